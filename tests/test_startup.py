"""Start-up stays light: help and plain runs load only what the command needs."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO


def _modules_after(*args: str) -> set[str]:
    """The modules a real `ckpt ARGS` process had loaded when it exited."""
    probe = (
        "import sys, atexit\n"
        "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sys.modules) + '\\n'))\n"
        "sys.argv = ['ckpt', *sys.argv[1:]]\n"
        "from ckpt_cli.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=REPO
    )
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    return set(line.split()[1:])


def test_help_loads_no_operation_no_distributed_machinery_and_no_torch() -> None:
    for args in (["--help"], ["inspect", "--help"], ["convert", "--help"]):
        loaded = _modules_after(*args)
        assert "torch" not in loaded, args
        assert "ckpt_cli.distributed" not in loaded, args
        assert not any(m.startswith(("ckpt_cli.ops", "ckpt_cli.formats")) for m in loaded), args
    # the top-level help builds no option parser, so not even pydantic (typer's subcommand
    # parsing imports it on its own)
    top = _modules_after("--help")
    assert "pydantic" not in top
    # nor rich: the top-level help is plain click text, and rich is a third of the start-up
    assert "rich" not in top and "ckpt_cli.render" not in top


def test_a_plain_run_never_loads_the_distributed_machinery(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    loaded = _modules_after("inspect", str(tmp_path / "m.safetensors"), "--json")
    assert "ckpt_cli.distributed" not in loaded
    assert "torch" not in loaded
