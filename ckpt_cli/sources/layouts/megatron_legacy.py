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

The whole save named as SRC (`iter_N/`) is `megatron_save`'s: it opens the rank folders and
reads the args through the run judge, both of which import this module.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ...errors import MissingRanksError

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
