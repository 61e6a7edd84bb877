"""The training logs the frameworks write, read as one series of (step, loss, lr) records.

Sources, in this order: the `log_history` of a Trainer save's `trainer_state.json`, a
`metrics.jsonl` in the run folder (one JSON object per line with `step`), and Lightning's CSV
logs (`lightning_logs/version_N/metrics.csv`, a new version per run: a resumed run continues in
the next one, or `metrics.csv` in the run folder). A restart shows in a series as a step logged
twice or the steps going back.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from typing import Any

from ...errors import CkptError
from ...storage import Storage
from .models import LogJump

_LOSS_KEYS = ("loss", "train_loss", "train/loss", "train_loss_step", "loss_step", "training_loss")
_LR_KEYS = ("learning_rate", "lr", "train/lr", "train/learning_rate")
#: the most bytes of one log read
_MAX_LOG = 64 << 20


@dataclass
class Record:
    """One logged step."""

    step: int
    loss: float | None
    lr: float | None


@dataclass
class Series:
    """A log's records in the order they were written, and where they came from."""

    source: str
    records: list[Record]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _record(row: dict[str, Any]) -> Record | None:
    step = _number(row.get("step", row.get("global_step")))
    if step is None:
        return None
    loss = next((_number(row[k]) for k in _LOSS_KEYS if _number(row.get(k)) is not None), None)
    lr = next((_number(row[k]) for k in _LR_KEYS if _number(row.get(k)) is not None), None)
    if lr is None:
        lr = next(
            (_number(v) for k, v in row.items() if k.startswith("lr-") and _number(v) is not None),
            None,
        )
    if loss is None and lr is None:
        return None
    return Record(int(step), loss, lr)


def from_trainer_state(doc: Any, source: str) -> Series | None:
    """The Trainer's `log_history` (training entries: those with a loss or learning rate)."""
    history = doc.get("log_history") if isinstance(doc, dict) else None
    if not isinstance(history, list):
        return None
    records = [r for r in (_record(e) for e in history if isinstance(e, dict)) if r]
    return Series(source, records) if records else None


def run_logs(storage: Storage, describe: str) -> list[Series]:
    """The run folder's own logs: `metrics.jsonl`, then Lightning CSV logs (all versions, in
    version order, as one series)."""
    files = storage.list_files()
    found: list[Series] = []
    if "metrics.jsonl" in files and files["metrics.jsonl"] <= _MAX_LOG:
        records: list[Record] = []
        for line in _text(storage, "metrics.jsonl").splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict) and (rec := _record(row)) is not None:
                records.append(rec)
        if records:
            found.append(Series(f"{describe}/metrics.jsonl", records))
    csvs = sorted(
        (rel for rel in files if rel.endswith("metrics.csv") and files[rel] <= _MAX_LOG),
        key=_version_order,
    )
    records = []
    for rel in csvs:
        for row in csv.DictReader(io.StringIO(_text(storage, rel))):
            if (rec := _record(dict(row))) is not None:
                records.append(rec)
    if records:
        found.append(
            Series(f"{describe}/{csvs[0] if len(csvs) == 1 else 'metrics.csv logs'}", records)
        )
    return found


def _version_order(rel: str) -> tuple[int, str]:
    match = re.search(r"version_(\d+)", rel)
    return (int(match.group(1)) if match else -1, rel)


def _text(storage: Storage, rel: str) -> str:
    try:
        return storage.read_all(rel).decode("utf-8", errors="replace")
    except CkptError:
        return ""


def restarts(series: Series) -> list[int]:
    """Indices of the records that start again: a step not after the one logged before it."""
    recs = series.records
    return [i for i in range(1, len(recs)) if recs[i].step <= recs[i - 1].step]


def jump(series: Series, step_before: int, step_after: int | None) -> LogJump | None:
    """The logged values around a resume from `step_before` (None when the log misses it)."""
    recs = series.records
    starts = [
        i
        for i in restarts(series)
        if recs[i].step > step_before and (step_after is None or recs[i].step <= step_after)
    ]
    restarted = bool(starts)
    if starts:
        first = starts[0]
    else:
        first = next((i for i, r in enumerate(recs) if r.step > step_before), -1)
        if first < 0:
            return None
    prior = [r for r in recs[:first] if r.step <= step_before]
    if not prior:
        return None
    before, after = prior[-1], recs[first]
    out = LogJump(
        source=series.source,
        step_before=before.step,
        step_after=after.step,
        loss_before=before.loss,
        loss_after=after.loss,
        lr_before=before.lr,
        lr_after=after.lr,
        restarted=restarted,
    )
    if before.lr is not None:
        _warmup_again(out, recs, first, step_before, step_after, before.lr)
    return out


def _warmup_again(
    out: LogJump,
    recs: list[Record],
    first: int,
    step_before: int,
    step_after: int | None,
    lr_before: float,
) -> None:
    """Set `out.lr_like_*` when a step after the resume (up to the next save) ran with the
    learning rate the run had logged as many steps from its start as it stands from the
    resume (the schedule started over), and not with the one logged at the resume, nor the one
    logged at that same step before the restart (a continued schedule's)."""
    earlier: dict[int, float] = {r.step: r.lr for r in recs[:first] if r.lr is not None}
    found: tuple[int, int, float] | None = None
    for i, r in enumerate(recs[first:]):
        if r.step <= step_before or (step_after is not None and r.step > step_after):
            break
        fresh = r.step - step_before  # where a schedule that started over stands
        if r.lr is None or fresh not in earlier:
            continue
        if r.step in earlier and _close(earlier[r.step], r.lr):
            if i > 0 and not _close(earlier[fresh], r.lr):
                return  # past the first step (the restored optimizer's LR): carried on
            continue
        if found is None and not _close(r.lr, lr_before) and _close(earlier[fresh], r.lr):
            found = (fresh, r.step, r.lr)
    if found is not None:
        out.lr_like_step, out.lr_like_at, out.lr_like = found


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-9 + 1e-6 * max(abs(x), abs(y))
