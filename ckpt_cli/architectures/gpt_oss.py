"""gpt-oss (OpenAI's open-weight MoE): transformers' `GptOssForCausalLM` naming only.

No training framework here names gpt-oss otherwise, so the family maps nothing: it recognises
a checkpoint in transformers' names (attention sinks, a biased router, stacked experts with
biases) so `convert --to hf` writes it as a model folder, most usefully with `--dequantize`
from the released MXFP4 checkpoints. Their experts are stored `[E, out, in]` for
quantization; `--dequantize` writes them `[E, in, out]`, the layout `GptOss` holds
(`quant.recognise.GPT_OSS_EXPERTS`, as transformers' own MXFP4 dequantize transposes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .base import HF, Architecture, ModelArgs

_LAYER = "model.layers.{layer}."
#: every tensor of `GptOssForCausalLM`'s state dict, by pattern
_NAMES = (
    "model.embed_tokens.weight",
    *(
        _LAYER + name
        for name in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
            "self_attn.sinks",
            "mlp.router.weight",
            "mlp.router.bias",
            "mlp.experts.gate_up_proj",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias",
        )
    ),
    "model.norm.weight",
    "lm_head.weight",
)


class GptOss(Architecture):
    """gpt-oss in transformers' names (`GptOssForCausalLM`), its only naming."""

    name = "gpt-oss"
    title = "gpt-oss"
    hf_model_types = ("gpt_oss",)
    hf_names: ClassVar[tuple[str, ...]] = _NAMES
    markers: ClassVar[Mapping[str, Sequence[str]]] = {HF: (_LAYER + "self_attn.sinks",)}

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        embed = shapes.get("model.embed_tokens.weight")
        router = shapes.get("model.layers.0.mlp.router.weight")
        sinks = shapes.get("model.layers.0.self_attn.sinks")
        layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")}
        return ModelArgs(
            dim=embed[1] if embed else None,
            vocab_size=embed[0] if embed else None,
            n_layers=max(layers) + 1 if layers else None,
            n_heads=sinks[0] if sinks else None,
            num_experts=router[0] if router else None,
        )

    @classmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        return ModelArgs(
            dim=config.get("hidden_size"),
            vocab_size=config.get("vocab_size"),
            n_layers=config.get("num_hidden_layers"),
            n_heads=config.get("num_attention_heads"),
            n_kv_heads=config.get("num_key_value_heads"),
            num_experts=config.get("num_local_experts") or config.get("num_experts"),
            experts_per_token=config.get("num_experts_per_tok"),
            config=dict(config),
        )

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        # gpt-oss's config (yarn rope, sliding-window layer types, SwiGLU limits) is not
        # rebuilt from the weights: the source's own config.json, or --config, says it
        config: dict[str, Any] = dict(
            args.require("config", cls.title, "pass its config.json (--config)")
        )
        return config
