"""The companion files `diff` compares besides the entries: `config.json`,
`generation_config.json`, tokenizer files, custom code, a pipeline's component configs: what
`convert` carries beside the weights (`transfer.extra_files`), read whole (each at most
`MAX_EXTRA_BYTES`).

A JSON object is compared key by key at its top level (`config.json:rms_norm_eps`), so a file
written again with other spacing or key order is no difference, and a changed
hyper-parameter is named; any other file by its bytes (size and a sha256 prefix). Keys that
name the writer, not the model (`transformers_version`, `_name_or_path`), are left out. A model
card (`README.md`) is no part of what loads, and is not compared. A PEFT `adapter_config.json`
holds its module-name sets (`target_modules`...) as Python sets, written in the saving
process's hash order (`PYTHONHASHSEED`): they are compared as sets.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ...formats.base import Checkpoint
from ...formats.names import looks_like_index
from ...quant.schemes import quantization_only_file
from ...sources.model_files import EXTRA_SUFFIXES, MAX_EXTRA_BYTES
from ..convert.plan import CONFIG_DTYPE_KEYS
from ..shared.transfer import extra_files

#: top-level keys that say which library version wrote the file, or where it was loaded from
WRITER_KEYS = frozenset({"transformers_version", "_name_or_path", "_diffusers_version"})
#: the keys of a PEFT `adapter_config.json` that peft holds as a `set` (its configs'
#: `__post_init__`) and `save_pretrained` writes as a list in the process's set order: a resumed
#: run, another process, writes the same set in another order
PEFT_SET_KEYS = frozenset({"target_modules", "exclude_modules", "feedforward_modules"})
#: values longer than this (as JSON) are compared, and shown, as a summary and a digest
MAX_SHOWN = 200


def companion_files(checkpoint: Checkpoint, *, dequantize: bool = False) -> list[str]:
    """The companion files of `checkpoint` that `diff` compares (none for a single file):
    those beside the weights, and in the component folders of a multi-folder model (a
    diffusers pipeline's `unet/config.json`, `scheduler/scheduler_config.json`), which
    `convert` carries too; never a shard index. With `dequantize`, not those that only
    declare the quantization (`hf_quant_config.json`, which `convert --dequantize` leaves
    out)."""
    source = checkpoint.source
    names = list(extra_files(checkpoint))
    if source.target is None:
        names += [
            f.path
            for f in checkpoint.manifest.files
            if not f.entries
            and "/" in f.path
            and f.path.endswith(EXTRA_SUFFIXES)
            and not any(part.startswith(".") for part in f.path.split("/"))
            and not looks_like_index(f.path.rsplit("/", 1)[-1])
            and (source.files.get(f.path) or 0) <= MAX_EXTRA_BYTES
        ]
    return [
        name
        for name in dict.fromkeys(names)
        if not name.lower().endswith(".md")
        and not (dequantize and quantization_only_file(name.rsplit("/", 1)[-1]))
    ]


def companion_values(
    checkpoint: Checkpoint, name: str, *, ignore_dtype: bool = False, dequantize: bool = False
) -> dict[str, str]:
    """The compared values of companion file `name`: `file:key` -> the value as JSON text for
    a JSON object, else `file` -> its size and a sha256 prefix of its bytes.

    `ignore_dtype` (`diff --ignore-dtype`) leaves out the dtype a config declares for its
    weights (`torch_dtype`, `dtype`, in sub-configs too), which `convert --dtype` rewrites;
    `dequantize` (`diff --dequantize`) that and `quantization_config`, which
    `convert --dequantize` drops.
    """
    data = checkpoint.storage.read_all(name)
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):  # not JSON (a tokenizer.model), or not UTF-8
        parsed = None
    if not isinstance(parsed, dict):
        digest = hashlib.sha256(data).hexdigest()[:16]
        return {name: f"{len(data)} bytes, sha256:{digest}"}
    left_out = set(WRITER_KEYS)
    if dequantize:
        left_out.add("quantization_config")
    if ignore_dtype or dequantize:
        parsed = _without_dtype(parsed)
    if name.rsplit("/", 1)[-1] == "adapter_config.json":
        parsed = {
            key: _as_set(value) if key in PEFT_SET_KEYS else value for key, value in parsed.items()
        }
    return {f"{name}:{key}": _shown(value) for key, value in parsed.items() if key not in left_out}


def _without_dtype(node: dict[str, Any]) -> dict[str, Any]:
    """`node` without the dtype keys a config declares its weights' dtype under, at any depth."""
    return {
        key: _without_dtype(value) if isinstance(value, dict) else value
        for key, value in node.items()
        if key not in CONFIG_DTYPE_KEYS
    }


def _as_set(value: Any) -> Any:
    """A list of names peft held as a set, in one order (sorted); any other value as it is."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return sorted(set(value))
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    if len(text) <= MAX_SHOWN:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    kind = type(value).__name__
    size = f"{len(value)} items" if isinstance(value, (list, dict)) else f"{len(text)} chars"
    return f"<{kind} of {size}> sha256:{digest}"
