"""An accelerate run's data position, and what `verify` tells a user to do about it: a user's story.

accelerate's `save_state` keeps the data loader's position only for a `StatefulDataLoader`
(`DataLoaderConfiguration(use_stateful_dataloader=True)`: `dl_state_dict.bin`, which
`load_state` restores); a plain shuffled `DataLoader` leaves none (a seedable sampler alone
neither), and the resumed run draws other batches. `verify --resumable` said so, but its fix read
"save the data loader's state with the checkpoint (the Trainer and accelerate's save_state do)":
the save it judged was accelerate's own `save_state`. The fix names what makes accelerate save it.

Over a torch `DataLoader`, `prepare` wraps the loader's own sampler, which has no state:
`dl_state_dict.bin` records how many batches were drawn, and `load_state` skips that many batches
of the order the resumed loader draws. Without `use_seedable_sampler=True` that order is another
one, and `verify --exact` called the save exact. With it the order is the saved run's (in the
epoch the sampler is set to), but the two saves are the same bytes: the save cannot show which,
so it is not called exact, and the fix names both the seedable sampler and the loader whose
order the save does keep (torchdata's own `StatefulDataLoader`, its shuffle generator saved).
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

#: 4 steps of a shuffled loader over 8 rows, `save_state` after step 2. LOADER: `plain` (a
#: torch DataLoader, no stateful loader), `torch` (a torch DataLoader, stateful, no seedable
#: sampler), `seedable` (the same with `use_seedable_sampler=True`), `torchdata` (torchdata's
#: StatefulDataLoader, stateful). MODE `resume`: `load_state` of the save, then the batches
#: left. Prints the rows of the batches drawn after the save as JSON.
_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
loader_kind, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
    use_seedable_sampler=loader_kind == "seedable",
    use_stateful_dataloader=loader_kind != "plain"))
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
rows = torch.arange(8, dtype=torch.float32).unsqueeze(1)
if loader_kind == "torchdata":
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(rows, batch_size=2, shuffle=True)
else:
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=True)
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


def _accelerate(loader: str, mode: str, path: Path) -> list[list[float]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _SCRIPT, loader, mode, str(path)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    batches: list[list[float]] = json.loads(ran.stdout.strip().splitlines()[-1])
    return batches


def test_verify_names_the_setting_that_makes_save_state_keep_the_data_position(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain"
    _accelerate("plain", "straight", plain)
    assert not (plain / "dl_state_dict.bin").exists()  # accelerate saved no data position
    result = run_ckpt("verify", "--resumable", plain, "--json")
    assert result.exit_code == 0, result.stdout
    [problem] = [p for p in result.json["result"]["problems"] if p["code"] == "missing_dataloader"]
    assert "DataLoaderConfiguration(use_stateful_dataloader=True)" in problem["fix"], problem
    assert "StatefulDataLoader" in problem["fix"], problem
    assert "accelerate's save_state do" not in problem["fix"], problem

    # the user follows the fix: the save keeps the position and its order, is exact, and
    # resumes on the batches the straight run saw
    stateful = tmp_path / "stateful"
    straight = _accelerate("torchdata", "straight", stateful)
    assert (stateful / "dl_state_dict.bin").is_file()
    exact = run_ckpt("verify", "--exact", stateful)
    assert exact.exit_code == 0, exact.stdout
    assert "exact: yes" in exact.stdout
    assert _accelerate("torchdata", "resume", stateful) == straight


def test_a_stateful_loader_over_an_unseeded_shuffle_is_not_called_exact(tmp_path: Path) -> None:
    """`use_stateful_dataloader=True` over a torch DataLoader without `use_seedable_sampler`:
    `verify --exact` said "exact: yes", and the run resumed on other batches."""
    unseeded = tmp_path / "unseeded"
    straight = _accelerate("torch", "straight", unseeded)
    assert (unseeded / "dl_state_dict.bin").is_file()
    # accelerate's own resume: the batches after the save are not the straight run's
    resumed = _accelerate("torch", "resume", unseeded)
    assert resumed != straight

    exact = run_ckpt("verify", "--exact", unseeded, "--json")
    assert exact.exit_code == 1, exact.stdout
    training = exact.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert training["missing_exact"] == ["dataloader"]
    [problem] = [p for p in exact.json["result"]["problems"] if p["code"] == "missing_dataloader"]
    assert problem["severity"] == "error"
    assert "dl_state_dict.bin records how many batches" in problem["message"], problem
    assert "use_seedable_sampler=True" in problem["fix"], problem
    assert "set_epoch" in problem["fix"] and "StatefulDataLoader" in problem["fix"], problem
    # resumable all the same: a warning without --exact
    resumable = run_ckpt("verify", "--resumable", unseeded)
    assert resumable.exit_code == 0, resumable.stdout
    assert "exact: no (missing: dataloader)" in resumable.stdout

    # with the seedable sampler the resume is the straight run's, but the save is the same
    # bytes as the unseeded one's: nothing in it shows the order, so it is not called exact
    seeded = tmp_path / "seeded"
    seeded_straight = _accelerate("seedable", "straight", seeded)
    assert _accelerate("seedable", "resume", seeded) == seeded_straight
    dl_state = "dl_state_dict.bin"
    assert (seeded / dl_state).read_bytes() == (unseeded / dl_state).read_bytes()
    again = run_ckpt("verify", "--exact", seeded, "--json")
    assert again.exit_code == 1 and again.json["result"]["training"]["exact"] is False
