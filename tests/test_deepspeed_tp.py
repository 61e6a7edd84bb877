"""Tensor-parallel DeepSpeed ZeRO-2/3 (2 data- x 2 model-parallel ranks, gloo, CPU), written by
DeepSpeed itself with a Megatron-style `mpu` (tests/deepspeed_tp_script.py): ckpt rebuilds
each model-parallel rank's fp32 weights, bit-identical to `zero_to_fp32` run on that rank's
files, and demands every partition of every mp rank."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt
from .dist_helpers import run_torchrun

pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed: `make frameworks` installs it (DS_BUILD_OPS=0)",
)

# the session fixture's 4-rank run (a 900 s limit of its own) is set up inside the first test
# that asks for it: pytest's default 300 s would stop it under load
pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(1800)]
SCRIPT = Path(__file__).resolve().parent / "deepspeed_tp_script.py"
MP = 2


@pytest.fixture(scope="session")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zero2/` and `zero3/` saved by `engine.save_checkpoint` on 4 ranks (dp 2 x mp 2)."""
    out = tmp_path_factory.mktemp("deepspeed-tp")
    run_torchrun(SCRIPT, 4, out, timeout=900)
    return out


def _reference(run: Path, mp_rank: int, scratch: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own `zero_to_fp32` on one mp rank's files alone (it reads `mp_rank_00`
    names, so that rank's files are copied under them first)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = next(run.glob("global_step*"))
    alone = scratch / f"mp{mp_rank}" / tag.name
    alone.mkdir(parents=True)
    mine = f"mp_rank_{mp_rank:02d}_"
    for file in tag.glob(f"*{mine}*"):
        shutil.copy(file, alone / file.name.replace(mine, "mp_rank_00_"))
    state = get_fp32_state_dict_from_zero_checkpoint(str(alone.parent), tag=tag.name)
    return {k: v.contiguous() for k, v in state.items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_each_model_parallel_rank_is_rebuilt_bit_exact(
    tp_runs: Path, stage: int, tmp_path: Path
) -> None:
    run = tp_runs / f"zero{stage}"
    expected = [_reference(run, t, tmp_path / "ref") for t in range(MP)]
    assert not torch.equal(expected[0]["0.weight"], expected[1]["0.weight"])
    report = run_ckpt("inspect", run, "--json").json["result"]
    training = report["training"]
    assert training["layout"] == "deepspeed"
    assert training["weights"]["tensors"] == sum(len(e) for e in expected) == 8
    assert training["weights"]["parameters"] == 2 * 357
    assert run_ckpt("verify", run).exit_code == 0
    for t, truth in enumerate(expected):
        out = tmp_path / f"mp{t}.safetensors"
        select = f"model.mp_rank_{t:02d}"
        result = run_ckpt("convert", run, out, "--to", "safetensors", "--select", select)
        assert result.exit_code == 0, result.stdout + result.stderr
        got = load_file(out)
        assert got.keys() == truth.keys()
        for name, tensor in truth.items():
            assert got[name].dtype == tensor.dtype == torch.float32
            assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), name


def test_a_missing_partition_of_one_model_parallel_rank_fails_verify(
    tp_runs: Path, tmp_path: Path
) -> None:
    for stage in (2, 3):
        run = shutil.copytree(tp_runs / f"zero{stage}", tmp_path / f"zero{stage}")
        lost = next(run.glob("global_step*/*zero_pp_rank_1_mp_rank_01_optim_states.pt"))
        lost.unlink()
        result = run_ckpt("verify", run, "--json")
        assert result.exit_code == 1
        missing = [p for p in result.json["result"]["problems"] if p["code"] == "missing_partition"]
        assert len(missing) == 1 and lost.name in missing[0]["message"]
        out = tmp_path / f"w{stage}.safetensors"
        result = run_ckpt(
            "convert", run, out, "--to", "safetensors", "--select", "model.mp_rank_00"
        )
        assert result.exit_code == 3
    # ZeRO-1/2: each mp rank's model-states file is needed too
    run = shutil.copytree(tp_runs / "zero2", tmp_path / "no-model-states")
    (next(run.glob("global_step*")) / "mp_rank_01_model_states.pt").unlink()
    result = run_ckpt("verify", run, "--json")
    assert result.exit_code == 1
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert "missing_partition" in codes


def test_world_size_reshard_of_a_tensor_parallel_zero_save_is_refused(
    tp_runs: Path, tmp_path: Path
) -> None:
    """`reshard --world-size` re-cuts the data-parallel ZeRO partitions only: a tensor-parallel
    save (`mp_rank_01`) is refused (exit 2) naming why and DeepSpeed's universal checkpoint as
    the way; nothing is written."""
    out = tmp_path / "out"
    for stage in (2, 3):
        result = run_ckpt("reshard", tp_runs / f"zero{stage}", out, "--world-size", "1", "--json")
        assert result.exit_code == 2, result.stdout
        error = result.json["error"]
        assert "tensor-parallel" in error["message"] and "mp_rank_01" in error["message"]
        assert "ds_to_universal.py" in error["fix"] and "load_universal" in error["fix"]
        assert not out.exists()
