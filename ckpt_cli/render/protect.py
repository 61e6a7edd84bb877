"""Human rendering of `ckpt protect`."""

from __future__ import annotations

from rich.markup import escape

from ..ops.parity import ProtectReport
from . import counted, human_bytes, stdout


def render_protect(report: ProtectReport) -> None:
    """Where the parity went, what it costs, and what it can rebuild."""
    stdout.print(f"[bold]{escape(report.parity_dir)}[/]", soft_wrap=True)
    stdout.print(
        f"  {counted(report.files, 'file')}, {human_bytes(report.bytes)} protected; parity "
        f"{human_bytes(report.parity_bytes)} ({report.overhead:.1%}), {report.codec}"
    )
    what = (
        f"any {report.parity} whole files lost"
        if report.whole_files
        else "damaged blocks only (a file this large cannot be rebuilt if lost whole)"
    )
    stdout.print(
        f"  stripes of {report.width} + {report.parity} blocks of "
        f"{human_bytes(report.block_size)}: rebuilds {what}, and any {report.parity} damaged "
        "blocks per stripe"
    )
