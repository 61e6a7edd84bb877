"""Run folders: every layout found, completeness judged, `ckpt latest` never picks a broken save."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.sources.runs import looks_like_run, scan_run

from .conftest import denying_prefix, run_ckpt, run_ckpt_json_as, run_ckpt_process
from .run_fixtures import (
    accelerate_run,
    age,
    dcp_save,
    interrupted_trainer_save,
    trainer_checkpoint,
    trainer_run,
    weights,
)


class HParams(dict):  # type: ignore[type-arg]
    """Stands in for Lightning's AttributeDict."""


def table(run_dir: Path) -> dict[str, dict]:  # type: ignore[type-arg]
    result = run_ckpt("latest", run_dir, "--json")
    return {c["name"]: c for c in result.json["result"]["checkpoints"]}


def test_latest_skips_an_interrupted_newer_save(tmp_path: Path) -> None:
    """The `get_last_checkpoint` trap: the highest step is a preempted, half-written save."""
    out = trainer_run(tmp_path, steps=(100, 200))
    interrupted_trainer_save(out, 300)
    result = run_ckpt_process("latest", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{out / 'checkpoint-200'}\n"
    resumed = load_file(result.stdout.strip() + "/model.safetensors")
    for name, tensor in weights(200).items():
        assert torch.equal(resumed[name], tensor)
    rows = table(out)
    assert rows["checkpoint-300"]["status"] == "incomplete"
    assert "truncated" in rows["checkpoint-300"]["reason"]
    assert "newest" in rows["checkpoint-200"]["markers"]


@pytest.mark.parametrize("lost", ["model.safetensors", "optimizer.pt", "rng_state.pth"])
def test_a_trainer_save_that_lost_a_file_every_other_save_has_is_incomplete(
    tmp_path: Path, lost: str
) -> None:
    """`trainer_state.json` says the save finished, not that its files are still there: the
    newest save lost its model (a dead node, a careless `rm`) is incomplete, `latest` names
    the save before it and `prune --keep-last 1` keeps that one, never deleting the intact
    saves for the broken one. Weights stored in shards in one save and whole in another are
    the same part (checkpoint-300 is sharded)."""
    out = trainer_run(tmp_path, steps=(100, 200, 300, 400))
    (out / "checkpoint-400" / lost).unlink()
    age(out)  # long enough ago not to be a save still being written
    rows = table(out)
    assert [rows[f"checkpoint-{s}"]["status"] for s in (100, 200, 300)] == ["complete"] * 3
    assert rows["checkpoint-400"]["status"] == "incomplete"
    reason = rows["checkpoint-400"]["reason"]
    # the Trainer's own layout says so first, at any number of saves: its optimizer and
    # scheduler are written with its RNG states, and its weights before all of them
    if lost != "model.safetensors":
        assert f"{lost} is missing, but the Trainer saves it with" in reason
    else:
        assert "no model weights" in reason and "a Trainer save writes first" in reason
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")
    plan = run_ckpt("prune", out, "--keep-last", "1", "--json").json["result"]
    actions = {d["name"]: d["action"] for d in plan["decisions"]}
    assert actions["checkpoint-300"] == "keep", actions


def test_a_save_without_ckpts_own_manifest_is_not_missing_a_part(tmp_path: Path) -> None:
    """ckpt adds `ckpt-manifest.json` to saves after they were made (`verify
    --write-manifest`, a pull from a bucket); the training's next save has none. That save
    was "incomplete: lacks ckpt-manifest.json, which every other save of this run has", so
    `latest` named the one before it and `sync` never sent it."""
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    for step in (100, 200):
        written = run_ckpt("verify", out / f"checkpoint-{step}", "--write-manifest")
        assert written.exit_code == 0, written.stdout
        assert (out / f"checkpoint-{step}" / "ckpt-manifest.json").is_file()
    age(out)
    rows = table(out)
    assert rows["checkpoint-300"]["status"] == "complete", rows["checkpoint-300"]["reason"]
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")


def test_trainer_table_markers_and_sharded_model(tmp_path: Path) -> None:
    out = trainer_run(tmp_path)
    report = scan_run(out)
    assert [c.step for c in report.checkpoints] == [100, 200, 300, 400, 500]
    assert all(c.complete and c.layout == "hf-trainer" for c in report.checkpoints)
    assert report.checkpoints[2].formats == ["safetensors", "torch"]  # sharded + index
    assert report.trainer_best == "checkpoint-200"
    assert report.trainer_best_metric == 0.40
    assert "trainer-best" in report.checkpoints[1].markers
    assert report.latest == str(out / "checkpoint-500")
    sizes = {c.name: c.size for c in report.checkpoints}
    folder = out / "checkpoint-100"
    assert sizes["checkpoint-100"] == sum(p.stat().st_size for p in folder.iterdir())


def test_index_naming_a_missing_shard_and_missing_trainer_state(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 300))
    index = json.loads((out / "checkpoint-300" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (out / "checkpoint-300" / shard).unlink()
    state = out / "checkpoint-100" / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # cut short while being written
    age(out)
    rows = table(out)
    assert rows["checkpoint-300"]["status"] == "incomplete"
    assert shard in rows["checkpoint-300"]["reason"]
    assert rows["checkpoint-100"]["status"] == "incomplete"
    assert "trainer_state.json: not valid JSON" in rows["checkpoint-100"]["reason"]
    result = run_ckpt("latest", out)
    assert result.exit_code == 3
    assert "no complete checkpoint" in result.stderr
    envelope = run_ckpt("latest", out, "--json").json
    assert envelope["exit_code"] == 3 and envelope["result"]["latest"] is None


def test_torchtitan_dcp_without_metadata_is_incomplete(tmp_path: Path) -> None:
    run = tmp_path / "dump" / "checkpoint"
    for step in (5, 10, 20, 30):
        dcp_save(run / f"step-{step}", step)
    (run / "step-30" / ".metadata").unlink()  # killed before the commit marker
    for data in (run / "step-5").glob("*.distcp"):
        data.unlink()  # the marker is there, a rank's data is not
    age(run)
    rows = table(tmp_path / "dump")  # the torchtitan dump folder: checkpoints under checkpoint/
    assert set(rows) == {f"checkpoint/step-{n}" for n in (5, 10, 20, 30)}
    assert rows["checkpoint/step-5"]["status"] == "incomplete"
    assert ".distcp" in rows["checkpoint/step-5"]["reason"]
    assert rows["checkpoint/step-30"]["status"] == "incomplete"
    assert ".metadata" in rows["checkpoint/step-30"]["reason"]
    assert rows["checkpoint/step-20"]["formats"] == ["dcp"]
    assert run_ckpt("latest", tmp_path / "dump").stdout.strip() == str(run / "step-20")


@pytest.mark.slow
def test_a_torchtitan_save_with_train_state_and_no_optimizer_is_incomplete(tmp_path: Path) -> None:
    """torchtitan's CheckpointManager saves the model with its optimizer, lr_scheduler,
    dataloader and train_state at every step, and `load` restores them all; only a model-only
    export (`last_save_model_only`) holds the model alone. A save holding `train_state` but no
    optimizer state was called complete and named the latest: a resume from it fails (or,
    with the optimizer excluded from loading, restarts the optimizer)."""
    run = tmp_path / "dump" / "checkpoint"
    dcp_save(run / "step-10", 10)
    dcp_save(run / "step-20", 20, nested=False)  # torchtitan 0.3: model keys at the top
    dcp_save(run / "step-30", 30, states=("lr_scheduler", "dataloader", "train_state"))
    age(run)
    rows = table(tmp_path / "dump")
    assert rows["checkpoint/step-10"]["status"] == "complete"
    assert rows["checkpoint/step-20"]["status"] == "complete"
    row = rows["checkpoint/step-30"]
    assert row["status"] == "incomplete"
    assert "no optimizer state" in row["reason"] and "train_state" in row["reason"]
    assert "CheckpointManager" in row["reason"]
    assert run_ckpt("latest", tmp_path / "dump").stdout.strip() == str(run / "step-20")
    # `verify` holds the save to the same rule: exit 1, naming what it lacks
    result = run_ckpt("verify", run / "step-30")
    assert result.exit_code == 1
    assert "missing_optimizer" in result.stdout and "no optimizer state" in result.stdout
    assert run_ckpt("verify", run / "step-20").exit_code == 0
    # and the whole save of either torchtitan layout is resumable, as torchtitan resumes it
    assert run_ckpt("verify", run / "step-10", "--resumable").exit_code == 0
    assert run_ckpt("verify", run / "step-20", "--resumable").exit_code == 0
    # a model-only save (the seed step-0; the last step's `last_save_model_only` export) is
    # whole; the export is no resume point for torchtitan's `load`, which `latest` says
    dcp_save(run / "step-0", 0, states=(), nested=False)
    dcp_save(run / "step-50", 50, states=(), nested=False)
    age(run)
    rows = table(tmp_path / "dump")
    assert rows["checkpoint/step-0"]["status"] == "complete"
    assert rows["checkpoint/step-0"]["reason"] is None
    assert rows["checkpoint/step-50"]["status"] == "complete"
    assert "last_save_model_only" in rows["checkpoint/step-50"]["reason"]
    latest = run_ckpt("latest", tmp_path / "dump")
    assert latest.stdout.strip() == str(run / "step-50")
    assert "resume from the full save before it" in latest.stderr
    assert run_ckpt("verify", run / "step-50").exit_code == 0


def step_folder_save(folder: Path, step: int, *, optimizer: bool = True) -> None:
    """What a hand-written training loop saves as `step-N/`: safetensors weights and a
    torch.save optimizer file, with no commit marker (no DCP)."""
    folder.mkdir(parents=True)
    save_file(weights(step), folder / "model.safetensors")
    if optimizer:
        torch.save({"step": step, "exp_avg": torch.full((4,), float(step))}, folder / "optim.pt")


def test_a_step_folder_of_plain_files_cut_short_is_incomplete_and_never_the_latest(
    tmp_path: Path,
) -> None:
    """`step-N/` is torchtitan's name, but a folder of safetensors and torch.save files is no
    DCP save and has no commit marker: it is compared with the other saves of the run, as
    plain saves are. A save whose optimizer file never came (a crash mid-save) used to be the
    latest, and `prune --keep-last 1` deleted every save that had its optimizer state. Still
    being written, it waits its settle time."""
    run = tmp_path / "run"
    for step in (100, 200, 300):
        step_folder_save(run / f"step-{step}", step)
    age(run)
    step_folder_save(run / "step-400", 400, optimizer=False)  # being written right now
    assert table(run)["step-400"]["status"] == "writing"
    age(run)  # and never finished
    rows = table(run)
    assert [rows[f"step-{s}"]["status"] for s in (100, 200, 300)] == ["complete"] * 3
    assert rows["step-400"]["status"] == "incomplete"
    assert "lacks optim.pt, which every other save of this run has" in rows["step-400"]["reason"]
    assert run_ckpt("latest", run).stdout.strip() == str(run / "step-300")
    pruned = run_ckpt("prune", run, "--keep-last", "1", "--yes")
    assert pruned.exit_code == 0, pruned.stderr
    assert (run / "step-300" / "optim.pt").exists()


def test_a_loops_own_iter_folders_are_plain_saves_not_megatron_ones(tmp_path: Path) -> None:
    """`iter_0000100/` is Megatron-LM's name, but a loop's own folder of safetensors and
    torch.save files has no commit marker: one written a moment ago may still be being
    written, so `prune --keep-last 1` keeps the newest settled save, not only that one."""
    run = tmp_path / "run"
    step_folder_save(run / "iter_0000100", 100)
    age(run)
    step_folder_save(run / "iter_0000200", 200)  # being written right now
    report = run_ckpt("inspect", run, "--json").json["result"]["run"]
    assert "megatron" not in report["layouts"]
    pruned = run_ckpt("prune", run, "--keep-last", "1", "--yes")
    assert pruned.exit_code == 0, pruned.stderr
    assert (run / "iter_0000100" / "optim.pt").exists()
    assert (run / "iter_0000200" / "optim.pt").exists()


def test_an_accelerate_save_cut_short_before_its_rng_states_is_incomplete(
    tmp_path: Path,
) -> None:
    # accelerate's save_state writes random_states_0.pkl last; a save killed just before it
    # lacked only a numbered file, and numbered names were never compared: it was the latest
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator

    run = tmp_path / "run"
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(1, 9):
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            accelerator.save_state(str(run / "checkpoints" / f"step_{step}"))
    (run / "checkpoints" / "step_8" / "random_states_0.pkl").unlink()  # killed before it
    age(run)
    rows = table(run)
    assert [rows[f"checkpoints/step_{s}"]["status"] for s in (2, 4, 6)] == ["complete"] * 3
    assert rows["checkpoints/step_8"]["status"] == "incomplete"
    assert (
        "lacks random_states_*.pkl, which every other save" in rows["checkpoints/step_8"]["reason"]
    )
    assert run_ckpt("latest", run).stdout.strip() == str(run / "checkpoints" / "step_6")


@pytest.mark.parametrize("naming", ["automatic", "script"])
@pytest.mark.parametrize("saves", [1, 2])
def test_an_accelerate_save_cut_short_before_its_rng_states_is_unfinished_in_a_short_run(
    tmp_path: Path, naming: str, saves: int
) -> None:
    # save_state writes random_states_0.pkl after the model, optimizer and scheduler: a save
    # killed just before it was complete in a run of one or two saves (the comparison with the
    # run's other saves needs three), so `latest` named a save with no RNG states to resume.
    # accelerate's own naming (checkpoints/checkpoint_N) says save_state wrote the folder; a
    # folder of the script's naming says so when another save of the run holds its RNG states
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    run = tmp_path / "run"
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(run), automatic_checkpoint_naming=naming == "automatic"
        ),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    names = []
    for step in range(1, saves + 1):
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if naming == "automatic":
            accelerator.save_state()
            names.append(f"checkpoints/checkpoint_{step - 1}")
        else:
            accelerator.save_state(str(run / f"step_{step}"))
            names.append(f"step_{step}")
    cut = run / names[-1]
    (cut / "random_states_0.pkl").unlink()  # killed before it
    age(run)
    rows = table(run)
    latest = run_ckpt("latest", run)
    if naming == "script" and saves == 1:
        # nothing says a lone folder of the script's naming was written by save_state
        assert rows[names[-1]]["status"] == "complete"
        return
    assert rows[names[-1]]["status"] == "incomplete", rows[names[-1]]
    assert "no random_states_0.pkl, which accelerate writes last" in rows[names[-1]]["reason"]
    if saves == 1:
        assert latest.exit_code == 3
        assert "no random_states_0.pkl" in latest.stderr
    else:
        assert rows[names[0]]["status"] == "complete"
        assert latest.stdout.strip() == str(run / names[0])
        accelerator.load_state(latest.stdout.strip())  # the real reader resumes from it
    # recent, the same save is one still being written
    os.utime(cut / "model.safetensors")
    assert table(run)[names[-1]]["status"] == "writing"


class _Counter:
    """An object a script registers with `accelerator.register_for_checkpointing`."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


@pytest.mark.parametrize("naming", ["automatic", "script"])
@pytest.mark.parametrize(("saves", "lost"), [(2, 1), (2, 2), (3, 1)])
def test_an_accelerate_save_cut_short_before_its_registered_objects_is_unfinished(
    tmp_path: Path, naming: str, saves: int, lost: int
) -> None:
    # save_state writes each `register_for_checkpointing` object's custom_checkpoint_{i}.pkl
    # after every other file, RNG states included: a save killed before the last ones looked
    # whole (the comparison of three saves or more sees digits as `*`, and needs three), so
    # `latest` named a save that accelerate's load_state refuses ("Number of custom
    # checkpoints ... does not match the number of registered objects")
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    run = tmp_path / "run"
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(run), automatic_checkpoint_naming=naming == "automatic"
        ),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    counters = [_Counter(), _Counter()]
    for counter in counters:
        accelerator.register_for_checkpointing(counter)
    names = []
    for step in range(1, saves + 1):
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for counter in counters:
            counter.seen += 1
        if naming == "automatic":
            accelerator.save_state()
            names.append(f"checkpoints/checkpoint_{step - 1}")
        else:
            accelerator.save_state(str(run / f"step_{step}"))
            names.append(f"step_{step}")
    cut = run / names[-1]
    gone = [f"custom_checkpoint_{i}.pkl" for i in range(2 - lost, 2)]
    for name in gone:
        (cut / name).unlink()  # killed before it
    age(run)
    rows = table(run)
    assert rows[names[-1]]["status"] == "incomplete", rows[names[-1]]
    reason = rows[names[-1]]["reason"]
    assert f"no {', '.join(gone)}, which the save before it ({names[-2]}) holds" in reason
    assert all(rows[n]["status"] == "complete" for n in names[:-1])
    latest = run_ckpt("latest", run)
    assert latest.stdout.strip() == str(run / names[-2])
    accelerator.load_state(latest.stdout.strip())  # the real reader resumes from it
    assert [c.seen for c in counters] == [saves - 1] * 2
    with pytest.raises(RuntimeError, match="custom checkpoints"):
        accelerator.load_state(str(cut))  # and refuses the cut one
    # recent, the same save is one still being written
    os.utime(cut / "model.safetensors")
    assert table(run)[names[-1]]["status"] == "writing"


def test_a_nodes_own_folder_of_a_save_on_each_node_run_is_complete_and_never_pruned(
    tmp_path: Path,
) -> None:
    # accelerate's `save_on_each_node` on node-local disks: each node's local main process
    # writes the model and optimizer on its own disk, each process its random_states_{rank}.pkl
    # beside them. Node 1's folder of a 2-node run (one process a node) holds
    # random_states_1.pkl and no random_states_0.pkl (on node 0's disk): its names cannot tell
    # it from a save that lost rank 0's file. `latest` called such saves incomplete once
    # settled, so `prune --incomplete --yes` deleted every save of the node. It is complete,
    # with the doubt said; `verify` warns (rank_rng_elsewhere). A rank missing between two
    # that saved theirs here was lost for certain: incomplete, as before.
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    run = tmp_path / "node1"
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(run), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    saves = [run / "checkpoints" / f"checkpoint_{i}" for i in range(3)]
    for save in saves:
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
        # written by process 1 of the run, on node 1's disk
        (save / "random_states_0.pkl").rename(save / "random_states_1.pkl")
    age(run)
    rows = table(run)
    assert [rows[f"checkpoints/checkpoint_{i}"]["status"] for i in range(3)] == ["complete"] * 3
    # the doubt, said beside the verdict
    assert "random_states_0.pkl" in rows["checkpoints/checkpoint_2"]["reason"]
    assert "another node's disk" in rows["checkpoints/checkpoint_2"]["reason"]
    latest = run_ckpt("latest", run)
    assert latest.stdout.strip() == str(saves[2]), latest.stderr
    pruned = run_ckpt("prune", run, "--incomplete", "--yes", "--json")
    assert pruned.exit_code == 0, pruned.stderr
    assert all(save.is_dir() for save in saves)
    checked = run_ckpt("verify", saves[2], "--json")
    assert checked.exit_code == 0, checked.stdout
    warned = [p for p in checked.json["result"]["problems"] if p["code"] == "rank_rng_elsewhere"]
    assert [p["file"] for p in warned] == [str(saves[2] / "random_states_0.pkl")]
    assert "save_on_each_node" in warned[0]["message"] and warned[0]["severity"] == "warning"
    # recent, it may still be being written (rank 0 writes its RNG states last)
    os.utime(saves[2] / "model.safetensors")
    assert table(run)["checkpoints/checkpoint_2"]["status"] == "writing"

    # ranks 0 and 2 saved theirs here and rank 1's is gone: lost for certain
    age(run)
    shutil.copy(saves[1] / "random_states_1.pkl", saves[1] / "random_states_0.pkl")
    (saves[1] / "random_states_1.pkl").rename(saves[1] / "random_states_2.pkl")
    age(run)
    assert table(run)["checkpoints/checkpoint_1"]["status"] == "incomplete"
    lost = run_ckpt("verify", saves[1], "--json")
    assert lost.exit_code == 1, lost.stdout
    codes = {(p["code"], p["file"]) for p in lost.json["result"]["problems"]}
    assert ("missing_rank_rng", str(saves[1] / "random_states_1.pkl")) in codes


@pytest.mark.parametrize("saves", [2, 3])
def test_a_ddp_save_that_lost_its_highest_ranks_rng_states_is_no_latest(
    tmp_path: Path, saves: int
) -> None:
    # a 2-process DDP `save_state`: rank 0 writes the model, optimizer and its
    # random_states_0.pkl, rank 1 its random_states_1.pkl and nothing else. A save that lost
    # rank 1's file (killed, a node's disk) looks like a 1-process save on its own: nothing in
    # it records the world size, so `latest` named it and `prune --incomplete` kept it, and
    # accelerate's load_state on 2 ranks goes on with rank 1's RNG as it is. The save before
    # it holds both files: the newest lost one
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    run = tmp_path / "run"
    accelerator, folders = accelerate_run(run, saves, processes=2)
    (folders[-1] / "random_states_1.pkl").unlink()
    age(run)
    rows = table(run)
    newest = f"checkpoints/checkpoint_{saves - 1}"
    before = f"checkpoints/checkpoint_{saves - 2}"
    assert rows[newest]["status"] == "incomplete", rows[newest]
    reason = rows[newest]["reason"]
    assert f"no random_states_1.pkl, which the save before it ({before}) holds" in reason
    assert all(
        rows[f"checkpoints/checkpoint_{i}"]["status"] == "complete" for i in range(saves - 1)
    )
    latest = run_ckpt("latest", run)
    assert latest.stdout.strip() == str(folders[-2]), latest.stderr
    # recent, it may be rank 1 still writing its file
    os.utime(folders[-1] / "model.safetensors")
    assert table(run)[newest]["status"] == "writing"
    # the run saves again, whole: `prune --incomplete` deletes the one that lost its file
    accelerator.save_state()
    whole = run / "checkpoints" / f"checkpoint_{saves}"
    shutil.copy(whole / "random_states_0.pkl", whole / "random_states_1.pkl")
    age(run)
    age(whole, 1800)  # written after the others
    assert run_ckpt("latest", run).stdout.strip() == str(whole)
    pruned = run_ckpt("prune", run, "--incomplete", "--yes")
    assert pruned.exit_code == 0, pruned.stderr
    assert not folders[-1].exists() and all(f.is_dir() for f in [*folders[:-1], whole])


@pytest.mark.parametrize("naming", ["automatic", "script"])
def test_verify_of_an_accelerate_save_that_lost_a_file_its_save_before_holds_fails(
    tmp_path: Path, naming: str
) -> None:
    # one save given to `verify`: it lost its last registered object's
    # custom_checkpoint_1.pkl (load_state refuses it) or its highest rank's
    # random_states_1.pkl (load_state goes on without it), which nothing in the save itself
    # says were written. verify said OK; the save before it in the same folder holds them,
    # as the Trainer's sibling checkpoints say what a checkpoint-N lacks
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    run = tmp_path / "run"
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(run), automatic_checkpoint_naming=naming == "automatic"
        ),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    counters = [_Counter(), _Counter()]
    for counter in counters:
        accelerator.register_for_checkpointing(counter)
    folders = []
    for step in (5, 10, 15):
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if naming == "automatic":
            accelerator.save_state()
            folders.append(run / "checkpoints" / f"checkpoint_{len(folders)}")
        else:
            accelerator.save_state(str(run / f"step_{step}"))
            folders.append(run / f"step_{step}")
        # a 2-process save: process 1 writes its own RNG states
        shutil.copy(folders[-1] / "random_states_0.pkl", folders[-1] / "random_states_1.pkl")
    assert all(run_ckpt("verify", f).exit_code == 0 for f in folders)
    (folders[1] / "custom_checkpoint_1.pkl").unlink()
    (folders[2] / "random_states_1.pkl").unlink()
    with pytest.raises(RuntimeError, match="custom checkpoints"):
        accelerator.load_state(str(folders[1]))  # the real reader refuses it

    result = run_ckpt("verify", folders[1], "--json")
    assert result.exit_code == 1, result.stdout
    found = {(p["code"], p["file"]): p for p in result.json["result"]["problems"]}
    lost = found[("missing_component", str(folders[1] / "custom_checkpoint_1.pkl"))]
    assert folders[0].name in lost["message"] and lost["fix"], lost
    result = run_ckpt("verify", folders[2], "--json")
    assert result.exit_code == 1, result.stdout
    found = {(p["code"], p["file"]): p for p in result.json["result"]["problems"]}
    lost = found[("missing_rank_rng", str(folders[2] / "random_states_1.pkl"))]
    assert folders[1].name in lost["message"] and lost["fix"], lost
    # the first save has no save before it: nothing to compare, OK as before
    assert run_ckpt("verify", folders[0]).exit_code == 0


def test_a_trainer_save_that_lost_its_highest_ranks_rng_state_is_no_latest(tmp_path: Path) -> None:
    # a 3-process Trainer run writes rng_state_0.pth, rng_state_1.pth and rng_state_2.pth in
    # each checkpoint-N. One that lost rng_state_2.pth looks like a 2-process save on its own,
    # so `latest` named it (the Trainer resumes without it, logging a line); the checkpoint
    # before it holds it
    out = tmp_path / "out"
    for step in (100, 200):
        trainer_checkpoint(out / f"checkpoint-{step}", step)
        rng = out / f"checkpoint-{step}" / "rng_state.pth"
        for rank in range(3):
            shutil.copy(rng, rng.with_name(f"rng_state_{rank}.pth"))
        rng.unlink()
    (out / "checkpoint-200" / "rng_state_2.pth").unlink()
    age(out)
    rows = table(out)
    assert rows["checkpoint-200"]["status"] == "incomplete", rows["checkpoint-200"]
    assert (
        "no rng_state_2.pth, which the save before it (checkpoint-100) holds"
        in (rows["checkpoint-200"]["reason"])
    )
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-100")
    # `verify` of the one checkpoint says so too, as its sibling checkpoints say a lost
    # optimizer.pt
    result = run_ckpt("verify", out / "checkpoint-200", "--json")
    assert result.exit_code == 1, result.stdout
    found = {(p["code"], p["file"]): p for p in result.json["result"]["problems"]}
    lost = found[("missing_rank_rng", str(out / "checkpoint-200" / "rng_state_2.pth"))]
    assert "checkpoint-100" in lost["message"] and lost["fix"], lost
    assert run_ckpt("verify", out / "checkpoint-100").exit_code == 0


def test_staging_folders_are_interrupted_or_still_being_written(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200))
    # ckpt's own staging name (output.py) and the Trainer's tmp-checkpoint-N, both old
    shutil.copytree(out / "checkpoint-200", out / ".checkpoint-300.ckpt-tmp-abc123")
    shutil.copytree(out / "checkpoint-200", out / "tmp-checkpoint-400")
    age(out)
    # a save in progress right now: no trainer_state.json yet, files just written
    trainer_checkpoint(out / "checkpoint-500", 500)
    (out / "checkpoint-500" / "trainer_state.json").unlink()
    rows = table(out)
    assert rows[".checkpoint-300.ckpt-tmp-abc123"]["status"] == "interrupted"
    assert rows[".checkpoint-300.ckpt-tmp-abc123"]["step"] == 300
    assert rows["tmp-checkpoint-400"]["status"] == "interrupted"
    assert rows["checkpoint-500"]["status"] == "writing"
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-200")
    # with no settle window the same save is plainly incomplete
    rows = {
        c["name"]: c
        for c in run_ckpt("latest", out, "--settle", "0", "--json").json["result"]["checkpoints"]
    }
    assert rows["checkpoint-500"]["status"] == "incomplete"


def test_accelerate_deepspeed_lightning_and_plain_layouts(tmp_path: Path) -> None:
    acc = tmp_path / "acc"
    for i in range(3):
        folder = acc / "checkpoints" / f"checkpoint_{i}"
        folder.mkdir(parents=True)
        save_file(weights(i), folder / "model.safetensors")
        torch.save({"state": {}, "param_groups": []}, folder / "optimizer.bin")
        # one process: `save_state` names its RNG file after its rank, 0, in every save
        torch.save({"cpu": torch.random.get_rng_state()}, folder / "random_states_0.pkl")
    # save_state of step 3 died after the model: nothing marks the end of an accelerate save
    (acc / "checkpoints" / "checkpoint_3").mkdir()
    save_file(weights(3), acc / "checkpoints" / "checkpoint_3" / "model.safetensors")
    ds = tmp_path / "ds"
    for step in (10, 20):
        (ds / f"global_step{step}").mkdir(parents=True)
        torch.save(
            {"module": weights(step)}, ds / f"global_step{step}" / "mp_rank_00_model_states.pt"
        )
    (ds / "latest").write_text("global_step10")  # the step-20 save never finished
    pl = tmp_path / "pl" / "checkpoints"
    pl.mkdir(parents=True)
    for epoch, step, loss in ((0, 50, 0.8), (1, 100, 0.3), (2, 150, 0.5)):
        # Lightning pickles its hyper-parameters as a dict subclass weights_only refuses:
        # the file is whole all the same
        torch.save(
            {"state_dict": weights(step), "global_step": step, "hyper_parameters": HParams(lr=1)},
            pl / f"epoch={epoch}-step={step}-val_loss={loss}.ckpt",
        )
    blob = (pl / "epoch=2-step=150-val_loss=0.5.ckpt").read_bytes()
    (pl / "epoch=2-step=150-val_loss=0.5.ckpt").write_bytes(blob[:-100])  # truncated
    os.symlink("epoch=1-step=100-val_loss=0.3.ckpt", pl / "last.ckpt")
    plain = tmp_path / "plain"
    plain.mkdir()
    for step in (1000, 2000):
        torch.save(weights(step), plain / f"model_{step}.pt")
        torch.save({"state": {}}, plain / f"optim_{step}.pt")
    (plain / "notes_3000.txt").write_text("not a checkpoint")
    for folder in (acc, ds, pl.parent, plain):
        age(folder)

    acc_rows = table(acc)
    assert list(acc_rows) == [f"checkpoints/checkpoint_{i}" for i in range(4)]
    assert {r["layout"] for r in acc_rows.values()} == {"accelerate"}
    assert [r["complete"] for r in acc_rows.values()] == [True, True, True, False]
    assert "lacks optimizer.bin" in acc_rows["checkpoints/checkpoint_3"]["reason"]
    assert run_ckpt("latest", acc).stdout.strip() == str(acc / "checkpoints" / "checkpoint_2")

    # with two tags the DeepSpeed save folder is a run; with one, inspect opens that checkpoint
    assert looks_like_run(ds)
    single = tmp_path / "ds1"
    shutil.copytree(ds / "global_step10", single / "global_step10")
    (single / "latest").write_text("global_step10")
    assert not looks_like_run(single)
    assert run_ckpt("inspect", ds, "--json").json["result"]["format"] == "run"

    ds_rows = table(ds)
    assert ds_rows["global_step10"]["markers"] == ["newest", "deepspeed-latest"]
    assert ds_rows["global_step20"]["status"] == "incomplete"
    assert "latest" in ds_rows["global_step20"]["reason"]

    pl_rows = table(pl.parent)
    assert pl_rows["checkpoints/epoch=1-step=100-val_loss=0.3.ckpt"]["epoch"] == 1
    assert "link-target" in pl_rows["checkpoints/epoch=1-step=100-val_loss=0.3.ckpt"]["markers"]
    assert pl_rows["checkpoints/epoch=2-step=150-val_loss=0.5.ckpt"]["status"] == "incomplete"
    assert run_ckpt("latest", pl.parent).stdout.strip() == str(
        pl / "epoch=1-step=100-val_loss=0.3.ckpt"
    )

    plain_rows = table(plain)
    assert list(plain_rows) == ["model_1000.pt", "model_2000.pt"]
    assert plain_rows["model_2000.pt"]["paths"] == [
        str(plain / "model_2000.pt"),
        str(plain / "optim_2000.pt"),
    ]


def lightning_version(version: Path, steps: tuple[int, ...]) -> None:
    """Lightning's `lightning_logs/version_N/`: ModelCheckpoint saves, logs beside them."""
    ckpts = version / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in steps:
        torch.save(
            {"state_dict": weights(step), "global_step": step, "epoch": 0},
            ckpts / f"epoch=0-step={step}.ckpt",
        )
    (version / "hparams.yaml").write_text("lr: 0.1\n")


@pytest.mark.parametrize("kind", ["lightning_logs", "sweep", "named"])
def test_a_folder_of_runs_is_refused_never_pruned_as_one_run(tmp_path: Path, kind: str) -> None:
    # lightning_logs/version_0, sweep/trial_0: numbered run folders, each holding its own step
    # checkpoints; read as one run, `latest` printed version_1 and `prune --keep-last 1 --yes`
    # deleted version_0 with every checkpoint and log in it. Run folders of any name
    # (runs/exp1/checkpoint-500) are refused the same way: `latest` said "no step checkpoints
    # found" (exit 3) without naming them, and `inspect` / `verify` exited 4 telling the user
    # to run `ckpt latest` on the folder, which then refused it
    root = tmp_path / kind
    runs = {
        "lightning_logs": ["version_0", "version_1"],
        "sweep": ["trial_0", "trial_1"],
        "named": ["exp_a", "exp_b"],
    }[kind]
    for name in runs:
        if kind == "lightning_logs":
            lightning_version(root / name, (10, 20))
        else:
            for step in (500, 1000):  # each trial's (each experiment's) Trainer output_dir
                trainer_checkpoint(root / name / f"checkpoint-{step}", step)
    age(root)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    latest = run_ckpt("latest", root)
    assert latest.exit_code == 2
    assert f"holds run folders ({', '.join(runs)})" in latest.stderr
    assert f"{root}/{runs[-1]}" in latest.stderr  # the fix names one to pass
    pruned = run_ckpt("prune", root, "--keep-last", "1", "--yes")
    assert pruned.exit_code == 2
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    # every command that reads a checkpoint says the same: a usage error naming the runs
    for command in ("inspect", "verify", "protect"):
        refused = run_ckpt(command, root)
        assert refused.exit_code == 2, (command, refused.stderr)
        assert f"holds run folders ({', '.join(runs)})" in refused.stderr, refused.stderr
        assert f"{root}/{runs[-1]}" in refused.stderr
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    # each run folder on its own is a run, its steps its checkpoints
    one = root / runs[0]
    newest = "checkpoints/epoch=0-step=20.ckpt" if kind == "lightning_logs" else "checkpoint-1000"
    assert run_ckpt("latest", one).stdout.strip() == str(one / newest)
    assert looks_like_run(root / runs[0])


def test_a_run_folder_or_a_folder_of_saves_given_for_one_checkpoint_names_what_to_pass(
    tmp_path: Path,
) -> None:
    # `verify out/` (the Trainer's output_dir) or `verify exports/` (final/ and best/ saved with
    # save_pretrained): no checkpoint of its own, so a usage error (exit 2) naming where the
    # checkpoints are. It was exit 4 ("bad checkpoint") for both, and for exports/ the fix said
    # to run `ckpt latest` on it, which finds no step checkpoint there
    out = trainer_run(tmp_path, steps=(100, 200))
    refused = run_ckpt("verify", out)
    assert refused.exit_code == 2, refused.stderr
    assert "is a run folder (checkpoint-100, checkpoint-200), not one checkpoint" in refused.stderr
    assert f"ckpt latest {out}" in refused.stderr
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-200")

    exports = tmp_path / "exports"
    for name in ("best", "final"):
        (exports / name).mkdir(parents=True)
        save_file(weights(1), exports / name / "model.safetensors")
    for command in ("inspect", "verify"):
        refused = run_ckpt(command, exports, "--json")
        assert refused.exit_code == 2, refused.stderr
        message = refused.json["error"]["message"]
        assert "its subfolders do (best/, final/)" in message, message
        assert "ckpt latest" not in message
        assert f"{exports}/final" in refused.json["error"]["fix"]
    assert run_ckpt("inspect", exports / "final").exit_code == 0


def test_a_folder_of_only_an_empty_parity_folder_holds_no_checkpoint(tmp_path: Path) -> None:
    # a `.ckpt-parity/` with no parity manifest in it can rebuild nothing: the folder holds no
    # checkpoint (exit 3, as an empty folder), not "the parity lists the files it had" (exit 4)
    empty = tmp_path / "empty"
    (empty / ".ckpt-parity").mkdir(parents=True)
    for command in ("inspect", "verify"):
        refused = run_ckpt(command, empty, "--json")
        assert refused.exit_code == 3, refused.stderr
        assert refused.json["error"]["code"] == "no_checkpoint"
        assert "lists the files it had" not in refused.json["error"]["message"]
    assert run_ckpt("latest", empty).exit_code == 3
    assert run_ckpt("repair", empty).exit_code == 3


def test_a_stray_numbered_file_beside_trainer_checkpoints_is_no_checkpoint(
    tmp_path: Path,
) -> None:
    # the training script dumped eval predictions into the Trainer's output_dir: named
    # NAME_N.pt, it was the newest "checkpoint" and took a --keep-last slot
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    torch.save({"predictions": torch.randn(8, 4)}, out / "eval_preds_1000.pt")
    age(out)
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")
    report = run_ckpt("latest", out, "--json").json["result"]
    assert [c["name"] for c in report["checkpoints"]] == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    ]
    assert report["left_out"] == [
        "eval_preds_1000.pt: a loose file beside the hf-trainer checkpoints, whose saves are "
        "named otherwise: not a checkpoint of this run"
    ]
    pruned = run_ckpt("prune", out, "--keep-last", "2", "--yes")
    assert pruned.exit_code == 0
    assert "left out: eval_preds_1000.pt" in pruned.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-200",
        "checkpoint-300",
        "eval_preds_1000.pt",
    ]


def test_inspect_of_a_run_folder_shows_the_table(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200))
    interrupted_trainer_save(out, 300)
    save_file(weights(200), out / "model.safetensors")  # trainer.save_model() at the end
    age(out)
    assert looks_like_run(out)
    assert not looks_like_run(out / "checkpoint-100")
    report = run_ckpt("inspect", out, "--json").json["result"]
    assert report["format"] == "run"
    assert [c["status"] for c in report["run"]["checkpoints"]] == [
        "complete",
        "complete",
        "incomplete",
    ]
    human = run_ckpt("inspect", out)
    assert human.exit_code == 0
    assert "checkpoint-300" in human.stdout and "incomplete" in human.stdout
    assert f"latest complete: {out / 'checkpoint-200'}" in human.stdout
    assert "also in the folder itself: model.safetensors" in human.stdout
    final = run_ckpt("inspect", out, "--format", "safetensors", "--json").json["result"]
    assert final["format"] == "safetensors" and final["tensors"] == len(weights(200))
    # accelerate's save_state numbers the parts of ONE checkpoint: not a run folder
    state = tmp_path / "state"
    state.mkdir()
    for name in ("model.safetensors", "model_1.safetensors", "model_2.safetensors"):
        save_file(weights(1), state / name)
    assert not looks_like_run(state)
    plain = tmp_path / "plain"
    plain.mkdir()
    for step in (10, 20):
        save_file(weights(step), plain / f"model_{step}.safetensors")
    assert looks_like_run(plain)
    # a checkpoint folder itself is still inspected as a checkpoint
    single = run_ckpt("inspect", out / "checkpoint-100" / "model.safetensors", "--json")
    assert single.json["result"]["format"] == "safetensors"


def test_latest_on_missing_or_empty_folders(tmp_path: Path) -> None:
    assert run_ckpt("latest", tmp_path / "nope").exit_code == 3
    empty = run_ckpt("latest", tmp_path)
    assert empty.exit_code == 3
    assert "no step checkpoints" in empty.stderr


def test_latest_of_a_dcp_run_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    from .conftest import REPO

    run = tmp_path / "run"
    for step in (10, 20):
        dcp_save(run / f"step-{step}", step)
    age(run)
    probe = (
        "import sys; sys.argv = ['ckpt', 'latest', sys.argv[1]]\n"
        "from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(run)], capture_output=True, text=True, env=env
    )
    assert proc.stdout.strip() == str(run / "step-20")
    assert "NO_TORCH" in proc.stderr, proc.stderr


def test_a_run_folder_given_where_a_checkpoint_is_wanted_is_named_as_one(tmp_path: Path) -> None:
    """`verify` / `convert` of a run folder said it was no checkpoint ckpt recognises, while
    `inspect` and `latest` read it as a run: it says it is a run folder and how to pick one,
    a usage error (exit 2) as for a folder of run folders."""
    out = trainer_run(tmp_path, steps=(100, 200))
    for command in (("verify", out), ("convert", out, tmp_path / "o", "--to", "torch")):
        result = run_ckpt(*command)
        assert result.exit_code == 2
        assert "is a run folder (checkpoint-100, checkpoint-200)" in result.stderr
        assert f"ckpt latest {out}" in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "denied", ["checkpoint-200/optimizer.pt", "checkpoint-200/trainer_state.json", "checkpoint-200"]
)
@pytest.mark.slow
def test_a_save_ckpt_may_not_read_is_a_permission_error_naming_the_file_never_incomplete(
    tmp_path: Path, denied: str
) -> None:
    """`chmod 000` on one file (or the folder) of the newest save: `latest` and `prune` called it
    incomplete ("truncated or corrupt torch.save file (Permission denied)"), `latest` printed
    checkpoint-100 and `prune --incomplete --yes` deleted the newest save. They fail with exit 74
    (an OS error, docs/safety.md) naming the file and EACCES, and delete nothing."""
    out = trainer_run(tmp_path, steps=(100, 200))
    target = out / denied
    mode = target.stat().st_mode
    target.chmod(0)
    try:
        prefix = denying_prefix(target)
        for command in (
            ("latest", out),
            ("prune", out, "--keep-last", "1", "--incomplete", "--yes"),
        ):
            code, doc = run_ckpt_json_as(prefix, *command)
            assert code == 74, doc
            error = doc["error"]
            assert (error["code"], error["path"]) == ("io_error", str(target)), error
            assert "EACCES" in error["message"] and "permission" in error["fix"].lower()
    finally:
        target.chmod(mode)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-100", "checkpoint-200"]
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-200")


@pytest.mark.parametrize(
    ("state", "step"),
    [
        ({"best_metric": "NaN"}, "200"),  # strings where numbers belong
        ({"best_metric": 10**400}, [200]),  # an int past a float's range; a list
    ],
)
@pytest.mark.slow
def test_a_trainer_state_with_values_of_the_wrong_type_is_no_internal_error(
    tmp_path: Path, state: dict[str, object], step: object
) -> None:
    """A hand-edited (or hostile) `trainer_state.json` whose metric or step is no number is
    no internal error (0.1.x: exit 70, "could not convert string to float"). Its metrics say
    nothing: `latest`, `prune` and `inspect` judge the run as before. A `global_step` that is
    no count of steps makes the save incomplete (the Trainer's resume divides it by the steps
    of an epoch: a TypeError), so `latest` names the save before it."""
    out = trainer_run(tmp_path, steps=(100, 200))
    path = out / "checkpoint-200" / "trainer_state.json"
    doc = json.loads(path.read_text())
    doc.update(state, best_model_checkpoint=str(out / "checkpoint-100"))
    doc["log_history"] = [{"step": 100, "eval_loss": 10**400}, {"step": 200, "eval_loss": "x"}]
    path.write_text(json.dumps(doc))
    latest = run_ckpt_process("latest", out)
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout == f"{out / 'checkpoint-200'}\n"
    inspect = run_ckpt("inspect", out, "--json")
    assert inspect.json["result"]["run"]["trainer_best"] == "checkpoint-100"
    assert inspect.json["result"]["run"]["trainer_best_metric"] is None
    prune = run_ckpt("prune", out, "--keep-last", "1", "--keep-best", "eval_loss", "--json")
    assert prune.exit_code == 3, prune.stdout  # no value of eval_loss is a number
    assert "no value of 'eval_loss'" in prune.json["error"]["message"]
    doc["global_step"] = step
    path.write_text(json.dumps(doc))
    latest = run_ckpt_process("latest", out)
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout == f"{out / 'checkpoint-100'}\n"
    verified = run_ckpt("verify", out / "checkpoint-200", "--json")
    assert verified.exit_code == 1, verified.stdout
    assert [p["code"] for p in verified.json["result"]["problems"]] == ["unreadable_component"]


def test_a_metrics_line_nested_past_pythons_limit_is_a_usage_error_naming_it(
    tmp_path: Path,
) -> None:
    """0.1.x: `prune --keep-best` of a run whose metrics.jsonl holds a line nested 100,000 deep
    ended in exit 70 (RecursionError)."""
    out = trainer_run(tmp_path, steps=(100, 200))
    (out / "metrics.jsonl").write_text(
        '{"step": 100, "eval_loss": 1.0}\n' + "[" * 100_000 + "]" * 100_000 + "\n"
    )
    result = run_ckpt("prune", out, "--keep-last", "1", "--keep-best", "eval_loss")
    assert result.exit_code == 2, result.stderr
    assert "line 2 is not JSON" in result.stderr
    assert str(out / "metrics.jsonl") in result.stderr


def test_every_length_of_time_takes_seconds_or_units(tmp_path: Path) -> None:
    """`--settle 2m` and `--watch 5m` were refused ("Input should be a valid number") while
    `--keep-within 2d` took units: every option that is a length of time takes both now."""
    out = trainer_run(tmp_path, steps=(100, 200))
    age(out)
    trainer_checkpoint(out / "checkpoint-300", 300)  # being written right now
    (out / "checkpoint-300" / "trainer_state.json").unlink()

    def status(*settle: str) -> str:
        report = run_ckpt("latest", out, *settle, "--json").json["result"]
        return {c["name"]: c["status"] for c in report["checkpoints"]}["checkpoint-300"]

    assert status("--settle", "2m") == status("--settle", "120") == status() == "writing"
    assert status("--settle", "0") == status("--settle", "0s") == "incomplete"
    for command in ("latest", "doctor"):
        refused = run_ckpt(command, out, "--settle", "soon", "--json")
        assert refused.exit_code == 2
        assert "--settle 'soon' is not a duration" in refused.json["error"]["message"]
    # prune --watch 5m is taken (one round, then --max-iterations ends it); deletes nothing
    watched = run_ckpt(
        "prune", out, "--keep-last", "5", "--yes", "--watch", "5m", "--max-iterations", "1"
    )
    assert watched.exit_code == 0, watched.stderr
    assert (out / "checkpoint-100").is_dir() and (out / "checkpoint-200").is_dir()
    assert run_ckpt("prune", out, "--keep-last", "1", "--yes", "--watch", "0").exit_code == 2


def test_a_real_trainer_save_without_its_optimizer_is_incomplete_in_a_run_of_two(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """A real Trainer run saved checkpoint-2 and checkpoint-4; checkpoint-4 lost optimizer.pt.
    Below three saves there was nothing to compare it with, so `latest` named it, complete:
    a resume from it restarts AdamW from zero. The Trainer's own layout says it writes
    optimizer.pt with scheduler.pt and rng_state.pth (unless save_only_model), both here:
    incomplete, whatever the number of saves; `latest` names checkpoint-2."""
    out = shutil.copytree(real_trainer_run / "straight", tmp_path / "out")
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    age(out)
    rows = table(out)
    assert rows["checkpoint-2"]["status"] == "complete"
    assert rows["checkpoint-4"]["status"] == "incomplete"
    assert "optimizer.pt is missing" in rows["checkpoint-4"]["reason"]
    latest = run_ckpt_process("latest", out)
    assert latest.exit_code == 0, latest.stderr
    assert latest.stdout == f"{out / 'checkpoint-2'}\n"
    state = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert state["state"], "the save named holds the optimizer's moments"
    # nothing left saying what a full save holds (no optimizer, scheduler, RNG file, no
    # training_args.bin, no other save): not called whole silently, the reason says so
    for name in ("scheduler.pt", "rng_state.pth", "training_args.bin"):
        (out / "checkpoint-4" / name).unlink()
    shutil.rmtree(out / "checkpoint-2")
    age(out)
    unknown = table(out)["checkpoint-4"]
    assert unknown["status"] == "complete"
    assert "no training_args.bin says whether the run saved them" in unknown["reason"]
    latest = run_ckpt_process("latest", out)
    assert latest.stdout == f"{out / 'checkpoint-4'}\n"
    assert "warning" in latest.stderr and "save_only_model" in latest.stderr


def test_a_real_accelerate_save_without_its_optimizer_is_incomplete_in_a_run_of_two(
    real_accelerate_run: Path, tmp_path: Path
) -> None:
    """accelerate's `save_state` at step 2 and 4, and step-4's optimizer.bin lost: with two
    saves nothing compared them and `latest` named step-4. save_state writes the optimizer's
    state before the scheduler's, and scheduler.bin is here: step-4 is incomplete."""
    out = shutil.copytree(real_accelerate_run / "straight", tmp_path / "run")
    assert (out / "step-4" / "scheduler.bin").is_file()
    (out / "step-4" / "optimizer.bin").unlink()
    age(out)
    rows = table(out)
    assert rows["step-2"]["status"] == "complete"
    assert rows["step-4"]["status"] == "incomplete"
    assert "optimizer.bin is missing, but scheduler.bin is here" in rows["step-4"]["reason"]
    assert run_ckpt("latest", out).stdout.strip() == str(out / "step-2")
    verified = run_ckpt("verify", out / "step-4", "--json")
    assert verified.exit_code == 1
    assert [p["code"] for p in verified.json["result"]["problems"]] == ["missing_component"]


def test_a_torchtitan_model_only_final_save_is_a_complete_export(tmp_path: Path) -> None:
    """torchtitan with `last_save_model_only`: every `step-N/` is a full DCP of the model's
    FQNs beside `optimizer`, `lr_scheduler`, `dataloader` and `train_state`, except the last,
    which `_save_last_step` writes as the model's state dict alone, cast to `export_dtype`.
    That final save is a whole model export: complete (no reason about optimizer state), the
    newest, and its verify passes; the intermediate saves keep their training state."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = tmp_path / "outputs" / "checkpoint"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (10, 20):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            sched.step()
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {
                **model_sd,
                "optimizer": optim_sd,
                "lr_scheduler": sched.state_dict(),
                # ParallelAwareDataloader.state_dict: the rank's state pickled, the dp degree
                "dataloader": {"dp_rank_0": pickle.dumps({"pos": step}), "world_size": 1},
                "train_state": {"step": step, "ntokens_seen": step * 64},
            }
            dcp.save(state, checkpoint_id=str(run / f"step-{step}"), no_dist=True)
        final = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        dcp.save(final, checkpoint_id=str(run / "step-30"), no_dist=True)
    age(run)
    rows = table(run)
    assert {name: (row["status"], row["reason"]) for name, row in rows.items()} == {
        "step-10": ("complete", None),
        "step-20": ("complete", None),
        "step-30": ("complete", rows["step-30"]["reason"]),
    }
    # complete weights, and said to be no resume point (torchtitan's `load` of a step past 0
    # restores the training state too): never a reason about missing optimizer state
    export_note = rows["step-30"]["reason"]
    assert "model-only export" in export_note and "optimizer state" not in export_note
    latest = run_ckpt_process("latest", run)
    assert latest.stdout == f"{run / 'step-30'}\n"
    assert "model-only export" in latest.stderr and "--checkpoint.load_step" in latest.stderr
    verified = run_ckpt("verify", run / "step-30", "--json")
    assert verified.exit_code == 0 and verified.json["result"]["problems"] == []
    export = run_ckpt("inspect", run / "step-30", "--json").json["result"]
    assert export["training"] is None  # a model, not a training save missing its optimizer
    assert export["parameters"] == sum(p.numel() for p in model.parameters())
    loaded = {k: torch.empty_like(v) for k, v in final.items()}
    dcp.load(loaded, checkpoint_id=str(run / "step-30"), no_dist=True)
    assert all(torch.equal(loaded[k], final[k]) for k in final)
    full = run_ckpt("inspect", run / "step-20", "--json").json["result"]["training"]
    assert full["layout"] == "torchtitan" and full["resumable"] is True
    assert full["step"] == 20 and full["optimizer"]["kind"] == "AdamW"


def test_the_old_copy_a_killed_force_replace_left_is_never_the_latest(tmp_path: Path) -> None:
    """A replace of checkpoint-100 (a pull of a save synced again, a `--force` convert) killed
    mid-way leaves the old copy as `.checkpoint-100.ckpt-old-PID`. Its name ends in a number:
    `ckpt latest` took it for a plain save of step PID (12345 here), newer than every real
    step, and a resume script resumed from that hidden, replaced copy."""
    out = trainer_run(tmp_path, steps=(100, 200))
    shutil.copytree(out / "checkpoint-100", out / ".checkpoint-100.ckpt-old-12345")
    result = run_ckpt_process("latest", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{out / 'checkpoint-200'}\n"
    rows = table(out)
    assert sorted(rows) == ["checkpoint-100", "checkpoint-200"]
    # and `prune --incomplete` never plans it as debris of the run (`prune --yes` settles it
    # as every writer of the run does: removed, and said, once checkpoint-100 is whole and
    # its process is gone; test_faults.py covers that)
    planned = run_ckpt("prune", out, "--incomplete", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert "ckpt-old" not in json.dumps(planned.json["result"])
    assert (out / ".checkpoint-100.ckpt-old-12345" / "model.safetensors").is_file()


def test_a_plain_save_whose_torch_file_is_no_torch_file_is_never_the_latest(
    tmp_path: Path,
) -> None:
    """A plain loop's `step-7/` held only `model.bin`, five bytes of garbage (a copy cut at
    its start, a file written by something else): `ckpt latest` called it the newest complete
    save, while `ckpt verify` said it is no torch file, and a resume script resumed from it.
    Legacy torch.save files (a pickle, no zip) are still whole saves, and a `.bin` that is no
    torch file beside a save's own files is no part of it."""
    run = tmp_path / "run"
    (run / "step-5").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, run / "step-5" / "model.bin")
    (run / "step-6").mkdir()
    torch.save(
        {"w": torch.ones(2)}, run / "step-6" / "model.bin", _use_new_zipfile_serialization=False
    )
    (run / "step-7").mkdir()
    (run / "step-7" / "model.bin").write_bytes(b"12345")
    age(run)
    rows = table(run)
    assert rows["step-5"]["status"] == "complete"
    assert rows["step-6"]["status"] == "complete"
    assert rows["step-7"]["status"] == "incomplete"
    assert "not a torch.save file" in rows["step-7"]["reason"]
    assert "text file" in rows["step-7"]["reason"]  # what it is instead
    # a Trainer save may hold a `.bin` of its own beside its torch.save files (verify passes
    # it): no part of the save, never a reason to call it incomplete
    trainer = tmp_path / "trainer"
    trainer_checkpoint(trainer / "checkpoint-100", 100)
    (trainer / "checkpoint-100" / "extra.bin").write_bytes(bytes(range(256)) * 64)
    age(trainer)
    assert run_ckpt("verify", trainer / "checkpoint-100").exit_code == 0
    assert table(trainer)["checkpoint-100"]["status"] == "complete"
    latest = run_ckpt_process("latest", run)
    assert latest.stdout == f"{run / 'step-6'}\n", latest.stderr
    assert run_ckpt("verify", run / "step-7").exit_code != 0  # the two commands agree


def test_a_trainer_save_whose_optimizer_file_is_garbage_is_never_the_latest(
    tmp_path: Path,
) -> None:
    """`checkpoint-200/optimizer.pt` overwritten with random bytes (a copy from a failing
    disk): a file the Trainer saves its state in is part of the save whatever its bytes, so
    the save is damaged, as `verify` says, and `latest` names the one before."""
    out = trainer_run(tmp_path, steps=(100, 200))
    (out / "checkpoint-200" / "optimizer.pt").write_bytes(bytes(range(256)) * 16)
    age(out)
    rows = table(out)
    assert rows["checkpoint-100"]["status"] == "complete"
    assert rows["checkpoint-200"]["status"] == "incomplete"
    assert "optimizer.pt: not a torch.save file" in rows["checkpoint-200"]["reason"]
    latest = run_ckpt_process("latest", out)
    assert latest.stdout == f"{out / 'checkpoint-100'}\n", latest.stderr
    assert run_ckpt("verify", out / "checkpoint-200").exit_code != 0  # the two agree


def test_a_save_that_lost_rank_0s_rng_states_its_save_before_holds_is_no_latest(
    tmp_path: Path,
) -> None:
    # a 2-process DDP `save_state` and a 2-process Trainer run: every process writes its own
    # RNG file, rank 0 too, in every save. The newest save lost rank 0's (a careless `rm`, a
    # copy cut short): its names alone look like node 1's folder of a `save_on_each_node` run
    # on node-local disks, so `verify` only warned (rank_rng_elsewhere), `latest` named it once
    # settled and `convert` wrote it. A run of any number of processes writes rank 0's file,
    # and the save before holds it: lost, as a lost highest rank's file is
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    run = tmp_path / "run"
    accelerator, folders = accelerate_run(run, 3, processes=2)
    (folders[-1] / "random_states_0.pkl").unlink()
    trainer = tmp_path / "out"
    for step in (100, 200, 300):
        trainer_checkpoint(trainer / f"checkpoint-{step}", step)
        rng = trainer / f"checkpoint-{step}" / "rng_state.pth"
        for rank in range(2):
            shutil.copy(rng, rng.with_name(f"rng_state_{rank}.pth"))
        rng.unlink()
    (trainer / "checkpoint-300" / "rng_state_0.pth").unlink()
    for folder, lost, before, newest in (
        (run, "random_states_0.pkl", folders[1], folders[2]),
        (trainer, "rng_state_0.pth", trainer / "checkpoint-200", trainer / "checkpoint-300"),
    ):
        age(folder)
        rows = {
            Path(c["path"]): c
            for c in run_ckpt("latest", folder, "--json").json["result"]["checkpoints"]
        }
        assert rows[newest]["status"] == "incomplete", rows[newest]
        assert (
            f"no {lost}, which the save before it ({before.relative_to(folder)}) holds"
            in rows[newest]["reason"]
        )
        assert rows[before]["status"] == "complete"
        assert run_ckpt("latest", folder).stdout.strip() == str(before)
        result = run_ckpt("verify", newest, "--json")
        assert result.exit_code == 1, result.stdout
        problems = result.json["result"]["problems"]
        # one problem for the file: the certain one, not the doubt
        assert [(p["code"], p["file"]) for p in problems] == [
            ("missing_rank_rng", str(newest / lost))
        ], problems
        assert before.name in problems[0]["message"] and "rank 0" in problems[0]["message"]
        assert "fewer processes" not in problems[0]["fix"]  # a smaller run writes rank 0's too
        refused = run_ckpt("convert", newest, tmp_path / f"{folder.name}-whole", "--to", "dcp")
        assert refused.exit_code == 4, refused.stderr
        assert "--filter-out 'rng_0*'" in refused.stderr
        assert not (tmp_path / f"{folder.name}-whole").exists()
    accelerator.load_state(str(folders[1]))  # the real reader resumes from the one `latest` names


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_trainer_run_resumed_on_another_number_of_processes_keeps_its_newest_save(
    tmp_path: Path, ranks: tuple[int, int]
) -> None:
    # a Trainer run saved on 2 processes (rng_state_0.pth, rng_state_1.pth in each
    # checkpoint-N), stopped, and resumed on 1 (rng_state.pth, which the Trainer writes only
    # when it runs on one process), or the other way round. `latest` called the newest save
    # incomplete ("lacks rng_state_*.pth, which every other save of this run has", or "lacks
    # rng_state.pth") and named the one before it; `verify` of the 1-process save failed it
    # (missing_rank_rng for rng_state_1.pth). Its names say how many processes saved it
    out = tmp_path / "out"
    for step, world in ((100, ranks[0]), (200, ranks[0]), (300, ranks[1])):
        trainer_checkpoint(out / f"checkpoint-{step}", step)
        rng = out / f"checkpoint-{step}" / "rng_state.pth"
        if world > 1:
            for rank in range(world):
                shutil.copy(rng, rng.with_name(f"rng_state_{rank}.pth"))
            rng.unlink()
    age(out)
    rows = table(out)
    assert [rows[f"checkpoint-{s}"]["status"] for s in (100, 200, 300)] == ["complete"] * 3, rows
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")
    checked = run_ckpt("verify", out / "checkpoint-300", "--json")
    assert checked.exit_code == 0, checked.stdout
    assert checked.json["result"]["problems"] == []
    pruned = run_ckpt("prune", out, "--incomplete", "--yes")
    assert pruned.exit_code == 0, pruned.stderr
    assert all((out / f"checkpoint-{s}").is_dir() for s in (100, 200, 300))
    if ranks == (2, 1):
        # a 2-process save that lost rank 1's file is still found: its rng_state_0.pth says
        # several processes saved it, and the save before holds rng_state_1.pth
        (out / "checkpoint-200" / "rng_state_1.pth").unlink()
        age(out)
        assert table(out)["checkpoint-200"]["status"] == "incomplete"
        lost = run_ckpt("verify", out / "checkpoint-200", "--json").json["result"]["problems"]
        assert [(p["code"], p["file"]) for p in lost] == [
            ("missing_rank_rng", str(out / "checkpoint-200" / "rng_state_1.pth"))
        ], lost


def test_verify_of_an_accelerate_save_that_lost_every_ranks_rng_states_fails(
    tmp_path: Path,
) -> None:
    # a 2-process DDP `save_state` writes random_states_0.pkl and random_states_1.pkl at every
    # save, last. The newest save lost both (a copy that skipped `*.pkl`, a cut-short save):
    # `latest` calls it incomplete, but `verify` of the save said OK and `convert` wrote it
    # without a word, while accelerate's load_state goes on without them ("Could not load
    # random states"), so the resumed run draws other random numbers. The save before holds
    # them: lost
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    run = tmp_path / "run"
    accelerator, folders = accelerate_run(run, 2, processes=2)
    for lost in folders[1].glob("random_states_*.pkl"):
        lost.unlink()
    accelerator.load_state(str(folders[1]))  # the real reader goes on without them
    age(run)
    assert run_ckpt("latest", run).stdout.strip() == str(folders[0])

    result = run_ckpt("verify", folders[1], "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    found = {p["file"]: p for p in problems if p["code"] == "missing_rank_rng"}
    assert sorted(found) == [str(folders[1] / f"random_states_{r}.pkl") for r in (0, 1)], problems
    assert all(folders[0].name in p["message"] for p in found.values())
    refused = run_ckpt("convert", folders[1], tmp_path / "whole", "--to", "dcp")
    assert refused.exit_code == 4 and "random_states_0.pkl" in refused.stderr, refused.stderr
    assert not (tmp_path / "whole").exists()
    # the first save has no save before it: nothing to compare, OK as before
    assert run_ckpt("verify", folders[0]).exit_code == 0


def test_latest_of_one_checkpoint_names_the_run_folder_to_ask(tmp_path: Path) -> None:
    """`ckpt latest out/checkpoint-500` (the save, not its run folder) said "no step
    checkpoints found", which reads as if the run had none: it says the folder is one
    checkpoint and names the run folder that `latest` answers for, exit 3 as before."""
    run = trainer_run(tmp_path, steps=(100, 200))
    one = run_ckpt("latest", run / "checkpoint-200", "--json")
    assert one.exit_code == 3, one.stdout
    error = one.json["error"]
    assert error["code"] == "no_checkpoint"
    assert error["problem"] == "is one checkpoint, not a run folder of checkpoints"
    assert f"`ckpt latest {run}`" in error["fix"]
    human = run_ckpt("latest", run / "checkpoint-200")
    assert human.exit_code == 3 and human.stdout == ""
    assert f"is one checkpoint, not a run folder of checkpoints. `ckpt latest {run}`" in (
        " ".join(human.stderr.split())
    )
    # and the fix is right: the run folder names its newest save
    assert run_ckpt("latest", run).stdout.strip() == str(run / "checkpoint-200")


_ACCELERATE_THREE_MODELS = r"""
import sys
import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
models = [torch.nn.Linear(4, 4) for _ in range(3)]
optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
schedulers = [torch.optim.lr_scheduler.LinearLR(o, total_iters=4) for o in optimizers]
prepared = accelerator.prepare(*models, *optimizers, *schedulers)
for model, optimizer, scheduler in zip(prepared[:3], prepared[3:6], prepared[6:]):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
for folder in sys.argv[1:]:
    accelerator.save_state(folder)
"""


def test_an_accelerate_save_of_several_models_is_one_checkpoint_not_a_run(
    tmp_path: Path,
) -> None:
    """An accelerate `save_state` folder with three prepared models, optimizers and schedulers
    (`model.safetensors`, `model_1.safetensors`, `model_2.safetensors`, `optimizer_1.bin`...):
    `latest` of the save named its own `model_2.safetensors` as the newest checkpoint of a run,
    and `prune --keep-last 1 --yes` would have deleted `model_1.safetensors`, `optimizer_1.bin`
    and `scheduler_1.bin` as older "step 1" saves. The numbered files beside accelerate's own are
    parts of that save: the folder is one checkpoint (refused, the run folder named), and a run
    folder of such saves lists the saves, not their parts."""
    import subprocess
    import sys

    from .conftest import REPO

    run = tmp_path / "run"
    saves = [run / "step_1", run / "step_2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _ACCELERATE_THREE_MODELS, *map(str, saves)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    save = saves[1]
    before = sorted(p.name for p in save.iterdir())
    assert {"model_1.safetensors", "model_2.safetensors", "optimizer_2.bin"} <= set(before)
    one = run_ckpt("latest", save, "--json")
    assert one.exit_code == 3, one.stdout
    assert one.json["error"]["problem"] == "is one checkpoint, not a run folder of checkpoints"
    pruned = run_ckpt("prune", save, "--keep-last", "1", "--settle", "0", "--yes")
    assert pruned.exit_code == 2, pruned.stdout
    assert "is one checkpoint, not a run folder" in " ".join(pruned.stderr.split())
    assert sorted(p.name for p in save.iterdir()) == before
    # the run folder: its two saves, each whole
    age(run)
    rows = table(run)
    assert sorted(rows) == ["step_1", "step_2"], rows
    assert all(r["status"] == "complete" for r in rows.values()), rows
    assert run_ckpt("latest", run).stdout.strip() == str(save)
