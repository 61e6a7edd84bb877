"""`ckpt diff`: verdicts, exit codes and the numbers it reports, on real checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .conftest import run_ckpt
from .test_convert import hf_save, tiny_state


def test_identical_across_layouts_is_exit_0(tmp_path: Path) -> None:
    state = tiny_state()
    hf_save(state, tmp_path / "sharded", "1KB")
    save_file(state, tmp_path / "one.safetensors")
    result = run_ckpt("diff", tmp_path / "sharded", tmp_path / "one.safetensors")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.startswith("IDENTICAL")
    report = run_ckpt("diff", tmp_path / "sharded", tmp_path / "one.safetensors", "--json").json
    assert report["ok"] is True
    assert report["result"]["compared"] == report["result"]["equal"] == len(state)


def test_every_kind_of_difference_is_found_and_the_largest_leads(tmp_path: Path) -> None:
    state = tiny_state()
    save_file(state, tmp_path / "a.safetensors")
    changed = dict(state)
    changed["layers.0.weight"] = state["layers.0.weight"].clone()
    changed["layers.0.weight"][3, 4] += 0.5
    changed["layers.1.weight"] = state["layers.1.weight"].clone()
    changed["layers.1.weight"][0, :2] += 2.0
    changed["norm.weight"] = state["norm.weight"].to(torch.float16)
    changed["layers.2.bias"] = torch.zeros(17)
    del changed["mask"]
    changed["extra"] = torch.ones(2)
    save_file(changed, tmp_path / "b.safetensors")
    result = run_ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    assert result.exit_code == 1
    report = result.json["result"]
    assert report["identical"] is False
    assert report["only_a"] == ["mask"] and report["only_b"] == ["extra"]
    by_name = {d["name"]: d for d in report["differences"]}
    assert by_name["layers.2.bias"]["status"] == "shape"
    assert by_name["norm.weight"]["status"] == "dtype"
    w0 = by_name["layers.0.weight"]
    assert w0["status"] == "values" and w0["differing"] == 1 and w0["numel"] == 256
    assert math.isclose(w0["max_abs"], 0.5, rel_tol=1e-6)
    expected_rel = 0.5 / abs(float(changed["layers.0.weight"][3, 4]))
    assert math.isclose(w0["max_rel"], expected_rel, rel_tol=1e-6)
    assert by_name["layers.1.weight"]["differing"] == 2
    values = [d["name"] for d in report["differences"] if d["status"] == "values"]
    assert values == ["layers.1.weight", "layers.0.weight"]  # largest max abs first
    human = run_ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    lines = human.stdout.splitlines()
    assert lines[0].startswith("DIFFERENT") and "1 only in A" in lines[0]
    assert "layers.1.weight" in human.stdout and "only in B (1): extra" in human.stdout


def test_tolerances_turn_tiny_differences_into_identical(tmp_path: Path) -> None:
    state = {"w": torch.linspace(1, 2, 1000), "i": torch.arange(5)}
    save_file(state, tmp_path / "a.safetensors")
    save_file({"w": state["w"] * (1 + 1e-6), "i": state["i"]}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert run_ckpt("diff", a, b).exit_code == 1
    close = run_ckpt("diff", a, b, "--rtol", "1e-5", "--json")
    assert close.exit_code == 0
    assert close.json["result"]["close"] == 1
    assert close.json["result"]["within_tolerance"][0]["outside_tolerance"] == 0
    assert run_ckpt("diff", a, b, "--atol", "1e-9").exit_code == 1
    assert run_ckpt("diff", a, b, "--atol", "-1").exit_code == 2


def test_select_and_rename_line_up_naming_schemes(tmp_path: Path) -> None:
    state = tiny_state()
    save_file({f"model.{k}": v for k, v in state.items()}, tmp_path / "train.safetensors")
    save_file(state, tmp_path / "weights.safetensors")
    a, b = tmp_path / "train.safetensors", tmp_path / "weights.safetensors"
    plain = run_ckpt("diff", a, b, "--json").json["result"]
    assert len(plain["only_a"]) == len(plain["only_b"]) == len(state)
    selected = run_ckpt("diff", a, b, "--select", "model", "--json")
    assert selected.exit_code == 0
    assert selected.json["result"]["select_applied"] == {"a": True, "b": False}
    assert run_ckpt("diff", a, b, "--rename", "model.=").exit_code == 0
    filtered = run_ckpt("diff", a, b, "--select", "model", "--filter", "layers.*", "--json")
    assert filtered.json["result"]["compared"] == 8
    assert run_ckpt("diff", a, b, "--select", "optimizer").exit_code == 3


def test_a_filter_written_on_the_source_names_says_diff_matches_the_lined_up_names(
    tmp_path: Path,
) -> None:
    """`diff A B --select model --filter 'model.layers.*'` (the glob `convert` takes, on the
    names `inspect --list` shows) said the patterns leave no entry and to "check the pattern
    against `ckpt inspect --list`", which lists names the pattern matches. It now says diff
    matches the names after --select / --rename, and gives the glob to write."""
    state = tiny_state()
    save_file({f"model.{k}": v for k, v in state.items()}, tmp_path / "train.safetensors")
    save_file(state, tmp_path / "weights.safetensors")
    a, b = tmp_path / "train.safetensors", tmp_path / "weights.safetensors"
    result = run_ckpt("diff", a, b, "--select", "model", "--filter", "model.layers.*", "--json")
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert "leave no entry" in error["message"]
    assert "after --select" in error["fix"] and "--filter 'layers.*'" in error["fix"], error
    fixed = run_ckpt("diff", a, b, "--select", "model", "--filter", "layers.*", "--json")
    assert fixed.exit_code == 0 and fixed.json["result"]["compared"] == 8
    # without --select or --rename the lined-up names are the names inspect shows
    plain = run_ckpt("diff", a, b, "--filter", "nothing.*", "--json")
    assert plain.exit_code == 3
    assert "ckpt inspect --list" in plain.json["error"]["fix"]


def test_nan_in_the_same_place_is_equal_and_against_a_number_is_infinite() -> None:
    from ckpt_cli.ops.diff.compare import tensor_stats

    a = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    b = torch.tensor([1.0, float("nan"), 3.5, 4.0])
    differing, outside, max_abs, max_rel = tensor_stats(a, b, atol=1.0, rtol=None)
    assert differing == 2 and outside == 1
    assert max_abs == math.inf and max_rel == math.inf
    same = tensor_stats(a, a.clone(), None, None)
    assert same[0] == 0
    assert tensor_stats(torch.tensor([0.0]), torch.tensor([-0.0]), None, None)[0] == 1


def test_infinities_of_opposite_sign_are_outside_every_tolerance(tmp_path: Path) -> None:
    """A weight that overflowed to -inf where the other run holds +inf was "within
    tolerance" (exit 0) under any --atol: the bound `atol + rtol*|b|` is NaN at an infinity.
    And an infinity equal on both sides made the report's max abs difference `inf`
    (`inf - inf` is NaN) when the only change elsewhere was 0.0 against -0.0."""
    inf = float("inf")
    save_file({"w": torch.tensor([0.0, 1.0, inf, 2.0])}, tmp_path / "a.safetensors")
    save_file({"w": torch.tensor([0.0, 1.0, -inf, 2.0])}, tmp_path / "b.safetensors")
    save_file({"w": torch.tensor([-0.0, 1.0, inf, 2.5])}, tmp_path / "c.safetensors")
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    for tolerance in (["--atol", "1e30"], ["--atol", "1e-3", "--rtol", "0.5"]):
        flipped = run_ckpt("diff", a, b, *tolerance, "--json")
        assert flipped.exit_code == 1, flipped.stdout
        assert flipped.json["result"]["differences"][0]["outside_tolerance"] == 1
    close = run_ckpt("diff", a, c, "--atol", "0.1", "--json")
    assert close.exit_code == 1, close.stdout
    entry = close.json["result"]["differences"][0]
    assert entry["differing"] == 2 and entry["outside_tolerance"] == 1
    assert entry["max_abs"] == 0.5, entry
    assert run_ckpt("diff", a, c, "--atol", "1").exit_code == 0


def test_non_tensor_entries_are_compared_by_value_across_formats(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    weights = {"w": torch.randn(4, 4)}
    base = {"model": weights, "step": 7, "dataloader": {"epoch": 1, "position": 16}}
    torch.save(base, tmp_path / "a.pt")
    dcp.save(
        {
            "model": {"w": weights["w"].clone()},
            "step": 7,
            "dataloader": {"epoch": 1, "position": 16},
        },
        checkpoint_id=tmp_path / "a-dcp",
        no_dist=True,
    )
    assert run_ckpt("diff", tmp_path / "a.pt", tmp_path / "a-dcp").exit_code == 0
    torch.save({**base, "step": 8, "dataloader": {"epoch": 1, "position": 24}}, tmp_path / "b.pt")
    result = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert result.exit_code == 1
    by_name = {d["name"]: d for d in result.json["result"]["differences"]}
    assert set(by_name) == {"step", "dataloader.position"}
    assert (by_name["step"]["value_a"], by_name["step"]["value_b"]) == ("7", "8")
    assert by_name["step"]["status"] == "value"
    human = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert "7 → 8" in human.stdout and "16 → 24" in human.stdout


# --------------------------------------------------------------------------- tied weights


def _tiny_tied(kind: str) -> torch.nn.Module:
    """A tiny GPT-2 or T5 from transformers, built from its config (tied embeddings)."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1,
            n_embd=8,
            n_head=2,
            vocab_size=32,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.T5Config(
        d_model=8,
        d_ff=16,
        num_layers=1,
        num_heads=2,
        d_kv=4,
        vocab_size=32,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config).eval()


TIED = {
    "gpt2": {"lm_head.weight": "transformer.wte.weight"},
    "t5": {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    },
}


@pytest.mark.frameworks
@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_tied_weights_converted_once_diff_identical_naming_the_aliases(
    tmp_path: Path, kind: str
) -> None:
    model = _tiny_tied(kind)
    state = model.state_dict()
    torch.save(state, tmp_path / "shared.pt")  # the tied names share one storage
    out = tmp_path / "out"
    out.mkdir()
    converted = run_ckpt(
        "convert", tmp_path / "shared.pt", out / "model.safetensors", "--to", "safetensors"
    )
    assert converted.exit_code == 0, converted.stderr
    # the conversion is right: from_pretrained of it (with the model's config) is bit-exact
    model.config.save_pretrained(out)
    loaded = type(model).from_pretrained(out).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # and diff says so, naming each alias and where it is recorded
    result = run_ckpt("diff", tmp_path / "shared.pt", out / "model.safetensors", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["identical"] and report["only_a"] == [] and report["only_b"] == []
    assert report["compared"] == len(state)
    aliases = {a["name"]: a for a in report["aliases"]}
    assert {n: a["target"] for n, a in aliases.items()} == TIED[kind]
    for a in aliases.values():
        assert a["written_once"] == "b" and a["recorded_b"] == "safetensors metadata"
        assert a["recorded_a"] == "shared storage"
    human = run_ckpt("diff", tmp_path / "shared.pt", out / "model.safetensors")
    assert human.stdout.startswith("IDENTICAL") and "aliases (" in human.stdout
    for name, target in TIED[kind].items():
        assert f"{name} = {target}" in human.stdout

    # transformers' own save_pretrained drops the tied names and records them nowhere but in
    # the model class and config.json: diff reads them from there
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    result = run_ckpt("diff", saved, tmp_path / "shared.pt", "--json")
    assert result.exit_code == 0, result.stdout
    aliases = {a["name"]: a for a in result.json["result"]["aliases"]}
    assert {n: a["target"] for n, a in aliases.items()} == TIED[kind]
    assert all(a["written_once"] == "a" for a in aliases.values())
    assert all(
        a["recorded_a"].startswith(f"config.json tie_word_embeddings ({type(model).__name__}")
        for a in aliases.values()
    )


@pytest.mark.frameworks
def test_a_real_difference_behind_an_alias_is_still_different(tmp_path: Path) -> None:
    model = _tiny_tied("gpt2")
    torch.save(model.state_dict(), tmp_path / "shared.pt")
    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", tmp_path / "shared.pt", out, "--to", "safetensors").exit_code == 0
    # the same weights, but lm_head untied and changed in one element
    untied = {k: v.clone() for k, v in model.state_dict().items()}
    untied["lm_head.weight"][3, 1] += 1.0
    torch.save(untied, tmp_path / "untied.pt")
    result = run_ckpt("diff", tmp_path / "untied.pt", out, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert not report["identical"] and report["only_a"] == []
    [changed] = report["differences"]
    assert changed["name"] == "lm_head.weight" and changed["name_b"] == "transformer.wte.weight"
    assert changed["differing"] == 1
    assert report["aliases"][0]["written_once"] == "b"
    assert run_ckpt("diff", tmp_path / "untied.pt", out).stdout.startswith("DIFFERENT")
    # a name missing with no alias recorded anywhere stays a name only one side has
    plain = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(plain, tmp_path / "plain.safetensors")
    result = run_ckpt("diff", tmp_path / "shared.pt", tmp_path / "plain.safetensors", "--json")
    assert result.exit_code == 1 and result.json["result"]["only_a"] == ["lm_head.weight"]


def test_filter_out_leaves_names_out_as_in_convert(tmp_path: Path) -> None:
    """`--filter-out` means in `diff` what it means in `convert` (the docs said both take it;
    `diff` refused it as no such option): the matching names are not compared."""
    a = {"model.w": torch.ones(4), "model.rotary.inv_freq": torch.ones(2), "step": torch.tensor(1)}
    b = {**a, "model.rotary.inv_freq": torch.zeros(2), "step": torch.tensor(2)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    assert run_ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors").exit_code == 1
    left_out = run_ckpt(
        "diff",
        tmp_path / "a.safetensors",
        tmp_path / "b.safetensors",
        "--filter-out",
        "*.inv_freq",
        "--filter-out",
        "step",
        "--json",
    )
    assert left_out.exit_code == 0, left_out.stdout
    assert left_out.json["result"]["identical"] is True
    both = run_ckpt(
        "diff",
        tmp_path / "a.safetensors",
        tmp_path / "b.safetensors",
        "--filter",
        "model.*",
        "--filter-out",
        "*.inv_freq",
        "--filter-out",
        "nothing*",
        "--json",
    )
    assert both.exit_code == 0 and any("nothing*" in w for w in both.json["result"]["warnings"])
    none = run_ckpt(
        "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--filter-out", "*"
    )
    assert none.exit_code == 3 and "leave no entry" in none.stderr


def test_a_component_neither_side_can_read_is_never_called_identical(tmp_path: Path) -> None:
    """Two Trainer checkpoints whose `optimizer.pt` differ, both unreadable (one truncated, one
    a hostile pickle): diff left the optimizer out of the comparison without a word and said
    IDENTICAL, exit 0. It refuses (exit 4, naming the file) unless the component is left out
    explicitly, and then says what was not compared."""
    import json
    import pickle
    import shutil

    a = tmp_path / "a" / "checkpoint-2"
    a.mkdir(parents=True)
    save_file({"w": torch.ones(2, 2)}, a / "model.safetensors")
    torch.save({"last_epoch": 2}, a / "scheduler.pt")
    (a / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    b = tmp_path / "b" / "checkpoint-2"
    shutil.copytree(a, b)
    (a / "optimizer.pt").write_bytes(b"PK\x03\x04 cut short")
    (b / "optimizer.pt").write_bytes(pickle.dumps({"x": print}, protocol=2))
    refused = run_ckpt("diff", a, b, "--json")
    assert refused.exit_code == 4, refused.stdout
    assert "optimizer component cannot be read" in refused.json["error"]["message"]
    left_out = run_ckpt("diff", a, b, "--filter-out", "optimizer*", "--json")
    assert left_out.exit_code == 0, left_out.stdout
    notes = left_out.json["result"]["warnings"]
    assert any("optimizer not compared" in n for n in notes), notes


@pytest.mark.parametrize("tolerance", [(), ("--atol", "0"), ("--rtol", "1e-20"), ("--atol", "0.5")])
def test_integers_past_2_to_the_53_are_compared_exactly(
    tmp_path: Path, tolerance: tuple[str, ...]
) -> None:
    # token ids / step counters: 2**53 and 2**53 + 1 are one float64, but not one integer
    save_file({"ids": torch.tensor([2**53, 7], dtype=torch.int64)}, tmp_path / "a.safetensors")
    save_file({"ids": torch.tensor([2**53 + 1, 7], dtype=torch.int64)}, tmp_path / "b.safetensors")
    result = run_ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", *tolerance)
    assert result.exit_code == 1, result.stdout
    assert result.stdout.startswith("DIFFERENT")
    report = run_ckpt(
        "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", *tolerance, "--json"
    ).json["result"]
    (found,) = report["differences"]
    assert found["status"] == "values" and found["differing"] == 1 and found["max_abs"] == 1.0
    # a tolerance that covers the difference absorbs it
    loose = run_ckpt("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--atol", "1")
    assert loose.exit_code == 0 and "(1 within tolerance)" in loose.stdout


def test_packed_f4_tensors_are_compared_by_their_e2m1_values(tmp_path: Path) -> None:
    # bytes 0x07 -> 0x08: the low nibble's value goes 6.0 -> -0.0 (the byte "moves by 1")
    def f4(*raw: int) -> torch.Tensor:
        return torch.tensor(raw, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    save_file({"w": f4(0x07, 0x22)}, tmp_path / "a.safetensors")
    save_file({"w": f4(0x08, 0x22)}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tight = run_ckpt("diff", a, b, "--atol", "1", "--json")
    assert tight.exit_code == 1, tight.stdout
    (found,) = tight.json["result"]["differences"]
    # four E2M1 values, one of them differs by 6
    assert (found["numel"], found["differing"], found["max_abs"]) == (4, 1, 6.0)
    assert run_ckpt("diff", a, b, "--atol", "6").exit_code == 0
    # +0.0 against -0.0 (0x00 -> 0x08) differs in bits, not in value
    save_file({"w": f4(0x00, 0x22)}, tmp_path / "c.safetensors")
    assert run_ckpt("diff", tmp_path / "c.safetensors", b).exit_code == 1
    assert run_ckpt("diff", tmp_path / "c.safetensors", b, "--atol", "0").exit_code == 0


def test_ignore_dtype_without_a_tolerance_says_no_tolerance(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(4, dtype=torch.float16)}, tmp_path / "b.safetensors")
    result = run_ckpt(
        "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--ignore-dtype"
    )
    assert result.exit_code == 0
    assert result.stdout.splitlines()[0] == (
        "IDENTICAL: 1 entries equal, 1 with a dtype change (ignored)"
    )
    assert "tolerance" not in result.stdout


def test_a_lossless_dtype_change_says_the_values_are_equal(tmp_path: Path) -> None:
    """A bf16 model against its float32 upcast, without tolerances: the verdict was only
    "DIFFERENT: 1 of 1 entries differ", though every value is equal and --ignore-dtype
    turns it into exit 0; with --atol the same verdict named --ignore-dtype."""
    weights = torch.randn(8, 8).to(torch.bfloat16)
    save_file({"w": weights}, tmp_path / "bf16.safetensors")
    save_file({"w": weights.float()}, tmp_path / "fp32.safetensors")
    a, b = tmp_path / "bf16.safetensors", tmp_path / "fp32.safetensors"
    result = run_ckpt("diff", a, b)
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        "DIFFERENT: 1 of 1 entries changed dtype (values equal; --ignore-dtype accepts that)"
    )
    assert run_ckpt("diff", a, b, "--ignore-dtype").exit_code == 0
    changed = weights.float()
    changed[0, 0] += 1
    save_file({"w": changed}, b)
    assert run_ckpt("diff", a, b).stdout.startswith("DIFFERENT: 1 of 1 entries differ")


@pytest.mark.parametrize("weights_first", [True, False])
def test_select_lines_up_a_plain_dcp_model_save_with_its_hf_weights(
    tiny_llama: Path, tmp_path: Path, weights_first: bool
) -> None:
    """`dcp.save({"model": model.state_dict()})` against the model's `save_pretrained`
    weights with `--select model`: both sides were stripped of `model.`, so the HF side's own
    `model.layers…` lost its prefix and `lm_head.weight` was dropped: "20 only in A, 21 only
    in B", exit 1, for the same weights."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    state = {
        k: v.detach().clone()
        for k, v in LlamaForCausalLM.from_pretrained(tiny_llama).state_dict().items()
    }
    saved = tmp_path / "dcp"
    dcp.save({"model": state}, checkpoint_id=str(saved), no_dist=True)
    a, b = (tiny_llama, saved) if weights_first else (saved, tiny_llama)
    result = run_ckpt("diff", a, b, "--select", "model", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["equal"] == len(state) and not report["only_a"] and not report["only_b"]
    applied = {"a": not weights_first, "b": weights_first}
    assert report["select_applied"] == applied
    # a real difference under the prefix is still one
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "changed"), no_dist=True)
    changed = run_ckpt("diff", tiny_llama, tmp_path / "changed", "--select", "model", "--json")
    assert changed.exit_code == 1
    assert [d["name"] for d in changed.json["result"]["differences"]] == ["model.norm.weight"]


@pytest.mark.frameworks
def test_a_filter_naming_a_tied_alias_compares_it_with_the_tensor_it_names(
    tmp_path: Path,
) -> None:
    """`--filter 'lm_head.*'` on a correct conversion of tied weights: the filter matched the
    alias on A, and left out the tensor B stores it as, so diff called `lm_head.weight` "only
    in A" (exit 1). The filter chooses the names compared; the alias still resolves to its
    tensor on the side that stores it once, whatever the filter leaves of that side."""
    model = _tiny_tied("gpt2")
    state = model.state_dict()
    torch.save(state, tmp_path / "shared.pt")
    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", tmp_path / "shared.pt", out, "--to", "safetensors").exit_code == 0
    saved = tmp_path / "saved"
    model.save_pretrained(saved)  # drops lm_head.weight, reties it from config.json
    untied = tmp_path / "untied.safetensors"  # lm_head.weight stored as a tensor of its own
    save_file({k: v.clone().contiguous() for k, v in state.items()}, untied)
    for a, b in ((tmp_path / "shared.pt", out), (out, tmp_path / "shared.pt"), (saved, untied)):
        result = run_ckpt("diff", a, b, "--filter", "lm_head.*", "--json")
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert report["only_a"] == report["only_b"] == [], report
        assert report["compared"] == report["equal"] == 1
        assert [x["name"] for x in report["aliases"]] == ["lm_head.weight"]
    # and a real difference behind the alias is still found through the filter
    changed = {k: v.clone() for k, v in state.items()}
    changed["lm_head.weight"][0, 0] += 1.0
    torch.save(changed, tmp_path / "untied.pt")
    result = run_ckpt("diff", tmp_path / "untied.pt", out, "-k", "lm_head.*", "--json")
    assert result.exit_code == 1, result.stdout
    [changed] = result.json["result"]["differences"]
    assert changed["name"] == "lm_head.weight" and changed["name_b"] == "transformer.wte.weight"
    # a filter leaving out the alias compares no alias at all
    result = run_ckpt("diff", tmp_path / "shared.pt", out, "--filter-out", "lm_head.*", "--json")
    assert result.exit_code == 0 and result.json["result"]["aliases"] == []


@pytest.mark.frameworks
def test_a_changed_config_beside_the_same_weights_is_a_difference(tmp_path: Path) -> None:
    """Two `save_pretrained` folders with bit-identical weights whose `config.json` differ
    (another `rms_norm_eps`: another model's outputs) were IDENTICAL, exit 0: diff compared
    the entries only. The companion files both folders hold are compared key by key now;
    one written again with other spacing and key order is still identical, and one that only
    one folder holds is a warning."""
    import json
    import shutil

    from transformers import LlamaForCausalLM

    from .framework_fixtures import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    a, b = tmp_path / "a", tmp_path / "b"
    model.save_pretrained(a)
    shutil.copytree(a, b)
    model.config.rms_norm_eps = 0.5
    model.config.save_pretrained(b)
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert report["differences"] == [] and not report["identical"]
    assert report["metadata"] == [
        {"key": "config.json:rms_norm_eps", "value_a": "1e-06", "value_b": "0.5"}
    ]
    human = run_ckpt("diff", a, b)
    assert human.exit_code == 1 and human.stdout.startswith("DIFFERENT: 1 metadata key differs")
    assert "config.json:rms_norm_eps  1e-06 → 0.5" in human.stdout

    # the same config in another layout of its JSON is no difference
    config = json.loads((a / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["warnings"] == []
    # a companion file one folder lacks is said, not counted
    (b / "generation_config.json").unlink()
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["warnings"] == [
        "only A holds generation_config.json: not compared (a companion file of the weights, "
        "not an entry)"
    ]
    # a part compared (--filter) leaves the companion files out, saying so
    model.config.save_pretrained(b)
    result = run_ckpt("diff", a, b, "--filter", "model.*", "--json")
    assert result.exit_code == 0, result.stdout
    assert any("config.json" in w for w in result.json["result"]["warnings"])

    # the config change `convert --dtype` makes (torch_dtype) is what --ignore-dtype accepts
    cast = tmp_path / "bf16"
    converted = run_ckpt("convert", a, cast, "--to", "safetensors", "--dtype", "bfloat16")
    assert converted.exit_code == 0, converted.stderr
    declared = json.loads((cast / "config.json").read_text())
    assert declared.get("torch_dtype", declared.get("dtype")) == "bfloat16"
    tolerant = ("--atol", "1e-2", "--rtol", "1e-2")
    result = run_ckpt("diff", a, cast, *tolerant, "--ignore-dtype", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["metadata"] == []


@pytest.mark.frameworks
def test_a_pipeline_whose_scheduler_config_changed_is_different(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """A diffusers pipeline saved again with another scheduler config (1000 training steps
    become 500: another sampling) and the same weights was IDENTICAL: the component folders'
    configs are compared too, as `convert` carries them; its whole-folder copy is identical."""
    import shutil

    from diffusers import DDIMScheduler

    other = tmp_path / "pipeline"
    shutil.copytree(diffusers_pipeline, other)
    DDIMScheduler(num_train_timesteps=500).save_pretrained(other / "scheduler")
    result = run_ckpt("diff", diffusers_pipeline, other, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert report["differences"] == [] and report["only_a"] == report["only_b"] == []
    assert [m["key"] for m in report["metadata"]] == [
        "scheduler/scheduler_config.json:num_train_timesteps"
    ]
    converted = tmp_path / "torch"
    assert run_ckpt("convert", diffusers_pipeline, converted, "--to", "torch").exit_code == 0
    result = run_ckpt("diff", diffusers_pipeline, converted, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["warnings"] == []


def test_a_training_save_against_its_exported_weights_names_the_select_that_lines_them_up(
    tmp_path: Path,
) -> None:
    """The restart test's judge: a user diffs a Trainer checkpoint against the model it
    exported (`convert --select model`). Every name stood on one side ("DIFFERENT: 30 only in A,
    5 only in B"), nothing compared, and nothing said that B's names are A's `model.`
    component. The verdict stays (the sides differ as wholes), and a warning names the
    `--select model` that compares the weights, which then are IDENTICAL."""
    from .run_fixtures import trainer_checkpoint

    save = tmp_path / "checkpoint-100"
    trainer_checkpoint(save, 100)
    export = tmp_path / "export"
    made = run_ckpt("convert", save, export, "--to", "safetensors", "--select", "model")
    assert made.exit_code == 0, made.stderr
    whole = run_ckpt("diff", save, export, "--json")
    assert whole.exit_code == 1, whole.stdout
    report = whole.json["result"]
    assert report["compared"] == 0 and report["only_a"] and report["only_b"]
    hints = [w for w in report["warnings"] if "--select model" in w]
    assert len(hints) == 1, report["warnings"]
    human = run_ckpt("diff", save, export)
    assert "--select model" in human.stderr and "--select model" not in human.stdout
    lined = run_ckpt("diff", save, export, "--select", "model", "--json")
    assert lined.exit_code == 0, lined.stdout
    assert lined.json["result"]["compared"] == len(report["only_b"])
    # sides that share names get no such hint
    same = run_ckpt("diff", save, save, "--json").json["result"]
    assert not [w for w in same["warnings"] if "--select" in w]


def test_a_trainer_checkpoints_training_args_are_compared(tmp_path: Path) -> None:
    """A user diffs two Trainer `checkpoint-N` folders to learn what changed. Their
    `training_args.bin` (a pickle of TrainingArguments, which ckpt never unpickles) vanished:
    not compared and not named. It was then listed as not compared, its bytes compared in a
    warning, and two saves whose training arguments differed were IDENTICAL. It is compared
    now: a pickle that builds no object (this one) by its bytes, a difference when they differ
    (`tests/test_diff_training_components.py` compares a real one field by field)."""
    import pickle

    from .run_fixtures import trainer_checkpoint

    sides = []
    for run in ("a", "b", "c"):
        save = tmp_path / run / "checkpoint-100"
        trainer_checkpoint(save, 100)
        lr = 1e-3 if run != "c" else 2e-3
        (save / "training_args.bin").write_bytes(pickle.dumps({"learning_rate": lr}))
        sides.append(save)
    same = run_ckpt("diff", sides[0], sides[1], "--json")
    assert same.exit_code == 0, same.stdout
    assert not [w for w in same.json["result"]["warnings"] if "training_args.bin" in w]
    changed = run_ckpt("diff", sides[0], sides[2], "--json")
    assert changed.exit_code == 1, changed.stdout
    report = changed.json["result"]
    assert [m["key"] for m in report["metadata"]] == ["training_args.bin"]
    assert report["components"] == {"training_args": 1} and not report["differences"]
    # only one side holds it: named
    (sides[1] / "training_args.bin").unlink()
    lone = run_ckpt("diff", sides[0], sides[1], "--json").json["result"]
    assert [w for w in lone["warnings"] if "training_args.bin" in w and "only A" in w]


def test_differing_safetensors_metadata_is_named_but_an_equal_total_size_is_not(
    tmp_path: Path,
) -> None:
    """Two safetensors checkpoints whose header `__metadata__` (`{"format": "pt"}` against
    `{"format": "pt", "note": "x"}`) or whose index's extra metadata (`"foo": "bar"`) differ
    were called IDENTICAL without a word. Each differing key is now a note (a warning: file
    metadata, no tensor's value); `total_size`, the tensors' bytes, says nothing (a cast
    changes it, and the tensors say so), and alias records (tied weights) are left to
    `aliases`."""
    import json

    from huggingface_hub import save_torch_state_dict

    state = {"a.weight": torch.arange(64.0).reshape(8, 8), "b.weight": torch.ones(8, 8)}
    plain, noted = tmp_path / "plain.safetensors", tmp_path / "noted.safetensors"
    save_file(state, plain, metadata={"format": "pt"})
    save_file(state, noted, metadata={"format": "pt", "note": "x"})
    header = run_ckpt("diff", plain, noted, "--json")
    assert header.exit_code == 0, header.stdout
    notes = [w for w in header.json["result"]["warnings"] if "note" in w]
    assert len(notes) == 1 and '"x"' in notes[0], header.json["result"]["warnings"]
    assert not run_ckpt("diff", plain, plain, "--json").json["result"]["warnings"]

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    save_torch_state_dict(state, one, max_shard_size=300)
    save_torch_state_dict(state, two, max_shard_size=10**6)
    for folder in (one, two):
        index = folder / "model.safetensors.index.json"
        if not index.exists():  # one shard: write the index a sharded save would
            (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
            index.write_text(
                json.dumps(
                    {
                        "metadata": {"total_size": 512},
                        "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors"),
                    }
                )
            )
    same = run_ckpt("diff", one, two, "--json")
    assert same.exit_code == 0, same.stdout
    assert not [w for w in same.json["result"]["warnings"] if "metadata" in w], same.json
    index = two / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"]["foo"] = "bar"
    index.write_text(json.dumps(data))
    extra = run_ckpt("diff", one, two)
    assert extra.exit_code == 0, extra.stdout
    assert "foo" in extra.stderr and '"bar"' in extra.stderr, extra.stderr


def test_a_later_shards_differing_metadata_is_named_with_its_shard(tmp_path: Path) -> None:
    """Only the first shard's `__metadata__` was compared: two sharded models whose second
    shard was written again with a note of its own (`save_file(..., metadata=...)`) diffed
    IDENTICAL without a word. Every shard's metadata is compared now, and the note names the
    shard; against another sharding, the shards that hold each value are named."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = tiny_state()
    plain, noted = (hf_save(state, tmp_path / side, "2KB") for side in ("plain", "noted"))
    shards = sorted(noted.glob("*.safetensors"))
    assert len(shards) > 2
    last = shards[-1]
    save_file(load_file(last), last, metadata={"format": "pt", "note": "re-saved"})
    with safe_open(last, "pt") as f:
        assert f.metadata()["note"] == "re-saved"
    with safe_open(shards[0], "pt") as f:
        assert "note" not in f.metadata()
    found = run_ckpt("diff", plain, noted, "--json")
    assert found.exit_code == 0, found.stdout
    notes = [w for w in found.json["result"]["warnings"] if "note" in w]
    assert len(notes) == 1, found.json["result"]["warnings"]
    assert last.name in notes[0] and '"re-saved"' in notes[0] and "(none)" in notes[0]
    human = run_ckpt("diff", plain, noted)
    assert last.name in human.stderr and '"re-saved"' in human.stderr, human.stderr
    # another sharding of the same tensors: the shard that holds the note is named
    whole = tmp_path / "whole.safetensors"
    save_file(state, whole, metadata={"format": "pt"})
    across = run_ckpt("diff", whole, noted, "--json")
    assert across.exit_code == 0, across.stdout
    notes = [w for w in across.json["result"]["warnings"] if "note" in w]
    assert len(notes) == 1 and last.name in notes[0], across.json["result"]["warnings"]
    assert not run_ckpt("diff", plain, whole, "--json").json["result"]["warnings"]


def test_negative_zero_differs_from_zero_in_tensors_and_in_plain_floats_alike(
    tmp_path: Path,
) -> None:
    """`-0.0` against `0.0` was a difference in a tensor (bit for bit) and equal in a
    non-tensor float (a scheduler's `last_lr`, Python's `==`): one rule now, the bits, so a
    save whose plain float changed sign is DIFFERENT as its tensor twin is; a NaN still equals
    the same NaN."""
    for entry in ("tensor", "float"):
        a, b = tmp_path / f"{entry}-a.pt", tmp_path / f"{entry}-b.pt"
        for path, zero in ((a, 0.0), (b, -0.0)):
            value = torch.tensor([zero]) if entry == "tensor" else zero
            torch.save({"w": torch.ones(2), "x": value, "nan": math.nan}, path)
        found = run_ckpt("diff", a, b, "--json")
        assert found.exit_code == 1, (entry, found.stdout)
        assert [d["name"] for d in found.json["result"]["differences"]] == ["x"], entry
