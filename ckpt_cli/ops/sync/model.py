"""The reports of `sync` and its byte-rate limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Literal

from pydantic import Field

from ...models import Record
from ..prune.retention import PruneReport

#: hash algorithm of manifests sync computes (the one `verify --write-manifest` defaults to)
SYNC_ALGORITHM = "sha256"

#: files of one checkpoint uploaded or fetched at once (S3 serves parallel requests; so does
#: every store fsspec speaks to); `ckpt sync --jobs` sets it
DEFAULT_JOBS = 8


class SyncedCheckpoint(Record):
    """What one round did with one checkpoint.

    Attributes:
        name: the checkpoint's name in the run folder (`checkpoint-500`).
        step: its step.
        action: `uploaded` / `downloaded`; `present` (the other side holds it already);
            `skipped` (not complete, or still being written: `reason` says which);
            `failed` (`reason` says why).
        reason: why it was skipped or failed, or why a local copy was replaced.
        files: files of the checkpoint; bytes: their total size.
        files_sent / bytes_sent: files and bytes actually transferred this time.
        files_reused: files an earlier, interrupted sync had already uploaded.
        verified: each file matched the checksum manifest (and, up, its uploaded object).
        manifest: where the manifest was taken from: `checkpoint` (its own) or `computed`.
    """

    name: str
    step: int | None = None
    action: Literal["uploaded", "downloaded", "present", "skipped", "failed"]
    reason: str | None = None
    files: int = 0
    bytes: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    files_reused: int = 0
    verified: bool = False
    manifest: Literal["checkpoint", "computed"] | None = None


class SyncReport(Record):
    """The result of `ckpt sync`.

    Attributes:
        source / dest: as given.
        direction: `up` (local to object store) or `down`.
        checkpoints: every checkpoint considered in the last round, oldest first.
        bytes_sent: bytes transferred, over all rounds.
        transferred: names uploaded or downloaded, over all rounds.
        failed: `name: why` for checkpoints that failed (exit 1).
        refused_keys: remote keys (relative to the run folder, as listed) that are not safe
            file names (an empty, `.` or `..` part,
            a backslash, a NUL, or also another key's folder), each refusing the checkpoint it
            lies in (exit 4); the other checkpoints are still pulled.
        left_out: what of the source's run folder the sync does not carry: entries at its
            top that are part of no step checkpoint (a final model at the root, logs), folders
            ending in `/`; `latest` and `metrics.jsonl` travel, ckpt's own records are not named.
        latest: the newest complete checkpoint on the destination after the sync (for a
            pull: its local path, ready for `--resume_from_checkpoint`).
        pruned: the remote retention report of the last round (`--prune-remote`).
        iterations: rounds run (1 without `--watch`).
        stopped: with `--watch`: `max-iterations` or `interrupted`.
        dry_run: nothing was written or removed on either side: `checkpoints`, `transferred`
            and `bytes_sent` are what one round would do, `pruned` the remote prune plan
            (`applied` false) judged on the destination as the round would leave it, `latest`
            the destination's newest complete save as it is now.
    """

    source: str
    dest: str
    direction: Literal["up", "down"]
    checkpoints: list[SyncedCheckpoint] = Field(default_factory=list)
    bytes_sent: int = 0
    transferred: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)
    refused_keys: list[str] = Field(default_factory=list)
    left_out: list[str] = Field(default_factory=list)
    latest: str | None = None
    pruned: PruneReport | None = None
    iterations: int = 0
    stopped: Literal["max-iterations", "interrupted"] | None = None
    dry_run: bool = False


class RateLimit:
    """Bounds the bytes per second moved by one sync (a token bucket of one second).

    `clock` and `sleep` are injectable so the pacing is tested without waiting.
    """

    def __init__(
        self,
        rate: int | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._start = clock()
        self._moved = 0
        self._lock = threading.Lock()

    def take(self, amount: int) -> None:
        """Account for `amount` bytes, sleeping as long as the rate demands."""
        if not self.rate:
            return
        with self._lock:
            self._moved += amount
            due = self._moved / self.rate - (self._clock() - self._start)
        if due > 0:
            self._sleep(due)


# --------------------------------------------------------------------------- helpers


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
