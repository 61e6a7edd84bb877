"""`ckpt doctor` on a large checkpoint pair: peak memory and time against one read of both
saves. By hand, never in tests.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_doctor.py [--tensor-mb 16] [--tensors 10]

Two DCP saves (`dcp.save`, one process) of a model of `--tensors` float32 weights of
`--tensor-mb` each, with AdamW state (`step`, `exp_avg`, `exp_avg_sq`) and an EMA copy: with the
defaults 640 MiB per save, 1.25 GiB for the pair. The save after has its optimizer step counts
restarted, so the doctor reads every tensor it can: the weights of both saves, the second
moments of both (the optimizer evidence) and the EMA check's three tensors at a time. It reads
them as raw bytes in 1 MiB blocks through numpy and never imports torch: its peak is its own
imports plus a few blocks, whatever the tensor sizes.
Baselines: `cat` of both saves' files (one read of both), `dcp.load` of both saves (what
a script comparing them would do), and importing ckpt alone (the floor of any ckpt command).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

from timing import PY, measure

LOAD_BOTH = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.simplefilter("ignore")
for path in sys.argv[1:]:
    md = dcp.FileSystemReader(path).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    del state
"""


def build(root: Path, tensors: int, tensor_mb: int) -> tuple[Path, Path]:
    import torch
    import torch.distributed.checkpoint as dcp

    rows = tensor_mb * (1 << 20) // 4 // 1024
    gen = torch.Generator().manual_seed(0)
    paths = []
    for step, restarted in ((2, False), (4, True)):
        model = {f"layer{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(tensors)}
        state = {
            "model": model,
            "ema": {k: v * 0.9 for k, v in model.items()},
            "optimizer": {
                "state": {
                    i: {
                        "step": torch.tensor(float(2 if restarted else step)),
                        "exp_avg": torch.zeros(rows, 1024),
                        "exp_avg_sq": torch.full((rows, 1024), 1e-6),
                    }
                    for i in range(tensors)
                },
                "param_groups": [{"lr": 1e-3, "params": list(range(tensors))}],
            },
            "train_state": {"step": step},
        }
        path = root / f"step-{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(path), no_dist=True)
        paths.append(path)
        del state, model
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=10)
    parser.add_argument("--tensor-mb", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a, b = build(Path(tmp), args.tensors, args.tensor_mb)
        size = sum(f.stat().st_size for p in (a, b) for f in p.iterdir()) / (1 << 20)
        files = [str(f) for p in (a, b) for f in sorted(p.iterdir())]
        runs = {
            "ckpt doctor --before --after": [
                "sh",
                "-c",
                # it exits 1: it finds the planted cause
                '"$0" -m ckpt_cli doctor --before "$1" --after "$2" --json; test $? -eq 1',
                PY,
                str(a),
                str(b),
            ],
            "import ckpt only": [PY, "-c", "import ckpt_cli.cli.app"],
            "cat both saves": ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            "dcp.load both saves": [PY, "-c", LOAD_BOTH, str(a), str(b)],
        }
        print(f"pair: {size:.0f} MiB, largest tensor {args.tensor_mb} MiB")
        results = {}
        for label, cmd in runs.items():
            measure(cmd)  # warm the page cache: every run reads from memory
            results[label] = measure(cmd)
        cat_s = results["cat both saves"][0]
        for label, (seconds, mib) in results.items():
            ratio = f"{seconds / cat_s:.1f}× cat" if cat_s else ""
            print(f"  {label:<32} {seconds:6.2f} s  {ratio:>10}  peak RSS {mib:7.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
