"""Benchmark `ckpt reshard --world-size` of a DeepSpeed ZeRO save. By hand, never in tests.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_reshard_zero.py [--params-m 64] [--stage 2]

A ZeRO save of `--params-m` million parameters (square bf16 Linear layers, AdamW, one step) is
written by DeepSpeed itself under torchrun on 2 ranks (gloo, CPU), then resized to 1 rank by
  - `ckpt reshard RUN OUT --world-size 1` (the ZeRO partitions re-cut as 1 rank saves them;
    DeepSpeed's `load_checkpoint` resumes it with the same config),
  - DeepSpeed's own way: `ds_to_universal.py --inject_missing_state` (a universal checkpoint,
    resumed with `"checkpoint": {"load_universal": true}`), one extract and one merge worker.
Each is a separate process measured with /usr/bin/time -v (wall, peak RSS), the page cache
warm for both; the figures are printed with the largest parameter and the save's size, since
ckpt's peak should follow neither.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

from bench_reshard import ENV, PY, timed, warm

TRAIN = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed, torch
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    out, stage, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    loss = engine(torch.randn(1, width, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=64.0)
    parser.add_argument("--stage", type=int, default=2, choices=(2, 3))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    width = int((args.params_m * 1e6 / args.layers) ** 0.5)
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-zero-"))
    try:
        script = work / "train.py"
        script.write_text(TRAIN)
        run = work / "run"
        torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd = [*torchrun, str(script), str(run), str(args.stage), str(width), str(args.layers)]
        subprocess.run(cmd, env=ENV, check=True, capture_output=True)
        tag = (run / "latest").read_text().strip()
        size = warm(run)
        largest = width * width * 4
        print(
            f"ZeRO-{args.stage} save of {args.layers} x Linear({width}, {width}) "
            f"({args.layers * width * (width + 1) / 1e6:.0f}M parameters) on 2 ranks: "
            f"{size / 2**20:.0f} MiB; largest parameter {largest / 2**20:.0f} MiB (fp32)"
        )
        _, base = timed([PY, "-c", "import torch, ckpt_cli.ops.reshard.zero"])
        print(f"  (a process that only imports torch and ckpt peaks at {base:.0f} MiB)")
        ckpt = [PY, "-m", "ckpt_cli", "reshard", str(run), str(work / "ckpt"), "--world-size", "1"]
        wall, rss = timed(ckpt)
        print(f"  ckpt reshard --world-size 1   {wall:7.1f} s  peak RSS {rss:7.0f} MiB")
        universal = [
            PY,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(run / tag),
            "--output_folder",
            str(work / "universal" / tag),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            # a plain (non-Megatron) engine records no universal_checkpoint_info
            "--inject_missing_state",
        ]
        wall, rss = timed(universal)
        print(f"  ds_to_universal.py (1 worker) {wall:7.1f} s  peak RSS {rss:7.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ENV["DS_ACCELERATOR"] = "cpu"  # DeepSpeed picks its accelerator at import; no GPU here
    main()
