"""RNG cause: the RNG state was not restored, so the resumed run drew other random numbers
(dropout masks, shuffles) than the run it continues. Two signs, from the saved states alone:

- the save after the resume holds the very RNG state an earlier save of the run held (the run
  re-seeded and replayed the same draws);
- torch's CPU generator, whose state carries its seed (`mt19937`): it carries another seed
  after the resume, or has drawn fewer numbers since its seed than it had at the save resumed
  from (it was seeded again, whatever it drew since);
- the save resumed from holds no RNG state at all (its `rng_state.pth` lost, a loop that did
  not save it) while the save after does: there was nothing to restore (the Trainer only logs
  "Didn't find an RNG file" and goes on).
"""

from __future__ import annotations

from typing import Any

from ...errors import CkptError
from ...sources.runs import SLIM_RECORD
from ..diff.compare import values_equal
from . import mt19937
from .models import Cause
from .pair import Pair, fmt
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


_FIX = (
    "Restore the saved RNG states after seeding, not before (Trainer: keep rng_state*.pth; "
    "accelerate: call set_seed before load_state; a plain loop: torch.set_rng_state / "
    "random.setstate / np.random.set_state from the save); or declare it with --expect rng."
)


def _generator(value: Any) -> mt19937.CpuGeneratorState | None:
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], bytes):
        return mt19937.parse(value[2])
    return None


def _reseeded(pair: Pair, before: dict[str, Any], after: dict[str, Any]) -> list[Cause]:
    """torch's CPU generator seeded again at the resume: another seed, or fewer draws."""
    for key in sorted(set(before) & set(after)):
        a, b = _generator(before[key]), _generator(after[key])
        if a is None or b is None:
            continue
        where = f"{key} (torch's CPU generator)"
        if a.seed != b.seed:
            evidence = (
                f"{where}: seed {a.seed} at {pair.before.name}, {b.seed} at {pair.after.name}: "
                "the resumed run seeded it anew (a restored state keeps its seed)"
            )
        else:
            drawn_a, drawn_b = mt19937.draws_since_seed([a, b])
            if drawn_a is None or drawn_b is None or drawn_b >= drawn_a:
                continue
            evidence = (
                f"{where}: {drawn_a:,} numbers drawn since seed {a.seed} at "
                f"{pair.before.name} (step {fmt(pair.before.step)}), {drawn_b:,} at "
                f"{pair.after.name} (step {fmt(pair.after.step)}): it was seeded again at the "
                "resume (a restored generator carries on counting)"
            )
        return [
            Cause(
                id="rng_not_restored",
                title="the RNG state was not restored: the resumed run seeded its generator again",
                score=0.8,
                before=pair.before.name,
                after=pair.after.name,
                evidence=[evidence],
                fix=_FIX,
            )
        ]
    return []


def _files(save: Save) -> list[str]:
    """The files rank 0's RNG states are kept in (`rng_state.pth`), where they are files."""
    return sorted({e.file for e in save.rng_groups.get("0", []) if e.file is not None})


def _nothing_to_restore(pair: Pair, after: dict[str, Any]) -> list[Cause]:
    """The save before holds no RNG state, the save after does: a resume from it (a restart
    found, or the state after bit-identical to an earlier save's that the run moved on from)
    had no RNG state to restore. In one process between them (no restart), the state lost
    from the save before changed nothing for the run."""
    a, b = pair.before, pair.after
    replay = next(
        (e for e in reversed(pair.earlier) if _same(after, _streams(e))),
        None,
    )
    moved = replay is not None and any(
        _streams(e) and not _same(_streams(e), _streams(replay))
        for e in pair.earlier
        if e is not replay
    )
    if not pair.stopped and not moved:
        return []
    files = _files(b)
    slimmed = SLIM_RECORD in a.source.files
    evidence = [
        f"{a.name} holds no RNG state"
        + (f" (no {', '.join(files)}, which {b.name} holds)" if files else f", {b.name} does")
        + (", slimmed by `ckpt prune`" if slimmed else "")
        + f": the resume from {a.name} had none to restore"
    ]
    if replay is not None:
        evidence.append(
            f"the RNG state at {b.name} (step {fmt(b.step)}) is bit-identical to the one "
            f"{replay.name} (step {fmt(replay.step)}) held "
            f"({', '.join(sorted(set(after) & set(_streams(replay))))}): the resumed run "
            "seeded it as the run's start did"
        )
    return [
        Cause(
            id="rng_not_restored",
            title=f"the RNG state was not restored: {a.name}, resumed from, holds none",
            score=0.8 if replay is not None else 0.7,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix=f"{a.name} lacks the RNG state the run's saves hold"
            + (f" ({', '.join(files)})" if files else "")
            + ": restore it from a copy of the save, or resume from a save that holds it "
            "(`ckpt latest` passes over a save missing its RNG file); a plain loop must save "
            "torch.get_rng_state() (and random / numpy's states) with every save. Or declare "
            "it with --expect rng.",
        )
    ]


def _other_world_size(pair: Pair) -> list[Cause]:
    """A Trainer resumed on another number of processes: it reads `rng_state.pth` on one
    process and `rng_state_{rank}.pth` on several, so a save written by another number finds
    no file for it (the Trainer only logs "Didn't find an RNG file") and nothing is restored."""
    a, b = pair.before.trainer_processes, pair.after.trainer_processes
    if not pair.stopped or a is None or b is None or a[0] == b[0]:
        return []
    wanted = "rng_state.pth" if b[0] == 1 else "rng_state_{rank}.pth"
    before, after = pair.before.name, pair.after.name
    return [
        Cause(
            id="rng_not_restored",
            title="the RNG state was not restored: the Trainer was resumed on another number "
            "of processes",
            score=0.8,
            before=before,
            after=after,
            evidence=[
                f"{before} was saved by {a[0]} process(es) ({a[1]}), {after} by {b[0]} "
                f"({b[1]}): on {b[0]} the Trainer loads {wanted}, which {before} does not hold"
                + ("" if b[0] == 1 else " for every rank")
                + ", so it resumed with freshly seeded random numbers"
            ],
            fix="Resume on the number of processes the run was saved with, or reshard the "
            f"save for the new one first (`ckpt reshard {before} OUT --world-size {b[0]} "
            "--rank-state replicate` writes the RNG file each process reads); or declare it "
            "with --expect rng.",
        )
    ]


def check(pair: Pair) -> list[Cause]:
    """The RNG cause of one pair of saves."""
    if not pair.after.rng_groups:
        return []
    resized = _other_world_size(pair)
    if resized:
        return resized
    after = _streams(pair.after)
    if not after:
        return []
    if not pair.before.rng_groups:
        return _nothing_to_restore(pair, after)
    before = _streams(pair.before)
    if _same(after, before):
        return []
    # a save before the resume that itself replays an earlier state (an earlier resume re-seeded)
    # is followed by the state after that one: a continuation of the same replay, no new cause
    replaying = next(
        (
            i
            for i in range(len(pair.earlier) - 1, -1, -1)
            if _same(before, _streams(pair.earlier[i]))
        ),
        None,
    )
    for index in range(len(pair.earlier) - 1, -1, -1):
        save = pair.earlier[index]
        earlier = _streams(save)
        if not _same(after, earlier) or (replaying is not None and index == replaying + 1):
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
                    f"the RNG state at {pair.after.name} (step {fmt(pair.after.step)}) is "
                    f"bit-identical to the one at {save.name} (step {fmt(save.step)}) "
                    f"({', '.join(sorted(set(after) & set(earlier)))}), though it had moved on "
                    f"by {pair.before.name} ({', '.join(sorted(advanced))} changed): the run "
                    "was seeded again instead of restored",
                ],
                fix=_FIX,
            )
        ]
    return _reseeded(pair, before, after)
