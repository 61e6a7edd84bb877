"""The weights transformers and diffusers keep in float32 whatever dtype a model is loaded in,
so that a `--dtype` cast leaves them as stored.

transformers' `from_pretrained(dtype=...)` loads the modules a model class lists in
`_keep_in_fp32_modules` in float32 under float16 (T5's `wo`, BLIP-2's `query_tokens`), and
those in `_keep_in_fp32_modules_strict` under float16 and bfloat16 (MoE routers, DeepSeek's
correction bias); diffusers loads its models' `_keep_in_fp32_modules` in float32 under any
dtype (Wan's time embedder and modulation). A copy cast to that dtype rounds them, and the
model loaded from it holds the rounded values upcast: not the model the source loads as.

The lists are read from the class the source's `config.json` names (transformers'
`architectures`, diffusers' `_class_name`), as class attributes of the installed library:
nothing is instantiated, no file of the source is run, and without the library (or for a class
it does not know) nothing is kept.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: a class name as the libraries spell their models (`T5ForConditionalGeneration`)
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]{0,199}")


def kept_in_float32(
    config: Mapping[str, Any] | None, cast: str | None, names: Iterable[str]
) -> set[str]:
    """The `names` (tensor names, any prefix before the model's own) transformers or diffusers
    would load in float32 when the model `config` describes is loaded in `cast` (a canonical
    dtype name); empty for any other cast, or a config naming no class the library has."""
    if cast not in ("float16", "bfloat16") or config is None:
        return set()
    modules: set[str] = set()
    for cls in _model_classes("transformers", config.get("architectures")):
        if cast == "float16":
            modules.update(_listed(getattr(cls, "_keep_in_fp32_modules", None)))
        modules.update(_listed(getattr(cls, "_keep_in_fp32_modules_strict", None)))
    # diffusers keeps its list in float32 under any dtype a model is loaded in
    for cls in _model_classes("diffusers", [config.get("_class_name")]):
        modules.update(_listed(getattr(cls, "_keep_in_fp32_modules", None)))
    if not modules:
        return set()
    # a module name (or a glob of one) as a whole component of the tensor's dotted name
    pattern = re.compile(
        "|".join(
            rf"(?:^|\.){re.escape(m).replace(re.escape('*'), '.*')}(?:\.|$)"
            for m in sorted(modules)
        )
    )
    return {n for n in names if pattern.search(n)}


def _model_classes(library: str, names: object) -> list[type]:
    """The classes `library` (transformers or diffusers) exports under `names`, when it is
    installed; a name it does not export is none."""
    if not isinstance(names, list):
        return []
    wanted = [a for a in names[:8] if isinstance(a, str) and _CLASS_NAME.fullmatch(a)]
    if not wanted:
        return []
    try:
        module = importlib.import_module(library)
    except Exception:  # not installed, or broken: nothing to read the lists from
        return []
    found: list[type] = []
    for name in wanted:
        try:
            cls = getattr(module, name, None)
        except Exception:  # a model module transformers cannot import here (a missing extra)
            continue
        if isinstance(cls, type):
            found.append(cls)
    return found


def _listed(value: object) -> list[str]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v for v in value if isinstance(v, str) and v]
    return []
