"""torchtitan DCP checkpoints: the model's keys at the top level (0.3) or under `model.`.

torchtitan 0.3.0's `CheckpointManager.save` writes one DCP per `step-N/` folder (under the dump
folder's `checkpoint/`): the model's FQNs flattened to the top level beside `optimizer`
(FQN-keyed, flattened), `lr_scheduler` (`last_epoch`), `dataloader` (`dp_rank_N` pickled bytes
and `world_size`) and `train_state` (`step`, `ntokens_seen`). Older releases kept the model
under `model.`. The fused attention projection is a `wqkv` parameter (which the optimizer's
state is keyed by) saved split as `wq` / `wk` / `wv` by a state-dict hook.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...models import Entry, Manifest
from .training import top_keys

#: the top-level states torchtitan's CheckpointManager saves beside the model's own keys
_TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


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
