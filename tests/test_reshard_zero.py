"""The pieces of a ZeRO world-size reshard that need no DeepSpeed: the model states' recorded
`dp_world_size` rewritten in the pickle's opcodes (nothing unpickled, everything else byte for
byte), and DeepSpeed's partition arithmetic. The whole flow, resumed by DeepSpeed itself, is in
`tests/test_deepspeed.py`."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.errors import FormatError
from ckpt_cli.formats import resolve_source
from ckpt_cli.ops.reshard.zero import rewrite_world_size, zero2_partition, zero3_sub_groups


@pytest.mark.parametrize("world_size", [1, 3, 300])
def test_dp_world_size_is_rewritten_and_nothing_else(tmp_path: Path, world_size: int) -> None:
    state = {
        "module": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.bfloat16)},
        "dp_world_size": 2,
        "mp_world_size": 1,
        "global_steps": 2,
        "note": "dp_world_size",  # the same text as a value is no key to rewrite
    }
    src = tmp_path / "src"
    src.mkdir()
    torch.save(state, src / "mp_rank_00_model_states.pt")
    out = tmp_path / "out.pt"
    rewrite_world_size(resolve_source(str(src)), "mp_rank_00_model_states.pt", world_size, out)
    back = torch.load(out, weights_only=True)
    assert back["dp_world_size"] == world_size
    assert {k: v for k, v in back.items() if k not in ("module", "dp_world_size")} == {
        "mp_world_size": 1,
        "global_steps": 2,
        "note": "dp_world_size",
    }
    for name, tensor in state["module"].items():
        assert back["module"][name].dtype == tensor.dtype
        assert torch.equal(back["module"][name], tensor)
    # the storages are the source's records, copied as they are
    with zipfile.ZipFile(src / "mp_rank_00_model_states.pt") as a, zipfile.ZipFile(out) as b:
        data = [n for n in a.namelist() if "/data/" in n]
        assert data and all(a.read(n) == b.read(n) for n in data)


def test_a_second_dp_world_size_is_refused(tmp_path: Path) -> None:
    torch.save({"dp_world_size": 2, "client": {"dp_world_size": 2}}, tmp_path / "states.pt")
    with pytest.raises(FormatError, match="2 times"):
        rewrite_world_size(resolve_source(str(tmp_path)), "states.pt", 3, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_zero2_partitions_follow_deepspeed_alignment() -> None:
    # 357 elements: 2 ranks align to 4 -> 360, partitions of 180 (the last 3 padding);
    # 3 ranks align to 6 -> 360, partitions of 120
    assert [zero2_partition(357, 2, r) for r in range(2)] == [(0, 180, 180), (180, 180, 177)]
    assert [zero2_partition(357, 3, r) for r in range(3)] == [
        (0, 120, 120),
        (120, 120, 120),
        (240, 120, 117),
    ]
    assert zero2_partition(10, 8, 7) == (14, 2, 0)  # a rank past the data holds padding only


def test_zero3_sub_groups_follow_partition_sizes() -> None:
    numels = [256, 16, 80, 5]
    assert zero3_sub_groups(numels, 2, 1_000_000_000) == [[0, 1, 2, 3]]
    # a sub-group closes once its partition elements reach sub_group_size
    assert zero3_sub_groups(numels, 1, 200) == [[0], [1, 2, 3]]
    assert zero3_sub_groups(numels, 2, 200) == [[0, 1, 2, 3]]
