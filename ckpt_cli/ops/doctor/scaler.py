"""Gradient-scaler cause: the fp16 loss scale was reset to its initial value at the resume."""

from __future__ import annotations

import math

from .models import Cause
from .pair import Pair, fmt
from .save import INITIAL_SCALE


def _grown(start: float, tracker: float, steps: int, factor: float, interval: float) -> float:
    """The scale after `steps` overflow-free steps from `start` with `tracker` good steps."""
    return start * factor ** math.floor((tracker + steps) / max(interval, 1.0))


def check(pair: Pair) -> list[Cause]:
    """The grad-scaler cause of one pair of saves."""
    a, b, n = pair.before.scaler, pair.after.scaler, pair.elapsed
    if a is None or b is None or n is None:
        return []
    factor, interval = b.get("growth_factor", 2.0), b.get("growth_interval", 2000.0)
    tracker_a, tracker_b = a.get("growth_tracker", 0.0), b.get("growth_tracker")
    continued = _grown(a["scale"], tracker_a, n, factor, interval)
    fresh = _grown(INITIAL_SCALE, 0.0, n, factor, interval)
    scale = b["scale"]
    reset = by_tracker = False
    expected = (tracker_a + n) % max(interval, 1.0)
    if continued != fresh and abs(scale - fresh) < abs(scale - continued):
        reset = scale >= a["scale"] * 0.5**n or scale == fresh  # not explained by back-offs
    elif continued == fresh and tracker_b is not None:
        # the scale cannot tell: the growth tracker counted from the resume
        by_tracker = reset = tracker_b != expected and tracker_b == n % max(interval, 1.0)
    if not reset:
        return []
    if by_tracker and tracker_b is not None:
        scales = (
            f"{fmt(scale)} at both" if scale == a["scale"] else f"{fmt(a['scale'])} → {fmt(scale)}"
        )
        title = "the gradient scaler was reset: its growth tracker counted again from the resume"
        evidence = [
            f"growth tracker {fmt(tracker_a)} at {pair.before.name}, {fmt(tracker_b)} at "
            f"{pair.after.name}: continued it would be {fmt(expected)}, a fresh scaler counts "
            f"{fmt(n % max(interval, 1.0))} (the loss scale, {scales}, grows only "
            f"every {fmt(interval)} good steps)"
        ]
    else:
        title = "the gradient scaler was reset: the fp16 loss scale started over"
        evidence = [
            f"loss scale {fmt(a['scale'])} at {pair.before.name}, {fmt(scale)} at "
            f"{pair.after.name}: continued it would be {fmt(continued)}, a fresh scaler "
            f"(init {fmt(INITIAL_SCALE)}) reaches {fmt(fresh)} in {n} steps"
        ]
        if tracker_b is not None:
            evidence.append(f"growth tracker {fmt(tracker_a)} → {fmt(tracker_b)}")
    return [
        Cause(
            id="grad_scaler_reset",
            title=title,
            score=0.9,
            before=pair.before.name,
            after=pair.after.name,
            evidence=evidence,
            fix="Save and load the GradScaler's state dict with the checkpoint (Trainer and "
            "accelerate keep it in scaler.pt; a plain loop: scaler.load_state_dict).",
        )
    ]
