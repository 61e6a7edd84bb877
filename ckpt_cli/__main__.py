"""`python -m ckpt_cli` (also what torchrun launches, and the `ckpt` console script).

Ctrl-C, SIGTERM or SIGHUP while the CLI is still importing (the first second) exits with the
signal's code and no traceback: the handlers are installed before the heavy imports. Once typer
runs (a command module or its operation still importing), `conventions.CkptGroup` maps them the
same way: 130, 143, 129, with the message on stderr.
"""

import errno
import io
import os
import signal
import sys
import types
from collections.abc import Iterable
from typing import NoReturn


def run() -> int:
    """Install the signal handlers, then import and run the CLI: its exit status."""
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python leaves None there
        sys.stdout = _ClosedStream()
    try:
        # inside the `try`: Ctrl-C while these first modules import is Python's own
        # KeyboardInterrupt, reported as any other (SIGTERM then still kills at once)
        from . import faults, heap

        faults.install_handlers()
        from .cli.render.terminal import escape_what_stdout_cannot_carry

        escape_what_stdout_cannot_carry()
        heap.pause_start_up()  # until the command's work begins: see `heap`
        # pydantic looks for plugins (logfire and the like) by reading the entry points of
        # every installed distribution, on the first model it builds: ~25 ms of a metadata
        # command in a large environment, for plugins that observe services, not a command
        # line. An explicit PYDANTIC_DISABLE_PLUGINS (even empty, which loads them all) is
        # left as the user set it.
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")
        _without_plugin_loader()
        from .cli.app import main

        main()
        code = 0
    except SystemExit as exc:  # typer ends every command so, with its exit status
        code = _status(exc.code)
    except KeyboardInterrupt as exc:  # arrived outside a command (imports, argument parsing)
        code = _early_interruption(exc)
    except Exception:
        from . import faults

        if faults.received is None:
            raise
        # the signal's exception wrapped on its way: Python turns one raised in a class's
        # `__set_name__` (pydantic's, importing while the arguments parse) into a RuntimeError
        code = _early_interruption(None)
    return code


class _NoPydanticPlugins(types.ModuleType):
    """Stands in for `pydantic.plugin._loader` while plugins are disabled: its `get_plugins`
    finds none, as the real one does then, without the real module's import of
    `importlib.metadata` (and `email`, which that imports): ~30 ms of every command's
    start-up, for a scan the setting skips anyway (#30). Anything else asked of it, or plugins
    enabled later in the process, loads the real module in its place."""

    def get_plugins(self) -> Iterable[object]:
        if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in ("__all__", "1", "true"):
            return ()
        return self._real().get_plugins()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # what the import system asks of any module (`__path__`)
            raise AttributeError(name)
        return getattr(self._real(), name)

    def _real(self) -> types.ModuleType:
        import importlib

        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return importlib.import_module(self.__name__)


def _without_plugin_loader() -> None:
    """Put `_NoPydanticPlugins` in the place of pydantic's plugin loader, unless the user asked
    for plugins or something loaded the real one already."""
    name = "pydantic.plugin._loader"
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") == "1" and name not in sys.modules:
        sys.modules[name] = _NoPydanticPlugins(name)


def _early_interruption(exc: BaseException | None) -> int:
    """Report a signal that came outside a command (message, envelope with --json): its code."""
    from . import faults
    from .cli.render import emit_early_interruption

    error = faults.interruption(exc)
    emit_early_interruption(error, sys.argv[1:])
    return error.exit_code


class _ClosedStream(io.TextIOBase):
    """stdout when the process was started without one: a write fails as a write to a closed
    descriptor does (EBADF), so a command that prints its result reports it with exit 74
    instead of printing nowhere and calling that success."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def isatty(self) -> bool:
        return False


def entry() -> NoReturn:
    """The `ckpt` console script (and `python -m ckpt_cli`): `run`, then `_leave`."""
    _leave(run())


def _status(code: object) -> int:
    """The exit status `sys.exit(code)` would give: None is 0, a message is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _leave(code: int) -> NoReturn:
    """End the process once the command is over: flush what it printed, then exit at once.

    The interpreter's own teardown (unloading every module, collecting what they hold) takes
    up to a second once torch is imported, for nothing a finished command needs: every
    output is closed, fsynced and published, and every staging folder removed, before the
    command returns; the threads still running only read ahead for it. Skipping it also
    closes the window in which a Ctrl-C after a published output turned success into 130.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # closed when the process started
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # `ckpt ... | head -1`: the reader is gone, not an error
            code = code or 141
        except (OSError, ValueError):
            pass  # closed or failing: nothing more can be said on it
    os._exit(code)


if __name__ == "__main__":
    entry()
