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
from collections.abc import Callable
from pathlib import PurePath
from types import FrameType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .errors import HubError, HungUp, Interrupted, IOFailure, Terminated

if TYPE_CHECKING:  # a metadata command never imports the pools (tests/test_startup.py)
    from concurrent.futures import Executor, Future

#: the signal that stopped this process, once one arrived (SIGINT included)
received: int | None = None

#: the stop signal the operation itself caught and answered (a `--watch` loop that ends
#: cleanly on Ctrl-C): the command's result then stands (see `answer_stop`)
answered: int | None = None

#: the outputs a CLI command published complete so far (None outside a command: a library
#: caller such as a training loop saving for hours keeps no list): an interruption that comes
#: after them says they are whole, never that they were removed
published: list[str] | None = None


#: where notices of what ckpt tidied up on its own go (an old copy a killed run left, restored
#: or removed): the CLI points it at stderr for each command; None (a library caller): nowhere
notice_sink: Callable[[str], None] | None = None


def notice(message: str) -> None:
    """Tell the user of something ckpt did that they did not ask for (the debris of a killed
    run removed, their old output put back): on stderr under the CLI, nowhere otherwise."""
    if notice_sink is not None:
        notice_sink(message)


def begin_command() -> None:
    """Start a command's record of published outputs (`note_published`)."""
    global published, answered
    published = []
    answered = None


def answer_stop() -> None:
    """Say that the stop signal received was caught and answered by the operation (a `--watch`
    loop that stops cleanly, its result reporting `stopped: interrupted`). Any other signal
    received by a command that then returns was swallowed on its way (importing torch catches
    and drops one now and then) and still ends the command with its exit code."""
    global answered
    answered = received


def answered_stop() -> Interrupted | None:
    """The interruption a command whose operation answered a stop signal (`answer_stop`: a
    `--watch` loop that stopped cleanly, its summary made) ends with: the signal's exit code
    (130, 143, 129), never 0, so a job scheduler or a script sees the command was stopped."""
    if answered is None:
        return None
    return interruption(fix="The summary lists what its rounds did; run it again to go on.")


def unanswered_stop() -> bool:
    """Whether a stop signal came that nothing raised through or answered: one swallowed by
    code that catches every exception (torch's import does, now and then)."""
    return received is not None and answered is None


def note_published(path: str | PurePath) -> None:
    """Record that the output at `path` is published, complete (a no-op outside a command)."""
    if published is not None:
        published.append(str(path))


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
    errno.EBADF: "The stream is closed (`>&-`?): point it at a file or at /dev/null.",
    errno.ENAMETOOLONG: "The name is too long for the filesystem (an output is written under a "
    "hidden name about 20 characters longer first): choose a shorter name.",
    errno.ENOTDIR: "A part of the path is a file, not a folder: check the path.",
    errno.EFBIG: "The file is larger than the filesystem or the process's file size limit "
    "(ulimit -f) allows: raise the limit or write to another filesystem.",
}


#: errnos that belong to the file written, in an error naming two (a copy, a rename)
_WRITE_SIDE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


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


#: the signals ckpt turns into an interruption (exit 129, 130, 143), where the OS has them
STOP_SIGNALS = frozenset(
    s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None
)


class HeldStopSignals:
    """The stop signals deferred while a staging folder is made and its cleanup armed.

    A Python-level hold rather than a signal mask: the OS hands a process-directed signal to
    any thread that does not block it (torch's, an upload pool's, a test server's), and
    Python then runs the handler in the main thread all the same, so masking the main thread
    alone held nothing once another thread was running. Here the handlers themselves are
    swapped for one that notes the signal; `release` puts them back and raises the signal
    that came meanwhile, so it lands where the caller can clean up. Only the main thread can
    swap handlers (elsewhere nothing is held: signals are not handled there anyway).
    """

    def __init__(self, second_stops: bool = False) -> None:
        #: with `second_stops`, a second signal stops at once (through the handlers put
        #: back): a hold over a write to a stdout that blocks must not make ckpt unkillable
        self.second_stops = second_stops
        self.arrived: int | None = None
        self.previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers]
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            handler = signal.getsignal(signum)
            # None: set outside Python, which could not be put back; an ignored signal
            # (`nohup`'s SIGHUP) has nothing to hold
            if handler is not None and handler != signal.SIG_IGN:
                self.previous[signum] = handler
                signal.signal(signum, self._note)

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.arrived is None:
            self.arrived = signum
        elif self.second_stops:
            self.release()

    def restore(self) -> int | None:
        """Put the handlers back and return the signal that came meanwhile, not raised: for a
        caller whose work was done when it came (the process ends at once after it)."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        arrived, self.arrived = self.arrived, None
        return arrived

    def release(self) -> None:
        """Put the handlers back; a signal that came meanwhile is raised now, through them."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        if self.arrived is not None:
            arrived, self.arrived = self.arrived, None
            signal.raise_signal(arrived)


_P = ParamSpec("_P")
_T = TypeVar("_T")


def submit_tracked(
    pool: Executor, work: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> Future[_T]:
    """`pool.submit(work, …)` with the stop signals held while it runs. A thread pool starts
    its worker threads inside `submit`, and counts a thread only once it has started: a
    Ctrl-C landing in between left a worker the pool did not know, one `shutdown(wait=True)`
    did not wait for, so a cleanup ran while that worker's upload was still on its way (and
    landed after it). Held, the signal is raised as `submit` returns, every worker counted."""
    held = HeldStopSignals()
    try:
        return pool.submit(work, *args, **kwargs)
    finally:
        held.release()


def close_pool(pool: Executor) -> None:
    """Shut a worker pool down, its queued work dropped. Once a stop signal has arrived, the
    threads still inside a request are not waited for: a stalled request would hold Ctrl-C
    (or SIGTERM) for its timeout and every retry. The CLI ends the process with `os._exit`
    once its cleanup is done, which joins no thread; otherwise (no signal) the running work
    finishes first, as before."""
    pool.shutdown(wait=received is None, cancel_futures=True)


def install_handlers() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP in the main thread (no-op elsewhere).

    A signal the process started with ignored stays ignored, as Python leaves an ignored
    SIGINT: `nohup` ignores SIGHUP so that a download outlives its terminal, and a shell's
    background job (`ckpt sync … &` in a script) ignores SIGINT so that a Ctrl-C meant for the
    foreground leaves it running. Handling them anyway ended such a run with 129 or 130.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, _handler)


def interruption(
    exc: BaseException | None = None,
    problem: str = "interrupted",
    path: str | PurePath | None = None,
    fix: str | None = None,
) -> Interrupted:
    """The error to report for an interruption: by SIGTERM (143), SIGHUP (129) or Ctrl-C (130);
    `fix` where what was left differs from the usual (partial outputs removed). An output the
    command had already published (`note_published`) is named as complete: it is valid, and
    running the command again would only find it there."""
    signum = exc.signum if isinstance(exc, Signalled) else received
    if published:
        itself = path is not None and published == [str(path)]
        done = "it" if itself else ", ".join(published)
        problem += f" after {done} was published complete (it is valid)"
        fix = (
            fix
            or f"{'It' if itself else done} is complete: use it as it is (`ckpt verify` checks it)."
        )
    # a problem that already says the partial output was removed is not told so twice
    said = "removed" in problem
    fix = fix or (
        "Run the command again when ready."
        if said
        else "Run the command again when ready (partial outputs are removed)."
    )
    if signum == getattr(signal, "SIGTERM", None):
        problem = problem.replace("interrupted", "terminated (SIGTERM)", 1)
        return Terminated(problem, path=path, fix=fix)
    if signum == getattr(signal, "SIGHUP", None):
        problem = problem.replace("interrupted", "hung up (SIGHUP)", 1)
        return HungUp(problem, path=path, fix=fix)
    return Interrupted(problem, path=path, fix=fix)


def naming(exc: OSError, path: str | PurePath) -> OSError:
    """`exc` naming `path` when it names no file: a read or write on a descriptor (`pread`,
    `copy_file_range`) fails with a bare errno, and the file is what the user must check."""
    if exc.filename is None:
        exc.filename = str(path)
    return exc


def io_failure(
    exc: OSError, path: str | PurePath | None = None, doing: str | None = None
) -> IOFailure:
    """An `OSError` as an `IOFailure` naming the file (the error's own, else `path`) and errno."""
    where = exc.filename if exc.filename is not None else path
    code = errno.errorcode.get(exc.errno or 0, "E?") if exc.errno is not None else "no errno"
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    problem = f"{doing} failed: {reason} ({code})" if doing else f"{reason} ({code})"
    if exc.filename2 is not None and exc.errno in _WRITE_SIDE:
        # a copy or rename that found no room (or a read-only target): the target is where
        # space must be made, not the file it came from
        where = exc.filename2
        problem += f" (from {exc.filename})"
    elif exc.filename2 is not None:
        problem += f" (to {exc.filename2})"
    fix = _FIXES.get(exc.errno or 0, "Check the file and the filesystem, then run again.")
    return IOFailure(problem, path=str(where) if where is not None else None, fix=fix)


def no_verdict(exc: BaseException) -> None:
    """Raise `exc` again when a failed read says nothing about the file: the store failed to
    answer (`HubError`, exit 5) or the operating system refused the read (permission denied,
    an I/O error: `IOFailure`, exit 74, naming the file and errno). Each handler that would
    judge a checkpoint by a read that failed asks this first, so a save ckpt could not read is
    never called incomplete (and `latest` never passes over it for an older one, `prune
    --incomplete` never deletes it)."""
    if isinstance(exc, HubError | IOFailure):
        raise exc
    if isinstance(exc, PermissionError):
        raise io_failure(exc) from None
