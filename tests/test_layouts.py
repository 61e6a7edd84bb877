"""Training layouts: a Trainer folder from real training, accelerate, Lightning, DeepSpeed and
plain torch dicts built with torch.save in their real key structure; inspect says what they
hold and whether they can resume; `training_checks` names what is missing."""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckpt_cli.sources.layouts import training_checks
from ckpt_cli.sources.opening import open_source

from .conftest import REPO, run_ckpt


def _demo() -> Any:
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "examples" / "make_demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module  # dataclasses pickled by training_args.bin need it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Trainer-style checkpoint-4/ saved after four real AdamW steps."""
    return Path(_demo().save_trainer_checkpoint(tmp_path_factory.mktemp("run")))


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _hostile(marker: Path) -> Any:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    return Evil()


def test_trainer_checkpoint_is_recognised_and_resumable(trainer_run: Path) -> None:
    report = run_ckpt("inspect", trainer_run, "--json").json["result"]
    assert report["format"] == "composite"
    training = report["training"]
    assert training["layout"] == "hf-trainer"
    assert training["step"] == 4 and training["epoch"] == 0.5
    weights = load_file(trainer_run / "model.safetensors")
    assert training["weights"] == {
        "tensors": len(weights),
        "parameters": sum(t.numel() for t in weights.values()),
        "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
    }
    opt = training["optimizer"]
    assert opt["kind"] == "AdamW" and opt["states"] == ["exp_avg", "exp_avg_sq", "step"]
    assert opt["params"] == opt["params_with_state"] == len(weights) and opt["complete"]
    assert training["scheduler"]["kind"] == "LambdaLR" and training["scheduler"]["last_epoch"] == 4
    assert training["rng"] == ["python", "numpy", "torch_cpu"]
    assert training["resumable"] is True and training["missing"] == []
    assert training["prefixes"]["model"] == "model."
    names = {e["name"]: e for e in report["entries"]}
    assert "training_args" not in names  # a pickled dataclass: listed, never loaded
    assert training["components"]["training_args"].startswith("training_args.bin")
    assert "training_args.bin" in [f["path"] for f in report["files"]]
    assert names["trainer_state.global_step"]["value"] == 4
    assert "optimizer.state.0.exp_avg" in names
    human = run_ckpt("inspect", trainer_run).stdout
    assert "hf-trainer" in human and "AdamW" in human and "yes" in human

    opened = open_source(str(trainer_run))
    with opened.checkpoint as checkpoint:
        for name, tensor in weights.items():
            assert torch.equal(checkpoint.read_tensor(f"model.{name}"), tensor)
        saved = torch.load(trainer_run / "optimizer.pt", weights_only=True)
        assert torch.equal(
            checkpoint.read_tensor("optimizer.state.3.exp_avg"), saved["state"][3]["exp_avg"]
        )
        assert checkpoint.read_object("trainer_state.global_step") == 4
    assert training_checks(opened) == []


def test_a_trainer_save_with_gradient_accumulation_replays_its_batches(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A Trainer run with `gradient_accumulation_steps=2` saved at step 2 has seen 4 batches,
    and `resume_from_checkpoint` skips those 4 (`_init_training_state` multiplies the steps by
    the accumulation): `inspect` said `skips_batches=2`, the step count, as if each optimizer
    step took one batch. It reads the accumulation from `training_args.bin` (never
    unpickled)."""
    import warnings

    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(tiny_llama)
        Trainer(model=model, args=args, train_dataset=data).train()
    training = run_ckpt("inspect", tmp_path / "run" / "checkpoint-2", "--json").json["result"][
        "training"
    ]
    assert training["step"] == 2
    assert training["dataloader"] == {"kind": "replayed", "skips_batches": 4}
    assert training["exact"] is True


def test_trainer_without_optimizer_is_not_resumable(trainer_run: Path, tmp_path: Path) -> None:
    folder = _copy(trainer_run, tmp_path / "checkpoint-4")
    (folder / "optimizer.pt").unlink()
    training = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert training["resumable"] is False and training["missing"] == ["optimizer"]
    problems = training_checks(open_source(str(folder)))
    # the Trainer writes optimizer.pt with scheduler.pt and rng_state.pth, both here: the
    # file is missing (its own problem, what plain verify says), and so is the state
    assert [p.code for p in problems] == ["missing_component", "missing_optimizer"]
    assert "optimizer.pt is missing" in problems[0].message


def test_optimizer_of_another_model_is_a_shape_mismatch(trainer_run: Path, tmp_path: Path) -> None:
    folder = _copy(trainer_run, tmp_path / "checkpoint-4")
    other = _demo().TinyLM(dim=16)
    opt = torch.optim.AdamW(other.parameters())
    other(torch.randint(0, 64, (2, 5))).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    problems = training_checks(open_source(str(folder)))
    assert problems and all(p.code == "optimizer_shape_mismatch" for p in problems)
    # and the verdict says so: not "resumable: yes" above the errors that say it is not
    result = run_ckpt("verify", "--resumable", folder, "--json")
    assert result.exit_code == 1
    training = result.json["result"]["training"]
    assert training["resumable"] is False
    assert "optimizer state that fits the weights" in training["missing"]
    text = run_ckpt("verify", "--resumable", folder).stdout
    assert "resumable: no (missing: optimizer state that fits the weights)" in text


def test_hostile_files_in_a_trainer_folder_are_listed_not_run(
    trainer_run: Path, tmp_path: Path
) -> None:
    folder = _copy(trainer_run, tmp_path / "checkpoint-4")
    marker = tmp_path / "PWNED"
    torch.save({"python": _hostile(marker)}, folder / "rng_state.pth")
    torch.save(_hostile(marker), folder / "training_args.bin")
    result = run_ckpt("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    training = result.json["result"]["training"]
    assert "rng_state.pth" in training["unreadable"]
    assert training["resumable"] is False
    problems = training_checks(open_source(str(folder)))
    assert "unreadable_component" in [p.code for p in problems]
    assert "missing_rng" in [p.code for p in problems]
    assert not marker.exists()


def test_accelerate_save_state_folder(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    folder = tmp_path / "checkpoint_7"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.bin")
    torch.save(sched.state_dict(), folder / "scheduler.bin")
    torch.save({"epoch": 0, "batches_seen": 7}, folder / "sampler.bin")
    torch.save(
        {
            "step": 7,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        folder / "random_states_0.pkl",
    )
    torch.save({"best": 0.5}, folder / "custom_checkpoint_0.pkl")
    training = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert training["layout"] == "accelerate"
    # accelerate records no training step: `random_states_0.pkl`'s counts accumulation
    # micro-steps, and an automatic `checkpoint_N` counts saves
    assert training["step"] is None and training["counter"]
    assert training["optimizer"]["kind"] == "SGD" and training["optimizer"]["complete"]
    assert training["scheduler"]["kind"] == "CosineAnnealingLR"
    assert training["rng"] == ["python", "numpy", "torch_cpu"]
    assert training["resumable"] is True, training["missing"]


def _accelerate_models(folder: Path, models: list[torch.nn.Module]) -> None:
    """accelerate's `save_state` names for several prepared models, each with its AdamW after
    one step: `model{_i}.safetensors`, `optimizer{_i}.bin`, `random_states_0.pkl`."""
    from safetensors.torch import save_file

    folder.mkdir()
    for i, model in enumerate(models):
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, model[0].in_features)).sum().backward()
        opt.step()
        suffix = f"_{i}" if i else ""
        save_file(model.state_dict(), str(folder / f"model{suffix}.safetensors"))
        torch.save(opt.state_dict(), folder / f"optimizer{suffix}.bin")
    torch.save(
        {
            "step": 3,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        folder / "random_states_0.pkl",
    )


def _mlp(*dims: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def test_resumable_checks_every_models_optimizer_shapes(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    _accelerate_models(folder, [_mlp(4, 3), _mlp(6, 5, 2)])
    opened = open_source(str(folder))
    assert opened.training is not None and opened.training.layout == "accelerate"
    assert [p.code for p in training_checks(opened) if p.severity == "error"] == []
    # the second model's optimizer replaced by one of a third model: only it is wrong
    other = _mlp(7, 9)
    opt = torch.optim.AdamW(other.parameters())
    other(torch.randn(2, 7)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer_1.bin")
    problems = training_checks(open_source(str(folder)))
    mismatched = [p for p in problems if p.code == "optimizer_shape_mismatch"]
    assert mismatched, [p.message for p in problems]
    assert all(p.tensor and p.tensor.startswith("optimizer_1.state.") for p in mismatched)
    assert all("optimizer_1" in p.message and "model_1" in p.message for p in mismatched)
    result = run_ckpt("verify", folder, "--resumable", "--json")
    assert result.exit_code == 1, result.stdout
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert "optimizer_shape_mismatch" in codes


def test_accelerate_folder_with_training_args_opens_as_accelerate(
    real_accelerate_run: Path, real_trainer_run: Path, tmp_path: Path
) -> None:
    from transformers import TrainingArguments

    # an accelerate script that saves its TrainingArguments beside `save_state`'s files
    folder = _copy(real_accelerate_run / "straight" / "step-4", tmp_path / "step-4")
    torch.save(TrainingArguments(output_dir=str(tmp_path)), folder / "training_args.bin")
    result = run_ckpt("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    training = result.json["result"]["training"]
    assert training["layout"] == "accelerate"
    assert training["rng"] == ["python", "numpy", "torch_cpu"]  # random_states_0.pkl, read
    assert training["components"]["rng"] == "random_states_0.pkl"
    assert training["components"]["training_args"].startswith("training_args.bin")
    assert training["resumable"] is True, training["missing"]
    converted = run_ckpt("convert", folder, tmp_path / "whole.pt", "--to", "torch", "--json")
    assert converted.exit_code == 0, converted.stderr
    report = converted.json["result"]
    assert "random_states_0.pkl" in report["read"]
    assert [s["name"] for s in report["skipped"] if s["kind"] == "file"] == ["training_args.bin"]
    # a real Trainer checkpoint (training_args.bin among its files) is still the Trainer's
    trainer = run_ckpt("inspect", real_trainer_run / "straight" / "checkpoint-4", "--json")
    assert trainer.json["result"]["training"]["layout"] == "hf-trainer"


def test_lightning_ckpt(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    ckpt = {
        "epoch": 2,
        "global_step": 30,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {"total": {"ready": 3, "completed": 2}},
                "epoch_loop.batch_progress": {"total": {"ready": 30, "completed": 30}},
            }
        },
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": ""}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
    }
    torch.save(ckpt, tmp_path / "epoch=2-step=30.ckpt")
    report = run_ckpt("inspect", tmp_path / "epoch=2-step=30.ckpt", "--json").json["result"]
    # the weights under `state_dict.` are the parameters, Adam's moments (and steps) state
    assert report["parameters"] == 10
    assert report["state_elements"] == {"optimizer": 2 * 10 + 2}
    training = report["training"]
    assert training["layout"] == "lightning"
    assert training["step"] == 30 and training["epoch"] == 2.0
    assert training["weights"]["tensors"] == 2
    assert training["optimizer"]["kind"] == "Adam" and training["optimizer"]["complete"]
    assert training["scheduler"]["kind"] == "StepLR"
    assert training["prefixes"]["model"] == "state_dict."
    # Lightning saves no RNG state by default: resumable, not exactly
    assert training["resumable"] is True and training["missing"] == []
    assert training["exact"] is False and training["missing_exact"] == ["rng"]


def test_select_model_of_a_lightning_file_is_its_state_dict_in_convert_and_diff(
    tmp_path: Path,
) -> None:
    """`--select model` names the weights by the layout's own prefix (`state_dict.` inside a
    Lightning file) in convert as in diff: one rule for every command."""
    from safetensors.torch import load_file

    model = torch.nn.Linear(4, 2)
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    ckpt = {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": weights,
        "loops": {},
        "optimizer_states": [torch.optim.SGD(model.parameters(), lr=0.1).state_dict()],
        "lr_schedulers": [],
    }
    src = tmp_path / "last.ckpt"
    torch.save(ckpt, src)
    out = tmp_path / "weights.safetensors"
    made = run_ckpt("convert", src, out, "--to", "safetensors", "--select", "model")
    assert made.exit_code == 0, made.stderr
    got = load_file(out)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    for a, b in ((src, out), (out, src)):
        result = run_ckpt("diff", a, b, "--select", "model", "--json")
        assert result.exit_code == 0, result.stdout
        assert result.json["result"]["compared"] == len(weights)


def _fake_deepspeed_classes() -> dict[str, Any]:
    """DeepSpeed's pickled data classes under their real module names (deepspeed itself is not
    installed): what a real ZeRO optimizer file refers to."""
    import enum

    for name in (
        "deepspeed",
        "deepspeed.runtime",
        "deepspeed.runtime.fp16",
        "deepspeed.runtime.fp16.loss_scaler",
        "deepspeed.runtime.zero",
        "deepspeed.runtime.zero.config",
    ):
        sys.modules.setdefault(name, types.ModuleType(name))

    class LossScaler:
        def __init__(self, scale: float = 1.0):
            self.cur_scale = scale
            self.dynamic = False

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2

    for cls, module in (
        (LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
        (ZeroStageEnum, "deepspeed.runtime.zero.config"),
    ):
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
        setattr(sys.modules[module], cls.__name__, cls)
    return {"LossScaler": LossScaler, "ZeroStageEnum": ZeroStageEnum}


def test_deepspeed_zero2_global_step_with_latest(tmp_path: Path) -> None:
    classes = _fake_deepspeed_classes()
    model = torch.nn.Linear(4, 2)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    tag = tmp_path / "global_step12"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step12")
    torch.save(
        {
            "module": model.state_dict(),
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [{"weight": torch.Size([2, 4]), "bias": torch.Size([2])}],
            "lr_scheduler": {"last_epoch": 12, "_step_count": 13, "_last_lr": [0.001]},
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0,
            "global_steps": 12,
            "global_samples": 96,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_config": {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}},
            "ds_version": "0.15.0",
        },
        tag / "mp_rank_00_model_states.pt",
    )
    torch.save(
        {
            "optimizer_state_dict": {
                "loss_scaler": classes["LossScaler"](),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": {
                    "state": {
                        0: {
                            "step": torch.tensor(12.0),
                            "exp_avg": torch.zeros_like(flat),
                            "exp_avg_sq": torch.zeros_like(flat),
                        }
                    },
                    "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}],
                },
                "single_partition_of_fp32_groups": [flat.clone()],
                "zero_stage": classes["ZeroStageEnum"].gradients,
                "group_paddings": [0],
                "partition_count": [1],
                "ds_version": "0.15.0",
            },
            "ds_config": {"zero_optimization": {"stage": 2}},
            "ds_version": "0.15.0",
        },
        tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    for name in list(sys.modules):
        if name.startswith("deepspeed"):
            del sys.modules[name]  # the reader must not need deepspeed
    result = run_ckpt("inspect", tmp_path, "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    training = report["training"]
    assert training["layout"] == "deepspeed"
    assert training["step"] == 12
    assert training["weights"]["tensors"] == 2
    assert training["optimizer"]["states"] == ["exp_avg", "exp_avg_sq", "step"]
    assert training["optimizer"]["complete"]
    assert training["scheduler"]["last_epoch"] == 12
    assert training["unreadable"] == {}
    # DeepSpeed saves no RNG or data-loader state unless the client state adds them
    assert training["missing"] == [] and training["missing_exact"] == ["rng", "dataloader"]
    names = {e["name"]: e for e in report["entries"]}
    assert names["optim_states.optimizer_state_dict.loss_scaler"]["py_type"].endswith("LossScaler")


def test_complete_torch_dict_is_resumable_and_checks_pass(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "step": 1,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "dataloader": {"epoch": 0, "index": 3, "perm": torch.randperm(8)},
        },
        tmp_path / "last.pt",
    )
    opened = open_source(str(tmp_path / "last.pt"))
    assert opened.training is not None and opened.training.resumable
    assert training_checks(opened) == []
    weights_only = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights_only)
    assert [p.code for p in training_checks(open_source(str(weights_only)))] == ["not_resumable"]


@pytest.mark.parametrize(
    "scheduler",
    [
        torch.optim.lr_scheduler.LinearLR,
        torch.optim.lr_scheduler.ConstantLR,
        torch.optim.lr_scheduler.PolynomialLR,
        torch.optim.lr_scheduler.ReduceLROnPlateau,
    ],
)
def test_the_scheduler_is_named_by_the_keys_only_its_class_saves(
    tmp_path: Path, scheduler: type
) -> None:
    """LinearLR (the warm-up of many accelerate loops), ConstantLR and PolynomialLR all save
    `total_iters`: `inspect` said "LinearLR/ConstantLR/PolynomialLR" for each, though
    `start_factor`, `factor` and `power` tell them apart."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = scheduler(opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save({**state, "scheduler": sched.state_dict(), "step": 0}, tmp_path / "last.pt")
    result = run_ckpt("inspect", tmp_path / "last.pt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["training"]["scheduler"]["kind"] == scheduler.__name__


@pytest.mark.parametrize("saved_by", ["torch.save", "dcp.save"])
def test_an_optimizer_state_saved_alone_is_optimizer_state_not_parameters(
    tmp_path: Path, saved_by: str
) -> None:
    """`inspect optimizer.pt` (the Trainer's file, `torch.save(opt.state_dict())`, or the same
    dict through `dcp.save`) reports the optimizer: its kind and parameters with state, its
    moments as state elements, and 0 model parameters. It used to count the moments as the
    model's parameters and say nothing of the optimizer."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = tmp_path / ("optimizer.pt" if saved_by == "torch.save" else "optimizer")
    if saved_by == "torch.save":
        torch.save(opt.state_dict(), path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(opt.state_dict(), checkpoint_id=str(path), no_dist=True)
    report = run_ckpt("inspect", path, "--json").json["result"]
    moments = 2 * (4 * 2 + 2)  # exp_avg and exp_avg_sq of the weight and the bias
    assert report["parameters"] == 0
    assert report["state_elements"] == {"optimizer": moments + 2}  # and the two `step`s
    training = report["training"]
    assert training["optimizer"]["kind"] == "AdamW"
    assert training["optimizer"]["params"] == training["optimizer"]["params_with_state"] == 2
    assert training["resumable"] is False and "weights" in training["missing"]
    text = run_ckpt("inspect", path).stdout
    assert "0 parameters" in text and "AdamW" in text


@pytest.mark.parametrize("model_keys", ["under model.", "top-level"])
def test_torchtitan_step_folder_from_dcp_save(tmp_path: Path, model_keys: str) -> None:
    """Older torchtitan saves the model under `model`, 0.2 and later its FQNs at the top level
    beside `optimizer`, `train_state`...: either way the weights are the parameters and the
    optimizer's moments are its state (the top-level case counted them as parameters)."""
    import io
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {
        **({"model": model_sd} if model_keys == "under model." else model_sd),
        "optimizer": optim_sd,
        "lr_scheduler": sched.state_dict(),
        "dataloader": {"rank_0": io.BytesIO(b"sampler position")},
        "train_state": {"step": torch.tensor(5), "ntokens_seen": torch.tensor(100)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
    report = run_ckpt("inspect", tmp_path / "step-5", "--json").json["result"]
    weights = sum(p.numel() for p in model.parameters())
    assert report["parameters"] == weights
    assert report["state_elements"] == {"optimizer": 2 * weights + 4}  # and 4 `step`s
    training = report["training"]
    assert training["layout"] == "torchtitan"
    assert training["step"] == 5
    assert training["weights"]["tensors"] == 4
    assert training["optimizer"]["kind"] == "AdamW"
    assert training["optimizer"]["params"] == training["optimizer"]["params_with_state"] == 4
    assert training["dataloader"] is not None
    # torchtitan keeps no RNG state in the checkpoint: resumable, not exactly
    assert training["resumable"] is True and training["missing"] == []
    assert training["exact"] is False and training["missing_exact"] == ["rng"]
    problems = training_checks(open_source(str(tmp_path / "step-5")))
    assert [(p.code, p.severity) for p in problems] == [("missing_rng", "warning")]
    exact = training_checks(open_source(str(tmp_path / "step-5")), exact=True)
    assert [(p.code, p.severity) for p in exact] == [("missing_rng", "error")]
    # converted to one torch.save file (the data loader's BytesIO left out: ckpt never
    # unpickles it), it is the same training state; it was "no model weights, not
    # resumable" when the model's FQNs sit at the top level
    whole = tmp_path / "step-5.pt"
    converted = run_ckpt(
        "convert", tmp_path / "step-5", whole, "--to", "torch", "--filter-out", "dataloader.*"
    )
    assert converted.exit_code == 0, converted.stderr
    again = run_ckpt("inspect", whole, "--json").json["result"]
    assert again["parameters"] == report["parameters"]
    assert again["state_elements"] == report["state_elements"]
    for key in ("layout", "step", "weights", "optimizer", "resumable", "missing", "exact"):
        assert again["training"][key] == training[key], key


def test_check_source_runs_every_component_check(trainer_run: Path, tmp_path: Path) -> None:
    from ckpt_cli.sources.opening import check_source

    assert check_source(str(trainer_run)) == []
    folder = _copy(trainer_run, tmp_path / "checkpoint-4")
    data = (folder / "scheduler.pt").read_bytes()
    (folder / "scheduler.pt").write_bytes(data[: len(data) // 2])
    problems = check_source(str(folder))
    assert problems and all("scheduler.pt" in (p.file or "") for p in problems)
    # DeepSpeed's `latest` naming a tag that is gone: one problem, not a crash
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "latest").write_text("global_step9")
    torch.save({"module": {}}, ds / "mp_rank_00_model_states.pt")
    assert [p.code for p in check_source(str(ds))] == ["not_found"]


def test_trainer_folder_written_as_one_torch_training_dict(
    trainer_run: Path, tmp_path: Path
) -> None:
    from ckpt_cli.formats.base import WriteOptions
    from ckpt_cli.formats.torch.format import TorchFormat

    from .test_torch_format import assert_same

    out = tmp_path / "out"
    out.mkdir()
    with open_source(str(trainer_run)).checkpoint as checkpoint:
        plan = checkpoint.manifest.entries
        writer = TorchFormat.writer(out, plan, WriteOptions())
        for entry in plan:
            if entry.kind == "tensor":
                writer.write_tensor(entry.name, checkpoint.read_tensor(entry.name))
            else:
                writer.write_object(entry.name, checkpoint.read_object(entry.name))
        writer.finish()
    allow = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allow):
        back = torch.load(out / "pytorch_model.bin", weights_only=True)
        rng = torch.load(trainer_run / "rng_state.pth", weights_only=True)
    assert list(back) == ["model", "optimizer", "scheduler", "rng", "trainer_state"]
    assert_same(back["optimizer"], torch.load(trainer_run / "optimizer.pt", weights_only=True))
    assert_same(back["scheduler"], torch.load(trainer_run / "scheduler.pt", weights_only=True))
    assert_same(back["rng"], rng)
    assert back["trainer_state"]["global_step"] == 4
    model = _demo().TinyLM()
    model.load_state_dict(back["model"])
    for name, tensor in load_file(trainer_run / "model.safetensors").items():
        assert torch.equal(back["model"][name], tensor)


def test_deepspeed_zero3_counts_weights_from_partitions(tmp_path: Path) -> None:
    classes = _fake_deepspeed_classes()
    model = torch.nn.Linear(4, 2)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    tag = tmp_path / "global_step3"
    tag.mkdir()
    torch.save(
        {
            "module": {},
            "param_shapes": [{"weight": torch.Size([2, 4]), "bias": torch.Size([2])}],
            "lr_scheduler": {"last_epoch": 3, "_step_count": 4, "_last_lr": [0.001]},
            "global_steps": 3,
            "ds_config": {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}},
        },
        tag / "zero_pp_rank_0_mp_rank_00_model_states.pt",
    )
    torch.save(
        {
            "optimizer_state_dict": {
                "zero_stage": classes["ZeroStageEnum"].gradients,
                "loss_scaler": classes["LossScaler"](),
                "partition_count": 1,
                "optimizer_state_dict": {
                    "state": {0: {"exp_avg": flat * 0, "exp_avg_sq": flat * 0}},
                    "param_groups": [{"lr": 0.001, "params": [0]}],
                },
                "fp32_flat_groups": [flat.clone()],
            },
        },
        tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    for name in list(sys.modules):
        if name.startswith("deepspeed"):
            del sys.modules[name]
    training = run_ckpt("inspect", tag, "--json").json["result"]["training"]
    assert training["layout"] == "deepspeed" and training["step"] == 3
    assert training["weights"] == {"tensors": 2, "parameters": 10, "bytes": 40}
    assert training["optimizer"]["kind"] == "AdamW" and training["optimizer"]["complete"]
    assert training["missing"] == [] and training["missing_exact"] == ["rng", "dataloader"]


def test_trainer_fsdp_folder_with_dcp_model_and_optimizer(
    trainer_run: Path, tmp_path: Path
) -> None:
    """FSDP with SHARDED_STATE_DICT: the Trainer (through accelerate) saves the model and the
    optimizer as DCP folders wrapped in {"model": ...} / {"optimizer": ...}."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = _copy(trainer_run, tmp_path / "checkpoint-4")
    (folder / "model.safetensors").unlink()
    (folder / "optimizer.pt").unlink()
    model = _demo().TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 5))).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": model_sd}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True
        )
        dcp.save({"optimizer": optim_sd}, checkpoint_id=str(folder / "optimizer_0"), no_dist=True)
    report = run_ckpt("inspect", folder, "--json").json["result"]
    training = report["training"]
    assert training["layout"] == "hf-trainer"
    assert training["weights"]["tensors"] == len(model_sd)
    assert training["optimizer"]["kind"] == "AdamW"
    assert training["optimizer"]["params"] == training["optimizer"]["params_with_state"] == 8
    assert training["resumable"] is True, training["missing"]
    names = {e["name"]: e for e in report["entries"]}
    assert names["model.head.weight"]["file"].startswith("pytorch_model_fsdp_0/")
    assert "optimizer.state.head.weight.exp_avg" in names
    opened = open_source(str(folder))
    assert training_checks(opened) == []
    with opened.checkpoint as checkpoint:
        assert torch.equal(checkpoint.read_tensor("model.fc1.weight"), model_sd["fc1.weight"])
    from ckpt_cli.sources.opening import check_source

    assert check_source(str(folder)) == []


def test_plain_sgd_needs_no_per_parameter_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path / "c.pt"
    )
    training = run_ckpt("inspect", tmp_path / "c.pt", "--json").json["result"]["training"]
    assert training["optimizer"]["kind"] == "SGD" and training["optimizer"]["complete"]
    assert "optimizer state for every parameter" not in training["missing"]
    assert training["missing"] == []
    # no LR scheduler stepped it (no `initial_lr`): none is missing
    assert training["missing_exact"] == ["rng", "dataloader"]


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_per_rank_rng_survives_a_whole_folder_conversion(tmp_path: Path, to: str) -> None:
    """A 2-process Trainer save (`rng_state_0.pth`, `rng_state_1.pth`, each rank's streams as
    the Trainer's `_save_rng_state` writes them) converted whole still says RNG of 2 ranks,
    and exact, like its source."""
    from .run_fixtures import trainer_checkpoint

    folder = tmp_path / "checkpoint-200"
    trainer_checkpoint(folder, 200)
    (folder / "rng_state.pth").unlink()
    for rank in range(2):
        torch.manual_seed(rank)
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cpu": torch.random.get_rng_state(),
            },
            folder / f"rng_state_{rank}.pth",
        )
    source = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert source["rng"] == ["python", "numpy", "torch_cpu"] and source["rng_ranks"] == [0, 1]
    out = tmp_path / ("whole.pt" if to == "torch" else "whole")
    assert run_ckpt("convert", folder, out, "--to", to).exit_code == 0
    converted = run_ckpt("inspect", out, "--json").json["result"]["training"]
    assert converted["rng"] == source["rng"]
    assert converted["rng_ranks"] == [0, 1]
    assert converted["components"]["rng_0"] == "rng_0"
    assert converted["exact"] is source["exact"] is True
    assert converted["missing_exact"] == source["missing_exact"] == []
    assert "(2 ranks: 0, 1)" in run_ckpt("inspect", out).stdout


def test_a_trainer_checkpoint_without_weights_has_no_parameters_from_its_optimizer(
    tmp_path: Path,
) -> None:
    """`parameters` counts the model, never the optimizer's moments: a Trainer checkpoint
    whose model.safetensors is gone showed its optimizer's element count as parameters."""
    from .run_fixtures import trainer_checkpoint

    folder = tmp_path / "checkpoint-100"
    trainer_checkpoint(folder, 100)
    whole = run_ckpt("inspect", folder, "--json").json["result"]
    assert whole["parameters"] > 0 and whole["state_elements"]["optimizer"] > 0
    (folder / "model.safetensors").unlink()
    report = run_ckpt("inspect", folder, "--json").json["result"]
    assert report["parameters"] == 0
    assert report["state_elements"]["optimizer"] == whole["state_elements"]["optimizer"]


def test_a_deepspeed_latest_naming_a_tag_folder_linked_from_outside_is_refused_not_missing(
    tmp_path: Path,
) -> None:
    """`latest` names `global_step9`, a link to a folder outside the checkpoint: 0.1.x `verify`
    and `convert` said the tag was missing (exit 3, "the save was interrupted"); the folder is
    there but out of the checkpoint, so it is refused as a link out (exit 4)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"module": {"w": torch.ones(2)}}, outside / "mp_rank_00_model_states.pt")
    run = tmp_path / "ds"
    (run / "global_step1").mkdir(parents=True)
    torch.save(
        {"module": {"w": torch.ones(2)}}, run / "global_step1" / "mp_rank_00_model_states.pt"
    )
    (run / "global_step9").symlink_to(outside, target_is_directory=True)
    (run / "latest").write_text("global_step9")
    for args in (("verify", run), ("convert", run, tmp_path / "out", "--to", "safetensors")):
        result = run_ckpt(*args)
        assert result.exit_code == 4, result.stderr
        assert "'global_step9' is a link that points outside the checkpoint" in result.stderr
    assert not (tmp_path / "out").exists()


def _plain_loop_saves(ckpt: Path, steps: tuple[int, ...]) -> torch.nn.Module:
    """A training loop of its own: every 100 steps `torch.save` of each state into its own file
    of `ckpt/step_N/` (model.pt, optimizer.pt, scheduler.pt, rng.pt). Returns the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for step in range(1, max(steps) + 1):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step in steps:
            folder = ckpt / f"step_{step}"
            folder.mkdir(parents=True)
            torch.save(model.state_dict(), folder / "model.pt")
            torch.save(opt.state_dict(), folder / "optimizer.pt")
            torch.save(sched.state_dict(), folder / "scheduler.pt")
            rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
            torch.save(rng, folder / "rng.pt")
    return model


def test_a_step_folder_of_separate_torch_save_files_is_a_plain_training_save(
    tmp_path: Path,
) -> None:
    """A loop saving `model.pt`, `optimizer.pt`, `scheduler.pt` and `rng.pt` into
    `ckpt/step_N/` was read as a Hugging Face Trainer checkpoint (for its `optimizer.pt`) with
    no weights: verify failed on an intact save with `missing_weights` and "trainer_state.json
    is missing", and inspect showed no model. It is a plain training save of those four
    components: each listed, none missing, verify passes; a save that lost its model.pt fails
    verify and is never the latest."""
    ckpt = tmp_path / "ckpt"
    model = _plain_loop_saves(ckpt, (100, 200))
    step = ckpt / "step_200"
    report = run_ckpt("inspect", step, "--json").json["result"]
    training = report["training"]
    assert training["layout"] == "torch-files"
    assert training["components"] == {
        "model": "model.pt",
        "optimizer": "optimizer.pt",
        "rng": "rng.pt",
        "scheduler": "scheduler.pt",
    }
    assert training["missing"] == [] and training["resumable"] is True
    assert training["step"] == 200
    assert training["optimizer"]["kind"] == "AdamW"
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    verified = run_ckpt("verify", step, "--json")
    assert verified.exit_code == 0, verified.stdout
    assert verified.json["result"]["problems"] == []
    assert "(torch-files)" in run_ckpt("verify", step).stdout
    # the weights are the model component, as saved
    out = tmp_path / "weights.safetensors"
    converted = run_ckpt("convert", step, out, "--to", "safetensors", "--select", "model")
    assert converted.exit_code == 0, converted.stderr
    saved = torch.load(step / "model.pt", weights_only=True)
    exported = load_file(out)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    # the run's newest save lost its weights: verify says so, latest names the one before
    (step / "model.pt").unlink()
    broken = run_ckpt("verify", step, "--json")
    assert broken.exit_code == 1
    (problem,) = broken.json["result"]["problems"]
    assert problem["code"] == "missing_weights" and "model.pt" in problem["message"]
    assert "trainer_state.json" not in problem["message"]
    latest = run_ckpt("latest", ckpt)
    assert latest.exit_code == 0 and latest.stdout.strip() == str(ckpt / "step_100")
    # a folder of a lone model.pt is a model, not a training save
    lone = tmp_path / "exported"
    lone.mkdir()
    shutil.copy(ckpt / "step_100" / "model.pt", lone / "model.pt")
    plain = run_ckpt("inspect", lone, "--json").json["result"]
    assert plain["format"] == "torch" and plain["training"] is None


#: accelerate `save_state` of an encoder and a decoder stepped by one AdamW, beside a frozen
#: teacher with no optimizer (distillation), then `load_state` of the save into fresh objects
_ACCELERATE_SHARED_OPTIMIZER = """
import itertools, sys, warnings
warnings.simplefilter("ignore")
import torch
from accelerate import Accelerator
def build(seed):
    acc = Accelerator(cpu=True)
    torch.manual_seed(seed)
    enc, dec, teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW(itertools.chain(enc.parameters(), dec.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    return acc, *acc.prepare(enc, dec, teacher, opt, sched)
acc, enc, dec, teacher, opt, sched = build(0)
for _ in range(3):
    x = torch.randn(2, 4)
    acc.backward((dec(enc(x)) - teacher(x)).pow(2).sum())
    opt.step(); sched.step(); opt.zero_grad()
acc.save_state(sys.argv[1])
saved = {k: v.clone() for k, v in opt.state_dict()["state"][3].items()}
acc, *fresh = build(1)
acc.load_state(sys.argv[1])
assert all(torch.equal(fresh[3].state_dict()["state"][3][k], v) for k, v in saved.items())
"""


_ACCELERATE_TWO_KINDS = """
import sys
import torch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
g_opt = torch.optim.AdamW(generator.parameters())
c_opt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
generator, critic, g_opt, c_opt = acc.prepare(generator, critic, g_opt, c_opt)
for _ in range(2):
    acc.backward(generator(torch.ones(1, 4)).sum() + critic(torch.ones(1, 4)).sum())
    g_opt.step()
    c_opt.step()
acc.save_state(sys.argv[1])
"""


def test_two_optimizers_of_different_kinds_are_each_named(tmp_path: Path) -> None:
    """A GAN's accelerate save: an AdamW for the generator, SGD with momentum for the critic
    (`optimizer.bin`, `optimizer_1.bin`). `inspect` called their state "unknown", as if
    neither could be told; each is now named, in order."""
    import subprocess

    save = tmp_path / "step_2"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _ACCELERATE_TWO_KINDS, str(save)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert {"optimizer.bin", "optimizer_1.bin"} <= {p.name for p in save.iterdir()}
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["optimizer"]["kind"] == "AdamW + SGD"
    assert training["optimizer"]["complete"] is True
    assert "AdamW + SGD:" in run_ckpt("inspect", save).stdout


def test_several_models_with_one_optimizer_or_none_are_resumable(tmp_path: Path) -> None:
    """accelerate numbers prepared models and optimizers apart: one AdamW stepping an encoder
    and a decoder (`optimizer.bin` beside `model.safetensors` and `model_1.safetensors`), a
    frozen teacher (`model_2`) with none. `verify --resumable` failed the save ("optimizer
    state covers 4 of 4 parameters", "which no remaining weight of model has") and `doctor`
    blamed an optimizer restored for other parameters, though accelerate's `load_state`
    resumes it. Every optimizer is fitted to the weights of all the models."""
    import subprocess
    import sys

    from .conftest import REPO

    save = tmp_path / "step_3"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _ACCELERATE_SHARED_OPTIMIZER, str(save)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert {"model.safetensors", "model_2.safetensors", "optimizer.bin"} <= {
        p.name for p in save.iterdir()
    }
    assert not (save / "optimizer_1.bin").exists()
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["layout"] == "accelerate"
    assert training["optimizer"]["complete"] is True and training["resumable"] is True
    result = run_ckpt("verify", save, "--resumable", "--json")
    assert result.exit_code == 0, result.stdout
    errors = [p for p in result.json["result"]["problems"] if p["severity"] == "error"]
    assert errors == []
    # an optimizer of weights no model has is still a mismatch, naming the models it was held to
    other = torch.nn.Linear(7, 9)
    opt = torch.optim.AdamW(other.parameters())
    other(torch.randn(2, 7)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), save / "optimizer.bin")
    broken = run_ckpt("verify", save, "--resumable", "--json")
    assert broken.exit_code == 1
    mismatched = [
        p for p in broken.json["result"]["problems"] if p["code"] == "optimizer_shape_mismatch"
    ]
    assert mismatched and all("model, model_1, model_2" in p["message"] for p in mismatched)


def test_a_run_of_torch_files_saves_lists_them_as_torch_files(tmp_path: Path) -> None:
    """`inspect` of one save said `torch-files`, but the run table (`latest --json`, `inspect
    RUN_DIR`) listed its saves, and the run, as `plain`: the saves' files say what they are,
    whatever the script named the folders (`step_N/`)."""
    from .run_fixtures import age

    ckpt = tmp_path / "ckpt"
    _plain_loop_saves(ckpt, (100, 200, 300))
    age(ckpt)
    report = run_ckpt("latest", ckpt, "--json").json["result"]
    assert report["layouts"] == ["torch-files"]
    assert {c["name"]: c["layout"] for c in report["checkpoints"]} == {
        f"step_{n}": "torch-files" for n in (100, 200, 300)
    }
    assert report["latest"] == str(ckpt / "step_300")
    assert "(run folder: torch-files, 3 checkpoints)" in run_ckpt("inspect", ckpt).stdout
    # they have no commit marker: a save cut short before its rng.pt is compared with the others
    (ckpt / "step_300" / "rng.pt").unlink()
    rows = run_ckpt("latest", ckpt, "--json", "--settle", "0").json["result"]["checkpoints"]
    row = {c["name"]: c for c in rows}
    assert row["step_300"]["status"] == "incomplete" and "rng.pt" in row["step_300"]["reason"]
    assert run_ckpt("latest", ckpt).stdout.strip() == str(ckpt / "step_200")


def test_a_plain_saves_step_is_read_from_its_own_meta_file(tmp_path: Path) -> None:
    """`model.pth`, `optim.pth` and a `meta.pt` of `{"step": 7, "epoch": 1}` in a folder whose
    name carries no number: the step and epoch are the meta file's, so the save is resumable
    (it was "missing: step")."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    folder = tmp_path / "last"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "model.pth")
    torch.save(opt.state_dict(), folder / "optim.pth")
    torch.save({"step": 7, "epoch": 1}, folder / "meta.pt")
    training = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert training["layout"] == "torch-files"
    assert training["components"] == {
        "meta": "meta.pt",
        "model": "model.pth",
        "optimizer": "optim.pth",
    }
    assert (training["step"], training["epoch"]) == (7, 1.0)
    assert training["resumable"] is True and training["optimizer"]["kind"] == "SGD"


_ACCELERATE_ONE_MODEL_TWO_OPTIMIZERS = r"""
import sys
import torch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
adamw = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
sgd = torch.optim.SGD(model[1].parameters(), lr=1e-2, momentum=0.9)
model, adamw, sgd = acc.prepare(model, adamw, sgd)
for _ in range(2):
    acc.backward(model(torch.ones(1, 4)).sum())
    adamw.step()
    sgd.step()
acc.save_state(sys.argv[1])
"""


def test_one_model_with_two_optimizers_has_both_described_and_fitted(tmp_path: Path) -> None:
    """One model whose layers two optimizers step (AdamW for some, SGD with momentum for the
    rest: `optimizer.bin`, `optimizer_1.bin` beside one `model.safetensors`). `inspect` described
    the first optimizer alone ("AdamW ... 2/2"), and `verify --resumable` passed a save whose
    `optimizer_1.bin` was another model's state. Both optimizers are now described and fitted
    to the model's weights."""
    import subprocess

    save = tmp_path / "step_2"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _ACCELERATE_ONE_MODEL_TWO_OPTIMIZERS, str(save)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert not (save / "model_1.safetensors").exists()
    training = run_ckpt("inspect", save, "--json").json["result"]["training"]
    assert training["optimizer"]["kind"] == "AdamW + SGD"
    assert training["optimizer"]["params"] == 4 and training["optimizer"]["params_with_state"] == 4
    assert run_ckpt("verify", save, "--resumable").exit_code == 0
    # the second optimizer's state of another model's weights is a mismatch
    other = torch.nn.Linear(7, 9)
    opt = torch.optim.SGD(other.parameters(), lr=1e-2, momentum=0.9)
    other(torch.randn(2, 7)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), save / "optimizer_1.bin")
    broken = run_ckpt("verify", save, "--resumable", "--json")
    assert broken.exit_code == 1, broken.stdout
    mismatched = [
        p for p in broken.json["result"]["problems"] if p["code"] == "optimizer_shape_mismatch"
    ]
    assert mismatched and all("optimizer_1 state" in p["message"] for p in mismatched)


_ACCELERATE_WITH_OR_WITHOUT_SCHEDULER = r"""
import sys
import torch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
objects = [model, optimizer]
if sys.argv[2] == "scheduled":
    objects.append(torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4))
prepared = acc.prepare(*objects)
for _ in range(2):
    acc.backward(prepared[0](torch.ones(1, 4)).sum())
    prepared[1].step()
    if len(prepared) > 2:
        prepared[2].step()
acc.save_state(sys.argv[1])
"""


def test_a_run_without_an_lr_scheduler_lacks_no_scheduler_state(tmp_path: Path) -> None:
    """A script that prepares no LR scheduler (a constant learning rate) saves no
    `scheduler.bin`, and resumes exactly without one; `verify --exact` failed every such save
    with "no LR scheduler state". torch's schedulers set `initial_lr` in each param group they
    schedule, so an optimizer without it had none: nothing is missing. A scheduled run whose
    `scheduler.bin` was lost still lacks it."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    saves = {}
    for kind in ("constant", "scheduled"):
        save = saves[kind] = tmp_path / kind
        cmd = [sys.executable, "-c", _ACCELERATE_WITH_OR_WITHOUT_SCHEDULER, str(save), kind]
        ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
    assert not (saves["constant"] / "scheduler.bin").exists()
    training = run_ckpt("inspect", saves["constant"], "--json").json["result"]["training"]
    assert training["optimizer"]["scheduled"] is False
    assert training["missing_exact"] == ["dataloader"], training
    (saves["scheduled"] / "scheduler.bin").unlink()
    training = run_ckpt("inspect", saves["scheduled"], "--json").json["result"]["training"]
    assert training["optimizer"]["scheduled"] is True
    assert training["missing_exact"] == ["scheduler", "dataloader"], training
    verdict = run_ckpt("verify", saves["scheduled"], "--exact", "--json")
    codes = {p["code"] for p in verdict.json["result"]["problems"]}
    assert verdict.exit_code == 1 and "missing_scheduler" in codes
