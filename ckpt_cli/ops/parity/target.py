"""The checkpoint being protected or repaired: its files, storage and parity manifest."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from ...dist.command import active
from ...errors import FormatError, NoCheckpointError, NotFoundError, UsageError
from ...formats import resolve_source
from ...formats.base import Source
from ...sources.runs.records import CHECKSUM_MANIFEST
from ...storage import (
    PARITY_DIR,
    LocalStorage,
    Storage,
    is_parity_path,
    safe_relpath,
)
from ...storage.output import TMP_MARKER, Destination
from ...storage.uri import parse_location
from .layout import plan_layout, small_block
from .model import (
    BLOCK_ALIGN,
    CODEC,
    EC_TYPES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_CONTAINERS,
    MAX_PARITY,
    MAX_WIDTH,
    PARITY_VERSION,
    ParityManifest,
)

# ------------------------------------------------------------------------------ where things are


@dataclass
class ParityTarget:
    """A checkpoint as protect/repair see it: its storage, data files and parity folder."""

    source: Source
    storage: Storage
    #: data file name -> size (the parity folder and ckpt-manifest.json excluded)
    files: dict[str, int]
    #: the parity folder, relative to the storage root
    parity_rel: str

    @property
    def manifest_rel(self) -> str:
        return f"{self.parity_rel}/{MANIFEST_NAME}"


def open_parity_target(src: str | Source, *, rebuilding: bool = False) -> ParityTarget:
    """The checkpoint at `src`. `rebuilding` (repair, verify of parity): a single file deleted
    outright is still its parity's target, found by the parity `protect` wrote beside it."""
    if rebuilding and isinstance(src, str):
        lost = lost_single_file(src)
        if lost is not None:
            assert lost.target is not None
            return ParityTarget(lost, lost.storage, {}, f"{PARITY_DIR}/{lost.target}")
    source = src if isinstance(src, Source) else resolve_source(src)
    storage = source.storage
    if not storage.writable:  # the parity is written beside the files (the Hub: one commit)
        raise UsageError(
            "protect and repair work on local folders and object stores",
            path=source.location.raw,
            fix="A Hub repository changes only by commits, so ckpt keeps no parity there: "
            "upload a damaged file again from a good copy (a new commit)."
            if rebuilding
            else "Download the checkpoint first (`ckpt download`), then protect the copy.",
        )
    if source.target is not None:
        files = {source.target: source.files[source.target]}
        parity_rel = f"{PARITY_DIR}/{source.target}"
    else:
        files = {
            name: size
            for name, size in source.files.items()
            if name != CHECKSUM_MANIFEST and TMP_MARKER not in name
        }
        parity_rel = PARITY_DIR
    if not files and not rebuilding:
        # (a repair of a folder whose every file was lost reads what its parity lists)
        raise NoCheckpointError(
            "holds no checkpoint files to protect or repair",
            path=source.location.raw,
            fix="Point at the checkpoint folder or file itself.",
        )
    return ParityTarget(source, storage, files, parity_rel)


def lost_single_file(src: str) -> Source | None:
    """A local single-file checkpoint that is gone while the parity `protect` wrote for it
    (`.ckpt-parity/NAME/` beside it) is there: the source of a repair that recreates it (with
    `--whole-files` parity a file lost whole comes back). None for anything else."""
    loc = parse_location(src)
    path = loc.path
    if loc.kind != "local" or path is None or path.exists() or path.is_symlink():
        return None
    if not (path.parent / PARITY_DIR / path.name / MANIFEST_NAME).is_file():
        return None
    return Source(location=loc, storage=LocalStorage(path.parent), target=path.name)


def parity_dest(target: ParityTarget) -> Destination:
    """The parity folder as an output destination of the checkpoint's storage."""
    return target.storage.destination(target.parity_rel)


def written_at(target: ParityTarget, rel: str) -> int | None:
    """When data file `rel` was last written (ns), for a file on this machine; None in an
    object store (whose objects `repair` cannot date)."""
    local = target.storage.local_path(rel)
    return local.lstat().st_mtime_ns if local is not None else None


def checkpoint_folder(target: ParityTarget) -> Path | None:
    """The checkpoint folder on this machine (a folder SRC), else None."""
    return target.storage.local_root if target.source.target is None else None


@contextmanager
def folder_time_kept(target: ParityTarget, protected_ns: int | None = None) -> Iterator[None]:
    """Give the checkpoint folder (local, a folder SRC) back the modification time it had
    before the block: publishing the parity, or a rebuilt file, renames an entry into it,
    which would date the save now, and `latest` and `prune` (the settle window,
    `--keep-within`) would take an old save protected or repaired today for a fresh one.

    `protected_ns` (repair: the folder's time when protected): the folder is dated no later
    than that or its newest entry, whichever is newer, so a deleted file put back leaves the
    save as old as it was (an entry added since keeps its own, newer, time)."""
    folder = checkpoint_folder(target)
    before = folder.stat().st_mtime_ns if folder is not None else None
    yield
    if folder is None or before is None:
        return
    # the time is the save's record, not its content: a folder whose time this user may not
    # set (another's, shared) keeps the new one, and the parity or repair stands
    with suppress(OSError):
        stamp = before
        if protected_ns is not None:
            entries = [e for e in os.scandir(folder) if not is_parity_path(e.name)]
            newest = max((e.stat(follow_symlinks=False).st_mtime_ns for e in entries), default=0)
            stamp = min(before, max(protected_ns, newest))
        now = folder.stat()
        if now.st_mtime_ns != stamp:
            os.utime(folder, ns=(now.st_atime_ns, stamp))


def read_parity_manifest(target: ParityTarget) -> ParityManifest | None:
    """The parity manifest of the checkpoint, or None when it is not protected."""
    storage = target.storage
    where = storage.describe(target.manifest_rel)
    fix = (
        "The manifest is corrupt or was altered: protect the checkpoint again "
        "(`ckpt protect SRC --force`) from an intact copy."
    )
    try:
        # checked before it is read (a manifest is read whole): no manifest chooses the memory
        size = storage.size(target.manifest_rel)
        if size > MAX_MANIFEST_BYTES:
            raise FormatError(
                f"is {size:,} bytes, more than the {MAX_MANIFEST_BYTES:,} a parity manifest may "
                "take (7 million blocks); ckpt refuses it (a hostile or corrupt manifest)",
                path=where,
                fix=fix,
            )
        raw = storage.read_all(target.manifest_rel)
    except NotFoundError:
        return None
    if raw.count(b"[") + raw.count(b"{") > MAX_MANIFEST_CONTAINERS:
        raise FormatError(
            f"holds more than {MAX_MANIFEST_CONTAINERS:,} JSON arrays and objects, which no "
            "parity manifest needs (two per file); ckpt refuses it (a hostile or corrupt "
            "manifest)",
            path=where,
            fix=fix,
        )
    try:
        manifest = ParityManifest.model_validate(json.loads(raw))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # too deep: hostile
        raise FormatError(
            f"is not a valid ckpt parity manifest ({str(exc).splitlines()[0]})",
            path=storage.describe(target.manifest_rel),
            fix="Protect the checkpoint again: `ckpt protect SRC --force`.",
        ) from None
    _check_manifest(manifest, storage.describe(target.manifest_rel))
    return manifest


def _check_manifest(m: ParityManifest, where: str) -> None:
    """Refuse manifests whose numbers do not add up (corrupt or hostile): no huge allocations."""
    if m.ec_type not in EC_TYPES:
        raise FormatError(
            f"names the erasure code {m.ec_type!r}, which is none pyeclib has (ckpt protect "
            f"writes {EC_TYPES[0]!r}): the manifest is corrupt",
            path=where,
            fix="Protect the checkpoint again: `ckpt protect SRC --force`.",
        )
    bad = (
        m.ckpt_parity != PARITY_VERSION
        or m.codec != CODEC
        or not 1 <= m.width <= MAX_WIDTH
        or not 1 <= m.parity <= MAX_PARITY
        or m.block_size <= 0
        or m.block_size % BLOCK_ALIGN
        or m.block_size > 1 << 30
        or m.stripes < 1
        or len(m.shares) != m.parity
        or any(len(s.blocks) != m.stripes or s.size != m.stripes * m.block_size for s in m.shares)
    )
    # every name must stay inside the checkpoint (repair writes to these names)
    for f in m.files:
        if safe_relpath(f.path, source=where) != f.path or is_parity_path(f.path):
            bad = True
    if [s.path for s in m.shares] != [f"parity-{j}.bin" for j in range(len(m.shares))]:
        bad = True
    spans = []
    total = 0
    for f in m.files:
        n = -(-f.size // m.block_size)
        total += n
        if f.size < 0 or len(f.blocks) != n:
            bad = True
        if n:
            spans.append((f.start, f.start + n))
    spans.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        bad = True  # two files claim one block
    if spans and (spans[0][0] < 0 or spans[-1][1] > m.width * m.stripes):
        bad = True
    if bad or total != m.total_blocks:
        raise FormatError(
            "is not a consistent ckpt parity manifest",
            path=where,
            fix="Protect the checkpoint again: `ckpt protect SRC --force`.",
        )
    _check_protect_would_choose(m, where)


def _check_protect_would_choose(m: ParityManifest, where: str) -> None:
    """Refuse a layout `protect` would not have written for these files: the block size, the
    width and the stripes decide what verify and repair read (and the decoder's memory), so a
    manifest may not choose them. `protect` takes blocks of at most 1/64 of the longest file
    (a power of two, 4 KiB at least) and the layout `plan_layout` gives the files' sizes; the
    parity shares are then K x stripes x block_size, about K/W of the data."""
    sizes = [f.size for f in m.files]
    cap = small_block(max(sizes, default=0))
    if m.block_size > cap:
        raise FormatError(
            f"is not a ckpt parity manifest protect would write: block_size {m.block_size} is "
            f"larger than the {cap} bytes protect uses for a longest file of "
            f"{max(sizes, default=0)} bytes",
            path=where,
            fix="The manifest is corrupt or was altered: protect the checkpoint again "
            "(`ckpt protect SRC --force`) from an intact copy.",
        )
    starts = [f.start for f in m.files]
    # protect stripes the files, or, for a save's per-rank files (or --whole-files), gives
    # every file its own place in a column: either layout, never one a manifest makes up
    plans = [plan_layout(sizes, m.block_size, whole_files=whole) for whole in (False, True)]
    if not any(
        (plan.width, plan.stripes, plan.whole_files, plan.starts)
        == (m.width, m.stripes, m.whole_files, starts)
        for plan in plans
    ):
        # the plan of the manifest's own kind (whole files or striped) says what differs
        plan = plans[1] if m.whole_files else plans[0]
        if (plan.width, plan.stripes) != (m.width, m.stripes):
            differs = (
                f"width {m.width} and {m.stripes} stripes, where its files give width "
                f"{plan.width} and {plan.stripes} stripes"
            )
        else:
            moved = [
                (f.path, at, want)
                for f, at, want in zip(m.files, starts, plan.starts, strict=True)
                if at != want
            ]
            differs = (
                f"{moved[0][0]} starts at block {moved[0][1]}, where protect puts it at block "
                f"{moved[0][2]}"
                if moved
                else f"whole_files is {m.whole_files}, which its layout is not"
            )
        raise FormatError(
            f"is not a ckpt parity manifest protect would write: {differs}",
            path=where,
            fix="The manifest is corrupt or was altered: protect the checkpoint again "
            "(`ckpt protect SRC --force`) from an intact copy.",
        )


# ------------------------------------------------------------------------------ protect


M = TypeVar("M", bound=BaseModel)


def on_leader(work: Callable[[], M], model: type[M]) -> M:
    """Run `work` on rank 0 only (under torchrun the others wait), the result on every rank.

    Every rank writing the same parity or rebuilding the same file would race on one staging
    name (a repair rebuilds a few files: one process suffices).
    """
    workers = active()
    result: M | None = None
    with workers.together():
        if workers.leader:
            result = work()
    if not workers.distributed:
        assert result is not None
        return result
    shared = workers.broadcast(result.model_dump(mode="json") if result is not None else None)
    return model.model_validate(shared)


def check_unchanged(target: ParityTarget) -> None:
    """Refuse to bless parity of files that changed while they were read: in size, or (a
    local file) rewritten in place or replaced since ckpt first opened it. Parity of such a
    file would record blocks of two versions, and `repair` would then "restore" the blocks
    of the old one into the new."""
    storage = target.storage
    rewritten = set(storage.changed_since_read())
    # a local file is stat-ed again; an object store answers from its one listing (objects are
    # replaced whole, never rewritten in place)
    for name, size in target.files.items():
        try:
            now = storage.size(name)
        except NotFoundError:
            now = -1
        if now != size or storage.describe(name) in rewritten:
            raise FormatError(
                "changed while it was being protected",
                path=storage.describe(name),
                fix="Protect the checkpoint once its writer has finished.",
            )


class BlockReader:
    """Reads blocks, keeping local files open (one `pread` per block, no reopen)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        # a local folder's files are kept open (one pread per block); others read through it
        path = self.storage.local_path(rel) if self.storage.local_root is not None else None
        if path is None:
            return self.storage.read(rel, offset, length)
        with self._lock:  # blocks are read from several threads
            fd = self._fds.get(rel)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFoundError(
                        "file not found",
                        path=str(path),
                        fix="It was moved or deleted while ckpt read the checkpoint: put it back "
                        "(`ckpt repair` rebuilds a protected one) and run the same command again.",
                    ) from None
                self._fds[rel] = fd
        data = os.pread(fd, length, offset)
        if len(data) != length:
            return self.storage.read(rel, offset, length)  # raises the truncation error
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            with suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self.storage.close()


def sha256_storage(reader: BlockReader, rel: str, size: int) -> str:
    h = hashlib.sha256()
    for lo in range(0, size, 4 << 20):
        h.update(reader.read(rel, lo, min(4 << 20, size - lo)))
    return h.hexdigest()


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
