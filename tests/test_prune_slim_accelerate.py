"""`prune --slim-older-than` of an accelerate run: what goes, what stays, and why: a user's story.

Slimming keeps what the weights need and what says where they came from (the scheduler, the
step, the configuration), in every layout as in a Trainer folder (`scheduler.pt` and
`trainer_state.json` stay), and removes the state only a resume reads. An accelerate save lost
its optimizer, RNG and data-loader files, and its `scheduler.bin`, `custom_checkpoint_0.pkl`
and `scaler.pt` stayed without a word: the plan named the files it removed and nothing of the
rest, and the gradient scaler's loss scale, resume state alone, stayed. Now every file of the
save is listed, removed or kept, each with why; the scaler's state goes with the optimizer's;
a registered object's state stays (it may be an EMA of the weights); `--dry-run` writes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import HOUR, age

pytestmark = [pytest.mark.frameworks]


class _Counter:
    """A registered object (`custom_checkpoint_0.pkl`): the script's own step counter."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def _accelerate_run(run: Path, saves: int) -> list[Path]:
    """`save_state` after each of `saves` steps (automatic naming: `checkpoints/checkpoint_N`)
    of a loop with an LR scheduler, a stateful data loader and a registered object; each save
    also holds `scaler.pt`, which accelerate writes with torch.save of the GradScaler's state
    dict under fp16 mixed precision (on a GPU only: the same call, made here)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    AcceleratorState._reset_state()
    GradientState._reset_state()
    set_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(run), automatic_checkpoint_naming=True),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    folders = []
    for step, x in enumerate(loader):
        if step == saves:
            break
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.seen += len(x)
        accelerator.save_state()
        folders.append(run / "checkpoints" / f"checkpoint_{step}")
        torch.save(torch.amp.GradScaler("cpu").state_dict(), folders[-1] / "scaler.pt")
    return folders


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` and the sha256 of its bytes."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


REMOVED = {"optimizer.bin", "random_states_0.pkl", "dl_state_dict.bin", "scaler.pt"}
KEPT = {"model.safetensors", "scheduler.bin", "custom_checkpoint_0.pkl"}


def test_slimming_an_accelerate_save_lists_every_file_it_removes_or_keeps(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    saves = _accelerate_run(run, 3)
    age(run, 24 * HOUR)
    old = saves[0]
    assert {p.name for p in old.iterdir()} == REMOVED | KEPT
    weights = load_file(old / "model.safetensors")

    # the plan, with --dry-run: every file listed with why, nothing written
    before = _snapshot(run)
    dry = run_ckpt("prune", run / "checkpoints", "--slim-older-than", "1", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stdout + dry.stderr
    assert _snapshot(run) == before
    slimmed = {
        d["name"]: d["slim"] for d in dry.json["result"]["decisions"] if d["action"] == "slim"
    }
    assert set(slimmed) == {"checkpoint_0", "checkpoint_1"}
    listing = {f["path"]: f for f in slimmed["checkpoint_0"]["listing"]}
    assert set(listing) == REMOVED | KEPT  # every file of the save, none unnamed
    assert {p for p, f in listing.items() if f["removed"]} == REMOVED
    assert set(slimmed["checkpoint_0"]["files"]) == REMOVED
    assert all(f["why"] for f in listing.values())
    assert "only a resume reads it" in listing["scaler.pt"]["why"]
    assert "scheduler" in listing["scheduler.bin"]["why"]
    assert "register_for_checkpointing" in listing["custom_checkpoint_0.pkl"]["why"]
    assert listing["model.safetensors"]["why"] == "the model's weights"

    # the human plan says the same, file by file; --yes with --dry-run writes nothing either
    human = run_ckpt("prune", run / "checkpoints", "--slim-older-than", "1", "--yes", "--dry-run")
    assert human.exit_code == 0, human.stdout + human.stderr
    for name in REMOVED:
        assert f"checkpoint_0: removes {name} (" in human.stdout, human.stdout
    for name in KEPT:
        assert f"checkpoint_0: keeps {name} (" in human.stdout, human.stdout
    assert _snapshot(run) == before

    # done: exactly the files listed as removed are gone; the rest loads in the real readers
    done = run_ckpt("prune", run / "checkpoints", "--slim-older-than", "1", "--yes")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert "checkpoint_0: removed scaler.pt (" in done.stdout
    assert {p.name for p in old.iterdir()} == KEPT | {"ckpt-slim.json"}
    reloaded = load_file(old / "model.safetensors")
    assert all(torch.equal(reloaded[k], v) for k, v in weights.items())
    assert torch.load(old / "scheduler.bin", weights_only=True)["last_epoch"] == 1
    assert torch.load(old / "custom_checkpoint_0.pkl", weights_only=True) == {"seen": 4}
    assert run_ckpt("verify", old).exit_code == 0
    assert (saves[-1] / "scaler.pt").is_file()  # the newest save stays whole
