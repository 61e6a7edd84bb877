"""Streamed torch.save output against `torch.save` itself. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_torch_save.py [WORKDIR] [--gb 1.0] [--repeat 2]

Builds a safetensors model of float32 tensors (largest 64 MiB) and converts it to one
torch.save file two ways, each in a fresh process with `sync` before it, wall time and peak
RSS from `/usr/bin/time`:

- `ckpt convert model.safetensors out.pt --to torch` (streams each tensor into the zip
  container, fsyncs the file);
- `safetensors.torch.load_file` + `torch.save` of the loaded dict (what users write; holds the
  whole model, does not fsync: `sync` is timed after it for the durable figure).

Both outputs are loaded with `torch.load(weights_only=True)` and compared bit for bit.

Then the copy-speed comparison (#18: target >= 0.9x), each against `cp -r SRC DST && sync` of
the same source in the same run:

- safetensors -> torch.save (`ckpt convert --to torch`: raw ranges into the zip container);
- torch.save -> safetensors (`ckpt convert --to safetensors` of ckpt's torch.save output:
  raw ranges located through the zip directory).

Prints Markdown tables and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

from timing import ENV, PY, measure

MAKE = """
import sys, torch
from safetensors.torch import save_file
total, largest = int(float(sys.argv[2]) * 2**30), 64 << 20
gen = torch.Generator().manual_seed(0)
state, i, left = {}, 0, total
while left > 0:
    n = min(largest if i % 2 == 0 else largest // 4, left)
    state[f"model.layers.{i}.weight"] = torch.randn(n // 4 // 1024, 1024, generator=gen)
    left -= n; i += 1
save_file(state, sys.argv[1])
"""

BASELINE = """
import sys, torch
from safetensors.torch import load_file
torch.save(load_file(sys.argv[1]), sys.argv[2])
"""

SAME = """
import sys, torch
a = torch.load(sys.argv[1], weights_only=True, mmap=True)
b = torch.load(sys.argv[2], weights_only=True, mmap=True)
assert a.keys() == b.keys()
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", nargs="?", type=Path, default=Path("build/bench-torch-save"))
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work: Path = args.workdir.absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "model.safetensors"
    subprocess.run([PY, "-c", MAKE, str(src), str(args.gb)], env=ENV, check=True)
    ours, theirs, theirs_sync = [], [], []
    for i in range(args.repeat):
        out = work / f"ckpt{i}.pt"
        ours.append(measure([PY, "-m", "ckpt_cli", "convert", str(src), str(out), "--to", "torch"]))
        base = work / f"base{i}.pt"
        theirs.append(measure([PY, "-c", BASELINE, str(src), str(base)]))
        sync_s, _ = measure(["sync"])
        theirs_sync.append((theirs[-1][0] + sync_s, theirs[-1][1]))
        subprocess.run([PY, "-c", SAME, str(out), str(base)], env=ENV, check=True)
        out.unlink()
        base.unlink()
    best = min(t for t, _ in ours), max(r for _, r in ours)
    base_best = min(t for t, _ in theirs), max(r for _, r in theirs)
    base_sync = min(t for t, _ in theirs_sync)
    size = src.stat().st_size
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; best of {args.repeat}")
    print("| safetensors → one torch.save file | wall | peak RSS |\n|---|---|---|")
    print(
        f"| {size / 1e9:.2f} GB, largest tensor 64 MiB: `ckpt convert --to torch` (fsynced) "
        f"| {best[0]:.2f} s | {best[1]:.0f} MiB |"
    )
    print(
        f"| `load_file` + `torch.save` | {base_best[0]:.2f} s ({base_sync:.2f} s with `sync`) "
        f"| {base_best[1]:.0f} MiB |"
    )
    print(
        f"| ratio | {base_sync / best[0]:.2f}× the speed of save + sync "
        f"| **{best[1] / base_best[1]:.2f}× the peak RSS** |"
    )
    copy_speed(work, src, args.repeat)
    shutil.rmtree(work, ignore_errors=True)


def copy_speed(work: Path, src: Path, repeat: int) -> None:
    """Both directions against `cp -r && sync` of the same bytes: a throughput ratio."""
    pt = work / "model.pt"
    subprocess.run(
        [PY, "-m", "ckpt_cli", "convert", str(src), str(pt), "--to", "torch"], env=ENV, check=True
    )
    rows = []
    for label, source, to, suffix in (
        ("safetensors → torch.save", src, "torch", ".pt"),
        ("torch.save → safetensors", pt, "safetensors", ".safetensors"),
    ):
        ckpt_s, cp_s, peak = [], [], []
        for i in range(repeat):
            out = work / f"out{i}{suffix}"
            seconds, rss = measure(
                [PY, "-m", "ckpt_cli", "convert", str(source), str(out), "--to", to]
            )
            ckpt_s.append(seconds)
            peak.append(rss)
            out.unlink()
            copy = work / f"copy{i}{suffix}"
            cp_s.append(measure(["sh", "-c", f"cp -r '{source}' '{copy}' && sync"])[0])
            copy.unlink()
        best, base = min(ckpt_s), min(cp_s)
        size = source.stat().st_size / 1e9
        rows.append(
            f"| {label}, {size:.2f} GB | {best:.2f} s | {base:.2f} s | "
            f"**{base / best:.2f}×** | {max(peak):.0f} MiB |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f}; best of {repeat}")
    print("| convert | ckpt | `cp -r && sync` | throughput ratio | ckpt peak RSS |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
