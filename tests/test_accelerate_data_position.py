"""An accelerate run's data position, and what `verify` tells a user to do about it: a user's story.

accelerate's `save_state` keeps the data loader's position only for a `StatefulDataLoader`
(`DataLoaderConfiguration(use_stateful_dataloader=True)`: `dl_state_dict.bin`, which
`load_state` restores, in the same order with `use_seedable_sampler=True`); a plain shuffled
`DataLoader` leaves none (a seedable sampler alone neither), and the resumed run draws other
batches. `verify --resumable` said so, but its fix read "save the data loader's state
with the checkpoint (the Trainer and accelerate's save_state do)": the save it judged was
accelerate's own `save_state`. The fix names the setting that makes accelerate save it, and a
run that follows it is exact and resumes on the batch the straight run saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, run_ckpt

pytestmark = [pytest.mark.frameworks]

#: 4 steps of a shuffled loader, `save_state` after step 2 (`plain` or `stateful` loader);
#: `resume`: `load_state` of the stateful save, then the batches left. Prints the rows of the
#: batches drawn after the save as JSON.
_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
mode, path = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
    use_seedable_sampler=True, use_stateful_dataloader=mode != "plain"))
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
rows = torch.arange(8, dtype=torch.float32).unsqueeze(1)
loader = torch.utils.data.DataLoader(
    rows, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
model, opt, loader = acc.prepare(model, opt, loader)
if mode == "resume":
    acc.load_state(path)
after, step = [], 2 if mode == "resume" else 0
for batch in loader:
    acc.backward(model(batch).sum())
    opt.step(); opt.zero_grad()
    step += 1
    if step == 2 and mode != "resume":
        acc.save_state(path)
    elif step > 2:
        after.append(batch.flatten().tolist())
print(json.dumps(after))
"""


def _accelerate(mode: str, path: Path) -> list[list[float]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _SCRIPT, mode, str(path)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    batches: list[list[float]] = json.loads(ran.stdout.strip().splitlines()[-1])
    return batches


def test_verify_names_the_setting_that_makes_save_state_keep_the_data_position(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain"
    _accelerate("plain", plain)
    assert not (plain / "dl_state_dict.bin").exists()  # accelerate saved no data position
    result = run_ckpt("verify", "--resumable", plain, "--json")
    assert result.exit_code == 0, result.stdout
    [problem] = [p for p in result.json["result"]["problems"] if p["code"] == "missing_dataloader"]
    assert "use_stateful_dataloader=True, use_seedable_sampler=True" in problem["fix"], problem
    assert "accelerate's save_state do" not in problem["fix"], problem

    # the user follows the fix: the save keeps the position, is exact, and resumes on it
    stateful = tmp_path / "stateful"
    straight = _accelerate("stateful", stateful)
    assert (stateful / "dl_state_dict.bin").is_file()
    exact = run_ckpt("verify", "--exact", stateful)
    assert exact.exit_code == 0, exact.stdout
    assert _accelerate("resume", stateful) == straight
