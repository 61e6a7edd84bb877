"""What reaches a terminal: names made safe to print, the width at which nothing wraps, and
the quiet exit when stdout's reader is gone. Beneath both the renderers and their consoles."""

from __future__ import annotations

import codecs
import io
import os
import re
import sys
from typing import NoReturn, TextIO

#: the width a console claims when it is not a terminal: wide enough that nothing wraps
UNWRAPPED_WIDTH = 1_000_000

# C0 controls but newline, DEL, C1 controls, and the bidi / direction marks and overrides
# (U+061C, U+200E-F, U+202A-E, U+2066-9): characters a name must never send to a terminal;
# and lone surrogates (U+D800-DFFF), which a pickled or DCP name may hold and no UTF-8
# stream can write (the encoder raised after the command's work was done)
_UNSAFE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(text: str) -> str:
    """`text` with control and bidi characters and lone surrogates written as visible escapes
    (`\\x1b`, `\\u202e`, `\\udc80`).

    Names come from checkpoints, i.e. from anyone: `ESC[2J` must not clear the user's screen,
    and U+202E must not make `gpj.exe` read as `exe.jpg`. JSON output keeps the real names.
    """
    return _UNSAFE.sub(_escape_char, text)


def one_line(name: str) -> str:
    """`name` as one record of human output: a name holding a line break (a file or tensor
    name, which may hold any character but `/`) is quoted as Python writes it
    (`'notes\\nFAKE LINE.txt'`), so its second half never reads as a line of its own;
    any other name is unchanged. JSON output keeps the real names."""
    return repr(name) if "\n" in name or "\r" in name else name


#: characters of a message shown from each end when it is longer than twice this: the start
#: says what is wrong, the end the fix; a name quoted in between may be any length (a tensor
#: named with a megabyte of characters made a verify problem a 2 MB line)
MESSAGE_END_CHARS = 5_000


def one_line_message(text: str) -> str:
    """A message (an error, a warning, a verify problem with its fix) kept on one line: a line
    break in it comes from a name it quotes (a file may be named `a\\nb`), so it is written
    as `\\n`, and the line's second half never reads as a record of its own. A message
    longer than `2 * MESSAGE_END_CHARS` keeps its two ends and says how much it left out
    between them; `--json` carries it whole."""
    text = text.replace("\n", "\\n")
    if len(text) <= 2 * MESSAGE_END_CHARS + 100:
        return text
    left_out = len(text) - 2 * MESSAGE_END_CHARS
    return (
        f"{text[:MESSAGE_END_CHARS]}… ({left_out:,} characters left out; --json has the whole "
        f"message) …{text[-MESSAGE_END_CHARS:]}"
    )


def writes_utf8(stream: TextIO) -> bool:
    """Whether `stream` encodes text as UTF-8 (so it can carry any character a name holds)."""
    encoding = stream.encoding or "utf-8"  # None: a stream of str only (closed at start)
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def escape_what_stdout_cannot_carry() -> None:
    """Make stdout write a character its encoding lacks as an escape (`\\u2264`).

    Under a Latin-1 locale, PYTHONIOENCODING=ascii or a Windows code page, stdout's strict
    encoder raised on the first "≤" or "—" of a report, after the command's work was done;
    stderr already escapes (Python's default for it). A UTF-8 stdout is left as it is.
    """
    stream = sys.stdout
    if isinstance(stream, io.TextIOWrapper) and not writes_utf8(stream):
        stream.reconfigure(errors="backslashreplace")


#: the status of a run whose reader went away: 128 + SIGPIPE, what a shell reports for `yes | head`
CLOSED_PIPE_EXIT = 141


def closed_pipe_exit() -> NoReturn:
    """Stop quietly with 141 after stdout's reader went away (`| head -1`)."""
    try:
        # later flushes (at exit too) must not raise again: point stdout at /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # not a real file descriptor (the in-process test runner)
    raise SystemExit(CLOSED_PIPE_EXIT)
