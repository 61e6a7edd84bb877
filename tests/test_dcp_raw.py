"""DCP torch_save data at copy speed: tensor bytes copied out of, and written into, torch.save
blobs as raw byte ranges, never through `torch.load` / `torch.save` (#18)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.formats import open_checkpoint
from ckpt_cli.formats.dcp import DcpCheckpoint

from .conftest import run_ckpt
from .dcp_dist_script import expected_state
from .dist_helpers import DIST_SCRIPT, dcp_load_flat, dcp_save, run_torchrun


def tensors() -> dict[str, torch.Tensor]:
    """Every shape class a chunk can have: 2-D, 1-D, 0-dim, empty, narrow and exotic dtypes."""
    gen = torch.Generator().manual_seed(5)
    return {
        "model.w": torch.randn(6, 5, generator=gen),
        "model.b": torch.randn(5, generator=gen).to(torch.bfloat16),
        "model.scale": torch.tensor(0.25, dtype=torch.float64),
        "model.empty": torch.zeros(0, 3),
        "model.ids": torch.arange(7, dtype=torch.int64),
        "model.u16": torch.arange(4).to(torch.uint16),
        "model.f8": torch.randn(3, 2, generator=gen).to(torch.float8_e4m3fn),
        "model.mask": torch.tensor([True, False, True]),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (float8 and friends have no `==`)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous()
        .view(-1)
        .view(torch.uint8)
        .equal(b.contiguous().view(-1).view(torch.uint8))
    )


class Calls:
    """Counts the calls of a torch function that the raw paths must not make."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str):
        self.count = 0
        real = getattr(torch, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)


def test_dcp_torch_save_to_safetensors_copies_tensor_bytes_out_of_the_blobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tensors()
    dcp_save(state, tmp_path / "src")
    loads = Calls(monkeypatch, "load")
    result = run_ckpt(
        "convert", tmp_path / "src", tmp_path / "out", "--to", "safetensors", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["raw_copies"] == len(state)
    assert loads.count == 0  # no chunk was deserialised
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(state)
        for name, tensor in state.items():
            assert same(f.get_tensor(name), tensor), name


def test_raw_chunks_point_inside_the_blobs_and_stream_across_rank_files(tmp_path: Path) -> None:
    # a 2-rank layout written by ckpt's writer through torch.save (the deserialising path)
    state = tensors()
    save_file(state, str(tmp_path / "m.safetensors"))
    out = tmp_path / "dcp2"
    assert (
        run_ckpt(
            "convert", tmp_path / "m.safetensors", out, "--to", "dcp", "--world-size", "2"
        ).exit_code
        == 0
    )
    checkpoint = open_checkpoint(str(out))
    assert isinstance(checkpoint, DcpCheckpoint)
    with checkpoint:
        w = checkpoint.manifest.by_name["model.w"]
        assert w.chunks is not None and not any(c.raw for c in w.chunks)  # stored as blobs
        ordered = checkpoint.raw_chunks_in_order("model.w")
        assert ordered is not None and [c.file for c in ordered] == ["__0_0.distcp", "__1_0.distcp"]
        for chunk, blob in zip(ordered, w.chunks, strict=True):
            # the tensor's bytes lie inside the blob's byte range
            assert blob.byte_offset < chunk.byte_offset
            assert chunk.byte_offset + chunk.byte_length <= blob.byte_offset + blob.byte_length
            assert chunk.byte_length == 3 * 5 * 4
        raw = b"".join(bytes(b) for b in checkpoint.iter_raw("model.w", block=7))
        assert raw == state["model.w"].numpy().tobytes()


def test_compressed_chunks_fall_back_to_loading(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.randn(8, 4), "b": torch.arange(3.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = FileSystemWriter(str(tmp_path / "src"), _extensions=[ZStandard()])
        dcp.save(dict(state), storage_writer=writer, no_dist=True)
    result = run_ckpt(
        "convert", tmp_path / "src", tmp_path / "out", "--to", "safetensors", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == 0  # zstd items are inflated and loaded
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        for name, tensor in state.items():
            assert same(f.get_tensor(name), tensor)


def test_a_view_saved_with_its_whole_storage_falls_back_to_loading(tmp_path: Path) -> None:
    # torch.save of a view stores the whole storage: the chunk's bytes are not the blob's
    # record, so the blob is loaded (and the view's values come out right)
    base = torch.arange(24.0).reshape(6, 4)
    dcp_save({"w": base[:, 1:3], "full": base.clone()}, tmp_path / "src")
    result = run_ckpt(
        "convert", tmp_path / "src", tmp_path / "out", "--to", "safetensors", "--json"
    )
    assert result.exit_code == 0, result.stderr
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert same(f.get_tensor("w"), base[:, 1:3].contiguous())
        assert same(f.get_tensor("full"), base)


@pytest.mark.parametrize("world_size", [1, 3])
def test_safetensors_to_dcp_torch_save_writes_the_containers_around_raw_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    state = tensors()
    save_file(state, str(tmp_path / "m.safetensors"))
    saves = Calls(monkeypatch, "save")
    out = tmp_path / "dcp"
    result = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        out,
        "--to",
        "dcp",
        "--world-size",
        str(world_size),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == len(state)
    assert saves.count == 0  # no torch.save per chunk
    inspected = run_ckpt("inspect", out, "--json").json["result"]
    assert inspected["details"]["serialization"] == "torch_save"
    assert inspected["details"]["world_size"] == world_size
    # torch's own reader loads it, bit-exact
    template = {name: torch.empty_like(t) for name, t in state.items()}
    loaded = dcp_load_flat(out, template)
    for name, tensor in state.items():
        assert same(loaded[name], tensor), name
    # each item is a torch.save blob torch.load reads on its own, and ckpt's checks pass
    assert run_ckpt("verify", out, "--deep").exit_code == 0
    # and back out, raw again, to the same bytes
    back = run_ckpt("convert", out, tmp_path / "st", "--to", "safetensors", "--json")
    assert back.json["result"]["raw_copies"] == len(state)
    with safe_open(str(tmp_path / "st" / "model.safetensors"), framework="pt") as f:
        for name, tensor in state.items():
            assert same(f.get_tensor(name), tensor), name


def test_raw_written_blobs_hold_what_torch_save_pickles(tmp_path: Path) -> None:
    # the data.pkl of every raw-written item is byte for byte torch.save's own; only the zip
    # headers differ (Python's zipfile, not torch's miniz), so the files are not byte-identical
    import io
    import zipfile

    state = tensors()
    save_file(state, str(tmp_path / "m.safetensors"))
    assert (
        run_ckpt("convert", tmp_path / "m.safetensors", tmp_path / "dcp", "--to", "dcp").exit_code
        == 0
    )
    checkpoint = open_checkpoint(str(tmp_path / "dcp"))
    data = (tmp_path / "dcp" / "__0_0.distcp").read_bytes()
    with checkpoint:
        for name, tensor in state.items():
            chunk = (checkpoint.manifest.by_name[name].chunks or [])[0]
            blob = data[chunk.byte_offset : chunk.byte_offset + chunk.byte_length]
            ours = zipfile.ZipFile(io.BytesIO(blob))
            assert ours.namelist()[0] == "archive/data.pkl"  # first, as torch.save writes it
            assert ours.testzip() is None  # every record's CRC-32 matches its bytes
            reference = io.BytesIO()
            torch.save(tensor, reference)
            theirs = zipfile.ZipFile(io.BytesIO(reference.getvalue()))
            assert ours.read("archive/data.pkl") == theirs.read("archive/data.pkl"), name
            assert ours.read("archive/data/0") == theirs.read("archive/data/0"), name
            assert same(torch.load(io.BytesIO(blob), weights_only=True), tensor), name


@pytest.mark.torchrun
def test_raw_written_two_rank_dcp_loads_under_torchrun(tmp_path: Path) -> None:
    full = expected_state()
    save_file(full, str(tmp_path / "m.safetensors"))
    out = tmp_path / "dcp"
    result = run_ckpt(
        "convert", tmp_path / "m.safetensors", out, "--to", "dcp", "--world-size", "2", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == len(full)
    run_torchrun(DIST_SCRIPT, 2, "--load", out, tmp_path / "report")
    for rank in range(2):
        report = json.loads((tmp_path / "report" / f"rank{rank}.json").read_text())
        assert report["ok"], report["mismatches"]


@pytest.mark.parametrize(
    ("serialization", "in_memory"),
    [("torch_save", True), ("torch_save", False), ("safetensors", True)],
)
def test_the_raw_kernel_and_tensor_paths_write_byte_identical_data_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, serialization: str, in_memory: bool
) -> None:
    # three ways in: raw blocks, a local file range (copied in the kernel, the zip CRC read
    # alongside and patched into the header) and torch tensors; one set of bytes out, whether
    # small containers are built in memory from a template per dtype and shape (the default
    # for these sizes) or record by record in the file
    from ckpt_cli.formats.dcp import torch_blob
    from ckpt_cli.storage.fileio import FileRange

    if not in_memory:
        monkeypatch.setattr(torch_blob, "SMALL_BLOB", -1)
    from ckpt_cli.formats.base import WriteOptions
    from ckpt_cli.formats.dcp import DcpFormat
    from ckpt_cli.models import Entry

    state = tensors()
    plan = [
        Entry(
            name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), nbytes=t.nbytes
        )
        for n, t in state.items()
    ]
    pool = tmp_path / "bytes.bin"
    places: dict[str, tuple[int, int]] = {}
    with open(pool, "wb") as fh:
        for name, tensor in state.items():
            data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            places[name] = (fh.tell(), len(data))
            fh.write(b"pad" + data)  # ranges start mid-file, at odd offsets
            places[name] = (places[name][0] + 3, len(data))
    options = WriteOptions(world_size=3, dcp_serialization=serialization)
    for how in ("raw", "kernel", "tensor"):
        (tmp_path / how).mkdir()
        writer = DcpFormat.writer(tmp_path / how, plan, options)
        assert writer.accepts_raw
        for name, tensor in state.items():
            offset, length = places[name]
            if how == "raw":
                data = pool.read_bytes()[offset : offset + length]
                writer.write_raw(name, iter([data[:5], data[5:]]))
            elif how == "kernel":
                # two segments, as a tensor whose chunks sit in two files would be
                half = length // 2
                writer.write_raw(
                    name, FileRange.of([(pool, offset, half), (pool, offset + half, length - half)])
                )
            else:
                writer.write_tensor(name, tensor)
        writer.finish()
    # and the other way of building containers, for the tensor path, to the same bytes
    monkeypatch.setattr(torch_blob, "SMALL_BLOB", 1 << 20 if not in_memory else -1)
    (tmp_path / "other").mkdir()
    writer = DcpFormat.writer(tmp_path / "other", plan, options)
    for name, tensor in state.items():
        writer.write_tensor(name, tensor)
    writer.finish()
    for rank in range(3):
        name = f"__{rank}_0.distcp"
        tensor_bytes = (tmp_path / "tensor" / name).read_bytes()
        assert (tmp_path / "raw" / name).read_bytes() == tensor_bytes, rank
        assert (tmp_path / "kernel" / name).read_bytes() == tensor_bytes, rank
        assert (tmp_path / "other" / name).read_bytes() == tensor_bytes, rank
    if serialization == "torch_save":  # (the safetensors kind's tensor path is loaded elsewhere)
        template = {name: torch.empty_like(t) for name, t in state.items()}
        for name, tensor in dcp_load_flat(tmp_path / "kernel", template).items():
            assert same(tensor, state[name]), name


def test_safetensors_to_dcp_never_imports_torch(tmp_path: Path) -> None:
    # the containers and `.metadata` are pickled naming torch's classes, without torch
    import subprocess
    import sys

    from .conftest import REPO

    save_file(tensors(), str(tmp_path / "m.safetensors"))
    script = (
        "import sys; from ckpt_cli.__main__ import run\n"
        f"sys.argv = ['ckpt', 'convert', {str(tmp_path / 'm.safetensors')!r}, "
        f"{str(tmp_path / 'dcp')!r}, '--to', 'dcp', '--world-size', '2']\n"
        "code = run()\nassert not code, code\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
    template = {name: torch.empty_like(t) for name, t in tensors().items()}
    for name, tensor in dcp_load_flat(tmp_path / "dcp", template).items():
        assert same(tensor, tensors()[name]), name
