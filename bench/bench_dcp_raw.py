"""DCP torch_save data paths against a durable copy of the same bytes. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_dcp_raw.py [WORKDIR] [--gb 1.0] [--runs 3]

Generates on the fly a DCP checkpoint (torch_save serialization, `dcp.save`, float32 tensors of
16-64 MiB) and the same tensors as one safetensors file, then measures in one run, alternating
the runs of each pair (median wall time, peak RSS via /usr/bin/time):

1. `ckpt convert DCP --to safetensors` (tensor bytes copied out of each torch.save blob) against
   `cp -r DCP COPY && sync`;
2. `ckpt convert SAFETENSORS --to dcp` (torch.save containers written around raw bytes) against
   `cp SAFETENSORS COPY && sync`;
3. `ckpt convert SAFETENSORS --to torch` (one torch.save file) against the same copy;
4. `ckpt reshard SAFETENSORS --max-shard-size 500MB` against the same copy;
5. `ckpt convert SAFETENSORS --dtype bf16` (every tensor read, cast by torch and written: the
   cast path, target within 2x of the copy) against the same copy of the F32 source.

Tensor bytes move with `copy_file_range` and write-back starts as they land (`ckpt_cli/storage/fileio.py`).
The zip CRC-32 of cases 2 and 3 is computed by ISA-L where installed (the pyeclib wheel bundles
it), else by zlib: the table's heading says which (`ckpt_cli/storage/crc.py`).

Prints each ratio as the throughput of ckpt over that of the copy (1.0: as fast as `cp`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
from pathlib import Path

from timing import ENV, PY, measure


def make_sources(work: Path, gb: float) -> tuple[Path, Path]:
    """A DCP folder (torch_save) and a safetensors file of the same float32 tensors."""
    script = f"""
import torch, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
total, sizes = int({gb} * 2**30), [64, 16, 32, 48]
gen = torch.Generator().manual_seed(0)
state, i, left = {{}}, 0, total
while left > 0:
    n = min(sizes[i % len(sizes)] << 20, left)
    state[f"model.layers.{{i}}.w"] = torch.randn(n // 4 // 1024, 1024, generator=gen)
    left -= n; i += 1
dcp.save(state, checkpoint_id="{work / "dcp"}", no_dist=True)
save_file(state, "{work / "model.safetensors"}")
"""
    subprocess.run([PY, "-c", script], env=ENV, check=True, stderr=subprocess.DEVNULL)
    return work / "dcp", work / "model.safetensors"


def pair(ours: list[str], baseline: str, outs: list[Path], runs: int) -> dict[str, float]:
    """Median seconds and peak RSS of `ours` and of the shell `baseline`, runs alternated."""
    mine: list[tuple[float, float]] = []
    base: list[tuple[float, float]] = []
    for _ in range(runs):
        for out in outs:
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        mine.append(measure(ours))
        base.append(measure(["sh", "-c", baseline]))
    return {
        "ours_s": statistics.median(s for s, _ in mine),
        "ours_rss": max(r for _, r in mine),
        "cp_s": statistics.median(s for s, _ in base),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", nargs="?", type=Path, default=Path("build/bench-dcp-raw"))
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work: Path = args.workdir.absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dcp_src, st_src = make_sources(work, args.gb)
    ckpt = [PY, "-m", "ckpt_cli"]
    copy_dcp = (f"cp -r {dcp_src} {work / 'dcp-copy'} && sync", work / "dcp-copy")
    copy_st = (f"cp {st_src} {work / 'st-copy'} && sync", work / "st-copy")
    # (label, ckpt's arguments, its output, the baseline copy of the same source)
    cases = [
        ("DCP (torch_save) -> safetensors", ["convert", dcp_src, "--to", "safetensors"],
         work / "st-out", copy_dcp),
        ("safetensors -> DCP (torch_save)", ["convert", st_src, "--to", "dcp"],
         work / "dcp-out", copy_st),
        ("safetensors -> torch.save (one .pt)", ["convert", st_src, "--to", "torch"],
         work / "model.pt", copy_st),
        ("safetensors -> 500 MB shards (`reshard --max-shard-size`)",
         ["reshard", st_src, "--max-shard-size", "500MB"], work / "resharded", copy_st),
        ("safetensors F32 -> BF16 (`convert --dtype bf16`, a cast)",
         ["convert", st_src, "--to", "safetensors", "--dtype", "bf16"], work / "bf16", copy_st),
    ]  # fmt: skip
    rows = []
    for label, argv, out, (baseline, copy) in cases:
        command, src, *options = argv
        ours = [*ckpt, str(command), str(src), str(out), *map(str, options)]
        rows.append((label, pair(ours, baseline, [out, copy], args.runs)))
    load = os.getloadavg()[0]
    crc = subprocess.run(
        [PY, "-c", "from ckpt_cli.storage.crc import implementation; print(implementation())"],
        env=ENV, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    print(
        f"{args.gb:g} GiB, {args.runs} runs each, median; load {load:.1f}, "
        f"{os.cpu_count()} CPUs; zip CRC-32 by {crc}"
    )
    print("| work | ckpt | `cp -r && sync` | ratio (throughput vs cp) | ckpt peak RSS |")
    print("|---|---|---|---|---|")
    for label, r in rows:
        ratio = r["cp_s"] / r["ours_s"] if r["ours_s"] else float("inf")
        print(
            f"| {label} | {r['ours_s']:.2f} s | {r['cp_s']:.2f} s | {ratio:.2f}x "
            f"| {r['ours_rss']:.0f} MiB |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
