"""`ckpt diff` of two saves of one training run: "what changed between them?" - a user's story.

A training save is more than its weights: the optimizer's moments and step counts, the LR
scheduler, every RNG stream, the data position, and the files the frameworks pickle whole and
ckpt never unpickles (a Trainer's `training_args.bin`, accelerate's `sampler.bin` and a
registered object's `custom_checkpoint_N.pkl`). Each pair below differs in ONE component, and
`diff` must name that one, and nothing else.

The pickled files were only named in a warning, with whether their bytes matched: two saves
whose sampler epoch, registered object or learning rate differed were IDENTICAL, exit 0. They
are now compared: a TrainingArguments or a sampler by its plain attributes (read as data,
nothing of its class imported or run), any other pickle by its bytes.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import LossWindow


def _diffed(a: Path, b: Path, *options: str) -> dict[str, Any]:
    result = run_ckpt("diff", a, b, *options, "--json")
    assert result.exit_code in (0, 1), result.stdout + result.stderr
    report: dict[str, Any] = result.json["result"]
    return report


def _changed(report: dict[str, Any]) -> list[str]:
    """Every name the report calls different: entries, metadata keys, one-side names."""
    return sorted(
        [d["name"] for d in report["differences"]]
        + [m["key"] for m in report["metadata"]]
        + report["only_a"]
        + report["only_b"]
    )


@pytest.mark.frameworks
def test_accelerate_saves_differing_in_the_sampler_or_a_registered_object_are_different(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, save

    AcceleratorState._reset_state()
    GradientState._reset_state()
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    rows = torch.utils.data.TensorDataset(torch.randn(16, 8))
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    window = LossWindow()
    accelerator.register_for_checkpointing(window)
    for (x,) in loader:
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        window.recent.append(0.5)

    def save_state(name: str) -> Path:
        # nothing trains between the saves: each holds what the one before it holds, but for
        # what the test changed (accelerate's own writer, then the sampler as it writes it)
        folder = tmp_path / name
        accelerator.save_state(str(folder))
        save(loader.get_sampler(), folder / "sampler.bin", safe_serialization=False)
        return folder

    base = save_state("base")
    again = save_state("again")
    window.recent.append(0.25)  # the registered object alone moves on
    window_moved = save_state("window")
    loader.get_sampler().set_epoch(7)  # the sampler alone: the next epoch's shuffle order
    epoch_moved = save_state("epoch")
    (epoch_moved / "custom_checkpoint_0.pkl").write_bytes(
        (window_moved / "custom_checkpoint_0.pkl").read_bytes()
    )

    same = _diffed(base, again)
    assert same["identical"] is True, same["verdict"]
    assert not any("not compared" in w for w in same["warnings"]), same["warnings"]

    moved = _diffed(base, window_moved)
    assert moved["identical"] is False
    assert _changed(moved) == ["custom_checkpoint_0.pkl"], moved["verdict"]
    assert moved["components"] == {"custom_0": 1}
    assert torch.load(base / "custom_checkpoint_0.pkl", weights_only=False) != torch.load(
        window_moved / "custom_checkpoint_0.pkl", weights_only=False
    )

    epoch = _diffed(window_moved, epoch_moved)
    assert _changed(epoch) == ["sampler.bin:epoch"], epoch["verdict"]
    (key,) = epoch["metadata"]
    before = torch.load(window_moved / "sampler.bin", weights_only=False).epoch
    after = torch.load(epoch_moved / "sampler.bin", weights_only=False).epoch
    assert before != after == 7
    assert (key["value_a"], key["value_b"]) == (str(before), "7")  # JSON text
    assert epoch["components"] == {"sampler": 1}

    shown = run_ckpt("diff", window_moved, epoch_moved)
    assert shown.exit_code == 1
    assert "sampler.bin:epoch" in shown.stdout and "sampler (1)" in shown.stdout


def _trainer_copy(src: Path, dest: Path, file: str, change: Any) -> Path:
    """A copy of a Trainer save whose `file` was loaded, changed and saved back with torch.save
    (the Trainer's own writer for it)."""
    shutil.copytree(src, dest)
    value = torch.load(dest / file, weights_only=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = change(value) or value
        torch.save(value, dest / file)
    return dest


@pytest.mark.frameworks
def test_trainer_saves_differing_in_their_training_arguments_are_different(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    from transformers.trainer_utils import SchedulerType

    save = real_trainer_run / "straight" / "checkpoint-4"

    def retuned(args: Any) -> None:
        args.learning_rate = 5e-4
        args.lr_scheduler_type = SchedulerType("cosine")

    other = _trainer_copy(save, tmp_path / "retuned", "training_args.bin", retuned)
    report = _diffed(save, other)
    assert report["identical"] is False
    assert _changed(report) == [
        "training_args.bin:learning_rate",
        "training_args.bin:lr_scheduler_type",
    ], report["verdict"]
    values = {m["key"]: (m["value_a"], m["value_b"]) for m in report["metadata"]}
    assert values["training_args.bin:learning_rate"] == ("0.001", "0.0005")
    assert values["training_args.bin:lr_scheduler_type"] == ('"linear"', '"cosine"')
    assert report["components"] == {"training_args": 2}

    # the restart test still holds: a resumed run writes into another output_dir, which says
    # where the run writes, not how it trains (named in a warning, no difference)
    resumed = _diffed(save, real_trainer_run / "resumed" / "checkpoint-4")
    assert resumed["identical"] is True, resumed["verdict"]
    (said,) = [w for w in resumed["warnings"] if "training_args.bin" in w]
    assert "output_dir" in said and "not a difference" in said


@pytest.mark.frameworks
@pytest.mark.parametrize(
    ("file", "component"),
    [
        ("rng_state.pth", "rng.cpu"),
        ("scheduler.pt", "scheduler.last_epoch"),
        ("optimizer.pt", "optimizer.state.3.exp_avg_sq"),
        ("trainer_state.json", "trainer_state.global_step"),
    ],
)
def test_trainer_saves_differing_in_one_component_name_it_alone(
    real_trainer_run: Path, tmp_path: Path, file: str, component: str
) -> None:
    """A guard: these components were already compared (weights, optimizer per parameter,
    scheduler, RNG, data position)."""
    save = real_trainer_run / "straight" / "checkpoint-4"
    if file == "trainer_state.json":
        other = shutil.copytree(save, tmp_path / "other")
        state = json.loads((other / file).read_text())
        state["global_step"] = 3  # where the data loader resumes: batches skipped
        (other / file).write_text(json.dumps(state, indent=2))
    else:

        def change(value: Any) -> None:
            if file == "rng_state.pth":
                value["cpu"] = torch.Generator().manual_seed(99).get_state()
            elif file == "scheduler.pt":
                value["last_epoch"] += 1
            else:
                value["state"][3]["exp_avg_sq"] = value["state"][3]["exp_avg_sq"] * 2

        other = _trainer_copy(save, tmp_path / "other", file, change)
    report = _diffed(save, other)
    assert _changed(report) == [component], report["verdict"]


def test_torchtitan_steps_differing_in_one_state_name_it_alone(tmp_path: Path) -> None:
    """A guard for torchtitan-like DCP saves (`dcp.save` of model, optimizer, lr_scheduler,
    dataloader, train_state): each state was already compared."""
    import torch.distributed.checkpoint as dcp

    from .run_fixtures import titan_states

    def saved(name: str, change: Any = None) -> Path:
        state = titan_states(4)
        if change is not None:
            change(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(tmp_path / name), no_dist=True)
        return tmp_path / name

    def moment(state: dict[str, Any]) -> None:
        key = next(k for k in state["optimizer"] if k.endswith("exp_avg_sq"))
        state["optimizer"][key] = state["optimizer"][key] + 1

    base = saved("base")
    cases = {
        "dataloader.dp_rank_0": lambda s: s["dataloader"].update(
            dp_rank_0=pickle.dumps({"sample_idx": 5})
        ),
        "train_state.ntokens_seen": lambda s: s["train_state"].update(ntokens_seen=1),
        "lr_scheduler.last_epoch": lambda s: s["lr_scheduler"].update(last_epoch=7),
        "optimizer.state.model.layers.0.weight.exp_avg_sq": moment,
    }
    assert _diffed(base, saved("same"))["identical"] is True
    for name, change in cases.items():
        report = _diffed(base, saved(name, change))
        assert _changed(report) == [name], report["verdict"]


@pytest.mark.frameworks
def test_a_training_save_against_its_hf_export_says_the_training_state_is_on_one_side(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """`convert --to hf` keeps the model alone. Diffed whole, every name of the save stands on
    its side (the training state among them) and a warning names `--select model`; with it, the
    weights were IDENTICAL and the optimizer, scheduler, RNG and trainer state the export lacks
    vanished without a word. They are now named as held by one side only."""
    from safetensors import safe_open

    save = real_trainer_run / "straight" / "checkpoint-4"
    export = tmp_path / "hf"
    made = run_ckpt("convert", save, export, "--to", "hf")
    assert made.exit_code == 0, made.stdout + made.stderr
    with safe_open(export / "model.safetensors", "pt") as f:
        exported = set(f.keys())

    whole = _diffed(save, export)
    assert whole["identical"] is False and sorted(whole["only_b"]) == sorted(exported)
    held = {n.split(".", 1)[0] for n in whole["only_a"]}
    assert {"optimizer", "scheduler", "rng", "trainer_state"} <= held

    lined = _diffed(save, export, "--select", "model")
    assert lined["identical"] is True and lined["compared"] == len(exported)
    (said,) = [w for w in lined["warnings"] if "only A" in w]
    for component in ("optimizer", "scheduler", "rng", "trainer_state", "training_args"):
        assert component in said, said
    # two training saves: --select is the user's choice of a part, nothing more to say
    both = _diffed(save, real_trainer_run / "resumed" / "checkpoint-4", "--select", "model")
    assert not [w for w in both["warnings"] if "only A" in w or "only B" in w]
