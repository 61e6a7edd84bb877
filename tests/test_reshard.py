"""`ckpt reshard`: re-cut checkpoints for another shard size or another world size.

World-size stories save DCP checkpoints with `dcp.save` (one process, and 2 ranks under
torchrun), reshard them, and load the result with `dcp.load` on the new world size; shard-size
stories regroup safetensors and read them back with `safe_open` and an index-based reader.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckpt_cli.dist.placement import (
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
from .dist_helpers import dcp_load_flat, run_torchrun
from .reshard_worker import TP_RULES, build_model

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
    assert rank_of("model.layers.1.lora_rank_8.weight") is None
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


# --- world size: DCP ---------------------------------------------------------------------

WORKER = Path(__file__).with_name("reshard_worker.py")
TP_ARGS = ["--shard-dim", "*.wo.weight=1", "--shard-dim", "*.norm.*=replicate"]


def torchrun(nproc: int, *args: str | Path) -> None:
    """Run the reshard worker under torchrun (gloo, CPU) on `nproc` ranks."""
    run_torchrun(WORKER, nproc, *args)


def save_one_rank(folder: Path) -> None:
    """A single-process training save (`dcp.save(..., no_dist=True)`) and its full values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = build_model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    torch.manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {
        "model": model_sd,
        "optimizer": optim_sd,
        "rng": {"rank0": torch.get_rng_state()},
        "train_state": {"step": 3},
    }
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    flat, _ = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in flat.items() if k not in tensors}
    torch.save({"tensors": tensors, "objects": objects}, f"{folder}.expected.pt")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Source checkpoints (1 rank in-process, 2 ranks under torchrun) and their reshards."""
    root = tmp_path_factory.mktemp("dcp")
    one, two = root / "one", root / "two"
    save_one_rank(one)
    torchrun(2, "save", two)
    plan = root / "tp.json"
    plan.write_text(json.dumps({"*.norm.*": "replicate"}))
    outputs: dict[str, Any] = {"root": root}
    for n in (1, 2, 3, 4):
        cases = {
            f"one-{n}": [one, "--rank-state", "keep"] if n > 1 else [one],
            f"two-{n}": [two] + (["--rank-state", "drop"] if n != 2 else []),
            # the tensor-parallel mix: wo split on dim 1, norms replicated (rule + --plan)
            f"two-tp-{n}": [two, "--shard-dim", "*.wo.weight=1", "--plan", plan]
            + (["--rank-state", "keep"] if n != 2 else []),
        }
        for key, (src, *extra) in cases.items():
            dest = root / key
            result = run_ckpt("reshard", src, dest, "--world-size", str(n), *extra, "--json")
            assert result.exit_code == 0, result.stdout + result.stderr
            outputs[key] = result.json["result"]
    # --rank-state replicate: rank 2 starts from copies of rank 0's RNG and data position;
    # at 1 rank, rank 1's are left out
    for n in (1, 3):
        dest = root / f"two-rep-{n}"
        result = run_ckpt(
            "reshard", two, dest, "--world-size", str(n), "--rank-state", "replicate", "--json"
        )
        assert result.exit_code == 0, result.stdout + result.stderr
        outputs[f"two-rep-{n}"] = result.json["result"]
    expected = torch.load(f"{two}.expected.pt", weights_only=True)
    expected["tensors"]["rng.rank2"] = expected["tensors"]["rng.rank0"]
    position = expected["objects"]["dataloader.dp_rank_0.position"]
    expected["objects"]["dataloader.dp_rank_2.position"] = position
    torch.save(expected, root / "two-rep.expected.pt")
    return outputs


def load_on(n: int, resharded: dict[str, Any], jobs: list[tuple[str, str, bool]]) -> None:
    """dcp.load each (output, source, tp-rules?) on n ranks and assert the worker found nothing."""
    root: Path = resharded["root"]
    spec = [
        {
            "path": str(root / key),
            "expected": f"{root / src}.expected.pt",
            "rules": TP_RULES if tp else {},
            "own_file": int(key.rsplit("-", 1)[1]) == n,
        }
        for key, src, tp in jobs
    ]
    jobs_file = root / f"jobs-{n}.json"
    jobs_file.write_text(json.dumps(spec))
    torchrun(n, "load", jobs_file)
    summary = json.loads(Path(f"{jobs_file}.result.json").read_text())
    for job in summary:
        assert job["problems"] == [], job
        assert job["sharded"] > 0 and job["entries"] > 0


@pytest.mark.torchrun
def test_one_rank_save_resharded_to_1_2_3_4_loads_bit_exact(resharded: dict[str, Any]) -> None:
    """Covered by the per-world-size loads below; here: what the reports say."""
    for n in (1, 2, 3, 4):
        report = resharded[f"one-{n}"]
        assert report["source_world_size"] == 1 and report["world_size"] == n
        assert [e["name"] for e in report["rank_state"]] == ["rng.rank0"]
        assert report["rank_state_action"] == ("carry" if n == 1 else "keep")
        files = sorted(f["path"] for f in report["files"] if f["path"].endswith(".distcp"))
        assert files == [f"__{r}_0.distcp" for r in range(n)]
        assert report["verified"]


@pytest.mark.torchrun
def test_two_rank_reports_name_rank_state_and_placements(resharded: dict[str, Any]) -> None:
    two = resharded["two-2"]
    assert two["source_world_size"] == 2 and two["rank_state_action"] == "carry"
    assert {e["name"] for e in two["rank_state"]} == {
        "rng.rank0",
        "rng.rank1",
        "dataloader.dp_rank_0.position",
        "dataloader.dp_rank_1.position",
    }
    assert resharded["two-3"]["rank_state_action"] == "drop"
    tp = resharded["two-tp-4"]
    # wo weights and their exp_avg/exp_avg_sq on dim 1; norms and their state replicated
    assert tp["sharded"]["1"] == 2 * 3
    assert tp["rules"] == ["*.wo.weight=1", "*.norm.*=replicate"]
    assert tp["unused_rules"] == []
    # a rule that matches nothing is reported (most likely a typo in the glob)
    out = resharded["root"] / "typo"
    result = run_ckpt(
        "reshard",
        resharded["root"] / "two",
        out,
        "--world-size",
        "2",
        "--shard-dim",
        "*.w0.weight=1",
    )
    assert result.exit_code == 0
    assert "*.w0.weight=1 matched no tensor" in result.stderr


@pytest.mark.torchrun
def test_replicate_gives_new_ranks_rank_0s_state_and_says_resume_is_not_exact(
    resharded: dict[str, Any],
) -> None:
    """`--rank-state replicate` on a plain 2-rank DCP training save (dcp.load judges the data in
    test_load_on_1_rank / _3_ranks); here: which entries were written, and the verdict."""
    up = resharded["two-rep-3"]
    assert up["rank_state_action"] == "replicate"
    written = {e["name"]: e["written"] for e in up["rank_state"]}
    assert written["rng.rank0"] == ["rng.rank0", "rng.rank2"]
    assert written["rng.rank1"] == ["rng.rank1"]
    assert written["dataloader.dp_rank_0.position"] == [
        "dataloader.dp_rank_0.position",
        "dataloader.dp_rank_2.position",
    ]
    meta = FileSystemReader(str(resharded["root"] / "two-rep-3")).read_metadata()
    assert {"rng.rank0", "rng.rank1", "rng.rank2"} <= set(meta.state_dict_metadata)
    down = resharded["two-rep-1"]
    assert {e["name"]: e["written"] for e in down["rank_state"]}["rng.rank1"] == []
    meta = FileSystemReader(str(resharded["root"] / "two-rep-1")).read_metadata()
    assert "rng.rank1" not in meta.state_dict_metadata and "rng.rank0" in meta.state_dict_metadata
    for report, why in (
        (up, "rank 2 starts from a copy of rank 0's"),
        (down, "of rank 1 was left"),
    ):
        verdict = report["resume"]
        assert verdict["exact"] is False
        assert any("world size changed (2 -> " in r for r in verdict["reasons"])
        assert any(why in r for r in verdict["reasons"]), verdict["reasons"]
    # the same world size changes nothing about the run
    assert resharded["two-2"]["resume"]["reasons"] == [] or not any(
        "world size changed" in r for r in resharded["two-2"]["resume"]["reasons"]
    )


@pytest.mark.torchrun
def test_load_on_1_rank(resharded: dict[str, Any]) -> None:
    load_on(
        1,
        resharded,
        [
            ("one-1", "one", False),
            ("two-1", "two", False),
            ("two-tp-1", "two", True),
            ("two-rep-1", "two-rep", False),
        ],
    )


@pytest.mark.torchrun
def test_load_on_2_ranks(resharded: dict[str, Any]) -> None:
    load_on(
        2, resharded, [("one-2", "one", False), ("two-2", "two", False), ("two-tp-2", "two", True)]
    )


@pytest.mark.torchrun
def test_load_on_3_ranks_including_dcp_own_resharding(resharded: dict[str, Any]) -> None:
    # two-4 on 3 ranks: not our layout for 3, so DCP reshards at load time; still bit-exact
    load_on(
        3,
        resharded,
        [
            ("one-3", "one", False),
            ("two-3", "two", False),
            ("two-tp-3", "two", True),
            ("two-4", "two", False),
            ("two-rep-3", "two-rep", False),
        ],
    )


@pytest.mark.torchrun
def test_load_on_4_ranks(resharded: dict[str, Any]) -> None:
    load_on(
        4, resharded, [("one-4", "one", False), ("two-4", "two", False), ("two-tp-4", "two", True)]
    )


@pytest.mark.torchrun
def test_rank_state_needs_a_choice_when_the_world_size_changes(
    resharded: dict[str, Any], tmp_path: Path
) -> None:
    src = resharded["root"] / "two"
    result = run_ckpt("reshard", src, tmp_path / "out", "--world-size", "3", "--json")
    assert result.exit_code == 2
    message = result.json["error"]["message"]
    for name in ("rng.rank0", "rng.rank1", "dataloader.dp_rank_0.position"):
        assert name in message
    for choice in ("keep", "drop", "replicate"):
        assert f"--rank-state {choice}" in message
    assert not (tmp_path / "out").exists()
    # dropped state is gone from the output; kept state is the source's, byte for byte
    reader = FileSystemReader(str(resharded["root"] / "two-3")).read_metadata()
    assert not [k for k in reader.state_dict_metadata if k.startswith(("rng.", "dataloader."))]
    assert "train_state.step" in reader.state_dict_metadata
    kept = FileSystemReader(str(resharded["root"] / "two-tp-3")).read_metadata()
    assert {"rng.rank0", "rng.rank1"} <= set(kept.state_dict_metadata)


@pytest.mark.torchrun
def test_output_files_hold_exactly_each_ranks_chunk(resharded: dict[str, Any]) -> None:
    """Read `.metadata` with DCP's own reader: chunk r of every sharded tensor in __r_0.distcp."""
    meta = FileSystemReader(str(resharded["root"] / "two-4")).read_metadata()
    chunks = meta.state_dict_metadata["model.out.weight"].chunks  # type: ignore[union-attr]
    assert [(list(c.offsets), list(c.sizes)) for c in chunks] == [
        ([0, 0], [2, 8]),
        ([2, 0], [2, 8]),
        ([4, 0], [1, 8]),
        ([5, 0], [0, 8]),
    ]
    for index, item in meta.storage_data.items():
        if index.fqn == "model.out.weight":
            rank = [list(c.offsets) for c in chunks].index(list(index.offset))
            assert item.relative_path == f"__{rank}_0.distcp"
    # 0-dim tensors and objects are stored once; so are tensors a rule replicates
    stored = [i.fqn for i in meta.storage_data]
    assert stored.count("optimizer.state.embed.weight.step") == 1
    assert stored.count("train_state.step") == 1
    assert stored.count("model.layers.0.norm.weight") == 4
    tp = FileSystemReader(str(resharded["root"] / "two-tp-4")).read_metadata()
    stored = [i.fqn for i in tp.storage_data]
    assert stored.count("model.layers.0.norm.weight") == 1
    assert stored.count("optimizer.state.layers.0.norm.weight.exp_avg") == 1


@pytest.mark.torchrun
def test_safetensors_serialization_puts_each_ranks_rows_in_its_file(
    resharded: dict[str, Any],
) -> None:
    """`--dcp-serialization safetensors`: every rank file is a safetensors blob of its chunks.

    (torch 2.13's FileSystemReader cannot load this serialization at all, so the rank files
    are judged with `safe_open` and DCP's sharding info.)
    """
    root: Path = resharded["root"]
    dest = root / "two-st-3"
    result = run_ckpt(
        "reshard",
        root / "two",
        dest,
        "--world-size",
        "3",
        "--rank-state",
        "drop",
        "--dcp-serialization",
        "safetensors",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["serialization"] == "safetensors"
    expected = torch.load(f"{root / 'two'}.expected.pt", weights_only=True)["tensors"]
    for rank in range(3):
        # the blob starts the file (objects follow it): hand exactly its bytes to safetensors
        data = (dest / f"__{rank}_0.distcp").read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        end = (
            8 + length + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        )
        tensors = safetensors_load(data[:end])
        sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for name in ("model.embed.weight", "optimizer.state.layers.1.wo.weight.exp_avg"):
            want = expected[name].chunk(3)[rank]
            assert torch.equal(tensors[name], want), (rank, name)
            rows = -(-expected[name].shape[0] // 3)
            assert sharding[name]["saved_offsets"] == [rank * rows, 0]
    # and back from raw safetensors chunks to torch_save on 2 ranks: dcp.load reads it bit-exact
    back = root / "two-st-3-back-2"
    result = run_ckpt(
        "reshard", dest, back, "--world-size", "2", "--dcp-serialization", "torch_save"
    )
    assert result.exit_code == 0, result.stderr
    template = {name: torch.zeros_like(t) for name, t in expected.items() if "rng." not in name}
    loaded = dcp_load_flat(back, template)
    for name in template:
        assert torch.equal(loaded[name], expected[name]), name


@pytest.mark.torchrun
def test_world_size_streams_chunks_never_whole_tensors(
    resharded: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output chunk comes from the stored chunks it overlaps, each loaded once in turn."""
    from ckpt_cli.formats.dcp import DcpCheckpoint

    loads: list[tuple[str, int]] = []
    original = DcpCheckpoint.read_chunk

    def counting(self: DcpCheckpoint, name: str, index: int) -> torch.Tensor:
        loads.append((name, index))
        return original(self, name, index)

    def whole(self: DcpCheckpoint, name: str) -> torch.Tensor:
        raise AssertionError(f"read the whole of {name}")

    monkeypatch.setattr(DcpCheckpoint, "read_chunk", counting)
    monkeypatch.setattr(DcpCheckpoint, "read_tensor", whole)
    src = resharded["root"] / "two"
    result = run_ckpt("reshard", src, tmp_path / "out", "--world-size", "3", "--rank-state", "drop")
    assert result.exit_code == 0, result.stderr
    # embed (10 rows, 2 stored chunks of 5) -> 3 chunks of 4, 4, 2 rows: 2 loads, not 4
    assert [i for n, i in loads if n == "model.embed.weight"] == [0, 1]
    # wo was stored split on dim 1: every output row block needs both stored chunks
    assert [i for n, i in loads if n == "model.layers.0.wo.weight"] == [0, 1] * 3


def test_max_shard_size_regroups_sharded_torch_save(tmp_path: Path) -> None:
    """Hugging Face `pytorch_model-*.bin` shards, regrouped and read back through the index."""
    gen = torch.Generator().manual_seed(9)
    state = {f"model.layers.{i}.weight": torch.randn(32, 32, generator=gen) for i in range(6)}
    state["model.count"] = torch.tensor(5)
    src = tmp_path / "bin"
    src.mkdir()
    save_torch_state_dict(state, src, max_shard_size="10KB", safe_serialization=False)
    assert (src / "pytorch_model.bin.index.json").exists()
    dest = tmp_path / "regrouped"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "9KB", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["format"] == "torch"
    index = json.loads((dest / "pytorch_model.bin.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = torch.load(dest / shard, weights_only=True)
        assert all(index["weight_map"][name] == shard for name in part)
        loaded.update(part)
    # 4096-byte tensors, two per 9000-byte shard; the 8-byte count joins the last one
    assert len(set(index["weight_map"].values())) == 3
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


def test_raw_copy_falls_back_when_the_kernel_refuses_copy_file_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-kernel copies are an optimisation: a refusal (EXDEV, ENOSYS...) still copies exactly."""
    src, state = hf_model(tmp_path)
    calls: list[int] = []

    def refuse(*args: Any) -> int:
        calls.append(1)
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    dest = tmp_path / "fallback"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "30KB", "--json")
    assert result.exit_code == 0, result.stderr
    assert calls and result.json["result"]["raw_copy"] == len(state)
    tensors, _, _ = read_with_index(dest)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name


@pytest.mark.torchrun
def test_interrupted_reshard_leaves_no_destination(
    resharded: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C half-way: exit 130, no DEST, no temporary sibling, the source untouched."""
    from ckpt_cli.formats.dcp import DcpWriter

    src = resharded["root"] / "two"
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    written: list[str] = []
    original = DcpWriter.write_chunk

    def interrupt(self: DcpWriter, name: str, index: int, piece: torch.Tensor) -> None:
        if len(written) == 5:
            raise KeyboardInterrupt
        written.append(name)
        original(self, name, index, piece)

    monkeypatch.setattr(DcpWriter, "write_chunk", interrupt)
    dest = tmp_path / "out"
    result = run_ckpt("reshard", src, dest, "--world-size", "3", "--rank-state", "drop")
    assert result.exit_code == 130
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_reshard_names_every_file_it_does_not_write_and_never_carries_the_source_manifest(
    tmp_path: Path,
) -> None:
    """`reshard --max-shard-size` left out a `.bin` beside the `.safetensors`, a subfolder's
    file and the like without a line (its `skipped` was always empty), and copied the source's
    `ckpt-manifest.json` into DEST, where `verify --checksums` then failed on a fresh output."""
    src = tmp_path / "model"
    src.mkdir()
    state = {f"layers.{i}.weight": torch.full((64, 16), float(i)) for i in range(4)}
    save_torch_state_dict(state, str(src))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save(state, src / "pytorch_model.bin")
    (src / "original").mkdir()
    torch.save(state, src / "original" / "consolidated.00.pth")
    assert run_ckpt("verify", src, "--write-manifest").exit_code == 0
    for command in (
        ["reshard", src, tmp_path / "resharded", "--max-shard-size", "5KB"],
        ["convert", src, tmp_path / "converted", "--to", "dcp"],
    ):
        result = run_ckpt(*command, "--json")
        assert result.exit_code == 0, result.stdout
        out = Path(command[2])
        assert not (out / "ckpt-manifest.json").exists()
        skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
        assert {"pytorch_model.bin", "original/consolidated.00.pth", "ckpt-manifest.json"} <= set(
            skipped
        ), skipped
        assert "--write-manifest" in skipped["ckpt-manifest.json"]
        # the output gets a manifest of its own, and it checks
        assert run_ckpt("verify", out, "--write-manifest").exit_code == 0
        assert run_ckpt("verify", out, "--checksums").exit_code == 0


def test_reshard_of_a_trainer_checkpoint_with_bin_weights_cuts_them_and_carries_the_rest(
    tmp_path: Path,
) -> None:
    """A Trainer `checkpoint-N/` whose weights are `pytorch_model.bin` (`save_safetensors=False`)
    beside `optimizer.pt` and `rng_state.pth`: reshard read every torch file of the folder as
    one and failed with "no ... torch.save files found". The weights are cut into the shards
    and index the Trainer's resume reads (`load_sharded_checkpoint`), the rest carried."""
    pytest.importorskip("transformers", reason="the frameworks extra brings transformers")
    from transformers.trainer_utils import load_sharded_checkpoint

    src = tmp_path / "checkpoint-4"
    src.mkdir()
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), src / "optimizer.pt")
    torch.save({"last_epoch": 4}, src / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, src / "rng_state.pth")
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    out = tmp_path / "resharded"
    result = run_ckpt("reshard", src, out, "--max-shard-size", "5KB", "--json")
    assert result.exit_code == 0, result.stdout
    assert len(list(out.glob("pytorch_model-*-of-*.bin"))) > 1
    assert (out / "pytorch_model.bin.index.json").is_file()
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(
        result.json["result"]["carried"]
    )
    same = run_ckpt("diff", src, out)
    assert same.exit_code == 0 and same.stdout.startswith("IDENTICAL"), same.stdout
    fresh = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    load_sharded_checkpoint(fresh, str(out))
    saved = torch.load(src / "pytorch_model.bin", weights_only=True)
    for name, value in saved.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_rule_for_the_weights_saved_name_cuts_its_optimizer_state_the_same_way(
    tmp_path: Path,
) -> None:
    """`*.emb.weight` matches `model.emb.weight` as inspect lists it; its optimizer state is
    keyed by the bare FQN `emb.weight` and used to be cut on dim 0 regardless."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.out = torch.nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(x))

    torch.manual_seed(0)
    net = Net()
    adam = torch.optim.Adam(net.parameters())
    net(torch.tensor([1, 2])).sum().backward()
    adam.step()
    weights, state = get_state_dict(net, adam)
    src = tmp_path / "src"
    dcp.save(
        {"model": weights, "optimizer": state, "step": 1}, checkpoint_id=str(src), no_dist=True
    )
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"*.out.weight": 1}))
    out = tmp_path / "out"
    args = ["--shard-dim", "*.emb.weight=replicate", "--plan", plan]
    result = run_ckpt("reshard", src, out, "--world-size", "2", *args)
    assert result.exit_code == 0, result.stdout + result.stderr
    metadata = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    for param, boxes in (("emb.weight", [(8, 4)]), ("out.weight", [(6, 2), (6, 2)])):
        for name in (
            f"model.{param}",
            *(f"optimizer.state.{param}.{s}" for s in ("exp_avg", "exp_avg_sq")),
        ):
            got = [tuple(c.sizes) for c in metadata[name].chunks]  # type: ignore[union-attr]
            assert got == boxes, (name, got)


def test_a_dry_run_lists_each_rank_file_with_the_entries_the_real_run_writes(
    tmp_path: Path,
) -> None:
    """The dry run used to put objects in the source's file and give data bytes as sizes."""
    from collections import Counter

    src = tmp_path / "src"
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    state = {"model": {"w": full}, "step": 5, "sched": {"lr": 0.1, "name": "cos"}}
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "out"
    dry = run_ckpt("reshard", src, out, "--world-size", "3", "-n", "--json")
    assert dry.exit_code == 0, dry.stdout + dry.stderr
    real = run_ckpt("reshard", src, out, "--world-size", "3", "--json")
    assert real.exit_code == 0, real.stdout + real.stderr
    written = {f["path"]: f for f in real.json["result"]["files"]}
    planned = {f["path"]: f for f in dry.json["result"]["files"]}
    assert planned.keys() == written.keys()
    stored = Counter(
        v.relative_path for v in FileSystemReader(str(out)).read_metadata().storage_data.values()
    )
    for path, info in planned.items():
        assert info["entries"] == written[path]["entries"], path
        if path.endswith(".distcp"):
            assert info["entries"] == stored[path], path
        # a size the dry run states is the size written; none is guessed from data bytes
        assert info["size"] in (None, written[path]["size"]), path


def test_a_world_size_reshard_says_why_the_sources_checksum_manifest_is_not_copied(
    tmp_path: Path,
) -> None:
    """The source's `ckpt-manifest.json` used to vanish: not copied, not in `skipped`."""
    src = tmp_path / "src"
    dcp.save({"w": torch.ones(4, 2), "step": 1}, checkpoint_id=str(src), no_dist=True)
    (src / "notes.txt").write_text("hi")
    assert run_ckpt("verify", src, "--write-manifest").exit_code == 0
    out = tmp_path / "out"
    result = run_ckpt("reshard", src, out, "--world-size", "2", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    (skipped,) = report["skipped"]
    assert skipped["name"] == "ckpt-manifest.json" and "checksum manifest" in skipped["reason"]
    assert skipped["kind"] == "file"
    assert report["extras"] == ["notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "notes.txt",
    ]
    text = run_ckpt("reshard", src, tmp_path / "out2", "--world-size", "2")
    assert "ckpt-manifest.json" in text.stdout + text.stderr


def test_reshard_says_what_is_not_in_the_output_where_and_as_convert_and_merge_do(
    tmp_path: Path,
) -> None:
    """`reshard` printed "skipped X: why" on stdout, among the data a script reads, while
    `convert` and `merge` name what the output lacks on stderr under "not in the output:",
    and its JSON said `path` where theirs say `name` and `kind`. One story, told one way."""
    src = tmp_path / "model"
    src.mkdir()
    state = {f"layers.{i}.weight": torch.full((64, 16), float(i)) for i in range(4)}
    save_torch_state_dict(state, str(src))
    torch.save(state, src / "pytorch_model.bin")
    reports = {}
    for command, out in (
        ("reshard", [src, tmp_path / "resharded", "--max-shard-size", "5KB"]),
        ("convert", [src, tmp_path / "converted", "--to", "dcp"]),
    ):
        text = run_ckpt(command, *out)
        assert text.exit_code == 0, text.stderr
        assert "pytorch_model.bin" not in text.stdout, text.stdout
        assert "not in the output: pytorch_model.bin: " in text.stderr, text.stderr
        result = run_ckpt(command, out[0], tmp_path / f"{command}-json", *out[2:], "--json")
        assert result.exit_code == 0, result.stderr
        reports[command] = {s["name"]: s for s in result.json["result"]["skipped"]}
    assert reports["reshard"]["pytorch_model.bin"] == reports["convert"]["pytorch_model.bin"]
    assert reports["reshard"]["pytorch_model.bin"]["kind"] == "file"


def test_a_model_that_fits_one_shard_is_reported_as_one_file_and_one_tensor(
    tmp_path: Path,
) -> None:
    """A user regroups a small model under a large --max-shard-size: the report and the
    inspect tree count in English ("in 1 file", "1 tensor"; they said "1 files", "1 tensors")."""
    weights = {"embed.weight": torch.randn(8, 4), "head.0.weight": torch.randn(2, 4)}
    (tmp_path / "src").mkdir()
    save_torch_state_dict(weights, tmp_path / "src", max_shard_size=40)
    result = run_ckpt("reshard", tmp_path / "src", tmp_path / "one", "--max-shard-size", "1MB")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "of tensor data in 1 file (" in result.stdout, result.stdout
    with safe_open(str(tmp_path / "one" / "model.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in weights.items())
    torch.save({"step": {"count": torch.tensor(3), "name": "warmup"}}, tmp_path / "state.pt")
    tree = run_ckpt("inspect", tmp_path / "state.pt")
    assert "step  1 tensor, 1 object, " in tree.stdout, tree.stdout
