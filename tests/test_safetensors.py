"""safetensors: inspect real files from the real writers; hostile headers get exit 4."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.formats import open_checkpoint
from ckpt_cli.formats.base import WriteOptions
from ckpt_cli.formats.safetensors.format import SafetensorsFormat

from .conftest import run_ckpt


def sample_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state = {f"model.layers.{i}.mlp.weight": torch.randn(32, 16, generator=gen) for i in range(6)}
    state["model.embed.weight"] = torch.randn(50, 16, generator=gen).to(torch.bfloat16)
    state["model.step_mask"] = torch.tensor([True, False, True])
    state["model.scalar"] = torch.tensor(3, dtype=torch.int64)
    return state


def test_inspect_single_file_counts_dtypes_shapes_bytes(tmp_path: Path) -> None:
    state = sample_state()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = run_ckpt("inspect", tmp_path / "model.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["format"] == "safetensors"
    assert report["tensors"] == len(state)
    assert report["tensor_bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert report["metadata"] == {"format": "pt"}
    by_name = {e["name"]: e for e in report["entries"]}
    for name, tensor in state.items():
        assert by_name[name]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert by_name[name]["shape"] == list(tensor.shape)
    assert report["parameters"] == sum(t.numel() for t in state.values() if t.is_floating_point())
    assert report["bytes_by_dtype"]["bfloat16"] == 50 * 16 * 2


def test_inspect_sharded_folder_folds_layers_and_filters(tmp_path: Path) -> None:
    state = sample_state()
    save_torch_state_dict(state, tmp_path, max_shard_size=3000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    report = run_ckpt("inspect", tmp_path, "--json").json["result"]
    assert report["tensors"] == len(state)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(report["files"]) == 1 + len(set(weight_map.values()))
    human = run_ckpt("inspect", tmp_path)
    assert "layers.{0..5}" in human.stdout
    filtered = run_ckpt("inspect", tmp_path, "--filter", "*.layers.2.*", "--json").json["result"]
    assert [e["name"] for e in filtered["entries"]] == ["model.layers.2.mlp.weight"]
    assert run_ckpt("inspect", tmp_path, "--filter", "nothing*").exit_code == 3


def test_read_tensor_is_bit_exact(tmp_path: Path) -> None:
    state = sample_state()
    save_torch_state_dict(state, tmp_path, max_shard_size=3000)
    with open_checkpoint(str(tmp_path)) as checkpoint:
        for name, tensor in state.items():
            got = checkpoint.read_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_writer_round_trips_through_safe_open(tmp_path: Path) -> None:
    state = sample_state()
    save_file(state, tmp_path / "src.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(str(tmp_path / "src.safetensors")) as src:
        plan = src.manifest.entries
        writer = SafetensorsFormat.writer(
            out, plan, WriteOptions(max_shard_size=2500, metadata={"format": "pt"})
        )
        for entry in plan:
            if entry.name.endswith("mlp.weight"):
                writer.write_raw(entry.name, src.iter_raw(entry.name))
            else:
                writer.write_tensor(entry.name, src.read_tensor(entry.name))
        files = writer.finish()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    assert len(files) == 1 + len(set(index["weight_map"].values()))
    for name, shard in index["weight_map"].items():
        with safe_open(out / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor(name), state[name])


# ---- hostile and corrupt inputs: clear error, exit 4, nothing read past the header ----


def _write_raw(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("header_past_end", "header"),
        ("absurd_header", "absurd"),
        ("invalid_json", "not valid JSON"),
        ("unknown_dtype", "unknown dtype"),
        ("shape_bytes_mismatch", "span"),
        ("overlap", "overlaps"),
        ("out_of_file", "past its end"),
        ("too_short", "too short"),
    ],
)
def test_corrupt_headers_are_exit_4_naming_the_file(
    tmp_path: Path, case: str, expected: str
) -> None:
    path = tmp_path / "bad.safetensors"
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "header_past_end":
        _write_raw(path, {"a": f32}, b"\0" * 8, length=10_000)
    elif case == "absurd_header":
        _write_raw(path, {"a": f32}, b"\0" * 8, length=1 << 60)
    elif case == "invalid_json":
        path.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    elif case == "unknown_dtype":
        _write_raw(path, {"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "shape_bytes_mismatch":
        _write_raw(path, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif case == "overlap":
        _write_raw(
            path,
            {"a": f32, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
        )
    elif case == "out_of_file":
        _write_raw(path, {"a": f32}, b"\0" * 4)
    elif case == "too_short":
        path.write_bytes(b"\1\2")
    result = run_ckpt("inspect", path)
    assert result.exit_code == 4, (result.stdout, result.stderr)
    assert str(path) in result.stderr
    assert expected in result.stderr
    envelope = run_ckpt("inspect", path, "--json").json
    assert envelope["error"]["code"] == "bad_checkpoint"


@pytest.mark.parametrize(
    "encode",
    [
        lambda text: b"\xef\xbb\xbf" + text.encode(),  # a UTF-8 byte-order mark
        lambda text: text.encode("utf-16"),  # an editor's "Unicode" save
        lambda text: text.encode("utf-32-le"),
    ],
    ids=["utf8-bom", "utf16", "utf32"],
)
def test_a_header_not_in_plain_utf8_is_refused_as_safe_open_refuses_it(
    tmp_path: Path, encode: Any
) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "real.safetensors")
    real = (tmp_path / "real.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", real[:8])
    header = encode(real[8 : 8 + length].decode())
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + real[8 + length :])
    with pytest.raises(Exception, match="header"):
        safe_open(path, framework="pt")  # the real reader refuses the file

    verified = run_ckpt("verify", path)
    assert verified.exit_code == 1, verified.stderr
    assert str(path) in verified.stdout and "UTF-8" in verified.stdout
    converted = run_ckpt("convert", path, tmp_path / "out.safetensors", "--to", "safetensors")
    assert converted.exit_code == 4, converted.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_truncated_shard_is_exit_4(tmp_path: Path) -> None:
    save_file(sample_state(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    result = run_ckpt("inspect", tmp_path / "model.safetensors")
    assert result.exit_code == 4
    assert "truncated" in result.stderr


def _sharded(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(sample_state(), tmp_path, max_shard_size=3000)
    return tmp_path / "model.safetensors.index.json"


def test_index_naming_a_missing_shard_is_named(tmp_path: Path) -> None:
    index_path = _sharded(tmp_path)
    shard = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    result = run_ckpt("inspect", tmp_path)
    assert result.exit_code == 3
    assert shard in result.stderr


@pytest.mark.parametrize(
    "evil", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"]
)
def test_weight_map_paths_leaving_the_checkpoint_are_refused(tmp_path: Path, evil: str) -> None:
    index_path = _sharded(tmp_path / "ckpt")
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = evil
    index_path.write_text(json.dumps(index))
    save_file({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")
    result = run_ckpt("inspect", tmp_path / "ckpt", "--json")
    assert result.exit_code == 4
    assert result.json["error"]["code"] == "unsafe_input"
    assert "outside" in result.stderr or "absolute" in result.stderr


def test_symlinked_shard_pointing_outside_is_refused(tmp_path: Path) -> None:
    index_path = _sharded(tmp_path / "ckpt")
    shard = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))[0]
    target = tmp_path / "elsewhere.safetensors"
    (tmp_path / "ckpt" / shard).rename(target)
    (tmp_path / "ckpt" / shard).symlink_to(target)
    result = run_ckpt("inspect", tmp_path / "ckpt")
    assert result.exit_code == 4
    assert "outside the checkpoint" in result.stderr


@pytest.mark.slow
def test_many_shards_inspect_reads_headers_only(tmp_path: Path) -> None:
    # 200 shards x 100 tensors: every tensor's offset comes from the header alone
    for shard in range(200):
        save_file(
            {f"layers.{shard}.t{i}": torch.zeros(4) for i in range(100)},
            tmp_path / f"s{shard:03d}.safetensors",
        )
    report = run_ckpt("inspect", tmp_path, "--json").json["result"]
    assert report["tensors"] == 20_000
    assert len(report["files"]) == 200


def test_inspect_entries_built_unvalidated_equal_validated_ones(tmp_path: Path) -> None:
    # the manifest's entries skip pydantic validation (`Entry.trusted`): they must be the
    # same models a validated construction gives, dumps and copies included
    from ckpt_cli import inspect as inspect_checkpoint
    from ckpt_cli.models import Entry

    save_file(
        {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)},
        tmp_path / "m.safetensors",
    )
    entries = inspect_checkpoint(str(tmp_path / "m.safetensors")).entries
    assert [e.name for e in entries] == ["a", "b"]
    for entry in entries:
        validated = Entry.model_validate(entry.model_dump())
        assert entry == validated
        assert entry.model_dump_json() == validated.model_dump_json()
        assert entry.model_fields_set == validated.model_fields_set
        assert entry.model_copy(update={"name": "x"}).name == "x"
    assert (entries[0].dtype, entries[0].shape, entries[0].nbytes) == ("float32", [2, 3], 24)
    assert (entries[1].dtype, entries[1].numel, entries[1].is_raw) == ("bfloat16", 4, True)


def test_header_listing_tensors_out_of_data_order_reads_in_data_order(tmp_path: Path) -> None:
    """A header may list its tensors in any order: ckpt reports them in data order, as the
    reference reader places them, and still finds an overlap listed backwards."""
    path = tmp_path / "model.safetensors"
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    f32 = {"dtype": "F32", "shape": [2]}
    _write_raw(
        path, {"b": {**f32, "data_offsets": [8, 16]}, "a": {**f32, "data_offsets": [0, 8]}}, data
    )
    report = run_ckpt("inspect", path, "--json").json["result"]
    start = path.stat().st_size - len(data)
    assert [(e["name"], e["offset"]) for e in report["entries"]] == [("a", start), ("b", start + 8)]
    assert run_ckpt("verify", path).exit_code == 0
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("b").tolist() == [3.0, 4.0]
    converted = tmp_path / "out.safetensors"
    assert run_ckpt("convert", path, converted, "--to", "safetensors").exit_code == 0
    with safe_open(converted, framework="pt") as f:
        assert f.get_tensor("a").tolist() == [1.0, 2.0] and f.get_tensor("b").tolist() == [3.0, 4.0]
    backwards = tmp_path / "overlap.safetensors"
    _write_raw(
        backwards,
        {"b": {**f32, "data_offsets": [4, 12]}, "a": {**f32, "data_offsets": [0, 8]}},
        data,
    )
    result = run_ckpt("inspect", backwards)
    assert result.exit_code == 4 and "overlaps" in result.stderr


def test_names_with_digit_like_characters_fold_only_ascii_numbers(tmp_path: Path) -> None:
    """`²` is a digit to Python's `isdigit` but no number: inspect shows it as written."""
    state = {f"model.layers.{i}.w": torch.zeros(2) for i in range(3)}
    state["model.pos.²"] = torch.zeros(1)
    save_file(state, tmp_path / "model.safetensors")
    result = run_ckpt("inspect", tmp_path / "model.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "layers.{0..2}" in result.stdout and "pos.²" in result.stdout


def test_a_name_with_a_hash_component_is_shown_as_written(tmp_path: Path) -> None:
    """`#` is an ordinary name component: it neither folds with the numbered layers beside it
    nor breaks the tree (it was taken for the folded layers' node: an internal error)."""
    state = {"#.x": torch.zeros(2), "a.#": torch.zeros(1), "a.1": torch.zeros(1)}
    save_file(state, tmp_path / "model.safetensors")
    result = run_ckpt("inspect", tmp_path / "model.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "#.x" in result.stdout and "{1}" in result.stdout
    tree = run_ckpt("inspect", tmp_path / "model.safetensors", "--json").json["result"]["tree"]
    assert {node["name"] for node in tree} == {"#.x", "a"}
    (a,) = [node for node in tree if node["name"] == "a"]
    assert [child["name"] for child in a["children"]] == ["#", "{1}"]


def test_a_weight_map_path_with_backslashes_is_named_as_such_not_as_an_absolute_path(
    tmp_path: Path,
) -> None:
    """`..\\..\\etc\\passwd` leaves the checkpoint on Windows; it is refused as it was, but the
    message called it "the absolute path", which it is not."""
    index_path = _sharded(tmp_path / "ckpt")
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "..\\..\\etc\\passwd"
    index_path.write_text(json.dumps(index))
    result = run_ckpt("inspect", tmp_path / "ckpt", "--json")
    assert result.exit_code == 4
    assert result.json["error"]["code"] == "unsafe_input"
    message = result.json["error"]["message"]
    assert "backslash" in message and "absolute" not in message, message
