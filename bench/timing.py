"""What the bench scripts share: the environment of the measured processes and `measure`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
#: this checkout first on the path; bytecode cached, as an installed ckpt has it (a sandbox
#: with PYTHONDONTWRITEBYTECODE=1 would have every measured process recompile ckpt, ~0.15 s)
ENV = dict(os.environ, PYTHONPATH=str(REPO))
ENV.pop("PYTHONDONTWRITEBYTECODE", None)


def sync_disk() -> None:
    """Write back every dirty page now, so the next measurement does not pay for earlier ones."""
    subprocess.run(["sync"], check=True)


def measure(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one command, started with no dirty pages pending.

    ckpt fsyncs what it writes; without the `sync` first, that fsync would also pay for the
    write-back of whatever the previous step left dirty.
    """
    sync_disk()
    out = subprocess.run(
        ["/usr/bin/time", "-f", "%e %M", *cmd],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{out.stderr[-2000:]}")
    seconds, kib = out.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kib) / 1024
