"""What `ckpt doctor` reports: the causes it ranks, the resume points it found, its report."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...models import Record

#: every cause the doctor recognises, in the order a tie is broken (the likelier first)
CAUSE_IDS = (
    "optimizer_not_restored",
    "optimizer_mismatch",
    "optimizer_settings_changed",
    "scheduler_not_restored",
    "schedule_changed",
    "data_position_not_restored",
    "grad_scaler_reset",
    "model_in_eval_mode",
    "weights_partly_restored",
    "precision_changed",
    "batch_changed",
    "ema_not_restored",
    "rng_not_restored",
    "config_changed",
    "tokenizer_changed",
    "seed_changed",
    "grad_clip_changed",
    "inconsistent_state",
    "rng_ranks_missing",
)

#: what `--expect` accepts: a change the user made on purpose, reported but not ranked
EXPECTABLE = {
    "batch": "batch_changed",
    "world-size": "batch_changed",
    "precision": "precision_changed",
    "config": "config_changed",
    "tokenizer": "tokenizer_changed",
    "scheduler": "scheduler_not_restored",
    "optimizer": "optimizer_not_restored",
    "optimizer-settings": "optimizer_settings_changed",
    "data": "data_position_not_restored",
    "rng": "rng_not_restored",
    "ema": "ema_not_restored",
    "scaler": "grad_scaler_reset",
    "schedule": "schedule_changed",
    "grad-clip": "grad_clip_changed",
}


class Cause(Record):
    """One reason a resumed run diverged, with its evidence in numbers and the fix.

    Attributes:
        id: a stable token (`optimizer_not_restored`, `scheduler_not_restored`... see
            `CAUSE_IDS`).
        title: one line saying what happened.
        rank: 1 for the likeliest cause (0 for a declared change, which is not ranked).
        score: how strongly the files say so, 0..1 (direct counters ~0.95, tensor statistics
            ~0.8, changed settings ~0.7).
        before / after: the two saves the cause lies between (`after` alone for a finding on
            one checkpoint).
        evidence: the numbers that show it, one line each.
        fix: what to change in the resume code.
        declared: the user said the change was intended (`--expect`): shown, not ranked.
    """

    id: str
    title: str
    rank: int = 0
    score: float
    before: str | None = None
    after: str
    evidence: list[str] = Field(default_factory=list)
    fix: str
    declared: bool = False


class LogJump(Record):
    """The logged loss and learning rate on both sides of a resume step.

    Attributes:
        source: the log read (`checkpoint-6/trainer_state.json`, `metrics.jsonl`...).
        step_before / step_after: the last logged step up to the save, the first after it.
        loss_before / loss_after, lr_before / lr_after: the values logged there.
        lr_like_step: the earlier step whose logged learning rate the resumed run repeats
            (the scheduler started over: warm-up again), when it does.
        lr_like_at / lr_like: the resumed step that repeats it, and its learning rate: the
            first step after the resume, or a later one up to the next save (a restored
            optimizer carries its last learning rate into the first step; a fresh scheduler
            sets its own from the next).
        restarted: the log itself shows a restart (a step logged twice, or the steps going
            back).
    """

    source: str
    step_before: int | None = None
    step_after: int | None = None
    loss_before: float | None = None
    loss_after: float | None = None
    lr_before: float | None = None
    lr_after: float | None = None
    lr_like_step: int | None = None
    lr_like_at: int | None = None
    lr_like: float | None = None
    restarted: bool = False


class ResumePoint(Record):
    """Two consecutive saves of the run, and whether a restart lies between them.

    Attributes:
        before / after: the saves (names in the run folder).
        step_before / step_after: their steps.
        resumed: a restart was found between them.
        how: what said so: `declared` (--before/--after), `log` (a step logged twice or
            going back), `steps` (the saved step counter went back), `time` (a gap far longer
            than the run's save interval) or `state` (the saved state itself is
            discontinuous); empty when nothing did.
        log: the logged loss / learning rate around the resume step, when a log covers it.
        notes: changes seen that are no cause (a world-size change that kept the global batch).
    """

    before: str
    after: str
    step_before: int | None = None
    step_after: int | None = None
    resumed: bool = False
    how: list[str] = Field(default_factory=list)
    log: LogJump | None = None
    notes: list[str] = Field(default_factory=list)


class DoctorReport(Record):
    """The result of `ckpt doctor`.

    Attributes:
        run_dir: the run folder (or the checkpoint) examined.
        mode: `run` (a run folder's saves), `pair` (--before / --after) or `single` (one
            checkpoint: only its own consistency is checked).
        checkpoints: the saves examined, oldest first.
        resume_points: each consecutive pair examined, and whether it is a restart.
        causes: the causes found, likeliest first (declared ones last, rank 0).
        verdict: one line: the likeliest cause, or that none was found.
        expected: the changes declared with `--expect`.
        warnings: what could not be examined, and why.
    """

    run_dir: str
    mode: Literal["run", "pair", "single"]
    checkpoints: list[str] = Field(default_factory=list)
    resume_points: list[ResumePoint] = Field(default_factory=list)
    causes: list[Cause] = Field(default_factory=list)
    verdict: str = ""
    expected: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @property
    def found(self) -> bool:
        """Whether any cause (not a declared change) was found."""
        return any(not c.declared for c in self.causes)
