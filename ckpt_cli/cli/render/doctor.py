"""Human rendering of `ckpt doctor`: the verdict, the ranked causes with their evidence and fix,
then the resume points with the loss / LR on both sides."""

from __future__ import annotations

from ...ops.doctor import Cause, DoctorReport, ResumePoint
from . import stdout


def _cause(cause: Cause) -> None:
    where = f"{cause.before} → {cause.after}" if cause.before else cause.after
    label = "declared" if cause.declared else f"{cause.rank}."
    colour = "dim" if cause.declared else "red" if cause.rank == 1 else "yellow"
    stdout.print(f"[bold {colour}]{label}[/] [bold]{cause.id}[/]  ", end="", highlight=False)
    stdout.print(f"{cause.title}  ({where}, score {cause.score:.2f})", markup=False)
    for line in cause.evidence:
        stdout.print(f"     · {line}", markup=False, highlight=False)
    stdout.print(f"     fix: {cause.fix}", markup=False, highlight=False)


def _save(name: str, step: int | None) -> str:
    """`checkpoint-4 (step 4)`; the name alone when the step is unknown (accelerate's
    automatic `checkpoint_N` counts saves)."""
    return name if step is None else f"{name} (step {step})"


def _point(point: ResumePoint) -> str:
    text = f"  {_save(point.before, point.step_before)} → {_save(point.after, point.step_after)}"
    if point.resumed:
        text += f"  resumed ({', '.join(point.how)})"
    log = point.log
    if log is not None:
        parts = []
        if log.loss_before is not None and log.loss_after is not None:
            parts.append(
                f"loss {log.loss_before:.4g} @ {log.step_before} → {log.loss_after:.4g} @ "
                f"{log.step_after}"
            )
        if log.lr_before is not None and log.lr_after is not None:
            parts.append(f"lr {log.lr_before:.3g} → {log.lr_after:.3g}")
        if parts:
            text += "  [" + ", ".join(parts) + "]"
    return text


def render_doctor(report: DoctorReport) -> None:
    """Verdict, ranked causes (evidence, fix), then the resume points and notes."""
    colour = "red" if report.found else "green"
    stdout.print(f"[bold {colour}]{report.verdict}[/]", highlight=False, markup=True)
    stdout.print(
        f"  {report.run_dir}  ({report.mode}: {len(report.checkpoints)} "
        f"save{'' if len(report.checkpoints) == 1 else 's'})",
        markup=False,
        highlight=False,
    )
    for cause in report.causes:
        _cause(cause)
    if report.resume_points:
        stdout.print("[bold]saves examined[/]")
        for point in report.resume_points:
            stdout.print(_point(point), markup=False, highlight=False)
            for note in point.notes:
                stdout.print(f"     note: {note}", markup=False, highlight=False)
