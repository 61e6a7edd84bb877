"""Build the bundled demo: a small sharded safetensors model written by huggingface_hub.

Usage: python examples/make_demo.py DEST
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict


def tiny_transformer_state(
    layers: int = 4, dim: int = 64, vocab: int = 256
) -> dict[str, torch.Tensor]:
    """Weights shaped like a small Llama-style model (deterministic)."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, dim, generator=gen)
    }
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{prefix}.self_attn.{proj}.weight"] = torch.randn(dim, dim, generator=gen)
        state[f"{prefix}.mlp.up_proj.weight"] = torch.randn(4 * dim, dim, generator=gen)
        state[f"{prefix}.mlp.down_proj.weight"] = torch.randn(dim, 4 * dim, generator=gen)
        state[f"{prefix}.input_layernorm.weight"] = torch.ones(dim)
        state[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(dim)
    state["model.norm.weight"] = torch.ones(dim)
    state["lm_head.weight"] = torch.randn(vocab, dim, generator=gen)
    return {k: v.to(torch.bfloat16) if "proj" in k else v for k, v in state.items()}


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "build/demo")
    model_dir = dest / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(tiny_transformer_state(), model_dir, max_shard_size="100KB")
    print(f"wrote {model_dir}")


if __name__ == "__main__":
    main()
