"""DeepSeek-V3: torchtitan 0.3's `deepseek_v3` names against transformers'
`DeepseekV3ForCausalLM`.

The rules are those of torchtitan 0.3.0's own `DeepSeekV3StateDictAdapter`
(`torchtitan/models/deepseek_v3/state_dict_adapter.py`), stated declaratively:

- Multi-head latent attention (MLA): the query is one projection (`wq` / `q_proj`, when
  `q_lora_rank` is 0 / null) or a low-rank pair with a norm between (`wq_a`, `q_norm`, `wq_b` /
  `q_a_proj`, `q_a_layernorm`, `q_b_proj`); keys and values come from one down-projection
  whose last `qk_rope_head_dim` rows are the shared rotary key (`wkv_a` /
  `kv_a_proj_with_mqa`), a norm (`kv_norm` / `kv_a_layernorm`) and an up-projection (`wkv_b` /
  `kv_b_proj`). Both sides keep the rotary rows interleaved (torchtitan's complex RoPE;
  transformers' `rope_interleave: true`, the default), so every tensor is a plain rename.
- The first `first_k_dense_replace` layers hold a dense SwiGLU MLP; the others an MoE: a
  sigmoid router (`gate.weight`) whose top-k choice is shifted by a per-expert bias
  (torchtitan's load-balancing `expert_bias_E` is transformers' `e_score_correction_bias`:
  mapped, never dropped), routed experts (stacked `[E, ...]` natively, one tensor per expert
  in Hugging Face's files) and shared experts (one SwiGLU MLP of
  `moe_intermediate_size x n_shared_experts`).
- torchtitan's multi-token-prediction layers (`mtp_layers.*`, a training-time head) have no
  module in transformers' `DeepseekV3ForCausalLM`: an export leaves them out, listed.

A torchtitan save holds no config, and this family's config (MLA ranks, router groups and
scaling, yarn rotary) is not rebuilt from the weights: `--config` gives it (checked against
every shape here), or `--flavor` builds it from torchtitan's own model registry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..errors import UsageError
from .base import (
    HF,
    Architecture,
    ArchitecturePlan,
    Experts,
    Filled,
    Ignored,
    ModelArgs,
    Rename,
    TensorRule,
    one,
)

TITAN = "torchtitan"

_HF = "model.layers.{layer}."
_TT = "layers.{layer}."

#: tensors every layer (or the model) holds, as (HF pattern, torchtitan pattern)
_COMMON = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    (_HF + "self_attn.kv_a_proj_with_mqa.weight", _TT + "attention.wkv_a.weight"),
    (_HF + "self_attn.kv_a_layernorm.weight", _TT + "attention.kv_norm.weight"),
    (_HF + "self_attn.kv_b_proj.weight", _TT + "attention.wkv_b.weight"),
    (_HF + "self_attn.o_proj.weight", _TT + "attention.wo.weight"),
    (_HF + "input_layernorm.weight", _TT + "attention_norm.weight"),
    (_HF + "post_attention_layernorm.weight", _TT + "ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
#: the query as one projection (`q_lora_rank` 0 / null)...
_Q_FULL = ((_HF + "self_attn.q_proj.weight", _TT + "attention.wq.weight"),)
#: ... or as a low-rank pair with a norm between
_Q_LORA = (
    (_HF + "self_attn.q_a_proj.weight", _TT + "attention.wq_a.weight"),
    (_HF + "self_attn.q_a_layernorm.weight", _TT + "attention.q_norm.weight"),
    (_HF + "self_attn.q_b_proj.weight", _TT + "attention.wq_b.weight"),
)
_DENSE_MLP = (
    (_HF + "mlp.gate_proj.weight", _TT + "feed_forward.w1.weight"),
    (_HF + "mlp.up_proj.weight", _TT + "feed_forward.w3.weight"),
    (_HF + "mlp.down_proj.weight", _TT + "feed_forward.w2.weight"),
)
_ROUTER = (_HF + "mlp.gate.weight", _TT + "moe.router.gate.weight")
_BIAS = (_HF + "mlp.gate.e_score_correction_bias", _TT + "moe.expert_bias_E")
_SHARED = (
    (_HF + "mlp.shared_experts.gate_proj.weight", _TT + "moe.shared_experts.w1.weight"),
    (_HF + "mlp.shared_experts.up_proj.weight", _TT + "moe.shared_experts.w3.weight"),
    (_HF + "mlp.shared_experts.down_proj.weight", _TT + "moe.shared_experts.w2.weight"),
)
_EXPERTS = (
    (_HF + "mlp.experts.{expert}.gate_proj.weight", _TT + "moe.routed_experts.inner_experts.w1_EFD"),
    (_HF + "mlp.experts.{expert}.up_proj.weight", _TT + "moe.routed_experts.inner_experts.w3_EFD"),
    (_HF + "mlp.experts.{expert}.down_proj.weight", _TT + "moe.routed_experts.inner_experts.w2_EDF"),
)  # fmt: skip
_MOE = (_ROUTER, _BIAS, *_SHARED)
#: what only a multi-token-prediction layer holds in Hugging Face's files (DeepSeek's own
#: checkpoints save their MTP module as the layer after the last, `model.layers.61`)
_HF_MTP = tuple(
    _HF + name
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
    )
)
#: why a multi-token-prediction layer is left out
_MTP_REASON = (
    "multi-token prediction layer (a training-time head transformers' DeepseekV3ForCausalLM "
    "has no module for)"
)

#: transformers' `DeepseekV3Config` defaults, for the keys a config.json leaves out (what
#: `from_pretrained` builds the model with)
CONFIG_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
}


def _renames(pairs: Sequence[tuple[str, str]]) -> list[TensorRule]:
    return [Rename(one(hf), one(native)) for hf, native in pairs]


def _layers_holding(shapes: Mapping[str, Sequence[int]], pattern: str) -> set[int]:
    """The layers with a tensor named by `pattern` (a `{layer}` pattern)."""
    regex = re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)") + r"\Z")
    return {int(m.group(1)) for name in shapes if (m := regex.match(name))}


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _in_layers(name: str, layers: set[int]) -> bool:
    """Whether Hugging Face name `name` is a tensor of one of `layers`."""
    m = _HF_LAYER.match(name)
    return m is not None and int(m.group(1)) in layers


def _mtp_layers(names: Sequence[str]) -> set[int]:
    """The layers of Hugging Face names that are multi-token-prediction modules."""
    return _layers_holding(dict.fromkeys(names, ()), _HF_MTP[2])


class DeepseekV3(Architecture):
    """DeepSeek-V3 (MLA attention, sigmoid-routed MoE with shared experts after dense first
    layers): torchtitan's `deepseek_v3` against transformers' `DeepseekV3ForCausalLM`."""

    name = "deepseek-v3"
    title = "DeepSeek-V3"
    hf_model_types = ("deepseek_v3",)
    activations = ("silu", "swish")
    torchtitan_models = "torchtitan.models.deepseek_v3"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: [
            *_renames((*_COMMON, *_Q_FULL, *_Q_LORA, *_DENSE_MLP, *_MOE)),
            *(Experts(one(hf), one(native)) for hf, native in _EXPERTS),
        ],
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: (
            Ignored(_HF + "self_attn.rotary_emb.inv_freq", "rotary table (rebuilt)"),
            Ignored("model.rotary_emb.inv_freq", "rotary table (rebuilt)"),
            *(Ignored(pattern, _MTP_REASON) for pattern in _HF_MTP),
        ),
        TITAN: (
            Ignored("freqs_cis", "rotary table (rebuilt)"),
            Ignored(_TT + "attention.rope.cache", "rotary table (rebuilt)"),
            Ignored(_TT + "moe.tokens_per_expert_E", "MoE load-balancing counter (training)"),
            Ignored("mtp_layers.", _MTP_REASON, prefix=True),
        ),
    }
    markers: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (_COMMON[1][0],),
        TITAN: (_COMMON[1][1],),
    }
    tied: ClassVar[Mapping[str, tuple[str, str]]] = {
        HF: (_COMMON[0][0], _COMMON[-1][0]),
        TITAN: (_COMMON[0][1], _COMMON[-1][1]),
    }
    # each layer's query is one projection or a low-rank pair; its MLP dense (the first
    # `first_k_dense_replace` layers) or an MoE; a torchtitan MoE built without
    # load-balancing (`load_balance_coeff` None) holds no expert bias
    optional: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: tuple(hf for hf, _ in (*_Q_FULL, *_Q_LORA, *_DENSE_MLP, *_MOE, *_EXPERTS)),
        TITAN: tuple(tt for _, tt in (*_Q_FULL, *_Q_LORA, *_DENSE_MLP, *_MOE, *_EXPERTS)),
    }
    # ... so each layer holds one whole query variant and one whole MLP variant
    layer_variants: ClassVar[Sequence[Sequence[str]]] = tuple(
        (*(hf for hf, _ in q), *mlp)
        for q in (_Q_FULL, _Q_LORA)
        for mlp in (
            tuple(hf for hf, _ in _DENSE_MLP),
            tuple(hf for hf, _ in (*_MOE, *_EXPERTS)),
        )
    )
    # the router bias shifts the top-k choice by small amounts: DeepSeek's checkpoints,
    # transformers (`_keep_in_fp32_modules_strict`) and torchtitan (a float32 buffer) keep
    # it in float32 beside bf16 weights; transformers (5) keeps the router's gate so too, so
    # an HF output keeps it as stored (`convert --dtype` of an HF folder does the same)
    float32: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (_BIAS[0], _ROUTER[0]),
        TITAN: (_BIAS[1],),
    }
    # transformers' router always holds its correction bias; an export of a torchtitan MoE
    # without one writes the zeros it would route by (the same model)
    filled: ClassVar[Mapping[str, Sequence[Filled]]] = {
        HF: (
            Filled(
                _BIAS[0],
                like=_ROUTER[0],
                dtype="float32",
                reason="router correction bias at its neutral value",
            ),
        )
    }

    @classmethod
    def plan(
        cls,
        entries: Sequence[tuple[str, Sequence[int], str]],
        source: str,
        target: str,
        args: ModelArgs,
    ) -> ArchitecturePlan:
        """The family's plan, leaving a Hugging Face source's multi-token-prediction layers
        out whole (the layers holding `eh_proj`: DeepSeek's checkpoints save the module as
        `model.layers.61`, beside the 61 layers transformers builds, which ignores it)."""
        mtp = _mtp_layers([name for name, _, _ in entries]) if source == HF else set()
        if not mtp or source == target:
            return super().plan(entries, source, target, args)
        kept = [entry for entry in entries if not _in_layers(entry[0], mtp)]
        dropped = [entry for entry in entries if _in_layers(entry[0], mtp)]
        plan = super().plan(kept, source, target, args)
        plan.left_out += [(name, _MTP_REASON) for name, _, _ in dropped]
        return plan

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        def pick(pair: tuple[str, str]) -> str:
            return pair[0] if naming == HF else pair[1]

        if naming == HF:  # the model's layers, not the MTP module saved after them
            mtp = _mtp_layers(list(shapes))
            shapes = {n: s for n, s in shapes.items() if not _in_layers(n, mtp)}

        embed = shapes.get(pick(_COMMON[0]))
        layers = _layers_holding(shapes, pick(_COMMON[5]))  # every layer has a pre-norm
        moe_layers = sorted(_layers_holding(shapes, pick(_ROUTER)))
        router = shapes.get(pick(_ROUTER).format(layer=moe_layers[0])) if moe_layers else None
        dense_layers = sorted(_layers_holding(shapes, pick(_DENSE_MLP[0])))
        dense = (
            shapes.get(pick(_DENSE_MLP[0]).format(layer=dense_layers[0])) if dense_layers else None
        )
        moe_ffn = None
        if moe_layers:
            layer = moe_layers[0]
            stacked = shapes.get(_EXPERTS[0][1].format(layer=layer))
            per = shapes.get(_EXPERTS[0][0].format(layer=layer, expert=0))
            moe_ffn = stacked[1] if stacked else per[0] if per else None
        return ModelArgs(
            dim=embed[1] if embed else None,
            vocab_size=embed[0] if embed else None,
            n_layers=max(layers) + 1 if layers else None,
            ffn_dim=dense[0] if dense else None,
            num_experts=router[0] if router else None,
            moe_ffn_dim=moe_ffn,
            tie_embeddings=True if embed and shapes.get(pick(_COMMON[-1])) is None else None,
        )

    @classmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        def get(key: str) -> Any:
            return config.get(key, CONFIG_DEFAULTS.get(key))

        heads = get("num_attention_heads")
        return ModelArgs(
            dim=config.get("hidden_size"),
            n_layers=config.get("num_hidden_layers"),
            n_heads=heads,
            vocab_size=config.get("vocab_size"),
            ffn_dim=get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps"),
            max_position_embeddings=config.get("max_position_embeddings"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=get("n_routed_experts"),
            experts_per_token=config.get("num_experts_per_tok"),
            moe_ffn_dim=get("moe_intermediate_size"),
            norm_topk_prob=config.get("norm_topk_prob"),
            config=dict(config),
        )

    @classmethod
    def config_conflicts(cls, config: Mapping[str, Any]) -> list[str]:
        # the rules map weights only: DeepseekV3Attention builds q_a / kv_a / o biases with
        # attention_bias; and its rotary reads interleaved rows only with rope_interleave
        out = []
        if config.get("attention_bias") not in (None, False):
            out.append(f"attention_bias: {json.dumps(config['attention_bias'])}")
        if config.get("rope_interleave", True) is not True:
            out.append(f"rope_interleave: {json.dumps(config.get('rope_interleave'))}")
        return out

    @classmethod
    def shape_conflicts(
        cls, shapes: Mapping[str, Sequence[int]], naming: str, args: ModelArgs
    ) -> list[str]:
        if args.config is None:
            return []
        config = args.config
        side = 0 if naming == HF else 1

        def get(key: str) -> int | None:
            value = config.get(key, CONFIG_DEFAULTS.get(key))
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        def said(*keys: str) -> str:
            return ", ".join(f"{key}={json.dumps(get(key))}" for key in keys)

        def total(*parts: int | None, times: int | None = 1) -> int | None:
            if times is None or any(p is None for p in parts):
                return None
            return times * sum(p for p in parts if p is not None)

        out: list[str] = []

        def check(pair: tuple[str, str], layer: int, axis: int, want: int | None, why: str) -> None:
            name = pair[side].format(layer=layer, expert=0)
            shape = shapes.get(name)
            if want is None or shape is None or len(shape) <= axis or shape[axis] == want:
                return
            where = "rows" if axis == 0 else "columns" if len(shape) == 2 else f"in dim {axis}"
            out.append(f"{name} has {shape[axis]} {where}, where {why} = {want}")

        heads, q_lora, kv_lora = (
            get(k) for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank")
        )
        rope, nope, v = (get(k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
        for layer in sorted(_layers_holding(shapes, _COMMON[5][side]))[:1]:
            check(
                _COMMON[1],
                layer,
                0,
                total(kv_lora, rope),
                said("kv_lora_rank") + " + " + said("qk_rope_head_dim"),
            )
            check(_COMMON[2], layer, 0, kv_lora, "kv_lora_rank")
            check(_COMMON[3], layer, 1, kv_lora, "kv_lora_rank")
            check(
                _COMMON[3],
                layer,
                0,
                total(nope, v, times=heads),
                f"{said('num_attention_heads')} x ({said('qk_nope_head_dim')} + {said('v_head_dim')})",
            )
            check(
                _COMMON[4],
                layer,
                1,
                total(v, times=heads),
                f"{said('num_attention_heads')} x {said('v_head_dim')}",
            )
            query = f"{said('num_attention_heads')} x ({said('qk_nope_head_dim')} + {said('qk_rope_head_dim')})"
            check(_Q_FULL[0], layer, 0, total(nope, rope, times=heads), query)
            check(_Q_LORA[2], layer, 0, total(nope, rope, times=heads), query)
            check(_Q_LORA[0], layer, 0, q_lora, "q_lora_rank")
        # a low-rank query with q_lora_rank set, one projection with it null (or 0)
        full = sorted(_layers_holding(shapes, _Q_FULL[0][side]))
        lora = sorted(_layers_holding(shapes, _Q_LORA[0][side]))
        if q_lora and full:
            out.append(
                f"{_Q_FULL[0][side].format(layer=full[0])} is one query projection, where "
                f"q_lora_rank={q_lora} builds a low-rank pair (q_lora_rank: null builds one)"
            )
        if not q_lora and lora:
            out.append(
                f"{_Q_LORA[0][side].format(layer=lora[0])} is a low-rank query projection, where "
                f"q_lora_rank={json.dumps(config.get('q_lora_rank'))} builds one q_proj"
            )
        dense = sorted(_layers_holding(shapes, _DENSE_MLP[0][side]))
        moe = sorted(_layers_holding(shapes, _ROUTER[side]))
        for layer in dense[:1]:
            check(_DENSE_MLP[0], layer, 0, get("intermediate_size"), "intermediate_size")
        moe_ffn = get("moe_intermediate_size")
        for layer in moe[:1]:
            shared = total(moe_ffn, times=get("n_shared_experts"))
            check(
                _SHARED[0],
                layer,
                0,
                shared,
                said("moe_intermediate_size") + " x " + said("n_shared_experts"),
            )
            if naming == HF:  # one expert's gate rows; the stack's F natively
                check((_EXPERTS[0][0], ""), layer, 0, moe_ffn, "moe_intermediate_size")
            else:
                check(("", _EXPERTS[0][1]), layer, 1, moe_ffn, "moe_intermediate_size")
        first_moe = get("first_k_dense_replace")
        wrong = [n for n in dense if first_moe is not None and n >= first_moe]
        wrong += [n for n in moe if first_moe is not None and n < first_moe]
        if first_moe is not None and wrong:
            # transformers builds a dense MLP in the layers before it, an MoE from it on
            layer = min(wrong)
            kind = "a dense MLP" if layer in dense else "an MoE"
            rule = (
                f"layers 0-{first_moe - 1} dense and the rest MoE"
                if first_moe
                else "every layer MoE"
            )
            out.append(
                f"layer {layer} holds {kind}, where first_k_dense_replace={first_moe} makes {rule}"
            )
        return out

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        # DeepSeek-V3's config (MLA ranks, router groups and scaling, yarn rotary) is not
        # rebuilt from the weights: the source's own config.json, --config or --flavor says it
        config: dict[str, Any] = dict(
            args.require("config", cls.title, "MLA ranks, router and rotary settings")
        )
        return config

    @classmethod
    def args_from_torchtitan(cls, model: Any) -> ModelArgs:
        """A Hugging Face `config.json` (as `ModelArgs.config`) of torchtitan's DeepSeek-V3
        `Model.Config` `model`: the same model as transformers builds it."""
        layers = list(model.layers)
        attention = layers[0].attention
        rope = attention.rope
        moe_layer = next((layer for layer in layers if layer.moe is not None), None)
        if moe_layer is None:
            raise UsageError(
                f"--flavor: this {cls.title} flavor has no MoE layer, which transformers' "
                "DeepseekV3ForCausalLM always builds",
                fix="Pass the model's config.json with --config.",
            )
        moe = moe_layer.moe
        router = moe.router
        if router.score_func != "sigmoid":
            raise UsageError(
                f"--flavor: this {cls.title} flavor routes by {router.score_func}, and "
                "transformers' DeepseekV3 router by sigmoid only: it would be another model",
                fix="Convert with --to safetensors / dcp to keep torchtitan's names.",
            )
        dense = next((layer.feed_forward for layer in layers if layer.feed_forward), None)
        first_moe = layers.index(moe_layer)
        moe_ffn = moe.routed_experts.inner_experts.hidden_dim
        shared = moe.shared_experts
        config: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": model.vocab_size,
            "hidden_size": model.dim,
            "intermediate_size": dense.w1.out_features if dense is not None else moe_ffn,
            "moe_intermediate_size": moe_ffn,
            "num_hidden_layers": len(layers),
            "num_attention_heads": attention.n_heads,
            "num_key_value_heads": attention.n_heads,
            "n_shared_experts": shared.w1.out_features // moe_ffn if shared is not None else 0,
            "n_routed_experts": moe.num_experts,
            "routed_scaling_factor": float(router.route_scale),
            "kv_lora_rank": attention.kv_lora_rank,
            "q_lora_rank": attention.q_lora_rank or None,
            "qk_rope_head_dim": attention.qk_rope_head_dim,
            "qk_nope_head_dim": attention.qk_nope_head_dim,
            "v_head_dim": attention.v_head_dim,
            "head_dim": attention.qk_rope_head_dim,
            "n_group": router.num_expert_groups or 1,
            "topk_group": router.num_limited_groups or 1,
            "num_experts_per_tok": router.top_k,
            "first_k_dense_replace": first_moe,
            "norm_topk_prob": bool(router.route_norm),
            "hidden_act": "silu",
            "max_position_embeddings": int(rope.max_seq_len),
            "rms_norm_eps": float(model.norm.eps),
            "rope_interleave": True,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope.theta)}
        if rope.scaling == "yarn" and rope.rope_factor > 1.0:
            # torchtitan scales the softmax by its mscale squared (DeepSeek's own code), as
            # transformers does with mscale == mscale_all_dim
            rope_parameters = {
                "rope_type": "yarn",
                "rope_theta": float(rope.theta),
                "factor": float(rope.rope_factor),
                "beta_fast": float(rope.beta_fast),
                "beta_slow": float(rope.beta_slow),
                "mscale": float(attention.mscale),
                "mscale_all_dim": float(attention.mscale),
                "original_max_position_embeddings": int(rope.original_seq_len),
            }
        elif rope.scaling not in ("none", "yarn"):
            raise UsageError(
                f"--flavor: this {cls.title} flavor uses {rope.scaling} rotary scaling, "
                "which transformers' DeepseekV3 does not build",
                fix="Pass the model's config.json with --config.",
            )
        config["rope_parameters"] = rope_parameters
        config["rope_theta"] = float(rope.theta)
        if rope_parameters["rope_type"] != "default":
            legacy = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
            config["rope_scaling"] = {"type": legacy["rope_type"], **legacy}
        return cls.args_from_config(config)
