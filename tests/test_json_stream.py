"""`--json` off a terminal is spliced from pydantic-core's JSON: the same envelope, key order
and error member as the dict-built one, for a clean result and for one with problems."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ckpt_cli.cli.render import envelope
from ckpt_cli.ops.inspect import inspect
from ckpt_cli.ops.verify.run import verify

from .conftest import run_ckpt_process


def _checkpoint(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {f"model.layers.{i}.w": rng.standard_normal((3, 2)).astype(np.float32) for i in range(4)},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return folder


def test_piped_json_is_the_envelope_of_the_report(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m")
    out = run_ckpt_process("inspect", folder, "--json")
    assert out.exit_code == 0
    doc = json.loads(out.stdout)
    expected = json.loads(json.dumps(envelope("inspect", inspect(str(folder)), 0)))
    assert list(doc) == ["ckpt_json", "command", "ok", "exit_code", "result", "error"]
    assert doc == expected
    assert doc["result"]["tree"][0]["name"] == "model.layers.{0..3}.w"


def test_piped_json_of_a_failing_verify_carries_the_error(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-8])  # the last tensor loses its bytes
    out = run_ckpt_process("verify", folder, "--json")
    assert out.exit_code == 1
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert doc["error"]["exit_code"] == 1 and doc["error"]["code"]
    report = json.loads(json.dumps(envelope("verify", verify(str(folder)), 1)))["result"]
    assert doc["result"] == report and report["problems"]
