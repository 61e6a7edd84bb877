"""Human rendering of `ckpt download`."""

from __future__ import annotations

from rich.table import Table

from ...ops.download import DownloadReport
from . import human_bytes, stdout


def render_download(report: DownloadReport) -> None:
    """What was (or would be) fetched: files or ranges, bytes, where it went."""
    verb = "would fetch" if report.dry_run else "fetched"
    stdout.print(
        f"[bold]{report.repo}[/]@{report.revision} ({report.commit[:12]}), {report.mode} mode: "
        f"{report.tensors_selected} of {report.tensors_total} tensors"
        + (f", {human_bytes(report.selected_bytes)}" if report.selected_bytes is not None else "")
    )
    if report.ranges:
        waste = sum(r.waste for r in report.ranges)
        files = len({r.file for r in report.ranges})
        stdout.print(
            f"  {len(report.ranges)} range requests over {files} shard{'s' if files != 1 else ''}"
            + (f" ({human_bytes(waste)} of coalesced gaps)" if waste else "")
        )
        if report.dry_run:
            table = Table(box=None, pad_edge=False, show_edge=False)
            for column in ("file", "bytes", "length", "tensors"):
                table.add_column(column, overflow="fold")
            for r in report.ranges:
                shown = ", ".join(r.tensors[:3]) + (
                    f" … +{len(r.tensors) - 3}" if len(r.tensors) > 3 else ""
                )
                table.add_row(r.file, f"{r.start}-{r.end - 1}", human_bytes(r.length), shown)
            stdout.print(table)
    if report.files:
        table = Table(box=None, pad_edge=False, show_edge=False)
        for column in ("file", "size", "status"):
            table.add_column(column, overflow="fold")
        for f in report.files:
            status = f.status + (" ✓" if f.verified else "")
            size = "-" if f.kind == "index" and not f.size else human_bytes(f.size)
            table.add_row(f.path, size, status)
        stdout.print(table)
    if report.integrity and not report.dry_run:
        # what a ranged download can prove, said plainly (stderr: not data)
        from . import stderr

        stderr.print(f"  checked: {report.integrity}", highlight=False, markup=False)
    if report.dry_run:
        stdout.print(
            f"  {verb} {human_bytes(report.bytes_planned)}"
            + (
                f" ({human_bytes(report.bytes_resumed)} already present from an unfinished run)"
                if report.bytes_resumed
                else ""
            )
            + "; nothing was downloaded"
        )
        render_skipped(report)
        return
    cached = [f for f in report.files if f.status == "cached"]
    stdout.print(
        f"  {verb} {human_bytes(report.bytes_transferred)}"
        f" (+{human_bytes(report.metadata_bytes)} of headers and indexes)"
        + (
            f"; {human_bytes(report.bytes_from_cache)} read from the HF cache"
            if report.bytes_from_cache
            else ""
        )
        + (
            f"; {human_bytes(sum(f.size for f in cached))} in {len(cached)}"
            f" file{'s' if len(cached) != 1 else ''} already in the HF cache"
            if cached
            else ""
        )
        + (
            f"; {human_bytes(report.bytes_resumed)} resumed from an unfinished run"
            if report.bytes_resumed
            else ""
        )
    )
    if report.dest:
        stdout.print(f"  wrote {report.dest}")
    elif report.cache_only:
        stdout.print("  files are in the Hugging Face cache")
    render_skipped(report)


#: files named per reason on a `not fetched` line; the rest are counted
NAMED_SKIPPED = 3


def render_skipped(report: DownloadReport) -> None:
    """The repository's files not fetched, on stderr: one line a reason (a filter that leaves
    160 shards reads as one line, naming a few of them)."""
    from . import stderr

    by_reason: dict[str, list[str]] = {}
    for item in report.skipped:
        by_reason.setdefault(item.reason, []).append(item.name)
    for reason, names in by_reason.items():
        shown = ", ".join(names[:NAMED_SKIPPED])
        if len(names) > NAMED_SKIPPED:
            shown = f"{len(names)} files ({shown} … +{len(names) - NAMED_SKIPPED})"
        stderr.print(f"[yellow]not fetched:[/] {shown}: {reason}", highlight=False)
