"""accelerate FSDP `save_state` folders as one checkpoint: a user's story on a 2-rank FSDP2 run.

The folders are written by accelerate's own `save_state` (`tests/accelerate_fsdp_script.py`
under torchrun, gloo, CPU), with SHARDED_STATE_DICT (DCP sub-folders) and FULL_STATE_DICT
(rank 0's torch.save files), two prepared models each (`_1` names). `inspect` and `verify` must
see the optimizer and every rank's RNG, `convert` must keep every component, `diff` must call a
lossy copy DIFFERENT, and accelerate's own `load_state` must restore what ckpt wrote bit-exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .dist_helpers import run_torchrun
from .framework_fixtures import ACCELERATE_FSDP_SCRIPT, FSDP_STATE_DICTS
from .hub_server import TestHub

# each save, and each load, is a 2-rank torchrun job building a Llama: minutes on a busy machine
pytestmark = [pytest.mark.torchrun, pytest.mark.frameworks, pytest.mark.timeout(1200)]

#: the tiny Llama's 21 tensors and the MLP's 4: every one has AdamW state
PARAMS = 25


def _inspect(path: Path) -> dict[str, Any]:
    result = run_ckpt("inspect", path, "--json")
    assert result.exit_code == 0, result.stderr
    report: dict[str, Any] = result.json["result"]
    return report


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _restored_by_accelerate(kind: str, folders: list[Path], tmp_path: Path) -> dict[str, list[str]]:
    """accelerate's `load_state` of each folder on 2 ranks: for each after the first, what it
    restored differently from the first (empty: the same, bit for bit)."""
    report = tmp_path / f"load-{kind}.json"
    run_torchrun(ACCELERATE_FSDP_SCRIPT, 2, "load", report, FSDP_STATE_DICTS[kind], *folders)
    found: dict[str, list[str]] = json.loads(report.read_text())
    return found


@pytest.fixture(scope="module")
def restored(accelerate_fsdp_saves: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """What accelerate's `load_state` restored from each save (gathered whole), by kind."""
    return {
        kind: torch.load(f"{folder}.restored.pt", weights_only=False)
        for kind, folder in accelerate_fsdp_saves.items()
    }


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_inspect_and_verify_see_optimizer_and_every_rank_rng(
    accelerate_fsdp_saves: dict[str, Path], kind: str
) -> None:
    folder = accelerate_fsdp_saves[kind]
    training = _inspect(folder)["training"]
    assert training["layout"] == "accelerate"
    optimizer = training["optimizer"]
    assert optimizer["kind"] == "AdamW" and optimizer["complete"] is True
    assert optimizer["params"] == optimizer["params_with_state"] == PARAMS
    assert training["weights"]["tensors"] == PARAMS
    assert training["rng"] == ["python", "numpy", "torch_cpu"]
    assert training["rng_ranks"] == [0, 1]
    components = training["components"]
    if kind == "sharded":
        assert components["model"] == "pytorch_model_fsdp_0/ (dcp, 3 files)"
        assert components["model_1"] == "pytorch_model_fsdp_1/ (dcp, 3 files)"
        assert components["optimizer"] == "optimizer_0/ (dcp, 3 files)"
        assert components["optimizer_1"] == "optimizer_1/ (dcp, 3 files)"
    else:
        assert components["model"] == "pytorch_model_fsdp.bin"
        assert components["optimizer_1"] == "optimizer_1.bin"
    assert components["rng_0"] == "random_states_0.pkl"
    assert components["rng_1"] == "random_states_1.pkl"
    assert training["resumable"] is True and training["missing_exact"] == ["dataloader"]
    human = run_ckpt("inspect", folder)
    assert "rng          python, numpy, torch_cpu (2 ranks: 0, 1)" in human.stdout
    verified = run_ckpt("verify", folder, "--resumable", "--json")
    assert verified.exit_code == 0, verified.stdout
    codes = [p["code"] for p in verified.json["result"]["problems"]]
    assert "missing_optimizer" not in codes and "missing_rng" not in codes


@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_whole_folder_conversion_keeps_optimizer_and_rng(
    accelerate_fsdp_saves: dict[str, Path],
    restored: dict[str, dict[str, Any]],
    kind: str,
    to: str,
    tmp_path: Path,
) -> None:
    """`convert DIR whole.pt`: every model's, every optimizer's and every rank's state is in
    the output (read by torch.load / dcp.load), equal to what accelerate's `load_state`
    restores from DIR; inspect of the output reports what inspect of DIR did."""
    folder = accelerate_fsdp_saves[kind]
    out = tmp_path / ("whole.pt" if to == "torch" else "whole")
    converted = run_ckpt("convert", folder, out, "--to", to, "--json")
    assert converted.exit_code == 0, converted.stderr
    same = run_ckpt("diff", folder, out, "--json").json["result"]
    assert same["identical"] is True, same["verdict"]
    truth = restored[kind]
    # the output holds accelerate's numpy RNG states, which weights_only refuses: ckpt wrote it
    whole = torch.load(out, weights_only=False) if to == "torch" else _dcp_read(out, truth)
    # a DCP-held optimizer comes out of a torch.save nested as a torch-held one does, as
    # `optimizer.load_state_dict` takes it: a `state` dict and a list of `param_groups`
    for i, comp in ((0, "optimizer"), (1, "optimizer_1")):
        want = _flat(truth[f"optimizer_{i}"]["state"], "state")
        if to == "torch":
            assert isinstance(whole[comp]["param_groups"], list), comp
            got = _flat(whole[comp]["state"], "state")
        else:
            got = {k: v for k, v in _flat(whole[comp]).items() if k.startswith("state.")}
        assert got.keys() == want.keys() and want
        for name, value in want.items():
            assert torch.equal(got[name], value), (comp, name)
    for i, comp in ((0, "model"), (1, "model_1")):
        want = truth[f"model_{i}"]
        assert whole[comp].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(whole[comp][name], value), (comp, name)
    report = _inspect(out)["training"]
    source = _inspect(folder)["training"]
    for key in ("optimizer", "weights", "rng", "rng_ranks", "exact", "missing_exact"):
        if key == "optimizer":
            assert {k: v for k, v in report[key].items() if k != "source"} == {
                k: v for k, v in source[key].items() if k != "source"
            }
        else:
            assert report[key] == source[key], key


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict's leaves by dotted name (`state.<fqn>.exp_avg`)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _dcp_read(out: Path, truth: dict[str, Any]) -> dict[str, Any]:
    """The DCP output read by `dcp.load` into a state dict shaped like accelerate's."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in truth["model_0"].items()},
        "model_1": {k: torch.empty_like(v) for k, v in truth["model_1"].items()},
    }
    for i, comp in ((0, "optimizer"), (1, "optimizer_1")):
        state[comp] = {
            "state": {
                fqn: {n: torch.empty_like(t) for n, t in states.items()}
                for fqn, states in truth[f"optimizer_{i}"]["state"].items()
            }
        }
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    return state


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_load_state_restores_what_ckpt_wrote_and_notices_a_lossy_copy(
    accelerate_fsdp_saves: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    """Every weight and optimizer component rewritten by `ckpt convert` (DCP folders to DCP,
    torch files to torch) in place of accelerate's own: `load_state` restores it bit-exact on
    2 ranks. `diff` calls a copy with one optimizer's state changed DIFFERENT, and a copy
    missing an optimizer too."""
    folder = accelerate_fsdp_saves[kind]
    rewritten = tmp_path / "rewritten"
    rewritten.mkdir()
    opened = _inspect(folder)["training"]["components"]
    parts = [p.split(" ")[0] for c, p in opened.items() if c.startswith(("model", "optimizer"))]
    assert len(parts) == 4
    for item in folder.iterdir():
        if item.name not in {p.rstrip("/") for p in parts}:
            shutil.copy(item, rewritten / item.name)
    for part in parts:
        name = part.rstrip("/")
        to = "dcp" if part.endswith("/") else "torch"
        result = run_ckpt("convert", folder / name, rewritten / name, "--to", to)
        assert result.exit_code == 0, result.stderr
    assert run_ckpt("diff", folder, rewritten).exit_code == 0

    lossy = tmp_path / "lossy"
    shutil.copytree(rewritten, lossy)
    optimizer_1 = next(p.rstrip("/") for p in parts if "optimizer_1" in p)
    _remove(lossy / optimizer_1)
    # optimizer 1's state, 1e-3 off everywhere (a DCP one written by ckpt from a torch dict)
    whole = tmp_path / "whole.pt"
    assert run_ckpt("convert", folder, whole, "--to", "torch").exit_code == 0
    changed = torch.load(whole, weights_only=False)  # numpy RNG states: ckpt's own output
    optim = changed["optimizer_1"]  # nested, from a torch file or a DCP folder alike
    for states in optim["state"].values():
        states["exp_avg"] = states["exp_avg"] + 1e-3
    torch.save({"optimizer": changed["optimizer_1"]}, tmp_path / "changed.pt")
    if optimizer_1.endswith(".bin"):
        torch.save(changed["optimizer_1"], lossy / optimizer_1)
    else:
        result = run_ckpt("convert", tmp_path / "changed.pt", lossy / optimizer_1, "--to", "dcp")
        assert result.exit_code == 0, result.stderr

    found = _restored_by_accelerate(kind, [folder, rewritten], tmp_path)
    assert found[str(rewritten)] == []

    diffed = run_ckpt("diff", folder, lossy, "--json")
    assert diffed.exit_code == 1
    assert diffed.json["result"]["components"] == {"optimizer_1": 4}

    missing = tmp_path / "missing"
    shutil.copytree(rewritten, missing)
    _remove(missing / optimizer_1)
    diffed = run_ckpt("diff", folder, missing, "--json")
    assert diffed.exit_code == 1, diffed.stdout
    only_a = diffed.json["result"]["only_a"]
    assert only_a and all(n.startswith("optimizer_1.") for n in only_a)
    # `verify --resumable` names what is missing ("covers 4 of 4 parameters" said nothing)
    checked = run_ckpt("verify", missing, "--resumable", "--json")
    assert checked.exit_code == 1
    (incomplete,) = [
        p for p in checked.json["result"]["problems"] if p["code"] == "optimizer_incomplete"
    ]
    assert "a model's optimizer state was not saved" in incomplete["message"]


def _rank_shards(path: Path) -> dict[str, torch.Tensor]:
    """A per-rank file's tensors as the rank holds them (a DTensor's local part), by the
    dotted names ckpt gives them."""
    import torch.distributed.tensor as dtensor

    loaded = torch.load(path, weights_only=True)
    flat = _flat(loaded)
    return {
        name: value.to_local() if isinstance(value, dtensor.DTensor) else value
        for name, value in flat.items()
        if isinstance(value, torch.Tensor)
    }


def test_per_rank_files_are_read_checked_for_every_rank_and_converted(
    accelerate_fsdp_rank_files: Path, tmp_path: Path
) -> None:
    """accelerate's `use_dcp=False` save (one torch.save file per rank of every model and
    optimizer, DTensors inside): each file is a component of its own, read as the rank saved
    it; verify needs every rank's file; a whole conversion keeps them all, bit-exact."""
    folder = accelerate_fsdp_rank_files
    report = _inspect(folder)
    training = report["training"]
    assert training["layout"] == "accelerate"
    ranked = {
        f"{obj}{suffix}_rank{rank}": f"{stem}_{i}_rank{rank}.bin"
        for i, suffix in ((0, ""), (1, "_1"))
        for obj, stem in (("model", "pytorch_model_fsdp"), ("optimizer", "optimizer"))
        for rank in (0, 1)
    }
    assert {c: training["components"][c] for c in ranked} == ranked
    assert training["rng_ranks"] == [0, 1]
    assert training["optimizer"]["kind"] == "AdamW" and training["optimizer"]["complete"]
    assert training["resumable"] is True, training["missing"]
    import torch.distributed.tensor as dtensor

    # FSDP2 saved DTensors: each rank's file holds its part of the embedding, not all of it
    raw = _flat(torch.load(folder / "pytorch_model_fsdp_0_rank1.bin", weights_only=True))
    assert any(
        isinstance(v, dtensor.DTensor) and v.to_local().shape != v.shape for v in raw.values()
    )
    listed = run_ckpt("inspect", folder, "--json", "--list").json["result"]["entries"]
    shapes = {e["name"]: e["shape"] for e in listed}
    for comp, file in ranked.items():
        shards = _rank_shards(folder / file)
        assert shards
        for name, tensor in shards.items():
            assert shapes[f"{comp}.{name}"] == list(tensor.shape), f"{comp}.{name}"
    assert run_ckpt("verify", folder, "--resumable").exit_code == 0

    # a whole conversion holds every rank's part, bit for bit (judged by torch.load)
    out = tmp_path / "whole.pt"
    converted = run_ckpt("convert", folder, out, "--to", "torch", "--json")
    assert converted.exit_code == 0, converted.stderr
    assert set(ranked.values()) <= set(converted.json["result"]["read"])
    whole = _flat(torch.load(out, weights_only=False))  # ckpt's own output (numpy RNG state)
    for comp, file in ranked.items():
        for name, tensor in _rank_shards(folder / file).items():
            got = whole[f"{comp}.{name}"]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"{comp}.{name}"
    assert run_ckpt("diff", folder, out).exit_code == 0
    assert _inspect(out)["training"]["resumable"] is True

    # one rank's file of one model lost: verify names it, the save cannot be resumed
    lossy = shutil.copytree(folder, tmp_path / "lossy")
    (lossy / "pytorch_model_fsdp_1_rank1.bin").unlink()
    result = run_ckpt("verify", lossy, "--json")
    assert result.exit_code == 1
    problems = result.json["result"]["problems"]
    assert [(p["code"], Path(p["file"]).name) for p in problems] == [
        ("missing_rank_file", "pytorch_model_fsdp_1_rank1.bin")
    ]
    assert _inspect(lossy)["training"]["resumable"] is False
    # rank 1's RNG states lost: the per-rank files say 2 processes saved it (verify said OK)
    rng = shutil.copytree(folder, tmp_path / "rng")
    (rng / "random_states_1.pkl").unlink()
    result = run_ckpt("verify", rng, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], Path(p["file"]).name) for p in problems] == [
        ("missing_rank_rng", "random_states_1.pkl")
    ]
    assert "_rank1.bin holds rank 1's shard" in problems[0]["message"]
    # --world-size cannot re-cut one rank's part of every parameter: refused, nothing written
    resharded = run_ckpt(
        "reshard", folder, tmp_path / "ws4", "--world-size", "4", "--rank-state", "keep"
    )
    assert resharded.exit_code == 2, resharded.stdout + resharded.stderr
    assert "one file per rank" in resharded.stderr and not (tmp_path / "ws4").exists()


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_an_fsdp_save_on_the_hub_downloads_whole_and_resumes(
    accelerate_fsdp_saves: dict[str, Path], hub: TestHub, kind: str, tmp_path: Path
) -> None:
    """A user uploads the FSDP `save_state` folder (or a Trainer pushes it as `last-checkpoint/`)
    and fetches it on another machine with `ckpt download`. It was refused, exit 4, "holds no
    safetensors checkpoint (nor torch.save weights)": FSDP's weights are DCP folders
    (`pytorch_model_fsdp_0/`) or several `pytorch_model_fsdp*.bin`. The whole save comes, byte
    for byte, every file checked against the Hub's hash, and a tensor filter, which cannot pick
    tensors out of it, is refused with what to do instead."""
    save = accelerate_fsdp_saves[kind]
    files = {
        f"last-checkpoint/{p.relative_to(save).as_posix()}": p.read_bytes()
        for p in save.rglob("*")
        if p.is_file()
    }
    hub.add_repo("org/fsdp-run", files)
    src = "hf://org/fsdp-run/last-checkpoint"
    out = tmp_path / "copy"

    whole = run_ckpt("download", src, out, "--json")
    assert whole.exit_code == 0, whole.stdout + whole.stderr
    report = whole.json["result"]
    assert report["skipped"] == [], report["skipped"]
    source_files = sorted(p.relative_to(save).as_posix() for p in save.rglob("*") if p.is_file())
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == (
        source_files
    )
    for rel in source_files:
        assert (out / rel).read_bytes() == (save / rel).read_bytes(), rel
    kinds = {f["path"]: f["kind"] for f in report["files"]}
    model, optimizer = (
        ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata")
        if kind == "sharded"
        else ("pytorch_model_fsdp.bin", "optimizer.bin")
    )
    assert kinds[model] == "weights" and kinds[optimizer] == "state"
    assert kinds["random_states_1.pkl"] == "state"
    assert all(f["verified"] for f in report["files"]), report["files"]
    checked = run_ckpt("verify", out, "--json")
    assert checked.exit_code == 0, checked.stdout
    assert checked.json["result"]["training"]["resumable"] is True
    same = run_ckpt("diff", save, out, "--json").json["result"]
    assert same["identical"] is True and same["compared"] > 100

    # tensors cannot be picked out of it: refused, nothing written, the fix named
    for options in (("--filter", "lm_head.*"), ("--mode", "tensors")):
        part = tmp_path / "part"
        refused = run_ckpt("download", src, part, *options, "--json")
        assert refused.exit_code == 2, refused.stdout + refused.stderr
        error = refused.json["error"]
        assert "FSDP" in error["problem"], error
        assert "ckpt convert" in error["fix"] and "--select" in error["fix"], error
        assert not part.exists()
