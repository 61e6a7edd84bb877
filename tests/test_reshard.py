"""`ckpt reshard`: re-cut checkpoints for another shard size or another world size.

World-size stories save DCP checkpoints with `dcp.save` (one process, and 2 ranks under
torchrun), reshard them, and load the result with `dcp.load` on the new world size; shard-size
stories regroup safetensors and read them back with `safe_open` and an index-based reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckpt_cli.placement import (
    Box,
    load_plan,
    overlaps,
    param_name,
    parse_rule,
    placement_dim,
    rank_of,
    shard_boxes,
    shard_dim0_boxes,
)
from ckpt_cli.sizes import parse_size

from .conftest import run_ckpt

# --- placement: the same cut as DTensor -------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 7, 8, 10, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_boxes_match_dtensor_and_torch_chunk(size: int, world: int) -> None:
    shape = (size, 3)
    boxes = shard_dim0_boxes(shape, world)
    pieces = torch.arange(size * 3).reshape(shape).chunk(world, dim=0) if size else ()
    for rank, box in enumerate(boxes):
        local, offset = _compute_local_shape_and_global_offset(shape, (world,), [rank], [Shard(0)])
        assert box.sizes == tuple(local), (rank, box)
        assert box.offsets == tuple(offset), (rank, box)
        expected_rows = pieces[rank].shape[0] if rank < len(pieces) else 0
        assert box.sizes[0] == expected_rows
    # and on dim 1
    for rank, box in enumerate(shard_boxes((2, size), world, 1)):
        local, offset = _compute_local_shape_and_global_offset(
            (2, size), (world,), [rank], [Shard(1)]
        )
        assert (box.sizes, box.offsets) == (tuple(local), tuple(offset))


def test_overlaps_assemble_any_box_from_any_chunking() -> None:
    full = torch.arange(7 * 6).reshape(7, 6)
    # an odd source chunking: 3 uneven row blocks, the last split on dim 1
    chunks = [Box((0, 0), (3, 6)), Box((3, 0), (2, 6)), Box((5, 0), (2, 4)), Box((5, 4), (2, 2))]
    stored = [
        full[c.offsets[0] : c.offsets[0] + c.sizes[0], c.offsets[1] : c.offsets[1] + c.sizes[1]]
        for c in chunks
    ]
    for world in (1, 2, 3, 4):
        for dim in (0, 1):
            for box in shard_boxes((7, 6), world, dim):
                out = torch.full(box.sizes, -1)
                for piece in overlaps(box, chunks):
                    s, d = piece.src, piece.dst
                    src = stored[piece.chunk][
                        s.offsets[0] : s.offsets[0] + s.sizes[0],
                        s.offsets[1] : s.offsets[1] + s.sizes[1],
                    ]
                    out[
                        d.offsets[0] : d.offsets[0] + d.sizes[0],
                        d.offsets[1] : d.offsets[1] + d.sizes[1],
                    ] = src
                want = full[
                    box.offsets[0] : box.offsets[0] + box.sizes[0],
                    box.offsets[1] : box.offsets[1] + box.sizes[1],
                ]
                assert torch.equal(out, want)
    with pytest.raises(ValueError, match="cover"):
        overlaps(Box((0, 0), (7, 6)), chunks[:2])


def test_placement_rules_first_match_wins_and_optimizer_state_follows(tmp_path: Path) -> None:
    rules = [parse_rule("*.wo.weight=1"), parse_rule("*.norm.*=replicate"), parse_rule("*=0")]
    assert placement_dim("layers.0.wo.weight", [4, 6], rules) == 1
    assert placement_dim("layers.0.norm.weight", [4], rules) is None
    assert placement_dim("layers.0.wq.weight", [4, 6], rules) == 0
    assert placement_dim("step", [], rules) is None
    assert param_name("optimizer.state.layers.0.wo.weight.exp_avg") == "layers.0.wo.weight"
    assert placement_dim("optimizer.state.layers.0.wo.weight.exp_avg", [4, 6], rules) == 1
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"*.wo.weight": 1, "*.norm.*": "replicate"}))
    assert [str(r) for r in load_plan(plan)] == ["*.wo.weight=1", "*.norm.*=replicate"]
    from ckpt_cli.errors import UsageError

    with pytest.raises(UsageError, match="dim 2"):
        placement_dim("a.wo.weight", [4], [parse_rule("*.wo.weight=2")])
    with pytest.raises(UsageError):
        parse_rule("*.wo.weight=sideways")


def test_rank_state_names_are_recognised() -> None:
    assert rank_of("dataloader.dp_rank_3") == 3
    assert rank_of("rng.rank1.torch") == 1
    assert rank_of("train_state.rng_state.2") == 2
    assert rank_of("dataloader.0.position") == 0
    assert rank_of("model.layers.1.weight") is None
    assert rank_of("optimizer.state.layers.0.weight.step") is None


def test_sizes_are_decimal_like_huggingface_hub_and_binary_with_i() -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    for text in ("5GB", "500MB", "1.5GB", "10KB"):
        assert parse_size(text) == parse_size_to_int(text)
    assert parse_size("1.5GiB") == 1536 << 20
    assert parse_size("4096") == 4096
    from ckpt_cli.errors import UsageError

    with pytest.raises(UsageError):
        parse_size("2 parsecs")


# --- shard size: safetensors -------------------------------------------------------------


def hf_model(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face-style sharded safetensors model saved by huggingface_hub."""
    gen = torch.Generator().manual_seed(5)
    state = {f"model.layers.{i}.mlp.weight": torch.randn(64, 32, generator=gen) for i in range(8)}
    state["model.embed.weight"] = torch.randn(100, 32, generator=gen).to(torch.bfloat16)
    state["model.mask"] = torch.tensor([True, False, True])
    state["model.count"] = torch.tensor(7, dtype=torch.int64)
    src = tmp_path / "model"
    src.mkdir()
    save_torch_state_dict(state, src, max_shard_size="20KB")
    return src, state


def stored_order(path: Path) -> list[str]:
    """Tensor names of one safetensors file in the order their bytes are stored."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


def read_with_index(
    folder: Path, stem: str = "model"
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """Read a sharded safetensors folder the way transformers does: the index's weight_map."""
    index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    order: list[str] = []
    metadata: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, framework="pt") as fh:
            metadata = fh.metadata()
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert index["weight_map"][name] == shard
                out[name] = fh.get_tensor(name)
        order += stored_order(folder / shard)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in out.values()
    )
    return out, order, metadata


def test_max_shard_size_regroups_in_order_raw_and_bit_exact(tmp_path: Path) -> None:
    src, state = hf_model(tmp_path)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    _, source_order, source_metadata = read_with_index(src)
    dest = tmp_path / "regrouped"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "30KB", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["mode"] == "shard-size" and report["verified"]
    assert report["raw_copy"] == len(state) and report["max_shard_size"] == 30_000
    tensors, order, metadata = read_with_index(dest)
    assert order == source_order  # tensor order kept across the new shard boundaries
    assert metadata == source_metadata == {"format": "pt"}
    assert set(tensors) == set(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
    shards = sorted(p.name for p in dest.glob("*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        # every shard within the limit, unless it holds one tensor larger than the limit
        with safe_open(dest / shard, framework="pt") as fh:
            names = list(fh.keys())
            data = sum(state[n].nbytes for n in names)
        assert data <= 30_000 or len(names) == 1
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # source untouched


def test_max_shard_size_to_one_file_and_back_to_shards(tmp_path: Path) -> None:
    src, state = hf_model(tmp_path)
    one = tmp_path / "one"
    assert run_ckpt("reshard", src, one, "--max-shard-size", "1GB").exit_code == 0
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]
    with safe_open(one / "model.safetensors", framework="pt") as fh:
        for name, tensor in state.items():
            assert torch.equal(fh.get_tensor(name), tensor)
    # a single file with its own __metadata__, cut into shards: every shard keeps it
    single = tmp_path / "single.safetensors"
    save_file(state, single, metadata={"format": "pt", "run": "a1"})
    # a tensor larger than the limit gets a shard of its own
    many = tmp_path / "many"
    result = run_ckpt("reshard", single, many, "--max-shard-size", "1KB", "--json")
    assert result.exit_code == 0, result.stderr
    tensors, _, metadata = read_with_index(many, "single")  # the source's stem is kept
    assert metadata == {"format": "pt", "run": "a1"}
    # greedy in stored order: tensors over 1 KB alone, the small ones share a shard while they fit
    groups: list[int] = []
    for name in stored_order(single):
        if groups and groups[-1] + state[name].nbytes <= 1000:
            groups[-1] += state[name].nbytes
        else:
            groups.append(state[name].nbytes)
    assert len(list(many.glob("*.safetensors"))) == len(groups)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor)


def test_reshard_refuses_existing_dest_and_bad_options(tmp_path: Path) -> None:
    src, _ = hf_model(tmp_path)
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "1MB")
    assert result.exit_code == 2 and "--force" in result.stderr
    assert (dest / "keep.txt").read_text() == "mine"
    assert run_ckpt("reshard", src, dest, "--max-shard-size", "1MB", "--force").exit_code == 0
    assert not (dest / "keep.txt").exists()
    assert (dest / "model.safetensors").exists()
    other = tmp_path / "other"
    for args in (
        [],
        ["--max-shard-size", "1MB", "--world-size", "2"],
        ["--max-shard-size", "lots"],
        ["--max-shard-size", "1MB", "--shard-dim", "*=1"],
    ):
        result = run_ckpt("reshard", src, other, *args)
        assert result.exit_code == 2, (args, result.stderr)
    # --world-size needs a DCP source
    result = run_ckpt("reshard", src, other, "--world-size", "2")
    assert result.exit_code == 2 and "convert" in result.stderr
    assert not other.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]
