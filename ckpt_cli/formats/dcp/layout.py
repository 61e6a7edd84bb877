"""The shared vocabulary of the DCP package: file names, the layout record, rank naming."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from ...dist.placement import Box
from ...errors import FormatError
from ...models import Chunk, Entry, Problem, ProblemList
from ...problems import Severity
from ..names import DCP_DATA_SUFFIX, DCP_METADATA
from ..safetensors.format import DCP_HF_SHARD

METADATA = DCP_METADATA
SUFFIX = DCP_DATA_SUFFIX
SERIALIZATIONS = ("torch_save", "safetensors")
RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: per-rank metadata of `dcp.save(..., use_collectives=False)` (no global `.metadata`)
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
#: safetensors metadata keys torch's DCP writer puts in each embedded blob
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_MAX_HEADER = 100 << 20
ZIP_MAGIC = b"PK\x03\x04"


@functools.cache
def rank_file(rank: int) -> str:
    """The data file DCP's FileSystemWriter gives rank `rank` (single file per rank).

    One string per rank, shared by every chunk planned into it (a plan for 1,024 ranks holds
    a million chunks)."""
    return f"__{rank}_0{SUFFIX}"


_ZEROS: dict[int, list[int]] = {}


def zeros(n: int) -> list[int]:
    """One shared list of `n` zeros: the offsets of every chunk that starts a tensor.

    Chunks are never changed once built, so every such chunk (of a plan, or read from
    `.metadata`) holds this one list, not a list of its own (#30: 100,000 entries)."""
    shared = _ZEROS.get(n)
    if shared is None:
        shared = _ZEROS[n] = [0] * n
    return shared


def rank_chunk(rank: int, box: Box) -> Chunk:
    """The chunk `box` as rank `rank` writes it, into its own `rank_file` (bytes not yet placed)."""
    # a placement box holds non-negative ints by construction: nothing to validate
    return Chunk(list(box.offsets), list(box.sizes), rank_file(rank), 0, 0)


#: a chunk as `.metadata` lists it: (offsets, sizes, file, byte offset, byte length)
PendingChunk = tuple[list[int], list[int], str, int, int]
#: a tensor as `.metadata` lists it: (fqn, dtype, shape, chunks)
PendingTensor = tuple[str, str, list[int], list[PendingChunk]]


@dataclass
class Layout:
    """What `.metadata` plus the file listing (plus embedded safetensors headers) say."""

    entries: list[Entry] = field(default_factory=list)
    #: at most `MAX_EXAMPLES` of each code, the rest counted (see `ProblemList`)
    problems: list[Problem] = field(default_factory=ProblemList)
    serialization: set[str] = field(default_factory=set)
    files: dict[str, int] = field(default_factory=dict)
    planner_data: Any = None
    version: str | None = None
    #: Megatron-Core torch_dist: metadata.json's backend fields and common.pt's keys
    megatron: dict[str, Any] | None = None
    #: (file, byte offset) -> stream transform of items stored through one (`zstd`)
    transforms: dict[tuple[str, int], str] = field(default_factory=dict)

    def problem(
        self,
        code: str,
        message: str,
        file: str | None = None,
        tensor: str | None = None,
        severity: Severity = "error",
    ) -> None:
        self.problems.append(
            Problem(code=code, message=message, file=file, tensor=tensor, severity=severity)
        )


def is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def int_list(value: Any) -> list[int] | None:
    """`value` as a list of non-negative ints, or None when it is anything else."""
    if isinstance(value, (tuple, list)) and all(map(is_count, value)):
        return list(value)
    return None


class InterruptedSaveError(FormatError):
    """A DCP folder with data files but no `.metadata`: the save did not finish (exit 4)."""

    code = "dcp_interrupted"


def world_size(layout: Layout) -> int:
    ranks = set()
    names = {c.file for e in layout.entries for c in (e.chunks or [])}
    names |= {e.file for e in layout.entries if e.file is not None}
    names |= {n for n in layout.files if "/" not in n and n.endswith(SUFFIX)}
    for name in names:
        match = RANK_FILE.match(name)
        if match:
            ranks.add(int(match.group(1)))
        hf = DCP_HF_SHARD.match(name)
        if hf:
            ranks.add(int(hf.group(1)) - 1)
    return max(ranks) + 1 if ranks else len(names)
