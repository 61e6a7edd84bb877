"""Write and read torchtitan 0.3.0 checkpoints with torchtitan's own `CheckpointManager` on CPU.

Run in its own process (torchtitan's imports are heavy and register hooks):

    python tests/torchtitan_writer.py save RUN_DIR TRUTH.pt
        trains a tiny llama3 (2 layers, dim 16, SDPA attention) for 3 real AdamW steps with
        torchtitan's optimizer / LR-scheduler containers and its `ParallelAwareDataloader`,
        `CheckpointManager.save` after every step (`RUN_DIR/checkpoint/step-{1,2,3}`), and
        writes what step 3 held (torchtitan's own flattened state dict) to TRUTH.pt
    python tests/torchtitan_writer.py load RUN_DIR STEP OUT.pt
        builds a fresh model from another seed and restores `RUN_DIR/checkpoint/step-STEP` with
        `CheckpointManager.load(step=STEP)`, then writes what it restored to OUT.pt

Under torchrun (gloo, CPU) both modes run on every rank: each rank holds the whole model (plain
data parallelism over the same deterministic samples, so the replicas stay identical), its data
loader is `dp_rank` RANK of WORLD_SIZE, and `CheckpointManager` saves or loads one DCP
together. `save` writes TRUTH.pt from rank 0; `load` writes OUT.pt from rank 0 and
OUT.rank{r}.pt from every rank.

torchtitan's trainer wants CUDA; its model, optimizer, scheduler, data loader and checkpoint
manager do not. The stock language-model attention backends are flex / varlen, so the tiny
config swaps in `ScaledDotProductAttention` (the backend the issue names for CPU).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first

VOCAB, DIM, HEADS, LAYERS, SEQ = 32, 16, 2, 2, 8


class Tokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]], Stateful):
    """Deterministic token samples whose position is the state a resume needs."""

    def __init__(self) -> None:
        self.sample_idx = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            gen = torch.Generator().manual_seed(self.sample_idx)
            self.sample_idx += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=gen)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    """What torchtitan's `Trainer` saves as `train_state` (its own `state_dict`)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def model_config() -> Any:
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE

    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
            rope=ComplexRoPE.Config(
                dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _build(run: Path, seed: int) -> tuple[Any, ...]:
    """model, optimizers, schedulers, data loader, train state, checkpoint manager."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = model_config().build()
    model.init_weights(buffer_device=None)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=10)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=2)
    train_state = TrainState()
    manager = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=False
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(run),
    )
    return model, optimizers, schedulers, loader, train_state, manager


def flat_state(states: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`a.b.c` -> value for every leaf (what DCP itself stores per key)."""
    out: dict[str, Any] = {}
    for key, value in states.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_state(value, f"{name}."))
        else:
            out[name] = value
    return out


def _snapshot(manager: Any) -> dict[str, Any]:
    """What the manager saves (or just restored): its flattened state dict, plain values.

    Non-tensor leaves become 0-d tensors or stay as str/bytes-free lists so that the file
    loads with `torch.load(weights_only=True)`; the data loader's pickled bytes are dropped
    (the caller records the next batch instead, which is what that state decides)."""
    states = manager._flattened_model_states_sd()
    flat = flat_state(
        {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}
    )
    out: dict[str, Any] = {}
    for name, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
        elif isinstance(value, (bool, int, float)):
            out[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
            out[name] = list(value)
    return out


def save(run: Path, truth: Path) -> None:
    model, optimizers, schedulers, loader, train_state, manager = _build(run, seed=0)
    batches = iter(loader)
    for step in range(1, 4):
        inputs, labels = next(batches)
        logits = model(inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        train_state.ntokens_seen += labels.numel()
        manager.save(curr_step=step)
    snapshot = _snapshot(manager)
    snapshot["next_batch"] = next(batches)[0]["input"]
    if _rank() == 0:
        torch.save(snapshot, truth)
    manager.close()


def load(run: Path, step: int, out: Path) -> None:
    *_, loader, _, manager = _build(run, seed=1)
    assert manager.load(step=step), f"no checkpoint step-{step} under {run}"
    snapshot = _snapshot(manager)
    snapshot["next_batch"] = next(iter(loader))[0]["input"]
    if _rank() == 0:
        torch.save(snapshot, out)
    torch.save(snapshot, out.with_name(f"{out.stem}.rank{_rank()}{out.suffix}"))
    manager.close()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    if "LOCAL_RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        load(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
