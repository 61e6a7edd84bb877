"""`sync`: a run's complete checkpoints copied between a local run folder and an object store.

Up (`ckpt sync out/ s3://bucket/run/`): every *complete* checkpoint of the local run folder
(judged by `ckpt_cli.runs`, so never one still being written, never an interrupted one) that
the destination does not hold yet is uploaded under its own name. The order inside one
checkpoint is the one ckpt's object-store writer uses (`output.publish_order`): data files
first, then the commit markers (`.metadata`, `*.index.json`, `trainer_state.json`), and last
the checksum manifest `ckpt-manifest.json` (the checkpoint's own when it has one, else one
computed while uploading; for a single-file checkpoint `NAME.ckpt-manifest.json` beside it).
The manifest is what makes a remote copy *synced*: a destination holds a checkpoint when its
manifest is there and every file it lists has the recorded size.

Verification: each file is hashed while it is read for the upload; a checkpoint that has a
manifest must match it (a corrupt local copy is never published), and each uploaded object
must carry the ETag S3 computes from the bytes it received (MD5, or the MD5 of the parts'
MD5s for a multipart upload); where a store reports no usable ETag the object is read back
and hashed.

Resume: a file whose object already exists with the same size and ETag (an earlier,
interrupted sync uploaded it) is not sent again; S3 creates an object only when its upload
completes, so a file cut midway is simply missing and sent whole.

Down (`ckpt sync s3://bucket/run/ out/ --latest`): the newest complete remote checkpoint (or
every one missing locally) is streamed into a hidden staging folder in the run folder,
hashed on the way and checked against its manifest, then published with one rename.

`--watch` repeats rounds every interval; `--max-rate` bounds the bytes per second sent or
received; `--prune-remote` applies a retention policy on the remote side after each round.
The parity folder `.ckpt-parity/` of `ckpt protect` lies inside the checkpoint folder and
travels with it like any other file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from .. import __version__
from ..errors import CkptError, FormatError, NotFoundError, UsageError
from ..hashing import hasher_factory
from ..output import TMP_MARKER, UPLOAD_BLOCK, fsync_dir, is_commit_marker
from ..runs import _UNMARKED, DEFAULT_SETTLE, RunCheckpoint, is_remote, run_storage, scan_run
from ..storage import Storage, remote_failure
from ..uri import parse_location
from .checksums import MANIFEST_NAME, ChecksumManifest, FileDigest
from .prune import PrunePolicy, PruneReport, prune

#: hash algorithm of manifests sync computes (the one `verify --write-manifest` defaults to)
SYNC_ALGORITHM = "sha256"
#: files written after a checkpoint's data, in this order (the manifest always last)
_LATE = ("trainer_state.json",)
#: small run-folder files carried along so the remote run keeps its pointers and metrics
_ROOT_FILES = ("latest", "metrics.jsonl")


class SyncedCheckpoint(BaseModel):
    """What one round did with one checkpoint.

    Attributes:
        name: the checkpoint's name in the run folder (`checkpoint-500`).
        step: its step.
        action: `uploaded` / `downloaded`; `present` (the other side holds it already);
            `skipped` (not complete, or still being written: `reason` says which);
            `failed` (`reason` says why).
        reason: why it was skipped or failed.
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


class SyncReport(BaseModel):
    """The result of `ckpt sync`.

    Attributes:
        source / dest: as given.
        direction: `up` (local to object store) or `down`.
        checkpoints: every checkpoint considered in the last round, oldest first.
        bytes_sent: bytes transferred, over all rounds.
        transferred: names uploaded or downloaded, over all rounds.
        failed: `name: why` for checkpoints that failed (exit 1).
        latest: the newest complete checkpoint on the destination after the sync (for a
            pull: its local path, ready for `--resume_from_checkpoint`).
        pruned: the remote retention report of the last round (`--prune-remote`).
        iterations: rounds run (1 without `--watch`).
        stopped: with `--watch`: `max-iterations` or `interrupted`.
    """

    source: str
    dest: str
    direction: Literal["up", "down"]
    checkpoints: list[SyncedCheckpoint] = Field(default_factory=list)
    bytes_sent: int = 0
    transferred: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)
    latest: str | None = None
    pruned: PruneReport | None = None
    iterations: int = 0
    stopped: Literal["max-iterations", "interrupted"] | None = None


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


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _local_files(run_root: Path, c: RunCheckpoint) -> dict[str, Path]:
    """The files of a local checkpoint, by path relative to the run folder (hidden ones too:
    the `.ckpt-parity/` folder travels with the checkpoint)."""
    out: dict[str, Path] = {}
    for raw in c.paths:
        path = Path(raw)
        if path.is_file():
            out[path.relative_to(run_root).as_posix()] = path
            continue
        for dirpath, dirs, files in os.walk(path):
            dirs.sort()
            for fname in sorted(files):
                full = Path(dirpath, fname)
                if not full.is_symlink():
                    out[full.relative_to(run_root).as_posix()] = full
    return out


def _manifest_rel(c: RunCheckpoint, is_dir: bool) -> str:
    """Where a checkpoint's manifest lives, relative to the run folder."""
    return f"{c.name}/{MANIFEST_NAME}" if is_dir else f"{c.name}.{MANIFEST_NAME}"


def _late(rel: str) -> bool:
    """Commit markers and `trainer_state.json`: uploaded once the data is in place."""
    return is_commit_marker(rel) or rel.rsplit("/", 1)[-1] in _LATE


def _order(rels: list[str]) -> list[str]:
    """Data first, then commit markers and `trainer_state.json` (the manifest goes after)."""
    return sorted(rels, key=lambda r: (_late(r), r))


def s3_etag(parts: list[bytes], size: int = 0) -> str:
    """The ETag S3 gives an object uploaded in these parts' MD5 digests.

    s3fs sends a file smaller than its block size with one PUT (ETag: the MD5) and a larger
    one as a multipart upload of `UPLOAD_BLOCK` parts, as written (ETag: MD5 of the parts'
    MD5s, `-N`), even when N is 1.
    """
    if len(parts) == 1 and size < UPLOAD_BLOCK:
        return parts[0].hex()
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def _remote_etag(info: dict[str, Any]) -> str | None:
    etag = info.get("ETag") or info.get("etag")
    return str(etag).strip('"') if etag else None


# --------------------------------------------------------------------------- up


class _Uploader:
    """Uploads checkpoints of one local run folder into one object-store prefix."""

    def __init__(self, run_root: Path, dest: str, limit: RateLimit):
        from ..storage import filesystem_for

        self.run_root = run_root
        self.dest = dest.rstrip("/")
        self.fs, path = filesystem_for(parse_location(self.dest))
        self.root = path.rstrip("/")
        if "/" not in self.root.strip("/"):
            raise UsageError(
                "DEST names a bucket, not a prefix inside it",
                path=dest,
                fix="Name a folder-like prefix, e.g. s3://bucket/runs/my-run/.",
            )
        self.limit = limit
        self._listing: dict[str, dict[str, Any]] | None = None
        #: uploads of the current checkpoint not yet checked against the store
        self._pending: list[tuple[str, str, int, list[bytes], str, Any]] = []

    def listing(self) -> dict[str, dict[str, Any]]:
        """Objects under the destination prefix, relative name -> info (one listing a round)."""
        if self._listing is None:
            try:
                self.fs.invalidate_cache(self.root)
                found = self.fs.find(self.root, detail=True) if self.fs.exists(self.root) else {}
            except Exception as exc:  # each filesystem package raises its own errors
                raise remote_failure(exc, self.dest) from None
            prefix = self.root + "/"
            self._listing = {
                name[len(prefix) :]: info
                for name, info in found.items()
                if name.startswith(prefix) and info.get("type") != "directory"
            }
        return self._listing

    def holds(self, manifest_rel: str, files: dict[str, int]) -> bool:
        """Whether the destination has this checkpoint synced: manifest and every file."""
        listing = self.listing()
        if manifest_rel not in listing:
            return False
        return all(
            rel in listing and int(listing[rel].get("size") or 0) == size
            for rel, size in files.items()
        )

    def sync(self, c: RunCheckpoint) -> SyncedCheckpoint:
        """Upload one complete checkpoint (what is missing of it), its manifest last."""
        files = _local_files(self.run_root, c)
        is_dir = Path(c.path).is_dir()
        manifest_rel = _manifest_rel(c, is_dir)
        own_manifest: ChecksumManifest | None = None
        local_manifest = self.run_root / manifest_rel
        if is_dir and manifest_rel in files:
            from .checksums import read_manifest

            own_manifest = read_manifest(local_manifest)
            del files[manifest_rel]
        sizes = {rel: path.stat().st_size for rel, path in files.items()}
        result = SyncedCheckpoint(
            name=c.name,
            step=c.step,
            action="uploaded",
            files=len(files),
            bytes=sum(sizes.values()),
            manifest="checkpoint" if own_manifest else "computed",
        )
        if self.holds(manifest_rel, sizes):
            result.action = "present"
            result.verified = True
            return result
        if manifest_rel in self.listing():
            # synced before, changed since (slimmed, say): not synced while it is replaced
            self._remove([manifest_rel])
        algo = own_manifest.algorithm if own_manifest else SYNC_ALGORITHM
        new = hasher_factory(algo)
        digests: dict[str, FileDigest] = {}
        stamps = {rel: path.stat().st_mtime_ns for rel, path in files.items()}
        prefix = c.name if is_dir else None
        for rel in _order(list(files)):
            if _late(rel):
                self._check_pending(prefix)  # the data is verified before any marker lands
            digest, sent = self._upload_file(files[rel], rel, sizes[rel], new)
            inside = rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]
            if own_manifest is not None:
                expected = own_manifest.files.get(inside)
                if expected is None or expected.digest != digest or expected.size != sizes[rel]:
                    raise FormatError(
                        f"{rel} does not match the checkpoint's checksum manifest",
                        path=str(local_manifest),
                        fix="The local copy is damaged: `ckpt verify --checksums` says which "
                        "file; it was not published to the destination.",
                    )
            digests[inside] = FileDigest(size=sizes[rel], digest=digest)
            if sent:
                result.files_sent += 1
                result.bytes_sent += sizes[rel]
            else:
                result.files_reused += 1
        self._check_pending(prefix)
        # a file rewritten while it was uploaded would make the remote copy a mix
        for rel, path in files.items():
            st = path.stat()
            if st.st_mtime_ns != stamps[rel] or st.st_size != sizes[rel]:
                raise FormatError(
                    f"{rel} changed while it was uploaded; its manifest was not written",
                    path=str(path),
                    fix="Run the sync again once the save is finished.",
                )
        if own_manifest is not None:
            data = local_manifest.read_bytes()
        else:
            record = ChecksumManifest(
                algorithm=algo,
                created=_now_iso(),
                tool=f"ckpt {__version__} sync",
                format=None,
                files=digests,
            )
            data = (json.dumps(record.model_dump(mode="json"), indent=2) + "\n").encode()
        self._put(manifest_rel, data)
        if is_dir:
            # objects of an older version of this checkpoint that it no longer has
            stale = [
                rel
                for rel in self.listing()
                if rel.startswith(f"{c.name}/") and rel not in files and rel != manifest_rel
            ]
            self._remove(stale)
        result.verified = True
        return result

    def _remove(self, rels: list[str]) -> None:
        if not rels:
            return
        try:
            self.fs.rm([f"{self.root}/{rel}" for rel in rels])
            self.fs.invalidate_cache(self.root)
        except Exception as exc:
            raise remote_failure(exc, f"{self.dest}/{rels[0]}", writing=True) from None

    def _put(self, rel: str, data: bytes) -> None:
        try:
            with self.fs.open(f"{self.root}/{rel}", "wb") as out:
                out.write(data)
        except Exception as exc:
            raise remote_failure(exc, f"{self.dest}/{rel}", writing=True) from None
        self.limit.take(len(data))

    def _upload_file(
        self, path: Path, rel: str, size: int, new: Callable[[], Any]
    ) -> tuple[str, bool]:
        """(manifest digest, whether it was sent): skipped when the object already holds it."""
        target = f"{self.root}/{rel}"
        existing = self.listing().get(rel)
        if existing is not None and int(existing.get("size") or 0) == size:
            digest, local_parts = self._hash_local(path, new)
            if _remote_etag(existing) == s3_etag(local_parts, size):
                return digest, False
        hasher = new()
        parts: list[bytes] = []
        try:
            with (
                open(path, "rb") as src,
                self.fs.open(target, "wb", block_size=UPLOAD_BLOCK) as out,
            ):
                while block := src.read(UPLOAD_BLOCK):
                    hasher.update(block)
                    parts.append(hashlib.md5(block).digest())
                    out.write(block)
                    self.limit.take(len(block))
                if not parts:
                    parts.append(hashlib.md5(b"").digest())
        except CkptError:
            raise
        except Exception as exc:
            raise remote_failure(exc, f"{self.dest}/{rel}", writing=True) from None
        self._pending.append((target, rel, size, parts, hasher.hexdigest(), new))
        return hasher.hexdigest(), True

    def _check_pending(self, prefix: str | None) -> None:
        """Check the objects uploaded for one checkpoint, from one listing of its prefix."""
        infos: dict[str, dict[str, Any]] = {}
        if prefix is not None and self._pending:
            try:
                self.fs.invalidate_cache(f"{self.root}/{prefix}")
                infos = self.fs.find(f"{self.root}/{prefix}", detail=True)
            except Exception as exc:
                raise remote_failure(exc, f"{self.dest}/{prefix}") from None
        pending, self._pending = self._pending, []
        for target, rel, size, parts, digest, new in pending:
            self._check_upload(target, rel, size, parts, digest, new, infos.get(target))

    def _hash_local(self, path: Path, new: Callable[[], Any]) -> tuple[str, list[bytes]]:
        hasher = new()
        parts = []
        with open(path, "rb") as src:
            while block := src.read(UPLOAD_BLOCK):
                hasher.update(block)
                parts.append(hashlib.md5(block).digest())
        return hasher.hexdigest(), parts or [hashlib.md5(b"").digest()]

    def _check_upload(
        self,
        target: str,
        rel: str,
        size: int,
        parts: list[bytes],
        digest: str,
        new: Any,
        info: dict[str, Any] | None = None,
    ) -> None:
        """The uploaded object has the size and the bytes that were sent."""
        if info is None:
            try:
                self.fs.invalidate_cache(target)
                info = self.fs.info(target)
            except Exception as exc:
                raise remote_failure(exc, f"{self.dest}/{rel}") from None
        if int(info.get("size") or 0) != size:
            raise FormatError(
                f"the uploaded object has {info.get('size')} bytes, the file {size}",
                path=f"{self.dest}/{rel}",
                fix="Run the sync again; the object is re-sent.",
            )
        if _remote_etag(info) == s3_etag(parts, size):
            return
        # no ETag we can compute (another store, other part sizes): read it back
        hasher = new()
        offset = 0
        while offset < size:
            end = min(size, offset + UPLOAD_BLOCK)
            hasher.update(self.fs.cat_file(target, start=offset, end=end))
            offset = end
        if hasher.hexdigest() != digest:
            raise FormatError(
                "the uploaded object's bytes differ from the file's",
                path=f"{self.dest}/{rel}",
                fix="Run the sync again; the object is re-sent.",
            )

    def copy_root_files(self, names: list[str]) -> None:
        """The DeepSpeed `latest` pointer and `metrics.jsonl`, after the checkpoints."""
        for name in names:
            path = self.run_root / name
            if path.is_file() and path.stat().st_size <= 16 << 20:
                data = path.read_bytes()
                existing = self.listing().get(name)
                if existing is not None and _remote_etag(existing) == s3_etag(
                    [hashlib.md5(data).digest()]
                ):
                    continue
                self._put(name, data)


def _uploadable(c: RunCheckpoint, settle: float, now: float) -> str | None:
    """Why a local checkpoint is not uploaded now, or None."""
    if not c.complete:
        return f"{c.status}: {c.reason}"
    if c.symlink:
        return "a symlink (its target is synced under its own name)"
    # layouts with no commit marker of their own look complete while still being written
    if c.layout in _UNMARKED and now - c.mtime < settle:
        return f"modified in the last {settle:g} s (no commit marker in this layout)"
    return None


def sync_up(
    src: str,
    dest: str,
    *,
    settle: float = DEFAULT_SETTLE,
    limit: RateLimit | None = None,
    prune_policy: PrunePolicy | None = None,
) -> SyncReport:
    """One round of `ckpt sync RUN_DIR s3://…`: upload what the destination lacks."""
    run_root = Path(src)
    run = scan_run(run_root, settle=settle)
    uploader = _Uploader(Path(run.run_dir), dest, limit or RateLimit(None))
    report = SyncReport(source=src, dest=dest, direction="up")
    now = time.time()
    for c in run.checkpoints:
        why = _uploadable(c, settle, now)
        if why is not None:
            report.checkpoints.append(
                SyncedCheckpoint(name=c.name, step=c.step, action="skipped", reason=why)
            )
            continue
        try:
            done = uploader.sync(c)
        except CkptError as error:
            done = SyncedCheckpoint(name=c.name, step=c.step, action="failed", reason=str(error))
            report.failed.append(f"{c.name}: {error}")
        report.checkpoints.append(done)
        report.bytes_sent += done.bytes_sent
        if done.action == "uploaded":
            report.transferred.append(c.name)
    uploader.copy_root_files([n for n in _ROOT_FILES if (run_root / n).is_file()])
    if prune_policy is not None:
        # the remote side has one writer, this sync, which writes each save's markers last:
        # a fresh upload is complete the moment its manifest is there
        policy = prune_policy.model_copy(update={"settle": 0.0})
        report.pruned = prune(dest.rstrip("/"), policy, yes=True, strict_metric=False)
    remote = scan_run(dest.rstrip("/"), settle=0.0, until_latest=True)
    report.latest = remote.latest
    return report


# --------------------------------------------------------------------------- down


def _remote_manifest(storage: Storage, rel: str) -> ChecksumManifest | None:
    try:
        raw = storage.read_all(rel)
    except NotFoundError:
        return None
    try:
        return ChecksumManifest.model_validate(json.loads(raw))
    except ValueError as exc:
        raise FormatError(
            f"is not a valid ckpt checksum manifest ({str(exc).splitlines()[0]})",
            path=storage.describe(rel),
        ) from None


def _download(
    storage: Storage,
    c: RunCheckpoint,
    files: dict[str, int],
    manifest: ChecksumManifest | None,
    manifest_rel: str,
    dest_root: Path,
    limit: RateLimit,
) -> SyncedCheckpoint:
    """Stream one remote checkpoint into a staging folder, verified, then publish it."""
    is_dir = c.name not in files
    result = SyncedCheckpoint(
        name=c.name,
        step=c.step,
        action="downloaded",
        files=len(files),
        bytes=sum(files.values()),
        manifest="checkpoint" if manifest else None,
    )
    final = dest_root / c.name
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_MARKER}", dir=final.parent))
    new = hasher_factory(manifest.algorithm) if manifest else None
    try:
        for rel, size in sorted(files.items()):
            inside = rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]
            target = staging / inside
            target.parent.mkdir(parents=True, exist_ok=True)
            hasher = new() if new else None
            with open(target, "wb") as out:
                offset = 0
                while offset < size:
                    block = storage.read(rel, offset, min(UPLOAD_BLOCK, size - offset))
                    out.write(block)
                    if hasher is not None:
                        hasher.update(block)
                    offset += len(block)
                    limit.take(len(block))
                out.flush()
                os.fsync(out.fileno())
            result.files_sent += 1
            result.bytes_sent += size
            if manifest is not None and hasher is not None:
                key = inside
                expected = manifest.files.get(key)
                if expected is None or expected.digest != hasher.hexdigest():
                    raise FormatError(
                        f"{rel} does not match the checkpoint's checksum manifest",
                        path=storage.describe(manifest_rel),
                        fix="The remote copy is damaged; pull an older checkpoint, or sync "
                        "it again from a machine that has it whole.",
                    )
        if manifest is not None:
            missing = set(manifest.files) - {
                rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]
                for rel in files
            }
            if missing:
                raise FormatError(
                    f"the remote checkpoint lacks {', '.join(sorted(missing))}, "
                    "which its manifest lists",
                    path=storage.describe(manifest_rel),
                )
            if is_dir:
                (staging / MANIFEST_NAME).write_bytes(storage.read_all(manifest_rel))
        fsync_dir(staging)
        if is_dir:
            os.rename(staging, final)
        else:
            # plain files of one step (`model_500.pt`, `optim_500.pt`) land side by side
            for rel in files:
                os.rename(staging / rel.rsplit("/", 1)[-1], dest_root / rel)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if manifest is None:
        # nothing to check the bytes against: the structure is checked instead
        from .verify import verify

        if not verify(str(final)).ok:
            result.action = "failed"
            result.reason = "no checksum manifest, and the structural check failed"
            return result
    result.verified = manifest is not None
    return result


def sync_down(
    src: str,
    dest: str,
    *,
    latest_only: bool = False,
    limit: RateLimit | None = None,
) -> SyncReport:
    """`ckpt sync s3://… RUN_DIR`: pull the newest (or every missing) complete checkpoint."""
    limit = limit or RateLimit(None)
    remote = scan_run(src.rstrip("/"), settle=0.0)
    storage = run_storage(src.rstrip("/"))
    listing = storage.list_files()
    dest_root = Path(dest)
    dest_root.mkdir(parents=True, exist_ok=True)
    report = SyncReport(source=src, dest=dest, direction="down")
    wanted = [c for c in remote.checkpoints if c.complete and not c.slim]
    if latest_only:
        if not wanted:
            raise NotFoundError(
                "no complete checkpoint in the remote run folder",
                path=src,
                fix="`ckpt latest` on it lists every checkpoint and why it is not complete.",
            )
        wanted = wanted[-1:]
    for c in wanted:
        is_dir = c.name not in listing
        manifest_rel = _manifest_rel(c, is_dir)
        own = {p.removeprefix(remote.run_dir.rstrip("/") + "/") for p in c.paths}
        files = {
            rel: size
            for rel, size in listing.items()
            if (rel.startswith(f"{c.name}/") if is_dir else rel in own) and rel != manifest_rel
        }
        if (dest_root / c.name).exists():
            report.checkpoints.append(
                SyncedCheckpoint(name=c.name, step=c.step, action="present", files=len(files))
            )
            continue
        manifest = _remote_manifest(storage, manifest_rel) if manifest_rel in listing else None
        try:
            done = _download(storage, c, files, manifest, manifest_rel, dest_root, limit)
        except CkptError as error:
            done = SyncedCheckpoint(name=c.name, step=c.step, action="failed", reason=str(error))
        if done.action == "failed":
            report.failed.append(f"{c.name}: {done.reason}")
        report.checkpoints.append(done)
        report.bytes_sent += done.bytes_sent
        if done.action == "downloaded":
            report.transferred.append(c.name)
    for name in _ROOT_FILES:
        if name in listing and listing[name] <= 16 << 20 and not (dest_root / name).exists():
            (dest_root / name).write_bytes(storage.read_all(name))
    storage.close()
    local = scan_run(dest_root, settle=0.0, until_latest=True)
    report.latest = local.latest
    return report


# --------------------------------------------------------------------------- entry point


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
) -> SyncReport:
    """What `ckpt sync SRC DEST` does: one round, or `--watch` rounds until Ctrl-C.

    Args:
        src / dest: a local run folder and an object-store prefix, either way round (the
            remote side may also be a Hub repo when pulling).
        latest_only: pulling: only the newest complete checkpoint.
        settle: seconds; see `ckpt_cli.runs` (saves of marker-less layouts this fresh wait).
        max_rate: bytes per second at most.
        prune_policy: pushing: retention applied on the remote side after each round.
        watch_seconds / max_iterations: repeat every interval (and stop after N rounds).
        on_round: called with each round's report (the CLI prints progress with it).
    """
    up = is_remote(dest) and not is_remote(src)
    down = is_remote(src) and not is_remote(dest)
    if not (up or down):
        raise UsageError(
            "one side of a sync is a local run folder, the other an object store",
            fix="ckpt sync out/ s3://bucket/run/   or   ckpt sync s3://bucket/run/ out/ --latest",
        )
    if up and dest.startswith("hf://"):
        raise UsageError(
            "cannot sync to the Hub: publishing there is a commit",
            path=dest,
            fix="Use the Trainer's push_to_hub, or `huggingface-cli upload`; sync to an object "
            "store (s3://, gs://...) instead.",
        )
    if up and not Path(src).is_dir():
        raise NotFoundError("no such run folder", path=src, fix="Check the path.")
    if latest_only and up:
        raise UsageError("--latest applies when pulling (SRC remote, DEST local)")
    if prune_policy is not None and down:
        raise UsageError("--prune-remote applies when pushing (SRC local, DEST remote)")
    if max_iterations is not None and watch_seconds is None:
        raise UsageError("--max-iterations only applies with --watch")
    if watch_seconds is not None and watch_seconds <= 0:
        raise UsageError(f"--watch needs a positive number of seconds (got {watch_seconds:g})")
    limit = RateLimit(max_rate)

    def one_round() -> SyncReport:
        if up:
            return sync_up(src, dest, settle=settle, limit=limit, prune_policy=prune_policy)
        return sync_down(src, dest, latest_only=latest_only, limit=limit)

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
            total.latest = report.latest
            total.pruned = report.pruned
            if on_round is not None:
                on_round(report)
            if max_iterations is not None and total.iterations >= max_iterations:
                total.stopped = "max-iterations"
                break
            sleep(watch_seconds)
    except KeyboardInterrupt:
        total.stopped = "interrupted"
    return total


def _rounds(limit: int | None) -> Iterator[int]:
    count = 0
    while limit is None or count < limit:
        yield count
        count += 1


def exit_code(report: SyncReport) -> int:
    """1 when a checkpoint failed to sync or verify."""
    return 1 if report.failed else 0
