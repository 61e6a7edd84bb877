"""Run-setup causes: the global batch changed (world size, per-device batch or gradient
accumulation) without the learning rate rescaled with it; the seed (or the data seed), the
learning-rate schedule's settings, the gradient clipping, the model config or the tokenizer
changed between the saves."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from .models import Cause
from .pair import Pair, fmt
from .save import CONFIG_FILES, TOKENIZER_FILES, Save

#: config keys that change with every save or tool version, never the model
_VOLATILE = {"transformers_version", "_name_or_path", "name_or_path", "_commit_hash"}
#: dtype keys: a precision change is its own cause (`weights.py`)
_DTYPE_KEYS = {"torch_dtype", "dtype"}
#: a work-per-step ratio this far from 1 is a changed global batch
_RATIO_TOLERANCE = 0.2


#: data counters that count samples or tokens since the run's start (never per epoch): their
#: growth per step is the global batch
_CUMULATIVE = (
    "samples_seen",
    "num_input_tokens_seen",
    "tokens_seen",
    "ntokens_seen",
    "consumed_samples",
    "consumed_train_samples",
)


def _grows_with_batch(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _CUMULATIVE


def _close(x: float, y: float, rel: float = 0.05) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y))


def _global_batch(save: Save, keys: set[str]) -> float:
    out = 1.0
    for key in keys:
        out *= save.settings[key]
    return out


def _rescaled(lr_ratio: float, ratio: float, possible: tuple[float, float] | None) -> bool:
    """Whether the learning rate was rescaled with the global batch (linearly or by its square
    root): with `ratio`, or any ratio in `possible` (the range a short last step allows)."""
    if _close(lr_ratio, ratio) or _close(lr_ratio, math.sqrt(ratio)):
        return True
    if possible is None:
        return False
    low, high = possible[0] * 0.95, possible[1] * 1.05
    return low <= lr_ratio <= high or low <= lr_ratio**2 <= high


def _epoch_ends(first: Save | None, last: Save) -> int:
    """How many epochs ended in the steps after `first` (the run's start when None) up to
    `last`: each may end in a short step (its last batch, or fewer accumulated micro-batches)."""
    end = last.value("trainer_state.epoch")
    start = 0.0 if first is None else first.value("trainer_state.epoch")
    if not isinstance(end, int | float) or not isinstance(start, int | float):
        return 0
    return max(math.floor(end + 1e-6) - math.floor(start + 1e-6), 0)


def _pace_range(work: float, steps: int, ends: int) -> tuple[float, float]:
    """The work of a full step over `steps` steps, `ends` of them possibly short."""
    high = work / (steps - ends) if steps > ends else math.inf
    return work / steps, high


def _counter(save: Save, name: str) -> float | None:
    """Work counter `name` of `save`, or the data counter of that name."""
    value = save.work_counters.get(name)
    return value if value is not None else save.data_counters.get(name)


def _interval_paces(
    pair: Pair, name: str, after: float
) -> tuple[tuple[float, float], tuple[float, float], str] | None:
    """The work per step of work counter `name` over the interval before the pair (from the
    save before `pair.before`, else from the start) and over the pair's own, and the span of
    the first (`checkpoint-2 → checkpoint-4`); None when unknown. A plain loop's samples
    counter says nothing of its epochs: each interval may end one, in a short last batch."""
    a, b = pair.before, pair.after
    before, n = _counter(a, name), pair.elapsed
    if before is None or n is None or not a.step:
        return None
    prev = pair.earlier[-1] if pair.earlier else None
    prev_work = _counter(prev, name) if prev is not None else None
    if prev is not None and prev.step is not None and prev_work is not None and prev.step < a.step:
        work_a, steps_a, first = before - prev_work, a.step - prev.step, prev
    else:
        work_a, steps_a, first = before, a.step, None
    work_b = after - before
    if work_a <= 0 or work_b <= 0:
        return None
    unknown = 0 if name in b.work_counters else 1  # epoch ends the counter cannot tell
    return (
        _pace_range(work_a, steps_a, max(_epoch_ends(first, a), unknown)),
        _pace_range(work_b, n, max(_epoch_ends(a, b), unknown)),
        f"{first.name} → {a.name}" if first is not None else f"the start → {a.name}",
    )


def check_batch(pair: Pair, notes: list[str]) -> list[Cause]:
    """The batch cause of one pair; changes that are no cause go to `notes`."""
    a, b = pair.before, pair.after
    evidence: list[str] = []
    ratio: float | None = None
    known = {k for k in a.settings if k in b.settings}
    changed = [k for k in sorted(known) if a.settings[k] != b.settings[k]]
    if changed:
        ratio = _global_batch(b, known) / _global_batch(a, known)
        for key in changed:
            where = sorted({a.setting_source(key), b.setting_source(key)})
            evidence.append(
                f"{key.replace('_', ' ')} {fmt(a.settings[key])} at {a.name}, "
                f"{fmt(b.settings[key])} at {b.name} ({' / '.join(where)})"
            )
    counters = dict(b.work_counters)
    if not known:
        # no batch setting recorded on both sides: the samples (tokens) a plain loop counts
        # seen grow by the global batch per step
        counters.update(
            (name, value) for name, value in b.data_counters.items() if _grows_with_batch(name)
        )
    # the global batch ratios a short last step leaves possible (None: the settings say)
    possible: tuple[float, float] | None = None
    for name, after in counters.items():
        paces = _interval_paces(pair, name, after)
        if paces is None:
            continue
        (low_a, high_a), (low_b, high_b), span = paces
        # each range holds the pace of a full step: an interval that ends an epoch holds its
        # short last step (fewer rows, fewer accumulated micro-batches), so its pace is a range
        if low_b > high_a * (1 + _RATIO_TOLERANCE):
            pace_a, pace_b = high_a, low_b
        elif high_b < low_a * (1 - _RATIO_TOLERANCE):
            pace_a, pace_b = low_a, high_b
        else:
            continue
        short = ""
        if name not in b.work_counters:
            # a plain loop's counter: its epochs unknown, the paces without a short step
            pace_a, pace_b = low_a, low_b
            short = " (a short last batch in each interval allowed for)"
        evidence.append(
            f"{name} per step {pace_a:.4g} over {span}, {pace_b:.4g} over {pair.where()} "
            f"(×{pace_b / pace_a:.2f}): each step now processes "
            f"{'more' if pace_b > pace_a else 'less'} data{short}"
        )
        if ratio is None or ratio == 1.0:
            ratio = pace_b / pace_a
            possible = (low_b / high_a, high_b / low_a) if short else None
    if ratio is None:
        return []
    if _close(ratio, 1.0):
        if changed:
            notes.append("; ".join(evidence) + f": the global batch is unchanged ({pair.where()})")
        return []
    lr_a, lr_b = a.base_lr, b.base_lr
    if lr_a and lr_b:
        lr_ratio = lr_b / lr_a
        if _rescaled(lr_ratio, ratio, possible):
            notes.append(
                "; ".join(evidence) + f": global batch ×{ratio:.3g}, learning rate rescaled "
                f"×{lr_ratio:.3g} ({fmt(lr_a)} → {fmt(lr_b)})"
            )
            return []
        evidence.append(
            f"global batch ×{ratio:.3g} but the learning rate ×{lr_ratio:.3g} "
            f"({fmt(lr_a)} → {fmt(lr_b)}): not rescaled with it"
        )
    else:
        evidence.append(f"global batch ×{ratio:.3g}")
    return [
        Cause(
            id="batch_changed",
            title="the global batch changed at the resume, the learning rate was not rescaled",
            score=0.85,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Keep world size × per-device batch × gradient accumulation as before (change "
            "the accumulation to make up for a changed world size), or rescale the learning "
            "rate with the global batch; declare an intended change with --expect batch.",
        )
    ]


def _flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for key, value in doc.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): doc}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _json_changes(a: Any, b: Any, rel: str) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    lines = []
    for key in sorted(set(fa) | set(fb)):
        if key.split(".")[-1] in _VOLATILE | _DTYPE_KEYS:
            continue
        if fa.get(key, "<absent>") != fb.get(key, "<absent>"):
            lines.append(
                f"{rel}: {key} {_short(fa.get(key, '<absent>'))} → {_short(fb.get(key, '<absent>'))}"
            )
    return lines


def check_config(pair: Pair) -> list[Cause]:
    """The config cause of one pair of saves."""
    a, b = pair.before, pair.after
    evidence: list[str] = []
    for rel in CONFIG_FILES:
        da, db = a.json_file(rel), b.json_file(rel)
        if da is None or db is None:
            continue
        evidence += _json_changes(da, db, rel)
    if not evidence:
        return []
    return [
        Cause(
            id="config_changed",
            title="the model config changed between the saves",
            score=0.75,
            before=a.name,
            after=b.name,
            evidence=evidence[:8] + ([f"… {len(evidence) - 8} more"] if len(evidence) > 8 else []),
            fix="Resume with the config the run was saved with (from_pretrained on the "
            "checkpoint folder), or declare the change with --expect config.",
        )
    ]


def _vocab(doc: Any) -> dict[str, int]:
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        return {str(k): v for k, v in vocab.items() if isinstance(v, int)}
    if isinstance(vocab, list):  # unigram: [[piece, score], ...]
        return {str(p[0]): i for i, p in enumerate(vocab) if isinstance(p, list) and p}
    return {}


def check_tokenizer(pair: Pair) -> list[Cause]:
    """The tokenizer cause of one pair of saves."""
    a, b = pair.before, pair.after
    evidence: list[str] = []
    for rel in TOKENIZER_FILES:
        raw_a, raw_b = a.file_bytes(rel), b.file_bytes(rel)
        if raw_a is None or raw_b is None or raw_a == raw_b:
            continue
        if rel == "tokenizer.json":
            va, vb = _vocab(a.json_file(rel)), _vocab(b.json_file(rel))
            moved = sum(1 for tok, i in va.items() if tok in vb and vb[tok] != i)
            added = len(set(vb) - set(va))
            removed = len(set(va) - set(vb))
            evidence.append(
                f"{rel}: vocabulary {len(va)} → {len(vb)} tokens, {moved} tokens renumbered, "
                f"{added} added, {removed} removed"
            )
            continue
        if rel.endswith(".json"):
            da, db = a.json_file(rel), b.json_file(rel)
            if da is not None and db is not None:
                changes = _json_changes(da, db, rel)
                evidence += changes[:4]
                if changes:
                    continue
        evidence.append(
            f"{rel} differs (sha256 {hashlib.sha256(raw_a).hexdigest()[:12]} → "
            f"{hashlib.sha256(raw_b).hexdigest()[:12]})"
        )
    if not evidence:
        return []
    return [
        Cause(
            id="tokenizer_changed",
            title="the tokenizer changed between the saves: the same ids mean other tokens",
            score=0.8,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Resume with the tokenizer saved beside the checkpoint (AutoTokenizer."
            "from_pretrained on the checkpoint folder), or declare it with --expect tokenizer.",
        )
    ]


def check_seed(pair: Pair) -> list[Cause]:
    """The seed cause of one pair: the Trainer's `seed`, or the `data_seed` its sampler
    shuffles with (`seed` where unset), changed (training_args.bin)."""
    a, b = pair.before, pair.after
    args_a, args_b = a.training_args, b.training_args
    seed_a, seed_b = args_a.get("seed"), args_b.get("seed")
    if not isinstance(seed_a, int) or not isinstance(seed_b, int):
        return []
    data_a, data_b = args_a.get("data_seed"), args_b.get("data_seed")
    shuffle_a = data_a if isinstance(data_a, int) else seed_a
    shuffle_b = data_b if isinstance(data_b, int) else seed_b
    where = f"training_args.bin of {a.name} and {b.name}"
    evidence: list[str] = []
    if seed_a != seed_b:
        evidence.append(
            f"seed {seed_a} → {seed_b} at the resume ({where}): the random draws after the "
            "resume (dropout, initialisations) are not the run's"
        )
    if shuffle_a != shuffle_b:
        evidence.append(
            f"data_seed {_seed(data_a)} → {_seed(data_b)} at the resume ({where}): the sampler shuffles with "
            f"{shuffle_b} (was {shuffle_a}), so the batches after the resume are not the ones "
            "the run would have seen, and the batches skipped to the resume point are not the "
            "ones it trained on"
        )
    if not evidence:
        return []
    data_only = seed_a == seed_b
    return [
        Cause(
            id="seed_changed",
            title="the run was resumed with another data seed: another data order"
            if data_only
            else "the run was resumed with another seed: another data order and dropout",
            score=0.7,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="Resume with the seeds the run was started with (TrainingArguments.seed "
            f"{seed_a}"
            + (f", data_seed {_seed(data_a)}" if shuffle_a != shuffle_b else "")
            + " here), "
            "or declare the change with --expect seed_changed.",
        )
    ]


def _seed(value: Any) -> str:
    return "unset" if value is None else str(value)


#: the Trainer's schedulers whose learning rate does not depend on the run's total steps
_NO_TOTAL = ("constant", "constant_with_warmup", "reduce_lr_on_plateau", "inverse_sqrt")


def check_schedule(pair: Pair) -> list[Cause]:
    """The schedule cause of one pair: the Trainer's scheduler settings (`lr_scheduler_type`,
    the warm-up, the total steps it decays over) other after the resume. A restored scheduler
    keeps its step count, never its shape: `LambdaLR` saves no lambda, the Trainer builds it
    anew from the arguments, so the learning rate follows the new curve from the resume on."""
    a, b = pair.before, pair.after
    args_a, args_b = a.training_args, b.training_args
    evidence: list[str] = []
    for key in ("lr_scheduler_type", "warmup_steps", "warmup_ratio"):
        if key in args_a and key in args_b and args_a[key] != args_b[key]:
            evidence.append(
                f"{key} {args_a[key]} at {a.name}, {args_b[key]} at {b.name} (training_args.bin)"
            )
    total_a, total_b = a.value("trainer_state.max_steps"), b.value("trainer_state.max_steps")
    kind = args_b.get("lr_scheduler_type")
    if (
        isinstance(total_a, int)
        and isinstance(total_b, int)
        and total_a > 0
        and total_b > 0
        and total_a != total_b
        and kind not in _NO_TOTAL
    ):
        epochs_a, epochs_b = args_a.get("num_train_epochs"), args_b.get("num_train_epochs")
        why = (
            f", num_train_epochs {fmt(epochs_a)} → {fmt(epochs_b)}"
            if isinstance(epochs_a, int | float)
            and isinstance(epochs_b, int | float)
            and epochs_a != epochs_b
            else ""
        )
        evidence.append(
            f"total steps {total_a} at {a.name}, {total_b} at {b.name} (trainer_state.json "
            f"max_steps{why}): the {kind or 'learning-rate'} schedule now runs over "
            f"{total_b} steps, so the learning rate after the resume is not the run's"
        )
    if not evidence:
        return []
    return [
        Cause(
            id="schedule_changed",
            title="the learning-rate schedule was changed at the resume: the restored "
            "scheduler follows another curve",
            score=0.75,
            before=a.name,
            after=b.name,
            evidence=evidence,
            fix="A restored scheduler keeps its step count only; its shape comes from the "
            "arguments of the resumed run: resume with the run's lr_scheduler_type, warm-up "
            "and total steps (max_steps, or num_train_epochs; extending a run changes its "
            "decay), or declare the change with --expect schedule.",
        )
    ]


def check_grad_clip(pair: Pair) -> list[Cause]:
    """The gradient-clipping cause of one pair: the clipping norm the run was configured with
    (the Trainer's `max_grad_norm`, DeepSpeed's `gradient_clipping`, a loop's own record)
    other after the resume. No optimizer state keeps it: the resumed run clips as it is told."""
    a, b = pair.before, pair.after
    clip_a, clip_b = a.grad_clip, b.grad_clip
    if clip_a is None or clip_b is None or clip_a[0] == clip_b[0]:
        return []
    where = sorted({clip_a[1], clip_b[1]})
    off = " (0: no clipping)" if 0.0 in (clip_a[0], clip_b[0]) else ""
    return [
        Cause(
            id="grad_clip_changed",
            title="the gradient clipping changed at the resume: the updates are clipped otherwise",
            score=0.7,
            before=a.name,
            after=b.name,
            evidence=[
                f"gradient clipping norm {fmt(clip_a[0])} at {a.name}, {fmt(clip_b[0])} at "
                f"{b.name} ({' / '.join(where)}){off}: no saved state carries it, the resumed "
                "run clips its gradients as it is configured"
            ],
            fix=f"Resume with the run's clipping norm ({fmt(clip_a[0])} here: "
            "TrainingArguments.max_grad_norm, DeepSpeed's gradient_clipping, the max_norm of "
            "clip_grad_norm_), or declare the change with --expect grad-clip.",
        )
    ]
