"""Data-position cause: the loader's position was not restored (samples or batches seen,
`num_input_tokens_seen`, the loader state's yielded count, the Trainer's epoch fraction count
again from the resume), so the resumed run sees batches it already trained on."""

from __future__ import annotations

from .models import Cause
from .pair import Pair, counter_restart, fmt
from .save import LOADER_POSITIONS

#: counters a loader may set back to 0 at each epoch (a `StatefulDataLoader`'s, a plain
#: loader's `position`): crossing an epoch boundary also lowers them, so only the exact fresh
#: count is a restart
_PER_EPOCH = {
    "_num_yielded",
    "_sampler_iter_yielded",
    "num_yielded",
    "samples_yielded",
    *LOADER_POSITIONS,
}


def check(pair: Pair) -> list[Cause]:
    """The data-position cause of one pair of saves."""
    a, b = pair.before, pair.after
    evidence: list[str] = []
    for name, before in a.data_counters.items():
        after = b.data_counters.get(name)
        found = counter_restart(before, after, a.step, pair.elapsed)
        if found is None or not found.restarted:
            continue
        if name.rsplit(".", 1)[-1] in _PER_EPOCH and found.after not in (found.fresh, 0.0):
            continue  # an epoch ended between the saves, maybe: not proof of a restart
        evidence.append(
            f"{name} {fmt(found.before)} at {a.name}, {fmt(found.after)} at {b.name}: "
            + found.outlook("continued it would be", "started over")
        )
    evidence += _new_loaders(pair)
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
            "loop must restore its sampler / samples-seen counter; torchtitan: keep "
            "`dataloader` out of checkpoint.exclude_from_loading.",
        )
    ]


def _new_loaders(pair: Pair) -> list[str]:
    """Loaders the save after has and the save before had not (accelerate numbers each
    prepared loader: `dataloader_1`), counting from the resume: the loop iterates a loader
    built after the state was loaded."""
    a, b = pair.before, pair.after
    out: list[str] = []
    for name, after in b.data_counters.items():
        if name in a.data_counters:
            continue
        leaf = name.rsplit(".", 1)[-1]
        known = [(n, v) for n, v in a.data_counters.items() if n.rsplit(".", 1)[-1] == leaf]
        if not known:
            continue
        old_name, before = known[0]
        found = counter_restart(before, after, a.step, pair.elapsed)
        if found is not None and found.after == found.fresh and found.fresh != found.continued:
            out.append(
                f"{name} {fmt(after)} at {b.name}, a loader {a.name} did not have: it counts "
                f"from the resume ({old_name} was {fmt(before)} at {a.name}, continued it "
                f"would be {fmt(found.continued)})"
            )
    return out
