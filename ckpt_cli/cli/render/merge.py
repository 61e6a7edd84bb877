"""Human rendering of `ckpt merge`."""

from __future__ import annotations

from ...ops.merge import MergeReport
from ...sizes import counted
from . import human_bytes, stdout


def render_merge(report: MergeReport) -> None:
    """What was merged into what, and the files written."""
    size = sum(f.size or 0 for f in report.files)
    stdout.print(
        f"[bold]{report.dest}[/]  ({counted(len(report.files), 'file')}, {human_bytes(size)})"
        f"  from {report.base} + {report.adapter}",
        highlight=False,
    )
    stdout.print(
        f"  {report.adapter_type} r={report.r} alpha={report.lora_alpha}: "
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
