"""A real (tiny) training run that saves through `ckpt_cli.Checkpointer` and resumes from it.

`python tests/checkpointer_worker.py RUN_DIR OUT --steps N --save-every K [--upload URL]
[--resume]` trains an MLP with dropout (the global RNG), AdamW, a StepLR schedule and a
shuffling `StatefulDataLoader` (single process) for steps 1..N, saving every K steps; with
`--resume` it first loads the newest complete save (`load_latest`) and continues from there.
Under torchrun (2 ranks, gloo) the model is wrapped in DDP and each rank draws its own batch
from a generator seeded by (step, rank). At the end rank R writes `OUT.rankR.pt`: the final
model and optimizer state dicts, the scheduler's state, where it resumed from and the
checkpointer's status. Nothing goes to stdout: the checkpointer logs to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first


class ShuffledBatches:
    """A data loader with a resumable position: 40 samples in batches of 8, reshuffled every
    epoch from a generator seeded by (seed, epoch); `state_dict` holds the epoch and the
    position in it (what torchdata's `StatefulDataLoader` keeps; its own shuffling generator
    is not restored across a later epoch boundary in torchdata 0.11, so it is not used here).
    """

    def __init__(self, seed: int, size: int = 40, batch_size: int = 8) -> None:
        data = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 16, generator=data)
        self.y = torch.randn(size, 4, generator=data)
        self.seed, self.batch_size = seed, batch_size
        self.epoch, self.position = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= len(self.x):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(
            len(self.x), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        )
        picked = order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.x[picked], self.y[picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--upload")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    trained: torch.nn.Module = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    loader: ShuffledBatches | None = None if distributed else ShuffledBatches(seed=7)

    def state(step: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "rng": {"torch": torch.get_rng_state()},
            "step": step,
        }
        if loader is not None:
            out["data"] = loader
        return out

    # --keep-last 0: no retention
    ck = Checkpointer(args.run_dir, keep_last=args.keep_last or None, upload=args.upload)
    start, tier = 0, None
    if args.resume:
        into = state(0)
        loaded = ck.load_latest(into=into)
        if loaded is not None:
            torch.set_rng_state(into["rng"]["torch"])
            start, tier = loaded.step, loaded.tier
            assert into["step"] == loaded.step

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if loader is None:
            g = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        return loader.next()

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step)
        loss = F.mse_loss(trained(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % args.save_every == 0:
            ck.save(step, state(step))
    ck.close()
    status = ck.status()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "start": start,
            "tier": tier,
            "status": json.dumps(status.model_dump(mode="json")),
        },
        f"{args.out}.rank{rank}.pt",
    )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
