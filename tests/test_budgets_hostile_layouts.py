"""Budgets on hostile inputs to the training-layout readers: a rank folder's name, a run's
`args`, a pickled sampler's attributes, a custom checkpoint's value choose neither ckpt's memory
nor its CPU, and never turn into "a bug in ckpt".

Each checkpoint is written by the real writer (torch.save of Megatron-LM's rank dict, accelerate's
`save_state`), then one value or one folder name is made hostile, and `ckpt` runs as a real
process under an address-space and CPU limit (`test_budgets.ckpt_limited`): a regression is
killed by SIGXCPU instead of running for hours.
"""

from __future__ import annotations

import os
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from .run_fixtures import age
from .test_budgets import CPU_LIMIT, ckpt_limited
from .test_megatron_legacy import RANK_FILE, TRACKER, legacy_save, megatron_args

# ----------------------------------------------------------------- Megatron-LM legacy rank folders


def _legacy_run(root: Path, args_tp_pp: tuple[int, int] | None) -> tuple[Path, Path]:
    """A run folder of one legacy save of two pipeline stages (`mp_rank_00_000`,
    `mp_rank_00_001`), its args recording `args_tp_pp` (None: no args); returns (run, save)."""
    run = root / "ckpts"
    save = run / "iter_0000100"
    args = None if args_tp_pp is None else megatron_args(*args_tp_pp)
    legacy_save(save, 100, 1, 2, args)
    (run / TRACKER).write_text("100")
    return run, save


@pytest.mark.slow  # a fresh process under limits
def test_a_rank_folder_numbered_past_any_grid_is_judged_in_bounded_cpu(tmp_path: Path) -> None:
    # without args, the numbering of the folders present tells which are missing: one folder
    # named mp_rank_1999_1999_1999 spanned a grid of 8·10^9 folders, listed one by one
    run, save = _legacy_run(tmp_path, None)
    for name in ("mp_rank_00_000_000", "mp_rank_1999_1999_1999"):
        (save / name).mkdir()
        shutil.copy(save / "mp_rank_00_000" / RANK_FILE, save / name / RANK_FILE)
    age(run)

    done = ckpt_limited("latest", run)

    # mixed forms (two and three numbers) are no one save's numbering: nothing to judge by it
    assert done.exit_code == 0, done.stdout + done.stderr
    assert done.stdout.strip() == str(save)
    assert done.cpu_s < CPU_LIMIT

    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        shutil.rmtree(save / name)
    age(run)
    done = ckpt_limited("latest", run)
    # one form, a grid no run has: the numbering tells nothing, and nothing is listed
    assert done.exit_code == 0, done.stdout + done.stderr
    assert done.stdout.strip() == str(save)
    assert done.cpu_s < CPU_LIMIT


@pytest.mark.slow  # a fresh process under limits
def test_args_calling_for_a_million_ranks_beside_thousands_of_folders_are_judged_in_linear_time(
    tmp_path: Path,
) -> None:
    # args say TP 1024 × PP 1024; 6,000 pipeline folders are present: each of the 10^6 expected
    # folders was looked up in a list of the 6,000 present (6·10^9 comparisons)
    run, save = _legacy_run(tmp_path, (1024, 1024))
    for stage in range(2, 6000):
        folder = save / f"mp_rank_00_{stage:03d}"
        folder.mkdir()
        os.link(save / "mp_rank_00_000" / RANK_FILE, folder / RANK_FILE)
    age(run)

    done = ckpt_limited("latest", run)

    text = done.stdout + done.stderr
    assert done.exit_code == 3, text
    assert "lacks mp_rank_01_000/" in text
    assert f"of the {1024 * 1024} rank folders" in text
    assert "tensor_model_parallel_size 1024 × pipeline_model_parallel_size 1024" in text
    assert done.cpu_s < CPU_LIMIT


# --------------------------------------------------------------------- accelerate's pickled values


@pytest.fixture(scope="module")
def accelerate_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """accelerate's `save_state` of a shuffled loader's run, with its pickled `sampler.bin`."""
    pytest.importorskip("accelerate", reason="the frameworks extra brings accelerate")
    from .test_accelerate_sampler import _run

    return _run(tmp_path_factory.mktemp("accelerate") / "run", stateful=False)[-1]


@pytest.mark.slow  # a fresh process under limits
def test_a_sampler_whose_epoch_has_100_000_bits_is_listed_not_a_crash(
    tmp_path: Path, accelerate_save: Path
) -> None:
    # the sampler's epoch is shown; one of 30,000 digits is past what Python prints
    save = tmp_path / "save"
    shutil.copytree(accelerate_save, save)
    sampler = torch.load(save / "sampler.bin", weights_only=False)
    sampler.epoch = 1 << 100_000
    torch.save(sampler, save / "sampler.bin")
    age(save)

    for command in ("inspect", "verify"):
        done = ckpt_limited(command, save, "--json")
        assert done.exit_code == 0, done.stdout + done.stderr
        training = done.json["result"]["training"]
        # the epoch is not kept (no sampler has one that wide); the seed still is
        assert training["dataloader"].pop("reason")
        assert training["dataloader"] == {
            "kind": "seedable sampler",
            "file": "sampler.bin",
            "initial_seed": sampler.initial_seed,
        }
        said = f"sampler.bin (SeedableRandomSampler: initial_seed {sampler.initial_seed})"
        assert training["components"]["sampler"] == said


@pytest.mark.slow  # a fresh process under limits
def test_diff_shows_a_custom_value_of_100_000_bits_by_its_width(
    tmp_path: Path, accelerate_save: Path
) -> None:
    # `diff` shows a value that differs; Python refuses to print an int of over 4,300 digits
    save = tmp_path / "save"
    shutil.copytree(accelerate_save, save)
    before = torch.load(save / "custom_checkpoint_0.pkl", weights_only=True)
    torch.save({**before, "seen": 1 << 100_000}, save / "custom_checkpoint_0.pkl")
    age(save)

    done = ckpt_limited("diff", save, accelerate_save, "--json")

    assert done.exit_code == 1, done.stdout + done.stderr
    changed = {e["name"]: e for e in done.json["result"]["differences"] if e["status"] == "value"}
    assert changed["custom_0.seen"]["value_a"] == "<int of 100,001 bits>"
    assert changed["custom_0.seen"]["value_b"] == str(before["seen"])
    assert done.cpu_s < CPU_LIMIT


@pytest.mark.slow  # a fresh process under limits, reading 250 MiB of opcodes
def test_a_rank_file_of_250_mib_of_opcodes_is_scanned_for_its_args_in_bounded_cpu(
    tmp_path: Path,
) -> None:
    # the sizes are read from the lowest rank file's pickle opcodes; one of 250 MiB of NONEs,
    # deflated 23-fold into an 11 MB file (within the zip budget), took 95 CPU-s to step
    # through one opcode at a time
    run, save = _legacy_run(tmp_path, (1, 2))
    rank_file = save / "mp_rank_00_000" / RANK_FILE
    rnd = random.Random(0)
    chunk = bytes(rnd.choices(b"N)", weights=[97, 3], k=1 << 20))  # NONE, EMPTY_TUPLE
    rank_file.unlink()
    with zipfile.ZipFile(rank_file, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w", force_zip64=True) as member:
            member.write(b"\x80\x02")
            for _ in range(250):
                member.write(chunk)
            member.write(b".")
        archive.writestr("archive/version", "3\n")
    age(run)

    done = ckpt_limited("latest", run)

    # no args to read: the numbering of the two stages present says the save is whole
    assert done.exit_code == 0, done.stdout + done.stderr
    assert done.stdout.strip() == str(save)
    assert done.cpu_s < CPU_LIMIT
