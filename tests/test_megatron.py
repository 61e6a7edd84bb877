"""Megatron-Core `torch_dist` checkpoints (#20), written by megatron-core's own
`dist_checkpointing.save` (tests/megatron_writer.py, one process with gloo on CPU) and judged
by its own `dist_checkpointing.load` and by `dcp.load`."""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt, run_ckpt_process
from .dist_helpers import dcp_load_flat, free_port, torchrun_env

# find_spec, not importorskip: importing megatron.core registers torch safe globals
# (argparse.Namespace...) process-wide, which would change what other tests' torch.load admits
if (
    importlib.util.find_spec("megatron") is None
    or not (
        Path(importlib.util.find_spec("megatron").submodule_search_locations[0]) / "core"  # type: ignore[index,union-attr]
    ).is_dir()
):
    pytest.skip(
        "megatron-core is not installed (pip install '.[frameworks]' brings it)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.frameworks

WRITER = Path(__file__).with_name("megatron_writer.py")


def megatron(*args: str | Path) -> None:
    """Run megatron_writer.py (save DIR | load DIR OUT.pt) in its own process."""
    proc = subprocess.run(
        [sys.executable, str(WRITER), *map(str, args), str(free_port())],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A torch_dist checkpoint and what megatron's own load returns for it."""
    root = tmp_path_factory.mktemp("megatron")
    megatron("save", root / "ckpt")
    megatron("load", root / "ckpt", root / "truth.pt")
    return root / "ckpt", torch.load(root / "truth.pt", weights_only=True)


def test_layout_is_recognised_without_format_and_shows_common_state(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    folder, truth = saved
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "common.pt",
        "metadata.json",
    ]
    result = run_ckpt("inspect", folder, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["format"] == "dcp"
    details = report["details"]
    assert details["layout"] == "megatron_torch_dist"
    assert details["megatron"]["metadata"]["sharded_backend"] == "torch_dist"
    entries = {e["name"]: e for e in report["entries"]}
    tensors = {k: v for k, v in truth.items() if isinstance(v, torch.Tensor)}
    for name, value in tensors.items():
        assert entries[name]["dtype"] == str(value.dtype).removeprefix("torch.")
        assert entries[name]["shape"] == list(value.shape)
    assert entries["iteration"]["value"] == 7 and entries["args.lr"]["value"] == 0.1
    assert entries["checkpoint_version"]["py_type"] == "float"
    # human output names the layout; inspect stays torch-free in a real process
    text = run_ckpt_process("inspect", folder, env={"CKPT_DEBUG": "1", "COLUMNS": "200"})
    assert text.exit_code == 0 and "Megatron-Core torch_dist" in text.stdout


@pytest.mark.slow
def test_megatron_lms_lr_scheduler_in_the_common_state_is_the_scheduler(
    tmp_path: Path,
) -> None:
    """Megatron-LM keeps its LR scheduler in `common.pt` as `opt_param_scheduler`
    (megatron-core's `OptimizerParamScheduler`): `inspect` said `scheduler none` and
    `verify --resumable` warned of no scheduler state."""
    folder = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(WRITER), "save", str(folder), str(free_port())],
        capture_output=True,
        text=True,
        env=torchrun_env({"MEGATRON_SCHEDULER": "1"}),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    common = torch.load(folder / "common.pt", weights_only=False)
    assert common["opt_param_scheduler"]["num_steps"] == 32
    training = run_ckpt("inspect", folder, "--json").json["result"]["training"]
    assert training["components"]["scheduler"] == "opt_param_scheduler"
    assert training["scheduler"] == {"num_steps": 32}
    verdict = run_ckpt("verify", "--resumable", folder, "--json").json
    assert "missing_scheduler" not in {p["code"] for p in verdict["result"]["problems"]}


def test_verify_good_and_damaged_copies(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    import shutil

    folder, _ = saved
    assert run_ckpt("verify", folder).exit_code == 0
    assert run_ckpt("verify", folder, "--deep").exit_code == 0
    no_common = shutil.copytree(folder, tmp_path / "no-common")
    (no_common / "common.pt").unlink()
    result = run_ckpt("verify", no_common, "-f", "dcp", "--json")
    assert result.exit_code == 1
    assert "megatron_missing_common" in {p["code"] for p in result.json["result"]["problems"]}
    cut = shutil.copytree(folder, tmp_path / "cut")
    data = (cut / "__0_1.distcp").read_bytes()
    (cut / "__0_1.distcp").write_bytes(data[: len(data) // 2])
    result = run_ckpt("verify", cut, "--json")
    assert result.exit_code == 1
    assert "dcp_truncated" in {p["code"] for p in result.json["result"]["problems"]}


def test_verify_names_a_common_pt_pickle_that_would_run_code(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Plain verify used to say OK for a common.pt that convert and diff refuse."""
    import os
    import shutil

    folder, _ = saved
    copy = shutil.copytree(folder, tmp_path / "copy")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    common = torch.load(folder / "common.pt", weights_only=False)
    torch.save({**common, "args": Evil()}, copy / "common.pt")
    for deep in ((), ("--deep",)):
        result = run_ckpt("verify", copy, *deep, "--json")
        assert result.exit_code == 1, result.stdout
        flagged = [p for p in result.json["result"]["problems"] if p["severity"] == "error"]
        assert [p["code"] for p in flagged] == ["unsafe_input"], flagged
        assert "common.pt" in flagged[0]["file"] and "system" in flagged[0]["message"]
    assert run_ckpt("convert", copy, tmp_path / "o.pt", "--to", "torch").exit_code == 4
    assert not marker.exists()


def test_convert_reshard_diff_are_bit_exact_against_megatrons_own_load(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    folder, truth = saved
    tensors = {k: v for k, v in truth.items() if isinstance(v, torch.Tensor)}
    as_torch = tmp_path / "model.pt"
    assert run_ckpt("convert", folder, as_torch, "--to", "torch").exit_code == 0
    loaded = torch.load(as_torch, weights_only=True)
    for name, value in tensors.items():
        assert torch.equal(loaded[name], value), name
    assert loaded["iteration"] == 7 and (loaded["args.lr"], loaded["args.seed"]) == (0.1, 3)
    for args in (["convert", "--to", "dcp"], ["reshard", "--world-size", "2"]):
        out = tmp_path / args[0]
        result = run_ckpt(args[0], folder, out, *args[1:])
        assert result.exit_code == 0, result.stdout + result.stderr
        # a plain DCP for dcp.load: the tensors, bit-exact
        got = dcp_load_flat(out, {k: torch.zeros_like(v) for k, v in tensors.items()})
        for name, value in tensors.items():
            assert torch.equal(got[name], value), name
        diff = run_ckpt("diff", folder, out)
        assert diff.exit_code == 0, diff.stdout + diff.stderr
        assert run_ckpt("verify", out).exit_code == 0
    diff = run_ckpt("diff", folder, as_torch)
    assert diff.exit_code == 0, diff.stdout + diff.stderr


@pytest.mark.parametrize(
    "args",
    [["convert", "--to", "dcp"], ["reshard", "--world-size", "2"]],
    ids=["convert", "reshard-2"],
)
def test_dcp_output_stays_a_megatron_checkpoint_its_own_loader_reads(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, args: list[str]
) -> None:
    """convert/reshard of a torch_dist save write common.pt and metadata.json as Megatron
    does: megatron's own `dist_checkpointing.load` reads the output, equal to the source."""
    folder, truth = saved
    out = tmp_path / "out"
    result = run_ckpt(args[0], folder, out, *args[1:], "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    names = sorted(p.name for p in out.iterdir())
    distcp = [n for n in names if n.endswith(".distcp")]
    assert len(distcp) == (2 if args[0] == "reshard" else 1)
    assert names == sorted([".metadata", "common.pt", "metadata.json", *distcp])
    assert (out / "common.pt").read_bytes() == (folder / "common.pt").read_bytes()
    assert (out / "metadata.json").read_bytes() == (folder / "metadata.json").read_bytes()
    # the common state lives in common.pt only, as Megatron keeps it: not inside the DCP
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert keys == {k for k, v in truth.items() if isinstance(v, torch.Tensor)}
    megatron("load", out, tmp_path / "loaded.pt")
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == truth.keys()
    for name, value in truth.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == loaded[name].dtype and torch.equal(loaded[name], value), name
        else:
            assert loaded[name] == value, name
    report = run_ckpt("inspect", out, "--json").json["result"]
    assert report["details"]["layout"] == "megatron_torch_dist"
    verify = run_ckpt("verify", out, "--deep", "--json")
    assert verify.exit_code == 0 and not verify.json["result"]["problems"]
    diff = run_ckpt("diff", folder, out)
    assert diff.exit_code == 0 and "identical" in diff.stdout.lower(), diff.stdout


def test_a_filter_that_drops_common_state_writes_a_plain_dcp(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Without all of common.pt's keys there is no faithful common.pt: the output is the plain
    DCP it always was, the kept common entries inside it, and no metadata.json."""
    folder, truth = saved
    out = tmp_path / "plain"
    result = run_ckpt("convert", folder, out, "--to", "dcp", "--filter-out", "args.*")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert not (out / "common.pt").exists() and not (out / "metadata.json").exists()
    template: dict[str, Any] = {
        k: torch.zeros_like(v) for k, v in truth.items() if isinstance(v, torch.Tensor)
    }
    template["iteration"] = None
    assert dcp_load_flat(out, template)["iteration"] == 7


def test_only_the_save_plan_classes_are_admitted(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A LoadPlan (never written by DCP) in `.metadata` is refused like any other global."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadPlan

    folder, _ = saved
    copy = shutil.copytree(folder, tmp_path / "copy")
    metadata = FileSystemReader(str(folder)).read_metadata()
    assert len(metadata.all_local_plans) == 1  # what megatron keeps: every rank's SavePlan
    metadata.all_local_plans = [LoadPlan(items=[])]
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    result = run_ckpt("inspect", copy)
    assert result.exit_code == 4
    assert "LoadPlan" in result.stderr and "not part of DCP metadata" in result.stderr


# --- 2 ranks, tensor parallel, per-rank objects (#33) ------------------------------------------


def megatron_ranks(*args: str | Path) -> list[dict[str, Any]]:
    """megatron_writer.py under torchrun on 2 ranks (save DIR | load DIR OUT); what each rank's
    own `dist_checkpointing.load` returned, for `load`."""
    from .dist_helpers import run_torchrun

    run_torchrun(WRITER, 2, *args, timeout=600)
    if args[0] != "load":
        return []
    return [torch.load(f"{args[2]}.{rank}.pt", weights_only=True) for rank in range(2)]


def same(a: Any, b: Any) -> bool:
    """Equal, tensors bit for bit (dtype included), through dicts and lists."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


#: how megatron_writer.tp_state splits each weight over the ranks (None: replicated)
_TP_DIMS = {
    "decoder.layers.0.self_attention.linear_qkv.weight": 0,
    "decoder.layers.0.self_attention.linear_proj.weight": 1,
    "decoder.final_layernorm.weight": None,
}


def _same_as_megatrons_load(got: list[dict[str, Any]], truth: list[dict[str, Any]]) -> None:
    for rank in range(2):
        assert got[rank].keys() == truth[rank].keys()
        for key, want in truth[rank].items():
            assert same(got[rank][key], want), (rank, key)


@pytest.fixture(scope="module")
def tp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A 2-rank torch_dist save (weights split over the ranks, a per-rank ShardedObject,
    common state) and what megatron's own load returns on each rank."""
    root = tmp_path_factory.mktemp("megatron-tp")
    megatron_ranks("save", root / "ckpt")
    return root / "ckpt", megatron_ranks("load", root / "ckpt", root / "truth")


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_two_rank_save_with_byte_io_objects_is_read_whole(
    tp_saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The save plans Megatron keeps in `.metadata` hold BYTE_IO items (its ShardedObjects):
    inspect / verify read the folder, and `convert --to torch` holds every rank's share."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import WriteItemType

    folder, truth = tp_saved
    plans = FileSystemReader(str(folder)).read_metadata().all_local_plans
    assert WriteItemType.BYTE_IO in {item.type for plan in plans for item in plan.items}
    result = run_ckpt("inspect", folder, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["details"]["layout"] == "megatron_torch_dist"
    entries = {e["name"]: e for e in report["entries"]}
    assert {"rng_state/shard_0_2", "rng_state/shard_1_2"} <= entries.keys()
    assert entries["iteration"]["value"] == 7
    whole = {}
    for name, dim in _TP_DIMS.items():
        parts = [truth[rank][name] for rank in range(2)]
        whole[name] = parts[0] if dim is None else torch.cat(parts, dim)
        assert entries[name]["shape"] == list(whole[name].shape)
    assert run_ckpt("verify", folder).exit_code == 0
    assert run_ckpt("verify", folder, "--deep").exit_code == 0
    out = tmp_path / "all.pt"
    converted = run_ckpt("convert", folder, out, "--to", "torch")
    assert converted.exit_code == 0, converted.stdout + converted.stderr
    loaded = torch.load(out, weights_only=True)
    for name, tensor in whole.items():
        assert same(loaded[name], tensor), name
    for rank in range(2):
        # megatron stores a ShardedObject's data as a one-element list and unwraps it on load
        assert same(loaded[f"rng_state/shard_{rank}_2"], [truth[rank]["rng_state"]]), rank
    assert loaded["iteration"] == 7 and (loaded["args.lr"], loaded["args.seed"]) == (0.1, 3)


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["convert", "--to", "dcp"], ["reshard", "--world-size", "2"]],
    ids=["convert", "reshard-2"],
)
def test_a_two_rank_save_converted_loads_back_in_megatron_on_two_ranks(
    tp_saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path, args: list[str]
) -> None:
    folder, truth = tp_saved
    out = tmp_path / "out"
    result = run_ckpt(args[0], folder, out, *args[1:])
    assert result.exit_code == 0, result.stdout + result.stderr
    _same_as_megatrons_load(megatron_ranks("load", out, tmp_path / "back"), truth)
    diff = run_ckpt("diff", folder, out)
    assert diff.exit_code == 0 and "identical" in diff.stdout.lower(), diff.stdout
    assert run_ckpt("verify", out, "--deep").exit_code == 0
