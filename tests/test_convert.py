"""`ckpt convert`: real checkpoints in, real readers judge the output, bit-exact."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from huggingface_hub import load_torch_model, save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file
from torch.serialization import get_unsafe_globals_in_checkpoint

from ckpt_cli.formats import open_checkpoint

from .conftest import REPO, RecordingProgress, run_ckpt
from .dist_helpers import run_torchrun
from .hub_fixtures import publish_model
from .hub_server import TestHub


class TinyModel(torch.nn.Module):
    """A model whose state dict mixes shapes, dtypes and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.norm = torch.nn.LayerNorm(16)
        self.register_buffer("positions", torch.arange(12, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    state = {k: v.detach().clone() for k, v in TinyModel().state_dict().items()}
    state["embed.weight"] = state["embed.weight"].to(torch.bfloat16)
    return state


def read_safetensors_folder(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file or sharded folder, through `safe_open`."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            metadata = f.metadata() or {}
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert name not in tensors
                tensors[name] = f.get_tensor(name)
    return tensors, metadata


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def hf_save(state: dict[str, torch.Tensor], folder: Path, max_shard_size: str) -> Path:
    """Write `state` with huggingface_hub's own sharded writer."""
    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
    return folder


def digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_sharded_safetensors_loads_with_huggingface_hub_and_matches_its_sharding(
    tmp_path: Path,
) -> None:
    state = tiny_state()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt", "note": "x"})
    src = tmp_path / "model.safetensors"
    before = digest(src)
    result = run_ckpt(
        "convert", src, tmp_path / "out", "--to", "safetensors", "--max-shard-size", "3KB", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["raw_copies"] == len(state) and report["checked"] is True
    out_state, metadata = read_safetensors_folder(tmp_path / "out")
    assert_same(out_state, state)
    assert metadata == {"format": "pt", "note": "x"}
    # the same shard names and weight_map as huggingface_hub's own writer at the same limit,
    # given the tensors in the order they are stored in the source (no tensor above the limit:
    # huggingface_hub then puts that one before the shard it interrupts; we keep tensor order)
    with open_checkpoint(str(src)) as checkpoint:
        order = [e.name for e in checkpoint.manifest.entries]
    hf_save({name: state[name] for name in order}, tmp_path / "hf", "3KB")
    ours = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    model = TinyModel()
    model.embed.to(torch.bfloat16)
    load_torch_model(model, tmp_path / "out", strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert digest(src) == before
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_sharded_to_single_file_and_back(tmp_path: Path) -> None:
    state = tiny_state()
    hf_save(state, tmp_path / "hf", "1KB")
    assert (
        run_ckpt(
            "convert", tmp_path / "hf", tmp_path / "one.safetensors", "--to", "safetensors"
        ).exit_code
        == 0
    )
    got, metadata = read_safetensors_folder(tmp_path / "one.safetensors")
    assert_same(got, state)
    assert metadata["format"] == "pt"
    result = run_ckpt(
        "convert",
        tmp_path / "one.safetensors",
        tmp_path / "again",
        "--to",
        "safetensors",
        "--max-shard-size",
        "1500",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert len(result.json["result"]["files"]) > 2
    assert_same(read_safetensors_folder(tmp_path / "again")[0], state)


@pytest.mark.parametrize(
    ("flag", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_dtype_cast_equals_tensor_to_and_leaves_ints_alone(
    tmp_path: Path, flag: str, dtype: torch.dtype
) -> None:
    state = tiny_state()
    save_file(state, tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "c.safetensors",
        "--to",
        "safetensors",
        "--dtype",
        flag,
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    got, _ = read_safetensors_folder(tmp_path / "c.safetensors")
    want = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    assert_same(got, want)
    assert got["positions"].dtype == torch.int64 and got["mask"].dtype == torch.bool
    report = result.json["result"]
    assert report["casts"] == sum(
        1 for v in state.values() if v.is_floating_point() and v.dtype != dtype
    )


def test_include_exclude_rename_select_do_what_they_say(tmp_path: Path) -> None:
    state = {f"model.{k}": v for k, v in tiny_state().items()}
    state["lm_head.weight"] = torch.randn(4, 16)
    save_file(state, tmp_path / "m.safetensors")
    src = tmp_path / "m.safetensors"
    run = lambda out, *args: run_ckpt("convert", src, tmp_path / out, "--to", "safetensors", *args)  # noqa: E731
    assert run("sel.safetensors", "--select", "model").exit_code == 0
    got, _ = read_safetensors_folder(tmp_path / "sel.safetensors")
    assert_same(
        got, {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    )
    assert run("inc.safetensors", "--filter", "*.layers.*", "--filter-out", "*.bias").exit_code == 0
    got, _ = read_safetensors_folder(tmp_path / "inc.safetensors")
    assert set(got) == {f"model.layers.{i}.weight" for i in range(4)}
    # a glob that matches no entry does nothing: it says so (stderr, --json), it is no error
    stray = run("stray.safetensors", "--filter-out", "layers.*", "--filter-out", "*.bias")
    assert stray.exit_code == 0
    assert stray.stderr.count("--filter-out 'layers.*' matches no entry") == 1  # once, not twice
    assert "'*.bias'" not in stray.stderr
    warned = run("stray2.safetensors", "--filter", "*.weight", "--filter", "lm_head*x", "--json")
    assert warned.json["result"]["warnings"] == [
        "--filter 'lm_head*x' matches no entry, so it has no effect; "
        "check it against `ckpt inspect --list`"
    ]
    assert (
        run("ren.safetensors", "--rename", "model.layers.=blocks.", "--rename", "model.=").exit_code
        == 0
    )
    got, _ = read_safetensors_folder(tmp_path / "ren.safetensors")
    assert torch.equal(got["blocks.2.bias"], state["model.layers.2.bias"])
    assert torch.equal(got["norm.weight"], state["model.norm.weight"])
    assert "lm_head.weight" in got and len(got) == len(state)
    # mistakes are named, and nothing is written
    missing = run("none.safetensors", "--select", "optimizer")
    assert missing.exit_code == 3 and "model" in missing.stderr
    clash = run("clash.safetensors", "--rename", "model.=", "--rename", "lm_head.=norm.")
    assert clash.exit_code == 2, clash.stderr
    assert run("bad.safetensors", "--rename", "nonsense").exit_code == 2
    assert (
        not (tmp_path / "none.safetensors").exists()
        and not (tmp_path / "clash.safetensors").exists()
    )


def test_progress_counts_every_byte_written_once(tmp_path: Path) -> None:
    from ckpt_cli.ops.convert.run import convert

    state = tiny_state()
    save_file(state, tmp_path / "model.safetensors")
    recorder = RecordingProgress()
    report = convert(
        str(tmp_path / "model.safetensors"), str(tmp_path / "out"), "dcp", progress=recorder
    )
    assert report.checked
    tensor_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert [(total, done) for _, total, done in recorder.phases] == [(tensor_bytes, tensor_bytes)]
    assert "dcp" in recorder.description


def test_existing_dest_is_refused_without_force_and_replaced_with_it(tmp_path: Path) -> None:
    state = tiny_state()
    save_file(state, tmp_path / "m.safetensors")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    refused = run_ckpt("convert", tmp_path / "m.safetensors", dest, "--to", "safetensors", "--json")
    assert refused.exit_code == 2
    assert refused.json["error"]["code"] == "destination_exists"
    assert (dest / "keep.txt").read_text() == "mine"
    forced = run_ckpt("convert", tmp_path / "m.safetensors", dest, "--to", "safetensors", "--force")
    assert forced.exit_code == 0, forced.stderr
    assert not (dest / "keep.txt").exists()
    assert_same(read_safetensors_folder(dest)[0], state)


def test_dest_inside_or_equal_to_the_source_is_refused(tmp_path: Path) -> None:
    hf_save(tiny_state(), tmp_path / "hf", "1KB")
    before = digest(tmp_path / "hf")
    for dest in (tmp_path / "hf", tmp_path / "hf" / "sub"):
        result = run_ckpt("convert", tmp_path / "hf", dest, "--to", "safetensors", "--force")
        assert result.exit_code == 2 and "overlaps" in result.stderr
    assert digest(tmp_path / "hf") == before


def test_sigkill_mid_copy_leaves_no_complete_looking_dest_and_source_untouched(
    tmp_path: Path,
) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(40)}
    src = tmp_path / "src"
    hf_save(state, src, "100KB")
    before = digest(src)
    dest = tmp_path / "dest"
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_TEST_COPY_DELAY="0.05")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckpt_cli",
            "convert",
            str(src),
            str(dest),
            "--to",
            "safetensors",
            "--max-shard-size",
            "50KB",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # wait until the copy has started writing shards into its staging folder
        deadline = time.monotonic() + 120
        staged: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            staged = [p for p in tmp_path.glob(".dest.ckpt-tmp-*/*.safetensors")]
            if len(staged) >= 2:
                break
            time.sleep(0.02)
        assert len(staged) >= 2, "the copy never started writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists()
    assert digest(src) == before
    leftovers = list(tmp_path.glob(".dest.ckpt-tmp-*"))
    assert leftovers and not list(leftovers[0].glob("*.index.json"))
    # the leftover is clearly an interrupted write; a new run succeeds beside it
    result = run_ckpt("convert", src, dest, "--to", "safetensors")
    assert result.exit_code == 0, result.stderr
    assert_same(read_safetensors_folder(dest)[0], state)


def test_usage_errors_are_exit_2(tmp_path: Path) -> None:
    save_file(tiny_state(), tmp_path / "m.safetensors")
    src = tmp_path / "m.safetensors"
    cases = [
        ["--to", "onnx"],
        ["--to", "safetensors", "--dtype", "int8"],
        ["--to", "safetensors", "--max-shard-size", "lots"],
        ["--to", "safetensors", "--world-size", "2"],
        ["--to", "dcp", "--dcp-serialization", "pickle"],
    ]
    for args in cases:
        result = run_ckpt("convert", src, tmp_path / "o", *args)
        assert result.exit_code == 2, (args, result.stderr)
    sharded_file = run_ckpt(
        "convert", src, tmp_path / "x.safetensors", "--to", "safetensors", "--max-shard-size", "1KB"
    )
    assert sharded_file.exit_code == 2 and "folder" in sharded_file.stderr
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".o*"))


def test_sizes_parse_like_huggingface_hub() -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    from ckpt_cli.sizes import parse_size

    for text in ("5GB", "500MB", "1.5GB", "10KB", " 2TB "):
        assert parse_size(text) == parse_size_to_int(text)
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("4096") == 4096


# ---- every pair of formats, written by the real writers, judged by the real readers ----

SOURCES = ["safetensors", "dcp", "dcp-safetensors", "torch"]
TARGETS = ["safetensors", "dcp", "dcp-safetensors", "torch"]


def mixed_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(10, 8, generator=gen).to(torch.bfloat16),
        "layers.0.weight": torch.randn(6, 8, generator=gen),
        "layers.0.bias": torch.randn(6, generator=gen),
        "layers.1.weight": torch.randn(5, 6, generator=gen).to(torch.float16),
        "positions": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True]),
        "scale": torch.tensor(0.5),
    }


def save_with_real_writer(kind: str, state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write `state` with the library users would use for that format; returns SRC."""
    import torch.distributed.checkpoint as dcp

    if kind == "safetensors":
        save_file(state, path / "model.safetensors")
        return path / "model.safetensors"
    if kind == "torch":
        torch.save(state, path / "model.pt")
        return path / "model.pt"
    if kind == "dcp":
        dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=path / "dcp", no_dist=True)
        return path / "dcp"
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = FileSystemWriter(path / "dcp-st", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({k: v.clone() for k, v in state.items()}, storage_writer=writer, no_dist=True)
    return path / "dcp-st"


def load_with_real_reader(
    kind: str, dest: Path, like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Read a converted checkpoint back with that format's own reader."""
    import torch.distributed.checkpoint as dcp

    if kind == "safetensors":
        return read_safetensors_folder(dest)[0]
    if kind == "torch":
        loaded = torch.load(dest, weights_only=True)
        assert isinstance(loaded, dict)
        return loaded
    if kind == "dcp":
        target = {k: torch.empty_like(v) for k, v in like.items()}
        dcp.load(target, checkpoint_id=dest, no_dist=True)
        return target
    # torch's FileSystemReader cannot read the safetensors serialization back (it torch.loads
    # the blob), so the embedded safetensors headers are read with safe_open's parser instead
    from safetensors.torch import load

    out: dict[str, torch.Tensor] = {}
    for file in sorted(dest.glob("*.distcp")):
        data = file.read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        end = (
            8
            + header_len
            + max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
        )
        if len(header) > 1:
            out.update(load(data[:end]))
    return out


def convert_args(kind: str, dest: Path) -> list[str]:
    if kind == "dcp-safetensors":
        return [str(dest), "--to", "dcp", "--dcp-serialization", "safetensors"]
    return [str(dest), "--to", kind]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.slow
def test_every_pair_of_formats_converts_bit_exact(tmp_path: Path, source: str, target: str) -> None:
    state = mixed_state()
    src = save_with_real_writer(source, state, tmp_path)
    before = digest(src)
    dest = tmp_path / ("out.pt" if target == "torch" else "out")
    result = run_ckpt("convert", src, *convert_args(target, dest), "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["tensors"] == len(state) and report["skipped"] == []
    got = load_with_real_reader(target, dest, state)
    assert_same(got, state)
    assert digest(src) == before
    # and back to the source's format, still bit-exact
    back = tmp_path / ("back.pt" if source == "torch" else "back")
    if source == "safetensors":
        back = tmp_path / "back.safetensors"
    again = run_ckpt("convert", dest, *convert_args(source, back))
    assert again.exit_code == 0, again.stderr
    assert_same(load_with_real_reader(source, back, state), state)
    assert run_ckpt("diff", src, back).exit_code == 0


def training_checkpoint(path: Path) -> tuple[Path, torch.nn.Module]:
    """A plain torch.save training dict: model (with tied weights), AdamW state, step, RNG."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(12, 4), torch.nn.Linear(4, 12))
    model[1].weight = model[0].weight  # tied input/output embedding
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": 7,
            "rng": torch.get_rng_state(),
        },
        path / "train.pt",
    )
    return path / "train.pt", model


def test_select_model_extracts_weights_of_a_training_checkpoint(tmp_path: Path) -> None:
    src, model = training_checkpoint(tmp_path)
    result = run_ckpt(
        "convert",
        src,
        tmp_path / "w.safetensors",
        "--to",
        "safetensors",
        "--select",
        "model",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["tied"] == [["0.weight", "1.weight"]]
    assert report["aliases"] == {"1.weight": "0.weight"}
    got, metadata = read_safetensors_folder(tmp_path / "w.safetensors")
    # written once (safetensors cannot share storage), the alias recorded as safetensors' own
    # save_model and huggingface_hub do
    assert set(got) == {"0.weight", "1.bias"}
    assert metadata == {"format": "pt", "1.weight": "0.weight"}
    for name in got:
        assert torch.equal(got[name], model.state_dict()[name])
    # non-tensor entries of the whole checkpoint are reported as skipped for safetensors
    whole = run_ckpt("convert", src, tmp_path / "all.safetensors", "--to", "safetensors", "--json")
    skipped = {s["name"] for s in whole.json["result"]["skipped"]}
    assert "step" in skipped and "optimizer.param_groups.0.lr" in skipped
    human = run_ckpt("convert", src, tmp_path / "all2.safetensors", "--to", "safetensors")
    assert "skipped" in human.stderr and "step" in human.stderr


def test_training_state_is_carried_to_torch_and_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src, _ = training_checkpoint(tmp_path)
    original = torch.load(src, weights_only=True)
    assert run_ckpt("convert", src, tmp_path / "copy.pt", "--to", "torch").exit_code == 0
    copy = torch.load(tmp_path / "copy.pt", weights_only=True)
    assert copy["step"] == 7 and torch.equal(copy["rng"], original["rng"])
    assert copy["optimizer"]["param_groups"] == original["optimizer"]["param_groups"]
    # the tie survives: torch.save stores the shared storage once
    assert copy["model"]["0.weight"].data_ptr() == copy["model"]["1.weight"].data_ptr()
    assert run_ckpt("convert", src, tmp_path / "dcp", "--to", "dcp").exit_code == 0
    state = {
        "model": {k: torch.empty_like(v) for k, v in original["model"].items()},
        "step": 0,
        "rng": torch.empty_like(original["rng"]),
    }
    dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert state["step"] == 7 and torch.equal(state["rng"], original["rng"])
    for name, tensor in original["model"].items():
        assert torch.equal(state["model"][name], tensor)
    assert run_ckpt("diff", src, tmp_path / "dcp").exit_code == 0


def test_dtype_cast_across_formats_equals_tensor_to(tmp_path: Path) -> None:
    state = mixed_state()
    src = save_with_real_writer("dcp", state, tmp_path)
    dest = tmp_path / "bf16"
    result = run_ckpt(
        "convert", src, dest, "--to", "safetensors", "--dtype", "bf16", "--max-shard-size", "200"
    )
    assert result.exit_code == 0, result.stderr
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    assert_same(read_safetensors_folder(dest)[0], want)
    assert run_ckpt("diff", src, dest).exit_code == 1
    close = run_ckpt("diff", src, dest, "--filter", "layers.0.*", "--json").json["result"]
    assert {d["status"] for d in close["differences"]} == {"dtype"}


def test_dtype_cast_of_a_training_checkpoint_keeps_the_optimizer_step_counters(
    tmp_path: Path,
) -> None:
    """`--dtype bf16` of a training save cast AdamW's `step` counters too: bfloat16 holds 301
    as 300, and the resumed optimizer (which keeps the loaded counter's dtype) then adds 1 to
    300 forever. The moments and weights are cast; the counters are kept as saved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(301):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, src)
    dest = tmp_path / "bf16"

    result = run_ckpt("convert", src, dest, "--to", "torch", "--dtype", "bf16")

    assert result.exit_code == 0, result.stderr
    (out,) = dest.glob("*.bin")
    saved = torch.load(out, weights_only=True)
    for state in saved["optimizer"]["state"].values():
        assert state["step"].dtype == torch.float32 and state["step"].item() == 301
        assert state["exp_avg"].dtype == torch.bfloat16
    resumed_model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    resumed_model.load_state_dict(saved["model"])
    resumed = torch.optim.AdamW(resumed_model.parameters())
    resumed.load_state_dict(saved["optimizer"])
    resumed_model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    resumed.step()
    assert {s["step"].item() for s in resumed.state_dict()["state"].values()} == {302}


_TORCHRUN_SAVE = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from tests.dist_helpers import RANK_TIMEOUT

dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
gen = torch.Generator().manual_seed(5)
full = {"w": torch.randn(10, 6, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "scale": torch.tensor(2.0)}
state = {k: (distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v) for k, v in full.items()}
dcp.save({"model": state, "step": 3}, checkpoint_id=sys.argv[1])
if dist.get_rank() == 0:
    torch.save(full, sys.argv[2])
dist.barrier()
# gloo's teardown can abort ("terminate called without an active exception"); the work is done
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.torchrun
def test_two_rank_dcp_from_torchrun_to_safetensors_and_back(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    script = tmp_path / "save.py"
    script.write_text(_TORCHRUN_SAVE)
    src = tmp_path / "dcp2"
    run_torchrun(script, 2, src, tmp_path / "full.pt", timeout=240)
    assert sorted(p.name for p in src.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    result = run_ckpt(
        "convert",
        src,
        tmp_path / "hf",
        "--to",
        "safetensors",
        "--select",
        "model",
        "--max-shard-size",
        "200",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    # every tensor of the model written; the step counter beside it listed as left behind
    skipped = [(s["name"], s["kind"]) for s in result.json["result"]["skipped"]]
    assert skipped == [("step", "component")]
    assert_same(read_safetensors_folder(tmp_path / "hf")[0], full)
    back = tmp_path / "back"
    assert (
        run_ckpt(
            "convert",
            tmp_path / "hf",
            back,
            "--to",
            "dcp",
            "--world-size",
            "2",
            "--rename",
            "=model.",
        ).exit_code
        == 0
    )
    assert sorted(p.name for p in back.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    target = {"model": {k: torch.empty_like(v) for k, v in full.items()}}
    dcp.load(target, checkpoint_id=back, no_dist=True)
    assert_same(target["model"], full)
    assert run_ckpt("diff", src, back, "--filter", "model.*").exit_code == 0


@pytest.mark.parametrize("serialization", ["torch_save", "safetensors"])
def test_safetensors_to_dcp_for_three_ranks_and_back(tmp_path: Path, serialization: str) -> None:
    state = mixed_state()
    save_file(state, tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "dcp",
        "--to",
        "dcp",
        "--world-size",
        "3",
        "--dcp-serialization",
        serialization,
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["world_size"] == 3 and report["dcp_serialization"] == serialization
    # raw bytes go straight into the safetensors serialization's blobs, or into the torch.save
    # containers of the torch_save serialization
    assert report["raw_copies"] == len(state)
    files = sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    if serialization == "torch_save":
        assert_same(load_with_real_reader("dcp", tmp_path / "dcp", state), state)
    assert (
        run_ckpt(
            "convert", tmp_path / "dcp", tmp_path / "back.safetensors", "--to", "safetensors"
        ).exit_code
        == 0
    )
    assert_same(read_safetensors_folder(tmp_path / "back.safetensors")[0], state)


def test_convert_from_the_hub_fetches_only_the_selected_tensors(
    hub: TestHub, tmp_path: Path
) -> None:
    gen = torch.Generator().manual_seed(2)
    state = {f"layers.{i}.weight": torch.randn(256, 256, generator=gen) for i in range(6)}
    publish_model(hub, "org/model", tmp_path / "pub", state, max_shard_size="600KB", extras=False)
    index = json.loads((tmp_path / "pub" / "model.safetensors.index.json").read_text())
    shard_of_0 = index["weight_map"]["layers.0.weight"]
    result = run_ckpt(
        "convert",
        "hf://org/model",
        tmp_path / "l0.safetensors",
        "--to",
        "safetensors",
        "--filter",
        "layers.0.*",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert_same(
        read_safetensors_folder(tmp_path / "l0.safetensors")[0],
        {"layers.0.weight": state["layers.0.weight"]},
    )
    for shard in sorted(set(index["weight_map"].values())):
        size = (tmp_path / "pub" / shard).stat().st_size
        if shard == shard_of_0:
            assert hub.bytes_sent("org/model", shard) >= 256 * 256 * 4
        else:  # a header probe only
            assert hub.bytes_sent("org/model", shard) < size / 4, shard


def test_format_safetensors_on_a_folder_without_any_is_refused_not_empty(tmp_path: Path) -> None:
    """`-f safetensors` on a folder of `.bin` shards (or an empty one) is no empty checkpoint
    that every command calls fine (inspect showed 0 tensors, verify OK, convert and reshard
    wrote an empty model): exit 4, or one error from verify, naming the folder and the fix."""
    folder = tmp_path / "bin-model"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    for src in (folder, empty):
        shown = run_ckpt("inspect", src, "-f", "safetensors")
        assert shown.exit_code == 4 and "holds no .safetensors file" in shown.stderr
        checked = run_ckpt("verify", src, "-f", "safetensors", "--json")
        assert checked.exit_code == 1
        assert [p["code"] for p in checked.json["result"]["problems"]] == ["bad_checkpoint"]
        out = tmp_path / f"out-{src.name}"
        written = run_ckpt("convert", src, out, "-f", "safetensors", "--to", "torch")
        assert written.exit_code == 4 and not out.exists()
        resharded = run_ckpt(
            "reshard",
            src,
            tmp_path / f"rs-{src.name}",
            "-f",
            "safetensors",
            "--max-shard-size",
            "1KB",
        )
        assert resharded.exit_code == 4 and not (tmp_path / f"rs-{src.name}").exists()
    # detected as what it is, it converts as ever
    assert run_ckpt("inspect", folder, "--json").json["result"]["format"] == "torch"


def test_dtype_cast_of_a_model_folder_writes_a_config_that_says_so(tmp_path: Path) -> None:
    """`from_pretrained` loads in the dtype `config.json` names: a `--dtype bf16` copy whose
    config still said float32 came back as a float32 model. The dtype it declares
    (`torch_dtype`, transformers 5's `dtype`, sub-configs too) follows the cast; nothing else
    in it changes, and a config that names no dtype (or `auto`) is copied as it is."""
    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": torch.randn(4, 4), "step": torch.tensor(3)}, src / "model.safetensors")
    config = {
        "model_type": "llava",
        "dtype": "float32",
        "text_config": {"torch_dtype": "float32", "hidden_size": 4},
        "vision_config": {"dtype": "auto"},
    }
    (src / "config.json").write_text(json.dumps(config))
    result = run_ckpt(
        "convert", src, tmp_path / "bf16", "--to", "safetensors", "--dtype", "bf16", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["config_dtype"] == "bfloat16" and "config.json" not in report["extras"]
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert written == {
        **config,
        "dtype": "bfloat16",
        "text_config": {"torch_dtype": "bfloat16", "hidden_size": 4},
    }
    human = run_ckpt("convert", src, tmp_path / "fp16", "--to", "safetensors", "--dtype", "fp16")
    assert "config.json says float16" in human.stdout
    # no cast, or a config without a dtype: copied byte for byte
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert (
        run_ckpt(
            "convert", src, tmp_path / "plain", "--to", "safetensors", "--dtype", "bf16"
        ).exit_code
        == 0
    )
    assert (tmp_path / "plain" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_select_of_a_training_component_that_cannot_be_read_names_it(tmp_path: Path) -> None:
    """`--select model` of a Trainer checkpoint whose model.safetensors is cut short said
    "no entry is under the prefix 'model'" (exit 3): the component is there, unreadable.
    It is named with what is wrong (exit 4), as without --select."""
    from .run_fixtures import trainer_checkpoint

    folder = tmp_path / "checkpoint-100"
    trainer_checkpoint(folder, 100)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])
    result = run_ckpt(
        "convert", folder, tmp_path / "out", "--to", "safetensors", "--select", "model"
    )
    assert result.exit_code == 4, result.stderr
    assert (
        "model.safetensors" in result.stderr and "model component cannot be read" in result.stderr
    )
    assert not (tmp_path / "out").exists()


def test_a_filter_written_for_the_selected_names_says_it_matches_the_source_names(
    tmp_path: Path,
) -> None:
    """`--select model --filter 'layers.0.*'` (the glob `diff` takes, on the names after
    --select) said "no entry is under the prefix 'model'. Top-level keys here: model." (exit 3):
    the prefix is there; convert's globs match the source names, before --select strips it."""
    state = {
        "model.layers.0.weight": torch.full((2, 3), 1.0),
        "model.layers.1.weight": torch.full((2, 3), 2.0),
        "optimizer.step": torch.tensor(7),
    }
    save_file(state, tmp_path / "ckpt.safetensors")
    args = ["--to", "safetensors", "--select", "model"]
    result = run_ckpt(
        "convert", tmp_path / "ckpt.safetensors", tmp_path / "a.safetensors", *args,
        "--filter", "layers.0.*", "--json",
    )  # fmt: skip
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert "no entry is under the prefix" not in error["message"]
    assert "--filter" in error["message"] and "'model'" in error["message"]
    assert "--filter 'model.layers.0.*'" in error["fix"], error["fix"]
    assert not (tmp_path / "a.safetensors").exists()
    # the fix, as given, works
    fixed = run_ckpt(
        "convert", tmp_path / "ckpt.safetensors", tmp_path / "b.safetensors", *args,
        "--filter", "model.layers.0.*",
    )  # fmt: skip
    assert fixed.exit_code == 0, fixed.stderr
    with safe_open(tmp_path / "b.safetensors", "pt") as f:
        assert list(f.keys()) == ["layers.0.weight"]
        assert torch.equal(f.get_tensor("layers.0.weight"), state["model.layers.0.weight"])
    # a prefix that really is absent is still named as such
    absent = run_ckpt(
        "convert", tmp_path / "ckpt.safetensors", tmp_path / "c.safetensors",
        "--to", "safetensors", "--select", "ema", "--json",
    )  # fmt: skip
    assert absent.exit_code == 3
    assert "no entry is under the prefix 'ema'" in absent.json["error"]["message"]


@pytest.mark.parametrize("world_size", ["1", "3"])
def test_a_dcp_dry_run_lists_the_files_and_entries_the_real_run_writes(
    tmp_path: Path, world_size: str
) -> None:
    """`convert --to dcp -n` put every entry on `.metadata` and none on the rank files, the
    other way round from what the real run reports."""
    state = {f"layers.{i}.weight": torch.full((4, 2), float(i)) for i in range(3)}
    state["step"] = torch.tensor(7)
    state["bias"] = torch.ones(2)  # 2 rows: no chunk for rank 2 of 3
    save_file(state, tmp_path / "m.safetensors")
    args = ["convert", tmp_path / "m.safetensors", tmp_path / "dcp", "--to", "dcp"]
    args += ["--world-size", world_size, "--json"]
    planned = run_ckpt(*args, "--dry-run").json["result"]["files"]
    written = run_ckpt(*args).json["result"]["files"]
    assert [(f["path"], f["entries"]) for f in planned] == [
        (f["path"], f["entries"]) for f in written
    ]


def test_a_dry_run_lists_the_files_written_beside_the_weights(tmp_path: Path) -> None:
    """Dry runs of convert and reshard used to list the weights alone: no carried config.json /
    tokenizer.json, no config.json or generation_config.json an `--to hf` export writes."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "src"
    dcp.save({"w": torch.ones(4, 2)}, checkpoint_id=str(src), no_dist=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "tokenizer.json").write_text("{}")
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    runs = [
        ("convert", src, tmp_path / "c", "--to", "dcp"),
        ("reshard", src, tmp_path / "r", "--world-size", "2"),
        ("convert", tmp_path / "llama", tmp_path / "h", "--to", "hf"),
    ]
    for args in runs:
        dry = run_ckpt(*args, "-n", "--json")
        assert dry.exit_code == 0, dry.stdout + dry.stderr
        planned = dry.json["result"]
        listed = sorted([f["path"] for f in planned["files"]] + planned["extras"])
        real = run_ckpt(*args, "--json")
        assert real.exit_code == 0, real.stdout + real.stderr
        assert listed == sorted(os.listdir(args[2])), args
        assert planned.get("config_written") == real.json["result"].get("config_written"), args


def test_a_companion_left_out_on_purpose_says_why_not_that_ckpt_cannot_carry_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A user converts a `save_pretrained` folder with `--no-extras`, then with `--config`
    from another model: the source's `config.json` is reported as left out by that option,
    not as "nor a companion it carries (config, tokenizer...)", which contradicted itself."""
    from transformers import LlamaForCausalLM

    bare = run_ckpt("convert", tiny_llama, tmp_path / "bare", "--to", "safetensors", "--no-extras")
    assert bare.exit_code == 0, bare.stdout + bare.stderr
    assert sorted(os.listdir(tmp_path / "bare")) == ["model.safetensors"]
    assert "config.json: left out (--no-extras)" in bare.stderr, bare.stderr
    assert "nor a companion it carries" not in bare.stderr, bare.stderr
    again = run_ckpt(
        "convert", tiny_llama, tmp_path / "b2", "--to", "safetensors", "--no-extras", "--json"
    )
    reasons = {s["name"]: s["reason"] for s in again.json["result"]["skipped"]}
    assert reasons["config.json"] == "left out (--no-extras)", reasons
    assert reasons["generation_config.json"] == "left out (--no-extras)", reasons

    other = tmp_path / "other.json"
    other.write_text((tiny_llama / "config.json").read_text())
    out = tmp_path / "given"
    given = run_ckpt("convert", tiny_llama, out, "--to", "safetensors", "--config", other, "--json")
    assert given.exit_code == 0, given.stdout + given.stderr
    skipped = {s["name"]: s["reason"] for s in given.json["result"]["skipped"]}
    assert skipped["config.json"] == f"replaced by --config {other}", skipped
    assert (out / "config.json").read_text() == other.read_text()
    model = LlamaForCausalLM.from_pretrained(out)
    want = LlamaForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())


def test_converting_an_output_dir_names_each_save_beside_the_model_once(tmp_path: Path) -> None:
    """A Trainer's `output_dir` after `trainer.save_model()`: the final model at the root, the
    run's `checkpoint-N/` saves beside it. `ckpt convert out export` converts the root model;
    the saves' files were each "in a subfolder ckpt does not read" (one line a file, cut at
    eight), which hid that they are saves. Each save is now one line saying it is a
    checkpoint of its own and how to convert it; `--json` still lists every file."""
    from .run_fixtures import trainer_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.ones(4)}, out / "model.safetensors")
    (out / "config.json").write_text('{"model_type": "llama"}')
    for step in (2, 4, 6):
        trainer_checkpoint(out / f"checkpoint-{step}", step)
    saved = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and "/" in p.relative_to(out).as_posix()
    )
    result = run_ckpt("convert", out, tmp_path / "export", "--to", "safetensors")
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "not in the output" in line]
    assert len(lines) == 3, result.stderr
    for step, line in zip((2, 4, 6), lines, strict=True):
        assert f"checkpoint-{step}/ (" in line and "a checkpoint of its own" in line, line
        assert f"ckpt convert {out}/checkpoint-{step}" in line, line
    again = run_ckpt("convert", out, tmp_path / "export2", "--to", "safetensors", "--json")
    skipped = {s["name"] for s in again.json["result"]["skipped"] if s["kind"] == "file"}
    assert skipped == set(saved)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_a_cast_keeps_the_weights_transformers_loads_in_float32(
    tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    """T5 lists its feed-forward output `wo` in `_keep_in_fp32_modules`: `from_pretrained(dtype=
    torch.float16)` loads it in float32. `convert --dtype fp16` rounded it to float16, so the
    model loaded from the copy held other `wo` weights than the one loaded from the source.
    They now stay as stored under fp16 (bf16, which the list does not cover, casts them), and
    the copy loads as the source does, bit for bit."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    out = tmp_path / "out"
    r = run_ckpt("convert", tmp_path / "t5", out, "--to", "safetensors", "--dtype", dtype)
    assert r.exit_code == 0, r.stderr
    with safe_open(out / "model.safetensors", framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    wo = {k: v for k, v in stored.items() if k.endswith("DenseReluDense.wo.weight")}
    assert len(wo) == 2
    assert set(wo.values()) == ({"F32"} if dtype == "fp16" else {"BF16"}), stored
    assert {v for k, v in stored.items() if k not in wo} == {dtype.upper().replace("FP", "F")}
    want = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", dtype=torch_dtype)
    got = T5ForConditionalGeneration.from_pretrained(out, dtype=torch_dtype)
    expected, loaded = want.state_dict(), got.state_dict()
    assert expected.keys() == loaded.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_cast_keeps_the_weights_diffusers_loads_in_float32(tmp_path: Path) -> None:
    """Wan's video transformer lists its time embedder and modulation (`scale_shift_table`) in
    `_keep_in_fp32_modules`, which diffusers loads in float32 under any dtype. `convert --dtype
    bf16` rounded them, so the copy loaded other weights than the source under
    `torch_dtype=torch.bfloat16`; they stay as stored and the copy loads bit-exact."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    ).save_pretrained(tmp_path / "wan")  # fmt: skip
    out = tmp_path / "out"
    r = run_ckpt("convert", tmp_path / "wan", out, "--to", "safetensors", "--dtype", "bf16")
    assert r.exit_code == 0, r.stderr
    with safe_open(out / "diffusion_pytorch_model.safetensors", framework="pt") as f:
        assert f.get_slice("scale_shift_table").get_dtype() == "F32"
        assert f.get_slice("proj_out.weight").get_dtype() == "BF16"
    want = WanTransformer3DModel.from_pretrained(tmp_path / "wan", torch_dtype=torch.bfloat16)
    got = WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    expected, loaded = want.state_dict(), got.state_dict()
    assert expected.keys() == loaded.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_dry_run_of_a_trainer_checkpoint_says_which_tensors_are_copied_raw_as_the_run_does(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """A user plans the conversion of a Trainer `checkpoint-N/` with `--dry-run --json` before
    running it: the weights (safetensors) and the optimizer's step counters and RNG state
    (torch.save blobs) are copied as raw bytes by the run, and the plan says so entry by entry.
    It used to say `tensor` (deserialised) for every one of them and `raw_copies: 0`."""
    src = real_trainer_run / "straight" / "checkpoint-4"
    for to, extra in (("safetensors", []), ("dcp", ["--world-size", "2"]), ("torch", [])):
        out = tmp_path / to
        args = ("convert", src, out, "--to", to, *extra, "--json")
        before = sorted(p.name for p in tmp_path.iterdir())
        dry = run_ckpt(*args, "--dry-run")
        assert dry.exit_code == 0, dry.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
        real = run_ckpt(*args)
        assert real.exit_code == 0, real.stderr
        planned, done = dry.json["result"], real.json["result"]
        assert [(e["name"], e["how"]) for e in planned["entries"]] == [
            (e["name"], e["how"]) for e in done["entries"]
        ], to
        assert planned["raw_copies"] == done["raw_copies"] > 0, to
    # what was copied raw reads back bit-exact with the real reader
    written = tmp_path / "safetensors" / "model.safetensors"
    with safe_open(src / "model.safetensors", "pt") as a, safe_open(written, "pt") as b:
        for name in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(a.get_tensor(name), b.get_tensor(f"model.{name}")), name
    # a cast is no raw copy, in the plan as in the run
    cast = run_ckpt(
        "convert",
        src,
        tmp_path / "bf16",
        "--to",
        "safetensors",
        "--dtype",
        "bf16",
        "--json",
        "--dry-run",
    )
    assert cast.exit_code == 0, cast.stderr
    hows = {e["how"] for e in cast.json["result"]["entries"] if e["dtype"] == "bfloat16"}
    assert hows == {"cast"}


def test_a_dry_run_lists_the_shards_and_index_as_the_run_reports_them(
    real_accelerate_run: Path, tmp_path: Path
) -> None:
    """A user plans cutting an accelerate `save_state` folder into torch.save shards: the dry
    run's files (index first, each with the entries it holds) are the run's. The index was
    listed last, said to hold every entry (the run says 0: it maps them), so the files'
    entries added up to twice what was written."""
    src = real_accelerate_run / "straight" / "step-4"
    for to, size in (("torch", "20KB"), ("safetensors", "10KB")):
        out = tmp_path / to
        args = ("convert", src, out, "--to", to, "--max-shard-size", size, "--json")
        dry = run_ckpt(*args, "--dry-run")
        assert dry.exit_code == 0, dry.stderr
        assert not out.exists()
        real = run_ckpt(*args)
        assert real.exit_code == 0, real.stderr
        planned = [(f["path"], f["entries"]) for f in dry.json["result"]["files"]]
        written = [(f["path"], f["entries"]) for f in real.json["result"]["files"]]
        assert planned == written, to
        report = real.json["result"]
        assert sum(n for _, n in planned) == report["tensors"] + report["objects"], to
        # the index the run wrote maps every entry to a shard that holds it (the real readers)
        index = json.loads(next(out.glob("*.index.json")).read_text())["weight_map"]
        held: dict[str, str] = {}
        for shard in sorted(set(index.values())):
            if to == "torch":
                # the RNG state accelerate saved holds numpy arrays, as in its own file
                allowed = [_global(g) for g in get_unsafe_globals_in_checkpoint(out / shard)]
                allowed.append(type(numpy.dtype(numpy.uint32)))  # the dtype of its key array
                with torch.serialization.safe_globals(allowed):
                    names = torch.load(out / shard, weights_only=True, map_location="cpu").keys()
            else:
                with safe_open(out / shard, "pt") as f:
                    names = set(f.keys())
            held.update(dict.fromkeys(names, shard))
        assert held == index, to


def _global(dotted: str) -> Any:
    """The object a pickle global names (`numpy._core.multiarray._reconstruct`)."""
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_a_dry_run_into_a_folder_under_a_file_is_refused_as_the_run_is(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """A user mistypes DEST under a file (`notes.txt/out`): the dry run planned the output
    and exited 0, then the run read the whole source and failed creating its staging folder
    (exit 74). Both now stop first, exit 74, naming the file, with one JSON envelope."""
    src = real_trainer_run / "straight" / "checkpoint-4"
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    commands = [
        ("convert", src, notes / "out", "--to", "dcp"),
        ("convert", src, notes / "model.safetensors", "--to", "safetensors", "--select", "model"),
        ("reshard", src, notes / "out", "--max-shard-size", "10KB"),
    ]
    for args in commands:
        for dry in (["--dry-run"], []):
            result = run_ckpt(*args, *dry, "--json")
            assert result.exit_code == 74, (args, dry, result.stdout)
            error = result.json["error"]
            assert error["path"] == str(notes) and "ENOTDIR" in error["message"], error
            assert result.json["ok"] is False and result.stdout.count("ckpt_json") == 1
    assert notes.read_text() == "not a folder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
