"""torch.save's legacy (pre-1.6, non-zip) format, `_use_new_zipfile_serialization=False`:
files whose tensors torch's own legacy loader cannot read back (uint16/uint32/uint64 and
float8 storages, a `torch.Generator`) are read by ckpt bit-exact, judged against the tensors
that were saved and against the same object saved in the zip format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .conftest import run_ckpt


def _odd_dtypes() -> dict[str, torch.Tensor]:
    """Tensors of the dtypes torch's legacy writer stores as untyped (byte) storages."""
    base = torch.arange(-6, 6, dtype=torch.float32) / 3
    big = torch.tensor([0, 1, 40000, 65535, 7, 9])
    wide = torch.tensor([0, 1, 1 << 31, (1 << 32) - 1])
    u16 = big.to(torch.uint16)
    return {
        "u16": u16,
        "u16_tail": u16[2:],  # a view of the same storage, from an offset
        "u32": wide.to(torch.uint32),
        "u64": torch.tensor([0, 1 << 40, (1 << 62) + 3]).to(torch.uint64),
        "e4m3": base.to(torch.float8_e4m3fn).reshape(3, 4),
        "e5m2": base.to(torch.float8_e5m2),
        "f32": base,
        "nested": {"step": 7, "half": base.half()},
    }


def _flat(obj: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact: dtype, shape and the bytes."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )


def test_a_legacy_file_of_uint_and_float8_tensors_is_read_bit_exact(tmp_path: Path) -> None:
    """inspect, verify, convert and diff called such a file "truncated or corrupt; write or
    fetch it again" (torch.load's AttributeError quoted); a fresh copy is the same bytes."""
    saved = _odd_dtypes()
    legacy = tmp_path / "legacy.pt"
    torch.save(saved, legacy, _use_new_zipfile_serialization=False)
    # the ground truth for why: torch's own legacy loader fails on these storages
    with pytest.raises(AttributeError, match="UntypedStorage"):
        torch.load(legacy, weights_only=True)
    zipped = tmp_path / "zipped.pt"
    torch.save(saved, zipped)
    expected = _flat(saved)

    report = run_ckpt("inspect", legacy, "--json")
    assert report.exit_code == 0, report.stderr
    entries = {e["name"]: e for e in report.json["result"]["entries"]}
    for name, tensor in expected.items():
        assert entries[name]["shape"] == list(tensor.shape), name
    assert entries["u16"]["dtype"] == "uint16" and entries["e4m3"]["dtype"] == "float8_e4m3fn"
    assert report.json["result"]["details"]["legacy_format"] == ["legacy.pt"]

    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", legacy, out, "--to", "safetensors").exit_code == 0
    with safe_open(str(out), "pt") as f:
        for name, tensor in expected.items():
            assert _same(f.get_tensor(name), tensor), name
    back = tmp_path / "back.pt"
    assert run_ckpt("convert", legacy, back, "--to", "torch").exit_code == 0
    loaded = _flat(torch.load(back, weights_only=True))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert _same(loaded[name], tensor), name
    assert torch.load(back, weights_only=True)["nested"]["step"] == 7

    verify = run_ckpt("verify", legacy, "--deep", "--json")
    assert verify.exit_code == 0, verify.stdout
    (warning,) = verify.json["result"]["problems"]
    assert warning["code"] == "torch_load_refuses" and warning["severity"] == "warning"
    assert "legacy.pt" in warning["message"] and "uint16" in warning["message"]
    assert "--to torch" in warning["fix"]
    same = run_ckpt("diff", legacy, zipped)
    assert same.exit_code == 0, same.stdout
    # the safetensors output holds every tensor; only the step (an object) is not in it
    against = run_ckpt("diff", legacy, out, "--json").json["result"]
    assert against["only_a"] == ["nested.step"] and against["differences"] == []


def test_a_legacy_file_holding_a_generator_keeps_its_rng_state(tmp_path: Path) -> None:
    """torch restores a legacy file's Generator before its state bytes are read (the data
    follows the pickle), from whatever the fresh storage's memory holds: torch.load fails
    ("Invalid mt19937 state"), or, when that memory passes torch's check (a freed buffer
    reused), returns a generator in a state nobody saved; ckpt called the file truncated or
    corrupt. ckpt reads the state the Generator was saved with. (torch's own outcome depends on
    the allocator, so it is not asserted here.)"""
    gen = torch.Generator().manual_seed(1234)
    torch.rand(5, generator=gen)  # a state past the seed
    saved = {"w": torch.randn(3), "rng": gen, "epoch": 2}
    legacy = tmp_path / "rng.pt"
    torch.save(saved, legacy, _use_new_zipfile_serialization=False)

    report = run_ckpt("inspect", legacy, "--json")
    assert report.exit_code == 0, report.stderr
    entries = {e["name"]: e for e in report.json["result"]["entries"]}
    assert entries["rng"]["kind"] == "object"
    back = tmp_path / "back.pt"
    assert run_ckpt("convert", legacy, back, "--to", "torch").exit_code == 0
    with torch.serialization.safe_globals([(torch.Generator, "torch._C.Generator")]):
        loaded = torch.load(back, weights_only=True)
    assert torch.equal(loaded["w"], saved["w"]) and loaded["epoch"] == 2
    assert torch.equal(loaded["rng"].get_state(), gen.get_state())
    assert loaded["rng"].initial_seed() == 1234
    verify = run_ckpt("verify", legacy, "--deep", "--json")
    assert verify.exit_code == 0, verify.stdout
    codes = [p["code"] for p in verify.json["result"]["problems"]]
    assert codes == ["torch_load_refuses"]
    zipped = tmp_path / "zipped.pt"
    torch.save(saved, zipped)
    assert run_ckpt("diff", legacy, zipped).exit_code == 0


def test_a_truncated_legacy_file_names_the_storage_cut_short(tmp_path: Path) -> None:
    """A legacy file cut in its tensor data is refused as truncated, naming the file."""
    legacy = tmp_path / "cut.pt"
    torch.save(_odd_dtypes(), legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    legacy.write_bytes(data[:-5])
    result = run_ckpt("inspect", legacy)
    assert result.exit_code == 4, result.stderr
    assert "cut.pt" in result.stderr and "past the end of the file" in result.stderr


def test_a_sharded_bin_of_legacy_files_verifies_as_it_inspects(tmp_path: Path) -> None:
    """`inspect` read a sharded `pytorch_model.bin.index.json` of legacy shards holding a
    uint16 tensor while `verify` called the shard "truncated or corrupt" (its shard check went
    through torch.load alone)."""
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {"a": torch.tensor([1, 65535]).to(torch.uint16)},
        "pytorch_model-00002-of-00002.bin": {"b": torch.ones(2)},
    }
    for name, part in shards.items():
        torch.save(part, folder / name, _use_new_zipfile_serialization=False)
    index = {
        "metadata": {"total_size": 12},
        "weight_map": {key: name for name, part in shards.items() for key in part},
    }
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert run_ckpt("inspect", folder).exit_code == 0
    verify = run_ckpt("verify", folder, "--deep", "--json")
    assert verify.exit_code == 0, verify.stdout
    (warning,) = verify.json["result"]["problems"]
    assert warning["code"] == "torch_load_refuses"
    assert "pytorch_model-00001-of-00002.bin" in warning["message"]
    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", folder, out, "--to", "safetensors").exit_code == 0
    with safe_open(str(out), "pt") as f:
        assert _same(f.get_tensor("a"), shards["pytorch_model-00001-of-00002.bin"]["a"])


def test_a_legacy_file_torch_cannot_read_and_ckpt_cannot_map_says_why(tmp_path: Path) -> None:
    """A uint16 tensor saved as a strided view (or a Generator beside one) is no plain range
    ckpt reads itself, and torch.load fails on it: the refusal says so and how to re-save it,
    where it said "truncated or corrupt; write or fetch it again"."""
    cases = {
        "u16": ({"t": torch.arange(4).to(torch.uint16).view(2, 2).t()}, "no legacy storage"),
        "gen": ({"g": torch.Generator(), "t": torch.ones(4).view(2, 2).t()}, "torch.Generator"),
    }
    for name, (saved, words) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save(saved, path, _use_new_zipfile_serialization=False)
        refused = run_ckpt("inspect", path)
        assert refused.exit_code == 4, refused.stderr
        assert f"{name}.pt: is a legacy (non-zip) torch.save file holding" in refused.stderr
        assert words in refused.stderr and "zip format" in refused.stderr
        assert "truncated" not in refused.stderr
