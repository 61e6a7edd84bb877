"""The format-adapter contract (issue #14 §1): what each format declares on its classes is what
its readers and writers do, and the operations read those declarations instead of probing
objects or comparing format names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ckpt_cli.errors import FormatError
from ckpt_cli.formats import DETECT_NAMES, get_format, names, open_checkpoint, writable_formats
from ckpt_cli.formats.base import WriteOptions
from ckpt_cli.models import Entry

from .conftest import run_ckpt
from .parsed import parse

REPO = Path(__file__).resolve().parent.parent
#: the operations that move data between formats: they must not know any format by name
OPS = [
    "convert/run.py",
    "convert/plan.py",
    "reshard/run.py",
    "reshard/request.py",
    "reshard/world.py",
    "reshard/report.py",
    "shared/transfer.py",
    "verify/run.py",
    "prune/slim.py",
    "shared/components.py",
    "merge.py",
]


def _model(path: Path, n: int = 6) -> dict[str, object]:
    import torch
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.weight": torch.full((16, 4), float(i)) for i in range(n)}
    save_file(state, path)
    return dict(state)


def test_operations_compare_no_format_names_and_probe_no_methods() -> None:
    token = re.compile(r'"(dcp|torch|safetensors|hub|gguf)"')
    probe = re.compile(r"\b(getattr|hasattr)\(|type: ignore\[attr-defined\]")
    found = []
    for name in OPS:
        for number, line in enumerate((REPO / "ckpt_cli" / "ops" / name).read_text().splitlines()):
            if token.search(line) or probe.search(line):
                found.append(f"ops/{name}:{number + 1}: {line.strip()}")
    assert not found, "\n".join(found)


#: a literal made only of format suffixes: `.safetensors`, `.bin.index.json`, `.metadata`, `*.pt`
_SUFFIX_LITERAL = re.compile(
    r"\*?(\.(safetensors|distcp|metadata|bin|pt|pth|gguf|ckpt|pkl|index|json))*"
    r"\.(safetensors|distcp|metadata|bin|pt|pth|gguf|ckpt|pkl|index\.json)",
    re.IGNORECASE,
)
_FORMAT_TOKENS = {"safetensors", "dcp", "torch", "gguf", "hub"}
#: expressions that hold a format token (`manifest.format`, `fmt_name`, `to`, `kind`)
_FORMAT_VALUED = re.compile(r"format|fmt|\bto\b|\bkind\b")


def format_knowledge(source: str, path: str) -> list[str]:
    """Where `source` (the module at `path`, relative to the repository) knows a format by name.

    The rule (issue #26): file suffixes and format tokens are format knowledge and live in
    `ckpt_cli/formats/` alone; everything else asks it (`formats.names`, the `Format` classes'
    declared facts). Precisely, outside `formats/`:

    - a *bare suffix* literal (`".safetensors"`, `".bin.index.json"`, `".metadata"`, `"*.pt"`)
      is format knowledge. A framework's *file name* (`"optimizer.pt"`, `"trainer_state.json"`,
      `"model.safetensors"`, a regex of `mp_rank_XX_model_states.pt`) is that framework's naming:
      layout knowledge, allowed. In `layouts/`, a layout may also spell its framework's names as
      stem + suffix (`numbered_files("optimizer", ".bin")`, Lightning's `suffixes`,
      `removesuffix`), but it may not classify files by suffix: `endswith` / `startswith` tests
      and comparisons with a bare suffix, and module-level suffix constants, are flagged there too;
    - a format token compared with a format-valued expression (`manifest.format == "dcp"`,
      `to != "dcp"`, `"dcp" in c.formats`) is format knowledge: read the format's declared
      facts (`holds_objects`, `folder`, `layout_files`...) instead;
    - text for people is not knowledge: docstrings and f-strings are not scanned.
    """
    tree = parse(source, path)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skipped.add(id(body[0].value))  # docstrings
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(part) for part in ast.walk(node))
    in_layouts = path.startswith("ckpt_cli/sources/layouts/")
    flagged: list[tuple[int, str]] = []

    def suffixes_in(node: ast.AST) -> list[ast.Constant]:
        return [
            c
            for c in ast.walk(node)
            if isinstance(c, ast.Constant)
            and isinstance(c.value, str)
            and id(c) not in skipped
            and _SUFFIX_LITERAL.fullmatch(c.value)
        ]

    if in_layouts:
        tests: list[ast.AST] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("endswith", "startswith"):
                    tests += node.args
            elif isinstance(node, ast.Compare):
                tests += [node.left, *node.comparators]
        tests += [
            s.value for s in tree.body if isinstance(s, ast.Assign | ast.AnnAssign) and s.value
        ]
        found = [c for node in tests for c in suffixes_in(node)]
    else:
        found = suffixes_in(tree)
    flagged += [(c.lineno, f"suffix {c.value!r}") for c in found]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for side in sides:
            tokens = [
                c.value
                for c in ast.walk(side)
                if isinstance(c, ast.Constant) and c.value in _FORMAT_TOKENS
            ]
            others = [ast.unparse(s) for s in sides if s is not side]
            if tokens and any(_FORMAT_VALUED.search(o) for o in others):
                flagged += [(node.lineno, f"format token {v!r}") for v in tokens]
    return [f"{path}:{line}: {what}" for line, what in sorted(set(flagged))]


def test_the_format_knowledge_scan_tells_formats_from_layout_names() -> None:
    source = (
        '"""Docstrings may say `.safetensors`."""\n'
        "SUFFIXES = ('.pt', '.bin')\n"
        "NAMES = ('optimizer.pt', 'trainer_state.json')\n"
        "def f(name, manifest, to, module):\n"
        "    folder.numbered_files('optimizer', '.bin')\n"
        "    print(f'no {name}.metadata')\n"
        "    return (name.endswith('.safetensors.index.json'), manifest.format == 'dcp',\n"
        "            to != 'torch', module == 'torch', name == 'model.safetensors')\n"
    )
    assert format_knowledge(source, "ckpt_cli/sources/runs/x.py") == [
        "ckpt_cli/sources/runs/x.py:2: suffix '.bin'",
        "ckpt_cli/sources/runs/x.py:2: suffix '.pt'",
        "ckpt_cli/sources/runs/x.py:5: suffix '.bin'",
        "ckpt_cli/sources/runs/x.py:7: format token 'dcp'",
        "ckpt_cli/sources/runs/x.py:7: suffix '.safetensors.index.json'",
        "ckpt_cli/sources/runs/x.py:8: format token 'torch'",
    ]
    # a layout spells its framework's names (`numbered_files`) but classifies nothing by suffix
    assert format_knowledge(source, "ckpt_cli/sources/layouts/x.py") == [
        "ckpt_cli/sources/layouts/x.py:2: suffix '.bin'",
        "ckpt_cli/sources/layouts/x.py:2: suffix '.pt'",
        "ckpt_cli/sources/layouts/x.py:7: format token 'dcp'",
        "ckpt_cli/sources/layouts/x.py:7: suffix '.safetensors.index.json'",
        "ckpt_cli/sources/layouts/x.py:8: format token 'torch'",
    ]


@pytest.mark.slow
def test_format_knowledge_lives_in_formats_only() -> None:
    found = []
    for path in sorted((REPO / "ckpt_cli").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("ckpt_cli/formats/"):
            found += format_knowledge(path.read_text(), rel)
    assert not found, "ask `ckpt_cli.formats` (names, Format facts) instead:\n" + "\n".join(found)


def test_file_names_agree_with_the_adapters() -> None:
    torch_format, safetensors, dcp = (get_format(n) for n in ("torch", "safetensors", "dcp"))
    assert torch_format.single_file_suffixes == names.TORCH_SUFFIXES
    assert torch_format.index_suffix == names.TORCH_INDEX_SUFFIX
    assert safetensors.single_file_suffixes == (names.SAFETENSORS_SUFFIX,)
    assert safetensors.index_suffix == names.SAFETENSORS_INDEX_SUFFIX
    assert dcp.commit_marker == names.DCP_METADATA
    assert dcp.rank_file(0).endswith(names.DCP_DATA_SUFFIX)
    # every data suffix is one the format's detection pre-check accepts
    for token, suffixes in names.SAVE_SUFFIXES.items():
        for suffix in suffixes:
            assert DETECT_NAMES[token].fullmatch(f"x{suffix}"), (token, suffix)
    assert DETECT_NAMES["gguf"].fullmatch(f"x{names.GGUF_SUFFIX}")


@pytest.mark.parametrize(
    ("name", "weights", "index", "checkpoint_file"),
    [
        ("model.safetensors", "safetensors", None, True),
        ("sub/model-00001-of-00002.safetensors", "safetensors", None, True),
        ("pytorch_model.bin", "torch", None, True),
        ("epoch=1-step=10.ckpt", "torch", None, True),
        ("__0_0.distcp", "dcp", None, True),
        (".metadata", None, None, True),
        ("model.safetensors.index.json", None, "safetensors", False),
        ("pytorch_model.bin.index.json", None, "torch", False),
        ("model.pt.index.json", None, "torch", False),
        ("config.index.json", None, None, False),
        ("model.gguf", None, None, False),
        ("trainer_state.json", None, None, False),
    ],
)
def test_names_classify_files_by_format(
    name: str, weights: str | None, index: str | None, checkpoint_file: bool
) -> None:
    assert names.weight_format(name) == weights
    assert names.index_format(name) == index
    assert names.is_index_file(name) == (index is not None)
    assert names.is_checkpoint_file(name) == checkpoint_file
    assert names.is_single_file_weights(name) == (weights in ("safetensors", "torch"))
    assert names.holds_dcp([name, "config.json"]) == (weights == "dcp" or name == ".metadata")
    assert names.is_commit_marker(f"run/{name}") == (
        name == ".metadata" or name.endswith(".index.json")
    )


def test_every_writer_does_what_its_format_declares(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    plan = [Entry(name="w", dtype="float32", shape=[4, 2], nbytes=32)]
    tensor = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    assert writable_formats() == ["safetensors", "dcp", "torch"]
    for name in writable_formats():
        fmt = get_format(name)
        staging = tmp_path / name
        staging.mkdir()
        writer = fmt.writer(staging, plan, WriteOptions(world_size=2 if fmt.shards_by_rank else 1))
        # the chunk protocol is exactly the by-rank layout; objects exactly where declared
        assert writer.chunk_writes == fmt.shards_by_rank, name
        assert writer.accepts_objects == fmt.holds_objects, name
        assert writer.object_bytes == fmt.object_bytes, name
        if writer.chunk_writes:
            chunks = writer.chunks_of("w")
            assert [c.sizes for c in chunks] == [[2, 2], [2, 2]]
            for index, chunk in enumerate(chunks):
                rows = slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
                writer.write_chunk("w", index, tensor[rows].clone())
        else:
            with pytest.raises(FormatError):
                writer.write_chunk("w", 0, tensor)
            writer.write_tensor("w", tensor)
        files = {f.path for f in writer.finish()}
        with open_checkpoint(str(staging)) as back:
            assert back.manifest.format == name
            assert torch.equal(back.read_tensor("w"), tensor)
            assert {f.path for f in back.manifest.files} <= files | {fmt.commit_marker}
    with safe_open(tmp_path / "safetensors" / "model.safetensors", framework="pt") as fh:
        assert torch.equal(fh.get_tensor("w"), tensor)


def test_chunk_and_object_reads_where_a_format_stores_them(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    _model(tmp_path / "m.safetensors")
    with open_checkpoint(str(tmp_path / "m.safetensors")) as flat:
        assert not flat.chunk_reads and not flat.object_bytes
        with pytest.raises(FormatError, match="does not store tensors as chunks") as raised:
            flat.read_chunk("model.layers.0.weight", 0)
        assert raised.value.path == str(tmp_path / "m.safetensors")
        with pytest.raises(FormatError):
            flat.read_object_bytes("model.layers.0.weight")
    state = {"w": torch.arange(12.0).reshape(6, 2), "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with open_checkpoint(str(tmp_path / "dcp")) as chunked:
        assert chunked.chunk_reads and chunked.object_bytes
        assert torch.equal(chunked.read_chunk("w", 0), state["w"])
        blob = chunked.read_object_bytes("step")
        # a torch.save blob, handed over without unpickling it
        assert blob[:2] == b"PK"
        import io

        assert torch.load(io.BytesIO(blob), weights_only=True) == 7


@pytest.mark.parametrize(
    ("to", "extra"),
    [
        ("safetensors", ["--max-shard-size", "1KB"]),
        ("torch", ["--max-shard-size", "1KB"]),
        ("torch", []),
        ("dcp", ["--world-size", "3"]),
    ],
)
def test_a_dry_run_names_the_files_every_target_writes(
    tmp_path: Path, to: str, extra: list[str]
) -> None:
    _model(tmp_path / "m.safetensors", n=8)
    dest = tmp_path / "out"
    args = ("convert", tmp_path / "m.safetensors", dest, "--to", to, *extra)
    plan = run_ckpt(*args, "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert not dest.exists()
    done = run_ckpt(*args, "--json")
    assert done.exit_code == 0, done.stderr
    planned = {f["path"]: f["size"] for f in plan.json["result"]["files"]}
    written = {p.name: p.stat().st_size for p in dest.iterdir()}
    assert set(planned) == set(written)
    for name, size in planned.items():
        if size is not None:
            assert written[name] == size, name
    assert plan.json["result"]["world_size"] == (3 if to == "dcp" else None)


def test_dest_named_like_another_formats_file_is_refused(tmp_path: Path) -> None:
    _model(tmp_path / "m.safetensors")
    result = run_ckpt(
        "convert", tmp_path / "m.safetensors", tmp_path / "x.safetensors", "--to", "torch"
    )
    assert result.exit_code == 2
    assert "DEST names a safetensors file, but --to torch writes a .pt file or a folder" in (
        result.stderr
    )
    assert "--to safetensors, or name DEST x.pt" in result.stderr
    folder = run_ckpt("convert", tmp_path / "m.safetensors", tmp_path / "y.pt", "--to", "dcp")
    assert folder.exit_code == 2
    assert "DEST names a torch.save file, but --to dcp writes a folder" in folder.stderr
    assert "Use --to torch, or name DEST y to write that format" in folder.stderr
