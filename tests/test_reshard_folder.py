"""Whole-folder `reshard --world-size`: a training checkpoint resumed on another number of ranks.

The Hugging Face Trainer with FSDP2 (SHARDED_STATE_DICT) trains the suite's tiny Llama on 2 CPU
ranks under torchrun (`tests/trainer_fsdp_script.py`) and saves `checkpoint-2/`: the
`pytorch_model_fsdp_0/` and `optimizer_0/` DCP folders, `scheduler.pt`, `rng_state_{0,1}.pth`
and `trainer_state.json`. `ckpt reshard checkpoint-2 OUT --world-size N` re-cuts both DCP
folders for N ranks, applies the per-rank policy to the RNG files and copies the rest; the
judge is the Trainer itself: `Trainer(...).train(resume_from_checkpoint=OUT)` under torchrun
with N processes restores the model and optimizer state bit-exact (against DCP's own reader of
the source folders) and trains on to step 4.

The same for an accelerate FSDP2 `save_state` folder of two models (`tests/accelerate_fsdp_script.py`),
judged by `accelerator.load_state` on N ranks against what it restores from the source; and a DDP Trainer checkpoint, whose only per-rank
files are its RNG states.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .dist_helpers import run_torchrun

if (
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None
):
    pytest.skip(
        "transformers and accelerate are not installed (pip install '.[frameworks]'): the "
        "Trainer with FSDP writes these fixtures",
        allow_module_level=True,
    )

# a Trainer or accelerate run under torchrun and its resume on up to 3 ranks: several minutes of
# framework start-up on a busy CPU, more than the suite's default 300 s per test
pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.torchrun,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

SCRIPT = Path(__file__).with_name("trainer_fsdp_script.py")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`checkpoint-2/` of a 2-rank Trainer FSDP2 run (the Trainer's own save code)."""
    root = tmp_path_factory.mktemp("trainer_fsdp")
    run_torchrun(SCRIPT, 2, "train", root / "run", timeout=600)
    folder = root / "run" / "checkpoint-2"
    assert (folder / "pytorch_model_fsdp_0" / "__1_0.distcp").is_file()
    assert (folder / "optimizer_0" / "__1_0.distcp").is_file()
    assert sorted(p.name for p in folder.glob("rng_state*")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    return folder


def _source_state(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the source holds, read by DCP's own reader: (model, optimizer) state dicts."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _load_state_dict_from_keys(checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
        optim = _load_state_dict_from_keys(checkpoint_id=str(folder / "optimizer_0"))
    return model["model"], optim["optimizer"]


def _resume(ckpt: Path, nproc: int, work: Path) -> dict[str, Any]:
    """`Trainer.train(resume_from_checkpoint=ckpt)` on `nproc` ranks; what it restored."""
    report = work / f"restored-{nproc}.pt"
    run_torchrun(SCRIPT, nproc, "resume", ckpt, work / f"resumed-{nproc}", report, timeout=600)
    restored: dict[str, Any] = torch.load(report, weights_only=True)
    return restored


def _assert_restored(restored: dict[str, Any], source: Path) -> None:
    model, optim = _source_state(source)
    assert restored["model"].keys() == model.keys()
    for name, tensor in model.items():
        got = restored["model"][name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert restored["optimizer"]["state"].keys() == optim["state"].keys()
    for param, state in optim["state"].items():
        for key, value in state.items():
            got = restored["optimizer"]["state"][param][key]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (param, key)
    assert restored["global_step"] == 2 and restored["final_step"] == 4


@pytest.mark.parametrize("world", [1, 3])
def test_trainer_fsdp_checkpoint_resharded_whole_resumes_in_the_trainer(
    fsdp_checkpoint: Path, tmp_path: Path, world: int
) -> None:
    out = tmp_path / "checkpoint-2"
    result = run_ckpt(
        "reshard",
        fsdp_checkpoint,
        out,
        "--world-size",
        world,
        "--rank-state",
        "replicate",
        "--json",
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["layout"] == "hf-trainer"
    assert (report["source_world_size"], report["world_size"]) == (2, world)
    assert {p["path"]: p["component"] for p in report["parts"]} == {
        "optimizer_0/": "optimizer",
        "pytorch_model_fsdp_0/": "model",
    }
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (out / sub).glob("*.distcp")) == [
            f"__{r}_0.distcp" for r in range(world)
        ]
    # everything else verbatim; the RNG files as the new world names them
    assert report["carried"] == ["scheduler.pt", "trainer_state.json"]
    for name in report["carried"]:
        assert _sha(out / name) == _sha(fsdp_checkpoint / name)
    rng_0, rng_1 = (
        _sha(fsdp_checkpoint / "rng_state_0.pth"),
        _sha(fsdp_checkpoint / "rng_state_1.pth"),
    )
    if world == 1:
        assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state.pth"]
        assert _sha(out / "rng_state.pth") == rng_0
    else:
        assert sorted(p.name for p in out.glob("rng_state*")) == [
            f"rng_state_{r}.pth" for r in range(3)
        ]
        assert [_sha(out / f"rng_state_{r}.pth") for r in range(3)] == [rng_0, rng_1, rng_0]
    assert {f["path"]: f["action"] for f in report["rank_files"]} == {
        "rng_state_0.pth": "copied" if world == 1 else "carried",
        "rng_state_1.pth": "dropped" if world == 1 else "carried",
    }
    # the verdict, and the global batch the data position was counted in
    resume = report["resume"]
    assert resume["resumable"] is True and resume["exact"] is False
    assert any("world size changed (2 -> " in r for r in resume["reasons"])
    batch = [w for w in report["warnings"] if "global batch" in w]
    assert len(batch) == 1 and "4 samples" in batch[0] and f"{2 * world} samples" in batch[0]
    human = run_ckpt(
        "reshard",
        fsdp_checkpoint,
        tmp_path / "again",
        "--world-size",
        world,
        "--rank-state",
        "replicate",
    )
    assert human.exit_code == 0
    assert "resumable: yes, exact: no" in human.stdout
    assert "global batch" in human.stderr
    # the judge: the Trainer resumes from it on `world` ranks, state restored bit-exact
    _assert_restored(_resume(out, world, tmp_path), fsdp_checkpoint)


def test_trainer_fsdp_reshard_asks_what_to_do_with_per_rank_files(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    asked = run_ckpt("reshard", fsdp_checkpoint, out, "--world-size", "3", "--json")
    assert asked.exit_code == 2, asked.stdout
    error = asked.json["error"]
    assert "rng_state_0.pth" in error["message"] and "rng_state_1.pth" in error["message"]
    for choice in ("keep", "drop", "replicate"):
        assert f"--rank-state {choice}" in error["fix"]
    assert not out.exists()
    # keep: carried as saved; the verdict names the files the new ranks will not find
    kept = run_ckpt(
        "reshard", fsdp_checkpoint, out, "--world-size", "3", "--rank-state", "keep", "--json"
    )
    assert kept.exit_code == 0, kept.stderr
    assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    reasons = kept.json["result"]["resume"]["reasons"]
    assert any("rng_state_2.pth" in r for r in reasons), reasons
    # and `verify` of the kept output names the file rank 2 will not find, and the choice that
    # gives it one
    checked = run_ckpt("verify", out, "--json")
    assert checked.exit_code == 1, checked.stdout
    lost = [p for p in checked.json["result"]["problems"] if p["code"] == "missing_rank_rng"]
    assert [p["file"] for p in lost] == [str(out / "rng_state_2.pth")]
    assert "--rank-state replicate" in lost[0]["fix"]
    # drop: no RNG file at all
    dropped = tmp_path / "dropped"
    result = run_ckpt(
        "reshard", fsdp_checkpoint, dropped, "--world-size", "1", "--rank-state", "drop", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert not list(dropped.glob("rng_state*"))
    assert {f["action"] for f in result.json["result"]["rank_files"]} == {"dropped"}
    # the same world size needs no choice, and the output stays exact
    same = run_ckpt("reshard", fsdp_checkpoint, tmp_path / "same", "--world-size", "2", "--json")
    assert same.exit_code == 0, same.stderr
    verdict = same.json["result"]["resume"]
    assert verdict["exact"] is True and verdict["reasons"] == []
    assert not [w for w in same.json["result"]["warnings"] if "global batch" in w]


def test_a_trainer_checkpoint_that_lost_a_ranks_rng_state_fails_verify_and_is_no_latest(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    """Each process of a multi-process Trainer writes its own `rng_state_{rank}.pth`, and the
    Trainer's `_load_rng_state` only logs "Didn't find an RNG file for process 1" and goes on:
    `verify` said OK and `latest` named the save. The save's own files say 2 processes."""
    run = shutil.copytree(fsdp_checkpoint.parent, tmp_path / "run")
    (run / "checkpoint-4" / "rng_state_1.pth").unlink()
    checked = run_ckpt("verify", run / "checkpoint-4", "--json")
    assert checked.exit_code == 1, checked.stdout
    lost = [p for p in checked.json["result"]["problems"] if p["code"] == "missing_rank_rng"]
    assert [p["file"] for p in lost] == [str(run / "checkpoint-4" / "rng_state_1.pth")]
    assert "rank 1" in lost[0]["message"] and lost[0]["fix"]
    training = run_ckpt("inspect", run / "checkpoint-4", "--json").json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    # the other processes write their RNG files while rank 0 still saves the weights and the
    # optimizer, before its trainer_state.json: lost, not still being written
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-2"), latest.stdout
    rows = {c["name"]: c for c in latest.json["result"]["checkpoints"]}
    assert rows["checkpoint-4"]["status"] == "incomplete"
    assert "rng_state_1.pth" in rows["checkpoint-4"]["reason"]


def test_a_trainer_fsdp_checkpoint_that_lost_every_rng_state_fails_verify_and_is_no_latest(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    """Both `rng_state_{0,1}.pth` gone: no rank's file left to say the save had them, and the
    FSDP optimizer state is accelerate's `optimizer_0/`, not the Trainer's `optimizer.pt`, so
    ckpt said OK and `latest` named it. The Trainer saves the RNG states with the optimizer
    (unless `save_only_model`, which the optimizer state here rules out), and the DCP folders'
    `__1_0.distcp` say two processes saved."""
    run = shutil.copytree(fsdp_checkpoint.parent, tmp_path / "run")
    damaged = run / "checkpoint-4"
    for rank in range(2):
        (damaged / f"rng_state_{rank}.pth").unlink()
    checked = run_ckpt("verify", damaged, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = checked.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_component", str(damaged / f"rng_state_{rank}.pth")) for rank in range(2)
    ]
    assert "optimizer_0/" in problems[0]["message"] and problems[0]["fix"]
    training = run_ckpt("inspect", damaged, "--json").json["result"]["training"]
    assert training["exact"] is False
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-2"), latest.stdout
    rows = {c["name"]: c for c in latest.json["result"]["checkpoints"]}
    assert rows["checkpoint-4"]["status"] == "incomplete"
    assert "rng_state_0.pth" in rows["checkpoint-4"]["reason"]
    refused = run_ckpt("convert", damaged, tmp_path / "out", "--to", "dcp", "--json")
    assert refused.exit_code == 4, refused.stdout
    assert refused.json["error"]["path"] == str(damaged / "rng_state_0.pth")
    assert not (tmp_path / "out").exists()
    # the Trainer's own scheduler.pt, saved beside accelerate's FSDP optimizer state, likewise
    lost = shutil.copytree(fsdp_checkpoint, tmp_path / "checkpoint-2")
    (lost / "scheduler.pt").unlink()
    checked = run_ckpt("verify", lost, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = checked.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_component", str(lost / "scheduler.pt"))
    ]


def test_a_trainer_fsdp_checkpoint_that_lost_its_model_folder_is_no_latest(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    """`checkpoint-4/pytorch_model_fsdp_0/` deleted (a partial copy, a cleanup script):
    `verify` failed it ("no model weights") but `ckpt latest` named it, and `prune
    --keep-last 1` would have kept it and deleted the whole checkpoint-2: the run judge looked
    for no weights in a Trainer save. The save also lost its optimizer folder: named as the
    FSDP optimizer state it is, not as the Trainer's optimizer.pt."""
    run = shutil.copytree(fsdp_checkpoint.parent, tmp_path / "run")
    damaged = run / "checkpoint-4"
    shutil.rmtree(damaged / "pytorch_model_fsdp_0")
    checked = run_ckpt("verify", damaged, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = checked.json["result"]["problems"]
    assert [p["code"] for p in problems] == ["missing_weights"], problems
    assert "pytorch_model_fsdp_0/" in problems[0]["message"]
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-2"), latest.stdout
    rows = {c["name"]: c for c in latest.json["result"]["checkpoints"]}
    assert rows["checkpoint-4"]["status"] == "incomplete"
    assert "weights" in rows["checkpoint-4"]["reason"]

    lost = shutil.copytree(fsdp_checkpoint, tmp_path / "checkpoint-2")
    shutil.rmtree(lost / "optimizer_0")
    checked = run_ckpt("verify", lost, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = checked.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_component", str(lost / "optimizer_0"))
    ], problems
    assert "optimizer_0/" in problems[0]["message"]
    assert "optimizer.pt" not in problems[0]["message"]


def test_a_trainer_fsdp_checkpoint_that_lost_a_rank_rng_converts_the_rest_when_told_to(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    """`convert` refuses a save that lost rank 1's `rng_state_1.pth`, and `--filter-out` could
    not make it write the rest on purpose: the refusal came whatever the filters. Its fix now
    names the option, and with it the output holds every other component, bit for bit, and
    says what it left out."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    damaged = shutil.copytree(fsdp_checkpoint, tmp_path / "checkpoint-2")
    (damaged / "rng_state_1.pth").unlink()
    out = tmp_path / "out"
    refused = run_ckpt("convert", damaged, out, "--to", "dcp", "--json")
    assert refused.exit_code == 4, refused.stdout
    assert "--filter-out 'rng_1*'" in refused.json["error"]["fix"]
    assert not out.exists()
    # a filter that leaves out another component still refuses: the lost one is not chosen
    other = run_ckpt("convert", damaged, out, "--to", "dcp", "--filter-out", "scheduler.*")
    assert other.exit_code == 4 and not out.exists()
    written = run_ckpt("convert", damaged, out, "--to", "dcp", "--filter-out", "rng_1*", "--json")
    assert written.exit_code == 0, written.stdout
    report = written.json["result"]
    skipped = {s["name"]: s for s in report["skipped"] if s["kind"] == "component"}
    assert list(skipped) == ["rng_1"]
    assert "rng_state_1.pth" in skipped["rng_1"]["reason"]
    assert "--filter-out" in skipped["rng_1"]["reason"]
    assert not [w for w in report["warnings"] if "no effect" in w], report["warnings"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = _load_state_dict_from_keys(checkpoint_id=str(out))
    assert "rng_1" not in back and "rng_0" in back
    model, _ = _source_state(fsdp_checkpoint)
    assert back["model"].keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(back["model"][name], tensor), name


def test_trainer_fsdp_reshard_dry_run_and_hidden_files(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    src = shutil.copytree(fsdp_checkpoint, tmp_path / "checkpoint-2")
    (src / ".notes").write_text("mine")
    (src / "config.json").write_text('{"model_type": "llama"}')
    out = tmp_path / "out"
    dry = run_ckpt("reshard", src, out, "--world-size", "3", "--rank-state", "drop", "-n", "--json")
    assert dry.exit_code == 0, dry.stderr
    assert not out.exists()
    planned = {f["path"] for f in dry.json["result"]["files"]}
    assert {"pytorch_model_fsdp_0/__2_0.distcp", "optimizer_0/.metadata", "scheduler.pt"} <= planned
    result = run_ckpt("reshard", src, out, "--world-size", "3", "--rank-state", "drop", "--json")
    assert result.exit_code == 0, result.stderr
    skipped = result.json["result"]["skipped"]
    assert [s["name"] for s in skipped] == [".notes"]
    assert "hidden" in skipped[0]["reason"]
    assert not (out / ".notes").exists()
    assert "config.json" in result.json["result"]["carried"]
    # --no-extras reaches the whole folder: the config is left out, and listed
    bare = run_ckpt(
        "reshard",
        src,
        tmp_path / "bare",
        "--world-size",
        "3",
        "--rank-state",
        "drop",
        "--no-extras",
        "--json",
    )
    assert bare.exit_code == 0, bare.stderr
    assert {"name": "config.json", "kind": "file", "reason": "left out (--no-extras)"} in bare.json[
        "result"
    ]["skipped"]
    assert not (tmp_path / "bare" / "config.json").exists()
    # ckpt reads the output as the Trainer checkpoint it is: resumable, and without any
    # rank's RNG states, which the Trainer saves with the FSDP optimizer state, so `verify`
    # names each (as it names those a `--rank-state keep` output lacks) and the choice made
    inspected = run_ckpt("inspect", out, "--json").json["result"]["training"]
    assert inspected["layout"] == "hf-trainer" and inspected["resumable"] is True
    checked = run_ckpt("verify", out, "--json")
    assert checked.exit_code == 1, checked.stdout
    problems = checked.json["result"]["problems"]
    assert [p["file"] for p in problems] == [str(out / f"rng_state_{r}.pth") for r in range(3)]
    assert all("--rank-state drop" in p["fix"] for p in problems), problems[0]


def test_ddp_trainer_checkpoint_gets_the_new_worlds_rng_files(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """A Trainer checkpoint without FSDP (replicated `model.safetensors`, `optimizer.pt`) saved
    by one process: nothing to re-cut, every file copied, `rng_state.pth` given to the ranks
    of the new world under the names the Trainer reads there."""
    src = real_trainer_run / "straight" / "checkpoint-4"
    assert (src / "rng_state.pth").is_file() and (src / "optimizer.pt").is_file()
    out = tmp_path / "checkpoint-4"
    result = run_ckpt(
        "reshard", src, out, "--world-size", "2", "--rank-state", "replicate", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["parts"] == [] and (report["source_world_size"], report["world_size"]) == (1, 2)
    assert "model.safetensors" in report["carried"] and "optimizer.pt" in report["carried"]
    for name in report["carried"]:
        assert _sha(out / name) == _sha(src / name), name
    rng = _sha(src / "rng_state.pth")
    assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert _sha(out / "rng_state_0.pth") == _sha(out / "rng_state_1.pth") == rng
    # the human report says nothing was cut by rank (it said "None serialization")
    text = run_ckpt(
        "reshard", src, tmp_path / "text", "--world-size", "2", "--rank-state", "replicate"
    )
    assert text.exit_code == 0, text.stderr
    assert "1 -> 2 ranks (no file is cut by rank" in text.stdout
    assert "None" not in text.stdout
    # keep: carried as saved, and the verdict says the Trainer on 2 ranks will not find it
    kept = run_ckpt(
        "reshard", src, tmp_path / "kept", "--world-size", "2", "--rank-state", "keep", "--json"
    )
    assert kept.exit_code == 0, kept.stderr
    assert (tmp_path / "kept" / "rng_state.pth").is_file()
    reasons = kept.json["result"]["resume"]["reasons"]
    assert any("rng_state_0.pth, rng_state_1.pth" in r for r in reasons), reasons


ACCELERATE = Path(__file__).with_name("accelerate_fsdp_script.py")


@pytest.fixture(scope="module")
def accelerate_fsdp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`save_state` of a 2-rank accelerate FSDP2 loop with two models (accelerate's own save
    code, `tests/accelerate_fsdp_script.py`)."""
    folder = tmp_path_factory.mktemp("accelerate_fsdp") / "step-2"
    run_torchrun(ACCELERATE, 2, "save", folder, "SHARDED_STATE_DICT", timeout=600)
    for sub in ("pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "optimizer_0", "optimizer_1"):
        assert (folder / sub / "__1_0.distcp").is_file(), sub
    assert (folder / "random_states_1.pkl").is_file()
    return folder


@pytest.mark.parametrize("world", [1, 3])
def test_accelerate_fsdp_folder_resharded_whole_loads_in_load_state(
    accelerate_fsdp_folder: Path, tmp_path: Path, world: int
) -> None:
    src = accelerate_fsdp_folder
    out = tmp_path / "step-2"
    result = run_ckpt(
        "reshard", src, out, "--world-size", world, "--rank-state", "replicate", "--json"
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["layout"] == "accelerate"
    assert sorted(p["path"] for p in report["parts"]) == [
        "optimizer_0/",
        "optimizer_1/",
        "pytorch_model_fsdp_0/",
        "pytorch_model_fsdp_1/",
    ]
    for sub in ("pytorch_model_fsdp_0", "optimizer_1"):
        assert sorted(p.name for p in (out / sub).glob("*.distcp")) == [
            f"__{r}_0.distcp" for r in range(world)
        ]
    assert report["carried"] == ["scheduler.bin", "scheduler_1.bin"]
    for name in report["carried"]:
        assert _sha(out / name) == _sha(src / name)
    states = [_sha(src / f"random_states_{r}.pkl") for r in range(2)]
    assert sorted(p.name for p in out.glob("random_states_*")) == [
        f"random_states_{r}.pkl" for r in range(world)
    ]
    assert [_sha(out / f"random_states_{r}.pkl") for r in range(world)] == [
        states[r] if r < 2 else states[0] for r in range(world)
    ]
    resume = report["resume"]
    assert resume["resumable"] is True and resume["exact"] is False
    # the judge: accelerate's load_state on `world` ranks restores from OUT what it restores
    # from SRC (DCP reshards SRC itself at load time), bit for bit: every model, optimizer and
    # scheduler, and each rank's RNG streams; at 3 ranks rank 2 has no RNG file in SRC, and
    # from OUT restores rank 0's copy
    report_file = tmp_path / "restored.json"
    run_torchrun(
        ACCELERATE, world, "load", report_file, "SHARDED_STATE_DICT", src, out, timeout=600
    )
    found = json.loads(report_file.read_text())[str(out)]
    expected_rng_only = [f for f in found if f.startswith("rank 2: .rng")]
    assert found == expected_rng_only, found
    assert bool(expected_rng_only) == (world == 3)


def test_a_shard_size_dry_run_of_a_trainer_checkpoint_counts_the_raw_copies_the_run_makes(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """`reshard --max-shard-size --dry-run --json` of a Trainer checkpoint says how many
    tensors the run copies as raw bytes (all of them: safetensors to safetensors, no cast);
    it said 0, and the run then copied every one raw."""
    src = real_trainer_run / "straight" / "checkpoint-4"
    out = tmp_path / "checkpoint-4"
    args = ("reshard", src, out, "--max-shard-size", "10KB", "--json")
    dry = run_ckpt(*args, "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert not out.exists()
    real = run_ckpt(*args)
    assert real.exit_code == 0, real.stderr
    planned, done = dry.json["result"], real.json["result"]
    assert planned["raw_copy"] == done["raw_copy"] == done["tensors"] > 0
    assert len(list(out.glob("model-*.safetensors"))) > 1


def test_a_shard_size_reshard_of_a_trainer_checkpoint_lists_every_file_it_wrote(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """The report's `files` of `reshard --max-shard-size` on a Trainer checkpoint are the files
    in DEST, as its dry run lists them and as `--world-size` lists them: the optimizer,
    scheduler, RNG and config files copied beside the shards were missing from the run's."""
    src = real_trainer_run / "straight" / "checkpoint-4"
    out = tmp_path / "checkpoint-4"
    args = ("reshard", src, out, "--max-shard-size", "10KB", "--json")
    dry = run_ckpt(*args, "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    real = run_ckpt(*args)
    assert real.exit_code == 0, real.stderr
    on_disk = {p.name: p.stat().st_size for p in out.iterdir()}
    listed = {f["path"]: f["size"] for f in real.json["result"]["files"]}
    assert listed == on_disk
    assert {f["path"] for f in dry.json["result"]["files"]} == set(on_disk)
    assert {"optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"} <= set(listed)
    # the copies are the source's files, byte for byte
    for name in ("optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
