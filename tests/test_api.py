"""The library API: a training script calls the same operations the CLI runs, typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckpt_cli

from .conftest import REPO


def test_a_script_inspects_verifies_and_converts_through_the_package(tmp_path: Path) -> None:
    weights = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.zeros(4)}
    src = tmp_path / "model.safetensors"
    save_file(weights, str(src))

    report = ckpt_cli.inspect(str(src))
    assert isinstance(report, ckpt_cli.InspectReport)
    assert (report.format, report.tensors, report.parameters) == ("safetensors", 2, 16)

    verdict = ckpt_cli.verify(str(src))
    assert isinstance(verdict, ckpt_cli.VerifyReport) and verdict.ok

    converted = ckpt_cli.convert(str(src), str(tmp_path / "out.pt"), "torch")
    assert isinstance(converted, ckpt_cli.ConvertReport)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())

    same = ckpt_cli.diff(str(src), str(tmp_path / "out.pt"))
    assert isinstance(same, ckpt_cli.DiffReport) and same.identical

    resharded = ckpt_cli.reshard(str(src), str(tmp_path / "shards"), max_shard_size="50B")
    assert isinstance(resharded, ckpt_cli.ReshardReport)
    assert len(list((tmp_path / "shards").glob("*.safetensors.index.json"))) == 1
    shards = sorted((tmp_path / "shards").glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert torch.equal(f.get_tensor(key), weights[key])


def test_every_export_resolves_and_unknown_names_raise() -> None:
    for name in ckpt_cli.__all__:
        assert getattr(ckpt_cli, name) is not None
    try:
        ckpt_cli.no_such_operation  # noqa: B018
    except AttributeError as error:
        assert "no_such_operation" in str(error)
    else:
        raise AssertionError("an unknown name resolved")


def test_importing_the_package_loads_no_operation_and_no_torch() -> None:
    probe = "import sys, ckpt_cli; print(sorted(m for m in sys.modules if m.startswith(('torch', 'ckpt_cli.'))))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert out.strip() == "[]"


def test_all_lists_exactly_the_lazy_exports() -> None:
    assert sorted(ckpt_cli.__all__) == sorted(["__version__", *ckpt_cli._EXPORTS])


def test_every_command_has_its_library_entry_point() -> None:
    from ckpt_cli.cli.completions import describe_app

    for command in describe_app():
        assert callable(getattr(ckpt_cli, command.name)), command.name


def test_a_script_protects_loses_a_shard_and_repairs_through_the_package(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "model"
    folder.mkdir()
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
    save_torch_state_dict(weights, folder, max_shard_size="20KB")  # 4 shards + index
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) == 4
    lost, original = shards[2], shards[2].read_bytes()

    protected = ckpt_cli.protect(str(folder), parity=1)
    assert isinstance(protected, ckpt_cli.ProtectReport)
    lost.unlink()  # a shard lost with its node

    repaired = ckpt_cli.repair(str(folder))
    assert isinstance(repaired, ckpt_cli.RepairReport)
    assert lost.read_bytes() == original
    assert ckpt_cli.verify(str(folder)).ok
