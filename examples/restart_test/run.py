"""The restart test: is a resumed run the same run?

1. Train `--steps` steps straight through (`straight/`).
2. Train again (`resumed/`), kill the process with SIGKILL once it has saved a checkpoint past
   the half-way step, i.e. mid-run and possibly mid-save, without asking it to stop.
3. Ask `ckpt latest` for the newest complete checkpoint of `resumed/`, show what
   `ckpt verify --resumable` says about it, and resume from it.
4. `ckpt diff` the two final checkpoints: exit 0 (bit-identical) means the checkpoint held
   everything the run needed; exit 1 shows what diverged.

Usage:
    python examples/restart_test/run.py WORKDIR [--format torch|dcp] [--omit rng|dataloader]

Exit status: that of `ckpt diff` (0 identical, 1 different), or 2 if a step failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CKPT = [sys.executable, "-m", "ckpt_cli"]


def train(run_dir: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(HERE / "train.py"),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--format",
        args.format,
        *[f"--omit={o}" for o in args.omit],
        *extra,
    ]


def run_killed(run_dir: Path, args: argparse.Namespace) -> int:
    """Start a run and SIGKILL it right after it reports a save past the half-way step."""
    # the per-step pause only slows the run down so the kill lands mid-run; it changes no number
    proc = subprocess.Popen(
        train(run_dir, args, "--step-delay", "0.05"), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    killed_after = 0
    for line in proc.stdout:
        if line.startswith("saved step "):
            saved = int(line.split()[2])
            if saved >= args.steps // 2:
                os.kill(proc.pid, signal.SIGKILL)
                killed_after = saved
                break
    proc.wait()
    if not killed_after or proc.returncode != -signal.SIGKILL:
        print("the run finished before it could be killed", file=sys.stderr)
        return 0
    print(f"killed the run (SIGKILL) after it saved step {killed_after}")
    return killed_after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--format", choices=["torch", "dcp"], default="torch")
    parser.add_argument("--omit", choices=["rng", "dataloader"], action="append", default=[])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args(argv)
    straight, resumed = args.workdir / "straight", args.workdir / "resumed"
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)

    subprocess.run(train(straight, args), check=True, stdout=subprocess.DEVNULL)
    if not run_killed(resumed, args):
        return 2
    latest = subprocess.run([*CKPT, "latest", str(resumed)], capture_output=True, text=True)
    if latest.returncode != 0:
        print(latest.stderr, file=sys.stderr)
        return 2
    checkpoint = latest.stdout.strip()
    print(f"resuming from {checkpoint} (ckpt latest)")
    # what the checkpoint claims before it is put to the test (exit 1 names what is missing)
    verify = subprocess.run(
        [*CKPT, "verify", "--resumable", checkpoint], capture_output=True, text=True
    )
    print(f"ckpt verify --resumable: exit {verify.returncode}")
    print(verify.stdout.strip())
    subprocess.run(
        train(resumed, args, "--resume", checkpoint), check=True, stdout=subprocess.DEVNULL
    )
    final = f"step-{args.steps}"
    diff = subprocess.run([*CKPT, "diff", str(straight / final), str(resumed / final)])
    return diff.returncode


if __name__ == "__main__":
    sys.exit(main())
