"""torchtitan DCP checkpoints: the model's keys at the top level (0.3) or under `model.`."""

from __future__ import annotations

from ..models import Entry, Manifest
from .base import OpenedSource
from .training import top_keys

#: the top-level states torchtitan's CheckpointManager saves beside the model's own keys
_TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def titan_model_keys(manifest: Manifest) -> list[str]:
    """The top-level keys of a torchtitan DCP that are the model's (`tok_embeddings`, `layers`,
    `norm`, `output`...): every key but the CheckpointManager's other states."""
    keys = top_keys(manifest)
    return [k for k in keys if k not in _TITAN_STATES]


def model_entries(manifest: Manifest, keys: list[str]) -> list[Entry]:
    """The entries under the top-level `keys`."""
    wanted = set(keys)

    def top(entry: Entry) -> str:
        path = getattr(entry, "key_path", None)
        return str(path[0][1]) if path else entry.name.split(".", 1)[0]

    return [e for e in manifest.entries if top(e) in wanted]


def select_view(opened: OpenedSource, select: str | None) -> Manifest | None:
    """For `--select model` on a layout whose model keys sit at the top level (torchtitan
    0.3), the manifest of just those entries (names unchanged); None otherwise."""
    state = opened.training
    if not select or select.rstrip(".") != "model" or state is None:
        return None
    if state.layout != "torchtitan" or state.prefixes.get("model") != "":
        return None
    manifest = opened.checkpoint.manifest
    return manifest.model_copy(
        update={"entries": model_entries(manifest, titan_model_keys(manifest))}
    )
