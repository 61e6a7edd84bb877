"""Benchmark `ckpt verify` against what users would otherwise run.

1. Structural verify of a 200-shard, 20,000-tensor safetensors checkpoint (headers, offsets,
   sizes, index against shards), in-process and as a real `ckpt` process.
2. `--write-manifest` / `--checksums` hashing over ~1.5 GB of shards: sha256 against
   coreutils `sha256sum` run as 2 parallel processes (`xargs -P2`), then blake3 and xxh3.
   Files are read once beforehand so both sides hash from the page cache (the comparison is
   of hashing throughput, not of the disk).

Run by hand (never in tests):  PYTHONPATH=. python bench/bench_verify.py [--gb 1.5] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckpt_cli.ops.verify.run import verify
from ckpt_cli.storage.hashing import hash_files

SHARDS = 200
TENSORS_PER_SHARD = 100


def write_raw_safetensors(path: Path, tensors: dict[str, int], fill: bytes | None = None) -> None:
    """A safetensors file of uint8 tensors (name -> byte count), data random or zero."""
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for size in tensors.values():
            left = size
            while left:
                n = min(left, 64 << 20)
                fh.write(os.urandom(n) if fill is None else fill * n)
                left -= n


def build_many_shards(root: Path) -> Path:
    folder = root / "many"
    folder.mkdir()
    weight_map = {}
    count = 0
    for s in range(1, SHARDS + 1):
        name = f"model-{s:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {f"layers.{s}.t{i}.weight": 64 for i in range(TENSORS_PER_SHARD)}
        write_raw_safetensors(folder / name, tensors, fill=b"\0")
        weight_map.update(dict.fromkeys(tensors, name))
        count += len(tensors) * 64
    index = {"metadata": {"total_size": count}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def build_big(root: Path, gigabytes: float) -> Path:
    folder = root / "big"
    folder.mkdir()
    shard_bytes = 256 << 20
    shards = max(2, round(gigabytes * (1 << 30) / shard_bytes))
    for s in range(1, shards + 1):
        write_raw_safetensors(
            folder / f"model-{s:05d}-of-{shards:05d}.safetensors", {f"w{s}": shard_bytes}
        )
    return folder


def best(fn: object, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.5, help="data size for the hashing runs")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-verify-", dir=args.dir))
    try:
        many = build_many_shards(root)
        report = verify(str(many))
        assert report.ok, report.problems
        structural = best(lambda: verify(str(many)))
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        cli = best(
            lambda: subprocess.run(
                [sys.executable, "-m", "ckpt_cli", "verify", str(many)],
                check=True,
                capture_output=True,
                env=env,
            )
        )
        print(f"structural verify, {SHARDS} shards / {SHARDS * TENSORS_PER_SHARD} tensors:")
        print(f"  in-process {structural * 1000:.0f} ms, `ckpt verify` process {cli * 1000:.0f} ms")

        big = build_big(root, args.gb)
        files = {p.name: p for p in sorted(big.iterdir())}
        total = sum(p.stat().st_size for p in files.values())
        for path in files.values():  # warm the page cache for both sides
            with open(path, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        gb = total / 1e9
        coreutils = best(
            lambda: subprocess.run(
                f"ls {big}/*.safetensors | xargs -P2 -n1 sha256sum > /dev/null",
                shell=True,
                check=True,
            ),
            repeat=2,
        )
        print(f"hashing {gb:.2f} GB in {len(files)} files (page cache):")
        print(f"  sha256sum (xargs -P2)    {gb / coreutils:6.2f} GB/s")
        for algo in ("sha256", "blake3", "xxh3"):
            seconds = best(lambda a=algo: hash_files(files, a), repeat=2)  # type: ignore[misc]
            print(
                f"  ckpt {algo:<19} {gb / seconds:6.2f} GB/s  "
                f"({coreutils / seconds:.1f}x sha256sum)"
            )
        end_to_end = best(
            lambda: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ckpt_cli",
                    "verify",
                    str(big),
                    "--write-manifest",
                    "--force",
                ],
                check=True,
                capture_output=True,
                env=env,
            ),
            repeat=2,
        )
        print(
            f"  `ckpt verify --write-manifest` (sha256, whole process) {gb / end_to_end:.2f} GB/s"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
