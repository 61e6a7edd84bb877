"""Human rendering of `ckpt protect`."""

from __future__ import annotations

from rich.markup import escape

from ...ops.parity import ProtectReport
from ...sizes import counted
from . import human_bytes, stderr, stdout


def _cost(report: ProtectReport) -> str:
    text = (
        f"{counted(report.files, 'file')}, {human_bytes(report.bytes)}; parity "
        f"{human_bytes(report.parity_bytes)} ({report.overhead:.1%} of it), {report.codec}"
    )
    if report.whole_files and report.largest_bytes * 2 > report.bytes:
        # the overhead is set by the largest file, not by the number of files
        text += (
            f"; whole files: each of the {report.parity} parity shares is as long as the "
            f"largest file, {report.largest_file} ({human_bytes(report.largest_bytes)})"
        )
    return text


def _survival(report: ProtectReport) -> list[str]:
    return [f"survives: {'; '.join(report.survives)}"] + (
        [f"does not survive: {'; '.join(report.does_not_survive)}"]
        if report.does_not_survive
        else []
    )


def render_protect_plan(report: ProtectReport) -> None:
    """Before anything is written: the cost and what the parity will survive, on stderr."""
    stderr.print(f"ckpt protect: {escape(_cost(report))}", highlight=False, soft_wrap=True)
    for line in _survival(report):
        stderr.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


def render_protect(report: ProtectReport) -> None:
    """Where the parity went, what it costs, and what it can rebuild."""
    head = "would write " if report.dry_run else ""
    stdout.print(f"[bold]{head}{escape(report.parity_dir)}[/]", soft_wrap=True)
    stdout.print(f"  {escape(_cost(report))}", soft_wrap=True)
    stdout.print(
        f"  stripes of {report.width} + {report.parity} blocks of {human_bytes(report.block_size)}",
    )
    for line in _survival(report):
        stdout.print(f"  {escape(line)}", soft_wrap=True)
    if report.dry_run:
        stdout.print("  nothing was written (run again without --dry-run to protect)")
