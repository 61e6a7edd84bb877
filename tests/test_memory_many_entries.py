"""Memory on checkpoints of many small entries (#20): a data command's peak RSS may grow with
the entry count only by what its output needs per entry (names, offsets, the report line), a
KiB or a few, never by a tensor, a buffer or an open file per entry.

Measured in a real process (`ru_maxrss` of the `ckpt` child), on DCPs
written once by `dcp.save` with 500, 3,000 and 12,000 tiny tensors: the growth between two of
them, per added entry, is bounded per command. diff and verify --deep use the larger pair:
below a few thousand entries their peak is still torch's import, not the records. The bounds
sit between this version (records sharing their pydantic fields set, see
bench/bench_memory.py: about 7.2, 9.2, 2.7 and 1.4 KiB) and the one before, which grew about
11.4 KiB (convert), 16.9 (reshard to 2 ranks), 5.7 (diff) and 3.0 (verify --deep) per entry on
these pairs. The metadata commands, `inspect --json` and plain `verify`, grow about 2.0 KiB per
entry (#30: DCP stand-ins in slots and let go as the manifest is built, one parse shared by
verify's check and open); before, 3.7 and 3.6. `convert --to dcp` on the larger pair grows
about 2.9 KiB per entry (#30: `.metadata` without a memo of every object to read back, one
slotted record per written entry, the plan let go before the output check); before, 3.9.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .dist_helpers import many_entries_dcp

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SMALL, LARGE = (500, 3000), (3000, 12000)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The two DCPs every command is measured on (written once for the module)."""
    root = tmp_path_factory.mktemp("many-entries")
    return {count: many_entries_dcp(root / f"src{count}", count) for count in {*SMALL, *LARGE}}


def _peak_bytes(*args: str | Path) -> int:
    """Peak RSS of `python -m ckpt_cli ARGS` (under a small fresh parent, so RUSAGE_CHILDREN is
    its own: a child forked from pytest would start with pytest's RSS as its maximum)."""
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
    ("command", "counts", "bound_kib"),
    [
        (["convert", "{src}", "{out}", "--to", "dcp"], SMALL, 9.5),
        (["convert", "{src}", "{out}", "--to", "dcp"], LARGE, 3.4),
        (["reshard", "{src}", "{out}", "--world-size", "2"], SMALL, 12),
        (["diff", "{src}", "{src}"], LARGE, 4),
        (["verify", "{src}", "--deep"], LARGE, 2.2),
        (["inspect", "{src}", "--json"], LARGE, 2.8),
        (["verify", "{src}"], LARGE, 2.8),
    ],
    ids=["convert", "convert-large", "reshard", "diff", "verify-deep", "inspect-json", "verify"],
)
def test_peak_memory_per_small_entry_is_bounded(
    tmp_path: Path,
    sources: dict[int, Path],
    command: list[str],
    counts: tuple[int, int],
    bound_kib: float,
) -> None:
    few, many = counts
    peaks = []
    for count in counts:
        args = [a.format(src=sources[count], out=tmp_path / f"out{count}") for a in command]
        peaks.append(_peak_bytes(*args))
    per_entry = (peaks[1] - peaks[0]) / (many - few)
    assert per_entry < bound_kib * 1024, (
        f"{command[0]}: peak RSS grows {per_entry / 1024:.1f} KiB per entry "
        f"({peaks[0] >> 20} MiB at {few}, {peaks[1] >> 20} MiB at {many} entries)"
    )
