"""Multi-process accelerate saves that lost a file: a user's story.

Every process of `Accelerator.save_state` writes its own `random_states_{rank}.pkl` (rank 0
after the model, optimizer and scheduler), and `load_state` restores nothing for a rank whose
file is missing: it logs a line and goes on, so the resumed run is silently not the run it
continues. accelerate records the number of processes nowhere, so ckpt takes it from the save's
own files: a higher rank's RNG file, an FSDP DCP folder's `__{rank}_0.distcp`, a per-rank FSDP
file. `verify` must fail such a save, naming the file, `inspect` must call it not exact, and
`latest` must never name it (a save whose rank 0 has not written its RNG states yet is still
being written). Where the names cannot tell a lost file from one on another node's disk (a DDP
save without rank 0's: node 1's folder of a `save_on_each_node` run), `verify` warns and the
save is complete once settled, so `prune --incomplete` never deletes a node's own saves; unless
the run's save before it holds the file, which no node's folder does: then it was lost, as a
lost highest rank's file is. The truth is accelerate's own `load_state` on 2 ranks
(`tests/accelerate_fsdp_script.py`).

The same holds for each prepared object's state: `save_state` numbers models, optimizers,
schedulers and registered objects from 0 with no gap, and saves an FSDP optimizer with its
model, so a save holding `pytorch_model_fsdp_1/` and no `pytorch_model_fsdp_0/` (or
`optimizer_1/` and no `pytorch_model_fsdp_1/`, or `scheduler_1.bin` and no `scheduler.bin`)
lost one; an FSDP DCP folder with data files and no `.metadata` did not finish. `verify` said
OK for every one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_ckpt
from .dist_helpers import run_torchrun
from .framework_fixtures import ACCELERATE_FSDP_SCRIPT

# each save and each load is a 2-rank torchrun job building a Llama: minutes on a busy machine
pytestmark = [pytest.mark.torchrun, pytest.mark.frameworks, pytest.mark.timeout(1200)]


def _without(save: Path, name: str, dest: Path) -> Path:
    """A copy of `save` at `dest` that lost the file `name`."""
    shutil.copytree(save, dest)
    (dest / name).unlink()
    return dest


def _restored_differently(mode: str, good: Path, other: Path, tmp_path: Path) -> list[str]:
    """What accelerate's `load_state` on 2 ranks restores from `other` that differs from what
    it restores from `good` (`rank R: .path` items; empty: the same, bit for bit)."""
    report = tmp_path / "load.json"
    run_torchrun(ACCELERATE_FSDP_SCRIPT, 2, "load", report, mode, good, other, timeout=600)
    found: dict[str, list[str]] = json.loads(report.read_text())
    return found[str(other)]


def _missing_rank_rng(path: Path) -> list[dict[str, Any]]:
    result = run_ckpt("verify", path, "--json")
    assert result.exit_code == 1, result.stdout
    problems: list[dict[str, Any]] = result.json["result"]["problems"]
    return [p for p in problems if p["code"] == "missing_rank_rng"]


def _age(folder: Path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (then, then))


def test_a_ddp_save_without_rank_0s_rng_states_is_warned_of_alone_and_fails_after_one_with_it(
    accelerate_ddp_save: Path, tmp_path: Path
) -> None:
    good = accelerate_ddp_save
    assert run_ckpt("verify", good).exit_code == 0
    damaged = _without(good, "random_states_0.pkl", tmp_path / "damaged")
    # ckpt said "OK": `random_states_1.pkl` says 2 processes saved it. Nothing of rank 0 but
    # its RNG file is per-rank in a DDP save, so the folder is also what node 1 of a
    # `save_on_each_node` run on node-local disks holds: a warning, not an error
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 0, result.stdout
    found = [p for p in result.json["result"]["problems"] if p["code"] == "rank_rng_elsewhere"]
    assert [p["file"] for p in found] == [str(damaged / "random_states_0.pkl")]
    assert "random_states_1.pkl" in found[0]["message"] and "rank 0" in found[0]["message"]
    assert "save_on_each_node" in found[0]["message"] and found[0]["fix"]
    training = run_ckpt("inspect", damaged, "--json").json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert any("RNG" in m for m in training["missing_exact"]), training["missing_exact"]
    # the truth: accelerate's own load_state goes on, and rank 0's RNG is not the saved one
    differs = _restored_differently("PLAIN", good, damaged, tmp_path)
    assert differs and {d.split(":")[0] for d in differs} == {"rank 0"}, differs[:5]
    assert all(d.split(": ")[1].startswith(".rng.") for d in differs), differs[:5]
    # `convert` of it may be a node's own folder: written, and the missing state said (it was
    # written with exit 0 and not a word)
    out = tmp_path / "converted"
    converted = run_ckpt("convert", damaged, out, "--to", "dcp", "--json")
    assert converted.exit_code == 0, converted.stdout
    said = [w for w in converted.json["result"]["warnings"] if "random_states_0.pkl" in w]
    assert len(said) == 1 and "rank_rng_elsewhere" in said[0], converted.json["result"]
    human = run_ckpt("convert", damaged, tmp_path / "again", "--to", "dcp")
    assert human.exit_code == 0 and "random_states_0.pkl" in human.stderr
    recut = run_ckpt("reshard", damaged, tmp_path / "recut", "--world-size", "2", "--json")
    assert recut.exit_code == 0, recut.stdout
    assert any("random_states_0.pkl" in w for w in recut.json["result"]["warnings"])

    # a run whose newest save is so, its save before holding rank 0's file: lost (or rank 0
    # still writing, or killed) for certain, as a lost highest rank's file is; `latest` named
    # it once settled, and `verify` only warned
    run = tmp_path / "run" / "checkpoints"
    shutil.copytree(good, run / "checkpoint_0")
    _age(run / "checkpoint_0")
    shutil.copytree(damaged, run / "checkpoint_1")
    _age(run / "checkpoint_1", 1800)
    found = _missing_rank_rng(run / "checkpoint_1")
    assert [p["file"] for p in found] == [str(run / "checkpoint_1" / "random_states_0.pkl")]
    assert "checkpoint_0" in found[0]["message"] and "rank 0" in found[0]["message"]
    checked = run_ckpt("verify", run / "checkpoint_1", "--json").json["result"]["problems"]
    assert [p["code"] for p in checked] == ["missing_rank_rng"], checked
    result = run_ckpt("latest", run.parent, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["latest"] == str(run / "checkpoint_0")
    rows = {c["name"]: c for c in result.json["result"]["checkpoints"]}
    assert rows["checkpoints/checkpoint_1"]["status"] == "incomplete"
    assert "random_states_0.pkl" in rows["checkpoints/checkpoint_1"]["reason"]
    refused = run_ckpt("convert", run / "checkpoint_1", tmp_path / "whole", "--to", "dcp")
    assert refused.exit_code == 4 and "--filter-out 'rng_0*'" in refused.stderr

    # one node's folder of a `save_on_each_node` run on node-local disks: its every save lacks
    # rank 0's file. Recent, it may be still being written; settled, whole as far as its
    # names tell, the doubt said; `prune --incomplete` keeps it
    node = tmp_path / "node1" / "checkpoints"
    shutil.copytree(damaged, node / "checkpoint_0")
    _age(node / "checkpoint_0")
    shutil.copytree(damaged, node / "checkpoint_1")
    result = run_ckpt("latest", node.parent, "--json")
    assert result.json["result"]["latest"] == str(node / "checkpoint_0"), result.stdout
    rows = {c["name"]: c for c in result.json["result"]["checkpoints"]}
    assert rows["checkpoints/checkpoint_1"]["status"] == "writing"
    assert "random_states_0.pkl" in rows["checkpoints/checkpoint_1"]["reason"]
    _age(node / "checkpoint_1", 1800)
    assert run_ckpt("verify", node / "checkpoint_1").exit_code == 0
    result = run_ckpt("latest", node.parent, "--json")
    rows = {c["name"]: c for c in result.json["result"]["checkpoints"]}
    assert rows["checkpoints/checkpoint_1"]["status"] == "complete"
    assert "another node's disk" in rows["checkpoints/checkpoint_1"]["reason"]
    assert run_ckpt("prune", node.parent, "--incomplete", "--yes").exit_code == 0
    assert (node / "checkpoint_1").is_dir() and (node / "checkpoint_0").is_dir()


def test_an_fsdp_save_without_rank_1s_rng_states_fails_verify(
    accelerate_fsdp_saves: dict[str, Path], tmp_path: Path
) -> None:
    good = accelerate_fsdp_saves["sharded"]
    damaged = _without(good, "random_states_1.pkl", tmp_path / "damaged")
    # ckpt said "OK": its DCP folders say rank 1 saved (`__1_0.distcp`)
    found = _missing_rank_rng(damaged)
    assert [p["file"] for p in found] == [str(damaged / "random_states_1.pkl")]
    assert "__1_0.distcp" in found[0]["message"] and "rank 1" in found[0]["message"]
    training = run_ckpt("inspect", damaged, "--json").json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    # the truth: load_state restores everything else and rank 1's RNG is not the saved one
    differs = _restored_differently("SHARDED_STATE_DICT", good, damaged, tmp_path)
    assert differs and {d.split(":")[0] for d in differs} == {"rank 1"}, differs[:5]
    assert all(d.split(": ")[1].startswith(".rng.") for d in differs), differs[:5]
    # `diff` names the lost rank's state and compares rank 0's as rank 0's: the one file left
    # was read as a one-process save's `rng`, so rank 0's and rank 1's states both differed
    result = run_ckpt("diff", good, damaged, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert report["components"] == {"rng_1": 4} and report["only_b"] == []
    assert {name.split(".")[0] for name in report["only_a"]} == {"rng_1"}
    # `convert` and `reshard` of the whole save wrote an output silently without rank 1's
    # RNG states: they refuse it (exit 4, the problem named), nothing written
    out = tmp_path / "out"
    for command, knowingly in (
        (("convert", damaged, out, "--to", "dcp"), "--filter-out 'rng_1*'"),
        (("reshard", damaged, out, "--world-size", "1"), "--rank-state drop"),
        (
            ("reshard", damaged, out, "--world-size", "1", "--rank-state", "replicate"),
            "--rank-state drop",
        ),
    ):
        refused = run_ckpt(*command, "--json")
        assert refused.exit_code == 4, (command, refused.stdout)
        error = refused.json["error"]
        assert error["path"] == str(damaged / "random_states_1.pkl"), error
        assert "missing_rank_rng" in error["message"] and "rank 1" in error["message"]
        assert "--select" in error["fix"] and knowingly in error["fix"], error["fix"]
        assert not out.exists()
    # what is there still converts, one component at a time
    model = run_ckpt("convert", damaged, out, "--to", "safetensors", "--select", "model")
    assert model.exit_code == 0, model.stderr
    # and a re-cut told to leave out every rank's RNG states lacks nothing it was asked for:
    # the models and optimizers re-cut, no random_states file at all (it was refused)
    recut = tmp_path / "recut"
    result = run_ckpt(
        "reshard", damaged, recut, "--world-size", "1", "--rank-state", "drop", "--json"
    )
    assert result.exit_code == 0, result.stdout
    warned = result.json["result"]["warnings"]
    said = [w for w in warned if "random_states_1.pkl" in w and "--rank-state drop" in w]
    assert len(said) == 1 and not [w for w in warned if "no effect" in w], warned
    assert not list(recut.glob("random_states_*"))
    assert (recut / "pytorch_model_fsdp_1" / "__0_0.distcp").is_file()
    same = run_ckpt("diff", damaged, recut, "--select", "model_1", "--json")
    assert same.exit_code == 0, same.stdout


def test_an_fsdp_save_without_any_rng_states_fails_verify_and_is_no_latest(
    accelerate_fsdp_saves: dict[str, Path], tmp_path: Path
) -> None:
    """Both `random_states_{0,1}.pkl` gone: no rank's file left to say how many there were, so
    ckpt said OK, though `save_state` writes every process's into every save and the DCP
    folders' `__1_0.distcp` say both ranks saved here."""
    good = accelerate_fsdp_saves["sharded"]
    run = tmp_path / "run"
    shutil.copytree(good, run / "step_2")
    _age(run / "step_2")
    damaged = shutil.copytree(good, run / "step_4")
    for rank in range(2):
        (damaged / f"random_states_{rank}.pkl").unlink()
    _age(damaged)
    found = _missing_rank_rng(damaged)
    assert [p["file"] for p in found] == [str(damaged / f"random_states_{r}.pkl") for r in (0, 1)]
    assert "__1_0.distcp" in found[1]["message"] and "rank 1's own data" in found[1]["message"]
    training = run_ckpt("inspect", damaged, "--json").json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    # the truth: load_state restores everything else, and neither rank's RNG is the saved one
    differs = _restored_differently("SHARDED_STATE_DICT", good, damaged, tmp_path)
    assert {d.split(":")[0] for d in differs} == {"rank 0", "rank 1"}, differs[:5]
    assert all(d.split(": ")[1].startswith(".rng.") for d in differs), differs[:5]
    result = run_ckpt("latest", run, "--json")
    assert result.json["result"]["latest"] == str(run / "step_2"), result.stdout
    rows = {c["name"]: c for c in result.json["result"]["checkpoints"]}
    assert rows["step_4"]["status"] == "incomplete"
    assert "random_states_0.pkl" in rows["step_4"]["reason"]
    refused = run_ckpt("convert", damaged, tmp_path / "out", "--to", "dcp")
    assert refused.exit_code == 4 and "--filter-out 'rng_0*' --filter-out 'rng_1*'" in (
        refused.stderr
    )


@pytest.mark.parametrize(
    ("removed", "blamed", "code", "says"),
    [
        ("pytorch_model_fsdp_0", "pytorch_model_fsdp_0", "missing_component", "model 1"),
        ("optimizer_0", "optimizer_0", "missing_component", "optimizer_1/"),
        ("pytorch_model_fsdp_1", "pytorch_model_fsdp_1", "missing_component", "optimizer_1/"),
        ("scheduler.bin", "scheduler.bin", "missing_component", "scheduler_1.bin"),
        (
            "pytorch_model_fsdp_1/.metadata",
            "pytorch_model_fsdp_1",
            "unreadable_component",
            "no .metadata",
        ),
    ],
)
def test_an_fsdp_save_that_lost_an_objects_state_fails_verify_and_is_no_latest(
    accelerate_fsdp_saves: dict[str, Path],
    tmp_path: Path,
    removed: str,
    blamed: str,
    code: str,
    says: str,
) -> None:
    good = accelerate_fsdp_saves["sharded"]
    run = tmp_path / "run"
    shutil.copytree(good, run / "step_2")
    _age(run / "step_2")
    damaged = shutil.copytree(good, run / "step_4")
    target = damaged / removed
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [(code, str(damaged / blamed))]
    assert says in problems[0]["message"] and problems[0]["fix"]
    # `latest` names the save before, the damaged one's reason naming what it lacks
    result = run_ckpt("latest", run, "--json")
    assert result.json["result"]["latest"] == str(run / "step_2"), result.stdout
    rows = {c["name"]: c for c in result.json["result"]["checkpoints"]}
    assert rows["step_4"]["status"] != "complete"
    assert blamed in rows["step_4"]["reason"]
