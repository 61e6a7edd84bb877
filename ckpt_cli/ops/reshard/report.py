"""The report of `ckpt reshard` (both modes): per-rank training state (entries and files), the
DCP folders re-cut inside a training folder, and the resume verdict after a world-size change."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...dist.command import RankShare
from ...models import FileInfo, Record
from ..shared.transfer import SkippedEntry

#: what happens to per-rank state (RNG streams, data-loader positions) in a world-size reshard:
#: `carry` (same world size), `keep` (as saved), `drop` (left out), `replicate` (each new rank
#: gets its own state where it had one, else a copy of rank 0's)
RankStateAction = Literal["carry", "drop", "keep", "replicate"]
#: what a user may ask for (`--rank-state`)
RankStateChoice = Literal["drop", "keep", "replicate"]


class RankStateEntry(Record):
    """A per-rank training-state entry (RNG stream, data-loader position...).

    Attributes:
        name / rank / kind / nbytes: the source entry and the rank it belongs to.
        written: the output entries it became (its own name, plus copies for new ranks with
            `replicate`); empty when it was left out; None before a plan decided.
    """

    name: str
    rank: int
    kind: str
    nbytes: int
    written: list[str] | None = None


class RankFile(Record):
    """What a world-size reshard did with one per-rank file of a training folder.

    Attributes:
        path: the source file (`rng_state_1.pth`), relative to the folder.
        rank: the rank it belongs to.
        action: `carried` (same name), `copied` (to `written`, another rank's name), `dropped`.
        written: the output files it became (several when `replicate` copies rank 0's).
    """

    path: str
    rank: int
    action: Literal["carried", "copied", "dropped"]
    written: list[str] = Field(default_factory=list)


class ReshardedPart(Record):
    """One DCP folder of a training folder, re-cut for the new world size.

    Attributes:
        path: the sub-folder (`pytorch_model_fsdp_0/`), relative to the training folder.
        component: the component it holds (`model`, `optimizer`).
        source_world_size: how many ranks wrote it.
        tensors / objects / tensor_bytes: what was written into it.
    """

    path: str
    component: str
    source_world_size: int
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0


class ResumeVerdict(Record):
    """Whether the output resumes the run, and whether bit-identically, with the reasons.

    Attributes:
        resumable: training continues from the output (weights and optimizer state complete).
        exact: it continues as the saved run would have (same data order and RNG streams);
            never after a world-size change.
        reasons: why not `exact` (or not `resumable`), one sentence each.
    """

    resumable: bool
    exact: bool
    reasons: list[str] = Field(default_factory=list)


class ReshardReport(Record):
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
        partitioning: what a world-size reshard re-cut: `chunks` (DCP chunks) or `zero`
            (DeepSpeed's ZeRO partitions, written as an N-rank engine saves them: DeepSpeed
            resumes the output at N ranks with the same config); None in shard-size mode.
        sharded: tensors split across ranks, by dim (`{"0": 12, "1": 4}`).
        replicated: tensors written once, whole (0-dim, `replicate` rules).
        rules: the placement rules applied, in order.
        unused_rules: rules that matched no tensor (a typo in a glob, most likely).
        rank_state: per-rank training-state entries found in the source.
        rank_state_action: `carry` (same world size), `keep`, `drop`, `replicate`, or None
            when there is none.
        layout: the training layout of a whole folder resharded (`hf-trainer`), else None.
        parts: the DCP folders of that training folder re-cut for the new world size.
        rank_files: what happened to each per-rank file of that folder (`rng_state_1.pth`).
        skipped: source files not written, with why (a stale parity folder...).
        resume: the resume verdict of the output (world-size mode, when SRC holds a run).
        verified: the output passed the format's structural check before publishing.
        dry_run: nothing was written; `files` are what would be (sizes are data bytes for
            DCP outputs, exact file sizes for safetensors).
        carried: files of a training folder copied unchanged beside the resharded weights
            (shard-size mode: optimizer, scheduler, RNG, trainer state...; world-size mode:
            everything but the DCP folders and the per-rank files).
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
    partitioning: Literal["chunks", "zero"] | None = None
    sharded: dict[str, int] = Field(default_factory=dict)
    replicated: int = 0
    rules: list[str] = Field(default_factory=list)
    unused_rules: list[str] = Field(default_factory=list)
    rank_state: list[RankStateEntry] = Field(default_factory=list)
    rank_state_action: RankStateAction | None = None
    layout: str | None = None
    parts: list[ReshardedPart] = Field(default_factory=list)
    rank_files: list[RankFile] = Field(default_factory=list)
    skipped: list[SkippedEntry] = Field(default_factory=list)
    resume: ResumeVerdict | None = None
    verified: bool = False
    ranks: list[RankShare] = Field(default_factory=list)
    dry_run: bool = False
    carried: list[str] = Field(default_factory=list)
    extras: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
