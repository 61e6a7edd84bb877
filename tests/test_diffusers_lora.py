"""diffusers LoRA folders, as diffusion training scripts save them: one
`pytorch_lora_weights.safetensors` (or `.bin`) written by the pipeline's `save_lora_weights`,
keys named per component (`unet.…`, `text_encoder.…`). Converted or resharded, they keep the
name `load_lora_weights` looks for, in one file, and load to the same fused pipeline."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt


@pytest.fixture(scope="module")
def pipeline_lora(fp16_variant_pipeline: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA on the tiny pipeline's UNet and text encoder, saved the way diffusers' training
    scripts save it (`convert_state_dict_to_diffusers(get_peft_model_state_dict(...))` into
    `save_lora_weights`), as a `.bin` (`safe_serialization=False`)."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = StableDiffusionPipeline.from_pretrained(fp16_variant_pipeline, variant="fp16").to(
            torch.float32
        )
        pipe.unet.add_adapter(
            LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False)
        )
        inject_adapter_in_model(
            LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], init_lora_weights=False),
            pipe.text_encoder,
        )
        path = tmp_path_factory.mktemp("diffusers-lora") / "lora"
        StableDiffusionPipeline.save_lora_weights(
            path,
            unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet)),
            text_encoder_lora_layers=convert_state_dict_to_diffusers(
                get_peft_model_state_dict(pipe.text_encoder)
            ),
            safe_serialization=False,
        )
    assert {p.name for p in path.iterdir()} == {"pytorch_lora_weights.bin"}
    return path


def _fused(pipeline: Path, lora: Path | None, weight_name: str = "") -> dict[str, torch.Tensor]:
    """The pipeline's UNet and text encoder weights with the LoRA fused in by diffusers (none
    with `lora` None)."""
    from diffusers import StableDiffusionPipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe: Any = StableDiffusionPipeline.from_pretrained(pipeline, variant="fp16").to(
            torch.float32
        )
        if lora is not None:
            # no weight_name: found by the name diffusers looks for by default
            pipe.load_lora_weights(lora, **({"weight_name": weight_name} if weight_name else {}))
            pipe.fuse_lora()
            pipe.unload_lora_weights()
    out = {f"unet.{k}": v for k, v in pipe.unet.state_dict().items()}
    out.update({f"text_encoder.{k}": v for k, v in pipe.text_encoder.state_dict().items()})
    return out


def test_a_converted_diffusers_lora_keeps_the_name_load_lora_weights_reads(
    fp16_variant_pipeline: Path, pipeline_lora: Path, tmp_path: Path
) -> None:
    out = tmp_path / "safetensors"
    result = run_ckpt("convert", pipeline_lora, out, "--to", "safetensors")
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in out.iterdir()} == {"pytorch_lora_weights.safetensors"}
    want = _fused(fp16_variant_pipeline, pipeline_lora, "pytorch_lora_weights.bin")
    got = _fused(fp16_variant_pipeline, out)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the LoRA really is in there
    base = _fused(fp16_variant_pipeline, None)
    changed = {k for k in want if not torch.equal(want[k], base[k])}
    assert changed and all(
        k.endswith(("to_q.weight", "to_v.weight", "q_proj.weight")) for k in changed
    )

    back = tmp_path / "torch"
    assert run_ckpt("convert", out, back, "--to", "torch").exit_code == 0
    assert {p.name for p in back.iterdir()} == {"pytorch_lora_weights.bin"}


def test_a_diffusers_lora_is_never_cut_into_shards_diffusers_cannot_load(
    pipeline_lora: Path, tmp_path: Path
) -> None:
    """`load_lora_weights` reads one file: `pytorch_lora_weights-00001-of-00003` plus an
    index is a LoRA no pipeline loads."""
    out = tmp_path / "cut"
    for args in (
        ["reshard", pipeline_lora, out, "--max-shard-size", "1KB"],
        ["convert", pipeline_lora, out, "--to", "safetensors", "--max-shard-size", "1KB"],
    ):
        result = run_ckpt(*args)
        assert result.exit_code == 2, result.stdout
        assert "loads them from one file only" in result.stderr
        assert not out.exists()
    assert run_ckpt("reshard", pipeline_lora, out, "--max-shard-size", "1GB").exit_code == 0
    assert {p.name for p in out.iterdir()} == {"pytorch_lora_weights.bin"}


def test_inspect_says_a_diffusers_lora_is_one_and_what_it_adapts(
    pipeline_lora: Path, tmp_path: Path
) -> None:
    """A `pytorch_lora_weights` file is labelled as the diffusers LoRA it is: the pipeline
    components it adapts with their tensor counts, its rank, and how it is loaded; the folder
    and the file alike, and its converted copy."""
    from safetensors.torch import load_file

    out = tmp_path / "safetensors"
    assert run_ckpt("convert", pipeline_lora, out, "--to", "safetensors").exit_code == 0
    held = load_file(out / "pytorch_lora_weights.safetensors")
    counts = {c: sum(1 for k in held if k.startswith(f"{c}.")) for c in ("unet", "text_encoder")}
    assert all(counts.values()) and sum(counts.values()) == len(held)
    for src in (pipeline_lora, out, out / "pytorch_lora_weights.safetensors"):
        result = run_ckpt("inspect", src, "--json")
        assert result.exit_code == 0, result.stderr
        layout = result.json["result"]["layout"]
        assert layout["layout"] == "diffusers-lora", layout
        assert layout["details"]["components"] == counts
        assert layout["details"]["ranks"] == [2]
    human = run_ckpt("inspect", pipeline_lora).stdout
    assert "diffusers-lora" in human and "load_lora_weights" in human
