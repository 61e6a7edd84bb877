"""Qwen3.5 (dense and MoE) from torchtitan to serving and back: `convert --to hf` /
`--to torchtitan`.

tests/torchtitan_arch_script.py builds a tiny torchtitan 0.3.0 Qwen3.5 (three GatedDeltaNet
layers and one gated full-attention layer, a tiny vision encoder beside them; the MoE with
routed experts and a gated shared expert) on CPU, takes one AdamW step and saves `step-1/`
with torchtitan's own `CheckpointManager.save`, with its forward on fixed ids and torchtitan's
own `Qwen35StateDictAdapter.to_hf`. The export of the language model must load in
transformers' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` and give torchtitan's logits; its
import back must load with `CheckpointManager.load`, every tensor as saved, and train a step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from .conftest import run_ckpt
from .dist_helpers import torchrun_env

SCRIPT = Path(__file__).with_name("torchtitan_arch_script.py")

needs_qwen35 = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None
    or importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("fla") is None,
    reason="torchtitan, transformers and flash-linear-attention (which torchtitan's qwen3_5 "
    "imports) are not installed (pip install '.[frameworks]')",
)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# --------------------------------------------------------------------------- no frameworks

DIM, VOCAB, FFN, HEADS, KV, HEAD_DIM = 32, 40, 48, 4, 2, 16
K_DIM, V_DIM, CONV, EXPERTS, MOE_FFN = 16, 32, 4, 4, 24


def _qwen35_hf(folder: Path, *, moe: bool) -> dict[str, torch.Tensor]:
    """A tiny HF-named Qwen3.5 language model (random tensors) with its config.json: layers
    0-2 GatedDeltaNet, layer 3 full attention."""
    gen = torch.Generator().manual_seed(0)
    lm = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {
        lm + "embed_tokens.weight": (VOCAB, DIM),
        lm + "norm.weight": (DIM,),
        "lm_head.weight": (VOCAB, DIM),
    }
    for i in range(4):
        p = f"{lm}layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (DIM,),
            p + "post_attention_layernorm.weight": (DIM,),
        }
        if i == 3:
            shapes |= {
                p + "self_attn.q_proj.weight": (2 * HEADS * HEAD_DIM, DIM),
                p + "self_attn.k_proj.weight": (KV * HEAD_DIM, DIM),
                p + "self_attn.v_proj.weight": (KV * HEAD_DIM, DIM),
                p + "self_attn.o_proj.weight": (DIM, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": (HEAD_DIM,),
                p + "self_attn.k_norm.weight": (HEAD_DIM,),
            }
        else:
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": (2 * K_DIM + V_DIM, DIM),
                p + "linear_attn.conv1d.weight": (2 * K_DIM + V_DIM, 1, CONV),
                p + "linear_attn.in_proj_z.weight": (V_DIM, DIM),
                p + "linear_attn.in_proj_a.weight": (4, DIM),
                p + "linear_attn.in_proj_b.weight": (4, DIM),
                p + "linear_attn.A_log": (4,),
                p + "linear_attn.dt_bias": (4,),
                p + "linear_attn.norm.weight": (8,),
                p + "linear_attn.out_proj.weight": (DIM, V_DIM),
            }
        if moe:
            shapes |= {
                p + "mlp.gate.weight": (EXPERTS, DIM),
                p + "mlp.experts.gate_up_proj": (EXPERTS, 2 * MOE_FFN, DIM),
                p + "mlp.experts.down_proj": (EXPERTS, DIM, MOE_FFN),
                p + "mlp.shared_expert.gate_proj.weight": (FFN, DIM),
                p + "mlp.shared_expert.up_proj.weight": (FFN, DIM),
                p + "mlp.shared_expert.down_proj.weight": (DIM, FFN),
                p + "mlp.shared_expert_gate.weight": (1, DIM),
            }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (FFN, DIM),
                p + "mlp.up_proj.weight": (FFN, DIM),
                p + "mlp.down_proj.weight": (DIM, FFN),
            }
    tensors = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "num_hidden_layers": 4,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": CONV,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
    }
    config |= (
        {
            "num_experts": EXPERTS,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": MOE_FFN,
            "shared_expert_intermediate_size": FFN,
        }
        if moe
        else {"intermediate_size": FFN}
    )
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_qwen3_5_splits_its_fused_tensors_into_torchtitan_names_and_back(
    tmp_path: Path, moe: bool
) -> None:
    """transformers' fused GatedDeltaNet `in_proj_qkv` / `conv1d` (rows q | k | v, the value
    width told by `in_proj_z`) and MoE `gate_up_proj` ([E, 2F, D], gate rows first) are
    torchtitan's separate `in_proj_q/k/v`, `conv_q/k/v` and stacked `w1_EFD` / `w3_EFD`; the
    way back fuses them bit for bit."""
    tensors = _qwen35_hf(tmp_path / "hf", moe=moe)
    family = "qwen3.5-moe" if moe else "qwen3.5"
    r = run_ckpt("inspect", tmp_path / "hf", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["result"]["architecture"]["architecture"] == family
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    transforms = json.loads(r.stdout)["result"]["architecture"]["transforms"]
    assert transforms["split-qkv"] == 3 * 6
    assert transforms.get("split-gate-up") == (8 if moe else None)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    names = {
        "layers.0.attn.in_proj_q.weight": (K_DIM, DIM),
        "layers.0.attn.in_proj_k.weight": (K_DIM, DIM),
        "layers.0.attn.in_proj_v.weight": (V_DIM, DIM),
        "layers.0.attn.conv_v.weight": (V_DIM, 1, CONV),
        "layers.3.attn.wq.weight": (2 * HEADS * HEAD_DIM, DIM),
    }
    if moe:
        names |= {
            "layers.0.moe.routed_experts.inner_experts.w1_EFD": (EXPERTS, MOE_FFN, DIM),
            "layers.0.moe.routed_experts.inner_experts.w3_EFD": (EXPERTS, MOE_FFN, DIM),
            "layers.0.moe.expert_bias_E": (EXPERTS,),
        }
    state = {name: torch.empty(shape) for name, shape in names.items()}
    dcp_load(state, storage_reader=FileSystemReader(str(tmp_path / "tt")), no_dist=True)
    lm = "model.language_model.layers.0."
    qkv = tensors[lm + "linear_attn.in_proj_qkv.weight"]
    assert torch.equal(state["layers.0.attn.in_proj_q.weight"], qkv[:K_DIM])
    assert torch.equal(state["layers.0.attn.in_proj_k.weight"], qkv[K_DIM : 2 * K_DIM])
    assert torch.equal(state["layers.0.attn.in_proj_v.weight"], qkv[2 * K_DIM :])
    conv = tensors[lm + "linear_attn.conv1d.weight"]
    assert torch.equal(state["layers.0.attn.conv_v.weight"], conv[2 * K_DIM :])
    q = tensors["model.language_model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(state["layers.3.attn.wq.weight"], q)
    if moe:
        gate_up = tensors[lm + "mlp.experts.gate_up_proj"]
        experts = "layers.0.moe.routed_experts.inner_experts."
        assert torch.equal(state[experts + "w1_EFD"], gate_up[:, :MOE_FFN])
        assert torch.equal(state[experts + "w3_EFD"], gate_up[:, MOE_FFN:])
        assert not state["layers.0.moe.expert_bias_E"].any()  # its fresh-start zeros
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    back = _hf_tensors(tmp_path / "back")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name


def test_a_qwen3_5_whose_config_puts_attention_elsewhere_is_refused(tmp_path: Path) -> None:
    """transformers builds each layer's attention from config.json's `layer_types`: one that
    does not say where the weights' full-attention layer is builds a model they do not fill."""
    _qwen35_hf(tmp_path / "hf", moe=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["layer_types"] = ["full_attention"] + ["linear_attention"] * 3
    (tmp_path / "other.json").write_text(json.dumps(config))
    r = run_ckpt(
        "convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan",
        "--config", tmp_path / "other.json",
    )  # fmt: skip
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert 'layer 0 holds linear attention, where layer_types[0] = "full_attention"' in said
    assert not (tmp_path / "tt").exists()


def test_a_qwen3_5_layer_without_its_value_projection_is_refused(tmp_path: Path) -> None:
    """torchtitan's three q/k/v projections are one tensor in transformers': a layer lacking
    one cannot be fused, and is named."""
    _qwen35_hf(tmp_path / "hf", moe=False)
    assert run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan")
    r = run_ckpt(
        "convert", tmp_path / "tt", tmp_path / "back", "--to", "hf",
        "--filter-out", "layers.1.attn.in_proj_v.weight",
    )  # fmt: skip
    assert r.exit_code == 4
    assert "'layers.1.attn.in_proj_v.weight' is missing" in " ".join(r.stderr.split())
    assert not (tmp_path / "back").exists()


#: a tiny vision encoder: width 16, one block, patches of 3 channels x 2 frames x 4 x 4
V_DIM_, V_FFN, PATCH = 16, 32, 4
PATCH_WIDTH = 3 * 2 * PATCH * PATCH


def _vision_hf() -> dict[str, torch.Tensor]:
    """A tiny Qwen3.5 vision encoder in transformers' names (random tensors)."""
    gen = torch.Generator().manual_seed(1)
    merged = 4 * V_DIM_  # spatial_merge_size 2: four patches side by side
    b = "model.visual.blocks.0."
    shapes: dict[str, tuple[int, ...]] = {
        "model.visual.patch_embed.proj.weight": (V_DIM_, 3, 2, PATCH, PATCH),
        "model.visual.patch_embed.proj.bias": (V_DIM_,),
        "model.visual.pos_embed.weight": (16, V_DIM_),
        b + "norm1.weight": (V_DIM_,),
        b + "norm1.bias": (V_DIM_,),
        b + "norm2.weight": (V_DIM_,),
        b + "norm2.bias": (V_DIM_,),
        b + "attn.qkv.weight": (3 * V_DIM_, V_DIM_),
        b + "attn.qkv.bias": (3 * V_DIM_,),
        b + "attn.proj.weight": (V_DIM_, V_DIM_),
        b + "attn.proj.bias": (V_DIM_,),
        b + "mlp.linear_fc1.weight": (V_FFN, V_DIM_),
        b + "mlp.linear_fc1.bias": (V_FFN,),
        b + "mlp.linear_fc2.weight": (V_DIM_, V_FFN),
        b + "mlp.linear_fc2.bias": (V_DIM_,),
        "model.visual.merger.norm.weight": (V_DIM_,),
        "model.visual.merger.norm.bias": (V_DIM_,),
        "model.visual.merger.linear_fc1.weight": (merged, merged),
        "model.visual.merger.linear_fc1.bias": (merged,),
        "model.visual.merger.linear_fc2.weight": (DIM, merged),
        "model.visual.merger.linear_fc2.bias": (DIM,),
    }
    return {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}


def _vlm_config(text: dict[str, Any]) -> dict[str, Any]:
    """Qwen's own config.json layout: the language model's and the vision encoder's."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 1,
            "hidden_size": V_DIM_,
            "intermediate_size": V_FFN,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": PATCH,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": DIM,
            "num_position_embeddings": 16,
        },
        "tie_word_embeddings": False,
    }


def test_a_qwen3_5_with_its_vision_encoder_converts_to_torchtitan_and_back_bit_exact(
    tmp_path: Path,
) -> None:
    """Qwen's checkpoints hold the vision encoder beside the language model (`model.visual.`):
    its fused attention `qkv` (weight and bias) is torchtitan's `wq/wk/wv`, its Conv3d patch
    embedding torchtitan's flat Linear, as torchtitan's adapter maps them; the way back
    fuses and reshapes them bit for bit, and `diff` compares the encoder across the namings."""
    tensors = _qwen35_hf(tmp_path / "plain", moe=False)
    text = json.loads((tmp_path / "plain" / "config.json").read_text())
    vision = _vision_hf()
    # and their multi-token-prediction head, which transformers' load ignores (`^mtp.*`)
    mtp = {"mtp.fc.weight": torch.ones(DIM, 2 * DIM)}
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    save_file({**tensors, **vision, **mtp}, vlm / "model.safetensors")
    (vlm / "config.json").write_text(json.dumps(_vlm_config(text)))
    r = run_ckpt("inspect", vlm, "--json")
    assert json.loads(r.stdout)["result"]["architecture"]["architecture"] == "qwen3.5"
    r = run_ckpt("convert", vlm, tmp_path / "tt", "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    transforms = json.loads(r.stdout)["result"]["architecture"]["transforms"]
    assert transforms["split-qkv"] == 3 * 6 + 6 and transforms["reshape"] == 1
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    v = "vision_encoder.layers.0.attn."
    state = {
        "vision_encoder.patch_embed.weight": torch.empty(V_DIM_, PATCH_WIDTH),
        "vision_encoder.pos_embed": torch.empty(16, V_DIM_),
        **{v + f"{w}.weight": torch.empty(V_DIM_, V_DIM_) for w in ("wq", "wk", "wv")},
        **{v + f"{w}.bias": torch.empty(V_DIM_) for w in ("wq", "wk", "wv")},
    }
    dcp_load(state, storage_reader=FileSystemReader(str(tmp_path / "tt")), no_dist=True)
    patch = vision["model.visual.patch_embed.proj.weight"]
    assert torch.equal(state["vision_encoder.patch_embed.weight"], patch.reshape(V_DIM_, -1))
    assert torch.equal(state["vision_encoder.pos_embed"], vision["model.visual.pos_embed.weight"])
    for kind in ("weight", "bias"):
        q, k, w = vision[f"model.visual.blocks.0.attn.qkv.{kind}"].chunk(3)
        for part, want in (("wq", q), ("wk", k), ("wv", w)):
            assert torch.equal(state[f"{v}{part}.{kind}"], want), (part, kind)
    # back to transformers' names, with the config that shapes the patch embedding
    r = run_ckpt(
        "convert", tmp_path / "tt", tmp_path / "back", "--to", "hf", "--config", vlm / "config.json"
    )
    assert r.exit_code == 0, r.stderr
    back = _hf_tensors(tmp_path / "back")
    assert back.keys() == {*tensors, *vision}
    for name, tensor in {**tensors, **vision}.items():
        assert torch.equal(back[name], tensor), name
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert written["vision_config"]["patch_size"] == PATCH
    r = run_ckpt("diff", vlm, tmp_path / "tt", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and doc["compared"] == len(tensors) + len(vision)
    assert {item["name"] for item in doc["naming"]["left_out_a"]} == set(mtp)


def test_a_vision_encoder_short_of_a_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    """A text model holds no vision encoder, so its tensors are optional to recognition; but
    an encoder converted short of one (a `--filter-out` too wide) would load with that weight
    at random: refused, named."""
    tensors = _qwen35_hf(tmp_path / "plain", moe=False)
    text = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "vlm").mkdir()
    save_file({**tensors, **_vision_hf()}, tmp_path / "vlm" / "model.safetensors")
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(_vlm_config(text)))
    r = run_ckpt(
        "convert", tmp_path / "vlm", tmp_path / "tt", "--to", "torchtitan",
        "--filter-out", "model.visual.blocks.0.norm2.*",
    )  # fmt: skip
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "vision encoder lacks 'model.visual.blocks.0.norm2.weight' and 1 more" in said
    assert "--filter-out 'vision_encoder.*'" in said
    assert not (tmp_path / "tt").exists()


def test_a_vision_encoder_exported_with_a_text_config_is_refused_and_one_left_out_gets_one(
    tmp_path: Path,
) -> None:
    """The flat patch embedding's channels, frames and patch size are the config's
    `vision_config`: a text model's config cannot shape it (and from_pretrained would build
    no encoder for the tensors), so the export is refused, naming the fix; the language model
    alone, exported with Qwen's VLM config, gets the text model's config, which builds no
    encoder at random."""
    tensors = _qwen35_hf(tmp_path / "plain", moe=False)
    text = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "vlm").mkdir()
    save_file({**tensors, **_vision_hf()}, tmp_path / "vlm" / "model.safetensors")
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(_vlm_config(text)))
    assert run_ckpt("convert", tmp_path / "vlm", tmp_path / "tt", "--to", "torchtitan")
    r = run_ckpt(
        "convert", tmp_path / "tt", tmp_path / "refused", "--to", "hf",
        "--config", tmp_path / "plain" / "config.json",
    )  # fmt: skip
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "'vision_encoder.patch_embed.weight' is the vision encoder's patch embedding" in said
    assert "no vision_config" in said and "--filter-out 'vision_encoder.*'" in said
    assert not (tmp_path / "refused").exists()
    r = run_ckpt(
        "convert", tmp_path / "tt", tmp_path / "text", "--to", "hf",
        "--config", tmp_path / "vlm" / "config.json", "--filter-out", "vision_encoder.*",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    written = json.loads((tmp_path / "text" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForCausalLM"]
    assert "vision_config" not in written and written["hidden_size"] == DIM
    assert _hf_tensors(tmp_path / "text").keys() == tensors.keys()


def test_a_flavor_whose_torchtitan_model_cannot_be_imported_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchtitan's qwen3_5 imports flash-linear-attention at its top: without it, `--flavor`
    crashed (exit 70, a ModuleNotFoundError); it names what is missing and --config."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed: --flavor says so itself")
    _qwen35_hf(tmp_path / "hf", moe=False)
    (tmp_path / "hf" / "config.json").unlink()
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    for name in [n for n in sys.modules if n.startswith("torchtitan.models.qwen3_5")]:
        monkeypatch.delitem(sys.modules, name)
    r = run_ckpt(
        "convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--flavor", "0.8B"
    )
    assert r.exit_code == 2, r.stderr
    said = " ".join(r.stderr.split())
    assert "model registry of torchtitan.models.qwen3_5, whose import failed" in said
    assert "Install what it imports (fla)" in said and "--config" in said
    assert not (tmp_path / "tt").exists()


# --------------------------------------------------------------------------- torchtitan


def _script(*args: str | Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def titan_qwen35(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A torchtitan run (`run/checkpoint/step-1`) of FAMILY and its references (`ref/`)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"arch-{family}")
    _script("save", family, root / "run", root / "ref")
    return family, root


def _hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(SCRIPT.parent))
    from torchtitan_arch_script import QWEN35_IDS

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    # every weight transformers builds is one the export holds, and no tensor is left over
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits: torch.Tensor = model.eval()(QWEN35_IDS).logits
    return logits


#: the MoE forward sums the routed experts in another order than torchtitan's grouped
#: matmul (measured 4.8e-6); the dense one agrees to float32 rounding (measured 1.2e-7)
TOLERANCE = {"qwen3.5": 1e-6, "qwen3.5-moe": 1e-4}


@needs_qwen35
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_torchtitan_qwen3_5_exports_to_a_model_transformers_loads_with_its_logits(
    titan_qwen35: tuple[str, Path], tmp_path: Path
) -> None:
    family, root = titan_qwen35
    step = root / "run" / "checkpoint" / "step-1"
    config = root / "ref" / "config.json"
    r = run_ckpt("inspect", step, "--json")
    assert r.exit_code == 0, r.stderr
    arch = json.loads(r.stdout)["result"]["architecture"]
    assert (arch["architecture"], arch["naming"]) == (family, "torchtitan")
    # the save holds torchtitan's vision encoder, which a text model's config cannot shape:
    # refused, naming the fix
    r = run_ckpt("convert", step, tmp_path / "refused", "--to", "hf", "--config", config)
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "'vision_encoder.patch_embed.weight' is the vision encoder's patch embedding" in said
    assert "--filter-out 'vision_encoder.*'" in said
    assert not (tmp_path / "refused").exists()
    # the language model alone
    dest = tmp_path / "hf"
    r = run_ckpt(
        "convert", step, dest, "--to", "hf", "--config", config,
        "--filter-out", "vision_encoder.*", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["architecture"]["architecture"] == family
    # torchtitan's own to_hf, tensor for tensor; its experts are the transpose of what
    # transformers' Qwen3_5MoeExperts loads (`[E, D, 2F]` against `[E, 2F, D]`): the same
    # values, in the layout from_pretrained takes
    want = {
        k: v
        for k, v in load_file(root / "ref" / "to_hf.safetensors").items()
        if not k.startswith("model.visual.")
    }
    got = _hf_tensors(dest)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensor = tensor.transpose(-2, -1)
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    logits = _hf_logits(dest)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, reference, rtol=0, atol=TOLERANCE[family])
    # the config.json --flavor builds from torchtitan's model config: the same model, its
    # language model alone written with the text model's config
    flavored = tmp_path / "flavored"
    r = run_ckpt(
        "convert", step, flavored, "--to", "hf", "--config", root / "ref" / "flavor_config.json",
        "--filter-out", "vision_encoder.*",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "vision_config" not in json.loads((flavored / "config.json").read_text())
    assert torch.allclose(_hf_logits(flavored), reference, rtol=0, atol=TOLERANCE[family])


def _vlm(folder: Path) -> Any:
    """transformers' Qwen3.5 vision-language model of `folder`, loaded whole."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    kind = getattr(transformers, config["architectures"][0])
    model, info = kind.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


#: transformers' vision attention and torchtitan's (flex) sum in other orders (measured 6.2e-7)
VISION_TOLERANCE = 1e-5


@needs_qwen35
@pytest.mark.frameworks
@pytest.mark.slow
@pytest.mark.parametrize("config", ["config_vlm.json", "flavor_config.json"])
def test_a_torchtitan_qwen3_5_with_its_vision_encoder_exports_to_the_model_transformers_loads(
    titan_qwen35: tuple[str, Path], tmp_path: Path, config: str
) -> None:
    """The whole save, language model and vision encoder, under Qwen's own config layout
    (the VLM's, or the one --flavor builds from torchtitan's model config): every tensor is
    torchtitan's own `to_hf`'s, `Qwen3_5(Moe)ForConditionalGeneration.from_pretrained` loads
    it with no weight missing, its text logits are torchtitan's, and its vision encoder
    computes what torchtitan's computes on the same image."""
    family, root = titan_qwen35
    step = root / "run" / "checkpoint" / "step-1"
    dest = tmp_path / "hf"
    r = run_ckpt("convert", step, dest, "--to", "hf", "--config", root / "ref" / config, "--json")
    assert r.exit_code == 0, r.stderr
    transforms = json.loads(r.stdout)["result"]["architecture"]["transforms"]
    assert transforms["reshape"] == 1 and transforms["fuse-qkv"] >= 2
    want = load_file(root / "ref" / "to_hf.safetensors")
    got = _hf_tensors(dest)
    assert got.keys() == want.keys()
    assert any(k.startswith("model.visual.") for k in got)
    for name, tensor in want.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensor = tensor.transpose(-2, -1)  # as in the text export above
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    model = _vlm(dest)
    sys.path.insert(0, str(SCRIPT.parent))
    from torchtitan_arch_script import QWEN35_IDS

    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    vision = torch.load(root / "ref" / "vision.pt", weights_only=True)
    with torch.no_grad():
        logits = model(QWEN35_IDS).logits
        seen = model.model.visual(vision["pixels"], grid_thw=vision["grid"]).pooler_output
    assert torch.allclose(logits, reference, rtol=0, atol=TOLERANCE[family])
    assert seen.shape == vision["out"].shape
    assert torch.allclose(seen, vision["out"], rtol=0, atol=VISION_TOLERANCE)
    # the export holds what torchtitan saved: diff reads the save through the same mapping
    r = run_ckpt("diff", step, dest, "--select", "model", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and not doc["only_a"] and not doc["only_b"]
    assert doc["compared"] == len(want)


@needs_qwen35
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_qwen3_5_export_imports_back_into_torchtitan_bit_exact(
    titan_qwen35: tuple[str, Path], tmp_path: Path
) -> None:
    """HF -> torchtitan: CheckpointManager.load (step-0, model only) of the language model
    restores every tensor as torchtitan saved it, and one training step runs after it."""
    family, root = titan_qwen35
    step = root / "run" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    r = run_ckpt(
        "convert", step, hf, "--to", "hf", "--config", root / "ref" / "config.json",
        "--filter-out", "vision_encoder.*",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    _imports_back(family, root, hf, tmp_path, vision=False)


@needs_qwen35
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_qwen3_5_export_with_its_vision_encoder_imports_back_into_torchtitan_bit_exact(
    titan_qwen35: tuple[str, Path], tmp_path: Path
) -> None:
    """HF -> torchtitan of the whole model: CheckpointManager.load restores the vision
    encoder too, every tensor as saved, and it sees the image as the saved model did."""
    family, root = titan_qwen35
    step = root / "run" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    r = run_ckpt(
        "convert", step, hf, "--to", "hf", "--config", root / "ref" / "config_vlm.json"
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    _imports_back(family, root, hf, tmp_path, vision=True)
    seen = torch.load(tmp_path / "out" / "loaded_vision.pt", weights_only=True)
    want = torch.load(root / "ref" / "vision.pt", weights_only=True)
    assert torch.equal(seen["out"], want["out"])


def _imports_back(family: str, root: Path, hf: Path, tmp_path: Path, *, vision: bool) -> None:
    """`hf` converted to torchtitan and loaded by its CheckpointManager: every tensor as
    torchtitan saved it, the same logits, and a training step after it."""
    r = run_ckpt("convert", hf, tmp_path / "tt", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "tt", run / "checkpoint" / "step-0")
    _script("load-vision" if vision else "load", family, run, tmp_path / "out")
    saved = torch.load(root / "ref" / "state.pt", weights_only=True)
    loaded = torch.load(tmp_path / "out" / "loaded_state.pt", weights_only=True)
    held = {k for k in saved if vision or not k.startswith("vision_encoder.")}
    assert loaded.keys() == held
    for name, tensor in loaded.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert torch.equal(torch.load(tmp_path / "out" / "loaded_logits.pt"), reference)
    trained = torch.load(tmp_path / "out" / "trained.pt", weights_only=True)
    assert trained["restored"] and trained["moved"]
    assert torch.isfinite(torch.tensor(trained["loss"]))
