"""A plain training loop's step folder: one `torch.save` file per component.

A loop of its own saves each state into the step's folder with `torch.save`:
`model.pt`, `optimizer.pt`, `scheduler.pt`, `rng.pt` (and often `scaler.pt`, `dataloader.pt`,
`ema.pt`...) in `ckpt/step_100/`. The names are the script's, not a framework's; those the
component names of `ckpt_cli.sources.layouts` are recognised by their stems (`FILE_STEMS`).
Two of them (`optimizer.pt`, `scheduler.pt`) are also the Hugging Face Trainer's: a folder is
this layout's, not the Trainer's, when it holds a component file the Trainer never writes
(`model.pt`, `rng.pt`...) and none of the Trainer's own (`trainer_state.json`,
`rng_state*.pth`), and some training state beside the weights (a lone `model.pt` is a
model). Each file is opened as a component (weights_only; nothing unpickled otherwise); a file
of another stem (`ema.pt`) is a component named by its stem. Only the weights are demanded
(`missing_weights`): the script decides what else a save holds, so the rest of completeness
is the components' own (each file whole, the resumable verdict over what is there).
"""

from __future__ import annotations

import re

from ...formats.base import Source
from ...models import Problem
from .base import Layout, OpenedSource
from .composite import Folder, component_files, component_prefixes
from .training import finish

#: component -> the file stems a plain loop saves it under (`<stem>.pt` / `<stem>.pth`)
FILE_STEMS: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_state_dict", "state_dict", "net", "network", "module", "weights"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched"),
    "rng": ("rng", "rng_state", "rng_states", "random_state", "random_states"),
    "dataloader": ("dataloader", "data_loader", "sampler", "dataloader_state", "data_state"),
    "scaler": ("scaler", "grad_scaler"),
}
#: the keys a file of the loop's own (`meta.pt`) records its step under
_STEP_KEYS = ("step", "global_step", "iteration", "train_step")
#: the files of these stems the Hugging Face Trainer writes itself: alone they say nothing
_TRAINER_FILES = frozenset(("optimizer.pt", "scheduler.pt", "scaler.pt"))
_SUFFIX = re.compile(r"(?P<stem>[A-Za-z0-9_]+)\.pth?")
#: the Trainer's own files: a folder holding one is a Trainer checkpoint
_TRAINER_ONLY = re.compile(r"trainer_state\.json|rng_state(_\d+)?\.pth")
#: model weights saved by a library beside the torch files (what `Folder.add_model` opens)
_WEIGHT_FILE = re.compile(
    r"(model|pytorch_model)(\.safetensors|\.bin)(\.index\.json)?|adapter_model\.(safetensors|bin)"
)
#: accelerate's `save_state` RNG files: a folder holding them is accelerate's
_ACCELERATE_RNG = re.compile(r"random_states_\d+\.pkl")


def _component_of(name: str) -> str | None:
    """The component a top-level `<stem>.pt` file of a plain loop holds, None for another."""
    match = _SUFFIX.fullmatch(name)
    if match is None:
        return None
    stem = match.group("stem")
    return next((comp for comp, stems in FILE_STEMS.items() if stem in stems), None)


class TorchFiles(Layout):
    """A step folder of separate `torch.save` files, one per component (see the module
    docstring); a run names such folders `NAME_N/` (`step_100/`), as plain saves."""

    name = "torch-files"
    #: `torch.load("model.pt")` reads one file: weights cut into size shards would not load
    loads_size_shards = False

    def recognise(self, source: Source) -> bool:
        folder = Folder(source)
        if any(_TRAINER_ONLY.fullmatch(n) or _ACCELERATE_RNG.fullmatch(n) for n in folder.names):
            return False
        comps = {n: _component_of(n) for n in folder.names}
        # a file the Trainer never writes, and some training state beside the weights (a
        # folder of a lone `model.pt` is a model, not a training save)
        foreign = any(c is not None and n not in _TRAINER_FILES for n, c in comps.items())
        return foreign and any(c not in (None, "model") for c in comps.values())

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """The model weights: a save of the training state holds them (the loop's own names
        decide the rest); no file of them here is a save that lost them. Names only."""
        if any(_component_of(n) == "model" or _WEIGHT_FILE.fullmatch(n) for n in folder.names):
            return []
        held = ", ".join(sorted(n for n in folder.names if _SUFFIX.fullmatch(n)))
        return [
            Problem(
                code="missing_weights",
                message=f"{source.location.raw}: no model weights (model.pt, model.pth, "
                f"model.safetensors...) beside {held}: deleted or lost since the save?",
                file=source.location.raw,
                fix="Use another checkpoint of the run (`ckpt latest` names the newest whole one).",
            )
        ]

    def open(self, source: Source) -> OpenedSource | None:
        from .training import analyse, as_int, value_of

        folder = Folder(source)
        for name in sorted(folder.names):
            match = _SUFFIX.fullmatch(name)
            if match is None:
                continue
            comp = _component_of(name) or match.group("stem")
            if comp in folder.components or comp in folder.unreadable_parts:
                continue  # `model.pt` beside `model.pth`: the first, the other listed as a file
            folder.add(comp, name, "torch")
        if "model" not in folder.components and "model" not in folder.unreadable_parts:
            folder.add_model()  # weights saved with safetensors beside the torch files
        folder.problems.extend(self.missing(source, folder))
        checkpoint = folder.composite(self.name)
        state = analyse(checkpoint, self.name, component_prefixes(checkpoint))
        state.components = component_files(folder)
        # a plain loop records its step where it likes: a file of its own (`meta.pt`,
        # `train_state.pt` holding `step`, `epoch`), else the folder's number (`step_100`)
        others = [c for c in folder.components if c not in FILE_STEMS]
        for comp in others:
            for key in _STEP_KEYS:
                step = as_int(value_of(checkpoint, f"{comp}.{key}"))
                if state.step is None and step is not None:
                    state.step = step
            epoch = value_of(checkpoint, f"{comp}.epoch")
            numeric = isinstance(epoch, (int, float)) and not isinstance(epoch, bool)
            if state.epoch is None and numeric:
                state.epoch = float(epoch)
        folder_name = source.location.raw.rstrip("/").rsplit("/", 1)[-1]
        number = re.search(r"(\d+)$", folder_name)
        if state.step is None and number:
            state.step = int(number.group(1))
        return finish(checkpoint, state, folder)
