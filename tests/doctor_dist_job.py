"""A tiny training job under torchrun (gloo, CPU) for `ckpt doctor`'s world-size resumes.

    torchrun --standalone --nproc-per-node N tests/doctor_dist_job.py RUN PER_DEVICE LR [RESUME]

Every rank trains a small MLP wrapped in DDP (dropout on: each rank draws random numbers) on
its own `PER_DEVICE` samples of each global batch, AdamW at `LR` under a warm-up / decay
LambdaLR, for 8 steps, and every 2 steps all ranks save one DCP together with `dcp.save`
(`RUN/step-N/`): model and optimizer (`get_state_dict`), scheduler, the data position
(samples and batches seen, global), the run settings (`world_size`, `per_device_batch`,
`grad_accum`) and each rank's RNG under its own key (`rng.rank_R`).

With RESUME (`step-4`) the job first restores `RUN/RESUME` with `dcp.load` on however many
ranks it now runs, the way a resumed run does (`set_state_dict`, the scheduler, the data
position, this rank's RNG), then trains on to step 8. A learning rate other than the saved one
is applied after the scheduler's restore (a rescaled LR outlives its saved `base_lrs`).
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown  # the checkout is first

STEPS, EVERY, SAMPLES = 8, 2, 256


def schedule(step: int) -> float:
    """Warm-up over 3 steps, then a linear decay."""
    return min(1.0, (step + 1) / 3) * (1 - step / 12)


def main(run: Path, per_device: int, lr: float, resume: str | None) -> None:
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 1),
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    random.seed(100 + rank)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(SAMPLES, 8, generator=data), torch.randn(SAMPLES, 1, generator=data)
    counters = {"samples_seen": 0, "batches_seen": 0}
    step = 0

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "dataloader": dict(counters),
            "train_state": {
                "step": step,
                "world_size": world,
                "per_device_batch": per_device,
                "grad_accum": 1,
            },
            "rng": {
                f"rank_{rank}": {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
            },
        }

    if resume is not None:
        target = state()
        dcp.load(target, checkpoint_id=str(run / resume))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=target["model"],
            optim_state_dict=target["optimizer"],
        )
        scheduler.load_state_dict(target["scheduler"])
        if target["scheduler"]["base_lrs"] != [lr]:
            scheduler.base_lrs = [lr]
            for group in optimizer.param_groups:
                group["initial_lr"] = lr
                group["lr"] = lr * schedule(scheduler.last_epoch)
        counters = {k: int(v) for k, v in target["dataloader"].items()}
        step = int(target["train_state"]["step"])
        torch.set_rng_state(target["rng"][f"rank_{rank}"]["torch_cpu"])
        random.setstate(target["rng"][f"rank_{rank}"]["python"])

    while step < STEPS:
        step += 1
        start = (counters["samples_seen"] + rank * per_device) % SAMPLES
        x, y = xs[start : start + per_device], ys[start : start + per_device]
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counters["samples_seen"] += per_device * world
        counters["batches_seen"] += 1
        if step % EVERY == 0:
            dcp.save(state(), checkpoint_id=str(run / f"step-{step}"))
    dist.barrier()
    # not destroy_process_group(): gloo's teardown can deadlock on the GIL on a loaded machine
    leave_without_teardown()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        sys.argv[4] if len(sys.argv) > 4 else None,
    )
