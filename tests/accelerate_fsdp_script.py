"""Run under torchrun (2 ranks, gloo, CPU): accelerate's own FSDP2 `save_state` / `load_state`.

Usage:
  torchrun --nproc-per-node 2 tests/accelerate_fsdp_script.py save OUT STATE_DICT_TYPE
      trains two FSDP2 models (a tiny Llama and a small MLP, each with its AdamW and LinearLR)
      for 2 steps and writes OUT with `Accelerator.save_state`: with SHARDED_STATE_DICT
      `pytorch_model_fsdp_{0,1}/` and `optimizer_{0,1}/` (DCP folders written by both ranks),
      with FULL_STATE_DICT `pytorch_model_fsdp{,_1}.bin` and `optimizer{,_1}.bin` (rank 0's
      torch.save); both with `scheduler{,_1}.bin` and `random_states_{0,1}.pkl`.
  torchrun --nproc-per-node 2 tests/accelerate_fsdp_script.py save OUT RANK_FILES
      the same run saved with SHARDED_STATE_DICT through accelerate's `use_dcp=False` path of
      `save_fsdp_model` / `save_fsdp_optimizer` (per-rank torch.save files, for runs at a scale
      where DCP's collectives time out): `pytorch_model_fsdp_{0,1}_rank{0,1}.bin` and
      `optimizer_{0,1}_rank{0,1}.bin`, every rank its own, beside the same other files.
      `save_state` has no switch for it: the script binds `use_dcp=False` to the four functions
      `Accelerator` calls (save and load), and everything else is `save_state`'s own code.
  torchrun --nproc-per-node 2 tests/accelerate_fsdp_script.py save OUT PLAIN
      the same two models and run without FSDP: accelerate's plain multi-process (DDP, gloo)
      `save_state`, `model{,_1}.safetensors`, `optimizer{,_1}.bin`, `scheduler{,_1}.bin` from
      rank 0 and `random_states_{0,1}.pkl`, one per process.
  torchrun --nproc-per-node 2 tests/accelerate_fsdp_script.py load REPORT STATE_DICT_TYPE DIR...
      `Accelerator.load_state` of each DIR into freshly built models; REPORT (JSON, from rank 0)
      lists, for each DIR after the first, every model or optimizer tensor (gathered full),
      scheduler value or RNG stream whose restored value differs, bit for bit, from what the
      first DIR restored, on any rank (empty: restored the same). Each rank draws from its
      RNGs before every `load_state`, as a fresh process would hold other streams: a DIR
      whose RNG states `load_state` does not restore shows as an RNG difference.

Forcing the FSDP path on CPU: accelerate turns its FSDP plugin on only for GPU-like
distributed types (`AcceleratorState.__init__` keeps `MULTI_CPU` and drops the plugin on a gloo
CPU job), and FSDP1 refuses CPU altogether ("FSDP needs a non-CPU accelerator device"), so this
uses FSDP2 (`fully_shard`, which runs on CPU). The script sets `accelerator.state.distributed_type
= DistributedType.FSDP` and `accelerator.state.fsdp_plugin` itself before `prepare()` (so
`prepare` applies `fully_shard` the way it does on GPUs), and again after `prepare()` and before
every `save_state` / `load_state`: the training step publishes `MULTI_CPU` again (the value the
process group was set up with), and `save_state` would then write the models as plain
`model.safetensors`. Everything written is accelerate's own code from there on
(`save_fsdp_model`, `save_fsdp_optimizer`, `save_accelerator_state`).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType, InitProcessGroupKwargs, set_seed
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first
from tests.framework_fixtures import tiny_config

#: the `save` / `load` mode of accelerate's plain multi-process path (DDP, no FSDP)
PLAIN = "PLAIN"


def _force_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """accelerate's FSDP path on a CPU job (see the module docstring); none in `PLAIN` mode."""
    if plugin is None:
        return
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def _setup(
    state_dict_type: str,
) -> tuple[Accelerator, FullyShardedDataParallelPlugin | None, list[Any]]:
    """Two models, each with its optimizer and scheduler, prepared by accelerate under FSDP2
    (under DDP in `PLAIN` mode)."""
    from transformers import LlamaForCausalLM

    set_seed(0)
    plugin = None
    if state_dict_type != PLAIN:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type=state_dict_type, cpu_ram_efficient_loading=False
        )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=RANK_TIMEOUT)],
    )
    _force_fsdp(accelerator, plugin)
    parts: list[Any] = []
    for model in (
        LlamaForCausalLM(tiny_config()),
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
    ):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4)
        # FSDP2 prepares one model per call: a second call makes it model 1 (`_1` names)
        parts.append(list(accelerator.prepare(model, optimizer, scheduler)))
    _force_fsdp(accelerator, plugin)
    return accelerator, plugin, parts


def _train(accelerator: Accelerator, parts: list[Any]) -> None:
    gen = torch.Generator().manual_seed(1 + accelerator.process_index)
    for _ in range(2):
        (llama, opt0, sched0), (mlp, opt1, sched1) = parts
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        # dropout-free models: the loss still draws from the RNG through torch.randn below
        loss = llama(input_ids=ids, labels=ids).loss
        loss = loss + mlp(torch.randn(2, 8)).pow(2).mean()
        accelerator.backward(loss)
        for opt, sched in ((opt0, sched0), (opt1, sched1)):
            opt.step()
            sched.step()
            opt.zero_grad()


def _restored(parts: list[Any]) -> dict[str, Any]:
    """Everything `load_state` restored, gathered whole (collective: every rank calls it)."""
    import random

    import numpy as np

    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    out: dict[str, Any] = {}
    for i, (model, opt, sched) in enumerate(parts):
        out[f"model_{i}"] = get_model_state_dict(model, options=full)
        out[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt.optimizer, options=full)
        out[f"scheduler_{i}"] = sched.scheduler.state_dict()
    out["rng"] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads and signed zeros compared too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any, where: str, found: list[str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
        if not ok:
            found.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            found.append(f"{where} keys {sorted(map(str, set(a) ^ set(b)))}")
        for key in set(a) & set(b):
            _same(a[key], b[key], f"{where}.{key}", found)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            found.append(f"{where} length")
        for n, (x, y) in enumerate(zip(a, b, strict=False)):
            _same(x, y, f"{where}.{n}", found)
    elif type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        if not np.array_equal(np.asarray(a), np.asarray(b)):
            found.append(where)
    elif a != b:
        found.append(where)


def _scramble_rng(rank: int) -> None:
    """Draw from every RNG `save_state` saves: what `load_state` does not restore then
    differs from what another load restored."""
    import random

    import numpy as np

    for _ in range(rank + 1):
        torch.rand(3)
        random.random()
        np.random.rand()


#: the `save` mode writing accelerate's per-rank files (`use_dcp=False`)
RANK_FILES = "RANK_FILES"


def _per_rank_files() -> None:
    """`Accelerator.save_state` / `load_state` through `use_dcp=False` (per-rank torch.save):
    the functions accelerate imported by name, bound to it (see the module docstring)."""
    import functools

    import accelerate.accelerator as accelerator_module
    from accelerate.utils import fsdp_utils

    for name in (
        "save_fsdp_model",
        "save_fsdp_optimizer",
        "load_fsdp_model",
        "load_fsdp_optimizer",
    ):
        bound = functools.partial(getattr(fsdp_utils, name), use_dcp=False)
        setattr(accelerator_module, name, bound)


def save(out: str, state_dict_type: str) -> None:
    if state_dict_type == RANK_FILES:
        _per_rank_files()
        state_dict_type = "SHARDED_STATE_DICT"
    accelerator, plugin, parts = _setup(state_dict_type)
    _train(accelerator, parts)
    _force_fsdp(accelerator, plugin)
    accelerator.save_state(out)
    # plain `save_state` ends without a barrier: rank 0 may still be writing the model
    accelerator.wait_for_everyone()
    # the truth the tests judge ckpt's outputs by: what `load_state` restores from OUT
    accelerator.load_state(out)
    restored = _restored(parts)
    if accelerator.is_main_process:
        torch.save({k: v for k, v in restored.items() if k != "rng"}, f"{out}.restored.pt")


def load(report: str, state_dict_type: str, folders: list[str]) -> None:
    if state_dict_type == RANK_FILES:
        _per_rank_files()
        state_dict_type = "SHARDED_STATE_DICT"
    accelerator, plugin, parts = _setup(state_dict_type)
    results: dict[str, list[str]] = {}
    first: dict[str, Any] | None = None
    for folder in folders:
        _scramble_rng(accelerator.process_index)
        _force_fsdp(accelerator, plugin)
        accelerator.load_state(folder)
        got = _restored(parts)
        if first is None:
            first = got
            continue
        found: list[str] = []
        _same(first, got, "", found)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        results[folder] = [f"rank {r}: {w}" for r, ws in enumerate(gathered) for w in ws]
    if accelerator.is_main_process:
        with open(report, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    if sys.argv[1] == "save":
        save(sys.argv[2], sys.argv[3])
    else:
        load(sys.argv[2], sys.argv[3], sys.argv[4:])
