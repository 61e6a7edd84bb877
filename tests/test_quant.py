"""Quantized checkpoints: FP8 block, MXFP4, NVFP4 (ModelOpt and compressed-tensors), mixed,
scaled FP8 diffusion weights: inspect, verify, dequantizing convert and diff.

Fixtures are real tensors written by `safetensors.torch.save_file` (or compressed-tensors' own
compressor), quantized here from the published schemes, with the config files those projects
write. Dequantized values are judged by torch's `QuantizedHuggingFaceStorageReader` (FP8,
MXFP4), compressed-tensors' own decompressor, and the published NVFP4 formula.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .conftest import run_ckpt

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
FP8_MAX = 448.0


# ---------------------------------------------------------------- quantizers (published schemes)


def to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (sign in bit 3) of every value of `x` (already divided by its scale)."""
    mag = x.abs().clamp(max=6.0)
    index = (mag.unsqueeze(-1) - E2M1).abs().argmin(dim=-1)
    return (index | ((x < 0).to(torch.long) << 3)).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte, the first in the low nibble (gpt-oss, ModelOpt, compressed-tensors)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def quantize_fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block FP8: per block, scale_inv = amax / 448, weight = w / scale_inv."""
    rows, cols = w.shape
    grid = [math.ceil(rows / block), math.ceil(cols / block)]
    scale_inv = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            s = part.abs().max().clamp(min=1e-12) / FP8_MAX
            scale_inv[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (part / s).to(
                torch.float8_e4m3fn
            )
    return q, scale_inv


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 in gpt-oss's layout: `[..., in]` -> blocks `[..., in/32, 16]`, U8 scales `[..., in/32]`."""
    *prefix, cols = w.shape
    groups = w.float().reshape(*prefix, cols // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.floor(torch.log2(amax)) - 2  # E2M1's largest value is 1.5 * 2^2
    codes = to_e2m1_codes(groups / torch.exp2(exponent).unsqueeze(-1))
    return pack_nibbles(codes), (exponent + 127).to(torch.uint8)


def quantize_nvfp4_modelopt(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4: weight_scale_2 = amax / (6 * 448), FP8 scale per 16, E2M1 values."""
    rows, cols = w.shape
    scale_2 = w.float().abs().max() / (6.0 * FP8_MAX)
    groups = w.float().reshape(rows, cols // 16, 16)
    scale = (groups.abs().amax(dim=-1) / 6.0 / scale_2).to(torch.float8_e4m3fn)
    per = (scale.float() * scale_2).clamp(min=1e-12).unsqueeze(-1)
    codes = to_e2m1_codes(groups / per).reshape(rows, cols)
    return {
        "weight": pack_nibbles(codes),
        "weight_scale": scale,
        "weight_scale_2": scale_2.reshape(()),
        "input_scale": torch.tensor(0.02),
    }


def nvfp4_reference(
    packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
) -> torch.Tensor:
    """The published NVFP4 formula: E2M1 value x FP8 group scale x global scale (float32)."""
    values = torch.stack(
        [FP4_VALUES[(packed & 0x0F).long()], FP4_VALUES[(packed >> 4).long()]], dim=-1
    )
    values = values.reshape(packed.shape[0], -1)
    # groups of 16 columns, the last one partial when the input size is not a multiple of 16
    per = (scale.float() * scale_2.float()).repeat_interleave(16, dim=1)[:, : values.shape[1]]
    return values * per


def hf_shards(folder: Path, shards: list[dict[str, torch.Tensor]], config: dict | None) -> None:
    """Shards + `model.safetensors.index.json` as transformers writes them, and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def torch_reader_load(
    folder: Path, shapes: dict[str, list[int]], block: int
) -> dict[str, torch.Tensor]:
    """What torch's own QuantizedHuggingFaceStorageReader dequantizes (bf16)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    state = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    reader = QuantizedHuggingFaceStorageReader(
        str(folder), target_dtype=torch.bfloat16, block_size=block
    )
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def torch_mxfp4(folder: Path, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's own MXFP4 dequantization (QuantizedHuggingFaceStorageReader), whole tensor.

    Called on the reader's dequantization step directly: in torch 2.13 a `dcp.load` through
    this reader plans MXFP4 reads from the stored chunk sizes (`[..., G, 1]` of the 4-D blocks),
    so it fills only the first value of every group (checked below).
    """
    from types import SimpleNamespace

    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    reader = QuantizedHuggingFaceStorageReader(str(folder), target_dtype=torch.bfloat16)
    *prefix, groups, width = blocks.shape
    request = SimpleNamespace(
        storage_offsets=[0] * (len(prefix) + 1), lengths=[*prefix, groups * width * 2]
    )
    return reader._dequantize_tensor_mxfp4(blocks, scales, request, 0, 0)


def _problems(result: dict) -> list[tuple[str, str | None]]:
    return [(p["code"], p["tensor"]) for p in result["problems"]]


# ---------------------------------------------------------------- FP8 block (DeepSeek-V3)

BLOCK = 16  # weight_block_size [16, 16]: real multi-block grids at test size
FP8_LINEARS = {
    "model.layers.0.self_attn.q_proj": (40, 48),  # partial blocks: grid [3, 3]
    "model.layers.0.mlp.down_proj": (48, 32),
    "model.layers.1.self_attn.q_proj": (40, 48),
    "model.layers.1.mlp.down_proj": (48, 32),
}


def fp8_source() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    full = {
        f"{m}.weight": torch.randn(*s, generator=gen).to(torch.bfloat16)
        for m, s in FP8_LINEARS.items()
    }
    full["model.embed_tokens.weight"] = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    full["model.layers.0.input_layernorm.weight"] = torch.ones(48, dtype=torch.bfloat16)
    full["model.layers.1.input_layernorm.weight"] = torch.ones(48, dtype=torch.bfloat16)
    full["lm_head.weight"] = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    return full


def write_fp8_block(folder: Path, full: dict[str, torch.Tensor]) -> None:
    quantized: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        module = name.removesuffix(".weight")
        if module in FP8_LINEARS:
            q, s = quantize_fp8_block(t, BLOCK)
            quantized[name], quantized[f"{module}.weight_scale_inv"] = q, s
        else:
            quantized[name] = t
    names = list(quantized)
    # two shards, a weight and its scale in the same shard (as DeepSeek's are)
    first = {n: quantized[n] for n in names if ".layers.1." not in n}
    second = {n: quantized[n] for n in names if ".layers.1." in n}
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }
    hf_shards(folder, [first, second], config)


def test_fp8_block_is_inspected_verified_dequantized_like_torch_and_diffed(tmp_path: Path) -> None:
    full = fp8_source()
    src = tmp_path / "fp8"
    write_fp8_block(src, full)

    shown = run_ckpt("inspect", src, "--json")
    assert shown.exit_code == 0, shown.stderr
    quant = shown.json["result"]["quantization"]
    (group,) = quant["schemes"]
    assert group["scheme"] == "fp8-block" and group["label"] == "FP8 block 16x16"
    assert group["modules"] == 4
    assert set(group["patterns"]) == {
        "model.layers.*.self_attn.q_proj",
        "model.layers.*.mlp.down_proj",
    }
    assert group["example"]["name"] == "model.layers.0.mlp.down_proj.weight"
    assert group["example"]["scales"] == {"scale": [3, 2]}  # [48, 32] in 16x16 blocks
    assert quant["parameters"] == sum(t.numel() for t in full.values())
    assert set(quant["unquantized"]) == {
        "model.embed_tokens",
        "model.layers.*.input_layernorm",
        "lm_head",
    }
    human = run_ckpt("inspect", src)
    assert "FP8 block 16x16" in human.stdout and "unquantized" in human.stdout

    ok = run_ckpt("verify", src, "--deep", "--json")
    assert ok.exit_code == 0, ok.stdout
    assert "quantization" in ok.json["result"]["checks"]

    out = tmp_path / "bf16"
    conv = run_ckpt(
        "convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "bf16", "--json"
    )
    assert conv.exit_code == 0, conv.stdout
    assert conv.json["result"]["dequantized"] == 4
    got = load_file(out / "model.safetensors")
    assert not any("scale" in n for n in got)
    expected = torch_reader_load(src, {n: list(t.shape) for n, t in full.items()}, BLOCK)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"

    # the quantized checkpoint against its full-precision source: per-module error statistics
    fp = tmp_path / "full"
    hf_shards(fp, [full], None)
    diff = run_ckpt("diff", src, fp, "--dequantize", "--rtol", "0.1", "--atol", "0.02", "--json")
    report = diff.json["result"]
    errors = {e["name"]: e for e in report["quant_errors"]}
    assert set(errors) == {f"{m}.weight" for m in FP8_LINEARS}
    for name, e in errors.items():
        ref = full[name].double()
        deq = expected[name].double()  # bf16 dequantized; the diff works in float32
        assert 0 < e["rel_rms"] < 0.1 and e["scheme"] == "fp8-block"
        assert e["max_abs"] >= float((deq - ref).abs().max()) * 0.5
    assert report["only_a"] == [] and report["only_b"] == []
    assert diff.exit_code == 0, diff.stdout  # within the tolerance the user gave
    assert "relative RMS" in run_ckpt("diff", src, fp, "--dequantize").stdout


@pytest.mark.parametrize(
    "case", ["nothing quantized", "fp8 weights", "config declares fp8", "orphan scale"]
)
def test_verify_checks_quantization_from_the_headers_it_checked_without_a_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """`verify` judges the quantization from the names, dtypes and shapes its structural check
    parsed, never opening the checkpoint for it (#30: DeepSeek-V3's manifest of 90,000 entries
    was a fifth of its verify), and finds exactly what the analysis of the opened checkpoint
    finds; `--deep`, which reads scale values, opens it once."""
    from ckpt_cli.formats import open_checkpoint
    from ckpt_cli.formats.safetensors.format import SafetensorsFormat
    from ckpt_cli.quant import analyse_checkpoint

    src = tmp_path / "model"
    full = fp8_source()
    if case in ("fp8 weights", "orphan scale"):
        write_fp8_block(src, full)
    else:
        config = {"model_type": "deepseek_v3", "torch_dtype": "bfloat16"}
        if case == "config declares fp8":
            config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
        hf_shards(src, [full], config)
    if case == "orphan scale":
        shard = src / "model-00002-of-00002.safetensors"
        tensors = load_file(shard)
        removed = tensors.pop("model.layers.1.mlp.down_proj.weight")
        save_file(tensors, shard, metadata={"format": "pt"})
        index = json.loads((src / "model.safetensors.index.json").read_text())
        del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
        index["metadata"]["total_size"] -= removed.numel() * removed.element_size()
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = open_checkpoint(str(src))
    expected = analyse_checkpoint(checkpoint.manifest, checkpoint.storage)
    checkpoint.close()
    quantized = bool(expected.quantized or expected.config.method)
    assert quantized == (case != "nothing quantized")

    opened: list[str] = []
    real_open = SafetensorsFormat.open.__func__  # type: ignore[attr-defined]

    def counting_open(cls: type[SafetensorsFormat], source: object) -> object:
        opened.append(str(source))
        return real_open(cls, source)

    monkeypatch.setattr(SafetensorsFormat, "open", classmethod(counting_open))
    checked = run_ckpt("verify", src, "--json")
    result = checked.json["result"]
    assert opened == []
    assert ("quantization" in result["checks"]) == quantized
    reported = [(p["code"], p["tensor"], p["file"], p["message"]) for p in result["problems"]]
    assert reported == [(p.code, p.tensor, p.file, p.message) for p in expected.problems]
    assert checked.exit_code == (1 if expected.problems else 0), checked.stdout
    if case == "config declares fp8":
        assert [p["code"] for p in result["problems"]] == ["config_mismatch"]
    if case == "orphan scale":
        assert [p["code"] for p in result["problems"]] == ["orphan_scale"]
        assert result["problems"][0]["file"].endswith("model-00002-of-00002.safetensors")

    deep = run_ckpt("verify", src, "--deep", "--json")
    assert len(opened) == 1 and ("quantization" in deep.json["result"]["checks"]) == quantized


@pytest.mark.parametrize(
    "damage", ["scale_removed", "wrong_grid", "orphan", "wrong_dtype", "config"]
)
def test_fp8_verify_names_the_weight_and_the_sidecar(tmp_path: Path, damage: str) -> None:
    full = fp8_source()
    src = tmp_path / "fp8"
    write_fp8_block(src, full)
    shard = src / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    weight = "model.layers.1.mlp.down_proj.weight"
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    if damage == "scale_removed":
        del tensors[scale]
        expected = ("missing_scale", weight)
    elif damage == "wrong_grid":
        tensors[scale] = torch.ones(2, 3)  # a [48, 32] weight in 16x16 blocks needs [3, 2]
        expected = ("scale_grid", scale)
    elif damage == "orphan":
        del tensors[weight]
        expected = ("orphan_scale", scale)
    elif damage == "wrong_dtype":
        tensors[scale] = tensors[scale].to(torch.float8_e4m3fn)
        expected = ("scale_dtype", scale)
    else:
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = [128, 128]
        (src / "config.json").write_text(json.dumps(config))
        expected = ("scale_grid", scale)
    if damage != "config":
        save_file(tensors, shard, metadata={"format": "pt"})
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = {
            k: v for k, v in index["weight_map"].items() if k in tensors or "00001" in v
        }
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    checked = run_ckpt("verify", src, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = _problems(checked.json["result"])
    assert expected in problems, problems
    message = next(
        p["message"]
        for p in checked.json["result"]["problems"]
        if (p["code"], p["tensor"]) == expected
    )
    assert weight in message and (scale in message or damage == "scale_removed")
    if damage == "scale_removed":
        assert scale in message  # the missing sidecar is named too
        refused = run_ckpt("convert", src, tmp_path / "out", "--to", "safetensors", "--dequantize")
        assert refused.exit_code == 4 and weight in refused.stderr


def test_convert_without_dequantize_keeps_scales_beside_their_weights_and_uncast(
    tmp_path: Path,
) -> None:
    src = tmp_path / "fp8"
    write_fp8_block(src, fp8_source())
    before = {}
    for shard in src.glob("*.safetensors"):
        before.update(load_file(shard))
    out = tmp_path / "resharded"
    conv = run_ckpt(
        "convert",
        src,
        out,
        "--to",
        "safetensors",
        "--dtype",
        "fp16",
        "--max-shard-size",
        "3KB",
        "--json",
    )
    assert conv.exit_code == 0, conv.stdout
    assert conv.json["result"]["quantized_kept"] == 8  # 4 weights + 4 scales never cast
    assert (
        "--dtype applies to unquantized"
        in run_ckpt(
            "convert", src, tmp_path / "again", "--to", "safetensors", "--dtype", "fp16"
        ).stdout
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    for module in FP8_LINEARS:
        assert index[f"{module}.weight"] == index[f"{module}.weight_scale_inv"]
    for name, shard in index.items():
        with safe_open(out / shard, framework="pt") as f:
            t = f.get_tensor(name)
        if name.endswith(("_proj.weight", "scale_inv")):
            assert t.dtype == before[name].dtype and torch.equal(
                t.view(torch.uint8), before[name].view(torch.uint8)
            )
        else:
            assert t.dtype == torch.float16  # --dtype applied to the unquantized ones
    assert run_ckpt("verify", out).exit_code == 0
    # reshard to small shards keeps every weight with its scale too
    resharded = tmp_path / "small"
    assert run_ckpt("reshard", src, resharded, "--max-shard-size", "2KB").exit_code == 0
    small = json.loads((resharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(small.values())) > 3
    for module in FP8_LINEARS:
        assert small[f"{module}.weight"] == small[f"{module}.weight_scale_inv"]


# ---------------------------------------------------------------- MXFP4 (gpt-oss)

GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
}


def write_gpt_oss(folder: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}"
        for proj, shape in (("gate_up_proj", (2, 32, 64)), ("down_proj", (2, 16, 32))):
            w = torch.randn(*shape, generator=gen) * 0.05
            blocks, scales = quantize_mxfp4(w)
            state[f"{p}.mlp.experts.{proj}_blocks"] = blocks
            state[f"{p}.mlp.experts.{proj}_scales"] = scales
            state[f"{p}.mlp.experts.{proj}_bias"] = torch.zeros(shape[:2], dtype=torch.bfloat16)
            full[f"{p}.mlp.experts.{proj}"] = w.to(torch.bfloat16)
        state[f"{p}.self_attn.q_proj.weight"] = torch.randn(16, 16, generator=gen).to(
            torch.bfloat16
        )
        state[f"{p}.mlp.router.weight"] = torch.randn(2, 16, generator=gen).to(torch.bfloat16)
    state["model.embed_tokens.weight"] = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    hf_shards(folder, [state], GPT_OSS_CONFIG)
    return full


def test_mxfp4_gpt_oss_layout_dequantizes_like_torch_reader(tmp_path: Path) -> None:
    src = tmp_path / "gpt-oss"
    write_gpt_oss(src)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == "mxfp4" and group["modules"] == 4
    assert group["example"]["name"] == "model.layers.0.mlp.experts.down_proj_blocks"
    assert group["example"]["stored_shape"] == [2, 16, 1, 16]
    # the dequantized experts are [E, in, out], as transformers' GptOss holds them
    assert group["example"]["logical_shape"] == [2, 32, 16]
    assert "model.layers.*.self_attn.q_proj" in shown["unquantized"]
    assert run_ckpt("verify", src, "--deep").exit_code == 0

    out = tmp_path / "bf16"
    assert run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize").exit_code == 0
    got = load_file(out / "model.safetensors")
    blocks = {
        n: t
        for n, t in load_file(src / "model-00001-of-00001.safetensors").items()
        if n.endswith("_blocks")
    }
    scales = load_file(src / "model-00001-of-00001.safetensors")
    for name, tensor in blocks.items():
        expected = torch_mxfp4(src, tensor, scales[name.replace("_blocks", "_scales")])
        # torch's reader keeps the `_blocks` name and the stored [E, out, in]; ckpt names and
        # lays out the weight as transformers does
        mine = got[name.removesuffix("_blocks")].transpose(1, 2)
        assert mine.shape == expected.shape
        assert torch.equal(mine.view(torch.int16), expected.view(torch.int16)), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def _gpt_oss_mxfp4(folder: Path) -> None:
    """A tiny real `GptOssForCausalLM` (bf16) saved as the released gpt-oss checkpoints are:
    experts MXFP4-quantized in the stored `[E, out, in]` layout (`*_blocks`, `*_scales`), the
    rest as is, `quantization_config` naming mxfp4."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
        hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, sliding_window=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.float().transpose(1, 2))
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        else:
            state[name] = tensor.contiguous()
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors")
    doc = {**config.to_dict(), "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16"}
    doc["quantization_config"] = GPT_OSS_CONFIG["quantization_config"]
    (folder / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("to", ["hf", "safetensors"])
def test_gpt_oss_mxfp4_dequantizes_to_what_transformers_loads(tmp_path: Path, to: str) -> None:
    """`convert --to hf --dequantize` of a gpt-oss MXFP4 checkpoint: `GptOssForCausalLM.
    from_pretrained(DEST)` holds exactly what transformers' own MXFP4 dequantize of the source
    holds (`Mxfp4Config(dequantize=True)`), experts `[E, in, out]`, and gives its logits."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import GptOssForCausalLM, Mxfp4Config

    _gpt_oss_mxfp4(tmp_path / "src")
    r = run_ckpt(
        "convert", tmp_path / "src", tmp_path / "out", "--to", to, "--dequantize", "--json"
    )
    assert r.exit_code == 0, r.stderr
    if to == "hf":
        assert r.json["result"]["architecture"]["architecture"] == "gpt-oss"
    # the source's config.json is the output's (without its quantization section)
    assert "config.json" not in {s["name"] for s in r.json["result"]["skipped"]}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    reference = GptOssForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    model = GptOssForCausalLM.from_pretrained(tmp_path / "out").eval()
    want, got = reference.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    ids = torch.tensor([[1, 5, 9, 2, 33, 60, 7, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_mxfp4_missing_and_misshapen_scales_are_named(tmp_path: Path) -> None:
    src = tmp_path / "gpt-oss"
    write_gpt_oss(src)
    shard = src / "model-00001-of-00001.safetensors"
    state = load_file(shard)
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    state["model.layers.1.mlp.experts.gate_up_proj_scales"] = torch.zeros(
        2, 32, 4, dtype=torch.uint8
    )
    save_file(state, shard)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.mlp.experts.down_proj_scales"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    result = run_ckpt("verify", src, "--json").json["result"]
    problems = _problems(result)
    assert ("missing_scale", "model.layers.0.mlp.experts.down_proj_blocks") in problems
    assert ("scale_grid", "model.layers.1.mlp.experts.gate_up_proj_scales") in problems


# ---------------------------------------------------------------- NVFP4 (ModelOpt and compressed-tensors)

MODELOPT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    },
}
NV_LINEARS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")


def write_modelopt(folder: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    state: dict[str, torch.Tensor] = {}
    for module in NV_LINEARS:
        for key, t in quantize_nvfp4_modelopt(torch.randn(32, 64, generator=gen) * 0.1).items():
            state[f"{module}.{key}"] = t
    state["lm_head.weight"] = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    hf_shards(folder, [state], {"model_type": "llama", "torch_dtype": "bfloat16"})
    (folder / "hf_quant_config.json").write_text(json.dumps(MODELOPT_CONFIG, indent=4))
    return state


def test_nvfp4_modelopt_dequantizes_by_the_published_formula(tmp_path: Path) -> None:
    src = tmp_path / "nvfp4"
    state = write_modelopt(src)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == "nvfp4" and group["example"]["logical_shape"] == [32, 64]
    assert shown["config"]["file"] == "hf_quant_config.json"
    assert shown["unquantized"] == ["lm_head"]
    assert run_ckpt("verify", src, "--deep").exit_code == 0

    out = tmp_path / "fp32"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32")
    assert conv.exit_code == 0, conv.stdout
    got = load_file(out / "model.safetensors")
    assert set(got) == {f"{m}.weight" for m in NV_LINEARS} | {"lm_head.weight"}
    for module in NV_LINEARS:
        ref = nvfp4_reference(
            state[f"{module}.weight"],
            state[f"{module}.weight_scale"],
            state[f"{module}.weight_scale_2"],
        )
        assert torch.equal(got[f"{module}.weight"], ref), module


def test_nvfp4_reciprocal_global_scale_and_mixed_conventions_are_flagged(tmp_path: Path) -> None:
    src = tmp_path / "nvfp4"
    write_modelopt(src)
    shard = src / "model-00001-of-00001.safetensors"
    state = load_file(shard)
    # a converter stored compressed-tensors' global scale (the reciprocal) as weight_scale_2
    name = "model.layers.0.mlp.down_proj.weight_scale_2"
    state[name] = 1.0 / state[name]
    save_file(state, shard)
    plain = run_ckpt("verify", src, "--json").json["result"]
    assert plain["ok"]  # headers alone cannot tell
    deep = run_ckpt("verify", src, "--deep", "--json").json["result"]
    assert ("reciprocal_scale", name) in _problems(deep)

    # compressed-tensors' names under a ModelOpt config: the conventions are mixed up
    state["model.layers.0.self_attn.q_proj.weight_global_scale"] = torch.tensor([400.0])
    save_file(state, shard)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight_global_scale"] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    mixed = run_ckpt("verify", src, "--json").json["result"]
    assert ("config_mismatch", "model.layers.0.self_attn.q_proj.weight_global_scale") in _problems(
        mixed
    )


def _ct_nvfp4(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Linear weights compressed by compressed-tensors' own NVFP4 compressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    gen = torch.Generator().manual_seed(4)
    state: dict[str, torch.Tensor] = {}
    for module in NV_LINEARS:
        w = (torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16)
        gs = generate_gparam(w.float().min(), w.float().max())
        groups = w.float().reshape(32, 4, 16)
        scale, _ = calculate_qparams(
            groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs
        )
        packed = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme
        )
        for key, t in packed.items():
            state[f"{module}.{key}"] = t
    state["lm_head.weight"] = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    hf_shards(
        folder,
        [state],
        {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": config},
    )
    return state, {"scheme": scheme}


def test_nvfp4_compressed_tensors_matches_its_own_decompressor(tmp_path: Path) -> None:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    src = tmp_path / "ct"
    state, extra = _ct_nvfp4(src)
    assert list(state["model.layers.0.mlp.down_proj.weight_global_scale"].shape) == [1]
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == "nvfp4-ct" and group["stored_dtype"] == "uint8"
    assert shown["config"]["algo"] == "nvfp4-pack-quantized"
    assert run_ckpt("verify", src, "--deep").exit_code == 0

    out = tmp_path / "bf16"
    assert run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize").exit_code == 0
    got = load_file(out / "model.safetensors")
    for module in NV_LINEARS:
        mine = {
            k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module + ".")
        }
        ref = NVFP4PackedCompressor.decompress(mine, extra["scheme"])["weight"]
        assert got[f"{module}.weight"].dtype == ref.dtype == torch.bfloat16
        assert torch.equal(got[f"{module}.weight"].view(torch.int16), ref.view(torch.int16)), module

    # a ModelOpt-convention scale under the compressed-tensors names is flagged with --deep
    shard = src / "model-00001-of-00001.safetensors"
    name = "model.layers.0.mlp.down_proj.weight_global_scale"
    state[name] = 1.0 / state[name]
    save_file(state, shard)
    deep = run_ckpt("verify", src, "--deep", "--json").json["result"]
    assert ("reciprocal_scale", name) in _problems(deep)


def test_mixed_fp8_and_nvfp4_modelopt_checkpoint(tmp_path: Path) -> None:
    src = tmp_path / "mixed"
    gen = torch.Generator().manual_seed(5)
    state = dict(
        (f"model.layers.0.self_attn.q_proj.{k}", v)
        for k, v in quantize_nvfp4_modelopt(torch.randn(32, 64, generator=gen) * 0.1).items()
    )
    w = torch.randn(32, 64, generator=gen)
    scale = w.abs().max() / FP8_MAX
    state["model.layers.0.mlp.down_proj.weight"] = (w / scale).to(torch.float8_e4m3fn)
    state["model.layers.0.mlp.down_proj.weight_scale"] = scale.reshape(())
    state["model.layers.0.mlp.down_proj.input_scale"] = torch.tensor(0.01)
    hf_shards(src, [state], {"torch_dtype": "bfloat16"})
    config = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": {
                "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
                "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
            },
        },
    }
    (src / "hf_quant_config.json").write_text(json.dumps(config))
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert {g["scheme"] for g in shown["schemes"]} == {"nvfp4", "fp8-tensor"}
    assert run_ckpt("verify", src, "--deep").exit_code == 0
    out = tmp_path / "fp32"
    assert (
        run_ckpt(
            "convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32"
        ).exit_code
        == 0
    )
    got = load_file(out / "model.safetensors")
    fp8 = state["model.layers.0.mlp.down_proj.weight"].float() * scale
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], fp8)
    assert set(got) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }


# ---------------------------------------------------------------- scaled FP8 diffusion weights


@pytest.mark.parametrize("spelling", ["scale_weight", "weight_scale"])
def test_scaled_fp8_diffusion_weights_both_spellings(tmp_path: Path, spelling: str) -> None:
    gen = torch.Generator().manual_seed(6)
    state: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for i in range(2):
        module = f"model.diffusion_model.blocks.{i}.attn.qkv"
        w = torch.randn(48, 16, generator=gen)
        scale = w.abs().max() / FP8_MAX
        state[f"{module}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        state[f"{module}.{spelling}"] = scale.reshape(())
        expected[f"{module}.weight"] = (state[f"{module}.weight"].float() * scale).to(
            torch.bfloat16
        )
    state["model.diffusion_model.blocks.0.norm.weight"] = torch.ones(16, dtype=torch.bfloat16)
    src = tmp_path / "flux-fp8.safetensors"
    save_file(state, src)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == "fp8-tensor" and group["modules"] == 2
    assert run_ckpt("verify", src, "--deep").exit_code == 0
    # one block lost its scale: the others say it should have one
    broken = dict(state)
    del broken[f"model.diffusion_model.blocks.1.attn.qkv.{spelling}"]
    save_file(broken, tmp_path / "broken.safetensors")
    result = run_ckpt("verify", tmp_path / "broken.safetensors", "--json").json["result"]
    assert ("missing_scale", "model.diffusion_model.blocks.1.attn.qkv.weight") in _problems(result)
    out = tmp_path / "bf16.safetensors"
    assert run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize").exit_code == 0
    got = load_file(out)
    for name, t in expected.items():
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16))


def test_dequantize_on_a_plain_checkpoint_is_a_usage_error(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2, 2)}, tmp_path / "plain.safetensors")
    result = run_ckpt(
        "convert",
        tmp_path / "plain.safetensors",
        tmp_path / "o.safetensors",
        "--to",
        "safetensors",
        "--dequantize",
    )
    assert result.exit_code == 2 and "no quantized weight" in result.stderr


# ---------------------------------------------------------------- download: a weight brings its scales


@pytest.mark.parametrize("mode", ["shards", "tensors"])
def test_download_of_a_quantized_weight_brings_its_scales(hub, tmp_path: Path, mode: str) -> None:
    src = tmp_path / "fp8"
    write_fp8_block(src, fp8_source())
    hub.add_repo("org/fp8", src)
    dest = tmp_path / "picked"
    result = run_ckpt(
        "download",
        "hf://org/fp8",
        dest,
        "--mode",
        mode,
        "--no-extras",
        "--filter",
        "model.layers.1.mlp.down_proj.weight",
        "--filter",
        "lm_head.weight",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    got: dict[str, torch.Tensor] = {}
    for shard in dest.glob("*.safetensors"):
        got.update(load_file(shard))
    assert {
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.down_proj.weight_scale_inv",
    } <= set(got)
    if mode == "tensors":  # byte ranges: exactly the selection and its scale
        assert set(got) == {
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.mlp.down_proj.weight_scale_inv",
            "lm_head.weight",
        }
    # the scale counts as selected in both modes (shards mode fetches its shard for it)
    assert result.json["result"]["tensors_selected"] == 3


def test_inspect_and_plain_verify_of_a_quantized_checkpoint_never_import_torch(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    from .conftest import REPO

    src = tmp_path / "gpt-oss"
    write_gpt_oss(src)
    probe = (
        "import sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
        "from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for command in ("inspect", "verify"):
        proc = subprocess.run(
            [sys.executable, "-c", probe, command, str(src), "--json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert "NO_TORCH" in proc.stderr, (command, proc.stderr)
        result = json.loads(proc.stdout)["result"]
        if command == "verify":
            assert "quantization" in result["checks"]
        else:
            assert result["quantization"]["schemes"][0]["scheme"] == "mxfp4"


@pytest.mark.parametrize(
    ("preset", "scheme"),
    [("FP8", "fp8-tensor"), ("FP8_DYNAMIC", "fp8-channel"), ("FP8_BLOCK", "fp8-block")],
)
def test_compressed_tensors_fp8_matches_its_own_decompressor(
    tmp_path: Path, preset: str, scheme: str
) -> None:
    """FP8 per tensor, per channel and in 128x128 blocks, written by compressed-tensors itself."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qscheme = preset_name_to_scheme(preset, ["Linear"])
    gen = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for module in NV_LINEARS:
        w = torch.randn(256, 384, generator=gen).to(torch.bfloat16)
        f = w.float()
        if qscheme.weights.strategy == "tensor":
            low, high = f.amin(), f.amax()
        elif qscheme.weights.strategy == "channel":
            low, high = f.amin(1, keepdim=True), f.amax(1, keepdim=True)
        else:
            blocks = f.reshape(2, 128, 3, 128)
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, _ = calculate_qparams(low, high, qscheme.weights)
        packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, qscheme)
        state.update({f"{module}.{k}": v for k, v in packed.items()})
    config = QuantizationConfig(
        config_groups={"group_0": qscheme},
        format="float-quantized",
        quantization_status="compressed",
    ).model_dump(mode="json")
    src = tmp_path / "ct-fp8"
    hf_shards(src, [state], {"torch_dtype": "bfloat16", "quantization_config": config})

    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert [g["scheme"] for g in shown["schemes"]] == [scheme]
    assert run_ckpt("verify", src, "--deep").exit_code == 0
    out = tmp_path / "fp32"
    assert (
        run_ckpt(
            "convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32"
        ).exit_code
        == 0
    )
    got = load_file(out / "model.safetensors")
    for module in NV_LINEARS:
        mine = {
            k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module + ".")
        }
        ref = FloatQuantizationCompressor.decompress(mine, qscheme)["weight"]
        assert ref.dtype == torch.float32
        assert torch.equal(got[f"{module}.weight"], ref), module


@pytest.mark.parametrize("written", [[0, 0], [128], "128x128"])
def test_a_block_structure_that_is_no_block_size_is_said_not_read_as_no_blocks(
    tmp_path: Path, written: object
) -> None:
    """A compressed-tensors block FP8 model whose config says `block_structure: [0, 0]` (a
    converter that lost the size): ckpt read it as "no block size given", took the block from
    the scales' grid, and said nothing, while loaders follow the config. `verify` now warns,
    naming the setting and its value; the weights are still read by the grid."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qscheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    gen = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for module in NV_LINEARS:
        w = torch.randn(256, 384, generator=gen).to(torch.bfloat16)
        blocks = w.float().reshape(2, 128, 3, 128)
        scale, _ = calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), qscheme.weights)
        packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, qscheme)
        state.update({f"{module}.{k}": v for k, v in packed.items()})
    config = QuantizationConfig(
        config_groups={"group_0": qscheme},
        format="float-quantized",
        quantization_status="compressed",
    ).model_dump(mode="json")
    assert config["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    config["config_groups"]["group_0"]["weights"]["block_structure"] = written
    src = tmp_path / "ct-fp8"
    hf_shards(src, [state], {"torch_dtype": "bfloat16", "quantization_config": config})

    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert [g["scheme"] for g in shown["schemes"]] == ["fp8-block"]
    checked = run_ckpt("verify", src, "--json")
    warned = [p for p in checked.json["result"]["problems"] if "block_structure" in p["message"]]
    assert len(warned) == 1, checked.json["result"]["problems"]
    assert warned[0]["severity"] == "warning" and warned[0]["file"].endswith("config.json")
    assert "group_0" in warned[0]["message"] and repr(written) in warned[0]["message"]
    assert checked.exit_code == 0
    human = run_ckpt("verify", src)
    assert "block_structure" in human.stdout + human.stderr


def test_compressed_tensors_int4_raises_no_false_problems(tmp_path: Path) -> None:
    """compressed-tensors int4 `pack-quantized` (its own compressor): declared, not misread."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qscheme = preset_name_to_scheme("W4A16", ["Linear"])
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    groups = w.float().reshape(64, 2, 128)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), qscheme.weights)
    packed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16)}, qscheme
    )
    state = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in packed.items()}
    config = QuantizationConfig(
        config_groups={"g": qscheme}, format="pack-quantized", quantization_status="compressed"
    ).model_dump(mode="json")
    src = tmp_path / "int4"
    hf_shards(src, [state], {"quantization_config": config})
    result = run_ckpt("verify", src, "--json").json["result"]
    assert result["ok"] and result["problems"] == [] and "quantization" in result["checks"]
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert shown["packed"] == [] and shown["schemes"][0]["patterns"] == [
        "model.layers.*.mlp.down_proj"
    ]
    # 64 x 256 int4 values in int32 words
    label = "16.4K parameters, INT4 compressed-tensors pack-quantized (groups of 128)"
    assert label in shown["label"]


def test_fp8_llama_dequantized_equals_transformers_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    """A tiny Llama saved by `save_pretrained`, block-FP8 quantized, read by transformers itself.

    On a machine without a GPU, transformers' FP8 quantizer dequantizes a pre-quantized
    checkpoint to bf16 at load time: the real loader is the judge of ckpt's values, and the
    dequantized output (config without `quantization_config`) must load as a plain model.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    full = tmp_path / "full"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(full)
    quantized: dict[str, torch.Tensor] = {}
    for name, t in load_file(full / "model.safetensors").items():
        if name.endswith("proj.weight"):
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = (
                quantize_fp8_block(t, BLOCK)
            )
        else:
            quantized[name] = t
    src = tmp_path / "fp8"
    src.mkdir()
    save_file(quantized, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((full / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (src / "config.json").write_text(json.dumps(cfg))
    assert run_ckpt("verify", src, "--deep").exit_code == 0

    out = tmp_path / "bf16"
    assert run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize").exit_code == 0
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert getattr(ours.config, "quantization_config", None) is None
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor.view(torch.int16), reference[name].view(torch.int16)), name


def test_nvfp4_missing_global_scale_wrong_grid_and_orphan_input_scale(tmp_path: Path) -> None:
    src = tmp_path / "nvfp4"
    write_modelopt(src)
    shard = src / "model-00001-of-00001.safetensors"
    state = load_file(shard)
    q, d = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
    del state[f"{q}.weight_scale_2"]
    state[f"{d}.weight_scale"] = state[f"{d}.weight_scale"][:, :2].contiguous()  # in/32, not in/16
    state["model.layers.0.mlp.up_proj.input_scale"] = torch.tensor(0.5)  # its weight is gone
    save_file(state, shard)
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, shard.name)}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = _problems(run_ckpt("verify", src, "--json").json["result"])
    assert ("missing_scale", f"{q}.weight") in problems
    assert ("scale_grid", f"{d}.weight_scale") in problems
    assert ("orphan_scale", "model.layers.0.mlp.up_proj.input_scale") in problems


def _replace_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    """Overwrite one tensor of a one-shard checkpoint, as a botched re-export would."""
    shard = folder / "model-00001-of-00001.safetensors"
    state = load_file(shard)
    state[name] = value
    save_file(state, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["fp8-oversized", "fp8-undersized", "mxfp4", "nvfp4"])
def test_dequantize_refuses_a_scale_grid_verify_calls_wrong(tmp_path: Path, case: str) -> None:
    # a scale of the wrong grid: applied, its values land on other blocks (or do not fit)
    src = tmp_path / "src"
    if case.startswith("fp8"):
        gen = torch.Generator().manual_seed(5)
        q, _ = quantize_fp8_block(torch.randn(32, 32, generator=gen), BLOCK)
        grid = (3, 3) if case == "fp8-oversized" else (2, 1)
        weight, scale = (
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.weight_scale_inv",
        )
        config = {
            "model_type": "llama",
            "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]},
        }
        state = {weight: q, scale: torch.rand(*grid) + 0.5, "model.norm.weight": torch.ones(4)}
        hf_shards(src, [state], config)
        want, got = "[2, 2]", f"{list(grid)}"
    elif case == "mxfp4":
        write_gpt_oss(src)
        weight = "model.layers.0.mlp.experts.down_proj_blocks"
        scale = "model.layers.0.mlp.experts.down_proj_scales"  # [2, 16, 1] stored
        _replace_tensor(src, scale, torch.full((2, 16, 2), 127, dtype=torch.uint8))
        want, got = "[2, 16, 1]", "[2, 16, 2]"
    else:
        write_modelopt(src)
        weight = "model.layers.0.mlp.down_proj.weight"
        scale = "model.layers.0.mlp.down_proj.weight_scale"  # [32, 4] stored
        _replace_tensor(src, scale, torch.ones(32, 3).to(torch.float8_e4m3fn))
        want, got = "[32, 4]", "[32, 3]"
    verified = run_ckpt("verify", src, "--json").json["result"]
    assert ("scale_grid", scale) in _problems(verified)

    out = tmp_path / "out"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize")
    assert conv.exit_code == 4, conv.stdout + conv.stderr
    for text in (weight, scale, want, got):
        assert text in conv.stderr
    assert not out.exists()
    compared = run_ckpt("diff", src, src, "--dequantize")
    assert compared.exit_code == 4 and scale in compared.stderr


def test_nvfp4_whose_input_size_is_not_a_multiple_of_16_dequantizes_in_groups_of_16(
    tmp_path: Path,
) -> None:
    # in = 24: ModelOpt pads to 32, quantizes, keeps 24 columns; scales [out, ceil(24/16)]
    gen = torch.Generator().manual_seed(7)
    w = torch.zeros(8, 32)
    w[:, :24] = torch.randn(8, 24, generator=gen)
    w[:, 16:24] *= 20  # the partial group's scale differs from the first's
    q = quantize_nvfp4_modelopt(w)
    module = "model.layers.0.mlp.up_proj"
    state = {
        f"{module}.weight": q["weight"][:, :12].contiguous(),
        f"{module}.weight_scale": q["weight_scale"],
        f"{module}.weight_scale_2": q["weight_scale_2"],
        "model.norm.weight": torch.ones(8),
    }
    src = tmp_path / "nvfp4"
    hf_shards(src, [state], {"model_type": "llama", "torch_dtype": "float32"})
    (src / "hf_quant_config.json").write_text(json.dumps(MODELOPT_CONFIG))
    assert run_ckpt("verify", src).exit_code == 0

    out = tmp_path / "fp32"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    got = load_file(out / "model.safetensors")[f"{module}.weight"]
    ref = nvfp4_reference(
        state[f"{module}.weight"],
        state[f"{module}.weight_scale"],
        state[f"{module}.weight_scale_2"],
    )
    assert got.shape == (8, 24) and torch.equal(got, ref)
    assert torch.equal(
        got, nvfp4_reference(q["weight"], q["weight_scale"], q["weight_scale_2"])[:, :24]
    )


def test_diff_dequantize_compares_static_activation_scales(tmp_path: Path) -> None:
    # two NVFP4 exports with the same weights but another calibration: every output differs
    a, b = tmp_path / "a", tmp_path / "b"
    state = write_modelopt(a)
    write_modelopt(b)
    scale = "model.layers.0.mlp.down_proj.input_scale"
    _replace_tensor(b, scale, torch.tensor(5.0))
    result = run_ckpt("diff", a, b, "--dequantize", "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert [d["name"] for d in report["differences"]] == [scale]
    assert report["dequantized"] == {"a": 2, "b": 2}

    # against the full-precision weights, which have no activation scales: no difference,
    # but the scales are said not compared
    full = tmp_path / "full"
    plain = {
        f"{m}.weight": nvfp4_reference(
            state[f"{m}.weight"], state[f"{m}.weight_scale"], state[f"{m}.weight_scale_2"]
        )
        for m in NV_LINEARS
    }
    plain["lm_head.weight"] = state["lm_head.weight"]
    hf_shards(full, [plain], {"model_type": "llama", "torch_dtype": "float32"})
    against = run_ckpt("diff", a, full, "--dequantize", "--atol", "0")
    assert against.exit_code == 0, against.stdout + against.stderr
    assert "2 activation scale(s) of quantized weights not compared" in against.stderr
    assert "model.layers.0.self_attn.q_proj.input_scale" in against.stderr
    report = run_ckpt("diff", a, full, "--dequantize", "--atol", "0", "--json").json["result"]
    assert report["only_a"] == [] and report["identical"] is True


# ---------------------------------------------------------------- GPTQ (packed, kept as stored)


def write_gptq(folder: Path) -> dict[str, torch.Tensor]:
    """A GPTQ 4-bit checkpoint as AutoGPTQ / GPTQModel write it: per linear `qweight` int32
    `[in/8, out]`, `qzeros` int32 `[in/group, out/8]`, `scales` float16 `[in/group, out]`,
    `g_idx` int32 `[in]`; config.json `quantization_config.quant_method: gptq`."""
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    rows, cols, group = 64, 32, 32  # in, out
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.up_proj"
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int64)
        shifts = torch.arange(8, dtype=torch.int64) * 4
        packed = (codes.reshape(rows // 8, 8, cols) << shifts.reshape(1, 8, 1)).sum(dim=1)
        state[f"{p}.qweight"] = packed.to(torch.uint32).view(torch.int32)
        zeros = (torch.full((rows // group, cols), 7, dtype=torch.int64)).reshape(-1, cols // 8, 8)
        state[f"{p}.qzeros"] = (zeros << shifts).sum(-1).to(torch.uint32).view(torch.int32)
        # float16 scales a bfloat16 cast rounds (10 mantissa bits against 7)
        state[f"{p}.scales"] = (torch.rand(rows // group, cols, generator=gen) * 0.01 + 1e-3).half()
        state[f"{p}.g_idx"] = torch.arange(rows, dtype=torch.int32) // group
    state["model.norm.weight"] = torch.ones(cols, dtype=torch.float16)
    state["lm_head.weight"] = torch.randn(16, cols, generator=gen).half()
    config = {
        "model_type": "llama",
        "torch_dtype": "float16",
        "quantization_config": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": True,
        },
    }
    hf_shards(folder, [state], config)
    return state


def test_gptq_weights_and_scales_are_never_cast_and_inspect_calls_them_packed(
    tmp_path: Path,
) -> None:
    src = tmp_path / "gptq"
    state = write_gptq(src)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert shown["packed"] == ["model.layers.*.mlp.up_proj"]
    assert "model.layers.*.mlp.up_proj" not in shown["unquantized"]
    assert "gptq packed" in shown["label"]

    out = tmp_path / "bf16"
    conv = run_ckpt(
        "convert", src, out, "--to", "safetensors", "--dtype", "bf16", "--max-shard-size", "2KB"
    )
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    assert "kept as stored" in conv.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    for name, shard in index.items():
        with safe_open(out / shard, framework="pt") as f:
            got = f.get_tensor(name)
        if name.startswith("model.layers."):
            # the packed values and their float16 scales, bit for bit, one shard per module
            assert got.dtype == state[name].dtype and torch.equal(got, state[name]), name
            module = name.rsplit(".", 1)[0]
            assert shard == index[f"{module}.qweight"]
        else:
            assert got.dtype == torch.bfloat16, name


def test_convert_filter_of_a_quantized_weight_brings_its_scales(tmp_path: Path) -> None:
    src = tmp_path / "fp8"
    write_fp8_block(src, fp8_source())
    out = tmp_path / "q_proj"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "-k", "*.q_proj.weight", "--json")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    listed = {e["name"] for e in conv.json["result"]["entries"]}
    want = {
        f"model.layers.{n}.self_attn.q_proj.{s}"
        for n in (0, 1)
        for s in ("weight", "weight_scale_inv")
    }
    assert listed == want
    got = {}
    for shard in out.glob("*.safetensors"):
        got.update(load_file(shard))
    assert set(got) == want
    assert run_ckpt("verify", out).exit_code == 0
    # a --filter-out that names a scale explicitly still wins (and verify says what is missing)
    bare = tmp_path / "bare"
    made = run_ckpt(
        "convert",
        src,
        bare,
        "--to",
        "safetensors",
        "-k",
        "*.q_proj.weight",
        "--filter-out",
        "*scale_inv",
    )
    assert made.exit_code == 0, made.stdout + made.stderr
    assert "missing_scale" in run_ckpt("verify", bare).stdout
    # GPTQ: a module's qweight brings its qzeros, scales and g_idx
    gptq = tmp_path / "gptq"
    write_gptq(gptq)
    picked = run_ckpt(
        "convert", gptq, tmp_path / "up0", "--to", "safetensors", "-k", "*.0.*.qweight", "--json"
    )
    assert picked.exit_code == 0, picked.stdout + picked.stderr
    assert {e["name"] for e in picked.json["result"]["entries"]} == {
        f"model.layers.0.mlp.up_proj.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")
    }


def test_dequantized_modelopt_output_leaves_hf_quant_config_out_and_verifies(
    tmp_path: Path,
) -> None:
    src = tmp_path / "nvfp4"
    write_modelopt(src)
    out = tmp_path / "plain"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--json")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    result = conv.json["result"]
    assert not (out / "hf_quant_config.json").exists()
    (left_out,) = [s for s in result["skipped"] if s["name"] == "hf_quant_config.json"]
    assert "--dequantize" in left_out["reason"]
    assert "hf_quant_config.json" not in result["extras"]
    # the plain output declares no quantization, so ckpt's own verify passes it
    assert run_ckpt("verify", out).exit_code == 0
    shown = run_ckpt("inspect", out, "--json").json["result"].get("quantization")
    assert shown is None or not shown["schemes"]


def test_dequantize_reports_the_file_every_weight_was_read_from(tmp_path: Path) -> None:
    # every tensor quantized: each output entry is built from the shard's payload and scales
    src = tmp_path / "fp8"
    gen = torch.Generator().manual_seed(9)
    q, s = quantize_fp8_block(torch.randn(32, 32, generator=gen), BLOCK)
    module = "model.layers.0.mlp.up_proj"
    config = {
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]},
    }
    hf_shards(src, [{f"{module}.weight": q, f"{module}.weight_scale_inv": s}], config)
    conv = run_ckpt(
        "convert", src, tmp_path / "out", "--to", "safetensors", "--dequantize", "--json"
    )
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    result = conv.json["result"]
    assert result["read"] == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert result["skipped"] == []
    human = run_ckpt("convert", src, tmp_path / "again", "--to", "safetensors", "--dequantize")
    assert "not in the output" not in human.stdout + human.stderr


@pytest.mark.parametrize("config_block", [True, False])
def test_fp8_block_stacked_experts_dequantize_per_expert_like_torch(
    tmp_path: Path, config_block: bool
) -> None:
    # a 3-D weight [E, out, in] with one scale grid per expert [E, ceil(out/16), ceil(in/16)]
    gen = torch.Generator().manual_seed(11)
    name = "model.layers.0.mlp.experts.down_proj.weight"
    experts = [torch.randn(40, 48, generator=gen).to(torch.bfloat16) for _ in range(3)]
    quantized = [quantize_fp8_block(w, BLOCK) for w in experts]
    weight = torch.stack([q for q, _ in quantized])
    scale = torch.stack([s for _, s in quantized])
    assert list(scale.shape) == [3, 3, 3]
    quant_config: dict = {"quant_method": "fp8"}
    if config_block:
        quant_config["weight_block_size"] = [BLOCK, BLOCK]
    config = {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": quant_config}
    src = tmp_path / "fp8"
    norm = torch.ones(48, dtype=torch.bfloat16)
    hf_shards(
        src,
        [{name: weight, name + "_scale_inv": scale, "model.norm.weight": norm}],
        config,
    )
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == "fp8-block" and group["example"]["logical_shape"] == [3, 40, 48]
    assert run_ckpt("verify", src).exit_code == 0

    out = tmp_path / "bf16"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "bf16")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    got = load_file(out / "model.safetensors")[name]
    assert got.shape == (3, 40, 48) and got.dtype == torch.bfloat16
    # torch's reader dequantizes 2-D weights: each expert on its own is the reference
    for i, (q, s) in enumerate(quantized):
        one = tmp_path / f"expert{i}"
        hf_shards(one, [{"w.weight": q, "w.weight_scale_inv": s}], None)
        (want,) = torch_reader_load(one, {"w.weight": [40, 48]}, BLOCK).values()
        assert torch.equal(got[i].view(torch.int16), want.view(torch.int16)), i

    full = tmp_path / "full"
    hf_shards(full, [{name: torch.stack(experts), "model.norm.weight": norm}], None)
    compared = run_ckpt("diff", src, full, "--dequantize", "--rtol", "0.1", "--atol", "0.05")
    assert compared.exit_code == 0, compared.stdout + compared.stderr
    # a grid of the wrong expert count is named, as verify names it
    hf_shards(
        src, [{name: weight, name + "_scale_inv": scale[:2], "model.norm.weight": norm}], config
    )
    refused = run_ckpt("convert", src, tmp_path / "bad", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4 and "[2, 3, 3]" in refused.stderr
    implied = "[3, 3, 3] (E x ceil(out/16)" if config_block else "[3, 1, 1] (E x 128x128 blocks)"
    assert implied in refused.stderr


# ------------------------------------------------- bitsandbytes (packed, kept as stored)


def write_bitsandbytes(folder: Path, bits: int) -> dict[str, torch.Tensor]:
    """A bitsandbytes checkpoint under the names and dtypes transformers' `save_pretrained`
    gives a `load_in_4bit` / `load_in_8bit` model (bitsandbytes itself needs a GPU to
    quantize, so the values are drawn, not computed): 4-bit, per linear `weight` uint8
    `[out*in/2, 1]` (two NF4 codes a byte) with `weight.absmax` float32, `weight.quant_map`
    float32 `[16]` and `weight.quant_state.bitsandbytes__nf4` (its JSON as uint8); 8-bit,
    `weight` int8 `[out, in]` with `SCB` float32 `[out]` and `weight_format` uint8."""
    gen = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    rows, cols = 32, 64  # out, in
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.up_proj"
        if bits == 4:
            state[f"{p}.weight"] = torch.randint(
                0, 256, (rows * cols // 2, 1), generator=gen, dtype=torch.uint8
            )
            # float32 values a bfloat16 cast rounds
            state[f"{p}.weight.absmax"] = torch.rand(rows * cols // 64, generator=gen) + 0.1
            state[f"{p}.weight.quant_map"] = torch.linspace(-1, 1, 16) / 3
            blob = json.dumps(
                {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [rows, cols]}
            ).encode()
            state[f"{p}.weight.quant_state.bitsandbytes__nf4"] = torch.tensor(
                list(blob), dtype=torch.uint8
            )
        else:
            state[f"{p}.weight"] = torch.randint(
                -127, 128, (rows, cols), generator=gen, dtype=torch.int8
            )
            state[f"{p}.SCB"] = torch.rand(rows, generator=gen) * 3 + 0.1
            state[f"{p}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
    state["model.norm.weight"] = torch.rand(cols, generator=gen)
    state["lm_head.weight"] = torch.randn(16, cols, generator=gen)
    quant = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if bits == 4 else {}
    config = {
        "model_type": "llama",
        "torch_dtype": "float32",
        "quantization_config": {
            "quant_method": "bitsandbytes",
            f"load_in_{bits}bit": True,
            **quant,
        },
    }
    hf_shards(folder, [state], config)
    return state


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_states_are_never_cast_and_inspect_calls_them_packed(
    tmp_path: Path, bits: int
) -> None:
    """`convert --dtype bf16` of a bitsandbytes model cast its float32 `absmax`, `quant_map`
    and `SCB` to bfloat16 (every dequantized value then off) and `inspect` listed its 4/8-bit
    weights as `unquantized`."""
    src = tmp_path / f"bnb{bits}"
    state = write_bitsandbytes(src, bits)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert shown["packed"] == ["model.layers.*.mlp.up_proj"], shown
    assert not any(p.startswith("model.layers.*.mlp.up_proj") for p in shown["unquantized"])
    assert f"bitsandbytes {bits}-bit packed" in shown["label"]

    out = tmp_path / "bf16"
    conv = run_ckpt(
        "convert", src, out, "--to", "safetensors", "--dtype", "bf16", "--max-shard-size", "1KB"
    )
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    assert "kept as stored" in conv.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    for name, shard in index.items():
        with safe_open(out / shard, framework="pt") as f:
            got = f.get_tensor(name)
        if name.startswith("model.layers."):
            # the codes and their float32 states, bit for bit, in their weight's shard
            assert got.dtype == state[name].dtype and torch.equal(got, state[name]), name
            module = name.split(".weight")[0].removesuffix(".SCB")
            assert shard == index[f"{module}.weight"], name
        else:
            assert got.dtype == torch.bfloat16, name


@pytest.mark.parametrize("scheme", ["bnb4", "bnb8", "gptq"])
def test_dequantize_of_a_scheme_ckpt_keeps_packed_names_it(tmp_path: Path, scheme: str) -> None:
    """`--dequantize` of a GPTQ or bitsandbytes model said "no quantized weight found" (exit
    2, a usage error): it holds quantized weights, of a scheme ckpt does not dequantize."""
    src = tmp_path / scheme
    if scheme == "gptq":
        write_gptq(src)
    else:
        write_bitsandbytes(src, int(scheme[-1]))
    named = "gptq" if scheme == "gptq" else f"bitsandbytes {scheme[-1]}-bit"
    conv = run_ckpt("convert", src, tmp_path / "out", "--to", "safetensors", "--dequantize")
    assert conv.exit_code == 4, conv.stdout + conv.stderr
    assert named in conv.stderr and "model.layers.0.mlp.up_proj" in conv.stderr
    assert "no quantized weight found" not in conv.stderr
    assert not (tmp_path / "out").exists()
    compared = run_ckpt("diff", src, src, "--dequantize")
    assert compared.exit_code == 4, compared.stdout + compared.stderr
    assert named in compared.stderr


def write_compressed_tensors_int(folder: Path, preset: str) -> dict[str, torch.Tensor]:
    """Two bfloat16 linears quantized by compressed-tensors' own compressors: `W4A16`
    (`pack-quantized`: `weight_packed` int32, `weight_scale` bfloat16 per group of 128,
    `weight_shape`) or `W8A8` (`int-quantized`: `weight` int8, `weight_scale` per channel)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    qscheme = preset_name_to_scheme(preset, ["Linear"])
    gen = torch.Generator().manual_seed(8)
    state: dict[str, torch.Tensor] = {}
    for layer in range(2):
        w = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
        groups = w.float().reshape(64, -1, 128 if preset == "W4A16" else 256)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), qscheme.weights)
        compressor = (
            PackedQuantizationCompressor if preset == "W4A16" else IntQuantizationCompressor
        )
        packed = compressor.compress(
            {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero},
            qscheme,
        )
        state.update({f"model.layers.{layer}.mlp.down_proj.{k}": v for k, v in packed.items()})
    state["model.norm.weight"] = torch.rand(64, generator=gen).to(torch.bfloat16)
    fmt = "pack-quantized" if preset == "W4A16" else "int-quantized"
    config = QuantizationConfig(
        config_groups={"g": qscheme}, format=fmt, quantization_status="compressed"
    ).model_dump(mode="json")
    hf_shards(folder, [state], {"torch_dtype": "bfloat16", "quantization_config": config})
    return state


@pytest.mark.parametrize("preset", ["W4A16", "W8A8"])
def test_compressed_tensors_int_weights_and_scales_are_never_cast(
    tmp_path: Path, preset: str
) -> None:
    """compressed-tensors int4 (`pack-quantized`) and int8 (`int-quantized`) models: `convert
    --dtype fp16` cast their bfloat16 `weight_scale` to float16 (rounded, every value then
    off) and `inspect` listed the modules as `unquantized`."""
    src = tmp_path / preset
    state = write_compressed_tensors_int(src, preset)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (scheme,) = shown["schemes"]
    assert scheme["patterns"] == ["model.layers.*.mlp.down_proj"], shown
    assert "model.layers.*.mlp.down_proj" not in shown["unquantized"]
    fmt = "pack-quantized" if preset == "W4A16" else "int-quantized"
    assert f"INT{4 if preset == 'W4A16' else 8} compressed-tensors {fmt}" in shown["label"]
    assert run_ckpt("verify", src).exit_code == 0

    out = tmp_path / "fp16"
    conv = run_ckpt(
        "convert", src, out, "--to", "safetensors", "--dtype", "fp16", "--max-shard-size", "4KB"
    )
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    payload = "weight_packed" if preset == "W4A16" else "weight"
    for name, shard in index.items():
        with safe_open(out / shard, framework="pt") as f:
            got = f.get_tensor(name)
        if name.startswith("model.layers."):
            assert got.dtype == state[name].dtype and torch.equal(got, state[name]), name
            module = name.rsplit(".", 1)[0]
            assert shard == index[f"{module}.{payload}"], name
        else:
            assert got.dtype == torch.float16, name
    dequantized = run_ckpt("convert", src, tmp_path / "dq", "--to", "safetensors", "--dequantize")
    assert dequantized.exit_code == 0, dequantized.stdout + dequantized.stderr


#: compressed-tensors integer variants: (format, num_bits, strategy, group size, symmetric)
CT_INT_VARIANTS = {
    "int4-group128": ("pack-quantized", 4, "group", 128, True),
    "int4-group32-asym": ("pack-quantized", 4, "group", 32, False),
    "int4-channel-asym": ("pack-quantized", 4, "channel", None, False),
    "int4-tensor": ("pack-quantized", 4, "tensor", None, True),
    "int8-channel": ("pack-quantized", 8, "channel", None, True),
    "int8-group32-asym": ("pack-quantized", 8, "group", 32, False),
    "int-quantized-channel": ("int-quantized", 8, "channel", None, True),
    "int-quantized-group128-asym": ("int-quantized", 8, "group", 128, False),
    "int-quantized-tensor": ("int-quantized", 8, "tensor", None, True),
}


def ct_int_scheme(variant: str) -> Any:
    """The compressed-tensors `QuantizationScheme` of a `CT_INT_VARIANTS` entry."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    _, bits, strategy, group, symmetric = CT_INT_VARIANTS[variant]
    args = QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_int_quantize(w: torch.Tensor, variant: str) -> dict[str, torch.Tensor]:
    """`w` quantized and compressed by compressed-tensors' own compressor of the variant's
    format (scales from its `calculate_qparams`, in the weight's dtype)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    fmt, _, strategy, group, _ = CT_INT_VARIANTS[variant]
    qscheme = ct_int_scheme(variant)
    rows = w.shape[0]
    x = w.float()
    if strategy == "group":
        lo, hi = x.reshape(rows, -1, group).amin(-1), x.reshape(rows, -1, group).amax(-1)
    elif strategy == "channel":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    else:
        lo, hi = x.amin().reshape(1), x.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, qscheme.weights)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return compressor.compress(
        {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}, qscheme
    )


def write_ct_int_variant(folder: Path, variant: str) -> dict[str, torch.Tensor]:
    """Two bfloat16 linears (`[48, 256]`, `[64, 256]`) compressed as `variant`, a norm, and
    the config compressed-tensors writes."""
    from compressed_tensors.quantization import QuantizationConfig

    gen = torch.Generator().manual_seed(11)
    state: dict[str, torch.Tensor] = {}
    for layer, rows in enumerate((48, 64)):
        w = (torch.randn(rows, 256, generator=gen) * 0.05).to(torch.bfloat16)
        packed = ct_int_quantize(w, variant)
        state.update({f"model.layers.{layer}.mlp.down_proj.{k}": v for k, v in packed.items()})
    state["model.norm.weight"] = torch.rand(64, generator=gen).to(torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"g": ct_int_scheme(variant)},
        format=CT_INT_VARIANTS[variant][0],
        quantization_status="compressed",
    ).model_dump(mode="json")
    hf_shards(folder, [state], {"torch_dtype": "bfloat16", "quantization_config": config})
    return state


def ct_int_reference(state: dict[str, torch.Tensor], module: str, variant: str) -> torch.Tensor:
    """What compressed-tensors' own compressor decompresses `module` of `state` to."""
    from compressed_tensors.compressors.base import BaseCompressor

    mine = {k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module)}
    compressor = BaseCompressor.get_value_from_registry(CT_INT_VARIANTS[variant][0])
    return compressor.decompress(mine, ct_int_scheme(variant))["weight"]


@pytest.mark.parametrize("variant", list(CT_INT_VARIANTS))
def test_compressed_tensors_int_weights_dequantize_like_its_own_decompressor(
    tmp_path: Path, variant: str
) -> None:
    """compressed-tensors' integer formats (`pack-quantized` int4/int8 W4A16/W8A16 and
    `int-quantized` W8A8; per channel, per group of 32 or 128, per tensor; symmetric and
    asymmetric) were kept as stored by `convert --dequantize`, which refused them (exit 4).
    Each weight is now dequantized bit for bit as compressed-tensors' own decompressor
    dequantizes it, in bf16 and fp32; `inspect` names the scheme and bits, `verify --deep`
    stays clean, and `diff --dequantize` finds no difference."""
    fmt, bits, strategy, group, _ = CT_INT_VARIANTS[variant]
    src = tmp_path / variant
    state = write_ct_int_variant(src, variant)
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (scheme,) = shown["schemes"]
    assert scheme["modules"] == 2 and shown["packed"] == [], shown
    assert f"INT{bits} compressed-tensors {fmt}" in scheme["label"], scheme
    if strategy == "group":
        assert f"(groups of {group})" in scheme["label"], scheme
    assert shown["parameters"] == (48 + 64) * 256 + 64
    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out = tmp_path / dtype
        conv = run_ckpt(
            "convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", dtype
        )
        assert conv.exit_code == 0, conv.stdout + conv.stderr
        got = load_file(out / "model.safetensors")
        assert sorted(got) == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] + [
            "model.norm.weight"
        ]
        for layer in range(2):
            module = f"model.layers.{layer}.mlp.down_proj"
            ref = ct_int_reference(state, module, variant).to(torch_dtype)
            assert got[f"{module}.weight"].dtype == torch_dtype
            assert torch.equal(got[f"{module}.weight"], ref), (dtype, module)
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        assert run_ckpt("verify", out).exit_code == 0
    compared = run_ckpt("diff", src, tmp_path / "bf16", "--dequantize", "--atol", "0")
    assert compared.exit_code == 0, compared.stdout + compared.stderr


def test_compressed_tensors_int4_activation_order_g_idx_dequantizes_by_its_groups(
    tmp_path: Path,
) -> None:
    """A GPTQ `actorder: group` int4 model as llm-compressor wrote it: `weight_g_idx` gives
    each input column its group. compressed-tensors sorts the columns by it, dequantizes them
    in groups and puts them back; ckpt's output equals compressed-tensors' own decompression
    of the same codes in that sorted order, put back. A `g_idx` whose groups are not all the
    group size (compressed-tensors would give columns another group's scale) is refused by
    name before anything is written."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationConfig

    variant = "int4-group32-asym"
    gen = torch.Generator().manual_seed(12)
    w = (torch.randn(64, 256, generator=gen) * 0.05).to(torch.bfloat16)
    order = torch.randperm(256, generator=gen)
    sorted_state = ct_int_quantize(w[:, order], variant)  # groups of 32 in activation order
    codes = torch.empty(64, 256, dtype=torch.int8)
    codes[:, order] = unpack_from_int32(sorted_state["weight_packed"], 4, torch.Size([64, 256]))
    g_idx = torch.empty(256, dtype=torch.int32)
    g_idx[order] = (torch.arange(256) // 32).to(torch.int32)
    module = "model.layers.0.mlp.down_proj"
    state = {
        f"{module}.weight_packed": pack_to_int32(codes, 4),
        f"{module}.weight_scale": sorted_state["weight_scale"],
        f"{module}.weight_zero_point": sorted_state["weight_zero_point"],
        f"{module}.weight_shape": sorted_state["weight_shape"],
        f"{module}.weight_g_idx": g_idx,
    }
    config = QuantizationConfig(
        config_groups={"g": ct_int_scheme(variant)},
        format="pack-quantized",
        quantization_status="compressed",
    ).model_dump(mode="json")
    config["config_groups"]["g"]["weights"]["actorder"] = "group"
    src = tmp_path / "actorder"
    hf_shards(src, [state], {"torch_dtype": "bfloat16", "quantization_config": config})
    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr

    out = tmp_path / "bf16"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    in_order = ct_int_reference(
        {f"{module}.{k}": v for k, v in sorted_state.items()}, module, variant
    )
    want = torch.empty_like(in_order)
    want[:, order] = in_order
    got = load_file(out / "model.safetensors")[f"{module}.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # the dequantized values track the weight (the codes were put back in the right columns)
    assert (got.float() - w.float()).abs().max() < 0.05

    state[f"{module}.weight_g_idx"] = torch.zeros(256, dtype=torch.int32)  # one group of 256
    hf_shards(src, [state], {"torch_dtype": "bfloat16", "quantization_config": config})
    refused = run_ckpt("convert", src, tmp_path / "no", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4, refused.stdout + refused.stderr
    assert f"{module}.weight_packed" in refused.stderr and "g_idx" in refused.stderr
    assert "CompressedTensorsConfig" in refused.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("damage", ["three-bit", "wrong-bits", "wrong-shape"])
def test_compressed_tensors_int_weights_ckpt_cannot_match_are_refused_by_name(
    tmp_path: Path, damage: str
) -> None:
    """What ckpt cannot dequantize bit for bit is refused by name, with the fix, before
    anything is written: 3-bit packing (compressed-tensors changed how it packs values that
    straddle words), a config whose `num_bits` is not the packing's, a `weight_shape` that
    does not fit the packed words."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = tmp_path / damage
    state = write_ct_int_variant(src, "int4-group128")
    config = json.loads((src / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["g"]["weights"]
    module = "model.layers.1.mlp.down_proj"
    if damage == "three-bit":
        args = QuantizationArgs(num_bits=3, type="int", strategy="group", group_size=128)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        from compressed_tensors.compressors.pack_quantized.base import (
            PackedQuantizationCompressor,
        )
        from compressed_tensors.quantization.utils.helpers import calculate_qparams

        w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        groups = w.float().reshape(64, 2, 128)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme
        )
        state.update({f"{module}.{k}": v for k, v in packed.items()})
        weights["num_bits"] = 3
        said = "3-bit"
    elif damage == "wrong-bits":
        weights["num_bits"] = 8
        said = "num_bits"
    else:
        state[f"{module}.weight_shape"] = torch.tensor([64, 512])
        said = "[64, 512]"
    hf_shards(src, [state], config)
    refused = run_ckpt("convert", src, tmp_path / "no", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4, refused.stdout + refused.stderr
    assert "model.layers." in refused.stderr and said in refused.stderr, refused.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("variant", ["int4-group32-asym", "int8-channel", "int-quantized-channel"])
def test_compressed_tensors_int_llama_dequantized_equals_what_transformers_loads(
    tmp_path: Path, variant: str
) -> None:
    """A tiny Llama quantized and saved the way llm-compressor does it
    (`apply_quantization_config`, `ModelCompressor.compress_model`, `save_pretrained`,
    `update_config`) in compressed-tensors' integer formats: ckpt's dequantized output loads
    as a plain model whose every tensor equals what transformers' own compressed-tensors
    loader decompresses (`run_compressed=False`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    scheme = ct_int_scheme(variant)
    fmt, _, strategy, group, _ = CT_INT_VARIANTS[variant]
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"], format=fmt)
    )
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, "weight_scale"):
            x = module.weight.float()
            if strategy == "group":
                x = x.reshape(x.shape[0], -1, group)
            lo, hi = (
                x.amin(-1, keepdim=strategy != "group"),
                x.amax(-1, keepdim=strategy != "group"),
            )
            scale, zero = calculate_qparams(lo, hi, scheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    assert compressor is not None
    compressor.compress_model(model)
    src = tmp_path / variant
    model.save_pretrained(src)
    compressor.update_config(src)
    assert qscheme_format(src) == fmt

    _verified_then_dequantized_like_transformers(src, tmp_path / "bf16")


def test_compressed_tensors_int4_stacked_experts_dequantize_like_its_own_decompressor(
    tmp_path: Path,
) -> None:
    """Stacked experts `[E, out, in]` packed by compressed-tensors' own compressor (int4,
    asymmetric, groups of 32: `weight_packed` `[E, out, in/8]`, zero points packed per
    expert along `out`) dequantize to `[E, out, in]`, bit for bit its own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = ct_int_scheme("int4-group32-asym")
    gen = torch.Generator().manual_seed(13)
    w = (torch.randn(3, 16, 64, generator=gen) * 0.05).to(torch.bfloat16)
    groups = w.float().reshape(3, 16, 2, 32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    stored = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero},
        scheme,
    )
    assert list(stored["weight_zero_point"].shape) == [3, 2, 2]  # packed along out, per expert
    src = tmp_path / "experts"
    config = QuantizationConfig(
        config_groups={"g": scheme}, format="pack-quantized", quantization_status="compressed"
    ).model_dump(mode="json")
    hf_shards(
        src,
        [{f"mlp.experts.{k}": v.contiguous() for k, v in stored.items()}],
        {"torch_dtype": "bfloat16", "quantization_config": config},
    )
    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    out = tmp_path / "fp32"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    got = load_file(out / "model.safetensors")["mlp.experts.weight"]
    want = PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
    assert list(got.shape) == [3, 16, 64] and torch.equal(got, want.float())


@pytest.mark.parametrize(
    "damage", ["empty-scale", "zero-point-shape", "g-idx-2d", "g-idx-float", "float-words"]
)
def test_a_hostile_compressed_tensors_int_weight_is_refused_by_name_not_a_crash(
    tmp_path: Path, damage: str
) -> None:
    """Crafted sidecars of a compressed-tensors int8 / int4 weight (a scale of no groups, zero
    points of the wrong shape, a `g_idx` that is no column list, packed words stored as
    floats: those were silently read as other values) made `verify` or `convert
    --dequantize` fail as "a bug in ckpt" (exit 70: a division by zero, a reshape or
    bincount error); the weight is refused by name (exit 4) and nothing is written."""
    src = tmp_path / damage
    variant = "int-quantized-group128-asym" if damage == "empty-scale" else "int4-group32-asym"
    state = write_ct_int_variant(src, variant)
    module = "model.layers.1.mlp.down_proj"
    if damage == "empty-scale":
        state[f"{module}.weight_scale"] = torch.empty(64, 0, dtype=torch.bfloat16)
    elif damage == "zero-point-shape":
        state[f"{module}.weight_zero_point"] = state[f"{module}.weight_zero_point"][:, :3]
    elif damage == "g-idx-2d":
        state[f"{module}.weight_g_idx"] = torch.zeros(16, 16, dtype=torch.int32)
    elif damage == "g-idx-float":
        state[f"{module}.weight_g_idx"] = (torch.arange(256) // 32).float()
    else:  # the words stored as float32: read as int32 they would be other values
        state[f"{module}.weight_packed"] = state[f"{module}.weight_packed"].float()
    hf_shards(
        src,
        [{k: v.contiguous() for k, v in state.items()}],
        json.loads((src / "config.json").read_text()),
    )
    verified = run_ckpt("verify", src)
    assert verified.exit_code in (0, 1), verified.stdout + verified.stderr
    refused = run_ckpt("convert", src, tmp_path / "no", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4, refused.stdout + refused.stderr
    assert module in refused.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("scheme", ["bnb4", "bnb8", "W4A16", "W8A8"])
def test_convert_filter_of_a_packed_weight_brings_its_state(tmp_path: Path, scheme: str) -> None:
    """`convert -k '*.0.*.weight'` of a bitsandbytes model wrote the 4/8-bit codes without
    their `absmax` / `quant_map` / `quant_state` (or `SCB`), and of a compressed-tensors
    `pack-quantized` one the `weight_packed` without its `weight_shape` / `weight_zero_point`:
    codes no loader can read."""
    src = tmp_path / scheme
    if scheme.startswith("bnb"):
        state = write_bitsandbytes(src, int(scheme[-1]))
        module, glob = "model.layers.0.mlp.up_proj", "*.0.*.weight"
    else:
        state = write_compressed_tensors_int(src, scheme)
        module = "model.layers.0.mlp.down_proj"
        glob = "*.0.*.weight_packed" if scheme == "W4A16" else "*.0.*.weight"
    out = tmp_path / "picked"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "-k", glob, "--json")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    want = {n for n in state if n.startswith(module + ".")}
    assert len(want) >= 2
    assert {e["name"] for e in conv.json["result"]["entries"]} == want
    got = load_file(out / "model.safetensors")
    assert set(got) == want and all(torch.equal(got[n], state[n]) for n in want)


@pytest.mark.parametrize(
    ("scheme", "dropped"),
    [
        ("bnb4", "model.layers.0.mlp.up_proj.weight.absmax"),
        ("bnb4", "model.layers.1.mlp.up_proj.weight.quant_map"),
        ("W4A16", "model.layers.0.mlp.down_proj.weight_shape"),
        ("W4A16", "model.layers.1.mlp.down_proj.weight_scale"),
    ],
)
def test_verify_finds_a_packed_weight_without_its_state(
    tmp_path: Path, scheme: str, dropped: str
) -> None:
    """A bitsandbytes model whose `absmax` (or a compressed-tensors int4 one whose
    `weight_shape`) was lost passed `verify` (exit 0): no loader reads the codes without it."""
    src = tmp_path / scheme
    if scheme == "bnb4":
        state = write_bitsandbytes(src, 4)
    else:
        state = write_compressed_tensors_int(src, scheme)
    assert run_ckpt("verify", src).exit_code == 0
    del state[dropped]
    (src / "model.safetensors.index.json").unlink()
    (src / "model-00001-of-00001.safetensors").unlink()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    result = run_ckpt("verify", src, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "missing_scale" and dropped in problem["message"]
    assert "model.safetensors" in problem["message"] or "model.safetensors" in problem["path"]


def test_a_packed_model_without_its_config_is_still_judged(tmp_path: Path) -> None:
    """GPTQ tensors (a `qweight` beside its `qzeros`) with no `config.json` beside them:
    `inspect` showed no quantization at all and `verify` passed a module that had lost its
    `scales` (exit 0), though the tensors alone tell the scheme."""
    src = tmp_path / "gptq"
    state = write_gptq(src)
    (src / "config.json").unlink()
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    assert shown is not None and shown["packed"] == ["model.layers.*.mlp.up_proj"]
    assert "GPTQ/AWQ packed" in shown["label"]
    del state["model.layers.1.mlp.up_proj.scales"]
    hf_shards(src, [state], None)
    result = run_ckpt("verify", src, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "missing_scale"
    assert "model.layers.1.mlp.up_proj.scales" in problem["message"]


@pytest.mark.parametrize("scheme", ["gptq", "bnb4", "bnb8", "W4A16"])
def test_inspect_counts_packed_weights_by_their_logical_parameters(
    tmp_path: Path, scheme: str
) -> None:
    """The first line of `inspect` counted a GPTQ or bitsandbytes model's parameters as its
    floating tensors: the scales and `absmax` in, the packed weights out (a third of the model
    here), where its quantization section gave the logical count."""
    src = tmp_path / scheme
    if scheme == "gptq":
        write_gptq(src)
        logical = 2 * 64 * 32 + 32 + 16 * 32  # two 64x32 up_proj, the norm and lm_head
    elif scheme.startswith("bnb"):
        write_bitsandbytes(src, int(scheme[-1]))
        logical = 2 * 32 * 64 + 64 + 16 * 64
    else:
        write_compressed_tensors_int(src, scheme)
        logical = 2 * 64 * 256 + 64
    report = run_ckpt("inspect", src, "--json").json["result"]
    assert report["quantization"]["parameters"] == logical
    assert report["parameters"] == logical


@pytest.mark.parametrize("scheme", ["fp8", "gptq", "bnb4"])
def test_parameters_are_counted_by_one_rule_with_a_filter_and_in_a_training_folder(
    tmp_path: Path, scheme: str
) -> None:
    """The quantization section counts logical parameters, scales none. The first line of
    `inspect` counted FP8 `weight_scale_inv` as parameters, and so did `--filter` and a
    Trainer checkpoint holding the quantized model for every scheme (their scales and zeros in,
    GPTQ's and bitsandbytes' packed weights out): one rule everywhere now."""
    model = tmp_path / "model"
    if scheme == "fp8":
        full = fp8_source()
        write_fp8_block(model, full)
        logical = sum(t.numel() for t in full.values())
    elif scheme == "gptq":
        write_gptq(model)
        logical = 2 * 64 * 32 + 32 + 16 * 32
    else:
        write_bitsandbytes(model, 4)
        logical = 2 * 32 * 64 + 64 + 16 * 64
    report = run_ckpt("inspect", model, "--json").json["result"]
    assert report["quantization"]["parameters"] == logical
    assert report["parameters"] == logical
    assert run_ckpt("inspect", model, "--filter", "*", "--json").json["result"]["parameters"] == (
        logical
    )
    # the norm alone: a plain floating tensor, its elements
    norm = run_ckpt(
        "inspect", model, "--filter", "*layernorm*", "--filter", "model.norm*", "--json"
    )
    expected_norm = 2 * 48 if scheme == "fp8" else 64 if scheme == "bnb4" else 32
    assert norm.json["result"]["parameters"] == expected_norm
    # the same weights in a Trainer checkpoint (optimizer, scheduler, RNG, trainer_state.json)
    folder = shutil.copytree(model, tmp_path / "out" / "checkpoint-10")
    head = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(head.parameters())
    head(torch.randn(1, 2)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(torch.optim.lr_scheduler.LinearLR(opt).state_dict(), folder / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10, "epoch": 1.0}))
    training = run_ckpt("inspect", folder, "--json").json["result"]
    assert training["training"]["layout"] == "hf-trainer"
    assert training["parameters"] == logical
    assert training["training"]["weights"]["parameters"] == logical
    assert training["state_elements"]["optimizer"] == 2 * (4 + 2) + 2
    chosen = run_ckpt("inspect", folder, "--filter", "model.*", "--json").json["result"]
    assert chosen["parameters"] == logical


def write_compressed_tensors_mx(folder: Path, preset: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Two bfloat16 linears quantized by compressed-tensors' own MX compressors: `MXFP4A16`
    (`mxfp4-pack-quantized`: `weight_packed` uint8 `[out, in/2]`), `MXFP8A16`
    (`mxfp8-quantized`: `weight` float8 `[out, in]`) or `MXFP6A16` (`mxfp6-pack-quantized`:
    `weight_packed` uint8 `[out, in*3/4]`), each with a uint8 E8M0 `weight_scale` per 32
    values. Returns the state written and the scheme (for the compressor's decompress)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    fmt = {
        "MXFP4A16": "mxfp4-pack-quantized",
        "MXFP8A16": "mxfp8-quantized",
        "MXFP6A16": "mxfp6-pack-quantized",
    }[preset]
    qscheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry(fmt)
    gen = torch.Generator().manual_seed(9)
    state: dict[str, torch.Tensor] = {}
    for layer in range(2):
        w = (torch.randn(64, 256, generator=gen) * 0.1).to(torch.bfloat16)
        groups = w.float().reshape(64, -1, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), qscheme.weights)
        packed = compressor.compress({"weight": w, "weight_scale": scale}, qscheme)
        state.update({f"model.layers.{layer}.mlp.down_proj.{k}": v for k, v in packed.items()})
    state["model.norm.weight"] = torch.rand(64, generator=gen).to(torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"g": qscheme}, format=fmt, quantization_status="compressed"
    ).model_dump(mode="json")
    hf_shards(folder, [state], {"torch_dtype": "bfloat16", "quantization_config": config})
    return state, qscheme


@pytest.mark.parametrize(
    ("preset", "scheme"),
    [("MXFP4A16", "mxfp4-ct"), ("MXFP6A16", "mxfp6-ct"), ("MXFP8A16", "mxfp8-ct")],
)
def test_compressed_tensors_mx_formats_match_their_own_decompressor(
    tmp_path: Path, preset: str, scheme: str
) -> None:
    """compressed-tensors MXFP4 / MXFP8 models: `verify` failed a healthy one (MXFP4 as an
    int4 packing without `weight_shape`; MXFP8's E8M0 scales as a wrong FP8 grid and dtype),
    `inspect` misnamed them and `--dequantize` refused them (MXFP6 too: it was kept as
    stored). Now they are MX weights: dequantized bit for bit as compressed-tensors' own
    compressor decompresses them."""
    from compressed_tensors.compressors.base import BaseCompressor

    src = tmp_path / preset
    state, qscheme = write_compressed_tensors_mx(src, preset)
    compressor = BaseCompressor.get_value_from_registry(qscheme_format(src))
    shown = run_ckpt("inspect", src, "--json").json["result"]["quantization"]
    (group,) = shown["schemes"]
    assert group["scheme"] == scheme and group["modules"] == 2, shown
    assert group["example"]["logical_shape"] == [64, 256]
    assert shown["packed"] == [] and shown["parameters"] == 2 * 64 * 256 + 64
    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr

    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out = tmp_path / dtype
        conv = run_ckpt(
            "convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", dtype
        )
        assert conv.exit_code == 0, conv.stdout + conv.stderr
        got = load_file(out / "model.safetensors")
        assert sorted(got) == sorted(
            [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] + ["model.norm.weight"]
        )
        for layer in range(2):
            module = f"model.layers.{layer}.mlp.down_proj"
            mine = {
                k.removeprefix(module + "."): v
                for k, v in state.items()
                if k.startswith(module + ".")
            }
            ref = compressor.decompress(mine, qscheme)["weight"].to(torch_dtype)
            assert got[f"{module}.weight"].dtype == torch_dtype
            assert torch.equal(got[f"{module}.weight"], ref), (dtype, module)
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
    compared = run_ckpt("diff", src, tmp_path / "bf16", "--dequantize", "--atol", "0")
    assert compared.exit_code == 0, compared.stdout + compared.stderr

    # kept as stored without --dequantize: codes and E8M0 exponents never cast
    kept = tmp_path / "kept"
    conv = run_ckpt("convert", src, kept, "--to", "safetensors", "--dtype", "fp16")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    got = load_file(kept / "model.safetensors")
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["model.norm.weight"].dtype == torch.float16

    # a scale cut for another weight is named, and dequantizing it is refused
    name = "model.layers.0.mlp.down_proj.weight_scale"
    state[name] = state[name][:, :4].contiguous()
    save_file(state, src / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    damaged = run_ckpt("verify", src, "--json").json["result"]
    assert ("scale_grid", name) in _problems(damaged)
    refused = run_ckpt("convert", src, tmp_path / "no", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4 and name in refused.stderr
    assert not (tmp_path / "no").exists()

    # a weight without its scale: named, and dequantizing it is refused
    del state[name]
    hf_shards(src, [state], json.loads((src / "config.json").read_text()))
    payload = next(n for n in state if n.startswith("model.layers.0.") and "scale" not in n)
    damaged = run_ckpt("verify", src, "--json").json["result"]
    assert _problems(damaged) == [("missing_scale", payload)], damaged["problems"]
    refused = run_ckpt("convert", src, tmp_path / "no", "--to", "safetensors", "--dequantize")
    assert refused.exit_code == 4 and payload in refused.stderr


def qscheme_format(folder: Path) -> str:
    """The compressed-tensors format the model in `folder` declares."""
    config = json.loads((folder / "config.json").read_text())
    return str(config["quantization_config"]["format"])


@pytest.mark.parametrize("structure", [["x", "y"], [0, 0], [[16], [16]], [True, 16]])
def test_a_hostile_block_structure_is_no_block_size(tmp_path: Path, structure: list) -> None:
    """A compressed-tensors config whose `block_structure` is not two positive integers made
    every command fail as "a bug in ckpt" (exit 70: int('x'), a division by zero). It is
    read as no block size, as a bad `weight_block_size` is: the scales' grid tells it."""
    src = tmp_path / "fp8"
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 32, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=gen) + 0.5
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "block",
                    "block_structure": structure,
                },
            }
        },
    }
    hf_shards(src, [{"a.weight": weight, "a.weight_scale": scale}], {"quantization_config": config})
    shown = run_ckpt("inspect", src, "--json")
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    (group,) = shown.json["result"]["quantization"]["schemes"]
    assert group["label"] == "FP8 block 16x16"
    verified = run_ckpt("verify", src)
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    out = tmp_path / "fp32"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    want = weight.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(load_file(out / "model.safetensors")["a.weight"], want)


def test_a_hostile_num_bits_is_no_crash(tmp_path: Path) -> None:
    """A compressed-tensors config whose `num_bits` is a list made `inspect` of its int4
    model fail as "a bug in ckpt" (exit 70); the parameters are counted at 4 bits."""
    src = tmp_path / "w4a16"
    write_compressed_tensors_int(src, "W4A16")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["g"]["weights"]["num_bits"] = [4]
    (src / "config.json").write_text(json.dumps(config))
    shown = run_ckpt("inspect", src, "--json")
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    assert shown.json["result"]["quantization"]["parameters"] == 2 * 64 * 256 + 64


@pytest.mark.parametrize("dequantize", [True, False])
def test_a_config_dtype_that_is_no_string_is_left_as_it_is(
    tmp_path: Path, dequantize: bool
) -> None:
    """An FP8 model whose `config.json` says `"torch_dtype": ["bfloat16"]` made `convert
    --dtype` fail as "a bug in ckpt" (exit 70) while rewriting the config's dtype; the
    weights are written and that value is left as it was (it names no dtype)."""
    src = tmp_path / "fp8"
    write_fp8_block(src, fp8_source())
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = ["bfloat16"]
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    args = ["--dequantize"] if dequantize else []
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dtype", "fp32", *args)
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == ["bfloat16"]
    assert run_ckpt("verify", out).exit_code == 0


@pytest.mark.parametrize("preset", ["MXFP4A16", "MXFP6A16", "MXFP8A16"])
def test_compressed_tensors_mx_llama_dequantized_equals_what_transformers_loads(
    tmp_path: Path, preset: str
) -> None:
    """A tiny Llama quantized and saved the way compressed-tensors does it
    (`apply_quantization_config`, `ModelCompressor.compress_model`, `save_pretrained`,
    `update_config`): ckpt's dequantized output loads as a plain model whose every tensor
    equals what transformers' own compressed-tensors loader decompresses
    (`run_compressed=False`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, "weight_scale"):
            groups = module.weight.float().reshape(module.weight.shape[0], -1, 32)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    assert compressor is not None
    compressor.compress_model(model)
    src = tmp_path / preset
    model.save_pretrained(src)
    compressor.update_config(src)

    _verified_then_dequantized_like_transformers(src, tmp_path / "bf16")


def test_inspect_names_every_quantized_module_or_says_how_many_more(tmp_path: Path) -> None:
    """`inspect` listed the first six module patterns of a scheme and dropped the rest without
    a word: a Llama's seventh projection (`v_proj`) appeared neither as quantized nor as
    unquantized. It now lists eight, then says how many more (`--json` lists all)."""
    gen = torch.Generator().manual_seed(5)
    projections = ["q", "k", "v", "o", "gate", "up", "down"]
    modules = [f"model.layers.0.p.{p}_proj" for p in projections]
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        state[f"{module}.weight"] = torch.randn(8, 8, generator=gen).to(torch.float8_e4m3fn)
        state[f"{module}.weight_scale"] = torch.tensor([0.01])
    llama = tmp_path / "seven"
    hf_shards(llama, [state], None)
    shown = run_ckpt("inspect", llama)
    assert shown.exit_code == 0, shown.stderr
    for module in modules:
        assert module.replace(".0.", ".*.") in shown.stdout, module

    for extra in ("a", "b", "c"):
        state[f"model.layers.0.p.{extra}.weight"] = state[f"{modules[0]}.weight"].clone()
        state[f"model.layers.0.p.{extra}.weight_scale"] = torch.tensor([0.01])
    ten = tmp_path / "ten"
    hf_shards(ten, [state], None)
    shown = run_ckpt("inspect", ten)
    assert "… 2 more" in shown.stdout, shown.stdout
    listed = run_ckpt("inspect", ten, "--json").json["result"]["quantization"]
    assert len(listed["schemes"][0]["patterns"]) == 10


def test_compressed_tensors_mxfp4_stacked_experts_dequantize_per_expert(tmp_path: Path) -> None:
    """A compressed-tensors MXFP4 `weight_packed` of stacked experts `[E, out, in/2]` (scales
    `[E, out, in/32]`) was recognised as nothing: `verify` said the config declares a
    quantization no tensor has. Each expert is dequantized as compressed-tensors' own
    decompressor dequantizes that expert's `[out, in/2]` weight."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    gen = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (3, 8, 32), generator=gen, dtype=torch.uint8)
    scale = torch.randint(120, 130, (3, 8, 2), generator=gen, dtype=torch.uint8)
    src = tmp_path / "experts"
    config = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    hf_shards(
        src,
        [{"mlp.experts.weight_packed": packed, "mlp.experts.weight_scale": scale}],
        {"quantization_config": config},
    )
    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    out = tmp_path / "fp32"
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    got = load_file(out / "model.safetensors")["mlp.experts.weight"]
    assert list(got.shape) == [3, 8, 64]
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    for expert in range(3):
        state = {"weight_packed": packed[expert], "weight_scale": scale[expert]}
        ref = MXFP4PackedCompressor.decompress(state, scheme)["weight"]
        assert torch.equal(got[expert], ref.float()), expert


def _verified_then_dequantized_like_transformers(src: Path, out: Path) -> None:
    """A compressed-tensors model `src` passes `verify --deep`, and `convert --dequantize`
    into `out` loads bit for bit as transformers' own decompressing load of `src` (bf16)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    verified = run_ckpt("verify", src, "--deep")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    conv = run_ckpt("convert", src, out, "--to", "safetensors", "--dequantize")
    assert conv.exit_code == 0, conv.stdout + conv.stderr
    reference = AutoModelForCausalLM.from_pretrained(
        src,
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(run_compressed=False),
    ).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert sorted(ours) == sorted(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor.view(torch.int16), reference[name].view(torch.int16)), name
