"""Human rendering of `ckpt convert`."""

from __future__ import annotations

from ..ops.convert import ConvertReport
from . import human_bytes, stderr, stdout
from .ranks import render_ranks

#: skipped entries listed by name before the rest are counted
MAX_LISTED = 8


def render_convert(report: ConvertReport) -> None:
    """What was written where, then what was skipped or tied."""
    files = len(report.files)
    stdout.print(
        f"[bold]{report.dest}[/]  ({report.format}, {files} file{'s' if files != 1 else ''})"
        f"  [dim]from {report.source} ({report.source_format})[/]"
    )
    how = [f"{report.raw_copies} copied as raw bytes"] if report.raw_copies else []
    if report.cast:
        how.append(f"{report.casts} cast to {report.cast}")
    if report.renamed:
        how.append(f"{report.renamed} renamed")
    line = f"  {report.tensors} tensors, {human_bytes(report.tensor_bytes)}"
    if report.objects:
        line += f"; {report.objects} non-tensor entries"
    stdout.print(line + (f" ({', '.join(how)})" if how else ""))
    layout = []
    if report.max_shard_size:
        layout.append(f"shards ≤ {human_bytes(report.max_shard_size)}")
    if report.world_size:
        layout.append(f"world size {report.world_size}, {report.dcp_serialization} serialization")
    if layout:
        stdout.print("  " + ", ".join(layout))
    stdout.print("  [green]structure checked before publishing[/]")
    if report.extras:
        stdout.print(f"  carried: {', '.join(report.extras)}", highlight=False, markup=False)
    for warning in report.warnings:
        stderr.print(f"[yellow]ckpt convert: warning:[/] {warning}", highlight=False)
    render_ranks(report.ranks)
    for group in report.tied:
        if group[1] in report.aliases:
            note = f"written once as {group[0]}; the aliases are recorded in __metadata__"
        else:
            note = "each name written"
        stdout.print(f"  tied: {', '.join(group)} share storage ({note})", highlight=False)
    if report.skipped:
        # grouped by parent so 50 optimizer hyper-parameters read as one line
        groups: dict[str, int] = {}
        for entry in report.skipped:
            parent = entry.name.rsplit(".", 1)[0] if "." in entry.name else entry.name
            groups[parent] = groups.get(parent, 0) + 1
        listed = [f"{name}.* ({n})" if n > 1 else name for name, n in groups.items()]
        more = f", … {len(listed) - MAX_LISTED} more" if len(listed) > MAX_LISTED else ""
        stderr.print(
            f"[yellow]skipped {len(report.skipped)} non-tensor entries[/] "
            f"({report.skipped[0].reason}): {', '.join(listed[:MAX_LISTED])}{more}",
            highlight=False,
        )
