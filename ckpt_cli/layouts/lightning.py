"""Lightning `.ckpt` files: `state_dict`, `optimizer_states`, `lr_schedulers`, `loops`."""

from __future__ import annotations

from ..formats.base import Checkpoint
from ..models import TrainingState
from .training import analyse, as_int, rng_streams, value_of, verdict


def is_lightning(keys: dict[str, str]) -> bool:
    """Whether a checkpoint's top-level keys (`top_keys`) are a Lightning `.ckpt`'s."""
    return "state_dict" in keys and (
        "pytorch-lightning_version" in keys
        or "optimizer_states" in keys
        or ("loops" in keys and "global_step" in keys)
    )


def lightning_state(checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState:
    """The training state of a Lightning `.ckpt` (its weights under `state_dict.`)."""
    names = checkpoint.manifest.by_name
    prefixes = {"model": "state_dict."}
    if any(n.startswith("optimizer_states.0.") for n in names):
        prefixes["optimizer"] = "optimizer_states.0."
    if any(n.startswith("lr_schedulers.0.") for n in names):
        prefixes["scheduler"] = "lr_schedulers.0."
    if "loops" in keys:
        prefixes["dataloader"] = "loops."
    state = analyse(checkpoint, "lightning", prefixes)
    state.step = as_int(value_of(checkpoint, "global_step"))
    epoch = value_of(checkpoint, "epoch")
    if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
        state.epoch = float(epoch)
    if state.dataloader is not None:
        # Lightning restores the position in the epoch from its loop progress counters
        state.dataloader = {"kind": "loop progress", "source": "loops"}
    for key in ("rng", "rng_states", "random_state"):
        if key in keys:
            state.rng = rng_streams(checkpoint.manifest, [keys[key]]) or [key]
    state.components = {c: p.rstrip(".") for c, p in prefixes.items()}
    verdict(state)
    return state
