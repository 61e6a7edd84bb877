"""Peak memory of the DCP data commands against torch's own load + save. By hand, never in tests.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_memory.py [--big-mb 256] [--small 20000]

1. A DCP (`dcp.save`, one process) whose largest tensor dominates (`--big-mb` of float32 plus
   a few small ones): `ckpt reshard --world-size 1`, `convert --to dcp`, `diff` against itself
   and `verify --deep`, each a separate process whose peak RSS comes from `getrusage` of the
   child. The target is import + one source chunk + one output chunk: the report prints the
   peak above a process that only imports ckpt and torch, as a multiple of the largest tensor.
   Baseline: `dcp.load` of the whole checkpoint + `dcp.save` (what a user script does).
2. A DCP of `--small` tiny entries: the same commands; memory above import should stay flat
   (not grow with the entry count), printed in MiB.
3. The same at a quarter of `--small` entries: the growth per added entry (KiB), what the
   per-entry records (manifest, plan, write layout, report) cost
   (`tests/test_memory_many_entries.py` bounds it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IMPORT_ONLY = "import ckpt_cli.cli.app, torch, torch.distributed.checkpoint"
TORCH_BASELINE = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.simplefilter("ignore")
md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
         if hasattr(v, "size")}
dcp.load(state, checkpoint_id=sys.argv[1], no_dist=True)
dcp.save(state, checkpoint_id=sys.argv[2], no_dist=True)
"""


def peak_mib(argv: list[str]) -> float:
    """Peak RSS (MiB) of `argv`, run under a fresh parent so RUSAGE_CHILDREN is its own."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True
    )
    return int(proc.stdout.split()[-1]) / 1024


def ckpt(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "ckpt_cli", *map(str, args)]


def save(path: Path, state: dict[str, object]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def measure(src: Path, work: Path, label: str, scale_mib: float | None) -> dict[str, float]:
    base = peak_mib([sys.executable, "-c", IMPORT_ONLY])
    runs = {
        "verify --deep": ckpt("verify", src, "--deep"),
        "diff A A": ckpt("diff", src, src),
        "convert --to dcp": ckpt("convert", src, work / f"{label}-conv", "--to", "dcp"),
        "reshard --world-size 1": ckpt(
            "reshard", src, work / f"{label}-re", "--world-size", "1", "--rank-state", "keep"
        ),
        "dcp.load + dcp.save": [
            sys.executable,
            "-c",
            TORCH_BASELINE,
            str(src),
            str(work / f"{label}-t"),
        ],
    }
    print(f"\n{label}: import-only peak {base:.0f} MiB")
    peaks = {}
    for name, argv in runs.items():
        peak = peaks[name] = peak_mib(argv)
        above = peak - base
        ratio = f"  = {above / scale_mib:.2f}x the largest tensor" if scale_mib else ""
        print(f"  {name:<24} peak {peak:7.0f} MiB, {above:7.0f} MiB above import{ratio}")
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--big-mb", type=int, default=256)
    parser.add_argument("--small", type=int, default=20000)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-mem-") as tmp:
        work = Path(tmp)
        n = args.big_mb * (1 << 20) // 4
        rows = max(1, n // 1024)
        big = {"big": torch.randn(rows, 1024), "w": torch.randn(64, 64), "step": 3}
        save(work / "big", big)
        del big
        measure(work / "big", work, "largest tensor dominates", rows * 1024 * 4 / (1 << 20))
        few = args.small // 4
        peaks = []
        for count in (few, args.small):
            small = {f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}
            save(work / f"small{count}", small)
            del small
            peaks.append(measure(work / f"small{count}", work, f"{count} small entries", None))
        print(f"\ngrowth per added entry ({few} -> {args.small} entries):")
        for name in peaks[0]:
            kib = (peaks[1][name] - peaks[0][name]) * 1024 / (args.small - few)
            print(f"  {name:<24} {kib:6.1f} KiB")


if __name__ == "__main__":
    main()
