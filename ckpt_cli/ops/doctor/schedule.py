"""LR scheduler causes: its state was not restored (`last_epoch` counts again from the resume;
the logged learning rate jumps back into warm-up). A run whose saves hold no scheduler state
at all is judged at a restart by its log: the learning rate of the step after it is the one the
run logged at the first steps' distance from its start (`logs.jump`'s `lr_like_step`); without
a log, by the learning rate its optimizer saved, compared so with an earlier save's. And the
schedule changed: a scheduler stepped at another pace from the resume on (`schedule_changed`;
the Trainer's schedule settings are `setup`'s)."""

from __future__ import annotations

from .models import Cause
from .pair import Pair, counter_restart, fmt
from .save import Save

_FIX = (
    "Load the scheduler's state dict on resume (Trainer: keep scheduler.pt; "
    "accelerate: prepare the scheduler before load_state; a plain loop: "
    "scheduler.load_state_dict; torchtitan: keep `lr_scheduler` out of "
    "checkpoint.exclude_from_loading), after the optimizer's."
)
_FIX_UNSAVED = (
    "Save the scheduler's state with the checkpoint (a plain loop: put "
    "scheduler.state_dict() in the saved dict; accelerate: prepare the scheduler, or "
    "register_for_checkpointing it; the ckpt Checkpointer: pass it in the state) and load it "
    "on resume, after the optimizer's."
)


def check(pair: Pair) -> list[Cause]:
    """The scheduler cause of one pair of saves."""
    a, b = pair.before, pair.after
    if a.scheduler_epoch is None or b.scheduler_epoch is None:
        return _unsaved(pair)
    found = counter_restart(a.scheduler_epoch, b.scheduler_epoch, a.step, pair.elapsed)
    if found is not None and not found.restarted:
        return _pace_changed(pair) or _ran_ahead(pair, found.continued) or _behind(pair)
    if found is None or not found.restarted:
        return []
    copied = _copied(pair, found.before, found.after)
    if copied:
        return copied
    evidence = [
        f"scheduler {a.scheduler_counter} {fmt(found.before)} at {a.name}, {fmt(found.after)} "
        f"at {b.name}: " + found.outlook("restored it would be", "started over")
    ]
    line = _logged_lr(pair)
    if line is not None:
        evidence.append(line)
    return [
        Cause(
            id="scheduler_not_restored",
            title="the LR scheduler was not restored: its schedule started over at the resume",
            score=0.95,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix=_FIX,
        )
    ]


def _copied(pair: Pair, before: float, after: float) -> list[Cause]:
    """The save after holds the save before's scheduler state (its count did not move) while
    the run's log shows the schedule carried on between them, and nothing else says the run
    stopped: no scheduler started over (that one's log goes back to the first steps' LR), the
    file is the earlier save's, put together with the later one's other files."""
    a, b, log = pair.before, pair.after, pair.log
    if pair.stopped or before != after or not pair.elapsed:
        return []
    if log is None or log.lr_before is None or log.lr_after is None or log.restarted:
        return []
    if log.lr_like_step is not None:
        return []
    return [
        Cause(
            id="inconsistent_state",
            title=f"{b.name} holds {a.name}'s scheduler state: the save mixes state of two saves",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=[
                f"scheduler {a.scheduler_counter} {fmt(before)} at {a.name} and at {b.name}, "
                f"{fmt(pair.elapsed)} steps later, while the logged learning rate carried on "
                f"({log.lr_before:.3g} at step {log.step_before}, {log.lr_after:.3g} at step "
                f"{log.step_after}, {log.source}: no warm-up again): the scheduler state "
                "saved did not move",
            ],
            fix=f"{b.name}'s scheduler state was copied from {a.name} (files of two saves put "
            "together), or the loop saves a scheduler it does not step: resume from "
            f"{a.name}, and save the scheduler that steps.",
        )
    ]


def _pace(first: Save | None, last: Save) -> float | None:
    """The scheduler's steps per counted step from `first` (the run's start when None) to
    `last`; None when unknown."""
    start_step = 0 if first is None else first.counted_step
    start_sched = 0 if first is None else first.scheduler_epoch
    end_step, end_sched = last.counted_step, last.scheduler_epoch
    if start_step is None or start_sched is None or end_step is None or end_sched is None:
        return None
    if end_step <= start_step or end_sched < start_sched:
        return None
    return (end_sched - start_sched) / (end_step - start_step)


def _pace_changed(pair: Pair) -> list[Cause]:
    """The scheduler steps at another pace from the resume on, and keeps it over the next
    interval: it is stepped otherwise than the run stepped it (accelerate's
    `step_scheduler_with_optimizer` or gradient accumulation changed: a prepared scheduler
    steps once per optimizer step with it, on every micro-batch without it). A scheduler
    stepped again once to catch up runs ahead at the resume only: `_ran_ahead`."""
    a, b = pair.before, pair.after
    if not pair.stopped or not pair.later or a.layout == "hf-trainer":
        return []
    before = _pace(pair.earlier[-1] if pair.earlier else None, a)
    after, kept = _pace(a, b), _pace(b, pair.later[0])
    if before is None or after is None or kept is None or min(before, after) <= 0:
        return []
    if abs(after - kept) > 1e-9 * max(after, kept) or max(after, before) < 1.5 * min(after, before):
        return []
    spans = [
        f"{fmt(before)} over {pair.earlier[-1].name if pair.earlier else 'the start'} → {a.name}",
        f"{fmt(after)} over {a.name} → {b.name}",
        f"{fmt(kept)} over {b.name} → {pair.later[0].name}",
    ]
    return [
        Cause(
            id="schedule_changed",
            title="the LR scheduler steps at another pace since the resume: its schedule runs "
            + ("faster" if after > before else "slower")
            + " than the run's",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=[
                f"scheduler {a.scheduler_counter} per step: {'; '.join(spans)}: it is stepped "
                f"{fmt(after)} time(s) per step since the resume, {fmt(before)} before"
            ],
            fix="Step the scheduler as the run did: accelerate steps a prepared scheduler once "
            "per optimizer step with step_scheduler_with_optimizer=True (num_processes times "
            "unless split_batches) and on every micro-batch of a gradient accumulation with it "
            "False, so keep the run's Accelerator(step_scheduler_with_optimizer=..., "
            "gradient_accumulation_steps=...) and process count; a plain loop: call "
            "scheduler.step() where the run did. Or declare the change with --expect schedule.",
        )
    ]


def _ran_ahead(pair: Pair, continued: float) -> list[Cause]:
    """The scheduler counts more steps after the pair than the run took, though it did not
    before it: stepped again after its restore (to "catch up", or built with `last_epoch=`
    and loaded too), so its schedule runs ahead from the resume on."""
    a, b = pair.before, pair.after
    sched_a, sched_b = a.scheduler_epoch, b.scheduler_epoch
    step_a, step_b = a.counted_step, b.counted_step
    if sched_a is None or sched_b is None or step_a is None or step_b is None:
        return []
    if sched_a > step_a or sched_b <= step_b or sched_b - continued < 1:
        return []
    return [
        Cause(
            id="inconsistent_state",
            title="the LR scheduler ran ahead at the resume: it was stepped more often than "
            "the run trained",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=[
                f"scheduler {a.scheduler_counter} {fmt(sched_a)} at {a.name}, {fmt(sched_b)} "
                f"at {b.name}, {fmt(pair.elapsed)} steps later: restored it would be "
                f"{fmt(continued)}; it runs {fmt(sched_b - continued)} steps ahead of the run "
                f"(step {fmt(step_b)})"
            ],
            fix="A restored scheduler already counts the steps it took: load its state dict "
            "and step it once per optimizer step from there, without stepping it again to "
            "catch up (nor building it with last_epoch= as well). Resume from "
            f"{a.name} again to train on the run's schedule.",
        )
    ]


def _behind(pair: Pair) -> list[Cause]:
    """The scheduler stepped with the optimizer, count for count, up to the save before, and
    lags it at the save after: the resume loaded another (older) save's scheduler state, so the
    schedule replays the steps between from there on. Runs that may skip optimizer steps
    (fp16 overflows) are left out: their scheduler legitimately counts otherwise."""
    a, b = pair.before, pair.after
    sched_a, sched_b = a.scheduler_epoch, b.scheduler_epoch
    ref_a, ref_b = a.optimizer_step, b.optimizer_step
    if sched_a is None or sched_b is None or ref_a is None or ref_b is None:
        return []
    if a.may_skip_steps or b.may_skip_steps or sched_a <= 0 or sched_a != ref_a:
        return []
    lag = ref_b - sched_b
    taken = ref_b - ref_a  # the optimizer steps since the save before
    if lag <= 0 or taken <= 0:
        return []
    if sched_b == sched_a and not pair.stopped:
        return []  # the save before's scheduler saved again, maybe: no resume between them
    resumed_with = sched_b - taken
    other = next((e for e in reversed(pair.earlier) if e.scheduler_epoch == resumed_with), None)
    counter = a.scheduler_counter
    evidence = [
        f"scheduler {counter} {fmt(sched_a)} at {a.name} with the optimizer's step count "
        f"{fmt(ref_a)}, {fmt(sched_b)} at {b.name} with {fmt(ref_b)}: restored it would be "
        f"{fmt(ref_b)}; it lags the optimizer by {fmt(lag)} steps"
        + (
            f", resumed from {fmt(resumed_with)}, the count of {other.name} (step "
            f"{fmt(other.step)})"
            if other is not None
            else ""
        )
    ]
    line = _logged_lr(pair)
    if line is not None:
        evidence.append(line)
    title = (
        f"the LR scheduler state restored was {other.name}'s, not {a.name}'s: it lags the optimizer"
        if other is not None
        else "the LR scheduler lags the optimizer from the resume on: its state is an older save's"
    )
    return [
        Cause(
            id="scheduler_not_restored",
            title=title,
            score=0.9,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix=f"Load the scheduler state saved with the optimizer and weights the run resumes "
            f"from ({a.name}), not another save's: build every path from the same checkpoint. "
            f"Resume from {a.name} again to train on the run's schedule.",
        )
    ]


def _logged_lr(pair: Pair) -> str | None:
    log = pair.log
    if log is None or log.lr_after is None or log.lr_before is None:
        return None
    line = (
        f"logged learning rate {log.lr_before:.3g} at step {log.step_before}, "
        f"{log.lr_after:.3g} at step {log.step_after}"
    )
    if log.lr_like_step is not None and log.lr_like_at == log.step_after:
        line += f" (the value of step {log.lr_like_step}: warm-up again)"
    elif log.lr_like_step is not None and log.lr_like is not None:
        line += (
            f", {log.lr_like:.3g} at step {log.lr_like_at} (the value of step "
            f"{log.lr_like_step}: warm-up again)"
        )
    return line + f" ({log.source})"


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-6 * max(abs(x), abs(y))


def _saved_lr_restarted(pair: Pair) -> str | None:
    """Where no log covers the resume: the learning rate the optimizer holds at the save after
    is the one an earlier save held as many steps from the run's start as the save after is
    from the resume, and neither the one at the save resumed from nor that earlier one are it
    (the schedule moved): a fresh scheduler set it, its schedule started over."""
    a, b, steps = pair.before, pair.after, pair.elapsed
    lr_a, lr_b = a.current_lr, b.current_lr
    if steps is None or lr_a is None or lr_b is None or _close(lr_a, lr_b):
        return None
    like = next(
        (
            e
            for e in pair.earlier
            if e.step == steps and e.current_lr is not None and _close(e.current_lr, lr_b)
        ),
        None,
    )
    if like is None:
        return None
    return (
        f"optimizer learning rate {lr_b:.3g} at {b.name}, {fmt(steps)} steps after the resume "
        f"from {a.name} ({lr_a:.3g}): the value {like.name} held {fmt(steps)} steps from the "
        "run's start (warm-up again)"
    )


def _unsaved(pair: Pair) -> list[Cause]:
    """Saves without scheduler state on a side: the log's learning rate at a restart, back at
    the value of the run's first steps, is the only witness."""
    a, b = pair.before, pair.after
    log = pair.log
    if not pair.stopped:
        return []
    if log is not None and log.lr_like_step is not None:
        line = _logged_lr(pair)
    else:
        line = _saved_lr_restarted(pair)
        if line is None:
            return []
    missing = [s.name for s in (a, b) if s.scheduler_epoch is None]
    evidence = [line] if line is not None else []
    evidence.append(
        f"{' and '.join(missing)} hold{'s' if len(missing) == 1 else ''} no LR scheduler "
        "state: the resumed run could only build a fresh scheduler"
        if a.scheduler_epoch is None
        else f"{b.name} holds no LR scheduler state to compare with {a.name}'s"
    )
    return [
        Cause(
            id="scheduler_not_restored",
            title="the LR scheduler was not restored: its schedule started over at the resume",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix=(
                "The Trainer's save_only_model=True saves keep no scheduler.pt: train with "
                "save_only_model=False to resume on the run's schedule."
                if a.scheduler_epoch is None and a.training_args.get("save_only_model") is True
                else _FIX_UNSAVED
                if a.scheduler_epoch is None
                else _FIX
            ),
        )
    ]
