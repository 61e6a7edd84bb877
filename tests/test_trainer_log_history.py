"""A Trainer run that logs every step: its `trainer_state.json` holds a long `log_history`.

`logging_steps=1` over 300,000 steps is 300,000 rows of loss, grad norm, learning rate, epoch
and step: 1.5 million values in a 48 MB `trainer_state.json` (`TrainerState.save_to_json`
indents it). ckpt flattened it into one entry per value (`trainer_state.log_history.0.loss`,
~1 KiB and ~33 µs each): 60,000 rows took 8 CPU-s and 620 MiB to `inspect`, and past
1,000,000 values the whole save was refused ("holds more than 1,000,000 values"), so `verify
--resumable` failed a save the Trainer resumes from. The log is now one entry: read, compared,
converted whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .test_budgets_ops import run_bounded


def _with_log(src: Path, dest: Path, rows: int) -> Path:
    """A copy of the real Trainer save `src` whose `trainer_state.json` logs `rows` steps,
    written by transformers' own `TrainerState.save_to_json` (what `_save_checkpoint` calls)."""
    from transformers import TrainerState

    shutil.copytree(src, dest)
    state = TrainerState.load_from_json(str(dest / "trainer_state.json"))
    state.log_history = [
        {
            "loss": 4.0 - i / rows,
            "grad_norm": 1.0 + (i % 7) / 10,
            "learning_rate": 1e-3 * (1 - i / rows),
            "epoch": i / 1000,
            "step": i + 1,
        }
        for i in range(rows)
    ]
    state.save_to_json(str(dest / "trainer_state.json"))
    return dest


@pytest.fixture(scope="module")
def long_log_save(real_trainer_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`checkpoint-4` of a real Trainer run with 300,000 logged steps (1.5M values)."""
    out = tmp_path_factory.mktemp("long_log") / "checkpoint-4"
    return _with_log(real_trainer_run / "straight" / "checkpoint-4", out, 300_000)


def test_a_save_logging_300k_steps_is_inspected_and_resumable_within_bounds(
    long_log_save: Path, tmp_path: Path
) -> None:
    inspected = run_bounded(tmp_path, "inspect", long_log_save, "--json", cpu_s=20)
    assert inspected.code == 0, inspected.stdout[-2000:] + inspected.stderr
    report = json.loads(inspected.stdout)["result"]
    logs = [e for e in report["entries"] if e["name"].startswith("trainer_state.log_history")]
    assert [(e["name"], e["py_type"]) for e in logs] == [("trainer_state.log_history", "list")]
    assert report["training"]["step"] == 4 and report["training"]["resumable"]
    assert inspected.peak_mib < 1024

    verified = run_bounded(tmp_path, "verify", long_log_save, "--resumable", "--json", cpu_s=20)
    assert verified.code == 0, verified.stdout[-2000:] + verified.stderr
    assert json.loads(verified.stdout)["ok"] is True
    assert verified.peak_mib < 1024


def test_diff_tells_two_logs_apart_and_convert_keeps_the_log_whole(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    src = real_trainer_run / "straight" / "checkpoint-4"
    a = _with_log(src, tmp_path / "a" / "checkpoint-4", 2000)
    b = _with_log(src, tmp_path / "b" / "checkpoint-4", 2000)
    assert run_ckpt("diff", a, b).exit_code == 0

    state = json.loads((b / "trainer_state.json").read_text())
    state["log_history"][-1]["loss"] = 99.0  # one loss of 10,000 values
    (b / "trainer_state.json").write_text(json.dumps(state))
    changed = run_ckpt("diff", a, b, "--json")
    assert changed.exit_code == 1, changed.stdout
    differences = changed.json["result"]["differences"]
    assert [d["name"] for d in differences] == ["trainer_state.log_history"]

    dest = tmp_path / "state.pt"
    assert run_ckpt("convert", a, dest, "--to", "torch").exit_code == 0
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # how the Trainer itself loads its numpy RNG state
        saved = torch.load(dest, weights_only=True)
    original = json.loads((a / "trainer_state.json").read_text())
    assert saved["trainer_state"]["log_history"] == original["log_history"]
    # the torch file reads the log as one entry too: the conversion diffs identical
    assert run_ckpt("diff", a, dest).exit_code == 0
    assert run_ckpt("diff", b, dest).exit_code == 1


def test_doctor_reads_the_loss_curve_of_a_run_with_long_logs(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    """doctor compares the saves of a run (their `log_history` entries are the past, not a
    data position) and reads the loss curve from the log itself."""
    run = tmp_path / "run"
    for step in (2, 4):
        src = real_trainer_run / "straight" / f"checkpoint-{step}"
        _with_log(src, run / f"checkpoint-{step}", 20_000 * step)
    result = run_bounded(tmp_path, "doctor", run, "--json", cpu_s=60)
    assert result.code == 0, result.stdout[-2000:] + result.stderr
    report = json.loads(result.stdout)["result"]
    assert report["verdict"].startswith("NO CAUSE FOUND"), report["causes"]


def test_diff_of_two_saves_with_the_same_long_log_is_bounded(
    long_log_save: Path, tmp_path: Path
) -> None:
    """The same log in files that are not byte-identical (written again without indents, as a
    script editing `global_step`'s neighbours would) diffs IDENTICAL. Its 1.5M values were
    compared one by one (~8 µs each: 11 CPU-s in all), now as plain data, whole (~5 CPU-s:
    `bench/bench_trainer_log.py`); the limit here only says the comparison ends."""
    copy = tmp_path / "copy" / "checkpoint-4"
    shutil.copytree(long_log_save, copy)
    state = json.loads((copy / "trainer_state.json").read_text())
    (copy / "trainer_state.json").write_text(json.dumps(state))
    result = run_bounded(tmp_path, "diff", long_log_save, copy, cpu_s=60)
    assert result.code == 0, result.stdout[-2000:] + result.stderr
    assert "IDENTICAL" in result.stdout


def test_an_entry_read_from_trainer_state_is_a_copy_the_caller_may_change() -> None:
    """`read_object` of a JSON component hands out a copy (parsed JSON, copied without pickle
    and without recursion): changing it leaves the checkpoint's own value as read."""
    from ckpt_cli.sources.layouts.composite import copy_json

    log = [{"loss": 1.5, "step": 1, "tags": ["a", {"b": None}]}, {"loss": -0.0, "step": 2}]
    copied = copy_json(log)
    assert copied == log and json.dumps(copied) == json.dumps(log)
    copied[0]["tags"][1]["b"] = 7
    copied.append({})
    assert log[0]["tags"][1] == {"b": None} and len(log) == 2
    deep: list[object] = []
    node = deep
    for _ in range(50_000):  # deeper than Python's recursion limit
        node.append([])
        node = node[0]  # type: ignore[assignment]
    assert copy_json(deep) is not deep and copy_json({"x": 1, "y": [2]}) == {"x": 1, "y": [2]}
