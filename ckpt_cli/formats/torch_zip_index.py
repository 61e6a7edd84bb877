"""Reading torch.save zip files without torch: where each tensor's bytes lie.

A torch.save file is a stored (uncompressed) zip: `<archive>/data.pkl` pickles the object,
each storage is a record `<archive>/data/<key>`. The zip directory gives every record's
place; a restricted walk of data.pkl's opcodes (nothing imported, nothing called: any bytes
are safe to walk) gives each tensor's storage, dtype, shape, stride and storage offset. A
tensor whose bytes are a C-order range of its storage can then be copied as raw bytes, which
is what lets torch.save -> safetensors/DCP run at copy speed. Public through `torch_zip`.
"""

from __future__ import annotations

import contextlib
import io
import pickletools
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ..dtypes import is_known, itemsize

#: a data.pkl larger than this is not walked (100,000 tensors take ~10 MB)
MAX_PICKLE_BYTES = 256 << 20
#: a zip directory larger than this is not read (one ~60-byte entry per storage)
MAX_DIRECTORY_BYTES = 256 << 20
#: nodes the walk from the root of the unpickled object visits at most
_MAX_VISITS = 10_000_000

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")

#: typed storage classes torch pickles -> canonical dtype token (`torch.<X>Storage`)
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


@dataclass(frozen=True)
class ZipRecord:
    """One stored record of a torch.save zip: where its bytes lie in the file."""

    name: str
    offset: int
    length: int


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
    """

    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


Read = Callable[[int, int], bytes]


class _NotPlain(Exception):
    """The blob is not a torch.save zip this reader can map (the caller falls back)."""


def _read_exact(read: Read, offset: int, n: int) -> bytes:
    data = read(offset, n)
    if len(data) != n:
        raise _NotPlain(f"short read at {offset}")
    return data


def _directory(read: Read, start: int, length: int) -> tuple[int, dict[str, tuple[int, int, int]]]:
    """(offset the zip's own offsets count from, name -> (method, size, local header offset))."""
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
    names: dict[str, tuple[int, int, int]] = {}
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(raw):
            raise _NotPlain("truncated zip directory")
        f = _CENTRAL.unpack_from(raw, pos)
        if f[0] != b"PK\x01\x02":
            raise _NotPlain("bad zip directory entry")
        method, csize, usize = f[4], f[8], f[9]
        name_len, extra_len, comment_len, local = f[10], f[11], f[12], f[16]
        pos += _CENTRAL.size
        name = raw[pos : pos + name_len].decode("utf-8", "replace")
        extra = raw[pos + name_len : pos + name_len + extra_len]
        pos += name_len + extra_len + comment_len
        usize, csize, local = _zip64_fields(extra, usize, csize, local)
        if method != 0 or csize != usize:
            raise _NotPlain(f"record {name} is compressed")
        names[name] = (method, usize, local)
    return start + base, names


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


def _record(read: Read, base: int, end: int, name: str, size: int, local: int) -> ZipRecord:
    """Where record `name`'s data starts: after its local header (its own name and extra)."""
    head = _read_exact(read, base + local, _LOCAL.size)
    f = _LOCAL.unpack(head)
    if f[0] != b"PK\x03\x04":
        raise _NotPlain(f"bad local header of {name}")
    offset = base + local + _LOCAL.size + f[9] + f[10]
    if offset + size > end:
        raise _NotPlain(f"record {name} runs past the end")
    return ZipRecord(name, offset, size)


# ---- the restricted walk of data.pkl: nothing is called, only torch's tensor recipe is read


@dataclass(frozen=True)
class _Global:
    name: str


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


class _Opaque:
    """Anything the walk does not model (its contents hold no tensor it can name)."""


_OPAQUE = _Opaque()
_SCALARS = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
    "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
}  # fmt: skip


def _is_ints(value: object) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _rebuild(func: str, args: object) -> object:
    """What a REDUCE of `func(*args)` stands for: a tensor, its data, a plain dict, or opaque."""
    if not isinstance(args, tuple):
        return _OPAQUE
    if func in ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"):
        v3 = func.endswith("v3")
        if len(args) < (7 if v3 else 6):
            return _OPAQUE
        storage, offset, shape, stride = args[:4]
        dtype = storage.dtype if isinstance(storage, _Storage) else None
        meta = args[7 if v3 else 6] if len(args) > (7 if v3 else 6) else None
        if v3:
            dtype = args[6].name.removeprefix("torch.") if isinstance(args[6], _Global) else None
        if (
            not isinstance(storage, _Storage)
            or dtype is None
            or not is_known(dtype)
            or type(offset) is not int
            or offset < 0
            or not _is_ints(shape)
            or not _is_ints(stride)
            or len(shape) != len(stride)
        ):
            return _OPAQUE
        return _Tensor(storage, dtype, offset, shape, stride, bool(meta))
    if func in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
        return args[0] if args and isinstance(args[0], _Tensor) else _OPAQUE
    if func == "collections.OrderedDict" and args == ():
        return OrderedDict()
    return _OPAQUE


def _walk_pickle(data: bytes) -> object:
    """The object data.pkl describes, with tensors as `_Tensor` and anything else opaque.

    A stack machine over `pickletools.genops` that models containers, scalars and torch's
    tensor recipe (`_rebuild_tensor_v2/v3`, `_rebuild_parameter`, storages as persistent
    ids); no global is imported and nothing is called, so any bytes are safe to walk.
    """
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name in _SCALARS:
            stack.append(arg)
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "STOP":
            return stack[-1] if stack else _OPAQUE
        elif name == "MARK":
            marks.append(len(stack))
        elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            packed = tuple(stack[-n:])
            del stack[-n:]
            stack.append(packed)
        elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            if name == "TUPLE":
                stack.append(tuple(items))
            elif name == "LIST":
                stack.append(list(items))
            elif name == "DICT":
                stack.append(_to_dict({}, items))
            else:
                stack.append(_OPAQUE)
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name == "EMPTY_SET":
            stack.append(_OPAQUE)
        elif name == "APPEND":
            value = stack.pop()
            if isinstance(stack[-1], list):
                stack[-1].append(value)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            target = stack[-1]
            if name == "APPENDS" and isinstance(target, list):
                target.extend(items)
            elif name == "SETITEMS" and isinstance(target, dict):
                _to_dict(target, items)
        elif name == "SETITEM":
            value = stack.pop()
            key = stack.pop()
            if isinstance(stack[-1], dict):
                _to_dict(stack[-1], [key, value])
        elif name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            if name == "INST":
                del stack[marks.pop() :]
                stack.append(_OPAQUE)
            else:
                stack.append(_Global(f"{module}.{attr}"))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            ok = isinstance(module, str) and isinstance(attr, str)
            stack.append(_Global(f"{module}.{attr}") if ok else _OPAQUE)
        elif name == "REDUCE":
            args = stack.pop()
            func = stack.pop()
            stack.append(_rebuild(func.name, args) if isinstance(func, _Global) else _OPAQUE)
        elif name in ("BUILD", "NEWOBJ"):
            stack.pop()
            stack[-1] = _OPAQUE
        elif name == "NEWOBJ_EX":
            del stack[-2:]
            stack[-1] = _OPAQUE
        elif name == "BINPERSID":
            stack.append(_persistent(stack.pop()))
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[cast(int, arg)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[cast(int, arg)])
        elif name == "POP":
            if stack and len(stack) > (marks[-1] if marks else -1):
                stack.pop()
            else:
                del stack[marks.pop() :]
        elif name == "POP_MARK":
            del stack[marks.pop() :]
        elif name == "DUP":
            stack.append(stack[-1])
        else:  # PERSID, EXT*, OBJ...: nothing torch.save writes
            raise _NotPlain(f"pickle opcode {name}")
    raise _NotPlain("pickle without STOP")


def _to_dict(target: dict[Any, Any], items: list[Any]) -> dict[Any, Any]:
    for key, value in zip(items[::2], items[1::2], strict=False):
        with contextlib.suppress(TypeError):  # an unhashable key: nothing to name by it
            target[key] = value
    return target


def _persistent(pid: object) -> object:
    """torch's storage persistent id: ("storage", <class>, key, location, numel)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        return _OPAQUE
    _, kind, key, _, count = pid
    if not isinstance(kind, _Global) or not isinstance(key, str) or type(count) is not int:
        return _OPAQUE
    cls = kind.name.removeprefix("torch.storage.").removeprefix("torch.")
    if cls == "UntypedStorage":
        return _Storage(key, None, count)
    dtype = STORAGE_DTYPES.get(cls)
    return _Storage(key, dtype, count) if dtype is not None else _OPAQUE


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
        elif isinstance(node, dict):
            todo.extend(
                ((*path, k), v)
                for k, v in node.items()
                if isinstance(k, (str, int)) and not isinstance(k, bool)
            )
        elif isinstance(node, (list, tuple)):
            todo.extend(((*path, i), v) for i, v in enumerate(node))
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


def _index(read: Read, start: int, length: int) -> tuple[TorchZipIndex, object]:
    base, names = _directory(read, start, length)
    end = start + length
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise _NotPlain("no single data.pkl")
    archive = pkl[0].split("/", 1)[0]
    _, size, local = names[pkl[0]]
    if size > MAX_PICKLE_BYTES:
        raise _NotPlain("data.pkl too large to walk")
    rec = _record(read, base, end, pkl[0], size, local)
    root = _walk_pickle(_read_exact(read, rec.offset, rec.length))
    order = names.get(f"{archive}/byteorder")
    little = True
    if order is not None:
        rec_order = _record(read, base, end, f"{archive}/byteorder", order[1], order[2])
        little = _read_exact(read, rec_order.offset, rec_order.length) == b"little"
    prefix = f"{archive}/data/"
    records: dict[str, ZipRecord] = {}
    tensors: dict[tuple[str | int, ...], TensorLayout] = {}
    for path, t in _tensors(root).items():
        record = records.get(t.storage.key)
        if record is None:
            found = names.get(prefix + t.storage.key)
            if found is None:
                raise _NotPlain(f"no record for storage {t.storage.key}")
            record = records[t.storage.key] = _record(
                read, base, end, prefix + t.storage.key, found[1], found[2]
            )
        tensors[path] = _layout(t, record, little)
    return TorchZipIndex(archive, records, tensors), root


def index_torch_zip(read: Read, start: int, length: int) -> TorchZipIndex | None:
    """The storage records and tensor layouts of the torch.save zip at [start, start+length).

    `read(offset, n)` returns n bytes of the file at an absolute offset. Reads only the zip
    directory, data.pkl and the local headers of the storage records. None when the bytes
    are not a torch.save zip this reader can follow (legacy files, compressed records...):
    callers then load the file with torch.
    """
    try:
        return _index(read, start, length)[0]
    except (_NotPlain, ValueError, IndexError, KeyError, EOFError, struct.error):
        return None


def locate_single_tensor(read: Read, start: int, length: int) -> LocatedTensor | None:
    """The tensor bytes of a torch.save blob of exactly one plain tensor, or None.

    The blob (a DCP item, or a whole .pt file) occupies [start, start+length) of a file read
    by `read(offset, n)`. Returned when data.pkl is one tensor (or nn.Parameter) whose bytes
    are its whole storage in C order, with no conjugate/negative bit: those bytes are then
    the storage record's data, to copy as they are. Reads only zip headers and data.pkl.
    """
    try:
        index, root = _index(read, start, length)
    except (_NotPlain, ValueError, IndexError, KeyError, EOFError, struct.error):
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
    )
