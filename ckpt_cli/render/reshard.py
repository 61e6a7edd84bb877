"""Human rendering of `ckpt reshard`."""

from __future__ import annotations

from ..ops.reshard import ReshardReport
from . import counted, human_bytes, stderr, stdout
from .ranks import render_ranks

_ACTIONS = {
    "carry": "carried unchanged (same world size)",
    "keep": "copied as-is (--keep-rank-state)",
    "drop": "left out (--drop-rank-state)",
}


def render_reshard(report: ReshardReport) -> None:
    """A few lines: what was written, how it was cut, what happened to per-rank state."""
    files = [f for f in report.files]
    size = sum(f.size or 0 for f in files)
    if report.mode == "shard-size":
        how = f"shards of at most {human_bytes(report.max_shard_size)}"
        if report.raw_copy:
            how += f", {report.raw_copy} tensors copied as raw bytes"
    else:
        cuts = ", ".join(f"{n} on dim {d}" for d, n in sorted(report.sharded.items()))
        how = (
            f"{report.source_world_size} -> {report.world_size} ranks "
            f"({cuts or 'none'} sharded, {report.replicated} replicated; "
            f"{report.serialization} serialization)"
        )
    verb = "[bold]would reshard[/]" if report.dry_run else "[bold green]resharded[/]"
    stdout.print(
        f"{verb} {report.source} -> [bold]{report.destination}[/]  [dim]{report.format}[/]"
    )
    stdout.print(f"  {how}")
    stdout.print(
        f"  {counted(report.tensors, 'tensor')}, {counted(report.objects, 'object')}, "
        f"{human_bytes(report.tensor_bytes)} of tensor data in {len(files)} files "
        f"({human_bytes(size)})"
    )
    if report.carried:
        stdout.print(
            f"  training state copied unchanged: {', '.join(report.carried)}",
            highlight=False,
            markup=False,
        )
    if report.extras:
        stdout.print(f"  carried: {', '.join(report.extras)}", highlight=False, markup=False)
    for warning in report.warnings:
        stderr.print(f"[yellow]ckpt reshard: warning:[/] {warning}", highlight=False)
    if report.rules:
        stdout.print(f"  rules: {'  '.join(report.rules)}")
    for rule in report.unused_rules:
        stderr.print(f"[yellow]ckpt reshard: warning:[/] rule {rule} matched no tensor")
    if report.rank_state and report.rank_state_action:
        names = ", ".join(e.name for e in report.rank_state[:6])
        more = f" +{len(report.rank_state) - 6} more" if len(report.rank_state) > 6 else ""
        stdout.print(
            f"  per-rank state ({len(report.rank_state)}: {names}{more}): "
            f"{_ACTIONS[report.rank_state_action]}"
        )
    if report.dry_run:
        for f in files:
            size_text = human_bytes(f.size) if f.size is not None else "size decided when written"
            stdout.print(f"  file  {f.path}  {size_text}  ({f.entries} entries)", markup=False)
        stdout.print("  nothing was written (--dry-run)")
        return
    stdout.print("  [green]verified[/] before publishing" if report.verified else "")
    render_ranks(report.ranks)
