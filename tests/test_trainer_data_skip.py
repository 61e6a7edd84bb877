"""A Trainer run saved with `ignore_data_skip=True`: a user's story.

When it resumes, the Trainer skips the batches its `global_step` already trained on, so the
resumed run sees the batches the uninterrupted one saw; with `ignore_data_skip=True` (in the
`training_args.bin` the save keeps) it does not: a save from the middle of an epoch resumes at
that epoch's first batch, and the run trains on other data than the one it continues. `inspect`
said `data loader kind=replayed, skips_batches=N` and `verify --exact` said exact. A save at an
epoch's end skips nothing either way, and stays exact.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import age


def _train(model_dir: Path, out: Path, resume: Path | None = None) -> None:
    """2 epochs of 4 steps (8 distinct samples, batch 2, shuffled), saved every 2 steps."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    data = [{"input_ids": (torch.arange(8) * (i + 1)) % 64} for i in range(8)]
    for row in data:
        row["labels"] = row["input_ids"]
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=2,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        ignore_data_skip=True,
        disable_tqdm=True,
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=data).train(
            resume_from_checkpoint=str(resume) if resume else None
        )


@pytest.mark.slow
def test_a_mid_epoch_save_of_a_run_that_ignores_data_skip_is_not_exact(
    tiny_llama: Path, tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="the frameworks extra brings transformers")
    run = tmp_path / "run"
    _train(tiny_llama, run)
    age(run)
    middle, end = run / "checkpoint-2", run / "checkpoint-4"

    inspect = run_ckpt("inspect", middle, "--json")
    assert inspect.exit_code == 0, inspect.stderr
    state = json.loads(inspect.stdout)["result"]["training"]
    assert state["resumable"] is True
    assert state["exact"] is False
    assert state["missing_exact"] == ["dataloader"]
    assert state["dataloader"]["ignore_data_skip"] is True
    verify = run_ckpt("verify", "--exact", middle)
    assert verify.exit_code == 1, verify.stdout
    assert "ignore_data_skip" in verify.stdout
    assert run_ckpt("verify", "--exact", end).exit_code == 0  # nothing to skip at an epoch's end

    # the truth: resumed from the middle of the epoch, the run trains on other batches
    resumed = tmp_path / "resumed"
    _train(tiny_llama, resumed, resume=middle)
    diff = run_ckpt("diff", run / "checkpoint-8", resumed / "checkpoint-8", "--select", "model")
    assert diff.exit_code == 1, diff.stdout + diff.stderr
