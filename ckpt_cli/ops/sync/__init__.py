"""`sync`: a run's complete checkpoints copied between a local run folder and an object store.

Up (`ckpt sync out/ s3://bucket/run/`): every *complete* checkpoint of the local run folder
(judged by `ckpt_cli.sources.runs`, so never one still being written, never an interrupted one) that
the destination does not hold yet is uploaded under its own name. The order inside one
checkpoint is the one ckpt's object-store writer uses (`output.publish_order`): data files
first, then the commit markers (`.metadata`, `*.index.json`, `trainer_state.json`), and last
the checksum manifest `ckpt-manifest.json` (the checkpoint's own when it has one, else one
computed while uploading; for a single-file checkpoint `NAME.ckpt-manifest.json` beside it).
The manifest is what makes a remote copy *synced*: a destination holds a checkpoint when its
manifest is there, every file has its local size, and no local file was modified after that
manifest was written (a save rewritten at the same size is synced again).

The data files of all the round's checkpoints share one pool of `jobs` uploads, oldest save
first: the next save's data is on its way while this one's markers and manifest follow it.

Verification: each file is read once and hashed on the way; a checkpoint that has a manifest
must match it (a corrupt local copy is never published), and each uploaded object must carry
the ETag S3 computes from the bytes it received (MD5, or the MD5 of the parts' MD5s for a
multipart upload). Against S3 that ETag is in the upload's own reply (one request a file,
no listing or HEAD after it: `storage.object_upload`); other fsspec stores are checked from
one listing of the checkpoint before its markers. Where a store reports no usable ETag the
object is read back and hashed.

Resume: a file whose object already exists with the same size and ETag (an earlier,
interrupted sync uploaded it) is not sent again; S3 creates an object only when its upload
completes, so a file cut midway is simply missing and sent whole.

Down (`ckpt sync s3://bucket/run/ out/ --latest`): the newest complete remote checkpoint (or
every one missing locally) is streamed into a hidden staging folder in the run folder (its
files `jobs` at once, largest first), hashed on the way and checked against its manifest, then published with one rename. The
staging folder (`.NAME.ckpt-tmp-pull`) outlives a pull cut short, and the next pull keeps
every file already whole in it: a pull resumes as an upload does.

`--watch` repeats rounds every interval; `--max-rate` bounds the bytes per second sent or
received; `--prune-remote` applies a retention policy on the remote side after each round.
The parity folder `.ckpt-parity/` of `ckpt protect` lies inside the checkpoint folder and
travels with it like any other file.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ... import faults
from ...errors import Interrupted, UsageError
from ...models import Request
from ...sources.runs import DEFAULT_SETTLE, check_run_folder, is_remote
from ...storage.uri import is_hub_url, parse_location
from ..prune.retention import PrunePolicy
from .model import DEFAULT_JOBS, RateLimit, SyncedCheckpoint, SyncReport
from .push import plan_up, sync_up

__all__ = [
    "RateLimit",
    "SyncReport",
    "SyncRequest",
    "SyncedCheckpoint",
    "exit_code",
    "sync",
    "sync_with",
]


# --------------------------------------------------------------------------- entry point


class SyncRequest(Request):
    """Every option of `sync` but the two sides, typed and frozen: built once (by the command,
    or by `sync` from its keywords) and read by every `--watch` round. Its fields are `sync`'s
    keyword parameters less the sinks (`on_round`, `sleep`, `on_file`), and the command's
    options (`--prune-remote` and `--keep-*` make `prune_policy`; a test holds them to each
    other); they mean what `sync`'s arguments say."""

    latest_only: bool = False
    settle: float = DEFAULT_SETTLE
    max_rate: int | None = None
    prune_policy: PrunePolicy | None = None
    watch_seconds: float | None = None
    max_iterations: int | None = None
    jobs: int | None = None
    dry_run: bool = False


def sync(
    src: str,
    dest: str,
    *,
    latest_only: bool = False,
    settle: float = DEFAULT_SETTLE,
    max_rate: int | None = None,
    prune_policy: PrunePolicy | None = None,
    watch_seconds: float | None = None,
    max_iterations: int | None = None,
    on_round: Callable[[SyncReport], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_file: Callable[[str, int], None] | None = None,
    jobs: int | None = None,
    dry_run: bool = False,
) -> SyncReport:
    """What `ckpt sync SRC DEST` does: one round, or `--watch` rounds until Ctrl-C.

    Args:
        src / dest: a local run folder and an object-store prefix, either way round (the
            remote side may also be a Hub repo when pulling).
        latest_only: pulling: only the newest complete checkpoint.
        settle: seconds; see `ckpt_cli.sources.runs` (saves of marker-less layouts this fresh wait).
        max_rate: bytes per second at most.
        prune_policy: pushing: retention applied on the remote side after each round.
        watch_seconds / max_iterations: repeat every interval (and stop after N rounds).
        on_round: called with each round's report (the CLI prints progress with it).
        on_file: pushing: called with (path in the run folder, bytes) after each file is
            in place remotely (the library's `Checkpointer` logs upload progress with it).
        jobs: files (or parts of a large file) uploaded at once (each checkpoint's markers
            and manifest still go last, one by one, once its data is there), or files of a
            checkpoint fetched at once when pulling; None: `DEFAULT_JOBS`.
        dry_run: one round's plan: what would be uploaded or pulled and, with
            `prune_policy`, the remote prune plan; nothing is written or removed on either
            side. Refused with `watch_seconds` (a plan that repeats would show nothing new).
    """
    request = SyncRequest(
        latest_only=latest_only,
        settle=settle,
        max_rate=max_rate,
        prune_policy=prune_policy,
        watch_seconds=watch_seconds,
        max_iterations=max_iterations,
        jobs=jobs,
        dry_run=dry_run,
    )
    return sync_with(src, dest, request, on_round=on_round, sleep=sleep, on_file=on_file)


def sync_with(
    src: str,
    dest: str,
    request: SyncRequest,
    *,
    on_round: Callable[[SyncReport], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_file: Callable[[str, int], None] | None = None,
) -> SyncReport:
    """`sync` as `request` says (the command's one call); the sinks are `sync`'s."""
    latest_only, settle, prune_policy = request.latest_only, request.settle, request.prune_policy
    watch_seconds, max_iterations = request.watch_seconds, request.max_iterations
    for side in (src, dest):
        parse_location(side)  # a URL with no bucket is refused here, before it is trimmed
    up = is_remote(dest) and not is_remote(src)
    down = is_remote(src) and not is_remote(dest)
    if not (up or down):
        raise UsageError(
            "one side of a sync is a local run folder, the other an object store",
            fix="ckpt sync out/ s3://bucket/run/   or   ckpt sync s3://bucket/run/ out/ --latest",
        )
    if up and is_hub_url(dest):
        raise UsageError(
            "cannot sync to the Hub: publishing there is a commit",
            path=dest,
            fix="Use the Trainer's push_to_hub, or `hf upload`; sync to an object "
            "store (s3://, gs://...) instead.",
        )
    if up:
        check_run_folder(Path(src))
    if down and (Path(dest).exists() or Path(dest).is_symlink()) and not Path(dest).is_dir():
        raise UsageError(
            "DEST is not a folder: a pull writes checkpoints into a run folder",
            path=dest,
            fix="Name a folder (it is created if missing).",
        )
    if down:
        # the folders of DEST are created if missing, and cannot be under a file: the pull
        # failed there (exit 74) after its dry run had planned it
        above = next((p for p in Path(dest).absolute().parents if p.exists()), None)
        if above is not None and not above.is_dir():
            refused = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
            raise faults.io_failure(refused, doing=f"creating {dest} under it")
    if latest_only and up:
        raise UsageError(
            "--latest applies when pulling (SRC remote, DEST local)",
            fix="Leave --latest out: a push uploads every complete checkpoint the store lacks.",
        )
    if prune_policy is not None and down:
        raise UsageError(
            "--prune-remote applies when pushing (SRC local, DEST remote)",
            fix="Leave --prune-remote out, or prune the local folder with `ckpt prune`.",
        )
    if max_iterations is not None and watch_seconds is None:
        raise UsageError(
            "--max-iterations only applies with --watch",
            fix="Add --watch SECONDS, or leave --max-iterations out.",
        )
    if request.dry_run and watch_seconds is not None:
        # as `prune --dry-run --watch`: a plan repeated every interval would show nothing new
        raise UsageError(
            "--dry-run and --watch conflict: --dry-run shows one round's plan",
            fix="Leave --watch out to see the plan, or --dry-run out to sync as the job trains.",
        )
    if watch_seconds is not None and watch_seconds <= 0:
        raise UsageError(
            f"--watch needs a positive number of seconds (got {watch_seconds:g})",
            fix="Give the interval in seconds, e.g. --watch 300.",
        )
    limit = RateLimit(request.max_rate)
    jobs = DEFAULT_JOBS if request.jobs is None else request.jobs

    def one_round() -> SyncReport:
        if up and request.dry_run:
            return plan_up(src, dest, settle=settle, prune_policy=prune_policy)
        if up:
            return sync_up(
                src,
                dest,
                settle=settle,
                limit=limit,
                prune_policy=prune_policy,
                on_file=on_file,
                jobs=jobs,
            )
        # a push never pulls: its process does not import the pull side
        from .pull import sync_down

        return sync_down(
            src,
            dest,
            latest_only=latest_only,
            limit=limit,
            settle=settle,
            dry_run=request.dry_run,
            jobs=jobs,
        )

    if watch_seconds is None:
        report = one_round()
        report.iterations = 1
        return report
    total = SyncReport(source=src, dest=dest, direction="up" if up else "down")
    try:
        for _ in _rounds(max_iterations):
            report = one_round()
            total.iterations += 1
            total.checkpoints = report.checkpoints
            total.bytes_sent += report.bytes_sent
            total.transferred += report.transferred
            total.failed += report.failed
            total.refused_keys += report.refused_keys
            total.latest = report.latest
            total.pruned = report.pruned
            if on_round is not None:
                on_round(report)
            if max_iterations is not None and total.iterations >= max_iterations:
                total.stopped = "max-iterations"
                break
            if faults.received is not None:  # one swallowed on its way (a torch import)
                raise KeyboardInterrupt
            sleep(watch_seconds)
    except (KeyboardInterrupt, Interrupted):
        # a round cut midway keeps what it uploaded (each object whole) for the next
        total.stopped = "interrupted"
        faults.answer_stop()
    return total


def _rounds(limit: int | None) -> Iterator[int]:
    count = 0
    while limit is None or count < limit:
        yield count
        count += 1


def exit_code(report: SyncReport) -> int:
    """4 when a remote key was refused as unsafe, 1 when a checkpoint failed to sync or verify."""
    if report.refused_keys:
        return 4
    return 1 if report.failed else 0
