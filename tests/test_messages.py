"""Messages and option effects a user meets first (issue #13): what a file is when it is not a
checkpoint, options that would do nothing, --dry-run, Hub habits, what "parameters" counts."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from .conftest import run_ckpt
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .run_fixtures import trainer_checkpoint


def _model(path: Path, n: int = 6) -> dict[str, object]:
    import torch
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.weight": torch.full((16, 4), float(i)) for i in range(n)}
    save_file(state, path)
    return dict(state)


# -- detection: say what the file is ----------------------------------------------------------


def test_a_text_file_named_fake_pt_is_called_a_text_file(tmp_path: Path) -> None:
    (tmp_path / "fake.pt").write_text("this is not a checkpoint\n")
    result = run_ckpt("inspect", tmp_path / "fake.pt")
    assert result.exit_code == 4
    assert "is not a torch.save file: it is a text file" in result.stderr
    assert "'this is not a checkpoint'" in result.stderr
    assert "(101)" not in result.stderr and "544502645" not in result.stderr


def test_a_text_file_named_safetensors_is_not_an_absurd_header(tmp_path: Path) -> None:
    (tmp_path / ".safetensors").write_text("hello world, this is text\n")
    result = run_ckpt("inspect", tmp_path / ".safetensors")
    assert result.exit_code == 4
    assert "is not a safetensors file: it is a text file" in result.stderr
    assert "absurd" not in result.stderr
    (tmp_path / "empty.safetensors").write_bytes(b"")
    empty = run_ckpt("inspect", tmp_path / "empty.safetensors")
    assert empty.exit_code == 4 and "it is an empty file" in empty.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "doctor", "convert"])
def test_a_folder_without_a_checkpoint_says_what_it_holds_not_pass_format(
    tmp_path: Path, command: str
) -> None:
    """An empty folder, or one of notes, is no checkpoint: every command says so, lists what the
    folder holds and points at a checkpoint folder; `--format` cannot read a folder without its
    files, so it is not offered."""
    empty = tmp_path / "empty"
    empty.mkdir()
    notes = tmp_path / "notes"
    (notes / "logs").mkdir(parents=True)
    (notes / "README.txt").write_text("run notes\n")
    (notes / "logs" / "train.log").write_text("loss 1.0\n")
    for folder, holds in ((empty, "it is empty"), (notes, "it holds README.txt, logs/")):
        extra = [str(tmp_path / f"out-{folder.name}"), "--to", "torch"]
        args = [command, str(folder), *(extra if command == "convert" else [])]
        result = run_ckpt(*args)
        assert result.exit_code == 3, result.stderr  # not found: nothing there to read
        assert f"{folder}: holds no checkpoint files" in result.stderr
        assert holds in result.stderr
        assert "Point at the folder the checkpoint was saved to" in result.stderr
        assert "or pass --format" not in result.stderr
        assert not (tmp_path / f"out-{folder.name}").exists()


#: every command that reads a checkpoint, or a run folder it must find one in, with SRC an
#: empty folder (`{empty}`) and the scratch folder's other paths (`{tmp}`)
_ON_AN_EMPTY_FOLDER = {
    "inspect": ["inspect", "{empty}"],
    "verify": ["verify", "{empty}"],
    "doctor": ["doctor", "{empty}"],
    "convert": ["convert", "{empty}", "{tmp}/out", "--to", "safetensors"],
    "reshard": ["reshard", "{empty}", "{tmp}/out", "--max-shard-size", "1GB"],
    "diff": ["diff", "{empty}", "{empty}"],
    "merge": ["merge", "{empty}", "{tmp}/adapter", "{tmp}/out"],
    "latest": ["latest", "{empty}"],
    "protect": ["protect", "{empty}"],
    "repair": ["repair", "{empty}"],
}


@pytest.mark.parametrize("command", sorted(_ON_AN_EMPTY_FOLDER))
def test_every_command_exits_3_on_an_empty_folder(tmp_path: Path, command: str) -> None:
    """Readers (inspect, verify...) exited 4 ("bad checkpoint") on an empty folder while
    protect, repair and latest exited 3: the exit-code table says 3 is "not found" and 4 a
    checkpoint that is there and bad. A folder holding no checkpoint is the first: every
    command exits 3 with the one error code `no_checkpoint`, names the folder and writes
    nothing."""
    empty = tmp_path / "empty"
    empty.mkdir()
    adapter = tmp_path / "adapter"  # a real adapter's files, so only BASE is missing
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q"]})
    )
    import torch
    from safetensors.torch import save_file

    save_file(
        {"base_model.model.q.lora_A.weight": torch.zeros(4, 4)},
        adapter / "adapter_model.safetensors",
    )
    args = [a.format(empty=empty, tmp=tmp_path) for a in _ON_AN_EMPTY_FOLDER[command]]
    result = run_ckpt(*args, "--json")
    assert result.exit_code == 3, result.stdout + result.stderr
    error = result.json["error"]
    assert error["code"] == "no_checkpoint" and error["path"] == str(empty), error
    assert error["fix"]
    assert not (tmp_path / "out").exists()
    assert list(empty.iterdir()) == []


def test_a_file_of_another_suffix_names_the_suffixes_and_where_format_helps(
    tmp_path: Path,
) -> None:
    """A safetensors file saved as `weights.bin2`: every command said "pass --format", which
    doctor and merge do not have. The error lists the suffixes formats are told by and the
    commands whose --format reads it; inspect --format safetensors does."""
    _model(tmp_path / "weights.bin2")
    for args in (["inspect"], ["doctor"]):
        result = run_ckpt(*args, tmp_path / "weights.bin2")
        assert result.exit_code == 4, result.stderr
        assert "none of the suffixes a format is told by (.safetensors" in result.stderr
        assert "--format where the command has one (inspect, verify" in result.stderr
    read = run_ckpt("inspect", tmp_path / "weights.bin2", "--format", "safetensors")
    assert read.exit_code == 0, read.stderr


@pytest.mark.parametrize(
    "header",
    [
        b"{not json",
        b"[1, 2]",
        b'{"x": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}}',
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}',
        b'{"x": 7}',
        b'{"__metadata__": {"a": 1}}',
    ],
)
def test_every_unreadable_safetensors_header_says_what_to_do(tmp_path: Path, header: bytes) -> None:
    """Each header flaw names the file, what is wrong and the fix (an invalid JSON header and
    a negative dimension said only the first two)."""
    import struct

    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    result = run_ckpt("inspect", path)
    assert result.exit_code == 4
    assert str(path) in result.stderr
    assert "write or fetch the file again" in result.stderr, result.stderr


def test_format_dcp_on_a_safetensors_folder_is_not_an_interrupted_save(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    _model(tmp_path / "hf" / "model.safetensors")
    result = run_ckpt("inspect", tmp_path / "hf", "--format", "dcp")
    assert result.exit_code == 4
    assert "is not a DCP checkpoint" in result.stderr and ".safetensors files" in result.stderr
    assert "interrupted" not in result.stderr
    assert "--format safetensors" in result.stderr


# -- options with no effect are errors or warnings ---------------------------------------------


def test_a_dest_suffix_contradicting_to_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    _model(tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert", tmp_path / "m.safetensors", tmp_path / "x.safetensors", "--to", "torch"
    )
    assert result.exit_code == 2
    assert "x.pt" in result.stderr and "--to safetensors" in result.stderr
    assert not (tmp_path / "x.safetensors").exists()  # 0.1.0 made a folder of that name
    ok = run_ckpt("convert", tmp_path / "m.safetensors", tmp_path / "x.pt", "--to", "torch")
    assert ok.exit_code == 0 and (tmp_path / "x.pt").is_file()


def test_a_dest_in_a_folder_that_does_not_exist_is_not_found_and_creates_nothing(
    tmp_path: Path,
) -> None:
    """A mistyped parent folder of DEST is a path that does not exist (exit 3, as a missing
    SRC is), not a usage error (exit 2): the command line itself was well formed."""
    _model(tmp_path / "m.safetensors")
    dest = tmp_path / "no-such-folder" / "out.safetensors"
    result = run_ckpt("convert", tmp_path / "m.safetensors", dest, "--to", "safetensors")
    assert result.exit_code == 3, result.stderr
    assert "no-such-folder" in result.stderr and "does not exist" in result.stderr
    assert not dest.parent.exists()


def test_verify_algo_without_a_manifest_operation_is_a_usage_error(tmp_path: Path) -> None:
    _model(tmp_path / "m.safetensors")
    result = run_ckpt("verify", tmp_path / "m.safetensors", "--algo", "sha256", "--json")
    assert result.exit_code == 2
    assert "--algo sha256 applies to --write-manifest" in result.json["error"]["message"]
    (tmp_path / "d").mkdir()
    _model(tmp_path / "d" / "model.safetensors")
    written = run_ckpt("verify", tmp_path / "d", "--write-manifest", "--algo", "sha256")
    assert written.exit_code == 0, written.stderr


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--manifest", "elsewhere.json"], "--manifest elsewhere.json names the manifest of"),
        (["--force"], "--force applies to --write-manifest only"),
    ],
)
def test_verify_options_that_would_check_nothing_are_usage_errors(
    tmp_path: Path, options: list[str], said: str
) -> None:
    """`verify --manifest M` without `--checksums` used to check nothing and say OK, exit 0:
    a false pass for a user who expected the manifest to be checked."""
    _model(tmp_path / "m.safetensors")
    result = run_ckpt("verify", tmp_path / "m.safetensors", *options, "--json")
    assert result.exit_code == 2, result.stdout
    assert said in result.json["error"]["message"] and result.json["error"]["fix"]
    assert not (tmp_path / "elsewhere.json").exists()


def test_a_rename_rule_that_matches_nothing_warns(tmp_path: Path) -> None:
    from safetensors import safe_open

    _model(tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "o.safetensors",
        "--to",
        "safetensors",
        "--rename",
        "model.=",
        "--rename",
        "transformer.h.=layers.",
    )
    assert result.exit_code == 0, result.stderr
    assert "--rename transformer.h.=layers. matches no entry" in result.stderr
    assert "model.=" not in result.stderr  # the rule that applied is not warned about
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        names = list(f.keys())
        assert "layers.0.weight" in names
    quiet = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "q.safetensors",
        "--to",
        "safetensors",
        "--rename",
        "nothing.=x.",
        "--json",
    )
    assert quiet.json["result"]["warnings"] == [
        "--rename nothing.=x. matches no entry (names are matched after --select; see "
        "`ckpt inspect --list`)"
    ]


# -- --dry-run -----------------------------------------------------------------------------------


def test_convert_dry_run_predicts_the_files_and_writes_nothing(tmp_path: Path) -> None:
    _model(tmp_path / "m.safetensors", n=12)
    dest = tmp_path / "sharded"
    args = (
        "convert",
        tmp_path / "m.safetensors",
        dest,
        "--to",
        "safetensors",
        "--max-shard-size",
        "1KB",
    )
    plan = run_ckpt(*args, "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert not dest.exists()
    human = run_ckpt(*args, "-n")
    assert "nothing was written (--dry-run)" in human.stdout and not dest.exists()
    assert "model-00001-of-" in human.stdout
    done = run_ckpt(*args)
    assert done.exit_code == 0
    planned = {f["path"]: f["size"] for f in plan.json["result"]["files"]}
    written = {p.name: p.stat().st_size for p in dest.iterdir()}
    assert set(planned) == set(written)
    for name, size in planned.items():
        if size is not None:  # shard sizes are exact; the index is sized when written
            assert written[name] == size, name
    assert len(plan.json["result"]["entries"]) == 12


def test_reshard_dry_run_lists_files_and_writes_nothing(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    _model(tmp_path / "m.safetensors", n=12)
    plan = run_ckpt(
        "reshard",
        tmp_path / "m.safetensors",
        tmp_path / "r",
        "--max-shard-size",
        "2KB",
        "--dry-run",
        "--json",
    )
    assert plan.exit_code == 0, plan.stderr
    assert not (tmp_path / "r").exists()
    real = run_ckpt(
        "reshard", tmp_path / "m.safetensors", tmp_path / "r", "--max-shard-size", "2KB", "--json"
    )
    assert real.exit_code == 0, real.stderr
    planned = {f["path"]: f["size"] for f in plan.json["result"]["files"] if f["size"] is not None}
    written = {p.name: p.stat().st_size for p in (tmp_path / "r").iterdir()}
    assert planned and all(written[name] == size for name, size in planned.items())

    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    world = run_ckpt(
        "reshard", tmp_path / "dcp", tmp_path / "d4", "--world-size", "4", "--dry-run", "--json"
    )
    assert world.exit_code == 0, world.stderr
    assert not (tmp_path / "d4").exists()
    names = [f["path"] for f in world.json["result"]["files"]]
    # in the real run's order, the commit marker first; sizes are decided as the containers
    # are written (the data bytes alone would understate every file)
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert all(f["size"] is None for f in world.json["result"]["files"])
    assert sum(f["entries"] for f in world.json["result"]["files"]) == 2 * 4


# -- Hub habits ---------------------------------------------------------------------------------


@pytest.fixture
def published(hub: TestHub, tmp_path: Path) -> TestHub:
    import torch

    state = {f"model.layers.{i}.weight": torch.full((8, 8), float(i)) for i in range(3)}
    publish_model(hub, "org/model", tmp_path / "src", state)
    return hub


def test_download_include_exclude_are_file_globs_as_in_hf_download(
    published: TestHub, tmp_path: Path
) -> None:
    only_config = run_ckpt(
        "download", "hf://org/model", "--local-dir", tmp_path / "a", "--include", "config.json"
    )
    assert only_config.exit_code == 0, only_config.stderr
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert "config.json" in files and "tokenizer.json" not in files
    assert "model.safetensors" in files  # weights are chosen by tensor, never by file glob
    no_tok = run_ckpt("download", "hf://org/model", tmp_path / "b", "--exclude", "tokenizer.*")
    assert no_tok.exit_code == 0
    assert (
        not (tmp_path / "b" / "tokenizer.json").exists()
        and (tmp_path / "b" / "config.json").exists()
    )
    # a tensor glob passed as a file glob (0.1.0's --exclude) matches no file: a warning says so
    stray = run_ckpt(
        "download", "hf://org/model", tmp_path / "c", "--exclude", "model.layers.0.*", "--json"
    )
    assert stray.exit_code == 0
    [warning] = stray.json["result"]["warnings"]
    assert "matches no file" in warning and "--filter-out" in warning
    both = run_ckpt("download", "hf://org/model", tmp_path / "d", "--local-dir", tmp_path / "e")
    assert both.exit_code == 2 and "two destinations" in both.stderr


def test_revision_and_repo_type_options_fold_into_the_hub_location(published: TestHub) -> None:
    pinned = run_ckpt("inspect", "hf://org/model", "--revision", "main", "--json")
    assert pinned.exit_code == 0, pinned.stderr
    assert run_ckpt("inspect", "hf://org/model@main", "--json").json["result"]["tensors"] == 3
    wrong = run_ckpt("inspect", "hf://org/model@main", "--revision", "v2")
    assert wrong.exit_code == 2 and "contradicts" in wrong.stderr
    dataset = run_ckpt("inspect", "hf://org/model", "--repo-type", "dataset", "--json")
    assert dataset.exit_code in (3, 5)  # no such dataset: it asked for datasets/org/model
    bad = run_ckpt("inspect", "hf://org/model", "--repo-type", "notebook")
    assert bad.exit_code == 2 and "model, dataset or space" in bad.stderr


def test_offline_mode_says_offline_mode_is_on(
    published: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_ckpt("inspect", "hf://org/model", "--json")
    assert result.exit_code == 5
    message = result.json["error"]["message"]
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in message
    assert "could not be reached" not in message and "cannot be reached" not in message


# -- parameters ------------------------------------------------------------------------------------


def test_parameters_count_the_model_and_optimizer_state_is_its_own_figure(tmp_path: Path) -> None:
    trainer_checkpoint(tmp_path / "checkpoint-100", 100)
    result = run_ckpt("inspect", tmp_path / "checkpoint-100", "--json")
    report = result.json["result"]
    weights = report["training"]["weights"]["parameters"]
    assert report["parameters"] == weights
    assert report["state_elements"]["optimizer"] > 0
    human = run_ckpt("inspect", tmp_path / "checkpoint-100")
    assert f"{weights} parameters" in human.stdout
    assert "state elements (not parameters): optimizer" in human.stdout
    # a plain weights file is all parameters
    _model(tmp_path / "m.safetensors")
    plain = run_ckpt("inspect", tmp_path / "m.safetensors", "--json").json["result"]
    assert plain["parameters"] == 6 * 64 and plain["state_elements"] == {}
    assert json.dumps(plain)  # the envelope stays JSON


def test_token_option_opens_a_gated_repo_and_leaves_the_environment_alone(
    hub: TestHub, tmp_path: Path
) -> None:
    import os

    import torch

    publish_model(hub, "org/gated", tmp_path / "src", {"w": torch.zeros(2)}, token="hf_secret")
    assert run_ckpt("inspect", "hf://org/gated").exit_code == 5
    result = run_ckpt("inspect", "hf://org/gated", "--token", "hf_secret", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["tensors"] == 1
    assert "HF_TOKEN" not in os.environ


def test_diff_applies_revision_to_its_hub_side(published: TestHub, tmp_path: Path) -> None:
    fetched = run_ckpt("download", "hf://org/model", tmp_path / "local")
    assert fetched.exit_code == 0, fetched.stderr
    same = run_ckpt("diff", tmp_path / "local", "hf://org/model", "--revision", "main")
    assert same.exit_code == 0, same.stdout + same.stderr


def test_a_dry_run_is_refused_where_the_real_run_would_be(tmp_path: Path) -> None:
    """`convert -n` onto an existing DEST and `protect -n` of a protected checkpoint said
    "would write" and exited 0, where the real runs are refused (exit 2)."""
    model = tmp_path / "model"
    model.mkdir()
    _model(model / "model.safetensors")
    dest = tmp_path / "out"
    assert run_ckpt("convert", model, dest, "--to", "dcp").exit_code == 0
    before = sorted(p.name for p in dest.iterdir())
    for command in (["convert", model, dest, "--to", "dcp"], ["protect", model]):
        real = run_ckpt(*command, "--json")
        if command[0] == "protect":  # the first one protects, the second is refused
            assert real.exit_code == 0, real.stdout
            real = run_ckpt(*command, "--json")
        dry = run_ckpt(*command, "--dry-run", "--json")
        assert real.exit_code == dry.exit_code == 2, (real.stdout, dry.stdout)
        assert dry.json["error"]["code"] == real.json["error"]["code"]
    assert sorted(p.name for p in dest.iterdir()) == before


#: an integer past Python's 4,300-digit limit (`json.loads` raises a plain ValueError, not a
#: JSONDecodeError) and a nesting past the recursion limit (RecursionError)
HUGE_INT = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


def test_json_a_parser_refuses_is_a_bad_input_never_a_bug_in_ckpt(tmp_path: Path) -> None:
    """Every JSON file ckpt reads (headers, indexes, configs, trainer state, metrics) that
    Python's parser refuses for a huge integer or a deep nesting was "internal error ... a bug
    in ckpt" (exit 70) in some readers: each is now reported as the bad file it is."""
    import torch
    from safetensors.torch import save_file

    header = ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,' + HUGE_INT + "]}}").encode()
    (tmp_path / "header.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 8
    )
    index = tmp_path / "index"
    index.mkdir()
    save_file({"a": torch.ones(2)}, index / "m-00001-of-00001.safetensors")
    (index / "model.safetensors.index.json").write_text(
        '{"metadata":{"total_size":'
        + HUGE_INT
        + '},"weight_map":{"a":"m-00001-of-00001.safetensors"}}'
    )
    adapters = {}
    for kind, text in (("huge", '{"r":' + HUGE_INT + ',"peft_type":"LORA"}'), ("deep", DEEP)):
        adapters[kind] = folder = tmp_path / f"adapter-{kind}"
        folder.mkdir()
        save_file(
            {"base_model.model.l.lora_A.weight": torch.ones(2, 2)},
            folder / "adapter_model.safetensors",
        )
        (folder / "adapter_config.json").write_text(text)
    config = tmp_path / "config-deep"
    config.mkdir()
    save_file({"w": torch.ones(2)}, config / "model.safetensors")
    (config / "config.json").write_text('{"x":' + DEEP + "}")
    run = tmp_path / "run"
    for step, global_step in ((2, "2"), (4, HUGE_INT)):
        save = run / f"checkpoint-{step}"
        save.mkdir(parents=True)
        save_file({"w": torch.ones(2)}, save / "model.safetensors")
        torch.save(
            {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, save / "optimizer.pt"
        )
        torch.save({"last_epoch": step}, save / "scheduler.pt")
        torch.save({"cpu": torch.random.get_rng_state()}, save / "rng_state.pth")
        (save / "trainer_state.json").write_text('{"global_step":' + global_step + "}")
        old = time.time() - 1000
        for f in save.iterdir():
            os.utime(f, (old, old))
    (run / "metrics.jsonl").write_text(
        '{"step":1,"loss":' + HUGE_INT + '}\n{"step":2,"loss":1.0}\n'
    )
    for args, codes in (
        (["verify", tmp_path / "header.safetensors"], (1,)),
        (["inspect", index], (4,)),
        (["inspect", adapters["huge"]], (0, 4)),
        (["inspect", adapters["deep"]], (0, 4)),
        (["inspect", config], (0, 4)),
        (["verify", run / "checkpoint-4"], (1, 4)),
        (["doctor", run], (0, 1, 4)),
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code in codes, (args, result.stdout)
        assert "internal error" not in result.stdout and "Traceback" not in result.stderr


def test_a_name_no_utf8_can_hold_is_a_bad_header(tmp_path: Path) -> None:
    """A tensor named `"\\ud800"` (a lone UTF-16 surrogate, which the safetensors library
    refuses) passed verify, crashed `inspect -l` and `--json` with tracebacks, and `convert`
    published a file the safetensors library could not open."""
    header = b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    src = tmp_path / "s.safetensors"
    src.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    verified = run_ckpt("verify", src, "--json")
    assert verified.exit_code == 1
    assert [p["code"] for p in verified.json["result"]["problems"]] == ["bad_header"]
    for args in (["inspect", src, "--list"], ["convert", src, tmp_path / "out", "--to", "dcp"]):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 4, result.stdout
        assert "surrogate" in result.json["error"]["message"]
    assert not (tmp_path / "out").exists()
    # a surrogate pair (an emoji) is one character, and fine
    emoji = b'{"\\ud83d\\ude00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    src.write_bytes(struct.pack("<Q", len(emoji)) + emoji + b"\0" * 8)
    assert run_ckpt("verify", src).exit_code == 0


def test_options_that_would_do_nothing_are_refused_like_their_siblings(tmp_path: Path) -> None:
    """`convert --to safetensors --dcp-serialization X`, `diff --dequantize` of unquantized
    checkpoints and `prune --mode max` (now `--higher-is-better`) without `--keep-best` were accepted without a word,
    while `--dcp-compression`, `convert --dequantize` and `--keep-top` in the same place are
    usage errors."""
    model = tmp_path / "m.safetensors"
    _model(model)
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        trainer_checkpoint(run / f"checkpoint-{step}", step)
    for args, said in (
        (
            [
                "convert",
                model,
                tmp_path / "x",
                "--to",
                "safetensors",
                "--dcp-serialization",
                "safetensors",
            ],
            "--dcp-serialization applies to --to dcp only",
        ),
        (["diff", model, model, "--dequantize"], "no quantized weight found on either side"),
        (
            ["prune", run, "--keep-last", "1", "--higher-is-better"],
            "--higher-is-better applies with --keep-best",
        ),
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 2, (args, result.stdout)
        assert said in result.json["error"]["message"] and result.json["error"]["fix"]
    assert not (tmp_path / "x").exists()
    kept = run_ckpt("prune", run, "--keep-best", "eval_loss", "--lower-is-better", "--settle", "0")
    assert kept.exit_code == 0, kept.stderr


def test_every_refusal_names_the_choices_and_a_fix(tmp_path: Path) -> None:
    """Messages that contradicted the help or themselves: `-f nope` listed other tokens than
    `--help`, `-f gguf` of a safetensors folder and `protect` of an empty folder carried no fix,
    `--to nope` left out hf / torchtitan / megatron, `--to hf` said a family "has no rule for
    0 tensor(s)", and a FIFO named `*.safetensors` was "0 bytes long … an empty file"."""
    model = tmp_path / "model"
    model.mkdir()
    _model(model / "model.safetensors")
    (tmp_path / "empty").mkdir()
    import torch

    unknown = run_ckpt("inspect", model, "-f", "nope", "--json").json["error"]
    assert "gguf" in unknown["fix"] and "hub" in unknown["fix"]
    for args in (["inspect", model, "-f", "gguf"], ["protect", tmp_path / "empty"]):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 3 and result.json["error"]["fix"], result.stdout
    target = run_ckpt("convert", model, tmp_path / "x", "--to", "nope", "--json").json["error"]
    assert all(t in target["fix"] for t in ("hf", "torchtitan", "megatron"))
    llama_like = {
        f"model.layers.0.{p}.weight": torch.zeros(4, 4)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    }
    llama_like |= {
        "model.embed_tokens.weight": torch.zeros(8, 4),
        "model.norm.weight": torch.zeros(4),
        "model.layers.0.input_layernorm.weight": torch.zeros(4),
        "model.layers.0.post_attention_layernorm.weight": torch.zeros(4),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8),
    }
    from safetensors.torch import save_file

    save_file(llama_like, tmp_path / "no-gate.safetensors")
    mapped = run_ckpt("convert", tmp_path / "no-gate.safetensors", tmp_path / "hf", "--to", "hf")
    assert mapped.exit_code == 4 and "gate_proj" in mapped.stderr, mapped.stderr
    assert "0 tensor(s)" not in mapped.stderr
    os.mkfifo(tmp_path / "pipe.safetensors")
    fifo = run_ckpt("inspect", tmp_path / "pipe.safetensors")
    assert fifo.exit_code == 4 and "FIFO" in fifo.stderr, fifo.stderr


def test_a_json_component_past_the_entry_budget_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `trainer_state.json` is flattened into one entry per value, as a torch.save dict is
    (its `log_history` is one value, however long): a 64 MiB file of other values would name
    millions. It has the torch flattening's entry budget (1,000,000; lowered here so the test
    stays small)."""
    import torch

    from ckpt_cli.formats.torch import flatten

    monkeypatch.setattr(flatten, "MAX_LEAVES", 1000)
    save = tmp_path / "checkpoint-1"
    save.mkdir()
    _model(save / "model.safetensors")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}, save / "optimizer.pt")
    rows = ",".join(['{"loss": 1.0, "step": 1}'] * 600)
    (save / "trainer_state.json").write_text(
        '{"global_step": 1, "log_history": [], "trial_params": {"runs": [' + rows + "]}}"
    )
    result = run_ckpt("verify", save, "--json")
    assert result.exit_code == 1, result.stdout
    messages = [p["message"] for p in result.json["result"]["problems"]]
    assert any("trainer_state.json" in m and "more than 1,000 values" in m for m in messages)


def test_a_symbolic_link_that_leads_nowhere_says_so(tmp_path: Path) -> None:
    """A link to a checkpoint that was moved, or two links pointing at each other: the error
    said "no such file or folder" of a name `ls` shows; it says what the link is."""
    dangling = tmp_path / "model.safetensors"
    dangling.symlink_to(tmp_path / "moved" / "model.safetensors")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")

    moved = run_ckpt("inspect", dangling, "--json").json["error"]
    looping = run_ckpt("verify", tmp_path / "a", "--json").json["error"]

    assert moved["code"] == looping["code"] == "not_found"
    assert moved["problem"] == (
        f"is a symbolic link to {tmp_path / 'moved' / 'model.safetensors'}, which does not exist"
    )
    assert "loops back on itself (ELOOP)" in looping["problem"]
    assert moved["path"] == str(dangling) and "Repair the link" in moved["fix"]


# -- corrupt and hostile files: every failure says the fix ------------------------------------


def _dcp_with_metadata(folder: Path, change: str) -> None:
    """A real `dcp.save` whose `.metadata` is then rewritten by torch's own pickler with one
    flaw (`change`): what a bad copy, a hand edit or another tool leaves behind."""
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=folder, no_dist=True)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    if change == "storage_data":
        metadata.storage_data = {"w": 1}
    elif change == "chunks":
        metadata.state_dict_metadata["w"].chunks = None
    elif change == "file_name":
        for info in metadata.storage_data.values():
            info.relative_path = 7
    elif change == "key":
        metadata.state_dict_metadata[3] = metadata.state_dict_metadata.pop("w")
    buffer = io.BytesIO()
    if change == "persistent_id":

        class WithIds(pickle.Pickler):
            def persistent_id(self, obj: object) -> str | None:
                return "w" if obj == "w" else None

        WithIds(buffer, protocol=2).dump(metadata)
    else:
        pickle.dump(metadata, buffer)
    (folder / ".metadata").write_bytes(buffer.getvalue())


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("storage_data", "has a malformed storage_data entry"),
        ("chunks", "tensor 'w' has no chunk list"),
        ("file_name", "entry 'w' has no file name"),
        ("key", "has a state_dict_metadata key that is not a string"),
        ("persistent_id", "is a pickle with persistent ids"),
    ],
)
def test_a_dcp_metadata_that_is_not_what_dcp_writes_says_what_to_do(
    tmp_path: Path, change: str, problem: str
) -> None:
    """A `.metadata` that unpickles but is malformed named the file and the flaw, with no fix
    (`error.fix` was null in the JSON envelope)."""
    folder = tmp_path / "step-100"
    _dcp_with_metadata(folder, change)
    result = run_ckpt("inspect", folder, "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["path"] == str(folder / ".metadata")
    assert error["problem"].startswith(problem)
    assert isinstance(error["fix"], str) and error["fix"].strip()
    assert error["fix"] in error["message"]


def test_a_shard_index_without_a_weight_map_says_what_to_do(tmp_path: Path) -> None:
    """`model.safetensors.index.json` whose weight_map is a list: the error had no fix."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": ["a"]}))
    result = run_ckpt("inspect", tmp_path, "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["path"] == str(index)
    assert "has no valid weight_map" in error["problem"]
    assert "fetch the index again" in error["fix"]


def test_a_checksum_manifest_of_an_unknown_algorithm_says_what_to_do(tmp_path: Path) -> None:
    """A manifest naming a digest this ckpt does not compute (a newer release's, or an edit):
    `verify --checksums` named it with no fix."""
    _model(tmp_path / "model.safetensors")
    assert run_ckpt("verify", tmp_path, "--write-manifest").exit_code == 0
    manifest = tmp_path / "ckpt-manifest.json"
    record = json.loads(manifest.read_text())
    record["algorithm"] = "sha3_512"
    manifest.write_text(json.dumps(record))
    result = run_ckpt("verify", tmp_path, "--checksums", "--json")
    assert result.exit_code == 4
    error = result.json["error"]
    assert error["path"] == str(manifest)
    assert error["problem"] == "records digests of unknown algorithm 'sha3_512'"
    assert "sha256" in error["fix"] and "--write-manifest --force" in error["fix"]


def test_a_shard_index_total_size_that_is_no_byte_count_says_what_to_do(tmp_path: Path) -> None:
    """`verify` reported `metadata.total_size "abc"` naming the index and the flaw only."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {"a": "model-00001-of-00001.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": "abc"}, "weight_map": weight_map}))
    result = run_ckpt("verify", tmp_path, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "bad_index" and problem["file"] == str(index)
    assert (
        problem["message"] == f"{index}: has metadata.total_size 'abc', which is not a byte count"
    )
    assert problem["fix"] == (
        "Write the index again (save_pretrained writes the shards' byte count there)."
    )


def test_a_truncated_distcp_file_says_what_to_do_in_verify(tmp_path: Path) -> None:
    """`verify` of a DCP save whose data file was cut short (a copy that stopped): the problem
    line said "the file is truncated" and no fix."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step-100"
    dcp.save({"w": torch.ones(16, 16)}, checkpoint_id=folder, no_dist=True)
    (data,) = folder.glob("*.distcp")
    os.truncate(data, data.stat().st_size // 2)
    result = run_ckpt("verify", folder, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "dcp_truncated" and problem["file"] == str(data)
    assert problem["message"].endswith("the file is truncated")
    assert problem["fix"].startswith("Copy the data file again")
    assert "`ckpt repair`" in problem["fix"]
    human = run_ckpt("verify", folder).stdout
    assert "the file is truncated. Copy the data file again" in human


def test_a_file_that_no_longer_matches_its_manifest_says_what_to_do(tmp_path: Path) -> None:
    """`verify --checksums` after a byte of a shard changed, and with a file the manifest does
    not record: the lines said what differs, not what to do."""
    _model(tmp_path / "model.safetensors")
    assert run_ckpt("verify", tmp_path, "--write-manifest").exit_code == 0
    with open(tmp_path / "model.safetensors", "r+b") as fh:
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\xff\xff\xff\xff")
    (tmp_path / "notes.txt").write_text("added later\n")
    result = run_ckpt("verify", tmp_path, "--checksums", "--json")
    assert result.exit_code == 1
    found = {p["code"]: p for p in result.json["result"]["problems"]}
    assert found["checksum_mismatch"]["message"].endswith("(the content changed or is corrupt)")
    assert found["checksum_mismatch"]["fix"].startswith("Restore it from a good copy")
    assert "`ckpt repair`" in found["checksum_mismatch"]["fix"]
    assert "write the manifest again (`--write-manifest --force`)" in found["unlisted_file"]["fix"]
    human = run_ckpt("verify", tmp_path, "--checksums").stdout
    assert "(the content changed or is corrupt). Restore it from a good copy" in human
