"""DCP as torch itself writes it (#20): what `dcp.save` writes in the cases 0.1.0 refused.

Every fixture is written by `dcp.save` (one process with `no_dist=True`, or several ranks under
torchrun with gloo) and every output is judged by `dcp.load`, bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from .conftest import run_ckpt
from .dist_helpers import dcp_load_flat, dcp_save, run_torchrun

HERE = Path(__file__).resolve().parent


def load_like(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """`dcp.load` of `path` into zeroed copies of `state`'s tensors (objects as None)."""
    template = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }
    return dcp_load_flat(path, template)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert got[key] == value, key


# --- reshard --world-size with empty chunks ----------------------------------------------


def test_reshard_world_size_with_empty_chunks_loads_like_convert(tmp_path: Path) -> None:
    """A 0-row tensor (N >= 2) and a 1-row tensor (N >= 3) leave several ranks empty-handed."""
    torch.manual_seed(0)
    state = {"empty": torch.zeros(0, 4), "row": torch.randn(1, 4), "w": torch.randn(5, 3)}
    dcp_save(state, tmp_path / "src")
    for n in (2, 3, 4):
        out = tmp_path / f"reshard-{n}"
        result = run_ckpt("reshard", tmp_path / "src", out, "--world-size", str(n), "--json")
        assert result.exit_code == 0, result.stdout + result.stderr
        assert_same(load_like(out, state), state)
        conv = tmp_path / f"convert-{n}"
        result = run_ckpt("convert", tmp_path / "src", conv, "--to", "dcp", "--world-size", str(n))
        assert result.exit_code == 0, result.stdout + result.stderr
        # the same layout as convert writes (which writes what dcp.save writes)
        ours = FileSystemReader(str(out)).read_metadata().state_dict_metadata
        theirs = FileSystemReader(str(conv)).read_metadata().state_dict_metadata
        for key in state:
            assert ours[key].chunks == theirs[key].chunks, (n, key)
        assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(n)]


@pytest.mark.torchrun
def test_three_rank_save_with_empty_shards_reshards_to_three_and_two(tmp_path: Path) -> None:
    src = tmp_path / "three"
    run_torchrun(HERE / "dcp_torch_worker.py", 3, "save", src)
    jobs = []
    for n in (3, 2):
        out = tmp_path / f"out-{n}"
        result = run_ckpt("reshard", src, out, "--world-size", str(n))
        assert result.exit_code == 0, result.stdout + result.stderr
        jobs.append({"path": str(out), "expected": f"{src}.expected.pt", "rules": {}})
    for n, job in zip((3, 2), jobs, strict=True):
        job["own_file"] = True
        jobs_file = tmp_path / f"jobs-{n}.json"
        jobs_file.write_text(json.dumps([job]))
        run_torchrun(HERE / "reshard_worker.py", n, "load", jobs_file)
        summary = json.loads(Path(f"{jobs_file}.result.json").read_text())
        assert summary[0]["problems"] == [] and summary[0]["sharded"] == 4, summary
