"""Data-position cause: the loader's position was not restored (samples or batches seen,
`num_input_tokens_seen`, the loader state's yielded count, the Trainer's epoch fraction count
again from the resume), so the resumed run sees batches it already trained on."""

from __future__ import annotations

from .models import Cause
from .pair import Pair, counter_restart, fmt


def check(pair: Pair) -> list[Cause]:
    """The data-position cause of one pair of saves."""
    a, b = pair.before, pair.after
    evidence: list[str] = []
    for name, before in a.data_counters.items():
        after = b.data_counters.get(name)
        found = counter_restart(before, after, a.step, pair.elapsed)
        if found is None or not found.restarted:
            continue
        evidence.append(
            f"{name} {fmt(found.before)} at {a.name}, {fmt(found.after)} at {b.name}: "
            f"continued it would be {fmt(found.continued)}, started over {fmt(found.fresh)}"
        )
    if not evidence:
        return []
    return [
        Cause(
            id="data_position_not_restored",
            title="the data position was not restored: the resumed run replays data it saw",
            score=0.9,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Restore the loader's position on resume: the Trainer skips the batches it "
            "trained on unless ignore_data_skip is set; a StatefulDataLoader's state_dict must "
            "be loaded into the loader the run iterates (prepared before load_state); a plain "
            "loop must restore its sampler / samples-seen counter.",
        )
    ]
