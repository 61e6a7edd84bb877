"""Benchmark `ckpt verify --checksums` against `sha256sum` and `cat > /dev/null` (#18).

Targets from the issue: sha256 at >= 2 GB/s on 2 cores, blake3 / xxh3 within 1.2x of the time
`cat FILES > /dev/null` takes on the same warm data. The data is a safetensors checkpoint of
`--gb` GB of random bytes in 128 MiB shards, read once beforehand so every side hashes from the
page cache (the comparison is of hashing throughput, not of the disk).

Each round runs every candidate once, interleaved (so a burst of load on a shared machine hits
all of them alike); the medians over `--rounds` rounds are compared. Candidates:

* `cat` one process over all files, and `cat` as 2 parallel processes (`xargs -P2`);
* `sha256sum` as 2 parallel processes (`xargs -P2`, one per core);
* `ckpt verify DIR --checksums` as a real process, for a manifest of each algorithm (structure
  check and process start-up included), and `hashing.hash_files` in-process (the loop alone);
* the same loop reading through `mmap` instead of `readinto` (what dropping the page-cache
  copy would give; not what ckpt does, see docs/performance.md);
* #30: `ckpt verify DIR --write-manifest --algo xxh3|blake3` as a real process (start-up,
  structure check, hashing, manifest written) against the reference command-line tools
  `xxhsum -H2 FILES` (XXH3-128, one process) and `b3sum FILES` (its own threads and mmap), when
  they are installed (or named with --xxhsum / --b3sum); the target is 1.2x their time at 2 GiB.
* with `--small N`: the same manifests and tools over N shards of 256 KiB each (a DCP folder of
  many ranks: the cost per file, not per byte).

Run by hand (never in tests):  PYTHONPATH=. python bench/bench_checksums.py [--gb 1] [--dir D]
(#30's figure: --gb 2.147, i.e. 2 GiB; per file: --gb 0.1 --small 2000)
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_cli.storage.hashing import hash_files, hasher_factory

SHARD = 128 << 20
ALGOS = ("sha256", "blake3", "xxh3")


def write_shards(
    folder: Path, gigabytes: float, count: int | None = None, size: int = SHARD
) -> dict[str, Path]:
    """Random-byte safetensors shards (one U8 tensor each) totalling about `gigabytes` GB, or
    `count` shards of `size` bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_verify import write_raw_safetensors

    shards = count or max(2, round(gigabytes * 1e9 / size))
    for s in range(1, shards + 1):
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        write_raw_safetensors(folder / name, {f"w{s}": size})
    return {p.name: p for p in sorted(folder.glob("*.safetensors"))}


def mmap_hash(files: dict[str, Path], algo: str) -> None:
    """The hashing loop without the copy into a user buffer: every file hashed from a
    read-only mapping, two files at a time."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    new = hasher_factory(algo)

    def one(path: Path) -> str:
        hasher = new()
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            for start in range(0, len(m), 4 << 20):
                hasher.update(view[start : start + (4 << 20)])
            view.release()
        return hasher.hexdigest()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, files.values()))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def shell(command: str) -> Callable[[], object]:
    return lambda: subprocess.run(command, shell=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0, help="data size (GB)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--xxhsum", default=shutil.which("xxhsum"), help="xxhsum to compare")
    parser.add_argument("--b3sum", default=shutil.which("b3sum"), help="b3sum to compare")
    parser.add_argument("--small", type=int, default=0, help="also N shards of 256 KiB")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-checksums-", dir=args.dir))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    # an installed ckpt has its bytecode cached; a checkout run with PYTHONDONTWRITEBYTECODE
    # would compile every module on every start (about a second here) and time that instead
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    try:
        data = root / "ckpt"
        data.mkdir()
        files = write_shards(data, args.gb)
        total = sum(p.stat().st_size for p in files.values())
        gb = total / 1e9
        globbed = f"{data}/*.safetensors"
        manifests = {}
        for algo in ALGOS:
            manifests[algo] = root / f"manifest-{algo}.json"
            subprocess.run(
                [sys.executable, "-m", "ckpt_cli", "verify", str(data), "--write-manifest",
                 "--algo", algo, "--manifest", str(manifests[algo])],
                check=True, capture_output=True, env=env,
            )  # fmt: skip
        subprocess.run(f"cat {globbed} > /dev/null", shell=True, check=True)  # warm

        def verify(algo: str) -> Callable[[], object]:
            argv = [sys.executable, "-m", "ckpt_cli", "verify", str(data), "--checksums",
                    "--manifest", str(manifests[algo])]  # fmt: skip
            return lambda: subprocess.run(argv, check=True, capture_output=True, env=env)

        candidates: dict[str, Callable[[], object]] = {
            "cat > /dev/null": shell(f"cat {globbed} > /dev/null"),
            "cat, xargs -P2": shell(f"ls {globbed} | xargs -P2 -n1 cat > /dev/null"),
            "sha256sum, xargs -P2": shell(f"ls {globbed} | xargs -P2 -n1 sha256sum > /dev/null"),
        }

        def write(algo: str) -> Callable[[], object]:
            argv = [sys.executable, "-m", "ckpt_cli", "verify", str(data), "--write-manifest",
                    "--algo", algo, "--force", "--manifest", str(root / f"written-{algo}.json")]  # fmt: skip
            return lambda: subprocess.run(argv, check=True, capture_output=True, env=env)

        names = " ".join(shlex.quote(str(p)) for p in files.values())
        tools = {"xxh3": (args.xxhsum, "-H2"), "blake3": (args.b3sum, "")}
        for algo, (tool, flag) in tools.items():
            if tool:
                candidates[f"{Path(tool).name} {flag}".strip()] = shell(
                    f"{shlex.quote(tool)} {flag} {names} > /dev/null"
                )
                candidates[f"ckpt verify --write-manifest ({algo})"] = write(algo)
        for algo in ALGOS:
            candidates[f"ckpt verify --checksums ({algo})"] = verify(algo)
            candidates[f"hash_files in-process ({algo})"] = lambda a=algo: hash_files(files, a)
            candidates[f"mmap loop in-process ({algo})"] = lambda a=algo: mmap_hash(files, a)
        small_gb = args.small * (256 << 10) / 1e9
        if args.small:
            small = root / "small"
            small.mkdir()
            small_files = write_shards(small, 0, count=args.small, size=256 << 10)
            subprocess.run(f"cat {small}/*.safetensors > /dev/null", shell=True, check=True)
            for algo, (tool, flag) in tools.items():
                if tool:
                    candidates[f"small: {Path(tool).name} {flag}".strip()] = shell(
                        f"cd {shlex.quote(str(small))} && {shlex.quote(tool)} {flag} *.safetensors"
                        " > /dev/null"  # one short `sh -c` argument however many files
                    )
                argv = [sys.executable, "-m", "ckpt_cli", "verify", str(small), "--write-manifest",
                        "--algo", algo, "--force", "--manifest", str(root / f"small-{algo}.json")]  # fmt: skip
                candidates[f"small: ckpt --write-manifest ({algo})"] = lambda argv=argv: (
                    subprocess.run(argv, check=True, capture_output=True, env=env)
                )
                candidates[f"small: hash_files ({algo})"] = lambda a=algo: hash_files(
                    small_files, a
                )
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(args.rounds):
            for name, fn in candidates.items():
                times[name].append(timed(fn))
        load_after = os.getloadavg()
        median = {name: statistics.median(t) for name, t in times.items()}

        print(f"{gb:.2f} GB in {len(files)} files, page cache, {os.cpu_count()} cores, "
              f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after, "
              f"median of {args.rounds} interleaved rounds")  # fmt: skip
        for name, seconds in median.items():
            size = small_gb if name.startswith("small:") else gb
            print(f"  {name:<36} {seconds:6.2f} s  {size / seconds:6.2f} GB/s")
        cat = median["cat > /dev/null"]
        sha = median["sha256sum, xargs -P2"]
        print("ratios (time, lower is better):")
        for algo in ALGOS:
            cli = median[f"ckpt verify --checksums ({algo})"]
            loop = median[f"hash_files in-process ({algo})"]
            mapped = median[f"mmap loop in-process ({algo})"]
            base, label = (sha, "sha256sum -P2") if algo == "sha256" else (cat, "cat")
            target = "" if algo == "sha256" else "  (target <= 1.20)"
            print(f"  {algo:<7} ckpt verify / {label}: {cli / base:5.2f}   "
                  f"loop / {label}: {loop / base:5.2f}   "
                  f"mmap loop / {label}: {mapped / base:5.2f}{target}")  # fmt: skip
        for algo, (tool, flag) in tools.items():
            if tool:
                ref = median[f"{Path(tool).name} {flag}".strip()]
                mine = median[f"ckpt verify --write-manifest ({algo})"]
                print(f"  {algo:<7} ckpt verify --write-manifest / {Path(tool).name}: "
                      f"{mine / ref:5.2f}   (target <= 1.20)")  # fmt: skip
            else:
                print(f"  {algo:<7} no reference tool (install it or pass --xxhsum / --b3sum)")
        if args.small:
            for algo, (tool, flag) in tools.items():
                mine = median[f"small: ckpt --write-manifest ({algo})"]
                loop = median[f"small: hash_files ({algo})"]
                got = median.get(f"small: {Path(tool).name} {flag}".strip()) if tool else None
                vs = f"{mine / got:5.2f} / {loop / got:5.2f}" if got else "no reference tool"
                print(f"  {algo:<7} {args.small} small shards, ckpt process / loop vs "
                      f"{Path(tool).name if tool else '-'}: {vs}")  # fmt: skip
        print(f"  sha256 ckpt verify throughput: {gb / median['ckpt verify --checksums (sha256)']:.2f}"
              " GB/s (target >= 2 on 2 quiet cores)")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
