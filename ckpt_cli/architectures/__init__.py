"""Model families and the framework namings of their weights (export to and import from
Hugging Face): a registry of `Architecture` classes, imported lazily, and recognition.

`recognise(names)` tells which family and naming a model's tensor names are in (`inspect`,
`convert --to hf`); `get_architecture(token)` returns a family's class. Which output format a
naming is written as is `NAMING_FORMATS` (`--to hf` writes Hugging Face safetensors shards,
`--to torchtitan` a DCP save torchtitan's CheckpointManager loads).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import FormatError, UsageError
from ..models import Record
from .base import HF, NAMINGS, Architecture, ArchitecturePlan, MappedTensor, ModelArgs

__all__ = [
    "HF",
    "NAMINGS",
    "NAMING_FORMATS",
    "REGISTRY",
    "Architecture",
    "ArchitecturePlan",
    "MappedTensor",
    "ModelArgs",
    "NamingInfo",
    "Recognised",
    "architectures",
    "get_architecture",
    "naming_info",
    "recognise",
]

#: token -> "module:Class", most specific first (recognition tries them in this order)
REGISTRY: dict[str, str] = {
    "qwen3.5-moe": "ckpt_cli.architectures.qwen3_5:Qwen3_5Moe",
    "qwen3.5": "ckpt_cli.architectures.qwen3_5:Qwen3_5",
    "deepseek-v3": "ckpt_cli.architectures.deepseek:DeepseekV3",
    "qwen3-moe": "ckpt_cli.architectures.llama:Qwen3Moe",
    "qwen3": "ckpt_cli.architectures.llama:Qwen3",
    "qwen2": "ckpt_cli.architectures.llama:Qwen2",
    "mixtral": "ckpt_cli.architectures.llama:Mixtral",
    "llama3": "ckpt_cli.architectures.llama:Llama3",
    "gpt-oss": "ckpt_cli.architectures.gpt_oss:GptOss",
    "flux": "ckpt_cli.architectures.flux:Flux",
}

#: `convert --to` naming tokens -> the format their output is written as
NAMING_FORMATS: dict[str, str] = {"hf": "safetensors", "torchtitan": "dcp", "megatron": "dcp"}


def get_architecture(name: str) -> type[Architecture]:
    """The class of family `name`."""
    if name not in REGISTRY:
        raise UsageError(
            f"unknown architecture {name!r}", fix=f"Use one of: {', '.join(REGISTRY)}."
        )
    module_name, cls_name = REGISTRY[name].split(":")
    cls: type[Architecture] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def architectures() -> list[type[Architecture]]:
    """Every registered family, in recognition order."""
    return [get_architecture(name) for name in REGISTRY]


@dataclass(frozen=True)
class Recognised:
    """A model's family and the naming its tensors are in."""

    architecture: type[Architecture]
    naming: str


def recognise(names: Sequence[str], model_type: str | None = None) -> Recognised | None:
    """The family and naming of a model's tensor names, or None when no family claims them.

    `model_type` (an HF `config.json`'s) picks among families whose rules all cover the names.
    """
    found = []
    for arch in architectures():
        naming = arch.recognise(names)
        if naming is not None:
            found.append(Recognised(arch, naming))
    if model_type is not None:
        typed = [r for r in found if model_type in r.architecture.hf_model_types]
        if typed:
            return typed[0]
    return found[0] if found else None


def unrecognised(names: Sequence[str], target: str, where: str) -> FormatError:
    """The error for a model no family claims, naming the closest family's unknown tensors."""
    fix = (
        f"Known: {', '.join(REGISTRY)}. Use --select to pick the model's weights, "
        "--filter-out for tensors that are no weights, or --to safetensors / dcp to keep the "
        "names as they are."
    )
    nested = _nested(names)
    if nested is not None:
        prefix, found = nested
        return FormatError(
            f"these {len(names)} tensors are {found.architecture.title}'s {found.naming} names "
            f"under the prefix '{prefix}.' (a state dict saved nested, as "
            f"`{{'{prefix}': model.state_dict()}}`), so they cannot be mapped to the {target} "
            "naming as they are",
            path=where,
            fix=f"Pass --select {prefix} to take the model's weights from under '{prefix}.'.",
        )
    # a family with a rule for every name first, then one whose marker tensors are there
    # (a Llama with biases is no gpt-oss, though gpt-oss has rules for more of its names),
    # then the most names known
    Score = tuple[bool, bool, int]
    best: tuple[Score, type[Architecture], str, list[str], list[str]] | None = None
    for arch in architectures():
        for naming in arch.namings():
            unknown, known = arch.covers(names, naming)
            score = (not unknown, arch.marked(names, naming), len(known))
            if best is None or score > best[0]:
                best = (score, arch, naming, unknown, known)
    detail = ""
    if best is not None and best[0][2]:
        _, arch, naming, unknown, known = best
        # tensors under top-level names the model's own never use (a value head, a
        # classifier): name the --filter-out that leaves them out
        tops = sorted({n.split(".", 1)[0] for n in unknown})
        if unknown and not set(tops) & {n.split(".", 1)[0] for n in known}:
            globs = " ".join(f"--filter-out '{t}.*'" for t in tops[:3])
            fix = (
                f"If they are no weights of the {arch.title} model (a value or classifier "
                f"head), leave them out: {globs}. {fix}"
            )
        # parameters beside a weight the rules map (a projection's bias) are the model's own:
        # leaving them out gives another model, so --filter-out is no fix for them
        modules = {n[: -len(".weight")] for n in known if n.endswith(".weight")}
        beside = [n for n in unknown if n.rpartition(".")[0] in modules]
        if beside:
            fix = (
                f"{arch.title}'s rules map no such tensor, and leaving them out (--filter-out) "
                "would give a model that runs without them: convert with --to safetensors / "
                "dcp to keep the names as they are."
            )
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:3])
            detail = (
                f"; closest is {arch.title} ({naming} naming), which has no rule for "
                f"{len(unknown)} tensor(s): {shown}"
            )
        elif lacking := arch.lacking(names, naming):
            # every name has a rule: the family's own tensors are what is missing
            shown = ", ".join(repr(p) for p in lacking[:3])
            detail = (
                f"; closest is {arch.title} ({naming} naming), whose rules cover every name "
                f"but which needs tensors this model lacks: {shown}"
            )
        else:
            detail = (
                f"; closest is {arch.title} ({naming} naming), whose rules cover every name "
                "but whose marker tensors are not there (the model is a relative of it)"
            )
    return FormatError(
        f"no known model architecture matches these {len(names)} tensor names, so they "
        f"cannot be mapped to the {target} naming{detail}",
        path=where,
        fix=fix,
    )


def _nested(names: Sequence[str]) -> tuple[str, Recognised] | None:
    """(prefix, family and naming) when every name sits under one top-level key and the
    names under it are a known family's: a state dict saved nested (`{'model': ...}`)."""
    prefix = names[0].split(".", 1)[0] if names else ""
    if not prefix or not all(n.startswith(prefix + ".") for n in names):
        return None
    found = recognise([n[len(prefix) + 1 :] for n in names])
    return (prefix, found) if found is not None else None


class NamingInfo(Record):
    """Which model family a checkpoint's weights are and which framework names them
    (`inspect`): what `convert --to hf` / `--to torchtitan` would map from.

    Attributes:
        architecture: the family token (`llama3`, `qwen3`, `qwen3-moe`).
        title: the family's name for people (`Llama 3`).
        naming: the naming its tensors are in (`hf`, `torchtitan`...).
        component: the training component the weights were found in (`model`), if any.
    """

    architecture: str
    title: str
    naming: str
    component: str | None = None


def naming_info(names: Sequence[str], component: str | None = None) -> NamingInfo | None:
    """The family and naming of a model's tensor names (names only, no torch)."""
    found = recognise(names)
    if found is None:
        return None
    arch = found.architecture
    return NamingInfo(
        architecture=arch.name, title=arch.title, naming=found.naming, component=component
    )
