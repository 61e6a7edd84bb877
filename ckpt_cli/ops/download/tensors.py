"""`download --mode tensors`: only the byte ranges of the selected tensors, fetched with range
requests and streamed into a new safetensors checkpoint; fetched parts are kept for a rerun
(`PartialPieces`)."""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import threading
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

from ...errors import FormatError, Interrupted, NotFoundError
from ...faults import close_pool
from ...formats.base import Source, WriteOptions
from ...formats.names import SAFETENSORS_SUFFIX, is_commit_marker
from ...formats.safetensors.format import (
    SafetensorsCheckpoint,
    SafetensorsFormat,
    index_bytes,
    plan_shards,
)
from ...formats.safetensors.header import prefetch_headers, read_header
from ...formats.torch.format import TorchFormat
from ...formats.weight_map import INDEX_SUFFIX, find_index, read_index
from ...models import Entry
from ...progress import NULL_PROGRESS, Progress
from ...quant import with_sidecars
from ...storage import LocalStorage
from ...storage.hub import HubRepo, HubStorage, hub_errors
from ...storage.output import Destination, local_destination, staged_output
from ...storage.uri import Location
from ..inspect import select
from .plan import (
    COALESCE_MAX_GAP,
    COALESCE_SHARE,
    DEFAULT_SHARD_SIZE,
    PART_SIZE,
    PARTIAL_MARKER,
    PARTS_IN_FLIGHT,
    RANGE_WORKERS,
    RANGES_HASHED,
    RANGES_UNHASHED,
    DownloadFile,
    DownloadRange,
    DownloadReport,
    DownloadRequest,
    dcp_save_files,
    fsdp_save_files,
    fsdp_tensors_refused,
    index_selection,
    no_match,
    no_safetensors,
    planned_files,
    save_globs,
    skipped_files,
    state_left_behind,
    top_level_extras,
    training_state_files,
    unmatched_filters,
)
from .shards import fetch_files

# -- tensors mode ----------------------------------------------------------------------------


def plan_ranges(entries: list[Entry]) -> list[DownloadRange]:
    """Group raw tensors by file into range requests, coalescing neighbours.

    Two tensors share a request when the gap between them is at most `COALESCE_MAX_GAP` and at
    most `COALESCE_SHARE` of the bytes the request would carry, so coalescing never wastes more
    than about 1% of the transfer while saving a round trip per small tensor.
    """
    ranges: list[DownloadRange] = []
    by_file: dict[str, list[Entry]] = {}
    for entry in entries:
        assert entry.file is not None and entry.offset is not None
        by_file.setdefault(entry.file, []).append(entry)
    for file, group in by_file.items():
        group.sort(key=lambda e: e.offset or 0)
        current: DownloadRange | None = None
        useful = 0
        for entry in group:
            assert entry.offset is not None
            start, end = entry.offset, entry.offset + entry.nbytes
            if current is not None:
                gap = start - current.end
                if gap <= COALESCE_MAX_GAP and gap <= COALESCE_SHARE * (useful + entry.nbytes):
                    current.tensors.append(entry.name)
                    current.waste += gap
                    current.end = end
                    useful += entry.nbytes
                    continue
                ranges.append(current)
            current = DownloadRange(file=file, start=start, end=end, tensors=[entry.name])
            useful = entry.nbytes
        if current is not None:
            ranges.append(current)
    return ranges


class PartialPieces:
    """The byte ranges a tensors-mode download has fetched, kept on disk until DEST is published.

    Layout of the folder (`.NAME.ckpt-partial/` beside a local DEST; under the HF cache for an
    object-store DEST)::

        journal.json                      {"version", "repo", "commit"}: whose bytes these are
        pieces/<sha1(file)[:16]>/<start>-<end>   the bytes start..end (exclusive) of that file

    A piece appears whole or not at all (written to a temporary name, then renamed), so the
    folder listing is the journal of completed ranges and a SIGKILL at any moment leaves it
    consistent. Pieces are trusted only for the commit the journal names: a different commit
    (the branch moved) discards them all, so stale bytes are never reused; a piece whose size
    is not its name's length is discarded too. Any later selection reuses whatever pieces
    overlap the ranges it needs, and fetches only the gaps.
    """

    def __init__(self, folder: Path, repo_id: str, commit: str, *, dry_run: bool = False):
        self.folder = folder
        self.journal = {"version": 1, "repo": repo_id, "commit": commit}
        self.dry_run = dry_run
        #: bytes served from pieces (or, on a dry run, found present)
        self.resumed = 0
        self._lock = threading.Lock()
        self._pieces: dict[str, list[tuple[int, int]]] = {}
        self._starts: dict[str, list[int]] = {}
        self._load()

    @staticmethod
    def for_destination(dest: Destination, cache_dir: str) -> Path:
        """Where the partial folder of `dest` lives (an object-store DEST: in the HF cache)."""
        local = local_destination(dest)
        if local is None:
            key = hashlib.sha1(str(dest).encode()).hexdigest()[:16]
            return Path(cache_dir) / PARTIAL_MARKER / key
        return local.parent / f".{local.name}{PARTIAL_MARKER}"

    @staticmethod
    def _key(rel: str) -> str:
        return hashlib.sha1(rel.encode()).hexdigest()[:16]

    def _load(self) -> None:
        try:
            found = json.loads((self.folder / "journal.json").read_text())
        except (OSError, ValueError, RecursionError):
            found = None
        if found != self.journal:
            # another commit (or no journal): nothing here may be reused
            if not self.dry_run and self.folder.exists():
                shutil.rmtree(self.folder, ignore_errors=True)
            return
        for sub in (self.folder / "pieces").glob("*"):
            good: list[tuple[int, int]] = []
            for piece in sub.iterdir():
                start_s, _, end_s = piece.name.partition("-")
                if not (start_s.isdigit() and end_s.isdigit()):
                    continue  # a temporary file of a write that never finished
                start, end = int(start_s), int(end_s)
                if end > start and piece.stat().st_size == end - start:
                    good.append((start, end))
                elif not self.dry_run:
                    piece.unlink(missing_ok=True)
            # keep only pieces not inside another: then ends rise with starts (see `_cover`)
            good.sort(key=lambda p: (p[0], -p[1]))
            kept: list[tuple[int, int]] = []
            for start, end in good:
                if not kept or end > kept[-1][1]:
                    kept.append((start, end))
            self._pieces[sub.name] = kept
            self._starts[sub.name] = [p[0] for p in kept]

    def _cover(self, rel: str, start: int, end: int) -> list[tuple[int, int, bool]]:
        """`start..end` as consecutive segments `(s, e, present)`."""
        key = self._key(rel)
        pieces, starts = self._pieces.get(key, []), self._starts.get(key, [])
        out: list[tuple[int, int, bool]] = []
        pos = start
        while pos < end:
            i = bisect.bisect_right(starts, pos)
            if i and pieces[i - 1][1] > pos:
                stop = min(end, pieces[i - 1][1])
                out.append((pos, stop, True))
            else:
                stop = min(end, starts[i]) if i < len(starts) else end
                out.append((pos, stop, False))
            pos = stop
        return out

    def present(self, rel: str, start: int, end: int) -> int:
        """Bytes of `start..end` of `rel` that pieces hold."""
        return sum(e - s for s, e, have in self._cover(rel, start, end) if have)

    def read(self, storage: HubStorage, rel: str, start: int, length: int, keep: bool) -> bytes:
        """Bytes `start..start+length` of `rel`: from pieces where present, else fetched.

        With `keep`, each fetched segment is saved as a piece before it is returned.
        """
        blocks = []
        key = self._key(rel)
        for s, e, have in self._cover(rel, start, start + length):
            if have:
                i = bisect.bisect_right(self._starts[key], s) - 1
                p_start, p_end = self._pieces[key][i]
                with open(self.folder / "pieces" / key / f"{p_start}-{p_end}", "rb") as fh:
                    fh.seek(s - p_start)
                    data = fh.read(e - s)
                if len(data) != e - s:  # changed under us: fetch it instead
                    data = storage.read(rel, s, e - s)
                else:
                    with self._lock:
                        self.resumed += len(data)
            else:
                data = storage.read(rel, s, e - s)
                if keep:
                    self._save(key, s, data)
            blocks.append(data)
        return blocks[0] if len(blocks) == 1 else b"".join(blocks)

    def _save(self, key: str, start: int, data: bytes) -> None:
        folder = self.folder / "pieces" / key
        with self._lock:
            if not (self.folder / "journal.json").exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = self.folder / f".journal-{uuid.uuid4().hex}"
                tmp.write_text(json.dumps(self.journal))
                os.replace(tmp, self.folder / "journal.json")
            folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{start}-{start + len(data)}")

    def remove(self) -> None:
        """Delete the folder (DEST is published: its bytes are no longer needed)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _planned_weights(plan: list[Entry], options: WriteOptions) -> list[DownloadFile]:
    """The safetensors files (index first, as the writer lists them) a tensors-mode download
    writes for `plan`, with their exact sizes, for a dry run: it listed only the extras, so the
    weights the run then wrote were in no plan."""
    assert options.basename is not None
    groups = plan_shards(plan, options.max_shard_size)
    names = SafetensorsFormat.shard_names(options.basename, len(groups))
    files = [
        DownloadFile(
            path=name,
            size=SafetensorsFormat.planned_size(group, options.metadata) or 0,
            kind="weights",
            status="planned",
        )
        for name, group in zip(names, groups, strict=True)
    ]
    if len(groups) > 1:
        shard_of = {e.name: name for name, group in zip(names, groups, strict=True) for e in group}
        index = f"{options.basename}{INDEX_SUFFIX}"
        size = len(index_bytes(plan, shard_of))
        files.insert(0, DownloadFile(path=index, size=size, kind="index", status="planned"))
    return files


def _ordered_parts(
    storage: HubStorage, ranges: list[DownloadRange], pieces: PartialPieces | None = None
) -> Generator[bytes, None, None]:
    """The bytes of `ranges`, in order, as parts of at most `PART_SIZE` fetched in parallel.

    Up to `RANGE_WORKERS` range requests run at once and at most `PARTS_IN_FLIGHT` parts are
    held, so memory stays bounded (parts in flight × part size) whatever the tensor sizes,
    while many small or distant tensors do not pay one round trip each in sequence. With
    `pieces`, bytes an earlier run fetched are read from disk and each part fetched now is
    saved as it arrives (on the worker thread, so parts completed before a failure are kept).
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    def parts() -> Iterator[tuple[str, int, int]]:
        for request in ranges:
            for start in range(request.start, request.end, PART_SIZE):
                yield request.file, start, min(PART_SIZE, request.end - start)

    # ranges of shards already in the HF cache are local: no need to keep them twice
    keep = {r.file: storage.local_path(r.file) is None for r in ranges}

    def read(rel: str, start: int, length: int) -> bytes:
        if pieces is None:
            return storage.read(rel, start, length)
        return pieces.read(storage, rel, start, length, keep[rel])

    todo = parts()
    pending: collections.deque[Future[bytes]] = collections.deque()
    pool = ThreadPoolExecutor(max_workers=RANGE_WORKERS)
    try:
        for rel, start, length in itertools.islice(todo, PARTS_IN_FLIGHT):
            pending.append(pool.submit(read, rel, start, length))
        while pending:
            data = pending.popleft().result()
            for rel, start, length in itertools.islice(todo, 1):
                pending.append(pool.submit(read, rel, start, length))
            yield data
    finally:
        for future in pending:
            future.cancel()
        close_pool(pool)


class _Cursor:
    """Reads a ranged stream sequentially: `skip(n)` and `take(n)` in order."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks = blocks
        self._buffer = b""

    def _next(self, what: str) -> bytes:
        if not self._buffer:
            try:
                self._buffer = next(self._blocks)
            except StopIteration:
                raise FormatError(
                    f"the Hub's response ended early while reading {what}",
                    fix="Run the same `ckpt download` again: it fetches only the ranges it lacks.",
                ) from None
        return self._buffer

    def skip(self, n: int) -> None:
        while n:
            block = self._next("a gap")
            cut = min(n, len(block))
            self._buffer = block[cut:]
            n -= cut

    def take(self, n: int, what: str, progress: Progress) -> Iterator[bytes]:
        while n:
            block = self._next(what)
            cut = min(n, len(block))
            out, self._buffer = block[:cut], block[cut:]
            n -= cut
            progress.advance(len(out))
            yield out


def download_tensors(
    source: Source,
    storage: HubStorage,
    report: DownloadReport,
    dest: Destination | None,
    asked: DownloadRequest,
    progress: Progress,
) -> None:
    # a training save's weights answer to the names inspect shows too (`model.lm_head.weight`)
    include, exclude = save_globs(source, asked.tensors), save_globs(source, asked.exclude)
    extras, force = asked.extras, asked.force
    repo = storage.repo
    src = report.source
    if not SafetensorsFormat.detect(source):
        if TorchFormat.detect(source):
            raise FormatError(
                "holds no safetensors files: --mode tensors needs raw byte ranges to fetch",
                path=src,
                fix="Use --mode shards (torch.save shards are fetched whole).",
            )
        if fsdp_save_files(source, repo) is not None:
            raise fsdp_tensors_refused(src)
        if dcp_save_files(repo) is not None:
            raise fsdp_tensors_refused(src, dcp=True)
        raise no_safetensors(
            src, repo, "holds no safetensors files: --mode tensors needs raw byte ranges to fetch"
        )
    with hub_errors(src):
        checkpoint, total, max_shard, own = _open_selected(source, include, exclude)
    manifest = checkpoint.manifest
    chosen = select(manifest.tensors, include, exclude)
    if include:
        chosen = with_sidecars(chosen, manifest.tensors, exclude)  # a weight needs its scales
    chosen = [e for e in chosen if e.is_raw]
    # a training save's optimizer, scheduler, RNG... files are no byte ranges of its weights
    layout, state = training_state_files(source, own)
    if not chosen:
        raise no_match(src, asked.tensors, asked.exclude, layout, state)
    # a glob that matched a tensor opened its shard: the names of the shards opened suffice
    names = [e.name for e in manifest.tensors]
    report.warnings += unmatched_filters(names, asked.tensors, layout, state)
    report.tensors_total = total
    report.tensors_selected = len(chosen)
    report.selected_bytes = sum(e.nbytes for e in chosen)
    report.ranges = plan_ranges(chosen)
    report.bytes_planned = sum(r.length for r in report.ranges)
    index_rel = checkpoint.index
    left_behind = state_left_behind(
        layout,
        state,
        "--mode tensors writes the selected weights only; --mode shards fetches the whole save",
    )
    extra_files = (
        top_level_extras(
            repo,
            {h.file for h in checkpoint.headers} | {index_rel or ""},
            report.filters,
            own,
            state,
        )
        if extras
        else []
    )
    # the shards ranges are read from, the index that found them, the extras: the rest is named
    taken = {r.file for r in report.ranges} | set(extra_files)
    taken |= {index_rel} if index_rel else set()
    report.skipped = skipped_files(repo, taken, own, asked, left_behind)
    extra_plan = planned_files(repo, extra_files, "extra")
    report.bytes_planned += sum(f.size for f in extra_plan if f.status == "planned")
    report.metadata_bytes = storage.bytes_fetched
    cache_before = storage.bytes_from_cache
    pieces: PartialPieces | None = None
    if dest is not None:
        folder = PartialPieces.for_destination(dest, repo.settings.cache_dir)
        pieces = PartialPieces(folder, repo.repo_id, repo.commit, dry_run=report.dry_run)
        present = sum(pieces.present(r.file, r.start, r.end) for r in report.ranges)
        report.partial = str(folder)
        report.bytes_planned -= present
        if report.dry_run:
            report.bytes_resumed = present
    # keep the source's shard size (so the output is sharded like the source) and its names
    if index_rel:
        basename = Path(index_rel).name[: -len(INDEX_SUFFIX)]
    elif len(checkpoint.headers) == 1:  # one file keeps its name
        basename = Path(checkpoint.headers[0].file).name[: -len(SAFETENSORS_SUFFIX)]
    else:
        basename = "model"
    order = {name: i for i, name in enumerate(n for r in report.ranges for n in r.tensors)}
    plan = sorted(chosen, key=lambda e: order[e.name])
    # DEST says itself where its bytes came from and what they were checked for
    metadata = dict(manifest.metadata)
    metadata["ckpt.download.source"] = f"hf://{repo.repo_id}@{repo.commit}"
    metadata["ckpt.download.checked"] = (
        "ranges-sha256" if report.verify_ranges else "size-and-position"
    )
    options = WriteOptions(max_shard_size=max_shard, metadata=metadata, basename=basename)
    if report.dry_run:
        # the files the run writes from the ranges, then the extras it fetches, as it lists them
        report.files = _planned_weights(plan, options) + extra_plan
        return
    assert dest is not None and pieces is not None
    report.integrity = RANGES_HASHED if report.verify_ranges else RANGES_UNHASHED
    by_name = manifest.by_name
    digests: dict[str, str] = {}
    try:
        with staged_output(
            dest, commit_marker=is_commit_marker, force=force, progress=progress
        ) as staging:
            writer = SafetensorsFormat.writer(staging, plan, options)
            progress.start(report.selected_bytes, repo.repo_id)
            try:
                with contextlib.closing(_ordered_parts(storage, report.ranges, pieces)) as parts:
                    for request in report.ranges:
                        count = -(-request.length // PART_SIZE)
                        cursor = _Cursor(itertools.islice(parts, count))
                        pos = request.start
                        for name in request.tensors:
                            entry = by_name[name]
                            assert entry.offset is not None
                            cursor.skip(entry.offset - pos)
                            blocks = cursor.take(entry.nbytes, name, progress)
                            if report.verify_ranges:
                                blocks = _hashed(blocks, name, digests)
                            writer.write_raw(name, blocks)
                            pos = entry.offset + entry.nbytes
            finally:
                progress.finish()
            written = writer.finish()
            if report.verify_ranges:
                try:
                    _verify_ranges(storage, repo, plan, digests, progress)
                except FormatError:
                    pieces.remove()  # which kept range was wrong is unknown: keep none of them
                    raise
            report.bytes_transferred = storage.bytes_fetched - report.metadata_bytes
            report.bytes_from_cache = storage.bytes_from_cache - cache_before
            report.bytes_resumed = pieces.resumed
            # the output must open as a valid checkpoint before it is published
            local = Location(raw=str(dest), kind="local", path=staging)
            SafetensorsFormat.open(Source(location=local, storage=LocalStorage(staging))).close()
            report.files = [
                DownloadFile(
                    path=f.path,
                    size=f.size or 0,
                    kind="index" if f.path.endswith(INDEX_SUFFIX) else "weights",
                    status="written",
                    verified=report.verify_ranges,
                    checked="ranges-sha256" if report.verify_ranges else "size-and-position",
                )
                for f in written
            ]
            if extra_files:
                extra = report.model_copy(
                    update={"files": planned_files(repo, extra_files, "extra")}
                )
                report.bytes_transferred += fetch_files(repo, extra, NULL_PROGRESS)
                for info in extra.files:
                    assert info.cache_path is not None
                    target = staging / info.path
                    # `--include 'original/*'` picks files in subfolders too
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(info.cache_path, target)
                report.files.extend(extra.files)
    except Interrupted as exc:
        # the ranges fetched so far stay in the partial folder for the next run, not removed
        exc.problem = f"{exc.problem}; the ranges fetched so far are kept in {pieces.folder}"
        exc.fix = "Run the same `ckpt download` again: it fetches only the ranges it lacks."
        raise
    # DEST is published: the kept ranges have served their purpose
    pieces.remove()


def _open_selected(
    source: Source, include: list[str] | None, exclude: list[str] | None
) -> tuple[SafetensorsCheckpoint, int, int, set[str]]:
    """The checkpoint opened for the selection: (checkpoint, tensors in all, output shard size,
    every file of the checkpoint: its index and all its shards).

    With an index, only the shards it names for the selected tensors (and their scales) are
    opened: their headers are all that is read, so a filter that picks one expert of a
    163-shard model reads one header, not 163. Every tensor the index places in those shards
    must be in their headers. The output keeps the source's largest shard size (from the
    listing). Without an index, every safetensors file is opened (its header names its tensors).
    """
    storage = source.storage
    index_rel = find_index(source)
    if index_rel is None:
        checkpoint = SafetensorsFormat.open(source)
        files = {h.file for h in checkpoint.headers}
        return checkpoint, len(checkpoint.manifest.tensors), DEFAULT_SHARD_SIZE, files
    weight_map, index_meta = read_index(storage, index_rel)
    _, picked = index_selection(weight_map, include, exclude)
    listing = storage.list_files() if source.target is not None else source.files
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if shard not in listing:
            raise NotFoundError(
                f"the index names shard {shard!r}, which is missing",
                path=storage.describe(index_rel),
                fix="Fetch or copy the missing shard; `ckpt verify` lists every problem.",
            )
    needed = sorted({e.file for e in picked if e.file is not None})
    prefetch_headers(storage, needed, weight_map)
    headers = [read_header(storage, shard, listing[shard]) for shard in needed]
    checkpoint = SafetensorsCheckpoint.from_headers(
        source, headers, index_rel, weight_map, index_meta
    )
    found = checkpoint.manifest.by_name
    lost = [e for e in picked if e.name not in found]
    if lost:
        raise FormatError(
            f"the index places tensor {lost[0].name!r} in {lost[0].file}, whose header does "
            "not hold it" + (f" ({len(lost) - 1} more like it)" if len(lost) > 1 else ""),
            path=storage.describe(index_rel),
            fix="The index and the shards disagree; `ckpt verify` lists every problem.",
        )
    own = set(shards) | {index_rel}
    return checkpoint, len(weight_map), max(listing[shard] for shard in shards), own


def _hashed(blocks: Iterator[bytes], name: str, digests: dict[str, str]) -> Iterator[bytes]:
    """`blocks` unchanged; their sha256 is recorded as `digests[name]` once they are all read."""
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
        yield block
    digests[name] = digest.hexdigest()


def _verify_ranges(
    storage: HubStorage,
    repo: HubRepo,
    entries: list[Entry],
    digests: dict[str, str],
    progress: Progress,
) -> None:
    """Check the ranged bytes by hash: each source shard, streamed whole, must match the Hub's
    recorded sha256, and each tensor written must match that shard's bytes at its offsets.

    The Hub hashes whole files only, so this is what it takes to prove a range: the whole shard
    (read from the HF cache when it is there). One pass per shard, one block in memory.
    """
    by_file: dict[str, list[Entry]] = {}
    for entry in entries:
        assert entry.file is not None
        by_file.setdefault(entry.file, []).append(entry)
    wrong: list[str] = []
    progress.start(sum(storage.size(rel) for rel in by_file), "verifying ranges")
    try:
        for rel, group in sorted(by_file.items()):
            remote = repo.files[rel]
            group.sort(key=lambda e: e.offset or 0)
            whole = hashlib.sha256()
            tensor_digests = {e.name: hashlib.sha256() for e in group}
            pos = 0
            for block in storage.stream(rel, 0, remote.size):
                whole.update(block)
                end = pos + len(block)
                for e in group:
                    assert e.offset is not None
                    lo, hi = max(pos, e.offset), min(end, e.offset + e.nbytes)
                    if lo < hi:
                        tensor_digests[e.name].update(block[lo - pos : hi - pos])
                pos = end
                progress.advance(len(block))
            if remote.sha256 is None:
                raise FormatError(
                    "has no sha256 on the Hub (not an LFS file), so its ranges cannot be checked",
                    path=storage.describe(rel),
                    fix="Use --mode shards, which checks its git blob id.",
                )
            if whole.hexdigest() != remote.sha256:
                raise FormatError(
                    f"the bytes served do not match the Hub's recorded sha256 {remote.sha256[:16]}…",
                    path=storage.describe(rel),
                    fix="Run again later; nothing was written to DEST.",
                )
            wrong += [
                e.name for e in group if tensor_digests[e.name].hexdigest() != digests[e.name]
            ]
    finally:
        progress.finish()
    if wrong:
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise FormatError(
            f"{len(wrong)} tensor(s) came back wrong in range responses ({shown}): the whole "
            "shards match the Hub's sha256, the ranges did not",
            path=repo.display(),
            fix="A proxy or CDN served wrong ranges; nothing was written to DEST. Run again, or "
            "use --mode shards.",
        )
