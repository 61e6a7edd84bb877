"""Run under torchrun (2 ranks, gloo, CPU): train a tiny bf16 model with DeepSpeed ZeRO-2 and
ZeRO-3 for two steps each and save with `engine.save_checkpoint` (DeepSpeed's own writer).

Usage: torchrun --nproc-per-node 2 tests/deepspeed_script.py OUT_DIR
writes OUT_DIR/zero2/ and OUT_DIR/zero3/ (each: `latest`, `global_step2/`, zero_to_fp32.py).
"""

from __future__ import annotations

import os
import sys

# DeepSpeed picks its accelerator at import time; there is no GPU here
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

# the shared-memory all-reduce kernel is only a speed-up over gloo, and compiling it takes
# minutes on a fresh machine: leave it out (everything DeepSpeed saves is unchanged)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _train(stage: int, out: str) -> None:
    torch.manual_seed(stage)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model.register_buffer("scale", torch.arange(3, dtype=torch.float32))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
    }
    # DeepSpeed allocates its partitions with torch.empty, so the padding at the end of the
    # last rank's flat group (357 parameters over 2 ranks: one slot) holds whatever memory was
    # there, now and then a NaN that `verify --deep` rightly reports: zero it, as clean memory
    empty = torch.empty
    torch.empty = torch.zeros  # type: ignore[assignment]
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    finally:
        torch.empty = empty  # type: ignore[assignment]
    for _ in range(2):
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)


if __name__ == "__main__":
    _train(2, f"{sys.argv[1]}/zero2")
    _train(3, f"{sys.argv[1]}/zero3")
