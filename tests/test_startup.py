"""Start-up stays light: help and plain runs load only what the command needs."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO


def _modules_after(*args: str) -> set[str]:
    """The modules a real `ckpt ARGS` process had loaded when it exited."""
    probe = (
        "import sys, atexit\n"
        "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sys.modules) + '\\n'))\n"
        "sys.argv = ['ckpt', *sys.argv[1:]]\n"
        "from ckpt_cli.cli.app import main\n"
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
        assert "ckpt_cli.dist.command" not in loaded, args
        assert not any(m.startswith(("ckpt_cli.ops", "ckpt_cli.formats")) for m in loaded), args
    # the top-level help builds no option parser, so not even pydantic (typer's subcommand
    # parsing imports it on its own)
    top = _modules_after("--help")
    assert "pydantic" not in top
    # nor rich: the top-level help is plain click text, and rich is a third of the start-up
    assert "rich" not in top and "ckpt_cli.cli.render" not in top


def test_a_plain_run_never_loads_the_distributed_machinery(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    loaded = _modules_after("inspect", str(tmp_path / "m.safetensors"), "--json")
    assert "ckpt_cli.dist.command" not in loaded
    assert "torch" not in loaded


def test_inspect_of_a_plain_model_imports_no_training_layout_run_scanner_or_other_command(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A user inspecting (or verifying) a safetensors file or a folder of shards pays for
    safetensors alone: no training layout (Trainer, DeepSpeed...), no run-folder scanner,
    no dequantization, no other command's module."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2), "b": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"a": torch.zeros(4)}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(shards / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 32}, "weight_map": weight_map}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    # what a model repository holds beside its weights
    (shards / "config.json").write_text('{"model_type": "llama"}')
    (shards / "README.md").write_text("# a model\n")
    # the layout modules a safetensors model needs: the protocol and the model-folder facts
    needed = {
        "ckpt_cli.sources.layouts",
        "ckpt_cli.sources.layouts.base",
        "ckpt_cli.sources.layouts.model_folders",
    }
    for args in (
        ["inspect", str(tmp_path / "m.safetensors")],
        ["inspect", str(shards), "--json"],
        ["verify", str(shards)],
    ):
        loaded = _modules_after(*args)
        assert "ckpt_cli.formats.safetensors.format" in loaded, args  # it did read the checkpoint
        layouts = {m for m in loaded if m.startswith("ckpt_cli.sources.layouts")}
        assert layouts <= needed, (args, layouts - needed)
        # the run report's field types (`runs.records`) only: never the scanners
        runs = {m for m in loaded if m.startswith("ckpt_cli.sources.runs.")}
        assert runs <= {"ckpt_cli.sources.runs.records"}, (args, runs)
        assert "ckpt_cli.quant.dequant" not in loaded, args
        # format detection asks only the adapters whose file names are there
        others = (
            "ckpt_cli.formats.dcp",
            "ckpt_cli.formats.torch.format",
            "ckpt_cli.formats.gguf.format",
        )
        assert not loaded & set(others), (args, loaded & set(others))
        commands = {m for m in loaded if m.startswith("ckpt_cli.cli.commands.")}
        assert commands == {f"ckpt_cli.cli.commands.{args[0]}"}, (args, commands)
        assert "torch" not in loaded, args
