"""Terminal output: the JSON envelope, error messages, and shared human formatting.

Each command's human rendering lives in `render/<command>.py`. stdout carries data only;
errors, warnings and progress go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from ..errors import CkptError

JSON_VERSION = 1

stdout = Console(highlight=False, soft_wrap=False)
stderr = Console(stderr=True, highlight=False)


def _jsonable(result: Any) -> Any:
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
        "error": error.to_json() if error is not None else None,
    }


def _print_json(doc: dict[str, Any]) -> None:
    # indented for people at a terminal; compact for pipes, where the C encoder is much faster
    indent = 2 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(doc, indent=indent, default=str) + "\n")
    sys.stdout.flush()


def emit_json(command: str, result: Any, exit_code: int) -> None:
    """Print a successful (or problems-found) result as the JSON envelope."""
    _print_json(envelope(command, result, exit_code))


def emit_error(command: str, error: CkptError, json_output: bool) -> None:
    """Report an expected failure: envelope on stdout with --json, a message on stderr always."""
    if json_output:
        _print_json(envelope(command, None, error.exit_code, error))
    # the message is plain text: brackets in it (`ckpt-cli[fast]`) are not markup
    stderr.print(
        f"[bold red]ckpt {command}: error:[/] {escape(error.message)}", markup=True, highlight=False
    )


def emit_internal_error(command: str, exc: BaseException, json_output: bool) -> None:
    """Report a bug (exit 70) without a traceback unless CKPT_DEBUG is set."""
    error = CkptError(
        f"internal error: {type(exc).__name__}: {exc}",
        fix="This is a bug in ckpt. Run again with CKPT_DEBUG=1 for the traceback and report it.",
    )
    if json_output:
        _print_json(envelope(command, None, 70, error))
    stderr.print(f"[bold red]ckpt {command}: {escape(error.message)}[/]", highlight=False)


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


def counted(n: int, noun: str) -> str:
    """(1, 'file') -> '1 file'; (3, 'file') -> '3 files'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def human_count(n: int) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def shape_str(shape: list[int]) -> str:
    """[4096, 11008] -> '[4096, 11008]'; [] -> '[]' (a scalar)."""
    return "[" + ", ".join(str(d) for d in shape) + "]"
