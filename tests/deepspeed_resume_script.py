"""Run under torchrun (N ranks, gloo, CPU): load ZeRO saves with DeepSpeed's own
`engine.load_checkpoint` at this world size, record the full training state it restored, then
train one more step.

Usage: torchrun --nproc-per-node N tests/deepspeed_resume_script.py OUT_DIR STAGE:RUN_DIR...

STAGE is `2`, `3`, or `3-SIZE` for ZeRO-3 with `sub_group_size` SIZE. For each STAGE:RUN_DIR it
builds the engine of `deepspeed_script.engine_for(STAGE, SIZE)` (the same
model and config the save was trained with), loads RUN_DIR (its `latest` tag) and writes
OUT_DIR/<index>.pt from rank 0: the fp32 master weights and every optimizer state tensor
gathered whole per parameter (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`:
DeepSpeed's own gathering across the ZeRO partitions), the optimizer step counts, the
engine's `global_steps` / `global_samples`, the LR scheduler's state and the learning rate;
then the loss and `global_steps` after one more training step.
"""

from __future__ import annotations

import math
import sys

import deepspeed_script  # the tests folder is the script's folder: on sys.path
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state


def _resume(stage: int, sub_group_size: int | None, run: str) -> dict[str, object]:
    engine = deepspeed_script.engine_for(stage, sub_group_size)
    path, _client = engine.load_checkpoint(run)
    assert path is not None, f"DeepSpeed loaded nothing from {run}"
    # ZeRO-1/2 link each parameter to its optimizer-state fragments at the first step; link
    # them now, as that step would, so the state can be gathered before it changes
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    fp32: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in engine.module.named_parameters():
        fp32[name] = safe_get_full_fp32_param(param).clone()
        states[name] = {
            key: safe_get_full_optimizer_state(param, key).clone()
            for key in ("exp_avg", "exp_avg_sq")
        }
    steps = sorted(
        {
            float(state["step"])
            for state in engine.optimizer.optimizer.state.values()
            if "step" in state
        }
    )
    restored = {
        "fp32": fp32,
        "optimizer": states,
        "steps": steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "scheduler": engine.lr_scheduler.state_dict(),
        "lr": [group["lr"] for group in engine.optimizer.param_groups],
        "world_size": dist.get_world_size(),
    }
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    restored["loss"] = float(loss)
    restored["global_steps_after"] = engine.global_steps
    restored["finite_after"] = all(
        math.isfinite(float(safe_get_full_fp32_param(p).abs().sum()))
        for p in engine.module.parameters()
    )
    engine.destroy()
    return restored


if __name__ == "__main__":
    deepspeed_script.init_distributed()
    out = sys.argv[1]
    for index, task in enumerate(sys.argv[2:]):
        kind, run = task.split(":", 1)
        stage, _, size = kind.partition("-")
        result = _resume(int(stage), int(size) if size else None, run)
        if dist.get_rank() == 0:
            torch.save(result, f"{out}/{index}.pt")
        dist.barrier()
