"""gguf: llama.cpp's GGUF files (`model.gguf`, or split `model-00001-of-00003.gguf` files).

I/O strategy: the header (version, metadata key-values, tensor infos) is parsed by the `gguf`
package's `GGUFReader`, which memory-maps the file and reads only the header pages; tensor data
is never touched by `inspect` or `verify`. Each tensor's absolute offset, byte length and type
come from the tensor infos, so an unquantized tensor (F32, F16, BF16, F64, I8-I64) is a raw
entry: `convert` copies its bytes straight into safetensors. GGUF lists dimensions fastest
first (`ne`); entries use the row-major shape torch and safetensors use (`ne` reversed), which
is what llama.cpp's own converters write. Quantized tensors (Q4_K, Q8_0, IQ...) are listed as
non-tensor entries named like their tensor, with their quantization type, shape and size:
`convert` reports them as skipped, never drops them silently; with `--dequantize` they are
written as gguf's `gguf.quants.dequantize` decodes them (`read_dequantized`).
A big-endian file's tensors are byte-swapped element by element as they stream (never copied
in the kernel), so every output holds the values `GGUFReader` reads; its quantized blocks are
served with their multi-byte fields swapped to little-endian (`BLOCK_FIELDS`), as llama.cpp on a
big-endian machine reads them.

Split files are one checkpoint, named by their folder or by any one of them: every
`-0000k-of-0000n.gguf` must be present and agree on `split.count`, and together hold
`split.tensors.count` tensors. Only local files are read
(GGUFReader needs a path).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import dtypes
from ...errors import FormatError, NotFoundError
from ...findings import problem_from_error
from ...models import Entry, FileInfo, Manifest, Problem, ProblemList
from ...storage.fileio import COPY_BLOCK
from ..base import NAMES_FIX, Checkpoint, Format, Source, leading_slab
from ..details import GgufDetails

if TYPE_CHECKING:
    import torch

SUFFIX = ".gguf"
#: missing split files named one by one; the rest are counted in one problem
MAX_MISSING_LISTED = 16
SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
#: GGML types stored as plain element arrays, and their canonical dtypes
PLAIN = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}
_CORRUPT_FIX = (
    "The file is corrupt or its writer is broken: download it again, or convert the model to "
    "GGUF again."
)
_SPLIT_SET_FIX = (
    "The split files come from different sets or one is cut short: download the whole set "
    "again into a folder of its own."
)
#: the fix of each problem a GGUF header check finds, by its code
PROBLEM_FIXES = {
    "truncated": "The file is cut short; download it again.",
    "missing_split": "Fetch the missing split file beside the others.",
    "misaligned_tensor": _CORRUPT_FIX,
    "overlapping_tensors": _CORRUPT_FIX,
    "duplicate_tensor": _CORRUPT_FIX,
    "too_many_dims": "llama.cpp cannot load the file as it is; the tensor is still readable: "
    "write it with at most 4 dimensions (fold the leading ones together) and keep its shape "
    "in the metadata, as ComfyUI-GGUF does, or convert it to another format.",
    "noncontiguous_tensors": "llama.cpp cannot load the file as it is; every tensor is still "
    "readable: rewrite it in order with the gguf package (`gguf-new-metadata IN.gguf OUT.gguf` "
    "copies the tensors one after another), or convert the model to GGUF again.",
    "split_count_mismatch": _SPLIT_SET_FIX,
    "split_number_mismatch": "The split files were renamed, or come from different sets: give "
    "each file the name its split.no says (split.no 0 is -00001-of-…), or download the whole set "
    "again into a folder of its own.",
    "split_tensor_count": _SPLIT_SET_FIX,
}
#: what `check` finds that `open` refuses too: the tensors' bytes cannot be told apart
#: (llama.cpp's loader refuses any tensor whose offset is not the end of the previous one,
#: aligned, and a name two split files hold; the gguf package's reader maps them as they lie)
_REFUSED = (
    "truncated",
    "missing_split",
    "overlapping_tensors",
    "misaligned_tensor",
    "duplicate_tensor",
)
_LLAMA_REFUSES = "; llama.cpp's loader refuses such a file"
#: stored bytes of a quantized tensor decoded at a time by `verify --deep`
_DECODE_BYTES = 1 << 20
#: longest metadata value inspect shows in full; longer arrays are summarised
MAX_SHOWN = 16


#: bytes of each fixed-size GGUF metadata value type (GGUFValueType); 8 is STRING, 9 ARRAY
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: arrays of arrays nest at most this deep (llama.cpp writes none)
_MAX_NESTING = 8
#: dimensions a tensor info may declare before ckpt refuses to read it (the gguf reader reads
#: any number)
_MAX_DIMS = 8
#: dimensions GGUF allows a tensor (ggml's GGML_MAX_DIMS): llama.cpp's loader refuses more
_GGML_MAX_DIMS = 4
#: metadata keys, strings, arrays, array items and tensor infos a header may hold: `GGUFReader`
#: builds about a kilobyte of objects for each (a Llama 3 tokenizer's 408,000 strings: ~690 MB;
#: with its token types, 536,000 pieces), so 3,000,000 empty strings in a 48 MB file took it past
#: 4 GB, and 5,000,000 floats in a 20 MB file 3.6 GB and 134 s
MAX_PIECES = 1_000_000
#: pieces a tensor info counts for: the reader builds about 5 KB of objects for each (its six
#: parts, a tensor and a view of its data): 200,000 empty tensors in a 7.7 MB file took 1.1 GB
#: and 49 s; the largest models hold about 20,000
TENSOR_INFO_PIECES = 6


class _Header:
    """A walk of a GGUF header over a memory map: every count and length is checked against the
    bytes left before anything is skipped or read, so no declaration chooses the work."""

    def __init__(self, data: Any, where: str):
        self.data = data
        self.pos = 0
        self.where = where
        self.order = "<"
        self.pieces = 0

    def piece(self, count: int = 1) -> None:
        """Count `count` pieces the `gguf` reader builds an object for (a key, a string, an
        array, an array item, a tensor info); FormatError past `MAX_PIECES`."""
        self.pieces += count
        if self.pieces > MAX_PIECES:
            raise FormatError(
                f"holds more than the {MAX_PIECES:,} pieces ckpt lets the gguf reader build "
                "(a metadata key, string, array or array item is one, about a kilobyte of "
                f"objects; a tensor info {TENSOR_INFO_PIECES}; the largest tokenizers hold about "
                "800,000); ckpt refuses it (a hostile or corrupt file)",
                path=self.where,
                fix="The file is corrupt or crafted; download it again from its source.",
            )

    def error(self, what: str) -> FormatError:
        return FormatError(
            f"is not a valid GGUF file: {what} (at byte {self.pos:,} of {len(self.data):,})",
            path=self.where,
            fix="The file is truncated or corrupt; download it again.",
        )

    def take(self, n: int, what: str) -> int:
        """Skip `n` bytes (FormatError when fewer are left); returns where they started."""
        if n < 0 or n > len(self.data) - self.pos:
            raise self.error(f"{what} of {n:,} bytes runs past the end of the file")
        start = self.pos
        self.pos += n
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(
            self.data[start : start + size], "little" if self.order == "<" else "big"
        )

    def count(self, what: str, least: int) -> int:
        """A u64 count of items each at least `least` bytes, checked against the bytes left."""
        n = self.uint(8, what)
        if n * least > len(self.data) - self.pos:
            raise self.error(
                f"{what} declares {n:,} items, more than the {len(self.data) - self.pos:,} bytes "
                "left can hold"
            )
        return n

    def string(self, what: str) -> str:
        """Skip a string; returns its first 200 characters (for messages)."""
        self.piece()
        n = self.uint(8, f"the length of {what}")
        start = self.take(n, what)
        return bytes(self.data[start : start + min(n, 200)]).decode("utf-8", "replace")

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        size = _VALUE_SIZES.get(kind)
        if size is not None:
            self.take(size, what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.error(f"{what} nests arrays more than {_MAX_NESTING} deep")
            self.piece()
            item = self.uint(4, f"the item type of {what}")
            least = _VALUE_SIZES.get(item, 8 if item == _STRING else 12)
            n = self.count(f"the array {what}", least)
            if item in _VALUE_SIZES:
                self.piece(n)  # the reader builds a view of each number too
                self.take(n * _VALUE_SIZES[item], what)
            else:
                for _ in range(n):
                    self.value(item, what, depth + 1)
        else:
            raise self.error(f"{what} has unknown value type {kind}")


@dataclass(frozen=True)
class HeaderFacts:
    """What `check_header` learned of a GGUF file besides that its header is sound.

    Attributes:
        big_endian: the file was written big-endian.
        version: the GGUF version (0 when the file is no GGUF file).
        past_end: (tensor name, end byte) of each tensor whose data the header places past
            the end of the file (a truncated download), in header order.
    """

    big_endian: bool = False
    version: int = 0
    past_end: list[tuple[str, int]] = field(default_factory=list)


#: GGUF versions the `gguf` package reads (its READER_SUPPORTED_VERSIONS)
_READ_VERSIONS = (2, 3)
#: a version above this is no version any writer wrote: the header is corrupt
_PLAUSIBLE_VERSION = 255
#: GGUFValueType.UINT32, the type `general.alignment` must have
_UINT32 = 4


def _sizes() -> dict[int, tuple[int, int]]:
    """GGML type code -> (elements per block, bytes per block), from the gguf package."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:  # pragma: no cover - declared in the gguf extra
        return {}
    return {int(kind): (int(block), int(size)) for kind, (block, size) in GGML_QUANT_SIZES.items()}


def check_header(path: str, where: str) -> HeaderFacts:
    """Walk a GGUF file's header (metadata and tensor infos) checking every count and length
    against the bytes left, before the `gguf` package's reader (which would build a 2^40-item
    array from a 51-byte file, or read past the end silently) sees it. FormatError naming
    `where` on the first that does not fit, on a version the reader cannot read and on an
    invalid `general.alignment`, each in its own words. Returns what else it learned (the
    byte order; tensors whose data lies past the end, which the reader cannot map)."""
    import mmap

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise FormatError(
                f"is not a valid GGUF file: {size} bytes, too short for a GGUF header",
                path=where,
                fix="The file is truncated or corrupt; download it again.",
            )
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            head = _Header(data, where)
            if head.uint(4, "the magic") != int.from_bytes(b"GGUF", "little"):
                # another kind of file read as GGUF (`--format gguf`), not a damaged one
                from ..sniff import SNIFF_BYTES, what_is

                raise FormatError(
                    f"is not a GGUF file: it is {what_is(bytes(data[:SNIFF_BYTES]), size)} (a "
                    "GGUF file starts with the magic 'GGUF')",
                    path=where,
                    fix="Check the path; if it is a checkpoint of another format, name it by "
                    "that format's suffix or pass --format.",
                )
            version = head.uint(4, "the version")
            if version & 0xFFFF == 0:  # written for the other byte order
                head.order = ">"
                version = int.from_bytes(version.to_bytes(4, "little"), "big")
            _check_version(version, head)
            tensors = head.uint(8, "the tensor count")
            kvs = head.count("the metadata", 8 + 4 + 1)
            alignment = 32
            for _ in range(kvs):
                key = head.string("a metadata key")
                kind = head.uint(4, f"the type of {key!r}")
                if key == "general.alignment":
                    alignment = _alignment(kind, head)
                    continue
                head.value(kind, f"metadata {key!r}")
            if tensors * (8 + 4 + 4 + 8) > size - head.pos:
                raise head.error(f"{tensors:,} tensor infos cannot fit in the bytes left")
            infos: list[tuple[str, int, int, int]] = []
            sizes = _sizes()
            for _ in range(tensors):
                head.piece(TENSOR_INFO_PIECES - 1)  # its name is one more
                name = head.string("a tensor name")
                dims = head.uint(4, "a tensor's dimension count")
                if dims > _MAX_DIMS:
                    raise head.error(f"a tensor with {dims:,} dimensions")
                numel = 1
                for _ in range(dims):
                    numel *= head.uint(8, "a tensor's dimension")
                kind = head.uint(4, "a tensor's type")
                if sizes and kind not in sizes:
                    raise _unknown_type(name, kind, where)
                infos.append((name, numel, kind, head.uint(8, "a tensor's offset")))
            start = -(-head.pos // alignment) * alignment
            past_end = []
            for name, numel, kind, offset in infos:
                block, nbytes = sizes.get(kind, (0, 0))
                end = start + offset + (numel // block * nbytes if block else 0)
                if end > size:
                    past_end.append((name, end))
            return HeaderFacts(big_endian=head.order == ">", version=version, past_end=past_end)


def _unknown_type(name: str, kind: int, where: str) -> FormatError:
    """The error for a tensor of a GGML type code the installed gguf package does not know:
    llama.cpp adds block types (MXFP4 came after gguf releases people still run), so the
    file may be sound and the package old; a fresh download is the same bytes."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("gguf")
    except PackageNotFoundError:  # pragma: no cover - declared in the gguf extra
        installed = "unknown version"
    return FormatError(
        f"tensor {name!r} is stored as GGML type {kind}, which the installed gguf package "
        f"({installed}) does not know: a block type newer than it, or a corrupt header",
        path=where,
        fix="Upgrade the gguf package (`pip install -U gguf`) and run again; if the type is "
        "still unknown, the file is corrupt: download it again.",
    )


def _check_version(version: int, head: _Header) -> None:
    """FormatError for a GGUF version the `gguf` package cannot read, in its own words."""
    try:
        from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

        readable = tuple(int(v) for v in READER_SUPPORTED_VERSIONS)
    except ImportError:  # pragma: no cover - declared in the gguf extra
        readable = _READ_VERSIONS
    if version in readable:
        return
    where, known = head.where, " and ".join(str(v) for v in readable)
    if version > _PLAUSIBLE_VERSION:
        raise head.error(f"its version field reads {version:,}, which no GGUF writer writes")
    if version < min(readable):
        raise FormatError(
            f"is a GGUF version {version} file, an early format ckpt (through the gguf "
            f"package) cannot read: it reads GGUF versions {known}",
            path=where,
            fix="Convert the model again with a current llama.cpp (convert_hf_to_gguf.py "
            "writes version 3); downloading this file again gives the same bytes.",
        )
    raise FormatError(
        f"is a GGUF version {version} file, newer than the installed gguf package reads "
        f"(versions {known})",
        path=where,
        fix="Upgrade the gguf package (`pip install -U gguf`); a release that reads GGUF "
        f"version {version} lets ckpt read it.",
    )


def _alignment(kind: int, head: _Header) -> int:
    """The value of `general.alignment` (at `head`, of value type `kind`): FormatError
    unless it is a uint32 power of two, which is what llama.cpp and the gguf package read."""
    if kind != _UINT32:
        head.value(kind, "metadata 'general.alignment'")
        raise FormatError(
            f"is not a valid GGUF file: general.alignment is stored as value type {kind}, "
            "not the uint32 GGUF requires",
            path=head.where,
            fix="The file's writer is broken; convert the model again with a current llama.cpp "
            "(the tensor data cannot be located without a valid alignment).",
        )
    value = head.uint(4, "metadata 'general.alignment'")
    if value <= 0 or value & (value - 1):
        raise FormatError(
            f"is not a valid GGUF file: general.alignment is {value}, not a power of two",
            path=head.where,
            fix="The file's writer is broken; convert the model again with a current llama.cpp "
            "(the tensor data cannot be located without a valid alignment).",
        )
    return value


def _reader(path: str, where: str | None = None) -> tuple[Any, HeaderFacts]:
    """The `gguf` package's reader of a checked file (None when tensors lie past its end:
    the reader cannot map them), and what the header check learned."""
    facts = check_header(path, where or path)
    if facts.past_end:
        return None, facts
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - declared in the gguf extra
        raise FormatError(
            "reading GGUF needs the gguf package",
            path=path,
            fix="pip install 'ckpt-cli[gguf]'",
        ) from None
    try:
        return GGUFReader(path, "r"), facts
    except Exception as exc:  # the reader raises bare ValueError / IndexError on bad headers
        raise FormatError(
            f"is not a readable GGUF file ({type(exc).__name__}: {str(exc)[:200]})",
            path=path,
            fix="The file is truncated or corrupt; download it again.",
        ) from None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    if len(field.types) > 1 and int(field.types[1]) == _ARRAY:
        # the gguf reader's `contents()` flattens an array of arrays into one list
        return _nested_value(field.parts, _FIELD_VALUE, _ARRAY)[0]
    try:
        return field.contents()
    except UnicodeDecodeError:  # a string (a byte token) that is not UTF-8
        return _undecodable_strings(field)
    except Exception:
        return None


#: the index of a reader field's first value part (after the key's length, the key, the type)
_FIELD_VALUE = 3


def _nested_value(parts: list[Any], index: int, kind: int) -> tuple[Any, int]:
    """The value of type `kind` whose parts start at `parts[index]` (a reader field's parts,
    in file order), and the index after them: arrays of arrays keep their nesting (the header
    walk bounded their depth and their items), strings that are not UTF-8 are escaped."""
    if kind == _STRING:  # the length, then the bytes
        return bytes(parts[index + 1]).decode("utf-8", "backslashreplace"), index + 2
    if kind != _ARRAY:
        return parts[index].tolist()[0], index + 1
    item, count = int(parts[index][0]), int(parts[index + 1][0])
    index += 2
    items = []
    for _ in range(count):
        value, index = _nested_value(parts, index, item)
        items.append(value)
    return items, index


def _undecodable_strings(field: Any) -> Any:
    """A string field's value, or a string array's, that is not all UTF-8: the bytes decoded
    with the undecodable ones escaped (`\\xff`), so they are shown and compared, never a
    null that equals any other; None for another kind of field."""
    types = [int(t) for t in field.types]

    def text(index: int) -> str:
        return bytes(field.parts[index]).decode("utf-8", "backslashreplace")

    if types == [_STRING]:
        return text(int(field.data[0]))
    if types == [_ARRAY, _STRING]:
        return [text(int(index)) for index in field.data]
    return None


@dataclass(frozen=True)
class _Parsed:
    """What an opened GGUF checkpoint keeps besides its manifest: the files written
    big-endian, the model's metadata as `diff` compares it (`_comparable`), and the problems
    found that leave every tensor readable (`GgufCheckpoint.tolerated`)."""

    big_endian: frozenset[str]
    metadata: dict[str, str]
    tolerated: list[Problem] = field(default_factory=list)


#: metadata keys about the files, not the model (a split set and its merged file differ there)
FILE_KEYS = ("split.", "general.alignment")
#: metadata values longer than this (as JSON) are compared by digest
MAX_COMPARED = 200


def _comparable(value: Any) -> str:
    """A metadata value as `diff` compares and shows it: its JSON text, or for a long one
    (a token list) its summary and a digest of the whole, so no difference hides in a
    summary and no report holds a vocabulary."""
    import hashlib
    import json

    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) <= MAX_COMPARED:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{_shown(value)} sha256:{digest}"


def _shown(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_SHOWN:
        kind = type(value[0]).__name__ if value else "value"
        return f"[{len(value)} × {kind}]"
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + "…"
    return value


def split_set(source: Source, target: str) -> list[str] | None:
    """The files of the split set `target` (one `-0000k-of-0000n.gguf` file) is part of that
    lie beside it, in order (a missing one is a problem `_split_problems` reports); None when
    `target` is no split file."""
    match = SPLIT.match(target.rsplit("/", 1)[-1])
    if match is None:
        return None
    folder = target.rsplit("/", 1)[0] + "/" if "/" in target else ""
    stem, count = f"{folder}{match.group('stem')}", int(match.group("count"))
    names = (f"{stem}-{no:05d}-of-{count:05d}{SUFFIX}" for no in range(1, count + 1))
    return [n for n in names if n == target or source.storage.exists(n)]


def _files(source: Source) -> list[str]:
    """The GGUF file(s) of the source: the target (with its split siblings), or the folder's."""
    if source.target is not None:
        return split_set(source, source.target) or [source.target]
    names = sorted(n for n in source.top_level() if n.endswith(SUFFIX))
    split = [n for n in names if SPLIT.match(n)]
    if len(names) > 1 and len(split) != len(names):
        raise FormatError(
            f"holds {len(names)} GGUF files that are not one split model",
            path=source.location.raw,
            fix=f"Point at one of them, e.g. {source.location.raw.rstrip('/')}/{names[0]}.",
        )
    sets: dict[tuple[str, str], list[str]] = {}
    for name in split:
        match = SPLIT.match(name)
        assert match is not None
        sets.setdefault((match.group("stem"), match.group("count")), []).append(name)
    if len(sets) > 1:
        stems = ", ".join(f"{stem}-*-of-{count}.gguf" for stem, count in sets)
        raise FormatError(
            f"holds {len(sets)} split GGUF sets ({stems}), not one split model",
            path=source.location.raw,
            fix="Point at one file of the set you mean, e.g. "
            f"{source.location.raw.rstrip('/')}/{next(iter(sets.values()))[0]}.",
        )
    return names


class GgufCheckpoint(Checkpoint):
    """An opened GGUF file or split set; unquantized tensors read as raw byte ranges.

    A file written big-endian (`GGUFWriter(endianess=BIG)`, for s390x) stores each element
    byte-swapped: its tensors are still served as raw little-endian C-order bytes (what
    safetensors and torch hold), swapped element by element as they stream, never copied
    as they lie in the file.
    """

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        big_endian: frozenset[str],
        metadata: dict[str, str] | None = None,
    ):
        super().__init__(source, manifest)
        self.big_endian = big_endian
        self.metadata = metadata or {}
        #: what `verify` reports that leaves every tensor readable (`noncontiguous_tensors`,
        #: `too_many_dims`: llama.cpp refuses the file); `inspect` and `convert` warn of it
        self.tolerated: list[Problem] = []
        #: quantized tensors of a big-endian file that decode non-finite read big-endian and
        #: cleanly as stored (`stored_nonfinite_cause`)
        self._little_endian_blocks: set[str] = set()
        #: `block_quantized`, once `read_dequantized` has asked
        self._block_quantized: dict[str, str | None] | None = None

    def tolerated_problems(self) -> list[Problem]:
        return list(self.tolerated)

    def model_metadata(self) -> dict[str, str] | None:
        return self.metadata

    def recorded_architecture(self) -> str | None:
        value = self.manifest.details.get("architecture")
        return str(value) if value is not None else ""

    def _swapped(self, entry: Entry) -> int:
        """The element size to byte-swap `entry`'s bytes by (0: stored little-endian)."""
        if entry.file not in self.big_endian or entry.kind != "tensor" or entry.dtype is None:
            return 0
        size = dtypes.itemsize(entry.dtype)
        return size if size > 1 else 0

    def read_tensor(self, name: str) -> torch.Tensor:
        from ...tensors import tensor_from_bytes

        entry = self.manifest.by_name.get(name)
        if entry is None:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            )
        if entry.kind != "tensor" or entry.file is None or entry.offset is None:
            raise _not_dequantized(name, entry, self.manifest.location)
        assert entry.dtype is not None
        data = self.storage.read(entry.file, entry.offset, entry.nbytes)
        size = self._swapped(entry)
        return tensor_from_bytes(byteswap(data, size) if size else data, entry.dtype, entry.shape)

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """A box of a tensor; a run of whole slices along dim 0 (one expert of a stack) reads
        only its own bytes, not the whole tensor's."""
        from ...tensors import tensor_from_bytes

        entry = self.manifest.by_name.get(name)
        slab = leading_slab(entry.shape, offsets, sizes) if entry is not None else None
        if entry is None or slab is None or entry.kind != "tensor" or entry.offset is None:
            return super().read_slice(name, offsets, sizes)
        assert entry.file is not None and entry.dtype is not None
        first, count = slab
        per = dtypes.numel(entry.shape[1:]) * dtypes.itemsize(entry.dtype)
        data = self.storage.read(entry.file, entry.offset + first * per, count * per)
        size = self._swapped(entry)
        shape = [count, *entry.shape[1:]]
        return tensor_from_bytes(byteswap(data, size) if size else data, entry.dtype, shape)

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        entry = self.manifest.by_name[name]
        size = self._swapped(entry)
        if not size:
            yield from super().iter_raw(name, block)
            return
        # whole elements per block, so each is swapped in one piece
        for data in super().iter_raw(name, max(block // size, 1) * size):
            yield byteswap(data, size)

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        if self._swapped(self.manifest.by_name[name]):
            return None  # the bytes in the file are not the C-order bytes: never copied as is
        return super().local_ranges(name)

    def _big_endian_blocks(self, entry: Entry) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """(block bytes, multi-byte fields) of a quantized tensor of a big-endian file whose
        block layout ckpt knows (`BLOCK_FIELDS`); None for any other entry."""
        if entry.file not in self.big_endian or entry.kind == "tensor":
            return None
        fields = BLOCK_FIELDS.get(entry.dtype or "")
        sizes = _sizes_by_name().get(entry.dtype or "")
        if fields is None or sizes is None:
            return None
        return sizes[1], fields

    def stored_as(self, name: str) -> str | None:
        entry = self.manifest.by_name.get(name)
        if entry is None or entry.kind == "tensor" or entry.offset is None:
            return None
        form = (entry.py_type or "").removeprefix("gguf ")
        if entry.file not in self.big_endian or self._big_endian_blocks(entry) is not None:
            return form  # served as little-endian blocks (`iter_stored`)
        return f"{form}, big-endian"

    def iter_stored(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        """The stored bytes of a quantized tensor; a big-endian file's blocks with their
        multi-byte fields (fp16 scales...) swapped to little-endian, as a little-endian file
        of the same model holds them, where ckpt knows the block layout."""
        entry = self.manifest.by_name[name]
        if self.stored_as(name) is None or entry.file is None or entry.offset is None:
            yield from super().iter_stored(name, block)
            return
        yield from self._iter_blocks(entry, block, 0, entry.nbytes)

    def _iter_blocks(self, entry: Entry, block: int, start: int, length: int) -> Iterator[bytes]:
        """`length` stored bytes of quantized `entry` from byte `start` (whole blocks), in
        pieces of about `block` bytes, a big-endian file's swapped as `iter_stored` says."""
        layout = self._big_endian_blocks(entry)
        if layout is not None:
            block = max(block // layout[0], 1) * layout[0]  # whole blocks, swapped in place
        for data in self._iter_as_stored(entry, block, start, length):
            yield data if layout is None else swap_block_fields(data, *layout)

    def stored_nonfinite(self, name: str) -> tuple[int, int, int, int] | None:
        entry = self.manifest.by_name[name]
        if self.stored_as(name) is None:
            return None
        if entry.file in self.big_endian and self._big_endian_blocks(entry) is None:
            return None  # gguf's dequantization reads little-endian blocks only
        found = self._decoded_counts(name, swapped=True)
        # more than one block's worth of NaN and Inf (damage hits a block; a 16-bit scale
        # read in the wrong byte order is NaN or Inf in one block of 32), none read as stored
        per_block = _sizes_by_name().get(entry.dtype or "", (0, 0))[0]
        if found is not None and found[2] + found[3] > per_block and self._big_endian_blocks(entry):
            as_stored = self._decoded_counts(name, swapped=False)
            if as_stored is not None and not (as_stored[2] or as_stored[3]):
                self._little_endian_blocks.add(name)
        return found

    def stored_nonfinite_cause(self, name: str) -> tuple[str, str] | None:
        if name not in self._little_endian_blocks:
            return None
        return (
            "its blocks' scales read big-endian, as llama.cpp on a big-endian machine reads "
            "this big-endian file; read little-endian they hold no NaN or Inf: the blocks were "
            "written little-endian into a big-endian file (the gguf package's "
            "GGUFWriter(endianess=BIG) on a little-endian machine copies quantized blocks as "
            "they are)",
            "Write the file little-endian and convert it with gguf's gguf_convert_endian.py "
            "(`gguf-convert-endian MODEL.gguf big`), which swaps the blocks' scales, or "
            "quantize on the big-endian machine itself.",
        )

    def block_quantized(self) -> dict[str, str | None]:
        """Every quantized tensor, and why gguf's dequantization cannot decode it: a type the
        installed gguf package does not decode (Q8_K...), or a big-endian file's blocks of a
        layout ckpt cannot swap (`BLOCK_FIELDS`), which would decode to wrong values."""
        found: dict[str, str | None] = {}
        for entry in self.manifest.entries:
            if entry.kind == "tensor" or not (entry.py_type or "").startswith("gguf "):
                continue
            qtype = entry.dtype or ""
            why = _undecodable(qtype)
            if why is None and (self.stored_as(entry.name) or "").endswith(", big-endian"):
                why = (
                    f"its {qtype} blocks are stored big-endian in a layout ckpt cannot swap "
                    "to the little-endian one gguf decodes"
                )
            found[entry.name] = why
        return found

    def read_dequantized(self, name: str, leading: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 values gguf's `gguf.quants.dequantize` gives for the tensor's blocks
        (a big-endian file's read little-endian, `iter_stored`), decoded a few MiB of blocks
        at a time into the one output tensor; with `leading` (first, count), only the blocks
        of those slices along dim 0 (one expert of a stack), when each is whole blocks."""
        import numpy as np
        import torch
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        entry = self.manifest.by_name.get(name)
        if self._block_quantized is None:
            self._block_quantized = self.block_quantized()
        why = self._block_quantized.get(name, "it is no quantized tensor")
        if entry is None or why is not None:
            raise FormatError(
                f"{name!r} cannot be dequantized: {why}",
                path=self.manifest.location,
                fix="Leave it out (--filter-out), or dequantize with llama.cpp's tools "
                "(`llama-quantize --allow-requantize SRC OUT F16`).",
            )
        kind = GGMLQuantizationType[entry.dtype or ""]
        per_block, type_size = GGML_QUANT_SIZES[kind]
        shape = list(entry.shape)
        start, length = 0, entry.nbytes
        per_slice = dtypes.numel(entry.shape[1:]) if entry.shape else 0
        if leading is not None and per_slice and per_slice % per_block == 0:
            blocks_per_slice = per_slice // per_block
            start = leading[0] * blocks_per_slice * type_size
            length = leading[1] * blocks_per_slice * type_size
            shape = [leading[1], *entry.shape[1:]]
        elif leading is not None:  # slices that split a block: decode it all, then cut
            whole = self.read_dequantized(name)
            return whole[leading[0] : leading[0] + leading[1]].clone()
        out = np.empty(dtypes.numel(shape), dtype=np.float32)
        step = max(_DECODE_BYTES // type_size, 1) * type_size
        done = 0
        for data in self._iter_blocks(entry, step, start, length):
            if len(data) % type_size:
                raise FormatError(
                    f"{name!r} ({entry.dtype}) ends inside a block",
                    path=self.manifest.location,
                    fix=PROBLEM_FIXES["truncated"],
                )
            blocks = np.frombuffer(data, dtype=np.uint8)
            count = len(data) // type_size * per_block
            with np.errstate(all="ignore"):  # NaN and Inf are judged below
                out[done : done + count] = dequantize(blocks, kind)
            done += count
        if entry.file in self.big_endian:
            self._refuse_little_endian_blocks(name, int((~np.isfinite(out)).sum()), per_block)
        return torch.from_numpy(out).reshape(shape)

    def _refuse_little_endian_blocks(self, name: str, nonfinite: int, per_block: int) -> None:
        """Refuse the values of a big-endian file's tensor whose blocks were written
        little-endian (`stored_nonfinite_cause`): more than one block's worth of NaN and Inf
        read big-endian, none read as stored. Written out, they would be garbage."""
        if nonfinite <= per_block:
            return
        as_stored = self._decoded_counts(name, swapped=False)
        if as_stored is None or as_stored[2] or as_stored[3]:
            return  # damaged either way: the values are what the file holds
        self._little_endian_blocks.add(name)
        cause = self.stored_nonfinite_cause(name)
        assert cause is not None
        raise FormatError(
            f"{name!r} decodes to {nonfinite} NaN and Inf values: {cause[0]}",
            path=self.manifest.location,
            fix=cause[1],
        )

    def _decoded_counts(self, name: str, *, swapped: bool) -> tuple[int, int, int, int] | None:
        """(bytes read, values, NaN, Inf) of quantized tensor `name` decoded block by block
        with gguf's dequantization; a big-endian file's blocks read swapped to little-endian
        (`iter_stored`) or, with `swapped` False, as they lie in the file."""
        entry = self.manifest.by_name[name]
        qtype = (entry.py_type or "").split()[1:2]
        try:
            import numpy as np
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
            from gguf.quants import dequantize

            kind = GGMLQuantizationType[qtype[0]]
            _, type_size = GGML_QUANT_SIZES[kind]
        except (ImportError, KeyError, IndexError):
            return None
        read = values = nan = inf = 0
        # whole blocks at a time, a few MiB of float32 each
        step = max(_DECODE_BYTES // type_size, 1) * type_size
        blocks = self.iter_stored(name, step) if swapped else self._iter_as_stored(entry, step)
        for data in blocks:
            read += len(data)
            cut = len(data) - len(data) % type_size
            if not cut:
                continue
            try:
                with np.errstate(all="ignore"):  # NaN and Inf are what is counted
                    decoded = dequantize(np.frombuffer(data, dtype=np.uint8, count=cut), kind)
            except NotImplementedError:  # a type gguf's numpy code cannot decode
                return None
            values += decoded.size
            nan += int(np.isnan(decoded).sum())
            inf += int(np.isinf(decoded).sum())
        return read, values, nan, inf

    def _iter_as_stored(
        self, entry: Entry, block: int, start: int = 0, length: int | None = None
    ) -> Iterator[bytes]:
        """Entry's bytes as they lie in its file (`length` of them from byte `start`; all by
        default), in blocks of `block` bytes."""
        assert entry.file is not None and entry.offset is not None
        end = entry.nbytes if length is None else start + length
        done = start
        while done < end:
            n = min(block, end - done)
            yield self.storage.read(entry.file, entry.offset + done, n)
            done += n

    def read_object(self, name: str) -> Any:
        entry = self.manifest.by_name.get(name)
        if entry is None:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            )
        if entry.kind == "tensor":
            return self.read_tensor(name)
        raise _not_dequantized(name, entry, self.manifest.location)


def _not_dequantized(name: str, entry: Entry, where: str) -> FormatError:
    return FormatError(
        f"{name!r} is a quantized GGUF tensor ({entry.py_type}), read only dequantized",
        path=where,
        fix="Pass --dequantize (convert, diff), or leave it out (--filter-out).",
    )


def byteswap(data: bytes, size: int) -> bytes:
    """`data` with each `size`-byte element's bytes reversed (big- <-> little-endian)."""
    import numpy as np

    return np.frombuffer(data, dtype=f"<u{size}").byteswap().tobytes()


#: the multi-byte fields, (offset, bytes), of each quantized block type whose layout ckpt knows
#: (ggml's `block_q8_0`... structs): a big-endian GGUF holds them big-endian, as llama.cpp on
#: s390x reads them natively and gguf's gguf_convert_endian.py writes them (it swaps the fp16
#: fields of Q4_0, Q8_0, Q4_K and Q6_K); the rest of a block is bytes, or packed bits. Q5_0 and
#: Q5_1 keep their fifth bits as a 32-bit word (ggml copies it with memcpy). A type not here
#: (IQ2_XS's 16-bit grid indices...) is compared as stored and not decoded.
BLOCK_FIELDS: dict[str, tuple[tuple[int, int], ...]] = {
    "Q4_0": ((0, 2),),
    "Q4_1": ((0, 2), (2, 2)),
    "Q5_0": ((0, 2), (2, 4)),
    "Q5_1": ((0, 2), (2, 2), (4, 4)),
    "Q8_0": ((0, 2),),
    "Q2_K": ((80, 2), (82, 2)),
    "Q3_K": ((108, 2),),
    "Q4_K": ((0, 2), (2, 2)),
    "Q5_K": ((0, 2), (2, 2)),
    "Q6_K": ((208, 2),),
    "MXFP4": (),
}


def _sizes_by_name() -> dict[str, tuple[int, int]]:
    """GGML type name -> (elements per block, bytes per block), from the gguf package."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:  # pragma: no cover - declared in the gguf extra
        return {}
    return {kind.name: (int(n), int(size)) for kind, (n, size) in GGML_QUANT_SIZES.items()}


def swap_block_fields(data: bytes, block: int, fields: tuple[tuple[int, int], ...]) -> bytes:
    """`data` (whole `block`-byte quantized blocks, a partial one last left as it is) with each
    block's `fields` byte-reversed (big- <-> little-endian)."""
    import numpy as np

    whole = len(data) - len(data) % block
    if not fields or not whole:
        return data
    blocks = np.frombuffer(data, dtype=np.uint8, count=whole).reshape(-1, block).copy()
    for start, size in fields:
        blocks[:, start : start + size] = blocks[:, start : start + size][:, ::-1]
    return blocks.tobytes() + data[whole:]


@functools.cache
def _undecodable(qtype: str) -> str | None:
    """Why gguf's dequantization cannot decode GGML type `qtype` (None: it can)."""
    try:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:  # pragma: no cover - declared in the gguf extra
        return "the gguf package is not installed"
    kind = GGMLQuantizationType.__members__.get(qtype)
    if kind is None:
        return f"the installed gguf package does not know the type {qtype}"
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)
    except NotImplementedError:
        return f"the installed gguf package does not dequantize {qtype}"
    return None


def skip_reason(entry: Entry) -> str | None:
    """Why convert leaves a GGUF entry out (quantized tensors), for its report."""
    if entry.py_type and entry.py_type.startswith("gguf "):
        return f"{entry.py_type.removeprefix('gguf ')}: quantized; --dequantize writes it"
    return None


class GgufFormat(Format):
    """GGUF files, read through the `gguf` package (metadata, tensor infos, raw tensor ranges)."""

    name = "gguf"
    title = "GGUF"
    details_model = GgufDetails
    self_described = True
    flat_names = True
    skip_reason = staticmethod(skip_reason)

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            return source.target.endswith(SUFFIX)
        names = source.top_level()
        return any(n.endswith(SUFFIX) for n in names) and not any(
            n.endswith((".safetensors", ".metadata", ".distcp", ".bin", ".pt")) for n in names
        )

    @classmethod
    def checkpoint_source(cls, source: Source) -> Source:
        """One file of a split set names the whole set: every file of it is checked."""
        members = split_set(source, source.target) if source.target is not None else None
        if members is None:
            return source
        return Source(
            location=source.location,
            storage=source.storage,
            target=source.target,
            origin=source.origin,
            members=tuple(members),
        )

    @classmethod
    def _parse(cls, source: Source) -> tuple[Manifest, list[Problem], _Parsed]:
        """The manifest, the problems found, and what the checkpoint keeps besides."""
        files = _files(source)
        where = source.location.raw
        if not files:
            raise NotFoundError(
                "holds no .gguf file",
                path=where,
                fix="Check the path, or leave -f/--format out to detect the format.",
            )
        problems: list[Problem] = ProblemList()
        entries: list[Entry] = []
        infos: list[FileInfo] = []
        kv: dict[str, Any] = {}
        quant: Counter[str] = Counter()
        split_count: int | None = None
        split_tensors: int | None = None
        version = None
        big_endian: set[str] = set()
        compared: dict[str, str] = {}
        numbers: dict[str, int | None] = {}  # each file's split.no
        counts: dict[str, int] = {}  # each file's split.count
        #: what llama.cpp refuses but leaves every tensor readable (out of order, gaps, 5-D)
        tolerated: list[Problem] = []
        for rel in files:
            local = source.storage.local_path(rel)
            if local is None:
                raise FormatError(
                    "GGUF files are read from local disk only",
                    path=source.storage.describe(rel),
                    fix="Copy the file to local disk first (from the Hub: `hf download REPO "
                    "FILE`; from an object store, its own copy command) and run ckpt on the copy.",
                )
            described = source.storage.describe(rel)
            reader, facts = _reader(str(local), described)
            size = source.storage.size(rel)
            if reader is None:  # tensors past the end: the file is cut short
                version = facts.version
                for name, end in facts.past_end:
                    problems.append(_truncated(described, name, end, size))
                infos.append(FileInfo(path=rel, size=size, entries=0))
                continue
            version = _field(reader, "GGUF.version")
            if facts.big_endian:
                big_endian.add(rel)
            for key in reader.fields:
                if not key.startswith("GGUF.") and key not in kv:
                    value = _field(reader, key)
                    kv[key] = _shown(value)
                    if not key.startswith(FILE_KEYS):
                        compared[key] = _comparable(value)
            number = _field(reader, "split.no")
            numbers[rel] = number if isinstance(number, int) else None
            count = _field(reader, "split.count")
            if isinstance(count, int):
                counts[rel] = count
                # llama.cpp takes the count from the first file
                split_count = count if split_count is None else split_count
                total = _field(reader, "split.tensors.count")
                split_tensors = total if isinstance(total, int) else split_tensors
            alignment = _field(reader, "general.alignment")
            alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
            spans: list[tuple[int, int, str]] = []
            for tensor in reader.tensors:
                qtype = tensor.tensor_type.name
                shape = [int(d) for d in reversed(list(tensor.shape))]
                why = dtypes.shape_problem(shape)
                if why is not None:
                    raise FormatError(
                        f"tensor {tensor.name!r} has shape {shape} ({why})",
                        path=described,
                        fix="The file is corrupt; download it again.",
                    )
                nbytes = int(tensor.n_bytes)
                offset = int(tensor.data_offset)
                spans.append((offset, offset + nbytes, tensor.name))
                if offset % alignment:
                    problems.append(
                        Problem(
                            code="misaligned_tensor",
                            message=f"{described}: tensor {tensor.name!r} starts at {offset}, "
                            f"not a multiple of the alignment {alignment}{_LLAMA_REFUSES}",
                            file=described,
                            tensor=tensor.name,
                            fix=PROBLEM_FIXES["misaligned_tensor"],
                        )
                    )
                if offset + nbytes > size:
                    problems.append(_truncated(described, tensor.name, offset + nbytes, size))
                quant[qtype] += 1
                dtype = PLAIN.get(qtype)
                if dtype is not None:
                    entries.append(
                        Entry(
                            name=tensor.name,
                            kind="tensor",
                            dtype=dtype,
                            shape=shape,
                            nbytes=nbytes,
                            file=rel,
                            offset=offset,
                        )
                    )
                else:
                    entries.append(
                        Entry(
                            name=tensor.name,
                            kind="object",
                            dtype=qtype,
                            shape=shape,
                            nbytes=nbytes,
                            file=rel,
                            offset=offset,
                            py_type=f"gguf {qtype} tensor {shape}",
                        )
                    )
            for tensor in reader.tensors:
                dims = len(tensor.shape)
                if dims > _GGML_MAX_DIMS:
                    tolerated.append(
                        Problem(
                            code="too_many_dims",
                            message=f"{described}: tensor {tensor.name!r} has {dims} dimensions, "
                            f"more than the {_GGML_MAX_DIMS} GGUF allows; llama.cpp's loader "
                            "refuses such a file, the gguf package reads it",
                            file=described,
                            tensor=tensor.name,
                            fix=PROBLEM_FIXES["too_many_dims"],
                        )
                    )
            broken = any(p.file == described for p in problems)
            if not broken:  # a tensor past the end or misaligned says more
                tolerated.extend(_out_of_order(reader, alignment, described))
            spans.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(spans):
                if start < end:
                    problems.append(
                        Problem(
                            code="overlapping_tensors",
                            message=f"{described}: tensors {a!r} and {b!r} overlap (both hold "
                            f"the bytes from offset {start:,}){_LLAMA_REFUSES}",
                            file=described,
                            tensor=b,
                            fix=PROBLEM_FIXES["overlapping_tensors"],
                        )
                    )
                    tolerated = [p for p in tolerated if p.file != described]
            infos.append(FileInfo(path=rel, size=size, entries=len(reader.tensors)))
        if split_count is not None or any(SPLIT.match(f.rsplit("/", 1)[-1]) for f in files):
            problems.extend(_split_problems(source, files, counts, split_tensors, entries))
            problems.extend(_split_numbers(source, numbers))
        seen: dict[str, str] = {}  # tensor name -> the file holding it first
        for entry in entries:
            first = seen.get(entry.name)
            if first is not None:
                files_named = (
                    f"in {first}" if first == entry.file else f"in {first} and {entry.file}"
                )
                problems.append(
                    Problem(
                        code="duplicate_tensor",
                        message=f"{where}: tensor {entry.name!r} is stored twice ({files_named}), "
                        f"which copy is the tensor cannot be told{_LLAMA_REFUSES}",
                        file=where,
                        tensor=entry.name,
                        fix=PROBLEM_FIXES["duplicate_tensor"],
                    )
                )
            seen.setdefault(entry.name, entry.file or where)
        architecture = kv.get("general.architecture")
        details = GgufDetails(
            gguf_version=version,
            architecture=None if architecture is None else str(architecture),
            tensor_types=dict(sorted(quant.items())),
            metadata=kv,
        )
        if split_count is not None:
            details.split = {"count": split_count, "files": len(files)}
        if big_endian:
            details.byte_order = "big" if len(big_endian) == len(files) else "mixed"
        manifest = Manifest(
            format="gguf",
            location=where,
            files=infos,
            entries=entries,
            details=details.as_details(),
        )
        problems.extend(tolerated)
        return manifest, problems, _Parsed(frozenset(big_endian), compared, tolerated)

    @classmethod
    def open(cls, source: Source) -> GgufCheckpoint:
        """The checkpoint; FormatError for what `check` calls a broken layout (a tensor past
        the end, a missing split, tensors that overlap or break the alignment): llama.cpp's
        loader refuses those files, and a tensor's bytes there are not its own."""
        manifest, problems, parsed = cls._parse(source)
        errors = [p for p in problems if p.code in _REFUSED]
        if errors:
            first = errors[0]
            message = first.message.removeprefix(f"{first.file}: ")  # the path leads anyway
            raise FormatError(message, path=first.file, fix=first.fix)
        checkpoint = GgufCheckpoint(source, manifest, parsed.big_endian, parsed.metadata)
        checkpoint.tolerated = parsed.tolerated
        return checkpoint

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        """Headers parse; every tensor lies inside its file, aligned, without overlaps; every
        split file is present and the splits agree."""
        try:
            _, problems, _ = cls._parse(source)
        except (FormatError, NotFoundError) as error:
            return [problem_from_error(error)]
        return problems


def _out_of_order(reader: Any, alignment: int, where: str) -> list[Problem]:
    """`noncontiguous_tensors` for the first tensor of a file whose data does not start where
    llama.cpp's loader expects it: ggml's gguf.cpp requires each tensor's offset (relative to
    the data section) to be the sum of the sizes, each padded to the alignment, of the tensors
    listed before it, and refuses the file otherwise ("tensor 'x' has offset N, expected M").
    Tensors out of order and gaps between them break that rule; overlaps and misalignment,
    reported on their own, too."""
    expected = 0
    for tensor in reader.tensors:
        offset = int(tensor.data_offset) - int(reader.data_offset)
        if offset != expected:
            return [
                Problem(
                    code="noncontiguous_tensors",
                    message=f"{where}: tensor {tensor.name!r} lies at data offset {offset:,}, "
                    f"where llama.cpp's loader expects {expected:,}: the tensors' data is "
                    "out of order or has gaps (each tensor must follow the one listed before "
                    f"it, padded to the alignment {alignment}); "
                    "llama.cpp's loader refuses such a file, the gguf package reads it",
                    file=where,
                    tensor=tensor.name,
                    fix=PROBLEM_FIXES["noncontiguous_tensors"],
                )
            ]
        expected += -(-int(tensor.n_bytes) // alignment) * alignment
    return []


def _truncated(file: str, name: str, end: int, size: int) -> Problem:
    return Problem(
        code="truncated",
        message=f"{file}: tensor {name!r} ends at byte {end:,}, past the end of the file "
        f"({size:,} bytes)",
        file=file,
        tensor=name,
        fix=PROBLEM_FIXES["truncated"],
    )


def _split_numbers(source: Source, numbers: dict[str, int | None]) -> list[Problem]:
    """`split_number_mismatch` for each split file whose `split.no` is not its place in the
    set, as its name gives it: llama.cpp's loader opens `-0000k-of-` as split k-1, refuses a
    file whose `split.no` says otherwise ("invalid split file idx"; one with none past the
    first, "missing key split.no"), and reads the model's metadata from the first file."""
    problems: list[Problem] = []
    for rel, number in numbers.items():
        match = SPLIT.match(rel.rsplit("/", 1)[-1])
        if match is None:
            continue
        place = int(match.group("no"))
        if number is None and place == 1:
            continue  # llama.cpp takes a first file without split.no as split 0
        if number == place - 1:
            continue
        where = source.storage.describe(rel)
        said = "has no split.no" if number is None else f"split.no is {number}"
        problems.append(
            Problem(
                code="split_number_mismatch",
                message=f"{where}: {said}, but its name makes it split {place} "
                f"(split.no {place - 1}); llama.cpp's loader refuses the set",
                file=where,
                fix=PROBLEM_FIXES["split_number_mismatch"],
            )
        )
    return problems


def _split_problems(
    source: Source,
    files: list[str],
    counts: dict[str, int],
    tensors: int | None,
    entries: list[Entry],
) -> list[Problem]:
    problems: list[Problem] = []
    where = source.location.raw
    first = SPLIT.match(files[0].rsplit("/", 1)[-1]) if files else None
    if first is None:
        return problems
    # the file names (five digits: at most 99,999 splits) say how many splits there are; the
    # header's `split.count` only confirms it: a 176-byte file saying 10**9 built a billion
    # names (gigabytes, minutes)
    named = int(first.group("count"))
    for rel, count in counts.items():  # each file's: llama.cpp reads the first file's
        if count != named:
            described = source.storage.describe(rel) if len(files) > 1 else where
            problems.append(
                Problem(
                    code="split_count_mismatch",
                    message=f"{described}: split.count says {count}, the file names say {named}",
                    file=described,
                    fix=PROBLEM_FIXES["split_count_mismatch"],
                )
            )
    expected = named
    folder = files[0].rsplit("/", 1)[0] + "/" if "/" in files[0] else ""
    held = set(files)
    missing = [
        rel
        for rel in (
            f"{folder}{first.group('stem')}-{no:05d}-of-{expected:05d}.gguf"
            for no in range(1, expected + 1)
        )
        if rel not in held
    ]
    for rel in missing[:MAX_MISSING_LISTED]:
        problems.append(
            Problem(
                code="missing_split",
                message=f"{where}: split file {rel.rsplit('/', 1)[-1]} of {expected} is missing",
                file=source.storage.describe(rel),
                fix=PROBLEM_FIXES["missing_split"],
            )
        )
    if len(missing) > MAX_MISSING_LISTED:
        problems.append(
            Problem(
                code="missing_split",
                message=f"{where}: {len(missing) - MAX_MISSING_LISTED} more of the {expected} "
                "split files are missing",
                file=where,
                fix=PROBLEM_FIXES["missing_split"],
            )
        )
    if tensors is not None and not problems and len(entries) != tensors:
        problems.append(
            Problem(
                code="split_tensor_count",
                message=f"{where}: the splits hold {len(entries)} tensors, "
                f"split.tensors.count says {tensors}",
                file=where,
                fix=PROBLEM_FIXES["split_tensor_count"],
            )
        )
    return problems
