"""DeepSpeed `global_stepN/` folders (or their parent with `latest`); ZeRO in `zero.py`."""

from __future__ import annotations

import math
import re

from ...errors import CkptError, NotFoundError, UnsafeInputError
from ...formats.base import Checkpoint, Source
from ...models import Entry, Problem
from ...sizes import counted
from ...storage import safe_relpath
from .base import Layout, OpenedSource, Placeholder
from .composite import CompositeCheckpoint, Folder, component_files, trainer_progress
from .ranks import missing_rank_states, saved_world
from .training import analyse, entries_under, finish, value_of

_DS_MODEL = re.compile(r"mp_rank_\d+_model_states\.pt$")
#: `optim_states_R_mp_rank_MM` when a save has several model-parallel ranks
_TP_INDEX = r"rank_(\d+_mp_rank_\d+)_"
_MP_RANK = re.compile(r"mp_rank_(\d+)_model_states\.pt$")


class DeepSpeed(Layout):
    """`global_stepN/` (`mp_rank_00_model_states.pt`, `*_optim_states.pt`), or its parent
    with `latest` naming the tag."""

    name = "deepspeed"
    step_folder = re.compile(r"global_step(\d+)")
    #: ZeRO partitions are cut by data-parallel rank, not DCP chunks (`ops.reshard_zero`)
    world_size_cut = "zero"
    #: the per-rank RNG files a Hugging Face Trainer saves beside DeepSpeed's tag folder
    #: (`checkpoint-N/` holds `latest`, `global_stepN/` and `rng_state_{process_index}.pth`)
    rank_files = re.compile(r"rng_state(?:_(\d+))?\.pth")
    #: the recovery scripts `save_checkpoint` copies beside its tag folders
    training_files = re.compile(r"zero_to_\w+\.py")

    def rank_file_name(self, rank: int, world_size: int) -> str:
        return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"

    def batch_notes(self, opened: OpenedSource, before: int, after: int) -> list[str]:
        """DeepSpeed counts `global_steps` / `global_samples` in global batches of
        `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps` x ranks (the
        `ds_config` the model states record); a config that pins `train_batch_size` keeps the
        global batch at any world size DeepSpeed accepts.

        Under the Hugging Face Trainer (`trainer_state.json` beside the tag folder) the
        Trainer fills ds_config's batch settings from its own arguments at every launch: the
        recorded ones say nothing of what it accepts, and its own note applies."""
        if before == after:
            return []
        checkpoint = opened.checkpoint
        if isinstance(checkpoint, CompositeCheckpoint) and "trainer_state" in checkpoint.components:
            from .trainer import Trainer

            return Trainer().batch_notes(opened, before, after)

        def setting(key: str) -> int | None:
            value = value_of(checkpoint, f"model_states.ds_config.{key}")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            return None

        total, micro = setting("train_batch_size"), setting("train_micro_batch_size_per_gpu")
        accumulation = setting("gradient_accumulation_steps")
        steps = value_of(checkpoint, "model_states.global_steps")
        step_count = f"global_steps {steps}" if isinstance(steps, int) else "its step"
        ranks = counted(after, "rank")
        if total is not None:
            per_rank = [v for v in (micro, accumulation) if v is not None]
            if (
                len(per_rank) == 2
                and micro
                and accumulation
                and total != micro * accumulation * after
            ):
                return [
                    f"ds_config sets train_batch_size {total} = train_micro_batch_size_per_gpu "
                    f"{micro} x gradient_accumulation_steps {accumulation} x {before} ranks; at "
                    f"{ranks} DeepSpeed refuses that config: drop "
                    "gradient_accumulation_steps (or micro batch) so it derives it"
                ]
            if total % (math.prod(per_rank) * after):
                return [
                    f"ds_config sets train_batch_size {total}, which {ranks} cannot split "
                    f"(train_micro_batch_size_per_gpu {micro or 'unset'}, "
                    f"gradient_accumulation_steps {accumulation or 'unset'}): DeepSpeed refuses "
                    "that config at the new world size"
                ]
            return []  # DeepSpeed keeps the global batch, changing the accumulation steps
        if micro is None:
            return []
        accumulation = accumulation or 1
        was, now = micro * accumulation * before, micro * accumulation * after
        return [
            f"the global batch changes: the data position ({step_count}) was counted in global "
            f"batches of {was} samples (ds_config train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x {before} ranks); at {ranks} the same "
            f"config makes it {now} samples, so a resume that skips data by step sees other "
            f"samples than the saved run did. Set train_batch_size {was} in ds_config to keep "
            "it (DeepSpeed then derives gradient_accumulation_steps)."
        ]

    def recognise(self, source: Source) -> bool:
        top = {n for n in source.files if "/" not in n}
        return "latest" in top or any(_DS_MODEL.search(n) for n in top)

    def open(self, source: Source) -> OpenedSource | None:
        top = {n for n in source.files if "/" not in n}
        base = _tag_base(source) if "latest" in top else ""
        if base is None:
            return None  # some other tool's `latest` file
        folder = Folder(source, base)
        models = folder.matching(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")
        if not models:
            return None
        if "latest" in top:
            folder.used.add("latest")
        from .zero import saved_sizes, stray_partitions

        model = folder.add("model_states", models[0], "torch")
        # another save's partitions copied in: not this save's, named and left out
        sizes = saved_sizes(model) if model is not None else None
        strays = stray_partitions(folder.names, sizes) if sizes is not None else {}
        if sizes is not None:
            _leave_out_strays(folder, strays, sizes.dp, sizes.mp or 1)
        for extra in models[1:]:
            if extra not in strays:
                folder.add(extra.removesuffix(".pt"), extra, "torch")
        optim = [n for n in folder.matching(r".*optim_states\.pt") if n not in strays]
        # eco: tensor-parallel saves have one partition per (dp, mp) rank: name both
        tp = any("_mp_rank_00_" not in name for name in optim)
        folder.add_many("optim_states", optim, "torch", index=_TP_INDEX if tp else r"rank_(\d+)_")
        if base:
            # a Hugging Face Trainer's `checkpoint-N/` under DeepSpeed: `latest` and the tag
            # folder, and beside them the Trainer's per-rank RNG and `trainer_state.json`
            # the Trainer's per-process RNG files, as many as the save's files say processes
            # saved it (`missing_rank_states`: its ZeRO partitions, their own names)
            from .trainer import Trainer, foreign_trainer_state

            root, trainer = Folder(source), Trainer()
            folder.add_many(
                "rng",
                sorted(n for n in top if self.rank_files.fullmatch(n)),
                "torch",
                root=True,
                several=saved_world(source, root, trainer)[0] > 1,
            )
            # the Trainer writes them with DeepSpeed's state (no `save_only_model`, or there
            # would be no `global_stepN/`), before the `trainer_state.json` it writes last
            written = "trainer_state.json" in top
            folder.problems.extend(missing_rank_states(source, root, trainer, every_save=written))
            if "trainer_state.json" in top:
                folder.add("trainer_state", "trainer_state.json", "json", root=True)
                # its global_step against the folder's name and the tag `latest` names: a
                # folder put together from two saves resumes one save's engine at another's step
                folder.problems.extend(foreign_trainer_state(source, root))
            folder.list_training_args(root=True)
        from .zero import zero_partitions

        # ZeRO: every rank's partition must be there; the fp32 weights are rebuilt from them
        zero = zero_partitions(source, base, folder.parts, folder.components)
        if zero is not None:
            folder.problems.extend(zero.problems)
            folder.padding.update(zero.padding)
            if zero.weights is not None:
                folder.components["model"] = zero.weights
                folder.listed["model"] = (
                    f"fp32 weights rebuilt from {zero.weights.world_size} "
                    f"ZeRO-{zero.weights.stage} partitions"
                )
        checkpoint = folder.composite("deepspeed")
        rebuilt = zero is not None and zero.weights is not None
        prefixes = _prefixes(checkpoint, list(folder.components), rebuilt)
        state = analyse(checkpoint, "deepspeed", prefixes)
        state.components = component_files(folder)
        if any(c.startswith("optim_states") for c in folder.components) or any(
            rel.endswith("optim_states.pt") for rel in folder.unreadable
        ):
            state.components.setdefault(
                "optimizer",
                ", ".join(sorted(rel for rel in folder.used if rel.endswith("optim_states.pt"))),
            )
        step = value_of(checkpoint, "model_states.global_steps")
        if isinstance(step, int):
            state.step = step
        trainer_progress(folder, state)
        configured = value_of(checkpoint, "model_states.ds_config.optimizer.type")
        if state.optimizer is not None and isinstance(configured, str):
            state.optimizer.kind = configured
        if not state.weights.get("tensors"):
            state.weights = _zero3_weights(checkpoint)
        if zero is not None and not rebuilt:
            # a ZeRO save's weights are its fp32 partitions: with one missing, `model` names
            # nothing to select (the module holds bf16 copies or ZeRO-3 placeholders)
            state.prefixes.pop("model", None)
        opened = finish(checkpoint, state, folder)
        mp = zero.weights.mp_world_size if zero is not None and zero.weights is not None else 0
        files = {comp: rel for comp, (rel, _) in folder.parts.items()}
        opened.placeholders = zero3_placeholders(checkpoint, files, mp)
        return opened


def _leave_out_strays(
    folder: Folder, strays: dict[str, tuple[int, int]], dp: int | None, mp: int
) -> None:
    """List each stray ZeRO partition (`stray_partitions`) of a save recording `dp` x `mp`
    ranks as a file left out, with a warning: DeepSpeed resumes the save without it, but
    `zero_to_fp32` fails on it."""
    for name, (rank, mp_rank) in sorted(strays.items()):
        rel = folder.rel(name)
        folder.listed_files[rel] = (
            f"a stray ZeRO partition (rank {rank}, mp rank {mp_rank}) of a rank the save did "
            f"not have (dp_world_size {dp}, mp_world_size {mp}): not part of the save"
        )
        folder.problems.append(
            Problem(
                code="stray_partition",
                message=f"{name} is the ZeRO partition of data-parallel rank {rank}, mp rank "
                f"{mp_rank}, but the save recorded dp_world_size {dp} and mp_world_size {mp}: "
                "DeepSpeed's resume ignores it, but zero_to_fp32 takes every "
                "*_optim_states.pt of the folder and fails on it; ckpt leaves it out",
                file=folder.source.storage.describe(rel),
                severity="warning",
                fix=f"Remove {name} from the folder: it belongs to another save or run, copied "
                "in (the save's own partitions are those of ranks below dp_world_size).",
            )
        )


def _tag_base(source: Source) -> str | None:
    """The folder (`global_stepN/`) the `latest` file names; None when `latest` is not
    DeepSpeed's (no tag folder and no model states anywhere).

    A tag that is a link to another tag folder of the checkpoint (`best -> global_step100`)
    is that folder; one that leads out of it is refused (exit 4), and one missing or without
    model states is an error naming the tags a resume can take instead (exit 3)."""
    # a tag name is short; never read more than a few KB of whatever `latest` holds
    size = min(source.storage.size("latest"), 4096)
    tag = source.storage.read("latest", 0, size).decode("utf-8", "replace").strip()
    tag = safe_relpath(tag, source=source.storage.describe("latest"))
    out = source.storage.links_out([tag])
    if tag in out:
        raise UnsafeInputError(
            f"`latest` names {tag!r}, but {tag!r} is a link that points outside the checkpoint "
            f"({out[tag]}): ckpt reads no path out of the folder it was given",
            path=source.storage.describe(tag),
            fix=f"Copy that save in instead of linking it (`rm {source.storage.describe(tag)} "
            f"&& cp -r {out[tag]} {source.storage.describe(tag)}`), or point `latest` at a tag "
            "folder inside the checkpoint.",
        )
    base = f"{source.storage.alias_of(tag) or tag}/"
    inside = [n for n in source.files if n.startswith(base)]
    if inside and any(_DS_MODEL.search(n) for n in inside):
        return base
    if not any(_DS_MODEL.search(n) for n in source.files):
        return None  # some other tool's `latest` file
    # a tag folder linked from outside is not listed: it is refused, not missing
    source.storage.local_path(tag)
    loop = source.storage.link_loop(tag)
    if loop is not None:
        from ..runs.scan import LINK_LOOP

        raise NotFoundError(
            f"`latest` names {tag!r}, {LINK_LOOP.format(chain=loop)}",
            path=source.storage.describe("latest"),
            fix=f"Remove the link or re-point it at a save (`rm {source.storage.describe(tag)}`). "
            f"{_resume_instead(source, tag)}",
        )
    why = "which is missing" if not inside else "which holds no model states (a save cut short?)"
    raise NotFoundError(
        f"`latest` names {tag!r}, {why}",
        path=source.storage.describe("latest"),
        fix=_resume_instead(source, tag),
    )


def _resume_instead(source: Source, tag: str) -> str:
    """The fix for a `latest` naming `tag`, which is no whole save: the complete saves of the
    folder (judged as `ckpt latest` judges them) and how to resume from one."""
    from ..runs import scan_run
    from ..runs.scan import resume_instead

    try:
        report = scan_run(source)
    except CkptError:
        return "The save was interrupted or the folder was pruned; point `latest` at another tag."
    return f"{resume_instead(report, tag)}."


def _prefixes(checkpoint: Checkpoint, components: list[str], rebuilt: bool) -> dict[str, str]:
    """Where each training component sits among the composite's entries."""
    names = checkpoint.manifest.by_name
    prefixes: dict[str, str] = {"model": "model." if rebuilt else "model_states.module."}
    if any(n.startswith("model_states.optimizer.state.") for n in names):
        prefixes["optimizer"] = "model_states.optimizer."
    else:
        for comp in components:
            if comp.startswith("optim_states"):
                # ZeRO keeps the wrapped optimizer's state (over flat partitions) one level down
                # ZeRO-1/2 keep the wrapped optimizer's state under `base_optimizer_state`,
                # ZeRO-3 under a second `optimizer_state_dict` (both over flat partitions)
                prefixes["optimizer"] = f"{comp}.optimizer_state_dict."
                for inner in ("base_optimizer_state.", "optimizer_state_dict."):
                    if any(
                        n.startswith(f"{comp}.optimizer_state_dict.{inner}state.") for n in names
                    ):
                        prefixes["optimizer"] = f"{comp}.optimizer_state_dict.{inner}"
                        break
                break
    if any(n.startswith("model_states.lr_scheduler.") for n in names):
        prefixes["scheduler"] = "model_states.lr_scheduler."
    for key in ("rng", "random_state", "rng_state"):
        if any(n.startswith(f"model_states.{key}.") for n in names):
            prefixes["rng"] = f"model_states.{key}."
    rng = [c for c in components if c == "rng" or c.startswith("rng_")]
    if rng and "rng" not in prefixes:
        prefixes["rng"] = f"{rng[0]}."  # the Trainer's rng_state[_R].pth beside the tag folder
    for key in ("dataloader", "data_loader", "sampler"):
        if any(n.startswith(f"model_states.{key}.") for n in names):
            prefixes["dataloader"] = f"model_states.{key}."
    return prefixes


def zero3_placeholders(
    checkpoint: Checkpoint, files: dict[str, str], mp: int
) -> dict[str, Placeholder]:
    """The parameters ZeRO-3 leaves in the model states as empty placeholders: every tensor of
    a model-states file's `module` that its `param_shapes` records with another shape (every
    rank's file has them; the real weight is partitioned over the ranks' fp32 groups).

    `files`: component -> its file; `mp`: the model-parallel ranks of the rebuilt weights (0
    when they could not be rebuilt), which name the real weight: `model.<name>`, or
    `model.mp_rank_MM.<name>` above one rank.
    """
    shapes: dict[tuple[object, str], list[int]] = {}
    modules: list[tuple[object, str, Entry]] = []
    for entry in checkpoint.manifest.entries:
        path = _key_path(entry)
        if len(path) < 3 or not str(path[0]).endswith("model_states"):
            continue
        if path[1] == "param_shapes" and len(path) == 4:
            value = entry.value
            if isinstance(value, list) and all(isinstance(d, int) for d in value):
                shapes[(path[0], str(path[3]))] = value
        elif path[1] == "module" and len(path) == 3 and entry.kind == "tensor":
            modules.append((path[0], str(path[2]), entry))
    out: dict[str, Placeholder] = {}
    for component, name, entry in modules:
        shape = shapes.get((component, name))
        if shape is None or list(entry.shape) == shape:
            continue
        ranks = _MP_RANK.search(files.get(str(component), ""))
        inner = f"mp_rank_{ranks.group(1) if ranks else '00'}.{name}" if mp > 1 else name
        out[entry.name] = Placeholder(
            real=f"model.{inner}" if mp else "",
            kind="ZeRO-3 placeholders",
            why=f"stored as {list(entry.shape)}, the parameter is {shape}; ZeRO-3 partitions "
            "every parameter over the ranks' fp32 groups in *_optim_states.pt and leaves only "
            "an empty placeholder in the model states",
            fix="Use --select model: ckpt rebuilds the full fp32 weights from every rank's "
            "partition, bit-identical to DeepSpeed's zero_to_fp32.py"
            + ("." if mp else " (restore the missing partition files first)."),
        )
    return out


def _key_path(entry: Entry) -> tuple[object, ...]:
    """The keys of an entry of the composite, its component first (`model_states`, ...)."""
    path = entry.saved_keys()
    if path:
        return tuple(key for _, key in path)
    return tuple(entry.name.split("."))


def _zero3_weights(checkpoint: Checkpoint) -> dict[str, int]:
    """ZeRO-3 keeps no weights in the model states: count them from `param_shapes` and the
    fp32 partitions the optimizer files hold (what `zero_to_fp32.py` reassembles)."""
    manifest = checkpoint.manifest
    shapes = [
        e.value
        for e in entries_under(manifest, "model_states.param_shapes.")
        if isinstance(e.value, list) and all(isinstance(d, int) for d in e.value)
    ]
    flat = [
        e
        for e in manifest.entries
        if e.kind == "tensor"
        and (".fp32_flat_groups." in e.name or ".single_partition_of_fp32_groups." in e.name)
    ]
    if not shapes or not flat:
        return {}
    parameters = 0
    for shape in shapes:
        count = 1
        for dim in shape:
            count *= dim
        parameters += count
    return {
        "tensors": len(shapes),
        "parameters": parameters,
        "bytes": sum(e.nbytes for e in flat),
    }
