"""verify of a DCP training checkpoint against its inspect (#30: verify <= 1.2x inspect).

A resumable training checkpoint written by torch's own `dcp.save`: a model of `--layers` Linear
layers (weight + bias each), its AdamW state (`exp_avg`, `exp_avg_sq` and a `step` tensor per
parameter, the param groups), an LR scheduler's state and a step counter, saved the way a
training loop saves them with `torch.distributed.checkpoint.state_dict.get_state_dict`-shaped
dicts. One process, no process group (dcp.save runs without one).

Then, in interleaved rounds (a burst of load hits every candidate alike), fresh processes of
`ckpt inspect`, `ckpt inspect --json`, `ckpt verify` and `ckpt verify --json`: CPU seconds (user +
system, from `os.wait4`), medians over the rounds, and verify / inspect. verify reads what
inspect reads plus one small range per chunk head and checks every chunk against its file.

Run by hand (never in tests):  PYTHONPATH=. python bench/bench_dcp_training.py [--layers 500]
[--rounds 7] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import ENV


def build(path: Path, layers: int) -> int:
    """Save a training checkpoint with `dcp.save`; returns the number of state-dict leaves."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    scheduler.step()
    names = {id(p): n for n, p in model.named_parameters()}
    optim = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # keyed by parameter name, as torch's get_state_dict keys it (FQNs, not integer ids)
    state = {names[id(params[i])]: value for i, value in optim["state"].items()}
    groups = [
        {**group, "params": [names[id(params[i])] for i in group["params"]]}
        for group in optim["param_groups"]
    ]
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    dcp.save(
        {
            "model": model.state_dict(),
            "optimizer": {"state": state, "param_groups": groups},
            "scheduler": scheduler.state_dict(),
            "step": 1,
        },
        checkpoint_id=str(staging),
    )
    staging.rename(path)
    leaves = len(model.state_dict()) + sum(len(v) for v in state.values())
    return leaves


def cpu_of(command: list[str], env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one run of `command`, which must succeed."""
    with open(os.devnull, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        err = process.stderr.read().decode() if process.stderr else ""
        raise SystemExit(f"{command} failed: {err}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-dcp-training-", dir=args.dir))
    try:
        checkpoint = root / "step-1"
        leaves = build(checkpoint, args.layers)
        env = ENV  # this checkout first on the path, its bytecode cached
        ckpt = [sys.executable, "-m", "ckpt_cli"]
        candidates = {
            "inspect": [*ckpt, "inspect", str(checkpoint)],
            "inspect --json": [*ckpt, "inspect", str(checkpoint), "--json"],
            "verify": [*ckpt, "verify", str(checkpoint)],
            "verify --json": [*ckpt, "verify", str(checkpoint), "--json"],
        }
        for command in candidates.values():  # warm the page cache and the .pyc files
            cpu_of(command, env)
        seconds: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(args.rounds):
            for name, command in candidates.items():
                seconds[name].append(cpu_of(command, env))
        median = {name: statistics.median(values) for name, values in seconds.items()}
        load = os.getloadavg()[0]
        print(f"DCP training checkpoint: {args.layers} layers, {leaves} model + optimizer tensors")
        print(f"process CPU, median of {args.rounds} interleaved rounds (load {load:.1f}):")
        for name, value in median.items():
            print(f"  ckpt {name:<16} {value:.3f} s")
        print(
            f"  verify / inspect: {median['verify'] / median['inspect']:.2f}x, "
            f"--json {median['verify --json'] / median['inspect --json']:.2f}x"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
