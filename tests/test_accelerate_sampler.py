"""An accelerate run with a seedable sampler: a user's story.

`Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))` gives a
shuffled DataLoader a `SeedableRandomSampler`, and `save_state` writes the sampler OBJECT with
torch.save as `sampler.bin` (`sampler_1.bin`... for later loaders), beside `dl_state_dict.bin`
when `use_stateful_dataloader=True`. torch's weights_only loader refuses the class, and ckpt never
unpickles one: ckpt called the file unreadable, so `verify --resumable` failed a whole save
("resumable: no"), `convert` refused the folder and `prune --slim-older-than` left the sampler
behind. Now its class, epoch and seed are read as data (every global of the pickle a stand-in,
nothing imported or run), the save is whole and resumable, and the file is carried where the
copy keeps accelerate's layout, or listed with why where it cannot be.

accelerate 0.24.0 wrote `sampler.bin` for every seedable sampler; later releases write it from
`save_accelerator_state` only when the loader's dataset is an `IterableDatasetShard` (whose
sampler is never a `SeedableRandomSampler` after `prepare`), so the story writes the file as
that writer does: `accelerate.utils.save(loader.get_sampler(), ...)`, the same call on the
sampler `prepare` built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import REPO, run_ckpt
from .run_fixtures import age
from .s3_fixtures import S3Server, fetch_object, make_bucket


class _Counter:
    """A registered object (`custom_checkpoint_0.pkl`) with plain state."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def _run(out: Path, stateful: bool) -> list[Path]:
    """Three epochs of 4 steps over a shuffled loader, `save_state` every 3 steps
    (`step_3`...`step_12`), each with the sampler's `sampler.bin`. Returns the saves."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, save, set_seed

    AcceleratorState._reset_state()
    GradientState._reset_state()
    set_seed(0)
    config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    rows = torch.utils.data.TensorDataset(torch.randn(16, 8))
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    saves: list[Path] = []
    step = 0
    for _ in range(3):
        for (x,) in loader:
            accelerator.backward(model(x).square().mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            counter.seen += len(x)
            if step % 3 == 0:
                saves.append(out / f"step_{step}")
                accelerator.save_state(str(saves[-1]))
                save(loader.get_sampler(), saves[-1] / "sampler.bin", safe_serialization=False)
    return saves


@pytest.mark.slow
@pytest.mark.parametrize("stateful", [False, True], ids=["sampler", "sampler+dl_state_dict"])
def test_a_pickled_seedable_sampler_is_read_as_data_and_the_save_is_whole(
    tmp_path: Path, stateful: bool, s3_server: S3Server
) -> None:
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    if stateful:
        pytest.importorskip("torchdata", reason="use_stateful_dataloader needs torchdata")
    run = tmp_path / "run"
    saves = _run(run, stateful)
    age(run)
    save = saves[-1]
    assert (save / "dl_state_dict.bin").is_file() is stateful
    # what the file holds, by the real (trusting) reader: the sampler object itself
    sampler = torch.load(save / "sampler.bin", weights_only=False)
    assert type(sampler).__name__ == "SeedableRandomSampler" and sampler.epoch == 3

    verify = run_ckpt("verify", "--resumable", save)
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    assert "resumable: yes" in verify.stdout
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["resumable"] is True and not training.get("unreadable")
    said = f"epoch {sampler.epoch}, initial_seed {sampler.initial_seed}"
    assert training["components"]["sampler"] == f"sampler.bin (SeedableRandomSampler: {said})"
    if stateful:  # the loader's own state is the data position
        assert training["components"]["dataloader"] == "dl_state_dict.bin"
        assert training["dataloader"]["source"] == "dataloader."
    else:
        # the epoch's order, not the position in it (see the test below)
        assert "not how far into the epoch" in training["dataloader"].pop("reason")
        assert training["dataloader"] == {
            "kind": "seedable sampler",
            "file": "sampler.bin",
            "epoch": sampler.epoch,
            "initial_seed": sampler.initial_seed,
        }
    # read as data: neither accelerate nor torch is imported, nothing of the class runs
    probe = (
        "import sys; from ckpt_cli.sources.opening import open_source\n"
        f"opened = open_source({str(save)!r})\n"
        "print(opened.training.components['sampler'], 'accelerate' in sys.modules)"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    assert seen.stdout.strip().endswith(f"{said}) False"), seen.stdout + seen.stderr

    # the run: the newest save is the latest, every save complete
    latest = run_ckpt("latest", run, "--json").json["result"]
    assert latest["latest"] == str(save)
    assert {c["status"] for c in latest["checkpoints"]} == {"complete"}

    # a copy in accelerate's layout carries it as it is, and accelerate resumes from it
    resharded = tmp_path / "resharded"
    result = run_ckpt("reshard", save, resharded, "--world-size", "2", "--rank-state", "keep")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert (resharded / "sampler.bin").read_bytes() == (save / "sampler.bin").read_bytes()
    # one checkpoint of another format cannot hold it: listed with why, never dropped silently
    converted = run_ckpt("convert", save, tmp_path / "dcp", "--to", "dcp", "--json")
    assert converted.exit_code == 0, converted.stdout + converted.stderr
    skipped = {s["name"]: s["reason"] for s in converted.json["result"]["skipped"]}
    assert "pickled accelerate SeedableRandomSampler object" in skipped["sampler.bin"]
    assert "does not unpickle classes" in skipped["sampler.bin"]
    diff = run_ckpt("diff", saves[-2], save)
    assert diff.exit_code == 1, diff.stdout + diff.stderr  # the run moved on between them
    # the sampler's epoch moved on too: compared by its attributes, named as a difference
    assert "sampler.bin:epoch" in diff.stdout

    # the run to an object store and back: every save, the sampler's bytes as they are
    make_bucket(s3_server.endpoint, "ckpts")
    pushed = run_ckpt("sync", run, "s3://ckpts/run/", "--json")
    assert pushed.exit_code == 0, pushed.stdout + pushed.stderr
    assert {c["action"] for c in pushed.json["result"]["checkpoints"]} == {"uploaded"}
    key = f"run/{save.name}/sampler.bin"
    assert fetch_object(s3_server.endpoint, "ckpts", key) == (save / "sampler.bin").read_bytes()
    pulled = run_ckpt("sync", "s3://ckpts/run/", tmp_path / "pulled", "--latest")
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    back = tmp_path / "pulled" / save.name
    assert (back / "sampler.bin").read_bytes() == (save / "sampler.bin").read_bytes()

    # old saves slimmed to weights: the sampler is resume state, removed with the optimizer
    pruned = run_ckpt("prune", run, "--keep-last", "4", "--slim-older-than", "1", "--yes")
    assert pruned.exit_code == 0, pruned.stdout + pruned.stderr
    for older in saves[:-1]:
        assert not (older / "sampler.bin").exists() and not (older / "optimizer.bin").exists()
        assert (older / "model.safetensors").is_file()
    assert (save / "sampler.bin").is_file()
    assert json.loads((saves[0] / "ckpt-slim.json").read_text())

    # the truth: accelerate's own loader resumes the copy ckpt carried the sampler into
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state(str(resharded))
    assert torch.equal(model.weight.detach(), load_file(save / "model.safetensors")["weight"])
    assert counter.seen == 48  # 12 steps of 4 rows


class _Planted:
    """What a hostile `sampler.bin` would hide in the sampler's state: a call of `os.system`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _save_state(folder: Path) -> Path:
    """A real `save_state` of a tiny model and optimizer into `folder` (no loader prepared)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.save_state(str(folder))
    return folder


@pytest.mark.slow
def test_a_sampler_pickle_that_would_run_code_runs_nothing(tmp_path: Path) -> None:
    """The stand-ins keep the calls the pickle asks for, and make none: a sampler whose epoch
    is a call of `os.system` is read (no epoch shown) and nothing runs."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate.data_loader import SeedableRandomSampler

    save = _save_state(tmp_path / "step_1")
    sampler = SeedableRandomSampler(range(4), data_seed=7)
    marker = tmp_path / "ran"
    sampler.epoch = _Planted(marker)  # type: ignore[assignment]
    torch.save(sampler, save / "sampler.bin")

    inspect = run_ckpt("inspect", save, "--json")
    assert inspect.exit_code == 0, inspect.stdout + inspect.stderr
    components = inspect.json["result"]["training"]["components"]
    assert components["sampler"] == "sampler.bin (SeedableRandomSampler: initial_seed 7)"
    assert run_ckpt("verify", save).exit_code == 0
    assert not marker.exists()


@pytest.mark.slow
def test_a_sampler_of_a_dataset_held_in_memory_is_named_by_its_class(tmp_path: Path) -> None:
    """A sampler pickles the dataset it samples: one held in memory (a list of 2,000,000 rows)
    makes a pickle of megabytes, past what ckpt unpickles even with stand-ins. Its class is
    read from the head of the pickle: the save is still whole, the seed and epoch unread."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate.data_loader import SeedableRandomSampler

    save = _save_state(tmp_path / "step_1")
    torch.save(SeedableRandomSampler(list(range(2_000_000))), save / "sampler.bin")
    assert (save / "sampler.bin").stat().st_size > 8 << 20

    verify = run_ckpt("verify", "--resumable", save)
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["components"]["sampler"] == "sampler.bin (SeedableRandomSampler)"
    assert training["dataloader"].pop("reason")
    assert training["dataloader"] == {"kind": "seedable sampler", "file": "sampler.bin"}


def test_a_seedable_sampler_alone_saves_no_position_within_the_epoch(tmp_path: Path) -> None:
    """`sampler.bin` without `dl_state_dict.bin`: the sampler's epoch and seed (the epoch's
    shuffle order), not how far into the epoch the run was. accelerate's own `load_state`
    sets the sampler back and the resumed loader starts the epoch again from its first batch
    (unless the script calls `skip_first_batches`), so a save mid-epoch resumes, not exactly:
    `verify --exact` called it exact. It now says what is missing and names the setting that
    saves the position."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, save, set_seed

    def prepared() -> tuple[Accelerator, Any, Any, Any, Any]:
        AcceleratorState._reset_state()
        GradientState._reset_state()
        set_seed(0)
        config = DataLoaderConfiguration(use_seedable_sampler=True)
        accelerator = Accelerator(cpu=True, dataloader_config=config)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        rows = torch.utils.data.TensorDataset(torch.arange(64, dtype=torch.float32).view(16, 4))
        loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
        return accelerator, *accelerator.prepare(model, optimizer, scheduler, loader)

    accelerator, model, optimizer, scheduler, loader = prepared()
    # the saved run: 3 steps on an epoch's 4 batches, save_state (and the sampler as its
    # writer saves it), then the batch the run went on to draw
    batches = iter(loader)
    seen = []
    for _ in range(3):
        (x,) = next(batches)
        seen.append(x)
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    save_dir = tmp_path / "step_3"
    accelerator.save_state(str(save_dir))
    save(loader.get_sampler(), save_dir / "sampler.bin", safe_serialization=False)
    assert not (save_dir / "dl_state_dict.bin").exists()
    went_on = next(batches)[0]

    # accelerate's own resume of the save: the epoch again from its first batch
    accelerator, *_, loader = prepared()
    accelerator.load_state(str(save_dir))
    resumed = next(iter(loader))[0]
    assert torch.equal(resumed, seen[0]) and not torch.equal(resumed, went_on)

    result = run_ckpt("verify", "--exact", save_dir, "--json")
    assert result.exit_code == 1, result.stdout
    training = result.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert "dataloader" in training["missing_exact"]
    problem = {p["code"]: p for p in result.json["result"]["problems"]}["missing_dataloader"]
    assert "sampler.bin" in problem["message"] and "skip_first_batches" in problem["message"]
    assert "use_stateful_dataloader=True" in problem["fix"]
    assert run_ckpt("verify", "--resumable", save_dir).exit_code == 0
