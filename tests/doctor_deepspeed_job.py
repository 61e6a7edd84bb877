"""Run under torchrun (gloo, CPU): a DeepSpeed ZeRO-2 run for `ckpt doctor`, saved every 2 steps
with `engine.save_checkpoint` (`RUN/global_stepN/` + `latest`), resumed with DeepSpeed's own
`engine.load_checkpoint`, a component left out as its options allow.

Usage: torchrun --nproc-per-node N tests/doctor_deepspeed_job.py RUN MODE
MODE `fresh` trains steps 1-4 (saves 2 and 4); `clean`, `skip_scheduler` (load_lr_scheduler_states
False), `skip_optimizer` (load_optimizer_states False) or `accum2` (2 micro-batches of
gradient accumulation per step: a global batch kept on half the ranks) resume from `latest` up
to step 8. The model and WarmupLR schedule are `deepspeed_script.engine_for(2)`'s.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed_script  # the tests folder is the script's folder: on sys.path
import torch


def _engine(accumulation: int) -> deepspeed.DeepSpeedEngine:
    if accumulation == 1:
        return deepspeed_script.engine_for(2)
    # engine_for(2)'s model and config, with gradient accumulation
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model.register_buffer("scale", torch.arange(3, dtype=torch.float32))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def main(run: str, mode: str) -> None:
    accumulation = 2 if mode == "accum2" else 1
    engine = _engine(accumulation)
    start = 0
    if mode != "fresh":
        path, _ = engine.load_checkpoint(
            run,
            load_optimizer_states=mode != "skip_optimizer",
            load_lr_scheduler_states=mode != "skip_scheduler",
        )
        assert path is not None, f"DeepSpeed loaded nothing from {run}"
        start = engine.global_steps
    data = torch.Generator().manual_seed(3)
    for step in range(start + 1, (4 if mode == "fresh" else 8) + 1):
        for _ in range(accumulation):
            x = torch.randn(2, 16, dtype=torch.bfloat16, generator=data)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == step
        if step % 2 == 0:
            engine.save_checkpoint(run)


if __name__ == "__main__":
    deepspeed_script.init_distributed()
    main(sys.argv[1], sys.argv[2])
