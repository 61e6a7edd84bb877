"""Build the bundled demo: a small sharded safetensors model written by huggingface_hub, a
Hugging Face Trainer-style `checkpoint-4/` from a tiny model really trained for four steps, and a
run folder `run/` of that training saved every two steps, its last save interrupted.

The Trainer folder holds the files transformers writes (`model.safetensors`, `optimizer.pt`,
`scheduler.pt`, `rng_state.pth`, `trainer_state.json`, `training_args.bin`, `config.json`),
written here the same way without depending on transformers.

Usage: python examples/make_demo.py DEST
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file


def tiny_transformer_state(
    layers: int = 4, dim: int = 64, vocab: int = 256
) -> dict[str, torch.Tensor]:
    """Weights shaped like a small Llama-style model (deterministic)."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, dim, generator=gen)
    }
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{prefix}.self_attn.{proj}.weight"] = torch.randn(dim, dim, generator=gen)
        state[f"{prefix}.mlp.up_proj.weight"] = torch.randn(4 * dim, dim, generator=gen)
        state[f"{prefix}.mlp.down_proj.weight"] = torch.randn(dim, 4 * dim, generator=gen)
        state[f"{prefix}.input_layernorm.weight"] = torch.ones(dim)
        state[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(dim)
    state["model.norm.weight"] = torch.ones(dim)
    state["lm_head.weight"] = torch.randn(vocab, dim, generator=gen)
    return {k: v.to(torch.bfloat16) if "proj" in k else v for k, v in state.items()}


class TinyLM(torch.nn.Module):
    """A next-token model small enough to train in milliseconds (with dropout, so RNG matters)."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens))
        x = x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))
        logits: torch.Tensor = self.head(x)
        return logits


@dataclasses.dataclass
class DemoTrainingArguments:
    """Stands in for transformers' TrainingArguments: `training_args.bin` pickles a dataclass."""

    output_dir: str
    learning_rate: float = 1e-3
    max_steps: int = 8
    save_steps: int = 4
    seed: int = 42


def linear_warmup(warmup: int, total: int) -> Any:
    """transformers' get_linear_schedule_with_warmup as a LambdaLR factor."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def save_trainer_checkpoint(run_dir: Path, steps: int = 4, seed: int = 42) -> Path:
    """Train `TinyLM` for `steps` AdamW steps and save `run_dir/checkpoint-{steps}` as the
    Trainer does. Returns the checkpoint folder."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = TinyLM()
    args = DemoTrainingArguments(output_dir=str(run_dir), save_steps=steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(2, args.max_steps))
    data = torch.randint(0, 64, (64, 16))
    batch_size = 8
    log_history: list[dict[str, Any]] = []
    model.train()
    for step in range(1, steps + 1):
        batch = data[torch.randperm(len(data))[:batch_size]]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        log_history.append(
            {
                "epoch": step * batch_size / len(data),
                "grad_norm": float(grad_norm),
                "learning_rate": scheduler.get_last_lr()[0],
                "loss": round(loss.item(), 4),
                "step": step,
            }
        )
    out = run_dir / f"checkpoint-{steps}"
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(
        json.dumps({"model_type": "tiny-lm", "vocab_size": 64, "hidden_size": 32}, indent=2)
    )
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    torch.save(scheduler.state_dict(), out / "scheduler.pt")
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
        out / "rng_state.pth",
    )
    torch.save(args, out / "training_args.bin")
    state = {
        "best_global_step": None,
        "best_metric": None,
        "best_model_checkpoint": None,
        "epoch": steps * batch_size / len(data),
        "eval_steps": 500,
        "global_step": steps,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": log_history,
        "logging_steps": 1,
        "max_steps": args.max_steps,
        "num_input_tokens_seen": 0,
        "num_train_epochs": math.ceil(args.max_steps * batch_size / len(data)),
        "save_steps": args.save_steps,
        "stateful_callbacks": {
            "TrainerControl": {
                "args": {
                    "should_epoch_stop": False,
                    "should_evaluate": False,
                    "should_log": False,
                    "should_save": True,
                    "should_training_stop": False,
                },
                "attributes": {},
            }
        },
        "total_flos": 0.0,
        "train_batch_size": batch_size,
        "trial_name": None,
        "trial_params": None,
    }
    # transformers' TrainerState.save_to_json
    (out / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    return out


def save_demo_run(run_dir: Path, now: float | None = None) -> Path:
    """A Trainer run folder: `checkpoint-{2,4,6}` complete, `checkpoint-8` interrupted before
    the Trainer wrote its `trainer_state.json` (it writes it last). The saves are dated an hour
    apart, the newest an hour ago, so the run reads as one that stopped, not one still writing
    (`ckpt prune` never touches a save modified in the last two minutes)."""
    now = time.time() if now is None else now
    for steps in (2, 4, 6, 8):
        folder = save_trainer_checkpoint(run_dir, steps=steps)
        if steps == 8:
            (folder / "trainer_state.json").unlink()
        saved_at = now - (10 - steps) / 2 * 3600
        for path in folder.iterdir():
            os.utime(path, (saved_at, saved_at))
        os.utime(folder, (saved_at, saved_at))
    return run_dir


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "build/demo")
    model_dir = dest / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(tiny_transformer_state(), model_dir, max_shard_size="100KB")
    print(f"wrote {model_dir}")
    print(f"wrote {save_trainer_checkpoint(dest)}")
    print(f"wrote {save_demo_run(dest / 'run')}")


if __name__ == "__main__":
    main()
