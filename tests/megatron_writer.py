"""Write a Megatron-Core `torch_dist` checkpoint with megatron-core's own `dist_checkpointing`.

Run as a script (one process, gloo): `python megatron_writer.py save DIR` or `load DIR OUT.pt`
(megatron's own `dist_checkpointing.load` of DIR, saved with torch.save for the test to
compare). megatron-core calls `torch.cuda.synchronize` / `torch.cuda.current_device`
unconditionally in its writer; on a CPU-only machine they are stubbed here, in this
subprocess only (the "cpu" device makes its status tensors CPU tensors).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


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
    state.update({"iteration": 7, "checkpoint_version": 3.0, "args": {"lr": 0.1, "seed": 3}})
    return state


def main() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[-1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing

    if sys.argv[1] == "save":
        os.makedirs(sys.argv[2], exist_ok=True)
        dist_checkpointing.save(sharded_state(), sys.argv[2])
    else:
        loaded = dist_checkpointing.load(sharded_state(), sys.argv[2])
        torch.save(loaded, sys.argv[3])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
