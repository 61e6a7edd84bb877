"""Benchmark `ckpt` split across torchrun ranks against one process. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_distributed.py [WORKDIR] [--gb 1.0] [--ranks 2] [--repeat 2]

On this machine, in one run, for a safetensors model of `--gb` GiB (64 float32 tensors):

1. safetensors -> sharded safetensors (`--max-shard-size 128MB`: raw byte copies, I/O bound);
2. safetensors -> DCP, `--world-size 4`, torch_save serialization (each chunk `torch.save`d);
3. `verify --write-manifest` (sha256 of every shard).

Each is timed as one plain process (`python -m ckpt_cli`) and under
`torchrun --standalone --nproc-per-node 1` and `--nproc-per-node N` (best of `--repeat`,
page cache warm, `sync` before each so write-back of the previous step is not billed).
Prints a Markdown table for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def timed(cmd: list[str]) -> float:
    """Seconds one command takes, started with no dirty pages pending."""
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return seconds


def launcher(ranks: int | None) -> list[str]:
    """`python -m ckpt_cli` (None) or torchrun with `ranks` processes."""
    if ranks is None:
        return [PY, "-m", "ckpt_cli"]
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "ckpt_cli",
    ]


def make_model(path: Path, gb: float) -> None:
    script = f"""
import torch
from safetensors.torch import save_file
n = 64
numel = int({gb} * 2**30) // 4 // n
torch.manual_seed(0)
save_file({{f"layers.{{i}}.weight": torch.randn(numel // 1024, 1024) for i in range(n)}}, {str(path)!r})
"""
    subprocess.run([PY, "-c", script], check=True, env=ENV)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", nargs="?", default="/tmp/ckpt-bench-dist")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "model.safetensors"
    make_model(model, args.gb)
    size = model.stat().st_size
    sharded = work / "sharded"
    subprocess.run(
        [*launcher(None), "convert", str(model), str(sharded), "--to", "safetensors",
         "--max-shard-size", "128MB"],
        check=True, env=ENV, capture_output=True,
    )  # fmt: skip

    cases = {
        "safetensors → sharded safetensors (raw copy)": lambda out: [
            "convert", str(model), str(out), "--to", "safetensors", "--max-shard-size", "128MB"
        ],
        "safetensors → DCP, world size 4 (torch_save)": lambda out: [
            "convert", str(model), str(out), "--to", "dcp", "--world-size", "4"
        ],
        "verify --write-manifest (sha256)": lambda out: [
            "verify", str(sharded), "--write-manifest", "--force"
        ],
    }  # fmt: skip
    runs: list[tuple[str, int | None]] = [
        ("1 process", None),
        ("torchrun, 1 rank", 1),
        (f"torchrun, {args.ranks} ranks", args.ranks),
    ]
    rows = []
    for case, build in cases.items():
        best: dict[str, float] = {}
        for label, ranks in runs:
            times = []
            for _ in range(args.repeat):
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                times.append(timed([*launcher(ranks), *build(out)]))
            best[label] = min(times)
        rows.append((case, best))
    shutil.rmtree(work, ignore_errors=True)

    print(f"\n{size / 2**30:.2f} GiB model, {os.cpu_count()} CPUs, best of {args.repeat}\n")
    header = " | ".join(label for label, _ in runs)
    print(f"| operation | {header} | {args.ranks} ranks vs 1 process |")
    print("|---|" + "---|" * (len(runs) + 1))
    for case, best in rows:
        cells = " | ".join(
            f"{best[label]:.1f} s ({size / best[label] / 2**20:.0f} MiB/s)" for label, _ in runs
        )
        ratio = best[runs[0][0]] / best[runs[-1][0]]
        print(f"| {case} | {cells} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
