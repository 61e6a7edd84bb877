"""`Accelerator.save_state` folders, FSDP saves included.

The names are accelerate's own (`accelerate.checkpointing.save_accelerator_state`,
`accelerate.utils.fsdp_utils.save_fsdp_model` / `save_fsdp_optimizer`, constants in
`accelerate.utils.constants`); the i-th prepared object is numbered `_{i}` from the second on:

| what | plain | FSDP, SHARDED_STATE_DICT | FSDP, FULL_STATE_DICT |
|---|---|---|---|
| model i | `model{_i}.safetensors` / `pytorch_model{_i}.bin` | `pytorch_model_fsdp_{i}/` (DCP) | `pytorch_model_fsdp{_i}.bin` |
| optimizer i | `optimizer{_i}.bin` | `optimizer_{i}/` (DCP) | `optimizer{_i}.bin` |

beside `scheduler{_i}.bin`, `sampler{_i}.bin`, `dl_state_dict{_i}.bin`, `scaler.pt`,
`random_states_{rank}.pkl` (one per process) and `custom_checkpoint_{i}.pkl`. Components are
`model`, `model_1`..., `optimizer`, `optimizer_1`..., `scheduler`, `scheduler_1`..., `rng_0`,
`rng_1`... (one RNG per rank; `rng` when a single process saved). FSDP1 and FSDP2 write the same
names (the FQNs inside differ only by what the model calls its parameters).
"""

from __future__ import annotations

import re

from ...formats.base import Source
from ...formats.names import (
    PICKLE_SUFFIX,
    SAFETENSORS_SUFFIX,
    SLIM_RECORD,
    TORCH_BIN_SUFFIX,
    index_format,
    weight_format,
)
from ...models import Problem, ProblemList
from .base import Layout, OpenedSource
from .composite import (
    FSDP_MODEL,
    RANK_MODEL_FILE,
    RANK_OPTIMIZER_FILE,
    Folder,
    component_files,
    component_prefixes,
    numbered,
)
from .model_folders import saved_model_folders
from .ranks import (
    check_file_number,
    missing_rank_files,
    missing_rank_states,
    ranks_lost_since,
    saved_world,
)
from .save_before import LOST_SINCE_FIX, lost_since, save_before
from .training import (
    COUNTED_ONLY,
    EPOCH_ONLY,
    all_models,
    all_schedulers,
    analyse,
    finish,
    per_rank_models,
    value_of,
    weights_summary,
)

_RNG = r"random_states_\d+\.pkl"
_OPTIM = r"optimizer(_\d+)?\.bin"


class Accelerate(Layout):
    """`Accelerator.save_state` folders (see the module docstring for the names)."""

    name = "accelerate"
    loads_size_shards = False  # `load_accelerator_state`: one model{_i}.safetensors / .bin
    step_folder = re.compile(r"checkpoint_(\d+)")
    #: `ProjectConfiguration(automatic_checkpoint_naming=True)`: N is `save_iteration`
    step_folder_counts_saves = True
    #: `save_accelerator_state`: `random_states_{process_index}.pkl` at every world size
    rank_files = re.compile(r"random_states_(\d+)\.pkl")
    #: `save_accelerator_state` writes every process's RNG states after the model, optimizer,
    #: scheduler, sampler and scaler (only `custom_checkpoint_N.pkl` come after, when registered)
    last_file = re.compile(_RNG)
    #: `Accelerator.save_state` writes each `register_for_checkpointing` object's state after
    #: `save_accelerator_state` returns (rank 0's RNG states written), in registration order
    after_last_file = re.compile(r"custom_checkpoint_(\d+)\.pkl")

    def rank_file_name(self, rank: int, world_size: int) -> str:
        return f"random_states_{rank}.pkl"

    def recognise(self, source: Source) -> bool:
        """accelerate's own files, or a save `ckpt prune --slim-older-than` slimmed to the model
        a save hook wrote (`holds_hook_model`: the diffusers training scripts' `unet/`)."""
        folder = Folder(source)
        if folder.has(SLIM_RECORD) and holds_hook_model(set(source.files)):
            return True
        return bool(
            folder.matching(_RNG)
            or folder.matching(_OPTIM)
            or folder.has("scheduler.bin")
            or folder.matching(RANK_MODEL_FILE.pattern)
            or folder.matching(RANK_OPTIMIZER_FILE.pattern)
        )

    def missing(self, source: Source, folder: Folder) -> list[Problem]:
        """Every rank's file of a per-rank FSDP save (`ranks.missing_rank_files`), the
        optimizer state a scheduler's file says was saved (`_missing_optimizer`), the one a
        scheduler steps that no optimizer file saved holds (`_unsaved_optimizer`), and every
        prepared object's state below the highest one saved (`_missing_objects`). A save
        `ckpt prune --slim-older-than` slimmed lacks its optimizer and RNG states on purpose
        (its scheduler kept): only its objects are asked for. A model a save hook wrote into a
        subfolder, which the run's save before this one holds, is asked for of every save
        (`_models_lost_since`)."""

        if folder.has(SLIM_RECORD):
            return _missing_objects(source, folder) + _models_lost_since(source, folder)
        return (
            _missing_optimizer(source, folder)
            + _missing_objects(source, folder)
            + _unsaved_optimizer(source, folder)
            + missing_rank_files(source, folder, self.rank_files)
            + _models_lost_since(source, folder)
        )

    def unknown_state(self, source: Source, folder: Folder) -> str | None:
        """A save with neither an optimizer's nor a scheduler's state in any shape:
        `save_state` writes one for every prepared optimizer, and a script may prepare none,
        so its files cannot tell a model-only save from one whose optimizer file was lost."""
        if _optimizers(folder) or folder.numbered_files("scheduler", ".bin"):
            return None
        if _deepspeed_states(source):
            return None  # DeepSpeed saved the optimizer in its own folder
        return (
            "holds no optimizer state (optimizer.bin) and no scheduler.bin: a save of a run "
            "that prepared no optimizer, or its optimizer file was lost; nothing in the folder "
            "tells which (`ckpt verify --resumable` says whether it can resume)"
        )

    def open(self, source: Source) -> OpenedSource | None:
        folder = Folder(source)
        rng = folder.matching(_RNG)
        folder.add_model()
        hook_models = _add_hook_models(folder)
        for stem in ("model", "pytorch_model"):  # the models after the first (`model_1...`)
            for suffix, fmt in ((".safetensors", "safetensors"), (".bin", "torch")):
                for name, i in folder.numbered_files(stem, suffix):
                    if i and numbered("model", i) not in folder.components:
                        folder.add(numbered("model", i), name, fmt)
        folder.add_fsdp()
        samplers: list[dict[str, object]] = []
        for comp, stem in (
            ("optimizer", "optimizer"),
            ("scheduler", "scheduler"),
            ("sampler", "sampler"),
            ("dataloader", "dl_state_dict"),
        ):
            if comp == "sampler":
                samplers = _add_samplers(folder)
                continue
            for name, i in folder.numbered_files(stem, ".bin"):
                if numbered(comp, i) not in folder.components:
                    folder.add(numbered(comp, i), name, "torch")
        if folder.has("scaler.pt"):
            folder.add("scaler", "scaler.pt", "torch")
        # one file of a multi-process save keeps its rank's number (`rng_1`)
        several = saved_world(source, folder, self)[0] > 1
        folder.add_many("rng", rng, "torch", several=several)
        for name in folder.matching(r"custom_checkpoint_\d+\.pkl"):
            number = re.findall(r"\d+", name)[-1]
            folder.add(f"custom_{number}", name, "torch", unpickled_by="accelerate's load_state")
        folder.list_training_args()  # what scripts on accelerate often save beside it
        folder.problems.extend(self.missing(source, folder))
        folder.problems.extend(missing_rank_states(source, folder, self))
        folder.problems.extend(_lost_since_save_before(source, folder, self))
        checkpoint = folder.composite("accelerate")
        prefixes = component_prefixes(checkpoint)
        if "model" not in prefixes:
            # the hook popped accelerate's own weights: the models it saved are the run's
            trained = [c for c in hook_models if "ema" not in c] or hook_models
            # the denoiser first: what `model` names (`--to hf`, `diff --select model`)
            trained.sort(key=lambda comp: comp not in ("unet", "transformer"))
            prefixes.update((numbered("model", i), f"{comp}.") for i, comp in enumerate(trained))
        state = analyse(checkpoint, "accelerate", prefixes)
        all_models(checkpoint, state)
        all_schedulers(checkpoint, state)
        if "model_1" in prefixes:  # several models trained: the weights of all of them
            weights = [
                weights_summary(checkpoint, p) for k, p in prefixes.items() if k.startswith("model")
            ]
            state.weights = {
                k: sum(w.get(k, 0) for w in weights) for k in ("tensors", "parameters", "bytes")
            }
        per_rank_models(checkpoint, state)
        state.components = component_files(folder)
        if samplers and not state.dataloader:
            state.dataloader = samplers[0]
        counted_only = _positions_counted_only(folder, samplers)
        if counted_only and state.dataloader is not None:
            state.dataloader = {
                **state.dataloader,
                "kind": COUNTED_ONLY,
                "reason": f"{', '.join(counted_only)} records how many batches the loader drew, "
                "not its shuffle order: load_state skips that many batches of the order the "
                "resumed loader draws, the saved run's only with a seedable sampler "
                "(use_seedable_sampler=True) whose epoch the script sets, or with no shuffle, "
                "and the save shows neither",
            }
        # accelerate records no training step: the `step` in `random_states_N.pkl` counts
        # gradient-accumulation micro-steps (0 without `accumulate()`, reset each epoch), and
        # the automatic `checkpoint_N` counts saves. A folder the script named after its step
        # (`step_500`) says it.
        folder_name = source.location.raw.rstrip("/").rsplit("/", 1)[-1]
        match = re.search(r"(\d+)$", folder_name)
        if state.step is None and match and not self.step_folder.fullmatch(folder_name):
            state.step = int(match.group(1))
        for name in ("rng", *(c for c in folder.components if c.startswith("rng_"))):
            if isinstance(value_of(checkpoint, f"{name}.step"), int):
                # what `load_state` restores as `Accelerator.step`
                state.counter = f"accelerate's gradient-accumulation step ({name})"
                break
        opened = finish(checkpoint, state, folder)
        if any(_lost_optimizer(p) for p in opened.problems):
            # `load_state` stops at the lost optimizer's file
            state.missing.append("every prepared optimizer's state")
            state.resumable = state.exact = False
        return opened


def _positions_counted_only(folder: Folder, samplers: list[dict[str, object]]) -> list[str]:
    """The `dl_state_dict{_i}.bin` files whose data position is a batch count only.

    A `StatefulDataLoader` built over a torch `DataLoader`'s sampler (what accelerate's
    `prepare` builds with `use_stateful_dataloader=True`) saves how many batches it drew
    (`_num_yielded`, `_sampler_iter_yielded`), and nothing of the sampler: torch's samplers
    have no state. The resumed loader draws a new order and skips that many batches of it: the
    saved run's order only where the sampler reproduces it (a `SeedableRandomSampler` at the
    same epoch, or no shuffle), which the files do not show; a save with and one without
    `use_seedable_sampler=True` are the same bytes. The order is saved where the loader's
    sampler is torchdata's own (a `StatefulDataLoader` prepared as it is: its shuffle
    generator, `..._sampler_iter_state.sampler_iter_state.generator`), where the dataset keeps
    its own state (`dataset_state.*`), or where the save holds loader i's pickled
    `SeedableRandomSampler` (`sampler{_i}.bin`: its seed and epoch)."""
    pickled = {s.get("file") for s in samplers}
    counted: list[str] = []
    for comp, checkpoint in sorted(folder.components.items()):
        match = re.fullmatch(r"dataloader(?:_(\d+))?", comp)
        files = [f.path for f in checkpoint.manifest.files]
        if match is None or not files:
            continue
        if numbered("sampler", int(match.group(1) or 0)) + TORCH_BIN_SUFFIX in pickled:
            continue
        if any(_ORDER_SAVED.search(f".{e.name}") for e in checkpoint.manifest.entries):
            continue
        counted.append(files[0])
    return counted


#: an entry of a data loader's state that saves its order: a sampler's generator state, or
#: the dataset's own state (a Stateful dataset)
_ORDER_SAVED = re.compile(r"\.generator$|\.dataset_state\.")


#: the class of the sampler `save_state` pickles whole into `sampler{_i}.bin`
#: (`accelerate.data_loader.SeedableRandomSampler`, with `use_seedable_sampler=True`)
SEEDABLE_SAMPLER = "accelerate.data_loader.SeedableRandomSampler"


def _add_samplers(folder: Folder) -> list[dict[str, object]]:
    """Each `sampler{_i}.bin`: accelerate's `save_state` writes it with torch.save of the
    prepared data loader's `SeedableRandomSampler` object itself (not a state dict), which
    torch's weights_only loader refuses and ckpt never unpickles. Its class and plain
    attributes are read as data (`read_pickled_object`: every global a stand-in, nothing run),
    and the file is listed, not loaded: a whole save, never an unreadable one. Its `epoch` and
    `initial_seed` are what set the shuffle order (`SeedableRandomSampler.__iter__` seeds its
    generator with their sum). A file that holds plain data, or an object of another class, is
    opened as the torch.save component it is (and said unreadable if it is not one).

    Returns the data-loader summary of each sampler listed (`TrainingState.dataloader`)."""
    from ...formats.torch.pickle_values import read_pickled_object

    summaries: list[dict[str, object]] = []
    for name, i in folder.numbered_files("sampler", TORCH_BIN_SUFFIX):
        comp = numbered("sampler", i)
        if comp in folder.components:
            continue
        rel = folder.rel(name)
        pickled = read_pickled_object(folder.source.storage, rel)
        if pickled is None or pickled.cls != SEEDABLE_SAMPLER:
            folder.add(comp, name, "torch")
            continue
        shown: dict[str, object] = {
            k: pickled.values[k] for k in ("epoch", "initial_seed") if k in pickled.values
        }
        said = ", ".join(f"{k} {v}" for k, v in shown.items())
        dataset = pickled.objects.get("data_source")
        folder.list_file(
            comp,
            name,
            f"{name} (SeedableRandomSampler{f': {said}' if said else ''})",
            # the same words for every save of a run (`diff` names the file with one side's)
            "a pickled accelerate SeedableRandomSampler object: its epoch and initial_seed "
            "set the shuffle order (`inspect` shows them); the pickle also holds the dataset "
            f"it samples{f' (a {dataset})' if dataset else ''}. ckpt does not unpickle classes, "
            "so it is not loaded: it is carried as it is where the copy keeps accelerate's "
            "layout (reshard, sync), copy it by hand otherwise",
        )
        summaries.append(
            {
                "kind": EPOCH_ONLY,
                "file": name,
                **shown,
                "reason": f"{name} holds the sampler's epoch and seed, the epoch's shuffle "
                "order, not how far into the epoch the run was: load_state starts the epoch "
                "again from its first batch, unless the script skips the batches trained on "
                "(skip_first_batches), which the save does not show",
            }
        )
    return summaries


#: the file diffusers' LoRA training scripts save the adapter in from their `save_state`
#: pre-hook (`StableDiffusionPipeline.save_lora_weights`)
_HOOK_LORA = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin")


def holds_hook_model(names: set[str]) -> bool:
    """Whether a folder whose files are `names` (relative to it) holds a model a `save_state`
    pre-hook wrote: a LoRA's `pytorch_lora_weights.safetensors`, or a `save_pretrained`
    subfolder (`unet/`). Names only."""
    return any(n in names for n in _HOOK_LORA) or bool(saved_model_folders(names))


def _add_hook_models(folder: Folder) -> list[str]:
    """The models a `register_save_state_pre_hook` saved beside accelerate's files, as the
    diffusers training scripts do (and pop from accelerate's weights, so no `model.safetensors`
    is written): each `save_pretrained` folder (`unet/`, `unet_ema/`, `text_encoder/`) a
    component named after it, a LoRA's `pytorch_lora_weights.safetensors` the component
    `lora`. Returns the components added, in the order found."""
    added: list[str] = []
    for name in _HOOK_LORA:
        if (
            folder.has(name)
            and "lora" not in folder.components
            and folder.add("lora", name, weight_format(name) or "torch") is not None
        ):
            added.append("lora")
    names = {n[len(folder.base) :] for n in folder.source.files if n.startswith(folder.base)}
    for sub, weights in saved_model_folders(names):
        if sub in folder.components or sub in folder.unreadable_parts:
            continue
        fmt = index_format(weights) or weight_format(weights) or "safetensors"
        if folder.add(sub, weights, fmt) is not None:
            added.append(sub)
    return added


def _models_lost_since(source: Source, folder: Folder) -> list[Problem]:
    """`missing_component` for each model a `save_state` pre-hook saved into a subfolder
    (`unet/`, `saved_model_folders`) that the run's save before this one holds (`save_before`)
    and this save lacks whole: the diffusers training scripts write it at every save, before
    accelerate's own files, so it was lost since (nothing else in the folder records it;
    `load_state` then resumes with the model as the script built it).
    Likewise the optimizer's `optimizer.bin` of a save that holds such a model and no
    optimizer state: the hook runs first, so a save with its model went on to the optimizer."""
    before = save_before(source, _named_alike)
    if before is None:
        return []
    older = {rel for rel in before.files if rel.count("/") == 1}
    older_top = before.top
    names = {n[len(folder.base) :] for n in source.files if n.startswith(folder.base)}
    here = {sub for sub, _ in saved_model_folders(names)}
    problems = [
        lost_since(
            source,
            folder.rel(name),
            f"the LoRA a save hook wrote with save_lora_weights, which the save before it "
            f"({before.name}) holds (the diffusers training scripts write it at every save, "
            "before accelerate's own files); this save cannot resume training where it stopped",
        )
        for name in _HOOK_LORA
        if name in older_top and not any(folder.has(n) for n in _HOOK_LORA)
    ]
    hooked = here or any(folder.has(n) for n in _HOOK_LORA)
    if hooked and not _optimizers(folder) and not _deepspeed_states(source):
        # the save hook's model is here, so the save went on to accelerate's own files:
        # an optimizer the save before holds was written into this one too
        problems += [
            lost_since(
                source,
                folder.rel(name),
                f"the optimizer's state, which the save before it ({before.name}) holds and "
                "accelerate's save_state writes at every save; this save cannot resume "
                "training where it stopped",
            )
            for name in sorted(n for n in older_top if re.fullmatch(_OPTIM, n))
        ]
    return problems + [
        lost_since(
            source,
            folder.rel(sub),
            f"the model a save hook wrote into {sub}/ with save_pretrained, which the save "
            f"before it ({before.name}) holds (the diffusers training scripts write it at "
            "every save, before accelerate's own files); this save cannot resume training "
            "where it stopped",
        )
        for sub, _ in saved_model_folders(older)
        if sub not in here
    ]


def _named_alike(name: str) -> re.Pattern[str] | None:
    """How a run names its saves, from one save's name: as it is but for its trailing number
    (`checkpoint_1` before `checkpoint_2`, `step_500` before `step_1000`)."""
    match = re.fullmatch(r"(.*?)(\d+)", name)
    return re.compile(re.escape(match.group(1)) + r"(\d+)") if match is not None else None


def _lost_since_save_before(source: Source, folder: Folder, layout: Layout) -> list[Problem]:
    """Files the run's save before this one holds (`save_before`) that accelerate writes at
    every save and this one lacks, which nothing in this save says were written: a registered
    object's `custom_checkpoint_{i}.pkl` (load_state refuses a save with fewer than the
    objects registered), the RNG states of a rank above the highest this save's own files
    name (a DDP save that lost its highest rank's file looks like a smaller run's) or below
    the lowest (rank 0's), and every process's when this save holds none. The run
    judge compares a save with the one before it the same way (`runs.judge`). A script that
    registers fewer objects, or a run resumed with fewer processes, has its first save after
    the change so reported."""
    before = save_before(source, _named_alike)
    if before is None:
        return []
    names = before.top
    problems = [
        lost_since(
            source,
            folder.rel(name),
            f"a registered object's state, which the save before it ({before.name}) holds; "
            "accelerate's load_state refuses a save with fewer custom checkpoints than "
            "registered objects",
        )
        for name in sorted(names)
        if layout.after_last_file is not None
        and layout.after_last_file.fullmatch(name)
        and not folder.has(name)
    ]
    problems.extend(ranks_lost_since(source, folder, layout, before.name, names))
    problems.extend(_rng_lost_since(source, folder, layout, before.name, names))
    return problems


def _rng_lost_since(
    source: Source, folder: Folder, layout: Layout, older: str, older_names: set[str]
) -> list[Problem]:
    """`missing_rank_rng` for each process's `random_states_{r}.pkl` the run's save before
    this one (`older`, holding `older_names`) holds when this save holds none: `save_state`
    writes them at every save, last (`Layout.last_file`), so the save stopped before them or
    lost them, and `load_state` goes on without them (it logs "Could not load random
    states"). A save with some of them is `ranks_lost_since`' to judge, a rank whose own data
    files are here `missing_rank_states`'; one `ckpt prune --slim-older-than` slimmed dropped
    them on purpose."""

    if layout.rank_files is None or folder.has(SLIM_RECORD):
        return []
    if any(layout.rank_file_rank(name) is not None for name in folder.names):
        return []
    held = {r for r in map(layout.rank_file_rank, older_names) if r is not None}
    if not held:
        return []
    world = max(held) + 1
    # a rank whose own data files are here (an FSDP folder's `__1_0.distcp`) is
    # `missing_rank_states`' already: one problem a file
    ranks = sorted(held - saved_world(source, folder, layout).with_data)
    return [
        Problem(
            code="missing_rank_rng",
            message=f"is missing: rank {rank}'s RNG states, which the save before it ({older}) "
            f"holds, as this save holds no process's: {layout.name} writes every process's "
            "at every save, last, so the save stopped before them or lost them since; its "
            "loader goes on without them (it logs a line), so a resumed run silently draws "
            "other random numbers (dropout, sampling) than the run it continues",
            file=source.storage.describe(folder.rel(layout.rank_file_name(rank, world))),
            fix=LOST_SINCE_FIX,
        )
        for rank in ranks
    ]


def _optimizers(folder: Folder) -> bool:
    """Whether the folder holds an optimizer's state in any of accelerate's shapes."""
    return bool(
        folder.matching(_OPTIM)
        or folder.dcp_dirs_matching(r"optimizer_(\d+)")
        or folder.matching(RANK_OPTIMIZER_FILE.pattern)
    )


def _deepspeed_states(source: Source) -> bool:
    """Whether DeepSpeed saved the state (`save_checkpoint` into a subfolder of the save)."""
    return any("/" in n and n.endswith("model_states.pt") for n in source.files)


def _missing_optimizer(source: Source, folder: Folder) -> list[Problem]:
    """`save_state` writes every prepared optimizer's state (`optimizer{_i}.bin`, or its FSDP
    shapes) before the schedulers' (`scheduler{_i}.bin`), and a scheduler steps an optimizer:
    a scheduler's file with no optimizer state in any shape says the optimizer's was saved and
    is gone, whatever the run's other saves hold."""
    schedulers = folder.numbered_files("scheduler", ".bin")
    if not schedulers or _optimizers(folder) or _deepspeed_states(source):
        return []
    return [
        Problem(
            code="missing_component",
            message=f"{source.location.raw}: optimizer.bin is missing, but {schedulers[0][0]} "
            "is here and accelerate's save_state writes the optimizer's state before the "
            "scheduler's; this save cannot resume training where it stopped",
            file=source.storage.describe(folder.rel("optimizer.bin")),
            fix="Use another checkpoint of the run (`ckpt latest` names the newest whole one).",
        )
    ]


def _lost_optimizer(problem: Problem) -> bool:
    """Whether `problem` is a prepared optimizer's state lost (`optimizer_1.bin`)."""
    name = (problem.file or "").rsplit("/", 1)[-1]
    return problem.code == "missing_component" and re.fullmatch(_OPTIM, name) is not None


def _lrs(value: object) -> list[float] | None:
    """A list of plain learning rates (a scheduler's `base_lrs`), or None."""
    if isinstance(value, list) and value and all(type(v) is float for v in value):
        return value
    return None


def _unsaved_optimizer(source: Source, folder: Folder) -> list[Problem]:
    """The optimizer a scheduler steps, where its state is in none of the optimizer files
    saved. An LR scheduler's `base_lrs` is its optimizer's param groups' `initial_lr` (torch's
    `LRScheduler.__init__` sets that key, or reads it on a resume), so a scheduler whose
    `base_lrs` matches no saved optimizer's `initial_lr`s steps an optimizer whose file was
    lost: the highest one, since a gap below it is `_missing_objects`'s. One optimizer with
    two schedulers is a legitimate save (both match it). Read only with several schedulers
    and plain `optimizer{_i}.bin` files (their pickles, no tensor data; FSDP's and
    DeepSpeed's shapes are not read here); a OneCycleLR, which overwrites `initial_lr`,
    leaves nothing to tell."""
    optimizers = folder.numbered_files("optimizer", TORCH_BIN_SUFFIX)
    schedulers = folder.numbered_files("scheduler", TORCH_BIN_SUFFIX)
    if not optimizers or len(schedulers) < 2 or _deepspeed_states(source):
        return []
    if folder.dcp_dirs_matching(r"optimizer_(\d+)") or folder.matching(RANK_OPTIMIZER_FILE.pattern):
        return []  # an FSDP shape: its groups are not read here
    read = Folder(source, folder.base)  # its own: `open` adds the components in its order
    opened = {}
    for name, _ in (*optimizers, *schedulers):
        checkpoint = read.add(name, name, "torch")
        if checkpoint is None:
            return []  # unreadable: the layout's open reports it
        opened[name] = checkpoint
    if any("total_steps" in opened[name].manifest.by_name for name, _ in schedulers):
        return []  # OneCycleLR sets `initial_lr` itself
    initial: list[list[float]] = []
    for name, _ in optimizers:
        checkpoint = opened[name]
        groups = sorted(
            {
                int(m.group(1))
                for n in checkpoint.manifest.by_name
                if (m := re.fullmatch(r"param_groups\.(\d+)\.initial_lr", n))
            }
        )
        lrs = [value_of(checkpoint, f"param_groups.{g}.initial_lr") for g in groups]
        if lrs and all(type(v) is float for v in lrs):
            initial.append(lrs)
    if len(initial) != len(optimizers):
        return []  # an optimizer no scheduler set up, or groups not read: nothing to compare
    saved = ", ".join(name for name, _ in optimizers)
    lost = f"optimizer_{max(i for _, i in optimizers) + 1}{TORCH_BIN_SUFFIX}"
    for name, _ in schedulers:
        checkpoint = opened[name]
        base = _lrs(value_of(checkpoint, "base_lrs"))
        if base is None or base in initial:
            continue
        return [
            Problem(
                code="missing_component",
                message=f"is missing: {name} steps an optimizer whose learning rates "
                f"(base_lrs {base}) are none of the optimizer states saved ({saved}); "
                "accelerate's save_state writes every prepared optimizer's state, so "
                f"{lost} was lost and this save cannot resume training where it stopped "
                "(load_state looks for it)",
                file=source.storage.describe(folder.rel(lost)),
                fix=LOST_SINCE_FIX,
            )
        ]
    return []


#: the shapes of object i's state `save_state` writes, by object: (stem, suffix, whether object 0
#: drops the `_0`): `model.safetensors`, `model_1.safetensors`; FSDP's `pytorch_model_fsdp_0/`
_SHAPES: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "model": (
        ("model", SAFETENSORS_SUFFIX, True),
        ("pytorch_model", TORCH_BIN_SUFFIX, True),
        (FSDP_MODEL, TORCH_BIN_SUFFIX, True),
        (FSDP_MODEL, "/", False),
    ),
    "optimizer": (("optimizer", TORCH_BIN_SUFFIX, True), ("optimizer", "/", False)),
    "scheduler": (("scheduler", TORCH_BIN_SUFFIX, True),),
    "registered object": (("custom_checkpoint", PICKLE_SUFFIX, False),),
}


def _shape_name(shape: tuple[str, str, bool], index: int) -> str:
    stem, suffix, plain_zero = shape
    return f"{stem}{suffix}" if index == 0 and plain_zero else f"{stem}_{index}{suffix}"


def _saved_objects(folder: Folder) -> dict[str, dict[int, str]]:
    """Object kind -> index -> the file (or `folder/`) holding that object's state, in
    accelerate's shapes (`_SHAPES`, and per-rank FSDP files, named by their index alone)."""
    found: dict[str, dict[int, str]] = {kind: {} for kind in _SHAPES}
    for kind, shapes in _SHAPES.items():
        for shape in shapes:
            stem, suffix, plain_zero = shape
            if suffix == "/":
                pairs = folder.dcp_dirs_matching(rf"{re.escape(stem)}_(\d+)")
                for sub, i in pairs:
                    found[kind].setdefault(i, f"{sub}/")
            elif plain_zero:
                for name, i in folder.numbered_files(stem, suffix):
                    found[kind].setdefault(i, name)
            else:
                for name in folder.matching(rf"{re.escape(stem)}_\d+{re.escape(suffix)}"):
                    found[kind].setdefault(int(re.findall(r"\d+", name)[-1]), name)
    for kind, regex in (("model", RANK_MODEL_FILE), ("optimizer", RANK_OPTIMIZER_FILE)):
        for name in folder.matching(regex.pattern):
            match = regex.fullmatch(name)
            assert match is not None
            found[kind].setdefault(int(match.group(1) or 0), name)
    return found


def _missing_objects(source: Source, folder: Folder) -> list[Problem]:
    """`save_state` writes the state of every prepared model, optimizer and scheduler, and of
    every registered object, numbered from 0 with no gap (`model.safetensors`,
    `model_1.safetensors`...; FSDP's `pytorch_model_fsdp_0/`...), all the models first, then the
    optimizers, then the schedulers: an index below the highest one saved with no file in any
    shape was lost (a save in progress never leaves one). Under FSDP each optimizer is saved
    with its own model (`save_fsdp_optimizer(..., self._models[i], ...)`), so an FSDP
    optimizer's state (`optimizer_{i}/`, `optimizer_{i}_rank{r}.bin`) says model i was saved.
    The highest object's file lost alone leaves no trace in the folder (accelerate records no
    count): `latest` compares the run's saves for that. A DeepSpeed save keeps its models'
    and optimizers' state in its own folders: only its schedulers and objects are checked."""
    saved = _saved_objects(folder)
    deepspeed = _deepspeed_states(source)
    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    said: set[str] = set()

    def lost(kind: str, index: int, name: str, why: str) -> None:
        where = source.storage.describe(folder.rel(name.rstrip("/")))
        if where in said:
            return  # model i: below the highest and its FSDP optimizer's, said once
        said.add(where)
        problems.append(
            Problem(
                code="missing_component",
                message=f"is missing: {kind} {index}'s state, which {why}; this save cannot "
                "resume training where it stopped",
                file=where,
                fix=LOST_SINCE_FIX,
            )
        )

    for kind, shapes in _SHAPES.items():
        present = saved[kind]
        if not present or (deepspeed and kind in ("model", "optimizer")):
            continue
        top = max(present)
        check_file_number(top, source.storage.describe(folder.rel(present[top].rstrip("/"))))
        shape = next(
            (sh for sh in shapes if _shape_name(sh, top) == present[top]),
            None,
        )
        if shape is None:
            continue  # only per-rank FSDP files: `missing_rank_files` names what they lack
        for index in range(top):
            if index not in present:
                lost(
                    kind,
                    index,
                    _shape_name(shape, index),
                    f"accelerate's save_state writes for every {kind} it numbers, and "
                    f"{present[top]} ({kind} {top}) is here",
                )
    if not deepspeed:
        for index, name in sorted(saved["optimizer"].items()):
            fsdp = name.endswith("/") or RANK_OPTIMIZER_FILE.fullmatch(name)
            if fsdp and index not in saved["model"] and name.endswith("/"):
                lost(
                    "model",
                    index,
                    f"{FSDP_MODEL}_{index}/",
                    f"accelerate's FSDP save_state writes with its optimizer's, and {name} is here",
                )
    return problems
