"""Open any SRC: a plain checkpoint of one format, or a training layout built on top of them.

`open_source` is what inspect, verify, convert and diff call. It returns the checkpoint to read
entries from and, when the source is (or contains) a resumable training checkpoint, the
`TrainingState` describing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import open_checkpoint
from .formats.base import Checkpoint
from .models import TrainingState


@dataclass
class OpenedSource:
    """A source opened for reading.

    Attributes:
        checkpoint: where entries are read from (a composite for multi-file training folders).
        training: the training state, when the layout holds one.
    """

    checkpoint: Checkpoint
    training: TrainingState | None = None


def open_source(src: str, format: str | None = None) -> OpenedSource:
    """Open `src` (local path or URL), recognising training layouts unless `format` is given."""
    return OpenedSource(checkpoint=open_checkpoint(src, format))
