"""A rich progress bar on stderr implementing `ckpt_cli.progress.Progress`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ...dist.command import joined
from ...progress import NULL_PROGRESS
from ...progress import Progress as ProgressSink

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class RichProgress:
    """Bytes, rate and ETA on stderr; silent when stderr is not a terminal or with --json."""

    def __init__(self, progress: Progress):
        self._progress = progress
        self._task: TaskID | None = None

    def start(self, total: int, description: str) -> None:
        self.finish()
        workers = joined()
        if not workers.leader:
            return  # under torchrun only rank 0 draws (one terminal, K processes)
        self._task = self._progress.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, amount)

    def finish(self) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None


@contextmanager
def bar(enabled: bool = True) -> Iterator[ProgressSink]:
    """A progress sink for one command run (one that draws nothing when nothing would show:
    rich's progress machinery is then not even imported, a measurable part of a start-up)."""
    if not enabled:  # --json: not even the console is made
        yield NULL_PROGRESS
        return
    from . import stderr

    if not stderr.on_terminal or stderr.quiet:
        yield NULL_PROGRESS
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=True,
    )
    with progress:
        yield RichProgress(progress)
