"""Loading torch.save files safely: torch's weights_only loader plus ckpt's small allow-list.

`load_torch_file` loads with `torch.load(weights_only=True, mmap=True, map_location="cpu")`:
the pickle is unpickled by torch's restricted unpickler (nothing outside its allow-list can
run; a file that asks for anything else is refused with `UnsafeInputError`, exit 4) and
storages are memory-mapped, so listing dtypes and shapes reads no tensor data. Old (pre-1.6,
non-zip) files cannot be mapped; they are loaded whole, still with `weights_only=True`. Remote
zip files load with `map_location="meta"` through ranged reads (zip directory and pickle only).
numpy arrays and scalars (found in RNG states), `torch.Generator` and a few data-only classes
of DeepSpeed and Lightning (as inert records) are admitted beyond torch's own set.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

from ...errors import CkptError, FormatError, UnsafeInputError
from ...storage import Storage, StorageRangeFile
from ...storage.local import open_regular
from .inert import INERT
from .preflight import check_legacy_head, check_zip_pickles, numpy_allowlist
from .zip_index import check_zip_budget

ZIP_MAGIC = b"PK\x03\x04"


def _generator_allowlist() -> list[Any]:
    """`torch.Generator`, which `torch.save` pickles as `Generator(device)` + its state tensor.

    Rebuilding one only sets an RNG state (`Generator.__setstate__`); `dcp.load` restores such
    objects, so ckpt's readers must too.
    """
    import torch

    return [(torch.Generator, "torch._C.Generator")]


def object_allowlist() -> list[Any]:
    """What ckpt admits beyond torch's own weights_only set when loading saved objects.

    The numpy array and dtype globals transformers and accelerate allow-list for RNG states,
    and `torch.Generator`; nothing that can call arbitrary code. Shared by the DCP reader.
    """
    return [*numpy_allowlist(), *_generator_allowlist()]


@contextmanager
def _safe_globals() -> Iterator[None]:
    import torch

    inert = [(cls, name) for name, cls in INERT.items()]
    with torch.serialization.safe_globals([*object_allowlist(), *inert]):
        yield


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _refused_globals(exc: BaseException, path: Path | None) -> list[str]:
    """Names of the globals weights_only refused, from the error or a scan of the pickle."""
    names = _GLOBAL_RE.findall(str(exc))
    if not names and path is not None:
        import torch

        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:
            names = []
    return sorted(set(names))


def is_zip(storage: Storage, rel: str) -> bool:
    """Whether the file is a zip-format torch.save file (the format since torch 1.6)."""
    try:
        return storage.read(rel, 0, 4) == ZIP_MAGIC
    except FormatError:
        return False


#: read-ahead of remote metadata reads: torch seeks between the zip directory and a few small
#: records, so a small buffer keeps each seek from fetching much more than it needs
_RANGE_BUF = 16 << 10


def load_torch_file(storage: Storage, rel: str, *, meta: bool = False) -> tuple[Any, bool]:
    """Load one torch.save file safely: (the object, whether it is the legacy non-zip format).

    Tensors are memory-mapped for zip files on local storage (no data read). With `meta`, a
    zip file on remote storage loads with `map_location="meta"`: only the zip directory and
    the pickle are fetched (ranged reads), tensors come back shape-and-dtype only. Raises
    `UnsafeInputError` when the pickle asks for anything outside torch's weights_only
    allow-list (nothing is executed), `FormatError` when the file is not a readable
    torch.save file.
    """
    import torch

    where = storage.describe(rel)
    size = storage.size(rel)
    local = storage.local_path(rel)
    if size == 0 and local is not None:
        # a FIFO or a device reports no size either: refused as what it is, never as "empty"
        os.close(open_regular(local, where))
    if size == 0:
        raise FormatError(
            "is empty", path=where, fix="The save was interrupted; write the file again."
        )
    zipped = is_zip(storage, rel)
    if not zipped:
        _refuse_non_pickle(storage, rel, where, size)
    else:
        # torch's reader inflates a record whole: its declared size is checked first
        check_zip_budget(lambda at, n: storage.read(rel, at, n), 0, size, where)
    try:
        try:
            obj = _torch_load(storage, rel, local, zipped=zipped, meta=meta, size=size)
        except pickle.UnpicklingError as exc:
            if _DTENSOR_NEEDS_IMPORT not in str(exc):
                raise
            # DTensors (accelerate FSDP's per-rank `*_rank{r}.bin` files): torch's weights_only
            # loader admits them once torch's own module is imported
            import torch.distributed.tensor  # noqa: F401

            obj = _torch_load(storage, rel, local, zipped=zipped, meta=meta, size=size)
        if "torch.distributed.tensor" in sys.modules:
            # each DTensor becomes the part of it this rank saved: a plain tensor
            obj = local_parts(obj)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "GLOBAL" in text:
            globals_ = _refused_globals(exc, local if zipped else None)
            raise UnsafeInputError(
                "holds a pickle that asks to call "
                + (", ".join(globals_) if globals_ else "a function")
                + ", which torch's weights_only loader refuses; nothing was executed",
                path=where,
                fix="ckpt never runs code from a checkpoint. If you trust whoever wrote it, "
                "re-save its tensors and plain values (dicts, lists, numbers, strings) and inspect that.",
            ) from None
        opcode = _UNSUPPORTED_OPCODE.search(text)
        if opcode is not None:
            raise FormatError(
                f"holds a pickle opcode torch's weights_only loader does not support "
                f"({_opcode_name(int(opcode.group(1)))}): it was written with "
                "torch.save(..., pickle_protocol=3 or higher)",
                path=where,
                fix="Re-save it with torch.save's default pickle_protocol (2); ckpt reads such "
                "a file without torch.load only when it is plain data on local disk (tensors "
                "stored as plain ranges, dicts, lists, numbers, strings).",
            ) from None
        raise FormatError(
            "is not a torch.save file torch's weights_only loader accepts "
            f"({_first_line(text, 'WeightsUnpickler error:')})",
            path=where,
            fix="Plain pickles are never unpickled by ckpt; re-save it with torch.save.",
        ) from None
    except CkptError:
        raise
    except Exception as exc:  # torch.load's error for malformed bytes may be any type
        legacy_bug = None if zipped else _legacy_loader_bug(exc)
        if legacy_bug is not None:
            raise _legacy_unreadable(legacy_bug, where) from None
        raise FormatError(
            f"is not a readable torch.save file ({_first_line(str(exc))})",
            path=where,
            fix="The file is truncated or corrupt; write or fetch it again.",
        ) from None
    if not zipped and _holds_generator(obj):
        # torch's legacy loader sets a Generator's state from its tensor before that tensor's
        # bytes are read: from whatever memory the allocation held. It fails on most such
        # bytes; when they happen to form a valid state the load "succeeds" with that state,
        # so a Generator from a legacy file is refused whatever torch.load said
        raise _legacy_unreadable(_GENERATOR_BUG, where)
    return obj, not zipped


def _legacy_unreadable(what: str, where: str) -> FormatError:
    """The refusal of a legacy (non-zip) file holding `what`, which torch's legacy loader
    cannot read back (`_legacy_loader_bug`)."""
    return FormatError(
        f"is a legacy (non-zip) torch.save file holding {what}, which torch's "
        "legacy loader cannot read back; ckpt reads such a file itself only on local "
        "disk and when its tensors are plain ranges of their storages (not strided "
        "views)",
        path=where,
        fix="Copy it to local disk if it is remote; else re-save it from its source in "
        "the zip format (torch.save without _use_new_zipfile_serialization=False).",
    )


def _holds_generator(obj: Any) -> bool:
    """Whether a loaded object holds a `torch.Generator` anywhere in its dicts, lists and
    tuples (tensors and other leaves are not looked into)."""
    import torch

    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Generator):
            return True
        if isinstance(item, (dict, list, tuple)):
            if id(item) in seen:  # a pickle may hold a container inside itself
                continue
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
    return False


#: torch's weights_only unpickler's error for an opcode it does not implement
_UNSUPPORTED_OPCODE = re.compile(r"Unsupported operand (\d+)")


def _opcode_name(code: int) -> str:
    """The pickle opcode `code` by its name (`FRAME`), as pickletools names it."""
    import pickletools

    for op in pickletools.opcodes:
        if ord(op.code) == code:
            return op.name
    return f"opcode {code}"


def _legacy_loader_bug(exc: Exception) -> str | None:
    """What a legacy file holds that torch's legacy loader fails on (see `zip_index`'s note),
    from its error; None for any other error."""
    text = str(exc)
    if isinstance(exc, AttributeError) and "UntypedStorage" in text:
        return "a tensor of a dtype with no legacy storage class (uint16/32/64, float8...)"
    cause = exc.__cause__ if isinstance(exc, SystemError) else exc
    if "mt19937" in str(cause):
        return _GENERATOR_BUG
    return None


_GENERATOR_BUG = "a torch.Generator (torch restores it before its state's bytes are read)"


#: what torch's weights_only loader says of a DTensor before `torch.distributed.tensor` is imported
_DTENSOR_NEEDS_IMPORT = "torch.distributed.tensor`` must be imported to load DTensors"


def _torch_load(
    storage: Storage, rel: str, local: Path | None, *, zipped: bool, meta: bool, size: int
) -> Any:
    """`torch.load` with weights_only and ckpt's allow-list: mapped for a local zip file, the
    metadata alone (`meta`) of a remote one, else the whole file read."""
    import torch

    where = storage.describe(rel)
    whole: bytes | None = None
    # the pickle is read by ckpt's own restricted reader first (`preflight`): torch's admits
    # calls that allocate by a size argument, and ckpt's numpy allow-list states numpy crashes on
    if zipped and local is not None:
        with local.open("rb") as file:
            check_zip_pickles(file, where)
    elif zipped:
        ranged = io.BufferedReader(StorageRangeFile(storage, rel, size), buffer_size=_RANGE_BUF)
        check_zip_pickles(ranged, where)
    elif local is not None:
        check_legacy_head(lambda at, n: storage.read(rel, at, n), size, where)
    else:
        whole = storage.read_all(rel)
        check_legacy_head(lambda at, n: whole[at : at + n], size, where)
    # torch warns about pickle protocols and legacy files on stderr, and logs that a DeviceMesh
    # was unpickled outside a process group (a DTensor's); errors say what matters instead
    with _safe_globals(), warnings.catch_warnings(), _quiet_logger("torch.distributed"):
        warnings.simplefilter("ignore")
        if local is not None:
            return torch.load(local, weights_only=True, mmap=zipped, map_location="cpu")
        if meta and zipped:
            reader = io.BufferedReader(StorageRangeFile(storage, rel, size), buffer_size=_RANGE_BUF)
            return torch.load(reader, weights_only=True, map_location="meta")
        if whole is None:
            whole = storage.read_all(rel)
        return torch.load(io.BytesIO(whole), weights_only=True, map_location="cpu")


@contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """The standard-library logger `name` silenced (the library never prints)."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def local_parts(value: Any, depth: int = 0) -> Any:
    """`value` with every DTensor replaced by its local tensor (the part its rank holds); dicts,
    lists and tuples rebuilt around them, anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if depth > 200:  # deeper than any state dict; left as loaded
        return value
    if isinstance(value, dict):
        return type(value)((k, local_parts(v, depth + 1)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(local_parts(v, depth + 1) for v in value)
    return value


def _refuse_non_pickle(storage: Storage, rel: str, where: str, size: int) -> None:
    """A file that is neither a ZIP archive nor a pickle is no torch.save file: say what it is."""
    from ..sniff import SNIFF_BYTES, what_is

    head = storage.read(rel, 0, min(size, SNIFF_BYTES))
    if head[:1] == b"\x80":  # a pickle protocol marker: legacy torch.save, judged by the loader
        if not _legacy_magic(head):
            _refuse_bare_pickle(storage, rel, where, size)
        return
    raise FormatError(
        f"is not a torch.save file: it is {what_is(head, size)} (torch.save writes a ZIP "
        "archive, or a pickle for legacy files)",
        path=where,
        fix="Check the path; if it is a checkpoint of another format, name it by that "
        "format's suffix or pass --format.",
    )


#: the number a legacy (non-zip) torch.save file's first pickle holds (`torch.serialization`'s
#: MAGIC_NUMBER): a pickle that starts otherwise is no torch.save file
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
#: bytes of a bare pickle scanned for the globals it names (opcodes only, nothing is loaded)
_BARE_SCAN_BYTES = 1 << 20


def _legacy_magic(head: bytes) -> bool:
    """Whether the pickle `head` starts with opens with torch's legacy magic number (after its
    PROTO and FRAME opcodes): read by opcodes, nothing is loaded."""
    import pickletools

    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name in ("PROTO", "FRAME"):
                continue
            return op.name in ("LONG1", "LONG4", "LONG", "INT") and arg == _LEGACY_MAGIC
    except Exception:  # any bytes: a head that does not parse is judged by the loader
        return True
    return False


def _refuse_bare_pickle(storage: Storage, rel: str, where: str, size: int) -> None:
    """Refuse a pickle that is not torch.save's (`pickle.dump` of an object): ckpt never
    unpickles one. Named by the globals it asks to call (read from its opcodes, nothing is
    imported or run), as torch.save files that ask for them are."""
    from .pickle_scan import pickle_globals

    names = [
        n
        for n in dict.fromkeys(pickle_globals(storage.read(rel, 0, min(size, _BARE_SCAN_BYTES))))
        if not n.startswith("<not a valid pickle")
    ]
    fix = (
        "ckpt never unpickles a plain pickle. Load it yourself (pickle.load) only if you "
        "trust whoever wrote it, then re-save its tensors with torch.save (a dict of tensors) "
        "or safetensors' save_file, and point ckpt at that."
    )
    # os.system pickles as the module that defines it (posix.system, nt.system)
    names = [
        f"{n} (os.{n.split('.', 1)[1]})" if n.split(".", 1)[0] in ("posix", "nt") else n
        for n in names
    ]
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise UnsafeInputError(
            f"is a plain pickle (pickle.dump), not a torch.save file, and it asks to call "
            f"{shown}, which ckpt never runs; nothing was executed",
            path=where,
            fix=fix,
        )
    raise FormatError(
        "is a plain pickle (pickle.dump), not a torch.save file; nothing was executed",
        path=where,
        fix=fix,
    )


def _first_line(text: str, after: str | None = None) -> str:
    if after and after in text:
        text = text.split(after, 1)[1]
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return "unknown error"


#: records up to this size are read back through torch's zip reader and their CRC-32 compared;
#: a larger one, and a tensor's data, stored uncompressed, are compared by their offsets, their
#: bytes left to the reads of them, which check their CRC-32
CHECKED_RECORD_BYTES = 1 << 20


_V = TypeVar("_V")


def _records_named(names: list[str], records: dict[str, _V]) -> dict[str, list[_V]]:
    """For each of `names` (records as torch's reader lists them, without the archive's
    folder), the values of `records` (by zip name) whose name is it or ends with "/" and it.

    In time linear in the names' bytes: each zip name is walked from its last "/"-separated
    part back, in a tree of the listed names' parts (last part first), only as far as some
    listed name ends the same way; comparing every name with every zip name took minutes for
    a torch.save of 10,000 tensors.
    """
    root = _Suffix()
    ends: dict[str, _Suffix] = {}
    for name in names:
        node = root
        for part in reversed(name.split("/")):
            node = node.children.setdefault(part, _Suffix())
        ends[name] = node
    found: dict[int, list[_V]] = {id(node): [] for node in ends.values()}
    for key, value in records.items():
        node = root
        for part in reversed(key.split("/")):
            child = node.children.get(part)
            if child is None:
                break
            node = child
            if id(node) in found:
                found[id(node)].append(value)
    return {name: found[id(node)] for name, node in ends.items()}


class _Suffix:
    """A node of `_records_named`'s tree: the parts that may come before the ones walked."""

    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[str, _Suffix] = {}


def torch_reader_damage(file: IO[bytes]) -> str | None:
    """Why torch's own zip reader (miniz, what `torch.load` and `dcp.load` read a torch.save
    archive with) refuses or misreads the archive `file` (seekable), or None.

    miniz checks what Python's `zipfile` does not (disk numbers, the flags of every record)
    and trusts what `zipfile` checks (CRC-32s, the names in the local headers): a record it
    reads from elsewhere than its bytes (a flipped name or extra-field length) loads garbage.
    So the archive is opened by both: each record's local header as `zipfile` checks it, and
    as torch's reader finds it: its bytes read back (up to `CHECKED_RECORD_BYTES`) hold the
    CRC-32 the directory records; a tensor's data (`data/N`) or a larger record, stored
    uncompressed, starts where its local header says (the reads of those bytes check them).
    """
    import struct
    import zipfile
    import zlib

    import torch

    from ...budgets import ZIP_READ_ERRORS

    try:
        file.seek(0)
        with zipfile.ZipFile(file) as archive:
            records = {}
            for info in archive.infolist():
                with archive.open(info):  # its local header: signature, name, flags, method
                    pass
                file.seek(info.header_offset + 26)
                lengths = file.read(4)
                if len(lengths) != 4:
                    return f"the local header of record {info.filename!r} is cut short"
                name_length, extra_length = struct.unpack("<HH", lengths)
                start = info.header_offset + 30 + name_length + extra_length
                records[info.filename] = (info, start)
        file.seek(0)
        # `get_record_offset` is torch's own (torch.load uses it) but missing from its stubs
        reader: Any = torch._C.PyTorchFileReader(file)
        names = reader.get_all_records()
        holding = _records_named(names, records)
        for name in names:
            found = holding[name]
            if len(found) != 1:
                return f"torch reads a record {name!r} the zip directory does not hold once"
            info, start = found[0]
            if info.compress_type == 0 and (
                name.startswith("data/") or info.file_size > CHECKED_RECORD_BYTES
            ):
                if reader.get_record_offset(name) != start:
                    return f"torch reads record {name!r} from elsewhere than its bytes"
                continue
            got = zlib.crc32(reader.get_record(name))
            if got != info.CRC:
                return (
                    f"torch reads record {name!r} with CRC-32 {got:08x}, the zip directory "
                    f"records {info.CRC:08x}"
                )
    except ZIP_READ_ERRORS as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        file.seek(0)
    return None
