"""Each format's `Manifest.details` is a typed model: the reader writes it, ops read it typed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.formats import get_format, open_checkpoint
from ckpt_cli.formats.base import Format
from ckpt_cli.formats.details import (
    DcpDetails,
    IndexedDetails,
    PlainDetails,
    SafetensorsDetails,
    TorchDetails,
)

from .conftest import run_ckpt, run_ckpt_process


def _formats() -> list[type[Format]]:
    return [get_format(name) for name in ("safetensors", "torch", "dcp", "gguf")]


def test_every_format_declares_a_details_model_for_its_own_manifests() -> None:
    for fmt in _formats():
        assert fmt.details_model is not PlainDetails, fmt.name
        assert fmt.name in fmt.details_model.formats, fmt.name


def _sharded_safetensors(folder: Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    folder.mkdir()
    state = {f"layers.{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    save_torch_state_dict(state, folder, max_shard_size=40_000)
    return folder


def test_safetensors_index_facts_are_typed_and_the_json_keeps_its_keys(tmp_path: Path) -> None:
    folder = _sharded_safetensors(tmp_path / "model")
    with open_checkpoint(str(folder)) as checkpoint:
        manifest = checkpoint.manifest
        details = SafetensorsDetails.of(manifest)
        assert details is not None and details.sharded
        assert details.index == "model.safetensors.index.json"
        assert details.weight_map_size == 4
        assert details.total_size == 4 * 64 * 64 * 4
        # the weight-map facts read the same through the model both indexed formats share
        indexed = IndexedDetails.of(manifest)
        assert indexed is not None and indexed.index == details.index
        # the JSON keeps exactly the keys the reader set (nothing unset appears as null)
        assert set(manifest.details) == {"sharded", "index", "weight_map_size", "total_size"}
        assert TorchDetails.of(manifest) is None and DcpDetails.of(manifest) is None


def test_an_index_total_size_that_is_no_byte_count_is_left_out_of_inspect(
    tmp_path: Path,
) -> None:
    # `inspect --json` printed `"total_size": "big"` (the schema says an integer) and pydantic's
    # serializer warnings on stderr; verify names the flaw, inspect shows no size
    folder = _sharded_safetensors(tmp_path / "model")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] = "big"
    index_path.write_text(json.dumps(index))
    result = run_ckpt_process("inspect", folder, "--json")
    assert result.exit_code == 0, result.stderr
    assert "Pydantic" not in result.stderr and "Warning" not in result.stderr, result.stderr
    details = json.loads(result.stdout)["result"]["details"]
    assert details == {"sharded": True, "index": index_path.name, "weight_map_size": 4}
    verify = run_ckpt("verify", folder, "--json")
    assert [p["code"] for p in verify.json["result"]["problems"]] == ["bad_index"]
    with safe_open(str(folder / "model-00001-of-00002.safetensors"), "pt") as shard:
        assert torch.equal(shard.get_tensor("layers.0.weight"), torch.full((64, 64), 0.0))


def test_torch_ties_and_dcp_facts_are_typed(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    weight = torch.randn(8, 4)
    torch.save({"embed.weight": weight, "lm_head.weight": weight}, tmp_path / "tied.pt")
    with open_checkpoint(str(tmp_path / "tied.pt")) as checkpoint:
        details = TorchDetails.of(checkpoint.manifest)
        assert details is not None and not details.sharded
        assert details.shared_tensors == [["embed.weight", "lm_head.weight"]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 4), "step": 3}, checkpoint_id=str(tmp_path / "d"))
    with open_checkpoint(str(tmp_path / "d")) as checkpoint:
        details = DcpDetails.of(checkpoint.manifest)
        assert details is not None
        assert (details.serialization, details.world_size, details.chunks) == ("torch_save", 1, 1)
        assert details.layout is None and details.compression is None


@pytest.mark.parametrize("bad", [{"world_size": "two"}, {"chunks": [1]}])
def test_details_a_reader_did_not_write_give_no_typed_view(bad: dict[str, object]) -> None:
    from ckpt_cli.models import Manifest

    manifest = Manifest(format="dcp", location="x", details={"serialization": "torch_save", **bad})
    assert DcpDetails.of(manifest) is None


def test_keys_added_beside_a_formats_own_are_left_out_of_the_view(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    with open_checkpoint(str(tmp_path / "m.safetensors")) as checkpoint:
        checkpoint.manifest.details["hub"] = {"repo": "org/name"}  # what a Hub source adds
        details = SafetensorsDetails.of(checkpoint.manifest)
        assert details is not None and not details.sharded
