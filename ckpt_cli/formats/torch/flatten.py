"""Flattening a loaded torch.save object into entries: dotted names, key paths, budgets.

Nested containers are flattened to dotted names (`optimizer.state.0.exp_avg`); every entry
remembers its real key path (`TorchEntry.key_path`) so the writer can rebuild the exact
nesting. Leaves that are not tensors are `object` entries with their Python type and, for
small scalars, their value. A hostile pickle can describe a huge graph in a few bytes, so the
walk has budgets (leaves, containers, depth) and refuses views that dwarf their storage.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ...budgets import check_expanded
from ...dtypes import MAX_NDIM
from ...errors import FormatError
from ...models import KeyedEntry, KeyStep
from .inert import INERT, InertObject
from .zip_index import TensorLayout, too_many_dims

#: longest string an object entry shows as its value
MAX_VALUE_STR = 200
#: longest list of scalars an object entry shows as its value
MAX_VALUE_ITEMS = 16


class TorchEntry(KeyedEntry):
    """An entry of a torch.save file, with the real key path inside the saved object
    (`KeyedEntry.key_path`; kinds `dict`, `odict`, `list`, `tuple`)."""


def dotted(key_path: tuple[KeyStep, ...] | list[KeyStep]) -> str:
    """The flattened name of a key path (`optimizer.state.0.exp_avg`)."""
    return ".".join(str(key) for _, key in key_path)


def is_tensor(obj: Any) -> bool:
    """A torch tensor, or a tensor read without torch (`TensorLayout`, see `torch_zip`)."""
    if isinstance(obj, TensorLayout):
        return True
    torch = sys.modules.get("torch")  # not imported: nothing here can be a torch tensor
    return torch is not None and isinstance(obj, torch.Tensor)


def _holds(obj: Any, dicts: bool, memo: dict[tuple[int, int], bool], depth: int = 0) -> bool:
    """Whether a list/tuple (or a dict's values) holds a tensor (or, with `dicts`, a dict) worth
    flattening into, within 8 levels. `memo` keeps each (container, depth) answer: a graph of
    shared lists is looked at once per container and level, never once per path."""
    if depth > 8:
        return False
    key = (id(obj), depth)
    known = memo.get(key)
    if known is not None:
        return known
    memo[key] = False  # a cycle back here holds nothing new
    found = any(
        is_tensor(item)
        or (dicts and isinstance(item, dict))
        or (isinstance(item, (list, tuple, dict)) and _holds(item, dicts, memo, depth + 1))
        for item in (obj.values() if isinstance(obj, dict) else obj)
    )
    memo[key] = found
    return found


def _container_kind(obj: Any, memo: dict[tuple[int, int], bool] | None = None) -> str | None:
    """How a container is flattened: `dict`, `odict`, `list`, `tuple`, or None for a leaf.
    `memo` is `_holds`'s, shared by the calls of one flattening."""
    if isinstance(obj, dict):
        if obj and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            return "odict" if isinstance(obj, OrderedDict) else "dict"
        return None
    # a list is a container of records (param_groups, optimizer_states) or of tensors; a list
    # of numbers stays one value. A tuple is always one value, even of tensors: that is
    # dcp.save's rule (`_traverse.traverse_state_dict`), so a name means the same in every format
    # and DCP -> torch -> DCP still loads into the original state dict.
    if type(obj) is list and obj and _holds(obj, True, {} if memo is None else memo):
        return "list"
    return None


#: dict keys whose list is one value however many records it holds: a training log, one dict
#: per logging step (transformers' `TrainerState.log_history`). Flattened, a run logging every
#: step for 300,000 steps made 1.5 million entries (~1 KiB and ~33 µs each) and passed the
#: leaf budget; one entry holds the whole log, and still tells two logs apart by value.
ONE_VALUE_LISTS = frozenset({"log_history"})


def is_log(key: Any, node: Any) -> bool:
    """Whether `node`, held under dict key `key`, is a log kept as one value
    (`ONE_VALUE_LISTS`). The key's last dotted part counts: a sharded torch output stores the
    log under its flat name (`trainer_state.log_history`), which must read back as the same
    one entry the nested save (`{"trainer_state": {"log_history": [...]}}`) reads as."""
    return type(node) is list and isinstance(key, str) and key.rpartition(".")[2] in ONE_VALUE_LISTS


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
    referenced twice) flattens as before: one entry per path. Before anything walks it, the
    whole object (the values of object entries too: lists, tuples, sets) must unfold to at most
    `budgets.MAX_EXPANDED_NODES` nodes (`budgets.check_expanded`), so no copy, comparison or
    writer of an entry's value walks a graph of 10^40 paths.
    """
    check_expanded(obj, where)
    memo: dict[tuple[int, int], bool] = {}
    expanded = _expanded_leaves(obj, where, memo)
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
        kind = None if path and is_log(path[-1][1], node) else _container_kind(node, memo)
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
    cls = INERT.get(node["__class__"]) if isinstance(node["__class__"], str) else None
    if cls is None or not issubclass(cls, InertObject) or not isinstance(node["args"], list):
        return node
    record = cls.__new__(cls)
    record.args = tuple(node["args"])
    record.state = node["state"]
    return record


def _expanded_leaves(obj: Any, where: str | None, memo: dict[tuple[int, int], bool]) -> int:
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
        kind = _container_kind(node, memo)
        if kind is None:
            continue
        children = (
            [None if is_log(k, v) else v for k, v in node.items()]  # a log is one leaf
            if isinstance(node, dict)
            else list(node)
        )
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
            if isinstance(item, (list, tuple, dict)):  # before any look inside: it may nest
                return False, None  # deeper than Python recurses
            ok, value = _jsonable_value(item)
            if not ok:
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


def type_name(obj: Any) -> str:
    if isinstance(obj, InertObject):
        return obj.original
    cls = type(obj)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _raw_offset(
    layouts: Mapping[tuple[str | int, ...], TensorLayout] | None,
    path: tuple[KeyStep, ...],
    leaf: Any,
    dtype: str,
    shape: list[int],
    nbytes: int,
) -> int | None:
    """The file offset of `leaf`'s C-order bytes when the zip index found them, else None.

    The index read data.pkl on its own; it is trusted only where it agrees with what torch
    loaded (dtype, shape, contiguity, size), so a disagreement costs speed, never bytes."""
    if layouts is None:
        return None
    layout = layouts.get(tuple(key for _, key in path))
    if (
        layout is None
        or not layout.plain
        or layout.data_offset is None
        or layout.dtype != dtype
        or list(layout.shape) != shape
        or layout.nbytes != nbytes
        or not leaf.is_contiguous()
    ):
        return None
    return layout.data_offset


def _raw_entry(name: str, leaf: TensorLayout, file: str, path: tuple[KeyStep, ...]) -> TorchEntry:
    return TorchEntry.model_construct(
        name=name,
        kind="tensor",
        dtype=leaf.dtype,
        shape=list(leaf.shape),
        nbytes=leaf.nbytes,
        file=file,
        offset=leaf.data_offset,
        chunks=None,
        py_type=None,
        value=None,
        key_path=path,
    )


def build_entries(
    obj: Any,
    file: str,
    where: str | None = None,
    layouts: Mapping[tuple[str | int, ...], TensorLayout] | None = None,
) -> tuple[list[TorchEntry], dict[str, Any], list[list[str]]]:
    """Entries for a loaded object: (entries, name -> leaf, groups of tensors sharing memory).

    `where` names the file in errors (a flattening budget exceeded); `file` by default.
    `layouts` (from `torch_zip.index_torch_zip` of the same file, by key path) gives a tensor
    stored as a plain C-order byte range its `offset`, which makes it a raw entry: copies to
    raw formats then move those bytes without deserialising.
    """
    from ...tensors import dtype_name

    entries: list[TorchEntry] = []
    leaves: dict[str, Any] = {}
    views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for path, leaf in flatten(obj, where or file):
        if not path and type(leaf) in (dict, OrderedDict) and not leaf:
            # an empty state dict (a safetensors file with no tensors, saved by torch) holds
            # no entries; it is not one object named `object`
            continue
        name = dotted(path) if path else "tensor" if is_tensor(leaf) else "object"
        base, n = name, 1
        while name in leaves:  # {"a.b": x, "a": {"b": y}} flatten to the same name
            name, n = f"{base}~{n}", n + 1
        leaves[name] = leaf
        if isinstance(leaf, TensorLayout):
            # read without torch: a plain C-order range, raw by construction
            entries.append(_raw_entry(name, leaf, file, path))
            if leaf.nbytes:
                spot = (-1, leaf.data_offset or 0, leaf.shape, leaf.stride)
                views.setdefault(spot, []).append(name)
        elif is_tensor(leaf):
            _refuse_not_dense(leaf, name, where or file)
            if leaf.dim() > MAX_NDIM:
                raise too_many_dims(name, leaf.dim(), where or file)
            dtype = dtype_name(leaf.dtype)
            shape = list(leaf.shape)
            nbytes = leaf.numel() * leaf.element_size()
            _refuse_expanded(leaf, name, nbytes, where or file)
            offset = _raw_offset(layouts, path, leaf, dtype, shape, nbytes)
            entries.append(
                TorchEntry.model_construct(
                    name=name,
                    kind="tensor",
                    dtype=dtype,
                    shape=shape,
                    nbytes=nbytes,
                    file=file,
                    offset=offset,
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
                    py_type=type_name(leaf),
                    value=value if has_value else None,
                    key_path=path,
                )
            )
    shared = [names for names in views.values() if len(names) > 1]
    return entries, leaves, shared


def _refuse_not_dense(leaf: Any, name: str, where: str) -> None:
    """A sparse (COO, CSR...) or nested tensor has no one storage of its elements, which every
    reader and writer of ckpt works with: refused by name, never a crash."""
    import torch

    if leaf.is_nested:
        kind = "a nested tensor"
        dense = "`torch.nested.to_padded_tensor(t, 0.0)` or its components as separate tensors"
    elif leaf.layout != torch.strided:
        kind = f"a sparse tensor ({str(leaf.layout).removeprefix('torch.')})"
        dense = "`t.to_dense()`, or its indices and values as separate tensors"
    else:
        return
    raise FormatError(
        f"entry {name!r} is {kind}; ckpt reads dense (strided) tensors only",
        path=where,
        fix=f"Re-save the checkpoint with that tensor stored dense: {dense}.",
    )


_MISSING = object()


def plain_copy(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of `value` with inert records (DeepSpeed loss scalers...) as plain dicts.

    Each container (tuples too) is copied once, by identity (`memo`): a shared sub-object stays
    shared, and a "billion laughs" graph costs its size in time and memory, not its 2^N paths
    (`copy.deepcopy` re-walks a tuple of immutables once per path to it). Other values are
    deep-copied by `copy.deepcopy` (numpy arrays, tensors); scalars are returned as they are.
    """
    memo = {} if memo is None else memo
    if value is None or type(value) in _SCALARS:
        return value
    done = memo.get(id(value), _MISSING)
    if done is not _MISSING:
        return done
    kind = type(value)
    out: Any
    if isinstance(value, InertObject):
        out = {"__class__": value.original}
        memo[id(value)] = out
        out["args"] = [plain_copy(v, memo) for v in value.args]
        out["state"] = plain_copy(value.state, memo)
    elif kind in (dict, OrderedDict):
        out = kind()
        memo[id(value)] = out
        for k, v in value.items():
            out[plain_copy(k, memo)] = plain_copy(v, memo)
    elif kind is list:
        out = []
        memo[id(value)] = out
        out.extend(plain_copy(v, memo) for v in value)
    elif kind in (tuple, set, frozenset):
        out = kind(plain_copy(v, memo) for v in value)
        memo[id(value)] = out
    else:
        out = copy.deepcopy(value, memo.setdefault(-1, {}))  # -1: deepcopy's own memo
        memo[id(value)] = out
    return out


_SCALARS = (bool, int, float, complex, str, bytes)
