"""The record ckpt's own `Checkpointer` writes into every save: the DCP entry `__ckpt__`.

`ckpt_cli.checkpointer.state` writes and reads it (its names come from here); `reshard
--world-size` reads the names to tell ckpt's bookkeeping from the user's per-rank state, and
cuts the bookkeeping for the new world size itself, so a Checkpointer save needs no
`--rank-state` for entries only ckpt wrote. Names only: nothing is read, no torch.

| entry (flattened DCP name) | what it holds | across a world-size reshard |
|---|---|---|
| `__ckpt__.layout` | the record's layout version | carried |
| `__ckpt__.world_size` | the world size the save is laid out for | the new one |
| `__ckpt__.step` | the training step saved (`save`'s own argument; older saves lack it) | carried |
| `__ckpt__.shapes.rank-R` | the shapes of rank R's Stateful states and plain values (JSON) | kept for ranks below the new world size; a new rank gets a copy of the shapes of the rank its values are copied from (`--rank-state replicate`), else of the lowest rank's |
| `__ckpt__.ranks.rank-R.NAME` | rank R's own plain values (RNG states, counters) and Stateful states (a data loader's; an LR scheduler's is saved once), R >= 1 | the user's per-rank state: as `--rank-state` says |

Rank 0's plain values and Stateful states are saved under their own names, never under the
record. A rank whose Stateful states are not there (`--rank-state drop`, a new rank without
`replicate`; saves older than the per-rank states) loads rank 0's, and gets rank 0's shapes
unless `replicate` copied another rank's, so its int dict keys and empty containers come back
as saved. Its plain values are not there unless `--rank-state replicate` copied them;
`load_latest` then names them.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

#: the save's own record: the layout version and the world size that wrote it
RECORD_KEY = "__ckpt__"
#: the layout version the record names (1: plain values keyed by rank)
LAYOUT = 1
#: the world size the save is laid out for
WORLD_SIZE = f"{RECORD_KEY}.world_size"
#: the training step saved (a loop's state need hold no counter of its own)
STEP = f"{RECORD_KEY}.step"

_SHAPES = re.compile(rf"^{RECORD_KEY}\.shapes\.rank-(\d+)$")
_VALUES_PREFIX = f"{RECORD_KEY}.ranks."


def rank_name(rank: int) -> str:
    """The record's name for `rank` (`rank-1`)."""
    return f"rank-{rank}"


def rank_path(rank: int) -> tuple[str, ...]:
    """Where the plain values of `rank` are saved: their own names for rank 0, else under the
    record (`__ckpt__.ranks.rank-1.rng.torch`)."""
    return () if rank == 0 else (RECORD_KEY, "ranks", rank_name(rank))


def shapes_path(rank: int) -> tuple[str, ...]:
    """Where the shapes of `rank`'s entries are recorded."""
    return (RECORD_KEY, "shapes", rank_name(rank))


def shapes_rank(name: str) -> int | None:
    """The rank whose shapes the entry `name` records (`__ckpt__.shapes.rank-2` -> 2), else None."""
    match = _SHAPES.match(name)
    return int(match.group(1)) if match else None


def is_bookkeeping(name: str) -> bool:
    """Whether the entry `name` is ckpt's own bookkeeping: the record but the users' values."""
    return (name == RECORD_KEY or name.startswith(f"{RECORD_KEY}.")) and not name.startswith(
        _VALUES_PREFIX
    )


def never_read(name: str) -> bool:
    """Whether `name` would be rank 0's values under the record, which the Checkpointer never
    reads (rank 0 keeps its own under their names): a per-rank copy must not be made there."""
    return name.startswith(f"{_VALUES_PREFIX}{rank_name(0)}.")


@dataclass(frozen=True)
class RecordCut:
    """What a world-size reshard does to the record: entries left out, entries added (new name
    -> the entry it is a copy of) and object entries written with another value."""

    drop: frozenset[str] = frozenset()
    added: dict[str, str] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)


def cut_record(names: Collection[str], world_size: int, values_from: int | None) -> RecordCut:
    """The record of a save with the entries `names`, for `world_size` ranks.

    `values_from`: the rank whose plain values the new ranks get copies of
    (`--rank-state replicate`), whose shapes they then get too; else they get the lowest rank's.
    A save without the record gets nothing.
    """
    shapes = {rank: name for name in names if (rank := shapes_rank(name)) is not None}
    if not shapes:
        return RecordCut()
    source = values_from if values_from in shapes else min(shapes)
    drop = frozenset(name for rank, name in shapes.items() if rank >= world_size)
    added = {
        f"{RECORD_KEY}.shapes.{rank_name(rank)}": shapes[source]
        for rank in range(world_size)
        if rank not in shapes
    }
    values = {WORLD_SIZE: world_size} if WORLD_SIZE in names else {}
    return RecordCut(drop=drop, added=added, values=values)
