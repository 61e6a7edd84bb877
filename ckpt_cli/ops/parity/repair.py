"""`repair`: rebuild lost or damaged files bit-exact from the parity, and publish them."""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ... import __version__
from ...errors import FormatError, IOFailure, NoCheckpointError, NotFoundError
from ...faults import io_failure
from ...formats.names import is_commit_marker
from ...models import Request
from ...progress import NULL_PROGRESS, Progress
from ...sources.runs.records import CHECKSUM_MANIFEST
from ...storage import Storage
from ...storage.output import current_umask, new_staging_folder, remove_dead_stagings
from ..verify.checksum_manifest import (
    ChecksumManifest,
    FileDigest,
    manifest_location,
    read_manifest,
    write_manifest,
)
from .codec import Codec, chunk_size, pad_block, slices
from .layout import ParityLayout
from .model import ParityManifest, ProtectedFile, RepairReport
from .scan import (
    ParityScan,
    damage_list,
    misrecorded_text,
    newer_than_parity,
    not_a_file,
    scan_parity,
)
from .target import (
    BlockReader,
    ParityTarget,
    folder_time_kept,
    on_leader,
    open_parity_target,
    pwrite_all,
    read_parity_manifest,
    sha256_file,
)

# ------------------------------------------------------------------------------ repair


def repair(src: str, *, dry_run: bool = False, progress: Progress = NULL_PROGRESS) -> RepairReport:
    """Rebuild missing or corrupt files of a protected checkpoint, bit-exact, atomically.

    Every block of every file is checked against its digest; the damaged ones are rebuilt
    stripe by stripe from the surviving data and parity, each rebuilt file is checked against
    the manifest's sha256 in staging, then published with one rename per file (commit markers
    last). With more than K losses in a stripe nothing is changed and the report names the
    files that cannot be rebuilt (exit 1).

    Args:
        src: checkpoint folder or file, local or an fsspec URL (`s3://...`).
        dry_run: check every block and report what would be rebuilt; write nothing.
        progress: receives the bytes read.

    Raises:
        NotFoundError: the checkpoint has no parity (run `ckpt protect` first).
        FormatError: a rebuilt file does not match its recorded sha256 (nothing published).
    """
    return repair_with(src, RepairRequest(dry_run=dry_run), progress)


class RepairRequest(Request):
    """Every option of `repair` but the location, typed and frozen: built once (by the command,
    or by `repair` from its keywords) and passed down whole. Its fields are `repair`'s keyword
    parameters less the progress sink, and the command's options (a test holds them to each
    other); they mean what `repair`'s arguments say."""

    dry_run: bool = False


def repair_with(
    src: str, request: RepairRequest, progress: Progress = NULL_PROGRESS
) -> RepairReport:
    """`repair` of `src` as `request` says (the command's one call)."""
    return on_leader(lambda: _repair(src, request, progress), RepairReport)


def _repair(src: str, request: RepairRequest, progress: Progress) -> RepairReport:
    target = open_parity_target(src, rebuilding=True)
    m = read_parity_manifest(target)
    if m is None and not target.files:
        # nothing here at all: what every command says of an empty folder
        raise NoCheckpointError(
            "holds no checkpoint files, and no parity to repair them from",
            path=target.source.location.raw,
            fix="Point at the checkpoint folder or file itself (protected with "
            "`ckpt protect SRC` while it was intact).",
        )
    if m is None:
        raise NotFoundError(
            "has no parity to repair from",
            path=target.source.location.raw,
            fix="Protect checkpoints while they are intact: `ckpt protect SRC`.",
        )
    scan = scan_parity(target, m, checksums=True, progress=progress)
    report = RepairReport(
        location=target.source.location.raw,
        ok=True,
        dry_run=request.dry_run,
        damaged=damage_list(target, scan),
        hashed_bytes=scan.hashed,
    )
    # a file the manifest misrecords is intact: nothing to rebuild, the parity to write again
    misrecorded = [
        f"{line}; write the parity again with `ckpt protect SRC --force`"
        for line in misrecorded_text(target, scan)
    ]
    if not report.damaged:
        report.warnings = misrecorded
        if not misrecorded:
            _redate_intact(target, m, report)
            _mend_checksum_manifest(target, m, report)
        return report
    newer = set(newer_than_parity(target, m))
    report.unrecoverable = [d.path for d in report.damaged if not d.repairable]
    if report.unrecoverable:
        # nothing is written: say so, not what a repair would have done to the file
        outcome = {
            True: "not restored (other files are damaged beyond the parity, and repair "
            "changes nothing until they are restored)",
            False: "not restored (the damage is beyond the parity)",
        }
    else:
        restored = "would be restored" if request.dry_run else "restored"
        restored += " to its content as of then, which undoes the change if it was intended"
        outcome = {True: restored, False: restored}
    report.warnings = [
        f"{d.path}: modified after `ckpt protect` wrote the parity ({m.created}); "
        f"{outcome[d.repairable]} (if the change was intended, run `ckpt protect SRC --force` "
        "instead)"
        for d in report.damaged
        if d.kind == "data" and d.state != "missing" and d.path in newer
    ] + misrecorded
    if report.unrecoverable:
        report.ok = False
        return report
    if request.dry_run:
        report.ok = False  # damage remains until a real run
        if not misrecorded:
            _mend_checksum_manifest(target, m, report)
        return report
    for f in m.files:
        if not_a_file(target.storage, f.path):
            raise FormatError(
                "is not a regular file (a folder, FIFO or device) where the checkpoint has "
                "a file; repair does not replace it",
                path=target.storage.describe(f.path),
                fix="Move it out of the way, then run `ckpt repair` again to rebuild the file.",
            )
    with _repair_staging(target) as staging:
        staged = _rebuild(target, scan, staging, progress)
        with folder_time_kept(target, m.folder_mtime_ns):
            _publish_repaired(target, staged)
    report.rebuilt = [d.path for d in report.damaged]
    if not misrecorded:
        _redate_intact(target, m, report)
        _mend_checksum_manifest(target, m, report)
    return report


def _protected_stamp(recorded: ProtectedFile, protected_ns: int) -> int:
    """The time a file holding the bytes `protect` recorded is dated: as `protect` found it,
    no later than the parity manifest (so `verify` does not take it for a change since)."""
    written = recorded.mtime_ns
    return protected_ns if written is None else min(written, protected_ns)


def _redate_intact(target: ParityTarget, m: ParityManifest, report: RepairReport) -> None:
    """Date the local files the scan found intact, block by block, but newer than the parity
    (touched, or copied without their times) as when `protect` found them: `verify` warns of
    each (`parity_stale`) and names `ckpt repair`, which found nothing to rebuild, so the
    warning would stay. Into `report.redated`; a dry run only lists them."""
    storage = target.storage
    manifest = storage.local_path(target.manifest_rel)
    if manifest is None:
        return
    try:
        protected_ns = manifest.stat().st_mtime_ns
    except OSError:
        return
    damaged = {d.path for d in report.damaged}
    for f in m.files:
        path = storage.local_path(f.path)
        if path is None or storage.describe(f.path) in damaged:
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_mtime_ns <= protected_ns:
            continue
        if not report.dry_run:
            stamp = _protected_stamp(f, protected_ns)
            os.utime(path, ns=(info.st_atime_ns, stamp))
        report.redated.append(storage.describe(f.path))


def _mend_checksum_manifest(target: ParityTarget, m: ParityManifest, report: RepairReport) -> None:
    """Write the checksum manifest beside the protected files again when it is no longer
    readable (damaged bytes: the parity does not cover it, since `verify --write-manifest`
    may rewrite it after `protect`), from the parity's sha256 of each file, which the repair
    has just found intact or rebuilt bit-exact. Only where the parity records every file the
    folder holds: it cannot vouch for a file added since. A readable
    manifest is `verify --checksums`'s to judge, never rewritten here."""
    source = target.source
    if source.target is not None or CHECKSUM_MANIFEST not in source.files:
        return
    path = manifest_location(source, None)
    try:
        read_manifest(path)
        return
    except (FormatError, NotFoundError) as exc:
        problem = exc.problem
    recorded = {f.path: f for f in m.files}
    # (a file the parity records and the folder lost has just been rebuilt, or would be)
    unvouched = sorted(set(target.files) - set(recorded))
    if unvouched:
        report.ok = False
        report.warnings.append(
            f"{path}: {problem}; not written again, because the parity has no record of "
            f"{', '.join(target.storage.describe(n) for n in unvouched)} (added since `ckpt "
            f"protect`): write it with `ckpt verify {source.location.raw} --write-manifest "
            "--force` once the files are known good"
        )
        return
    report.rewritten = [str(path)]
    if report.dry_run:
        report.ok = False  # the manifest stays unreadable until a real run
        return
    write_manifest(
        path,
        ChecksumManifest(
            algorithm="sha256",
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            tool=f"ckpt {__version__}",
            files={
                name: FileDigest(size=f.size, digest=f.sha256)
                for name, f in sorted(recorded.items())
            },
        ),
        force=True,
    )


@contextmanager
def _repair_staging(target: ParityTarget) -> Iterator[Path]:
    """A staging folder for rebuilt files: hidden in the parity folder (local: same filesystem,
    so publishing is a rename), or a local temporary folder for an object store."""
    root = target.storage.local_root
    if root is not None:
        parent = root / target.parity_rel
        name = "repair"
    else:
        parent, name = Path(tempfile.gettempdir()), "ckpt-repair"
    # the staging folder of a repair that was killed (SIGKILL, a crash) is removed first
    remove_dead_stagings(parent, name)
    try:
        folder, lock = new_staging_folder(parent, name)
    except OSError as exc:  # a read-only filesystem: the folder, not the random name
        unnamed = OSError(exc.errno, exc.strerror)
        raise io_failure(unnamed, parent, "creating the repair's staging folder") from None
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _rebuild(
    target: ParityTarget, scan: ParityScan, staging: Path, progress: Progress
) -> list[tuple[str, Path, ProtectedFile]]:
    """Write every damaged file whole into `staging`; each checked against its sha256."""
    m = scan.manifest
    layout = ParityLayout(m)
    storage = target.storage
    reader = BlockReader(storage)
    # staged output files, pre-sized; good blocks are copied, bad ones come from the decoder
    staged: dict[tuple[str, int], tuple[str, Path, ProtectedFile, int]] = {}
    try:
        return _rebuild_into(target, scan, staging, progress, layout, reader, staged)
    except OSError as exc:
        # disk full, EIO...: named by the files being rebuilt (their filesystem is where the
        # rebuilt copies are written), or by the file that could not be read; the staging
        # folder is removed, so its name would point nowhere
        names = [
            storage.describe(m.files[idx].path if kind == "data" else m.shares[idx].path)
            for kind, idx in sorted(scan.damaged)
        ]
        if exc.filename is None or Path(os.fsdecode(exc.filename)).is_relative_to(staging):
            exc = OSError(exc.errno, exc.strerror)
        failure = io_failure(exc, names[0], f"rebuilding {', '.join(names)}")
        raise IOFailure(
            f"{failure.problem}; nothing was changed", path=failure.path, fix=failure.fix
        ) from None
    finally:
        for _rel, _path, _f, fd in staged.values():
            with suppress(OSError):
                os.close(fd)
        reader.close()


def _rebuild_into(
    target: ParityTarget,
    scan: ParityScan,
    staging: Path,
    progress: Progress,
    layout: ParityLayout,
    reader: BlockReader,
    staged: dict[tuple[str, int], tuple[str, Path, ProtectedFile, int]],
) -> list[tuple[str, Path, ProtectedFile]]:
    m = scan.manifest
    storage = target.storage
    damaged = scan.damaged
    for n, (kind, idx) in enumerate(sorted(damaged)):
        f = m.files[idx] if kind == "data" else m.shares[idx]
        rel = f.path if kind == "data" else f"{target.parity_rel}/{f.path}"
        path = staging / f"{n}.part"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        # the rebuilt file gets the permissions the file had (a 0600 file stays 0600)
        os.fchmod(fd, _mode_of(storage, rel, [g.path for g in m.files]))
        os.ftruncate(fd, f.size)
        staged[(kind, idx)] = (rel, path, f, fd)
    fds = {key: fd for key, (_rel, _path, _f, fd) in staged.items()}
    losses = scan.losses()
    total = sum(len(b) for _s, b in damaged.values()) * m.block_size
    # the decoder works on one slice of the stripe's blocks at a time (see `codec.CHUNK`):
    # memory is W + K slices, whatever block size the manifest gives
    chunk = chunk_size(m.block_size)
    codec = Codec(m.width, m.parity, chunk, m.ec_type)
    zeros = bytes(chunk)
    progress.start(total, "rebuilding")
    try:
        for stripe in sorted(losses):
            lost = sorted(losses[stripe])
            sources = _surviving_shares(layout, target.parity_rel, stripe, losses[stripe])
            dests = _rebuilt_share_places(layout, stripe, lost, fds)
            for offset, _size in slices(m.block_size, chunk):
                shares: dict[int, bytes] = {}
                for c, name, lo, hi in sources:
                    start, end = lo + offset, min(hi, lo + offset + chunk)
                    if name is None or start >= end:
                        shares[c] = zeros
                    else:
                        shares[c] = pad_block(reader.read(name, start, end - start), chunk)
                for c, data in codec.rebuild(shares, lost).items():
                    if c not in dests:
                        continue
                    fd, lo, hi = dests[c]
                    start, end = lo + offset, min(hi, lo + offset + chunk)
                    if start >= end:
                        continue
                    piece = data[: end - start]
                    # the staged file is pre-sized (a hole reads as zeros): zeros stay a hole
                    if piece != zeros[: len(piece)]:
                        pwrite_all(fd, piece, start)
                    progress.advance(end - start)
        _copy_intact_blocks(scan, staged, reader)
        for _rel, _path, _f, fd in staged.values():
            os.fsync(fd)
    finally:
        progress.finish()
    return _checked(storage, [(rel, path, f) for rel, path, f, _fd in staged.values()])


def _mode_of(storage: Storage, rel: str, siblings: list[str]) -> int:
    """The permissions for the rebuilt `rel`: those of the damaged file where it is still
    there, else no wider than any surviving file of the checkpoint (the manifest records no
    modes), else what a plain `open` gives under the umask."""
    path = storage.local_path(rel)
    if path is None:
        return 0o644 & ~current_umask()
    with suppress(OSError):
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return st.st_mode & 0o777
    mode = 0o666 & ~current_umask()
    for name in siblings:
        other = storage.local_path(name)
        if other is None or other == path:
            continue
        with suppress(OSError):
            st = os.stat(other)
            if stat.S_ISREG(st.st_mode):
                mode &= st.st_mode & 0o777
    return mode


def _surviving_shares(
    layout: ParityLayout, parity_rel: str, stripe: int, lost: set[int]
) -> list[tuple[int, str | None, int, int]]:
    """The first W surviving shares of `stripe`: (column, file path, its extent); a data
    column run out reads as zeros (no path)."""
    m = layout.m
    w = m.width
    sources: list[tuple[int, str | None, int, int]] = []
    for c in range(w + m.parity):
        if len(sources) == w:
            break
        if c in lost:
            continue
        if c < w:
            where = layout.block(c, stripe)
            if where is None:
                sources.append((c, None, 0, 0))  # a column run out: zeros
                continue
            fi, bi = where
            lo, hi = layout.extent(m.files[fi].size, bi)
            sources.append((c, m.files[fi].path, lo, hi))
        else:
            lo = stripe * m.block_size
            sources.append((c, f"{parity_rel}/{m.shares[c - w].path}", lo, lo + m.block_size))
    return sources


def _rebuilt_share_places(
    layout: ParityLayout, stripe: int, lost: list[int], fds: dict[tuple[str, int], int]
) -> dict[int, tuple[int, int, int]]:
    """Where each rebuilt share of `stripe` goes: column -> (staged fd, first byte, end)."""
    m = layout.m
    w = m.width
    dests: dict[int, tuple[int, int, int]] = {}
    for c in lost:
        if c < w:
            where = layout.block(c, stripe)
            if where is None:
                continue
            fi, bi = where
            lo, hi = layout.extent(m.files[fi].size, bi)
            dests[c] = (fds[("data", fi)], lo, hi)
        else:
            lo = stripe * m.block_size
            dests[c] = (fds[("parity", c - w)], lo, lo + m.block_size)
    return dests


def _copy_intact_blocks(
    scan: ParityScan,
    staged: dict[tuple[str, int], tuple[str, Path, ProtectedFile, int]],
    reader: BlockReader,
) -> None:
    """Copy the intact blocks of damaged (not missing) files into their staged copies."""
    block_size = scan.manifest.block_size
    for key, (state, bad) in scan.damaged.items():
        rel, _path, f, fd = staged[key]
        if state == "missing":
            continue
        for bi in range(len(f.blocks)):
            if bi in bad:
                continue
            lo, hi = bi * block_size, min(f.size, (bi + 1) * block_size)
            for offset, size in slices(hi - lo):
                pwrite_all(fd, reader.read(rel, lo + offset, size), lo + offset)


def _checked(
    storage: Storage, rebuilt: list[tuple[str, Path, ProtectedFile]]
) -> list[tuple[str, Path, ProtectedFile]]:
    """`rebuilt`, once each file's sha256 is the manifest's; FormatError naming the first that
    is not (nothing is published then)."""
    for rel, path, f in rebuilt:
        digest = sha256_file(path)
        if digest != f.sha256:
            raise FormatError(
                f"rebuilt from parity, but its sha256 {digest[:16]}… differs from the "
                f"manifest's {f.sha256[:16]}…; nothing was changed",
                path=storage.describe(rel),
                fix="The parity or the surviving files are damaged beyond their digests; "
                "restore this checkpoint from another copy.",
            )
    return rebuilt


def _publish_repaired(target: ParityTarget, staged: list[tuple[str, Path, ProtectedFile]]) -> None:
    """Put each rebuilt file in place: data first, commit markers (index, .metadata) last."""
    storage = target.storage
    ordered = sorted(staged, key=lambda item: (is_commit_marker(item[0]), item[0]))
    manifest = storage.local_path(target.manifest_rel)
    protected_ns = manifest.stat().st_mtime_ns if manifest is not None else None
    for rel, path, recorded in ordered:
        if protected_ns is not None:
            # the bytes are those `protect` recorded (sha256 checked): dated no later than
            # its manifest, so `verify` does not take them for a change made since
            # (`parity_stale`), which its advice (`ckpt repair`) could never clear; and as
            # the file was dated when protected, where the manifest says, so the save keeps
            # its save time (an old save is no new one to `latest` and `prune`)
            stamp = _protected_stamp(recorded, protected_ns)
            os.utime(path, ns=(stamp, stamp))
        # a damaged file may be a link or read-only: the name is replaced, never written
        # through (a rename locally; an upload and one server-side copy in an object store)
        storage.put(rel, path, move=True)
