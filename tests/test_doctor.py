"""`ckpt doctor`: real tiny training jobs (transformers Trainer, accelerate, a plain DCP loop),
each resumed with one fault planted at a time, and the doctor names the planted cause first;
clean resumes (a declared world-size change among them) get no cause."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import REPO, run_ckpt
from .dist_helpers import run_torchrun
from .doctor_jobs import (
    ACCELERATE_PACE,
    CASES,
    DECLARED,
    DOWN_SECONDS,
    TORCHRUN_RESUMES,
    TRAINER_RUNS,
    copy_saves,
)
from .s3_fixtures import S3Server, upload_folder

_FRAMEWORK = {
    "trainer": ("transformers",),
    "accelerate": ("accelerate", "transformers", "torchdata"),
    "torchtitan": ("torchtitan", "torchdata"),
}
#: where each kind's job keeps its saves inside a case folder (torchtitan: its dump folder's
#: `checkpoint/`)
_RUN_FOLDER = {"torchtitan": "checkpoint"}
DIST_JOB = Path(__file__).with_name("doctor_dist_job.py")
TRAINER_DIST_JOB = Path(__file__).with_name("doctor_trainer_dist_job.py")


def _build(kind: str, out: Path) -> Path:
    for module in _FRAMEWORK.get(kind, ()):
        pytest.importorskip(module, reason=f"the {kind} job needs {module} (the frameworks extra)")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("HF_ENDPOINT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.doctor_jobs", kind, str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trainer_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trainer runs: `base/` and one folder per case of `CASES["trainer"]`."""
    return _build("trainer", tmp_path_factory.mktemp("doctor_trainer"))


@pytest.fixture(scope="module")
def accelerate_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """accelerate runs: `base/` and one folder per case of `CASES["accelerate"]`."""
    return _build("accelerate", tmp_path_factory.mktemp("doctor_accelerate"))


@pytest.fixture(scope="module")
def dcp_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain DCP-loop runs: `base/` and one folder per case of `CASES["dcp"]`."""
    return _build("dcp", tmp_path_factory.mktemp("doctor_dcp"))


@pytest.fixture(scope="module")
def torchtitan_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchtitan runs (its CheckpointManager, on CPU): one folder per `CASES["torchtitan"]`."""
    return _build("torchtitan", tmp_path_factory.mktemp("doctor_torchtitan"))


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain DCP loop trained on 2 ranks under torchrun (gloo, CPU), resumed from `step-4`
    on 2 or 1 rank(s) (`TORCHRUN_RESUMES`): one folder per `CASES["torchrun"]`."""
    out = tmp_path_factory.mktemp("doctor_torchrun")
    run_torchrun(DIST_JOB, 2, out / "base", "4", "0.05", timeout=600)
    for case, (ranks, per_device, lr) in TORCHRUN_RESUMES.items():
        copy_saves(out / "base", out / case, ["step-2", "step-4"])
        run_torchrun(DIST_JOB, ranks, out / case, str(per_device), str(lr), "step-4", timeout=600)
    return out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain Trainer runs: one folder per case of `TRAINER_RUNS`."""
    return _build("trainer_runs", tmp_path_factory.mktemp("doctor_trainer_runs"))


def _jobs(request: pytest.FixtureRequest, kind: str) -> Path:
    path: Path = request.getfixturevalue(f"{kind}_jobs")
    return path


def _params() -> list[Any]:
    out = []
    for kind, cases in CASES.items():
        marks = [pytest.mark.frameworks] if kind in _FRAMEWORK else []
        if kind == "torchrun":
            marks = [pytest.mark.torchrun, pytest.mark.slow]
        for case, want in cases.items():
            out.append(pytest.param(kind, case, want, marks=marks, id=f"{kind}-{case}"))
    return out


def _resume_save(kind: str) -> tuple[str, str]:
    """(the save resumed from, the first save the resumed run wrote) of a fault case."""
    return ("checkpoint-4", "checkpoint-6") if kind == "trainer" else ("step-4", "step-6")


# the first case of a kind builds its jobs (several real trainings, a torchrun launch each for
# the torchrun kind): minutes on a loaded 2-core machine, more than the suite's default timeout
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("kind", "case", "want"), _params())
@pytest.mark.slow
def test_the_planted_cause_is_ranked_first(
    request: pytest.FixtureRequest, kind: str, case: str, want: str | None
) -> None:
    run = _jobs(request, kind) / case / _RUN_FOLDER.get(kind, "")
    expect = [f"--expect={change}" for change in DECLARED.get(kind, {}).get(case, [])]
    result = run_ckpt("doctor", run, *expect, "--json")
    report = result.json["result"]
    live = [c for c in report["causes"] if not c["declared"]]
    if want is None:
        assert result.exit_code == 0, report["causes"]
        assert live == [] and report["verdict"].startswith("NO CAUSE FOUND")
        # a resume it examined and found continuous, not a run it took for unbroken
        assert [p["resumed"] for p in report["resume_points"]].count(True) == 1
        return
    assert result.exit_code == 1, report["verdict"]
    top = live[0]
    assert (top["id"], top["rank"]) == (want, 1), [(c["id"], c["evidence"]) for c in live]
    before, after = _resume_save(kind)
    assert (top["before"], top["after"]) == (before, after)
    assert top["evidence"] and top["fix"]
    assert result.json["error"]["code"] == "problems_found"
    point = next(p for p in report["resume_points"] if p["after"] == after)
    assert point["resumed"] and "state" in point["how"]


@pytest.mark.frameworks
def test_trainer_evidence_matches_the_saved_files(trainer_jobs: Path) -> None:
    run = trainer_jobs / "skip_optimizer"
    report = run_ckpt("doctor", run, "--json").json["result"]
    saved = torch.load(run / "checkpoint-6" / "optimizer.pt", weights_only=True)
    before = torch.load(run / "checkpoint-4" / "optimizer.pt", weights_only=True)
    steps_after = {int(s["step"]) for s in saved["state"].values()}
    steps_before = {int(s["step"]) for s in before["state"].values()}
    assert steps_before == {4} and steps_after == {2}  # what the faulty resume really saved
    top = report["causes"][0]
    assert "optimizer step count 4 at checkpoint-4, 2 at checkpoint-6" in top["evidence"][0]
    # the scheduler was restored: its counter carried on
    assert torch.load(run / "checkpoint-6" / "scheduler.pt", weights_only=True)["last_epoch"] == 6
    assert all(c["id"] != "scheduler_not_restored" for c in report["causes"])
    # the LR log of the skipped scheduler is evidence beside its cause
    sched = run_ckpt("doctor", trainer_jobs / "skip_scheduler", "--json").json["result"]
    log = next(p["log"] for p in sched["resume_points"] if p["after"] == "checkpoint-6")
    history = json.loads(
        (trainer_jobs / "skip_scheduler/checkpoint-6/trainer_state.json").read_text()
    )
    lrs = {e["step"]: e["learning_rate"] for e in history["log_history"] if "learning_rate" in e}
    assert (log["lr_before"], log["lr_after"]) == (lrs[4], lrs[5])
    assert log["lr_like_step"] == 1 and lrs[5] == lrs[1]


@pytest.mark.frameworks
def test_trainer_batch_change_reads_training_args(trainer_jobs: Path) -> None:
    report = run_ckpt("doctor", trainer_jobs / "grad_accum", "--json").json["result"]
    top = report["causes"][0]
    assert (
        "grad accum 1 at checkpoint-4, 2 at checkpoint-6 "
        "(training_args.bin gradient_accumulation_steps)"
    ) in top["evidence"]
    assert any("total_flos per step" in line for line in top["evidence"])
    # declared, the same change is reported, not ranked: exit 0
    declared = run_ckpt("doctor", trainer_jobs / "grad_accum", "--expect", "batch", "--json")
    assert declared.exit_code == 0
    causes = declared.json["result"]["causes"]
    assert [(c["id"], c["declared"], c["rank"]) for c in causes] == [("batch_changed", True, 0)]


@pytest.mark.frameworks
def test_trainer_optimizer_reordered_onto_same_shape_parameters_is_found(
    trainer_jobs: Path,
) -> None:
    """A custom trainer whose refactored attention numbers `o_proj` before `q_proj` (both
    [16, 16]) resumed a Trainer checkpoint: `optimizer.pt` loads by number, so each took the
    other's Adam moments, and `model.safetensors` keeps no parameter order (sorted names).
    The doctor said NO CAUSE FOUND. Each state's direction follows the change of the weight
    it steps: o_proj's state drove o_proj up to checkpoint-4 and q_proj after the resume."""
    run = trainer_jobs / "reordered"
    before = torch.load(run / "checkpoint-4" / "optimizer.pt", weights_only=True)
    after = torch.load(run / "checkpoint-6" / "optimizer.pt", weights_only=True)
    shapes = [tuple(s["exp_avg"].shape) for s in before["state"].values()]
    assert shapes == [tuple(s["exp_avg"].shape) for s in after["state"].values()]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "optimizer_mismatch",
        "checkpoint-4",
        "checkpoint-6",
    )
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    # o_proj's state on q_proj keeps its second moments (q_proj's gradients are small at
    # init); q_proj's on o_proj is swamped by o_proj's, so it cannot show where it came from
    assert [line.split(" (")[0] for line in top["evidence"]] == [
        f"optimizer state of parameter 4 drove {o!r} up to checkpoint-4",
    ], top["evidence"]
    assert f"and {q!r} after it" in top["evidence"][0]
    assert "its second moments carried on" in top["evidence"][0]


@pytest.mark.frameworks
def test_trainer_resumed_under_bf16_reads_training_args(trainer_jobs: Path) -> None:
    """The run trained in fp32 and was resumed with `bf16=True`: the weights stay fp32 (the
    Trainer autocasts), so doctor, which compared weight dtypes only, said NO CAUSE FOUND."""
    from safetensors import safe_open

    with safe_open(trainer_jobs / "bf16/checkpoint-6/model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"F32"}
    result = run_ckpt("doctor", trainer_jobs / "bf16", "--json")
    assert result.exit_code == 1
    top = result.json["result"]["causes"][0]
    assert top["id"] == "precision_changed"
    assert "another mixed precision" in top["title"]
    assert top["evidence"] == [
        "mixed precision fp32 at checkpoint-4, bf16 at checkpoint-6 (TrainingArguments bf16 / "
        "fp16 in training_args.bin): the resumed run computes in another precision"
    ]
    declared = run_ckpt("doctor", trainer_jobs / "bf16", "--expect", "precision", "--json")
    assert declared.exit_code == 0


def test_dcp_clean_world_size_change_is_a_note(dcp_jobs: Path) -> None:
    result = run_ckpt("doctor", dcp_jobs / "clean_world_size", "--json")
    assert result.exit_code == 0
    point = next(p for p in result.json["result"]["resume_points"] if p["after"] == "step-6")
    assert point["resumed"] and "log" in point["how"]
    assert any("world size 2 at step-4, 1 at step-6" in n for n in point["notes"])
    assert any("global batch is unchanged" in n for n in point["notes"])


def test_dcp_log_restart_is_found_and_shown(dcp_jobs: Path) -> None:
    run = dcp_jobs / "skip_data"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8]  # the crashed job logged past its save
    report = run_ckpt("doctor", run, "--json").json["result"]
    point = next(p for p in report["resume_points"] if p["after"] == "step-6")
    assert point["how"][:1] == ["log"]
    log = point["log"]
    assert (log["step_before"], log["step_after"], log["restarted"]) == (4, 5, True)
    assert log["loss_after"] == rows[8]["loss"] and log["loss_before"] == rows[3]["loss"]
    top = report["causes"][0]
    assert "dataloader.samples_seen 16 at step-4, 8 at step-6" in top["evidence"][0]


def test_dcp_human_output(dcp_jobs: Path) -> None:
    result = run_ckpt("doctor", dcp_jobs / "ema")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("LIKELY CAUSE: the EMA was not restored")
    assert any(line.startswith("1. ema_not_restored") for line in lines)
    assert any(line.strip().startswith("fix: Load the EMA state dict") for line in lines)
    assert "resumed (log, time, state)" in result.stdout


def test_before_after_examines_one_pair(dcp_jobs: Path) -> None:
    run = dcp_jobs / "scaler"
    result = run_ckpt("doctor", run, "--before", "step-4", "--after", "step-6", "--json")
    assert result.exit_code == 1
    report = result.json["result"]
    assert report["mode"] == "pair" and report["checkpoints"] == ["step-4", "step-6"]
    assert report["causes"][0]["id"] == "grad_scaler_reset"
    assert report["resume_points"][0]["how"][0] == "declared"
    # full paths, no RUN_DIR: the same
    alone = run_ckpt("doctor", "--before", run / "step-4", "--after", run / "step-6", "--json")
    assert alone.json["result"]["causes"][0]["id"] == "grad_scaler_reset"
    # a straight pair of the same run has no cause
    straight = run_ckpt("doctor", run, "--before", "step-2", "--after", "step-4", "--json")
    assert straight.exit_code == 0 and straight.json["result"]["causes"] == []


def test_single_checkpoint_with_counters_that_disagree(dcp_jobs: Path) -> None:
    save = dcp_jobs / "skip_optimizer" / "step-6"
    result = run_ckpt("doctor", save, "--json")
    assert result.exit_code == 1
    report = result.json["result"]
    assert report["mode"] == "single"
    top = report["causes"][0]
    assert top["id"] == "inconsistent_state"
    assert "optimizer step count 2, trainer step 6" in top["evidence"]
    assert run_ckpt("doctor", dcp_jobs / "clean" / "step-6").exit_code == 0


def test_single_checkpoint_with_rng_for_fewer_ranks(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "train_state": {"step": 1, "world_size": 2},
        "rng": {"rank_0": {"torch_cpu": torch.get_rng_state()}},  # rank 1's was never saved
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    result = run_ckpt("doctor", tmp_path / "step-1", "--json")
    assert result.exit_code == 1
    top = result.json["result"]["causes"][0]
    assert top["id"] == "rng_ranks_missing"
    assert top["evidence"] == ["world size 2 recorded, RNG states for 1 rank(s)"]


def test_lightning_csv_logs_across_versions(tmp_path: Path) -> None:
    from ckpt_cli.ops.doctor.logs import jump, run_logs
    from ckpt_cli.storage import LocalStorage

    # Lightning's CSVLogger starts a new version_N per run: the resumed run is version_1
    for version, steps in ((0, range(1, 7)), (1, range(5, 9))):
        folder = tmp_path / "lightning_logs" / f"version_{version}"
        folder.mkdir(parents=True)
        rows = ["epoch,step,train_loss,lr-AdamW"]
        rows += [f"0,{s},{1.0 / s:.4f},{0.001 * (s if version == 0 else s - 4)}" for s in steps]
        (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    series = run_logs(LocalStorage(tmp_path), str(tmp_path))
    assert len(series) == 1
    found = jump(series[0], 4, 6)
    assert found is not None and found.restarted
    assert (found.step_before, found.step_after, found.lr_after, found.lr_like_step) == (
        4,
        5,
        0.001,
        1,
    )


def test_expect_rejects_an_unknown_change(dcp_jobs: Path) -> None:
    result = run_ckpt("doctor", dcp_jobs / "clean", "--expect", "weather", "--json")
    assert result.exit_code == 2
    assert "--expect 'weather'" in result.json["error"]["message"]
    assert run_ckpt("doctor", dcp_jobs / "clean", "--before", "step-4").exit_code == 2


def test_library_call(dcp_jobs: Path) -> None:
    import ckpt_cli

    report = ckpt_cli.doctor(str(dcp_jobs / "bf16"))
    assert isinstance(report, ckpt_cli.DoctorReport) and report.found
    assert report.causes[0].id == "precision_changed"
    assert report.causes[0].evidence == [
        "8 of 8 weight tensors float32 at step-4, bfloat16 at step-6"
    ]


def test_json_envelope_follows_the_published_schema(dcp_jobs: Path) -> None:
    import jsonschema

    schema = json.loads((REPO / "schema" / "ckpt-json.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for case in ("ema", "clean"):
        result = run_ckpt("doctor", dcp_jobs / case, "--json")
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        assert len(lines) == 1
        doc = json.loads(lines[0])
        assert [e.message for e in validator.iter_errors(doc)] == []
        assert doc["command"] == "doctor" and doc["exit_code"] == result.exit_code
        assert doc["ok"] is (case == "clean")


@pytest.mark.slow  # four saves uploaded to moto and read back through it (~10 s)
def test_a_run_folder_in_an_object_store(dcp_jobs: Path, s3_server: S3Server) -> None:
    # the same run uploaded to S3: the saves, the log, read through the store
    upload_folder(s3_server.endpoint, "runs", "skip_data", dcp_jobs / "skip_data")
    result = run_ckpt("doctor", "s3://runs/skip_data", "--json")
    assert result.exit_code == 1, result.stderr
    report = result.json["result"]
    assert report["checkpoints"] == ["step-2", "step-4", "step-6", "step-8"]
    top = report["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "data_position_not_restored",
        "step-4",
        "step-6",
    )
    point = next(p for p in report["resume_points"] if p["after"] == "step-6")
    assert "log" in point["how"] and point["log"]["source"].endswith("metrics.jsonl")


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_torchrun_world_size_change_declared_or_not(torchrun_jobs: Path) -> None:
    # 2 ranks of 4 → 1 rank of 4: the global batch halved, the LR kept
    run = torchrun_jobs / "lr_not_rescaled"
    top = run_ckpt("doctor", run, "--json").json["result"]["causes"][0]
    assert top["id"] == "batch_changed"
    assert "world size 2 at step-4, 1 at step-6 (train_state.world_size)" in top["evidence"]
    assert any("global batch ×0.5 but the learning rate ×1" in e for e in top["evidence"])
    # the same change declared is reported, not ranked
    declared = run_ckpt("doctor", run, "--expect", "world-size", "--json")
    assert declared.exit_code == 0
    causes = declared.json["result"]["causes"]
    assert [(c["id"], c["declared"]) for c in causes] == [("batch_changed", True)]
    # the LR halved with the batch: a note, no cause
    rescaled = run_ckpt("doctor", torchrun_jobs / "clean_lr_rescaled", "--json")
    assert rescaled.exit_code == 0 and rescaled.json["result"]["causes"] == []
    point = next(p for p in rescaled.json["result"]["resume_points"] if p["after"] == "step-6")
    assert any("learning rate rescaled ×0.5" in n for n in point["notes"])
    # the saves hold what the ranks wrote: 2 ranks' RNG before, 1 rank's after
    assert {p.name for p in (run / "step-4").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert {p.name for p in (run / "step-6").glob("*.distcp")} == {"__0_0.distcp"}


def test_torch_generator_draws_are_counted_from_its_state() -> None:
    from ckpt_cli.ops.doctor.mt19937 import draws_since_seed, parse

    states, drawn, total = [], [], 0
    torch.manual_seed(77)
    for n in (0, 1, 623, 1, 5000, 100_000):
        torch.rand(n)
        total += n
        state = parse(torch.get_rng_state().numpy().tobytes())
        assert state is not None and state.seed == 77
        states.append(state)
        drawn.append(total)
    torch.manual_seed(5)
    torch.rand(3000)
    other = parse(torch.get_rng_state().numpy().tobytes())
    assert other is not None
    assert draws_since_seed([*states, other]) == [*drawn, 3000]
    assert parse(bytes(5056)) is None and parse(b"\x00" * 16) is None


@pytest.mark.slow
def test_doctor_reads_tensors_without_torch(dcp_jobs: Path) -> None:
    # weights, EMA and optimizer moments from their raw bytes through numpy: a process that
    # never imports torch (its import alone is most of the memory budget)
    probe = (
        "import sys; from ckpt_cli import doctor\n"
        "r = doctor(sys.argv[1])\n"
        "print([c.id for c in r.causes], 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for case, want in (("partial_weights", "weights_partly_restored"), ("ema", "ema_not_restored")):
        proc = subprocess.run(
            [sys.executable, "-c", probe, str(dcp_jobs / case)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"['{want}'] False", proc.stdout


@pytest.mark.frameworks
def test_torchtitan_evidence(torchtitan_jobs: Path) -> None:
    # the data position lives in the loader's pickled state (`dataloader.dp_rank_0`)
    data = run_ckpt("doctor", torchtitan_jobs / "skip_data" / "checkpoint", "--json")
    top = data.json["result"]["causes"][0]
    assert top["evidence"][0].startswith(
        "dataloader.dp_rank_0._num_yielded 4 at step-4, 2 at step-6"
    )
    assert "exclude_from_loading" in top["fix"]
    # the weights are the model's top-level keys only (not the optimizer's moments beside them):
    # layer 1's 7 matrices and its attention norm (its ffn norm, back at ones, still correlates)
    run = torchtitan_jobs / "partial_weights" / "checkpoint"
    weights = run_ckpt("doctor", run, "--json").json["result"]["causes"][0]
    assert weights["evidence"][0].startswith("8 of 21 weight tensors changed by far more")
    assert all(line.split(":")[0].startswith("layers.1.") for line in weights["evidence"][1:])


def test_dcp_rng_replay_is_one_cause(dcp_jobs: Path) -> None:
    # re-seeded at step 4, the resumed run replays the run's RNG states: step-6 holds step-2's
    # state and step-8 step-4's; only the resume is a cause, not the replay's continuation
    report = run_ckpt("doctor", dcp_jobs / "rng", "--json").json["result"]
    assert [(c["id"], c["before"], c["after"]) for c in report["causes"]] == [
        ("rng_not_restored", "step-4", "step-6")
    ]
    assert "bit-identical to the one at step-2" in report["causes"][0]["evidence"][0]
    # the same state counted: fewer draws since the seed after the resume than before it
    seeded = run_ckpt("doctor", dcp_jobs / "rng_seeded_check", "--json").json["result"]
    evidence = seeded["causes"][0]["evidence"][0]
    assert "numbers drawn since seed 0 at step-4 (step 4)" in evidence
    other = run_ckpt("doctor", dcp_jobs / "rng_new_seed", "--json").json["result"]
    assert "seed 0 at step-4, 1234 at step-6" in other["causes"][0]["evidence"][0]


def test_tensor_moments_from_raw_bytes_match_torch(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckpt_cli.formats import resolve_source
    from ckpt_cli.ops.doctor.tensors import BLOCK_ELEMENTS, moments_against, streams_raw
    from ckpt_cli.sources.opening import open_source

    gen = torch.Generator().manual_seed(0)
    n = BLOCK_ELEMENTS * 2 + 123  # blocks, and a short last one
    base = torch.randn(n, generator=gen)
    tensors = {
        "b": base.reshape(-1, 1),
        "f32": (base + 0.1 * torch.randn(n, generator=gen)).reshape(-1, 1),
        "bf16": (-base).to(torch.bfloat16).reshape(-1, 1),
        "f16": torch.randn(n, generator=gen).to(torch.float16).reshape(-1, 1),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    checkpoint = open_source(resolve_source(str(tmp_path / "m.safetensors"))).checkpoint
    entry = checkpoint.manifest.by_name
    assert all(streams_raw(checkpoint, entry[k]) for k in tensors)
    got = moments_against(
        (checkpoint, entry["b"]), [(checkpoint, entry[k]) for k in ("f32", "bf16", "f16")]
    )
    b = tensors["b"].double().flatten()
    for (norm, dist, corr), key in zip(got, ("f32", "bf16", "f16"), strict=True):
        a = tensors[key].double().flatten()
        want_corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert norm == pytest.approx(float(a.norm()), rel=1e-9)
        assert dist == pytest.approx(float((b - a).norm()), rel=1e-9)
        assert corr == pytest.approx(want_corr, rel=1e-6, abs=1e-9)


def test_accelerate_saves_named_automatically_number_saves_not_steps(tmp_path: Path) -> None:
    """accelerate's automatic naming (`checkpoint_N`, one per `save_state`) counts saves: a
    run saving every 2 optimizer steps has `checkpoint_2` at step 6. doctor took N for the
    trainer step and called the clean run's counters inconsistent (exit 1)."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path / "run"), automatic_checkpoint_naming=True
        ),
    )
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for step in range(1, 7):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            accelerator.save_state()
    saves = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in saves.iterdir()) == [
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_2",
    ]
    for target in (tmp_path / "run", saves / "checkpoint_2"):
        result = run_ckpt("doctor", target, "--json")
        assert result.exit_code == 0, result.stdout
        assert result.json["result"]["causes"] == []
    # nor is N a step anywhere else: the saves are ordered by it, but no metric row keyed by
    # step is matched to them (step 2's loss was credited to checkpoint_2, saved at step 6,
    # and `prune --keep-best` planned to delete checkpoint_0, the real best)
    listed = run_ckpt("latest", tmp_path / "run", "--settle", "0", "--json")
    rows = listed.json["result"]["checkpoints"]
    assert [(r["name"], r["step"], r["save_number"]) for r in rows] == [
        (f"checkpoints/checkpoint_{n}", None, n) for n in range(3)
    ]
    assert (
        run_ckpt("inspect", saves / "checkpoint_1", "--json").json["result"]["training"]["step"]
        is None
    )
    losses = {2: 1.0, 4: 3.0, 6: 2.0}
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items())
    )
    pruned = run_ckpt(
        "prune", tmp_path / "run", "--keep-best", "loss", "--settle", "0", "--yes", "--json"
    )
    assert pruned.exit_code == 3, pruned.stdout
    assert "count saves, not steps" in pruned.json["error"]["fix"]
    assert sorted(p.name for p in saves.iterdir()) == [f"checkpoint_{n}" for n in range(3)]


def test_accelerate_steps_come_from_the_folder_names_not_the_accumulation_counter(
    tmp_path: Path,
) -> None:
    """`random_states_0.pkl`'s `step` is accelerate's gradient-accumulation micro-step counter
    (reset each epoch): `step_4` was reported as step 8, `step_8` as step 0, and doctor saw a
    resume at step_6 -> step_8 in a run that never stopped."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.randn(32, 8), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    step = 0
    for _epoch in range(2):
        for batch in data:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 2 == 0:
                    accelerator.save_state(str(tmp_path / "run" / f"step_{step}"))
    names = sorted((p.name for p in (tmp_path / "run").iterdir()), key=lambda n: int(n[5:]))
    assert names == [f"step_{n}" for n in (2, 4, 6, 8)]
    for name in names:
        training = run_ckpt("inspect", tmp_path / "run" / name, "--json").json["result"]
        assert training["training"]["step"] == int(name[5:]), name
    doctor = run_ckpt("doctor", tmp_path / "run", "--json")
    assert doctor.exit_code == 0, doctor.stdout
    assert doctor.json["result"]["causes"] == []
    assert not any(pair["resumed"] for pair in doctor.json["result"]["resume_points"])


def test_a_resume_from_torchs_own_dcp_conversion_is_explained(tmp_path: Path) -> None:
    """A run saved with `dcp.save`, converted with torch's `dcp_to_torch_save` and resumed
    from that file: `optimizer.load_state_dict` took the string ids without an error and
    restored nothing. The doctor called it "restored for other parameters" and advised
    rebuilding the optimizer; it now names the string ids of the save resumed from."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).sum().backward()
            optimizer.step()

    train(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 4}
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp-4"))
        dcp_to_torch_save(str(tmp_path / "dcp-4"), str(tmp_path / "step-4.pt"))
    saved = torch.load(tmp_path / "step-4.pt", weights_only=False)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])  # no error, nothing restored
    train(2)
    after = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 6}
    torch.save(after, tmp_path / "step-6.pt")

    result = run_ckpt(
        "doctor", "--before", tmp_path / "step-4.pt", "--after", tmp_path / "step-6.pt", "--json"
    )
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert top["id"] == "optimizer_not_restored"
    assert any("keyed by the strings '0', '1'" in line for line in top["evidence"])
    assert "int ids" in top["fix"]
    ids = {c["id"] for c in result.json["result"]["causes"]}
    assert "optimizer_mismatch" not in ids


def test_a_resume_from_a_slimmed_save_names_the_fresh_optimizer(tmp_path: Path) -> None:
    """A Trainer resumed from a save `prune --slim-older-than` had made weights-only starts a
    fresh optimizer (and scheduler). doctor named only the scheduler: the optimizer's counts
    could not be compared with a save that holds none."""
    from .run_fixtures import trainer_checkpoint

    trainer_checkpoint(tmp_path / "run" / "checkpoint-200", 200)
    slimmed = tmp_path / "run" / "checkpoint-200"
    (slimmed / "optimizer.pt").unlink()
    (slimmed / "ckpt-slim.json").write_text("{}")
    for name, adam_steps in (("resumed", 200), ("straight", 400)):
        after = tmp_path / name / "checkpoint-400"
        trainer_checkpoint(after, 400)
        optimizer = torch.load(after / "optimizer.pt", weights_only=True)
        for state in optimizer["state"].values():
            state["step"] = torch.tensor(float(adam_steps))
        torch.save(optimizer, after / "optimizer.pt")
        result = run_ckpt("doctor", "--before", slimmed, "--after", after, "--json")
        causes = {c["id"]: c for c in result.json["result"]["causes"]}
        if name == "resumed":
            cause = causes["optimizer_not_restored"]
            assert "without optimizer state" in cause["title"]
            assert any("slimmed" in line for line in cause["evidence"])
        else:
            assert "optimizer_not_restored" not in causes, causes


def test_doctor_of_weights_only_does_not_call_them_resumable(tmp_path: Path) -> None:
    """`doctor model/` printed "can resume consistently" above the warning "nothing to resume
    from"."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    result = run_ckpt("doctor", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "weights only" in result.stdout and "can resume" not in result.stdout
    assert "(single: 1 save)" in result.stdout


@pytest.mark.frameworks
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("case", "want"), list(TRAINER_RUNS.items()))
def test_trainer_runs_without_a_planted_fault_in_the_trainer(
    trainer_runs: Path, case: str, want: str | None
) -> None:
    # straight runs whose epochs end in a short step are no batch change; a batch changed at a
    # resume is found at that resume only, not again at the next (unchanged) pair; a resume
    # from a slimmed save, or from one whose optimizer.pt was deleted, is examined like any other
    result = run_ckpt("doctor", trainer_runs / case, "--json")
    report = result.json["result"]
    if want is None:
        assert result.exit_code == 0, report["causes"]
        assert not [p for p in report["resume_points"] if p["resumed"]]
        return
    assert report["causes"][0]["id"] == want
    # every cause is at the resume: none at the next pair, no save's counters "inconsistent"
    assert {(c["before"], c["after"]) for c in report["causes"]} == {
        ("checkpoint-4", "checkpoint-6")
    }
    resumed = [(p["before"], p["after"]) for p in report["resume_points"] if p["resumed"]]
    assert resumed == [("checkpoint-4", "checkpoint-6")]
    if case == "optimizer_deleted":  # examined, and said so
        # the Trainer's own layout says it (it writes optimizer.pt with scheduler.pt)
        assert any(
            w.startswith("checkpoint-4: incomplete (") and "optimizer.pt is missing" in w
            for w in report["warnings"]
        ), report["warnings"]
    if want == "batch_changed":
        evidence = report["causes"][0]["evidence"]
        assert any("(×2.00): each step now processes more data" in e for e in evidence)
    if case == "slimmed":  # slimming drops rng_state.pth too: nothing to restore it from
        rng = [c for c in report["causes"] if c["id"] == "rng_not_restored"]
        assert [c["evidence"][0] for c in rng] == [
            "checkpoint-4 holds no RNG state (no rng_state.pth, which checkpoint-6 holds), "
            "slimmed by `ckpt prune`: the resume from checkpoint-4 had none to restore"
        ], report["causes"]


@pytest.mark.frameworks
@pytest.mark.timeout(1200)
def test_trainer_resumed_with_other_settings_names_the_setting(trainer_runs: Path) -> None:
    """Trainer runs resumed from checkpoint-4 with another data_seed, scheduler type, warm-up,
    max_steps or max_grad_norm, or from a save_only_model=True save: doctor said NO CAUSE FOUND
    (the settings live in training_args.bin and trainer_state.json, no state tensor), and for
    the weights-only save "save the scheduler's state", a plain loop's fix. One resumed with
    ignore_data_skip=True was found, its fix a list of every framework's."""

    def top(case: str) -> dict[str, Any]:
        result = run_ckpt("doctor", trainer_runs / case, "--json")
        assert result.exit_code == 1, result.stdout
        cause: dict[str, Any] = result.json["result"]["causes"][0]
        return cause

    seed = top("data_seed")
    assert seed["title"] == "the run was resumed with another data seed: another data order"
    assert seed["evidence"][0].startswith(
        "data_seed unset → 7 at the resume (training_args.bin of checkpoint-4 and "
        "checkpoint-6): the sampler shuffles with 7 (was 0)"
    ), seed["evidence"]
    assert "data_seed unset here" in seed["fix"]
    assert top("scheduler_type")["evidence"] == [
        "lr_scheduler_type linear at checkpoint-4, cosine at checkpoint-6 (training_args.bin)"
    ]
    assert top("warmup")["evidence"] == [
        "warmup_steps 2 at checkpoint-4, 4 at checkpoint-6 (training_args.bin)"
    ]
    extended = top("extended")
    assert extended["evidence"][0].startswith(
        "total steps 8 at checkpoint-4, 16 at checkpoint-6 (trainer_state.json max_steps): "
        "the linear schedule now runs over 16 steps"
    ), extended["evidence"]
    assert "--expect schedule" in extended["fix"]
    clip = top("grad_clip")
    assert clip["evidence"][0].startswith(
        "gradient clipping norm 1 at checkpoint-4, 0.1 at checkpoint-6 (training_args.bin "
        "max_grad_norm)"
    ), clip["evidence"]
    skipped = top("ignore_data_skip")  # found before; now the setting is named, and its fix
    assert skipped["evidence"][-1].startswith(
        "ignore_data_skip=True in checkpoint-6's training_args.bin"
    ), skipped["evidence"]
    assert skipped["fix"].startswith("Resume with ignore_data_skip=False")
    model_only = top("save_only_model")
    assert "save_only_model=True" in model_only["evidence"][0], model_only
    assert "Train with save_only_model=False" in model_only["fix"]
    declared = run_ckpt("doctor", trainer_runs / "extended", "--expect", "schedule", "--json")
    assert declared.exit_code == 0, declared.stdout
    assert [c["id"] for c in declared.json["result"]["causes"]] == ["schedule_changed"]


@pytest.mark.frameworks
@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_resumed_on_another_number_of_processes(tmp_path: Path) -> None:
    """A Trainer run on 2 processes (rng_state_0.pth, rng_state_1.pth), resumed on 1, where it
    reads rng_state.pth: its RNG is not restored. With the per-device batch doubled (the same
    global batch) doctor called it a batch change and missed the RNG (the Trainer records no
    world size); with the per-device batch kept it blamed a re-seeding and told to keep the
    files, and the data position it found had a plain loop's fix."""
    pytest.importorskip("transformers", reason="the job needs transformers (the frameworks extra)")
    base = tmp_path / "base"
    run_torchrun(TRAINER_DIST_JOB, 2, base, "2", timeout=600)
    assert (base / "checkpoint-4" / "rng_state_1.pth").is_file()
    for case, per_device in (("same_global_batch", "4"), ("half_global_batch", "2")):
        copy_saves(base, tmp_path / case, ["checkpoint-2", "checkpoint-4"])
        run_torchrun(TRAINER_DIST_JOB, 1, tmp_path / case, per_device, "checkpoint-4", timeout=600)
    rng_line = (
        "checkpoint-4 was saved by 2 process(es) (rng_state_0..1.pth files), checkpoint-6 by 1 "
        "(rng_state.pth): on 1 the Trainer loads rng_state.pth, which checkpoint-4 does not "
        "hold, so it resumed with freshly seeded random numbers"
    )
    same = run_ckpt("doctor", tmp_path / "same_global_batch", "--json").json["result"]
    assert [(c["id"], c["evidence"]) for c in same["causes"]] == [
        ("rng_not_restored", [rng_line])
    ], same["causes"]
    notes = [n for p in same["resume_points"] for n in p["notes"]]
    assert notes == [
        "per device batch 2 at checkpoint-4, 4 at checkpoint-6 (training_args.bin "
        "per_device_train_batch_size); world size 2 at checkpoint-4, 1 at checkpoint-6 "
        "(rng_state.pth / rng_state_0..1.pth files): the global batch is unchanged "
        "(checkpoint-4 → checkpoint-6)"
    ]
    half = run_ckpt("doctor", tmp_path / "half_global_batch", "--json").json["result"]
    causes = {c["id"]: c for c in half["causes"]}
    assert set(causes) == {"data_position_not_restored", "batch_changed", "rng_not_restored"}
    assert causes["rng_not_restored"]["evidence"] == [rng_line]
    assert "ckpt reshard checkpoint-4 OUT --world-size 1" in causes["rng_not_restored"]["fix"]
    assert causes["batch_changed"]["evidence"][0] == (
        "world size 2 at checkpoint-4, 1 at checkpoint-6 (rng_state.pth / rng_state_0..1.pth files)"
    )
    assert causes["data_position_not_restored"]["fix"].startswith(
        "Resume with the global batch the run had"
    )


@pytest.mark.frameworks
@pytest.mark.timeout(600)
def test_accelerate_scheduler_pace_and_an_unsaved_scheduler(
    tmp_path: Path,
) -> None:
    """accelerate under gradient accumulation steps a prepared scheduler once per optimizer
    step with `step_scheduler_with_optimizer=True`, on every micro-batch with it False. A run
    trained with it False was called inconsistent at every save (scheduler 2x the step); one
    resumed with the other setting got a "ran ahead: stepped again to catch up" fix, or
    nothing."""
    pytest.importorskip("accelerate", reason="the job needs accelerate (the frameworks extra)")
    out = _build("accelerate_pace", tmp_path / "job")
    for case, (_, want) in ACCELERATE_PACE.items():
        result = run_ckpt("doctor", out / case, "--json")
        causes = result.json["result"]["causes"]
        if want is None:
            assert result.exit_code == 0, (case, causes)
            # its loader is not stateful: no save says whether the resume skipped the batches
            # it had trained on, and "no cause" is said with that limit named
            assert result.json["result"]["warnings"] == [
                "step-4 → step-6: neither save records the data loader's position (accelerate "
                "saves it only for a stateful loader: DataLoaderConfiguration("
                "use_stateful_dataloader=True)): whether the resumed run skipped the batches it "
                "had trained on (accelerator.skip_first_batches) cannot be told from the files"
            ], case
            continue
        assert [(c["id"], c["before"], c["after"]) for c in causes] == [
            (want, "step-4", "step-6")
        ], (case, causes)
        faster = case == "per_micro_batch_at_resume"
        assert causes[0]["evidence"] == [
            "scheduler last_epoch per step: "
            + (
                "1 over step-2 → step-4; 2 over step-4 → step-6; 2 over step-6 → step-8: it is "
                "stepped 2 time(s) per step since the resume, 1 before"
                if faster
                else "2 over step-2 → step-4; 1 over step-4 → step-6; 1 over step-6 → step-8: "
                "it is stepped 1 time(s) per step since the resume, 2 before"
            )
        ], causes
        assert "step_scheduler_with_optimizer" in causes[0]["fix"]
    # a scheduler accelerate does not save: no log either, the optimizer's saved learning
    # rate shows the schedule started over (doctor said NO CAUSE FOUND)
    result = run_ckpt("doctor", out / "scheduler_unregistered", "--json")
    top = result.json["result"]["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "scheduler_not_restored",
        "step-4",
        "step-6",
    ), result.json["result"]["causes"]
    assert top["evidence"][0] == (
        "optimizer learning rate 0.008 at step-6, 2 steps after the resume from step-4 "
        "(0.006): the value step-2 held 2 steps from the run's start (warm-up again)"
    ), top["evidence"]
    assert "register_for_checkpointing" in top["fix"]


@pytest.mark.frameworks
@pytest.mark.timeout(600)
def test_accelerate_automatic_names_are_no_steps(tmp_path: Path) -> None:
    # `checkpoint_N` counts saves: neither shown as a step nor used as one in the evidence
    pytest.importorskip("accelerate", reason="the job needs accelerate (the frameworks extra)")
    out = _build("accelerate_auto", tmp_path / "job")
    result = run_ckpt("doctor", out / "checkpoints", "--json")
    report = result.json["result"]
    top = report["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "optimizer_not_restored",
        "checkpoint_1",
        "checkpoint_2",
    )
    assert top["evidence"][0].startswith(
        "optimizer step count 4 at checkpoint_1, 2 at checkpoint_2"
    )
    assert "would count" not in top["evidence"][0]  # no pace from save numbers
    assert {p["step_before"] for p in report["resume_points"]} == {None}
    text = run_ckpt("doctor", out / "checkpoints")
    assert "checkpoint_1 → checkpoint_2" in text.stdout and "(step" not in text.stdout


@pytest.mark.frameworks
@pytest.mark.timeout(1200)
def test_saves_many_steps_apart_are_no_stop(trainer_runs: Path, tmp_path: Path) -> None:
    # a straight run whose middle saves were rotated away: 80 s for 8 steps, then 20 s for 2,
    # the same 10 s a step; the longer gap is no resume
    run = tmp_path / "rotated"
    run.mkdir()
    start = trainer_runs.stat().st_mtime - DOWN_SECONDS
    for step in (2, 10, 12):
        save = run / f"checkpoint-{step}"
        shutil.copytree(trainer_runs / "short_last_batch" / save.name, save)
        for path in [*save.rglob("*"), save]:
            os.utime(path, (start + 10 * step, start + 10 * step))
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.json["result"]["causes"]
    assert [p["how"] for p in result.json["result"]["resume_points"]] == [[], []]


@pytest.mark.frameworks
@pytest.mark.timeout(1200)
def test_before_and_after_the_same_save_is_refused(trainer_runs: Path) -> None:
    run = trainer_runs / "short_last_batch"
    result = run_ckpt("doctor", run, "--before", "checkpoint-4", "--after", f"{run}/checkpoint-4/")
    assert result.exit_code == 2
    assert "--before and --after name the same save" in result.stderr


def _plain_loop(
    run: Path,
    resume: int | None,
    fault: str | None = None,
    *,
    until: int,
    save_scheduler: bool = True,
    zero_lr_steps: int = 0,
) -> None:
    """A plain training loop that `torch.save`s one dict per save (`run/ckpt_N.pt`: model,
    optimizer, scheduler, its own `samples_seen` counter and `rng_state` at the top level) every
    2 steps and appends `metrics.jsonl`; resumed from `ckpt_RESUME.pt` with `fault` planted."""
    import random

    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.0 if s < zero_lr_steps else min(1.0, (s + 1) / 4)
    )
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = samples_seen = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        if fault == "optimizer_from_2":  # the optimizer's path built from another step
            optimizer.load_state_dict(torch.load(run / "ckpt_2.pt")["optimizer"])
        else:
            optimizer.load_state_dict(saved["optimizer"])
        if "scheduler" in saved:
            scheduler.load_state_dict(saved["scheduler"])
        if fault == "scheduler_fast_forward":  # "catching up" a scheduler already restored
            for _ in range(saved["step"]):
                scheduler.step()
        step = saved["step"]
        if fault != "skip_data":
            samples_seen = saved["samples_seen"]
        torch.set_rng_state(saved["rng_state"])
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        start = samples_seen % 256
        loss = torch.nn.functional.mse_loss(model(xs[start : start + 8]), ys[start : start + 8])
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        samples_seen += 8
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr}) + "\n")
        if step % 2 == 0:
            state: dict[str, Any] = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "samples_seen": samples_seen,
                "rng_state": torch.get_rng_state(),
            }
            if save_scheduler:
                state["scheduler"] = scheduler.state_dict()
            torch.save(state, run / f"ckpt_{step}.pt")


def test_a_plain_loop_that_saves_no_scheduler_is_found_from_its_log(tmp_path: Path) -> None:
    """A plain loop saved its model and optimizer but not its warm-up scheduler: after a crash
    at step 5 and a resume from `ckpt_4.pt`, the learning rate went back to its step-1 value.
    The log showed it, and doctor said NO CAUSE FOUND (it looked only at scheduler state)."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=5, save_scheduler=False)  # crashed after step 5
    _plain_loop(run, 4, until=8, save_scheduler=False)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert top["id"] == "scheduler_not_restored", top
    assert (top["before"], top["after"]) == ("ckpt_4.pt", "ckpt_6.pt")
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the restored optimizer carried its last LR into step 5; the fresh scheduler set step 6's
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert logged[6]["lr"] == logged[1]["lr"] != logged[3]["lr"]  # warm-up again, truly
    assert any(
        "0.005 at step 6 (the value of step 2: warm-up again)" in line for line in top["evidence"]
    )
    assert any("hold no LR scheduler state" in line for line in top["evidence"])
    assert "scheduler.state_dict()" in top["fix"]

    # the same loop saving and restoring its scheduler: a clean resume, no cause
    clean = tmp_path / "clean"
    _plain_loop(clean, None, until=5)
    _plain_loop(clean, 4, until=8)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []
    assert any("log" in p["how"] for p in result.json["result"]["resume_points"])


def test_a_plain_loops_own_samples_counter_is_read(tmp_path: Path) -> None:
    """A plain `torch.save` dict keeps `samples_seen` at its top level; a resume that did not
    restore it replays the data it saw. doctor read counters only inside a `dataloader` /
    `train_state`... component and found no cause."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=5)
    _plain_loop(run, 4, "skip_data", until=8)
    saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True)["samples_seen"] for n in (4, 6)]
    assert saved == [32, 16]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert top["id"] == "data_position_not_restored", top
    assert (top["before"], top["after"]) == ("ckpt_4.pt", "ckpt_6.pt")
    assert "samples_seen 32 at ckpt_4.pt, 16 at ckpt_6.pt" in top["evidence"][0]


def _loader_loop(run: Path, key: str, restore: bool, *, pickled: bool = False) -> None:
    """A plain loop that keeps its loader position under `key` (`dataloader.position`,
    `dataloader.dp_rank_0.position`: the names ckpt's reshard docs show) in the dict it
    `torch.save`s every 2 steps, run to step 4 and resumed from `step-4` to step 8; the resume
    restores model and optimizer, and the scheduler, RNG and loader position only if `restore`."""
    import pickle

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return model, opt, sched

    def nest(position: int) -> dict[str, Any]:
        *homes, leaf = key.split(".")
        value: Any = {leaf: position}
        for i, home in enumerate(reversed(homes)):
            value = {home: pickle.dumps(value) if pickled and i == 0 else value}
        return dict(value)

    def train(model: Any, opt: Any, sched: Any, start: int, position: int) -> None:
        for step in range(start, start + 4):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            position += 4
            if (step + 1) % 2 == 0:
                folder = run / f"step-{step + 1}"
                folder.mkdir(parents=True)
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": torch.get_rng_state(),
                    "step": step + 1,
                    **nest(position),
                }
                torch.save(state, folder / "checkpoint.pt")

    train(*build(), 0, 0)
    model, opt, sched = build()
    saved = torch.load(run / "step-4" / "checkpoint.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    position = 0
    if restore:
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        position = 16
    train(model, opt, sched, 4, position)


@pytest.mark.parametrize(
    ("key", "pickled"),
    [
        ("dataloader.position", False),
        ("dataloader.dp_rank_0.position", False),
        ("data_loader.pos", False),
        ("loader.index", False),
        ("dataloader.step", False),
        ("dataloader.dp_rank_0.position", True),  # torchtitan: the rank's state pickled
    ],
)
@pytest.mark.slow
def test_a_plain_loops_loader_position_is_read(tmp_path: Path, key: str, pickled: bool) -> None:
    """A plain loop keeps its loader position as `dataloader.position` (or per rank,
    `dataloader.dp_rank_0.position`, as ckpt's reshard docs show it); resumed without its
    scheduler, RNG and loader position, doctor named the scheduler and the RNG but not the
    replayed data: it read only `samples_seen`-like names. A resume that restored all three
    is clean."""
    run = tmp_path / "run"
    _loader_loop(run, key, restore=False, pickled=pickled)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = {c["id"]: c for c in result.json["result"]["causes"]}
    assert {"scheduler_not_restored", "rng_not_restored", "data_position_not_restored"} <= set(
        causes
    ), list(causes)
    data = causes["data_position_not_restored"]
    assert (data["before"], data["after"]) == ("step-4", "step-6")
    assert data["evidence"][0].startswith(f"{key} 16 at step-4, 8 at step-6"), data["evidence"]

    clean = tmp_path / "clean"
    _loader_loop(clean, key, restore=True, pickled=pickled)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_the_checkpointers_rng_value_is_checked(tmp_path: Path) -> None:
    """The ckpt Checkpointer saved `"rng": torch.get_rng_state()` as one entry `rng`; a resume
    that seeded again instead of restoring it was not found: doctor read RNG streams only
    inside an `rng.` component."""
    from ckpt_cli import Checkpointer

    def train(until: int, restore_rng: bool) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        checkpointer = Checkpointer(tmp_path / "run")
        into = {"model": model, "optimizer": optimizer, "rng": torch.get_rng_state()}
        loaded = checkpointer.load_latest(into=into)
        step = loaded.step if loaded else 0
        if loaded and restore_rng:
            torch.set_rng_state(into["rng"])
        while step < until:
            step += 1
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 0:
                state = {"model": model, "optimizer": optimizer, "rng": torch.get_rng_state()}
                checkpointer.save(step, state)
        checkpointer.close()

    train(4, restore_rng=True)
    train(6, restore_rng=False)  # seeded again by `manual_seed(0)`, the saved state unused
    result = run_ckpt(
        "doctor", "--before", tmp_path / "run/step-4", "--after", tmp_path / "run/step-6", "--json"
    )
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [c["id"] for c in causes] == ["rng_not_restored"], causes
    assert "torch's CPU generator" in causes[0]["evidence"][0]

    # restored, a resume from step-6 carries on: no cause
    train(8, restore_rng=True)
    result = run_ckpt(
        "doctor", "--before", tmp_path / "run/step-6", "--after", tmp_path / "run/step-8", "--json"
    )
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_an_optimizer_restored_from_another_save_is_named(tmp_path: Path) -> None:
    """A resume from `ckpt_4.pt` that loaded the optimizer of `ckpt_2.pt` (its path built from
    another step): doctor said only that the later saves' counters disagree (twice, one per
    save), not which resume loaded what. It now names the save the optimizer came from."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=5)
    _plain_loop(run, 4, "optimizer_from_2", until=8)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [c["id"] for c in causes] == ["optimizer_not_restored"], causes
    top = causes[0]
    assert (top["before"], top["after"]) == ("ckpt_4.pt", "ckpt_6.pt")
    assert "ckpt_2.pt's, not ckpt_4.pt's" in top["title"]
    saved = torch.load(run / "ckpt_6.pt", weights_only=True)["optimizer"]["state"][0]["step"]
    assert int(saved) == 4  # 2 restored + 2 trained: neither 6 (restored) nor 2 (fresh)
    assert "resumed with counted 2, the count of ckpt_2.pt (step 2)" in top["evidence"][0]


def test_a_scheduler_stepped_again_after_its_restore_is_found_at_the_resume(
    tmp_path: Path,
) -> None:
    """A resume that restored the scheduler and then stepped it as many times as the run had
    trained, to "catch up": its schedule runs 4 steps ahead from there. doctor said only that
    `ckpt_6.pt`'s and `ckpt_8.pt`'s counters disagree, twice, with a fix about state restored
    from elsewhere; not the resume, nor what ran ahead."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=5)
    _plain_loop(run, 4, "scheduler_fast_forward", until=8)
    saved = torch.load(run / "ckpt_6.pt", weights_only=True)["scheduler"]["last_epoch"]
    assert saved == 10  # 4 restored + 4 again + 2 trained
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("inconsistent_state", "ckpt_4.pt", "ckpt_6.pt")
    ], causes
    top = causes[0]
    assert (
        top["title"] == "the LR scheduler ran ahead at the resume: it was stepped more "
        "often than the run trained"
    )
    assert top["evidence"][0] == (
        "scheduler last_epoch 4 at ckpt_4.pt, 10 at ckpt_6.pt, 2 steps later: restored it "
        "would be 6; it runs 4 steps ahead of the run (step 6)"
    )
    assert "without stepping it again" in top["fix"]


def test_weights_that_adam_steps_at_learning_rate_zero_are_no_mixed_save(tmp_path: Path) -> None:
    """A run that warms Adam's moments up at learning rate 0 for its first 4 steps saves the
    same weights at steps 2 and 4 while the optimizer counts on: no save mixed from two."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=8, zero_lr_steps=4)
    weights = [torch.load(run / f"ckpt_{n}.pt", weights_only=True)["model"] for n in (2, 4)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


@pytest.mark.parametrize("component", ["optimizer", "model"])
@pytest.mark.parametrize(("source", "into"), [(4, 6), (2, 4)])
@pytest.mark.slow
def test_a_save_holding_an_earlier_saves_state_is_found(
    tmp_path: Path, component: str, source: int, into: int
) -> None:
    """`ckpt_6.pt` put together from two saves: its optimizer (or its weights) are
    `ckpt_4.pt`'s. The weights case was NO CAUSE FOUND; the optimizer case only "the save's
    step counters disagree" for `ckpt_6.pt`, not where its state came from. `ckpt_4.pt` holding
    the first save's optimizer, whose count (2) is a fresh optimizer's two steps after it, was
    "not restored: the second moments started over" at a resume that never was, beside the
    same second moments (×1.00)."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=8)
    mixed = torch.load(run / f"ckpt_{into}.pt", weights_only=True)
    mixed[component] = torch.load(run / f"ckpt_{source}.pt", weights_only=True)[component]
    torch.save(mixed, run / f"ckpt_{into}.pt")
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [c["id"] for c in causes] == ["inconsistent_state"], causes
    top = causes[0]
    assert (top["before"], top["after"]) == (f"ckpt_{source}.pt", f"ckpt_{into}.pt")
    what = "weights" if component == "model" else "optimizer state"
    assert top["title"] == (
        f"ckpt_{into}.pt holds ckpt_{source}.pt's {what}: the save mixes state of two saves"
    )
    assert f"resume from ckpt_{source}.pt" in top["fix"]
    points = result.json["result"]["resume_points"]
    assert [p["how"] for p in points if p["after"] != f"ckpt_{into}.pt"] == [[]] * 2


@pytest.mark.frameworks
def test_a_final_save_holding_the_save_befores_weights_is_found(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """A Trainer's linear schedule ends at learning rate 0: the optimizer of its last save,
    `checkpoint-4`, holds LR 0 for the step that never comes. Its weights put together from
    `checkpoint-2` were NO CAUSE FOUND (the LR 0 saved there was taken for steps taken at LR 0);
    the steps between the saves ran at the LR `checkpoint-2` holds."""
    from safetensors.torch import load_file

    run = tmp_path / "out"
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(real_trainer_run / "straight" / name, run / name)
    lr = torch.load(run / "checkpoint-4" / "optimizer.pt", weights_only=True)["param_groups"]
    assert lr[0]["lr"] == 0.0  # the schedule's end
    shutil.copy2(run / "checkpoint-2" / "model.safetensors", run / "checkpoint-4")
    mixed = load_file(run / "checkpoint-4" / "model.safetensors")
    real = load_file(real_trainer_run / "straight" / "checkpoint-4" / "model.safetensors")
    assert any(not torch.equal(mixed[k], real[k]) for k in real)

    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [c["id"] for c in causes] == ["inconsistent_state"], causes
    top = causes[0]
    assert (top["before"], top["after"]) == ("checkpoint-2", "checkpoint-4")
    assert top["title"] == (
        "checkpoint-4 holds checkpoint-2's weights: the save mixes state of two saves"
    )
    # the straight run is no mixed save
    clean = run_ckpt("doctor", real_trainer_run / "straight", "--json")
    assert clean.exit_code == 0, clean.stdout
    assert clean.json["result"]["causes"] == []


@pytest.mark.frameworks
def test_a_trainer_save_holding_the_save_befores_scheduler_is_found(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """`checkpoint-4` put together with `checkpoint-2`'s `scheduler.pt`: its count (2) is what
    a fresh scheduler would count two steps after a resume from `checkpoint-2`, and doctor said
    "the LR scheduler was not restored: its schedule started over at the resume", though
    nothing stopped and the Trainer's own log shows the schedule carrying on."""
    run = tmp_path / "out"
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(real_trainer_run / "straight" / name, run / name)
    shutil.copy2(run / "checkpoint-2" / "scheduler.pt", run / "checkpoint-4" / "scheduler.pt")
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("inconsistent_state", "checkpoint-2", "checkpoint-4")
    ], causes
    top = causes[0]
    assert top["title"] == (
        "checkpoint-4 holds checkpoint-2's scheduler state: the save mixes state of two saves"
    )
    assert "no warm-up again" in top["evidence"][0]
    assert "resume from checkpoint-2" in top["fix"]


@pytest.mark.frameworks
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("source", "into"), [(6, 4), (4, 6)])
def test_a_trainer_state_of_another_save_is_named(
    trainer_runs: Path, tmp_path: Path, source: int, into: int
) -> None:
    """A Trainer save holding another save's `trainer_state.json` (files of two saves put
    together): its `global_step` is not the step the Trainer named the save after. doctor took
    that global_step for the save's step: `checkpoint-4` holding `checkpoint-6`'s was "the
    global batch changed" (the file's total_flos) and "the optimizer was not restored" at a
    resume that never was; `checkpoint-6` holding `checkpoint-4`'s was only "counters
    disagree", the file not named."""
    run = tmp_path / "out"
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        shutil.copytree(trainer_runs / "base" / name, run / name)
    shutil.copy2(
        run / f"checkpoint-{source}" / "trainer_state.json",
        run / f"checkpoint-{into}" / "trainer_state.json",
    )
    state = json.loads((run / f"checkpoint-{into}" / "trainer_state.json").read_text())
    assert state["global_step"] == source

    for target in (run, run / f"checkpoint-{into}"):
        result = run_ckpt("doctor", target, "--json")
        assert result.exit_code == 1, result.stdout
        causes = result.json["result"]["causes"]
        assert [(c["id"], c["after"]) for c in causes] == [
            ("inconsistent_state", f"checkpoint-{into}")
        ], causes
        top = causes[0]
        assert top["evidence"][0] == (
            f"trainer_state.json global_step {source} in checkpoint-{into}, which the Trainer "
            f"named after its global_step {into}: the file is another save's"
        )
        assert f"checkpoint-{into}'s trainer_state.json is another save's" in top["fix"]
    steps = [(p["step_before"], p["step_after"]) for p in result.json["result"]["resume_points"]]
    assert steps == [] or steps == [(2, 4), (4, 6)]


@pytest.mark.frameworks
def test_a_save_whose_optimizer_file_is_unreadable_is_not_called_resumable(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """`checkpoint-2`'s `optimizer.pt` overwritten with other bytes (a bad disk, a copy cut
    and padded): `torch.load` of it fails, so a resume from it stops there, and `verify` fails
    it. `doctor checkpoint-2` said "can resume consistently" and the run "state continuous",
    neither naming the file: the optimizer was left out of the examination in silence."""
    run = tmp_path / "out"
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(real_trainer_run / "straight" / name, run / name, copy_function=shutil.copy)
    broken = run / "checkpoint-2" / "optimizer.pt"
    broken.write_bytes(bytes(range(256)) * (broken.stat().st_size // 256 + 1))
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, the resume stops
        torch.load(broken, weights_only=True)

    single = run_ckpt("doctor", run / "checkpoint-2", "--json")
    assert single.exit_code == 0, single.stdout
    report = single.json["result"]
    assert "can resume consistently" not in report["verdict"]
    assert "optimizer.pt" in report["verdict"], report["verdict"]
    assert any(
        "checkpoint-2/optimizer.pt" in w and "not a torch.save file" in w
        for w in report["warnings"]
    ), report["warnings"]

    whole = run_ckpt("doctor", run, "--json")
    assert whole.exit_code == 0, whole.stdout
    assert any("checkpoint-2/optimizer.pt" in w for w in whole.json["result"]["warnings"])
    assert "checkpoint-2/optimizer.pt" in run_ckpt("doctor", run).stderr


def _accumulating_loop(run: Path, resume: int | None, *, fresh_optimizer: bool = False) -> None:
    """A plain loop that counts micro-batches (`step`) and steps its optimizer and scheduler
    once per 4 of them (gradient accumulation), `torch.save`s `ckpt_{step}.pt` every 8 and
    stops at 32; resumed from `ckpt_{resume}.pt` (with a fresh optimizer: `fresh_optimizer`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        if not fresh_optimizer:
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step = saved["step"]
    run.mkdir(parents=True, exist_ok=True)
    while step < 32:
        step += 1
        start = step * 8 % 256
        loss = torch.nn.functional.mse_loss(model(xs[start : start + 8]), ys[start : start + 8])
        (loss / 4).backward()
        if step % 4 == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if step % 8 == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
            }
            torch.save(state, run / f"ckpt_{step}.pt")


@pytest.mark.slow
def test_a_loop_counting_micro_batches_is_no_inconsistent_save(tmp_path: Path) -> None:
    """A loop whose `step` counts micro-batches, its optimizer stepping once per 4 (gradient
    accumulation), as the doctor's own "another save's optimizer" check allows for: every
    save of a straight run was "inconsistent_state: optimizer step count 2, trainer step 8".
    The same ratio in every save of the run is the loop's counting; a resume that started
    the optimizer over is still found."""
    straight = tmp_path / "straight"
    _accumulating_loop(straight, None)
    saved = torch.load(straight / "ckpt_16.pt", weights_only=True)
    assert int(saved["optimizer"]["state"][0]["step"]) == 4 and saved["step"] == 16
    result = run_ckpt("doctor", straight, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []

    resumed = tmp_path / "resumed"
    _accumulating_loop(resumed, None)
    for name in ("ckpt_24.pt", "ckpt_32.pt"):
        (resumed / name).unlink()
    _accumulating_loop(resumed, 16, fresh_optimizer=True)
    result = run_ckpt("doctor", resumed, "--json")
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "optimizer_not_restored",
        "ckpt_16.pt",
        "ckpt_24.pt",
    ), top


def test_a_lost_rank_rng_file_is_found_against_the_runs_other_saves(tmp_path: Path) -> None:
    """A 2-rank Trainer run keeps `rng_state_0.pth` and `rng_state_1.pth` in every save; one
    save lost `rng_state_1.pth`. The Trainer records no world size, so doctor (run or single
    save) said NO CAUSE FOUND / "can resume consistently". Its neighbours in the same process
    now say which rank's file is missing; a resume on 1 rank (a restart between the saves) loses
    no file (what it changes is another finding)."""
    from .run_fixtures import trainer_checkpoint

    def build(run: Path, ranks: dict[int, tuple[int, ...]]) -> None:
        streams = {r: torch.Generator().manual_seed(r) for r in (0, 1)}
        for step, kept in ranks.items():
            folder = run / f"checkpoint-{step}"
            trainer_checkpoint(folder, step)
            (folder / "rng_state.pth").unlink()
            for rank, stream in streams.items():
                torch.rand(64, generator=stream)  # the steps' draws
                if rank in kept:
                    # what the Trainer writes per process (`rng_state_{process_index}.pth`)
                    torch.save({"cpu": stream.get_state()}, folder / f"rng_state_{rank}.pth")
        # saved an hour ago: a save that lost a file is incomplete, not one still being written
        for path in [*run.rglob("*"), run]:
            stat = path.stat()
            os.utime(path, (stat.st_atime - 3600, stat.st_mtime - 3600))

    lost = tmp_path / "lost"
    build(lost, {100: (0, 1), 200: (0,), 300: (0, 1)})
    result = run_ckpt("doctor", lost, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["after"]) for c in causes] == [("rng_ranks_missing", "checkpoint-200")]
    assert "rank 1 missing (rng_state_1.pth at checkpoint-100)" in causes[0]["evidence"][0]
    assert "restore rng_state_1.pth" in causes[0]["fix"]

    # the newest save lost it: found against the save before
    build(newest := tmp_path / "newest", {100: (0, 1), 200: (0, 1), 300: (0,)})
    causes = run_ckpt("doctor", newest, "--json").json["result"]["causes"]
    assert [(c["id"], c["after"]) for c in causes] == [("rng_ranks_missing", "checkpoint-300")]

    # every save whole: no cause
    build(whole := tmp_path / "whole", {100: (0, 1), 200: (0, 1), 300: (0, 1)})
    result = run_ckpt("doctor", whole, "--json")
    assert result.exit_code == 0 and result.json["result"]["causes"] == [], result.stdout

    # resumed on 1 rank after a stop (the earlier saves an hour old): fewer states, no loss;
    # the Trainer on one process writes `rng_state.pth`
    build(fewer := tmp_path / "fewer", {100: (0, 1), 200: (0, 1), 300: (0,)})
    (fewer / "checkpoint-300" / "rng_state_0.pth").rename(
        fewer / "checkpoint-300" / "rng_state.pth"
    )
    for name in ("checkpoint-100", "checkpoint-200"):
        for path in [*(fewer / name).rglob("*"), fewer / name]:
            stat = path.stat()
            os.utime(path, (stat.st_atime - DOWN_SECONDS, stat.st_mtime - DOWN_SECONDS))
    result = run_ckpt("doctor", fewer, "--json")
    points = result.json["result"]["resume_points"]
    assert [p["how"][0] for p in points if p["how"]] == ["time"]
    # no rank's file is called lost; what a resume on 1 process does is found (the world size
    # read from the RNG files): the global batch halved, and no rng_state.pth to restore
    causes = result.json["result"]["causes"]
    assert sorted((c["id"], c["before"]) for c in causes) == [
        ("batch_changed", "checkpoint-200"),
        ("rng_not_restored", "checkpoint-200"),
    ], causes


def _overflowed(run: Path, out: Path) -> None:
    """`run`'s saves as an fp16 run whose loss scale overflowed on both steps after
    global_step4 writes them: DeepSpeed skips the optimizer and scheduler steps and counts them
    in `skipped_steps`, so global_step6 holds global_step4's weights and optimizer state. doctor
    called that an inconsistent save (optimizer step count 4, trainer step 6)."""
    shutil.copytree(run, out)
    optim = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy2(out / "global_step4" / optim, out / "global_step6" / optim)
    four = torch.load(out / "global_step4/mp_rank_00_model_states.pt", weights_only=False)
    six = torch.load(out / "global_step6/mp_rank_00_model_states.pt", weights_only=False)
    six.update(module=four["module"], lr_scheduler=four["lr_scheduler"], skipped_steps=2)
    torch.save(six, out / "global_step6/mp_rank_00_model_states.pt")
    result = run_ckpt("doctor", out, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


@pytest.mark.frameworks
@pytest.mark.torchrun
@pytest.mark.timeout(1200)
def test_deepspeed_scheduler_not_restored(tmp_path: Path) -> None:
    """A DeepSpeed run resumed with `load_checkpoint(load_lr_scheduler_states=False)`: its
    WarmupLR counts `last_batch_iteration`, not `last_epoch`, and doctor said NO CAUSE FOUND."""
    job = Path(__file__).with_name("doctor_deepspeed_job.py")
    for case in ("clean", "skip_scheduler"):
        run = tmp_path / case
        run_torchrun(job, 1, run, "fresh", timeout=600)
        for path in run.rglob("*"):  # the crashed job's saves, an hour old
            stat = path.stat()
            os.utime(path, (stat.st_atime - DOWN_SECONDS, stat.st_mtime - DOWN_SECONDS))
        run_torchrun(job, 1, run, case, timeout=600)
        iterations = [
            torch.load(run / f"global_step{n}/mp_rank_00_model_states.pt", weights_only=False)[
                "lr_scheduler"
            ]["last_batch_iteration"]
            for n in (4, 6)
        ]
        result = run_ckpt("doctor", run, "--json")
        causes = result.json["result"]["causes"]
        if case == "clean":
            assert iterations == [3, 5]
            assert result.exit_code == 0 and causes == [], result.stdout
            _overflowed(run, tmp_path / "overflowed")
            continue
        assert iterations == [3, 1]  # started over at the resume
        assert result.exit_code == 1, result.stdout
        assert [c["id"] for c in causes] == ["scheduler_not_restored"], causes
        assert (causes[0]["before"], causes[0]["after"]) == ("global_step4", "global_step6")
        assert causes[0]["evidence"][0].startswith(
            "scheduler steps (last_batch_iteration + 1) 4 at global_step4, 2 at global_step6"
        )


def test_before_and_after_given_the_other_way_round_are_refused(tmp_path: Path) -> None:
    """`--before ckpt_6.pt --after ckpt_4.pt` (swapped by mistake) on a clean run: doctor
    ranked every counter that "went back" as a cause (optimizer, scheduler...), exit 1. It now refuses
    the pair (exit 2) and says to swap them; a resumed save whose step counter started over
    (fewer steps, written later) is still examined."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=8)
    four, six = run / "ckpt_4.pt", run / "ckpt_6.pt"
    os.utime(four, (four.stat().st_atime - 60, four.stat().st_mtime - 60))
    result = run_ckpt("doctor", "--before", six, "--after", four, "--json")
    assert result.exit_code == 2, result.stdout
    assert result.json["error"]["code"] == "usage"
    assert result.json["error"]["fix"] == f"Swap them: --before {four} --after {six}."
    assert run_ckpt("doctor", "--before", four, "--after", six).exit_code == 0

    # the resumed run's own step counter restarted: it saved "step 2" after step 4's save
    restarted = torch.load(six, weights_only=True)
    restarted["step"] = 2
    torch.save(restarted, six)
    result = run_ckpt("doctor", "--before", four, "--after", six, "--json")
    assert result.exit_code != 2, result.stdout
    assert result.json["result"]["resume_points"][0]["step_after"] == 2


@pytest.mark.frameworks
@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_deepspeed_world_size_change_reads_the_samples_counted(tmp_path: Path) -> None:
    """A DeepSpeed run trained on 2 ranks, its newest save resharded to 1 rank (`ckpt reshard
    --world-size 1`, which records the new world size in it) and resumed there: with the
    micro-batch kept the global batch halves under the same learning rate, and doctor said NO
    CAUSE FOUND. DeepSpeed's `global_samples` now gives the work per step; with 2 micro-batches
    of accumulation the global batch is kept and there is no cause."""
    job = Path(__file__).with_name("doctor_deepspeed_job.py")
    base = tmp_path / "base"
    run_torchrun(job, 2, base, "fresh", timeout=600)
    resharded = tmp_path / "resharded"
    result = run_ckpt("reshard", base, resharded, "--world-size", "1", "--json")
    assert result.exit_code == 0, result.stdout
    for mode in ("clean", "accum2"):
        run = tmp_path / mode
        run.mkdir()
        shutil.copytree(base / "global_step2", run / "global_step2")
        shutil.copytree(resharded / "global_step4", run / "global_step4")
        shutil.copy2(resharded / "latest", run / "latest")
        for path in [*run.rglob("*")]:  # the stopped job's saves, an hour old
            stat = path.stat()
            os.utime(path, (stat.st_atime - DOWN_SECONDS, stat.st_mtime - DOWN_SECONDS))
        run_torchrun(job, 1, run, mode, timeout=600)
        samples = [
            torch.load(run / f"global_step{n}/mp_rank_00_model_states.pt", weights_only=False)[
                "global_samples"
            ]
            for n in (2, 4, 6)
        ]
        result = run_ckpt("doctor", run, "--json")
        causes = result.json["result"]["causes"]
        if mode == "accum2":
            assert samples == [8, 16, 24]  # 4 samples a step throughout
            assert result.exit_code == 0 and causes == [], result.stdout
            continue
        assert samples == [8, 16, 20]  # 4 samples a step on 2 ranks, 2 on 1
        assert result.exit_code == 1, result.stdout
        assert [c["id"] for c in causes] == ["batch_changed"], causes
        assert (causes[0]["before"], causes[0]["after"]) == ("global_step4", "global_step6")
        assert causes[0]["evidence"] == [
            "model_states.global_samples per step 4 over global_step2 → global_step4, 2 over "
            "global_step4 → global_step6 (×0.50): each step now processes less data",
            "global batch ×0.5 but the learning rate ×1 (0.01 → 0.01): not rescaled with it",
        ]


def test_a_run_whose_saves_are_all_incomplete_names_them_and_a_fix_that_helps(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A Trainer output_dir whose `checkpoint-N/` hold the weights `save_pretrained` wrote but
    no `trainer_state.json` yet (written last): doctor said "holds no complete checkpoint to
    examine. Point at the folder holding the run's step checkpoints", which the user had
    done. It names each save and what it lacks, says to wait while one is being written, and
    points at `ckpt inspect` and --before/--after."""
    run = tmp_path / "out"
    for step in (2, 4):
        shutil.copytree(tiny_llama, run / f"checkpoint-{step}")
    for written in run.rglob("*"):
        os.utime(written)  # written just now (copytree keeps the fixture's older times)
    fresh = run_ckpt("doctor", run, "--json")
    assert fresh.exit_code == 3, fresh.stdout
    error = fresh.json["error"]
    assert "checkpoint-2: writing" in error["message"]
    assert "no trainer_state.json" in error["message"]
    assert "--settle 0" in error["fix"] and f"ckpt inspect {run}" in error["fix"]
    assert "Point at the folder holding" not in error["fix"]
    settled = run_ckpt("doctor", run, "--settle", "0", "--json")
    assert settled.exit_code == 3, settled.stdout
    error = settled.json["error"]
    assert "checkpoint-2: incomplete" in error["message"]
    assert "checkpoint-4: incomplete" in error["message"]
    assert "--settle" not in error["fix"] and "--before and --after" in error["fix"]


def test_one_save_interval_longer_than_the_only_other_is_no_stop_in_a_straight_run(
    tmp_path: Path,
) -> None:
    """A straight run of three saves (two intervals), the second a few seconds longer than the
    first (the first save of a tiny run is quick, a later one waits on a log flush): doctor
    called the second a stop and resume (`how: ["time"]`) against a baseline of one interval.
    With one interval to compare with, a gap is a stop only when it is past it by minutes, as
    a job's restart is (the hour-long stop of the rank test above still is)."""
    run = tmp_path / "run"
    _plain_loop(run, None, until=6)
    start = time.time() - 600
    for offset, name in ((0.0, "ckpt_2.pt"), (0.5, "ckpt_4.pt"), (4.0, "ckpt_6.pt")):
        os.utime(run / name, (start + offset, start + offset))
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.stdout
    assert [p["how"] for p in result.json["result"]["resume_points"]] == [[], []]
    # the same run stopped for ten minutes before its last save: a stop
    os.utime(run / "ckpt_6.pt", (start + 600.5, start + 600.5))
    result = run_ckpt("doctor", run, "--json")
    assert [p["how"] for p in result.json["result"]["resume_points"]] == [[], ["time"]]
