"""What a multi-process save wrote and which rank's files it lost.

Every process of a DDP / FSDP / DeepSpeed run writes files of its own into a save: its RNG
states (`Layout.rank_files`), its part of a per-rank FSDP save, its DCP data files, its ZeRO
partition. No framework records the number of processes, so the save's own file names
(`saved_world`) and the save before it (`ranks_lost_since`) are what tell a lost file from a
smaller run. The problems found here are what `verify`, `latest` and `convert` act on
(`LOST_FILE_CODES`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ...errors import FormatError
from ...formats.base import Source
from ...models import Problem, ProblemList
from .base import Layout
from .composite import (
    FSDP_MODEL,
    RANK_MODEL_FILE,
    RANK_OPTIMIZER_FILE,
    Folder,
    numbered,
    rank_component,
)
from .save_before import LOST_SINCE_FIX

#: the numbers a file name may give a rank or an object (`random_states_N.pkl`,
#: `scheduler_N.bin`): the largest runs use about 100,000 processes, and every lower number is
#: checked for its file (a copy named for rank 10**11 made verify check 10**11)
MAX_FILE_NUMBER = 1 << 20


def check_file_number(number: int, file: str) -> None:
    """FormatError naming `file` when its name numbers a rank or object past `MAX_FILE_NUMBER`."""
    if number >= MAX_FILE_NUMBER:
        raise FormatError(
            f"is numbered {number:,} (a rank or an object), past the {MAX_FILE_NUMBER:,} ckpt "
            "checks every lower number of: no run writes it (a corrupt or crafted file name)",
            path=file,
            fix="Remove the file, or give it back the name its framework wrote, and run again.",
        )


def missing_rank_files(
    source: Source, folder: Folder, rank_state: re.Pattern[str] | None
) -> list[Problem]:
    """A per-rank FSDP save (`RANK_MODEL_FILE`, `RANK_OPTIMIZER_FILE`) must hold every rank's
    file of every model and optimizer: one problem per file missing. The world size is the
    highest rank any per-rank file names (`rank_state`: the layout's RNG files too), plus one."""
    groups: dict[tuple[str, int], dict[int, str]] = {}
    for obj, regex in (("model", RANK_MODEL_FILE), ("optimizer", RANK_OPTIMIZER_FILE)):
        for name in folder.matching(regex.pattern):
            match = regex.fullmatch(name)
            assert match is not None
            check_file_number(int(match.group(2)), source.storage.describe(folder.rel(name)))
            groups.setdefault((obj, int(match.group(1) or 0)), {})[int(match.group(2))] = name
    if not groups:
        return []
    ranks = {rank for files in groups.values() for rank in files}
    if rank_state is not None:
        for name in folder.names:
            match = rank_state.fullmatch(name)
            if match:
                ranks.add(int(match.group(1) or 0))
                check_file_number(max(ranks), source.storage.describe(folder.rel(name)))
    world = max(ranks) + 1
    problems: list[Problem] = []
    for (obj, index), files in sorted(groups.items()):
        sample = files[min(files)]
        for rank in range(world):
            if rank in files:
                continue
            name = re.sub(r"_rank\d+\.bin$", f"_rank{rank}.bin", sample)
            problems.append(
                Problem(
                    code="missing_rank_file",
                    message=f"is missing: {obj} {index}'s state was saved one file per rank "
                    f"(FSDP, {len(files)} of {world} ranks' files are here) and rank {rank}'s "
                    "part is in no other file, so the run cannot be resumed",
                    file=source.storage.describe(folder.rel(name)),
                    fix="Copy the file again from where the run saved it.",
                )
            )
    return problems


#: files in a save's sub-folders that one rank wrote, the rank in a group: DCP's
#: `FileSystemWriter` (`__{rank}_{i}.distcp`: FSDP's `pytorch_model_fsdp_0/`, `optimizer_0/`)
#: and DeepSpeed's ZeRO partitions (`zero_pp_rank_{dp_rank}_mp_rank_{mp}_optim_states.pt`)
_RANK_DATA_FILE = re.compile(
    r"__(\d+)_\d+\.distcp|(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt"
)


class SavedRanks(NamedTuple):
    """What a save's own file names say of the processes that made it (`saved_world`).

    Attributes:
        world: the fewest processes it was made by.
        why: the file that says so, and how.
        with_data: the ranks whose own data files are here (a per-rank FSDP file, a DCP
            sub-folder's `__{rank}_0.distcp`, a ZeRO partition): such a rank saved into
            this folder, so its RNG states belong here too.
    """

    world: int
    why: str
    with_data: frozenset[int]


def saved_world(source: Source, folder: Folder, layout: Layout) -> SavedRanks:
    """The fewest processes a save was made by, the file of the save that says so, and the
    ranks whose data files are here.

    Names only, nothing read. A file rank r wrote says there were at least r + 1: the
    layout's per-rank RNG files (`random_states_1.pkl`), accelerate's per-rank FSDP files
    (`*_rank1.bin`), a DCP sub-folder's data files (`__1_0.distcp`), DeepSpeed's ZeRO
    partitions; and a per-rank file named as the framework names it only when several
    processes save (the Trainer's `rng_state_0.pth`, `rng_state.pth` at one) says 2. Neither
    accelerate nor the Trainer records the world size itself: a plain multi-process save
    (DDP) that lost its highest rank's RNG file and nothing else looks like a smaller run's."""
    world, why = 1, ""
    with_data: set[int] = set()

    def saw(ranks: int, name: str, what: str) -> None:
        nonlocal world, why
        check_file_number(ranks - 1, source.storage.describe(folder.rel(name)))
        if ranks > world:
            world, why = ranks, f"{name} {what}"

    for name in sorted(folder.names):
        rank = layout.rank_file_rank(name)
        if rank is not None:
            saw(rank + 1, name, f"holds rank {rank}'s state")
            if name != layout.rank_file_name(rank, 1):
                saw(2, name, "is named as when several processes save")
        for regex in (RANK_MODEL_FILE, RANK_OPTIMIZER_FILE):
            match = regex.fullmatch(name)
            if match:
                with_data.add(int(match.group(2)))
                saw(int(match.group(2)) + 1, name, f"holds rank {match.group(2)}'s shard")
    for rel in sorted(source.files):
        rest = rel[len(folder.base) :] if rel.startswith(folder.base) else None
        if rest is None or "/" not in rest:
            continue
        match = _RANK_DATA_FILE.fullmatch(rest.rsplit("/", 1)[-1])
        if match:
            rank = int(match.group(1) or match.group(2))
            with_data.add(rank)
            saw(rank + 1, rest, f"holds rank {rank}'s data")
    return SavedRanks(world, why, frozenset(with_data))


#: the problem codes (at severity error) of a file a training save wrote and lost: a prepared
#: object's state (`missing_component`), a rank's part of a per-rank FSDP save
#: (`missing_rank_file`), a process's RNG states (`missing_rank_rng`), a DeepSpeed ZeRO rank's
#: partition (`missing_partition`). A command that writes the whole save again (`convert`,
#: `reshard`) must not publish it without them (`refuse_lost_files`)
LOST_FILE_CODES = (
    "missing_component",
    "missing_rank_file",
    "missing_rank_rng",
    "missing_partition",
)

#: how the layouts name the component of a file of a training save (`inspect`'s components):
#: (file name pattern, component pattern on its groups); a lost file is named so in `convert`'s
#: refusal and matched so by `--filter-out` (`lost_component`)
_LOST_COMPONENTS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), component)
    for pattern, component in (
        (r"(?:random_states|rng_state)_(\d+)\.(?:pkl|pth)", "rng_{0}"),
        (r"rng_state\.pth", "rng"),
        (r"custom_checkpoint_(\d+)\.pkl", "custom_{0}"),
        (r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", "optim_states_{0}"),
        (r"trainer_state\.json", "trainer_state"),
    )
)
_NUMBERED_FILE = re.compile(
    rf"(?P<stem>{FSDP_MODEL}|model|pytorch_model|optimizer|scheduler|sampler|dl_state_dict)"
    r"(?:_(?P<index>\d+))?(?:_rank(?P<rank>\d+))?(?:\.(?:bin|pt|safetensors))?"
)
_NUMBERED_COMPONENT = {
    FSDP_MODEL: "model",
    "pytorch_model": "model",
    "dl_state_dict": "dataloader",
}


def lost_component(rel: str) -> str:
    """The component a lost file of a training save (`LOST_FILE_CODES`, `rel` its path in the
    save) would be, as `inspect` names the components of a save that holds it: `rng_1` for
    `random_states_1.pkl` or `rng_state_1.pth`, `optimizer` for `optimizer_0/` or
    `optimizer.pt`, `scheduler_1` for `scheduler_1.bin`, `optim_states_1` for a ZeRO
    partition; the file's own stem for a name no layout numbers."""
    name = rel.rstrip("/").rsplit("/", 1)[-1]
    for pattern, component in _LOST_COMPONENTS:
        match = pattern.fullmatch(name)
        if match:
            return component.format(*match.groups())
    match = _NUMBERED_FILE.fullmatch(name)
    if match:
        comp = _NUMBERED_COMPONENT.get(match["stem"], match["stem"])
        index = int(match["index"] or 0)
        rank = match["rank"]
        return rank_component(comp, index, int(rank)) if rank else numbered(comp, index)
    return name.split(".", 1)[0]


#: the problem codes of a rank's RNG states file not in a multi-process save
#: (`missing_rank_states`): lost for certain, or perhaps on another node's disk
RANK_RNG_CODES = ("missing_rank_rng", "rank_rng_elsewhere")


def missing_rank_states(
    source: Source, folder: Folder, layout: Layout, *, every_save: bool | None = None
) -> list[Problem]:
    """Every process of a multi-process save writes its own RNG states (`Layout.rank_files`:
    accelerate's `random_states_{r}.pkl`, the Trainer's `rng_state_{r}.pth`): one problem per
    rank whose file is not here, as many ranks as the save's own files say it was made by
    (`saved_world`). Neither framework's loader fails without it: accelerate's `load_state`
    and the Trainer log a line and go on with the RNG as it is, so the resumed run is
    silently not the one it continues. None when the save holds no per-rank file at all (no
    RNG state: what `verify --exact` reports), unless the framework wrote them into this save
    (`every_save`; by default, when `Layout.last_file` is the per-rank file: accelerate's
    `save_state` writes them into every save): then every rank whose own data files are here
    (an FSDP folder's `__1_0.distcp`, a ZeRO partition) lost its file.

    `missing_rank_rng` (an error) when the file was lost for certain: the rank's own data
    files are here, or ranks on both sides of it saved theirs here. Otherwise
    `rank_rng_elsewhere` (a warning): a save with `save_on_each_node` on node-local disks
    holds its own node's ranks' files only (node 1's folder has `random_states_1.pkl` and no
    `random_states_0.pkl`), which its names cannot tell from a lost file; `prune
    --incomplete` must never delete such a save."""
    if layout.rank_files is None:
        return []
    have = {r for r in map(layout.rank_file_rank, folder.names) if r is not None}
    if every_save is None:
        every_save = layout.last_file is not None and bool(
            layout.last_file.fullmatch(layout.rank_file_name(0, 1))
        )
    if not have and not every_save:
        return []
    saved = saved_world(source, folder, layout)
    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    for rank in range(saved.world):
        if rank in have or (not have and rank not in saved.with_data):
            continue  # with none here, only a rank's own data files say it saved here
        file = source.storage.describe(folder.rel(layout.rank_file_name(rank, saved.world)))
        loss = (
            f"{layout.name}'s loader restores none for rank {rank} without this file (it logs "
            "a line and goes on), so a resumed run silently draws other random numbers "
            "(dropout, sampling) than the run it continues"
        )
        if rank in saved.with_data or min(have) < rank < max(have):
            evidence = (
                f"rank {rank}'s own data files are here"
                if rank in saved.with_data
                else f"ranks {min(have)} and {max(have)} saved theirs here"
            )
            problems.append(
                Problem(
                    code="missing_rank_rng",
                    message=f"is missing: the save's own files say {saved.world} processes "
                    f"load it (at least: {saved.why}), each its own RNG states, and "
                    f"{evidence}; {loss}",
                    file=file,
                    fix="Copy the file again from where the run saved it, or resume from "
                    "another save of the run (`ckpt latest RUN_DIR` names the newest whole "
                    "one); a folder re-cut for more ranks by `ckpt reshard --rank-state keep` "
                    "has none for the new ranks (`--rank-state replicate` gives them rank 0's), "
                    "one re-cut with `--rank-state drop` none at all.",
                )
            )
        else:
            problems.append(
                Problem(
                    code="rank_rng_elsewhere",
                    severity="warning",
                    message=f"is not here: the save's own files say {saved.world} processes "
                    f"load it (at least: {saved.why}), each its own RNG states; this one was "
                    "lost, or written to another node's disk (a save with `save_on_each_node` "
                    "on node-local disks holds its own node's ranks' files only), which the "
                    f"names cannot tell apart. Resumed from this folder alone, {loss}",
                    file=file,
                    fix="On node-local disks, resume each node from its own folder; otherwise "
                    "copy the file again from where the run saved it, or resume from another "
                    "save of the run.",
                )
            )
    return problems


def ranks_lost_since(
    source: Source, folder: Folder, layout: Layout, older: str, older_names: set[str]
) -> list[Problem]:
    """`missing_rank_rng` for each per-rank RNG file (`Layout.rank_files`) that the run's save
    before this one (`older`, holding the files `older_names`) holds and this save's own files
    leave in doubt:

    - a rank above the highest this save's own files name (`saved_world`): a plain
      multi-process save (DDP) that lost its highest rank's file looks like a smaller run's
      on its own, since neither accelerate nor the Trainer records the number of processes;
      a run resumed with fewer processes has its first save after the change so reported;
    - a rank below the world its own files say (rank 0's `random_states_0.pkl` beside rank
      1's; the Trainer's `rng_state_1.pth` beside an `rng_state_0.pth`, which only a
      multi-process run writes): a smaller run still has that rank and writes its file, and
      alone the save looks like one node's folder of a `save_on_each_node` run on node-local
      disks (`rank_rng_elsewhere`), whose save before it holds no other node's files either.

    A rank between two here, or with its own data files here, is `missing_rank_states`' (lost
    whatever the save before holds). `finish` keeps this problem, not the doubt, for the file.
    None when this save holds no per-rank file (no RNG state at all: `verify --exact` says so),
    or only the one a framework names so at one process only (the Trainer's `rng_state.pth`:
    a run resumed on one process).
    """
    if layout.rank_files is None:
        return []
    own = {name for name in folder.names if layout.rank_file_rank(name) is not None}
    if not own:
        return []
    alone = layout.rank_file_name(0, 1)
    if own == {alone} and alone != layout.rank_file_name(0, 2):
        # named as only a one-process save names it (the Trainer's `rng_state.pth`): a run
        # resumed on one process, whole whatever the save before holds
        return []
    have = {r for r in map(layout.rank_file_rank, own) if r is not None}
    saved = saved_world(source, folder, layout)
    held = {r for r in map(layout.rank_file_rank, older_names) if r is not None}
    ranks = sorted(
        r
        for r in held - have
        if r >= saved.world or not (r in saved.with_data or min(have) < r < max(have))
    )
    world = max(held | have) + 1
    fewer = (
        " If the run was resumed with fewer processes before this save, the save is whole "
        "(nothing records the number of processes; the run's next save is judged against "
        "this one)."
    )
    return [
        Problem(
            code="missing_rank_rng",
            message=f"is missing: rank {rank}'s RNG states, which the save before it "
            f"({older}) holds: the run saved with {world} processes, each its own; "
            f"{layout.name}'s loader restores none for the rank without it (it logs a line "
            "and goes on), so a resumed run silently draws other random numbers than the "
            "run it continues",
            file=source.storage.describe(folder.rel(layout.rank_file_name(rank, world))),
            fix=LOST_SINCE_FIX
            # a run of any number of processes has a rank 0: only a rank above can be gone
            + (fewer if rank >= saved.world else ""),
        )
        for rank in ranks
    ]
