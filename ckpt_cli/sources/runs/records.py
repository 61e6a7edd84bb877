"""What a run scan reports: `RunCheckpoint`, `RunReport`, `BestMetric`, and the file names ckpt itself writes into a run (slim records, deletion staging)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_serializer

from ...models import Record

#: files modified within this many seconds mark a checkpoint as possibly still being written
DEFAULT_SETTLE = 120.0
#: `prune` renames what it deletes to `.NAME.ckpt-tmp-del-PID-NS` first
DELETING = "del-"


def deleting_process(name: str) -> int | None:
    """The process id in a `.NAME.ckpt-tmp-del-PID-NS` name (what `prune` was deleting), or
    None when `name` (its last component) is no such name."""
    import re

    found = re.search(r"\.ckpt-tmp-del-(\d+)-\d+$", name.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


def still_deleting(pid: int) -> bool:
    """Whether the `prune` of process `pid` (`deleting_process`) may still be deleting: it
    runs on this machine (another user's counts too). Not this process: a deletion it began
    earlier (a `--watch` round) is over, having failed."""
    import os

    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


#: the run-table marker of a save `ckpt protect` wrote parity for (its parity manifest is there)
PROTECTED = "protected"
#: metric file read from the run folder
METRICS_FILE = "metrics.jsonl"
#: the run folder's record of slimmed single-file checkpoints (name -> size, mtime_ns...)
RUN_SLIM_RECORD = ".ckpt-slim.json"
#: ckpt's checksum manifest of a checkpoint: inside its folder, or `NAME.ckpt-manifest.json`
#: beside a single file (`verify --checksums`, `sync`)
CHECKSUM_MANIFEST = "ckpt-manifest.json"
#: left by `sync` at the root of its destination: there, each save's manifest goes up after
#: its files, so a save without one is an upload that has not finished
SYNC_RECORD = ".ckpt-sync.json"


def checksum_manifest_of(name: str, is_dir: bool) -> str:
    """Where the checksum manifest of checkpoint `name` (a path in its run folder) lives:
    inside its folder, or beside a single file."""
    return f"{name}/{CHECKSUM_MANIFEST}" if is_dir else f"{name}.{CHECKSUM_MANIFEST}"


def is_checksum_manifest(rel: str) -> bool:
    """Whether `rel` is a ckpt checksum manifest (its folder's, or a file's beside it): it
    describes the files it was written for, so a converted or resharded copy never carries it
    (`ckpt verify DEST --write-manifest` writes the output's own)."""
    name = rel.rsplit("/", 1)[-1]
    return name == CHECKSUM_MANIFEST or name.endswith(f".{CHECKSUM_MANIFEST}")


Status = Literal["complete", "incomplete", "interrupted", "writing"]


class RunCheckpoint(Record):
    """One step checkpoint of a run folder.

    Attributes:
        name: its path relative to the run folder (`checkpoint-500`, `checkpoints/checkpoint_3`).
        path: its full path (what `ckpt latest` prints).
        paths: every path it consists of (several for plain files sharing a step).
        layout: `hf-trainer`, `accelerate`, `torchtitan`, `deepspeed`, `lightning` or `plain`.
        step / epoch: from its name (`epoch` for Lightning names only).
        size: bytes on disk (a symlink counts as 0: deleting it frees nothing).
        mtime: newest modification time of its files (seconds since the epoch); 0.0 when the
            listing records none (a Hub repository), null in JSON.
        status: `complete`; `incomplete` (a marker missing or a structural problem);
            `interrupted` (a staging folder left by a save that stopped); `writing` (incomplete
            or staging, and modified within the settle window).
        complete: status is `complete`.
        reason: why it is not complete (or why it is treated with care).
        formats: the formats of its components (`safetensors`, `dcp`, `torch`).
        symlink: it is a symbolic link (deleting it unlinks the link, never the target).
        link_target: where the link points.
        markers: `newest` (newest complete), `trainer-best` (the Trainer's
            `best_model_checkpoint`), `deepspeed-latest` (named by the `latest` file),
            `megatron-latest` (named by `latest_checkpointed_iteration.txt`),
            `link-target` (a symlink in the run folder points at it), `best` (best by metric),
            `weights-only` (slimmed), `protected` (a folder holding `ckpt protect`'s parity:
            incomplete, it was damaged since, never interrupted, and `prune` keeps it).
        metric: the value of the metric asked for, at this checkpoint's step.
        slim: `prune --slim-older-than` removed its optimizer / RNG / data-loader state: it
            holds weights only, is complete but not a resume point (marker `weights-only`).
        save_number: for a name that counts saves rather than steps (accelerate's automatic
            `checkpoint_N`), N: it orders the saves; `step` is then None (unknown), so no
            metric row or `--keep-every` rule is matched to a save by it.
    """

    name: str
    path: str
    paths: list[str]
    layout: str
    step: int | None = None
    epoch: float | None = None
    size: int = 0
    mtime: float = 0.0
    status: Status = "complete"
    complete: bool = True
    reason: str | None = None
    formats: list[str] = Field(default_factory=list)
    symlink: bool = False
    link_target: str | None = None
    markers: list[str] = Field(default_factory=list)
    metric: float | None = None
    slim: bool = False
    save_number: int | None = None

    @property
    def mtime_known(self) -> bool:
        """Whether the listing said when its files were written (a Hub repository does not:
        `mtime` is then 0.0, shown as unknown, and no time rule may be applied to it)."""
        return self.mtime > 0

    @field_serializer("mtime")
    def _unknown_time_is_null(self, mtime: float) -> float | None:
        # 0.0 is "the listing does not say": null in JSON, never 1970
        return mtime if mtime > 0 else None

    @property
    def order(self) -> tuple[float, float, float, float]:
        """Sort key: step, then epoch, then save number, then time (unknown ones sort first)."""
        return step_order(self.step, self.epoch, self.mtime, self.save_number)


def step_order(
    step: int | None, epoch: float | None, mtime: float, save_number: int | None = None
) -> tuple[float, float, float, float]:
    """Newest-first order known before judging: step, epoch, the number of a name that counts
    saves (`Found.save_number`), then the entry's own time."""
    return (
        float(step) if step is not None else -math.inf,
        epoch if epoch is not None else -math.inf,
        float(save_number) if save_number is not None else -math.inf,
        mtime,
    )


class BestMetric(Record):
    """Where the best checkpoint by a metric comes from.

    Attributes:
        metric: the metric name (`eval_loss`).
        mode: `min` or `max`.
        source: the file (or `file names`) the values were read from.
        name / value: the best complete checkpoint and its value (None when no checkpoint has one).
    """

    metric: str
    mode: Literal["min", "max"]
    source: str | None = None
    name: str | None = None
    value: float | None = None


class RunReport(Record):
    """The checkpoints of a run folder.

    Attributes:
        run_dir: the folder scanned.
        layouts: the layouts found.
        checkpoints: every checkpoint, oldest first (by step, then time, then name).
        latest: path of the newest complete checkpoint (None if there is none).
        trainer_state: the `trainer_state.json` the Trainer markers were read from.
        trainer_best: the Trainer's `best_model_checkpoint` (as a name in the run folder).
        trainer_best_metric: the Trainer's `best_metric`.
        deepspeed_latest: the folder the DeepSpeed `latest` file names.
        megatron_latest: the folder Megatron-LM's `latest_checkpointed_iteration.txt` names
            (`iter_0000200`, or `release`): the save its `load_checkpoint` resumes from.
        tracker_problem: why Megatron-LM would not resume from the save `latest` names (its
            `latest_checkpointed_iteration.txt` missing, unreadable as an iteration, or naming
            a save the run lacks or holds incomplete), or DeepSpeed from the tag its `latest`
            file names (one the run lacks or holds incomplete: the complete saves named), with
            the fix; None when it would.
        best: best-by-metric, when a metric was asked for.
        settle: the settle window used (seconds).
        root_files: checkpoint files directly in the run folder that belong to no step
            checkpoint (the Trainer's final `model.safetensors`, say).
        left_out: files named like a plain checkpoint (`NAME_N.pt`) that are no checkpoint of
            the run, each as "PATH: why" (a loose file beside a known layout's step folders).
        top_entries: every entry at the run folder's top, name -> whether it is a folder, as
            the scan listed it (not in `--json`: what `sync` names as not carried).
        aliases: the links at the run folder's top to one of its saves that are no save of
            their own (`best -> global_step100`, a name users give a save, which no `latest`
            file names): link name -> the save's name. Never judged, counted (`--keep-last`)
            or deleted: the save one names is kept (`link-target`).
    """

    run_dir: str
    layouts: list[str] = Field(default_factory=list)
    checkpoints: list[RunCheckpoint] = Field(default_factory=list)
    latest: str | None = None
    trainer_state: str | None = None
    trainer_best: str | None = None
    trainer_best_metric: float | None = None
    deepspeed_latest: str | None = None
    megatron_latest: str | None = None
    tracker_problem: str | None = None
    best: BestMetric | None = None
    settle: float = DEFAULT_SETTLE
    root_files: list[str] = Field(default_factory=list)
    left_out: list[str] = Field(default_factory=list)
    top_entries: dict[str, bool] = Field(default_factory=dict, exclude=True)
    aliases: dict[str, str] = Field(default_factory=dict)

    @property
    def newest_complete(self) -> RunCheckpoint | None:
        """The newest complete checkpoint a run can resume from (slimmed saves are not); of
        two saves of one step and time, the later by name, as `checkpoints` are ordered (what
        `--keep-last` counts)."""
        done = [c for c in self.checkpoints if c.complete and not c.slim]
        return max(done, key=lambda c: (c.order, c.name)) if done else None


# --------------------------------------------------------------------------- discovery


@dataclass
class Found:
    """One candidate checkpoint of a run folder, named by `naming.classify`.

    Attributes:
        layout / step / epoch: from its name.
        rels: its paths relative to the run folder (POSIX): one folder or file, or the plain
            files of one step (`model_500.pt`, `optim_500.pt`).
        is_dir: it is a folder (a link to a folder counts as one).
        temporary: a staging folder or file of a save (or deletion) in progress.
        save_number: the number of a name that counts saves, not steps (accelerate's
            automatic `checkpoint_N`); `step` is None then.
    """

    layout: str
    step: int | None
    epoch: float | None
    rels: list[str]
    is_dir: bool
    temporary: bool = False
    save_number: int | None = None
