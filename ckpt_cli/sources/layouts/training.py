"""Optimizer, scheduler, RNG and data-loader analysis; the resumable / exact verdict."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...budgets import json_record_over_budget
from ...errors import CkptError
from ...formats.base import Checkpoint, Source
from ...formats.names import RESHARD_RECORD
from ...models import Entry, Manifest, OptimizerState, Problem, ProblemList, TrainingState
from .base import REQUIRED, OpenedSource, top_keys
from .ranks import MAX_FILE_NUMBER, RANK_RNG_CODES

if TYPE_CHECKING:
    from .composite import Folder

# --------------------------------------------------------------------------- analysis


def value_of(checkpoint: Checkpoint, name: str) -> Any:
    """An object entry's value: from the manifest when it holds it, else read (None on error)."""
    entry = checkpoint.manifest.by_name.get(name)
    if entry is None:
        return None
    if entry.kind == "object" and entry.value is not None:
        return entry.value
    if entry.kind == "tensor" and entry.numel != 1:
        return None  # counters are scalars; never read a large tensor here
    stored = _stored_value(checkpoint, entry)
    if stored is not _UNREAD:
        return stored
    try:
        if entry.kind == "tensor":
            return checkpoint.read_tensor(name).item()
        value = checkpoint.read_object(name)
    except CkptError:
        return None
    if hasattr(value, "item"):  # a numpy / torch scalar kept in an object entry
        try:
            return value.item() if getattr(value, "numel", lambda: 1)() == 1 else value
        except (AttributeError, ValueError, RuntimeError):
            return value
    return value


#: `_stored_value`'s answer when it could not read the value without torch
_UNREAD = object()


def _stored_value(checkpoint: Checkpoint, entry: Entry) -> Any:
    """A DCP scalar or small object read from its stored bytes without torch, else `_UNREAD`.

    The summary of a DCP training checkpoint (step, param groups, scheduler counters) then
    never imports torch (`ckpt_cli.formats.torch.pickle_values`); whatever that reader refuses (a blob with
    other globals, a compressed tensor chunk) goes to the format's own torch-based reader.
    """
    from ...formats.dcp import DcpCheckpoint
    from ...formats.torch.pickle_values import (
        MAX_BLOB_BYTES,
        NotPlain,
        SavedTensorValue,
        decode_scalar,
        load_plain,
        saved_scalar,
    )

    if not isinstance(checkpoint, DcpCheckpoint):
        return _UNREAD
    if entry.kind == "object":
        if entry.offset is None or entry.nbytes > MAX_BLOB_BYTES:
            return _UNREAD  # not a stored blob (Megatron's common.pt keys), or a large one
        try:
            value = load_plain(checkpoint.read_object_bytes(entry.name))
        except (NotPlain, CkptError):
            return _UNREAD
        if isinstance(value, SavedTensorValue) and value.value is not None:
            return value.value
        return value
    chunks = [c for c in entry.chunks or [] if c.byte_length]
    if len(chunks) != 1 or entry.dtype is None or entry.numel != 1:
        return _UNREAD
    chunk = chunks[0]
    if (chunk.file, chunk.byte_offset) in checkpoint.transforms:
        return _UNREAD  # compressed: the format's reader inflates it
    if chunk.byte_length > MAX_BLOB_BYTES:
        return _UNREAD
    try:
        data = checkpoint.storage.read(chunk.file, chunk.byte_offset, chunk.byte_length)
    except CkptError:
        return None
    value = decode_scalar(data, entry.dtype) if chunk.raw else saved_scalar(data)
    return _UNREAD if value is None else value


def entries_under(manifest: Manifest, prefix: str) -> list[Entry]:
    return [e for e in manifest.entries if e.name.startswith(prefix)]


def weights_summary(checkpoint: Checkpoint, prefix: str) -> dict[str, int]:
    """Tensors, parameters and bytes of the weights under `prefix`; parameters by the rule of
    every parameter count (`quant.entry_parameters`: a quantized weight's scales are none)."""
    from ...quant import parameter_counter

    manifest = checkpoint.manifest
    tensors = [e for e in entries_under(manifest, prefix) if e.kind == "tensor"]
    count = parameter_counter(manifest, checkpoint.storage)
    return {
        "tensors": len(tensors),
        "parameters": sum(count(e) for e in tensors),
        "bytes": sum(e.nbytes for e in tensors),
    }


_OPTIMIZER_KINDS = (
    ({"exp_avg_sq_row"}, "Adafactor"),
    ({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, "Adam (amsgrad)"),
    ({"exp_avg", "exp_avg_sq"}, "Adam"),
    ({"acc_delta"}, "Adadelta"),
    ({"square_avg"}, "RMSprop"),
    ({"momentum_buffer"}, "SGD"),
    ({"sum"}, "Adagrad"),
    ({"exp_avg"}, "Lion"),
)


@dataclass
class OptimizerView:
    """Per-parameter optimizer state as found: param id -> state name -> shape."""

    state: OptimizerState
    per_param: dict[str, dict[str, list[int]]]
    by_fqn: bool
    #: the state is keyed by the strings "0", "1"... while `param_groups` name int ids (what
    #: torch's `dcp_to_torch_save` writes): `optimizer.load_state_dict` restores none of it
    ids_as_strings: bool = False


def analyse_optimizer(checkpoint: Checkpoint, prefix: str) -> OptimizerView | None:
    """Summarise a `torch.optim` state dict (int ids, or DCP's FQN-keyed flattening)."""
    manifest = checkpoint.manifest
    entries = entries_under(manifest, prefix)
    if not entries:
        return None
    state_prefix = f"{prefix}state."
    groups_prefix = f"{prefix}param_groups."
    per_param: dict[str, dict[str, list[int]]] = {}
    for e in entries:
        if e.name.startswith(state_prefix):
            rest = e.name[len(state_prefix) :]
            if "." not in rest:
                continue
            pid, state_name = rest.rsplit(".", 1)
            per_param.setdefault(pid, {})[state_name] = list(e.shape) if e.kind == "tensor" else []
    group_names = [e.name for e in entries if e.name.startswith(groups_prefix)]
    by_fqn = bool(per_param) and not all(pid.isdigit() for pid in per_param)
    int_ids = False
    params: int | None = None
    group_keys: dict[str, Any] = {}
    ids: list[str] = []  # the parameters param_groups list, as the state keys them
    listed = [n for n in group_names if n.endswith(".params")]
    if listed:
        # param_groups is a list whose `params` name the parameters (ids, or FQNs in DCP)
        total = 0
        for name in group_names:
            if name.endswith(".params"):
                value = value_of(checkpoint, name)
                if isinstance(value, (list, tuple)):
                    total += len(value)
                    int_ids = int_ids or any(type(v) is int for v in value)
                    ids += [str(v) for v in value]
            key = name.rsplit(".", 1)[-1]
            if key not in group_keys:
                group_keys[key] = (
                    value_of(checkpoint, name) if key == "decoupled_weight_decay" else 1
                )
        params = total
    elif group_names:
        fqns = {n[len(groups_prefix) :].rsplit(".", 1)[0] for n in group_names}
        params = len(fqns)
        ids = sorted(fqns)
        for n in group_names:
            if n.endswith(".decoupled_weight_decay"):
                group_keys["decoupled_weight_decay"] = value_of(checkpoint, n)
    names = sorted({s for states in per_param.values() for s in states})
    kind = None
    for needed, label in _OPTIMIZER_KINDS:
        if needed <= set(names):
            kind = label
            break
    if kind == "Adam" and group_keys.get("decoupled_weight_decay") is True:
        kind = "AdamW"
    full = set(names)
    with_state = sum(1 for states in per_param.values() if set(states) == full) if full else 0
    if params is None:
        params = len(per_param)
    complete = params > 0 and with_state == params and len(per_param) == params
    pending: list[str] = []
    if not complete and per_param and with_state == len(per_param) and len(ids) == params:
        # every parameter with state has all of it, the others none: torch keeps no state
        # for a parameter before its first gradient (frozen, staged unfreezing), and a resume
        # restores the rest; only state for a parameter no group lists says otherwise
        pending = [pid for pid in ids if pid not in per_param]
        complete = len(pending) + len(per_param) == params
        if not complete:
            pending = []
    if not per_param and params and _stateless_sgd(checkpoint, groups_prefix, group_names):
        # SGD without momentum keeps no per-parameter state: nothing is missing
        kind, complete = "SGD", True
    return OptimizerView(
        state=OptimizerState(
            kind=kind,
            states=names,
            params=params,
            params_with_state=with_state,
            complete=complete,
            pending=pending,
            source=prefix,
            # every torch LR scheduler sets `initial_lr` in each param group it schedules
            scheduled=any(n.endswith(".initial_lr") for n in group_names) if group_names else None,
        ),
        per_param=per_param,
        by_fqn=by_fqn,
        ids_as_strings=int_ids and not by_fqn and _state_keys_are_strings(entries, state_prefix),
    )


def _state_keys_are_strings(entries: list[Entry], state_prefix: str) -> bool:
    """Whether the saved keys below `state_prefix` (`optimizer.state.`) are strings where the
    format keeps real keys (a torch.save file): an int-keyed optimizer's ids written as "0"."""
    for entry in entries:
        if not entry.name.startswith(state_prefix):
            continue
        keys = entry.keys_as_named()
        if not keys:
            return False  # only dotted names known: nothing to tell
        joined = ""
        for depth, (_, key) in enumerate(keys[:-1]):
            joined += f"{key}."
            if joined == state_prefix:
                return isinstance(keys[depth + 1][1], str)
        return False
    return False


def _stateless_sgd(checkpoint: Checkpoint, groups_prefix: str, group_names: list[str]) -> bool:
    momenta = [n for n in group_names if n.endswith(".momentum")]
    dampening = any(n.endswith(".dampening") for n in group_names)
    return bool(momenta) and dampening and all(value_of(checkpoint, n) == 0 for n in momenta)


_SCHEDULERS = (
    ("_schedulers", "SequentialLR/ChainedScheduler"),
    ("lr_lambdas", "LambdaLR"),
    ("total_steps", "OneCycleLR"),
    ("T_max", "CosineAnnealingLR"),
    ("T_0", "CosineAnnealingWarmRestarts"),
    ("milestones", "MultiStepLR"),
    ("step_size", "StepLR"),
    # the three save `total_iters`; only LinearLR a `start_factor`, only PolynomialLR a `power`
    ("start_factor", "LinearLR"),
    ("power", "PolynomialLR"),
    ("total_iters", "ConstantLR"),
    ("gamma", "ExponentialLR"),
    ("patience", "ReduceLROnPlateau"),
)


def _scheduler(checkpoint: Checkpoint, prefix: str) -> dict[str, Any] | None:
    entries = entries_under(checkpoint.manifest, prefix)
    if not entries:
        return None
    keys = {e.name[len(prefix) :].split(".", 1)[0] for e in entries}
    summary: dict[str, Any] = {}
    for key, label in _SCHEDULERS:
        if key in keys:
            summary["kind"] = label
            break
    # DeepSpeed's own schedulers (WarmupLR, WarmupDecayLR, OneCycle...) count
    # `last_batch_iteration` where torch's count `last_epoch`; Megatron's
    # `OptimizerParamScheduler` counts `num_steps` (in samples)
    for key in ("last_epoch", "_step_count", "last_batch_iteration", "num_steps"):
        value = value_of(checkpoint, f"{prefix}{key}")
        if isinstance(value, int):
            summary[key.lstrip("_")] = value
    last_lr = value_of(checkpoint, f"{prefix}_last_lr")
    if isinstance(last_lr, list) and last_lr:
        summary["last_lr"] = last_lr[0] if len(last_lr) == 1 else last_lr
    if not summary:
        summary["entries"] = len(entries)
    return summary


_RNG_STREAMS = (
    (("python", "random_state"), "python"),
    (("numpy", "np_"), "numpy"),
    (("cuda",), "torch_cuda"),
    (("xpu",), "torch_xpu"),
    (("mps",), "torch_mps"),
    (("npu",), "torch_npu"),
    (("xm_", "xla"), "torch_xla"),
    (("cpu", "torch"), "torch_cpu"),
)


def rng_streams(manifest: Manifest, prefixes: list[str]) -> list[str]:
    found: list[str] = []
    for prefix in prefixes:
        for e in entries_under(manifest, prefix):
            key = e.name[len(prefix) :].split(".", 1)[0].lower()
            for needles, stream in _RNG_STREAMS:
                if any(n in key for n in needles):
                    if stream not in found:
                        found.append(stream)
                    break
    order = [s for _, s in _RNG_STREAMS]
    return sorted(found, key=order.index)


_RANKED = re.compile(r"(?P<comp>[a-z_]+?)_(?P<rank>\d+)")


def rank_components(manifest: Manifest, component: str) -> dict[int, str]:
    """The per-rank components `<component>_N` (`rng_0`, `rng_1`...) among the top-level
    names of `manifest`: rank -> component name. A composite folder names a layout's per-rank
    files so (`Folder.add_many`), and a whole folder converted to one file keeps the names."""
    found: dict[int, str] = {}
    for key in top_keys(manifest):
        match = _RANKED.fullmatch(key)
        if match and match["comp"] == component:
            found.setdefault(int(match["rank"]), key)
    return found


def analyse(checkpoint: Checkpoint, layout: str, prefixes: dict[str, str]) -> TrainingState:
    manifest = checkpoint.manifest
    state = TrainingState(layout=layout, prefixes=dict(prefixes))
    if "model" in prefixes:
        state.weights = weights_summary(checkpoint, prefixes["model"])
    if "optimizer" in prefixes:
        view = analyse_optimizer(checkpoint, prefixes["optimizer"])
        state.optimizer = view.state if view else None
    if "scheduler" in prefixes:
        state.scheduler = _scheduler(checkpoint, prefixes["scheduler"])
    rng_prefixes = [prefixes["rng"]] if "rng" in prefixes else []
    # every rank's RNG component (`rng_0.`, `rng_1.`): in a composite folder, and in the one
    # torch / DCP file a whole folder was converted to, which keeps the component names
    ranks = rank_components(manifest, "rng")
    rng_prefixes += [f"{c}." for c in ranks.values()]
    state.rng = rng_streams(manifest, list(dict.fromkeys(rng_prefixes)))
    state.rng_ranks = sorted(ranks)
    if "dataloader" in prefixes:
        entries = entries_under(manifest, prefixes["dataloader"])
        if entries:
            state.dataloader = {"entries": len(entries), "source": prefixes["dataloader"]}
    return state


def all_models(checkpoint: Checkpoint, state: TrainingState) -> None:
    """With several prepared models (`model`, `model_1`...), the weights and the optimizer
    state of all of them: one training run resumes only with every model and every optimizer.
    Components are found by their names (`model_1.`), so a folder converted whole to one file
    reports what the folder did.

    accelerate numbers the prepared models and the prepared optimizers apart (`save_state`):
    one optimizer may step several models, and a model may have none (a frozen teacher), so
    the optimizer state is every saved optimizer's, complete when each one is. Under FSDP
    accelerate saves optimizer i with model i (`save_fsdp_optimizer`, keyed by that model's
    FQNs): there a model whose optimizer state was not saved makes it incomplete."""
    keys = top_keys(checkpoint.manifest)
    models = numbered_keys(keys, "model")
    if len(models) < 2 and len(numbered_keys(keys, "optimizer")) < 2:
        return  # one model, one optimizer: `analyse` said it all
    weights = [weights_summary(checkpoint, f"{c}.") for c in models]
    state.weights = {
        k: sum(w.get(k, 0) for w in weights) for k in ("tensors", "parameters", "bytes")
    }
    saved = {o: analyse_optimizer(checkpoint, f"{o}.") for o in numbered_keys(keys, "optimizer")}
    views: list[OptimizerState | None]
    if any(v is not None and v.by_fqn for v in saved.values()):
        views = []
        for model in models:
            view = saved.get(model.replace("model", "optimizer", 1))
            views.append(view.state if view is not None else None)
    else:
        views = [v.state for v in saved.values() if v is not None]
    combined = _combined_optimizers(views)
    if combined is not None:
        state.optimizer = combined


def all_schedulers(checkpoint: Checkpoint, state: TrainingState) -> None:
    """With several LR schedulers saved (accelerate numbers its prepared schedulers:
    `scheduler`, `scheduler_1`...), each one's summary in `state.schedulers`; `load_state`
    restores every one, so every one is described. `state.scheduler` stays the first's."""
    names = numbered_keys(top_keys(checkpoint.manifest), "scheduler")
    if len(names) < 2:
        return
    for name in names:
        summary = _scheduler(checkpoint, f"{name}.")
        if summary is not None:
            state.schedulers[name] = summary


def numbered_keys(keys: Iterable[str], stem: str) -> list[str]:
    """The top-level keys accelerate numbers for its i-th prepared object of a kind (`model`,
    `model_1`, `model_2`...), in that order."""
    found = [k for k in keys if re.fullmatch(rf"{stem}(_\d+)?", k)]
    return sorted(found, key=lambda k: int(k[len(stem) + 1 :] or 0))


def _combined_optimizers(views: list[OptimizerState | None]) -> OptimizerState | None:
    """One summary of several optimizers' states (None where one was not saved): complete
    only when every one is there and complete; None when none is."""
    found = [v for v in views if v is not None]
    if not found:
        return None
    # one kind when they agree, else each named in order (`AdamW + SGD`: a GAN's two); one
    # that cannot be told spoils nothing of the others' names
    kinds = list(dict.fromkeys(v.kind or "unknown" for v in found))
    return OptimizerState(
        kind=None if kinds == ["unknown"] else " + ".join(kinds),
        states=sorted({s for v in found for s in v.states}),
        params=sum(v.params or 0 for v in found),
        params_with_state=sum(v.params_with_state or 0 for v in found),
        complete=len(found) == len(views) and all(v.complete for v in found),
        pending=[p for v in found for p in v.pending],
        source=", ".join(v.source or "" for v in found),
        scheduled=True
        if any(v.scheduled for v in found)
        else False
        if all(v.scheduled is False for v in found)
        else None,
    )


#: a per-rank FSDP component (`composite.rank_component`): object, its index, the rank
_RANK_PART = re.compile(r"(?P<obj>model|optimizer)(?:_(?P<index>\d+))?_rank(?P<rank>\d+)")


def rank_parts(manifest: Manifest) -> dict[tuple[str, int], dict[int, str]]:
    """The per-rank FSDP components among the top-level names of `manifest` (`model_rank0`,
    `optimizer_1_rank1`...): (object, index) -> rank -> the prefix of its entries. A folder
    names accelerate's `*_rank{r}.bin` files so, and a whole folder converted to one file keeps
    the names."""
    found: dict[tuple[str, int], dict[int, str]] = {}
    for key, prefix in top_keys(manifest).items():
        match = _RANK_PART.fullmatch(key)
        if match:
            part = (match["obj"], int(match["index"] or 0))
            found.setdefault(part, {})[int(match["rank"])] = prefix
    return found


def per_rank_models(checkpoint: Checkpoint, state: TrainingState) -> None:
    """The weights and optimizer state of a save made of per-rank files (accelerate FSDP's
    LOCAL_STATE_DICT, or SHARDED_STATE_DICT with `use_dcp=False`) when no other copy of the
    model is there: the weights as the ranks' files store them (every rank's shard counted),
    and the optimizer state complete only when every rank that saved a model shard saved its
    optimizer state, complete."""
    parts = rank_parts(checkpoint.manifest)
    models = {index: ranks for (obj, index), ranks in parts.items() if obj == "model"}
    if not models or "model" in state.prefixes:
        return
    summaries = [
        weights_summary(checkpoint, prefix)
        for ranks in models.values()
        for prefix in ranks.values()
    ]
    state.weights = {
        k: sum(w.get(k, 0) for w in summaries) for k in ("tensors", "parameters", "bytes")
    }
    if state.optimizer is not None:
        return
    views: list[OptimizerState | None] = []
    for index, ranks in sorted(models.items()):
        optimizers = parts.get(("optimizer", index), {})
        for rank in sorted(ranks):
            prefix = optimizers.get(rank)
            view = analyse_optimizer(checkpoint, prefix) if prefix is not None else None
            views.append(view.state if view is not None else None)
    combined = _combined_optimizers(views)
    if combined is not None:
        state.optimizer = combined


#: `TrainingState.dataloader["kind"]` of a data position saved as a batch count alone, whose
#: order after resume the save does not show (accelerate's `dl_state_dict.bin` over a torch
#: sampler): not exact, with its `reason`
COUNTED_ONLY = "batch count only"
#: `TrainingState.dataloader["kind"]` of accelerate's `sampler.bin` saved without
#: `dl_state_dict.bin`: the epoch's shuffle order (the sampler's epoch and seed), not the position
#: within it; `load_state` starts the epoch again from its first batch: not exact, with its
#: `reason`
EPOCH_ONLY = "seedable sampler"
#: the data-loader kinds an exact resume lacks: the position is not restored (the Trainer's
#: `ignore_data_skip`), restored in an order the save does not show, or not saved (the epoch)
_NOT_REPLAYED = ("not replayed", COUNTED_ONLY, EPOCH_ONLY)


def verdict(state: TrainingState) -> None:
    """Two levels: `resumable` (training can continue: weights, optimizer, a progress counter)
    and `exact` (the resumed run is bit-identical: also scheduler, step, RNG, data loader).
    Lightning and torchtitan saves without RNG, or torch dicts without data-loader state, are
    resumable (their users resume from them every day), not exact."""
    missing = []
    if not state.weights.get("tensors"):
        missing.append("weights")
    if state.optimizer is None:
        missing.append("optimizer")
    elif not state.optimizer.complete:
        missing.append("optimizer state for every parameter")
    counted = state.step is not None or state.epoch is not None or state.counter is not None
    if not counted and not state.scheduler:
        missing.append("step")
    for rel, why in state.unreadable.items():
        missing.append(f"{rel} (unreadable: {why})")
    extra = []
    # a run with no LR scheduler saves none, and resumes exactly without one
    unscheduled = state.optimizer is not None and state.optimizer.scheduled is False
    if not state.scheduler and not unscheduled:
        extra.append("scheduler")
    if not counted and "step" not in missing:
        extra.append("step")
    if not state.rng:
        extra.append("rng")
    if not state.dataloader or state.dataloader.get("kind") in _NOT_REPLAYED:
        extra.append("dataloader")
    if state.resharded is not None:
        extra.append(_resharded_note(state.resharded))
    state.missing = missing
    state.resumable = not missing
    state.missing_exact = extra
    state.exact = state.resumable and not extra


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def component_problems(opened: OpenedSource) -> list[Problem]:
    """Components that were found but could not be read (for a structural verify)."""
    return list(opened.problems)


def opened_problems(source: Source, opened: OpenedSource) -> list[Problem]:
    """The structural problems of a training folder `source` opened as `opened`: the
    components that could not be read, and each component file's (or subfolder's) own format
    check (what `verify` runs on a training folder, and on each rank folder of a whole legacy
    Megatron-LM save)."""
    from ...formats import get_format
    from .composite import subfolder_source

    problems = component_problems(opened)
    for rel, fmt in opened.parts.values():
        if fmt == "json":
            continue
        if rel.endswith("/"):
            part = subfolder_source(source, rel.rstrip("/"))
        else:
            part = Source(location=source.location, storage=source.storage, target=rel)
        problems.extend(get_format(fmt).check(part))
    return problems


def no_training_state(opened: OpenedSource) -> str:
    """Why a source with no training layout holds no training state, in a few words: weights
    only, or entries beside them in no arrangement a training framework saves (a DeepSpeed
    folder converted whole into one file holds its optimizer partitions, in names no loader
    resumes from)."""
    if all(e.kind == "tensor" for e in opened.checkpoint.manifest.entries):
        return "weights only"
    return "its entries are laid out as no training framework ckpt knows saves them"


#: what makes accelerate's `save_state` keep the data position and its order
_STATEFUL_LOADER = (
    "create the Accelerator with dataloader_config=DataLoaderConfiguration("
    "use_stateful_dataloader=True) and prepare a torchdata StatefulDataLoader(..., shuffle=True) "
    "in place of the torch DataLoader: save_state then saves the position and the shuffle "
    "generator (dl_state_dict.bin) and load_state restores both"
)

#: who saves an item a checkpoint lacks (see `training_checks`)
_SAVERS = "the Trainer and accelerate's save_state do"


def training_checks(opened: OpenedSource, exact: bool = False) -> list[Problem]:
    """What `verify --resumable` reports: every reason the checkpoint cannot resume the run.

    Errors: missing weights, optimizer or progress counter; optimizer state that does not
    exist for every parameter or whose shapes do not match the weights; components that could
    not be read. What only an exact (bit-identical) resume needs (scheduler, step, RNG,
    data-loader state) is a warning, an error with `exact`. A source with no training state
    at all is one problem.
    """
    where = opened.checkpoint.manifest.location
    state = opened.training
    if state is None:
        return [
            Problem(
                code="not_resumable",
                message=f"{where}: holds no training state ({no_training_state(opened)}); "
                "a resumable checkpoint also saves optimizer, scheduler, step, RNG and data-loader state",
                file=where,
                fix="Resume from a checkpoint that saved the training state (`ckpt latest "
                "RUN_DIR` names the newest complete one), or save the whole state next time "
                "(Trainer without save_only_model, accelerate save_state, DCP with the "
                "optimizer's state dict).",
            )
        ]
    problems = component_problems(opened)
    labels = {
        "weights": "no model weights",
        "optimizer": "no optimizer state",
        "scheduler": "no LR scheduler state",
        "step": "no step or epoch counter",
        "rng": "no RNG state (dropout and shuffling will differ after a resume)",
        "dataloader": "no data-loader state (the resumed run will see different batches)",
    }
    #: what a save must include for each item
    saved = {
        "weights": "the model's state dict",
        "optimizer": "the optimizer's state dict",
        "scheduler": "the LR scheduler's state dict",
        "step": "the step (or epoch) counter",
        "rng": "the RNG states (torch, CUDA, numpy, random)",
        "dataloader": "the data loader's (or sampler's) state",
    }
    #: who saves it, where not both of the Trainer and accelerate's save_state do
    savers = {
        "dataloader": "the Trainer does, and accelerate's save_state of a torchdata "
        "StatefulDataLoader with DataLoaderConfiguration(use_stateful_dataloader=True)"
    }
    fixes: dict[str, str] = {}
    kind = state.dataloader.get("kind") if state.dataloader else None
    reason = state.dataloader.get("reason") if state.dataloader else None
    if kind == COUNTED_ONLY and isinstance(reason, str):
        # restored, but in an order the save does not show (accelerate over a torch sampler)
        labels["dataloader"] = f"the data position is saved without its order ({reason})"
        fixes["dataloader"] = (
            f"For an exact resume, {_STATEFUL_LOADER}. With a torch DataLoader, create the "
            "Accelerator with DataLoaderConfiguration(use_stateful_dataloader=True, "
            "use_seedable_sampler=True) and call the prepared loader's set_epoch(epoch) at "
            "each epoch: the resumed run then draws the saved run's order, which the save "
            "cannot show (a restart test compared with `ckpt diff` can)."
        )
    elif kind == EPOCH_ONLY and isinstance(reason, str):
        # the epoch's order restored, not the position in it (accelerate's sampler.bin alone)
        labels["dataloader"] = f"the data position within the epoch is not saved ({reason})"
        fixes["dataloader"] = (
            f"For an exact resume, {_STATEFUL_LOADER}; or resume from a save made at an "
            "epoch's end (the save does not show whether it was)."
        )
    elif isinstance(reason, str):
        # saved, but the framework will not restore it (the Trainer's ignore_data_skip)
        labels["dataloader"] = f"the data position is not restored ({reason})"
        fixes["dataloader"] = (
            "For an exact resume, resume with ignore_data_skip=False (TrainingArguments' "
            "default), so the Trainer skips the batches trained on, or resume from a save at "
            "an epoch's end."
        )
    elif state.layout == "accelerate":
        # save_state keeps a data position only for torchdata's StatefulDataLoader
        fixes["dataloader"] = (
            f"For an exact resume, {_STATEFUL_LOADER} (over a torch DataLoader's sampler it "
            "saves a batch count only, in the saved run's order only with "
            "use_seedable_sampler=True, which the save cannot show); or resume from a "
            "checkpoint of the run that holds it."
        )
    said = {p.code for p in problems}
    for item in REQUIRED:
        if item in state.missing and f"missing_{item}" not in said:
            problems.append(
                Problem(
                    code=f"missing_{item}",
                    message=f"{where}: {labels[item]}",
                    file=where,
                    fix=f"Resume from a checkpoint of the run that holds it (`ckpt latest "
                    f"RUN_DIR` names the newest complete one), or save {saved[item]} with the "
                    "checkpoint next time.",
                )
            )
        elif item in state.missing_exact:
            problems.append(
                Problem(
                    code=f"missing_{item}",
                    message=f"{where}: {labels[item]}; resumable, but not exactly",
                    file=where,
                    severity="error" if exact else "warning",
                    fix=fixes.get(item)
                    or f"For an exact resume, save {saved[item]} with the checkpoint "
                    f"({savers.get(item, _SAVERS)}), or resume from a checkpoint of the run that "
                    "holds it.",
                )
            )
    if state.resharded is not None:
        # 0: a record that could not be read (the world sizes are unknown, the cut is not)
        was = state.resharded["saved_world_size"] or "?"
        now = state.resharded["world_size"] or "?"
        record = state.reshard_record or RESHARD_RECORD
        cut = (
            f"`ckpt reshard` cut it from the {was} rank(s) the run saved it at for {now} ({record})"
        )
        on = f"{was} rank(s)"
        if state.reshard_record_problem is not None:
            # the record says the folder was cut; what it says of the world sizes is unread
            cut = (
                f"`ckpt reshard` cut it for another world size, but its {record} "
                f"{state.reshard_record_problem}, so the world size the run saved it at is "
                "unknown"
            )
            on = "the world size the run saved it at (its launch command or logs say it)"
        problems.append(
            Problem(
                code="resharded_world_size",
                message=f"{where}: {cut}: every rank reads another shard of the data and draws "
                "from another RNG stream than the saved run did; resumable, but not exactly",
                file=where,
                severity="error" if exact else "warning",
                fix=f"For an exact resume, resume on {on} from the save the run wrote; a resume "
                "on another world size is never bit-identical.",
            )
        )
    opt = state.optimizer
    if opt is not None and not opt.complete:
        covers = (
            f"optimizer state covers {opt.params_with_state} of {opt.params} parameters "
            f"({', '.join(opt.states) or 'no state'})"
        )
        if opt.params_with_state == opt.params:
            # every optimizer saved is whole: what is missing is a model's own optimizer
            covers = (
                "a model's optimizer state was not saved (each model saves its own here: "
                f"FSDP's optimizer_i, a rank's file); the {covers.removeprefix('optimizer ')} "
                "of the optimizers saved"
            )
        problems.append(
            Problem(
                code="optimizer_incomplete",
                message=f"{where}: {covers}",
                file=where,
                fix="Resume from a checkpoint whose optimizer state covers every parameter "
                "(`ckpt latest RUN_DIR` names the newest complete one); a sharded optimizer "
                "(FSDP, ZeRO) needs every rank's part in the save.",
            )
        )
    if opt is not None and opt.complete and opt.pending:
        shown = ", ".join(repr(p) for p in opt.pending[:5])
        more = f" and {len(opt.pending) - 5} more" if len(opt.pending) > 5 else ""
        problems.append(
            Problem(
                code="optimizer_state_pending",
                message=f"{where}: the optimizer's param_groups list {len(opt.pending)} "
                f"parameter(s) with no state ({shown}{more}): torch keeps no optimizer state "
                "for a parameter until it gets its first gradient (frozen, or not yet "
                "unfrozen); a resume restores the others' state and starts these fresh",
                file=where,
                severity="warning",
                fix="Nothing to do if those parameters were frozen or not trained yet; if they "
                "were trained, the optimizer state was saved before their first step: save "
                "again after it.",
            )
        )
    misfits = shape_problems(opened)
    if misfits and state.resumable:
        # the verdict `inspect` gives reads what is present; optimizer state that fits no
        # weight restores nothing for them, so the resume `verify --resumable` judges fails
        state.missing.append(
            "optimizer state keyed as the optimizer loads it"
            if any(p.code == "optimizer_ids_as_strings" for p in misfits)
            else "optimizer state that fits the weights"
        )
        state.resumable = state.exact = False
    problems.extend(misfits)
    return problems


def shape_problems(opened: OpenedSource) -> list[Problem]:
    """Optimizer state that does not fit the weights: state for a parameter the weights lack,
    or whose shape no (remaining) weight has (the optimizer was restored for other parameters).

    With several prepared models (accelerate's `model`, `model_1`... beside `optimizer`,
    `optimizer_1`...), every optimizer's state is fitted to the weights of all of them
    (accelerate numbers models and optimizers apart: `all_models`), FSDP's per-model
    optimizers each to its own model; each problem names the optimizer and the models."""
    state = opened.training
    if state is None or state.optimizer is None:
        return []
    model_prefix = state.prefixes.get("model")
    opt_prefix = state.prefixes.get("optimizer")
    if opt_prefix is not None and opt_prefix.startswith("optim_states"):
        return []  # DeepSpeed ZeRO state covers flat partitions, not individual weights
    pooled = _pooled_optimizers(opened.checkpoint, state.prefixes)
    if pooled is not None:
        models, optimizers = pooled
        available = Counter(
            tuple(e.shape)
            for prefix in models
            for e in entries_under(opened.checkpoint.manifest, prefix)
            if e.kind == "tensor"
        )
        found: list[Problem] = ProblemList()  # bounded: see `ProblemList`
        for optimizer in optimizers:
            found += _pair_shape_problems(opened, models, optimizer, available=available)
        return found
    pairs = model_optimizer_pairs(opened.checkpoint.manifest)
    if model_prefix is not None and opt_prefix is not None:
        pairs.insert(0, (model_prefix, opt_prefix))
    elif opt_prefix is not None:
        # an optimizer saved alone: no weights to fit, but its keys still decide what loads
        view = analyse_optimizer(opened.checkpoint, opt_prefix)
        if view is not None and view.ids_as_strings:
            where = opened.checkpoint.manifest.location
            return [ids_problem(where, view, opt_prefix, "optimizer state")]
    several = len(pairs) > 1
    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    for model, optimizer in pairs:
        problems += _pair_shape_problems(opened, [model], optimizer, named=several)
    return problems


def _pooled_optimizers(
    checkpoint: Checkpoint, prefixes: dict[str, str]
) -> tuple[list[str], list[str]] | None:
    """(model prefixes, optimizer prefixes) of several prepared models, or of one with several
    optimizers (Muon beside AdamW, each stepping some of its weights), whose optimizers are
    `torch.optim` state dicts (parameter ids, not FQNs): accelerate numbers models and
    optimizers apart, so every optimizer's state is fitted to the weights of all the models
    (`all_models`); None otherwise (one model and one optimizer, or FSDP's per-model
    optimizers). The models
    are the components `model`, `model_1`..., or those the layout's `prefixes` number so (the
    models a save hook wrote instead of accelerate: a DreamBooth run's `unet/` and
    `text_encoder/`, both stepped by one optimizer)."""
    keys = top_keys(checkpoint.manifest)
    models = [keys[m] for m in numbered_keys(keys, "model")]
    if len(models) < 2:
        models = [prefixes[m] for m in numbered_keys(prefixes, "model")]
    optimizers = numbered_keys(keys, "optimizer")
    if not models or not optimizers or len(models) + len(optimizers) < 3:
        return None  # one model, one optimizer: `model_optimizer_pairs` fits them
    views = [analyse_optimizer(checkpoint, keys[o]) for o in optimizers]
    if any(v is not None and v.by_fqn for v in views):
        return None
    return models, [keys[o] for o in optimizers]


#: the fix of optimizer state that does not fit the weights saved beside it
_OTHER_MODEL_FIX = (
    "The optimizer state was saved for another model (or the model changed since): resume "
    "with the model it was saved with, or from a checkpoint whose weights and optimizer were "
    "saved together (`ckpt latest RUN_DIR` names the newest complete one)."
)


def ids_problem(where: str, view: OptimizerView, opt_prefix: str, opt_label: str) -> Problem:
    """The `optimizer_ids_as_strings` problem of an optimizer whose view says so."""
    ids = sorted(view.per_param, key=int)
    shown = ", ".join(repr(p) for p in ids[:3]) + ("…" if len(ids) > 3 else "")
    return Problem(
        code="optimizer_ids_as_strings",
        message=f"{where}: {opt_label} is keyed by the strings {shown} while its param_groups "
        "name int ids: optimizer.load_state_dict accepts it and restores none of it (torch's "
        "dcp_to_torch_save writes it so)",
        file=where,
        tensor=f"{opt_prefix}state",
        fix="Convert the DCP save with `ckpt convert SRC OUT.pt --to torch`, which writes int "
        "ids, or re-key the state by int ids before loading it "
        "(`{int(k): v for k, v in sd['state'].items()}`).",
    )


def model_optimizer_pairs(manifest: Manifest) -> list[tuple[str, str]]:
    """The (model, optimizer) prefixes of the models after the first (`model_1.` with
    `optimizer_1.`...), in model order: accelerate numbers the i-th prepared object `_{i}`;
    then those of every rank's own files (`model_rank0.` with `optimizer_rank0.`...)."""
    keys = top_keys(manifest)
    numbered = sorted(
        (int(m.group(1)), key)
        for key in keys
        if (m := re.fullmatch(r"model_(\d+)", key)) is not None
    )
    pairs = [(keys[key], keys[f"optimizer_{i}"]) for i, key in numbered if f"optimizer_{i}" in keys]
    parts = rank_parts(manifest)
    for (obj, index), ranks in sorted(parts.items()):
        optimizers = parts.get(("optimizer", index), {}) if obj == "model" else {}
        pairs += [(ranks[r], optimizers[r]) for r in sorted(ranks) if r in optimizers]
    return pairs


def _pair_shape_problems(
    opened: OpenedSource,
    model_prefixes: list[str],
    opt_prefix: str,
    *,
    named: bool = True,
    available: Counter[tuple[int, ...]] | None = None,
) -> list[Problem]:
    """`shape_problems` of one optimizer against the weights of one model (or of several,
    `available` then the shapes the other optimizers left unclaimed); with `named`, each
    message says which optimizer and which model (`optimizer_1` against `model_1`)."""
    checkpoint = opened.checkpoint
    state = opened.training
    assert state is not None
    view = analyse_optimizer(checkpoint, opt_prefix)
    if view is None:
        return []
    where = checkpoint.manifest.location
    model = {
        e.name[len(prefix) :]: list(e.shape)
        for prefix in model_prefixes
        for e in entries_under(checkpoint.manifest, prefix)
        if e.kind == "tensor"
    }
    model_prefix = ", ".join(p.rstrip(".") for p in model_prefixes)
    if state.layout == "torchtitan":
        from .torchtitan import fused_shapes

        model.update(fused_shapes(model))  # its optimizer keys the fused `wqkv` parameter
    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    opt_label = f"{opt_prefix.rstrip('.')} state" if named else "optimizer state"
    if view.ids_as_strings:
        return [ids_problem(where, view, opt_prefix, opt_label)]
    weights_label = f"weight of {model_prefix}" if named else "model weight"
    lacking = f"{model_prefix} lacks" if named else "the weights lack"

    def shaped(states: dict[str, list[int]]) -> dict[str, list[int]]:
        # every state with a shape (exp_avg AND exp_avg_sq...), each one a parameter's shape
        return {name: s for name, s in states.items() if s and name != "step"}

    if view.by_fqn:
        for fqn, states in view.per_param.items():
            if fqn not in model:
                problems.append(
                    Problem(
                        code="optimizer_unknown_param",
                        message=f"{where}: {opt_label} for {fqn!r}, which {lacking}",
                        file=where,
                        tensor=f"{opt_prefix}state.{fqn}",
                        fix=_OTHER_MODEL_FIX,
                    )
                )
                continue
            for key, shape in shaped(states).items():
                if shape != model[fqn]:
                    problems.append(
                        Problem(
                            code="optimizer_shape_mismatch",
                            message=f"{where}: {opt_label} of {fqn!r} ({key}) is {shape}, "
                            f"the {weights_label} is {model[fqn]}",
                            file=where,
                            tensor=f"{opt_prefix}state.{fqn}.{key}",
                            fix=_OTHER_MODEL_FIX,
                        )
                    )
        return problems
    # torch.optim numbers parameters in model.parameters() order, which the saved weights do
    # not record (safetensors sorts names): every state shape must match a distinct weight
    if available is None:
        available = Counter(tuple(s) for s in model.values())
    for pid in sorted(view.per_param, key=lambda p: int(p) if p.isdigit() else 0):
        states = shaped(view.per_param[pid])
        if not states:
            continue
        (first, shape), *others = states.items()
        odd = [(key, s) for key, s in others if s != shape]
        if odd:
            # the states of one parameter all have its shape: one that differs is wrong
            problems.append(
                Problem(
                    code="optimizer_shape_mismatch",
                    message=f"{where}: {opt_label} of parameter {pid}: {first} is {shape} "
                    f"but {', '.join(f'{key} is {s}' for key, s in odd)} (each state of a "
                    "parameter has the parameter's shape)",
                    file=where,
                    tensor=f"{opt_prefix}state.{pid}.{odd[0][0]}",
                    fix=_OTHER_MODEL_FIX,
                )
            )
            continue
        if available[tuple(shape)] > 0:
            available[tuple(shape)] -= 1
            continue
        problems.append(
            Problem(
                code="optimizer_shape_mismatch",
                message=f"{where}: {opt_label} of parameter {pid} has shape {shape}, "
                f"which no remaining {weights_label} has",
                file=where,
                tensor=f"{opt_prefix}state.{pid}",
                fix=_OTHER_MODEL_FIX,
            )
        )
    return problems


def _resharded_note(record: dict[str, int]) -> str:
    return f"the world size it was saved at ({record['saved_world_size'] or '?'})"


def note_resharded(state: TrainingState, source: Source, rel: str) -> None:
    """`state` (its verdict given) with what the `ckpt-reshard.json` at `rel` of `source` says:
    a save `ckpt reshard --world-size` cut for another world size resumes, never exactly."""
    state.resharded, state.reshard_record_problem = read_reshard_record(source, rel)
    if state.resharded is not None:
        state.reshard_record = rel
        state.missing_exact.append(_resharded_note(state.resharded))
        state.exact = False


def resharded(source: Source, rel: str) -> dict[str, int] | None:
    """What the `ckpt-reshard.json` at `rel` of `source` says (`TrainingState.resharded`), or
    None where there is none. A record that cannot be read still says the folder was
    resharded: its world sizes are then 0 (unknown; `read_reshard_record` says why)."""
    return read_reshard_record(source, rel)[0]


def read_reshard_record(source: Source, rel: str) -> tuple[dict[str, int] | None, str | None]:
    """(`resharded`, why the record could not be read or None). The record is ckpt's own, but
    a folder's files are its owner's: a record past the JSON budget is not read, one nested too
    deep for the parser, not JSON, not an object, or whose world sizes are no positive counts
    of ranks (`MAX_FILE_NUMBER` at most) gives unknown world sizes (0), never a crash."""
    if rel not in source.files:
        return None, None
    size = source.files.get(rel) or 0
    unknown = {"saved_world_size": 0, "world_size": 0}
    over = json_record_over_budget(size)
    if over is not None:
        return unknown, over
    try:
        record = json.loads(source.storage.read_all(rel))
    except RecursionError:  # `[[[[...`: deeper than the parser goes; no record ckpt wrote
        return unknown, "is nested too deep to be the record `ckpt reshard` writes"
    except (ValueError, OSError) as exc:
        return unknown, f"cannot be read as JSON ({str(exc)[:200]})"
    if not isinstance(record, dict):
        return (
            unknown,
            f"holds a JSON {type(record).__name__}, not the object `ckpt reshard` writes",
        )
    out = {k: record.get(k) for k in unknown}
    for key, value in out.items():
        if value is None:
            return unknown, f"does not say {key}"
        if type(value) is not int or not 0 < value <= MAX_FILE_NUMBER:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
            return unknown, (
                f"gives {key} {shown}, not a number of ranks (1 to {MAX_FILE_NUMBER:,})"
            )
    return {k: int(v) for k, v in out.items() if isinstance(v, int)}, None


def finish(
    checkpoint: Checkpoint, state: TrainingState, folder: Folder | None = None
) -> OpenedSource:
    """The end of a layout's `open`: `state`'s verdict given, with what `folder` (the one the
    layout read its components through) found unreadable or lost; a rank's lost part makes the
    save not resumable, a rank's lost RNG states not exactly."""
    if folder is not None:
        state.unreadable = dict(folder.unreadable)
        record = folder.rel(RESHARD_RECORD)
        state.resharded, state.reshard_record_problem = read_reshard_record(folder.source, record)
        if state.resharded is not None:
            state.reshard_record = record
        # a rank's RNG file the save before held (`ranks_lost_since`) was lost, not perhaps on
        # another node's disk: one problem for the file, the certain one
        certain = {p.file for p in folder.problems if p.code == "missing_rank_rng"}
        folder.problems = [
            p for p in folder.problems if not (p.code == "rank_rng_elsewhere" and p.file in certain)
        ]
    verdict(state)
    lost = [p.file for p in folder.problems if p.code == "missing_rank_file"] if folder else []
    if lost:
        # no resume without every rank's part: a missing shard, not an inexact resume
        state.missing.append(f"every rank's file ({len(lost)} missing)")
        state.resumable = state.exact = False
    rng = [p.file for p in folder.problems if p.code in RANK_RNG_CODES] if folder else []
    if rng:
        # the loaders go on without a rank's RNG states: resumable, never exactly
        state.missing_exact.append(f"every rank's RNG states ({len(rng)} missing)")
        state.exact = False
    if folder is None:
        return OpenedSource(checkpoint=checkpoint, training=state)
    return OpenedSource(
        checkpoint=checkpoint,
        training=state,
        problems=list(folder.problems),
        parts=dict(folder.parts),
        unreadable=dict(folder.unreadable_parts),
        listed_files=dict(folder.listed_files),
        listed_parts=dict(folder.listed_parts),
    )
