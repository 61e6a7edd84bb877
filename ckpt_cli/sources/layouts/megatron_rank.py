"""One rank folder of a legacy Megatron-LM save (`iter_N/mp_rank_TT[_PPP][_EEE]/`), named alone.

Megatron-LM's legacy `save_checkpoint` (`--ckpt-format torch`) has each model-parallel rank
write `model_optim_rng.pt` into its rank folder: the run's `args`, the rank's model shard, its
optimizer's state dict, the LR scheduler and RNG states (`megatron_legacy` says which rank
folders a whole save holds). With `--use-distributed-optimizer` the optimizer's state dict
holds the param groups alone, and megatron-core's `DistributedOptimizer.save_parameter_state`
writes the rank's fp32 master weights and Adam moments, gathered over its data-parallel group,
to `distrib_optim.pt` beside it; `load_checkpoint` reads both.

I/O: both files are opened by the torch format (headers and pickle only, weights_only, no
tensor data). `model_optim_rng.pt` is the root component: its entries keep the names they
have when the file is read alone (`model.decoder...`, `optimizer.param_groups...`), and
`distrib_optim.pt`'s are `distrib_optim.<buffer>.<dtype>.param`... The parallel sizes and the
optimizer flags come from the `args` entry, read as inert data.

A rank folder holds one rank's slices of the model, never the whole: `missing` says so (a
warning, naming the command that checks the whole save) when its args record several rank
folders, and the opened source carries it as `OpenedSource.part_of`, so an export to a
framework naming (`convert --to hf`), which would write one rank's slices as the model, is
refused. A rank folder whose args call for `distrib_optim.pt` and that lacks it is not
resumable (`missing`: an error naming the file).
"""

from __future__ import annotations

from typing import Any

from ...formats.base import Source
from ...models import OptimizerState, Problem, TrainingState
from .base import Layout, OpenedSource
from .composite import Folder, component_files
from .megatron_legacy import (
    DISTRIB_OPTIM,
    DISTRIB_OPTIM_FIX,
    FLAG_KEYS,
    RANK_FILE,
    RANK_FOLDER,
    SIZE_KEYS,
    holds_distrib_optim,
    missing_distrib_optim_text,
    rank_text,
)
from .training import finish, value_of

#: the component `model_optim_rng.pt` is read as (its entries keep their own names)
_RANK = "model_optim_rng"
#: the component `distrib_optim.pt` is read as
_DISTRIB = "distrib_optim"
#: what the distributed optimizer keeps per parameter buffer (`get_parameter_state_dp_zero`)
_DISTRIB_STATES = ["param", "exp_avg", "exp_avg_sq"]
#: the problem code of a rank folder named alone
ONE_RANK = "one_rank_folder"


def saved_args(opened: Any) -> dict[str, Any]:
    """The attributes of the `args` (`argparse.Namespace`) a rank file records, as read inert
    (`{"__class__": "argparse.Namespace", "state": {...}}`); empty when there are none."""
    if isinstance(opened, dict):
        state = opened.get("state")
        if isinstance(state, dict):
            return state
    return {}


def _sizes_and_flags(args: dict[str, Any]) -> tuple[dict[str, int], dict[str, bool]]:
    sizes = {
        k: v for k in SIZE_KEYS if isinstance(v := args.get(k), int) and not isinstance(v, bool)
    }
    flags = {k: v for k in FLAG_KEYS if isinstance(v := args.get(k), bool)}
    return sizes, flags


class MegatronRank(Layout):
    """A legacy Megatron-LM rank folder: `model_optim_rng.pt`, and `distrib_optim.pt` with the
    distributed optimizer (see the module docstring)."""

    name = "megatron-legacy"

    def recognise(self, source: Source) -> bool:
        return RANK_FILE in Folder(source).names

    def open(self, source: Source) -> OpenedSource | None:
        from .torch_dict import analyse_single

        folder = Folder(source)
        rank = folder.add(_RANK, RANK_FILE, "torch")
        if folder.has(DISTRIB_OPTIM):
            folder.add(_DISTRIB, DISTRIB_OPTIM, "torch")
        checkpoint = folder.composite(self.name, root=_RANK)
        args = saved_args(value_of(checkpoint, "args")) if rank is not None else {}
        sizes, flags = _sizes_and_flags(args)
        state = (analyse_single(checkpoint) if rank is not None else None) or TrainingState(
            layout=self.name
        )
        state.layout = self.name
        state.prefixes.pop(_DISTRIB, None)
        state.components = component_files(folder)
        distributed = holds_distrib_optim(flags)
        if _DISTRIB in folder.components:
            # the distributed optimizer's moments and master weights: its state, whatever
            # the param groups in model_optim_rng.pt say (they hold no per-parameter state)
            kind = state.optimizer.kind if state.optimizer is not None else None
            state.optimizer = OptimizerState(
                kind=f"{kind or 'Adam'} (distributed optimizer)",
                states=list(_DISTRIB_STATES),
                source=DISTRIB_OPTIM,
            )
            state.prefixes["optimizer"] = f"{_DISTRIB}."
        elif distributed:
            state.optimizer = None  # its param groups alone: no state to resume from
        if state.step is None:
            step = value_of(checkpoint, "iteration")
            if isinstance(step, int) and not isinstance(step, bool):
                state.step = step
        folder.problems.extend(self._missing(source, folder, sizes, flags))
        opened = finish(checkpoint, state, folder)
        name = source.location.raw.rstrip("/").rsplit("/", 1)[-1]
        if RANK_FOLDER.fullmatch(name) is None:
            name = "this rank folder"
        opened.part_of = rank_text(name, sizes)
        return opened

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """`distrib_optim.pt` when the args call for it, and a warning that a rank folder of
        several is one rank's slices (see `open`, which reads the args first)."""
        rank = folder.components.get(_RANK)
        args = saved_args(value_of(rank, "args")) if rank is not None else {}
        sizes, flags = _sizes_and_flags(args)
        return self._missing(source, folder, sizes, flags)

    def _missing(
        self,
        source: Source,
        folder: Folder,
        sizes: dict[str, int],
        flags: dict[str, bool],
    ) -> list[Problem]:
        where = source.location.raw.rstrip("/")
        problems = []
        if holds_distrib_optim(flags) and not folder.has(DISTRIB_OPTIM):
            problems.append(
                Problem(
                    code="missing_optimizer",
                    message=missing_distrib_optim_text([DISTRIB_OPTIM]),
                    file=f"{where}/{DISTRIB_OPTIM}",
                    fix=DISTRIB_OPTIM_FIX,
                )
            )
        name = where.rsplit("/", 1)[-1]
        told = rank_text(name if RANK_FOLDER.fullmatch(name) else "this rank folder", sizes)
        if told is not None:
            parent = where.rsplit("/", 1)[0] if "/" in where else "."
            problems.append(
                Problem(
                    code="one_rank_folder",  # ONE_RANK
                    severity="warning",
                    message=f"{told}: only this rank's files were checked",
                    file=where,
                    fix=f"Check the whole save with `ckpt verify {parent}` (every rank "
                    f"folder, {DISTRIB_OPTIM} included); `ckpt latest` of the run folder "
                    "names the newest complete save.",
                )
            )
        return problems
