"""A LoRA trained with the Trainer, merged from its `checkpoint-N/`: a user's story.

The checkpoint holds the adapter (`adapter_model.safetensors`, `adapter_config.json`) beside
the Trainer's optimizer, scheduler, RNG and state files. `ckpt merge BASE checkpoint-N DEST`
merges the adapter and leaves the training files out, saying so on stderr; given the folder
as an absolute path, the line read "not in the output: / (6 files)", naming no folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt

pytestmark = pytest.mark.frameworks


def test_merging_a_trainer_lora_checkpoint_names_the_folder_it_leaves_files_of(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
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
    checkpoint = (tmp_path / "run" / "checkpoint-1").resolve()
    training_files = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    assert training_files <= {p.name for p in checkpoint.iterdir()}

    result = run_ckpt("merge", tiny_llama, checkpoint, tmp_path / "merged")
    assert result.exit_code == 0, result.stderr
    left_out = [line for line in result.stderr.splitlines() if "not in the output" in line]
    assert left_out, result.stderr
    assert not any(line.startswith("not in the output: / ") for line in left_out), left_out
    assert any(f"not in the output: {checkpoint}/ (" in line for line in left_out), left_out
    # and the merged model is the adapter folded into the base, as peft merges it
    peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tiny_llama), checkpoint)
    want = peft_model.merge_and_unload().state_dict()
    got = LlamaForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
