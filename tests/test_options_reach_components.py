"""Every option of a command reaches every component of a multi-part checkpoint.

A user points `ckpt` at a whole training save (a Trainer `checkpoint-N/`, an accelerate
`save_state` folder, a DCP training save), a diffusers pipeline or a PEFT adapter, and adds an
option: `--dtype`, `--max-shard-size`, `--filter`, `--dry-run`, `--write-manifest`... Each option
either takes effect on every component (judged with the real readers), or the report names the
component it left as it was, or the command refuses with a message naming the problem. Never is
one component silently different from what was asked. A `--dry-run` (and a plan-only `prune`)
writes nothing anywhere, sources included, and its report accounts for every component.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.formats.names import DCP_METADATA

from .conftest import run_ckpt
from .dist_helpers import dcp_save, training_state
from .run_fixtures import trainer_checkpoint, trainer_run

Builder = Callable[[pytest.FixtureRequest, Path], Path]


def _trainer(request: pytest.FixtureRequest, tmp: Path) -> Path:
    trainer_checkpoint(tmp / "run" / "checkpoint-300", 300, shards=True)
    return tmp / "run" / "checkpoint-300"


def _dcp_training(request: pytest.FixtureRequest, tmp: Path) -> Path:
    dcp_save(training_state(), tmp / "dcp")
    return tmp / "dcp"


def _megatron_legacy(request: pytest.FixtureRequest, tmp: Path) -> Path:
    from .test_megatron_legacy import legacy_save, megatron_args

    legacy_save(tmp / "iter_0000200", 200, 2, 2, megatron_args(2, 2))
    return tmp / "iter_0000200"


def _fixture(name: str, *path: str) -> Builder:
    def build(request: pytest.FixtureRequest, tmp: Path) -> Path:
        value: Any = request.getfixturevalue(name)
        if isinstance(value, tuple):  # (folder, what its framework loads from it)
            value = value[0]
        for part in path:
            value = value[part] if isinstance(value, dict) else value / part
        return Path(value)

    return build


_FRAMEWORKS = pytest.mark.frameworks
TRAINER = pytest.param(_trainer, id="trainer")
DCP = pytest.param(_dcp_training, id="dcp-training")
TRAINER_REAL = pytest.param(
    _fixture("trainer_runs", "full", "checkpoint-2"), id="trainer-real", marks=_FRAMEWORKS
)
ACCELERATE = pytest.param(
    _fixture("real_accelerate_run", "straight", "step-4"), id="accelerate-real", marks=_FRAMEWORKS
)
DIFFUSERS = pytest.param(_fixture("diffusers_pipeline"), id="diffusers", marks=_FRAMEWORKS)
PEFT = pytest.param(_fixture("lora_adapter"), id="peft", marks=_FRAMEWORKS)
# accelerate FSDP2 `save_state` on 2 ranks: `pytorch_model_fsdp_{0,1}/` and `optimizer_{0,1}/`
# DCP folders beside per-rank RNG files (a torchrun job, shared with test_accelerate_fsdp.py)
FSDP = pytest.param(
    _fixture("accelerate_fsdp_saves", "sharded"),
    id="accelerate-fsdp-sharded",
    marks=[_FRAMEWORKS, pytest.mark.torchrun, pytest.mark.timeout(1200)],
)
# a DeepSpeed ZeRO-2 run folder (`global_step2/` + `latest`) of 2 ranks, bf16 (torchrun)
DEEPSPEED = pytest.param(
    _fixture("zero_runs", "zero2"),
    id="deepspeed-zero2",
    marks=[_FRAMEWORKS, pytest.mark.torchrun, pytest.mark.timeout(1800)],
)
# a whole legacy Megatron-LM save: `mp_rank_{tp}_{pp}/model_optim_rng.pt` of a 2 x 2 grid
MEGATRON = pytest.param(_megatron_legacy, id="megatron-legacy")
# the same accelerate FSDP2 run saved with FULL_STATE_DICT: `pytorch_model_fsdp{,_1}.bin` and
# `optimizer{,_1}.bin` whole (gathered on rank 0), `random_states_{0,1}.pkl` per rank
FSDP_FULL = pytest.param(
    _fixture("accelerate_fsdp_saves", "full"),
    id="accelerate-fsdp-full",
    marks=[_FRAMEWORKS, pytest.mark.torchrun, pytest.mark.timeout(1200)],
)
# and through accelerate's per-rank path (`use_dcp=False`): every rank torch.save's its own part
# of every model and optimizer (`pytorch_model_fsdp_0_rank1.bin`, `optimizer_1_rank0.bin`...)
RANK_FILES = pytest.param(
    _fixture("accelerate_fsdp_rank_files"),
    id="accelerate-fsdp-rank-files",
    marks=[_FRAMEWORKS, pytest.mark.torchrun, pytest.mark.timeout(1200)],
)
# a torchtitan `step-3/` DCP folder written by its own CheckpointManager: model, optimizer,
# lr_scheduler, dataloader and train_state in one DCP
TITAN = pytest.param(
    _fixture("titan_run", "checkpoint", "step-3"),
    id="torchtitan",
    marks=[_FRAMEWORKS, pytest.mark.slow, pytest.mark.timeout(1200)],
)
TRAINING = [
    TRAINER,
    DCP,
    TRAINER_REAL,
    ACCELERATE,
    FSDP,
    DEEPSPEED,
    MEGATRON,
    FSDP_FULL,
    RANK_FILES,
    TITAN,
]
EVERY_LAYOUT = [*TRAINING, DIFFUSERS, PEFT]


# fixtures of other test modules, shared here (pytest finds them by name)
from .test_deepspeed import zero_runs  # noqa: E402,F401
from .test_torchtitan import titan_run  # noqa: E402,F401


def _files(root: Path) -> set[str]:
    return {
        Path(dirpath, name).relative_to(root).as_posix()
        for dirpath, _, names in os.walk(root)
        for name in names
    }


def _snapshot(*roots: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under `roots`: size, mtime and content digest."""
    seen: dict[str, tuple[int, int, str]] = {}
    for root in roots:
        for dirpath, dirs, names in os.walk(root):
            for name in dirs:
                seen[os.path.join(dirpath, name)] = (0, 0, "dir")
            for name in names:
                path = Path(dirpath, name)
                stat = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                seen[str(path)] = (stat.st_size, stat.st_mtime_ns, digest)
    return seen


def _tensors(src: Path) -> int:
    count: int = run_ckpt("inspect", src, "--json").json["result"]["tensors"]
    return count


# ---------------------------------------------------------------------------------------------
# --dry-run writes nothing anywhere, and its report names every component


DRY_RUNS = {
    "convert-torch-dtype": ("convert", "--to", "torch", "--dtype", "bf16"),
    "convert-safetensors-shards": ("convert", "--to", "safetensors", "--max-shard-size", "20KB"),
    "convert-dcp": ("convert", "--to", "dcp", "--dtype", "fp16"),
    "reshard-shard-size": ("reshard", "--max-shard-size", "20KB"),
}


@pytest.mark.parametrize("build", EVERY_LAYOUT)
@pytest.mark.parametrize("command", list(DRY_RUNS))
def test_a_dry_run_writes_nothing_anywhere_and_accounts_for_every_component(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder, command: str
) -> None:
    src = build(request, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    before = _snapshot(src, tmp_path)
    out = work / "out"
    verb, *options = DRY_RUNS[command]
    result = run_ckpt(verb, src, out, *options, "--dry-run", "--json")
    assert _snapshot(src, tmp_path) == before, "a dry run changed a file"
    assert not out.exists()
    if result.exit_code != 0:
        # refused up front: an option that does not apply to this layout (a usage error), or
        # a layout that cannot be cut so (a legacy Megatron-LM save loads whole), said with
        # the problem and the fix
        assert result.exit_code in (2, 4), result.stdout
        error = result.json["error"]
        assert str(src) in error["message"] or "--max-shard-size" in error["message"]
        assert error["fix"]
        return
    report = result.json["result"]
    assert report["dry_run"] is True
    names = _files(src)
    if verb == "convert":
        skipped = {s["name"] for s in report["skipped"] if s["kind"] == "file"}
        accounted = set(report["read"]) | set(report["extras"]) | skipped
        if report["config_written"]:  # rewritten (its dtype said), not copied
            accounted.add(Path(report["config_written"]).relative_to(out).as_posix())
        assert names <= accounted, f"not in the dry-run report: {sorted(names - accounted)}"
        assert report["tensors"] == _tensors(src)
    else:
        # the training state is carried by name; every tensor of the rest is planned
        assert report["tensors"] == _tensors(src) - _carried_tensors(src, report)
        assert report["tensors"] > 0


def _carried_tensors(src: Path, report: dict[str, Any]) -> int:
    """The tensors of the files a reshard carries unchanged (the training state beside the
    weights it re-cuts)."""
    entries = run_ckpt("inspect", src, "--list", "--json").json["result"]["entries"]
    carried = set(report["carried"])
    return sum(1 for e in entries if e["kind"] == "tensor" and e.get("file") in carried)


PRUNES = {
    "keep-last": ("--keep-last", "1"),
    "slim": ("--slim-older-than", "1"),
}


def _synthetic_run(request: pytest.FixtureRequest, tmp: Path) -> Path:
    return trainer_run(tmp / "run", (100, 200, 300))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_synthetic_run, id="trainer"),
        pytest.param(_fixture("trainer_runs", "full"), id="trainer-real", marks=_FRAMEWORKS),
        pytest.param(
            _fixture("real_accelerate_run", "straight"), id="accelerate-real", marks=_FRAMEWORKS
        ),
        # torchtitan's `checkpoint/step-{1,2,3}`: each step one DCP, rewritten to slim it
        pytest.param(
            _fixture("titan_run", "checkpoint"),
            id="torchtitan",
            marks=[_FRAMEWORKS, pytest.mark.slow, pytest.mark.timeout(1200)],
        ),
    ],
)
@pytest.mark.parametrize("policy", list(PRUNES))
def test_prune_dry_run_writes_nothing_and_plans_every_component(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder, policy: str
) -> None:
    run = build(request, tmp_path)
    before = _snapshot(run, tmp_path)
    # --settle 0: the saves a fixture just wrote count as finished ones
    policy_options = (*PRUNES[policy], "--settle", "0")
    result = run_ckpt("prune", run, *policy_options, "--yes", "--dry-run", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert _snapshot(run, tmp_path) == before, "a dry run changed a file"
    decisions = result.json["result"]["decisions"]
    saves = sorted(p.name for p in run.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert sorted(Path(d["path"]).name for d in decisions) == saves
    slims = [d["slim"] for d in decisions if d["action"] == "slim"]
    assert (policy == "slim") == bool(slims)
    for slim in slims:
        if slim["how"] == "rewrite":  # one DCP holds every component: its entries go by name
            target = Path(slim["target"])
            names = {
                e["name"]
                for e in run_ckpt("inspect", target, "--list", "--json").json["result"]["entries"]
            }
            assert "optimizer." in slim["prefixes"] and set(slim["components"]) >= {"optimizer"}
            for prefix, component in zip(slim["prefixes"], slim["components"], strict=True):
                assert prefix == f"{component}." and any(n.startswith(prefix) for n in names)
            assert slim["bytes"] > 0 and not slim["listing"]
            continue
        listed = {f["path"] for f in slim["listing"]}
        assert listed == _files(Path(slim["target"])), "the slim plan leaves a file unnamed"
        assert all(f["why"] for f in slim["listing"])
        assert any(f["removed"] and "optimizer" in f["path"] for f in slim["listing"])


# ---------------------------------------------------------------------------------------------
# --dtype: every floating tensor of every component, or named where it is kept


def _load_all(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch.save output (one file, or a folder of them: each rank folder's
    file of a legacy Megatron-LM save), by dotted name, read by torch.load."""
    found: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}" if prefix else str(i), item)

    for path in sorted(out.rglob("*")) if out.is_dir() else [out]:
        if path.is_file() and not path.name.endswith(".json"):
            prefix = path.relative_to(out).as_posix() if out.is_dir() else ""
            walk(prefix, torch.load(path, weights_only=False, map_location="cpu"))
    return found


@pytest.mark.parametrize("build", TRAINING)
def test_dtype_casts_every_component_and_names_the_counters_it_keeps(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    src = build(request, tmp_path)
    before = _snapshot(src)
    # a legacy Megatron-LM save is written rank folder by rank folder, into a folder
    out = tmp_path / ("whole" if (src / "mp_rank_00_000").is_dir() else "whole.pt")
    result = run_ckpt("convert", src, out, "--to", "torch", "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert _snapshot(src) == before, "convert changed its source"
    report = result.json["result"]
    tensors = _load_all(out)
    floating = {n: t for n, t in tensors.items() if t.is_floating_point()}
    kept = sorted(n for n, t in floating.items() if t.dtype != torch.bfloat16)
    counters = [n for n in kept if n.rpartition(".")[2] == "step" and floating[n].numel() == 1]
    # optimizer moments, model weights: all cast; only the step counters stay as stored
    assert kept == counters, kept
    assert any(".exp_avg" in n and floating[n].dtype == torch.bfloat16 for n in floating)
    if counters:
        # said once per file written (a legacy Megatron-LM save: per rank folder), counted
        said = [w for w in report["warnings"] if "step counter" in w]
        assert said, report["warnings"]
        counted = [int(w.split(": ", 1)[1].split(" ", 1)[0]) for w in said]
        assert sum(counted) == len(counters), said
        assert all("float32" in w for w in said)


@pytest.mark.parametrize("build", [DCP, FSDP_FULL, RANK_FILES, TITAN])
def test_dtype_into_dcp_casts_every_component_as_dcp_load_reads_it(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    """`convert --to dcp --dtype bf16` of a whole training save: dcp.load reads every floating
    tensor of every component (each rank's part of a per-rank save too) as bf16, equal to the
    source's value cast, the step counters as stored."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dist_helpers import dcp_load_flat

    src = build(request, tmp_path)
    plain, cast = tmp_path / "plain", tmp_path / "cast"
    for out, options in ((plain, ()), (cast, ("--dtype", "bf16"))):
        result = run_ckpt("convert", src, out, "--to", "dcp", *options, "--json")
        assert result.exit_code == 0, result.stdout + result.stderr
    stored = FileSystemReader(str(cast)).read_metadata().state_dict_metadata
    tensors = {
        n: m.properties.dtype for n, m in stored.items() if isinstance(m, TensorStorageMetadata)
    }
    assert len(tensors) == _tensors(src)
    kept = sorted(n for n, d in tensors.items() if d.is_floating_point and d != torch.bfloat16)
    assert all(n.rpartition(".")[2] == "step" for n in kept), kept
    # every component holds a cast tensor: the weights' and each optimizer's (every rank's)
    cast_components = {n.split(".")[0] for n, d in tensors.items() if d == torch.bfloat16}
    optimizers = {n.split(".")[0] for n in tensors if n.startswith("optimizer")}
    assert optimizers and optimizers <= cast_components, optimizers - cast_components
    listed = {
        e["name"]: e
        for e in run_ckpt("inspect", plain, "--list", "--json").json["result"]["entries"]
    }
    template = {
        n: torch.empty(listed[n]["shape"], dtype=getattr(torch, listed[n]["dtype"]))
        for n in tensors
    }
    want = dcp_load_flat(plain, template)
    got = dcp_load_flat(
        cast, {n: torch.empty(t.shape, dtype=tensors[n]) for n, t in template.items()}
    )
    for name, tensor in want.items():
        expected = tensor.to(tensors[name])
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name


def test_dtype_says_so_when_it_keeps_a_lone_step_counter(tmp_path: Path) -> None:
    """A one-element `step` tensor is kept as stored under --dtype wherever it is: the report
    says so, rather than leave one float32 tensor in a bf16 output unexplained."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 4), "step": torch.ones(1)}, tmp_path / "m.safetensors")
    cast = run_ckpt(
        "convert",
        tmp_path / "m.safetensors",
        tmp_path / "c.pt",
        "--to",
        "torch",
        "--dtype",
        "bf16",
        "--json",
    )
    assert cast.exit_code == 0, cast.stdout
    said = [w for w in cast.json["result"]["warnings"] if "step counter" in w]
    assert said and "1 optimizer step counter" in said[0]
    assert torch.load(tmp_path / "c.pt")["step"].dtype == torch.float32
    assert torch.load(tmp_path / "c.pt")["w"].dtype == torch.bfloat16


@pytest.mark.parametrize("build", [DIFFUSERS, PEFT])
def test_dtype_reaches_every_model_folder(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    from safetensors import safe_open

    src = build(request, tmp_path)
    before = _snapshot(src)
    out = tmp_path / "out"
    result = run_ckpt("convert", src, out, "--to", "safetensors", "--dtype", "fp16", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert _snapshot(src) == before
    written = sorted(out.rglob("*.safetensors"))
    assert {p.parent.relative_to(out) for p in written} == {
        p.parent.relative_to(src) for p in src.rglob("*.safetensors")
    }, "a component folder's weights are missing from the output"
    for path in written:
        with safe_open(path, "pt") as f:
            names = f.keys()
            dtypes = {f.get_slice(k).get_dtype() for k in names}
        assert dtypes == {"F16"}, (path, dtypes)


# ---------------------------------------------------------------------------------------------
# --max-shard-size: every component cut, or named where it is carried


@pytest.mark.parametrize("to", ["torch", "safetensors"])
@pytest.mark.parametrize("build", [TRAINER, TRAINER_REAL, ACCELERATE, FSDP_FULL, RANK_FILES, TITAN])
def test_max_shard_size_of_a_training_folder_writes_shards_that_read_back_whole(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder, to: str
) -> None:
    """A Trainer folder's `trainer_state.json` holds the run's log (a list of dicts): written
    into a torch shard under its dotted name, it read back as one entry per logged value, and
    the torch output failed its own structural check ("a bug in ckpt")."""
    src = build(request, tmp_path)
    out = tmp_path / "out"
    # a third of the weights: every layout here is cut into several shards
    size = run_ckpt("inspect", src, "--json").json["result"]["tensor_bytes"] // 3
    result = run_ckpt("convert", src, out, "--to", to, "--max-shard-size", str(size), "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    shards = [f for f in result.json["result"]["files"] if not f["path"].endswith(".json")]
    assert len(shards) > 1
    for shard in shards:  # the real readers open every shard
        path = out / shard["path"]
        if to == "torch":
            assert isinstance(torch.load(path, weights_only=False), dict)
        else:
            from safetensors.torch import load_file

            assert load_file(path)
    same = run_ckpt("diff", src, out, "--json")
    verdict = same.json["result"]
    if to == "torch":  # a torch target holds every component
        assert verdict["identical"] is True, (verdict["only_a"][:5], verdict["only_b"][:5])
    assert verdict["compared"] == result.json["result"]["tensors"] + (
        result.json["result"]["objects"] if to == "torch" else 0
    )
    checked = run_ckpt("verify", out, "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.parametrize("build", [TRAINER, TRAINER_REAL])
def test_reshard_by_size_names_the_training_state_it_carries(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    src = build(request, tmp_path)
    out = tmp_path / "out"
    result = run_ckpt("reshard", src, out, "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    state = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    assert state <= set(report["carried"])
    for name in state:  # carried byte for byte
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert run_ckpt("diff", src, out).exit_code == 0


# ---------------------------------------------------------------------------------------------
# --filter / --filter-out: the same names in every component, in inspect, diff and convert


@pytest.mark.parametrize("build", [TRAINER, DCP, DIFFUSERS, FSDP_FULL, RANK_FILES, TITAN])
def test_filter_sees_every_component_in_inspect_diff_and_convert(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    src = build(request, tmp_path)
    entries = run_ckpt("inspect", src, "--list", "--json").json["result"]["entries"]
    components = sorted({e["name"].split(".")[0] for e in entries if "." in e["name"]})
    assert len(components) > 1
    for component in components:
        shown = run_ckpt("inspect", src, "--list", "--filter", f"{component}.*", "--json")
        names = {e["name"] for e in shown.json["result"]["entries"]}
        assert names == {e["name"] for e in entries if e["name"].startswith(component + ".")}
        left = run_ckpt("inspect", src, "--list", "--filter-out", f"{component}.*", "--json")
        assert not [e for e in left.json["result"]["entries"] if e["name"] in names]
    out = tmp_path / "out.pt" if not (src / "model_index.json").exists() else tmp_path / "out"
    to = "torch" if out.suffix else "safetensors"
    last = components[-1]
    cut = run_ckpt("convert", src, out, "--to", to, "--filter", f"{last}.*", "--json")
    assert cut.exit_code == 0, cut.stdout + cut.stderr
    diffed = run_ckpt("diff", src, out, "--filter", f"{last}.*", "--json")
    assert diffed.json["result"]["identical"] is True, diffed.stdout
    assert diffed.json["result"]["compared"] == sum(
        1
        for e in entries
        if e["name"].startswith(last + ".") and (to == "torch" or e["kind"] == "tensor")
    )


# ---------------------------------------------------------------------------------------------
# verify --write-manifest / --checksums: every component's files


@pytest.mark.parametrize("build", EVERY_LAYOUT)
def test_the_checksum_manifest_covers_every_component(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    import json
    import shutil

    src = shutil.copytree(build(request, tmp_path), tmp_path / "copy")
    manifest = tmp_path / "manifest.json"
    written = run_ckpt("verify", src, "--write-manifest", "--manifest", manifest, "--json")
    assert written.exit_code == 0, written.stdout
    recorded = set(json.loads(manifest.read_text())["files"])
    assert recorded == _files(src), "the manifest leaves a file out"
    # one byte changed in the smallest file of each folder: --checksums names it
    for folder in sorted({Path(n).parent for n in recorded}):
        victim = min(
            (n for n in recorded if Path(n).parent == folder),
            key=lambda n: (src / n).stat().st_size,
        )
        data = bytearray((src / victim).read_bytes())
        data[len(data) // 2] ^= 0x01
        (src / victim).write_bytes(bytes(data))
        checked = run_ckpt("verify", src, "--checksums", "--manifest", manifest, "--json")
        if checked.exit_code in (3, 4):  # a pointer file (DeepSpeed's `latest`) read as garbage
            assert checked.json["error"]["path"] == str(src / victim), checked.stdout
            data[len(data) // 2] ^= 0x01
            (src / victim).write_bytes(bytes(data))
            continue
        assert checked.exit_code == 1, checked.stdout
        blamed = {
            p["file"]
            for p in checked.json["result"]["problems"]
            if p["code"] == "checksum_mismatch"
        }
        assert str(src / victim) in blamed
        data[len(data) // 2] ^= 0x01
        (src / victim).write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
# download --filter / --dry-run: a Trainer save on the Hub, its weights and its training state


STATE_FILES = ["optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]


@pytest.mark.parametrize("mode", ["shards", "tensors"])
def test_download_filter_naming_the_training_state_says_it_fetched_nothing(
    hub: Any, tmp_path: Path, mode: str
) -> None:
    """`inspect --list hf://org/run` names the optimizer's entries (`optimizer.state.0.
    exp_avg`); `download --filter 'model.*' --filter 'optimizer.*'` fetched the weights, left
    the optimizer behind and said nothing of the second glob."""
    trainer_checkpoint(tmp_path / "save", 300, shards=True)
    hub.add_repo("org/run", tmp_path / "save")
    shown = run_ckpt("inspect", "hf://org/run", "--list", "--filter", "optimizer.*", "--json")
    assert shown.json["result"]["entries"], "inspect names the optimizer's entries"

    both = tmp_path / "both"
    result = run_ckpt(
        "download",
        "hf://org/run",
        both,
        "--mode",
        mode,
        "--filter",
        "model.*",
        "--filter",
        "optimizer.*",
        "--json",
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    said = [w for w in report["warnings"] if "'optimizer.*'" in w]
    assert said and "optimizer.pt" in said[0] and "--include" in said[0], report["warnings"]
    assert not [w for w in report["warnings"] if "'model.*'" in w]
    assert not (both / "optimizer.pt").exists()
    skipped = {s["name"] for s in report["skipped"]}
    assert set(STATE_FILES) <= skipped  # and each left-behind state file is named

    alone = tmp_path / "alone"
    refused = run_ckpt(
        "download", "hf://org/run", alone, "--mode", mode, "--filter", "optimizer.*", "--json"
    )
    assert refused.exit_code == 3, refused.stdout
    error = refused.json["error"]
    assert "no weight matches optimizer.*" in error["message"]
    assert "optimizer.pt" in error["message"] and "--include" in error["fix"]
    assert not alone.exists()


def test_download_dry_run_writes_nothing_and_lists_every_component(
    hub: Any, tmp_path: Path
) -> None:
    trainer_checkpoint(tmp_path / "save", 300, shards=True)
    hub.add_repo("org/run", tmp_path / "save")
    before = _snapshot(tmp_path / "save")
    dest = tmp_path / "dest"
    planned = run_ckpt("download", "hf://org/run", dest, "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert not dest.exists()
    assert _snapshot(tmp_path / "save") == before
    report = planned.json["result"]
    assert report["dry_run"] is True
    listed = {f["path"]: f["kind"] for f in report["files"]}
    assert {n: listed.get(n) for n in STATE_FILES} == dict.fromkeys(STATE_FILES, "state")
    weights = {n for n, kind in listed.items() if kind == "weights"}
    assert weights == {p.name for p in (tmp_path / "save").glob("model-*")}
    fetched = run_ckpt("download", "hf://org/run", dest, "--json")
    assert fetched.exit_code == 0, fetched.stdout
    assert _files(dest) == set(listed)  # the dry run listed what the download writes


# ---------------------------------------------------------------------------------------------
# sync --dry-run: nothing written on either side; the plan names every component's files


def _synthetic_two_saves(request: pytest.FixtureRequest, tmp: Path) -> Path:
    return trainer_run(tmp / "run", (100, 200))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_synthetic_two_saves, id="trainer"),
        pytest.param(
            _fixture("titan_run", "checkpoint"),
            id="torchtitan",
            marks=[_FRAMEWORKS, pytest.mark.slow, pytest.mark.timeout(1200)],
        ),
    ],
)
def test_sync_dry_run_writes_nothing_and_plans_every_component_file(
    s3_server: Any, request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    from .s3_fixtures import list_keys, make_bucket

    make_bucket(s3_server.endpoint, "ckpts")
    run = build(request, tmp_path)
    s3_server.requests.clear()  # the bucket's creation
    before = _snapshot(run, tmp_path)
    result = run_ckpt("sync", run, "s3://ckpts/run/", "--dry-run", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert _snapshot(run, tmp_path) == before
    assert not [r for r in s3_server.requests if r.method in ("PUT", "POST", "DELETE")]
    assert not list(list_keys(s3_server.endpoint, "ckpts", "run/"))
    report = result.json["result"]
    planned = {c["name"]: c for c in report["checkpoints"]}
    assert set(planned) == {p.name for p in run.iterdir() if p.is_dir()}
    for name, plan in planned.items():  # every file of every component, counted and sized
        files = _files(run / name)
        assert plan["files"] == len(files), (name, plan)
        assert plan["bytes"] == sum((run / name / f).stat().st_size for f in files)


# ---------------------------------------------------------------------------------------------
# reshard --world-size of a DCP training save: every component, the optimizer's included


def test_reshard_world_size_reaches_the_optimizer_and_a_dry_run_writes_nothing(
    tmp_path: Path,
) -> None:
    from .dist_helpers import dcp_load_flat

    dcp_save(training_state(), tmp_path / "dcp")
    src = tmp_path / "dcp"
    out = tmp_path / "out"
    before, source = _snapshot(tmp_path), _snapshot(src)
    planned = run_ckpt("reshard", src, out, "--world-size", "2", "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert _snapshot(tmp_path) == before and not out.exists()
    done = run_ckpt("reshard", src, out, "--world-size", "2", "--json")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert planned.json["result"]["tensors"] == done.json["result"]["tensors"] == _tensors(src)
    assert _snapshot(src) == source, "reshard changed its source"
    template = {
        e["name"]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        for e in run_ckpt("inspect", src, "--list", "--json").json["result"]["entries"]
        if e["kind"] == "tensor"
    }
    original = dcp_load_flat(src, {n: t.clone() for n, t in template.items()})
    resharded = dcp_load_flat(out, {n: t.clone() for n, t in template.items()})
    assert any(n.startswith("optimizer.state.") for n in template)
    for name, tensor in original.items():  # the real reader: every tensor, bit for bit
        assert torch.equal(resharded[name], tensor), name


# ---------------------------------------------------------------------------------------------
# reshard of the saves accelerate loads file by file (FULL_STATE_DICT, per-rank files) and of
# a torchtitan step: every component re-cut or carried, or refused naming the files and a fix
# that works as written


@pytest.mark.parametrize("build", [ACCELERATE, FSDP, FSDP_FULL, RANK_FILES])
def test_reshard_by_size_of_an_accelerate_fsdp_save_names_its_weight_files_and_a_working_fix(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    """accelerate loads each model file whole (per rank, for `use_dcp=False`): --max-shard-size
    is refused. For the per-rank save the message named `model.safetensors`, a file it does not
    hold, and its fix (`--select model`, or `--world-size N`) failed in turn: no entry is
    `model` there, and --world-size refuses per-rank files. For the others, the fix's
    `convert` command stopped at "Missing option '--to'"."""
    import re

    src = build(request, tmp_path)
    out = tmp_path / "out"
    before = _snapshot(src)
    refused = run_ckpt("reshard", src, out, "--max-shard-size", "20KB", "--json")
    assert refused.exit_code == 2, refused.stdout + refused.stderr
    assert not out.exists() and _snapshot(src) == before
    error = refused.json["error"]
    named = re.findall(r"`([^`]+)`", error["problem"])
    assert named, error["problem"]
    for name in named:  # the weights as saved, read by their own reader
        if name.endswith("/"):  # a SHARDED_STATE_DICT model: a DCP folder
            from torch.distributed.checkpoint import FileSystemReader

            assert FileSystemReader(str(src / name)).read_metadata().state_dict_metadata
            continue
        assert (src / name).is_file(), f"the message names {name}, which {src} does not hold"
        assert torch.load(src / name, weights_only=True)
    # the fix's command, run as written, cuts every component it keeps by size
    command = re.search(r"`ckpt (convert [^`]+)`", error["fix"])
    assert command, error["fix"]
    values = {"SRC": src, "DEST": out, "SIZE": "20KB"}
    done = run_ckpt(*[values.get(a, a) for a in command.group(1).split()], "--json")
    assert done.exit_code == 0, done.stdout + done.stderr
    shards = [f["path"] for f in done.json["result"]["files"] if not f["path"].endswith(".json")]
    assert len(shards) > 1
    assert run_ckpt("verify", out).exit_code == 0


@pytest.mark.parametrize("build", [FSDP_FULL, RANK_FILES, TITAN])
def test_reshard_world_size_reaches_every_component_or_names_what_it_cannot_recut(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder
) -> None:
    """Saved on 2 ranks (FSDP) or 1 (torchtitan), re-cut for 4 or 2: the weights and the
    optimizer of a FULL_STATE_DICT save are world-size free (carried byte for byte), a
    torchtitan step is re-cut whole (read back by dcp.load, bit for bit), and per-rank files
    are refused. The per-rank RNG / data-loader state asks for --rank-state, by file name."""
    from .dist_helpers import dcp_load_flat

    src = build(request, tmp_path)
    titan = (src / DCP_METADATA).is_file()
    world = "2" if titan else "4"
    out = tmp_path / "out"
    before, source = _snapshot(src, tmp_path), _snapshot(src)
    asked = run_ckpt("reshard", src, out, "--world-size", world, "--json")
    assert asked.exit_code == 2, asked.stdout + asked.stderr
    message = asked.json["error"]["message"]
    if "one file per rank" in message:  # accelerate's per-rank files: nothing re-cuts them
        assert "optimizer_0_rank0.bin" in message and "--to dcp" in asked.json["error"]["fix"]
        kept = run_ckpt("reshard", src, out, "--world-size", world, "--rank-state", "keep")
        assert kept.exit_code == 2 and "one file per rank" in kept.stderr
        assert _snapshot(src, tmp_path) == before and not out.exists()
        return
    per_rank = ["dataloader.dp_rank_0"] if titan else ["random_states_0.pkl", "random_states_1.pkl"]
    assert all(name in message for name in per_rank), message
    assert "--rank-state" in message
    options = ("--world-size", world, "--rank-state", "replicate", "--json")
    planned = run_ckpt("reshard", src, out, *options, "--dry-run")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert _snapshot(src, tmp_path) == before and not out.exists()
    done = run_ckpt("reshard", src, out, *options)
    assert done.exit_code == 0, done.stdout + done.stderr
    assert _snapshot(src) == source, "reshard changed its source"
    report = done.json["result"]
    assert planned.json["result"]["tensors"] == report["tensors"]
    if titan:
        template = {
            e["name"]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            for e in run_ckpt("inspect", src, "--list", "--json").json["result"]["entries"]
            if e["kind"] == "tensor"
        }
        assert report["tensors"] == len(template)
        assert {n.split(".")[0] for n in template} >= {"optimizer", "tok_embeddings", "layers"}
        original = dcp_load_flat(src, {n: t.clone() for n, t in template.items()})
        resharded = dcp_load_flat(out, {n: t.clone() for n, t in template.items()})
        for name, tensor in original.items():  # the real reader: every tensor, bit for bit
            assert torch.equal(resharded[name], tensor), name
        verdict = run_ckpt("diff", src, out, "--json").json["result"]
        # rank 0's data-loader position handed to the new rank 1, the world size said
        assert verdict["only_a"] == [] and verdict["only_b"] == ["dataloader.dp_rank_1"]
        assert [d["name"] for d in verdict["differences"]] == ["dataloader.world_size"]
        return
    # FULL_STATE_DICT: each model and optimizer file whole, the same for any world size
    assert report["tensors"] == 0
    whole = {p.name for p in src.iterdir() if not p.name.startswith("random_states_")}
    assert set(report["carried"]) == whole
    for name in whole:  # carried byte for byte, torch.load reads it
        assert (out / name).read_bytes() == (src / name).read_bytes()
        assert torch.load(out / name, weights_only=True) is not None
    rng = sorted(p.name for p in out.glob("random_states_*"))
    assert rng == [f"random_states_{r}.pkl" for r in range(4)]
    for r in (2, 3):  # the new ranks start from rank 0's RNG
        assert (out / rng[r]).read_bytes() == (src / "random_states_0.pkl").read_bytes()
    assert run_ckpt("verify", out).exit_code == 0


@pytest.mark.parametrize("build", [FSDP_FULL, RANK_FILES, TITAN])
def test_download_dry_run_of_a_save_on_the_hub_lists_every_component_file(
    request: pytest.FixtureRequest, hub: Any, tmp_path: Path, build: Builder
) -> None:
    """A user pushes the whole save (a Trainer's `last-checkpoint/`, a torchtitan step) to the
    Hub: `download --dry-run` lists every component's file, each rank's included, writes
    nothing; the download then writes exactly those files, byte for byte. A torchtitan step
    was refused as holding "no safetensors checkpoint (nor torch.save weights)"; --filter,
    which cannot pick tensors out of a DCP's files, is refused saying so."""
    src = build(request, tmp_path)
    hub.add_repo("org/save", src)
    dest = tmp_path / "dest"
    before = _snapshot(src, tmp_path)
    planned = run_ckpt("download", "hf://org/save", dest, "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    assert _snapshot(src, tmp_path) == before and not dest.exists()
    report = planned.json["result"]
    assert report["dry_run"] is True
    listed = {f["path"] for f in report["files"]}
    assert listed == _files(src), (sorted(_files(src) - listed), sorted(listed - _files(src)))
    fetched = run_ckpt("download", "hf://org/save", dest, "--json")
    assert fetched.exit_code == 0, fetched.stdout + fetched.stderr
    assert _files(dest) == listed
    for name in listed:
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name
    assert run_ckpt("diff", src, dest).exit_code == 0
    for narrowed in (("--filter", "*.weight"), ("--mode", "tensors")):
        picked = run_ckpt("download", "hf://org/save", tmp_path / "picked", *narrowed, "--json")
        assert picked.exit_code == 2, picked.stdout + picked.stderr
        assert "downloaded whole" in picked.json["error"]["message"]
        assert not (tmp_path / "picked").exists()
