"""Memory on checkpoints of many small entries (#20): a data command's peak RSS may grow with
the entry count only by what its output needs per entry (names, offsets, the report line), a
KiB or a few, never by a tensor, a buffer or an open file per entry.

Measured in a real process (`ru_maxrss` of the `ckpt` child, from `os.wait4`), on two DCPs
written once by `dcp.save` with 500 and 3,000 tiny tensors: the growth between them, per added
entry, is bounded per command. The bounds sit between this version (records sharing their
pydantic fields set, see bench/bench_memory.py) and the one before, which used about 11 KiB
(convert), 17 (reshard to 2 ranks), 5.5 (diff) and 2.6 (verify --deep) per entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

FEW, MANY = 500, 3000


def _small_dcp(path: Path, count: int) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The two DCPs every command is measured on (written once for the module)."""
    root = tmp_path_factory.mktemp("many-entries")
    return {count: _small_dcp(root / f"src{count}", count) for count in (FEW, MANY)}


def _peak_bytes(*args: str | Path) -> int:
    """Peak RSS of one `python -m ckpt_cli ARGS` process (its own rusage, from wait4)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "ckpt_cli", *map(str, args)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == 0, stderr
    return usage.ru_maxrss * 1024


@pytest.mark.parametrize(
    ("command", "bound_kib"),
    [
        (["convert", "{src}", "{out}", "--to", "dcp"], 9),
        (["reshard", "{src}", "{out}", "--world-size", "2"], 13),
        (["diff", "{src}", "{src}"], 4),
        (["verify", "{src}", "--deep"], 2.2),
    ],
    ids=["convert", "reshard", "diff", "verify-deep"],
)
def test_peak_memory_per_small_entry_is_bounded(
    tmp_path: Path, sources: dict[int, Path], command: list[str], bound_kib: float
) -> None:
    peaks = []
    for count, src in sources.items():
        args = [a.format(src=src, out=tmp_path / f"out{count}") for a in command]
        peaks.append(_peak_bytes(*args))
    per_entry = (peaks[1] - peaks[0]) / (MANY - FEW)
    assert per_entry < bound_kib * 1024, (
        f"{command[0]}: peak RSS grows {per_entry / 1024:.1f} KiB per entry "
        f"({peaks[0] >> 20} MiB at {FEW}, {peaks[1] >> 20} MiB at {MANY} entries)"
    )
