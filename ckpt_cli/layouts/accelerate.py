"""`Accelerator.save_state` folders."""

from __future__ import annotations

import re

from ..formats.base import Source
from .base import Layout, OpenedSource
from .composite import Folder, component_files, component_prefixes, finish
from .training import analyse, value_of

_RNG = r"random_states_\d+\.pkl"
_OPTIM = r"optimizer(_\d+)?\.bin"


class Accelerate(Layout):
    """`Accelerator.save_state` folders: `model.safetensors`, `optimizer.bin`, `scheduler.bin`,
    `sampler.bin`, `random_states_N.pkl`, `custom_checkpoint_N.pkl`."""

    name = "accelerate"
    step_folder = re.compile(r"checkpoint_(\d+)")
    #: `save_accelerator_state`: `random_states_{process_index}.pkl` at every world size
    rank_files = re.compile(r"random_states_(\d+)\.pkl")

    def rank_file_name(self, rank: int, world_size: int) -> str:
        return f"random_states_{rank}.pkl"

    def recognise(self, source: Source) -> bool:
        folder = Folder(source)
        return bool(folder.matching(_RNG) or folder.matching(_OPTIM) or folder.has("scheduler.bin"))

    def open(self, source: Source) -> OpenedSource | None:
        folder = Folder(source)
        rng = folder.matching(_RNG)
        optim = folder.matching(_OPTIM)
        folder.add_model()
        for comp, files in (
            ("optimizer", optim),
            ("scheduler", folder.matching(r"scheduler(_\d+)?\.bin")),
            ("sampler", folder.matching(r"sampler(_\d+)?\.bin")),
            ("dataloader", folder.matching(r"dl_state_dict(_\d+)?\.bin")),
        ):
            folder.add_many(comp, files, "torch")
        if folder.has("scaler.pt"):
            folder.add("scaler", "scaler.pt", "torch")
        folder.add_many("rng", rng, "torch")
        for name in folder.matching(r"custom_checkpoint_\d+\.pkl"):
            number = re.findall(r"\d+", name)[-1]
            folder.add(f"custom_{number}", name, "torch")
        checkpoint = folder.composite("accelerate")
        state = analyse(checkpoint, "accelerate", component_prefixes(checkpoint))
        state.components = component_files(folder)
        for name in ("rng", *(c for c in folder.components if c.startswith("rng_"))):
            step = value_of(checkpoint, f"{name}.step")
            if isinstance(step, int):
                state.step = step
                break
        if state.step is None:
            match = re.search(r"(\d+)$", source.location.raw.rstrip("/"))
            if match:
                state.step = int(match.group(1))
        return finish(checkpoint, state, folder)
