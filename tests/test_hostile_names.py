"""Entry names from anyone: every command counts, prints and writes them, or refuses them
with the file, the problem and the fix; never "a bug in ckpt", a hang or quadratic work.

A name is any string a writer accepts: thousands of dots, only dots, empty, a megabyte long,
a prefix of another, `__metadata__`-like, with `/`, `..`, NUL, line breaks, ANSI escapes,
`{0..3}`, non-ASCII digits; a lone surrogate where pickle (torch.save, DCP) carries one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.numpy import save_file
from safetensors.torch import load_file

from ckpt_cli.formats.torch.flatten import MAX_DEPTH

from .conftest import REPO, run_ckpt, run_ckpt_process

#: every odd name at once: one checkpoint of each format holds them all
NAMES = [
    "a." * 3000 + "w",
    "a." * 100_000 + "w",
    ".....",
    "",
    "x" * 1_000_000,
    "p",
    "p.q",
    "p.q.r",
    "__metadata__.x",
    "__metadata",
    "a/b",
    "/abs",
    "../up",
    "a/../../b",
    "nul\x00name",
    "line\nbreak",
    "cr\r\nlf",
    "\x1b[31mred\x1b[0m",
    "\x1b]0;title\x07x",
    "layers.{0..3}.w",
    "layers.{0,1}.w",
    "layers.0.w",
    "layers.².w",
    "layers.٣.w",
]


def _tensors(names: list[str], bump: str | None = None) -> dict[str, torch.Tensor]:
    """One small tensor per name, each its own values; `bump` differs by one."""
    out = {n: torch.arange(4, dtype=torch.float32) + i for i, n in enumerate(names)}
    if bump is not None:
        out[bump] = out[bump] + 1
    return out


def _write(kind: str, folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`tensors` saved by the format's own writer."""
    folder.mkdir(parents=True)
    if kind == "safetensors":
        path = folder / "m.safetensors"
        save_file({k: v.numpy() for k, v in tensors.items()}, str(path))
        return path
    if kind == "sharded":
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(tensors, folder, max_shard_size=2_000_000)
        return folder
    if kind == "torch":
        path = folder / "m.pt"
        torch.save(tensors, path)
        return path
    dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    return folder


def _read(path: Path) -> dict[str, torch.Tensor]:
    """A written output, by the real reader of its format."""
    if path.is_dir() and any(path.glob("*.distcp")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path.parent / "from-dcp.pt")
        return dict(torch.load(path.parent / "from-dcp.pt", weights_only=True))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if files:
        out: dict[str, torch.Tensor] = {}
        for file in files:
            out.update(load_file(file))
        return out
    out = {}
    for file in sorted(path.glob("*.bin")):
        out.update(torch.load(file, weights_only=True))
    return out


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "torch", "dcp"])
def test_every_command_counts_every_odd_name(kind: str, tmp_path: Path) -> None:
    """One checkpoint holding every odd name: inspect (text, JSON, list, filter), verify
    (deep, checksums), diff, convert to each format and reshard count all of them and never
    fail; outputs hold the same names and values, by the real readers. Before, the empty
    name made convert and reshard refuse with "--rename turns '' into an empty name"
    (exit 2), though no --rename was given."""
    want = _tensors(NAMES)
    src = _write(kind, tmp_path / "a", want)
    other = _write(kind, tmp_path / "b", _tensors(NAMES, bump="line\nbreak"))

    for extra in ([], ["--list"], ["-k", "layers.*"]):
        shown = run_ckpt("inspect", src, *extra)
        assert shown.exit_code == 0, shown.stderr
        assert "\x1b" not in shown.stdout  # escapes are shown, never sent
    report = run_ckpt("inspect", src, "--json")
    assert report.exit_code == 0, report.stderr
    assert sorted(e["name"] for e in report.json["result"]["entries"]) == sorted(NAMES)

    manifest = tmp_path / "sums.json"
    assert run_ckpt("verify", src, "--write-manifest", "--manifest", manifest).exit_code == 0
    checked = run_ckpt("verify", src, "--deep", "--checksums", "--manifest", manifest)
    assert checked.exit_code == 0, checked.stdout + checked.stderr

    diff = run_ckpt("diff", src, other, "--json")
    assert diff.exit_code == 1, diff.stderr
    assert json.dumps(diff.json["result"]).count("line\\nbreak") >= 1
    assert run_ckpt("diff", src, src).exit_code == 0

    for to in ("safetensors", "torch", "dcp"):
        out = tmp_path / f"out-{to}"
        converted = run_ckpt("convert", src, out, "--to", to)
        assert converted.exit_code == 0, converted.stderr
        got = _read(out)
        assert sorted(got) == sorted(want), to
        assert all(torch.equal(got[n], want[n]) for n in want), to
    if kind != "dcp":  # --max-shard-size regroups safetensors and torch shards
        resharded = run_ckpt("reshard", src, tmp_path / "resharded", "--max-shard-size", "200KB")
        assert resharded.exit_code == 0, resharded.stderr
        got = _read(tmp_path / "resharded")
        assert sorted(got) == sorted(want)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_a_lone_surrogate_in_a_name_is_printed_as_an_escape(kind: str, tmp_path: Path) -> None:
    """pickle carries a lone surrogate (`'a\\ud800b'`) in a key; safetensors' JSON cannot.
    `inspect` and `diff` wrote it to stdout and failed with "UnicodeEncodeError ... This is a
    bug in ckpt" (exit 70), after the work was done. It is shown as `\\ud800`; --json keeps
    the real name."""
    name = "a\ud800b"
    src = _write(kind, tmp_path / "a", _tensors([name, "b"]))
    other = _write(kind, tmp_path / "b", _tensors([name, "b"], bump=name))

    for args in (["inspect", src], ["inspect", src, "--list"], ["diff", src, other]):
        shown = run_ckpt(*args)
        assert shown.exit_code in (0, 1), shown.stderr
        assert "a\\ud800b" in shown.stdout, args
    report = run_ckpt("inspect", src, "--json")
    assert report.exit_code == 0, report.stderr
    assert sorted(e["name"] for e in report.json["result"]["entries"]) == [name, "b"]
    if kind == "torch":  # a real process's stdout, as a terminal or a pipe gets it
        shown = run_ckpt_process("inspect", src)
        assert shown.exit_code == 0 and "a\\ud800b" in shown.stdout, shown.stderr


@pytest.mark.parametrize("name", ["__metadata__", "a\ud800b"])
def test_a_name_safetensors_cannot_hold_is_refused_before_writing(
    name: str, tmp_path: Path
) -> None:
    """`__metadata__` is the safetensors header's reserved key, and its JSON has no lone
    surrogate: converting a torch.save file holding such a name to safetensors wrote a file
    its own check refused, reported as "This is a bug in ckpt". It is refused up front (exit
    4), naming the tensor and the way out; dcp and torch keep the name."""
    src = tmp_path / "m.pt"
    torch.save(_tensors([name, "b"]), src)

    refused = run_ckpt("convert", src, tmp_path / "out", "--to", "safetensors")
    assert refused.exit_code == 4, refused.stderr
    assert "bug" not in refused.stderr and repr(name) in refused.stderr
    assert "--filter-out" in refused.stderr
    assert not (tmp_path / "out").exists()

    kept = run_ckpt("convert", src, tmp_path / "kept", "--to", "torch")
    assert kept.exit_code == 0, kept.stderr
    assert sorted(_read(tmp_path / "kept")) == sorted([name, "b"])


def test_dcp_safetensors_serialization_refuses_a_tensor_named_metadata(tmp_path: Path) -> None:
    """A DCP file's embedded safetensors blob keys chunks by name beside its `__metadata__`:
    a tensor of that name overwrote the metadata and the output failed ckpt's own check, "a
    bug in ckpt". It is refused before writing (exit 4); the default torch_save keeps it."""
    src = tmp_path / "m.pt"
    torch.save(_tensors(["__metadata__", "b"]), src)
    out = tmp_path / "out"
    refused = run_ckpt("convert", src, out, "--to", "dcp", "--dcp-serialization", "safetensors")
    assert refused.exit_code == 4, refused.stderr
    assert "bug" not in refused.stderr and "'__metadata__'" in refused.stderr
    assert not out.exists()
    kept = run_ckpt("convert", src, out, "--to", "dcp")
    assert kept.exit_code == 0, kept.stderr
    assert sorted(_read(out)) == ["__metadata__", "b"]


def test_a_state_dict_nested_as_deep_as_the_reader_admits_converts_to_torch(
    tmp_path: Path,
) -> None:
    """A torch.save dict nested nearly `MAX_DEPTH` deep reads fine, but `convert --to torch`
    rebuilt and pickled it recursively: RecursionError, "a bug in ckpt" (exit 70). Deeper
    than the budget stays a refusal (exit 4)."""

    def nested(depth: int) -> dict[str, Any]:
        value: dict[str, Any] = {"w": torch.arange(3.0)}
        for _ in range(depth):
            value = {"k": value}
        return {"root": value, "b": torch.ones(2)}

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 20 * MAX_DEPTH)  # torch.save itself pickles recursively
    try:
        torch.save(nested(MAX_DEPTH - 2), tmp_path / "deep.pt")
        torch.save(nested(MAX_DEPTH + 10), tmp_path / "deeper.pt")
    finally:
        sys.setrecursionlimit(limit)

    converted = run_ckpt("convert", tmp_path / "deep.pt", tmp_path / "out", "--to", "torch")
    assert converted.exit_code == 0, converted.stderr
    back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    depth, node = 0, back["root"]
    while "k" in node:
        depth, node = depth + 1, node["k"]
    assert depth == MAX_DEPTH - 2 and torch.equal(node["w"], torch.arange(3.0))
    assert run_ckpt("diff", tmp_path / "deep.pt", tmp_path / "out").exit_code == 0

    refused = run_ckpt("convert", tmp_path / "deeper.pt", tmp_path / "no", "--to", "torch")
    assert refused.exit_code == 4 and "nested more than" in refused.stderr


def test_merge_finds_the_lora_of_a_module_whose_name_holds_a_line_break(
    tmp_path: Path,
) -> None:
    """`ckpt merge` matched LoRA keys with a `.` that stops at a line break, so a module named
    `a\\nb.q` was "a LoRA tensor ckpt merge does not know" (exit 4). It merges like any other."""
    module = "a\nb.q"
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    save_file({f"{module}.weight": np.ones((4, 4), np.float32)}, str(base / "model.safetensors"))
    lora_a, lora_b = np.full((2, 4), 0.5, np.float32), np.full((4, 2), 0.25, np.float32)
    save_file(
        {
            f"base_model.model.{module}.lora_A.weight": lora_a,
            f"base_model.model.{module}.lora_B.weight": lora_b,
        },
        str(adapter / "adapter_model.safetensors"),
    )
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"]})
    )
    merged = run_ckpt("merge", base, adapter, tmp_path / "merged")
    assert merged.exit_code == 0, merged.stderr
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="numpy") as f:
        got = f.get_tensor(f"{module}.weight")
    np.testing.assert_array_equal(got, np.ones((4, 4), np.float32) + 2.0 * (lora_b @ lora_a))


_UNDER_CPU_LIMIT = """
import json, resource, sys
from typer.testing import CliRunner
from ckpt_cli.cli.app import get_app

resource.setrlimit(resource.RLIMIT_CPU, (int(sys.argv[1]), int(sys.argv[1])))
commands = json.loads(sys.argv[2])
codes = [CliRunner().invoke(get_app(), args, catch_exceptions=False).exit_code for args in commands]
print(json.dumps(codes))
"""


def test_thousands_of_names_sharing_a_long_prefix_are_not_quadratic(tmp_path: Path) -> None:
    """1,000 names sharing one 10 KB prefix (a 10 MB header): inspect's tree and list, diff
    and convert walk each name a bounded number of times. Work quadratic in the names and
    the prefix (comparing or rebuilding it per pair) would be ~10 G character steps; the
    commands run in one process under a CPU limit of 60 s, a large multiple of linear."""
    prefix = "p" * 10_000 + "."
    src = tmp_path / "m.safetensors"
    save_file({f"{prefix}{i}.w": np.zeros(1, np.float32) for i in range(1000)}, str(src))
    commands = [
        ["inspect", str(src)],
        ["inspect", str(src), "--list"],
        ["diff", str(src), str(src)],
        ["convert", str(src), str(tmp_path / "out"), "--to", "torch"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_CPU_LIMIT, "60", json.dumps(commands)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [0, 0, 0, 0]
    assert len(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)) == 1000


def test_a_message_quoting_a_megabyte_name_keeps_its_ends_not_every_character(
    tmp_path: Path,
) -> None:
    """Two overlapping tensors named with a million characters each: `verify` printed its
    problem as one 2 MB line. Human output keeps the start (what is wrong) and the end (the
    fix) and says how much it left out; `--json` keeps the whole message."""
    import struct

    from ckpt_cli.cli.render.terminal import MESSAGE_END_CHARS

    long = "x" * 1_000_000
    header = {
        long: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        long + "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file = tmp_path / "overlap.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))

    shown = run_ckpt("verify", file)
    assert shown.exit_code == 1
    [line] = [ln for ln in shown.stdout.splitlines() if "error overlap" in ln]
    assert len(line) < 3 * MESSAGE_END_CHARS
    assert "characters left out; --json has the whole message" in line
    assert line.endswith("do not use this file.")  # the fix, whole

    report = run_ckpt("verify", file, "--json")
    [problem] = [p for p in report.json["result"]["problems"] if p["code"] == "overlap"]
    assert long + "y" in problem["message"]
