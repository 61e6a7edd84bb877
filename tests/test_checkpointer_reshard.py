"""A save of `ckpt_cli.Checkpointer`, resharded with `ckpt reshard --world-size`, resumed.

A user's story: a training loop saves through the Checkpointer
(`tests/checkpointer_reshard_worker.py`: an MLP, AdamW, a StepLR schedule, a Stateful data
loader with int keys, the RNG state and the step) in one process; the run is to go on with 2
ranks, so `ckpt reshard SAVE OUT --world-size 2` cuts it for them. The Checkpointer's own record
holds an entry per rank (`__ckpt__.shapes.rank-0`): ckpt's bookkeeping, which the reshard cuts
for the new world size itself, so no `--rank-state` is asked for. The output is judged by
`dcp.load` and by the Checkpointer's own `load_latest`, in one process and on 2 gloo ranks:
model and optimizer bit-exact, the loader's int keys back on every rank. The per-rank values a
2-rank save keeps under the record (`__ckpt__.ranks.rank-1.rng.torch`) are the user's RNG
state: they still need the choice.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .dist_helpers import run_torchrun, torchrun_env
from .torchtitan_writer import flat_state

WORKER = Path(__file__).resolve().parent / "checkpointer_reshard_worker.py"


def _worker(mode: str, run: Path, out: Path) -> None:
    """The worker in one process (`save` or `load`); fails with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), mode, str(run), str(out)],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _state(out: Path, rank: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
    return state


def assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Every tensor of `want` (model and optimizer state dicts), bit for bit, and the rest."""
    flat_got, flat_want = flat_state(got), flat_state(want)
    assert flat_got.keys() == flat_want.keys()
    for name, value in flat_want.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == flat_got[name].dtype and torch.equal(flat_got[name], value), name
        else:
            assert flat_got[name] == value, name


def dcp_loaded(save: Path, like: dict[str, Any]) -> dict[str, Any]:
    """The model and optimizer of a DCP folder, read by `dcp.load` itself (one process)."""
    import torch.distributed.checkpoint as dcp

    def empty(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: empty(v) for k, v in value.items()}
        return torch.empty_like(value) if isinstance(value, torch.Tensor) else value

    target = {"model": empty(like["model"]), "optimizer": empty(like["optimizer"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(save), no_dist=True)
    return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A one-process Checkpointer save (`run/step-3`) and what the loop saved in it."""
    root = tmp_path_factory.mktemp("one-rank")
    _worker("save", root / "run", root / "saved")
    return root / "run" / "step-3", _state(root / "saved")


@pytest.mark.slow
def test_a_one_process_save_reshards_for_two_ranks_without_rank_state_and_resumes(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    save, state = saved
    (tmp_path / "run2").mkdir()
    out = tmp_path / "run2" / "step-3"
    # it used to stop with exit 2: "holds per-rank training state ...: __ckpt__.shapes.rank-0"
    result = run_ckpt("reshard", save, out, "--world-size", "2", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert (report["source_world_size"], report["world_size"]) == (1, 2)
    assert report["rank_state"] == [] and report["rank_state_action"] is None
    assert (out / "__0_0.distcp").is_file() and (out / "__1_0.distcp").is_file()

    # ckpt's record, cut for 2 ranks: each rank has its shapes, the world size says 2
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(out)).read_metadata()
    assert {"__ckpt__.shapes.rank-0", "__ckpt__.shapes.rank-1"} <= set(metadata.state_dict_metadata)
    record = {"__ckpt__.world_size": None, "__ckpt__.layout": None}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(record, checkpoint_id=str(out), no_dist=True)
    assert record == {"__ckpt__.world_size": 2, "__ckpt__.layout": 1}

    # the real readers: dcp.load, and the Checkpointer's own resume in one process
    assert_same_tensors(dcp_loaded(out, state), {k: state[k] for k in ("model", "optimizer")})
    _worker("load", tmp_path / "run2", tmp_path / "loaded")
    loaded = _state(tmp_path / "loaded")
    for key in ("model", "optimizer", "scheduler", "data"):
        assert_same_tensors(loaded[key], state[key])
    assert list(loaded["data"]["seen"]) == [1, 2, 3]  # int keys, as saved
    assert loaded["step"] == 3 and torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    verdict = run_ckpt("verify", out, "--resumable")
    assert verdict.exit_code == 0, verdict.stdout + verdict.stderr


@pytest.mark.torchrun
def test_the_resharded_save_resumes_on_two_ranks_and_a_new_rank_is_told_its_values_are_missing(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    save, state = saved
    (tmp_path / "run2").mkdir()
    result = run_ckpt("reshard", save, tmp_path / "run2" / "step-3", "--world-size", "2")
    assert result.exit_code == 0, result.stdout + result.stderr
    run_torchrun(WORKER, 2, "load", tmp_path / "run2", tmp_path / "loaded")
    for rank in (0, 1):
        loaded = _state(tmp_path / "loaded", rank)
        for key in ("model", "optimizer", "scheduler", "data"):
            assert_same_tensors(loaded[key], state[key])
        assert list(loaded["data"]["seen"]) == [1, 2, 3] and loaded["data"]["pending"] == {}
    # rank 1 never had RNG state or counters of its own: named, not a KeyError, and on every
    # rank alike (rank 0 used to load its values and train on while rank 1 raised)
    for rank in (0, 1):
        refused = _state(tmp_path / "loaded", rank)["refused"]
        assert "holds no values of rank 1 (such as 'rng')" in refused, refused


@pytest.mark.torchrun
def test_a_two_rank_save_still_asks_about_its_per_rank_values_and_not_about_the_record(
    tmp_path: Path,
) -> None:
    run_torchrun(WORKER, 2, "save", tmp_path / "run", tmp_path / "saved")
    save = tmp_path / "run" / "step-3"
    (tmp_path / "one").mkdir()
    asked = run_ckpt("reshard", save, tmp_path / "one" / "step-3", "--world-size", "1")
    assert asked.exit_code == 2
    assert "__ckpt__.ranks.rank-1.rng.torch" in asked.stderr
    assert "__ckpt__.shapes" not in asked.stderr and "__ckpt__.world_size" not in asked.stderr

    # replicate: rank 2 gets rank 1's values (rank 0 keeps its own under their own names)
    (tmp_path / "three").mkdir()
    three = run_ckpt(
        "reshard", save, tmp_path / "three" / "step-3", "--world-size", "3",
        "--rank-state", "replicate", "--json",
    )  # fmt: skip
    assert three.exit_code == 0, three.stdout + three.stderr
    written = {e["name"]: e["written"] for e in three.json["result"]["rank_state"]}
    assert written["__ckpt__.ranks.rank-1.rng.torch"] == [
        "__ckpt__.ranks.rank-1.rng.torch",
        "__ckpt__.ranks.rank-2.rng.torch",
    ]
    from torch.distributed.checkpoint import FileSystemReader

    names = set(
        FileSystemReader(str(tmp_path / "three" / "step-3")).read_metadata().state_dict_metadata
    )
    assert {f"__ckpt__.shapes.rank-{r}" for r in range(3)} <= names
    assert not any(n.startswith("__ckpt__.ranks.rank-0.") for n in names)

    # drop, down to one process: the Checkpointer resumes it with rank 0's own values
    dropped = run_ckpt(
        "reshard", save, tmp_path / "one" / "step-3", "--world-size", "1", "--rank-state", "drop"
    )
    assert dropped.exit_code == 0, dropped.stdout + dropped.stderr
    _worker("load", tmp_path / "one", tmp_path / "loaded")
    loaded, rank0 = _state(tmp_path / "loaded"), _state(tmp_path / "saved", 0)
    for key in ("model", "optimizer", "scheduler", "data"):
        assert_same_tensors(loaded[key], rank0[key])
    assert torch.equal(loaded["rng"]["torch"], rank0["rng"]["torch"])
