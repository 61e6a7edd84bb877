"""Finding the resume points of a run: which consecutive saves have a restart between them.

What says so, each recorded in `ResumePoint.how`: `declared` (--before / --after), `log` (the
log has a step logged twice, or the steps going back, between the two saves), `steps` (the
trainer's own step counter went back while the folder names go forward), `time` (the gap
between the two saves, per step where the steps are known, is far longer than the run's other
save intervals: the job was down) and
`state` (a cause was found between them: the saved state itself is discontinuous).
"""

from __future__ import annotations

import statistics

from .models import LogJump, ResumePoint
from .pair import Pair

#: a gap this many times the run's median save interval (and a second longer; per step where
#: the steps are known) is a stop
_GAP_FACTOR = 3.0
#: how much longer than the typical interval a gap must be, in seconds: with two intervals or
#: more to compare with, a second; with one, a single interval is no baseline (a tiny run's
#: first save is quick, a later one waits on a flush), and a job's stop and restart (the
#: queue, the start-up, the load) takes minutes
_GAP_EXCESS = 1.0
_GAP_EXCESS_ONE_BASELINE = 60.0


def find(pairs: list[Pair], declared: bool) -> list[ResumePoint]:
    """One `ResumePoint` per pair (causes are added later, as `state`)."""
    gaps = [max(p.after.mtime - p.before.mtime, 0.0) for p in pairs]
    # per step where every pair's steps are known: saves many steps apart (rotated ones
    # between them) are no stop
    counts = [p.elapsed for p in pairs]
    steps = [n for n in counts if n]
    if len(steps) != len(gaps):
        steps = [1] * len(gaps)
    paces = [g / n for g, n in zip(gaps, steps, strict=True)]
    points: list[ResumePoint] = []
    for i, pair in enumerate(pairs):
        how: list[str] = ["declared"] if declared else []
        log: LogJump | None = pair.log
        if log is not None and log.restarted:
            how.append("log")
        own_a = pair.before.opened.training.step if pair.before.opened.training else None
        own_b = pair.after.opened.training.step if pair.after.opened.training else None
        if own_a is not None and own_b is not None and own_b < own_a:
            how.append("steps")
        others = [g for j, g in enumerate(paces) if j != i and g > 0]
        if others:
            typical = statistics.median(others)
            excess = _GAP_EXCESS if len(others) >= 2 else _GAP_EXCESS_ONE_BASELINE
            if paces[i] > _GAP_FACTOR * typical and gaps[i] - typical * steps[i] > excess:
                how.append("time")
        points.append(
            ResumePoint(
                before=pair.before.name,
                after=pair.after.name,
                step_before=pair.before.step,
                step_after=pair.after.step,
                resumed=bool(how),
                how=how,
                log=log,
            )
        )
    return points
