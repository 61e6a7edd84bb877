"""`scan_run` and `looks_like_run` for a local run folder (remote run folders: `remote.py`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from ..errors import NotFoundError, UsageError
from .judge import _best_by_metric, _deepspeed_latest, _judge, _name_in_run, _trainer_state
from .naming import (
    _CKPT_EXT,
    _discover,
    _expected_parts,
    _int_or_none,
    _match_name,
    _name_order,
    _scan_dirs,
)
from .records import DEFAULT_SETTLE, RunCheckpoint, RunReport, _Found
from .remote import is_remote, looks_like_remote_run, scan_remote_run


def scan_run(
    run_dir: str | Path,
    *,
    metric: str | None = None,
    mode: Literal["min", "max"] = "min",
    settle: float = DEFAULT_SETTLE,
    now: float | None = None,
    until_latest: bool = False,
) -> RunReport:
    """List and judge the checkpoints of `run_dir` (see the module docstring for the rules).

    Args:
        run_dir: the run folder (the Trainer's `output_dir`, a torchtitan dump folder...).
        metric: judge best-by-metric on this metric name (`eval_loss`).
        mode: `min` or `max`: which end of `metric` is best.
        settle: seconds since the last write below which an incomplete save is `writing`.
        now: the current time (tests of the settle window pass one).
        until_latest: judge from the newest save down and stop at the first complete one
            (`checkpoints` then holds only those): what `ckpt latest` needs, and no more.
    """
    if is_remote(run_dir):
        return scan_remote_run(
            str(run_dir),
            metric=metric,
            mode=mode,
            settle=settle,
            now=now,
            until_latest=until_latest,
        )
    root = Path(str(run_dir).removeprefix("file://"))
    if not root.exists():
        raise NotFoundError("no such folder", path=root, fix="Check the run folder's path.")
    if not root.is_dir():
        raise UsageError(
            "is not a folder",
            path=root,
            fix="Pass the run folder that holds the step checkpoints (checkpoint-N/...).",
        )
    now = time.time() if now is None else now
    found = _discover(root)
    ds_latest = _deepspeed_latest(root)
    ds_step = _int_or_none(ds_latest.removeprefix("global_step")) if ds_latest else None
    expected = _expected_parts(found)
    judged: list[RunCheckpoint] = []
    for item in sorted(found, key=_name_order, reverse=True):
        judged.append(_judge(item, root, now, settle, ds_step, expected.get(id(item))))
        if until_latest and judged[-1].complete and not judged[-1].slim:
            break
    checkpoints = sorted(judged, key=lambda c: c.order)
    report = RunReport(
        run_dir=str(root),
        layouts=sorted({c.layout for c in checkpoints}),
        checkpoints=checkpoints,
        settle=settle,
        root_files=_root_files(root, found),
    )
    newest = report.newest_complete
    if newest is not None:
        newest.markers.append("newest")
        report.latest = newest.path
    if ds_latest:
        for c in checkpoints:
            if c.layout == "deepspeed" and Path(c.path).name == ds_latest:
                c.markers.append("deepspeed-latest")
                report.deepspeed_latest = c.name
    _mark_link_targets(root, checkpoints)
    state = _trainer_state(root, checkpoints)
    trainer_doc = None
    if state is not None:
        state_path, trainer_doc = state
        report.trainer_state = str(state_path)
        pointer = trainer_doc.get("best_model_checkpoint")
        if isinstance(pointer, str) and pointer:
            report.trainer_best = _name_in_run(root, pointer, checkpoints)
            best_metric = trainer_doc.get("best_metric")
            if isinstance(best_metric, int | float):
                report.trainer_best_metric = float(best_metric)
            for c in checkpoints:
                if c.name == report.trainer_best:
                    c.markers.append("trainer-best")
    if metric:
        report.best = _best_by_metric(root, metric, mode, trainer_doc, checkpoints)
    return report


def _root_files(root: Path, found: list[_Found]) -> list[str]:
    claimed = {p for f in found for p in f.paths}
    return sorted(
        e.name
        for e in root.iterdir()
        if e.is_file() and e.name.endswith(_CKPT_EXT) and e not in claimed
    )


def _mark_link_targets(root: Path, checkpoints: list[RunCheckpoint]) -> None:
    """A checkpoint a symlink in the run folder points at (Lightning `last.ckpt`) is in use."""
    real_root = os.path.realpath(root)
    targets: set[str] = set()
    for folder in _scan_dirs(root):
        for entry in folder.iterdir():
            if entry.is_symlink():
                real = os.path.realpath(entry)
                if real.startswith(real_root + os.sep):
                    targets.add(real)
    for c in checkpoints:
        if not c.symlink and os.path.realpath(c.path) in targets:
            c.markers.append("link-target")


def looks_like_run(path: str | Path) -> bool:
    """Whether `path` is a local run folder holding step checkpoints (not itself a checkpoint).

    A folder named like a step checkpoint (`checkpoint-500`, which may hold a DeepSpeed
    `global_step500/`) is a checkpoint; otherwise one layout folder or Lightning file, or plain
    checkpoints at two different steps and no unnumbered checkpoint file, make a run folder.
    A DeepSpeed save folder with a `latest` file and a single `global_stepN/` is that
    checkpoint (as DeepSpeed reads it); with several tags it is a run folder.
    """
    if is_remote(path):
        return looks_like_remote_run(str(path))
    root = Path(path)
    if not root.is_dir():
        return False
    own = _match_name(root.name, True)
    if own is not None and own[0] != "plain":
        return False
    found = [f for f in _discover(root) if not f.temporary]
    if (root / "latest").is_file() and len(found) == 1 and found[0].layout == "deepspeed":
        return False  # DeepSpeed's save folder with its one tag: `load_checkpoint(dir)` reads it
    if any(f.layout != "plain" for f in found):
        return True
    # numbered files beside unnumbered ones are parts of one checkpoint (accelerate writes
    # model.safetensors, model_1.safetensors...), not steps
    numbered = {p.name for f in found for p in f.paths}
    for entry in root.iterdir():
        is_part = entry.name.endswith(_CKPT_EXT) or entry.name == ".metadata"
        if is_part and entry.name not in numbered:
            return False
    return len({f.step for f in found}) >= 2
