"""A Megatron-LM legacy save (`--ckpt-format torch`) that lost a whole rank folder.

Megatron-LM's legacy `save_checkpoint` has every model-parallel rank write its own
`iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt` (`get_checkpoint_name`), then rank 0 rewrites
`latest_checkpointed_iteration.txt`. A node that died, or a copy that missed one node's disk,
leaves a save whose other files are whole: ckpt called it complete, `latest` resumed from it and
`convert` read half the weights. megatron-core's pip package holds no legacy writer
(`megatron.training` is Megatron-LM's), so each rank's file here is the dict Megatron-LM's
`generate_state_dict` builds, written with `torch.save` as it does: `args` (its
`argparse.Namespace`), `checkpoint_version`, `iteration`, the rank's model shard, its optimizer,
scheduler and RNG states.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import run_ckpt
from .run_fixtures import age

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"


def rank_folder(tp: int, pp: int, pp_size: int) -> str:
    """Megatron-LM's `get_checkpoint_name`: `mp_rank_TT`, or `mp_rank_TT_PPP` with a pipeline."""
    return f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def legacy_save(
    folder: Path, iteration: int, tp_size: int, pp_size: int, args: argparse.Namespace | None
) -> None:
    """One legacy save: each (tensor, pipeline) rank's `model_optim_rng.pt`, as the rank
    writes it (its own shard of the weights, its optimizer, the run's args)."""
    for tp in range(tp_size):
        for pp in range(pp_size):
            torch.manual_seed(100 * tp + pp)
            shard = {
                f"decoder.layers.{pp}.mlp.linear_fc1.weight": torch.randn(16 // tp_size, 8),
                f"decoder.layers.{pp}.self_attention.linear_proj.weight": torch.randn(
                    8, 16 // tp_size
                ),
            }
            params = [torch.nn.Parameter(t.clone()) for t in shard.values()]
            optimizer = torch.optim.Adam(params, lr=0.1)
            sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
            optimizer.step()
            state = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": shard,
                "optimizer": optimizer.state_dict(),
                "opt_param_scheduler": {"num_steps": iteration * 32, "max_lr": 0.1},
                "rng_state": [
                    {
                        "random_rng_state": random.getstate(),
                        "np_rng_state": np.random.get_state(),
                        "torch_rng_state": torch.get_rng_state(),
                        "rng_tracker_states": {},
                    }
                ],
                "num_floating_point_operations_so_far": 0,
            }
            rank = folder / rank_folder(tp, pp, pp_size)
            rank.mkdir(parents=True)
            torch.save(state, rank / RANK_FILE)


def megatron_args(tp_size: int, pp_size: int) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=2,
        hidden_size=8,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        ckpt_format="torch",
        lr=0.1,
        seed=1234,
    )


def legacy_run(
    root: Path, tp_size: int, pp_size: int, lost: str, args: argparse.Namespace | None = None
) -> Path:
    """A run folder of three saves, the tracker naming the newest, which lost the rank folder
    `lost` (its node died); all written an hour ago."""
    run = root / "ckpts"
    for iteration in (100, 200, 300):
        saved = megatron_args(tp_size, pp_size) if args is None else args
        legacy_save(run / f"iter_{iteration:07d}", iteration, tp_size, pp_size, saved)
    (run / TRACKER).write_text("300")
    shutil.rmtree(run / "iter_0000300" / lost)
    age(run)
    return run


@pytest.mark.parametrize(
    ("tp_size", "pp_size", "lost"),
    [(2, 1, "mp_rank_01"), (2, 2, "mp_rank_01_001"), (1, 2, "mp_rank_00_000")],
    ids=["tp2", "tp2-pp2", "pp2-first-stage"],
)
def test_a_save_that_lost_a_rank_folder_is_incomplete_and_latest_skips_it(
    tmp_path: Path, tp_size: int, pp_size: int, lost: str
) -> None:
    run = legacy_run(tmp_path, tp_size, pp_size, lost)

    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip() == str(run / "iter_0000200")
    assert f"{TRACKER} names iter_0000300, which is incomplete" in latest.stderr

    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    assert table["layouts"] == ["megatron"]
    status = {c["name"]: (c["status"], c["reason"] or "") for c in table["checkpoints"]}
    assert status["iter_0000100"] == ("complete", "")
    assert status["iter_0000200"] == ("complete", "")
    assert status["iter_0000300"][0] == "incomplete"
    reason = status["iter_0000300"][1]
    assert f"lacks {lost}/ of the {tp_size * pp_size} rank folders" in reason
    assert f"tensor_model_parallel_size {tp_size} × pipeline_model_parallel_size {pp_size}" in (
        reason
    )

    # the newest good save is the one kept, never the one that lost a rank
    plan = run_ckpt("prune", run, "--keep-last", "1", "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stdout
    actions = {d["name"]: d["action"] for d in plan.json["result"]["decisions"]}
    assert actions["iter_0000200"] == "keep"
    assert actions["iter_0000100"] == "delete"
    pruned = run_ckpt("prune", run, "--keep-last", "1", "--yes")
    assert pruned.exit_code == 0, pruned.stdout + pruned.stderr
    assert not (run / "iter_0000100").exists()
    kept = run / "iter_0000200" / rank_folder(tp_size - 1, pp_size - 1, pp_size) / RANK_FILE
    state = torch.load(kept, weights_only=False)  # as Megatron-LM's load_checkpoint reads it
    assert state["iteration"] == 200
    assert state["args"].tensor_model_parallel_size == tp_size


def test_verify_inspect_and_convert_refuse_the_save_naming_the_lost_folder(
    tmp_path: Path,
) -> None:
    run = legacy_run(tmp_path, 2, 1, "mp_rank_01")
    save = run / "iter_0000300"

    verify = run_ckpt("verify", save, "--json")
    assert verify.exit_code == 1, verify.stdout + verify.stderr
    problems = verify.json["result"]["problems"]
    # every rank folder left is checked too (each file whole: warnings only)
    assert [p["code"] for p in problems if p["severity"] == "error"] == ["missing_rank_folder"]
    assert "lacks mp_rank_01/ of the 2 rank folders" in problems[0]["message"]
    assert "Restore the missing rank folders" in problems[0]["fix"]
    assert "`ckpt latest RUN_DIR`" in problems[0]["fix"]
    human = run_ckpt("verify", save)
    assert human.exit_code == 1
    assert "FAILED" in human.stdout and "missing_rank_folder" in human.stdout

    inspect = run_ckpt("inspect", save)
    assert inspect.exit_code == 4, inspect.stdout + inspect.stderr
    assert f"{save}: lacks mp_rank_01/" in inspect.stderr

    out = tmp_path / "out"
    convert = run_ckpt("convert", save, out, "--to", "safetensors", "--json")
    assert convert.exit_code == 4, convert.stdout
    assert convert.json["error"]["code"] == "missing_rank_folder"
    assert not out.exists()

    # the whole save is not refused as incomplete (it names its rank folders instead)
    whole = run_ckpt("verify", run / "iter_0000200")
    assert "missing_rank_folder" not in whole.stdout + whole.stderr


def test_a_gap_in_the_numbering_counts_when_the_args_cannot_be_read(tmp_path: Path) -> None:
    # args recording no parallel sizes (an old or edited save): the folders present, 00 and
    # 02, say a rank between them was lost
    run = legacy_run(tmp_path, 3, 1, "mp_rank_01", args=argparse.Namespace(lr=0.1))
    table = run_ckpt("inspect", run, "--json").json["result"]["run"]
    status = {c["name"]: (c["status"], c["reason"] or "") for c in table["checkpoints"]}
    assert status["iter_0000200"] == ("complete", "")
    assert status["iter_0000300"][0] == "incomplete"
    assert "lacks mp_rank_01/ of the 3 rank folders" in status["iter_0000300"][1]
    assert "the numbering of the rank folders it holds" in status["iter_0000300"][1]
    assert run_ckpt("latest", run).stdout.strip() == str(run / "iter_0000200")


def test_a_rank_folder_that_lost_its_file_is_missing_too(tmp_path: Path) -> None:
    run = legacy_run(tmp_path, 2, 1, "mp_rank_01")
    (run / "iter_0000300" / "mp_rank_01").mkdir()  # the folder made, the file never written
    age(run)
    verify = run_ckpt("verify", run / "iter_0000300", "--json")
    assert verify.exit_code == 1, verify.stdout + verify.stderr
    assert "lacks mp_rank_01/" in verify.json["result"]["problems"][0]["message"]


@pytest.mark.parametrize(
    ("sizes", "present", "missing"),
    [
        # experts split, one pipeline stage: `mp_rank_TT_EEE` (get_checkpoint_name appends EEE)
        (
            {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 2},
            ["mp_rank_00_000"],
            ["mp_rank_00_001"],
        ),
        # experts split over a pipeline: `mp_rank_TT_PPP_EEE`
        (
            {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
            },
            ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000"],
            ["mp_rank_00_001_001"],
        ),
    ],
    ids=["ep2", "pp2-ep2"],
)
def test_expert_parallel_rank_folders_are_expected_as_megatron_names_them(
    sizes: dict[str, int], present: list[str], missing: list[str]
) -> None:
    from ckpt_cli.sources.layouts.megatron_legacy import missing_ranks

    found = missing_ranks([f"{name}/{RANK_FILE}" for name in present], sizes)
    assert found is not None
    assert found.missing == missing
    assert found.expected == len(present) + len(missing)
    assert missing_ranks([f"{n}/{RANK_FILE}" for n in present + missing], sizes) is None


def test_diff_of_two_legacy_saves_names_the_one_rank_state_that_differs(tmp_path: Path) -> None:
    """A guard: two whole legacy saves (tp 2) that differ in one rank's RNG, scheduler, one
    optimizer moment or run args: `diff` names that entry of that rank folder alone."""
    legacy_save(tmp_path / "base", 100, 2, 1, megatron_args(2, 1))
    cases = {
        "mp_rank_01.rng_state.0.torch_rng_state": lambda s: s["rng_state"][0].update(
            torch_rng_state=torch.Generator().manual_seed(5).get_state()
        ),
        "mp_rank_01.opt_param_scheduler.num_steps": lambda s: s["opt_param_scheduler"].update(
            num_steps=1
        ),
        "mp_rank_01.optimizer.state.0.exp_avg": lambda s: s["optimizer"]["state"][0][
            "exp_avg"
        ].add_(1),
        "mp_rank_01.args": lambda s: setattr(s["args"], "lr", 0.2),
    }
    for i, (name, change) in enumerate(cases.items()):
        other = shutil.copytree(tmp_path / "base", tmp_path / f"other{i}")
        rank = other / "mp_rank_01" / RANK_FILE
        state = torch.load(rank, weights_only=False)
        change(state)
        torch.save(state, rank)
        result = run_ckpt("diff", tmp_path / "base", other, "--json")
        assert result.exit_code == 1, result.stdout + result.stderr
        report = result.json["result"]
        assert [d["name"] for d in report["differences"]] == [name], report["verdict"]
        assert not (report["only_a"] or report["only_b"] or report["metadata"])
