"""Running one `ckpt` command across the ranks of a `torchrun` launch.

`torchrun --nproc-per-node K -m ckpt_cli convert|reshard|verify …` starts K copies of the
command; the launcher sets `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`.
`launched()` (called by the CLI's `main`) recognises that, joins the process group and makes a
`Workers` object the active one (joining when the first operation asks `active()`, so commands
that do not split never touch torch.distributed); the operations then split their work:

* `Workers.assign` hands weighted work items (output shards, rank files, files to hash) to
  ranks: longest-processing-time greedy by bytes, computed identically on every rank from the
  same metadata, so no rank has to tell another what to do.
* `Workers.all_gather` / `broadcast` exchange results. Values go over the wire as JSON text
  (our own report data, never inputs), so what a rank receives is plain data.
* `Workers.together` is the collective failure step: every rank reports whether its part
  raised; if any did, every rank raises the same `RankFailedError` naming the rank(s) and the
  error, so all ranks exit with the same documented code and the staged output is removed.

A plain (non-torchrun) run gets `Workers()`, rank 0 of 1, whose methods do nothing and which
never imports torch: metadata commands stay torch-free. Library callers opt in explicitly
(`with use(workers): ...`), so calling `ckpt_cli` from inside a training job under torchrun
does not silently turn collective.

Backend: gloo (CPU, no GPU needed) unless `CKPT_DIST_BACKEND` names another
(`nccl`, `cpu:gloo,cuda:nccl`); a process group the caller already initialised is reused.

Joining is bounded: every rank waits at most `CKPT_DIST_TIMEOUT` (5 minutes by default) for
all ranks of the launch to join (`join`), then fails with `RendezvousError` naming the ranks
that never came, instead of torch's default 30 minutes in `init_process_group`.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from ..errors import CkptError, HubError
from ..faults import io_failure
from ..formats.names import is_commit_marker
from ..models import Record
from ..storage.output import output_failure, staged_output
from .launch import launch_environment

T = TypeVar("T")

#: overrides the process-group backend (default gloo)
BACKEND_ENV = "CKPT_DIST_BACKEND"
#: how long a rank waits for every rank to join the launch (seconds, or a duration: `10m`)
TIMEOUT_ENV = "CKPT_DIST_TIMEOUT"
#: the join timeout when `CKPT_DIST_TIMEOUT` is not set: far longer than ranks take to start
#: (seconds, even on a loaded node), far shorter than torch's 30 minutes
DEFAULT_JOIN_TIMEOUT = 300.0
#: set only by the tests: the rank named here raises inside its part of the work
FAIL_RANK_ENV = "CKPT_TEST_FAIL_RANK"


class RankFailedError(CkptError):
    """One or more ranks of a distributed run failed; every rank raises this.

    The exit code is the one the first failing rank's own error carries (4 for a bad
    checkpoint, 70 for a bug...), so every rank of the launch exits with the same code.
    """

    exit_code = 70
    code = "rank_failed"

    def __init__(self, failures: list[tuple[int, dict[str, Any]]], size: int):
        self.failures = failures
        first_rank, first = failures[0]
        ranks = ", ".join(str(r) for r, _ in failures)
        label = "rank" if len(failures) == 1 else "ranks"
        super().__init__(
            f"{label} {ranks} of {size} failed: {first['message']}",
            fix="Nothing was published; fix the problem and run the command again.",
        )
        # the class default is 70; instances carry the failing rank's code
        self.exit_code = int(first.get("exit_code") or 70)  # type: ignore[misc]
        self.error_code = str(first.get("code") or "internal")
        self.first_rank = first_rank


class RendezvousError(HubError):
    """The ranks of a launch did not all join within `CKPT_DIST_TIMEOUT` (exit 5): a rank
    died or never started, or the launch's store cannot be reached."""

    code = "rendezvous"


def join_timeout() -> float:
    """Seconds a rank waits for the others to join (`CKPT_DIST_TIMEOUT`; UsageError, exit 2,
    when it is not a duration)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_JOIN_TIMEOUT
    from ..durations import parse_duration

    return parse_duration(text, TIMEOUT_ENV)


_JOIN_FIX = (
    "Check that every rank started and runs the same ckpt command (torchrun's "
    "--nnodes / --nproc-per-node, each rank's log); set CKPT_DIST_TIMEOUT (e.g. 15m) where "
    "ranks take longer to start."
)


def join(rank: int, size: int, backend: str) -> None:
    """Join the launch's process group as `rank` of `size`, waiting at most `join_timeout()`
    for every rank to arrive (torch's own wait is 30 minutes).

    The launch's store (torchrun's, or rank 0's) is reached with that timeout; each rank then
    leaves its mark in it and waits for all the others', so a rank that never came is named.

    Raises:
        RendezvousError: not every rank joined in time, or the store could not be reached.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    seconds = join_timeout()
    started = time.monotonic()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, _, _ = next(rendezvous("env://", rank, size, timeout=timedelta(seconds=seconds)))
    except Exception as exc:  # rank 0 waited for every client, or the store was unreachable
        raise RendezvousError(
            f"rank {rank} of {size}: the launch's ranks did not all meet at its store ({where}) "
            f"within {seconds:g} s ({CKPT_DIST_TIMEOUT_TEXT}): {exc}",
            fix=_JOIN_FIX,
        ) from None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    marks = PrefixStore(f"ckpt/joined/{restart}/", store)
    marks.set(str(rank), "1")
    left = max(1.0, seconds - (time.monotonic() - started))
    try:
        marks.wait([str(r) for r in range(size)], timedelta(seconds=left))
    except Exception:
        missing = [r for r in range(size) if not marks.check([str(r)])]
        label = "rank" if len(missing) == 1 else "ranks"
        raise RendezvousError(
            f"{label} {', '.join(map(str, missing))} of {size} did not join the launch within "
            f"{seconds:g} s ({CKPT_DIST_TIMEOUT_TEXT}): it died or never started",
            fix=_JOIN_FIX,
        ) from None
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)


#: how the join timeout is named in messages
CKPT_DIST_TIMEOUT_TEXT = f"{TIMEOUT_ENV}, {DEFAULT_JOIN_TIMEOUT:g} s unless set"


@dataclass(frozen=True)
class Workers:
    """The ranks sharing one command run, and the collectives the operations need.

    Attributes:
        rank: this process's rank (0 in a single-process run).
        size: how many ranks take part (1 in a single-process run).
    """

    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        """More than one rank takes part."""
        return self.size > 1

    @property
    def leader(self) -> bool:
        """This is rank 0: it writes the commit marker, publishes and prints."""
        return self.rank == 0

    def assign(self, weights: Sequence[int]) -> list[int]:
        """The rank that does each item: longest-processing-time greedy on `weights` (bytes).

        Items are taken heaviest first (ties by position) and each goes to the rank with the
        least work so far (ties to the lowest rank); the result depends only on `weights` and
        `size`, so every rank computes the same assignment without talking.
        """
        owner = [0] * len(weights)
        load = [0] * self.size
        order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
        for index in order:
            rank = min(range(self.size), key=lambda r: (load[r], r))
            owner[index] = rank
            load[rank] += weights[index]
        return owner

    def mine(self, weights: Sequence[int]) -> list[int]:
        """Indices of the items `assign` gives this rank, in their original order."""
        return [i for i, r in enumerate(self.assign(weights)) if r == self.rank]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (JSON-able), indexed by rank, on every rank."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, json.dumps(value))
        return [json.loads(text) for text in out]

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s `value` (JSON-able), on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [json.dumps(value) if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return json.loads(box[0])  # type: ignore[arg-type]

    def settle(self, error: BaseException | None) -> None:
        """Collective: raise `RankFailedError` on every rank if any rank passes an error."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        mine = None if error is None else describe(error)
        reports = self.all_gather(mine)
        failures = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if failures:
            raise RankFailedError(failures, self.size) from error

    @contextmanager
    def together(self) -> Iterator[None]:
        """Run the body on every rank; afterwards, fail every rank if any rank's body raised."""
        if not self.distributed:
            yield
            return
        try:
            yield
        except BaseException as exc:  # reported to every rank, then re-raised
            self.settle(exc)
            raise  # pragma: no cover - settle always raises when given an error
        self.settle(None)

    def test_failure_point(self, where: str) -> None:
        """Raise here when the tests ask this rank to fail (`CKPT_TEST_FAIL_RANK`)."""
        wanted = os.environ.get(FAIL_RANK_ENV)
        if wanted is not None and wanted.strip() == str(self.rank) and self.distributed:
            from ..errors import FormatError

            raise FormatError(
                f"injected failure on rank {self.rank} during {where}",
                fix="Unset CKPT_TEST_FAIL_RANK: only ckpt's tests set it.",
            )


def describe(error: BaseException) -> dict[str, Any]:
    """A JSON-able summary of `error` for the other ranks (an OS error is the I/O failure it
    is, exit 74, naming its file and errno: never a bug)."""
    if isinstance(error, OSError):
        error = io_failure(error)
    if isinstance(error, CkptError):
        return {"code": error.code, "exit_code": error.exit_code, "message": error.message}
    if isinstance(error, KeyboardInterrupt):
        return {"code": "interrupted", "exit_code": 130, "message": "interrupted"}
    return {
        "code": "internal",
        "exit_code": 70,
        "message": f"internal error {type(error).__name__}: {error}",
    }


SINGLE = Workers()
_ACTIVE: contextvars.ContextVar[Workers] = contextvars.ContextVar("ckpt_workers", default=SINGLE)
#: (rank, size) of a launch seen by `launched()` but not joined yet
_PENDING: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "ckpt_pending_launch", default=None
)
_CREATED: list[bool] = []


def active() -> Workers:
    """The workers the current command runs on; joins a pending launch's process group.

    `Workers()` unless inside `use(...)`, or inside `launched()` under torchrun, where the first
    call (from an operation that splits its work) joins the process group. Commands that never
    ask (inspect, prune, download...) never join it and never import torch.distributed.
    """
    workers = _ACTIVE.get()
    pending = _PENDING.get()
    if pending is None or workers.distributed:
        return workers
    import torch.distributed as dist

    if not dist.is_initialized():
        join(pending[0], pending[1], os.environ.get(BACKEND_ENV) or "gloo")
        _CREATED.append(True)
    workers = Workers(rank=dist.get_rank(), size=dist.get_world_size())
    _ACTIVE.set(workers)
    return workers


def joined() -> Workers:
    """The active workers without joining anything (rank 0 of 1 until an operation joined)."""
    return _ACTIVE.get()


@contextmanager
def use(workers: Workers) -> Iterator[Workers]:
    """Make `workers` the active ones for the operations called inside."""
    token = _ACTIVE.set(workers)
    try:
        yield workers
    finally:
        _ACTIVE.reset(token)


@contextmanager
def launched() -> Iterator[None]:
    """Under a launch of more than one rank, let operations join its process group.

    Joining waits for the first `active()` call, so only the commands that split their work
    join (and import torch.distributed); the group is destroyed on the way out.
    """
    found = launch_environment()
    if found is None or found[1] == 1:
        yield
        return
    pending = _PENDING.set(found)
    token = _ACTIVE.set(SINGLE)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _PENDING.reset(pending)
        if _CREATED:
            _CREATED.clear()
            import torch.distributed as dist

            # teardown of a failed run must not mask its error
            with suppress(Exception):
                dist.destroy_process_group()


class CombinedProgress:
    """Progress of every rank, drawn by rank 0 as one bar.

    Every rank calls `start(total_of_all_ranks, ...)` and `advance(its own units)`. The other
    ranks publish their count in the launch's key-value store (the rendezvous store torchrun
    already runs) at most every `interval` seconds; rank 0 adds what they published to its own
    count when it draws. Without a store (or a single process) this is `inner` unchanged.

    Args:
        inner: rank 0's real progress sink (the other ranks' is not drawn).
        workers: the ranks.
        store: a `torch.distributed.Store`-like object (`add(key, amount) -> int`); by default
            the process group's own store.
        interval: seconds between store round trips on each rank.
        total: the units of all ranks together, when the caller's `start` gets its own only.
    """

    def __init__(
        self,
        inner: Any,
        workers: Workers,
        store: Any = None,
        interval: float = 0.25,
        total: int | None = None,
    ):
        self.inner = inner
        self.total = total
        self.workers = workers
        self.store = store if store is not None or not workers.distributed else _default_store()
        self.interval = interval
        self._phase = 0
        self._unsent = 0
        self._seen = [0] * workers.size
        self._last = 0.0

    @property
    def combined(self) -> bool:
        """Whether the other ranks' progress reaches rank 0."""
        return self.workers.distributed and self.store is not None

    def _key(self, rank: int) -> str:
        return f"ckpt/progress/{self._phase}/{rank}"

    def start(self, total: int, description: str) -> None:
        # phases are numbered alike on every rank: the operations call start symmetrically
        self._phase += 1
        self._unsent = 0
        self._seen = [0] * self.workers.size
        self._last = time.monotonic()
        if self.combined:
            description = f"{description} ({self.workers.size} ranks)"
            total = self.total if self.total is not None else total
        elif self.workers.distributed:
            description = f"{description} (rank 0's share)"
        self.inner.start(total, description)

    def advance(self, amount: int) -> None:
        if not self.combined:
            self.inner.advance(amount)
            return
        if self.workers.leader:
            self.inner.advance(amount)
        else:
            self._unsent += amount
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._sync()

    def _sync(self) -> None:
        try:
            if not self.workers.leader:
                if self._unsent:
                    self.store.add(self._key(self.workers.rank), self._unsent)
                    self._unsent = 0
                return
            for rank in range(1, self.workers.size):
                seen = int(self.store.add(self._key(rank), 0))
                if seen > self._seen[rank]:
                    self.inner.advance(seen - self._seen[rank])
                    self._seen[rank] = seen
        except Exception:  # progress is cosmetic: a store hiccup must not fail the run
            self.store = None

    def finish(self) -> None:
        if self.combined:
            self._sync()
        self.inner.finish()


def _default_store() -> Any:
    """The default process group's key-value store, or None where torch hides it."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # a private accessor: without it rank 0 draws its own share only
        return None


class RankShare(Record):
    """What one rank of a split run did (reports list one per rank; empty in a single run).

    Attributes:
        rank: the rank.
        files: the output files it wrote (or the files it hashed, for verify).
        bytes: the bytes it moved (or hashed).
        seconds: how long its share took.
    """

    rank: int
    files: list[str] = Field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0


def refuse_remote_split(dest: Any) -> None:
    """Refuse an object-store DEST (a `RemoteDest`) under a launch of more than one rank, up
    front: the split run writes into a staging folder every rank sees, and the refusal must
    not wait for the store to answer (or to be reachable at all)."""
    if isinstance(dest, Path) or not (_PENDING.get() is not None or _ACTIVE.get().distributed):
        return
    from ..errors import UsageError

    raise UsageError(
        "a run split across torchrun ranks writes to a filesystem every rank sees",
        path=str(dest),
        fix="Give a DEST on a shared filesystem, or run as one process to write to a URL.",
    )


def split_output(
    workers: Workers,
    dest: Any,
    *,
    force: bool,
    single_file: bool = False,
    work: Callable[[Path], T],
    commit: Callable[[Path, list[T]], Any],
) -> Any:
    """Write one output at `dest` with every rank, published atomically by rank 0.

    Each rank runs `work(staging)` (its share of the data files; returns a JSON-able part).
    After every rank's part is in (a failure anywhere fails every rank, see `together`), rank 0
    runs `commit(staging, parts)` (the commit marker, then the structural check) and publishes
    with one rename. Returns `commit`'s JSON-able result on every rank. Rank 0 alone creates the
    staging folder (its path is broadcast: the ranks share a filesystem) and alone renames or
    removes it. A single-process run is `commit(staging, [work(staging)])` in `staged_output`.
    `dest` is whatever `staged_output` accepts; a split run needs a local (shared) path.
    """
    if not workers.distributed:
        with staged_output(
            dest, commit_marker=is_commit_marker, force=force, single_file=single_file
        ) as staging:
            return commit(staging, [work(staging)])
    if not isinstance(dest, Path):
        from ..errors import UsageError

        raise UsageError(
            "a run split across torchrun ranks writes to a filesystem every rank sees",
            path=str(dest),
            fix="Give a DEST on a shared filesystem, or run as one process to write to a URL.",
        )
    stack = ExitStack()
    try:
        path = None
        with workers.together():
            if workers.leader:
                staged = staged_output(
                    dest, commit_marker=is_commit_marker, force=force, single_file=single_file
                )
                path = str(stack.enter_context(staged))
        staging = Path(workers.broadcast(path))
        part: Any = None
        with workers.together():
            try:
                part = work(staging)
            except OSError as exc:  # named as one process names it: DEST, not the staging
                raise output_failure(exc, dest, staging) from None
        parts = workers.all_gather(part)
        result = None
        with workers.together():
            if workers.leader:
                try:
                    result = commit(staging, parts)
                except OSError as exc:
                    raise output_failure(exc, dest, staging) from None
                # the publishing rename: still inside `together`, so if it fails, all fail
                stack.close()
        return workers.broadcast(result)
    except BaseException as error:
        try:
            # rank 0's staged_output removes the staging folder; the other ranks hold nothing
            stack.__exit__(*sys.exc_info())
        finally:
            if isinstance(error, RankFailedError):
                # every rank failed together: the others wait until rank 0 has removed the
                # staging folder, since torchrun stops the remaining ranks once one exits
                with suppress(Exception):
                    workers.barrier()
        raise
