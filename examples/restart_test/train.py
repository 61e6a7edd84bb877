"""A tiny but real training run that saves resumable checkpoints: the restart test's subject.

A one-layer transformer learns a synthetic sequence task with AdamW, a warm-up + cosine
learning-rate schedule, dropout (so the RNG matters) and a shuffling data loader that keeps its
own position (so the data order matters). Every `--save-every` steps it saves everything needed
to continue the same run:

    model, optimizer, scheduler, step, RNG (torch + python), data loader (epoch, position, seed)

`--format torch` writes `step-N/state.pt` with `torch.save` into a hidden `.step-N.tmp/`
folder, renamed into place when complete; `--format dcp` writes `step-N/` with
`torch.distributed.checkpoint` (its `.metadata`, written last, marks it complete).
`--resume PATH` continues from a checkpoint; `--omit rng|dataloader` leaves that component
out of the saves, to show what an incomplete resumable checkpoint does to a resumed run.

Usage:
    python train.py --run-dir out/ --steps 24 --save-every 4 [--resume out/step-12]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB, DIM, SEQ, SAMPLES, BATCH = 32, 32, 12, 64, 8


class TinyTransformer(nn.Module):
    """Embedding, one transformer encoder layer with dropout, and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(
            DIM, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


class ShuffledLoader:
    """Batches of a fixed synthetic dataset, reshuffled every epoch, with resumable state.

    The order of epoch e is `randperm` under a generator seeded with `seed + e`, so the state
    is three integers: which epoch, how far into it, and the seed.
    """

    def __init__(self, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(0)
        self.inputs = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
        self.targets = (self.inputs * 3 + 1) % VOCAB  # a learnable token-wise mapping
        self.seed, self.epoch, self.position = seed, 0, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= SAMPLES:
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(
            SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        index = order[self.position : self.position + BATCH]
        self.position += BATCH
        return self.inputs[index], self.targets[index]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


def warmup_cosine(total: int, warmup: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def save(path: Path, state: dict[str, Any], fmt: str) -> None:
    """Save atomically: a hidden temporary folder renamed into place (torch), or DCP whose
    `.metadata` is written last."""
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path, no_dist=True)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pt", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def load(path: Path, template: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Load a checkpoint saved by `save` (weights_only for torch.save, in place for DCP)."""
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(template, checkpoint_id=path, no_dist=True)
        return template
    loaded: dict[str, Any] = torch.load(path / "state.pt", weights_only=True)
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--format", choices=["torch", "dcp"], default="torch")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--omit", choices=["rng", "dataloader"], action="append", default=[])
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to idle per step")
    args = parser.parse_args(argv)

    # determinism on CPU: one thread, deterministic kernels, a fixed seed before building
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps, 4))
    loader = ShuffledLoader()
    step = 0

    def full_state() -> dict[str, Any]:
        if args.format == "dcp":
            # DCP loads in place, so the optimizer state must exist before loading; the
            # distributed state-dict API creates it and keys it by parameter name
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
        else:
            model_state, optim_state = model.state_dict(), optimizer.state_dict()
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "step": step,
        }
        if "rng" not in args.omit:
            state["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if "dataloader" not in args.omit:
            state["dataloader"] = loader.state_dict()
        return state

    if args.resume is not None:
        state = load(args.resume, full_state(), args.format)
        if args.format == "dcp":
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
        if "dataloader" in state:
            loader.load_state_dict(state["dataloader"])
        print(f"resumed from {args.resume} at step {step}", flush=True)

    args.run_dir.mkdir(parents=True, exist_ok=True)
    model.train()
    while step < args.steps:
        inputs, targets = loader.next_batch()
        loss = nn.functional.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save(args.run_dir / f"step-{step}", full_state(), args.format)
            print(f"saved step {step}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
