"""Metadata paths never import torch: `inspect` and plain `verify` of every header-only format,
including a DCP training checkpoint whose step, param groups and scheduler are torch.save blobs.

Each check runs a real `ckpt` process and reads `sys.modules` at its exit. Plain torch.save
files (state dicts, optimizer and scheduler states, and RNG states with their numpy arrays: the
Trainer and accelerate checkpoints made of them) are read by a restricted unpickler too. Files
that pickle other classes (DeepSpeed's model states, Lightning's hyper-parameters) are loaded
with torch (on the meta device, no data); they are not in this list.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, run_ckpt

PROBE = (
    "import sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
    "from ckpt_cli.cli.app import main\n"
    "code = 0\n"
    "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
    "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', code, file=sys.stderr)"
)


def _torch_free(*args: str | Path) -> tuple[bool, int, str]:
    """(torch stayed unimported, exit code, stdout) of one real `ckpt ARGS` process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, env=env
    )
    verdict, code = proc.stderr.strip().splitlines()[-1].split()
    return verdict == "NO_TORCH", int(code), proc.stdout


def _training_dcp(folder: Path) -> dict[str, Any]:
    """A torchtitan-style step folder written by `dcp.save`: model, AdamW, scheduler, step."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {
        "model": model_sd,
        "optimizer": optim_sd,
        "lr_scheduler": sched.state_dict(),
        "train_state": {"step": torch.tensor(3)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import gguf
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((4, 3)).astype(np.float32)}, str(root / "m.safetensors"))
    sharded = root / "sharded"
    sharded.mkdir()
    weight_map = {}
    for i, name in enumerate(("a", "b"), start=1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({name: np.zeros(3, np.float32)}, str(sharded / file))
        weight_map[name] = file
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 24}, "weight_map": weight_map})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.ones(4, 2), "b": torch.zeros(2)},
            checkpoint_id=str(root / "dcp"),
            no_dist=True,
        )
    _training_dcp(root / "step-3")
    writer = gguf.GGUFWriter(str(root / "m.gguf"), "llama")
    writer.add_tensor("t", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "safetensors": root / "m.safetensors",
        "sharded": sharded,
        "dcp": root / "dcp",
        "dcp-training": root / "step-3",
        "gguf": root / "m.gguf",
    }


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "dcp", "dcp-training", "gguf"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.slow
def test_metadata_commands_never_import_torch(
    sources: dict[str, Path], kind: str, command: str
) -> None:
    torch_free, code, stdout = _torch_free(command, sources[kind], "--json")
    assert code == 0, stdout
    assert torch_free, f"`ckpt {command}` of a {kind} checkpoint imported torch"
    assert json.loads(stdout)["result"]


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_trainer_and_accelerate_checkpoints_are_read_without_torch(
    real_trainer_run: Path, real_accelerate_run: Path, framework: str, command: str
) -> None:
    # optimizer.pt, scheduler.pt and the RNG states (numpy arrays inside) as the frameworks
    # wrote them: read by the restricted unpickler, the same summary as in-process
    step = (
        real_trainer_run / "straight" / "checkpoint-4"
        if framework == "trainer"
        else real_accelerate_run / "straight" / "step-4"
    )
    torch_free, code, stdout = _torch_free(command, step, "--json")
    assert code == 0, stdout
    assert torch_free, f"`ckpt {command}` of a {framework} checkpoint imported torch"
    result = json.loads(stdout)["result"]
    assert result == run_ckpt(command, step, "--json").json["result"]


def test_an_rng_state_read_without_torch_holds_what_torch_load_returns(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from ckpt_cli.formats.torch.format import object_allowlist
    from ckpt_cli.formats.torch.zip_index import TensorLayout, read_plain_torch_zip

    random.seed(3)
    np.random.seed(3)
    # what transformers' Trainer._save_rng_state writes, plus a numpy scalar
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
        "scale": np.float32(0.5),
    }
    path = tmp_path / "rng_state.pth"
    torch.save(state, path)
    with torch.serialization.safe_globals(object_allowlist()):
        want = torch.load(path, weights_only=True)
    data = path.read_bytes()
    found = read_plain_torch_zip(lambda at, n: data[at : at + n], 0, len(data))
    assert found is not None
    got = found[1]
    assert isinstance(got, dict) and got["python"] == want["python"]
    assert got["numpy"][0] == want["numpy"][0] and got["numpy"][2:] == want["numpy"][2:]
    assert np.array_equal(got["numpy"][1], want["numpy"][1])
    assert got["numpy"][1].dtype == want["numpy"][1].dtype
    assert type(got["scale"]) is type(want["scale"]) and got["scale"] == want["scale"]
    layout = got["cpu"]
    assert isinstance(layout, TensorLayout) and layout.data_offset is not None
    raw = data[layout.data_offset : layout.data_offset + layout.nbytes]
    assert raw == want["cpu"].numpy().tobytes()
    # numpy's array recipe only as numpy pickles arrays: a pickle asking `_reconstruct` for a
    # 2 GiB shape would get the allocation before any data check
    core = getattr(np, "_core", None) or np.core

    class Huge:
        def __reduce__(self) -> Any:
            return (core.multiarray._reconstruct, (np.ndarray, (1 << 31,), b"b"))

    buffer = io.BytesIO()
    torch.save({"rng": Huge()}, buffer, pickle_module=pickle)
    blob = buffer.getvalue()
    assert read_plain_torch_zip(lambda at, n: blob[at : at + n], 0, len(blob)) is None
    # an array of Python objects is not plain data: left to torch.load, which refuses it
    buffer = io.BytesIO()
    torch.save({"objects": np.array([{"a": 1}], dtype=object)}, buffer)
    blob = buffer.getvalue()
    assert read_plain_torch_zip(lambda at, n: blob[at : at + n], 0, len(blob)) is None


def test_dcp_training_summary_without_torch_matches_the_saved_state(
    sources: dict[str, Path],
) -> None:
    """The values read without torch are the ones torch saved (step, groups, scheduler)."""
    torch_free, code, stdout = _torch_free("inspect", sources["dcp-training"], "--json")
    assert torch_free and code == 0
    training = json.loads(stdout)["result"]["training"]
    assert training["layout"] == "torchtitan"
    assert training["step"] == 3  # a one-element tensor blob, decoded from its storage
    assert training["optimizer"]["kind"] == "AdamW"  # decoupled_weight_decay from a group blob
    assert training["optimizer"]["params"] == training["optimizer"]["params_with_state"] == 4
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {"lr_scheduler": {"last_epoch": 0, "_step_count": 0, "_last_lr": []}}
    dcp.load(state, checkpoint_id=str(sources["dcp-training"]), no_dist=True)
    saved = state["lr_scheduler"]
    assert training["scheduler"]["last_epoch"] == saved["last_epoch"] == 3
    assert training["scheduler"]["step_count"] == saved["_step_count"]
    assert training["scheduler"]["last_lr"] == saved["_last_lr"][0]
    # the same summary as the torch-based reader gives in-process
    assert run_ckpt("inspect", sources["dcp-training"], "--json").json["result"]["training"] == (
        training
    )


def test_plain_reader_matches_torch_load_and_runs_nothing(tmp_path: Path) -> None:
    import torch

    from ckpt_cli.formats.torch.pickle_values import (
        NotPlain,
        SavedTensorValue,
        load_plain,
        saved_scalar,
    )

    values: list[Any] = [
        {"lr": 0.01, "betas": (0.9, 0.999), "params": ["a.weight", "b.bias"], "amsgrad": False},
        [1, 2.5, None, "x", b"raw", {3, 4}],
    ]
    for value in values:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        assert load_plain(buffer.getvalue()) == torch.load(io.BytesIO(buffer.getvalue()))
    for scalar in (
        torch.tensor(7),
        torch.tensor(2.5),
        torch.tensor([1.5], dtype=torch.bfloat16),
        torch.tensor(True),
        torch.tensor(-3, dtype=torch.int32),
        torch.arange(10)[4],  # a view into a larger storage: the offset is honoured
    ):
        buffer = io.BytesIO()
        torch.save(scalar, buffer)
        assert saved_scalar(buffer.getvalue()) == scalar.item()
    buffer = io.BytesIO()
    torch.save({"big": torch.zeros(3, 5)}, buffer)
    record = load_plain(buffer.getvalue())["big"]
    assert isinstance(record, SavedTensorValue) and record.shape == [3, 5] and record.value is None

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer, pickle_module=pickle)
    with pytest.raises(NotPlain, match="system"):
        load_plain(buffer.getvalue())
    assert not marker.exists()
    with pytest.raises(NotPlain):
        load_plain(b"PK\x03\x04 truncated")
