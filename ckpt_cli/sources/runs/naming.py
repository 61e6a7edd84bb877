"""How checkpoints are named in a run folder: step folders per layout, plain `NAME-N` files, staging folders; the candidates among a folder's entries (local or remote alike)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ...formats.names import (
    SAFETENSORS_SUFFIX,
    SLIM_RECORD,
    TORCH_SUFFIXES,
    holds_dcp,
    is_checkpoint_file,
)
from ...storage import is_parity_path
from ...storage.output import OLD_MARKER, TMP_MARKER
from ...storage.uri import is_hub_url, parse_location
from .records import CHECKSUM_MANIFEST, Found

if TYPE_CHECKING:
    from ..layouts import Layout

#: plain `NAME_N.ext` files: extensions that can be a whole checkpoint (not `.distcp` pieces)
_PLAIN_EXT = (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)
#: `model-00001-of-00003`, `rng_state_1`: numbered parts of one checkpoint, not steps
_PART = re.compile(r".*-\d+-of-\d+|rng_state.*|.*rank.*")
_PLAIN = re.compile(r"(?P<stem>.+?)[-_](?P<n>\d+)(?P<ext>\.[A-Za-z]+)?")
_TEMP_NAMES = [
    re.compile(r"\.(?P<name>.+?)" + re.escape(TMP_MARKER) + r".*"),
    re.compile(r"tmp[-_](?P<name>.+)"),
    re.compile(r"(?P<name>.+)\.(?:tmp|partial|incomplete)"),
]
#: sub-folders that hold the checkpoints in some layouts (accelerate, torchtitan, Lightning)
SUBFOLDERS = ("checkpoints", "checkpoint")


@functools.cache
def _step_layouts() -> tuple[Layout, ...]:
    """The layouts with step folders of their own (their `step_folder`), from the layouts
    registry: the naming rules live once, on each layout (imported on first use, so listing a
    run folder's names does not import the format readers)."""
    from ..layouts import FOLDER_LAYOUTS, SINGLE_LAYOUTS

    return tuple(lay for lay in (*FOLDER_LAYOUTS, *SINGLE_LAYOUTS) if lay.step_folder is not None)


#: Megatron-LM's `save_checkpoint` folders, `iter_{iteration:07d}` (its `get_checkpoint_name`)
MEGATRON_ITER = re.compile(r"iter_(\d{7,})")
#: the layout token of a Megatron-LM run's saves (a `torch_dist` DCP or legacy `mp_rank_*/`)
MEGATRON = "megatron"
#: the file Megatron-LM rewrites once a save has finished, naming its iteration (or
#: `release`): what its `load_checkpoint` resumes from, whatever the `iter_*` folders say
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
#: the folder a tracker reading `release` sends `load_checkpoint` to
MEGATRON_RELEASE = "release"


def megatron_tracker(text: str) -> int | str | None:
    """What a Megatron-LM tracker file says, as its `read_metadata` reads it: an iteration,
    `MEGATRON_RELEASE`, or None for anything else (Megatron-LM exits: "Invalid metadata
    file")."""
    value = text.strip()
    if value == MEGATRON_RELEASE:
        return MEGATRON_RELEASE
    number = int_or_none(value) if value.isascii() and value.isdigit() else None
    return number


#: what Megatron-LM's `save_checkpoint` writes into an `iter_*` folder: a `torch_dist` (or
#: `torch_dcp`) save's files, or a legacy save's per-rank folders (`mp_rank_00/`,
#: `mp_rank_00_001/`, each with `model_optim_rng.pt`)
_MEGATRON_FILE = re.compile(
    r"metadata\.json|common\.pt|\.metadata|.*\.distcp|mp_rank_\d+(_\d+)*/.*"
)


def _holds_megatron_save(names: Iterable[str]) -> bool:
    """Whether the paths inside a folder (relative to it) are a Megatron-LM save's."""
    return any(_MEGATRON_FILE.fullmatch(name) for name in names)


def megatron_folder(tracker: int | str | None) -> str | None:
    """The folder a Megatron-LM tracker's value sends `load_checkpoint` to (`iter_0000200`,
    `release`), None for none."""
    if tracker is None or tracker == MEGATRON_RELEASE:
        return tracker
    return f"iter_{int(tracker):07d}"


def match_name(name: str, is_dir: bool) -> tuple[str, int | None, float | None] | None:
    """(layout, step, epoch) for an entry name, or None when it is not a checkpoint name."""
    if is_dir:
        megatron = MEGATRON_ITER.fullmatch(name)
        if megatron is not None:
            return MEGATRON, int(megatron.group(1)), None
        for layout in _step_layouts():
            step = layout.step_of(name)
            if step is not None:
                return layout.name, step, None
    from ..layouts.lightning import Lightning, name_values

    if Lightning.is_step_file(name):
        pairs = name_values(name)
        step = int_or_none(pairs.get("step"))
        epoch = _float_or_none(pairs.get("epoch"))
        return "lightning", step, epoch
    m = _PLAIN.fullmatch(name)
    if m and not _PART.fullmatch(m.group("stem") + "-" + m.group("n")):
        ext = m.group("ext")
        if is_dir and ext is None:
            return "plain", int(m.group("n")), None
        if not is_dir and ext is not None and ext.lower() in _PLAIN_EXT:
            return "plain", int(m.group("n")), None
    return None


def holds_run(files: Iterable[str]) -> bool:
    """Whether a folder whose files are `files` (paths relative to it) is a run folder of its
    own, not one checkpoint: a step checkpoint of a known layout (a `checkpoint-500/` folder, a
    Lightning `epoch=0-step=10.ckpt`...) lies directly in it or in its checkpoint sub-folders
    (`SUBFOLDERS`). Lightning's `version_0/`, a sweep's `trial_0/` holding Trainer folders:
    their number is a version or a trial, not a step. One DeepSpeed tag folder (`global_step5/`)
    is that save's (as DeepSpeed reads it); several make a run folder."""
    tags: set[str] = set()
    for rel in files:
        parts = rel.split("/")
        if parts[0] in SUBFOLDERS and len(parts) > 1:
            parts = parts[1:]
        matched = match_name(parts[0], len(parts) > 1)
        if matched is None or matched[0] == "plain":
            continue
        if matched[0] != "deepspeed":
            return True
        tags.add(parts[0])
    return len(tags) > 1


def nested_saves(files: Iterable[str]) -> list[str]:
    """The saves of a run that lie in sub-folders of a folder that is one checkpoint itself
    (`files`: paths relative to it): the `checkpoint-500/` folders a Trainer writes into the
    `output_dir` whose root `trainer.save_model()` fills with the final model (a diffusers
    script's pipeline, the same). Each is a checkpoint of its own, no part of the one at the
    root. A DeepSpeed tag folder (`global_step5/`) is part of its save, not one beside it."""
    saves = []
    for name in top_folders(files):
        matched = match_name(name, True)
        if matched is not None and matched[0] not in ("plain", "deepspeed"):
            saves.append(name)
    return saves


def refuse_run_of_runs(run_dir: str, runs: list[str]) -> None:
    """Refuse a folder whose only candidates are run folders of their own (`holds_run`):
    scanned as one run, each would be a checkpoint, its number a step (UsageError). The same
    refusal for every command, whether it reads a run folder (`latest`, `prune`, `sync`) or
    one checkpoint (`inspect`, `verify`...)."""
    if not runs:
        return
    shown = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
    one = f"{run_dir.rstrip('/')}/{runs[-1]}"
    raise UsageError(
        f"holds run folders ({shown}), not step checkpoints: point at one",
        path=run_dir,
        fix=f"Pass one run folder: {one} (`ckpt latest {one}` prints its newest complete save).",
    )


def run_folder_above(run_dir: str) -> str | None:
    """The folder that holds `run_dir` (a folder or URL given as a run folder that turned out
    to be one checkpoint): the run folder to name instead. None where there is none: a
    bucket's root, `/`, a Hub repository's root."""
    if is_hub_url(run_dir):
        if not parse_location(run_dir).subfolder:
            return None  # a repository's root: the folder above is no run folder
        parent = run_dir.rstrip("/").rpartition("/")[0]
    elif "://" in run_dir and not run_dir.startswith("file://"):
        parent = run_dir.rstrip("/").rpartition("/")[0]
    else:  # (`ckpt prune step-1` from inside the run folder: its parent is `.`)
        path = Path(run_dir)
        parent = str(path.parent) if path.parent != path else ""
    if not parent or parent.endswith(":/"):
        return None
    return parent


def in_parity(rel: str) -> bool:
    """Whether file `rel` (relative to the run folder) lies in a checkpoint's `ckpt protect`
    parity folder: parity added to an old save, written today, says nothing of when the save
    was made, so it never dates one."""
    return any(is_parity_path(part) for part in rel.split("/")[:-1])


def top_folders(files: Iterable[str]) -> dict[str, list[str]]:
    """The folders at the top of a listing (`files`: paths relative to it), each with its
    files relative to that folder; hidden ones (parity, ckpt's staging) are none of them."""
    out: dict[str, list[str]] = {}
    for rel in files:
        top, sep, inner = rel.partition("/")
        if sep and not top.startswith("."):
            out.setdefault(top, []).append(inner)
    return dict(sorted(out.items()))


def refuse_parent_folder(where: str, files: Iterable[str]) -> None:
    """Refuse a folder given for one checkpoint that holds none itself while its subfolders
    do (`files`: every file under it): a run folder, a folder of run folders, or a folder of
    saves (`final/`, `best/`). A usage error naming what to pass instead; nothing when no
    subfolder holds a checkpoint file."""
    listed = list(files)
    top = top_folders(listed)
    saves = [name for name, inner in top.items() if any(is_checkpoint_file(f) for f in inner)]
    if not saves:
        return
    shown = ", ".join(saves[:4]) + (f" and {len(saves) - 4} more" if len(saves) > 4 else "")
    if holds_run(listed):
        raise UsageError(
            f"is a run folder ({shown}), not one checkpoint",
            path=where,
            fix=f"Name one checkpoint inside it: `ckpt latest {where}` prints the newest "
            f"complete one, `ckpt inspect {where}` lists them all.",
        )
    refuse_run_of_runs(where, [name for name in saves if holds_run(top[name])])
    folders = ", ".join(f"{name}/" for name in saves[:4])
    raise UsageError(
        "holds no checkpoint files itself, but its subfolders do "
        f"({folders}{f' and {len(saves) - 4} more' if len(saves) > 4 else ''})",
        path=where,
        fix=f"Name one of them: {where.rstrip('/')}/{saves[-1]}.",
    )


def int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def lightning_metrics(name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    from ..layouts.lightning import name_values

    for key, value in name_values(name).items():
        number = _float_or_none(value)
        if number is not None and key not in ("step", "epoch"):
            out[key] = number
    return out


def classify(
    name: str, is_dir: bool, holds_checkpoint: Callable[[], bool]
) -> tuple[str, int | None, float | None, bool] | None:
    """(layout, step, epoch, temporary) of one entry of a run folder, local or remote; None
    when it is no checkpoint (the one naming rule of every scanner).

    `holds_checkpoint` says whether a plain `NAME-N/` folder holds checkpoint files (asked
    only for such folders: a log folder named `eval-3/` is no checkpoint).
    """
    if name.startswith(".") and OLD_MARKER in name:
        # `.NAME.ckpt-old-PID`: the copy a `--force` replace set aside, whole but replaced
        # (the next run writing NAME settles it); its number is a process id, never a step
        return None
    for pattern in _TEMP_NAMES:
        m = pattern.fullmatch(name)
        if m:
            inner = m.group("name")
            matched = match_name(inner, is_dir) or match_name(inner, not is_dir)
            if matched is None and TMP_MARKER not in name:
                continue  # `notes.tmp` is not a checkpoint; ckpt's own staging always is
            layout, step, epoch = matched or ("plain", None, None)
            return layout, step, epoch, True
    matched = match_name(name, is_dir)
    if matched is None:
        return None
    layout, step, epoch = matched
    if layout == "plain" and is_dir and not holds_checkpoint():
        return None
    return layout, step, epoch, False


def deepspeed_tag(text: str) -> str | None:
    """The tag a DeepSpeed `latest` file names, when it is a folder name of the run; None
    otherwise. A tag is compared with folder names and never joined to a path, so a `latest`
    naming `../x` or `/etc` names nothing (local and remote scans alike)."""
    tag = text.strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        return None
    return tag


def deepspeed_step(tag: str | None) -> int | None:
    """The step of a DeepSpeed tag (`global_step500` -> 500); None for another tag."""
    return int_or_none(tag.removeprefix("global_step")) if tag else None


def counts_saves(layout: str, name: str) -> bool:
    """Whether `name` is a layout's step folder whose number counts saves, not steps."""
    return any(
        lay.name == layout
        and lay.step_folder_counts_saves
        and lay.step_folder is not None
        and lay.step_folder.fullmatch(name) is not None
        for lay in _step_layouts()
    )


def expected_parts(names: dict[int, set[str]]) -> dict[int, set[str]]:
    """For the folders of one unmarked layout (id -> its top-level file names, digits as `*`: `part_names`):
    the names every *other* full save has (see `scan.expected_parts_of`); empty below three full
    saves. Slimmed saves (`SLIM_RECORD`) lack their optimizer on purpose and say nothing."""
    full = [key for key, have in names.items() if SLIM_RECORD not in have]
    if len(full) < 3:
        return {}
    # the names every *other* full folder has, for all folders in one pass (not N² set
    # intersections): those in all of them, plus, for a full folder, those missing from it alone
    counts: collections.Counter[str] = collections.Counter()
    for key in full:
        counts.update(names[key])
    everywhere = {n for n, c in counts.items() if c == len(full)}
    all_but_one = {n for n, c in counts.items() if c == len(full) - 1}
    in_full = set(full)
    return {
        key: everywhere | (all_but_one - have if key in in_full else set())
        for key, have in names.items()
    }


def collect(entries: Iterable[tuple[str, bool, Callable[[], bool]]]) -> list[Found]:
    """The candidate checkpoints among the entries of a run folder's step folders, local or
    remote alike: (path relative to the run folder, is a folder, holds checkpoint files) each,
    the last asked only of a plain `NAME-N/` folder (see `classify`). Plain files of one step
    in one folder (`model_500.pt`, `optim_500.pt`) form one checkpoint."""
    found: list[Found] = []
    plain_files: dict[tuple[str, int | None], Found] = {}
    listed = list(entries)
    accelerate_saves = _accelerate_save_folders((rel, is_dir) for rel, is_dir, _ in listed)
    for rel, is_dir, holds_checkpoint in listed:
        parent, _, name = rel.rpartition("/")
        named = classify(name, is_dir, holds_checkpoint)
        if named is None:
            continue
        layout, step, epoch, temporary = named
        if (
            layout == "plain"
            and not is_dir
            and parent in accelerate_saves
            and _ACCELERATE_PART.fullmatch(name)
        ):
            continue  # `model_1.safetensors` of the save this folder is: no step save
        save_number = None
        if step is not None and counts_saves(layout, name):
            save_number, step = step, None
        item = Found(
            layout, step, epoch, [rel], is_dir, temporary=temporary, save_number=save_number
        )
        if layout == "plain" and not temporary and not is_dir:
            key = (parent, step)
            if key in plain_files:
                plain_files[key].rels.append(rel)
                continue
            plain_files[key] = item
        found.append(item)
    return found


#: the files `save_state` numbers by the prepared (or registered) object they hold, the second
#: on (`model_1.safetensors`, `optimizer_1.bin`, `scheduler_2.bin`, `custom_checkpoint_0.pkl`)
_ACCELERATE_PART = re.compile(
    r"(?:model|pytorch_model|pytorch_model_fsdp|optimizer|scheduler|sampler|dl_state_dict"
    r"|custom_checkpoint)_\d+\.(?:safetensors|bin|pkl)"
)
#: the files only an accelerate save holds at its top: each process's RNG states, and the first
#: optimizer's and scheduler's state
_ACCELERATE_OWN = re.compile(r"random_states_\d+\.pkl|optimizer\.bin|scheduler\.bin")


def _accelerate_save_folders(entries: Iterable[tuple[str, bool]]) -> set[str]:
    """The folders (relative to the run folder, `""` for itself) that are an accelerate
    `save_state` save themselves: accelerate's own files lie at their top. Its numbered files
    there are that save's second and later models, optimizers, schedulers: not step saves
    (`ckpt latest` of one such save named its own `model_2.safetensors`, and `prune` would have
    deleted `model_1.safetensors` as an older one)."""
    return {
        rel.rpartition("/")[0]
        for rel, is_dir in entries
        if not is_dir and _ACCELERATE_OWN.fullmatch(rel.rpartition("/")[2])
    }


def leave_out_strays(items: list[Found]) -> tuple[list[Found], list[str]]:
    """`items` without the loose plain `NAME_N` files that lie beside step checkpoints of a
    known layout (`eval_preds_1000.pt` beside a Trainer's `checkpoint-N/`): that layout names
    its saves otherwise, so such a file is what the training script dumped, not a save (it
    became the newest "checkpoint" and took a `--keep-last` slot). Returns (the candidates,
    "PATH: why" for each file left out)."""
    known: dict[str, str] = {}
    for item in items:
        if item.layout != "plain" and not item.temporary:
            known.setdefault(item.rels[0].rpartition("/")[0], item.layout)
    kept: list[Found] = []
    left_out: list[str] = []
    for item in items:
        parent = item.rels[0].rpartition("/")[0]
        if item.layout == "plain" and not item.is_dir and not item.temporary and parent in known:
            left_out += [
                f"{rel}: a loose file beside the {known[parent]} checkpoints, whose saves are "
                "named otherwise: not a checkpoint of this run"
                for rel in item.rels
            ]
            continue
        kept.append(item)
    return kept, left_out


# --------------------------------------------------------------------------- unmarked layouts


#: layouts with no commit marker of their own: their saves are compared with each other
UNMARKED = ("accelerate", "torch-files", "plain")
#: layouts named by a step folder whose saves are DCP folders (`.metadata` their commit marker)
_DCP_STEP_LAYOUTS = ("torchtitan",)


#: the model states DeepSpeed's `save_checkpoint` writes into every tag folder (ZeRO-1/2 and
#: stage 0: `mp_rank_MM_…`; ZeRO-3: `zero_pp_rank_R_mp_rank_MM_…`)
_DEEPSPEED_MODEL_STATES = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")
#: the model states file rank 0 writes into every DeepSpeed tag folder (ZeRO 0-2; ZeRO-3)
DEEPSPEED_RANK0_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def deepspeed_states_in(folder: str, files: Iterable[str]) -> list[str]:
    """The model states files DeepSpeed wrote directly in `folder` (a path relative to the run)
    among a listing's `files` (relative to the run too), sorted: rank 0's first."""
    inside = f"{folder}/"
    return sorted(
        rel
        for rel in files
        if rel.startswith(inside) and _DEEPSPEED_MODEL_STATES.fullmatch(rel[len(inside) :])
    )


def holds_deepspeed_states(folder: str, files: Iterable[str]) -> bool:
    """Whether `folder` of a run is a DeepSpeed tag folder: it holds the model states
    `save_checkpoint` writes into every tag, whatever the tag's name."""
    return bool(deepspeed_states_in(folder, files))


#: a ZeRO partition DeepSpeed writes into a tag folder beside its model states
_ZERO_PARTITION = re.compile(r"(?:\w+_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt")


def holds_deepspeed_save(folder: str, files: Iterable[str]) -> bool:
    """Whether `folder` of a run is a DeepSpeed tag folder, whole or not: its model states
    (`holds_deepspeed_states`), or ZeRO partitions without them (a save cut short, or that
    lost rank 0's file: judged as DeepSpeed's, never as a plain save that looks whole)."""
    inside = f"{folder}/"
    return any(
        rel.startswith(inside)
        and (
            _DEEPSPEED_MODEL_STATES.fullmatch(rel[len(inside) :])
            or _ZERO_PARTITION.fullmatch(rel[len(inside) :])
        )
        for rel in files
    )


#: the files only accelerate's `save_state` writes into every save (each process's RNG
#: states), and those only the Trainer writes (its own marker, optimizer, scheduler, RNG states)
_ACCELERATE_RNG = re.compile(r"random_states_\d+\.pkl")
_TRAINER_STATE = re.compile(r"trainer_state\.json|optimizer\.pt|scheduler\.pt|rng_state.*\.pth")


#: the folder a Trainer with `push_to_hub=True, hub_strategy="checkpoint"` uploads its newest
#: save to (the Hub repo's `last-checkpoint/`, which `resume_from_checkpoint` is pointed at):
#: its name holds no step, its `trainer_state.json` does
TRAINER_LAST_CHECKPOINT = "last-checkpoint"


def holds_trainer_save(folder: str, files: Iterable[str]) -> bool:
    """Whether `folder` of a run holds a Trainer save's own files at its top (its
    `trainer_state.json`, optimizer, scheduler or RNG states), whatever the folder is named."""
    inside = f"{folder}/"
    return any(
        rel.startswith(inside) and _TRAINER_STATE.fullmatch(rel[len(inside) :]) for rel in files
    )


def _holds_accelerate_state(folder: str, files: Iterable[str]) -> bool:
    """Whether a `checkpoint-N/` folder is an accelerate `save_state` save, not a Trainer's:
    the diffusers training scripts name theirs so (`output_dir/checkpoint-{global_step}`).
    It holds none of the Trainer's files, and accelerate's RNG states or the model a save
    hook wrote (`unet/`, `pytorch_lora_weights.safetensors`: what is left of a save cut short
    before accelerate's files, or `ckpt prune --slim-older-than` slimmed). An FSDP Trainer
    save cut short before its RNG states (`optimizer.bin` beside `pytorch_model_fsdp.bin`)
    holds neither, and stays the Trainer's."""
    from ..layouts.accelerate import holds_hook_model

    inside = f"{folder}/"
    names = {rel[len(inside) :] for rel in files if rel.startswith(inside)}
    top = [n for n in names if "/" not in n]
    if any(_TRAINER_STATE.fullmatch(n) for n in top):
        return False
    return any(_ACCELERATE_RNG.fullmatch(n) for n in top) or holds_hook_model(names)


def by_content(item: Found, files: Iterable[str]) -> Found:
    """`item` with the layout its `files` (paths relative to the run) show, where its name says
    another:

    - a plain save when its name is a DCP layout's (`step-N/`, torchtitan's) but it holds no
      DCP file: a training loop's own folder of safetensors and torch.save files has no commit
      marker, so it is judged as plain saves are (compared with the other saves, given its
      settle time), never trusted as a DCP;
    - a DeepSpeed save when a plain `NAME_N/` folder holds DeepSpeed's model states: a tag of
      the user's own (`save_checkpoint(dir, tag=f"step_{n}")`), judged as a `global_stepN/`
      is (every rank's ZeRO partition, the `latest` file);
    - an accelerate save when a `checkpoint-N/` folder holds accelerate's `save_state` files
      and none of the Trainer's (`_holds_accelerate_state`): the diffusers training scripts';
    - a plain save when an `iter_0000100/` folder (Megatron-LM's name) holds files and none
      of Megatron-LM's (`_holds_megatron_save`): a training loop of one's own naming its saves
      so is judged as plain saves are (no commit marker), not as a Megatron-LM save.
    """
    if not item.is_dir or item.temporary:
        return item
    if item.layout == MEGATRON:
        inside = f"{item.rels[0]}/"
        names = [rel[len(inside) :] for rel in files if rel.startswith(inside)]
        if names and not _holds_megatron_save(names):
            return dataclasses.replace(item, layout="plain")
        return item
    if item.layout == "hf-trainer" and _holds_accelerate_state(item.rels[0], files):
        return dataclasses.replace(item, layout="accelerate")
    if item.layout == "plain":
        if holds_deepspeed_save(item.rels[0], files):
            return dataclasses.replace(item, layout="deepspeed")
        return item
    if item.layout not in _DCP_STEP_LAYOUTS or holds_dcp(files):
        return item
    return dataclasses.replace(item, layout="plain")


#: layouts whose saves are compared with each other for a file the others all have: the
#: unmarked ones (a save cut short), and the Trainer's, whose marker (`trainer_state.json`,
#: written last) says the save finished, not that its model or optimizer file is still there
#: (deleted since, lost with a node)
COMPARED = (*UNMARKED, "hf-trainer", MEGATRON)


#: what `part_names` calls a Trainer folder's model weights, however they are stored
TRAINER_WEIGHTS = "model weights"
#: the names the Trainer saves a model's (or an adapter's) weights under, whole or in shards
_TRAINER_WEIGHT_FILE = re.compile(r"(model|pytorch_model|adapter_model)[.-]")
#: what `part_names` calls a Trainer folder's RNG states, however many processes saved it
TRAINER_RNG = "RNG states"
#: the Trainer's RNG files: `rng_state.pth` from one process, `rng_state_{rank}.pth` from each
#: of several (a run resumed on another number of processes switches between them)
_TRAINER_RNG_FILE = re.compile(r"rng_state(?:_\d+)?\.pth")


_DIGITS = re.compile(r"\d+")


def save_parts(item: Found, files: Mapping[str, int]) -> set[str]:
    """The part names of one save, compared with its run's other saves: a folder's files
    (`part_names`); for plain files of one step (`model_300.pt`, `optim_300.pt`) their names,
    digits as `*` (`model_*.pt`, `optim_*.pt`): a loop killed between its two saves leaves
    `model_300.pt` alone, which lacks `optim_*.pt`."""
    if item.is_dir:
        return part_names(files, item.rels[0], item.layout)
    return {_DIGITS.sub("*", rel.rsplit("/", 1)[-1]) for rel in item.rels}


def part_names(files: Mapping[str, int], folder: str, layout: str | None = None) -> set[str]:
    """Names of the files directly in `folder` (of a run listing: path relative to the run ->
    size), each run of digits as `*` (`random_states_*.pkl` for `random_states_0.pkl` ...
    `random_states_3.pkl`, whose count follows the number of processes; `model_*.safetensors`
    for a second model's): a save cut short before accelerate's last file, its RNG states,
    lacks a name the others have. In a Trainer folder, its weight files, one `model.safetensors` or
    shards with their index, safetensors or `.bin`, are one part: `TRAINER_WEIGHTS`; its RNG
    states, `rng_state.pth` of a one-process save or `rng_state_{rank}.pth` of a multi-process
    one, another: `TRAINER_RNG` (a run resumed on another number of processes is whole).

    In the folders of unmarked layouts (accelerate), each model a save hook wrote into a
    subfolder of its own with `save_pretrained` is one part, `unet/` (`saved_model_folders`).

    ckpt's own checksum manifest is not a part: `verify --write-manifest` and a pull add it
    to some saves after they were made, and a run resumed on a pulled folder writes its new
    saves without it (which were "incomplete: lacks ckpt-manifest.json" and never synced)."""
    start = f"{folder}/"
    names = [rel[len(start) :] for rel in files if rel.startswith(start)]
    parts = {_DIGITS.sub("*", n) for n in names if "/" not in n and n != CHECKSUM_MANIFEST}
    if layout in UNMARKED:
        from ..layouts.model_folders import saved_model_folders

        # a model a `save_state` pre-hook saved with `save_pretrained` (the diffusers scripts'
        # `unet/`): a part, whose folder a save that lost it lacks
        parts |= {f"{sub}/" for sub, _ in saved_model_folders(set(names))}
    if layout == "hf-trainer":
        weights = {
            _DIGITS.sub("*", n) for n in names if "/" not in n and _TRAINER_WEIGHT_FILE.match(n)
        }
        parts = (parts - weights) | ({TRAINER_WEIGHTS} if weights else set())
        rng = {_DIGITS.sub("*", n) for n in names if _TRAINER_RNG_FILE.fullmatch(n)}
        parts = (parts - rng) | ({TRAINER_RNG} if rng else set())
    return parts
