"""`verify --exact` of a training folder `reshard --world-size` cut for another world size: a
user's story.

An accelerate save that resumes bit-identically (`verify --exact` passes: a torchdata
StatefulDataLoader's position and order, every RNG state) was resharded from 1 process to 2
with `--rank-state replicate`. `reshard` itself said "exact: no" (each rank reads another shard
of the data and draws from another RNG stream), but `verify --exact` of the output said "exact:
yes": nothing in the folder said it had been cut. The output now holds `ckpt-reshard.json`
(the world size the run saved it at, the one it is laid out for), and `verify` and `inspect` say
it resumes, not exactly, naming the world size to resume on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import run_ckpt
from .test_accelerate_data_position import _accelerate

pytestmark = [pytest.mark.frameworks]


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
