"""Megatron-LM's legacy saves (`--ckpt-format torch`): which rank folders one must hold.

Megatron-LM's `save_checkpoint` in its legacy format has every model-parallel rank of the first
data-parallel group write its own `torch.save` file, `iter_NNNNNNN/<rank folder>/
model_optim_rng.pt`, the folder named by `get_checkpoint_name`: `mp_rank_TT` (tensor-parallel
rank TT) when the pipeline has one stage, `mp_rank_TT_PPP` (pipeline rank PPP) when it has
several, and `_EEE` (expert-parallel rank) appended when experts are split. Each file holds
the run's `args` (an `argparse.Namespace` with `tensor_model_parallel_size`,
`pipeline_model_parallel_size`, `expert_model_parallel_size`). A node that died takes its
ranks' folders with it, and nothing else in the save says so: the tracker file is rewritten
by rank 0 alone, and each remaining file is whole. `load_checkpoint` then fails on the ranks
whose folder is missing, and a conversion reads part of the weights.

Names only here: the caller reads the sizes from a rank file's pickle opcodes
(`runs.judge.model_states_ints`: nothing unpickled, no tensor data) and this module says which
rank folders those sizes call for and which of them the save lacks. Without readable sizes, a
gap in the numbering of the folders present is still one.

With `--use-distributed-optimizer`, the optimizer's state is not in `model_optim_rng.pt`: its
`optimizer` holds the param groups alone, and megatron-core's `DistributedOptimizer.
save_parameter_state` writes the fp32 master weights and the Adam moments of the rank's
parameters, gathered over its data-parallel group, to `distrib_optim.pt` beside it
(`get_distributed_optimizer_checkpoint_name`: a `torch.save` of `{"buckets_coalesced": True,
<buffer index>: {<dtype>: {"param", "exp_avg", "exp_avg_sq": flat fp32 tensors,
"numel_unpadded": int}}}`). `load_checkpoint` reads it whenever the args say so; a rank folder
without it resumes nowhere. `missing_distrib_optim` names the folders that lack it.

A rank folder is one model-parallel rank of the save, never the whole: its tensors are that
rank's slices (`tensor_model_parallel_size` splits each layer's weights, pipeline stages hold
different layers). `rank_text` says so for a rank folder named alone.

The whole save named as SRC (`iter_N/`, or its run folder through the tracker) is one
checkpoint (`whole_save`, `open_save`): every rank folder opened as `megatron_rank` opens one
alone, its entries under `<rank folder>.`; the layout modules it opens are imported inside
those functions, so the run judge's name checks stay as cheap as before.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from ...errors import MissingRanksError
from ...formats.base import Source
from ...models import FileInfo, Problem

if TYPE_CHECKING:
    from .base import OpenedSource

#: the file each rank folder holds (Megatron-LM's `model_optim_rng.pt`)
RANK_FILE = "model_optim_rng.pt"
#: the distributed optimizer's state of a rank folder (`DistributedOptimizer.
#: save_parameter_state`, written by the rank's first data-parallel rank)
DISTRIB_OPTIM = "distrib_optim.pt"
#: the args that say whether a rank folder holds `distrib_optim.pt`: Megatron-LM writes it
#: with `--use-distributed-optimizer`, unless `--no-save-optim` saves no optimizer at all
DIST_OPT, NO_SAVE_OPTIM = "use_distributed_optimizer", "no_save_optim"
FLAG_KEYS = frozenset({DIST_OPT, NO_SAVE_OPTIM})
#: a rank folder: `mp_rank_TT`, `mp_rank_TT_PPP`, `mp_rank_TT_PPP_EEE` (or `mp_rank_TT_EEE`
#: with one pipeline stage and several expert-parallel ranks)
RANK_FOLDER = re.compile(r"mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?")
#: the sizes Megatron-LM's `args` record that name the rank folders, as written in `args`
TP, PP, EP = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
)
SIZE_KEYS = frozenset({TP, PP, EP})
#: the most rank folders one save is judged against (TP × PP × EP, or the grid the numbers of
#: the folders present span): the largest runs have tens of thousands of ranks, and a folder
#: named `mp_rank_2000_2000_2000` (or args edited to match) must not make ckpt list 8·10^9
MAX_RANK_FOLDERS = 1 << 20


class MissingRanks(NamedTuple):
    """What a legacy save lacks: the rank folders missing, and how the expected set was told.

    Attributes:
        missing: the rank folders the save should hold and does not (`mp_rank_01`), in order.
        expected: how many rank folders the save should hold.
        basis: where that number comes from, for people (`tensor_model_parallel_size 2 ×
            pipeline_model_parallel_size 1 in its args`, or the numbering of the folders).
    """

    missing: list[str]
    expected: int
    basis: str


def rank_folders(names: Iterable[str]) -> dict[str, bool]:
    """The rank folders among the paths of a save folder (relative to it), each with whether
    it holds its `model_optim_rng.pt`. Empty for anything but a legacy Megatron-LM save."""
    out: dict[str, bool] = {}
    for name in names:
        top, sep, inner = name.partition("/")
        if sep and RANK_FOLDER.fullmatch(top):
            out[top] = out.get(top, False) or inner == RANK_FILE
    return out


def folder_name(tp: int, pp: int | None, ep: int | None) -> str:
    """The rank folder Megatron-LM's `get_checkpoint_name` names (`pp` None with one pipeline
    stage, `ep` None with one expert-parallel rank)."""
    return (
        f"mp_rank_{tp:02d}"
        + (f"_{pp:03d}" if pp is not None else "")
        + (f"_{ep:03d}" if ep is not None else "")
    )


def expected_folders(sizes: Mapping[str, int]) -> list[str] | None:
    """Every rank folder a save whose args record `sizes` holds, or None when they record no
    usable tensor-parallel size."""
    tp, pp, ep = (sizes.get(key, 1) for key in (TP, PP, EP))
    if TP not in sizes or min(tp, pp, ep) < 1 or tp * pp * ep > MAX_RANK_FOLDERS:
        return None
    return [
        folder_name(t, p if pp > 1 else None, e if ep > 1 else None)
        for t, p, e in itertools.product(range(tp), range(pp), range(ep))
    ]


def _gaps(present: Iterable[str]) -> list[str]:
    """The folders missing from the grid the numbers of the folders present span: with no
    args to say how many ranks there were, a hole in the numbering is a lost folder (the last
    ranks lost cannot be told)."""
    shapes: dict[int, list[tuple[int, ...]]] = {}
    for name in present:
        match = RANK_FOLDER.fullmatch(name)
        if match is not None:
            numbers = tuple(int(g) for g in match.groups() if g is not None)
            shapes.setdefault(len(numbers), []).append(numbers)
    if len(shapes) != 1:
        return []  # mixed forms: not one save's numbering
    ranks = next(iter(shapes.values()))
    bounds = [max(r[i] for r in ranks) + 1 for i in range(len(ranks[0]))]
    if math.prod(bounds) > MAX_RANK_FOLDERS:
        return []  # a grid no run has: the numbering tells nothing
    have = set(ranks)
    out = []
    for numbers in itertools.product(*(range(b) for b in bounds)):
        if numbers not in have:
            first, *rest = numbers
            out.append(
                f"mp_rank_{first:02d}" + "".join(f"_{n:03d}" for n in rest)  # as they are named
            )
    return out


def missing_ranks(names: Iterable[str], sizes: Mapping[str, int]) -> MissingRanks | None:
    """The rank folders a legacy Megatron-LM save (the paths `names` of its folder, relative to
    it) lacks, None when it holds them all or is no legacy save.

    `sizes`: what a rank file's `args` record (`SIZE_KEYS`; empty when none could be read).
    The folders those sizes call for are expected; when they record none, or none of the
    folders present is one they call for (args edited, or another naming), a gap in the
    numbering of the folders present is missing. A folder without its `model_optim_rng.pt` is
    missing too."""
    folders = rank_folders(names)
    if not folders:
        return None
    present = {name for name, whole in folders.items() if whole}
    expected = expected_folders(sizes)
    if expected is not None and not present.isdisjoint(expected):
        missing = [name for name in expected if name not in present]
        basis = f"its args ({sizes_text(sizes)})"
        count = len(expected)
    else:
        missing = _gaps(present) if present else sorted(folders)
        count = len(present) + len(missing)
        basis = "the numbering of the rank folders it holds"
    if not missing:
        return None
    return MissingRanks(missing, count, basis)


def missing_ranks_text(found: MissingRanks) -> str:
    """The problem, for people: which rank folders are missing, of how many, and why it
    matters."""
    shown = ", ".join(f"{name}/" for name in found.missing[:8])
    more = len(found.missing) - 8
    if more > 0:
        shown += f" and {more} more"
    return (
        f"lacks {shown} of the {found.expected} rank folders (each with its {RANK_FILE}) "
        f"called for by {found.basis}: Megatron-LM cannot resume from it, and a conversion "
        "would hold only part of the weights (a node lost, or its files not copied?)"
    )


#: the fix of a legacy save that lacks rank folders
MISSING_RANKS_FIX = (
    "Restore the missing rank folders from the node that wrote them, or resume from an older "
    "complete save (`ckpt latest RUN_DIR` names it)."
)


def refuse_missing_ranks(where: str, found: MissingRanks | None) -> None:
    """Refuse a legacy save that lacks rank folders (`MissingRanksError`), naming them."""
    if found is not None:
        raise MissingRanksError(missing_ranks_text(found), path=where, fix=MISSING_RANKS_FIX)


def rank_file_to_read(folders: Mapping[str, bool]) -> str | None:
    """The rank folder whose `model_optim_rng.pt` to read the sizes from: the lowest present
    (every rank writes the same args)."""
    present = sorted(name for name, whole in folders.items() if whole)
    return f"{present[0]}/{RANK_FILE}" if present else None


def holds_distrib_optim(flags: Mapping[str, bool]) -> bool:
    """Whether a save whose args record `flags` (`FLAG_KEYS`) writes `distrib_optim.pt` into
    every rank folder."""
    return flags.get(DIST_OPT, False) and not flags.get(NO_SAVE_OPTIM, False)


def missing_distrib_optim(names: Iterable[str], flags: Mapping[str, bool]) -> list[str]:
    """The `distrib_optim.pt` files (`mp_rank_00/distrib_optim.pt`) the rank folders present
    in a legacy save (`names`: the paths of its folder, relative to it) lack, when its args
    (`flags`) say the distributed optimizer wrote one into each; empty otherwise."""
    if not holds_distrib_optim(flags):
        return []
    listed = set(names)
    folders = rank_folders(listed)
    return [
        f"{name}/{DISTRIB_OPTIM}"
        for name, whole in sorted(folders.items())
        if whole and f"{name}/{DISTRIB_OPTIM}" not in listed
    ]


def missing_distrib_optim_text(missing: list[str]) -> str:
    """The problem, for people: which `distrib_optim.pt` files are missing, and why it
    matters."""
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (
        f"lacks {shown}: its args record {DIST_OPT}=True, so the optimizer's state (fp32 "
        f"master weights, Adam moments) is in each rank folder's {DISTRIB_OPTIM}, not in "
        f"{RANK_FILE}; Megatron-LM's load_checkpoint cannot resume the optimizer without it"
    )


#: the fix of a legacy save that lacks `distrib_optim.pt`
DISTRIB_OPTIM_FIX = (
    f"Restore {DISTRIB_OPTIM} from the node that wrote it, or resume from an older complete "
    "save (`ckpt latest RUN_DIR` names it); to start from the weights alone, Megatron-LM's "
    "--no-load-optim skips the optimizer's state."
)


def rank_count(sizes: Mapping[str, int]) -> int | None:
    """How many rank folders a save whose args record `sizes` holds (None when they record no
    usable tensor-parallel size)."""
    expected = expected_folders(sizes)
    return len(expected) if expected is not None else None


def sizes_text(sizes: Mapping[str, int]) -> str:
    """The parallel sizes `sizes` records, for people (`tensor_model_parallel_size 2 ×
    pipeline_model_parallel_size 1`)."""
    text = f"{TP} {sizes.get(TP, 1)} × {PP} {sizes.get(PP, 1)}"
    if sizes.get(EP, 1) > 1:
        text += f" × {EP} {sizes[EP]}"
    return text


def rank_text(folder: str, sizes: Mapping[str, int]) -> str | None:
    """What a rank folder named alone is, for people: one of how many rank folders, holding
    which part of the weights; None when its args say the save has one rank folder (or
    record no sizes)."""
    count = rank_count(sizes)
    if count is None or count < 2:
        return None
    parts = []
    if sizes.get(TP, 1) > 1:
        parts.append(f"1/{sizes[TP]} of each tensor-parallel weight")
    if sizes.get(PP, 1) > 1:
        parts.append(f"the layers of one of {sizes[PP]} pipeline stages")
    if sizes.get(EP, 1) > 1:
        parts.append(f"the experts of one of {sizes[EP]} expert-parallel ranks")
    return (
        f"{folder}/ is one of the {count} rank folders of a legacy Megatron-LM save "
        f"({sizes_text(sizes)} in its args): it holds {', '.join(parts)}, not the whole model"
    )


# --------------------------------------------------------------------------- the whole save
# `inspect` and `convert` of the iteration folder (or of the run folder, through the tracker):
# one checkpoint of its rank folders. Everything below imports the layouts it opens lazily:
# this module is imported for names by the run judge.

#: the layout token of a whole legacy save read as one checkpoint (`LayoutInfo.layout`)
SAVE_LAYOUT = "megatron-legacy-save"


class WholeSave(NamedTuple):
    """A whole legacy Megatron-LM save named as SRC, by names and its lowest rank's args.

    Attributes:
        source: the iteration folder (`iter_0000200/`), SRC itself or the folder the run
            folder's tracker names.
        folders: its rank folders that hold their `model_optim_rng.pt`, in order.
        sizes: the parallel sizes its args record (`SIZE_KEYS`; empty when unreadable).
    """

    source: Source
    folders: list[str]
    sizes: dict[str, int]


def whole_save(source: Source) -> WholeSave | None:
    """The legacy Megatron-LM save `source` is (its iteration folder), or the one the tracker of
    a run folder `source` names (`latest_checkpointed_iteration.txt`: what Megatron-LM's
    `load_checkpoint` resumes from); None for any other SRC. Refuses (`MissingRanksError`) a
    save that lacks rank folders, naming them."""
    from ...formats import holds_only_nested_checkpoints

    if source.target is not None or not holds_only_nested_checkpoints(source):
        return None
    from ..runs.judge import megatron_legacy_args, megatron_missing_ranks

    save = source
    if not rank_folders(source.files):
        from ..runs.judge import read_megatron_tracker
        from ..runs.naming import MEGATRON_TRACKER, megatron_folder

        if MEGATRON_TRACKER not in source.top_level():
            return None
        named = megatron_folder(read_megatron_tracker(source.storage))
        if named is None or not rank_folders(
            n[len(named) + 1 :] for n in source.files if n.startswith(f"{named}/")
        ):
            return None
        from .composite import subfolder_source

        save = subfolder_source(source, named)
    refuse_missing_ranks(save.location.raw, megatron_missing_ranks(save.storage, "", save.files))
    folders = sorted(name for name, whole in rank_folders(save.files).items() if whole)
    sizes, _flags = megatron_legacy_args(save.storage, "", save.files)
    return WholeSave(save, folders, sizes)


def grid_of(folder: str) -> str:
    """A rank folder's place in the grid, for people (`tensor rank 1, pipeline rank 0`)."""
    match = RANK_FOLDER.fullmatch(folder)
    if match is None:
        return folder
    numbers = [int(g) for g in match.groups() if g is not None]
    names = ["tensor", "pipeline", "expert"] if len(numbers) == 3 else ["tensor", "pipeline"]
    return ", ".join(f"{what} rank {n}" for what, n in zip(names, numbers, strict=False))


def open_save(save: WholeSave) -> OpenedSource:
    """A whole legacy save as one checkpoint: every rank folder opened as `megatron_rank`
    opens one named alone (headers and pickle metadata only), its entries under
    `<rank folder>.` (`mp_rank_01_000.model.decoder.layers.0...`), `OpenedSource.ranks` each
    rank's own view, `layout` the grid its args record and each rank folder's totals, the
    training state the ranks' together (resumable only when every rank is)."""
    from ...models import TrainingState
    from .base import OpenedSource
    from .composite import CompositeCheckpoint, subfolder_source
    from .megatron_rank import MegatronRank
    from .model_folders import ComponentInfo, LayoutInfo

    layout = MegatronRank()
    ranks: dict[str, OpenedSource] = {}
    try:
        for name in save.folders:
            opened = layout.open(subfolder_source(save.source, name))
            if opened is not None:
                ranks[name] = opened
    except BaseException:
        for opened in ranks.values():
            opened.checkpoint.close()
        raise
    components = {name: opened.checkpoint for name, opened in ranks.items()}
    inside = {f"{name}/{f.path}" for name, c in components.items() for f in c.manifest.files}
    other = [
        FileInfo(path=rel, size=size, entries=0)
        for rel, size in sorted(save.source.files.items())
        if rel not in inside
    ]
    checkpoint = CompositeCheckpoint(
        save.source,
        components,
        SAVE_LAYOUT,
        other,
        subfolders={name: f"{name}/" for name in components},
    )
    states = [o.training for o in ranks.values() if o.training is not None]
    first = states[0] if states else TrainingState(layout=layout.name)
    training = first.model_copy(deep=True)
    training.components = {name: f"{name}/" for name in ranks}
    training.prefixes = {}
    training.resumable = all(s.resumable for s in states) and len(states) == len(ranks)
    training.exact = all(s.exact for s in states) and training.resumable
    # the weights of every rank folder (tensor-parallel replicas, the layer norms, once each)
    training.weights = {key: sum(s.weights.get(key, 0) for s in states) for key in first.weights}
    for state in states[1:]:
        training.missing += [m for m in state.missing if m not in training.missing]
        training.missing_exact += [
            m for m in state.missing_exact if m not in training.missing_exact
        ]
    optimizer = None
    if first.optimizer is not None:
        optimizer = DISTRIB_OPTIM if first.optimizer.source == DISTRIB_OPTIM else RANK_FILE
    sizes = save.sizes
    details: dict[str, object] = {key: sizes.get(key, 1) for key in (TP, PP, EP)}
    details.update(rank_folders=len(ranks), iteration=first.step, optimizer=optimizer)
    grid = sizes_text(sizes) if TP in sizes else "parallel sizes not recorded in its args"
    step = f", iteration {first.step}" if first.step is not None else ""
    info = LayoutInfo(
        layout=SAVE_LAYOUT,
        description=f"legacy Megatron-LM save, {grid}: {len(ranks)} rank folders{step}",
        details=details,
        components=[
            ComponentInfo(
                name=name,
                path=name,
                kind=grid_of(name),
                tensors=sum(1 for e in o.checkpoint.manifest.entries if e.kind == "tensor"),
                bytes=o.checkpoint.manifest.tensor_bytes(),
                files=[f"{name}/{f.path}" for f in o.checkpoint.manifest.files],
            )
            for name, o in ranks.items()
        ],
    )
    return OpenedSource(
        checkpoint=checkpoint,
        training=training,
        problems=[p for o in ranks.values() for p in o.problems if p.code != "one_rank_folder"],
        layout=info,
        unreadable={
            f"{name}.{comp}": why for name, o in ranks.items() for comp, why in o.unreadable.items()
        },
        ranks=ranks,
    )


def refuse_export(save: WholeSave, naming: str) -> None:
    """Refuse (FormatError, exit 4) to map a save of several rank folders to a framework
    naming: each holds one rank's slices, and merging them is no copy (see `docs`)."""
    from ...errors import FormatError

    raise FormatError(
        f"is a legacy Megatron-LM save of {len(save.folders)} rank folders "
        f"({sizes_text(save.sizes)} in its args): each holds one rank's slices, and ckpt does "
        f"not merge them into the one model --to {naming} maps (how each weight is split, and "
        "which layers each pipeline stage numbers from 0, depend on the model)",
        path=save.source.location.raw,
        fix="Merge it with Megatron-LM's tools/checkpoint/convert.py "
        "(--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1), or save it as "
        "torch_dist (`--ckpt-convert-format torch_dist`) and convert that; "
        "`--to safetensors` (or torch, dcp) writes each rank folder as it is.",
    )


def refuse_incomplete_save(source: Source) -> None:
    """Refuse (`MissingRanksError`, exit 4) a whole legacy save `source` that lacks rank
    folders, naming them; nothing for a complete one or any other SRC."""
    from ..runs.judge import megatron_missing_ranks

    refuse_missing_ranks(
        source.location.raw, megatron_missing_ranks(source.storage, "", source.files)
    )


def save_checks(source: Source, resumable: bool, exact: bool) -> list[Problem] | None:
    """`verify` of a whole legacy Megatron-LM save (`iter_N/`, its `mp_rank_*/` rank folders
    at its top), None for any other SRC (by names: nothing read).

    The rank folders its args call for (a lost one is `missing_rank_folder`), then every rank
    folder checked as `verify` checks one named alone (each file's structure, the
    `distrib_optim.pt` its args call for) and, with `resumable`, each rank's training state;
    every problem is reported, named by its rank folder's path."""
    from ...formats import holds_only_nested_checkpoints

    if source.target is not None or not holds_only_nested_checkpoints(source):
        return None
    folders = rank_folders(source.files)
    if not folders:
        return None
    from ...findings import problem_from_error
    from ..runs.judge import megatron_missing_ranks
    from . import open_folder_layout
    from .composite import subfolder_source
    from .megatron_rank import ONE_RANK
    from .training import opened_problems, training_checks

    problems: list[Problem] = []
    missing = megatron_missing_ranks(source.storage, "", source.files)
    if missing is not None:
        error = MissingRanksError(
            missing_ranks_text(missing), path=source.location.raw, fix=MISSING_RANKS_FIX
        )
        problems.append(problem_from_error(error))
    for name, whole in sorted(folders.items()):
        if not whole:
            continue  # said above: a rank folder without its model_optim_rng.pt is missing
        part = subfolder_source(source, name)
        opened = open_folder_layout(part)
        if opened is None:
            continue
        try:
            found = opened_problems(part, opened)
            if resumable and not any(p.severity == "error" for p in found):
                said = {(p.code, p.file, p.message) for p in found}
                found += [
                    p
                    for p in training_checks(opened, exact=exact)
                    if (p.code, p.file, p.message) not in said
                ]
        finally:
            opened.checkpoint.close()
        # this is the whole save: no rank folder is "one of several" here
        problems += [p for p in found if p.code != ONE_RANK]
    return problems


def refuse_reshard(source: Source) -> None:
    """Refuse (FormatError, exit 4) to reshard a legacy Megatron-LM save (`iter_N/`) or one of
    its rank folders (by names: nothing read).

    Megatron-LM loads each rank folder's `model_optim_rng.pt` and `distrib_optim.pt` whole,
    at the tensor × pipeline sizes its args record; a copy cut into size shards, or re-cut for
    another world size, is one no loader reads, and the distributed optimizer's flat buffers
    cannot be re-cut from names alone. Megatron-LM's own converter changes the sizes."""
    if source.target is not None:
        return
    from ...formats import holds_only_nested_checkpoints
    from . import folder_layout_of

    layout = folder_layout_of(source)
    if layout is not None:
        from .megatron_rank import MegatronRank

        if layout.name != MegatronRank.name:
            return
        what = "a rank folder of a legacy Megatron-LM save"
    else:
        if not holds_only_nested_checkpoints(source) or not rank_folders(source.files):
            return
        what = "a legacy Megatron-LM save (its mp_rank_* rank folders)"
    from ...errors import FormatError

    raise FormatError(
        f"is {what}: Megatron-LM loads each rank folder's model_optim_rng.pt (and "
        "distrib_optim.pt) whole, at the parallel sizes its args record, so a copy cut into "
        "shards or for another world size would load nowhere",
        path=source.location.raw,
        fix="Change its parallel sizes with Megatron-LM's tools/checkpoint/convert.py "
        "(--target-tensor-parallel-size / --target-pipeline-parallel-size), or save it as "
        "torch_dist (`--ckpt-convert-format torch_dist --ckpt-convert-save DIR`) and run "
        "`ckpt reshard DIR OUT --world-size N`; copy it as it is with `ckpt sync` or cp.",
    )
