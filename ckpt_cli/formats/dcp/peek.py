"""What a stored `torch.save` blob declares, read without torch and without running anything.

DCP stores each non-tensor item and (torch_save serialization) each tensor chunk as a
`torch.save` zip. `inspect` and `verify` peek into them with unpicklers that resolve no global:
the type and small value of an object (`peek_saved_object`), the dtype and shape a tensor chunk
declares (`peek_saved_tensor`), the keys of Megatron's `common.pt` (`peek_saved_mapping`).
"""

from __future__ import annotations

import io
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Iterator
from typing import Any, ClassVar

from ...budgets import ZIP_READ_ERRORS, BudgetedUnpickler, read_member
from ...dtypes import STORAGE_DTYPES, TORCH_ALIASES
from ...errors import FormatError
from .metadata import TORCH_DTYPES, DType


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


class _PlainUnpickler(BudgetedUnpickler):
    """Unpickles only plain Python data; tensors and numpy arrays become inert stubs, so a
    container holding them (a tuple of tensors) is named by its own type."""

    def find_class(self, module: str, name: str) -> Any:
        # `torch.save` pickles with protocol 2, which names Python 3's builtins after Python
        # 2's (`__builtin__.set`): mapped back as Python's own unpickler maps them
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
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


def peek_saved_object(blob: bytes, where: str | None = None) -> tuple[str | None, Any]:
    """(type name, value if small) of a `torch.save` blob holding plain Python data.

    Without torch: opens the zip, unpickles `data.pkl` with an unpickler that admits no globals,
    so only ints, floats, strings, bytes, lists, tuples, dicts run through it. A blob holding
    anything else reports the first global it names (e.g. `numpy._core.multiarray._reconstruct`)
    or `tensor`, and no value. FormatError naming `where` for a pickle or record over its
    budget (`budgets`).
    """
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                return None, None
            data = read_member(archive, names[0], len(blob) * 4, where)
    except ZIP_READ_ERRORS:
        return None, None
    unpickler = _PlainUnpickler(data, where)
    try:
        value = unpickler.load()
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


class _TensorHeaderUnpickler(BudgetedUnpickler):
    """Reads the declaration of a saved tensor: no torch, nothing callable but `_rebuild`."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return None
        if module == "torch" and name in TORCH_DTYPES:
            return DType(TORCH_ALIASES.get(name, name))
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


#: what `peek_saved_tensor` found, keyed by the bytes of a `data.pkl` the unpickler read whole
#: and no further: the chunks of a sharded model declare a handful of (dtype, shape, storage)
#: pickles, so a million chunk heads are a handful of unpicklings. Bounded; never evicted.
_DECLARED: dict[bytes, SavedTensor] = {}
_DECLARED_MAX = 4096


def peek_saved_tensor(head: bytes, where: str | None = None) -> SavedTensor | None:
    """Dtype and shape declared by a `torch.save`d tensor, from the first bytes of the blob.

    `torch.save` writes `data.pkl` first and uncompressed, so the local zip header plus a few
    hundred bytes suffice. None when the blob does not look like that (then nothing is claimed);
    FormatError naming `where` for a pickle over its budget (`budgets`). The result may be
    shared with other calls that read the same `data.pkl` bytes: callers do not change it.
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
    # where the record ends: its size in the local header (stored, so as many bytes as the
    # pickle) or, as torch writes it (flag bit 3), the data descriptor's signature after it.
    # A pickle the unpickler read to exactly there reads the same from any blob starting so.
    size = int.from_bytes(head[18:22], "little") or head.find(b"PK\x07\x08", start) - start
    key = head[start : start + size] if 0 < size <= len(head) - start else None
    if key is not None:
        known = _DECLARED.get(key)
        if known is not None:
            return known
    # the head may end mid-pickle: only the memo is judged, not lengths past its end
    stream = io.BytesIO(head[start:])
    unpickler = _TensorHeaderUnpickler(head[start:], where, stream, complete=False)
    try:
        value = unpickler.load()
    except Exception:
        return None
    if not isinstance(value, SavedTensor):
        return None
    # a BytesIO has no `peek`: the unpickler read exactly up to its STOP
    if key is not None and stream.tell() == size and len(_DECLARED) < _DECLARED_MAX:
        _DECLARED[key] = value
    return value


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


class _StructureUnpickler(BudgetedUnpickler):
    """Unpickles the containers of a `torch.save` payload; every global becomes a stub.

    No global is ever resolved, so nothing can run: a tensor, a numpy array or any class
    instance comes back as a `_Stub` naming what it would have been."""

    def find_class(self, module: str, name: str) -> Any:
        # `torch.save` pickles with protocol 2, which names Python 3's builtins after Python
        # 2's (`__builtin__.set`): mapped back as Python's own unpickler maps them
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        plain = _PLAIN_GLOBALS.get((module, name))
        if plain is not None and plain in (dict, set, frozenset, _latin1_encode):
            return plain
        return _stub_class(_KNOWN_TYPES.get(f"{module}.{name}", f"{module}.{name}"))

    def persistent_load(self, pid: Any) -> Any:
        return _stub_class("storage")()


def peek_saved_mapping(blob: bytes, where: str | None = None) -> dict[str, tuple[str, Any]] | None:
    """For a `torch.save` file holding a dict: each leaf's (type name, small value).

    Nested non-empty dicts with string keys are flattened into dotted names, as `dcp.save`
    flattens a state dict (`args.lr`); `common_leaf` finds a name's value in the loaded dict.

    Read without torch and without resolving any global (see `_StructureUnpickler`). None when
    the blob is not a zip `torch.save` of a dict with string keys; FormatError naming `where`
    for a pickle or record over its budget (`budgets`).
    """
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                return None
            data = read_member(archive, names[0], len(blob) * 4, where)
        value = _StructureUnpickler(data, where).load()
    except FormatError:
        raise
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
