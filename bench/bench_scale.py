"""The scale curve: inspect / verify / convert / reshard time and peak RSS against model size
and tensor count, on checkpoints generated on the fly.

Sources are sharded safetensors checkpoints (F32 tensors, an index, shards of at most ~1 GB)
whose data regions are holes: each file has its full size, takes no disk, and reads back as
zeros at page-cache speed, so a 16 GB source costs nothing to build. Metadata commands read the
headers only; `convert --to dcp` and `reshard --max-shard-size` really read and write every
byte (the outputs are real files, deleted after each run: a 16 GB point needs 16 GB free).

Two curves, each command a fresh `python -m ckpt_cli` process (wall seconds, peak RSS of
that process from `wait4`):
- size: 0.25, 1, 4, 16 GB at 1,000 tensors;
- count: 1k, 20k, 100k tensors at 0.25 GB.

Run by hand (never in tests):
    PYTHONPATH=. python bench/bench_scale.py [--sizes 0.25,1,4,16] [--counts 1000,20000,100000]
        [--dir D] [--data-ops-max-gb 16] [--data-ops-max-tensors 100000] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# a sibling script, not a package
from bench_metadata import child_env, write_sparse_shard

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


def build(root: Path, size_gb: float, tensors: int) -> Path:
    """A sparse sharded safetensors checkpoint of `tensors` F32 tensors, `size_gb` GB in all."""
    folder = root / f"src-{size_gb:g}GB-{tensors}"
    if folder.exists():
        return folder
    staging = root / f".{folder.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    per_tensor = max(1, int(size_gb * GB / 4 / tensors))  # elements
    shards = max(math.ceil(size_gb), math.ceil(tensors / 1000))
    per_shard = math.ceil(tensors / shards)
    weight_map: dict[str, str] = {}
    total = 0
    done = 0
    for s in range(1, shards + 1):
        count = min(per_shard, tensors - done)
        if count <= 0:
            break
        file = f"model-{s:05d}-of-{shards:05d}.safetensors"
        names = {f"model.layers.{done + i}.weight": [per_tensor] for i in range(count)}
        done += count
        total += write_sparse_shard(staging / file, names)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index))
    staging.rename(folder)
    return folder


def run(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one fresh process; exits on failure."""
    env = child_env()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({status}): {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss // 1024


def measure(src: Path, scratch: Path, size_gb: float, data_ops: bool) -> dict[str, tuple]:
    """Each command once on `src` (data commands only when `data_ops`)."""
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    out: dict[str, tuple] = {
        "inspect": run([*ckpt, "inspect", str(src), "--json"]),
        "verify": run([*ckpt, "verify", str(src), "--json"]),
    }
    if data_ops:
        for name, argv in (
            ("convert", [*ckpt, "convert", str(src), str(scratch / "dcp"), "--to", "dcp"]),
            (
                "reshard",
                [*ckpt, "reshard", str(src), str(scratch / "resharded"), "--max-shard-size", "2GB"],
            ),
        ):
            out[name] = run(argv)
            shutil.rmtree(scratch / ("dcp" if name == "convert" else "resharded"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.25,1,4,16", help="GB, comma-separated")
    parser.add_argument("--counts", default="1000,20000,100000", help="tensor counts")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (sources kept)")
    parser.add_argument(
        "--data-ops-max-gb",
        type=float,
        default=16.0,
        help="run convert/reshard only up to this size (they write real bytes)",
    )
    parser.add_argument(
        "--data-ops-max-tensors",
        type=int,
        default=100_000,
        help="run convert/reshard only up to this tensor count",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    scratch = root / "out"
    scratch.mkdir(exist_ok=True)
    points = [(float(s), 1000) for s in args.sizes.split(",") if s]
    points += [(0.25, int(c)) for c in args.counts.split(",") if c and int(c) != 1000]
    load_before = os.getloadavg()[0]
    rows = []
    for size_gb, tensors in points:
        src = build(root, size_gb, tensors)
        data_ops = size_gb <= args.data_ops_max_gb and tensors <= args.data_ops_max_tensors
        results = measure(src, scratch, size_gb, data_ops)
        rows.append((size_gb, tensors, results))
        cells = "  ".join(
            f"{op} {wall:6.2f}s ({cpu:5.2f} CPU) {rss:5d}MiB"
            for op, (wall, cpu, rss) in results.items()
        )
        print(f"{size_gb:6g} GB {tensors:7d} tensors  {cells}", flush=True)
    load_after = os.getloadavg()[0]
    print(
        f"\nload average {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} "
        "CPUs; one run per point; wall s (user+system CPU s) / peak RSS MiB of each `ckpt` process"
    )
    if args.markdown:
        ops = ("inspect", "verify", "convert", "reshard")
        print("\n| size | tensors | " + " | ".join(ops) + " |")
        print("|---|---|" + "---|" * len(ops))
        for size_gb, tensors, results in rows:
            cells = [
                f"{results[op][0]:.1f} s ({results[op][1]:.1f}) / {results[op][2]} MiB"
                if op in results
                else "-"
                for op in ops
            ]
            print(f"| {size_gb:g} GB | {tensors:,} | " + " | ".join(cells) + " |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
