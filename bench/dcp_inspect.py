"""Benchmark: `ckpt inspect` of a DCP checkpoint against torch's own `FileSystemReader.read_metadata()`.

Builds (once, under bench/data/) a DCP checkpoint of N small tensors laid out for R ranks with
ckpt's DCP writer (either serialization), then times, best of 5:

* torch: `FileSystemReader(path).read_metadata()` in a warm process (torch already imported),
  and end to end as a fresh process (`python -c 'import torch.distributed.checkpoint; ...'`);
* ckpt: `ops.inspect.inspect(path)` in a warm process (full manifest: every chunk, file sizes,
  embedded headers), and `ckpt inspect PATH --json` end to end as a fresh process.

Usage: python bench/dcp_inspect.py [--tensors 5000] [--ranks 8] [--serialization safetensors]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(path: Path, tensors: int, ranks: int, serialization: str) -> None:
    import torch

    from ckpt_cli.formats.base import WriteOptions
    from ckpt_cli.formats.dcp import DcpFormat
    from ckpt_cli.models import Entry

    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    plan = [
        Entry(
            name=f"model.layers.{i // 10}.p{i % 10}.weight",
            dtype="bfloat16",
            shape=[16, 8],
            nbytes=256,
        )
        for i in range(tensors)
    ]
    plan.append(Entry(name="step", kind="object"))
    writer = DcpFormat.writer(
        staging, plan, WriteOptions(world_size=ranks, dcp_serialization=serialization)
    )
    value = torch.ones(16, 8, dtype=torch.bfloat16)
    for entry in plan[:-1]:
        writer.write_tensor(entry.name, value)
    writer.write_object("step", 100)
    writer.finish()
    staging.rename(path)


def best(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=5000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--serialization", default="safetensors")
    args = parser.parse_args()
    path = ROOT / "bench" / "data" / f"dcp-{args.serialization}-{args.tensors}x{args.ranks}"
    if not path.exists():
        build(path, args.tensors, args.ranks, args.serialization)

    from torch.distributed.checkpoint import FileSystemReader

    from ckpt_cli.ops.inspect import inspect

    torch_warm = best(lambda: FileSystemReader(str(path)).read_metadata())
    ckpt_warm = best(lambda: inspect(str(path)))
    env_py = [sys.executable, "-c"]
    torch_cold = best(
        lambda: subprocess.run(
            [
                *env_py,
                "import sys; from torch.distributed.checkpoint import FileSystemReader;"
                "FileSystemReader(sys.argv[1]).read_metadata()",
                str(path),
            ],
            check=True,
        ),
        3,
    )
    ckpt_cold = best(
        lambda: subprocess.run(
            [sys.executable, "-m", "ckpt_cli", "inspect", str(path), "--json"],
            check=True,
            stdout=subprocess.DEVNULL,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        ),
        3,
    )
    chunks = args.tensors * args.ranks
    print(
        f"DCP ({args.serialization}): {args.tensors} tensors x {args.ranks} ranks = {chunks} chunks"
    )
    print(f"warm  torch read_metadata   {torch_warm * 1000:8.1f} ms")
    print(
        f"warm  ckpt inspect (ops)    {ckpt_warm * 1000:8.1f} ms  ({ckpt_warm / torch_warm:.2f}x torch)"
    )
    print(f"cold  torch read_metadata   {torch_cold * 1000:8.1f} ms  (process, incl. import torch)")
    print(
        f"cold  ckpt inspect --json   {ckpt_cold * 1000:8.1f} ms  ({torch_cold / ckpt_cold:.2f}x faster)"
    )


if __name__ == "__main__":
    main()
