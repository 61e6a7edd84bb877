"""The layout protocol every training layout implements (`Layout`; `SingleLayout` for those
inside one checkpoint), `OpenedSource`, and `open_as_format`."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from ...formats.base import Checkpoint, Source
from ...formats.names import DCP_METADATA, TORCH_SUFFIXES
from ...models import Manifest, Problem, TrainingState
from .model_folders import LayoutInfo

if TYPE_CHECKING:
    from .composite import Folder


#: the components `resumable` needs, in the order they are reported
REQUIRED = ("weights", "optimizer", "scheduler", "step", "rng", "dataloader")

#: the components that hold a model's weights: `model`, `model_1`... (several prepared models),
#: `model_rank0` (a rank's FSDP part); not DeepSpeed's `model_states` (its bf16 module copy)
_MODEL_COMPONENT = re.compile(r"model(_\d+)?(_rank\d+)?")


def is_model_component(component: str) -> bool:
    """Whether `component` of a training folder holds a model's weights (`model`, `model_1`,
    `model_1_rank0`), rather than its training state."""
    return _MODEL_COMPONENT.fullmatch(component) is not None


@dataclass(frozen=True)
class Placeholder:
    """An entry a layout keeps in place of data that lives elsewhere (ZeRO-3's empty
    parameters in the model states): never to be handed over as that data.

    Attributes:
        real: the entry that holds the data (the rebuilt weight), "" when none can be built.
        kind: what it is, plural (`ZeRO-3 placeholders`).
        why: what it holds and where the data is, for the message.
        fix: what to do instead (`--select model`).
    """

    real: str
    kind: str
    why: str
    fix: str


@dataclass
class OpenedSource:
    """A source opened for reading.

    Attributes:
        checkpoint: where entries are read from (a composite for multi-file training folders).
        training: the training state, when the layout holds one.
        problems: components that were found but could not be read (unsafe or corrupt files).
        parts: for a multi-file folder, component -> (its main file, its format token).
        unreadable: components found but not readable: component -> (where, the problem);
            a command that writes the checkpoint must not drop them silently.
        placeholders: entry name -> the placeholder it is (see `Placeholder`).
    """

    checkpoint: Checkpoint
    training: TrainingState | None = None
    problems: list[Problem] = field(default_factory=list)
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the library layout of a model folder (PEFT adapter, diffusers pipeline...), if any
    layout: LayoutInfo | None = None
    unreadable: dict[str, tuple[str, str]] = field(default_factory=dict)
    placeholders: dict[str, Placeholder] = field(default_factory=dict)
    #: files of the folder a layout lists but never loads: file -> why (`training_args.bin`)
    listed_files: dict[str, str] = field(default_factory=dict)
    #: the components such files are: component -> its file (accelerate's `sampler.bin` is
    #: the `sampler`, which `prune --slim-older-than` removes with the other resume state)
    listed_parts: dict[str, str] = field(default_factory=dict)
    #: what part of a larger checkpoint this source is, for people, when it is one (a legacy
    #: Megatron-LM rank folder: one rank's slices of the model): an export to a framework
    #: naming, which needs the whole model, is refused; None for a whole checkpoint
    part_of: str | None = None
    #: for a whole save of several rank folders (a legacy Megatron-LM `iter_N/`): each rank
    #: folder opened as it is named alone, by folder name; `checkpoint` holds their entries
    #: under `<folder>.`. Empty for anything else
    ranks: dict[str, OpenedSource] = field(default_factory=dict)


class Layout(ABC):
    """One training-folder layout (Trainer, accelerate, DeepSpeed...): what `open_source` asks.

    `open_source` walks the registry (`ckpt_cli.sources.layouts.FOLDER_LAYOUTS`) in order: the first
    layout whose `recognise` says yes and whose `open` returns a source wins. `recognise` looks
    at file names only (nothing is read), so asking every layout costs nothing; `open` opens the
    components and may still decline (None) when a closer look says the folder is not its own.

    Attributes:
        name: the layout token reported in `TrainingState.layout` / `LayoutInfo.layout`.
        step_folder: how a run folder names this layout's checkpoints (`checkpoint-(\\d+)`),
            the step being group 1; None when the layout has no step naming of its own.
        rank_files: the top-level files holding one rank's state (RNG streams): the rank is
            group 1 (a name without it is rank 0's of a one-rank save); None: no such files.
            `rank_file_name` says how the framework names them at a given world size.
        rank_state_world_size: entries recording the world size the per-rank state was saved
            for (torchtitan's `dataloader.world_size`), which its loader compares with its own.
        world_size_cut: how a world-size reshard of the whole folder cuts its state: `dcp`
            re-cuts its DCP sub-folders and carries the rest; `zero` re-cuts DeepSpeed's ZeRO
            partitions (`ops.reshard_zero`).
        training_files: top-level files the framework writes for the training save, not for
            a model (DeepSpeed's `zero_to_fp32.py`): a copy of the save carries them, an
            export to a framework naming (`convert --to hf`) leaves them out.
        step_folder_counts_saves: the number in `step_folder` counts saves, not training
            steps (accelerate's automatic `checkpoint_N`, one per `save_state`): it orders the
            run's saves but is never reported, or matched with metrics, as a step.
        loads_size_shards: whether the framework's loader reads weights cut into size shards
            with an index (the Trainer does, `load_sharded_checkpoint`); accelerate's
            `load_state` reads one `model{_i}.safetensors` per model, so a `--max-shard-size`
            copy of its folder would not resume.
        last_file: the top-level file the framework's save writes last, into every save
            (accelerate's `random_states_N.pkl`, after the model, optimizer, scheduler...); a
            run's judge calls a save without it unfinished (cut short, or still being written)
            when the save is named by `step_folder` or another save of the run holds one.
            None when the layout has no such file (its marker, if any, is judged otherwise).
        after_last_file: top-level files the save writes after `last_file` only when the
            script asked for them, one per object, numbered (accelerate's
            `custom_checkpoint_{i}.pkl`, one per `register_for_checkpointing` object): a save
            holding `last_file` but not one of these that the run's save before it holds was
            cut short after `last_file` (a run's judge). None when the layout writes none.
        holds_training_state: whether the folder is a training save (its files beside the
            weights are optimizer, scheduler, RNG... state a copy of the save needs); a model
            folder layout (a diffusers pipeline) says no.
    """

    name: ClassVar[str]
    step_folder: ClassVar[re.Pattern[str] | None] = None
    rank_files: ClassVar[re.Pattern[str] | None] = None
    rank_state_world_size: ClassVar[tuple[str, ...]] = ()
    world_size_cut: ClassVar[Literal["dcp", "zero"]] = "dcp"
    training_files: ClassVar[re.Pattern[str] | None] = None
    step_folder_counts_saves: ClassVar[bool] = False
    loads_size_shards: ClassVar[bool] = True
    last_file: ClassVar[re.Pattern[str] | None] = None
    after_last_file: ClassVar[re.Pattern[str] | None] = None
    holds_training_state: ClassVar[bool] = True

    @abstractmethod
    def recognise(self, source: Source) -> bool:
        """Whether the folder's file names look like this layout (cheap: no file is read)."""

    @abstractmethod
    def open(self, source: Source) -> OpenedSource | None:
        """Open the folder's components as one source; None when it turns out not to be one."""

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """Components this checkpoint should hold but lacks (completeness); none by default."""
        return []

    def unknown_state(self, source: Source, folder: Folder) -> str | None:
        """Why the checkpoint's own files cannot tell whether it should hold more than it does
        (the framework records nothing that says so: a weights-only save, or state lost), or
        that they say it is a weights-only save no resume continues where training stopped
        from (`save_only_model`, torchtitan's `last_save_model_only` export), for a run's
        judge to say rather than call it whole silently; None when it holds its state."""
        return None

    def rank_file_name(self, rank: int, world_size: int) -> str:
        """The file the framework saves (and at `world_size` ranks loads) rank `rank`'s state in;
        only asked of layouts with `rank_files`."""
        raise NotImplementedError(f"the {self.name} layout has no per-rank files")

    def rank_file_rank(self, name: str) -> int | None:
        """The rank a top-level file of this layout holds the state of (`rank_files`), else None."""
        if self.rank_files is None:
            return None
        match = self.rank_files.fullmatch(name)
        if match is None:
            return None
        return int(match.group(1)) if match.group(1) is not None else 0

    def batch_notes(self, opened: OpenedSource, before: int, after: int) -> list[str]:
        """What a change from `before` to `after` ranks does to the saved data position (the
        global batch it was counted in), one warning each; none when the layout records none."""
        return []

    def step_of(self, folder_name: str) -> int | None:
        """The step a run's checkpoint folder named `folder_name` holds, by this layout's naming."""
        if self.step_folder is None:
            return None
        match = self.step_folder.fullmatch(folder_name)
        return int(match.group(1)) if match else None


def top_keys(manifest: Manifest) -> dict[str, str]:
    """Top-level key -> the prefix of its entries (the real key, not the first dotted part)."""
    out: dict[str, str] = {}
    for e in manifest.entries:
        key = e.top_key()
        if key not in out:
            out[key] = f"{key}." if e.name != key else key
    return out


def open_as_format(source: Source, format: str | None = None) -> Checkpoint:
    """`source` opened as one format (`formats.choose_format`: `format`, a token, else the one
    detected), its origin in the manifest's details; no training layout is looked for. What a
    layout opens its own checkpoints with; a SRC a user named goes through the door
    (`ckpt_cli.sources.opening.open_plain`), which first refuses a folder of saves."""
    from ...formats import choose_format, get_format

    checkpoint = get_format(choose_format(source, format)).open(source)
    if source.origin:
        checkpoint.manifest.details.update(source.origin)
    return checkpoint


class SingleLayout(Layout):
    """A training layout inside one checkpoint: a torch.save dict, a Lightning `.ckpt`, a
    torchtitan DCP folder. It is told apart from the others by the top-level keys of the opened
    checkpoint (`matches`), so `open_source` opens SRC once and asks the registry
    (`ckpt_cli.sources.layouts.SINGLE_LAYOUTS`) in order; `recognise` / `open` serve a caller that holds
    only a source.

    Attributes:
        suffixes: the file names it is saved under as one torch.save file (none: never a file).
        dcp_folder: whether it may also be a DCP folder (`.metadata` at the top).
    """

    suffixes: ClassVar[tuple[str, ...]] = TORCH_SUFFIXES
    dcp_folder: ClassVar[bool] = True

    @abstractmethod
    def matches(self, checkpoint: Checkpoint, keys: dict[str, str]) -> bool:
        """Whether an opened checkpoint with these top-level keys (`top_keys`) is this
        layout's (cheap: the manifest's names, nothing read)."""

    @abstractmethod
    def training_state(self, checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState | None:
        """The training state of an opened checkpoint this layout `matches` (`keys`: its
        top-level keys); None when it holds plain weights after all."""

    def recognise(self, source: Source) -> bool:
        """Whether SRC could be this layout from its names: one of its files, or a DCP folder."""
        if source.target is not None:
            return bool(self.suffixes) and source.target.endswith(self.suffixes)
        return self.dcp_folder and DCP_METADATA in set(source.top_level())

    def open(self, source: Source) -> OpenedSource | None:
        """Open SRC as one checkpoint; None unless its keys say it is this layout's."""
        from ...formats import get_format

        checkpoint = open_as_format(source)
        state = None
        if get_format(checkpoint.manifest.format).holds_objects:
            keys = top_keys(checkpoint.manifest)
            if self.matches(checkpoint, keys):
                state = self.training_state(checkpoint, keys)
        if state is None:
            checkpoint.close()
            return None
        return OpenedSource(checkpoint=checkpoint, training=state)
