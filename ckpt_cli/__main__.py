"""`python -m ckpt_cli` (also what torchrun launches, and the `ckpt` console script).

Ctrl-C, SIGTERM or SIGHUP while the CLI is still importing (the first second) exits with the
signal's code and no traceback: the handlers are installed before the heavy imports. Once typer
runs (a command module or its operation still importing), `conventions.CkptGroup` maps them the
same way: 130, 143, 129, with the message on stderr.
"""

import sys


def _exit_now(code: object) -> None:
    """End the process with `code` without tearing the interpreter down, when nothing is left
    that the teardown would do for us.

    A command is over when it returns: its outputs are fsynced, closed and published. What the
    interpreter's own exit adds is freeing every module and object one by one, 0.05-0.15 s of
    CPU after a `convert` has imported pydantic, typer and rich, on every data command. So:
    the exit handlers still run (`atexit`: logging, coverage, torch's), stdout and stderr are
    flushed, and only then `os._exit`. Anything unusual (a thread still running, a flush that
    fails, a code that is not a number) takes the ordinary exit instead."""
    import atexit
    import os
    import threading

    if code is None:
        code = 0
    if not isinstance(code, int) or isinstance(code, bool):
        return
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        return
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # a closed pipe, a signal: the ordinary exit reports it
        return
    os._exit(code)


def entry() -> None:
    """Install the signal handlers, then import and run the CLI."""
    from . import faults

    faults.install_handlers()
    try:
        from .cli.app import main

        main()
    except KeyboardInterrupt as exc:  # arrived outside a command (imports, argument parsing)
        error = faults.interruption(exc)
        sys.stderr.write(f"ckpt: {error.message}\n")
        sys.exit(error.exit_code)


def console() -> None:
    """The `ckpt` command and `python -m ckpt_cli`: `entry`, then the process ends without the
    interpreter's teardown (`_exit_now`). `entry` itself ends with `SystemExit`, for callers
    that run it in their own process."""
    try:
        entry()
    except SystemExit as exc:
        _exit_now(exc.code)
        raise


if __name__ == "__main__":
    console()
