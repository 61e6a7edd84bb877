"""Exporting the weights of an FSDP Trainer checkpoint for `from_pretrained`.

With FSDP's SHARDED_STATE_DICT the Trainer saves through accelerate's `save_fsdp_model` /
`save_fsdp_optimizer`: `dcp.save({"model": state_dict})` into `pytorch_model_fsdp_0/` and
`dcp.save({"optimizer": ...})` into `optimizer_0/`, beside `trainer_state.json`, the scheduler
and the RNG state, and no `config.json` (the model's `save_pretrained` is not called). The
fixture takes a real Trainer checkpoint of the tiny Llama and writes its model and optimizer
that way, with `get_state_dict` and `dcp.save` (one process: FSDP itself needs no GPU to save,
but a 2-rank FSDP Trainer job on CPU is not something the Trainer supports).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .hub_server import TestHub

pytestmark = pytest.mark.frameworks


@pytest.fixture
def fsdp_checkpoint(trainer_runs: dict[str, Path], tiny_llama: Path, tmp_path: Path) -> Path:
    """`checkpoint-2/` of a real Trainer run, saved the way FSDP SHARDED_STATE_DICT saves."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaForCausalLM

    folder = shutil.copytree(trainer_runs["full"] / "checkpoint-2", tmp_path / "checkpoint-2")
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    # one more AdamW step, so the optimizer has state to save beside the weights
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.arange(8).unsqueeze(0) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for name in ("model.safetensors", "optimizer.pt", "config.json", "generation_config.json"):
        (folder / name).unlink(missing_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": model_sd}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True
        )
        dcp.save({"optimizer": optim_sd}, checkpoint_id=str(folder / "optimizer_0"), no_dist=True)
    return folder


def _reference(fsdp_checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights as `dcp.load` reads them from the FSDP save."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    model = LlamaForCausalLM(tiny_config())
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"model": state},
            checkpoint_id=str(fsdp_checkpoint / "pytorch_model_fsdp_0"),
            no_dist=True,
        )
    return state


def _loads_bit_exact(folder: Path, want: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)  # the config says which model
    assert isinstance(model, LlamaForCausalLM)
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_fsdp_weights_without_a_config_say_why_from_pretrained_fails(
    fsdp_checkpoint: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf-model"
    result = run_ckpt(
        "convert", fsdp_checkpoint, out, "--to", "safetensors", "--select", "model", "--json"
    )
    assert result.exit_code == 0, result.stdout
    [warning] = [w for w in result.json["result"]["warnings"] if "config.json" in w]
    assert "from_pretrained" in warning and "--config" in warning
    assert not (out / "config.json").exists()
    with pytest.raises((OSError, ValueError)):
        AutoModelForCausalLM.from_pretrained(out)
    human = run_ckpt(
        "convert", fsdp_checkpoint, tmp_path / "again", "--to", "safetensors", "--select", "model"
    )
    assert human.exit_code == 0 and "holds no config.json" in human.stderr
    # a dry run says it too, before anything is written
    planned = run_ckpt(
        "convert",
        fsdp_checkpoint,
        tmp_path / "plan",
        "--to",
        "safetensors",
        "--select",
        "model",
        "--dry-run",
        "--json",
    )
    assert any("config.json" in w for w in planned.json["result"]["warnings"])


def test_config_from_a_folder_or_file_makes_the_export_load_bit_exact(
    fsdp_checkpoint: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    want = _reference(fsdp_checkpoint)
    for spec in (tiny_llama, tiny_llama / "config.json"):
        out = tmp_path / f"from-{spec.name}"
        result = run_ckpt(
            "convert",
            fsdp_checkpoint,
            out,
            "--to",
            "safetensors",
            "--select",
            "model",
            "--config",
            spec,
            "--json",
        )
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert not any("config.json" in w for w in report["warnings"]), report["warnings"]
        assert report["config_written"] == str(out / "config.json")
        assert (out / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
        _loads_bit_exact(out, want)


def test_config_from_the_hub_makes_the_export_load_bit_exact(
    fsdp_checkpoint: Path, tiny_llama: Path, tmp_path: Path, hub: TestHub
) -> None:
    config = (tiny_llama / "config.json").read_bytes()
    hub.add_repo("org/tiny-llama", {"config.json": config, "README.md": b"# tiny\n"})
    out = tmp_path / "hf-model"
    result = run_ckpt(
        "convert",
        fsdp_checkpoint,
        out,
        "--to",
        "safetensors",
        "--select",
        "model",
        "--config",
        "hf://org/tiny-llama",
        "--json",
    )
    assert result.exit_code == 0, result.stdout
    assert "org/tiny-llama" in result.json["result"]["config_source"]
    assert (out / "config.json").read_bytes() == config
    _loads_bit_exact(out, _reference(fsdp_checkpoint))


def test_a_bad_config_is_refused_and_nothing_written(
    fsdp_checkpoint: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    base = ("convert", fsdp_checkpoint)
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_ckpt(*base, tmp_path / "a", "--to", "safetensors", "--config", empty)
    assert missing.exit_code == 3 and "config.json" in missing.stderr
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    bad = run_ckpt(*base, tmp_path / "b", "--to", "safetensors", "--config", tmp_path / "list.json")
    assert bad.exit_code == 4 and "JSON object" in bad.stderr
    one_file = run_ckpt(
        *base,
        tmp_path / "c.safetensors",
        "--to",
        "safetensors",
        "--select",
        "model",
        "--config",
        tiny_llama,
    )
    assert one_file.exit_code == 2 and "folder" in one_file.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "empty", "list.json"]


def test_the_optimizers_dcp_metadata_is_named_as_the_optimizers(
    fsdp_checkpoint: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """An export of the weights leaves the optimizer's `optimizer_0/` behind: both of its
    files are listed with why. Its `.metadata` was listed as "a hidden file: not part of the
    checkpoint", a wrong reason (it is the optimizer's DCP index, part of the save)."""
    result = run_ckpt(
        "convert", fsdp_checkpoint, tmp_path / "hf", "--to", "hf", "--config", tiny_llama,
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stdout
    reasons = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    assert "none of its entries was selected" in reasons["optimizer_0/__0_0.distcp"]
    metadata = reasons["optimizer_0/.metadata"]
    assert metadata == "the index of the optimizer component, none of whose entries was selected"
