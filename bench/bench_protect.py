"""`ckpt protect` / `ckpt repair` throughput against `sha256sum` and `cp`, and parity overhead.

Builds a sharded safetensors checkpoint of random tensors (default 1 GiB in 8 shards), then
times, on the same files (page cache warm for every tool, one run each after a warm-up read):

* `sha256sum` of every shard (what a checksum manifest costs) and `cp -r` of the folder;
* `ckpt protect --parity K` (parity written into SRC/.ckpt-parity/);
* `ckpt repair` after deleting one shard (rebuild of one lost shard), and after deleting K.

    python bench/bench_protect.py [--gib 1] [--shards 8] [--parity 2] [--block-size 1MiB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _build(folder: Path, gib: float, shards: int) -> int:
    import torch
    from safetensors.torch import save_file

    total = int(gib * (1 << 30))
    per = total // shards
    rows = per // (4 * 1024)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layer{i}.weight": torch.randn(rows, 1024, generator=gen)}, folder / name)
    return sum(p.stat().st_size for p in folder.iterdir())


def _timed(cmd: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--parity", type=int, default=2)
    parser.add_argument("--block-size", default="1MiB")
    args = parser.parse_args()
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    with tempfile.TemporaryDirectory(prefix="bench-protect-") as tmp:
        src = Path(tmp) / "model"
        size = _build(src, args.gib, args.shards)
        shards = sorted(src.glob("*.safetensors"))
        mb = size / 1e6
        _timed(["cat", *map(str, shards)])  # warm the page cache for every tool alike
        t_sha = _timed(["sha256sum", *map(str, shards)])
        t_cp = _timed(["cp", "-r", str(src), str(Path(tmp) / "copy")])
        shutil.rmtree(Path(tmp) / "copy")
        t_protect = _timed(
            [
                *ckpt,
                "protect",
                str(src),
                "--parity",
                str(args.parity),
                "--block-size",
                args.block_size,
            ]
        )
        parity = sum(p.stat().st_size for p in (src / ".ckpt-parity").iterdir())
        shard_mb = shards[0].stat().st_size / 1e6
        shards[0].unlink()
        t_repair1 = _timed([*ckpt, "repair", str(src)])
        for shard in shards[: args.parity]:
            shard.unlink()
        t_repairk = _timed([*ckpt, "repair", str(src)])
        t_check = _timed([*ckpt, "repair", str(src), "--dry-run"])
    print(
        f"{mb:.0f} MB in {args.shards} shards, K={args.parity}, blocks {args.block_size}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"parity: {parity / 1e6:.0f} MB = {parity / size:.1%} of the checkpoint "
        f"(K / W = {args.parity}/{args.shards} = {args.parity / args.shards:.1%})"
    )
    rows = [
        ("sha256sum (all shards)", t_sha),
        ("cp -r", t_cp),
        (f"ckpt protect --parity {args.parity}", t_protect),
        ("ckpt repair --dry-run (check every block)", t_check),
        (f"ckpt repair: 1 lost shard ({shard_mb:.0f} MB)", t_repair1),
        (f"ckpt repair: {args.parity} lost shards", t_repairk),
    ]
    for name, seconds in rows:
        print(
            f"{name:44s} {seconds:7.2f} s  {mb / seconds:7.0f} MB/s  "
            f"x{seconds / t_sha:5.2f} sha256sum"
        )


if __name__ == "__main__":
    main()
