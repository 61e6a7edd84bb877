"""Human rendering of `ckpt convert`."""

from __future__ import annotations

from ...ops.convert.run import ConvertReport
from . import human_bytes, one_line, stdout
from .left_out import render_not_in_output
from .ranks import render_ranks


def render_convert(report: ConvertReport) -> None:
    """What was written where, then what was skipped or tied."""
    if report.dry_run:
        render_plan(report)
        return
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
    if report.dequantized:
        how.append(f"{report.dequantized} quantized weights dequantized")
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
    if report.quantized_kept:
        stdout.print(
            f"  --dtype applies to unquantized tensors: {report.quantized_kept} tensors of "
            "quantized weights (packed values and scales) kept as stored (--dequantize "
            "converts FP8, MXFP4, NVFP4 and compressed-tensors INT4/INT8 weights)"
        )
    render_architecture(report)
    if (
        report.config_written
        and report.dequantized
        and report.architecture is None
        and report.config_source is None
    ):
        stdout.print("  config.json written without its quantization section")
    if report.config_dtype:
        done = "were cast to" if report.cast else "are written in"
        stdout.print(f"  config.json says {report.config_dtype}, the dtype the weights {done}")
    stdout.print("  [green]structure checked before publishing[/]")
    if report.extras:
        stdout.print(
            f"  carried: {', '.join(map(one_line, report.extras))}", highlight=False, markup=False
        )
    if report.serving_files:
        stdout.print(
            f"  from {report.config_source}: config.json, {', '.join(report.serving_files)}",
            highlight=False,
            markup=False,
        )
    render_ranks(report.ranks)
    for group in report.tied:
        if group[1] in report.aliases:
            note = f"written once as {group[0]}; the aliases are recorded in __metadata__"
        else:
            note = "each name written"
        stdout.print(f"  tied: {', '.join(group)} share storage ({note})", highlight=False)
    render_not_in_output(report.skipped)


def render_plan(report: ConvertReport) -> None:
    """`--dry-run`: the files and entries that would be written, one per line."""
    stdout.print(
        f"[bold]{report.dest}[/]  (would write {report.format}, {len(report.files)} file"
        f"{'s' if len(report.files) != 1 else ''})  [dim]from {report.source} "
        f"({report.source_format})[/]"
    )
    stdout.print(f"  {report.tensors} tensors, {human_bytes(report.tensor_bytes)}")
    render_architecture(report)
    for f in report.files:
        size = human_bytes(f.size) if f.size is not None else "size decided when written"
        stdout.print(f"  file  {one_line(f.path)}  {size}  ({f.entries} entries)", markup=False)
    if report.extras:
        stdout.print(
            f"  carried: {', '.join(map(one_line, report.extras))}", highlight=False, markup=False
        )
    how = {m.name: m.transform for m in report.architecture.mapped} if report.architecture else {}
    for e in report.entries:
        shape = "[" + ", ".join(str(d) for d in e.shape) + "]"
        transform = how.get(e.name, "rename")
        renamed = f"  ({transform} from {one_line(e.source)})" if e.source != e.name else ""
        stdout.print(
            f"  entry {one_line(e.name)}  {e.dtype or e.kind}  {shape}  {human_bytes(e.nbytes)}{renamed}",
            markup=False,
        )
    stdout.print("  nothing was written (--dry-run)")
    render_not_in_output(report.skipped)


def render_architecture(report: ConvertReport) -> None:
    """The family and namings of a `--to hf` / `--to torchtitan` conversion, and its transforms."""
    arch = report.architecture
    if arch is None:
        return
    counts = ", ".join(f"{n} {t}" for t, n in arch.transforms.items())
    stdout.print(
        f"  {arch.architecture}: {arch.source_naming} names -> {arch.target_naming} names "
        f"({counts})",
        highlight=False,
    )
