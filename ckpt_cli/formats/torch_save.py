"""torch: files written by `torch.save` (`.pt/.pth/.bin/.ckpt`), and sharded
`pytorch_model.bin.index.json` folders.

I/O strategy: a torch.save file is a zip of one pickle plus one record per storage. `open`
loads it with `torch.load(weights_only=True, mmap=True, map_location="cpu")`: the pickle is
unpickled by torch's restricted unpickler (nothing outside its allow-list can run; a file that
asks for anything else is refused with `UnsafeInputError`, exit 4) and storages are memory-mapped,
so listing dtypes and shapes reads no tensor data. Old (pre-1.6, non-zip) files cannot be
mapped; they are loaded whole, still with `weights_only=True`.

Nested containers are flattened to dotted names (`optimizer.state.0.exp_avg`); every entry
remembers its real key path (`TorchEntry.key_path`) so the writer can rebuild the exact
nesting. Leaves that are not tensors are `object` entries with their Python type and, for small
scalars, their value. numpy arrays and scalars (found in RNG states) are admitted as data, as
transformers and accelerate do; they cannot run code.

Remote files (the Hub, object stores) load with `map_location="meta"`: only the zip
directory and the pickle are fetched by ranged reads; reading a tensor then fetches its file
once (one file held at a time).

The writer saves one file (nesting rebuilt from key paths when entries came from a torch.save
file and were not renamed, otherwise flat keys), or, with `max_shard_size`, Hugging Face style
flat shards `pytorch_model-00001-of-00002.bin` plus `pytorch_model.bin.index.json`, written last.
Each tensor is streamed into its file's zip container as it arrives (`torch_zip`): one tensor
in memory at a time, whatever the file or shard size.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from ..errors import CkptError, FormatError, NotFoundError, UnsafeInputError
from ..models import Entry, FileInfo, Manifest, Problem
from ..problems import Findings
from ..storage import Storage, StorageRangeFile
from .base import Checkpoint, Format, Source, WriteOptions, Writer
from .safetensors import plan_shards
from .torch_zip import TorchZipWriter
from .weight_map import (
    BIN_INDEX_SUFFIX,
    ShardContents,
    check_index,
    find_index,
    read_index,
    report_bad_index,
    report_missing_shard,
    shards_to_check,
)

if TYPE_CHECKING:
    import torch

#: file suffixes torch.save files usually carry
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
ZIP_MAGIC = b"PK\x03\x04"
#: longest string an object entry shows as its value
MAX_VALUE_STR = 200
#: longest list of scalars an object entry shows as its value
MAX_VALUE_ITEMS = 16

#: one step of a key path: (kind of the container holding the key, the key)
KeyStep = tuple[str, str | int]


class TorchEntry(Entry):
    """An entry of a torch.save file, with the real key path inside the saved object.

    Attributes:
        key_path: the keys from the saved object's root to this leaf, each with the kind of
            container holding it (`dict`, `odict`, `list`, `tuple`). The writer rebuilds the
            nesting from it while `name` still equals the dotted join of the keys.
    """

    key_path: tuple[KeyStep, ...] = ()


def dotted(key_path: tuple[KeyStep, ...] | list[KeyStep]) -> str:
    """The flattened name of a key path (`optimizer.state.0.exp_avg`)."""
    return ".".join(str(key) for _, key in key_path)


# --------------------------------------------------------------------------- loading


def _numpy_allowlist() -> list[Any]:
    """numpy globals that only build arrays and scalars from bytes (RNG states hold them).

    transformers and accelerate allow-list the same ones for `rng_state.pth` and
    `random_states_*.pkl`; none of them can call arbitrary code.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return []
    core = getattr(np, "_core", None) or np.core
    allow: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    # files written under numpy 1.x name the same functions under `numpy.core`
    allow += [
        (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (core.multiarray.scalar, "numpy.core.multiarray.scalar"),
    ]
    for code in "?bBhHiIlLqQefdgFDGSUV":
        allow.append(type(np.dtype(code)))
    return allow


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
    return [*_numpy_allowlist(), *_generator_allowlist()]


#: classes DeepSpeed pickles into its checkpoints that only carry data (loss scaler settings,
#: the ZeRO stage, parameter fragment addresses). They load as inert records: their pickled
#: state is kept, their code is never imported or run. Without them no ZeRO optimizer file
#: loads under weights_only.
INERT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    # hyper-parameters of older Lightning checkpoints
    "argparse.Namespace",
)
#: dict subclasses that carry plain mappings (Lightning's hyper-parameters): loaded as dicts
INERT_DICTS = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
)


class InertObject:
    """A stand-in for an allow-listed class: holds the pickled arguments and state, no code."""

    original: ClassVar[str] = ""
    # class-level defaults: NEWOBJ builds instances without calling __init__
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.state = kwargs or None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __deepcopy__(self, memo: dict[int, Any]) -> InertObject:
        new = type(self).__new__(type(self))
        new.args = copy.deepcopy(self.args, memo)
        new.state = copy.deepcopy(self.state, memo)
        return new

    def as_plain(self) -> dict[str, Any]:
        """What the torch writer stores instead (the original class is not importable here)."""
        return {"__class__": self.original, "args": list(self.args), "state": self.state}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.args == other.args and self.state == other.state

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<inert {self.original} args={self.args!r} state={self.state!r}>"


class InertDict:
    """A stand-in for an allow-listed dict subclass: unpickles as a plain dict (its items follow
    through SETITEMS, which torch's loader allows on plain dicts only)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return {}


_INERT: dict[str, type] = {
    name: type(name.rsplit(".", 1)[1], (InertObject,), {"original": name}) for name in INERT_CLASSES
}
_INERT.update(
    {name: type(name.rsplit(".", 1)[1], (InertDict,), {"original": name}) for name in INERT_DICTS}
)


@contextmanager
def _safe_globals() -> Iterator[None]:
    import torch

    inert = [(cls, name) for name, cls in _INERT.items()]
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
    if size == 0:
        raise FormatError(
            "is empty", path=where, fix="The save was interrupted; write the file again."
        )
    zipped = is_zip(storage, rel)
    if not zipped:
        _refuse_non_pickle(storage, rel, where, size)
    local = storage.local_path(rel)
    try:
        # torch warns about pickle protocols and legacy files on stderr; errors say it instead
        with _safe_globals(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if local is not None:
                obj = torch.load(local, weights_only=True, mmap=zipped, map_location="cpu")
            elif meta and zipped:
                reader = io.BufferedReader(
                    StorageRangeFile(storage, rel, size), buffer_size=_RANGE_BUF
                )
                obj = torch.load(reader, weights_only=True, map_location="meta")
            else:
                obj = torch.load(
                    io.BytesIO(storage.read_all(rel)), weights_only=True, map_location="cpu"
                )
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
        raise FormatError(
            "is not a torch.save file torch's weights_only loader accepts "
            f"({_first_line(text, 'WeightsUnpickler error:')})",
            path=where,
            fix="Plain pickles are never unpickled by ckpt; re-save it with torch.save.",
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError) as exc:
        raise FormatError(
            f"is not a readable torch.save file ({_first_line(str(exc))})",
            path=where,
            fix="The file is truncated or corrupt; write or fetch it again.",
        ) from None
    return obj, not zipped


def _refuse_non_pickle(storage: Storage, rel: str, where: str, size: int) -> None:
    """A file that is neither a ZIP archive nor a pickle is no torch.save file: say what it is."""
    from ..sniff import SNIFF_BYTES, what_is

    head = storage.read(rel, 0, min(size, SNIFF_BYTES))
    if head[:1] == b"\x80":  # a pickle protocol marker: legacy torch.save, judged by the loader
        return
    raise FormatError(
        f"is not a torch.save file: it is {what_is(head, size)} (torch.save writes a ZIP "
        "archive, or a pickle for legacy files)",
        path=where,
        fix="Check the path; if it is a checkpoint of another format, name it by that "
        "format's suffix or pass --format.",
    )


def _first_line(text: str, after: str | None = None) -> str:
    if after and after in text:
        text = text.split(after, 1)[1]
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return "unknown error"


# --------------------------------------------------------------------------- flattening


def _is_tensor(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.Tensor)


def _holds(obj: Any, dicts: bool, depth: int = 0) -> bool:
    """Whether a list/tuple holds a tensor (or, with `dicts`, a dict) worth flattening into."""
    if depth > 8:
        return False
    for item in obj:
        if _is_tensor(item) or (dicts and isinstance(item, dict)):
            return True
        if isinstance(item, (list, tuple)) and _holds(item, dicts, depth + 1):
            return True
        if isinstance(item, dict) and _holds(list(item.values()), dicts, depth + 1):
            return True
    return False


def _container_kind(obj: Any) -> str | None:
    """How a container is flattened: `dict`, `odict`, `list`, `tuple`, or None for a leaf."""
    if isinstance(obj, dict):
        if obj and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            return "odict" if isinstance(obj, OrderedDict) else "dict"
        return None
    # a list is a container of records (param_groups, optimizer_states) or of tensors; a list
    # of numbers stays one value. A tuple is always one value, even of tensors: that is
    # dcp.save's rule (`_traverse.traverse_state_dict`), so a name means the same in every format
    # and DCP -> torch -> DCP still loads into the original state dict.
    if type(obj) is list and obj and _holds(obj, dicts=True):
        return "list"
    return None


#: budgets of the flattening of one loaded file (a hostile pickle can describe a huge graph
#: in a few bytes): leaves, containers walked, nesting depth
MAX_LEAVES = 1_000_000
MAX_VISITED = 10_000_000
MAX_DEPTH = 1_000


def flatten(obj: Any, where: str | None = None) -> Iterator[tuple[tuple[KeyStep, ...], Any]]:
    """Every leaf of a loaded object with its key path, in the saved order.

    A shared sub-object (pickle's memo lets 2 KB describe a "billion laughs" graph of 2^40
    paths) is measured first, each container once (`_expanded_leaves`): a graph naming more
    than `MAX_LEAVES` entries is refused before any is built. Depth and containers walked
    have budgets too; past one, FormatError naming `where`. Modest sharing (one dict
    referenced twice) flattens as before: one entry per path.
    """
    expanded = _expanded_leaves(obj, where)
    if expanded > MAX_LEAVES:
        raise _over_budget(
            where,
            f"a graph of shared sub-objects that names more than {MAX_LEAVES:,} entries "
            "(a 'billion laughs' structure)",
        )
    leaves = visited = 0
    stack: list[tuple[tuple[KeyStep, ...], Any]] = [((), obj)]
    while stack:
        path, node = stack.pop()
        node = _revive(node)
        kind = _container_kind(node)
        if kind is None:
            leaves += 1
            if leaves > MAX_LEAVES:
                raise _over_budget(where, f"more than {MAX_LEAVES:,} entries")
            yield path, node
            continue
        visited += 1
        if visited > MAX_VISITED:
            raise _over_budget(where, f"more than {MAX_VISITED:,} nested containers")
        if len(path) >= MAX_DEPTH:
            raise _over_budget(where, f"containers nested more than {MAX_DEPTH} deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = [((*path, (kind, key)), value) for key, value in items]
        stack.extend(reversed(children))


def _revive(node: Any) -> Any:
    """The inert record a plain `{"__class__", "args", "state"}` dict stands for.

    ckpt's writers store inert records (DeepSpeed's `LossScaler`...) as such dicts, since the
    original classes are not importable here; reading one back as the record it was keeps the
    entry names and values of a conversion equal to its source's. Only allow-listed names are
    revived, as the stand-in class (no code of the original runs).
    """
    if type(node) is not dict or set(node) != {"__class__", "args", "state"}:
        return node
    cls = _INERT.get(node["__class__"]) if isinstance(node["__class__"], str) else None
    if cls is None or not issubclass(cls, InertObject) or not isinstance(node["args"], list):
        return node
    record = cls.__new__(cls)
    record.args = tuple(node["args"])
    record.state = node["state"]
    return record


def _expanded_leaves(obj: Any, where: str | None) -> int:
    """How many leaves `obj` names if every shared sub-object counted once per path to it.

    Counted over the graph (each container once, bottom-up, no recursion), so a 2 KB file whose
    40 nested dicts each hold the next one twice is measured in microseconds as 2^40. The
    count stops growing past `MAX_LEAVES` (the caller refuses), and a cycle counts as a leaf.
    """
    counts: dict[int, int] = {}
    active: set[int] = set()
    visited = 0
    stack: list[tuple[Any, bool, int]] = [(obj, False, 0)]
    while stack:
        node, ready, depth = stack.pop()
        key = id(node)
        if key in counts:
            continue
        kind = _container_kind(node)
        if kind is None:
            continue
        children = list(node.values() if isinstance(node, dict) else node)
        if not ready:
            if key in active:
                continue
            visited += 1
            if visited > MAX_VISITED:
                raise _over_budget(where, f"more than {MAX_VISITED:,} nested containers")
            if depth >= MAX_DEPTH:
                raise _over_budget(where, f"containers nested more than {MAX_DEPTH} deep")
            active.add(key)
            stack.append((node, True, depth))
            stack.extend((c, False, depth + 1) for c in children if id(c) not in counts)
            continue
        active.discard(key)
        total = sum(counts.get(id(c), 1) for c in children)
        counts[key] = min(total, MAX_LEAVES + 1)
    return counts.get(id(obj), 1)


#: a tensor may name at most this many times the bytes its storage holds (stride-0 views)...
MAX_EXPANSION = 64
#: ... once it is larger than this: small broadcast buffers stay readable
EXPANSION_FLOOR = 1 << 30


def _refuse_expanded(tensor: Any, name: str, nbytes: int, where: str | None) -> None:
    """Refuse a tensor whose logical size dwarfs its stored bytes (a stride-0 4 TiB view kept in
    a 1 KB file): every reader or writer that materialises it would exhaust memory or disk."""
    if nbytes <= EXPANSION_FLOOR or tensor.device.type == "meta":
        return
    stored = tensor.untyped_storage().nbytes()
    if nbytes > MAX_EXPANSION * max(stored, 1):
        raise FormatError(
            f"tensor {name!r} claims {nbytes:,} bytes (shape {list(tensor.shape)}, stride "
            f"{list(tensor.stride())}) over {stored:,} bytes of stored data; ckpt refuses "
            "views that expand their storage this much",
            path=where,
            fix="Save the tensor contiguous (`.contiguous()` or `.clone()`) if it is meant.",
        )


def _over_budget(where: str | None, what: str) -> FormatError:
    return FormatError(
        f"holds {what}; ckpt refuses it (a hostile or corrupt file)",
        path=where,
        fix="Re-save the checkpoint as a flat state dict of tensors.",
    )


def _jsonable_value(obj: Any) -> tuple[bool, Any]:
    """(has a value to show, the value) for small scalars and short lists of them."""
    if obj is None or isinstance(obj, bool | int):
        return True, obj
    if isinstance(obj, float):
        return (True, obj) if math.isfinite(obj) else (False, None)
    if isinstance(obj, str):
        return (True, obj) if len(obj) <= MAX_VALUE_STR else (False, None)
    if isinstance(obj, (list, tuple)) and len(obj) <= MAX_VALUE_ITEMS:
        values = []
        for item in obj:
            ok, value = _jsonable_value(item)
            if not ok or isinstance(item, (list, tuple, dict)):
                return False, None
            values.append(value)
        return True, values
    if isinstance(obj, dict) and not obj:
        return True, {}
    return False, None


def _object_size(obj: Any) -> int:
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return len(pickle.dumps(obj, protocol=4))
    except Exception:
        return 0


def _type_name(obj: Any) -> str:
    if isinstance(obj, InertObject):
        return obj.original
    cls = type(obj)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def build_entries(
    obj: Any, file: str, where: str | None = None
) -> tuple[list[TorchEntry], dict[str, Any], list[list[str]]]:
    """Entries for a loaded object: (entries, name -> leaf, groups of tensors sharing memory).

    `where` names the file in errors (a flattening budget exceeded); `file` by default.
    """
    from ..tensors import dtype_name

    entries: list[TorchEntry] = []
    leaves: dict[str, Any] = {}
    views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for path, leaf in flatten(obj, where or file):
        if not path and type(leaf) in (dict, OrderedDict) and not leaf:
            # an empty state dict (a safetensors file with no tensors, saved by torch) holds
            # no entries; it is not one object named `object`
            continue
        name = dotted(path) if path else "tensor" if _is_tensor(leaf) else "object"
        base, n = name, 1
        while name in leaves:  # {"a.b": x, "a": {"b": y}} flatten to the same name
            name, n = f"{base}~{n}", n + 1
        leaves[name] = leaf
        if _is_tensor(leaf):
            dtype = dtype_name(leaf.dtype)
            shape = list(leaf.shape)
            nbytes = leaf.numel() * leaf.element_size()
            _refuse_expanded(leaf, name, nbytes, where or file)
            entries.append(
                TorchEntry.model_construct(
                    name=name,
                    kind="tensor",
                    dtype=dtype,
                    shape=shape,
                    nbytes=nbytes,
                    file=file,
                    offset=None,
                    chunks=None,
                    py_type=None,
                    value=None,
                    key_path=path,
                )
            )
            if nbytes and leaf.device.type == "cpu":
                key = (
                    leaf.untyped_storage().data_ptr(),
                    leaf.storage_offset(),
                    tuple(leaf.shape),
                    tuple(leaf.stride()),
                )
                views.setdefault(key, []).append(name)
        else:
            has_value, value = _jsonable_value(leaf)
            entries.append(
                TorchEntry.model_construct(
                    name=name,
                    kind="object",
                    dtype=None,
                    shape=[],
                    nbytes=_object_size(leaf),
                    file=file,
                    offset=None,
                    chunks=None,
                    py_type=_type_name(leaf),
                    value=value if has_value else None,
                    key_path=path,
                )
            )
    shared = [names for names in views.values() if len(names) > 1]
    return entries, leaves, shared


# --------------------------------------------------------------------------- index


def read_bin_index(storage: Storage, rel: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Read a `*.bin.index.json`: the same shape as the safetensors index."""
    return read_index(storage, rel)


def find_bin_index(source: Source) -> str | None:
    """The bin index to use: the target if it is one, else the single one in the root."""
    return find_index(source, BIN_INDEX_SUFFIX, "torch")


def _torch_files(source: Source) -> list[str]:
    return sorted(n for n in source.top_level() if n.endswith(TORCH_SUFFIXES))


# --------------------------------------------------------------------------- format


class TorchFormat(Format):
    """torch.save files, single or sharded with `pytorch_model.bin.index.json`."""

    name = "torch"
    title = "torch.save"
    writable = True
    single_file_suffixes = TORCH_SUFFIXES
    default_basename = "pytorch_model"
    index_suffix = BIN_INDEX_SUFFIX
    holds_objects = True
    shards_by_size = True
    shard_names = staticmethod(lambda basename, count: shard_names(basename, count))

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            target = source.target
            if target.endswith((*TORCH_SUFFIXES, BIN_INDEX_SUFFIX)):
                return True
            # accelerate writes torch.save files named `*.pkl`
            return target.endswith(".pkl") and is_zip(source.storage, target)
        names = source.top_level()
        if any(n.endswith(BIN_INDEX_SUFFIX) for n in names):
            return True
        # a folder is a torch checkpoint when its one torch file is the model, not a side file
        # of another format's training folder (those are the layouts' business)
        if ".metadata" in names and "common.pt" in names:
            # Megatron-Core torch_dist: common.pt is the non-sharded half of that DCP
            return False
        files = _torch_files(source)
        return len(files) == 1 and not any(n.endswith(".safetensors") for n in names)

    @classmethod
    def open(cls, source: Source) -> TorchCheckpoint:
        storage = source.storage
        index_rel = find_bin_index(source)
        if index_rel is not None:
            weight_map, index_meta = read_bin_index(storage, index_rel)
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not storage.exists(shard):
                    raise NotFoundError(
                        f"the index names shard {shard!r}, which is missing",
                        path=storage.describe(index_rel),
                        fix="Fetch or copy the missing shard; `ckpt verify` lists every problem.",
                    )
        elif source.target is not None:
            shards, weight_map, index_meta = [source.target], None, {}
        else:
            shards, weight_map, index_meta = _torch_files(source), None, {}
            if len(shards) != 1:
                raise FormatError(
                    f"holds {len(shards)} torch.save files and no index",
                    path=source.location.raw,
                    fix="Point at one of the files.",
                )
        return TorchCheckpoint.load(source, shards, index_rel, weight_map, index_meta)

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> Writer:
        return TorchWriter(staging, plan, options)

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        """Every file loads with weights_only=True; a bin index agrees with its shards (the
        weight-map check the safetensors format runs too: same codes, same files blamed)."""
        storage = source.storage
        findings = Findings(strict=False)
        try:
            index_rel = find_bin_index(source)
        except CkptError as error:
            findings.error(error)
            return findings.problems
        if index_rel is None:
            return super().check(source)
        try:
            weight_map, meta = read_bin_index(storage, index_rel)
        except CkptError as error:
            report_bad_index(findings, error)
            return findings.problems
        # unnamed shards of the same save are checked too (their tensors are "not in the
        # index"); other .bin files are not strays here: a training folder holds many
        listing = storage.list_files()
        names, _ = shards_to_check(index_rel, weight_map, listing)
        shards: dict[str, ShardContents] = {}
        for shard in names:
            if shard not in listing and not storage.exists(shard):
                report_missing_shard(findings, storage, index_rel, weight_map, shard)
                continue
            try:
                obj, _ = load_torch_file(storage, shard, meta=storage.local_path(shard) is None)
                entries, _, _ = build_entries(obj, shard, storage.describe(shard))
            except FormatError as error:
                findings.error(error)
                continue
            shards[shard] = ShardContents(
                {e.name: e.nbytes if e.kind == "tensor" else 0 for e in entries}
            )
        check_index(findings, storage, index_rel, weight_map, meta, shards)
        return findings.problems


class TorchCheckpoint(Checkpoint):
    """An opened torch.save checkpoint: the loaded (memory-mapped) objects of its files.

    Attributes:
        objects: file -> the object torch.load returned for it.
        leaves: entry name -> the loaded leaf (tensor or value).
    """

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        objects: dict[str, Any],
        leaves: dict[str, Any],
    ):
        super().__init__(source, manifest)
        self.objects = objects
        self.leaves = leaves
        #: the one remote file whose real tensors are held: (file, name -> leaf)
        self._loaded: tuple[str, dict[str, Any]] | None = None

    @classmethod
    def load(
        cls,
        source: Source,
        shards: list[str],
        index_rel: str | None,
        weight_map: dict[str, str] | None,
        index_meta: dict[str, Any],
    ) -> TorchCheckpoint:
        """Load every file (memory-mapped) and build the manifest."""
        storage = source.storage
        objects: dict[str, Any] = {}
        leaves: dict[str, Any] = {}
        entries: list[Entry] = []
        files: list[FileInfo] = []
        shared: list[list[str]] = []
        legacy: list[str] = []
        for shard in shards:
            # remote files: metadata only now, one whole file when a tensor of it is read
            remote = storage.local_path(shard) is None
            obj, is_legacy = load_torch_file(storage, shard, meta=remote)
            if is_legacy:
                legacy.append(shard)
            objects[shard] = obj
            shard_entries, shard_leaves, shard_shared = build_entries(
                obj, shard, storage.describe(shard)
            )
            for entry in shard_entries:
                if entry.name in leaves:
                    raise FormatError(
                        f"entry {entry.name!r} appears in more than one shard",
                        path=storage.describe(shard),
                        fix="The checkpoint is inconsistent; `ckpt verify` lists every problem.",
                    )
                if weight_map is not None and weight_map.get(entry.name, shard) != shard:
                    raise FormatError(
                        f"the index maps {entry.name!r} to {weight_map[entry.name]}, "
                        "but it is stored here",
                        path=storage.describe(shard),
                        fix="The index is inconsistent; `ckpt verify` lists every problem.",
                    )
            entries.extend(shard_entries)
            leaves.update(shard_leaves)
            shared.extend(shard_shared)
            files.append(FileInfo(path=shard, size=storage.size(shard), entries=len(shard_entries)))
        details: dict[str, Any] = {"sharded": index_rel is not None}
        if index_rel is not None:
            files.insert(0, FileInfo(path=index_rel, size=storage.size(index_rel), entries=0))
            details["index"] = index_rel
            details["weight_map_size"] = len(weight_map or {})
            if "total_size" in index_meta:
                details["total_size"] = index_meta["total_size"]
            missing = sorted(set(weight_map or {}) - set(leaves))
            if missing:
                raise FormatError(
                    f"the index lists {len(missing)} entries no shard holds "
                    f"(first: {missing[0]!r})",
                    path=storage.describe(index_rel),
                    fix="The index is inconsistent; `ckpt verify` lists every problem.",
                )
        if shared:
            details["shared_tensors"] = shared
        if legacy:
            details["legacy_format"] = legacy
        manifest = Manifest(
            format="torch",
            location=source.location.raw,
            files=files,
            entries=entries,
            details=details,
        )
        return cls(source, manifest, objects, leaves)

    def _leaf(self, name: str) -> Any:
        try:
            return self.leaves[name]
        except KeyError:
            raise NotFoundError(f"no entry named {name!r}", path=self.manifest.location) from None

    def read_tensor(self, name: str) -> torch.Tensor:
        leaf = self._leaf(name)
        if not _is_tensor(leaf):
            raise FormatError(
                f"entry {name!r} is a {_type_name(leaf)}, not a tensor",
                path=self.manifest.location,
            )
        if leaf.device.type == "meta":
            leaf = self._real_leaf(name)
        # memory-mapped: pages are read on first touch, one tensor at a time
        return leaf.detach().contiguous()

    def _real_leaf(self, name: str) -> Any:
        """A remote file's real tensor: the whole file is fetched once, one file at a time."""
        file = self.manifest.by_name[name].file
        assert file is not None
        if self._loaded is None or self._loaded[0] != file:
            self._loaded = None  # drop the previous file before fetching the next
            obj, _ = load_torch_file(self.storage, file, meta=False)
            _, leaves, _ = build_entries(obj, file, self.storage.describe(file))
            self._loaded = (file, leaves)
        return self._loaded[1][name]

    def read_object(self, name: str) -> Any:
        leaf = self._leaf(name)
        if _is_tensor(leaf):
            return self.read_tensor(name)
        # inert records as plain dicts: what every writer can store and every reader load
        return _plain(copy.deepcopy(leaf))

    def close(self) -> None:
        self.objects.clear()
        self.leaves.clear()
        self._loaded = None


# --------------------------------------------------------------------------- writer


def shard_names(basename: str, count: int) -> list[str]:
    """Hugging Face names: `pytorch_model.bin` or `pytorch_model-00001-of-00002.bin`..."""
    if count == 1:
        return [f"{basename}.bin"]
    return [f"{basename}-{i:05d}-of-{count:05d}.bin" for i in range(1, count + 1)]


class _Node:
    """A container being rebuilt from key paths."""

    def __init__(self, kind: str):
        self.kind = kind
        self.children: dict[str | int, Any] = {}

    def materialize(self) -> Any:
        values = {
            k: v.materialize() if isinstance(v, _Node) else v for k, v in self.children.items()
        }
        if self.kind == "list":
            return [values[k] for k in sorted(values, key=lambda k: int(k))]
        if self.kind == "tuple":
            return tuple(values[k] for k in sorted(values, key=lambda k: int(k)))
        if self.kind == "odict":
            return OrderedDict(values)
        return dict(values)


def rebuild(items: list[tuple[Entry, Any]]) -> Any:
    """The saved object for (entry, value) pairs: nesting from key paths where they still fit.

    An entry keeps its original place when it carries a key path (it came from a torch.save
    file) whose dotted join is still its name (it was not renamed). Every other entry becomes a
    top-level key named by its full name, which is the flat state_dict layout transformers uses.
    """
    if len(items) == 1 and isinstance(items[0][0], TorchEntry) and items[0][0].key_path == ():
        return items[0][1]  # torch.save(tensor): the root itself
    paths: list[tuple[KeyStep, ...]] = []
    for entry, _ in items:
        path: tuple[KeyStep, ...] = getattr(entry, "key_path", ())
        joined = dotted(path)
        if not path or (entry.name != joined and not entry.name.startswith(joined + "~")):
            path = (("dict", entry.name),)
        paths.append(path)
    root_kinds = {path[0][0] for path in paths if path}
    root = _Node(root_kinds.pop() if len(root_kinds) == 1 else "dict")
    for (entry, value), path in zip(items, paths, strict=True):
        if path[0][0] != root.kind:
            path = ((root.kind, entry.name),)
        node = root
        ok = True
        for depth, (_, key) in enumerate(path[:-1]):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(path[depth + 1][0])
            elif not isinstance(child, _Node):
                ok = False
                break
            node = child
        last = path[-1][1]
        if not ok or last in node.children:
            root.children[entry.name] = value
        else:
            node.children[last] = value
    return root.materialize()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor torch.save writes without dragging along a larger storage it views into."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # a slice of a bigger buffer: torch.save would write the whole buffer
        tensor = tensor.clone()
    return tensor


def _plain(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """`value` with inert records (DeepSpeed loss scalers...) replaced by plain dicts.

    A shared sub-object is converted once and stays shared (`memo`, by id): a "billion
    laughs" graph costs its size in memory, not its 2^N paths.
    """
    if isinstance(value, InertObject):
        return value.as_plain()
    kind = type(value)
    if kind not in (dict, OrderedDict, list, tuple):
        return value
    memo = {} if memo is None else memo
    done = memo.get(id(value))
    if done is not None:
        return done
    if kind in (dict, OrderedDict):
        out: Any = kind((k, _plain(v, memo)) for k, v in value.items())
    else:
        out = kind(_plain(v, memo) for v in value)
    memo[id(value)] = out
    return out


class TorchWriter(Writer):
    """torch.save, single file or Hugging Face shards; one tensor in memory at a time.

    Each tensor is streamed into its file's zip container as it arrives (`torch_zip`); only
    a stand-in stays behind. Entries may arrive in any order. Without `max_shard_size` the
    object is pickled at `finish` as one file whose nesting is rebuilt (see `rebuild`); with
    it, each shard is a flat name -> value dict closed as soon as all its entries have
    arrived, and the index `<basename>.bin.index.json` is written last.
    """

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        super().__init__(staging, plan, options)
        self.basename = options.basename or "pytorch_model"
        self.groups = plan_shards(plan, options.max_shard_size)
        if options.single_file and len(self.groups) > 1:
            raise FormatError("a single-file destination cannot be split into shards")
        self.names = shard_names(self.basename, len(self.groups))
        self._where = {e.name: i for i, group in enumerate(self.groups) for e in group}
        self._entries = {e.name: e for e in plan}
        self._pending: list[dict[str, Any]] = [{} for _ in self.groups]
        self._saved: set[int] = set()
        self._written: list[FileInfo] = []
        self._open: dict[int, tuple[IO[bytes], TorchZipWriter]] = {}

    @property
    def accepts_objects(self) -> bool:
        return True

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._where.get(name)
        if shard is None:
            raise RuntimeError(f"writer got {name!r}, which is not in the plan")
        if name in self._pending[shard] or shard in self._saved:
            raise RuntimeError(f"writer got {name!r} twice")
        self._put(name, self._zip(shard).add_tensor(_own_storage(tensor)))

    def _zip(self, shard: int) -> TorchZipWriter:
        """The open container of output file `shard` (opened at its first tensor)."""
        opened = self._open.get(shard)
        if opened is None:
            fname = self.names[shard]
            fh = open(self.staging / fname, "wb")  # closed in _save_file
            # torch names the archive folder after the file, as `torch.save(obj, path)` does
            opened = self._open[shard] = (fh, TorchZipWriter(fh, fname.rsplit(".", 1)[0]))
        return opened[1]

    def write_object(self, name: str, value: Any) -> None:
        self._put(name, _plain(value))

    def _put(self, name: str, value: Any) -> None:
        shard = self._where.get(name)
        if shard is None:
            raise RuntimeError(f"writer got {name!r}, which is not in the plan")
        if name in self._pending[shard] or shard in self._saved:
            raise RuntimeError(f"writer got {name!r} twice")
        self._pending[shard][name] = value
        if len(self.groups) > 1 and len(self._pending[shard]) == len(self.groups[shard]):
            self._save_shard(shard)

    def _save_file(self, shard: int, obj: Any, entries: int) -> None:
        """Pickle `obj` (tensors already streamed) into file `shard`, close and fsync it."""
        fname = self.names[shard]
        fh, container = self._open.pop(shard, None) or (None, None)
        if fh is None or container is None:  # a file of objects only
            fh = open(self.staging / fname, "wb")  # closed below
            container = TorchZipWriter(fh, fname.rsplit(".", 1)[0])
        with fh:
            container.finish(obj)
            fh.flush()
            os.fsync(fh.fileno())
        size = (self.staging / fname).stat().st_size
        self._written.append(FileInfo(path=fname, size=size, entries=entries))

    def _save_shard(self, shard: int) -> None:
        values = self._pending[shard]
        # shards are flat name -> value dicts, in plan order, as transformers writes them
        ordered = {e.name: values[e.name] for e in self.groups[shard]}
        self._save_file(shard, ordered, len(ordered))
        self._pending[shard] = {}
        self._saved.add(shard)

    def finish(self) -> list[FileInfo]:
        missing = [
            e.name
            for i, group in enumerate(self.groups)
            if i not in self._saved
            for e in group
            if e.name not in self._pending[i]
        ]
        if missing:
            raise RuntimeError(
                f"writer finished with {len(missing)} entries unwritten: {missing[:3]}"
            )
        if len(self.groups) == 1:
            values = self._pending[0]
            items = [(self._entries[e.name], values[e.name]) for e in self.plan]
            self._save_file(0, rebuild(items), len(items))
            self._pending[0] = {}
            return self._written
        for shard in range(len(self.groups)):
            if shard not in self._saved:
                self._save_shard(shard)
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in self.plan if e.kind == "tensor")},
            "weight_map": {name: self.names[i] for name, i in sorted(self._where.items())},
        }
        # a naming convention may spell the index itself (diffusers variants)
        index_name = self.options.extra.get("index_name") or f"{self.basename}{BIN_INDEX_SUFFIX}"
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        with open(self.staging / index_name, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self._written.sort(key=lambda f: f.path)
        self._written.insert(0, FileInfo(path=index_name, size=len(data), entries=0))
        return self._written
