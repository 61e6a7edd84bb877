"""The one run-folder scanner: `scan` judges the candidates of a `RunListing` (a folder on this
machine: `local.py`; an object store or the Hub: `remote.py`) with the one judge (`judge.py`),
so local and remote run folders get the same rules, in the same order, and the same messages.

A `RunListing` only says what is there: the candidates, the files of each with their sizes and
times, and (on this machine) links. Every byte the judge reads, it reads through the run
folder's `Storage`. Everything between is here: the newest-first judging that `ckpt latest`
stops early, the `newest` / `deepspeed-latest` / `trainer-best` markers, the Trainer's best
pointer and best-by-metric.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import pairwise
from pathlib import Path
from typing import Literal

from ...storage import Storage
from .judge import (
    best_by_metric,
    check_metrics_size,
    deepspeed_states_step,
    json_number,
    judge_found,
    newest_trainer_state,
    read_deepspeed_latest,
    read_megatron_tracker,
    trainer_state_step,
)
from .listing import RunListing
from .naming import (
    COMPARED,
    DEEPSPEED_RANK0_STATES,
    MEGATRON,
    MEGATRON_RELEASE,
    MEGATRON_TRACKER,
    TRAINER_LAST_CHECKPOINT,
    by_content,
    deepspeed_step,
    expected_parts,
    holds_deepspeed_states,
    holds_trainer_save,
    leave_out_strays,
    megatron_folder,
    part_names,
    save_parts,
)
from .records import METRICS_FILE, Found, RunCheckpoint, RunReport, step_order


def expected_parts_of(run: RunListing, items: list[Found]) -> dict[int, set[str]]:
    """For folders of the `COMPARED` layouts: the files every *other* save of the run has.

    accelerate's `save_state` writes model, optimizer, scheduler, sampler... with no marker
    at the end, so a save cut short after the model looks whole on its own; a Trainer folder
    whose `model.safetensors` was deleted after the save still has its marker. Against at
    least two other saves of the same run neither does. Names are compared, nothing is read.
    """
    out: dict[int, set[str]] = {}
    for layout in COMPARED:
        folders = [
            i
            for i in items
            if i.layout == layout and i.is_dir and not i.temporary and run.link(i) is None
        ]
        if len(folders) >= 3:
            names = {id(f): part_names(run.files(f), f.rels[0], layout) for f in folders}
            out.update(expected_parts(names))
    # plain files of one step (`model_500.pt`, `optim_500.pt`), the saves of each folder
    file_sets: dict[str, list[Found]] = {}
    for i in items:
        if i.layout == "plain" and not i.is_dir and not i.temporary and run.link(i) is None:
            file_sets.setdefault(i.rels[0].rpartition("/")[0], []).append(i)
    for saves in file_sets.values():
        if len(saves) >= 3:
            out.update(expected_parts({id(f): save_parts(f, {}) for f in saves}))
    return out


def top_file_names(run: RunListing, items: list[Found]) -> frozenset[str]:
    """The names of the files directly in the run's save folders (not staging ones, not
    links): whether the run's saves hold their layout's `Layout.last_file` (accelerate's RNG
    states), so that a save lacking it is unfinished at any number of saves. Names only."""
    names: set[str] = set()
    for i in items:
        if i.is_dir and not i.temporary and run.link(i) is None:
            start = f"{i.rels[0]}/"
            names.update(
                rel[len(start) :]
                for rel in run.files(i)
                if rel.startswith(start) and "/" not in rel[len(start) :]
            )
    return frozenset(names)


def save_before(
    run: RunListing, items: list[Found], newest_first: list[Found]
) -> dict[int, tuple[str, frozenset[str]]]:
    """For each save folder of the run (not staging ones, not links): the save just older than
    it, by name, and the names of the files at its top (`Layout.after_last_file`: a save
    lacking a registered object's state that the save before it holds was cut short). Names
    only, nothing read."""
    saves = [
        i for i in reversed(newest_first) if i.is_dir and not i.temporary and run.link(i) is None
    ]
    out: dict[int, tuple[str, frozenset[str]]] = {}
    for older, newer in pairwise(saves):
        start = f"{older.rels[0]}/"
        names = frozenset(
            rel[len(start) :]
            for rel in run.files(older)
            if rel.startswith(start) and "/" not in rel[len(start) :]
        )
        out[id(newer)] = (older.rels[0], names)
    return out


def scan(
    run: RunListing,
    *,
    metric: str | None,
    mode: Literal["min", "max"],
    settle: float,
    now: float | None,
    until_latest: bool,
) -> RunReport:
    """List and judge the checkpoints of `run` (arguments as for `scan_run`)."""
    now = time.time() if now is None else now
    candidates, left_out = leave_out_strays(run.discover())
    items = [by_content(item, run.files(item)) for item in candidates]
    ds_latest = read_deepspeed_latest(run.storage)
    # no `latest` at all: every tag was saved with `save_latest=False` (or none yet)
    no_latest = "latest" not in run.top_entries()
    items += _unnamed_step_tag(run, items, ds_latest)
    if no_latest:
        items += _tags_without_latest(run, items)
    items += _trainer_last_checkpoint(run, items)
    tracker = read_megatron_tracker(run.storage)
    items += _megatron_release(run, items, tracker)
    megatron_latest = _megatron_latest(tracker)
    ds_step = deepspeed_step(ds_latest)
    if ds_step is None and ds_latest:
        # a tag of the user's own (`step_500`): the step of the save it names
        named = [
            i.step for i in items if i.layout == "deepspeed" and _base_name(i.rels[0]) == ds_latest
        ]
        ds_step = named[0] if named else None
    expected = expected_parts_of(run, items)
    run_files = top_file_names(run, items)
    judged: list[RunCheckpoint] = []

    def order(item: Found) -> tuple[tuple[float, float, float, float], str]:
        # the name breaks ties (two saves of one step, one time), as in `RunReport`'s order
        known = step_order(item.step, item.epoch, run.entry_time(item), item.save_number)
        return known, item.rels[0]

    newest_first = sorted(items, key=order, reverse=True)
    before = save_before(run, items, newest_first)
    for item in newest_first:
        judged.append(
            judge_found(
                run,
                item,
                now,
                settle,
                ds_step,
                expected.get(id(item)),
                run_files,
                before.get(id(item)),
                megatron_latest,
            )
        )
        if until_latest and judged[-1].complete and not judged[-1].slim:
            break
    checkpoints = sorted(judged, key=lambda c: (c.order, c.name))
    report = RunReport(
        run_dir=run.display,
        layouts=sorted({c.layout for c in checkpoints}),
        checkpoints=checkpoints,
        settle=settle,
        root_files=[
            name
            for name in run.root_files(items)
            if not any(why.startswith(f"{name}: ") for why in left_out)
        ],
        left_out=left_out,
        top_entries=run.top_entries(),
    )
    newest = report.newest_complete
    if newest is not None:
        newest.markers.append("newest")
        report.latest = newest.path
    if ds_latest:
        for c in checkpoints:
            if c.layout == "deepspeed" and _base_name(c.name) == ds_latest:
                c.markers.append("deepspeed-latest")
                report.deepspeed_latest = c.name
    if no_latest and newest is not None and newest.layout == "deepspeed" and "/" not in newest.name:
        # the save a resume takes (what `latest` prints, with its reason as a warning)
        note = _NO_LATEST.format(tag=newest.name)
        newest.reason = f"{newest.reason}; {note}" if newest.reason else note
    if megatron_latest is not None:
        for c in checkpoints:
            if c.layout == MEGATRON and _base_name(c.name) == megatron_latest[1]:
                c.markers.append("megatron-latest")
                report.megatron_latest = c.name
    if any(c.layout == MEGATRON for c in checkpoints):
        present = run.top_entries().get(MEGATRON_TRACKER) is False
        loop = None if megatron_latest is None else run.storage.link_loop(megatron_latest[1])
        report.tracker_problem = _tracker_problem(present, megatron_latest, report, loop)
    if ds_latest and report.tracker_problem is None:
        loop = run.storage.link_loop(ds_latest)
        report.tracker_problem = deepspeed_latest_problem(ds_latest, report, loop)
    run.mark_links(checkpoints)
    report.aliases = _aliases(run, items)
    state = newest_trainer_state(run.storage, checkpoints)
    trainer_doc = None
    if state is not None:
        report.trainer_state, trainer_doc = state
        pointer = trainer_doc.get("best_model_checkpoint")
        if isinstance(pointer, str) and pointer:
            # a path recorded by the trainer (absolute, or relative to its cwd): its last name
            base = _base_name(pointer)
            report.trainer_best = next(
                (c.name for c in checkpoints if _base_name(c.name) == base), None
            )
            report.trainer_best_metric = json_number(trainer_doc.get("best_metric"))
            for c in checkpoints:
                if c.name == report.trainer_best:
                    c.markers.append("trainer-best")
    if metric:
        # never a metrics file of the current folder: the run's own, or none ("")
        report.best = best_by_metric(
            Path("."), metric, mode, trainer_doc, checkpoints, _metrics_file(run.storage)
        )
        if report.best.source == "":
            report.best.source = None
    run.close()
    return report


#: what a DeepSpeed save of a run folder with no `latest` file is told (complete all the same)
_NO_LATEST = (
    "no `latest` file in the run folder (saved with save_latest=False): DeepSpeed's "
    "engine.load_checkpoint(dir) loads nothing without it (it logs a warning and returns "
    "None); resume with engine.load_checkpoint(dir, tag={tag!r})"
)


def _tags_without_latest(run: RunListing, items: list[Found]) -> list[Found]:
    """The DeepSpeed tag folders at the top of a run folder with no `latest` file whose names
    hold no step (`save_checkpoint(dir, tag="final", save_latest=False)`), each a DeepSpeed save
    at the step its model states record: no naming rule finds them and no `latest` names them,
    so the run's newest save went unlisted and `latest` named an older one. A folder is one
    when rank 0's model states are directly in it (one file looked up, nothing walked first)."""
    held = {i.rels[0] for i in items}
    found: list[Found] = []
    for name, is_dir in sorted(run.top_entries().items()):
        if not is_dir or name in held or name.startswith("."):
            continue
        if not any(run.storage.exists(f"{name}/{states}") for states in DEEPSPEED_RANK0_STATES):
            continue
        item = Found("deepspeed", None, None, [name], True)
        files = run.files(item)
        if holds_deepspeed_states(name, files):
            step = deepspeed_states_step(run.storage, name, files)
            found.append(dataclasses.replace(item, step=step))
    return found


def _aliases(run: RunListing, items: list[Found]) -> dict[str, str]:
    """The links at the top of the run folder to one of its save folders that are no
    candidate of their own (`best -> global_step100`; one `latest` names is a save: judged
    through the link): link name -> the save's name. Only local folders have links."""
    saves = {i.rels[0] for i in items if i.is_dir and run.link(i) is None}
    held = {rel for i in items for rel in i.rels}
    out: dict[str, str] = {}
    for name, is_dir in sorted(run.top_entries().items()):
        if is_dir or name in held:
            continue  # a folder of its own, or a save (a link `latest` names)
        target = run.storage.alias_of(name)
        if target is not None and target in saves:
            out[name] = target
    return out


def _unnamed_step_tag(run: RunListing, items: list[Found], tag: str | None) -> list[Found]:
    """The save DeepSpeed's `latest` file names when its tag holds no step
    (`save_checkpoint(dir, tag="final")`), as a DeepSpeed save at the step its model states
    record: no naming rule finds such a folder, so the run's newest save went unlisted, `latest`
    named an older one and `sync` pushed a `latest` naming a folder it had left behind."""
    if tag is None or any(_base_name(i.rels[0]) == tag for i in items):
        return []
    found = Found("deepspeed", None, None, [tag], True)
    files = run.files(found)
    if not holds_deepspeed_states(tag, files):
        return []
    return [dataclasses.replace(found, step=deepspeed_states_step(run.storage, tag, files))]


def _megatron_latest(tracker: int | str | None) -> tuple[int, str] | None:
    """The iteration and folder name a Megatron-LM tracker names (`release` resumes at
    iteration 0, Megatron-LM's own rule); None when there is none or it says nothing."""
    folder = megatron_folder(tracker)
    if folder is None:
        return None
    return (0 if tracker == MEGATRON_RELEASE else int(tracker or 0)), folder


def _tracker_problem(
    present: bool, named: tuple[int, str] | None, report: RunReport, loop: str | None = None
) -> str | None:
    """Why Megatron-LM would not resume a run's Megatron saves from the one `latest` names:
    its `latest_checkpointed_iteration.txt` is missing, says nothing, or names a save the run
    folder lacks (`loop`: a link that loops back on itself, its chain) or holds incomplete;
    None when it names the save `latest` names."""
    fix = (
        f"write its iteration into {MEGATRON_TRACKER} to resume from "
        f"{report.latest.rstrip('/').rsplit('/', 1)[-1]}"
        if report.latest is not None
        else "save again"
    )
    if not present:
        return (
            f"no {MEGATRON_TRACKER}: Megatron-LM's load_checkpoint finds no save to resume "
            f"from and starts training from scratch; {fix}"
        )
    if named is None:
        return (
            f"{MEGATRON_TRACKER} holds neither an iteration nor `release`: Megatron-LM's "
            f'load_checkpoint exits ("Invalid metadata file"); {fix}'
        )
    chosen = next((c for c in report.checkpoints if c.name == report.megatron_latest), None)
    if chosen is None and loop is not None:
        return (
            f"{MEGATRON_TRACKER} names {named[1]}, {LINK_LOOP.format(chain=loop)}: "
            f"Megatron-LM's load_checkpoint fails on it; remove the link or re-point it at a "
            f"save, or {fix}"
        )
    if chosen is None:
        return (
            f"{MEGATRON_TRACKER} names {named[1]}, which this run folder does not hold: "
            f"Megatron-LM's load_checkpoint fails; {fix}"
        )
    if not chosen.complete:
        return (
            f"{MEGATRON_TRACKER} names {named[1]}, which is {chosen.status} "
            f"({chosen.reason}): Megatron-LM's load_checkpoint fails on it; {fix}"
        )
    return None


#: what a pointer's save is when it is a link that loops back on itself (`chain`: `a -> b -> a`)
LINK_LOOP = "a symbolic link that loops back on itself ({chain}), so no save is there"


def deepspeed_latest_problem(tag: str, report: RunReport, loop: str | None = None) -> str | None:
    """Why DeepSpeed would not resume from the tag its `latest` file names: the run folder
    lacks it (`loop`: it is a link that loops back on itself, its chain), or holds it
    incomplete; with the saves it can resume from instead and the fix (the file rewritten, or
    `tag=`). None when the tag is whole, or was not judged (older than the newest complete
    save, when judging stopped there)."""
    top = report.top_entries
    chosen = next((c for c in report.checkpoints if _base_name(c.name) == tag), None)
    if chosen is None and loop is not None:
        return (
            f"the DeepSpeed `latest` file names {tag}, {LINK_LOOP.format(chain=loop)}: "
            f"{resume_instead(report, tag)}; or remove the link {tag} or re-point it at a save"
        )
    if chosen is None and tag in top:
        return None
    if chosen is not None and chosen.complete:
        return None
    if chosen is None:
        why = "which this run folder does not hold"
    elif chosen.symlink and chosen.status == "incomplete" and chosen.link_target is not None:
        # DeepSpeed follows the link; ckpt reads nothing out of the run, so vouches for nothing
        why = f"which is not checked ({chosen.reason})"
        return (
            f"the DeepSpeed `latest` file names {tag}, {why}: {resume_instead(report, tag, False)}"
        )
    else:
        why = f"which is {chosen.status} ({chosen.reason})"
    return f"the DeepSpeed `latest` file names {tag}, {why}: {resume_instead(report, tag)}"


def resume_instead(report: RunReport, bad: str, fails: bool = True) -> str:
    """What DeepSpeed's `load_checkpoint(dir)` does with a `latest` naming `bad` (`fails`: it
    fails on it), the tags of `report` it can resume from instead (newest first) and the fix."""
    valid = [
        c.name
        for c in sorted(report.checkpoints, key=lambda c: (c.order, c.name), reverse=True)
        if c.complete and c.layout == "deepspeed" and "/" not in c.name and c.name != bad
    ]
    if not valid:
        return (
            ("DeepSpeed's load_checkpoint(dir) fails on it, and " if fails else "")
            + "the run folder holds no complete DeepSpeed save to resume from instead; restore "
            "the save or train from scratch"
        )
    latest_file = f"{report.run_dir.rstrip('/')}/latest"
    lead = "DeepSpeed's load_checkpoint(dir) fails on it. " if fails else ""
    return (
        f"{lead}Complete saves to resume from: "
        f"{', '.join(valid)}; point `latest` at one (`echo {valid[0]} > {latest_file}`), or "
        f"pass it: load_checkpoint(dir, tag='{valid[0]}')"
    )


def _megatron_release(
    run: RunListing, items: list[Found], tracker: int | str | None
) -> list[Found]:
    """Megatron-LM's `release/` folder when the run's tracker names it (a converted
    checkpoint a run starts from: `load_checkpoint` resumes from it at iteration 0), as a
    Megatron save: no naming rule finds a folder with no number, so `latest` named an older
    `iter_*` save or none at all."""
    if tracker != MEGATRON_RELEASE or run.top_entries().get(MEGATRON_RELEASE) is not True:
        return []
    if any(i.rels[0] == MEGATRON_RELEASE for i in items):
        return []
    return [Found(MEGATRON, 0, None, [MEGATRON_RELEASE], True)]


def _trainer_last_checkpoint(run: RunListing, items: list[Found]) -> list[Found]:
    """The `last-checkpoint/` a Trainer pushes to the Hub with `hub_strategy="checkpoint"`, as
    a Trainer save at the step its `trainer_state.json` records: no naming rule finds it (its
    name holds no step), so `ckpt latest hf://org/run` of such a repo found no checkpoint at
    all. Only where the run holds no `checkpoint-N/` of its own: older transformers also copied
    the newest save there in the local `output_dir`, and `resume_from_checkpoint=True` (the
    Trainer's `get_last_checkpoint`) looks for `checkpoint-N/` only, so that copy is no save
    `latest` may name or `prune` keep in place of one."""
    if run.top_entries().get(TRAINER_LAST_CHECKPOINT) is not True:
        return []
    if any(i.layout == "hf-trainer" or i.rels[0] == TRAINER_LAST_CHECKPOINT for i in items):
        return []
    found = Found("hf-trainer", None, None, [TRAINER_LAST_CHECKPOINT], True)
    files = run.files(found)
    if not holds_trainer_save(TRAINER_LAST_CHECKPOINT, files):
        return []
    step = trainer_state_step(run.storage, TRAINER_LAST_CHECKPOINT, files)
    return [dataclasses.replace(found, step=step)]


def _metrics_file(storage: Storage) -> tuple[str, str]:
    """(where, text) of the run's `metrics.jsonl`, or ("", "") when it has none."""
    if not storage.exists(METRICS_FILE):
        return "", ""
    check_metrics_size(storage.size(METRICS_FILE), storage.describe(METRICS_FILE))
    raw = storage.read_all(METRICS_FILE)
    return storage.describe(METRICS_FILE), raw.decode("utf-8", "replace")


def _base_name(name: str) -> str:
    """The last component of a `/`-separated name (`checkpoints/checkpoint_3` -> `checkpoint_3`)."""
    return name.rstrip("/").rsplit("/", 1)[-1]
