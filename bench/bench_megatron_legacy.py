"""A whole legacy Megatron-LM save of many rank folders: `inspect` / `verify` CPU, in processes.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_megatron_legacy.py [--grids 8x8,16x16]
        [--dir D] [--code-root OTHER_CHECKOUT ...]

Each grid TPxPP is one save, `iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt` per rank (the dict
Megatron-LM's `generate_state_dict` builds, written with `torch.save`, as in
tests/test_megatron_legacy.py: the run's `argparse.Namespace`, a small model shard, its Adam
state, Python's, numpy's and torch's RNG states) and the tracker naming it. Printed: CPU (user +
system, least of 3) of `ckpt inspect SAVE` and `ckpt verify SAVE`, and the cost of one more rank
folder (the difference between the two largest grids over their difference in folders).

Each `--code-root` (a checkout of ckpt, e.g. `git archive main | tar -x -C /tmp/base`) is measured
in the same run, for before/after figures. By hand, never in tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_many_entries import REPO, child

#: writes one save; a child of its own, so this process never holds torch
WRITE_SAVE = """
import argparse, random, sys
from pathlib import Path
import numpy as np
import torch

root, tp_size, pp_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
args = argparse.Namespace(
    num_layers=pp_size, hidden_size=8, tensor_model_parallel_size=tp_size,
    pipeline_model_parallel_size=pp_size, expert_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, ckpt_format="torch", lr=0.1, seed=1234,
)
for tp in range(tp_size):
    for pp in range(pp_size):
        torch.manual_seed(100 * tp + pp)
        shard = {
            f"decoder.layers.{pp}.mlp.linear_fc1.weight": torch.randn(16, 8),
            f"decoder.layers.{pp}.self_attention.linear_proj.weight": torch.randn(8, 16),
        }
        params = [torch.nn.Parameter(t.clone()) for t in shard.values()]
        optimizer = torch.optim.Adam(params, lr=0.1)
        sum(p.sum() for p in params).backward()
        optimizer.step()
        state = {
            "args": args, "checkpoint_version": 3.0, "iteration": 10, "model": shard,
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": {"num_steps": 320, "max_lr": 0.1},
            "rng_state": [{
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }],
            "num_floating_point_operations_so_far": 0,
        }
        rank = root / "iter_0000010" / f"mp_rank_{tp:02d}_{pp:03d}"
        rank.mkdir(parents=True)
        torch.save(state, rank / "model_optim_rng.pt")
(root / "latest_checkpointed_iteration.txt").write_text("10")
"""


def save(root: Path, tp: int, pp: int) -> Path:
    folder = root / f"save{tp}x{pp}"
    if not folder.exists():
        subprocess.run(
            [sys.executable, "-c", WRITE_SAVE, str(folder), str(tp), str(pp)], check=True
        )
    return folder / "iter_0000010"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", default="8x8,16x16")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (saves kept)")
    parser.add_argument("--code-root", type=Path, action="append", default=None)
    args = parser.parse_args()
    roots = args.code_root or [REPO]
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-megatron-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    grids = [tuple(int(n) for n in g.split("x")) for g in args.grids.split(",")]
    for command in ("inspect", "verify"):
        for code in roots:
            cpu: list[tuple[int, float]] = []
            for tp, pp in grids:
                argv = [*ckpt, command, str(save(root, tp, pp))]
                seconds = min(child(argv, code)[1] for _ in "123")
                cpu.append((tp * pp, seconds))
                print(f"{tp * pp} rank folders, ckpt {command} [{code}]: {seconds:.2f}s CPU")
            if len(cpu) > 1:
                (few, low), (many, high) = cpu[-2], cpu[-1]
                each = (high - low) / (many - few) * 1000
                print(f"  one more rank folder, ckpt {command} [{code}]: {each:.1f} ms CPU")


if __name__ == "__main__":
    main()
