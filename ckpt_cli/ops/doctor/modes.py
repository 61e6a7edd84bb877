"""Train/eval mode cause: the model trained on in eval mode after the resume.

`model.eval()` (a validation pass the resume script runs first, a loop whose `model.train()`
came before the load) turns dropout off and makes BatchNorm normalise by its frozen running
statistics; nothing in a state dict records the mode. BatchNorm leaves one trace: its
`num_batches_tracked` counts the batches it saw in train mode. A counter that moved over the
interval before the save resumed from and stands still after it, while the optimizer steps,
shows the run trained in eval mode. A model without BatchNorm (dropout only, transformers)
leaves none: that is not judged.
"""

from __future__ import annotations

from .models import Cause
from .pair import Pair, fmt
from .save import Save

#: the buffer BatchNorm counts its train-mode batches in
_TRACKER = "num_batches_tracked"


def _trackers(save: Save) -> dict[str, int]:
    """BatchNorm's batch counters of the save's model, by tensor name."""
    found: dict[str, int] = {}
    for name, entry in save.model_tensors.items():
        if name.rsplit(".", 1)[-1] != _TRACKER or entry.numel != 1:
            continue
        value = save.value(entry.name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[name] = int(value)
    return found


def check(pair: Pair) -> list[Cause]:
    """The train/eval mode cause of one pair of saves."""
    a, b = pair.before, pair.after
    if not pair.earlier:
        return []  # no interval before the save to show the counters moving in train mode
    earlier = pair.earlier[-1]
    if a.optimizer_step is not None and b.optimizer_step is not None:
        stepped = b.optimizer_step - a.optimizer_step
        taken = f"while the optimizer stepped {fmt(stepped)} times"
    else:
        stepped = pair.elapsed or 0
        taken = f"{fmt(stepped)} steps later"
    if stepped <= 0:
        return []
    before, at, after = _trackers(earlier), _trackers(a), _trackers(b)
    # counters that moved before the resume (train mode then; frozen BatchNorm never moves)
    moving = [name for name in at if name in before and name in after and before[name] < at[name]]
    if not moving or any(after[name] != at[name] for name in moving):
        return []
    evidence = [
        f"BatchNorm's {name} {fmt(before[name])} at {earlier.name}, {fmt(at[name])} at "
        f"{a.name}, {fmt(after[name])} at {b.name} {taken}: the model counted its batches in "
        "train mode up to the resume, and none after it"
        for name in moving[:3]
    ]
    if len(moving) > 3:
        evidence.append(f"and {len(moving) - 3} more BatchNorm layers stood still the same way")
    return [
        Cause(
            id="model_in_eval_mode",
            title="the model trained in eval mode after the resume: BatchNorm's statistics "
            "froze and dropout was off",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Call model.train() after loading the checkpoint and after every evaluation, "
            "before the training steps go on (model.eval() for a validation pass before the "
            "loop leaves dropout off and BatchNorm's running statistics frozen); the Trainer "
            "and accelerate's examples call it each step. BatchNorm frozen on purpose at the "
            "resume: declare it with --expect model_in_eval_mode.",
        )
    ]
