"""`--flavor NAME`: a torchtitan model flavor (`8B`, `debugmodel`...) as `ModelArgs`.

A torchtitan save holds weights and no config: the head counts, rotary base and scaling, norm
epsilon and context length live in the flavor the run was trained with. This reads that
flavor from the installed torchtitan's own model registry (`torchtitan.models.<family>`'s
`model_registry(flavor)`), so `convert --to hf` can build `config.json` without one given.
Nothing here reads the checkpoint: the registry is code of the installed library.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..errors import UsageError
from .base import Architecture, ModelArgs


def flavor_args(arch: type[Architecture], flavor: str) -> ModelArgs:
    """The args torchtitan's flavor `flavor` of `arch`'s family builds its model with.

    Raises:
        UsageError: torchtitan is not installed, the family has no torchtitan model, the
            flavor is unknown, or its rotary scaling has no `config.json` spelling here.
    """
    module_name = arch.torchtitan_models
    if module_name is None:
        raise UsageError(
            f"--flavor: {arch.title} has no torchtitan model registry",
            fix="Pass the model's config.json with --config instead.",
        )
    if importlib.util.find_spec("torchtitan") is None:
        raise UsageError(
            "--flavor reads torchtitan's model registry, and torchtitan is not installed",
            fix="Install torchtitan, or pass the model's config.json with --config.",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        # torchtitan's qwen3_5 imports flash-linear-attention's kernels (`fla`) at its top
        missing = (e.name or "").split(".")[0] or "a module it imports"
        raise UsageError(
            f"--flavor reads the model registry of {module_name}, whose import failed ({e})",
            fix=f"Install what it imports ({missing}), or pass the model's config.json with "
            "--config.",
        ) from None
    family = module_name.rsplit(".", 1)[-1]
    # (`deepseek_v3`'s registry is `deepseekv3_configs`)
    configs: dict[str, Any] = getattr(module, f"{family}_configs", None) or getattr(
        module, f"{family.replace('_', '')}_configs", {}
    )
    if flavor not in configs:
        raise UsageError(
            f"--flavor: torchtitan's {family} has no flavor {flavor!r}",
            fix=f"Its flavors: {', '.join(configs)}.",
        )
    model = module.model_registry(flavor).model
    own = arch.args_from_torchtitan(model)
    return own if own is not None else args_of(model, arch.title)


def args_of(config: Any, title: str) -> ModelArgs:
    """`ModelArgs` from a torchtitan decoder `Model.Config` (layers, attention, rope, norm)."""
    layers = list(config.layers)
    attention = layers[0].attention
    rope = attention.rope
    n_heads = attention.n_heads
    scaling: dict[str, Any] | None = None
    kind = getattr(rope, "scaling", "none")
    if kind == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position_embeddings),
        }
    elif kind == "yarn" and getattr(rope, "rope_factor", 1.0) > 1.0:
        raise UsageError(
            f"--flavor: this {title} flavor uses yarn rotary scaling, which ckpt does not "
            "write into config.json",
            fix="Pass the model's config.json with --config.",
        )
    moe = next((layer.moe for layer in layers if getattr(layer, "moe", None) is not None), None)
    feed_forward = next(
        (layer.feed_forward for layer in layers if getattr(layer, "feed_forward", None)), None
    )
    return ModelArgs(
        dim=config.dim,
        n_layers=len(layers),
        n_heads=n_heads,
        n_kv_heads=attention.n_kv_heads or n_heads,
        head_dim=attention.head_dim or config.dim // n_heads,
        vocab_size=config.vocab_size,
        ffn_dim=feed_forward.w1.out_features if feed_forward is not None else None,
        norm_eps=float(config.norm.eps),
        rope_theta=float(rope.theta),
        rope_scaling=scaling,
        max_position_embeddings=int(rope.max_seq_len),
        tie_embeddings=bool(getattr(config, "enable_weight_tying", False)),
        num_experts=moe.num_experts if moe is not None else None,
        experts_per_token=moe.router.top_k if moe is not None else None,
        norm_topk_prob=bool(moe.router.route_norm) if moe is not None else None,
    )
