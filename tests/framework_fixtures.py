"""Checkpoints written by the frameworks' own save code, built once per test session.

- `real_trainer_run`: a transformers `Trainer` run (tiny Llama, 2 layers, hidden 16, vocab 64) of
  4 steps saving every 2 (`straight/checkpoint-2`, `straight/checkpoint-4`), and the same run
  resumed from `checkpoint-2` with `resume_from_checkpoint` (`resumed/checkpoint-4`).
- `real_accelerate_run`: an accelerate loop (`Accelerator.save_state` / `load_state`) of 4 steps
  saving `step-2` and `step-4`, and the run resumed from `step-2` (`resumed/step-4`).
- `accelerate_fsdp_saves`: `Accelerator.save_state` under FSDP2 on 2 ranks (torchrun, gloo, CPU)
  of two models (the tiny Llama and a small MLP), with SHARDED_STATE_DICT (`sharded`:
  `pytorch_model_fsdp_{0,1}/`, `optimizer_{0,1}/` DCP folders) and FULL_STATE_DICT (`full`:
  `pytorch_model_fsdp{,_1}.bin`, `optimizer{,_1}.bin`), each with `scheduler{,_1}.bin` and
  `random_states_{0,1}.pkl` (`tests/accelerate_fsdp_script.py`, which says how accelerate's FSDP
  path is forced on CPU). A test using it is marked `torchrun` and `frameworks`.
- `accelerate_fsdp_rank_files`: the same run saved through accelerate's per-rank path
  (`save_fsdp_model` / `save_fsdp_optimizer` with `use_dcp=False`): `pytorch_model_fsdp_{0,1}_rank
  {0,1}.bin` and `optimizer_{0,1}_rank{0,1}.bin`, every rank its own torch.save file.
- `accelerate_ddp_save`: the same two models and run saved by accelerate's plain multi-process
  `save_state` (DDP, no FSDP): `model{,_1}.safetensors`, `optimizer{,_1}.bin`,
  `scheduler{,_1}.bin` from rank 0, `random_states_{0,1}.pkl` one per process.
- `real_hf_model`: `save_pretrained` of the same tiny Llama with its generation config and a real
  (tokenizers-built) fast tokenizer: the folder `from_pretrained` reads.

Each builder runs in its own Python process (`python -m tests.framework_fixtures KIND DIR`):
Trainer and accelerate seed the global RNGs and keep process-wide singletons, which must not
leak into the other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def tiny_config() -> Any:
    """The smallest Llama config that is still a real causal LM."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


class Rows:
    """A tiny in-memory causal-LM dataset (a torch map-style dataset)."""

    def __init__(self, n: int = 16, length: int = 8):
        import torch

        gen = torch.Generator().manual_seed(1234)
        self.rows = [torch.randint(0, 64, (length,), generator=gen) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.rows[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": ids.new_ones(ids.shape)}


def build_trainer(out: Path) -> None:
    """Train 4 steps straight (saves at 2 and 4), then resume from checkpoint-2 to step 4."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments, set_seed

    def run(folder: Path, resume: str | None) -> None:
        set_seed(0)
        model = LlamaForCausalLM(tiny_config())
        args = TrainingArguments(
            output_dir=str(folder),
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
        )
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train(resume_from_checkpoint=resume)

    run(out / "straight", None)
    run(out / "resumed", str(out / "straight" / "checkpoint-2"))


def build_accelerate(out: Path) -> None:
    """An accelerate training loop saving `step-2` and `step-4`, and its resume from step-2."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import LlamaForCausalLM

    def run(folder: Path, resume: Path | None) -> None:
        set_seed(0)
        # the seedable sampler is what makes accelerate save (and restore) the data order
        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
        )
        model = LlamaForCausalLM(tiny_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4)
        # its own generator: starting an epoch then draws no number from the global RNG, which
        # a resumed run restores before (not after) it starts its epoch
        loader = torch.utils.data.DataLoader(
            Rows(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        start = 0
        batches = loader
        if resume is not None:
            accelerator.load_state(str(resume))
            start = int(resume.name.split("-")[1])
            batches = accelerator.skip_first_batches(loader, start)
        step = start
        for batch in batches:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 2 == 0:
                accelerator.save_state(str(folder / f"step-{step}"))
            if step == 4:
                break

    run(out / "straight", None)
    run(out / "resumed", out / "straight" / "step-2")


def build_hf_model(out: Path) -> None:
    """`save_pretrained` of a tiny Llama, its generation config and a real fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed

    set_seed(0)
    model = LlamaForCausalLM(tiny_config())
    model.generation_config = GenerationConfig(max_new_tokens=7, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(out)
    vocab = {f"w{i}": i for i in range(64)}
    vocab["<unk>"] = 0
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(out)


BUILDERS = {"trainer": build_trainer, "accelerate": build_accelerate, "hf_model": build_hf_model}


def _build(kind: str, out: Path) -> Path:
    """Run `BUILDERS[kind]` in a process of its own (Trainer and accelerate keep singletons)."""
    assert kind in BUILDERS, kind
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("HF_ENDPOINT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.framework_fixtures", kind, str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def real_trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Trainer run folder: `straight/checkpoint-{2,4}` and `resumed/checkpoint-4`."""
    return _build("trainer", tmp_path_factory.mktemp("trainer_run"))


@pytest.fixture(scope="session")
def real_accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real accelerate run folder: `straight/step-{2,4}` and `resumed/step-4`."""
    return _build("accelerate", tmp_path_factory.mktemp("accelerate_run"))


#: the FSDP state-dict types `accelerate_fsdp_saves` writes, by the key it returns them under
FSDP_STATE_DICTS = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}
ACCELERATE_FSDP_SCRIPT = REPO / "tests" / "accelerate_fsdp_script.py"


@pytest.fixture(scope="session")
def accelerate_fsdp_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """accelerate FSDP2 `save_state` folders of a 2-rank run: `sharded` and `full`."""
    from .dist_helpers import run_torchrun

    root = tmp_path_factory.mktemp("accelerate_fsdp")
    out = {}
    for key, kind in FSDP_STATE_DICTS.items():
        run_torchrun(ACCELERATE_FSDP_SCRIPT, 2, "save", root / key, kind, timeout=600)
        out[key] = root / key
    return out


@pytest.fixture(scope="session")
def accelerate_fsdp_rank_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 2-rank FSDP2 run saved by `save_state` through accelerate's `use_dcp=False`
    path: `pytorch_model_fsdp_{0,1}_rank{0,1}.bin` and `optimizer_{0,1}_rank{0,1}.bin`."""
    from .dist_helpers import run_torchrun

    out = tmp_path_factory.mktemp("accelerate_fsdp_rank_files") / "save"
    run_torchrun(ACCELERATE_FSDP_SCRIPT, 2, "save", out, "RANK_FILES", timeout=600)
    return out


@pytest.fixture(scope="session")
def accelerate_ddp_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process accelerate `save_state` without FSDP (DDP on gloo): every process writes its
    own `random_states_{rank}.pkl`, rank 0 everything else."""
    from .dist_helpers import run_torchrun

    out = tmp_path_factory.mktemp("accelerate_ddp") / "save"
    run_torchrun(ACCELERATE_FSDP_SCRIPT, 2, "save", out, "PLAIN", timeout=600)
    return out


@pytest.fixture(scope="session")
def real_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `save_pretrained` model folder (config, generation config, tokenizer, weights)."""
    return _build("hf_model", tmp_path_factory.mktemp("hf_model") / "model")


if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
