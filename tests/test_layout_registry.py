"""One layout protocol for every training layout (issue #14 §2): the folder layouts and the
single-checkpoint ones (Lightning, torchtitan, plain torch dicts) are `Layout`s in the
registry, each with its cheap recognise, open, step naming; run folders name their steps by
those very rules."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ckpt_cli.formats import resolve_source
from ckpt_cli.sources.layouts import (
    FOLDER_LAYOUTS,
    SINGLE_LAYOUTS,
    CompositeDetails,
    Layout,
    Lightning,
    TorchDict,
    TorchTitan,
    analyse_single,
)
from ckpt_cli.sources.opening import open_source
from ckpt_cli.sources.runs import scan_run

from .conftest import run_ckpt
from .run_fixtures import age, dcp_save, trainer_checkpoint, weights


def _lightning_file(path: Path, step: int) -> Path:
    """A `.ckpt` in the key structure Lightning's `trainer.save_checkpoint` writes."""
    model = weights(step)
    torch.save(
        {
            "epoch": 1,
            "global_step": step,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": model,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
            "optimizer_states": [
                {
                    "state": {i: {"exp_avg": t} for i, t in enumerate(model.values())},
                    "param_groups": [{"lr": 0.1, "params": list(range(len(model)))}],
                }
            ],
            "lr_schedulers": [{"last_epoch": step}],
        },
        path,
    )
    return path


def test_every_layout_is_one_protocol_with_a_distinct_name() -> None:
    layouts = [*FOLDER_LAYOUTS, *SINGLE_LAYOUTS]
    assert all(isinstance(layout, Layout) for layout in layouts)
    names = [layout.name for layout in layouts]
    assert len(names) == len(set(names))
    # the catch-all plain dict is asked last
    assert isinstance(SINGLE_LAYOUTS[-1], TorchDict)


def test_lightning_is_recognised_from_names_and_opened_from_keys(tmp_path: Path) -> None:
    ckpt_file = _lightning_file(tmp_path / "epoch=1-step=40.ckpt", 40)
    source = resolve_source(str(ckpt_file))
    lightning = Lightning()
    assert lightning.recognise(source)
    opened = lightning.open(source)
    assert opened is not None and opened.training is not None
    with opened.checkpoint:
        assert opened.training.layout == "lightning"
        assert opened.training.step == 40
        assert opened.training.prefixes["model"] == "state_dict."
    # the same file, opened by the registry walk open_source does, says the same
    walked = open_source(str(ckpt_file))
    with walked.checkpoint:
        assert walked.training is not None
        assert walked.training.model_dump() == opened.training.model_dump()
    # a safetensors file is no Lightning save, by its name alone
    save_file(weights(1), tmp_path / "model.safetensors")
    assert not lightning.recognise(resolve_source(str(tmp_path / "model.safetensors")))


def test_plain_weights_are_no_training_layout(tmp_path: Path) -> None:
    torch.save(weights(3), tmp_path / "weights.pt")
    source = resolve_source(str(tmp_path / "weights.pt"))
    assert TorchDict().recognise(source)
    assert TorchDict().open(source) is None  # plain weights: no training state
    torch.save({"model": weights(3), "optimizer": {"state": {}}, "step": 3}, tmp_path / "t.pt")
    opened = TorchDict().open(resolve_source(str(tmp_path / "t.pt")))
    assert opened is not None and opened.training is not None
    with opened.checkpoint:
        assert opened.training.layout == "torch-dict" and opened.training.step == 3


def test_torchtitan_dcp_is_the_torchtitan_layout(tmp_path: Path) -> None:
    folder = tmp_path / "step-5"
    dcp_save(folder, 5)
    source = resolve_source(str(folder))
    titan = TorchTitan()
    assert titan.recognise(source) and not Lightning().recognise(source)
    opened = titan.open(source)
    assert opened is not None and opened.training is not None
    with opened.checkpoint:
        assert opened.training.layout == "torchtitan" and opened.training.step == 5
        assert analyse_single(opened.checkpoint) == opened.training


def test_run_folders_name_steps_by_the_layouts_own_rules(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer_checkpoint(run / "checkpoint-100", 100)
    dcp_save(run / "checkpoint" / "step-200", 200)
    _lightning_file(run / "epoch=2-step=300-val_loss=0.25.ckpt", 300)
    age(run)
    report = scan_run(run)
    by_layout = {c.layout: c.step for c in report.checkpoints}
    assert by_layout == {"hf-trainer": 100, "torchtitan": 200, "lightning": 300}
    layouts = {layout.name: layout for layout in (*FOLDER_LAYOUTS, *SINGLE_LAYOUTS)}
    for c in report.checkpoints:
        assert layouts[c.layout].step_of(Path(c.path).name) == c.step


def test_a_training_folder_has_typed_details_and_the_same_json(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-9"
    trainer_checkpoint(folder, 9)
    opened = open_source(str(folder))
    with opened.checkpoint as checkpoint:
        details = CompositeDetails.of(checkpoint.manifest)
    assert details is not None
    assert details.layout == "hf-trainer"
    assert details.components == {
        "model": "safetensors",
        "optimizer": "torch",
        "scheduler": "torch",
        "rng": "torch",
        "trainer_state": "json",
    }
    # the JSON output is the typed model's dump, key for key
    shown = run_ckpt("inspect", folder, "--json").json["result"]["details"]
    assert shown == {"layout": "hf-trainer", "components": details.components}
    save_file(weights(1), tmp_path / "model.safetensors")
    plain = open_source(str(tmp_path / "model.safetensors"))
    with plain.checkpoint as checkpoint:
        assert CompositeDetails.of(checkpoint.manifest) is None
