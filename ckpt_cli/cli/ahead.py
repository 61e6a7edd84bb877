"""The remote SRC of a metadata command, opened while the CLI is still importing.

`ckpt inspect hf://org/repo` and `ckpt verify hf://org/repo` start with round trips (the
repository's info, the index, every shard's header) and with a few hundred milliseconds of
imports (typer, pydantic, the command's modules): the entry point calls `start` before those
imports, so the two overlap (`sources.ahead`). The arguments are read by hand, as typer would
read them later: only the plain form `ckpt COMMAND SRC [OPTIONS]` with a remote SRC starts
anything; with `--help` or a Hub option (`--token`, `--revision`, `--repo-type`) nothing
does, and a `--format` leaves the format's reads to the
command (it may name another format than the one detected).
"""

from __future__ import annotations

import os

from ..sources import ahead

#: the commands whose first work is reading SRC's metadata
COMMANDS = ("inspect", "verify")

#: options that change how SRC is opened (another revision, another token): with one of them
#: nothing is opened ahead (a gated repository asked without `--token` would fail ahead)
HUB_OPTIONS = ("--token", "--revision", "--repo-type")


def start(args: list[str]) -> bool:
    """Start opening the SRC of `ckpt ARGS` ahead when it is remote; whether it was started."""
    if len(args) < 2 or args[0] not in COMMANDS or os.environ.get("_CKPT_COMPLETE"):
        return False
    src, options = args[1], args[2:]
    if "://" not in src or src.startswith("file://") or src.startswith("-"):
        return False  # a local SRC costs no round trip to overlap
    if any(a in ("-h", "--help") for a in options):
        return False
    if any(a.split("=", 1)[0] in HUB_OPTIONS for a in options):
        return False  # SRC is opened with them, which only the command applies
    named = any(a.startswith(("--format", "-f")) for a in options)
    ahead.start(src, prefetch=not named)
    return True


def discard() -> None:
    """Close what `start` opened when the command did not take it (`sources.ahead.discard`)."""
    ahead.discard()
