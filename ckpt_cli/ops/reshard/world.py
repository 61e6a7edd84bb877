"""`reshard --world-size`: a chunked checkpoint (DCP) re-cut as N ranks would have saved it.

Every tensor is cut `Shard(0)` by default (`placement` rules for other dims or replication),
chunk r in rank r's file; each output chunk is assembled from whichever source chunks overlap
it (`_BoxReader`: stored chunks loaded once per run of output chunks, raw ones through
`read_slice` for just the rows needed), so peak memory follows the largest chunk. Replicated
tensors are written once, spread over the rank files the way `dcp.save`'s de-duplication
spreads them (each to the file holding the fewest bytes so far); objects are copied as stored
bytes, once, into the file the writer keeps them in (rank 0's).

Per-rank training state (`placement.rank_of`: RNG streams and data-loader positions keyed by
rank) cannot be re-cut: it is carried unchanged when N equals the source world size; otherwise
the caller must choose `drop` or `keep` (copied as-is; a per-rank tensor goes whole into its
rank's file when that rank still exists, else rank 0's).

The work uses the chunk protocol of `formats.base` (`Checkpoint.read_chunk`,
`Writer.chunks_of` / `owns` / `write_chunk`, object bytes) and the target's facts
(`Format.shards_by_rank`, `serializations`, `compressions`), never a format name.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...dist.command import CombinedProgress, RankShare, active, split_output
from ...dist.placement import (
    Box,
    Rule,
    full_box,
    overlaps,
    param_weights,
    placement_dim,
    rank_of,
    rule_for,
    shard_boxes,
    with_rank,
)
from ...errors import REPORT_BUG, FormatError, UsageError
from ...formats import get_format, resolve_source
from ...formats.base import Checkpoint, Format, Source, WriteOptions, Writer
from ...formats.dcp import rank_chunk, rank_file
from ...formats.details import DcpDetails
from ...formats.names import RESHARD_RECORD
from ...heap import gc_paused
from ...models import Chunk, Entry, FileInfo, Manifest, TrainingState
from ...progress import NULL_PROGRESS, CountingProgress, Progress
from ...sources.layouts import ckpt_record
from ...sources.opening import open_plain
from ...storage.output import check_destination
from ..convert.plan import (
    NO_COMPRESSION,
    check_compressed_serialization,
    guard_paths,
    local_dest,
    output_warnings,
)
from ..shared.megatron import keep_megatron_layout
from ..shared.transfer import (
    Item,
    SkippedEntry,
    TransferPlan,
    account_files,
    check_source_unchanged,
    check_staged,
    copy_files,
    extra_files,
)
from .rank_files import reshard_record, with_record
from .report import (
    RankStateAction,
    RankStateChoice,
    RankStateEntry,
    ReshardReport,
    ResumeVerdict,
)
from .request import ReshardRequest

if TYPE_CHECKING:
    import torch

    from ...sources.layouts.base import SingleLayout
    from ...storage.output import Destination

_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


def source_world_size(checkpoint: Checkpoint) -> int:
    """How many ranks saved a DCP checkpoint: recorded by the adapter, else from file names."""
    details = DcpDetails.of(checkpoint.manifest)
    if details is not None and details.world_size > 0:
        return details.world_size
    ranks = [
        int(m.group(1))
        for f in checkpoint.manifest.files
        if (m := _DISTCP.match(f.path.rsplit("/", 1)[-1]))
    ]
    return max(ranks) + 1 if ranks else 1


def find_rank_state(entries: list[Entry]) -> list[RankStateEntry]:
    """Per-rank training-state entries (see `placement.rank_of`); the bookkeeping of ckpt's own
    record (`ckpt_record`: a Checkpointer save's `__ckpt__.shapes.rank-R`) is not the user's
    state, and `plan_cut` cuts it for the new world size itself."""
    found = []
    for entry in entries:
        if ckpt_record.is_bookkeeping(entry.name):
            continue
        rank = rank_of(entry.name)
        if rank is not None:
            found.append(
                RankStateEntry(name=entry.name, rank=rank, kind=entry.kind, nbytes=entry.nbytes)
            )
    return found


@gc_paused()  # a million planned chunks and no cycles: see `heap`
def plan_world_size(
    entries: list[Entry],
    world_size: int,
    rules: list[Rule],
    rank_state: dict[str, int],
    drop: set[str],
    added: dict[str, str] | None = None,
) -> tuple[list[Entry], dict[str, int], int]:
    """Lay `entries` out for `world_size` ranks.

    Returns the planned entries (tensors with `chunks`), how many tensors were sharded per
    dim, and how many were replicated. Per-rank tensors in `rank_state` (name -> rank) go whole
    into their rank's file (rank 0's if that rank is gone). Objects get a `file` too, for
    writers that honour it (the DCP writer keeps objects in rank 0's file). `added` (new name
    -> source entry) plans copies of per-rank entries for new ranks (`replicate`), each placed
    after its source entry and laid out like it.
    """
    added = added or {}
    by_source: dict[str, list[str]] = {}
    for new, old in added.items():
        by_source.setdefault(old, []).append(new)
    wanted: list[Entry] = []
    for entry in entries:
        if entry.name not in drop:
            wanted.append(entry)
        wanted.extend(
            entry.model_copy(update={"name": new}) for new in by_source.get(entry.name, [])
        )
    load = [0] * world_size
    weights = param_weights(e.name for e in wanted if e.kind == "tensor")
    planned: dict[str, Entry] = {}
    sharded: dict[str, int] = {}
    whole: list[Entry] = []
    for entry in wanted:
        if entry.name in rank_state or entry.kind == "object":
            whole.append(entry)
            continue
        dim = placement_dim(entry.name, entry.shape, rules, weights)
        if dim is None:
            whole.append(entry)
            continue
        itemsize = entry.nbytes // entry.numel if entry.numel else 0
        chunks = []
        seen: set[tuple[int, ...]] = set()
        for rank, box in enumerate(shard_boxes(entry.shape, world_size, dim)):
            # ranks past the end get empty boxes at the same offset; DCP keys chunks by
            # offset, so (like dcp.save's plan dedup and our convert) only the first is kept
            if box.offsets in seen:
                continue
            seen.add(box.offsets)
            chunks.append(rank_chunk(rank, box))
            load[rank] += box.numel * itemsize
        planned[entry.name] = entry.model_copy(
            update={"chunks": chunks, "file": rank_file(0), "offset": None}
        )
        sharded[str(dim)] = sharded.get(str(dim), 0) + 1
    replicated = 0
    for entry in whole:
        if entry.name in rank_state:
            rank = rank_state[entry.name]
            rank = rank if rank < world_size else 0
        else:
            # like dcp.save's de-duplication: the file holding the fewest bytes so far
            rank = min(range(world_size), key=lambda r: load[r])
        load[rank] += entry.nbytes
        update: dict[str, Any] = {"file": rank_file(rank), "offset": None}
        if entry.kind == "tensor":
            replicated += 1
            update["chunks"] = [rank_chunk(rank, full_box(entry.shape))]
        planned[entry.name] = entry.model_copy(update=update)
    # keep the source's entry order
    return [planned[e.name] for e in wanted], sharded, replicated


@dataclass
class DcpCut:
    """One DCP checkpoint planned for another world size: what `write_cuts` writes.

    Attributes:
        checkpoint: the source DCP (open; the caller closes it).
        fmt: its format, the output's too.
        plan: the output entries, chunked for the new world size.
        options: the writer's options.
        into: the output sub-folder it is written in (`pytorch_model_fsdp_0/`), '' for the
            output itself.
        extras: source files (relative to the checkpoint's own folder) copied beside it.
        copied_from: output entry -> the source entry its data comes from (`replicate`).
        values: output object entry -> the value written instead of the stored one (the world
            size a framework recorded for its per-rank state).
        report: what the plan says (world sizes, rank state, placements).
    """

    checkpoint: Checkpoint
    fmt: type[Format]
    plan: list[Entry]
    options: WriteOptions
    into: str
    extras: list[str]
    copied_from: dict[str, str]
    values: dict[str, Any]
    report: ReshardReport


def plan_cut(
    checkpoint: Checkpoint,
    world_size: int,
    *,
    rules: list[Rule],
    action: RankStateAction | None,
    serialization: str | None,
    compression: str | None,
    into: str = "",
    extras: list[str] | None = None,
    world_size_entries: tuple[str, ...] = (),
) -> DcpCut:
    """Plan one DCP checkpoint for `world_size` ranks, its per-rank entries as `action` says.

    `replicate`: each rank below `world_size` keeps its own entries; ranks the source did not
    have get copies of the lowest rank's (renamed, `placement.with_rank`); ranks past the new
    world are left out; `world_size_entries` (objects recording the world size the per-rank
    state was saved for) then hold the new world size.
    """
    manifest = checkpoint.manifest
    fmt = get_format(manifest.format)
    if not fmt.shards_by_rank or not fmt.writable:
        raise UsageError(
            f"--world-size re-cuts DCP checkpoints; this is a {manifest.format} checkpoint",
            path=manifest.location,
            fix="Use `ckpt convert SRC DEST --to dcp --world-size N` to make a DCP one, "
            "or --max-shard-size to regroup shards.",
        )
    before = source_world_size(checkpoint)
    rank_entries = find_rank_state(manifest.entries)
    if not rank_entries:
        action = None
    names = {e.name for e in manifest.entries}
    copied_rank: int | None = None  # whose per-rank entries new ranks get copies of
    drop: set[str] = set()
    added: dict[str, str] = {}
    values: dict[str, Any] = {}
    if action == "drop":
        drop = {e.name for e in rank_entries}
    elif action == "replicate":
        drop = {e.name for e in rank_entries if e.rank >= world_size}
        ranks = {e.rank for e in rank_entries}
        copied_rank = first = min(ranks)
        for entry in (e for e in rank_entries if e.rank == first):
            for rank in range(world_size):
                new = with_rank(entry.name, rank)
                if (
                    rank not in ranks
                    and new != entry.name
                    and new not in names
                    and not ckpt_record.never_read(new)
                ):
                    added[new] = entry.name
        values = {n: world_size for n in world_size_entries if n in names}
    # ckpt's own record (a Checkpointer save's): re-derived for the new world size, unasked
    record = ckpt_record.cut_record(names, world_size, copied_rank)
    for entry in rank_entries:
        if entry.name in drop:
            entry.written = []
        else:
            entry.written = [entry.name, *(n for n, old in added.items() if old == entry.name)]
    drop |= record.drop
    added.update(record.added)
    values.update(record.values)
    rank_of_entry = {e.name: e.rank for e in rank_entries}
    rank_of_entry.update({new: rank_of(new) or 0 for new in added})
    plan, sharded, replicated = plan_world_size(
        manifest.entries, world_size, rules, rank_of_entry, drop, added
    )
    # a Megatron-Core torch_dist source stays one (its common.pt + metadata.json)
    megatron_files = keep_megatron_layout(checkpoint, plan, fmt.name)
    chosen, compression = _encoding(fmt, manifest, serialization, compression)
    planner_data = checkpoint.planner_data
    if added and isinstance(planner_data, dict):
        planner_data = dict(planner_data)
        for new, old in added.items():
            path = planner_data.get(old)
            if isinstance(path, tuple) and path:
                planner_data[new] = tuple(
                    with_rank(p, rank_of_entry[new]) if isinstance(p, str) else p for p in path
                )
    options = WriteOptions(
        world_size=world_size,
        dcp_serialization=chosen,
        # keeps the nested state-dict paths, so dcp.load of nested dicts still maps keys
        dcp_planner_data=planner_data,
        dcp_compression=None if compression == NO_COMPRESSION else compression,
    )
    report = ReshardReport(
        mode="world-size",
        source=manifest.location,
        destination="",
        format=manifest.format,
        tensors=sum(1 for e in plan if e.kind != "object"),
        objects=sum(1 for e in plan if e.kind == "object"),
        tensor_bytes=sum(e.nbytes for e in plan if e.kind == "tensor"),
        source_world_size=before,
        world_size=world_size,
        serialization=chosen,
        partitioning="chunks",
        sharded=sharded,
        replicated=replicated,
        rules=[str(r) for r in rules],
        unused_rules=_unused_rules(rules, manifest),
        rank_state=rank_entries,
        rank_state_action=action,
        warnings=output_warnings(fmt, chosen),
    )
    return DcpCut(
        checkpoint=checkpoint,
        fmt=fmt,
        plan=plan,
        options=options,
        into=into,
        extras=[*(extras or []), *megatron_files],
        copied_from=added,
        values=values,
        report=report,
    )


def reshard_world_size(
    src: str | Source,
    dest: str,
    request: ReshardRequest,
    rules: list[Rule],
    progress: Progress = NULL_PROGRESS,
) -> ReshardReport:
    """Rewrite a DCP checkpoint as `request.world_size` ranks would have saved it (the
    folder's config/tokenizer files copied beside it unless `request.extras` is off).

    `rules` are the request's `--shard-dim` / `--plan`, parsed (once, by `reshard_with`). The
    DCP compression (`zstd` or `none`) defaults to the source's when the serialization stays
    torch_save: a zstd-compressed DCP is re-cut compressed. The report's `resume` says whether
    the output resumes the run the source held, and why not exactly after a world-size change.
    """
    assert request.world_size is not None
    world_size = request.world_size
    rank_state_action = cast(RankStateChoice | None, request.rank_state)
    serialization, compression = request.dcp_serialization, request.dcp_compression
    format, force, dry_run = request.format, request.force, request.dry_run
    check_world_options(world_size, compression)
    out = local_dest(dest)
    source = src if isinstance(src, Source) else None  # resolved already: read once
    text = source.location.raw if source is not None else str(src)
    guard_paths(text, out)  # as convert: a DEST in (or over) the source is refused
    check_destination(out.absolute(), force)
    with open_plain(source or resolve_source(text), format) as checkpoint:
        fmt = get_format(checkpoint.manifest.format)
        if fmt.shards_by_rank:
            before = source_world_size(checkpoint)
            rank_entries = find_rank_state(checkpoint.manifest.entries)
            names = [e.name for e in rank_entries]
            action = rank_state_choice(text, names, rank_state_action, before, world_size)
        else:
            action = None  # plan_cut says why it cannot
        layout = _single_layout(checkpoint) if format is None else None
        #: entries recording the world size the per-rank state was saved for (torchtitan's)
        recording = layout.rank_state_world_size if layout else ()
        cut = plan_cut(
            checkpoint,
            world_size,
            rules=rules,
            action=action,
            serialization=serialization,
            compression=compression,
            extras=extra_files(checkpoint) if request.extras else [],
            world_size_entries=recording,
        )
        report = cut.report
        report.destination = str(out)
        # every other file of the source, with why it is not in the output (as convert says)
        left_out = [] if request.extras else extra_files(checkpoint)
        report.skipped = _skipped_files(checkpoint, cut.extras, left_out)
        training = _training_of(checkpoint) if format is None else None
        notes = []
        recorded = [n for n in recording if n in checkpoint.manifest.by_name]
        if recorded and action == "keep" and world_size != report.source_world_size:
            notes.append(
                f"{', '.join(recorded)} still says {report.source_world_size}: "
                f"{layout.name if layout else 'the framework'}'s loader refuses per-rank state "
                "saved at another world size (--rank-state replicate sets it)"
            )
        report.resume = resume_verdict(training, report, notes)
        # a training save cut for another world size records the one the run saved it at: the
        # new file names say only the new one (verify: not exactly). Not a plain model, nor
        # weights with a counter: nothing of theirs depends on the number of ranks
        held = training if format is None else _training_of(checkpoint)
        trains = held is not None and bool(held.optimizer or held.rng or held.dataloader)
        record = (
            reshard_record(checkpoint.source, report.source_world_size or 1, world_size, action)
            if trains or action is not None
            else None
        )
        if dry_run:
            report.files = planned_rank_files(cut.fmt, cut.plan, world_size)
            report.files = with_record(report.files, record)
            report.extras = cut.extras  # copied beside the weights by the real run too
            report.dry_run = True
            return report

        def carry(staging: Path) -> None:
            if record is not None:
                # after the extras: a record the source had says an older cut
                (staging / RESHARD_RECORD).write_bytes(record)

        result = write_cuts([cut], out, force, progress, carry)
        report.files = with_record([FileInfo.model_validate(f) for f in result["files"]], record)
        report.extras = cut.extras
        report.verified = True
        report.ranks = [RankShare.model_validate(r) for r in result["shares"]]
        return report


def check_world_options(world_size: int, compression: str | None) -> None:
    """Refuse a world size below 1 and an unknown `--dcp-compression`."""
    known = known_compressions()
    if compression not in (None, NO_COMPRESSION, *known):
        raise UsageError(
            f"--dcp-compression {compression!r} is not {' or '.join([*known, NO_COMPRESSION])}",
            fix=f"Use --dcp-compression {' or '.join([*known, NO_COMPRESSION])}.",
        )
    if world_size < 1:
        raise UsageError(
            f"--world-size must be at least 1, got {world_size}",
            fix="Give the number of ranks, e.g. --world-size 8.",
        )


def _single_layout(checkpoint: Checkpoint) -> SingleLayout | None:
    """The single-checkpoint training layout (torchtitan...) a DCP checkpoint is, if any."""
    from ...sources.layouts.base import top_keys
    from ...sources.layouts.torch_dict import SINGLE_LAYOUTS

    keys = top_keys(checkpoint.manifest)
    for layout in SINGLE_LAYOUTS:
        if layout.matches(checkpoint, keys):
            return layout
    return None


def _training_of(checkpoint: Checkpoint) -> TrainingState | None:
    """The training state a DCP checkpoint holds (None for plain weights)."""
    from ...sources.layouts.torch_dict import analyse_single

    return analyse_single(checkpoint)


def known_compressions() -> list[str]:
    """Every compression a writable format offers (`--dcp-compression`)."""
    from ...formats import writable_formats

    return [c for name in writable_formats() for c in get_format(name).compressions]


#: what `--rank-state` may say, and what each does (the error message and the docs)
RANK_STATE_CHOICES = {
    "keep": "carry it as saved (nothing renamed or added)",
    "drop": "leave it out (each rank starts fresh RNG / data-loader state)",
    "replicate": "give each new rank a copy of rank 0's (ranks past the new world left out)",
}


def rank_state_choice(
    src: str,
    names: list[str],
    asked: RankStateChoice | None,
    before: int,
    world_size: int,
) -> RankStateAction | None:
    """What happens to per-rank state (`names`: its entries and files): as asked, carried at
    the same world size, else refused with the choices (exit 2)."""
    if not names:
        return None
    if asked is not None:
        return asked
    if world_size == before:
        return "carry"
    shown = ", ".join(names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    choices = "; ".join(f"--rank-state {k} to {v}" for k, v in RANK_STATE_CHOICES.items())
    raise UsageError(
        f"holds per-rank training state that cannot be resharded from "
        f"{before} to {world_size} ranks: {shown}{more}",
        path=src,
        fix=f"Choose what happens to it: {choices}.",
    )


def resume_verdict(
    training: TrainingState | None, report: ReshardReport, notes: list[str]
) -> ResumeVerdict | None:
    """Whether the output resumes the run `training` describes, and why not exactly.

    A world-size change never resumes bit-identically: every rank reads another shard of the
    data and draws from another RNG stream than the saved run did. `notes` adds the
    layout's own reasons (the global batch the data position was counted in).
    """
    if training is None:
        return None
    before, after = report.source_world_size, report.world_size
    if before == after:
        reasons = [f"the source is not exact: it lacks {', '.join(training.missing_exact)}"]
        return ResumeVerdict(
            resumable=training.resumable,
            exact=training.exact,
            reasons=[] if training.exact else reasons,
        )
    reasons = [
        f"the world size changed ({before} -> {after} ranks): each rank reads another shard of "
        "the data and draws from another RNG stream than the saved run did",
    ]
    action = report.rank_state_action
    lo, hi = sorted((before or 1, after or 1))
    several = hi - lo > 1
    ranks = f"ranks {lo}..{hi - 1}" if several else f"rank {lo}"
    grew = (after or 1) > (before or 1)
    if action == "drop":
        reasons.append("per-rank RNG / data-loader state was left out: every rank starts fresh")
    elif action == "replicate" and grew:
        copies = "start from copies" if several else "starts from a copy"
        reasons.append(f"{ranks} {copies} of rank 0's per-rank state")
    elif action == "replicate":
        reasons.append(f"the per-rank state of {ranks} was left out (no such rank any more)")
    elif action == "keep" and grew:
        finds = "find none of their own" if several else "finds none of its own"
        reasons.append(f"per-rank state was carried as saved: {ranks} {finds}")
    elif action == "keep":
        reasons.append(f"per-rank state was carried as saved: that of {ranks} is not read")
    reasons.extend(notes)
    if not training.resumable:
        reasons.insert(0, f"the source cannot resume: it lacks {', '.join(training.missing)}")
    return ResumeVerdict(resumable=training.resumable, exact=False, reasons=reasons)


def _encoding(
    fmt: type[Format], manifest: Manifest, serialization: str | None, compression: str | None
) -> tuple[str, str | None]:
    """(serialization, compression) of the output: as asked, else the source's own."""
    default = fmt.serializations[0]
    details = DcpDetails.of(manifest)
    chosen = serialization or (details.serialization if details else default)
    if chosen not in fmt.serializations:
        # HuggingFaceStorageWriter's per-rank files ("hf_safetensors") and mixed folders
        # become a regular DCP that dcp.load reads
        chosen = default
    if compression is None and details and details.compression and chosen == default:
        # a compressed source stays compressed (the transform applies to the default only)
        compression = fmt.compressions[0] if fmt.compressions else None
    check_compressed_serialization(fmt, chosen, compression)
    return chosen, compression


def write_cuts(
    cuts: list[DcpCut],
    out: Destination,
    force: bool,
    progress: Progress,
    carry: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Write every planned cut (each rank its files under torchrun), then each one's commit
    marker, extras and structural check, then `carry` (the rest of a training folder);
    publish `out` with one rename."""
    total = sum(e.nbytes for cut in cuts for e in cut.plan if e.kind == "tensor")
    workers = active()
    writers: list[Writer] = []

    def work(staging: Path) -> dict[str, Any]:
        started = time.perf_counter()
        writers.clear()
        mine: list[str] = []
        for cut in cuts:
            folder = staging / cut.into if cut.into else staging
            folder.mkdir(parents=True, exist_ok=True)
            writer = cut.fmt.writer(folder, cut.plan, cut.options)
            if not writer.chunk_writes:
                raise FormatError(
                    f"the {cut.fmt.name} writer of this version cannot write planned chunks",
                    fix=REPORT_BUG,
                )
            if workers.distributed:
                sizes = writer.output_files()
                names = list(sizes)
                own = [names[i] for i in workers.mine([sizes[n] for n in names])]
                writer.restrict(own)
                mine.extend(f"{cut.into}{n}" for n in own)
            writers.append(writer)
        counted = CountingProgress(CombinedProgress(progress, workers))
        counted.start(total, "resharding")
        parts = []
        try:
            for cut, writer in zip(cuts, writers, strict=True):
                _copy_chunks(cut, writer, counted)
            workers.test_failure_point("the reshard")
            parts = [writer.finish_part() for writer in writers]
        finally:
            counted.finish()
        for cut in cuts:
            check_source_unchanged(cut.checkpoint)
        share = RankShare(
            rank=workers.rank,
            files=mine,
            # the bytes of the files this rank wrote (containers and objects too), not the
            # tensor data alone: the ranks' shares add up to the output
            bytes=sum((staging / rel).stat().st_size for rel in mine) if mine else counted.done,
            seconds=time.perf_counter() - started,
        )
        return {"parts": parts, "share": share.model_dump(mode="json")}

    def commit(staging: Path, parts: list[dict[str, Any]]) -> dict[str, Any]:
        files: list[FileInfo] = []
        for i, cut in enumerate(cuts):
            folder = staging / cut.into if cut.into else staging
            written = writers[i].commit([p["parts"][i] for p in parts])
            files.extend(f.model_copy(update={"path": f"{cut.into}{f.path}"}) for f in written)
        # the writers' per-entry layouts are spent: free them before the checks read (#20)
        writers.clear()
        for cut in cuts:
            folder = staging / cut.into if cut.into else staging
            copy_files(cut.checkpoint, cut.extras, folder)
            check_staged(cut.fmt.name, folder, single_file=False)
        if carry is not None:
            carry(staging)
        for cut in cuts:
            check_source_unchanged(cut.checkpoint)
        return {
            "files": [f.model_dump(mode="json") for f in files],
            "shares": [p["share"] for p in parts] if workers.distributed else [],
        }

    result: dict[str, Any] = split_output(workers, out, force=force, work=work, commit=commit)
    return result


def _copy_chunks(cut: DcpCut, writer: Writer, counted: Progress) -> None:
    """Every entry this writer wants: objects as stored bytes, tensors box by box."""
    checkpoint = cut.checkpoint
    reader = _BoxReader(checkpoint)
    for entry in cut.plan:
        if not writer.wants(entry.name):
            continue
        source = cut.copied_from.get(entry.name, entry.name)
        if entry.kind == "object":
            if entry.name in cut.values:
                writer.write_object(entry.name, cut.values[entry.name])
            else:
                _copy_object(checkpoint, writer, source, entry.name)
            continue
        assert entry.chunks is not None
        for index, chunk in enumerate(entry.chunks):
            if not writer.owns(chunk.file):
                continue
            piece = reader.read(entry, chunk, source)
            writer.write_chunk(entry.name, index, piece)
            counted.advance(piece.numel() * piece.element_size())
            del piece
        reader.forget()


def _unused_rules(rules: list[Rule], manifest: Manifest) -> list[str]:
    """The `--shard-dim` / `--plan` rules that match no tensor of the source."""
    return [
        str(r) for r in rules if not any(rule_for(e.name, [r]) for e in manifest.tensors if e.shape)
    ]


def _skipped_files(
    checkpoint: Checkpoint, carried: list[str], left_out: list[str]
) -> list[SkippedEntry]:
    """The source's files neither re-cut nor copied, with why (`account_files`, as `convert`
    reports them): its checksum manifest, a file in a subfolder... They used to vanish."""
    plan = TransferPlan(items=[Item(e, e) for e in checkpoint.manifest.entries])
    _, skipped = account_files(checkpoint, plan, [*carried, *left_out], single_file=False)
    return [
        SkippedEntry(name=r, kind="file", reason="left out (--no-extras)") for r in left_out
    ] + [s for s in skipped]


def planned_rank_files(fmt: type[Format], plan: list[Entry], world_size: int) -> list[FileInfo]:
    """`--dry-run` of a world-size reshard: each rank's file and the entries it would hold, as
    the writer reports them: a chunk in the rank file it is planned in, every object in rank
    0's file (where the DCP writer keeps them), the commit marker holding none. Sizes are left
    unknown: each item's container (a torch.save zip) is only sized as it is written, and the
    data bytes alone would understate every file."""
    first = fmt.rank_file(0)
    held: dict[str, int] = {fmt.rank_file(r): 0 for r in range(world_size)}
    for entry in plan:
        if entry.kind == "object" or not entry.chunks:
            held[first] += 1
            continue
        for chunk in entry.chunks:
            held[chunk.file] = held.get(chunk.file, 0) + 1
    files = [FileInfo(path=name, entries=count) for name, count in held.items()]
    return [FileInfo(path=fmt.commit_marker or "", entries=0), *files]


def _copy_object(checkpoint: Checkpoint, writer: Writer, source: str, name: str) -> None:
    """Copy the non-tensor entry `source` as `name`, as its stored bytes (never unpickled)
    where both sides can."""
    if checkpoint.object_bytes and writer.object_bytes:
        writer.write_object_bytes(name, checkpoint.read_object_bytes(source))
    else:
        writer.write_object(name, checkpoint.read_object(source))


class _BoxReader:
    """Reads output boxes from the source, keeping the last stored chunk it loaded.

    Output chunks of one tensor come in order, so consecutive boxes usually fall in the same
    source chunk: a torch_save chunk is then loaded once, not once per output chunk (1 -> 4
    ranks would load every tensor 4 times through `read_slice`). Memory stays at one source
    chunk plus one output chunk, the same bound as `read_slice`. Raw (safetensors) chunks go
    through `read_slice`, which reads only the rows a box needs.
    """

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._key: tuple[str, int] | None = None
        self._chunk: torch.Tensor | None = None

    def _stored(self, name: str, index: int) -> torch.Tensor:
        if self._key != (name, index):
            self._chunk = None  # drop the old chunk before loading the next
            self._chunk = self.checkpoint.read_chunk(name, index)
            self._key = (name, index)
        assert self._chunk is not None
        return self._chunk

    def forget(self) -> None:
        """Release the cached chunk (between tensors)."""
        self._key, self._chunk = None, None

    def read(self, entry: Entry, chunk: Chunk, name: str | None = None) -> torch.Tensor:
        """The source data of one output chunk of `entry` (read from the source entry `name`,
        by default the entry's own)."""
        import torch

        from ...tensors import torch_dtype

        assert entry.dtype is not None
        if any(s == 0 for s in chunk.sizes):
            return torch.empty(chunk.sizes, dtype=torch_dtype(entry.dtype))
        name = name or entry.name
        source = self.checkpoint.manifest.by_name[name]
        stored = source.chunks or []
        if not self.checkpoint.chunk_reads or not stored or any(c.raw for c in stored):
            return self.checkpoint.read_slice(name, list(chunk.offsets), list(chunk.sizes))
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        try:
            pieces = overlaps(box, [Box(tuple(c.offsets), tuple(c.sizes)) for c in stored])
        except ValueError as exc:
            raise FormatError(
                f"tensor {name!r}: {exc}",
                path=self.checkpoint.manifest.location,
                fix="The checkpoint is missing data; `ckpt verify` lists every problem.",
            ) from None
        out = torch.empty(chunk.sizes, dtype=torch_dtype(entry.dtype))
        for piece in pieces:
            data = self._stored(name, piece.chunk)
            src = tuple(
                slice(o, o + n) for o, n in zip(piece.src.offsets, piece.src.sizes, strict=True)
            )
            dst = tuple(
                slice(o, o + n) for o, n in zip(piece.dst.offsets, piece.dst.sizes, strict=True)
            )
            out[dst] = data[src]
        return out
