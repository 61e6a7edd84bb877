"""Benchmark `ckpt reshard` against what users would otherwise run. By hand, never in tests.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_reshard.py [--size-mb 1024] [--dcp-mb 256]

Shard size: a ~1 GB Hugging Face-style safetensors checkpoint (saved by huggingface_hub,
500 MB shards) regrouped into 200 MB shards by
  - `cp -r` of the same bytes (the floor), with and without a final `sync`,
  - `ckpt reshard --max-shard-size 200MB` (raw byte copy, fsync'd),
  - the usual script: `safetensors.torch.load_file` every shard + `save_torch_state_dict`.
World size: a DCP checkpoint saved on 1 rank (`--dcp-mb`) resharded 1 -> 4, and one saved on
4 ranks resharded 4 -> 2, by
  - `ckpt reshard --world-size N` (one process),
  - `dcp.load` into Shard(0) DTensors + `dcp.save` under torchrun on N ranks (gloo, CPU).
Each run is a separate process measured with /usr/bin/time -v (wall, peak RSS; for torchrun
the peak of the largest rank). Shard-size tools all end with `sync` (ckpt fsyncs each shard
itself), so every one pays for getting the bytes to disk; rounds are interleaved and the median
wall time is reported (the machine is shared). The page cache is warm for everyone
(each source is read once before timing).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command, from /usr/bin/time -v."""
    proc = subprocess.run(
        ["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=ENV, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    assert wall and rss, proc.stderr
    hours = float(wall.group(1) or 0)
    seconds = hours * 3600 + float(wall.group(2)) * 60 + float(wall.group(3))
    return seconds, int(rss.group(1)) / 1024


def warm(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                while block := fh.read(8 << 20):
                    total += len(block)
    return total


def run_py(code: str, *args: str) -> tuple[float, float]:
    return timed([PY, "-c", textwrap.dedent(code), *args])


def row(name: str, wall: float, rss: float, nbytes: int, base: float | None) -> str:
    rate = nbytes / wall / 1e6
    ratio = f"{base / wall:.2f}×" if base else "1.00×"
    return f"| {name} | {wall:.2f} s | {rate:.0f} MB/s | {ratio} | {rss:.0f} MiB |"


def shard_size_bench(work: Path, size_mb: int, repeat: int) -> list[str]:
    src = work / "hf"
    run_py(
        """
        import sys, torch
        from huggingface_hub import save_torch_state_dict
        n = int(sys.argv[2]) * 1024 * 1024 // (4096 * 4096 * 2)
        g = torch.Generator().manual_seed(0)
        sd = {f"model.layers.{i}.w": torch.randn(4096, 4096, generator=g).bfloat16() for i in range(n)}
        sd["model.norm.weight"] = torch.ones(4096)
        import os; os.makedirs(sys.argv[1])
        save_torch_state_dict(sd, sys.argv[1], max_shard_size="500MB")
        """,
        str(src),
        str(size_mb),
    )
    nbytes = warm(src)
    out: list[str] = [
        f"Shard size: {nbytes / 1e9:.2f} GB safetensors (500 MB shards) -> 200 MB shards, "
        f"median of {repeat} interleaved runs",
        "",
        "| tool | wall | throughput | vs cp + sync | peak RSS |",
        "|---|---|---|---|---|",
    ]
    script = textwrap.dedent(
        """
        import sys, glob
        from safetensors.torch import load_file
        from huggingface_hub import save_torch_state_dict
        sd = {}
        for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
            sd.update(load_file(f))
        save_torch_state_dict(sd, sys.argv[2], max_shard_size="200MB")
        """
    )
    tools = {
        "cp -r (no sync)": f"cp -r {src} {work / 'out'}",
        "cp -r + sync": f"cp -r {src} {work / 'out'} && sync",
        "ckpt reshard --max-shard-size 200MB (fsyncs each shard)": f"{PY} -m ckpt_cli reshard "
        f"{src} {work / 'out'} --max-shard-size 200MB && sync",
        "load_file + save_torch_state_dict + sync": f"mkdir {work / 'out'} && {PY} -c '{script}' "
        f"{src} {work / 'out'} && sync",
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    # interleaved rounds, median wall: the machine is shared, one run can be unlucky
    for _ in range(repeat):
        for name, cmd in tools.items():
            runs[name].append(timed(["sh", "-c", cmd]))
            shutil.rmtree(work / "out", ignore_errors=True)
    results = {
        name: (statistics.median(w for w, _ in got), max(r for _, r in got))
        for name, got in runs.items()
    }
    base = results["cp -r + sync"][0]
    for name, (wall, rss) in results.items():
        out.append(row(name, wall, rss, nbytes, base))
    shutil.rmtree(src)
    return out


DCP_SAVE = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mb, dest = int(sys.argv[1]), sys.argv[2]
n = mb * 1024 * 1024 // (2048 * 2048 * 4)
g = torch.Generator().manual_seed(0)
full = {f"model.layers.{i}.w": torch.randn(2048, 2048, generator=g) for i in range(n)}
if dist.is_torchelastic_launched():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(sd, checkpoint_id=dest)
    dist.barrier()
    os._exit(0)  # gloo teardown can abort a busy process at exit; the work is done
else:
    dcp.save(full, checkpoint_id=dest, no_dist=True)
"""

DCP_RESHARD = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, zeros
src, dest = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
meta = FileSystemReader(src).read_metadata()
sd = {k: zeros(m.size, dtype=m.properties.dtype, device_mesh=mesh, placements=[Shard(0)])
      for k, m in meta.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=src)
dcp.save(sd, checkpoint_id=dest)
dist.barrier()
os._exit(0)
"""


def torchrun(n: int, script: Path, *args: str) -> list[str]:
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(script),
        *args,
    ]


def world_size_bench(work: Path, dcp_mb: int) -> list[str]:
    save = work / "save.py"
    save.write_text(DCP_SAVE)
    reshard = work / "reshard.py"
    reshard.write_text(DCP_RESHARD)
    out = [
        "",
        f"World size: DCP checkpoint of {dcp_mb} MB (float32 2048×2048 tensors), Shard(0)",
        "",
        "| change | tool | wall | throughput | vs dcp.load+save | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for before, after in ((1, 4), (4, 2)):
        src = work / f"dcp{before}"
        if before == 1:
            timed([PY, str(save), str(dcp_mb), str(src)])
        else:
            timed(torchrun(before, save, str(dcp_mb), str(src)))
        nbytes = warm(src)
        ref_wall, ref_rss = timed(torchrun(after, reshard, str(src), str(work / "ref")))
        ours_wall, ours_rss = timed(
            [
                PY,
                "-m",
                "ckpt_cli",
                "reshard",
                str(src),
                str(work / "ours"),
                "--world-size",
                str(after),
            ]
        )
        change = f"{before} -> {after}"
        tool = f"dcp.load + dcp.save, torchrun ×{after} (peak is the launcher's largest child)"
        out.append(
            f"| {change} | {tool} | {ref_wall:.2f} s | {nbytes / ref_wall / 1e6:.0f} MB/s | 1.00× | {ref_rss:.0f} MiB |"
        )
        out.append(
            f"| {change} | ckpt reshard --world-size {after} | {ours_wall:.2f} s | "
            f"{nbytes / ours_wall / 1e6:.0f} MB/s | {ref_wall / ours_wall:.2f}× | {ours_rss:.0f} MiB |"
        )
        for name in ("ref", "ours"):
            shutil.rmtree(work / name, ignore_errors=True)
        shutil.rmtree(src)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--dcp-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-reshard-", dir=args.dir))
    try:
        print("\n".join(shard_size_bench(work, args.size_mb, args.repeat)), flush=True)
        if not args.skip_dcp:
            print("\n".join(world_size_bench(work, args.dcp_mb)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
