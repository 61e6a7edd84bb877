"""Plain `verify` of real Trainer checkpoints: a deleted optimizer.pt is a problem when the
checkpoint's own training arguments (save_only_model=False, read from the pickle's opcodes,
never unpickled) or its sibling checkpoints say it should be there; a save_only_model
checkpoint without one is fine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ckpt_cli.sources.layouts.trainer import TRAINER_STATE_FIELDS

from .conftest import REPO, run_ckpt


def test_deleted_optimizer_fails_plain_verify(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    assert run_ckpt("verify", run / "checkpoint-2").exit_code == 0
    (run / "checkpoint-2" / "optimizer.pt").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    missing = [p for p in result.json["result"]["problems"] if p["code"] == "missing_component"]
    assert len(missing) == 1 and "optimizer.pt" in missing[0]["message"]
    assert "save_only_model=False" in missing[0]["message"]

    # without its training arguments: the scheduler and RNG files the Trainer writes with the
    # optimizer are the witness
    (run / "checkpoint-2" / "training_args.bin").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    missing = [p for p in result.json["result"]["problems"] if p["code"] == "missing_component"]
    assert len(missing) == 1 and "the Trainer saves it with" in missing[0]["message"]

    # with those gone too, the sibling checkpoint is the witness
    for lost in (run / "checkpoint-2").glob("rng_state*.pth"):
        lost.unlink()
    (run / "checkpoint-2" / "scheduler.pt").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    missing = [p for p in result.json["result"]["problems"] if p["code"] == "missing_component"]
    assert missing and "checkpoint-1 has one" in missing[0]["message"]


def test_a_checkpoint_that_lost_its_rng_state_fails_verify_and_is_no_latest(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """The Trainer writes `rng_state.pth` with `optimizer.pt` and `scheduler.pt` (unless
    `save_only_model`), and `_load_rng_state` only logs "Didn't find an RNG file" and goes on
    without it: a checkpoint that lost it was "OK" to `verify`, `latest` named it and `convert`
    wrote it, while the resumed run draws other random numbers than the one it continues."""
    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    (run / "checkpoint-2" / "rng_state.pth").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_component", str(run / "checkpoint-2" / "rng_state.pth"))
    ]
    assert "save_only_model=False" in problems[0]["message"]
    assert "random numbers" in problems[0]["message"]
    latest = run_ckpt("latest", run, "--settle", "0", "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-1"), latest.stdout
    out = tmp_path / "out"
    refused = run_ckpt("convert", run / "checkpoint-2", out, "--to", "dcp")
    assert refused.exit_code == 4 and "rng_state.pth" in refused.stderr and not out.exists()


def test_save_only_model_checkpoint_passes(trainer_runs: dict[str, Path]) -> None:
    checkpoint = trainer_runs["model_only"] / "checkpoint-1"
    assert not (checkpoint / "optimizer.pt").exists()
    result = run_ckpt("verify", checkpoint, "--json")
    assert result.exit_code == 0, result.stdout
    # `latest` names it (the run has no other), and says what a resume from it is: the
    # Trainer restarts the optimizer, scheduler and RNG (it was named with nothing said)
    latest = run_ckpt("latest", trainer_runs["model_only"])
    assert latest.exit_code == 0 and latest.stdout.strip() == str(checkpoint)
    assert "save_only_model=True" in latest.stderr and "fresh optimizer" in latest.stderr
    full = run_ckpt("latest", trainer_runs["full"])
    assert full.exit_code == 0 and full.stderr == ""


def test_a_save_latest_skips_is_no_whole_checkpoint_to_plain_verify_either(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """What `ckpt latest` calls incomplete, plain `verify` does not call OK: a real Trainer
    save whose model weights are gone (written first: deleted or lost since) or without its
    trainer_state.json (written last: the save did not finish). Both name the file and say
    to use another checkpoint; --resumable says it once, not twice."""
    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    assert run_ckpt("verify", run / "checkpoint-2").exit_code == 0
    (run / "checkpoint-2" / "model.safetensors").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert (
        codes == ["missing_weights"]
        and "ckpt latest" in result.json["result"]["problems"][0]["fix"]
    )
    resumable = run_ckpt("verify", "--resumable", run / "checkpoint-2", "--json")
    errors = [p["code"] for p in resumable.json["result"]["problems"] if p["severity"] == "error"]
    assert errors == ["missing_weights"]

    (run / "checkpoint-1" / "trainer_state.json").unlink()
    result = run_ckpt("verify", run / "checkpoint-1", "--json")
    assert result.exit_code == 1
    problem = next(p for p in result.json["result"]["problems"] if p["code"] == "missing_component")
    assert problem["file"].endswith("trainer_state.json") and "did not finish" in problem["message"]


def test_the_model_trainer_save_model_writes_is_no_unfinished_checkpoint(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """`trainer.save_model(dir)` writes the weights, config.json and training_args.bin, and
    nothing of the training state: plain `verify` said optimizer.pt and scheduler.pt were
    missing (and, for a moment in this stop, trainer_state.json). It is a model folder. The
    same files in a folder named `checkpoint-N` are a save cut short after its model."""
    final = trainer_runs["final"]
    assert (final / "training_args.bin").is_file() and not (final / "optimizer.pt").exists()
    result = run_ckpt("verify", final, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["problems"] == []
    cut = shutil.copytree(final, tmp_path / "checkpoint-3")
    codes = {p["code"] for p in run_ckpt("verify", cut, "--json").json["result"]["problems"]}
    assert "missing_component" in codes


def _example_script_output(tiny_llama: Path, out: Path, *, save_steps: int | None) -> Path:
    """What a transformers example script leaves in `output_dir`: a Trainer run of 2 steps
    (saving `checkpoint-N/` every `save_steps`, or none), then `trainer.save_model()` and
    `trainer.save_state()` (the final model, training_args.bin and trainer_state.json)."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=LlamaForCausalLM.from_pretrained(tiny_llama), args=args, train_dataset=data
        )
        trainer.train()
        trainer.save_model()
        trainer.save_state()
    return out


def test_the_output_dir_an_example_script_ends_with_is_a_model_folder(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """transformers' example scripts end with `trainer.save_model()` and `trainer.save_state()`:
    `output_dir` holds the weights, config.json, training_args.bin and the run's
    trainer_state.json (what `push_to_hub` uploads, what is served). Plain `verify` failed it,
    exit 1, with three errors (optimizer.pt, scheduler.pt and rng_state.pth "missing, but
    training_args.bin says save_only_model=False"). It is a model folder: plain `verify` passes
    it, `verify --resumable` still says it cannot resume; the same files in a folder named as a
    save is (`checkpoint-N`, `last-checkpoint`) are a save that lost its training state."""
    out = _example_script_output(tiny_llama, tmp_path / "out", save_steps=None)
    assert (out / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()

    result = run_ckpt("verify", out, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["problems"] == []
    resumable = run_ckpt("verify", out, "--resumable", "--json")
    assert resumable.exit_code == 1
    codes = {p["code"] for p in resumable.json["result"]["problems"]}
    assert "missing_optimizer" in codes
    for name in ("checkpoint-1", "last-checkpoint"):
        saved = shutil.copytree(out, tmp_path / "run" / name)
        problems = run_ckpt("verify", saved, "--json").json["result"]["problems"]
        assert "optimizer.pt" in {p["file"].rsplit("/", 1)[-1] for p in problems}, name


def test_verify_of_an_output_dir_does_not_count_the_saves_beside_its_model_as_checked(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`output_dir` after an example script: the final model at its root, the run's
    `checkpoint-1/`, `checkpoint-2/` beside it. `ckpt verify out` checked the root model and
    said "OK — 21 files", counting every file of the saves as checked, even with
    `checkpoint-1/model.safetensors` truncated (and `--write-manifest` hashed them into the
    model's manifest). The saves are checkpoints of their own: the
    count is the root's, and a warning names them and how to verify one."""
    out = _example_script_output(tiny_llama, tmp_path / "out", save_steps=1)
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    weights = out / "checkpoint-1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    result = run_ckpt("verify", out, "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    root = [p for p in out.iterdir() if p.is_file()]
    assert report["files"] == len(root), report["files"]
    assert report["bytes"] == sum(p.stat().st_size for p in root)
    problems = report["problems"]
    assert [(p["code"], p["severity"]) for p in problems] == [("nested_saves", "warning")]
    assert "checkpoint-1/, checkpoint-2/" in problems[0]["message"]
    assert f"ckpt verify {out}/checkpoint-2" in problems[0]["fix"]
    assert run_ckpt("verify", out / "checkpoint-1").exit_code == 1
    # the root's manifest is the model's: each save has its own
    assert run_ckpt("verify", out, "--write-manifest").exit_code == 0
    manifest = json.loads((out / "ckpt-manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in root)


def test_a_checkpoint_holding_another_saves_trainer_state_fails_verify_and_is_no_latest(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """`checkpoint-2` holding `checkpoint-1`'s trainer_state.json (two saves' files put
    together): the Trainer names a checkpoint after its global_step and resumes at the step
    the file records, with the folder's optimizer and scheduler. `verify` said OK, `inspect`
    exact, and `latest` named it."""
    from transformers import TrainerState

    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    shutil.copy2(run / "checkpoint-1" / "trainer_state.json", run / "checkpoint-2")
    state = run / "checkpoint-2" / "trainer_state.json"
    # what `resume_from_checkpoint` reads: step 1, in a folder the Trainer wrote at step 2
    assert TrainerState.load_from_json(str(state)).global_step == 1
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [("trainer_state_mismatch", str(state))]
    assert "global_step 1" in problems[0]["message"] and "checkpoint-2" in problems[0]["message"]
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-1"), latest.stdout
    rows = {c["name"]: c for c in latest.json["result"]["checkpoints"]}
    assert rows["checkpoint-2"]["status"] == "incomplete"
    assert "trainer_state.json" in rows["checkpoint-2"]["reason"]
    # its own file back: whole again
    shutil.copy2(trainer_runs["full"] / "checkpoint-2" / "trainer_state.json", state)
    assert run_ckpt("verify", run / "checkpoint-2").exit_code == 0
    assert run_ckpt("latest", run).stdout.strip() == str(run / "checkpoint-2")


def test_a_peft_checkpoint_that_lost_its_adapter_names_the_adapter_file(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A Trainer run of a PEFT (LoRA) model saves the adapter (`adapter_model.safetensors`
    beside `adapter_config.json`), not the base weights: a checkpoint that lost it was said
    to lack `model.safetensors, pytorch_model.bin or their shards`, which it never had."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(tiny_llama),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=data).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert run_ckpt("verify", checkpoint).exit_code == 0
    (checkpoint / "adapter_model.safetensors").unlink()
    result = run_ckpt("verify", checkpoint, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [
        ("missing_weights", str(checkpoint / "adapter_model.safetensors"))
    ]
    assert "adapter_config.json" in problems[0]["message"]
    assert "pytorch_model.bin" not in problems[0]["message"]


def test_a_truncated_weights_file_is_named_not_called_deleted(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A disk that filled up (or a copy cut short) left the Trainer checkpoint's weights file
    truncated: verify names that file as unreadable, and does not also claim the weights were
    deleted ("no model weights ... deleted or lost since?"), which sends the user looking for
    a file that is right there; once protected, the one fix given is `ckpt repair`."""
    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    folder = run / "checkpoint-2"
    weights = next(p for p in folder.iterdir() if p.name.endswith(".safetensors"))
    assert run_ckpt("protect", folder).exit_code == 0
    with open(weights, "r+b") as fh:
        fh.truncate(100)
    result = run_ckpt("verify", folder, "--json")
    assert result.exit_code == 1
    problems = result.json["result"]["problems"]
    codes = {p["code"] for p in problems}
    assert "missing_weights" not in codes, problems
    unreadable = [p for p in problems if p["code"] == "unreadable_component"]
    assert [p["file"] for p in unreadable] == [str(weights)]
    assert "ckpt repair" in unreadable[0]["fix"]
    assert run_ckpt("repair", folder).exit_code == 0
    assert run_ckpt("verify", folder, "--checksums").exit_code == 0


def test_a_trainer_state_whose_global_step_is_no_count_fails_verify_and_is_no_latest(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A real Trainer save whose `trainer_state.json` records `global_step: "ten"` (a garbled
    or hand-edited file): `TrainerState.load_from_json` takes it, and the resume cannot count
    from it. `verify` said OK and `resumable: yes`, and `latest` named the save."""
    run = shutil.copytree(trainer_runs["full"], tmp_path / "run")
    state = run / "checkpoint-2" / "trainer_state.json"
    doc = json.loads(state.read_text())
    doc["global_step"] = "ten"
    state.write_text(json.dumps(doc))
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["file"]) for p in problems] == [("unreadable_component", str(state))]
    assert "global_step 'ten'" in problems[0]["message"]
    latest = run_ckpt("latest", run, "--json")
    assert latest.json["result"]["latest"] == str(run / "checkpoint-1"), latest.stdout


def test_a_trainer_state_whose_global_step_key_was_damaged_is_no_resume(tmp_path: Path) -> None:
    # one flipped byte turns `global_step` into `global_stdp`: the Trainer's resume fails on
    # the key it does not know (and with the key gone, it would start over at step 0 with this
    # save's optimizer); verify called the save resumable and latest chose it
    from .run_fixtures import trainer_checkpoint

    transformers = pytest.importorskip("transformers")
    save = tmp_path / "checkpoint-100"
    trainer_checkpoint(save, 100)
    state = json.loads((save / "trainer_state.json").read_text())
    state["global_stdp"] = state.pop("global_step")
    (save / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(TypeError, match="global_stdp"):
        transformers.TrainerState.load_from_json(str(save / "trainer_state.json"))

    found = run_ckpt("verify", save, "--resumable", "--json")
    assert found.exit_code == 1, found.stdout
    errors = [p for p in found.json["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in errors] == [
        ("unreadable_component", str(save / "trainer_state.json"))
    ], errors
    assert "global_step" in errors[0]["message"]
    assert run_ckpt("latest", tmp_path).exit_code != 0


def test_a_trainer_state_with_a_key_the_trainer_does_not_know_is_no_resume(
    tmp_path: Path,
) -> None:
    # a damaged key (`epoch` -> `epocj`): `TrainerState.load_from_json` is `TrainerState(**json)`
    # and fails on the key it does not know, so `resume_from_checkpoint` does; verify called the
    # save resumable and latest chose it. A key missing (`log_history`) takes its default there:
    # the save resumes, and verify agrees.
    from .run_fixtures import trainer_checkpoint

    transformers = pytest.importorskip("transformers")
    save = tmp_path / "checkpoint-100"
    trainer_checkpoint(save, 100)
    path = save / "trainer_state.json"
    state = json.loads(path.read_text())
    del state["log_history"]
    path.write_text(json.dumps(state))
    transformers.TrainerState.load_from_json(str(path))
    assert run_ckpt("verify", save, "--resumable").exit_code == 0

    state["epocj"] = state.pop("epoch")
    path.write_text(json.dumps(state))
    with pytest.raises(TypeError, match="epocj"):
        transformers.TrainerState.load_from_json(str(path))
    found = run_ckpt("verify", save, "--resumable", "--json")
    assert found.exit_code == 1, found.stdout
    errors = [p for p in found.json["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in errors] == [("unreadable_component", str(path))]
    assert "'epocj'" in errors[0]["message"] and "TrainerState" in errors[0]["message"]
    assert "Put back the trainer_state.json" in errors[0]["fix"]
    assert run_ckpt("latest", tmp_path).exit_code != 0


def test_the_key_check_imports_no_torch_and_without_transformers_names_only_sure_damage(
    tmp_path: Path,
) -> None:
    # verify reads the installed transformers' TrainerState fields from its source: importing
    # transformers imports torch (seconds), which a metadata command never does
    from .run_fixtures import trainer_checkpoint

    save = tmp_path / "checkpoint-100"
    trainer_checkpoint(save, 100)
    path = save / "trainer_state.json"
    state = json.loads(path.read_text())
    state["epocj"] = state.pop("epoch")
    path.write_text(json.dumps(state))
    script = (
        "import sys; from ckpt_cli import verify; "
        f"r = verify({str(save)!r}, resumable=True); "
        "assert [p.code for p in r.problems if p.severity == 'error'] == "
        "['unreadable_component'], r.problems; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    # a machine without transformers: a key past the list beside every field the Trainer
    # writes may be a newer transformers' field, and is not called damage; a damaged one is
    state["epoch"] = state.pop("epocj")
    for field in TRAINER_STATE_FIELDS - state.keys():  # what a real Trainer writes beside
        state[field] = None
    state["a_field_of_a_newer_transformers"] = 1
    path.write_text(json.dumps(state))
    hidden = (
        "import importlib.util, sys; real = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda name, *a: None if name == 'transformers' "
        "else real(name, *a); from ckpt_cli import verify; "
    )
    newer = hidden + (
        f"r = verify({str(save)!r}, resumable=True); "
        "assert not [p for p in r.problems if p.severity == 'error'], r.problems"
    )
    proc = subprocess.run([sys.executable, "-c", newer], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    del state["a_field_of_a_newer_transformers"]
    state["epocj"] = state.pop("epoch")
    path.write_text(json.dumps(state))
    damaged = hidden + (
        f"r = verify({str(save)!r}, resumable=True); "
        "assert [p.code for p in r.problems if p.severity == 'error'] == "
        "['unreadable_component'], r.problems"
    )
    proc = subprocess.run([sys.executable, "-c", damaged], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
