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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..distributed import CombinedProgress, RankShare, active, split_output
from ..errors import FormatError, UsageError
from ..formats import get_format, open_checkpoint
from ..formats.base import Checkpoint, Format, WriteOptions, Writer
from ..formats.dcp import rank_chunk, rank_file
from ..formats.details import DcpDetails
from ..layouts.megatron import keep_megatron_layout
from ..models import Chunk, Entry, FileInfo, Manifest
from ..output import check_destination
from ..placement import (
    Box,
    Rule,
    full_box,
    overlaps,
    placement_dim,
    rank_of,
    rule_for,
    shard_boxes,
)
from ..progress import NULL_PROGRESS, CountingProgress, Progress
from .convert_plan import NO_COMPRESSION, guard_paths, local_dest, output_warnings
from .reshard_report import RankStateAction, RankStateEntry, ReshardReport
from .transfer import check_staged, copy_files, extra_files

if TYPE_CHECKING:
    import torch

    from ..output import Destination

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
    """Per-rank training-state entries (see `placement.rank_of`)."""
    found = []
    for entry in entries:
        rank = rank_of(entry.name)
        if rank is not None:
            found.append(
                RankStateEntry(name=entry.name, rank=rank, kind=entry.kind, nbytes=entry.nbytes)
            )
    return found


def plan_world_size(
    entries: list[Entry],
    world_size: int,
    rules: list[Rule],
    rank_state: dict[str, int],
    drop: set[str],
) -> tuple[list[Entry], dict[str, int], int]:
    """Lay `entries` out for `world_size` ranks.

    Returns the planned entries (tensors with `chunks`), how many tensors were sharded per
    dim, and how many were replicated. Per-rank tensors in `rank_state` (name -> rank) go whole
    into their rank's file (rank 0's if that rank is gone). Objects get a `file` too, for
    writers that honour it (the DCP writer keeps objects in rank 0's file).
    """
    load = [0] * world_size
    planned: dict[str, Entry] = {}
    sharded: dict[str, int] = {}
    whole: list[Entry] = []
    for entry in entries:
        if entry.name in drop:
            continue
        if entry.name in rank_state or entry.kind == "object":
            whole.append(entry)
            continue
        dim = placement_dim(entry.name, entry.shape, rules)
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
    return [planned[e.name] for e in entries if e.name in planned], sharded, replicated


def reshard_world_size(
    src: str,
    dest: str,
    world_size: int,
    *,
    rules: list[Rule] | None = None,
    rank_state_action: Literal["drop", "keep"] | None = None,
    serialization: str | None = None,
    compression: str | None = None,
    format: str | None = None,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
) -> ReshardReport:
    """Rewrite a DCP checkpoint as `world_size` ranks would have saved it (the folder's
    config/tokenizer files copied beside it unless `extras=False`).

    `compression` (`zstd` or `none`) defaults to the source's when the serialization stays
    torch_save: a zstd-compressed DCP is re-cut compressed.
    """
    known = known_compressions()
    if compression not in (None, NO_COMPRESSION, *known):
        raise UsageError(
            f"--dcp-compression {compression!r} is not {' or '.join([*known, NO_COMPRESSION])}"
        )
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    rules = list(rules or [])
    out = local_dest(dest)
    guard_paths(src, out)  # as convert: a DEST in (or over) the source is refused
    check_destination(out.absolute(), force)
    with open_checkpoint(src, format) as checkpoint:
        manifest = checkpoint.manifest
        fmt = get_format(manifest.format)
        if not fmt.shards_by_rank or not fmt.writable:
            raise UsageError(
                f"--world-size re-cuts DCP checkpoints; this is a {manifest.format} checkpoint",
                path=src,
                fix="Use `ckpt convert SRC DEST --to dcp --world-size N` to make a DCP one, "
                "or --max-shard-size to regroup shards.",
            )
        before = source_world_size(checkpoint)
        rank_entries = find_rank_state(manifest.entries)
        action = _rank_state_action(src, rank_entries, rank_state_action, before, world_size)
        drop = {e.name for e in rank_entries} if action == "drop" else set()
        plan, sharded, replicated = plan_world_size(
            manifest.entries,
            world_size,
            rules,
            {e.name: e.rank for e in rank_entries},
            drop,
        )
        # a Megatron-Core torch_dist source stays one (its common.pt + metadata.json)
        megatron_files = keep_megatron_layout(checkpoint, plan, fmt.name)
        chosen, compression = _encoding(fmt, manifest, serialization, compression)
        report = ReshardReport(
            mode="world-size",
            source=manifest.location,
            destination=str(out),
            format=manifest.format,
            tensors=sum(1 for e in plan if e.kind != "object"),
            objects=sum(1 for e in plan if e.kind == "object"),
            tensor_bytes=sum(e.nbytes for e in plan if e.kind == "tensor"),
            source_world_size=before,
            world_size=world_size,
            serialization=chosen,
            sharded=sharded,
            replicated=replicated,
            rules=[str(r) for r in rules],
            unused_rules=_unused_rules(rules, manifest),
            rank_state=rank_entries,
            rank_state_action=action,
        )
        if dry_run:
            report.files = _planned_files(fmt, plan, world_size)
            report.dry_run = True
            return report
        options = WriteOptions(
            world_size=world_size,
            dcp_serialization=chosen,
            # keeps the nested state-dict paths, so dcp.load of nested dicts still maps keys
            dcp_planner_data=checkpoint.planner_data,
            dcp_compression=None if compression == NO_COMPRESSION else compression,
        )
        carried_extras = (extra_files(checkpoint) if extras else []) + megatron_files
        result = _write(checkpoint, fmt, plan, options, out, carried_extras, force, progress)
        report.files = [FileInfo.model_validate(f) for f in result["files"]]
        report.extras = carried_extras
        report.warnings = output_warnings(fmt, chosen)
        report.verified = True
        report.ranks = [RankShare.model_validate(r) for r in result["shares"]]
        return report


def known_compressions() -> list[str]:
    """Every compression a writable format offers (`--dcp-compression`)."""
    from ..formats import writable_formats

    return [c for name in writable_formats() for c in get_format(name).compressions]


def _rank_state_action(
    src: str,
    rank_entries: list[RankStateEntry],
    asked: Literal["drop", "keep"] | None,
    before: int,
    world_size: int,
) -> RankStateAction | None:
    """What happens to per-rank state: as asked, carried at the same world size, else refused."""
    if not rank_entries:
        return None
    if asked is not None:
        return asked
    if world_size == before:
        return "carry"
    names = ", ".join(e.name for e in rank_entries[:8])
    more = f" and {len(rank_entries) - 8} more" if len(rank_entries) > 8 else ""
    raise UsageError(
        f"holds per-rank training state that cannot be resharded from "
        f"{before} to {world_size} ranks: {names}{more}",
        path=src,
        fix="Pass --drop-rank-state to leave it out (each rank starts fresh RNG / "
        "data-loader state) or --keep-rank-state to copy it as-is.",
    )


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
    return chosen, compression


def _write(
    checkpoint: Checkpoint,
    fmt: type[Format],
    plan: list[Entry],
    options: WriteOptions,
    out: Destination,
    carried_extras: list[str],
    force: bool,
    progress: Progress,
) -> dict[str, Any]:
    """Write every planned chunk and object (each rank its files under torchrun), then the
    commit marker, the extras and the structural check; publish `out`."""
    total = sum(e.nbytes for e in plan if e.kind == "tensor")
    workers = active()
    writers: list[Writer] = []

    def work(staging: Path) -> dict[str, Any]:
        started = time.perf_counter()
        writer = fmt.writer(staging, plan, options)
        writers.append(writer)
        if not writer.chunk_writes:
            raise FormatError(f"the {fmt.name} writer of this version cannot write planned chunks")
        mine: list[str] = []
        if workers.distributed:
            sizes = writer.output_files()
            names = list(sizes)
            mine = [names[i] for i in workers.mine([sizes[n] for n in names])]
            writer.restrict(mine)
        counted = CountingProgress(CombinedProgress(progress, workers))
        counted.start(total, "resharding")
        try:
            _copy_chunks(checkpoint, writer, plan, counted)
            workers.test_failure_point("the reshard")
            part = writer.finish_part()
        finally:
            counted.finish()
        share = RankShare(
            rank=workers.rank,
            files=mine,
            bytes=counted.done,
            seconds=time.perf_counter() - started,
        )
        return {"part": part, "share": share.model_dump(mode="json")}

    def commit(staging: Path, parts: list[dict[str, Any]]) -> dict[str, Any]:
        files = writers[0].commit([p["part"] for p in parts])
        # the writer's per-entry layout is spent: free it before the check reads the output (#20)
        writers.clear()
        copy_files(checkpoint, carried_extras, staging)
        check_staged(fmt.name, staging, single_file=False)
        return {
            "files": [f.model_dump(mode="json") for f in files],
            "shares": [p["share"] for p in parts] if workers.distributed else [],
        }

    result: dict[str, Any] = split_output(workers, out, force=force, work=work, commit=commit)
    return result


def _copy_chunks(
    checkpoint: Checkpoint, writer: Writer, plan: list[Entry], counted: Progress
) -> None:
    """Every entry this writer wants: objects as stored bytes, tensors box by box."""
    reader = _BoxReader(checkpoint)
    for entry in plan:
        if not writer.wants(entry.name):
            continue
        if entry.kind == "object":
            _copy_object(checkpoint, writer, entry.name)
            continue
        assert entry.chunks is not None
        for index, chunk in enumerate(entry.chunks):
            if not writer.owns(chunk.file):
                continue
            piece = reader.read(entry, chunk)
            writer.write_chunk(entry.name, index, piece)
            counted.advance(piece.numel() * piece.element_size())
            del piece
        reader.forget()


def _unused_rules(rules: list[Rule], manifest: Manifest) -> list[str]:
    """The `--shard-dim` / `--plan` rules that match no tensor of the source."""
    return [
        str(r) for r in rules if not any(rule_for(e.name, [r]) for e in manifest.tensors if e.shape)
    ]


def _planned_files(fmt: type[Format], plan: list[Entry], world_size: int) -> list[FileInfo]:
    """`--dry-run` of a world-size reshard: each rank's file and the data bytes it would hold."""
    first = fmt.rank_file(0)
    data: dict[str, int] = {fmt.rank_file(r): 0 for r in range(world_size)}
    held: dict[str, int] = dict.fromkeys(data, 0)
    for entry in plan:
        if entry.kind == "object" or not entry.chunks:
            held[entry.file or first] = held.get(entry.file or first, 0) + 1
            data[entry.file or first] += entry.nbytes
            continue
        itemsize = entry.nbytes // entry.numel if entry.numel else 0
        for chunk in entry.chunks:
            numel = 1
            for size in chunk.sizes:
                numel *= size
            data[chunk.file] = data.get(chunk.file, 0) + numel * itemsize
            held[chunk.file] = held.get(chunk.file, 0) + 1
    files = [FileInfo(path=name, size=size, entries=held[name]) for name, size in data.items()]
    files.append(FileInfo(path=fmt.commit_marker or "", entries=len(plan)))
    return files


def _copy_object(checkpoint: Checkpoint, writer: Writer, name: str) -> None:
    """Copy a non-tensor entry as its stored bytes (never unpickled) where both sides can."""
    if checkpoint.object_bytes and writer.object_bytes:
        writer.write_object_bytes(name, checkpoint.read_object_bytes(name))
    else:
        writer.write_object(name, checkpoint.read_object(name))


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

    def read(self, entry: Entry, chunk: Chunk) -> torch.Tensor:
        """The source data of one output chunk of `entry`."""
        import torch

        from ..tensors import torch_dtype

        assert entry.dtype is not None
        if any(s == 0 for s in chunk.sizes):
            return torch.empty(chunk.sizes, dtype=torch_dtype(entry.dtype))
        source = self.checkpoint.manifest.by_name[entry.name]
        stored = source.chunks or []
        if not self.checkpoint.chunk_reads or not stored or any(c.raw for c in stored):
            return self.checkpoint.read_slice(entry.name, list(chunk.offsets), list(chunk.sizes))
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        try:
            pieces = overlaps(box, [Box(tuple(c.offsets), tuple(c.sizes)) for c in stored])
        except ValueError as exc:
            raise FormatError(
                f"tensor {entry.name!r}: {exc}",
                path=self.checkpoint.manifest.location,
                fix="The checkpoint is missing data; `ckpt verify` lists every problem.",
            ) from None
        out = torch.empty(chunk.sizes, dtype=torch_dtype(entry.dtype))
        for piece in pieces:
            data = self._stored(entry.name, piece.chunk)
            src = tuple(
                slice(o, o + n) for o, n in zip(piece.src.offsets, piece.src.sizes, strict=True)
            )
            dst = tuple(
                slice(o, o + n) for o, n in zip(piece.dst.offsets, piece.dst.sizes, strict=True)
            )
            out[dst] = data[src]
        return out
