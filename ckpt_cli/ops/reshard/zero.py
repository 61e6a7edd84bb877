"""`reshard --world-size` of a DeepSpeed ZeRO save: its partitions re-cut as N ranks save them.

DeepSpeed's `engine.load_checkpoint` reads a ZeRO save only at the data-parallel world size it
was written at (`dp_world_size` in the model states; anything else raises "Automatic adjustment
of ZeRO's optimizer state partitioning with a new world size is not currently supported").
This module writes the tag folder (`global_stepN/`) exactly as an N-rank engine would have saved
it, so DeepSpeed resumes it natively at N ranks with the user's own config (no universal
checkpoint, no `load_universal` switch):

- ZeRO-1/2 (`*zero_pp_rank_R_mp_rank_00_optim_states.pt`): each parameter group is one flat
  vector (parameters in `param_shapes` order, with DeepSpeed's per-parameter alignment padding),
  aligned to `2 x N` elements and cut into N equal partitions. Rank r's file holds its partition
  of the fp32 master weights without the group padding (`single_partition_of_fp32_groups`), the
  optimizer state over the padded partition (`exp_avg`, `exp_avg_sq`: zeros in the padding, as
  DeepSpeed's own), the step, `group_paddings`, `partition_count` and the
  `param_slice_mappings` an N-rank engine records.
- ZeRO-3 (`fp32_flat_groups`): every parameter is cut on its own into N slots of
  `ceil(numel / N)` elements (zero padded at the end), rank r's slots concatenated per
  sub-group; the optimizer state the same way. Each rank also gets its own
  `zero_pp_rank_R_mp_rank_00_model_states.pt`.
- The model-states files are copied with only `dp_world_size` changed: that integer is
  rewritten in the pickle's opcodes (nothing is unpickled, every other record is copied byte
  for byte).

Per-rank files beside the tag folder (a Hugging Face Trainer's `rng_state_{r}.pth`) follow the
one `--rank-state` policy; everything else in the folder (`latest`, `zero_to_fp32.py`, other
files of the tag folder) is copied verbatim; other tags of a run folder are listed in
`skipped`. I/O: each source file's zip directory and data.pkl give where every partition's
bytes lie (`index_torch_zip`); each output partition is streamed into its zip record from
those offsets in 16 MiB blocks (ranged reads, nothing memory-mapped), so memory stays at one
block whatever the model size. The staged output is opened again with ckpt's ZeRO reader
(complete, resumable, the source's weights by name, dtype and shape) before one rename
publishes it.

Refused (exit 2), with why: tensor- or pipeline-parallel saves (`mp_rank_01`, `layer_*` files:
DeepSpeed's universal checkpoint is the way there), MoE expert files, ZeRO-2 with
`round_robin_gradients` (the parameter order depends on the world size), `elastic_checkpoint`
saves, ZeRO-3 saves whose sub-groups (`sub_group_size`) would regroup at N ranks, and ZeRO-3
frozen parameters (cut per rank into the model states).
"""

from __future__ import annotations

import io
import math
import os
import pickletools
import re
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...dtypes import itemsize
from ...errors import FormatError, UsageError
from ...formats.base import Source
from ...formats.names import RESHARD_RECORD, is_commit_marker
from ...formats.torch.inert import InertObject
from ...formats.torch.load import load_torch_file
from ...formats.torch.zip_index import TensorLayout, TorchZipIndex, index_torch_zip
from ...formats.torch.zip_write import Reduced, TorchZipWriter, write_record
from ...models import FileInfo
from ...progress import NULL_PROGRESS, CountingProgress, Progress
from ...sources.layouts.base import Layout, OpenedSource
from ...storage import safe_relpath
from ...storage.output import check_destination, staged_output
from ..convert.plan import guard_paths, local_dest
from ..shared.transfer import SkippedEntry
from .rank_files import (
    copy_verbatim,
    missing_rank_files,
    rank_file_plan,
    reshard_record,
    with_record,
)
from .report import RankStateChoice, ReshardedPart, ReshardReport
from .request import ReshardRequest
from .world import check_world_options, rank_state_choice, resume_verdict

if TYPE_CHECKING:
    pass

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
#: DeepSpeed's files for pipeline stages and MoE experts: cut another way, not re-cut here
_OTHER_PARALLEL = re.compile(r"(layer_\d+-model_\d+-model_states|.*expert.*|expp_rank_.*)\.pt")
#: elements per block read from a source partition (16 MiB of fp32): the memory bound
_BLOCK = 4 << 20
#: DeepSpeed's `nccl_start_alignment_factor`: partitions start 4-byte aligned in 16-bit
_ALIGNMENT_FACTOR = 2
#: DeepSpeed's default `zero_optimization.sub_group_size`
_SUB_GROUP_SIZE = 1_000_000_000
#: why a refused save cannot be re-cut here, and DeepSpeed's own way
_UNIVERSAL = (
    "DeepSpeed's universal checkpoint resizes it: `ds_to_universal.py --input_folder TAG "
    '--output_folder TAG_universal`, then resume with `"checkpoint": {"load_universal": true}`.'
)
#: the fix of a save whose files disagree with the layout DeepSpeed writes
_DAMAGED = (
    "`ckpt verify` on the tag folder checks the save; restore what it finds damaged from the "
    f"run's storage. If the save is intact, {_UNIVERSAL}"
)


@dataclass
class _Flat:
    """A flat source partition: `size` elements of `dtype` at byte `offset` of file `rel`."""

    rel: str
    offset: int
    size: int
    dtype: str


@dataclass
class _Piece:
    """`length` elements of the flat partition `tensor` from `start`; zeros when it is None."""

    tensor: _Flat | None
    start: int
    length: int


@dataclass
class _Output:
    """One output partition tensor: its dtype and the pieces it is made of, in order."""

    dtype: str
    pieces: list[_Piece]

    @property
    def numel(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass
class ZeroSave:
    """A ZeRO tag folder opened for re-cutting.

    Attributes:
        base: the tag folder's prefix in the source (`global_step2/`, '' for the folder itself).
        stage: 2 (ZeRO-1 and 2) or 3.
        world: the data-parallel ranks that saved it.
        optim_names: rank -> optimizer file name (inside the tag folder).
        model_names: rank -> model-states file name (one, rank 0's, for ZeRO-1/2).
        optim: rank -> the loaded optimizer file (its structure and small values; the
            partitions are read through `index`).
        index: rank -> where each tensor of its optimizer file lies in the file.
        model: the loaded model states of rank 0.
    """

    base: str
    stage: int
    world: int
    optim_names: dict[int, str]
    model_names: dict[int, str]
    optim: dict[int, dict[str, Any]] = field(default_factory=dict)
    index: dict[int, TorchZipIndex] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)

    def optim_name(self, rank: int) -> str:
        """The optimizer file rank `rank` saves (bf16 runs prefix `bf16_`)."""
        prefix = "bf16_" if self.optim_names[0].startswith("bf16_") else ""
        return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def reshard_zero(
    source: Source,
    opened: OpenedSource,
    layout: Layout,
    dest: str,
    request: ReshardRequest,
    progress: Progress = NULL_PROGRESS,
) -> ReshardReport:
    """Write the ZeRO save `source` (opened as DeepSpeed's layout) as `world_size` ranks save it
    (see the module docstring); DeepSpeed's `load_checkpoint` resumes the output at that size.

    Per-rank files beside the tag folder (a Hugging Face Trainer's `rng_state_{r}.pth`) follow
    the request's `rank_state` as in `reshard_folder` (asked for when the world size changes).
    `extras=False` leaves out what `convert` calls extras (`zero_to_fp32.py`...).
    """
    from ...dist.command import active

    assert request.world_size is not None
    world_size = request.world_size
    rank_state_action = cast(RankStateChoice | None, request.rank_state)
    force, dry_run, extras = request.force, request.dry_run, request.extras
    src = source.location.raw
    check_world_options(world_size, None)
    if active().distributed:
        raise UsageError(
            "a DeepSpeed ZeRO re-cut runs as one process (it streams block by block; torchrun "
            "ranks would write the same files)",
            path=src,
            fix="Run `ckpt reshard` without torchrun.",
        )
    out = local_dest(dest)
    guard_paths(src, out)
    check_destination(out.absolute(), force)
    save = open_zero_save(source, opened)
    rank_files = {
        rel: rank
        for rel in sorted(source.files)
        if "/" not in rel and (rank := layout.rank_file_rank(rel)) is not None
    }
    action = rank_state_choice(src, list(rank_files), rank_state_action, save.world, world_size)
    files_out = rank_file_plan(layout, rank_files, action, world_size)
    carried, skipped = _carried(source, save, rank_files)
    if not extras:
        from ..shared.transfer import extra_files

        left_out = set(extra_files(opened.checkpoint))
        skipped += [
            SkippedEntry(name=r, kind="file", reason="left out (--no-extras)")
            for r in carried
            if r in left_out
        ]
        carried = [r for r in carried if r not in left_out]
    plans = _plan(save, world_size)
    tensors = sum(len(files) for files in plans.values())
    tensor_bytes = sum(o.nbytes for files in plans.values() for o in files.values())
    report = ReshardReport(
        mode="world-size",
        source=src,
        destination=str(out),
        format=opened.checkpoint.manifest.format,
        layout=layout.name,
        tensors=tensors,
        tensor_bytes=tensor_bytes,
        source_world_size=save.world,
        world_size=world_size,
        partitioning="zero",
        parts=[
            ReshardedPart(
                path=save.base or "./",
                component="optimizer",
                source_world_size=save.world,
                tensors=tensors,
                tensor_bytes=tensor_bytes,
            )
        ],
        carried=carried,
        skipped=skipped,
        rank_files=files_out,
        rank_state_action=action if rank_files else None,
    )
    notes = layout.batch_notes(opened, save.world, world_size)
    report.warnings.extend(notes)
    notes = notes + missing_rank_files(layout, files_out, rank_files, world_size, save.world)
    report.resume = resume_verdict(opened.training, report, notes)
    written = _output_names(save, world_size)
    # in the tag folder: the world size the run saved it at, which the re-cut model states no
    # longer say (verify: resumable, not exactly)
    at = f"{save.base}{RESHARD_RECORD}"
    record = reshard_record(source, save.world, world_size, action if rank_files else None, at)
    if dry_run:
        report.files = [FileInfo(path=f"{save.base}{n}") for n in written]
        report.files += [FileInfo(path=r, size=source.files.get(r)) for r in carried]
        report.files += [
            FileInfo(path=n, size=source.files.get(i.path)) for i in files_out for n in i.written
        ]
        report.files = with_record(report.files, record, at)
        report.dry_run = True
        return report
    counted = CountingProgress(progress)
    counted.start(tensor_bytes, "resharding")
    try:
        with staged_output(out, commit_marker=is_commit_marker, force=force) as staging:
            files = _write(source, save, plans, world_size, staging, counted)
            for rel in carried:
                copy_verbatim(source, rel, staging / safe_relpath(rel, source=src))
            files += [FileInfo(path=rel, size=source.files.get(rel)) for rel in carried]
            for item in files_out:
                for name in item.written:
                    copy_verbatim(source, item.path, staging / safe_relpath(name, source=src))
                    files.append(FileInfo(path=name, size=source.files.get(item.path)))
            if record is not None:
                # written after what was carried: a record the source had says an older cut
                (staging / safe_relpath(at, source=src)).write_bytes(record)
            check_recut(opened, staging)
    finally:
        counted.finish()
    report.files = with_record(files, record, at)
    report.verified = True
    return report


def open_zero_save(source: Source, opened: OpenedSource) -> ZeroSave:
    """The ZeRO tag folder of `opened` with its files loaded (tensors memory-mapped), or a
    `UsageError` saying why it cannot be re-cut here."""
    src = source.location.raw
    model_rel = next(
        (rel for rel, _ in opened.parts.values() if _MODEL.search(rel.rsplit("/", 1)[-1])), None
    )
    if model_rel is None:
        raise UsageError(
            "holds no DeepSpeed model states to re-cut",
            path=src,
            fix="Point at the global_stepN folder DeepSpeed saved (it holds *_model_states.pt).",
        )
    base = model_rel.rsplit("/", 1)[0] + "/" if "/" in model_rel else ""
    names = sorted(n[len(base) :] for n in source.files if n.startswith(base))
    names = [n for n in names if "/" not in n]
    optim: dict[int, str] = {}
    model3: dict[int, str] = {}
    model: dict[int, str] = {}
    for name in names:
        if m := _OPTIM.fullmatch(name):
            optim[int(m.group(2))] = name
            mp = int(m.group(3))
        elif m := _MODEL3.fullmatch(name):
            model3[int(m.group(1))] = name
            mp = int(m.group(2))
        elif m := _MODEL.fullmatch(name):
            model[0] = name
            mp = int(m.group(1))
        elif _OTHER_PARALLEL.fullmatch(name):
            raise UsageError(
                f"{base}{name}: pipeline-parallel and MoE DeepSpeed saves keep layer or expert "
                "files that --world-size does not re-cut (only the data-parallel ZeRO partitions "
                "are)",
                path=src,
                fix=_UNIVERSAL,
            )
        else:
            continue
        if mp != 0:
            raise UsageError(
                f"{base}{name}: a tensor-parallel DeepSpeed save (mp_rank_{mp:02d}): --world-size "
                "re-cuts the data-parallel ZeRO partitions, and joining tensor-parallel slices "
                "needs the model's own split rules",
                path=src,
                fix=_UNIVERSAL,
            )
    if not optim:
        raise UsageError(
            "is a DeepSpeed save without ZeRO partitions (ZeRO stage 0): its optimizer state "
            "is not cut by rank, so there is nothing to re-cut",
            path=src,
            fix="Resume it at any world size as it is.",
        )
    stage = 3 if model3 else 2
    world = max(optim) + 1
    missing = [r for r in range(world) if r not in optim] + (
        [r for r in range(world) if r not in model3] if stage == 3 else []
    )
    if missing:
        raise FormatError(
            f"the ZeRO partition of rank {missing[0]} is missing",
            path=src,
            fix="`ckpt verify` lists what is missing; restore it from the run's storage.",
        )
    save = ZeroSave(
        base=base,
        stage=stage,
        world=world,
        optim_names=optim,
        model_names=model3 if stage == 3 else model,
    )
    save.model = _load(source, f"{base}{save.model_names[0]}")
    recorded = save.model.get("dp_world_size")
    if isinstance(recorded, int) and recorded != world:
        raise FormatError(
            f"the model states record dp_world_size {recorded} but {world} ZeRO partitions are "
            "present",
            path=src,
            fix="`ckpt verify` lists what is missing or left over.",
        )
    for rank, name in optim.items():
        save.optim[rank] = _load(source, f"{base}{name}")
        save.index[rank] = _index(source, f"{base}{name}")
    _check_supported(save, src)
    return save


def _load(source: Source, rel: str) -> dict[str, Any]:
    """A torch.save file of the save, loaded safely (weights_only, inert DeepSpeed records,
    tensors memory-mapped): only its structure is read."""
    obj, _legacy = load_torch_file(source.storage, rel)
    if not isinstance(obj, dict):
        raise FormatError(
            "is not a DeepSpeed checkpoint file (no dict at the top)",
            path=source.storage.describe(rel),
            fix=_DAMAGED,
        )
    return obj


def _index(source: Source, rel: str) -> TorchZipIndex:
    """Where each tensor of a torch.save file lies (zip directory and data.pkl only)."""
    where = source.storage.describe(rel)
    size = source.storage.size(rel)
    index = index_torch_zip(lambda at, n: source.storage.read(rel, at, n), 0, size, where)
    if index is None:
        raise FormatError(
            "is not a zip torch.save file whose partitions can be read in place",
            path=where,
            fix="Re-save it with a current torch (DeepSpeed's own save writes one).",
        )
    return index


def _flat(rel: str, layout: TensorLayout, where: str) -> _Flat:
    if not layout.plain or layout.data_offset is None:
        raise FormatError(
            "holds a ZeRO partition that is not a plain C-order tensor", path=where, fix=_DAMAGED
        )
    return _Flat(rel, layout.data_offset, math.prod(layout.shape), layout.dtype)


def _config(save: ZeroSave, *keys: str) -> Any:
    value: Any = save.model.get("ds_config")
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _check_supported(save: ZeroSave, src: str) -> None:
    """Refuse what an N-rank layout cannot be computed for here (see the module docstring)."""
    if _config(save, "zero_optimization", "round_robin_gradients") is True:
        raise UsageError(
            "was saved with zero_optimization.round_robin_gradients, whose parameter order "
            "depends on the world size",
            path=src,
            fix=_UNIVERSAL,
        )
    osd = save.optim[0].get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise FormatError("holds no ZeRO optimizer_state_dict", path=src, fix=_DAMAGED)
    if save.stage == 2 and not isinstance(osd.get("base_optimizer_state"), dict):
        raise UsageError(
            "is a ZeRO elastic_checkpoint save, which --world-size does not re-cut yet",
            path=src,
            fix=_UNIVERSAL,
        )
    if save.stage == 3:
        frozen = save.model.get("frozen_param_shapes")
        if frozen:
            raise UsageError(
                "is a ZeRO-3 save with frozen parameters, whose fragments each rank keeps in its "
                "model states; --world-size does not re-cut those yet",
                path=src,
                fix=_UNIVERSAL,
            )
        if osd.get("ds_zero_partition_groups"):
            raise UsageError(
                "is an AutoEP ZeRO-3 save, whose partition groups are not re-cut here",
                path=src,
                fix=_UNIVERSAL,
            )


def _shapes(save: ZeroSave, src: str) -> list[list[tuple[str, int]]]:
    """(name, numel) of every partitioned parameter, per group (ZeRO-3: per sub-group)."""
    groups = save.model.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise FormatError("the model states record no param_shapes", path=src, fix=_DAMAGED)
    return [[(str(n), math.prod(s)) for n, s in g.items()] for g in groups]


def _plan(save: ZeroSave, world_size: int) -> dict[int, dict[str, _Output]]:
    """Per new rank: every partition tensor it saves, keyed by its place in the optimizer file
    (`fp32.G`, `state.G.exp_avg`...), as pieces of the source partitions."""
    if save.stage == 3:
        return _plan_zero3(save, world_size)
    return _plan_zero2(save, world_size)


def _flat_tensors(
    save: ZeroSave, group_key: str, state_key: str
) -> tuple[list[list[_Flat]], list[dict[str, list[_Flat]]]]:
    """Per rank, the flat fp32 partition of every group, and every group's state tensors
    (`"G.exp_avg"` -> [that partition]); 0-dim ones (the step) are copied as values."""
    fp32: list[list[_Flat]] = []
    states: list[dict[str, list[_Flat]]] = []
    for rank in range(save.world):
        rel = f"{save.base}{save.optim_names[rank]}"
        where = rel
        tensors = save.index[rank].tensors
        top = ("optimizer_state_dict", group_key)
        groups = sorted(int(p[2]) for p in tensors if len(p) == 3 and p[:2] == top)
        if groups != list(range(len(groups))) or not groups:
            raise FormatError(f"holds no {group_key} partitions 0..N", path=where, fix=_DAMAGED)
        fp32.append([_flat(rel, tensors[(*top, g)], where) for g in groups])
        per_group: dict[str, list[_Flat]] = {}
        inner = ("optimizer_state_dict", state_key, "state")
        for path, layout in tensors.items():
            if len(path) == 5 and path[:3] == inner and len(layout.shape) > 0:
                per_group.setdefault(f"{path[3]}.{path[4]}", []).append(_flat(rel, layout, where))
        states.append(per_group)
    return fp32, states


def zero2_partition(total: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, size, unpadded length) of rank `rank`'s partition of a ZeRO-1/2 flat group of
    `total` elements: aligned to 2 x world size, cut equally (DeepSpeed's own rule)."""
    alignment = _ALIGNMENT_FACTOR * world_size
    size = math.ceil(total / alignment) * alignment // world_size
    start = rank * size
    return start, size, max(0, min(size, total - start))


def _plan_zero2(save: ZeroSave, world_size: int) -> dict[int, dict[str, _Output]]:
    src = save.base or "."
    fp32, states = _flat_tensors(save, "single_partition_of_fp32_groups", "base_optimizer_state")
    groups = len(fp32[0])
    totals = [sum(fp32[r][g].size for r in range(save.world)) for g in range(groups)]
    plans: dict[int, dict[str, _Output]] = {r: {} for r in range(world_size)}
    for g, total in enumerate(totals):
        _, old_size, _ = zero2_partition(total, save.world, 0)
        for r in range(save.world):
            if fp32[r][g].size != zero2_partition(total, save.world, r)[2]:
                raise FormatError(
                    f"rank {r}'s fp32 partition of group {g} holds {fp32[r][g].size} elements, "
                    f"not what DeepSpeed's {save.world}-rank layout of {total} gives",
                    path=src,
                    fix=_DAMAGED,
                )
        for key in sorted({k for s in states for k in s if k.split(".", 1)[0] == str(g)}):
            tensors = [states[r][key][0] for r in range(save.world)]
            if any(t.size != old_size for t in tensors):
                raise FormatError(
                    f"optimizer state {key} is not cut like the partitions", path=src, fix=_DAMAGED
                )
        for r in range(world_size):
            start, size, lean = zero2_partition(total, world_size, r)
            plans[r][f"fp32.{g}"] = _Output(
                fp32[0][g].dtype, _pieces([t[g] for t in fp32], old_size, total, start, lean)
            )
            for key in (k for k in states[0] if k.split(".", 1)[0] == str(g)):
                tensors = [states[s][key][0] for s in range(save.world)]
                plans[r][f"state.{key}"] = _Output(
                    tensors[0].dtype, _pieces(tensors, old_size, total, start, size)
                )
    return plans


def _pieces(tensors: list[_Flat], part: int, total: int, start: int, length: int) -> list[_Piece]:
    """Elements [start, start + length) of a flat vector cut into `part`-element partitions
    (`tensors`, one per rank), zeros past its `total` real elements."""
    pieces: list[_Piece] = []
    at, end = start, start + length
    while at < min(end, total):
        rank = at // part
        stop = min(end, total, (rank + 1) * part)
        pieces.append(_Piece(tensors[rank], at - rank * part, stop - at))
        at = stop
    if end > at:
        pieces.append(_Piece(None, 0, end - at))
    return pieces


def zero3_sub_groups(numels: list[int], world_size: int, sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's ZeRO-3 sub-groups of one parameter group (`_create_fp16_sub_groups`): the
    parameter indices of each, grouped by their partition sizes at `world_size` ranks."""
    slots = [math.ceil(n / world_size) for n in numels]
    if sub_group_size >= sum(slots):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, slot in enumerate(slots):
        current.append(index)
        held += slot
        if held >= sub_group_size or index == len(numels) - 1:
            groups.append(current)
            current, held = [], 0
    return groups


def _plan_zero3(save: ZeroSave, world_size: int) -> dict[int, dict[str, _Output]]:
    src = save.base or "."
    shapes = _shapes(save, src)
    fp32, states = _flat_tensors(save, "fp32_flat_groups", "optimizer_state_dict")
    if len(fp32[0]) != len(shapes):
        raise FormatError(
            f"the optimizer holds {len(fp32[0])} ZeRO-3 sub-groups, param_shapes {len(shapes)}",
            path=src,
            fix=_DAMAGED,
        )
    _check_sub_groups(save, shapes, world_size, src)
    plans: dict[int, dict[str, _Output]] = {r: {} for r in range(world_size)}
    for k, params in enumerate(shapes):
        flats = {"fp32": [fp32[r][k] for r in range(save.world)]}
        for key in (key for key in states[0] if key.split(".", 1)[0] == str(k)):
            flats[f"state.{key}"] = [states[r][key][0] for r in range(save.world)]
        for name, tensors in flats.items():
            expected = sum(math.ceil(n / save.world) for _, n in params)
            if any(t.size != expected for t in tensors):
                raise FormatError(
                    f"ZeRO-3 sub-group {k} ({name}) is not {expected} elements per rank as "
                    "param_shapes says",
                    path=src,
                    fix=_DAMAGED,
                )
            for r in range(world_size):
                pieces: list[_Piece] = []
                offset = 0  # the parameter's slot in each source partition
                for _, numel in params:
                    old = math.ceil(numel / save.world)
                    new = math.ceil(numel / world_size)
                    begin = min(numel, r * new)
                    real = max(0, min(numel, (r + 1) * new) - begin)
                    at = begin
                    while at < begin + real:
                        rank = at // old
                        stop = min(begin + real, (rank + 1) * old)
                        pieces.append(_Piece(tensors[rank], offset + at - rank * old, stop - at))
                        at = stop
                    if new > real:
                        pieces.append(_Piece(None, 0, new - real))
                    offset += old
                key = f"fp32.{k}" if name == "fp32" else name
                plans[r][key] = _Output(tensors[0].dtype, pieces)
    return plans


def _check_sub_groups(
    save: ZeroSave, shapes: list[list[tuple[str, int]]], world_size: int, src: str
) -> None:
    """Refuse a ZeRO-3 save whose sub-groups would be others at `world_size` ranks (their
    count and the param_shapes of the model states would change)."""
    size = _config(save, "zero_optimization", "sub_group_size")
    size = int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) else None
    size = _SUB_GROUP_SIZE if size is None else size
    groups = save.optim[0]["optimizer_state_dict"]["optimizer_state_dict"].get("param_groups", [])
    members = [list(g.get("params", [])) for g in groups if isinstance(g, dict)]
    if sorted(i for m in members for i in m) != list(range(len(shapes))):
        raise FormatError(
            "the ZeRO-3 param_groups do not list every sub-group once", path=src, fix=_DAMAGED
        )
    for ids in members:
        numels = [n for k in ids for _, n in shapes[k]]
        lengths = [len(shapes[k]) for k in ids]
        for world in (save.world, world_size):
            found = [len(g) for g in zero3_sub_groups(numels, world, size)]
            if found != lengths:
                raise UsageError(
                    f"its ZeRO-3 sub-groups (sub_group_size {size}) hold {lengths} parameters "
                    f"at {save.world} ranks and would hold {found} at {world}: the model states' "
                    "param_shapes would change, which --world-size does not rewrite yet",
                    path=src,
                    fix=_UNIVERSAL,
                )


def _output_names(save: ZeroSave, world_size: int) -> list[str]:
    """The files the re-cut tag folder holds (inside it)."""
    names = [save.optim_name(r) for r in range(world_size)]
    if save.stage == 3:
        names += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
    else:
        names.append(save.model_names[0])
    return names


def _write(
    source: Source,
    save: ZeroSave,
    plans: dict[int, dict[str, _Output]],
    world_size: int,
    staging: Path,
    progress: Progress,
) -> list[FileInfo]:
    """Write the re-cut tag folder into `staging` (at its place in the source)."""
    folder = staging / save.base if save.base else staging
    folder.mkdir(parents=True, exist_ok=True)
    files: list[FileInfo] = []
    for rank in range(world_size):
        name = save.optim_name(rank)
        _write_optim(source, save, plans[rank], rank, world_size, folder / name, progress)
        files.append(FileInfo(path=f"{save.base}{name}", size=(folder / name).stat().st_size))
    if save.stage == 3:
        targets = {
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": save.model_names.get(
                r, save.model_names[0]
            )
            for r in range(world_size)
        }
    else:
        targets = {save.model_names[0]: save.model_names[0]}
    for name, origin in targets.items():
        rewrite_world_size(source, f"{save.base}{origin}", world_size, folder / name)
        files.append(FileInfo(path=f"{save.base}{name}", size=(folder / name).stat().st_size))
    return files


def _blocks(source: Source, output: _Output, progress: Progress) -> Iterator[bytes]:
    """The bytes of one output partition, a block at a time, read from the source files at
    their offsets (nothing mapped: the memory is one block)."""
    size = itemsize(output.dtype)
    for piece in output.pieces:
        if piece.tensor is not None and piece.tensor.dtype != output.dtype:
            raise FormatError("ZeRO partitions of one tensor differ in dtype", fix=_DAMAGED)
        for begin in range(0, piece.length, _BLOCK):
            count = min(_BLOCK, piece.length - begin)
            if piece.tensor is None:
                data = bytes(count * size)
            else:
                at = piece.tensor.offset + (piece.start + begin) * size
                data = source.storage.read(piece.tensor.rel, at, count * size)
            progress.advance(len(data))
            yield data


def _write_optim(
    source: Source,
    save: ZeroSave,
    plan: dict[str, _Output],
    rank: int,
    world_size: int,
    path: Path,
    progress: Progress,
) -> None:
    """Rank `rank`'s optimizer file: rank 0's structure with this rank's partitions."""
    with path.open("wb") as fh:
        zipw = TorchZipWriter(fh, path.stem)
        written: dict[str, Reduced] = {}
        for key, output in plan.items():
            blocks = _blocks(source, output, progress)
            written[key] = zipw.add_raw(output.dtype, (output.numel,), output.nbytes, blocks)
        top = dict(save.optim[0])
        osd = dict(top["optimizer_state_dict"])
        if save.stage == 3:
            state_key, group_key = "optimizer_state_dict", "fp32_flat_groups"
            osd["partition_count"] = world_size
        else:
            state_key, group_key = "base_optimizer_state", "single_partition_of_fp32_groups"
            totals = [
                sum(
                    int(save.optim[r]["optimizer_state_dict"][group_key][g].numel())
                    for r in range(save.world)
                )
                for g in range(len(osd[group_key]))
            ]
            osd["group_paddings"] = [
                zero2_partition(t, world_size, rank)[1] - zero2_partition(t, world_size, rank)[2]
                for t in totals
            ]
            osd["partition_count"] = [world_size] * len(totals)
            if "param_slice_mappings" in osd:
                osd["param_slice_mappings"] = _slice_mappings(save, totals, world_size, rank, zipw)
        osd[group_key] = [written[f"fp32.{g}"] for g in range(len(osd[group_key]))]
        inner = dict(osd[state_key])
        inner["state"] = {
            g: {key: written.get(f"state.{g}.{key}", value) for key, value in state.items()}
            for g, state in inner["state"].items()
        }
        osd[state_key] = inner
        top["optimizer_state_dict"] = osd
        zipw.finish(_picklable(top, zipw))
        fh.flush()
        os.fsync(fh.fileno())


def _slice_mappings(
    save: ZeroSave, totals: list[int], world_size: int, rank: int, zipw: TorchZipWriter
) -> list[OrderedDict[str, Any]]:
    """ZeRO-1/2 `param_slice_mappings` of rank `rank`: where each parameter's fragment sits in
    its partition (`fragment_address(numel, start)`), as an N-rank engine records it."""
    src = save.base or "."
    shapes = _shapes(save, src)
    paddings = save.optim[0]["optimizer_state_dict"].get("param_alignment_paddings")
    cls = zipw.name_global("deepspeed.utils.tensor_fragment.fragment_address")
    out: list[OrderedDict[str, Any]] = []
    for g, params in enumerate(shapes):
        start, size, _ = zero2_partition(totals[g], world_size, rank)
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        mapping: OrderedDict[str, Any] = OrderedDict()
        offset = 0
        for index, (name, numel) in enumerate(params):
            lo, hi = max(offset, start), min(offset + numel, start + size)
            if hi > lo:
                mapping[name] = _instance(cls, {"numel": hi - lo, "start": lo - start})
            offset += numel + (int(pads[index]) if pads is not None else 0)
        out.append(mapping)
    return out


def _picklable(value: Any, zipw: TorchZipWriter) -> Any:
    """`value` with what `TorchZipWriter.finish` cannot pickle as it is replaced: tensors by
    their written storage, inert DeepSpeed records by objects pickling as the original class
    (NEWOBJ + state, or the class called with its arguments, as they were read)."""
    import torch

    if isinstance(value, torch.Tensor):
        return zipw.add_tensor(value.clone() if value.dim() == 0 else value)
    if isinstance(value, InertObject):
        cls = zipw.name_global(value.original)
        state = _picklable(value.state, zipw)
        if value.args or not isinstance(state, dict):
            return _Rebuilt(cls, tuple(_picklable(a, zipw) for a in value.args), state)
        return _instance(cls, state)
    if type(value) in (dict, OrderedDict):
        out = type(value)()
        for k, v in value.items():
            out[k] = _picklable(v, zipw)
        return out
    if type(value) is list:
        return [_picklable(v, zipw) for v in value]
    if type(value) is tuple:
        return tuple(_picklable(v, zipw) for v in value)
    return value


def _instance(cls: type, state: dict[str, Any]) -> Any:
    """An object of `cls` holding `state`: pickles as NEWOBJ of the class plus its state, the
    way pickle writes a dataclass or plain object (DeepSpeed's loss scaler, fragment_address)."""
    record: Any = object.__new__(cls)
    record.__dict__.update(state)
    return record


class _Rebuilt:
    """Pickles as `cls(*args)` (then its state set), `cls` naming the original class."""

    def __init__(self, cls: type, args: tuple[Any, ...], state: Any):
        self.cls, self.args, self.state = cls, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        if self.state is None:
            return (self.cls, self.args)
        return (self.cls, self.args, self.state)


_INT_OPS = {"BININT1", "BININT2", "BININT", "LONG1"}
_MEMO_OPS = {"BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT"}
_GET_OPS = {"BINGET", "LONG_BINGET", "GET"}


def rewrite_world_size(source: Source, rel: str, world_size: int, target: Path) -> None:
    """Copy the model-states file `rel` to `target` with `dp_world_size` set to `world_size`.

    The integer after the one `dp_world_size` key is rewritten in data.pkl's opcodes (nothing
    is unpickled); every other record of the zip is copied as it is, streamed.
    """
    where = source.storage.describe(rel)
    local = source.storage.local_path(rel)
    handle = open(local, "rb") if local is not None else source.storage.open(rel)
    with handle as raw, zipfile.ZipFile(raw) as archive:
        pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise FormatError(
                "is not a zip-format torch.save file",
                path=where,
                fix="Re-save it with a current torch (DeepSpeed's own save writes one).",
            )
        data = archive.read(pickles[0])
        data = _set_world_size(data, world_size, where)
        with target.open("wb") as fh:
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as out:
                for info in archive.infolist():
                    blocks = data if info is pickles[0] else _record_blocks(archive, info)
                    size = len(data) if info is pickles[0] else info.file_size
                    write_record(out, fh, 0, info.filename, blocks, size)
            fh.flush()
            os.fsync(fh.fileno())


def _record_blocks(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> Iterator[bytes]:
    with archive.open(info) as member:
        while block := member.read(8 << 20):
            yield block


def _set_world_size(data: bytes, world_size: int, where: str) -> bytes:
    """data.pkl with the integer stored under the key `dp_world_size` set to `world_size`."""
    ops = list(pickletools.genops(io.BytesIO(data)))
    spots = []
    # the memo slot each op stores to (MEMOIZE takes the next free one), so a repeated key,
    # which the pickler writes as a GET of its slot, is found too
    slots: dict[int, int] = {}
    taken = 0
    for i, (op, arg, _pos) in enumerate(ops):
        if op.name in _MEMO_OPS:
            slots[i] = arg if isinstance(arg, int) else taken
            taken += 1
    memo: set[int] = set()  # the slots holding the key
    for i, (op, arg, _pos) in enumerate(ops):
        if op.name in _GET_OPS and arg in memo:
            pass
        elif arg != "dp_world_size" or "UNICODE" not in op.name:
            continue
        elif i + 1 in slots:
            memo.add(slots[i + 1])
        j = i + 1
        while j < len(ops) and ops[j][0].name in _MEMO_OPS:
            j += 1
        if j < len(ops) and ops[j][0].name in _INT_OPS:
            spots.append(j)
    if len(spots) != 1:
        raise FormatError(
            f"records dp_world_size {len(spots)} times, not once as DeepSpeed writes it",
            path=where,
            fix=_DAMAGED,
        )
    op, _arg, pos = ops[spots[0]]
    assert pos is not None
    end = ops[spots[0] + 1][2]
    assert end is not None
    # BININT1 below 256, else BININT, as pickle itself writes an int
    new = b"K" + bytes([world_size]) if world_size < 256 else b"J" + struct.pack("<i", world_size)
    return data[:pos] + new + data[end:]


def _carried(
    source: Source, save: ZeroSave, rank_files: dict[str, int]
) -> tuple[list[str], list[SkippedEntry]]:
    """(files copied verbatim, files left out with why): everything but the ZeRO files the
    re-cut writes anew, the per-rank files (their own policy), other tags of a run folder, and
    hidden files."""
    own = {f"{save.base}{n}" for n in (*save.optim_names.values(), *save.model_names.values())}
    own |= set(rank_files)
    carried: list[str] = []
    skipped: list[SkippedEntry] = []
    for rel in sorted(source.files):
        if rel in own:
            continue
        if any(part.startswith(".") for part in rel.split("/")):
            skipped.append(
                SkippedEntry(
                    name=rel, kind="file", reason="a hidden file: not part of the training state"
                )
            )
        elif "/" in rel and save.base and not rel.startswith(save.base):
            skipped.append(
                SkippedEntry(
                    name=rel,
                    kind="file",
                    reason=f"another checkpoint of the run (`latest` names {save.base.rstrip('/')}): "
                    "reshard it on its own",
                )
            )
        else:
            carried.append(rel)
    return carried, skipped


def check_recut(opened: OpenedSource, staging: Path) -> None:
    """The structural check before publishing: the staged output opens as a complete,
    resumable ZeRO save whose rebuilt fp32 weights have the source's names, dtypes and shapes.
    (Their values are the source's by construction: the partitions are the same bytes cut
    elsewhere, which the tests check bit for bit through DeepSpeed; reading them all again
    here would hold a partition in memory.)"""
    from ...formats import resolve_source
    from ...sources.opening import recognise_layout

    out = recognise_layout(resolve_source(str(staging)))
    if out is None:
        raise RuntimeError("the re-cut ZeRO save does not open as a DeepSpeed folder")
    try:
        errors = [p for p in out.problems if p.severity == "error"]
        if errors:
            raise RuntimeError(f"the re-cut ZeRO save has problems: {errors[0].message}")
        if out.training is None or not out.training.resumable:
            raise RuntimeError("the re-cut ZeRO save is not resumable")

        def weights(checkpoint: Any) -> dict[str, tuple[str | None, list[int]]]:
            return {
                e.name: (e.dtype, list(e.shape))
                for e in checkpoint.manifest.entries
                if e.name.startswith("model.")
            }

        mine = weights(opened.checkpoint)
        if not mine or weights(out.checkpoint) != mine:
            raise RuntimeError("the re-cut ZeRO save does not rebuild the source's weights")
    finally:
        out.checkpoint.close()
