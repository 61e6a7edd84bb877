"""A hostile sweep of the readers that landed last stop: each input made hostile by a small
script, then `ckpt` run on it as a user would.

* `ckpt-reshard.json` (the record `reshard --world-size` writes and `verify`/`inspect` read):
  nested 200,000 deep it made every command a "bug in ckpt" (exit 70, RecursionError); a world
  size of 10**100 was taken as a number of ranks; a record that could not be read said "cut it
  from the ? rank(s)" with no word of why, and a later `reshard` wrote the world size it started
  from as the one the run saved it at.
* Shards' `__metadata__` merged: 500 shards each holding its own 1 MB value of one key made one
  warning of 60,000 characters naming every shard; 21 keys that differ, 21 warnings. A key's
  message now shows three values and three shards of each, "and N more", and past eight keys
  one message names the rest.
* accelerate's `sampler.bin` / `dl_state_dict.bin` and a whole legacy Megatron-LM save (its
  tracker, args, rank folder names and links) held when swept: one guard test each.
  (DeepSpeed `latest` and tag links: `test_deepspeed.py`, beside its fixture.)
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
    """`shards` safetensors files (saved by safetensors) each holding its own `comment` of
    `value_bytes` characters (and its own `key_i`, 21 keys in all that differ), and their
    index. safetensors writes the keys in another order in each process: the warnings name
    them in the order of their names (`comment` first)."""
    from safetensors.torch import save_file

    folder.mkdir()
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        metadata = {"format": "pt", "comment": f"{i:08d}" * (value_bytes // 8)}
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
        # in the order of their names, whatever order each file wrote them in
        shown = [w.split("'")[1] for w in warnings[:8]]
        assert shown == ["comment", *(f"key_{k}" for k in (0, 1, 10, 11, 12, 13, 14))], shown
        [note] = [w for w in warnings if w.startswith("__metadata__ key 'comment'")]
        assert "model-00001-of-00500.safetensors" in note and "(1,000,000 chars)" in note
        assert "and 497 more values in 497 more shards" in note, note
        assert warnings[-1].startswith("13 more __metadata__ keys differ"), warnings[-1]
        assert "and 5 more" in warnings[-1]
    # the output holds what every shard agrees on, and nothing they disagree on
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


# ------------------------------------------------- accelerate's data position (a regression guard)


class _RunsCode:
    """What a hostile `sampler.bin` pickles: a call of os.system (touching a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def accelerate_stateful_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """accelerate's `save_state` of a seedable, stateful loader: `sampler.bin` and
    `dl_state_dict.bin` beside the model."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from .test_accelerate_sampler import _run

    return _run(tmp_path_factory.mktemp("accelerate") / "run", stateful=True)[-1]


@pytest.mark.frameworks
@pytest.mark.slow  # fresh processes under limits
@pytest.mark.parametrize("name", ["sampler.bin", "dl_state_dict.bin"])
@pytest.mark.parametrize("kind", ["runs_code", "pickle_of_450_mb"])
def test_a_hostile_data_position_file_is_refused_unrun_in_bounded_memory(
    accelerate_stateful_save: Path, tmp_path: Path, name: str, kind: str
) -> None:
    """Every case already held when swept (a guard): a torch.save file whose pickle calls
    os.system is refused without running it, one whose pickle declares 450 MB before reading
    it; `verify --exact` names the file, `convert --dry-run` and `diff` refuse it with the fix."""
    import os

    from .test_budgets import torch_zip_with_pickle

    save = shutil.copytree(accelerate_stateful_save, tmp_path / "save")
    marker = tmp_path / "ran"
    if kind == "runs_code":
        import pickle

        torch_zip_with_pickle(save / name, pickle.dumps(_RunsCode(marker), protocol=2))
        said = "posix.system"
    else:
        torch.save({"x": [os.urandom(1 << 20) for _ in range(450)]}, save / name)
        said = "declares"

    verified = ckpt_limited("verify", "--exact", save)
    text = verified.stdout + verified.stderr
    assert verified.exit_code == 1, text
    assert f"{save / name}: " in text and said in text and "unreadable_component" in text, text
    for command in (
        ("convert", save, tmp_path / "out", "--to", "safetensors", "--dry-run"),
        ("diff", save, accelerate_stateful_save),
    ):
        refused = ckpt_limited(*command)
        assert refused.exit_code == 4, refused.stdout + refused.stderr
        assert str(save / name) in refused.stderr and "--filter-out" in refused.stderr
        assert refused.peak_rss < 1 << 30 and refused.cpu_s < CPU_LIMIT
    assert verified.peak_rss < 1 << 30 and verified.cpu_s < CPU_LIMIT
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


# -------------------------------------------- a whole legacy Megatron-LM save (a regression guard)


def _megatron_hostile(root: Path, case: str) -> tuple[Path, Path]:
    """A run folder of one legacy save (Megatron-LM's rank dicts, torch.save, TP 1 × PP 2)
    with one thing made hostile; returns (run, save)."""
    from .test_megatron_legacy import RANK_FILE, TRACKER, legacy_save, megatron_args

    run = root / "ckpts"
    save = run / "iter_0000100"
    args: object = {
        "args_a_dict": {"tensor_model_parallel_size": 1},
        "args_a_string": "tensor_model_parallel_size=1",
        "grid_4x3": megatron_args(4, 3),
    }.get(case, megatron_args(1, 2))
    legacy_save(save, 100, 1, 2, args)  # type: ignore[arg-type]
    tracker = {
        "tracker_dotdot": b"../../etc",
        "tracker_negative": b"-1",
        "tracker_10_30": str(10**30).encode(),
        "tracker_nul": b"100\x00\n",
    }.get(case, b"100")
    (run / TRACKER).write_bytes(tracker)
    if case == "tracker_1_gib":
        with (run / TRACKER).open("r+b") as f:
            f.truncate(1 << 30)
    if case == "rank_numbers_huge":
        for name in ("mp_rank_99999999_999", "mp_rank_00_99999999"):
            (save / name).mkdir()
            shutil.copy(save / "mp_rank_00_000" / RANK_FILE, save / name / RANK_FILE)
    if case == "rank_folder_linked_out":
        outside = root / "elsewhere"
        shutil.move(save / "mp_rank_00_001", outside)
        (save / "mp_rank_00_001").symlink_to(outside, target_is_directory=True)
    return run, save


#: (case, exit of `latest RUN`, exit of `inspect SAVE`, words `latest` says, words `inspect` says)
MEGATRON_HOSTILE = [
    ("tracker_dotdot", 0, 0, "holds neither an iteration nor `release`", ""),
    ("tracker_negative", 0, 0, "holds neither an iteration nor `release`", ""),
    ("tracker_nul", 0, 0, "holds neither an iteration nor `release`", ""),
    ("tracker_1_gib", 0, 0, "holds neither an iteration nor `release`", ""),
    ("tracker_10_30", 0, 0, "which this run folder does not hold", ""),
    ("args_a_dict", 0, 0, "", ""),
    ("args_a_string", 0, 0, "", ""),
    ("rank_numbers_huge", 0, 0, "", ""),
    ("grid_4x3", 3, 4, "lacks mp_rank_00_002/", "lacks mp_rank_00_002/"),
    # read as lost, and the fix said to restore it from the node that wrote it: it is there
    (
        "rank_folder_linked_out",
        3,
        4,
        "lacks mp_rank_00_001/",
        "mp_rank_00_001/ is a link that points outside the save",
    ),
]


@pytest.mark.slow  # fresh processes under limits
@pytest.mark.parametrize(
    ("case", "latest_code", "inspect_code", "said", "inspect_said"),
    MEGATRON_HOSTILE,
    ids=[c[0] for c in MEGATRON_HOSTILE],
)
def test_a_hostile_legacy_megatron_save_is_judged_clearly_in_bounded_cpu(
    tmp_path: Path, case: str, latest_code: int, inspect_code: int, said: str, inspect_said: str
) -> None:
    """All but one case held when swept (a guard): a tracker naming `../../etc`, -1, 10**30,
    a NUL or 1 GiB of bytes is read as Megatron-LM reads it (at most 4 KiB), args that are no
    Namespace give no grid, folders numbered past any grid are judged by name, and a grid the
    folders lack is named with what is missing. A rank folder linked out of the save read as
    lost to `inspect` and `convert` of the save ("restore it from the node that wrote it"): it
    is refused as the link it is, with where it leads and the fix."""
    from .run_fixtures import age
    from .test_megatron_legacy import TRACKER

    run, save = _megatron_hostile(tmp_path, case)
    age(run)
    latest = ckpt_limited("latest", run)
    inspected = ckpt_limited("inspect", save)
    for done, code in ((latest, latest_code), (inspected, inspect_code)):
        text = done.stdout + done.stderr
        assert done.exit_code == code, text
        assert "internal error" not in text, text
        assert done.cpu_s < CPU_LIMIT and done.peak_rss < 1 << 30
    assert said in latest.stdout + latest.stderr
    if latest_code == 0:
        assert latest.stdout.strip() == str(save)
    if said.startswith("holds neither"):
        assert TRACKER in latest.stderr, latest.stderr
    if inspect_code:
        assert str(save) in inspected.stderr, inspected.stderr
        assert inspect_said in inspected.stderr, inspected.stderr
