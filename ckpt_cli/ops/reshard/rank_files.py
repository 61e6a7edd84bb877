"""The files a training folder keeps per rank, and the verbatim copies, when it is re-cut.

Shared by the two folder reshards (`folder.py`: DCP sub-folders; `zero.py`: a DeepSpeed ZeRO
tag folder): what each per-rank file (`rng_state_{r}.pth`, `random_states_{r}.pkl`) becomes
under `--rank-state`, the note for the ranks of a new world that find none, and the block-wise
copy of every file carried unchanged; and the `ckpt-reshard.json` a cut for another world
size writes (the world size the run saved it at, which `verify` reads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...formats.base import Source
from ...formats.names import RESHARD_RECORD
from ...models import FileInfo
from ...sizes import counted
from ...sources.layouts.base import Layout
from .report import RankFile, RankStateAction


def rank_file_plan(
    layout: Layout, rank_files: dict[str, int], action: RankStateAction | None, world_size: int
) -> list[RankFile]:
    """What each per-rank file becomes under `action` (see `reshard_folder`)."""
    if not rank_files:
        return []
    plan = {
        rel: RankFile(path=rel, rank=rank, action="carried", written=[rel])
        for rel, rank in rank_files.items()
    }
    if action == "drop":
        for item in plan.values():
            item.action, item.written = "dropped", []
    elif action == "replicate":
        by_rank = {rank: rel for rel, rank in sorted(rank_files.items(), key=lambda kv: kv[1])}
        first = by_rank[min(by_rank)]
        for item in plan.values():
            item.written = []
        for rank in range(world_size):
            plan[by_rank.get(rank, first)].written.append(layout.rank_file_name(rank, world_size))
        for item in plan.values():
            item.action = (
                "carried" if item.path in item.written else "copied" if item.written else "dropped"
            )
    return list(plan.values())


def missing_rank_files(
    layout: Layout,
    files_out: list[RankFile],
    rank_files: dict[str, int],
    world_size: int,
    before: int,
) -> list[str]:
    """The resume note for the ranks of the new world that find no per-rank file."""
    if not rank_files or world_size == before:
        return []
    written = {n for item in files_out for n in item.written}
    missing = [
        layout.rank_file_name(r, world_size)
        for r in range(world_size)
        if layout.rank_file_name(r, world_size) not in written
    ]
    if not missing:
        return []
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    ranks = counted(world_size, "rank")
    return [
        f"at {ranks} the framework looks for {shown}, which the output does not "
        "hold: those ranks start with fresh RNG state"
    ]


def copy_verbatim(source: Source, rel: str, target: Path) -> None:
    """Copy one source file to `target`, a block at a time (a large optimizer.pt of a DDP
    save never sits in memory whole)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    local = source.storage.local_path(rel)
    if local is not None:
        shutil.copyfile(local, target)
        return
    with source.storage.open(rel) as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, 8 << 20)


def reshard_record(
    source: Source, before: int, after: int, action: str | None, rel: str = RESHARD_RECORD
) -> bytes | None:
    """The `ckpt-reshard.json` a world-size cut of `source` (from `before` ranks to `after`)
    writes into its output at `rel`, or None when the world size stays. It names the world size
    the run saved the folder at (an earlier cut's record at `rel` says it, else `before`), which
    `verify` and `inspect` read: a resume at another world size is never exact."""
    if before == after:
        return None
    # imported here: the plain DCP re-cut (`world.py`) loads no training layout until it cuts
    # a training save (start-up)
    from ...sources.layouts.training import resharded

    earlier = resharded(source, rel)
    # an earlier cut's record that cannot be read: the world size the run saved it at is
    # unknown (null), never the one this cut starts from
    saved = before if earlier is None else earlier["saved_world_size"] or None
    record = {
        "ckpt_reshard": 1,
        "saved_world_size": saved,
        "source_world_size": before,
        "world_size": after,
        "rank_state": action,
    }
    return (json.dumps(record, indent=2) + "\n").encode()


def with_record(
    files: list[FileInfo], record: bytes | None, rel: str = RESHARD_RECORD
) -> list[FileInfo]:
    """`files` (what a re-cut wrote or would write) with `record` at `rel`, in place of one
    carried from the source (an older cut's)."""
    if record is None:
        return files
    kept = [f for f in files if f.path != rel]
    return [*kept, FileInfo(path=rel, size=len(record))]
