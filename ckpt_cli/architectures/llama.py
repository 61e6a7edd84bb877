"""Llama 3 and Qwen3 (dense and MoE): Hugging Face names against torchtitan 0.3's (and
Qwen2 and Mixtral, which torchtitan has not, against llama.cpp's GGUF names only).

The rules are those of torchtitan 0.3.0's own `Llama3StateDictAdapter` and
`Qwen3StateDictAdapter` (`torchtitan/models/{llama3,qwen3}/state_dict_adapter.py`), stated
declaratively: torchtitan's llama3 keeps q/k rows in the interleaved (complex RoPE) layout, so
they are permuted per head on the way (`RotaryPermute`); Qwen3 uses the halves layout on both
sides (plain renames) and adds per-head q/k RMSNorms; Qwen3-MoE stacks each layer's experts as
`[E, F, D]` / `[E, D, F]` tensors natively and stores them one per expert in Hugging Face
files. Each output is built from its own source tensor (or a box of it), one at a time.

Llama 3 also maps to Megatron-Core's GPT names (`architectures.megatron`): a GPTModel built
Llama-style is a `LlamaForCausalLM` with fused QKV and gate/up projections.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from . import gguf
from .base import (
    HF,
    Architecture,
    Experts,
    Filled,
    Ignored,
    ModelArgs,
    NamingOutput,
    Rename,
    RotaryPermute,
    TensorRule,
    one,
)
from .megatron import LLAMA_STYLE, MEGATRON, MEGATRON_IGNORED, MegatronStyle
from .megatron import args_from_checkpoint as megatron_args_from_checkpoint
from .megatron import args_from_shapes as megatron_args_from_shapes
from .megatron import naming_output as megatron_output

if TYPE_CHECKING:
    from ..formats.base import Checkpoint

TITAN = "torchtitan"
GGUF = gguf.GGUF

#: the tensors every decoder family here shares, as (HF pattern, torchtitan pattern)
_COMMON = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    (
        "model.layers.{layer}.self_attn.v_proj.weight",
        "layers.{layer}.attention.qkv_linear.wv.weight",
    ),
    ("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.attention.wo.weight"),
    ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attention_norm.weight"),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
_DENSE_MLP = (
    ("model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.feed_forward.w1.weight"),
    ("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.feed_forward.w3.weight"),
    ("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.feed_forward.w2.weight"),
)
_Q = (
    "model.layers.{layer}.self_attn.q_proj.weight",
    "layers.{layer}.attention.qkv_linear.wq.weight",
)
_K = (
    "model.layers.{layer}.self_attn.k_proj.weight",
    "layers.{layer}.attention.qkv_linear.wk.weight",
)
_QK_NORMS = (
    ("model.layers.{layer}.self_attn.q_norm.weight", "layers.{layer}.attention.q_norm.weight"),
    ("model.layers.{layer}.self_attn.k_norm.weight", "layers.{layer}.attention.k_norm.weight"),
)
_MOE_EXPERTS = (
    ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
     "layers.{layer}.moe.routed_experts.inner_experts.w1_EFD"),
    ("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
     "layers.{layer}.moe.routed_experts.inner_experts.w3_EFD"),
    ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
     "layers.{layer}.moe.routed_experts.inner_experts.w2_EDF"),
)  # fmt: skip
_ROUTER = (("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.moe.router.gate.weight"),)

_HF_IGNORED = (
    Ignored("model.layers.{layer}.self_attn.rotary_emb.inv_freq", "rotary table (rebuilt)"),
    Ignored("model.rotary_emb.inv_freq", "rotary table (rebuilt)"),
)
_TITAN_IGNORED = (
    Ignored("freqs_cis", "rotary table (rebuilt)"),
    Ignored("rope.cache", "rotary table (rebuilt)"),
    Ignored("layers.{layer}.attention.rope.cache", "rotary table (rebuilt)"),
    # torchtitan's own to_hf drops these too: transformers' Qwen3-MoE router has no bias.
    # The bias routes tokens (torchtitan adds it to the scores it picks the top-k by), so
    # a trained, non-zero one dropped changes the model: the caller checks it is zero
    Ignored(
        "layers.{layer}.moe.expert_bias_E",
        "MoE load-balancing bias (no HF counterpart)",
        computes=True,
    ),
    Ignored("layers.{layer}.moe.tokens_per_expert_E", "MoE load-balancing counter (training)"),
)


#: Hugging Face model types named like a Llama whose attention builds q/k/v biases with no
#: `attention_bias` in their config.json -> the key that turns them off (None: none does):
#: transformers' Qwen2Attention always builds them (`bias=True`); Qwen2-MoE's `qkv_bias`
#: defaults to true. The rules map no bias, so a model without them is not that model.
_QKV_BIAS_TYPES: dict[str, str | None] = {"qwen2": None, "qwen2_moe": "qkv_bias"}


def _renames(pairs: Sequence[tuple[str, str]]) -> list[TensorRule]:
    return [Rename(one(hf), one(native)) for hf, native in pairs]


def _count_layers(shapes: Mapping[str, Sequence[int]], naming: str) -> int | None:
    import re

    pattern = re.compile(r"(?:model\.)?layers\.(\d+)\." if naming == HF else r"layers\.(\d+)\.")
    layers = {int(m.group(1)) for n in shapes if (m := pattern.match(n))}
    return max(layers) + 1 if layers else None


def _rope_from_config(config: Mapping[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4 (`rope_theta`, `rope_scaling`) or 5
    (`rope_parameters`) config."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta"))
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling = rest if rest.get("rope_type", "default") != "default" else None
        return theta, scaling
    scaling = config.get("rope_scaling")
    # the number is judged as ModelArgs takes it (`Architecture.config_args` names a bad one)
    return config.get("rope_theta"), (dict(scaling) if isinstance(scaling, dict) else None)


class _Decoder(Architecture):
    """What Llama 3 and Qwen3 share: shapes -> args, config.json <-> args."""

    tied: ClassVar[Mapping[str, tuple[str, str]]] = {
        HF: (_COMMON[0][0], _COMMON[-1][0]),
        TITAN: (_COMMON[0][1], _COMMON[-1][1]),
        GGUF: ("token_embd.weight", "output.weight"),
    }
    # Megatron shares the embedding with the output (share_embeddings_and_output_weights)
    # by leaving `output_layer.weight` out
    optional: ClassVar[Mapping[str, Sequence[str]]] = {MEGATRON: ("output_layer.weight",)}
    activations: ClassVar[tuple[str, ...]] = ("silu", "swish")

    hf_architecture: ClassVar[str]
    hf_model_type: ClassVar[str]
    #: what a Megatron-Core GPTModel of the family holds beyond the Llama style
    megatron_style: ClassVar[MegatronStyle] = LLAMA_STYLE

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        if naming == MEGATRON:
            return megatron_args_from_shapes(shapes)
        if naming == GGUF:
            return cls.args_from_shapes(gguf.to_hf_names(shapes), HF)

        def shape(hf: str, native: str) -> Sequence[int] | None:
            return shapes.get(hf if naming == HF else native)

        def layer0(hf: str, native: str) -> Sequence[int] | None:
            return shape(hf.format(layer=0, expert=0), native.format(layer=0, expert=0))

        embed = shape(*_COMMON[0])
        q, k = layer0(*_Q), layer0(*_K)
        q_norm = layer0(*_QK_NORMS[0])
        gate = layer0(*_DENSE_MLP[0])
        head_dim = q_norm[0] if q_norm else None
        values: dict[str, Any] = {
            "dim": embed[1] if embed else None,
            "vocab_size": embed[0] if embed else None,
            "n_layers": _count_layers(shapes, naming),
            "ffn_dim": gate[0] if gate else None,
            "head_dim": head_dim,
            # a saved lm_head may still be the embedding's twin (torchtitan saves both names):
            # only config.json tells; an absent one is tied for sure
            "tie_embeddings": True if embed and shape(*_COMMON[-1]) is None else None,
        }
        if head_dim and q and k:
            values["n_heads"] = q[0] // head_dim
            values["n_kv_heads"] = k[0] // head_dim
        experts = shapes.get(
            "model.layers.0.mlp.gate.weight" if naming == HF else "layers.0.moe.router.gate.weight"
        )
        if experts:
            values["num_experts"] = experts[0]
            stacked = shapes.get(_MOE_EXPERTS[0][1].format(layer=0))
            per = shapes.get(_MOE_EXPERTS[0][0].format(layer=0, expert=0))
            values["moe_ffn_dim"] = stacked[1] if stacked else per[0] if per else None
        return ModelArgs(**values)

    @classmethod
    def shape_conflicts(
        cls, shapes: Mapping[str, Sequence[int]], naming: str, args: ModelArgs
    ) -> list[str]:
        if naming == GGUF:
            return cls.shape_conflicts(gguf.to_hf_names(shapes), HF, args)
        if naming not in (HF, TITAN):  # Megatron's fused tensors: its args come with it
            return []
        heads, dim = args.n_heads, args.dim
        kv_heads = args.n_kv_heads or heads
        head_dim = args.head_dim or (dim // heads if dim and heads else None)
        out: list[str] = []

        def check(pair: tuple[str, str], axis: int, want: int | None, why: str) -> None:
            name = (pair[0] if naming == HF else pair[1]).format(layer=0, expert=0)
            shape = shapes.get(name)
            if want is None or shape is None or len(shape) <= axis or shape[axis] == want:
                return
            side = "rows" if axis == 0 else "columns" if len(shape) == 2 else f"in dim {axis}"
            out.append(f"{name} has {shape[axis]} {side}, where {why} = {want}")

        if heads and head_dim:
            why = f"num_attention_heads={heads} x head_dim={head_dim}"
            check(_Q, 0, heads * head_dim, why)
            check(_COMMON[2], 1, heads * head_dim, why)  # o_proj / wo
        if kv_heads and head_dim:
            why = f"num_key_value_heads={kv_heads} x head_dim={head_dim}"
            check(_K, 0, kv_heads * head_dim, why)
            check(_COMMON[1], 0, kv_heads * head_dim, why)  # v_proj / wv
        check(_QK_NORMS[0], 0, head_dim, "head_dim")
        check(_DENSE_MLP[0], 0, args.ffn_dim, "intermediate_size")
        if args.moe_ffn_dim is not None:  # one expert's gate rows (HF), the stack's F (torchtitan)
            check((_MOE_EXPERTS[0][0], ""), 0, args.moe_ffn_dim, "moe_intermediate_size")
            check(("", _MOE_EXPERTS[0][1]), 1, args.moe_ffn_dim, "moe_intermediate_size")
        return out

    @classmethod
    def args_from_source(cls, checkpoint: Checkpoint, naming: str) -> ModelArgs:
        if naming == MEGATRON:
            return megatron_args_from_checkpoint(checkpoint, cls.megatron_style)
        if naming == GGUF:
            args = gguf.args_from_metadata(checkpoint, cls.name, cls.title)
            # the metadata is the file's config.json: held against the tensors as one is
            shapes = {e.name: e.shape for e in checkpoint.manifest.entries if e.kind == "tensor"}
            found = cls.args_from_shapes(shapes, GGUF)
            gguf.refuse_misfit(checkpoint, args, found, cls.shape_conflicts(shapes, GGUF, args))
            # llama.cpp writes no output.weight for a tied model: the file's own tensors tell,
            # not those a --filter-out left
            return args.model_copy(update={"tie_embeddings": bool(found.tie_embeddings)})
        return ModelArgs()

    @classmethod
    def naming_output(cls, naming: str, args: ModelArgs) -> NamingOutput:
        if naming == MEGATRON:
            return megatron_output(args, cls.title, cls.megatron_style)
        return NamingOutput()

    @classmethod
    def config_conflicts(cls, config: Mapping[str, Any]) -> list[str]:
        # the rules map weights only: LlamaForCausalLM builds a bias on every attention
        # projection (attention_bias) or MLP projection (mlp_bias) when its config says so
        out = [
            f"{key}: {json.dumps(config[key])}"
            for key in ("attention_bias", "mlp_bias")
            if config.get(key) not in (None, False)
        ]
        model_type = config.get("model_type")
        if isinstance(model_type, str) and model_type in _QKV_BIAS_TYPES:
            switch = _QKV_BIAS_TYPES[model_type]
            if switch is None or config.get(switch, True) is not False:
                said = (
                    "whose q/k/v projections always have biases"
                    if switch is None
                    else f"whose q/k/v projections have biases unless {switch} is false"
                )
                out.append(f"model_type: {json.dumps(model_type)} ({said})")
        return out

    @classmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        theta, scaling = _rope_from_config(config)
        heads = config.get("num_attention_heads")
        dim = config.get("hidden_size")
        head_dim = config.get("head_dim") or (dim // heads if dim and heads else None)
        return ModelArgs(
            dim=dim,
            n_layers=config.get("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=config.get("vocab_size"),
            ffn_dim=config.get("intermediate_size"),
            norm_eps=config.get("rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings"),
            # transformers builds an untied lm_head when config.json leaves the key out
            # (the default of LlamaConfig, Qwen3Config, Qwen3MoeConfig, MistralConfig)
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=config.get("num_experts") or config.get("num_local_experts"),
            experts_per_token=config.get("num_experts_per_tok"),
            moe_ffn_dim=config.get("moe_intermediate_size"),
            norm_topk_prob=config.get("norm_topk_prob"),
            config=dict(config),
        )

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        if args.config is not None:
            return dict(args.config)
        need = {
            f: args.require(f, cls.title, "config.json names it")
            for f in ("dim", "n_layers", "n_heads", "vocab_size", "norm_eps", "rope_theta")
        }
        head_dim = args.head_dim or need["dim"] // need["n_heads"]
        rope: dict[str, Any] = {"rope_theta": need["rope_theta"], "rope_type": "default"}
        if args.rope_scaling:
            rope = {**args.rope_scaling, "rope_theta": need["rope_theta"]}
        config: dict[str, Any] = {
            "architectures": [cls.hf_architecture],
            "model_type": cls.hf_model_type,
            "hidden_size": need["dim"],
            "num_hidden_layers": need["n_layers"],
            "num_attention_heads": need["n_heads"],
            "num_key_value_heads": args.n_kv_heads or need["n_heads"],
            "head_dim": head_dim,
            "vocab_size": need["vocab_size"],
            "rms_norm_eps": need["norm_eps"],
            "rope_theta": need["rope_theta"],
            "rope_parameters": rope,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": bool(args.tie_embeddings),
        }
        if args.ffn_dim is not None:
            config["intermediate_size"] = args.ffn_dim
        if args.max_position_embeddings is not None:
            config["max_position_embeddings"] = args.max_position_embeddings
        if args.rope_scaling:
            # transformers 4 and llama.cpp's converter read the scaling from the legacy key
            # beside `rope_theta`, and without it run the model unscaled: the same values
            config["rope_scaling"] = _legacy_rope_scaling(args.rope_scaling)
        if args.bos_token_id is not None:
            config["bos_token_id"] = args.bos_token_id
        if args.eos_token_id is not None:
            config["eos_token_id"] = args.eos_token_id
        if args.dtype is not None:
            config["torch_dtype"] = args.dtype  # canonical tokens are torch's names
        return config


def _legacy_rope_scaling(scaling: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 4's `rope_scaling` of a rope scaling: `rope_type` first (named `type`
    before transformers 4.43), the scaling's own fields, no `rope_theta` (a key of its own)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    rest = {k: v for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")}
    return {"rope_type": kind, **rest}


class Llama3(_Decoder):
    """Llama 3 (dense, GQA): torchtitan's `llama3` against transformers' `LlamaForCausalLM`."""

    name = "llama3"
    title = "Llama 3"
    hf_model_types = ("llama",)
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"
    torchtitan_models = "torchtitan.models.llama3"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: [
            *_renames(_COMMON),
            RotaryPermute(one(_Q[0]), one(_Q[1]), heads="n_heads"),
            RotaryPermute(one(_K[0]), one(_K[1]), heads="n_kv_heads"),
            *_renames(_DENSE_MLP),
        ],
        # Megatron-Core's GPTModel built Llama-style (RMSNorm, SwiGLU, GQA, rotary, no bias)
        MEGATRON: LLAMA_STYLE.rules,
        # llama.cpp's names; its converter permutes q/k into the interleaved layout too
        GGUF: [
            *_renames(gguf.RENAMES),
            RotaryPermute(one(gguf.Q[0]), one(gguf.Q[1]), heads="n_heads"),
            RotaryPermute(one(gguf.K[0]), one(gguf.K[1]), heads="n_kv_heads"),
        ],
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: _HF_IGNORED,
        TITAN: _TITAN_IGNORED,
        MEGATRON: MEGATRON_IGNORED,
        GGUF: (Ignored(gguf.ROPE_FREQS, "rotary frequency factors (config.json's rope_scaling)"),),
    }


class Mixtral(_Decoder):
    """Mixtral (a Llama whose MLP is a router and experts): llama.cpp's `llama` GGUF names of
    it (q/k permuted, experts stacked per layer) against transformers' `MixtralForCausalLM`
    (one tensor per expert, `block_sparse_moe`). torchtitan has no Mixtral."""

    name = "mixtral"
    title = "Mixtral"
    hf_model_types = ("mixtral",)
    hf_architecture = "MixtralForCausalLM"
    hf_model_type = "mixtral"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        GGUF: [
            *_renames(tuple(pair for pair in gguf.RENAMES if ".mlp." not in pair[0])),
            RotaryPermute(one(gguf.Q[0]), one(gguf.Q[1]), heads="n_heads"),
            RotaryPermute(one(gguf.K[0]), one(gguf.K[1]), heads="n_kv_heads"),
            *_renames((gguf.MIXTRAL_ROUTER,)),
            *(Experts(one(hf), one(native)) for hf, native in gguf.MIXTRAL_EXPERTS),
            *_renames(gguf.MIXTRAL_EXPERTS_APART),
        ],
    }
    # a file holds its experts stacked, or (llama.cpp before April 2024) one tensor each; a
    # layer without them is refused on the whole output (`check_layers`)
    optional: ClassVar[Mapping[str, Sequence[str]]] = {
        GGUF: tuple(native for _, native in (*gguf.MIXTRAL_EXPERTS, *gguf.MIXTRAL_EXPERTS_APART)),
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: _HF_IGNORED,
        GGUF: (Ignored(gguf.ROPE_FREQS, "rotary frequency factors (config.json's rope_scaling)"),),
    }
    markers: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (gguf.MIXTRAL_ROUTER[0],),
        GGUF: (gguf.MIXTRAL_ROUTER[1],),
    }
    # a model with q/k norms is a Qwen3-MoE's relative, not a Mixtral
    excluders: ClassVar[Mapping[str, Sequence[str]]] = {
        GGUF: (gguf.QK_NORMS[0][1],),
    }

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        args = super().args_from_shapes(shapes, naming)
        router, expert = gguf.MIXTRAL_ROUTER[0], gguf.MIXTRAL_EXPERTS[0][0]
        if naming == GGUF:
            router_shape = shapes.get(gguf.ROUTER[1].format(layer=0))
            stack = shapes.get(gguf.EXPERTS[0][1].format(layer=0))
            apart = shapes.get(gguf.MIXTRAL_EXPERTS_APART[0][1].format(layer=0, expert=0))
            expert_shape = stack[1:] if stack else apart
        else:
            router_shape = shapes.get(router.format(layer=0))
            expert_shape = shapes.get(expert.format(layer=0, expert=0))
        # Mixtral's intermediate_size is one expert's width
        return args.merged(
            ModelArgs(
                num_experts=router_shape[0] if router_shape else None,
                ffn_dim=expert_shape[0] if expert_shape else None,
            )
        )

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        config = super().hf_config(args)
        if args.config is None:
            del config["attention_bias"]  # no key of MixtralConfig
            config["num_local_experts"] = args.require(
                "num_experts", cls.title, "config.json names it"
            )
            config["num_experts_per_tok"] = args.require(
                "experts_per_token", cls.title, "the router picks that many experts"
            )
            config["sliding_window"] = None  # llama.cpp's graph attends to the whole context
        return config


class Qwen2(_Decoder):
    """Qwen2 and Qwen2.5 (a Llama with q/k/v biases, halves RoPE): llama.cpp's `qwen2` GGUF
    names against transformers' `Qwen2ForCausalLM`. torchtitan has no Qwen2."""

    name = "qwen2"
    title = "Qwen2"
    hf_model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"
    hf_model_type = "qwen2"
    megatron_style = MegatronStyle("Qwen2", qkv_bias=True)
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        # llama.cpp writes a Qwen2's q/k rows as they are (NEOX rope: the halves layout)
        GGUF: _renames((*gguf.RENAMES, gguf.Q, gguf.K, *gguf.QKV_BIASES)),
        # Megatron-Core's GPTModel with --add-qkv-bias (Megatron-Bridge's Qwen2 / Qwen2.5)
        MEGATRON: megatron_style.rules,
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: _HF_IGNORED,
        MEGATRON: MEGATRON_IGNORED,
    }
    markers: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (gguf.QKV_BIASES[0][0],),
        GGUF: (gguf.QKV_BIASES[0][1],),
        MEGATRON: megatron_style.markers,
    }
    # a model with an o_proj bias too is a Llama with attention_bias, no Qwen2
    excluders: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: ("model.layers.{layer}.self_attn.o_proj.bias",),
        GGUF: ("blk.{layer}.attn_output.bias",),
    }

    @classmethod
    def config_conflicts(cls, config: Mapping[str, Any]) -> list[str]:
        # Qwen2Attention builds its q/k/v biases whatever the config says, and the rules map
        # them; it reads no attention_bias or mlp_bias
        return []

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        config = super().hf_config(args)
        if args.config is None:
            del config["attention_bias"]  # no key of Qwen2Config: its biases are always there
        return config


class Qwen3(_Decoder):
    """Qwen3 dense (q/k norms, halves RoPE on both sides): torchtitan's `qwen3` against
    transformers' `Qwen3ForCausalLM`."""

    name = "qwen3"
    title = "Qwen3"
    hf_model_types = ("qwen3",)
    hf_architecture = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    torchtitan_models = "torchtitan.models.qwen3"
    megatron_style = MegatronStyle("Qwen3", qk_layernorm=True)
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: _renames((*_COMMON, _Q, _K, *_QK_NORMS, *_DENSE_MLP)),
        # llama.cpp writes a Qwen3's q/k rows as they are (NEOX rope: the halves layout)
        GGUF: _renames((*gguf.RENAMES, gguf.Q, gguf.K, *gguf.QK_NORMS)),
        # Megatron-Core's GPTModel with --qk-layernorm (Megatron-Bridge's Qwen3)
        MEGATRON: megatron_style.rules,
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: _HF_IGNORED,
        TITAN: _TITAN_IGNORED,
        MEGATRON: MEGATRON_IGNORED,
    }
    markers: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (_QK_NORMS[0][0],),
        TITAN: (_QK_NORMS[0][1],),
        GGUF: (gguf.QK_NORMS[0][1],),
        MEGATRON: megatron_style.markers,
    }


class Qwen3Moe(_Decoder):
    """Qwen3-MoE: torchtitan's `qwen3` MoE flavors (experts stacked `[E, ...]` per layer)
    against transformers' `Qwen3MoeForCausalLM` (one tensor per expert on disk)."""

    name = "qwen3-moe"
    title = "Qwen3-MoE"
    hf_model_types = ("qwen3_moe",)
    hf_architecture = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    torchtitan_models = "torchtitan.models.qwen3"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {
        TITAN: [
            *_renames((*_COMMON, _Q, _K, *_QK_NORMS, *_DENSE_MLP, *_ROUTER)),
            *(Experts(one(hf), one(native)) for hf, native in _MOE_EXPERTS),
        ],
        # llama.cpp's qwen3moe: a Qwen3's names, its router, its experts stacked per layer
        GGUF: [
            *_renames((*gguf.RENAMES, gguf.Q, gguf.K, *gguf.QK_NORMS, gguf.ROUTER)),
            *(Experts(one(hf), one(native)) for hf, native in gguf.EXPERTS),
        ],
    }
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {HF: _HF_IGNORED, TITAN: _TITAN_IGNORED}
    markers: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: (_ROUTER[0][0],),
        TITAN: (_ROUTER[0][1],),
        GGUF: (gguf.ROUTER[1],),
    }
    # a model may hold dense MLP layers between its MoE ones (mlp_only_layers), or none
    optional: ClassVar[Mapping[str, Sequence[str]]] = {
        HF: tuple(hf for hf, _ in _DENSE_MLP),
        TITAN: tuple(native for _, native in _DENSE_MLP),
        GGUF: tuple(
            native for _, native in gguf.RENAMES if ".ffn_" in native and "norm" not in native
        ),
    }
    # ...so each layer holds a whole dense MLP or a whole MoE block
    layer_variants: ClassVar[Sequence[Sequence[str]]] = (
        tuple(hf for hf, _ in _DENSE_MLP),
        (_ROUTER[0][0], *(hf for hf, _ in _MOE_EXPERTS)),
    )
    # torchtitan keeps a load-balancing bias per MoE layer (with load_balance_coeff, the
    # default); CheckpointManager.load wants it, so an import writes its fresh-start zeros
    filled: ClassVar[Mapping[str, Sequence[Filled]]] = {
        TITAN: (
            Filled(
                "layers.{layer}.moe.expert_bias_E",
                like=_ROUTER[0][1],
                dtype="float32",
                reason="MoE load-balancing bias at its fresh-start value",
            ),
        )
    }

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        config = super().hf_config(args)
        if args.config is None:
            config["num_experts"] = args.require("num_experts", cls.title, "config.json names it")
            config["num_experts_per_tok"] = args.require(
                "experts_per_token", cls.title, "the router picks that many experts"
            )
            config["moe_intermediate_size"] = args.moe_ffn_dim
            config["norm_topk_prob"] = args.require(
                "norm_topk_prob", cls.title, "the router's top-k renormalisation"
            )
        return config
