"""Terminal output: the JSON envelope, error messages, and shared human formatting.

Each command's human rendering lives in `render/<command>.py`. stdout carries data only;
errors, warnings and progress go to stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ...errors import CkptError
from .terminal import CLOSED_PIPE_EXIT as CLOSED_PIPE_EXIT
from .terminal import UNWRAPPED_WIDTH as UNWRAPPED_WIDTH
from .terminal import closed_pipe_exit as closed_pipe_exit
from .terminal import one_line as one_line
from .terminal import one_line_message as one_line_message
from .terminal import safe_text as safe_text
from .terminal import writes_utf8

JSON_VERSION = 1


def command_of(argv: list[str]) -> str | None:
    """The subcommand named on a command line (its first word that is not an option)."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("-"):
            return token
    return None


def json_requested(argv: list[str]) -> bool:
    """Whether a command line asks for the JSON envelope (`--json` before any `--`; also
    `--json=VALUE`, a usage error whose envelope the caller's parser is waiting for)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(token == "--json" or token.startswith("--json=") for token in options)


def emit_early_interruption(error: CkptError, argv: list[str]) -> None:
    """A signal before any command ran (modules importing, arguments parsed): the message on
    stderr and, with `--json`, the envelope. Plain writes: rich may be what was importing."""
    command = command_of(argv) or "ckpt"
    try:
        if json_requested(argv):
            _print_json(envelope(command, None, error.exit_code, error))
        sys.stderr.write(f"{_prog(command)}: error: {safe_text(one_line_message(error.message))}\n")
    except (OSError, ValueError, AttributeError):
        pass  # a stream closed or gone: the exit status still says it


def output_failed(
    command: str, exc: OSError, what: str = "the result (the command itself ran to its end)"
) -> NoReturn:
    """Stop after stdout itself refused a write: 141 for a reader gone, else exit 74 with the
    errno on stderr (`ckpt inspect X > /dev/full`, stdout closed), as for any other file.

    A `--json` envelope cannot be delivered on the stream that failed; the message goes to
    stderr either way. The result was computed and nothing was written but stdout.
    """
    from ... import faults

    if isinstance(exc, BrokenPipeError):
        closed_pipe_exit()
    try:  # what is still buffered must not fail again at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    error = faults.io_failure(exc, "standard output", doing=f"writing {what}")
    with contextlib.suppress(OSError):  # stderr refuses too (`2>/dev/full`): the status says it
        emit_error(command, error, json_output=False)
    raise SystemExit(error.exit_code)


if TYPE_CHECKING:
    from .console import SafeConsole

    #: data for people (rich markup), on stdout
    stdout: SafeConsole
    #: warnings, notes and progress: silenced by --quiet
    stderr: SafeConsole
    #: errors: printed whatever the verbosity
    errors: SafeConsole

#: -1 with --quiet, 1 with --verbose, 0 otherwise (set once per command run)
verbosity = 0

#: the consoles once made (see `__getattr__`)
_consoles: dict[str, SafeConsole] = {}


def __getattr__(name: str) -> SafeConsole:
    """The consoles `stdout`, `stderr` and `errors`, made when first used.

    rich is imported by what prints with it: a `--json` run's result or `ckpt latest`'s path
    never is (rich's console is about a fifth of a metadata command's start-up).
    """
    if name not in ("stdout", "stderr", "errors"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _console(name)


def _console(name: str) -> SafeConsole:
    """The console `name`, the three made at the first call (and module attributes from then)."""
    if not _consoles:
        from .console import SafeConsole

        _consoles["stdout"] = SafeConsole(highlight=False, soft_wrap=False)
        _consoles["stderr"] = SafeConsole(stderr=True, highlight=False, quiet=verbosity < 0)
        _consoles["errors"] = SafeConsole(stderr=True, highlight=False)
        globals().update(_consoles)
    return _consoles[name]


def set_verbosity(level: int) -> None:
    """Apply -q/-v: quiet silences everything on stderr but errors."""
    global verbosity
    verbosity = level
    if _consoles:  # otherwise `stderr` takes the level when it is made
        _consoles["stderr"].quiet = level < 0


def warn(command: str, message: str) -> None:
    """A warning on stderr (`ckpt CMD: warning: ...`), silenced by --quiet."""
    from rich.markup import escape

    _console("stderr").print(
        f"[yellow]{_prog(command)}: warning:[/] {escape(one_line_message(message))}",
        highlight=False,
    )


def _prog(command: str) -> str:
    # `ckpt inspect: error: ...`, or `ckpt: error: ...` before a command was recognised
    return "ckpt" if command == "ckpt" else f"ckpt {command}"


def stdout_text(text: str) -> None:
    """Plain text on stdout, control characters escaped."""
    sys.stdout.write(safe_text(text) + "\n")
    sys.stdout.flush()


def _jsonable(result: Any) -> Any:
    from pydantic import BaseModel  # here, not at import: `ckpt --help` needs no pydantic

    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return result


def envelope(
    command: str, result: Any, exit_code: int, error: CkptError | None = None
) -> dict[str, Any]:
    """The one JSON document a `--json` run prints."""
    return {
        "ckpt_json": JSON_VERSION,
        "command": command,
        "ok": exit_code == 0,
        "exit_code": exit_code,
        "result": _jsonable(result),
        "error": _error_json(error, exit_code) if error is not None else None,
    }


def _error_json(error: CkptError, exit_code: int) -> dict[str, Any]:
    doc = error.to_json()
    doc["exit_code"] = exit_code
    return doc


#: whether this command began writing its `--json` envelope: stdout holds (part of) one, so
#: an interruption from then on is said on stderr only (a second document would not parse)
envelope_started = False


def write_whole(text: str) -> None:
    """Write `text` to stdout, all of it.

    A signal that is handled (not raised: one held while an envelope prints) while a write
    blocks on a full pipe makes the binary layer return a partial count, and Python's text
    layer drops the rest without a word: an envelope cut short, exit 0. The bytes are written
    here until every one is out.
    """
    stream = sys.stdout
    if not isinstance(stream, io.TextIOWrapper):  # stdout closed at start (`_ClosedStream`)
        stream.write(text)
        stream.flush()
        return
    stream.flush()
    data = memoryview(text.encode(stream.encoding, stream.errors or "strict"))
    while data:
        data = data[stream.buffer.write(data) :]
    stream.buffer.flush()


def _print_json(doc: dict[str, Any]) -> None:
    global envelope_started
    # indented for people at a terminal; compact for pipes, where the C encoder is much faster
    indent = 2 if sys.stdout.isatty() else None
    text = json.dumps(doc, indent=indent, default=str) + "\n"
    envelope_started = True
    write_whole(text)


def emit_json(command: str, result: Any, exit_code: int, error: CkptError | None = None) -> None:
    """Print a result as the JSON envelope; a non-zero exit carries its error object.

    Off a terminal a model result is serialised by pydantic-core straight to JSON text and
    spliced into the envelope: no intermediate tree of Python dicts (on 100,000 tensors that
    tree and its encoding were most of `inspect --json`'s time).
    """
    global envelope_started
    from pydantic import BaseModel
    from pydantic_core import PydanticSerializationError

    # pydantic-core writes UTF-8; on any other stdout the json module's ASCII escapes carry
    # every name
    if sys.stdout.isatty() or not isinstance(result, BaseModel) or not writes_utf8(sys.stdout):
        _print_json(envelope(command, result, exit_code, error))
        return
    try:
        # before the first byte goes out: a result that cannot be written never leaves half an
        # envelope on stdout
        body = result.model_dump_json()
    except PydanticSerializationError:
        # pydantic-core writes UTF-8 only, and a file name that is not UTF-8 (`os.fsdecode`'s
        # lone surrogates) is not: the json module escapes it as `\udcff`, which `json.loads`
        # and `os.fsencode` turn back into the bytes on disk
        _print_json(envelope(command, result, exit_code, error))
        return
    doc = envelope(command, None, exit_code, error)
    del doc["result"]
    head = json.dumps({k: doc[k] for k in ("ckpt_json", "command", "ok", "exit_code")})
    tail = json.dumps(doc["error"], default=str)
    # written in three pieces: the result's text (~120 bytes per DCP chunk) is not copied again
    envelope_started = True
    write_whole(f'{head[:-1]}, "result": ')
    write_whole(body)
    write_whole(f', "error": {tail}}}\n')


def emit_error(
    command: str, error: CkptError, json_output: bool, exit_code: int | None = None
) -> None:
    """Report an expected failure: envelope on stdout with --json, a message on stderr always."""
    from rich.markup import escape

    code = error.exit_code if exit_code is None else exit_code
    if json_output:
        _print_json(envelope(command, None, code, error))
    # the message is plain text: brackets in it (`ckpt-cli[fast]`) are not markup
    _console("errors").print(
        f"[bold red]{_prog(command)}: error:[/] {escape(one_line_message(error.message))}",
        markup=True,
        highlight=False,
    )
    if verbosity > 0:
        _console("errors").print(
            f"  (error code {error.code}, exit {code})", markup=False, highlight=False
        )


def emit_internal_error(command: str, exc: BaseException, json_output: bool) -> None:
    """Report a bug (exit 70) without a traceback unless CKPT_DEBUG is set."""
    from rich.markup import escape

    error = CkptError(
        f"internal error: {type(exc).__name__}: {exc}",
        fix="This is a bug in ckpt. Run again with CKPT_DEBUG=1 for the traceback and report it.",
    )
    if json_output:
        _print_json(envelope(command, None, 70, error))
    _console("errors").print(
        f"[bold red]ckpt {command}: {escape(error.message)}[/]", highlight=False
    )
    if verbosity > 0:
        import traceback

        _console("errors").print(
            "".join(traceback.format_exception(exc)), markup=False, highlight=False, soft_wrap=True
        )


def human_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def human_count(n: int) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def shape_str(shape: list[int]) -> str:
    """[4096, 11008] -> '[4096, 11008]'; [] -> '[]' (a scalar)."""
    return "[" + ", ".join(str(d) for d in shape) + "]"
