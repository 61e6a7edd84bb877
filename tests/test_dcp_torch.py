"""DCP as torch itself writes it (#20): what `dcp.save` writes in the cases 0.1.0 refused.

Every fixture is written by `dcp.save` (one process with `no_dist=True`, or several ranks under
torchrun with gloo) and every output is judged by `dcp.load`, bit-exact.
"""

from __future__ import annotations

import json
import warnings
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


# --- dtypes DCP round-trips ------------------------------------------------------------------


def exotic_state() -> dict[str, torch.Tensor]:
    """One tensor of each dtype `dcp.save` round-trips that 0.1.0 did not know."""
    torch.manual_seed(0)
    return {
        "f32": torch.randn(3, 2),
        "e4m3fnuz": torch.randn(4, 2).to(torch.float8_e4m3fnuz),
        "e5m2fnuz": torch.randn(4, 2).to(torch.float8_e5m2fnuz),
        "c128": torch.randn(3, dtype=torch.complex128),
        "c32": torch.randn(3, dtype=torch.complex64).to(torch.complex32),
        "f4x2": torch.randint(0, 255, (4, 2), dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "u16": torch.randint(0, 60000, (3,), dtype=torch.int32).to(torch.uint16),
        "u32": torch.randint(0, 1 << 31, (3,), dtype=torch.int64).to(torch.uint32),
        "u64": torch.randint(0, 1 << 62, (3,), dtype=torch.int64).to(torch.uint64),
    }


def test_dtypes_dcp_round_trips_are_read_converted_and_resharded(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        state = exotic_state()
        dcp_save(state, tmp_path / "src")
    inspect = run_ckpt("inspect", tmp_path / "src", "--json")
    assert inspect.exit_code == 0, inspect.stdout + inspect.stderr
    tensors = {t["name"]: t for t in inspect.json["result"]["entries"]}
    for name, value in state.items():
        assert tensors[name]["dtype"] == str(value.dtype).removeprefix("torch.")
        assert tensors[name]["nbytes"] == value.numel() * value.element_size()
    verify = run_ckpt("verify", tmp_path / "src", "--deep")
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    for args in (["convert", "--to", "dcp"], ["reshard", "--world-size", "2"]):
        out = tmp_path / args[0]
        result = run_ckpt(args[0], tmp_path / "src", out, *args[1:])
        assert result.exit_code == 0, result.stdout + result.stderr
        assert_same(load_like(out, state), state)
        assert run_ckpt("diff", tmp_path / "src", out).exit_code == 0
    result = run_ckpt("convert", tmp_path / "src", tmp_path / "t.pt", "--to", "torch")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert_same(torch.load(tmp_path / "t.pt", weights_only=True), state)


def test_dtype_safetensors_cannot_store_is_a_clear_refusal(tmp_path: Path) -> None:
    dcp_save({"c128": torch.randn(3, dtype=torch.complex128)}, tmp_path / "src")
    result = run_ckpt("convert", tmp_path / "src", tmp_path / "out", "--to", "safetensors")
    assert result.exit_code == 4
    assert "complex128" in result.stderr and "c128" in result.stderr
    assert not (tmp_path / "out").exists()
