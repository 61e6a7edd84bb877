"""Metadata paths against the raw parse: how close `inspect` / `verify` get to the limit.

The limit for a safetensors checkpoint is reading each header (8-byte length + `json.loads`):
nothing can tell you less work than that. This script builds sharded checkpoints whose data
is sparse (the files have their full size but take no disk), then compares, in one run:

1. in-process: `ckpt_cli.inspect` / `ckpt_cli.verify` against a raw header loop and against
   `safe_open(framework="numpy")` over every shard (what a user would write);
2. as processes: `ckpt inspect --json`, `ckpt inspect`, `ckpt verify` against `python -c` running
   the raw loop (both pay the interpreter start; CPU seconds, user + system), in interleaved
   rounds: best and median of the rounds (#30's target: 3x the raw loop at 20,000 tensors);
3. `ckpt --help` and `ckpt latest --help` CPU against `python -c "import typer"`.

Sizes: 200 shards x 100 tensors (20,000), 56 shards of a 4 GB model, and a tensor-count curve
(1k, 20k, 100k). Prints one table of seconds and ratios.

Run by hand (never in tests):  PYTHONPATH=. python bench/bench_metadata.py [--dir D] [--repeat 3]
[--cases t20k]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RAW_LOOP = """
import json, struct, sys, glob
for path in sorted(glob.glob(sys.argv[1] + '/*.safetensors')):
    with open(path, 'rb') as fh:
        (n,) = struct.unpack('<Q', fh.read(8))
        json.loads(fh.read(n))
"""


def write_sparse_shard(path: Path, tensors: dict[str, list[int]]) -> int:
    """A safetensors file of F32 tensors (name -> shape) whose data region is a hole."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        nbytes = 4
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return offset


def build(root: Path, name: str, shards: int, per_shard: int, shape: list[int]) -> Path:
    folder = root / name
    if folder.exists():
        return folder
    staging = root / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(1, shards + 1):
        file = f"model-{s:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{s}.block{i}.weight": shape for i in range(per_shard)}
        total += write_sparse_shard(staging / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index))
    staging.rename(folder)
    return folder


def best_wall(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


#: compiled bytecode for the child processes, kept between runs: an installed ckpt has its
#: `.pyc` files, but a shell with PYTHONDONTWRITEBYTECODE=1 (this project's sandbox) would
#: recompile every module from source in every process (~0.15 s CPU of a `ckpt inspect`)
PYCACHE = Path(tempfile.gettempdir()) / "ckpt-bench-pycache"


def child_env() -> dict[str, str]:
    """The environment of the measured processes: repo on the path, bytecode cached."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    return env


def best_cpu(argv: list[str], repeat: int) -> float:
    """Least user+system CPU seconds of a child process over `repeat` runs (after one warm-up
    run that fills the bytecode cache and the page cache)."""
    env = child_env()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    times = []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(times)


def interleaved_cpu(argvs: dict[str, list[str]], rounds: int) -> dict[str, list[float]]:
    """User+system CPU seconds of each child process, over `rounds` rounds that run every
    command once in turn (so a burst of load from elsewhere hits all of them alike), after
    one warm-up round that fills the bytecode cache and the page cache."""
    env = child_env()
    times: dict[str, list[float]] = {what: [] for what in argvs}
    for round_ in range(rounds + 1):
        for what, argv in argvs.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if round_:
                cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                times[what].append(cpu)
    return times


def raw_loop(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            json.loads(fh.read(n))


def safe_open_loop(folder: Path) -> None:
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (not a mapping)
                f.get_slice(key).get_shape()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (kept)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (best and median)")
    parser.add_argument(
        "--cases", nargs="*", help="only these cases: t20k gb4 t1k t100k (default: all)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-meta-"))
    root.mkdir(parents=True, exist_ok=True)

    import ckpt_cli

    py = sys.executable
    ckpt = [py, "-m", "ckpt_cli"]
    cases = {
        "200 shards, 20k tensors": build(root, "t20k", 200, 100, [64]),
        "56 shards, 4 GB": build(root, "gb4", 56, 10, [1024, 1792]),
        "10 shards, 1k tensors": build(root, "t1k", 10, 100, [64]),
        "500 shards, 100k tensors": build(root, "t100k", 500, 200, [64]),
    }
    if args.cases:
        cases = {label: f for label, f in cases.items() if f.name in args.cases}
    rows: list[tuple[str, str, float, float]] = []
    medians: list[tuple[str, str, float, float]] = []
    for label, folder in cases.items():
        raw = best_wall(lambda f=folder: raw_loop(f), args.repeat)
        lib = best_wall(lambda f=folder: safe_open_loop(f), args.repeat)
        ins = best_wall(lambda f=folder: ckpt_cli.inspect(str(f)), args.repeat)
        ver = best_wall(lambda f=folder: ckpt_cli.verify(str(f)), args.repeat)
        rows += [
            (label, "raw header loop (in-process)", raw, 1.0),
            (label, "safe_open(numpy) loop", lib, lib / raw),
            (label, "ckpt_cli.inspect", ins, ins / raw),
            (label, "ckpt_cli.verify", ver, ver / raw),
        ]
        argvs = {
            "python -c raw loop (CPU)": [py, "-c", RAW_LOOP, str(folder)],
            "ckpt inspect --json (CPU)": [*ckpt, "inspect", str(folder), "--json"],
            "ckpt inspect (CPU)": [*ckpt, "inspect", str(folder)],
            "ckpt verify (CPU)": [*ckpt, "verify", str(folder)],
        }
        cpu = interleaved_cpu(argvs, args.repeat)
        raw_p = min(cpu["python -c raw loop (CPU)"])
        raw_med = statistics.median(cpu["python -c raw loop (CPU)"])
        for what, seconds in cpu.items():
            rows.append((label, what, min(seconds), min(seconds) / raw_p))
            med = statistics.median(seconds)
            medians.append((label, what, med, med / raw_med))
    base = best_cpu([py, "-c", "import typer"], args.repeat)
    for what, argv in (
        ("ckpt --help (CPU)", [*ckpt, "--help"]),
        ("ckpt --version (no-op, CPU)", [*ckpt, "--version"]),
        ("ckpt latest --help (CPU)", [*ckpt, "latest", "--help"]),
    ):
        cpu = best_cpu(argv, args.repeat)
        rows.append(("start-up", what, cpu, cpu / base))
    rows.append(("start-up", 'python -c "import typer" (CPU)', base, 1.0))
    rows.append(("start-up", "python -c pass (CPU)", best_cpu([py, "-c", "pass"], args.repeat), 0))

    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} CPUs; best of {args.repeat}")
    print("processes, median of the interleaved rounds (ratio to the raw loop's median):")
    for label, what, seconds, ratio in medians:
        print(f"{label:28} {what:34} {seconds:8.3f} {ratio:6.1f}x")
    print("best of the rounds:")
    print("targets: 3x the raw loop (200 shards / 20k), 1.5x (56 shards / 4 GB), start-up 0.2 s")
    print(f"{'case':28} {'what':34} {'seconds':>8} {'ratio':>7}")
    for label, what, seconds, ratio in rows:
        shown = f"{ratio:6.1f}x" if ratio else "      -"
        print(f"{label:28} {what:34} {seconds:8.3f} {shown}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
