"""The safetensors header codec: parse and validate a header, build one for a plan.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets; an optional `__metadata__` string map), then the data. Parsing reads
only the length and the header (two small reads; no torch import) and validates every entry
against the file size; the same parse either raises the first flaw (`read_header`, what opening
uses) or collects every flaw as a `Problem` (`parse_header` with collecting findings, what
`ckpt verify` uses). Shared by the safetensors format, DCP's safetensors serialization and the
Hub download.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ... import dtypes
from ...dtypes import MAX_DIM, MAX_NDIM
from ...findings import Findings
from ...models import Entry, Problem
from ...storage import Storage
from ..weight_map import stem_of_index

#: no sane header is this large; a bigger length field is corruption or an attack
MAX_HEADER = 100 << 20
#: a validated header entry: (dtype token, shape, begin, end), offsets relative to the data
TensorInfo = tuple[str, list[int], int, int]
#: the fix of a header ckpt cannot read as safetensors describes it
CORRUPT_HEADER = "The header is corrupt or not safetensors; write or fetch the file again."


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
        tensors: dict[str, TensorInfo],
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


#: bytes a header entry takes besides its name, about (a large tensor's:
#: `"":{"dtype":"BF16","shape":[7168,2048],"data_offsets":[1234567890,1246201090]},`)
ENTRY_BYTES = 80
#: what the rest of a header takes, about: the `__metadata__`, braces and padding
HEADER_EXTRA = 256


def prefetch_headers(
    storage: Storage, shards: Iterable[str], weight_map: Mapping[str, str] | None = None
) -> None:
    """Let a remote storage fetch the header of every shard at once, before they are parsed
    one by one (`Storage.prefetch_heads`); with an index, each header's size is guessed from
    the names it lists, so that a large header (DeepSeek-V3's are about 60 KiB) is fetched in
    one request."""
    if storage.local_root is not None:
        return  # a local storage fetches nothing ahead (`Storage.prefetch_heads`): no guesses
    guess = dict.fromkeys(shards, 0)
    if weight_map:
        for name, shard in weight_map.items():
            if shard in guess:
                guess[shard] += len(name) + ENTRY_BYTES
        guess = {shard: 8 + n + HEADER_EXTRA if n else 0 for shard, n in guess.items()}
    storage.prefetch_heads(guess)


#: a header takes about this many times the bytes its shard's lines take in the index (an
#: index line is the name and the shard's file name, a header entry the name, dtype, shape and
#: offsets: Llama's and DeepSeek-V3's names give 1.4 to 1.5)
HEADER_PER_INDEX_BYTE = 1.5
#: no header size guessed from an index is larger (a one-shard save of a large index would
#: otherwise read megabytes of tensor data with its header)
HEADER_GUESS_MAX = 4 << 20


def prefetch_numbered_shards(storage: Storage, index_rel: str, listing: Mapping[str, int]) -> None:
    """Let a remote storage fetch the headers of an index's shards while the index itself is
    fetched and parsed: the shards are read off the listing, the whole numbered set of the
    index's naming (`model-00001-of-00163.safetensors` ... `-00163-of-00163`), and each
    header's size is guessed from the index's size, shared evenly. Parsing DeepSeek-V3's 8 MB
    index takes longer than a round trip; the headers no longer wait for it (#30).

    Nothing is fetched for a local storage, for a listing without the index, or for shards
    that are not one complete numbered set (strays of another save would be fetched for
    nothing): `prefetch_headers`, with the index parsed, fetches those."""
    if storage.local_root is not None or index_rel not in listing:
        return
    stem, suffix = stem_of_index(index_rel)
    folder = index_rel.rpartition("/")[0]
    prefix = f"{folder}/{stem}" if folder else stem
    numbered = re.compile(rf"{re.escape(prefix)}-(\d+)-of-(\d+){re.escape(suffix)}")
    found: dict[int, str] = {}
    totals: set[int] = set()
    for name in listing:
        match = numbered.fullmatch(name)
        if match is not None:
            found[int(match[1])] = name
            totals.add(int(match[2]))
    if len(totals) != 1 or sorted(found) != list(range(1, totals.pop() + 1)):
        return
    per_shard = int(listing[index_rel] / len(found) * HEADER_PER_INDEX_BYTE) + HEADER_EXTRA
    per_shard = min(per_shard, HEADER_GUESS_MAX)
    storage.prefetch_heads(dict.fromkeys(found.values(), per_shard))


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
    raw = _read_raw(storage, rel, size, where, findings)
    if raw is None:
        return None
    header = _decode(raw, where, findings)
    if header is None:
        return None
    data_start = 8 + len(raw)
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        findings.add(
            "bad_header",
            "has __metadata__ that is not a string-to-string map",
            file=where,
            fix=CORRUPT_HEADER,
        )
        metadata = {}
    tensors, rejected, unsupported, placed, ordered = _entries(header, data_size, where, findings)
    # writers lay the data out in header order: then the header's order is the data's
    order = list(placed.items())
    if not ordered:
        order.sort(key=_data_begin)
    # flaws a reader tolerates (gaps, trailing bytes) are only reported when collecting, but
    # a strict read notes them too, at no extra cost, so `inspect` need not parse again
    tolerated = findings if findings.thorough else Findings(strict=False)
    _check_layout(order, data_start, data_size, not rejected, where, findings, tolerated)
    # every placed tensor is a valid one in data order already (the common case): no copy
    in_order = tensors if ordered and len(tensors) == len(placed) else None
    if in_order is None:
        in_order = {n: v for n, v in order if n in tensors}
    parsed = SafetensorsHeader(rel, size, data_start, in_order, metadata)
    parsed.rejected = rejected
    parsed.unsupported = unsupported
    parsed.tolerated = [] if tolerated is findings else tolerated.problems
    return parsed


def _read_raw(
    storage: Storage, rel: str, size: int, where: str, findings: Findings
) -> bytes | None:
    """The JSON header's bytes, after checking the length field against the file size."""
    if size < 8:
        from ..sniff import what_is

        # on this machine a size of 0 may be a FIFO or a device, whose open says what it is
        opened = size or storage.local_root is not None
        kind = what_is(storage.read(rel, 0, size) if opened else b"", size)
        findings.add(
            "truncated",
            f"is {size} bytes long, too short to be a safetensors file: it is {kind}",
            file=where,
            fix="The file is truncated or not safetensors; write or fetch it again.",
        )
        return None
    # remote storages may ask for a smaller first read (bytes cost more than a round trip there)
    head = storage.read(rel, 0, max(8, storage.header_read(rel, size)))
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
    return raw


#: the end of a key written with whitespace before its colon (`"name" : {...}`)
_SPACED_KEY_END = re.compile(rb'"[ \t\r\n]+:')
_QUOTE_SPACE = (b'" ', b'"\t', b'"\r', b'"\n')


def _decode(raw: bytes, where: str, findings: Findings) -> dict[str, Any] | None:
    """The header as a JSON object; duplicate keys are reported (the spec forbids them).

    A plain `json.loads` reads it; the duplicate-key hook parses again only when a count of
    the raw key ends (a quote then a colon: at least one per key written) disagrees with the
    keys parsed, so a clean header costs one parse and two scans of its bytes.
    """
    header = _json_object(raw, where, findings)
    if header is None:
        return None
    if _keys_accounted(raw, header):
        return header
    return _decode_checked(raw, where, findings)


def _json_object(
    raw: bytes,
    where: str,
    findings: Findings,
    pairs_hook: Callable[[list[tuple[str, Any]]], dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """`raw` parsed as a JSON object, or None with a `bad_header` finding."""
    if not _plain_utf8(raw):
        # `json.loads(bytes)` guesses the encoding: it would read a UTF-16 or UTF-32 header,
        # or one after a byte-order mark, that the safetensors library refuses (its header
        # is UTF-8 JSON that starts at the first byte)
        findings.add(
            "bad_header",
            "has a header that is not plain UTF-8 JSON (it starts with a byte-order mark, or "
            "is in UTF-16 or UTF-32): the safetensors library refuses it",
            file=where,
            fix=CORRUPT_HEADER,
        )
        return None
    try:
        header = json.loads(raw, object_pairs_hook=pairs_hook)
    # ValueError: JSONDecodeError, and an integer past Python's 4,300 digits
    except (UnicodeDecodeError, ValueError) as exc:
        findings.add(
            "bad_header",
            f"has a header that is not valid JSON ({exc})",
            file=where,
            fix=CORRUPT_HEADER,
        )
        return None
    except RecursionError:
        findings.add(
            "bad_header",
            "has a header nested too deeply to be read",
            file=where,
            fix=CORRUPT_HEADER,
        )
        return None
    if not isinstance(header, dict):
        findings.add(
            "bad_header", "has a header that is not a JSON object", file=where, fix=CORRUPT_HEADER
        )
        return None
    if _SURROGATE_ESCAPE.search(raw) is not None and not _is_utf8(header):
        # `"\ud800"` parses in Python to a string no UTF-8 can hold: the safetensors library
        # refuses the header, and such a name broke every output written with it
        findings.add(
            "bad_header",
            "has a header with an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is "
            "not valid UTF-8: the safetensors library refuses it",
            file=where,
            fix=CORRUPT_HEADER,
        )
        return None
    return header


def _plain_utf8(raw: bytes) -> bool:
    """Whether `raw` is what `json.loads` reads as UTF-8 with no byte-order mark.

    Only the first bytes decide which encoding `json.loads` guesses (a mark, or a zero byte
    among the first four); invalid UTF-8 further on is its own `UnicodeDecodeError`.
    """
    return not raw.startswith(b"\xef\xbb\xbf") and b"\0" not in raw[:4]


#: a JSON escape of a UTF-16 surrogate; only a header holding one is checked further
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _is_utf8(header: dict[str, Any]) -> bool:
    try:
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _keys_accounted(raw: bytes, header: dict[str, Any]) -> bool:
    """Whether every key written in `raw` is a key of the parsed `header` (so none is a
    duplicate). Each key ends with a quote and a colon; strings may add more such pairs,
    never fewer, so equal counts prove no key was dropped. Objects nested below the entries
    (not in a safetensors header) are not counted: their presence sends the header to the
    checked parse, as does any surplus."""
    values = header.values()
    # counted at C speed: a value that is not an object (no header entry is one) sends the
    # header to the checked parse, which is exact about what it holds
    if set(map(type, values)) - {dict}:
        return False
    objects = 1 + len(header)
    keys = len(header) + sum(map(len, values))
    if raw.count(b"{") != objects:
        return False
    written = raw.count(b'":')
    # writers put no space between a key and its colon; a header that has a quote followed by
    # whitespace anywhere (`json.dumps` never writes one outside a string) is counted in full
    if any(spaced in raw for spaced in _QUOTE_SPACE):
        written += len(_SPACED_KEY_END.findall(raw))
    return written == keys


def _decode_checked(raw: bytes, where: str, findings: Findings) -> dict[str, Any] | None:
    """`_decode` with the duplicate-key hook on every object (a header that may have some)."""
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

    header = _json_object(raw, where, findings, no_duplicates)
    if header is None:
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
    return header


def _data_begin(item: tuple[str, TensorInfo]) -> int:
    return item[1][2]


def _entries(
    header: dict[str, Any], data_size: int, where: str, findings: Findings
) -> tuple[dict[str, TensorInfo], set[str], dict[str, str], dict[str, TensorInfo], bool]:
    """(valid tensors, rejected names, unsupported name -> dtype code, every placed range,
    whether the placed ranges are in data order as listed)."""
    tensors: dict[str, TensorInfo] = {}
    rejected: set[str] = set()
    unsupported: dict[str, str] = {}
    placed: dict[str, TensorInfo] = {}
    bits_of = _BITS
    last_begin = 0  # of the entries taken by the fast check: any other clears `ordered`
    ordered = True
    for name, info in header.items():
        # the common case in one tight check: a known dtype, a shape and two offsets of
        # plain non-negative ints, the span matching the size, inside the data; any entry
        # that is not all of that goes through the full checks below, which say why
        if type(info) is dict:
            code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            known = bits_of.get(code) if type(code) is str else None
            if (
                known is not None
                and type(shape) is list
                and len(shape) <= MAX_NDIM
                and type(offsets) is list
                and len(offsets) == 2
            ):
                begin, end = offsets
                count = span = 1
                for dim in shape:
                    if type(dim) is not int or dim < 0:
                        break
                    count *= dim
                    span *= dim or 1
                else:
                    if (
                        span <= MAX_DIM
                        and type(begin) is int
                        and type(end) is int
                        and begin >= 0
                        and end <= data_size
                        and (end - begin) * 8 == count * known[1]
                    ):
                        plain: TensorInfo = (known[0], shape, begin, end)
                        tensors[name] = plain
                        placed[name] = plain
                        if begin < last_begin:
                            ordered = False
                        last_begin = begin
                        continue
        ordered = False
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
    return tensors, rejected, unsupported, placed, ordered


#: safetensors dtype code -> (canonical dtype, bits per element), for `_entries`' fast check
_BITS: dict[str, tuple[str, int]] = {
    code: (dtype, dtypes.bitsize(dtype)) for code, dtype in dtypes.FROM_SAFETENSORS.items()
}


def _check_layout(
    order: list[tuple[str, TensorInfo]],
    data_start: int,
    data_size: int,
    complete: bool,
    where: str,
    findings: Findings,
    tolerated: Findings,
) -> None:
    """Overlaps (to `findings`), gaps and trailing bytes (to `tolerated`) of the data ranges."""
    previous_end, previous_name = 0, None
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
    if complete and previous_end < data_size:
        tolerated.add(
            "trailing_bytes",
            f"has {data_size - previous_end} bytes after the last tensor's data (the header "
            f"accounts for {data_start + previous_end} of {data_start + data_size} bytes)",
            file=where,
            fix="Trailing garbage: the file was appended to or overwritten in place; write it again.",
        )


def _unknown_dtype(info: Any, data_size: int) -> TensorInfo | None:
    """(code, shape, begin, end) of a well-formed entry whose dtype code is unknown, else None."""
    if not isinstance(info, dict):
        return None
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or dtypes.from_safetensors(code) is not None:
        return None
    if not isinstance(shape, list) or dtypes.shape_problem(shape) is not None:
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
) -> TensorInfo | None:
    """One header entry checked against the spec and the data size (None when it fails)."""
    if not isinstance(info, dict):
        findings.add(
            "bad_header",
            f"tensor {name!r} has a malformed header entry",
            file=where,
            tensor=name,
            fix=CORRUPT_HEADER,
        )
        return None
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = dtypes.from_safetensors(code) if isinstance(code, str) else None
    if dtype is None:
        findings.add(
            "unknown_dtype",
            f"tensor {name!r} has unknown dtype {dtypes.shown(code)}",
            file=where,
            tensor=name,
            fix="Upgrade ckpt if this is a new dtype; otherwise the header is corrupt.",
        )
        return None
    why = dtypes.shape_problem(shape) if isinstance(shape, list) else "not a list"
    if not isinstance(shape, list) or why is not None:
        findings.add(
            "bad_header",
            f"tensor {name!r} has an invalid shape {dtypes.shown(shape)} ({why})",
            file=where,
            tensor=name,
            fix=CORRUPT_HEADER,
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
            f"tensor {name!r} has invalid data_offsets {dtypes.shown(offsets)}",
            file=where,
            tensor=name,
            fix=CORRUPT_HEADER,
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
