"""A Trainer run with gradient accumulation, resharded for another world size: a user's story.

The Trainer resumes by skipping `global_step` optimizer steps of data, each of
`per_device_train_batch_size` x `gradient_accumulation_steps` x ranks samples. `reshard
--world-size` warns that this global batch changes; with `gradient_accumulation_steps=2` its
numbers left the accumulation out (4 samples named 2, 8 named 4) while saying they counted it.
The accumulation is read from the save's own `training_args.bin` (its opcodes, never unpickled).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt

pytestmark = pytest.mark.frameworks


def _train(model_dir: Path, out: Path, accumulation: int) -> Any:
    """One optimizer step of the tiny Llama over `accumulation` batches of 2, saved; the
    Trainer's own arguments are returned."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(8)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_steps=1,
        save_strategy="steps",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=data).train()
    return args


def test_the_global_batch_warning_counts_the_saves_gradient_accumulation(
    tiny_llama: Path, tmp_path: Path
) -> None:
    args = _train(tiny_llama, tmp_path / "run", accumulation=2)
    src = tmp_path / "run" / "checkpoint-1"
    # what the Trainer itself logs as "Total train batch size (w. parallel, distributed &
    # accumulation)" on one rank, and what the same arguments make on two
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert per_rank == 4
    result = run_ckpt(
        "reshard", src, tmp_path / "w2", "--world-size", "2", "--rank-state", "replicate"
    )
    assert result.exit_code == 0, result.stderr
    warning = " ".join(result.stderr.split())
    assert f"counted in global batches of {per_rank} samples" in warning, warning
    assert "gradient_accumulation_steps 2" in warning, warning
    assert f"at 2 ranks the same settings make it {per_rank * 2} samples" in warning, warning
    assert f"It stays {per_rank} only if" in warning, warning
    # the JSON report carries the same numbers
    report = run_ckpt(
        "reshard",
        src,
        tmp_path / "w2j",
        "--world-size",
        "2",
        "--rank-state",
        "replicate",
        "--json",
    )
    assert report.exit_code == 0, report.stderr
    notes = " ".join(report.json["result"]["warnings"])
    assert f"global batches of {per_rank} samples" in notes, notes
