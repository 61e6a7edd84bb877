"""A training loop that saves through `ckpt_cli.Checkpointer`, and one that resumes from it.

`python tests/checkpointer_reshard_worker.py save RUN_DIR OUT` trains a small MLP (AdamW, a
StepLR schedule, a Stateful data loader whose state has int dict keys and an empty dict) for 3
steps and saves step 3 with the model, optimizer, scheduler, loader and the plain values `rng`
(the torch RNG state) and `step`; rank R writes what it saved to `OUT.rankR.pt`.

`... load RUN_DIR OUT` builds the same objects afresh and resumes with `load_latest`, first
into the model, optimizer, scheduler and loader only, then (on a fresh Checkpointer) also into
the plain values; rank R writes what it loaded, or the error the second load raised, to
`OUT.rankR.pt`.

Both run in one process or under torchrun (gloo, the model in DDP, each rank its own RNG).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first


class Loader:
    """A data loader's resumable position; its state keys samples by int and has an empty dict
    (what DCP alone would bring back as str keys, and not at all)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.seen: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seen": dict(self.seen), "pending": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.seen = state["epoch"], dict(state["seen"])


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Loader]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, Loader()


def main() -> None:
    mode, run, out = sys.argv[1:4]
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    rank = dist.get_rank() if distributed else 0
    model, optimizer, scheduler, loader = build()
    trained: torch.nn.Module = model
    if distributed:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}
    if mode == "save":
        torch.manual_seed(100 + rank)  # each rank its own batches and RNG stream
        for step in range(1, 4):
            loss = F.mse_loss(trained(torch.randn(5, 8)), torch.randn(5, 4))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loader.epoch, loader.seen[step] = step // 2, 5 * step
        plain = {"rng": {"torch": torch.get_rng_state()}, "step": 3}
        with Checkpointer(run) as ck:
            ck.save(3, {**state, **plain})
            record = ck.wait()
            assert record is not None and record.phase == "done", record
        saved: dict[str, Any] = {**plain, "data": loader.state_dict()}
    else:
        loaded = Checkpointer(run).load_latest(into=state)
        assert loaded is not None and loaded.step == 3
        saved = {"data": loader.state_dict()}
        into = {**state, "rng": {"torch": None}, "step": 0}
        try:
            Checkpointer(run).load_latest(into=into)
            saved.update(rng=into["rng"], step=into["step"])
        except CkptError as error:
            saved["refused"] = str(error)
    saved["model"] = get_model_state_dict(model)
    saved["optimizer"] = get_optimizer_state_dict(model, optimizer)
    saved["scheduler"] = scheduler.state_dict()
    torch.save(saved, f"{out}.rank{rank}.pt")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
