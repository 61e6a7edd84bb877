"""The layout protocol every training-folder layout implements, and `OpenedSource`."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..formats.base import Checkpoint, Source
from ..models import Problem, TrainingState
from .model_folders import LayoutInfo

if TYPE_CHECKING:
    from .composite import Folder


#: the components `resumable` needs, in the order they are reported
REQUIRED = ("weights", "optimizer", "scheduler", "step", "rng", "dataloader")


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
    """

    checkpoint: Checkpoint
    training: TrainingState | None = None
    problems: list[Problem] = field(default_factory=list)
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the library layout of a model folder (PEFT adapter, diffusers pipeline...), if any
    layout: LayoutInfo | None = None
    unreadable: dict[str, tuple[str, str]] = field(default_factory=dict)


class Layout(ABC):
    """One training-folder layout (Trainer, accelerate, DeepSpeed...): what `open_source` asks.

    `open_source` walks the registry (`ckpt_cli.layouts.FOLDER_LAYOUTS`) in order: the first
    layout whose `recognise` says yes and whose `open` returns a source wins. `recognise` looks
    at file names only (nothing is read), so asking every layout costs nothing; `open` opens the
    components and may still decline (None) when a closer look says the folder is not its own.

    Attributes:
        name: the layout token reported in `TrainingState.layout` / `LayoutInfo.layout`.
        step_folder: how a run folder names this layout's checkpoints (`checkpoint-(\\d+)`),
            the step being group 1; None when the layout has no step naming of its own.
    """

    name: ClassVar[str]
    step_folder: ClassVar[re.Pattern[str] | None] = None

    @abstractmethod
    def recognise(self, source: Source) -> bool:
        """Whether the folder's file names look like this layout (cheap: no file is read)."""

    @abstractmethod
    def open(self, source: Source) -> OpenedSource | None:
        """Open the folder's components as one source; None when it turns out not to be one."""

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """Components this checkpoint should hold but lacks (completeness); none by default."""
        return []

    def step_of(self, folder_name: str) -> int | None:
        """The step a run's checkpoint folder named `folder_name` holds, by this layout's naming."""
        if self.step_folder is None:
            return None
        match = self.step_folder.fullmatch(folder_name)
        return int(match.group(1)) if match else None
