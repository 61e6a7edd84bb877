"""Tiny real training jobs resumed with one fault planted at a time, for `ckpt doctor`.

Four jobs, each run once per test module in its own process (`python -m tests.doctor_jobs KIND
OUT`: the frameworks seed global RNGs and keep process-wide singletons), and one under torchrun:

- `trainer`: transformers `Trainer` on a tiny Llama built from its config (no download), 6 steps
  saving every 2 (`base/checkpoint-{2,4,6}`); each case copies `checkpoint-2` and `checkpoint-4`
  into `CASE/` and resumes there from `checkpoint-4`, which saves `checkpoint-6`.
- `accelerate`: an accelerate loop (`save_state` / `load_state`, stateful data loader), the same
  6 steps and saves, resumed from `step-4`.
- `dcp`: a plain loop saving one `dcp.save` per save (`step-N/`: model, optimizer, scheduler,
  grad scaler, EMA, data position, RNG, run settings), 8 steps saving every 2, resumed from
  `step-4` to step 8.
- `torchtitan`: torchtitan 0.3.0's own model, optimizer and scheduler containers, data loader
  and `CheckpointManager` on CPU (`checkpoint/step-{2,4,6}`), resumed from `step-4`; faults
  through its own `exclude_from_loading`, and a model part re-initialised after the load.
- `torchrun` (`tests/doctor_dist_job.py`, launched by the test's fixture): a DDP loop trained on
  2 ranks (gloo, CPU), resumed from `step-4` on 2 ranks or on 1 (`TORCHRUN_RESUMES`).

The crashed job's saves are dated `DOWN_SECONDS` back, so the stop shows in the file times
whatever the machine's speed. A fault is planted the way people get it wrong (a custom trainer skipping a load, a
`strict=False` load that misses some keys, a seed set after `load_state`...). `CASES[kind]`
maps each case to the cause `ckpt doctor` should rank first (None: a clean resume).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.framework_fixtures import Rows

#: case -> the cause id the doctor must rank first (None: clean, no cause)
CASES: dict[str, dict[str, str | None]] = {
    "trainer": {
        "clean": None,
        "clean_from_2": None,
        "skip_optimizer": "optimizer_not_restored",
        "skip_scheduler": "scheduler_not_restored",
        "skip_data": "data_position_not_restored",
        "grad_accum": "batch_changed",
        "batch": "batch_changed",
        "config": "config_changed",
        "tokenizer": "tokenizer_changed",
        "rng": "rng_not_restored",
        "rng_file_lost": "rng_not_restored",
        "bf16": "precision_changed",
        "reordered": "optimizer_mismatch",
    },
    "accelerate": {
        "clean": None,
        "clean_from_2": None,
        "skip_optimizer": "optimizer_not_restored",
        "skip_scheduler": "scheduler_not_restored",
        "skip_data": "data_position_not_restored",
        "partial_weights": "weights_partly_restored",
        "rng": "rng_not_restored",
    },
    "torchtitan": {
        "clean": None,
        "clean_from_2": None,
        "skip_optimizer": "optimizer_not_restored",
        "skip_scheduler": "scheduler_not_restored",
        "skip_data": "data_position_not_restored",
        "partial_weights": "weights_partly_restored",
        "batch": "batch_changed",
    },
    # tests/doctor_dist_job.py: trained on 2 ranks under torchrun, resumed on 2 or 1
    "torchrun": {
        "clean": None,
        "clean_world_size": None,
        "clean_lr_rescaled": None,
        "lr_not_rescaled": "batch_changed",
    },
    "dcp": {
        "clean": None,
        "clean_from_2": None,
        "clean_from_6": None,
        "clean_sgd": None,
        "clean_lr_rescaled": None,
        "clean_world_size": None,
        "skip_optimizer": "optimizer_not_restored",
        "skip_scheduler": "scheduler_not_restored",
        "skip_data": "data_position_not_restored",
        "scaler": "grad_scaler_reset",
        "bf16": "precision_changed",
        "ema": "ema_not_restored",
        "rng": "rng_not_restored",
        "rng_new_seed": "rng_not_restored",
        "rng_seeded_check": "rng_not_restored",
        "batch": "batch_changed",
        "partial_weights": "weights_partly_restored",
    },
}


#: how long the crashed job was down before the resume (its saves' files are dated this much
#: earlier, so the gap before the first save after the resume is the stop it was)
DOWN_SECONDS = 3600


#: torchrun cases: (ranks, per-device batch, learning rate) of the resume (the base run: 2 ranks
#: of 4 samples at LR 0.05, a global batch of 8), and what the change is declared as
TORCHRUN_RESUMES: dict[str, tuple[int, int, float]] = {
    "clean": (2, 4, 0.05),
    "clean_world_size": (1, 8, 0.05),  # the same global batch on 1 rank
    "clean_lr_rescaled": (1, 4, 0.025),  # half the global batch, half the LR
    "lr_not_rescaled": (1, 4, 0.05),  # half the global batch, the LR kept
}
DECLARED: dict[str, dict[str, list[str]]] = {"torchrun": {"clean_world_size": ["world-size"]}}


def copy_saves(base: Path, case: Path, names: list[str]) -> None:
    """The run folder a crashed job leaves: its saves up to the resume point, and its log
    (which ran on past the last save)."""
    case.mkdir(parents=True)
    for name in names:
        shutil.copytree(base / name, case / name)
        for path in [*(case / name).rglob("*"), case / name]:  # the folder last: its own time
            stat = path.stat()
            os.utime(path, (stat.st_atime - DOWN_SECONDS, stat.st_mtime - DOWN_SECONDS))
    if (base / "metrics.jsonl").is_file():
        shutil.copy2(base / "metrics.jsonl", case / "metrics.jsonl")


# --------------------------------------------------------------------------- Trainer


def _tiny_llama(**changes: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.1,  # training draws random numbers: RNG state matters
    )
    settings.update(changes)
    return LlamaConfig(**settings)


def _tokenizer(extra: bool = False) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1, 64)}
    vocab["<unk>"] = 0
    if extra:  # the same words, renumbered: another tokenizer with the same size
        vocab = {f"w{i}": (i * 7) % 63 + 1 for i in range(1, 64)}
        vocab["<unk>"] = 0
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def build_trainer(out: Path) -> None:
    from transformers import (
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    class Faulty(Trainer):  # type: ignore[misc]
        fault: str | None = None

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            if self.fault == "skip_optimizer" and checkpoint:
                import torch

                # a custom trainer that restores the scheduler only
                self.lr_scheduler.load_state_dict(
                    torch.load(Path(checkpoint, "scheduler.pt"), weights_only=True)
                )
                return
            if self.fault == "skip_scheduler" and checkpoint:
                import torch

                self.optimizer.load_state_dict(
                    torch.load(Path(checkpoint, "optimizer.pt"), weights_only=True)
                )
                return
            super()._load_optimizer_and_scheduler(checkpoint)

        def create_optimizer(self) -> Any:
            optimizer = super().create_optimizer()
            if self.fault == "reordered":
                # a refactored attention that registers `o_proj` before `q_proj` (both
                # [16, 16]): the decay group numbers the two the other way round
                names = {id(p): n for n, p in self.model.named_parameters()}
                params = optimizer.param_groups[0]["params"]
                at = {names[id(p)]: i for i, p in enumerate(params)}
                q = at["model.layers.0.self_attn.q_proj.weight"]
                o = at["model.layers.0.self_attn.o_proj.weight"]
                params[q], params[o] = params[o], params[q]
            return optimizer

        def _load_rng_state(self, checkpoint: str | None) -> None:
            if self.fault != "rng":
                super()._load_rng_state(checkpoint)

    def run(folder: Path, resume: Path | None, fault: str | None = None) -> None:
        set_seed(0)
        config = _tiny_llama(rms_norm_eps=1e-5) if fault == "config" else _tiny_llama()
        model = LlamaForCausalLM(config)
        args = TrainingArguments(
            output_dir=str(folder),
            max_steps=6,
            save_steps=2,
            per_device_train_batch_size=4 if fault == "batch" else 2,
            gradient_accumulation_steps=2 if fault == "grad_accum" else 1,
            learning_rate=1e-2,
            lr_scheduler_type="linear",
            warmup_steps=2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            ignore_data_skip=fault == "skip_data",
            bf16=fault == "bf16",  # resumed under bf16 autocast: the run trained in fp32
        )
        trainer = Faulty(
            model=model,
            args=args,
            train_dataset=Rows(),
            data_collator=default_data_collator,
            processing_class=_tokenizer(extra=fault == "tokenizer"),
        )
        trainer.fault = fault
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    base = out / "base"
    run(base, None)
    for case in CASES["trainer"]:
        folder = out / case
        if case == "clean_from_2":
            copy_saves(base, folder, ["checkpoint-2"])
            run(folder, folder / "checkpoint-2")
            continue
        copy_saves(base, folder, ["checkpoint-2", "checkpoint-4"])
        if case == "rng_file_lost":
            # the save resumed from lost its RNG file since it was written: the Trainer only
            # logs "Didn't find an RNG file" and goes on from the seed
            lost = folder / "checkpoint-4"
            (lost / "rng_state.pth").unlink()
            written = (lost / "trainer_state.json").stat()
            os.utime(lost, (written.st_atime, written.st_mtime))
            run(folder, lost)
            continue
        run(folder, folder / "checkpoint-4", None if case == "clean" else case)


# --------------------------------------------------------------------------- accelerate


def build_accelerate(out: Path) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import LlamaForCausalLM

    def run(folder: Path, resume: Path | None, fault: str | None = None) -> None:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()
        set_seed(0)
        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
        model = LlamaForCausalLM(_tiny_llama())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fresh_optimizer = optimizer.state_dict()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 3) * (1 - step / 8)
        )
        fresh_scheduler = scheduler.state_dict()
        loader = torch.utils.data.DataLoader(
            Rows(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        step = 0
        if fault != "rng":
            set_seed(0)  # the script seeds right before its loop...
        if resume is not None:
            accelerator.load_state(str(resume))
            step = int(resume.name.split("-")[1])
            if fault == "skip_optimizer":
                optimizer.optimizer.load_state_dict(fresh_optimizer)
            if fault == "skip_scheduler":
                scheduler.scheduler.load_state_dict(fresh_scheduler)
            if fault == "skip_data":  # the loader rebuilt after load_state starts over
                loader = accelerator.prepare(
                    torch.utils.data.DataLoader(
                        Rows(),
                        batch_size=2,
                        shuffle=True,
                        generator=torch.Generator().manual_seed(0),
                    )
                )
            if fault == "partial_weights":
                # `load_state_dict(strict=False)` of a state dict whose layer-1 keys did not
                # match: those weights keep their fresh initialisation
                fresh = LlamaForCausalLM(_tiny_llama()).state_dict()
                missed = {k: v for k, v in fresh.items() if ".layers.1." in k}
                model.load_state_dict(missed, strict=False)
        if fault == "rng":
            set_seed(0)  # ...which, after load_state, undoes the RNG state it restored
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 2 == 0:
                accelerator.save_state(str(folder / f"step-{step}"))
            if step == 6:
                break

    base = out / "base"
    run(base, None)
    for case in CASES["accelerate"]:
        folder = out / case
        if case == "clean_from_2":
            copy_saves(base, folder, ["step-2"])
            run(folder, folder / "step-2")
            continue
        copy_saves(base, folder, ["step-2", "step-4"])
        run(folder, folder / "step-4", None if case == "clean" else case)


# --------------------------------------------------------------------------- plain DCP loop


def build_dcp(out: Path) -> None:
    import random

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def run(folder: Path, resume: Path | None, fault: str | None = None, **opts: Any) -> None:
        torch.manual_seed(0)
        random.seed(0)
        world_size = opts.get("world_size", 1)
        per_device = opts.get("per_device", 4)
        lr = opts.get("lr", 0.05)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.LayerNorm(16),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(16, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 1),
        )
        if opts.get("sgd"):
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                model.parameters(), lr=lr, momentum=0.9
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

        def schedule(s: int) -> float:
            return min(1.0, (s + 1) / 3) * (1 - s / 12)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)
        ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
        data = torch.Generator().manual_seed(7)
        xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
        samples_seen = batches_seen = step = 0
        settings = {"world_size": world_size, "per_device_batch": per_device, "grad_accum": 1}

        def state() -> dict[str, Any]:
            # DCP's own state-dict API: FQN-keyed optimizer state, initialised before a load
            model_state, optim_state = get_state_dict(model, optimizer)
            return {
                "model": model_state,
                "optimizer": optim_state,
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "ema": ema,
                "dataloader": {"samples_seen": samples_seen, "batches_seen": batches_seen},
                "train_state": {"step": step, **settings},
                "rng": {
                    f"rank_{r}": {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
                    for r in range(world_size)
                },
            }

        if resume is not None:
            target = state()
            dcp.load(target, checkpoint_id=str(resume), no_dist=True)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=target["model"],
                optim_state_dict=target["optimizer"],
            )
            if fault == "skip_optimizer":  # the optimizer rebuilt after the load: state lost
                optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            if fault == "partial_weights":
                fresh = torch.nn.Linear(16, 16)
                model[3].load_state_dict(fresh.state_dict())  # strict=False missed these keys
            if fault != "skip_scheduler":
                scheduler.load_state_dict(target["scheduler"])
            if target["scheduler"]["base_lrs"] != [lr]:
                # a rescaled learning rate must outlive the scheduler's restored base_lrs
                scheduler.base_lrs = [lr]
                for group in optimizer.param_groups:
                    group["initial_lr"] = lr
            if fault != "scaler":
                scaler.load_state_dict(target["scaler"])
            if fault == "ema":
                ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                ema = target["ema"]
            step = int(target["train_state"]["step"])
            if fault != "skip_data":
                samples_seen = int(target["dataloader"]["samples_seen"])
                batches_seen = int(target["dataloader"]["batches_seen"])
            if fault == "rng_new_seed":  # a job seeding from its own id, after the load
                torch.manual_seed(1234)
                random.seed(1234)
            elif fault == "rng_seeded_check":
                # seeded again (as at the start), then one batch through the model in train
                # mode to check the restored weights: other draws than the run's start made
                torch.manual_seed(0)
                random.seed(0)
                with torch.no_grad():
                    model(xs[:per_device])
            elif fault != "rng":
                torch.set_rng_state(target["rng"]["rank_0"]["torch_cpu"])
                random.setstate(target["rng"]["rank_0"]["python"])
            if fault == "bf16":
                model.to(torch.bfloat16)
                for group in optimizer.state.values():
                    for k, v in list(group.items()):
                        if k != "step" and torch.is_tensor(v):
                            group[k] = v.to(torch.bfloat16)
                ema = {k: v.to(torch.bfloat16) for k, v in ema.items()}
        while step < 8:
            step += 1
            for _ in range(world_size):  # each rank's share of the global batch
                start = samples_seen % 256
                x, y = xs[start : start + per_device], ys[start : start + per_device]
                dtype = next(model.parameters()).dtype
                loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
                scaler.scale(loss / world_size).backward()
                samples_seen += per_device
            batches_seen += 1
            lr_used = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    ema[k].mul_(0.9).add_(v.to(ema[k].dtype), alpha=0.1)
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "metrics.jsonl", "a") as log:  # the run's own log, appended
                log.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr_used}) + "\n")
            if step % 2 == 0:
                dcp.save(state(), checkpoint_id=str(folder / f"step-{step}"), no_dist=True)

    base = out / "base"
    run(base, None)
    run(out / "base_sgd", None, sgd=True)
    run(out / "base_w2", None, world_size=2, per_device=2)
    for case in CASES["dcp"]:
        folder = out / case
        if case == "clean_from_2":
            copy_saves(base, folder, ["step-2"])
            run(folder, folder / "step-2")
        elif case == "clean_from_6":
            copy_saves(base, folder, ["step-2", "step-4", "step-6"])
            run(folder, folder / "step-6")
        elif case == "clean_sgd":
            copy_saves(out / "base_sgd", folder, ["step-2", "step-4"])
            run(folder, folder / "step-4", sgd=True)
        elif case == "clean_lr_rescaled":
            # twice the batch, twice the learning rate: the linear scaling rule, on purpose
            copy_saves(base, folder, ["step-2", "step-4"])
            run(folder, folder / "step-4", per_device=8, lr=0.1)
        elif case == "clean_world_size":
            # 2 ranks of 2 before, 1 rank of 4 after: the same global batch
            copy_saves(out / "base_w2", folder, ["step-2", "step-4"])
            run(folder, folder / "step-4", per_device=4)
        elif case == "batch":
            copy_saves(base, folder, ["step-2", "step-4"])
            run(folder, folder / "step-4", per_device=8)
        else:
            copy_saves(base, folder, ["step-2", "step-4"])
            run(folder, folder / "step-4", None if case == "clean" else case)


# --------------------------------------------------------------------------- torchtitan


def build_torchtitan(out: Path) -> None:
    """torchtitan 0.3.0's own components on CPU (`tests/torchtitan_writer.py`: a tiny llama3,
    its AdamW and LR-scheduler containers, `ParallelAwareDataloader`, `CheckpointManager`
    saving `checkpoint/step-N/` every 2 steps), 6 steps, resumed from `step-4` with
    `CheckpointManager.load`. The faults are torchtitan's own option `exclude_from_loading`
    (a component left out of the load) and a model part re-initialised after the load."""
    import warnings

    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from tests.torchtitan_writer import Tokens, TrainState, model_config

    warnings.simplefilter("ignore")

    def run(folder: Path, resume: int | None, fault: str | None = None) -> None:
        torch.manual_seed(0)
        model = model_config().build()
        model.init_weights(buffer_device=None)
        optimizers = default_adamw(lr=8e-3).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=optimizers, training_steps=6)
        # `batch`: the resumed job's local batch doubled, its learning rate kept
        batch_size = 4 if fault == "batch" else 2
        loader = ParallelAwareDataloader(
            Tokens(), dp_rank=0, dp_world_size=1, batch_size=batch_size
        )
        train_state = TrainState()
        excluded = {
            "skip_optimizer": ["optimizer"],
            "skip_scheduler": ["lr_scheduler"],
            "skip_data": ["dataloader"],
        }.get(fault or "", [])
        manager = CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=2,
            keep_latest_k=0,
            last_save_model_only=False,
            exclude_from_loading=excluded,
        ).build(
            dataloader=loader,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={"train_state": train_state},
            sd_adapter=None,
            base_folder=str(folder),
        )
        if resume is not None:
            assert manager.load(step=resume)
            if fault == "partial_weights":
                # a model part whose keys the load missed keeps its fresh initialisation
                torch.manual_seed(1)
                fresh = model_config().build()
                fresh.init_weights(buffer_device=None)
                layer = dict(fresh.named_parameters())
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if name.startswith("layers.1."):
                            param.copy_(layer[name])
        batches = iter(loader)
        while train_state.step < 6:
            inputs, labels = next(batches)
            logits = model(inputs["input"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            train_state.step += 1
            train_state.ntokens_seen += labels.numel()
            manager.save(curr_step=train_state.step)
        manager.close()

    base = out / "base"
    run(base, None)
    for case in CASES["torchtitan"]:
        folder = out / case
        saves = ["step-2"] if case == "clean_from_2" else ["step-2", "step-4"]
        copy_saves(base / "checkpoint", folder / "checkpoint", saves)
        resume = 2 if case == "clean_from_2" else 4
        run(folder, resume, None if case.startswith("clean") else case)


# --------------------------------------------------------------------------- Trainer, more runs

#: `trainer_runs` cases: what the doctor must rank first (None: no cause, exit 0)
TRAINER_RUNS: dict[str, str | None] = {
    "short_last_batch": None,  # 30 rows in batches of 4: each epoch ends in a batch of 2
    "short_last_accum": None,  # and an accumulation of 3 that does not divide the 8 batches
    "batch_then_same": "batch_changed",  # batch 2 → 4 at the resume from checkpoint-4, then kept
    # `prune --slim-older-than` slimmed checkpoint-2 and -4 to their weights; checkpoint-6 was
    # lost, and the run resumed from the slimmed checkpoint-4 (a fresh optimizer)
    "slimmed": "optimizer_not_restored",
    "seed": "seed_changed",  # resumed from checkpoint-4 with seed 7 (was 0)
    # checkpoint-4's optimizer.pt was deleted, and the run resumed from it (a fresh optimizer)
    "optimizer_deleted": "optimizer_not_restored",
    "data_seed": "seed_changed",  # resumed with data_seed 7 (unset: the seed, 0)
    "scheduler_type": "schedule_changed",  # resumed with lr_scheduler_type cosine (was linear)
    "warmup": "schedule_changed",  # resumed with warmup_steps 4 (was 2)
    "extended": "schedule_changed",  # resumed with max_steps 16 (was 8): a longer decay
    "grad_clip": "grad_clip_changed",  # resumed with max_grad_norm 0.1 (was 1.0)
    "ignore_data_skip": "data_position_not_restored",  # resumed with ignore_data_skip=True
    # saved with save_only_model=True (weights only), resumed from checkpoint-4 so
    "save_only_model": "optimizer_not_restored",
}
#: the options of the resume from checkpoint-4 of the `TRAINER_RUNS` cases that resume
_RESUMED_WITH: dict[str, dict[str, Any]] = {
    "batch_then_same": {"bs": 4},
    "seed": {"seed": 7},
    "data_seed": {"data_seed": 7},
    "scheduler_type": {"lr_scheduler_type": "cosine"},
    "warmup": {"warmup_steps": 4},
    "extended": {"max_steps": 16},
    "grad_clip": {"max_grad_norm": 0.1},
    "ignore_data_skip": {"ignore_data_skip": True},
}


def build_trainer_runs(out: Path) -> None:
    """Plain Trainer runs (no fault planted in the trainer), one per `TRAINER_RUNS` case."""
    from transformers import (
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    def run(folder: Path, resume: Path | None, **opts: Any) -> None:
        seed = opts.get("seed", 0)
        set_seed(seed)
        args = TrainingArguments(
            output_dir=str(folder),
            max_steps=opts.get("max_steps", 8),
            save_steps=2,
            per_device_train_batch_size=opts.get("bs", 2),
            gradient_accumulation_steps=opts.get("ga", 1),
            learning_rate=1e-2,
            lr_scheduler_type=opts.get("lr_scheduler_type", "linear"),
            warmup_steps=opts.get("warmup_steps", 2),
            max_grad_norm=opts.get("max_grad_norm", 1.0),
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            seed=seed,
            data_seed=opts.get("data_seed"),
            save_only_model=opts.get("save_only_model", False),
            ignore_data_skip=opts.get("ignore_data_skip", False),
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=LlamaForCausalLM(_tiny_llama()),
            args=args,
            train_dataset=Rows(opts.get("rows", 16)),
            data_collator=default_data_collator,
        )
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    run(out / "short_last_batch", None, rows=30, bs=4, max_steps=12)
    run(out / "short_last_accum", None, rows=30, bs=4, ga=3, max_steps=12)
    base = out / "base"
    run(base, None)
    for case, opts in _RESUMED_WITH.items():
        copy_saves(base, out / case, ["checkpoint-2", "checkpoint-4"])
        run(out / case, out / case / "checkpoint-4", **opts)
    slimmed = out / "slimmed"
    copy_saves(base, slimmed, ["checkpoint-2", "checkpoint-4", "checkpoint-6"])
    prune = ["prune", str(slimmed), "--slim-older-than", "1", "--yes"]
    subprocess.run(
        [sys.executable, "-m", "ckpt_cli", *prune],
        check=True,
        capture_output=True,
    )
    assert (slimmed / "checkpoint-4" / "ckpt-slim.json").is_file()
    shutil.rmtree(slimmed / "checkpoint-6")
    run(slimmed, slimmed / "checkpoint-4")
    deleted = out / "optimizer_deleted"
    copy_saves(base, deleted, ["checkpoint-2", "checkpoint-4"])
    (deleted / "checkpoint-4" / "optimizer.pt").unlink()
    stat = (deleted / "checkpoint-4").stat()  # deleted long before the resume
    os.utime(deleted / "checkpoint-4", (stat.st_atime, stat.st_mtime - DOWN_SECONDS))
    run(deleted, deleted / "checkpoint-4")
    model_only = out / "save_only_model"
    run(out / "model_only_base", None, save_only_model=True)
    copy_saves(out / "model_only_base", model_only, ["checkpoint-2", "checkpoint-4"])
    run(model_only, model_only / "checkpoint-4", save_only_model=True)


def build_accelerate_auto(out: Path) -> None:
    """accelerate with automatic checkpoint naming (`checkpoints/checkpoint_N`, N counts saves):
    4 steps saving every 2 (`checkpoint_0` at step 2, `checkpoint_1` at step 4), resumed from
    `checkpoint_1` with a fresh optimizer (its state cleared after `load_state`), to step 8."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    def run(resume: bool) -> None:
        set_seed(0)
        config = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=config)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        start = 0
        if resume:
            accelerator.load_state(str(out / "checkpoints" / "checkpoint_1"))
            accelerator.project_configuration.iteration = 2
            start = 4
            optimizer.optimizer.state.clear()  # the fault: a fresh optimizer
        for step in range(start + 1, 9 if resume else 5):
            model(torch.randn(2, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 0:
                accelerator.save_state()

    run(resume=False)
    for path in [*(out / "checkpoints").rglob("*"), *(out / "checkpoints").iterdir()]:
        stat = path.stat()
        os.utime(path, (stat.st_atime - DOWN_SECONDS, stat.st_mtime - DOWN_SECONDS))
    run(resume=True)


#: `accelerate_pace` cases: (step_scheduler_with_optimizer of the run, of its resume) under a
#: gradient accumulation of 2, and what the doctor must rank first (None: no cause)
ACCELERATE_PACE: dict[str, tuple[tuple[bool, bool], str | None]] = {
    "clean_per_update": ((True, True), None),
    "clean_per_micro_batch": ((False, False), None),  # the scheduler counts micro-batches
    "per_micro_batch_at_resume": ((True, False), "schedule_changed"),
    "per_update_at_resume": ((False, True), "schedule_changed"),
}


def build_accelerate_pace(out: Path) -> None:
    """accelerate loops under `accumulate()` (2 micro-batches per optimizer step), the
    scheduler prepared with `step_scheduler_with_optimizer` as `ACCELERATE_PACE` says: 8
    optimizer steps saving every 2 (`step-N`), crashed after `step-4` and resumed from it (the
    data position restored with `skip_first_batches`). And `scheduler_unregistered`: the same
    loop with its scheduler neither prepared nor registered for checkpointing: no save holds
    it, and the resume builds it fresh."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    def run(folder: Path, resume: Path | None, with_optimizer: bool, register: bool = True) -> None:
        AcceleratorState._reset_state()
        GradientState._reset_state()
        set_seed(0)
        accelerator = Accelerator(
            cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_optimizer
        )
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 3) * (1 - s / 20)
        )
        data = torch.Generator().manual_seed(7)
        rows = torch.utils.data.TensorDataset(
            torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data)
        )
        loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
        if register:
            model, optimizer, loader, scheduler = accelerator.prepare(
                model, optimizer, loader, scheduler
            )
        else:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        step, batches = 0, loader
        if resume is not None:
            accelerator.load_state(str(resume))
            step = int(resume.name.split("-")[1])
            batches = accelerator.skip_first_batches(loader, step * 2)
        while step < 8:
            for x, y in batches:
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    step += 1
                    if step % 2 == 0:
                        accelerator.save_state(str(folder / f"step-{step}"))
                    if step == 8:
                        break
            batches = loader

    for case, ((trained, resumed), _) in ACCELERATE_PACE.items():
        base = out / f"{case}_base"
        run(base, None, trained)
        copy_saves(base, out / case, ["step-2", "step-4"])
        run(out / case, out / case / "step-4", resumed)
    run(out / "scheduler_unregistered_base", None, True, register=False)
    copy_saves(
        out / "scheduler_unregistered_base", out / "scheduler_unregistered", ["step-2", "step-4"]
    )
    run(out / "scheduler_unregistered", out / "scheduler_unregistered" / "step-4", True, False)


BUILDERS = {
    "trainer": build_trainer,
    "accelerate": build_accelerate,
    "dcp": build_dcp,
    "torchtitan": build_torchtitan,
    "trainer_runs": build_trainer_runs,
    "accelerate_auto": build_accelerate_auto,
    "accelerate_pace": build_accelerate_pace,
}


if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
    cases = TRAINER_RUNS if sys.argv[1] == "trainer_runs" else CASES.get(sys.argv[1], {})
    (Path(sys.argv[2]) / "cases.json").write_text(json.dumps(cases))
