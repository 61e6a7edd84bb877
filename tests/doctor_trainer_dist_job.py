"""A transformers `Trainer` job under torchrun (gloo, CPU) for `ckpt doctor`'s world-size resumes.

    torchrun --standalone --nproc-per-node N tests/doctor_trainer_dist_job.py RUN PER_DEVICE [RESUME]

The tiny Llama of `tests/doctor_jobs.py` on 32 rows, `PER_DEVICE` rows per rank and step, 8
steps saving every 2 (`RUN/checkpoint-N`: each rank writes its own `rng_state_R.pth` on several
processes, one `rng_state.pth` on one), resumed from `RUN/RESUME` where given.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from tests.doctor_jobs import _tiny_llama
from tests.framework_fixtures import Rows


def main(run: Path, per_device: int, resume: str | None) -> None:
    set_seed(0)
    args = TrainingArguments(
        output_dir=str(run),
        max_steps=8,
        save_steps=2,
        per_device_train_batch_size=per_device,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo",
    )
    trainer = Trainer(
        model=LlamaForCausalLM(_tiny_llama()),
        args=args,
        train_dataset=Rows(32),
        data_collator=default_data_collator,
    )
    trainer.train(resume_from_checkpoint=str(run / resume) if resume else None)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
