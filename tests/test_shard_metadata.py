"""A sharded safetensors model whose shards carry different `__metadata__`.

safetensors keeps one string map per file. A model assembled from two saves (a shard
re-exported by another tool, a merge that re-wrote one shard) holds `{"format": "pt"}` in one
shard and more keys, or another value of a key, in the next. `convert` and `reshard` wrote the
FIRST shard's `__metadata__` into every output shard: the other shards' keys vanished without a
word, and a key they disagreed on took the first shard's value everywhere. The output now holds
every key the shards agree on (a key only some shards hold included), and a key with two values
is left out and named in the warnings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .conftest import run_ckpt


def _two_shard_model(folder: Path) -> Path:
    """Two shards written by safetensors with metadata that differs, and their index."""
    folder.mkdir()
    first = {"a.weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    second = {"b.weight": torch.ones(64, 64), "b.bias": torch.zeros(64)}
    save_file(
        second,
        folder / "model-00002-of-00002.safetensors",
        metadata={"format": "pt", "exported_by": "merge-tool 1.2", "revision": "b"},
    )
    # the first shard records another revision than the second: a key with two values
    save_file(
        first,
        folder / "model-00001-of-00002.safetensors",
        metadata={"format": "pt", "revision": "a"},
    )
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in second}
    total = sum(t.numel() * t.element_size() for t in [*first.values(), *second.values()])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _output_metadata(folder: Path) -> list[dict[str, str]]:
    shards = sorted(folder.glob("*.safetensors"))
    assert shards
    out = []
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            out.append(f.metadata())
    return out


def _warned_of_revision(warnings: list[str]) -> None:
    (said,) = [w for w in warnings if "revision" in w]
    assert "'a' in model-00001-of-00002.safetensors" in said
    assert "'b' in model-00002-of-00002.safetensors" in said


def test_reshard_keeps_the_metadata_every_shard_agrees_on(tmp_path: Path) -> None:
    src = _two_shard_model(tmp_path / "src")
    dest = tmp_path / "resharded"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    metadata = _output_metadata(dest)
    assert len(metadata) > 1
    assert all(m == {"format": "pt", "exported_by": "merge-tool 1.2"} for m in metadata)
    _warned_of_revision(result.json["result"]["warnings"])
    # the tensors are the source's, bit for bit
    read = {}
    for shard in dest.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            read |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert torch.equal(read["a.weight"], torch.arange(4096.0).reshape(64, 64))
    assert sorted(read) == ["a.weight", "b.bias", "b.weight"]


def test_convert_keeps_the_metadata_every_shard_agrees_on(tmp_path: Path) -> None:
    src = _two_shard_model(tmp_path / "src")
    dest = tmp_path / "converted"
    result = run_ckpt("convert", src, dest, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    metadata = _output_metadata(dest)
    assert all(m == {"format": "pt", "exported_by": "merge-tool 1.2"} for m in metadata)
    _warned_of_revision(result.json["result"]["warnings"])

    # shards that agree: nothing left out, nothing said
    same = tmp_path / "same"
    same.mkdir()
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        save_file(tensors, same / shard.name, metadata={"format": "pt"})
    (same / "model.safetensors.index.json").write_text(
        (src / "model.safetensors.index.json").read_text()
    )
    quiet = run_ckpt("convert", same, tmp_path / "quiet", "--to", "safetensors", "--json")
    assert quiet.exit_code == 0, quiet.stdout + quiet.stderr
    assert not [w for w in quiet.json["result"]["warnings"] if "__metadata__" in w]
    assert all(m == {"format": "pt"} for m in _output_metadata(tmp_path / "quiet"))


def test_convert_to_hf_through_a_naming_says_what_the_shards_disagree_on(
    tmp_path: Path,
) -> None:
    """A torchtitan-named model in safetensors shards that disagree on a key, exported `--to
    hf`: the key was left out of the output without a word (the mapping's view of the
    checkpoint did not pass the shards' disagreement through)."""
    from .test_architectures import _llama_hf

    _llama_hf(tmp_path / "hf")
    titan = tmp_path / "tt"
    assert run_ckpt("convert", tmp_path / "hf", titan, "--to", "torchtitan").exit_code == 0
    shards = tmp_path / "tt-shards"
    cut = run_ckpt("convert", titan, shards, "--to", "safetensors", "--max-shard-size", "20KB")
    assert cut.exit_code == 0, cut.stderr
    shutil.copy(titan / "config.json", shards / "config.json")
    files = sorted(shards.glob("*.safetensors"))
    assert len(files) > 1
    # each shard re-saved by safetensors with the revision of the save it came from
    for revision, shard in zip("ab", files[:2], strict=True):
        save_file(load_file(shard), shard, metadata={"format": "pt", "revision": revision})

    out = tmp_path / "back"
    result = run_ckpt("convert", shards, out, "--to", "hf", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    (said,) = [w for w in result.json["result"]["warnings"] if "revision" in w]
    assert f"'a' in {files[0].name}" in said and f"'b' in {files[1].name}" in said
    assert "left out of the output" in said
    assert all("revision" not in m for m in _output_metadata(out))
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        got |= load_file(shard)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_shards_that_disagree_on_format_are_told_the_format_the_output_holds(
    tmp_path: Path,
) -> None:
    """One shard saved with `format: np`, the other with `format: pt`: the warning said
    `format` was left out of the output, yet the safetensors writer sets `format: pt` in every
    file (transformers loads no other). It now says the output holds 'pt'."""
    src = _two_shard_model(tmp_path / "src")
    second = src / "model-00002-of-00002.safetensors"
    save_file(load_file(second), second, metadata={"format": "np", "revision": "a"})
    dest = tmp_path / "converted"
    result = run_ckpt("convert", src, dest, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert all(m == {"format": "pt", "revision": "a"} for m in _output_metadata(dest))
    (said,) = [w for w in result.json["result"]["warnings"] if "'format'" in w]
    assert "'pt' in model-00001-of-00002.safetensors" in said
    assert "'np' in model-00002-of-00002.safetensors" in said
    assert "left out" not in said and "the output holds 'pt'" in said, said


def test_a_reshard_of_shards_that_disagree_on_format_is_loaded_by_accelerate(
    tmp_path: Path,
) -> None:
    """`reshard` keeps the source's metadata, but a `format` the shards disagreed on was left
    out: accelerate's loader (`load_checkpoint_in_model`, `load_checkpoint_and_dispatch`)
    refuses a file whose metadata lacks `format` ("does not contain the valid metadata"). The
    output now holds `format: pt`, and the warning says so."""
    from accelerate.utils.modeling import load_state_dict

    src = _two_shard_model(tmp_path / "src")
    second = src / "model-00002-of-00002.safetensors"
    save_file(load_file(second), second, metadata={"format": "np", "revision": "a"})
    dest = tmp_path / "resharded"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert all(m == {"format": "pt", "revision": "a"} for m in _output_metadata(dest))
    (said,) = [w for w in result.json["result"]["warnings"] if "'format'" in w]
    assert "the output holds 'pt'" in said, said
    read: dict[str, torch.Tensor] = {}
    for shard in dest.glob("*.safetensors"):
        read |= load_state_dict(str(shard))
    assert sorted(read) == ["a.weight", "b.bias", "b.weight"]
    assert torch.equal(read["a.weight"], torch.arange(4096.0).reshape(64, 64))


def test_a_reshard_keeps_a_format_every_shard_agrees_on(tmp_path: Path) -> None:
    """A model saved with `format: flax` in every shard keeps it: reshard changes the cut,
    not what the files say they are."""
    src = _two_shard_model(tmp_path / "src")
    for shard in src.glob("*.safetensors"):
        save_file(load_file(shard), shard, metadata={"format": "flax"})
    dest = tmp_path / "resharded"
    result = run_ckpt("reshard", src, dest, "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert all(m == {"format": "flax"} for m in _output_metadata(dest))
    assert not [w for w in result.json["result"]["warnings"] if "__metadata__" in w]


def test_inspect_shows_a_long_metadata_value_cut_and_json_holds_it_whole(tmp_path: Path) -> None:
    """A writer's note of a megabyte in `__metadata__` filled the terminal: the text report
    printed it whole on one line. It now shows the start and the length; `--json` keeps it."""
    note = "x" * 1_000_000
    model = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, model, metadata={"format": "pt", "note": note})
    shown = run_ckpt("inspect", model)
    assert shown.exit_code == 0, shown.stderr
    assert len(shown.stdout) < 5_000
    assert (
        "format=pt" in shown.stdout and "(1,000,000 chars; --json shows it whole)" in shown.stdout
    )
    whole = run_ckpt("inspect", model, "--json")
    assert whole.json["result"]["metadata"]["note"] == note
