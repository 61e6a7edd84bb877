"""Single torch.save / DCP training dicts (model / optimizer / scheduler / step / rng keys),
and `SINGLE_LAYOUTS`, the registry of the layouts inside one checkpoint."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ...formats import find_format
from ...formats.base import Checkpoint, Source
from ...formats.names import SLIM_RECORD
from ...models import Manifest, Problem, TrainingState
from . import ckpt_record
from .base import SingleLayout, open_as_format, top_keys
from .lightning import Lightning
from .torchtitan import missing_states, model_entries, model_only_note, titan_model_keys
from .training import (
    all_models,
    analyse,
    as_int,
    per_rank_models,
    rank_components,
    value_of,
    verdict,
)

if TYPE_CHECKING:
    from .composite import Folder

# --------------------------------------------------------------------------- single files


_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module", "net", "network")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state")
#: `opt_param_scheduler`: Megatron-LM's (megatron-core's `OptimizerParamScheduler`), in `common.pt`
_SCHEDULER_KEYS = (
    "scheduler",
    "lr_scheduler",
    "scheduler_state_dict",
    "sched",
    "lr_schedule",
    "opt_param_scheduler",
)
_STEP_KEYS = ("step", "global_step", "iteration", "iter", "steps", "train_step")
_RNG_KEYS = ("rng", "rng_state", "rng_states", "random_state", "random_states", "rng_state_dict")
_LOADER_KEYS = (
    "dataloader",
    "data_loader",
    "sampler",
    "dataloader_state",
    "train_loader",
    "data",
    "data_state",
)


def _folder_format(manifest: Manifest) -> bool:
    """Whether the checkpoint is of a folder format (DCP): torchtitan saves one per step."""
    saved_as = find_format(manifest.format)
    return saved_as is not None and saved_as.folder


def _first(keys: dict[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in keys:
            return name
    return None


class TorchTitan(SingleLayout):
    """A torchtitan DCP folder: `train_state` / `optimizer` / `lr_scheduler` / `dataloader`
    beside the model's keys; its run names the saves `step-N/` (under `checkpoint/`).

    ckpt's own `Checkpointer` names its saves `step-N/` too, and a loop may save an entry it
    calls `train_state`: a save holding the Checkpointer's record (`ckpt_record.RECORD_KEY`) is
    the Checkpointer's, never judged by torchtitan's rule of what a save must hold."""

    name = "torchtitan"
    step_folder = re.compile(r"step-(\d+)")
    suffixes = ()
    #: `ParallelAwareDataloader.load_state_dict` refuses a state saved at another dp degree
    rank_state_world_size = ("dataloader.world_size",)

    def matches(self, checkpoint: Checkpoint, keys: dict[str, str]) -> bool:
        return (
            _folder_format(checkpoint.manifest)
            and "train_state" in keys
            and ckpt_record.RECORD_KEY not in keys
        )

    def training_state(self, checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState | None:
        return _dict_state(checkpoint, keys)

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """The states a save holding torchtitan's `train_state` lacks by torchtitan's own rule
        (`torchtitan.missing_states`): its `.metadata` read, no tensor data."""

        if not self.recognise(source) or folder.has(SLIM_RECORD):
            return []  # slimmed by `ckpt prune --slim-older-than`: weights-only on purpose
        with open_as_format(source) as checkpoint:
            keys = top_keys(checkpoint.manifest)
        if ckpt_record.RECORD_KEY in keys:  # a Checkpointer save (see the class)
            return []
        return missing_states(keys, source.location.raw)

    def unknown_state(self, source: Source, folder: Folder) -> str | None:
        """A model-only save past step 0 (`torchtitan.model_only_note`): a weights export, which
        torchtitan's own `load` cannot resume from; its `.metadata` read, no tensor data."""

        if not self.recognise(source) or folder.has(SLIM_RECORD):
            return None
        # step-0 is the seed checkpoint, which `load` reads model-only
        if not self.step_of(source.location.raw.rstrip("/").rsplit("/", 1)[-1]):
            return None
        with open_as_format(source) as checkpoint:
            keys = top_keys(checkpoint.manifest)
        if ckpt_record.RECORD_KEY in keys:  # a Checkpointer save (see the class)
            return None
        return model_only_note(keys)


class TorchDict(SingleLayout):
    """A torch.save (or DCP) dict with model / optimizer / scheduler / step / rng keys under
    any of their usual names (`model_state_dict`, `optim`, `global_step`...); the last layout
    asked, so it matches every checkpoint and says None for plain weights."""

    name = "torch-dict"

    def matches(self, checkpoint: Checkpoint, keys: dict[str, str]) -> bool:
        return True

    def training_state(self, checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState | None:
        return _dict_state(checkpoint, keys)


#: the layouts inside one checkpoint, asked in order by `analyse_single` (the first that
#: `matches` says what the checkpoint is)
SINGLE_LAYOUTS: tuple[SingleLayout, ...] = (Lightning(), TorchTitan(), TorchDict())


def analyse_single(checkpoint: Checkpoint) -> TrainingState | None:
    """The training state of one torch.save file or DCP folder, None for plain weights."""
    keys = top_keys(checkpoint.manifest)
    for layout in SINGLE_LAYOUTS:
        if layout.matches(checkpoint, keys):
            return layout.training_state(checkpoint, keys)
    return None


#: the top-level keys of `optimizer.state_dict()`: a file of nothing else is an optimizer's
#: state saved alone (the Trainer's `optimizer.pt`, accelerate's `optimizer.bin`)
_OPTIMIZER_STATE_KEYS = {"state", "param_groups"}


def _optimizer_alone(checkpoint: Checkpoint, layout: str) -> TrainingState:
    """The training state of an optimizer's state dict saved on its own: the optimizer, and
    no weights (its moments are state, not the model's parameters)."""
    state = analyse(checkpoint, layout, {"optimizer": ""})
    state.components = {"optimizer": "top-level keys (state, param_groups)"}
    verdict(state)
    return state


def _dict_state(checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState | None:
    """What a training dict holds, by the usual key names (torchtitan's layout included)."""
    manifest = checkpoint.manifest
    model = _first(keys, _MODEL_KEYS)
    optimizer = _first(keys, _OPTIMIZER_KEYS)
    scheduler = _first(keys, _SCHEDULER_KEYS)
    step = _first(keys, _STEP_KEYS)
    folder = _folder_format(manifest)
    # torchtitan's save (a DCP folder), or one converted whole to a torch.save file: its
    # `train_state` beside the model's FQNs, the optimizer, the scheduler...
    is_titan = "train_state" in keys
    if keys.keys() == _OPTIMIZER_STATE_KEYS:
        return _optimizer_alone(checkpoint, "dcp" if folder else "torch-dict")
    if not (optimizer or scheduler or step or is_titan):
        return None
    # a training folder converted whole keeps its per-rank components (`rng_0`, `rng_1`)
    rng_ranks = rank_components(manifest, "rng")
    prefixes: dict[str, str] = {}
    titan_model = titan_model_keys(manifest) if is_titan and not model else []
    if not model and not titan_model:
        # Megatron-Core (and any save of a model's own FQNs beside its training state): the
        # top-level keys whose tensors a model family recognises (`decoder.`, `embedding.`)
        titan_model = _named_model_keys(manifest, keys)
    if model:
        prefixes["model"] = f"{model}."
    elif titan_model:
        # torchtitan >= 0.2 saves the model's FQNs at the top level, beside its other states
        prefixes["model"] = ""
    if optimizer:
        prefixes["optimizer"] = f"{optimizer}."
    if scheduler:
        prefixes["scheduler"] = f"{scheduler}."
    rng = _first(keys, _RNG_KEYS)
    if rng:
        prefixes["rng"] = keys[rng]
    loader = _first(keys, _LOADER_KEYS)
    if loader:
        prefixes["dataloader"] = keys[loader]
    # a DCP training dict is named after its format
    layout = "torchtitan" if is_titan else manifest.format if folder else "torch-dict"
    state = analyse(checkpoint, layout, prefixes)
    if model == "model" and optimizer == "optimizer":
        all_models(checkpoint, state)  # a whole multi-model accelerate folder, converted
    per_rank_models(checkpoint, state)  # a whole per-rank FSDP save (`model_rank0`...), converted
    if titan_model:
        from ...quant import parameter_counter

        tensors = [e for e in model_entries(manifest.entries, titan_model) if e.kind == "tensor"]
        count = parameter_counter(manifest, checkpoint.storage)
        state.weights = {
            "tensors": len(tensors),
            "parameters": sum(count(e) for e in tensors),
            "bytes": sum(e.nbytes for e in tensors),
        }
    if rng and not state.rng:
        # a stream under an unrecognised key name still counts as RNG state
        state.rng = [rng]
    if rng_ranks and not state.rng:
        state.rng = [rng_ranks[min(rng_ranks)]]
    if step:
        state.step = as_int(value_of(checkpoint, step))
    for comp in ([rng] if rng else []) + [rng_ranks[r] for r in sorted(rng_ranks)]:
        # accelerate's `random_states_N.pkl` (a folder converted whole): its `step` counts
        # gradient-accumulation micro-steps, restored by `load_state`; not the training step
        if as_int(value_of(checkpoint, f"{keys[comp].rstrip('.')}.step")) is not None:
            state.counter = f"accelerate's gradient-accumulation step ({comp})"
            break
    if is_titan:
        state.step = as_int(value_of(checkpoint, "train_state.step"))
    if "trainer_state" in keys and state.step is None:
        # a Trainer folder converted to one torch / DCP checkpoint: its trainer_state came along
        state.step = as_int(value_of(checkpoint, "trainer_state.global_step"))
        if state.step is not None and state.dataloader is None:
            # the Trainer replays its data order from the seed and skips `global_step` batches
            state.dataloader = {"kind": "replayed", "skips_batches": state.step}
        epoch = value_of(checkpoint, "trainer_state.epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
            state.epoch = float(epoch)
    epoch = value_of(checkpoint, "epoch") if "epoch" in keys else None
    if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
        state.epoch = float(epoch)
    if state.step is None and ckpt_record.RECORD_KEY in keys:
        # ckpt's Checkpointer records the step it saved (the state may hold no counter)
        state.step = as_int(value_of(checkpoint, ckpt_record.STEP))
    state.components = {c: p.rstrip(".") for c, p in prefixes.items()}
    state.components.update({comp: comp for comp in rng_ranks.values()})
    if titan_model:
        state.components["model"] = f"top-level keys ({', '.join(titan_model)})"
    verdict(state)
    return state


#: top-level keys that are training state, never a model's own FQNs
_STATE_KEYS = frozenset(
    (*_OPTIMIZER_KEYS, *_SCHEDULER_KEYS, *_STEP_KEYS, *_RNG_KEYS, *_LOADER_KEYS, "train_state")
)


def _named_model_keys(manifest: Manifest, keys: dict[str, str]) -> list[str]:
    """The top-level keys holding a model's weights under its own names (Megatron-Core's
    `decoder`, `embedding`, `output_layer`), when a model family (`architectures.recognise`,
    what inspect's architecture line says) recognises their tensors; else none."""
    from ...architectures import recognise

    candidates = [k for k in keys if k not in _STATE_KEYS]
    wanted = set(candidates)
    tensors = [e for e in manifest.entries if e.kind == "tensor" and e.top_key() in wanted]
    if not tensors or recognise([e.name for e in tensors]) is None:
        return []
    held = {e.top_key() for e in tensors}
    return [k for k in candidates if k in held]
