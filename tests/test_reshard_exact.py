"""`verify --exact` of a training folder `reshard --world-size` cut for another world size: a
user's story.

An accelerate save that resumes bit-identically (`verify --exact` passes: a torchdata
StatefulDataLoader's position and order, every RNG state) was resharded from 1 process to 2
with `--rank-state replicate`. `reshard` itself said "exact: no" (each rank reads another shard
of the data and draws from another RNG stream), but `verify --exact` of the output said "exact:
yes": nothing in the folder said it had been cut. The output now holds `ckpt-reshard.json`
(the world size the run saved it at, the one it is laid out for), and `verify` and `inspect` say
it resumes, not exactly, naming the world size to resume on.

The same for a single DCP training save (`dcp.save` of model, optimizer, step and per-rank RNG
and data-loader entries, torchtitan's `step-N/` style): its `__R_0.distcp` names say only the
world size it is cut for now, so the record goes into the DCP folder; a plain model (no
training state) gets none.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .test_accelerate_data_position import _accelerate


@pytest.mark.frameworks
def test_a_folder_resharded_to_another_world_size_is_not_called_exact(tmp_path: Path) -> None:
    save = tmp_path / "step_2"
    _accelerate("torchdata", "straight", save)
    source = run_ckpt("verify", "--exact", save)
    assert source.exit_code == 0 and "exact: yes" in source.stdout, source.stdout

    # the same world size: nothing cut, still exact, no record
    same = tmp_path / "same"
    kept = run_ckpt("reshard", save, same, "--world-size", "1", "--json")
    assert kept.exit_code == 0, kept.stdout + kept.stderr
    assert not (same / "ckpt-reshard.json").exists()
    assert run_ckpt("verify", "--exact", same).exit_code == 0

    # 1 -> 2 ranks: the dry run names the record among the files it would write
    out = tmp_path / "two"
    args = ("--world-size", "2", "--rank-state", "replicate")
    planned = run_ckpt("reshard", save, out, *args, "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert "ckpt-reshard.json" in {f["path"] for f in planned.json["result"]["files"]}
    assert not out.exists()
    done = run_ckpt("reshard", save, out, *args, "--json")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert done.json["result"]["resume"]["exact"] is False
    assert sorted(p.name for p in out.glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    record = json.loads((out / "ckpt-reshard.json").read_text())
    assert (record["saved_world_size"], record["world_size"]) == (1, 2)

    exact = run_ckpt("verify", "--exact", out, "--json")
    assert exact.exit_code == 1, exact.stdout
    training = exact.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert training["resharded"] == {"saved_world_size": 1, "world_size": 2}
    [problem] = exact.json["result"]["problems"]
    assert problem["code"] == "resharded_world_size" and problem["severity"] == "error"
    assert "resume on 1 rank(s)" in problem["fix"], problem
    resumable = run_ckpt("verify", "--resumable", out)
    assert resumable.exit_code == 0, resumable.stdout
    assert "exact: no (missing: the world size it was saved at (1))" in resumable.stdout
    inspected = run_ckpt("inspect", out, "--json").json["result"]["training"]
    assert inspected["exact"] is False

    # cut again (2 -> 3): the record still names the world size the run saved it at
    three = tmp_path / "three"
    again = run_ckpt("reshard", out, three, "--world-size", "3", "--rank-state", "replicate")
    assert again.exit_code == 0, again.stdout + again.stderr
    record = json.loads((three / "ckpt-reshard.json").read_text())
    assert (record["saved_world_size"], record["world_size"]) == (1, 3)
    assert run_ckpt("verify", "--exact", three).exit_code == 1


def _dcp_training_save(folder: Path) -> dict[str, torch.Tensor]:
    """One rank's training save written by `dcp.save`: model, optimizer, scheduler, step, and
    the per-rank RNG and data-loader entries (`rng.rank0`, `dataloader.dp_rank_0`)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    state: dict[str, object] = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": 3,
        "rng": {"rank0": torch.get_rng_state()},
        "dataloader": {"dp_rank_0": {"position": 6}},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_dcp_training_save_resharded_to_another_world_size_is_not_called_exact(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    save = tmp_path / "step-3"
    weights = _dcp_training_save(save)
    assert run_ckpt("verify", "--exact", save).exit_code == 0

    out = tmp_path / "two"
    args = ("--world-size", "2", "--rank-state", "replicate", "--json")
    planned = run_ckpt("reshard", save, out, *args, "--dry-run")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert "ckpt-reshard.json" in {f["path"] for f in planned.json["result"]["files"]}
    done = run_ckpt("reshard", save, out, *args)
    assert done.exit_code == 0, done.stdout + done.stderr
    assert "ckpt-reshard.json" in {f["path"] for f in done.json["result"]["files"]}
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    record = json.loads((out / "ckpt-reshard.json").read_text())
    assert (record["saved_world_size"], record["world_size"]) == (1, 2)
    # DCP's own loader reads the folder as before: the record is no part of it
    restored = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(restored, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(restored["model"][k], v) for k, v in weights.items())

    exact = run_ckpt("verify", "--exact", out, "--json")
    assert exact.exit_code == 1, exact.stdout
    training = exact.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert training["resharded"] == {"saved_world_size": 1, "world_size": 2}
    [problem] = exact.json["result"]["problems"]
    assert problem["code"] == "resharded_world_size" and problem["severity"] == "error"
    assert run_ckpt("verify", "--resumable", out).exit_code == 0
    assert run_ckpt("inspect", out, "--json").json["result"]["training"]["exact"] is False

    # cut again (2 -> 3): still the world size the run saved it at
    three = tmp_path / "three"
    again = run_ckpt("reshard", out, three, "--world-size", "3", "--rank-state", "replicate")
    assert again.exit_code == 0, again.stdout + again.stderr
    record = json.loads((three / "ckpt-reshard.json").read_text())
    assert (record["saved_world_size"], record["world_size"]) == (1, 3)


def test_a_plain_dcp_model_resharded_gets_no_record(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = tmp_path / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(torch.nn.Linear(8, 4).state_dict(), checkpoint_id=str(model), no_dist=True)
    out = tmp_path / "two"
    done = run_ckpt("reshard", model, out, "--world-size", "2", "--json")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (out / "ckpt-reshard.json").exists()
    assert "ckpt-reshard.json" not in {f["path"] for f in done.json["result"]["files"]}
    assert run_ckpt("verify", out).exit_code == 0
