"""Benchmark: `ckpt inspect` of a torch.save file against loading it with torch.

Builds (once, under a temporary folder) a torch.save state dict of `--mib` MiB of float32
tensors, then runs each variant as a fresh process and reports wall time and peak RSS:

* `import torch` alone (the floor every torch-reading tool pays);
* `torch.load(path, weights_only=True)`: what people run to see what is inside;
* `torch.load(path, weights_only=True, mmap=True)`;
* `ckpt inspect PATH --json` end to end.

Usage: python bench/torch_inspect.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in MiB) of one fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    pid = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL).pid
    _, status, usage = os.wait4(pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{args} failed ({status})")
    return elapsed, usage.ru_maxrss // 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        path = Path(tmp) / "model.pt"
        count = max(1, opts.mib // 16)
        # built in a child so this process stays small (children inherit its RSS at fork)
        build = (
            "import torch; torch.save({f'layers.{i}.weight': torch.randn(2048, 2048) "
            f"for i in range({count})}}, {str(path)!r})"
        )
        subprocess.run([sys.executable, "-c", build], check=True)
        py = sys.executable
        variants = {
            "import torch": [py, "-c", "import torch"],
            "torch.load": [py, "-c", f"import torch; torch.load({str(path)!r}, weights_only=True)"],
            "torch.load mmap": [
                py,
                "-c",
                f"import torch; torch.load({str(path)!r}, weights_only=True, mmap=True)",
            ],
            "ckpt inspect": [py, "-m", "ckpt_cli", "inspect", str(path), "--json"],
        }
        results = {
            name: min((run(cmd) for _ in range(3)), key=lambda r: r[0])
            for name, cmd in variants.items()
        }
        size = path.stat().st_size / (1 << 20)
    print(f"torch.save file: {size:.0f} MiB, {count} tensors (best of 3, fresh processes)")
    base_rss = results["torch.load"][1]
    for name, (seconds, rss) in results.items():
        print(
            f"  {name:<16} {seconds:6.2f} s  peak RSS {rss:6d} MiB  ({rss / base_rss:.2f}x torch.load)"
        )


if __name__ == "__main__":
    main()
