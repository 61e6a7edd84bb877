"""Flux from torchtitan to diffusers and back: `convert --to hf` / `--to torchtitan`.

tests/torchtitan_flux_script.py builds a tiny torchtitan 0.3.0 Flux transformer (two
double-stream and two single-stream blocks) on CPU, trains it three AdamW steps and saves
`step-1/` with torchtitan's own `CheckpointManager.save`, with its forward on fixed inputs and
torchtitan's own `FluxStateDictAdapter.to_hf`. The export must load in diffusers'
`FluxTransformer2DModel.from_pretrained` and give torchtitan's output; its import back must
load with `CheckpointManager.load`, every tensor as saved, and train a step.
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

SCRIPT = Path(__file__).with_name("torchtitan_flux_script.py")

needs_flux = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("diffusers") is None,
    reason="torchtitan and diffusers are not installed (pip install '.[frameworks]')",
)

# --------------------------------------------------------------------------- no frameworks

H, HEAD, IN, CTX, VEC = 32, 16, 8, 12, 10


def _flux_hf(
    folder: Path, *, guidance: bool = False, h: int = H, hd: int = HEAD
) -> dict[str, torch.Tensor]:
    """A tiny diffusers-named Flux transformer (random tensors: 2 double-stream and 2
    single-stream blocks, hidden `h` in heads `hd` wide) with its diffusers config.json."""
    linears: dict[str, tuple[int, int]] = {
        "x_embedder": (h, IN),
        "context_embedder": (h, CTX),
        "time_text_embed.timestep_embedder.linear_1": (h, 256),
        "time_text_embed.timestep_embedder.linear_2": (h, h),
        "time_text_embed.text_embedder.linear_1": (h, VEC),
        "time_text_embed.text_embedder.linear_2": (h, h),
        "norm_out.linear": (2 * h, h),
        "proj_out": (IN, h),
    }
    if guidance:
        linears["time_text_embed.guidance_embedder.linear_1"] = (h, 256)
        linears["time_text_embed.guidance_embedder.linear_2"] = (h, h)
    norms: list[str] = []
    for i in range(2):
        d = f"transformer_blocks.{i}."
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            linears[f"{d}attn.{name}"] = (h, h)
        linears |= {
            d + "attn.to_out.0": (h, h),
            d + "attn.to_add_out": (h, h),
            d + "ff.net.0.proj": (4 * h, h),
            d + "ff.net.2": (h, 4 * h),
            d + "ff_context.net.0.proj": (4 * h, h),
            d + "ff_context.net.2": (h, 4 * h),
            d + "norm1.linear": (6 * h, h),
            d + "norm1_context.linear": (6 * h, h),
        }
        norms += [
            d + f"attn.{n}.weight" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
        ]
        s = f"single_transformer_blocks.{i}."
        linears |= {
            s + "attn.to_q": (h, h),
            s + "attn.to_k": (h, h),
            s + "attn.to_v": (h, h),
            s + "proj_mlp": (4 * h, h),
            s + "proj_out": (h, 5 * h),
            s + "norm.linear": (3 * h, h),
        }
        norms += [s + "attn.norm_q.weight", s + "attn.norm_k.weight"]
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in linears.items():
        tensors[f"{name}.weight"] = torch.randn(*shape, generator=gen)
        tensors[f"{name}.bias"] = torch.randn(shape[0], generator=gen)
    for name in norms:
        tensors[name] = torch.randn(hd, generator=gen)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    config = {
        "_class_name": "FluxTransformer2DModel",
        "_diffusers_version": "0.42.1",
        "attention_head_dim": hd,
        "axes_dims_rope": [4, 6, 6] if hd == HEAD else [16, 56, 56],
        "guidance_embeds": guidance,
        "in_channels": IN,
        "joint_attention_dim": CTX,
        "num_attention_heads": h // hd,
        "num_layers": 2,
        "num_single_layers": 2,
        "out_channels": None,
        "patch_size": 1,
        "pooled_projection_dim": VEC,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def test_a_diffusers_flux_fuses_into_torchtitan_names_and_splits_back(tmp_path: Path) -> None:
    """diffusers' separate q/k/v (and a single-stream block's MLP input) are torchtitan's fused
    `qkv` / `linear1` rows; the final modulation's halves trade places (diffusers' scale |
    shift against BFL's shift | scale). The way back splits them bit for bit, into the files
    diffusers loads."""
    tensors = _flux_hf(tmp_path / "hf")
    r = run_ckpt("inspect", tmp_path / "hf", "--json")
    assert r.exit_code == 0, r.stderr
    arch = json.loads(r.stdout)["result"]["architecture"]
    assert (arch["architecture"], arch["naming"]) == ("flux", "hf")
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--json")
    assert r.exit_code == 0, r.stderr
    transforms = json.loads(r.stdout)["result"]["architecture"]["transforms"]
    assert transforms == {"rename": 66, "fuse-rows": 12, "swap-halves": 2}
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    names = {
        "double_blocks.0.img_attn.qkv.weight": (3 * H, H),
        "double_blocks.1.txt_attn.qkv.bias": (3 * H,),
        "single_blocks.1.linear1.weight": (7 * H, H),
        "single_blocks.0.norm.key_norm.weight": (HEAD,),
        "final_layer.adaLN_modulation.1.weight": (2 * H, H),
        "final_layer.adaLN_modulation.1.bias": (2 * H,),
    }
    state = {name: torch.empty(shape) for name, shape in names.items()}
    dcp_load(state, storage_reader=FileSystemReader(str(tmp_path / "tt")), no_dist=True)
    d0, d1, s1 = (
        "transformer_blocks.0.attn.",
        "transformer_blocks.1.attn.",
        "single_transformer_blocks.1.",
    )
    want = torch.cat([tensors[d0 + p + ".weight"] for p in ("to_q", "to_k", "to_v")])
    assert torch.equal(state["double_blocks.0.img_attn.qkv.weight"], want)
    want = torch.cat(
        [tensors[d1 + p + ".bias"] for p in ("add_q_proj", "add_k_proj", "add_v_proj")]
    )
    assert torch.equal(state["double_blocks.1.txt_attn.qkv.bias"], want)
    parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    want = torch.cat([tensors[s1 + p + ".weight"] for p in parts])
    assert torch.equal(state["single_blocks.1.linear1.weight"], want)
    key_norm = tensors["single_transformer_blocks.0.attn.norm_k.weight"]
    assert torch.equal(state["single_blocks.0.norm.key_norm.weight"], key_norm)
    for p in ("weight", "bias"):
        scale, shift = tensors[f"norm_out.linear.{p}"].chunk(2)
        assert torch.equal(state[f"final_layer.adaLN_modulation.1.{p}"], torch.cat([shift, scale]))
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    back = load_file(tmp_path / "back" / "diffusion_pytorch_model.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel"
    assert config["axes_dims_rope"] == [4, 6, 6]


def test_a_flux_without_what_diffusers_or_torchtitan_need_is_refused(tmp_path: Path) -> None:
    """FLUX.1-dev's guidance embedder has no torchtitan counterpart (named, never dropped
    quietly); a block short of a projection cannot be fused; a torchtitan save whose rotary
    axes nothing says, or a config.json whose axes do not fit the heads, gets no config.json
    that would build another model."""
    _flux_hf(tmp_path / "dev", guidance=True)
    r = run_ckpt("convert", tmp_path / "dev", tmp_path / "out", "--to", "torchtitan")
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "Flux's guidance embedder" in said
    assert "--filter-out 'time_text_embed.guidance_embedder.*'" in said
    assert not (tmp_path / "out").exists()

    _flux_hf(tmp_path / "hf")
    r = run_ckpt(
        "convert", tmp_path / "hf", tmp_path / "out", "--to", "torchtitan",
        "--filter-out", "single_transformer_blocks.1.attn.to_v.*",
    )  # fmt: skip
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "block 1 of the Flux model's single_transformer_blocks lacks" in said
    assert "'single_transformer_blocks.1.attn.to_v.weight'" in said
    assert not (tmp_path / "out").exists()

    # a torchtitan save holds no config.json
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--no-extras")
    assert r.exit_code == 0, r.stderr
    assert not (tmp_path / "tt" / "config.json").exists()
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "out", "--to", "hf")
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "axes_dims_rope" in said and "--config" in said and "--flavor" in said
    assert not (tmp_path / "out").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["axes_dims_rope"] = [16, 56, 56]
    (tmp_path / "other.json").write_text(json.dumps(config))
    r = run_ckpt(
        "convert",
        tmp_path / "tt",
        tmp_path / "out",
        "--to",
        "hf",
        "--config",
        tmp_path / "other.json",
    )
    assert r.exit_code == 4
    said = " ".join(r.stderr.split())
    assert "does not fit the weights: axes_dims_rope=[16, 56, 56]" in said
    assert not (tmp_path / "out").exists()


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


@pytest.fixture(scope="module")
def titan_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torchtitan Flux run (`run/checkpoint/step-1`) and its references (`ref/`)."""
    root = tmp_path_factory.mktemp("flux")
    _script("save", root / "run", root / "ref")
    return root


def _diffusers_output(folder: Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    from diffusers import FluxTransformer2DModel

    model, info = FluxTransformer2DModel.from_pretrained(folder, output_loading_info=True)
    # every weight diffusers builds is one the export holds, and no tensor is left over
    assert not any(info.values()), info
    with torch.no_grad():
        out: torch.Tensor = model.eval()(
            hidden_states=inputs["img"],
            encoder_hidden_states=inputs["txt"],
            pooled_projections=inputs["y"],
            timestep=inputs["timesteps"],
            img_ids=inputs["img_ids"],
            txt_ids=inputs["txt_ids"],
        ).sample
    return out


#: torchtitan's Flux builds its q/k RMSNorms with eps 1e-5, diffusers' with 1e-6 (measured
#: 2.5e-7 apart on outputs of about 0.26)
TOLERANCE = 1e-5


@needs_flux
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_torchtitan_flux_exports_to_a_model_diffusers_loads_with_its_output(
    titan_flux: Path, tmp_path: Path
) -> None:
    root = titan_flux
    step = root / "run" / "checkpoint" / "step-1"
    r = run_ckpt("inspect", step, "--json")
    assert r.exit_code == 0, r.stderr
    arch = json.loads(r.stdout)["result"]["architecture"]
    assert (arch["architecture"], arch["naming"]) == ("flux", "torchtitan")
    dest = tmp_path / "hf"
    r = run_ckpt(
        "convert", step, dest, "--to", "hf", "--config", root / "ref" / "config.json",
        "--max-shard-size", "200KB", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["architecture"]["architecture"] == "flux"
    # the model's weights only: the optimizer and the rest of the training state stay
    left = " ".join(json.dumps(doc.get(k)) for k in ("skipped", "skipped_files"))
    assert "optimizer" in left and "lr_scheduler" in left
    files = sorted(p.name for p in dest.iterdir())
    assert files[0] == "config.json" and len(files) > 3
    assert files[-1] == "diffusion_pytorch_model.safetensors.index.json"
    assert all(f.startswith("diffusion_pytorch_model-0000") for f in files[1:-1])
    # torchtitan's own to_hf, tensor for tensor, dtype and bytes
    want = load_file(root / "ref" / "to_hf.safetensors")
    got: dict[str, torch.Tensor] = {}
    for shard in files[1:-1]:
        got.update(load_file(dest / shard))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    inputs = torch.load(root / "ref" / "inputs.pt", weights_only=True)
    reference = torch.load(root / "ref" / "output.pt", weights_only=True)
    out = _diffusers_output(dest, inputs)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference, rtol=0, atol=TOLERANCE)
    # the export holds what torchtitan saved
    r = run_ckpt("diff", step, dest, "--select", "model", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["result"]
    assert doc["identical"] and doc["compared"] == len(want)
    # the config.json --flavor builds from torchtitan's model config: the same model
    flavored = tmp_path / "flavored"
    r = run_ckpt(
        "convert", step, flavored, "--to", "hf", "--config", root / "ref" / "flavor_config.json"
    )
    assert r.exit_code == 0, r.stderr
    assert torch.allclose(_diffusers_output(flavored, inputs), reference, rtol=0, atol=TOLERANCE)


@needs_flux
@pytest.mark.frameworks
@pytest.mark.slow
def test_a_flux_export_imports_back_into_torchtitan_bit_exact(
    titan_flux: Path, tmp_path: Path
) -> None:
    """diffusers -> torchtitan: CheckpointManager.load (step-0, model only) restores every
    tensor as torchtitan saved it, gives its output, and one training step runs after it."""
    root = titan_flux
    step = root / "run" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    r = run_ckpt("convert", step, hf, "--to", "hf", "--config", root / "ref" / "config.json")
    assert r.exit_code == 0, r.stderr
    r = run_ckpt("convert", hf, tmp_path / "tt", "--to", "torchtitan")
    assert r.exit_code == 0, r.stderr
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "tt", run / "checkpoint" / "step-0")
    _script("load", run, tmp_path / "out")
    saved: dict[str, Any] = torch.load(root / "ref" / "state.pt", weights_only=True)
    loaded: dict[str, Any] = torch.load(tmp_path / "out" / "loaded_state.pt", weights_only=True)
    assert loaded.keys() == saved.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
    reference = torch.load(root / "ref" / "output.pt", weights_only=True)
    assert torch.equal(torch.load(tmp_path / "out" / "loaded_output.pt"), reference)
    trained = torch.load(tmp_path / "out" / "trained.pt", weights_only=True)
    assert trained["restored"] and trained["moved"]
    assert torch.isfinite(torch.tensor(trained["loss"]))


def test_a_torchtitan_flux_with_128_wide_heads_exports_without_a_config(tmp_path: Path) -> None:
    """The shapes tell every size of a Flux but its rotary axes' widths: for 128-wide heads
    (every torchtitan flavor's and BFL's) they are 16, 56, 56, so a save without a config.json
    exports with the config diffusers builds the same model from."""
    _flux_hf(tmp_path / "hf", h=128, hd=128)
    r = run_ckpt("convert", tmp_path / "hf", tmp_path / "tt", "--to", "torchtitan", "--no-extras")
    assert r.exit_code == 0, r.stderr
    r = run_ckpt("convert", tmp_path / "tt", tmp_path / "back", "--to", "hf")
    assert r.exit_code == 0, r.stderr
    built = json.loads((tmp_path / "back" / "config.json").read_text())
    given = json.loads((tmp_path / "hf" / "config.json").read_text())
    del built["_diffusers_version"], given["_diffusers_version"]
    assert built == given
