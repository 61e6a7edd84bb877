"""Is this process one rank of a torchrun-style launch? Answered from the environment alone.

The CLI asks on every start, so this module imports nothing but `os`: a plain `ckpt` (the
usual case) never loads `ckpt_cli.dist.command`, pydantic's models or torch to find out.
"""

from __future__ import annotations

import os

#: `0` runs a plain process even where launcher variables are set
DISABLE_ENV = "CKPT_DISTRIBUTED"
#: what torchrun (and other launchers) set for every rank
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_environment() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or another launcher) set the usual variables.

    `CKPT_DISTRIBUTED=0` hides a launch: a `ckpt` started from inside a launched program
    inherits its variables, and must then run as a plain process.
    """
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return None
    if not all(os.environ.get(name) for name in LAUNCH_VARS):
        return None
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        return None
    if size < 1 or not 0 <= rank < size:
        return None
    return rank, size


def is_multi_rank_launch() -> bool:
    """More than one rank was launched (a launch of one rank is a plain process)."""
    found = launch_environment()
    return found is not None and found[1] > 1
