"""`prune`: retention over a run folder, as a plan unless asked to delete.

Every checkpoint gets one decision and the rule that made it. Protections come first and no
policy overrides them: a checkpoint still being written, the newest complete one, the best
by metric, the Trainer's `best_model_checkpoint`, the folder the DeepSpeed `latest` file names,
a checkpoint a symlink in the run folder points at, and pinned steps. Deletion renames each
checkpoint to a hidden `.NAME.ckpt-tmp-del-*` sibling first, then removes it: a crash midway
leaves a staging name that `ckpt latest` ignores and `prune --incomplete` cleans, never a
half-deleted folder under its real name.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ..errors import NotFoundError, UsageError
from ..output import TMP_MARKER, fsync_dir
from ..runs import DEFAULT_SETTLE, DELETING, BestMetric, RunCheckpoint, RunReport, scan_run
from ..storage import PARITY_DIR


class PrunePolicy(BaseModel):
    """What to keep.

    Attributes:
        keep_last: keep the newest N complete checkpoints.
        keep_every: keep checkpoints whose step is divisible by K.
        keep_best: keep the best checkpoint by this metric.
        mode: `min` or `max`: which end of `keep_best` is best.
        keep: steps pinned by the user.
        incomplete: delete incomplete and interrupted saves older than the newest complete one.
        settle: seconds; a checkpoint with a file modified more recently is never touched.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: str | None = None
    mode: Literal["min", "max"] = "min"
    keep: list[int] = Field(default_factory=list)
    incomplete: bool = False
    settle: float = DEFAULT_SETTLE

    @property
    def retains(self) -> bool:
        """Whether a retention rule (last / every / best) decides over complete checkpoints."""
        return bool(self.keep_last or self.keep_every or self.keep_best)


class PruneDecision(BaseModel):
    """The fate of one checkpoint.

    Attributes:
        name / path / paths / step / status / size / markers / metric: the checkpoint (see
            `ckpt_cli.runs.RunCheckpoint`).
        action: `keep` or `delete`.
        rule: the rule that decided.
        deleted: with `--yes`, whether it is gone.
        error: why the deletion failed or was skipped.
    """

    name: str
    path: str
    paths: list[str]
    step: int | None
    status: str
    size: int
    markers: list[str] = Field(default_factory=list)
    metric: float | None = None
    action: Literal["keep", "delete"]
    rule: str
    deleted: bool = False
    error: str | None = None


class PruneReport(BaseModel):
    """The result of `ckpt prune`.

    Attributes:
        run_dir: the run folder.
        policy: the policy applied.
        applied: True with `--yes` (deletions were made), False for a plan.
        decisions: every checkpoint, oldest first.
        to_delete / bytes_to_free: how many checkpoints the plan deletes, and their bytes.
        deleted / bytes_freed: what was actually deleted (with `--yes`).
        failed: deletions that failed or were skipped (exit 1).
        latest: the newest complete checkpoint.
        best: best-by-metric, when `--keep-best` was given.
    """

    run_dir: str
    policy: PrunePolicy
    applied: bool = False
    decisions: list[PruneDecision] = Field(default_factory=list)
    to_delete: int = 0
    bytes_to_free: int = 0
    deleted: list[str] = Field(default_factory=list)
    bytes_freed: int = 0
    failed: list[str] = Field(default_factory=list)
    latest: str | None = None
    best: BestMetric | None = None


class WatchReport(BaseModel):
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


#: why a checkpoint was not deleted when something else removed it first
VANISHED = "vanished before it was deleted (removed by someone else)"


def _validate(policy: PrunePolicy) -> None:
    if not (policy.retains or policy.incomplete):
        raise UsageError(
            "no policy given: nothing would be deleted",
            fix="Pass --keep-last N, --keep-every K, --keep-best METRIC and/or --incomplete.",
        )
    for name, value in (("--keep-last", policy.keep_last), ("--keep-every", policy.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1 (got {value})")


def _older_than(c: RunCheckpoint, newest: RunCheckpoint) -> bool:
    if c.step is None and c.epoch is None:  # staging folders of unknown step: compare times
        return c.mtime < newest.mtime
    return c.order < newest.order


def plan(run: RunReport, policy: PrunePolicy) -> list[PruneDecision]:
    """One decision per checkpoint of `run` (deletes nothing)."""
    newest = run.newest_complete
    complete = [c for c in run.checkpoints if c.complete]
    last = {c.name for c in complete[-policy.keep_last :]} if policy.keep_last else set()
    metric_missing = policy.keep_best is not None and (run.best is None or run.best.name is None)
    now = time.time()
    decisions = []
    for c in run.checkpoints:
        action, rule = _decide(c, policy, newest, last, metric_missing, now)
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
                rule=rule,
            )
        )
    return decisions


def _decide(
    c: RunCheckpoint,
    policy: PrunePolicy,
    newest: RunCheckpoint | None,
    last: set[str],
    metric_missing: bool,
    now: float,
) -> tuple[Literal["keep", "delete"], str]:
    if c.status == "writing":
        return "keep", "still being written"
    # unlinking a symlink never harms what a writer may be writing through it
    if not c.symlink and now - c.mtime < policy.settle:
        return "keep", f"modified in the last {policy.settle:g} s"
    protections = {
        "newest": "newest complete",
        "best": f"best {policy.keep_best} ({c.metric:g})" if c.metric is not None else "best",
        "trainer-best": "Trainer best_model_checkpoint",
        "deepspeed-latest": "named by the DeepSpeed latest file",
        "link-target": "a symlink in the run folder points at it",
    }
    for marker, rule in protections.items():
        if marker in c.markers:
            return "keep", rule
    if c.step is not None and c.step in policy.keep:
        return "keep", f"--keep {c.step}"
    if not c.complete:
        if not policy.incomplete:
            return "keep", f"{c.status} (--incomplete removes it)"
        if newest is None or not _older_than(c, newest):
            return "keep", f"{c.status}, newer than the newest complete checkpoint"
        return "delete", f"--incomplete: {c.status}"
    if not policy.retains:
        return "keep", "complete (no retention policy given)"
    if metric_missing:
        return "keep", f"no value of {policy.keep_best} found yet"
    if c.name in last:
        return "keep", f"--keep-last {policy.keep_last}"
    number = c.step if c.step is not None else (int(c.epoch) if c.epoch is not None else None)
    if number is None:
        return "keep", "no step or epoch in its name"
    if policy.keep_every and number % policy.keep_every == 0:
        return "keep", f"--keep-every {policy.keep_every}"
    return "delete", "not kept by any rule"


def _confined(run_dir: Path, path: Path) -> bool:
    """Whether `path` (not followed if it is a link) lies inside the run folder."""
    real_root = os.path.realpath(run_dir)
    parent = os.path.realpath(path.parent)
    return parent == real_root or parent.startswith(real_root + os.sep)


def _newest_write(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for dirpath, _dirs, files in os.walk(path):
            for fname in files:
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, fname)).st_mtime)
                except OSError:
                    continue
    return newest


def remove_checkpoint(paths: list[Path]) -> None:
    """Delete one checkpoint: rename each of its paths to a hidden staging name, then remove.

    Every path is renamed before anything is removed, so the checkpoint leaves its real names
    in one quick step. A symlink is unlinked (its target is never touched); a folder is
    removed without following the links inside it. If interrupted while removing, the removal
    is finished before the interrupt propagates: at worst hidden `.NAME.ckpt-tmp-del-*` remain.
    """
    hidden: list[Path] = []
    # a single-file checkpoint's parity (`ckpt protect FILE`) lives beside it; it goes too
    # (a folder checkpoint's parity is inside the folder)
    paths = paths + [
        parity
        for p in paths
        if not p.is_dir()
        and (parity := p.parent / PARITY_DIR / p.name).is_dir()
        and not parity.is_symlink()
    ]
    for path in paths:
        tag = f"{TMP_MARKER}{DELETING}{os.getpid()}-{time.time_ns()}"
        target = path.with_name(f".{path.name}{tag}")
        os.rename(path, target)
        hidden.append(target)
    for folder in {p.parent for p in paths}:
        fsync_dir(folder)
    try:
        for target in hidden:
            _remove(target)
    except KeyboardInterrupt:
        for target in hidden:
            _remove(target)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def apply(run_dir: Path, decisions: list[PruneDecision], settle: float) -> None:
    """Carry out the deletions of a plan, re-checking each checkpoint just before."""
    for d in decisions:
        if d.action == "delete":
            d.error = _delete_one(run_dir, [Path(p) for p in d.paths], settle)
            d.deleted = d.error is None


def _delete_one(run_dir: Path, paths: list[Path], settle: float) -> str | None:
    """Delete one checkpoint; the reason it was not deleted, or None."""
    try:
        for path in paths:
            if not _confined(run_dir, path):
                return "outside the run folder; not deleted"
            if not path.is_symlink() and time.time() - _newest_write(path) < settle:
                return "modified since the plan was made; not deleted"
        remove_checkpoint(paths)
    except FileNotFoundError:
        return VANISHED
    except OSError as exc:
        return f"could not delete: {exc.strerror or exc}"
    return None


def prune(
    run_dir: str | Path, policy: PrunePolicy, *, yes: bool = False, strict_metric: bool = True
) -> PruneReport:
    """Plan retention over `run_dir`; with `yes`, delete what the plan deletes.

    Args:
        run_dir: the run folder.
        policy: what to keep.
        yes: delete (otherwise only plan).
        strict_metric: raise NotFoundError when `keep_best` has no value anywhere (a watch
            round passes False and keeps everything until values appear).
    """
    _validate(policy)
    root = Path(run_dir)
    run = scan_run(root, metric=policy.keep_best, mode=policy.mode, settle=policy.settle)
    if strict_metric and run.best is not None and run.best.name is None:
        raise NotFoundError(
            f"no value of {policy.keep_best!r} for any complete checkpoint",
            path=root,
            fix=(
                "Check the metric name; values come from metrics.jsonl "
                '({"step": N, "METRIC": value} per line), trainer_state.json log_history, '
                "or Lightning file names (…-val_loss=0.25.ckpt)."
            ),
        )
    decisions = plan(run, policy)
    doomed = [d for d in decisions if d.action == "delete"]
    report = PruneReport(
        run_dir=str(root),
        policy=policy,
        applied=yes,
        decisions=decisions,
        to_delete=len(doomed),
        bytes_to_free=sum(d.size for d in doomed),
        latest=run.latest,
        best=run.best,
    )
    if yes and doomed:
        apply(root, decisions, policy.settle)
        report.deleted = [d.name for d in decisions if d.deleted]
        report.bytes_freed = sum(d.size for d in decisions if d.deleted)
        # gone already (the trainer's own rotation, say) is what was wanted: not a failure
        report.failed = [
            f"{d.name}: {d.error}" for d in decisions if d.error not in (None, VANISHED)
        ]
    return report


def watch(
    run_dir: str | Path,
    policy: PrunePolicy,
    interval: float,
    *,
    max_iterations: int | None = None,
    on_round: Callable[[PruneReport], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> WatchReport:
    """Re-apply `policy` every `interval` seconds until Ctrl-C (or `max_iterations` rounds).

    Checkpoints still being written are never touched (see `runs`); rounds where the metric
    of `keep_best` has no values yet keep every complete checkpoint.
    """
    _validate(policy)
    if interval <= 0:
        raise UsageError(f"--watch needs a positive number of seconds (got {interval:g})")
    result = WatchReport(run_dir=str(run_dir), policy=policy)
    try:
        while True:
            report = prune(run_dir, policy, yes=True, strict_metric=False)
            result.iterations += 1
            if report.deleted or report.failed:
                result.rounds.append(report)
                result.deleted.extend(report.deleted)
                result.bytes_freed += report.bytes_freed
            if on_round is not None:
                on_round(report)
            if max_iterations is not None and result.iterations >= max_iterations:
                result.stopped = "max-iterations"
                break
            sleep(interval)
    except KeyboardInterrupt:
        result.stopped = "interrupted"
    return result


def run(
    run_dir: str | Path,
    policy: PrunePolicy,
    *,
    yes: bool = False,
    watch_seconds: float | None = None,
    max_iterations: int | None = None,
    on_round: Callable[[PruneReport], None] | None = None,
) -> PruneReport | WatchReport:
    """What `ckpt prune` does: one plan (deleting with `yes`), or `--watch` rounds."""
    if watch_seconds is not None and not yes:
        raise UsageError(
            "--watch deletes as it goes and needs --yes",
            fix="Run without --watch to see the plan first, then add --watch SECONDS --yes.",
        )
    if max_iterations is not None and watch_seconds is None:
        raise UsageError("--max-iterations only applies with --watch")
    if watch_seconds is None:
        return prune(run_dir, policy, yes=yes)
    return watch(run_dir, policy, watch_seconds, max_iterations=max_iterations, on_round=on_round)


def exit_code(report: PruneReport | WatchReport) -> int:
    """1 when a deletion failed (in any round)."""
    if isinstance(report, WatchReport):
        return 1 if any(r.failed for r in report.rounds) else 0
    return 1 if report.failed else 0
