"""Start-up stays light: help and plain runs load only what the command needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------- metadata commands (#30)
# A `ckpt inspect` / `ckpt verify` of a local model, run the way scripts and CI run it (stdout
# and stderr piped), reports what the real reader sees, and at its exit has imported no
# read-ahead pool (`concurrent.futures`, for remote files) and no progress-bar machinery
# (nothing is drawn off a terminal); ckpt's models build their pydantic schemas on first use,
# and the `ckpt` command skips pydantic's plugin scan unless the user asked for plugins.

#: `ckpt ARGS` through the console entry point; on stderr, as its last line, what stayed out
PROBE = (
    "import json, os, sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
    "from ckpt_cli.__main__ import run\n"
    "code = run()\n"
    "from ckpt_cli.models import Record\n"
    "def every(cls):\n"
    "    for sub in cls.__subclasses__():\n"
    "        yield sub\n        yield from every(sub)\n"
    "built = sorted({c.__qualname__ for c in every(Record) if c.__pydantic_complete__})\n"
    "print(json.dumps({'code': code, 'modules': sorted(sys.modules), 'built': built,\n"
    "    'plugins': os.environ.get('PYDANTIC_DISABLE_PLUGINS')}), file=sys.stderr)"
)


def _probe(*args: str | Path, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """(what the process loaded and its exit code, its stdout) of one real `ckpt ARGS`."""
    full = dict(os.environ, PYTHONPATH=str(REPO))
    full.pop("PYDANTIC_DISABLE_PLUGINS", None)
    full.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of two safetensors shards and their index, written by the safetensors library."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("startup") / "model"
    folder.mkdir()
    weight_map: dict[str, str] = {}
    rng = np.random.default_rng(0)
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {
            f"model.layers.{shard * 2 + i}.mlp.weight": rng.standard_normal((4, 8)).astype(
                np.float32
            )
            for i in range(2)
        }
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 4 * 4 * 8 * 4}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_inspect_of_a_local_model_loads_no_pool_no_progress_and_builds_few_schemas(
    model: Path,
) -> None:
    seen, stdout = _probe("inspect", model, "--json")
    assert seen["code"] == 0
    result = json.loads(stdout)["result"]
    assert result["tensors"] == 4 and result["parameters"] == 4 * 4 * 8
    assert result["bytes_by_dtype"] == {"float32": 4 * 4 * 8 * 4}
    loaded = set(seen["modules"])
    assert "concurrent.futures" not in loaded
    assert "rich.progress" not in loaded
    # the options given and left out were taken as they came, without a pydantic adapter each
    assert "typer._adapters" not in loaded
    # the report and what it is made of are built; the run scanner's, the writers' are not
    assert "InspectReport" in seen["built"] and "Manifest" in seen["built"]
    assert "RunReport" not in seen["built"] and "ConvertReport" not in seen["built"]
    assert seen["plugins"] == "1"


def test_verify_off_a_terminal_draws_no_bar_and_still_checks(model: Path) -> None:
    seen, _ = _probe("verify", model)
    assert seen["code"] == 0
    assert "rich.progress" not in seen["modules"]
    # the same checkpoint with a shard cut short: the structure check still runs and fails
    broken = model.parent / "broken"
    broken.mkdir()
    for f in model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = broken / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-16])
    seen, stdout = _probe("verify", broken, "--json")
    assert seen["code"] == 1
    assert not json.loads(stdout)["ok"]


def test_plugins_stay_as_the_user_set_them(model: Path) -> None:
    seen, _ = _probe("inspect", model, env={"PYDANTIC_DISABLE_PLUGINS": ""})
    assert seen["code"] == 0 and seen["plugins"] == ""


def test_a_pydantic_plugin_the_user_enables_still_sees_ckpts_models(
    model: Path, tmp_path: Path
) -> None:
    """pydantic's plugin loader stays out of a plain run (it imports `importlib.metadata`), and
    a plugin installed as pydantic documents it (an entry point in the `pydantic` group) still
    sees every model ckpt builds once the user enables plugins."""
    seen_file = tmp_path / "seen.txt"
    site = tmp_path / "site"
    (site / "probe_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "probe_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: probe-plugin\nVersion: 1.0\n"
    )
    (site / "probe_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[pydantic]\nprobe = probe_plugin:plugin\n"
    )
    (site / "probe_plugin.py").write_text(
        "import os\n"
        "class Plugin:\n"
        "    def new_schema_validator(self, schema, schema_type, path, kind, config, settings):\n"
        "        with open(os.environ['PROBE_SEEN'], 'a') as fh:\n"
        "            fh.write(path.name + '\\n')\n"
        "        return None, None, None\n"
        "plugin = Plugin()\n"
    )
    path = f"{REPO}{os.pathsep}{site}"
    env = {"PYTHONPATH": path, "PROBE_SEEN": str(seen_file)}
    plain, _ = _probe("inspect", model, "--json", env=env)
    assert plain["code"] == 0
    assert "importlib.metadata" not in plain["modules"] and not seen_file.exists()
    enabled, stdout = _probe(
        "inspect", model, "--json", env={**env, "PYDANTIC_DISABLE_PLUGINS": ""}
    )
    assert enabled["code"] == 0 and json.loads(stdout)["result"]["tensors"] == 4
    assert "InspectReport" in seen_file.read_text().split()


def test_a_model_validates_and_dumps_the_same_once_built_on_first_use() -> None:
    from ckpt_cli.models import Entry, Manifest

    manifest = Manifest.model_validate(
        {
            "location": "m",
            "format": "safetensors",
            "entries": [{"name": "w", "kind": "tensor", "dtype": "F32", "shape": [2], "nbytes": 8}],
            "files": [],
        }
    )
    assert manifest.entries[0] == Entry(name="w", kind="tensor", dtype="F32", shape=[2], nbytes=8)
    assert Manifest.model_validate_json(manifest.model_dump_json()) == manifest
    with pytest.raises(ValueError):
        Entry.model_validate({"name": "w", "kind": "tensor", "dtype": "F32", "shape": "x"})


# ---------------------------------------------------------------- only what is printed (#30)
# rich's console is imported by what prints with it, and `--version` by no command at all: a
# script reading `--json`, `$(ckpt latest out/)` or the version pays for neither.


def test_version_loads_no_command_and_says_the_version() -> None:
    from ckpt_cli import __version__

    seen, stdout = _probe("--version")
    assert seen["code"] == 0 and stdout == f"ckpt {__version__}\n"
    assert not [m for m in seen["modules"] if m.startswith("ckpt_cli.cli.commands.")]
    assert "rich" not in seen["modules"]


@pytest.mark.slow
def test_json_reports_are_printed_without_rich(model: Path) -> None:
    for args in (["inspect", model, "--json"], ["verify", model, "--json"]):
        seen, stdout = _probe(*args)
        assert seen["code"] == 0 and json.loads(stdout)["ok"], args
        assert "rich" not in seen["modules"], args
    # the same checkpoint for people: rich draws the summary
    seen, stdout = _probe("inspect", model)
    assert "rich" in seen["modules"] and "4 tensors" in stdout


def test_latest_prints_its_path_without_rich_or_the_prune_command(tmp_path: Path) -> None:
    from .run_fixtures import trainer_run

    out = trainer_run(tmp_path)
    seen, stdout = _probe("latest", out)
    assert seen["code"] == 0 and stdout == f"{out / 'checkpoint-500'}\n"
    assert "rich" not in seen["modules"]
    assert not [m for m in seen["modules"] if m.startswith("ckpt_cli.ops.prune")]


#: `ckpt ARGS` through the entry point; on stderr, whether the cyclic GC was on when typer and
#: pydantic were imported, and its state at exit
GC_PROBE = (
    "import gc, json, sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
    "on = {}\n"
    "class Seen:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name in ('typer', 'pydantic'):\n"
    "            on[name] = gc.isenabled()\n"
    "sys.meta_path.insert(0, Seen())\n"
    "from ckpt_cli.__main__ import run\n"
    "run()\n"
    "print(json.dumps({'on at import': on, 'on at exit': gc.isenabled(),\n"
    "    'frozen': gc.get_freeze_count()}), file=sys.stderr)"
)


def _gc_probe(*args: str | Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", GC_PROBE, *map(str, args)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    seen: dict[str, Any] = json.loads(proc.stderr.strip().splitlines()[-1])
    return seen


def test_start_up_runs_without_the_collector_and_the_work_with_it(model: Path) -> None:
    # the start-up's objects all live as long as the process: no collection looks at them
    seen = _gc_probe("--version")
    assert seen["on at import"] == {"typer": False}
    seen = _gc_probe("inspect", model, "--json")
    assert seen["on at import"] == {"typer": False, "pydantic": False}
    # the command's work gets the collector back, with the start-up's objects frozen out of it
    assert seen["on at exit"] and seen["frozen"] > 10_000


def test_the_console_script_leaves_without_the_interpreters_teardown(model: Path) -> None:
    """Once a command is over, `ckpt` flushes what it printed and exits at once: the
    interpreter's teardown (up to a second once torch is imported) is skipped, so no exit
    handler runs, while the output and the exit status are the command's own."""
    script = (
        "import atexit, sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
        "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
        "from ckpt_cli.__main__ import entry\n"
        "entry()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", script, "inspect", str(model), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"]["tensors"] == 4
    assert "teardown ran" not in done.stderr
    failed = subprocess.run(
        [sys.executable, "-c", script, "inspect", str(model / "nothing-here"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert failed.returncode == 3 and json.loads(failed.stdout)["ok"] is False
    assert "teardown ran" not in failed.stderr


# ------------------------------------------------------------- option values without adapters
# typer builds a pydantic adapter for every parameter of the command being run; ckpt hands it
# the values already of their type itself (`PlainValues`) and leaves the rest to typer.


def _typer_and_plain(param: Any) -> tuple[Any, Any]:
    from typer._coercion import build_runtime_param

    from ckpt_cli.cli.conventions import PlainValues

    described = param.type_descriptor
    plain = PlainValues(parameter_info=described.parameter_info, annotation=described.annotation)
    return build_runtime_param(described), plain


def _outcome(coercion: Any, value: Any, param: Any, ctx: Any) -> tuple[Any, ...]:
    """What `coercion` makes of `value`: the value and its type, or the error it raises."""
    try:
        got = coercion.coerce(value, param=param, ctx=ctx)
    except Exception as exc:  # the same refusal, message and all, is what is compared
        return ("refused", type(exc).__name__, str(exc))
    return ("taken", got, type(got))


def test_every_plain_option_of_every_command_takes_its_values_as_typer_would() -> None:
    import click
    import typer.main

    from ckpt_cli.cli.app import get_app
    from ckpt_cli.cli.conventions import coerce_plain_values

    samples: dict[Any, list[Any]] = {
        str: ["model.safetensors", "", "--x", "hf://org/model@main"],
        bool: [True, False],
        int: [0, 3, "3", " 7 ", "-2"],
        float: [0.5, 2.0, "0.25", "1e-3"],
        list[str]: [(), ("a",), ("*.weight", "model.*"), ["x", "y"]],
    }
    root = typer.main.get_command(get_app())
    checked = 0
    for command in [root, *root.commands.values()]:  # type: ignore[attr-defined]
        ctx = click.Context(command)
        params = [*command.params, command.get_help_option(ctx)]
        coerce_plain_values(params)
        for param in params:
            values = samples.get(param.type_descriptor.annotation)
            if values is None:
                continue
            typer_side, plain = _typer_and_plain(param)
            for value in values:
                expected = _outcome(typer_side, value, param, ctx)
                assert _outcome(plain, value, param, ctx) == expected, (param.name, value)
                checked += 1
    assert checked > 500


def test_a_value_typer_refuses_is_refused_with_typers_message(tmp_path: Path) -> None:
    from .conftest import run_ckpt

    result = run_ckpt("prune", str(tmp_path), "--keep-last", "three")
    assert result.exit_code == 2
    assert "'--keep-last'" in result.stderr and "valid integer" in result.stderr, result.stderr
