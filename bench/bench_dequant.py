"""Benchmark `ckpt convert --dequantize` against torch's own reader. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_dequant.py [WORKDIR] [--mb 256]

Builds a DeepSeek-style block-FP8 checkpoint (`weight` F8_E4M3 + `weight_scale_inv` F32,
128x128 blocks, `config.json` with `quantization_config`) of about `--mb` MB of FP8 weights in
two shards, then does the same work two ways, each in a fresh process, timed with
/usr/bin/time (wall time, peak RSS):

1. `ckpt convert SRC DEST --to safetensors --dequantize --dtype bf16`;
2. torch's `QuantizedHuggingFaceStorageReader` through `dcp.load` into a bf16 state dict,
   then `safetensors.torch.save_file` (what a user writes with torch alone).

Both outputs are compared bit for bit. An MXFP4 (gpt-oss layout) checkpoint of the same size is
dequantized by ckpt alone (torch 2.13's reader plans MXFP4 reads from the stored chunk sizes and
fills one value per group through `dcp.load`, so there is no torch baseline to time).
Prints a Markdown table for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from timing import PY, measure

TORCH_READER = r"""
import sys, json, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from safetensors.torch import save_file
src, out = sys.argv[1], sys.argv[2]
index = json.load(open(f"{src}/model.safetensors.index.json"))["weight_map"]
shapes = json.load(open(f"{src}/shapes.json"))
state = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes.items()}
dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(src, target_dtype=torch.bfloat16), no_dist=True)
save_file(state, out)
"""


def build_fp8(folder: Path, mb: int) -> int:
    """Block-FP8 shards of about `mb` MB; returns the FP8 bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    rows, cols = 2048, 4096
    count = max(2, mb * (1 << 20) // (rows * cols))
    gen = torch.Generator().manual_seed(0)
    weight_map, shapes, shards = {}, {}, [{}, {}]
    for i in range(count):
        raw = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
        raw[(raw & 0x7F) == 0x7F] = 0  # E4M3FN's NaN encodings
        name = f"model.layers.{i}.mlp.down_proj"
        shard = shards[i % 2]
        shard[f"{name}.weight"] = raw.view(torch.float8_e4m3fn)
        shard[f"{name}.weight_scale_inv"] = (
            torch.rand(rows // 128, cols // 128, generator=gen) * 1e-3
        )
        shapes[f"{name}.weight"] = [rows, cols]
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-00002.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / "shapes.json").write_text(json.dumps(shapes))
    config = {
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "fmt": "e4m3",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return count * rows * cols


def build_mxfp4(folder: Path, mb: int) -> int:
    """gpt-oss-layout MXFP4 experts of about `mb` MB of packed blocks."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    experts, rows, groups = 8, 2048, 64  # in = 64 groups x 32 = 2048
    count = max(1, mb * (1 << 20) // (experts * rows * groups * 16))
    gen = torch.Generator().manual_seed(1)
    state = {}
    for i in range(count):
        name = f"model.layers.{i}.mlp.experts.down_proj"
        state[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=gen
        )
        state[f"{name}_scales"] = torch.randint(
            110, 130, (experts, rows, groups), dtype=torch.uint8, generator=gen
        )
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(
        json.dumps({"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}})
    )
    return sum(t.numel() for n, t in state.items() if n.endswith("_blocks"))


def same(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        return set(fb.keys()) <= set(fa.keys()) and all(
            torch.equal(fa.get_tensor(k).view(torch.int16), fb.get_tensor(k).view(torch.int16))
            for k in fb.keys()  # noqa: SIM118 - safe_open has no __iter__
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", nargs="?", default="/tmp/ckpt-bench-dequant")
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    fp8 = work / "fp8"
    fp8_bytes = build_fp8(fp8, args.mb)
    ckpt_s, ckpt_rss = measure(
        [
            PY,
            "-m",
            "ckpt_cli",
            "convert",
            str(fp8),
            str(work / "ckpt-out"),
            "--to",
            "safetensors",
            "--dequantize",
            "--dtype",
            "bf16",
        ]
    )
    torch_s, torch_rss = measure(
        [PY, "-c", TORCH_READER, str(fp8), str(work / "torch.safetensors")]
    )
    identical = same(work / "ckpt-out" / "model.safetensors", work / "torch.safetensors")

    mx = work / "mxfp4"
    mx_bytes = build_mxfp4(mx, args.mb)
    mx_s, mx_rss = measure(
        [
            PY,
            "-m",
            "ckpt_cli",
            "convert",
            str(mx),
            str(work / "mx-out"),
            "--to",
            "safetensors",
            "--dequantize",
        ]
    )
    mib = 1 << 20
    print(
        "| case | ckpt convert --dequantize | torch QuantizedHuggingFaceStorageReader + save_file | ratio |"
    )
    print("|---|---|---|---|")
    print(
        f"| block FP8, {fp8_bytes / mib:.0f} MiB FP8 -> {2 * fp8_bytes / mib:.0f} MiB bf16 | "
        f"{ckpt_s:.2f} s ({fp8_bytes / mib / ckpt_s:.0f} MiB/s of FP8), {ckpt_rss:.0f} MiB peak | "
        f"{torch_s:.2f} s, {torch_rss:.0f} MiB peak | {torch_s / ckpt_s:.2f}x faster, "
        f"{ckpt_rss / torch_rss:.2f}x the peak RSS; bit-identical: {identical} |"
    )
    print(
        f"| MXFP4, {mx_bytes / mib:.0f} MiB blocks -> {4 * 2 * mx_bytes / mib:.0f} MiB bf16 | "
        f"{mx_s:.2f} s ({mx_bytes / mib / mx_s:.0f} MiB/s of blocks), {mx_rss:.0f} MiB peak | - | - |"
    )


if __name__ == "__main__":
    main()
