"""A whole legacy Megatron-LM save (`iter_N/`, or its run folder) is one checkpoint to inspect
and convert.

A user names the iteration folder Megatron-LM's `save_checkpoint` (`--ckpt-format torch`)
wrote, `iter_0000200/` with its `mp_rank_TT[_PPP]/model_optim_rng.pt` rank folders: `verify`
checked every rank folder, but `inspect` and `convert` stopped with "name one of them". Each
rank's file here is the dict Megatron-LM's `generate_state_dict` builds, written with
`torch.save` as it does (tests/test_megatron_legacy.py: megatron-core's pip package holds no
legacy writer), and with `--use-distributed-optimizer` its `distrib_optim.pt` beside it
(tests/test_megatron_legacy_ranks.py). Outputs are read back with `torch.load`,
`safetensors.safe_open` and `dcp.load`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import run_ckpt
from .test_megatron_legacy import RANK_FILE, TRACKER, legacy_save, megatron_args, rank_folder
from .test_megatron_legacy_ranks import DISTRIB_OPTIM, distributed_save

#: the rank folders of a save split over 2 tensor-parallel ranks and 2 pipeline stages
GRID = ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]


def rank_model(save: Path, folder: str) -> dict[str, torch.Tensor]:
    """A rank's weights as Megatron-LM's `load_checkpoint` reads them."""
    state = torch.load(save / folder / RANK_FILE, weights_only=False)
    return dict(state["model"])


def test_inspect_of_a_whole_save_reports_the_grid_and_every_rank_folder(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))

    result = run_ckpt("inspect", save, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    layout = report["layout"]
    assert layout["layout"] == "megatron-legacy-save"
    assert layout["details"]["tensor_model_parallel_size"] == 2
    assert layout["details"]["pipeline_model_parallel_size"] == 2
    assert layout["details"]["expert_model_parallel_size"] == 1
    assert layout["details"]["iteration"] == 200
    assert [c["name"] for c in layout["components"]] == GRID
    assert {f["path"] for f in report["files"]} == {f"{r}/{RANK_FILE}" for r in GRID}
    # every rank's tensors under its folder's name, as the real reader sees them
    entries = {e["name"]: e for e in report["entries"]}
    for tp in range(2):
        for pp in range(2):
            folder = rank_folder(tp, pp, 2)
            weights = rank_model(save, folder)
            for name, tensor in weights.items():
                entry = entries[f"{folder}.model.{name}"]
                assert entry["shape"] == list(tensor.shape), name
                assert entry["dtype"] == "float32"
            comp = next(c for c in layout["components"] if c["name"] == folder)
            assert comp["tensors"] >= len(weights)
            assert comp["parameters"] == sum(t.numel() for t in weights.values())
    # the optimizer's moments are no parameters: per rank, summed
    assert report["parameters"] == sum(
        t.numel() for folder in GRID for t in rank_model(save, folder).values()
    )
    moments = 0
    for folder in GRID:
        saved = torch.load(save / folder / RANK_FILE, weights_only=False)["optimizer"]["state"]
        moments += sum(t.numel() for per in saved.values() for t in per.values())
    assert report["state_elements"]["optimizer"] == moments
    training = report["training"]
    assert training["step"] == 200
    assert training["optimizer"] is not None
    assert training["resumable"] is True
    assert report["part_of"] is None
    # the module tree: one branch per rank folder
    assert [node["name"] for node in report["tree"]] == GRID

    human = run_ckpt("inspect", save)
    assert human.exit_code == 0, human.stdout + human.stderr
    assert "tensor_model_parallel_size 2 × pipeline_model_parallel_size 2" in human.stdout
    assert "mp_rank_01_001" in human.stdout


def test_inspect_of_a_whole_save_names_the_distributed_optimizer_state(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    distributed_save(save, 200, 2)

    report = run_ckpt("inspect", save, "--json").json["result"]
    assert report["layout"]["details"]["optimizer"] == DISTRIB_OPTIM
    assert report["training"]["optimizer"]["source"] == DISTRIB_OPTIM
    assert {f["path"] for f in report["files"]} == {
        f"mp_rank_0{t}/{name}" for t in range(2) for name in (RANK_FILE, DISTRIB_OPTIM)
    }
    assert "mp_rank_01.distrib_optim.0" in {e["name"] for e in report["entries"]}


def test_convert_of_a_one_rank_save_is_that_rank_as_the_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    save = tmp_path / "iter_0000100"
    legacy_save(save, 100, 1, 1, megatron_args(1, 1))
    out = tmp_path / "model.safetensors"
    result = run_ckpt("convert", save, out, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    # the whole model: no "one of the rank folders" warning
    assert not any("rank folder" in w for w in result.json["result"]["warnings"])
    weights = rank_model(save, "mp_rank_00")
    with safe_open(out, "pt") as f:
        assert {k for k in f.keys() if k.startswith("model.")}  # noqa: SIM118 == {f"model.{k}" for k in weights}
        for name, tensor in weights.items():
            assert torch.equal(f.get_tensor(f"model.{name}"), tensor), name


@pytest.mark.parametrize("to", ["safetensors", "torch", "dcp"])
def test_convert_of_a_split_save_writes_each_rank_folder_under_dest(
    tmp_path: Path, to: str
) -> None:
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))
    out = tmp_path / "out"
    result = run_ckpt("convert", save, out, "--to", to, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert sorted(p.name for p in out.iterdir()) == GRID
    assert any("each rank folder" in w for w in report["warnings"])
    assert report["tensors"] > 0
    for folder in GRID:
        weights = rank_model(save, folder)
        got = _read_back(out / folder, to, [f"model.{k}" for k in weights])
        for name, tensor in weights.items():
            assert torch.equal(got[f"model.{name}"], tensor), (folder, name)
    assert {f["path"].split("/")[0] for f in report["files"]} == set(GRID)


def _read_back(folder: Path, to: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of one rank's output, by the format's own reader."""
    if to == "safetensors":
        from safetensors import safe_open

        (path,) = folder.glob("*.safetensors")
        with safe_open(path, "pt") as f:
            return {n: f.get_tensor(n) for n in names}
    if to == "torch":
        (path,) = [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        state = torch.load(path, weights_only=False)  # its `args` is an argparse.Namespace
        flat: dict[str, torch.Tensor] = {}
        for key, value in state["model"].items():
            flat[f"model.{key}"] = value
        return {n: flat[n] for n in names}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {
        n: torch.empty(m.size, dtype=m.properties.dtype)
        for n, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and n in names
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    return state


def test_convert_of_the_run_folder_converts_the_iteration_its_tracker_names(
    tmp_path: Path,
) -> None:
    run = tmp_path / "ckpts"
    legacy_save(run / "iter_0000100", 100, 1, 1, megatron_args(1, 1))
    legacy_save(run / "iter_0000200", 200, 1, 1, megatron_args(1, 1))
    (run / TRACKER).write_text("100")  # the tracker, not the newest folder, says which
    out = tmp_path / "out"
    result = run_ckpt("convert", run, out, "--to", "torch", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    (path,) = [p for p in out.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    state = torch.load(path, weights_only=False)  # as Megatron-LM loads it: `args` inside
    assert state["iteration"] == 100
    for name, tensor in rank_model(run / "iter_0000100", "mp_rank_00").items():
        assert torch.equal(state["model"][name], tensor), name


def test_a_split_save_is_never_exported_as_one_model(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))
    out = tmp_path / "hf"
    refused = run_ckpt("convert", save, out, "--to", "hf", "--json")
    assert refused.exit_code == 4, refused.stdout
    error = refused.json["error"]
    assert "tensor_model_parallel_size 2 × pipeline_model_parallel_size 2" in error["message"]
    assert "tools/checkpoint/convert.py" in error["fix"]
    assert "--to safetensors" in error["fix"]
    assert not out.exists()


def test_a_split_save_dry_run_plans_each_rank_folder_and_writes_nothing(tmp_path: Path) -> None:
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))
    out = tmp_path / "out"
    plan = run_ckpt("convert", save, out, "--to", "safetensors", "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stdout + plan.stderr
    assert {f["path"] for f in plan.json["result"]["files"]} == {
        f"{r}/model.safetensors" for r in GRID
    }
    assert not out.exists()

    # a file DEST cannot hold four rank folders: a usage error, nothing written
    one_file = tmp_path / "model.safetensors"
    refused = run_ckpt("convert", save, one_file, "--to", "safetensors", "--json")
    assert refused.exit_code == 2, refused.stdout
    assert f"{save}/mp_rank_00_000" in refused.json["error"]["fix"]
    assert not one_file.exists()


def test_filters_see_the_rank_folder_names_inspect_shows(tmp_path: Path) -> None:
    from safetensors import safe_open

    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))
    out = tmp_path / "out"
    result = run_ckpt(
        "convert", save, out, "--to", "safetensors", "--filter", "mp_rank_01_*.model.*", "--json"
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mp_rank_01_000", "mp_rank_01_001"]
    left = {s["name"] for s in result.json["result"]["skipped"] if s["kind"] == "component"}
    assert left == {"mp_rank_00_000", "mp_rank_00_001"}
    weights = rank_model(save, "mp_rank_01_001")
    with safe_open(out / "mp_rank_01_001" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == {f"model.{k}" for k in weights}
        for name, tensor in weights.items():
            assert torch.equal(f.get_tensor(f"model.{name}"), tensor), name


def test_diff_of_two_whole_saves_lines_up_their_rank_folders(tmp_path: Path) -> None:
    # two saves of the same weights (each rank's seed is its place in the grid), 100 steps
    # apart: the iteration and the scheduler's step count differ in every rank folder
    a, b = tmp_path / "iter_0000100", tmp_path / "iter_0000200"
    legacy_save(a, 100, 2, 2, megatron_args(2, 2))
    legacy_save(b, 200, 2, 2, megatron_args(2, 2))
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    report = result.json["result"]
    assert report["only_a"] == [] and report["only_b"] == []
    differ = {d["name"] for d in report["differences"]}
    assert differ == {
        f"{r}.{key}" for r in GRID for key in ("iteration", "opt_param_scheduler.num_steps")
    }
    for folder in GRID:
        for name, tensor in rank_model(a, folder).items():
            assert torch.equal(tensor, rank_model(b, folder)[name])


def test_rank_files_are_read_once_without_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of thousands of rank folders cost ~30 ms of CPU per folder: each
    `model_optim_rng.pt` (plain data but for `args`, an `argparse.Namespace`) had its pickle
    read by ckpt's reader, then by torch.load, then by ckpt's reader again. `args` is the inert
    record torch.load is given for it, so ckpt's reader reads the whole file: inspect and
    verify never hand a rank file to torch.load, and say the same (the convert tests above
    check the tensors so read against torch.load's)."""
    save = tmp_path / "iter_0000200"
    legacy_save(save, 200, 2, 2, megatron_args(2, 2))
    before = run_ckpt("inspect", save, "--json").json["result"]

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called on a rank file")

    monkeypatch.setattr(torch, "load", refused)
    result = run_ckpt("inspect", save, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    assert report["layout"]["details"]["tensor_model_parallel_size"] == 2
    assert report["entries"] == before["entries"]
    assert report["training"]["step"] == 200
    checked = run_ckpt("verify", save, "--json")
    assert checked.exit_code == 0, checked.stdout + checked.stderr
