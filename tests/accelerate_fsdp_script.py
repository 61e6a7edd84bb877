"""torchrun worker: an accelerate training loop with FSDP2 (SHARDED_STATE_DICT) on CPU ranks.

`train OUT`: the suite's tiny Llama, AdamW and a LinearLR scheduler prepared by an
`Accelerator` with an FSDP2 plugin on the launch's ranks (gloo), 2 steps, then
`accelerator.save_state(OUT)`: `pytorch_model_fsdp_0/` and `optimizer_0/` DCP folders,
`scheduler.bin`, `sampler.bin`, `random_states_{r}.pkl`.

`resume CKPT REPORT`: the same objects prepared on this launch's ranks (any number), then
`accelerator.load_state(CKPT)`; rank 0 saves the full model and optimizer state
(`get_state_dict`, full state dict), the scheduler's state and the world size to REPORT.

accelerate turns FSDP on only for accelerator devices; on CPU the state is switched to FSDP
with the plugin given (`trainer_fsdp_script.fsdp_on_cpu`) and again before `save_state` /
`load_state` (`prepare()` wraps the model with `fully_shard`, then sets `MULTI_CPU` back), so
accelerate's own FSDP paths (`save_fsdp_model` / `save_fsdp_optimizer`, `load_fsdp_*`) run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.framework_fixtures import Rows, tiny_config
from tests.trainer_fsdp_script import fsdp_on_cpu, full_state


def _prepared() -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
    from transformers import LlamaForCausalLM

    set_seed(0)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = LlamaForCausalLM(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def _fsdp_paths(accelerator: Any) -> None:
    """prepare() wraps the model with fully_shard, then puts MULTI_CPU back (and training keeps
    it): save_state and load_state must take their FSDP paths."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP


def main() -> None:
    warnings.simplefilter("ignore")
    fsdp_on_cpu()
    accelerator, model, optimizer, loader, scheduler = _prepared()
    if sys.argv[1] == "train":
        for step, batch in enumerate(loader, 1):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step == 2:
                break
        _fsdp_paths(accelerator)
        accelerator.save_state(sys.argv[2])
    else:
        _fsdp_paths(accelerator)
        accelerator.load_state(sys.argv[2])
        model_sd, optim_sd = full_state(model, optimizer)
        if dist.get_rank() == 0:
            torch.save(
                {
                    "model": model_sd,
                    "optimizer": optim_sd,
                    "scheduler": scheduler.state_dict(),
                    "world_size": dist.get_world_size(),
                },
                sys.argv[3],
            )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
