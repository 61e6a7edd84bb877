"""Weight causes: weights partly restored (`strict=False`: some tensors moved far more than the
run's steps move them and lost their correlation with the save, as a fresh initialisation
does), precision changed (fp32 before, bf16 after), an EMA copy not restored (re-initialised
from the weights at the resume).

Tensors are read one pair at a time (an EMA check reads three: the EMA on both sides and the
weights before, in one pass), their statistics over blocks (`tensors`: raw bytes through numpy
where the format stores them, without torch).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

from .models import Cause
from .optimizer import second_moment_mean
from .pair import Pair, fmt
from .save import Save
from .tensors import moments_against, pair_moments

#: tensors this small carry too little to judge a correlation by
_MIN_NUMEL = 16


def check(pair: Pair) -> list[Cause]:
    """The weight causes of one pair of saves."""
    causes: list[Cause] = []
    precision = _precision(pair)
    if precision is not None:
        causes.append(precision)
    rows = _changes(pair)
    partial = _partial(pair, rows)
    if partial is not None:
        causes.append(partial)
    stale = _unmoved(pair, rows)
    if stale is not None:
        causes.append(stale)
    ema = _ema(pair)
    if ema is not None:
        causes.append(ema)
    return causes


def _mixed_precision(args: dict[str, object]) -> str | None:
    """The Trainer's mixed precision from its training arguments (None when not recorded)."""
    if not isinstance(args.get("bf16"), bool) or not isinstance(args.get("fp16"), bool):
        return None
    return "bf16" if args["bf16"] else "fp16" if args["fp16"] else "fp32"


def _precision(pair: Pair) -> Cause | None:
    a, b = pair.before.model_tensors, pair.after.model_tensors
    changes = Counter((a[n].dtype, b[n].dtype) for n in a if n in b and a[n].dtype != b[n].dtype)
    total = sum(1 for n in a if n in b)
    evidence = [
        f"{count} of {total} weight tensors {old} at {pair.before.name}, {new} at {pair.after.name}"
        for (old, new), count in changes.most_common()
    ]
    mixed_a = _mixed_precision(pair.before.training_args)
    mixed_b = _mixed_precision(pair.after.training_args)
    if mixed_a is not None and mixed_b is not None and mixed_a != mixed_b:
        evidence.append(
            f"mixed precision {mixed_a} at {pair.before.name}, {mixed_b} at {pair.after.name} "
            "(TrainingArguments bf16 / fp16 in training_args.bin): the resumed run computes "
            "in another precision"
        )
    if not evidence:
        return None
    return Cause(
        id="precision_changed",
        title="the precision changed at the resume: the weights are kept in another dtype"
        if changes
        else "the precision changed at the resume: the run computes in another mixed precision",
        score=0.9 if changes else 0.8,
        before=pair.before.name,
        after=pair.after.name,
        evidence=evidence,
        fix="Resume with the precision the run was saved in (fp32 master weights with bf16 "
        "autocast, not a model cast to bf16; the Trainer: the same bf16 / fp16 arguments); or "
        "declare it with --expect precision.",
    )


def _changes(pair: Pair) -> list[tuple[str, float, float]]:
    """Per weight tensor both saves hold: its name, its change per element, its correlation."""
    a, b = pair.before, pair.after
    rows: list[tuple[str, float, float]] = []  # name, relative change, correlation
    for name, ea in a.model_tensors.items():
        eb = b.model_tensors.get(name)
        if eb is None or list(ea.shape) != list(eb.shape) or (ea.numel or 0) < _MIN_NUMEL:
            continue
        _, change, corr = pair_moments((a.opened.checkpoint, ea), (b.opened.checkpoint, eb))
        # the change per element: a fresh tensor moved by the size of its values, a restored
        # one by the run's updates (relative to its norm, a zero-initialised bias would look
        # "changed" by any update)
        rows.append((name, change / math.sqrt(ea.numel or 1), corr))
    return rows


def _partial(pair: Pair, rows: list[tuple[str, float, float]]) -> Cause | None:
    a, b = pair.before, pair.after
    if len(rows) < 3:
        return None
    moving = [r for _, r, _ in rows if r > 0]
    if not moving:
        return None
    typical = statistics.median(moving)
    typical_corr = statistics.median(c for _, _, c in rows)
    flagged = [
        (name, r, c) for name, r, c in rows if c < 0.5 and r > 2 * typical and typical_corr > 0.8
    ]
    if not flagged:
        return None
    flagged.sort(key=lambda row: row[2])
    evidence = [
        f"{len(flagged)} of {len(rows)} weight tensors changed by far more than the others "
        f"between {pair.where()} (median change per element {typical:.3g}, correlation "
        f"{typical_corr:.3f}) and no longer correlate with the save: freshly initialised"
    ]
    evidence += [
        f"{name}: change per element {r:.3g} (×{r / typical:.1f} the median), correlation {c:.3f}"
        for name, r, c in flagged[:6]
    ]
    return Cause(
        id="weights_partly_restored",
        title="the weights were only partly restored: some tensors look freshly initialised",
        score=0.9,
        before=a.name,
        after=b.name,
        evidence=evidence,
        fix="Load the weights with strict=True (or check load_state_dict's missing_keys / "
        "unexpected_keys): a key renamed (a `module.` or `_orig_mod.` prefix, a renamed "
        "layer) leaves those weights at their initial values.",
    )


def _ema(pair: Pair) -> Cause | None:
    a, b = pair.before, pair.after
    if not a.ema_tensors:
        return None
    if not b.ema_tensors:
        return Cause(
            id="ema_not_restored",
            title="the EMA weights were not carried over: the save after the resume has none",
            score=0.7,
            before=a.name,
            after=b.name,
            evidence=[f"{len(a.ema_tensors)} EMA tensors at {a.name}, none at {b.name}"],
            fix="Restore (and save) the EMA state on resume.",
        )
    to_ema = to_weights = 0.0
    compared = 0
    for name, eb in b.ema_tensors.items():
        ea, wa = a.ema_tensors.get(name), a.model_tensors.get(name)
        if ea is None or wa is None or list(ea.shape) != list(eb.shape):
            continue
        if list(wa.shape) != list(eb.shape):
            continue
        (_, d_ema, _), (_, d_weights, _) = moments_against(
            (b.opened.checkpoint, eb), [(a.opened.checkpoint, ea), (a.opened.checkpoint, wa)]
        )
        to_ema += d_ema**2
        to_weights += d_weights**2
        compared += 1
    if not compared or to_ema == 0:
        return None
    d_ema, d_weights = to_ema**0.5, to_weights**0.5
    if d_weights >= 0.5 * d_ema:
        return None
    return Cause(
        id="ema_not_restored",
        title="the EMA was not restored: it was re-initialised from the weights at the resume",
        score=0.85,
        before=a.name,
        after=b.name,
        evidence=[
            f"the EMA at {b.name} is {d_weights:.3g} from the weights at {a.name} but "
            f"{d_ema:.3g} from the EMA at {a.name} (over {compared} tensors): it restarted "
            "from the weights instead of carrying on",
        ],
        fix="Load the EMA state dict on resume instead of copying the current weights into it.",
    )


def _unmoved(pair: Pair, rows: list[tuple[str, float, float]]) -> Cause | None:
    """Every weight tensor of the save after bit-identical to the save before's, though the
    optimizer stepped between them (its step count grew, its moments moved): the weights
    saved are not the ones trained."""
    a, b = pair.before, pair.after
    if not rows or any(change != 0.0 for _, change, _ in rows):
        return None
    steps_a, steps_b = a.optimizer_step, b.optimizer_step
    if steps_a is None or steps_b is None or steps_b <= steps_a:
        return None
    moments_a, moments_b = second_moment_mean(a), second_moment_mean(b)
    if moments_a is None or moments_a == moments_b:
        return None
    if _zero_lr(a):
        # the LR a save holds is the next step's: the steps after `a` ran at LR 0 (a warm-up
        # of Adam's moments), no update; `b`'s is for the steps after it (0 at the end of a
        # schedule that decays to 0, the last save's), which moved nothing between the two
        return None
    return Cause(
        id="inconsistent_state",
        title=f"{b.name} holds {a.name}'s weights: the save mixes state of two saves",
        score=0.85,
        before=a.name,
        after=b.name,
        evidence=[
            f"all {len(rows)} weight tensors compared are bit-identical at {a.name} and "
            f"{b.name}, though the optimizer took {fmt(steps_b - steps_a)} steps between them "
            f"(step count {fmt(steps_a)} → {fmt(steps_b)}, mean exp_avg_sq {moments_a:.3g} → "
            f"{moments_b:.3g}): the weights saved did not train",
        ],
        fix=f"{b.name}'s weights were copied from {a.name} (files of two saves put together), "
        "or the loop saves a model the optimizer does not step (a copy made before training, "
        f"a module other than the wrapped one): resume from {a.name}, and save the model "
        "that trains.",
    )


def _zero_lr(save: Save) -> bool:
    """Whether the optimizer's learning rate at the save (the one its next step takes) is 0 in
    some param group."""
    prefix = save.prefix("optimizer")
    if prefix is None:
        return False
    for i in range(len(save.param_groups) or 1):
        lr = save.value(f"{prefix}param_groups.{i}.lr")
        if isinstance(lr, int | float) and not isinstance(lr, bool) and lr == 0:
            return True
    return False
