"""A DCP save with many small object entries, converted to one torch.save file. Run by hand.

    python bench/bench_dcp_objects.py [--objects 2000] [--rounds 5] [--before TREE]

Builds (once, in a temporary folder) a `dcp.save` of a 50-layer MLP, its AdamW state and a
dict of `--objects` entries, each holding an int, a string and a list (three object entries
apiece, as a training loop's own counters and settings come out). Each such entry is a small
torch.save blob in the `.distcp` file, which every reader (`dcp.load`, ckpt) unpickles on its
own: this measures the cost per object of reading them, ckpt's pickle check before
`torch.load` included.

Each round runs `ckpt convert SRC out.pt --to torch` as a fresh process, for this checkout
and, with `--before TREE`, for another checkout of ckpt (a `git worktree` of an older commit),
interleaved; the medians of wall time, CPU time (user + system) and peak RSS are printed, and
the outputs are checked to load with `torch.load(weights_only=True)` to the same values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import ENV, PY, REPO, sync_disk


def build(folder: Path, objects: int) -> None:
    """The DCP save, written by `dcp.save` in a child process (torch is imported there)."""
    script = f"""
import torch, torch.distributed.checkpoint as dcp
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(50)])
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 64)).sum().backward()
optimizer.step()
extra = {{f"k{{i}}": {{"step": i, "name": f"n{{i}}", "vals": [i, i + 1]}} for i in range({objects})}}
state = {{"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": extra}}
dcp.save(state, checkpoint_id={str(folder)!r}, no_dist=True)
"""
    subprocess.run([PY, "-c", script], check=True, env=ENV, stderr=subprocess.DEVNULL)


def run(tree: Path, src: Path, out: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of one conversion with the ckpt of `tree`."""
    out.unlink(missing_ok=True)
    sync_disk()
    env = dict(ENV, PYTHONPATH=str(tree))
    cmd = [PY, "-m", "ckpt_cli", "convert", str(src), str(out), "--to", "torch", "-q"]
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%e %U %S %M", *cmd],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{done.stderr[-2000:]}")
    wall, user, system, kib = done.stderr.strip().splitlines()[-1].split()
    return float(wall), float(user) + float(system), int(kib) / 1024


def same_values(a: Path, b: Path) -> bool:
    """Whether two torch.save outputs load to the same objects and tensors."""
    script = f"""
import torch
a = torch.load({str(a)!r}, weights_only=True)
b = torch.load({str(b)!r}, weights_only=True)
def same(x, y):
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(same, x, y))
    return x == y
raise SystemExit(0 if same(a, b) else 1)
"""
    return subprocess.run([PY, "-c", script], env=ENV).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another ckpt checkout to measure beside")
    args = parser.parse_args()
    trees = {"this checkout": REPO}
    if args.before is not None:
        trees = {"before": args.before.resolve(), **trees}
    for tree in trees.values():  # bytecode cached, as an installed ckpt has it
        subprocess.run([PY, "-m", "compileall", "-q", str(tree / "ckpt_cli")], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "dcp"
        build(src, args.objects)
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                times[name].append(run(tree, src, Path(tmp) / f"{name}.pt"))
        outputs = [Path(tmp) / f"{name}.pt" for name in trees]
        agree = all(same_values(outputs[0], other) for other in outputs[1:])
        print(f"{args.objects * 3:,} object entries, {args.rounds} rounds, load {os.getloadavg()}")
        print("| ckpt | wall s | CPU s | peak RSS MiB |\n|---|---|---|---|")
        for name, rows in times.items():
            wall, cpu, rss = (statistics.median(column) for column in zip(*rows, strict=True))
            print(f"| {name} | {wall:.2f} | {cpu:.2f} | {rss:.0f} |")
        print("outputs load to the same values" if agree else "OUTPUTS DIFFER")
        if not agree:
            sys.exit(1)


if __name__ == "__main__":
    main()
