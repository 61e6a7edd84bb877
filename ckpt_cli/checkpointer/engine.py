"""`Checkpointer`: the save engine (see the package docstring for what it guarantees)."""

from __future__ import annotations

# imported first: its exit hook (which refuses new pool work) must be registered before ours
import concurrent.futures.thread  # noqa: F401
import errno
import logging
import re
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..errors import (
    REPORT_BUG,
    CkptError,
    FormatError,
    Interrupted,
    IOFailure,
    UsageError,
)
from ..faults import io_failure
from ..formats.names import is_commit_marker
from ..progress import NULL_PROGRESS, Progress
from ..sources.runs import is_remote
from ..storage.output import TMP_MARKER, staged_output
from ..storage.uri import is_hub_url
from .hooks import pause_point
from .model import SAVE_FORMAT, CheckpointerStatus, LoadedCheckpoint, SaveRecord
from .staging import HostStaging
from .state import apply, capture, entries, load_template, rebuild
from .tiers import DEFAULT_ALGO, RESCANS, Choice, choose

if TYPE_CHECKING:
    from ..ops.prune.retention import PruneDecision, PrunePolicy

OnBusy = Literal["wait", "skip"]
#: the folders a Checkpointer writes: its saves, and the staging folders of interrupted ones
_OWN_SAVE = re.compile(r"step-\d+|\.step-\d+" + re.escape(TMP_MARKER) + r".*")
Checks = Literal["checksums", "structure", "none"]
#: how long one rank waits for the others at any point of a save or a load, by default
DEFAULT_TIMEOUT = timedelta(minutes=10)


#: the live checkpointers, whose save in flight the interpreter waits for at exit
_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _finish_pending_saves() -> None:
    """Let every save in flight finish before the interpreter shuts down.

    A script that ends (or raises, or exits from a signal handler) right after `save` would
    otherwise lose that save: Python's exit first marks the thread pools shut (the checksum
    and parity steps use one), and only then joins the save thread, whose next pool job then
    fails. `threading._register_atexit` hooks run before that join, newest first, so this one
    (registered after `concurrent.futures.thread`'s) runs while the pools still take work.
    """
    for engine in list(_LIVE):
        with engine._lock:
            in_flight = engine._current
        if in_flight is not None:  # the wait may take minutes: say why the exit is held
            engine.log.info(
                "the script is ending: waiting for the save of step %d in flight "
                "(a SIGKILL now leaves it unpublished)",
                in_flight.step,
            )
        engine.wait()


threading._register_atexit(_finish_pending_saves)  # type: ignore[attr-defined]

# DCP warns on every single-process save and load that it assumes a single process: the one
# intended here (the library never writes to stderr). The filter is narrow (this message of
# DCP's utilities), and installed once: `catch_warnings` is not thread-safe, and the saves run
# in a background thread while the training loop may warn.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
    module="torch.distributed.checkpoint",
)


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it, outermost first: the `__cause__` / `__context__` chain, and
    each rank's failure of a DCP `CheckpointException`."""
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        here = todo.pop(0)
        if any(here is seen for seen in out):
            continue
        out.append(here)
        if isinstance(here, CheckpointException):
            for failure in here.failures.values():
                cause = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(cause, BaseException):
                    todo.append(cause)
        for nxt in (here.__cause__, here.__context__):
            if nxt is not None:
                todo.append(nxt)
    return out


def _out_of_space(causes: list[BaseException]) -> bool:
    """Whether the disk (or the quota) was full: an `ENOSPC` / `EDQUOT` among `causes`."""
    return any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)


def _failed_ranks(causes: list[BaseException]) -> list[int]:
    """The ranks whose part of a DCP save failed (its `CheckpointException` names them)."""
    for cause in causes:
        if isinstance(cause, CheckpointException):
            return sorted(cause.failures)
    return []


def _first_failure(error: CheckpointException) -> str:
    """The first rank's failure of a DCP load, in one line (`ValueError: Size mismatch...`)."""
    for failure in error.failures.values():
        # DCP keeps each rank's failure as (exception, stack)
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, BaseException):
            return f"{type(cause).__name__}: {cause}"
    return type(error).__name__


def _for_other_ranks(error: BaseException, where: Path, rank: int = 0) -> CkptError:
    """What the other ranks raise for `rank`'s failure to choose or load the save: the same
    error when it is ckpt's own; an OS error as the I/O failure it is; anything else as a bug."""
    if isinstance(error, CkptError):
        return error
    if isinstance(error, OSError):
        return io_failure(error, where, f"loading the save on rank {rank}")
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(
            f"rank {rank} was interrupted while loading the save",
            path=where,
            fix="The load did not finish on every rank; start the job again.",
        )
    return CkptError(
        f"loading the save failed on rank {rank}: {type(error).__name__}: {error}",
        path=where,
        fix=REPORT_BUG,
    )


class _RemovedWhileLoading(IOFailure):
    """A file of the chosen save vanished while it was loaded (`_removed_while_loading`):
    `load_latest` chooses again, on every rank alike (the error reaches each rank, its
    attributes with it)."""

    #: the step whose save was removed
    step: int = -1


def _removed_while_loading(lost: FileNotFoundError, choice: Choice) -> _RemovedWhileLoading:
    """A file of the chosen save vanished after it was chosen and verified: another process
    removed it (the retention of the Checkpointer training this run, once a newer save was
    published), not a save that does not fit `into`."""
    error = _RemovedWhileLoading(
        f"step {choice.step} was removed while it was being loaded ({lost.filename or lost} is "
        "gone): the retention of a Checkpointer writing this run folder (keep_last) may have "
        "deleted it once a newer save was published",
        path=choice.path,
        fix="Call load_latest again: it takes the newest complete save. A process that reads "
        "a run another one trains should load a copy it owns (`ckpt latest RUN` names the "
        "newest save) or run while no save is published.",
    )
    error.step = choice.step
    return error


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def _lost_fix(timeout: timedelta) -> str:
    return (
        "A rank that stops answering died or stalled (a hung disk or file system, a stopped "
        "process: its own log says which); the Checkpointer's ranks are out of step and it "
        "saves no more in this job: restart the job, and `load_latest` resumes from the newest "
        f"complete save. If that rank was only slow, raise Checkpointer(timeout=...) (now "
        f"{_seconds(timeout)})."
    )


class _RollCall:
    """After its own write, every rank reports to rank 0, which waits at most `timeout` for
    each and names the ranks that did not answer (a hung disk, a dead process): DCP's own
    gather would wait the group's whole timeout and then say only that a connection closed."""

    def __init__(self, group: Any, rank: int, world_size: int, timeout: timedelta) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    def missing(self) -> list[int] | None:
        """Rank 0: the ranks that did not report in time; the others: None once reported,
        [0] when rank 0 could not be reached."""
        if self.rank != 0:
            try:
                dist.send(torch.tensor([self.rank], dtype=torch.int32), dst=0, group=self.group)
            except RuntimeError:
                return [0]
            return None
        boxes = {r: torch.zeros(1, dtype=torch.int32) for r in range(1, self.world_size)}
        works = {r: dist.irecv(box, src=r, group=self.group) for r, box in boxes.items()}
        deadline = time.monotonic() + self.timeout.total_seconds()
        missing = []
        for r, work in works.items():
            assert work is not None  # every rank is in the group
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:  # gloo's timeout, or the peer's closed connection
                missing.append(r)
        return missing


#: the agreements of the ranks (`Checkpointer._meet`), and what each rank does at each
_WAITING, _STAGED, _LOADING = 1, 2, 3
_MEETINGS = {
    _WAITING: "waiting for the save in flight",
    _STAGED: "agreeing its copy of the state",
    _LOADING: "waiting to choose the save to load",
}


class _OutOfStep(UsageError):
    """The ranks' `save` calls reached different agreements (`Checkpointer._meet`)."""


#: what rank 0 sends the waiting ranks while it works alone (never an outcome or a choice)
_BEAT = ("ckpt-heartbeat",)


class _Heartbeat:
    """The progress of what rank 0 does alone while the other ranks wait for it (a save's
    checksum and parity pass; the verification of the save `load_latest` chose), which tells
    them it is alive: a beat at most every quarter of the timeout (from the hashing threads,
    one at a time). Their wait is then bounded by the timeout however long the pass takes,
    and a rank 0 that stops answering is still noticed. `steady` beats on a clock instead,
    for the object store's listings and pulls, which report no progress of their own."""

    def __init__(self, beat: Callable[[], object], timeout: timedelta) -> None:
        self._beat = beat
        self._every = timeout.total_seconds() / 4
        self._last = time.monotonic()
        self._lock = threading.Lock()

    @contextmanager
    def steady(self) -> Iterator[None]:
        """Beat every quarter of the timeout while the block runs, from a thread of its own:
        around rank 0's listing of the object store and its pull of a save, whose requests
        report no progress (each is bounded by the store client's own timeouts and retries).
        A beat that fails (the other ranks are gone) is raised here once the block is over."""
        stop = threading.Event()
        failed: list[BaseException] = []

        def beat_until_stopped() -> None:
            while not stop.wait(self._every):
                try:
                    self._maybe()
                except BaseException as error:  # raised in the caller's thread, below
                    failed.append(error)
                    return

        ticker = threading.Thread(target=beat_until_stopped, name="ckpt-heartbeat", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
        if failed:
            raise failed[0]

    def _maybe(self) -> None:
        with self._lock:
            if time.monotonic() - self._last < self._every:
                return
            self._beat()
            self._last = time.monotonic()

    def start(self, total: int, description: str) -> None:
        self._maybe()

    def advance(self, amount: int) -> None:
        self._maybe()

    def finish(self) -> None:
        self._maybe()


class _Writer(FileSystemWriter):
    """DCP's file-system writer, with the test pause point before the commit marker, and
    (under torchrun) the roll call after every rank's write."""

    def __init__(self, path: Path, step: int, roll_call: _RollCall | None = None) -> None:
        super().__init__(str(path), sync_files=True)
        self.step = step
        self.roll_call = roll_call
        #: the ranks the roll call missed (None: every rank answered, or no roll call)
        self.missing: list[int] | None = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            future = super().write_data(plan, planner)
            future.wait()  # this rank's data is on disk (or its error is raised) before it reports
        finally:
            # every rank takes part, its own write failed or not: the others wait for it
            if self.roll_call is not None:
                missing = self.roll_call.missing()
                self.missing = missing or None
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        # runs on the coordinator once every rank's data files are written
        pause_point("write", self.step)
        super().finish(metadata, results)


class Checkpointer:
    """Saves a training loop's state in the background, and resumes it from the newest save.

    Args:
        run_dir: the local run folder; each save is the DCP folder `run_dir/step-N`.
        format: `dcp` (the one format written).
        keep_last: keep the newest N complete saves (locally and in the object store).
        keep_every: also keep the saves whose step is a multiple of K.
        upload: an object-store prefix (`s3://bucket/run`) every save is uploaded to.
        protect: parity shares written into each save (`ckpt protect`; 0 for none).
        checksums: the hash algorithm of the `ckpt-manifest.json` written into each save
            (`xxh3`, `blake3`, `sha256`), or None for no manifest.
        on_busy: what `save` does while the previous save is still in flight: `wait` for it,
            or `skip` this one (logged, and counted in `status()`).
        verify: what `load_latest` checks before loading: `checksums` (the manifest or parity
            when the save has one, else the structure), `structure`, or `none`.
        logger: where progress and failures go (default `logging.getLogger("ckpt_cli.checkpointer")`).
        pin_memory: pin the host staging buffer (default: when CUDA is available).
        timeout: under torchrun, the longest one rank waits for the others (seconds or a
            `timedelta`; 10 minutes by default): it must cover a rank's write of its shards and,
            in `load_latest`, rank 0's pull of a save from the object store, which the others
            wait for (its checksum passes, in a save and before a load, tell them it is alive).
            Past it the save fails naming the rank that did not answer, nothing of it
            published, and every later `save` raises `IOFailure` (the ranks are out of step:
            restart the job).

    Under torchrun (a process group initialised), construct it on every rank at the same
    point: it creates two gloo process groups of its own, one for the background writes and
    one for the decisions the ranks take together. The run folder must be on a file system
    every rank sees (as DCP's `FileSystemWriter` needs).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        format: str = "dcp",
        keep_last: int | None = None,
        keep_every: int | None = None,
        upload: str | None = None,
        protect: int = 0,
        checksums: str | None = "xxh3",
        on_busy: OnBusy = "wait",
        verify: Checks = "checksums",
        logger: logging.Logger | None = None,
        pin_memory: bool | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        from ..ops.prune.retention import PrunePolicy
        from ..storage.hashing import ALGORITHMS

        if format != SAVE_FORMAT:
            raise UsageError(
                f"the Checkpointer writes DCP folders; format {format!r} is not supported",
                fix='Use format="dcp"; `ckpt convert` turns a save into safetensors afterwards.',
            )
        if on_busy not in ("wait", "skip"):
            raise UsageError(
                f'on_busy must be "wait" or "skip" (got {on_busy!r})',
                fix='Pass on_busy="wait" (the default) or on_busy="skip".',
            )
        if verify not in ("checksums", "structure", "none"):
            raise UsageError(
                f'verify must be "checksums", "structure" or "none" (got {verify!r})',
                fix='Pass one of verify="checksums", "structure" or "none".',
            )
        if checksums is not None and checksums not in ALGORITHMS:
            raise UsageError(
                f"unknown checksum algorithm {checksums!r}",
                fix=f"Use one of {', '.join(ALGORITHMS)}.",
            )
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and value < 1:
                raise UsageError(
                    f"{name} must be at least 1 (got {value})",
                    fix=f"Pass {name}=1 or more, or None to keep every save.",
                )
        if not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise UsageError(
                    f"timeout must be seconds or a timedelta (got {timeout!r})",
                    fix="Pass e.g. timeout=600 or timeout=datetime.timedelta(minutes=10).",
                )
            timeout = timedelta(seconds=timeout)
        if not timeout.total_seconds() > 0:
            raise UsageError(
                f"timeout must be positive (got {timeout.total_seconds():g} s)",
                fix="Pass the longest a rank may wait for the others, e.g. timeout=600.",
            )
        if protect < 0:
            raise UsageError(
                f"protect must be 0 or more parity shares (got {protect})",
                fix="Pass protect=0 (no parity) or the number of parity shares, e.g. 2.",
            )
        if upload is not None:
            if not is_remote(upload) or is_hub_url(upload):
                raise UsageError(
                    "upload must be an object-store prefix",
                    path=upload,
                    fix="Pass e.g. upload='s3://bucket/runs/exp1'.",
                )
            upload = upload.rstrip("/")
        self.run_dir = Path(run_dir).absolute()
        self.upload = upload
        self.protect = protect
        self.checksums = checksums
        self.on_busy: OnBusy = on_busy
        self.verify: Checks = verify
        self.timeout = timeout
        self.log = logger or logging.getLogger("ckpt_cli.checkpointer")
        self.policy: PrunePolicy | None = None
        if keep_last or keep_every:
            # this checkpointer is the run's one writer and judges its own saves: no settle
            # window; interrupted saves older than the newest complete one are cleaned too
            self.policy = PrunePolicy(
                keep_last=keep_last, keep_every=keep_every, incomplete=True, settle=0.0
            )
        self._distributed = (
            dist.is_available() and dist.is_initialized() and (dist.get_world_size() > 1)
        )
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        # the background writes and the main thread's agreements each get a group of their
        # own: collectives of two threads must never share one (nor the training's); each
        # with the Checkpointer's timeout, not torch's 30 minutes for a new group
        self._write_group: Any = None
        self._control_group: Any = None
        if self._distributed:
            self._write_group = dist.new_group(backend="gloo", timeout=timeout)
            self._control_group = dist.new_group(backend="gloo", timeout=timeout)
        #: why this checkpointer's ranks are out of step (a collective failed): it saves no more
        self._lost: IOFailure | None = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only or full disk: the library's own error (exit 74)
            raise io_failure(exc, self.run_dir, "creating the run folder") from None
        self._staging = HostStaging(pin_memory=pin_memory, logger=self.log)
        self._lock = threading.Lock()
        #: held by `save` from its check for a save in flight to the start of its own
        self._saving = threading.Lock()
        #: the thread inside `save` (holding `_saving`), and whether that save has begun to
        #: stage its state (before, it only waits for the save in flight)
        self._save_thread: int | None = None
        self._save_staging = False
        self._thread: threading.Thread | None = None
        self._current: SaveRecord | None = None
        self._last: SaveRecord | None = None
        self._complete_step: int | None = None
        self._uploaded_step: int | None = None
        #: the step `load_latest` resumed from: retention keeps it until a later step is saved
        self._resumed_step: int | None = None
        self._saves = self._skipped = self._failures = 0
        self._last_error: str | None = None
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------------ public

    def save(self, step: int, state: Mapping[str, Any]) -> SaveRecord:
        """Save `state` as step `step`: blocks while it is copied into host memory only.

        The write, fsync, manifest, parity, publish, retention and upload run in a background
        thread. While the previous save is still in flight, this one waits for it or is
        skipped (`on_busy`), and says so in the log and the returned record. Calls from
        several threads are taken one at a time, each then waiting or skipped the same way
        (they would otherwise share the staging buffer). Failures of the
        background work never raise here: they are logged and reported by `status()` and by
        the record `wait()` returns. Under torchrun the ranks agree that each staged its
        state before any writes: a rank whose state cannot be staged raises here, and the
        others save nothing of that step (their record is `failed`, naming that rank); ranks
        that pass different steps all raise `UsageError`, and nothing is written; ranks whose
        calls reach different agreements (a signal handler's `save` that interrupted another
        on one rank) all return a `failed` record saying so, and stay in step.
        """
        if self._closed:
            raise UsageError(
                "the Checkpointer is closed",
                fix="Make a new Checkpointer to save again.",
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(
                f"step must be a non-negative int (got {step!r})",
                fix="Pass the training step as an int, e.g. save(step=1000, state=...).",
            )
        if self._save_thread == threading.get_ident():
            return self._reentered(step, state)
        with self._saving:  # one save at a time: two threads would share the staging buffer
            self._save_thread, self._save_staging = threading.get_ident(), False
            try:
                return self._save(step, state)
            finally:
                self._save_thread = None

    def _reentered(self, step: int, state: Mapping[str, Any]) -> SaveRecord:
        """`save` called by this thread inside its own `save`: a signal handler's (the
        preemption pattern: SIGTERM, save, exit) that interrupted the loop's. Waiting for the
        lock would wait for this very thread: a hang. While the interrupted save only waits for
        the one in flight it has touched nothing, so this one runs (the interrupted one then
        waits for it in turn); once it stages, two saves would share the staging buffer."""
        if self._save_staging:
            raise UsageError(
                f"save of step {step} was called while this thread was copying the state of "
                "another save (from a signal handler?): it would overwrite that save's copy",
                path=self.run_dir,
                fix="Save from the training loop (a handler can set a flag the loop checks), or "
                "call wait() in the handler: the save under way is published.",
            )
        try:
            return self._save(step, state)
        finally:
            self._save_staging = False

    def _save(self, step: int, state: Mapping[str, Any]) -> SaveRecord:
        start = time.perf_counter()
        record = SaveRecord(step=step, name=f"step-{step}")
        lost = self._lost
        if lost is not None:  # no collective: the ranks are out of step (see `_lose`)
            raise IOFailure(
                f"step {step} cannot be saved: {lost.problem}", path=lost.path, fix=lost.fix
            )
        try:
            return self._agree_and_stage(step, state, record, start)
        except _OutOfStep as error:  # every rank gives this save up alike (`_meet`)
            return self._failed(record, str(error), start)

    def _failed(self, record: SaveRecord, error: str, start: float) -> SaveRecord:
        """`record` as a save every rank gave up (`error`, logged), counted as a failure."""
        record.phase = "failed"
        record.error = error
        record.blocked_seconds = time.perf_counter() - start
        self.log.error("save of step %d failed: %s", record.step, error)
        with self._lock:
            self._saves += 1
            self._failures += 1
            self._last_error = error
            self._last = record
        return record

    def _agree_and_stage(
        self, step: int, state: Mapping[str, Any], record: SaveRecord, start: float
    ) -> SaveRecord:
        """The part of `save` in the caller's thread: the ranks agree, the state is staged,
        the background write starts."""
        if self._busy(f"the save of step {step} was agreed on", _WAITING, step):
            in_flight = self._current
            what = f"step {in_flight.step}" if in_flight is not None else "a save on another rank"
            if self.on_busy == "skip":
                record.phase = "skipped"
                record.error = f"{what} was still being saved"
                self.log.warning("save of step %d skipped: %s is still in flight", step, what)
                with self._lock:
                    self._skipped += 1
                    self._last = record
                record.blocked_seconds = time.perf_counter() - start
                return record
            self.log.info("save of step %d waits for %s", step, what)
            # (a signal handler's save may start meanwhile, `_reentered`: it is waited for too)
            self._wait_everywhere(f"the save of step {step} was agreed on", _WAITING, step)
            record.waited_seconds = time.perf_counter() - start
        self._save_staging = True
        staged_from = time.perf_counter()
        try:
            items = entries(state)
            staged, nbytes = self._staging.stage(capture(items, self.rank, self.world_size, step))
        except BaseException:
            # the other ranks must not start a write this rank will never join: theirs would
            # wait for it, and take its next save's collectives for this one's (a torn save)
            with suppress(_OutOfStep):  # this rank's own failure is the one to raise
                self._ranks_not_staged(False, step)
            raise
        failed, steps = self._ranks_not_staged(True, step)
        record.stage_seconds = time.perf_counter() - staged_from
        if not failed and len(set(steps)) > 1:
            # one folder for two steps would mix them, and each rank would report its own
            # step's folder saved; every rank raises, so none waits for the others
            told = ", ".join(f"rank {rank}: {saved}" for rank, saved in enumerate(steps))
            raise UsageError(
                f"the ranks called save with different steps ({told}): no rank saved any",
                path=self.run_dir,
                fix="Pass every rank the same step: under torchrun save is collective, called "
                "at the same point of the loop on every rank.",
            )
        if failed:
            which = ", ".join(map(str, failed))
            return self._failed(
                record,
                f"rank {which} could not stage step {step}: no rank saved it (that rank's save "
                "raised; its error is in its log or its training loop)",
                start,
            )
        record.bytes = nbytes
        record.blocked_seconds = time.perf_counter() - start
        self.log.info(
            "step %d staged: %.1f MiB in %.3f s; writing in the background",
            step,
            nbytes / 2**20,
            record.stage_seconds,
        )
        with self._lock:
            self._current = record
            self._saves += 1
        thread = threading.Thread(
            target=self._background, args=(record, staged), name=f"ckpt-save-{step}"
        )
        with self._lock:
            self._thread = thread
        thread.start()
        return record

    def wait(self) -> SaveRecord | None:
        """Wait for the save in flight; the newest finished record (None before any save)."""
        self._join()
        with self._lock:
            return self._last.model_copy(deep=True) if self._last is not None else None

    def status(self) -> CheckpointerStatus:
        """A snapshot of where the saves stand (safe to call from any thread)."""
        with self._lock:
            return CheckpointerStatus(
                run_dir=str(self.run_dir),
                upload=self.upload,
                rank=self.rank,
                world_size=self.world_size,
                in_flight=self._current.model_copy(deep=True) if self._current else None,
                last=self._last.model_copy(deep=True) if self._last else None,
                last_complete_step=self._complete_step,
                last_uploaded_step=self._uploaded_step,
                saves=self._saves,
                skipped=self._skipped,
                failures=self._failures,
                last_error=self._last_error,
                staging_bytes=self._staging.nbytes,
            )

    def load_latest(self, into: MutableMapping[str, Any]) -> LoadedCheckpoint | None:
        """Load the newest complete, verified save of either tier into `into`; None if neither
        tier holds a save. A local save that is damaged (fails its checks, or lost a file) and
        carries parity (`protect=`) is rebuilt from it first, as `ckpt repair` does
        (`LoadedCheckpoint.repaired`). Saves that are there but cannot be loaded (each failed
        its checks, or the store could not be read with none on this machine) raise a
        `CkptError` naming them: taking that for "no save" would start the run over.

        Models, optimizers and other Stateful objects of `into` are loaded in place; the plain
        entries (RNG states, counters) are replaced in `into` by the loaded values and also
        returned in `LoadedCheckpoint.state`. Under torchrun rank 0 chooses the save (and
        pulls it from the object store if need be) and every rank loads its own shards; after
        `close()` (which released the process groups the ranks agree through) it raises
        `UsageError` on every rank, before any collective.
        """
        if self._closed and self._distributed:
            # each rank closed its own groups: none may wait for the others through them
            raise UsageError(
                f"rank {self.rank} of {self.world_size}: load_latest was called after close(); "
                "the Checkpointer is closed and its process groups are released",
                path=self.run_dir,
                fix="Call load_latest before close(), or make a new Checkpointer on every rank "
                "(at the same point: its construction is collective) and load with it.",
            )
        vanished: int | None = None
        for _ in range(RESCANS):
            try:
                return self._load_newest(into, vanished)
            except _RemovedWhileLoading as gone:
                # the training's retention removed the save once it published a newer one:
                # every rank raised this alike, so every rank chooses again alike
                vanished = gone.step
                self.log.info("%s: choosing the save to load again", gone.problem)
        return self._load_newest(into, vanished)

    def _load_newest(
        self, into: MutableMapping[str, Any], vanished: int | None
    ) -> LoadedCheckpoint | None:
        """One choice and load for `load_latest`; `vanished`: the step of a save removed while
        it was loaded, so a choice older than it is refused (a save removed while being loaded
        gives way to a newer one, never silently to an older one)."""
        self._wait_everywhere("the save to load was chosen", _LOADING)
        items = entries(into)
        choice: Choice | None = None
        failure: CkptError | None = None
        if self.rank == 0:
            try:
                # the other ranks wait for the choice meanwhile (`_tell_ranks`)
                if self._distributed:
                    beat = _Heartbeat(lambda: self._tell_ranks(_BEAT, None), self.timeout)
                    choice = choose(
                        self.run_dir,
                        self.upload,
                        self.verify,
                        self.log,
                        beat,
                        beat.steady,
                        algo=self.checksums or DEFAULT_ALGO,
                    )
                else:
                    choice = choose(
                        self.run_dir,
                        self.upload,
                        self.verify,
                        self.log,
                        algo=self.checksums or DEFAULT_ALGO,
                    )
            except BaseException as error:
                if not self._distributed:
                    raise
                # every rank raises the same error (its class and exit code: a damaged run is
                # no disk fault); rank 0 its own, with its traceback
                self._tell_ranks(None, _for_other_ranks(error, self.run_dir))
                raise
        if self._distributed:
            choice, failure = self._tell_ranks(choice, None)
        if failure is not None:
            raise failure
        if vanished is not None and (choice is None or choice.step < vanished):
            removed = self.run_dir / f"step-{vanished}"
            # (the same words as the first time: no newer save took its place)
            lost = FileNotFoundError(errno.ENOENT, "gone", str(removed))
            said = _removed_while_loading(lost, Choice(str(removed), vanished, "local"))
            # a plain IOFailure: `load_latest` chooses no more (it would choose the same)
            raise IOFailure(said.problem, path=said.path, fix=said.fix)
        if choice is None:
            self.log.info("no complete checkpoint in %s%s", self.run_dir, self._remote_note())
            return None
        reader = FileSystemReader(choice.path)
        try:
            try:
                metadata = reader.read_metadata()
                template = load_template(items, metadata, choice.path, self.rank)
            except FileNotFoundError as lost:
                raise _removed_while_loading(lost, choice) from lost
        except BaseException as error:
            self._load_failed(error, choice)
            raise
        self._load_failed(None, choice)
        try:
            if self._distributed:
                with self._together("the save was loaded", Path(choice.path)):
                    dcp_load(template, storage_reader=reader, process_group=self._control_group)
            else:
                dcp_load(template, storage_reader=reader, no_dist=True)
        except CheckpointException as error:  # a BaseException: it would pass `except Exception`
            gone = next((c for c in _causes(error) if isinstance(c, FileNotFoundError)), None)
            if gone is not None:
                raise _removed_while_loading(gone, choice) from error
            raise FormatError(
                f"step {choice.step} does not fit the state of `into`: {_first_failure(error)}",
                path=choice.path,
                fix="Build the models and optimizers of `into` as the run that saved it did "
                "(same shapes, same optimizer settings, the scheduler created as then), or drop "
                "the entry that differs from `into`.",
            ) from error
        try:
            restored = rebuild(items, template, metadata, self.rank, choice.path)
        except BaseException as error:
            self._load_failed(error, choice)
            raise
        self._load_failed(None, choice)
        values = apply(items, restored)
        self._resumed_step = choice.step
        for key, value in values.items():
            into[key] = value
        self.log.info(
            "loaded step %d from %s (%s tier; checks: %s)",
            choice.step,
            choice.path,
            choice.tier,
            ", ".join(choice.verified) or "none",
        )
        return LoadedCheckpoint(
            step=choice.step,
            path=choice.path,
            tier=choice.tier,
            verified=choice.verified,
            skipped=choice.skipped,
            repaired=choice.repaired,
            state=values,
        )

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffer (and, under torchrun,
        the Checkpointer's process groups: it neither saves nor loads afterwards)."""
        if self._closed:
            return
        self._join()
        self._closed = True
        self._staging = HostStaging(pin_memory=self._staging.pin_memory, logger=self.log)
        if self._distributed:
            for group in (self._write_group, self._control_group):
                dist.destroy_process_group(group)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the main thread

    def _remote_note(self) -> str:
        return f" nor in {self.upload}" if self.upload else ""

    def _load_failed(self, error: BaseException | None, choice: Choice) -> None:
        """Collective under torchrun: when any rank could not load its part of the save (a
        value saved for no rank of its number: a resume on more ranks), every rank raises the
        first failing rank's error (before `dcp.load`, or before `into` is handed its values);
        a rank that failed alone left the others waiting in `dcp.load` for it until it exited
        (then failing with gloo's "Connection closed by peer"), or training on without it."""
        if not self._distributed:
            return
        mine = None if error is None else _for_other_ranks(error, Path(choice.path), self.rank)
        everyone: list[Any] = [None] * self.world_size
        with self._together("the save was loaded", Path(choice.path)):
            dist.all_gather_object(everyone, mine, group=self._control_group)
        failed = [(rank, failure) for rank, failure in enumerate(everyone) if failure is not None]
        if error is None and failed:
            raise failed[0][1]

    def _tell_ranks(
        self, choice: Choice | tuple[str] | None, failure: CkptError | None
    ) -> tuple[Choice | None, CkptError | None]:
        """Rank 0's choice of the save to load (or its failure), on every rank; the other
        ranks wait out rank 0's heartbeats (`_BEAT`, sent while it verifies the save)."""
        while True:
            shared: list[Any] = [choice, failure]
            with self._together("the save to load was chosen", self.run_dir):
                dist.broadcast_object_list(shared, src=0, group=self._control_group)
            if self.rank == 0 or shared[0] != _BEAT:
                return shared[0], shared[1]

    def _wait_everywhere(self, doing: str, meeting: int = _WAITING, step: int = -1) -> None:
        """Wait until no rank has a save in flight. Each rank waits for its own, and the ranks
        agree every quarter of the timeout whether any is still busy: rank 0's work after a
        publish (retention, the upload) may outlast the timeout, which a rank done at once,
        waiting for it in one collective, would take for a lost rank. `meeting` and `step`:
        what this rank's agreements are for (`_meet`)."""
        if not self._distributed:
            while self._thread is not None:  # (one a signal handler started meanwhile too)
                self._join()
            return
        every = self.timeout.total_seconds() / 4
        while True:
            with self._lock:
                thread = self._thread
            if thread is not None:
                thread.join(every)
                if not thread.is_alive():
                    with self._lock:
                        if self._thread is thread:
                            self._thread = None
            if not self._busy(doing, meeting, step):
                return

    def _busy(self, doing: str, meeting: int = _WAITING, step: int = -1) -> bool:
        """Whether a save is in flight here (or, under torchrun, on any rank: they agree)."""
        mine = self._thread is not None and self._thread.is_alive()
        if not self._distributed:
            return mine
        return any(flag for _, flag in self._meet(meeting, step, 1 if mine else 0, doing))

    def _ranks_not_staged(self, staged: bool, step: int) -> tuple[list[int], list[int]]:
        """The ranks whose `save` could not stage the state (under torchrun; [] alone), and
        the step each rank's `save` was called with."""
        if not self._distributed:
            return [], [step]
        met = self._meet(
            _STAGED, step, 0 if staged else 1, f"the save of step {step} was agreed on"
        )
        failed = [rank for rank, (_, flag) in enumerate(met) if flag]
        return failed, [saved for saved, _ in met]

    def _meet(self, meeting: int, step: int, flag: int, doing: str) -> list[tuple[int, int]]:
        """One agreement of the ranks' `save` (or `load_latest`): every rank's (step, flag).

        Every agreement is the same collective (an all_gather of the meeting, the step and
        the flag), so ranks that reach different ones (a `save` called from a signal handler
        on one rank interrupted that rank's own save between two agreements, while another
        rank's signal came before its save began) see it, all of them in the same
        collective: each raises `_OutOfStep` (the same words on every rank), and they are
        still in step. Two different collectives would have met instead (gloo's failure, or a
        wait until the timeout: the ranks lost for good)."""
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([meeting, step, flag], dtype=torch.int64)
        with self._together(doing, self.run_dir):
            dist.all_gather(rows, mine, group=self._control_group)
        met = [(int(row[0].item()), int(row[1].item()), int(row[2].item())) for row in rows]
        if len({point for point, _, _ in met}) > 1:
            told = "; ".join(
                f"rank {rank}: {_MEETINGS.get(point, 'elsewhere')}"
                + (f" (step {at})" if at >= 0 else "")
                for rank, (point, at, _) in enumerate(met)
            )
            steps = sorted({at for _, at, _ in met if at >= 0})
            lost = (
                f"no rank saved step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
                if steps
                else "nothing was saved or loaded"
            )
            raise _OutOfStep(
                f"the ranks' calls met out of step ({told}): they were not the same call on "
                "every rank (a save from a signal handler that interrupted another save on one "
                f"rank, or load_latest on one rank and save on another); {lost}",
                path=self.run_dir,
                fix="Under torchrun save from the training loop, at the same point on every "
                "rank: let the signal handler only set a flag, have the loop agree on it every "
                "step (an all_reduce of the flag), then save that step and exit on every rank.",
            )
        return [(at, flag) for _, at, flag in met]

    def _lose(self, who: str, doing: str, where: Path) -> IOFailure:
        """The error of ranks that lost each other (`who` did not answer while `doing`), kept:
        a collective that failed leaves the ranks out of step (one waits at a point the others
        left, its group's connection to them closed), so no collective of this checkpointer
        can be trusted again, and every later `save` raises it at once, waiting for nobody."""
        error = IOFailure(
            f"rank {self.rank} of {self.world_size}: {who} while {doing}",
            path=where,
            fix=_lost_fix(self.timeout),
        )
        with self._lock:
            if self._lost is None:
                self._lost = error
        return error

    @contextmanager
    def _together(self, doing: str, where: Path) -> Iterator[None]:
        """Around a collective: gloo's failure (the group's timeout passed, or a peer's
        connection closed) as the ranks lost each other (`_lose`); none once they have."""
        if self._lost is not None:
            raise self._lost
        try:
            yield
        except RuntimeError as exc:  # gloo's errors (torch's DistError is one)
            who = f"another rank did not answer within {_seconds(self.timeout)} or ended"
            raise self._lose(who, doing, where) from exc

    def _join(self) -> None:
        """Wait for the save in flight. Only that save is forgotten once it is over: a wait
        from another thread (a monitor's `wait()`) may end after this thread started the next
        save, which must stay the one in flight for `_busy` and `close`."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        thread.join()
        with self._lock:
            if self._thread is thread:
                self._thread = None

    # ------------------------------------------------------------------ the background thread

    def _background(self, record: SaveRecord, staged: dict[str, Any]) -> None:
        try:
            if self.rank == 0:
                self._write_as_leader(record, staged)
            else:
                self._write_as_follower(record, staged)
            del staged  # the staging buffers stay; this tree of references to them goes
            if self.rank == 0:
                self._retain(record)
                if self.upload is not None:
                    self._upload(record)
            record.phase = "done"
            self.log.info("step %d saved: %s", record.step, record.remote or record.path)
        except BaseException as exc:  # a failed save must never take the training down
            record.phase = "failed"
            record.error, expected = self._failure(exc, record)
            self.log.error(
                "save of step %d failed: %s",
                record.step,
                record.error,
                exc_info=not expected,  # a traceback only for what may be a bug
            )
            with self._lock:
                self._failures += 1
                self._last_error = record.error
        finally:
            with self._lock:
                self._last = record
                self._current = None

    def _failure(self, exc: BaseException, record: SaveRecord) -> tuple[str, bool]:
        """One line for a failed save: ckpt's own message, a full disk said as such (DCP
        reports it as a traceback of the zip writer, `unexpected pos 704 vs 598`), else the
        innermost cause; and whether the failure is an expected one (ckpt's own, or the
        operating system's), which needs no traceback."""
        causes = _causes(exc)
        if isinstance(exc, CkptError) and (record.path is not None or not _out_of_space(causes)):
            # (a full disk before the publish, in the manifest or the parity, is said as one
            # below; once published, the failure is the upload's, which says so itself)
            return str(exc), True
        writing = f"writing step {record.step}"
        ranks = _failed_ranks(causes) if self._distributed else []
        if ranks:  # DCP hands every rank the failures of all: say whose write failed
            label = "rank" if len(ranks) == 1 else "ranks"
            whose = "its" if len(ranks) == 1 else "their"
            files = ", ".join(f"__{rank}_*.distcp" for rank in ranks)
            writing = (
                f"{label} {', '.join(map(str, ranks))} of {self.world_size}: writing {whose} "
                f"part of step {record.step} ({files})"
            )
        try:
            free: int | None = shutil.disk_usage(self.run_dir).free
        except OSError:
            free = None
        if _out_of_space(causes) or (free is not None and free < record.bytes):
            room = f" ({free / 2**20:.1f} MiB free" if free is not None else " ("
            # (its checksum manifest and parity take more: the tensors are what is known)
            needs = ""
            keep_last = self.policy.keep_last if self.policy is not None else None
            if keep_last is not None:
                # the oldest save goes only once the new one is whole: a crash meanwhile must
                # leave a complete save, so retention never makes room for the save it follows
                needs = (
                    f"; retention (keep_last={keep_last}) removes an old save only once the "
                    f"new one is published, so the disk needs room for {keep_last + 1} saves"
                )
            return (
                f"{writing} failed: no space left on the device{room}, "
                f"the save holds {record.bytes / 2**20:.1f} MiB of tensors){needs}; check free "
                f"space at {self.run_dir}"
            ), True
        cause = causes[-1]
        if isinstance(cause, OSError):  # the file (or the run folder), the errno and a fix
            inside = self._in_staging(cause.filename, record)
            if inside is None:
                return io_failure(cause, self.run_dir, writing).message, True
            # the staging folder was removed with the failure: the save's own name is the
            # path, and the file is named inside it (rank R's files are named already)
            unnamed = OSError(cause.errno, cause.strerror or str(cause))
            doing = writing if ranks else f"{writing} ({inside})"
            return io_failure(unnamed, self.run_dir / record.name, doing).message, True
        return f"{writing} failed: {type(cause).__name__}: {cause}", any(
            isinstance(c, OSError) for c in causes
        )

    def _in_staging(self, filename: Any, record: SaveRecord) -> str | None:
        """`filename`'s path inside the staging folder of `record`'s save (`__0_0.distcp`), or
        None when it is not in one."""
        if not isinstance(filename, str | Path):
            return None
        path = Path(filename)
        staging = f".{record.name}{TMP_MARKER}"
        for parent in path.parents:
            if parent.parent == self.run_dir and parent.name.startswith(staging):
                return path.relative_to(parent).as_posix()
        return None

    def _share(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (over the write group)."""
        if not self._distributed:
            return value
        box = [value]
        with self._together(self._saving_step(), self._save_dir()):
            dist.broadcast_object_list(box, src=0, group=self._write_group)
        return box[0]

    def _agree(self, ok: bool) -> bool:
        """Whether every rank's part went well."""
        if not self._distributed:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        with self._together(self._saving_step(), self._save_dir()):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._write_group)
        return not bool(flag.item())

    def _saving_step(self) -> str:
        """What the background thread is doing, for `_lose` (rank 0 publishes nothing before
        every rank has agreed; the others cannot tell how far rank 0 got)."""
        record = self._current
        step = f"step {record.step}" if record is not None else "a step"
        if self.rank == 0:
            return f"{step} was being saved: nothing of it was published"
        return (
            f"{step} was being saved: it may not be published (`ckpt latest {self.run_dir}` "
            "names the newest complete save)"
        )

    def _save_dir(self) -> Path:
        record = self._current
        return self.run_dir / record.name if record is not None else self.run_dir

    def _write(self, staging: Path, staged: dict[str, Any], record: SaveRecord) -> None:
        """Every rank writes its shards into the staging folder; rank 0 writes `.metadata`
        last, once all ranks' data is there (DCP gathers the write results first)."""
        record.phase = "writing"
        started = time.perf_counter()
        if not self._distributed:
            dcp_save(staged, storage_writer=_Writer(staging, record.step), no_dist=True)
            record.write_seconds = time.perf_counter() - started
            return
        if self._lost is not None:
            raise self._lost
        roll_call = _RollCall(self._write_group, self.rank, self.world_size, self.timeout)
        writer = _Writer(staging, record.step, roll_call)
        try:
            dcp_save(staged, storage_writer=writer, process_group=self._write_group)
        except RuntimeError as exc:  # not a rank's failed write (a CheckpointException): gloo's
            raise self._lose(
                self._who(writer.missing), self._saving_step(), self._save_dir()
            ) from exc
        if writer.missing is not None:
            raise self._lose(self._who(writer.missing), self._saving_step(), self._save_dir())
        record.write_seconds = time.perf_counter() - started

    def _who(self, missing: list[int] | None) -> str:
        """The ranks the roll call missed, in words."""
        waited = _seconds(self.timeout)
        if not missing:
            return f"another rank did not answer within {waited} or ended"
        if self.rank != 0:
            return f"rank 0 could not be reached (it ended, or stopped waiting for this rank after {waited})"
        label = "rank" if len(missing) == 1 else "ranks"
        return f"{label} {', '.join(map(str, missing))} did not answer within {waited}"

    def _write_as_leader(self, record: SaveRecord, staged: dict[str, Any]) -> None:
        """Stage, write, seal and publish `run_dir/step-N`; tell the other ranks how it went.

        The sequence of collectives is the same on every rank whatever fails: the staging
        folder (or None), whether every rank wrote its part, and the outcome.
        """
        dest = self.run_dir / record.name
        shared = False
        outcome: BaseException | None = None
        try:
            with staged_output(dest, commit_marker=is_commit_marker, force=True) as staging:
                self._share(str(staging))
                shared = True
                error: BaseException | None = None
                try:
                    self._write(staging, staged, record)
                except BaseException as exc:
                    error = exc
                everyone = self._agree(error is None)
                if error is not None:
                    raise error
                if not everyone:
                    raise IOFailure(
                        f"another rank failed to write its part of step {record.step}; "
                        "nothing was published",
                        path=dest,
                        fix="Its error is in that rank's log.",
                    )
                self._seal(staging, record)
        except BaseException as exc:
            if not shared and self._lost is None:
                self._share(None)
                self._agree(False)
            outcome = exc
        else:
            record.path = str(dest)
            with self._lock:
                self._complete_step = record.step
        if self._lost is not None:  # the ranks are out of step: no more collectives
            if outcome is not None:
                raise outcome
            return  # published (the main thread lost the ranks meanwhile: the next save says so)
        try:
            self._share(None if outcome is None else str(outcome))
        except IOFailure as lost:
            if outcome is None:  # published: the save is whole; the next one raises `lost`
                self.log.error("after step %d was published: %s", record.step, lost)
                return
            raise lost from outcome
        if outcome is not None:
            raise outcome

    def _write_as_follower(self, record: SaveRecord, staged: dict[str, Any]) -> None:
        staging = self._share(None)
        error: BaseException | None = None
        if staging is None:
            error = IOFailure(
                f"rank 0 could not stage step {record.step}",
                path=self.run_dir,
                fix="Its error is in rank 0's log.",
            )
        else:
            try:
                self._write(Path(staging), staged, record)
            except BaseException as exc:
                error = exc
        self._agree(error is None)
        outcome = self._share(None)
        while outcome == _BEAT:  # rank 0 is still sealing the save (`_Heartbeat`)
            outcome = self._share(None)
        if error is not None:
            raise error
        if outcome is not None:
            raise IOFailure(
                f"rank 0 did not publish step {record.step}: {outcome}",
                path=self.run_dir,
                fix="The step was not published: rank 0's error (in its log) says why and what to do.",
            )
        record.path = str(self.run_dir / record.name)
        with self._lock:
            self._complete_step = record.step

    def _seal(self, staging: Path, record: SaveRecord) -> None:
        """Rank 0, before the rename: the structural check (and manifest), then parity."""
        from ..ops.parity import protect
        from ..ops.verify.run import verify

        record.phase = "publishing"
        started = time.perf_counter()
        # the other ranks wait for the outcome meanwhile (`_write_as_follower`)
        progress: Progress = NULL_PROGRESS
        if self._distributed:
            progress = _Heartbeat(lambda: self._share(_BEAT), self.timeout)
        report = verify(
            str(staging),
            write_manifest=self.checksums is not None,
            algo=self.checksums,
            progress=progress,
        )
        if not report.ok:
            first = next(p for p in report.problems if p.severity == "error")
            fix = (
                "Save plain values (numbers, strings, lists, dicts, tensors, numpy arrays) or "
                "the object's state_dict(): load_latest refuses pickles that would run code."
                if first.code == "unloadable_object"
                else None
            )
            # the staging folder is removed with this failure: the save's own name is the
            # path, and the file the problem is in is named inside it
            where = Path(first.file) if first.file else staging
            inside = where.relative_to(staging).as_posix() if where.is_relative_to(staging) else ""
            raise FormatError(
                f"the save of step {record.step} failed its check and was not published: "
                + (f"{inside}: " if inside not in ("", ".") else "")
                + first.message,
                path=self.run_dir / record.name,
                fix=fix,
            )
        if self.protect:
            protect(str(staging), parity=self.protect, progress=progress)
        pause_point("publish", record.step)
        record.publish_seconds = time.perf_counter() - started

    def _retention(self, record: SaveRecord) -> PrunePolicy:
        """This checkpointer's policy (or, without one, the cleaning of interrupted saves only),
        with the save just written pinned, and the one `load_latest` resumed from while this
        run's saves have lower steps."""
        from ..ops.prune.retention import PrunePolicy

        policy = self.policy or PrunePolicy(incomplete=True, settle=0.0)
        pinned = {record.step}
        resumed = self._resumed_step
        if resumed is not None and resumed > record.step:  # not passed by this run's saves yet
            pinned.add(resumed)
        return policy.model_copy(update={"keep": sorted(pinned)})

    def _retain(self, record: SaveRecord) -> None:
        """Local retention after a publish: `ckpt prune`'s plan with this checkpointer's
        policy, over its own saves only (`step-N` and the staging folders of interrupted ones);
        the save just written and the one resumed from are never deleted."""
        from ..ops.prune.run import apply as delete_planned

        def delete(decisions: list[PruneDecision]) -> None:
            delete_planned(self.run_dir, decisions, 0.0)

        self._prune_own(record, self.run_dir, delete, warn_later=True)

    def _retain_remote(self, record: SaveRecord) -> None:
        """Retention in the object store after an upload, judged as on the local disk: the
        checkpointer's own saves only, never the other folders the run folder's upload sent."""
        from ..ops.prune.run import apply_remote

        assert self.upload is not None
        upload = self.upload

        def delete(decisions: list[PruneDecision]) -> None:
            apply_remote(upload, decisions)

        self._prune_own(record, upload, delete, warn_later=False)

    def _prune_own(
        self,
        record: SaveRecord,
        run_dir: Path | str,
        delete: Callable[[list[PruneDecision]], None],
        *,
        warn_later: bool,
    ) -> None:
        """`ckpt prune`'s plan over this checkpointer's own saves in `run_dir` (local or
        remote), carried out by `delete`; what it removed is added to `record.pruned`."""
        from ..ops.prune.retention import plan
        from ..ops.prune.run import VANISHED
        from ..sources.runs import scan_run

        policy = self._retention(record)
        run = scan_run(run_dir, settle=0.0)
        own = [c for c in run.checkpoints if _OWN_SAVE.fullmatch(c.name)]
        later = [c.name for c in own if c.complete and c.step is not None and c.step > record.step]
        if warn_later and later and self.policy is not None and self.policy.retains:
            self.log.warning(
                "the run folder holds saves of later steps than step %d (%s): retention counts "
                "them as the newest; remove them if this run replaces them",
                record.step,
                ", ".join(later),
            )
        decisions = plan(run.model_copy(update={"checkpoints": own}), policy)
        if self.policy is None:  # no retention: only the staging folders of interrupted saves go
            decisions = [d for d in decisions if d.name.startswith(".")]
        delete(decisions)
        remote = isinstance(run_dir, str)
        deleted = [d.name for d in decisions if d.deleted and d.action == "delete"]
        record.pruned.extend(f"{run_dir}/{name}" if remote else name for name in deleted)
        if deleted:
            self.log.info("retention removed %s from %s", ", ".join(deleted), run_dir)
        for d in decisions:
            if d.error is not None and d.error != VANISHED:
                self.log.warning("retention could not remove %s: %s", d.name, d.error)

    def _upload(self, record: SaveRecord) -> None:
        """`ckpt sync` the run folder to the object store: data first, `.metadata` after,
        the checksum manifest last; remote retention with the same policy."""
        from ..ops.sync import sync

        assert self.upload is not None
        record.phase = "uploading"
        started = time.perf_counter()
        prefix = f"{record.name}/"

        def on_file(rel: str, size: int) -> None:
            self.log.debug("uploaded %s (%d bytes)", rel, size)
            if rel.startswith(prefix):
                pause_point("upload", record.step)

        try:
            report = sync(str(self.run_dir), self.upload, settle=0.0, on_file=on_file)
        except CkptError as error:  # the object store could not be listed or reached
            raise IOFailure(
                f"step {record.step} is saved locally ({record.path}) but its upload failed: "
                f"{error.problem}",
                path=self.upload,
                fix=error.fix or "The next save uploads it again (sync resumes what is missing).",
            ) from error
        record.upload_seconds = time.perf_counter() - started
        if report.failed:
            raise IOFailure(
                f"step {record.step} is saved locally ({record.path}) but its upload failed: "
                + "; ".join(report.failed),
                path=self.upload,
                fix="The next save uploads it again (sync resumes what is missing).",
            )
        record.remote = f"{self.upload}/{record.name}"
        with self._lock:
            self._uploaded_step = record.step
        if self.policy is not None:  # only once the save is whole in the object store
            try:
                self._retain_remote(record)
            except CkptError as error:  # the save is uploaded: the next one prunes again
                self.log.warning("retention in %s failed: %s", self.upload, error)
