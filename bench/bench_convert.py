"""Benchmark `ckpt convert` against what users would otherwise run. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_convert.py [WORKDIR] [--gb 1.0]

Measures, on this machine, in one run (wall time and peak RSS via /usr/bin/time):

1. DCP -> sharded safetensors: `ckpt convert --to safetensors --max-shard-size 500MB` against
   `dcp_to_torch_save` followed by `torch.load` + `huggingface_hub.save_torch_state_dict`.
2. safetensors -> safetensors with a new shard size: `ckpt convert` against `cp -r` of the
   same bytes (best of 3 each, page cache warm for both).
3. Bounded memory: the same largest tensor in a model 1x and 4x as large; peak RSS follows the
   largest tensor, not the model.
4. Raw copy strategies for one large byte range: buffered pread/write, `os.copy_file_range`,
   `os.sendfile` (best of 3 each).

Prints a Markdown table of ratios for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

from timing import ENV, PY, measure


def make_model(path: Path, gb: float, largest_mb: int) -> None:
    """A DCP checkpoint (torch_save serialization) of float32 tensors, the largest given."""
    script = f"""
import torch, torch.distributed.checkpoint as dcp
total, largest = int({gb} * 2**30), {largest_mb} * 2**20
sizes, left = [], total
while left > 0:
    n = min(largest, left); sizes.append(n); left -= n
    if left > 0:
        m = min(largest // 4, left); sizes.append(m); left -= m
gen = torch.Generator().manual_seed(0)
state = {{f"model.layers.{{i}}.w": torch.randn(n // 4 // 1024, 1024, generator=gen) for i, n in enumerate(sizes)}}
dcp.save(state, checkpoint_id="{path}", no_dist=True)
"""
    subprocess.run([PY, "-c", script], env=ENV, check=True, stderr=subprocess.DEVNULL)


BASELINE = """
import os, sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from huggingface_hub import save_torch_state_dict
src, tmp, out = sys.argv[1:4]
dcp_to_torch_save(src, tmp)
state = torch.load(tmp, weights_only=True)
os.makedirs(out, exist_ok=True)
save_torch_state_dict(state, out, max_shard_size="500MB")
"""


def copy_strategies(path: Path, work: Path) -> dict[str, float]:
    """GB/s of copying one file's bytes (after a 4 KiB header) with each strategy."""
    size = path.stat().st_size
    block = 8 << 20

    def buffered(dst: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        with open(dst, "wb", buffering=0) as out:
            done = 4096
            while done < size:
                data = os.pread(fd, min(block, size - done), done)
                out.write(data)
                done += len(data)
        os.close(fd)

    def copy_file_range(dst: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        with open(dst, "wb") as out:
            done = 4096
            while done < size:
                done += os.copy_file_range(fd, out.fileno(), min(1 << 30, size - done), done)
        os.close(fd)

    def sendfile(dst: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        with open(dst, "wb") as out:
            done = 4096
            while done < size:
                done += os.sendfile(out.fileno(), fd, done, min(1 << 30, size - done))
        os.close(fd)

    results: dict[str, float] = {}
    for fn in (buffered, copy_file_range, sendfile):
        best = float("inf")
        for _ in range(3):
            dst = work / f"copy-{fn.__name__}"
            start = time.perf_counter()
            fn(dst)
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            best = min(best, time.perf_counter() - start)
            dst.unlink()
        results[fn.__name__] = size / best / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", nargs="?", type=Path, default=Path("build/bench-convert"))
    parser.add_argument("--gb", type=float, default=2.0)
    args = parser.parse_args()
    work: Path = args.workdir.absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = [PY, "-m", "ckpt_cli"]
    dcp_src = work / "dcp"
    make_model(dcp_src, args.gb, largest_mb=64)
    rows = []

    # 1. DCP -> sharded safetensors
    ours = measure(
        [
            *ckpt,
            "convert",
            str(dcp_src),
            str(work / "hf"),
            "--to",
            "safetensors",
            "--max-shard-size",
            "500MB",
        ]
    )
    theirs = measure(
        [PY, "-c", BASELINE, str(dcp_src), str(work / "tmp.pt"), str(work / "hf-base")]
    )
    rows.append(
        (
            "DCP → sharded safetensors",
            f"{ours[0]:.1f} s, {ours[1]:.0f} MiB",
            f"dcp_to_torch_save + save_torch_state_dict: {theirs[0]:.1f} s, {theirs[1]:.0f} MiB",
            f"{theirs[0] / ours[0]:.2f}× faster, {ours[1] / theirs[1]:.2f}× the peak RSS",
        )
    )
    (work / "tmp.pt").unlink()
    shutil.rmtree(work / "hf-base")

    # 2. safetensors -> safetensors, new shard size, against cp of the same bytes
    nbytes = sum(p.stat().st_size for p in (work / "hf").iterdir())
    best_ours = best_cp = best_cp_sync = float("inf")
    rss = 0.0
    for i in range(3):
        reshard = ["convert", str(work / "hf"), str(work / f"re{i}"), "--to", "safetensors"]
        t, r = measure([*ckpt, *reshard, "--max-shard-size", "200MB"])
        best_ours, rss = min(best_ours, t), max(rss, r)
        shutil.rmtree(work / f"re{i}")
        t, _ = measure(["cp", "-r", str(work / "hf"), str(work / f"cp{i}")])
        best_cp = min(best_cp, t)
        shutil.rmtree(work / f"cp{i}")
        # ckpt's output is on disk when it returns (fsync); cp's only once synced
        t, _ = measure(["sh", "-c", f"cp -r '{work / 'hf'}' '{work / f'cs{i}'}' && sync"])
        best_cp_sync = min(best_cp_sync, t)
        shutil.rmtree(work / f"cs{i}")
    rows.append(
        (
            "safetensors → safetensors (new shard size)",
            f"{nbytes / best_ours / 1e9:.2f} GB/s, {rss:.0f} MiB",
            f"cp -r: {nbytes / best_cp / 1e9:.2f} GB/s; cp -r && sync: "
            f"{nbytes / best_cp_sync / 1e9:.2f} GB/s",
            f"{best_cp / best_ours:.2f}× cp, {best_cp_sync / best_ours:.2f}× cp + sync",
        )
    )

    # 3. bounded memory: the same largest tensor (64 MiB), models of 1x and 4x the size
    idle = measure([PY, "-c", "import torch, ckpt_cli.ops.convert.run"])[1]
    small = work / "small"
    make_model(small, args.gb / 4, largest_mb=64)
    rss_small = measure([*ckpt, "convert", str(small), str(work / "s-out"), "--to", "safetensors"])[
        1
    ]
    rss_big = ours[1]
    rows.append(
        (
            "bounded memory (largest tensor 64 MiB)",
            f"model {args.gb / 4:.2f} GB: {rss_small:.0f} MiB; model {args.gb:.2f} GB: {rss_big:.0f} MiB",
            f"python + torch + ckpt imported: {idle:.0f} MiB",
            f"above that: {rss_small - idle:.0f} MiB vs {rss_big - idle:.0f} MiB for 4× the model",
        )
    )

    # 4. raw copy strategies
    shard = max((work / "hf").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    speeds = copy_strategies(shard, work)
    rows.append(
        (
            "raw copy of one shard (GB/s)",
            ", ".join(f"{k} {v:.2f}" for k, v in speeds.items()),
            "",
            "",
        )
    )

    print("| case | ckpt | baseline | ratio |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
