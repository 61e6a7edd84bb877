"""Human rendering of the per-rank summary of a torchrun (split) run."""

from __future__ import annotations

from ...dist.command import RankShare
from . import human_bytes, stdout


def render_ranks(shares: list[RankShare], verb: str = "wrote") -> None:
    """One line per rank: files, bytes and seconds (nothing for a single-process run)."""
    if not shares:
        return
    stdout.print(f"  split over {len(shares)} ranks:")
    for share in shares:
        files = len(share.files)
        rate = share.bytes / share.seconds if share.seconds > 0 else 0.0
        stdout.print(
            f"    rank {share.rank}: {verb} {files} file{'s' if files != 1 else ''}, "
            f"{human_bytes(share.bytes)} in {share.seconds:.1f} s ({human_bytes(rate)}/s)",
            highlight=False,
        )
