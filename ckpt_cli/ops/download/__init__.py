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

from pathlib import Path

from ...errors import UsageError
from ...formats.base import Source
from ...progress import NULL_PROGRESS, Progress
from ...storage.hub import open_hub
from ...storage.output import check_destination, resolve_destination
from ...storage.uri import parse_location
from .plan import (
    DownloadFile,
    DownloadRange,
    DownloadReport,
    DownloadRequest,
    Mode,
    check_file_globs,
)
from .shards import download_shards
from .tensors import download_tensors

__all__ = [
    "DownloadFile",
    "DownloadRange",
    "DownloadReport",
    "DownloadRequest",
    "download",
    "download_with",
]


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
        src: `hf://org/repo[@revision][/subfolder]`, or a location naming one file of it.
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
    request = DownloadRequest(
        tensors=tensors,
        exclude=exclude,
        mode=mode,
        extras=extras,
        cache_only=cache_only,
        dry_run=dry_run,
        force=force,
        verify_ranges=verify_ranges,
        include_files=include_files,
        exclude_files=exclude_files,
    )
    return download_with(src, dest, request, progress)


def download_with(
    src: str,
    dest: str | Path | None,
    request: DownloadRequest,
    progress: Progress = NULL_PROGRESS,
) -> DownloadReport:
    """`download` as `request` says (the command's one call)."""
    tensors, exclude, mode = request.tensors, request.exclude, request.mode
    cache_only, dry_run, force = request.cache_only, request.dry_run, request.force
    verify_ranges = request.verify_ranges
    include_files, exclude_files = request.include_files, request.exclude_files
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
    if dest is not None and cache_only:
        # a DEST that --cache-only would leave unwritten, exit 0: refused, as it does nothing
        raise UsageError(
            "--cache-only writes no DEST, and a DEST was given",
            path=str(dest),
            fix="Drop DEST to fill the Hugging Face cache only, or drop --cache-only to write "
            "DEST.",
        )
    if dest is None and not (cache_only or dry_run):
        raise UsageError("DEST is missing", fix="Name the folder to create, or pass --cache-only.")
    if force and cache_only:
        raise UsageError(
            "--force replaces an existing DEST, and --cache-only writes none",
            fix="Leave --force out.",
        )
    if not request.extras and (include_files or exclude_files):
        # the file globs choose among the files fetched besides the weights: with
        # --no-extras there are none, and the globs would silently do nothing
        option = "--include" if include_files else "--exclude"
        raise UsageError(
            f"{option} picks the repository files fetched besides the weights, and "
            "--no-extras fetches none",
            fix=f"Leave --no-extras out to fetch the files {option} picks, or leave {option} "
            "out; tensors are chosen with --filter / --filter-out.",
        )
    out = resolve_destination(dest) if dest is not None else None
    if out is not None and not cache_only:
        # a dry run says that the real run would stop here, as convert's and reshard's do
        check_destination(out, force)
    # a location may name one file of the repository (`hf://org/repo/unet/x.fp16.safetensors`):
    # that file is the checkpoint, as for every command that reads SRC
    storage, target = open_hub(location)
    repo = storage.repo
    source = Source(
        location=location, storage=storage, target=target, origin={"hub": repo.details()}
    )
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
    check_file_globs(repo, report)
    if mode == "shards":
        download_shards(source, storage, report, out, request, progress)
    else:
        assert out is not None or dry_run
        download_tensors(source, storage, report, out, request, progress)
    return report
