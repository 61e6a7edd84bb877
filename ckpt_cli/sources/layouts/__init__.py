"""Open any SRC: a plain checkpoint of one format, or a training layout built on top of them.

`open_source` is what inspect, verify, convert and diff call. It returns the checkpoint to read
entries from and, when the source is (or contains) a resumable training checkpoint, the
`TrainingState` describing it.

Layouts recognised (from file names, then from the keys of the loaded objects):

| layout | what it is |
|---|---|
| `hf-trainer` | Hugging Face Trainer `checkpoint-N/`: model weights, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `trainer_state.json`, `training_args.bin` |
| `accelerate` | `Accelerator.save_state` folders: `model.safetensors`, `optimizer.bin`, `scheduler.bin`, `sampler.bin`, `random_states_N.pkl`, `custom_checkpoint_N.pkl`; FSDP's `pytorch_model_fsdp_N/` + `optimizer_N/` (DCP), `pytorch_model_fsdp.bin`, or per-rank `pytorch_model_fsdp[_N]_rankR.bin` + `optimizer_N_rankR.bin` |
| `torch-files` | a training loop's step folder of separate torch.save files: `model.pt`, `optimizer.pt`, `scheduler.pt`, `rng.pt`... (`torch_files`) |
| `deepspeed` | `global_stepN/` (`mp_rank_00_model_states.pt`, `*_optim_states.pt`), or its parent with `latest` |
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
analysis and the resumable / exact verdict; `model_folders` the PEFT / diffusers /
sentence-transformers / GGUF descriptions.

One resolution per operation: an op resolves SRC once (`formats.resolve_source`) and hands the
`Source` to `open_source` / `check_source` / `recognise_layout` (`SourceOpener` opens it at most
once for the checks that need it opened), so a listing or a Hub lookup is never repeated.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...errors import CkptError
from ...findings import problem_from_error
from ...formats import get_format, resolve_source
from ...formats.base import Source
from ...formats.names import DCP_METADATA
from ...models import Problem
from .base import REQUIRED, Layout, OpenedSource, SingleLayout, format_of, open_plain
from .model_folders import LayoutInfo

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
    "SourceOpener",
    "TorchDict",
    "TorchTitan",
    "analyse_single",
    "check_source",
    "component_problems",
    "describe_model_folder",
    "folder_layout",
    "folder_layout_named",
    "folder_layout_of",
    "format_of",
    "layout_named",
    "open_plain",
    "open_source",
    "recognise_layout",
    "single_layout_missing",
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


def _open_layout(source: Source) -> OpenedSource | None:
    """The training folder layout of a local, object-store or Hub folder, if it is one (DCP
    folders excepted): a Trainer pushes `last-checkpoint/` with its optimizer state to the Hub."""
    for layout in _recognised(source):
        opened = layout.open(source)
        if opened is not None:
            return opened
    return None


def open_source(src: str | Source, format: str | None = None) -> OpenedSource:
    """Open `src` (local path or URL), recognising training layouts unless `format` is given.

    `src` may be a `Source` already resolved (`resolve_source`): an operation resolves its
    SRC once and passes it down, so its listing and the Hub's repository lookup happen once.
    With `format`, the source is read as that format alone; a torch.save or DCP training dict
    still gets its training state (it is the same single checkpoint).
    """
    source = src if isinstance(src, Source) else resolve_source(src)
    layout: LayoutInfo | None = None
    if format is None:
        opened = _open_layout(source)
        if opened is not None:
            return opened
        layout = describe_model_folder(source)
    checkpoint = open_plain(source, format)
    saved_as = get_format(checkpoint.manifest.format)
    if saved_as.self_described:
        from .model_folders import gguf_info

        layout = gguf_info(checkpoint.manifest)
    if layout is None:
        from .model_folders import diffusers_lora_info

        layout = diffusers_lora_info(checkpoint.manifest)
    if not saved_as.holds_objects:  # no training dict: plain weights
        return OpenedSource(checkpoint=checkpoint, layout=layout)
    from .torch_dict import analyse_single

    return OpenedSource(checkpoint=checkpoint, training=analyse_single(checkpoint), layout=layout)


class SourceOpener:
    """One operation's SRC, opened at most once, on first use, by whichever check needs it.

    `verify` runs its quantization checks and its `--deep` / `--resumable` reads on the same
    opened source; a failure to open is kept and raised again to every later caller, so each
    one reports it as it did when it opened SRC itself.
    """

    def __init__(self, source: Source, format: str | None = None) -> None:
        self.source = source
        self.format = format
        self._opened: OpenedSource | None = None
        self._error: CkptError | None = None

    def get(self) -> OpenedSource:
        """The opened source (CkptError when it cannot be opened)."""
        if self._error is not None:
            raise self._error
        if self._opened is None:
            try:
                self._opened = open_source(self.source, self.format)
            except CkptError as error:
                self._error = error
                raise
        return self._opened

    def close(self) -> None:
        """Close what `get` opened (nothing when it was never asked)."""
        if self._opened is not None:
            self._opened.checkpoint.close()


def describe_model_folder(source: Source) -> LayoutInfo | None:
    """The library layout of a local or remote model folder (PEFT...), from its JSON files."""
    from .model_folders import peft_info

    if source.target is not None:
        return None
    return peft_info(source)


# --------------------------------------------------------------------------- checks


def check_source(
    src: str | Source, format: str | None = None, opened: OpenedSource | None = None
) -> list[Problem]:
    """Structural problems of any SRC, training folders included (what plain `verify` runs).

    A training folder gets its format's `check` on every component (the model's index against
    its shards, every torch file loading with weights_only...) plus the components that could
    not be read; anything else gets its format's `check`. Sources that cannot be opened at all
    (a `latest` naming a missing tag) become one problem. `src` may be a `Source` already
    resolved and `opened` its training layout already opened (`recognise_layout`): nothing is
    then resolved or opened again.
    """
    where = src.location.raw if isinstance(src, Source) else src
    owned = opened is None  # what this call opens it closes; a caller's stays open
    try:
        source = src if isinstance(src, Source) else resolve_source(src)
        if opened is None and format is None:
            opened = _open_layout(source)
        if opened is None:
            name = format_of(source, format)
            return list(get_format(name).check(source))
    except CkptError as error:
        return [problem_from_error(error, file=error.path or where)]
    from .composite import subfolder_source
    from .training import component_problems

    problems = component_problems(opened)
    try:
        for rel, fmt in opened.parts.values():
            if fmt == "json":
                continue
            if rel.endswith("/"):
                part = subfolder_source(source, rel.rstrip("/"))
            else:
                part = Source(location=source.location, storage=source.storage, target=rel)
            problems.extend(get_format(fmt).check(part))
    finally:
        if owned:
            opened.checkpoint.close()
    return problems


def single_layout_missing(source: Source) -> list[Problem]:
    """What one checkpoint (a DCP folder, a torch.save file) lacks by its training layout's own
    rule (`Layout.missing`: a torchtitan save holding its `train_state` and no optimizer
    state); what plain `verify` adds to its format's structural check. Only a DCP folder's
    layout has such a rule (torchtitan's): another source imports no layout module."""
    if source.target is not None or DCP_METADATA not in set(source.top_level()):
        return []
    from .composite import Folder
    from .torch_dict import SINGLE_LAYOUTS

    for layout in SINGLE_LAYOUTS:
        if layout.recognise(source):
            found = layout.missing(source, Folder(source))
            if found:
                return found
    return []


def recognise_layout(source: Source) -> OpenedSource | None:
    """The training layout of a local folder when it is one, else None (cheap: names first).

    Unlike `open_source`, nothing else is opened, so a caller can still run a format's `check`
    on a broken plain checkpoint (what `verify` does).
    """
    return _open_layout(source)
