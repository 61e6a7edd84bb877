"""Every safetensors 0.8 dtype: read, verified, converted; one unknown tensor never sinks a file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .conftest import run_ckpt

#: what `safetensors.torch` itself writes for torch's dtypes (code -> torch dtype)
TORCH_WRITTEN = {
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


def _exotic_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=gen)
    state: dict[str, torch.Tensor] = {}
    for code, dtype in TORCH_WRITTEN.items():
        if dtype.itemsize == 1:
            state[code.lower()] = raw.view(dtype).clone()
        elif dtype == torch.complex64:
            state[code.lower()] = torch.randn(4, 2, dtype=torch.complex64, generator=gen)
        else:
            state[code.lower()] = torch.randint(0, 1000, (4, 2), generator=gen).to(dtype)
    state["plain"] = torch.randn(3, 3, generator=gen)
    return state


def _append_raw_tensor(path: Path, name: str, code: str, shape: list[int], data: bytes) -> None:
    """Rewrite a safetensors file with one more tensor whose header entry we write by hand."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    body = blob[8 + n :]
    header[name] = {
        "dtype": code,
        "shape": shape,
        "data_offsets": [len(body), len(body) + len(data)],
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body + data)


def test_every_dtype_safetensors_torch_writes_is_inspected_verified_and_copied(
    tmp_path: Path,
) -> None:
    state = _exotic_state()
    src = tmp_path / "exotic.safetensors"
    save_file(state, src)
    # F6 has no torch dtype: written the way the Rust crate lays it out (6 bits a value)
    _append_raw_tensor(src, "f6", "F6_E2M3", [4, 4], bytes(range(12)))

    shown = run_ckpt("inspect", src, "--json")
    assert shown.exit_code == 0, shown.stderr
    entries = {e["name"]: e for e in shown.json["result"]["entries"]}
    assert entries["f4"]["dtype"] == "float4_e2m1fn" and entries["f4"]["shape"] == [4, 16]
    assert entries["f4"]["nbytes"] == 32
    assert entries["f6"]["dtype"] == "float6_e2m3fn" and entries["f6"]["nbytes"] == 12
    assert entries["f8_e5m2fnuz"]["dtype"] == "float8_e5m2fnuz"
    assert entries["u64"]["dtype"] == "uint64" and entries["c64"]["dtype"] == "complex64"

    deep = run_ckpt("verify", src, "--deep", "--json")
    assert deep.exit_code == 0, deep.stdout
    result = deep.json["result"]
    assert result["tensors"] == len(state)
    assert [p["tensor"] for p in result["problems"]] == ["f6"]  # a warning: torch cannot hold F6

    out = tmp_path / "copy.safetensors"
    assert run_ckpt("convert", src, out, "--to", "safetensors").exit_code == 0
    with safe_open(out, framework="pt") as f:
        for name, tensor in state.items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    assert out.read_bytes().endswith(bytes(range(12)))  # F6 bytes carried untouched

    # a torch-native target holds F4 as torch's packed pairs and reports the F6 tensor
    pt = tmp_path / "copy.pt"
    conv = run_ckpt("convert", src, pt, "--to", "torch", "--json")
    assert conv.exit_code == 0, conv.stderr
    assert [s["name"] for s in conv.json["result"]["skipped"]] == ["f6"]
    loaded = torch.load(pt, weights_only=True)
    assert loaded["f4"].dtype == torch.float4_e2m1fn_x2
    assert torch.equal(loaded["f4"].view(torch.uint8), state["f4"].view(torch.uint8))

    # and back: torch's packed FP4 is written as safetensors F4 that safetensors reads
    back = tmp_path / "back.safetensors"
    assert run_ckpt("convert", pt, back, "--to", "safetensors").exit_code == 0
    with safe_open(back, framework="pt") as f:
        assert torch.equal(f.get_tensor("f4").view(torch.uint8), state["f4"].view(torch.uint8))


def test_a_tensor_of_an_unknown_dtype_is_reported_and_the_rest_still_read(tmp_path: Path) -> None:
    src = tmp_path / "mixed.safetensors"
    save_file({"good": torch.arange(6, dtype=torch.float32)}, src)
    _append_raw_tensor(src, "future", "Q7_NEW", [2], b"\0" * 8)

    shown = run_ckpt("inspect", src, "--json")
    assert shown.exit_code == 0, shown.stderr
    result = shown.json["result"]
    assert [e["name"] for e in result["entries"]] == ["good"]
    assert result["details"]["unsupported_tensors"] == {"future": "Q7_NEW"}
    assert "future (Q7_NEW)" in run_ckpt("inspect", src).stdout

    checked = run_ckpt("verify", src, "--json")
    assert checked.exit_code == 1
    (problem,) = checked.json["result"]["problems"]
    assert problem["code"] == "unknown_dtype" and problem["tensor"] == "future"

    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", src, out, "--to", "safetensors").exit_code == 0
    with safe_open(out, framework="pt") as f:
        assert list(f.keys()) == ["good"]


@pytest.mark.parametrize(("code", "shape", "nbytes"), [("F4", [3], 2), ("F6_E3M2", [3], 3)])
def test_a_sub_byte_tensor_that_does_not_end_on_a_byte_is_refused_by_name(
    tmp_path: Path, code: str, shape: list[int], nbytes: int
) -> None:
    src = tmp_path / "odd.safetensors"
    save_file({"good": torch.zeros(2)}, src)
    _append_raw_tensor(src, "odd", code, shape, b"\0" * nbytes)
    checked = run_ckpt("verify", src, "--json")
    assert checked.exit_code == 1
    (problem,) = checked.json["result"]["problems"]
    assert problem["code"] == "misaligned" and problem["tensor"] == "odd"
    with pytest.raises(Exception, match="byte boundary"):
        safe_open(src, framework="pt")  # safetensors itself refuses the file the same way
