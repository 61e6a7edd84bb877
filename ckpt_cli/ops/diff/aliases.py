"""Tied weights as `diff` sees them: which names of a checkpoint are aliases of another.

A tied weight (GPT-2's `lm_head.weight` and `transformer.wte.weight`, T5's three aliases of
`shared.weight`) is one tensor under several names. Writers keep it in different ways:

* `torch.save` keeps every name, sharing one storage (`tied_groups` finds them);
* safetensors cannot share storage: ckpt's `convert`, `safetensors.torch.save_model` and
  huggingface_hub keep one copy and record each dropped name in `__metadata__`
  (`{"lm_head.weight": "transformer.wte.weight"}`);
* transformers' `save_pretrained` drops the tied names and records nothing in the file: the
  model class's `_tied_weights_keys`, under `tie_word_embeddings` of `config.json`, reties
  them at `from_pretrained`.

`recorded_aliases` reads all three from metadata (the model class is imported only when a
`config.json` names one and transformers is installed; without it the output embedding is
matched to the one input embedding of the same shape). A name missing on one side whose alias
is recorded there is then compared with the tensor it names, so a correct conversion is
IDENTICAL and a real difference still is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...budgets import MAX_CONFIG_BYTES
from ...formats.base import Checkpoint
from ..shared.transfer import metadata_aliases, tied_groups

#: how a checkpoint names its input embedding, for the output embedding tied to it
_EMBEDDING_SUFFIXES = (
    "shared.weight",
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
)
#: the output embedding, tied only when `tie_word_embeddings` is true
_OUTPUT_EMBEDDINGS = ("lm_head.", "cls.predictions.decoder.", "embed_out.")


@dataclass(frozen=True)
class Alias:
    """One name recorded as another tensor's alias.

    Attributes:
        name: the alias (a checkpoint name, before diff's --select / --rename).
        target: the name of the tensor it is.
        recorded: where the checkpoint says so (`safetensors metadata`, `shared storage`,
            `config.json tie_word_embeddings (GPT2LMHeadModel)`).
        stored: the checkpoint holds `name` itself (shared storage), not only the record.
    """

    name: str
    target: str
    recorded: str
    stored: bool


def recorded_aliases(checkpoint: Checkpoint, model_prefix: str = "") -> list[Alias]:
    """Every alias `checkpoint` records (see the module docstring).

    Args:
        checkpoint: an opened checkpoint (its manifest, and its folder's `config.json`).
        model_prefix: where the model's weights sit among the entries (`model.` in a training
            folder), for the names a `config.json` gives relative to the model.
    """
    manifest = checkpoint.manifest
    tensors = {e.name: e for e in manifest.entries if e.kind == "tensor"}
    found: list[Alias] = []
    for group in tied_groups(manifest):
        found.extend(Alias(n, group[0], "shared storage", True) for n in group[1:])
    for name, target in metadata_aliases(manifest).items():
        found.append(Alias(name, target, "safetensors metadata", False))
    known = {a.name for a in found}
    for name, target, how in _config_ties(checkpoint, tensors, model_prefix):
        if name not in tensors and name not in known:
            found.append(Alias(name, target, how, False))
    return found


def _config_ties(
    checkpoint: Checkpoint, tensors: dict[str, Any], prefix: str
) -> list[tuple[str, str, str]]:
    """(alias, target, how) from `config.json` beside the weights: the model class's
    `_tied_weights_keys` that apply under `tie_word_embeddings` (targets present only)."""
    config = _config(checkpoint)
    if config is None:
        return []
    tie = config.get("tie_word_embeddings", True) is not False
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    keys = _tied_weights_keys(arch) if arch else None
    how = f"config.json tie_word_embeddings ({arch or 'no architectures'})"
    pairs: list[tuple[str, str | None]] = []
    if isinstance(keys, dict):
        pairs = [(str(k), str(v)) for k, v in keys.items()]
    elif isinstance(keys, (list, tuple)):  # transformers 4: the alias names only
        pairs = [(str(k), None) for k in keys]
    else:
        pairs = [("lm_head.weight", None)]
    out = []
    for name, target in pairs:
        if not tie and name.startswith(_OUTPUT_EMBEDDINGS):
            continue
        if "*" in name or "(" in name or "\\" in name:
            continue  # a pattern over layers, not one name
        full = prefix + name
        chosen = prefix + target if target is not None else _input_embedding(tensors, prefix)
        if chosen is not None and chosen in tensors:
            out.append((full, chosen, how))
    return out


def _input_embedding(tensors: dict[str, Any], prefix: str) -> str | None:
    """The one input embedding among `tensors` (by its conventional name), else None."""
    for suffix in _EMBEDDING_SUFFIXES:
        hits = [n for n in tensors if n.startswith(prefix) and n.endswith(suffix)]
        if len(hits) == 1:
            return hits[0]
    return None


def _config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    storage = checkpoint.storage
    try:
        # a model config is kilobytes: a larger one (a sparse file of gigabytes) is none,
        # rather than read whole into memory
        if not storage.exists("config.json") or storage.size("config.json") > MAX_CONFIG_BYTES:
            return None
        doc = json.loads(storage.read_all("config.json"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    except Exception:  # a remote store's own errors: no config is no aliases
        return None
    return doc if isinstance(doc, dict) else None


def _tied_weights_keys(arch: str) -> Any:
    """The model class's `_tied_weights_keys` (transformers 5: alias -> target; 4: names),
    or None when transformers or the class is not there."""
    if not arch.isidentifier():
        return None
    try:
        import transformers
    except ImportError:
        return None
    try:
        cls = getattr(transformers, arch)
    except Exception:  # unknown class, or a model module that fails to import
        return None
    return getattr(cls, "_tied_weights_keys", None)
