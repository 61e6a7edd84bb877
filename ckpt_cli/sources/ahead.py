"""A remote SRC opened ahead: its listing and its format's first reads, started on a thread
while the command line is still importing.

Opening `hf://org/repo` costs round trips before anything can be parsed: the repository's
info (its commit and files), the index, then every shard's header. A `ckpt` process also
spends a few hundred milliseconds importing typer, pydantic and its own modules before its
command runs. `start` (called by the CLI's entry point, before those imports) overlaps the
two: a daemon thread resolves the location (`formats.resolve_source`) and lets its format
start fetching what it reads first (`Format.prefetch`: the safetensors index, and every
shard's header in the background). The command's own `resolve_source` of the same SRC then
`take`s that source instead of resolving it again: nothing is requested twice, and what was
fetched waits in the storage for the parse.

Nothing here decides what the command would not: the format is detected as the command
detects it, and nothing is fetched ahead when the command names a format or when the location
may be a run folder (`inspect` scans those instead of opening them). A failure to resolve is
kept and raised again by `take`, so the command reports it as if it had met it itself; a
failure in the prefetch is dropped (the command's own reads meet and report it). A source
never taken (a usage error, an interrupt during the imports) is closed by `discard`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..errors import CkptError

if TYPE_CHECKING:
    from ..formats.base import Source


class _Ahead:
    """One location being opened on its thread, and what came of it."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.done = threading.Event()
        self.source: Source | None = None
        self.error: CkptError | None = None
        self.taken = False
        self.discarded = False


_lock = threading.Lock()
_current: _Ahead | None = None


def start(src: str, *, prefetch: bool = True) -> None:
    """Start resolving `src` (a remote location) on a daemon thread and, with `prefetch`,
    fetching what its detected format reads first. Returns at once."""
    global _current
    ahead = _Ahead(src)
    with _lock:
        _current = ahead
    threading.Thread(target=_open, args=(ahead, prefetch), name="ckpt-ahead", daemon=True).start()


def take(src: str) -> Source | None:
    """The source `start` opened for `src` (waiting for it), handed over once; None when
    nothing was started for it (or it could not be opened for a reason the caller's own
    attempt will meet). A CkptError met while resolving is raised here."""
    with _lock:
        ahead = _current
        if ahead is None or ahead.src != src or ahead.taken or ahead.discarded:
            return None
        ahead.taken = True
    ahead.done.wait()
    if ahead.error is not None:
        raise ahead.error
    return ahead.source


def discard() -> None:
    """Close a source opened ahead that no command took (its fetches still queued are
    dropped); one still being opened is closed by its thread when it is done."""
    with _lock:
        ahead = _current
        if ahead is None or ahead.taken or ahead.discarded:
            return
        ahead.discarded = True
        source = ahead.source if ahead.done.is_set() else None
    if source is not None:
        source.storage.close()


def _open(ahead: _Ahead, prefetch: bool) -> None:
    from ..formats import resolve_source
    from ..storage.uri import parse_location

    try:
        # a Location, not the string: `resolve_source` of a string would take this very source
        source = resolve_source(parse_location(ahead.src))
    except CkptError as error:
        ahead.error = error
        ahead.done.set()
        return
    except Exception:
        ahead.done.set()  # the command resolves it itself and reports what goes wrong
        return
    with _lock:
        wanted = prefetch and not ahead.discarded
    if wanted:
        _prefetch(source)
    with _lock:
        ahead.source = source
        ahead.done.set()
        dropped = ahead.discarded
    if dropped:
        source.storage.close()


def _prefetch(source: Source) -> None:
    """The first reads of the format the command will detect, started (best effort: what
    fails here, the command's own reads meet again and report)."""
    from ..formats import choose_format, get_format
    from ..sources.runs import looks_like_run

    try:
        if looks_like_run(source):
            return
        get_format(choose_format(source, None)).prefetch(source)
    except Exception:  # a speed-up only: the command reads again, and reports
        return
