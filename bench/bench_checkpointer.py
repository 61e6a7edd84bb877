"""Benchmark `Checkpointer.save` against `dcp.save` and `dcp.async_save` from a training loop.

The state is a stack of `Linear(2048, 2048)` layers trained with AdamW (parameters plus two
moments: three times the parameter bytes), sized to `--size` (default 1 GiB). Measured in one
process, in one run, each save into a fresh folder of the same disk, `sync` before each:

1. blocking time: how long each call holds the training loop. `dcp.save` writes and fsyncs
   everything before it returns; `dcp.async_save` copies the state into CPU memory it allocates
   on each call, then writes in a thread; `Checkpointer.save` copies into its staging buffer
   (allocated by the first save, reused after) and does the rest in its background thread:
   write, fsync, checksum manifest (xxh3), publish. The first and a later call are shown.
2. the training loop's throughput (steps per second) with no save, and while the background
   save of `dcp.async_save` or of the Checkpointer is running (steps counted from the moment
   the save call returns until its background work is done).

Run by hand (never in tests):
    PYTHONPATH=. python bench/bench_checkpointer.py [--size 1GiB] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from timing import sync_disk

from ckpt_cli import Checkpointer
from ckpt_cli.sizes import parse_size

DIM = 2048


def build(size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A model whose parameters and AdamW moments total about `size` bytes (one step taken)."""
    layers = max(1, round(size / (3 * DIM * DIM * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer)
    return model, optimizer, 3 * layers * DIM * DIM * 4


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, DIM)
    loss = F.mse_loss(model(x), x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def steps_per_second(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, busy: Callable[[], bool]
) -> tuple[float, int]:
    """Train while `busy()`; (steps per second, steps)."""
    count = 0
    start = time.perf_counter()
    while busy():
        step(model, optimizer)
        count += 1
    elapsed = time.perf_counter() - start
    return (count / elapsed if elapsed > 0 else 0.0), count


def baseline(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seconds: float) -> float:
    deadline = time.perf_counter() + seconds
    rate, _ = steps_per_second(model, optimizer, lambda: time.perf_counter() < deadline)
    return rate


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="state size (parameters + AdamW moments)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING)
    model, optimizer, nbytes = build(parse_size(args.size))
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    print(f"state: {nbytes / 2**20:.0f} MiB, torch threads {args.threads}, writing to {root}")
    rows: list[tuple[str, float, float]] = []
    try:
        # 1. dcp.save: everything before it returns
        for n in (1, 2):
            sync_disk()
            t = time.perf_counter()
            dcp.save(
                state_of(model, optimizer), checkpoint_id=str(root / f"dcp-save-{n}"), no_dist=True
            )
            rows.append((f"dcp.save (call {n})", time.perf_counter() - t, 0.0))
        rate0 = baseline(model, optimizer, 5.0)

        # 2. dcp.async_save
        async_rates = []
        for n in (1, 2):
            sync_disk()
            t = time.perf_counter()
            future: Any = dcp.async_save(
                state_of(model, optimizer), checkpoint_id=str(root / f"dcp-async-{n}"), no_dist=True
            )
            blocked = time.perf_counter() - t
            rate, _ = steps_per_second(model, optimizer, lambda f=future: not f.done())
            future.result()
            rows.append((f"dcp.async_save (call {n})", blocked, time.perf_counter() - t))
            async_rates.append(rate)

        # 3. Checkpointer.save
        ck = Checkpointer(root / "run")
        ck_rates = []
        for n in (1, 2):
            sync_disk()
            t = time.perf_counter()
            record = ck.save(n, {"model": model, "optimizer": optimizer})
            blocked = time.perf_counter() - t
            rate, _ = steps_per_second(model, optimizer, lambda: ck.status().in_flight is not None)
            done = ck.wait()
            assert done is not None and done.phase == "done", done
            rows.append((f"Checkpointer.save (call {n})", blocked, time.perf_counter() - t))
            ck_rates.append(rate)
            assert abs(record.blocked_seconds - blocked) < 0.05
        ck.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    dcp_blocking = rows[1][1]
    print()
    print("| call | blocks the loop | until written | vs dcp.save |")
    print("|---|---|---|---|")
    for name, blocked, total in rows:
        until = f"{total:.2f} s" if total else f"{blocked:.2f} s"
        print(f"| {name} | {blocked:.3f} s | {until} | {blocked / dcp_blocking:.3f}x |")
    print()
    print("| training loop | steps/s | vs no save |")
    print("|---|---|---|")
    print(f"| no save | {rate0:.2f} | 1.00x |")
    print(
        f"| while dcp.async_save writes (call 2) | {async_rates[1]:.2f} | {async_rates[1] / rate0:.2f}x |"
    )
    print(
        f"| while Checkpointer writes (call 2) | {ck_rates[1]:.2f} | {ck_rates[1] / rate0:.2f}x |"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
