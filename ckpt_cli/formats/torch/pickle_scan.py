"""Which globals a pickle would import, found by reading its opcodes: nothing is executed and
torch is not imported (what plain `verify` can afford on every DCP object entry).

`torch.save` blobs are zip archives holding `*/data.pkl`; legacy ones are a run of pickles. A
global is admitted when `torch.load(weights_only=True)` (with the numpy reconstruction globals
and inert records ckpt allowlists, see `formats.torch_save`) would admit it; anything else is
named, so `verify` can say which entry `ckpt`'s reader refuses and why.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ...budgets import READ_CHUNK, ZIP_READ_ERRORS, check_inflated, read_member, walk_pickle
from .zip_index import record_damage

#: globals torch's weights_only unpickler admits by default (its own rebuild functions,
#: storages, dtypes and layouts, and the plain containers)
_TORCH_DEFAULTS = (
    r"torch\._utils\._rebuild_\w+"
    r"|torch\._tensor\._rebuild_from_type_v2"
    r"|torch\.serialization\._get_layout"
    r"|torch\.(?:storage\.)?(?:Untyped|Typed)?\w*Storage"
    r"|torch\.(?:device|Size|Tensor|nn\.parameter\.Parameter|strided|sparse_\w+|_sparse_\w+)"
    r"|torch\.(?:channels_last\w*|contiguous_format|preserve_format)"
    r"|torch\.(?:u?int\d+|float\d*\w*|bfloat16|half|double|long|short|bool|bits\d+\w*"
    r"|complex\d*|cfloat|cdouble|q?u?int\d+x?\d*|quint\w+|qint\w+)"
    r"|collections\.OrderedDict"
    r"|builtins\.(?:set|bytearray|complex|int|float|bool|str|bytes|tuple|list|dict)"
    r"|_codecs\.encode"
)
#: numpy's array reconstruction, which ckpt allowlists for RNG states
_NUMPY_ARRAYS = (
    r"numpy\.(?:_core|core)\.multiarray\.(?:_reconstruct|scalar)"
    r"|numpy\.(?:ndarray|dtype)"
    r"|numpy\.dtypes\.\w+DType"
)
#: what ckpt's restricted reader admits: torch's defaults, numpy's arrays, and the inert
#: records of `formats.torch_save`
_ALLOWED = re.compile(
    r"^(?:"
    + _TORCH_DEFAULTS
    + "|"
    + _NUMPY_ARRAYS
    + r"|torch\._C\.Generator|torch\.Generator"  # RNG state: `formats.torch_save` admits it
    r"|deepspeed\.runtime\.fp16\.loss_scaler\.(?:Dynamic)?LossScaler"
    r"|deepspeed\.runtime\.zero\.config\.ZeroStageEnum"
    r"|deepspeed\.utils\.tensor_fragment\.fragment_address"
    r"|argparse\.Namespace"
    r"|(?:lightning\.fabric|lightning_fabric)\.utilities\.data\.AttributeDict"
    r"|pytorch_lightning\.utilities\.parsing\.AttributeDict"
    r")$"
)
#: what needs no look from torch's own scan: its defaults, and numpy's arrays (which the
#: frameworks that save RNG states allow-list when they load)
_NO_TORCH_SCAN = re.compile(r"^(?:" + _TORCH_DEFAULTS + "|" + _NUMPY_ARRAYS + r")$")
#: a pickle longer than this is not scanned (object entries are small; tensors are not here)
MAX_SCAN_BYTES = 256 << 20

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING"}
_STRINGS |= {"SHORT_BINSTRING"}
_PUTS = {"BINPUT", "LONG_BINPUT", "PUT"}
_GETS = {"BINGET", "LONG_BINGET", "GET"}


def _pickles(data: bytes) -> list[bytes]:
    """The pickle streams of a stored object: `data.pkl` of a torch.save zip, or the bytes.
    FormatError for a data.pkl over its inflation budget (`budgets.read_member`)."""
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            return [read_member(archive, n, MAX_SCAN_BYTES, None) for n in names[:1]]
    if data[:1] == b"\x80":
        return [data]
    return []  # raw bytes (an io.BytesIO saved as is): data, not code


@dataclass(frozen=True)
class ArchiveRead:
    """What reading a stored object's torch.save archive through found.

    Attributes:
        damage: why the archive is corrupt, or None when it is intact or no zip at all (a
            bare pickle or raw bytes carry no checksum).
        pickles: its `data.pkl` records, kept on the way (each at most `MAX_SCAN_BYTES`), so
            the pickle check need not open the archive again; None when the bytes are no zip,
            or a record was too long to keep.
    """

    damage: str | None
    pickles: tuple[bytes, ...] | None


def read_archive(data: bytes, where: str | None = None) -> ArchiveRead:
    """Read a stored object's torch.save archive through, keeping its `data.pkl` records: one
    parse of the zip serves the corruption check and the pickle check.

    Every member is read through (in `READ_CHUNK` pieces, after `budgets.check_inflated`),
    as `zipfile.testzip` does: a member whose bytes fail the CRC-32 the zip records for them,
    a zip that does not parse, or a member torch's own reader would misread where `zipfile`
    does not (`zip_index.record_damage`) is corruption (bytes changed after torch.save
    wrote them), not a pickle ckpt refuses.
    """
    if data[:4] != b"PK\x03\x04":
        return ArchiveRead(None, None)
    pickles: list[bytes] | None = []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                damage = record_damage(
                    info.filename,
                    info.external_attr,
                    info.compress_type,
                    info.compress_size,
                    info.file_size,
                    info.header_offset,
                    len(data),
                )
                if damage is not None:
                    return ArchiveRead(damage, None)
                # the inflation budget only: the bytes are in memory already
                check_inflated(info.filename, info.compress_size, info.file_size, 1 << 62, where)
                keep = info.filename.endswith("data.pkl") and pickles is not None
                if keep and info.file_size > MAX_SCAN_BYTES:
                    pickles = None  # the pickle check reads it on its own, within its budget
                    keep = False
                kept = bytearray()
                with archive.open(info) as member:
                    while block := member.read(READ_CHUNK):
                        if keep:
                            kept += block
                if keep and pickles is not None:
                    pickles.append(bytes(kept))
    except ZIP_READ_ERRORS as exc:
        return ArchiveRead(str(exc) or type(exc).__name__, None)
    return ArchiveRead(None, None if pickles is None else tuple(pickles))


def refused_globals(data: bytes) -> list[str]:
    """Globals a stored object's pickle would import that ckpt's restricted reader refuses.

    Empty when every global is admitted or the bytes are no pickle at all. A pickle that
    cannot be parsed, or that builds a global from computed names, is reported as such.
    """
    return sorted({g for g in pickle_globals(data) if not _ALLOWED.match(g)})


def beyond_torch_defaults(data: bytes) -> bool:
    """Whether a stored object's pickle names a global that is neither one torch's default
    loader admits nor numpy's arrays: only then need torch's own scan say what it refuses."""
    return any(not _NO_TORCH_SCAN.match(g) for g in pickle_globals(data))


def _python3_name(module: str, attr: str) -> str:
    """The global an unpickler imports for a name a protocol 0-2 pickle writes: `torch.save`
    pickles with protocol 2, which names builtins after Python 2 (`__builtin__.set`,
    `__builtin__.xrange`) and which every Python 3 unpickler, torch's included, maps back
    (`fix_imports`)."""
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{attr}"


def pickle_globals(data: bytes) -> list[str]:
    """Every global a stored object's pickle would import, in order (opcodes only)."""
    if len(data) > MAX_SCAN_BYTES:
        return []
    try:
        streams = _pickles(data)
    except ZIP_READ_ERRORS as exc:
        return [f"<not a readable torch.save archive: {exc}>"]
    found: list[str] = []
    for stream in streams:
        pushed: list[object] = []
        memo: dict[object, object] = {}
        try:
            # genops stops at the first STOP: the pickle proper (a legacy file's data follows)
            for op, arg, _ in pickletools.genops(io.BytesIO(stream)):
                name = op.name
                if name in _STRINGS:
                    pushed.append(arg if isinstance(arg, str) else str(arg))
                elif name in _PUTS:
                    memo[arg] = pushed[-1] if pushed else None
                elif name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif name in _GETS:
                    pushed.append(memo.get(arg))
                elif name in ("GLOBAL", "INST"):
                    module, _, attr = str(arg).partition(" ")
                    found.append(_python3_name(module, attr))
                elif name == "STACK_GLOBAL":
                    pair: tuple[object, object] = (
                        (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
                    )
                    if isinstance(pair[0], str) and isinstance(pair[1], str):
                        found.append(_python3_name(pair[0], pair[1]))
                    else:
                        found.append("<a global built from computed names>")
                else:
                    pushed.append(None)
        except (ValueError, EOFError) as exc:
            found.append(f"<not a valid pickle: {exc}>")
    return found


#: a value `_keyed` reads after a key (an int, a bool)
_V = TypeVar("_V")


def _key_pattern(keys: frozenset[str]) -> re.Pattern[bytes]:
    """The opcodes a pickler writes a string `key` of `keys` with, whole: BINUNICODE (protocol
    2, what torch.save writes), SHORT_BINUNICODE and BINUNICODE8 (4+), SHORT_BINSTRING and
    BINSTRING (Python 2's `str`), UNICODE and STRING (protocol 0's text)."""
    forms: list[bytes] = []
    for key in sorted(keys):
        raw = key.encode("ascii")
        size = len(raw)
        forms += [
            b"X" + size.to_bytes(4, "little") + raw,
            b"\x8c" + bytes([size]) + raw,
            b"\x8d" + size.to_bytes(8, "little") + raw,
            b"U" + bytes([size]) + raw,
            b"T" + size.to_bytes(4, "little") + raw,
            b"V" + raw + b"\n",
            b"S'" + raw + b"'\n",
            b'S"' + raw + b'"\n',
        ]
    return re.compile(b"|".join(re.escape(f) for f in forms))


#: the memo opcodes a pickler may write between a key and its value: BINPUT, LONG_BINPUT, PUT,
#: MEMOIZE
_MEMO_OPS = re.compile(rb"(?:q.|r....|p\d+\n|\x94)*", re.DOTALL)
#: an int opcode and its argument: BININT1, BININT2, BININT, LONG1, INT, LONG
_INT_OP = re.compile(rb"K(.)|M(..)|J(....)|\x8a(.)|I(-?\d{1,19})\n|L(-?\d{1,19})L?\n", re.DOTALL)


def _int_at(stream: bytes, pos: int) -> int | None:
    """The int the opcode at `pos` of `stream` pushes (after any memo opcodes), or None."""
    pos = _MEMO_OPS.match(stream, pos).end()  # type: ignore[union-attr]  # `*` always matches
    found = _INT_OP.match(stream, pos)
    if found is None:
        return None
    k, m, j, long1, text, long_text = found.groups()
    if k is not None or m is not None:
        return int.from_bytes(k if k is not None else m, "little")
    if j is not None:
        return int.from_bytes(j, "little", signed=True)
    if long1 is not None:  # LONG1: a length byte, then that many bytes of two's complement
        size = long1[0]
        start = found.end()
        if size > 8 or start + size > len(stream):
            return None  # no size, step or count is wider than 64 bits
        return int.from_bytes(stream[start : start + size], "little", signed=True)
    digits = text if text is not None else long_text
    return None if text == b"00" or text == b"01" else int(digits)


def keyed_ints(stream: bytes, keys: frozenset[str]) -> dict[str, int]:
    """The int that follows each of `keys` where the pickle `stream` (a `data.pkl`) writes it as
    a dict key and an int as its value, the first time: `dp_world_size` of a DeepSpeed model
    states file, read by its opcodes alone (nothing built, torch not imported).

    The keys are found by pattern and kept only where the opcode walk of `budgets.walk_pickle`
    starts an opcode (never inside another string's bytes): one pass in C-speed runs, ~30 ns a
    byte, where stepping through `pickletools.genops` took ~370 (256 MiB of opcodes, a 6 MB
    deflated file: 95 CPU-s)."""
    return _keyed(stream, keys, _int_at)


def _keyed(
    stream: bytes, keys: frozenset[str], value_at: Callable[[bytes, int], _V | None]
) -> dict[str, _V]:
    """Each of `keys` the pickle `stream` writes as a string opcode (where an opcode starts),
    with the value `value_at` reads right after it, the first time it reads one."""
    found: dict[str, _V] = {}

    def at(start: int, end: int) -> None:
        key = _key_name(stream[start:end])
        if key in keys and key not in found:
            value = value_at(stream, end)
            if value is not None:
                found[key] = value

    matches = (m.span() for m in _key_pattern(keys).finditer(stream))
    walk_pickle(stream, complete=False, spans=matches, found=at)
    return found


def _key_name(opcode: bytes) -> str:
    """The string a key opcode `_key_pattern` matched writes."""
    head = opcode[:1]
    if head in (b"X", b"T"):
        raw = opcode[5:]
    elif head == b"\x8d":
        raw = opcode[9:]
    elif head in (b"\x8c", b"U"):
        raw = opcode[2:]
    elif head == b"V":
        raw = opcode[1:-1]
    else:  # S'...' or S"..."
        raw = opcode[2:-2]
    return raw.decode("ascii")


def _flag_at(stream: bytes, pos: int) -> bool | None:
    """The bool the opcode at `pos` of `stream` pushes (NEWTRUE / NEWFALSE, after any memo
    opcodes), or None."""
    pos = _MEMO_OPS.match(stream, pos).end()  # type: ignore[union-attr]  # `*` always matches
    op = stream[pos : pos + 1]
    return True if op == b"\x88" else False if op == b"\x89" else None


def keyed_flags(stream: bytes, keys: frozenset[str]) -> dict[str, bool]:
    """The bool that follows each of `keys` where the pickle `stream` writes it as a dict key
    and True or False as its value, the first time: Megatron-LM's `use_distributed_optimizer`
    in the `args` of a rank's `model_optim_rng.pt`, found as `keyed_ints` finds ints."""
    return _keyed(stream, keys, _flag_at)


#: the opcodes torch's weights_only unpickler implements (torch 2.x: what torch.save's default
#: pickle protocol 2 writes); it refuses a pickle with any other ("Unsupported operand")
_TORCH_OPCODES = frozenset(
    [
        "GLOBAL",
        "BINUNICODE",
        "PROTO",
        "STOP",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
        "APPEND",
        "APPENDS",
        "SETITEM",
        "SETITEMS",
        "MARK",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NONE",
        "NEWFALSE",
        "NEWTRUE",
        "EMPTY_TUPLE",
        "EMPTY_LIST",
        "EMPTY_DICT",
        "EMPTY_SET",
        "BININT",
        "BININT1",
        "BININT2",
        "BINFLOAT",
        "SHORT_BINSTRING",
        "BINPERSID",
        "BINGET",
        "LONG_BINGET",
        "BINPUT",
        "LONG_BINPUT",
        "LONG1",
    ]
)


def opcodes_torch_refuses(stream: bytes) -> list[str]:
    """The opcodes of the pickle `stream` (a `data.pkl`) that torch's weights_only unpickler
    does not implement (`FRAME` of pickle protocol 4, `SHORT_BINBYTES` of 3...), in order of
    first use; empty for one it reads, or one too long or too broken to scan. A pickle that
    declares protocol 2 or lower (torch.save's default) is not walked: its pickler wrote none."""
    if len(stream) > MAX_SCAN_BYTES or stream[:1] != b"\x80" or stream[1:2] <= b"\x02":
        return []
    found: dict[str, None] = {}
    try:
        for op, _, _ in pickletools.genops(io.BytesIO(stream)):
            if op.name not in _TORCH_OPCODES:
                found.setdefault(op.name)
    except (ValueError, EOFError):
        return []
    return list(found)
