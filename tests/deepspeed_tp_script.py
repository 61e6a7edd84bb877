"""Run under torchrun (4 ranks, gloo, CPU): DeepSpeed ZeRO-2 and ZeRO-3 with tensor (model)
parallelism, 2 data-parallel x 2 model-parallel ranks, saved with `engine.save_checkpoint`.

DeepSpeed learns the process groups from an `mpu` object (as Megatron-LM passes its own):
ranks {0, 1} and {2, 3} are the model-parallel groups, {0, 2} and {1, 3} the data-parallel
ones. Each model-parallel rank holds its own slice of the model (here: its own values, seeded
by the mp rank), so each mp rank's files rebuild a different state dict.

Usage: torchrun --nproc-per-node 4 tests/deepspeed_tp_script.py OUT_DIR
writes OUT_DIR/zero2/ and OUT_DIR/zero3/ (`latest`, `global_step2/` with
`[zero_pp_rank_D_]mp_rank_0M_model_states.pt` and `*zero_pp_rank_D_mp_rank_0M_optim_states.pt`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

MP = 2


class Mpu:
    """The model-/data-parallel groups DeepSpeed asks a Megatron-style `mpu` for."""

    def __init__(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.mp_rank, self.dp_rank = rank % MP, rank // MP
        self.mp_group: Any = None
        self.dp_group: Any = None
        # every rank creates every group, in the same order (new_group is collective)
        for start in range(0, world, MP):
            group = dist.new_group(list(range(start, start + MP)))
            if rank in range(start, start + MP):
                self.mp_group = group
        for offset in range(MP):
            group = dist.new_group(list(range(offset, world, MP)))
            if rank % MP == offset:
                self.dp_group = group
        self.world = world

    def get_model_parallel_rank(self) -> int:
        return self.mp_rank

    def get_model_parallel_world_size(self) -> int:
        return MP

    def get_model_parallel_group(self) -> Any:
        return self.mp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.world // MP

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    # DeepSpeed also asks the tensor-parallel spellings
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def _train(stage: int, out: str, mpu: Mpu) -> None:
    torch.manual_seed(10 * stage + mpu.mp_rank)  # each mp rank: its own slice of the model
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu
    )
    for _ in range(2):
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)


if __name__ == "__main__":
    deepspeed.init_distributed("gloo", timeout=RANK_TIMEOUT)
    mpu = Mpu()
    _train(2, f"{sys.argv[1]}/zero2", mpu)
    _train(3, f"{sys.argv[1]}/zero3", mpu)
