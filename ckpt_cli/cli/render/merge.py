"""Human rendering of `ckpt merge`."""

from __future__ import annotations

from ...ops.merge import MergeReport
from ...sizes import counted
from . import human_bytes, stdout
from .left_out import render_not_in_output


def render_merge(report: MergeReport) -> None:
    """What was merged into what, and the files written."""
    size = sum(f.size or 0 for f in report.files)
    would = "would write " if report.dry_run else ""
    stdout.print(
        f"[bold]{report.dest}[/]  ({would}{counted(len(report.files), 'file')}, "
        f"{human_bytes(size)})  from {report.base} + {report.adapter}",
        highlight=False,
    )
    # IA³ has neither rank nor alpha
    numbers = "".join(
        f" {key}={value}"
        for key, value in (("r", report.r), ("alpha", report.lora_alpha))
        if value is not None
    )
    stdout.print(
        f"  {report.adapter_type}{numbers}: "
        f"{counted(len(report.merged), 'weight')} merged, {len(report.replaced)} replaced, "
        f"{report.copied} copied unchanged",
        highlight=False,
    )
    if report.vocab_size is not None:
        stdout.print(
            f"  vocabulary resized to {report.vocab_size} tokens: the adapter's saved "
            "embedding and output head replace the base's (config.json says so)",
            highlight=False,
        )
    if report.tokenizer_from_adapter:
        stdout.print(
            f"  tokenizer from the adapter folder: {', '.join(report.tokenizer_from_adapter)}",
            highlight=False,
        )
    if report.dry_run:
        kinds = ", ".join(f"{n} {dtype}" for dtype, n in report.dtypes.items())
        stdout.print(
            f"  {counted(report.tensors, 'tensor')} ({kinds}), "
            f"{human_bytes(report.tensor_bytes)} of tensor data",
            highlight=False,
        )
        for f in report.files:
            shown = human_bytes(f.size) if f.size is not None else "size decided when written"
            stdout.print(f"  file  {f.path}  {shown}  ({f.entries} entries)", markup=False)
        stdout.print("  nothing was written (--dry-run)")
    render_not_in_output(report.skipped)
