"""Plain values of small `torch.save` blobs, read without torch (the metadata-path reader).

A training checkpoint keeps its counters and optimizer settings as small pickled values: a DCP
stores each non-tensor entry (`optimizer.param_groups.*.lr`, a scheduler's `last_epoch`) as a
`torch.save` blob, and a step counter as a one-element tensor. `inspect` and plain `verify`
need those values for the training summary; loading them with `torch.load` would import torch
(1.5-7 s) on a path that otherwise reads headers only.

This module unpickles such a blob with a `pickle.Unpickler` whose `find_class` admits only
plain containers (`collections.OrderedDict`, `set`, `frozenset`, protocol 2's `_codecs.encode`)
and the tensor rebuild functions, which it maps to `SavedTensorValue` records: nothing is
imported and nothing callable from the stream runs. A one-element tensor's value is decoded from
its storage record in the zip; larger tensors and numpy arrays stay records without data, which
the summary does not need. Anything else (any other global) is refused with `NotPlain`.

An object a framework pickles whole (accelerate's `sampler.bin`: its `SeedableRandomSampler`
itself, not a state dict) is read by `read_pickled_object` instead: every global is a stand-in
that keeps its name and the state the pickle hands it, so the object's class and its plain
attributes (a sampler's `epoch` and `initial_seed`) are read as data, and nothing of the class
is imported or run.
"""

from __future__ import annotations

import io
import pickletools
import struct
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ... import dtypes
from ...budgets import BudgetedUnpickler, read_member
from ...dtypes import STORAGE_DTYPES
from ...errors import CkptError, FormatError
from .preflight import Opaque

if TYPE_CHECKING:
    from ...storage.base import Storage

#: the largest blob read here: the values a summary needs are a few KiB; a larger object
#: entry is left to the data paths (`--deep`), which load it with torch
MAX_BLOB_BYTES = 4 << 20

#: `torch.<dtype>` globals (a v3 rebuild names the dtype) -> canonical names
_TORCH_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float64": "float64",
    "double": "float64",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "short": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}
#: struct codes of the scalar dtypes decoded here (little-endian, as torch.save writes)
_STRUCT = {
    "float32": "<f",
    "float64": "<d",
    "float16": "<e",
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}


class NotPlain(Exception):
    """The blob holds something beyond plain data and tensors (a global this reader refuses)."""


def decode_scalar(raw: bytes, dtype: str) -> int | float | bool | None:
    """The Python value of one element of `dtype` stored as `raw` (None for dtypes not kept)."""
    if dtype == "bfloat16" and len(raw) >= 2:
        # bfloat16 is the top half of a float32
        return float(struct.unpack("<f", b"\x00\x00" + raw[:2])[0])
    code = _STRUCT.get(dtype)
    if code is None or len(raw) < struct.calcsize(code):
        return None
    value = struct.unpack(code, raw[: struct.calcsize(code)])[0]
    return bool(value) if dtype == "bool" else value


class SavedTensorValue:
    """A tensor inside a blob, as declared: dtype, shape and (one element only) its value.

    Mirrors the part of the tensor API the training summary uses: `numel()` and `item()`.
    """

    def __init__(self, dtype: str, shape: list[int], value: int | float | bool | None):
        self.dtype = dtype
        self.shape = shape
        self.value = value

    def numel(self) -> int:
        return dtypes.numel(self.shape)

    def item(self) -> int | float | bool:
        if self.value is None:
            raise ValueError(f"a {self.dtype} tensor of shape {self.shape} has no single value")
        return self.value

    def __repr__(self) -> str:
        return f"SavedTensorValue({self.dtype}, {self.shape}, {self.value!r})"


class _Storage:
    """A storage record: its dtype (None for an untyped storage) and the bytes it names."""

    def __init__(self, dtype: str | None, data: bytes | None):
        self.dtype = dtype
        self.data = data


def _latin1_encode(text: Any, encoding: str = "latin1") -> bytes:
    """How pickle protocol 2 stores bytes: `_codecs.encode(str, 'latin1')`."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise NotPlain("_codecs.encode with another encoding")
    return text.encode("latin1")


class _Array:
    """A numpy array or dtype inside the blob: recorded, never built (RNG states hold them)."""

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> SavedTensorValue:
    """`torch._utils._rebuild_tensor_v2/v3`, as a record: dtype, shape, one element's value."""
    if not isinstance(storage, _Storage) or not isinstance(size, tuple):
        raise NotPlain("a tensor without a storage record")
    dtype = storage.dtype
    # v3 (dtypes without a typed storage): (..., requires_grad, hooks, dtype[, metadata])
    if len(rest) >= 3 and isinstance(rest[2], str):
        dtype = rest[2]
    if dtype is None:
        raise NotPlain("a tensor of unknown dtype")
    shape = [int(d) for d in size]
    value = None
    if dtypes.numel(shape) == 1 and storage.data is not None and isinstance(offset, int):
        start = offset * dtypes.itemsize(dtype) if dtypes.is_known(dtype) else -1
        if start >= 0:
            value = decode_scalar(storage.data[start:], dtype)
    return SavedTensorValue(dtype, shape, value)


_PLAIN: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    # protocol 2 (what torch.save writes) names builtins by their Python 2 module
    **{(module, "set"): set for module in ("builtins", "__builtin__")},
    **{(module, "frozenset"): frozenset for module in ("builtins", "__builtin__")},
    ("_codecs", "encode"): _latin1_encode,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild,
    ("torch.storage", "UntypedStorage"): None,
    ("numpy", "ndarray"): _Array,
    ("numpy", "dtype"): _Array,
    **{
        (module, name): _Array
        for module in ("numpy._core.multiarray", "numpy.core.multiarray")
        for name in ("_reconstruct", "scalar")
    },
}


class _PlainUnpickler(BudgetedUnpickler):
    """Admits plain containers and tensor records only (see the module docstring)."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, where: str | None):
        super().__init__(data, where)
        self._archive = archive
        self._prefix = prefix

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return _PLAIN[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel), as torch.save writes it
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain("a persistent id that is not a storage")
        dtype, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(key, str) or not isinstance(numel, int):
            raise NotPlain("a malformed storage record")
        data = None
        if numel <= 16:  # only one-element tensors are decoded; keep the read tiny
            try:
                data = read_member(self._archive, f"{self._prefix}data/{key}", 256, None)
            except (KeyError, zipfile.BadZipFile, OSError, ValueError, FormatError):
                data = None
        return _Storage(dtype if isinstance(dtype, str) else None, data)


def load_plain(blob: bytes, where: str | None = None) -> Any:
    """The value a `torch.save` blob holds, when it is plain data (and tensors as records).

    Raises `NotPlain` for a blob that is no torch.save zip, is over `MAX_BLOB_BYTES`, or names a
    global beyond plain containers, numpy arrays and tensors; FormatError naming `where` for a
    pickle or record over its budget (`budgets`), which no reader should follow.
    """
    if len(blob) > MAX_BLOB_BYTES:
        raise NotPlain(f"a blob of {len(blob)} bytes")
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(names) != 1:
                raise NotPlain("not a torch.save archive")
            prefix = names[0][: -len("data.pkl")]
            data = read_member(archive, names[0], MAX_BLOB_BYTES, where)
            value = _PlainUnpickler(data, archive, prefix, where).load()
    except (NotPlain, FormatError):
        raise
    except Exception as exc:  # a truncated or corrupt blob: no value, never a crash
        raise NotPlain(f"unreadable ({type(exc).__name__})") from None
    return value


def saved_scalar(blob: bytes, where: str | None = None) -> int | float | bool | None:
    """The value of a one-element tensor saved alone with `torch.save` (None otherwise)."""
    try:
        value = load_plain(blob, where)
    except NotPlain:
        return None
    return value.value if isinstance(value, SavedTensorValue) else None


class _BareUnpickler(BudgetedUnpickler):
    """A pickle of plain containers only: no tensors, no persistent ids, no other globals."""

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN.get((module, name))
        if found is dict or found is set or found is frozenset or found is _latin1_encode:
            return found
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise NotPlain("a persistent id in a bare pickle")


def load_plain_pickle(data: bytes, where: str | None = None) -> Any:
    """The value of a bare `pickle.dumps` of plain data (torchtitan keeps its data loader's
    state as such bytes inside the checkpoint), never running anything.

    Raises `NotPlain` for one over `MAX_BLOB_BYTES`, one naming any global beyond plain
    containers, or one that does not read; FormatError naming `where` for a pickle over its
    budget (`budgets`).
    """
    if len(data) > MAX_BLOB_BYTES:
        raise NotPlain(f"a pickle of {len(data)} bytes")
    try:
        return _BareUnpickler(data, where).load()
    except (NotPlain, FormatError):
        raise
    except Exception as exc:  # truncated or corrupt: no value, never a crash
        raise NotPlain(f"unreadable ({type(exc).__name__})") from None


#: the most distinct globals `read_pickled_object` makes stand-ins for (one class each): a
#: sampler's pickle names a dozen
_MAX_STANDS = 256
#: a plain string attribute longer than this is not kept (a value to show, not a payload)
_MAX_TEXT = 200
#: an int attribute wider than this many bits is not kept: a sampler's epoch and seed fit in 64,
#: and a pickled int of 10^5 digits is past what Python will print (`sys.int_info`)
_MAX_INT_BITS = 128


@dataclass(frozen=True)
class PickledObject:
    """An object a torch.save file pickles whole, as far as it reads without its class.

    Attributes:
        cls: the class the pickle names for it (`accelerate.data_loader.SeedableRandomSampler`).
        values: its attributes that are plain numbers, booleans, short strings or None, by
            name (`epoch`, `initial_seed`).
        objects: its attributes that are objects of other classes, by name -> that class
            (`data_source` -> `torch.utils.data.dataset.TensorDataset`); never read further.
    """

    cls: str
    values: dict[str, int | float | bool | str | None] = field(default_factory=dict)
    objects: dict[str, str] = field(default_factory=dict)
    #: the attributes of `objects` the pickle builds by calling their class with one plain
    #: value (an enum member, `SchedulerType('cosine')`), by name -> that value (`cosine`):
    #: what the pickle says, never the result of any call
    built: dict[str, int | float | bool | str | None] = field(default_factory=dict)


class _Stand(Opaque):
    """Any global of the pickle and what it builds: keeps the state BUILD hands it, runs
    nothing (the class it stands for is never imported)."""

    original: ClassVar[str] = ""
    state: Any = None
    #: what the pickle called it with (REDUCE, NEWOBJ): an enum member's value
    args: tuple[Any, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stand:
        made = object.__new__(cls)
        made.args = args
        return made

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _ObjectUnpickler(BudgetedUnpickler):
    """Plain containers as themselves, every other global a `_Stand` subclass of its name."""

    def __init__(self, data: bytes, where: str | None):
        super().__init__(data, where)
        self._stands: dict[str, type[_Stand]] = {}

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 names Python 3's modules by their Python 2 names (`__builtin__`)
        module, name = NAME_MAPPING.get((module, name), (module, name))
        module = IMPORT_MAPPING.get(module, module)
        plain = _PLAIN.get((module, name))
        if plain is dict or plain is set or plain is frozenset or plain is _latin1_encode:
            return plain
        full = f"{module}.{name}"
        stand = self._stands.get(full)
        if stand is None:
            if len(self._stands) >= _MAX_STANDS:
                raise NotPlain(f"more than {_MAX_STANDS} globals")
            stand = type("Stand", (_Stand,), {"original": full})
            self._stands[full] = stand
        return stand

    def persistent_load(self, pid: Any) -> Any:
        return None  # a storage record: its bytes are never read here


#: the head of a pickle read for its class when the whole is over `MAX_BLOB_BYTES`
_HEAD_BYTES = 4096


def _head_class(head: bytes) -> str | None:
    """The class of the object a protocol 2 pickle builds first, when it opens with it (the
    way `torch.save` pickles a class instance: PROTO, GLOBAL, EMPTY_TUPLE, NEWOBJ), read from
    the opcodes of its `head`; None for any other opening."""
    wanted = ["PROTO", "GLOBAL", "EMPTY_TUPLE", "NEWOBJ"]
    cls = None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                continue
            if op.name != wanted[0]:
                return None
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                module, name = NAME_MAPPING.get((module, name), (module, name))
                cls = f"{IMPORT_MAPPING.get(module, module)}.{name}"
            wanted.pop(0)
            if not wanted:
                return cls
    except (ValueError, EOFError):
        return None
    return None


def _plain_attribute(value: Any) -> bool:
    if type(value) is int:
        return value.bit_length() <= _MAX_INT_BITS
    if value is None or type(value) in (float, bool):
        return True
    return type(value) is str and len(value) <= _MAX_TEXT


def read_pickled_object(storage: Storage, rel: str) -> PickledObject | None:
    """The class and plain attributes of the object the torch.save file `rel` of `storage`
    pickles whole (`PickledObject`), read from its `data.pkl` (at most `MAX_BLOB_BYTES`; the
    storage records are never read) with every global a stand-in: nothing is imported or run.

    None when the file holds no object of a class (plain data, which torch's weights_only
    loader reads), is no torch.save zip, or does not read within the budgets; the torch
    format's own reader then says what it is."""
    from ...storage.base import StorageRangeFile

    where = storage.describe(rel)
    try:
        with zipfile.ZipFile(StorageRangeFile(storage, rel)) as archive:
            names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(names) != 1:
                return None
            info = archive.getinfo(names[0])
            if info.file_size > MAX_BLOB_BYTES:
                # an object pickled with a large payload (a dataset held in memory): its
                # class from the head of the pickle, its attributes left unread
                with archive.open(info) as member:
                    cls = _head_class(member.read(_HEAD_BYTES))
                return PickledObject(cls=cls) if cls is not None else None
            data = read_member(archive, names[0], MAX_BLOB_BYTES, where)
        root = _ObjectUnpickler(data, where).load()
    except CkptError:
        return None  # over a budget, or unreadable: the torch format's reader says so
    except Exception:  # any bytes: a corrupt zip or pickle is the torch format's to report
        return None
    if not isinstance(root, _Stand):
        return None
    state = root.state
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
        state = state[0] if isinstance(state[0], dict) else state[1]
    attributes = state if isinstance(state, dict) else {}
    objects = {
        k: v
        for k, v in attributes.items()
        if isinstance(k, str) and isinstance(v, _Stand) and type(v).original
    }
    return PickledObject(
        cls=type(root).original,
        values={k: v for k, v in attributes.items() if isinstance(k, str) and _plain_attribute(v)},
        objects={k: type(v).original for k, v in objects.items()},
        built={
            k: v.args[0]
            for k, v in objects.items()
            if v.state is None and len(v.args) == 1 and _plain_attribute(v.args[0])
        },
    )
