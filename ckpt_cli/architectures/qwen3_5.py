"""Qwen3.5 (dense and MoE) language models: torchtitan 0.3's `qwen3_5` against transformers'
`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, under the Hugging Face names of Qwen's own
checkpoints (`model.language_model.`, which transformers' text models load as they are).

The correspondence is torchtitan 0.3.0's own `Qwen35StateDictAdapter`
(`torchtitan/models/qwen3_5/state_dict_adapter.py`), stated declaratively:

- full-attention layers (`self_attn`): renames. The q projection holds each head's query and
  its output gate side by side on both sides, and both rotate the halves of the first
  `rotary_dim` columns (no row permutation: the logits agree without one);
- GatedDeltaNet layers (`linear_attn`): torchtitan's separate `in_proj_q/k/v` and
  `conv_q/k/v` are transformers' fused `in_proj_qkv` and `conv1d`, rows `[q | k | v]`
  (`DeltaNetQKV`: the key width is read from the shapes, the value width from `in_proj_z`);
- MoE layers: router, shared expert and its sigmoid gate renamed; the routed experts' stacked
  `w1_EFD` and `w3_EFD` are transformers' one `gate_up_proj` `[E, 2F, D]` (gate rows, then up
  rows: `FusedExperts`), `w2_EDF` its `down_proj` `[E, D, F]` as it is.

One departure from torchtitan 0.3.0's adapter: it transposes the stacked experts (writing
`gate_up_proj` `[E, D, 2F]` and `down_proj` `[E, F, D]`), which transformers 5's
`Qwen3_5MoeExperts` (`[E, 2F, D]`, `[E, D, F]`, as Qwen's checkpoints store them) refuses
as a size mismatch; the layout here is the one `from_pretrained` loads and computes the
torchtitan logits with.

The vision encoder (`vision_encoder.*` against `model.visual.*`, as torchtitan's adapter maps
it): blocks, norms and merger renamed (its blocks numbered by `{block}`, apart from the
language model's layers); each block's separate `wq/wk/wv` weights and biases are the fused
`attn.qkv` (`VisionQKV`); the patch embedding is torchtitan's `Linear` `[out, C*T*P*P]` and
transformers' `Conv3d` `[out, C, T, P, P]`, the same bytes (`PatchEmbedding`, which reads C,
T and P from the config's `vision_config`). An export holding the encoder writes the
`Qwen3_5ForConditionalGeneration` config (`text_config` and `vision_config`); one without it
(`--filter-out 'vision_encoder.*'`) writes the language model's (`fit_config`).

A torchtitan save holds no config, and Qwen3.5's (linear-attention heads, partial rotary,
layer types) is not in the weights: `--config` or `--flavor` gives it (`hf_config`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import FormatError, UsageError
from .base import (
    HF,
    Architecture,
    Direction,
    Filled,
    Ignored,
    MappedTensor,
    Match,
    ModelArgs,
    Piece,
    Rename,
    TensorRule,
    numbers_held,
    one,
)

TITAN = "torchtitan"

_H = "model.language_model.layers.{layer}."
_T = "layers.{layer}."

_COMMON = (
    ("model.language_model.embed_tokens.weight", "tok_embeddings.weight"),
    (_H + "input_layernorm.weight", _T + "attention_norm.weight"),
    (_H + "post_attention_layernorm.weight", _T + "ffn_norm.weight"),
    ("model.language_model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
_FULL_ATTENTION = (
    (_H + "self_attn.q_proj.weight", _T + "attn.wq.weight"),
    (_H + "self_attn.k_proj.weight", _T + "attn.wk.weight"),
    (_H + "self_attn.v_proj.weight", _T + "attn.wv.weight"),
    (_H + "self_attn.o_proj.weight", _T + "attn.wo.weight"),
    (_H + "self_attn.q_norm.weight", _T + "attn.q_norm.weight"),
    (_H + "self_attn.k_norm.weight", _T + "attn.k_norm.weight"),
)
_LINEAR_ATTENTION = (
    (_H + "linear_attn.in_proj_a.weight", _T + "attn.in_proj_a.weight"),
    (_H + "linear_attn.in_proj_b.weight", _T + "attn.in_proj_b.weight"),
    (_H + "linear_attn.A_log", _T + "attn.A_log"),
    (_H + "linear_attn.dt_bias", _T + "attn.dt_bias"),
    (_H + "linear_attn.norm.weight", _T + "attn.norm.weight"),
    (_H + "linear_attn.out_proj.weight", _T + "attn.out_proj.weight"),
)
#: (HF fused, ...), (torchtitan parts, ...) of a GatedDeltaNet layer's q/k/v (`DeltaNetQKV`)
_DELTANET_HF = (
    _H + "linear_attn.in_proj_qkv.weight",
    _H + "linear_attn.conv1d.weight",
    _H + "linear_attn.in_proj_z.weight",
)
_DELTANET_TT = (
    _T + "attn.in_proj_q.weight",
    _T + "attn.in_proj_k.weight",
    _T + "attn.in_proj_v.weight",
    _T + "attn.conv_q.weight",
    _T + "attn.conv_k.weight",
    _T + "attn.conv_v.weight",
    _T + "attn.in_proj_z.weight",
)
_DENSE_MLP = (
    (_H + "mlp.gate_proj.weight", _T + "feed_forward.w1.weight"),
    (_H + "mlp.up_proj.weight", _T + "feed_forward.w3.weight"),
    (_H + "mlp.down_proj.weight", _T + "feed_forward.w2.weight"),
)
_ROUTER = (_H + "mlp.gate.weight", _T + "moe.router.gate.weight")
_MOE = (
    _ROUTER,
    (_H + "mlp.shared_expert.gate_proj.weight", _T + "moe.shared_experts.w1.weight"),
    (_H + "mlp.shared_expert.up_proj.weight", _T + "moe.shared_experts.w3.weight"),
    (_H + "mlp.shared_expert.down_proj.weight", _T + "moe.shared_experts.w2.weight"),
    (_H + "mlp.shared_expert_gate.weight", _T + "moe.shared_experts.gate.weight"),
    (_H + "mlp.experts.down_proj", _T + "moe.routed_experts.inner_experts.w2_EDF"),
)
_GATE_UP = (
    _H + "mlp.experts.gate_up_proj",
    (
        _T + "moe.routed_experts.inner_experts.w1_EFD",
        _T + "moe.routed_experts.inner_experts.w3_EFD",
    ),
)

#: the vision encoder: its blocks are numbered apart from the language model's layers
_VB = "model.visual.blocks.{block}."
_VT = "vision_encoder.layers.{block}."
_VISION = (
    ("model.visual.patch_embed.proj.bias", "vision_encoder.patch_embed.bias"),
    ("model.visual.pos_embed.weight", "vision_encoder.pos_embed"),
    *(
        (f"{_VB}{module}.{kind}", f"{_VT}{module}.{kind}")
        for module in ("norm1", "norm2", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
        for kind in ("weight", "bias")
    ),
    *(
        (f"model.visual.merger.{module}.{kind}", f"vision_encoder.merger.{module}.{kind}")
        for module in ("norm", "linear_fc1", "linear_fc2")
        for kind in ("weight", "bias")
    ),
)
_VISION_QKV = (
    (_VB + "attn.qkv.weight", _VB + "attn.qkv.bias"),
    tuple(_VT + f"attn.{w}.{kind}" for kind in ("weight", "bias") for w in ("wq", "wk", "wv")),
)
_PATCH_EMBED = ("model.visual.patch_embed.proj.weight", "vision_encoder.patch_embed.weight")
#: the HF side's vision patterns: a text-only model holds none of them
_VISION_HF = (*(hf for hf, _ in _VISION), *_VISION_QKV[0], _PATCH_EMBED[0])
_VISION_TITAN = (*(tt for _, tt in _VISION), *_VISION_QKV[1], _PATCH_EMBED[1])

_HF_IGNORED = (
    Ignored(_H + "self_attn.rotary_emb.inv_freq", "rotary table (rebuilt)"),
    Ignored("model.language_model.rotary_emb.inv_freq", "rotary table (rebuilt)"),
    # Qwen's checkpoints hold it; transformers' load ignores it (`^mtp.*`), torchtitan's
    # adapter maps none of it, and neither model builds one
    Ignored(
        "mtp.",
        "multi-token-prediction module (a training head neither model builds)",
        prefix=True,
    ),
)
_TITAN_IGNORED = (
    Ignored("freqs_cis", "rotary table (rebuilt)"),
    Ignored(_T + "attn.rope.cache", "rotary table (rebuilt)"),
    # as torchtitan's own to_hf: transformers' Qwen3.5-MoE router has no bias. The bias
    # routes tokens, so a trained, non-zero one dropped changes the model: the caller checks
    Ignored(
        _T + "moe.expert_bias_E",
        "MoE load-balancing bias (no HF counterpart)",
        computes=True,
    ),
    Ignored(_T + "moe.tokens_per_expert_E", "MoE load-balancing counter (training)"),
)


def _renames(pairs: Sequence[tuple[str, str]]) -> list[TensorRule]:
    return [Rename(one(hf), one(native)) for hf, native in pairs]


def _by_layer(matches: Sequence[Match], key: str = "layer") -> dict[int, dict[int, Match]]:
    """Each layer's (or vision block's: `key`) matches by the index of the pattern they
    matched."""
    out: dict[int, dict[int, Match]] = {}
    for m in matches:
        out.setdefault(m.groups[key], {})[m.pattern] = m
    return out


def _complete(
    layer: int,
    have: Mapping[int, Match],
    patterns: Sequence[str],
    what: str,
    key: str = "layer",
) -> None:
    """FormatError naming the first of `patterns` layer `layer` lacks (`have`: by index)."""
    lacking = [p.format(**{key: layer}) for i, p in enumerate(patterns) if i not in have]
    if lacking:
        unit = "vision block" if key == "block" else "layer"
        raise FormatError(
            f"{lacking[0]!r} is missing, so {unit} {layer}'s {what} cannot be mapped (its "
            "parts are one tensor in the other naming)",
            fix="Convert the complete checkpoint (every shard of it), with every tensor of "
            "each layer (no --filter / --filter-out that leaves one out).",
        )


@dataclass(frozen=True)
class DeltaNetQKV(TensorRule):
    """A GatedDeltaNet layer's q/k/v: torchtitan's `in_proj_q/k/v` and `conv_q/k/v` are
    transformers' `in_proj_qkv` and `conv1d`, rows `[q | k | v]`, and `in_proj_z` beside them
    (renamed; its rows are the value width, which splits the fused tensors on the way from
    HF: q and k are each `(rows - value width) / 2`, as torchtitan's adapter reads them from
    its model config)."""

    @property
    def transform(self) -> str:
        return "fuse-qkv"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        for layer, have in sorted(_by_layer(matches).items()):
            sources = self.source_patterns(direction)
            _complete(layer, have, sources, "GatedDeltaNet q/k/v")
            if direction == "to_hf":
                out += self._fuse(layer, have)
            else:
                out += self._split(layer, have)
        return out

    def _fuse(self, layer: int, have: Mapping[int, Match]) -> list[MappedTensor]:
        out = []
        for fused, parts in ((0, (0, 1, 2)), (1, (3, 4, 5))):
            first = have[parts[0]]
            out.append(
                MappedTensor(
                    name=self.hf[fused].format(layer=layer),
                    shape=(sum(have[p].shape[0] for p in parts), *first.shape[1:]),
                    dtype=first.dtype,
                    pieces=tuple(Piece(have[p].name) for p in parts),
                    combine="concat",
                    transform="fuse-qkv",
                )
            )
        z = have[6]
        out.append(
            MappedTensor(
                name=self.hf[2].format(layer=layer),
                shape=z.shape,
                dtype=z.dtype,
                pieces=(Piece(z.name),),
            )
        )
        return out

    def _split(self, layer: int, have: Mapping[int, Match]) -> list[MappedTensor]:
        qkv, conv, z = have[0], have[1], have[2]
        value = z.shape[0] if z.shape else 0
        rows = qkv.shape[0] if qkv.shape else 0
        key, odd = divmod(rows - value, 2)
        if key <= 0 or odd or not conv.shape or conv.shape[0] != rows:
            raise FormatError(
                f"{qkv.name!r} has {rows} rows and {conv.name!r} "
                f"{conv.shape[0] if conv.shape else 0}, which are not q and k of one width "
                f"and v of {value} ({z.name!r}'s rows) each",
                fix="Convert a checkpoint as its framework saved it (a Qwen3.5's fused "
                "GatedDeltaNet projections hold q, k and v rows in that order).",
            )
        out = []
        for fused, parts in ((qkv, (0, 1, 2)), (conv, (3, 4, 5))):
            rest = tuple(fused.shape[1:])
            for part, (start, count) in zip(
                parts, ((0, key), (key, key), (2 * key, value)), strict=True
            ):
                out.append(
                    MappedTensor(
                        name=self.native[part].format(layer=layer),
                        shape=(count, *rest),
                        dtype=fused.dtype,
                        pieces=(Piece(fused.name, (start, *(0 for _ in rest)), (count, *rest)),),
                        transform="split-qkv",
                    )
                )
        out.append(
            MappedTensor(
                name=self.native[6].format(layer=layer),
                shape=z.shape,
                dtype=z.dtype,
                pieces=(Piece(z.name),),
            )
        )
        return out


@dataclass(frozen=True)
class FusedExperts(TensorRule):
    """A layer's routed experts' gate and up projections: torchtitan's stacked `w1_EFD` and
    `w3_EFD` (`[E, F, D]` each) side by side in transformers' one `gate_up_proj`
    `[E, 2F, D]` (gate rows first, as `Qwen3_5MoeExperts` chunks them)."""

    @property
    def transform(self) -> str:
        return "fuse-gate-up"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        for layer, have in sorted(_by_layer(matches).items()):
            _complete(layer, have, self.source_patterns(direction), "experts' gate and up")
            if direction == "to_hf":
                gate, up = have[0], have[1]
                if len(gate.shape) != 3 or gate.shape != up.shape:
                    raise FormatError(
                        f"{gate.name!r} {list(gate.shape)} and {up.name!r} {list(up.shape)} "
                        "are not two [experts, hidden, dim] stacks of one shape",
                        fix="Convert a checkpoint as torchtitan saved it.",
                    )
                experts, hidden, dim = gate.shape
                out.append(
                    MappedTensor(
                        name=self.hf[0].format(layer=layer),
                        shape=(experts, 2 * hidden, dim),
                        dtype=gate.dtype,
                        pieces=(Piece(gate.name), Piece(up.name)),
                        combine="concat",
                        axis=1,
                        transform="fuse-gate-up",
                    )
                )
                continue
            fused = have[0]
            if len(fused.shape) != 3 or fused.shape[1] % 2:
                raise FormatError(
                    f"{fused.name!r} {list(fused.shape)} is not an [experts, 2 x hidden, dim] "
                    "stack of gate and up projections",
                    fix="Convert a checkpoint as its framework saved it.",
                )
            experts, both, dim = fused.shape
            hidden = both // 2
            for part, start in ((0, 0), (1, hidden)):
                out.append(
                    MappedTensor(
                        name=self.native[part].format(layer=layer),
                        shape=(experts, hidden, dim),
                        dtype=fused.dtype,
                        pieces=(Piece(fused.name, (0, start, 0), (experts, hidden, dim)),),
                        transform="split-gate-up",
                    )
                )
        return out


@dataclass(frozen=True)
class VisionQKV(TensorRule):
    """A vision block's attention q/k/v: torchtitan's separate `wq/wk/wv` (weights, then
    biases) are transformers' fused `attn.qkv`, rows `[q | k | v]` of one width each, as
    torchtitan's adapter concatenates and chunks them."""

    @property
    def transform(self) -> str:
        return "fuse-qkv"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        for block, have in sorted(_by_layer(matches, "block").items()):
            sources = self.source_patterns(direction)
            _complete(block, have, sources, "attention q/k/v", "block")
            if direction == "to_hf":
                for fused, parts in ((0, (0, 1, 2)), (1, (3, 4, 5))):
                    first = have[parts[0]]
                    if any(have[p].shape != first.shape for p in parts):
                        raise FormatError(
                            f"{first.name!r} and the other q/k/v of vision block {block} "
                            "differ in shape: they are not one attention's projections",
                            fix="Convert a checkpoint as torchtitan saved it.",
                        )
                    out.append(
                        MappedTensor(
                            name=self.hf[fused].format(block=block),
                            shape=(3 * first.shape[0], *first.shape[1:]),
                            dtype=first.dtype,
                            pieces=tuple(Piece(have[p].name) for p in parts),
                            combine="concat",
                            transform="fuse-qkv",
                        )
                    )
                continue
            for qkv, parts in ((have[0], (0, 1, 2)), (have[1], (3, 4, 5))):
                rows = qkv.shape[0] if qkv.shape else 0
                width, odd = divmod(rows, 3)
                if not width or odd:
                    raise FormatError(
                        f"{qkv.name!r} has {rows} rows, which are not q, k and v of one width each",
                        fix="Convert a checkpoint as its framework saved it.",
                    )
                rest = tuple(qkv.shape[1:])
                for i, part in enumerate(parts):
                    out.append(
                        MappedTensor(
                            name=self.native[part].format(block=block),
                            shape=(width, *rest),
                            dtype=qkv.dtype,
                            pieces=(
                                Piece(qkv.name, (i * width, *(0 for _ in rest)), (width, *rest)),
                            ),
                            transform="split-qkv",
                        )
                    )
        return out


@dataclass(frozen=True)
class PatchEmbedding(TensorRule):
    """The vision encoder's patch embedding: torchtitan's `Linear` `[out, C*T*P*P]` (patches
    cut by the collator) is transformers' `Conv3d` `[out, C, T, P, P]` with a kernel of one
    whole patch, the same elements in the same order. C, T and P are the config's
    `vision_config` `in_channels`, `temporal_patch_size` and `patch_size`: the flat width
    alone cannot tell them apart."""

    @property
    def transform(self) -> str:
        return "reshape"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        for m in matches:
            if direction == "to_hf":
                shape = _conv_shape(m, args, family)
            else:
                if len(m.shape) != 5:
                    raise FormatError(
                        f"{m.name!r} {list(m.shape)} is not a Conv3d weight [out, channels, "
                        "temporal patch, patch, patch]",
                        fix="Convert a checkpoint as its framework saved it.",
                    )
                shape = (m.shape[0], math.prod(m.shape[1:]))
            out.append(
                MappedTensor(
                    name=self.target_patterns(direction)[0],
                    shape=shape,
                    dtype=m.dtype,
                    pieces=(Piece(m.name),),
                    transform="reshape",
                    reshape=True,
                )
            )
        return out


def _conv_shape(m: Match, args: ModelArgs, family: str) -> tuple[int, ...]:
    """transformers' Conv3d shape of torchtitan's flat patch embedding `m`."""
    config = args.config or {}
    vision = config.get("vision_config")
    keys = ("in_channels", "temporal_patch_size", "patch_size")
    said = [vision.get(k) for k in keys] if isinstance(vision, dict) else []
    values = [v for v in said if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if len(values) != len(keys):
        raise FormatError(
            f"{m.name!r} is the vision encoder's patch embedding, and the config gives no "
            "vision_config (in_channels, temporal_patch_size, patch_size) to shape it as "
            f"{family}'s Conv3d weight",
            fix="Pass the model's config.json (with its vision_config) with --config, or "
            "--flavor; or leave the vision encoder out with --filter-out 'vision_encoder.*' to "
            "export the language model alone.",
        )
    channels, temporal, patch = values
    if len(m.shape) != 2 or m.shape[1] != channels * temporal * patch * patch:
        raise FormatError(
            f"{m.name!r} {list(m.shape)} is not [out, in_channels x temporal_patch_size x "
            f"patch_size^2] = [out, {channels * temporal * patch * patch}] as the config's "
            "vision_config says",
            fix="Pass the config.json of the model this checkpoint holds.",
        )
    return (m.shape[0], channels, temporal, patch, patch)


_VISION_RULES: tuple[TensorRule, ...] = (
    *_renames(_VISION),
    VisionQKV(*_VISION_QKV),
    PatchEmbedding(one(_PATCH_EMBED[0]), one(_PATCH_EMBED[1])),
)


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: a Qwen3.5 VLM's `text_config`, or a text model's own."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _layers_holding(shapes: Mapping[str, Sequence[int]], pattern: str) -> list[int]:
    regex = re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)") + r"\Z")
    return sorted({int(m.group(1)) for name in shapes if (m := regex.match(name))})


class _Qwen35(Architecture):
    """What Qwen3.5 dense and MoE share."""

    activations: ClassVar[tuple[str, ...]] = ("silu", "swish")
    torchtitan_models = "torchtitan.models.qwen3_5"
    tied: ClassVar[Mapping[str, tuple[str, str]]] = {
        HF: (_COMMON[0][0], _COMMON[-1][0]),
        TITAN: (_COMMON[0][1], _COMMON[-1][1]),
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {HF: _HF_IGNORED, TITAN: _TITAN_IGNORED}
    # a layer is full attention or GatedDeltaNet (config.json's layer_types): either is
    # optional to recognition, and `check_layers` wants one whole in each layer; a text
    # model holds no vision encoder
    optional: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (
            *(hf for hf, _ in _FULL_ATTENTION),
            *(hf for hf, _ in _LINEAR_ATTENTION),
            *_VISION_HF,
        ),
        TITAN: (
            *(tt for _, tt in _FULL_ATTENTION),
            *(tt for _, tt in _LINEAR_ATTENTION),
            *_VISION_TITAN,
        ),
    }
    layer_variants: ClassVar[Sequence[Sequence[str]]] = (
        tuple(hf for hf, _ in _FULL_ATTENTION),
        (*(hf for hf, _ in _LINEAR_ATTENTION), *_DELTANET_HF),
    )

    hf_architecture: ClassVar[str]
    hf_model_type: ClassVar[str]
    #: the vision-language model's (`text_config` and `vision_config`)
    hf_vlm_architecture: ClassVar[str]
    hf_vlm_model_type: ClassVar[str]

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        side = 0 if naming == HF else 1

        def pick(pair: tuple[str, str]) -> str:
            return pair[side]

        embed = shapes.get(pick(_COMMON[0]))
        layers = _layers_holding(shapes, pick(_COMMON[1]))
        full = _layers_holding(shapes, pick(_FULL_ATTENTION[4]))
        values: dict[str, Any] = {
            "dim": embed[1] if embed else None,
            "vocab_size": embed[0] if embed else None,
            "n_layers": max(layers) + 1 if layers else None,
            "tie_embeddings": True if embed and shapes.get(pick(_COMMON[-1])) is None else None,
        }
        if full:
            q_norm = shapes.get(pick(_FULL_ATTENTION[4]).format(layer=full[0]))
            q = shapes.get(pick(_FULL_ATTENTION[0]).format(layer=full[0]))
            k = shapes.get(pick(_FULL_ATTENTION[1]).format(layer=full[0]))
            head_dim = q_norm[0] if q_norm else None
            values["head_dim"] = head_dim
            if head_dim and q and k:
                values["n_heads"] = q[0] // (2 * head_dim)  # each head's query and gate
                values["n_kv_heads"] = k[0] // head_dim
        dense = _layers_holding(shapes, pick(_DENSE_MLP[0]))
        if dense:
            gate = shapes.get(pick(_DENSE_MLP[0]).format(layer=dense[0]))
            values["ffn_dim"] = gate[0] if gate else None
        moe = _layers_holding(shapes, pick(_ROUTER))
        if moe:
            router = shapes.get(pick(_ROUTER).format(layer=moe[0]))
            values["num_experts"] = router[0] if router else None
            down = shapes.get(pick(_MOE[-1]).format(layer=moe[0]))
            values["moe_ffn_dim"] = down[2] if down and len(down) == 3 else None
        return ModelArgs(**values)

    @classmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        text = _text(config)
        params = text.get("rope_parameters")
        theta = params.get("rope_theta") if isinstance(params, dict) else text.get("rope_theta")
        return ModelArgs(
            dim=text.get("hidden_size"),
            n_layers=text.get("num_hidden_layers"),
            n_heads=text.get("num_attention_heads"),
            n_kv_heads=text.get("num_key_value_heads"),
            head_dim=text.get("head_dim"),
            vocab_size=text.get("vocab_size"),
            ffn_dim=text.get("intermediate_size"),
            norm_eps=text.get("rms_norm_eps"),
            rope_theta=theta,
            max_position_embeddings=text.get("max_position_embeddings"),
            tie_embeddings=bool(
                text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
            ),
            num_experts=text.get("num_experts"),
            experts_per_token=text.get("num_experts_per_tok"),
            moe_ffn_dim=text.get("moe_intermediate_size"),
            config=dict(config),
        )

    @classmethod
    def config_conflicts(cls, config: Mapping[str, Any]) -> list[str]:
        # the rules map weights only: Qwen3_5Attention builds q/k/v/o biases with it
        bias = _text(config).get("attention_bias")
        return [] if bias in (None, False) else [f"attention_bias: {json.dumps(bias)}"]

    @classmethod
    def shape_conflicts(
        cls, shapes: Mapping[str, Sequence[int]], naming: str, args: ModelArgs
    ) -> list[str]:
        if args.config is None or naming not in (HF, TITAN):
            return []
        text = _text(args.config)
        out: list[str] = []
        side = 0 if naming == HF else 1
        layers = _layers_holding(shapes, _COMMON[1][side])
        full = set(_layers_holding(shapes, _FULL_ATTENTION[0][side]))
        linear = set(_layers_holding(shapes, _LINEAR_ATTENTION[0][side]))
        types = text.get("layer_types")
        if not isinstance(types, list):
            interval = text.get("full_attention_interval", 4)
            count = text.get("num_hidden_layers", len(layers))
            if isinstance(interval, int) and interval > 0 and isinstance(count, int):
                types = [
                    "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                    for i in range(count)
                ]
        for layer in layers:
            said = types[layer] if isinstance(types, list) and layer < len(types) else None
            held = "full_attention" if layer in full else "linear_attention"
            if said is not None and layer in full | linear and said != held:
                out.append(
                    f"layer {layer} holds {held.replace('_', ' ')}, where layer_types[{layer}] "
                    f"= {json.dumps(said)}"
                )
                break

        def check(name: str, axis: int, keys: Sequence[str], factor: int = 1) -> None:
            values = [text.get(k) for k in keys]
            shape = shapes.get(name)
            if shape is None or len(shape) <= axis:
                return
            numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
            if len(numbers) != len(values):
                return
            want = factor * math.prod(numbers)
            if shape[axis] != want:
                said = " x ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
                times = f"{factor} x " if factor != 1 else ""
                out.append(f"{name} has {shape[axis]} rows, where {times}{said} = {want}")

        for layer in sorted(full)[:1]:
            q, k = _FULL_ATTENTION[0][side], _FULL_ATTENTION[1][side]
            check(q.format(layer=layer), 0, ("num_attention_heads", "head_dim"), 2)
            check(k.format(layer=layer), 0, ("num_key_value_heads", "head_dim"))
        for layer in sorted(linear)[:1]:
            z = _DELTANET_HF[2] if naming == HF else _DELTANET_TT[6]
            check(z.format(layer=layer), 0, ("linear_num_value_heads", "linear_value_head_dim"))
            if naming == TITAN:
                q = _DELTANET_TT[0].format(layer=layer)
                check(q, 0, ("linear_num_key_heads", "linear_key_head_dim"))
        for layer in _layers_holding(shapes, _DENSE_MLP[0][side])[:1]:
            check(_DENSE_MLP[0][side].format(layer=layer), 0, ("intermediate_size",))
        for layer in _layers_holding(shapes, _ROUTER[side])[:1]:
            check(_ROUTER[side].format(layer=layer), 0, ("num_experts",))
            check(_MOE[1][side].format(layer=layer), 0, ("shared_expert_intermediate_size",))
        return out

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        # Qwen3.5's linear-attention heads, partial rotary and layer types are not in the
        # weights: the source's own config.json, --config or --flavor says them
        config: dict[str, Any] = dict(
            args.require("config", cls.title, "linear-attention heads, rotary and layer types")
        )
        return config

    @classmethod
    def check_layers(cls, names: Sequence[str]) -> None:
        """The language model's layers (`Architecture.check_layers`), and the vision
        encoder, when the model holds one, whole: every tensor of it, in every block (its
        tensors are optional to a text model, so the layers' check passes over them)."""
        super().check_layers(names)
        held = [n for n in names if n.startswith("model.visual.")]
        if not held:
            return
        found = numbers_held(held, _VISION_HF, "block")
        blocks = set().union(*found.values())
        for block in range(max(blocks) + 1 if blocks else 1):
            lacks = [
                p.format(block=block)
                for p in _VISION_HF
                if ("{block}" in p or block == 0) and block not in found[p]
            ]
            if lacks:
                more = f" and {len(lacks) - 1} more" if len(lacks) > 1 else ""
                raise FormatError(
                    f"the {cls.title} vision encoder lacks {lacks[0]!r}{more} (in Hugging Face "
                    "names), which a whole encoder holds: transformers' from_pretrained would "
                    "initialise it at random",
                    fix="Convert the complete checkpoint (every shard of it), or leave the "
                    "vision encoder out whole with --filter-out 'vision_encoder.*' (torchtitan "
                    "names) / 'model.visual.*' (Hugging Face names).",
                )

    @classmethod
    def fit_config(cls, config: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
        vision = [n for n in names if n.startswith("model.visual.")]
        if vision and not isinstance(config.get("vision_config"), dict):
            raise FormatError(
                f"the export holds {len(vision)} tensor(s) of {cls.title}'s vision encoder "
                f"({vision[0]!r}...), and the config describes no vision_config: "
                "from_pretrained would build a text model and drop them",
                fix="Pass the model's config.json (with its vision_config) with --config, or "
                "leave the vision encoder out with --filter-out 'vision_encoder.*'.",
            )
        if vision or not isinstance(config.get("text_config"), dict):
            return config
        # the language model alone: its own config, which builds no vision encoder
        text: dict[str, Any] = dict(config["text_config"])
        text["architectures"] = [cls.hf_architecture]
        text.setdefault("model_type", cls.hf_model_type)
        for key in ("tie_word_embeddings", "torch_dtype", "dtype"):
            if key in config and key not in text:
                text[key] = config[key]
        return text

    @classmethod
    def args_from_torchtitan(cls, model: Any) -> ModelArgs:
        """A Hugging Face text `config.json` (as `ModelArgs.config`) of torchtitan's Qwen3.5
        `Model.Config` `model`: the language model as transformers builds it."""
        layers = list(model.layers)
        attention = next((layer.attention for layer in layers if layer.attention), None)
        delta = next((layer.delta_net for layer in layers if layer.delta_net), None)
        moe = next((layer.moe for layer in layers if layer.moe is not None), None)
        dense = next((layer.feed_forward for layer in layers if layer.feed_forward), None)
        if attention is None or delta is None:
            raise UsageError(
                f"--flavor: this {cls.title} flavor has no "
                f"{'full-attention' if attention is None else 'GatedDeltaNet'} layer",
                fix="Pass the model's config.json with --config.",
            )
        if (moe is None) != (cls.hf_model_type == "qwen3_5_text"):
            raise UsageError(
                f"--flavor: this flavor is {'an MoE' if moe is not None else 'a dense'} "
                f"model, not a {cls.title} one",
                fix="Pass the flavor the run was trained with.",
            )
        rope = attention.rope
        config: dict[str, Any] = {
            "architectures": [cls.hf_architecture],
            "model_type": cls.hf_model_type,
            "vocab_size": model.vocab_size,
            "hidden_size": model.dim,
            "num_hidden_layers": len(layers),
            "num_attention_heads": attention.n_heads,
            "num_key_value_heads": attention.n_kv_heads,
            "head_dim": attention.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": float(model.norm.eps),
            "max_position_embeddings": int(rope.max_seq_len),
            "tie_word_embeddings": False,
            "layer_types": [
                "full_attention" if layer.attention is not None else "linear_attention"
                for layer in layers
            ],
            "linear_conv_kernel_dim": delta.conv_kernel_size,
            "linear_key_head_dim": delta.key_head_dim,
            "linear_value_head_dim": delta.value_head_dim,
            "linear_num_key_heads": delta.in_proj_q.out_features // delta.key_head_dim,
            "linear_num_value_heads": delta.in_proj_v.out_features // delta.value_head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": float(rope.theta),
                "partial_rotary_factor": attention.rotary_dim / attention.head_dim,
                "mrope_section": list(rope.mrope_section),
                "mrope_interleaved": True,
            },
        }
        if dense is not None:
            config["intermediate_size"] = dense.w1.out_features
        if moe is not None:
            shared = moe.shared_experts
            config.update(
                {
                    "num_experts": moe.num_experts,
                    "num_experts_per_tok": moe.router.top_k,
                    "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
                    "shared_expert_intermediate_size": shared.w1.out_features,
                }
            )
        encoder = model.vision_encoder
        if encoder is not None:
            config = {
                "architectures": [cls.hf_vlm_architecture],
                "model_type": cls.hf_vlm_model_type,
                "text_config": config,
                "vision_config": _vision_config(encoder, cls.hf_vlm_model_type),
                "tie_word_embeddings": False,
            }
        return cls.args_from_config(config)


def _vision_config(encoder: Any, model_type: str) -> dict[str, Any]:
    """transformers' `vision_config` of torchtitan's `Qwen35VisionEncoder.Config`."""
    return {
        "model_type": model_type + "_vision",
        "depth": encoder.num_layers,
        "hidden_size": encoder.dim,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": encoder.block.mlp.fc1.out_features,
        "num_heads": encoder.num_heads,
        "in_channels": encoder.in_channels,
        "patch_size": encoder.patch_size,
        "spatial_merge_size": encoder.spatial_merge_size,
        "temporal_patch_size": encoder.temporal_patch_size,
        "out_hidden_size": encoder.merger.fc2.out_features,
        "num_position_embeddings": encoder.num_position_embeddings,
    }


class Qwen3_5(_Qwen35):
    """Qwen3.5 dense: torchtitan's `qwen3_5` dense flavors against transformers'
    `Qwen3_5ForCausalLM`."""

    name = "qwen3.5"
    title = "Qwen3.5"
    hf_model_types = ("qwen3_5_text", "qwen3_5")
    hf_architecture = "Qwen3_5ForCausalLM"
    hf_model_type = "qwen3_5_text"
    hf_vlm_architecture = "Qwen3_5ForConditionalGeneration"
    hf_vlm_model_type = "qwen3_5"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: [
            *_renames((*_COMMON, *_FULL_ATTENTION, *_LINEAR_ATTENTION, *_DENSE_MLP)),
            DeltaNetQKV(_DELTANET_HF, _DELTANET_TT),
            *_VISION_RULES,
        ],
    }


class Qwen3_5Moe(_Qwen35):
    """Qwen3.5-MoE (routed experts and a gated shared expert in every layer): torchtitan's
    `qwen3_5` MoE flavors against transformers' `Qwen3_5MoeForCausalLM`."""

    name = "qwen3.5-moe"
    title = "Qwen3.5-MoE"
    hf_model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    hf_architecture = "Qwen3_5MoeForCausalLM"
    hf_model_type = "qwen3_5_moe_text"
    hf_vlm_architecture = "Qwen3_5MoeForConditionalGeneration"
    hf_vlm_model_type = "qwen3_5_moe"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: [
            *_renames((*_COMMON, *_FULL_ATTENTION, *_LINEAR_ATTENTION, *_MOE)),
            DeltaNetQKV(_DELTANET_HF, _DELTANET_TT),
            *_VISION_RULES,
            FusedExperts(one(_GATE_UP[0]), _GATE_UP[1]),
        ],
    }
    # torchtitan keeps a load-balancing bias per MoE layer (with load_balance_coeff, the
    # default); CheckpointManager.load wants it, so an import writes its fresh-start zeros
    filled: ClassVar[Mapping[str, Sequence[Filled]]] = {
        TITAN: (
            Filled(
                _T + "moe.expert_bias_E",
                like=_ROUTER[1],
                dtype="float32",
                reason="MoE load-balancing bias at its fresh-start value",
            ),
        )
    }
