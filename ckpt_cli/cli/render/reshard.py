"""Human rendering of `ckpt reshard`."""

from __future__ import annotations

from ...ops.reshard.run import ReshardReport
from ...sizes import counted
from . import human_bytes, one_line, stderr, stdout
from .left_out import render_not_in_output
from .ranks import render_ranks

_ACTIONS = {
    "carry": "carried unchanged (same world size)",
    "keep": "copied as saved (--rank-state keep)",
    "drop": "left out (--rank-state drop)",
    "replicate": "new ranks get a copy of rank 0's (--rank-state replicate)",
}


def render_reshard(report: ReshardReport) -> None:
    """A few lines: what was written, how it was cut, what happened to per-rank state."""
    files = [f for f in report.files]
    size = sum(f.size or 0 for f in files)
    if report.mode == "shard-size":
        how = f"shards of at most {human_bytes(report.max_shard_size)}"
        if report.raw_copy:
            how += f", {report.raw_copy} tensors copied as raw bytes"
    elif report.partitioning == "zero":
        how = (
            f"{report.source_world_size} -> {report.world_size} ranks (ZeRO partitions re-cut "
            f"as {counted(report.world_size or 1, 'rank')} save them: DeepSpeed's "
            "load_checkpoint resumes it "
            "at that size with the same config)"
        )
    elif report.serialization is None and not report.parts:
        # a training folder of whole files (accelerate without FSDP, FULL_STATE_DICT): only
        # its per-rank files change with the world size
        how = (
            f"{report.source_world_size} -> {report.world_size} ranks (no file is cut by rank: "
            "weights and optimizer state are whole files, copied as saved)"
        )
    else:
        cuts = ", ".join(f"{n} on dim {d}" for d, n in sorted(report.sharded.items()))
        how = (
            f"{report.source_world_size} -> {report.world_size} ranks "
            f"({cuts or 'none'} sharded, {report.replicated} replicated; "
            f"{report.serialization} serialization)"
        )
    verb = "[bold]would reshard[/]" if report.dry_run else "[bold green]resharded[/]"
    kind = report.layout or report.format
    stdout.print(f"{verb} {report.source} -> [bold]{report.destination}[/]  [dim]{kind}[/]")
    stdout.print(f"  {how}")
    for part in report.parts:
        stdout.print(
            f"  re-cut {part.path} ({part.component}): {counted(part.tensors, 'tensor')}, "
            f"{counted(part.objects, 'object')}, {part.source_world_size} -> "
            f"{report.world_size} ranks",
            highlight=False,
            markup=False,
        )
    stdout.print(
        f"  {counted(report.tensors, 'tensor')}, {counted(report.objects, 'object')}, "
        f"{human_bytes(report.tensor_bytes)} of tensor data in {counted(len(files), 'file')} "
        # a dry run's DCP files are sized as they are written
        f"({human_bytes(size) if all(f.size is not None for f in files) else 'sizes decided when written'})"
    )
    if report.carried:
        what = (
            "copied verbatim" if report.mode == "world-size" else "training state copied unchanged"
        )
        stdout.print(
            f"  {what}: {', '.join(map(one_line, report.carried))}",
            highlight=False,
            markup=False,
        )
    for item in report.rank_files:
        if item.action == "dropped":
            done = "left out"
        elif item.written == [item.path]:
            done = "carried"
        else:
            done = "-> " + ", ".join(item.written)
        stdout.print(
            f"  per-rank file {item.path} (rank {item.rank}): {done}", highlight=False, markup=False
        )
    if report.extras:
        stdout.print(
            f"  carried: {', '.join(map(one_line, report.extras))}", highlight=False, markup=False
        )
    # the report's `warnings` go to stderr from `run_command`, as for every command
    if report.rules:
        stdout.print(f"  rules: {'  '.join(report.rules)}")
    for rule in report.unused_rules:
        stderr.print(f"[yellow]ckpt reshard: warning:[/] rule {rule} matched no tensor")
    if report.rank_state_action and not report.rank_state and report.rank_files:
        stdout.print(f"  per-rank files: {_ACTIONS[report.rank_state_action]}")
    if report.rank_state and report.rank_state_action:
        names = ", ".join(e.name for e in report.rank_state[:6])
        more = f" +{len(report.rank_state) - 6} more" if len(report.rank_state) > 6 else ""
        stdout.print(
            f"  per-rank state ({len(report.rank_state)}: {names}{more}): "
            f"{_ACTIONS[report.rank_state_action]}"
        )
    if report.resume is not None:
        verdict = report.resume
        stdout.print(
            f"  resumable: {'yes' if verdict.resumable else 'no'}, "
            f"exact: {'yes' if verdict.exact else 'no'}",
            highlight=False,
        )
        for reason in verdict.reasons:
            if reason not in report.warnings:  # those are on stderr already
                stdout.print(f"    {reason}", highlight=False, markup=False)
    if report.dry_run:
        for f in files:
            size_text = human_bytes(f.size) if f.size is not None else "size decided when written"
            stdout.print(f"  file  {f.path}  {size_text}  ({f.entries} entries)", markup=False)
        stdout.print("  nothing was written (--dry-run)")
    else:
        stdout.print("  [green]verified[/] before publishing" if report.verified else "")
        render_ranks(report.ranks)
    render_not_in_output(report.skipped)
