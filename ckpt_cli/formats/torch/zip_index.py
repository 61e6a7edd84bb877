"""Reading torch.save zip files without torch: where each tensor's bytes lie.

A torch.save file is a stored (uncompressed) zip: `<archive>/data.pkl` pickles the object,
each storage is a record `<archive>/data/<key>`. The zip directory gives every record's
place; a restricted unpickler of data.pkl (every global an inert stand-in: nothing from the
file is imported or called) gives each tensor's storage, dtype, shape, stride and storage offset. A
tensor whose bytes are a C-order range of its storage can then be copied as raw bytes, which
is what lets torch.save -> safetensors/DCP run at copy speed. Public through `torch_zip`.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...budgets import BudgetedUnpickler, check_expanded, check_inflated
from ...dtypes import MAX_NDIM, STORAGE_DTYPES, is_known, itemsize
from ...errors import CorruptDataError, FormatError
from .inert import INERT, InertObject
from .preflight import array_state_refused, numpy_allowlist

#: a data.pkl larger than this is not read (100,000 tensors take ~10 MB)
MAX_PICKLE_BYTES = 256 << 20
#: a zip directory larger than this is not read (one ~60-byte entry per storage)
MAX_DIRECTORY_BYTES = 256 << 20
#: the fix of a torch.save zip whose bytes changed after they were written
CORRUPT_ZIP_FIX = (
    "Restore this file from a good copy of the checkpoint (or download it again); nothing "
    "was written from it"
)
#: nodes visited at most walking the read object for its tensors
_MAX_VISITS = 1_000_000

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")


@dataclass(frozen=True)
class ZipRecord:
    """One stored record of a torch.save zip: where its bytes lie in the file."""

    name: str
    offset: int
    length: int
    #: the CRC-32 the zip directory records for the record's bytes (None: not read)
    crc32: int | None = None


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor of a torch.save file sits in its storage record, read from data.pkl.

    Attributes:
        key: the storage's key (its record is `<archive>/data/<key>`).
        dtype: canonical dtype token.
        shape / stride / storage_offset: in elements, as torch rebuilds the tensor.
        record: the storage record (absolute file offset and length).
        data_offset / nbytes: the tensor's bytes in the file when `plain`, else None / 0.
        plain: whether those bytes are exactly the tensor in C order (contiguous, no
            conjugate/negative bit, little-endian, inside the record).
        whole: whether they are also the whole storage (no other tensor's bytes around).
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    record: ZipRecord
    data_offset: int | None
    nbytes: int
    plain: bool
    whole: bool


@dataclass(frozen=True)
class TorchZipIndex:
    """What `index_torch_zip` found: the storage records and every tensor reachable by keys.

    Attributes:
        archive: the folder name inside the zip (`archive`, or the file's stem).
        records: storage key -> its record.
        tensors: key path from the saved object's root (dict keys, list/tuple indices; `()`
            when the root is a tensor) -> the tensor's layout.
    """

    archive: str
    records: dict[str, ZipRecord]
    tensors: dict[tuple[str | int, ...], TensorLayout]


@dataclass(frozen=True)
class LocatedTensor:
    """The one tensor of a torch.save blob (see `locate_single_tensor`).

    Attributes:
        offset / length: the storage record's data in the file: the tensor's C-order bytes.
        dtype / shape / stride / storage_offset: as data.pkl rebuilds the tensor.
        crc32: the CRC-32 the zip records for those bytes (a copy compares it with the bytes'
            own, so corrupt data is refused rather than written under a fresh CRC).
    """

    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    crc32: int | None = None


Read = Callable[[int, int], bytes]


class _NotPlain(Exception):
    """The blob is not a torch.save zip this reader can map (the caller falls back)."""


def _read_exact(read: Read, offset: int, n: int) -> bytes:
    data = read(offset, n)
    if len(data) != n:
        raise _NotPlain(f"short read at {offset}")
    return data


#: the MS-DOS directory bit of a zip record's external attributes
_DOS_DIRECTORY = 0x10


def record_damage(
    name: str,
    external_attr: int,
    method: int,
    stored: int,
    size: int,
    header_offset: int = 0,
    archive_size: int | None = None,
) -> str | None:
    """Why torch's own zip reader (miniz) misreads or refuses a torch.save record whose header
    Python's `zipfile` (and the record's CRC-32) accepts, or None.

    * A record whose name ends in `/` or whose MS-DOS directory bit is set is a folder to
      torch.load, which reads none of its bytes: the buffer it hands on is uninitialised
      memory, so `torch.load` and `dcp.load` return garbage, or fail. torch.save writes no
      folder records: one that holds bytes is corruption.
    * A record stored uncompressed (method 0) whose inflated size differs from its stored
      size: miniz refuses the whole archive, `zipfile` reads the stored bytes and checks
      their CRC-32 only.
    * A record whose local header and stored bytes (by the directory's offset) would end past
      the end of the archive: miniz checks every directory entry when it opens the archive
      and refuses the whole file, even for a record no tensor uses.
    """
    if size > 0 and (name.endswith("/") or external_attr & _DOS_DIRECTORY):
        return (
            f"record {name!r} holds {size:,} bytes but is marked as a folder, so torch.load "
            "reads none of them"
        )
    if method == 0 and stored != size:
        return (
            f"record {name!r} is stored uncompressed but declares {size:,} bytes for its "
            f"{stored:,} stored bytes, which torch.load refuses"
        )
    if archive_size is not None and header_offset + _LOCAL.size + stored > archive_size:
        return (
            f"directory places record {name!r} at byte {header_offset:,}, so that its "
            f"{stored:,} bytes would end past the archive's {archive_size:,} bytes, which "
            "torch.load refuses"
        )
    return None


def _directory(
    read: Read, start: int, length: int, where: str | None = None
) -> tuple[int, dict[str, tuple[int, int, int, int, int]]]:
    """(offset the zip's own offsets count from, name -> (method, inflated size, local header
    offset, stored size, CRC-32)).

    CorruptDataError (naming `where`) for a record torch's reader would misread
    (`record_damage`)."""
    if length < _EOCD.size:
        raise _NotPlain("too short for a zip")
    tail_len = min(length, _EOCD.size + 0xFFFF)
    tail = _read_exact(read, start + length - tail_len, tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        raise _NotPlain("no zip end record")
    eocd_pos = length - tail_len + at  # relative to start
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    base = eocd_pos - cd_size - cd_offset
    loc_pos = eocd_pos - _EOCD64_LOCATOR.size
    # torch's writer (miniz) adds the zip64 end records even to small files; the directory
    # then ends where they begin
    if loc_pos >= _EOCD64.size:
        locator = _read_exact(read, start + loc_pos, _EOCD64_LOCATOR.size)
        if locator[:4] == b"PK\x06\x07":
            eocd64_pos = loc_pos - _EOCD64.size
            fields = _EOCD64.unpack(_read_exact(read, start + eocd64_pos, _EOCD64.size))
            if fields[0] != b"PK\x06\x06":
                raise _NotPlain("bad zip64 end record")
            count, cd_size, cd_offset = fields[7], fields[8], fields[9]
            base = eocd64_pos - cd_size - cd_offset
    if base < 0 or cd_size > MAX_DIRECTORY_BYTES or cd_offset + base + cd_size > length:
        raise _NotPlain("zip directory out of bounds")
    raw = _read_exact(read, start + base + cd_offset, cd_size)
    names: dict[str, tuple[int, int, int, int, int]] = {}
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(raw):
            raise _NotPlain("truncated zip directory")
        f = _CENTRAL.unpack_from(raw, pos)
        if f[0] != b"PK\x01\x02":
            raise _NotPlain("bad zip directory entry")
        method, crc, csize, usize = f[4], f[7], f[8], f[9]
        name_len, extra_len, comment_len, local = f[10], f[11], f[12], f[16]
        pos += _CENTRAL.size
        name = raw[pos : pos + name_len].decode("utf-8", "replace")
        extra = raw[pos + name_len : pos + name_len + extra_len]
        pos += name_len + extra_len + comment_len
        usize, csize, local = _zip64_fields(extra, usize, csize, local)
        damage = record_damage(name, f[15], method, csize, usize, base + local, length)
        if damage is not None:
            raise CorruptDataError(
                f"is corrupt: its torch.save zip {damage}; the bytes changed after they were "
                "written",
                path=where,
                fix=CORRUPT_ZIP_FIX,
            )
        names[name] = (method, usize, local, csize, crc)
    return start + base, names


def check_zip_budget(read: Read, start: int, length: int, where: str | None) -> None:
    """Refuse (FormatError naming `where`) a torch.save zip any of whose records declares more
    inflated bytes than its budget (`budgets.check_inflated`): data.pkl at most
    `MAX_PICKLE_BYTES`, any record at most `MAX_INFLATE_RATIO` times its stored bytes. Checked
    before torch.load, whose reader inflates a record whole. A zip this reader cannot parse is
    left to torch.load to judge."""
    try:
        _, names = _directory(read, start, length, where)
    except (_NotPlain, struct.error, StopIteration):
        return
    for name, (_, usize, _, csize, _) in names.items():
        limit = MAX_PICKLE_BYTES if name.endswith("data.pkl") else usize
        check_inflated(name, csize, usize, limit, where)


def _zip64_fields(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field, for the ones the entry left at 0xFFFFFFFF."""
    pos = 0
    while pos + 4 <= len(extra):
        kind, size = struct.unpack_from("<HH", extra, pos)
        if kind == 1:
            values = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                usize = next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if local == 0xFFFFFFFF:
                local = next(values)
            break
        pos += 4 + size
    return usize, csize, local


def _record(
    read: Read, base: int, end: int, name: str, size: int, local: int, crc: int | None = None
) -> ZipRecord:
    """Where record `name`'s data starts: after its local header (its own name and extra)."""
    head = _read_exact(read, base + local, _LOCAL.size)
    f = _LOCAL.unpack(head)
    if f[0] != b"PK\x03\x04":
        raise _NotPlain(f"bad local header of {name}")
    offset = base + local + _LOCAL.size + f[9] + f[10]
    if offset + size > end:
        raise _NotPlain(f"record {name} runs past the end")
    return ZipRecord(name, offset, size, crc)


# ---- the restricted read of data.pkl: every global is an inert stand-in of this module


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str | None  # None: an UntypedStorage (the dtype comes with _rebuild_tensor_v3)
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    flags: bool  # a conj/neg bit or other metadata: bytes are not the values as stored


@dataclass(frozen=True)
class _Kind:
    """`torch.<X>Storage` (dtype set), `torch.storage.UntypedStorage` (None) or a dtype."""

    dtype: str | None
    storage: bool


class _Opaque:
    """Anything not modelled (an unknown global, what it builds): holds no nameable tensor.

    Accepts every call the unpickler may make on it (construction, state, items) and keeps
    nothing, so a hostile pickle builds only these."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _is_ints(value: object) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _tensor(
    storage: object, offset: object, shape: object, stride: object, dtype: str | None, meta: object
) -> object:
    if (
        not isinstance(storage, _Storage)
        or dtype is None
        or not is_known(dtype)
        or type(offset) is not int
        or offset < 0
        or not isinstance(shape, tuple)
        or not isinstance(stride, tuple)
        or not _is_ints(shape)
        or not _is_ints(stride)
        or len(shape) != len(stride)
    ):
        return _Opaque()
    if len(shape) > MAX_NDIM:  # torch.load would build it too, at minutes of CPU
        raise _TooManyDims(len(shape))
    return _Tensor(storage, dtype, offset, shape, stride, bool(meta))


def _rebuild_v2(
    storage: object, offset: object, shape: object, stride: object, *rest: object
) -> object:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, grad, hooks[, meta])."""
    dtype = storage.dtype if isinstance(storage, _Storage) else None
    return _tensor(storage, offset, shape, stride, dtype, rest[2] if len(rest) > 2 else None)


def _rebuild_v3(
    storage: object, offset: object, shape: object, stride: object, *rest: object
) -> object:
    """torch._utils._rebuild_tensor_v3(storage, offset, size, stride, grad, hooks, dtype[, meta])."""
    kind = rest[2] if len(rest) > 2 else None
    dtype = kind.dtype if isinstance(kind, _Kind) and not kind.storage else None
    untyped = isinstance(storage, _Storage) and storage.dtype is None
    meta = rest[3] if len(rest) > 3 else None
    return _tensor(storage, offset, shape, stride, dtype if untyped else None, meta)


def _parameter(data: object = None, *rest: object) -> object:
    """torch._utils._rebuild_parameter(data, requires_grad, hooks[, state]): the data."""
    return data if isinstance(data, _Tensor) else _Opaque()


class _TensorType:
    """`torch.Tensor` itself, as `_rebuild_from_type_v2` names the type to rebuild."""


def _from_type(
    func: object = None, new_type: object = None, args: object = (), *rest: object
) -> object:
    """torch._tensor._rebuild_from_type_v2(func, new_type, args, state): a plain tensor that
    carries Python attributes (DeepSpeed's ZeRO-3 `fp32_flat_groups`) is `func(*args)`; the
    attributes say nothing about where its bytes lie. A subclass stays opaque."""
    if new_type is _TensorType and func in _REBUILDS.values() and isinstance(args, tuple):
        return func(*args)  # type: ignore[operator]
    return _Opaque()


_REBUILDS: dict[str, Callable[..., object]] = {
    "_rebuild_tensor_v2": _rebuild_v2,
    "_rebuild_tensor_v3": _rebuild_v3,
    "_rebuild_parameter": _parameter,
    "_rebuild_parameter_with_state": _parameter,
}


def _latin1_bytes(text: object, encoding: object = "utf-8") -> object:
    """`_codecs.encode(text, "latin1")`, the only call of it a pickle of bytes makes."""
    if isinstance(text, str) and encoding == "latin1":
        return text.encode("latin1")
    return _Opaque()


@functools.cache
def _numpy_globals() -> dict[str, Any]:
    """The numpy globals an RNG state pickles through, by their pickled names (`_reconstruct`
    as `_empty_array` takes it, per reader)."""
    named: dict[str, Any] = {}
    for item in numpy_allowlist():
        obj, name = item if isinstance(item, tuple) else (item, None)
        named[name or f"{obj.__module__}.{obj.__qualname__}"] = obj
    return named


class _PendingArray:
    """numpy's `_reconstruct(ndarray, (0,), b'b')`, before its state: the array is built only
    from a state that carries what it declares (`preflight.array_state_refused`; numpy 2.x
    crashes on an object array whose item list is short)."""

    def __init__(self, reconstruct: Any, args: tuple[object, ...], where: str | None):
        self.reconstruct, self.args, self.where = reconstruct, args, where
        self.array: object = None

    def __setstate__(self, state: Any) -> None:
        why = array_state_refused(state)
        if why is not None:
            raise FormatError(
                f"holds a pickle that {why}; ckpt refuses it (a hostile or corrupt file)",
                path=self.where,
                fix="torch.save never writes this; re-save the checkpoint from its source, and "
                "do not trust where this file came from.",
            )
        array = self.reconstruct(*self.args)
        array.__setstate__(state)
        self.array = array


def _empty_array(reconstruct: Any, where: str | None) -> Callable[..., object]:
    """numpy's `_reconstruct` as `ndarray.__reduce__` calls it, `(ndarray, (0,), b'b')`, and
    no other way: a pickle asking for a large shape would allocate it before its data is
    checked."""
    import numpy as np

    def build(subtype: object = None, shape: object = None, dtype: object = None) -> object:
        if subtype is not np.ndarray or shape != (0,):
            return _Opaque()
        return _PendingArray(reconstruct, (subtype, shape, dtype), where)

    return build


def _plain_numpy(node: object) -> bool:
    """A numpy array, scalar or dtype of plain values (no Python objects inside)."""
    import numpy as np

    if isinstance(node, (np.ndarray, np.generic)):
        return not node.dtype.hasobject
    return isinstance(node, np.dtype) and not node.hasobject


def _inert_class(name: str) -> type | None:
    """The stand-in class ckpt's torch.load admits for the inert record class `name`
    (`inert.INERT_CLASSES`: an object of pickled arguments and state, no code), or None. Dict
    stand-ins (`INERT_DICTS`) are left to torch.load."""
    found = INERT.get(name)
    return found if found is not None and issubclass(found, InertObject) else None


def _is_inert(node: object) -> bool:
    """Whether `node` is an object `_inert_class` built (not a subclass of one)."""
    return isinstance(node, InertObject) and _inert_class(node.original) is type(node)


class _LayoutUnpickler(BudgetedUnpickler):
    """Reads data.pkl at C speed with every global replaced by an inert stand-in.

    `find_class` never imports: torch's tensor recipe maps to `_rebuild_v2/_v3` (which only
    record storage, dtype, shape, stride and offset), `collections.OrderedDict` to itself (it
    only holds items), and every other global to `_Opaque`. Storages (persistent ids) become
    `_Storage` records. Whatever the bytes, nothing from the file is imported or run."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in _REBUILDS:
            return _REBUILDS[name]
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _from_type
        if (module, name) == ("torch", "Tensor"):
            return _TensorType
        if module == "torch" and name in STORAGE_DTYPES:
            return _Kind(STORAGE_DTYPES[name], True)
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _Kind(None, True)
        if module == "torch" and is_known(name):
            return _Kind(name, False)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        inert = _inert_class(f"{module}.{name}")
        if inert is not None:
            # an inert record (Megatron-LM's `args` Namespace): the class torch.load is given
            # for it (`inert.INERT`), which holds the pickled arguments and state and runs nothing
            return inert
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes  # how protocol 2 spells a bytes object (numpy's raw data)
        if module.startswith("numpy"):
            # an RNG state's arrays: numpy's own array recipe, the globals torch.load is told
            # to admit for them (`numpy_allowlist`); nothing else of numpy
            found = _numpy_globals().get(f"{module}.{name}", _Opaque)
            return _empty_array(found, self.where) if name == "_reconstruct" else found
        return _Opaque

    def persistent_load(self, pid: Any) -> Any:
        """torch's storage persistent id: ("storage", <class>, key, location, numel)."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            return _Opaque()
        _, kind, key, _, count = pid
        if not isinstance(kind, _Kind) or not kind.storage:
            return _Opaque()
        if not isinstance(key, str) or type(count) is not int or count < 0:
            return _Opaque()
        return _Storage(key, kind.dtype, count)


class _TooManyDims(Exception):
    """A tensor recipe names more than `MAX_NDIM` dimensions (args: how many)."""


def _read_pickle(data: bytes, where: str | None) -> object:
    try:
        return _LayoutUnpickler(data, where).load()
    except _TooManyDims as exc:
        raise too_many_dims(None, exc.args[0], where) from None


def too_many_dims(name: str | None, ndim: int, where: str | None) -> FormatError:
    """The error for tensor `name` (None: not known yet) of `ndim` dimensions, more than
    `dtypes.MAX_NDIM`."""
    which = "a tensor" if name is None else f"tensor {name!r}"
    return FormatError(
        f"{which} has {ndim:,} dimensions, more than the {MAX_NDIM} a tensor may have; "
        "ckpt refuses it (a hostile or corrupt file)",
        path=where,
        fix="Re-save the tensor with its real shape.",
    )


_WALKED = (_Tensor, dict, list, tuple)


def _tensors(root: object) -> dict[tuple[str | int, ...], _Tensor]:
    """Every tensor reachable through dicts, lists and tuples, by its key path."""
    found: dict[tuple[str | int, ...], _Tensor] = {}
    todo: list[tuple[tuple[str | int, ...], object]] = [((), root)]
    visits = 0
    while todo:
        path, node = todo.pop()
        visits += 1
        if visits > _MAX_VISITS or len(path) > 1000:
            raise _NotPlain("object graph too large")
        if isinstance(node, _Tensor):
            found[path] = node
            continue
        if isinstance(node, dict):
            items: list[tuple[str | int, object]] = [
                (k, v)
                for k, v in node.items()
                if isinstance(k, (str, int)) and not isinstance(k, bool)
            ]
        elif isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        else:
            continue
        # a leaf (an RNG state's 625 ints) counts as a visit, but is never queued: it holds
        # no tensor, and queueing each one was most of this walk's time
        visits += len(items)
        if items and (visits > _MAX_VISITS or len(path) >= 1000):
            raise _NotPlain("object graph too large")
        todo.extend(((*path, k), v) for k, v in items if isinstance(v, _WALKED))
    return found


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """torch's `is_contiguous` rule: strides of C order, ignoring dimensions of size 1."""
    if 0 in shape:
        return True
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _layout(t: _Tensor, record: ZipRecord, little: bool) -> TensorLayout:
    size = itemsize(t.dtype)
    storage_bytes = t.storage.numel * (size if t.storage.dtype is not None else 1)
    count = 1
    for dim in t.shape:
        count *= dim
    nbytes = count * size
    begin = t.offset * size
    plain = (
        little
        and not t.flags
        and storage_bytes == record.length
        and _contiguous(t.shape, t.stride)
        and begin + nbytes <= record.length
    )
    return TensorLayout(
        key=t.storage.key,
        dtype=t.dtype,
        shape=t.shape,
        stride=t.stride,
        storage_offset=t.offset,
        record=record,
        data_offset=record.offset + begin if plain else None,
        nbytes=nbytes if plain else 0,
        plain=plain,
        whole=plain and begin == 0 and nbytes == record.length,
    )


def _index(
    read: Read, start: int, length: int, where: str | None
) -> tuple[TorchZipIndex, object, dict[int, TensorLayout]]:
    """(the index, data.pkl's object with its tensor stand-ins, each stand-in's layout by id)."""
    base, names = _directory(read, start, length, where)
    end = start + length
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise _NotPlain("no single data.pkl")
    archive = pkl[0].split("/", 1)[0]
    if any(method != 0 or csize != usize for method, usize, _, csize, _ in names.values()):
        raise _NotPlain("compressed records")
    _, size, local, _, _ = names[pkl[0]]
    if size > MAX_PICKLE_BYTES:
        raise _NotPlain("data.pkl too large to read")
    rec = _record(read, base, end, pkl[0], size, local)
    root = _read_pickle(_read_exact(read, rec.offset, rec.length), where)
    check_expanded(root, where)  # before any walk of it
    order = names.get(f"{archive}/byteorder")
    little = True
    if order is not None:
        rec_order = _record(read, base, end, f"{archive}/byteorder", order[1], order[2])
        little = _read_exact(read, rec_order.offset, rec_order.length) == b"little"
    prefix = f"{archive}/data/"
    records: dict[str, ZipRecord] = {}
    tensors: dict[tuple[str | int, ...], TensorLayout] = {}
    by_id: dict[int, TensorLayout] = {}
    for path, t in _tensors(root).items():
        record = records.get(t.storage.key)
        if record is None:
            found = names.get(prefix + t.storage.key)
            if found is None:
                raise _NotPlain(f"no record for storage {t.storage.key}")
            record = records[t.storage.key] = _record(
                read, base, end, prefix + t.storage.key, found[1], found[2], found[4]
            )
            _check_record_size(t.storage, record, where)
        tensors[path] = by_id[id(t)] = _layout(t, record, little)
    return TorchZipIndex(archive, records, tensors), root, by_id


def _check_record_size(storage: _Storage, record: ZipRecord, where: str | None) -> None:
    """Refuse a storage record whose size is not its storage's: torch.load refuses it too,
    but torch.load with `mmap=True` (ckpt's reader) does not, and would read the bytes that
    follow the record (the next record, the zip directory) as the tensor's."""
    size = 1 if storage.dtype is None else itemsize(storage.dtype)
    expected = storage.numel * size
    if record.length != expected:
        raise FormatError(
            f"storage record {record.name} holds {record.length:,} bytes, where its storage "
            f"of {storage.numel:,} elements needs {expected:,}: the file is truncated or corrupt",
            path=where,
            fix="Write or fetch the file again from where the checkpoint was saved.",
        )


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray)
#: containers deeper than this are left to torch (the rebuild below recurses)
_MAX_PLAIN_DEPTH = 200


def _plain_tree(
    root: object,
    layouts: dict[int, TensorLayout],
    build: Callable[[object], object] | None = None,
) -> object:
    """`root` with each tensor replaced by its layout; _NotPlain when anything is not plain
    data (an unknown global, a strided tensor...). Shared sub-objects stay shared. `build`
    turns a stand-in of another kind into its value (raising _NotPlain when it cannot)."""
    memo: dict[int, object] = {}

    def copy(node: object, depth: int) -> object:
        if isinstance(node, _Tensor):
            layout = layouts.get(id(node))
            if layout is None or not layout.plain:
                raise _NotPlain("a tensor that is not a plain range")
            return layout
        if type(node) in _PLAIN_LEAVES:
            return node
        if isinstance(node, _PendingArray):
            node = node.array  # built from a checked state, or None (no state: not plain)
        if type(node).__module__.startswith("numpy") and _plain_numpy(node):
            return node  # torch.load returns the same array
        done = memo.get(id(node))
        if done is not None:
            return done
        if depth > _MAX_PLAIN_DEPTH:
            raise _NotPlain("nested too deep")
        if type(node) in (dict, OrderedDict):
            out: Any = type(node)()
            memo[id(node)] = out
            for key, value in node.items():  # type: ignore[attr-defined]
                out[copy(key, depth + 1)] = copy(value, depth + 1)
            return out
        if type(node) is list:
            items: list[object] = []
            memo[id(node)] = items
            items.extend(copy(v, depth + 1) for v in node)
            return items
        if type(node) in (tuple, set, frozenset):
            built = type(node)(copy(v, depth + 1) for v in node)  # type: ignore[call-arg, attr-defined]
            memo[id(node)] = built
            return built
        if _is_inert(node):
            return copy_inert(node, depth)
        if build is not None:
            value = build(node)
            memo[id(node)] = value
            return value
        raise _NotPlain(f"a {type(node).__name__}")

    def copy_inert(node: Any, depth: int) -> object:
        # as torch.load builds it: the same class, its arguments and state copied
        record: Any = object.__new__(type(node))
        memo[id(node)] = record
        if "args" in vars(node):
            record.args = copy(node.args, depth + 1)
        if "state" in vars(node):
            record.state = copy(node.state, depth + 1)
        return record

    return copy(root, 0)


def read_plain_torch_zip(
    read: Read, start: int, length: int, where: str | None = None
) -> tuple[TorchZipIndex, object] | None:
    """The object a torch.save zip holds, read without torch, when it is plain data.

    Returns (index, object) where the object is data.pkl's containers and scalars with every
    tensor as its `TensorLayout`, or None when anything in it is not plain (a global beyond
    torch's tensor recipe and OrderedDict, a strided or conjugated tensor, a record this
    reader cannot follow): callers then load the file with torch. What this returns,
    `torch.load(weights_only=True)` loads too (the same recipe, a subset of its globals).
    Raises FormatError naming `where` for what no reader should follow (a pickle or record
    over its budget, see `budgets`).
    """
    found = read_torch_zip(read, start, length, where)
    if found is None or not found.plain:
        return None
    return found.index, found.root


@dataclass(frozen=True)
class ZipRead:
    """What `read_torch_zip` read of a torch.save zip.

    Attributes:
        index: its storage records and tensor layouts (`index_torch_zip`).
        plain: whether the object is plain data (`read_plain_torch_zip`).
        root: the object with each tensor as its `TensorLayout` when `plain`, else None.
    """

    index: TorchZipIndex
    plain: bool
    root: object


def read_torch_zip(read: Read, start: int, length: int, where: str | None = None) -> ZipRead | None:
    """`index_torch_zip` and `read_plain_torch_zip` of the same bytes, from one read of its
    data.pkl: a file that is not plain data (Megatron-LM's `args` Namespace) is then loaded
    with torch, and its layouts are this index, not a second read of the pickle. None where
    `index_torch_zip` returns None; FormatError as it raises."""
    try:
        index, root, layouts = _index(read, start, length, where)
    except FormatError:
        raise
    except Exception:  # any bytes: whatever this reader cannot follow, torch.load judges
        return None
    try:
        return ZipRead(index, True, _plain_tree(root, layouts))
    except FormatError:
        raise
    except Exception:  # not plain data: torch.load reads it
        return ZipRead(index, False, None)


def _tensor_layouts(root: object, index: TorchZipIndex) -> list[tuple[_Tensor, TensorLayout]]:
    """Each tensor object of the read tree with the layout the index found for it."""
    found = _tensors(root)
    return [(t, index.tensors[path]) for path, t in found.items()]


def index_torch_zip(
    read: Read, start: int, length: int, where: str | None = None
) -> TorchZipIndex | None:
    """The storage records and tensor layouts of the torch.save zip at [start, start+length).

    `read(offset, n)` returns n bytes of the file at an absolute offset. Reads only the zip
    directory, data.pkl and the local headers of the storage records. None when the bytes
    are not a torch.save zip this reader can follow (legacy files, compressed records...):
    callers then load the file with torch. FormatError naming `where` as `read_plain_torch_zip`.
    """
    try:
        return _index(read, start, length, where)[0]
    except FormatError:
        raise
    except Exception:  # any bytes: whatever this reader cannot follow, torch.load judges
        return None


def locate_single_tensor(
    read: Read, start: int, length: int, where: str | None = None
) -> LocatedTensor | None:
    """The tensor bytes of a torch.save blob of exactly one plain tensor, or None.

    The blob (a DCP item, or a whole .pt file) occupies [start, start+length) of a file read
    by `read(offset, n)`. Returned when data.pkl is one tensor (or nn.Parameter) whose bytes
    are its whole storage in C order, with no conjugate/negative bit: those bytes are then
    the storage record's data, to copy as they are. Reads only zip headers and data.pkl.
    FormatError naming `where` as `read_plain_torch_zip`.
    """
    try:
        index, root, _ = _index(read, start, length, where)
    except FormatError:
        raise
    except Exception:  # any bytes: whatever this reader cannot follow, torch.load judges
        return None
    if not isinstance(root, _Tensor) or len(index.tensors) != 1:
        return None
    layout = index.tensors[()]
    if not layout.whole or layout.data_offset is None:
        return None
    return LocatedTensor(
        offset=layout.data_offset,
        length=layout.nbytes,
        dtype=layout.dtype,
        shape=layout.shape,
        stride=layout.stride,
        storage_offset=layout.storage_offset,
        crc32=layout.record.crc32,
    )


# ---- torch.save's legacy (pre-1.6, non-zip) format
#
# A legacy file is five pickles and the storages' bytes: the magic number, the protocol
# version (1001), a system-info dict, the object (each storage a persistent id
# ("storage", <class>, key, location, numel, view)), the list of storage keys; then, for each
# key in that order, the storage's element count (int64, little-endian) and its bytes
# (little-endian whatever the machine: torch's writer converts them). torch's own loader fails
# on two kinds of such files torch.save writes: a tensor of a dtype with no legacy storage class
# (uint16/32/64, float8...) is pickled over an `UntypedStorage`, which its loader asks for a
# dtype; and a `torch.Generator` is restored from its state tensor before any storage's bytes
# are read. Read here, both come back as they were saved.

#: the first pickle of a legacy torch.save file
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
#: bytes of a legacy file's head read at first; 16 times more while its pickles run past it
_LEGACY_WINDOW = 1 << 20
_COUNT = struct.Struct("<q")


@dataclass(frozen=True)
class _Device:
    """`torch.device("cpu")` as a legacy pickle names a Generator's device."""

    name: str


def _device(name: object = None, *rest: object) -> object:
    return _Device(name) if isinstance(name, str) and not rest else _Opaque()


class _PendingGenerator:
    """`torch.Generator(device)` before its state (seed, offset, state tensor) is set."""

    def __init__(self, device: object = None, *rest: object):
        self.device = device if not rest else None
        self.state: object = None

    def __setstate__(self, state: object) -> None:
        self.state = state


class _LegacyUnpickler(_LayoutUnpickler):
    """`_LayoutUnpickler` for a legacy file's object: its storage ids carry a sixth field (a
    view of another storage, which torch.save no longer writes), and a CPU `torch.Generator`
    is a `_PendingGenerator`. Every storage id read is kept in `storages`."""

    def __init__(self, data: bytes, where: str | None, file: Any, *, complete: bool):
        super().__init__(data, where, file, complete=complete)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (("torch._C", "Generator"), ("torch", "Generator")):
            return _PendingGenerator
        if (module, name) == ("torch", "device"):
            return _device
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[5] is None):
            return _Opaque()
        found = super().persistent_load(pid[:5])
        if isinstance(found, _Storage):
            known = self.storages.setdefault(found.key, found)
            if known != found:  # one key, two storages: torch keeps the first
                raise _NotPlain(f"storage {found.key} named twice")
        return found


@dataclass(frozen=True)
class LegacyRead:
    """What `read_plain_torch_legacy` read.

    Attributes:
        index: the storages (as records: their bytes in the file) and the tensors' layouts.
        root: the saved object, each tensor as its `TensorLayout` (a Generator as itself).
        torch_fails: why torch.load cannot read the file back (empty when it can), one
            reason per kind (`a uint16 tensor ('w')`).
    """

    index: TorchZipIndex
    root: object
    torch_fails: list[str]


def _legacy_pickles(read: Read, length: int, where: str | None) -> tuple[list[object], int, Any]:
    """The five pickles at the head of a legacy file, where they end, and the object's
    unpickler (its storages)."""
    window = _LEGACY_WINDOW
    while True:
        head = read(0, min(length, window))
        cut = len(head) < length
        stream = io.BytesIO(head)
        values: list[object] = []
        unpickler: Any = None
        try:
            for n in range(5):
                pos = stream.tell()
                if n == 3:
                    unpickler = _LegacyUnpickler(head[pos:], where, stream, complete=False)
                    values.append(unpickler.load())
                else:
                    values.append(
                        _LayoutUnpickler(head[pos:], where, stream, complete=False).load()
                    )
        except (EOFError, pickle.UnpicklingError):
            if cut and window < MAX_PICKLE_BYTES:
                window *= 16
                continue
            raise
        return values, stream.tell(), unpickler


def _legacy_index(read: Read, length: int, where: str | None) -> tuple[TorchZipIndex, object]:
    if read(0, 1) != b"\x80":
        raise _NotPlain("not a pickle")
    try:
        values, pos, unpickler = _legacy_pickles(read, length, where)
    except _TooManyDims as exc:
        raise too_many_dims(None, exc.args[0], where) from None
    magic, protocol, info, root, keys = values
    if magic != LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL or not isinstance(info, dict):
        raise _NotPlain("not a legacy torch.save file")
    if not isinstance(keys, list) or len(set(keys)) != len(keys):
        raise _NotPlain("no list of storage keys")
    check_expanded(root, where)  # before any walk of it
    records: dict[str, ZipRecord] = {}
    for key in keys:
        storage = unpickler.storages.get(key) if isinstance(key, str) else None
        if storage is None:
            raise _NotPlain(f"storage key {key!r} names no storage")
        size = 1 if storage.dtype is None else itemsize(storage.dtype)
        nbytes = storage.numel * size
        if pos + _COUNT.size + nbytes > length:
            raise FormatError(
                f"storage {key} ({nbytes:,} bytes from byte {pos + _COUNT.size:,}) runs past "
                f"the end of the file ({length:,} bytes): the file is truncated",
                path=where,
                fix="Write or fetch the file again from where the checkpoint was saved.",
            )
        (count,) = _COUNT.unpack(_read_exact(read, pos, _COUNT.size))
        if count != storage.numel:
            raise FormatError(
                f"storage {key} records {count:,} elements where its tensors' pickle says "
                f"{storage.numel:,}: the file is corrupt",
                path=where,
                fix="Write or fetch the file again from where the checkpoint was saved.",
            )
        records[key] = ZipRecord(f"storage {key}", pos + _COUNT.size, nbytes)
        pos += _COUNT.size + nbytes
    tensors: dict[tuple[str | int, ...], TensorLayout] = {}
    for path, t in _tensors(root).items():
        record = records.get(t.storage.key)
        if record is None:
            raise _NotPlain(f"no bytes for storage {t.storage.key}")
        tensors[path] = _layout(t, record, True)
    return TorchZipIndex("", records, tensors), root


def _generator(read: Read, records: dict[str, ZipRecord]) -> Callable[[object], object]:
    """A builder of the CPU Generators of a legacy file, from their state's bytes."""

    def build(node: object) -> object:
        if not isinstance(node, _PendingGenerator) or node.device != _Device("cpu"):
            raise _NotPlain("not a CPU Generator")
        state = node.state
        if not (isinstance(state, tuple) and len(state) == 3):
            raise _NotPlain("a Generator without its state")
        seed, offset, tensor = state
        record = records.get(tensor.storage.key) if isinstance(tensor, _Tensor) else None
        if record is None or not isinstance(tensor, _Tensor) or tensor.dtype != "uint8":
            raise _NotPlain("a Generator state that is no byte tensor")
        layout = _layout(tensor, record, True)
        if not layout.plain or layout.data_offset is None:
            raise _NotPlain("a Generator state that is no plain range")
        import torch

        data = bytearray(_read_exact(read, layout.data_offset, layout.nbytes))
        generator = torch.Generator(device="cpu")
        generator.__setstate__((seed, offset, torch.frombuffer(data, dtype=torch.uint8)))
        return generator

    return build


def _torch_fails(root: object, generators: bool) -> list[str]:
    """Why torch.load cannot read this legacy file back (see the section's note): each dtype
    pickled over an untyped storage (with a tensor of it), and a Generator."""
    untyped: dict[str, str] = {}
    for path, t in _tensors(root).items():
        if t.storage.dtype is None:
            untyped.setdefault(t.dtype, ".".join(map(str, path)) or "tensor")
    found = [f"a {dtype} tensor ({name!r})" for dtype, name in sorted(untyped.items())]
    if generators:
        found.append("a torch.Generator (restored before its state's bytes are read)")
    return found


def read_plain_torch_legacy(
    read: Read, start: int, length: int, where: str | None = None
) -> LegacyRead | None:
    """The object a legacy (non-zip) torch.save file holds, read without torch.load, when it
    is plain data (as `read_plain_torch_zip`; a CPU `torch.Generator` too, built from its
    saved state). None when anything in it is not plain, or the bytes are no legacy file:
    callers then load the file with torch. FormatError naming `where` for a pickle over its
    budget, or storage bytes cut short or at odds with the pickle."""
    if start != 0:  # legacy bytes are never embedded (DCP items are zips)
        return None
    try:
        index, root = _legacy_index(read, length, where)
        layouts: dict[int, TensorLayout] = {}
        for t, layout in _tensor_layouts(root, index):
            layouts[id(t)] = layout
        generators: list[object] = []
        make = _generator(read, index.records)

        def build(node: object) -> object:
            generators.append(node)
            return make(node)

        tree = _plain_tree(root, layouts, build)
        return LegacyRead(index, tree, _torch_fails(root, bool(generators)))
    except FormatError:
        raise
    except Exception:  # any bytes: whatever this reader cannot follow, torch.load judges
        return None
