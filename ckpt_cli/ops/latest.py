"""`latest`: the newest complete checkpoint of a run folder (see `runs` for the rules)."""

from __future__ import annotations

from pathlib import Path

from ..errors import CkptError, NoCheckpointError, NotFoundError
from ..models import Request
from ..sources.runs import DEFAULT_SETTLE, RunReport, scan_run
from ..sources.runs.naming import run_folder_above


class LatestRequest(Request):
    """Every option of `latest` but the run folder, typed and frozen: built once (by the
    command, or by `latest` from its keywords) and passed down whole. Its fields are `latest`'s
    keyword parameters: the command's `--settle`, and `full`, which the command derives from
    `--json` (the table of every checkpoint); a test holds them to each other.

    Attributes:
        settle: seconds since the last write below which an incomplete save is `writing`.
        full: judge every checkpoint; without it judging stops at the newest complete one
            (older ones are not read).
    """

    settle: float = DEFAULT_SETTLE
    full: bool = True


def latest(run_dir: str | Path, *, settle: float = DEFAULT_SETTLE, full: bool = True) -> RunReport:
    """Scan `run_dir`; `report.latest` is the newest complete checkpoint's path, or None.

    Without `full`, judging stops at the newest complete checkpoint (older ones are not read).
    """
    return latest_with(run_dir, LatestRequest(settle=settle, full=full))


def latest_with(run_dir: str | Path, request: LatestRequest) -> RunReport:
    """`latest` of `run_dir` as `request` says (the command's one call)."""
    return scan_run(run_dir, settle=request.settle, until_latest=not request.full)


def exit_code(report: RunReport) -> int:
    """3 (not found) when the run folder holds no complete checkpoint."""
    return 0 if report.latest is not None else 3


def none_found(report: RunReport) -> CkptError:
    """Why `report` names no checkpoint (exit 3), with the fix: its saves' verdicts, or, of a
    folder that is one checkpoint itself (`ckpt latest out/checkpoint-500`), the run folder to
    ask instead."""
    if report.checkpoints:
        return NotFoundError(
            "no complete checkpoint",
            path=report.run_dir,
            fix="Each checkpoint's status and reason say why (listed below it; with --json, "
            "in result.checkpoints).",
        )
    if report.root_files:
        above = run_folder_above(report.run_dir)
        return NoCheckpointError(
            "is one checkpoint, not a run folder of checkpoints",
            path=report.run_dir,
            fix=f"`ckpt latest {above}` names the newest complete checkpoint of its run folder."
            if above is not None
            else "Point at the run folder that holds checkpoint-N/, step-N/ or *.ckpt saves.",
        )
    return NoCheckpointError(
        "no step checkpoints found",
        path=report.run_dir,
        fix="Point at the folder that holds checkpoint-N/, step-N/ or *.ckpt saves.",
    )
