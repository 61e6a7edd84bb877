"""Optimizer causes: state not restored (step counts restart, second moments collapse), or
restored for other parameters (param groups or shapes that no longer fit the weights)."""

from __future__ import annotations

from ...sources.layouts.training import shape_problems
from .models import Cause
from .pair import Pair, counter_restart, fmt
from .save import Save
from .tensors import total as tensor_total


def second_moment_mean(save: Save) -> float | None:
    """The mean of Adam's `exp_avg_sq` over every parameter (streamed, one tensor at a time)."""
    prefix = save.prefix("optimizer")
    if prefix is None:
        return None
    total, count = 0.0, 0
    for entry in save.entries:
        if entry.kind != "tensor" or not entry.name.startswith(f"{prefix}state."):
            continue
        if not entry.name.endswith(".exp_avg_sq") or not entry.numel:
            continue
        s, n = tensor_total(save.opened.checkpoint, entry)
        total += s
        count += n
    return total / count if count else None


def check(pair: Pair) -> list[Cause]:
    """The optimizer causes of one pair of saves."""
    a, b = pair.before, pair.after
    causes: list[Cause] = []
    found = counter_restart(a.optimizer_step, b.optimizer_step, a.step, pair.elapsed)
    if found is not None and found.restarted:
        evidence = [
            f"optimizer step count {fmt(found.before)} at {a.name}, {fmt(found.after)} at "
            f"{b.name}: a restored optimizer would count {fmt(found.continued)}, "
            f"a fresh one {fmt(found.fresh)}"
        ]
        before_v, after_v = second_moment_mean(a), second_moment_mean(b)
        if before_v and after_v is not None:
            evidence.append(
                f"mean exp_avg_sq {before_v:.3g} → {after_v:.3g} "
                f"(×{after_v / before_v:.2f}): the second moments started over"
            )
        causes.append(
            Cause(
                id="optimizer_not_restored",
                title="the optimizer state was not restored: Adam's step counts started over",
                score=0.95,
                before=a.name,
                after=b.name,
                evidence=evidence,
                fix="Load the optimizer's state dict after building the optimizer on the "
                "resumed model (Trainer: keep optimizer.pt beside the weights; accelerate: "
                "prepare the optimizer before load_state; DCP: build its state with "
                "get_state_dict before dcp.load, which loads in place, then set_state_dict; "
                "torchtitan: keep `optimizer` out of checkpoint.exclude_from_loading).",
            )
        )
    mismatch = _mismatch(a, b)
    if mismatch:
        causes.append(
            Cause(
                id="optimizer_mismatch",
                title="the optimizer state was restored for other parameters",
                score=0.9,
                before=a.name,
                after=b.name,
                evidence=mismatch,
                fix="Build the optimizer with the same parameters, in the same order and "
                "param groups, as the run that saved it before loading its state (or map the "
                "state by parameter name).",
            )
        )
    return causes


def _mismatch(a: Save, b: Save) -> list[str]:
    evidence: list[str] = []
    if a.param_groups and b.param_groups and a.param_groups != b.param_groups:
        evidence.append(
            f"param groups {a.param_groups} parameters at {a.name}, {b.param_groups} at {b.name}"
        )
    before = {p.message for p in shape_problems(a.opened)}
    for problem in shape_problems(b.opened):
        if problem.message not in before:
            evidence.append(problem.message)
    return evidence[:8]
