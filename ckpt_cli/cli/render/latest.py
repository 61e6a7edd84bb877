"""Human rendering of `ckpt latest`: the path alone on stdout, for `$(ckpt latest out/)`."""

from __future__ import annotations

import sys

from ...sources.runs import PROTECTED, RunReport
from . import safe_text, warn


def render_latest(report: RunReport) -> None:
    """Only the path on stdout (for `$(ckpt latest out/)`); the reason for none on stderr,
    as an error (exit 3): printed with --quiet too. What is not known of the checkpoint
    named (its reason: whether it holds the optimizer state it should) is a warning."""
    if report.latest is not None:
        # the real path for `$(ckpt latest out/)`; on a terminal, a name cannot drive it
        path = report.latest if not sys.stdout.isatty() else safe_text(report.latest)
        sys.stdout.write(path + "\n")
        sys.stdout.flush()
        chosen = next((c for c in report.checkpoints if c.path == report.latest), None)
        if chosen is not None and chosen.reason:
            warn("latest", f"{chosen.name}: {chosen.reason}")
        if report.tracker_problem:
            warn("latest", report.tracker_problem)
        return
    from ...ops.latest import none_found
    from . import errors  # rich: only to say why there is none

    why = none_found(report)
    errors.print(f"ckpt latest: {why.message}", markup=False, highlight=False, soft_wrap=True)
    for c in reversed(report.checkpoints):
        # `ckpt protect` blessed it whole: damaged since, and its parity may rebuild it
        damaged = PROTECTED in c.markers and c.status == "incomplete"
        repair = f" (protected: `ckpt repair {c.path}` can rebuild it)" if damaged else ""
        errors.print(
            f"  {c.name}: {c.status}: {c.reason}{repair}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
