"""torch.save outputs are streamed: written tensor by tensor, read back by torch itself.

`convert --to torch` used to call `torch.save` on the whole state dict, holding every tensor
of the output at once. The container is now written as the tensors arrive; these tests judge
the files with `torch.load(weights_only=True)` (and `mmap=True`, which needs the 64-byte
aligned, stored records torch writes) and bound the peak memory of a real process.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import REPO, run_ckpt


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes (any dtype, 0-dim and empty included)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(8, 4, generator=gen)
    return {
        "model": {
            "embed.weight": shared,
            "lm_head.weight": shared,  # tied: one storage
            "norm.weight": torch.randn(4, generator=gen).to(torch.bfloat16),
            "scale": torch.tensor(0.5),  # 0-dim
            "empty": torch.zeros(0, 3),
            "mask": torch.tensor([True, False, True]),
            "ids": torch.tensor([1, 2, 65535], dtype=torch.uint16),  # no typed storage class
        },
        "step": 7,
        "name": "run-a",
        "history": [0.5, 0.25],
        "pair": (torch.ones(2), torch.tensor([3], dtype=torch.int64)),  # one value, of tensors
    }


def test_convert_to_torch_streams_a_file_torch_loads_bit_exact(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save(_state(), src)
    out = tmp_path / "out.pt"
    result = run_ckpt("convert", src, out, "--to", "torch")
    assert result.exit_code == 0, result.stderr
    want = torch.load(src, weights_only=True)
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        assert got.keys() == want.keys()
        assert (got["step"], got["name"], got["history"]) == (7, "run-a", [0.5, 0.25])
        assert [_bits(t) for t in got["pair"]] == [_bits(t) for t in want["pair"]]
        assert got["model"].keys() == want["model"].keys()
        for key, tensor in want["model"].items():
            mine = got["model"][key]
            assert (mine.dtype, mine.shape, mine.stride()) == (
                tensor.dtype,
                tensor.shape,
                tensor.stride(),
            ), key
            assert _bits(mine) == _bits(tensor), key
        # tied weights still share one storage
        model = got["model"]
        assert (
            model["embed.weight"].untyped_storage().data_ptr()
            == model["lm_head.weight"].untyped_storage().data_ptr()
        )
    # stored records, their data 64-byte aligned as torch.save writes them
    with zipfile.ZipFile(out) as archive, open(out, "rb") as fh:
        for info in archive.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            fh.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", fh.read(4))
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
        names = {i.filename.split("/", 1)[1] for i in archive.infolist()}
    assert {"data.pkl", "version", "byteorder", ".format_version"} <= names


def test_sharded_torch_output_is_streamed_per_shard(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {f"layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(6)}
    torch.save(state, tmp_path / "src.pt")
    out = tmp_path / "out"
    result = run_ckpt(
        "convert", tmp_path / "src.pt", out, "--to", "torch", "--max-shard-size", "40KB"
    )
    assert result.exit_code == 0, result.stderr
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(torch.load(out / name, weights_only=True, mmap=True))
    assert loaded.keys() == state.keys()
    assert all(_bits(loaded[k]) == _bits(v) for k, v in state.items())


# The child's own peak: VmHWM of the memory map exec gave it. Not `ru_maxrss`: at exec Linux
# folds the pre-exec memory map's high-water mark into it (fs/exec.c, `setmax_mm_hiwater_rss`),
# and with vfork/fork that map is the parent's, so a child of a pytest process that once held
# 900 MiB reports >= 900 MiB whatever it does: the "whole model" peak seen late in full runs.
PEAK = """
import sys
from ckpt_cli.cli.app import main
sys.argv = ["ckpt", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open("/proc/self/status") as status:
    hwm = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
print("PEAK", hwm, file=sys.stderr)
sys.exit(code)
"""


def _peak_mib(*args: str | Path) -> float:
    """Peak resident memory (MiB) of one `ckpt` run in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, *map(str, args)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.rsplit("PEAK", 1)[1].split()[0]) / 1024


def test_the_peak_measure_is_the_child_s_own_not_its_parent_s() -> None:
    # the parent holds 600 MiB while it starts the child; `ru_maxrss` would report them
    held = bytearray(600 << 20)
    held[::4096] = b"\x01" * len(held[::4096])
    proc = subprocess.run(
        [sys.executable, "-c", PEAK.replace("main()", "pass"), "--version"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    del held
    assert int(proc.stderr.rsplit("PEAK", 1)[1].split()[0]) / 1024 < 300


def _sparse_safetensors(path: Path, tensors: int, mib: int) -> None:
    """A real safetensors file of zero-filled F32 tensors whose data region is a hole."""
    header, offset, nbytes = {}, 0, mib << 20
    for i in range(tensors):
        shape = [nbytes // 4 // 1024, 1024]
        header[f"layers.{i}.weight"] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)


@pytest.mark.slow
def test_convert_to_torch_peak_memory_follows_the_largest_tensor(tmp_path: Path) -> None:
    # a 640 MiB model of 32 MiB tensors: holding the output (as torch.save of the whole dict
    # does) would take 640 MiB on top of python + torch; streaming takes about one tensor
    src = tmp_path / "model.safetensors"
    largest_mib = 32
    _sparse_safetensors(src, 20, largest_mib)
    out = tmp_path / "model.pt"
    peak = _peak_mib("convert", src, out, "--to", "torch")
    # 0.1.0's writer (torch.save of the whole dict) peaks at about 880 MiB here
    assert peak < 3 * largest_mib + 400, f"peak RSS {peak} MiB"
    loaded = torch.load(out, weights_only=True, mmap=True)
    assert len(loaded) == 20
    assert loaded["layers.19.weight"].shape == (largest_mib * 256, 1024)
    assert not loaded["layers.19.weight"].any()


def _hows(result: Any) -> dict[str, str]:
    return {e["name"]: e["how"] for e in result.json["result"]["entries"]}


def test_torch_save_to_safetensors_copies_each_plain_tensor_as_raw_bytes(tmp_path: Path) -> None:
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, generator=gen)
    state = {
        "embed.weight": base,
        "lm_head.weight": base,  # tied: written once, the other an alias
        "rows": base[2:4],  # a C-order range inside a larger storage: still raw
        "cols": base[:, 1],  # strided: only torch can gather it
        "ids": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        "norm": torch.randn(4, generator=gen).to(torch.bfloat16),
        "scale": torch.tensor(0.5),
    }
    torch.save(state, tmp_path / "src.pt")
    out = tmp_path / "out.safetensors"
    result = run_ckpt("convert", tmp_path / "src.pt", out, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    hows = _hows(result)
    assert hows.pop("cols") == "tensor"
    assert set(hows.values()) == {"raw"}, hows
    with safe_open(out, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert _bits(f.get_tensor(name)) == _bits(state[name]), name
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118


def test_safetensors_to_torch_writes_the_zip_around_raw_bytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(4)
    tensors = {
        "w": torch.randn(5, 3, generator=gen),
        "h": torch.randn(7, generator=gen).half(),
        "ids": torch.tensor([0, 7, 65535], dtype=torch.uint16),
        "f8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(2.0),
    }
    save_file(tensors, tmp_path / "src.safetensors")
    out = tmp_path / "out.pt"
    result = run_ckpt("convert", tmp_path / "src.safetensors", out, "--to", "torch", "--json")
    assert result.exit_code == 0, result.stderr
    assert set(_hows(result).values()) == {"raw"}
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        assert got.keys() == tensors.keys()
        for name, want in tensors.items():
            assert (got[name].dtype, got[name].shape) == (want.dtype, want.shape), name
            assert _bits(got[name]) == _bits(want), name
    assert zipfile.ZipFile(out).testzip() is None


def _zero_torch_file(path: Path, tensors: int, mib: int) -> None:
    """A real torch.save file of zero F32 tensors, written block by block (no tensor held)."""
    from ckpt_cli.formats.torch.zip_write import TorchZipWriter

    zeros = bytes(8 << 20)
    nbytes = mib << 20
    with open(path, "wb") as fh:
        writer = TorchZipWriter(fh, path.stem)
        obj = {
            f"layers.{i}.weight": writer.add_raw(
                "float32",
                [nbytes // 4 // 1024, 1024],
                nbytes,
                (zeros for _ in range(nbytes // len(zeros))),
            )
            for i in range(tensors)
        }
        writer.finish(obj)


@pytest.mark.slow
def test_convert_from_torch_peak_memory_follows_the_largest_tensor(tmp_path: Path) -> None:
    # a 640 MiB torch.save model of 32 MiB tensors: reading the tensors through torch's
    # memory map keeps every touched page resident (the whole model by the end); raw range
    # copies read each range into one small buffer
    src = tmp_path / "model.pt"
    largest_mib = 32
    _zero_torch_file(src, 20, largest_mib)
    out = tmp_path / "model.safetensors"
    peak = _peak_mib("convert", src, out, "--to", "safetensors")
    assert peak < 3 * largest_mib + 400, f"peak RSS {peak} MiB"
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        assert len(f.keys()) == 20
        assert not f.get_tensor("layers.19.weight").any()


@pytest.mark.slow
def test_a_plain_torch_save_file_is_inspected_and_converted_without_torch(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2, 3), "step": 4, "ids": torch.arange(3)}, tmp_path / "m.pt")
    script = """
import sys
from ckpt_cli.cli.app import main
for argv in (["inspect", "m.pt"], ["convert", "m.pt", "out.safetensors", "--to", "safetensors"]):
    sys.argv = ["ckpt", *argv]
    try:
        main()
    except SystemExit as exc:
        assert not exc.code, exc.code
assert "torch" not in sys.modules, "torch was imported"
"""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=env)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], torch.ones(2, 3))
