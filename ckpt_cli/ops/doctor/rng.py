"""RNG cause: the RNG state was not restored, so the resumed run drew the random numbers of the
run's start again (dropout masks, shuffles): the save after the resume holds the very RNG state
an earlier save of the run held (the run re-seeded instead of restoring)."""

from __future__ import annotations

from typing import Any

from ...errors import CkptError
from ..compare import values_equal
from .models import Cause
from .pair import Pair
from .save import Save
from .tensors import raw_bytes


def _streams(save: Save) -> dict[str, Any]:
    """Rank 0's RNG states by stream name, read once per save (small: a few KiB each)."""
    if "rng_streams" in save.memo:
        cached: dict[str, Any] = save.memo["rng_streams"]
        return cached
    out: dict[str, Any] = {}
    save.memo["rng_streams"] = out
    checkpoint = save.opened.checkpoint
    by_name = checkpoint.manifest.by_name
    for key, name in save.rng_stream_names().items():
        entry = by_name[name]
        try:
            if entry.kind == "tensor":
                # a generator state is a byte tensor: its raw bytes say all (no torch import)
                raw = raw_bytes(checkpoint, entry)
                out[key] = (
                    (entry.dtype, tuple(entry.shape), raw)
                    if raw is not None
                    else checkpoint.read_tensor(name)
                )
            else:
                value = save.value(name)  # torch-free where the stored pickle is plain
                out[key] = value if value is not None else checkpoint.read_object(name)
        except CkptError:
            continue
    return out


def _same(x: dict[str, Any], y: dict[str, Any]) -> bool:
    common = set(x) & set(y)
    return bool(common) and all(values_equal(x[k], y[k]) for k in common)


def check(pair: Pair) -> list[Cause]:
    """The RNG cause of one pair of saves."""
    if not pair.earlier or not pair.after.rng_groups:
        return []
    after = _streams(pair.after)
    before = _streams(pair.before)
    if not after or _same(after, before):
        return []
    for save in reversed(pair.earlier):
        earlier = _streams(save)
        if not _same(after, earlier):
            continue
        advanced = [
            k for k in set(earlier) & set(before) if not values_equal(earlier[k], before[k])
        ]
        if not advanced:
            continue  # a state that never moves (nothing drew from it) tells nothing
        return [
            Cause(
                id="rng_not_restored",
                title="the RNG state was not restored: the resumed run re-drew the random "
                "numbers of the run's start",
                score=0.8,
                before=pair.before.name,
                after=pair.after.name,
                evidence=[
                    f"the RNG state at {pair.after.name} (step {pair.after.step}) is "
                    f"bit-identical to the one at {save.name} (step {save.step}) "
                    f"({', '.join(sorted(set(after) & set(earlier)))}), though it had moved on "
                    f"by {pair.before.name} ({', '.join(sorted(advanced))} changed): the run "
                    "was seeded again instead of restored",
                ],
                fix="Restore the saved RNG states after seeding, not before (Trainer: keep "
                "rng_state*.pth; accelerate: call set_seed before load_state; a plain loop: "
                "torch.set_rng_state / random.setstate / np.random.set_state from the save).",
            )
        ]
    return []
