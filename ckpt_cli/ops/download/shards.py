"""`download --mode shards`: whole files through `huggingface_hub.hf_hub_download`, pinned to
the commit, checked against the Hub's size and sha256 / git blob id, copied into DEST."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import FormatError, IOFailure
from ...faults import close_pool, io_failure, submit_tracked
from ...formats.base import Source
from ...formats.names import SAFETENSORS_SUFFIX, is_commit_marker
from ...formats.safetensors.format import SafetensorsFormat
from ...formats.safetensors.header import read_header
from ...formats.torch.format import TorchFormat
from ...formats.weight_map import BIN_INDEX_SUFFIX, MAX_INDEX_BYTES, find_index, read_index
from ...progress import NULL_PROGRESS, Progress
from ...quant import with_sidecars
from ...storage import LocalStorage
from ...storage.hub import HubRepo, HubStorage, RemoteFile, hub_errors, hub_mismatch, retrying
from ...storage.output import Destination, staged_output
from ..inspect import select
from .plan import (
    FETCH_WORKERS,
    DownloadFile,
    DownloadReport,
    DownloadRequest,
    FileKind,
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

# -- shards mode -----------------------------------------------------------------------------


def download_shards(
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
    index_rel = find_index(source)
    weight_map: dict[str, str] | None = None
    fmt: type[SafetensorsFormat] | type[TorchFormat] = SafetensorsFormat
    if index_rel is None and not SafetensorsFormat.detect(source):
        # older repositories: torch.save shards with `pytorch_model.bin.index.json` (same JSON),
        # or one `pytorch_model.bin` (its tensors named by ranged reads of its pickle)
        bin_indexes = [n for n in source.top_level() if n.endswith(BIN_INDEX_SUFFIX)]
        if len(bin_indexes) == 1:
            index_rel = bin_indexes[0]
        elif not bin_indexes and TorchFormat.detect(source):
            fmt = TorchFormat
        else:
            # FSDP's own files, or a DCP at the root (a torchtitan step): fetched whole
            fsdp = fsdp_save_files(source, repo) or dcp_save_files(repo)
            if fsdp is None:
                raise no_safetensors(src, repo)
            _download_whole_save(source, storage, report, dest, asked, progress, fsdp)
            return
    index_file: DownloadFile | None = None
    index_received = 0
    if index_rel is not None:
        index_file, index_received = _index_first(repo, index_rel, report)
        # read from the HF cache when it is there (fetched just now): read once, not twice
        weight_map, _ = read_index(storage, index_rel)
        # a weight needs its scales (the second list)
        picked, chosen = index_selection(weight_map, include, exclude)
        total = len(weight_map)
        all_shards = sorted(set(weight_map.values()))
    else:
        # no index: the headers (ranged reads) name the tensors
        opened = fmt.open(source)
        entries = opened.manifest.tensors
        opened.close()
        picked = chosen = select(entries, include, exclude)
        if include:
            chosen = with_sidecars(chosen, entries, exclude)
        total = len(entries)
        all_shards = sorted({e.file for e in entries if e.file is not None})
    checkpoint = set(all_shards) | ({index_rel} if index_rel is not None else set())
    # a training save (a Trainer's `last-checkpoint/`) is its weights and its state: a whole
    # download fetches both; tensors chosen by name are weights only, the state stays behind
    layout, state = training_state_files(source, checkpoint)
    if not picked:
        raise no_match(src, asked.tensors, asked.exclude, layout, state)
    names = list(weight_map) if weight_map is not None else [e.name for e in entries]
    report.warnings += unmatched_filters(names, asked.tensors, layout, state)
    report.tensors_total = total
    report.tensors_selected = len(chosen)
    if weight_map is None:  # sizes are known only when the headers were read
        report.selected_bytes = sum(e.nbytes for e in chosen)
    needed = sorted({e.file for e in chosen if e.file is not None})
    for shard in needed:
        storage.remote(shard)  # NotFoundError if the index names a shard the repo lacks
    subset = weight_map is not None and needed != all_shards
    plan: list[tuple[str, FileKind]] = [(s, "weights") for s in needed]
    if index_rel is not None:
        # the repository's own index goes into the HF cache even when DEST gets a narrowed
        # one: without it, the cached snapshot (what HF_HUB_OFFLINE=1 reads) would hold a
        # shard or two and nothing saying the model has more, and read as a whole model
        plan.insert(0, (index_rel, "index"))
    left_behind: dict[str, str] = {}
    if include or exclude:
        left_behind = state_left_behind(
            layout, state, "fetched whole when no --filter / --filter-out narrows the weights"
        )
    elif not asked.include_files:
        plan.extend((rel, "state") for rel in sorted(state) if not _excluded(rel, asked))
    if extras:
        plan.extend(
            (rel, "extra")
            for rel in top_level_extras(
                repo, set(needed) | {index_rel or ""}, report.filters, checkpoint, state
            )
        )
    taken = {rel for rel, _ in plan} | ({index_rel} if subset and index_rel else set())
    report.skipped = skipped_files(repo, taken, checkpoint, asked, left_behind)
    report.metadata_bytes = storage.bytes_fetched

    report.files = [
        f
        for rel, kind in plan
        for f in (
            [index_file] if index_file and rel == index_rel else planned_files(repo, [rel], kind)
        )
    ]
    report.bytes_planned = sum(f.size for f in report.files if f.status in ("planned", "fetched"))
    narrowed = subset and not report.cache_only  # DEST gets its own index, not the repo's
    if report.dry_run:
        if narrowed:
            report.files = [f for f in report.files if f.path != index_rel]
            report.files.insert(0, _rewritten_index_info(index_rel, 0, "planned"))
        return

    report.bytes_transferred = index_received + fetch_files(repo, report, progress)

    if report.cache_only:
        return
    assert dest is not None
    if narrowed:
        report.files = [f for f in report.files if f.path != index_rel]
    with staged_output(
        dest, commit_marker=is_commit_marker, force=force, progress=progress
    ) as staging:
        _copy_into(staging, report.files)
        if subset:
            assert weight_map is not None and index_rel is not None
            data = _narrowed_index(staging, weight_map, set(needed))
            (staging / index_rel).write_bytes(data)
            report.files.insert(0, _rewritten_index_info(index_rel, len(data), "rewritten"))


def _download_whole_save(
    source: Source,
    storage: HubStorage,
    report: DownloadReport,
    dest: Destination | None,
    asked: DownloadRequest,
    progress: Progress,
    save: tuple[str, set[str], set[str]],
) -> None:
    """An FSDP training save (`fsdp_save_files`: DCP folders or FSDP state-dict files), or a
    DCP checkpoint at the root (`dcp_save_files`: a torchtitan step), fetched whole: its
    weights, its optimizer, scheduler, RNG and trainer state, and the extras, each checked
    against the Hub, so DEST resumes as the source would. Tensor globs are refused
    (`fsdp_tensors_refused`). The tensors are counted from the copy written (reading the
    save's headers over the network would cost as much as its small files); a dry run or
    `--cache-only` counts none."""
    layout, weights, state = save
    if asked.tensors or asked.exclude:
        raise fsdp_tensors_refused(report.source, dcp=layout == "dcp")
    repo = storage.repo
    plan: list[tuple[str, FileKind]] = [(rel, "weights") for rel in sorted(weights)]
    plan.extend((rel, "state") for rel in sorted(state) if not _excluded(rel, asked))
    if asked.extras:
        plan.extend(
            (rel, "extra")
            for rel in top_level_extras(repo, weights, report.filters, weights, state)
        )
    report.skipped = skipped_files(repo, {rel for rel, _ in plan}, set(), asked)
    report.metadata_bytes = storage.bytes_fetched
    report.files = [f for rel, kind in plan for f in planned_files(repo, [rel], kind)]
    report.bytes_planned = sum(f.size for f in report.files if f.status in ("planned", "fetched"))
    if report.dry_run:
        return
    report.bytes_transferred = fetch_files(repo, report, progress)
    if report.cache_only:
        return
    assert dest is not None
    with staged_output(
        dest, commit_marker=is_commit_marker, force=asked.force, progress=progress
    ) as staging:
        _copy_into(staging, report.files)
        report.tensors_total = report.tensors_selected = _weights_in(staging)


def _weights_in(save: Path) -> int:
    """The model tensors of the training save at `save` (local), as `inspect` counts them; 0
    when it does not open (a damaged save is still copied whole: `ckpt verify` says what)."""
    from ...errors import CkptError
    from ...sources.opening import open_source

    try:
        opened = open_source(str(save))
    except CkptError:
        return 0
    try:
        return opened.training.weights.get("tensors", 0) if opened.training else 0
    finally:
        opened.checkpoint.close()


def _copy_into(staging: Path, files: list[DownloadFile]) -> None:
    """Copy each fetched (and checked) file from the HF cache to its place in `staging`."""
    for info in files:
        assert info.cache_path is not None
        target = staging / info.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(info.cache_path, target)


def _excluded(rel: str, asked: DownloadRequest) -> bool:
    """Whether an --exclude file glob leaves `rel` out."""
    import fnmatch

    return any(fnmatch.fnmatchcase(rel, glob) for glob in asked.exclude_files or [])


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
    if not all(shard.endswith(SAFETENSORS_SUFFIX) for shard in shards):
        return (json.dumps({"metadata": {}, "weight_map": kept}, indent=2) + "\n").encode()
    total = 0
    for shard in sorted(shards):
        header = read_header(local, shard)
        for name, (_dtype, _shape, begin, end) in header.tensors.items():
            kept.setdefault(name, shard)
            total += end - begin
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(kept.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def _index_first(repo: HubRepo, index_rel: str, report: DownloadReport) -> tuple[DownloadFile, int]:
    """The index's entry of the download, fetched into the HF cache first (checked against
    the Hub's record, as every file fetched is) when the download will fetch it anyway, so
    that the plan is read from that copy: the index crosses the network once, not once by a
    ranged read to plan and once more whole into the cache. Not on a dry run (which fetches
    nothing into the cache), nor for an index too large for `read_index`, which refuses it
    unread. Returns the entry and the bytes received for it."""
    entry = planned_files(repo, [index_rel], "index")[0]
    if report.dry_run or entry.status != "planned" or entry.size > MAX_INDEX_BYTES:
        return entry, 0
    received = fetch_files(repo, report.model_copy(update={"files": [entry]}), NULL_PROGRESS)
    assert entry.cache_path is not None
    repo.note_cached(index_rel, Path(entry.cache_path))
    return entry, received


def fetch_files(repo: HubRepo, report: DownloadReport, progress: Progress) -> int:
    """Fetch every file of `report` not yet in the HF cache, and check each against the Hub;
    a file fetched (and checked) already is left as it is.

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
        if info.status == "fetched":
            return
        if info.status != "cached":
            # huggingface_hub's own errors (some are OSErrors) are mapped first, inside
            where = storage_where(info.path)
            with _cache_failures(repo, info.path), hub_errors(where):
                # a broken connection or a busy Hub is asked again, as ckpt's own reads are
                path = retrying(
                    lambda: hf_hub_download(
                        repo.repo_id,
                        repo.repo_path(info.path),
                        repo_type=repo.repo_type,
                        revision=repo.commit,
                        cache_dir=repo.settings.cache_dir,
                        endpoint=repo.settings.endpoint,
                        token=repo.settings.token or None,
                        local_files_only=repo.settings.offline,
                        tqdm_class=_Bar,
                    ),
                    where,
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

    progress.start(sum(f.size for f in report.files if f.status == "planned"), repo.repo_id)
    pool = ThreadPoolExecutor(max_workers=max(1, min(FETCH_WORKERS, len(report.files))))
    try:
        futures = [submit_tracked(pool, fetch, info) for info in report.files]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    finally:
        close_pool(pool)
        progress.finish()
    return received[0]


@contextmanager
def _cache_failures(repo: HubRepo, rel: str) -> Iterator[None]:
    """An OS error while huggingface_hub writes into its cache (a full disk: it names no
    file) as an `IOFailure` naming the cache folder, and how to put the cache elsewhere."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:  # not the operating system's: a library error of another kind
            raise
        failure = io_failure(exc, repo.settings.cache_dir, f"fetching {rel} into the HF cache")
        raise IOFailure(
            failure.problem,
            path=failure.path,
            fix=f"{failure.fix} The cache can live on another filesystem: set HF_HUB_CACHE "
            "(or HF_HOME).",
        ) from None


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
