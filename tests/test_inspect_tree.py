"""`inspect`'s module tree: every entry on one line of it, whatever its names look like."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ckpt_cli.ops.shared.tree import MAX_DEPTH

from .conftest import run_ckpt


def _leaves(nodes: list[dict[str, Any]], path: str = "") -> dict[str, int]:
    """Each node of a JSON tree that counts tensors of its own (its dotted path) -> how many."""
    found: dict[str, int] = {}
    for node in nodes:
        here = f"{path}.{node['name']}" if path else node["name"]
        below = sum(c["tensors"] for c in node["children"])
        assert node["tensors"] >= below, here
        if node["tensors"] > below:
            found[here] = node["tensors"] - below
        found.update(_leaves(node["children"], here))
    return found


def _depth(nodes: list[dict[str, Any]]) -> int:
    return max((1 + _depth(n["children"]) for n in nodes), default=0)


def test_a_name_of_thousands_of_dots_is_one_line_of_the_tree_not_a_crash(
    tmp_path: Path,
) -> None:
    """A tensor named `a.a.….w` (3,000 dots) made `inspect` fail with "a bug in ckpt"
    (RecursionError drawing the tree). Past `MAX_DEPTH` components the rest of the name is
    one node; every tensor is still counted."""
    file = tmp_path / "deep.safetensors"
    deep = "a." * 3000 + "w"
    save_file({deep: np.zeros(2, np.float32), "b": np.ones(3, np.float32)}, str(file))

    shown = run_ckpt("inspect", file)
    assert shown.exit_code == 0, shown.stdout
    assert "2 tensors" in shown.stdout and "a bug in ckpt" not in shown.stdout

    report = run_ckpt("inspect", file, "--json")
    assert report.exit_code == 0, report.stdout
    result = report.json["result"]
    with safe_open(str(file), framework="numpy") as f:
        assert sorted(e["name"] for e in result["entries"]) == sorted(f.keys())
    tree = result["tree"]
    assert _depth(tree) <= MAX_DEPTH
    assert sum(_leaves(tree).values()) == 2
    # the node past the limit holds the rest of the name, whole
    assert any(path.endswith("a.a.a.w") for path in _leaves(tree))


def test_numbered_blocks_fold_and_odd_components_stay_apart(tmp_path: Path) -> None:
    """Numbered blocks fold into one node per position, a name that is also a prefix keeps
    its own count, and odd components (`""`, `²`, digits beside letters) are nodes of their
    own: none of them is taken for a folded block."""
    names = [
        *(
            f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
            for i in range(3)
            for e in (0, 1, 5)
            for p in ("up", "down")
        ),
        *(
            f"model.layers.{i}.mlp.experts.{e}.up.weight_scale_inv"
            for i in range(3)
            for e in (0, 1, 5)
        ),
        "model.layers.7.norm",
        "model.layers.7",
        "model..empty",
        "model.x².w",
        "model.2a.w",
        "lm_head.weight",
    ]
    file = tmp_path / "m.safetensors"
    save_file({n: np.zeros(2, np.float32) for n in names}, str(file))
    report = run_ckpt("inspect", file, "--json")
    assert report.exit_code == 0, report.stdout
    leaves = _leaves(report.json["result"]["tree"])
    assert sum(leaves.values()) == len(names)
    assert leaves["model.layers.{0..2,7}.mlp.experts.{0..1,5}.up.weight"] == 9
    assert leaves["model.layers.{0..2,7}.mlp.experts.{0..1,5}.down.weight"] == 9
    assert leaves["model.layers.{0..2,7}.mlp.experts.{0..1,5}.up.weight_scale_inv"] == 9
    assert leaves["model.layers.{0..2,7}.norm"] == 1
    assert leaves["model..empty"] == 1
    assert leaves["model.x².w"] == 1 and leaves["model.2a.w"] == 1
    assert leaves["lm_head.weight"] == 1
    # `model.layers.7` is a tensor and a prefix: the folded node counts it on itself
    [model] = [n for n in report.json["result"]["tree"] if n["name"].startswith("model")]
    assert model["tensors"] == len(names) - 1
