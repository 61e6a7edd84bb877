"""Lightning `.ckpt` files: `state_dict`, `optimizer_states`, `lr_schedulers`, `loops`."""

from __future__ import annotations

import re

from ...formats.base import Checkpoint
from ...formats.names import LIGHTNING_SUFFIX
from ...models import TrainingState
from .base import SingleLayout
from .training import analyse, as_int, rng_streams, value_of, verdict

#: `NAME=VALUE` pairs in a Lightning file name (`epoch=3-step=400-val_loss=0.25.ckpt`): a
#: value is any number `float()` reads, exponents of either sign included (`{val_loss:.2e}`
#: writes `1.50e+01`), and `inf` / `nan`
NAME_PAIR = re.compile(
    r"([A-Za-z_][\w/.]*?)="
    r"([-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|(?i:inf(?:inity)?|nan)))"
)


class Lightning(SingleLayout):
    """A Lightning `.ckpt`: `state_dict`, `optimizer_states`, `lr_schedulers`, `epoch`,
    `global_step`, `loops`; a run names its saves `epoch=N-step=M[-metric=V].ckpt`."""

    name = "lightning"
    suffixes = (".ckpt", ".pt", ".pth")
    dcp_folder = False

    def matches(self, checkpoint: Checkpoint, keys: dict[str, str]) -> bool:
        return is_lightning(keys)

    def training_state(self, checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState:
        return lightning_state(checkpoint, keys)

    def step_of(self, folder_name: str) -> int | None:
        """The `step=N` of a Lightning file name (None without one)."""
        text = name_values(folder_name).get("step")
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    @staticmethod
    def is_step_file(name: str) -> bool:
        """Whether a file name is one of a run's Lightning saves (`step=` / `epoch=` in it)."""
        return name.endswith(LIGHTNING_SUFFIX) and ("step=" in name or "epoch=" in name)


def name_values(name: str) -> dict[str, str]:
    """The `NAME=VALUE` pairs of a Lightning file name, as written."""
    return dict(NAME_PAIR.findall(name.removesuffix(LIGHTNING_SUFFIX)))


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
