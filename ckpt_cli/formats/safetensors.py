"""safetensors: one file, or shards plus a `*.safetensors.index.json`.

I/O strategy: `open` reads only the 8-byte length and the JSON header of each shard (two
small reads per file; no torch import), validating every offset against the file size. Tensor
reads are one `preadv` into a fresh tensor's memory (local) or one ranged read (remote). Raw
byte ranges are exposed so copies skip deserialisation. The writer lays out every shard's
header from the plan up front, then streams tensor bytes in order; the index is written last.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import dtypes
from ..errors import CkptError, FormatError, NotFoundError
from ..models import Entry, FileInfo, Manifest, Problem
from ..storage import LocalStorage, Storage, safe_relpath
from .base import Checkpoint, FileRange, Format, Source, WriteOptions, Writer

if TYPE_CHECKING:
    import torch

INDEX_SUFFIX = ".safetensors.index.json"
#: a weight variant's index as diffusers names it (`….safetensors.index.fp16.json`)
VARIANT_INDEX = re.compile(r"[^/]+\.safetensors\.index\.[\w-]+\.json")
#: per-rank files of torch DCP's `HuggingFaceStorageWriter(save_distributed=True)`: the same
#: tensor names in every file (chunks of one tensor), so the folder is read as `dcp`
DCP_HF_SHARD = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
#: no sane header is this large; a bigger length field is corruption or an attack
MAX_HEADER = 100 << 20
_PROBE = 64 << 10


def is_dcp_hf_sharded(names: list[str]) -> bool:
    """Whether top-level `names` are the per-rank shards of DCP's HuggingFaceStorageWriter."""
    shards = [n for n in names if n.endswith(".safetensors")]
    return (
        bool(shards)
        and all(DCP_HF_SHARD.match(n) for n in shards)
        and not any(n.endswith(INDEX_SUFFIX) for n in names)
    )


def _stem_of_index(name: str) -> str:
    base = Path(name).name
    variant = VARIANT_INDEX.fullmatch(base)
    if variant and not base.endswith(INDEX_SUFFIX):
        # `diffusion_pytorch_model.safetensors.index.fp16.json` indexes `…model.fp16-0000k-of-…`
        stem, _, rest = base.partition(".safetensors.index.")
        return f"{stem}.{rest.removesuffix('.json')}"
    return base[: -len(INDEX_SUFFIX)]


class SafetensorsHeader:
    """A parsed, validated safetensors header.

    Attributes:
        file: path relative to the checkpoint root.
        size: file size in bytes.
        data_start: absolute offset of the data section.
        tensors: name -> (dtype, shape, begin, end) with offsets relative to `data_start`,
            in file order.
        metadata: the `__metadata__` strings.
        rejected: names of header entries that failed validation (only when collecting).
        unsupported: name -> dtype code of tensors whose dtype this tool does not know; a
            strict read leaves them out and goes on with the rest (`Manifest.details`).
        tolerated: what a strict read found that readers tolerate (data gaps, trailing bytes),
            as the collecting parse reports it.
    """

    def __init__(
        self,
        file: str,
        size: int,
        data_start: int,
        tensors: dict[str, Any],
        metadata: dict[str, str],
    ):
        self.file = file
        self.size = size
        self.data_start = data_start
        self.tensors = tensors
        self.metadata = metadata
        self.rejected: set[str] = set()
        self.unsupported: dict[str, str] = {}
        self.tolerated: list[Problem] = []


class Findings:
    """Where header and index validation sends what it finds.

    Strict findings (`strict=True`, what `open` uses) raise the first flaw as a FormatError;
    collecting findings (what `check` uses) record every flaw as a `Problem` and let the
    validation carry on, so `ckpt verify` reports all of them. Some flaws (data gaps, trailing
    bytes) do not stop a reader and are only looked for when collecting (`thorough`).
    """

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.problems: list[Problem] = []

    @property
    def thorough(self) -> bool:
        """Whether checks beyond what reading needs should run."""
        return not self.strict

    def add(
        self,
        code: str,
        problem: str,
        *,
        file: str,
        tensor: str | None = None,
        fix: str | None = None,
        severity: Literal["error", "warning"] = "error",
    ) -> None:
        """Record one flaw of `file` (a display path), or raise it when strict."""
        if self.strict:
            raise FormatError(problem, path=file, fix=fix)
        error = FormatError(problem, path=file, fix=fix)
        self.problems.append(
            Problem(code=code, message=error.message, file=file, tensor=tensor, severity=severity)
        )


def read_header(storage: Storage, rel: str, size: int | None = None) -> SafetensorsHeader:
    """Read and validate one safetensors header (FormatError naming the file on any flaw)."""
    header = parse_header(storage, rel, size, Findings(strict=True))
    assert header is not None  # strict findings raise instead
    return header


def parse_header(
    storage: Storage, rel: str, size: int | None, findings: Findings
) -> SafetensorsHeader | None:
    """Parse one safetensors header, sending every flaw to `findings`.

    Returns the header with the tensors that passed validation, or None when the header
    cannot be parsed at all (too short, bad length, not JSON).
    """
    where = storage.describe(rel)
    size = storage.size(rel) if size is None else size
    if size < 8:
        from ..sniff import what_is

        kind = what_is(storage.read(rel, 0, size) if size else b"", size)
        findings.add(
            "truncated",
            f"is {size} bytes long, too short to be a safetensors file: it is {kind}",
            file=where,
            fix="The file is truncated or not safetensors; write or fetch it again.",
        )
        return None
    # remote storages may ask for a smaller first read (bytes cost more than a round trip there)
    probe = getattr(storage, "header_probe", _PROBE)
    head = storage.read(rel, 0, min(size, probe))
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER and head[8:9] != b"{":
        from ..sniff import what_is

        # not a damaged safetensors file but another kind of file under a safetensors name
        findings.add(
            "bad_header",
            f"is not a safetensors file: it is {what_is(head, size)} (a safetensors file "
            "starts with an 8-byte header length, then a JSON header)",
            file=where,
            fix="Check the path; if it is a checkpoint of another format, name it by that "
            "format's suffix or pass --format.",
        )
        return None
    if header_len > MAX_HEADER or header_len > size - 8:
        findings.add(
            "truncated" if header_len <= MAX_HEADER else "bad_header",
            f"declares a {header_len}-byte header but the file is {size} bytes"
            if header_len <= MAX_HEADER
            else f"declares an absurd {header_len}-byte header",
            file=where,
            fix="The file is truncated or corrupt; write or fetch it again.",
        )
        return None
    raw = head[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += storage.read(rel, 8 + len(raw), header_len - len(raw))
    duplicates: list[tuple[str, frozenset[str]]] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json.loads keeps the last of two equal keys, as the reference library does; the
        # spec forbids them, and two readers could then disagree on what a file holds
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                duplicates.append((key, frozenset(k for k, _ in pairs)))
            seen.add(key)
        return dict(pairs)

    try:
        header = json.loads(raw, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        findings.add("bad_header", f"has a header that is not valid JSON ({exc})", file=where)
        return None
    except RecursionError:
        findings.add("bad_header", "has a header nested too deeply to be read", file=where)
        return None
    if not isinstance(header, dict):
        findings.add("bad_header", "has a header that is not a JSON object", file=where)
        return None
    meta_keys = header.get("__metadata__")
    for key, keys in duplicates:
        if keys == frozenset(header):
            place = "the header names" if key != "__metadata__" else "the header has"
            what = f"{place} {key!r} twice"
        elif isinstance(meta_keys, dict) and keys == frozenset(meta_keys):
            what = f"__metadata__ has the key {key!r} twice"
        else:
            what = f"a header entry has the field {key!r} twice"
        findings.add(
            "duplicate_key",
            f"{what}; safetensors forbids duplicate keys (readers disagree on which one counts)",
            file=where,
            tensor=key if keys == frozenset(header) else None,
            fix="The file is corrupt or crafted; write it again with a safetensors writer.",
        )
    data_start = 8 + header_len
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        findings.add(
            "bad_header", "has __metadata__ that is not a string-to-string map", file=where
        )
        metadata = {}
    tensors: dict[str, tuple[str, list[int], int, int]] = {}
    rejected: set[str] = set()
    unsupported: dict[str, str] = {}
    placed: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        unknown = _unknown_dtype(info, data_size)
        if unknown is not None and findings.strict:
            # one tensor of a dtype this tool does not know must not make the whole file
            # unreadable: leave it out, keep its bytes in the overlap check, say so
            unsupported[name] = unknown[0]
            placed[name] = unknown
            continue
        valid = _validate_tensor(name, info, data_size, where, findings)
        if valid is not None:
            tensors[name] = valid
            placed[name] = valid
        else:
            rejected.add(name)
            if unknown is not None:
                placed[name] = unknown
    if unsupported and not tensors:
        name, code = next(iter(unsupported.items()))
        findings.add(
            "unknown_dtype",
            f"tensor {name!r} has unknown dtype {code!r}, and no tensor of the file has a "
            "dtype this tool reads",
            file=where,
            tensor=name,
            fix="Upgrade ckpt if this is a new dtype; otherwise the header is corrupt.",
        )
    order = sorted(placed.items(), key=lambda kv: kv[1][2])
    previous_end, previous_name = 0, None
    # flaws a reader tolerates (gaps, trailing bytes) are only reported when collecting, but
    # a strict read notes them too, at no extra cost, so `inspect` need not parse again
    tolerated = findings if findings.thorough else Findings(strict=False)
    for name, (_, _, begin, end) in order:
        if begin < previous_end:
            findings.add(
                "overlap",
                f"tensor {name!r} overlaps {previous_name!r} (bytes {begin}..{end} start before {previous_end})",
                file=where,
                tensor=name,
                fix="The header is corrupt or hostile; do not use this file.",
            )
        elif begin > previous_end:
            tolerated.add(
                "gap",
                f"has {begin - previous_end} unused bytes before tensor {name!r} (bytes "
                f"{previous_end}..{begin}); safetensors requires contiguous data",
                file=where,
                tensor=name,
                fix="The header is corrupt; safetensors' own loader refuses this file.",
            )
        if end > previous_end:
            previous_end, previous_name = end, name
    if not rejected and previous_end < data_size:
        tolerated.add(
            "trailing_bytes",
            f"has {data_size - previous_end} bytes after the last tensor's data (the header "
            f"accounts for {data_start + previous_end} of {size} bytes)",
            file=where,
            fix="Trailing garbage: the file was appended to or overwritten in place; write it again.",
        )
    parsed = SafetensorsHeader(
        rel, size, data_start, {n: v for n, v in order if n in tensors}, metadata
    )
    parsed.rejected = rejected
    parsed.unsupported = unsupported
    parsed.tolerated = [] if tolerated is findings else tolerated.problems
    return parsed


def _unknown_dtype(info: Any, data_size: int) -> tuple[str, list[int], int, int] | None:
    """(code, shape, begin, end) of a well-formed entry whose dtype code is unknown, else None."""
    if not isinstance(info, dict):
        return None
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or dtypes.from_safetensors(code) is not None:
        return None
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return None
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1] <= data_size
    ):
        return None
    return code, shape, offsets[0], offsets[1]


def _validate_tensor(
    name: str, info: Any, data_size: int, where: str, findings: Findings
) -> tuple[str, list[int], int, int] | None:
    if not isinstance(info, dict):
        findings.add(
            "bad_header", f"tensor {name!r} has a malformed header entry", file=where, tensor=name
        )
        return None
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = dtypes.from_safetensors(code) if isinstance(code, str) else None
    if dtype is None:
        findings.add(
            "unknown_dtype",
            f"tensor {name!r} has unknown dtype {code!r}",
            file=where,
            tensor=name,
            fix="Upgrade ckpt if this is a new dtype; otherwise the header is corrupt.",
        )
        return None
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        findings.add(
            "bad_header", f"tensor {name!r} has an invalid shape {shape!r}", file=where, tensor=name
        )
        return None
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        findings.add(
            "bad_header",
            f"tensor {name!r} has invalid data_offsets {offsets!r}",
            file=where,
            tensor=name,
        )
        return None
    begin, end = offsets
    expected = dtypes.storage_nbytes(dtype, shape)
    if expected is None:
        findings.add(
            "misaligned",
            f"tensor {name!r} is {code}{shape}: {dtypes.numel(shape)} values of "
            f"{dtypes.bitsize(dtype)} bits do not end on a byte boundary",
            file=where,
            tensor=name,
            fix="safetensors refuses such a tensor; the header is corrupt or the writer is broken.",
        )
        return None
    if end - begin != expected:
        findings.add(
            "size_mismatch",
            f"tensor {name!r} is {dtype}{shape} ({expected} bytes) but its data_offsets span {end - begin} bytes",
            file=where,
            tensor=name,
            fix="The header is corrupt; write or fetch the file again.",
        )
        return None
    if end > data_size:
        findings.add(
            "truncated",
            f"tensor {name!r} ends at byte {end} of the data section, past its end ({data_size} bytes)",
            file=where,
            tensor=name,
            fix="The file is truncated; write or fetch it again.",
        )
        return None
    return dtype, shape, begin, end


def read_index(storage: Storage, rel: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Read a weight-map index (`*.safetensors.index.json`, `*.bin.index.json`).

    Returns (tensor name -> shard path relative to the root, each checked by `safe_relpath`;
    the index's `metadata`).
    """
    where = storage.describe(rel)
    try:
        index = json.loads(storage.read_all(rel))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # too deep: hostile
        raise FormatError(
            f"is not valid JSON ({exc})", path=where, fix="Write or fetch the index again."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FormatError("has no valid weight_map (tensor name -> shard file)", path=where)
    base = posixpath_dir(rel)
    # thousands of tensors share a few shard names: check each name once
    resolved = {
        shard: _join(base, safe_relpath(shard, source=where)) for shard in set(weight_map.values())
    }
    safe = {name: resolved[shard] for name, shard in weight_map.items()}
    metadata = index.get("metadata") or {}
    return safe, metadata if isinstance(metadata, dict) else {}


def posixpath_dir(rel: str) -> str:
    """The folder part of a relative POSIX path ('' for a top-level file)."""
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _join(base: str, rel: str) -> str:
    return f"{base}/{rel}" if base else rel


def find_index(source: Source, suffix: str = INDEX_SUFFIX, kind: str = "safetensors") -> str | None:
    """The weight-map index to use: the target if it is one, else the single one in the root.

    Shared with the torch adapter (`suffix=".bin.index.json"`), whose indexes have the same shape.
    """
    if source.target is not None:
        if suffix == INDEX_SUFFIX and VARIANT_INDEX.fullmatch(source.target):
            return source.target
        return source.target if source.target.endswith(suffix) else None
    indexes = sorted(n for n in source.top_level() if n.endswith(suffix))
    if not indexes and suffix == INDEX_SUFFIX:
        # diffusers spells a variant's index `diffusion_pytorch_model.safetensors.index.fp16.json`
        indexes = sorted(n for n in source.top_level() if VARIANT_INDEX.fullmatch(n))
    if len(indexes) > 1:
        raise FormatError(
            f"holds several {kind} indexes ({', '.join(indexes)})",
            path=source.location.raw,
            fix=f"Point at the index you mean, e.g. {source.location.raw.rstrip('/')}/{indexes[0]}.",
        )
    return indexes[0] if indexes else None


class SafetensorsFormat(Format):
    """The safetensors format (single file or sharded with an index)."""

    name = "safetensors"
    title = "safetensors"
    writable = True
    single_file_suffixes = (".safetensors",)
    index_suffix = INDEX_SUFFIX
    shards_by_size = True
    dedupes_tied = True  # safetensors refuses shared storage: tied names become aliases
    string_metadata = True
    required_metadata: ClassVar[dict[str, str]] = {
        "format": "pt"
    }  # transformers loads a file only with format=pt
    shard_names = staticmethod(lambda basename, count: shard_names(basename, count))
    planned_size = staticmethod(
        lambda entries, metadata: (
            len(encode_header(entries, metadata)) + sum(e.nbytes for e in entries)
        )
    )

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            return source.target.endswith((".safetensors", INDEX_SUFFIX))
        names = source.top_level()
        if is_dcp_hf_sharded(names):
            return False
        return any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in names)

    @classmethod
    def open(cls, source: Source) -> SafetensorsCheckpoint:
        storage = source.storage
        index_rel = find_index(source)
        index_meta: dict[str, Any] = {}
        weight_map: dict[str, str] | None = None
        if index_rel is not None:
            weight_map, index_meta = read_index(storage, index_rel)
            shards = sorted(set(weight_map.values()))
            listing = storage.list_files() if source.target is not None else source.files
            for shard in shards:
                if shard not in listing and not storage.exists(shard):
                    raise NotFoundError(
                        f"the index names shard {shard!r}, which is missing",
                        path=storage.describe(index_rel),
                        fix="Fetch or copy the missing shard; `ckpt verify` lists every problem.",
                    )
            sizes = {shard: listing.get(shard) for shard in shards}
        elif source.target is not None:
            shards = [source.target]
            sizes = {source.target: source.files[source.target]}
        else:
            shards = [n for n in source.top_level() if n.endswith(".safetensors")]
            sizes = {n: source.files[n] for n in shards}
        headers = [read_header(storage, shard, sizes.get(shard)) for shard in shards]
        return SafetensorsCheckpoint.from_headers(
            source, headers, index_rel, weight_map, index_meta
        )

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        """Every structural problem: headers, offsets, file sizes, and index against shards."""
        findings = Findings(strict=False)
        storage = source.storage
        try:
            index_rel = find_index(source)
        except CkptError as error:
            return [problem_from_error(error)]
        weight_map: dict[str, str] | None = None
        index_meta: dict[str, Any] = {}
        if index_rel is not None:
            try:
                weight_map, index_meta = read_index(storage, index_rel)
            except CkptError as error:
                findings.problems.append(problem_from_error(error, code="bad_index"))
        # a single shard needs no listing of its folder (a run folder of 10,000 files would
        # list it once per file); an index given as the target needs its siblings
        listing = storage.list_files() if index_rel is not None else source.files
        top_shards = [n for n in listing if "/" not in n and n.endswith(".safetensors")]
        strays: list[str] = []
        if weight_map is not None:
            assert index_rel is not None
            named = set(weight_map.values())
            siblings = _same_save(index_rel, named)
            # an unnamed shard that belongs to the same save (same name and count) is checked
            # like the others, so tensors in it show up as "not in the index"
            unnamed = [n for n in top_shards if n not in named]
            shards = sorted(named | {n for n in unnamed if siblings(n)})
            strays = [n for n in unnamed if not siblings(n)]
        elif source.target is not None and index_rel is None:
            shards = [source.target]
        else:
            shards = top_shards
        headers: dict[str, SafetensorsHeader] = {}
        for shard in shards:
            if shard not in listing:
                assert index_rel is not None and weight_map is not None
                names = sorted(n for n, s in weight_map.items() if s == shard)
                findings.add(
                    "missing_shard",
                    f"is missing; the index {index_rel} maps {len(names)} tensors to it "
                    f"({_some(names)})",
                    file=storage.describe(shard),
                    fix="Fetch or copy the missing shard again.",
                )
                continue
            try:
                header = parse_header(storage, shard, listing[shard], findings)
            except CkptError as error:
                findings.problems.append(problem_from_error(error))
                continue
            if header is not None:
                headers[shard] = header
        found: dict[str, list[str]] = {}
        for shard, header in headers.items():
            for name in header.tensors:
                found.setdefault(name, []).append(shard)
        for name, where in found.items():
            if len(where) > 1:
                findings.add(
                    "duplicate_tensor",
                    f"tensor {name!r} is stored in {len(where)} shards ({', '.join(where)})",
                    file=storage.describe(where[1]),
                    tensor=name,
                    fix="The checkpoint mixes two saves; write it again.",
                )
        if index_rel is not None and weight_map is not None:
            _check_index(findings, source, index_rel, weight_map, index_meta, headers, found)
            for shard in strays:
                findings.add(
                    "unreferenced_shard",
                    f"is not named by {index_rel} (a leftover of another save?)",
                    file=storage.describe(shard),
                    severity="warning",
                    fix="Remove it, or check that the index is the right one.",
                )
        return findings.problems

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> Writer:
        return SafetensorsWriter(staging, plan, options)


def problem_from_error(error: CkptError, code: str | None = None) -> Problem:
    """A `Problem` carrying what an exception said."""
    return Problem(code=code or error.code, message=error.message, file=error.path)


def _same_save(index_rel: str, named: set[str]) -> Callable[[str], bool]:
    """Whether a shard name follows the naming of the index's own shards (`stem-i-of-N`)."""
    stem = re.escape(_stem_of_index(index_rel))
    pattern = re.compile(rf"^{stem}-\d{{5}}-of-(\d{{5}})\.safetensors$")
    counts = {m.group(1) for m in map(pattern.match, named) if m}

    def belongs(name: str) -> bool:
        match = pattern.match(name)
        return bool(match and match.group(1) in counts)

    return belongs


def _some(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_index(
    findings: Findings,
    source: Source,
    index_rel: str,
    weight_map: dict[str, str],
    index_meta: dict[str, Any],
    headers: dict[str, SafetensorsHeader],
    found: dict[str, list[str]],
) -> None:
    """The index against the shard headers: every entry where it says, every tensor indexed."""
    storage = source.storage
    index_where = storage.describe(index_rel)
    for name, shard in weight_map.items():
        header = headers.get(shard)
        if header is None or name in header.tensors or name in header.rejected:
            continue  # a missing or unreadable shard, or a bad entry, is reported already
        elsewhere = found.get(name)
        if elsewhere:
            findings.add(
                "wrong_shard",
                f"maps tensor {name!r} to {shard}, but it is stored in {', '.join(elsewhere)}",
                file=index_where,
                tensor=name,
                fix="The index does not belong to these shards; write the checkpoint again.",
            )
        else:
            findings.add(
                "missing_tensor",
                f"maps tensor {name!r} to {shard}, which does not hold it (no shard does)",
                file=index_where,
                tensor=name,
                fix="The shard is from another save or incomplete; write the checkpoint again.",
            )
    for name, shards in found.items():
        if name not in weight_map:
            findings.add(
                "not_in_index",
                f"holds tensor {name!r}, which the index {index_rel} does not list",
                file=storage.describe(shards[0]),
                tensor=name,
                fix="Loaders that follow the index will not load it; write the checkpoint again.",
            )
    total = index_meta.get("total_size")
    if total is None:
        return
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        findings.add(
            "bad_index",
            f"has metadata.total_size {total!r}, which is not a byte count",
            file=index_where,
        )
        return
    complete = all(s in headers and not headers[s].rejected for s in set(weight_map.values()))
    actual = sum(end - begin for h in headers.values() for (_, _, begin, end) in h.tensors.values())
    if complete and total != actual:
        # huggingface_hub/transformers sum the tensors' *storage* sizes, which exceed the tensor
        # bytes when a saved tensor was a view; loaders ignore the field, so this only warns
        findings.add(
            "total_size",
            f"says metadata.total_size is {total} bytes but the shards hold {actual} bytes of tensors",
            file=index_where,
            severity="warning",
            fix="Harmless for loading; rewrite the index if tools rely on it.",
        )


class SafetensorsCheckpoint(Checkpoint):
    """An opened safetensors checkpoint."""

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        headers: list[SafetensorsHeader],
        index: str | None,
    ):
        super().__init__(source, manifest)
        self.headers = headers
        self.index = index
        self._fds: dict[str, int] = {}

    @classmethod
    def from_headers(
        cls,
        source: Source,
        headers: list[SafetensorsHeader],
        index_rel: str | None,
        weight_map: dict[str, str] | None,
        index_meta: dict[str, Any],
    ) -> SafetensorsCheckpoint:
        """Build the manifest from validated headers (entries in shard, then file, order)."""
        entries: list[Entry] = []
        files: list[FileInfo] = []
        seen: set[str] = set()
        for header in headers:
            for name, (dtype, shape, begin, end) in header.tensors.items():
                if name in seen:
                    raise FormatError(
                        f"tensor {name!r} appears in more than one shard",
                        path=source.storage.describe(header.file),
                        fix="The checkpoint is inconsistent; `ckpt verify` lists every problem.",
                    )
                seen.add(name)
                entries.append(
                    Entry.trusted(
                        name, dtype, shape, end - begin, header.file, header.data_start + begin
                    )
                )
            files.append(FileInfo(path=header.file, size=header.size, entries=len(header.tensors)))
        if index_rel is not None:
            files.insert(
                0, FileInfo(path=index_rel, size=source.storage.size(index_rel), entries=0)
            )
        details: dict[str, Any] = {"sharded": index_rel is not None}
        unsupported = {n: c for h in headers for n, c in h.unsupported.items()}
        if unsupported:
            details["unsupported_tensors"] = unsupported
        if index_rel is not None:
            details["index"] = index_rel
            details["weight_map_size"] = len(weight_map or {})
            if "total_size" in index_meta:
                details["total_size"] = index_meta["total_size"]
        manifest = Manifest(
            format="safetensors",
            location=source.location.raw,
            files=files,
            entries=entries,
            metadata=headers[0].metadata if headers else {},
            details=details,
        )
        return cls(source, manifest, headers, index_rel)

    def read_tensor(self, name: str) -> torch.Tensor:
        from ..tensors import read_tensor_from_fd, tensor_from_bytes

        entry = self._entry(name)
        assert entry.file is not None and entry.offset is not None and entry.dtype is not None
        storage = self.storage
        if isinstance(storage, LocalStorage):
            fd = self._fds.get(entry.file)
            if fd is None:
                fd = self._fds[entry.file] = os.open(storage.path(entry.file), os.O_RDONLY)
            return read_tensor_from_fd(
                fd, entry.offset, entry.dtype, entry.shape, storage.describe(entry.file)
            )
        data = storage.read(entry.file, entry.offset, entry.nbytes)
        return tensor_from_bytes(data, entry.dtype, entry.shape)

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """A box of tensor `name`; a run of whole rows (dim-0 split) reads only its bytes."""
        from ..tensors import read_tensor_from_fd, tensor_from_bytes

        entry = self._entry(name)
        shape = list(entry.shape)
        if (
            not shape
            or list(sizes[1:]) != shape[1:]
            or any(offsets[1:])
            or entry.offset is None
            or entry.file is None
            or entry.dtype is None
        ):
            return super().read_slice(name, offsets, sizes)
        if dtypes.torch_layout(entry.dtype, shape) != (entry.dtype, shape):
            return super().read_slice(name, offsets, sizes)  # sub-byte: whole rows of packed bits
        row = dtypes.numel(shape[1:]) * dtypes.itemsize(entry.dtype)
        start = entry.offset + offsets[0] * row
        storage = self.storage
        if isinstance(storage, LocalStorage):
            fd = self._fds.get(entry.file)
            if fd is None:
                fd = self._fds[entry.file] = os.open(storage.path(entry.file), os.O_RDONLY)
            return read_tensor_from_fd(
                fd, start, entry.dtype, list(sizes), storage.describe(entry.file)
            )
        data = storage.read(entry.file, start, sizes[0] * row)
        return tensor_from_bytes(data, entry.dtype, list(sizes))

    def _entry(self, name: str) -> Entry:
        try:
            return self.manifest.by_name[name]
        except KeyError:
            raise NotFoundError(f"no tensor named {name!r}", path=self.manifest.location) from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def plan_shards(
    plan: list[Entry], max_shard_size: int | None, together: list[list[str]] | None = None
) -> list[list[Entry]]:
    """Group entries, in order, into shards of at most `max_shard_size` bytes.

    A tensor larger than the limit gets a shard of its own; `None` means one shard.
    `together` names groups (a quantized weight and its scales) that must share a shard:
    consecutive members of a group are placed as one unit.
    """
    if not max_shard_size:
        return [list(plan)]
    group_of = {name: i for i, names in enumerate(together or []) for name in names}
    units: list[list[Entry]] = []
    for entry in plan:
        group = group_of.get(entry.name)
        if units and group is not None and group_of.get(units[-1][-1].name) == group:
            units[-1].append(entry)
        else:
            units.append([entry])
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for unit in units:
        unit_size = sum(e.nbytes for e in unit)
        if current and size + unit_size > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(basename: str, count: int) -> list[str]:
    """Hugging Face shard names: `model.safetensors`, or `model-00001-of-00003.safetensors`..."""
    if count == 1:
        return [f"{basename}.safetensors"]
    return [f"{basename}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def encode_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus the JSON header for `entries` laid out contiguously, padded to 8."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for entry in entries:
        assert entry.dtype is not None
        shape = list(entry.shape)
        if entry.dtype == "float4_e2m1fn_x2" and shape:
            # safetensors counts F4 in 4-bit values: torch's packed pairs are twice as many
            shape[-1] *= 2
        header[entry.name] = {
            "dtype": dtypes.to_safetensors(entry.dtype),
            "shape": shape,
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter(Writer):
    """Streams tensors into safetensors shards laid out from the plan; index last."""

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        super().__init__(staging, plan, options)
        objects = [e.name for e in plan if e.kind != "tensor"]
        if objects:
            raise FormatError(
                f"safetensors holds tensors only; {len(objects)} non-tensor entries were planned",
                fix="Exclude them (the convert operation reports them as skipped).",
            )
        unstorable = [e.name for e in plan if e.dtype and not dtypes.has_safetensors_code(e.dtype)]
        if unstorable:
            first = next(e for e in plan if e.name == unstorable[0])
            raise FormatError(
                f"safetensors has no dtype code for {first.dtype} (tensor {first.name!r}"
                + (f" and {len(unstorable) - 1} more" if len(unstorable) > 1 else "")
                + ")",
                fix="Leave them out with --exclude, or convert to dcp or torch, which keep them.",
            )
        self.metadata = dict(options.metadata)
        self.basename = options.basename or "model"
        self.groups = plan_shards(plan, options.max_shard_size, options.extra.get("together"))
        if options.single_file and len(self.groups) > 1:
            raise FormatError("a single-file destination cannot be split into shards")
        self.names = shard_names(self.basename, len(self.groups))
        self._where: dict[str, int] = {}
        self._positions: dict[str, int] = {}
        for index, group in enumerate(self.groups):
            for position, entry in enumerate(group):
                self._where[entry.name] = index
                self._positions[entry.name] = position
        self._order = [e.name for e in plan]
        #: shard indices this writer writes (all of them unless `restrict`ed)
        self._owned = set(range(len(self.groups)))
        self._next = 0
        self._fh: Any = None
        self._shard = -1
        self._written: list[FileInfo] = []

    def _shard_metadata(self, shard: int) -> dict[str, str]:
        """The string metadata of one shard. A carried `DCP_SHARDING_INFO` (torch's
        HuggingFaceStorageWriter output) is rewritten per shard for the tensors it holds, whole
        tensors at offset 0, so torch's HuggingFaceStorageReader reads every output shard."""
        if "DCP_SHARDING_INFO" not in self.metadata:
            return self.metadata
        info = {e.name: {"saved_offsets": [0] * len(e.shape)} for e in self.groups[shard]}
        return {**self.metadata, "DCP_SHARDING_INFO": json.dumps(info)}

    @property
    def accepts_raw(self) -> bool:
        return True

    @property
    def splittable(self) -> bool:
        return True

    def output_files(self) -> dict[str, int]:
        return {
            name: sum(e.nbytes for e in group)
            for name, group in zip(self.names, self.groups, strict=True)
        }

    def restrict(self, files: Collection[str]) -> None:
        if self._next:
            raise RuntimeError("restrict() after entries were written")
        wanted = set(files)
        self._owned = {i for i, name in enumerate(self.names) if name in wanted}
        self._order = [e.name for e in self.plan if self._where[e.name] in self._owned]

    def wants(self, name: str) -> bool:
        return self._where.get(name) in self._owned

    def _advance(self, name: str) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise RuntimeError(f"writer got {name!r} out of plan order (expected {expected!r})")
        self._next += 1
        shard = self._where[name]
        if self._shard != shard:
            self._open_shard(shard)

    def _open_shard(self, shard: int) -> None:
        self._close_shard()
        self._shard = shard
        # shards stay open across write calls: the writer streams one tensor at a time
        self._fh = open(self.staging / self.names[shard], "wb")
        self._fh.write(encode_header(self.groups[shard], self._shard_metadata(shard)))

    def _close_shard(self) -> None:
        if self._fh is None:
            return
        # fsync is deferred to `finish`: an fsync per shard makes the copy wait for the disk
        # after every shard, while syncing them all at the end lets write-back overlap the
        # copy (measured on 2 GB: 3.9-7 s with an fsync per shard, 1.9 s at the end, the
        # same as `cp && sync`)
        self._fh.flush()
        size = self._fh.tell()
        self._fh.close()
        self._fh = None
        self._written.append(
            FileInfo(path=self.names[self._shard], size=size, entries=len(self.groups[self._shard]))
        )

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        from ..tensors import tensor_bytes

        self._advance(name)
        data = tensor_bytes(tensor)
        expected = self.groups[self._shard][self._positions[name]].nbytes
        if len(data) != expected:
            raise RuntimeError(f"tensor {name!r} has {len(data)} bytes, the plan said {expected}")
        self._fh.write(data)

    def write_raw(self, name: str, blocks: Iterator[bytes]) -> None:
        self._advance(name)
        if isinstance(blocks, FileRange):
            # a local source range: copied in the kernel, past Python's buffer
            self._fh.flush()
            position = self._fh.tell()
            self._fh.seek(position + blocks.copy_to(self._fh.fileno(), position))
            return
        for block in blocks:
            self._fh.write(block)

    def finish(self) -> list[FileInfo]:
        return self.commit([self.finish_part()])

    def finish_part(self) -> dict[str, Any]:
        if self._next != len(self._order):
            raise RuntimeError(f"writer finished after {self._next} of {len(self._order)} entries")
        # shards with no entries (an empty plan) still get their header written
        opened = {info.path for info in self._written}
        if self._fh is not None:
            opened.add(self.names[self._shard])
        for shard in sorted(self._owned):
            if self.names[shard] not in opened:
                self._open_shard(shard)
        self._close_shard()
        for info in self._written:
            fd = os.open(self.staging / info.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return {"files": [info.model_dump(mode="json") for info in self._written]}

    def commit(self, parts: list[dict[str, Any]]) -> list[FileInfo]:
        by_name = {
            info["path"]: FileInfo.model_validate(info) for part in parts for info in part["files"]
        }
        missing = [name for name in self.names if name not in by_name]
        if missing:
            raise RuntimeError(f"no rank wrote the shards {', '.join(missing[:3])}")
        written = [by_name[name] for name in self.names]
        if len(self.groups) > 1:
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in self.plan)},
                "weight_map": {name: self.names[self._where[name]] for name in sorted(self._where)},
            }
            # a naming convention may spell the index itself (diffusers variants)
            index_name = self.options.extra.get("index_name") or f"{self.basename}{INDEX_SUFFIX}"
            data = (json.dumps(index, indent=2) + "\n").encode()
            with open(self.staging / index_name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            written.insert(0, FileInfo(path=index_name, size=len(data), entries=0))
        return written
