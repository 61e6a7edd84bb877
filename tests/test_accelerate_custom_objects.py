"""An accelerate run whose registered object keeps more than plain values: a user's story.

`accelerator.register_for_checkpointing(obj)` saves `obj.state_dict()` as
`custom_checkpoint_{i}.pkl` with torch.save, and `load_state` reads it back with
`weights_only=False` (`accelerate.checkpointing.load_custom_state`): a tracker keeping its last
losses in a `collections.deque`, a dataclass, a numpy generator all resume. ckpt never unpickles
such a file, but a save holding one is no broken save: `verify --resumable` failed it
(`unreadable_component`, "resumable: no"), `diff` and `convert` refused the folder. It is listed,
never loaded, as a Trainer's `training_args.bin` is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import LossWindow, age


@pytest.mark.slow
def test_a_registered_object_accelerate_unpickles_is_listed_not_a_broken_save(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    window = LossWindow()
    accelerator.register_for_checkpointing(window)
    saves = []
    for step in (1, 2):
        loss = model(torch.randn(2, 8)).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        window.recent.append(float(loss.detach()))
        saves.append(tmp_path / f"step_{step}")
        accelerator.save_state(str(saves[-1]))
    age(tmp_path)
    save = saves[-1]

    verify = run_ckpt("verify", "--resumable", save)
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    assert "resumable: yes" in verify.stdout
    inspect = run_ckpt("inspect", save, "--json")
    assert inspect.exit_code == 0, inspect.stderr
    state = json.loads(inspect.stdout)["result"]["training"]
    assert state["resumable"] is True
    assert "not loaded" in state["components"]["custom_0"]

    diff = run_ckpt("diff", saves[0], save)
    assert diff.exit_code == 1, diff.stdout + diff.stderr  # the run moved on between them
    # the registered object moved on too: compared by its bytes, named as a difference
    assert "custom_checkpoint_0.pkl" in diff.stdout and "custom_0" in diff.stdout

    # the truth: accelerate resumes from it, the deque restored
    saved = list(window.recent)
    window.recent.clear()
    accelerator.load_state(str(save))
    assert list(window.recent) == saved and len(saved) == 2
