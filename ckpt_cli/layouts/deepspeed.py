"""DeepSpeed `global_stepN/` folders (or their parent with `latest`); ZeRO in `zero.py`."""

from __future__ import annotations

import re

from ..errors import NotFoundError
from ..formats.base import Checkpoint, Source
from ..storage import safe_relpath
from .base import Layout, OpenedSource
from .composite import Folder, component_files, finish
from .training import analyse, entries_under, value_of

_DS_MODEL = re.compile(r"mp_rank_\d+_model_states\.pt$")
#: `optim_states_R_mp_rank_MM` when a save has several model-parallel ranks
_TP_INDEX = r"rank_(\d+_mp_rank_\d+)_"


class DeepSpeed(Layout):
    """`global_stepN/` (`mp_rank_00_model_states.pt`, `*_optim_states.pt`), or its parent
    with `latest` naming the tag."""

    name = "deepspeed"
    step_folder = re.compile(r"global_step(\d+)")
    #: ZeRO partitions are cut by data-parallel rank, not DCP chunks (not re-cut yet)
    reshards_world_size = False

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
        folder.add("model_states", models[0], "torch")
        for extra in models[1:]:
            folder.add(extra.removesuffix(".pt"), extra, "torch")
        optim = folder.matching(r".*optim_states\.pt")
        # eco: tensor-parallel saves have one partition per (dp, mp) rank: name both
        tp = any("_mp_rank_00_" not in name for name in optim)
        folder.add_many("optim_states", optim, "torch", index=_TP_INDEX if tp else r"rank_(\d+)_")
        from .zero import zero_partitions

        # ZeRO: every rank's partition must be there; the fp32 weights are rebuilt from them
        zero = zero_partitions(source, base, folder.parts, folder.components)
        if zero is not None:
            folder.problems.extend(zero.problems)
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
                ", ".join(rel for rel in folder.used if rel.endswith("optim_states.pt")),
            )
        step = value_of(checkpoint, "model_states.global_steps")
        if isinstance(step, int):
            state.step = step
        configured = value_of(checkpoint, "model_states.ds_config.optimizer.type")
        if state.optimizer is not None and isinstance(configured, str):
            state.optimizer.kind = configured
        if not state.weights.get("tensors"):
            state.weights = _zero3_weights(checkpoint)
        return finish(checkpoint, state, folder)


def _tag_base(source: Source) -> str | None:
    """The folder (`global_stepN/`) the `latest` file names; None when `latest` is not
    DeepSpeed's (no tag folder and no model states anywhere)."""
    # a tag name is short; never read more than a few KB of whatever `latest` holds
    size = min(source.storage.size("latest"), 4096)
    tag = source.storage.read("latest", 0, size).decode("utf-8", "replace").strip()
    tag = safe_relpath(tag, source=source.storage.describe("latest"))
    base = f"{tag}/"
    if not any(n.startswith(base) for n in source.files):
        if not any(_DS_MODEL.search(n) for n in source.files):
            return None  # some other tool's `latest` file
        raise NotFoundError(
            f"`latest` names {tag!r}, which is missing",
            path=source.storage.describe("latest"),
            fix="The save was interrupted or the folder was pruned; point at another tag.",
        )
    return base


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
    for key in ("dataloader", "data_loader", "sampler"):
        if any(n.startswith(f"model_states.{key}.") for n in names):
            prefixes["dataloader"] = f"model_states.{key}."
    return prefixes


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
