"""Plain `verify` of real Trainer checkpoints: a deleted optimizer.pt is a problem when the
checkpoint's own training arguments (save_only_model=False, read from the pickle's opcodes,
never unpickled) or its sibling checkpoints say it should be there; a save_only_model
checkpoint without one is fine."""

from __future__ import annotations

import shutil
from pathlib import Path

from .conftest import run_ckpt


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

    # alone, without its training arguments: the sibling checkpoint is the witness
    (run / "checkpoint-2" / "training_args.bin").unlink()
    result = run_ckpt("verify", run / "checkpoint-2", "--json")
    assert result.exit_code == 1
    missing = [p for p in result.json["result"]["problems"] if p["code"] == "missing_component"]
    assert len(missing) == 1 and "checkpoint-1 has one" in missing[0]["message"]


def test_save_only_model_checkpoint_passes(trainer_runs: dict[str, Path]) -> None:
    checkpoint = trainer_runs["model_only"] / "checkpoint-1"
    assert not (checkpoint / "optimizer.pt").exists()
    result = run_ckpt("verify", checkpoint, "--json")
    assert result.exit_code == 0, result.stdout
