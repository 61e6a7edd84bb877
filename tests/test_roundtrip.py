"""Round trips users make with real Trainer, accelerate and `save_pretrained` outputs: every one
is lossless, and `ckpt` judges it right (issue #12)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .conftest import REPO, run_ckpt, run_ckpt_process
from .hub_fixtures import publish_model
from .hub_server import TestHub

# every test here judges with transformers' own loaders: without the frameworks extra the
# module is skipped, with the reason, instead of breaking collection
transformers = pytest.importorskip(
    "transformers", reason="needs the frameworks extra (transformers): `make test` installs it"
)
LlamaForCausalLM = transformers.LlamaForCausalLM
safe_globals = pytest.importorskip("transformers.trainer_pt_utils").safe_globals

# --------------------------------------------------------------------------- diff of RNG states


def test_a_bf16_cast_loads_back_as_bf16_with_from_pretrained(
    real_hf_model: Path, tmp_path: Path
) -> None:
    """`from_pretrained` loads in the dtype config.json names: the `--dtype bf16` copy of a
    model `save_pretrained` wrote came back as a float32 model while its config said float32.
    It loads as bf16 now, with the same values as transformers' own cast."""
    out = tmp_path / "bf16"
    result = run_ckpt("convert", real_hf_model, out, "--to", "safetensors", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    want = LlamaForCausalLM.from_pretrained(real_hf_model).to(torch.bfloat16).state_dict()
    got = model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("run", "step"),
    [("real_trainer_run", "checkpoint-4"), ("real_accelerate_run", "step-4")],
)
def test_restart_recipe_holds_for_trainer_and_accelerate_runs(
    request: pytest.FixtureRequest, run: str, step: str
) -> None:
    folder: Path = request.getfixturevalue(run)
    straight, resumed = folder / "straight" / step, folder / "resumed" / step
    # a checkpoint is identical to itself, numpy RNG states (MT19937 tuples) included
    same = run_ckpt("diff", straight, straight, "--json")
    assert same.exit_code == 0, same.stdout
    assert same.json["result"]["identical"] is True
    rng_names = [n for n in _names(straight) if n.startswith("rng.") and "numpy" in n]
    assert rng_names, "the framework saved a numpy RNG state"
    # the resumed run ends where the straight one did, bit for bit
    result = run_ckpt("diff", straight, resumed)
    assert result.exit_code == 0, result.stdout
    assert result.stdout.startswith("IDENTICAL")
    # and a checkpoint two steps earlier is told apart, RNG aside
    earlier = sorted((folder / "straight").iterdir())[0]
    other = run_ckpt("diff", earlier, straight, "--json")
    assert other.exit_code == 1 and other.json["result"]["components"]["model"] > 0


def _names(src: Path) -> list[str]:
    result = run_ckpt("inspect", src, "--json", "--list")
    assert result.exit_code == 0, result.stdout
    return [e["name"] for e in result.json["result"]["entries"]]


def test_numpy_arrays_compare_by_dtype_shape_and_bytes_inside_containers(tmp_path: Path) -> None:
    state = np.random.RandomState(3).get_state()
    # a tuple holding no tensor is one value: compared recursively, not flattened
    nested = {"rng": {"numpy": state, "streams": (state, [{"inner": np.arange(4)}])}, "step": 3}
    torch.save(nested, tmp_path / "a.pt")
    torch.save(nested, tmp_path / "b.pt")
    assert run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt").exit_code == 0
    streams = (state, [{"inner": np.arange(1, 5)}])
    changed = {**nested, "rng": {**nested["rng"], "streams": streams}}
    torch.save(changed, tmp_path / "c.pt")
    result = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "c.pt", "--json")
    assert result.exit_code == 1
    assert [d["name"] for d in result.json["result"]["differences"]] == ["rng.streams"]
    # same bytes, other dtype: different
    torch.save({**nested, "x": np.zeros(2, dtype=np.int32)}, tmp_path / "d.pt")
    torch.save({**nested, "x": np.zeros(2, dtype=np.float32)}, tmp_path / "e.pt")
    assert run_ckpt("diff", tmp_path / "d.pt", tmp_path / "e.pt").exit_code == 1


# --------------------------------------------------------------------------- JSON components


def test_trainer_folder_converted_to_torch_diffs_identical_to_its_source(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    src = real_trainer_run / "straight" / "checkpoint-4"
    dest = tmp_path / "state.pt"
    assert run_ckpt("convert", src, dest, "--to", "torch").exit_code == 0
    result = run_ckpt("diff", src, dest, "--json")
    assert result.exit_code == 0, result.stdout
    names = _names(src)
    # trainer_state.json is flattened like the torch.save dict it becomes; its log is one value
    assert "trainer_state.global_step" in names and "trainer_state.log_history" in names
    assert not any(name.startswith("trainer_state.log_history.") for name in names)
    with safe_globals():  # how the Trainer itself loads its numpy RNG state
        saved = torch.load(dest, weights_only=True)
    original = json.loads((src / "trainer_state.json").read_text())
    assert saved["trainer_state"]["log_history"] == original["log_history"]
    assert saved["trainer_state"]["global_step"] == 4


def test_trainer_state_copy_with_changed_log_history_is_told_apart(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    src = real_trainer_run / "straight" / "checkpoint-4"
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(src, copy)
    state = json.loads((copy / "trainer_state.json").read_text())
    state["log_history"][1]["loss"] = 99.0
    (copy / "trainer_state.json").write_text(json.dumps(state))
    result = run_ckpt("diff", src, copy, "--json")
    assert result.exit_code == 1
    assert [d["name"] for d in result.json["result"]["differences"]] == [
        "trainer_state.log_history"
    ]


# --------------------------------------------------------------------------- diff tolerance, select


def test_fp32_model_against_its_bf16_cast_within_tolerance(
    real_hf_model: Path, tmp_path: Path
) -> None:
    cast = tmp_path / "model-bf16.safetensors"
    made = run_ckpt("convert", real_hf_model, cast, "--to", "safetensors", "--dtype", "bf16")
    assert made.exit_code == 0, made.stderr
    tol = ("--atol", "1e-2", "--rtol", "1e-2")
    # the dtype change is reported, values are within tolerance: the verdict says both
    strict = run_ckpt("diff", real_hf_model, cast, *tol, "--json")
    assert strict.exit_code == 1
    report = strict.json["result"]
    assert report["dtype_changes"] == report["compared"] == 21
    assert {d["status"] for d in report["differences"]} == {"dtype"}
    assert all(d["outside_tolerance"] == 0 for d in report["differences"])
    human = run_ckpt("diff", real_hf_model, cast, *tol)
    assert "changed dtype" in human.stdout and "--ignore-dtype" in human.stdout
    # the help example: with --ignore-dtype the cast is accepted
    accepted = run_ckpt("diff", real_hf_model, cast, *tol, "--ignore-dtype")
    assert accepted.exit_code == 0, accepted.stdout
    assert accepted.stdout.startswith("IDENTICAL") and "dtype change" in accepted.stdout
    # a tolerance too tight for bf16 still fails, dtype ignored or not
    tight = run_ckpt("diff", real_hf_model, cast, "--atol", "1e-7", "--ignore-dtype", "--json")
    assert tight.exit_code == 1
    assert {d["status"] for d in tight.json["result"]["differences"]} == {"values"}
    # and the bf16 values really are those the reader casts back
    with safe_open(cast, "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_select_model_lines_a_trainer_checkpoint_up_with_its_exported_weights(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    step = real_trainer_run / "straight" / "checkpoint-4"
    hf = tmp_path / "hf"
    made = run_ckpt("convert", step, hf, "--to", "safetensors", "--select", "model")
    assert made.exit_code == 0, made.stderr
    # the causal LM's own keys start with `model.`: the exported side is compared whole
    result = run_ckpt("diff", step, hf, "--select", "model", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["identical"] and report["compared"] == 21
    assert report["select_applied"] == {"a": True, "b": False}
    assert run_ckpt("diff", hf, step, "--select", "model").stdout.startswith("IDENTICAL")
    # the export is what from_pretrained loads, with the Trainer's own weights
    for name in ("config.json", "generation_config.json"):
        assert (hf / name).is_file()
    model = LlamaForCausalLM.from_pretrained(hf)
    with safe_open(step / "model.safetensors", "pt") as f:
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, f.get_tensor(name)), name


# --------------------------------------------------------------------------- extras, reshard


def _same_model(folder: Path, reference: Path) -> None:
    """`from_pretrained(folder)` builds the reference's model: same config, same weights."""
    model = LlamaForCausalLM.from_pretrained(folder)
    ref = LlamaForCausalLM.from_pretrained(reference)
    config, expected = model.config.to_dict(), ref.config.to_dict()
    config.pop("_name_or_path"), expected.pop("_name_or_path")
    assert config == expected
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_convert_and_reshard_carry_the_model_folder_files(
    real_hf_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    extras = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    sharded = tmp_path / "sharded"
    result = run_ckpt("reshard", real_hf_model, sharded, "--max-shard-size", "10KB", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["extras"] == extras
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    _same_model(sharded, real_hf_model)
    assert LlamaForCausalLM.from_pretrained(sharded).generation_config.max_new_tokens == 7
    tokenizer = AutoTokenizer.from_pretrained(sharded)
    assert tokenizer("w3 w5")["input_ids"] == [3, 5]
    # convert to torch shards, listed in the human report too
    bins = tmp_path / "bins"
    human = run_ckpt("convert", sharded, bins, "--to", "torch")
    assert human.exit_code == 0, human.stderr
    assert "carried: " + ", ".join(extras) in " ".join(human.stdout.split())
    _same_model(bins, real_hf_model)
    # --no-extras leaves them out: the folder then holds only weights
    bare = tmp_path / "bare"
    assert (
        run_ckpt("convert", real_hf_model, bare, "--to", "safetensors", "--no-extras").exit_code
        == 0
    )
    assert sorted(p.name for p in bare.iterdir()) == ["model.safetensors"]
    bare2 = tmp_path / "bare2"
    assert (
        run_ckpt(
            "reshard", real_hf_model, bare2, "--max-shard-size", "10KB", "--no-extras"
        ).exit_code
        == 0
    )
    assert not (bare2 / "config.json").exists()


def test_reshard_by_size_of_an_accelerate_save_is_refused_since_accelerate_could_not_load_it(
    real_accelerate_run: Path, tmp_path: Path
) -> None:
    """accelerate's `load_state` reads one `model{_i}.safetensors` per model, never shards
    with an index: the resharded copy failed to load, and with two prepared models their
    weights were regrouped into one set of `model-*` shards (`model_1.weight` became
    `model.weight`) while `verify --resumable` said OK."""
    src = real_accelerate_run / "straight" / "step-4"
    out = tmp_path / "resharded"
    for dry in ([], ["--dry-run"]):
        result = run_ckpt("reshard", src, out, "--max-shard-size", "10KB", *dry, "--json")
        assert result.exit_code == 2, result.stdout
        assert "accelerate loads one file per model" in result.json["error"]["message"]
        assert "--select model" in result.json["error"]["fix"]
        assert not out.exists()


@pytest.mark.parametrize(("run", "step"), [("real_trainer_run", "checkpoint-4")])
def test_reshard_of_a_training_folder_carries_every_component(
    request: pytest.FixtureRequest, run: str, step: str, tmp_path: Path
) -> None:
    src: Path = request.getfixturevalue(run) / "straight" / step
    out = tmp_path / "resharded"
    result = run_ckpt("reshard", src, out, "--max-shard-size", "10KB", "--json")
    assert result.exit_code == 0, result.stdout
    carried = result.json["result"]["carried"]
    assert any(n.startswith(("optimizer.", "random_states", "rng_state")) for n in carried)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    # nothing lost: every entry (optimizer, scheduler, RNG, trainer state) equals its source
    same = run_ckpt("diff", src, out)
    assert same.exit_code == 0 and same.stdout.startswith("IDENTICAL"), same.stdout
    # and what verify --resumable says of the source it says of the output
    before = run_ckpt("verify", "--resumable", src, "--json")
    after = run_ckpt("verify", "--resumable", out, "--json")
    assert after.exit_code == before.exit_code
    codes = [{p["code"] for p in r.json["result"]["problems"]} for r in (before, after)]
    assert codes[0] == codes[1]
    if run == "real_trainer_run":
        _same_model(out, src)


@pytest.mark.parametrize(
    ("run", "step", "optimizer"),
    [
        ("real_trainer_run", "checkpoint-4", "optimizer.pt"),
        ("real_accelerate_run", "step-4", "optimizer.bin"),
    ],
)
def test_a_training_folder_converted_to_dcp_keeps_its_optimizer_shaped_for_torch(
    request: pytest.FixtureRequest, run: str, step: str, optimizer: str, tmp_path: Path
) -> None:
    """`convert CHECKPOINT --to dcp` of a Trainer or accelerate save, read back with torch's own
    `dcp_to_torch_save`: the optimizer is the dict the framework saved, `param_groups` still a
    list (DCP names the int keys of `state` by strings, as `dcp.save` does). ckpt recorded
    every path split at its dots, and param_groups came back as a dict keyed "0"."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src: Path = request.getfixturevalue(run) / "straight" / step
    out = tmp_path / "dcp"
    result = run_ckpt("convert", src, out, "--to", "dcp")
    assert result.exit_code == 0, result.stderr
    dcp_to_torch_save(str(out), str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=False)["optimizer"]
    saved = torch.load(src / optimizer, weights_only=True)
    assert isinstance(back["param_groups"], list)
    assert back["param_groups"] == saved["param_groups"]
    assert sorted(back["state"]) == sorted(str(key) for key in saved["state"])
    for key, states in saved["state"].items():
        assert states.keys() == back["state"][str(key)].keys()
        for name, value in states.items():
            assert torch.equal(back["state"][str(key)][name], value), (key, name)


def test_dcp_with_safetensors_serialization_warns_at_write_time(
    real_hf_model: Path, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    out = tmp_path / "dcp"
    result = run_ckpt(
        "convert", real_hf_model, out, "--to", "dcp", "--dcp-serialization", "safetensors"
    )
    assert result.exit_code == 0, result.stderr
    assert "warning" in result.stderr and f"torch {torch.__version__}" in result.stderr
    assert "dcp.load" in result.stderr
    as_json = run_ckpt(
        "convert",
        real_hf_model,
        tmp_path / "dcp2",
        "--to",
        "dcp",
        "--dcp-serialization",
        "safetensors",
        "--json",
    )
    assert as_json.json["result"]["warnings"]
    # the warning is true: torch's own loader refuses what it names
    with safe_open(real_hf_model / "model.safetensors", "pt") as f:
        state = {k: torch.empty_like(f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    # the default serialization warns nothing and dcp.load restores it
    plain = tmp_path / "plain"
    quiet = run_ckpt("convert", real_hf_model, plain, "--to", "dcp")
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    dcp.load(state, checkpoint_id=str(plain), no_dist=True)
    with safe_open(real_hf_model / "model.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118
            assert torch.equal(state[name], f.get_tensor(name)), name


# --------------------------------------------------------------------------- resumable vs exact


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_what_passed_resumable_before_a_convert_passes_it_after(
    real_trainer_run: Path, tmp_path: Path, to: str
) -> None:
    import torch.distributed.checkpoint as dcp

    src = real_trainer_run / "straight" / "checkpoint-4"
    out = tmp_path / ("out" if to == "dcp" else "out.pt")
    assert run_ckpt("convert", src, out, "--to", to).exit_code == 0
    for level in ("--resumable", "--exact"):
        before = run_ckpt("verify", level, src, "--json")
        after = run_ckpt("verify", level, out, "--json")
        assert before.exit_code == after.exit_code == 0, after.stdout
        assert after.json["result"]["problems"] == []
    training = after.json["result"]["training"]
    assert training["step"] == 4 and training["resumable"] and training["exact"]
    if to == "dcp":
        # torch's own loader reads the step the Trainer saved
        state = {"trainer_state": {"global_step": 0}}
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
        assert state["trainer_state"]["global_step"] == 4


def test_two_levels_resumable_and_exact_in_text_and_json(
    real_accelerate_run: Path, tmp_path: Path
) -> None:
    # a plain torch.save training dict without data-loader state, nor the state of the LR
    # scheduler that stepped its optimizer: training continues, not exactly
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LinearLR(opt, total_iters=4)  # sets each group's initial_lr
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 1,
            "rng": {"torch": torch.get_rng_state()},
        },
        tmp_path / "ckpt.pt",
    )
    result = run_ckpt("verify", "--resumable", tmp_path / "ckpt.pt", "--json")
    assert result.exit_code == 0, result.stdout
    training = result.json["result"]["training"]
    assert (training["resumable"], training["exact"]) == (True, False)
    assert training["missing"] == [] and training["missing_exact"] == ["scheduler", "dataloader"]
    warnings = {(p["code"], p["severity"]) for p in result.json["result"]["problems"]}
    assert warnings == {("missing_scheduler", "warning"), ("missing_dataloader", "warning")}
    text = run_ckpt("verify", "--resumable", tmp_path / "ckpt.pt")
    assert "resumable: yes; exact: no (missing: scheduler, dataloader)" in text.stdout
    strict = run_ckpt("verify", "--exact", tmp_path / "ckpt.pt")
    assert strict.exit_code == 1 and "error missing_dataloader" in strict.stdout
    inspect = run_ckpt("inspect", tmp_path / "ckpt.pt")
    assert "exact" in inspect.stdout and "missing: scheduler, dataloader" in inspect.stdout
    # weights only is neither
    torch.save({"model": model.state_dict(), "step": 1}, tmp_path / "weights.pt")
    none = run_ckpt("verify", "--resumable", tmp_path / "weights.pt", "--json")
    assert none.exit_code == 1
    assert {p["code"] for p in none.json["result"]["problems"]} >= {"missing_optimizer"}
    # accelerate keeps the data order in its seeded sampler, which the folder does not record
    step = real_accelerate_run / "straight" / "step-4"
    acc = run_ckpt("verify", "--resumable", step, "--json").json["result"]
    assert acc["ok"] and acc["training"]["resumable"]
    assert acc["training"]["missing_exact"] == ["dataloader"]


# --------------------------------------------------------------------------- download


def test_download_of_a_repo_that_does_not_exist_exits_3_with_the_gated_hint(
    hub: TestHub, tmp_path: Path
) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    # the Hub answers 401 RepoNotFound without a token; huggingface_hub raises this
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("org/nope")
    result = run_ckpt("download", "hf://org/nope", tmp_path / "d", "--json")
    assert result.exit_code == 3, result.stderr
    assert result.json["error"]["code"] == "not_found"
    assert "HF_TOKEN" in result.stderr and "private or gated" in result.stderr
    assert not (tmp_path / "d").exists()
    # a gated repository without a token is still an auth failure (5)
    publish_model(hub, "org/gated", tmp_path / "g", {"w": torch.zeros(2)}, token="hf_ok")
    assert run_ckpt("download", "hf://org/gated", tmp_path / "d").exit_code == 5


# --------------------------------------------------------------------------- safetensors rules


def _raw_safetensors(path: Path, header: str, data: bytes) -> None:
    """A safetensors file with a hand-written header (what a crafted or broken file holds)."""
    encoded = header.encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def test_duplicate_keys_in_a_safetensors_header_are_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    other = '{"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}'
    cases = {
        "tensor.safetensors": (f'{{"w": {entry}, "w": {other}}}', "'w' twice"),
        "meta.safetensors": (
            f'{{"__metadata__": {{"format": "pt", "format": "tf"}}, "w": {entry}, "v": {other}}}',
            "__metadata__ has the key 'format' twice",
        ),
        # keys written with whitespace before the colon are still counted as keys
        "spaced.safetensors": (f'{{"w" : {entry},\n "w"\t:{other}}}', "'w' twice"),
        "field.safetensors": (
            '{"w": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}, '
            f'"v": {other}}}',
            "a header entry has the field 'dtype' twice",
        ),
    }
    for name, (header, said) in cases.items():
        path = tmp_path / name
        _raw_safetensors(path, header, data)
        inspect = run_ckpt("inspect", path, "--json")
        assert inspect.exit_code == 4, inspect.stdout
        assert said in inspect.json["error"]["message"]
        verify = run_ckpt("verify", path, "--json")
        assert verify.exit_code == 1
        problems = verify.json["result"]["problems"]
        assert problems[0]["code"] == "duplicate_key" and said in problems[0]["message"]
    # a clean file written by safetensors itself passes both, also when its metadata strings
    # hold JSON text (quotes and colons that look like keys, braces that look like objects)
    metadata = {"config": '{"a": 1, "b": {"c": "d"}}', "format": "pt"}
    save_file({"w": torch.zeros(2), "v": torch.ones(2)}, tmp_path / "ok.safetensors", metadata)
    assert run_ckpt("inspect", tmp_path / "ok.safetensors").exit_code == 0
    assert run_ckpt("verify", tmp_path / "ok.safetensors").exit_code == 0


def test_inspect_says_a_malformed_safetensors_file_is_malformed(tmp_path: Path) -> None:
    save_file({"w": torch.arange(4, dtype=torch.float32)}, tmp_path / "good.safetensors")
    good = (tmp_path / "good.safetensors").read_bytes()
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    trailing = tmp_path / "trailing.safetensors"
    trailing.write_bytes(good + b"\0" * 8)
    hole = tmp_path / "hole.safetensors"
    _raw_safetensors(
        hole,
        '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
        ' "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}',
        data[:8] + b"\0" * 4 + data[8:],
    )
    late = tmp_path / "late.safetensors"
    _raw_safetensors(
        late, '{"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}', b"\0" * 8 + data
    )
    for path, code in ((trailing, "trailing_bytes"), (hole, "gap"), (late, "gap")):
        # the reference library refuses each of them
        with pytest.raises(SafetensorError), safe_open(path, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
        shown = run_ckpt("inspect", path)
        assert shown.exit_code == 4, (path.name, shown.stdout, shown.stderr)
        assert "tensor" in shown.stdout  # what can be shown is shown
        assert "malformed" in shown.stderr and code in shown.stderr
        as_json = run_ckpt("inspect", path, "--json")
        assert as_json.exit_code == 4
        assert [p["code"] for p in as_json.json["result"]["problems"]] == [code]
        # consistent with verify
        verify = run_ckpt("verify", path, "--json")
        assert verify.exit_code == 1
        assert code in {p["code"] for p in verify.json["result"]["problems"]}
    assert run_ckpt("inspect", tmp_path / "good.safetensors").exit_code == 0


# --------------------------------------------------------------------------- DCP object entries


class _Evil:
    """Pickles as a call to os.system: what a hostile object entry holds."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_plain_verify_names_a_dcp_object_entry_the_restricted_reader_refuses(
    real_trainer_run: Path, tmp_path: Path
) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    state = {
        "model": {"w": torch.ones(2, 2)},
        "step": 3,
        "extra": {"hook": _Evil(marker), "note": "plain"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "hostile"), no_dist=True)
    result = run_ckpt("verify", tmp_path / "hostile", "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["tensor"]) for p in problems] == [("unloadable_object", "extra.hook")]
    assert "posix.system" in problems[0]["message"] or "os.system" in problems[0]["message"]
    assert not marker.exists()
    # --deep agrees (it loads with the restricted reader), and nothing ran there either
    assert run_ckpt("verify", "--deep", tmp_path / "hostile").exit_code == 1
    assert not marker.exists()
    # plain verify stays metadata-and-opcodes only: no torch import
    probe = (
        "import sys; from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, "verify", str(tmp_path / "hostile")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert "unloadable_object" in proc.stdout and "NO_TORCH" in proc.stderr, proc.stderr
    # what dcp.save writes for ordinary values passes: a Trainer checkpoint as DCP
    out = tmp_path / "trainer-dcp"
    assert (
        run_ckpt(
            "convert", real_trainer_run / "straight" / "checkpoint-4", out, "--to", "dcp"
        ).exit_code
        == 0
    )
    clean = run_ckpt("verify", out, "--json")
    assert [p for p in clean.json["result"]["problems"] if p["code"] == "unloadable_object"] == []


# --------------------------------------------------------------------------- HF cache snapshots


def test_hf_cache_snapshots_are_read_and_links_leaving_the_repo_refused(
    hub: TestHub, real_hf_model: Path, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    hub.add_repo("org/tiny", real_hf_model)
    cache = tmp_path / "hub-cache"
    snapshot = Path(snapshot_download("org/tiny", endpoint=hub.url, cache_dir=str(cache)))
    assert (snapshot / "model.safetensors").is_symlink()  # -> ../../blobs/<sha256>
    shown = run_ckpt("inspect", snapshot, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert shown.json["result"]["tensors"] == 21
    assert run_ckpt("verify", snapshot).exit_code == 0
    out = tmp_path / "export"
    assert run_ckpt("convert", snapshot, out, "--to", "safetensors").exit_code == 0
    _same_model(out, real_hf_model)
    # `ckpt inspect org/name` finds the cached snapshot, as `hf` users expect
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    by_name = run_ckpt_process("inspect", "org/tiny", "--json", env=env)
    assert by_name.exit_code == 0, by_name.stderr
    assert by_name.json["result"]["tensors"] == 21
    missing = run_ckpt_process("inspect", "org/absent", env=env)
    assert missing.exit_code == 3 and "hf://org/absent" in missing.stderr
    # a link that leaves the cache repository folder is still refused
    secret = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.zeros(2)}, secret)
    evil = cache / "models--org--evil" / "snapshots" / ("b" * 40)
    evil.mkdir(parents=True)
    (evil / "model.safetensors").symlink_to(secret)
    refused = run_ckpt("inspect", evil)
    assert refused.exit_code == 4 and "outside" in refused.stderr
    # and outside a cache, a link to a sibling folder is refused as before
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(snapshot / "model.safetensors")
    assert run_ckpt("inspect", plain).exit_code == 4
