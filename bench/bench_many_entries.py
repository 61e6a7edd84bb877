"""Many small entries (#30): `convert --to dcp` peak RSS and `inspect` / `verify` CPU, in processes.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_many_entries.py [--counts 20000,100000]
        [--dir D] [--code-root OTHER_CHECKOUT ...]

1. A DCP of N tiny tensors written by `dcp.save`: `ckpt convert SRC OUT --to dcp`, its peak RSS
   (`ru_maxrss`) and CPU (user + system) from `os.wait4` of the child. Target: 100,000 entries
   within 250 MiB.
2. Sharded safetensors of N tensors (sparse data, `bench_metadata.build`): `ckpt inspect --json`,
   `ckpt inspect`, `ckpt verify` CPU (least of 3) against the raw header loop as a process.
   Targets: 20,000 tensors within 3x the raw loop, 100,000 within 2 s.

Each `--code-root` (a checkout of ckpt, e.g. `git worktree add /tmp/base main`) is measured in
the same run, for before/after figures. By hand, never in tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_metadata import RAW_LOOP, build

REPO = Path(__file__).resolve().parents[1]


def child(argv: list[str], code_root: Path) -> tuple[float, float]:
    """(peak RSS MiB, CPU seconds) of `argv` run with `code_root` on the path."""
    env = dict(os.environ, PYTHONPATH=str(code_root))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / f"ckpt-pyc-{code_root.name}")
    # run from the checkout: `python -m` puts the working folder first on the path
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=code_root
    )
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


#: writes the DCP source; run as a child of its own so that this process never holds torch: a
#: child's `ru_maxrss` starts from its parent's high-water mark (Linux keeps it across the
#: fork and the exec), so a parent that built 100,000 tensors would lend them its ~700 MiB
WRITE_DCP = """
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp

path, count = sys.argv[1], int(sys.argv[2])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state = {f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}
    dcp.save(state, checkpoint_id=path, no_dist=True)
"""


def small_dcp(path: Path, count: int) -> Path:
    if not path.exists():
        subprocess.run([sys.executable, "-c", WRITE_DCP, str(path), str(count)], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="20000,100000")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (sources kept)")
    parser.add_argument("--code-root", type=Path, action="append", default=None)
    args = parser.parse_args()
    roots = args.code_root or [REPO]
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-many-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    for count in (int(c) for c in args.counts.split(",")):
        src = small_dcp(root / f"dcp{count}", count)
        for code in roots:
            out = root / "out"
            shutil.rmtree(out, ignore_errors=True)
            peak, cpu = child([*ckpt, "convert", str(src), str(out), "--to", "dcp"], code)
            print(
                f"{count} entries, convert --to dcp [{code}]: peak {peak:.0f} MiB, {cpu:.2f}s CPU"
            )
        shutil.rmtree(root / "out", ignore_errors=True)
        folder = build(root, f"st{count}", max(1, count // 100), 100, [4])
        raw = min(child([sys.executable, "-c", RAW_LOOP, str(folder)], roots[0])[1] for _ in "123")
        print(f"{count} tensors, raw header loop: {raw:.2f}s CPU")
        for command in (["inspect", "--json"], ["inspect"], ["verify"]):
            for code in roots:
                argv = [*ckpt, command[0], str(folder), *command[1:]]
                cpu = min(child(argv, code)[1] for _ in "123")
                print(f"  ckpt {' '.join(command)} [{code}]: {cpu:.2f}s CPU ({cpu / raw:.1f}x raw)")


if __name__ == "__main__":
    main()
