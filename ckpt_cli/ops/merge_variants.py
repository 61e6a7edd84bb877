"""`merge` of the PEFT adapters that are not LoRA: IA³, LoHa and LoKr, as peft merges them.

Each targeted base weight is computed from its own adapter tensors only, one weight at a time
(the LoRA path's streaming), op for op as peft's layers merge on CPU, so the result equals
`merge_and_unload()` + `save_pretrained` bit for bit:

- IA³ (`ia3.Linear` / `ia3.Conv2d`): the weight times the learned vector `ia3_l`
  (`[1, in]` on a feedforward layer, `[out, 1]` otherwise; transposed on transformers'
  `Conv1D` layers), rounded once into the weight's dtype; a non-feedforward layer's bias is
  scaled by the same vector.
- LoHa (`LycorisLayer.merge` + `LoHaLayer.get_delta_weight`): `W += ((w1a @ w1b) * (w2a @
  w2b)) * alpha / r`, or the CP form (`hada_t1`, `hada_t2`: `use_effective_conv2d`).
- LoKr (`LoKrLayer.get_delta_weight`): `W += kron(w1, w2) * alpha / r`, each factor whole
  (`lokr_w1`, `lokr_w2`) or low rank (`…_a @ …_b`: `decompose_both`, small `r`), `w2` in the
  CP form (`lokr_t2`) for `use_effective_conv2d`.

Which form a layer took is read from the tensors it saved; the rank dropout and module dropout
act in training only. The factors are held in the weight's dtype, 16-bit ones upcast to float32
(peft's `autocast_adapter_dtype`), and the delta is reshaped to the weight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, NotFoundError
from ..models import Entry

if TYPE_CHECKING:
    import torch

#: `peft_type` -> the name users know it by
VARIANT_LABELS = {"IA3": "IA³", "LOHA": "LoHa", "LOKR": "LoKr"}
#: the tensors each adapter type saves per layer (`{module}.{name}`)
_PARAMETERS: dict[str, frozenset[str]] = {
    "IA3": frozenset({"ia3_l"}),
    "LOHA": frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}),
    "LOKR": frozenset(
        {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"}
    ),
}
_PREFIX = "base_model.model."

#: the base tensor a module's parameter is (`module`, `weight` or `bias`) -> its name, or None
Locate = Callable[[str, str], "str | None"]
#: why a base tensor cannot take an update (quantized, integer codes), or None
Refuse = Callable[[str, str], "FormatError | None"]


@dataclass
class VariantUpdate:
    """One base tensor's IA³ / LoHa / LoKr update.

    Attributes:
        kind: the adapter's `peft_type` (IA3, LOHA, LOKR).
        module: the peft module path the update belongs to.
        tensors: the adapter tensors it is made of (`hada_w1_a` -> its name in the file).
        scaling: LoHa / LoKr's `alpha / r` for this module (rank / alpha patterns applied).
        transposed: IA³: the vector's first two axes are swapped before it scales the weight
            (a `Conv1D` layer, weight stored `[in, out]`: peft's per-layer `fan_in_fan_out`;
            a convolution's output channels, `[1, out, 1, 1]`).
        bias: IA³: this is the layer's bias, scaled by the vector reshaped to it.
    """

    kind: str
    module: str
    tensors: dict[str, str] = field(default_factory=dict)
    scaling: float = 1.0
    transposed: bool = False
    bias: bool = False

    def merged(self, weight: torch.Tensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """`weight` with this update merged, rounded as peft rounds it; `read` reads an adapter
        tensor by name."""
        import torch

        compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        held = {part: read(name).to(compute) for part, name in self.tensors.items()}
        if self.kind == "IA3":
            vector = held["ia3_l"]
            if self.bias:
                scale = vector.reshape(weight.shape)
            else:
                scale = vector.transpose(0, 1) if self.transposed else vector
            # ia3.Linear.merge: `torch.mul(weight, ia3_l).to(orig_dtype)`, one rounding
            return torch.mul(weight, scale).to(weight.dtype).contiguous()
        delta = _delta(self.kind, held, self.scaling).reshape(weight.shape)
        # LycorisLayer.merge: `weight += delta`, the sum in the wider dtype, one rounding
        return torch.add(weight, delta).to(weight.dtype).contiguous()


def _delta(kind: str, held: Mapping[str, torch.Tensor], scaling: float) -> torch.Tensor:
    """LoHa / LoKr `get_delta_weight` before its reshape, op for op (on meta tensors too, for
    the planned shape)."""
    import torch

    if kind == "LOHA":
        scale = torch.tensor(scaling, device=held["hada_w1_a"].device)
        if "hada_t1" in held:
            # HadaWeightCP.forward
            first = torch.einsum(
                "i j k l, j r, i p -> p r k l",
                held["hada_t1"],
                held["hada_w1_b"],
                held["hada_w1_a"],
            )
            second = torch.einsum(
                "i j k l, j r, i p -> p r k l",
                held["hada_t2"],
                held["hada_w2_b"],
                held["hada_w2_a"],
            )
            return first * second * scale
        # HadaWeight.forward
        return (
            (held["hada_w1_a"] @ held["hada_w1_b"]) * (held["hada_w2_a"] @ held["hada_w2_b"])
        ) * (scale)
    w1 = held["lokr_w1"] if "lokr_w1" in held else held["lokr_w1_a"] @ held["lokr_w1_b"]
    if "lokr_w2" in held:
        w2 = held["lokr_w2"]
    elif "lokr_t2" in held:
        # lokr's make_weight_cp
        w2 = torch.einsum(
            "i j k l, i p, j r -> p r k l", held["lokr_t2"], held["lokr_w2_a"], held["lokr_w2_b"]
        )
    else:
        w2 = held["lokr_w2_a"] @ held["lokr_w2_b"]
    # make_kron
    if len(w2.shape) == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    return torch.kron(w1, w2.contiguous()) * scaling


def check_variant_config(kind: str, config: dict[str, Any], adapter: str) -> None:
    """Refuse an adapter_config.json peft would not build the layers of: LoHa / LoKr's `r`,
    `alpha` and their patterns, IA³'s `feedforward_modules`."""
    where = f"{adapter.rstrip('/')}/adapter_config.json"
    fix = "Fix adapter_config.json (as peft's save_pretrained writes it), or re-save it."
    if kind == "IA3":
        feedforward = config.get("feedforward_modules")
        if not (
            feedforward is None
            or isinstance(feedforward, str)
            or (isinstance(feedforward, list) and all(isinstance(f, str) for f in feedforward))
        ):
            raise FormatError(
                f"feedforward_modules must be a list of module names or a regular expression, "
                f"not {feedforward!r}",
                path=where,
                fix=fix,
            )
        return
    check_rank_and_alpha(config, "alpha", where, fix)


def check_rank_and_alpha(config: dict[str, Any], alpha_key: str, where: str, fix: str) -> None:
    """Refuse the numbers a scaling `alpha / r` is made of where peft would not build the
    layers: `r` (a whole number >= 1), the alpha (`alpha_key`: LoRA's `lora_alpha`, LoHa /
    LoKr's `alpha`; a finite number) and their per-module patterns (`rank_pattern`,
    `alpha_pattern`: regular expressions to such numbers). `where`: the config file named."""
    if not _is_rank(config.get("r")):
        raise FormatError(
            f"r must be a whole number >= 1, not {config.get('r')!r}", path=where, fix=fix
        )
    if not _is_alpha(config.get(alpha_key)):
        raise FormatError(
            f"{alpha_key} must be a finite number, not {config.get(alpha_key)!r}",
            path=where,
            fix=fix,
        )
    for key, valid in (("rank_pattern", _is_rank), ("alpha_pattern", _is_alpha)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(
            isinstance(k, str) and valid(v) for k, v in patterns.items()
        ):
            raise FormatError(
                f"{key} must map module names to {'ranks' if key == 'rank_pattern' else 'alphas'}",
                path=where,
                fix=fix,
            )
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise FormatError(
                    f"{key} key {pattern!r} is not a regular expression ({exc})",
                    path=where,
                    fix=fix,
                ) from None


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_alpha(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def split_variant_entries(kind: str, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """The adapter's tensors of `kind`'s layers, and the rest (`modules_to_save` copies)."""
    parts = _PARAMETERS[kind]
    own = [e for e in entries if e.name.rsplit(".", 1)[-1] in parts]
    return own, [e for e in entries if e not in own]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's `get_pattern_key`: a `rank_pattern` / `alpha_pattern` key matches a module name's
    tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _feedforward(config: dict[str, Any], module: str) -> bool:
    """peft's `_check_target_module_feedforward`: a regular expression the whole module name
    matches, or a list of name tails (matched as plain string suffixes, as peft does)."""
    feedforward = config.get("feedforward_modules") or []
    if isinstance(feedforward, str):
        return re.fullmatch(feedforward, module) is not None
    return any(module.endswith(name) for name in feedforward)


def _held_rank(kind: str, shapes: Mapping[str, list[int]]) -> int | None:
    """The rank a LoHa / LoKr layer's factors were built with (None: full factors only)."""
    if kind == "LOHA":
        return shapes["hada_t1"][0] if "hada_t1" in shapes else shapes["hada_w1_a"][1]
    if "lokr_t2" in shapes:
        return shapes["lokr_t2"][0]
    if "lokr_w2_a" in shapes:
        return shapes["lokr_w2_a"][1]
    if "lokr_w1_a" in shapes:
        return shapes["lokr_w1_a"][1]
    return None


#: the sets of tensors a layer of each type may hold (each a form peft builds)
_FORMS: dict[str, tuple[frozenset[str], ...]] = {
    "LOHA": (
        frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}),
        frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}),
    ),
    "LOKR": tuple(
        frozenset(first | second)
        for first in ({"lokr_w1"}, {"lokr_w1_a", "lokr_w1_b"})
        for second in (
            {"lokr_w2"},
            {"lokr_w2_a", "lokr_w2_b"},
            {"lokr_w2_a", "lokr_w2_b", "lokr_t2"},
        )
    ),
    "IA3": (frozenset({"ia3_l"}),),
}


def plan_variants(
    kind: str,
    config: dict[str, Any],
    entries: list[Entry],
    shapes: Mapping[str, list[int]],
    locate: Locate,
    refuse: Refuse,
    is_conv1d: Callable[[str], bool],
    where: str,
) -> dict[str, VariantUpdate]:
    """The updates (base tensor -> its update) an adapter of `kind` makes, its tensors
    (`entries`, from `split_variant_entries`) checked against the base's `shapes` before
    anything is read: every layer in one of the forms peft builds, of the rank the config
    says, its delta the base weight's size; the base weight found (`locate`) and mergeable
    (`refuse`). `is_conv1d(module)` tells a square IA³ layer's orientation."""
    import torch

    by_module: dict[str, dict[str, Entry]] = {}
    for entry in entries:
        module, part = entry.name.removeprefix(_PREFIX).rsplit(".", 1)
        by_module.setdefault(module, {})[part] = entry
    updates: dict[str, VariantUpdate] = {}
    for module, parts in sorted(by_module.items()):
        if frozenset(parts) not in _FORMS[kind]:
            raise FormatError(
                f"{module!r} holds {', '.join(sorted(parts))}, not a set of "
                f"{VARIANT_LABELS[kind]} tensors peft builds",
                path=where,
                fix="The adapter file is incomplete or inconsistent; save it again.",
            )
        target = locate(module, "weight")
        if target is None:
            raise NotFoundError(
                f"the adapter targets {module!r}, which has no weight in the base",
                path=where,
                fix="Check that the adapter was trained on this base model.",
            )
        problem = refuse(target, module)
        if problem is not None:
            raise problem
        weight = shapes[target]
        held = {part: list(entry.shape) for part, entry in parts.items()}
        update = VariantUpdate(kind, module, {p: e.name for p, e in parts.items()})
        if kind == "IA3":
            updates.update(
                _plan_ia3(
                    update, held["ia3_l"], weight, config, locate, refuse, shapes, is_conv1d, where
                )
            )
            continue
        r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["alpha"])
        rank = _held_rank(kind, held)
        if rank is not None and rank != r:
            raise FormatError(
                f"the {VARIANT_LABELS[kind]} factors of {module!r} have rank {rank}, "
                f"adapter_config.json says r={r}",
                path=where,
                fix="Use the adapter_config.json saved with these weights.",
            )
        update.scaling = alpha / r
        if kind == "LOKR" and "lokr_t2" in held and len(weight) == 3:
            # peft builds this form for a Conv1d too, but its own `make_kron` fails on it
            # (torch.kron of the unsqueezed w1 and the `[., ., k, 1]` w2): no merge to match
            raise FormatError(
                f"the LoKr layer {module!r} is a 1-D convolution in the CP form "
                "(use_effective_conv2d, `lokr_t2`), which peft's own merge fails on "
                "(torch.kron in get_delta_weight), so there is no merge to match",
                path=where,
                fix="Train the adapter with use_effective_conv2d=False (or leave the 1-D "
                "convolutions out of target_modules), then merge it.",
            )
        try:
            meta = {p: torch.empty(s, device="meta") for p, s in held.items()}
            size = _delta(kind, meta, update.scaling).numel()
        except RuntimeError:
            size = -1
        if size != math.prod(weight):
            raise FormatError(
                f"the {VARIANT_LABELS[kind]} factors of {module!r} "
                f"({', '.join(f'{p} {s}' for p, s in sorted(held.items()))}) do not make a "
                f"weight of the base's shape {weight} ({target!r})",
                path=where,
                fix="Check that the adapter was trained on this base model.",
            )
        updates[target] = update
    return updates


def _plan_ia3(
    update: VariantUpdate,
    vector: list[int],
    weight: list[int],
    config: dict[str, Any],
    locate: Locate,
    refuse: Refuse,
    shapes: Mapping[str, list[int]],
    is_conv1d: Callable[[str], bool],
    where: str,
) -> dict[str, VariantUpdate]:
    """An IA³ layer's updates: its weight, and its bias when it is not feedforward."""
    module = update.module
    feedforward = _feedforward(config, module)
    target = locate(module, "weight")
    assert target is not None
    features = vector[1] if len(vector) >= 2 and vector[0] == 1 else None
    if len(weight) == 2 and len(vector) == 2:
        # ia3.Linear: `[1, in]` feedforward, `[out, 1]` otherwise; transposed on a Conv1D
        size = vector[1] if feedforward else vector[0]
        ones = vector[0] if feedforward else vector[1]
        fits = [
            flipped
            for flipped, axis in ((False, 1 if feedforward else 0), (True, 0 if feedforward else 1))
            if ones == 1 and weight[axis] == size
        ]
        if len(fits) == 2:
            fits = [is_conv1d(module)]
        if not fits:
            raise FormatError(
                f"the IA³ vector of {module!r} has shape {vector}, which does not scale the "
                f"{'input' if feedforward else 'output'} features of its base weight "
                f"{target!r} {weight} (feedforward_modules "
                f"{'names' if feedforward else 'does not name'} it)",
                path=where,
                fix="Check that the adapter was trained on this base model, with the "
                "adapter_config.json saved beside it.",
            )
        update.transposed = fits[0]
    elif len(weight) == len(vector) >= 3 and features is not None:
        # ia3.Conv2d / Conv3d: `[1, channels, 1, ...]`; a grouped convolution's feedforward
        # vector is spread over its groups, which `ckpt merge` does not do
        if features != weight[1 if feedforward else 0]:
            raise FormatError(
                f"the IA³ vector of {module!r} has shape {vector}, its base weight {target!r} "
                f"is {weight} (a grouped convolution, or another base)",
                path=where,
                fix="Merge it with peft's merge_and_unload.",
            )
        update.transposed = not feedforward
    else:
        raise FormatError(
            f"the IA³ vector of {module!r} has shape {vector}, its base weight {target!r} is "
            f"{weight}",
            path=where,
            fix="Check that the adapter was trained on this base model.",
        )
    planned = {target: update}
    bias = locate(module, "bias")
    if not feedforward and bias is not None:
        problem = refuse(bias, module)
        if problem is not None:
            raise problem
        if math.prod(shapes[bias]) != math.prod(vector):
            raise FormatError(
                f"the IA³ vector of {module!r} has shape {vector}, its bias {bias!r} is "
                f"{shapes[bias]}",
                path=where,
                fix="Check that the adapter was trained on this base model.",
            )
        planned[bias] = VariantUpdate("IA3", module, dict(update.tensors), bias=True)
    return planned
