"""The training state a user hands to `save` / `load_latest`, as DCP state dicts.

Every entry of the mapping is one of:

* a model (`torch.nn.Module`, DDP / FSDP wrapped or not): saved and loaded through
  `torch.distributed.checkpoint.state_dict` (`get_model_state_dict` / `set_model_state_dict`),
  so the keys are the model's own fully-qualified names whatever wraps it;
* an optimizer: through `get_optimizer_state_dict` / `set_optimizer_state_dict` with the
  model of the same mapping that owns its parameters, so its state is keyed by parameter
  name and a freshly built optimizer (with no state yet) is loaded whole;
* any other Stateful object (scheduler, data loader, anything with `state_dict` and
  `load_state_dict`): its `state_dict()`, as `dcp.save` takes it;
* a plain value (tensors, RNG states, counters, dicts of them): saved as it is. Every rank
  has its own RNG state and counters, and DCP keeps one copy of a key every rank saves (any
  rank's), so under torchrun rank 0's values are saved under their own names (as one process
  saves them) and rank R's under the save's record, `__ckpt__.ranks.rank-R.NAME`; so are the
  Stateful objects' states (a data loader's position in its rank's shard differs by rank),
  but for an LR scheduler's (`per_rank`); `load_latest` gives each rank the values and states
  it saved itself (a save without a rank's states, older or resharded with `--rank-state
  drop`: rank 0's).

The save's own record, the entry `__ckpt__`, also holds its layout version, world size and
training step, and, for each rank, the shape of every Stateful's state and plain value (`shapes.rank-R`, a JSON
string): its containers, their int or str keys, empty ones included; and which optimizers had
not stepped yet. DCP's state-dict API fills such an optimizer by a zero-gradient step (Adam's
step count then 1) when its state is taken or loaded: `fill_quietly` takes that step first
without the optimizer's step hooks (which DCP's `optimizer.step()` would run), `capture`
empties the live optimizer again after taking it, and `apply` empties the loaded one, so a
save before the first step changes nothing and resumes exactly. DCP names every dict key
as a string and saves no empty container, so without it `{0: ...}` would come back as
`{"0": ...}` (a wrapped optimizer's state then silently not restored) and `{}` not at all.
Saves without the record (older ones) are loaded as they were written, one copy for every rank.
The record's names, and what `ckpt reshard --world-size` does to it, are
`ckpt_cli.sources.layouts.ckpt_record`'s.

On load, models and optimizers are loaded in place into state dicts of the live objects, as
DCP does. The other entries are loaded from what the checkpoint holds (its `.metadata` names
every key saved under them), not from the current object's `state_dict()`: a data loader's
state has other keys mid-epoch than at the start, and DCP loads only the keys of the template.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import FormatError, UsageError
from ..sources.layouts.ckpt_record import LAYOUT, RECORD_KEY, rank_name, rank_path, shapes_path

Kind = Literal["model", "optimizer", "stateful", "value"]


#: the shape of a value: None for a leaf, {"d": [[key, shape], ...]} for a mapping (an int key
#: stays an int), {"l": [shape, ...]} for a list
Shape = Any
#: what the shapes record for an optimizer saved before its first step (an empty `state`)
NOT_STEPPED: Shape = {"optimizer": "not stepped"}


def _shape(value: Any) -> Shape:
    from collections.abc import Mapping as AnyMapping

    if isinstance(value, AnyMapping):
        return {
            "d": [
                [k if isinstance(k, int) and not isinstance(k, bool) else str(k), _shape(v)]
                for k, v in value.items()
            ]
        }
    if isinstance(value, list):
        return {"l": [_shape(v) for v in value]}
    return None


def _build(shape: Shape, path: tuple[str | int, ...], leaves: dict[Any, Any]) -> Any:
    """The value of `shape` at `path`, its leaves from `leaves` (keyed by DCP's paths: dict
    keys as strings, list indices as ints); KeyError when a leaf is missing."""
    if shape is None or path in leaves:  # DCP saves a list without tensors whole
        return leaves[path]
    if "d" in shape:
        return {k: _build(child, (*path, str(k)), leaves) for k, child in shape["d"]}
    return [_build(child, (*path, i), leaves) for i, child in enumerate(shape["l"])]


@dataclass(frozen=True)
class Entry:
    """One entry of the training state and how it is saved and loaded."""

    key: str
    kind: Kind
    obj: Any
    #: for an optimizer: the model that owns its parameters
    model: torch.nn.Module | None = None


def is_stateful(value: Any) -> bool:
    """Whether `value` has `state_dict` and `load_state_dict` (DCP's `Stateful` protocol,
    checked as `dcp.save` checks it)."""
    from torch.distributed.checkpoint.stateful import Stateful

    return isinstance(value, Stateful)


def entries(state: Mapping[str, Any]) -> list[Entry]:
    """Classify every entry of `state` (UsageError for an optimizer without its model)."""
    if not isinstance(state, Mapping) or not state:
        raise UsageError(
            "the training state must be a non-empty mapping of names to objects",
            fix='Pass e.g. {"model": model, "optimizer": optimizer, "step": step}.',
        )
    models = {str(k): v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    out: list[Entry] = []
    for key, value in state.items():
        name = str(key)
        if name == RECORD_KEY:
            raise UsageError(
                f"the state key {name!r} is reserved for the save's own record",
                fix="Name the entry otherwise.",
            )
        if "." in name:
            raise UsageError(
                f"the state key {name!r} contains a dot",
                fix="DCP joins nested keys with dots; name the entry without one.",
            )
        if isinstance(value, torch.nn.Module):
            out.append(Entry(name, "model", value))
        elif isinstance(value, torch.optim.Optimizer):
            out.append(Entry(name, "optimizer", value, _owner(name, value, models)))
        elif is_stateful(value):
            out.append(Entry(name, "stateful", value))
        else:
            out.append(Entry(name, "value", value))
    return out


def _owner(
    key: str, optimizer: torch.optim.Optimizer, models: dict[str, torch.nn.Module]
) -> torch.nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in models.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    # DCP keys an optimizer's state by the parameter names of one module
    sharing = [name for name, m in models.items() if wanted & {id(p) for p in m.parameters()}]
    if len(sharing) > 1 and wanted <= {id(p) for n in sharing for p in models[n].parameters()}:
        listed = ", ".join(repr(n) for n in sharing)
        parts = ", ".join(f'"{n}": {n}' for n in sharing)
        raise UsageError(
            f"the optimizer {key!r} optimizes the parameters of several models of the state "
            f"({listed}): its state is saved by the parameter names of one model",
            fix="Save those models as one entry: "
            f'{{"model": torch.nn.ModuleDict({{{parts}}}), "{key}": {key}}}.',
        )
    raise UsageError(
        f"the optimizer {key!r} has parameters that no model of the state owns",
        fix="Pass the model it optimizes in the same mapping: "
        '{"model": model, "optimizer": optimizer}.',
    )


def capture(
    items: list[Entry], rank: int = 0, world_size: int = 1, step: int | None = None
) -> dict[str, Any]:
    """The state dict `dcp.save` gets: each entry's state, keyed by its name (the plain values
    of a rank other than 0 under the record: see the module), and the save's record (with
    `step`, the training step saved, when given)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out: dict[str, Any] = {}
    fresh: list[str] = []
    for e in items:
        if e.kind == "model":
            out[e.key] = get_model_state_dict(e.obj)
        elif e.kind == "optimizer":
            assert e.model is not None
            empty = not e.obj.state
            fill_quietly(e.obj)
            out[e.key] = get_optimizer_state_dict(e.model, e.obj)
            if empty:
                # DCP fills an optimizer that has not stepped yet by a zero-gradient step; the
                # live one must stay as it was (its next step is its first: Adam's bias
                # correction counts it), and the record says so for the load
                e.obj.state.clear()
                fresh.append(e.key)
        elif e.kind == "stateful":
            out[e.key] = e.obj.state_dict()
    values = {e.key: e.obj for e in items if e.kind == "value"}
    shapes: dict[str, Shape] = {
        e.key: _shape(out[e.key] if e.kind == "stateful" else e.obj)
        for e in items
        if e.kind in ("stateful", "value")
    }
    shapes.update(dict.fromkeys(fresh, NOT_STEPPED))
    record: dict[str, Any] = {
        "layout": LAYOUT,
        "world_size": world_size,
        "shapes": {rank_name(rank): json.dumps(shapes)},
    }
    if step is not None:  # `ckpt verify --resumable` reads it: the state may hold no counter
        record["step"] = step
    if rank == 0:
        out.update(values)
    else:
        # a Stateful's state differs by rank too (a data loader's position in its shard, an
        # RNG wrapper's state), and DCP keeps one copy of a key every rank saves (any rank's)
        own = {
            e.key: out.pop(e.key) if e.kind == "stateful" else e.obj
            for e in items
            if e.kind == "value" or per_rank(e)
        }
        if own:
            record["ranks"] = {rank_path(rank)[-1]: own}
    out[RECORD_KEY] = record
    return out


def per_rank(e: Entry) -> bool:
    """Whether a Stateful entry's state is saved for every rank (see the module): all but an
    LR scheduler's, which follows the optimizer's parameter groups, the same on every rank."""
    return e.kind == "stateful" and not isinstance(e.obj, torch.optim.lr_scheduler.LRScheduler)


def fill_quietly(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state as DCP's state-dict API does (a step
    on zero gradients at learning rate 0), without what `optimizer.step()` runs around the
    step: the user's step pre- and post-hooks (an EMA update, a step counter, a logger), the
    global ones, and an LR scheduler's record that the optimizer stepped. DCP's own fill then
    finds the state there and calls nothing. The parameters are left as they were (their
    gradients None again, each learning rate the same object)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return  # DCP does not fill an optimizer with gradients either
    step = type(optimizer).step
    # torch wraps each optimizer class's step once with the hook runner (marked `hooked`,
    # the step itself as `__wrapped__`); an instance's own step (a scheduler's wrapper) and
    # the hooks around it are skipped by calling the class's inner step
    inner: Any = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        return  # not torch's wrapper as known: DCP's fill runs as it always did
    filled = [p for p in params if p.requires_grad]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for p in filled:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        inner(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            if "lr" in group:
                group["lr"] = lr
        for p in filled:
            p.grad = None


_KIND_NAMES = {"model": "model", "optimizer": "optimizer", "stateful": "Stateful object"}


def _models(items: list[Entry]) -> list[Entry]:
    return [e for e in items if e.kind in ("model", "optimizer")]


def load_template(items: list[Entry], metadata: Any, where: str, rank: int = 0) -> dict[str, Any]:
    """What `dcp.load` fills: the live models' and optimizers' state dicts (loaded in place),
    and, for the other entries, every key the checkpoint holds under them (for a plain value,
    under `rank`), tensors as empty tensors of the saved size and dtype, objects as
    placeholders DCP replaces."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    template = capture(_models(items))
    del template[RECORD_KEY]
    paths = metadata.planner_data or {}
    prefix = rank_path(rank) if has_record(metadata) else ()
    shapes_fqn = _fqn(metadata, shapes_path(rank))
    if shapes_fqn is not None:
        template[shapes_fqn] = None
    saved = {next(iter(paths.get(fqn, (fqn,)))) for fqn in metadata.state_dict_metadata}
    for e in items:
        # a Stateful whose state is empty (a disabled GradScaler's) leaves no entry: when the
        # live one's is empty too, the shapes of ckpt's record tell whether it was saved so
        # (`rebuild` judges it once they are read); any other is refused before the load
        recorded = e.kind == "stateful" and shapes_fqn is not None and not e.obj.state_dict()
        # this rank's own copy of a Stateful's state (rank 0's, under its name, for a save
        # that holds none: an older one, or one resharded with `--rank-state drop`)
        own = e.kind == "stateful" and bool(prefix) and _rank_saved(metadata, (*prefix, e.key))
        missing = e.key not in saved and not own
        if e.kind in ("model", "optimizer", "stateful") and missing and not recorded:
            raise _no_entry(e, where)
        if e.kind == "optimizer" and not any(
            tuple(paths.get(fqn, (fqn,)))[:2] == (e.key, "state")
            for fqn in metadata.state_dict_metadata
        ):
            # saved before its first step, its gradients already there (DCP does not fill it
            # then): there is no state to load, only the parameter groups
            template[e.key]["state"] = {}
        if e.kind in ("model", "optimizer"):
            continue
        found = False
        where_values = (*prefix, e.key) if e.kind == "value" or own else (e.key,)
        for fqn, md in metadata.state_dict_metadata.items():
            path = tuple(paths.get(fqn, (fqn,)))
            if path[: len(where_values)] != where_values:
                continue
            found = True
            if isinstance(md, TensorStorageMetadata):
                template[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                template[fqn] = None
        if not found and e.kind == "value" and shapes_fqn is None:
            # (with the shapes recorded, an entry with no leaves may be an empty container:
            # `apply` judges it by its shape)
            raise _no_value(e.key, metadata, prefix, rank, where)
    return template


def _no_entry(e: Entry, where: str) -> FormatError:
    """The model, optimizer or Stateful object `e` of `into` is not in the save."""
    return FormatError(
        f"the checkpoint holds no entry {e.key!r} (the {_KIND_NAMES[e.kind]} of `into`)",
        path=where,
        fix=f"Drop {e.key!r} from `into` (and set it up anew), or load a checkpoint saved with it.",
    )


def _no_value(
    key: str, metadata: Any, prefix: tuple[str, ...], rank: int, where: str
) -> FormatError:
    """The plain value `key` of `into` is not in the save (for this rank)."""
    if prefix and not _rank_saved(metadata, prefix):
        # a resume on more ranks than saved it (or resharded for more without its values)
        return FormatError(
            f"the checkpoint holds no values of rank {rank} (such as {key!r}): "
            "it was saved by fewer ranks, or resharded without them (--rank-state drop)",
            path=where,
            fix=f"Resume with the ranks that saved it, or drop {key!r} from `into` "
            "and set it anew on every rank.",
        )
    return FormatError(
        f"the checkpoint holds no entry {key!r}",
        path=where,
        fix=f"Drop {key!r} from `into`, or load a checkpoint saved with it.",
    )


def _fqn(metadata: Any, path: tuple[str, ...]) -> str | None:
    """The key DCP saved the value at `path` under, if the save holds one."""
    paths = metadata.planner_data or {}
    for fqn in metadata.state_dict_metadata:
        if tuple(paths.get(fqn, (fqn,))) == path:
            return str(fqn)
    return None


def has_record(metadata: Any) -> bool:
    """Whether the save holds the record `__ckpt__` (and so each rank's own plain values)."""
    paths = metadata.planner_data or {}
    return any(paths.get(fqn, (fqn,))[0] == RECORD_KEY for fqn in metadata.state_dict_metadata)


def _rank_saved(metadata: Any, prefix: tuple[str, ...]) -> bool:
    paths = metadata.planner_data or {}
    return any(
        tuple(paths.get(fqn, (fqn,)))[: len(prefix)] == prefix
        for fqn in metadata.state_dict_metadata
    )


@dataclass(frozen=True)
class Restored:
    """What `rebuild` made of a loaded save for this rank, before anything is handed over."""

    #: the loaded state dict `dcp.load` filled
    loaded: dict[str, Any]
    #: each Stateful's and plain value's recorded shape (empty for a save without a record)
    shapes: dict[str, Shape]
    #: the Stateful objects' states and plain values, by entry name
    rebuilt: dict[str, Any]


def rebuild(
    items: list[Entry], loaded: dict[str, Any], metadata: Any, rank: int = 0, where: str = ""
) -> Restored:
    """The loaded values of every Stateful and plain entry, as saved; changes no live object.

    Raises:
        FormatError: a plain value of `items` is not in the save for `rank`, or a Stateful
            object is neither in it nor in its record.
    """
    paths = metadata.planner_data or {}
    prefix = rank_path(rank) if has_record(metadata) else ()
    shapes_fqn = _fqn(metadata, shapes_path(rank))
    shapes: dict[str, Shape] = json.loads(loaded[shapes_fqn]) if shapes_fqn is not None else {}
    rebuilt: dict[str, Any] = {}
    leaves: dict[tuple[str | int, ...], Any] = {}
    for fqn, value in loaded.items():
        if fqn in paths and fqn not in {e.key for e in _models(items)} and fqn != shapes_fqn:
            path = tuple(paths[fqn])
            if prefix and path[: len(prefix)] == prefix:  # this rank's own values
                path = path[len(prefix) :]
            _set_path(rebuilt, path, value)
            leaves[path] = value
    for e in items:
        if e.kind not in ("stateful", "value"):
            continue
        if e.key in shapes:
            # the value as it was saved: int keys and empty containers included (should a leaf
            # be missing, the value stays as DCP names it)
            with contextlib.suppress(KeyError):
                rebuilt[e.key] = _build(shapes[e.key], (e.key,), leaves)
        if e.kind == "stateful" and e.key not in rebuilt:
            raise _no_entry(e, where)  # neither saved nor recorded (see `load_template`)
        if e.kind == "value" and e.key not in rebuilt:
            # recorded in this rank's shapes but saved for no rank of this number: a save
            # resharded for more ranks gives the new ones the shapes, not the values
            raise _no_value(e.key, metadata, prefix, rank, where)
    return Restored(loaded=loaded, shapes=shapes, rebuilt=rebuilt)


def apply(items: list[Entry], restored: Restored) -> dict[str, Any]:
    """Hand the loaded state to the live objects; returns the plain values, by entry name."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    loaded, shapes, rebuilt = restored.loaded, restored.shapes, restored.rebuilt
    values: dict[str, Any] = {}
    for e in items:
        if e.kind == "model":
            set_model_state_dict(e.obj, loaded[e.key])
        elif e.kind == "optimizer":
            assert e.model is not None
            fill_quietly(e.obj)
            set_optimizer_state_dict(e.model, e.obj, loaded[e.key])
            if shapes.get(e.key) == NOT_STEPPED:  # saved before its first step: as it was then
                e.obj.state.clear()
        elif e.kind == "stateful":
            e.obj.load_state_dict(rebuilt.get(e.key, {}))
        else:
            values[e.key] = rebuilt[e.key]
    return values


def _set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put `value` at `path` (dict keys and list indices, as DCP's traversal names them)."""
    node: Any = root
    for here, nxt in itertools.pairwise(path):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            assert isinstance(here, int)
            while len(node) <= here:
                node.append(None)
            if node[here] is None:
                node[here] = fresh
            node = node[here]
        else:
            node = node.setdefault(here, fresh)
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value
