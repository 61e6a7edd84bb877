"""torchrun worker: a Hugging Face Trainer run with FSDP2 (SHARDED_STATE_DICT) on CPU ranks.

`train OUT`: `Trainer(...).train()` of the suite's tiny Llama for 4 steps on the launch's ranks
(gloo), saving every 2: `OUT/checkpoint-{2,4}` hold what the Trainer with FSDP writes
(`pytorch_model_fsdp_0/` and `optimizer_0/` DCP folders, `scheduler.pt`, `rng_state_{r}.pth`,
`trainer_state.json`, `training_args.bin`).

`resume CKPT OUT REPORT`: the same Trainer resumed with `train(resume_from_checkpoint=CKPT)` on
this launch's ranks (any number). When the Trainer has loaded the checkpoint and starts
training, a callback gathers the full model and optimizer state (`get_state_dict`, full state
dict) and rank 0 saves it to `REPORT` with the step it resumed at; training then runs to step 4.

accelerate only turns FSDP on for accelerator devices (its `MULTI_CPU` state ignores the FSDP
plugin), so on CPU the shared `AcceleratorState` is switched to `DistributedType.FSDP` with the
Trainer's own plugin right after accelerate builds it (`fsdp_on_cpu`), before the Trainer
looks at it; from there on the Trainer and accelerate run their real FSDP paths (fully_shard
on a gloo CPU mesh, `save_fsdp_model` / `save_fsdp_optimizer`, `load_fsdp_*`).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.dist_helpers import RANK_TIMEOUT
from tests.framework_fixtures import Rows, tiny_config


def fsdp_on_cpu() -> None:
    """Make accelerate's state FSDP on CPU ranks when an FSDP plugin is given (see above)."""
    from accelerate import state as acc_state
    from accelerate.utils import DistributedType

    original = acc_state.AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    acc_state.AcceleratorState.__init__ = init  # type: ignore[method-assign]


def _trainer(out: str, callbacks: list[Any]) -> Any:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = LlamaForCausalLM(tiny_config())
    args = TrainingArguments(
        output_dir=out,
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
        ddp_backend="gloo",
    )
    return Trainer(model=model, args=args, train_dataset=Rows(), callbacks=callbacks)


def full_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full (unsharded) model and optimizer state dicts of an FSDP2 model, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    model_sd, optim_sd = get_state_dict(
        model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )

    def full(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, dict):
            return {k: full(v) for k, v in value.items()}
        if isinstance(value, list):
            return [full(v) for v in value]
        return value

    return full(model_sd), full(optim_sd)


def _resume_probe(report: Path) -> Any:
    from transformers import TrainerCallback

    class Probe(TrainerCallback):  # type: ignore[misc]
        """Saves what the Trainer restored, once, when training starts."""

        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trainer = self.trainer
            model_sd, optim_sd = full_state(trainer.model_wrapped, trainer.optimizer)
            if dist.get_rank() == 0:
                torch.save(
                    {
                        "model": model_sd,
                        "optimizer": optim_sd,
                        "global_step": state.global_step,
                        "world_size": dist.get_world_size(),
                    },
                    report,
                )

    return Probe()


def main() -> None:
    warnings.simplefilter("ignore")
    fsdp_on_cpu()
    mode = sys.argv[1]
    if mode == "train":
        trainer = _trainer(sys.argv[2], [])
        trainer.train()
    elif mode == "resume":
        ckpt, out, report = sys.argv[2], sys.argv[3], Path(sys.argv[4])
        probe = _resume_probe(report)
        trainer = _trainer(out, [probe])
        probe.trainer = trainer
        trainer.train(resume_from_checkpoint=ckpt)
        if dist.get_rank() == 0:
            saved = torch.load(report, weights_only=True)
            saved["final_step"] = trainer.state.global_step
            torch.save(saved, report)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    # the Trainer's own process group ignores `ddp_timeout` on CPU (torch's 30 minutes)
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    main()
