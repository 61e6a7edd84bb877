"""PEFT adapters written by peft itself: labelled by inspect, converted and resharded under
their own file names (so `PeftModel.from_pretrained` still loads them), and merged into their
base by `ckpt merge` exactly as peft's `merge_and_unload` does."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt
from .model_fixtures import tiny_unet


def _load_peft(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_adapter_is_labelled_from_its_config(lora_adapter: Path, tiny_llama: Path) -> None:
    result = run_ckpt("inspect", lora_adapter, "--json")
    assert result.exit_code == 0
    layout = result.json["result"]["layout"]
    assert layout["layout"] == "peft"
    details = layout["details"]
    assert details["peft_type"] == "LORA" and details["r"] == 4 and details["lora_alpha"] == 8
    assert details["target_modules"] == ["q_proj", "v_proj"]
    assert details["base_model_name_or_path"] == str(tiny_llama)
    human = run_ckpt("inspect", lora_adapter).stdout
    assert "LoRA adapter for" in human and "r=4" in human and "q_proj, v_proj" in human


def test_convert_and_reshard_keep_the_peft_names(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    expected = _load_peft(tiny_llama, lora_adapter)
    out = tmp_path / "converted"
    assert run_ckpt("convert", lora_adapter, out, "--to", "safetensors").exit_code == 0
    assert {p.name for p in out.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    got = _load_peft(tiny_llama, out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    resharded = tmp_path / "resharded"
    assert run_ckpt("reshard", lora_adapter, resharded, "--max-shard-size", "1GB").exit_code == 0
    assert {p.name for p in resharded.iterdir()} >= {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    got = _load_peft(tiny_llama, resharded)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_an_adapter_is_never_cut_into_shards_peft_cannot_load(
    lora_adapter: Path, tmp_path: Path
) -> None:
    """peft reads one `adapter_model.safetensors`: `adapter_model-00001-of-00003` plus an index
    failed in `PeftModel.from_pretrained`, in the Trainer's resume and in `ckpt merge`."""
    out = tmp_path / "cut"
    for args in (
        ["reshard", lora_adapter, out, "--max-shard-size", "1KB"],
        ["reshard", lora_adapter, out, "--max-shard-size", "1KB", "--dry-run"],
        ["convert", lora_adapter, out, "--to", "safetensors", "--max-shard-size", "1KB"],
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 2, result.stdout
        error = result.json["error"]
        assert "peft loads them from one file only" in error["message"]
        assert not out.exists()
        # the fix offered is one the command takes: reshard needs a size (or --world-size)
        leave_out = "Leave --max-shard-size out" in error["fix"]
        assert leave_out == (args[0] == "convert"), error["fix"]
        need = int(error["fix"].split("at least ")[1].split(" bytes")[0].replace(",", ""))
        assert run_ckpt(*[str(need) if a == "1KB" else a for a in args]).exit_code == 0
        if out.exists():
            assert not any("-of-" in p.name for p in out.iterdir())
            shutil.rmtree(out)


def test_merge_equals_peft_merge_and_unload(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path / "merged"
    result = run_ckpt("merge", tiny_llama, lora_adapter, out, "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    # q_proj and v_proj of both layers
    assert len(report["merged"]) == 4 and all("_proj.weight" in n for n in report["merged"])
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json"}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(tiny_llama), lora_adapter
        ).merge_and_unload()
        merged = LlamaForCausalLM.from_pretrained(out)
    want, got = reference.state_dict(), merged.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    # the LoRA really changed those weights; the rest are the base's bytes
    base = load_file(tiny_llama / "model.safetensors")
    written = load_file(out / "model.safetensors")
    for name in base:
        assert torch.equal(written[name], base[name]) == (name not in report["merged"])


def test_merge_into_a_bf16_base_is_bit_identical_to_peft(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """peft adds the float32 delta into a bf16 weight in one rounding (`weight += delta`);
    rounding the delta to bf16 first left about a third of the merged values an ulp off."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = tmp_path / "base-bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(base)
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, lora_adapter, out)
    assert result.exit_code == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16), lora_adapter
        ).merge_and_unload()
    want, got = reference.state_dict(), load_file(out / "model.safetensors")
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    assert all(got[n].dtype == torch.bfloat16 for n in got)


def test_merge_of_an_adapter_on_a_tied_lm_head_equals_peft(tmp_path: Path) -> None:
    """A LoRA on `lm_head` of a base with tied embeddings: `save_pretrained` saves no
    `lm_head.weight`, and peft merges the update into the one shared tensor, the embedding.
    `ckpt merge` refused it as "a base weight the base does not have"."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(3)
    config = tiny_config()
    config.tie_word_embeddings = True
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(config).save_pretrained(base)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(LlamaForCausalLM.from_pretrained(base), lora).save_pretrained(adapter)
        merged = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base), adapter
        ).merge_and_unload()
        merged.save_pretrained(tmp_path / "peft-merged")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    before = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(got["model.embed_tokens.weight"], before)


def test_merge_of_an_adapter_on_the_embeddings_equals_peft(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A LoRA that targets `embed_tokens`: peft saves the whole embedding beside its factors
    (`save_embedding_layers`, key `...embed_tokens.base_layer.weight`) and merges the update
    into it. `ckpt merge` refused it as a weight the base does not have."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    adapter = tmp_path / "adapter"
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(LlamaForCausalLM.from_pretrained(tiny_llama), config).save_pretrained(
            adapter
        )
    saved = load_file(adapter / "adapter_model.safetensors")
    assert any(k.endswith("embed_tokens.base_layer.weight") for k in saved)
    out = tmp_path / "merged"
    result = run_ckpt("merge", tiny_llama, adapter, out, "--json")
    assert result.exit_code == 0, result.stderr
    assert "model.embed_tokens.weight" in result.json["result"]["merged"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(tiny_llama), adapter
        ).merge_and_unload()
    want, got = reference.state_dict(), load_file(out / "model.safetensors")
    assert [n for n in got if not torch.equal(got[n], want[n])] == []


def test_merge_onto_a_bin_sharded_base_keeps_its_shard_size(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """A base saved as `pytorch_model-*.bin` shards merges into safetensors shards of its own
    size (it became one `model.safetensors`), the same values as from its safetensors copy."""
    from huggingface_hub import save_torch_state_dict

    state = load_file(tiny_llama / "model.safetensors")
    base = tmp_path / "bin-base"
    base.mkdir()
    save_torch_state_dict(state, base, safe_serialization=False, max_shard_size="10KB")
    shutil.copy(tiny_llama / "config.json", base / "config.json")
    shards = sorted(base.glob("pytorch_model-*.bin"))
    assert len(shards) > 1
    out, reference = tmp_path / "merged", tmp_path / "merged-from-safetensors"
    assert run_ckpt("merge", base, lora_adapter, out).exit_code == 0
    assert run_ckpt("merge", tiny_llama, lora_adapter, reference).exit_code == 0
    written = sorted(out.glob("model-*.safetensors"))
    # cut at the largest .bin's size (a .bin carries pickle overhead: a shard or so fewer)
    assert len(written) > 1 and (out / "model.safetensors.index.json").is_file()
    got = {k: v for f in written for k, v in load_file(f).items()}
    want = load_file(reference / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_refuses_what_it_cannot_merge(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    not_lora = shutil.copytree(lora_adapter, tmp_path / "oft")
    config = json.loads((not_lora / "adapter_config.json").read_text())
    config["peft_type"] = "OFT"
    (not_lora / "adapter_config.json").write_text(json.dumps(config))
    result = run_ckpt("merge", tiny_llama, not_lora, tmp_path / "out")
    assert result.exit_code == 4 and "OFT" in result.stderr
    assert "merge_and_unload" in result.stderr
    assert not (tmp_path / "out").exists()
    result = run_ckpt("merge", tiny_llama, tmp_path, tmp_path / "out2")
    assert result.exit_code == 3 and "adapter_config.json" in result.stderr


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"r": 0}, "r must be a whole number >= 1"),  # was a ZeroDivisionError, exit 70
        ({"r": -2}, "r must be a whole number >= 1"),  # merged with a negative scaling
        ({"r": "4"}, "r must be a whole number >= 1"),
        ({"lora_alpha": None}, "lora_alpha must be a finite number"),
        ({"alpha_pattern": "x"}, "alpha_pattern must map"),  # an AttributeError, exit 70
        ({"rank_pattern": {"(": 4}}, "is not a regular expression"),
        ({"r": 2}, "have rank 4, adapter_config.json says r=2"),  # merged, scaled wrong
    ],
)
def test_merge_refuses_an_adapter_config_peft_would_not_build(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path, change: dict[str, object], said: str
) -> None:
    adapter = shutil.copytree(lora_adapter, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    assert said in result.json["error"]["message"] and result.json["error"]["fix"]
    assert not (tmp_path / "out").exists()


def test_verify_good_and_damaged_adapter(lora_adapter: Path, tmp_path: Path) -> None:
    assert run_ckpt("verify", lora_adapter).exit_code == 0
    damaged = shutil.copytree(lora_adapter, tmp_path / "damaged")
    weights = damaged / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1
    assert any(
        "adapter_model.safetensors" in (p["file"] or "") for p in result.json["result"]["problems"]
    )


def _quantize_q_proj(tiny_llama: Path, folder: Path, scheme: str) -> str:
    """`tiny_llama` with layer 0's q_proj stored quantized as `scheme` writes it; returns what
    the refusal names the scheme by."""
    from safetensors.torch import save_file

    from .test_quant import MODELOPT_CONFIG, quantize_fp8_block, quantize_nvfp4_modelopt

    state = load_file(tiny_llama / "model.safetensors")
    config = json.loads((tiny_llama / "config.json").read_text())
    module = "model.layers.0.self_attn.q_proj"
    weight = state.pop(f"{module}.weight")
    folder.mkdir()
    if scheme == "fp8":  # DeepSeek-style block FP8
        q, scale_inv = quantize_fp8_block(weight, 128)
        state |= {f"{module}.weight": q, f"{module}.weight_scale_inv": scale_inv}
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        said = "FP8 block 128x128"
    elif scheme == "nvfp4":  # ModelOpt
        state |= {f"{module}.{k}": v for k, v in quantize_nvfp4_modelopt(weight).items()}
        (folder / "hf_quant_config.json").write_text(json.dumps(MODELOPT_CONFIG))
        said = "NVFP4"
    else:  # bitsandbytes LLM.int8: int8 codes, one absmax (SCB) a row
        scb = weight.abs().amax(dim=1)
        state |= {
            f"{module}.weight": torch.round(weight / scb[:, None] * 127).to(torch.int8),
            f"{module}.SCB": scb,
        }
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        said = "int8 (bitsandbytes quantization)"
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return said


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4", "int8"])
def test_merge_refuses_a_base_whose_targeted_weight_is_quantized(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path, scheme: str
) -> None:
    """The float LoRA delta was added to the int8 codes of an LLM.int8 base (merged silently,
    wrong values), an FP8 base was an internal error (exit 70) and an NVFP4 one was "not
    trained on this base": a quantized target is refused, naming the weight, its scheme and
    the way out, before anything is written."""
    base = tmp_path / f"base-{scheme}"
    said = _quantize_q_proj(tiny_llama, base, scheme)
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, lora_adapter, out, "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert "'model.layers.0.self_attn.q_proj.weight'" in error["message"]
    assert said in error["message"] and "quantized" in error["message"]
    assert "Dequantize the base" in error["fix"]
    assert not out.exists()
    if scheme == "fp8":
        # the fix as it says: dequantize, then merge; the result is peft's on that base
        plain = tmp_path / "dequantized"
        converted = run_ckpt("convert", base, plain, "--to", "safetensors", "--dequantize")
        assert converted.exit_code == 0, converted.stderr
        assert "--dequantize" in error["fix"]
        assert run_ckpt("merge", plain, lora_adapter, out).exit_code == 0
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = PeftModel.from_pretrained(
                LlamaForCausalLM.from_pretrained(plain), lora_adapter
            ).merge_and_unload()
        want, got = reference.state_dict(), load_file(out / "model.safetensors")
        assert [n for n in got if not torch.equal(got[n], want[n])] == []


def _gpt2(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    config = GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(folder)


@pytest.mark.parametrize("saved", [False, True])
def test_merge_decides_fan_in_fan_out_per_layer_as_peft_does(tmp_path: Path, saved: bool) -> None:
    """peft sets `fan_in_fan_out` per layer, True for transformers' `Conv1D` (weight stored
    `[in, out]`) and False for `nn.Linear`, whatever adapter_config.json says; `ckpt merge`
    applied the config's one value to every layer, so a GPT-2 adapter on c_proj and lm_head
    merged one of them transposed. The shape decides, and for a square weight (GPT-2's
    attn.c_proj) the architecture does."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2LMHeadModel

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    _gpt2(base)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "attn.c_proj", "c_fc", "lm_head"],
        init_lora_weights=False,
        fan_in_fan_out=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(GPT2LMHeadModel.from_pretrained(base), lora).save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": saved}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PeftModel.from_pretrained(
            GPT2LMHeadModel.from_pretrained(base), adapter
        ).merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    assert "transformer.h.0.attn.c_proj.weight" in result.json["result"]["merged"]
    before = load_file(base / "model.safetensors")
    assert list(before["transformer.h.0.attn.c_proj.weight"].shape) == [16, 16]  # square
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    assert not torch.equal(
        got["transformer.h.0.attn.c_proj.weight"], before["transformer.h.0.attn.c_proj.weight"]
    )


def test_merge_of_a_square_linear_ignores_a_fan_in_fan_out_peft_overrides(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """A Llama's q_proj is an `nn.Linear`: peft merges it untransposed even when
    adapter_config.json says `fan_in_fan_out: true` (it warns and overrides)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    adapter = shutil.copytree(lora_adapter, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(tiny_llama), adapter
        ).merge_and_unload()
    want, got = reference.state_dict(), load_file(tmp_path / "merged" / "model.safetensors")
    assert [n for n in got if not torch.equal(got[n], want[n])] == []


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_merge_rounds_embedding_and_linear_updates_as_peft_does(
    tiny_llama: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """peft's `lora.Linear.merge` adds the float32 delta in one rounding, its
    `lora.Embedding.merge` rounds the delta to the weight's dtype first and then adds: an
    embedding LoRA on a bf16 base merged by `ckpt merge` was an ulp off in a quarter of the
    values. Both layer kinds, in each dtype, are now bit-identical to `merge_and_unload`."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM.from_pretrained(tiny_llama, dtype=dtype).save_pretrained(base)
        torch.manual_seed(5)
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False
        )
        get_peft_model(LlamaForCausalLM.from_pretrained(base, dtype=dtype), lora).save_pretrained(
            adapter
        )
        reference = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base, dtype=dtype), adapter
        ).merge_and_unload()
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(
        result.json["result"]["merged"]
    )
    want, got = reference.state_dict(), load_file(tmp_path / "merged" / "model.safetensors")
    assert got["model.embed_tokens.weight"].dtype == dtype
    assert [n for n in got if not torch.equal(got[n], want[n])] == []


def test_merge_refuses_trainable_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    """An adapter with peft's `trainable_token_indices` was refused as "trained on another
    base" (exit 3); it is a feature `ckpt merge` does not merge (exit 4), named as such."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    adapter = tmp_path / "adapter"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[1, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(LlamaForCausalLM.from_pretrained(tiny_llama), lora).save_pretrained(adapter)
    for config_says in (True, False):  # the config names it; else its saved tensors do
        if not config_says:
            config = json.loads((adapter / "adapter_config.json").read_text())
            config["trainable_token_indices"] = None
            (adapter / "adapter_config.json").write_text(json.dumps(config))
        result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "merged", "--json")
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert "trainable_token_indices" in error["message"]
        assert "merge_and_unload" in error["fix"]
        assert not (tmp_path / "merged").exists()


def test_merge_refuses_layer_replication_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    """An adapter trained with peft's `layer_replication` (the base's layers stacked into more,
    the copies sharing the base weights, each with its own LoRA update) was refused as "not
    trained on this base" (exit 3). No merged base of the original layers is right, and peft's
    own merge_and_unload adds every copy's update into the one shared weight: refused (exit 4)
    naming layer_replication and what to do."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    adapter = tmp_path / "adapter"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], layer_replication=[[0, 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(tiny_llama)
        layers = model.config.num_hidden_layers
        lora.layer_replication = [[0, layers], [layers - 1, layers]]
        get_peft_model(model, lora).save_pretrained(adapter)
    result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert error["path"] == str(adapter / "adapter_config.json"), error
    assert "layer_replication" in error["message"] and "not trained on" not in error["message"]
    assert f"into {layers + 1} layers" in error["message"], error["message"]
    assert "PeftModel.from_pretrained" in error["fix"]
    assert not (tmp_path / "merged").exists()


def test_merge_never_writes_over_or_into_its_sources(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    base = shutil.copytree(tiny_llama, tmp_path / "base")
    adapter = shutil.copytree(lora_adapter, tmp_path / "adapter")

    def snapshot() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = snapshot()
    for dest, force in (
        (adapter, ["--force"]),  # used to replace the adapter with the merged model
        (base, ["--force"]),
        (base / "merged", []),  # used to write a model inside the base
        (adapter / "merged", []),
        (tmp_path, ["--force"]),  # a DEST holding both sources
    ):
        result = run_ckpt("merge", base, adapter, dest, *force, "--json")
        assert result.exit_code == 2, result.stdout
        assert "DEST overlaps the source" in result.json["error"]["message"]
    assert snapshot() == before
    assert run_ckpt("verify", adapter).exit_code == 0


def test_merge_refuses_a_modules_to_save_copy_shaped_for_another_base(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """An adapter trained on a base with a larger vocabulary, saving `lm_head` whole
    (`modules_to_save`), merged into a base of the smaller one: `merge` failed mid-write with
    "tensor 'lm_head.weight' has 4608 bytes, the plan said 4096. This is a bug in ckpt" (exit
    70). peft cannot load it either (a size mismatch): it is refused before anything is
    written, naming the tensor, both shapes and the fix."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    config = tiny_config()
    config.vocab_size = 72
    torch.manual_seed(2)
    adapter = tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(
            LlamaForCausalLM(config),
            LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules=["q_proj"],
                modules_to_save=["lm_head"],
                init_lora_weights=False,
            ),
        ).save_pretrained(adapter)
    assert load_file(adapter / "adapter_model.safetensors")[
        "base_model.model.lm_head.weight"
    ].shape == (72, 16)
    result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert "'lm_head.weight' for 72 tokens, the base holds 64" in error["message"]
    assert "no 'model.embed_tokens.weight' of that size" in error["message"]
    assert "adapter_model.safetensors" in error["message"]
    assert "base the adapter was trained on" in error["fix"]
    assert "resize_token_embeddings(72)" in error["fix"]
    assert not (tmp_path / "out").exists()


#: how an adapter trained on a resized vocabulary holds the embedding and the output head:
#: `modules_to_save` on both, on the embedding alone, LoRA on both, or neither (peft's
#: `save_embedding_layers="auto"` saves them whole when the vocabulary differs from the base's)
_RESIZED = {
    "modules_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens", "lm_head"]},
    "modules_to_save_embedding": {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
    "lora_on_both": {"target_modules": ["q_proj", "embed_tokens", "lm_head"]},
    "saved_embedding_layers": {"target_modules": ["q_proj"]},
}  # fmt: skip


@pytest.mark.parametrize(
    ("how", "tied"),
    [(how, tied) for how in _RESIZED for tied in (False, True) if (how, tied) != ("lora_on_both", True)],
    ids=lambda v: v if isinstance(v, str) else ("tied" if v else "untied"),
)  # fmt: skip
def test_merge_of_an_adapter_trained_on_a_resized_vocabulary_equals_peft(
    tmp_path: Path, how: str, tied: bool
) -> None:
    """Tokens added before training (`resize_token_embeddings(72)` on a base of 64), then
    LoRA: peft saves the embedding and the output head whole (`modules_to_save`, or
    `save_embedding_layers="auto"` because the vocabulary differs, adding the wrapper's
    `lm_head.modules_to_save.weight` / `original_module.weight`). `ckpt merge` into the base
    refused with "replaces a base weight 'lm_head.modules_to_save.weight' the base does not
    have" (exit 3) or a shape mismatch (exit 4), though the adapter defines every row. It merges,
    equal to peft's `merge_and_unload` on the resized base, bit for bit, `config.json` saying the
    new vocabulary, and loads with `from_pretrained`."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(4)
    config = tiny_config()
    config.tie_word_embeddings = tied
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(config).save_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(base)
        model.resize_token_embeddings(72)
        lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **_RESIZED[how])
        trained = get_peft_model(model, lora)
        with torch.no_grad():  # the trained copies: no longer the resized base's
            for name, param in trained.named_parameters():
                if "modules_to_save" in name:
                    param.add_(0.5)
        trained.save_pretrained(adapter)
        saved = load_file(adapter / "adapter_model.safetensors")
        assert any(v.shape[0] == 72 for k, v in saved.items() if "lora" not in k), saved.keys()
        # peft merges into the base resized as training did (the new rows' initial values
        # differ: the adapter's saved tensors replace them)
        torch.manual_seed(5)
        resized = LlamaForCausalLM.from_pretrained(base)
        resized.resize_token_embeddings(72)
        PeftModel.from_pretrained(resized, adapter).merge_and_unload().save_pretrained(
            tmp_path / "peft-merged"
        )
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["vocab_size"] == 72
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    expected = json.loads((tmp_path / "peft-merged" / "config.json").read_text())
    assert written["vocab_size"] == expected["vocab_size"] == 72
    assert written.get("tie_word_embeddings") == expected.get("tie_word_embeddings")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert all(torch.equal(loaded[n], want[n]) for n in want)


def test_merge_refuses_an_adapter_trained_on_a_shallower_base(
    lora_adapter: Path, tmp_path: Path
) -> None:
    """The 2-layer tiny Llama's adapter (q_proj, v_proj) merged into a 3-layer Llama of the
    same width: every factor fits a weight, so `merge` wrote a model whose third layer was
    never adapted, exit 0, where peft warns of missing adapter keys (and, with the adapter's
    `init_lora_weights: false`, fills them at random). Layers the adapter's own config targets
    but holds no factors for mean it was trained on another base: refused, exit 4."""
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    config = tiny_config()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    deeper = tmp_path / "deeper"
    LlamaForCausalLM(config).save_pretrained(deeper)
    result = run_ckpt("merge", deeper, lora_adapter, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert "model.layers.2.self_attn.q_proj" in error["message"]
    assert "adapter_config.json" in error["message"] and "trained on" in error["fix"]
    assert not (tmp_path / "out").exists()


def test_merge_into_a_gptq_base_names_its_packed_weight(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """An adapter trained on a GPTQ base (peft trains LoRA on GPTQ layers) merged into it: the
    refusal was "the adapter targets 'model.layers.0.self_attn.q_proj', which has no weight in
    the base. Check that the adapter was trained on this base model" (exit 3), a wrong lead:
    the weight is there, packed as `qweight`. It is refused as quantized (exit 4)."""
    from safetensors.torch import save_file

    state = load_file(tiny_llama / "model.safetensors")
    config = json.loads((tiny_llama / "config.json").read_text())
    module = "model.layers.0.self_attn.q_proj"
    out_f, in_f = state.pop(f"{module}.weight").shape
    state |= {
        f"{module}.qweight": torch.zeros(in_f // 8, out_f, dtype=torch.int32),
        f"{module}.qzeros": torch.zeros(1, out_f // 8, dtype=torch.int32),
        f"{module}.scales": torch.ones(1, out_f, dtype=torch.float16),
        f"{module}.g_idx": torch.zeros(in_f, dtype=torch.int32),
    }
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": -1}
    base = tmp_path / "gptq"
    base.mkdir()
    save_file(state, base / "model.safetensors", metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps(config))
    result = run_ckpt("merge", base, lora_adapter, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert f"'{module}.weight'" in error["message"] and "gptq" in error["message"]
    assert f"'{module}.qweight'" in error["message"] and "quantized" in error["message"]
    assert "Dequantize the base" in error["fix"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "saved", [["lm_head"], ["embed_tokens"], ["embed_tokens", "lm_head"]], ids="+".join
)
def test_merge_of_a_modules_to_save_lm_head_on_tied_embeddings_unties_them_as_peft_does(
    tmp_path: Path, saved: list[str]
) -> None:
    """`modules_to_save=["lm_head"]` on a base with tied embeddings: peft trains a copy of the
    output head and leaves the input embedding as it was (and the other way round for
    `embed_tokens`); `merge_and_unload` and `save_pretrained` write both tensors and
    `tie_word_embeddings: false`. `ckpt merge` wrote the trained copy over the one shared
    tensor, so the other side changed too (wrong data, exit 0)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(3)
    config = tiny_config()
    config.tie_word_embeddings = True
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(config).save_pretrained(base)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        modules_to_save=saved,
        init_lora_weights=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base), lora)
        with torch.no_grad():  # the trained head: no longer the embedding
            for name, param in model.named_parameters():
                if "modules_to_save" in name:
                    param.add_(0.5)
        model.save_pretrained(adapter)
        merged = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base), adapter
        ).merge_and_unload()
        merged.save_pretrained(tmp_path / "peft-merged")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys() and "lm_head.weight" in got
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    before = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    for name, trained in (
        ("model.embed_tokens.weight", "embed_tokens"),
        ("lm_head.weight", "lm_head"),
    ):
        assert torch.equal(got[name], before) == (trained not in saved), name
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert all(torch.equal(loaded[n], want[n]) for n in want)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_merge_reads_a_modules_to_save_wrapper_saved_whole_as_peft_does(
    tmp_path: Path, tied: bool
) -> None:
    """`save_pretrained(save_embedding_layers=True)` with `modules_to_save=["lm_head"]` saves
    the wrapper whole: `lm_head.modules_to_save.weight` and `lm_head.original_module.weight`
    beside `lm_head.weight`. `merge` refused with "replaces a base weight
    'lm_head.modules_to_save.weight' the base does not have" (exit 3). The trained copy is the
    one merged, the untrained original dropped, equal to `merge_and_unload`."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(6)
    config = tiny_config()
    config.tie_word_embeddings = tied
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(config).save_pretrained(base)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
        init_lora_weights=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base), lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "modules_to_save" in name:
                    param.add_(0.5)
        model.save_pretrained(adapter, save_embedding_layers=True)
        assert "base_model.model.lm_head.original_module.weight" in load_file(
            adapter / "adapter_model.safetensors"
        )
        PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(base), adapter
        ).merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    expected = json.loads((tmp_path / "peft-merged" / "config.json").read_text())
    assert written.get("tie_word_embeddings") == expected.get("tie_word_embeddings")


def test_merge_of_a_resized_vocabulary_carries_the_tokenizer_that_holds_the_new_tokens(
    tmp_path: Path,
) -> None:
    """The recipe for new tokens: `tokenizer.add_tokens`, `resize_token_embeddings(len(
    tokenizer))`, LoRA, then the adapter and the tokenizer saved together. The merged model
    has the new rows; the base's tokenizer (carried as for any merge) has no tokens for them.
    The adapter folder's tokenizer is carried instead, so DEST's tokenizer and model agree."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    from .framework_fixtures import tiny_config

    torch.manual_seed(7)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(tiny_config()).save_pretrained(base)
    vocab = {f"w{i}": i for i in range(63)} | {"<unk>": 63}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    tokenizer.save_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer.add_tokens([f"new{i}" for i in range(8)])
        model = LlamaForCausalLM.from_pretrained(base)
        model.resize_token_embeddings(len(tokenizer))
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj"],
            modules_to_save=["embed_tokens", "lm_head"], init_lora_weights=False,
        )  # fmt: skip
        get_peft_model(model, lora).save_pretrained(adapter)
        tokenizer.save_pretrained(adapter)
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["vocab_size"] == 72 and "tokenizer.json" in report["tokenizer_from_adapter"]
    merged_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert len(merged_tokenizer) == 72
    assert merged_tokenizer.convert_tokens_to_ids("new7") == 71
    assert (tmp_path / "merged" / "tokenizer.json").read_bytes() == (
        adapter / "tokenizer.json"
    ).read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    assert loaded.get_input_embeddings().weight.shape[0] == len(merged_tokenizer)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "bin-shards"])
def test_merge_dry_run_says_what_it_would_write_and_writes_nothing(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path, sharded: bool
) -> None:
    """`merge --dry-run` (as convert and reshard take it): the files the real merge writes,
    at their sizes, the tensor count, bytes and dtypes; DEST is not created."""
    import jsonschema
    from safetensors import safe_open

    from .conftest import REPO

    base = tiny_llama
    if sharded:
        from huggingface_hub import save_torch_state_dict

        base = tmp_path / "bin-base"
        base.mkdir()
        state = load_file(tiny_llama / "model.safetensors")
        save_torch_state_dict(state, base, safe_serialization=False, max_shard_size="10KB")
        shutil.copy(tiny_llama / "config.json", base / "config.json")
    out = tmp_path / "merged"
    planned = run_ckpt("merge", base, lora_adapter, out, "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    schema = json.loads((REPO / "schema" / "ckpt-json.schema.json").read_text())
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(planned.json))
    plan = planned.json["result"]
    assert plan["dry_run"] is True
    assert not out.exists() and not list(tmp_path.glob(".merged*"))
    human = run_ckpt("merge", base, lora_adapter, out, "-n")
    assert human.exit_code == 0 and "nothing was written (--dry-run)" in human.stdout
    assert not out.exists()

    done = run_ckpt("merge", base, lora_adapter, out, "--json")
    assert done.exit_code == 0, done.stdout + done.stderr
    report = done.json["result"]
    on_disk = {p.name: p.stat().st_size for p in out.iterdir()}
    assert {f["path"] for f in plan["files"]} == set(on_disk)
    # exact sizes, but for a shard index's (as convert's dry run: decided when written)
    sized = {f["path"]: f["size"] for f in plan["files"] if f["size"] is not None}
    assert sized == {p: on_disk[p] for p in sized}
    assert set(on_disk) - set(sized) <= {"model.safetensors.index.json"}
    for key in ("merged", "replaced", "copied", "tensors", "tensor_bytes", "dtypes"):
        assert plan[key] == report[key], key
    tensors, nbytes = 0, 0
    dtypes: dict[str, int] = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                t = f.get_tensor(name)
                tensors += 1
                dtype = str(t.dtype).removeprefix("torch.")
                dtypes[dtype] = dtypes.get(dtype, 0) + 1
                nbytes += t.numel() * t.element_size()
    assert plan["tensors"] == tensors and plan["tensor_bytes"] == nbytes
    assert plan["dtypes"] == dict(sorted(dtypes.items()))
    # an existing DEST is refused by the dry run as by the real merge
    again = run_ckpt("merge", base, lora_adapter, out, "--dry-run")
    assert again.exit_code == 2 and "--force" in again.stderr


@pytest.mark.parametrize("tying", [False, True], ids=["own-updates", "ensure_weight_tying"])
def test_merge_of_lora_on_both_tied_embeddings_is_refused_with_the_untying_fix(
    tmp_path: Path, tying: bool
) -> None:
    """LoRA on `embed_tokens` and `lm_head` of a base that ties them: ckpt refused, saying
    "Merge it with peft's merge_and_unload", whose result is wrong there: it adds both updates
    (with `ensure_weight_tying`, the one shared update twice) into the one tensor both layers
    read, so the merged model's outputs differ from the adapter model's. The refusal says why
    and gives the fix; following it (untie the base, merge into that) merges exactly: the
    model computes what the adapter does, and its tensors are `merge_and_unload`'s on the
    untied base, bit for bit, and load with `from_pretrained`."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(5)
    config = tiny_config()
    config.tie_word_embeddings = True
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    LlamaForCausalLM(config).save_pretrained(base)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["embed_tokens", "lm_head", "q_proj"],
        init_lora_weights=False,
        ensure_weight_tying=tying,
    )
    tokens = torch.tensor([[1, 5, 7, 9, 30]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        get_peft_model(LlamaForCausalLM.from_pretrained(base), lora).save_pretrained(adapter)
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter)
        want = model(tokens).logits
        peft_merged = model.merge_and_unload()(tokens).logits
    # why it is refused: peft's own merge is not the adapter's model
    assert not torch.allclose(peft_merged, want, atol=1e-2)
    refused = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert refused.exit_code == 4
    error = refused.json["error"]
    assert "'model.embed_tokens.weight' (tie_word_embeddings)" in error["message"]
    assert "would not compute what the adapter does" in error["message"]
    assert "tie_word_embeddings = False" in error["fix"] and "ckpt merge UNTIED" in error["fix"]
    assert not (tmp_path / "merged").exists()
    # the fix, as the message gives it
    untied = tmp_path / "untied"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = LlamaForCausalLM.from_pretrained(base)
        m.config.tie_word_embeddings = False
        m.lm_head.weight = torch.nn.Parameter(m.get_input_embeddings().weight.clone())
        m.save_pretrained(untied)
    result = run_ckpt("merge", untied, adapter, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(untied), adapter
        ).merge_and_unload().save_pretrained(tmp_path / "peft-merged")
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
        got = loaded(tokens).logits
    assert torch.allclose(got, want, atol=1e-5)
    expected = load_file(tmp_path / "peft-merged" / "model.safetensors")
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert written.keys() == expected.keys() and "lm_head.weight" in written
    differ = [n for n in written if not torch.equal(written[n], expected[n])]
    # with `ensure_weight_tying` peft saves `lm_head`'s factors (the embedding's, transposed)
    # but drops `lm_head` from target_modules, so on the untied base it merges no update into
    # the head, which the adapter model did apply: ckpt merges the factors the file holds
    assert differ == (["lm_head.weight"] if tying else [])
    if tying:
        assert torch.allclose(written["lm_head.weight"], written["model.embed_tokens.weight"])
    state = loaded.state_dict()
    assert all(torch.equal(state[n], written[n]) for n in written)


def test_a_framework_naming_of_an_adapter_points_to_merging_it_first(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """`convert ADAPTER --to hf / torchtitan / megatron` said "no known model architecture
    matches these 4 tensor names" and offered --select, --filter-out or --to safetensors, none
    of which makes a LoRA adapter a model. It now says it is an adapter (exit 4, nothing
    written) and how to get there: merging it first, after which the import works."""
    for target in ("hf", "torchtitan", "megatron"):
        dest = tmp_path / target
        r = run_ckpt("convert", lora_adapter, dest, "--to", target, "--json")
        assert r.exit_code == 4, r.stdout + r.stderr
        error = json.loads(r.stdout)["error"]
        assert error["problem"].startswith("is a LoRA adapter for "), error
        assert f"cannot be mapped to the {target} naming" in error["problem"]
        assert f"`ckpt merge BASE {lora_adapter} MERGED`" in error["fix"]
        assert f"--to {target}" in error["fix"] and error["path"] == str(lora_adapter)
        assert not dest.exists()
    merged = tmp_path / "merged"
    assert run_ckpt("merge", tiny_llama, lora_adapter, merged).exit_code == 0
    r = run_ckpt("convert", merged, tmp_path / "titan", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr


def _trained_adapter(base: Path, adapter: Path, lora: Any, dtype: torch.dtype) -> None:
    """A peft adapter (`lora`: its `LoraConfig`) on `base` as training leaves it: every LoRA
    tensor (factors, DoRA magnitudes, `lora_bias` biases) moved away from its initial value."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(adapter)


def _dora_adapter(base: Path, adapter: Path, targets: list[str], dtype: torch.dtype) -> None:
    """A trained DoRA adapter on `base` (DoRA starts each magnitude at its weight's norm)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True)
    _trained_adapter(base, adapter, lora, dtype)


def _merge_like_peft(base: Path, adapter: Path, out: Path, dtype: torch.dtype) -> list[str]:
    """`ckpt merge BASE ADAPTER OUT/merged` held against peft's `merge_and_unload` of the same
    pair (`OUT/peft-merged`): every tensor bit for bit, in the base's dtype. The merged names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter
        ).merge_and_unload().save_pretrained(out / "peft-merged")
    result = run_ckpt("merge", base, adapter, out / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    want = load_file(out / "peft-merged" / "model.safetensors")
    got = load_file(out / "merged" / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    assert all(got[n].dtype == dtype for n in got if got[n].is_floating_point())
    merged: list[str] = result.json["result"]["merged"]
    return merged


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.bfloat16)],
)
def test_merge_of_a_dora_adapter_equals_peft(
    tiny_llama: Path, tmp_path: Path, family: str, dtype: torch.dtype
) -> None:
    """A DoRA adapter (`use_dora=True`: a magnitude per output feature beside the LoRA
    factors) was refused ("merge it with peft's merge_and_unload"). `ckpt merge` now merges it
    as peft's `DoraLinearVariant` does: the magnitude over the norm of each row of `W + ΔW`,
    times `W + ΔW`, bit for bit, on 16-bit bases and on GPT-2's `Conv1D` layers (`[in, out]`)."""
    from transformers import AutoModelForCausalLM

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    if family == "gpt2":
        _gpt2(tmp_path / "gpt2")
        source, targets = tmp_path / "gpt2", ["c_attn", "attn.c_proj", "c_fc"]
    else:
        source, targets = tiny_llama, ["q_proj", "v_proj", "down_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_pretrained(source, dtype=dtype).save_pretrained(base)
    _dora_adapter(base, adapter, targets, dtype)
    merged = _merge_like_peft(base, adapter, tmp_path, dtype)
    assert len(merged) == (6 if family == "llama" else 3)
    got, before = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(base / "model.safetensors"),
    )
    assert all(not torch.equal(got[n], before[n]) for n in merged)


def test_merge_refuses_the_dora_it_cannot_merge(tiny_llama: Path, tmp_path: Path) -> None:
    """DoRA on an embedding is not merged (refused by name, nothing written), and magnitudes
    under a config without `use_dora` (which peft would merge as plain LoRA, dropping them)
    are refused rather than guessed at."""
    on_embedding = tmp_path / "on-embedding"
    _dora_adapter(tiny_llama, on_embedding, ["embed_tokens", "q_proj"], torch.float32)
    result = run_ckpt("merge", tiny_llama, on_embedding, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    assert "DoRA adapter on the embedding 'model.embed_tokens'" in result.json["error"]["message"]
    assert not (tmp_path / "out").exists()

    unflagged = tmp_path / "unflagged"
    _dora_adapter(tiny_llama, unflagged, ["q_proj"], torch.float32)
    config = json.loads((unflagged / "adapter_config.json").read_text())
    (unflagged / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    result = run_ckpt("merge", tiny_llama, unflagged, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    assert "a DoRA magnitude, but adapter_config.json" in result.json["error"]["message"]
    assert not (tmp_path / "out").exists()


def _qwen2(folder: Path, dtype: torch.dtype) -> None:
    """A tiny Qwen2: a Llama whose q/k/v projections have biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(6)
    config = Qwen2Config(**{**tiny_config().to_dict(), "model_type": "qwen2"})
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_of_lora_bias_adds_it_into_the_base_bias_as_peft_does(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """`lora_bias=True` trains a bias on each `lora_B`, which `merge_and_unload` adds (scaled)
    into the base layer's bias. `ckpt merge` refused the adapter ("holds '...lora_B.bias', a
    LoRA tensor `ckpt merge` does not know"); it now merges it, bit for bit as peft."""
    from peft import LoraConfig, PeftModel
    from transformers import Qwen2ForCausalLM

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    _qwen2(base, dtype)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True)
    _trained_adapter(base, adapter, lora, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PeftModel.from_pretrained(
            Qwen2ForCausalLM.from_pretrained(base, dtype=dtype), adapter
        ).merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    merged = result.json["result"]["merged"]
    assert "model.layers.0.self_attn.q_proj.bias" in merged and len(merged) == 8
    want = load_file(tmp_path / "peft-merged" / "model.safetensors")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    before = load_file(base / "model.safetensors")
    assert not torch.equal(got[merged[0]], before[merged[0]])


def test_merge_refuses_lora_bias_for_a_base_layer_without_a_bias(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A `lora_bias` adapter (trained on a Qwen2, whose q_proj has a bias) merged into a Llama
    of the same shapes, whose q_proj has none: peft refuses the merge; so does `ckpt merge`,
    naming the layer, before anything is written."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    qwen, adapter = tmp_path / "qwen2", tmp_path / "adapter"
    _qwen2(qwen, torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(Qwen2ForCausalLM.from_pretrained(qwen), lora).save_pretrained(adapter)
    result = run_ckpt("merge", tiny_llama, adapter, tmp_path / "out", "--json")
    assert result.exit_code == 3, result.stdout
    assert "has no bias to merge it into" in result.json["error"]["message"]
    assert not (tmp_path / "out").exists()


def test_merge_names_every_file_of_base_and_adapter_it_does_not_carry(
    lora_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """Meta's Llama repositories hold `original/` (the same weights as `consolidated.00.pth`,
    unmerged): `merge` left it out without a word, where `convert` lists every file it does
    not carry. It now names each file of BASE and ADAPTER left out, with why (the adapter's
    model card too), in both the report and on stderr; the merged model's files are as
    before."""
    base = shutil.copytree(tiny_llama, tmp_path / "base")
    (base / "original").mkdir()
    torch.save({"w": torch.zeros(2)}, base / "original" / "consolidated.00.pth")
    (base / "original" / "params.json").write_text('{"dim": 16}')
    (base / "modeling_custom.py").write_text("# remote code\n")
    adapter = shutil.copytree(lora_adapter, tmp_path / "adapter")
    (adapter / "README.md").write_text("# my adapter\n")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    assert set(skipped) == {
        "original/consolidated.00.pth",
        "original/params.json",
        f"{adapter}/README.md",
    }
    assert "subfolder" in skipped["original/params.json"]
    assert "adapter folder" in skipped[f"{adapter}/README.md"]
    written = {p.name for p in (tmp_path / "merged").iterdir()}
    assert "modeling_custom.py" in written and "original" not in written
    human = run_ckpt("merge", base, adapter, tmp_path / "again")
    assert human.exit_code == 0, human.stderr
    assert "not in the output: original/consolidated.00.pth" in human.stderr


def _moe(folder: Path, family: str, dtype: torch.dtype) -> None:
    """A tiny MoE as transformers 5 builds it: each layer's experts one `[E, ...]` stack per
    projection (`mlp.experts.gate_up_proj`, `down_proj`). save_pretrained writes a Qwen3-MoE's
    stacks back one tensor per expert (`experts.0.gate_proj.weight`...), a gpt-oss's whole and
    transposed (`[E, in, out]`; here square, `hidden_size == 2 * intermediate_size`, so only the
    model type tells its layout)."""
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

    torch.manual_seed(11)
    shared = {"vocab_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = (
        Qwen3MoeConfig(
            **shared,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=8,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
        )
        if family == "qwen3_moe"
        else GptOssConfig(
            **shared,
            hidden_size=32,
            intermediate_size=16,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            layer_types=["full_attention"] * 2,
        )
    )
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3_moe", torch.bfloat16), ("qwen3_moe", torch.float32), ("gpt_oss", torch.bfloat16)],
)
def test_merge_of_lora_on_moe_expert_stacks_equals_peft(
    tmp_path: Path, family: str, dtype: torch.dtype
) -> None:
    """LoRA on a MoE layer's experts (`target_parameters=["mlp.experts.gate_up_proj", ...]`,
    peft's way to adapt the 3-D expert stacks of transformers 5, as in the gpt-oss fine-tuning
    recipes) was refused: "the adapter targets '...mlp.experts.base_layer', which has no weight
    in the base". `ckpt merge` now merges each `ParamWrapper` as peft does (the factors read
    expert by expert, the delta rounded into the stack's dtype, then added), into a stack saved
    whole (gpt-oss, transposed) or one tensor per expert (Qwen3-MoE), bit for bit."""
    from peft import LoraConfig

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    _moe(base, family, dtype)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    _trained_adapter(base, adapter, lora, dtype)
    label = run_ckpt("inspect", adapter).stdout
    assert "targets q_proj; parameters mlp.experts.down_proj, mlp.experts.gate_up_proj" in label
    merged = _merge_like_peft(base, adapter, tmp_path, dtype)
    # 2 layers: q_proj, and each expert projection (Qwen3-MoE: 4 experts x 3) or stack (2)
    assert len(merged) == (2 + 2 * 12 if family == "qwen3_moe" else 2 + 2 * 2)
    got, before = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(base / "model.safetensors"),
    )
    assert all(not torch.equal(got[n], before[n]) for n in merged)


def test_merge_of_lora_on_a_2d_target_parameter_rounds_as_peft_does(tmp_path: Path) -> None:
    """A 2-D weight named by `target_parameters` (`self_attn.q_proj.weight`) is updated by a
    `ParamWrapper`, which rounds the delta into the bf16 weight before adding it (two
    roundings), where `lora.Linear` adds the float32 delta and rounds once: merged as the
    latter, about a third of the values were one ulp off `merge_and_unload`'s."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from .framework_fixtures import tiny_config

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    torch.manual_seed(13)
    AutoModelForCausalLM.from_config(tiny_config()).to(torch.bfloat16).save_pretrained(base)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[],
        target_parameters=["self_attn.q_proj.weight", "mlp.up_proj.weight"],
    )
    _trained_adapter(base, adapter, lora, torch.bfloat16)
    assert len(_merge_like_peft(base, adapter, tmp_path, torch.bfloat16)) == 4


def test_merge_refuses_expert_factors_that_fit_no_targeted_stack(tmp_path: Path) -> None:
    """An adapter whose expert factors fit none of the stacks its `target_parameters` names
    there (trained on a MoE of another width) is refused by name, nothing written."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    _moe(base, "qwen3_moe", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.down_proj"])
        get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("experts.lora_A.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, adapter / "adapter_model.safetensors")
    result = run_ckpt("merge", base, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 4, result.stdout
    message = result.json["error"]["message"]
    assert "fit none of the parameters target_parameters names there" in message
    assert "mlp.experts.down_proj [4, 32, 8]" in message
    assert not (tmp_path / "merged").exists()

    # a base storing its experts under names transformers renames on load (Mixtral's w2)
    renamed = load_file(base / "model.safetensors")
    renamed = {n.replace(".down_proj.weight", ".w2.weight"): t for n, t in renamed.items()}
    save_file(renamed, base / "model.safetensors", metadata={"format": "pt"})
    result = run_ckpt("merge", base, tmp_path / "adapter", tmp_path / "merged", "--json")
    assert result.exit_code == 3, result.stdout
    message = result.json["error"]["message"]
    assert "model.layers.0.mlp.experts.down_proj (target_parameters)" in message
    assert "neither under that name nor one tensor per expert" in message
    assert not (tmp_path / "merged").exists()


def test_merge_refuses_lora_on_an_expert_stack_stored_quantized(tmp_path: Path) -> None:
    """gpt-oss ships its expert stacks in MXFP4 (`gate_up_proj_blocks` / `_scales`): LoRA on
    them (`target_parameters`) is refused by the scheme, with the dequantize-first fix, as
    every quantized LoRA target is, not as a stack "stored neither whole nor per expert"."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base, adapter, quantized = tmp_path / "base", tmp_path / "adapter", tmp_path / "mxfp4"
    _moe(base, "gpt_oss", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj"])
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        get_peft_model(model, lora).save_pretrained(adapter)
    shutil.copytree(base, quantized)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(base / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows, cols = tensor.shape
            tensors[name + "_blocks"] = torch.zeros(
                experts, cols, rows // 32, 16, dtype=torch.uint8
            )
            tensors[name + "_scales"] = torch.full(
                (experts, cols, rows // 32), 127, dtype=torch.uint8
            )
        else:
            tensors[name] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(config))
    result = run_ckpt("merge", quantized, adapter, tmp_path / "merged", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert (
        "'model.layers.0.mlp.experts.gate_up_proj_blocks' is quantized (MXFP4" in error["message"]
    )
    assert "--dequantize" in error["fix"]
    assert not (tmp_path / "merged").exists()


def _two_adapters(base: Path, folder: Path) -> None:
    """`PeftModel.save_pretrained` of a model with two LoRA adapters: `default` at the root,
    `second` in `second/`, as peft lays out every adapter but the default one."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    first = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), first)
    second = LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"], init_lora_weights=False)
    model.add_adapter("second", second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)


def _load_both(base: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Both adapters as peft loads them: the root one, then `second/` by its name."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), folder)
        model.load_adapter(str(folder / "second"), adapter_name="second")
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_merge_of_a_multi_adapter_folder_names_the_other_adapter_it_leaves(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`merge BASE FOLDER` merges the folder's default adapter, as peft's
    `PeftModel.from_pretrained(base, FOLDER).merge_and_unload()` does, and listed `second/`'s
    files as "its card, or training state saved beside it". They are another adapter of the
    folder, named so, with the command that merges it; that command merges it as peft does."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    folder = tmp_path / "adapters"
    _two_adapters(tiny_llama, folder)
    result = run_ckpt("merge", tiny_llama, folder, tmp_path / "merged", "--json")
    assert result.exit_code == 0, result.stdout
    skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    for rel in ("second/adapter_config.json", "second/adapter_model.safetensors"):
        reason = skipped[f"{folder}/{rel}"]
        assert "card" not in reason and "another adapter of the folder ('second'," in reason
        assert f"ckpt merge BASE {folder}/second" in reason
    assert "card" in skipped[f"{folder}/README.md"]
    alone = run_ckpt("merge", tiny_llama, folder / "second", tmp_path / "second", "--json")
    assert alone.exit_code == 0, alone.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = LlamaForCausalLM.from_pretrained(tiny_llama)
        model = PeftModel.from_pretrained(base, folder / "second").merge_and_unload()
    expected = model.state_dict()
    merged = load_file(tmp_path / "second" / "model.safetensors")
    for name in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ):
        assert torch.equal(merged[name], expected[name]), name


def test_every_adapter_of_a_multi_adapter_folder_is_diffed_and_converted(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """peft saves every adapter but the default one in a subfolder named after it. ckpt read
    the root adapter alone: `diff` said IDENTICAL of two folders whose `second` adapters
    differ, and `convert --dtype bf16` cast the root adapter and listed `second/` as "in a
    subfolder ckpt does not read". Every adapter is now a component: diffed, converted with
    every option, and loaded by peft from the output."""
    from safetensors.torch import save_file

    folder = tmp_path / "adapters"
    _two_adapters(tiny_llama, folder)
    listed = run_ckpt("inspect", folder, "--json")
    assert listed.exit_code == 0, listed.stderr
    names = {e["name"] for e in listed.json["result"]["entries"]}
    assert any(n.startswith("second.") for n in names)
    assert any(n.startswith("default.") for n in names)

    changed = shutil.copytree(folder, tmp_path / "changed")
    weights = changed / "second" / "adapter_model.safetensors"
    tensors = {k: v + 1 for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    diffed = run_ckpt("diff", folder, changed, "--json")
    assert diffed.exit_code == 1, diffed.stdout
    assert {d["name"].split(".")[0] for d in diffed.json["result"]["differences"]} == {"second"}
    assert run_ckpt("diff", folder, changed, "--select", "default").exit_code == 0

    out = tmp_path / "bf16"
    dry = run_ckpt("convert", folder, out, "--to", "safetensors", "--dtype", "bf16", "-n", "--json")
    assert dry.exit_code == 0, dry.stdout + dry.stderr
    assert not out.exists()
    result = run_ckpt("convert", folder, out, "--to", "safetensors", "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert {f["path"] for f in dry.json["result"]["files"]} == {
        f["path"] for f in result.json["result"]["files"]
    }
    assert not [s for s in result.json["result"]["skipped"] if s["kind"] == "file"]
    for adapter in (out, out / "second"):
        saved = load_file(adapter / "adapter_model.safetensors")
        assert saved and {t.dtype for t in saved.values()} == {torch.bfloat16}
    expected = {k: v.to(torch.bfloat16) for k, v in _load_both(tiny_llama, folder).items()}
    got = _load_both(tiny_llama, out)
    assert got.keys() == expected.keys() and any("second" in k for k in got)
    assert all(torch.equal(got[k].to(torch.bfloat16), expected[k]) for k in expected)
    assert run_ckpt("diff", folder, out, "--ignore-dtype", "--atol", "1e-2").exit_code == 0
    # peft loads one file per adapter: a size that would cut one is refused, nothing written
    cut = run_ckpt("reshard", folder, tmp_path / "cut", "--max-shard-size", "1KB", "--json")
    assert cut.exit_code == 2, cut.stdout
    assert "adapter_model" in cut.json["error"]["message"] and not (tmp_path / "cut").exists()


def test_merge_into_a_diffusers_unet_keeps_the_names_diffusers_loads(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """A LoRA trained with peft on a pipeline's UNet (`get_peft_model(unet)`, as diffusion
    training scripts wrap it) merged into the UNet's folder: the output keeps diffusers' names
    (`diffusion_pytorch_model.fp16-0000k-of-0000n.safetensors`, its variant index), so
    `UNet2DConditionModel.from_pretrained(DEST, variant="fp16")` loads what peft merges."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, PeftModel, get_peft_model

    base = fp16_variant_pipeline / "unet"

    def load_unet() -> Any:
        return UNet2DConditionModel.from_pretrained(base, variant="fp16", torch_dtype=torch.float16)

    adapter = tmp_path / "adapter"
    torch.manual_seed(3)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(load_unet(), config).save_pretrained(adapter)
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, adapter, out, "--json")
    assert result.exit_code == 0, result.stdout
    names = {p.name for p in out.iterdir()}
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in names
    assert "model.safetensors" not in names and "config.json" in names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = PeftModel.from_pretrained(load_unet(), adapter).merge_and_unload().state_dict()
        got = UNet2DConditionModel.from_pretrained(
            out, variant="fp16", torch_dtype=torch.float16
        ).state_dict()
    assert want.keys() == got.keys()
    merged = result.json["result"]["merged"]
    assert merged and all(n.endswith((".to_q.weight", ".to_v.weight")) for n in merged)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_merge_of_a_diffusers_lora_file_says_what_it_is_and_how_to_fuse_it(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """diffusers saves a LoRA as one `pytorch_lora_weights.safetensors` (`save_lora_adapter`,
    the training scripts' `save_lora_weights`), no adapter_config.json: merge refuses it as
    the diffusers LoRA it is (exit 4), naming diffusers' own fuse, not as a missing peft
    folder, for the folder and for the file alike; nothing is written."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    base = fp16_variant_pipeline / "unet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = UNet2DConditionModel.from_pretrained(base, variant="fp16")
        unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
        unet.save_lora_adapter(tmp_path / "lora")
    weights = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    assert weights.is_file()
    for adapter in (tmp_path / "lora", weights):
        out = tmp_path / "merged"
        result = run_ckpt("merge", base, adapter, out)
        assert result.exit_code == 4, result.stderr
        assert "diffusers LoRA" in result.stderr and "fuse_lora" in result.stderr
        assert not out.exists()


def test_merge_into_a_pipeline_names_the_component_the_adapter_was_trained_on(
    fp16_variant_pipeline: Path, tmp_path: Path
) -> None:
    """BASE given as the pipeline's root, an adapter of its UNet: refused (exit 2) naming the
    `unet` component (peft records the class it wrapped, `UNet2DConditionModel`, as
    model_index.json does), not some other subfolder, and the fix it gives works."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig, get_peft_model

    adapter = tmp_path / "adapter"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["to_q"], init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = UNet2DConditionModel.from_pretrained(fp16_variant_pipeline / "unet", variant="fp16")
        get_peft_model(unet, config).save_pretrained(adapter)
    # inspect says what the adapter was trained on: peft names no base model, but its class
    described = run_ckpt("inspect", adapter, "--json").json["result"]["layout"]["description"]
    assert "LoRA adapter for a UNet2DConditionModel" in described, described
    out = tmp_path / "merged"
    result = run_ckpt("merge", fp16_variant_pipeline, adapter, out, "--json")
    assert result.exit_code == 2, result.stdout
    error = result.json["error"]
    assert "UNet2DConditionModel" in error["message"] and "unet component" in error["message"]
    assert f"{fp16_variant_pipeline}/unet" in error["fix"] and "vae" not in error["fix"]
    assert not out.exists()
    # the fix: a copy of the pipeline, its unet replaced by the merge
    shutil.copytree(fp16_variant_pipeline, out)
    merged = run_ckpt("merge", fp16_variant_pipeline / "unet", adapter, out / "unet", "--force")
    assert merged.exit_code == 0, merged.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe: Any = DiffusionPipeline.from_pretrained(out, variant="fp16")
        original: Any = DiffusionPipeline.from_pretrained(fp16_variant_pipeline, variant="fp16")
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    assert not torch.equal(pipe.unet.state_dict()[name], original.unet.state_dict()[name])


def _trained_variant(base: Path, adapter: Path, config: Any, dtype: torch.dtype) -> None:
    """An IA³ / LoHa / LoKr adapter (`config`) on the model at `base` as training leaves it:
    every adapter tensor moved away from its initial value (IA³ starts at ones, LoHa / LoKr
    with one factor at zero)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(part in name for part in ("ia3_l", "hada_", "lokr_")):
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(adapter)


def _variant_config(variant: str) -> Any:
    """The adapter configs users train on a Llama, one per form of layer peft builds."""
    from peft import IA3Config, LoHaConfig, LoKrConfig

    configs: dict[str, Any] = {
        # k/v scale outputs, down_proj (feedforward) its inputs
        "ia3": lambda: IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "loha": lambda: LoHaConfig(
            r=4,
            alpha=8,
            target_modules=["q_proj", "v_proj", "up_proj"],
            rank_pattern={"up_proj": 2},
            alpha_pattern={"v_proj": 3},
        ),
        # whole w1 and w2 (`r` large for the factors of a 16-wide layer)
        "lokr": lambda: LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
        # w2 low rank where it is wide enough, factors of 4
        "lokr-factor": lambda: LoKrConfig(
            r=2,
            alpha=8,
            target_modules=["q_proj", "up_proj", "down_proj"],
            decompose_both=True,
            decompose_factor=4,
        ),
        # w1 and w2 both low rank (`decompose_both`, r=1)
        "lokr-both": lambda: LoKrConfig(
            r=1, alpha=3, target_modules=["q_proj", "v_proj"], decompose_both=True
        ),
    }
    return configs[variant]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["ia3", "loha", "lokr", "lokr-factor", "lokr-both"])
def test_merge_of_ia3_loha_and_lokr_adapters_equals_peft(
    tiny_llama: Path, tmp_path: Path, variant: str, dtype: torch.dtype
) -> None:
    """IA³, LoHa and LoKr adapters were refused by `peft_type` ("merge it with peft's
    merge_and_unload"). They are merged now, weight by weight, as peft's layers merge them:
    the output equals `merge_and_unload()` + `save_pretrained` bit for bit, fp32 and bf16."""
    from transformers import AutoModelForCausalLM

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype).save_pretrained(base)
    _trained_variant(base, adapter, _variant_config(variant), dtype)
    merged = _merge_like_peft(base, adapter, tmp_path, dtype)
    assert len(merged) == (4 if variant == "lokr-both" else 6)
    got = load_file(tmp_path / "merged" / "model.safetensors")
    before = load_file(base / "model.safetensors")
    assert all(not torch.equal(got[n], before[n]) for n in merged)
    label = {"ia3": "IA³", "loha": "LoHa"}.get(variant, "LoKr")
    human = run_ckpt("merge", base, adapter, tmp_path / "again").stdout
    assert f"  {label}" in human and "None" not in human


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_merge_of_ia3_scales_conv1d_layers_and_biases_as_peft_does(
    tmp_path: Path, family: str
) -> None:
    """IA³ on GPT-2's `Conv1D` layers (weight `[in, out]`: peft transposes the vector, whatever
    `fan_in_fan_out` says) and on Qwen2's q/k/v projections, whose biases a non-feedforward
    vector scales too: bit for bit what `merge_and_unload` gives."""
    from peft import IA3Config

    base = tmp_path / "base"
    if family == "gpt2":
        _gpt2(base)
        # attn.c_proj's weight is square: its orientation is told by the model type
        config = IA3Config(
            target_modules=["c_attn", "c_proj", "mlp.c_proj", "c_fc"],
            feedforward_modules=["mlp.c_proj"],
        )
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
        _qwen2(base, dtype)
        config = IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        )
    adapter = tmp_path / "adapter"
    _trained_variant(base, adapter, config, dtype)
    merged = _merge_like_peft(base, adapter, tmp_path, dtype)
    biases = [n for n in merged if n.endswith(".bias")]
    # GPT-2: c_attn, attn.c_proj and c_fc's biases (mlp.c_proj is feedforward); Qwen2: k/v
    # of two layers
    assert len(biases) == (3 if family == "gpt2" else 4), merged


def _tiny_unet(folder: Path) -> None:
    tiny_unet().save_pretrained(folder)


@pytest.mark.parametrize("variant", ["ia3", "loha-effective", "loha", "lokr-effective", "lokr"])
def test_merge_of_ia3_loha_and_lokr_on_a_unet_convolutions_equals_peft(
    tmp_path: Path, variant: str
) -> None:
    """The adapters diffusion fine-tunes train on a UNet's convolutions: IA³ (a channel vector),
    LoHa and LoKr flat or in their CP form (`use_effective_conv2d`: `hada_t1` / `lokr_t2`
    beside the factors; a 1x1 convolution stays flat), merged into the fp16 UNet folder bit for
    bit as `merge_and_unload`, loaded by `UNet2DConditionModel.from_pretrained`."""
    from diffusers import UNet2DConditionModel
    from peft import IA3Config, LoHaConfig, LoKrConfig, PeftModel, get_peft_model

    fp32, base = tmp_path / "unet-fp32", tmp_path / "unet"
    _tiny_unet(fp32)
    UNet2DConditionModel.from_pretrained(fp32, torch_dtype=torch.float16).save_pretrained(base)
    convolutions = ["conv1", "conv2", "conv_in", "conv_shortcut", "to_k"]
    effective = variant.endswith("-effective")
    config = {
        "ia3": lambda: IA3Config(target_modules=convolutions, feedforward_modules=["conv2"]),
        "loha": lambda: LoHaConfig(
            r=2, alpha=4, target_modules=convolutions, use_effective_conv2d=effective
        ),
        "lokr": lambda: LoKrConfig(
            r=1,
            alpha=3,
            target_modules=convolutions,
            use_effective_conv2d=effective,
            decompose_both=True,
        ),
    }[variant.removesuffix("-effective")]()

    def load() -> Any:
        return UNet2DConditionModel.from_pretrained(base, torch_dtype=torch.float16)

    adapter = tmp_path / "adapter"
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(load(), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if any(part in name for part in ("ia3_l", "hada_", "lokr_")):
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(adapter)
        want = PeftModel.from_pretrained(load(), adapter).merge_and_unload().state_dict()
    held = load_file(adapter / "adapter_model.safetensors")
    assert any(k.endswith((".hada_t1", ".lokr_t2")) for k in held) == effective
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, adapter, out, "--json")
    assert result.exit_code == 0, result.stdout
    assert any(".conv1." in n for n in result.json["result"]["merged"])
    got = UNet2DConditionModel.from_pretrained(out, torch_dtype=torch.float16).state_dict()
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def _without(adapter: Path, copy: Path, suffix: str) -> Path:
    """A copy of `adapter` whose file lacks the first tensor named `…suffix`."""
    from safetensors.torch import save_file

    shutil.copytree(adapter, copy)
    tensors = load_file(adapter / "adapter_model.safetensors")
    dropped = next(k for k in sorted(tensors) if k.endswith(suffix))
    save_file(
        {k: v for k, v in tensors.items() if k != dropped},
        str(copy / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return copy


def test_merge_refuses_the_ia3_loha_and_lokr_adapters_peft_would_not_load(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """What peft cannot build or load is refused by name, exit 4, nothing written: factors of
    another rank than adapter_config.json's (scaled wrong), an alpha that is no number, an IA³
    vector its config's `feedforward_modules` does not describe, a LoHa layer missing a
    factor. `--dry-run` plans the good one and writes nothing."""
    loha, ia3 = tmp_path / "loha", tmp_path / "ia3"
    _trained_variant(tiny_llama, loha, _variant_config("loha"), torch.float32)
    _trained_variant(tiny_llama, ia3, _variant_config("ia3"), torch.float32)

    def edited(adapter: Path, name: str, change: dict[str, Any]) -> Path:
        copy = shutil.copytree(adapter, tmp_path / name)
        config = json.loads((copy / "adapter_config.json").read_text())
        (copy / "adapter_config.json").write_text(json.dumps({**config, **change}))
        return copy

    cases = [
        (edited(loha, "rank", {"r": 3}), "have rank 4, adapter_config.json says r=3"),
        (edited(loha, "alpha", {"alpha": "8"}), "alpha must be a finite number"),
        (edited(ia3, "ff", {"feedforward_modules": []}), "does not scale the output features"),
        (_without(loha, tmp_path / "half", ".hada_w2_b"), "not a set of LoHa tensors"),
    ]
    out = tmp_path / "out"
    for adapter, said in cases:
        result = run_ckpt("merge", tiny_llama, adapter, out, "--json")
        assert result.exit_code == 4, result.stdout
        assert said in result.json["error"]["message"], result.json["error"]
        assert result.json["error"]["fix"]
        assert not out.exists()
    planned = run_ckpt("merge", tiny_llama, loha, out, "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout
    report = planned.json["result"]
    assert report["dry_run"] and report["adapter_type"] == "LoHa" and len(report["merged"]) == 6
    assert report["r"] == 4 and report["lora_alpha"] == 8
    assert not out.exists()


def test_an_ia3_loha_or_lokr_adapter_is_labelled_with_its_own_settings(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`inspect` of a LoHa / LoKr adapter gave its rank but not its alpha (their config says
    `alpha`, not `lora_alpha`), and of an IA³ adapter not which layers are feedforward (whose
    inputs it scales): both are said now, with LoKr's decomposition in `--json`."""
    from peft import LoKrConfig

    ia3, loha, lokr = tmp_path / "ia3", tmp_path / "loha", tmp_path / "lokr"
    _trained_variant(tiny_llama, ia3, _variant_config("ia3"), torch.float32)
    _trained_variant(tiny_llama, loha, _variant_config("loha"), torch.float32)
    config = LoKrConfig(
        r=2, alpha=6, target_modules=["q_proj"], decompose_both=True, decompose_factor=4
    )
    _trained_variant(tiny_llama, lokr, config, torch.float32)

    human = run_ckpt("inspect", ia3).stdout
    assert "IA³ adapter for" in human and "feedforward down_proj" in human, human
    details = run_ckpt("inspect", ia3, "--json").json["result"]["layout"]["details"]
    assert details["peft_type"] == "IA3" and details["feedforward_modules"] == ["down_proj"]

    human = run_ckpt("inspect", loha).stdout
    assert "LoHa adapter for" in human and "r=4" in human and "alpha=8" in human, human
    details = run_ckpt("inspect", loha, "--json").json["result"]["layout"]["details"]
    assert details["alpha"] == 8 and details["rank_pattern"] == {"up_proj": 2}

    human = run_ckpt("inspect", lokr).stdout
    assert "LoKr adapter for" in human and "r=2" in human and "alpha=6" in human, human
    details = run_ckpt("inspect", lokr, "--json").json["result"]["layout"]["details"]
    assert details["decompose_both"] is True and details["decompose_factor"] == 4


@pytest.mark.parametrize("variant", ["ia3", "lokr", "dora"])
def test_a_framework_naming_of_an_ia3_lokr_or_dora_adapter_points_to_ckpt_merge(
    tiny_llama: Path, tmp_path: Path, variant: str
) -> None:
    """`convert ADAPTER --to hf` of an IA³, LoHa, LoKr or DoRA adapter sent the user to peft's
    `merge_and_unload()`, though `ckpt merge` merges them; it names `ckpt merge` now, and the
    merged model converts."""
    adapter = tmp_path / "adapter"
    if variant == "dora":
        _dora_adapter(tiny_llama, adapter, ["q_proj"], torch.float32)
    else:
        _trained_variant(tiny_llama, adapter, _variant_config(variant), torch.float32)
    result = run_ckpt("convert", adapter, tmp_path / "out", "--to", "hf", "--json")
    assert result.exit_code == 4, result.stdout
    assert f"`ckpt merge BASE {adapter} MERGED`" in result.json["error"]["fix"]
    merged = tmp_path / "merged"
    assert run_ckpt("merge", tiny_llama, adapter, merged).exit_code == 0
    assert run_ckpt("convert", merged, tmp_path / "hf", "--to", "hf").exit_code == 0


@pytest.mark.parametrize("variant", ["ia3-on-head", "loha-head-saved", "lokr-on-head"])
def test_merge_of_ia3_loha_and_lokr_with_an_output_head_equals_peft(
    tiny_llama: Path, tmp_path: Path, variant: str
) -> None:
    """The output head of a base that ties it to its embedding, as these adapters touch it:
    IA³ on `lm_head` (peft saves the head whole beside the vector and scales the one shared
    tensor; it was refused, exit 3, "no weight in the base"), a `modules_to_save` copy of it
    beside LoHa layers (peft unties the pair) and LoKr on an untied head. Each equals
    `merge_and_unload()` + `save_pretrained` as `from_pretrained` loads both."""
    from peft import IA3Config, LoHaConfig, LoKrConfig
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        if variant != "lokr-on-head":
            model.config.tie_word_embeddings = True
            model.tie_weights()
        model.save_pretrained(base)
    config = {
        "ia3-on-head": lambda: IA3Config(
            target_modules=["k_proj", "lm_head"], feedforward_modules=[]
        ),
        "loha-head-saved": lambda: LoHaConfig(
            r=2, alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"]
        ),
        "lokr-on-head": lambda: LoKrConfig(r=2, alpha=4, target_modules=["q_proj", "lm_head"]),
    }[variant]()
    adapter = tmp_path / "adapter"
    _trained_variant(base, adapter, config, torch.float32)
    if variant == "loha-head-saved":
        # the trained copy of the head, as training leaves it
        from safetensors.torch import save_file

        tensors = load_file(adapter / "adapter_model.safetensors")
        tensors["base_model.model.lm_head.weight"] += 0.5
        save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, adapter, out, "--json")
    assert result.exit_code == 0, result.stdout
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = (
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
            .merge_and_unload()
            .state_dict()
        )
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    assert result.json["result"]["replaced"] or variant == "lokr-on-head"


@pytest.mark.parametrize("variant", ["ia3", "lokr"])
def test_merge_refuses_an_ia3_or_lokr_adapter_trained_on_a_shallower_base(
    tiny_llama: Path, tmp_path: Path, variant: str
) -> None:
    """As for LoRA: the 2-layer tiny Llama's IA³ / LoKr adapter merged into a 3-layer Llama of
    the same width fits every weight it holds, and `merge` wrote a model whose third layer
    was never adapted, exit 0. Layers its own `target_modules` selects but it holds nothing
    for mean another base: refused, exit 4, nothing written."""
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    adapter = tmp_path / "adapter"
    _trained_variant(tiny_llama, adapter, _variant_config(variant), torch.float32)
    config = tiny_config()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    deeper = tmp_path / "deeper"
    LlamaForCausalLM(config).save_pretrained(deeper)
    result = run_ckpt("merge", deeper, adapter, tmp_path / "out", "--json")
    assert result.exit_code == 4, result.stdout
    error = result.json["error"]
    assert "model.layers.2." in error["message"] and "trained on" in error["fix"]
    label = "IA³" if variant == "ia3" else "LoKr"
    assert f"holds no {label} weights for it" in error["message"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_merge_refuses_an_ia3_adapter_on_a_quantized_weight_in_its_own_words(
    tiny_llama: Path, tmp_path: Path, scheme: str
) -> None:
    """An IA³ vector multiplied into quantized codes is wrong data as a LoRA delta added to
    them is: refused by the weight and its scheme, exit 4; the message spoke of "a LoRA
    update" to the user of an IA³ adapter."""
    from peft import IA3Config

    adapter = tmp_path / "adapter"
    config = IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
    _trained_variant(tiny_llama, adapter, config, torch.float32)
    base = tmp_path / "base"
    said = _quantize_q_proj(tiny_llama, base, scheme)
    out = tmp_path / "merged"
    result = run_ckpt("merge", base, adapter, out, "--json")
    assert result.exit_code == 4, result.stdout
    message = result.json["error"]["message"]
    assert "'model.layers.0.self_attn.q_proj.weight'" in message and said in message
    assert "IA³" in message and "LoRA" not in message, message
    assert "Dequantize" in result.json["error"]["fix"]
    assert not out.exists()


class _Convolutions(torch.nn.Module):
    """A model of 1-D convolutions (as audio encoders have) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv1d(8, 16, 3)
        self.second = torch.nn.Conv1d(16, 16, 5)
        self.head = torch.nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)).mean(-1))


@pytest.mark.parametrize("variant", ["loha", "lokr"])
def test_merge_of_loha_and_lokr_on_1d_convolutions(tmp_path: Path, variant: str) -> None:
    """LoHa in its CP form on `Conv1d` layers merges bit for bit as peft's does. LoKr in that
    form (`use_effective_conv2d`) on a `Conv1d` is one peft cannot merge itself (torch.kron
    fails in its `get_delta_weight`); `ckpt merge` said "check that the adapter was trained on
    this base model". It names the layer and the peft setting now, exit 4, nothing written."""
    from peft import LoHaConfig, LoKrConfig, get_peft_model
    from safetensors.torch import save_file

    torch.manual_seed(0)
    base = tmp_path / "base"
    base.mkdir()
    state = _Convolutions().state_dict()
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    model = _Convolutions()
    model.load_state_dict(state)
    targets = ["first", "second", "head"]
    config = (
        LoHaConfig(r=2, alpha=4, target_modules=targets, use_effective_conv2d=True)
        if variant == "loha"
        else LoKrConfig(
            r=1, alpha=4, target_modules=targets, use_effective_conv2d=True, decompose_both=True
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for _, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    adapter, out = tmp_path / "adapter", tmp_path / "merged"
    peft_model.save_pretrained(adapter)
    result = run_ckpt("merge", base, adapter, out, "--json")
    if variant == "lokr":
        with pytest.raises(RuntimeError):
            peft_model.merge_and_unload()
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert "'first'" in error["message"] and "use_effective_conv2d" in error["message"]
        assert "use_effective_conv2d=False" in error["fix"]
        assert not out.exists()
        return
    assert result.exit_code == 0, result.stdout
    want = peft_model.merge_and_unload().state_dict()
    got = load_file(out / "model.safetensors")
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_diff_compares_the_module_sets_of_an_adapter_config_as_sets(
    lora_adapter: Path, tmp_path: Path
) -> None:
    """A LoRA run resumed with `Trainer.train(resume_from_checkpoint=...)` writes the same
    adapter as the run that never stopped, but peft holds `target_modules` as a set and writes
    it in the process's hash order (`PYTHONHASHSEED`): `adapter_config.json` said
    `["v_proj", "q_proj"]` in one save and `["q_proj", "v_proj"]` in the other, and
    `ckpt diff` (the restart test's judge) said DIFFERENT, exit 1, of two bit-identical
    adapters. The module sets are compared as sets; a module added is still a difference."""
    resumed = shutil.copytree(lora_adapter, tmp_path / "resumed")
    config_file = resumed / "adapter_config.json"
    config = json.loads(config_file.read_text())
    # what the other process writes: the same set, in its own order
    config["target_modules"] = list(reversed(config["target_modules"]))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    same = run_ckpt("diff", lora_adapter, resumed, "--json")
    assert same.exit_code == 0, same.stdout + same.stderr
    assert same.json["result"]["identical"] is True

    config["target_modules"] = ["q_proj", "v_proj", "k_proj"]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    grown = run_ckpt("diff", lora_adapter, resumed)
    assert grown.exit_code == 1
    assert "adapter_config.json:target_modules" in grown.stdout
