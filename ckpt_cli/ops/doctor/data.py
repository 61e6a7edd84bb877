"""Data-position cause: the loader's position was not restored (samples or batches seen,
`num_input_tokens_seen`, the loader state's yielded count, the Trainer's epoch fraction count
again from the resume), so the resumed run sees batches it already trained on; and a resume
whose saves record no data position at all (`unrecorded`: a warning, not a cause)."""

from __future__ import annotations

from typing import Any

from ...errors import CkptError
from ..diff.compare import values_equal
from .models import Cause
from .pair import Pair, counter_restart, fmt
from .save import DATA_COUNTERS, LOADER_POSITIONS, Save
from .tensors import raw_bytes

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
        if name.rsplit(".", 1)[-1] in _PER_EPOCH:
            if found.after not in (found.fresh, 0.0):
                continue  # an epoch ended between the saves, maybe: not proof of a restart
            if found.after == found.before <= found.fresh:
                # back at its place: whole epochs (each at least that long) fit in the steps
                # between, as a loader saved once per epoch shows; not proof either
                continue
        evidence.append(
            f"{name} {fmt(found.before)} at {a.name}, {fmt(found.after)} at {b.name}: "
            + found.outlook("continued it would be", "started over")
        )
    evidence += _epochs_back(pair)
    evidence += _new_loaders(pair)
    if not evidence:
        return _stale_loader(pair)
    skipped = b.training_args.get("ignore_data_skip") is True
    if skipped:
        evidence.append(
            f"ignore_data_skip=True in {b.name}'s training_args.bin: the resumed Trainer "
            "started its epoch over instead of skipping the batches it had trained on"
        )
    resized = None if skipped else _trainer_batch_ratio(pair)
    if resized is not None:
        evidence.append(
            f"the global batch changed ×{resized:.3g} at the resume (world size × per-device "
            "batch × accumulation): the Trainer skips as many steps as it had taken, each of "
            f"the new size, so it skipped ×{resized:.3g} the data the run had trained on"
        )
    return [
        Cause(
            id="data_position_not_restored",
            title="the data position was not restored: the resumed run replays data it saw",
            score=0.9,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Resume with ignore_data_skip=False (the default): the Trainer then skips the "
            "batches of the epoch it trained on."
            if skipped
            else "Resume with the global batch the run had (world size × "
            "per_device_train_batch_size × gradient_accumulation_steps): the Trainer skips "
            "the steps it had taken in batches of the new size."
            if resized is not None
            else "Restore the loader's position on resume: the Trainer skips the batches it "
            "trained on unless ignore_data_skip is set; a StatefulDataLoader's state_dict must "
            "be loaded into the loader the run iterates (prepared before load_state); a plain "
            "loop must restore its sampler / samples-seen counter, and the epoch it hands "
            "`sampler.set_epoch`; torchtitan: keep "
            "`dataloader` out of checkpoint.exclude_from_loading.",
        )
    ]


def _epochs_back(pair: Pair) -> list[str]:
    """Epoch numbers that went back between the saves: a loop that did not restore its epoch
    hands `sampler.set_epoch` an epoch it trained, and the sampler shuffles as it did then. An
    epoch number counts on slowly (one per many steps, an interval may not move it at all),
    so only one that went back is proof: carried on, it never does."""
    a, b = pair.before, pair.after
    if pair.elapsed is None:
        return []
    out: list[str] = []
    for name, before in a.epoch_counters.items():
        after = b.epoch_counters.get(name)
        if after is not None and after < before:
            out.append(
                f"{name} {fmt(before)} at {a.name}, {fmt(after)} at {b.name}: it went back "
                "(carried on, an epoch count never does): the sampler shuffles as the epochs "
                "already trained did (set_epoch)"
            )
    return out


def _trainer_batch_ratio(pair: Pair) -> float | None:
    """How much a Trainer's global batch changed at the resume, from the settings both saves
    record (None: unchanged, or not a Trainer's)."""
    a, b = pair.before, pair.after
    if a.layout != "hf-trainer" or b.layout != "hf-trainer":
        return None
    known = [k for k in a.settings if k in b.settings]
    before = after = 1.0
    for key in known:
        before, after = before * a.settings[key], after * b.settings[key]
    if not known or before <= 0 or abs(after / before - 1.0) < 0.05:
        return None
    return after / before


def unrecorded(pair: Pair) -> str | None:
    """A warning for a resume between two accelerate saves that record no data position (no
    counter, no loader state: a loader that is not stateful, whose position accelerate does
    not save): whether the resumed run skipped the batches it had trained on cannot be told
    from the files, so "no cause" says nothing of it. None where a position is recorded."""
    a, b = pair.before, pair.after
    if a.layout != "accelerate" or b.layout != "accelerate":
        return None
    if any(s.data_counters or s.epoch_counters or _loader_state(s) for s in (a, b)):
        return None
    return (
        f"{a.name} → {b.name}: neither save records the data loader's position (accelerate "
        "saves it only for a stateful loader: DataLoaderConfiguration(use_stateful_dataloader="
        "True)): whether the resumed run skipped the batches it had trained on "
        "(accelerator.skip_first_batches) cannot be told from the files"
    )


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


def _loader_state(save: Save) -> dict[str, Any] | None:
    """The data loader's state, entry by entry (tensors by their raw bytes), read once per
    save; None when it holds none, or an entry cannot be read (then no copy can be told)."""
    if "loader_state" not in save.memo:
        save.memo["loader_state"] = _read_loader_state(save)
    cached: dict[str, Any] | None = save.memo["loader_state"]
    return cached


def _read_loader_state(save: Save) -> dict[str, Any] | None:
    """`_loader_state`, read: None when it holds none or an entry cannot be read."""
    out: dict[str, Any] = {}
    checkpoint = save.opened.checkpoint
    try:
        for entry in save.loader_entries:
            if entry.kind == "tensor":
                raw = raw_bytes(checkpoint, entry)
                value: Any = (
                    (entry.dtype, tuple(entry.shape), raw)
                    if raw is not None
                    else checkpoint.read_tensor(entry.name)
                )
            else:
                value = save.value(entry.name)
                if value is None:
                    value = checkpoint.read_object(entry.name)
            out[entry.name] = value
    except CkptError:
        return None
    return out or None


def _loader_positions(save: Save) -> dict[str, float]:
    """The data counters inside the loader's own state, by name."""
    names = {e.name for e in save.loader_entries}
    inside = {n: v for n, v in save.data_counters.items() if n in names}
    # counters of a pickled loader state (torchtitan's `dataloader.dp_rank_N`) are named
    # below their entry
    inside.update(
        (n, v)
        for n, v in save.data_counters.items()
        if n not in inside and any(n.startswith(f"{entry}.") for entry in names)
    )
    return inside


def _same_state(x: dict[str, Any], y: dict[str, Any]) -> bool:
    return x.keys() == y.keys() and all(values_equal(x[k], y[k]) for k in x)


def _stale_loader(pair: Pair) -> list[Cause]:
    """The save after holds the loader state of an earlier save, identical entry for entry,
    though the run took steps between them that moved its position: the loader state saved
    is not the loader's (a file copied from that save, or a loop that saves the state it read
    at the resume, not the state of the loader it iterates). A resume from it replays the
    batches since. A counter of the samples seen since the start can never stand still; one a
    loader sets back at each epoch (`_num_yielded`) can, over whole epochs: only where the
    steps between could not have drawn an epoch of that many (at the run's fastest pace of it)
    is it proof."""
    a, b = pair.before, pair.after
    state_b = _loader_state(b)
    if state_b is None or b.step is None:
        return []
    positions = {n: v for n, v in _loader_positions(b).items() if v > 0}
    if not positions:
        return []
    source: tuple[Save, int] | None = None  # the oldest save holding that state, its step
    for save in (a, *reversed(pair.earlier)):
        state = _loader_state(save)
        if state is None or save.step is None or save.step >= b.step:
            break
        if not _same_state(state, state_b):
            break
        source = (save, save.step)
    if source is None or a.step is None:
        return []
    oldest, oldest_step = source
    # proof against the save before (the fewest steps between), the state named after the
    # oldest save that holds it
    steps = b.step - a.step
    runs = [*pair.earlier, a, b]
    proof: list[str] = []
    for name, value in sorted(positions.items()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _PER_EPOCH or leaf not in DATA_COUNTERS:
            # back at the same place after whole epochs: each at least `value` long
            pace = max(
                (
                    s.data_counters[name] / s.step
                    for s in runs
                    if name in s.data_counters and s.step
                ),
                default=0.0,
            )
            if value <= pace * steps:
                continue
            proof.append(
                f"{name} {fmt(value)} at {a.name} and at {b.name}, {fmt(steps)} steps later "
                f"(at {fmt(pace)} per step it would be {fmt(value + pace * steps)}; an epoch "
                f"of {fmt(value)} or more cannot pass in {fmt(pace * steps)})"
            )
        else:
            proof.append(
                f"{name} {fmt(value)} at {a.name} and at {b.name}, {fmt(steps)} steps "
                "later: a count of the data seen since the start never stands still"
            )
    if not proof:
        return []
    files = sorted({e.file for e in b.loader_entries if e.file})
    where = f" ({', '.join(files)})" if files else ""
    return [
        Cause(
            id="inconsistent_state",
            title=f"{b.name} holds {oldest.name}'s data-loader state: a resume from it replays "
            "data",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=[
                f"the data-loader state of {b.name}{where} is identical to {oldest.name}'s, "
                f"entry for entry ({len(state_b)} entries), while the run took "
                f"{fmt(b.step - oldest_step)} steps between them",
                *proof,
            ],
            fix=f"{b.name}'s data-loader state was copied from {oldest.name} (files of two "
            "saves put together), or the loop saves a loader state it read once (at the "
            "resume) instead of the state of the loader it iterates: save loader.state_dict() "
            f"of that loader at each save. Resumed from {b.name}, the run would replay the "
            f"batches since {oldest.name}: resume from {oldest.name}, or put back the loader "
            f"state written with {b.name}.",
        )
    ]
