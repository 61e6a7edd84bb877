"""torchtitan DCP checkpoints: the model's keys at the top level (0.3) or under `model.`.

torchtitan 0.3.0's `CheckpointManager.save` writes one DCP per `step-N/` folder (under the dump
folder's `checkpoint/`): the model's FQNs flattened to the top level beside `optimizer`
(FQN-keyed, flattened), `lr_scheduler` (`last_epoch`), `dataloader` (`dp_rank_N` pickled bytes
and `world_size`) and `train_state` (`step`, `ntokens_seen`). Older releases kept the model
under `model.`. The fused attention projection is a `wqkv` parameter (which the optimizer's
state is keyed by) saved split as `wq` / `wk` / `wv` by a state-dict hook.

What a save must hold is torchtitan's own rule (`CheckpointManager._save` / `_save_last_step`
/ `_states_to_load`): every interval save holds the model with all those states, and its
`load` restores them all; only a model-only save holds the model alone (the seed checkpoint
`step-0`, which `load` reads model-only, and the last step's export with
`last_save_model_only`, the default). A save holding `train_state` (the trainer's own state)
without the optimizer's is neither: `missing_states` says what it lacks.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...models import Entry, Manifest, Problem
from .base import top_keys

#: the top-level states torchtitan's CheckpointManager saves beside the model's own keys
_TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
#: what every save of torchtitan's that holds its `train_state` holds beside the model: the
#: optimizer state, without which a resume restarts the optimizer (the scheduler's, the data
#: loader's are an exact resume's question: `verify --resumable` warns; torchft's manager
#: keeps the data loader's apart, in its replica folders)
_SAVED_WITH_TRAIN_STATE = ("optimizer",)


def fused_shapes(model: dict[str, list[int]]) -> dict[str, list[int]]:
    """The shapes of torchtitan's fused `wqkv` parameters (0.3: the parameter, and so its
    FQN-keyed optimizer state, is `…qkv_linear.wqkv.weight`), rebuilt from the split `wq` / `wk`
    / `wv` weights its state-dict hook saves (rows concatenated), so the optimizer's FQN-keyed
    state lines up with the saved model keys. Empty when the model has no such trio."""
    fused: dict[str, list[int]] = {}
    for name, shape in model.items():
        if not name.endswith((".wq.weight", ".wq.bias")):
            continue
        stem, param = name.rsplit(".wq.", 1)
        parts = [model.get(f"{stem}.w{p}.{param}") for p in "qkv"]
        if all(part is not None and len(part) == len(shape) for part in parts):
            rows = sum(part[0] for part in parts if part)
            fused[f"{stem}.wqkv.{param}"] = [rows, *shape[1:]]
    return fused


def titan_model_keys(manifest: Manifest) -> list[str]:
    """The top-level keys of a torchtitan DCP that are the model's (`tok_embeddings`, `layers`,
    `norm`, `output`...): every key but the CheckpointManager's other states."""
    keys = top_keys(manifest)
    return [k for k in keys if k not in _TITAN_STATES]


def model_entries(entries: Iterable[Entry], keys: list[str]) -> list[Entry]:
    """The entries under the top-level `keys`."""
    wanted = set(keys)
    return [e for e in entries if e.top_key() in wanted]


def missing_states(keys: Iterable[str], where: str) -> list[Problem]:
    """What a torchtitan save with these top-level keys lacks by torchtitan's own rule (see the
    module docstring): a save holding `train_state` is an interval save, which holds the model
    with its optimizer state; a model-only save lacks nothing."""
    held = set(keys)
    if "train_state" not in held:
        return []
    lacks = [s for s in _SAVED_WITH_TRAIN_STATE if s not in held]
    if not held - set(_TITAN_STATES):
        lacks.insert(0, "model")
    if not lacks:
        return []
    saved = ", ".join(s for s in _TITAN_STATES if s in held)
    named = {"model": "the model's weights", "optimizer": "optimizer state"}
    return [
        Problem(
            code="missing_weights" if lack == "model" else "missing_optimizer",
            message=f"{where}: holds torchtitan's {saved} but no {named[lack]}: torchtitan's "
            "CheckpointManager saves the model, optimizer, lr_scheduler, dataloader and "
            "train_state at every step (only a model-only export, `last_save_model_only`, "
            "holds the model alone), and its `load` restores them all, so a resume from this "
            "save fails, or with the state in `checkpoint.exclude_from_loading` restarts it "
            "from scratch.",
            file=where,
            fix="Resume from another save (`ckpt latest RUN_DIR` names the newest complete one).",
        )
        for lack in lacks
    ]


def model_only_note(keys: Iterable[str]) -> str | None:
    """What a save of the model's keys alone at a step past 0 is, by torchtitan's own rule: the
    last step's export (`last_save_model_only`, the default), complete, but no resume point:
    `CheckpointManager.load` of a step past 0 restores every state and fails on it. None for a
    save holding any of the other states."""
    if set(keys) & set(_TITAN_STATES):
        return None
    return (
        "holds the model's weights alone (torchtitan's model-only export at the last step, "
        "`last_save_model_only`): complete weights, but torchtitan's `load` of a step past 0 "
        "restores the optimizer, lr_scheduler, dataloader and train_state too and fails on it; "
        "to continue training, resume from the full save before it (`--checkpoint.load_step`)"
    )
