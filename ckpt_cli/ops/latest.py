"""`latest`: the newest complete checkpoint of a run folder (see `runs` for the rules)."""

from __future__ import annotations

from pathlib import Path

from ..sources.runs import DEFAULT_SETTLE, RunReport, scan_run


def latest(run_dir: str | Path, *, settle: float = DEFAULT_SETTLE, full: bool = True) -> RunReport:
    """Scan `run_dir`; `report.latest` is the newest complete checkpoint's path, or None.

    Without `full`, judging stops at the newest complete checkpoint (older ones are not read).
    """
    return scan_run(run_dir, settle=settle, until_latest=not full)


def exit_code(report: RunReport) -> int:
    """3 (not found) when the run folder holds no complete checkpoint."""
    return 0 if report.latest is not None else 3
