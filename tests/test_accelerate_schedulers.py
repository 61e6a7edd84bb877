"""accelerate saves with several optimizers and LR schedulers: a user's story.

`Accelerator.save_state` writes every prepared optimizer (`optimizer.bin`, `optimizer_1.bin`)
and every prepared LR scheduler (`scheduler.bin`, `scheduler_1.bin`), and `load_state` restores
each. `inspect` described the first scheduler only, and `verify` and `latest` said OK for a save
of two optimizers that lost `optimizer_1.bin` (accelerate records no count), though
`load_state` of it fails. A scheduler's `base_lrs` is its optimizer's `initial_lr`s: a scheduler whose rates are no
saved optimizer's steps the lost one. One optimizer with two schedulers is a legitimate save.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, run_ckpt

pytestmark = [pytest.mark.frameworks]

#: `save_state` of one model stepped by AdamW and SGD (`two`), or by AdamW alone with a StepLR
#: and a LambdaLR on it (`one`); `load` SAVE: accelerate's own `load_state` into fresh objects
_SCRIPT = """
import sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
mode, path = sys.argv[1], sys.argv[2]
def build():
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    if mode != "one":
        opts.append(torch.optim.SGD(model.parameters(), lr=1e-2))
    scheds = [
        torch.optim.lr_scheduler.StepLR(opts[0], 1),
        torch.optim.lr_scheduler.LambdaLR(opts[-1], lambda s: 1.0),
    ]
    return acc, acc.prepare(model, *opts, *scheds)
acc, (model, *rest) = build()
if mode == "load":
    acc.load_state(path)
    sys.exit(0)
opts, scheds = rest[:-2], rest[-2:]
for _ in range(2):
    acc.backward(model(torch.randn(2, 4)).sum())
    for opt in opts:
        opt.step(); opt.zero_grad()
    for sched in scheds:
        sched.step()
acc.save_state(path)
"""


def _accelerate(mode: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _SCRIPT, mode, str(path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("accelerate_schedulers")
    found = {}
    for mode in ("one", "two"):
        ran = _accelerate(mode, root / mode)
        assert ran.returncode == 0, ran.stderr
        found[mode] = root / mode
    return found


def test_every_scheduler_of_a_save_is_described(saves: dict[str, Path]) -> None:
    save = saves["two"]
    assert {"scheduler.bin", "scheduler_1.bin"} <= {p.name for p in save.iterdir()}
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["scheduler"]["kind"] == "StepLR"
    schedulers = training["schedulers"]
    assert list(schedulers) == ["scheduler", "scheduler_1"]
    assert schedulers["scheduler_1"]["kind"] == "LambdaLR"
    assert schedulers["scheduler_1"]["last_lr"] == 0.01
    out = run_ckpt("inspect", save).stdout
    assert "scheduler_1  kind=LambdaLR" in out and "kind=StepLR" in out


def test_a_save_that_lost_its_second_optimizer_fails_verify(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    lost = tmp_path / "lost"
    shutil.copytree(saves["two"], lost)
    (lost / "optimizer_1.bin").unlink()
    # accelerate's own resume cannot load it
    assert _accelerate("load", lost).returncode != 0
    assert _accelerate("load", saves["two"]).returncode == 0
    result = run_ckpt("verify", lost, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    missing = [p for p in problems if p["code"] == "missing_component"]
    assert len(missing) == 1 and missing[0]["file"].endswith("optimizer_1.bin")
    assert "scheduler_1.bin" in missing[0]["message"] and missing[0]["fix"]
    training = run_ckpt("inspect", lost, "--json").json["result"]["training"]
    assert training["resumable"] is False
    assert run_ckpt("verify", saves["two"]).exit_code == 0
    # a resume script's `ckpt latest` agrees with verify: the save before it is the newest whole
    run = tmp_path / "run"
    shutil.copytree(saves["two"], run / "step_1")
    shutil.copytree(lost, run / "step_2")
    latest = run_ckpt("latest", run, "--settle", "0")
    assert latest.exit_code == 0 and latest.stdout.strip() == str(run / "step_1"), latest.stderr


def test_one_optimizer_with_two_schedulers_is_whole(saves: dict[str, Path]) -> None:
    save = saves["one"]
    names = {p.name for p in save.iterdir()}
    assert "scheduler_1.bin" in names and "optimizer_1.bin" not in names
    result = run_ckpt("verify", save, "--json")
    assert result.exit_code == 0, result.stdout
    assert run_ckpt("inspect", save, "--json").json["result"]["training"]["resumable"] is True
