"""Single-checkpoint causes: state that cannot resume consistently (the optimizer's, the
scheduler's and the trainer's step counters disagree; RNG states for fewer ranks than the run
had)."""

from __future__ import annotations

import itertools
import math

from .models import Cause
from .pair import Pair, fmt
from .save import INITIAL_SCALE, Save

_RANKS_FIX = (
    "Save every rank's RNG state (rng_state_N.pth, random_states_N.pkl, one key per rank): "
    "the ranks without one resume with fresh random numbers."
)


#: layouts whose own step counter counts optimizer steps, never micro-batches (the Trainer's
#: and Lightning's `global_step`, DeepSpeed's `global_steps`, torchtitan's `step`)
_COUNTS_UPDATES = ("hf-trainer", "deepspeed", "lightning", "torchtitan")


def micro_steps_per_update(saves: list[Save], first_segment: int | None = None) -> int:
    """At most how many of the run's counted steps make one optimizer step: a loop that counts
    micro-batches and steps its optimizer once per accumulation window saves `step` = k × the
    optimizer's count, or fewer micro-batches per optimizer step where a window closed early
    (an epoch's last window may hold one micro-batch). The saves of the run's first process
    (`saves[:first_segment]`, before any resume point: none of them restored anything) show
    how the loop counts: k is the largest `step / optimizer count` among them, rounded up, when
    two of them at least hold both counters; else 1 (a resume that restarted the optimizer
    makes a later save's ratio larger, so it is still found). 1 for layouts whose step counts
    optimizer steps (the Trainer's `global_step`...)."""
    ratios: list[float] = []
    for save in saves[:first_segment]:
        if save.layout in _COUNTS_UPDATES:
            return 1  # its step counts optimizer steps: a gap is no accumulation
        step, opt = save.counted_step, save.optimizer_step
        if step is None or opt is None or step <= 0 or opt <= 0:
            continue
        ratios.append(step / opt)
    if len(ratios) < 2:
        return 1
    return max(1, math.ceil(max(ratios) - 1e-9))


def scheduler_steps_per_step(saves: list[Save], first_segment: int | None = None) -> int:
    """How many times the run's scheduler steps per counted step, where the saves of its first
    process (before any resume point) all say the same whole number k > 1: a scheduler stepped
    on every micro-batch of a gradient accumulation (accelerate's
    `step_scheduler_with_optimizer=False`), or once per process (accelerate's default on N
    processes). That pace is the run's own, no disagreement; 1 otherwise, and for the Trainer,
    whose scheduler steps with its optimizer."""
    paces: set[int] = set()
    for save in saves[:first_segment]:
        step, sched = save.counted_step, save.scheduler_epoch
        if save.layout == "hf-trainer" or step is None or sched is None or step <= 0:
            return 1
        if sched % step:
            return 1
        paces.add(sched // step)
    if len(saves[:first_segment]) < 2 or len(paces) != 1:
        return 1
    return max(1, paces.pop())


def _per_update(save: Save, per_update: int) -> int:
    """The micro-batches one optimizer step takes at most in `save`: the run's (`per_update`),
    or the gradient accumulation the save records, where its layout's step may count
    micro-batches (a plain loop's own `step`)."""
    recorded = save.settings.get("grad_accum")
    if recorded is None or save.layout in _COUNTS_UPDATES or recorded < 1:
        return per_update
    return max(per_update, int(recorded))


def check(save: Save, per_update: int = 1, scheduler_pace: int = 1) -> list[Cause]:
    """The consistency causes of one save; `per_update`: the counted steps per optimizer step
    (`micro_steps_per_update` of its run); `scheduler_pace`: the scheduler's steps per
    counted step (`scheduler_steps_per_step` of its run)."""
    causes: list[Cause] = []
    counters = _disagreeing(save, per_update, scheduler_pace)
    if counters:
        causes.append(
            Cause(
                id="inconsistent_state",
                title="the save's step counters disagree: a resume from it is not consistent",
                score=0.6,
                after=save.name,
                evidence=counters,
                fix=(
                    f"{save.name}'s trainer_state.json is another save's: put back the one "
                    f"written with {save.name} (from a copy of the save), or resume from "
                    "another save; the Trainer resumes at the global_step it reads there, "
                    "skipping that many batches."
                    if save.misnamed_trainer_state is not None
                    else "The save mixes state from different points of the run (an optimizer "
                    "or scheduler restored from elsewhere, or not restored at the last "
                    "resume): resume from an earlier consistent save, or rebuild the state "
                    "that lags."
                ),
            )
        )
    ranks, fix = _rng_ranks(save)
    if ranks:
        causes.append(
            Cause(
                id="rng_ranks_missing",
                title="the save holds RNG states for fewer ranks than the run had",
                score=0.6,
                after=save.name,
                evidence=ranks,
                fix=fix,
            )
        )
    return causes


def _disagreeing(save: Save, per_update: int = 1, scheduler_pace: int = 1) -> list[str]:
    step, opt, sched = save.counted_step, save.optimizer_step, save.scheduler_epoch
    evidence: list[str] = []
    per_update = _per_update(save, per_update)
    # the fewest optimizer steps the counted steps make (a loop counting micro-batches: fewer,
    # each window of up to `per_update` of them; a window closed early, or one still open at
    # the save, makes more or fewer)
    updates = step // per_update if step is not None else None
    foreign = save.misnamed_trainer_state
    if foreign is not None:
        evidence.append(
            f"trainer_state.json global_step {fmt(foreign)} in {save.name}, which the Trainer "
            f"named after its global_step {fmt(save.folder_step)}: the file is another save's"
        )
    if (
        updates is not None
        and opt is not None
        and step is not None
        and updates > 0
        and (opt > step or updates - opt > _max_skipped(save, updates))
    ):
        evidence.append(
            f"optimizer step count {fmt(opt)}, trainer step {fmt(step)}"
            + (
                f" (at least {fmt(updates)} optimizer steps at up to {per_update} "
                "micro-batches each)"
                if per_update > 1
                else ""
            )
        )
    if sched is not None and step is not None and step > 0:
        # a per-epoch scheduler counts epochs, fewer than steps; never more than the steps
        per_step = save.layout == "hf-trainer"
        if sched > step * scheduler_pace or (per_step and sched != step):
            evidence.append(
                f"scheduler {save.scheduler_counter} {fmt(sched)}, trainer step {fmt(step)}"
            )
    if opt is not None and sched is not None and save.layout == "hf-trainer" and opt != sched:
        evidence.append(
            f"optimizer step count {fmt(opt)}, scheduler {save.scheduler_counter} {fmt(sched)}"
        )
    steps = sorted(set(save.optimizer_steps))
    if len(steps) > 1 and steps[-1] - steps[0] > 1:
        evidence.append(f"parameters' optimizer step counts range from {steps[0]} to {steps[-1]}")
    return evidence


def _max_skipped(save: Save, step: int) -> float:
    """How many optimizer steps fp16 overflows can have skipped: as many as DeepSpeed counts
    (`skipped_steps`: its step counter counts them, its optimizer and scheduler do not); for a
    `GradScaler`, each halved the loss scale, which grew at most once per `growth_interval`
    steps from its initial value."""
    skipped = save.value("model_states.skipped_steps")
    if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped >= 0:
        return float(skipped)
    scaler = save.scaler
    if scaler is None or scaler["scale"] <= 0:
        return 0.0
    interval = max(scaler.get("growth_interval", 2000.0), 1.0)
    factor = scaler.get("growth_factor", 2.0)
    halvings = math.log(INITIAL_SCALE / scaler["scale"], 2) + step / interval * math.log(factor, 2)
    return max(0.0, math.ceil(halvings))


def _rng_ranks(save: Save) -> tuple[list[str], str]:
    """Evidence that the save holds RNG states for fewer ranks than its run had, and the fix."""
    world = save.settings.get("world_size")
    if save.trainer_processes is not None and world == save.trainer_processes[0]:
        world = None  # read from the RNG files themselves: the gap below is the evidence
    have = save.rng_ranks
    if world is not None and 0 < have < world:
        return [f"world size {fmt(world)} recorded, RNG states for {have} rank(s)"], _RANKS_FIX
    # ranks are numbered from 0: a save holding rank N's state had N + 1 ranks at least
    ranks = sorted(int(r) for r in save.rng_groups)
    lacking = ranks[-1] + 1 - len(ranks) if ranks else 0
    if not lacking:
        return [], _RANKS_FIX
    # a key may number any rank (`rank_99999999999`): the first few lacking are named
    held = set(ranks)
    shown = list(itertools.islice((r for r in range(ranks[-1] + 1) if r not in held), 8))
    lost = ", ".join(str(r) for r in shown)
    if lacking > len(shown):
        lost += f" and {lacking - len(shown):,} more"
    files = sorted({e.file for r in ranks for e in save.rng_groups[str(r)] if e.file})
    plural = "s" if lacking > 1 else ""
    return [
        f"RNG states for {_ranks(save)}"
        + (f" ({', '.join(files)})" if files else "")
        + f", none for rank{plural} {lost}: ranks are numbered "
        f"from 0, so the run had {ranks[-1] + 1:,} at least"
    ], (
        f"{save.name} lost the RNG state of rank{plural} {lost} (a "
        f"file written beside {', '.join(files) or 'the others'}): restore it from a copy of "
        f"{save.name} (its object-store copy, a backup), or resume from a save that holds "
        "every rank's RNG state; resumed as it is, those ranks draw fresh random numbers."
    )


def _ranks(save: Save) -> str:
    ranks = sorted(save.rng_groups, key=int)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def check_ranks_lost(pairs: list[Pair]) -> list[Cause]:
    """Saves holding RNG states for fewer ranks than the save before or after them, the same
    process between them (no restart found: the world size cannot have changed): a rank's
    file was lost, or not written. Saves on both sides of a restart are not compared (a run
    resumed on fewer ranks saves fewer states)."""
    causes: list[Cause] = []
    seen: set[str] = set()
    for pair in pairs:
        if pair.stopped:
            continue
        for short, full in ((pair.after, pair.before), (pair.before, pair.after)):
            have, want = set(short.rng_groups), set(full.rng_groups)
            if not have or not have < want or short.name in seen:
                continue
            seen.add(short.name)
            missing = sorted(want - have, key=int)
            files = sorted(
                {e.file for r in missing for e in full.rng_groups[r] if e.file is not None}
            )
            causes.append(
                Cause(
                    id="rng_ranks_missing",
                    title="the save holds RNG states for fewer ranks than the run had",
                    score=0.6,
                    after=short.name,
                    evidence=[
                        f"RNG states for {_ranks(full)} at {full.name}, for {_ranks(short)} at "
                        f"{short.name} (the same run, no restart between them): "
                        f"rank{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing"
                        + (f" ({', '.join(files)} at {full.name})" if files else ""),
                    ],
                    fix=f"{short.name} lacks what the run's other saves hold: restore "
                    f"{', '.join(files) or 'the missing RNG files'} from a copy of "
                    f"{short.name} (its object-store copy, a backup), or resume from a save "
                    f"that holds every rank's RNG state ({full.name}); resumed from "
                    f"{short.name} as it is, those ranks draw fresh random numbers.",
                )
            )
    return causes
