"""Optimizer causes: state not restored (step counts restart, second moments collapse), or
restored for other parameters (param groups or shapes that no longer fit the weights)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ...models import Entry, Problem
from ...sources.layouts.training import OptimizerView, analyse_optimizer, shape_problems
from ...sources.runs import SLIM_RECORD
from .models import Cause
from .pair import Pair, counter_restart, fmt
from .save import Save
from .tensors import correlation, head, moments_against
from .tensors import total as tensor_total

if TYPE_CHECKING:
    from numpy.typing import NDArray

#: tensors this small carry too little to judge a correlation by
_MIN_NUMEL = 16

#: the `verify` problem of optimizer state that `load_state_dict` restores nothing of
IDS_AS_STRINGS = "optimizer_ids_as_strings"


def second_moment_mean(save: Save) -> float | None:
    """The mean of Adam's `exp_avg_sq` over every parameter (streamed, one tensor at a time;
    once per save, as each pair and check asks again)."""
    if "exp_avg_sq_mean" in save.memo:
        known: float | None = save.memo["exp_avg_sq_mean"]
        return known
    save.memo["exp_avg_sq_mean"] = mean = _second_moment_mean(save)
    return mean


def _second_moment_mean(save: Save) -> float | None:
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
    restart = found if found is not None and found.restarted else None
    # the count a fresh optimizer would have, with the very moments of the save before: no
    # optimizer started over, the save before's state was saved again (two saves mixed)
    copied = restart is not None and a.optimizer_step == b.optimizer_step and _same_moments(a, b)
    if copied:
        restart = None
    misfits_before = shape_problems(a.opened)  # read once: `_mismatch` compares with it
    # a save whose optimizer ids are strings loads as nothing, whatever the counters say
    # (the stale entries it leaves in the optimizer are saved again, with their old counts)
    unloadable = [p for p in misfits_before if p.code == IDS_AS_STRINGS]
    if restart is not None or unloadable:
        evidence = []
        if restart is not None:
            evidence.append(
                f"optimizer step count {fmt(restart.before)} at {a.name}, "
                f"{fmt(restart.after)} at {b.name}: "
                + restart.outlook("a restored optimizer would count", "a fresh one")
            )
            before_v, after_v = second_moment_mean(a), second_moment_mean(b)
            if before_v and after_v is not None:
                evidence.append(
                    f"mean exp_avg_sq {before_v:.3g} → {after_v:.3g} "
                    f"(×{after_v / before_v:.2f})"
                    + (": the second moments started over" if after_v < before_v else "")
                )
        evidence += [f"{a.name}: {p.message.split(': ', 1)[-1]}" for p in unloadable]
        causes.append(
            Cause(
                id="optimizer_not_restored",
                title="the optimizer state was not restored: its ids were saved as strings"
                if unloadable
                else "the optimizer state was not restored: Adam's step counts started over",
                score=0.95,
                before=a.name,
                after=b.name,
                evidence=evidence,
                fix="Re-key the saved optimizer state by int ids before loading it "
                "(`{int(k): v for k, v in sd['state'].items()}`), or convert the DCP save "
                "with `ckpt convert SRC OUT.pt --to torch`, which writes int ids."
                if unloadable
                else "Load the optimizer's state dict after building the optimizer on the "
                "resumed model (Trainer: keep optimizer.pt beside the weights; accelerate: "
                "prepare the optimizer before load_state; DCP: build its state with "
                "get_state_dict before dcp.load, which loads in place, then set_state_dict; "
                "torchtitan: keep `optimizer` out of checkpoint.exclude_from_loading).",
            )
        )
    model_only = _from_model_only_save(pair)
    if restart is None and not unloadable and (model_only or _fresh_after_weights_only(pair)):
        evidence = [
            f"{a.name} holds no optimizer state (weights only"
            + (", slimmed by `ckpt prune`" if SLIM_RECORD in a.source.files else "")
            + (
                ": saved with save_only_model=True, training_args.bin; no optimizer.pt, "
                "scheduler.pt or rng_state.pth"
                if model_only
                else ""
            )
            + ")"
        ]
        if b.optimizer_step is not None:
            evidence.append(
                f"optimizer step count {fmt(b.optimizer_step)} at {b.name}, "
                f"{fmt(pair.elapsed)} steps after {a.name}: a fresh optimizer's count"
            )
        causes.append(
            Cause(
                id="optimizer_not_restored",
                title="the run resumed from a save without optimizer state: the optimizer "
                "started fresh",
                score=0.95,
                before=a.name,
                after=b.name,
                evidence=evidence,
                fix="The Trainer's save_only_model=True saves cannot resume a run: they keep "
                "the weights alone, so the optimizer, the LR schedule and the RNG start "
                "afresh. Train with save_only_model=False to resume (save_total_limit bounds "
                "the disk), or accept that Adam's moments and the schedule start over."
                if model_only
                else "Resume from a save that kept its optimizer state (`ckpt latest RUN` "
                "names the newest whole one; `prune --slim-older-than` never slims the "
                "newest), or accept that Adam's moments start over.",
            )
        )
    if restart is None and not unloadable and not causes:
        causes += _copied(pair) if copied else _restored_from_another_save(pair)
    settings = _settings_changed(pair)
    if settings is not None:
        causes.append(settings)
    mismatch = _mismatch(a, b, misfits_before)
    if not mismatch and pair.earlier:
        mismatch = _reordered_by_updates(pair.earlier[-1], a, b)
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


#: param-group settings that change what a step does (the learning rate is the scheduler's)
SETTINGS = (
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "dampening",
    "nesterov",
    "amsgrad",
    "maximize",
    "alpha",
    "centered",
    "rho",
)


def _settings(save: Save) -> dict[tuple[int, str], object]:
    """The step settings of each optimizer param group, by (group, setting)."""
    prefix = save.prefix("optimizer")
    if prefix is None:
        return {}
    found: dict[tuple[int, str], object] = {}
    for group in range(len(save.param_groups)):
        for key in SETTINGS:
            value = save.value(f"{prefix}param_groups.{group}.{key}")
            if isinstance(value, bool | int | float):
                found[group, key] = value
            elif isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
                found[group, key] = tuple(value)
    return found


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return fmt(value) if isinstance(value, int | float) else repr(value)


def _settings_changed(pair: Pair) -> Cause | None:
    """Optimizer settings (weight decay, betas, eps, momentum...) other after the resume than
    at the save resumed from: `load_state_dict` restores the saved ones, so another value was
    set on the restored optimizer (a config value applied after the load). A setting that
    also changed over the interval before (a weight-decay schedule) is the run's own."""
    a, b = pair.before, pair.after
    before, after = _settings(a), _settings(b)
    earlier = _settings(pair.earlier[-1]) if pair.earlier else {}
    evidence = [
        f"{key} {_shown(value)} at {a.name}, {_shown(after[group, key])} at {b.name} "
        f"(optimizer param group {group})"
        for (group, key), value in before.items()
        if (group, key) in after
        and after[group, key] != value
        and earlier.get((group, key), value) == value
    ]
    if not evidence:
        return None
    return Cause(
        id="optimizer_settings_changed",
        title="the optimizer's settings changed at the resume: each step after it is another "
        "update rule",
        score=0.75,
        before=a.name,
        after=b.name,
        evidence=evidence[:8],
        fix="Keep the settings the optimizer was saved with (`load_state_dict` restores them; "
        "a value set on the param groups after the load overrides them), or declare an "
        "intended change with --expect optimizer-settings.",
    )


def _mismatch(a: Save, b: Save, misfits_before: list[Problem]) -> list[str]:
    """What shows the optimizer state restored for other parameters: param groups that
    changed, and problems of `b`'s optimizer that `a` (whose are `misfits_before`) lacked."""
    evidence: list[str] = _reordered(a, b)
    if a.param_groups and b.param_groups and a.param_groups != b.param_groups:
        evidence.append(
            f"param groups {a.param_groups} parameters at {a.name}, {b.param_groups} at {b.name}"
        )
    before = {p.message for p in misfits_before}
    for problem in shape_problems(b.opened):
        # string ids restore nothing (`check`'s `optimizer_not_restored`), not other parameters
        if problem.message not in before and problem.code != IDS_AS_STRINGS:
            evidence.append(problem.message)
    return evidence[:8]


def _reordered(a: Save, b: Save) -> list[str]:
    """Optimizer state at `b` numbered for another parameter order than `b`'s model: where the
    saves number the optimizer's parameters as their model's tensors come (`a`'s state, id for
    id, has the shapes of `a`'s model in its saved order: a plain loop's `torch.save` of
    `model.state_dict()` with the optimizer over `model.parameters()`), a state of `b` whose
    shape is not that of `b`'s parameter of the same number was loaded by number into a model
    whose parameters come in another order (a refactored `__init__`): `load_state_dict` maps
    state by position, and fused Adam steps a state of another shape with the same element
    count without a word. Each shape-fitting multiset (what `shape_problems` checks) misses it."""
    before, after = _by_position(a), _by_position(b)
    if before is None or after is None or len(before) != len(after):
        return _grouped_reorder(a, b)
    if any(_misfits(states, shape) for _, _, shape, states in before):
        # `a` does not number its state by the model's order as one list: param groups may
        return _grouped_reorder(a, b)
    evidence: list[str] = []
    positions_before = {name: i for i, (_, name, _, _) in enumerate(before)}
    for (pid, name, shape, states), (old_pid, old_name, old_shape, _) in zip(
        after, before, strict=True
    ):
        wrong = _misfits(states, shape)
        if wrong is None:
            if name != old_name and shape == old_shape and name in positions_before:
                by_name = before[positions_before[name]][0]
                followed = _followed_by_number(a, b, pid, old_pid, by_name)
                if followed is not None:
                    key, corr_number, corr_name = followed
                    evidence.append(
                        f"optimizer state of parameter {pid} ({key}) at {b.name} carries on "
                        f"{a.name}'s state of parameter {old_pid}, {old_name!r} (correlation "
                        f"{corr_number:.3f}, against {corr_name:.3f} with the state of "
                        f"{name!r}, parameter {by_name} there), while the model's parameter "
                        f"{pid} at {b.name} is {name!r} {shape}: the parameters were "
                        "reordered at the resume and the state applied to others of the same "
                        "shape"
                    )
            continue
        key, state_shape = wrong
        evidence.append(
            f"optimizer state of parameter {pid} ({key}) is {state_shape} at {b.name}, while the "
            f"model's parameter {pid} there is {name!r} {shape}; at {a.name} parameter {pid} was "
            f"{old_name!r} {old_shape}: "
            + (
                "the parameters were reordered at the resume and the state applied to others"
                if name != old_name
                else "the state was applied to a parameter of another shape"
            )
        )
    return evidence


def _grouped_reorder(a: Save, b: Save) -> list[str]:
    """`_reordered` where the param groups split the model (weights to decay in one group,
    biases and norms in another, nanoGPT's): each group numbers its parameters in the model's
    order, which `a` shows (each group's states fit its model's tensors in their saved order)
    and `b` does not (a group's state shapes follow no order of `b`'s tensors)."""
    fitted = _group_order(a)
    if fitted is None or _group_order(b) is not None:
        return []
    positions = {name: i for i, name in enumerate(b.model_tensors)}
    for group, names in enumerate(fitted):
        if not all(name in positions for name in names):
            return []  # tensors renamed or gone: not a reorder this can show
        now = sorted(names, key=positions.__getitem__)
        moved = next((k for k, (x, y) in enumerate(zip(names, now, strict=True)) if x != y), None)
        if moved is None:
            continue
        shown = slice(moved, moved + 2)
        return [
            f"param group {group} numbers its optimizer state in the model's order: "
            f"{', '.join(map(repr, names[shown]))} at {a.name}, but {b.name}'s model comes "
            f"{', '.join(map(repr, now[shown]))}: the parameters were reordered at the resume "
            "and the state of each applied to another (its shapes fit no order of the "
            f"weights at {b.name})"
        ]
    return []


#: elements of each tensor (its first ones) read to tell which parameter a state drives
_FINGERPRINT = 4096


def _reordered_by_updates(earlier: Save, a: Save, b: Save) -> list[str]:
    """`_reordered` where no save shows its model's parameter order (safetensors stores the
    tensors sorted by name: a Trainer's `model.safetensors`, a loop's own `save_file`): which
    parameter each optimizer state drives is read from the updates. Adam moves a parameter
    along -exp_avg / sqrt(exp_avg_sq): over the interval up to a save, the change of the
    parameter a state is applied to correlates with that state's direction at the save, and
    the change of another parameter of the same size does not. A state that drove one
    parameter up to the save resumed from (`earlier` → `a`) and another after the resume
    (`a` → `b`), both clearly, and whose second moments carry on its own (not those of the
    state that drove its new parameter: a state mapped by name), was restored by number onto
    a model whose parameters come in another order."""
    driven_a, driven_b = _driven(earlier, a), _driven(a, b)
    owners = {name: pid for pid, (name, _) in driven_a.items()}
    evidence: list[str] = []
    for pid, (before, corr_a) in driven_a.items():
        after, corr_b = driven_b.get(pid, (before, 0.0))
        if after == before or after not in owners:
            continue
        # a state mapped by name onto the new numbering carries on the state of the
        # parameter it now drives, not the one of its number: no finding
        if _followed_by_number(a, b, pid, pid, owners[after]) is None:
            continue
        evidence.append(
            f"optimizer state of parameter {pid} drove {before!r} up to {a.name} (its update "
            f"direction correlates {corr_a:.2f} with that tensor's change since {earlier.name}) "
            f"and {after!r} after it (correlation {corr_b:.2f} with its change up to "
            f"{b.name}), its second moments carried on: the parameters were reordered at the "
            "resume and the state applied to others"
        )
    return evidence


def _driven(start: Save, end: Save) -> dict[str, tuple[str, float]]:
    """Which model tensor each optimizer state of `end` (int ids) drove over the interval
    from `start`, with the correlation that says so: only states with two or more tensors of
    their size to choose from, and only where one tensor's change correlates with the state's
    direction clearly above the noise of the elements read and above every other's."""
    memo: dict[str, dict[str, tuple[str, float]]] = end.memo.setdefault("driven", {})
    if start.name not in memo:  # each save is the end of one interval, the start of the next
        memo[start.name] = _driven_over(start, end)
    return memo[start.name]


def _driven_over(start: Save, end: Save) -> dict[str, tuple[str, float]]:
    keyed = _int_keyed_groups(end)
    prefix = end.prefix("optimizer")
    if keyed is None or prefix is None or not start.model_tensors:
        return {}
    _, param_groups = keyed
    by_size: dict[int, list[str]] = {}
    for name, entry in end.model_tensors.items():
        old = start.model_tensors.get(name)
        if old is None or list(old.shape) != list(entry.shape) or (entry.numel or 0) < _MIN_NUMEL:
            continue
        by_size.setdefault(entry.numel or 0, []).append(name)
    entries = end.entries_by_name
    changes: dict[tuple[str, int], NDArray[np.float64]] = {}

    def change(name: str, count: int) -> NDArray[np.float64]:
        """The tensor's change over the interval, over its first `count` elements."""
        if (name, count) not in changes:
            changes[name, count] = _head(end, end.model_tensors[name], count) - _head(
                start, start.model_tensors[name], count
            )
        return changes[name, count]

    driven: dict[str, tuple[str, float]] = {}
    for pid in (str(p) for params in param_groups for p in params):
        momentum = entries.get(f"{prefix}state.{pid}.exp_avg")
        if momentum is None or len(by_size.get(momentum.numel or 0, [])) < 2:
            continue
        count = min(momentum.numel or 0, _FINGERPRINT)
        direction = -_head(end, momentum, count)
        second = entries.get(f"{prefix}state.{pid}.exp_avg_sq")
        if second is not None and second.numel == momentum.numel:
            direction = direction / (np.sqrt(np.abs(_head(end, second, count))) + 1e-8)
        ranked = sorted(
            (
                (correlation(change(name, count), direction), name)
                for name in by_size[momentum.numel or 0]
            ),
            reverse=True,
        )
        floor = max(0.1, 4 / math.sqrt(count))  # far above what unrelated tensors reach
        (best, name), (runner_up, _) = ranked[0], ranked[1]
        if best >= floor and best - runner_up >= floor:
            driven[pid] = (name, best)
    return driven


def _head(save: Save, entry: Entry, count: int) -> NDArray[np.float64]:
    """A tensor's fingerprint: its first `count` elements (read again where asked again, not
    kept: a run of many saves would hold them all)."""
    return head(save.opened.checkpoint, entry, count)


def _int_keyed_groups(save: Save) -> tuple[OptimizerView, list[list[object]]] | None:
    """The save's optimizer state (keyed by int parameter ids) and its param groups' id lists,
    in order; None where the save holds no model tensors or no such state."""
    prefix = save.prefix("optimizer")
    if prefix is None or not save.model_tensors:
        return None
    view = analyse_optimizer(save.opened.checkpoint, prefix)
    if view is None or view.by_fqn or view.ids_as_strings:
        return None
    groups: list[list[object]] = []
    for i in range(1024):
        params = save.value(f"{prefix}param_groups.{i}.params")
        if not isinstance(params, list | tuple):
            break
        groups.append(list(params))
    return view, groups


def _group_order(save: Save) -> list[list[str]] | None:
    """Each param group's parameters as model tensor names, matched in the model's saved
    order by the shapes of their states (a parameter without state matches none: it is left
    out); None where a group's states do not fit its model's tensors in that order."""
    keyed = _int_keyed_groups(save)
    if keyed is None:
        return None
    view, param_groups = keyed
    model = [(name, list(entry.shape)) for name, entry in save.model_tensors.items()]
    groups: list[list[str]] = []
    for params in param_groups:
        names: list[str] = []
        at = 0
        for pid in params:
            shapes = {
                tuple(s) for k, s in view.per_param.get(str(pid), {}).items() if s and k != "step"
            }
            if not shapes:
                continue
            if len(shapes) > 1:
                return None
            (shape,) = shapes
            while at < len(model) and tuple(model[at][1]) != shape:
                at += 1
            if at == len(model):
                return None
            names.append(model[at][0])
            at += 1
        groups.append(names)
    return groups if any(groups) else None


def _by_position(save: Save) -> list[tuple[str, str, list[int], dict[str, list[int]]]] | None:
    """(optimizer id, model tensor name, its shape, the id's state shapes) for each id of the
    save's param groups in order, against the model's tensors in their saved order; None where
    the counts differ (buffers saved among the weights, a partial optimizer) or the state is
    not keyed by int ids."""
    keyed = _int_keyed_groups(save)
    if keyed is None:
        return None
    view, param_groups = keyed
    ids = [str(p) for params in param_groups for p in params]
    model = list(save.model_tensors.items())
    if not ids or len(ids) != len(model):
        return None
    return [
        (pid, name, list(entry.shape), view.per_param.get(pid, {}))
        for pid, (name, entry) in zip(ids, model, strict=True)
    ]


#: how much nearer (in correlation) a state must be to the saved state of its own number than
#: to that of its parameter's name, to say it was loaded by number
_FOLLOW_MARGIN = 0.2


def _followed_by_number(
    a: Save, b: Save, pid: str, same_number: str, same_name: str
) -> tuple[str, float, float] | None:
    """Whether `b`'s optimizer state of parameter `pid` carries on `a`'s state of the same
    number (`same_number`) rather than `a`'s state of the parameter that now holds that number
    (`same_name`): (the state compared, its correlation with each) where it clearly does.

    Adam's second moments decay by beta2 (0.999) per step, so over a save interval a restored
    `exp_avg_sq` keeps the pattern it was loaded with; a load by number and a load by name
    (the state mapped onto the new order) are told apart by which one it keeps. None where
    neither is clearly nearer (the state decayed away, a momentum that forgets fast)."""
    prefix_a, prefix_b = a.prefix("optimizer"), b.prefix("optimizer")
    if prefix_a is None or prefix_b is None:
        return None
    entries_a, entries_b = a.entries_by_name, b.entries_by_name
    for key in ("exp_avg_sq", "exp_avg", "momentum_buffer"):
        after = entries_b.get(f"{prefix_b}state.{pid}.{key}")
        number = entries_a.get(f"{prefix_a}state.{same_number}.{key}")
        name = entries_a.get(f"{prefix_a}state.{same_name}.{key}")
        if after is None or number is None or name is None:
            continue
        if not after.numel or (after.numel or 0) < _MIN_NUMEL:
            return None
        if not after.numel == number.numel == name.numel:
            return None
        (_, _, corr_number), (_, _, corr_name) = moments_against(
            (b.opened.checkpoint, after),
            [(a.opened.checkpoint, number), (a.opened.checkpoint, name)],
        )
        if corr_number > 0.5 and corr_number > corr_name + _FOLLOW_MARGIN:
            return key, corr_number, corr_name
        return None
    return None


def _misfits(states: dict[str, list[int]], shape: list[int]) -> tuple[str, list[int]] | None:
    """The first state of a parameter (`exp_avg`) whose shape is not the parameter's."""
    for key, state_shape in states.items():
        if state_shape and key != "step" and state_shape != shape:
            return key, state_shape
    return None


def _fresh_after_weights_only(pair: Pair) -> bool:
    """Whether the save before holds no optimizer state while the one after counts no more
    optimizer steps than the steps between them: a resume from weights only (a slimmed save),
    whose optimizer could not have been restored."""
    a, b = pair.before, pair.after
    if a.prefix("optimizer") is not None or b.optimizer_step is None:
        return False
    elapsed = pair.elapsed
    return a.step is not None and a.step > 0 and elapsed is not None and b.optimizer_step <= elapsed


def _from_model_only_save(pair: Pair) -> bool:
    """Whether a run resumed (a restart found) from a Trainer save written with
    `save_only_model=True` (training_args.bin says so) that holds no optimizer state: there was
    none to restore, whatever the save after holds (none either, where the resumed run saves
    so too)."""
    a, b = pair.before, pair.after
    if not pair.stopped or a.prefix("optimizer") is not None:
        return False
    if a.training_args.get("save_only_model") is not True:
        return False
    elapsed = pair.elapsed
    return b.optimizer_step is None or (elapsed is not None and b.optimizer_step <= elapsed)


def _restored_from_another_save(pair: Pair) -> list[Cause]:
    """The resume loaded the optimizer state of an earlier save than the one it resumed from
    (a path built from another step): the save after counts the optimizer steps of that save
    plus the steps between the two saves. fp16 runs (a grad scaler saved, DeepSpeed's loss
    scaling) can skip optimizer steps on overflow, so a count short by whole save intervals,
    or one that did not move, proves nothing there."""
    a, b, elapsed = pair.before, pair.after, pair.elapsed
    if a.optimizer_step is None or b.optimizer_step is None or elapsed is None:
        return []
    if a.may_skip_steps or b.may_skip_steps:
        return []
    if not a.step or a.optimizer_step <= 0:
        return []
    # the optimizer's steps per counted step, from the save before (a loop that counts
    # micro-batches steps its optimizer once per accumulation)
    taken = elapsed * a.optimizer_step / a.step
    resumed_with = b.optimizer_step - taken
    if resumed_with == a.optimizer_step or resumed_with <= 0:
        return []
    if b.optimizer_step == a.optimizer_step and (
        second_moment_mean(a) is None or _same_moments(a, b)
    ):
        return _copied(pair)  # not another save's state trained on: the same state
    other = next((e for e in reversed(pair.earlier) if e.optimizer_step == resumed_with), None)
    if other is None:
        return []
    return [
        Cause(
            id="optimizer_not_restored",
            title=f"the optimizer state restored was {other.name}'s, not {a.name}'s: it "
            "lags the weights",
            score=0.9,
            before=a.name,
            after=b.name,
            evidence=[
                f"optimizer step count {fmt(b.optimizer_step)} at {b.name}, {fmt(taken)} "
                f"optimizer steps after {a.name}: the optimizer it resumed with counted "
                f"{fmt(resumed_with)}, the count of {other.name} (step {fmt(other.step)}); "
                f"{a.name}'s was {fmt(a.optimizer_step)}",
            ],
            fix=f"Load the optimizer state saved with the weights the run resumes from "
            f"({a.name}), not another save's: build both paths from the same checkpoint. "
            f"Resume from {a.name} again to train on consistent state.",
        )
    ]


def _same_moments(a: Save, b: Save) -> bool:
    """Whether two saves' optimizers hold the same second moments (mean `exp_avg_sq`)."""
    moments = second_moment_mean(a)
    return moments is not None and moments == second_moment_mean(b)


def _copied(pair: Pair) -> list[Cause]:
    """The save after holds the very optimizer state of the save before (the same step counts
    and second moments) though the run took steps between them: its optimizer file comes from
    the earlier save (two saves mixed), or the loop saved an optimizer that does not step."""
    a, b = pair.before, pair.after
    if second_moment_mean(a) is None:
        return []  # no moments to tell a copy from a state that lags by whole intervals
    return [
        Cause(
            id="inconsistent_state",
            title=f"{b.name} holds {a.name}'s optimizer state: the save mixes state of two saves",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=[
                f"optimizer step count {fmt(a.optimizer_step)} at {a.name} and at {b.name}, "
                f"{fmt(pair.elapsed)} steps later, with the same second moments (mean "
                f"exp_avg_sq {second_moment_mean(a):.6g}): the optimizer state did not move",
            ],
            fix=f"{b.name}'s optimizer state was copied from {a.name} (files of two saves "
            "put together), or the loop saves an optimizer that does not train (one built "
            f"before the model was wrapped, a copy): resume from {a.name}, and save the "
            "optimizer that steps.",
        )
    ]
