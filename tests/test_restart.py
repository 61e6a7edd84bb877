"""The restart test (examples/restart_test): a resumed run is the same run, and `ckpt diff`
proves it, or shows what an incomplete resumable checkpoint changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from .conftest import REPO, run_ckpt

EXAMPLE = REPO / "examples" / "restart_test"


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bit_identical(tmp_path: Path) -> None:
    # the whole recipe as a user runs it: real processes, SIGKILL mid-run, `ckpt latest`
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), str(tmp_path), "--steps", "16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed the run (SIGKILL) after it saved step" in proc.stdout
    assert "(ckpt latest)" in proc.stdout
    assert "ckpt verify --resumable: exit 0" in proc.stdout
    assert "IDENTICAL" in proc.stdout
    final_a = torch.load(tmp_path / "straight" / "step-16" / "state.pt", weights_only=True)
    final_b = torch.load(tmp_path / "resumed" / "step-16" / "state.pt", weights_only=True)
    assert final_b["step"] == 16 and final_b["dataloader"] == final_a["dataloader"]
    for name, tensor in final_a["model"].items():
        assert torch.equal(final_b["model"][name], tensor), name


@pytest.mark.parametrize("omit", ["rng", "dataloader"])
def test_leaving_state_out_of_the_save_is_caught_by_diff(
    tmp_path: Path, train: ModuleType, omit: str
) -> None:
    assert train.main(["--run-dir", str(tmp_path / "a"), "--steps", "12", f"--omit={omit}"]) == 0
    resume = tmp_path / "a" / "step-8"
    # verify names the missing component up front: resumable, but not exactly...
    verify = run_ckpt("verify", "--resumable", resume, "--json")
    assert verify.exit_code == 0
    found = {(p["code"], p["severity"]) for p in verify.json["result"]["problems"]}
    assert found == {(f"missing_{omit}", "warning")}
    assert verify.json["result"]["training"]["missing_exact"] == [omit]
    exact = run_ckpt("verify", "--exact", resume, "--json")
    assert exact.exit_code == 1
    assert {p["code"] for p in exact.json["result"]["problems"]} == {f"missing_{omit}"}
    assert (
        train.main(
            [
                "--run-dir",
                str(tmp_path / "b"),
                "--steps",
                "12",
                f"--omit={omit}",
                "--resume",
                str(resume),
            ]
        )
        == 0
    )
    result = run_ckpt("diff", tmp_path / "a" / "step-12", tmp_path / "b" / "step-12", "--json")
    assert result.exit_code == 1
    report = result.json["result"]
    assert report["components"]["model"] > 0 and report["components"]["optimizer"] > 0
    assert report["differences"][0]["status"] == "values"
    assert omit not in report["components"]  # absent on both sides: the loss shows elsewhere
    human = run_ckpt("diff", tmp_path / "a" / "step-12", tmp_path / "b" / "step-12")
    assert human.stdout.startswith("DIFFERENT") and "model." in human.stdout
    # ...and the full save passes it
    assert train.main(["--run-dir", str(tmp_path / "full"), "--steps", "4"]) == 0
    assert run_ckpt("verify", "--exact", tmp_path / "full" / "step-4").exit_code == 0


def test_dcp_checkpoints_resume_bit_identical(tmp_path: Path, train: ModuleType) -> None:
    args = ["--steps", "8", "--save-every", "4", "--format", "dcp"]
    assert train.main(["--run-dir", str(tmp_path / "a"), *args]) == 0
    # an interrupted DCP save (no .metadata yet) is not what `ckpt latest` resumes from
    (tmp_path / "a2").mkdir()
    for step in ("step-4", "step-8"):
        subprocess.run(
            ["cp", "-r", str(tmp_path / "a" / step), str(tmp_path / "a2" / step)], check=True
        )
    (tmp_path / "a2" / "step-8" / ".metadata").unlink()
    latest = run_ckpt("latest", tmp_path / "a2")
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout.strip().endswith("step-4")
    assert (
        train.main(["--run-dir", str(tmp_path / "b"), *args, "--resume", latest.stdout.strip()])
        == 0
    )
    result = run_ckpt("diff", tmp_path / "a" / "step-8", tmp_path / "b" / "step-8", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["format_a"] == "dcp" and report["equal"] == report["compared"] > 50
    assert run_ckpt("verify", "--resumable", tmp_path / "b" / "step-8").exit_code == 0
    # and the DCP run's weights equal those of its torch.save twin
    assert train.main(["--run-dir", str(tmp_path / "t"), "--steps", "8", "--save-every", "4"]) == 0
    twin = run_ckpt(
        "diff", tmp_path / "a" / "step-8", tmp_path / "t" / "step-8", "--select", "model"
    )
    assert twin.exit_code == 0, twin.stdout
