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


def test_a_qwen3_5_with_its_vision_encoder_is_refused_naming_it_and_diffed_without_it(
    tmp_path: Path,
) -> None:
    """Qwen's checkpoints hold the vision encoder beside the language model (`model.visual.`),
    which ckpt does not map: the family is still named, a conversion is refused naming the
    encoder's tensors and the `--filter-out` that converts the language model alone (never
    dropped quietly), and `diff` across namings compares the rest, naming what it left out."""
    tensors = _qwen35_hf(tmp_path / "plain", moe=False)
    vision = {
        "model.visual.patch_embed.proj.weight": torch.ones(16, 3, 2, 4, 4),
        "model.visual.blocks.0.attn.qkv.weight": torch.ones(48, 16),
    }
    # and their multi-token-prediction head, which transformers' load ignores (`^mtp.*`)
    mtp = {"mtp.fc.weight": torch.ones(DIM, 2 * DIM)}
    (tmp_path / "vlm").mkdir()
    save_file({**tensors, **vision, **mtp}, tmp_path / "vlm" / "model.safetensors")
    shutil.copy(tmp_path / "plain" / "config.json", tmp_path / "vlm" / "config.json")
    r = run_ckpt("inspect", tmp_path / "vlm", "--json")
    assert json.loads(r.stdout)["result"]["architecture"]["architecture"] == "qwen3.5"
    r = run_ckpt("convert", tmp_path / "vlm", tmp_path / "tt", "--to", "torchtitan")
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "2 tensor(s) of Qwen3.5's vision encoder" in said
    assert "'model.visual.patch_embed.proj.weight'" in said
    assert "--filter-out 'model.visual.*'" in said
    assert not (tmp_path / "tt").exists()
    r = run_ckpt(
        "convert", tmp_path / "vlm", tmp_path / "tt", "--to", "torchtitan",
        "--filter-out", "model.visual.*",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "multi-token-prediction module" in r.stderr and "mtp.fc.weight" in r.stderr
    r = run_ckpt("diff", tmp_path / "vlm", tmp_path / "tt", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and doc["compared"] == len(tensors)
    left = {item["name"] for item in doc["naming"]["left_out_a"]}
    assert {*vision, *mtp} <= left


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
    # the save holds torchtitan's vision encoder, which ckpt does not map: refused, named
    r = run_ckpt("convert", step, tmp_path / "refused", "--to", "hf", "--config", config)
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "tensor(s) of Qwen3.5" in said and "'vision_encoder." in said
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
    # the export holds what torchtitan saved: diff reads the save through the same mapping,
    # and names the vision encoder it leaves out
    r = run_ckpt("diff", step, dest, "--select", "model", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and not doc["only_a"] and not doc["only_b"]
    assert doc["compared"] == len(want)
    left = {item["name"] for item in doc["naming"]["left_out_a"]}
    assert "vision_encoder.patch_embed.weight" in left
    # the config.json --flavor builds from torchtitan's model config: the same model
    flavored = tmp_path / "flavored"
    r = run_ckpt(
        "convert", step, flavored, "--to", "hf", "--config", root / "ref" / "flavor_config.json",
        "--filter-out", "vision_encoder.*",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert torch.allclose(_hf_logits(flavored), reference, rtol=0, atol=TOLERANCE[family])


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
    r = run_ckpt("convert", hf, tmp_path / "tt", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "tt", run / "checkpoint" / "step-0")
    _script("load", family, run, tmp_path / "out")
    saved = torch.load(root / "ref" / "state.pt", weights_only=True)
    loaded = torch.load(tmp_path / "out" / "loaded_state.pt", weights_only=True)
    assert loaded.keys() == {k for k in saved if not k.startswith("vision_encoder.")}
    for name, tensor in loaded.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
    reference = torch.load(root / "ref" / "logits.pt", weights_only=True)
    assert torch.equal(torch.load(tmp_path / "out" / "loaded_logits.pt"), reference)
    trained = torch.load(tmp_path / "out" / "trained.pt", weights_only=True)
    assert trained["restored"] and trained["moved"]
    assert torch.isfinite(torch.tensor(trained["loss"]))
