"""Run under torchrun (2 ranks, gloo, CPU): train a tiny bf16 model with DeepSpeed ZeRO-1, 2
and 3 for two steps each and save with `engine.save_checkpoint` (DeepSpeed's own writer).

Usage:
  torchrun --nproc-per-node 2 tests/deepspeed_script.py OUT_DIR [--nan-padding|--hf|--trainer|--tags|--no-latest]
  torchrun --nproc-per-node N tests/deepspeed_script.py OUT_DIR --trainer-resume CHECKPOINT
writes OUT_DIR/zero1/, OUT_DIR/zero2/ and OUT_DIR/zero3/ (each: `latest`, `global_step2/`,
zero_to_fp32.py), and OUT_DIR/zero3-subgroups/ (ZeRO-3 with `sub_group_size` 100: two
sub-groups).

With `--nan-padding` it trains ZeRO-3 only and plants NaN where DeepSpeed's uninitialised
partition padding may hold one: OUT_DIR/zero3-nan-padding/ has NaN in every padding slot of
the fp32 partitions (and nowhere else); OUT_DIR/zero3-nan-parameter/ is the same engine saved
again after one real parameter element was set to NaN.

With `--hf` it trains the suite's tiny Hugging Face Llama with ZeRO-3 instead (`_train_hf`);
with `--trainer`, transformers' `Trainer` trains it with ZeRO-2 (`_train_trainer`); with `--tags`,
OUT_DIR/tagged/ holds ZeRO-2 saves under tags of the script's own (`_train_tagged`); with
`--no-latest`, OUT_DIR/no-latest/ holds ZeRO-2 saves made with `save_latest=False`
(`_train_without_latest`).
"""

from __future__ import annotations

import os
import sys

# DeepSpeed picks its accelerator at import time; there is no GPU here
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

from tests.dist_helpers import RANK_TIMEOUT  # the launcher puts the checkout first

# the shared-memory all-reduce kernel is only a speed-up over gloo, and compiling it takes
# minutes on a fresh machine: leave it out (everything DeepSpeed saves is unchanged)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed() -> None:
    """The process group (gloo), with the suite's `RANK_TIMEOUT`: the one `deepspeed.initialize`
    or the Trainer would start (the Trainer ignores `ddp_timeout` on CPU) waits 30 minutes for
    a dead or stuck peer."""
    deepspeed.init_distributed("gloo", timeout=RANK_TIMEOUT)


def _plant_nan_in_padding(engine: deepspeed.DeepSpeedEngine) -> int:
    """NaN in the padding of this rank's ZeRO-3 fp32 partitions; returns how many slots.

    Every parameter is cut into `world_size` pieces of `partition_numel()` elements; on rank r
    the piece holds `ds_numel - r * partition_numel()` real elements at most, the rest is the
    padding DeepSpeed allocates with torch.empty (the layout `zero_to_fp32.py` reads).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    optimizer = engine.optimizer
    planted = 0
    for g, params in enumerate(optimizer.fp16_groups):
        flat = optimizer.fp32_partitioned_groups_flat[g]
        offset = 0
        for param in params:
            part = param.partition_numel()
            real = max(0, min(part, param.ds_numel - rank * part))
            flat.data[offset + real : offset + part] = float("nan")
            planted += part - real
            offset += part
    return planted


def engine_for(stage: int, sub_group_size: int | None = None) -> deepspeed.DeepSpeedEngine:
    """The tiny bf16 model and DeepSpeed config of a ZeRO `stage` run, as an engine (the
    resume worker builds the same one to load a save into). `sub_group_size` splits ZeRO-3's
    flat partitions into several sub-groups."""
    torch.manual_seed(stage)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model.register_buffer("scale", torch.arange(3, dtype=torch.float32))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage}
        | ({"sub_group_size": sub_group_size} if sub_group_size else {}),
        "bf16": {"enabled": True},
    }
    # DeepSpeed allocates its partitions with torch.empty, so the padding at the end of the
    # last rank's flat group (357 parameters over 2 ranks: one slot) holds whatever memory was
    # there, now and then a NaN that `verify --deep` rightly reports: zero it, as clean memory
    empty = torch.empty
    torch.empty = torch.zeros  # type: ignore[assignment]
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    finally:
        torch.empty = empty  # type: ignore[assignment]
    return engine


def _train(
    stage: int, out: str, nan_padding: bool = False, sub_group_size: int | None = None
) -> None:
    engine = engine_for(stage, sub_group_size)
    for _ in range(2):
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    if not nan_padding:
        engine.save_checkpoint(out)
        return
    import torch.distributed as dist

    planted = torch.tensor([_plant_nan_in_padding(engine)])
    dist.all_reduce(planted)
    assert planted.item() > 0, "the model has no ZeRO-3 padding to plant NaN in"
    engine.save_checkpoint(f"{out}-nan-padding")
    # one real element of rank 0's partition (the first parameter's first value)
    if dist.get_rank() == 0:
        engine.optimizer.fp32_partitioned_groups_flat[0].data[0] = float("nan")
    engine.save_checkpoint(f"{out}-nan-parameter")


def _train_hf(out: str) -> None:
    """ZeRO-3 (fp32, so the master weights are the model's) of the suite's tiny Hugging Face
    Llama for two steps, saved with `engine.save_checkpoint(OUT/zero3-hf)`; rank 0 writes the
    trained model, gathered from the partitions, with `save_pretrained(OUT/zero3-hf-model)`
    (the reference an export must equal) and its logits on fixed ids."""
    import torch.distributed as dist
    from framework_fixtures import tiny_config  # the tests folder is the script's folder
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(f"{out}/zero3-hf")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if dist.get_rank() == 0:
            engine.module.save_pretrained(f"{out}/zero3-hf-model")
            with torch.no_grad():
                logits = engine.module(input_ids=ids).logits
            torch.save({"ids": ids, "logits": logits}, f"{out}/zero3-hf-model/logits.pt")
    dist.barrier()


def _train_tagged(out: str) -> None:
    """ZeRO-2 of the tiny model for 3 steps, saved after each with a tag of the script's own,
    `engine.save_checkpoint(OUT, tag=f"step_{n}")`: OUT/step_{1,2,3}/, `latest` naming step_3."""
    engine = engine_for(2)
    for step in range(1, 4):
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(out, tag=f"step_{step}")


def _train_without_latest(out: str) -> None:
    """ZeRO-2 of the tiny model for 3 steps, saved after each with
    `engine.save_checkpoint(OUT, save_latest=False)`: OUT/global_step{1,2,3}/ and no `latest`
    file (a script that names the tag it resumes from itself)."""
    engine = engine_for(2)
    for _ in range(3):
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(out, save_latest=False)


def _train_trainer(out: str, resume: str | None = None) -> None:
    """The suite's tiny Hugging Face Llama trained by transformers' `Trainer` with DeepSpeed
    ZeRO-2 in bf16 (its `deepspeed=` config, every value "auto" as the docs show) for 4 steps,
    saving every 2: OUT/checkpoint-{2,4}/ hold DeepSpeed's `latest` and `global_stepN/` and,
    beside them, the Trainer's `rng_state_{rank}.pth`, `trainer_state.json`, the bf16
    `model.safetensors` and its `config.json`. With `resume`, the same run resumed from that
    checkpoint (`train(resume_from_checkpoint=...)`) trains on to step 6."""
    from framework_fixtures import Rows, tiny_config  # the tests folder is the script's folder
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = LlamaForCausalLM(tiny_config())
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    }
    args = TrainingArguments(
        output_dir=out,
        max_steps=4 if resume is None else 6,
        save_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=config,
        bf16=True,
    )
    Trainer(model=model, args=args, train_dataset=Rows()).train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    init_distributed()
    if "--hf" in sys.argv[2:]:
        _train_hf(sys.argv[1])
    elif "--trainer" in sys.argv[2:]:
        _train_trainer(sys.argv[1])
    elif "--trainer-resume" in sys.argv[2:]:
        _train_trainer(sys.argv[1], resume=sys.argv[3])
    elif "--tags" in sys.argv[2:]:
        _train_tagged(f"{sys.argv[1]}/tagged")
    elif "--no-latest" in sys.argv[2:]:
        _train_without_latest(f"{sys.argv[1]}/no-latest")
    elif "--nan-padding" in sys.argv[2:]:
        _train(3, f"{sys.argv[1]}/zero3", nan_padding=True)
    else:
        _train(1, f"{sys.argv[1]}/zero1")
        _train(2, f"{sys.argv[1]}/zero2")
        _train(3, f"{sys.argv[1]}/zero3")
        # partitions of [128, 8, 40, 3] elements at 2 ranks: sub-groups [0.weight] and the rest
        _train(3, f"{sys.argv[1]}/zero3-subgroups", sub_group_size=100)
