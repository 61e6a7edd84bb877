"""DeepSpeed ZeRO-2 and ZeRO-3 checkpoints written by DeepSpeed itself (2 ranks, gloo, CPU):
ckpt rebuilds the fp32 weights one parameter at a time, bit-identical to DeepSpeed's own
`zero_to_fp32`, demands every rank's partition, and converts the whole folder losslessly."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, run_ckpt
from .dist_helpers import run_torchrun

pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed: `make frameworks` installs it (DS_BUILD_OPS=0)",
)

# a session fixture's torchrun runs (600-900 s limits of their own) are set up inside the first
# test that asks for them: pytest's default 300 s stopped them under load
pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(1800)]
SCRIPT = Path(__file__).resolve().parent / "deepspeed_script.py"


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zero1/`, `zero2/` and `zero3/` run folders saved by `engine.save_checkpoint` after two
    bf16 steps."""
    out = tmp_path_factory.mktemp("deepspeed")
    run_torchrun(SCRIPT, 2, out, timeout=600)
    return out


def _reference(run: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own reconstruction (what `zero_to_fp32.py` writes)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(run))
    return {k: v.contiguous() for k, v in state.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_weights_are_rebuilt_bit_exact(zero_runs: Path, stage: int, tmp_path: Path) -> None:
    run = zero_runs / f"zero{stage}"
    expected = _reference(run)
    report = run_ckpt("inspect", run, "--json").json["result"]
    training = report["training"]
    assert training["layout"] == "deepspeed" and training["step"] == 2
    # 357 trainable parameters (not the empty ZeRO-3 placeholders) plus the 3-element buffer
    assert training["weights"]["tensors"] == len(expected) == 5
    assert training["weights"]["parameters"] == sum(t.numel() for t in expected.values()) == 360
    # the stage the save records (a ZeRO-1 save was called ZeRO-2)
    assert f"rebuilt from 2 ZeRO-{stage} partitions" in training["components"]["model"]
    # the parameters are the rebuilt weights', not those plus the bf16 module's copy of them
    assert report["parameters"] == 360
    assert "model_states" in report["state_elements"]

    out = tmp_path / "weights.safetensors"
    result = run_ckpt("convert", run, out, "--to", "safetensors", "--select", "model")
    assert result.exit_code == 0, result.stderr
    got = load_file(out)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype == torch.float32
        assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), name
    # into a folder, the model is carried without DeepSpeed's tools for the save it left
    # (`zero_to_fp32.py` beside weights that are no ZeRO partitions), listed as left out
    folder = tmp_path / "weights"
    result = run_ckpt("convert", run, folder, "--to", "safetensors", "--select", "model", "--json")
    assert result.exit_code == 0, result.stdout
    assert not list(folder.glob("zero_to_*.py"))
    skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    assert "not of the model" in skipped["zero_to_fp32.py"], skipped
    # the fp32 master weights, not the bf16 copies the engine trained with
    if stage in (1, 2):
        model_states = torch.load(
            next(run.glob("global_step*/mp_rank_00_model_states.pt")), weights_only=False
        )
        assert model_states["module"]["0.weight"].dtype == torch.bfloat16


def test_inspect_shows_where_deepspeeds_own_lr_scheduler_stands(zero_runs: Path) -> None:
    """DeepSpeed's WarmupLR keeps its count as `last_batch_iteration` (not torch's
    `last_epoch`): `inspect` showed the scheduler as `entries=1`, no count a user could check
    against the step."""
    run = zero_runs / "zero2"
    saved = torch.load(run / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["lr_scheduler"] == {"last_batch_iteration": 1}
    result = run_ckpt("inspect", run, "--json")
    assert result.json["result"]["training"]["scheduler"] == {"last_batch_iteration": 1}
    assert "scheduler    last_batch_iteration=1" in run_ckpt("inspect", run).stdout


def test_a_missing_rank_partition_fails_plain_verify(zero_runs: Path, tmp_path: Path) -> None:
    for stage in (2, 3):
        run = shutil.copytree(zero_runs / f"zero{stage}", tmp_path / f"zero{stage}")
        assert run_ckpt("verify", run).exit_code == 0
        lost = next(run.glob("global_step*/*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        lost.unlink()
        result = run_ckpt("verify", run, "--json")
        assert result.exit_code == 1
        problems = result.json["result"]["problems"]
        missing = [p for p in problems if p["code"] == "missing_partition"]
        assert len(missing) == 1 and lost.name in missing[0]["message"]
        assert "dp_world_size" in missing[0]["message"]
        # and what to do: the rank's file copied again, or the previous checkpoint resumed
        fix = missing[0]["fix"]
        assert f"Copy {lost.name} again" in fix and "`ckpt latest RUN_DIR`" in fix
        assert f"every rank's partition is needed to rebuild the weights or resume. {fix}" in (
            run_ckpt("verify", run).stdout
        )
        # nothing to rebuild the weights from: `--select model` says so instead of inventing
        result = run_ckpt(
            "convert",
            run,
            tmp_path / f"w{stage}.safetensors",
            "--to",
            "safetensors",
            "--select",
            "model",
        )
        assert result.exit_code == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_a_save_that_lost_a_rank_partition_is_neither_converted_nor_recut_whole(
    zero_runs: Path, tmp_path: Path, stage: int
) -> None:
    """`verify` fails a save without rank 1's partition (`missing_partition`), but `convert`
    wrote the whole folder without it, exit 0: an output DeepSpeed cannot resume and nothing
    rebuilds the weights of. `convert` and `reshard` refuse it as they refuse any lost file of
    a training save, naming the file."""
    run = shutil.copytree(zero_runs / f"zero{stage}", tmp_path / f"zero{stage}")
    lost = next(run.glob("global_step*/*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    lost.unlink()
    out = tmp_path / "out"
    for command in (
        ("convert", run, out, "--to", "dcp"),
        ("reshard", run, out, "--world-size", "1"),
    ):
        refused = run_ckpt(*command, "--json")
        assert refused.exit_code == 4, (command, refused.stdout)
        error = refused.json["error"]
        assert error["path"] == str(lost), error
        assert "missing_partition" in error["message"] and "dp_world_size" in error["message"]
        assert not out.exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_save_that_lost_a_rank_partition_is_never_the_latest_nor_kept_by_prune(
    zero_runs: Path, tmp_path: Path, stage: int
) -> None:
    """The newest `global_stepN/` lost rank 1's optimizer partition (a node's disk), though
    `latest` names it: every file left passes its own check, but the save cannot be resumed.
    `ckpt latest` used to name it and `prune --keep-last 1 --yes` deleted the only whole save."""
    from .run_fixtures import age

    run = shutil.copytree(zero_runs / f"zero{stage}", tmp_path / "run")
    saved = next(run.glob("global_step*"))
    newest = shutil.copytree(saved, run / "global_step4")
    (run / "latest").write_text("global_step4")
    lost = next(newest.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    lost.unlink()
    age(run)
    rows = run_ckpt("latest", run, "--json").json["result"]
    by_name = {c["name"]: c for c in rows["checkpoints"]}
    assert by_name["global_step4"]["status"] == "incomplete"
    assert lost.name in by_name["global_step4"]["reason"]
    assert rows["latest"] == str(saved)
    # judged from the model states' pickle opcodes: `latest` still never imports torch
    probe = (
        "import sys; from ckpt_cli.sources.runs import scan_run\n"
        f"report = scan_run({str(run)!r})\n"
        "print(report.latest, 'torch' in sys.modules)"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    assert seen.stdout.split() == [str(saved), "False"], seen.stderr
    assert run_ckpt("prune", run, "--keep-last", "1", "--yes").exit_code == 0
    assert saved.is_dir() and run_ckpt("verify", saved).exit_code == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_whole_folder_converts_to_dcp_and_torch_identically(
    zero_runs: Path, stage: int, tmp_path: Path
) -> None:
    run = zero_runs / f"zero{stage}"
    for to, dest in (("dcp", tmp_path / "dcp"), ("torch", tmp_path / "all.pt")):
        result = run_ckpt("convert", run, dest, "--to", to)
        assert result.exit_code == 0, result.stderr
        diff = run_ckpt("diff", run, dest, "--json")
        assert diff.exit_code == 0, diff.stdout
        assert run_ckpt("verify", dest, "--deep").exit_code == 0
        # one file or a plain DCP of the whole folder holds its optimizer partitions under
        # names DeepSpeed resumes nothing from: not resumable, and never called "weights only"
        resumable = run_ckpt("verify", dest, "--resumable", "--json").json["result"]
        (problem,) = resumable["problems"]
        assert problem["code"] == "not_resumable" and "weights only" not in problem["message"]
        assert "laid out as no training framework" in problem["message"]
    # the loss scaler is carried as plain data any weights_only reader loads
    import torch.distributed.checkpoint as dcp

    scaler_key = "optim_states_0.optimizer_state_dict.loss_scaler"
    state: dict[str, object] = {scaler_key: None}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    scaler = state[scaler_key]
    assert isinstance(scaler, dict)
    assert scaler["__class__"] == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    back = torch.load(tmp_path / "all.pt", weights_only=True)
    expected = _reference(run)
    for name, tensor in expected.items():
        assert torch.equal(back["model"][name], tensor), name


@pytest.fixture(scope="session")
def zero3_nan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3 saves with NaN planted in the partition padding (`zero3-nan-padding/`), and the
    same engine saved again with a NaN in one real parameter (`zero3-nan-parameter/`)."""
    out = tmp_path_factory.mktemp("deepspeed-nan")
    run_torchrun(SCRIPT, 2, out, "--nan-padding", timeout=600)
    return out


def test_deep_verify_skips_zero3_padding_but_not_a_nan_parameter(zero3_nan: Path) -> None:
    padded = zero3_nan / "zero3-nan-padding"
    # the NaN is really there, in the tail of a rank's flat fp32 partition
    flats = [
        torch.load(f, weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
        for f in sorted(padded.glob("global_step*/*zero_pp_rank_*_optim_states.pt"))
    ]
    assert any(bool(torch.isnan(g).any()) for groups in flats for g in groups)
    # DeepSpeed's own reconstruction is finite: the padding is no parameter
    expected = _reference(padded)
    assert all(bool(torch.isfinite(t).all()) for t in expected.values())
    result = run_ckpt("verify", padded, "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["nonfinite"] == [] and report["tensors"] > 0

    broken = zero3_nan / "zero3-nan-parameter"
    result = run_ckpt("verify", broken, "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    nonfinite = {h["name"]: h["nan"] for h in result.json["result"]["nonfinite"]}
    # the partition holding it, and the rebuilt weight it belongs to, each with one NaN
    rebuilt = [name for name, t in _reference(broken).items() if bool(torch.isnan(t).any())]
    assert len(rebuilt) == 1
    assert nonfinite.get(f"model.{rebuilt[0]}") == 1
    assert nonfinite.get("optim_states_0.optimizer_state_dict.fp32_flat_groups.0") == 1
    assert not any(name.startswith("optim_states_1.") for name in nonfinite)


def test_selecting_zero3_placeholders_is_refused_and_points_to_select_model(
    zero_runs: Path, tmp_path: Path
) -> None:
    """ZeRO-3 leaves only empty placeholders in `model_states.module` (the weights live in the
    fp32 partitions): publishing them as weights, or calling two runs' placeholders identical,
    is refused (exit 4) with why and `--select model`, which rebuilds the real weights."""
    run = zero_runs / "zero3"
    model_states = torch.load(
        next(run.glob("global_step*/zero_pp_rank_0_mp_rank_00_model_states.pt")),
        weights_only=False,
    )
    placeholders = [k for k, v in model_states["module"].items() if v.numel() == 0]
    assert placeholders  # what DeepSpeed saved there: empty tensors, not the parameters
    out = tmp_path / "module.safetensors"
    for select in ("model_states.module", "model_states"):
        result = run_ckpt("convert", run, out, "--to", "safetensors", "--select", select, "--json")
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert "ZeRO-3 placeholders" in error["message"] and "--select model" in error["fix"]
        assert f"model_states.module.{placeholders[0]}" in error["message"]
        assert not out.exists()
    refused = run_ckpt(
        "convert", run, out, "--to", "safetensors", "--filter", "model_states.module.*"
    )
    assert refused.exit_code == 4 and not out.exists()
    diff = run_ckpt("diff", run, zero_runs / "zero2", "--select", "model_states.module")
    assert diff.exit_code == 4 and "ZeRO-3 placeholders" in diff.stderr
    # a real buffer of the module is no placeholder; the rebuilt weights are the way out
    scale = tmp_path / "scale.safetensors"
    select = ("--select", "model_states.module.scale")
    buffer = run_ckpt("convert", run, scale, "--to", "safetensors", *select)
    assert buffer.exit_code == 0, buffer.stderr
    got_scale = load_file(scale)["model_states.module.scale"]
    assert torch.equal(got_scale, model_states["module"]["scale"])
    expected = _reference(run)
    good = run_ckpt("convert", run, out, "--to", "safetensors", "--select", "model")
    assert good.exit_code == 0, good.stderr
    got = load_file(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


RESUME = Path(__file__).resolve().parent / "deepspeed_resume_script.py"
#: run folder -> how the resume worker builds its engine (ZeRO stage, `-sub_group_size`)
KINDS = {"zero1": "1", "zero2": "2", "zero3": "3", "zero3-subgroups": "3-100"}
#: (run, new world size) of the reshards DeepSpeed resumes
RESHARDS = [
    ("zero1", 1),
    ("zero1", 3),
    ("zero2", 1),
    ("zero2", 3),
    ("zero3", 1),
    ("zero3", 3),
    ("zero3-subgroups", 1),
]


@pytest.fixture(scope="session")
def zero_resharded(zero_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zero{1,2,3}-{1,3}/`: each 2-rank run resharded whole by `ckpt reshard --world-size 1 / 3`
    (the JSON report beside it as `zero{1,2,3}-{1,3}.json`), and `zero3-subgroups-1/`."""
    out = tmp_path_factory.mktemp("zero-resharded")
    for run, world_size in RESHARDS:
        dest = out / f"{run}-{world_size}"
        result = run_ckpt(
            "reshard", zero_runs / run, dest, "--world-size", str(world_size), "--json"
        )
        assert result.exit_code == 0, result.stdout + result.stderr
        (out / f"{dest.name}.json").write_text(json.dumps(result.json["result"]))
    return out


@pytest.fixture(scope="session")
def zero_resumed(
    zero_runs: Path, zero_resharded: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], dict[str, Any]]:
    """(run, world size) -> what DeepSpeed's own `engine.load_checkpoint` restored (gathered
    by DeepSpeed) and did one step later: the saved runs at 2 ranks, the reshards at 1 and 3."""
    out = tmp_path_factory.mktemp("zero-resumed")
    runs: dict[int, list[tuple[str, Path]]] = {2: [(r, zero_runs / r) for r in KINDS]}
    for run, world_size in RESHARDS:
        runs.setdefault(world_size, []).append((run, zero_resharded / f"{run}-{world_size}"))
    restored: dict[tuple[str, int], dict[str, Any]] = {}
    for world_size, tasks in runs.items():
        target = out / str(world_size)
        target.mkdir()
        specs = [f"{KINDS[run]}:{path}" for run, path in tasks]
        run_torchrun(RESUME, world_size, target, *specs, timeout=900)
        for index, (run, _) in enumerate(tasks):
            restored[(run, world_size)] = torch.load(target / f"{index}.pt", weights_only=True)
    return restored


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@pytest.mark.slow
@pytest.mark.parametrize(("run", "world_size"), RESHARDS)
def test_world_size_reshard_of_a_zero_run_resumes_in_deepspeed_bit_exact(
    zero_runs: Path,
    zero_resumed: dict[tuple[str, int], dict[str, Any]],
    run: str,
    world_size: int,
) -> None:
    """DeepSpeed loads the re-cut ZeRO partitions at the new world size with its own
    `load_checkpoint` and unchanged config; the fp32 master weights and every optimizer state
    tensor it holds (gathered per parameter) equal the 2-rank engine's bit for bit, as do the
    step counts and the LR scheduler; one more training step runs. `zero3-subgroups` keeps
    its two ZeRO-3 sub-groups at 1 rank."""
    saved, got = zero_resumed[(run, 2)], zero_resumed[(run, world_size)]
    assert saved["world_size"] == 2 and got["world_size"] == world_size
    # the 2-rank reference really holds the save: DeepSpeed's own fp32 reconstruction of it
    expected = _reference(zero_runs / run)
    assert saved["fp32"].keys() == {k for k in expected if k != "scale"}
    for name, tensor in saved["fp32"].items():
        assert torch.equal(_bits(tensor), _bits(expected[name])), name
    for name, tensor in saved["fp32"].items():
        assert torch.equal(_bits(got["fp32"][name]), _bits(tensor)), name
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = got["optimizer"][name][key], saved["optimizer"][name][key]
            assert bool(theirs.abs().sum() > 0), (name, key)  # real state, not a fresh one
            assert torch.equal(_bits(ours), _bits(theirs)), (name, key)
    assert got["steps"] == saved["steps"] == [2.0]
    assert got["global_steps"] == saved["global_steps"] == 2
    assert got["global_samples"] == saved["global_samples"]
    assert got["scheduler"] == saved["scheduler"] and got["lr"] == saved["lr"]
    assert got["global_steps_after"] == 3 and got["finite_after"]
    assert math.isfinite(got["loss"])


@pytest.mark.parametrize("stage", [2, 3])
def test_world_size_reshard_of_a_zero_run_reports_the_verdict_and_the_global_batch(
    zero_runs: Path, zero_resharded: Path, stage: int, tmp_path: Path
) -> None:
    """The report: ZeRO partitions re-cut, `resumable: yes, exact: no` with why, the warning
    that the global batch (micro batch x accumulation x ranks, from the recorded ds_config)
    changes, what was copied; ckpt's own readers find the output complete, resumable and
    holding the source's weights."""
    src = zero_runs / f"zero{stage}"
    prefix = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    for world_size in (1, 3):
        dest = zero_resharded / f"zero{stage}-{world_size}"
        report = json.loads((zero_resharded / f"{dest.name}.json").read_text())
        assert report["layout"] == "deepspeed" and report["partitioning"] == "zero"
        assert (report["source_world_size"], report["world_size"]) == (2, world_size)
        resume = report["resume"]
        assert resume["resumable"] is True and resume["exact"] is False
        assert any(f"2 -> {world_size} ranks" in r for r in resume["reasons"])
        batch = [w for w in report["warnings"] if "global batch" in w]
        assert len(batch) == 1 and batch[0] in resume["reasons"]
        assert "train_micro_batch_size_per_gpu 2" in batch[0] and "global_steps 2" in batch[0]
        assert "batches of 4 samples" in batch[0] and f"{2 * world_size} samples" in batch[0]
        files = {f["path"] for f in report["files"]}
        tag = "global_step2/"
        assert {f"{tag}{prefix.format(r)}" for r in range(world_size)} <= files
        assert f"{tag}{prefix.format(world_size)}" not in files
        assert not (dest / tag / prefix.format(world_size)).exists()
        assert report["carried"] == ["latest", "zero_to_fp32.py", "zero_to_torch.py"]
        assert (dest / "latest").read_bytes() == (src / "latest").read_bytes()
        assert report["verified"] is True

        assert run_ckpt("verify", dest, "--resumable").exit_code == 0
        # DeepSpeed's own zero_to_fp32 reads the output as the source
        rebuilt, expected = _reference(dest), _reference(src)
        assert rebuilt.keys() == expected.keys()
        assert all(torch.equal(rebuilt[k], v) for k, v in expected.items())
        inspected = run_ckpt("inspect", dest, "--json").json["result"]["training"]
        assert inspected["layout"] == "deepspeed" and inspected["step"] == 2
        assert f"rebuilt from {world_size} ZeRO-{stage}" in inspected["components"]["model"]
        assert inspected["weights"]["parameters"] == 360
        # the same weights; the optimizer partitions differ only in how they are cut
        assert run_ckpt("diff", src, dest, "--select", "model").exit_code == 0
        diff = run_ckpt("diff", src, dest, "--json")
        assert diff.exit_code == 1
        result = diff.json["result"]
        assert not any(d["name"].startswith("model.") for d in result["differences"])
        assert not any(n.startswith("model.") for n in result["only_a"] + result["only_b"])
    # --dry-run plans the same files and writes nothing
    planned = run_ckpt(
        "reshard", src, tmp_path / "plan", "--world-size", "3", "--dry-run", "--json"
    )
    assert planned.exit_code == 0, planned.stdout
    assert not (tmp_path / "plan").exists()
    paths = {f["path"] for f in planned.json["result"]["files"]}
    assert f"global_step2/{prefix.format(2)}" in paths


def test_world_size_reshard_of_a_zero_save_keeps_its_own_settings(
    zero_runs: Path, tmp_path: Path
) -> None:
    """A ZeRO save is cut by DeepSpeed's rule: DCP options are refused (exit 2), as is a ZeRO-3
    save whose sub-groups would regroup; nothing is written. A run folder's step folder alone
    reshards into a step folder."""
    out = tmp_path / "out"
    for option in (("--shard-dim", "*=1"), ("--dcp-serialization", "safetensors")):
        result = run_ckpt(
            "reshard", zero_runs / "zero2", out, "--world-size", "1", *option, "--json"
        )
        assert result.exit_code == 2, result.stdout
        assert "ZeRO" in result.json["error"]["message"]
        assert not out.exists()
    # ZeRO-3 sub-groups that regroup at the new size would change the model states' shapes
    refused = run_ckpt("reshard", zero_runs / "zero3-subgroups", out, "--world-size", "3", "--json")
    assert refused.exit_code == 2, refused.stdout
    message = refused.json["error"]["message"]
    assert "sub_group_size 100" in message and "[1, 3]" in message and "[3, 1]" in message
    assert "ds_to_universal.py" in refused.json["error"]["fix"]
    assert not out.exists()
    step = next((zero_runs / "zero3").glob("global_step*"))
    result = run_ckpt("reshard", step, out, "--world-size", "1", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert (out / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert (out / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
    assert not (out / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    model_states = torch.load(out / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    assert model_states["dp_world_size"] == 1
    assert run_ckpt("verify", out, "--resumable").exit_code == 0


def test_per_rank_rng_files_beside_a_zero_save_follow_the_rank_state_policy(
    zero_runs: Path, tmp_path: Path
) -> None:
    """A Hugging Face Trainer checkpoint with DeepSpeed keeps `rng_state_{r}.pth` beside
    `latest` and the tag folder: a world-size reshard asks what becomes of them (exit 2, listing
    them) and then applies the one per-rank policy, as for FSDP folders."""
    folder = shutil.copytree(zero_runs / "zero2", tmp_path / "checkpoint-2")
    for rank in range(2):
        torch.save({"cpu": torch.manual_seed(rank).get_state()}, folder / f"rng_state_{rank}.pth")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    out = tmp_path / "out"
    asked = run_ckpt("reshard", folder, out, "--world-size", "3", "--json")
    assert asked.exit_code == 2, asked.stdout
    assert "rng_state_0.pth, rng_state_1.pth" in asked.json["error"]["message"]
    assert not out.exists()
    result = run_ckpt(
        "reshard", folder, out, "--world-size", "3", "--rank-state", "replicate", "--json"
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["rank_state_action"] == "replicate"
    written = {f["path"]: f["written"] for f in report["rank_files"]}
    assert written == {
        "rng_state_0.pth": ["rng_state_0.pth", "rng_state_2.pth"],
        "rng_state_1.pth": ["rng_state_1.pth"],
    }
    assert (out / "rng_state_2.pth").read_bytes() == (folder / "rng_state_0.pth").read_bytes()
    assert (out / "trainer_state.json").is_file()
    assert any("rank 2 starts from a copy" in r for r in report["resume"]["reasons"])
    # one rank: the Trainer then reads `rng_state.pth`, rank 0's
    one = tmp_path / "one"
    result = run_ckpt("reshard", folder, one, "--world-size", "1", "--rank-state", "replicate")
    assert result.exit_code == 0, result.stderr
    assert (one / "rng_state.pth").read_bytes() == (folder / "rng_state_0.pth").read_bytes()
    assert not (one / "rng_state_1.pth").exists()
    assert run_ckpt("verify", one, "--resumable").exit_code == 0


def _same(a: Any, b: Any, where: str = "") -> None:
    """`a` and `b` are the same DeepSpeed state: tensors bit for bit, objects by their fields."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}.{i}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_re_cut_at_the_saved_size_is_what_deepspeed_saved(
    zero_runs: Path, stage: int, tmp_path: Path
) -> None:
    """Re-cut for the world size it was saved at, every file DeepSpeed loads is what DeepSpeed
    itself wrote, loaded back with DeepSpeed's classes (`torch.load(weights_only=False)`): the
    partitions, paddings, `param_slice_mappings`, the loss scaler and the ZeRO stage enum."""
    src = zero_runs / f"zero{stage}"
    out = tmp_path / "same"
    result = run_ckpt("reshard", src, out, "--world-size", "2")
    assert result.exit_code == 0, result.stderr
    tag = "global_step2"
    names = sorted(p.name for p in (src / tag).iterdir())
    assert sorted(p.name for p in (out / tag).iterdir()) == names
    for name in names:
        theirs = torch.load(src / tag / name, weights_only=False)
        ours = torch.load(out / tag / name, weights_only=False)
        _same(ours, theirs, name)
    loss_scaler = torch.load(next((out / tag).glob("*optim_states.pt")), weights_only=False)[
        "optimizer_state_dict"
    ]["loss_scaler"]
    assert type(loss_scaler).__module__ == "deepspeed.runtime.fp16.loss_scaler"


@pytest.fixture(scope="session")
def trainer_zero_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers `Trainer` run under DeepSpeed ZeRO-2 (bf16, 2 ranks): `checkpoint-2/` and
    `checkpoint-4/`, each DeepSpeed's `latest` + `global_stepN/` beside the Trainer's files."""
    out = tmp_path_factory.mktemp("trainer-deepspeed")
    run_torchrun(SCRIPT, 2, out, "--trainer", timeout=600)
    return out


def _same_rng(ours: Any, theirs: Any, where: str) -> None:
    """One rank's RNG streams as the Trainer saved them and as read back from a conversion."""
    import numpy as np

    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    elif isinstance(theirs, np.ndarray):
        assert np.array_equal(np.asarray(ours), theirs), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            _same_rng(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same_rng(a, b, f"{where}.{i}")
    else:
        assert ours == theirs, where


def test_a_trainer_checkpoint_under_deepspeed_keeps_the_trainers_rng_and_data_position(
    trainer_zero_run: Path, tmp_path: Path
) -> None:
    """The Trainer under DeepSpeed saves its per-rank `rng_state_{r}.pth` and
    `trainer_state.json` beside DeepSpeed's tag folder. They are the checkpoint's too: inspect
    reports both ranks' RNG and the replayed data order (it said none of either), `verify
    --exact` passes (it failed), and a whole-folder conversion carries every rank's streams, as
    the Trainer's own files hold them (it left them out)."""
    folder = trainer_zero_run / "checkpoint-4"
    assert (folder / "latest").is_file() and (folder / "rng_state_1.pth").is_file()
    training = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert training["layout"] == "deepspeed" and training["step"] == 4
    assert training["rng"] == ["python", "numpy", "torch_cpu"]
    assert training["rng_ranks"] == [0, 1]
    assert training["dataloader"] == {"kind": "replayed", "skips_batches": 4}
    assert training["resumable"] is True and training["exact"] is True
    exact = run_ckpt("verify", folder, "--exact")
    assert exact.exit_code == 0, exact.stdout + exact.stderr

    out = tmp_path / "whole.pt"
    converted = run_ckpt("convert", folder, out, "--to", "torch", "--json")
    assert converted.exit_code == 0, converted.stdout + converted.stderr
    reasons = {s["name"]: s["reason"] for s in converted.json["result"]["skipped"]}
    assert not reasons.keys() & {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"}
    # the Trainer's pickled arguments: listed as the Trainer layout lists them, never unpickled
    # (they were "not a file of the checkpoint ckpt reads")
    assert "never unpickled" in reasons["training_args.bin"], reasons
    # the Trainer's rng files hold numpy state: trusted here, as the Trainer itself loads them
    whole = torch.load(out, weights_only=False)
    for rank in range(2):
        saved = torch.load(folder / f"rng_state_{rank}.pth", weights_only=False)
        _same_rng(whole[f"rng_{rank}"], saved, f"rng_{rank}")
    assert whole["trainer_state"]["global_step"] == 4

    # a copy that lost rank 1's RNG file: the Trainer logs "Didn't find an RNG file for
    # process 1" and goes on, and `verify` said OK; its files say 2 processes saved it
    lost = shutil.copytree(folder, tmp_path / "checkpoint-4")
    (lost / "rng_state_1.pth").unlink()
    result = run_ckpt("verify", lost, "--json")
    assert result.exit_code == 1, result.stdout
    problems = [p for p in result.json["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_rank_rng", str(lost / "rng_state_1.pth"))
    ]
    assert "hf-trainer's loader restores none for rank 1" in problems[0]["message"]
    assert "rng_state_0.pth is named as when several processes save" in problems[0]["message"]
    training = run_ckpt("inspect", lost, "--json").json["result"]["training"]
    assert training["exact"] is False and training["rng_ranks"] == [0]


def test_a_trainer_deepspeed_checkpoint_that_lost_every_rng_state_fails_and_is_no_latest(
    trainer_zero_run: Path, tmp_path: Path
) -> None:
    """Both `rng_state_{0,1}.pth` gone from a Trainer checkpoint under DeepSpeed: no rank's file
    left to count, so `verify` said OK and `latest` named it. The Trainer writes them with
    DeepSpeed's state, before its `trainer_state.json`, and the ZeRO partitions say both ranks
    saved."""
    from .run_fixtures import age

    run = shutil.copytree(trainer_zero_run, tmp_path / "run")
    age(run)
    damaged = run / "checkpoint-4"
    for rank in range(2):
        (damaged / f"rng_state_{rank}.pth").unlink()
    result = run_ckpt("verify", damaged, "--json")
    assert result.exit_code == 1, result.stdout
    problems = [p for p in result.json["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_rank_rng", str(damaged / f"rng_state_{rank}.pth")) for rank in range(2)
    ]
    assert "zero_pp_rank_1" in problems[1]["message"]
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-2"), latest.stdout
    rows = {c["name"]: c for c in latest.json["result"]["checkpoints"]}
    assert rows["checkpoint-4"]["status"] == "incomplete"
    assert "rng_state_0.pth" in rows["checkpoint-4"]["reason"]


@pytest.mark.parametrize(
    "how", [("--select", "model", "--to", "safetensors"), ("--to", "hf")], ids=["select", "hf"]
)
def test_the_model_of_a_trainer_deepspeed_save_loads_as_the_fp32_weights(
    trainer_zero_run: Path, tmp_path: Path, how: tuple[str, ...]
) -> None:
    """`convert checkpoint-4 OUT --select model` (or `--to hf`) writes the fp32 master weights
    rebuilt from the ZeRO partitions, and the Trainer's `config.json` beside them said bfloat16
    (the dtype the model trained in): `from_pretrained(OUT)` loaded them cast to bf16. The
    published config says float32, so transformers loads exactly what `zero_to_fp32` gives."""
    from transformers import LlamaForCausalLM

    folder = trainer_zero_run / "checkpoint-4"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "model"
    result = run_ckpt("convert", folder, out, *how)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "config.json says float32, the dtype the weights are written in" in result.stdout
    expected = _reference(folder)
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32, name
        assert torch.equal(loaded[name], tensor), name


@pytest.fixture(scope="session")
def tagged_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2 saves under the script's own tags: `step_1/`, `step_2/`, `step_3/` and `latest`."""
    out = tmp_path_factory.mktemp("deepspeed-tags")
    run_torchrun(SCRIPT, 2, out, "--tags", timeout=600)
    return out / "tagged"


def test_a_run_saved_under_its_own_tags_is_judged_as_deepspeed_saves(
    tagged_run: Path, tmp_path: Path
) -> None:
    """`save_checkpoint(dir, tag=f"step_{n}")` names the saves like plain checkpoints. They are
    DeepSpeed's all the same: the newest lost rank 1's ZeRO partition (a node's disk), so it
    is incomplete and `latest` names the one before (it named the broken save, which DeepSpeed
    cannot load, and `prune --keep-last 1` planned to delete the last good one); a save newer
    than the one the `latest` file names did not finish."""
    run = shutil.copytree(tagged_run, tmp_path / "run")
    assert (run / "latest").read_text().strip() == "step_3"
    listing = run_ckpt("latest", run, "--json").json["result"]
    assert {c["name"]: c["layout"] for c in listing["checkpoints"]} == dict.fromkeys(
        ("step_1", "step_2", "step_3"), "deepspeed"
    )
    assert run_ckpt("latest", run).stdout.strip() == str(run / "step_3")

    (run / "step_3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    latest = run_ckpt("latest", run, "--settle", "0")
    assert latest.exit_code == 0 and latest.stdout.strip() == str(run / "step_2")
    plan = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0", "--json").json["result"]
    deleted = {d["name"] for d in plan["decisions"] if d["action"] == "delete"}
    assert deleted == {"step_1"}, plan

    # a save the `latest` file does not name yet: DeepSpeed writes `latest` when it finished
    shutil.copytree(run / "step_2", run / "step_4")
    (run / "step_3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(
        (tagged_run / "step_3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes()
    )
    listing = run_ckpt("latest", run, "--settle", "0", "--json").json["result"]
    status = {c["name"]: c["status"] for c in listing["checkpoints"]}
    assert status == {
        "step_1": "complete",
        "step_2": "complete",
        "step_3": "complete",
        "step_4": "incomplete",
    }
    assert listing["latest"] == str(run / "step_3")


def test_a_last_save_under_a_tag_with_no_step_is_the_runs_newest(
    tagged_run: Path, tmp_path: Path
) -> None:
    """A loop that ends with `save_checkpoint(dir, tag="final")`: no name rule sees a step in
    `final/`, so the save went unlisted. `latest` named step_2 where DeepSpeed's own `latest`
    file (and `load_checkpoint(dir)`) take `final`, and `prune --keep-last 1` planned to keep
    step_2 alone. It is a DeepSpeed save at the step its model states record."""
    run = shutil.copytree(tagged_run, tmp_path / "run")
    (run / "step_3").rename(run / "final")
    (run / "latest").write_text("final")

    listing = run_ckpt("latest", run, "--settle", "0", "--json").json["result"]
    steps = {c["name"]: (c["layout"], c["step"], c["status"]) for c in listing["checkpoints"]}
    assert steps == {
        "step_1": ("deepspeed", 1, "complete"),
        "step_2": ("deepspeed", 2, "complete"),
        "final": ("deepspeed", 3, "complete"),
    }
    assert listing["latest"] == str(run / "final")
    assert listing["deepspeed_latest"] == "final"
    assert run_ckpt("latest", run, "--settle", "0").stdout.strip() == str(run / "final")

    plan = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0", "--json").json["result"]
    actions = {d["name"]: d["action"] for d in plan["decisions"]}
    assert actions == {"step_1": "delete", "step_2": "delete", "final": "keep"}, plan


def test_a_trainer_deepspeed_folder_put_together_from_two_saves_fails_verify(
    trainer_zero_run: Path, tmp_path: Path
) -> None:
    """A Trainer `checkpoint-4/` under DeepSpeed holding `checkpoint-2`'s DeepSpeed tag (its
    `latest` and `global_step2/`) beside its own `trainer_state.json` (global_step 4), or its
    own tag beside `checkpoint-2`'s `trainer_state.json`: the Trainer resumes DeepSpeed's
    engine by `latest` and the data position by the file, two saves' states. `verify
    --resumable` said OK and `latest` named it; the file's global_step is now checked against
    the tag `latest` names (and, as in any Trainer save, the folder's name)."""
    from transformers import TrainerState

    from .run_fixtures import age

    for mix in ("tag", "state"):
        run = shutil.copytree(trainer_zero_run, tmp_path / mix)
        folder = run / "checkpoint-4"
        if mix == "tag":
            shutil.rmtree(folder / "global_step4")
            shutil.copytree(run / "checkpoint-2" / "global_step2", folder / "global_step2")
            shutil.copy2(run / "checkpoint-2" / "latest", folder / "latest")
        else:
            shutil.copy2(run / "checkpoint-2" / "trainer_state.json", folder)
        age(run)
        resumed_at = TrainerState.load_from_json(str(folder / "trainer_state.json")).global_step
        tag = (folder / "latest").read_text().strip()
        assert (resumed_at, tag) == ((4, "global_step2") if mix == "tag" else (2, "global_step4"))
        result = run_ckpt("verify", folder, "--resumable", "--json")
        assert result.exit_code == 1, (mix, result.stdout)
        problems = [p for p in result.json["result"]["problems"] if p["severity"] == "error"]
        assert {p["code"] for p in problems} == {"trainer_state_mismatch"}, problems
        assert {p["file"] for p in problems} == {str(folder / "trainer_state.json")}
        by_tag = [p["message"] for p in problems if "`latest` names" in p["message"]]
        assert len(by_tag) == 1, problems
        assert f"records global_step {resumed_at}" in by_tag[0] and tag in by_tag[0]
        latest = run_ckpt("latest", run, "--json").json["result"]
        assert latest["latest"] == str(run / "checkpoint-2"), (mix, latest)
        rows = {c["name"]: c for c in latest["checkpoints"]}
        assert rows["checkpoint-4"]["status"] == "incomplete"
        assert "trainer_state.json" in rows["checkpoint-4"]["reason"]
        doctor = run_ckpt("doctor", folder, "--json")
        assert doctor.exit_code == 1, (mix, doctor.stdout)
    whole = run_ckpt("verify", trainer_zero_run / "checkpoint-4", "--resumable")
    assert whole.exit_code == 0, whole.stdout


def test_slimming_a_deepspeed_run_names_the_zero_partitions_it_keeps(
    tagged_run: Path, trainer_zero_run: Path, tmp_path: Path
) -> None:
    """A DeepSpeed save's optimizer lives in its ZeRO partitions, which hold the fp32 weights
    and are kept: `prune --slim-older-than 1` of a DeepSpeed run printed the plain keep table
    and slimmed nothing without a word, and of a Trainer run under DeepSpeed planned "drop
    optimizer, rng…" while it removed the RNG files alone. Each now says what stays and why."""
    from .run_fixtures import age

    run = shutil.copytree(tagged_run, tmp_path / "run")
    age(run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    planned = run_ckpt("prune", run, "--slim-older-than", "1", "--settle", "0", "--json")
    assert planned.exit_code == 0, planned.stderr
    report = planned.json["result"]
    assert report["to_slim"] == 0
    why = {d["name"]: d["not_slimmed"] for d in report["decisions"]}
    assert why["step_3"] is None
    for name in ("step_1", "step_2"):
        assert why[name] is not None and why[name].startswith("its optimizer is in "), why
        assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in why[name]
        assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in why[name]
        assert why[name].endswith("(kept: they hold the weights too)")
    human = run_ckpt("prune", run, "--slim-older-than", "1", "--settle", "0", "--yes")
    assert human.exit_code == 0, human.stderr
    assert "not slimmed: its optimizer is in" in human.stdout
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before

    trainer = shutil.copytree(trainer_zero_run, tmp_path / "trainer")
    age(trainer)
    planned = run_ckpt("prune", trainer, "--slim-older-than", "1", "--settle", "0", "--json")
    slims = {d["name"]: d["slim"] for d in planned.json["result"]["decisions"] if d["slim"]}
    assert list(slims) == ["checkpoint-2"], planned.json
    assert slims["checkpoint-2"]["files"] == ["rng_state_0.pth", "rng_state_1.pth"]
    assert "optimizer" not in slims["checkpoint-2"]["components"]
    assert [k.split(" (")[0] for k in slims["checkpoint-2"]["kept"]] == [
        "optimizer is in global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, "
        "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]
    applied = run_ckpt("prune", trainer, "--slim-older-than", "1", "--settle", "0", "--yes")
    assert applied.exit_code == 0, applied.stderr
    assert "its optimizer is in" in applied.stdout
    slimmed = trainer / "checkpoint-2"
    assert not list(slimmed.glob("rng_state_*.pth"))
    assert len(list((slimmed / "global_step2").glob("*optim_states.pt"))) == 2
    record = json.loads((slimmed / "ckpt-slim.json").read_text())
    assert "optimizer" not in record["components"]


def test_a_trainer_deepspeed_save_resharded_to_one_rank_resumes_in_the_trainer(
    trainer_zero_run: Path, tmp_path: Path
) -> None:
    """The Trainer fills ds_config's "auto" batch settings from its own arguments at every
    launch, so the `train_batch_size` the save records binds nothing: the reshard warned
    "DeepSpeed refuses that config" though the Trainer resumes the output at 1 rank. The
    warning is the Trainer's own (its global batch changes), and the Trainer trains on."""
    out = tmp_path / "checkpoint-4"
    result = run_ckpt(
        "reshard",
        trainer_zero_run / "checkpoint-4",
        out,
        "--world-size",
        "1",
        "--rank-state",
        "replicate",
        "--json",
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    warnings = result.json["result"]["warnings"]
    assert not any("refuses" in w for w in warnings), warnings
    said = "trainer_state.json train_batch_size 2 x training_args.bin "
    said += "gradient_accumulation_steps 1 x 2 ranks"
    assert any(said in w for w in warnings), warnings
    assert (out / "rng_state.pth").is_file() and not (out / "rng_state_1.pth").exists()
    resumed = tmp_path / "resumed"
    run_torchrun(SCRIPT, 1, resumed, "--trainer-resume", out, timeout=600)
    state = json.loads((resumed / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert all(math.isfinite(row["loss"]) for row in state["log_history"] if "loss" in row)


@pytest.fixture(scope="session")
def no_latest_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2 saves made with `save_checkpoint(dir, save_latest=False)`: `global_step{1,2,3}/`
    and no `latest` file."""
    out = tmp_path_factory.mktemp("deepspeed-no-latest")
    run_torchrun(SCRIPT, 2, out, "--no-latest", timeout=600)
    return out / "no-latest"


def test_saves_made_without_a_latest_file_are_complete_and_the_newest_is_named(
    no_latest_run: Path, tmp_path: Path
) -> None:
    """A script that calls `save_checkpoint(dir, tag, save_latest=False)` and names the tag it
    resumes from itself: DeepSpeed writes no `latest` file. Every tag folder is a whole save;
    `latest` names the newest (a tag of the script's own with no step in its name, `final`,
    went unlisted, so `latest` named an older save and `prune --keep-last 1` planned to
    delete the newest), with the note that `load_checkpoint` then needs `tag=`. Where a
    `latest` file is there, a save newer than the one it names is still unfinished."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from .run_fixtures import age

    run = shutil.copytree(no_latest_run, tmp_path / "run")
    assert not (run / "latest").exists()
    assert sorted(p.name for p in run.glob("global_step*")) == [
        "global_step1",
        "global_step2",
        "global_step3",
    ]
    age(run)
    listing = run_ckpt("latest", run, "--json").json["result"]
    assert {c["name"]: c["status"] for c in listing["checkpoints"]} == dict.fromkeys(
        ("global_step1", "global_step2", "global_step3"), "complete"
    )
    assert listing["latest"] == str(run / "global_step3")
    shown = run_ckpt("latest", run)
    assert shown.stdout.strip() == str(run / "global_step3")
    assert "no `latest` file in the run folder" in shown.stderr
    assert "engine.load_checkpoint(dir, tag='global_step3')" in shown.stderr
    verify = run_ckpt("verify", "--resumable", run / "global_step3")
    assert verify.exit_code == 0, verify.stdout
    # DeepSpeed's own reader takes the save by its tag (it has no `latest` to follow)
    expected = {
        k: v.contiguous()
        for k, v in get_fp32_state_dict_from_zero_checkpoint(str(run), tag="global_step3").items()
    }
    out = tmp_path / "weights.safetensors"
    converted = run_ckpt(
        "convert", run / "global_step3", out, "--to", "safetensors", "--select", "model"
    )
    assert converted.exit_code == 0, converted.stderr
    got = load_file(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())

    # the last save under a tag of the script's own, with no step in its name
    (run / "global_step3").rename(run / "final")
    listing = run_ckpt("latest", run, "--json").json["result"]
    steps = {c["name"]: (c["step"], c["status"]) for c in listing["checkpoints"]}
    assert steps == {
        "global_step1": (1, "complete"),
        "global_step2": (2, "complete"),
        "final": (3, "complete"),
    }
    assert listing["latest"] == str(run / "final")
    assert "tag='final'" in run_ckpt("latest", run).stderr
    plan = run_ckpt("prune", run, "--keep-last", "1", "--json").json["result"]
    actions = {d["name"]: d["action"] for d in plan["decisions"]}
    assert actions == {"global_step1": "delete", "global_step2": "delete", "final": "keep"}

    # with a `latest` file, the saves newer than the one it names have not finished
    (run / "final").rename(run / "global_step3")
    (run / "latest").write_text("global_step2")
    age(run)
    listing = run_ckpt("latest", run, "--json").json["result"]
    status = {c["name"]: c["status"] for c in listing["checkpoints"]}
    assert status["global_step3"] == "incomplete" and status["global_step2"] == "complete"
    assert listing["latest"] == str(run / "global_step2")
    assert "no `latest` file" not in run_ckpt("latest", run).stderr


def test_a_tag_linked_to_another_tag_reads_as_that_tag_and_prune_keeps_both(
    tagged_run: Path, tmp_path: Path
) -> None:
    """`ln -s step_2 best` and `latest` naming `best` (DeepSpeed's load_checkpoint follows the
    link): `verify` and `convert` of the run folder said `latest` named a missing tag (exit
    3). The link is another name of the save inside the checkpoint: read as that tag, shown as
    its alias, kept by `prune` with its target, and never deleted through."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from .run_fixtures import age

    run = shutil.copytree(tagged_run, tmp_path / "run")
    (run / "best").symlink_to("step_2", target_is_directory=True)
    (run / "latest").write_text("best")
    age(run)
    verify = run_ckpt("verify", run, "--json")
    assert verify.exit_code == 0, verify.stdout + verify.stderr
    assert verify.json["result"]["location"] == str(run)
    out = tmp_path / "weights.safetensors"
    converted = run_ckpt("convert", run, out, "--to", "safetensors", "--select", "model")
    assert converted.exit_code == 0, converted.stderr
    expected = get_fp32_state_dict_from_zero_checkpoint(str(run))  # DeepSpeed follows `latest`
    got = load_file(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v.contiguous()) for k, v in expected.items())

    table = run_ckpt("inspect", run)
    best = next(line for line in table.stdout.splitlines() if line.startswith("best"))
    assert "alias of step_2" in best and "deepspeed-latest" in best, table.stdout
    listing = run_ckpt("latest", run, "--json").json["result"]
    rows = {c["name"]: c for c in listing["checkpoints"]}
    assert rows["best"]["status"] == "complete" and rows["best"]["step"] == 2
    assert "link-target" in rows["step_2"]["markers"]

    plan = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0", "--yes", "--json")
    assert plan.exit_code == 0, plan.stdout
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions["best"] == "keep" and actions["step_2"] == "keep", actions
    assert (run / "best").is_symlink() and (run / "step_2" / "mp_rank_00_model_states.pt").exists()
    assert run_ckpt("verify", run).exit_code == 0


def test_a_tag_linked_out_of_the_checkpoint_is_refused_naming_the_link_and_its_target(
    tagged_run: Path, tmp_path: Path
) -> None:
    """`latest` naming `best`, a link to a save outside the run folder. Opened through `latest`
    (the run folder is the checkpoint) nothing is read through the link: the refusal names the
    link, where it leads and the fix (exit 4). In the run table the link is a save of its own,
    judged by what it links to as any linked save is: it read "truncated or corrupt
    torch.save file" (its model states were read through the run folder, which refuses the
    link). `prune` never touches what it points at."""
    from .run_fixtures import age

    run = shutil.copytree(tagged_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "step_2").rename(elsewhere / "step_2")
    (run / "best").symlink_to(elsewhere / "step_2", target_is_directory=True)
    (run / "latest").write_text("best")
    age(run)
    for args in (("verify", run), ("convert", run, tmp_path / "out", "--to", "safetensors")):
        result = run_ckpt(*args)
        assert result.exit_code == 4, result.stderr
        said = " ".join(result.stderr.split())
        assert "'best' is a link that points outside the checkpoint" in said, said
        assert str(elsewhere / "step_2") in said and "cp -r" in said
    assert not (tmp_path / "out").exists()
    assert run_ckpt("verify", run / "best").exit_code == 0  # the save itself, named

    listing = run_ckpt("latest", run, "--json").json["result"]
    rows = {c["name"]: c for c in listing["checkpoints"]}
    assert (rows["best"]["status"], rows["best"]["step"]) == ("complete", 2), rows["best"]
    assert listing["latest"] == str(run / "best") and listing["tracker_problem"] is None
    table = run_ckpt("inspect", run).stdout
    assert "truncated or corrupt" not in table
    assert f"-> {elsewhere / 'step_2'}" in " ".join(table.split())

    (run / "latest").write_text("step_3")
    pruned = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0", "--yes", "--json")
    assert pruned.exit_code == 0, pruned.stdout
    actions = {d["name"]: d["action"] for d in pruned.json["result"]["decisions"]}
    assert actions["step_3"] == "keep", actions
    assert not (run / "step_1").exists()
    assert (elsewhere / "step_2" / "mp_rank_00_model_states.pt").is_file()


def test_a_latest_naming_a_missing_or_cut_short_tag_names_the_saves_to_resume_from(
    tagged_run: Path, tmp_path: Path
) -> None:
    """`latest` naming a tag the run lost (pruned, or a save that died before writing its
    model states): `verify` of the run said only "missing, point at another tag", and a tag
    holding ZeRO partitions but no model states read as a complete plain save that
    `ckpt latest` named. The error and `ckpt latest` name the bad tag, why, the complete
    saves and the fix."""
    from .run_fixtures import age

    for case in ("missing", "cut-short"):
        run = shutil.copytree(tagged_run, tmp_path / case)
        if case == "missing":
            shutil.rmtree(run / "step_3")
        else:
            (run / "step_3" / "mp_rank_00_model_states.pt").unlink()
        age(run)
        fix = "Complete saves to resume from: step_2, step_1; point `latest` at one (`echo "
        fix += f"step_2 > {run}/latest`)"
        verify = run_ckpt("verify", run)
        assert verify.exit_code == 3, (case, verify.stderr)
        said = " ".join(verify.stderr.split())
        assert "`latest` names 'step_3', which" in said and fix in said, said
        latest = run_ckpt("latest", run, "--json").json["result"]
        assert latest["latest"] == str(run / "step_2"), (case, latest)
        assert latest["tracker_problem"].startswith("the DeepSpeed `latest` file names step_3")
        assert fix in latest["tracker_problem"], latest["tracker_problem"]
        shown = run_ckpt("latest", run)
        assert shown.stdout.strip() == str(run / "step_2")
        assert "names step_3" in shown.stderr and "echo step_2 >" in " ".join(shown.stderr.split())
        if case == "cut-short":
            rows = {c["name"]: c for c in latest["checkpoints"]}
            assert rows["step_3"]["layout"] == "deepspeed"
            assert rows["step_3"]["status"] == "incomplete"
            assert "lacks mp_rank_00_model_states.pt" in rows["step_3"]["reason"]


@pytest.mark.slow
def test_a_pushed_run_whose_latest_names_an_alias_names_the_saved_tag(
    tagged_run: Path, tmp_path: Path, s3_server: Any
) -> None:
    """`sync` uploads a linked tag's target under its own name, not the link: the `latest`
    naming the link (`best`) was uploaded as it was, naming a folder the store did not hold,
    so a pull kept no `latest` and DeepSpeed resumed nothing from the copy."""
    from .run_fixtures import age
    from .s3_fixtures import make_bucket

    make_bucket(s3_server.endpoint, "ckpts")
    run = shutil.copytree(tagged_run, tmp_path / "run")
    (run / "best").symlink_to("step_2", target_is_directory=True)
    (run / "latest").write_text("best")
    age(run)
    pushed = run_ckpt("sync", run, "s3://ckpts/run/")
    assert pushed.exit_code == 0, pushed.stderr
    back = tmp_path / "back"
    pulled = run_ckpt("sync", "s3://ckpts/run/", back, "--json")
    assert pulled.exit_code == 0, pulled.stdout
    assert (back / "latest").read_text() == "step_2"
    assert not (back / "best").exists()
    assert run_ckpt("verify", back).exit_code == 0


def test_a_tag_folder_linked_to_another_tag_is_listed_as_its_alias_never_as_a_save(
    tagged_run: Path, tmp_path: Path
) -> None:
    """`ln -s step_2 best` with `latest` naming step_3: `best` has no step in its name, and no
    `latest` names it, so `ckpt latest`, `inspect RUN` and `prune` did not list it at all, and
    `inspect RUN/best` did not say it is step_2 under another name. It is listed as an alias
    of its target (never a save of its own: `--keep-last` does not count it), `prune` keeps
    the target and the link, dry run and real, and inspecting the link says whose alias it is."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from .run_fixtures import age

    run = shutil.copytree(tagged_run, tmp_path / "run")
    (run / "best").symlink_to("step_2", target_is_directory=True)
    (run / "newest").symlink_to("step_3", target_is_directory=True)
    age(run)

    inspected = run_ckpt("inspect", run / "best", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    assert inspected.json["result"]["alias_of"] == "step_2"
    said = " ".join(run_ckpt("inspect", run / "best").stdout.split())
    assert "alias of step_2" in said
    assert run_ckpt("inspect", run / "step_2", "--json").json["result"]["alias_of"] is None
    out = tmp_path / "best.safetensors"
    converted = run_ckpt("convert", run / "best", out, "--to", "safetensors", "--select", "model")
    assert converted.exit_code == 0, converted.stderr
    expected = get_fp32_state_dict_from_zero_checkpoint(str(run), tag="step_2")
    got = load_file(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v.contiguous()) for k, v in expected.items())

    listing = run_ckpt("latest", run, "--json").json["result"]
    assert listing["aliases"] == {"best": "step_2", "newest": "step_3"}
    assert listing["latest"] == str(run / "step_3")
    assert "best" not in {c["name"] for c in listing["checkpoints"]}
    table = run_ckpt("inspect", run)
    assert "best: alias of step_2" in table.stdout and "newest: alias of step_3" in table.stdout
    assert run_ckpt("inspect", run, "--json").json["result"]["run"]["aliases"]["best"] == "step_2"

    for args in (("--dry-run",), ("--yes",)):
        pruned = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0", *args, "--json")
        assert pruned.exit_code == 0, pruned.stdout
        doc = pruned.json["result"]
        actions = {d["name"]: d["action"] for d in doc["decisions"]}
        # an alias is no save: neither counted by --keep-last nor deleted; its target is kept
        assert actions == {"step_1": "delete", "step_2": "keep", "step_3": "keep"}, actions
        assert doc["aliases"] == {"best": "step_2", "newest": "step_3"}
    assert not (run / "step_1").exists()
    assert (run / "best").is_symlink() and (run / "newest").is_symlink()
    assert (run / "step_2" / "mp_rank_00_model_states.pt").is_file()
    plan = run_ckpt("prune", run, "--keep-last", "1", "--settle", "0")
    assert "best: alias of step_2" in " ".join(plan.stdout.split())
    assert run_ckpt("verify", run / "best").exit_code == 0


def test_a_trainer_deepspeed_save_resharded_to_another_world_size_is_not_called_exact(
    trainer_zero_run: Path, tmp_path: Path
) -> None:
    """A Trainer checkpoint under ZeRO-2 resumes exactly (every rank's RNG file, the data
    position); cut for 3 ranks with `--rank-state replicate` it held an RNG file for every rank
    and `verify --exact` called it exact, though each rank reads another shard of the data. The
    tag folder now records the world size the run saved it at, and verify says not exactly."""
    src = trainer_zero_run / "checkpoint-4"
    assert run_ckpt("verify", "--exact", src).exit_code == 0
    out = tmp_path / "checkpoint-4"
    args = ("--world-size", "3", "--rank-state", "replicate", "--json")
    planned = run_ckpt("reshard", src, tmp_path / "plan", *args, "--dry-run")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    record_at = "global_step4/ckpt-reshard.json"
    assert record_at in {f["path"] for f in planned.json["result"]["files"]}
    done = run_ckpt("reshard", src, out, *args)
    assert done.exit_code == 0, done.stdout + done.stderr
    assert record_at in {f["path"] for f in done.json["result"]["files"]}
    record = json.loads((out / record_at).read_text())
    assert (record["saved_world_size"], record["world_size"]) == (2, 3)
    exact = run_ckpt("verify", "--exact", out, "--json")
    assert exact.exit_code == 1, exact.stdout
    training = exact.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert training["resharded"] == {"saved_world_size": 2, "world_size": 3}
    codes = {p["code"]: p for p in exact.json["result"]["problems"]}
    assert codes["resharded_world_size"]["severity"] == "error"
    # the message names the record where it is: in the tag folder, not beside `latest`
    assert f"({record_at})" in codes["resharded_world_size"]["message"]
    assert training["reshard_record"] == record_at
    assert run_ckpt("verify", "--resumable", out).exit_code == 0
    # DeepSpeed's own reader still rebuilds the source's weights from the re-cut tag folder
    rebuilt, expected = _reference(out), _reference(src)
    assert rebuilt.keys() == expected.keys()
    assert all(torch.equal(rebuilt[k], v) for k, v in expected.items())


def test_diff_of_two_zero_saves_names_the_one_component_that_differs(
    zero_runs: Path, tmp_path: Path
) -> None:
    """A guard: `diff` of a ZeRO-2 save against a copy whose one rank partition holds another
    moment of one element (or whose scheduler moved on) names that entry alone."""
    src = zero_runs / "zero2"
    tag = next(src.glob("global_step*")).name

    def changed(name: str, file: str, change: Any) -> Path:
        dest = shutil.copytree(src, tmp_path / name)
        state = torch.load(dest / tag / file, weights_only=False)
        with torch.no_grad():
            change(state)
        torch.save(state, dest / tag / file)
        return dest

    partition = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    moment = changed(
        "moment",
        partition,
        lambda s: s["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][3].add_(
            1
        ),
    )
    scheduler = changed(
        "scheduler",
        "mp_rank_00_model_states.pt",
        lambda s: s["lr_scheduler"].update(last_batch_iteration=5),
    )
    for other, name in (
        (moment, "optim_states_1.optimizer_state_dict.base_optimizer_state.state.0.exp_avg"),
        (scheduler, "model_states.lr_scheduler.last_batch_iteration"),
    ):
        result = run_ckpt("diff", src, other, "--json")
        assert result.exit_code == 1, result.stdout + result.stderr
        report = result.json["result"]
        assert [d["name"] for d in report["differences"]] == [name]
        assert not (report["only_a"] or report["only_b"] or report["metadata"])


def _link_chain(run: Path, links: int) -> str:
    """`l0 -> step_2`, `l1 -> l0`, ... : a chain of `links` links; returns the last one."""
    previous = "step_2"
    for i in range(links):
        (run / f"l{i}").symlink_to(previous, target_is_directory=True)
        previous = f"l{i}"
    return previous


def _hostile_latest(run: Path, case: str) -> None:
    if case == "loop":  # a -> b -> a
        (run / "a").symlink_to("b", target_is_directory=True)
        (run / "b").symlink_to("a", target_is_directory=True)
        (run / "latest").write_text("a")
    elif case == "chain_of_1000":
        (run / "latest").write_text(_link_chain(run, 1000))
    elif case == "the_run_itself":
        (run / "me").symlink_to(".", target_is_directory=True)
        (run / "latest").write_text("me")
    elif case == "the_runs_parent":
        (run / "up").symlink_to("..", target_is_directory=True)
        (run / "latest").write_text("up")
    elif case == "dotdot":
        (run / "latest").write_text("../x")
    elif case == "nul":
        (run / "latest").write_bytes(b"step_2\x00../../etc")
    elif case == "newlines":
        (run / "latest").write_bytes(b"step_2\nstep_1\n")
    else:  # 100 MB: DeepSpeed strips it to `step_2`; ckpt reads its first 4 KiB
        with (run / "latest").open("wb") as f:
            f.write(b"step_2")
            for _ in range(100):
                f.write(b" " * (1 << 20))


#: (case, the exit code of `verify RUN`, words its message says)
HOSTILE_LATEST = [
    ("loop", 3, "names 'a'"),
    ("chain_of_1000", 3, "names 'l999'"),
    ("the_run_itself", 3, "names 'me'"),
    ("the_runs_parent", 4, "points outside the checkpoint"),
    ("dotdot", 4, "a path outside the checkpoint"),
    ("nul", 4, "invalid file name"),
    ("newlines", 3, "names 'step_2\\nstep_1'"),
    ("100_mb", 0, "step_2"),
]


@pytest.mark.slow  # fresh processes under limits
@pytest.mark.parametrize(
    ("case", "code", "said"), HOSTILE_LATEST, ids=[c[0] for c in HOSTILE_LATEST]
)
def test_a_hostile_latest_or_tag_link_is_a_clear_error_in_bounded_cpu(
    tagged_run: Path, tmp_path: Path, case: str, code: int, said: str
) -> None:
    """A `latest` naming a link loop, the end of a chain of 1,000 links (Python resolved it one
    recursion level per link: "a bug in ckpt", exit 70, in latest, inspect, verify and prune),
    the run folder or its parent, `../x`, a NUL or newlines, or 100 MB of it: `verify` names the
    file and the saves to resume from instead, and the run's listing and prune plan still stand."""
    from .run_fixtures import age
    from .test_budgets import CPU_LIMIT, ckpt_limited

    run = shutil.copytree(tagged_run, tmp_path / "run", symlinks=True)
    _hostile_latest(run, case)
    age(run)

    verified = ckpt_limited("verify", run)
    text = verified.stdout + verified.stderr
    if code == 0:  # DeepSpeed resumes from step_2 (its `latest` stripped): so does ckpt
        assert verified.exit_code == 0 and "internal error" not in text, text
    else:
        assert verified.exit_code == code, text
        assert str(run) in text and said in text, text
        assert "internal error" not in text, text
    assert verified.cpu_s < CPU_LIMIT
    for command in (("latest", run), ("inspect", run), ("prune", run, "--keep-last", "1")):
        done = ckpt_limited(*command)
        assert done.exit_code == 0, done.stdout + done.stderr
        assert done.cpu_s < CPU_LIMIT
        assert "internal error" not in done.stdout + done.stderr
    listing = run_ckpt("latest", run, "--json").json["result"]
    assert {c["name"] for c in listing["checkpoints"]} >= {"step_1", "step_2", "step_3"}
    # nothing was deleted by the dry run, and nothing outside the run was read as a save
    assert all((run / f"step_{n}" / "mp_rank_00_model_states.pt").exists() for n in (1, 2, 3))
