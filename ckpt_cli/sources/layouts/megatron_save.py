"""A whole legacy Megatron-LM save (`iter_N/` and its `mp_rank_*/` rank folders) named as SRC:
one checkpoint to inspect, convert, verify; refused to reshard.

`megatron_legacy` says, by names, which rank folders a save must hold; `megatron_rank` opens one
rank folder. This module sits above both (and above the run judge, which reads the args of the
lowest rank's file by its pickle opcodes and reads the run folder's tracker): it is what the door
(`sources.opening`) and the operations import, inside the branch that meets such a save (a folder
holding checkpoint files in its subfolders alone), so a plain model never loads it (start-up
#30). It is no module of `megatron_legacy` because those two import that one.

I/O: names first (`whole_save`: the listing, the lowest rank's `args` by pickle opcodes, the
tracker's few bytes); `open_save` opens each rank folder as `megatron_rank` opens one alone
(headers and pickle metadata, weights_only, no tensor data) and reads them as one composite,
its entries under `<rank folder>.`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ...errors import MissingRanksError, UnsafeInputError
from ...formats.base import Source
from ...models import FileInfo, Problem
from ...sizes import counted
from .megatron_legacy import (
    DISTRIB_OPTIM,
    EP,
    MISSING_RANKS_FIX,
    PP,
    RANK_FILE,
    RANK_FOLDER,
    TP,
    missing_ranks_text,
    rank_folders,
    refuse_missing_ranks,
    sizes_text,
)

if TYPE_CHECKING:
    from .base import OpenedSource
    from .megatron_legacy import MissingRanks


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
    found = megatron_missing_ranks(save.storage, "", save.files)
    refuse_linked_out(save, found)
    refuse_missing_ranks(save.location.raw, found)
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
        description=f"legacy Megatron-LM save, {grid}: {counted(len(ranks), 'rank folder')}{step}",
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

    found = megatron_missing_ranks(source.storage, "", source.files)
    refuse_linked_out(source, found)
    refuse_missing_ranks(source.location.raw, found)


def refuse_linked_out(save: Source, found: MissingRanks | None) -> None:
    """Refuse (`UnsafeInputError`, exit 4) a legacy save whose missing rank folder is a link
    out of it: the listing walks no link out, so it read as lost, and the fix said to restore
    it from the node that wrote it; it is there, where ckpt reads nothing."""
    if found is None:
        return
    # one lstat a name, for the first 1,024 (args may call for a million folders, none here)
    out = save.storage.links_out(found.missing[:1024])
    if not out:
        return
    name, where = next(iter(out.items()))
    more = f" (and {len(out) - 1:,} more rank folders)" if len(out) > 1 else ""
    at = save.storage.describe(name)
    raise UnsafeInputError(
        f"rank folder {name}/ is a link that points outside the save ({where}){more}: ckpt "
        "reads no path out of the checkpoint it was given",
        path=at,
        fix=f"Copy the rank folder in instead of linking it (`rm {at} && cp -r {where} {at}`).",
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
