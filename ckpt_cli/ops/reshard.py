"""`reshard`: the same checkpoint cut for another shard size or another world size.

Two modes:

- **shard size** (`max_shard_size`; safetensors, and sharded torch.save where its adapter
  writes): tensors regrouped in order into shards of at most that size, Hugging Face names
  and index, `__metadata__` kept; raw bytes are copied without deserialising (`convert`'s
  pipeline, `ops.transfer`).
- **world size** (`world_size`; DCP): every tensor re-cut as N ranks would have saved it
  (`Shard(0)` by default, `placement` rules for other dims or replication), chunk r in
  `__r_0.distcp`; each output chunk is assembled from whichever source chunks overlap it
  (`_BoxReader`: stored chunks loaded once per run of output chunks, raw ones through
  `read_slice` for just the rows needed), so peak memory follows the largest chunk. Replicated tensors are written once,
  spread over the rank files the way `dcp.save`'s de-duplication spreads them (each to the
  file holding the fewest bytes so far); objects are copied as stored bytes, once, into the
  file the DCP writer keeps them in (rank 0's).

Per-rank training state (`placement.rank_of`: RNG streams and data-loader positions keyed by
rank) cannot be re-cut: it is carried unchanged when N equals the source world size; otherwise
the caller must choose `drop` or `keep` (copied as-is; a per-rank tensor goes whole into its
rank's file when that rank still exists, else rank 0's).

Output is staged and published atomically after a structural check (the format's `check`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, Field

from ..distributed import CombinedProgress, RankShare, active, split_output
from ..errors import FormatError, UsageError
from ..formats import get_format, open_checkpoint, resolve_source
from ..formats.base import Checkpoint, WriteOptions, Writer
from ..formats.dcp import rank_chunk, rank_file
from ..formats.safetensors import INDEX_SUFFIX
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
from ..uri import parse_location
from .convert import _guard_paths
from .transfer import check_staged

if TYPE_CHECKING:
    import torch

    from ..output import Destination

RankStateAction = Literal["carry", "drop", "keep"]
#: formats whose shard size `--max-shard-size` can change
SHARD_SIZE_FORMATS = ("safetensors", "torch")
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


class RankStateEntry(BaseModel):
    """A per-rank training-state entry (RNG stream, data-loader position...)."""

    name: str
    rank: int
    kind: str
    nbytes: int


class ReshardReport(BaseModel):
    """The result of `ckpt reshard`.

    Attributes:
        mode: `shard-size` or `world-size`.
        source / destination: what was read and where the output was published.
        format: format of both source and output.
        files: the files written, with sizes.
        tensors / objects: entries written.
        tensor_bytes: tensor bytes written.
        raw_copy: tensors copied as raw bytes, without deserialising (shard-size mode).
        max_shard_size: the shard limit in bytes (shard-size mode).
        source_world_size / world_size: ranks before and after (world-size mode).
        serialization: DCP serialization of the output.
        sharded: tensors split across ranks, by dim (`{"0": 12, "1": 4}`).
        replicated: tensors written once, whole (0-dim, `replicate` rules).
        rules: the placement rules applied, in order.
        unused_rules: rules that matched no tensor (a typo in a glob, most likely).
        rank_state: per-rank training-state entries found in the source.
        rank_state_action: `carry` (same world size), `keep`, `drop`, or None when there is none.
        verified: the output passed the format's structural check before publishing.
        dry_run: nothing was written; `files` are what would be (sizes are data bytes for
            DCP outputs, exact file sizes for safetensors).
        carried: training-state files of a training folder (optimizer, scheduler, RNG,
            trainer state...) copied unchanged beside the resharded weights (shard-size mode).
        extras: non-weight files of the source folder copied unchanged (`config.json`,
            tokenizer files...); empty with `extras=False`.
        warnings: things the user should know about the output (a DCP torch cannot load).
    """

    mode: Literal["shard-size", "world-size"]
    source: str
    destination: str
    format: str
    files: list[FileInfo] = Field(default_factory=list)
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    raw_copy: int = 0
    max_shard_size: int | None = None
    source_world_size: int | None = None
    world_size: int | None = None
    serialization: str | None = None
    sharded: dict[str, int] = Field(default_factory=dict)
    replicated: int = 0
    rules: list[str] = Field(default_factory=list)
    unused_rules: list[str] = Field(default_factory=list)
    rank_state: list[RankStateEntry] = Field(default_factory=list)
    rank_state_action: RankStateAction | None = None
    verified: bool = False
    ranks: list[RankShare] = Field(default_factory=list)
    dry_run: bool = False
    carried: list[str] = Field(default_factory=list)
    extras: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class _ChunkWriter(Protocol):
    def write_chunk(self, name: str, chunk_index: int, piece: torch.Tensor) -> None: ...


def _local_dest(dest: str) -> Destination:
    """DEST as a local path or an object-store location (`s3://…`: staged, then uploaded)."""
    from ..output import resolve_destination

    loc = parse_location(dest)
    if loc.kind == "local" and loc.path is not None:
        return loc.path
    return resolve_destination(dest)


def reshard_shard_size(
    src: str,
    dest: str,
    max_shard_size: int,
    *,
    format: str | None = None,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
) -> ReshardReport:
    """Regroup `src`'s entries, in order, into shards of at most `max_shard_size` bytes.

    Runs `convert`'s pipeline (`ops.transfer`) with the source's own format as the target:
    raw byte copies for safetensors; torch.save shards hold one shard in memory at a time.
    In a training folder (Trainer `checkpoint-N/`, accelerate `save_state`) the weights are
    resharded and every other component (optimizer, scheduler, RNG, trainer state) is copied
    unchanged, so the output resumes the run as the source did.
    """
    from .transfer import HOLDS_OBJECTS, plan_transfer, write_checkpoint

    out = _local_dest(dest)
    _guard_paths(src, out)  # as convert: a DEST in (or over) the source is refused
    check_destination(out.absolute(), force)
    with open_checkpoint(src, format) as checkpoint:
        carried, extra = _carried_files(src, checkpoint, format)
        if not extras:
            extra = []
        manifest = checkpoint.manifest
        if manifest.format not in SHARD_SIZE_FORMATS:
            raise UsageError(
                f"--max-shard-size regroups safetensors or torch.save shards; "
                f"this is a {manifest.format} checkpoint",
                path=src,
                fix="For DCP, change the world size with --world-size N.",
            )
        plan = plan_transfer(manifest, keep_objects=manifest.format in HOLDS_OBJECTS)
        if dry_run:
            from .convert import _dry_run_report

            planned = _dry_run_report(
                manifest,
                plan,
                out,
                manifest.format,
                dict(manifest.metadata),
                max_shard_size,
                _basename(checkpoint),
                False,
                None,
                "torch_save",
                1,
                [],
            )
            return ReshardReport(
                mode="shard-size",
                source=manifest.location,
                destination=str(out),
                format=manifest.format,
                files=planned.files,
                tensors=planned.tensors,
                objects=planned.objects,
                tensor_bytes=planned.tensor_bytes,
                max_shard_size=max_shard_size,
                verified=False,
                dry_run=True,
            )
        options = WriteOptions(
            max_shard_size=max_shard_size,
            metadata=dict(manifest.metadata),
            basename=_basename(checkpoint),
        )
        from ..quant import analyse_checkpoint
        from .convert import keep_quantized

        # a quantized weight and its scales are never split across shards
        analysis = analyse_checkpoint(manifest, checkpoint.storage)
        if analysis.quantized:
            keep_quantized(plan, analysis)
            options.extra["together"] = analysis.together()
        if format is None:
            # keep the source library's file names and companions (PEFT, diffusers variants)
            from ..layouts.model_folders import apply_naming

            apply_naming(src, manifest.format, options)
        shares: list[RankShare] = []
        files, written = write_checkpoint(
            checkpoint,
            plan,
            out,
            manifest.format,
            options,
            force=force,
            progress=progress,
            shares=shares,
            extras=[*carried, *extra],
        )
        return ReshardReport(
            carried=carried,
            extras=extra,
            mode="shard-size",
            source=manifest.location,
            destination=str(out),
            format=manifest.format,
            files=files,
            tensors=sum(1 for w in written if w.kind == "tensor"),
            objects=sum(1 for w in written if w.kind != "tensor"),
            tensor_bytes=sum(w.nbytes for w in written if w.kind == "tensor"),
            raw_copy=sum(1 for w in written if w.how == "raw"),
            max_shard_size=max_shard_size,
            verified=True,
            ranks=shares,
        )


def _carried_files(
    src: str, weights: Checkpoint, format: str | None
) -> tuple[list[str], list[str]]:
    """(training-state files, extra files) of `src` to copy beside its resharded weights."""
    from ..formats import resolve_source
    from ..layouts import recognise_layout
    from .transfer import extra_files

    if weights.source.target is not None:
        return [], []
    opened = recognise_layout(resolve_source(src)) if format is None else None
    if opened is None:
        return [], extra_files(weights)
    with opened.checkpoint as composite:
        extra = extra_files(composite)
    index = weights.manifest.details.get("index")
    own = {f.path for f in weights.manifest.files} | ({index} if isinstance(index, str) else set())
    carried = [
        rel
        for rel in sorted(weights.source.files)
        if rel not in own
        and rel not in extra
        and not any(part.startswith(".") for part in rel.split("/"))
    ]
    return carried, extra


def _basename(checkpoint: Checkpoint) -> str:
    """The stem of the source's shard names (`model`, `diffusion_pytorch_model`...)."""
    details = checkpoint.manifest.details
    index = details.get("index")
    if isinstance(index, str):
        name = index.rsplit("/", 1)[-1]
        for suffix in (INDEX_SUFFIX, ".bin.index.json", ".index.json"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
    files = [f.path for f in checkpoint.manifest.files]
    if len(files) == 1:
        stem = files[0].rsplit("/", 1)[-1].split(".", 1)[0]
        # a single shard named like `model-00001-of-00001` keeps the stem before the counter
        return re.sub(r"-\d{5}-of-\d{5}$", "", stem) or "model"
    return "model"


def source_world_size(checkpoint: Checkpoint) -> int:
    """How many ranks saved a DCP checkpoint: recorded by the adapter, else from file names."""
    recorded = checkpoint.manifest.details.get("world_size")
    if isinstance(recorded, int) and recorded > 0:
        return recorded
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
    from .transfer import copy_files, extra_files

    if compression not in (None, "none", "zstd"):
        raise UsageError(f"--dcp-compression {compression!r} is not zstd or none")
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    rules = list(rules or [])
    out = _local_dest(dest)
    _guard_paths(src, out)  # as convert: a DEST in (or over) the source is refused
    check_destination(out.absolute(), force)
    with open_checkpoint(src, format) as checkpoint:
        manifest = checkpoint.manifest
        if manifest.format != "dcp":
            raise UsageError(
                f"--world-size re-cuts DCP checkpoints; this is a {manifest.format} checkpoint",
                path=src,
                fix="Use `ckpt convert SRC DEST --to dcp --world-size N` to make a DCP one, "
                "or --max-shard-size to regroup shards.",
            )
        before = source_world_size(checkpoint)
        rank_entries = find_rank_state(manifest.entries)
        action: RankStateAction | None = None
        if rank_entries:
            if rank_state_action is not None:
                action = rank_state_action
            elif world_size == before:
                action = "carry"
            else:
                names = ", ".join(e.name for e in rank_entries[:8])
                more = f" and {len(rank_entries) - 8} more" if len(rank_entries) > 8 else ""
                raise UsageError(
                    f"holds per-rank training state that cannot be resharded from "
                    f"{before} to {world_size} ranks: {names}{more}",
                    path=src,
                    fix="Pass --drop-rank-state to leave it out (each rank starts fresh RNG / "
                    "data-loader state) or --keep-rank-state to copy it as-is.",
                )
        drop = {e.name for e in rank_entries} if action == "drop" else set()
        plan, sharded, replicated = plan_world_size(
            manifest.entries,
            world_size,
            rules,
            {e.name: e.rank for e in rank_entries},
            drop,
        )
        # eco: a Megatron-Core torch_dist source stays one (its common.pt + metadata.json)
        megatron_files = keep_megatron_layout(checkpoint, plan, "dcp")
        chosen = serialization or str(manifest.details.get("serialization") or "torch_save")
        if chosen not in ("torch_save", "safetensors"):
            # HuggingFaceStorageWriter's per-rank files ("hf_safetensors") and mixed folders
            # become a regular DCP that dcp.load reads
            chosen = "torch_save"
        if compression is None:
            compression = (
                "zstd" if manifest.details.get("compression") and chosen == "torch_save" else None
            )
        if dry_run:
            return _planned_world_size(
                manifest,
                out,
                plan,
                world_size,
                before,
                chosen,
                sharded,
                replicated,
                rules,
                rank_entries,
                action,
            )
        fmt = get_format("dcp")
        options = WriteOptions(
            world_size=world_size,
            dcp_serialization=chosen,
            # keeps the nested state-dict paths, so dcp.load of nested dicts still maps keys
            extra={
                "dcp_planner_data": getattr(checkpoint, "planner_data", None),
                "dcp_compression": None if compression == "none" else compression,
            },
        )
        total = sum(e.nbytes for e in plan if e.kind == "tensor")
        workers = active()
        writers: list[Writer] = []

        def work(staging: Path) -> dict[str, Any]:
            started = time.perf_counter()
            writer = fmt.writer(staging, plan, options)
            writers.append(writer)
            write_chunk = getattr(writer, "write_chunk", None)
            if write_chunk is None:
                raise FormatError("the DCP writer of this version cannot write planned chunks")
            chunk_writer: _ChunkWriter = writer  # type: ignore[assignment]
            mine: list[str] = []
            if workers.distributed:
                sizes = writer.output_files()
                names = list(sizes)
                mine = [names[i] for i in workers.mine([sizes[n] for n in names])]
                writer.restrict(mine)
            owns = getattr(writer, "owns", lambda _file: True)
            counted = CountingProgress(CombinedProgress(progress, workers))
            counted.start(total, "resharding")
            try:
                reader = _BoxReader(checkpoint)
                for entry in plan:
                    if not writer.wants(entry.name):
                        continue
                    if entry.kind == "object":
                        _copy_object(checkpoint, writer, entry.name)
                        continue
                    assert entry.chunks is not None
                    for index, chunk in enumerate(entry.chunks):
                        if not owns(chunk.file):
                            continue
                        piece = reader.read(entry, chunk)
                        chunk_writer.write_chunk(entry.name, index, piece)
                        counted.advance(piece.numel() * piece.element_size())
                        del piece
                    reader.forget()
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

        carried_extras = (extra_files(checkpoint) if extras else []) + megatron_files  # eco

        def commit(staging: Path, parts: list[dict[str, Any]]) -> dict[str, Any]:
            files = writers[0].commit([p["part"] for p in parts])
            copy_files(checkpoint, carried_extras, staging)
            check_staged("dcp", staging, single_file=False)
            return {
                "files": [f.model_dump(mode="json") for f in files],
                "shares": [p["share"] for p in parts] if workers.distributed else [],
            }

        result = split_output(workers, out, force=force, work=work, commit=commit)
        files = [FileInfo.model_validate(f) for f in result["files"]]
        tensors = sum(1 for e in plan if e.kind != "object")
        objects = len(plan) - tensors
        return ReshardReport(
            mode="world-size",
            source=manifest.location,
            destination=str(out),
            format="dcp",
            files=files,
            tensors=tensors,
            objects=objects,
            tensor_bytes=total,
            source_world_size=before,
            world_size=world_size,
            serialization=chosen,
            sharded=sharded,
            replicated=replicated,
            rules=[str(r) for r in rules],
            unused_rules=_unused_rules(rules, manifest),
            rank_state=rank_entries,
            rank_state_action=action,
            extras=carried_extras,
            warnings=_dcp_warnings(chosen),
            verified=True,
            ranks=[RankShare.model_validate(r) for r in result["shares"]],
        )


def _unused_rules(rules: list[Rule], manifest: Manifest) -> list[str]:
    """The `--shard-dim` / `--plan` rules that match no tensor of the source."""
    return [
        str(r) for r in rules if not any(rule_for(e.name, [r]) for e in manifest.tensors if e.shape)
    ]


def _planned_world_size(
    manifest: Any,
    out: Any,
    plan: list[Entry],
    world_size: int,
    before: int,
    serialization: str,
    sharded: dict[str, int],
    replicated: int,
    rules: list[Rule],
    rank_entries: list[RankStateEntry],
    action: RankStateAction | None,
) -> ReshardReport:
    """`--dry-run` of a world-size reshard: each rank's file and the data bytes it would hold."""
    data: dict[str, int] = {rank_file(r): 0 for r in range(world_size)}
    held: dict[str, int] = dict.fromkeys(data, 0)
    for entry in plan:
        if entry.kind == "object" or not entry.chunks:
            held[entry.file or rank_file(0)] = held.get(entry.file or rank_file(0), 0) + 1
            data[entry.file or rank_file(0)] += entry.nbytes
            continue
        itemsize = entry.nbytes // entry.numel if entry.numel else 0
        for chunk in entry.chunks:
            numel = 1
            for size in chunk.sizes:
                numel *= size
            data[chunk.file] = data.get(chunk.file, 0) + numel * itemsize
            held[chunk.file] = held.get(chunk.file, 0) + 1
    files = [FileInfo(path=name, size=size, entries=held[name]) for name, size in data.items()]
    files.append(FileInfo(path=".metadata", entries=len(plan)))
    tensors = sum(1 for e in plan if e.kind != "object")
    return ReshardReport(
        mode="world-size",
        source=manifest.location,
        destination=str(out),
        format="dcp",
        files=files,
        tensors=tensors,
        objects=len(plan) - tensors,
        tensor_bytes=sum(e.nbytes for e in plan if e.kind == "tensor"),
        source_world_size=before,
        world_size=world_size,
        serialization=serialization,
        sharded=sharded,
        replicated=replicated,
        rules=[str(r) for r in rules],
        unused_rules=_unused_rules(rules, manifest),
        rank_state=rank_entries,
        rank_state_action=action,
        verified=False,
        dry_run=True,
    )


def _dcp_warnings(serialization: str) -> list[str]:
    from .convert import dcp_warnings

    return dcp_warnings(serialization)


def _copy_object(checkpoint: Checkpoint, writer: Writer, name: str) -> None:
    """Copy a non-tensor entry as its stored bytes (never unpickled) where both sides can."""
    read_bytes = getattr(checkpoint, "read_object_bytes", None)
    write_bytes = getattr(writer, "write_object_bytes", None)
    if read_bytes is not None and write_bytes is not None:
        write_bytes(name, read_bytes(name))
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
            self._chunk = self.checkpoint.read_chunk(name, index)  # type: ignore[attr-defined]
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
        if not hasattr(self.checkpoint, "read_chunk") or not stored or any(c.raw for c in stored):
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


def run_reshard(
    src: str,
    dest: str,
    *,
    world_size: int | None = None,
    max_shard_size: str | int | None = None,
    shard_dim: list[str] | None = None,
    plan: Path | None = None,
    drop_rank_state: bool = False,
    keep_rank_state: bool = False,
    dcp_serialization: str | None = None,
    dcp_compression: str | None = None,
    format: str | None = None,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
) -> ReshardReport:
    """Check the option combination, parse sizes and rules, and run the chosen mode.

    With `dry_run`, only metadata is read and nothing is written: the report says what would be.
    `extras=False` leaves the source folder's config/tokenizer files out of the output.
    """
    from ..placement import load_plan, parse_rule
    from ..sizes import parse_size

    if (world_size is None) == (max_shard_size is None):
        raise UsageError(
            "say what to change: --world-size N (DCP) or --max-shard-size SIZE (safetensors)",
            fix="Pass exactly one of them.",
        )
    if drop_rank_state and keep_rank_state:
        raise UsageError("--drop-rank-state and --keep-rank-state exclude each other")
    if dcp_serialization not in (None, "torch_save", "safetensors"):
        raise UsageError(
            f"--dcp-serialization {dcp_serialization!r} is not torch_save or safetensors"
        )
    if max_shard_size is not None:
        given = [
            flag
            for flag, on in (
                ("--shard-dim", bool(shard_dim)),
                ("--plan", plan is not None),
                ("--drop-rank-state", drop_rank_state),
                ("--keep-rank-state", keep_rank_state),
                ("--dcp-serialization", dcp_serialization is not None),
                ("--dcp-compression", dcp_compression is not None),
            )
            if on
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} only apply with --world-size",
                fix="Drop them, or reshard a DCP checkpoint with --world-size N.",
            )
        limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
        if format is None:
            from .components import components_of

            found = components_of(src)
            if found is not None:
                if dry_run:
                    raise UsageError(
                        "--dry-run does not plan a multi-folder model (diffusers pipeline, "
                        "sentence-transformers) yet",
                        path=src,
                        fix="Run --dry-run on one component folder (e.g. SRC/unet).",
                    )
                # a diffusers pipeline / sentence-transformers folder: component by component
                return _reshard_components(src, dest, limit, *found, force=force, progress=progress)
        return reshard_shard_size(
            src,
            dest,
            limit,
            format=format,
            force=force,
            progress=progress,
            dry_run=dry_run,
            extras=extras,
        )
    assert world_size is not None
    rules = [parse_rule(text) for text in shard_dim or []]
    if plan is not None:
        rules += load_plan(plan)
    action: Literal["drop", "keep"] | None = (
        "drop" if drop_rank_state else "keep" if keep_rank_state else None
    )
    return reshard_world_size(
        src,
        dest,
        world_size,
        rules=rules,
        rank_state_action=action,
        serialization=dcp_serialization,
        compression=dcp_compression,
        format=format,
        force=force,
        progress=progress,
        extras=extras,
        dry_run=dry_run,
    )


def _reshard_components(
    src: str,
    dest: str,
    limit: int,
    layout: str,
    components: list[Any],
    *,
    force: bool,
    progress: Progress,
) -> ReshardReport:
    """Reshard every weight-holding component of a multi-folder model with its own naming."""
    from .components import write_components

    def one(inner_src: str, inner_dest: str, to: str) -> ReshardReport:
        return reshard_shard_size(inner_src, inner_dest, limit, progress=progress)

    source = resolve_source(src)
    formats = {
        "torch" if (c.weights or "").endswith((".bin", ".bin.index.json")) else "safetensors"
        for c in components
        if c.weights
    }
    to = formats.pop() if len(formats) == 1 else "safetensors"
    files, reports = write_components(src, dest, layout, components, to, one, force=force)
    return ReshardReport(
        mode="shard-size",
        source=source.location.raw,
        destination=dest,
        format=layout,
        files=files,
        tensors=sum(r.tensors for r in reports),
        objects=sum(r.objects for r in reports),
        tensor_bytes=sum(r.tensor_bytes for r in reports),
        raw_copy=sum(r.raw_copy for r in reports),
        max_shard_size=limit,
        verified=True,
    )
