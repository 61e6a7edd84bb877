"""LR scheduler cause: its state was not restored (`last_epoch` counts again from the resume;
the logged learning rate jumps back into warm-up)."""

from __future__ import annotations

from .models import Cause
from .pair import Pair, counter_restart, fmt


def check(pair: Pair) -> list[Cause]:
    """The scheduler cause of one pair of saves."""
    a, b = pair.before, pair.after
    found = counter_restart(a.scheduler_epoch, b.scheduler_epoch, a.step, pair.elapsed)
    if found is None or not found.restarted:
        return []
    evidence = [
        f"scheduler last_epoch {fmt(found.before)} at {a.name}, {fmt(found.after)} at {b.name}: "
        + found.outlook("restored it would be", "started over")
    ]
    log = pair.log
    if log is not None and log.lr_after is not None and log.lr_before is not None:
        line = (
            f"logged learning rate {log.lr_before:.3g} at step {log.step_before}, "
            f"{log.lr_after:.3g} at step {log.step_after}"
        )
        if log.lr_like_step is not None:
            line += f" (the value of step {log.lr_like_step}: warm-up again)"
        evidence.append(line + f" ({log.source})")
    return [
        Cause(
            id="scheduler_not_restored",
            title="the LR scheduler was not restored: its schedule started over at the resume",
            score=0.95,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Load the scheduler's state dict on resume (Trainer: keep scheduler.pt; "
            "accelerate: prepare the scheduler before load_state; a plain loop: "
            "scheduler.load_state_dict; torchtitan: keep `lr_scheduler` out of "
            "checkpoint.exclude_from_loading), after the optimizer's.",
        )
    ]
