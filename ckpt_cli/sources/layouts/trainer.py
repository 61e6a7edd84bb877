"""Hugging Face Trainer `checkpoint-N/` folders."""

from __future__ import annotations

import functools
import re
from typing import Any

from ...formats.base import Source
from ...formats.names import SLIM_RECORD
from ...models import Problem
from ...sizes import counted
from .base import Layout, OpenedSource
from .composite import (
    Folder,
    ObjectsCheckpoint,
    component_files,
    component_prefixes,
    trainer_progress,
)
from .ranks import missing_rank_files, missing_rank_states, ranks_lost_since, saved_world
from .save_before import save_before
from .training import analyse, finish, per_rank_models
from .training_args import training_arg_values

#: files only the Trainer writes; `training_args.bin` is not one of them: scripts built on
#: accelerate save their `TrainingArguments` beside `save_state`'s files too
_MARKERS = ("trainer_state.json", "optimizer.pt", "scheduler.pt")
_RNG = r"rng_state(_\d+)?\.pth"


class Trainer(Layout):
    """`checkpoint-N/`: weights, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`,
    `trainer_state.json`, `training_args.bin`."""

    name = "hf-trainer"
    step_folder = re.compile(r"checkpoint-(\d+)")
    #: `_save_rng_state`: `rng_state.pth` at one rank, `rng_state_{process_index}.pth` above
    rank_files = re.compile(r"rng_state(?:_(\d+))?\.pth")

    def rank_file_name(self, rank: int, world_size: int) -> str:
        return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"

    def batch_notes(self, opened: OpenedSource, before: int, after: int) -> list[str]:
        """The Trainer resumes by skipping `global_step` batches of its data loader, each of
        `train_batch_size` samples per rank (times gradient accumulation): at another world
        size those batches are other samples."""
        from .composite import CompositeCheckpoint

        checkpoint = opened.checkpoint
        if not isinstance(checkpoint, CompositeCheckpoint) or before == after:
            return []
        state = checkpoint.components.get("trainer_state")
        if not isinstance(state, ObjectsCheckpoint):
            return []
        batch, step = state.values.get("train_batch_size"), state.values.get("global_step")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            return []
        steps = f"step {step}" if isinstance(step, int) else "its step"
        ranks = counted(after, "rank")
        recorded = _accumulation(checkpoint.source)
        # no training_args.bin says it: the numbers are those of one accumulation step
        accumulation = recorded or 1
        how = (
            f"trainer_state.json train_batch_size {batch} x training_args.bin "
            f"gradient_accumulation_steps {recorded} x {before} ranks"
            if recorded is not None
            else f"trainer_state.json train_batch_size {batch} x {before} ranks, times "
            "gradient_accumulation_steps: no training_args.bin here says how many"
        )
        was, now = batch * accumulation * before, batch * accumulation * after
        return [
            f"the global batch changes: the data position ({steps}) was counted in global "
            f"batches of {was} samples ({how}); at {ranks} the same settings "
            f"make it {now} samples, so the resumed run skips other samples than "
            f"the saved run saw. It stays {was} only if per_device_train_batch_size "
            f"x gradient_accumulation_steps x {after} does."
        ]

    def recognise(self, source: Source) -> bool:
        """A Trainer file (`trainer_state.json`, `optimizer.pt`, `scheduler.pt`,
        `rng_state*.pth`), or a lone `training_args.bin` in a folder that holds none of
        accelerate's `save_state` files (an accelerate folder with it opens as accelerate, so
        its `random_states_*.pkl` are read as its RNG)."""
        folder = Folder(source)
        if any(folder.has(m) for m in _MARKERS) or folder.matching(_RNG):
            return True
        if not folder.has("training_args.bin"):
            return False
        from .accelerate import Accelerate

        return not Accelerate().recognise(source)

    def open(self, source: Source) -> OpenedSource | None:
        folder = Folder(source)
        rng = folder.matching(_RNG)
        model_file = folder.add_model()
        for comp, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt")):
            if folder.has(name):
                folder.add(comp, name, "torch")
        if "optimizer" not in folder.components and folder.has("optimizer.bin"):
            # FSDP with FULL_STATE_DICT: accelerate's `save_fsdp_optimizer` names it so
            folder.add("optimizer", "optimizer.bin", "torch")
        # FSDP: accelerate's `save_fsdp_model` / `save_fsdp_optimizer` wrote the model and the
        # optimizer (`pytorch_model_fsdp_0/`, `optimizer_0/` DCP folders, or the full
        # `pytorch_model_fsdp.bin` beside the `model.safetensors` of `save_model`)
        folder.add_fsdp()
        if folder.has("scaler.pt"):
            folder.add("scaler", "scaler.pt", "torch")
        # one file of a multi-process save keeps its rank's number (`rng_1`)
        several = saved_world(source, folder, self)[0] > 1
        folder.add_many("rng", rng, "torch", several=several)
        if folder.has("trainer_state.json"):
            folder.add("trainer_state", "trainer_state.json", "json")
        folder.list_training_args()
        folder.problems.extend(self.missing(source, folder))
        before = save_before(source, _trainer_naming)
        if before is not None:
            folder.problems.extend(ranks_lost_since(source, folder, self, before.name, before.top))
        checkpoint = folder.composite("hf-trainer")
        state = analyse(checkpoint, "hf-trainer", component_prefixes(checkpoint))
        per_rank_models(checkpoint, state)  # FSDP's LOCAL_STATE_DICT: one file per rank
        state.components = component_files(folder)
        if model_file is None:
            state.components.pop("model", None)
        trainer_progress(folder, state)
        opened = finish(checkpoint, state, folder)
        opened.problems.extend(_unfinished(source, folder))
        return opened

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """Optimizer / scheduler files the Trainer should have saved (see `_trainer_missing`),
        every rank's file of a per-rank FSDP save, and every process's `rng_state_{r}.pth`
        (`missing_rank_states`): every process writes its own while rank 0 still saves the
        weights and optimizer, before the `trainer_state.json` it writes last, so one missing
        beside that file was lost (or its process died), not still being written; and a
        `trainer_state.json` whose `global_step` is not the one the folder is named after
        (`foreign_trainer_state`)."""
        return (
            _lost_weights(source, folder)
            + _trainer_missing(source, folder)
            + missing_rank_files(source, folder, self.rank_files)
            # under DeepSpeed the rank files are all the Trainer's own of the save (see
            # `_trainer_missing`); the ZeRO partitions say which ranks saved
            + missing_rank_states(
                source,
                folder,
                self,
                every_save=_deepspeed(source) and folder.has("trainer_state.json"),
            )
            + foreign_trainer_state(source, folder)
        )

    def unknown_state(self, source: Source, folder: Folder) -> str | None:
        """A checkpoint with no optimizer / scheduler / RNG file and no `training_args.bin`
        recording `save_only_model`, or one saved with `save_only_model` (see
        `_state_unknown`)."""
        return _state_unknown(source, folder)


#: what a Trainer saves beside the weights unless `save_only_model` is set
_TRAINER_STATE_FILES = ("optimizer.pt", "scheduler.pt")


def _accumulation(source: Source) -> int | None:
    """`gradient_accumulation_steps` from the `training_args.bin` at the top of a Trainer save
    (see `training_arg_values`), or None when there is none or it does not say."""
    rel = "training_args.bin"
    if rel not in source.files:
        return None
    value = training_arg_values(source, rel, ("gradient_accumulation_steps",)).get(
        "gradient_accumulation_steps"
    )
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return None
    return value


def _save_only_model(source: Source, rel: str) -> bool | None:
    """`save_only_model` from `training_args.bin` (see `training_arg_values`)."""
    value = training_arg_values(source, rel, ("save_only_model",)).get("save_only_model")
    return value if isinstance(value, bool) else None


_OTHER = "Use another checkpoint of the run (`ckpt latest` names the newest whole one)."
#: a folder `ckpt reshard --rank-state drop` wrote holds no RNG file, as one that lost them
_DROPPED = (
    " A folder re-cut by `ckpt reshard --rank-state drop` holds none: each rank starts with "
    "fresh RNG states (`--rank-state replicate` gives every rank one)."
)


def _model_only(source: Source, folder: Folder) -> bool:
    """A folder `Trainer.save_model()` wrote (the weights, `config.json` and the
    `training_args.bin` it saves beside them), not a `checkpoint-N/`: nothing of the training
    state is expected in it. A checkpoint cut short after its model looks the same, but is
    named `checkpoint-N` (or has some other Trainer file).

    The example scripts end with `trainer.save_model()` and `trainer.save_state()`, which adds
    the run's `trainer_state.json` beside the weights (the `output_dir` a Trainer pushes to the
    Hub): with the weights there and none of the optimizer, scheduler or RNG files it is that
    model folder too, unless named as a save is (`checkpoint-N`, the `last-checkpoint/` a
    Trainer pushes to be resumed from)."""
    from ..runs.naming import TRAINER_LAST_CHECKPOINT

    name = source.location.raw.rstrip("/").rsplit("/", 1)[-1]
    if Trainer.step_folder.fullmatch(name) is not None or folder.matching(_RNG):
        return False
    if not any(folder.has(m) for m in _MARKERS):
        return True
    return (
        name != TRAINER_LAST_CHECKPOINT
        and not any(folder.has(m) for m in _MARKERS if m != "trainer_state.json")
        and not folder.has("optimizer.bin")
        and not folder.has_dir("optimizer_0")
        and bool(folder.matching(_WEIGHT_NAMES))
    )


def _unfinished(source: Source, folder: Folder) -> list[Problem]:
    """What makes a Trainer save no whole checkpoint, whatever is asked of it: no
    `trainer_state.json` (it writes that last: the save did not finish). `ckpt latest` and
    `prune` judge the same save incomplete (`runs.judge`); plain `verify` says so too. Its
    weights gone are `_lost_weights` (in `missing`, which the run judge asks too)."""

    if _model_only(source, folder):
        return []
    where = source.location.raw
    problems: list[Problem] = []
    if not folder.has("trainer_state.json") and not folder.has(SLIM_RECORD):
        problems.append(
            Problem(
                code="missing_component",
                message=f"{where}: trainer_state.json is missing, and the Trainer writes it "
                f"last: this save did not finish",
                file=source.storage.describe("trainer_state.json"),
                fix=_OTHER,
            )
        )
    return problems


#: the Trainer's weight files (`save_pretrained`: one file or an index of shards; a PEFT
#: model's adapter) and accelerate's FSDP model files (`pytorch_model_fsdp.bin`, per-rank
#: `pytorch_model_fsdp_0_rank1.bin`)
_WEIGHT_NAMES = (
    r"(model|pytorch_model)\.(safetensors|bin)(\.index\.json)?|adapter_model\.(safetensors|bin)"
    r"|pytorch_model_fsdp.*\.bin"
)
#: FSDP's SHARDED_STATE_DICT model folder (`save_fsdp_model`), and ckpt's `model_0/`
_WEIGHT_DIRS = re.compile(r"(pytorch_model_fsdp_\d+|model_0)/")


def _lost_weights(source: Source, folder: Folder) -> list[Problem]:
    """A Trainer checkpoint that holds no model weights by name: the Trainer writes them first
    (`save_model`; under FSDP accelerate's `pytorch_model_fsdp_0/` or
    `pytorch_model_fsdp.bin`), so they were deleted or lost since. Names only, so the run judge
    (`ckpt latest`, `prune`) calls such a save incomplete as `verify` does. Weights that are
    here but unreadable are their component's own problem; DeepSpeed's are in `global_stepN/`;
    a model folder (`save_model`'s output, not a `checkpoint-N/`) is no save to judge."""
    if _deepspeed(source) or _model_only(source, folder) or folder.matching(_WEIGHT_NAMES):
        return []
    inside = [f[len(folder.base) :] for f in source.files if f.startswith(folder.base)]
    if any(_WEIGHT_DIRS.match(rel) for rel in inside):
        return []
    where = source.location.raw
    adapter = folder.has("adapter_config.json")
    weights = (
        "adapter weights (adapter_model.safetensors or adapter_model.bin) beside its "
        "adapter_config.json"
        if adapter
        else "model weights (model.safetensors, pytorch_model.bin or their shards; under FSDP "
        "pytorch_model_fsdp_0/ or pytorch_model_fsdp.bin)"
    )
    return [
        Problem(
            code="missing_weights",
            message=f"{where}: no {weights}, which a Trainer save writes first: deleted or "
            "lost since?",
            file=source.storage.describe("adapter_model.safetensors") if adapter else where,
            fix=_OTHER,
        )
    ]


def _state_unknown(source: Source, folder: Folder) -> str | None:
    """Why nothing tells whether a Trainer checkpoint should hold optimizer state: it has
    none of optimizer.pt, scheduler.pt, rng_state*.pth (what `save_only_model` leaves out)
    and no training_args.bin recording `save_only_model`; or, when its training_args.bin
    records `save_only_model=True`, that it is the weights alone (a resume from it restarts
    the optimizer); None when its files say it holds its training state."""
    if (
        folder.has_dir("optimizer_0")
        or folder.has("optimizer.bin")
        or any(n.startswith("global_step") for n in source.files)
        or _model_only(source, folder)
        or any(folder.has(n) for n in _TRAINER_STATE_FILES)
        or folder.matching(_RNG)
    ):
        return None

    if folder.has(SLIM_RECORD):
        return None
    only_model = (
        _save_only_model(source, "training_args.bin") if folder.has("training_args.bin") else None
    )
    if only_model is True:
        return (
            "saved with save_only_model=True (training_args.bin): the weights alone, no "
            "optimizer, scheduler or RNG state; `resume_from_checkpoint` on it continues from "
            "its step with a fresh optimizer and scheduler, not where training stopped"
        )
    if only_model is False:
        return None
    return (
        "holds no optimizer.pt, scheduler.pt or rng_state*.pth, and no training_args.bin says "
        "whether the run saved them (save_only_model): a weights-only save, or its training "
        "state was lost; `ckpt verify --resumable` says whether it can resume"
    )


def _trainer_naming(name: str) -> re.Pattern[str] | None:
    """The Trainer names every save `checkpoint-N` (`save_before`'s naming rule)."""
    return Trainer.step_folder if Trainer.step_folder.fullmatch(name) else None


def _trainer_missing(source: Source, folder: Folder) -> list[Problem]:
    """Optimizer / scheduler / RNG files a Trainer checkpoint should have but lacks, when its
    own training arguments (`save_only_model` false), the training state it holds or its
    sibling checkpoints say so. Under FSDP the optimizer is accelerate's (`optimizer_0/`,
    `optimizer.bin`), beside the Trainer's own `scheduler.pt` and every process's
    `rng_state_{r}.pth`, so a save that lost all of those is told by its optimizer state."""
    if _deepspeed(source):
        return []  # DeepSpeed state: `missing_rank_states` judges the RNG files
    fsdp = [n for n in ("optimizer_0/", "optimizer.bin") if _holds(folder, n)]
    missing = [n for n in _TRAINER_STATE_FILES if not folder.has(n)]
    if fsdp:
        missing.remove("optimizer.pt")  # accelerate's `save_fsdp_optimizer` wrote it
    elif "optimizer.pt" in missing:
        # an FSDP model (`save_fsdp_model`) says accelerate's `save_fsdp_optimizer` saved the
        # optimizer beside it, as its state-dict type names it: that is what was lost
        fsdp_optimizer = _fsdp_optimizer_of(source, folder)
        if fsdp_optimizer is not None:
            missing[missing.index("optimizer.pt")] = fsdp_optimizer
    if not folder.matching(_RNG):
        # `_save_rng_state` writes `rng_state.pth` (`rng_state_{rank}.pth` from each process
        # of a multi-process run) with the optimizer and scheduler; `_load_rng_state` only
        # logs "Didn't find an RNG file" and goes on without it. Every process's is lost: as
        # many as the save's own files say processes saved it (an FSDP folder's
        # `__1_0.distcp`), `rng_state.pth` when they say one
        world = saved_world(source, folder, Trainer()).world
        missing += [Trainer().rank_file_name(rank, world) for rank in range(world)]
    if not missing or _model_only(source, folder):
        return []

    if folder.has(SLIM_RECORD):
        return []  # `ckpt prune --slim-older-than` removed them on purpose: a weights-only save
    reasons: dict[str, str] = {}
    if folder.has("training_args.bin"):
        only_model = _save_only_model(source, "training_args.bin")
        if only_model is False:
            for name in missing:
                reasons[name] = "training_args.bin says save_only_model=False"
        elif only_model is True:
            return []
    # the Trainer's own layout (`_save_checkpoint`): unless `save_only_model`, it writes
    # optimizer.pt, then scheduler.pt, then rng_state*.pth, all three or none of them, so one
    # of them here says the others were saved too, whatever the run's other saves hold
    saved = fsdp + [n for n in (*_TRAINER_STATE_FILES, *folder.matching(_RNG)) if folder.has(n)]
    if saved:
        for name in missing:
            reasons.setdefault(
                name,
                f"the Trainer saves it with {saved[0]} (save_only_model=False), which is here",
            )
    loc = source.location
    if loc.is_local and loc.path is not None:
        here = loc.path.resolve()
        siblings = sorted(
            p
            for p in here.parent.glob("checkpoint-*")
            if p.is_dir() and p != here and Trainer().step_of(p.name) is not None
        )
        for name in missing:
            having = [p.name for p in siblings if (p / name).exists()]
            if having and name not in reasons:
                reasons[name] = f"the sibling checkpoint {having[-1]} has one"
    where = loc.raw
    return [
        Problem(
            code="missing_component",
            message=f"{where}: {name} is missing, but {why}; "
            + (
                "the Trainer resumes without it (it logs a line), so the resumed run draws "
                "other random numbers (dropout, sampling) than the run it continues"
                if re.fullmatch(_RNG, name)
                else "this checkpoint cannot resume training where it stopped"
            ),
            file=source.storage.describe(name.rstrip("/")),
            fix=_OTHER + (_DROPPED if re.fullmatch(_RNG, name) else ""),
        )
        for name, why in reasons.items()
    ]


def _deepspeed(source: Source) -> bool:
    """Whether DeepSpeed saved the training state (`global_stepN/` beside the Trainer's files:
    only without `save_only_model`)."""
    return any(n.startswith("global_step") for n in source.files)


def _fsdp_optimizer_of(source: Source, folder: Folder) -> str | None:
    """The optimizer accelerate's `save_fsdp_optimizer` writes beside the FSDP model of this
    checkpoint: `optimizer_0/` (DCP) beside SHARDED_STATE_DICT's `pytorch_model_fsdp_0/`,
    `optimizer.bin` beside FULL_STATE_DICT's `pytorch_model_fsdp.bin`; None without an FSDP
    model (a FULL_STATE_DICT Trainer save's `model.safetensors` does not say FSDP). Names only."""
    if any(f.startswith(f"{folder.base}pytorch_model_fsdp_0/") for f in source.files):
        return "optimizer_0/"
    if folder.has("pytorch_model_fsdp.bin"):
        return "optimizer.bin"
    return None


def _holds(folder: Folder, name: str) -> bool:
    """Whether the folder holds the file `name`, or the DCP folder `name` ending in `/`."""
    return folder.has_dir(name[:-1]) if name.endswith("/") else folder.has(name)


#: the fields of transformers' `TrainerState` (4.x/5.x), which `TrainerState.load_from_json`
#: takes as keyword arguments, and which the Trainer writes every one of (`dataclasses.asdict`)
TRAINER_STATE_FIELDS = frozenset(
    (
        "epoch",
        "global_step",
        "max_steps",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "train_batch_size",
        "num_train_epochs",
        "num_input_tokens_seen",
        "total_flos",
        "log_history",
        "best_metric",
        "best_global_step",
        "best_model_checkpoint",
        "is_local_process_zero",
        "is_world_process_zero",
        "is_hyper_param_search",
        "trial_name",
        "trial_params",
        "stateful_callbacks",
    )
)


@functools.cache
def installed_trainer_state_fields() -> frozenset[str] | None:
    """The fields of the installed transformers' `TrainerState`, read from its source with
    `ast` (importing transformers imports torch: seconds, and a metadata command imports no
    torch); None without transformers, or where its source does not show the class."""
    import ast
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "trainer_callback.py"
    try:
        if path.stat().st_size > 4 << 20:
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainerState":
            return frozenset(
                statement.target.id
                for statement in node.body
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            )
    return None


def _unknown_trainer_state_keys(doc: dict[str, Any]) -> list[str]:
    """The keys of a trainer_state.json that `TrainerState(**json)` refuses (TypeError on
    resume), where that is sure: the installed transformers' `TrainerState` lacks them; or,
    without transformers here, they are outside `TRAINER_STATE_FIELDS` while a field of it
    the Trainer always writes is missing (a key damaged in place: `epoch` -> `epocj`). A key
    outside the list with every field there may be a newer transformers' field: not named."""
    installed = installed_trainer_state_fields()
    known = installed if installed is not None else TRAINER_STATE_FIELDS
    unknown = sorted(str(k) for k in doc if k not in known)
    if installed is None and doc.keys() >= TRAINER_STATE_FIELDS:
        return []
    return unknown


def foreign_trainer_state(source: Source, folder: Folder) -> list[Problem]:
    """The Trainer names each checkpoint after the `global_step` its `trainer_state.json`
    records (`checkpoint-{global_step}`), and `resume_from_checkpoint` restarts at that step,
    skipping that many batches, with the optimizer and scheduler of the folder's files: a
    `checkpoint-N` whose file records another step holds another save's file (or the folder
    was renamed), and no resume from it is the run it continues. A `global_step` that is no
    count of steps (`"ten"`, -1), in any Trainer save, is no resume at all. A file that does not
    parse is the component check's to report.

    Under DeepSpeed (`global_stepN/` and `latest` beside the Trainer's files) the Trainer
    saves its engine under the tag `global_step{global_step}`, and resumes it with
    `engine.load_checkpoint`, which follows `latest`: a tag of another step is another save's
    optimizer, scheduler and weights, resumed at this file's step."""
    import json

    name = source.location.raw.rstrip("/").rsplit("/", 1)[-1]
    match = Trainer.step_folder.fullmatch(name)
    if not folder.has("trainer_state.json"):
        return []
    rel = folder.rel("trainer_state.json")
    opened = folder.components.get("trainer_state")
    doc: Any
    if isinstance(opened, ObjectsCheckpoint):
        doc = opened.values  # parsed once: a long log takes a second to parse
    elif source.storage.size(rel) > 64 << 20:
        return []  # past what ckpt reads of a trainer_state.json: the component check says so
    else:
        try:
            doc = json.loads(source.storage.read_all(rel))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return []
    step = doc.get("global_step") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and "global_step" not in doc:
        # every Trainer writes it (`TrainerState` dumps all its fields): a key damaged in
        # place (`global_stdp`) fails `TrainerState.load_from_json`, and without it the
        # resume would restart at step 0 with this save's optimizer and scheduler
        return [
            Problem(
                code="unreadable_component",
                message="records no global_step, which every Trainer writes: the Trainer's "
                "`resume_from_checkpoint` cannot restart from it (a damaged key fails "
                "`TrainerState.load_from_json`; a missing one restarts at step 0)",
                file=source.storage.describe(rel),
                fix="Put back the trainer_state.json written with this save (from a copy of the "
                "checkpoint), or resume from another checkpoint of the run (`ckpt latest "
                "RUN_DIR` names the newest whole one).",
            )
        ]
    unknown = _unknown_trainer_state_keys(doc) if isinstance(doc, dict) else []
    if unknown:
        keys = ", ".join(repr(k) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        return [
            Problem(
                code="unreadable_component",
                message=f"holds key(s) {keys} that transformers' TrainerState does not have: "
                "the Trainer's `resume_from_checkpoint` fails on it (`TrainerState."
                "load_from_json` is `TrainerState(**json)`: TypeError on an unknown key)",
                file=source.storage.describe(rel),
                fix="Put back the trainer_state.json written with this save (from a copy of the "
                "checkpoint), or fix the damaged key by hand, or resume from another checkpoint "
                "of the run (`ckpt latest RUN_DIR` names the newest whole one).",
            )
        ]
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        # `TrainerState.load_from_json` takes any value; the resume then divides it by the
        # steps of an epoch and skips that many batches
        return [
            Problem(
                code="unreadable_component",
                message=f"records global_step {step!r}, not a count of steps: the Trainer's "
                "`resume_from_checkpoint` cannot restart from it",
                file=source.storage.describe(rel),
                fix="Put back the trainer_state.json written with this save (from a copy of the "
                "checkpoint), or resume from another checkpoint of the run (`ckpt latest "
                "RUN_DIR` names the newest whole one).",
            )
        ]
    if not isinstance(step, int):
        return []
    problems = []
    if match is not None and step != int(match.group(1)):
        problems.append(
            _mismatch(
                source.storage.describe(rel),
                f"records global_step {step}, but the Trainer names a checkpoint after "
                f"its global_step and this one is {name}: the file is another save's (or the "
                f"folder was renamed), and `resume_from_checkpoint` would restart at step {step} "
                "with this folder's optimizer and scheduler state",
                "the trainer_state.json",
            )
        )
    deepspeed_tag = _latest_tag(source, folder) if _deepspeed(source) else None
    tagged = _DEEPSPEED_TAG.fullmatch(deepspeed_tag) if deepspeed_tag is not None else None
    if tagged is not None and step != int(tagged.group(1)):
        problems.append(
            _mismatch(
                source.storage.describe(rel),
                f"records global_step {step}, but DeepSpeed's `latest` names "
                f"{deepspeed_tag}, the tag the Trainer saves at global_step "
                f"{tagged.group(1)}: the two are different saves' files (a folder put together "
                f"from two saves), and `resume_from_checkpoint` would restart at step {step} "
                f"with the weights, optimizer and scheduler DeepSpeed saved at step "
                f"{tagged.group(1)} (`engine.load_checkpoint` follows `latest`)",
                "the trainer_state.json, `latest` and global_stepN/",
            )
        )
    return problems


def _mismatch(file: str, message: str, put_back: str) -> Problem:
    """A `trainer_state_mismatch` of `file`: its fix puts back `put_back` of the same save."""
    return Problem(
        code="trainer_state_mismatch",
        message=message,
        file=file,
        fix=f"Put back {put_back} written with this save (from a copy of the checkpoint), or "
        "resume from another checkpoint of the run (`ckpt latest RUN_DIR` names the newest "
        "whole one).",
    )


#: the tag the Trainer saves a DeepSpeed engine under (`global_step{global_step}`)
_DEEPSPEED_TAG = re.compile(r"global_step(\d+)")


def _latest_tag(source: Source, folder: Folder) -> str | None:
    """The tag DeepSpeed's `latest` file names (a few bytes read), None without one."""
    if not folder.has("latest"):
        return None
    rel = folder.rel("latest")
    # a tag name is short: never more than a few KB of whatever `latest` holds
    data = source.storage.read(rel, 0, min(source.storage.size(rel), 4096))
    return data.decode("utf-8", "replace").strip()
