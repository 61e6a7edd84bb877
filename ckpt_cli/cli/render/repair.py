"""Human rendering of `ckpt repair`."""

from __future__ import annotations

from rich.markup import escape

from ...ops.parity import RepairReport, damage_text
from . import human_bytes, stdout


def render_repair(report: RepairReport) -> None:
    """The verdict, then each damaged file and what happened to it."""
    if not report.damaged:
        checked = f"({human_bytes(report.hashed_bytes)} checked)"
        if not (report.rewritten or report.redated):
            stdout.print(
                f"{escape(report.location)}: [bold green]intact[/] {checked}, nothing to repair",
                soft_wrap=True,
            )
            return
        stdout.print(f"{escape(report.location)}: files [green]intact[/] {checked}", soft_wrap=True)
        _print_rewritten(report)
        return
    if report.unrecoverable:
        verdict = (
            "[bold red]cannot be repaired[/] (more losses in a stripe than parity); nothing changed"
        )
    elif report.dry_run:
        verdict = "[bold yellow]would rebuild[/] (dry run; nothing written)"
    else:
        verdict = "[bold green]repaired[/] (checked against the manifest's sha256)"
    stdout.print(f"{escape(report.location)}: {verdict}", soft_wrap=True)
    for d in report.damaged:
        if d.path in report.rebuilt:
            tag = "[green]rebuilt[/]"
        elif not d.repairable:
            tag = "[red]lost[/]"
        else:
            tag = "[yellow]rebuildable[/]" if report.dry_run or report.unrecoverable else ""
        stdout.print(f"  {tag} {escape(damage_text(d))}", highlight=False, soft_wrap=True)
    _print_rewritten(report)
    # the report's `warnings` go to stderr from `run_command`, as for every command


def _print_rewritten(report: RepairReport) -> None:
    """A file written again rather than rebuilt (the unreadable checksum manifest), and the
    intact files dated as when protected."""
    dated = "would be redated" if report.dry_run else "redated"
    for path in report.redated:
        stdout.print(
            f"  [green]{dated}[/] {escape(path)}: intact, but dated after `ckpt protect`; "
            "dated as when protected, so `verify` no longer calls it stale",
            highlight=False,
            soft_wrap=True,
        )
    done = "would be written again" if report.dry_run else "written again"
    for path in report.rewritten:
        stdout.print(
            f"  [green]{done}[/] {escape(path)}: it was not readable; from the parity's sha256 "
            "of each file",
            highlight=False,
            soft_wrap=True,
        )
