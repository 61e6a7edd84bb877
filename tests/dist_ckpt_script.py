"""Run several `ckpt` command lines in one torchrun launch (one process-group setup for all).

Usage: `torchrun … tests/dist_ckpt_script.py COMMANDS.json OUT_DIR`. COMMANDS.json is a list of
argument lists; each runs through `ckpt_cli.cli.app.main` exactly as `python -m ckpt_cli` would (the
CLI reuses the process group initialised here). Each rank writes `OUT_DIR/rank{R}.json`: per
command, its exit code and what it printed on stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch.distributed as dist

from ckpt_cli.cli.app import main as ckpt_main
from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first


def main() -> None:
    commands = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    results = []
    for argv in commands:
        buffer = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(buffer):
            try:
                ckpt_main(argv)
            except SystemExit as exc:
                code = int(exc.code or 0)
        results.append({"argv": argv, "code": code, "stdout": buffer.getvalue()})
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
