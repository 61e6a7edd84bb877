"""ckpt as a shell citizen, found by an exploratory run: `--quiet` keeps the reason of a
non-zero exit, and an option that has no effect in a combination is refused (exit 2, one
envelope with `--json`) rather than silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import run_ckpt, run_ckpt_process
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .parsed import parse
from .run_fixtures import interrupted_trainer_save, trainer_run
from .s3_fixtures import S3Server, make_bucket

BUCKET = "ckpts"

# -- --quiet silences notes, never the reason of a failure ------------------------------------


def test_latest_quiet_still_says_why_there_is_no_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    interrupted_trainer_save(out, 100)
    for flags in ([], ["-q"]):
        result = run_ckpt_process("latest", out, *flags)
        assert result.exit_code == 3 and result.stdout == ""
        assert "no complete checkpoint" in result.stderr, flags
        assert "checkpoint-100" in result.stderr, flags


def test_prune_quiet_still_names_a_checkpoint_it_could_not_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops.prune import run as prune_ops

    out = trainer_run(tmp_path, steps=(100, 200, 300))

    def refuses(path: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(prune_ops.shutil, "rmtree", refuses)
    result = run_ckpt("prune", out, "--keep-last", "1", "--yes", "-q")
    assert result.exit_code == 1
    assert "checkpoint-100" in result.stderr and "Input/output error" in result.stderr


def test_sync_quiet_still_names_a_checkpoint_it_could_not_upload(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    s3_server.refuse = lambda r: (
        r.method == "PUT" and r.path.endswith("/checkpoint-200/scheduler.pt")
    )
    result = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "-q")
    assert result.exit_code == 1
    assert "checkpoint-200" in result.stderr and "scheduler.pt" in result.stderr


# -- an option that would do nothing is refused -------------------------------------------------


def test_sync_refuses_mode_without_prune_remote(tmp_path: Path) -> None:
    """`sync out/ s3://… --mode max` (now `--higher-is-better`) was accepted and did nothing
    (the remote side is pruned only with --prune-remote). (`--jobs` when pulling was refused
    too, while a pull fetched one file at a time; it now sets how many it fetches at once.)"""
    out = trainer_run(tmp_path, steps=(100,))
    for args, option in (
        ([out, "s3://bucket/run/", "--higher-is-better"], "--higher-is-better"),
        ([out, "s3://bucket/run/", "--mode", "max"], "--higher-is-better"),  # deprecated spelling
    ):
        result = run_ckpt("sync", *args, "--json")
        assert result.exit_code == 2, (option, result.stdout)
        error = result.json["error"]
        assert option in error["message"] and error["fix"], option


# -- completions offer what the options take ----------------------------------------------------


def test_completions_offer_every_value_the_options_take() -> None:
    """Tab after `convert --to` offered safetensors, dcp and torch, not hf / torchtitan /
    megatron; after `--format` not gguf; after `--dcp-compression` nothing."""
    from ckpt_cli.architectures import NAMING_FORMATS
    from ckpt_cli.cli.completions import describe_app, render_all
    from ckpt_cli.formats import FORMAT_NAMES, get_format, writable_formats
    from ckpt_cli.ops.convert.plan import NO_COMPRESSION

    offered = {
        (command.name, long): set(option.values)
        for command in describe_app()
        for option in command.options
        for long in option.longs
    }
    assert offered["convert", "--to"] == {*writable_formats(), *NAMING_FORMATS}
    for (command, long), values in offered.items():
        if long in ("--format", "--format-a", "--format-b"):
            assert values == set(FORMAT_NAMES), (command, long)
    compressions = {c for name in writable_formats() for c in get_format(name).compressions}
    for command in ("convert", "reshard"):
        assert offered[command, "--dcp-compression"] == {*compressions, NO_COMPRESSION}
    from ckpt_cli.ops.doctor import EXPECTABLE

    assert offered["doctor", "--expect"] == set(EXPECTABLE)
    bash = render_all()["ckpt.bash"]
    assert "torchtitan megatron" in bash and "gguf" in bash


# -- convert --flavor ---------------------------------------------------------------------------


def _dcp_tensors(folder: Path, scratch: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, scratch)
    found: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)

    walk("", torch.load(scratch, weights_only=False))
    return found


def test_flavor_gives_a_megatron_export_the_head_counts_a_bare_weights_file_lacks(
    tmp_path: Path,
) -> None:
    """`--flavor` was documented (help, docs, its refusal) for --to hf / torchtitan only, yet
    `--to megatron` takes it too: it gives the head counts Megatron's fused QKV needs when
    SRC has no config.json. The help, the docs and the refusal now say so."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # torchtitan's llama3 `debugmodel`: dim 256, 6 layers, 16 heads, FFN 768, vocab 2048
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, bare / "model.safetensors"
    )

    needs = run_ckpt("convert", bare, tmp_path / "no", "--to", "megatron")
    assert needs.exit_code == 4 and "--flavor" in needs.stderr
    flavored = run_ckpt(
        "convert", bare, tmp_path / "flavored", "--to", "megatron", "--flavor", "debugmodel"
    )
    assert flavored.exit_code == 0, flavored.stderr
    configured = run_ckpt("convert", tmp_path / "hf", tmp_path / "configured", "--to", "megatron")
    assert configured.exit_code == 0, configured.stderr
    got = _dcp_tensors(tmp_path / "flavored", tmp_path / "a.pt")
    want = _dcp_tensors(tmp_path / "configured", tmp_path / "b.pt")
    assert got.keys() == want.keys() and got
    assert all(torch.equal(got[k], want[k]) for k in want)

    help_text = run_ckpt("convert", "--help").stdout
    assert "megatron" in help_text.split("--flavor")[1].split("--format")[0]
    refused = run_ckpt("convert", bare, tmp_path / "x", "--to", "dcp", "--flavor", "8B")
    assert refused.exit_code == 2 and "--to megatron" in refused.stderr


def test_download_refuses_file_globs_with_no_extras_and_force_with_cache_only(
    hub: TestHub, tmp_path: Path
) -> None:
    """`--no-extras --include '*.json'` fetched no file the glob picks, and `--cache-only
    --force` (there is no DEST to replace) did nothing: both ran as if the option were absent."""
    import torch

    state = {f"model.layers.{i}.weight": torch.full((4, 4), float(i)) for i in range(2)}
    publish_model(hub, "org/model", tmp_path / "published", state)
    for args, option in (
        ([tmp_path / "a", "--no-extras", "--include", "*.json"], "--include"),
        ([tmp_path / "b", "--no-extras", "--exclude", "*.md"], "--exclude"),
        (["--cache-only", "--force"], "--force"),
    ):
        result = run_ckpt("download", "hf://org/model", *args, "--json")
        assert result.exit_code == 2, (option, result.stdout)
        error = result.json["error"]
        assert option in error["message"] and error["fix"], option
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_download_dry_run_says_an_existing_dest_would_be_refused(
    hub: TestHub, tmp_path: Path
) -> None:
    """As `convert` and `reshard` do: the plan of a run that would stop is that stop."""
    import torch

    publish_model(hub, "org/model", tmp_path / "published", {"w": torch.ones(3)})
    dest = tmp_path / "there"
    dest.mkdir()
    plan = run_ckpt("download", "hf://org/model", dest, "--dry-run", "--json")
    assert plan.exit_code == 2, plan.stdout
    assert "already exists" in plan.json["error"]["message"]
    assert run_ckpt("download", "hf://org/model", dest, "--dry-run", "--force").exit_code == 0


# -- every usage error says the fix -------------------------------------------------------------


@pytest.mark.slow
def test_every_usage_error_in_the_code_names_its_fix() -> None:
    """Many `UsageError`s said only the problem (`--world-size applies to --to dcp only`,
    `--atol must be a non-negative number`...): the envelope's `fix` was null."""
    import ast

    from .conftest import REPO

    bare = []
    for path in sorted((REPO / "ckpt_cli").rglob("*.py")):
        for node in ast.walk(parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "UsageError"
                and not any(k.arg == "fix" for k in node.keywords)
            ):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, bare


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["convert", "M", "OUT.safetensors", "--to", "safetensors", "--world-size", "2"], "--world-size"),
        (["convert", "M", "OUT.safetensors", "--to", "safetensors", "--dcp-compression", "zstd"], "--dcp-compression"),
        (["diff", "M", "M", "--atol", "-1"], "--atol"),
        (["prune", "RUN", "--keep-within", "0h"], "--keep-within"),
        (["doctor"], "RUN_DIR"),
    ],
)  # fmt: skip
def test_usage_errors_carry_a_fix_in_the_envelope(
    tmp_path: Path, args: list[str], option: str
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    (tmp_path / "run").mkdir()
    where = {"M": str(tmp_path / "m.safetensors"), "RUN": str(tmp_path / "run")}
    where["OUT.safetensors"] = str(tmp_path / "out.safetensors")
    result = run_ckpt(*[where.get(a, a) for a in args], "--json")
    assert result.exit_code == 2, result.stdout
    error = result.json["error"]
    assert option in error["message"] and error["fix"], error


def test_json_given_a_value_is_refused_in_the_envelope_it_asked_for(tmp_path: Path) -> None:
    """`ckpt inspect M --json=yes` (a script's habit from other tools) was refused on stderr
    alone: the script parsing stdout got nothing to parse. The refusal now comes as the one
    envelope `--json` promises, exit 2."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    result = run_ckpt("inspect", tmp_path / "m.safetensors", "--json=yes")
    assert result.exit_code == 2
    error = result.json["error"]
    assert error["code"] == "usage" and "--json" in error["message"], error


def test_refusals_give_the_reason_that_fits_the_option_and_the_command(tmp_path: Path) -> None:
    """`verify --force` was refused "(checking uses the algorithm the manifest records)", the
    reason for --algo; `repair` of an empty folder said it "holds no files to protect"."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    force = run_ckpt("verify", tmp_path / "m.safetensors", "--force", "--json").json["error"]
    assert "algorithm" not in force["message"] and "replaces" in force["message"]
    algo = run_ckpt("verify", tmp_path / "m.safetensors", "--algo", "sha256", "--json")
    assert "algorithm the manifest records" in algo.json["error"]["message"]
    (tmp_path / "empty").mkdir()
    repair = run_ckpt("repair", tmp_path / "empty", "--json")
    assert repair.exit_code == 3 and "repair" in repair.json["error"]["message"]


def test_diff_warns_of_a_rename_rule_that_matches_nothing_as_convert_does(tmp_path: Path) -> None:
    """`diff A B --rename typo.=model.` compared as if the rule were absent and said nothing;
    `convert` warns of the same rule. `--rename` means the same in both commands now."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"module.w": torch.ones(2)}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    typo = run_ckpt("diff", a, b, "--rename", "modle.=module.", "--json")
    assert typo.exit_code == 1
    assert any("--rename modle.=module." in w for w in typo.json["result"]["warnings"])
    human = run_ckpt("diff", a, b, "--rename", "modle.=module.")
    assert "warning: --rename modle.=module. matches no entry" in human.stderr
    lined_up = run_ckpt("diff", a, b, "--rename", "model.=module.", "--json")
    assert lined_up.exit_code == 0 and lined_up.json["result"]["warnings"] == []


def test_diff_says_a_config_or_flavor_it_had_no_mapping_to_use_for(tmp_path: Path) -> None:
    """`diff A B --flavor 8B` (or `--config config.json`) of two checkpoints in one naming
    compared as if the option were absent and said nothing, so a user who meant a torchtitan
    save against its HF export could not tell the mapping never ran; `convert` refuses
    `--flavor` where it has nothing to apply to. Both options serve the naming mapping alone:
    a diff that maps no naming says it used neither."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"model.w": torch.zeros(2)}, tmp_path / "b.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for option, value in (("--flavor", "8B"), ("--config", str(tmp_path / "config.json"))):
        unused = run_ckpt("diff", a, b, option, value, "--json")
        assert unused.exit_code == 1, unused.stderr  # the comparison itself is unchanged
        assert unused.json["result"]["differences"], unused.json
        warned = [w for w in unused.json["result"]["warnings"] if f"{option} {value}" in w]
        assert warned and "not used" in warned[0], unused.json["result"]["warnings"]
        human = run_ckpt("diff", a, b, option, value)
        assert f"warning: {option} {value} was not used" in human.stderr, human.stderr
    plain = run_ckpt("diff", a, b, "--json")
    assert plain.json["result"]["warnings"] == []


def test_megatron_with_safetensors_serialization_is_a_usage_error_not_a_bad_checkpoint(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`convert --to megatron --dcp-serialization safetensors` stopped in the writer with exit
    4 (`bad_checkpoint`, for a sound checkpoint) telling the user to "plan at most one chunk
    per tensor per file"; it is an option this naming cannot take (exit 2), said up front, dry
    run included, and nothing is written."""
    for extra in ([], ["--dry-run"]):
        dest = tmp_path / f"mg{len(extra)}"
        args = ["--to", "megatron", "--dcp-serialization", "safetensors", *extra, "--json"]
        result = run_ckpt("convert", tiny_llama, dest, *args)
        assert result.exit_code == 2, result.stdout
        error = result.json["error"]
        assert "--dcp-serialization" in error["fix"] and "chunk" in error["message"]
        assert not dest.exists()
        assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_doctor_refuses_settle_where_no_run_folder_is_judged(tmp_path: Path) -> None:
    """`doctor --before A --after B --settle 5` (and `doctor ONE_CHECKPOINT --settle 5`) took
    --settle and did nothing with it: it judges a run folder's saves, and neither has one."""
    import torch
    from safetensors.torch import save_file

    for name in ("a", "b"):
        save_file({"w": torch.ones(2)}, tmp_path / f"{name}.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for args in (["--before", a, "--after", b], [a]):
        refused = run_ckpt("doctor", *args, "--settle", "5", "--json")
        assert refused.exit_code == 2, refused.stdout
        assert "--settle" in refused.json["error"]["message"] and refused.json["error"]["fix"]
        assert run_ckpt("doctor", *args, "--json").exit_code in (0, 1)


# -- the examples of --help run -----------------------------------------------------------------


def _help_examples(command: str) -> list[list[str]]:
    """The `ckpt …` example lines of `ckpt COMMAND --help`, as argument lists (comments off)."""
    import shlex

    text = run_ckpt(command, "--help").stdout.split("Examples:")[1]
    return [
        shlex.split(line.strip(), comments=True)[1:]
        for line in text.splitlines()
        if line.strip().startswith("ckpt ")
    ]


def test_every_help_example_parses() -> None:
    """Each example names options that exist, with values they take."""
    import typer.main

    from ckpt_cli.cli.app import get_app
    from ckpt_cli.cli.completions import describe_app

    group = typer.main.get_command(get_app())
    for command in describe_app():
        for argv in _help_examples(command.name):
            name, *rest = argv
            if "|" in rest:
                rest = rest[: rest.index("|")]
            group.commands[name].make_context(name, rest)  # type: ignore[attr-defined]


def test_the_reshard_rank_state_example_runs_as_written(tmp_path: Path) -> None:
    """`ckpt reshard run/checkpoint-500 run-3gpu/checkpoint-500 …` stopped with exit 3 (the
    parent folder run-3gpu/ does not exist) wherever it was tried as written."""
    from .run_fixtures import trainer_checkpoint

    trainer_checkpoint(tmp_path / "run" / "checkpoint-500", 500)
    [example] = [a for a in _help_examples("reshard") if "replicate" in a]
    result = run_ckpt_process(*example, cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    dest = tmp_path / example[2]
    assert sorted(p.name for p in dest.glob("rng_state_*.pth")) == [
        f"rng_state_{r}.pth" for r in range(3)
    ]


@pytest.mark.slow
def test_the_completion_ckpt_install_completion_installs_offers_option_values() -> None:
    """`ckpt --help` offers `--install-completion`: typer's own completion, which asks ckpt at
    each Tab. It completed commands and option names but no value (`convert --to <Tab>`
    offered nothing), unlike the scripts of completions/."""

    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        env = {"_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
        result = run_ckpt_process(env=env)
        assert result.exit_code == 0, result.stderr
        return result.stdout.split()

    assert complete("ckpt convert a b --to ") == [
        "safetensors",
        "dcp",
        "torch",
        "hf",
        "torchtitan",
        "megatron",
    ]
    assert complete("ckpt convert a b --to t") == ["torch", "torchtitan"]
    assert "gguf" in complete("ckpt inspect a --format ")
    assert complete("ckpt convert a b --dcp-compression ") == ["zstd", "none"]
    assert "world-size" in complete("ckpt doctor out --expect ")


# -- brackets and emoji codes in paths and names are text, not markup -----------------------------


@pytest.mark.slow
def test_brackets_in_paths_are_printed_as_written_never_a_traceback(tmp_path: Path) -> None:
    """A run folder named `runs[/x]` made `latest`, `prune`, `inspect`, `convert`, `diff`...
    die with rich's MarkupError traceback and exit 1 (read by CI as "problems found"), and
    `runs[exp1]` was printed as `runs`: rich took the brackets for its own markup. A name
    holding an emoji code (`run:cat:2`) was printed with rich's emoji in its place
    (`run🐱2`), a path that exists nowhere."""
    import torch
    from safetensors.torch import save_file

    for name in ("runs[exp1]", "runs[/x]", "run:cat:2"):
        run = tmp_path / name
        run.mkdir(parents=True)
        interrupted_trainer_save(run, 100)
        model = tmp_path / f"{name}.safetensors"
        save_file({"w": torch.ones(2)}, model)
        checks = [
            (["latest", run], 3),
            (["prune", run, "--keep-last", "1"], 0),
            (["inspect", model, "--list"], 0),
            (["diff", model, model], 0),
            (["verify", model], 0),
            (["convert", model, tmp_path / f"{name}.out", "--to", "dcp", "--dry-run"], 0),
        ]
        for args, code in checks:
            result = run_ckpt_process(*args)
            assert result.exit_code == code, (args, result.stderr)
            assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr
            assert name in result.stdout + result.stderr, (args, result.stdout, result.stderr)


def test_ckpts_own_styles_still_apply_on_a_terminal(tmp_path: Path) -> None:
    from ckpt_cli.cli.render.console import escape_data_tags

    assert escape_data_tags("[bold]runs[/x][/] [dim](safetensors)[/]") == (
        "[bold]runs\\[/x][/] [dim](safetensors)[/]"
    )
    assert escape_data_tags("[bold red]a[exp1][/]") == "[bold red]a\\[exp1][/]"
    assert escape_data_tags("already \\[escaped]") == "already \\[escaped]"


def test_a_bug_while_printing_the_result_is_exit_70_not_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from safetensors.torch import save_file

    from ckpt_cli.cli.render import verify as verify_render

    def broken(report: Any) -> None:
        raise ValueError("a rendering bug")

    monkeypatch.setattr(verify_render, "render_verify", broken)
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    result = run_ckpt("verify", tmp_path / "m.safetensors")
    assert result.exit_code == 70
    assert "internal error" in result.stderr and "bug in ckpt" in result.stderr


def test_reshard_says_a_rank_state_choice_had_nothing_to_apply_to(tmp_path: Path) -> None:
    """`reshard DCP OUT --world-size 2 --rank-state drop` on a save with no per-rank state
    took the choice silently; an unmatched `--shard-dim` rule is warned about, and so is it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from .run_fixtures import trainer_checkpoint

    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    result = run_ckpt(
        "reshard", tmp_path / "plain", tmp_path / "out", "--world-size", "2",
        "--rank-state", "drop", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stdout
    assert any("--rank-state drop has no effect" in w for w in result.json["result"]["warnings"])
    trainer_checkpoint(tmp_path / "run" / "checkpoint-5", 5)
    used = run_ckpt(
        "reshard", tmp_path / "run" / "checkpoint-5", tmp_path / "out3", "--world-size", "3",
        "--rank-state", "replicate", "--json",
    )  # fmt: skip
    assert used.exit_code == 0, used.stdout
    assert not any("--rank-state" in w for w in used.json["result"]["warnings"])


# -- names that are not UTF-8 -----------------------------------------------------------------


@pytest.mark.slow
def test_a_file_name_that_is_not_utf8_gives_one_envelope_naming_it_as_python_reads_it_back(
    tmp_path: Path,
) -> None:
    """A model folder holding a file whose name is not UTF-8 (copied from an old Latin-1 disk):
    `convert --json` and `reshard --json`, stdout a pipe, printed half an envelope, then
    "internal error ... This is a bug" (exit 70), after publishing DEST. Now each prints one
    envelope, exit 0, and the name it lists is the file's: JSON's `\\udcff` escape, which
    `json.loads` and `os.fsencode` turn back into the bytes on disk."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": torch.arange(8.0)}, src / "model.safetensors")
    odd = os.fsdecode(b"notes-\xff.txt")
    (src / odd).write_text("from an old disk")
    for command, options in (
        ("convert", ["--to", "dcp"]),
        ("reshard", ["--max-shard-size", "1KB"]),
    ):
        out = tmp_path / command
        result = run_ckpt_process(command, src, out, *options, "--json")
        assert result.exit_code == 0, result.stdout + result.stderr
        envelope = json.loads(result.stdout)  # one document, nothing else
        assert envelope["ok"] is True and envelope["error"] is None
        listed = envelope["result"]["extras"]
        assert odd in listed, listed
        assert os.fsencode(odd) in os.listdir(os.fsencode(out))


# -- a file where a run folder is expected ----------------------------------------------------


def test_a_file_given_as_the_run_folder_is_named_as_a_file_by_every_run_command(
    tmp_path: Path,
) -> None:
    """`ckpt sync model.safetensors s3://…` said "no such run folder. Check the path." (exit 3)
    of a file that is there, where `latest` and `prune` say it is not a folder (exit 2) and
    what to pass instead. Every command that takes a run folder now says the same."""
    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, weights)
    for args in (
        ["latest", weights],
        ["prune", weights, "--keep-last", "1"],
        ["sync", weights, f"s3://{BUCKET}/run/"],
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 2, (args, result.stdout)
        error = result.json["error"]
        assert (error["path"], error["problem"]) == (str(weights), "is not a folder"), error
        assert "run folder" in error["fix"]


# -- a terminal that is not UTF-8 ---------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
@pytest.mark.slow
def test_a_stdout_that_is_not_utf8_never_turns_a_finished_command_into_a_bug(
    tmp_path: Path, encoding: str
) -> None:
    """Under a Latin-1 locale (or PYTHONIOENCODING=ascii, a Windows code page), `convert
    --max-shard-size` published DEST, then failed printing "shards ≤ …": "internal error:
    UnicodeEncodeError … This is a bug" (exit 70); `verify --checksums` the same on its "—".
    A `--json` run naming `café.txt` died the same way, half an envelope out. Now a character
    the stream cannot carry is escaped, and the envelope is the same JSON in plain ASCII."""
    import json

    import torch
    from safetensors.torch import save_file

    src = tmp_path / "model"
    src.mkdir()
    save_file({"a": torch.zeros(64), "b": torch.ones(64)}, src / "model.safetensors")
    (src / "config.json").write_text('{"model_type": "llama"}')
    env = {"PYTHONIOENCODING": encoding}
    human = run_ckpt_process(
        "convert", src, tmp_path / "out", "--to", "safetensors", "--max-shard-size", "300B", env=env
    )
    assert human.exit_code == 0, human.stderr
    assert "shards \\u2264 300 B" in human.stdout, human.stdout
    assert run_ckpt_process("verify", src, "--write-manifest", env=env).exit_code == 0
    checked = run_ckpt_process("verify", src, "--checksums", env=env)
    assert checked.exit_code == 0, checked.stderr
    assert "checksums \\u2014 " in checked.stdout, checked.stdout
    (src / "café.txt").write_text("notes")
    result = run_ckpt_process("convert", src, tmp_path / "json", "--to", "dcp", "--json", env=env)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.isascii()
    assert "café.txt" in json.loads(result.stdout)["result"]["extras"]


# -- `-` is not standard output -----------------------------------------------------------------


@pytest.mark.slow
def test_dest_dash_is_refused_rather_than_made_a_folder_named_dash(tmp_path: Path) -> None:
    """`ckpt convert model.pt - --to safetensors | aws s3 cp - s3://…`: `-` reads as stdout in
    a shell, but ckpt made a folder named `-` in the working directory and printed its report
    down the pipe, exit 0. DEST `-` is refused (exit 2, nothing written); `./-` still names
    such a folder on purpose."""

    import torch

    torch.save({"w": torch.zeros(4)}, tmp_path / "model.pt")
    for args in (
        ["convert", "model.pt", "-", "--to", "safetensors"],
        ["reshard", "model.pt", "-", "--max-shard-size", "1KB"],
    ):
        result = run_ckpt_process(*args, "--json", cwd=tmp_path)
        assert result.exit_code == 2, result.stdout
        error = result.json["error"]
        assert error["path"] == "-" and "standard output" in error["problem"], error
        assert "./-" in error["fix"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    meant = run_ckpt_process("convert", "model.pt", "./-", "--to", "safetensors", cwd=tmp_path)
    assert meant.exit_code == 0, meant.stderr
    assert (tmp_path / "-" / "model.safetensors").is_file()


def test_a_format_fix_names_the_option_the_command_takes(tmp_path: Path) -> None:
    """`diff` reads each side with --format-a / --format-b, yet a side it could not read as
    told (or a folder of two formats) said "pass --format safetensors", which diff refuses as
    no such option; `protect`, which takes no --format, said the same. Each names what works."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(2, 2)}, model / "model.safetensors")
    both = tmp_path / "both"
    assert run_ckpt("convert", model, both, "--to", "dcp").exit_code == 0
    save_file({"w": torch.ones(2, 2)}, both / "model.safetensors")  # a second format beside

    wrong = run_ckpt("diff", model, model, "--format-a", "dcp")
    assert wrong.exit_code == 4
    assert "--format-a safetensors" in wrong.stderr and "--format " not in wrong.stderr
    assert run_ckpt("diff", model, model, "--format-a", "safetensors").exit_code == 0

    for side, args in (("--format-a", [both, model]), ("--format-b", [model, both])):
        told = run_ckpt("diff", *args, "--json")
        assert told.exit_code == 4
        fix = told.json["error"]["fix"]
        assert fix.startswith(f"Pass {side} to say which one to read"), fix
        assert run_ckpt("diff", *args, side, "safetensors").exit_code == 0

    protect = run_ckpt("protect", both, "--dry-run")
    assert protect.exit_code == 4
    assert "move the other format's files out of the folder" in protect.stderr


def test_a_file_read_as_another_format_is_named_for_what_it_is(tmp_path: Path) -> None:
    """`--format gguf` on a torch.save file said the file was "truncated or corrupt; download
    it again", and `--format dcp` on any file read the folder around it, every .distcp file
    below it counted: "has 4 .distcp file(s) but no .metadata: the save looks interrupted".
    Each now says the file is not that format (what it is, where known), as safetensors and
    torch do, with the fix that works: leave --format out."""
    import torch

    weights = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, weights)
    save = tmp_path / "step-1"  # a DCP save beside it, whose .distcp files are not the file's
    assert run_ckpt("convert", weights, save, "--to", "dcp").exit_code == 0
    for fmt, said in (("gguf", "is not a GGUF file: it is a ZIP archive"), ("dcp", "is not a DCP")):
        result = run_ckpt("inspect", weights, "--format", fmt, "--json")
        assert result.exit_code == 4, result.stdout + result.stderr
        error = result.json["error"]
        assert error["path"] == str(weights) and said in error["problem"], error
        assert "download it again" not in error["message"] and "interrupted" not in error["problem"]
        assert "Leave out --format" in error["fix"] or "pass --format" in error["fix"]
    assert run_ckpt("inspect", weights).exit_code == 0


def test_latest_with_json_still_says_on_stderr_why_there_is_none(tmp_path: Path) -> None:
    """With --json, errors still go to stderr (docs/json-output.md), and every other exit 3
    did; `ckpt latest out/ --json` finding no complete checkpoint said nothing there, so a
    job log showed a failed resume script without its reason. The problems `verify` lists
    (exit 1) are its report, and stay in the envelope alone."""
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    result = run_ckpt("latest", run_dir, "--json")
    assert result.exit_code == 3
    assert result.json["error"]["code"] == "no_checkpoint"
    assert result.stderr.startswith("ckpt latest: error: ") and str(run_dir) in result.stderr
    assert result.stderr.count("\n") == 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    verified = run_ckpt("verify", bad, "--json")
    assert verified.exit_code == 1 and verified.stderr == ""
