"""`sync` up: complete local checkpoints uploaded, verified and resumed, manifest last."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import __version__
from ...errors import CkptError, FormatError, Interrupted, NotFoundError, UsageError
from ...faults import close_pool, interruption, notice, submit_tracked
from ...sources.runs import DEFAULT_SETTLE, RunCheckpoint, RunReport, run_storage, scan_run
from ...sources.runs.records import CHECKSUM_MANIFEST, SYNC_RECORD, checksum_manifest_of
from ...storage import remote_failure
from ...storage.base import PARITY_DIR
from ...storage.destination import RemoteDest
from ...storage.hashing import hasher_factory
from ...storage.object_leases import Lease, abort_dead_uploads, is_lease, root_lease_name
from ...storage.object_upload import ObjectUploader, multipart_etag, read_for_upload
from ...storage.output import UPLOAD_BLOCK, require_bucket
from ...storage.remote_replies import listing_time
from ...storage.uri import parse_location
from ..prune.retention import RETENTION_OPTIONS, PrunePolicy, PruneReport
from ..verify.checksum_manifest import ChecksumManifest, FileDigest
from .model import (
    DEFAULT_JOBS,
    SYNC_ALGORITHM,
    RateLimit,
    SyncedCheckpoint,
    SyncReport,
    now_iso,
)
from .plan import (
    CHECKSUM_PROBE,
    ROOT_FILES,
    AfterRound,
    left_out,
    local_files,
    remote_etag,
    s3_etag,
    upload_order,
    uploadable,
    uploaded_late,
)

# --------------------------------------------------------------------------- up


@dataclass
class _Plan:
    """One checkpoint being uploaded: its files, what they must match, what was done."""

    c: RunCheckpoint
    files: dict[str, Path]
    sizes: dict[str, int]
    stamps: dict[str, int]
    is_dir: bool
    manifest_rel: str
    local_manifest: Path
    own_manifest: ChecksumManifest | None
    new: Callable[[], Any]
    algorithm: str
    result: SyncedCheckpoint
    digests: dict[str, FileDigest] = field(default_factory=dict)

    @property
    def prefix(self) -> str | None:
        return self.c.name if self.is_dir else None

    def inside(self, rel: str) -> str:
        """A file's name inside the checkpoint (as its manifest lists it)."""
        return rel.removeprefix(f"{self.c.name}/") if self.is_dir else rel.rsplit("/", 1)[-1]


class _Uploader:
    """Uploads checkpoints of one local run folder into one object-store prefix.

    The data files of every checkpoint of a round go through one pool of `jobs` workers,
    checkpoint after checkpoint (each one's largest first), so the next save's data is on
    its way while this one's markers and manifest follow its data one by one (`finish`). Against S3 each upload is
    checked by the store's reply (`ObjectUploader`: the store's own check of the SHA-256 /
    CRC32 sent with the body where it makes one, else the ETag): one listing a round, no
    request after an upload; other filesystems stream through `fs.open` and are checked
    with one listing of the checkpoint's prefix before its markers.
    """

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
        #: S3's own requests where the store is reached through s3fs, else None (`fs.open`)
        s3 = self.store.s3_filesystem()
        self.objects = (
            None
            if s3 is None
            else ObjectUploader(s3, self.jobs, limit.take, probe=f"{self.root}/{CHECKSUM_PROBE}")
        )
        self._lock = threading.Lock()
        self._listing: dict[str, dict[str, Any]] | None = None
        #: (manifest, its ETag) -> whether it lists its save's files (`_manifest_lists`)
        self._manifests: dict[tuple[str, str], bool] = {}
        #: manifests fetched ahead by `read_manifests`: bytes, or the failure to read one
        self._manifest_bytes: dict[str, bytes | Exception] = {}
        #: uploads (through `fs.open`) not yet checked against the store, by file
        self._pending: dict[str, tuple[str, int, str, str, Any]] = {}
        #: this round's lease at the destination's root, once it uploads (`mark_destination`)
        self.lease: Lease | None = None

    def close(self) -> None:
        if self.objects is not None:
            self.objects.close()
        if self.lease is not None:
            self.lease.release()

    def listing(self) -> dict[str, dict[str, Any]]:
        """Objects under the destination prefix, relative name -> info (one listing a round)."""
        if self._listing is None:
            try:
                if self.objects is not None:
                    # one request, also for a prefix nothing was synced to yet
                    found = self.objects.list_prefix(self.root)
                else:
                    self.fs.invalidate_cache(self.root)
                    found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                # an empty prefix, or no bucket at all: said now (exit 3), not once the
                # first save is uploaded, nor planned as uploads by a dry run
                require_bucket(RemoteDest(url=self.dest, fs=self.fs, path=self.root))
                found = {}
            except Exception as exc:  # each filesystem package raises its own errors
                raise remote_failure(exc, self.dest) from None
            prefix = self.root + "/"
            self._listing = {
                name[len(prefix) :]: info
                for name, info in found.items()
                if name.startswith(prefix) and info.get("type") != "directory"
            }
        return self._listing

    def holds(
        self,
        manifest_rel: str,
        files: dict[str, int],
        changed: float,
        own_manifest: bytes | None = None,
        listed: dict[str, int] | None = None,
    ) -> bool:
        """Whether the destination has this checkpoint synced: its manifest, and every file
        at its size, with no local file changed (`changed`: the newest local mtime) after the
        manifest was written there, or the remote manifest the very bytes of the save's own
        (`own_manifest`, given when no file of the save is newer than it).

        Sizes alone missed a save rewritten at the same size (a run restarted from an earlier
        save writes the same step again): the remote copy stayed the old one, called
        "present". The manifest goes up last, after every file of the save, so a local file
        newer than it changed after that sync; the checkpoint is then synced again, every
        unchanged file found in place by its ETag rather than sent. A local clock ahead of
        the store's costs at most one such round: the new manifest is written later still.

        A save given its manifest by `verify --write-manifest` after its upload, or pulled
        from a store that reports no times (a pull gives each file its object's time where
        the store says), has files newer than the remote manifest without being changed: the
        same manifest on both sides, none of its files newer than it here, says so.

        A remote manifest other than the save's own is read (once per ETag) and must list
        `listed` (each file's name inside the checkpoint and size): the object's presence
        alone called a save "present" whose manifest was damaged in the store, which no pull
        can use.
        """
        listing = self.listing()
        manifest = listing.get(manifest_rel)
        if manifest is None:
            return False
        same = own_manifest is not None and remote_etag(manifest) == self._put_etag(own_manifest)
        written = listing_time(manifest)
        # in whole seconds: S3 lists times to the second, so a file written in the second
        # the manifest went up is older than it, not newer
        if not same and written is not None and int(changed) > int(written):
            return False
        if not all(
            rel in listing and int(listing[rel].get("size") or 0) == size
            for rel, size in files.items()
        ):
            return False
        return same or listed is None or self._manifest_lists(manifest_rel, manifest, listed)

    def _manifest_lists(self, rel: str, info: dict[str, Any], listed: dict[str, int]) -> bool:
        """Whether the store's manifest `rel` (listed as `info`) is a checksum manifest of
        exactly these files at these sizes (remembered by its ETag across rounds)."""
        key = (rel, remote_etag(info) or "")
        known = self._manifests.get(key)
        if known is None:
            raw = self._manifest_bytes.pop(rel, None)
            try:
                if raw is None:
                    raw = self.fs.cat_file(f"{self.root}/{rel}", **self._whole_read)
                elif isinstance(raw, Exception):
                    raise raw
            except FileNotFoundError:
                return False
            except Exception as exc:  # each filesystem package raises its own errors
                raise remote_failure(exc, f"{self.dest}/{rel}") from None
            try:
                record = ChecksumManifest.model_validate(json.loads(raw))
            except ValueError:
                known = False
            else:
                known = {name: f.size for name, f in record.files.items()} == listed
            self._manifests[key] = known
        return known

    @property
    def _whole_read(self) -> dict[str, int]:
        """Arguments of a whole small object's read: one GET on S3. s3fs asks a whole read's
        size first (a HEAD: one more round trip per manifest) to split a large object into
        ranges read side by side, which a manifest never needs; other filesystems take
        their defaults."""
        return {"max_concurrency": 1} if self.objects is not None else {}

    def read_manifests(self, rels: list[str]) -> None:
        """Fetch the store's manifests among `rels` not yet judged, all in one call (side by
        side on filesystems that fetch concurrently, s3fs among them), for `_manifest_lists`:
        a run of many saves costs one round trip, not one per save."""
        listing = self.listing()
        todo = [
            f"{self.root}/{rel}"
            for rel in rels
            if rel in listing and (rel, remote_etag(listing[rel]) or "") not in self._manifests
        ]
        if len(todo) < 2:
            return  # one is read when it is judged
        try:
            found = self.fs.cat(todo, on_error="return", **self._whole_read)
        except Exception as exc:  # each filesystem package raises its own errors
            raise remote_failure(exc, self.dest) from None
        prefix = f"{self.root}/"
        for path, raw in found.items():
            self._manifest_bytes[path.removeprefix(prefix)] = raw

    def prepare(self, c: RunCheckpoint) -> _Plan | SyncedCheckpoint:
        """What to upload of one complete checkpoint, or `present` when the store has it; a
        copy synced before and changed since loses its remote manifest here (it is not
        synced while it is replaced)."""
        plan = self.judge(c)
        if isinstance(plan, _Plan) and plan.manifest_rel in self.listing():
            self._remove([plan.manifest_rel])
        return plan

    def judge(self, c: RunCheckpoint) -> _Plan | SyncedCheckpoint:
        """What to upload of one complete checkpoint, or `present` when the store has it:
        reads only (a dry run's plan is this)."""
        files = local_files(self.run_root, c)
        is_dir = Path(c.path).is_dir()
        manifest_rel = checksum_manifest_of(c.name, is_dir)
        own_manifest: ChecksumManifest | None = None
        local_manifest = self.run_root / manifest_rel
        if is_dir and manifest_rel in files:
            from ..verify.checksum_manifest import read_manifest

            own_manifest = read_manifest(local_manifest)
            del files[manifest_rel]
        stats = {rel: path.stat() for rel, path in files.items()}
        changed = max((st.st_mtime for st in stats.values()), default=0.0)
        own_bytes = None
        if own_manifest is not None:
            manifest_written = local_manifest.stat().st_mtime
            if int(changed) <= int(manifest_written):  # the manifest still tells the files
                own_bytes = local_manifest.read_bytes()
            changed = max(changed, manifest_written)
        sizes = {rel: st.st_size for rel, st in stats.items()}
        result = SyncedCheckpoint(
            name=c.name,
            step=c.step,
            action="uploaded",
            files=len(files),
            bytes=sum(sizes.values()),
            manifest="checkpoint" if own_manifest else "computed",
        )
        listed = {
            rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]: size
            for rel, size in sizes.items()
        }
        if self.holds(manifest_rel, sizes, changed, own_bytes, listed):
            result.action = "present"
            result.verified = True
            return result
        algo = own_manifest.algorithm if own_manifest else SYNC_ALGORITHM
        return _Plan(
            c=c,
            files=files,
            sizes=sizes,
            stamps={rel: st.st_mtime_ns for rel, st in stats.items()},
            is_dir=is_dir,
            manifest_rel=manifest_rel,
            local_manifest=local_manifest,
            own_manifest=own_manifest,
            new=hasher_factory(algo),
            algorithm=algo,
            result=result,
        )

    @staticmethod
    def data_files(plan: _Plan) -> list[str]:
        """The checkpoint's data files, largest first: the longest upload (an optimizer
        state, say) starts at once and the small files go up beside it, instead of it
        starting last and going up alone while the pool's other workers have nothing left."""
        rels = [rel for rel in plan.files if not uploaded_late(rel)]
        return sorted(rels, key=lambda rel: (-plan.sizes[rel], rel))

    def send(self, plan: _Plan, rel: str) -> None:
        """Upload one file of a checkpoint (or find it there), checked against its manifest."""
        size = plan.sizes[rel]
        digest, sent = self._upload_file(plan.files[rel], rel, size, plan)
        inside = plan.inside(rel)
        # the parity of `ckpt protect` is no file the checksum manifest lists: its own index
        # records every share's digest, and `verify --checksums` checks it by that
        if plan.own_manifest is not None and not inside.startswith(f"{PARITY_DIR}/"):
            expected = plan.own_manifest.files.get(inside)
            if expected is None or expected.digest != digest or expected.size != size:
                raise FormatError(
                    f"{rel} does not match the checkpoint's checksum manifest",
                    path=str(plan.local_manifest),
                    fix="The local copy is damaged: `ckpt verify --checksums` says which "
                    "file; it was not published to the destination.",
                )
        with self._lock:
            plan.digests[inside] = FileDigest(size=size, digest=digest)
            if sent:
                plan.result.files_sent += 1
                plan.result.bytes_sent += size
            else:
                plan.result.files_reused += 1
            if self.on_file is not None:
                self.on_file(rel, size)

    def finish(self, plan: _Plan, data: list[Future[None]]) -> SyncedCheckpoint:
        """Once the checkpoint's data is up: its markers one by one, in order, each once
        everything before it is in place and checked; then its manifest."""
        _wait_all(data)
        markers = [rel for rel in upload_order(list(plan.files)) if uploaded_late(rel)]
        for rel in markers:
            self._check_pending(plan)
            self.send(plan, rel)
        self._check_pending(plan)
        # a file rewritten while it was uploaded would make the remote copy a mix
        for rel, path in plan.files.items():
            st = path.stat()
            if st.st_mtime_ns != plan.stamps[rel] or st.st_size != plan.sizes[rel]:
                raise FormatError(
                    f"{rel} changed while it was uploaded; its manifest was not written",
                    path=str(path),
                    fix="Run the sync again once the save is finished.",
                )
        if plan.own_manifest is not None:
            data_bytes = plan.local_manifest.read_bytes()
        else:
            record = ChecksumManifest(
                algorithm=SYNC_ALGORITHM,
                created=now_iso(),
                tool=f"ckpt {__version__} sync",
                format=None,
                files=plan.digests,
            )
            data_bytes = (json.dumps(record.model_dump(mode="json"), indent=2) + "\n").encode()
        self._put(plan.manifest_rel, data_bytes)
        if plan.is_dir:
            # objects of an older version of this checkpoint that it no longer has
            name = plan.c.name
            stale = [
                rel
                for rel in self.listing()
                if rel.startswith(f"{name}/") and rel not in plan.files and rel != plan.manifest_rel
            ]
            self._remove(stale)
        plan.result.verified = True
        return plan.result

    def _remove(self, rels: list[str]) -> None:
        for rel in rels:
            self.store.remove(rel)

    def _put(self, rel: str, data: bytes) -> None:
        """A small file written whole (a manifest, `latest`). To S3 in one PUT, checked by the
        store's reply as a data file is, and removed again when that check fails: a damaged
        manifest would make its checkpoint look synced."""
        if self.objects is None:
            self.store.write_file(rel, [data])
            self.limit.take(len(data))
            return
        target = f"{self.root}/{rel}"
        new = hasher_factory(SYNC_ALGORITHM)
        try:
            up = self.objects.upload_bytes(data, target, new, sha256=SYNC_ALGORITHM == "sha256")
        except Exception as exc:
            raise remote_failure(exc, f"{self.dest}/{rel}", writing=True) from None
        if up.checked:
            return
        reply = {"size": len(data), "ETag": up.etag}
        try:
            self._check_upload(
                target, rel, len(data), up.expected_etag or "", up.digest, new, reply
            )
        except CkptError:
            self._remove([rel])
            raise

    def _put_etag(self, data: bytes) -> str:
        """The ETag of the object `_put` makes of `data`: one PUT to S3; through `write_file`
        elsewhere (`UPLOAD_BLOCK` parts from that size on, one PUT below it)."""
        if self.objects is not None:
            return hashlib.md5(data).hexdigest()
        parts = [
            hashlib.md5(data[i : i + UPLOAD_BLOCK]).digest()
            for i in range(0, max(len(data), 1), UPLOAD_BLOCK)
        ]
        return s3_etag(parts, len(data))

    def _upload_file(self, path: Path, rel: str, size: int, plan: _Plan) -> tuple[str, bool]:
        """(manifest digest, whether it was sent): skipped when the object already holds it."""
        new = plan.new
        target = f"{self.root}/{rel}"
        existing = self.listing().get(rel)
        if existing is not None and int(existing.get("size") or 0) == size:
            etag = remote_etag(existing)
            digest, local_etag = self._hash_local(path, new, multipart="-" in (etag or ""))
            if etag == local_etag:
                return digest, False
        if self.objects is not None:
            return self._upload_direct(self.objects, path, target, rel, size, plan), True
        hasher = new()
        parts: list[bytes] = []

        def blocks() -> Iterator[bytes]:
            with open(path, "rb") as src:
                while block := read_for_upload(src, UPLOAD_BLOCK):
                    hasher.update(block)
                    parts.append(hashlib.md5(block).digest())
                    yield block
                    self.limit.take(len(block))

        self.store.write_file(rel, blocks())
        if not parts:
            parts.append(hashlib.md5(b"").digest())
        with self._lock:
            self._pending[rel] = (target, size, s3_etag(parts, size), hasher.hexdigest(), new)
        return hasher.hexdigest(), True

    def _upload_direct(
        self, objects: ObjectUploader, path: Path, target: str, rel: str, size: int, plan: _Plan
    ) -> str:
        """One S3 upload, checked by the store's reply (no request after it): the store
        checked the body against the checksum sent with it, or its ETag is the bytes sent."""
        new = plan.new
        try:
            up = objects.upload(path, target, size, new, sha256=plan.algorithm == "sha256")
        except CkptError:
            raise
        except Exception as exc:
            raise remote_failure(exc, f"{self.dest}/{rel}", writing=True) from None
        if up.size != size:
            raise FormatError(
                f"{rel} changed while it was uploaded ({size} bytes, then {up.size})",
                path=str(path),
                fix="Run the sync again once the save is finished.",
            )
        if up.checked:
            return up.digest
        reply = {"size": size, "ETag": up.etag}
        self._check_upload(target, rel, size, up.expected_etag or "", up.digest, new, reply)
        return up.digest

    def _check_pending(self, plan: _Plan) -> None:
        """Check the objects uploaded through `fs.open` for one checkpoint, from one listing
        of its prefix (nothing is pending for uploads the store's reply has checked)."""
        with self._lock:
            pending = [(rel, self._pending.pop(rel)) for rel in plan.files if rel in self._pending]
        if not pending:
            return
        infos: dict[str, dict[str, Any]] = {}
        prefix = plan.prefix
        if prefix is not None:
            try:
                self.fs.invalidate_cache(f"{self.root}/{prefix}")
                infos = self.fs.find(f"{self.root}/{prefix}", detail=True)
            except Exception as exc:
                raise remote_failure(exc, f"{self.dest}/{prefix}") from None
        for rel, (target, size, etag, digest, new) in pending:
            self._check_upload(target, rel, size, etag, digest, new, infos.get(target))

    def _hash_local(
        self, path: Path, new: Callable[[], Any], *, multipart: bool
    ) -> tuple[str, str]:
        """(manifest digest, S3 ETag) of a local file, the ETag as one PUT or as parts gives it."""
        hasher = new()
        md5 = hashlib.md5()
        parts = []
        with open(path, "rb") as src:
            while block := read_for_upload(src, UPLOAD_BLOCK):
                hasher.update(block)
                if multipart:
                    parts.append(hashlib.md5(block).digest())
                else:
                    md5.update(block)
        etag = multipart_etag(parts) if multipart else md5.hexdigest()
        return hasher.hexdigest(), etag

    def _check_upload(
        self,
        target: str,
        rel: str,
        size: int,
        etag: str,
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
        if remote_etag(info) == etag:
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

    def mark_destination(self) -> None:
        """Leave sync's record at the destination's root (`SYNC_RECORD`), once, before the
        first upload: from then on whoever judges the destination (`latest`, a pull, a
        prune) reads a save without its manifest as an upload that has not finished, even a
        save of a layout with no commit marker of its own."""
        if self.objects is not None:
            # the store's checksum question goes out now (once), answered while the first
            # files are read and hashed
            self.objects.ask_early()
            if self.lease is None:
                self._take_lease()
        if SYNC_RECORD not in self.listing():
            self._put(SYNC_RECORD, _SYNC_RECORD_TEXT)
            self.listing()[SYNC_RECORD] = {"size": len(_SYNC_RECORD_TEXT)}

    def _take_lease(self) -> None:
        """A lease while this round writes, then what a sync that was killed (SIGKILL) left
        is removed: its lease, its checksum probe, its unfinished multipart uploads; never
        what a sync that runs holds."""
        self.lease = Lease(self.store, root_lease_name())
        self.lease.start()
        listing = self.listing()
        for note in abort_dead_uploads(self.store, listing, self.lease, [CHECKSUM_PROBE]):
            notice(note)

    def tidy(self) -> None:
        """For a round that uploaded nothing: what a killed sync left at the root (a lease, a
        checksum probe) is removed all the same, as `mark_destination` does before uploading,
        at the cost of this round's own lease; best effort (credentials that may only read
        leave it)."""
        if self.objects is None or self.lease is not None:
            return
        if not any(
            rel == CHECKSUM_PROBE or ("/" not in rel and is_lease(rel)) for rel in self.listing()
        ):
            return
        with contextlib.suppress(CkptError):
            self._take_lease()

    def copy_root_files(self, names: list[str]) -> None:
        """The DeepSpeed `latest` pointer and `metrics.jsonl`, after the checkpoints."""
        for name in names:
            path = self.run_root / name
            if path.is_file() and path.stat().st_size <= 16 << 20:
                data = path.read_bytes()
                if name == "latest":
                    data = _unaliased_latest(self.run_root, data)
                existing = self.listing().get(name)
                if existing is not None and remote_etag(existing) == self._put_etag(data):
                    continue
                self._put(name, data)


def _unaliased_latest(run_root: Path, data: bytes) -> bytes:
    """A DeepSpeed `latest` as uploaded: naming a tag that is a link to another tag folder
    of the run (`best -> global_step100`), the folder it stands for. A link is not uploaded
    (its target is, under its own name), and a `latest` naming it would send a resume from
    the copy to a folder the store does not hold."""
    from ...sources.runs.naming import deepspeed_tag
    from ...storage.local import LocalStorage

    tag = deepspeed_tag(data.decode(errors="replace"))
    alias = LocalStorage(run_root).alias_of(tag) if tag is not None else None
    if alias is None or "/" in alias:
        return data
    return alias.encode()


#: what `SYNC_RECORD` says, for whoever finds it in a bucket
_SYNC_RECORD_TEXT = (
    json.dumps(
        {
            "written_by": "ckpt sync",
            "rule": f"a checkpoint here is whole once its {CHECKSUM_MANIFEST} is there; "
            "sync uploads it after the checkpoint's files",
        },
        indent=2,
    )
    + "\n"
).encode()


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
    try:
        report.checkpoints = _upload_round(uploader, run.checkpoints, settle)
        uploader.tidy()
    finally:
        uploader.close()
    for done in report.checkpoints:
        report.bytes_sent += done.bytes_sent
        if done.action == "uploaded":
            report.transferred.append(done.name)
        elif done.action == "failed":
            report.failed.append(f"{done.name}: {done.reason}")
    uploader.copy_root_files([n for n in ROOT_FILES if (run_root / n).is_file()])
    report.left_out = left_out(run.top_entries, run.checkpoints, run.run_dir)
    if prune_policy is not None:
        # the remote side has one writer, this sync, which writes each save's markers last:
        # a fresh upload is complete the moment its manifest is there
        from ..prune.run import prune  # only a round that prunes imports the pruning

        policy = prune_policy.model_copy(update={"settle": 0.0})
        report.pruned = prune(dest.rstrip("/"), policy, yes=True, strict_metric=False)
    known = None if prune_policy is not None else _latest_held(uploader, run, report)
    if known is not None:
        report.latest = f"{dest.rstrip('/')}/{known}"
        return report
    try:
        remote = scan_run(dest.rstrip("/"), settle=0.0, until_latest=True)
    except NotFoundError:
        # nothing there yet: every upload of a first round failed
        return report
    report.latest = remote.latest
    return report


def plan_up(
    src: str,
    dest: str,
    *,
    settle: float = DEFAULT_SETTLE,
    prune_policy: PrunePolicy | None = None,
) -> SyncReport:
    """`ckpt sync RUN_DIR s3://… --dry-run`: what one round would upload (and, with
    `prune_policy`, the remote prune plan, judged on the destination as the round would leave
    it), from the local files and the store's listing and manifests: nothing is written or
    removed on either side.

    A checkpoint to upload is reported as the round would report it (`uploaded`, its files
    and bytes); `files_sent` / `bytes_sent` count the files the store lacks at their size, and
    `files_reused` those it holds at their size (the real round checks their ETag and sends
    any that differ). `latest` is the destination's newest complete save as it is now.
    """
    run = scan_run(Path(src), settle=settle)
    uploader = _Uploader(Path(run.run_dir), dest, RateLimit(None), None, 1)
    report = SyncReport(source=src, dest=dest, direction="up", dry_run=True)
    #: what the round would write, relative to DEST: the local file (or the bytes it computes)
    uploads: dict[str, Path | bytes] = {}
    #: what of the store those uploads replace (a checkpoint's folder, or its files)
    replaced: list[str] = []
    try:
        now = time.time()
        uploader.read_manifests(
            [
                checksum_manifest_of(c.name, Path(c.path).is_dir())
                for c in run.checkpoints
                if uploadable(c, settle, now) is None
            ]
        )
        listing = uploader.listing()
        for c in run.checkpoints:
            why = uploadable(c, settle, now)
            if why is not None:
                report.checkpoints.append(
                    SyncedCheckpoint(name=c.name, step=c.step, action="skipped", reason=why)
                )
                continue
            try:
                judged = uploader.judge(c)
            except CkptError as error:
                report.checkpoints.append(_failed(c, error))
                report.failed.append(f"{c.name}: {error}")
                continue
            if isinstance(judged, SyncedCheckpoint):
                report.checkpoints.append(judged)
                continue
            result = judged.result
            for rel, size in judged.sizes.items():
                there = listing.get(rel)
                if there is not None and int(there.get("size") or 0) == size:
                    result.files_reused += 1
                else:
                    result.files_sent += 1
                    result.bytes_sent += size
            if judged.manifest_rel in listing:
                result.reason = "changed since it was synced: the remote copy would be replaced"
            uploads.update(judged.files)
            uploads[judged.manifest_rel] = (
                judged.local_manifest if judged.own_manifest is not None else b""
            )
            replaced += [c.name] if judged.is_dir else list(judged.files)
            report.checkpoints.append(result)
            report.transferred.append(c.name)
            report.bytes_sent += result.bytes_sent
    finally:
        uploader.close()
    report.left_out = left_out(run.top_entries, run.checkpoints, run.run_dir)
    try:
        remote = scan_run(dest.rstrip("/"), settle=0.0, until_latest=True)
    except NotFoundError:
        remote = None  # nothing synced there yet
    report.latest = remote.latest if remote is not None else None
    if prune_policy is not None:
        report.pruned = _prune_plan(run, dest, prune_policy, uploads, replaced)
    return report


def _prune_plan(
    run: RunReport,
    dest: str,
    prune_policy: PrunePolicy,
    uploads: dict[str, Path | bytes],
    replaced: list[str],
) -> PruneReport:
    """The remote prune plan of a dry run, judged on the destination as the round would leave
    it (`AfterRound`): the real round prunes after its uploads and its `latest` and
    `metrics.jsonl`, so those are in the plan too."""
    from ...formats.base import Source
    from ..prune.retention import validate_policy
    from ..prune.run import plan_report  # only a plan that prunes imports the pruning

    validate_policy(prune_policy, RETENTION_OPTIONS)
    root = dest.rstrip("/")
    run_root = Path(run.run_dir)
    if uploads:
        uploads[SYNC_RECORD] = _SYNC_RECORD_TEXT
    for name in ROOT_FILES:
        path = run_root / name
        if path.is_file() and path.stat().st_size <= 16 << 20:
            uploads[name] = path
    try:
        store = run_storage(root)
    except NotFoundError:
        store = None  # nothing synced there yet: the round's uploads are all there will be
    view = AfterRound(store, root, uploads, replaced, time.time())
    try:
        source = Source(location=parse_location(root), storage=view)
        policy = prune_policy.model_copy(update={"settle": 0.0})
        after = scan_run(source, metric=policy.keep_best, mode=policy.mode, settle=0.0)
        return plan_report(after, policy, root)
    finally:
        view.close()


def _latest_held(uploader: _Uploader, run: RunReport, report: SyncReport) -> str | None:
    """The remote run's newest complete checkpoint (its path under DEST), known without
    reading the bucket, or None when only judging the bucket can tell.

    Known when the local run's newest complete checkpoint is held by the bucket as this
    round left it (uploaded and checked, or found there), and the bucket holds nothing the
    local run does not, nothing of a later checkpoint, and every checkpoint has its own step
    (so both sides order them alike): the bucket's judge would read the same bytes of the
    same checkpoints and stop at the same one.
    """
    newest = run.newest_complete
    held = {c.name for c in report.checkpoints if c.action in ("uploaded", "present")}
    if newest is None or newest.name not in held or len(newest.paths) != 1:
        return None
    steps = [c.step for c in run.checkpoints]
    if None in steps or len(set(steps)) != len(steps) or any(c.symlink for c in run.checkpoints):
        return None
    root = Path(run.run_dir)
    rel = newest.path.removeprefix(f"{run.run_dir.rstrip('/')}/")
    if rel == newest.path:
        return None
    later: set[str] = set()
    known = {*ROOT_FILES, CHECKSUM_PROBE, SYNC_RECORD}
    for c in run.checkpoints:
        names = {*local_files(root, c), checksum_manifest_of(c.name, Path(c.path).is_dir())}
        known |= names
        if c.order > newest.order:
            later |= names
    listed = {rel for rel in uploader.listing() if not is_lease(rel)}
    if not listed <= known or listed & later:
        return None
    return rel


def _upload_round(
    uploader: _Uploader, checkpoints: list[RunCheckpoint], settle: float
) -> list[SyncedCheckpoint]:
    """Every checkpoint of the round, oldest first: the data files of all of them queued in
    one pool at once, each checkpoint finished (markers, manifest) in order as its data lands."""
    now = time.time()
    done: list[SyncedCheckpoint | _Plan] = []
    waiting: dict[str, list[Future[None]]] = {}
    uploader.read_manifests(
        [
            checksum_manifest_of(c.name, Path(c.path).is_dir())
            for c in checkpoints
            if uploadable(c, settle, now) is None
        ]
    )
    pool = ThreadPoolExecutor(max_workers=uploader.jobs, thread_name_prefix="ckpt-sync")
    out: list[SyncedCheckpoint] = []
    try:
        for c in checkpoints:
            why = uploadable(c, settle, now)
            if why is not None:
                done.append(
                    SyncedCheckpoint(name=c.name, step=c.step, action="skipped", reason=why)
                )
                continue
            try:
                plan = uploader.prepare(c)
            except CkptError as error:
                done.append(_failed(c, error))
                continue
            done.append(plan)
            if isinstance(plan, _Plan):
                uploader.mark_destination()
                waiting[c.name] = [
                    submit_tracked(pool, uploader.send, plan, rel)
                    for rel in uploader.data_files(plan)
                ]
        for item in done:
            if not isinstance(item, _Plan):
                out.append(item)
                continue
            try:
                out.append(uploader.finish(item, waiting.pop(item.c.name)))
            except CkptError as error:
                out.append(_failed(item.c, error))
        return out
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: what is up stays, to resume
        finished = {r.name for r in out}
        raise _interrupted(
            exc,
            uploader.dest,
            [r.name for r in out if r.action == "uploaded"],
            [i.c.name for i in done if isinstance(i, _Plan) and i.c.name not in finished],
        ) from None
    finally:
        # Ctrl-C or a bug: what is queued is dropped, what is being sent ends first
        close_pool(pool)


def _interrupted(
    exc: KeyboardInterrupt, dest: str, synced: list[str], unfinished: list[str]
) -> Interrupted:
    """What an interrupted push left, said as it is: the checkpoints it synced (each with its
    manifest) and those it had begun, whose files uploaded so far stay in the store (each
    object whole, none with a manifest: no reader counts them as synced) for the next sync
    to reuse. No partial output is removed, so the usual words would not hold."""
    problem = "interrupted"
    if synced:
        their = "its" if len(synced) == 1 else "their"
        problem += f"; {', '.join(synced)} synced to {dest} (with {their} manifest)"
    if unfinished:
        problem += (
            f"; the files of {', '.join(unfinished)} uploaded so far are kept in {dest}, "
            "each whole, without a manifest, so not counted as synced"
        )
    return interruption(
        exc,
        problem,
        dest,
        fix="Run the same `ckpt sync` again: it resumes, sending only the files the store "
        "does not hold whole already.",
    )


def _failed(c: RunCheckpoint, error: CkptError) -> SyncedCheckpoint:
    return SyncedCheckpoint(name=c.name, step=c.step, action="failed", reason=str(error))


def _wait_all(futures: list[Future[None]]) -> None:
    """Wait for one checkpoint's uploads; on the first failure drop those not yet begun,
    wait for those being sent, and raise it."""
    for index, future in enumerate(futures):
        try:
            future.result()
        except BaseException:
            for rest in futures[index + 1 :]:
                rest.cancel()
            for rest in futures[index + 1 :]:
                if not rest.cancelled():
                    rest.exception()
            raise
