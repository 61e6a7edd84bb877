"""`ckpt inspect --list` off a terminal: one aligned record per entry, names printed as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .conftest import run_ckpt_process


def test_list_prints_every_name_literally_in_aligned_columns(tmp_path: Path) -> None:
    names = ["model.[bold]x[/bold].weight", "model.[red]y", "lm_head.weight", "w\x1b[2J"]
    file = tmp_path / "m.safetensors"
    save_file({n: np.zeros((i + 1, 2), np.float32) for i, n in enumerate(names)}, str(file))
    out = run_ckpt_process("inspect", file, "--list")
    assert out.exit_code == 0, out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("name "))
    header, records = lines[start], lines[start + 1 :]
    with safe_open(str(file), framework="numpy") as f:
        stored = list(f.keys())
    assert len(records) == len(stored) == 4
    # brackets in a name are not markup: the whole name is there, once per record
    for name in names[:3]:
        [record] = [r for r in records if r.startswith(name + " ")]
        assert "float32" in record and "m.safetensors" in record
    assert any(r.startswith("w\\x1b[2J ") for r in records)  # control characters escaped
    # every column starts at the same place on every line
    for column in ("kind/dtype", "shape", "bytes", "file"):
        at = header.index(column)
        assert all(r[at - 2 : at] == "  " and r[at] != " " for r in records), column


def test_filter_out_leaves_entries_out_of_the_report(tmp_path: Path) -> None:
    """`inspect --filter-out` means what it means in convert, download and diff (the safety
    page listed inspect among them; it had only --filter)."""
    from .conftest import run_ckpt

    save_file(
        {"model.a.weight": np.ones((2, 2), np.float32), "model.a.bias": np.ones(2, np.float32)},
        str(tmp_path / "m.safetensors"),
    )
    report = run_ckpt("inspect", tmp_path / "m.safetensors", "--filter-out", "*.bias", "--json")
    result = report.json["result"]
    assert report.exit_code == 0 and [e["name"] for e in result["entries"]] == ["model.a.weight"]
    assert result["excludes"] == ["*.bias"] and result["parameters"] == 4
    listed = run_ckpt("inspect", tmp_path / "m.safetensors", "-l", "--filter-out", "*.weight")
    assert "model.a.bias" in listed.stdout and "model.a.weight" not in listed.stdout
    nothing = run_ckpt("inspect", tmp_path / "m.safetensors", "--filter-out", "model.*")
    assert nothing.exit_code == 3 and "leave no entry" in nothing.stderr
