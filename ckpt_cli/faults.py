"""Signals and operating-system failures, turned into documented exit codes.

* SIGTERM and SIGHUP are handled like Ctrl-C: the handler raises `Signalled` (a
  `KeyboardInterrupt`), so every cleanup path that already removes partial output on Ctrl-C
  runs for them too; the process then exits 143 (SIGTERM) or 129 (SIGHUP) instead of 130.
  The handler also remembers the signal, because C++ code that calls back into Python
  (torch.save's zip writer) turns any exception raised inside it into a `RuntimeError`: a
  failure that happens after a signal arrived is reported as that interruption, not as a bug.
* An `OSError` (disk full, EIO, read-only filesystem, EACCES, EXDEV) becomes an `IOFailure`
  (exit 74, sysexits' EX_IOERR) whose message names the file, the errno and a fix.

The library raises these; only `cli.py` installs the handlers (`install_handlers`) and maps
what reaches it (`interruption`, `io_failure`).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import PurePath
from types import FrameType

from .errors import HungUp, Interrupted, IOFailure, Terminated

#: the signal that stopped this process, once one arrived (SIGINT included)
received: int | None = None

#: what the user can do, per errno
_FIXES = {
    errno.ENOSPC: "The filesystem is full: free some space or write to another filesystem.",
    errno.EDQUOT: "The disk quota is exceeded: free some space or write elsewhere.",
    errno.EIO: "The device reported an I/O error: check the disk (dmesg) and run again.",
    errno.EROFS: "The filesystem is read-only: write to another location.",
    errno.EACCES: "Permission denied: check the permissions of the file and its folder.",
    errno.EPERM: "Operation not permitted: check the permissions of the file and its folder.",
    errno.EXDEV: "The rename crossed filesystems: put DEST on the same filesystem as its parent.",
    errno.EMFILE: "Too many open files: raise the limit (ulimit -n) and run again.",
}


class Signalled(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM or SIGHUP arrives (a KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _handler(signum: int, _frame: FrameType | None) -> None:
    global received
    first = received is None
    received = signum
    if first:  # a second signal during cleanup must not interrupt the cleanup itself
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Signalled(signum)


def install_handlers() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP in the main thread (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, _handler)


def interruption(
    exc: BaseException | None = None,
    problem: str = "interrupted",
    path: str | PurePath | None = None,
) -> Interrupted:
    """The error to report for an interruption: by SIGTERM (143), SIGHUP (129) or Ctrl-C (130)."""
    signum = exc.signum if isinstance(exc, Signalled) else received
    if signum == getattr(signal, "SIGTERM", None):
        return Terminated(problem.replace("interrupted", "terminated (SIGTERM)", 1), path=path)
    if signum == getattr(signal, "SIGHUP", None):
        return HungUp(problem.replace("interrupted", "hung up (SIGHUP)", 1), path=path)
    return Interrupted(problem, path=path)


def io_failure(
    exc: OSError, path: str | PurePath | None = None, doing: str | None = None
) -> IOFailure:
    """An `OSError` as an `IOFailure` naming the file (the error's own, else `path`) and errno."""
    where = exc.filename if exc.filename is not None else path
    code = errno.errorcode.get(exc.errno or 0, "E?") if exc.errno is not None else "no errno"
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    problem = f"{doing} failed: {reason} ({code})" if doing else f"{reason} ({code})"
    if exc.filename2 is not None:
        problem += f" (renaming to {exc.filename2})"
    fix = _FIXES.get(exc.errno or 0, "Check the file and the filesystem, then run again.")
    return IOFailure(problem, path=str(where) if where is not None else None, fix=fix)
