"""torch: inspect real torch.save files and sharded bins; hostile pickles never run; the
writer round-trips state dicts and training dicts bit-exactly through torch.load."""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpt_cli.formats import open_checkpoint, resolve_source
from ckpt_cli.formats.base import WriteOptions
from ckpt_cli.formats.names import is_commit_marker
from ckpt_cli.formats.torch.format import TorchFormat
from ckpt_cli.storage.output import staged_output

from .conftest import run_ckpt


def state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    sd: dict[str, torch.Tensor] = {
        f"layers.{i}.weight": torch.randn(16, 8, generator=gen) for i in range(4)
    }
    sd["embed.weight"] = torch.randn(20, 8, generator=gen).to(torch.bfloat16)
    sd["mask"] = torch.tensor([True, False])
    sd["count"] = torch.tensor(7, dtype=torch.int64)
    return sd


def training_dict() -> dict[str, Any]:
    """What users save: {model, optimizer, scheduler, step, rng} after a real step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 1,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Deep, type-exact equality; tensors bit-exact."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, where


def copy_with_writer(src: Path, dest: Path, options: WriteOptions | None = None) -> None:
    with (
        open_checkpoint(str(src)) as checkpoint,
        staged_output(dest, commit_marker=is_commit_marker) as staging,
    ):
        plan = checkpoint.manifest.entries
        writer = TorchFormat.writer(staging, plan, options or WriteOptions())
        for entry in plan:
            if entry.kind == "tensor":
                writer.write_tensor(entry.name, checkpoint.read_tensor(entry.name))
            else:
                writer.write_object(entry.name, checkpoint.read_object(entry.name))
        writer.finish()


def test_inspect_state_dict_counts_dtypes_shapes_bytes(tmp_path: Path) -> None:
    sd = state_dict()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    report = run_ckpt("inspect", tmp_path / "pytorch_model.bin", "--json").json["result"]
    assert report["format"] == "torch"
    assert report["tensors"] == len(sd) and report["objects"] == 0
    assert report["tensor_bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert report["parameters"] == sum(t.numel() for t in sd.values() if t.is_floating_point())
    by_name = {e["name"]: e for e in report["entries"]}
    for name, tensor in sd.items():
        assert by_name[name]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert by_name[name]["shape"] == list(tensor.shape)
    assert report["training"] is None  # weights only
    # a folder holding just that file is the same checkpoint
    assert run_ckpt("inspect", tmp_path, "--json").json["result"]["tensors"] == len(sd)


def test_training_dict_is_flattened_with_objects_and_values(tmp_path: Path) -> None:
    ckpt = training_dict()
    torch.save(ckpt, tmp_path / "ckpt.pt")
    report = run_ckpt("inspect", tmp_path / "ckpt.pt", "--json").json["result"]
    by_name = {e["name"]: e for e in report["entries"]}
    assert by_name["optimizer.state.0.exp_avg"]["shape"] == [8, 4]
    assert by_name["model.0.weight"]["dtype"] == "float32"
    assert by_name["step"] == {**by_name["step"], "kind": "object", "py_type": "int", "value": 1}
    assert by_name["optimizer.param_groups.0.betas"]["value"] == [0.9, 0.999]
    assert by_name["rng.python"]["py_type"] == "tuple"
    assert by_name["rng.numpy"]["kind"] == "object"  # numpy RNG state loads as data
    assert by_name["rng.torch"]["dtype"] == "uint8"
    training = report["training"]
    assert training["layout"] == "torch-dict"
    assert training["optimizer"]["kind"] == "AdamW"
    assert training["optimizer"]["params"] == training["optimizer"]["params_with_state"] == 4
    assert training["step"] == 1 and training["rng"] == ["python", "numpy", "torch_cpu"]
    # no data-loader state saved: resumable, not exactly, and it says why
    assert training["resumable"] is True and training["missing"] == []
    assert training["exact"] is False and training["missing_exact"] == ["dataloader"]
    with open_checkpoint(str(tmp_path / "ckpt.pt")) as checkpoint:
        assert torch.equal(
            checkpoint.read_tensor("optimizer.state.2.exp_avg_sq"),
            ckpt["optimizer"]["state"][2]["exp_avg_sq"],
        )
        assert checkpoint.read_object("scheduler.last_epoch") == 1
        assert_same(checkpoint.read_object("rng.python"), ckpt["rng"]["python"])


def test_sharded_bin_written_like_transformers(tmp_path: Path) -> None:
    sd = state_dict()
    save_torch_state_dict(sd, tmp_path, max_shard_size=1200, safe_serialization=False)
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    report = run_ckpt("inspect", tmp_path, "--json").json["result"]
    assert report["format"] == "torch" and report["tensors"] == len(sd)
    assert [f["path"] for f in report["files"]] == ["pytorch_model.bin.index.json", *shards]
    by_name = {e["name"]: e for e in report["entries"]}
    assert all(by_name[n]["file"] == index["weight_map"][n] for n in sd)
    with open_checkpoint(str(tmp_path)) as checkpoint:
        for name, tensor in sd.items():
            assert torch.equal(checkpoint.read_tensor(name), tensor), name
    assert TorchFormat.check(resolve_source(str(tmp_path))) == []


def test_hostile_pickle_is_refused_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    torch.save({"weight": torch.ones(2), "payload": Evil()}, tmp_path / "evil.pt")
    result = run_ckpt("inspect", tmp_path / "evil.pt", "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["code"] == "unsafe_input"
    assert "evil.pt" in error["message"] and "system" in error["message"]
    assert not marker.exists()
    problems = TorchFormat.check(resolve_source(str(tmp_path / "evil.pt")))
    assert [p.code for p in problems] == ["unsafe_input"]
    assert not marker.exists()


def test_corrupt_truncated_and_plain_pickle_files_are_exit_4(tmp_path: Path) -> None:
    torch.save(state_dict(), tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    import pickle

    (tmp_path / "plain.pt").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    for name in ("cut.pt", "empty.pt", "plain.pt"):
        result = run_ckpt("inspect", tmp_path / name)
        assert result.exit_code == 4, (name, result.stderr)
        assert name in result.stderr


def test_a_storage_record_cut_short_inside_an_intact_zip_is_damage_not_data(
    tmp_path: Path,
) -> None:
    """A record rewritten shorter (the zip still whole) is refused as torch.load refuses it:
    read through mmap, the tensor would take the next record's bytes as its own."""
    import zipfile

    torch.save({"x": torch.ones(300), "y": torch.zeros(10)}, tmp_path / "good.pt")
    folder = tmp_path / "damaged"
    folder.mkdir()
    with (
        zipfile.ZipFile(tmp_path / "good.pt") as good,
        zipfile.ZipFile(folder / "model.pt", "w", zipfile.ZIP_STORED) as cut,
    ):
        for info in good.infolist():
            data = good.read(info.filename)
            cut.writestr(info, data[:8] if info.filename.endswith("/data/1") else data)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(folder / "model.pt", weights_only=True)

    for args in (("verify", folder, "--deep"), ("inspect", folder)):
        result = run_ckpt(*args)
        assert result.exit_code == (1 if args[0] == "verify" else 4), result.stdout
        said = result.stdout + result.stderr
        assert "model.pt" in said and "data/1 holds 8 bytes" in said and "truncated" in said
    result = run_ckpt("convert", folder, tmp_path / "out", "--to", "safetensors")
    assert result.exit_code == 4 and not (tmp_path / "out").exists()
    assert run_ckpt("verify", tmp_path / "good.pt", "--deep").exit_code == 0


def test_a_zip_directory_entry_pointing_past_the_end_fails_verify_as_torch_load_fails(
    tmp_path: Path,
) -> None:
    """One flipped byte in the zip directory's local-header offset of a record no tensor
    uses (`.storage_alignment`): torch's zip reader (miniz) checks every entry when it opens
    the archive and refuses the whole file; `verify --deep` said OK and `convert` published
    the tensors."""
    import struct
    import zipfile

    torch.save({"w": torch.randn(8, 8), "b": torch.arange(4)}, tmp_path / "good.pt")
    data = bytearray((tmp_path / "good.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "good.pt") as archive:
        names = [i.filename for i in archive.infolist()]
    victim = next(n for n in names if n.endswith("/.storage_alignment"))
    entry = -1
    while (entry := data.find(b"PK\x01\x02", entry + 1)) != -1:
        (name_length,) = struct.unpack_from("<H", data, entry + 28)
        if data[entry + 46 : entry + 46 + name_length] == victim.encode():
            break
    data[entry + 44] ^= 0x39  # the offset's third byte: megabytes past the end
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.pt").write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="zip archive"):
        torch.load(damaged / "model.pt", weights_only=True, map_location="cpu")

    for args in (("verify", damaged), ("verify", damaged, "--deep")):
        result = run_ckpt(*args)
        assert result.exit_code == 1, result.stdout
        assert "model.pt" in result.stdout and victim in result.stdout, result.stdout
    result = run_ckpt("convert", damaged, tmp_path / "out", "--to", "safetensors")
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "model.pt" in result.stderr and not (tmp_path / "out").exists()


def test_a_flipped_byte_in_tensor_data_fails_verify_deep(tmp_path: Path) -> None:
    """The zip records a CRC-32 per storage record; `--deep` checks it, for a single file and
    for a Trainer-style folder's optimizer.pt alike."""
    torch.save({"w": torch.randn(64, 64), "b": torch.randn(3)}, tmp_path / "good.pt")
    data = bytearray((tmp_path / "good.pt").read_bytes())
    import zipfile

    with zipfile.ZipFile(tmp_path / "good.pt") as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    # the record's data begins after its local header (30 bytes, the name, the extra field)
    extra = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + len(info.filename.encode()) + extra
    data[start + 100] ^= 4
    (tmp_path / "bad.pt").write_bytes(bytes(data))

    assert run_ckpt("verify", tmp_path / "good.pt", "--deep").exit_code == 0
    assert run_ckpt("verify", tmp_path / "bad.pt").exit_code == 0  # structure only: no CRC
    result = run_ckpt("verify", tmp_path / "bad.pt", "--deep", "--json")
    assert result.exit_code == 1
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "corrupt_data" and problem["file"].endswith("bad.pt")
    assert "/data/0" in problem["message"] and "CRC-32" in problem["message"]


@pytest.mark.parametrize(
    "damage",
    ["a tensor's name in data.pkl", "a data record's local header", ".storage_alignment"],
)
def test_a_flip_torch_load_trips_on_or_reads_wrong_fails_verify_deep(
    tmp_path: Path, damage: str
) -> None:
    """`--deep` checked the CRC-32 of the storage records only: one flipped byte in data.pkl
    (a tensor's name: torch.load returns it renamed), in a record's local header (torch.load
    fails), or in `.storage_alignment` (torch.load fails) passed as OK. Torch's own zip reader
    now opens the file too and every record it reads must hold the bytes the zip records."""
    import zipfile

    torch.save({"w": torch.randn(8, 8), "b": torch.arange(4)}, tmp_path / "good.pt")
    data = bytearray((tmp_path / "good.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "good.pt") as archive:
        infos = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
    if damage == "a tensor's name in data.pkl":
        data[data.find(b"X\x01\x00\x00\x00w") + 5] ^= 0x01  # 'w' -> 'v'
    elif damage == "a data record's local header":
        data[infos["data/0"].header_offset] ^= 0x01  # its signature
    else:
        info = infos[".storage_alignment"]
        extra = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
        data[info.header_offset + 30 + len(info.filename.encode()) + extra] ^= 0x80
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    try:
        loaded = torch.load(tmp_path / "bad.pt", weights_only=True, map_location="cpu")
    except (RuntimeError, ValueError):
        pass  # torch.load refuses it
    else:
        assert sorted(loaded) == ["b", "v"]  # torch.load reads a tensor under another name

    assert run_ckpt("verify", tmp_path / "good.pt", "--deep").exit_code == 0
    result = run_ckpt("verify", tmp_path / "bad.pt", "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "corrupt_data" and problem["file"].endswith("bad.pt"), problem
    assert "torch" in problem["message"] and problem["fix"]


def test_legacy_non_zip_file_is_read(tmp_path: Path) -> None:
    sd = state_dict()
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    report = run_ckpt("inspect", tmp_path / "old.pt", "--json").json["result"]
    assert report["tensors"] == len(sd)
    assert report["details"]["legacy_format"] == ["old.pt"]
    with open_checkpoint(str(tmp_path / "old.pt")) as checkpoint:
        assert torch.equal(checkpoint.read_tensor("layers.2.weight"), sd["layers.2.weight"])


def test_conjugate_and_negative_views_convert_as_their_values(tmp_path: Path) -> None:
    # torch.save keeps `x.conj()` as x's bytes plus a bit; 0.1.x ended convert (to safetensors
    # or DCP) and diff in "internal error: torch.Tensor.view is not supported for conjugate
    # view tensors", exit 70
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    src = tmp_path / "conj.pt"
    torch.save({"conj": x.conj(), "neg": torch.tensor([1.0, -2.0])._neg_view()}, src)
    expected = {"conj": x.conj().resolve_conj(), "neg": torch.tensor([-1.0, 2.0])}
    st = tmp_path / "out.safetensors"
    assert run_ckpt("convert", src, st, "--to", "safetensors").exit_code == 0
    with safe_open(str(st), "pt") as f:
        for name, want in expected.items():
            assert torch.equal(f.get_tensor(name), want), name
    out = tmp_path / "dcp"
    assert run_ckpt("convert", src, out, "--to", "dcp").exit_code == 0
    loaded = {name: torch.zeros_like(want) for name, want in expected.items()}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)
    for name, want in expected.items():
        assert torch.equal(loaded[name], want), name
    plain = tmp_path / "plain.pt"
    torch.save(expected, plain)
    assert run_ckpt("diff", src, plain).exit_code == 0  # the same values
    assert run_ckpt("diff", src, st).exit_code == 0


def test_a_fifo_named_like_a_torch_file_is_named_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    # 0.1.x: "is empty. The save was interrupted; write the file again." (a FIFO has no size)
    result = run_ckpt("inspect", fifo)
    assert result.exit_code == 4
    assert f"{fifo}: is a FIFO (named pipe), not a regular file" in result.stderr
    assert "empty" not in result.stderr
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert "is empty" in run_ckpt("inspect", empty).stderr


def test_index_traversal_and_missing_shard(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "../outside.bin"}}))
    result = run_ckpt("inspect", tmp_path, "--json")
    assert result.exit_code == 4 and result.json["error"]["code"] == "unsafe_input"
    index.write_text(json.dumps({"weight_map": {"w": "pytorch_model-00002-of-00002.bin"}}))
    result = run_ckpt("inspect", tmp_path)
    assert result.exit_code == 3 and "pytorch_model-00002-of-00002.bin" in result.stderr


def test_check_reports_every_index_problem(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "s1.bin")
    torch.save({"c": torch.ones(4), "stray": torch.ones(1)}, tmp_path / "s2.bin")
    weight_map = {"a": "s1.bin", "b": "s2.bin", "c": "s2.bin", "d": "s3.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    problems = TorchFormat.check(resolve_source(str(tmp_path)))
    found = {(p.code, p.tensor) for p in problems}
    assert ("missing_shard", None) in found
    assert ("wrong_shard", "b") in found
    assert ("not_in_index", "stray") in found
    assert run_ckpt("inspect", tmp_path).exit_code in (3, 4)


def test_writer_sharded_state_dict_round_trip(tmp_path: Path) -> None:
    sd = state_dict()
    torch.save(sd, tmp_path / "src.bin")
    out = tmp_path / "out"
    copy_with_writer(tmp_path / "src.bin", out, WriteOptions(max_shard_size=1200))
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin" and len(shards) > 1
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = torch.load(out / shard, weights_only=True)
        assert all(index["weight_map"][k] == shard for k in part)
        merged.update(part)
    assert set(merged) == set(sd)
    for name, tensor in sd.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor)
    assert TorchFormat.check(resolve_source(str(out))) == []


def test_writer_training_dict_round_trip_is_exact(tmp_path: Path) -> None:
    ckpt = training_dict()
    torch.save(ckpt, tmp_path / "src.pt")
    copy_with_writer(tmp_path / "src.pt", tmp_path / "out")
    with torch.serialization.safe_globals(
        [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    ):
        back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert_same(torch.load(tmp_path / "src.pt", weights_only=False), back)
    assert isinstance(back["model"], OrderedDict)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(back["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(back["optimizer"])


def test_writer_flat_keys_for_renamed_entries(tmp_path: Path) -> None:
    torch.save({"model": {"layer.weight": torch.ones(2, 2)}, "step": 3}, tmp_path / "src.pt")
    with open_checkpoint(str(tmp_path / "src.pt")) as checkpoint:
        out = tmp_path / "out"
        out.mkdir()
        renamed = [
            e.model_copy(update={"name": e.name.removeprefix("model.")})
            for e in checkpoint.manifest.entries
            if e.name.startswith("model.")
        ]
        writer = TorchFormat.writer(out, renamed, WriteOptions())
        writer.write_tensor("layer.weight", checkpoint.read_tensor("model.layer.weight"))
        writer.finish()
    back = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert list(back) == ["layer.weight"] and torch.equal(back["layer.weight"], torch.ones(2, 2))


@pytest.mark.parametrize("name", ["w.pt", "w.pth", "w.ckpt"])
def test_detect_by_suffix(tmp_path: Path, name: str) -> None:
    torch.save({"w": torch.arange(3)}, tmp_path / name)
    report = run_ckpt("inspect", tmp_path / name, "--json").json["result"]
    assert report["format"] == "torch" and report["tensors"] == 1


def test_tied_weights_are_reported_and_stay_tied(tmp_path: Path) -> None:
    embed = torch.randn(10, 4)
    big = torch.arange(1000, dtype=torch.float32)
    torch.save(
        {"embed.weight": embed, "lm_head.weight": embed, "slice": big[:3]}, tmp_path / "src.pt"
    )
    report = run_ckpt("inspect", tmp_path / "src.pt", "--json").json["result"]
    assert report["details"]["shared_tensors"] == [["embed.weight", "lm_head.weight"]]
    copy_with_writer(tmp_path / "src.pt", tmp_path / "out")
    back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    # tied tensors are stored once and load tied; a slice does not drag its whole buffer along
    assert back["embed.weight"].data_ptr() == back["lm_head.weight"].data_ptr()
    assert torch.equal(back["lm_head.weight"], embed)
    assert back["slice"].untyped_storage().nbytes() == 3 * 4
    assert torch.equal(back["slice"], big[:3])


def test_names_safetensors_records_as_aliases_come_back_in_torch_and_dcp(tmp_path: Path) -> None:
    """`safetensors.torch.save_model` stores a tied weight once and records the other name in
    `__metadata__`; a conversion to a format that stores every name writes it again: tied
    to the kept tensor in torch.save (as `torch.save` of the model does), a copy in DCP. It
    is never silently left out (it was: the report listed neither the name nor a skip)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_model

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    save_model(model, str(tmp_path / "tied.safetensors"))
    expected = model.state_dict()
    assert set(expected) == {"emb.weight", "head.weight"}

    to_torch = run_ckpt(
        "convert", tmp_path / "tied.safetensors", tmp_path / "t.pt", "--to", "torch"
    )
    assert to_torch.exit_code == 0, to_torch.stderr
    assert "emb.weight, head.weight share storage" in to_torch.stdout
    back = torch.load(tmp_path / "t.pt", weights_only=True)
    assert set(back) == set(expected)
    assert back["head.weight"].data_ptr() == back["emb.weight"].data_ptr()
    assert torch.equal(back["head.weight"], expected["head.weight"])

    to_dcp = run_ckpt(
        "convert", tmp_path / "tied.safetensors", tmp_path / "d", "--to", "dcp", "--json"
    )
    result = to_dcp.json["result"]
    assert [e["name"] for e in result["entries"]] == ["emb.weight", "head.weight"]
    assert result["renamed"] == 0 and result["tied"] == [["emb.weight", "head.weight"]]
    loaded = {name: torch.zeros(16, 8) for name in expected}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "d"))
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)

    # and back to safetensors: stored once again, the alias recorded again
    again = run_ckpt(
        "convert", tmp_path / "t.pt", tmp_path / "again.safetensors", "--to", "safetensors"
    )
    assert again.exit_code == 0, again.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "again.safetensors"), "pt") as f:
        assert list(f.keys()) == ["emb.weight"] and f.metadata()["head.weight"] == "emb.weight"


def test_accelerate_pkl_written_by_torch_save_is_read(tmp_path: Path) -> None:
    torch.save({"step": 3, "torch_manual_seed": torch.get_rng_state()}, tmp_path / "rs_0.pkl")
    report = run_ckpt("inspect", tmp_path / "rs_0.pkl", "--json").json["result"]
    assert report["format"] == "torch" and report["objects"] == 1 and report["tensors"] == 1
    import pickle

    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": 1}))
    assert run_ckpt("inspect", tmp_path / "plain.pkl").exit_code == 4  # not a torch.save zip


def test_remote_file_lists_from_ranged_reads_and_reads_tensors(tmp_path: Path) -> None:
    """On remote storage only the zip directory and the pickle are fetched to list a file."""
    import fsspec

    from ckpt_cli.formats.base import Source
    from ckpt_cli.storage import FsspecStorage
    from ckpt_cli.storage.uri import parse_location

    sd = {f"layers.{i}.weight": torch.randn(256, 512) for i in range(4)}
    torch.save(sd, tmp_path / "model.bin")
    fs = fsspec.filesystem("memory")
    data = (tmp_path / "model.bin").read_bytes()
    fs.pipe("/remote/model.bin", data)

    class CountingStorage(FsspecStorage):
        fetched = 0

        def read(self, rel: str, offset: int, length: int) -> bytes:
            CountingStorage.fetched += length
            return super().read(rel, offset, length)

    storage = CountingStorage(fs, "/remote", "memory://remote")
    source = Source(location=parse_location("memory://remote"), storage=storage, target="model.bin")
    with TorchFormat.open(source) as checkpoint:
        assert [e.shape for e in checkpoint.manifest.tensors] == [[256, 512]] * 4
        assert CountingStorage.fetched < len(data) // 10
        for name, tensor in sd.items():
            assert torch.equal(checkpoint.read_tensor(name), tensor)


def test_sharded_bin_repo_on_the_hub_lists_without_downloading(hub: Any, tmp_path: Path) -> None:
    sd = {f"layers.{i}.weight": torch.randn(256, 512) for i in range(6)}
    folder = tmp_path / "repo"
    folder.mkdir()
    save_torch_state_dict(sd, folder, max_shard_size=1_100_000, safe_serialization=False)
    hub.add_repo("org/bins", folder)
    total = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".bin")
    result = run_ckpt("inspect", "hf://org/bins", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["format"] == "torch" and report["tensors"] == len(sd)
    assert hub.bytes_sent("org/bins") < total // 4
    with open_checkpoint("hf://org/bins") as checkpoint:
        for name, tensor in sd.items():
            assert torch.equal(checkpoint.read_tensor(name), tensor)


def test_known_data_classes_load_as_inert_records(tmp_path: Path) -> None:
    """Lightning hyper-parameters (AttributeDict, argparse.Namespace) load as data, never as
    code; the writer stores such records as plain dicts."""
    import argparse
    import sys
    import types

    modules = ["lightning", "lightning.fabric", "lightning.fabric.utilities"]
    modules.append("lightning.fabric.utilities.data")
    for name in modules:
        sys.modules[name] = types.ModuleType(name)

    class AttributeDict(dict):  # type: ignore[type-arg]
        pass

    AttributeDict.__module__ = "lightning.fabric.utilities.data"
    AttributeDict.__qualname__ = "AttributeDict"
    sys.modules["lightning.fabric.utilities.data"].AttributeDict = AttributeDict  # type: ignore[attr-defined]
    try:
        torch.save(
            {
                "state_dict": {"w": torch.ones(2)},
                "hyper_parameters": AttributeDict(lr=0.1, layers=2),
                "args": argparse.Namespace(seed=7),
            },
            tmp_path / "last.ckpt",
        )
    finally:
        for name in modules:
            del sys.modules[name]
    report = run_ckpt("inspect", tmp_path / "last.ckpt", "--json").json["result"]
    by_name = {e["name"]: e for e in report["entries"]}
    assert by_name["hyper_parameters.lr"]["value"] == 0.1
    assert by_name["args"]["py_type"] == "argparse.Namespace"
    copy_with_writer(tmp_path / "last.ckpt", tmp_path / "out")
    back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert back["hyper_parameters"] == {"lr": 0.1, "layers": 2}
    assert back["args"] == {"__class__": "argparse.Namespace", "args": [], "state": {"seed": 7}}


def test_safetensors_with_no_tensors_round_trips_through_torch_as_empty(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty), metadata={"format": "pt"})
    as_torch = tmp_path / "empty.pt"
    assert run_ckpt("convert", empty, as_torch, "--to", "torch").exit_code == 0
    assert torch.load(as_torch, weights_only=True) == {}
    report = run_ckpt("inspect", as_torch, "--json").json["result"]
    assert report["entries"] == [] and report["objects"] == 0
    assert run_ckpt("diff", empty, as_torch).exit_code == 0
    back = tmp_path / "back.safetensors"
    result = run_ckpt("convert", as_torch, back, "--to", "safetensors", "--json")
    assert result.exit_code == 0 and result.json["result"]["skipped"] == []


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_sparse_and_nested_tensors_are_refused_by_name_not_a_crash(
    tmp_path: Path, legacy: bool
) -> None:
    """A torch.save file holding a sparse (COO, CSR) or nested tensor, which torch.load reads,
    made inspect, verify and convert exit 70 ("Cannot access storage of SparseTensorImpl: a
    bug in ckpt"). They are refused naming the entry, its layout and how to re-save it."""
    dense = torch.eye(3)
    cases: dict[str, tuple[torch.Tensor, str]] = {
        "coo": (dense.to_sparse(), "sparse tensor (sparse_coo)"),
        "csr": (dense.to_sparse_csr(), "sparse tensor (sparse_csr)"),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
    }
    for kind, (tensor, words) in cases.items():
        if legacy and kind != "coo":
            continue  # torch's legacy writer saves only COO of these
        path = tmp_path / f"{kind}.pt"
        torch.save(
            {"w": torch.ones(2), "s": tensor}, path, _use_new_zipfile_serialization=not legacy
        )
        # the ground truth: torch.load reads it
        assert torch.load(path, weights_only=True)["s"].is_nested == (kind == "nested")
        out = tmp_path / f"{kind}.safetensors"
        for command in (["inspect", path], ["convert", path, out, "--to", "safetensors"]):
            refused = run_ckpt(*command)
            assert refused.exit_code == 4, (kind, command, refused.stderr)
            assert f"{kind}.pt: entry 's' is a {words}" in refused.stderr
            assert "dense" in refused.stderr
        assert not out.exists()
        verify = run_ckpt("verify", path, "--json")
        assert verify.exit_code == 1
        (problem,) = verify.json["result"]["problems"]
        assert words in problem["message"]


def test_a_torch_file_of_a_newer_pickle_protocol_is_named_as_such(tmp_path: Path) -> None:
    """torch.save(..., pickle_protocol=4) of what ckpt loads through torch.load (a Generator
    beside the tensors) was "not a torch.save file ... re-save it with torch.save": it is one,
    and torch's weights_only loader refuses its FRAME opcode. The refusal says so."""
    path = tmp_path / "p4.pt"
    saved = {"w": torch.ones(2), "rng": torch.Generator().manual_seed(1)}
    torch.save(saved, path, pickle_protocol=4)
    # the ground truth: torch.load refuses it for the opcode
    with (
        torch.serialization.safe_globals([(torch.Generator, "torch._C.Generator")]),
        pytest.raises(Exception, match="Unsupported operand 149"),
    ):
        torch.load(path, weights_only=True)
    refused = run_ckpt("inspect", path)
    assert refused.exit_code == 4, refused.stderr
    words = "p4.pt: holds a pickle opcode torch's weights_only loader does not support (FRAME)"
    assert words in refused.stderr
    assert "pickle_protocol=3 or higher" in refused.stderr
    assert "default pickle_protocol (2)" in refused.stderr
    assert "not a torch.save file" not in refused.stderr
    # the same protocol with plain data only is read (without torch.load)
    plain = tmp_path / "plain4.pt"
    torch.save({"w": torch.arange(3.0)}, plain, pickle_protocol=4)
    out = tmp_path / "out.pt"
    assert run_ckpt("convert", plain, out, "--to", "torch").exit_code == 0
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(3.0))
    # ... and verify warns that torch.load refuses it (it said OK, nothing more)
    with pytest.raises(Exception, match="Unsupported operand 149"):
        torch.load(plain, weights_only=True)
    verify = run_ckpt("verify", plain, "--json")
    assert verify.exit_code == 0, verify.stdout
    (warning,) = verify.json["result"]["problems"]
    assert warning["code"] == "torch_load_refuses" and "FRAME" in warning["message"]
    assert "--to torch" in warning["fix"]
    assert run_ckpt("verify", out, "--json").json["result"]["problems"] == []


def test_the_inspect_tree_never_drops_an_entry_of_a_folded_node(tmp_path: Path) -> None:
    """torch.save([t0, {"a": t1}]) has entries `0` and `1.a`: inspect's tree showed one line,
    `{0..1}.a float32 [1]`, and tensor `0` was on no line."""
    path = tmp_path / "list.pt"
    torch.save([torch.tensor([1], dtype=torch.int32), {"a": torch.ones(1)}], path)
    names = [e["name"] for e in run_ckpt("inspect", path, "--json").json["result"]["entries"]]
    assert names == ["0", "1.a"]
    shown = run_ckpt("inspect", path).stdout
    assert "{0..1}.a" not in shown
    assert "{0..1}  2 tensors" in shown and "a  float32 [1]" in shown


class _RunsEcho:
    """What a hostile pickle holds: unpickled, it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_bare_pickle_that_asks_to_run_a_command_says_so_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """`pickle.dumps` of an object whose __reduce__ is (os.system, ...), saved as `.pt`: inspect,
    verify and convert said "truncated or corrupt". It is a plain pickle that asks to call
    os.system, which ckpt never runs, and the fix says what to do instead."""
    import pickle

    marker = tmp_path / "ran"
    bad = tmp_path / "model.pt"
    bad.write_bytes(pickle.dumps({"w": _RunsEcho(marker)}, protocol=2))
    for args in (("inspect", bad), ("convert", bad, tmp_path / "out", "--to", "safetensors")):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 4, result.stdout
        error = result.json["error"]
        assert error["code"] == "unsafe_input" and error["path"] == str(bad)
        assert "plain pickle" in error["problem"] and "os.system" in error["problem"]
        assert "truncated" not in error["problem"]
        assert "trust" in error["fix"] and "safetensors" in error["fix"]
    verify = run_ckpt("verify", bad, "--json")
    assert verify.exit_code == 1, verify.stdout
    messages = [p["message"] for p in verify.json["result"]["problems"]]
    assert any("os.system" in m and "never runs" in m for m in messages), messages
    assert not marker.exists() and not (tmp_path / "out").exists()
