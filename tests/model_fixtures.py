"""Session-scoped model folders written by the owning libraries' own save code: a tiny Llama
(`save_pretrained`), a LoRA adapter on it (peft), a diffusers pipeline and a
sentence-transformers folder. Each is built once per test session in a temporary folder."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with hidden size 16 saved by `save_pretrained` (model.safetensors)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "base"
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def lora_adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter (r=4, alpha=8, q_proj/v_proj, non-zero B) saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    base = LlamaForCausalLM.from_pretrained(tiny_llama)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    path = tmp_path_factory.mktemp("lora") / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(base, config).save_pretrained(path)
    return path
