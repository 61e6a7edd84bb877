"""A hostile sweep of the readers that landed last stop: each input made hostile by a small
script, then `ckpt` run on it as a user would.

* `ckpt-reshard.json` (the record `reshard --world-size` writes and `verify`/`inspect` read):
  nested 200,000 deep it made every command a "bug in ckpt" (exit 70, RecursionError); a world
  size of 10**100 was taken as a number of ranks; a record that could not be read said "cut it
  from the ? rank(s)" with no word of why, and a later `reshard` wrote the world size it started
  from as the one the run saved it at.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .test_budgets import CPU_LIMIT, ckpt_limited
from .test_reshard_exact import _dcp_training_save

# ------------------------------------------------------------------------- ckpt-reshard.json

RECORD = "ckpt-reshard.json"


@pytest.fixture(scope="module")
def resharded_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP training save (`dcp.save`, one rank) cut by `ckpt reshard` for two ranks."""
    root = tmp_path_factory.mktemp("resharded")
    _dcp_training_save(root / "step-3")
    out = root / "two"
    args = ("--world-size", "2", "--rank-state", "replicate")
    done = run_ckpt("reshard", root / "step-3", out, *args)
    assert done.exit_code == 0, done.stdout + done.stderr
    return out


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


HOSTILE_RECORDS = {
    # what the record was made, and what the problem then says of it
    "nested_deep": (b"[" * 200_000 + b"]" * 200_000, "nested too deep"),
    "object_nested_deep": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deep"),
    "a_list": (b"[1, 2]", "holds a JSON list"),
    "not_utf8": (b'{"saved_world_size": 1, "world_size": 2, "x": "\xff\xfe"}', "as JSON"),
    "world_size_a_string": (b'{"saved_world_size": "2", "world_size": 2}', "'2'"),
    "world_size_negative": (b'{"saved_world_size": -1, "world_size": 2}', "-1"),
    "world_size_10_100": (
        json.dumps({"saved_world_size": 10**100, "world_size": 2}).encode(),
        "not a number of ranks",
    ),
    "world_size_true": (b'{"saved_world_size": true, "world_size": 2}', "True"),
    "world_size_5000_digits": (b'{"world_size": ' + b"9" * 5000 + b"}", "as JSON"),
    "huge_file": (None, "more than the"),
}


@pytest.mark.parametrize("case", HOSTILE_RECORDS)
def test_a_hostile_reshard_record_is_a_problem_that_says_why_never_a_crash(
    resharded_save: Path, tmp_path: Path, case: str
) -> None:
    data, said = HOSTILE_RECORDS[case]
    save = shutil.copytree(resharded_save, tmp_path / "two")
    if data is None:
        _sparse(save / RECORD, (64 << 20) + 1)  # past the JSON budget: never read
    else:
        (save / RECORD).write_bytes(data)

    verified = run_ckpt("verify", "--exact", save, "--json")
    assert verified.exit_code == 1, verified.stdout + verified.stderr
    training = verified.json["result"]["training"]
    assert training["resumable"] is True and training["exact"] is False
    assert training["resharded"] == {"saved_world_size": 0, "world_size": 0}
    [problem] = verified.json["result"]["problems"]
    assert problem["code"] == "resharded_world_size" and problem["file"] == str(save)
    assert RECORD in problem["message"] and said in problem["message"], problem
    assert "? rank(s)" not in problem["fix"], problem
    assert "the world size the run saved it at" in problem["fix"], problem
    text = run_ckpt("verify", "--exact", save)
    assert text.exit_code == 1 and said in text.stdout + text.stderr
    inspected = run_ckpt("inspect", save, "--json")
    assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
    assert inspected.json["result"]["training"]["exact"] is False

    # cut again: the record never claims the world size this cut started from was the saved one
    three = tmp_path / "three"
    again = run_ckpt("reshard", save, three, "--world-size", "3", "--rank-state", "replicate")
    assert again.exit_code == 0, again.stdout + again.stderr
    record = json.loads((three / RECORD).read_text())
    assert (record["saved_world_size"], record["world_size"]) == (None, 3)
    [problem] = run_ckpt("verify", "--exact", three, "--json").json["result"]["problems"]
    assert "does not say saved_world_size" in problem["message"], problem


# ------------------------------------------------------------ shards' __metadata__ merged


def _shards_each_with_its_own_value(folder: Path, shards: int, value_bytes: int) -> Path:
    """`shards` safetensors files (saved by safetensors) each holding its own `note` of
    `value_bytes` characters (and its own `key_i`, 20 keys in all that differ), and their index."""
    from safetensors.torch import save_file

    folder.mkdir()
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        metadata = {"format": "pt", "note": f"{i:08d}" * (value_bytes // 8)}
        metadata |= {f"key_{k}": str(i) for k in range(20)}
        save_file({f"layers.{i}.weight": torch.zeros(4)}, folder / name, metadata=metadata)
        weight_map[f"layers.{i}.weight"] = name
    index = {"metadata": {"total_size": 16 * shards}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.slow  # 500 MB of headers, read by a fresh process under limits
def test_500_shards_each_with_its_own_1_mb_value_are_told_in_a_few_bounded_lines(
    tmp_path: Path,
) -> None:
    src = _shards_each_with_its_own_value(tmp_path / "src", 500, 1_000_000)
    for command in (
        ("convert", src, tmp_path / "out", "--to", "safetensors", "--json"),
        ("reshard", src, tmp_path / "resharded", "--max-shard-size", "1MB", "--json"),
    ):
        done = ckpt_limited(*command)
        assert done.exit_code == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert done.cpu_s < CPU_LIMIT
        assert done.peak_rss < 1 << 30, f"peak RSS {done.peak_rss:,}"
        warnings = json.loads(done.stdout)["result"]["warnings"]
        # the 21 keys that differ: 8 told one by one, the other 13 named in one more
        assert len(warnings) == 9, warnings
        assert all(len(w) < 1200 for w in warnings), [len(w) for w in warnings]
        [note] = [w for w in warnings if w.startswith("__metadata__ key 'note'")]
        assert "model-00001-of-00500.safetensors" in note and "(1,000,000 chars)" in note
        assert "and 497 more values in 497 more shards" in note, note
        assert warnings[-1].startswith("13 more __metadata__ keys differ"), warnings[-1]
        assert "and 5 more" in warnings[-1]
    # the output holds what every shard agrees on, and nothing they disagree on
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
