"""`python -m ckpt_cli` (also what torchrun launches, and the `ckpt` console script).

Ctrl-C, SIGTERM or SIGHUP while the CLI is still importing (the first second) exits with the
signal's code and no traceback: the handlers are installed before the heavy imports. Once typer
runs (a command module or its operation still importing), `conventions.CkptGroup` maps them the
same way: 130, 143, 129, with the message on stderr.
"""

import os
import sys


def entry() -> None:
    """Install the signal handlers, then import and run the CLI."""
    from . import faults, heap

    faults.install_handlers()
    heap.pause_start_up()  # until the command's work begins: see `heap`
    # pydantic looks for plugins (logfire and the like) by reading the entry points of every
    # installed distribution, on the first model it builds: ~25 ms of a metadata command in a
    # large environment, for plugins that observe services, not a command line. An explicit
    # PYDANTIC_DISABLE_PLUGINS (even empty, which loads them all) is left as the user set it.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")
    try:
        from .cli.app import main

        main()
    except KeyboardInterrupt as exc:  # arrived outside a command (imports, argument parsing)
        error = faults.interruption(exc)
        sys.stderr.write(f"ckpt: {error.message}\n")
        sys.exit(error.exit_code)


if __name__ == "__main__":
    entry()
