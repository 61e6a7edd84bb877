"""Progress reporting from library code without printing: operations take a `Progress`.

The library calls `start`/`advance`/`finish`; the CLI passes an implementation that draws a
rich progress bar on stderr (`render.progress.bar`); library users pass nothing.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress of a long operation (bytes moved, files hashed...)."""

    def start(self, total: int, description: str) -> None:
        """A new phase of `total` units begins."""

    def advance(self, amount: int) -> None:
        """`amount` more units are done."""

    def finish(self) -> None:
        """The phase is over."""


class NullProgress:
    """Progress that goes nowhere (the default for library calls)."""

    def start(self, total: int, description: str) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass


NULL_PROGRESS = NullProgress()


class CountingProgress:
    """Passes progress on to `inner` and counts the units advanced (`done`)."""

    def __init__(self, inner: Progress):
        self.inner = inner
        self.done = 0

    def start(self, total: int, description: str) -> None:
        self.inner.start(total, description)

    def advance(self, amount: int) -> None:
        self.done += amount
        self.inner.advance(amount)

    def finish(self) -> None:
        self.inner.finish()
