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

Enums pickle as a call of their class with the member's value (`WriteItemType(3)`). The two DCP
pickles, `WriteItemType` (`TENSOR`/`SHARD`/`BYTE_IO` = 1/2/3: `auto()` starts at 1) and
`_MEM_FORMAT_ENCODING` (0/1/2), are mapped member for member (`ENUMS`). A value neither holds
is well-formed pickle that this torch does not define: the error names the enum and the value
and says the file may come from a newer torch, never that it is truncated.
"""

from __future__ import annotations

import gc
import mmap
import pickle
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from ...budgets import BudgetedUnpickler, pickle_refused
from ...dtypes import TORCH_ALIASES
from ...errors import FormatError, UnsafeInputError
from ...models import KeyStep
from .lean import block_of, lean_records

#: the fix of a `.metadata` that unpickles but does not hold what DCP writes
CORRUPT_METADATA_FIX = (
    "The .metadata is corrupt or was not written by torch.distributed.checkpoint: copy the "
    "checkpoint again from where it was saved, or use an earlier checkpoint of the run."
)
#: the fix of a `.metadata` whose pickle does what no DCP save writes
HOSTILE_FIX = "This file is corrupt or hostile; do not load it with torch either."

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
_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "_mkldnn"})
_MEMORY_FORMATS = frozenset({"contiguous_format", "channels_last", "preserve_format"})
_MEM_ENCODING = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}


class DType(str):
    """A torch dtype read from a pickle, as its canonical name (`float32`)."""


class _Record:
    """Base of the stand-ins: built by pickle's NEWOBJ + BUILD with a `__dict__` state.

    The stand-ins a `.metadata` holds one of per chunk (`ChunkStorageMetadata`,
    `MetadataIndex`, `StorageInfo`) or per tensor (`TensorStorageMetadata`,
    `TensorProperties`) keep their fields in slots: a million-chunk checkpoint holds three
    million of them while its manifest is built, and a save of 100,000 small tensors half a
    million (a `__dict__` each was ~150 bytes more per tensor, #30).
    """

    __slots__ = ()
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
        if type(state) is tuple and len(state) > 2 and state[0] is None:
            self._set_lean(state)
            return
        # dataclasses with __slots__ pickle (None, slots); ours always use __dict__ states
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        for name in self._fields:
            if name in state:
                object.__setattr__(self, name, state[name])
        # the unpickler's memo keeps the state dict until the load ends; emptied, it holds
        # nothing twice (a pickler writes one state per object: none is read by two BUILDs)
        state.clear()

    def _set_lean(self, state: tuple[Any, ...]) -> None:
        """The state of a record `lean.lean_records` rewrote: (None, key, value, key, value...),
        a Size's value being the `torch.Size` stand-in followed by its tuple."""
        fields = self._fields
        items = iter(state)
        next(items)
        for key in items:
            if type(key) is not str:
                raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
            value = next(items)  # StopIteration: a key without a value, refused by the load
            if value is _size:
                value = next(items)
                if type(value) is not tuple:
                    raise pickle.UnpicklingError("torch.Size of something that is not a tuple")
            if key in fields:
                object.__setattr__(self, key, value)

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

    __slots__ = _fields = ("properties", "size", "chunks")
    properties: Any
    size: Any
    chunks: Any


class BytesStorageMetadata(_Record):
    """Stand-in for `BytesStorageMetadata` (a non-tensor entry)."""


class ChunkStorageMetadata(_Record):
    """Stand-in for `ChunkStorageMetadata`: offsets and sizes of one chunk."""

    __slots__ = _fields = ("offsets", "sizes")


class TensorProperties(_Record):
    """Stand-in for `TensorProperties` (pickled as a 5-tuple by its `__getstate__`)."""

    __slots__ = _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

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

    __slots__ = _fields = ("fqn", "offset", "index")

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

    __slots__ = _fields = ("relative_path", "offset", "length", "transform_descriptors")


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


class UnknownEnumMember(Exception):
    """A pickled enum call with a value the enum (as torch 2.13 defines it) has no member for."""

    def __init__(self, enum: str, value: Any, known: dict[Any, str]):
        super().__init__(f"{enum}({value!r})")
        self.enum = enum
        self.value = value
        self.known = known


class EnumStandIn:
    """Stand-in for one torch enum class: called with a member's value (how an enum pickles),
    it returns the name ckpt keeps for that member; any other value is `UnknownEnumMember`.

    Attributes:
        qualname: the enum's module and class (`torch.distributed.checkpoint.planner.WriteItemType`).
        members: value -> what the stand-in returns (every member torch 2.13 defines).
    """

    def __init__(self, qualname: str, members: dict[Any, str]):
        self.qualname = qualname
        self.members = members

    def __call__(self, value: Any) -> str:
        # bool is an int: `WriteItemType(True)` is no pickle torch writes
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise UnknownEnumMember(self.qualname, value, self.members)
        name = self.members.get(value)
        if name is None:
            raise UnknownEnumMember(self.qualname, value, self.members)
        return name


_PLANNER = "torch.distributed.checkpoint.planner"
#: every enum DCP pickles into `.metadata`, member for member (torch 2.13); a test checks the
#: table against torch's own classes
ENUMS: dict[tuple[str, str], EnumStandIn] = {
    # `auto()` numbers from 1; a save plan's items (Megatron keeps the plans in `.metadata`)
    (_PLANNER, "WriteItemType"): EnumStandIn(
        f"{_PLANNER}.WriteItemType", {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"}
    ),
    **{
        (module, "_MEM_FORMAT_ENCODING"): EnumStandIn(
            f"{module}._MEM_FORMAT_ENCODING", _MEM_ENCODING
        )
        for module in _METADATA_MODULES
    },
}


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
        known = {f"torch.{layout}": layout for layout in sorted(_LAYOUTS)}
        raise UnknownEnumMember("torch.serialization._get_layout", name, known)
    return name.removeprefix("torch.")


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
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(module, name): value for module in _METADATA_MODULES for name, value in _CLASSES.items()},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.distributed.checkpoint._fsspec_filesystem", "_StorageInfo"): StorageInfo,
    # the save-plan classes Megatron-Core's torch_dist writer pickles into `.metadata`
    ("torch.distributed.checkpoint.planner", "SavePlan"): SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): WriteItem,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): TensorWriteData,
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): BytesIOWriteData,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): StoragePrefix,
    **ENUMS,
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


#: budgets of one `.metadata` load (a hostile pickle can describe a huge graph in few bytes):
#: the file's size, checked before it is read...
MAX_METADATA_BYTES = 1 << 30
#: ... the objects unpickling may build: as many as a `.metadata` of `MAX_METADATA_BYTES`
#: written by torch holds (9-11 per chunk in 110-145 bytes of pickle: about one object per
#: 10-16 bytes; a 405B model saved by 2,048 ranks with FSDP 256 x TP 8 is 1.9M chunks, 21M
#: objects, refused by the 20M this was before #30) ...
MAX_METADATA_OBJECTS = 110_000_000
#: ... and, past the first million, at most one object per this many bytes read (a pickle that
#: builds an object per byte or two is a memory bomb, refused after a few MiB)
METADATA_BYTES_PER_OBJECT = 4
_FREE_OBJECTS = 1_000_000
#: how deep a `planner_data` value may nest (DCP writes a flat tuple of path components);
#: the writer pickles it again, and a deeper one would blow the recursion limit there
MAX_PLANNER_DEPTH = 100


def over_budget(where: str, what: str) -> FormatError:
    """The error for a `.metadata` that exceeds one of the budgets above."""
    return FormatError(
        f"holds {what}; ckpt refuses it (a hostile or corrupt .metadata)",
        path=where,
        fix="This is not DCP metadata as torch writes it; do not load it with torch either.",
    )


class _BudgetedInput:
    """The pickle input: the C unpickler prefetches it through `peek` (128 KiB at a time), and
    each prefetch checks how many objects the load has built so far. The pickle comes in
    blocks, each let go (`lean.block_of`: given back to the system) once read past.

    Objects are counted as the cyclic GC's allocation count (every list, dict, tuple and
    instance), which keeps counting while the GC is paused (as it is during the load).
    """

    def __init__(self, blocks: Sequence[bytes | mmap.mmap], where: str):
        self._rest = list(blocks)[::-1]  # the next block last; each is let go once read
        self._buf: bytes | mmap.mmap = b""
        self._at = 0  # in `_buf`
        self._pos = 0  # in the whole pickle
        self._where = where
        self._start = gc.get_count()[0]

    def _check(self) -> None:
        built = gc.get_count()[0] - self._start
        allowed = min(MAX_METADATA_OBJECTS, _FREE_OBJECTS + self._pos // METADATA_BYTES_PER_OBJECT)
        if built > allowed:
            raise over_budget(
                self._where,
                f"a pickle that builds more than {allowed:,} objects from its first "
                f"{self._pos:,} bytes",
            )

    def _fill(self, n: int) -> None:
        """At least `n` bytes from the position in `_buf` (fewer at the end of the pickle)."""
        while len(self._buf) - self._at < n and self._rest:
            merged = block_of([self._buf[self._at :], self._rest.pop()])  # type: ignore[list-item]
            if isinstance(self._buf, mmap.mmap):
                self._buf.close()
            self._buf, self._at = merged, 0

    def _take(self, n: int) -> bytes:
        out = self._buf[self._at : self._at + n]
        self._at += len(out)
        self._pos += len(out)
        return out

    def peek(self, n: int = 1) -> bytes:
        self._check()
        n = max(n, 1)
        self._fill(n)
        return self._buf[self._at : self._at + n]

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = len(self._buf) - self._at + sum(len(block) for block in self._rest)
        self._fill(n)
        return self._take(n)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        out = self.read(len(view))
        view[: len(out)] = out
        return len(out)

    def readline(self) -> bytes:
        # a line (a GLOBAL's module or name) is short: it is looked for in the rest of this
        # block and the next one; past them, what is there is the line, as at the end
        end = self._buf.find(b"\n", self._at)
        if end < 0:
            self._fill(len(self._buf) - self._at + 1)
            end = self._buf.find(b"\n", self._at)
        return self._take(len(self._buf) - self._at if end < 0 else end + 1 - self._at)


class MetadataUnpickler(BudgetedUnpickler):
    """An unpickler that admits only DCP metadata globals, mapped to the stand-ins above."""

    def __init__(self, data: bytes | Sequence[mmap.mmap], where: str, *, walked: bool = False):
        """`data`: the pickle, or (once walked: `lean.lean_records`) its blocks in order."""
        if isinstance(data, bytes):
            self._input = _BudgetedInput([data], where)
            super().__init__(data, where, self._input, walked=walked)
        elif walked:
            self._input = _BudgetedInput(data, where)
            super().__init__(b"", where, self._input, walked=True)
        else:
            raise TypeError("a pickle in blocks is loaded only once walked")
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch":
            if name in TORCH_DTYPES:
                return DType(TORCH_ALIASES.get(name, name))
            if name in _LAYOUTS:
                return name
            if name in _MEMORY_FORMATS:
                return name
        if module == "torch" or module.startswith("torch.distributed.checkpoint."):
            # well-formed torch names a newer torch may pickle (a new dtype, a new class)
            fix = (
                f"If the file comes from a torch newer than 2.13 (which has no {module}.{name} "
                "in DCP metadata), update ckpt; otherwise it is corrupt or hostile: do not "
                "load it with torch either."
            )
        else:
            fix = "This file is corrupt or hostile; do not load it with torch either."
        raise UnsafeInputError(
            f"is a pickle that calls {module}.{name}, which is not part of DCP metadata; "
            "it was not run",
            path=self.where,
            fix=fix,
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeInputError(
            "is a pickle with persistent ids, which DCP metadata never has; it was not loaded",
            path=self.where,
            fix=HOSTILE_FIX,
        )


def load_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle a `.metadata` file's bytes into stand-ins, refusing anything not on the list.

    Within budgets (`MAX_METADATA_BYTES`, `MAX_METADATA_OBJECTS`, `METADATA_BYTES_PER_OBJECT`,
    `MAX_PLANNER_DEPTH`): past one, FormatError naming `where`, before memory runs out.
    """
    if len(data) > MAX_METADATA_BYTES:
        raise over_budget(where, f"{len(data):,} bytes, more than {MAX_METADATA_BYTES:,}")
    enabled = gc.isenabled()
    gc.disable()  # collections would reset the allocation count the budget reads
    try:
        # torch's per-chunk records read lean (see `lean`: the walk that finds them on opcodes
        # is the memo budget's), from blocks let go once read: at the end of the load, when
        # every record is built, the file's bytes are gone
        blocks, overreach = lean_records(data)
        del data
        if overreach is not None:
            raise pickle_refused(overreach, where)
        unpickler = MetadataUnpickler(blocks, where, walked=True)
        del blocks  # the unpickler's input holds them, and lets each go once read
        result = unpickler.load()
    except (UnsafeInputError, FormatError):
        raise
    except RecursionError:
        raise FormatError(
            "is a pickle nested too deeply to be DCP metadata", path=where, fix=HOSTILE_FIX
        ) from None
    except UnknownEnumMember as exc:
        raise unknown_member_error(exc, where) from None
    except Exception as exc:
        raise FormatError(
            f"is not a readable DCP metadata pickle ({type(exc).__name__}: {exc})",
            path=where,
            fix="The file is truncated or corrupt; the save was probably interrupted.",
        ) from None
    finally:
        if enabled:
            gc.enable()
    if not isinstance(result, Metadata):
        raise FormatError(
            f"holds a {type(result).__name__}, not DCP Metadata",
            path=where,
            fix="This is not a torch.distributed.checkpoint folder.",
        )
    _check_planner_depth(result.planner_data, where)
    return result


def unknown_member_error(exc: UnknownEnumMember, where: str) -> FormatError:
    """The error for a well-formed `.metadata` holding a value torch 2.13 does not define."""
    known = ", ".join(f"{name} = {value!r}" for value, name in exc.known.items())
    return FormatError(
        f"holds {exc.enum}({exc.value!r}), a value torch 2.13 does not define (it knows "
        f"{known}); the pickle is well-formed, so the file may come from a newer torch",
        path=where,
        fix="Update ckpt to a release that reads this torch's DCP metadata; the torch that "
        "wrote the file loads it with its own reader.",
    )


def _check_planner_depth(planner_data: Any, where: str) -> None:
    """Every `planner_data` value nests at most `MAX_PLANNER_DEPTH` containers deep."""
    if not isinstance(planner_data, dict):
        return
    flat = (str, int)
    # what DCP writes (a flat tuple of path components) needs no walk
    nested = [
        v
        for v in planner_data.values()
        if isinstance(v, dict)
        or (isinstance(v, (list, tuple)) and not all(type(x) in flat for x in v))
    ]
    stack: list[tuple[Any, int]] = [(v, 1) for v in nested]
    seen: set[int] = set()
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (list, tuple, dict)) or id(value) in seen:
            continue
        if depth > MAX_PLANNER_DEPTH:
            raise over_budget(where, f"planner data nested more than {MAX_PLANNER_DEPTH} deep")
        seen.add(id(value))
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items)


# --- planner_data: where each fqn sits in the nested state dict ----------------------------
#
# `dcp.save` flattens the state dict with `traverse_state_dict`: a mapping's keys become str
# path components, a list's positions int ones, and `planner_data` records the path of each
# fqn (`("optim", "param_groups", 0, "lr")`). Loaders without a template (`dcp_to_torch_save`)
# rebuild the nesting from these paths, a list wherever the component is an int.


def planner_keys(path: Any, name: str) -> tuple[KeyStep, ...] | None:
    """The key path of fqn `name` from its `planner_data` value, or None when the value is not
    a path that spells `name` (what `dcp.save` records for a nested state dict always is)."""
    if not isinstance(path, (tuple, list)) or not path:
        return None
    keys: list[KeyStep] = []
    for key in path:
        if type(key) is int:
            keys.append(("list", key))
        elif type(key) is str:
            keys.append(("dict", key))
        else:
            return None
    return tuple(keys) if ".".join(str(key) for _, key in keys) == name else None


def planner_paths(
    leaves: Iterable[tuple[str, Sequence[KeyStep], bool]],
) -> dict[str, tuple[str | int, ...]]:
    """The `planner_data` values `dcp.save` records for leaves given as (name, key path,
    is a tensor): a key of a dict as a str (an optimizer's int `state` keys too), a position in
    a list as an int where torch's traversal walks into that list.

    torch walks into a list only when an item is a tensor, a dict or such a list; any other
    list is one leaf. ckpt keeps a list of empty dicts (a scheduler's `lr_lambdas: [{}, {}]`)
    as one entry per item, so such a list's positions are recorded as strings: a loader
    without a template then rebuilds it as a dict, and finds every entry where it looks.
    """
    leaves = list(leaves)
    walked: set[tuple[KeyStep, ...]] = set()  # lists torch walks into, by their key path
    for _, keys, tensor in leaves:
        for depth, (kind, _) in enumerate(keys):
            if kind == "list" and (tensor or depth < len(keys) - 1):
                walked.add(tuple(keys[:depth]))
    return {
        name: tuple(
            int(key) if kind in ("list", "tuple") and tuple(keys[:depth]) in walked else str(key)
            for depth, (kind, key) in enumerate(keys)
        )
        for name, keys, _ in leaves
    }
