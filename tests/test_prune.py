"""`ckpt prune`: plans first, deletions only with --yes, and the good saves always survive."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpt_cli.ops.prune import run as prune_ops
from ckpt_cli.ops.prune.retention import PrunePolicy
from ckpt_cli.ops.prune.run import watch

from .conftest import run_ckpt, run_ckpt_process
from .run_fixtures import (
    accelerate_run,
    age,
    dcp_save,
    interrupted_trainer_save,
    trainer_checkpoint,
    trainer_run,
    weights,
)


def tree(root: Path) -> dict[str, int]:
    """Every path under `root` (links not followed) with its size: a snapshot to compare."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            full = Path(dirpath, name)
            out[str(full.relative_to(root))] = full.lstat().st_size
    return out


def decisions(result: Any) -> dict[str, tuple[str, str]]:
    return {d["name"]: (d["action"], d["rule"]) for d in result.json["result"]["decisions"]}


def survivors(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def assert_model(folder: Path, step: int) -> None:
    """The model of a surviving checkpoint is intact, bit for bit."""
    loaded = load_file(folder / "model.safetensors")
    for name, tensor in weights(step).items():
        assert torch.equal(loaded[name], tensor)


def test_plan_deletes_nothing_and_says_why(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 400, 500))
    interrupted_trainer_save(out, 600)
    before = tree(out)
    result = run_ckpt("prune", out, "--keep-last", "1", "--incomplete", "--json")
    assert result.exit_code == 0, result.stderr
    assert tree(out) == before
    report = result.json["result"]
    assert report["applied"] is False
    assert decisions(result) == {
        "checkpoint-100": ("delete", "not kept by any rule"),
        "checkpoint-200": ("keep", "Trainer best_model_checkpoint"),
        "checkpoint-400": ("delete", "not kept by any rule"),
        "checkpoint-500": ("keep", "newest complete; --keep-last 1"),
        "checkpoint-600": ("keep", "incomplete, newer than the newest complete checkpoint"),
    }
    sizes = {d["name"]: d["size"] for d in report["decisions"]}
    assert report["bytes_to_free"] == sizes["checkpoint-100"] + sizes["checkpoint-400"]
    human = run_ckpt("prune", out, "--keep-last", "1")
    assert "would delete 2 checkpoints" in human.stdout
    assert "nothing was deleted (run again with --yes" in human.stdout
    # `-n -y` (a dry run wins over --yes) was told to "run again with --yes"
    both = run_ckpt("prune", out, "--keep-last", "1", "--dry-run", "--yes")
    assert "would delete 2 checkpoints" in both.stdout
    assert "--dry-run; leave it out" in both.stdout and "again with --yes" not in both.stdout
    assert tree(out) == before


def test_yes_deletes_exactly_the_plan(tmp_path: Path) -> None:
    out = trainer_run(tmp_path)
    plan = decisions(run_ckpt("prune", out, "--keep-last", "2", "--json"))
    result = run_ckpt_process("prune", out, "--keep-last", "2", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    doomed = sorted(name for name, (action, _rule) in plan.items() if action == "delete")
    assert doomed == ["checkpoint-100", "checkpoint-300"]
    assert sorted(report["deleted"]) == doomed
    assert report["bytes_freed"] == report["bytes_to_free"] > 0
    assert survivors(out) == ["checkpoint-200", "checkpoint-400", "checkpoint-500"]
    for step in (200, 400, 500):
        assert_model(out / f"checkpoint-{step}", step)
    # nothing hidden left behind, and the next plan has nothing to do
    assert not any(p.name.startswith(".") for p in out.iterdir())
    again = run_ckpt("prune", out, "--keep-last", "2", "--json").json["result"]
    assert again["to_delete"] == 0


POLICIES = [
    ["--keep-last", "1"],
    ["--keep-every", "1000"],
    ["--keep-best", "eval_loss"],
    ["--keep-best", "eval_loss", "--higher-is-better"],
    ["--incomplete"],
    ["--keep-last", "1", "--keep-every", "7", "--incomplete"],
]


@pytest.mark.parametrize("policy", POLICIES, ids=" ".join)
def test_newest_complete_and_best_survive_every_policy(tmp_path: Path, policy: list[str]) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300, 400))
    interrupted_trainer_save(out, 500)
    result = run_ckpt("prune", out, *policy, "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    left = survivors(out)
    assert "checkpoint-400" in left  # newest complete
    assert "checkpoint-200" in left  # best eval_loss, and the Trainer's best_model_checkpoint
    assert "checkpoint-500" in left  # incomplete but newer: never removed
    assert_model(out / "checkpoint-400", 400)
    assert_model(out / "checkpoint-200", 200)


def test_keep_best_every_and_pins_on_a_dcp_run_with_metrics_file(tmp_path: Path) -> None:
    run = tmp_path / "titan"
    losses = {10: 3.0, 20: 2.0, 30: 2.5, 40: 2.2, 50: 2.4, 60: 2.6}
    for step in losses:
        dcp_save(run / f"step-{step}", step)
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "val_loss": v, "lr": 0.1}) for s, v in losses.items())
    )
    age(run)
    args = ["--keep-best", "val_loss", "--keep-every", "30", "--keep", "10", "--json"]
    plan = decisions(run_ckpt("prune", run, *args))
    assert plan == {
        "step-10": ("keep", "--keep 10"),
        "step-20": ("keep", "best val_loss (2)"),
        "step-30": ("keep", "--keep-every 30"),
        "step-40": ("delete", "not kept by any rule"),
        "step-50": ("delete", "not kept by any rule"),
        "step-60": ("keep", "newest complete; --keep-every 30"),
    }
    result = run_ckpt("prune", run, *args, "--yes")
    assert result.exit_code == 0
    assert survivors(run) == ["metrics.jsonl", "step-10", "step-20", "step-30", "step-60"]
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.zeros_like(v) for k, v in weights(20).items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(run / "step-20"), no_dist=True)
    for name, tensor in weights(20).items():
        assert torch.equal(state["model"][name], tensor)
    maxed = decisions(
        run_ckpt("prune", run, "--keep-best", "val_loss", "--higher-is-better", "--json")
    )
    assert maxed["step-30"] == ("delete", "not kept by any rule")
    assert maxed["step-60"] == ("keep", "newest complete")  # also the max, newest wins the rule


def test_a_diverged_eval_logging_nan_is_never_the_best(tmp_path: Path) -> None:
    # step 10's eval diverged and logged NaN (json.dumps writes it, so does the Trainer): the
    # real best (step 20) must survive --keep-best and --keep-top, the NaN one is unranked
    run = tmp_path / "titan"
    losses = {10: float("nan"), 20: 0.4, 30: 0.7, 40: float("inf"), 50: 0.9}
    for step in losses:
        dcp_save(run / f"step-{step}", step)
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "val_loss": v}) for s, v in losses.items())
    )
    age(run)
    result = run_ckpt("prune", run, "--keep-best", "val_loss", "--json")
    assert result.json["result"]["best"]["name"] == "step-20"
    assert decisions(result) == {
        "step-10": ("delete", "not kept by any rule (val_loss is nan here: treated as no value)"),
        "step-20": ("keep", "best val_loss (0.4)"),
        "step-30": ("delete", "not kept by any rule"),
        "step-40": ("delete", "not kept by any rule (val_loss is inf here: treated as no value)"),
        "step-50": ("keep", "newest complete"),
    }
    top = decisions(run_ckpt("prune", run, "--keep-best", "val_loss", "--keep-top", "2", "--json"))
    assert top["step-20"][0] == top["step-30"][0] == "keep"
    assert top["step-10"][0] == top["step-40"][0] == "delete"
    assert (
        "val_loss is nan here: treated as no value"
        in run_ckpt("prune", run, "--keep-best", "val_loss").stdout
    )
    assert run_ckpt("prune", run, "--keep-best", "val_loss", "--yes").exit_code == 0
    assert survivors(run) == ["metrics.jsonl", "step-20", "step-50"]


def test_keep_last_orders_accelerates_automatically_named_saves_by_their_number(
    tmp_path: Path,
) -> None:
    # accelerate's automatic naming (checkpoints/checkpoint_N) counts saves, not steps: the
    # saves are ordered by N, so --keep-last deletes the older ones (it kept them all, "no step
    # or epoch in its name"); --keep-every, a rule on steps, still never matches them
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    run = tmp_path / "run"
    accelerate_run(run, 4)
    age(run)
    saves = run / "checkpoints"
    plan = decisions(run_ckpt("prune", run, "--keep-last", "2", "--keep-every", "2", "--json"))
    every = "not kept by any rule (--keep-every does not apply: its name counts saves, not steps)"
    assert plan == {
        "checkpoints/checkpoint_0": ("delete", every),
        "checkpoints/checkpoint_1": ("delete", every),
        "checkpoints/checkpoint_2": ("keep", "--keep-last 2"),
        "checkpoints/checkpoint_3": ("keep", "newest complete; --keep-last 2"),
    }
    only_every = decisions(run_ckpt("prune", run, "--keep-every", "2", "--json"))
    assert only_every["checkpoints/checkpoint_0"] == (
        "keep",
        "its name counts saves, not steps: only --keep-last and time rules apply",
    )
    assert run_ckpt("prune", run, "--keep-last", "2", "--yes").exit_code == 0
    assert sorted(p.name for p in saves.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    assert run_ckpt("latest", run).stdout.strip() == str(saves / "checkpoint_3")


def test_keep_last_never_deletes_the_only_settled_save_for_a_fresh_one_with_no_marker(
    tmp_path: Path,
) -> None:
    # accelerate's save_state writes no commit marker: a save finished a moment ago and one
    # still being written look the same (`sync` holds such a save back). `prune --keep-last 1
    # --yes` counted the fresh save as the one kept and deleted checkpoint_0, the run's only
    # settled save
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    run = tmp_path / "run"
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(run), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    saves = run / "checkpoints"
    for _ in range(2):
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
        if not (saves / "checkpoint_1").exists():
            age(saves / "checkpoint_0")  # saved long ago; checkpoint_1 just now
    settled = load_file(saves / "checkpoint_0" / "model.safetensors")
    result = run_ckpt("prune", run, "--keep-last", "1", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    plan = decisions(result)
    assert plan["checkpoints/checkpoint_0"][0] == "keep", plan
    assert "newest settled complete" in plan["checkpoints/checkpoint_0"][1]
    assert plan["checkpoints/checkpoint_1"] == ("keep", "modified in the last 120 s")
    assert survivors(saves) == ["checkpoint_0", "checkpoint_1"]
    kept = load_file(saves / "checkpoint_0" / "model.safetensors")
    assert all(torch.equal(kept[k], settled[k]) for k in settled)
    # settled, the newer save is the one --keep-last keeps
    age(saves / "checkpoint_1", 600)
    later = decisions(run_ckpt("prune", run, "--keep-last", "1", "--json"))
    assert later["checkpoints/checkpoint_0"] == ("delete", "not kept by any rule")


def test_deepspeed_run_keeps_the_save_its_latest_file_names(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    for step in (10, 20, 30):
        (out / f"global_step{step}").mkdir(parents=True)
        torch.save(
            {"module": weights(step)}, out / f"global_step{step}" / "mp_rank_00_model_states.pt"
        )
    (out / "latest").write_text("global_step20")  # the step-30 save never finished
    age(out)
    result = run_ckpt("prune", out, "--keep-last", "1", "--incomplete", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    assert decisions(result) == {
        "global_step10": ("delete", "not kept by any rule"),
        "global_step20": (
            "keep",
            "newest complete; named by the DeepSpeed latest file; --keep-last 1",
        ),
        "global_step30": ("keep", "incomplete, newer than the newest complete checkpoint"),
    }
    assert survivors(out) == ["global_step20", "global_step30", "latest"]
    model = torch.load(out / "global_step20" / "mp_rank_00_model_states.pt", weights_only=True)
    for name, tensor in weights(20).items():
        assert torch.equal(model["module"][name], tensor)
    assert run_ckpt("latest", out).stdout.strip() == str(out / "global_step20")


def test_plain_files_of_one_step_go_together(tmp_path: Path) -> None:
    run = tmp_path / "plain"
    run.mkdir()
    for step in (1000, 2000, 3000):
        torch.save(weights(step), run / f"model_{step}.pt")
        torch.save({"step": step}, run / f"optim_{step}.pt")
    age(run)
    result = run_ckpt("prune", run, "--keep-last", "2", "--yes", "--json")
    assert result.json["result"]["deleted"] == ["model_1000.pt"]
    assert survivors(run) == ["model_2000.pt", "model_3000.pt", "optim_2000.pt", "optim_3000.pt"]
    loaded = torch.load(run / "model_2000.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in weights(2000).items())


def test_a_plain_step_whose_optimizer_file_never_came_is_incomplete(tmp_path: Path) -> None:
    # a loop killed between its two torch.save calls leaves model_3000.pt without
    # optim_3000.pt: it was complete, the latest, and --keep-last 1 deleted every save that
    # could be resumed from
    run = tmp_path / "plain"
    run.mkdir()
    for step in (1000, 2000, 3000):
        torch.save(weights(step), run / f"model_{step}.pt")
        if step != 3000:
            torch.save({"step": step}, run / f"optim_{step}.pt")
    age(run)
    rows = {c["name"]: c for c in run_ckpt("latest", run, "--json").json["result"]["checkpoints"]}
    assert rows["model_3000.pt"]["status"] == "incomplete"
    assert "lacks optim_*.pt, which every other save" in rows["model_3000.pt"]["reason"]
    assert run_ckpt("latest", run).stdout.strip() == str(run / "model_2000.pt")
    assert run_ckpt("prune", run, "--keep-last", "1", "--yes").exit_code == 0
    assert survivors(run) == ["model_2000.pt", "model_3000.pt", "optim_2000.pt"]


def test_two_saves_of_one_step_are_ordered_one_way_by_every_rule(tmp_path: Path) -> None:
    # checkpoint-00200 and checkpoint-200 (a renamed copy, same time): "newest complete" was
    # one and --keep-last 1 the other, so --keep-last 1 kept two
    out = tmp_path / "out"
    for name, step in (("checkpoint-100", 100), ("checkpoint-00200", 200), ("checkpoint-200", 200)):
        trainer_checkpoint(out / name, step)
    age(out)
    plan = decisions(run_ckpt("prune", out, "--keep-last", "1", "--json"))
    assert plan == {
        "checkpoint-100": ("delete", "not kept by any rule"),
        "checkpoint-00200": ("delete", "not kept by any rule"),
        "checkpoint-200": ("keep", "newest complete; Trainer best_model_checkpoint; --keep-last 1"),
    }
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-200")


def test_a_multi_file_checkpoint_leaves_its_names_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "plain"
    run.mkdir()
    for step in (1000, 2000):
        torch.save(weights(step), run / f"model_{step}.pt")
        torch.save({"step": step}, run / f"optim_{step}.pt")
    age(run)

    def dies(path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(prune_ops, "_remove", dies)
    result = run_ckpt("prune", run, "--keep-last", "1", "--yes", "--json")
    assert result.exit_code == 1
    visible = sorted(p.name for p in run.iterdir() if not p.name.startswith("."))
    assert visible == ["model_2000.pt", "optim_2000.pt"]  # no lone optim_1000.pt left behind


def test_lightning_best_from_file_names_and_the_last_ckpt_link(tmp_path: Path) -> None:
    run = tmp_path / "lightning_logs" / "version_0"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    names = {}
    for epoch, step, acc in ((0, 100, 0.71), (1, 200, 0.93), (2, 300, 0.88), (3, 400, 0.90)):
        names[step] = f"epoch={epoch}-step={step}-val_acc={acc}.ckpt"
        torch.save({"state_dict": weights(step), "global_step": step}, ckpts / names[step])
    os.symlink(names[300], ckpts / "last.ckpt")  # save_last="link"
    age(run)
    plan = decisions(
        run_ckpt("prune", run, "--keep-best", "val_acc", "--higher-is-better", "--json")
    )
    assert plan == {
        f"checkpoints/{names[100]}": ("delete", "not kept by any rule"),
        f"checkpoints/{names[200]}": ("keep", "best val_acc (0.93)"),
        f"checkpoints/{names[300]}": ("keep", "a symlink in the run folder points at it"),
        f"checkpoints/{names[400]}": ("keep", "newest complete"),
    }
    assert (
        run_ckpt("prune", run, "--keep-best", "val_acc", "--higher-is-better", "--yes").exit_code
        == 0
    )
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        [names[200], names[300], names[400], "last.ckpt"]
    )
    loaded = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in weights(300).items())


def test_lightning_metrics_written_with_an_exponent_are_read_whole(tmp_path: Path) -> None:
    # ModelCheckpoint(filename="{epoch}-{step}-{val_loss:.2e}") writes val_loss=1.50e+01:
    # read as 1.5, the worst save would be the best and the real best deleted
    run = tmp_path / "lightning_logs" / "version_0"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    names = {}
    for step, loss in ((10, 15.0), (20, 3.0), (30, 9.0), (40, 0.000125)):
        names[step] = f"epoch=0-step={step}-val_loss={loss:.2e}.ckpt"
        torch.save({"state_dict": weights(step), "global_step": step}, ckpts / names[step])
    age(run)
    result = run_ckpt("prune", run, "--keep-best", "val_loss", "--keep-top", "2", "--json")
    metrics = {d["step"]: d["metric"] for d in result.json["result"]["decisions"]}
    assert metrics == {10: 15.0, 20: 3.0, 30: 9.0, 40: 0.000125}
    assert result.json["result"]["best"]["name"] == f"checkpoints/{names[40]}"
    assert (
        run_ckpt("prune", run, "--keep-best", "val_loss", "--keep-top", "2", "--yes").exit_code == 0
    )
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([names[20], names[40]])


def test_unknown_metric_is_an_error_not_a_massacre(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    before = tree(out)
    result = run_ckpt("prune", out, "--keep-best", "eval_acc", "--yes")
    assert result.exit_code == 3
    assert "eval_acc" in result.stderr
    assert tree(out) == before


def test_incomplete_removes_only_interrupted_saves_older_than_the_newest(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 300))
    interrupted_trainer_save(out, 250)
    shutil.copytree(out / "checkpoint-100", out / ".checkpoint-260.ckpt-tmp-k2j4")
    interrupted_trainer_save(out, 400)
    age(out)
    result = run_ckpt("prune", out, "--incomplete", "--yes", "--json")
    assert result.exit_code == 0
    assert sorted(result.json["result"]["deleted"]) == [
        ".checkpoint-260.ckpt-tmp-k2j4",
        "checkpoint-250",
    ]
    assert survivors(out) == ["checkpoint-100", "checkpoint-300", "checkpoint-400"]


def test_incomplete_removes_nothing_when_no_save_is_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    interrupted_trainer_save(out, 100)
    interrupted_trainer_save(out, 200)
    age(out)
    before = tree(out)
    result = run_ckpt("prune", out, "--incomplete", "--keep-last", "1", "--yes", "--json")
    assert result.exit_code == 0
    assert result.json["result"]["deleted"] == []
    assert tree(out) == before
    assert run_ckpt("latest", out).exit_code == 3


@pytest.mark.parametrize("layout", ["trainer", "dcp"])
def test_pruning_one_checkpoint_instead_of_its_run_says_so(tmp_path: Path, layout: str) -> None:
    """`ckpt prune out/checkpoint-500 --keep-last 1 --yes` (a checkpoint, not its run folder)
    printed "nothing to delete" and exit 0: a cron job never learnt it pruned nothing. It is
    now a usage error (exit 2) saying the folder is one checkpoint, naming the run folder to
    prune instead; nothing is touched."""
    if layout == "trainer":
        out = trainer_run(tmp_path, steps=(100, 200))
        one = out / "checkpoint-200"
    else:
        out = tmp_path / "run"
        dcp_save(out / "step-1", 1)
        one = out / "step-1"
    before = tree(out)
    for args in (["--keep-last", "1", "--yes"], ["--incomplete", "--json"]):
        result = run_ckpt("prune", one, *args)
        assert result.exit_code == 2, result.stdout + result.stderr
        said = result.json["error"]["message"] if "--json" in args else result.stderr
        assert "is one checkpoint, not a run folder" in said, said
        assert f"ckpt prune {out}" in said, said
    assert tree(out) == before


def test_symlinked_checkpoint_is_unlinked_and_its_target_untouched(tmp_path: Path) -> None:
    elsewhere = tmp_path / "archive" / "checkpoint-50"
    trainer_checkpoint(elsewhere, 50)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    os.symlink(elsewhere, out / "checkpoint-50")
    # a link inside a checkpoint that points out of the run folder must not be followed either
    os.symlink(elsewhere / "model.safetensors", out / "checkpoint-100" / "base_model.link")
    age(out)
    target_before = tree(elsewhere.parent)
    plan = decisions(run_ckpt("prune", out, "--keep-last", "1", "--json"))
    assert plan["checkpoint-50"] == ("delete", "not kept by any rule")
    report = run_ckpt("prune", out, "--keep-last", "1", "--yes", "--json").json["result"]
    sizes = {d["name"]: d["size"] for d in report["decisions"]}
    assert sizes["checkpoint-50"] == 0  # unlinking frees nothing
    assert not (out / "checkpoint-50").is_symlink()
    assert not (out / "checkpoint-100").exists()
    assert tree(elsewhere.parent) == target_before
    assert_model(elsewhere, 50)


def test_a_crash_mid_delete_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300))

    def dies_halfway(path: Path, *args: Any, **kwargs: Any) -> None:
        (Path(path) / "model.safetensors").unlink()  # part of the folder is gone...
        raise OSError(5, "Input/output error")  # ...then the process dies

    monkeypatch.setattr(prune_ops.shutil, "rmtree", dies_halfway)
    result = run_ckpt("prune", out, "--keep-last", "1", "--yes", "--json")
    assert result.exit_code == 1
    assert "checkpoint-100" in result.json["result"]["failed"][0]
    monkeypatch.undo()
    assert not (out / "checkpoint-100").exists()
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and hidden[0].startswith(".checkpoint-100.ckpt-tmp-del-")
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")
    rows = run_ckpt("latest", out, "--json", "--settle", "0").json["result"]["checkpoints"]
    leftover = {r["name"]: r for r in rows}[hidden[0]]
    assert leftover["status"] == "interrupted"
    assert leftover["reason"] == "staging folder left by an interrupted deletion"
    cleaned = run_ckpt("prune", out, "--incomplete", "--settle", "0", "--yes")
    assert cleaned.exit_code == 0
    assert survivors(out) == ["checkpoint-200", "checkpoint-300"]


def test_a_checkpoint_removed_by_someone_else_first_is_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = trainer_run(tmp_path, steps=(100, 300, 400))
    real_remove = prune_ops.remove_checkpoint

    def trainer_rotates_first(paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path)  # the Trainer's save_total_limit got there first
        real_remove(paths)

    monkeypatch.setattr(prune_ops, "remove_checkpoint", trainer_rotates_first)
    result = run_ckpt("prune", out, "--keep-last", "1", "--yes", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["failed"] == [] and report["deleted"] == []
    assert survivors(out) == ["checkpoint-400"]


def test_watch_prunes_as_the_run_goes_and_never_touches_a_save_in_progress(
    tmp_path: Path,
) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    ticks: list[float] = []
    pending: dict[Path, str] = {}

    def next_save(seconds: float) -> None:
        """Between rounds the job finishes its save in progress and starts the next one."""
        ticks.append(seconds)
        for state_file, text in pending.items():
            state_file.write_text(text)
        pending.clear()
        age(out)
        step = 300 + 100 * len(ticks)
        trainer_checkpoint(out / f"checkpoint-{step}", step)
        state_file = out / f"checkpoint-{step}" / "trainer_state.json"
        pending[state_file] = state_file.read_text()
        state_file.unlink()  # the Trainer writes it last: this save is not finished

    rounds: list[set[str]] = []
    result = watch(
        out,
        PrunePolicy(keep_last=1),
        60,
        max_iterations=3,
        on_round=lambda r: rounds.append(set(r.deleted)),
        sleep=next_save,
    )
    assert result.iterations == 3 and result.stopped == "max-iterations"
    assert ticks == [60, 60]
    # 200 is the Trainer's best; 400 is kept while it is written, then is the newest complete
    assert rounds == [{"checkpoint-100"}, set(), {"checkpoint-300"}]
    assert result.deleted == ["checkpoint-100", "checkpoint-300"]
    assert survivors(out) == ["checkpoint-200", "checkpoint-400", "checkpoint-500"]
    assert not (out / "checkpoint-500" / "trainer_state.json").exists()  # still in progress


def test_watch_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 300))

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    result = watch(out, PrunePolicy(keep_last=1), 5, sleep=interrupted)
    assert result.stopped == "interrupted" and result.iterations == 1
    assert result.deleted == ["checkpoint-100"]
    via_cli = run_ckpt(
        "prune", out, "--keep-last", "1", "--watch", "1", "--max-iterations", "1", "--yes", "--json"
    )
    assert via_cli.exit_code == 0
    assert via_cli.json["result"]["stopped"] == "max-iterations"


def test_usage_errors(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200))
    before = tree(out)
    assert run_ckpt("prune", out).exit_code == 2  # no policy
    assert run_ckpt("prune", out, "--keep-last", "0").exit_code == 2
    assert run_ckpt("prune", out, "--keep-last", "1", "--watch", "5").exit_code == 2  # no --yes
    assert run_ckpt("prune", out, "--keep-best", "x", "--mode", "avg").exit_code == 2
    assert run_ckpt("prune", tmp_path / "missing", "--keep-last", "1").exit_code == 3
    assert tree(out) == before


def test_watch_with_dry_run_names_that_conflict_not_a_missing_yes(tmp_path: Path) -> None:
    # --yes was given: "--watch ... needs --yes" sent the user looking for the wrong option
    out = trainer_run(tmp_path, steps=(100, 200))
    before = tree(out)
    args = ["--keep-last", "1", "--yes", "--dry-run", "--watch", "1", "--max-iterations", "1"]
    result = run_ckpt("prune", out, *args)
    assert result.exit_code == 2
    assert "--dry-run and --watch conflict" in result.stderr
    assert "needs --yes" not in result.stderr
    assert tree(out) == before


@pytest.mark.parametrize(
    ("signame", "code", "error"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")]
)
def test_watch_in_a_real_process_stopped_by_a_signal_exits_with_its_code(
    tmp_path: Path, signame: str, code: int, error: str
) -> None:
    """`prune --watch` under a job scheduler that ends it (SIGTERM) exited 0 with `stopped:
    interrupted`, where the exit-code table says 143 (130 for Ctrl-C): a script or a scheduler
    could not tell a stopped watch from one that ran its rounds. The summary still comes."""
    import signal
    import subprocess
    import sys
    import time

    from .conftest import REPO

    out = trainer_run(tmp_path, steps=(100, 300))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckpt_cli",
            "prune",
            str(out),
            "--keep-last",
            "1",
            "--watch",
            "3600",
            "--yes",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while survivors(out) != ["checkpoint-300"] and time.monotonic() < deadline:
            time.sleep(0.05)  # wait for the first round, then interrupt the sleep
        proc.send_signal(getattr(signal, signame))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    envelope = json.loads(stdout)
    assert envelope["exit_code"] == code and envelope["ok"] is False
    assert envelope["error"]["code"] == error
    report = envelope["result"]
    assert report["stopped"] == "interrupted"  # (the signal may land before round 1 is counted)
    assert survivors(out) == ["checkpoint-300"]


def test_a_deepspeed_latest_file_naming_a_path_outside_the_run_marks_nothing(
    tmp_path: Path,
) -> None:
    from ckpt_cli.sources.runs.judge import read_deepspeed_latest
    from ckpt_cli.storage import LocalStorage

    (tmp_path / "latest").write_text("../elsewhere/global_step5")
    assert read_deepspeed_latest(LocalStorage(tmp_path)) is None
    (tmp_path / "latest").write_text("global_step5\n")
    assert read_deepspeed_latest(LocalStorage(tmp_path)) == "global_step5"


def test_a_checkpoint_a_file_of_which_cannot_be_removed_is_reported_partly_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    real_unlink = os.unlink

    def immutable(path: Any, *args: Any, **kwargs: Any) -> None:
        fd = kwargs.get("dir_fd")
        folder = os.readlink(f"/proc/self/fd/{fd}") if fd is not None else str(path)
        if os.path.basename(path) == "optimizer.pt" and "checkpoint-100" in folder:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        real_unlink(path, *args, **kwargs)

    # `chattr +i checkpoint-100/optimizer.pt`: the folder can be renamed, that file not removed
    monkeypatch.setattr(os, "unlink", immutable)
    result = run_ckpt("prune", out, "--keep-last", "1", "--yes", "--json")
    monkeypatch.undo()
    assert result.exit_code == 1
    (failure,) = [f for f in result.json["result"]["failed"] if "checkpoint-100" in f]
    # it used to say "not deleted", naming no file, for a checkpoint already half gone
    assert "partly deleted" in failure and "optimizer.pt" in failure
    assert "not deleted" not in failure
    decision = {d["name"]: d for d in result.json["result"]["decisions"]}["checkpoint-100"]
    assert decision["deleted"] is False and decision["error"].startswith("partly deleted")
    assert not (out / "checkpoint-100").exists()
    (left,) = [p for p in out.iterdir() if p.name.startswith(".checkpoint-100.ckpt-tmp-del-")]
    assert [p.name for p in left.iterdir()] == ["optimizer.pt"]
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")
    shown = run_ckpt("prune", out, "--keep-last", "1", "--settle", "0")
    assert ".checkpoint-100.ckpt-tmp-del-" in shown.stdout and "interrupted" in shown.stdout
    assert run_ckpt("prune", out, "--incomplete", "--settle", "0", "--yes").exit_code == 0
    assert not left.exists()


# -- which end of --keep-best's metric is best -------------------------------------------------
#
# `prune --mode min|max` said which end of the metric is best while `download --mode` says how
# to fetch: one option name, two meanings. The flag pair says it in words; `--mode` is kept,
# hidden, as a deprecated spelling that says so on stderr.


@pytest.mark.parametrize(
    ("flags", "best"),
    [([], 40), (["--lower-is-better"], 40), (["--higher-is-better"], 20)],
    ids=["default", "lower", "higher"],
)
def test_higher_or_lower_is_better_picks_the_max_or_min_of_metrics_jsonl(
    tmp_path: Path, flags: list[str], best: int
) -> None:
    run = tmp_path / "titan"
    accuracy = {10: 0.50, 20: 0.90, 30: 0.70, 40: 0.30, 50: 0.60, 60: 0.80}
    for step in accuracy:
        dcp_save(run / f"step-{step}", step)
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "val_acc": v}) for s, v in accuracy.items())
    )
    age(run)
    result = run_ckpt("prune", run, "--keep-best", "val_acc", *flags, "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # no deprecation for the new spellings
    reported = result.json["result"]["best"]
    assert (reported["name"], reported["value"]) == (f"step-{best}", accuracy[best])
    assert reported["mode"] == ("max" if "--higher-is-better" in flags else "min")
    assert survivors(run) == sorted(["metrics.jsonl", f"step-{best}", "step-60"])
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.zeros_like(v) for k, v in weights(best).items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(run / f"step-{best}"), no_dist=True)
    for name, tensor in weights(best).items():
        assert torch.equal(state["model"][name], tensor)


def test_higher_is_better_keeps_the_max_of_a_trainer_log_history(tmp_path: Path) -> None:
    out = trainer_run(tmp_path)  # eval_loss 0.90, 0.40, 0.70, 0.65, 0.60 at steps 100..500
    higher = run_ckpt("prune", out, "--keep-best", "eval_loss", "--higher-is-better", "--yes")
    assert higher.exit_code == 0, higher.stderr
    # 100 is the max; 200 is the Trainer's best_model_checkpoint; 500 the newest
    assert survivors(out) == ["checkpoint-100", "checkpoint-200", "checkpoint-500"]
    assert_model(out / "checkpoint-100", 100)
    lower = run_ckpt("prune", out, "--keep-best", "eval_loss", "--lower-is-better", "--json")
    assert decisions(lower)["checkpoint-100"] == ("delete", "not kept by any rule")
    assert decisions(lower)["checkpoint-200"][1].startswith("best eval_loss (0.4)")


@pytest.mark.parametrize(
    ("value", "flag"), [("max", "--higher-is-better"), ("min", "--lower-is-better")]
)
def test_the_deprecated_mode_still_works_and_says_so_on_stderr_only(
    tmp_path: Path, value: str, flag: str
) -> None:
    out = trainer_run(tmp_path)
    new = run_ckpt("prune", out, "--keep-best", "eval_loss", flag, "--json")
    old = run_ckpt("prune", out, "--keep-best", "eval_loss", "--mode", value, "--json")
    assert old.exit_code == new.exit_code == 0, old.stderr
    assert decisions(old) == decisions(new)
    assert old.json["result"]["best"]["mode"] == value
    # one line on stderr naming the new flag; stdout is the envelope alone
    assert "is deprecated" not in old.stdout and "--mode" not in old.stdout
    [line] = old.stderr.splitlines()
    assert "--mode" in line and "is deprecated" in line and flag in line
    human = run_ckpt("prune", out, "--keep-best", "eval_loss", "--mode", value)
    assert human.exit_code == 0
    assert "is deprecated" not in human.stdout
    assert human.stderr.count("is deprecated") == 1 and flag in human.stderr
    # --quiet: nothing but errors on stderr
    quiet = run_ckpt("prune", out, "--keep-best", "eval_loss", "--mode", value, "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    # agreeing with the new flag is no contradiction
    both = run_ckpt("prune", out, "--keep-best", "eval_loss", "--mode", value, flag, "--json")
    assert both.exit_code == 0 and decisions(both) == decisions(new)


def test_the_deprecated_mode_contradicting_the_new_flag_is_a_usage_error(tmp_path: Path) -> None:
    out = trainer_run(tmp_path)
    before = tree(out)
    for old, new in (("max", "--lower-is-better"), ("min", "--higher-is-better")):
        args = ["--keep-best", "eval_loss", "--mode", old, new, "--yes", "--json"]
        result = run_ckpt("prune", out, *args)
        assert result.exit_code == 2, result.stdout
        error = result.json["error"]
        assert f"--mode {old}" in error["message"] and new in error["message"]
        assert error["fix"]
    assert tree(out) == before


def test_the_new_flags_are_in_help_and_mode_is_not(tmp_path: Path) -> None:
    from ckpt_cli.cli.completions import render_all

    for command in ("prune", "sync"):
        text = run_ckpt(command, "--help").stdout
        assert "--higher-is-better / --lower-is-better" in text, command
        assert "--mode" not in text, command
    bash = render_all()["ckpt.bash"]
    for command in ("prune", "sync"):
        words = bash.split(f"    {command}) opts=")[1].split(";;")[0]
        assert "--higher-is-better" in words and "--lower-is-better" in words
        assert "--mode" not in words
        assert f"{command}\\ --mode)" not in bash
    # without --keep-best the flags would do nothing: refused, naming the flag
    out = trainer_run(tmp_path)
    refused = run_ckpt("prune", out, "--keep-last", "1", "--higher-is-better", "--json")
    assert refused.exit_code == 2
    assert "--higher-is-better applies with --keep-best" in refused.json["error"]["message"]


def test_prune_incomplete_orders_accelerate_saves_by_their_number_as_latest_does(
    tmp_path: Path,
) -> None:
    # accelerate's automatic `checkpoints/checkpoint_N` record no step: N counts saves, and
    # `latest` orders them by it. `prune --incomplete` ordered them by modification time
    # instead, so in a run folder copied without times (`cp -r`, a download) a save cut
    # short after the newest whole one was deleted (the rule keeps those), and one cut short
    # before it was kept
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    run = tmp_path / "run"
    _, saves = accelerate_run(run, 4)
    # checkpoint_1 and checkpoint_3 cut short before their RNG states (written last)
    for cut in (saves[1], saves[3]):
        (cut / "random_states_0.pkl").unlink()
    # copied in another order than saved: checkpoint_3 got the oldest time, checkpoint_1 a
    # newer one than checkpoint_2
    for save, hours in zip(saves, (4, 2, 3, 5), strict=True):
        age(save, hours * 3600)
    assert run_ckpt("latest", run).stdout.strip() == str(saves[2])
    result = run_ckpt("prune", run, "--incomplete", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    rules = {d["name"]: (d["action"], d["rule"]) for d in result.json["result"]["decisions"]}
    assert rules["checkpoints/checkpoint_1"][0] == "delete", rules
    assert rules["checkpoints/checkpoint_3"] == (
        "keep",
        "incomplete, newer than the newest complete checkpoint",
    ), rules
    assert [s.is_dir() for s in saves] == [True, False, True, True]


def test_incomplete_keeps_a_protected_save_damaged_since_and_repair_brings_it_back(
    tmp_path: Path,
) -> None:
    """A torchtitan run's old save was protected; a disk error later cut its `.distcp` short.
    `latest` rightly skips it, but it is no interrupted save: `ckpt protect` blesses whole
    saves only, and its parity rebuilds it. `prune --incomplete --yes` keeps it and says how
    to repair it (it used to delete it with the interrupted ones); `ckpt repair` then gives
    `dcp.load` the save as it was written."""
    import torch.distributed.checkpoint as dcp

    from .run_fixtures import titan_states

    run = tmp_path / "run"
    for step in (10, 20, 30):
        dcp_save(run / f"step-{step}", step)
    age(run)
    damaged = run / "step-10"
    assert run_ckpt("protect", damaged).exit_code == 0
    data = damaged / "__0_0.distcp"
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size - 50)  # its last block: within what the parity rebuilds
    age(damaged)  # the damage is old news: outside the settle window

    table = run_ckpt("latest", run, "--json")
    rows = {c["name"]: c for c in table.json["result"]["checkpoints"]}
    assert table.stdout and rows["step-10"]["status"] == "incomplete"
    assert "protected" in rows["step-10"]["markers"]
    result = run_ckpt("prune", run, "--keep-last", "1", "--incomplete", "--yes", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    action, rule = decisions(result)["step-10"]
    assert action == "keep" and f"ckpt repair {damaged}" in rule
    assert survivors(run) == ["step-10", "step-30"]

    assert run_ckpt("repair", damaged).exit_code == 0
    want = titan_states(10)["model"]
    got = {k: torch.empty_like(v) for k, v in want.items()}  # type: ignore[union-attr]
    dcp.load({"model": got}, checkpoint_id=str(damaged), no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in want.items())  # type: ignore[union-attr]


def test_incomplete_keeps_a_protected_checkpoint_file_damaged_since(tmp_path: Path) -> None:
    """The same for a run of single files (Lightning's `.ckpt`, whose parity lies beside it in
    `.ckpt-parity/NAME/`): the protected file that lost its tail is kept by `--incomplete`
    and rebuilt by `ckpt repair`, for `torch.load` to read."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200, 300):
        torch.save(weights(step), run / f"epoch=0-step={step}.ckpt")
    damaged = run / "epoch=0-step=100.ckpt"
    assert run_ckpt("protect", damaged, "--whole-files").exit_code == 0
    with open(damaged, "r+b") as fh:
        fh.truncate(damaged.stat().st_size // 2)
    age(run)

    rows = {c["name"]: c for c in run_ckpt("latest", run, "--json").json["result"]["checkpoints"]}
    assert rows[damaged.name]["status"] == "incomplete"
    assert "protected" in rows[damaged.name]["markers"]
    result = run_ckpt("prune", run, "--keep-last", "1", "--incomplete", "--yes", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert decisions(result)[damaged.name][0] == "keep"
    assert survivors(run) == [".ckpt-parity", damaged.name, "epoch=0-step=300.ckpt"]
    assert run_ckpt("repair", damaged).exit_code == 0
    loaded = torch.load(damaged, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in weights(100).items())
