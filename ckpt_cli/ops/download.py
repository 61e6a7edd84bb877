"""`download`: only the Hub shards, or only the byte ranges, that hold the tensors you ask for.

Both modes resolve the revision to a commit once and read the safetensors index (or the single
file's header) to map tensor names to shards.

* `shards` mode fetches whole files through `huggingface_hub.hf_hub_download`, pinned to the
  commit, so the HF cache, `HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_OFFLINE` and huggingface_hub's own
  resumption of dropped connections apply; files already cached are not fetched again, so a
  rerun after an interruption fetches only what is missing. Each file is then checked against
  the Hub's recorded size and sha256 (LFS) or git blob id (small files) and copied into DEST.
  When only some shards are fetched, DEST gets an index rewritten to name just those shards (and
  every tensor in them), so the folder is a complete checkpoint of its own.
* `tensors` mode reads the shard headers with range requests, then fetches only the byte ranges
  of the selected tensors (neighbours coalesced when the gap between them costs at most 1% of
  the range), streaming each range straight into the safetensors writer: peak memory is one
  block, and DEST is a valid safetensors checkpoint (sharded with an index when large).
  Every part fetched is also kept in a hidden partial folder beside DEST
  (`.NAME.ckpt-partial/`, see `PartialPieces`) until DEST is published, so a run that fails or
  is killed leaves what it fetched: the rerun reads those bytes locally and fetches only the rest.

DEST is published atomically (`output.staged_output`); `--dry-run` reads metadata only.
"""

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
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..errors import FormatError, NotFoundError, UsageError
from ..formats.base import Source, WriteOptions
from ..formats.safetensors import (
    INDEX_SUFFIX,
    SafetensorsCheckpoint,
    SafetensorsFormat,
    find_index,
    read_header,
    read_index,
)
from ..models import Entry
from ..output import Destination, RemoteDest, check_destination, resolve_destination, staged_output
from ..progress import NULL_PROGRESS, Progress
from ..quant import with_sidecars
from ..storage import LocalStorage
from ..storage.hub import HubRepo, HubStorage, RemoteFile, hub_errors, hub_mismatch, open_repo
from ..uri import Location, parse_location
from .inspect import select

Mode = Literal["shards", "tensors"]

#: top-level files that belong with a model (config, tokenizer, card, custom code)
EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".spm", ".md", ".py")
#: weight files: never "extras"
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
)
#: the index of sharded torch.save checkpoints (`pytorch_model.bin.index.json`)
BIN_INDEX_SUFFIX = ".bin.index.json"
#: a gap between two selected tensors is fetched (not split) when it costs at most this share
COALESCE_SHARE = 0.01
#: ... and is at most this many bytes
COALESCE_MAX_GAP = 1 << 20
#: output shards of a tensors-mode download are at most this large when the source is one file
DEFAULT_SHARD_SIZE = 5 * 1000**3
#: files fetched at once in shards mode (snapshot_download's default)
FETCH_WORKERS = 8
#: tensors mode: range requests at once, bytes per request, requests held in memory
RANGE_WORKERS = 8
PART_SIZE = 8 << 20
PARTS_IN_FLIGHT = 16
#: the folder beside DEST that keeps the ranges of an unfinished tensors-mode run
PARTIAL_MARKER = ".ckpt-partial"


class DownloadFile(BaseModel):
    """One file of a download.

    Attributes:
        path: path relative to the checkpoint (and to DEST).
        size: size in bytes as the Hub records it (or as written, for tensors-mode shards).
        kind: `weights`, `index` or `extra`.
        status: `fetched`, `cached` (already in the HF cache), `planned` (dry run), `written`
            (assembled from ranges), `rewritten` (index narrowed to the fetched shards).
        sha256: the Hub's recorded sha256 (LFS files).
        verified: the bytes were checked by hash: the file matched the Hub's size and checksum
            (shards mode), or, tensors mode with `--verify-ranges`, the source shards matched
            the Hub's sha256 and every tensor written matched them. Never true for bytes
            checked only for size and position.
        checked: how the bytes were checked: `sha256` / `git-blob` (the whole file against the
            Hub's record), `ranges-sha256` (tensors mode, `--verify-ranges`), `size-and-position`
            (tensors mode: each range response was the range asked, of the exact length; no
            hash covers ranges), None (not checked: offline, or planned).
        cache_path: where the file is in the HF cache.
    """

    path: str
    size: int
    kind: Literal["weights", "index", "extra"]
    status: Literal["fetched", "cached", "planned", "written", "rewritten"]
    sha256: str | None = None
    verified: bool = False
    checked: str | None = None
    cache_path: str | None = None


class DownloadRange(BaseModel):
    """One HTTP range request of a tensors-mode download.

    Attributes:
        file: the shard it reads.
        start / end: absolute byte offsets (end exclusive).
        tensors: the selected tensors it covers, in file order.
        waste: bytes in the range that belong to no selected tensor (coalesced gaps).
    """

    file: str
    start: int
    end: int
    tensors: list[str]
    waste: int = 0

    @property
    def length(self) -> int:
        """Bytes the range covers."""
        return self.end - self.start


class DownloadReport(BaseModel):
    """The result of `ckpt download`.

    Attributes:
        source: the hf:// location as given.
        repo / revision / commit: the repository, the revision asked for, the commit it names.
        mode: `shards` or `tensors`.
        dest: the folder written (None with --cache-only or --dry-run).
        dry_run / cache_only: how it ran.
        tensors_selected / tensors_total: selected tensors and all tensors of the checkpoint.
        selected_bytes: data bytes of the selected tensors (when the headers were read).
        files: the files fetched, found in the cache or written.
        ranges: the range requests (tensors mode).
        bytes_planned: bytes the download needs from the network (files in the HF cache and
            ranges kept by an unfinished earlier run excluded).
        bytes_transferred: bytes received for file data (0 for a dry run).
        bytes_from_cache: tensors mode: selected bytes read from shards already in the HF cache.
        bytes_resumed: tensors mode: range bytes an earlier, unfinished run of this download
            had fetched (same commit), read from its partial folder instead of fetched again
            (with --dry-run: the bytes already present).
        partial: tensors mode: the partial folder that keeps fetched ranges until DEST is
            published (removed on success).
        metadata_bytes: bytes received for headers and indexes.
        filters: the tensor globs (--filter as `tensors`, --filter-out as `exclude`) and the
            file globs (--include as `files_include`, --exclude as `files_exclude`).
        verify_ranges: tensors mode: the source shards were fetched whole and hashed to check
            the ranged bytes (`--verify-ranges`).
        integrity: tensors mode: what the written bytes were checked for, in words.
        quarantined: shards mode: files ckpt found not to match the Hub's record and removed
            from the HF cache (so no tool reads them and a rerun fetches them again).
        warnings: options that had no effect (a file glob that matches no file).
    """

    source: str
    repo: str
    revision: str
    commit: str
    mode: Mode
    dest: str | None = None
    dry_run: bool = False
    cache_only: bool = False
    tensors_selected: int = 0
    tensors_total: int = 0
    selected_bytes: int | None = None
    files: list[DownloadFile] = Field(default_factory=list)
    ranges: list[DownloadRange] = Field(default_factory=list)
    bytes_planned: int = 0
    bytes_transferred: int = 0
    bytes_from_cache: int = 0
    bytes_resumed: int = 0
    partial: str | None = None
    metadata_bytes: int = 0
    filters: dict[str, list[str]] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    verify_ranges: bool = False
    integrity: str | None = None
    quarantined: list[str] = Field(default_factory=list)


#: what a tensors-mode download can prove without --verify-ranges (report and DEST metadata)
RANGES_UNHASHED = (
    "size and position only: every range response was checked to be the range asked "
    "(206, Content-Range, exact length), but the Hub records a sha256 for whole files only, "
    "so the bytes of a range are not covered by a hash; --verify-ranges checks them"
)
RANGES_HASHED = (
    "sha256: the source shards were fetched whole (--verify-ranges), matched the Hub's "
    "recorded sha256, and every tensor written matched their bytes"
)


def download(
    src: str,
    dest: str | Path | None,
    *,
    tensors: list[str] | None = None,
    exclude: list[str] | None = None,
    mode: Mode = "shards",
    extras: bool = True,
    cache_only: bool = False,
    dry_run: bool = False,
    force: bool = False,
    verify_ranges: bool = False,
    progress: Progress = NULL_PROGRESS,
    include_files: list[str] | None = None,
    exclude_files: list[str] | None = None,
) -> DownloadReport:
    """Download the tensors of `src` (an hf:// location) matching `tensors` into `dest`.

    Args:
        src: `hf://org/repo[@revision][/subfolder]`.
        dest: the folder to create, local or an fsspec URL (`s3://bucket/prefix`: staged
            locally, then uploaded and published with the commit marker last); None only with
            `cache_only` or `dry_run`.
        tensors: globs of tensor names to fetch (all when empty).
        exclude: globs of tensor names to leave out.
        mode: `shards` (whole shards through the HF cache) or `tensors` (byte ranges only).
        extras: also fetch config/tokenizer files.
        cache_only: shards mode: fill the HF cache, write no DEST.
        dry_run: say what would be fetched; fetch only metadata.
        force: replace an existing DEST.
        verify_ranges: tensors mode: also fetch the source shards whole and check them against
            the Hub's sha256 and the written tensors against them (costs the whole shards).
        progress: receives bytes as they arrive.
        include_files / exclude_files: file globs (as `hf download --include/--exclude`) over
            the repository's other files: with `include_files`, the files fetched besides the
            weights are those it matches (any file, not only config and tokenizer files);
            `exclude_files` leaves files out. Weights are chosen by `tensors` / `exclude`.
    """
    location = parse_location(src)
    if location.kind != "hf":
        raise UsageError(
            "is not a Hub location",
            path=src,
            fix="Write it as hf://org/repo[@revision][/subfolder].",
        )
    if mode not in ("shards", "tensors"):
        raise UsageError(f"unknown mode {mode!r}", fix="Use --mode shards or --mode tensors.")
    if cache_only and mode == "tensors":
        raise UsageError(
            "--cache-only applies to --mode shards (tensors mode assembles a new checkpoint)",
            fix="Drop --cache-only or use --mode shards.",
        )
    if verify_ranges and mode != "tensors":
        raise UsageError(
            "--verify-ranges applies to --mode tensors (shards are always sha256-checked)",
            fix="Drop --verify-ranges, or use --mode tensors.",
        )
    if dest is None and not (cache_only or dry_run):
        raise UsageError("DEST is missing", fix="Name the folder to create, or pass --cache-only.")
    out = resolve_destination(dest) if dest is not None else None
    if out is not None and not dry_run and not cache_only:
        check_destination(out, force)
    repo = open_repo(location)
    storage = HubStorage(repo)
    source = Source(location=location, storage=storage, origin={"hub": repo.details()})
    report = DownloadReport(
        source=src,
        repo=repo.repo_id,
        revision=location.revision or "main",
        commit=repo.commit,
        mode=mode,
        dest=None if (cache_only or dry_run or dest is None) else str(dest),
        dry_run=dry_run,
        cache_only=cache_only,
        filters={
            "tensors": list(tensors or []),
            "exclude": list(exclude or []),
            "files_include": list(include_files or []),
            "files_exclude": list(exclude_files or []),
        },
        verify_ranges=verify_ranges,
    )
    _check_file_globs(repo, report)
    if mode == "shards":
        _download_shards(source, storage, report, out, tensors, exclude, extras, force, progress)
    else:
        assert out is not None or dry_run
        _download_tensors(source, storage, report, out, tensors, exclude, extras, force, progress)
    return report


# -- choosing what to fetch ------------------------------------------------------------------


def _extras(
    repo: HubRepo, weights: set[str], filters: dict[str, list[str]] | None = None
) -> list[str]:
    """Top-level config/tokenizer/card files (weight files and weight indexes excluded).

    `filters` carries the --include/--exclude file globs: --include picks the other files
    (any of them), --exclude leaves files out.
    """
    import fnmatch

    include = (filters or {}).get("files_include") or []
    exclude = (filters or {}).get("files_exclude") or []
    out = []
    for rel in repo.files:
        if rel in weights or rel.startswith(".") or rel.endswith(WEIGHT_SUFFIXES):
            continue
        if rel.endswith(".index.json"):
            continue
        if include:
            if not any(fnmatch.fnmatchcase(rel, g) for g in include):
                continue
        elif "/" in rel or not rel.endswith(EXTRA_SUFFIXES):
            continue
        if any(fnmatch.fnmatchcase(rel, g) for g in exclude):
            continue
        out.append(rel)
    return out


def _check_file_globs(repo: HubRepo, report: DownloadReport) -> None:
    """A file glob that matches no file of the repository has no effect: say so."""
    import fnmatch

    for option, key in (("--include", "files_include"), ("--exclude", "files_exclude")):
        for glob in report.filters.get(key, []):
            if not any(fnmatch.fnmatchcase(rel, glob) for rel in repo.files):
                report.warnings.append(
                    f"{option} {glob!r} matches no file of {repo.repo_id} (file globs, as in "
                    "hf download); to select tensors by name use --filter / --filter-out"
                )


def _no_match(src: str, include: list[str] | None, exclude: list[str] | None) -> NotFoundError:
    what = " or ".join(include or ["*"])
    if exclude:
        what += f" (excluding {' or '.join(exclude)})"
    return NotFoundError(
        f"no tensor matches {what}",
        path=src,
        fix="Check the pattern; `ckpt inspect --list " + src + "` lists every name.",
    )


def _index_entries(weight_map: dict[str, str]) -> list[Entry]:
    return [
        Entry.model_construct(
            name=name, kind="tensor", dtype=None, shape=[], nbytes=0, file=shard, offset=None
        )
        for name, shard in weight_map.items()
    ]


def _no_safetensors(src: str) -> FormatError:
    return FormatError(
        "holds no safetensors checkpoint (nor a pytorch_model.bin.index.json) at this revision",
        path=src,
        fix="Point at the folder holding the weights (hf://org/repo/subfolder), or use "
        "`hf download` for other files.",
    )


# -- shards mode -----------------------------------------------------------------------------


def _download_shards(
    source: Source,
    storage: HubStorage,
    report: DownloadReport,
    dest: Destination | None,
    include: list[str] | None,
    exclude: list[str] | None,
    extras: bool,
    force: bool,
    progress: Progress,
) -> None:
    repo = storage.repo
    src = report.source
    index_rel = find_index(source)
    weight_map: dict[str, str] | None = None
    if index_rel is not None:
        weight_map, _ = read_index(storage, index_rel)
        entries = _index_entries(weight_map)
    elif SafetensorsFormat.detect(source):
        # no index: the headers (ranged reads) name the tensors
        entries = SafetensorsFormat.open(source).manifest.tensors
    else:
        # older repositories: torch.save shards with `pytorch_model.bin.index.json` (same JSON)
        bin_indexes = [n for n in source.top_level() if n.endswith(BIN_INDEX_SUFFIX)]
        if len(bin_indexes) != 1:
            raise _no_safetensors(src)
        index_rel = bin_indexes[0]
        weight_map, _ = read_index(storage, index_rel)
        entries = _index_entries(weight_map)
    chosen = select(entries, include, exclude)
    if not chosen:
        raise _no_match(src, include, exclude)
    if include:
        chosen = with_sidecars(chosen, entries, exclude)  # a weight needs its scales
    report.tensors_total = len(entries)
    report.tensors_selected = len(chosen)
    if weight_map is None:  # sizes are known only when the headers were read
        report.selected_bytes = sum(e.nbytes for e in chosen)
    needed = sorted({e.file for e in chosen if e.file is not None})
    all_shards = sorted({e.file for e in entries if e.file is not None})
    for shard in needed:
        storage.remote(shard)  # NotFoundError if the index names a shard the repo lacks
    subset = weight_map is not None and needed != all_shards
    plan: list[tuple[str, Literal["weights", "index", "extra"]]] = [(s, "weights") for s in needed]
    if index_rel is not None and not subset:
        plan.insert(0, (index_rel, "index"))
    if extras:
        plan.extend(
            (rel, "extra") for rel in _extras(repo, set(needed) | {index_rel or ""}, report.filters)
        )
    report.metadata_bytes = storage.bytes_fetched

    report.files = [f for rel, kind in plan for f in _planned(repo, [rel], kind)]
    report.bytes_planned = sum(f.size for f in report.files if f.status == "planned")
    if report.dry_run:
        if subset:
            report.files.insert(0, _rewritten_index_info(index_rel, 0, "planned"))
        return

    report.bytes_transferred = _fetch_files(repo, report, progress)

    if report.cache_only:
        return
    assert dest is not None
    with staged_output(dest, force=force, progress=progress) as staging:
        for info in report.files:
            assert info.cache_path is not None
            target = staging / info.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(info.cache_path, target)
        if subset:
            assert weight_map is not None and index_rel is not None
            data = _narrowed_index(staging, weight_map, set(needed))
            (staging / index_rel).write_bytes(data)
            report.files.insert(0, _rewritten_index_info(index_rel, len(data), "rewritten"))


def _planned(repo: HubRepo, rels: list[str], kind: Any) -> list[DownloadFile]:
    """Download entries for `rels`, marked `cached` when the HF cache holds them already."""
    out = []
    for rel in rels:
        remote = repo.files[rel]
        cached = repo.cached_path(rel)
        out.append(
            DownloadFile(
                path=rel,
                size=remote.size,
                kind=kind,
                status="cached" if cached else "planned",
                sha256=remote.sha256,
                cache_path=cached,
            )
        )
    return out


def _rewritten_index_info(index_rel: str | None, size: int, status: Any) -> DownloadFile:
    assert index_rel is not None
    return DownloadFile(path=index_rel, size=size, kind="index", status=status)


def _narrowed_index(staging: Path, weight_map: dict[str, str], shards: set[str]) -> bytes:
    """An index naming only `shards` and every tensor they hold (read from their headers).

    torch.save shards have no header to read without unpickling: their index keeps the
    source's entries for those shards and leaves `total_size` out.
    """
    local = LocalStorage(staging)
    kept = {name: shard for name, shard in weight_map.items() if shard in shards}
    if not all(shard.endswith(".safetensors") for shard in shards):
        return (json.dumps({"metadata": {}, "weight_map": kept}, indent=2) + "\n").encode()
    total = 0
    for shard in sorted(shards):
        header = read_header(local, shard)
        for name, (_dtype, _shape, begin, end) in header.tensors.items():
            kept.setdefault(name, shard)
            total += end - begin
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(kept.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def _fetch_files(repo: HubRepo, report: DownloadReport, progress: Progress) -> int:
    """Fetch every file of `report` not yet in the HF cache, and check each against the Hub.

    Files are fetched with `hf_hub_download` (pinned to the commit) by `FETCH_WORKERS` threads,
    as `snapshot_download` does; each is hashed as soon as it lands (hashlib releases the GIL,
    so hashing overlaps the other transfers). Returns the bytes received.
    """
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    from huggingface_hub import hf_hub_download

    lock = threading.Lock()
    received = [0]

    class _Bar:
        """Stands in for tqdm inside huggingface_hub: forwards bytes to our progress."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def update(self, n: float | None = 1) -> None:
            amount = int(n or 0)
            with lock:
                received[0] += amount
                progress.advance(amount)

        def close(self) -> None:
            pass

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    storage_where = repo.display

    def fetch(info: DownloadFile) -> None:
        if info.status != "cached":
            with hub_errors(storage_where(info.path)):
                path = hf_hub_download(
                    repo.repo_id,
                    repo.repo_path(info.path),
                    repo_type=repo.repo_type,
                    revision=repo.commit,
                    cache_dir=repo.settings.cache_dir,
                    endpoint=repo.settings.endpoint,
                    token=repo.settings.token or None,
                    local_files_only=repo.settings.offline,
                    tqdm_class=_Bar,
                )
            info.cache_path = str(path)
            info.status = "fetched"
        assert info.cache_path is not None
        remote = repo.files[info.path]
        try:
            _check_against_hub(Path(info.cache_path), remote, storage_where(info.path))
        except FormatError as error:
            # ckpt found it wrong: out of the shared cache, so no tool reads it and a rerun
            # fetches it again
            removed = _quarantine(Path(info.cache_path))
            with lock:
                report.quarantined += removed
            raise FormatError(
                f"{error.problem}; ckpt removed it from the HF cache ({', '.join(removed)})",
                path=error.path,
                fix="Run the download again to fetch it again; if it keeps failing, the Hub "
                "or a proxy serves a bad copy.",
            ) from None
        info.verified = repo.snapshot is None  # offline: no recorded checksums to compare with
        if info.verified:
            info.checked = "sha256" if remote.sha256 else "git-blob"

    progress.start(report.bytes_planned, repo.repo_id)
    pool = ThreadPoolExecutor(max_workers=max(1, min(FETCH_WORKERS, len(report.files))))
    try:
        futures = [pool.submit(fetch, info) for info in report.files]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.finish()
    return received[0]


def _quarantine(cached: Path) -> list[str]:
    """Remove a bad file from the HF cache: its snapshot link and the blob it points to.

    Only what ckpt itself found wrong; returns the paths removed. A blob is shared by every
    snapshot of the same content, so all of them would serve the bad bytes: it goes too.
    """
    removed: list[str] = []
    targets = [cached]
    if cached.is_symlink():
        targets.append(cached.resolve())
    for path in targets:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(str(path))
    return removed


def _check_against_hub(path: Path, remote: RemoteFile, where: str) -> None:
    """The local copy has the Hub's recorded size and checksum (FormatError if not)."""
    problem = hub_mismatch(path, remote)
    if problem is not None:
        raise FormatError(
            problem,
            path=where,
            fix=f"Delete {path} from the HF cache (`hf cache rm`) and run the download again.",
        )


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
        if isinstance(dest, RemoteDest):
            key = hashlib.sha1(dest.url.encode()).hexdigest()[:16]
            return Path(cache_dir) / PARTIAL_MARKER / key
        return dest.parent / f".{dest.name}{PARTIAL_MARKER}"

    @staticmethod
    def _key(rel: str) -> str:
        return hashlib.sha1(rel.encode()).hexdigest()[:16]

    def _load(self) -> None:
        try:
            found = json.loads((self.folder / "journal.json").read_text())
        except (OSError, ValueError):
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
        pool.shutdown(wait=True, cancel_futures=True)


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
                raise FormatError(f"the Hub's response ended early while reading {what}") from None
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


def _download_tensors(
    source: Source,
    storage: HubStorage,
    report: DownloadReport,
    dest: Destination | None,
    include: list[str] | None,
    exclude: list[str] | None,
    extras: bool,
    force: bool,
    progress: Progress,
) -> None:
    repo = storage.repo
    src = report.source
    if not SafetensorsFormat.detect(source):
        raise FormatError(
            "holds no safetensors files: --mode tensors needs raw byte ranges to fetch",
            path=src,
            fix="Use --mode shards (torch.save shards are fetched whole).",
        )
    with hub_errors(src):
        checkpoint: SafetensorsCheckpoint = SafetensorsFormat.open(source)
    manifest = checkpoint.manifest
    chosen = select(manifest.tensors, include, exclude)
    if include:
        chosen = with_sidecars(chosen, manifest.tensors, exclude)  # a weight needs its scales
    chosen = [e for e in chosen if e.is_raw]
    if not chosen:
        raise _no_match(src, include, exclude)
    report.tensors_total = len(manifest.tensors)
    report.tensors_selected = len(chosen)
    report.selected_bytes = sum(e.nbytes for e in chosen)
    report.ranges = plan_ranges(chosen)
    report.bytes_planned = sum(r.length for r in report.ranges)
    index_rel = checkpoint.index
    extra_files = (
        _extras(repo, {h.file for h in checkpoint.headers} | {index_rel or ""}, report.filters)
        if extras
        else []
    )
    extra_plan = _planned(repo, extra_files, "extra")
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
    if report.dry_run:
        report.files = extra_plan
        return
    assert dest is not None and pieces is not None

    # keep the source's shard size (so the output is sharded like the source) and its names
    shard_sizes = [h.size for h in checkpoint.headers]
    max_shard = max(shard_sizes) if index_rel is not None else DEFAULT_SHARD_SIZE
    if index_rel:
        basename = Path(index_rel).name[: -len(INDEX_SUFFIX)]
    elif len(checkpoint.headers) == 1:  # one file keeps its name
        basename = Path(checkpoint.headers[0].file).name[: -len(".safetensors")]
    else:
        basename = "model"
    order = {name: i for i, name in enumerate(n for r in report.ranges for n in r.tensors)}
    plan = sorted(chosen, key=lambda e: order[e.name])
    report.integrity = RANGES_HASHED if report.verify_ranges else RANGES_UNHASHED
    # DEST says itself where its bytes came from and what they were checked for
    metadata = dict(manifest.metadata)
    metadata["ckpt.download.source"] = f"hf://{repo.repo_id}@{repo.commit}"
    metadata["ckpt.download.checked"] = (
        "ranges-sha256" if report.verify_ranges else "size-and-position"
    )
    options = WriteOptions(max_shard_size=max_shard, metadata=metadata, basename=basename)
    by_name = manifest.by_name
    digests: dict[str, str] = {}
    with staged_output(dest, force=force, progress=progress) as staging:
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
            extra = report.model_copy(update={"files": _planned(repo, extra_files, "extra")})
            report.bytes_transferred += _fetch_files(repo, extra, NULL_PROGRESS)
            for info in extra.files:
                assert info.cache_path is not None
                shutil.copyfile(info.cache_path, staging / info.path)
            report.files.extend(extra.files)
    # DEST is published: the kept ranges have served their purpose
    pieces.remove()


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
