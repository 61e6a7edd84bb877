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

import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ... import faults
from ...errors import CkptError, NotFoundError, UsageError
from ...faults import notice
from ...sources.runs import DELETING, RunReport, is_remote, scan_run
from ...sources.runs.naming import run_folder_above
from ...sources.runs.records import CHECKSUM_MANIFEST
from ...storage import PARITY_DIR, is_parity_path
from ...storage.output import TMP_MARKER, fsync_dir, recover_old_copies_in
from ...storage.uri import is_hub_url, parse_location
from .retention import (
    PARTLY_DELETED,
    PruneDecision,
    PrunePolicy,
    PruneReport,
    WatchReport,
    plan,
    validate_policy,
)
from .slim import finish_removal, slim

#: why a checkpoint was not deleted when something else removed it first
VANISHED = "vanished before it was deleted (removed by someone else)"


def _confined(run_dir: Path, path: Path) -> bool:
    """Whether `path` (not followed if it is a link) lies inside the run folder."""
    real_root = os.path.realpath(run_dir)
    parent = os.path.realpath(path.parent)
    return parent == real_root or parent.startswith(real_root + os.sep)


def _newest_write(path: Path) -> float:
    """The newest write to a checkpoint, as the plan's settle window judged it: its parity
    (`ckpt protect`, added later) dates no save."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if not is_parity_path(d)]
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
    try:
        for path in paths:
            tag = f"{TMP_MARKER}{DELETING}{os.getpid()}-{time.time_ns()}"
            target = path.with_name(f".{path.name}{tag}")
            os.rename(path, target)
            hidden.append(target)
    except OSError:
        # nothing removed yet: the paths renamed so far get their names back
        for path, target in zip(paths, hidden, strict=False):
            os.rename(target, path)
        raise
    for folder in {p.parent for p in paths}:
        fsync_dir(folder)
    try:
        for target in hidden:
            _remove(target)
    except KeyboardInterrupt:
        for target in hidden:
            _remove(target)
        raise
    except OSError as exc:
        raise PartlyDeleted([t for t in hidden if t.exists() or t.is_symlink()], exc) from None


class PartlyDeleted(Exception):
    """A checkpoint left its names and was partly removed when removing a file failed: what
    is left (`.NAME.ckpt-tmp-del-*`, an interrupted deletion that `prune --incomplete`
    removes) and the error, which names the file."""

    def __init__(self, left: list[Path], error: OSError):
        super().__init__(str(error))
        self.left = left
        self.error = error


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        failed: list[OSError] = []

        def named(
            _func: Callable[..., Any],
            name: str,
            exc_info: tuple[type[BaseException], BaseException, TracebackType],
        ) -> None:
            # what can be removed is; the first failure is raised after, naming the file
            # (rmtree's own error names it relative to its folder, or not at all)
            err = exc_info[1]
            if not isinstance(err, OSError):
                raise err
            failed.append(OSError(err.errno, err.strerror, name))

        shutil.rmtree(path, onerror=named)
        if failed:
            raise failed[0]
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
        elif d.action == "keep" and _confined(run_dir, Path(d.path)):
            finish_removal(Path(d.path))  # what a slim killed midway left renamed


#: objects of a remote checkpoint deleted first: with them gone it no longer looks complete
_REMOTE_MARKERS = (CHECKSUM_MANIFEST, "trainer_state.json")


def apply_remote(run_url: str, decisions: list[PruneDecision]) -> None:
    """Delete a plan's checkpoints from an object store, each one's commit markers first.

    Object stores have no rename: the manifest, `.metadata`, indexes and `trainer_state.json`
    go first, so a listing taken midway shows an incomplete save, never a complete-looking
    one with files missing; then the rest of its objects.
    """
    from ...formats.names import is_commit_marker
    from ...storage import filesystem_for, literal, remote_failure
    from ...storage.uri import parse_location

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
                fs.rm([literal(o) for o in first])
            rest = [o for o in objects if o not in first]
            if rest:
                fs.rm([literal(o) for o in rest])
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
    except PartlyDeleted as partly:
        err = partly.error
        left = ", ".join(p.name for p in partly.left) or "nothing"
        return (
            f"{PARTLY_DELETED}: could not remove {err.filename or 'a file'} "
            f"({err.strerror or err}); left as {left} (no longer a checkpoint: `ckpt prune "
            "--incomplete` removes it once the file can be removed)"
        )
    except FileNotFoundError:
        return VANISHED
    except OSError as exc:
        return _not_deleted(exc, paths[0])
    return None


def _not_deleted(exc: OSError, path: Path) -> str:
    """Why a checkpoint was not deleted, with the errno, the file, and what to do: the write
    side's fix texts (room to make, a folder to create) say nothing to a deletion."""
    code = errno.errorcode.get(exc.errno or 0, "no errno")
    where = exc.filename or path
    if exc.errno == errno.EROFS:
        todo = "its file system is mounted read-only: remount it read-write"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        todo = "run as the user who owns the run folder, or give it write permission"
    else:
        todo = "check the file and its file system"
    return (
        f"could not delete {where}: {exc.strerror or exc} ({code}); nothing of it was removed: "
        f"{todo}, then run `ckpt prune` again"
    )


def plan_report(run: RunReport, policy: PrunePolicy, run_dir: str) -> PruneReport:
    """The plan of `policy` over a scanned run (nothing deleted, `applied` false): what
    `prune` reports without `yes`, and what `sync --dry-run` reports of the destination as
    the round would leave it."""
    decisions = plan(run, policy)
    doomed = [d for d in decisions if d.action == "delete"]
    slims = [d for d in decisions if d.action == "slim"]
    return PruneReport(
        run_dir=run_dir,
        policy=policy,
        applied=False,
        decisions=decisions,
        to_delete=len(doomed),
        bytes_to_free=sum(d.size for d in doomed),
        to_slim=len(slims),
        bytes_to_slim=sum(d.slim.bytes for d in slims if d.slim is not None),
        latest=run.latest,
        best=run.best,
        left_out=run.left_out,
        aliases=run.aliases,
    )


def _refuse_one_checkpoint(run_dir: str, run: RunReport) -> None:
    """Refuse a folder that is one checkpoint (its own files at its top, no step checkpoint
    below): judged as a run it held nothing to delete, and prune said so with exit 0, which a
    retention job takes for done (UsageError, naming the run folder to prune instead)."""
    if run.checkpoints or not run.root_files:
        return
    parent = run_folder_above(run_dir)
    if parent is None:
        fix = "Point at the run folder that holds checkpoint-N/, step-N/ or *.ckpt saves."
    else:
        fix = (
            f"Prune its run folder with the same options: `ckpt prune {parent} ...` (a plan; "
            "--yes deletes)."
        )
    raise UsageError(
        "is one checkpoint, not a run folder of checkpoints: prune removes whole checkpoints "
        "of a run",
        path=run_dir,
        fix=fix,
    )


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
    validate_policy(policy)
    remote = is_remote(run_dir)
    if remote and policy.slim_older_than:
        raise UsageError(
            "--slim-older-than rewrites checkpoints and works on local run folders only",
            path=str(run_dir),
            fix="Slim the local run folder, then `ckpt sync` it; remote saves can be pruned.",
        )
    if remote and yes and is_hub_url(str(run_dir)):
        raise UsageError(
            "deleting from a Hub repository is a commit, which ckpt does not make",
            path=str(run_dir),
            fix="Read the plan without --yes, then delete each folder with "
            "`hf repos delete-files ORG/REPO 'checkpoint-N/*'` or "
            "`HfApi().delete_folder('checkpoint-N', repo_id='ORG/REPO')`.",
        )
    parse_location(str(run_dir))  # a URL with no bucket is refused before it is trimmed
    root: Path | str = str(run_dir).rstrip("/") if remote else Path(run_dir)
    if yes and isinstance(root, Path):
        # a save a killed slim (or `--force` replace) had moved aside, its new copy not yet
        # in place: put back before the plan, which then judges it as any save
        for note in recover_old_copies_in(root):
            notice(note)
    run = scan_run(root, metric=policy.keep_best, mode=policy.mode, settle=policy.settle)
    _refuse_one_checkpoint(str(root), run)
    if strict_metric and run.best is not None and run.best.name is None:
        fix = (
            "Check the metric name; values come from metrics.jsonl "
            '({"step": N, "METRIC": value} per line), trainer_state.json log_history, '
            "or Lightning file names (…-val_loss=0.25.ckpt)."
        )
        if any(c.save_number is not None for c in run.checkpoints):
            fix += (
                " accelerate's automatic names (checkpoint_N) count saves, not steps, so no "
                "step-keyed row matches them: name each save after its step "
                "(save_state(f'checkpoints/step_{step}'))."
            )
        raise NotFoundError(
            f"no value of {policy.keep_best!r} for any complete checkpoint",
            path=root,
            fix=fix,
        )
    report = plan_report(run, policy, str(root))
    report.applied = yes
    decisions = report.decisions
    doomed = [d for d in decisions if d.action == "delete"]
    if yes and remote and doomed:
        apply_remote(str(root), decisions)
        report.deleted = [d.name for d in decisions if d.deleted]
        report.bytes_freed = sum(d.size for d in decisions if d.deleted)
        report.failed = [
            f"{d.name}: {d.error}" for d in decisions if d.error not in (None, VANISHED)
        ]
    elif yes and not remote:
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
    validate_policy(policy)
    if interval <= 0:
        raise UsageError(
            f"--watch needs a positive number of seconds (got {interval:g})",
            fix="Give the interval in seconds, e.g. --watch 300.",
        )
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
            if faults.received is not None:  # one swallowed on its way (a torch import)
                raise KeyboardInterrupt
            sleep(interval)
    except KeyboardInterrupt:
        result.stopped = "interrupted"
        faults.answer_stop()
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
        raise UsageError(
            "--max-iterations only applies with --watch",
            fix="Add --watch SECONDS, or leave --max-iterations out.",
        )
    if watch_seconds is None:
        return prune(run_dir, policy, yes=yes)
    return watch(run_dir, policy, watch_seconds, max_iterations=max_iterations, on_round=on_round)


def exit_code(report: PruneReport | WatchReport) -> int:
    """1 when a deletion failed (in any round)."""
    if isinstance(report, WatchReport):
        return 1 if any(r.failed for r in report.rounds) else 0
    return 1 if report.failed else 0
