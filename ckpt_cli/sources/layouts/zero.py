"""DeepSpeed ZeRO-1/2/3: the full fp32 weights, rebuilt one parameter at a time.

A ZeRO checkpoint keeps no whole weights. Every data-parallel rank saves its own partition of
the fp32 master weights in `zero_pp_rank_R_mp_rank_00_optim_states.pt` (ZeRO-1/2:
`single_partition_of_fp32_groups`, one flat vector per parameter group, the ranks' vectors
concatenated in rank order; ZeRO-3: `fp32_flat_groups`, every parameter cut into `world_size`
equal pieces padded at the end), and the model-states file records the names and shapes
(`param_shapes`), the buffers, the frozen parameters and the tied names (`shared_params`).
DeepSpeed's `zero_to_fp32.py` concatenates everything in memory; here each parameter is a
virtual entry whose read gathers only its own slices from the memory-mapped partition files,
so the peak is one parameter. The reconstruction follows `zero_to_fp32.py` rule for rule
(buffers cast to fp32, frozen parameters, ZeRO-2 alignment paddings, ZeRO-3 padding), so the
tensors are bit-identical to `get_fp32_state_dict_from_zero_checkpoint`.

`zero_partitions` also says what must be present: `dp_world_size` (and `mp_world_size`) in the
model-states file name every rank whose files must exist.

Tensor-parallel saves (`mp_world_size` > 1, DeepSpeed given a Megatron-style `mpu`) hold one
model-states file and one set of ZeRO partitions per model-parallel rank `M`
(`*zero_pp_rank_R_mp_rank_0M_*`). Each mp rank is rebuilt on its own, as `zero_to_fp32.py`
does on that rank's files, and its weights are named `mp_rank_0M.<name>`: joining the TP
slices of one weight needs the model's own rules (which dim each layer splits), so it is not
guessed here. `--select model.mp_rank_01` takes one mp rank's state dict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import FormatError, NotFoundError
from ...formats.base import NAMES_FIX, Checkpoint, Source
from ...models import Entry, Manifest, Problem, ProblemList
from .details import ZeroDetails
from .ranks import check_file_number

if TYPE_CHECKING:
    import torch

_OPTIM = re.compile(r"(?:.*/)?(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"(?:.*/)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"(?:.*/)?mp_rank_(\d+)_model_states\.pt$")


@dataclass
class _Slice:
    """`length` elements from `start` of the flat tensor `name` of `checkpoint`."""

    checkpoint: Checkpoint
    name: str
    start: int
    length: int


@dataclass
class _Param:
    """How to build one output tensor: slices concatenated, cut to `numel`, shaped."""

    shape: list[int]
    dtype: str
    slices: list[_Slice] = field(default_factory=list)
    numel: int = 0
    to_float: bool = False


def _path(entry: Entry) -> tuple[Any, ...]:
    return tuple(key for _, key in entry.saved_keys())


def _under(checkpoint: Checkpoint, *keys: Any) -> list[tuple[tuple[Any, ...], Entry]]:
    """(key path below `keys`, entry) for every leaf whose key path starts with `keys`."""
    out = []
    for entry in checkpoint.manifest.entries:
        path = _path(entry)
        if path[: len(keys)] == keys:
            out.append((path[len(keys) :], entry))
    return out


def _value(checkpoint: Checkpoint, entry: Entry) -> Any:
    if entry.value is not None:
        return entry.value
    if entry.kind != "object":
        return None
    try:
        return checkpoint.read_object(entry.name)
    except (FormatError, NotFoundError):
        return None


def _leaf(checkpoint: Checkpoint, *keys: Any) -> Any:
    for rest, entry in _under(checkpoint, *keys):
        if not rest:
            return _value(checkpoint, entry)
    return None


def _shape(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    ):
        return [int(d) for d in value]
    return None


def _flat_groups(checkpoint: Checkpoint, key: str) -> list[Entry]:
    groups = sorted(
        (rest[0], e)
        for rest, e in _under(checkpoint, "optimizer_state_dict", key)
        if len(rest) == 1 and isinstance(rest[0], int) and e.kind == "tensor"
    )
    return [e for _, e in groups]


class ZeroWeights(Checkpoint):
    """The full fp32 weights of a ZeRO checkpoint as virtual entries (see the module docstring).

    Attributes:
        stage: the ZeRO stage the save records (1, 2 or 3; 2 where it records none).
        world_size: the data-parallel ranks whose partitions are gathered.
        mp_world_size: model-parallel ranks; above 1 every mp rank's weights are their own
            state dict under `mp_rank_MM.`.
    """

    def __init__(
        self,
        source: Source,
        location: str,
        params: dict[str, _Param],
        stage: int,
        world: int,
        mp: int = 1,
    ):
        entries = [
            Entry(
                name=name,
                kind="tensor",
                dtype=p.dtype,
                shape=list(p.shape),
                nbytes=_nbytes(p),
            )
            for name, p in params.items()
        ]
        manifest = Manifest(
            format="zero",
            location=location,
            entries=entries,
            details=ZeroDetails(zero_stage=stage, world_size=world, mp_world_size=mp).as_details(),
        )
        super().__init__(source, manifest)
        self.params = params
        self.stage = stage
        self.world_size = world
        self.mp_world_size = mp

    def read_tensor(self, name: str) -> torch.Tensor:
        import torch

        try:
            param = self.params[name]
        except KeyError:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            ) from None
        pieces = [
            s.checkpoint.read_slice(s.name, [s.start], [s.length]).reshape(-1)
            for s in param.slices
            if s.length > 0
        ]
        if len(pieces) == 1 and not param.numel:
            flat = pieces[0]
        else:
            flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32)
        if param.numel:
            flat = flat[: param.numel]
        tensor = flat.reshape(param.shape).contiguous()
        if param.to_float and tensor.is_floating_point():
            tensor = tensor.float()
        return tensor

    def read_object(self, name: str) -> Any:
        return self.read_tensor(name)


def _nbytes(param: _Param) -> int:
    from ... import dtypes

    return math.prod(param.shape) * dtypes.itemsize(param.dtype)


@dataclass
class ZeroLayout:
    """What a ZeRO checkpoint folder holds, and what it lacks.

    Attributes:
        weights: the rebuilt fp32 weights, None when a partition is missing or inconsistent.
        problems: missing rank files and inconsistent partitions (plain `verify` reports them).
        stage / world_size: ZeRO stage (1, 2 or 3) and data-parallel ranks.
        padding: component entry name (`optim_states_1.optimizer_state_dict.fp32_flat_groups.0`)
            -> the flat element ranges `[start, end)` of it that hold no parameter (ZeRO-3
            pads every parameter to a multiple of the world size, ZeRO-2 aligns the groups;
            DeepSpeed allocates that padding with `torch.empty`, so its values mean nothing).
            The optimizer state over the same flat partition (`exp_avg`...) has the same.
    """

    weights: ZeroWeights | None
    problems: list[Problem]
    stage: int | None
    world_size: int | None
    padding: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class SavedSizes:
    """What a ZeRO save's rank-0 model states record of its layout: `dp_world_size`,
    `mp_world_size`, `ds_config`'s ZeRO stage and bf16 switch (None where not recorded)."""

    dp: int | None = None
    mp: int | None = None
    stage: int | None = None
    bf16: bool | None = None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


#: data-parallel x model-parallel ranks a ZeRO save may record: the largest runs use about
#: 100,000 GPUs, and each rank named is a file name listed (10**12 from a 2 KB model states)
MAX_ZERO_RANKS = 1 << 20


def expected_partitions(
    base: str,
    files: set[str],
    saved: SavedSizes,
    where: str,
    describe: Callable[[str], str] = str,
) -> tuple[int, int | None, int, list[str]] | None:
    """(stage, dp_world_size, mp_world_size, the files every rank's partition needs) of the
    ZeRO save in tag folder `base`, among `files` (paths of the run or tag folder), from what
    its model states `where` record (`saved`); None for ZeRO stage 0. Without a recorded
    dp_world_size only the ranks present are expected. FormatError naming `where` when the
    ranks recorded are more than `MAX_ZERO_RANKS`, and naming a partition file (`describe`d)
    numbered past any run (`check_file_number`): DeepSpeed's loader and `zero_to_fp32` take
    every `*_optim_states.pt` of the folder, so `verify`, `latest` and `prune` all refuse it."""
    present_optim = {r for r in files if r.startswith(base) and _OPTIM.fullmatch(r)}
    present_model3 = {r for r in files if r.startswith(base) and _MODEL3.fullmatch(r)}
    for rel in sorted(present_optim | present_model3):
        match = _OPTIM.fullmatch(rel) or _MODEL3.fullmatch(rel)
        if match:
            check_file_number(max(int(match.group(1)), int(match.group(2))), describe(rel))
    stage: int | None = None
    if present_model3:
        stage = 3
    elif isinstance(saved.stage, int) and not isinstance(saved.stage, bool):
        stage = saved.stage
    elif present_optim:
        stage = 2
    if not stage:
        return None
    dp, mp = _positive(saved.dp), _positive(saved.mp) or 1
    if (dp or 1) * mp > MAX_ZERO_RANKS:
        raise FormatError(
            f"records {(dp or 1) * mp:,} ranks (dp_world_size {dp or 1:,} x mp_world_size "
            f"{mp:,}), more than the {MAX_ZERO_RANKS:,} ckpt lists the partitions of; no run "
            "has used that many (a corrupt or crafted file)",
            path=where,
            fix="Copy the checkpoint again from where the run saved it, or resume from an "
            "earlier checkpoint of the run (`ckpt latest RUN_DIR` names the newest whole one).",
        )
    if dp is None:
        found = (
            _OPTIM.fullmatch(r) or _MODEL3.fullmatch(r) for r in present_optim | present_model3
        )
        ranks = sorted({int(m.group(1)) for m in found if m})
    else:
        ranks = list(range(dp))
    # the bf16 optimizer names its files `bf16_zero_pp_rank_...`
    bf16 = any(r[len(base) :].startswith("bf16_") for r in present_optim)
    if not present_optim:
        bf16 = saved.bf16 is True
    prefix = "bf16_" if bf16 else ""
    expected: list[str] = []
    for r in ranks:
        for t in range(mp):
            expected.append(f"{base}{prefix}zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt")
            if stage == 3:
                expected.append(f"{base}zero_pp_rank_{r}_mp_rank_{t:02d}_model_states.pt")
    if stage != 3:
        expected += [f"{base}mp_rank_{t:02d}_model_states.pt" for t in range(mp)]
    return stage, dp, mp, expected


#: the rank-0 model states of a ZeRO-1/2 save and of a ZeRO-3 one, in a tag folder
RANK0_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def saved_sizes(model: Checkpoint) -> SavedSizes:
    """`SavedSizes` of an opened model-states file."""
    return SavedSizes(
        dp=_leaf(model, "dp_world_size"),
        mp=_leaf(model, "mp_world_size"),
        stage=_leaf(model, "ds_config", "zero_optimization", "stage"),
        bf16=_leaf(model, "ds_config", "bf16", "enabled"),
    )


def stray_partitions(names: Iterable[str], saved: SavedSizes) -> dict[str, tuple[int, int]]:
    """The ZeRO partition files among `names` (of one tag folder) numbered for a rank the save
    did not have: data-parallel rank >= the recorded dp_world_size, or model-parallel rank >=
    mp_world_size (file -> (dp rank, mp rank)); none when dp_world_size is not recorded.

    DeepSpeed's resume opens only the ranks its model states record, so such a file (another
    save's, copied in) is not part of the save; but `zero_to_fp32` takes every
    `*_optim_states.pt` of the folder and fails on it, so the layout names it and leaves it out."""
    dp, mp = _positive(saved.dp), _positive(saved.mp) or 1
    if dp is None:
        return {}
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        match = _OPTIM.fullmatch(name) or _MODEL3.fullmatch(name)
        if match and (int(match.group(1)) >= dp or int(match.group(2)) >= mp):
            out[name] = (int(match.group(1)), int(match.group(2)))
    return out


def zero_partitions(
    source: Source,
    base: str,
    parts: dict[str, tuple[str, str]],
    components: dict[str, Checkpoint],
) -> ZeroLayout | None:
    """The ZeRO partitions of a DeepSpeed tag folder, or None when it is not a ZeRO save.

    Complexity 23: one pass (sort files by rank, infer the stage, list the expected partitions,
    rebuild) whose early returns each mean "report, do not rebuild"; moved unchanged from zero.py.

    Args:
        source: the run folder (or tag folder).
        base: the tag folder's prefix inside `source` (`global_step2/`, or empty).
        parts: component -> (file, format) as the layout opened them.
        components: component -> its opened torch checkpoint.
    """
    optim: dict[tuple[int, int], Checkpoint] = {}
    model3: dict[tuple[int, int], Checkpoint] = {}
    model_mp: dict[int, Checkpoint] = {}  # ZeRO-1/2: one model-states file per mp rank
    for comp, (rel, _fmt) in parts.items():
        checkpoint = components.get(comp)
        if checkpoint is None:
            continue
        if m := _OPTIM.fullmatch(rel):
            optim[(int(m.group(1)), int(m.group(2)))] = checkpoint
        elif m := _MODEL3.fullmatch(rel):
            model3[(int(m.group(1)), int(m.group(2)))] = checkpoint
        elif m := _MODEL.fullmatch(rel):
            model_mp[int(m.group(1))] = checkpoint
    model = model3.get((0, 0)) or model_mp.get(0)
    if model is None:
        return None
    files = set(source.files)
    model_file = next(
        (rel for comp, (rel, _) in parts.items() if components.get(comp) is model), "model states"
    )
    saved = saved_sizes(model)
    describe = source.storage.describe
    plan = expected_partitions(base, files, saved, describe(model_file), describe)
    if plan is None:
        return None  # ZeRO stage 0: the optimizer lives in the model states
    stage, dp, mp, expected = plan
    where = source.storage.describe(base.rstrip("/") or ".")
    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    if dp is None:
        problems.append(
            Problem(
                code="zero_world_size_unknown",
                message=f"{model_file}: records no dp_world_size, so the ZeRO partitions "
                "present cannot be checked for completeness",
                file=source.storage.describe(model_file),
                severity="warning",
                fix="Check that every data-parallel rank's zero_pp_rank_* files are here (one "
                "per rank the run used); a DeepSpeed version that records dp_world_size lets "
                "ckpt check it.",
            )
        )
        ranks = sorted({r for r, _ in optim} | {r for r, _ in model3})
    else:
        ranks = list(range(dp))
    for rel in expected:
        if rel in files:
            continue
        problems.append(
            Problem(
                code="missing_partition",
                message=f"{where}: {rel[len(base) :]} is missing: ZeRO-{stage} saved "
                f"{dp} data-parallel rank(s) (dp_world_size in {model_file[len(base) :]}) and "
                "every rank's partition is needed to rebuild the weights or resume",
                file=source.storage.describe(rel),
                fix=f"Copy {rel[len(base) :]} again from where the run saved it (each rank "
                "writes its own), or resume from an earlier checkpoint of the run (`ckpt latest "
                "RUN_DIR` names the newest complete one).",
            )
        )
    if problems and any(p.severity == "error" for p in problems):
        return ZeroLayout(None, problems, stage, dp)
    world = len(ranks)
    params: dict[str, _Param] = {}
    try:
        for t in range(mp):
            found = _rebuild(stage, t, ranks, optim, model3, model_mp)
            if found is None:
                return ZeroLayout(None, problems, stage, dp)  # unreadable: reported by the layout
            # tensor parallel: one state dict per mp rank (merging TP slices needs the model's
            # own rules), each under `mp_rank_MM.` as DeepSpeed names its files
            params.update(
                found if mp == 1 else {f"mp_rank_{t:02d}.{k}": v for k, v in found.items()}
            )
    except _Mismatch as error:
        problems.append(
            Problem(
                code="zero_partition_mismatch",
                message=f"{where}: {error}",
                file=where,
                fix="The partitions come from different saves, or one is corrupt: copy the "
                "folder again from where the run saved it, or resume from an earlier checkpoint "
                "of the run (`ckpt latest RUN_DIR` names the newest complete one).",
            )
        )
        return ZeroLayout(None, problems, stage, dp)
    weights = ZeroWeights(source, where, params, stage, world, mp)
    return ZeroLayout(weights, problems, stage, dp, _padding(params, components))


def _padding(
    params: dict[str, _Param], components: dict[str, Checkpoint]
) -> dict[str, list[tuple[int, int]]]:
    """The elements of every partition tensor that no parameter reads (see `ZeroLayout`).

    A parameter reads its slices in order up to its `numel`: what the last slice holds past
    that is its ZeRO-3 padding; what no parameter covers at all is group alignment.
    """
    covered: dict[tuple[int, str], list[tuple[int, int]]] = {}
    owners: dict[int, Checkpoint] = {}
    seen: set[int] = set()
    for param in params.values():
        if id(param) in seen:  # a tied name shares its target's _Param
            continue
        seen.add(id(param))
        left = param.numel or sum(s.length for s in param.slices)
        for piece in param.slices:
            used = max(0, min(piece.length, left))
            left -= used
            owners[id(piece.checkpoint)] = piece.checkpoint
            if used:
                key = (id(piece.checkpoint), piece.name)
                covered.setdefault(key, []).append((piece.start, piece.start + used))
            else:
                covered.setdefault((id(piece.checkpoint), piece.name), [])
    names = {id(c): comp for comp, c in components.items()}
    out: dict[str, list[tuple[int, int]]] = {}
    for (owner, inner), ranges in covered.items():
        comp = names.get(owner)
        checkpoint = owners[owner]
        entry = checkpoint.manifest.by_name.get(inner)
        if comp is None or entry is None or entry.kind != "tensor":
            continue
        numel = math.prod(entry.shape)
        gaps = _complement(ranges, numel)
        if not gaps:
            continue
        out[f"{comp}.{inner}"] = gaps
        # the optimizer state over the same flat group: `...state.<g>.exp_avg` and the like
        group = _path(entry)[-1] if _path(entry) else None
        if not isinstance(group, int):
            continue
        for other in checkpoint.manifest.entries:
            path = _path(other)
            if (
                other is not entry
                and other.kind == "tensor"
                and math.prod(other.shape) == numel
                and path[:1] == ("optimizer_state_dict",)
                and any(path[i] == "state" and path[i + 1] == group for i in range(len(path) - 1))
            ):
                out[f"{comp}.{other.name}"] = gaps
    return out


def _complement(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The parts of `[0, numel)` that `ranges` leave out, in order."""
    gaps: list[tuple[int, int]] = []
    at = 0
    for lo, hi in sorted(ranges):
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < numel:
        gaps.append((at, numel))
    return gaps


def _rebuild(
    stage: int,
    mp_rank: int,
    ranks: list[int],
    optim: dict[tuple[int, int], Checkpoint],
    model3: dict[tuple[int, int], Checkpoint],
    model_mp: dict[int, Checkpoint],
) -> dict[str, _Param] | None:
    """One model-parallel rank's fp32 weights from its data-parallel ranks' partitions (what
    `zero_to_fp32.py` rebuilds from that mp rank's files); None when a file is unreadable."""
    opt = [optim.get((r, mp_rank)) for r in ranks]
    if any(c is None for c in opt):
        return None
    ready = [c for c in opt if c is not None]
    if stage == 3:
        models = [model3.get((r, mp_rank)) for r in ranks]
        if any(c is None for c in models):
            return None
        present = [c for c in models if c is not None]
        return _zero3(present[0], present, ready, len(ranks))
    model = model_mp.get(mp_rank)
    if model is None:
        return None
    return _zero2(model, ready, len(ranks))


class _Mismatch(Exception):
    """The partitions do not add up to the recorded shapes."""


def _param_shapes(model: Checkpoint) -> list[list[tuple[str, list[int]]]]:
    groups: dict[int, list[tuple[str, list[int]]]] = {}
    for rest, entry in _under(model, "param_shapes"):
        if len(rest) != 2 or not isinstance(rest[0], int):
            continue
        shape = _shape(_value(model, entry))
        if shape is None:
            raise _Mismatch(f"param_shapes entry {entry.name!r} is not a shape")
        groups.setdefault(rest[0], []).append((str(rest[1]), shape))
    return [groups[g] for g in sorted(groups)]


def _buffers(model: Checkpoint) -> dict[str, _Param]:
    names = _leaf(model, "buffer_names")
    out: dict[str, _Param] = {}
    if not isinstance(names, (list, tuple)):
        return out
    wanted = {str(n) for n in names}
    for rest, entry in _under(model, "module"):
        if len(rest) == 1 and str(rest[0]) in wanted and entry.kind == "tensor":
            assert entry.dtype is not None
            floating = entry.dtype.startswith(("float", "bfloat"))
            numel = math.prod(entry.shape)
            out[str(rest[0])] = _Param(
                shape=list(entry.shape),
                dtype="float32" if floating else entry.dtype,
                slices=[_Slice(model, entry.name, 0, numel)],
                to_float=floating,
            )
    return out


def _frozen(models: list[Checkpoint], world: int, stage: int) -> dict[str, _Param]:
    shapes = {
        str(rest[0]): _shape(_value(models[0], e))
        for rest, e in _under(models[0], "frozen_param_shapes")
        if len(rest) == 1
    }
    out: dict[str, _Param] = {}
    for name, shape in shapes.items():
        if shape is None:
            continue
        numel = math.prod(shape)
        slices = []
        dtype = "float32"
        for model in models if stage == 3 else models[:1]:
            frags = [e for rest, e in _under(model, "frozen_param_fragments", name) if not rest]
            if not frags or frags[0].kind != "tensor":
                raise _Mismatch(f"frozen parameter {name!r} has no fragment")
            frag = frags[0]
            dtype = frag.dtype or dtype
            slices.append(_Slice(model, frag.name, 0, math.prod(frag.shape)))
        out[name] = _Param(shape=shape, dtype=dtype, slices=slices, numel=numel)
    return out


def _shared(model: Checkpoint, params: dict[str, _Param]) -> None:
    for rest, entry in _under(model, "shared_params"):
        target = _value(model, entry)
        if len(rest) == 1 and isinstance(target, str) and target in params:
            params[str(rest[0])] = params[target]


def _zero2(model: Checkpoint, opt: list[Checkpoint], world: int) -> dict[str, _Param]:
    params = _buffers(model)
    params.update(_frozen([model], world, 2))
    shapes = _param_shapes(model)
    per_rank = [_flat_groups(c, "single_partition_of_fp32_groups") for c in opt]
    if any(len(groups) != len(shapes) for groups in per_rank):
        raise _Mismatch(
            f"the optimizer partitions hold {[len(g) for g in per_rank]} parameter groups, "
            f"param_shapes has {len(shapes)}"
        )
    paddings = _leaf(opt[0], "optimizer_state_dict", "param_alignment_paddings")
    padding_groups: list[Any] = []
    if paddings is None:
        found = {
            rest[0]: _value(opt[0], e)
            for rest, e in _under(opt[0], "optimizer_state_dict", "param_alignment_paddings")
            if len(rest) == 1
        }
        padding_groups = [found.get(g) for g in range(len(shapes))] if found else []
    elif isinstance(paddings, (list, tuple)):
        padding_groups = list(paddings)
    align = 2 * world
    for g, group in enumerate(shapes):
        # the group's full vector is the ranks' partitions one after the other
        spans = []
        start = 0
        for rank, groups in enumerate(per_rank):
            length = math.prod(groups[g].shape)
            spans.append((start, length, opt[rank], groups[g]))
            start += length
        avail = start
        pads = padding_groups[g] if g < len(padding_groups) else None
        if pads is not None and (not isinstance(pads, (list, tuple)) or len(pads) != len(group)):
            raise _Mismatch(f"param_alignment_paddings of group {g} do not match its parameters")
        offset = 0
        for index, (name, shape) in enumerate(group):
            numel = math.prod(shape)
            dtype = per_rank[0][g].dtype or "float32"
            param = _Param(shape=shape, dtype=dtype)
            for begin, length, checkpoint, entry in spans:
                lo, hi = max(offset, begin), min(offset + numel, begin + length)
                if hi > lo:
                    param.slices.append(_Slice(checkpoint, entry.name, lo - begin, hi - lo))
            if sum(s.length for s in param.slices) != numel:
                raise _Mismatch(f"{name!r} runs past the end of the ZeRO partitions")
            params[name] = param
            offset += numel
            if pads is not None:
                offset += int(pads[index])
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise _Mismatch(
                f"parameter group {g} uses {offset} of the {avail} elements its "
                f"{world} partitions hold"
            )
    _shared(model, params)
    return params


def _zero3(
    model: Checkpoint, models: list[Checkpoint], opt: list[Checkpoint], world: int
) -> dict[str, _Param]:
    params = _buffers(model)
    params.update(_frozen(models, world, 3))
    shapes = [item for group in _param_shapes(model) for item in group]
    per_rank = [_flat_groups(c, "fp32_flat_groups") for c in opt]
    if not per_rank or not per_rank[0]:
        raise _Mismatch("the optimizer partitions hold no fp32_flat_groups")
    bounds = [0]
    for entry in per_rank[0]:
        bounds.append(bounds[-1] + math.prod(entry.shape))
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > bounds[-1]:
            raise _Mismatch(f"{name!r} runs past the end of the ZeRO-3 partitions")
        param = _Param(shape=shape, dtype=per_rank[0][0].dtype or "float32", numel=numel)
        for rank, groups in enumerate(per_rank):
            for g, entry in enumerate(groups):
                lo, hi = max(offset, bounds[g]), min(offset + part, bounds[g + 1])
                if hi > lo:
                    param.slices.append(_Slice(opt[rank], entry.name, lo - bounds[g], hi - lo))
        params[name] = param
        offset += part
    if offset != bounds[-1]:
        raise _Mismatch(
            f"the parameters use {offset * world} of the {bounds[-1] * world} elements "
            f"the {world} ZeRO-3 partitions hold"
        )
    _shared(model, params)
    return params
