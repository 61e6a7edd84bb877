"""Memory on checkpoints of many small entries (#20): a data command's peak RSS may grow with
the entry count only by what its output needs per entry (names, offsets, the report line), a
few KiB at most, never by a tensor, a buffer or an open file per entry.

Measured in a real process (`ru_maxrss` of a child), on two DCPs written by `dcp.save` with
500 and 2,500 tiny tensors: the growth between them, per added entry, is bounded. The bound
is generous (about 2.5x what this version uses: pydantic entry records dominate, see
bench/README.md) so that only a real per-entry leak, not noise, fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: bytes of peak RSS per added entry; this version: about 12 KiB (convert, reshard), 6 (diff), 3.5 (verify --deep)
PER_ENTRY_BOUND = 32 * 1024


def _small_dcp(path: Path, count: int) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _peak_bytes(*args: str | Path) -> int:
    """Peak RSS of `python -m ckpt_cli ARGS` (a fresh parent, so RUSAGE_CHILDREN is its own)."""
    code = (
        "import resource, subprocess, sys; "
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "ckpt_cli", *map(str, args)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    rc, kib = proc.stdout.split()[-2:]
    assert rc == "0", proc.stdout + proc.stderr
    return int(kib) * 1024


@pytest.mark.parametrize(
    "command",
    [
        ["convert", "{src}", "{out}", "--to", "dcp"],
        ["reshard", "{src}", "{out}", "--world-size", "2"],
        ["diff", "{src}", "{src}"],
        ["verify", "{src}", "--deep"],
    ],
    ids=["convert", "reshard", "diff", "verify-deep"],
)
def test_peak_memory_per_small_entry_is_bounded(tmp_path: Path, command: list[str]) -> None:
    few, many = 500, 2500
    peaks = []
    for count in (few, many):
        src = _small_dcp(tmp_path / f"src{count}", count)
        args = [a.format(src=src, out=tmp_path / f"out{count}") for a in command]
        peaks.append(_peak_bytes(*args))
    per_entry = (peaks[1] - peaks[0]) / (many - few)
    assert per_entry < PER_ENTRY_BOUND, (
        f"{command[0]}: peak RSS grows {per_entry / 1024:.1f} KiB per entry "
        f"({peaks[0] >> 20} MiB at {few}, {peaks[1] >> 20} MiB at {many} entries)"
    )
