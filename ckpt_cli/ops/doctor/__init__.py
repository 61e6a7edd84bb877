"""`doctor`: why did a resumed run diverge? Explained from the saved files alone.

The run folder's complete saves are scanned (`ckpt_cli.sources.runs`), opened once each (`Save`), and
every two consecutive saves are examined as a `Pair`: the state a resume had to restore before,
the state the resumed run saved after. Each family of causes is one module and only reads:

| module | causes |
|---|---|
| `optimizer` | optimizer state not restored (step counts restart, exp_avg_sq collapses, or ids saved as strings; another save's state restored); restored for other parameters (param groups, shapes); the save before's state saved again (two saves mixed) |
| `schedule` | LR scheduler not restored (`last_epoch` or DeepSpeed's `last_batch_iteration` restarts; the logged LR back in warm-up, or the optimizer's saved LR, where no scheduler state is saved); stepped at another pace from the resume on |
| `data` | data position not restored (samples / batches / tokens seen, the loader's yielded count, the epoch fraction); an earlier save's loader state saved again (two saves mixed) |
| `scaler` | gradient scaler reset (the fp16 loss scale back at its initial value) |
| `weights` | weights partly restored (tensors uncorrelated with the save: fresh), precision changed (dtypes, the Trainer's mixed precision), EMA not restored; the save before's weights saved again (two saves mixed) |
| `setup` | global batch changed without the LR rescaled (world size, per-device batch, accumulation); seed (or data seed), LR schedule settings, gradient clipping, config or tokenizer changed |
| `rng` | RNG not restored (the state after the resume is one the run held earlier; torch's CPU generator carries another seed, or fewer draws since its seed: `mt19937`; a Trainer resumed on another number of processes, which finds no RNG file of its own) |
| `consistency` | one save: step counters that disagree; RNG for fewer ranks than the run had (its record, or its neighbours in the same process) |

`points` finds the resume points (log, step numbering, file times, or --before / --after) and
`logs` reads the Trainer's log history, Lightning's `metrics.csv` and a `metrics.jsonl` for the
loss and LR on both sides of each resume. `rank` orders the causes.

Memory: tensor statistics are sums over 1 MiB blocks of the raw bytes, viewed with numpy
(`tensors`; torch only for what the format does not store raw, one tensor at a time); counters
and settings are small entries read once per save. A doctor run never imports torch for the
formats that store raw bytes (safetensors, DCP, torch.save zips).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from ...errors import CkptError, NotFoundError, UsageError
from ...formats import resolve_source
from ...formats.base import Source
from ...models import Request
from ...sources.layouts.training import no_training_state
from ...sources.opening import open_source
from ...sources.runs import DEFAULT_SETTLE, RunCheckpoint, is_remote, looks_like_run, scan_run
from . import consistency, data, modes, optimizer, points, rng, scaler, schedule, setup, weights
from .logs import Series, from_trainer_state, jump, run_logs
from .models import CAUSE_IDS, EXPECTABLE, Cause, DoctorReport, LogJump, ResumePoint
from .pair import Pair
from .save import Save

__all__ = ["CAUSE_IDS", "EXPECTABLE", "Cause", "DoctorReport", "LogJump", "ResumePoint", "doctor"]


class DoctorRequest(Request):
    """Every option of `doctor` but the run folder, typed and frozen (a test holds its fields
    to `doctor`'s keyword parameters and the command's options); they mean what `doctor`'s
    arguments say."""

    before: str | None = None
    after: str | None = None
    expect: list[str] = Field(default_factory=list)
    settle: float | None = None


def doctor(
    run_dir: str | None = None,
    *,
    before: str | None = None,
    after: str | None = None,
    expect: Sequence[str] = (),
    settle: float | None = None,
) -> DoctorReport:
    """Explain why a resumed run diverged, from its saves and logs.

    Args:
        run_dir: the run folder (local or a URL); or one checkpoint, whose own consistency
            is then checked. Optional with `before` and `after`.
        before / after: the save resumed from and a save the resumed run wrote (paths, or
            names inside `run_dir`): only this pair is examined.
        expect: changes made on purpose (`batch`, `world-size`, `precision`, `config`,
            `tokenizer`, ... see `EXPECTABLE`): reported as declared, not ranked.
        settle: seconds within which an incomplete save counts as still being written
            (None: `DEFAULT_SETTLE`); it judges a run folder's saves, so it is refused with
            `before` / `after` or a single checkpoint, where it would do nothing.

    Returns:
        The ranked causes (likeliest first), the resume points examined, and the verdict.
    """
    request = DoctorRequest(before=before, after=after, expect=list(expect), settle=settle)
    return doctor_with(run_dir, request)


def doctor_with(run_dir: str | None, request: DoctorRequest) -> DoctorReport:
    """`doctor` of `run_dir` as `request` says (the command's one call)."""
    before, after, settle = request.before, request.after, request.settle
    declared = _expected(request.expect)
    incomplete: set[str] = set()  # the names of the incomplete saves examined
    if (before is None) != (after is None):
        raise UsageError("--before and --after go together", fix="Give both saves, or neither.")
    if before is not None and after is not None:
        if settle is not None:
            raise _settle_unused("--before and --after name the two saves")
        first, second = _inside(run_dir, before), _inside(run_dir, after)
        if _same(first, second):
            raise UsageError(
                f"--before and --after name the same save ({first}): there is no resume "
                "between a save and itself",
                fix="Give the save the run resumed from as --before and a save the resumed "
                "run wrote as --after.",
            )
        report = DoctorReport(run_dir=run_dir or str(Path(before).parent), mode="pair")
        saves = [_open(first), _open(second)]
        logs = _logs_of(run_dir) if run_dir else []
    else:
        if run_dir is None:
            raise UsageError(
                "give RUN_DIR, or --before and --after",
                fix="ckpt doctor out/   or   ckpt doctor --before out/checkpoint-400 "
                "--after out/checkpoint-600",
            )
        # RUN_DIR is resolved (listed) once: the run check, the scan and the logs read it
        run = resolve_source(run_dir)
        if not looks_like_run(run):
            if settle is not None:
                raise _settle_unused(f"{run_dir} is one checkpoint, not a run folder")
            return _single(run_dir, declared)
        report = DoctorReport(run_dir=run_dir, mode="run")
        scan = scan_run(run, settle=DEFAULT_SETTLE if settle is None else settle)
        saves = []
        for c in scan.checkpoints:
            if c.complete:
                saves.append(_open_run_checkpoint(c))
                continue
            save = _open_incomplete(c)
            if save is None:
                report.warnings.append(f"{c.name}: skipped ({c.status}: {c.reason})")
                continue
            # a run may have resumed from it all the same: what it lacks was not restored
            report.warnings.append(
                f"{c.name}: incomplete ({c.reason}): examined as a save a resume may have "
                "started from; what it lacks could not be restored from it"
            )
            incomplete.add(c.name)
            saves.append(save)
        if not any(c.complete for c in scan.checkpoints) and not saves:
            # every save incomplete is examined all the same where it opens with its weights
            # and training state (a loop's own folders, read as a Trainer's, lack its files)
            raise _no_complete_save(run_dir, scan.checkpoints)
        logs = _logs_of(run)
    for save in saves:
        if save.name not in incomplete:  # an incomplete save's warning names what it lacks
            report.warnings += _unreadable(save)
    try:
        if report.mode == "pair":
            _check_order(saves[0], saves[1])
        _examine(report, saves, logs, declared, pair_mode=report.mode == "pair")
    finally:
        for save in saves:
            save.close()
    return report


def _newest_write(save: Save) -> float | None:
    """When the save's files were last written, where the storage says (None: unknown)."""
    stats = save.source.storage.stat_files()
    times = [stats[rel].mtime for rel in save.source.files if rel in stats]
    known = [t for t in times if t is not None]
    return max(known) if known and len(known) == len(times) else None


def _check_order(before: Save, after: Save) -> None:
    """Refuse --before / --after given the other way round: the save after the resume counts
    fewer steps and was written earlier than the one it resumed from. (A resumed run whose
    step counter started over counts fewer steps too, but writes its save later.)"""
    if before.step is None or after.step is None or after.step >= before.step:
        return
    written_before, written_after = _newest_write(before), _newest_write(after)
    if written_before is None or written_after is None or written_after >= written_before:
        return
    raise UsageError(
        f"--after {after.path} (step {after.step}) was written before --before {before.path} "
        f"(step {before.step}): a save the resumed run wrote comes after the save it resumed "
        "from",
        fix=f"Swap them: --before {after.path} --after {before.path}.",
    )


def _expected(expect: Sequence[str]) -> set[str]:
    out: set[str] = set()
    for item in expect:
        for token in item.split(","):
            token = token.strip()
            if not token:
                continue
            if token in EXPECTABLE:
                out.add(EXPECTABLE[token])
            elif token in CAUSE_IDS:
                out.add(token)
            else:
                raise UsageError(
                    f"--expect {token!r} is not a change ckpt doctor knows",
                    fix=f"Use one of: {', '.join(sorted(EXPECTABLE))}.",
                )
    return out


def _inside(run_dir: str | None, name: str) -> str:
    """`name` inside `run_dir` when it is there, else `name` as given."""
    if run_dir is None or is_remote(name) or Path(name).is_absolute():
        return name
    if is_remote(run_dir):
        return f"{run_dir.rstrip('/')}/{name}"
    candidate = Path(run_dir, name)
    return str(candidate) if candidate.exists() else name


def _same(first: str, second: str) -> bool:
    """Whether two save locations are one (local paths resolved, URLs compared as written)."""
    if is_remote(first) or is_remote(second):
        return first.rstrip("/") == second.rstrip("/")
    return Path(first).resolve() == Path(second).resolve()


def _open(path: str, name: str | None = None, step: int | None = None, mtime: float = 0.0) -> Save:
    source = resolve_source(path)
    opened = open_source(source)
    label = name or path.rstrip("/").rsplit("/", 1)[-1]
    if step is None:
        from ...sources.runs.naming import classify, counts_saves

        named = classify(label, source.target is None, lambda: True)
        # accelerate's automatic `checkpoint_N` counts saves, not steps (as the run scan says)
        if named is not None and not counts_saves(named[0], label):
            step = named[1]
    return Save(name=label, path=path, opened=opened, source=source, folder_step=step, mtime=mtime)


def _open_run_checkpoint(checkpoint: RunCheckpoint) -> Save:
    if checkpoint.step is None and checkpoint.save_number is not None:
        # a name that counts saves: no step from it (the scan has said so)
        source = resolve_source(checkpoint.path)
        return Save(
            name=checkpoint.name,
            path=checkpoint.path,
            opened=open_source(source),
            source=source,
            folder_step=None,
            mtime=checkpoint.mtime,
        )
    return _open(checkpoint.path, checkpoint.name, checkpoint.step, checkpoint.mtime)


def _open_incomplete(checkpoint: RunCheckpoint) -> Save | None:
    """A settled incomplete save that still opens with its training state (a file of it
    deleted or lost since), else None: a save still being written, or one that does not open."""
    if checkpoint.status != "incomplete" or checkpoint.symlink:
        return None
    try:
        save = _open_run_checkpoint(checkpoint)
    except CkptError:
        return None
    if save.opened.training is None or not save.model_tensors:
        save.close()
        return None
    return save


def _logs_of(run_dir: str | Source) -> list[Series]:
    try:
        source = run_dir if isinstance(run_dir, Source) else resolve_source(run_dir)
    except NotFoundError:
        return []
    if source.target is not None:
        return []
    return run_logs(source.storage, source.location.raw.rstrip("/"))


def _log_jump(pair: Pair, logs: list[Series]) -> LogJump | None:
    if pair.before.step is None:
        return None
    series = list(logs)
    state = from_trainer_state(
        pair.after.json_file("trainer_state.json"), f"{pair.after.name}/trainer_state.json"
    )
    if state is not None:
        series.insert(0, state)
    for one in series:
        found = jump(one, pair.before.step, pair.after.step)
        if found is not None:
            return found
    return None


#: the pair families, in the order they are asked
_PAIR_CHECKS = (
    optimizer.check,
    schedule.check,
    data.check,
    scaler.check,
    modes.check,
    weights.check,
    rng.check,
    setup.check_config,
    setup.check_tokenizer,
    setup.check_seed,
    setup.check_schedule,
    setup.check_grad_clip,
)


def _examine(
    report: DoctorReport,
    saves: list[Save],
    logs: list[Series],
    declared: set[str],
    pair_mode: bool,
) -> None:
    report.checkpoints = [s.name for s in saves]
    report.expected = sorted(declared)
    pairs = [
        Pair(before=saves[i], after=saves[i + 1], earlier=saves[:i], later=saves[i + 2 :])
        for i in range(len(saves) - 1)
    ]
    for pair in pairs:
        pair.log = _log_jump(pair, logs)
    report.resume_points = points.find(pairs, declared=pair_mode)
    causes: list[Cause] = []
    for pair, point in zip(pairs, report.resume_points, strict=True):
        pair.stopped = point.resumed
        found: list[Cause] = []
        for family in _PAIR_CHECKS:
            found += family(pair)
        found += setup.check_batch(pair, point.notes)
        if point.resumed:
            blind = data.unrecorded(pair)
            if blind is not None:
                report.warnings.append(blind)
        if found and "state" not in point.how:
            point.how.append("state")
            point.resumed = True
        causes += found
    explained = {
        c.after
        for c in causes
        if c.id in ("optimizer_not_restored", "scheduler_not_restored", "schedule_changed")
        or (c.id == "inconsistent_state" and c.before is not None)  # found by its pair
    }
    for pair, point in zip(pairs, report.resume_points, strict=True):
        if pair.before.name in explained and not point.resumed:
            explained.add(pair.after.name)  # the same process carried the lag on
    lost = consistency.check_ranks_lost(pairs)
    causes += lost
    # the run's first process: the saves before its first resume point
    first = next((i + 1 for i, p in enumerate(report.resume_points) if p.resumed), len(saves))
    per_update = consistency.micro_steps_per_update(saves, first)
    scheduler_pace = consistency.scheduler_steps_per_step(saves, first)
    for save in saves:
        for cause in consistency.check(save, per_update, scheduler_pace):
            if cause.id == "rng_ranks_missing" and any(c.after == save.name for c in lost):
                continue  # one finding per save
            if cause.id == "inconsistent_state" and save.name in explained:
                continue  # the pair's cause says why its counters disagree
            causes.append(cause)
    report.causes = rank(causes, declared)
    report.verdict = _verdict(report)


#: how many of a run's incomplete saves the refusal names before counting the rest
_NAMED_SAVES = 3


def _no_complete_save(run_dir: str, checkpoints: Sequence[RunCheckpoint]) -> NotFoundError:
    """Why a run folder gives doctor nothing to examine: no step checkpoint at all, or each
    one incomplete (named, with what it lacks), and the fix that helps in that case."""
    if not checkpoints:
        return NotFoundError(
            "holds no complete checkpoint to examine: no step checkpoints in it",
            path=run_dir,
            fix="Point at the folder holding the run's step checkpoints (the Trainer's "
            "output_dir, accelerate's project dir, torchtitan's checkpoint folder).",
        )
    named = "; ".join(f"{c.name}: {c.status} ({c.reason})" for c in checkpoints[:_NAMED_SAVES])
    more = len(checkpoints) - _NAMED_SAVES
    writing = any(c.status == "writing" for c in checkpoints)
    return NotFoundError(
        f"holds no complete checkpoint to examine: {named}"
        + (f"; and {more} more" if more > 0 else ""),
        path=run_dir,
        fix=(
            "Run doctor again once the save is written (`--settle 0` when nothing writes "
            "to the run any more); "
            if writing
            else ""
        )
        + f"`ckpt inspect {run_dir}` lists each save and what it lacks; to compare two saves "
        "anyway, name them with --before and --after.",
    )


def _settle_unused(why: str) -> UsageError:
    """`--settle` where no run folder's saves are judged: it would do nothing."""
    return UsageError(
        f"--settle judges the saves of a run folder, and {why}",
        fix="Leave --settle out, or give the run folder as RUN_DIR without --before/--after.",
    )


def _unreadable(save: Save) -> list[str]:
    """The save's components that could not be read, one warning each: left out of the
    examination (their causes cannot be found), and a resume from the save fails on them."""
    state = save.opened.training
    if state is None:
        return []
    return [
        f"{save.name}/{rel}: unreadable ({why}): left out of the examination; a resume from "
        f"{save.name} fails loading it"
        for rel, why in state.unreadable.items()
    ]


def _single(path: str, declared: set[str]) -> DoctorReport:
    report = DoctorReport(run_dir=path, mode="single")
    save = _open(path)
    try:
        if save.opened.training is None:
            report.warnings.append(
                f"{path}: holds no training state ({no_training_state(save.opened)}): nothing "
                "to resume from"
            )
        report.warnings += _unreadable(save)
        report.checkpoints = [save.name]
        report.expected = sorted(declared)
        report.causes = rank(consistency.check(save), declared)
        report.verdict = _verdict(report)
        if save.opened.training is None and not report.causes:
            # "can resume consistently" beside "nothing to resume from" contradicted itself
            report.verdict = f"NO CAUSE FOUND: {save.name} holds weights only, no training state"
        unreadable = list(save.opened.training.unreadable) if save.opened.training else []
        if unreadable and not report.causes:
            # its counters agree, but "can resume consistently" it cannot
            report.verdict = (
                f"NO CAUSE FOUND: {save.name}'s readable state is consistent, but it cannot "
                f"resume: {', '.join(unreadable)} unreadable"
            )
    finally:
        save.close()
    return report


def rank(causes: list[Cause], declared: set[str]) -> list[Cause]:
    """Causes ordered likeliest first (score, then the order of `CAUSE_IDS`); declared ones
    last with rank 0. A cause found for several pairs keeps its strongest finding first."""
    order = {cid: i for i, cid in enumerate(CAUSE_IDS)}
    for cause in causes:
        cause.declared = cause.id in declared
    ranked = sorted(causes, key=lambda c: (c.declared, -c.score, order.get(c.id, len(order))))
    n = 0
    for cause in ranked:
        if cause.declared:
            cause.rank = 0
        else:
            n += 1
            cause.rank = n
    return ranked


def _verdict(report: DoctorReport) -> str:
    live = [c for c in report.causes if not c.declared]
    resumes = [p for p in report.resume_points if p.resumed]
    if not live:
        where = f"{len(resumes)} resume point(s)" if resumes else "no resume point"
        if report.mode == "single":
            return f"NO CAUSE FOUND: {report.checkpoints[0]} can resume consistently"
        return f"NO CAUSE FOUND: {len(report.checkpoints)} saves, {where}, state continuous"
    top = live[0]
    where = f"{top.before} → {top.after}" if top.before else top.after
    more = f" (+{len(live) - 1} more)" if len(live) > 1 else ""
    return f"LIKELY CAUSE: {top.title} ({where}){more}"
