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

import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ..errors import CkptError, NotFoundError, UsageError
from ..output import TMP_MARKER, fsync_dir
from ..runs import (
    DEFAULT_SETTLE,
    DELETING,
    BestMetric,
    RunCheckpoint,
    RunReport,
    is_remote,
    scan_run,
)
from ..storage import PARITY_DIR
from .slim import SlimAction, slim, slim_plan

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str, option: str = "duration") -> float:
    """`90`, `90s`, `30m`, `6h`, `2d`, `1w`, `1d12h` as seconds (UsageError otherwise)."""
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise UsageError(
            f"{option} {text!r} is not a duration",
            fix="Write a number with a unit: 90s, 30m, 6h, 2d, 1w (or 1d12h).",
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{option} must be longer than 0 (got {text!r})")
    return seconds


class PrunePolicy(BaseModel):
    """What to keep.

    Attributes:
        keep_last: keep the newest N complete checkpoints.
        keep_every: keep checkpoints whose step is divisible by K.
        keep_best: keep the best checkpoint by this metric.
        mode: `min` or `max`: which end of `keep_best` is best.
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


class PruneDecision(BaseModel):
    """The fate of one checkpoint.

    Attributes:
        name / path / paths / step / status / size / markers / metric: the checkpoint (see
            `ckpt_cli.runs.RunCheckpoint`).
        action: `keep`, `delete` or `slim` (kept, its training-only state removed).
        rule: the rule that decided (every rule that keeps it, joined by `; `).
        rules: every rule that keeps it (empty for a deletion).
        slim: for `slim`: what is removed and the bytes it frees.
        deleted: with `--yes`, whether it is gone (for `slim`: whether it was slimmed).
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
    action: Literal["keep", "delete", "slim"]
    rule: str
    rules: list[str] = Field(default_factory=list)
    slim: SlimAction | None = None
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
        to_slim / bytes_to_slim: how many it slims, and the bytes that frees.
        deleted / bytes_freed: what was actually deleted (with `--yes`).
        slimmed / bytes_slimmed: what was actually slimmed (with `--yes`).
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
    to_slim: int = 0
    bytes_to_slim: int = 0
    deleted: list[str] = Field(default_factory=list)
    bytes_freed: int = 0
    slimmed: list[str] = Field(default_factory=list)
    bytes_slimmed: int = 0
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
            fix="Pass --keep-last N, --keep-every K, --keep-best METRIC, --keep-within 2d, "
            "--keep-every-duration 6h and/or --incomplete.",
        )
    for name, value in (
        ("--keep-last", policy.keep_last),
        ("--keep-every", policy.keep_every),
        ("--keep-top", policy.keep_top),
        ("--slim-older-than", policy.slim_older_than),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1 (got {value})")
    if policy.keep_top is not None and policy.keep_best is None:
        raise UsageError(
            "--keep-top N keeps the N best by a metric and needs --keep-best METRIC",
            fix="Add --keep-best eval_loss (and --mode max for metrics where higher is better).",
        )


def plan(run: RunReport, policy: PrunePolicy) -> list[PruneDecision]:
    """One decision per checkpoint of `run` (deletes nothing)."""
    newest = run.newest_complete
    complete = [c for c in run.checkpoints if c.complete]
    now = time.time() if policy.now is None else policy.now
    kept = _retention_rules(complete, policy, now)
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
        scored = [c for c in complete if c.metric is not None]
        sign = 1.0 if policy.mode == "min" else -1.0
        # ties go to the newer checkpoint, as for the single best
        ranked = sorted(scored, key=lambda c: (sign * (c.metric or 0.0), [-x for x in c.order]))
        for rank, c in enumerate(ranked[: policy.keep_top], 1):
            add(c, f"--keep-top {policy.keep_top} (#{rank} {policy.keep_best}={c.metric:g})")
    if policy.keep_within:
        window = policy.keep_within
        for c in complete:
            if now - c.mtime <= window:
                add(c, f"--keep-within {_human_duration(window)}")
    if policy.keep_every_duration:
        span = policy.keep_every_duration
        first: dict[int, RunCheckpoint] = {}
        for c in complete:
            slot = math.floor(c.mtime / span)
            if slot not in first or c.mtime < first[slot].mtime:
                first[slot] = c
        for slot, c in first.items():
            start = time.strftime("%Y-%m-%d %H:%M", time.gmtime(slot * span))
            add(c, f"--keep-every-duration {_human_duration(span)} (window from {start} UTC)")
    return rules


def _human_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        size = _UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _decide(
    c: RunCheckpoint,
    policy: PrunePolicy,
    newest: RunCheckpoint | None,
    retained: list[str],
    metric_missing: bool,
    now: float,
) -> tuple[Literal["keep", "delete"], list[str]]:
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
        "link-target": "a symlink in the run folder points at it",
    }
    rules = [rule for marker, rule in protections.items() if marker in c.markers]
    if c.step is not None and c.step in policy.keep:
        rules.append(f"--keep {c.step}")
    if not c.complete:
        if rules:
            return "keep", rules
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
    if (
        c.step is None
        and c.epoch is None
        and not (policy.keep_within or policy.keep_every_duration)
    ):
        return "keep", ["no step or epoch in its name"]
    return "delete", ["not kept by any rule"]


#: markers of checkpoints never slimmed: a resume point, the best, what a pointer names
_NEVER_SLIM = ("newest", "best", "trainer-best", "deepspeed-latest", "link-target")


def _plan_slims(run: RunReport, policy: PrunePolicy, decisions: list[PruneDecision]) -> None:
    """Turn kept, complete checkpoints older than the newest N whole ones into `slim`."""
    assert policy.slim_older_than is not None
    whole = [c for c in run.checkpoints if c.complete and not c.slim]
    young = {c.name for c in whole[-policy.slim_older_than :]}
    by_name = {c.name: c for c in run.checkpoints}
    for d in decisions:
        c = by_name[d.name]
        if d.action != "keep" or not c.complete or c.slim or c.symlink or c.name in young:
            continue
        if any(m in c.markers for m in _NEVER_SLIM) or "modified in the last" in d.rule:
            continue
        action = slim_plan(c.path)
        if action is None:
            continue
        d.action = "slim"
        d.slim = action
        d.rule = (
            f"--slim-older-than {policy.slim_older_than}: drop "
            f"{', '.join(action.components)}; kept by {d.rule}"
        )


def _older_than(c: RunCheckpoint, newest: RunCheckpoint) -> bool:
    if c.step is None and c.epoch is None:  # staging folders of unknown step: compare times
        return c.mtime < newest.mtime
    return c.order < newest.order


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
        elif d.action == "slim" and d.slim is not None:
            d.error = _slim_one(run_dir, d, settle)
            d.deleted = d.error is None


#: objects of a remote checkpoint deleted first: with them gone it no longer looks complete
_REMOTE_MARKERS = ("ckpt-manifest.json", "trainer_state.json")


def apply_remote(run_url: str, decisions: list[PruneDecision]) -> None:
    """Delete a plan's checkpoints from an object store, each one's commit markers first.

    Object stores have no rename: the manifest, `.metadata`, indexes and `trainer_state.json`
    go first, so a listing taken midway shows an incomplete save, never a complete-looking
    one with files missing; then the rest of its objects.
    """
    from ..output import is_commit_marker
    from ..storage import filesystem_for, remote_failure
    from ..uri import parse_location

    fs, root = filesystem_for(parse_location(run_url))
    root = root.rstrip("/")
    for d in decisions:
        if d.action != "delete":
            continue
        target = f"{root}/{d.name}"
        try:
            objects = sorted(fs.find(target)) or ([target] if fs.isfile(target) else [])
            if not objects:
                d.error = VANISHED
                continue
            first = [o for o in objects if is_commit_marker(o) or o.endswith(_REMOTE_MARKERS)]
            if first:
                fs.rm(first)
            rest = [o for o in objects if o not in first]
            if rest:
                fs.rm(rest)
            fs.invalidate_cache(target)
            d.deleted = True
        except Exception as exc:  # each filesystem package raises its own errors
            d.error = remote_failure(exc, f"{run_url}/{d.name}", writing=True).message
    fs.invalidate_cache(root)


def _slim_one(run_dir: Path, d: PruneDecision, settle: float) -> str | None:
    """Slim one checkpoint; the reason it was not slimmed, or None."""
    assert d.slim is not None
    path = Path(d.path)
    try:
        if not _confined(run_dir, path) or path.is_symlink():
            return "outside the run folder or a link; not slimmed"
        if time.time() - _newest_write(path) < settle:
            return "modified since the plan was made; not slimmed"
        d.slim.bytes = slim(d.slim, path)
    except FileNotFoundError:
        return VANISHED
    except OSError as exc:
        return f"could not slim: {exc.strerror or exc}"
    except CkptError as exc:
        return f"could not slim: {exc.message}"
    return None


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
    remote = is_remote(run_dir)
    if remote and policy.slim_older_than:
        raise UsageError(
            "--slim-older-than rewrites checkpoints and works on local run folders only",
            path=str(run_dir),
            fix="Slim the local run folder, then `ckpt sync` it; remote saves can be pruned.",
        )
    if remote and yes and str(run_dir).startswith("hf://"):
        raise UsageError(
            "deleting from a Hub repository is a commit, which ckpt does not make",
            path=str(run_dir),
            fix="Read the plan without --yes, then delete the folders with "
            "`huggingface-cli repo-files REPO delete checkpoint-N/` or HfApi.delete_folder.",
        )
    root: Path | str = str(run_dir).rstrip("/") if remote else Path(run_dir)
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
    slims = [d for d in decisions if d.action == "slim"]
    report = PruneReport(
        run_dir=str(root),
        policy=policy,
        applied=yes,
        decisions=decisions,
        to_delete=len(doomed),
        bytes_to_free=sum(d.size for d in doomed),
        to_slim=len(slims),
        bytes_to_slim=sum(d.slim.bytes for d in slims if d.slim is not None),
        latest=run.latest,
        best=run.best,
    )
    if yes and remote and doomed:
        apply_remote(str(root), decisions)
        report.deleted = [d.name for d in decisions if d.deleted]
        report.bytes_freed = sum(d.size for d in decisions if d.deleted)
        report.failed = [
            f"{d.name}: {d.error}" for d in decisions if d.error not in (None, VANISHED)
        ]
    elif yes and (doomed or slims):
        assert isinstance(root, Path)
        apply(root, decisions, policy.settle)
        report.deleted = [d.name for d in decisions if d.deleted and d.action == "delete"]
        report.bytes_freed = sum(d.size for d in decisions if d.deleted and d.action == "delete")
        report.slimmed = [d.name for d in decisions if d.deleted and d.action == "slim"]
        report.bytes_slimmed = sum(
            d.slim.bytes for d in decisions if d.deleted and d.slim is not None
        )
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
