"""The one run-folder scanner: `scan` drives a `RunFolder` (local: `local.py`; object stores and
the Hub: `remote.py`) through the same steps, so both apply the same rules in the same order.

A `RunFolder` knows how to list its candidates and judge one of them (a local folder walks the
file system, follows links and runs each component's `Format.check`; a remote one reads its
`Storage` listing and headers); everything between is here: the newest-first judging that
`ckpt latest` stops early, the `newest` / `deepspeed-latest` / `trainer-best` markers, the
Trainer's best pointer and best-by-metric.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from .judge import best_by_metric
from .naming import int_or_none
from .records import RunCheckpoint, RunReport

Item = TypeVar("Item")


class RunFolder(ABC, Generic[Item]):
    """One run folder as the scanner sees it: candidates (`Item`s) and how to judge each.

    Attributes:
        display: how the run folder is named in the report (`RunReport.run_dir`).
    """

    display: str

    @abstractmethod
    def discover(self) -> list[Item]:
        """The candidate checkpoints, named by the rules of `naming.classify`."""

    @abstractmethod
    def order(self, item: Item) -> tuple[float, float, float]:
        """Newest-first sort key known before judging (`naming.step_order`)."""

    @abstractmethod
    def judge(
        self,
        item: Item,
        now: float,
        settle: float,
        ds_latest_step: int | None,
        expected: set[str] | None,
    ) -> RunCheckpoint:
        """Complete, incomplete, interrupted or writing (see the package docstring)."""

    @abstractmethod
    def expected_parts(self, items: list[Item]) -> dict[int, set[str]]:
        """id(item) -> the files every other save of an unmarked layout has."""

    @abstractmethod
    def deepspeed_latest(self) -> str | None:
        """The tag DeepSpeed's `latest` file names (`naming.deepspeed_tag`), if any."""

    @abstractmethod
    def root_files(self, items: list[Item]) -> list[str]:
        """Checkpoint files directly in the run folder that belong to no step checkpoint."""

    @abstractmethod
    def trainer_state(self, checkpoints: list[RunCheckpoint]) -> tuple[str, dict[str, Any]] | None:
        """(where, document) of the `trainer_state.json` the Trainer markers come from."""

    @abstractmethod
    def metrics_file(self) -> tuple[str, str] | None:
        """(where, text) of the run's `metrics.jsonl`, if it has one."""

    def mark_links(self, checkpoints: list[RunCheckpoint]) -> None:
        """Mark checkpoints a link in the run folder points at (only local folders have links)."""

    def close(self) -> None:
        """Finish with the folder's storage."""


def scan(
    run: RunFolder[Any],
    *,
    metric: str | None,
    mode: Literal["min", "max"],
    settle: float,
    now: float | None,
    until_latest: bool,
) -> RunReport:
    """List and judge the checkpoints of `run` (arguments as for `scan_run`)."""
    now = time.time() if now is None else now
    items = run.discover()
    ds_latest = run.deepspeed_latest()
    ds_step = int_or_none(ds_latest.removeprefix("global_step")) if ds_latest else None
    expected = run.expected_parts(items)
    judged: list[RunCheckpoint] = []
    for item in sorted(items, key=run.order, reverse=True):
        judged.append(run.judge(item, now, settle, ds_step, expected.get(id(item))))
        if until_latest and judged[-1].complete and not judged[-1].slim:
            break
    checkpoints = sorted(judged, key=lambda c: c.order)
    report = RunReport(
        run_dir=run.display,
        layouts=sorted({c.layout for c in checkpoints}),
        checkpoints=checkpoints,
        settle=settle,
        root_files=run.root_files(items),
    )
    newest = report.newest_complete
    if newest is not None:
        newest.markers.append("newest")
        report.latest = newest.path
    if ds_latest:
        for c in checkpoints:
            if c.layout == "deepspeed" and _base_name(c.name) == ds_latest:
                c.markers.append("deepspeed-latest")
                report.deepspeed_latest = c.name
    run.mark_links(checkpoints)
    state = run.trainer_state(checkpoints)
    trainer_doc = None
    if state is not None:
        report.trainer_state, trainer_doc = state
        pointer = trainer_doc.get("best_model_checkpoint")
        if isinstance(pointer, str) and pointer:
            # a path recorded by the trainer (absolute, or relative to its cwd): its last name
            base = _base_name(pointer)
            report.trainer_best = next(
                (c.name for c in checkpoints if _base_name(c.name) == base), None
            )
            best_metric = trainer_doc.get("best_metric")
            if isinstance(best_metric, int | float):
                report.trainer_best_metric = float(best_metric)
            for c in checkpoints:
                if c.name == report.trainer_best:
                    c.markers.append("trainer-best")
    if metric:
        # never a metrics file of the current folder: the run's own, or none ("")
        report.best = best_by_metric(
            Path("."), metric, mode, trainer_doc, checkpoints, run.metrics_file() or ("", "")
        )
        if report.best.source == "":
            report.best.source = None
    run.close()
    return report


def _base_name(name: str) -> str:
    """The last component of a `/`-separated name (`checkpoints/checkpoint_3` -> `checkpoint_3`)."""
    return name.rstrip("/").rsplit("/", 1)[-1]
