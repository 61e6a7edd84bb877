"""`sync` up: complete local checkpoints uploaded, verified and resumed, manifest last."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ... import __version__
from ...errors import CkptError, FormatError, UsageError
from ...sources.runs import DEFAULT_SETTLE, RunCheckpoint, scan_run
from ...storage import remote_failure
from ...storage.hashing import hasher_factory
from ...storage.output import UPLOAD_BLOCK
from ...storage.uri import parse_location
from ..prune.retention import PrunePolicy
from ..prune.run import prune
from ..verify.checksums import ChecksumManifest, FileDigest
from .model import SYNC_ALGORITHM, RateLimit, SyncedCheckpoint, SyncReport, now_iso
from .plan import (
    ROOT_FILES,
    local_files,
    manifest_rel_path,
    remote_etag,
    s3_etag,
    upload_order,
    uploadable,
    uploaded_late,
)

# --------------------------------------------------------------------------- up

#: files of one checkpoint uploaded at once (S3 serves parallel PUTs; so does every store
#: fsspec speaks to); `ckpt sync --jobs` sets it
DEFAULT_JOBS = 8


class _Uploader:
    """Uploads checkpoints of one local run folder into one object-store prefix."""

    def __init__(
        self,
        run_root: Path,
        dest: str,
        limit: RateLimit,
        on_file: Callable[[str, int], None] | None = None,
        jobs: int = DEFAULT_JOBS,
    ):
        from ...storage import FsspecStorage, filesystem_for

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
        #: objects are written and removed through the write side of the prefix's storage;
        #: listings and checks read the store's own records (sizes, ETags)
        self.store = FsspecStorage(self.fs, self.root, self.dest)
        self.limit = limit
        self.on_file = on_file
        self.jobs = max(1, jobs)
        self._lock = threading.Lock()
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
        files = local_files(self.run_root, c)
        is_dir = Path(c.path).is_dir()
        manifest_rel = manifest_rel_path(c, is_dir)
        own_manifest: ChecksumManifest | None = None
        local_manifest = self.run_root / manifest_rel
        if is_dir and manifest_rel in files:
            from ..verify.checksums import read_manifest

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
        ordered = upload_order(list(files))
        data_files = [rel for rel in ordered if not uploaded_late(rel)]
        markers = [rel for rel in ordered if uploaded_late(rel)]

        def upload(rel: str) -> None:
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
            with self._lock:
                digests[inside] = FileDigest(size=sizes[rel], digest=digest)
                if sent:
                    result.files_sent += 1
                    result.bytes_sent += sizes[rel]
                else:
                    result.files_reused += 1
                if self.on_file is not None:
                    self.on_file(rel, sizes[rel])

        # the data files go up side by side (one object store connection each: a single
        # stream leaves most of the link idle); the markers follow one by one, in order,
        # each once everything before it is uploaded and checked
        with ThreadPoolExecutor(max_workers=min(self.jobs, max(1, len(data_files)))) as pool:
            for _ in pool.map(upload, data_files):
                pass  # re-raises the first failure; the pool waits for the others
        for rel in markers:
            self._check_pending(prefix)
            upload(rel)
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
                created=now_iso(),
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
        for rel in rels:
            self.store.remove(rel)

    def _put(self, rel: str, data: bytes) -> None:
        self.store.write_file(rel, [data])
        self.limit.take(len(data))

    def _upload_file(
        self, path: Path, rel: str, size: int, new: Callable[[], Any]
    ) -> tuple[str, bool]:
        """(manifest digest, whether it was sent): skipped when the object already holds it."""
        target = f"{self.root}/{rel}"
        existing = self.listing().get(rel)
        if existing is not None and int(existing.get("size") or 0) == size:
            digest, local_parts = self._hash_local(path, new)
            if remote_etag(existing) == s3_etag(local_parts, size):
                return digest, False
        hasher = new()
        parts: list[bytes] = []

        def blocks() -> Iterator[bytes]:
            with open(path, "rb") as src:
                while block := src.read(UPLOAD_BLOCK):
                    hasher.update(block)
                    parts.append(hashlib.md5(block).digest())
                    yield block
                    self.limit.take(len(block))

        self.store.write_file(rel, blocks())
        if not parts:
            parts.append(hashlib.md5(b"").digest())
        with self._lock:
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
        with self._lock:
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
        if remote_etag(info) == s3_etag(parts, size):
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
                # the parts `write_file` sends (`UPLOAD_BLOCK` each; one PUT below that)
                parts = [
                    hashlib.md5(data[i : i + UPLOAD_BLOCK]).digest()
                    for i in range(0, max(len(data), 1), UPLOAD_BLOCK)
                ]
                if existing is not None and remote_etag(existing) == s3_etag(parts, len(data)):
                    continue
                self._put(name, data)


def sync_up(
    src: str,
    dest: str,
    *,
    settle: float = DEFAULT_SETTLE,
    limit: RateLimit | None = None,
    prune_policy: PrunePolicy | None = None,
    on_file: Callable[[str, int], None] | None = None,
    jobs: int = DEFAULT_JOBS,
) -> SyncReport:
    """One round of `ckpt sync RUN_DIR s3://…`: upload what the destination lacks.

    `on_file(rel, size)` is called once each file of a checkpoint is in place remotely
    (sent, or found there already), in upload order; `jobs` files are sent at once.
    """
    run_root = Path(src)
    run = scan_run(run_root, settle=settle)
    uploader = _Uploader(Path(run.run_dir), dest, limit or RateLimit(None), on_file, jobs)
    report = SyncReport(source=src, dest=dest, direction="up")
    now = time.time()
    for c in run.checkpoints:
        why = uploadable(c, settle, now)
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
    uploader.copy_root_files([n for n in ROOT_FILES if (run_root / n).is_file()])
    if prune_policy is not None:
        # the remote side has one writer, this sync, which writes each save's markers last:
        # a fresh upload is complete the moment its manifest is there
        policy = prune_policy.model_copy(update={"settle": 0.0})
        report.pruned = prune(dest.rstrip("/"), policy, yes=True, strict_metric=False)
    remote = scan_run(dest.rstrip("/"), settle=0.0, until_latest=True)
    report.latest = remote.latest
    return report
