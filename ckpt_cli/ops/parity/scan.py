"""Locating damage from the parity manifest's digests; the parity check of `ckpt verify`."""

from __future__ import annotations

import hashlib
import os
import stat
from contextlib import suppress
from dataclasses import dataclass, field

from ...errors import NotFoundError, UsageError
from ...formats.base import Source
from ...progress import NULL_PROGRESS, Progress
from ...storage import Storage
from .codec import chunked_digest, slices
from .layout import ParityLayout
from .model import DamagedFile, ParityCheck, ParityManifest, ProtectedFile
from .target import BlockReader, ParityTarget, open_parity_target, read_parity_manifest

# ------------------------------------------------------------------------------ scan


@dataclass
class ParityScan:
    """What a scan found: bad blocks per file and per stripe."""

    manifest: ParityManifest
    #: (kind, index) -> state, bad block indexes
    damaged: dict[tuple[str, int], tuple[str, set[int]]] = field(default_factory=dict)
    #: (kind, index) of the files whose blocks or size differ from the manifest while the
    #: whole file holds the manifest's sha256: the manifest is damaged, not the file
    misrecorded: list[tuple[str, int]] = field(default_factory=list)
    hashed: int = 0

    def losses(self) -> dict[int, set[int]]:
        """stripe -> share indexes lost (0..W-1 columns, W.. parity)."""
        layout = ParityLayout(self.manifest)
        out: dict[int, set[int]] = {}
        for (kind, idx), (_state, blocks) in self.damaged.items():
            for bi in blocks:
                if kind == "data":
                    column, stripe = layout.position(idx, bi)
                    out.setdefault(stripe, set()).add(column)
                else:
                    out.setdefault(bi, set()).add(self.manifest.width + idx)
        return out

    def unrecoverable_stripes(self) -> set[int]:
        return {s for s, lost in self.losses().items() if len(lost) > self.manifest.parity}


def scan_parity(
    target: ParityTarget, m: ParityManifest, *, checksums: bool, progress: Progress = NULL_PROGRESS
) -> ParityScan:
    """Find missing, resized and (with `checksums`) corrupt blocks of data and parity files."""
    storage = target.storage
    scan = ParityScan(m)
    entries: list[tuple[str, int, ProtectedFile, str]] = [
        ("data", i, f, f.path) for i, f in enumerate(m.files)
    ] + [("parity", j, s, f"{target.parity_rel}/{s.path}") for j, s in enumerate(m.shares)]
    # a local file is stat-ed; an object store answers from its one listing (parity included)
    present: dict[str, int | None] = {}
    for _kind, _i, _f, rel in entries:
        try:
            present[rel] = storage.size(rel)
        except NotFoundError:
            present[rel] = None
        # a folder, FIFO or device where the file was: the file is lost (and never opened)
        if present[rel] is not None and not_a_file(storage, rel):
            present[rel] = None
    if checksums:
        progress.start(sum(p or 0 for p in present.values()), "checking blocks (xxh3)")
    reader = BlockReader(storage)
    try:
        for kind, i, f, rel in entries:
            size = present[rel]
            n = len(f.blocks)
            if size is None:
                scan.damaged[(kind, i)] = ("missing", set(range(n)))
                continue
            bad: set[int] = set()
            state = "size_changed" if size != f.size else "corrupt"
            if size != f.size:
                # blocks not wholly present are lost; those present are still checked below
                bad |= {bi for bi in range(n) if min(f.size, (bi + 1) * m.block_size) > size}
            if checksums or size != f.size:
                for bi in range(n):
                    if bi in bad:
                        continue
                    lo = bi * m.block_size
                    hi = min(f.size, lo + m.block_size)

                    def read(offset: int, size: int, rel: str = rel, lo: int = lo) -> bytes:
                        data = reader.read(rel, lo + offset, size)
                        progress.advance(len(data))
                        return data

                    # a block may be 1 GiB: read and hashed a chunk at a time
                    digest, done = chunked_digest(read, hi - lo)
                    scan.hashed += done
                    if digest != f.blocks[bi]:
                        bad.add(bi)
            if (bad or size != f.size) and _sha256(reader, rel, size) == f.sha256:
                # the file is as it was protected: its block digests or size in the manifest
                # changed (a damaged manifest); rebuilding the file would change nothing
                scan.misrecorded.append((kind, i))
            elif bad or size != f.size:
                scan.damaged[(kind, i)] = (state, bad)
    finally:
        reader.close()
        if checksums:
            progress.finish()
    return scan


def _sha256(reader: BlockReader, rel: str, size: int) -> str:
    """The sha256 of the `size` bytes of file `rel`, read `CHUNK` at a time."""
    digest = hashlib.sha256()
    for offset, length in slices(size):
        digest.update(reader.read(rel, offset, length))
    return digest.hexdigest()


def misrecorded_text(target: ParityTarget, scan: ParityScan) -> list[str]:
    """One line per file whose manifest entry is damaged (`ParityScan.misrecorded`)."""
    m = scan.manifest
    manifest = target.storage.describe(target.manifest_rel)
    lines = []
    for kind, idx in scan.misrecorded:
        rel = m.files[idx].path if kind == "data" else f"{target.parity_rel}/{m.shares[idx].path}"
        lines.append(
            f"{manifest}: its block digests or size of {target.storage.describe(rel)} do not "
            "match that file, whose sha256 does: the parity manifest is damaged, the file is "
            "intact"
        )
    return lines


def newer_than_parity(target: ParityTarget, m: ParityManifest) -> list[str]:
    """The protected files of a local checkpoint modified after the parity manifest was
    written (as shown to users)."""
    storage = target.storage
    manifest_path = storage.local_path(target.manifest_rel)
    if manifest_path is None:
        return []
    try:
        written = manifest_path.stat().st_mtime
    except OSError:
        return []
    out = []
    for f in m.files:
        path = storage.local_path(f.path)
        with suppress(OSError):
            if path is not None and path.stat().st_mtime > written:
                out.append(storage.describe(f.path))
    return out


def not_a_file(storage: Storage, rel: str) -> bool:
    """Whether something other than a regular file (a folder, a FIFO, a device) is at `rel`
    of a local checkpoint."""
    path = storage.local_path(rel)
    if path is None:
        return False
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _ranges(blocks: set[int], size: int, block_size: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for bi in sorted(blocks):
        lo, hi = bi * block_size, min(size, (bi + 1) * block_size)
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def damage_list(target: ParityTarget, scan: ParityScan) -> list[DamagedFile]:
    m = scan.manifest
    bad_stripes = scan.unrecoverable_stripes()
    layout = ParityLayout(m)
    out = []
    for (kind, idx), (state, blocks) in sorted(scan.damaged.items()):
        if kind == "data":
            f = m.files[idx]
            where = target.storage.describe(f.path)
            stripes = {layout.position(idx, bi)[1] for bi in blocks}
        else:
            f = m.shares[idx]
            where = target.storage.describe(f"{target.parity_rel}/{f.path}")
            stripes = set(blocks)
        out.append(
            DamagedFile(
                path=where,
                kind="data" if kind == "data" else "parity",
                state=state,
                blocks=sorted(blocks),
                ranges=_ranges(blocks, f.size, m.block_size),
                repairable=not (stripes & bad_stripes),
            )
        )
    return out


def check_parity(
    src: str | Source, *, checksums: bool, progress: Progress = NULL_PROGRESS
) -> ParityCheck | None:
    """For `verify`: the parity manifest checked against the files (None: not protected).

    Without `checksums` only presence and sizes are compared (and, locally, modification
    times: a file changed after `protect` makes the parity stale); with `checksums` every block
    is hashed and compared with its digest, which names the damaged byte ranges (and a file
    whose blocks all match is not stale, whatever its time).
    """
    try:
        target = open_parity_target(src)
    except (UsageError, NotFoundError):
        return None
    m = read_parity_manifest(target)
    if m is None:
        return None
    storage = target.storage
    scan = scan_parity(target, m, checksums=checksums, progress=progress)
    report = ParityCheck(
        manifest=storage.describe(target.manifest_rel),
        parity=m.parity,
        width=m.width,
        damaged=damage_list(target, scan),
        misrecorded=misrecorded_text(target, scan),
        hashed_bytes=scan.hashed,
    )
    recorded = {f.path for f in m.files}
    if target.source.target is None:
        report.unprotected = [storage.describe(n) for n in target.files if n not in recorded]
    newer = newer_than_parity(target, m)
    damaged = {d.path for d in report.damaged if d.kind == "data" and d.state != "missing"}
    # without checksums a newer file is all there is to tell; with them every block was
    # compared, and a time alone (a file touched, copied without its times) says nothing, but
    # a changed file that is also newer than the parity may be a deliberate edit: said beside
    # the damage, so that `repair` is not run to undo it unawares
    report.stale = [w for w in newer if (w in damaged) == checksums]
    return report
