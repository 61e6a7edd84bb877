"""The CLI shell: version, help, exit codes, the JSON envelope, completions, lazy torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_cli import __version__
from ckpt_cli.cli.completions import render_all

from .conftest import REPO, run_ckpt, run_ckpt_process


def test_version_and_help_list_every_command() -> None:
    assert run_ckpt("--version").stdout.strip() == f"ckpt {__version__}"
    result = run_ckpt("--help")
    assert result.exit_code == 0
    assert "inspect" in result.stdout


def test_every_command_has_examples_in_its_help() -> None:
    from ckpt_cli.cli.completions import describe_app

    for command in describe_app():
        result = run_ckpt(command.name, "--help")
        assert result.exit_code == 0, command.name
        assert "Examples" in result.stdout, f"`ckpt {command.name} --help` shows no examples"
    # help is rendered as markdown: the globs in the examples must keep their stars
    assert "--filter '*.layers.0.*'" in run_ckpt("inspect", "--help").stdout


def test_missing_path_is_exit_3_with_the_path_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = run_ckpt("inspect", missing)
    assert result.exit_code == 3
    assert str(missing) in result.stderr
    envelope = run_ckpt("inspect", missing, "--json").json
    assert envelope["ckpt_json"] == 1
    assert envelope["command"] == "inspect"
    assert envelope["ok"] is False
    assert envelope["exit_code"] == 3
    assert envelope["error"]["code"] == "not_found"
    assert envelope["result"] is None


def test_a_bug_is_exit_70_without_a_traceback_unless_ckpt_debug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops import inspect as inspect_ops

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug in the library")

    monkeypatch.setattr(inspect_ops, "inspect_with", broken)  # the command's one call
    result = run_ckpt("inspect", tmp_path)
    assert result.exit_code == 70
    assert "internal error: RuntimeError: a bug in the library" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    envelope = run_ckpt("inspect", tmp_path, "--json").json
    assert envelope["exit_code"] == 70 and envelope["ok"] is False
    assert "CKPT_DEBUG=1" in envelope["error"]["fix"]
    # with CKPT_DEBUG the exception itself comes out, traceback and all
    with pytest.raises(RuntimeError, match="a bug in the library"):
        run_ckpt("inspect", tmp_path, env={"CKPT_DEBUG": "1"})


def test_unknown_option_is_usage_error_exit_2() -> None:
    assert run_ckpt("inspect", "--no-such-option", "x").exit_code == 2


def test_committed_completions_are_current() -> None:
    for name, content in render_all().items():
        committed = (REPO / "completions" / name).read_text()
        assert committed == content, f"completions/{name} is stale: run `make completions`"


@pytest.mark.slow
def test_help_and_metadata_inspect_do_not_import_torch(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 3), dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    probe = (
        "import sys, runpy; sys.argv = ['ckpt'] + sys.argv[1:];"
        "from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)"
    )
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args in (["--help"], ["inspect", str(tmp_path / "m.safetensors"), "--json"]):
        proc = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env
        )
        assert "NO_TORCH" in proc.stderr, (args, proc.stderr)
    out = run_ckpt_process("inspect", tmp_path / "m.safetensors", "--json")
    assert json.loads(out.stdout)["result"]["tensors"] == 1
