"""A Trainer save that logs every step: CPU and peak RSS of the commands that read it.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_trainer_log.py [--rows 60000,300000]
        [--dir D] [--code-root OTHER_CHECKOUT ...]

A real Trainer run (`python -m tests.framework_fixtures trainer`: tiny Llama, `checkpoint-4`)
whose `trainer_state.json` is given `rows` logged steps of five values each by transformers'
`TrainerState.save_to_json` (what `Trainer._save_checkpoint` writes); a second copy differs in
the last loss, a third holds the same log written without indents. Each command runs as a
child process; CPU (user + system) and peak RSS (`ru_maxrss`) come from `os.wait4`, with the
exit code (a refusal is exit 4, or 1 from verify). Each `--code-root` (a checkout of ckpt,
e.g. `git worktree add /tmp/base main`) is measured in the same run, for before/after
figures. By hand, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(argv: list[str], code_root: Path) -> tuple[int, float, float]:
    """(exit code, peak RSS MiB, CPU seconds) of `argv` run with `code_root` on the path."""
    env = dict(os.environ, PYTHONPATH=str(code_root))
    # run from the checkout: `python -m` puts the working folder first on the path
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=code_root
    )
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def with_log(src: Path, dest: Path, rows: int, last_loss: float | None = None) -> Path:
    """A copy of the Trainer save `src` logging `rows` steps (in a child: transformers)."""
    code = """
import shutil, sys
from transformers import TrainerState
src, dest, rows, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
shutil.copytree(src, dest)
state = TrainerState.load_from_json(dest + "/trainer_state.json")
state.log_history = [
    {"loss": 4.0 - i / rows, "grad_norm": 1.0 + (i % 7) / 10,
      "learning_rate": 1e-3 * (1 - i / rows), "epoch": i / 1000, "step": i + 1}
    for i in range(rows)
]
if last != "-":
    state.log_history[-1]["loss"] = float(last)
state.save_to_json(dest + "/trainer_state.json")
"""
    last = "-" if last_loss is None else str(last_loss)
    argv = [sys.executable, "-c", code, str(src), str(dest), str(rows), last]
    subprocess.run(argv, check=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="60000,300000")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--code-root", type=Path, action="append", default=[])
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-log-"))
    run = work / "run"
    if not (run / "straight" / "checkpoint-4").is_dir():
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        argv = [sys.executable, "-m", "tests.framework_fixtures", "trainer", str(run)]
        subprocess.run(argv, check=True, env=env, cwd=REPO, capture_output=True)
    src = run / "straight" / "checkpoint-4"
    roots = [REPO, *args.code_root]
    py = [sys.executable, "-m", "ckpt_cli"]
    for rows in (int(r) for r in args.rows.split(",")):
        base = work / f"rows{rows}"
        shutil.rmtree(base, ignore_errors=True)
        a = with_log(src, base / "a" / "checkpoint-4", rows)
        b = with_log(src, base / "b" / "checkpoint-4", rows, last_loss=99.0)
        c = base / "c" / "checkpoint-4"
        shutil.copytree(a, c)
        state = json.loads((c / "trainer_state.json").read_text())
        (c / "trainer_state.json").write_text(json.dumps(state))
        out = base / "out.pt"
        commands = {
            "inspect": ["inspect", str(a)],
            "inspect --json": ["inspect", str(a), "--json"],
            "verify --resumable": ["verify", str(a), "--resumable"],
            "diff (last loss differs)": ["diff", str(a), str(b)],
            "diff (same log, re-written)": ["diff", str(a), str(c)],
            "convert --to torch": ["convert", str(a), str(out), "--to", "torch"],
        }
        print(f"\n{rows:,} logged steps ({rows * 5:,} values), {a / 'trainer_state.json'}:")
        print(f"  {'command':30} {'code root':28} {'exit':>4} {'CPU s':>7} {'peak MiB':>9}")
        for name, argv in commands.items():
            for root in roots:
                shutil.rmtree(out, ignore_errors=True)
                out.unlink(missing_ok=True)
                code, peak, cpu = child([*py, *argv], root)
                print(f"  {name:30} {str(root)[-28:]:28} {code:>4} {cpu:7.2f} {peak:9.0f}")


if __name__ == "__main__":
    main()
