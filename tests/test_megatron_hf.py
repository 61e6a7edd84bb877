"""Megatron-Core GPT ⇄ Hugging Face Llama (#27): `convert --to hf` of a real `GPTModel` save
and `convert --to megatron` of a real `LlamaForCausalLM`, judged by the frameworks themselves.

The Megatron side is megatron-core's own `GPTModel` (local spec: RMSNorm, SwiGLU, GQA, rotary,
no bias, untied output) saved by its `dist_checkpointing.save` under torchrun on 2 ranks
(tensor parallel: QKV and fc1 split across the ranks), and loaded back by its
`dist_checkpointing.load` (tests/megatron_gpt_script.py). The HF side is transformers'
`from_pretrained`. Equivalence is the logits on fixed input ids (fp32, max abs diff ≤ 1e-6);
the round trip HF → Megatron → HF is bit-exact.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .dist_helpers import free_port, run_torchrun, torchrun_env

# find_spec, not importorskip: importing megatron.core registers torch safe globals
# process-wide (see test_megatron.py); this process never imports it
if (
    importlib.util.find_spec("megatron") is None
    or not (
        Path(importlib.util.find_spec("megatron").submodule_search_locations[0]) / "core"  # type: ignore[index,union-attr]
    ).is_dir()
    or importlib.util.find_spec("transformers") is None
):
    pytest.skip(
        "megatron-core and transformers are not installed (pip install '.[frameworks]')",
        allow_module_level=True,
    )
pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = Path(__file__).with_name("megatron_gpt_script.py")
sys.path.insert(0, str(SCRIPT.parent))
import megatron_gpt_script as gpt  # noqa: E402  (its constants; it imports no megatron at import)

#: fp32 logits of the same model on both sides agree to this (the issue's bar)
TOLERANCE = 1e-6


def megatron_load(
    folder: Path, out: Path, ranks: int = 1, rope: str = "", family: str = ""
) -> tuple[torch.Tensor, dict[str, Any]]:
    """megatron's own `dist_checkpointing.load` of `folder` into a fresh GPTModel (on `ranks`
    tensor-parallel ranks; its rope scaled as `rope` says; built as `family`'s, `qwen2` or
    `qwen3`, see the script): its logits on `INPUT_IDS` and what one training step did."""
    env = {"MEGATRON_ROPE": rope, "MEGATRON_FAMILY": family}
    if ranks == 1:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "load", str(folder), str(out), str(free_port())],
            capture_output=True,
            text=True,
            env={**torchrun_env(), **env},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        run_torchrun(SCRIPT, ranks, "load", folder, out, timeout=600, env=env)
    return (
        torch.load(f"{out}.logits.pt", weights_only=True),
        torch.load(f"{out}.step.pt", weights_only=True),
    )


def hf_logits(folder: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(gpt.INPUT_IDS)).logits
    return model, logits


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    # the logits are far from trivial: a comparison of near-zero outputs would prove nothing
    assert float(b.std()) > 0.3
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def megatron_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A 2-rank tensor-parallel torch_dist save of the tiny GPTModel, and its logits."""
    root = tmp_path_factory.mktemp("megatron-gpt")
    run_torchrun(SCRIPT, 2, "save", root / "ckpt", timeout=600)
    return root / "ckpt", torch.load(root / "ckpt.logits.pt", weights_only=True)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A LlamaForCausalLM of the GPTModel's dimensions, random, saved sharded by transformers,
    and its logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=gpt.HIDDEN,
        intermediate_size=gpt.FFN,
        num_hidden_layers=gpt.LAYERS,
        num_attention_heads=gpt.HEADS,
        num_key_value_heads=gpt.GROUPS,
        vocab_size=gpt.VOCAB,
        max_position_embeddings=gpt.MAX_POS,
        rms_norm_eps=gpt.EPS,
        rope_theta=gpt.ROTARY_BASE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder, hf_logits(folder)[1]


def test_export_to_hf_loads_in_transformers_with_megatrons_logits(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, truth = megatron_save
    out = tmp_path / "hf"
    result = run_ckpt("convert", folder, out, "--to", "hf", "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    arch = report["architecture"]
    assert (arch["architecture"], arch["source_naming"], arch["target_naming"]) == (
        "llama3",
        "megatron",
        "hf",
    )
    assert arch["transforms"]["split-qkv"] == 3 * gpt.LAYERS
    assert arch["transforms"]["split-gate-up"] == 2 * gpt.LAYERS
    # the model args came from Megatron-LM's args in common.pt
    assert arch["args"]["n_kv_heads"] == gpt.GROUPS and arch["args"]["rope_theta"] == 500000.0
    # the per-layer _extra_state objects and the common state are no weights: reported
    skipped = {s["name"] for s in report["skipped"]}
    assert {"args", "iteration", "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"} <= skipped
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    config = json.loads((out / "config.json").read_text())
    # the configs are equivalent: RMSNorm eps, SwiGLU (silu), rotary base, no bias, untied
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False
    assert config["rms_norm_eps"] == gpt.EPS and config["rope_theta"] == gpt.ROTARY_BASE
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (gpt.HEADS, gpt.GROUPS)
    assert config["intermediate_size"] == gpt.FFN and config["head_dim"] == gpt.HIDDEN // gpt.HEADS
    model, logits = hf_logits(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.config.mlp_bias and model.lm_head.weight is not model.model.embed_tokens.weight
    assert close(logits, truth) <= TOLERANCE


def test_a_megatron_save_moves_to_torchtitan_and_back_through_the_hf_naming(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """A user moving a Megatron-trained Llama into torchtitan (`--to torchtitan`) was refused
    with "Llama 3 has no mapping from the megatron naming to the torchtitan naming. Its
    namings: hf, torchtitan, megatron": two native namings now map through Hugging Face's, as
    `diff` compares them. The torchtitan save dcp.load reads holds what `--to hf` of it gives
    (transformers' logits are Megatron's), and back to Megatron it loads in Megatron."""
    folder, truth = megatron_save
    titan = tmp_path / "titan"
    result = run_ckpt("convert", folder, titan, "--to", "torchtitan", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    arch = result.json["result"]["architecture"]
    assert (arch["source_naming"], arch["target_naming"]) == ("megatron", "torchtitan")
    # q/k split from the fused QKV, then permuted to torchtitan's interleaved rotary rows
    assert arch["transforms"]["split-qkv+rotary-permute"] == 2 * gpt.LAYERS
    wq = next(r for r in arch["mapped"] if r["name"] == "layers.0.attention.qkv_linear.wq.weight")
    assert wq["sources"] == ["decoder.layers.self_attention.linear_qkv.weight"]
    # Megatron's common state and _extra_state objects are left out, for torchtitan's naming
    skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    assert skipped["args"] == "not a model weight (the torchtitan naming holds weights only)"
    # what the Megatron save told of the model travels as config.json, for a later --to hf
    assert (titan / "config.json").is_file()
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    names = FileSystemReader(str(titan)).read_metadata().state_dict_metadata
    state = {n: torch.empty(m.size, dtype=m.properties.dtype) for n, m in names.items()}
    dcp_load(state, checkpoint_id=str(titan), no_dist=True)
    assert state["tok_embeddings.weight"].shape == (gpt.VOCAB, gpt.HIDDEN)
    hf = tmp_path / "hf"
    assert run_ckpt("convert", titan, hf, "--to", "hf").exit_code == 0
    direct = tmp_path / "direct"
    assert run_ckpt("convert", folder, direct, "--to", "hf").exit_code == 0
    assert run_ckpt("diff", hf, direct).exit_code == 0
    assert close(hf_logits(hf)[1], truth) <= TOLERANCE
    r = run_ckpt("diff", folder, titan, "--json")
    assert r.exit_code == 0 and r.json["result"]["compared"] == 9 * gpt.LAYERS + 3
    back = tmp_path / "megatron"
    result = run_ckpt("convert", titan, back, "--to", "megatron", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.json["result"]["architecture"]["source_naming"] == "torchtitan"
    logits, step = megatron_load(back, tmp_path / "tp1")
    assert close(logits, truth) <= TOLERANCE and step["moved"]


def test_an_untied_output_layer_left_out_is_refused_not_tied_to_the_embedding(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """Megatron-LM's args say the model's output layer is its own
    (`untie_embeddings_and_output_weights`); `--filter-out 'output_layer.*'` left it out and
    the export wrote `tie_word_embeddings: true`, exit 0: transformers then computes the
    logits with the embedding, another model. It is refused, as a config.json saying untied
    is for weights without an output projection."""
    folder, _ = megatron_save
    out = tmp_path / "hf"
    r = run_ckpt("convert", folder, out, "--to", "hf", "--filter-out", "output_layer.*")
    assert r.exit_code == 4, r.stdout + r.stderr
    assert "untie_embeddings_and_output_weights" in r.stderr and "no output projection" in r.stderr
    assert "--filter-out" in r.stderr
    assert not out.exists()


def test_diff_compares_a_megatron_save_with_its_hf_export_through_the_mapping(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """A user proves an export: `ckpt diff megatron-save hf-export`. The names share nothing,
    so every tensor was one-sided. Now the Megatron side is read in HF names (fused QKV and
    gate/up split, the layer stack unstacked), so the export is IDENTICAL, the non-tensor
    entries are named as not compared, and one changed element of a K projection (a box of
    the fused QKV) is the one difference, under its HF name."""
    from safetensors.torch import load_file, save_file

    folder, _ = megatron_save
    out = tmp_path / "hf"
    assert run_ckpt("convert", folder, out, "--to", "hf").exit_code == 0
    result = run_ckpt("diff", folder, out, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["identical"] and not report["only_a"] and not report["only_b"]
    naming = report["naming"]
    assert (naming["naming_a"], naming["naming_b"], naming["compared_in"]) == (
        "megatron",
        "hf",
        "hf",
    )
    assert naming["transforms_a"]["split-qkv"] == 3 * gpt.LAYERS
    left_out = {item["name"] for item in naming["left_out_a"]}
    assert {"args", "iteration", "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"} <= left_out
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = load_file(out / "model.safetensors")
    tensors[name][0, 0] += 0.5
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    result = run_ckpt("diff", folder, out, "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert [d["name"] for d in result.json["result"]["differences"]] == [name]


@pytest.mark.parametrize(
    ("rope", "scaling"),
    [
        (
            "llama3",
            {
                "rope_type": "llama3",
                "factor": gpt.ROPE_FACTOR,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        ("linear", {"rope_type": "linear", "factor": float(gpt.INTERPOLATION)}),
    ],
)
def test_a_rope_scaled_megatron_model_exports_its_scaling(
    rope: str, scaling: dict[str, Any], tmp_path: Path
) -> None:
    """A GPTModel trained with Llama 3.x rope scaling (`--use-rope-scaling`) or interpolated
    positions (`--rotary-seq-len-interpolation-factor`) exported to a config.json with no
    scaling: transformers ran it unscaled, other logits, and nothing said so."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "save", str(save), str(free_port())],
        capture_output=True,
        text=True,
        env={**torchrun_env(), "MEGATRON_ROPE": rope},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    truth = torch.load(f"{save}.logits.pt", weights_only=True)
    out = tmp_path / "hf"
    result = run_ckpt("convert", save, out, "--to", "hf")
    assert result.exit_code == 0, result.stdout + result.stderr
    config = json.loads((out / "config.json").read_text())
    # transformers 5 reads `rope_parameters`; transformers 4 and llama.cpp the legacy key
    assert config["rope_parameters"] == {**scaling, "rope_theta": gpt.ROTARY_BASE}
    assert config["rope_scaling"] == scaling
    assert close(hf_logits(out)[1], truth) <= TOLERANCE
    # and back: the args ckpt writes in common.pt scale it as the GPTModel's own did
    back = tmp_path / "megatron"
    result = run_ckpt("convert", out, back, "--to", "megatron")
    assert result.exit_code == 0, result.stdout + result.stderr
    with torch.serialization.safe_globals([argparse.Namespace]):
        written = vars(torch.load(back / "common.pt", weights_only=True)["args"])
        saved = vars(torch.load(save / "common.pt", weights_only=True)["args"])
    keys = ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor")
    assert {k: written[k] for k in keys} == {k: saved[k] for k in keys}
    logits, _ = megatron_load(back, tmp_path / "loaded", rope=rope)
    assert close(logits, truth) <= TOLERANCE


def test_a_pipeline_parallel_save_exports_to_what_megatron_loads_from_it(tmp_path: Path) -> None:
    """Two pipeline stages, each saving its own layers (global numbers) and the embedding or
    the output layer: the export equals the model megatron's own load builds from the save."""
    save = tmp_path / "pp"
    run_torchrun(SCRIPT, 2, "save-pp", save, timeout=600)
    truth, _ = megatron_load(save, tmp_path / "loaded")
    out = tmp_path / "hf"
    result = run_ckpt("convert", save, out, "--to", "hf")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert close(hf_logits(out)[1], truth) <= TOLERANCE


def test_inspect_names_the_megatron_naming_and_dry_run_lists_every_rename_and_split(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, _ = megatron_save
    inspected = run_ckpt("inspect", folder, "--json")
    assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
    found = inspected.json["result"]["architecture"]
    assert (found["architecture"], found["naming"]) == ("llama3", "megatron")
    assert "in megatron names" in run_ckpt("inspect", folder).stdout
    out = tmp_path / "dry"
    result = run_ckpt("convert", folder, out, "--to", "hf", "--dry-run", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not out.exists()
    mapped = {m["name"]: m for m in result.json["result"]["architecture"]["mapped"]}
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert mapped["model.layers.1.self_attn.k_proj.weight"] == {
        "name": "model.layers.1.self_attn.k_proj.weight",
        "sources": [qkv],
        "transform": "split-qkv",
    }
    assert mapped["model.layers.0.mlp.up_proj.weight"]["transform"] == "split-gate-up"
    assert mapped["model.layers.0.input_layernorm.weight"]["sources"] == [
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    ]
    assert mapped["lm_head.weight"]["sources"] == ["output_layer.weight"]
    assert len(mapped) == 3 + 9 * gpt.LAYERS
    text = run_ckpt("convert", folder, out, "--to", "hf", "--dry-run")
    assert text.exit_code == 0 and "megatron" in text.stdout and "split-qkv" in text.stdout


def test_the_training_state_finds_the_weights_under_megatrons_own_names(
    megatron_save: tuple[Path, torch.Tensor],
) -> None:
    """The architecture line recognised the save, yet the training state said 'missing:
    weights' (it looked for a `model` key or torchtitan's keys only)."""
    folder, _ = megatron_save
    inspected = run_ckpt("inspect", folder, "--json")
    training = inspected.json["result"]["training"]
    assert training["weights"]["tensors"] == len(
        [e for e in inspected.json["result"]["entries"] if e["kind"] == "tensor"]
    )
    assert "weights" not in training["missing"]
    verified = run_ckpt("verify", folder, "--resumable", "--json")
    errors = [p["code"] for p in verified.json["result"]["problems"] if p["severity"] == "error"]
    assert errors == ["missing_optimizer"]  # the script saves the model alone


def test_import_to_megatron_loads_in_megatron_continues_training_and_matches_hf(
    hf_model: tuple[Path, torch.Tensor], megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    source, truth = hf_model
    out = tmp_path / "megatron"
    result = run_ckpt("convert", source, out, "--to", "megatron", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    arch = result.json["result"]["architecture"]
    assert (arch["source_naming"], arch["target_naming"]) == ("hf", "megatron")
    assert arch["transforms"]["fuse-qkv"] == 1 and arch["transforms"]["stack-layers"] == 4
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        # the HF folder's companions travel (an export back writes the same config.json)
        "config.json",
        "generation_config.json",
        "metadata.json",
    ]
    # the backend description is byte for byte what dist_checkpointing.save writes
    own, _ = megatron_save
    assert (out / "metadata.json").read_bytes() == (own / "metadata.json").read_bytes()
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(out / "common.pt", weights_only=True)
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0
    args = vars(common["args"])
    assert args["num_query_groups"] == gpt.GROUPS and args["group_query_attention"] is True
    assert args["swiglu"] and args["normalization"] == "RMSNorm" and args["kv_channels"] == 8
    # megatron's own load into a fresh GPTModel: the HF model's logits, and a training step
    logits, step = megatron_load(out, tmp_path / "tp1")
    assert close(logits, truth) <= TOLERANCE
    assert step["moved"] and torch.isfinite(torch.tensor(step["loss"]))
    # and into 2 tensor-parallel ranks (QKV and fc1 split per rank as Megatron shards them)
    logits, step = megatron_load(out, tmp_path / "tp2", ranks=2)
    assert close(logits, truth) <= TOLERANCE
    assert step["moved"]
    assert run_ckpt("verify", out, "--deep").exit_code == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_hf_megatron_hf_is_bit_identical(
    hf_model: tuple[Path, torch.Tensor], tmp_path: Path, dtype: str
) -> None:
    from safetensors import safe_open

    source, _ = hf_model
    if dtype != "float32":
        cast = tmp_path / "cast"
        assert (
            run_ckpt("convert", source, cast, "--to", "safetensors", "--dtype", "bf16").exit_code
            == 0
        )
        source = cast
    there, back = tmp_path / "megatron", tmp_path / "back"
    assert run_ckpt("convert", source, there, "--to", "megatron").exit_code == 0
    result = run_ckpt("convert", there, back, "--to", "hf")
    assert result.exit_code == 0, result.stdout + result.stderr

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        return out

    want, got = tensors(source), tensors(back)
    assert got.keys() == want.keys() and len(want) == 3 + 9 * gpt.LAYERS
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(got[name], tensor), name
    # the config travels with the weights (carried into the Megatron folder, written back)
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )


def _with_common(folder: Path, dest: Path, common: dict[str, Any]) -> Path:
    copy = shutil.copytree(folder, dest)
    torch.save(common, copy / "common.pt")
    return copy


def test_export_without_megatron_args_needs_config_and_uses_it(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, truth = megatron_save
    bare = _with_common(folder, tmp_path / "bare", {"iteration": 7, "checkpoint_version": 3.0})
    refused = run_ckpt("convert", bare, tmp_path / "no", "--to", "hf")
    assert refused.exit_code == 4
    assert "n_heads" in refused.stderr and "--config" in refused.stderr
    assert not (tmp_path / "no").exists()
    # the HF config of the same model, given with --config
    config = tmp_path / "config.json"
    first = tmp_path / "first"
    assert run_ckpt("convert", folder, first, "--to", "hf").exit_code == 0
    shutil.copy(first / "config.json", config)
    out = tmp_path / "hf"
    result = run_ckpt("convert", bare, out, "--to", "hf", "--config", config)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert close(hf_logits(out)[1], truth) <= TOLERANCE


def test_a_megatron_model_that_is_not_llama_style_is_refused(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    folder, _ = megatron_save
    args = vars(gpt.megatron_args()) | {"normalization": "LayerNorm", "add_bias_linear": True}
    odd = _with_common(folder, tmp_path / "odd", {"args": argparse.Namespace(**args)})
    result = run_ckpt("convert", odd, tmp_path / "out", "--to", "hf")
    assert result.exit_code == 4
    assert "not Llama-style" in result.stderr and "normalization='LayerNorm'" in result.stderr
    assert not (tmp_path / "out").exists()
    # two rope scalings at once (Llama 3.x's and interpolated positions): no HF config holds both
    args = vars(gpt.megatron_args()) | {
        "use_rope_scaling": True,
        "rotary_seq_len_interpolation_factor": 4,
    }
    twice = _with_common(folder, tmp_path / "twice", {"args": argparse.Namespace(**args)})
    result = run_ckpt("convert", twice, tmp_path / "out", "--to", "hf")
    assert result.exit_code == 4
    assert "scales its rotary embeddings twice" in " ".join(result.stderr.split())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": "abc"}, "hidden_size='abc'"),
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"kv_channels": [8]}, "kv_channels=[8]"),
        ({"rotary_percent": "half"}, "could not convert string to float: 'half'"),
    ],
    ids=["str-width", "zero-heads", "list", "rotary-percent"],
)
def test_megatron_args_no_model_has_are_refused_naming_them(
    hf_model: tuple[Path, torch.Tensor], tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    """A Megatron save whose common.pt holds args no model has (a width that is a string,
    zero heads) was an internal error on export (exit 70: pydantic's or float's traceback);
    it is refused (exit 4) naming common.pt and the arg, and nothing is written."""
    source, _ = hf_model
    there = tmp_path / "megatron"
    assert run_ckpt("convert", source, there, "--to", "megatron").exit_code == 0
    (there / "config.json").unlink()  # the args are all the export reads
    common = torch.load(there / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(**(vars(common["args"]) | change))
    torch.save(common, there / "common.pt")
    result = run_ckpt("convert", there, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 4, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "common.pt" in message and "in Megatron's args," in message, message
    assert named in message and "a value no model has" in message, message
    assert not (tmp_path / "hf").exists()


def test_an_hf_rope_scaling_megatron_cannot_apply_is_refused_on_import(
    hf_model: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """A yarn-scaled Llama imported to Megatron: Megatron-Core applies only Llama 3.x's
    scaling or linear interpolation, so common.pt's args would run it unscaled."""
    folder, _ = hf_model
    yarn = tmp_path / "yarn"
    shutil.copytree(folder, yarn)
    config = json.loads((yarn / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": gpt.ROTARY_BASE}
    (yarn / "config.json").write_text(json.dumps(config))
    result = run_ckpt("convert", yarn, tmp_path / "megatron", "--to", "megatron")
    assert result.exit_code == 4, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "rope scaling" in said and "'yarn'" in said and "Megatron would run it unscaled" in said
    assert not (tmp_path / "megatron").exists()


def test_per_layer_megatron_names_export_the_same_tensors(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """Megatron-Core saves with `non_homogeneous_layers` keep one tensor per layer
    (`decoder.layers.<i>.<suffix>`), and a plain `state_dict()` of the local spec names the
    pre-norms `input_layernorm` / `pre_mlp_layernorm`: both export as the stacked save does."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, _ = megatron_save
    stacked = tmp_path / "stacked.safetensors"
    assert run_ckpt("convert", folder, stacked, "--to", "safetensors").exit_code == 0
    aliases = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
    per_layer: dict[str, torch.Tensor] = {}
    with safe_open(stacked, "pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            if not name.startswith("decoder.layers."):
                per_layer[name] = tensor
                continue
            suffix = name.removeprefix("decoder.layers.")
            for layer in range(tensor.shape[0]):
                key = f"decoder.layers.{layer}.{aliases.get(suffix, suffix)}"
                per_layer[key] = tensor[layer].clone()
    source = tmp_path / "per-layer.safetensors"
    save_file(per_layer, source)
    reference = tmp_path / "reference"
    assert run_ckpt("convert", folder, reference, "--to", "hf").exit_code == 0
    out = tmp_path / "hf"
    result = run_ckpt(
        "convert", source, out, "--to", "hf", "--config", reference / "config.json", "--json"
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.json["result"]["architecture"]["source_naming"] == "megatron"
    with (
        safe_open(reference / "model.safetensors", "pt") as want,
        safe_open(out / "model.safetensors", "pt") as got,
    ):
        assert sorted(got.keys()) == sorted(want.keys())
        for name in want.keys():  # noqa: SIM118
            assert torch.equal(got.get_tensor(name), want.get_tensor(name)), name


def test_a_save_with_optimizer_state_exports_the_model_alone(
    megatron_save: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    """Megatron-LM saves the optimizer's state beside the model (`optimizer.state.*`): the
    export leaves it out by itself, each tensor listed as skipped with the reason, as a
    torchtitan export leaves its training state; `--filter-out 'optimizer.*'` still works."""
    import torch.distributed.checkpoint as dcp

    folder, truth = megatron_save
    flat = tmp_path / "flat.safetensors"
    assert run_ckpt("convert", folder, flat, "--to", "safetensors").exit_code == 0
    from safetensors.torch import load_file

    state = load_file(flat)
    state["optimizer.state.exp_avg.output_layer.weight"] = torch.zeros_like(
        state["output_layer.weight"]
    )
    save = tmp_path / "with-optimizer"
    dcp.save(state, checkpoint_id=save, no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(folder / name, save / name)
    plain = run_ckpt("convert", save, tmp_path / "plain", "--to", "hf", "--json")
    assert plain.exit_code == 0, plain.stdout + plain.stderr
    result_doc = json.loads(plain.stdout)["result"]
    reasons = {s["name"]: s["reason"] for s in result_doc["skipped"]}
    assert reasons["optimizer.state.exp_avg.output_layer.weight"] == (
        "optimizer state (training only)"
    )
    assert not any(e["source"].startswith("optimizer.") for e in result_doc["entries"])
    assert close(hf_logits(tmp_path / "plain")[1], truth) <= TOLERANCE
    out = tmp_path / "hf"
    result = run_ckpt("convert", save, out, "--to", "hf", "--filter-out", "optimizer.*")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert close(hf_logits(out)[1], truth) <= TOLERANCE


def test_a_save_trained_with_llama3_rope_scaling_exports_it_into_config_json(
    tmp_path: Path,
) -> None:
    """A Megatron-LM run trained with `--use-rope-scaling --rope-scaling-factor 8` (Llama
    3.x's rotary frequencies) records it in its args: the export's config.json says it
    (`rope_type: llama3` with Megatron-Core's fixed low/high factors and original context),
    so `from_pretrained` gives Megatron's logits. It used to write `rope_type: default`, and
    the served model's logits were off by 2e-3."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "save", str(save), str(free_port())],
        capture_output=True,
        text=True,
        env=torchrun_env({"MEGATRON_ROPE_SCALING": "8"}),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    truth = torch.load(f"{save}.logits.pt", weights_only=True)
    out = tmp_path / "hf"
    result = run_ckpt("convert", save, out, "--to", "hf")
    assert result.exit_code == 0, result.stdout + result.stderr
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {
        "rope_type": "llama3",
        "rope_theta": gpt.ROTARY_BASE,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert close(hf_logits(out)[1], truth) <= TOLERANCE


def _scaled_llama(folder: Path, rope: dict[str, Any]) -> torch.Tensor:
    """A LlamaForCausalLM of the GPTModel's dimensions with rope `rope`, saved; its logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=gpt.HIDDEN, intermediate_size=gpt.FFN, num_hidden_layers=gpt.LAYERS,
        num_attention_heads=gpt.HEADS, num_key_value_heads=gpt.GROUPS, vocab_size=gpt.VOCAB,
        max_position_embeddings=gpt.MAX_POS, rms_norm_eps=gpt.EPS, tie_word_embeddings=False,
        rope_parameters={"rope_theta": gpt.ROTARY_BASE, **rope},
    )  # fmt: skip
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return hf_logits(folder)[1]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_an_import_keeps_llama3_rope_scaling_in_megatrons_args(tmp_path: Path) -> None:
    """A Llama 3.2 (rope scaling factor 32) imported to Megatron records
    `use_rope_scaling` / `rope_scaling_factor` in common.pt's args (what Megatron-LM's
    `--use-checkpoint-args` reads), and the export of that save alone, without the carried
    config.json, is the same model again. It used to lose the scaling both ways."""
    truth = _scaled_llama(tmp_path / "hf", LLAMA3_ROPE)
    there = tmp_path / "megatron"
    result = run_ckpt("convert", tmp_path / "hf", there, "--to", "megatron")
    assert result.exit_code == 0, result.stdout + result.stderr
    args = torch.load(there / "common.pt", weights_only=False)["args"]
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 32.0
    (there / "config.json").unlink()
    back = tmp_path / "back"
    result = run_ckpt("convert", there, back, "--to", "hf")
    assert result.exit_code == 0, result.stdout + result.stderr
    rope = json.loads((back / "config.json").read_text())["rope_parameters"]
    assert rope == {**LLAMA3_ROPE, "rope_theta": gpt.ROTARY_BASE}
    assert close(hf_logits(back)[1], truth) <= TOLERANCE


@pytest.mark.parametrize(
    "rope",
    [
        {**LLAMA3_ROPE, "original_max_position_embeddings": 4096},
        {**LLAMA3_ROPE, "high_freq_factor": 2.0},
    ],
    ids=["llama3-other-context", "llama3-other-high-factor"],
)
def test_an_import_refuses_rope_scaling_megatron_cannot_apply(
    tmp_path: Path, rope: dict[str, Any]
) -> None:
    """Megatron-Core's rotary applies Llama 3's scaling with fixed low/high factors and an
    8192 original context (or a linear interpolation of positions): a Llama scaled otherwise
    would train as another model there. The import is refused (exit 4) naming the scaling,
    and writes nothing."""
    _scaled_llama(tmp_path / "hf", rope)
    result = run_ckpt("convert", tmp_path / "hf", tmp_path / "megatron", "--to", "megatron")
    assert result.exit_code == 4, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "rope scaling" in message and rope["rope_type"] in message, message
    assert not (tmp_path / "megatron").exists()


# ----------------------------------------------------------------- Qwen2 and Qwen3 in Megatron

#: the q/k/v biases and q/k norms add sums in another order (measured 6.6e-7 and 1.0e-6 on
#: one-rank saves)
FAMILY_TOLERANCE = 4e-6
FAMILY_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family_save(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, torch.Tensor]:
    """A 2-rank torch_dist save of the tiny GPTModel built as Megatron-Bridge builds a Qwen2
    (`--add-qkv-bias`) or a Qwen3 (`--qk-layernorm`), and its logits."""
    family = request.param
    root = tmp_path_factory.mktemp(f"megatron-{family}")
    run_torchrun(SCRIPT, 2, "save", root / "ckpt", timeout=600, env={"MEGATRON_FAMILY": family})
    return family, root / "ckpt", torch.load(root / "ckpt.logits.pt", weights_only=True)


def test_a_megatron_qwen_exports_to_its_transformers_model_and_imports_back(
    family_save: tuple[str, Path, torch.Tensor], tmp_path: Path
) -> None:
    """The fused QKV's biases split per query group as its weight is (Qwen2), the q/k norms
    unstacked per layer (Qwen3): `from_pretrained` gives Megatron's logits, and the import of
    that folder loads in Megatron (on 1 and 2 tensor-parallel ranks) with the saved model's
    logits (exactly on the 2 ranks it was saved from), its `args` saying what Megatron must
    build."""
    family, folder, truth = family_save
    r = run_ckpt("inspect", folder, "--json")
    assert r.exit_code == 0, r.stderr
    arch = r.json["result"]["architecture"]
    assert (arch["architecture"], arch["naming"]) == (family, "megatron")
    hf = tmp_path / "hf"
    r = run_ckpt("convert", folder, hf, "--to", "hf", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    transforms = r.json["result"]["architecture"]["transforms"]
    # per layer: q/k/v of the weight, and of the bias for Qwen2; the two norms for Qwen3
    assert transforms["split-qkv"] == gpt.LAYERS * (6 if family == "qwen2" else 3)
    model, logits = hf_logits(hf)
    assert type(model).__name__ == FAMILY_CLASSES[family]
    assert close(logits, truth) <= FAMILY_TOLERANCE
    back = tmp_path / "megatron"
    r = run_ckpt("convert", hf, back, "--to", "megatron")
    assert r.exit_code == 0, r.stdout + r.stderr
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(back / "common.pt", weights_only=True)["args"])
    assert args["add_qkv_bias"] is (family == "qwen2")
    assert args["qk_layernorm"] is (family == "qwen3")
    for ranks in (1, 2):
        loaded, step = megatron_load(back, tmp_path / f"tp{ranks}", ranks=ranks, family=family)
        if ranks == 2:  # sharded as the save was: the same sums, the same logits
            assert torch.equal(loaded, truth)
        else:
            assert close(loaded, truth) <= FAMILY_TOLERANCE
        assert step["moved"] and torch.isfinite(torch.tensor(step["loss"]))
    r = run_ckpt("diff", folder, hf, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.json["result"]["identical"] and not r.json["result"]["only_b"]


def test_a_megatron_save_whose_args_deny_its_tensors_is_refused_naming_them(
    family_save: tuple[str, Path, torch.Tensor], tmp_path: Path
) -> None:
    """Names say Qwen2 (q/k/v biases) or Qwen3 (q/k norms), the saved args say otherwise:
    which model Megatron trained is unclear, and the export is refused naming the args."""
    family, folder, _ = family_save
    flag = "add_qkv_bias" if family == "qwen2" else "qk_layernorm"
    args = vars(gpt.megatron_args()) | {"add_qkv_bias": False, "qk_layernorm": False}
    common = {"iteration": 7, "checkpoint_version": 3.0, "args": argparse.Namespace(**args)}
    odd = _with_common(folder, tmp_path / "odd", common)
    r = run_ckpt("convert", odd, tmp_path / "out", "--to", "hf")
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    title = family.capitalize()
    assert f"not {title}-style ({flag}=False)" in said
    assert not (tmp_path / "out").exists()
