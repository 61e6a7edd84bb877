"""What a `download` fetches: the report models, the settings and the choice of files and
tensors, shared by both modes (`shards`, `tensors`)."""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Literal

from pydantic import Field

from ...errors import FormatError, NotFoundError, UsageError
from ...formats.base import Source
from ...formats.names import (
    DCP_DATA_SUFFIX,
    DCP_METADATA,
    SAFETENSORS_SUFFIX,
    WEIGHT_SUFFIXES,
    looks_like_index,
)
from ...models import Entry, Record, Request
from ...quant import sidecar_names
from ...sources.model_files import EXTRA_SUFFIXES
from ...storage.hub import HubRepo
from ..shared.transfer import SkippedEntry

Mode = Literal["shards", "tensors"]
FileKind = Literal["weights", "index", "extra", "state"]

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


class DownloadRequest(Request):
    """Every option of `download` but the locations, typed and frozen: built once (by the
    command, or by `download` from its keywords) and passed whole to the mode that runs it,
    so no option is re-listed by hand. Its fields are `download`'s keyword parameters less
    the progress sink, and the command's options (a test holds them to each other); they
    mean what `download`'s arguments say."""

    tensors: list[str] | None = None
    exclude: list[str] | None = None
    mode: Mode = "shards"
    extras: bool = True
    cache_only: bool = False
    dry_run: bool = False
    force: bool = False
    verify_ranges: bool = False
    include_files: list[str] | None = None
    exclude_files: list[str] | None = None


class DownloadFile(Record):
    """One file of a download.

    Attributes:
        path: path relative to the checkpoint (and to DEST).
        size: size in bytes as the Hub records it (or as written, for tensors-mode shards).
        kind: `weights`, `index`, `extra` (config, tokenizer, card...) or `state` (a training
            save's optimizer, scheduler, RNG... files, fetched whole beside its weights).
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
    kind: FileKind
    status: Literal["fetched", "cached", "planned", "written", "rewritten"]
    sha256: str | None = None
    verified: bool = False
    checked: str | None = None
    cache_path: str | None = None


class DownloadRange(Record):
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


class DownloadReport(Record):
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
        skipped: every other file of the repository (under the location's folder), each with
            why it was not fetched: nothing of the repository vanishes without a line.
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
    skipped: list[SkippedEntry] = Field(default_factory=list)


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


# -- choosing what to fetch ------------------------------------------------------------------


def training_state_files(source: Source, checkpoint: set[str]) -> tuple[str, set[str]]:
    """The layout of the training save SRC is (`hf-trainer`, `accelerate`...; "" when it is
    none) and its training-state files: the top-level files beside the weights read
    (`checkpoint`) that the framework wrote for resuming (`optimizer.pt`, `scheduler.pt`,
    `rng_state.pth`, `trainer_state.json`, `random_states_0.pkl`, `custom_checkpoint_0.pkl`...).
    A Trainer pushes `last-checkpoint/` to the Hub to be resumed from: its weights alone do not
    resume. Config, tokenizer and card files stay extras; names are read, no file is."""
    from ...sources.layouts import training_layout_of

    found = training_layout_of(source)
    if found is None:
        return "", set()
    layout, own = found
    state = {
        rel
        for rel in source.top_level()
        if rel not in checkpoint
        and not rel.startswith(".")
        and (rel in own or not rel.endswith(EXTRA_SUFFIXES))
    }
    return layout.name, state


def fsdp_save_files(source: Source, repo: HubRepo) -> tuple[str, set[str], set[str]] | None:
    """The files of an FSDP training save at SRC (accelerate `save_state`, a Trainer's
    `last-checkpoint/`) whose weights are FSDP's own: DCP folders (`pytorch_model_fsdp_0/`,
    beside `optimizer_0/`), `pytorch_model_fsdp{_i}.bin` (FULL_STATE_DICT) or per-rank
    `pytorch_model_fsdp{_i}_rank{r}.bin`. Every rank's DCP file holds a piece of every tensor,
    so such a save is fetched whole. Returns (the layout's name, the weight files, the other
    files of the save: optimizer, scheduler, RNG, trainer state), or None when SRC is not one.
    Config, tokenizer and card files are neither (extras); names are read, no file is."""
    from ...sources.layouts import training_layout_of
    from ...sources.layouts.composite import FSDP_MODEL

    found = training_layout_of(source)
    if found is None:
        return None
    layout, own = found
    # a DCP folder of the save (the model's, an optimizer's): everything in it, `.metadata`
    # included, belongs to the save; other subfolders are none of it
    dcp = {
        rel.split("/", 1)[0]
        for rel in repo.files
        if rel.count("/") == 1 and rel.endswith(f"/{DCP_METADATA}")
    }

    def in_save(rel: str) -> bool:
        if "/" in rel:
            return rel.split("/", 1)[0] in dcp
        return not rel.startswith(".")

    weights = {rel for rel in repo.files if rel.startswith(FSDP_MODEL) and in_save(rel)}
    if not weights:
        return None
    state = {
        rel
        for rel in repo.files
        if rel not in weights
        and in_save(rel)
        and ("/" in rel or rel in own or not rel.endswith(EXTRA_SUFFIXES))
    }
    return layout.name, weights, state


def dcp_save_files(repo: HubRepo) -> tuple[str, set[str], set[str]] | None:
    """The files of a DCP checkpoint at SRC's root (a torchtitan `step-N/`, any `dcp.save`
    folder pushed as it is): `.metadata` and every rank's `.distcp` file, which hold pieces of
    every tensor of every component (model, optimizer, scheduler, data loader, train state), so
    it is fetched whole, as `fsdp_save_files`' saves are. Its other top-level files are extras
    or skipped. None when SRC holds no `.metadata` at its root."""
    if DCP_METADATA not in repo.files:
        return None
    weights = {
        rel
        for rel in repo.files
        if "/" not in rel and (rel == DCP_METADATA or rel.endswith(DCP_DATA_SUFFIX))
    }
    return "dcp", weights, set()


def fsdp_tensors_refused(src: str, dcp: bool = False) -> UsageError:
    """Tensors picked out of an FSDP save (`fsdp_save_files`) or a DCP checkpoint
    (`dcp_save_files`, `dcp`): each rank's file holds part of every tensor and the optimizer's
    state is keyed to the whole model, so the download is of the whole save; `convert
    --select` picks tensors from the copy."""
    what = (
        "is a DCP checkpoint: every rank's .distcp file holds a part of every tensor of every "
        "component"
        if dcp
        else "is an FSDP training save: its weights are FSDP's own files (DCP folders, each "
        "rank's file a part of every tensor, or whole pytorch_model_fsdp*.bin files)"
    )
    return UsageError(
        f"{what}, which --filter, --filter-out and --mode tensors cannot pick tensors out of; "
        "it is downloaded whole",
        path=src,
        fix="Download it whole (no --filter, --filter-out or --mode tensors), then pick "
        "tensors from the copy: `ckpt convert COPY OUT --to safetensors --select model "
        "--filter 'model.lm_head.*'` (or `--to hf --config ...` for a from_pretrained folder).",
    )


#: the component a training save's weights are named under by inspect, convert and diff
#: (`model.lm_head.weight`: `Folder.add_model`)
WEIGHTS_COMPONENT = "model."


def save_globs(source: Source, globs: list[str] | None) -> list[str] | None:
    """Tensor globs as a training save's weights are matched: by their own names
    (`lm_head.weight`) or by the names `inspect --list` shows of the save
    (`model.lm_head.weight`): a glob naming the `model.` component also matches without it.
    Other sources' globs are returned as given."""
    from ...sources.layouts import training_layout_of

    if not globs or training_layout_of(source) is None:
        return globs
    prefix = WEIGHTS_COMPONENT
    return list(globs) + [g[len(prefix) :] for g in globs if g.startswith(prefix) and g != prefix]


def state_left_behind(layout: str, state: set[str], why: str) -> dict[str, str]:
    """Each training-state file of a `layout` save a download does not fetch, with `why`."""
    reason = (
        f"the training state of this {layout} save (optimizer, scheduler, RNG...): {why}; "
        "--include with its name fetches it"
    )
    return dict.fromkeys(sorted(state), reason)


def top_level_extras(
    repo: HubRepo,
    weights: set[str],
    filters: dict[str, list[str]] | None = None,
    checkpoint: set[str] | None = None,
    state: set[str] | None = None,
) -> list[str]:
    """The files fetched besides the weights: top-level config/tokenizer/card files (weight
    files, weight indexes and a training save's `state` files excluded).

    `filters` carries the --include/--exclude file globs: --include picks the other files (any
    file of the repository but those of the `checkpoint` read, whose shards follow the tensors
    chosen: the other format's weights and training state too, when asked for by name),
    --exclude leaves files out.
    """
    import fnmatch

    include = (filters or {}).get("files_include") or []
    exclude = (filters or {}).get("files_exclude") or []
    own = weights | (checkpoint or set())
    out = []
    for rel in repo.files:
        if rel in own:
            continue
        if include:
            if not any(fnmatch.fnmatchcase(rel, g) for g in include):
                continue
        elif (
            rel.startswith(".")
            or rel in (state or set())
            or rel.endswith(WEIGHT_SUFFIXES)
            or looks_like_index(rel)
            or "/" in rel
            or not rel.endswith(EXTRA_SUFFIXES)
        ):
            continue
        if any(fnmatch.fnmatchcase(rel, g) for g in exclude):
            continue
        out.append(rel)
    return out


def skipped_files(
    repo: HubRepo,
    taken: set[str],
    checkpoint: set[str],
    request: DownloadRequest,
    state: dict[str, str] | None = None,
) -> list[SkippedEntry]:
    """Every file of the repository (under the location's folder) not in `taken`, with why:
    nothing vanishes without a line in the report. `checkpoint` holds the files of the
    checkpoint read (its shards and index): one of them not taken held no selected tensor;
    `state` a training save's state files left behind, each with why (`state_left_behind`)."""
    state = state or {}
    include = request.include_files or []
    exclude = request.exclude_files or []
    out = []
    for rel in repo.files:
        if rel in taken:
            continue
        glob = next((g for g in exclude if fnmatch.fnmatchcase(rel, g)), None)
        base = rel.rsplit("/", 1)[-1]
        if rel in checkpoint:
            why = "holds none of the selected tensors"
        elif base.startswith(".") and not include:
            why = "a hidden file: not part of the checkpoint"
        elif glob is not None:
            why = f"left out by --exclude {glob!r}"
        elif rel in state and not include:
            why = state[rel]
        elif not request.extras:
            why = "left out by --no-extras"
        elif include:
            why = "matched by no --include glob"
        elif "/" in rel:
            # before the weights: a subfolder's weights (Llama 3's `original/`) are its own
            why = (
                "in a subfolder: hf://ORG/REPO/FOLDER downloads that folder's checkpoint, or "
                "--include 'FOLDER/*' fetches its files here"
            )
        elif rel.endswith(WEIGHT_SUFFIXES) or looks_like_index(base):
            why = (
                "weights of another format or variant than those read (a library loads one or "
                "the other): --include with its name fetches it too"
            )
        else:
            why = (
                "not a weight file nor a companion file (config, tokenizer, model card...): "
                "--include with its name fetches it"
            )
        out.append(SkippedEntry(name=rel, kind="file", reason=why))
    return out


def check_file_globs(repo: HubRepo, report: DownloadReport) -> None:
    """A file glob that matches no file of the repository has no effect: say so."""
    import fnmatch

    for option, key in (("--include", "files_include"), ("--exclude", "files_exclude")):
        for glob in report.filters.get(key, []):
            if not any(fnmatch.fnmatchcase(rel, glob) for rel in repo.files):
                report.warnings.append(
                    f"{option} {glob!r} matches no file of {repo.repo_id} (file globs, as in "
                    "hf download); to select tensors by name use --filter / --filter-out"
                )


def no_match(
    src: str,
    include: list[str] | None,
    exclude: list[str] | None,
    layout: str = "",
    state: set[str] | None = None,
) -> NotFoundError:
    """No tensor picked. In a training save (`layout`, its `state` files) the names inspect
    shows include the training state's (`optimizer.state.0.exp_avg`), which a download never
    picks by name: the fix says how that state is fetched instead."""
    what = " or ".join(include or ["*"])
    if exclude:
        what += f" (excluding {' or '.join(exclude)})"
    if layout and state:
        return NotFoundError(
            f"no weight matches {what}: --filter / --filter-out pick the weights of this "
            f"{layout} save, and its training state ({_listed(state)}) is fetched whole, "
            "never by tensor name",
            path=src,
            fix="Download without --filter / --filter-out to fetch the whole save, or add "
            "--include with a state file's name to fetch it too; `ckpt inspect --list "
            + src
            + " --filter 'model.*'` lists the weights' names.",
        )
    return NotFoundError(
        f"no tensor matches {what}",
        path=src,
        fix="Check the pattern; `ckpt inspect --list " + src + "` lists every name.",
    )


def unmatched_filters(
    names: list[str], globs: list[str] | None, layout: str = "", state: set[str] | None = None
) -> list[str]:
    """A warning for each --filter glob that picks no tensor while others do: the download
    went ahead without a word, so `--filter 'model.*' --filter 'optimizer.*'` of a Trainer
    save fetched the weights and left the optimizer behind as if asked. In a training save
    (`layout`, its `state` files) a glob is also tried without the `model.` component prefix
    (`save_globs`), and the warning says how its training state is fetched."""
    notes = []
    for glob in globs or []:
        tried = [glob]
        if layout and glob.startswith(WEIGHTS_COMPONENT) and glob != WEIGHTS_COMPONENT:
            tried.append(glob[len(WEIGHTS_COMPONENT) :])
        matches = [re.compile(fnmatch.translate(g)).match for g in tried]
        if any(match(name) for match in matches for name in names):
            continue
        if layout and state:
            notes.append(
                f"--filter {glob!r} matches no weight of this {layout} save, so it fetched "
                f"nothing: the training state ({_listed(state)}) is fetched whole, never by "
                "tensor name; download without --filter / --filter-out for the whole save, or "
                "add --include with a state file's name"
            )
        else:
            notes.append(
                f"--filter {glob!r} matches no tensor, so it fetched nothing; "
                "`ckpt inspect --list SRC` lists every name"
            )
    return notes


def _listed(files: set[str], most: int = 4) -> str:
    """`a, b, c` (or the first `most` and `+N`) of `files`, sorted."""
    names = sorted(files)
    shown = ", ".join(names[:most])
    return shown + (f" +{len(names) - most}" if len(names) > most else "")


def index_selection(
    weight_map: dict[str, str], include: list[str] | None, exclude: list[str] | None
) -> tuple[list[Entry], list[Entry]]:
    """(chosen, with their scales) among the index's names: what `select` and, with `include`,
    `with_sidecars` would choose from an entry per name, in index order, but matched on the
    names, with an entry (`Entry.named`) built only for each name chosen: DeepSeek-V3's index
    names 90,000 tensors, a filter picks a few. The second list is the first without `include`."""
    names = list(weight_map)

    def matching(globs: list[str]) -> set[str]:
        found: set[str] = set()
        for glob in globs:
            match = re.compile(fnmatch.translate(glob)).match  # fnmatchcase's own pattern
            found.update(n for n in names if match(n))
        return found

    keep = matching(include) if include else set(names)
    excluded = matching(exclude) if exclude else set()
    keep -= excluded
    named = Entry.named
    chosen = [named(n, weight_map[n]) for n in names if n in keep]
    if not include:
        return chosen, chosen
    wanted = set(keep)
    for name in keep:
        wanted.update(s for s in sidecar_names(name) if s not in excluded)
    return chosen, [named(n, weight_map[n]) for n in names if n in wanted]


def no_safetensors(src: str, repo: HubRepo, problem: str | None = None) -> FormatError:
    """SRC holds no checkpoint download reads at its root. When subfolders hold weights (a
    diffusers pipeline's `unet/`, `vae/`...), the message names them and the location of each."""
    folders = sorted(
        {
            rel.rsplit("/", 1)[0]
            for rel in repo.files
            if "/" in rel and rel.endswith(SAFETENSORS_SUFFIX) and not rel.startswith(".")
        }
    )
    problem = problem or (
        "holds no safetensors checkpoint (nor torch.save weights) at this revision"
    )
    if folders:
        named = ", ".join(f"{f}/" for f in folders[:6]) + (" …" if len(folders) > 6 else "")
        base = src.rstrip("/")
        return FormatError(
            f"{problem}: its weights are in subfolders ({named}), each a checkpoint of its own "
            "(a diffusers pipeline's components)",
            path=src,
            fix=f"Download each folder: `ckpt download {base}/{folders[0]} DEST/{folders[0]}`; "
            "`hf download` fetches the whole repository.",
        )
    return FormatError(
        problem,
        path=src,
        fix="Point at the folder holding the weights (hf://org/repo/subfolder), or use "
        "`hf download` for other files.",
    )


def planned_files(repo: HubRepo, rels: list[str], kind: Any) -> list[DownloadFile]:
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
