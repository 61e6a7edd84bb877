"""Reading DCP's `.metadata` pickle safely, without torch.

`torch.distributed.checkpoint` writes `.metadata` with a plain `pickle.dump` of its `Metadata`
dataclass and reads it back with a plain `pickle.load`, so a hostile `.metadata` runs code
when torch opens it. This module reads it with a `pickle.Unpickler` whose `find_class` admits
only the globals `dcp.save` actually pickles (checked against torch 2.13, both serializations,
single- and multi-rank saves) and maps each one to a small local stand-in; anything else, such
as `os.system` or `builtins.eval`, raises `UnsafeInputError` before it can be called.

What torch 2.13 pickles (protocol 4): the dataclasses of `torch.distributed.checkpoint.metadata`
(`Metadata`, `TensorStorageMetadata`, `BytesStorageMetadata`, `ChunkStorageMetadata`,
`TensorProperties`, `MetadataIndex`, `StorageMeta`, `_MEM_FORMAT_ENCODING`) and `filesystem._StorageInfo`
through NEWOBJ + BUILD; `torch.Size`, `torch.serialization._get_layout`, `_MEM_FORMAT_ENCODING` and
`pathlib.PosixPath` (the `checkpoint_id`) through REDUCE; dtypes as plain globals (`torch.float32`).
Megatron-Core's `torch_dist` writer also stores each rank's save plan (`Metadata.all_local_plans`):
`planner.SavePlan`, `WriteItem`, `WriteItemType`, `TensorWriteData`, `BytesIOWriteData` and
`filesystem._StoragePrefix`, admitted as stand-ins too; `LoadPlan`/`ReadItem` never are.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any, ClassVar

from ...errors import FormatError, UnsafeInputError

_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    # torch <= 2.1 kept TensorProperties here; old checkpoints still name it
    "torch.distributed._shard.sharded_tensor.metadata",
)

#: every dtype name torch has had; mapped to a `DType` stand-in holding the name
TORCH_DTYPES = frozenset(
    {
        "float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16",
        "uint8", "bool", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8", "bits16",
        "bits1x8", "bits2x4", "bits4x2", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6",
        "uint7", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
        "double", "float", "half", "cfloat", "cdouble", "long", "int", "short",
    }
)  # fmt: skip
_ALIASES = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}
_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "_mkldnn"})
_MEMORY_FORMATS = frozenset({"contiguous_format", "channels_last", "preserve_format"})
_MEM_ENCODING = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}


class DType(str):
    """A torch dtype read from a pickle, as its canonical name (`float32`)."""


class _Record:
    """Base of the stand-ins: built by pickle's NEWOBJ + BUILD with a `__dict__` state."""

    _fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in self._fields:
            setattr(self, name, None)
        for name, value in zip(self._fields, args, strict=False):
            setattr(self, name, value)
        for name, value in kwargs.items():
            if name in self._fields:
                setattr(self, name, value)

    def __setstate__(self, state: Any) -> None:
        # dataclasses with __slots__ pickle (None, slots); ours always use __dict__ states
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        own = self.__dict__
        for name in self._fields:
            if name in state:
                own[name] = state[name]

    def __getattr__(self, name: str) -> Any:
        # NEWOBJ skips __init__: fields absent from the pickled state read as None
        if name in type(self)._fields:
            return None
        raise AttributeError(name)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"


class Metadata(_Record):
    """Stand-in for `torch.distributed.checkpoint.metadata.Metadata`."""

    _fields = (
        "state_dict_metadata",
        "planner_data",
        "storage_data",
        "storage_meta",
        "version",
        # set by Megatron-Core's torch_dist writer (a SavePlan per rank), not by torch
        "all_local_plans",
    )
    state_dict_metadata: Any
    planner_data: Any
    storage_data: Any
    storage_meta: Any
    version: Any


class TensorStorageMetadata(_Record):
    """Stand-in for `TensorStorageMetadata`: properties, global size, chunks."""

    _fields = ("properties", "size", "chunks")
    properties: Any
    size: Any
    chunks: Any


class BytesStorageMetadata(_Record):
    """Stand-in for `BytesStorageMetadata` (a non-tensor entry)."""


class ChunkStorageMetadata(_Record):
    """Stand-in for `ChunkStorageMetadata`: offsets and sizes of one chunk."""

    _fields = ("offsets", "sizes")


class TensorProperties(_Record):
    """Stand-in for `TensorProperties` (pickled as a 5-tuple by its `__getstate__`)."""

    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            dtype, layout, requires_grad, memory_format, pin_memory = state
            self.dtype = dtype
            self.layout = layout
            self.requires_grad = requires_grad
            self.memory_format = memory_format
            self.pin_memory = pin_memory
            return
        super().__setstate__(state)


class MetadataIndex(_Record):
    """Stand-in for `MetadataIndex`: the key of `storage_data` (fqn, chunk offsets)."""

    _fields = ("fqn", "offset", "index")

    def key(self) -> tuple[Any, Any]:
        """What identifies the chunk (the `index` hint is not part of it, as in torch)."""
        offset = self.offset
        return (self.fqn, tuple(offset) if isinstance(offset, (tuple, list)) else offset)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self.key() == other.key()


class StorageInfo(_Record):
    """Stand-in for `filesystem._StorageInfo`: where an item's bytes are."""

    _fields = ("relative_path", "offset", "length", "transform_descriptors")


class SavePlan(_Record):
    """Stand-in for `planner.SavePlan`: Megatron-Core keeps every rank's plan in `.metadata`
    (`Metadata.all_local_plans`) to reuse it on the next save."""

    _fields = ("items", "storage_data", "planner_data", "usable")


class WriteItem(_Record):
    """Stand-in for `planner.WriteItem` (one item of a save plan)."""

    _fields = ("index", "type", "bytes_io_data", "tensor_data")


class TensorWriteData(_Record):
    """Stand-in for `planner.TensorWriteData`: chunk, properties and size of a planned write."""

    _fields = ("chunk", "properties", "size")


class BytesIOWriteData(_Record):
    """Stand-in for `planner.BytesIOWriteData`: the byte count of a planned object write."""

    _fields = ("nbytes",)


class StoragePrefix(_Record):
    """Stand-in for `filesystem._StoragePrefix`, a save plan's `storage_data`."""

    _fields = ("prefix",)


_WRITE_ITEM_TYPES = {0: "TENSOR", 1: "SHARD", 2: "BYTE_IO"}


def _write_item_type(value: Any) -> str:
    """Stand-in for the enum call `WriteItemType(n)`: its member name."""
    if value not in _WRITE_ITEM_TYPES:
        raise pickle.UnpicklingError(f"unknown WriteItemType {value!r}")
    return _WRITE_ITEM_TYPES[value]


class StorageMeta(_Record):
    """Stand-in for `StorageMeta` (checkpoint id, save id...)."""

    _fields = ("checkpoint_id", "save_id", "load_id", "modules")


def _size(values: Any = ()) -> tuple[Any, ...]:
    """Stand-in for `torch.Size(...)`: a tuple (its entries are validated where they are used)."""
    if not isinstance(values, (tuple, list)):
        raise pickle.UnpicklingError("torch.Size of something that is not a sequence")
    return tuple(values)


def _get_layout(name: Any) -> str:
    """Stand-in for `torch.serialization._get_layout('torch.strided')`."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return name.removeprefix("torch.")


def _mem_format_encoding(value: Any) -> str:
    """Stand-in for `_MEM_FORMAT_ENCODING(n)`."""
    if value not in _MEM_ENCODING:
        raise pickle.UnpicklingError(f"unknown memory format encoding {value!r}")
    return _MEM_ENCODING[value]


def _path(*parts: Any) -> str:
    """Stand-in for `pathlib.PosixPath(*parts)` (the recorded checkpoint_id): a string."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("path with non-string parts")
    return "/".join(parts).replace("//", "/")


_CLASSES: dict[str, Any] = {
    "Metadata": Metadata,
    "TensorStorageMetadata": TensorStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata,
    "ChunkStorageMetadata": ChunkStorageMetadata,
    "TensorProperties": TensorProperties,
    "MetadataIndex": MetadataIndex,
    "StorageMeta": StorageMeta,
    "_MEM_FORMAT_ENCODING": _mem_format_encoding,
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(module, name): value for module in _METADATA_MODULES for name, value in _CLASSES.items()},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.distributed.checkpoint._fsspec_filesystem", "_StorageInfo"): StorageInfo,
    # the save-plan classes Megatron-Core's torch_dist writer pickles into `.metadata`
    ("torch.distributed.checkpoint.planner", "SavePlan"): SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): WriteItem,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _write_item_type,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): TensorWriteData,
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): BytesIOWriteData,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): StoragePrefix,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that admits only DCP metadata globals, mapped to the stand-ins above."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch":
            if name in TORCH_DTYPES:
                return DType(_ALIASES.get(name, name))
            if name in _LAYOUTS:
                return name
            if name in _MEMORY_FORMATS:
                return name
        raise UnsafeInputError(
            f"is a pickle that calls {module}.{name}, which is not part of DCP metadata; "
            "it was not run",
            path=self.where,
            fix="This file is corrupt or hostile; do not load it with torch either.",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeInputError(
            "is a pickle with persistent ids, which DCP metadata never has; it was not loaded",
            path=self.where,
        )


def load_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle a `.metadata` file's bytes into stand-ins, refusing anything not on the list."""
    try:
        result = MetadataUnpickler(data, where).load()
    except UnsafeInputError:
        raise
    except RecursionError:
        raise FormatError("is a pickle nested too deeply to be DCP metadata", path=where) from None
    except Exception as exc:
        raise FormatError(
            f"is not a readable DCP metadata pickle ({type(exc).__name__}: {exc})",
            path=where,
            fix="The file is truncated or corrupt; the save was probably interrupted.",
        ) from None
    if not isinstance(result, Metadata):
        raise FormatError(
            f"holds a {type(result).__name__}, not DCP Metadata",
            path=where,
            fix="This is not a torch.distributed.checkpoint folder.",
        )
    return result


class _Opaque(Exception):
    """Raised by the peeking unpickler at the first global or tensor: the value is not plain."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def _latin1_encode(text: Any, encoding: str = "latin1") -> bytes:
    """How pickle protocol 2 stores bytes: `_codecs.encode(str, 'latin1')`."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Opaque("_codecs.encode")
    return text.encode("latin1")


class _NumpyStub:
    """What the peek makes of a numpy array or dtype: nothing is built, the state is dropped.

    Lets a container holding arrays (numpy's `get_state()` tuple) be named by its own type
    (`tuple`) rather than by the first global inside it."""

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _numpy_stub(*args: Any) -> _NumpyStub:
    return _NumpyStub()


_PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1_encode,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    # the globals numpy arrays pickle through (as in torch_save.object_allowlist); only stubs
    **{
        (module, name): _numpy_stub
        for module in ("numpy._core.multiarray", "numpy.core.multiarray")
        for name in ("_reconstruct", "scalar")
    },
    ("numpy", "ndarray"): _NumpyStub,
    ("numpy", "dtype"): _numpy_stub,
}
_KNOWN_TYPES = {
    "numpy._core.multiarray._reconstruct": "numpy.ndarray",
    "numpy.core.multiarray._reconstruct": "numpy.ndarray",
    "torch._utils._rebuild_tensor_v2": "tensor",
}


class _TensorStub(_NumpyStub):
    """What the peek makes of a tensor (and its storage): nothing is built or read."""


def _tensor_stub(*args: Any) -> _TensorStub:
    return _TensorStub()


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles only plain Python data; tensors and numpy arrays become inert stubs, so a
    container holding them (a tuple of tensors) is named by its own type."""

    def find_class(self, module: str, name: str) -> Any:
        plain = _PLAIN_GLOBALS.get((module, name))
        if plain is not None:
            return plain
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _tensor_stub
        if (module == "torch" and (name.endswith("Storage") or name in TORCH_DTYPES)) or (
            module,
            name,
        ) == ("torch.storage", "UntypedStorage"):
            return _tensor_stub
        raise _Opaque(_KNOWN_TYPES.get(f"{module}.{name}", f"{module}.{name}"))

    def persistent_load(self, pid: Any) -> Any:
        return _TensorStub()


def _small(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= 200
    if isinstance(value, (list, tuple)):
        return len(value) <= 16 and all(
            v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 60)
            for v in value
        )
    return False


def peek_saved_object(blob: bytes) -> tuple[str | None, Any]:
    """(type name, value if small) of a `torch.save` blob holding plain Python data.

    Without torch: opens the zip, unpickles `data.pkl` with an unpickler that admits no globals,
    so only ints, floats, strings, bytes, lists, tuples, dicts run through it. A blob holding
    anything else reports the first global it names (e.g. `numpy._core.multiarray._reconstruct`)
    or `tensor`, and no value.
    """
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1 or archive.getinfo(names[0]).file_size > len(blob) * 4:
                return None, None
            data = archive.read(names[0])
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None, None
    try:
        value = _PlainUnpickler(io.BytesIO(data)).load()
    except _Opaque as opaque:
        return opaque.what, None
    except Exception:
        return None, None
    if isinstance(value, _TensorStub):
        return "tensor", None
    if isinstance(value, _NumpyStub):
        return "numpy.ndarray", None
    return type(value).__name__, (list(value) if isinstance(value, tuple) else value) if _small(
        value
    ) else None


_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
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


class SavedTensor:
    """What the `data.pkl` of a `torch.save`d tensor declares (read without torch).

    Attributes:
        dtype: canonical dtype name.
        shape: the tensor's shape.
        storage_bytes: size of the storage the blob carries (a view saves all of it).
    """

    def __init__(self, dtype: str, shape: list[int], storage_bytes: int):
        self.dtype = dtype
        self.shape = shape
        self.storage_bytes = storage_bytes


class _Storage:
    def __init__(self, dtype: str | None, numel: int):
        self.dtype = dtype
        self.numel = numel


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
    dtype = storage.dtype if isinstance(storage, _Storage) else None
    # v3 (new dtypes): (..., requires_grad, hooks, dtype[, metadata]) over an UntypedStorage
    if len(rest) >= 3 and isinstance(rest[2], DType):
        dtype = str(rest[2])
    if dtype is None or not isinstance(size, tuple):
        raise _Opaque("tensor")
    from ...dtypes import is_known, itemsize

    if not is_known(dtype):
        raise _Opaque("tensor")
    per = 1 if storage.dtype is None else itemsize(dtype)
    return SavedTensor(dtype, [int(d) for d in size], storage.numel * per)


class _TensorHeaderUnpickler(pickle.Unpickler):
    """Reads the declaration of a saved tensor: no torch, nothing callable but `_rebuild`."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return None
        if module == "torch" and name in TORCH_DTYPES:
            return DType(_ALIASES.get(name, name))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise _Opaque(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Opaque("storage")
        dtype, numel = pid[1], pid[4]
        if not isinstance(numel, int):
            raise _Opaque("storage")
        return _Storage(dtype if isinstance(dtype, str) else None, numel)


def peek_saved_tensor(head: bytes) -> SavedTensor | None:
    """Dtype and shape declared by a `torch.save`d tensor, from the first bytes of the blob.

    `torch.save` writes `data.pkl` first and uncompressed, so the local zip header plus a few
    hundred bytes suffice. None when the blob does not look like that (then nothing is claimed).
    """
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return None
    method, name_len, extra_len = (
        int.from_bytes(head[8:10], "little"),
        int.from_bytes(head[26:28], "little"),
        int.from_bytes(head[28:30], "little"),
    )
    name = head[30 : 30 + name_len]
    if method != 0 or not name.endswith(b"data.pkl"):
        return None
    start = 30 + name_len + extra_len
    try:
        value = _TensorHeaderUnpickler(io.BytesIO(head[start:])).load()
    except Exception:
        return None
    return value if isinstance(value, SavedTensor) else None


class _Stub:
    """A value the structure peek does not build: its class names the global that would have
    made it (a subclass per global, see `_stub_class`); nothing runs."""

    what: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:  # APPEND(S) onto a stubbed list subclass
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) onto a stubbed dict
        pass


def _stub_class(what: str) -> type[_Stub]:
    """A `_Stub` subclass standing for global `what` (the C unpickler wants a type for NEWOBJ)."""
    return type("Stub", (_Stub,), {"what": what})


class _StructureUnpickler(pickle.Unpickler):
    """Unpickles the containers of a `torch.save` payload; every global becomes a stub.

    No global is ever resolved, so nothing can run: a tensor, a numpy array or any class
    instance comes back as a `_Stub` naming what it would have been."""

    def find_class(self, module: str, name: str) -> Any:
        plain = _PLAIN_GLOBALS.get((module, name))
        if plain is not None and plain in (dict, set, frozenset, _latin1_encode):
            return plain
        return _stub_class(_KNOWN_TYPES.get(f"{module}.{name}", f"{module}.{name}"))

    def persistent_load(self, pid: Any) -> Any:
        return _stub_class("storage")()


def peek_saved_mapping(blob: bytes) -> dict[str, tuple[str, Any]] | None:
    """For a `torch.save` file holding a dict: each leaf's (type name, small value).

    Nested non-empty dicts with string keys are flattened into dotted names, as `dcp.save`
    flattens a state dict (`args.lr`); `common_leaf` finds a name's value in the loaded dict.

    Read without torch and without resolving any global (see `_StructureUnpickler`). None when
    the blob is not a zip `torch.save` of a dict with string keys.
    """
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1 or archive.getinfo(names[0]).file_size > len(blob) * 4:
                return None
            data = archive.read(names[0])
        value = _StructureUnpickler(io.BytesIO(data)).load()
    except Exception:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    out: dict[str, tuple[str, Any]] = {}
    for key, item in _flat_items(value):
        if isinstance(item, _Stub):
            out[key] = ("tensor" if item.what == "tensor" else item.what, None)
        elif _contains_stub(item):
            out[key] = (type(item).__name__, None)
        else:
            plain = list(item) if isinstance(item, tuple) else item
            out[key] = (type(item).__name__, plain if _small(item) else None)
    return out


def _flat_items(value: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and item and all(isinstance(k, str) for k in item):
            yield from _flat_items(item, f"{name}.")
        else:
            yield name, item


def common_leaf(value: dict[str, Any], name: str) -> Any:
    """The leaf `name` (as `peek_saved_mapping` flattened it) of a loaded dict."""
    for key, item in _flat_items(value):
        if key == name:
            return item
    raise KeyError(name)


def _contains_stub(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _Stub) or (isinstance(value, type) and issubclass(value, _Stub)):
        return True
    if depth > 50:
        return True
    if isinstance(value, dict):
        return any(_contains_stub(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_contains_stub(v, depth + 1) for v in value)
    return False
