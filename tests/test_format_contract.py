"""The format-adapter contract (issue #14 §1): what each format declares on its classes is what
its readers and writers do, and the operations read those declarations instead of probing
objects or comparing format names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt_cli.errors import FormatError
from ckpt_cli.formats import get_format, open_checkpoint, writable_formats
from ckpt_cli.formats.base import WriteOptions
from ckpt_cli.models import Entry

from .conftest import run_ckpt

REPO = Path(__file__).resolve().parent.parent
#: the operations that move data between formats: they must not know any format by name
OPS = [
    "convert.py",
    "convert_plan.py",
    "reshard.py",
    "reshard_world.py",
    "reshard_report.py",
    "transfer.py",
    "verify.py",
    "slim.py",
    "components.py",
    "merge.py",
]


def _model(path: Path, n: int = 6) -> dict[str, object]:
    import torch
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.weight": torch.full((16, 4), float(i)) for i in range(n)}
    save_file(state, path)
    return dict(state)


def test_operations_compare_no_format_names_and_probe_no_methods() -> None:
    token = re.compile(r'"(dcp|torch|safetensors|hub|gguf)"')
    probe = re.compile(r"\b(getattr|hasattr)\(|type: ignore\[attr-defined\]")
    found = []
    for name in OPS:
        for number, line in enumerate((REPO / "ckpt_cli" / "ops" / name).read_text().splitlines()):
            if token.search(line) or probe.search(line):
                found.append(f"ops/{name}:{number + 1}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_writer_does_what_its_format_declares(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    plan = [Entry(name="w", dtype="float32", shape=[4, 2], nbytes=32)]
    tensor = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    assert writable_formats() == ["safetensors", "dcp", "torch"]
    for name in writable_formats():
        fmt = get_format(name)
        staging = tmp_path / name
        staging.mkdir()
        writer = fmt.writer(staging, plan, WriteOptions(world_size=2 if fmt.shards_by_rank else 1))
        # the chunk protocol is exactly the by-rank layout; objects exactly where declared
        assert writer.chunk_writes == fmt.shards_by_rank, name
        assert writer.accepts_objects == fmt.holds_objects, name
        assert writer.object_bytes == fmt.object_bytes, name
        if writer.chunk_writes:
            chunks = writer.chunks_of("w")
            assert [c.sizes for c in chunks] == [[2, 2], [2, 2]]
            for index, chunk in enumerate(chunks):
                rows = slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
                writer.write_chunk("w", index, tensor[rows].clone())
        else:
            with pytest.raises(FormatError):
                writer.write_chunk("w", 0, tensor)
            writer.write_tensor("w", tensor)
        files = {f.path for f in writer.finish()}
        with open_checkpoint(str(staging)) as back:
            assert back.manifest.format == name
            assert torch.equal(back.read_tensor("w"), tensor)
            assert {f.path for f in back.manifest.files} <= files | {fmt.commit_marker}
    with safe_open(tmp_path / "safetensors" / "model.safetensors", framework="pt") as fh:
        assert torch.equal(fh.get_tensor("w"), tensor)


def test_chunk_and_object_reads_where_a_format_stores_them(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    _model(tmp_path / "m.safetensors")
    with open_checkpoint(str(tmp_path / "m.safetensors")) as flat:
        assert not flat.chunk_reads and not flat.object_bytes
        with pytest.raises(FormatError, match="does not store tensors as chunks") as raised:
            flat.read_chunk("model.layers.0.weight", 0)
        assert raised.value.path == str(tmp_path / "m.safetensors")
        with pytest.raises(FormatError):
            flat.read_object_bytes("model.layers.0.weight")
    state = {"w": torch.arange(12.0).reshape(6, 2), "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with open_checkpoint(str(tmp_path / "dcp")) as chunked:
        assert chunked.chunk_reads and chunked.object_bytes
        assert torch.equal(chunked.read_chunk("w", 0), state["w"])
        blob = chunked.read_object_bytes("step")
        # a torch.save blob, handed over without unpickling it
        assert blob[:2] == b"PK"
        import io

        assert torch.load(io.BytesIO(blob), weights_only=True) == 7


@pytest.mark.parametrize(
    ("to", "extra"),
    [
        ("safetensors", ["--max-shard-size", "1KB"]),
        ("torch", ["--max-shard-size", "1KB"]),
        ("torch", []),
        ("dcp", ["--world-size", "3"]),
    ],
)
def test_a_dry_run_names_the_files_every_target_writes(
    tmp_path: Path, to: str, extra: list[str]
) -> None:
    _model(tmp_path / "m.safetensors", n=8)
    dest = tmp_path / "out"
    args = ("convert", tmp_path / "m.safetensors", dest, "--to", to, *extra)
    plan = run_ckpt(*args, "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert not dest.exists()
    done = run_ckpt(*args, "--json")
    assert done.exit_code == 0, done.stderr
    planned = {f["path"]: f["size"] for f in plan.json["result"]["files"]}
    written = {p.name: p.stat().st_size for p in dest.iterdir()}
    assert set(planned) == set(written)
    for name, size in planned.items():
        if size is not None:
            assert written[name] == size, name
    assert plan.json["result"]["world_size"] == (3 if to == "dcp" else None)


def test_dest_named_like_another_formats_file_is_refused(tmp_path: Path) -> None:
    _model(tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert", tmp_path / "m.safetensors", tmp_path / "x.safetensors", "--to", "torch"
    )
    assert result.exit_code == 2
    assert "DEST names a safetensors file, but --to torch writes a .pt file or a folder" in (
        result.stderr
    )
    assert "--to safetensors, or name DEST x.pt" in result.stderr
    folder = run_ckpt("convert", tmp_path / "m.safetensors", tmp_path / "y.pt", "--to", "dcp")
    assert folder.exit_code == 2
    assert "DEST names a torch.save file, but --to dcp writes a folder" in folder.stderr
    assert "Use --to torch, or name DEST y to write that format" in folder.stderr
