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
from .metadata import CORRUPT_METADATA_FIX

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
#: Megatron-Core `dist_checkpointing` (`torch_dist` backend) writes these beside the DCP files
MEGATRON_COMMON = "common.pt"
MEGATRON_METADATA = "metadata.json"

_DATA_FIX = (
    "Copy the data file again from where the checkpoint was saved (`ckpt repair` rebuilds it "
    "where the checkpoint was protected), or use an earlier checkpoint of the run."
)
_MIXED_FIX = (
    "The folder mixes files of different saves, or one is corrupt: copy the checkpoint again "
    "from where it was saved, or use an earlier checkpoint of the run."
)
_COMMON_FIX = f"Copy {MEGATRON_COMMON} again from the save."
#: the fix of each problem a DCP (or Megatron-Core torch_dist) check finds, by its code
PROBLEM_FIXES = {
    "dcp_bad_chunk": CORRUPT_METADATA_FIX,
    "dcp_bad_planner_data": CORRUPT_METADATA_FIX,
    "dcp_chunk_out_of_bounds": CORRUPT_METADATA_FIX,
    "dcp_coverage": CORRUPT_METADATA_FIX,
    "dcp_hole": CORRUPT_METADATA_FIX,
    "dcp_overlap": CORRUPT_METADATA_FIX,
    "dcp_missing_storage": CORRUPT_METADATA_FIX,
    "dcp_interrupted": "The save did not finish: use the previous complete checkpoint "
    "(`ckpt latest RUN_DIR` names it), or save again.",
    "dcp_mismatch": _MIXED_FIX,
    "dcp_missing_file": _DATA_FIX,
    "dcp_truncated": _DATA_FIX,
    "megatron_backend": "Save it with Megatron-Core's torch_dist backend (`--ckpt-format "
    "torch_dist`), the one ckpt reads.",
    "megatron_common": _COMMON_FIX,
    "megatron_common_clash": "Check which value the run meant to keep: ckpt reads and "
    "converts the sharded one.",
    "megatron_metadata": f"Copy {MEGATRON_METADATA} again from the save (Megatron-Core "
    "writes it with the checkpoint).",
    "megatron_missing_common": _COMMON_FIX,
}


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
        """Record one problem, with the fix `PROBLEM_FIXES` gives its code."""
        self.problems.append(
            Problem(
                code=code,
                message=message,
                file=file,
                tensor=tensor,
                severity=severity,
                fix=PROBLEM_FIXES[code],
            )
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
