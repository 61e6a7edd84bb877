"""The report of `ckpt reshard` (both modes), and its per-rank training-state entries."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..distributed import RankShare
from ..models import FileInfo

RankStateAction = Literal["carry", "drop", "keep"]


class RankStateEntry(BaseModel):
    """A per-rank training-state entry (RNG stream, data-loader position...)."""

    name: str
    rank: int
    kind: str
    nbytes: int


class ReshardReport(BaseModel):
    """The result of `ckpt reshard`.

    Attributes:
        mode: `shard-size` or `world-size`.
        source / destination: what was read and where the output was published.
        format: format of both source and output.
        files: the files written, with sizes.
        tensors / objects: entries written.
        tensor_bytes: tensor bytes written.
        raw_copy: tensors copied as raw bytes, without deserialising (shard-size mode).
        max_shard_size: the shard limit in bytes (shard-size mode).
        source_world_size / world_size: ranks before and after (world-size mode).
        serialization: DCP serialization of the output.
        sharded: tensors split across ranks, by dim (`{"0": 12, "1": 4}`).
        replicated: tensors written once, whole (0-dim, `replicate` rules).
        rules: the placement rules applied, in order.
        unused_rules: rules that matched no tensor (a typo in a glob, most likely).
        rank_state: per-rank training-state entries found in the source.
        rank_state_action: `carry` (same world size), `keep`, `drop`, or None when there is none.
        verified: the output passed the format's structural check before publishing.
        dry_run: nothing was written; `files` are what would be (sizes are data bytes for
            DCP outputs, exact file sizes for safetensors).
        carried: training-state files of a training folder (optimizer, scheduler, RNG,
            trainer state...) copied unchanged beside the resharded weights (shard-size mode).
        extras: non-weight files of the source folder copied unchanged (`config.json`,
            tokenizer files...); empty with `extras=False`.
        warnings: things the user should know about the output (a DCP torch cannot load).
    """

    mode: Literal["shard-size", "world-size"]
    source: str
    destination: str
    format: str
    files: list[FileInfo] = Field(default_factory=list)
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    raw_copy: int = 0
    max_shard_size: int | None = None
    source_world_size: int | None = None
    world_size: int | None = None
    serialization: str | None = None
    sharded: dict[str, int] = Field(default_factory=dict)
    replicated: int = 0
    rules: list[str] = Field(default_factory=list)
    unused_rules: list[str] = Field(default_factory=list)
    rank_state: list[RankStateEntry] = Field(default_factory=list)
    rank_state_action: RankStateAction | None = None
    verified: bool = False
    ranks: list[RankShare] = Field(default_factory=list)
    dry_run: bool = False
    carried: list[str] = Field(default_factory=list)
    extras: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
