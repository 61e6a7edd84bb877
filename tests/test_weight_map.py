"""One weight-map index check for safetensors and torch.save shards (issue #14 §1).

A Hugging Face sharded checkpoint is written by huggingface_hub itself (`save_torch_state_dict`,
as safetensors or as `pytorch_model-*.bin` torch.save shards), then broken the same way for both
formats: `ckpt verify` must report the same code and blame the same file for each defect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

from tests.conftest import run_ckpt

INDEXES = {"safetensors": "model.safetensors.index.json", "torch": "pytorch_model.bin.index.json"}


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(32, 16),
        "layers.0.attn.weight": torch.randn(16, 16),
        "layers.0.mlp.weight": torch.randn(24, 16),
        "layers.1.attn.weight": torch.randn(16, 16),
        "layers.1.mlp.weight": torch.randn(24, 16),
        "norm.weight": torch.ones(16),
    }


@pytest.fixture(params=["safetensors", "torch"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """(format, folder) of a sharded save by huggingface_hub, at least three shards."""
    fmt: str = request.param
    folder = tmp_path / fmt
    folder.mkdir()
    save_torch_state_dict(
        weights(), folder, max_shard_size=2500, safe_serialization=fmt == "safetensors"
    )
    assert (folder / INDEXES[fmt]).exists()
    assert len(set(index_of(fmt, folder)["weight_map"].values())) > 2
    return fmt, folder


def index_of(fmt: str, folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / INDEXES[fmt]).read_text())
    return data


def write_index(fmt: str, folder: Path, index: dict[str, Any]) -> None:
    (folder / INDEXES[fmt]).write_text(json.dumps(index, indent=2))


def verify(folder: Path) -> tuple[int, list[dict[str, Any]]]:
    result = run_ckpt("verify", folder, "--json")
    assert result.json["command"] == "verify"
    return result.exit_code, result.json["result"]["problems"]


def test_an_index_entry_naming_the_wrong_shard_blames_the_index(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    name = "layers.0.mlp.weight"
    right = index["weight_map"][name]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][name] = wrong
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 1
    [problem] = found
    assert (problem["code"], problem["tensor"]) == ("wrong_shard", name)
    assert problem["file"] == str(folder / INDEXES[fmt])
    assert right in problem["message"] and wrong in problem["message"]


def test_an_index_entry_no_shard_holds_blames_the_index(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    index["weight_map"]["ghost.weight"] = index["weight_map"]["norm.weight"]
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 1
    assert [(p["code"], p["tensor"], p["file"]) for p in found] == [
        ("missing_tensor", "ghost.weight", str(folder / INDEXES[fmt]))
    ]


def test_a_tensor_the_index_does_not_list_blames_the_shard(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    shard = index["weight_map"].pop("embed.weight")
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 1
    assert [(p["code"], p["tensor"], p["file"]) for p in found] == [
        ("not_in_index", "embed.weight", str(folder / shard))
    ]


def test_a_missing_shard_is_named_with_its_tensors(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    shard = index["weight_map"]["layers.1.attn.weight"]
    lost = sorted(n for n, s in index["weight_map"].items() if s == shard)
    (folder / shard).unlink()
    code, found = verify(folder)
    assert code == 1
    [problem] = found
    assert (problem["code"], problem["file"]) == ("missing_shard", str(folder / shard))
    assert INDEXES[fmt] in problem["message"] and lost[0] in problem["message"]


def test_a_tensor_stored_in_two_shards_blames_the_second(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    first, second = sorted(set(index["weight_map"].values()))[:2]
    # the first shard also gets a tensor of the second, written by the format's own writer
    name = next(n for n, s in index["weight_map"].items() if s == second)
    if fmt == "safetensors":
        part = load_file(folder / first)
        part[name] = load_file(folder / second)[name]
        save_file(part, folder / first)
    else:
        part = torch.load(folder / first, weights_only=True)
        part[name] = torch.load(folder / second, weights_only=True)[name]
        torch.save(part, folder / first)
    code, found = verify(folder)
    assert code == 1
    errors = [p for p in found if p["severity"] == "error"]
    assert [(p["code"], p["tensor"], p["file"]) for p in errors] == [
        ("duplicate_tensor", name, str(folder / second))
    ]


def test_a_wrong_total_size_is_the_same_warning_for_both(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights().values())
    index["metadata"]["total_size"] += 4
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 0
    assert [(p["code"], p["severity"], p["file"]) for p in found] == [
        ("total_size", "warning", str(folder / INDEXES[fmt]))
    ]


@pytest.mark.parametrize(
    "damage",
    [
        lambda index: {**index, "metadata": {"total_size": "lots"}},
        lambda index: {"metadata": index["metadata"]},  # no weight_map
        lambda index: "{not json",
        # transformers' from_pretrained indexes into it: TypeError (verify said OK)
        lambda index: {**index, "metadata": "total_size=832"},
    ],
    ids=["total_size_not_a_count", "no_weight_map", "not_json", "metadata_not_an_object"],
)
def test_an_unreadable_index_is_bad_index_for_both(saved: tuple[str, Path], damage: Any) -> None:
    fmt, folder = saved
    broken = damage(index_of(fmt, folder))
    (folder / INDEXES[fmt]).write_text(broken if isinstance(broken, str) else json.dumps(broken))
    code, found = verify(folder)
    assert code == 1
    assert [(p["code"], p["file"]) for p in found if p["severity"] == "error"] == [
        ("bad_index", str(folder / INDEXES[fmt]))
    ]


@pytest.mark.parametrize("shard", [".", "./"])
def test_an_index_naming_the_folder_itself_as_a_shard_names_the_index(
    saved: tuple[str, Path], shard: str
) -> None:
    """Before: verify called the checkpoint folder a missing shard, and inspect said the
    folder "is a folder, not a regular file", the index not named."""
    fmt, folder = saved
    index = index_of(fmt, folder)
    index["weight_map"]["norm.weight"] = shard
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 1
    errors = [(p["code"], p["file"]) for p in found if p["severity"] == "error"]
    assert errors == [("bad_index", str(folder / INDEXES[fmt]))], found
    result = run_ckpt("inspect", folder)
    assert result.exit_code == 4 and str(folder / INDEXES[fmt]) in result.stderr


def test_an_index_path_out_of_the_folder_is_unsafe_input_for_both(saved: tuple[str, Path]) -> None:
    fmt, folder = saved
    index = index_of(fmt, folder)
    index["weight_map"]["norm.weight"] = "../elsewhere/" + index["weight_map"]["norm.weight"]
    write_index(fmt, folder, index)
    code, found = verify(folder)
    assert code == 1
    assert [p["code"] for p in found if p["severity"] == "error"] == ["unsafe_input"]
    assert all("../elsewhere" not in (p["file"] or "") for p in found)


def test_a_shard_reached_through_a_linked_folder_out_of_the_checkpoint_is_refused_not_missing(
    tmp_path: Path,
) -> None:
    """An index naming `sub/model.safetensors` where `sub` links to a folder outside: 0.1.x
    `verify` called the shard missing (`missing_shard`, "fetch it again"), while `inspect`
    refused the link. Both now say it is a link out of the checkpoint (`unsafe_input`)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"a": torch.ones(2)}, str(outside / "model.safetensors"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "sub").symlink_to(outside, target_is_directory=True)
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "sub/model.safetensors"}})
    )
    verify = run_ckpt("verify", model, "--json")
    assert verify.exit_code == 1
    codes = {p["code"]: p["message"] for p in verify.json["result"]["problems"]}
    assert "missing_shard" not in codes, codes
    assert "link that points outside the checkpoint" in codes["unsafe_input"]
    inspect = run_ckpt("inspect", model)
    assert inspect.exit_code == 4 and "points outside the checkpoint" in inspect.stderr


@pytest.mark.parametrize("tail", ["/", "/."])
def test_a_shard_name_that_only_names_a_folder_is_a_bad_index(
    saved: tuple[str, Path], tail: str
) -> None:
    """`model-00001-of-00003.safetensors/` is the shard to ckpt's normalised paths, but loaders
    join it to the folder as written (`os.path.join`), and a file opened as a folder fails:
    verify called the checkpoint OK that `from_pretrained` cannot load."""
    fmt, folder = saved
    index = index_of(fmt, folder)
    shard = index["weight_map"]["norm.weight"]
    index["weight_map"] = {
        name: f"{file}{tail}" if file == shard else file
        for name, file in index["weight_map"].items()
    }
    write_index(fmt, folder, index)
    with pytest.raises(NotADirectoryError):
        open(f"{folder}/{shard}{tail}", "rb")  # what safe_open and torch.load are given
    code, found = verify(folder)
    assert code == 1
    errors = [p for p in found if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in errors] == [("bad_index", str(folder / INDEXES[fmt]))]
    assert repr(f"{shard}{tail}") in errors[0]["message"], errors[0]["message"]
