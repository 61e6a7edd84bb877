"""Run under torchrun (1 rank, gloo, CPU): a DeepSpeed ZeRO-2 run for `ckpt doctor`, saved every
2 steps with `engine.save_checkpoint` (`RUN/global_stepN/` + `latest`), resumed with DeepSpeed's
own `engine.load_checkpoint`, a component left out as its options allow.

Usage: torchrun --nproc-per-node 1 tests/doctor_deepspeed_job.py RUN MODE
MODE `fresh` trains steps 1-4 (saves 2 and 4); `clean`, `skip_scheduler` (load_lr_scheduler_states
False) or `skip_optimizer` (load_optimizer_states False) resume from `latest` up to step 8.
The model, config and WarmupLR schedule are `deepspeed_script.engine_for(2)`'s.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed_script  # the tests folder is the script's folder: on sys.path
import torch


def main(run: str, mode: str) -> None:
    engine = deepspeed_script.engine_for(2)
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
        x = torch.randn(2, 16, dtype=torch.bfloat16, generator=data)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step % 2 == 0:
            engine.save_checkpoint(run)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
