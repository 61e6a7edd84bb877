"""Human rendering of `ckpt sync`."""

from __future__ import annotations

import time

from rich.table import Table

from ...ops.sync import SyncReport
from . import errors, human_bytes, stdout

_STYLE = {
    "uploaded": "green",
    "downloaded": "green",
    "present": "",
    "skipped": "yellow",
    "failed": "red",
}


#: a dry run's actions, as the plan says them
_PLANNED = {"uploaded": "upload", "downloaded": "download"}


def render_sync(report: SyncReport) -> None:
    """Every checkpoint with what the sync did, then the totals and the newest remote save."""
    # the bytes go from SRC to DEST either way (a pull's SRC is the remote)
    stdout.print(f"[bold]{report.source}[/] → [bold]{report.dest}[/]", soft_wrap=True)
    done = "uploaded" if report.direction == "up" else "downloaded"
    if report.dry_run:
        done = "in the store" if report.direction == "up" else "pulled"
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("checkpoint", "step", "action", "size", "sent", "notes"):
        table.add_column(column, overflow="fold")
    for c in report.checkpoints:
        style = _STYLE.get(c.action, "")
        notes = []
        if c.verified:
            notes.append("verified")
        if c.files_reused:
            notes.append(
                f"{c.files_reused} file{'s' if c.files_reused != 1 else ''} already {done}"
            )
        if c.reason:
            notes.append(c.reason)
        action: str = c.action
        if report.dry_run and action in _PLANNED:
            action = _PLANNED[action]
        table.add_row(
            c.name,
            str(c.step) if c.step is not None else "?",
            f"[{style}]{action}[/]" if style else action,
            human_bytes(c.bytes),
            human_bytes(c.bytes_sent),
            "; ".join(notes),
        )
    if report.checkpoints:
        stdout.print(table)
    verb = "uploaded" if report.direction == "up" else "downloaded"
    if report.dry_run:
        verb = "would upload" if report.direction == "up" else "would download"
    stdout.print(
        f"{verb} {len(report.transferred)} checkpoint{'s' if len(report.transferred) != 1 else ''}"
        f" ({human_bytes(report.bytes_sent)})"
        + (f" in {report.iterations} rounds" if report.iterations > 1 else "")
    )
    if report.pruned is not None and report.pruned.deleted:
        stdout.print(f"pruned on the remote side: {', '.join(report.pruned.deleted)}")
    if report.dry_run and report.pruned is not None:
        doomed = [d.name for d in report.pruned.decisions if d.action == "delete"]
        stdout.print(
            "would prune on the remote side: " + (", ".join(doomed) if doomed else "nothing"),
            soft_wrap=True,
        )
    now = " now" if report.dry_run else ""
    stdout.print(f"latest complete{now}: {report.latest or '[red]none[/]'}", soft_wrap=True)
    if report.left_out:
        shown = ", ".join(report.left_out[:10])
        more = f" and {len(report.left_out) - 10} more" if len(report.left_out) > 10 else ""
        stdout.print(
            f"not synced, part of no step checkpoint: {shown}{more} (sync carries step "
            "checkpoints, `latest` and `metrics.jsonl`)",
            soft_wrap=True,
        )
    for failure in report.failed:  # the reason of exit 1: printed with --quiet too
        errors.print(f"[red]failed:[/] {failure}", soft_wrap=True)
    if report.dry_run:
        stdout.print("nothing was written (--dry-run)")


def render_sync_round(report: SyncReport) -> None:
    """During `--watch`: one line per checkpoint transferred (quiet rounds print nothing)."""
    stamp = time.strftime("%H:%M:%S")
    for c in report.checkpoints:
        if c.action in ("uploaded", "downloaded"):
            stdout.print(f"{stamp} {c.action} {c.name} ({human_bytes(c.bytes_sent)})")
        elif c.action == "failed":
            errors.print(f"{stamp} [red]failed:[/] {c.name}: {c.reason}")
