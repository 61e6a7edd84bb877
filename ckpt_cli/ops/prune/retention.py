"""Retention for `prune`: the policy, its reports, and the plan of what to keep, slim or delete.

Pure decisions over a scanned run (`runs.RunReport`); `ops.prune` applies them.
"""

from __future__ import annotations

import math
import time
from typing import Literal

from pydantic import Field

from ...durations import format_duration
from ...errors import UsageError
from ...models import Record, Request
from ...sources.runs import (
    DEFAULT_SETTLE,
    PROTECTED,
    UNMARKED,
    BestMetric,
    RunCheckpoint,
    RunReport,
    deleting_process,
    still_deleting,
)
from .slim import SlimAction, slim_plan


def best_mode(higher_is_better: bool | None, keep_best: str | None) -> Literal["min", "max"]:
    """`--higher-is-better` / `--lower-is-better` as a policy's `mode` (min when neither is
    given), refused without `--keep-best`, where they would do nothing."""
    if higher_is_better is not None and keep_best is None:
        flag = "--higher-is-better" if higher_is_better else "--lower-is-better"
        raise UsageError(
            f"{flag} applies with --keep-best only",
            fix=f"Add --keep-best METRIC, or leave {flag} out.",
        )
    return "max" if higher_is_better else "min"


class PrunePolicy(Request):
    """What to keep.

    Attributes:
        keep_last: keep the newest N complete checkpoints.
        keep_every: keep checkpoints whose step is divisible by K.
        keep_best: keep the best checkpoint by this metric.
        mode: `min` or `max`: which end of `keep_best` is best (`--lower-is-better`, the
            default, or `--higher-is-better`).
        keep: steps pinned by the user.
        keep_top: with `keep_best`: keep the N best complete checkpoints by the metric.
        keep_within: seconds: keep every complete checkpoint modified more recently.
        keep_every_duration: seconds: cut time into windows this long (from the epoch) and
            keep, in each, the complete checkpoint closest to the window's start.
        slim_older_than: keep the newest N complete checkpoints whole and slim the older ones
            that are kept (optimizer, RNG and data-loader state removed; see `ops.slim`).
        now: the time the time-based rules measure from (None: the current time).
        incomplete: delete incomplete and interrupted saves older than the newest complete one.
        settle: seconds; a checkpoint with a file modified more recently is never touched.
    """

    # `prune`'s request: built once by the command, read by every round of `--watch`, frozen
    # (a test holds its fields and `run`'s keywords to the command's options)

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: str | None = None
    mode: Literal["min", "max"] = "min"
    keep: list[int] = Field(default_factory=list)
    keep_top: int | None = None
    keep_within: float | None = None
    keep_every_duration: float | None = None
    slim_older_than: int | None = None
    now: float | None = None
    incomplete: bool = False
    settle: float = DEFAULT_SETTLE

    @property
    def retains(self) -> bool:
        """Whether a retention rule decides over complete checkpoints (else all are kept)."""
        return bool(
            self.keep_last
            or self.keep_every
            or self.keep_best
            or self.keep_top
            or self.keep_within
            or self.keep_every_duration
        )


#: how `PruneDecision.error` begins for a checkpoint that left its names and was partly removed
PARTLY_DELETED = "partly deleted"


class PruneDecision(Record):
    """The fate of one checkpoint.

    Attributes:
        name / path / paths / step / status / size / markers / metric: the checkpoint (see
            `ckpt_cli.sources.runs.RunCheckpoint`).
        action: `keep`, `delete` or `slim` (kept, its training-only state removed).
        rule: the rule that decided (every rule that keeps it, joined by `; `).
        rules: every rule that keeps it (empty for a deletion).
        slim: for `slim`: what is removed and the bytes it frees.
        not_slimmed: with `--slim-older-than`, for a complete checkpoint older than the newest
            N whole ones that is kept whole: why it is not slimmed (`it holds no optimizer,
            RNG or data-loader state`).
        deleted: with `--yes`, whether it is gone (for `slim`: whether it was slimmed).
        error: why the deletion failed or was skipped; it begins with `PARTLY_DELETED` when
            the checkpoint is partly removed (what is left is named).
    """

    name: str
    path: str
    paths: list[str]
    step: int | None
    status: str
    size: int
    markers: list[str] = Field(default_factory=list)
    metric: float | None = None
    action: Literal["keep", "delete", "slim"]
    rule: str
    rules: list[str] = Field(default_factory=list)
    slim: SlimAction | None = None
    not_slimmed: str | None = None
    deleted: bool = False
    error: str | None = None


class PruneReport(Record):
    """The result of `ckpt prune`.

    Attributes:
        run_dir: the run folder.
        policy: the policy applied.
        applied: True with `--yes` (deletions were made), False for a plan.
        decisions: every checkpoint, oldest first.
        to_delete / bytes_to_free: how many checkpoints the plan deletes, and their bytes.
        to_slim / bytes_to_slim: how many it slims, and the bytes that frees.
        deleted / bytes_freed: what was actually deleted (with `--yes`).
        slimmed / bytes_slimmed: what was actually slimmed (with `--yes`).
        failed: deletions that failed or were skipped (exit 1).
        latest: the newest complete checkpoint.
        best: best-by-metric, when `--keep-best` was given.
        left_out: files named like checkpoints that are none of the run's, "PATH: why" each
            (never deleted: see `RunReport.left_out`).
        aliases: links to a save of the run that are no save of their own (`best ->
            global_step100`): link name -> the save's name (`RunReport.aliases`). Never
            deleted, never counted by `--keep-last`; the save each names is kept.
    """

    run_dir: str
    policy: PrunePolicy
    applied: bool = False
    decisions: list[PruneDecision] = Field(default_factory=list)
    to_delete: int = 0
    bytes_to_free: int = 0
    to_slim: int = 0
    bytes_to_slim: int = 0
    deleted: list[str] = Field(default_factory=list)
    bytes_freed: int = 0
    slimmed: list[str] = Field(default_factory=list)
    bytes_slimmed: int = 0
    failed: list[str] = Field(default_factory=list)
    latest: str | None = None
    best: BestMetric | None = None
    left_out: list[str] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict)


class WatchReport(Record):
    """The result of `ckpt prune --watch`: every round that deleted something, and why it stopped.

    Attributes:
        run_dir / policy: as for a single run.
        iterations: rounds run.
        rounds: the reports of rounds that deleted or failed to delete something.
        deleted / bytes_freed: totals over all rounds.
        stopped: `max-iterations` or `interrupted` (Ctrl-C).
    """

    run_dir: str
    policy: PrunePolicy
    iterations: int = 0
    rounds: list[PruneReport] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    bytes_freed: int = 0
    stopped: Literal["max-iterations", "interrupted"] = "interrupted"


#: the retention options every command that prunes takes (`prune`, `sync --prune-remote`)
RETENTION_OPTIONS = (
    "--keep-last N",
    "--keep-every K",
    "--keep-best METRIC",
    "--keep-within 2d",
    "--keep-every-duration 6h",
)
#: the policy options of `ckpt prune`: the retention ones, slimming and the incomplete saves
PRUNE_OPTIONS = (*RETENTION_OPTIONS, "--slim-older-than N", "--incomplete")


def validate_policy(policy: PrunePolicy, offered: tuple[str, ...] = PRUNE_OPTIONS) -> None:
    """Refuse a policy that would change nothing, or whose options contradict (UsageError);
    the refusal of an empty one names the `offered` options (those of the command asking).

    Slimming is a policy of its own: `--slim-older-than N` alone keeps every checkpoint and
    slims the older ones.
    """
    if not (policy.retains or policy.incomplete or policy.slim_older_than):
        raise UsageError(
            "no policy given: nothing would be deleted",
            fix=f"Pass {', '.join(offered[:-1])} and/or {offered[-1]}.",
        )
    for name, value in (
        ("--keep-last", policy.keep_last),
        ("--keep-every", policy.keep_every),
        ("--keep-top", policy.keep_top),
        ("--slim-older-than", policy.slim_older_than),
    ):
        if value is not None and value < 1:
            raise UsageError(
                f"{name} must be at least 1 (got {value})",
                fix=f"Give {name} 1 or more, or leave it out.",
            )
    if policy.keep_top is not None and policy.keep_best is None:
        raise UsageError(
            "--keep-top N keeps the N best by a metric and needs --keep-best METRIC",
            fix="Add --keep-best eval_loss (and --higher-is-better for a metric such as accuracy).",
        )


def plan(run: RunReport, policy: PrunePolicy) -> list[PruneDecision]:
    """One decision per checkpoint of `run` (deletes nothing)."""
    newest = run.newest_complete
    complete = [c for c in run.checkpoints if c.complete]
    now = time.time() if policy.now is None else policy.now
    # a save with no commit marker written within --settle may still be being written: it is
    # kept (never touched), but never counted as a save the rules keep, so the settled save
    # before it is what --keep-last keeps, never deleted for it
    settled = [c for c in complete if not _unsettled(c, policy)]
    kept = _retention_rules(settled, policy, now)
    if len(settled) < len(complete) and settled:
        kept.setdefault(settled[-1].name, []).insert(
            0, "newest settled complete (a newer save has no commit marker and is within --settle)"
        )
    metric_missing = policy.keep_best is not None and (run.best is None or run.best.name is None)
    decisions = []
    for c in run.checkpoints:
        action, rules = _decide(c, policy, newest, kept.get(c.name, []), metric_missing, now)
        decisions.append(
            PruneDecision(
                name=c.name,
                path=c.path,
                paths=c.paths,
                step=c.step,
                status=c.status,
                size=c.size,
                markers=c.markers,
                metric=c.metric,
                action=action,
                rule="; ".join(rules),
                rules=rules if action == "keep" else [],
            )
        )
    if policy.slim_older_than:
        _plan_slims(run, policy, decisions)
    return decisions


def _retention_rules(
    complete: list[RunCheckpoint], policy: PrunePolicy, now: float
) -> dict[str, list[str]]:
    """For each complete checkpoint, the retention rules (last, every, top...) that keep it."""
    rules: dict[str, list[str]] = {}

    def add(c: RunCheckpoint, rule: str) -> None:
        rules.setdefault(c.name, []).append(rule)

    if policy.keep_last:
        for c in complete[-policy.keep_last :]:
            add(c, f"--keep-last {policy.keep_last}")
    if policy.keep_every:
        for c in complete:
            number = (
                c.step if c.step is not None else (int(c.epoch) if c.epoch is not None else None)
            )
            if number is not None and number % policy.keep_every == 0:
                add(c, f"--keep-every {policy.keep_every}")
    if policy.keep_top:
        # a NaN (or inf) value is no value: never ranked (NaN sorts anywhere)
        scored = [c for c in complete if c.metric is not None and math.isfinite(c.metric)]
        sign = 1.0 if policy.mode == "min" else -1.0
        # ties go to the newer checkpoint, as for the single best
        ranked = sorted(scored, key=lambda c: (sign * (c.metric or 0.0), [-x for x in c.order]))
        for rank, c in enumerate(ranked[: policy.keep_top], 1):
            add(c, f"--keep-top {policy.keep_top} (#{rank} {policy.keep_best}={c.metric:g})")
    if policy.keep_within:
        window = policy.keep_within
        _refuse_without_times(complete, f"--keep-within {format_duration(window)}")
        for c in complete:
            if now - c.mtime <= window:
                add(c, f"--keep-within {format_duration(window)}")
    if policy.keep_every_duration:
        span = policy.keep_every_duration
        _refuse_without_times(complete, f"--keep-every-duration {format_duration(span)}")
        first: dict[int, RunCheckpoint] = {}
        for c in complete:
            slot = math.floor(c.mtime / span)
            if slot not in first or c.mtime < first[slot].mtime:
                first[slot] = c
        for slot, c in first.items():
            start = time.strftime("%Y-%m-%d %H:%M", time.gmtime(slot * span))
            add(c, f"--keep-every-duration {format_duration(span)} (window from {start} UTC)")
    return rules


def _decide(
    c: RunCheckpoint,
    policy: PrunePolicy,
    newest: RunCheckpoint | None,
    retained: list[str],
    metric_missing: bool,
    now: float,
) -> tuple[Literal["keep", "delete"], list[str]]:
    deleter = deleting_process(c.name)
    if deleter is not None and not c.symlink:
        # what a `ckpt prune` killed midway was deleting: already out of every listing and
        # never of use again; this run finishes the deletion, unless that prune still runs
        if still_deleting(deleter):
            return "keep", [f"being deleted by `ckpt prune` (process {deleter})"]
        return "delete", ["the rest of a deletion a killed `ckpt prune` started"]
    if c.status == "writing":
        return "keep", ["still being written"]
    # unlinking a symlink never harms what a writer may be writing through it
    if not c.symlink and time.time() - c.mtime < policy.settle:
        return "keep", [f"modified in the last {policy.settle:g} s"]
    protections = {
        "newest": "newest complete",
        "best": f"best {policy.keep_best} ({c.metric:g})" if c.metric is not None else "best",
        "trainer-best": "Trainer best_model_checkpoint",
        "deepspeed-latest": "named by the DeepSpeed latest file",
        "megatron-latest": "named by latest_checkpointed_iteration.txt",
        "link-target": "a symlink in the run folder points at it",
    }
    rules = [rule for marker, rule in protections.items() if marker in c.markers]
    if c.step is not None and c.step in policy.keep:
        rules.append(f"--keep {c.step}")
    if not c.complete:
        if rules:
            return "keep", rules
        if PROTECTED in c.markers:
            # `ckpt protect` blesses whole saves only: this one was damaged since (a lost or
            # corrupt file), not interrupted, and its parity may rebuild it
            return "keep", [f"protected, damaged since: `ckpt repair {c.path}` rebuilds it"]
        if not policy.incomplete:
            return "keep", [f"{c.status} (--incomplete removes it)"]
        if newest is None or not _older_than(c, newest):
            return "keep", [f"{c.status}, newer than the newest complete checkpoint"]
        return "delete", [f"--incomplete: {c.status}"]
    rules += retained
    if rules:
        return "keep", rules
    if not policy.retains:
        return "keep", ["complete (no retention policy given)"]
    if metric_missing:
        return "keep", [f"no value of {policy.keep_best} found yet"]
    counted = c.step is None and c.epoch is None and c.save_number is not None
    if (
        c.step is None
        and c.epoch is None
        and not (counted and policy.keep_last)  # saves counted by N are ordered by N
        and not (policy.keep_within or policy.keep_every_duration)
    ):
        if counted:
            return "keep", [
                "its name counts saves, not steps: only --keep-last and time rules apply"
            ]
        return "keep", ["no step or epoch in its name"]
    notes = [c.reason] if c.reason else []
    if counted and policy.keep_every:
        notes.append("--keep-every does not apply: its name counts saves, not steps")
    # a complete checkpoint's reason says why a rule could not apply (a NaN metric value)
    return "delete", ["not kept by any rule" + (f" ({'; '.join(notes)})" if notes else "")]


#: markers of checkpoints never slimmed (a resume point, the best, what a pointer names), each
#: with what it says of the checkpoint
_NEVER_SLIM = {
    "newest": "the newest complete checkpoint",
    "best": "the best by --keep-best",
    "trainer-best": "the Trainer's best_model_checkpoint",
    "deepspeed-latest": "the save the DeepSpeed latest file names",
    "megatron-latest": "the save latest_checkpointed_iteration.txt names",
    "link-target": "a save a symlink points at",
}


def _plan_slims(run: RunReport, policy: PrunePolicy, decisions: list[PruneDecision]) -> None:
    """Turn kept, complete checkpoints older than the newest N whole ones into `slim`."""
    assert policy.slim_older_than is not None
    whole = [c for c in run.checkpoints if c.complete and not c.slim]
    young = {c.name for c in whole[-policy.slim_older_than :]}
    by_name = {c.name: c for c in run.checkpoints}
    for d in decisions:
        c = by_name[d.name]
        if d.action != "keep" or not c.complete or c.name in young:
            continue
        # an older save kept whole says why, as a kept one names its rules: a run whose saves
        # hold nothing to slim printed the plain keep table, and nothing was slimmed
        never = [m for m in _NEVER_SLIM if m in c.markers]
        if c.slim:
            d.not_slimmed = "already slimmed (weights only)"
        elif c.symlink:
            d.not_slimmed = "a symlink (slimming never goes through a link)"
        elif never:
            d.not_slimmed = f"{_NEVER_SLIM[never[0]]} is never slimmed"
        elif "modified in the last" in d.rule:
            d.not_slimmed = "modified in the last " + d.rule.partition("modified in the last ")[2]
        else:
            action = slim_plan(c.path)
            if isinstance(action, str):
                d.not_slimmed = action
                continue
            d.action = "slim"
            d.slim = action
            d.rule = (
                f"--slim-older-than {policy.slim_older_than}: drop "
                f"{', '.join(action.components)}; kept by {d.rule}"
            )


def _unsettled(c: RunCheckpoint, policy: PrunePolicy) -> bool:
    """A complete-looking save of a layout with no commit marker (`UNMARKED`) modified within
    `--settle`: its writer may not have finished (what `sync` holds back)."""
    return c.layout in UNMARKED and not c.symlink and time.time() - c.mtime < policy.settle


def _older_than(c: RunCheckpoint, newest: RunCheckpoint) -> bool:
    """Whether `c` was saved before `newest`, in the order `latest` judges them
    (`RunCheckpoint.order`: step, epoch, then the number of a name that counts saves, such as
    accelerate's `checkpoint_N`); by time only for a save none of these name (a staging
    folder of unknown step), whose times are all there is."""
    if c.step is None and c.epoch is None and c.save_number is None:
        return c.mtime < newest.mtime
    return c.order < newest.order


def _refuse_without_times(checkpoints: list[RunCheckpoint], rule: str) -> None:
    """A time rule over a listing that records no times (a Hub repository) would judge every
    save by 1970 (`--keep-within` keeping none of them): refused, naming the rule and why."""
    unknown = next((c for c in checkpoints if not c.mtime_known), None)
    if unknown is not None:
        raise UsageError(
            f"{rule} needs the time each checkpoint was written, and the listing records none "
            f"for {unknown.name} (a Hub repository records no modification times)",
            path=unknown.path,
            fix="Use --keep-last, --keep-every or --keep-best, which need no times.",
        )
