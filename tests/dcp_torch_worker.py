"""torchrun worker: `save DIR` writes a Shard(0) DTensor checkpoint whose small tensors leave
ranks with empty chunks (a 1-row tensor, a 0-row tensor, 2 rows on 3 ranks), the way FSDP2
saves such parameters; rank 0 writes the full values to DIR.expected.pt in the layout
`reshard_worker.load` checks against."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown  # the checkout is first


def save(folder: Path) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = {
        "model.row": torch.randn(1, 4),
        "model.empty": torch.zeros(0, 4),
        "model.pair": torch.randn(2, 3),
        "model.w": torch.randn(7, 2),
    }
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(state, checkpoint_id=str(folder))
    if dist.get_rank() == 0:
        torch.save({"tensors": full, "objects": {}}, f"{folder}.expected.pt")


def main() -> None:
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    save(Path(sys.argv[2]))
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
