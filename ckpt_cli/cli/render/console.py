"""The rich consoles of `ckpt_cli.cli.render` (imported when something is printed with them)."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterable
from typing import IO, Any, cast

from rich.console import Console, ConsoleDimensions
from rich.segment import Segment
from rich.text import Text

from .terminal import UNWRAPPED_WIDTH, closed_pipe_exit, safe_text

#: the words of ckpt's own markup tags (`[bold]`, `[bold red]`, `[dim]`, `[/]`...)
STYLE_WORDS = ("bold", "dim", "italic", "underline", "red", "green", "yellow", "cyan", "magenta")
_OWN_TAG = re.compile(rf"/?(?:(?:{'|'.join(STYLE_WORDS)})(?: (?:{'|'.join(STYLE_WORDS)}))*)?")
#: spaces at the end of a line (before its newline: a print may end mid-line, `end=""`), before
#: its style's reset code where colour is on
_TRAILING_SPACES = re.compile(r" +((?:\x1b\[0m)?)(?=\n)")
#: what rich's markup parser takes for a tag (`rich.markup.RE_TAGS`)
_TAG = re.compile(r"(\\*)\[([a-z#/@][^\[]*?)\]")


def escape_data_tags(text: str) -> str:
    """`text` with every bracketed run that is not one of ckpt's own style tags escaped.

    Paths and names come from users and checkpoints: `runs[/x]` made rich raise (a traceback,
    exit 1) and `runs[exp1]` printed as `runs`. ckpt's own tags (`[bold]`, `[/]`) stay markup;
    what `rich.markup.escape` escaped already is left as it is.
    """

    def escaped(match: re.Match[str]) -> str:
        backslashes, inner = match.group(1), match.group(2)
        if len(backslashes) % 2 or _OWN_TAG.fullmatch(inner):
            return match.group(0)
        return f"{backslashes}\\[{inner}]"

    return _TAG.sub(escaped, text)


class MessageStream(io.TextIOBase):
    """stderr as ckpt's messages see it: a write it refuses is dropped, never raised.

    stderr carries only messages (errors, warnings, progress); the outcome is the exit status
    and stdout. A stderr that cannot take them (`2>/dev/full`, a log file on a full disk, a
    log reader gone, a closed descriptor) must not change that outcome: a published DEST
    reported as exit 74, a missing path as exit 1 while its `--json` envelope says 3.
    """

    def __init__(self, stream: io.TextIOBase) -> None:
        super().__init__()
        self.stream = stream

    @property  # the stream's own: rich picks its characters by it
    def encoding(self) -> str:  # type: ignore[override]  # an attribute in typeshed
        return self.stream.encoding

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):  # refused or closed: the message is lost
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()


class SafeConsole(Console):
    """A rich Console that escapes control/bidi characters and never wraps off a terminal.

    Off a terminal (pipes, files, CI logs) one record is one line: the console claims a width
    nothing reaches (whatever COLUMNS says), so tables are space-aligned and never folded, and
    text is never wrapped. A closed pipe (`| head -1`) ends the run quietly with 141.
    Emoji codes are never replaced: a name holding one (`run:cat:2`) is a path, printed as
    it is written.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**{"emoji": False, **options})

    @property
    def file(self) -> IO[str]:
        """The stream written to; stderr's as a `MessageStream`, whose refusals are dropped."""
        stream = super().file
        if self.stderr and isinstance(stream, io.TextIOBase):
            return cast("IO[str]", MessageStream(stream))
        return stream

    @file.setter
    def file(self, new_file: IO[str]) -> None:
        self._file = new_file  # what rich's own setter does

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

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        """What rich writes, less the spaces a table pads its last column with off a terminal
        (each row as wide as the widest cell: `awk`, `diff` and editors see them)."""
        rendered = super()._render_buffer(buffer)
        if self.on_terminal:
            return rendered
        return _TRAILING_SPACES.sub(r"\1", rendered)

    def on_broken_pipe(self) -> None:
        # rich's default exits 1, which scripts read as "problems found"
        self.quiet = True
        closed_pipe_exit()

    def render_str(self, text: str, **kwargs: Any) -> Text:
        markup = kwargs.get("markup")
        if markup or (markup is None and self._markup):
            text = escape_data_tags(text)
        return super().render_str(safe_text(text), **kwargs)
