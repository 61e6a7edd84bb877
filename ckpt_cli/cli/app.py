"""The typer application: shared options, the command glue, and `main()` (errors -> exit codes).

Commands live one per module in `ckpt_cli/cli/commands/`; each registers itself on `app` and calls
`run_command`, which runs one library call, renders its result (human or `--json`) and maps
every failure to the exit codes documented in DESIGN.md.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer
import typer.core
import typer.models

from .. import __version__, faults
from ..errors import CkptError, Interrupted, NotFoundError, ProblemsFound
from ..heap import end_start_up
from .conventions import CkptGroup, CkptTyper, T, docs_url, hub_hint

app = CkptTyper(
    cls=CkptGroup,
    name="ckpt",
    help=(
        "Inspect, verify, convert, reshard, prune, sync, download, diff, merge, protect and "
        "repair sharded and resumable training checkpoints (safetensors, PyTorch DCP, "
        "torch.save, GGUF; on disk, the Hugging Face Hub and object stores), and find why a "
        "resumed run diverged."
    ),
    epilog=f"Documentation: {docs_url()}",
    no_args_is_help=True,
    add_completion=True,
    # plain click help: no width-dependent boxes, real metavars (SRC, GLOB), flags shown bare
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)

# options shared by several commands, so every command spells them the same way
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout (the ckpt_json envelope).")
]
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        "-f",
        help="Read SRC as this format (safetensors, dcp, torch, gguf; hub: an hf:// SRC) "
        "instead of detecting it.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", help="Replace DEST if it exists (only after the new output is complete)."
    ),
]
HigherIsBetterOpt = Annotated[
    bool | None,
    typer.Option(
        "--higher-is-better/--lower-is-better",
        help="With --keep-best: the best value is the highest (an accuracy) or the lowest "
        "(a loss; the default).",
        show_default=False,
    ),
]


class BestEnd(str, enum.Enum):
    """The values of the deprecated `--mode` of `prune` and `sync` (conventions.BEST_END_MODE)."""

    min = "min"
    max = "max"


#: `prune` / `sync --mode min|max`, hidden: see conventions.DEPRECATED_OPTIONS
DeprecatedModeOpt = Annotated[
    BestEnd | None,
    typer.Option(
        "--mode",
        hidden=True,
        help="Deprecated: --lower-is-better (min) or --higher-is-better (max).",
    ),
]
SrcArg = Annotated[
    str,
    typer.Argument(
        help="Checkpoint file or folder, or hf://org/repo[@revision][/subfolder].",
        show_default=False,
    ),
]

#: the order commands appear in `ckpt --help`; modules not listed follow alphabetically
COMMAND_ORDER = [
    "inspect",
    "verify",
    "convert",
    "reshard",
    "prune",
    "latest",
    "sync",
    "download",
    "diff",
    "doctor",
    "merge",
    "protect",
    "repair",
]


def examples(*commands: str) -> str:
    """A command's help epilog listing example invocations.

    The `\\b` line keeps click's help formatter from re-wrapping the examples into one paragraph.
    """
    return "Examples:\n\n\b\n" + "\n".join("  " + command for command in commands)


#: the root's version option: eager, it prints and exits before any command is looked up
VERSION_OPTIONS = ("--version", "-V")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"ckpt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            *VERSION_OPTIONS,
            help="Print the version and exit.",
            callback=_version_callback,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Inspect, verify, convert, reshard, prune, sync, download, diff, merge, protect and repair
    training checkpoints, and find why a resumed run diverged."""


def run_command(
    command: str,
    json_output: bool,
    action: Callable[[], T],
    render_human: Callable[[T], None],
    exit_code: Callable[[T], int] = lambda _result: 0,
    failure: Callable[[T, int], CkptError] | None = None,
) -> None:
    """Run one library call and render it; every failure becomes its documented exit code.

    Args:
        command: the subcommand name, for the JSON envelope.
        json_output: print the JSON envelope instead of human output.
        action: the library call; returns a pydantic model (or JSON-able value).
        render_human: prints `result` for people (rich, stdout for data).
        exit_code: 0, or 1 when the result reports problems (verify, diff).
        failure: the error object a non-zero `exit_code` carries in the JSON envelope (default:
            a generic "problems found" one), so every non-zero exit says code, message and fix.
    """
    import time

    from . import render

    started = time.monotonic()
    end_start_up()  # the collector paused by the entry point runs again, for the work
    faults.begin_command()
    faults.notice_sink = functools.partial(render.warn, command)
    render.envelope_started = False
    try:
        result = action()
        if faults.unanswered_stop():
            # a signal swallowed on its way (importing torch catches and drops one now and
            # then): the command was stopped, whatever the work that went on made of it
            raise faults.interruption()
        # the outputs are published, or the result is one `--json` envelope: a signal while
        # the report prints is held, and the command ends as it would have (a second one stops
        # the printing). A command that wrote nothing stops as usual while it prints for people
        held = bool(faults.published) or json_output
        reporting = faults.HeldStopSignals(second_stops=True) if held else None
    except NotFoundError as error:
        hint = next((h for h in map(hub_hint, _mentioned(error)) if h), None)
        if hint and (error.fix is None or "hf://" not in error.fix):
            error.fix = f"{error.fix.rstrip('.')}. " if error.fix else ""
            error.fix += hint[0].upper() + hint[1:]
        _report_failure(command, error, json_output)
    except CkptError as error:
        if faults.received is not None and not isinstance(error, Interrupted):
            error = faults.interruption()  # a failure caused by the signal's exception
        _report_failure(command, error, json_output)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP (see faults.py)
        interrupted = faults.interruption(exc)
        render.emit_error(command, interrupted, json_output)
        raise typer.Exit(interrupted.exit_code) from None
    except (typer.Exit, SystemExit):
        raise
    except OSError as exc:  # disk full, EIO, read-only, EACCES...: not a bug (exit 74)
        io_error: CkptError = faults.interruption() if faults.received else faults.io_failure(exc)
        render.emit_error(command, io_error, json_output)
        raise typer.Exit(io_error.exit_code) from None
    except Exception as exc:  # anything else is a bug: say so, keep the traceback for CKPT_DEBUG
        if faults.received is not None:  # torch's C++ writer wraps our KeyboardInterrupt
            interrupted = faults.interruption()
            render.emit_error(command, interrupted, json_output)
            raise typer.Exit(interrupted.exit_code) from None
        if os.environ.get("CKPT_DEBUG"):
            raise
        render.emit_internal_error(command, exc, json_output and _leader())
        raise typer.Exit(70) from None
    code = exit_code(result)
    stop = faults.answered_stop()
    if stop is not None:
        # a `--watch` loop stopped by a signal: its summary stands, and the exit code says the
        # signal (130, 143, 129) as the table does for every command
        code = stop.exit_code
        failure = lambda _result, _code: stop  # noqa: E731
    try:
        _render(command, json_output, result, code, render_human, failure, started)
        if stop is not None and not json_output:
            render.emit_error(command, stop, False)
    except KeyboardInterrupt as exc:  # a signal while the report printed
        interrupted = faults.interruption(exc, "interrupted while the report printed")
        with contextlib.suppress(OSError):  # stdout holds part of an envelope: stderr alone
            render.emit_error(command, interrupted, json_output and not render.envelope_started)
        raise typer.Exit(interrupted.exit_code) from None
    except OSError as exc:  # stdout itself: full, closed, or its reader gone
        render.output_failed(command, exc)
    except Exception as exc:  # a bug in the rendering: exit 70 as any other, never exit 1
        if os.environ.get("CKPT_DEBUG"):
            raise
        render.emit_internal_error(command, exc, False)
        raise typer.Exit(70) from None
    finally:
        if reporting is not None:  # the process ends now: a signal held meanwhile changes nothing
            reporting.restore()
    if code:
        raise typer.Exit(code)


def _render(
    command: str,
    json_output: bool,
    result: T,
    code: int,
    render_human: Callable[[T], None],
    failure: Callable[[T, int], CkptError] | None,
    started: float,
) -> None:
    """Print a command's result: its envelope, or its human rendering and warnings."""
    import time

    from . import render

    if _leader():  # under torchrun only rank 0 prints the result
        if json_output:
            found: CkptError | None = None
            if code:
                found = failure(result, code) if failure else _problems_found(command, code)
            render.emit_json(command, result, code, found)
            if found is not None and code != 1:
                # an error (`latest` finding no complete checkpoint: exit 3), not the problems
                # a report lists (exit 1): on stderr too, as every other error of a --json run
                render.emit_error(command, found, False, exit_code=code)
        else:
            render_human(result)
            # a report's `warnings` (options that had no effect...) go to stderr, any command
            notes = getattr(result, "warnings", None)
            if isinstance(notes, list):
                for note in notes:
                    if isinstance(note, str):
                        render.warn(command, note)
        if render.verbosity > 0:
            render.stderr.print(
                f"ckpt {command}: done in {time.monotonic() - started:.2f} s (exit {code})",
                highlight=False,
            )


def _problems_found(command: str, code: int) -> CkptError:
    error = ProblemsFound(
        f"ckpt {command} finished with exit {code}",
        fix="The result member lists what was found.",
    )
    return error


def _mentioned(error: CkptError) -> list[str]:
    """The locations an error speaks of, for the `hf://` hint."""
    return [error.path] if error.path else []


def _leader() -> bool:
    """Whether this process prints results: rank 0 of a split run, or a plain process.

    Ranks exist only once `ckpt_cli.dist.command` was imported (by a launch, or a library
    caller's `use(...)`), so a plain run answers without importing it.
    """
    distributed = sys.modules.get("ckpt_cli.dist.command")
    return distributed is None or bool(distributed.joined().leader)


def _report_failure(command: str, error: CkptError, json_output: bool) -> NoReturn:
    """Print `error` and exit with its code.

    Under torchrun a command that split its work speaks through rank 0; the others print only
    errors of their own (the collective RankFailedError is rank 0's to report).
    """
    from . import render

    distributed = sys.modules.get("ckpt_cli.dist.command")
    collective = distributed is not None and isinstance(error, distributed.RankFailedError)
    if _leader():
        render.emit_error(command, error, json_output)
    elif not collective:
        render.emit_error(command, error, False)
    raise typer.Exit(error.exit_code) from None


def _command_modules() -> list[str]:
    """The command modules of `ckpt_cli.cli.commands`, in `ckpt --help` order."""
    from . import commands

    # a listing of the package's folder, not `pkgutil` (an import of its own at every start)
    found = sorted(
        name.removesuffix(".py")
        for folder in commands.__path__
        for name in os.listdir(folder)
        if name.endswith(".py") and not name.startswith("_")
    )
    return [n for n in COMMAND_ORDER if n in found] + sorted(
        n for n in found if n not in COMMAND_ORDER
    )


def load_commands(only: str | None = None) -> None:
    """Import the modules of `ckpt_cli.cli.commands` so each registers its command on `app`: every
    one, or `only` that one (what a process running one command needs)."""
    ordered = _command_modules()
    for name in [only] if only in ordered else ordered:
        importlib.import_module(f"ckpt_cli.cli.commands.{name}")
    if only is None:
        # a process that loaded one command first still lists them in help order
        rank = {name: i for i, name in enumerate(ordered)}
        app.registered_commands.sort(
            key=lambda info: rank.get(
                getattr(info.callback, "__module__", "").rpartition(".")[2], 0
            )
        )


def get_app() -> typer.Typer:
    """The fully populated typer app (used by tests and completion generation)."""
    load_commands()
    return app


def _app_for(args: list[str]) -> typer.Typer:
    """The app with the commands `args` can run: the named command alone when the first
    argument names one (its siblings' modules and typer parameters cost start-up time), none
    for `--version`, every command for help, completion, a typo's suggestion or another root
    option."""
    if os.environ.get("_CKPT_COMPLETE"):
        return get_app()
    if args and args[0] in VERSION_OPTIONS:
        # eager: prints and exits while the root's options are parsed, before any command is
        # looked up, so no command module (a third of a `--version` process) is needed
        return app
    if args and not args[0].startswith("-") and args[0] in _command_modules():
        load_commands(only=args[0])
        return app
    return get_app()


def main(argv: list[str] | None = None) -> Any:
    """Console entry point (`ckpt`); under torchrun, joins the launch's process group first."""
    from ..dist.launch import is_multi_rank_launch

    faults.install_handlers()
    args = argv if argv is not None else sys.argv[1:]
    _app_for(args)
    if not is_multi_rank_launch():
        return app(args=args, prog_name="ckpt")
    from ..dist.command import launched

    with launched():
        return app(args=args, prog_name="ckpt")
