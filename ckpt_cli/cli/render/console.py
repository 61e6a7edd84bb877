"""The rich consoles of `ckpt_cli.cli.render` (imported when something is printed with them)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.text import Text

from . import UNWRAPPED_WIDTH, closed_pipe_exit, safe_text


class SafeConsole(Console):
    """A rich Console that escapes control/bidi characters and never wraps off a terminal.

    Off a terminal (pipes, files, CI logs) one record is one line: the console claims a width
    nothing reaches (whatever COLUMNS says), so tables are space-aligned and never folded, and
    text is never wrapped. A closed pipe (`| head -1`) ends the run quietly with 141.
    """

    @property
    def on_terminal(self) -> bool:
        """Whether the stream really is a terminal. rich's `is_terminal` is also true when
        FORCE_COLOR or TTY_COMPATIBLE ask for colour (common in CI), and colour into a pipe is
        the user's choice, but wrapping a record at COLUMNS there is not: width, tables and
        progress follow the stream itself."""
        try:
            return self.file.isatty()
        except (AttributeError, ValueError, OSError):
            return False

    @property
    def size(self) -> ConsoleDimensions:
        if not self.on_terminal:
            return ConsoleDimensions(UNWRAPPED_WIDTH, 25)
        return super().size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        width, height = new_size
        self._width, self._height = width, height

    def on_broken_pipe(self) -> None:
        # rich's default exits 1, which scripts read as "problems found"
        self.quiet = True
        closed_pipe_exit()

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(safe_text(text), **kwargs)
