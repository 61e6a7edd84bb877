"""The training layouts: what one checkpoint of each training framework is, and their registry.

`ckpt_cli.sources.opening.open_source` (the door inspect, verify, convert and diff call) asks
this package which layout a SRC is (`open_folder_layout`, `training_layout_of`,
`SINGLE_LAYOUTS`); the run judge (`ckpt_cli.sources.runs`) asks it the layouts' step names and
completeness rules. Nothing here knows run folders.

Layouts recognised (from file names, then from the keys of the loaded objects):

| layout | what it is |
|---|---|
| `hf-trainer` | Hugging Face Trainer `checkpoint-N/`: model weights, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `trainer_state.json`, `training_args.bin` |
| `accelerate` | `Accelerator.save_state` folders: `model.safetensors`, `optimizer.bin`, `scheduler.bin`, `sampler.bin`, `random_states_N.pkl`, `custom_checkpoint_N.pkl`; FSDP's `pytorch_model_fsdp_N/` + `optimizer_N/` (DCP), `pytorch_model_fsdp.bin`, or per-rank `pytorch_model_fsdp[_N]_rankR.bin` + `optimizer_N_rankR.bin` |
| `torch-files` | a training loop's step folder of separate torch.save files: `model.pt`, `optimizer.pt`, `scheduler.pt`, `rng.pt`... (`torch_files`) |
| `deepspeed` | `global_stepN/` (`mp_rank_00_model_states.pt`, `*_optim_states.pt`), or its parent with `latest` |
| `megatron-legacy` | one rank folder of a legacy Megatron-LM save (`iter_N/mp_rank_TT/`): `model_optim_rng.pt`, and `distrib_optim.pt` with the distributed optimizer (`megatron_rank`) |
| `torchtitan` | DCP folders with `optimizer.` / `lr_scheduler.` / `dataloader.` / `train_state.` keys beside the model's top-level keys (0.3), or `model.` (older) |
| `diffusers-pipeline` / `sentence-transformers` | `model_index.json` / `modules.json` folders: one composite of their components (`ckpt_cli.sources.layouts.model_folders`) |
| `lightning` | a Lightning `.ckpt`: `state_dict`, `optimizer_states`, `lr_schedulers`, `epoch`, `global_step`, `loops` |
| `torch-dict` | a torch.save dict with model / optimizer / scheduler / step / rng keys |

Composite naming: a folder of several files opens as one `CompositeCheckpoint` whose entry
names are `<component>.<name inside the component>`: `model.lm_head.weight`,
`optimizer.state.0.exp_avg`, `scheduler.last_epoch`, `rng.python`, `trainer_state.global_step`.
This is the very naming a flattened `torch.save({"model": ..., "optimizer": ...})` dict and a
torchtitan DCP checkpoint already have, so `diff` lines a Trainer folder up with a plain torch
dict, and `convert --select model` extracts the weights of any of them. `TrainingState.prefixes`
gives each component's prefix (`state_dict.` for the weights inside a Lightning file).

Package layout: `base` declares the `Layout` protocol (cheap `recognise`, `open`, step naming,
completeness) and `OpenedSource`; one module per folder layout (`trainer`, `accelerate`,
`deepspeed` with its ZeRO rebuild in `zero`, `torch_files`, `multi_folder`) registered in
`FOLDER_LAYOUTS`;
the single-checkpoint layouts (`SingleLayout`: `Lightning`, `TorchTitan`, `TorchDict`, asked
in that order from `SINGLE_LAYOUTS`) tell themselves apart by the keys of the one opened
checkpoint; `composite` builds the one-checkpoint view of a folder (its typed details:
`details.CompositeDetails`); `training` holds the optimizer / scheduler / RNG / data-loader
analysis and the resumable / exact verdict; `ranks` what a multi-process save wrote and
which rank's files it lost; `megatron_legacy` which rank folders a legacy Megatron-LM save
(`iter_N/mp_rank_*/`) must hold, `megatron_rank` one of those folders named alone,
`megatron_save` the whole save (opened as one, verified, refused to reshard); `model_folders` the PEFT / diffusers / sentence-transformers / GGUF
descriptions.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...formats.base import Source
from ...formats.names import DCP_METADATA
from .base import REQUIRED, Layout, OpenedSource, SingleLayout

if TYPE_CHECKING:
    from .composite import CompositeCheckpoint, ObjectsCheckpoint, subfolder_source
    from .details import CompositeDetails
    from .lightning import Lightning
    from .torch_dict import SINGLE_LAYOUTS, TorchDict, TorchTitan, analyse_single
    from .training import component_problems, training_checks

#: the names this package exports from its layout modules, imported on first use (a plain
#: model file or folder imports none of the training layouts: `ckpt inspect` start-up)
_LAZY = {
    "CompositeCheckpoint": "composite",
    "ObjectsCheckpoint": "composite",
    "subfolder_source": "composite",
    "CompositeDetails": "details",
    "Lightning": "lightning",
    "SINGLE_LAYOUTS": "torch_dict",
    "TorchDict": "torch_dict",
    "TorchTitan": "torch_dict",
    "analyse_single": "torch_dict",
    "component_problems": "training",
    "training_checks": "training",
}

__all__ = [
    "FOLDER_LAYOUTS",
    "FOLDER_REGISTRY",
    "REQUIRED",
    "SINGLE_LAYOUTS",
    "CompositeCheckpoint",
    "CompositeDetails",
    "Layout",
    "Lightning",
    "ObjectsCheckpoint",
    "OpenedSource",
    "SingleLayout",
    "TorchDict",
    "TorchTitan",
    "analyse_single",
    "component_problems",
    "folder_layout",
    "folder_layout_named",
    "folder_layout_of",
    "layout_named",
    "open_folder_layout",
    "subfolder_source",
    "training_checks",
    "training_layout_of",
]

#: the folder layouts `open_source` tries, in order: DeepSpeed first (its `latest` parent holds
#: other tools' files), the multi-folder model layouts last (they hold no training state).
#: Each is named by module and class with a name-only pre-check: a regex that some top-level
#: file name of the folder must fully match for the layout's own `recognise` to say yes (a
#: superset of it), so a folder of plain model files imports no layout module at all.
FOLDER_REGISTRY: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    ("deepspeed", "DeepSpeed", re.compile(r"latest|.*mp_rank_\d+_model_states\.pt")),
    # a legacy Megatron-LM rank folder (`iter_N/mp_rank_00/`): its own file names
    ("megatron_rank", "MegatronRank", re.compile(r"model_optim_rng\.pt")),
    # before the Trainer: its `optimizer.pt` / `scheduler.pt` are a plain loop's names too
    ("torch_files", "TorchFiles", re.compile(r"[A-Za-z0-9_]+\.pth?")),
    (
        "trainer",
        "Trainer",
        re.compile(
            r"trainer_state\.json|optimizer\.pt|scheduler\.pt|training_args\.bin"
            r"|rng_state(_\d+)?\.pth"
        ),
    ),
    (
        "accelerate",
        "Accelerate",
        re.compile(
            r"random_states_\d+\.pkl|optimizer(_\d+)?\.bin|scheduler\.bin"
            r"|pytorch_model_fsdp(_\d+)?_rank\d+\.bin|optimizer_\d+_rank\d+\.bin"
            # a save slimmed to the model its save hook wrote (the diffusers scripts' `unet/`)
            r"|ckpt-slim\.json"
        ),
    ),
    (
        "multi_folder",
        "MultiFolder",
        re.compile(r"model_index\.json|modules\.json|adapter_config\.json"),
    ),
)
_folder_layouts: dict[str, Layout] = {}


def folder_layout(module: str, cls_name: str) -> Layout:
    """The one instance of a registered folder layout (its module imported on first use)."""
    layout = _folder_layouts.get(cls_name)
    if layout is None:
        cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls_name)
        layout = _folder_layouts[cls_name] = cls()
    return layout


def folder_layout_named(name: str) -> Layout | None:
    """The registered folder layout whose token is `name` (`hf-trainer`), if any."""
    for module, cls_name, _ in FOLDER_REGISTRY:
        layout = folder_layout(module, cls_name)
        if layout.name == name:
            return layout
    return None


def layout_named(name: str) -> Layout | None:
    """The layout whose token is `name`, a folder layout's (`hf-trainer`) or a single
    checkpoint's (`torchtitan`): what a run's judge asks of a save its name says is one."""
    from .torch_dict import SINGLE_LAYOUTS

    found = folder_layout_named(name)
    return found or next((lay for lay in SINGLE_LAYOUTS if lay.name == name), None)


def __getattr__(name: str) -> Any:
    # `FOLDER_LAYOUTS` (every folder layout, instantiated) and the layout modules' exports
    # stay importable from here as before, without importing them at start-up
    if name == "FOLDER_LAYOUTS":
        return tuple(folder_layout(m, c) for m, c, _ in FOLDER_REGISTRY)
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    FOLDER_LAYOUTS: tuple[Layout, ...]


# --------------------------------------------------------------------------- entry point


def _recognised(source: Source) -> Iterator[Layout]:
    """The folder layouts whose file names `source` has, in registry order (DCP folders and
    single files have none)."""
    if source.target is not None:
        return
    top = source.top_level()
    if DCP_METADATA in set(top):
        return
    for module, cls_name, names in FOLDER_REGISTRY:
        if not any(names.fullmatch(n) for n in top):
            continue
        layout = folder_layout(module, cls_name)
        if layout.recognise(source):
            yield layout


def folder_layout_of(source: Source) -> Layout | None:
    """The folder layout `source`'s file names say it is (nothing is read): what a run's judge
    asks of a save named by the script (`step_100/`), whose name says no framework."""
    return next(_recognised(source), None)


def training_layout_of(source: Source) -> tuple[Layout, set[str]] | None:
    """The training layout `source`'s file names say it is (nothing is read), with the
    top-level files its registry names as the framework's own (`trainer_state.json`,
    `optimizer.pt`, `random_states_0.pkl`...); None for a plain checkpoint, a DCP folder or a
    model folder (a diffusers pipeline holds no training state)."""
    if source.target is not None:
        return None
    top = source.top_level()
    if DCP_METADATA in set(top):
        return None
    for module, cls_name, names in FOLDER_REGISTRY:
        own = {n for n in top if names.fullmatch(n)}
        if not own:
            continue
        layout = folder_layout(module, cls_name)
        if layout.recognise(source):
            return (layout, own) if layout.holds_training_state else None
    return None


def open_folder_layout(source: Source) -> OpenedSource | None:
    """The training folder layout of a local, object-store or Hub folder, if it is one (DCP
    folders excepted): a Trainer pushes `last-checkpoint/` with its optimizer state to the Hub."""
    for layout in _recognised(source):
        opened = layout.open(source)
        if opened is not None:
            return opened
    return None
