"""The one judge of a run folder's checkpoints, local or remote alike: complete, interrupted or
still being written (commit markers, each component's format check, layout rules), and
best-by-metric.

Every file is read through the run folder's `Storage` (a folder on this machine, an object
store, the Hub): each component is checked by its format's `check` (the one `ckpt verify`
runs: metadata and file sizes, never tensor data) on a view of its folder, over the run's one
listing, so the same checkpoint gets the same verdict and the same message wherever it lies.
What differs between storages is only what their listing tells (`listing.RunListing`): links
exist on this machine only, and an object store's times come from its listing.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ...budgets import json_record_over_budget, read_member
from ...errors import CkptError, HubError, UsageError, with_fix
from ...faults import no_verdict
from ...formats.base import Source
from ...formats.names import INDEX_SUFFIX, SLIM_RECORD, holds_dcp, index_format, weight_format
from ...formats.sniff import SNIFF_BYTES, is_pickle, what_is
from ...formats.weight_map import load_index_json
from ...storage import (
    PARITY_DIR,
    PARITY_MANIFEST,
    LocalStorage,
    Storage,
    StorageRangeFile,
    is_parity_path,
)
from ...storage.base import FolderView
from ...storage.output import TMP_MARKER, staging_held
from ...storage.uri import parse_location
from ..layouts.megatron_legacy import (
    FLAG_KEYS,
    SIZE_KEYS,
    MissingRanks,
    missing_distrib_optim,
    missing_distrib_optim_text,
    missing_ranks,
    missing_ranks_text,
    rank_file_to_read,
    rank_folders,
)
from .naming import (
    MEGATRON,
    MEGATRON_TRACKER,
    UNMARKED,
    deepspeed_states_in,
    deepspeed_tag,
    lightning_metrics,
    megatron_tracker,
    save_parts,
)
from .records import (
    CHECKSUM_MANIFEST,
    DELETING,
    METRICS_FILE,
    PROTECTED,
    RUN_SLIM_RECORD,
    BestMetric,
    Found,
    RunCheckpoint,
    Status,
)

if TYPE_CHECKING:
    from ..layouts import Layout
    from ..layouts.composite import Folder
    from .listing import RunListing

# --------------------------------------------------------------------------- judging


def judge_found(
    run: RunListing,
    item: Found,
    now: float,
    settle: float,
    ds_latest_step: int | None,
    expected: set[str] | None = None,
    run_files: frozenset[str] = frozenset(),
    before: tuple[str, frozenset[str]] | None = None,
    megatron_latest: tuple[int, str] | None = None,
) -> RunCheckpoint:
    """Complete, incomplete, interrupted or writing (see the package docstring).

    `expected`: the parts every other save of the run has (`scan.expected_parts_of`);
    `run_files`: the names of the files at the top of the run's saves (`scan.top_file_names`),
    which say whether the run's saves hold their layout's `last_file`; `before`: the save just
    older than this one and the names at its top (`scan.save_before`); `megatron_latest`: the
    iteration and folder a Megatron-LM run's tracker names (`read_megatron_tracker`)."""
    primary = item.rels[0]
    link = run.link(item)
    files = run.files(item)
    mtime, newest = run.times(item)
    recent = newest > 0 and now - newest < settle
    # a save the script named: the run table says what its files are when they are a layout
    # with no marker of its own (a loop's torch.save files, accelerate's `save_state`); it is
    # still compared with the run's other plain-named saves (one cut short may not say)
    own = files_layout(run.storage, item, files)
    entry = RunCheckpoint(
        name=primary,
        path=run.where(primary),
        paths=[run.where(rel) for rel in item.rels],
        layout=own.name if own is not None and own.name in UNMARKED else item.layout,
        step=item.step,
        epoch=item.epoch,
        save_number=item.save_number,
        size=0 if link else sum(files.values()),
        mtime=mtime,
        symlink=link is not None,
        link_target=link[0] if link else None,
    )
    if _protected(run, item, files):
        # `ckpt protect` blesses whole saves only: one found damaged since can be rebuilt
        # (`ckpt repair`), and `prune --incomplete` never takes it for an interrupted save
        entry.markers.append(PROTECTED)
    if item.temporary:
        what = "deletion" if f"{TMP_MARKER}{DELETING}" in primary.rsplit("/", 1)[-1] else "save"
        # ckpt's own staging folder is held by the process writing it: being written, however
        # long since its last byte (a stalled save is never taken for an interrupted one)
        local = run.storage.local_path(primary)
        held = local is not None and staging_held(local)
        return with_status(
            entry,
            "writing" if recent or held else "interrupted",
            f"staging folder of a {what} in progress"
            if recent
            else f"staging folder left by an interrupted {what}",
        )
    if link is not None and not link[1]:
        return with_status(entry, "incomplete", f"dangling link to {entry.link_target}")
    problem, entry.formats = _judge_components(run.storage, item, files)
    if problem is None and item.layout == "hf-trainer" and item.is_dir:
        problem = _trainer_state_problem(run.storage, primary, files)
    if problem is None and item.layout == "deepspeed" and item.is_dir:
        problem = _zero_partition_problem(run.storage, primary, files)
    if problem is None and item.layout == MEGATRON and item.is_dir:
        problem = _megatron_problem(run.storage, primary, files)
    note = unfinished = None
    if problem is None and item.is_dir:
        lost, unfinished, note = _layout_problem(run.storage, item, files, own, run_files, before)
        if lost is not None:
            # a file the framework writes before others that are here: lost since the save,
            # never one still being written, however recent
            return with_status(entry, "incomplete", lost)
    if problem is None and run.upload_unfinished(item):
        problem = (
            f"no {CHECKSUM_MANIFEST} yet: `ckpt sync` uploads it after the save's files, so "
            "this upload has not finished (interrupted?)"
        )
    entry.slim = _is_slim(run, item, files)
    if entry.slim:
        entry.markers.append("weights-only")
    if problem is None and expected and not entry.slim:
        missing = expected - save_parts(item, files)
        if missing:
            why = (
                "no commit marker in this layout: an interrupted save?"
                if item.layout in UNMARKED
                else "deleted or lost since the save finished?"
            )
            problem = (
                f"lacks {', '.join(sorted(missing))}, which every other save of this run has "
                f"({why})"
            )
    if problem is None and unfinished is not None and not entry.slim:
        # after the comparison, whose message names every missing part; a slimmed save
        # dropped its RNG states on purpose
        if unfinished.certain or recent:
            problem = unfinished.reason
        else:
            note = unfinished.reason  # perhaps whole (node-local disks): said, never deleted
    if (
        problem is None
        and item.layout == "deepspeed"
        and ds_latest_step is not None
        and item.step is not None
        and item.step > ds_latest_step
    ):
        problem = (
            f"newer than step {ds_latest_step}, the save the `latest` file names "
            "(DeepSpeed writes it when a save has finished)"
        )
    if (
        problem is None
        and item.layout == MEGATRON
        and megatron_latest is not None
        and item.step is not None
        and item.step > megatron_latest[0]
    ):
        problem = (
            f"newer than {megatron_latest[1]}, the save {MEGATRON_TRACKER} names (Megatron-LM "
            "writes it once a save has finished, and resumes from the save it names)"
        )
    if problem is None:
        entry.reason = note  # complete, but what it should hold is not known: said, not hidden
        return entry
    if recent:
        return with_status(entry, "writing", f"modified in the last {settle:g} s: {problem}")
    return with_status(entry, "incomplete", problem)


def _protected(run: RunListing, item: Found, files: Mapping[str, int]) -> bool:
    """Whether `ckpt protect` wrote parity for the save: a folder's own `.ckpt-parity/`, or
    the `.ckpt-parity/NAME/` beside a single file (where the listing says)."""
    primary = item.rels[0]
    if item.is_dir:
        return f"{primary}/{PARITY_DIR}/{PARITY_MANIFEST}" in files
    folder, _, name = primary.rpartition("/")
    beside = f"{folder}/" if folder else ""
    return len(item.rels) == 1 and run.holds(f"{beside}{PARITY_DIR}/{name}/{PARITY_MANIFEST}")


def files_layout(storage: Storage, item: Found, files: Mapping[str, int]) -> Layout | None:
    """The folder layout the files of a save the script named (`step_100/`: a plain name) say
    it is (accelerate's `save_state`, a loop's folder of torch.save files...), None for another
    save. Names only, nothing read."""
    from ..layouts import folder_layout_of

    if item.layout != "plain" or not item.is_dir or item.temporary:
        return None
    try:
        return folder_layout_of(_component_source(storage, item.rels[0], True, files))
    except CkptError as error:
        no_verdict(error)  # the store or the OS refused: the layout check says why
        return None


def folder_storage(storage: Storage, rel: str, files: Mapping[str, int] | None = None) -> Storage:
    """The folder `rel` of a run folder ("" for the run folder itself) as a storage of its own.

    On this machine, the folder's path (a linked checkpoint is judged by what it links to, as
    a loader would read it); elsewhere, a view over the run's one listing (`FolderView`), or
    over `files`, the part of it that holds the checkpoint the folder belongs to.
    """
    if not rel:
        return storage
    root = storage.local_root
    if root is not None:
        return LocalStorage(root / rel)
    return FolderView(storage, rel, files)


def _component_source(
    storage: Storage, rel: str, folder: bool, files: Mapping[str, int] | None
) -> Source:
    """A component (a folder, or one file of its folder) as the source its format checks."""
    if folder:
        inside = folder_storage(storage, rel, files)
        return Source(location=parse_location(inside.display), storage=inside)
    parent, _, name = rel.rpartition("/")
    inside = folder_storage(storage, parent, files)
    return Source(location=parse_location(inside.describe(name)), storage=inside, target=name)


def _check_with_format(
    storage: Storage, fmt_name: str, rel: str, folder: bool, files: Mapping[str, int] | None
) -> str | None:
    """The first structural problem of one component: its format's `check` (the one `ckpt
    verify` runs: headers, metadata and file sizes), or for pickle formats (torch.save) the
    zip structure (`_pickle_structure`)."""
    from ...formats import get_format

    try:
        source = _component_source(storage, rel, folder, files)
        fmt = get_format(fmt_name)
        if fmt.refused_pickles_may_be_whole and source.target is not None:
            return _pickle_structure(source.storage, source.target)
        problems = fmt.check(source)
    except CkptError as error:
        no_verdict(error)  # the store or the OS refused: no verdict on the file
        return error.message
    errors = [p for p in problems if p.severity == "error"]
    # a read the store failed to answer (a 500, a 403, a reset) says nothing about the file:
    # no verdict of "incomplete" on it, the command fails (exit 5) naming the file
    unanswered = next((p for p in errors if p.code == HubError.code), None)
    if unanswered is not None:
        raise HubError(
            unanswered.message,
            fix="The store did not answer a read, which says nothing about the file: run the same command again once it answers.",
        )
    # the reason `latest` gives says the fix too, as verify's line does
    return with_fix(errors[0].message, errors[0].fix) if errors else None


class ForeignFile(str):
    """What `_pickle_structure` says of a file named like a torch.save file (`.bin`, `.pt`)
    whose bytes are neither torch.save's zip nor a pickle: no part of the save (a Trainer
    folder may hold a `.bin` of its own), not a damaged one; a save left with no component is
    incomplete, naming it (five bytes of garbage in `step-7/model.bin` were called complete).
    A file named as a framework's training state (`_STATE_FILE`) is always part of the save."""


#: the files training frameworks save their state in (the Trainer's `optimizer.pt`,
#: accelerate's `optimizer_1.bin`, `scaler.pt`...): garbage there is a damaged save, never a
#: foreign file beside it
_STATE_FILE = re.compile(r"(optimizer|scheduler|scaler|sampler|rng_state)(_\d+)?\.(pt|bin|pth)")


def _pickle_structure(storage: Storage, rel: str) -> str | None:
    """Whether a torch.save file (or bin index, with its shards) is whole, unpickling nothing.

    torch.save writes its zip's directory last, so a save cut short has none: the directory is
    what completeness needs, and a few ranged reads fetch it where a weights_only load reads
    the whole pickle (or, of a remote file, the file again for each seek). A whole file whose
    pickle names classes weights_only refuses (Lightning's hyper_parameters) is complete: what
    may be loaded is `ckpt verify`'s question.
    """
    where = storage.describe(rel)
    try:
        size = storage.size(rel)
        if size == 0:
            return f"{where}: empty file"
        if rel.endswith(INDEX_SUFFIX):
            return _check_torch_index(storage, rel)
        head = storage.read(rel, 0, min(SNIFF_BYTES, size))
        if not head.startswith(b"PK\x03\x04"):
            if is_pickle(head):
                return None  # legacy torch.save format: no cheap structural check
            # neither torch.save's zip nor its legacy pickle: no component of the save
            return ForeignFile(f"{where}: not a torch.save file: it is {what_is(head, size)}")
        with zipfile.ZipFile(_TailFile(storage, rel, size)) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return f"{where}: truncated or corrupt torch.save file ({exc})"
    return None


#: bytes at the end of a torch.save file fetched in one read: its zip directory (about 100
#: bytes a record) and end record, for files of up to a few dozen tensors
_ZIP_TAIL = 4096


class _TailFile(StorageRangeFile):
    """A file of a storage whose last `_ZIP_TAIL` bytes (at most half the file) are fetched in
    one read: zipfile's reads of the end record and the directory are then served from memory
    (one request, not three), and only a larger directory is read beyond it."""

    def __init__(self, storage: Storage, rel: str, size: int):
        super().__init__(storage, rel, size)
        tail = min(_ZIP_TAIL, size // 2)
        self._start = size - tail
        self._tail = storage.read(rel, self._start, tail)

    def _read_into(self, view: memoryview, position: int) -> int:
        if position < self._start:
            return super()._read_into(view, position)
        data = self._tail[position - self._start : position - self._start + len(view)]
        view[: len(data)] = data
        return len(data)


def _check_torch_index(storage: Storage, rel: str) -> str | None:
    where = storage.describe(rel)
    try:
        index = load_index_json(storage, rel)
        shards = set(index["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return f"{where}: unreadable index ({exc})"
    listing = storage.list_files()
    folder = rel.rpartition("/")[0]
    for shard in sorted(shards, key=str):
        named = f"{folder}/{shard}" if folder and isinstance(shard, str) else shard
        if not isinstance(shard, str) or named not in listing:
            return f"{where}: the index names shard {shard!r}, which is missing"
    for shard in sorted(shards):
        problem = _pickle_structure(storage, f"{folder}/{shard}" if folder else shard)
        if problem:
            return str(problem)  # a shard the index names: damaged, whatever its bytes are
    return None


def _components(
    storage: Storage, item: Found, files: Mapping[str, int]
) -> list[tuple[str, str, bool]]:
    """The checkpoints inside one checkpoint (a Trainer folder holds model, optimizer...):
    (format, path relative to the run folder, is a folder) each.

    Each DCP folder is one component; each safetensors or torch index (the shards it names
    are its own); each remaining safetensors or torch.save file. The parity of `ckpt protect`
    is no part (its .bin files are no torch.save).
    """
    if not item.is_dir:
        from ...formats import get_format

        out: list[tuple[str, str, bool]] = []
        for rel in item.rels:
            fmt_name = weight_format(rel.rsplit("/", 1)[-1])
            if fmt_name is None:
                continue
            # one data file of a folder format (a `.distcp`) stands for its folder
            if get_format(fmt_name).folder:
                out.append((fmt_name, rel.rpartition("/")[0], True))
            else:
                out.append((fmt_name, rel, False))
        return out
    folders: dict[str, list[str]] = {}
    for rel in files:
        folder, _, name = rel.rpartition("/")
        folders.setdefault(folder, []).append(name)
    top = item.rels[0]
    out = []
    for folder, names in sorted(folders.items()):
        inside = folder[len(top) :].split("/")
        if any(is_parity_path(part) for part in inside if part):
            continue
        if holds_dcp(names):
            out.append(("dcp", folder, True))
            continue
        claimed: set[str] = set()
        for name in sorted(names):
            kind = index_format(name)
            if kind is not None:
                out.append((kind, f"{folder}/{name}", False))
                claimed.update(_index_shards(storage, folder, name))
        for name in sorted(names):
            kind = weight_format(name)
            if kind is not None and name not in claimed:
                out.append((kind, f"{folder}/{name}", False))
    return out


def _index_shards(storage: Storage, folder: str, name: str) -> set[str]:
    """The shard names an index names (its format's check reads them with it)."""
    try:
        weight_map = load_index_json(folder_storage(storage, folder), name).get("weight_map", {})
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (ValueError, AttributeError, OSError, RecursionError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return set()


def _judge_components(
    storage: Storage, item: Found, files: Mapping[str, int]
) -> tuple[str | None, list[str]]:
    """(first problem or None, formats seen) over every component of a checkpoint."""
    formats: list[str] = []
    foreign: list[str] = []
    components = _components(storage, item, files)
    for kind, rel, folder in components:
        # inside a checkpoint folder, its own files are all a view needs to list
        problem = _check_with_format(storage, kind, rel, folder, files if item.is_dir else None)
        if isinstance(problem, ForeignFile) and not _STATE_FILE.fullmatch(rel.rpartition("/")[2]):
            foreign.append(problem)
            continue
        if kind not in formats:
            formats.append(kind)
        if problem:
            return problem, formats
    if len(foreign) == len(components):
        what = "holds no checkpoint files (safetensors, DCP, torch.save)"
        return (f"{what}: {'; '.join(foreign)}" if foreign else what), formats
    return None, formats


def _is_slim(run: RunListing, item: Found, files: Mapping[str, int]) -> bool:
    """Whether `prune --slim-older-than` slimmed this checkpoint (see `ops.slim`)."""
    primary = item.rels[0]
    if item.is_dir:
        return f"{primary}/{SLIM_RECORD}" in files
    stamp = run.stamp(primary)
    if stamp is None:
        return False
    parent, _, name = primary.rpartition("/")
    record = f"{parent}/{RUN_SLIM_RECORD}".lstrip("/")
    try:
        if json_record_over_budget(run.storage.size(record)) is not None:
            return False  # no record `prune` writes (one line per slimmed file) is that long
        doc = json.loads(run.storage.read_all(record))
    except (OSError, ValueError, RecursionError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return False
    entry = doc.get(name) if isinstance(doc, dict) else None
    # a save written later under the same name is not the slimmed one
    return isinstance(entry, dict) and (entry.get("size"), entry.get("mtime_ns")) == stamp


def _trainer_state_problem(storage: Storage, folder: str, files: Mapping[str, int]) -> str | None:
    """The Trainer writes `trainer_state.json` last: missing or cut short, the save is not done."""
    if f"{folder}/trainer_state.json" not in files:
        return "no trainer_state.json (the Trainer writes it last)"
    inside = folder_storage(storage, folder, files)
    too_large = json_record_over_budget(files[f"{folder}/trainer_state.json"])
    if too_large is not None:
        return f"{inside.describe('trainer_state.json')}: {too_large}"
    try:
        json.loads(inside.read_all("trainer_state.json"))
    except (ValueError, OSError, RecursionError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return f"{inside.describe('trainer_state.json')}: not valid JSON, cut short? ({exc})"
    return None


def _layout_problem(
    storage: Storage,
    item: Found,
    files: Mapping[str, int],
    own: Layout | None,
    run_files: frozenset[str],
    before: tuple[str, frozenset[str]] | None = None,
) -> tuple[str | None, Unfinished | None, str | None]:
    """(problem, unfinished, note) of a save by its framework's own layout (`Layout.missing`: a
    Trainer checkpoint whose `rng_state.pth` says its `optimizer.pt` was saved, an accelerate
    save with a scheduler's state and no optimizer's, a torchtitan save with its `train_state`
    and no optimizer's), whatever the run's other saves hold; `unfinished` when it lacks the
    file its framework writes last (`Layout.last_file`: accelerate's RNG states), which a save
    cut short or still being written lacks; the note says when its files cannot tell what it
    should hold (`Layout.unknown_state`). Names only, the few bytes of `training_args.bin` a
    Trainer checkpoint's `save_only_model` needs, and a torchtitan save's `.metadata`. `own`:
    the layout the files of a save the script named say (`files_layout`)."""
    from ..layouts import layout_named
    from ..layouts.composite import Folder

    try:
        source = _component_source(storage, item.rels[0], True, files)
        # a save the script named (`step_100/`): the framework its files say (`own`)
        layout = own or layout_named(item.layout)
        if layout is None:
            return None, None, None
        folder = Folder(source)
        problems = [p for p in layout.missing(source, folder) if p.severity == "error"]
        if problems:
            first = problems[0]
            text = first.message
            name = first.file.rsplit("/", 1)[-1] if first.file else None
            if name and name not in text:
                # a problem's message leaves its file to the line it is shown on ("is missing:
                # ..."): the reason names it as `verify` does
                text = f"{name}: {text}"
            return with_fix(text, first.fix), None, None
        return (
            None,
            _unfinished(layout, folder, own is None, run_files, before),
            (layout.unknown_state(source, folder)),
        )
    except CkptError as error:
        no_verdict(error)  # the store or the OS refused: no verdict on the file
        return error.message, None, None


def _cut_after_last(
    layout: Layout, folder: Folder, before: tuple[str, frozenset[str]] | None
) -> Unfinished | None:
    """A save holding its layout's `last_file` that lacks a file written after it
    (`Layout.after_last_file`: accelerate's `custom_checkpoint_{i}.pkl`, one per registered
    object) which the run's save before it holds: the save stopped before writing it, at any
    number of saves (the comparison of three or more saves sees no missing
    `custom_checkpoint_1.pkl` beside a `custom_checkpoint_0.pkl`). A lone save cannot say."""
    after = layout.after_last_file
    if after is None or before is None:
        return None
    older, names = before
    lacking = sorted(n for n in names if after.fullmatch(n) and not folder.has(n))
    if not lacking:
        return None
    return Unfinished(
        f"no {', '.join(lacking)}, which the save before it ({older}) holds: {layout.name} "
        "writes each registered object's state last, after the RNG states, so the save "
        "stopped before it (cut short, or still being written); accelerate's load_state "
        "refuses it (fewer custom checkpoints than registered objects)"
    )


def _ranks_dropped_since(
    layout: Layout, folder: Folder, before: tuple[str, frozenset[str]] | None
) -> Unfinished | None:
    """A save lacking per-rank files (`Layout.rank_files`: accelerate's `random_states_{r}.pkl`)
    which the run's save before it holds, of ranks its own files leave in doubt
    (`ranks.ranks_lost_since`): above the highest its files name (a plain multi-process
    save that lost its highest rank's RNG states looks like a smaller run's on its own:
    nothing in it records the world size), or below the lowest (rank 0's: a run of any size
    writes it; alone, the save looks like one node's folder on node-local disks, whose save
    before holds no other node's files either). Ranks its files say are lost for certain
    are `missing_rank_states`'. A save with none of its own is `_unfinished`'s."""
    from ..layouts.ranks import ranks_lost_since, saved_world

    if before is None:
        return None
    older, names = before
    lost = ranks_lost_since(folder.source, folder, layout, older, set(names))
    if not lost:
        return None
    files = [p.file.rsplit("/", 1)[-1] for p in lost if p.file]
    # a rank above every one this save's files name: a run resumed with fewer processes
    world = saved_world(folder.source, folder, layout).world
    fewer = any((layout.rank_file_rank(name) or 0) >= world for name in files)
    return Unfinished(
        f"no {', '.join(files)}, which the save before it ({older}) holds: every process of "
        f"a multi-process {layout.name} save writes its own RNG states, so the save has not "
        "finished or a rank's file was lost (its loader goes on without it: a resumed run "
        "silently draws other random numbers)"
        + (
            "; only a run resumed with fewer processes before this save makes it whole, "
            "which nothing in the files records"
            if fewer
            else ""
        )
    )


class Unfinished(NamedTuple):
    """Why a save looks unfinished (`_unfinished`).

    Attributes:
        reason: what it lacks, and why that says so.
        certain: False when the save may be whole as it is (a per-rank file perhaps on another
            node's disk): unfinished while recent, then complete with the reason said.
    """

    reason: str
    certain: bool = True


def _unfinished(
    layout: Layout,
    folder: Folder,
    named: bool,
    run_files: frozenset[str],
    before: tuple[str, frozenset[str]] | None = None,
) -> Unfinished | None:
    """Why a save lacking its layout's `last_file` is unfinished, else None. Certain when the
    save is named by the layout's own step naming (accelerate's `checkpoints/checkpoint_N`:
    `save_state` wrote it); for a folder the script named, whose files only look like the
    layout's, when another save of the run holds such a file (this one's files are not among
    `run_files`' matches: it has none), at any number of saves. A save whose per-rank last
    files (accelerate's `random_states_{r}.pkl`, one per process) are fewer than its own
    files say processes saved it (`ranks.missing_rank_states`) is unfinished too, and in
    any layout with per-rank files (the Trainer's `rng_state_{r}.pth` too) one lacking a rank
    above its own highest, or rank 0, that the save before it holds (`_ranks_dropped_since`)."""
    from ..layouts.ranks import missing_rank_states

    lost = missing_rank_states(folder.source, folder, layout)
    if not any(p.severity == "error" for p in lost):
        # a rank above every rank this save's files name (a DDP save's highest), or rank 0's
        # beside another's: the save before it says how many processes the run has
        dropped = _ranks_dropped_since(layout, folder, before)
        if dropped is not None:
            return dropped
    last = layout.last_file
    if last is None:
        return None
    if lost:
        # accelerate: every process writes its RNG states at the end of the save, rank 0's
        # after the model and optimizer: one not here yet is being written, or was never
        # written (its process died), or was lost since; or, on node-local disks, it is on
        # another node's (`rank_rng_elsewhere`): then only while the save is recent
        names = ", ".join(p.file.rsplit("/", 1)[-1] for p in lost if p.file)
        certain = any(p.severity == "error" for p in lost)
        return Unfinished(
            f"no {names}, which every process of a multi-process {layout.name} save writes "
            "last (its other per-rank files say how many processes saved): the save has not "
            "finished, or a rank's file was lost"
            + ("" if certain else ", or is on another node's disk (`save_on_each_node`)"),
            certain=certain,
        )
    if folder.matching(last.pattern):
        return _cut_after_last(layout, folder, before)
    if not named and not any(last.fullmatch(name) for name in run_files):
        return None
    example = layout.rank_file_name(0, 1) if layout.rank_files is not None else last.pattern
    return Unfinished(
        f"no {example}, which {layout.name} writes last (after the model and optimizer "
        "state): the save has not finished"
    )


def _zero_partition_problem(storage: Storage, folder: str, files: Mapping[str, int]) -> str | None:
    """A ZeRO partition missing from a DeepSpeed tag folder: every data-parallel rank's
    optimizer file (and at ZeRO-3 its model states), as many as the rank-0 model states record
    (`dp_world_size`, read from its pickle's opcodes: nothing unpickled, no torch). Each file
    alone passes its structural check; a save that lost a rank's partition (a node's disk)
    cannot be resumed nor its weights rebuilt."""
    from ..layouts.zero import RANK0_MODEL_STATES, SavedSizes, expected_partitions

    model = next((f"{folder}/{n}" for n in RANK0_MODEL_STATES if f"{folder}/{n}" in files), None)
    if model is None:
        if deepspeed_states_in(folder, files):
            return None  # another rank's model states alone: the component checks judge it
        return (
            f"lacks {RANK0_MODEL_STATES[0]}: DeepSpeed writes the model states into every tag "
            "and its load_checkpoint fails without them (a save cut short, or a lost file)"
        )
    # through the save's own folder: a tag linked elsewhere is judged by what it links to,
    # as any linked save of a run is (and DeepSpeed's loader reads it)
    own = folder_storage(storage, folder, files)
    keys = frozenset({"dp_world_size", "mp_world_size"})
    try:
        sizes = model_states_ints(own, model[len(folder) + 1 :], keys)
    except (zipfile.BadZipFile, OSError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return f"{storage.describe(model)}: truncated or corrupt torch.save file ({exc})"
    saved = SavedSizes(dp=sizes.get("dp_world_size"), mp=sizes.get("mp_world_size"))
    try:
        plan = expected_partitions(
            f"{folder}/", set(files), saved, storage.describe(model), storage.describe
        )
    except CkptError as exc:  # more ranks than any run: no save to resume
        return exc.stated
    missing = [rel for rel in plan[3] if rel not in files] if plan else []
    if not missing:
        return None
    names = ", ".join(rel[len(folder) + 1 :] for rel in missing[:3])
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return (
        f"lacks {names}{more}: every data-parallel rank's ZeRO partition is needed to resume "
        "or rebuild the weights"
    )


def with_status(entry: RunCheckpoint, status: Status, reason: str) -> RunCheckpoint:
    entry.status = status
    entry.complete = status == "complete"
    entry.reason = reason
    return entry


# --------------------------------------------------------------------------- markers, metrics


def read_deepspeed_latest(storage: Storage) -> str | None:
    """The tag a run folder's DeepSpeed `latest` file names, read through its storage (local
    or remote alike): at most 4 KiB of a regular file inside the run (a link out of the run, a
    FIFO or a folder named `latest` names nothing), and only a folder name (`deepspeed_tag`)."""
    try:
        if storage.size("latest") > 4096:
            return None
        text = storage.read_all("latest").decode()
    except (OSError, UnicodeDecodeError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return None
    return deepspeed_tag(text)


def read_megatron_tracker(storage: Storage) -> int | str | None:
    """What a Megatron-LM run folder's `latest_checkpointed_iteration.txt` says
    (`naming.megatron_tracker`: an iteration, `release`, or None for anything else), read
    through its storage: at most 4 KiB of a regular file. None also when there is none."""
    try:
        if not storage.exists(MEGATRON_TRACKER) or storage.size(MEGATRON_TRACKER) > 4096:
            return None
        text = storage.read_all(MEGATRON_TRACKER).decode()
    except (OSError, UnicodeDecodeError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return None
    return megatron_tracker(text)


def _megatron_problem(storage: Storage, folder: str, files: Mapping[str, int]) -> str | None:
    """Why a Megatron-LM save has not finished or is not whole: a `torch_dist` save (a DCP
    with `common.pt`) without `metadata.json` (megatron-core's `dist_checkpointing.save`
    writes `common.pt`, then the DCP, then `metadata.json` last, its finalize step after an
    async save's writes, and its `load` reads `metadata.json` first); a legacy save
    (`mp_rank_*/model_optim_rng.pt`) that lacks rank folders its args call for
    (`megatron_missing_ranks`), or the `distrib_optim.pt` its args say each rank folder holds
    (`megatron_legacy.missing_distrib_optim`)."""
    start = f"{folder}/"
    names = [rel[len(start) :] for rel in files if rel.startswith(start)]
    top = set(names)
    torch_dist = "common.pt" in top or holds_dcp(top)
    if not torch_dist:
        sizes, flags = megatron_legacy_args(storage, folder, names)
        missing = missing_ranks(names, sizes) if rank_folders(names) else None
        if missing is not None:
            return f"{missing_ranks_text(missing)}; restore them from the node that wrote them"
        lost = missing_distrib_optim(names, flags)
        if lost:
            return f"{missing_distrib_optim_text(lost)}; restore it from the node that wrote it"
        return None
    if "metadata.json" in top:
        return None
    return (
        "no metadata.json, which megatron-core's dist_checkpointing.save writes last "
        "(after common.pt and the DCP): the save has not finished"
    )


def megatron_missing_ranks(
    storage: Storage, folder: str, names: Iterable[str]
) -> MissingRanks | None:
    """The rank folders a legacy Megatron-LM save lacks (`layouts.megatron_legacy`), the save
    being `folder` of `storage` ("" for the storage itself) and `names` the paths inside it.
    The parallel sizes come from the lowest rank's `model_optim_rng.pt` `args`, read by its
    pickle opcodes (`model_states_ints`: nothing unpickled, no tensor data); one that cannot
    be read leaves the numbering of the folders present to tell. None for no legacy save."""
    listed = list(names)
    if not rank_folders(listed):
        return None
    sizes, _flags = megatron_legacy_args(storage, folder, listed)
    return missing_ranks(listed, sizes)


def megatron_legacy_args(
    storage: Storage, folder: str, names: Iterable[str]
) -> tuple[dict[str, int], dict[str, bool]]:
    """What the `args` of a legacy Megatron-LM save (`folder` of `storage`, "" for the storage
    itself; `names` the paths inside it) record: its parallel sizes (`SIZE_KEYS`) and its
    optimizer flags (`FLAG_KEYS`), read from the lowest rank's `model_optim_rng.pt` by its
    pickle opcodes (nothing unpickled, no tensor data). Both empty when there is no rank file
    or it cannot be read (its own check names what is wrong with it)."""
    rank_file = rank_file_to_read(rank_folders(names))
    if rank_file is None:
        return {}, {}
    rel = f"{folder}/{rank_file}" if folder else rank_file
    try:
        data = _model_states_pickle(storage, rel)
    except (zipfile.BadZipFile, OSError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return {}, {}
    from ...formats.torch.pickle_scan import keyed_flags, keyed_ints

    return keyed_ints(data, SIZE_KEYS), keyed_flags(data, FLAG_KEYS)


def _model_states_pickle(storage: Storage, rel: str) -> bytes:
    """The `data.pkl` of a torch.save zip, at most `MAX_SCAN_BYTES` of it (empty when it has
    none). Raises what reading the zip raises (BadZipFile, OSError, CkptError)."""
    from ...formats.torch.pickle_scan import MAX_SCAN_BYTES

    with zipfile.ZipFile(_TailFile(storage, rel, storage.size(rel))) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        return read_member(archive, pickles[0], MAX_SCAN_BYTES, rel) if pickles else b""


def model_states_ints(storage: Storage, rel: str, keys: frozenset[str]) -> dict[str, int]:
    """The ints a torch.save zip (a DeepSpeed model states file, a Megatron-LM rank's
    `model_optim_rng.pt`) records under `keys`, read
    from its `data.pkl`'s opcodes (`pickle_scan.keyed_ints`): nothing unpickled, no torch, no
    tensor data. Raises what reading the zip raises (BadZipFile, OSError, CkptError)."""
    from ...formats.torch.pickle_scan import keyed_ints

    return keyed_ints(_model_states_pickle(storage, rel), keys)


def deepspeed_states_step(storage: Storage, tag: str, files: Mapping[str, int]) -> int | None:
    """The step DeepSpeed recorded in a tag folder's model states (`global_steps`, rank 0's
    file; `model_states_ints`): the step of a save whose tag names none
    (`save_checkpoint(dir, tag="final")`). None when it holds none or the file cannot be read
    (the judge then says what is wrong with it)."""
    states = deepspeed_states_in(tag, files)
    if not states:
        return None
    own = folder_storage(storage, tag, files)  # a linked tag: what it links to
    try:
        return model_states_ints(own, states[0][len(tag) + 1 :], frozenset({"global_steps"})).get(
            "global_steps"
        )
    except (zipfile.BadZipFile, OSError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return None


def trainer_state_step(storage: Storage, folder: str, files: Mapping[str, int]) -> int | None:
    """The step a Trainer save records in its `trainer_state.json` (`global_step`): the step of
    a save whose folder name holds none (`last-checkpoint/`). None when it has no such file or
    it cannot be read (the judge then says what is wrong with it)."""
    rel = f"{folder}/trainer_state.json"
    if rel not in files or json_record_over_budget(files[rel]) is not None:
        return None
    try:
        doc = json.loads(storage.read_all(rel))
    except (ValueError, OSError, RecursionError, CkptError) as exc:
        no_verdict(exc)  # the store or the OS refused: no verdict on the file
        return None
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def json_number(value: object) -> float | None:
    """A number read from JSON a trainer wrote, as a float; None for anything else (a string
    such as "NaN", a bool, null, an int past a float's range: the file is hand-edited or
    corrupt, and says nothing of the step or metric)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def newest_trainer_state(
    storage: Storage, checkpoints: list[RunCheckpoint]
) -> tuple[str, dict[str, Any]] | None:
    """The newest `trainer_state.json`: of the newest complete Trainer folder, or the run root,
    read through the run folder's storage (a link out of the run is not read)."""
    candidates: list[tuple[float, str]] = []
    for c in checkpoints:
        if c.layout == "hf-trainer" and c.complete and not c.symlink:
            candidates.append((float(c.step or 0), f"{c.name}/trainer_state.json"))
    states: list[tuple[float, str, dict[str, Any]]] = []
    for _order, rel in [*sorted(candidates, reverse=True)[:1], (0.0, "trainer_state.json")]:
        try:
            if json_record_over_budget(storage.size(rel)) is not None:
                continue  # not read: the checkpoint's own check names it
            doc = json.loads(storage.read_all(rel))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, CkptError) as exc:
            no_verdict(exc)  # the store or the OS refused: no verdict on the file
            continue
        if isinstance(doc, dict):
            states.append((json_number(doc.get("global_step")) or 0.0, rel, doc))
    if not states:
        return None
    _step, rel, doc = max(states, key=lambda s: s[0])
    return storage.describe(rel), doc


def _lines(text: str) -> Iterator[str]:
    """The `\n`-separated lines of `text`, one at a time (a JSON Lines file's own separator:
    JSON strings may hold U+2028, which `splitlines` would cut at)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        yield text[start:end]
        start = end + 1


def check_metrics_size(size: int, where: str) -> None:
    """Refuse (UsageError, as a line that is not JSON) a `metrics.jsonl` past the budget of a
    JSON record, before it is read."""
    too_large = json_record_over_budget(size)
    if too_large is not None:
        raise UsageError(
            too_large,
            path=where,
            fix="Keep the metrics a run logs to one line per evaluation, or move the older "
            "lines to another file.",
        )


def load_metrics(
    run_dir: Path,
    metric: str,
    trainer_state: dict[str, Any] | None,
    checkpoints: list[RunCheckpoint],
    metrics_file: tuple[str, str] | None = None,
) -> tuple[dict[int, float], dict[str, float], str | None]:
    """Values of `metric`: (by step, by checkpoint name, source description).

    `metrics_file` is (where, text) of a metrics file read elsewhere (a remote run folder).
    """
    path: Path | str = run_dir / METRICS_FILE
    by_step: dict[int, float] = {}
    source: str | None = None
    text: str | None = None
    if metrics_file is not None:
        path, text = metrics_file
    elif isinstance(path, Path) and path.is_file():
        check_metrics_size(path.stat().st_size, str(path))
        text = path.read_text(errors="replace")
    if text is not None:
        # line by line, never a list of them: a log of short lines holds millions
        for number, line in enumerate(_lines(text), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # too deep: hostile
                raise UsageError(
                    f"line {number} is not JSON",
                    path=path,
                    fix='Write one object per line: {"step": 500, "eval_loss": 1.9}.',
                ) from None
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                value = json_number(row.get(metric))
                if value is not None:
                    by_step[row["step"]] = value
        if by_step:
            source = str(path)
    if not by_step and trainer_state is not None:
        for row in trainer_state.get("log_history") or []:
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                value = json_number(row.get(metric))
                if value is not None:
                    by_step[row["step"]] = value
        if by_step:
            source = "trainer_state.json log_history"
    by_name: dict[str, float] = {}
    for c in checkpoints:
        if c.layout == "lightning":
            value = lightning_metrics(c.name.rsplit("/", 1)[-1]).get(metric)
            if value is not None:
                by_name[c.name] = value
    if by_name and source is None:
        source = "Lightning file names"
    return by_step, by_name, source


def best_by_metric(
    root: Path,
    metric: str,
    mode: Literal["min", "max"],
    trainer_doc: dict[str, Any] | None,
    checkpoints: list[RunCheckpoint],
    metrics_file: tuple[str, str] | None = None,
) -> BestMetric:
    by_step, by_name, source = load_metrics(root, metric, trainer_doc, checkpoints, metrics_file)
    best = BestMetric(metric=metric, mode=mode, source=source)
    for c in checkpoints:
        value = by_name.get(c.name)
        if value is None and c.step is not None:
            value = by_step.get(c.step)
        if value is not None and not math.isfinite(value):
            # a diverged eval logs NaN (or inf): never the best, never ranked
            note = f"{metric} is {value:g} here: treated as no value"
            c.reason = f"{c.reason}; {note}" if c.reason else note
            value = None
        c.metric = value
    scored = [c for c in checkpoints if c.complete and c.metric is not None]
    if scored:
        sign = 1.0 if mode == "min" else -1.0
        # ties go to the newer checkpoint
        winner = min(scored, key=lambda c: (sign * (c.metric or 0.0), [-x for x in c.order]))
        winner.markers.append("best")
        best.name, best.value = winner.name, winner.metric
    return best
