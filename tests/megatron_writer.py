"""Write a Megatron-Core `torch_dist` checkpoint with megatron-core's own `dist_checkpointing`.

Run as a script (one process, gloo): `python megatron_writer.py save DIR` or `load DIR OUT.pt`
(megatron's own `dist_checkpointing.load` of DIR, saved with torch.save for the test to
compare). Under `torchrun` (2 ranks, gloo) the same modes save and load a tensor-parallel state
(`tp_state`): weights split across the ranks, a replicated one, and a per-rank `ShardedObject`
(what Megatron saves its RNG state as: `BYTE_IO` write items in the save plans it keeps in
`.metadata`) beside the common state; `load DIR OUT` writes `OUT.<rank>.pt` per rank.
With `MEGATRON_SCHEDULER=1` a save also holds Megatron-LM's LR scheduler (`scheduler_state`).
megatron-core calls `torch.cuda.synchronize` / `torch.cuda.current_device`
unconditionally in its writer; on a CPU-only machine they are stubbed here, in this
subprocess only (the "cpu" device makes its status tensors CPU tensors).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first

torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

#: the common state every rank shares (megatron writes it to common.pt, from rank 0)
COMMON = {"iteration": 7, "checkpoint_version": 3.0, "args": {"lr": 0.1, "seed": 3}}


def scheduler_state() -> dict[str, Any]:
    """Megatron-LM's LR scheduler as its `save_checkpoint` keeps it in the common state
    (`opt_param_scheduler`): megatron-core's own `OptimizerParamScheduler`, stepped by a
    global batch of 32 samples (Megatron-LM counts `num_steps` in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=0.1,
        min_lr=0.0,
        lr_warmup_steps=5,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    scheduler.step(32)
    return {"opt_param_scheduler": scheduler.state_dict()}


def sharded_state() -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.manual_seed(0)
    tensors = {
        "decoder.layers.0.weight": torch.randn(6, 4),
        "decoder.layers.0.bias": torch.randn(6),
        "embedding.weight": torch.randn(10, 4).to(torch.bfloat16),
    }
    state: dict[str, Any] = {
        name: ShardedTensor.from_rank_offsets(name, value, replica_id=0)
        for name, value in tensors.items()
    }
    # what every rank shares goes to common.pt
    state.update(COMMON)
    return state


def full_tensors() -> dict[str, torch.Tensor]:
    """The whole weights of the tensor-parallel state (the same on every rank)."""
    torch.manual_seed(0)
    return {
        # column-parallel: split along dim 0
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(8, 4),
        # row-parallel: split along dim 1
        "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(4, 6),
        # replicated on every rank (only replica 0 is written)
        "decoder.final_layernorm.weight": torch.randn(4).to(torch.bfloat16),
    }


def rank_object(rank: int) -> dict[str, Any]:
    """What each rank keeps of its own, like Megatron's `rng_state` ShardedObject."""
    generator = torch.Generator().manual_seed(100 + rank)
    return {
        "torch_rng_state": generator.get_state(),
        "rank": rank,
        "note": f"rank {rank}",
        "values": [rank, rank + 0.5],
    }


def tp_state(rank: int, world: int) -> dict[str, Any]:
    """This rank's share of a tensor-parallel state: split, replicated and per-rank objects."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = full_tensors()
    qkv, proj, norm = full.values()
    names = list(full)
    state: dict[str, Any] = {
        names[0]: ShardedTensor.from_rank_offsets(
            names[0], qkv.chunk(world, 0)[rank].clone(), (0, rank, world), replica_id=0
        ),
        names[1]: ShardedTensor.from_rank_offsets(
            names[1], proj.chunk(world, 1)[rank].clone(), (1, rank, world), replica_id=0
        ),
        names[2]: ShardedTensor.from_rank_offsets(names[2], norm.clone(), replica_id=rank),
        "rng_state": ShardedObject("rng_state", rank_object(rank), (world,), (rank,), replica_id=0),
    }
    state.update(COMMON)
    return state


def main() -> None:
    import torch.distributed as dist

    launched = "LOCAL_RANK" in os.environ  # under torchrun: the rendezvous is in the env
    if launched:
        dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
        rank, world = dist.get_rank(), dist.get_world_size()
        args = sys.argv[1:]
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", sys.argv[-1])
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=RANK_TIMEOUT)
        rank, world = 0, 1
        args = sys.argv[1:-1]
    from megatron.core import dist_checkpointing

    def state() -> dict[str, Any]:
        return tp_state(rank, world) if launched else sharded_state()

    if args[0] == "save":
        os.makedirs(args[1], exist_ok=True)
        saved = state()
        if os.environ.get("MEGATRON_SCHEDULER"):
            saved.update(scheduler_state())
        dist_checkpointing.save(saved, args[1])
    else:
        loaded = dist_checkpointing.load(state(), args[1])
        torch.save(loaded, f"{args[2]}.{rank}.pt" if launched else args[2])
    # every rank done with its collectives before any tears the group down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
