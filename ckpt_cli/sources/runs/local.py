"""`scan_run` and `looks_like_run` for a local run folder (remote run folders: `remote.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ...errors import NotFoundError, UsageError
from ...formats.base import Source
from ...formats.names import CHECKPOINT_SUFFIXES, is_checkpoint_file
from ...storage import LocalStorage, Storage
from .judge import judge_found, newest_trainer_state, read_deepspeed_latest
from .naming import (
    discover_local,
    expected_parts_of_folders,
    listed,
    match_name,
    name_order,
    scan_dirs,
)
from .records import DEFAULT_SETTLE, METRICS_FILE, Found, RunCheckpoint, RunReport
from .remote import is_remote, looks_like_remote_run, scan_remote_run
from .scan import RunFolder, scan


def scan_run(
    run_dir: str | Path | Source,
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
            run_dir if isinstance(run_dir, Source) else str(run_dir),
            metric=metric,
            mode=mode,
            settle=settle,
            now=now,
            until_latest=until_latest,
        )
    root = _local_root(run_dir)
    if not root.exists():
        raise NotFoundError("no such folder", path=root, fix="Check the run folder's path.")
    if not root.is_dir():
        raise UsageError(
            "is not a folder",
            path=root,
            fix="Pass the run folder that holds the step checkpoints (checkpoint-N/...).",
        )
    storage = None
    if isinstance(run_dir, Source) and run_dir.storage.local_root is not None:
        storage = run_dir.storage if run_dir.target is None else None  # resolved: reused
    return scan(
        _LocalRun(root, storage),
        metric=metric,
        mode=mode,
        settle=settle,
        now=now,
        until_latest=until_latest,
    )


class _LocalRun(RunFolder[Found]):
    """A run folder on this machine: walked with links seen (never followed out of the run),
    each component judged by its format's `check`."""

    def __init__(self, root: Path, storage: Storage | None = None) -> None:
        self.root = root
        self.display = str(root)
        # the run's own small files (`latest`, `trainer_state.json`, `metrics.jsonl`) are read
        # through the run folder's storage (the one it was resolved to, when it was): regular
        # files inside the run only
        self.storage = storage or LocalStorage(root)
        self._listings: dict[Path, list[Path]] = {}

    def _list(self, folder: Path) -> list[Path]:
        """A folder of the run, listed once per scan: discovery, the root's loose files and the
        link marks read the same listing."""
        if folder not in self._listings:
            self._listings[folder] = listed(folder)
        return self._listings[folder]

    def discover(self) -> list[Found]:
        return discover_local(self.root, self._list)

    def order(self, item: Found) -> tuple[float, float, float]:
        return name_order(item)

    def judge(
        self,
        item: Found,
        now: float,
        settle: float,
        ds_latest_step: int | None,
        expected: set[str] | None,
    ) -> RunCheckpoint:
        return judge_found(item, self.root, now, settle, ds_latest_step, expected)

    def expected_parts(self, items: list[Found]) -> dict[int, set[str]]:
        return expected_parts_of_folders(items)

    def deepspeed_latest(self) -> str | None:
        return read_deepspeed_latest(self.storage)

    def root_files(self, items: list[Found]) -> list[str]:
        return _root_files(self._list(self.root), items)

    def trainer_state(self, checkpoints: list[RunCheckpoint]) -> tuple[str, dict[str, Any]] | None:
        return newest_trainer_state(self.storage, checkpoints)

    def metrics_file(self) -> tuple[str, str] | None:
        if not self.storage.exists(METRICS_FILE):
            return None
        raw = self.storage.read_all(METRICS_FILE)
        return self.storage.describe(METRICS_FILE), raw.decode("utf-8", "replace")

    def mark_links(self, checkpoints: list[RunCheckpoint]) -> None:
        _mark_link_targets(self.root, checkpoints, self._list)


def _root_files(entries: list[Path], found: list[Found]) -> list[str]:
    claimed = {p for f in found for p in f.paths}
    return sorted(
        e.name
        for e in entries
        if e.is_file() and e.name.endswith(CHECKPOINT_SUFFIXES) and e not in claimed
    )


def _mark_link_targets(
    root: Path, checkpoints: list[RunCheckpoint], list_dir: Callable[[Path], list[Path]]
) -> None:
    """A checkpoint a symlink in the run folder points at (Lightning `last.ckpt`) is in use."""
    real_root = os.path.realpath(root)
    targets: set[str] = set()
    for folder in scan_dirs(root):
        for entry in list_dir(folder):
            if entry.is_symlink():
                real = os.path.realpath(entry)
                if real.startswith(real_root + os.sep):
                    targets.add(real)
    for c in checkpoints:
        if not c.symlink and os.path.realpath(c.path) in targets:
            c.markers.append("link-target")


def _local_root(run_dir: str | Path | Source) -> Path:
    if isinstance(run_dir, Source) and run_dir.location.path is not None:
        return run_dir.location.path
    return Path(str(run_dir).removeprefix("file://"))


def looks_like_run(path: str | Path | Source) -> bool:
    """Whether `path` is a local run folder holding step checkpoints (not itself a checkpoint).

    A folder named like a step checkpoint (`checkpoint-500`, which may hold a DeepSpeed
    `global_step500/`) is a checkpoint; otherwise one layout folder or Lightning file, or plain
    checkpoints at two different steps and no unnumbered checkpoint file, make a run folder.
    A DeepSpeed save folder with a `latest` file and a single `global_stepN/` is that
    checkpoint (as DeepSpeed reads it); with several tags it is a run folder.
    """
    if is_remote(path):
        return looks_like_remote_run(path if isinstance(path, Source) else str(path))
    root = _local_root(path)
    if not root.is_dir():
        return False
    own = match_name(root.name, True)
    if own is not None and own[0] != "plain":
        return False
    found = [f for f in discover_local(root) if not f.temporary]
    if (root / "latest").is_file() and len(found) == 1 and found[0].layout == "deepspeed":
        return False  # DeepSpeed's save folder with its one tag: `load_checkpoint(dir)` reads it
    if any(f.layout != "plain" for f in found):
        return True
    # numbered files beside unnumbered ones are parts of one checkpoint (accelerate writes
    # model.safetensors, model_1.safetensors...), not steps
    numbered = {p.name for f in found for p in f.paths}
    for entry in root.iterdir():
        is_part = is_checkpoint_file(entry.name)
        if is_part and entry.name not in numbered:
            return False
    return len({f.step for f in found}) >= 2
