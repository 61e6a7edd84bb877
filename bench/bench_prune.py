"""Benchmark run-folder scanning (`ckpt latest`, `ckpt prune` plans) against what users run.

A run folder of N Hugging Face Trainer checkpoints (model.safetensors, optimizer.pt,
scheduler.pt, rng_state.pth, trainer_state.json), the newest one interrupted (model file cut
short, no trainer_state.json). Measured, in-process, after one warm-up (torch imported):

1. `get_last_checkpoint`-style resume logic: the highest `checkpoint-N` by name (transformers'
   `trainer_utils.get_last_checkpoint`, re-implemented: a regex over the folder listing). Fast,
   and wrong here: it picks the interrupted save.
2. `ckpt latest` (judges from the newest down, stops at the first complete checkpoint).
3. `ckpt latest --json` / a prune plan (judges every checkpoint).
4. Doing the same check by hand: `safetensors.safe_open` on every model file and
   `torch.load(weights_only=True, mmap=True)` on every .pt/.pth, `json.load` of the states.

Run by hand (never in tests):  PYTHONPATH=. python bench/bench_prune.py [--checkpoints 50]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.ops.prune.retention import PrunePolicy
from ckpt_cli.ops.prune.run import prune
from ckpt_cli.sources.runs import scan_run


def build(root: Path, count: int, params: int) -> Path:
    out = root / "out"
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(params // 8, generator=gen) for i in range(8)}
    old = time.time() - 3600
    for n in range(1, count + 1):
        folder = out / f"checkpoint-{n * 100}"
        folder.mkdir(parents=True)
        save_file(model, folder / "model.safetensors")
        torch.save(
            {
                "state": {i: {"exp_avg": t} for i, t in enumerate(model.values())},
                "param_groups": [],
            },
            folder / "optimizer.pt",
        )
        torch.save({"last_epoch": n}, folder / "scheduler.pt")
        torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
        if n < count:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": n * 100}))
        else:  # the interrupted newest save
            data = (folder / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    for dirpath, dirs, files in os.walk(out):
        for name in dirs + files:
            os.utime(os.path.join(dirpath, name), (old, old))
    return out


def get_last_checkpoint(folder: Path) -> Path | None:
    """transformers' rule: the highest `checkpoint-N` folder, complete or not."""
    pattern = re.compile(r"^checkpoint-(\d+)$")
    found = [p for p in folder.iterdir() if p.is_dir() and pattern.match(p.name)]
    return max(found, key=lambda p: int(pattern.match(p.name).group(1))) if found else None  # type: ignore[union-attr]


def by_hand(folder: Path) -> Path | None:
    """Check every checkpoint with the libraries' own loaders; the newest one that passes."""
    good = []
    for ckpt in sorted(folder.iterdir()):
        try:
            with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    f.get_slice(key)
            for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
                torch.load(ckpt / name, weights_only=True, mmap=True)
            json.loads((ckpt / "trainer_state.json").read_text())
            good.append(ckpt)
        except Exception:
            continue
    return max(good, key=lambda p: int(p.name.split("-")[1])) if good else None


def timed(fn: Callable[[], object], repeat: int = 3) -> tuple[float, object]:
    fn()
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=int, default=50)
    parser.add_argument("--params", type=int, default=256 * 1024, help="floats per model")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-prune-"))
    try:
        out = build(root, args.checkpoints, args.params)
        rows = [
            ("get_last_checkpoint (by name)", lambda: get_last_checkpoint(out)),
            ("ckpt latest", lambda: scan_run(out, until_latest=True).latest),
            ("ckpt latest --json (all judged)", lambda: scan_run(out).latest),
            (
                "ckpt prune --keep-last 2 (plan)",
                lambda: prune(out, PrunePolicy(keep_last=2)).to_delete,
            ),
            ("by hand: safe_open + torch.load each", lambda: by_hand(out)),
        ]
        base = None
        print(f"{args.checkpoints} Trainer checkpoints, newest interrupted", file=sys.stderr)
        for label, fn in rows:
            seconds, result = timed(fn)
            if label.startswith("by hand"):
                base = seconds
            print(f"{label:40s} {seconds * 1000:9.1f} ms   -> {Path(str(result)).name}")
        assert base is not None
        print(f"(by-hand check takes {base * 1000:.0f} ms)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
