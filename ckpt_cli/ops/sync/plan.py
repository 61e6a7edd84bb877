"""What `sync` sends and in which order, on either side: files of a checkpoint, manifests, ETags."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import IO, Any

from ...budgets import json_record_over_budget
from ...errors import FormatError, NotFoundError
from ...formats.names import is_commit_marker
from ...sources.runs import RUN_SLIM_RECORD, UNMARKED, RunCheckpoint
from ...sources.runs.naming import MEGATRON_TRACKER
from ...sources.runs.records import SYNC_RECORD, checksum_manifest_of
from ...storage import Storage, is_staging_name
from ...storage.output import UPLOAD_BLOCK
from ..verify.checksum_manifest import ChecksumManifest

#: files written after a checkpoint's data, in this order (the manifest always last)
_LATE = ("trainer_state.json",)
#: small run-folder files carried along so the remote run keeps its pointers and metrics
#: (DeepSpeed's `latest`, Megatron-LM's `latest_checkpointed_iteration.txt`: without it a
#: Megatron-LM run resumed from the copy starts from scratch)
ROOT_FILES = ("latest", MEGATRON_TRACKER, "metrics.jsonl")
#: of those, the pointers to a save (rewritten, not appended to)
POINTER_FILES = ("latest", MEGATRON_TRACKER)
#: the key (in the destination prefix) a sync writes once, with a wrong checksum, to learn
#: whether the store checks checksums; kept only by a store that does not (and then deleted)
CHECKSUM_PROBE = ".ckpt-checksum-probe"


def left_out(top: dict[str, bool], checkpoints: list[RunCheckpoint], run_dir: str) -> list[str]:
    """What a sync does not carry of a run folder: the entries at its top (name -> is a
    folder) that are part of no step checkpoint (a final model saved at the root, logs,
    scripts), beside `ROOT_FILES` and ckpt's own records; folders end in `/`.

    sync moves whole step saves, each checked against its manifest; a file at the root has
    no save to be judged complete with (the Trainer's final `save_model` may still be
    writing it), so it is named here rather than copied or passed over in silence.
    """
    prefix = f"{run_dir.rstrip('/')}/"
    carried = {*ROOT_FILES, SYNC_RECORD, CHECKSUM_PROBE, RUN_SLIM_RECORD}
    for c in checkpoints:
        carried.update(path.removeprefix(prefix).split("/", 1)[0] for path in c.paths)
        carried.add(checksum_manifest_of(c.name, False))  # beside a single-file save
    return sorted(
        f"{name}/" if is_dir else name for name, is_dir in top.items() if name not in carried
    )


def local_files(run_root: Path, c: RunCheckpoint) -> dict[str, Path]:
    """The files of a local checkpoint, by path relative to the run folder (hidden ones too:
    the `.ckpt-parity/` folder travels with the checkpoint). ckpt's own staging names (what
    a killed `protect` or `verify --write-manifest` left inside it) are no part of it, as in
    every listing and manifest."""
    out: dict[str, Path] = {}
    for raw in c.paths:
        path = Path(raw)
        if path.is_file():
            out[path.relative_to(run_root).as_posix()] = path
            continue
        for dirpath, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not is_staging_name(d))
            for fname in sorted(files):
                if is_staging_name(fname):
                    continue
                full = Path(dirpath, fname)
                if not full.is_symlink():
                    out[full.relative_to(run_root).as_posix()] = full
    return out


def uploaded_late(rel: str) -> bool:
    """Commit markers and `trainer_state.json`: uploaded once the data is in place."""
    return is_commit_marker(rel) or rel.rsplit("/", 1)[-1] in _LATE


def upload_order(rels: list[str]) -> list[str]:
    """Data first, then commit markers and `trainer_state.json` (the manifest goes after)."""
    return sorted(rels, key=lambda r: (uploaded_late(r), r))


def s3_etag(parts: list[bytes], size: int = 0) -> str:
    """The ETag S3 gives an object uploaded in these parts' MD5 digests.

    s3fs sends a file smaller than its block size with one PUT (ETag: the MD5) and a larger
    one as a multipart upload of `UPLOAD_BLOCK` parts, as written (ETag: MD5 of the parts'
    MD5s, `-N`), even when N is 1.
    """
    if len(parts) == 1 and size < UPLOAD_BLOCK:
        return parts[0].hex()
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def remote_etag(info: dict[str, Any]) -> str | None:
    etag = info.get("ETag") or info.get("etag")
    return str(etag).strip('"') if etag else None


def uploadable(c: RunCheckpoint, settle: float, now: float) -> str | None:
    """Why a local checkpoint is not uploaded now, or None."""
    if not c.complete:
        return f"{c.status}: {c.reason}"
    if c.symlink:
        return "a symlink (its target is synced under its own name)"
    # layouts with no commit marker of their own look complete while still being written
    if c.layout in UNMARKED and now - c.mtime < settle:
        return f"modified in the last {settle:g} s (no commit marker in this layout)"
    return None


class AfterRound(Storage):
    """The destination run folder as one upload round would leave it, read without writing:
    the store's objects, but each checkpoint the round uploads replaced by its local files
    (and its checksum manifest), the run folder's own files (`ROOT_FILES`) by the local ones,
    and sync's record at the root. What `sync --dry-run` judges its remote prune plan on: the
    real round prunes after its uploads, so a plan of the store as it is now would leave out
    the very saves the round adds.

    Files the round would upload are read from the local run folder (a manifest the round
    computes while uploading is given as bytes: its presence is what a judge reads) and dated
    `now` (the store dates an object by its upload); the others are read from the store.
    """

    def __init__(
        self,
        store: Storage | None,
        display: str,
        uploads: dict[str, Path | bytes],
        replaced: list[str],
        now: float,
    ):
        self.display = display
        self._store = store
        self._uploads = uploads
        self._now = now
        listed = store.list_files() if store is not None else {}
        gone = tuple(f"{name}/" for name in replaced)
        self._files = {
            rel: size
            for rel, size in listed.items()
            if rel not in replaced and not rel.startswith(gone)
        }
        for rel, held in uploads.items():
            self._files[rel] = len(held) if isinstance(held, bytes) else held.stat().st_size

    def list_files(self) -> dict[str, int]:
        return dict(self._files)

    def size(self, rel: str) -> int:
        if rel not in self._files:
            raise NotFoundError("no such object", path=self.describe(rel), fix="Check the path.")
        return self._files[rel]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        local = self._uploads.get(rel)
        if local is None:
            assert self._store is not None  # every listed file is uploaded or in the store
            self.size(rel)
            return self._store.read(rel, offset, length)
        if isinstance(local, bytes):
            data = local[offset : offset + length]
        else:
            with open(local, "rb") as src:
                src.seek(offset)
                data = src.read(length)
        if len(data) != length:
            raise FormatError(
                f"ends at byte {offset + len(data)}, before {offset + length}",
                path=str(local),
                fix="It changed while it was read; run the dry run again.",
            )
        return data

    def open(self, rel: str) -> IO[bytes]:
        local = self._uploads.get(rel)
        if local is None:
            assert self._store is not None
            self.size(rel)
            return self._store.open(rel)
        return io.BytesIO(local) if isinstance(local, bytes) else open(local, "rb")

    def modified(self, rel: str) -> float | None:
        if rel in self._uploads:
            return self._now
        return self._store.modified(rel) if self._store is not None else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


# --------------------------------------------------------------------------- down


def remote_manifest(storage: Storage, rel: str) -> ChecksumManifest | None:
    """The checkpoint's checksum manifest in the store, or None when there is none."""
    read = remote_manifest_bytes(storage, rel)
    return None if read is None else read[0]


def remote_manifest_bytes(storage: Storage, rel: str) -> tuple[ChecksumManifest, bytes] | None:
    """The checkpoint's checksum manifest in the store and the very bytes it was read from
    (a pull writes those into its copy: a second read could get a newer manifest than the
    one its files were checked against), or None when there is none."""
    try:
        too_large = json_record_over_budget(storage.size(rel))
        if too_large is not None:
            raise FormatError(
                f"{too_large} (a hostile or corrupt manifest)",
                path=storage.describe(rel),
                fix="The remote copy is damaged; pull an older checkpoint, or sync it again "
                "from a machine that has it whole.",
            )
        raw = storage.read_all(rel)
    except NotFoundError:
        return None
    try:
        return ChecksumManifest.model_validate(json.loads(raw)), raw
    except (ValueError, RecursionError) as exc:  # too deep: hostile
        raise FormatError(
            f"is not a valid ckpt checksum manifest ({str(exc).splitlines()[0]})",
            path=storage.describe(rel),
            fix="The remote copy is damaged; pull an older checkpoint, or sync it again from a "
            "machine that has it whole.",
        ) from None
