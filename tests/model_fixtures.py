"""Session-scoped model folders written by the owning libraries' own save code: a tiny Llama
(`save_pretrained`), a LoRA adapter on it (peft), a diffusers pipeline and a
sentence-transformers folder. Each is built once per test session in a temporary folder."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from .framework_fixtures import tiny_config


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with hidden size 16 saved by `save_pretrained` (model.safetensors)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "base"
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
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


@pytest.fixture(scope="session")
def diffusers_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An `LDMPipeline` (vqvae/ + unet/ + scheduler/, model_index.json) of tiny components,
    saved by diffusers' `save_pretrained`."""
    import torch
    from diffusers import DDIMScheduler, LDMPipeline, UNet2DModel, VQModel

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    vqvae = VQModel(
        in_channels=3,
        out_channels=3,
        latent_channels=3,
        block_out_channels=(8,),
        layers_per_block=1,
        norm_num_groups=4,
        num_vq_embeddings=16,
        vq_embed_dim=3,
    )
    path = tmp_path_factory.mktemp("diffusers") / "pipeline"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LDMPipeline(vqvae=vqvae, unet=unet, scheduler=DDIMScheduler()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def fp16_variant_unet(diffusers_pipeline: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pipeline's UNet saved again as the `fp16` variant in 20 KB shards
    (`diffusion_pytorch_model.fp16-0000k-of-0000n.safetensors` +
    `diffusion_pytorch_model.safetensors.index.fp16.json`)."""
    import torch
    from diffusers import UNet2DModel

    path = tmp_path_factory.mktemp("variant") / "unet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = UNet2DModel.from_pretrained(diffusers_pipeline / "unet").to(torch.float16)
        unet.save_pretrained(path, variant="fp16", max_shard_size="20KB")
    return path


@pytest.fixture(scope="session")
def fp16_variant_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `StableDiffusionPipeline` saved by `save_pretrained(variant="fp16",
    max_shard_size="20KB")`: diffusers components in variant shards
    (`unet/diffusion_pytorch_model.safetensors.index.fp16.json`) and a transformers text
    encoder as `text_encoder/model.fp16.safetensors`, no default weights anywhere."""
    import json

    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTokenizer

    torch.manual_seed(0)
    work = tmp_path_factory.mktemp("sd")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "a</w>": 2, "a": 3}
    (work / "vocab.json").write_text(json.dumps(vocab))
    (work / "merges.txt").write_text("#version: 0.2\n")
    unet = tiny_unet()
    vae = AutoencoderKL(
        latent_channels=4,
        block_out_channels=(8,),
        layers_per_block=1,
        norm_num_groups=4,
    )
    text_encoder = tiny_clip_text_encoder()
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer(str(work / "vocab.json"), str(work / "merges.txt")),
        unet=unet,
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    path = work / "pipeline"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.to(torch.float16).save_pretrained(path, variant="fp16", max_shard_size="20KB")
    return path


@pytest.fixture(scope="session")
def sentence_transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentenceTransformer (BERT root module, 1_Pooling/, 2_Dense/) saved by `.save`."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizer

    torch.manual_seed(0)
    work = tmp_path_factory.mktemp("st")
    bert = work / "bert"
    bert.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(27)]
    (bert / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(bert / "vocab.txt")).save_pretrained(bert)
    config = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    BertModel(config).save_pretrained(bert)
    path = work / "st"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = [models.Transformer(str(bert)), models.Pooling(16), models.Dense(16, 8)]
        SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def write_gguf(path: Path, split_max_tensors: int = 0) -> None:
    """A tiny llama-architecture GGUF written by gguf's own `GGUFWriter`: F32, F16 and BF16
    tensors, one Q8_0 tensor, a token list; split into files of at most N tensors if asked."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(32)
    writer.add_token_list([f"t{i}" for i in range(40)])
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 4), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((4, 4)).astype(np.float16))
    bf16 = (rng.standard_normal((2, 4), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    writer.add_tensor(
        "blk.0.ffn_up.weight", bf16, raw_shape=(2, 4), raw_dtype=GGMLQuantizationType.BF16
    )
    q8 = quantize(rng.standard_normal((2, 32), dtype=np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.1.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny.gguf` and `split/tiny-0000k-of-00002.gguf` (two tensors per file)."""
    root = tmp_path_factory.mktemp("gguf")
    write_gguf(root / "tiny.gguf")
    (root / "split").mkdir()
    write_gguf(root / "split" / "tiny.gguf", split_max_tensors=2)
    return root


def _train(
    model_dir: Path, out: Path, *, save_only_model: bool, steps: int, final: Path | None = None
) -> Path:
    """Train the tiny Llama for `steps` steps with transformers' Trainer, saving every step;
    with `final`, `trainer.save_model(final)` at the end (the model, its config and the
    `training_args.bin` the Trainer saves beside them)."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(8)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=1,
        save_strategy="steps",
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_only_model=save_only_model,
        logging_steps=1,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        if final is not None:
            trainer.save_model(str(final))
    return out


@pytest.fixture(scope="session")
def trainer_runs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real Trainer runs of the tiny Llama: `full/` (checkpoint-1, checkpoint-2 with
    optimizer and scheduler; its `trainer.save_model` output in `final/`) and `model_only/`
    (save_only_model=True, checkpoint-1)."""
    root = tmp_path_factory.mktemp("trainer")
    return {
        "full": _train(
            tiny_llama, root / "full", save_only_model=False, steps=2, final=root / "final"
        ),
        "final": root / "final",
        "model_only": _train(tiny_llama, root / "model_only", save_only_model=True, steps=1),
    }


def tiny_unet() -> Any:
    """The tiny Stable Diffusion UNet the diffusers fixtures and tests build (seeded: the same
    weights each time), cross-attending to `tiny_clip_text_encoder`'s width."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        norm_num_groups=4,
        attention_head_dim=2,
    )


def tiny_clip_text_encoder() -> Any:
    """The tiny CLIP text encoder of the diffusers fixtures (4 tokens, width 8)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=4,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
        )
    )
