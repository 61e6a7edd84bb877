"""From training to serving and back (#27): `convert --to hf` / `--to torchtitan`.

tests/torchtitan_arch_script.py builds tiny torchtitan 0.3.0 models (Llama 3 with GQA and
llama3 rope scaling, Qwen3 with q/k norms, Qwen3-MoE) on CPU, takes one AdamW step and saves
`step-1/` with torchtitan's own `CheckpointManager.save`; it also writes torchtitan's own
`StateDictAdapter.to_hf` of the model and its forward on fixed ids. An export must equal the
adapter's tensors bit for bit and `AutoModelForCausalLM.from_pretrained(DEST)` must give the
torchtitan logits; an import must load with `CheckpointManager.load` and train a step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import run_ckpt
from .dist_helpers import torchrun_env

SCRIPT = Path(__file__).with_name("torchtitan_arch_script.py")


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# --------------------------------------------------------------------------- no frameworks


def _llama_hf(folder: Path, *, heads: int = 4, kv_heads: int = 2, layers: int = 2) -> None:
    """A tiny HF-named Llama (random tensors, safetensors) with its config.json."""
    dim, head_dim, vocab, ffn = heads * 8, 8, 40, 48
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, dim, generator=gen)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (heads * head_dim, dim),
            "self_attn.k_proj.weight": (kv_heads * head_dim, dim),
            "self_attn.v_proj.weight": (kv_heads * head_dim, dim),
            "self_attn.o_proj.weight": (dim, heads * head_dim),
            "mlp.gate_proj.weight": (ffn, dim),
            "mlp.up_proj.weight": (ffn, dim),
            "mlp.down_proj.weight": (dim, ffn),
            "input_layernorm.weight": (dim,),
            "post_attention_layernorm.weight": (dim,),
        }
        for name, shape in shapes.items():
            tensors[p + name] = torch.randn(*shape, generator=gen)
    tensors["model.norm.weight"] = torch.randn(dim, generator=gen)
    tensors["lm_head.weight"] = torch.randn(vocab, dim, generator=gen)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "intermediate_size": ffn,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_a_family_with_no_megatron_naming_is_refused_naming_the_namings_it_has(
    tmp_path: Path,
) -> None:
    """`--to megatron` of a torchtitan Qwen3-MoE (a family ckpt maps between hf and torchtitan
    only) mapped it to Hugging Face's names first and then failed with "no mapping from the hf
    naming to the megatron naming", a naming the user never named. It is refused up front: no
    megatron naming, which ones there are, and the --to that works."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        vocab_size=40,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    titan = tmp_path / "titan"
    assert run_ckpt("convert", tmp_path / "qwen3", titan, "--to", "torchtitan").exit_code == 0
    out = tmp_path / "megatron"
    r = run_ckpt("convert", titan, out, "--to", "megatron")
    assert r.exit_code == 4, r.stdout + r.stderr
    said = " ".join(r.stderr.split())
    assert "Qwen3-MoE has no megatron naming: ckpt knows it in hf, torchtitan, gguf names" in said
    # llama.cpp's naming is one ckpt reads (a GGUF's), never one it writes
    assert "--to hf" in r.stderr and "hf naming" not in r.stderr and "--to gguf" not in r.stderr
    assert not out.exists()


def test_a_torchtitan_moe_without_load_balancing_diffs_identical_in_its_naming(
    tmp_path: Path,
) -> None:
    """A torchtitan Qwen3-MoE trained without load balancing (`load_balance_coeff=None`)
    saves no `expert_bias_E`; compared in torchtitan names with its Hugging Face model, the
    zeros the mapping fills in for the HF side are no difference when it holds none."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=40,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    titan = tmp_path / "titan"
    assert run_ckpt("convert", tmp_path / "hf", titan, "--to", "torchtitan").exit_code == 0
    plain = tmp_path / "plain"
    r = run_ckpt("convert", titan, plain, "--to", "dcp", "--filter-out", "*.expert_bias_E")
    assert r.exit_code == 0, r.stderr
    for side in (titan, plain):
        r = run_ckpt("diff", side, tmp_path / "hf", "--naming", "torchtitan", "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["result"]["identical"]
    r = run_ckpt("diff", titan, tmp_path / "hf", "--naming", "torchtitan", "--json")
    assert json.loads(r.stdout)["result"]["naming"]["transforms_b"]["zeros"] == 2


def _deepseek_hf(folder: Path, **change: Any) -> dict[str, Any]:
    """A tiny transformers DeepSeek-V3 (low-rank query, one dense layer then two MoE layers of
    8 experts in 2 groups and a shared expert) saved by `save_pretrained`; its config."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    sizes: dict[str, Any] = {
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "kv_lora_rank": 16,
        "q_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
    }
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**sizes, **change}))
    with torch.no_grad():  # a trained router correction bias: not zeros
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer))
    model.save_pretrained(folder)
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


def test_a_deepseek_v3_round_trips_through_torchtitan_names(tmp_path: Path) -> None:
    """A transformers DeepSeek-V3 (MLA, dense first layer, MoE with shared experts and a
    router correction bias) converts to torchtitan's names (experts stacked, the bias as
    torchtitan's `expert_bias_E`) and back, bit-identical; `inspect` names the family."""
    _deepseek_hf(tmp_path / "hf")
    tt = tmp_path / "tt"
    r = run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]["architecture"]
    assert doc["architecture"] == "deepseek-v3"
    assert doc["transforms"] == {"rename": 43, "stack-experts": 6}
    r = run_ckpt("inspect", tt)
    assert "architecture: DeepSeek-V3 (deepseek-v3) in torchtitan names" in r.stdout, r.stdout
    r = run_ckpt("convert", tt, tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    want, got = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "back")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    r = run_ckpt("diff", tt, tmp_path / "hf", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["identical"], r.stdout


def test_a_deepseek_v3_without_a_load_balancing_bias_exports_the_neutral_one(
    tmp_path: Path,
) -> None:
    """torchtitan built without load balancing (`load_balance_coeff=None`) saves no
    `expert_bias_E`; transformers' DeepSeek-V3 router always holds its correction bias. The
    export writes its neutral value (zeros: routing by the scores alone, as torchtitan's
    model did), so `from_pretrained` finds every weight."""
    from transformers import AutoModelForCausalLM

    config = _deepseek_hf(tmp_path / "hf")
    tt = tmp_path / "tt"
    assert run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan").exit_code == 0
    plain = tmp_path / "plain"
    r = run_ckpt("convert", tt, plain, "--to", "dcp", "--filter-out", "*.expert_bias_E")
    assert r.exit_code == 0, r.stderr
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = run_ckpt("convert", plain, out, "--to", "hf", "--config", tmp_path / "config.json")
    assert r.exit_code == 0, r.stderr
    got = _hf_tensors(out)
    biases = {n: t for n, t in got.items() if n.endswith("e_score_correction_bias")}
    assert sorted(biases) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    assert all(t.dtype == torch.float32 and not t.any() for t in biases.values())
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_a_deepseek_v3_cast_to_bf16_keeps_its_router_bias_in_float32(tmp_path: Path) -> None:
    """`--dtype bf16` cast DeepSeek-V3's router correction bias too. It shifts which experts
    each token is routed to by small amounts, so DeepSeek's own checkpoints store it in
    float32 beside bf16 weights, transformers keeps it float32 (`_keep_in_fp32_modules_strict`)
    and torchtitan keeps `expert_bias_E` a float32 buffer: a bf16 copy routes some tokens
    elsewhere. Both ways, the cast now leaves it as stored; every weight is cast."""
    config = _deepseek_hf(tmp_path / "hf")
    original = _hf_tensors(tmp_path / "hf")
    tt = tmp_path / "tt"
    r = run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan", "--dtype", "bf16")
    assert r.exit_code == 0, r.stderr
    r = run_ckpt("convert", tt, tmp_path / "back", "--to", "hf")  # as stored: no cast
    assert r.exit_code == 0, r.stderr
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = run_ckpt(
        "convert", tt, out, "--to", "hf", "--dtype", "bf16", "--config", tmp_path / "config.json"
    )
    assert r.exit_code == 0, r.stderr
    for folder in (tmp_path / "back", out):
        got = _hf_tensors(folder)
        assert got.keys() == original.keys()
        for name, tensor in got.items():
            if name.endswith("e_score_correction_bias"):
                assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name])
            else:
                assert tensor.dtype == torch.bfloat16, name
    # a float32 torchtitan save exported to HF in bf16: the router's gate stays as stored too
    # (transformers' strict list, as `convert --dtype` of the HF folder itself keeps it), where
    # it was rounded to bf16, which `from_pretrained(dtype=bf16)` then held upcast
    tt32, out32 = tmp_path / "tt32", tmp_path / "out32"
    assert run_ckpt("convert", tmp_path / "hf", tt32, "--to", "torchtitan").exit_code == 0
    r = run_ckpt(
        "convert",
        tt32,
        out32,
        "--to",
        "hf",
        "--dtype",
        "bf16",
        "--config",
        tmp_path / "config.json",
    )
    assert r.exit_code == 0, r.stderr
    direct = tmp_path / "direct"
    r = run_ckpt("convert", tmp_path / "hf", direct, "--to", "safetensors", "--dtype", "bf16")
    assert r.exit_code == 0, r.stderr
    exported, cast = _hf_tensors(out32), _hf_tensors(direct)
    for name, tensor in exported.items():
        assert tensor.dtype == cast[name].dtype and torch.equal(tensor, cast[name]), name
        if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"first_k_dense_replace": 2}, "layer 1 holds an MoE, where first_k_dense_replace=2"),
        ({"q_lora_rank": None}, "is a low-rank query projection, where q_lora_rank=null"),
        (
            {"kv_lora_rank": 32},
            "kv_a_proj_with_mqa.weight has 20 rows, where kv_lora_rank=32 + qk_rope_head_dim=4 = 36",
        ),
        ({"v_head_dim": 4}, "num_attention_heads=4 x (qk_nope_head_dim=8 + v_head_dim=4) = 48"),
        ({"n_shared_experts": 2}, "moe_intermediate_size=16 x n_shared_experts=2 = 32"),
        ({"rope_interleave": False}, "rope_interleave: false"),
    ],
    ids=["dense-layers", "q-lora", "kv-lora", "v-head-dim", "shared-experts", "rope-halves"],
)
def test_a_deepseek_v3_config_that_does_not_fit_its_weights_is_refused(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    """The DeepSeek-V3 settings transformers builds its modules from (MLA ranks and head
    widths, which layers are dense, the shared experts' width, interleaved rotary rows) are
    held against the tensors: a config.json that does not fit is refused (exit 4), naming the
    tensor and the setting, before anything is written."""
    config = _deepseek_hf(tmp_path / "hf")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**config, **change}))
    out = tmp_path / "tt"
    r = run_ckpt("convert", tmp_path / "hf", out, "--to", "torchtitan", "--config", bad)
    assert r.exit_code == 4, r.stdout + r.stderr
    assert named in " ".join(r.stderr.split()), r.stderr
    assert not out.exists()


def test_a_deepseek_v3_with_its_mtp_layer_imports_without_it(tmp_path: Path) -> None:
    """DeepSeek's own checkpoints (deepseek-ai/DeepSeek-V3) save the multi-token-prediction
    module as the layer after the last (`model.layers.61`: a whole layer plus `enorm`,
    `hnorm`, `eh_proj`, `shared_head.*`, `embed_tokens`), which transformers' model does not
    build. `--to torchtitan` refused such a folder ("no known model architecture matches").
    It now imports the model's layers and leaves the MTP layer out whole, listed with why."""
    config = _deepseek_hf(tmp_path / "hf")
    layers, dim, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    model = load_file(tmp_path / "hf" / "model.safetensors")
    last = f"model.layers.{layers - 1}."
    mtp = {
        name.replace(last, f"model.layers.{layers}."): tensor.clone()
        for name, tensor in model.items()
        if name.startswith(last)
    }
    extra = {"enorm.weight": [dim], "hnorm.weight": [dim], "eh_proj.weight": [dim, 2 * dim]}
    extra |= {"shared_head.norm.weight": [dim], "shared_head.head.weight": [vocab, dim]}
    extra |= {"embed_tokens.weight": [vocab, dim]}
    for name, shape in extra.items():
        mtp[f"model.layers.{layers}.{name}"] = torch.randn(shape)
    save_file({**model, **mtp}, tmp_path / "hf" / "model.safetensors")
    tt = tmp_path / "tt"
    r = run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    skipped = {s["name"]: s["reason"] for s in json.loads(r.stdout)["result"]["skipped"]}
    assert set(mtp) <= set(skipped)
    assert all("multi-token prediction" in skipped[name] for name in mtp)
    r = run_ckpt("convert", tt, tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    back = _hf_tensors(tmp_path / "back")
    assert back.keys() == model.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in model.items())


def test_deepseek_v3_multi_token_prediction_layers_are_left_out_named() -> None:
    """torchtitan's DeepSeek-V3 with multi-token prediction saves `mtp_layers.*`, a training
    head transformers' DeepseekV3ForCausalLM has no module for: the export leaves them out
    and says why, never under a made-up name."""
    from ckpt_cli.architectures import get_architecture
    from ckpt_cli.architectures.base import ModelArgs

    arch = get_architecture("deepseek-v3")
    entries = [
        ("tok_embeddings.weight", [40, 32], "float32"),
        ("layers.0.attention.wkv_a.weight", [20, 32], "float32"),
        ("mtp_layers.0.eh_proj.weight", [32, 64], "float32"),
        ("mtp_layers.0.attention.wkv_a.weight", [20, 32], "float32"),
    ]
    assert arch.recognise([n for n, _, _ in entries]) is None  # a part of a model only
    plan = arch.plan(entries, "torchtitan", "hf", ModelArgs())
    assert [t.name for t in plan.tensors] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ]
    assert [name for name, _ in plan.left_out] == [
        "mtp_layers.0.eh_proj.weight",
        "mtp_layers.0.attention.wkv_a.weight",
    ]
    assert all("multi-token prediction" in why for _, why in plan.left_out)


def test_rotary_permute_is_transformers_permute_and_inverts() -> None:
    """The permutation is transformers' `convert_llama_weights_to_hf.permute`, and the two
    directions undo each other exactly."""
    from ckpt_cli.architectures.base import rotary_permute

    heads, head_dim, dim = 4, 8, 32
    w = torch.randn(heads * head_dim, dim)
    # transformers' own permute (convert_llama_weights_to_hf.py)
    expected = w.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)
    halves = rotary_permute(w, heads, "to_halves")
    assert torch.equal(halves, expected)
    assert torch.equal(rotary_permute(halves, heads, "to_interleaved"), w)


def test_permuted_row_order_is_rotary_permute() -> None:
    """The row order the kernel copies of a permuted q/k follow is `rotary_permute`'s, both
    ways (GQA head counts, odd widths)."""
    from ckpt_cli.architectures.base import rotary_permute
    from ckpt_cli.architectures.mapped import permuted_row_order

    for heads, head_dim in ((4, 8), (2, 16), (1, 2)):
        rows = torch.arange(heads * head_dim)
        for to in ("to_halves", "to_interleaved"):
            want = rotary_permute(rows.view(-1, 1), heads, to).flatten().tolist()
            assert permuted_row_order(heads * head_dim, heads, to) == want


def test_export_copies_permuted_rows_as_file_ranges(tmp_path: Path) -> None:
    """A permuted q/k of a local safetensors source is served as its rows' byte ranges (the
    writers copy them in the kernel, no read into Python), and those bytes are the permuted
    tensor's."""
    from ckpt_cli.architectures.base import rotary_permute
    from ckpt_cli.architectures.mapped import MappedCheckpoint
    from ckpt_cli.formats import open_checkpoint
    from ckpt_cli.ops.shared.architecture import map_plan
    from ckpt_cli.ops.shared.transfer import plan_transfer
    from ckpt_cli.storage.fileio import FileRange

    _llama_hf(tmp_path / "hf")
    source = open_checkpoint(str(tmp_path / "hf" / "model.safetensors"))
    plan = plan_transfer(source.manifest, dtype=None, keep_objects=False, dedupe_tied=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    mapped = map_plan(
        source, plan, "torchtitan", config=config, cast=None, keep_objects=False,
        dedupe_tied=True,
    )  # fmt: skip
    checkpoint = mapped.checkpoint
    assert isinstance(checkpoint, MappedCheckpoint)
    name = "layers.1.attention.qkv_linear.wq.weight"
    segments = checkpoint.local_ranges(name)
    # one range per row, but a head's last row and the next head's first stay neighbours
    assert segments is not None and len(segments) == 32 - 3
    got = b"".join(bytes(b) for b in FileRange.of(segments))
    q = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    assert got == rotary_permute(q, 4, "to_interleaved").numpy().tobytes()
    source.close()


def test_hf_to_torchtitan_to_hf_is_bit_identical(tmp_path: Path) -> None:
    """HF -> torchtitan -> HF gives back every tensor bit for bit (GQA q/k permuted both ways)."""
    _llama_hf(tmp_path / "hf")
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["architecture"]["architecture"] == "llama3"
    assert doc["architecture"]["transforms"] == {"rename": 17, "rotary-permute": 4}
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got = _hf_tensors(tmp_path / "back")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    # the source's config.json carried (an HF source's own config is the model's)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.slow
def test_diff_compares_a_torchtitan_import_with_its_hf_source_through_the_mapping(
    tmp_path: Path,
) -> None:
    """A user diffs a torchtitan save against the Hugging Face model it was imported from (or
    exported to). The two share no tensor name: every tensor was listed as only in A or only
    in B, and the diff could not say whether the numbers were the same. Now the torchtitan
    side is read in HF names through Llama 3's mapping (q/k rows permuted back), so the pair
    is IDENTICAL, a changed element is a difference named in HF names, and `--naming off`
    compares the names as they are."""
    _llama_hf(tmp_path / "hf")
    tt = tmp_path / "tt"
    assert run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan").exit_code == 0
    r = run_ckpt("diff", tt, tmp_path / "hf", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and doc["compared"] == 21 and not doc["only_a"] and not doc["only_b"]
    naming = doc["naming"]
    assert (naming["architecture"], naming["naming_a"], naming["naming_b"]) == (
        "llama3",
        "torchtitan",
        "hf",
    )
    assert naming["compared_in"] == "hf"
    assert naming["transforms_a"] == {"rename": 17, "rotary-permute": 4}
    assert naming["transforms_b"] == {}
    r = run_ckpt("diff", tt, tmp_path / "hf")
    assert "names mapped: A's Llama 3 torchtitan names read as hf names" in r.stdout, r.stdout
    # one element of one k projection changed in the HF model: found, under its HF name
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "hf", changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][3, 2] += 1
    save_file(tensors, changed / "model.safetensors")
    r = run_ckpt("diff", tt, changed, "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert [d["name"] for d in doc["differences"]] == ["model.layers.1.self_attn.k_proj.weight"]
    assert doc["differences"][0]["differing"] == 1
    # compared in torchtitan's names on request, and by names as they are with --naming off
    r = run_ckpt("diff", tt, tmp_path / "hf", "--naming", "torchtitan", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["naming"]["transforms_b"] == {"rename": 17, "rotary-permute": 4}
    assert doc["compared"] == 21
    r = run_ckpt("diff", tt, tmp_path / "hf", "--naming", "off", "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)["result"]
    # lm_head.weight is the one name both namings share
    assert doc["naming"] is None and len(doc["only_a"]) == len(doc["only_b"]) == 20
    r = run_ckpt("diff", tt, tmp_path / "hf", "--naming", "nonesuch")
    assert r.exit_code == 2 and "--naming" in r.stderr
    # a forced naming for a side of no known family: named, with diff's own way out
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, other)
    r = run_ckpt("diff", tt, other, "--naming", "hf")
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "no known model architecture matches these 1 tensor names" in message, message
    assert "--naming off" in message and "--to safetensors" not in message
    # neither side's config.json to tell the head counts the q/k permutation needs: named
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tmp_path / "hf" / "model.safetensors", bare)
    (tt / "config.json").unlink()
    r = run_ckpt("diff", tt, bare)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert f"{tt}: the Llama 3 mapping needs n_heads" in message and "--config" in message
    r = run_ckpt("diff", tt, bare, "--config", tmp_path / "hf" / "config.json")
    assert r.exit_code == 0, r.stdout + r.stderr


def test_torchtitan_import_names_and_permutes_q_k(tmp_path: Path) -> None:
    """The DCP import holds torchtitan's names; q/k rows are in the interleaved layout."""
    import torch.distributed.checkpoint as dcp

    from ckpt_cli.architectures.base import rotary_permute

    _llama_hf(tmp_path / "hf")
    assert (
        run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan").exit_code == 0
    )
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    state = {
        "layers.1.attention.qkv_linear.wk.weight": torch.empty(16, 32),
        "layers.1.attention.qkv_linear.wq.weight": torch.empty(32, 32),
        "tok_embeddings.weight": torch.empty(40, 32),
    }
    dcp.load(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    assert torch.equal(state["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    k = hf["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(
        state["layers.1.attention.qkv_linear.wk.weight"], rotary_permute(k, 2, "to_interleaved")
    )
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(
        state["layers.1.attention.qkv_linear.wq.weight"], rotary_permute(q, 4, "to_interleaved")
    )


def test_dry_run_lists_renames_and_transforms(tmp_path: Path) -> None:
    _llama_hf(tmp_path / "hf")
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert "llama3: hf names -> torchtitan names (17 rename, 4 rotary-permute)" in r.stdout
    assert (
        "entry layers.0.attention.qkv_linear.wq.weight  float32  [32, 32]  4.0 KiB  "
        "(rotary-permute from model.layers.0.self_attn.q_proj.weight)" in r.stdout
    )
    assert "(rename from model.embed_tokens.weight)" in r.stdout
    assert not (tmp_path / "tt").exists()


def test_unknown_architecture_is_exit_4_naming_the_tensors(tmp_path: Path) -> None:
    """A model no family knows is refused (exit 4) naming what no rule maps: never copied
    under its old names."""
    _llama_hf(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "out", "--to", "torchtitan")
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "model.layers.0.self_attn.mystery.weight" in message
    assert "closest is Llama 3 (hf naming), which has no rule for 1 tensor(s)" in message
    assert not (tmp_path / "out").exists()


def test_missing_head_count_is_exit_4_asking_for_config(tmp_path: Path) -> None:
    """Llama's head count is not in its weights: without a config.json the export stops."""
    _llama_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "out", "--to", "torchtitan")
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "needs n_heads" in message and "--config" in message
    assert not (tmp_path / "out").exists()


def test_config_contradicting_the_weights_is_refused(tmp_path: Path) -> None:
    _llama_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**config, "hidden_size": 4096}))
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "o", "--to", "torchtitan", "--config", bad)
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "config.json gives dim=4096, but the weights have dim=32" in message


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": "abc"}, "hidden_size='abc'"),
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5"),
        ({"head_dim": [8]}, "head_dim=[8]"),
        ({"rope_theta": "fast"}, "rope_theta='fast'"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps='x'"),
        ({"max_position_embeddings": "long"}, "max_position_embeddings='long'"),
    ],
    ids=[
        "str-width",
        "zero-heads",
        "negative-kv-heads",
        "float-layers",
        "list",
        "theta",
        "eps",
        "positions",
    ],
)
def test_a_config_json_value_no_model_has_is_refused_naming_it(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    """A damaged or hand-edited config.json (a width that is a string, zero heads, half a
    layer) was an internal error (exit 70: pydantic's traceback, a division by zero): ckpt
    now refuses it (exit 4) naming the key and its value, and writes nothing."""
    _llama_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "out", "--to", "torchtitan")
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert f"in config.json, {named} is a value no model has" in message, message
    assert "--config" in message
    assert not (tmp_path / "out").exists()


def test_recognise_tells_families_apart() -> None:
    from ckpt_cli.architectures import recognise

    layer = "model.layers.0."
    attention = [f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"]
    norms = [f"{layer}input_layernorm.weight", f"{layer}post_attention_layernorm.weight"]
    dense = [f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    ends = ["model.embed_tokens.weight", "model.norm.weight"]
    llama = [*ends, *attention, *norms, *dense, "lm_head.weight"]
    found = recognise(llama)
    assert found is not None and (found.architecture.name, found.naming) == ("llama3", "hf")
    # tied embeddings: no lm_head, still Llama
    found = recognise([n for n in llama if n != "lm_head.weight"])
    assert found is not None and found.architecture.name == "llama3"
    qwen = [*llama, f"{layer}self_attn.q_norm.weight", f"{layer}self_attn.k_norm.weight"]
    found = recognise(qwen)
    assert found is not None and found.architecture.name == "qwen3"
    experts = [f"{layer}mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")]
    moe = [*(n for n in qwen if n not in dense), f"{layer}mlp.gate.weight", *experts]
    found = recognise(moe)
    assert found is not None and found.architecture.name == "qwen3-moe"
    titan = [
        "tok_embeddings.weight",
        "norm.weight",
        "lm_head.weight",
        *(f"layers.0.attention.qkv_linear.w{p}.weight" for p in "qkv"),
        "layers.0.attention.wo.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        *(f"layers.0.feed_forward.w{i}.weight" for i in (1, 2, 3)),
    ]
    found = recognise(titan)
    assert found is not None and (found.architecture.name, found.naming) == ("llama3", "torchtitan")
    assert recognise(["encoder.weight"]) is None
    # Llama-like names without the gated MLP are no Llama: an export would lack `w1`, which
    # torchtitan's loader asks for, so the family is not claimed
    assert recognise([n for n in llama if "gate_proj" not in n]) is None
    assert recognise([n for n in titan if "feed_forward.w1" not in n]) is None


def test_experts_unstack_and_stack_back() -> None:
    """Qwen3-MoE: torchtitan's stacked `[E, F, D]` experts become one tensor per expert, each
    read as its own box, and stack back to the same bytes."""
    from ckpt_cli.architectures import get_architecture
    from ckpt_cli.architectures.base import ModelArgs

    arch = get_architecture("qwen3-moe")
    stacked = torch.randn(4, 6, 8)

    class Source:
        def read_tensor(self, name: str) -> torch.Tensor:
            return stacked

        def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            return stacked[box]

    name = "layers.3.moe.routed_experts.inner_experts.w1_EFD"
    plan = arch.plan([(name, [4, 6, 8], "float32")], "torchtitan", "hf", ModelArgs())
    assert [t.name for t in plan.tensors] == [
        f"model.layers.3.mlp.experts.{e}.gate_proj.weight" for e in range(4)
    ]
    experts = [t.read(Source()) for t in plan.tensors]
    for e, tensor in enumerate(experts):
        assert tensor.shape == (6, 8) and torch.equal(tensor, stacked[e])
    back = arch.plan(
        [(t.name, [6, 8], "float32") for t in plan.tensors], "hf", "torchtitan", ModelArgs()
    )
    assert [t.name for t in back.tensors] == [name]

    class PerExpert:
        def read_tensor(self, name: str) -> torch.Tensor:
            return experts[int(name.split(".")[5])]

    assert torch.equal(back.tensors[0].read(PerExpert()), stacked)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- torchtitan


needs_frameworks = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None
    or importlib.util.find_spec("transformers") is None,
    reason="torchtitan and transformers are not installed (pip install '.[frameworks]')",
)


def _script(*args: str | Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


#: the families whose MoE forward sums the routed experts in another order than torchtitan's
#: grouped matmul: logits agree to 1e-4, not 1e-6 (weights bit-identical all the same)
MOE_FAMILIES = ("qwen3-moe", "deepseek-v3")


@pytest.fixture(scope="module", params=["llama3", "qwen3", "qwen3-moe", "deepseek-v3"])
def titan_model(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A torchtitan run (`run/checkpoint/step-1`) of FAMILY and its references (`ref/`)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"arch-{family}")
    _script("save", family, root / "run", root / "ref")
    return family, root


def _hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(SCRIPT.parent))
    from torchtitan_arch_script import IDS

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(IDS).logits
    return logits


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_export_equals_torchtitan_to_hf_and_loads_in_transformers(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    family, root = titan_model
    step = root / "run" / "checkpoint" / "step-1"
    dest = tmp_path / "hf"
    r = run_ckpt(
        "convert", step, dest, "--to", "hf", "--config", root / "ref" / "config.json", "--json"
    )
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["architecture"]["architecture"] == family
    assert doc["architecture"]["source_naming"] == "torchtitan"
    # the training state is not part of a Hugging Face model: left behind
    assert not any(e["source"].startswith("optimizer.") for e in doc["entries"])
    # bit for bit what torchtitan's own adapter gives
    want = load_file(root / "ref" / "to_hf.safetensors")
    got = _hf_tensors(dest)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    logits = _hf_logits(dest)
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert logits.dtype == torch.float32
    # the weights are torchtitan's own to_hf bit for bit (above); the MoE forward sums the
    # routed experts in another order than torchtitan's grouped matmul (measured 2.6e-5)
    tolerance = 1e-4 if family in MOE_FAMILIES else 1e-6
    assert (logits - reference).abs().max().item() <= tolerance
    if family == "deepseek-v3":
        # torchtitan's trained load-balancing bias is transformers' router correction bias:
        # carried (it routes tokens), so the logits above agree
        biases = [t for name, t in got.items() if name.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all(bool(b.abs().sum() > 0) for b in biases)
        assert doc["architecture"]["transforms"] == {"rename": 43, "unstack-experts": 48}


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_diff_proves_an_export_holds_what_torchtitan_saved(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    """Step 4 of the export how-to: `ckpt diff step-1 export/ --select model` against the
    `--to hf` export of a real torchtitan save. It listed every tensor as one-sided; it now
    compares each exported tensor with the torchtitan tensor(s) it came from (q/k permuted,
    experts unstacked), says the names were mapped, and lists what has no HF counterpart."""
    family, root = titan_model
    step = root / "run" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    assert run_ckpt("convert", step, hf, "--to", "hf", "--config", root / "ref" / "config.json")
    r = run_ckpt("diff", step, hf, "--select", "model", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and not doc["only_a"] and not doc["only_b"]
    assert doc["compared"] == len(load_file(root / "ref" / "to_hf.safetensors"))
    naming = doc["naming"]
    assert (naming["architecture"], naming["naming_a"], naming["compared_in"]) == (
        family,
        "torchtitan",
        "hf",
    )
    if family == "llama3":
        assert naming["transforms_a"]["rotary-permute"] == 4
    if family == "deepseek-v3":  # two MoE layers of 8 experts
        assert naming["transforms_a"]["unstack-experts"] == 3 * 8 * 2
    if family == "qwen3-moe":
        assert naming["transforms_a"]["unstack-experts"] == 3 * 4 * 2
        # torchtitan's load-balancing state has no HF counterpart: named, not compared
        reasons = {item["reason"] for item in naming["left_out_a"]}
        assert any("load-balancing" in reason for reason in reasons), naming
    r = run_ckpt("diff", step, hf, "--select", "model")
    assert "names mapped: A's" in r.stdout and "torchtitan names read as hf names" in r.stdout
    # without --select the save's optimizer and data loader are only in A, and its model is
    # compared by names as they are: the warning says what lines the two up
    r = run_ckpt("diff", step, hf, "--json")
    assert r.exit_code == 1
    warnings = " ".join(json.loads(r.stdout)["result"]["warnings"])
    assert "in torchtitan names and B's in hf names: --select model compares them" in warnings


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_trained_moe_load_balancing_bias_the_export_drops_is_said_and_diffed(
    tmp_path: Path,
) -> None:
    """A Qwen3-MoE trained by torchtitan with its load-balancing hook (its Trainer's default,
    `load_balance_coeff=1e-3`) holds non-zero `expert_bias_E`, which routes tokens. The HF
    Qwen3-MoE has no router bias, so `--to hf` drops it (as torchtitan's own to_hf) and the
    exported model's logits differ from torchtitan's. The export said nothing of it, and
    `diff --select model` called the two IDENTICAL in every naming: `--naming torchtitan`
    left the bias out though the HF side read in torchtitan names holds one (zeros, as an
    import writes). Now the export and the diff warn, naming the biases, and `--naming
    torchtitan` compares them: a difference."""
    root = tmp_path / "titan"
    _script("save-balanced", "qwen3-moe", root / "run", root / "ref")
    step = root / "run" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    r = run_ckpt("convert", step, hf, "--to", "hf", "--config", root / "ref" / "config.json")
    assert r.exit_code == 0, r.stderr
    warned = "2 trained MoE load-balancing bias(es) are non-zero (layers.0.moe.expert_bias_E"
    assert warned in r.stderr and "routes some tokens to other experts" in r.stderr
    # what the warning says: transformers' model computes otherwise than torchtitan's
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert (_hf_logits(hf) - reference).abs().max().item() > 1e-3
    r = run_ckpt("diff", step, hf, "--select", "model", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert any(warned in w and "--naming torchtitan compares them" in w for w in doc["warnings"])
    r = run_ckpt("diff", step, hf, "--select", "model", "--naming", "torchtitan", "--json")
    assert r.exit_code == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert [d["name"] for d in doc["differences"]] == [
        "layers.0.moe.expert_bias_E",
        "layers.1.moe.expert_bias_E",
    ]
    assert not doc["only_a"] and not doc["only_b"]
    assert doc["naming"]["transforms_b"]["zeros"] == 2
    # the import of the export writes the biases' fresh-start zeros: compared, equal
    titan = tmp_path / "tt"
    assert run_ckpt("convert", hf, titan, "--to", "torchtitan").exit_code == 0
    for naming in ("torchtitan", "hf"):
        r = run_ckpt("diff", titan, hf, "--naming", naming, "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)["result"]
        assert doc["identical"] and not doc["warnings"], doc
    r = run_ckpt("diff", titan, hf, "--naming", "torchtitan", "--json")
    assert json.loads(r.stdout)["result"]["compared"] == 29


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_export_without_config_builds_one_from_the_args(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    """Qwen3's head counts are in its weights (q/k norms are per head): with `--config` left
    out only what the weights cannot tell is asked for, and named."""
    family, root = titan_model
    step = root / "run" / "checkpoint" / "step-1"
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf")
    assert r.exit_code == 4
    missing = {"llama3": "n_heads", "deepseek-v3": "config"}.get(family, "norm_eps")
    assert f"needs {missing}" in " ".join(r.stderr.split()), r.stderr
    assert not (tmp_path / "hf").exists()


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_import_loads_in_torchtitan_and_trains(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    """HF -> torchtitan: CheckpointManager.load (step-0, model only) restores the weights (the
    torchtitan forward equals the original's), and one training step runs after it."""
    family, root = titan_model
    hf = tmp_path / "hf"
    step = root / "run" / "checkpoint" / "step-1"
    config = root / "ref" / "config.json"
    assert run_ckpt("convert", step, hf, "--to", "hf", "--config", config).exit_code == 0
    run = tmp_path / "run"
    r = run_ckpt("convert", hf, tmp_path / "tt", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr
    (run / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "tt", run / "checkpoint" / "step-0")
    _script("load", family, run, tmp_path / "out")
    loaded = torch.load(tmp_path / "out" / "loaded_logits.pt", weights_only=True)
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert torch.equal(loaded, reference)
    tolerance = 1e-4 if family in MOE_FAMILIES else 1e-6  # see the export test
    assert (loaded - _hf_logits(hf)).abs().max().item() <= tolerance
    trained = torch.load(tmp_path / "out" / "trained.pt", weights_only=True)
    assert trained["restored"] and trained["moved"]
    assert torch.isfinite(torch.tensor(trained["loss"]))


def test_inspect_names_the_architecture_and_naming(tmp_path: Path) -> None:
    _llama_hf(tmp_path / "hf")
    r = run_ckpt("inspect", tmp_path / "hf", "--json")
    assert r.exit_code == 0, r.stderr
    arch = json.loads(r.stdout)["result"]["architecture"]
    assert arch == {"architecture": "llama3", "title": "Llama 3", "naming": "hf", "component": None}
    assert (
        run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan").exit_code == 0
    )
    r = run_ckpt("inspect", tmp_path / "tt")
    assert r.exit_code == 0, r.stderr
    assert "architecture: Llama 3 (llama3) in torchtitan names" in r.stdout
    # a model no family knows: no architecture line, no error
    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    r = run_ckpt("inspect", tmp_path / "other.safetensors", "--json")
    assert json.loads(r.stdout)["result"]["architecture"] is None


def test_training_dict_of_an_hf_model_exports_by_select_and_strip(tmp_path: Path) -> None:
    """A training save of an HF-named model (`{"model": ..., "optimizer": ...}`) exports its
    model component with the prefix stripped; `--config FOLDER` brings the folder's
    tokenizer and generation config beside the config."""
    _llama_hf(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    optimizer = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"params": [0]}]}
    torch.save({"model": weights, "optimizer": optimizer, "step": 3}, tmp_path / "train.pt")
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (tmp_path / "hf" / "generation_config.json").write_text('{"do_sample": false}')
    r = run_ckpt(
        "convert", tmp_path / "train.pt", tmp_path / "out", "--to", "hf", "--config",
        tmp_path / "hf", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["architecture"]["source_naming"] == "hf"
    assert doc["architecture"]["transforms"] == {"copy": 21}
    assert sorted(doc["serving_files"]) == ["generation_config.json", "tokenizer_config.json"]
    got = _hf_tensors(tmp_path / "out")
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


def test_tied_embeddings_dropped_on_export_and_rebuilt_on_import() -> None:
    """tie_word_embeddings: the export leaves the output projection out (as torchtitan's own
    to_hf does); the import writes it from the embedding's bytes."""
    from ckpt_cli.architectures import get_architecture
    from ckpt_cli.architectures.base import ModelArgs

    arch = get_architecture("qwen3")
    tied = ModelArgs(tie_embeddings=True)
    titan = [("tok_embeddings.weight", [8, 4], "float32"), ("lm_head.weight", [8, 4], "float32")]
    plan = arch.plan([*titan, ("norm.weight", [4], "float32")], "torchtitan", "hf", tied)
    assert [t.name for t in plan.tensors] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert plan.left_out == [("lm_head.weight", "tied to the embedding (tie_word_embeddings)")]
    back = arch.plan(
        [("model.embed_tokens.weight", [8, 4], "float32"), ("model.norm.weight", [4], "float32")],
        "hf",
        "torchtitan",
        tied,
    )
    head = next(t for t in back.tensors if t.name == "lm_head.weight")
    assert head.sources == ["model.embed_tokens.weight"] and head.verbatim


def test_experts_of_a_non_raw_tensor_are_cut_from_one_read() -> None:
    """Splitting a stacked tensor the source cannot read in boxes (torch_save serialization)
    reads it once for all its experts, not once per expert."""
    from ckpt_cli.architectures import get_architecture
    from ckpt_cli.architectures.base import ModelArgs
    from ckpt_cli.architectures.mapped import BoxReads

    stacked = torch.randn(8, 3, 2)
    reads: list[str] = []

    name = "layers.0.moe.routed_experts.inner_experts.w2_EDF"

    class Pickled:
        # one stored piece (no chunks): boxes are cut from the whole tensor
        manifest = SimpleNamespace(by_name={name: SimpleNamespace(shape=[8, 3, 2], chunks=None)})

        def serves_raw(self, name: str) -> bool:
            return False

        def read_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return stacked.clone()

    plan = get_architecture("qwen3-moe").plan(
        [(name, [8, 3, 2], "float32")], "torchtitan", "hf", ModelArgs()
    )
    box_reads = BoxReads(Pickled())  # type: ignore[arg-type]
    experts = [t.read(box_reads) for t in plan.tensors]
    assert reads == [name]
    assert all(torch.equal(e, stacked[i]) for i, e in enumerate(experts))


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_export_with_a_torchtitan_flavor_builds_config_json(tmp_path: Path) -> None:
    """`--flavor debugmodel`: torchtitan's own llama3 flavor (16 heads, llama3 rope scaling,
    131072 positions) gives what the weights do not, and transformers builds the same model
    from the config.json ckpt writes."""
    _script("save", "llama3:debugmodel", tmp_path / "run", tmp_path / "ref")
    step = tmp_path / "run" / "checkpoint" / "step-1"
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--flavor", "debugmodel")
    assert r.exit_code == 0, r.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_attention_heads"] == 16 and config["max_position_embeddings"] == 131072
    assert config["rope_parameters"]["rope_type"] == "llama3"
    # transformers 4 and llama.cpp's converter read the scaling from the legacy `rope_scaling`
    # (beside `rope_theta`): the same values, or they would run the model unscaled
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert {**config["rope_scaling"], "rope_theta": config["rope_theta"]} == config[
        "rope_parameters"
    ]
    want = load_file(tmp_path / "ref" / "to_hf.safetensors")
    got = _hf_tensors(tmp_path / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    reference = torch.load(tmp_path / "ref" / "logits.pt", weights_only=True)
    # the weights are torchtitan's own to_hf bit for bit: what is left is the two forwards'
    # float32 rounding (6 layers, dim 256: measured 1.4e-6 on logits up to 4.2, 3 ulps)
    limit = 1e-6 * max(1.0, reference.abs().max().item())
    assert (_hf_logits(tmp_path / "hf") - reference).abs().max().item() <= limit
    # the config a transformers-4 reader sees (`rope_theta` + `rope_scaling`, no
    # `rope_parameters`) builds the same model: the installed transformers converts it
    legacy = tmp_path / "hf-legacy"
    shutil.copytree(tmp_path / "hf", legacy)
    del config["rope_parameters"]
    (legacy / "config.json").write_text(json.dumps(config))
    assert (_hf_logits(legacy) - reference).abs().max().item() <= limit
    # unscaled, the logits differ: the check above can tell
    del config["rope_scaling"]
    (legacy / "config.json").write_text(json.dumps(config))
    assert (_hf_logits(legacy) - reference).abs().max().item() > limit
    r = run_ckpt("convert", step, tmp_path / "x", "--to", "hf", "--flavor", "nonesuch")
    assert r.exit_code == 2 and "debugmodel" in r.stderr


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
@pytest.mark.parametrize("titan_model", ["deepseek-v3"], indirect=True)
def test_a_deepseek_v3_config_built_from_its_torchtitan_model_computes_the_same(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    """`--flavor` of a DeepSeek-V3 builds config.json from torchtitan's model config: its
    MLA ranks, router groups, scaling and normalisation, the dense first layers, and yarn
    rotary with torchtitan's softmax mscale (transformers' `mscale` = `mscale_all_dim`).
    The config built from the tiny model's own torchtitan config gives transformers'
    logits torchtitan's. torchtitan's debugmodel routes by softmax, which transformers'
    DeepseekV3 never does: `--flavor debugmodel` is refused, naming why."""
    _, root = titan_model
    step = root / "run" / "checkpoint" / "step-1"
    built = root / "ref" / "flavor_config.json"
    config = json.loads(built.read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["rope_parameters"]["mscale"] == config["rope_parameters"]["mscale_all_dim"]
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (2, 1, 1)
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--config", built)
    assert r.exit_code == 0, r.stderr
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert (_hf_logits(tmp_path / "hf") - reference).abs().max().item() <= 1e-4
    r = run_ckpt("convert", step, tmp_path / "x", "--to", "hf", "--flavor", "debugmodel")
    assert r.exit_code == 2, r.stdout + r.stderr
    assert "routes by softmax" in " ".join(r.stderr.split()), r.stderr
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def titan_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchtitan Llama 3 run (`run/checkpoint/step-1`: 4 heads over 2 KV heads of 8,
    an FFN of 64, untied `lm_head`) and its references (`ref/`: its config.json...)."""
    root = tmp_path_factory.mktemp("arch-llama3-configs")
    _script("save", "llama3", root / "run", root / "ref")
    return root


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"num_key_value_heads": 4},
            "layers.0.attention.qkv_linear.wk.weight has 16 rows, where "
            "num_key_value_heads=4 x head_dim=8 = 32",
        ),
        (
            {"num_attention_heads": 8, "head_dim": 4},
            "layers.0.attention.qkv_linear.wk.weight has 16 rows, where "
            "num_key_value_heads=2 x head_dim=4 = 8",
        ),
        (
            {"intermediate_size": 128},
            "layers.0.feed_forward.w1.weight has 64 rows, where intermediate_size = 128",
        ),
    ],
    ids=["kv-heads", "heads-and-head-dim", "intermediate-size"],
)
def test_a_config_json_that_does_not_fit_the_weights_is_refused(
    titan_llama: Path, tmp_path: Path, change: dict[str, int], named: str
) -> None:
    """A user exports a torchtitan Llama with the config.json of another size of it. A
    Llama's head counts are in no tensor's shape alone, but the rows they imply are: ckpt
    stops (exit 4) naming the tensor that does not fit, and writes nothing. (It used to
    write the folder, exit 0, and `from_pretrained` then refused it for size mismatches.)"""
    step = titan_llama / "run" / "checkpoint" / "step-1"
    config = json.loads((titan_llama / "ref" / "config.json").read_text())
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**config, **change}))
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--config", bad)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "config.json does not fit the weights" in message, message
    assert named in message, message
    assert "--config" in message
    assert not (tmp_path / "hf").exists()


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_config_json_of_another_width_is_refused_for_every_family(
    titan_model: tuple[str, Path], tmp_path: Path
) -> None:
    """The MLP width is a config.json value too: one that is not the tensors' (a dense FFN,
    or each MoE expert's) is refused, naming the tensor, for every family."""
    family, root = titan_model
    key = "moe_intermediate_size" if family == "qwen3-moe" else "intermediate_size"
    config = json.loads((root / "ref" / "config.json").read_text())
    wrong = config[key] * 2
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**config, key: wrong}))
    step = root / "run" / "checkpoint" / "step-1"
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--config", bad)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert f"where {key} = {wrong}" in message, message
    assert not (tmp_path / "hf").exists()


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_config_json_of_another_family_is_refused(titan_llama: Path, tmp_path: Path) -> None:
    """The config.json of a Qwen3 of the very same sizes, given for a torchtitan Llama:
    transformers would build a Qwen3 whose q/k norms no tensor fills (it warns and
    initialises them, and the logits are another model's). ckpt refuses it (exit 4) naming
    both families; the Llama's own config.json exports a model transformers loads whole."""
    sys.path.insert(0, str(SCRIPT.parent))
    from torchtitan_arch_script import hf_config

    step = titan_llama / "run" / "checkpoint" / "step-1"
    qwen = tmp_path / "qwen3.json"
    qwen.write_text(json.dumps(hf_config("qwen3")))
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--config", qwen)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "config.json is a Qwen3 model's (model_type 'qwen3')" in message, message
    assert "the weights are a Llama 3 model's" in message
    assert not (tmp_path / "hf").exists()
    own = titan_llama / "ref" / "config.json"
    assert run_ckpt("convert", step, tmp_path / "ok", "--to", "hf", "--config", own).exit_code == 0
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ok", output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_config_claiming_tied_embeddings_never_drops_a_trained_lm_head(
    titan_llama: Path, tmp_path: Path
) -> None:
    """torchtitan saves both names of a tied model, so an export drops `lm_head` when the
    config says `tie_word_embeddings`. For a model trained untied that would lose its output
    projection (the logits of the exported model were off by 36): ckpt refuses (exit 4),
    naming the two tensors that differ."""
    step = titan_llama / "run" / "checkpoint" / "step-1"
    config = json.loads((titan_llama / "ref" / "config.json").read_text())
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps({**config, "tie_word_embeddings": True}))
    r = run_ckpt("convert", step, tmp_path / "hf", "--to", "hf", "--config", tied)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "'lm_head.weight' differs from 'tok_embeddings.weight'" in message, message
    assert "tie_word_embeddings: false" in message
    assert not (tmp_path / "hf").exists()


@needs_frameworks
@pytest.mark.frameworks
def test_a_tied_transformers_llama_round_trips_through_torchtitan(tmp_path: Path) -> None:
    """A Llama saved tied by `save_pretrained` (no `lm_head` in its file): the torchtitan
    import writes `lm_head` as the embedding's copy, and the export back leaves that twin
    out again (checked equal): `from_pretrained` gets every tensor back bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    assert (
        run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan").exit_code == 0
    )
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf", "--json")
    assert r.exit_code == 0, r.stderr
    skipped = json.loads(r.stdout)["result"]["skipped"]
    assert {"name": "lm_head.weight", "kind": "tensor"}.items() <= skipped[0].items()
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert back.config.tie_word_embeddings
    want, got = model.state_dict(), back.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    # diff across the namings: torchtitan's lm_head is compared with the tensor the tied HF
    # model stores it as, the embedding (config.json's tie_word_embeddings), in either naming
    for naming in ("hf", "torchtitan"):
        r = run_ckpt("diff", tmp_path / "tt", tmp_path / "hf", "--naming", naming, "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)["result"]
        assert doc["compared"] == 21 and not doc["only_a"] and not doc["only_b"]
        embedding = "model.embed_tokens.weight" if naming == "hf" else "tok_embeddings.weight"
        assert [(a["name"], a["target"]) for a in doc["aliases"]] == [
            ("lm_head.weight", embedding)
        ], doc["aliases"]


@needs_frameworks
@pytest.mark.frameworks
def test_a_refused_llama_names_what_is_extra_and_how_to_leave_it_out(tmp_path: Path) -> None:
    """Models ckpt cannot map are refused (exit 4) naming the Llama they resemble: a Llama with
    attention biases (the biases are what no rule maps, not gpt-oss's MLP), and a Llama with
    a value head (a trl-style `v_head.*`) whose message gives the `--filter-out` that, when
    followed, exports the Llama and lists nothing as written that was not asked for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(attention_bias=True, **sizes)).save_pretrained(tmp_path / "bias")
    r = run_ckpt("convert", tmp_path / "bias", tmp_path / "o1", "--to", "torchtitan")
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "closest is Llama 3 (hf naming), which has no rule for 8 tensor(s)" in message, message
    assert "self_attn.k_proj.bias" in message and "gpt-oss (" not in message

    LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(tmp_path / "vh")
    weights = load_file(tmp_path / "vh" / "model.safetensors")
    weights["v_head.summary.weight"] = torch.randn(1, 32)
    weights["v_head.summary.bias"] = torch.randn(1)
    save_file(weights, tmp_path / "vh" / "model.safetensors", metadata={"format": "pt"})
    r = run_ckpt("convert", tmp_path / "vh", tmp_path / "o2", "--to", "torchtitan")
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "'v_head.summary.bias', 'v_head.summary.weight'" in message
    assert "leave them out: --filter-out 'v_head.*'" in message, message
    r = run_ckpt(
        "convert", tmp_path / "vh", tmp_path / "o2", "--to", "torchtitan",
        "--filter-out", "v_head.*", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    entries = json.loads(r.stdout)["result"]["entries"]
    assert not any(e["source"].startswith("v_head.") for e in entries)
    assert len(entries) == len(weights) - 2


@needs_frameworks
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_nested_torchtitan_state_dict_is_refused_pointing_to_select(
    titan_llama: Path, tmp_path: Path
) -> None:
    """`dcp.save({"model": model.state_dict()})` (a training loop of one's own) puts the
    torchtitan names under `model.`: the refusal says so and names `--select model`, which
    then exports torchtitan's own `to_hf` tensors bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = titan_llama / "run" / "checkpoint" / "step-1"
    dcp_to_torch_save(step, tmp_path / "all.pt")
    saved = torch.load(tmp_path / "all.pt", weights_only=False)
    model = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "nested"), no_dist=True)
    config = titan_llama / "ref" / "config.json"
    r = run_ckpt("convert", tmp_path / "nested", tmp_path / "hf", "--to", "hf", "--config", config)
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "Llama 3's torchtitan names under the prefix 'model.'" in message, message
    assert "Pass --select model" in message
    r = run_ckpt(
        "convert", tmp_path / "nested", tmp_path / "hf", "--to", "hf", "--config", config,
        "--select", "model",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    want = load_file(titan_llama / "ref" / "to_hf.safetensors")
    got = _hf_tensors(tmp_path / "hf")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_boxes_of_a_chunked_non_raw_tensor_read_only_their_chunks() -> None:
    """A Megatron layer stack stored one torch_save chunk per layer and tensor-parallel rank:
    q, k and v of one query group are cut from one read of their chunk, and nothing larger
    than a chunk is ever read (never the whole stack)."""
    from ckpt_cli.architectures import get_architecture
    from ckpt_cli.architectures.base import ModelArgs
    from ckpt_cli.architectures.mapped import BoxReads
    from ckpt_cli.models import Chunk

    layers, groups, heads, head_dim, hidden = 3, 2, 4, 2, 4
    rows = groups * (heads // groups + 2) * head_dim
    name = "decoder.layers.self_attention.linear_qkv.weight"
    stacked = torch.randn(layers, rows, hidden)
    half = rows // 2  # 2 tensor-parallel ranks: one query group each
    chunks = [
        Chunk(offsets=[layer, r * half, 0], sizes=[1, half, hidden], file="f", byte_offset=0,
              byte_length=0)
        for layer in range(layers)
        for r in range(2)
    ]  # fmt: skip
    reads: list[tuple[list[int], list[int]]] = []

    class Pickled:
        manifest = SimpleNamespace(
            by_name={name: SimpleNamespace(shape=[layers, rows, hidden], chunks=chunks)}
        )

        def serves_raw(self, name: str) -> bool:
            return False

        def read_tensor(self, name: str) -> torch.Tensor:
            raise AssertionError("the whole stack was read")

        def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
            reads.append((offsets, sizes))
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            return stacked[box].clone()

    args = ModelArgs(n_heads=heads, n_kv_heads=groups, head_dim=head_dim, dim=hidden)
    plan = get_architecture("llama3").plan(
        [(name, [layers, rows, hidden], "float32")], "megatron", "hf", args
    )
    box_reads = BoxReads(Pickled())  # type: ignore[arg-type]
    out = {t.name: t.read(box_reads) for t in plan.tensors}
    # every read is one chunk: one per layer and rank, each once
    assert sorted(map(str, reads)) == sorted(str((c.offsets, c.sizes)) for c in chunks)
    per_group = rows // groups
    q_rows = heads // groups * head_dim
    for layer in range(layers):
        fused = stacked[layer].reshape(groups, per_group, hidden)
        q = out[f"model.layers.{layer}.self_attn.q_proj.weight"]
        k = out[f"model.layers.{layer}.self_attn.k_proj.weight"]
        v = out[f"model.layers.{layer}.self_attn.v_proj.weight"]
        assert torch.equal(q, fused[:, :q_rows].reshape(-1, hidden))
        assert torch.equal(k, fused[:, q_rows : q_rows + head_dim].reshape(-1, hidden))
        assert torch.equal(v, fused[:, q_rows + head_dim :].reshape(-1, hidden))


def test_round_trip_through_a_sharded_torchtitan_save(tmp_path: Path) -> None:
    """An import laid out for 2 ranks (each tensor in two Shard(0) chunks, as FSDP saves it)
    exports back bit for bit: renames, permutations and boxes read across chunks."""
    _llama_hf(tmp_path / "hf")
    r = run_ckpt(
        "convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--world-size", "2"
    )
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "tt" / "__1_0.distcp").exists()
    assert run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf").exit_code == 0
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got = _hf_tensors(tmp_path / "back")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize(
    "names",
    [
        [],
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"],
        ["tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight", "output.weight"],
        ["unknown.tensor", "model.embed_tokens.weight"],
        ["model.embed_tokens.weight", "unknown.tensor"],
    ],
)
def test_covers_every_agrees_with_covers(names: list[str]) -> None:
    """The short-cut recognition uses (#30: stop at the first unknown name) decides as the
    full classification does, for every family and naming."""
    from ckpt_cli.architectures import architectures

    for arch in architectures():
        for naming in arch.namings():
            unknown, known = arch.covers(names, naming)
            assert arch.covers_every(names, naming) == (not unknown and bool(known)), (
                arch.__name__,
                naming,
            )


@needs_frameworks
@pytest.mark.frameworks
def test_a_relative_ckpt_does_not_know_is_mapped_with_a_warning(tmp_path: Path) -> None:
    """A Mistral (sliding-window attention) has a Llama's tensor names: it maps to torchtitan
    and back bit for bit, and both directions warn that its config.json's family is none
    ckpt knows, so a torchtitan Llama computes the same only if the model is one."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, sliding_window=16,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    for src, dest, to in (("hf", "tt", "torchtitan"), ("tt", "back", "hf")):
        r = run_ckpt("convert", tmp_path / src, tmp_path / dest, "--to", to, "--json")
        assert r.exit_code == 0, r.stderr
        warnings = " ".join(json.loads(r.stdout)["result"]["warnings"])
        assert "config.json names model_type 'mistral', a family ckpt does not map" in warnings
        assert "sliding-window attention" in warnings
    back = MistralForCausalLM.from_pretrained(tmp_path / "back")
    assert back.config.sliding_window == 16
    want, got = model.state_dict(), back.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@needs_frameworks
@pytest.mark.frameworks
def test_a_relative_whose_model_is_not_a_llama_is_refused_not_mapped(tmp_path: Path) -> None:
    """A Gemma has a Llama's tensor names, but not its model: its RMSNorm scales by
    (1 + weight), its embeddings by the square root of the width, and its MLP is GELU. Mapped
    by Llama's rules it became a torchtitan Llama 3 that computes something else, with only a
    warning; it is refused now, and so is any relative whose activation is not SiLU."""
    from transformers import GemmaConfig, GemmaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    GemmaForCausalLM(GemmaConfig(**small, head_dim=8)).save_pretrained(tmp_path / "gemma")
    MistralForCausalLM(MistralConfig(**small, hidden_act="gelu")).save_pretrained(tmp_path / "gelu")
    for src, why in (("gemma", "(1 + weight)"), ("gelu", "'gelu'")):
        for to in ("torchtitan", "megatron"):
            r = run_ckpt("convert", tmp_path / src, tmp_path / f"{src}-{to}", "--to", to, "--json")
            assert r.exit_code == 4, r.stdout
            error = json.loads(r.stdout)["error"]
            assert why in error["message"] and "Llama 3" in error["message"], error
            assert "--to safetensors" in error["fix"]
            assert not (tmp_path / f"{src}-{to}").exists()
    # the tensors as they are: any format, no family
    assert run_ckpt("convert", tmp_path / "gemma", tmp_path / "dcp", "--to", "dcp").exit_code == 0


@pytest.mark.parametrize("to", ["hf", "torchtitan"])
def test_a_config_claiming_an_untied_lm_head_the_weights_lack_is_refused(
    tmp_path: Path, to: str
) -> None:
    """A tied Llama (no `lm_head.weight` in its file, as `save_pretrained` writes one) given the
    config.json of an untied one: transformers would build a model whose `lm_head` no tensor
    fills and initialise it at random. It used to export with exit 0 (`from_pretrained` then
    reported `lm_head.weight` MISSING); it is refused (exit 4) naming the tensor and the key,
    and nothing is written. Leaving `lm_head` out of an untied model by `--filter-out` is the
    same model, refused the same way."""
    from safetensors.torch import load_file, save_file

    _llama_hf(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**config, "tie_word_embeddings": True})
    )
    untied = tmp_path / "untied.json"
    untied.write_text(json.dumps(config))
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "out", "--to", to, "--config", untied)
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "tie_word_embeddings: false" in message and "'lm_head.weight'" in message, message
    assert not (tmp_path / "out").exists()
    # the tied model's own config exports it
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "ok", "--to", to)
    assert r.exit_code == 0, r.stdout + r.stderr
    _llama_hf(tmp_path / "untied")
    r = run_ckpt(
        "convert", tmp_path / "untied", tmp_path / "cut", "--to", to,
        "--filter-out", "lm_head.weight",
    )  # fmt: skip
    assert r.exit_code == 4, r.stdout + r.stderr
    assert "tie_word_embeddings: false" in " ".join(r.stderr.split())
    assert not (tmp_path / "cut").exists()


def test_a_dry_run_says_what_the_export_would_leave_out(tmp_path: Path) -> None:
    """`--dry-run` is how a user checks an export before running it: it names what the output
    would not hold (the tied `lm_head` dropped, a file not exported) with the same lines the
    real run prints. It used to list the files and entries only, so the dropped `lm_head`
    surfaced after the export."""
    from safetensors.torch import load_file, save_file

    _llama_hf(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**config, "tie_word_embeddings": True})
    )
    (tmp_path / "hf" / "notes.dat").write_bytes(b"\0" * 8)  # no file ckpt carries
    tt = tmp_path / "tt"
    assert run_ckpt("convert", tmp_path / "hf", tt, "--to", "torchtitan").exit_code == 0
    shutil.copy(tmp_path / "hf" / "notes.dat", tt / "notes.dat")
    dry = run_ckpt("convert", tt, tmp_path / "back", "--to", "hf", "--dry-run")
    assert dry.exit_code == 0, dry.stdout + dry.stderr
    assert not (tmp_path / "back").exists()
    real = run_ckpt("convert", tt, tmp_path / "back", "--to", "hf")
    assert real.exit_code == 0, real.stdout + real.stderr
    lines = [x for x in real.stderr.splitlines() if x.startswith(("skipped", "not in the output"))]
    assert any("lm_head.weight" in x and "tied" in x for x in lines), real.stderr
    assert any("notes.dat" in x for x in lines), real.stderr
    for line in lines:
        assert line in dry.stderr.splitlines(), (line, dry.stderr)


def test_what_the_mapping_lacks_is_named_with_the_checkpoint(tmp_path: Path) -> None:
    """The weights of an FSDP Trainer save are in a DCP folder with no config.json beside
    them: `--to hf` cannot know the head count. The error names the checkpoint it is about,
    as every ckpt error does; it used to start with "the Llama 3 mapping needs n_heads" and
    name no file (in JSON, `error.path` was null)."""
    import torch.distributed.checkpoint as dcp

    _llama_hf(tmp_path / "hf")
    step = tmp_path / "checkpoint-2"
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    dcp.save({"model": weights}, checkpoint_id=step / "pytorch_model_fsdp_0", no_dist=True)
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    r = run_ckpt("convert", step, tmp_path / "out", "--to", "hf", "--json")
    assert r.exit_code == 4, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    assert "needs n_heads" in error["problem"] and "--config" in error["fix"]
    assert error["path"] is not None and str(step) in error["path"], error
    assert not (tmp_path / "out").exists()


def test_a_layer_lacking_a_tensor_the_others_hold_is_refused(tmp_path: Path) -> None:
    """A family was claimed when each of its rules matched some tensor, so a model one of whose
    layers lacked a weight (left out by a `--filter-out`, or by a partial copy) was written
    with exit 0: `from_pretrained` then reported the weight MISSING and initialised it at
    random, and a Qwen3-MoE layer short of its last expert was stacked as 3 experts of 4. Each
    is now refused (exit 4) naming the layer's missing tensor, nothing is written, and a model
    mixing dense and MoE layers (`mlp_only_layers`) still maps, logits bit-exact."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    _llama_hf(tmp_path / "llama")
    titan = tmp_path / "llama-tt"
    assert run_ckpt("convert", tmp_path / "llama", titan, "--to", "torchtitan").exit_code == 0
    cases = [
        (tmp_path / "llama", "torchtitan", "model.layers.1.self_attn.k_proj.weight",
         "layer 1 of the Llama 3 model lacks 'model.layers.1.self_attn.k_proj.weight'"),
        (tmp_path / "llama", "megatron", "model.layers.0.mlp.up_proj.weight",
         "layer 0 of the Llama 3 model lacks 'model.layers.0.mlp.up_proj.weight'"),
        (titan, "hf", "layers.1.attention.wo.weight",
         "layer 1 of the Llama 3 model lacks 'model.layers.1.self_attn.o_proj.weight'"),
    ]  # fmt: skip

    sizes = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    }  # fmt: skip
    torch.manual_seed(0)
    moe = tmp_path / "moe"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(mlp_only_layers=[1], **sizes)).save_pretrained(moe)
    cases += [
        (moe, "torchtitan", "model.layers.2.mlp.experts.3.*",
         "expert(s) [3] of 4 are missing ('model.layers.2.mlp.experts.3.gate_proj.weight')"),
        (moe, "torchtitan", "model.layers.0.mlp.gate.weight",
         "layer 0 of the Qwen3-MoE model lacks 'model.layers.0.mlp.gate.weight'"),
        (moe, "torchtitan", "model.layers.1.mlp.up_proj.weight",
         "layer 1 of the Qwen3-MoE model lacks 'model.layers.1.mlp.up_proj.weight'"),
    ]  # fmt: skip
    for source, target, left_out, says in cases:
        dest = tmp_path / f"out-{target}"
        r = run_ckpt("convert", source, dest, "--to", target, "--filter-out", left_out)
        assert r.exit_code == 4, (left_out, r.stdout + r.stderr)
        assert says in " ".join(r.stderr.split()), r.stderr
        assert not dest.exists()

    # the model mixing a dense layer among MoE ones maps there and back, bit-exact
    there, back = tmp_path / "moe-tt", tmp_path / "moe-hf"
    assert run_ckpt("convert", moe, there, "--to", "torchtitan").exit_code == 0
    r = run_ckpt("convert", there, back, "--to", "hf")
    assert r.exit_code == 0, r.stderr
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(moe)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back)(ids).logits
    assert torch.equal(got, want)


def test_a_config_with_biases_the_weights_lack_is_refused(tmp_path: Path) -> None:
    """A Llama trained with attention biases is refused with a hint to `--filter-out` what is
    no weight; a user who left the biases out that way got an import and an export (exit 0)
    whose carried config.json still said `attention_bias: true`, so `from_pretrained` built
    every bias and reported them MISSING, initialised at random. Both are refused (exit 4),
    naming the setting, and nothing is written; a config naming none converts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    biased = tmp_path / "biased"
    LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **sizes)).save_pretrained(
        biased
    )
    _llama_hf(tmp_path / "plain")
    titan = tmp_path / "titan"
    assert run_ckpt("convert", tmp_path / "plain", titan, "--to", "torchtitan").exit_code == 0
    runs = [
        (biased, "torchtitan", "--filter-out", "*.bias"),
        (biased, "megatron", "--filter-out", "*.bias"),
        (titan, "hf", "--config", biased / "config.json"),
    ]
    for source, target, *options in runs:
        dest = tmp_path / f"out-{target}"
        r = run_ckpt("convert", source, dest, "--to", target, *options)
        assert r.exit_code == 4, r.stdout + r.stderr
        message = " ".join(r.stderr.split())
        assert "config.json says attention_bias: true, mlp_bias: true" in message, message
        assert "initialised at random" in message
        assert not dest.exists()
    r = run_ckpt("convert", titan, tmp_path / "hf", "--to", "hf")
    assert r.exit_code == 0, r.stderr


def test_a_qwen2_is_never_mapped_without_its_qkv_biases(tmp_path: Path) -> None:
    """A Qwen2 has a Llama's tensor names plus q/k/v biases, and its config.json has no
    `attention_bias` key (transformers' Qwen2Attention builds the biases always). Refused for
    its biases, a user added `--filter-out '*.bias'`: the import (and the export of a torchtitan
    Llama with the Qwen2's config.json) was written with exit 0 and a warning, a model that
    runs without its biases. Both are refused (exit 4), by the config.json's model_type and,
    without a config.json, by the filter leaving out tensors of mapped modules; the refusal
    of the unfiltered model no longer suggests --filter-out for them. (ckpt now knows Qwen2,
    from llama.cpp's GGUF: a Qwen2 config.json is refused over weights without its biases,
    and the unfiltered model as one torchtitan has no naming for.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    qwen2 = tmp_path / "qwen2"
    Qwen2ForCausalLM(config).save_pretrained(qwen2)
    assert "attention_bias" not in json.loads((qwen2 / "config.json").read_text())
    _llama_hf(tmp_path / "plain", layers=2)
    titan = tmp_path / "titan"
    assert run_ckpt("convert", tmp_path / "plain", titan, "--to", "torchtitan").exit_code == 0
    runs = [
        (qwen2, "torchtitan", "--filter-out", "*.bias"),
        (qwen2, "megatron", "--filter-out", "*.bias"),
        (titan, "hf", "--config", qwen2 / "config.json"),
    ]
    for source, target, *options in runs:
        dest = tmp_path / f"out-{target}"
        r = run_ckpt("convert", source, dest, "--to", target, *options)
        assert r.exit_code == 4, r.stdout + r.stderr
        message = " ".join(r.stderr.split())
        # a Qwen2 config.json over weights without its biases: no Qwen2 the tensors fill
        assert "config.json is a Qwen2 model's (model_type 'qwen2')" in message, message
        assert "these tensors do not fill" in message
        assert not dest.exists()
    # no config.json to tell: the filter left out tensors of the projections it maps
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(qwen2 / "model.safetensors", bare)
    r = run_ckpt("convert", bare, tmp_path / "out", "--to", "torchtitan", "--filter-out", "*.bias")
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "--filter/--filter-out leave out 6 tensor(s) of modules whose weights are mapped" in (
        message
    ), message
    assert "'model.layers.0.self_attn.k_proj.bias'" in message
    assert not (tmp_path / "out").exists()
    # ckpt knows a Qwen2 (from llama.cpp's GGUF): torchtitan has none to map it to
    r = run_ckpt("convert", qwen2, tmp_path / "out", "--to", "torchtitan")
    assert r.exit_code == 4
    message = " ".join(r.stderr.split())
    assert "Qwen2 has no torchtitan naming" in message, message
    assert "--filter-out" not in message


def test_an_fp8_model_maps_to_a_naming_only_dequantized(tmp_path: Path) -> None:
    """A block-FP8 Llama (each projection's `weight_scale_inv` beside it) refused for its
    scales, given `--filter-out '*.weight_scale_inv'`: the import wrote the FP8 codes as
    torchtitan's weights, without their scales (exit 0), another model. It is refused (exit 4)
    naming the scheme and `--dequantize`, which maps it in full precision; `diff --dequantize`
    then compares the import with the FP8 model across the namings."""
    from .test_quant import quantize_fp8_block

    _llama_hf(tmp_path / "hf")
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(tmp_path / "hf" / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            codes, scale = quantize_fp8_block(tensor.to(torch.bfloat16), 16)
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = codes, scale
        else:
            stored[name] = tensor.to(torch.bfloat16)
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    }  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    for options in (("--filter-out", "*.weight_scale_inv"), ()):
        r = run_ckpt("convert", fp8, tmp_path / "tt", "--to", "torchtitan", *options)
        assert r.exit_code == 4, r.stdout + r.stderr
        message = " ".join(r.stderr.split())
        assert "holds quantized weights (fp8-block) with their scales" in message, message
        assert "Pass --dequantize" in message
        assert not (tmp_path / "tt").exists()
    r = run_ckpt("convert", fp8, tmp_path / "tt", "--to", "torchtitan", "--dequantize")
    assert r.exit_code == 0, r.stdout + r.stderr
    # the import holds the bf16 the weights dequantize to; diff dequantizes to float32
    r = run_ckpt("diff", tmp_path / "tt", fp8, "--dequantize", "--rtol", "0.01", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["naming"]["naming_a"] == "torchtitan" and doc["compared"] == 21


def test_a_config_leaving_tie_word_embeddings_out_is_an_untied_one(tmp_path: Path) -> None:
    """transformers builds an untied `lm_head` when config.json leaves `tie_word_embeddings`
    out (the default of LlamaConfig and Qwen3Config). An export of weights without an output
    projection under such a config was written with exit 0 and `from_pretrained` initialised
    `lm_head` at random (MISSING); an explicit `false` was already refused. Both are now, the
    message saying which; the same config with the key set to true exports the tied model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    sizes = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    tied = tmp_path / "tied"
    LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **sizes)).save_pretrained(tied)
    config = json.loads((tied / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "silent.json").write_text(json.dumps(config))
    titan = tmp_path / "titan"
    assert run_ckpt("convert", tied, titan, "--to", "torchtitan").exit_code == 0

    r = run_ckpt(
        "convert", titan, tmp_path / "hf", "--to", "hf", "--config", tmp_path / "silent.json",
        "--filter-out", "lm_head.weight",
    )  # fmt: skip
    assert r.exit_code == 4, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "leaves tie_word_embeddings out (transformers' default: false)" in message, message
    assert "'lm_head.weight'" in message and not (tmp_path / "hf").exists()

    config["tie_word_embeddings"] = True
    (tmp_path / "tied.json").write_text(json.dumps(config))
    r = run_ckpt(
        "convert", titan, tmp_path / "hf", "--to", "hf", "--config", tmp_path / "tied.json",
        "--filter-out", "lm_head.weight",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tied)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    assert torch.equal(got, want)
