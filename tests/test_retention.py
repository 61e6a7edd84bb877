"""Retention beyond last-N: the N best, time windows, and old saves slimmed to their weights.

Run folders are written by the real writers (transformers' Trainer, `dcp.save`, torch.save in
Lightning's file naming); times are controlled by setting mtimes, never by waiting.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import HOUR, dcp_save, trainer_run, weights

DAY = 24 * HOUR


def set_mtime(path: Path, stamp: float) -> None:
    """Give `path` and everything under it the modification time `stamp`."""
    targets = [path]
    if path.is_dir():
        targets += list(path.rglob("*"))
    for target in targets:
        os.utime(target, (stamp, stamp), follow_symlinks=False)


def plan(result: Any) -> dict[str, tuple[str, list[str]]]:
    assert result.exit_code == 0, result.stdout + result.stderr
    return {d["name"]: (d["action"], d["rules"]) for d in result.json["result"]["decisions"]}


def test_keep_top_and_keep_within_are_a_union_naming_every_rule(tmp_path: Path) -> None:
    # eval_loss by step: 100 .90, 200 .40, 300 .70, 400 .65, 500 .60 (run_fixtures.EVAL_LOSS)
    out = trainer_run(tmp_path)
    now = time.time()
    for step, hours_ago in ((100, 50), (200, 40), (300, 30), (400, 3), (500, 1)):
        set_mtime(out / f"checkpoint-{step}", now - hours_ago * HOUR)
    result = run_ckpt(
        "prune",
        out,
        "--keep-best",
        "eval_loss",
        "--keep-top",
        "2",
        "--keep-within",
        "4h",
        "--json",
    )
    decided = plan(result)
    assert decided["checkpoint-100"] == ("delete", [])
    assert decided["checkpoint-300"] == ("delete", [])
    action, rules = decided["checkpoint-200"]
    assert action == "keep"
    assert rules == [
        "best eval_loss (0.4)",
        "Trainer best_model_checkpoint",
        "--keep-top 2 (#1 eval_loss=0.4)",
    ]
    assert decided["checkpoint-400"] == ("keep", ["--keep-within 4h"])
    assert decided["checkpoint-500"] == (
        "keep",
        ["newest complete", "--keep-top 2 (#2 eval_loss=0.6)", "--keep-within 4h"],
    )
    assert (
        run_ckpt(
            "prune",
            out,
            "--keep-best",
            "eval_loss",
            "--keep-top",
            "2",
            "--keep-within",
            "4h",
            "--yes",
        ).exit_code
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-200",
        "checkpoint-400",
        "checkpoint-500",
    ]


def test_keep_every_duration_keeps_the_save_closest_to_each_window_start(tmp_path: Path) -> None:
    run = tmp_path / "dump"
    window = 6 * HOUR
    # three 6 h windows, far in the past; saves every 2 h, the first ones 1 h into a window
    base = (int(time.time() // window) - 10) * window
    stamps = {}
    for i, step in enumerate(range(10, 100, 10)):
        dcp_save(run / f"step-{step}", step)
        stamps[step] = base + HOUR + i * 2 * HOUR
        set_mtime(run / f"step-{step}", stamps[step])
    decided = plan(run_ckpt("prune", run, "--keep-every-duration", "6h", "--json"))
    kept = {name for name, (action, _rules) in decided.items() if action == "keep"}
    # windows [base, +6h) holds 10 (1h), 20 (3h), 30 (5h); the next 40 (7h), 50, 60; then 70...
    assert kept == {"step-10", "step-40", "step-70", "step-90"}
    assert decided["step-40"][1] == [
        "--keep-every-duration 6h (window from "
        + time.strftime("%Y-%m-%d %H:%M", time.gmtime(base + window))
        + " UTC)"
    ]
    assert decided["step-90"][1] == ["newest complete"]
    # the union with --keep-last: both rules named where both keep
    both = plan(run_ckpt("prune", run, "--keep-every-duration", "6h", "--keep-last", "3", "--json"))
    assert both["step-70"][1][0].startswith("--keep-last 3") is True
    assert both["step-70"][1][1].startswith("--keep-every-duration 6h")
    assert both["step-80"] == ("keep", ["--keep-last 3"])
    assert both["step-20"] == ("delete", [])


def test_keep_top_on_lightning_file_names(tmp_path: Path) -> None:
    ckpts = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    ckpts.mkdir(parents=True)
    names = {}
    for epoch, step, loss in ((0, 100, 0.9), (1, 200, 0.3), (2, 300, 0.5), (3, 400, 0.7)):
        names[step] = f"epoch={epoch}-step={step}-val_loss={loss}.ckpt"
        torch.save({"state_dict": weights(step), "global_step": step}, ckpts / names[step])
        set_mtime(ckpts / names[step], time.time() - DAY)
    run = ckpts.parent
    decided = plan(run_ckpt("prune", run, "--keep-best", "val_loss", "--keep-top", "2", "--json"))
    assert decided[f"checkpoints/{names[300]}"] == ("keep", ["--keep-top 2 (#2 val_loss=0.5)"])
    assert decided[f"checkpoints/{names[100]}"] == ("delete", [])
    assert decided[f"checkpoints/{names[400]}"] == ("keep", ["newest complete"])


def test_policy_usage_errors(tmp_path: Path) -> None:
    out = trainer_run(tmp_path, steps=(100, 200))
    top = run_ckpt("prune", out, "--keep-top", "2")
    assert top.exit_code == 2 and "--keep-best" in top.stderr
    bad = run_ckpt("prune", out, "--keep-within", "two days")
    assert bad.exit_code == 2 and "not a duration" in bad.stderr


# --------------------------------------------------------------------------- slimming


def _train_with_the_real_trainer(out: Path, *, save_only_model: bool = False) -> None:
    """transformers' Trainer on a 2-layer GPT-2 (hidden 16): checkpoint-2, -4, -6."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        save_steps=2,
        per_device_train_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_loss",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_only_model=save_only_model,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens()).train()


def test_slimming_a_real_trainer_run_keeps_weights_and_drops_resume_state(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "out"
    _train_with_the_real_trainer(out)
    for folder in out.iterdir():
        set_mtime(folder, time.time() - DAY)
    best = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())[
        "best_model_checkpoint"
    ]
    weights_before = {p.name: load_file(p / "model.safetensors") for p in out.iterdir()}
    for folder in out.iterdir():  # checksum manifests, which slimming must keep true
        assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
        set_mtime(folder, time.time() - DAY)
    decided = run_ckpt("prune", out, "--keep-last", "3", "--slim-older-than", "1", "--json")
    assert decided.exit_code == 0, decided.stderr
    report = decided.json["result"]
    slimmed = {d["name"]: d for d in report["decisions"] if d["action"] == "slim"}
    # never the newest complete, never the Trainer's best
    assert "checkpoint-6" not in slimmed and Path(best).name not in slimmed
    assert slimmed, report
    for d in slimmed.values():
        assert d["slim"]["files"] == ["optimizer.pt", "rng_state.pth"]
        folder = Path(d["path"])
        assert d["slim"]["bytes"] == sum((folder / f).stat().st_size for f in d["slim"]["files"])
    assert report["bytes_to_slim"] == sum(d["slim"]["bytes"] for d in slimmed.values())
    human = run_ckpt("prune", out, "--keep-last", "3", "--slim-older-than", "1")
    assert "would slim" in human.stdout and "frees ~" in human.stdout
    assert (
        run_ckpt("prune", out, "--keep-last", "3", "--slim-older-than", "1", "--yes").exit_code == 0
    )
    for name in slimmed:
        folder = out / name
        assert not (folder / "optimizer.pt").exists() and not (folder / "rng_state.pth").exists()
        reloaded = load_file(folder / "model.safetensors")
        assert reloaded.keys() == weights_before[name].keys()
        assert all(torch.equal(reloaded[k], v) for k, v in weights_before[name].items())
        assert run_ckpt("verify", folder).exit_code == 0
        checked = run_ckpt("verify", folder, "--checksums")
        assert checked.exit_code == 0, checked.stdout
        inspected = run_ckpt("inspect", folder, "--json").json["result"]["training"]
        assert inspected["resumable"] is False and "optimizer" in inspected["missing"]
    # the whole saves are untouched, and `latest` still resumes from the newest
    assert (out / "checkpoint-6" / "optimizer.pt").exists()
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-6")
    table = run_ckpt("inspect", out, "--json").json["result"]["run"]["checkpoints"]
    assert {c["name"] for c in table if "weights-only" in c["markers"]} == set(slimmed)


@pytest.mark.slow
def test_an_old_save_with_nothing_to_slim_says_why_it_stays_whole(tmp_path: Path) -> None:
    """A Trainer run with `save_only_model=True` keeps no optimizer or RNG state: `prune
    --slim-older-than 1` printed the plain keep table ("complete (no retention policy given)")
    and slimmed nothing, without a word of why. Each older save now says why it stays whole
    (JSON `not_slimmed`), and nothing is touched."""
    out = tmp_path / "out"
    _train_with_the_real_trainer(out, save_only_model=True)
    for folder in out.iterdir():
        assert not (folder / "optimizer.pt").exists() and not (folder / "rng_state.pth").exists()
        set_mtime(folder, time.time() - DAY)
    best = Path(
        json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())[
            "best_model_checkpoint"
        ]
    ).name
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    planned = run_ckpt("prune", out, "--slim-older-than", "1", "--json")
    assert planned.exit_code == 0, planned.stderr
    report = planned.json["result"]
    assert report["to_slim"] == 0
    why = {d["name"]: d["not_slimmed"] for d in report["decisions"]}
    assert why["checkpoint-6"] is None  # the newest: the policy keeps it whole
    for name in ("checkpoint-2", "checkpoint-4"):
        if name == best:
            assert why[name] == "the Trainer's best_model_checkpoint is never slimmed", why
        else:
            assert why[name] == "it holds no optimizer, RNG or data-loader state", why
    human = run_ckpt("prune", out, "--slim-older-than", "1", "--yes")
    assert human.exit_code == 0, human.stderr
    assert "not slimmed: it holds no optimizer, RNG or data-loader state" in human.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def load_model(folder: Path, inspected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP folder, read by `dcp.load` into fresh tensors."""
    import torch.distributed.checkpoint as dcp

    model = {
        e["name"].removeprefix("model."): torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        for e in inspected["entries"]
        if e["name"].startswith("model.")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model}, checkpoint_id=str(folder), no_dist=True)
    return model


def test_a_slimmed_dcp_save_loads_its_weights_verifies_and_is_no_resume_point(
    tmp_path: Path, train: ModuleType
) -> None:
    restart_train = train
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            restart_train.main(
                ["--run-dir", str(run), "--steps", "8", "--save-every", "4", "--format", "dcp"]
            )
            == 0
        )
    for folder in run.iterdir():
        set_mtime(folder, time.time() - DAY)
    mode = (run / "step-4").stat().st_mode
    before = run_ckpt("inspect", run / "step-4", "--json").json["result"]
    original = load_model(run / "step-4", before)
    assert (
        run_ckpt("prune", run, "--keep-last", "2", "--slim-older-than", "1", "--yes").exit_code == 0
    )
    slim = run / "step-4"
    assert (slim / "ckpt-slim.json").is_file() and slim.stat().st_mode == mode
    after = run_ckpt("inspect", slim, "--json").json["result"]
    names_after = {e["name"] for e in after["entries"]}
    assert not any(n.startswith(("optimizer.", "rng.", "dataloader.")) for n in names_after)
    assert {e["name"] for e in before["entries"] if e["name"].startswith("model.")} <= names_after
    assert after["training"]["resumable"] is False
    assert run_ckpt("verify", slim).exit_code == 0
    # dcp.load reads the weights back, bit-equal to what the full save held
    assert load_model(slim, before).keys() == original.keys()
    restored = load_model(slim, before)
    assert all(torch.equal(restored[k], v) for k, v in original.items())
    latest = run_ckpt("latest", run, "--json").json["result"]
    assert latest["latest"] == str(run / "step-8")
    # slim everything but the newest: the newest is never slimmed
    assert (
        run_ckpt("prune", run, "--keep-last", "2", "--slim-older-than", "1", "--json").json[
            "result"
        ]["to_slim"]
        == 0
    )


def test_slim_older_than_alone_is_a_policy_that_keeps_every_save_and_slims_the_old(
    tmp_path: Path, train: ModuleType
) -> None:
    # a user who only wants the disk back: no keep rule, nothing deleted, old saves slimmed
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            train.main(
                ["--run-dir", str(run), "--steps", "12", "--save-every", "4", "--format", "dcp"]
            )
            == 0
        )
    for folder in run.iterdir():
        set_mtime(folder, time.time() - DAY)
    before = {
        name: run_ckpt("inspect", run / name, "--json").json["result"]
        for name in ("step-4", "step-8")
    }
    originals = {name: load_model(run / name, before[name]) for name in before}
    planned = run_ckpt("prune", run, "--slim-older-than", "1", "--json")
    assert planned.exit_code == 0, planned.stderr
    actions = {d["name"]: d["action"] for d in planned.json["result"]["decisions"]}
    assert actions == {"step-4": "slim", "step-8": "slim", "step-12": "keep"}
    assert planned.json["result"]["to_delete"] == 0
    applied = run_ckpt("prune", run, "--slim-older-than", "1", "--yes")
    assert applied.exit_code == 0, applied.stderr
    assert sorted(p.name for p in run.iterdir()) == ["step-12", "step-4", "step-8"]
    for name, original in originals.items():
        assert (run / name / "ckpt-slim.json").is_file()
        restored = load_model(run / name, before[name])
        assert restored.keys() == original.keys()
        assert all(torch.equal(restored[k], v) for k, v in original.items())
        assert (
            run_ckpt("inspect", run / name, "--json").json["result"]["training"]["resumable"]
            is False
        )
    assert run_ckpt("inspect", run / "step-12", "--json").json["result"]["training"]["resumable"]
    # with no policy at all, still a usage error
    assert run_ckpt("prune", run, "--yes").exit_code == 2


def test_slimming_lightning_files_rewrites_them_without_optimizer_state(tmp_path: Path) -> None:
    run = tmp_path / "lightning_logs" / "version_0"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    names = {}
    for epoch, step in ((0, 100), (1, 200), (2, 300)):
        model = {k: v.float() for k, v in weights(step).items()}
        params = [torch.nn.Parameter(t.clone()) for t in model.values()]
        optimizer = torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        names[step] = f"epoch={epoch}-step={step}.ckpt"
        torch.save(
            {
                "epoch": epoch,
                "global_step": step,
                "pytorch-lightning_version": "2.4.0",
                "state_dict": model,
                "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": epoch}}}},
                "callbacks": {},
                "optimizer_states": [optimizer.state_dict()],
                "lr_schedulers": [],
            },
            ckpts / names[step],
        )
        set_mtime(ckpts / names[step], time.time() - DAY)
    old = ckpts / names[100]
    size_before = old.stat().st_size
    result = run_ckpt("prune", run, "--keep-last", "3", "--slim-older-than", "1", "--yes", "--json")
    assert result.exit_code == 0, result.stdout
    assert sorted(result.json["result"]["slimmed"]) == [
        f"checkpoints/{names[100]}",
        f"checkpoints/{names[200]}",
    ]
    assert old.is_file() and old.stat().st_size < size_before
    slimmed = torch.load(old, weights_only=True)
    assert "optimizer_states" not in slimmed and slimmed["global_step"] == 100
    assert all(torch.equal(slimmed["state_dict"][k], v.float()) for k, v in weights(100).items())
    assert run_ckpt("verify", old).exit_code == 0
    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    marked = {c["name"] for c in table["checkpoints"] if "weights-only" in c["markers"]}
    assert marked == {f"checkpoints/{names[100]}", f"checkpoints/{names[200]}"}
    assert table["latest"] == str(ckpts / names[300])
    # no leftovers: the files, and the record of which ones are slimmed
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([*names.values(), ".ckpt-slim.json"])


def test_a_slimmed_save_keeps_its_save_time_for_the_time_rules(tmp_path: Path) -> None:
    # slimming wrote ckpt-slim.json and changed the folder: the old saves looked made "now",
    # so --keep-within 1d kept the two-day-old slimmed saves and deleted a newer whole one
    out = trainer_run(tmp_path, steps=(100, 200, 300, 400))
    stamp = time.time() - 2 * DAY
    set_mtime(out, stamp)
    slimmed = run_ckpt("prune", out, "--slim-older-than", "1", "--yes", "--json")
    # checkpoint-200 is the Trainer's best: never slimmed
    assert sorted(slimmed.json["result"]["slimmed"]) == ["checkpoint-100", "checkpoint-300"]
    for name in ("checkpoint-100", "checkpoint-300"):
        assert (out / name / "ckpt-slim.json").is_file()
        assert not (out / name / "optimizer.pt").exists()
    table = run_ckpt("latest", out, "--json").json["result"]["checkpoints"]
    assert all(abs(c["mtime"] - stamp) < 1 for c in table)  # the save times, not the slimming's
    within = plan(run_ckpt("prune", out, "--keep-within", "1d", "--settle", "0", "--json"))
    assert within == {
        "checkpoint-100": ("delete", []),
        "checkpoint-200": ("keep", ["Trainer best_model_checkpoint"]),
        "checkpoint-300": ("delete", []),
        "checkpoint-400": ("keep", ["newest complete"]),
    }


def test_a_rewritten_single_file_keeps_its_save_time_and_its_slim_record(tmp_path: Path) -> None:
    run = tmp_path / "plain"
    run.mkdir()
    for step in (1, 2, 3):
        model = {k: v.float() for k, v in weights(step).items()}
        torch.save(
            {"model": model, "optimizer": {"state": {}, "param_groups": []}},
            run / f"state_{step}.pt",
        )
    stamp = time.time() - 2 * DAY
    set_mtime(run, stamp)
    result = run_ckpt("prune", run, "--slim-older-than", "1", "--yes", "--json")
    assert sorted(result.json["result"]["slimmed"]) == ["state_1.pt", "state_2.pt"]
    assert abs((run / "state_1.pt").stat().st_mtime - stamp) < 1
    table = {c["name"]: c for c in run_ckpt("latest", run, "--json").json["result"]["checkpoints"]}
    assert "weights-only" in table["state_1.pt"]["markers"]  # the record still matches it
    within = plan(run_ckpt("prune", run, "--keep-within", "1d", "--settle", "0", "--json"))
    assert within["state_1.pt"] == ("delete", [])


def test_slimming_drops_every_rank_rng_and_every_models_optimizer(tmp_path: Path) -> None:
    """A 2-rank Trainer save (`rng_state_0.pth`, `rng_state_1.pth`) and a two-model accelerate
    save (`optimizer_1.bin`, `random_states_1.pkl`) kept those files when slimmed, while the
    plan said "drop optimizer, rng": the numbered components were not matched."""
    from safetensors.torch import save_file

    from .run_fixtures import trainer_checkpoint

    run = tmp_path / "run"
    for step in (2, 4):
        save = run / f"checkpoint-{step}"
        trainer_checkpoint(save, step)
        (save / "rng_state.pth").unlink()
        for rank in (0, 1):
            torch.save({"cpu": torch.random.get_rng_state()}, save / f"rng_state_{rank}.pth")
        set_mtime(save, time.time() - DAY)
    accelerate = tmp_path / "accelerate" / "step_2"
    accelerate.mkdir(parents=True)
    for suffix in ("", "_1"):
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        save_file(model.state_dict(), accelerate / f"model{suffix}.safetensors")
        torch.save(optimizer.state_dict(), accelerate / f"optimizer{suffix}.bin")
    for rank in (0, 1):
        torch.save(
            {"step": 0, "torch_manual_seed": torch.get_rng_state()},
            accelerate / f"random_states_{rank}.pkl",
        )
    (accelerate.parent / "step_4").mkdir()
    for f in accelerate.iterdir():
        (accelerate.parent / "step_4" / f.name).write_bytes(f.read_bytes())
    set_mtime(accelerate, time.time() - DAY)
    for root, old, left in (
        (run, "checkpoint-2", {"model.safetensors", "scheduler.pt", "trainer_state.json"}),
        (accelerate.parent, "step_2", {"model.safetensors", "model_1.safetensors"}),
    ):
        applied = run_ckpt("prune", root, "--slim-older-than", "1", "--settle", "0", "--yes")
        assert applied.exit_code == 0, applied.stderr
        kept = {p.name for p in (root / old).iterdir()} - {"ckpt-slim.json"}
        assert kept == left, kept


#: `ckpt prune RUN --slim-older-than 1 --yes`, SIGKILLed right after its Nth rename, or just
#: before the replaced copy is removed (as the OOM killer or a preemption could at that instant)
_SLIM_KILLED_AFTER_RENAME = """
import os, signal, sys
import shutil
real, real_rmtree, count, nth = os.rename, shutil.rmtree, [0], sys.argv[2]
def rename(a, b, **kw):
    real(a, b, **kw)
    count[0] += 1
    if str(count[0]) == nth:
        os.kill(os.getpid(), signal.SIGKILL)
def rmtree(path, *args, **kw):
    if nth == "rmtree" and ".ckpt-old-" in str(path):  # swapped, the old copy not yet removed
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rmtree(path, *args, **kw)
os.rename, shutil.rmtree = rename, rmtree
from ckpt_cli.cli.app import main
sys.argv = ["ckpt", "prune", sys.argv[1], "--slim-older-than", "1", "--yes"]
main()
"""


def _slim_killed_after_rename(run: Path, nth: str, env: dict[str, str]) -> int:
    import subprocess
    import sys

    from .conftest import REPO

    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    cmd = [sys.executable, "-c", _SLIM_KILLED_AFTER_RENAME, str(run), str(nth)]
    return subprocess.run(cmd, env=full, capture_output=True, timeout=300).returncode


def _dcp_run_with_optimizer(run: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    for step in (100, 200):
        model = weights(step)
        state = {
            "model": model,
            "optimizer": {"state": {k: {"exp_avg": v.clone()} for k, v in model.items()}},
            "train_state": {"step": step},
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(run / f"step-{step}"), no_dist=True)
        set_mtime(run / f"step-{step}", time.time() - DAY)
    return weights(100)


@pytest.mark.parametrize(
    ("nth", "exchange"),
    [
        ("1", True),
        ("rmtree", True),
        ("1", False),
        ("2", False),
        ("3", False),
        ("4", False),
        # the old save moved aside, the slimmed one not yet in its place: step-100 is missing
        # until the next `prune --yes` puts it back
        ("5", False),
        ("rmtree", False),
    ],
)
@pytest.mark.slow
def test_a_slim_killed_mid_swap_never_loses_the_save(
    tmp_path: Path, nth: str, exchange: bool
) -> None:
    # the rewrite of a DCP save is swapped in by renames; killed between two of them, the old
    # copy moved aside and the new one not yet in place, a later `prune --incomplete` took both
    # for the debris of interrupted saves and deleted the step
    run = tmp_path / "run"
    original = _dcp_run_with_optimizer(run)
    env = {} if exchange else {"CKPT_NO_RENAME_EXCHANGE": "1"}
    assert _slim_killed_after_rename(run, nth, env) == -9  # SIGKILL
    cleaned = run_ckpt("prune", run, "--incomplete", "--settle", "0", "--yes")
    assert cleaned.exit_code == 0, cleaned.stdout + cleaned.stderr
    if nth == "5":
        assert "restored" in cleaned.stderr and ".step-100.ckpt-old-" in cleaned.stderr
    assert not list(run.glob(".step-100.ckpt-old-*"))  # put back, or removed once replaced
    step = run / "step-100"
    inspected = run_ckpt("inspect", step, "--json").json["result"]
    restored = load_model(step, inspected)
    assert all(torch.equal(restored[k], v) for k, v in original.items())
    assert run_ckpt("verify", step).exit_code == 0
    # run again, the slim finishes
    assert run_ckpt("prune", run, "--slim-older-than", "1", "--yes").exit_code == 0
    assert (step / "ckpt-slim.json").is_file()
    restored = load_model(step, run_ckpt("inspect", step, "--json").json["result"])
    assert all(torch.equal(restored[k], v) for k, v in original.items())


def test_a_trainer_slim_killed_between_its_file_removals_is_not_deleted_as_incomplete(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    out = trainer_run(tmp_path, steps=(100, 200, 300))
    want = load_file(out / "checkpoint-100" / "model.safetensors")
    assert _slim_killed_after_rename(out, "1", {}) == -9
    listed = run_ckpt("latest", out, "--json", "--settle", "0").json["result"]["checkpoints"]
    row = {r["name"]: r for r in listed}["checkpoint-100"]
    assert row["status"] == "complete" and "weights-only" in row["markers"], row
    cleaned = run_ckpt("prune", out, "--incomplete", "--settle", "0", "--yes")
    assert cleaned.exit_code == 0, cleaned.stdout + cleaned.stderr
    got = load_file(out / "checkpoint-100" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert run_ckpt("latest", out).stdout.strip() == str(out / "checkpoint-300")


def test_slimming_never_blesses_a_file_damaged_before_in_the_checksum_manifest(
    tmp_path: Path,
) -> None:
    out = trainer_run(tmp_path, steps=(100, 200, 300, 400))
    damaged, clean = out / "checkpoint-100", out / "checkpoint-300"
    for folder in (damaged, clean):
        assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    weights_file = damaged / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-5] ^= 0xFF  # bit rot in the weights, after the manifest was written
    weights_file.write_bytes(bytes(data))
    for folder in out.iterdir():
        set_mtime(folder, time.time() - DAY)
    assert run_ckpt("verify", damaged, "--checksums").exit_code == 1
    before = sorted(p.name for p in damaged.iterdir())
    result = run_ckpt("prune", out, "--slim-older-than", "1", "--yes", "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    failed = " ".join(result.json["result"]["failed"])
    assert "checkpoint-100" in failed and "model.safetensors" in failed
    # left as it was: the damage is still reported, the resume state still there
    assert sorted(p.name for p in damaged.iterdir()) == before
    assert run_ckpt("verify", damaged, "--checksums").exit_code == 1
    # an intact checkpoint with a manifest is slimmed, and its refreshed manifest checks out
    assert (clean / "ckpt-slim.json").is_file() and not (clean / "optimizer.pt").exists()
    assert run_ckpt("verify", clean, "--checksums").exit_code == 0


def test_a_slimmed_protected_save_gets_parity_for_what_it_now_holds(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = trainer_run(tmp_path, steps=(100, 200, 300))
    save = out / "checkpoint-100"
    assert run_ckpt("protect", save, "--whole-files").exit_code == 0
    for folder in out.iterdir():
        set_mtime(folder, time.time() - DAY)
    want = load_file(save / "model.safetensors")
    result = run_ckpt("prune", out, "--slim-older-than", "1", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not (save / "optimizer.pt").exists() and (save / "ckpt-slim.json").is_file()
    # the old parity listed the dropped files: verify called them lost, repair wrote them back
    verified = run_ckpt("verify", save, "--checksums", "--json")
    assert verified.exit_code == 0, verified.stdout
    assert "parity" in verified.json["result"]["checks"]
    protected = json.loads((save / ".ckpt-parity" / "parity.index.json").read_text())
    assert "optimizer.pt" not in {f["path"] for f in protected["files"]}
    assert protected["whole_files"] is True
    assert run_ckpt("repair", save, "--dry-run").exit_code == 0
    # and the new parity rebuilds what the slimmed save keeps
    (save / "model.safetensors").unlink()
    assert run_ckpt("repair", save).exit_code == 0
    got = load_file(save / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not (save / "optimizer.pt").exists()


@pytest.mark.frameworks
def test_a_slimmed_accelerate_save_is_kept_as_weights_only_not_deleted_as_incomplete(
    real_accelerate_run: Path, tmp_path: Path
) -> None:
    """`prune --slim-older-than` removes an accelerate save's `optimizer.bin` and
    `random_states_0.pkl` and keeps its `scheduler.bin`, as it keeps a Trainer's
    `scheduler.pt`. The run's judge then read the scheduler without its optimizer as a lost
    file: the slimmed save was `incomplete`, `verify` failed it, and the next `prune
    --incomplete --yes` deleted the save the user had kept for its weights."""
    import shutil

    from safetensors.torch import load_file

    run = shutil.copytree(real_accelerate_run / "straight", tmp_path / "run")
    weights_before = load_file(run / "step-2" / "model.safetensors")
    set_mtime(run / "step-2", time.time() - DAY)
    slimmed = run_ckpt("prune", run, "--slim-older-than", "1", "--settle", "0", "--yes")
    assert slimmed.exit_code == 0, slimmed.stderr
    left = {p.name for p in (run / "step-2").iterdir()}
    assert "optimizer.bin" not in left and "scheduler.bin" in left
    rows = run_ckpt("prune", run, "--incomplete", "--settle", "0", "--json").json["result"]
    decided = {d["name"]: (d["status"], d["action"], d["markers"]) for d in rows["decisions"]}
    assert decided["step-2"][:2] == ("complete", "keep"), decided
    assert "weights-only" in decided["step-2"][2]
    assert run_ckpt("prune", run, "--incomplete", "--settle", "0", "--yes").exit_code == 0
    assert (run / "step-2" / "model.safetensors").exists()
    checked = run_ckpt("verify", run / "step-2", "--json")
    assert checked.exit_code == 0, checked.stdout
    assert checked.json["result"]["training"]["resumable"] is False  # weights only, and said
    latest = run_ckpt("latest", run, "--settle", "0")
    assert latest.stdout.strip() == str(run / "step-4")
    kept = load_file(run / "step-2" / "model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in weights_before.items())
