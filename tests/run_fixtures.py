"""Run folders in the layouts training jobs leave behind, written by the real writers.

Every builder writes tiny checkpoints, then ages them (an hour old) so they are outside the
settle window, the way a finished save looks to a later `ckpt prune`; tests that need a save
"still being written" write one afterwards and leave it fresh.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

HOUR = 3600.0

#: eval_loss logged at each Trainer save: the best (200) is not the newest
EVAL_LOSS = {100: 0.90, 200: 0.40, 300: 0.70, 400: 0.65, 500: 0.60}


class LossWindow:
    """What scripts register with accelerate (`register_for_checkpointing`): the last losses,
    in a deque (not a plain value), so accelerate pickles the object whole."""

    def __init__(self) -> None:
        self.recent: collections.deque[float] = collections.deque(maxlen=4)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": self.recent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = state["recent"]


def weights(step: int) -> dict[str, torch.Tensor]:
    """A tiny model whose values depend on the step (so copies can be told apart)."""
    gen = torch.Generator().manual_seed(step)
    return {
        "model.layers.0.weight": torch.randn(8, 4, generator=gen),
        "model.layers.1.weight": torch.randn(8, 4, generator=gen),
        "model.embed.weight": torch.randn(16, 4, generator=gen).to(torch.bfloat16),
    }


def age(path: Path, seconds: float = HOUR) -> None:
    """Set the mtime of `path` and everything under it `seconds` into the past."""
    stamp = time.time() - seconds
    targets = [path]
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirs, files in os.walk(path):
            targets += [Path(dirpath, n) for n in dirs + files]
    for target in targets:
        os.utime(target, (stamp, stamp), follow_symlinks=False)


def trainer_checkpoint(folder: Path, step: int, *, shards: bool = False) -> None:
    """A Hugging Face Trainer `checkpoint-N/`: model, optimizer, scheduler, rng, trainer_state."""
    folder.mkdir(parents=True)
    model = weights(step)
    if shards:
        save_torch_state_dict(model, folder, max_shard_size=300)
    else:
        save_file(model, folder / "model.safetensors", metadata={"format": "pt"})
    params = list(model)
    torch.save(
        {
            "state": {
                i: {"step": torch.tensor(float(step)), "exp_avg": t}
                for i, t in enumerate(model.values())
            },
            "param_groups": [{"lr": 1e-3, "params": list(range(len(params)))}],
        },
        folder / "optimizer.pt",
    )
    torch.save({"last_epoch": step, "_last_lr": [1e-3]}, folder / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, folder / "rng_state.pth")
    history = [
        row
        for s, loss in EVAL_LOSS.items()
        if s <= step
        for row in ({"step": s, "loss": loss + 0.1}, {"step": s, "eval_loss": loss})
    ]
    logged = [s for s in EVAL_LOSS if s <= step]
    best = min(logged, key=lambda s: EVAL_LOSS[s]) if logged else None
    state = {
        "global_step": step,
        "epoch": step / 100,
        "best_metric": EVAL_LOSS[best] if best else None,
        "best_model_checkpoint": f"out/checkpoint-{best}" if best else None,
        "log_history": history,
    }
    (folder / "trainer_state.json").write_text(json.dumps(state))


def trainer_run(root: Path, steps: tuple[int, ...] = (100, 200, 300, 400, 500)) -> Path:
    """`out/checkpoint-N` for each step, aged; the best by eval_loss is checkpoint-200."""
    out = root / "out"
    for step in steps:
        trainer_checkpoint(out / f"checkpoint-{step}", step, shards=step == 300)
    age(out)
    return out


def interrupted_trainer_save(out: Path, step: int) -> Path:
    """A preempted Trainer save: model file cut short, no trainer_state.json, aged."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir()
    save_file(weights(step), folder / "model.safetensors")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    age(folder)
    return folder


#: the states torchtitan's `CheckpointManager` saves beside the model at every step but a
#: final model-only export (`last_save_model_only`)
TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


class _Tiny(torch.nn.Module):
    """A module whose state dict is `weights(step)` (what the optimizer's FQNs name)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 8, bias=False) for _ in range(2))
        self.model.embed = torch.nn.Embedding(16, 4, dtype=torch.bfloat16)


def titan_states(step: int, nested: bool = True) -> dict[str, object]:
    """What torchtitan's `CheckpointManager` hands `dcp.save` at an interval save: the model
    (under `model`, as torchtitan before 0.2 kept it; `nested=False`: its FQNs at the top level,
    as 0.3 flattens them, `layers.0.weight`...), its AdamW state flattened by FQN (`get_optimizer_state_dict` with
    `flatten_optimizer_state_dict`, what its `OptimizersContainer` saves), the LR scheduler's
    state, the data loader's pickled per-rank state and `world_size`, and `train_state`."""
    import pickle

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    tiny = _Tiny()
    tiny.load_state_dict(weights(step))
    # torchtitan 0.3's models hold their layers at the top (`layers.0...`, `tok_embeddings`)
    module = tiny if nested else tiny.model
    # lr 0: the moments are real, the weights stay `weights(step)`
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.0)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(step):
            scheduler.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = module.state_dict()
    return {
        **({"model": model} if nested else model),
        "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
        "lr_scheduler": scheduler.state_dict(),
        "dataloader": {"dp_rank_0": pickle.dumps({"sample_idx": step}), "world_size": 1},
        "train_state": {"step": step, "ntokens_seen": 8 * step},
    }


def dcp_save(
    folder: Path, step: int, *, states: tuple[str, ...] = TITAN_STATES, nested: bool = True
) -> None:
    """One torchtitan DCP step folder, written by `dcp.save` in a single process as its
    `CheckpointManager` does (`titan_states`); `states`: which of its states it holds (none:
    a model-only save, torchtitan's seed checkpoint or `last_save_model_only` export)."""
    import torch.distributed.checkpoint as dcp

    full = titan_states(step, nested)
    state = {k: v for k, v in full.items() if k not in TITAN_STATES or k in states}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def accelerate_run(run: Path, saves: int, *, processes: int = 1) -> tuple[Any, list[Path]]:
    """An accelerate loop on CPU of `saves` steps, each saved by `save_state` with automatic
    naming (`run/checkpoints/checkpoint_N`); with `processes=2`, each save also holds what
    process 1 of a 2-process DDP run writes beside rank 0's files (`random_states_1.pkl`).
    The Accelerator (for `load_state`) and the save folders."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=str(run), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    folders = [run / "checkpoints" / f"checkpoint_{i}" for i in range(saves)]
    for save in folders:
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
        for rank in range(1, processes):
            shutil.copy(save / "random_states_0.pkl", save / f"random_states_{rank}.pkl")
    return accelerator, folders
