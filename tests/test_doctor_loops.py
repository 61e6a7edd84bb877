"""`ckpt doctor` on plain torch training loops (no Trainer): each test trains a tiny model for
real, saves with `torch.save`, resumes the way people do (or get it wrong), and holds the
doctor's verdict to what the loop did. A clean resume of the same loop gets no finding."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt


def _batch_loop(
    run: Path, resume: int | None, until: int, batch: int, *, record_batch: bool
) -> None:
    """A plain loop: AdamW under a warm-up, `batch` samples per step, its own `samples_seen`
    counter (and `batch_size` where `record_batch`) at the top level of the dict it
    `torch.save`s every 4 steps (`ckpt_N.pt`), a `metrics.jsonl` log; resumed from
    `ckpt_RESUME.pt` with everything restored, at the batch size it is given now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(1024, 8, generator=data), torch.randn(1024, 1, generator=data)
    step = samples_seen = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step, samples_seen = saved["step"], saved["samples_seen"]
        torch.set_rng_state(saved["rng_state"])
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        start = samples_seen % 1024
        rows = slice(start, start + batch)
        loss = torch.nn.functional.mse_loss(model(xs[rows]), ys[rows])
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        samples_seen += batch
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr}) + "\n")
        if step % 4 == 0:
            state: dict[str, Any] = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "samples_seen": samples_seen,
                "rng_state": torch.get_rng_state(),
            }
            if record_batch:
                state["batch_size"] = batch
            torch.save(state, run / f"ckpt_{step}.pt")


def _resumed(run: Path, batch_after: int, *, record_batch: bool) -> None:
    """Trained at batch 8, crashed after step 9, resumed from `ckpt_8.pt` at `batch_after`."""
    _batch_loop(run, None, 9, 8, record_batch=record_batch)
    _batch_loop(run, 8, 16, batch_after, record_batch=record_batch)


@pytest.mark.slow
def test_a_plain_loop_resumed_at_another_batch_size_is_found(tmp_path: Path) -> None:
    """A plain loop keeps `batch_size` (or only its `samples_seen` counter) in the dict it
    saves; resumed at batch 16 instead of 8 with the learning rate kept, the doctor said NO
    CAUSE FOUND: it read batch settings only inside a train-state / config / args component
    and the work per step only from a Trainer's, torchtitan's or DeepSpeed's counters."""
    for record_batch in (True, False):
        run = tmp_path / f"recorded_{record_batch}"
        _resumed(run, 16, record_batch=record_batch)
        saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True) for n in (4, 8, 12)]
        assert [s["samples_seen"] for s in saved] == [32, 64, 128]
        result = run_ckpt("doctor", run, "--json")
        assert result.exit_code == 1, result.stdout
        causes = result.json["result"]["causes"]
        assert [(c["id"], c["before"], c["after"]) for c in causes] == [
            ("batch_changed", "ckpt_8.pt", "ckpt_12.pt")
        ], causes
        evidence = causes[0]["evidence"]
        if record_batch:
            assert evidence[0] == "per device batch 8 at ckpt_8.pt, 16 at ckpt_12.pt (batch_size)"
        else:
            assert evidence[0].startswith(
                "samples_seen per step 8 over ckpt_4.pt → ckpt_8.pt, 16 over ckpt_8.pt → "
                "ckpt_12.pt (×2.00): each step now processes more data"
            ), evidence
        assert "global batch ×2 but the learning rate ×1 (0.01 → 0.01)" in evidence[-1]
        assert "rescale the learning rate" in causes[0]["fix"]

        declared = run_ckpt("doctor", run, "--expect", "batch", "--json")
        assert declared.exit_code == 0, declared.stdout
        assert [c["declared"] for c in declared.json["result"]["causes"]] == [True]


def test_a_plain_loop_resumed_at_its_own_batch_size_is_clean(tmp_path: Path) -> None:
    """The same loop resumed at its own batch size: a resume found (its log repeats step 9),
    no finding, with or without `batch_size` recorded."""
    for record_batch in (True, False):
        run = tmp_path / f"recorded_{record_batch}"
        _resumed(run, 8, record_batch=record_batch)
        result = run_ckpt("doctor", run, "--json")
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert report["causes"] == [] and report["verdict"].startswith("NO CAUSE FOUND")
        assert [p["resumed"] for p in report["resume_points"]] == [False, True, False]


def _short_window_loop(
    run: Path, resume: int | None, until: int, every: int, *, fresh_optimizer: bool = False
) -> None:
    """A loop whose `step` counts micro-batches, accumulating 4 of them per optimizer step
    (`grad_accum: 4` saved) over epochs of 9: each epoch's last window holds one micro-batch,
    and the optimizer steps on it (as accelerate's `accumulate()` does at a loader's end).
    `torch.save`s `ckpt_{step}.pt` every `every` micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(72, 8, generator=data), torch.randn(72, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        if not fresh_optimizer:
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step = saved["step"]
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        i = step % 9
        step += 1
        rows = slice(i * 8, i * 8 + 8)
        (torch.nn.functional.mse_loss(model(xs[rows]), ys[rows]) / 4).backward()
        if (i + 1) % 4 == 0 or i == 8:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if step % every == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "grad_accum": 4,
            }
            torch.save(state, run / f"ckpt_{step}.pt")


@pytest.mark.slow
def test_a_window_of_one_micro_batch_is_no_inconsistent_save(tmp_path: Path) -> None:
    """Gradient accumulation of 4 over epochs of 9 micro-batches: the optimizer steps on a
    window of one micro-batch at each epoch's end, so a save at micro-batch 24 counts 7
    optimizer steps, not 6. The doctor took a run's counting from one whole ratio shared by
    every save, found none, and called every save inconsistent ("optimizer step count 2,
    trainer step 8"); `ckpt doctor ckpt_24.pt` alone said it could not resume consistently."""
    run = tmp_path / "run"
    _short_window_loop(run, None, 32, 8)
    counts = [
        (s["step"], int(s["optimizer"]["state"][0]["step"]))
        for s in (torch.load(run / f"ckpt_{n}.pt", weights_only=True) for n in (8, 16, 24, 32))
    ]
    assert counts == [(8, 2), (16, 4), (24, 7), (32, 10)]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []
    one = run_ckpt("doctor", run / "ckpt_24.pt", "--json")
    assert one.exit_code == 0, one.stdout
    assert one.json["result"]["verdict"] == "NO CAUSE FOUND: ckpt_24.pt can resume consistently"

    # resumed from ckpt_16.pt with a fresh optimizer: still found, at that resume
    resumed = tmp_path / "resumed"
    _short_window_loop(resumed, None, 17, 8)
    _short_window_loop(resumed, 16, 32, 8, fresh_optimizer=True)
    result = run_ckpt("doctor", resumed, "--json")
    assert result.exit_code == 1, result.stdout
    top = result.json["result"]["causes"][0]
    assert (top["id"], top["before"], top["after"]) == (
        "optimizer_not_restored",
        "ckpt_16.pt",
        "ckpt_24.pt",
    ), top
    # a save alone that counts fewer optimizer steps than its windows allow is still named
    lagging = run_ckpt("doctor", resumed / "ckpt_24.pt", "--json")
    assert lagging.exit_code == 1, lagging.stdout
    cause = lagging.json["result"]["causes"][0]
    assert cause["id"] == "inconsistent_state"
    assert cause["evidence"] == [
        "optimizer step count 3, trainer step 24 (at least 6 optimizer steps at up to 4 "
        "micro-batches each)"
    ]


def _stateful_loop(
    run: Path,
    resume: int | None,
    until: int,
    *,
    stale: bool = False,
    shuffle: bool = True,
    every: int = 2,
    rows: int = 256,
) -> None:
    """A plain loop over a torchdata `StatefulDataLoader` (batches of 8 of `rows` rows) that
    `torch.save`s model, optimizer, step, RNG and `loader.state_dict()` into `step-N/state.pt`
    every `every` steps; resumed from `step-RESUME`. `stale`: the loop saves the loader state it
    read at the resume, not the state of the loader it iterates."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(rows, 8, generator=data), torch.randn(rows, 1, generator=data)
    )
    loader = StatefulDataLoader(
        dataset, batch_size=8, shuffle=shuffle, generator=torch.Generator().manual_seed(1)
    )
    step = 0
    restored = None
    if resume is not None:
        saved = torch.load(run / f"step-{resume}" / "state.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["dataloader"])
        torch.set_rng_state(saved["rng"])
        step, restored = saved["step"], saved["dataloader"]
    while step < until:
        for x, y in loader:
            step += 1
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % every == 0:
                folder = run / f"step-{step}"
                folder.mkdir(parents=True, exist_ok=True)
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "rng": torch.get_rng_state(),
                    "dataloader": restored if stale else loader.state_dict(),
                }
                torch.save(state, folder / "state.pt")
            if step == until:
                break


def test_a_loader_state_saved_stale_is_found(tmp_path: Path) -> None:
    """A loop resumed from step-4 saves the loader state it read at the resume at every later
    save: step-6 and step-8 hold step-4's state, bit for bit, though the loader yielded 2 and
    4 more batches. A resume from either replays them; the doctor said NO CAUSE FOUND (the
    counters that stood still were neither a restart nor a pace)."""
    pytest.importorskip("torchdata", reason="the loop iterates a torchdata StatefulDataLoader")
    run = tmp_path / "run"
    _stateful_loop(run, None, 5)
    _stateful_loop(run, 4, 8, stale=True)
    states = [
        torch.load(run / f"step-{n}" / "state.pt", weights_only=False)["dataloader"]
        for n in (4, 6, 8)
    ]
    assert states[0]["_num_yielded"] == states[1]["_num_yielded"] == states[2]["_num_yielded"] == 4
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("inconsistent_state", "step-4", "step-6"),
        ("inconsistent_state", "step-6", "step-8"),
    ], causes
    assert causes[1]["title"] == (
        "step-8 holds step-4's data-loader state: a resume from it replays data"
    )
    evidence = causes[0]["evidence"]
    assert evidence[0] == (
        "the data-loader state of step-6 (state.pt) is identical to step-4's, entry for entry "
        "(11 entries), while the run took 2 steps between them"
    )
    assert "dataloader._num_yielded 4 at step-4 and at step-6, 2 steps later" in evidence[1]
    assert "save loader.state_dict() of that loader at each save" in causes[0]["fix"]

    clean = tmp_path / "clean"
    _stateful_loop(clean, None, 5)
    _stateful_loop(clean, 4, 8)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_a_loader_back_at_its_place_a_whole_epoch_later_is_no_copy(tmp_path: Path) -> None:
    """A loader without shuffling saved once per epoch (4 batches of 32 rows, every 4 steps)
    holds the same state, bit for bit, at every save: a whole epoch passed between them, no
    copy."""
    pytest.importorskip("torchdata", reason="the loop iterates a torchdata StatefulDataLoader")
    run = tmp_path / "run"
    _stateful_loop(run, None, 9, shuffle=False, every=4, rows=32)
    _stateful_loop(run, 8, 16, shuffle=False, every=4, rows=32)
    states = [
        torch.load(run / f"step-{n}" / "state.pt", weights_only=False)["dataloader"]
        for n in (4, 8, 12, 16)
    ]
    assert all(s["_num_yielded"] == 4 for s in states)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_an_accelerate_save_holding_an_older_loader_file_is_found(tmp_path: Path) -> None:
    """An accelerate run (`save_state` with a stateful data loader) whose step-6 was put
    together with step-4's `dl_state_dict.bin`: a resume from step-6 replays 2 steps of data.
    The doctor said NO CAUSE FOUND; the run as it was saved is clean."""
    pytest.importorskip("torchdata", reason="accelerate's stateful loader is torchdata's")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torchdata.stateful_dataloader import StatefulDataLoader

    run = tmp_path / "run"
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    data = torch.Generator().manual_seed(7)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(128, 8, generator=data), torch.randn(128, 1, generator=data)
    )
    loader = StatefulDataLoader(dataset, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for step, (x, y) in enumerate(loader, start=1):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            accelerator.save_state(str(run / f"step-{step}"))
        if step == 8:
            break
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []

    (run / "step-6" / "dl_state_dict.bin").write_bytes(
        (run / "step-4" / "dl_state_dict.bin").read_bytes()
    )
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("inconsistent_state", "step-4", "step-6")
    ], causes
    assert causes[0]["evidence"][0].startswith(
        "the data-loader state of step-6 (dl_state_dict.bin) is identical to step-4's"
    )
    assert "put back the loader state written with step-6" in causes[0]["fix"]


def _warmup_loop(run: Path, resume: int | None, until: int, scheduler_from: int | None) -> None:
    """A plain loop under an 8-step warm-up saving model, optimizer, scheduler, step and RNG
    every 2 steps (`ckpt_N.pt`) and logging `metrics.jsonl`; resumed from `ckpt_RESUME.pt`, its
    scheduler state loaded from `ckpt_{scheduler_from}.pt` (a path built from another step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        other = f"ckpt_{scheduler_from or resume}.pt"
        scheduler.load_state_dict(torch.load(run / other, weights_only=True)["scheduler"])
        step = saved["step"]
        torch.set_rng_state(saved["rng_state"])
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        rows = slice(step * 8 % 256, step * 8 % 256 + 8)
        loss = torch.nn.functional.mse_loss(model(xs[rows]), ys[rows])
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr}) + "\n")
        if step % 2 == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng_state": torch.get_rng_state(),
            }
            torch.save(state, run / f"ckpt_{step}.pt")


def test_a_scheduler_restored_from_an_older_save_is_found(tmp_path: Path) -> None:
    """Resumed from ckpt_4.pt with ckpt_2.pt's scheduler state: the schedule lags the
    optimizer by 2 steps from there on (step 6 runs with step 4's warm-up LR). Its count moved
    neither like a restart nor like a restored scheduler, and a plain loop's scheduler may count
    epochs, so the doctor said NO CAUSE FOUND. The same resume with the right state is clean."""
    run = tmp_path / "run"
    _warmup_loop(run, None, 5, None)
    _warmup_loop(run, 4, 8, 2)
    saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True) for n in (4, 6)]
    assert [s["scheduler"]["last_epoch"] for s in saved] == [4, 4]
    assert [int(s["optimizer"]["state"][0]["step"]) for s in saved] == [4, 6]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-3]["step"] == 6 and logged[-3]["lr"] == logged[3]["lr"]  # step 4's LR again
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("scheduler_not_restored", "ckpt_4.pt", "ckpt_6.pt")
    ], causes
    assert causes[0]["title"] == (
        "the LR scheduler state restored was ckpt_2.pt's, not ckpt_4.pt's: it lags the optimizer"
    )
    assert causes[0]["evidence"][0] == (
        "scheduler last_epoch 4 at ckpt_4.pt with the optimizer's step count 4, 4 at ckpt_6.pt "
        "with 6: restored it would be 6; it lags the optimizer by 2 steps, resumed from 2, the "
        "count of ckpt_2.pt (step 2)"
    )
    assert "not another save's" in causes[0]["fix"]

    clean = tmp_path / "clean"
    _warmup_loop(clean, None, 5, None)
    _warmup_loop(clean, 4, 8, None)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_a_lost_rank_0_rng_file_is_named_and_not_taken_for_rank_0s_stream(tmp_path: Path) -> None:
    """A 2-rank Trainer run keeps `rng_state_0.pth` and `rng_state_1.pth` in every save; one
    save lost `rng_state_0.pth`. A save holding one per-rank file names its component without
    the number, so the doctor took rank 1's generator for rank 0's: two `rng_not_restored`
    ("seed 0 at checkpoint-100, 1 at checkpoint-200") ranked first, and "rank 1 missing
    (rng_state_1.pth)", the file that is there. `doctor checkpoint-200` alone said it could
    resume consistently."""
    from .run_fixtures import trainer_checkpoint

    run = tmp_path / "run"
    streams = {r: torch.Generator().manual_seed(r) for r in (0, 1)}
    for step, kept in {100: (0, 1), 200: (1,), 300: (0, 1)}.items():
        folder = run / f"checkpoint-{step}"
        trainer_checkpoint(folder, step)
        (folder / "rng_state.pth").unlink()
        for rank, stream in streams.items():
            torch.rand(64, generator=stream)  # the steps' draws
            if rank in kept:
                # what the Trainer writes per process (`rng_state_{process_index}.pth`)
                torch.save({"cpu": stream.get_state()}, folder / f"rng_state_{rank}.pth")
    # saved an hour ago: a save that lost a file is incomplete, not one still being written
    an_hour_ago = time.time() - 3600
    for path in run.rglob("*"):
        os.utime(path, (an_hour_ago, an_hour_ago))
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["after"]) for c in causes] == [("rng_ranks_missing", "checkpoint-200")]
    assert "rank 0 missing (rng_state_0.pth at checkpoint-100)" in causes[0]["evidence"][0]
    assert "restore rng_state_0.pth" in causes[0]["fix"]

    one = run_ckpt("doctor", run / "checkpoint-200", "--json")
    assert one.exit_code == 1, one.stdout
    cause = one.json["result"]["causes"][0]
    assert cause["id"] == "rng_ranks_missing"
    assert cause["evidence"] == [
        "RNG states for rank 1 (rng_state_1.pth), none for rank 0: ranks are numbered from 0, "
        "so the run had 2 at least"
    ]
    assert "lost the RNG state of rank 0" in cause["fix"]
    whole = run_ckpt("doctor", run / "checkpoint-300", "--json")
    assert whole.exit_code == 0 and whole.json["result"]["causes"] == [], whole.stdout


class _Mlp(torch.nn.Module):
    """An MLP block whose projections are registered up then down (`down_first`: the other
    way round, what a refactor of its `__init__` does): the names, and so the weights loaded
    by name, are the same; `model.parameters()`, which numbers the optimizer's state, is not."""

    def __init__(self, *, down_first: bool, up_bias: bool = False) -> None:
        super().__init__()
        if down_first:
            self.down = torch.nn.Linear(32, 8, bias=False)
            self.up = torch.nn.Linear(8, 32, bias=up_bias)
        else:
            self.up = torch.nn.Linear(8, 32, bias=up_bias)
            self.down = torch.nn.Linear(32, 8, bias=False)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x))))


def _train_and_save(
    run: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    xs: torch.Tensor,
    ys: torch.Tensor,
    step: int,
    until: int,
) -> None:
    """Train from `step` to `until` on the rows of `xs` / `ys` the step picks, saving model,
    optimizer and step as `ckpt_N.pt` every 4 steps: the loop tail of the reorder, eval-mode
    and optimizer-settings jobs."""
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        rows = slice(step * 8 % 256, step * 8 % 256 + 8)
        loss = torch.nn.functional.mse_loss(model(xs[rows]), ys[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 4 == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, run / f"ckpt_{step}.pt")


def _reordered_loop(
    run: Path, resume: int | None, until: int, *, down_first: bool, split_groups: bool = False
) -> None:
    """A plain loop with fused AdamW (nanoGPT's choice), saving every 4 steps; resumed from
    `ckpt_RESUME.pt` with every state restored into a model built as `down_first` says.
    `split_groups`: `up` has a bias, and the parameters go into two param groups as nanoGPT's
    `configure_optimizers` puts them (matrices decay, vectors do not)."""
    torch.manual_seed(0)
    model = _Mlp(down_first=down_first, up_bias=split_groups)
    params: Any = model.parameters()
    if split_groups:
        named = list(model.named_parameters())
        params = [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ]
    optimizer = torch.optim.AdamW(params, lr=0.01, fused=True)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    _train_and_save(run, model, optimizer, xs, ys, step, until)


def test_optimizer_state_restored_under_another_parameter_order_is_found(tmp_path: Path) -> None:
    """The resumed model registers `down` before `up`: the weights load by name, but the saved
    optimizer state, keyed by parameter number, puts `up`'s moments ([32, 8]) on `down`
    ([8, 32]); fused AdamW steps on without a word (same element count). Every shape the
    optimizer holds is still some weight's, so the doctor said NO CAUSE FOUND. The same resume
    into the model as it was built is clean."""
    run = tmp_path / "run"
    _reordered_loop(run, None, 9, down_first=False)
    _reordered_loop(run, 8, 12, down_first=True)
    after = torch.load(run / "ckpt_12.pt", weights_only=True)
    assert list(after["model"])[:2] == ["down.weight", "up.weight"]
    assert after["optimizer"]["state"][0]["exp_avg"].shape == (32, 8)  # up's, on down
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("optimizer_mismatch", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["evidence"][0] == (
        "optimizer state of parameter 0 (exp_avg) is [32, 8] at ckpt_12.pt, while the model's "
        "parameter 0 there is 'down.weight' [8, 32]; at ckpt_8.pt parameter 0 was 'up.weight' "
        "[32, 8]: the parameters were reordered at the resume and the state applied to others"
    ), causes[0]["evidence"]
    assert "same order" in causes[0]["fix"]

    clean = tmp_path / "clean"
    _reordered_loop(clean, None, 9, down_first=False)
    _reordered_loop(clean, 8, 12, down_first=False)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_state_reordered_within_nanogpt_param_groups_is_found(tmp_path: Path) -> None:
    """The same refactor under nanoGPT's two param groups (matrices, then vectors): the ids
    no longer follow the saved model's order (group 0 takes `up.weight`, `down.weight`,
    `head.weight`; group 1 `up.bias`, `head.bias`), so the check by position could not judge,
    and the doctor said NO CAUSE FOUND. Each group still follows the model's order at
    ckpt_8.pt, and no order of ckpt_12.pt's. The same resume without the refactor is clean."""
    run = tmp_path / "run"
    _reordered_loop(run, None, 9, down_first=False, split_groups=True)
    _reordered_loop(run, 8, 12, down_first=True, split_groups=True)
    after = torch.load(run / "ckpt_12.pt", weights_only=True)
    assert after["optimizer"]["state"][0]["exp_avg"].shape == (32, 8)  # up's, on down
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("optimizer_mismatch", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["evidence"] == [
        "param group 0 numbers its optimizer state in the model's order: 'up.weight', "
        "'down.weight' at ckpt_8.pt, but ckpt_12.pt's model comes 'down.weight', 'up.weight': "
        "the parameters were reordered at the resume and the state of each applied to another "
        "(its shapes fit no order of the weights at ckpt_12.pt)"
    ], causes[0]["evidence"]

    clean = tmp_path / "clean"
    _reordered_loop(clean, None, 9, down_first=False, split_groups=True)
    _reordered_loop(clean, 8, 12, down_first=False, split_groups=True)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


class _Twins(torch.nn.Module):
    """Two projections of the same shape, `left` and `right`, registered left then right
    (`right_first`: the other way round, a refactored `__init__`): every position of
    `model.parameters()` keeps its shape, so no shape shows the state applied to the other."""

    def __init__(self, *, right_first: bool) -> None:
        super().__init__()
        if right_first:
            self.right = torch.nn.Linear(16, 16)
            self.left = torch.nn.Linear(16, 16)
        else:
            self.left = torch.nn.Linear(16, 16)
            self.right = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.right(torch.tanh(self.left(x)))))


def _twins_loop(
    run: Path, resume: int | None, until: int, *, right_first: bool, by_name: bool = False
) -> None:
    """A plain loop with AdamW over `model.parameters()`, `torch.save` of the model and the
    optimizer every 4 steps; resumed from `ckpt_RESUME.pt` into a model built as `right_first`
    says. `by_name`: the saved optimizer state is mapped onto the new order by parameter name
    before `load_state_dict` (the careful way to survive the refactor)."""
    torch.manual_seed(0)
    model = _Twins(right_first=right_first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 16, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer_state = saved["optimizer"]
        if by_name:
            old = {name: i for i, name in enumerate(saved["model"])}
            new = [name for name, _ in model.named_parameters()]
            optimizer_state["state"] = {
                i: optimizer_state["state"][old[name]] for i, name in enumerate(new)
            }
        optimizer.load_state_dict(optimizer_state)
        step = saved["step"]
    _train_and_save(run, model, optimizer, xs, ys, step, until)


def _folder_loop(
    run: Path,
    resume: int | None,
    until: int,
    *,
    right_first: bool = False,
    restore_optimizer: bool = True,
) -> None:
    """A plain loop that saves each step folder the way `save_pretrained` users do by hand:
    `step-N/model.safetensors` (safetensors' `save_file`, which stores the tensors sorted by
    name, not in the model's order) and `step-N/optimizer.pt` (`optimizer.state_dict()`),
    every 4 steps, with a `metrics.jsonl` log; resumed from `step-RESUME/` into a model built
    as `right_first` says, its optimizer state loaded where `restore_optimizer`."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = _Twins(right_first=right_first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 16, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        model.load_state_dict(load_file(run / f"step-{resume}" / "model.safetensors"))
        if restore_optimizer:
            saved = torch.load(run / f"step-{resume}" / "optimizer.pt", weights_only=True)
            optimizer.load_state_dict(saved)
        step = resume
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        rows = slice(step * 8 % 256, step * 8 % 256 + 8)
        loss = torch.nn.functional.mse_loss(model(xs[rows]), ys[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        if step % 4 == 0:
            folder = run / f"step-{step}"
            folder.mkdir()
            save_file(model.state_dict(), folder / "model.safetensors")
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")


def test_a_run_whose_saves_all_lack_a_file_is_examined_with_warnings(tmp_path: Path) -> None:
    """A plain loop's step folders (`model.safetensors` + `optimizer.pt`, no scheduler or RNG
    file) are read as Trainer saves without their `scheduler.pt`: each is incomplete, and the
    doctor refused the whole run ("holds no complete checkpoint to examine"), though one
    incomplete save among complete ones is examined with a warning. Saves that open with
    their weights and training state are examined all the same: the resume that did not load
    the optimizer is found, each save's warning names what it lacks."""
    run = tmp_path / "run"
    _folder_loop(run, None, 9)
    _folder_loop(run, 8, 12, restore_optimizer=False)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    causes = report["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes][:1] == [
        ("optimizer_not_restored", "step-8", "step-12")
    ], causes
    assert [w.split(":")[0] for w in report["warnings"]] == ["step-4", "step-8", "step-12"]
    assert all("scheduler.pt is missing" in w for w in report["warnings"]), report["warnings"]


def test_a_reorder_is_found_by_the_updates_where_safetensors_keeps_no_order(
    tmp_path: Path,
) -> None:
    """The same-shape refactor in a loop that saves `model.safetensors` (tensors sorted by
    name: the model's order is in no file) and `optimizer.pt`: nothing showed which parameter
    each numbered state belongs to, and the doctor found nothing. Which one it drives is in
    the updates: over the interval up to a save, the change of the parameter a state steps
    follows the state's direction (exp_avg / sqrt(exp_avg_sq)); state 0 drove `left.weight`
    up to step-8 and `right.weight` after the resume. The same resume without the refactor is
    clean."""
    run = tmp_path / "run"
    _folder_loop(run, None, 9)
    _folder_loop(run, 8, 12, right_first=True)
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("optimizer_mismatch", "step-8", "step-12")
    ], causes
    evidence = causes[0]["evidence"]
    assert [line.split(" (")[0] for line in evidence] == [
        "optimizer state of parameter 0 drove 'left.weight' up to step-8",
        "optimizer state of parameter 2 drove 'right.weight' up to step-8",
    ], evidence
    assert "and 'right.weight' after it (correlation " in evidence[0], evidence
    assert evidence[0].endswith(
        "the parameters were reordered at the resume and the state applied to others"
    ), evidence

    clean = tmp_path / "clean"
    _folder_loop(clean, None, 9)
    _folder_loop(clean, 8, 12)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def test_state_restored_onto_parameters_of_the_same_shape_in_another_order_is_found(
    tmp_path: Path,
) -> None:
    """The resumed model registers `right` before `left`, both [16, 16]: the weights load by
    name, the optimizer state by number, so left's moments step right and the other way round.
    Every position keeps its shape, and the doctor said NO CAUSE FOUND. The saved order shows
    the reorder; the second moments show the state followed its number (a load by name would
    have kept each with its parameter), which a resume that maps the state by name does not:
    that one, and the resume into the model as it was built, are clean."""
    run = tmp_path / "run"
    _twins_loop(run, None, 9, right_first=False)
    _twins_loop(run, 8, 12, right_first=True)
    after = torch.load(run / "ckpt_12.pt", weights_only=True)
    assert list(after["model"])[:2] == ["right.weight", "right.bias"]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("optimizer_mismatch", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    evidence = causes[0]["evidence"]
    assert evidence[0].startswith(
        "optimizer state of parameter 0 (exp_avg_sq) at ckpt_12.pt carries on ckpt_8.pt's "
        "state of parameter 0, 'left.weight' (correlation "
    ), evidence
    assert evidence[0].endswith(
        "with the state of 'right.weight', parameter 2 there), while the model's parameter 0 "
        "at ckpt_12.pt is 'right.weight' [16, 16]: the parameters were reordered at the "
        "resume and the state applied to others of the same shape"
    ), evidence
    assert any(line.startswith("optimizer state of parameter 2 (") for line in evidence)

    for name, by_name, right_first in (("by-name", True, True), ("clean", False, False)):
        clean = tmp_path / name
        _twins_loop(clean, None, 9, right_first=False)
        _twins_loop(clean, 8, 12, right_first=right_first, by_name=by_name)
        result = run_ckpt("doctor", clean, "--json")
        assert result.exit_code == 0, (name, result.stdout)
        assert result.json["result"]["causes"] == [], name


def _epoch_loop(run: Path, resume: int | None, until: int, *, restore_epoch: bool) -> None:
    """A plain loop over a `DataLoader` with a `DistributedSampler` (shuffled per epoch by
    `set_epoch`), 4 batches an epoch, saving `epoch` and `step` with the states every 4 steps;
    resumed from `ckpt_RESUME.pt` with its epoch restored, or left at 0 (`restore_epoch`)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    step = epoch = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        if restore_epoch:
            epoch = saved["epoch"]
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        sampler.set_epoch(epoch)
        for xs, ys in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with open(run / "metrics.jsonl", "a") as log:
                log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if step % 4 == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "epoch": epoch + 1,  # the epochs done: the one to run next
                }
                torch.save(state, run / f"ckpt_{step}.pt")
            if step >= until:
                break
        epoch += 1


def test_a_sampler_epoch_not_restored_is_found(tmp_path: Path) -> None:
    """Resumed from ckpt_8.pt (2 epochs done) with the loop's epoch left at 0: the sampler
    shuffles as epoch 0 did, and the run trains on epoch 0's order again. The loop saves
    `epoch` at the top of its dict; the doctor read no epoch counter and said NO CAUSE FOUND.
    The same resume with the epoch restored is clean."""
    run = tmp_path / "run"
    _epoch_loop(run, None, 10, restore_epoch=True)
    _epoch_loop(run, 8, 16, restore_epoch=False)
    saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True) for n in (8, 12)]
    assert [s["epoch"] for s in saved] == [2, 1]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("data_position_not_restored", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["evidence"] == [
        "epoch 2 at ckpt_8.pt, 1 at ckpt_12.pt: it went back (carried on, an epoch count never "
        "does): the sampler shuffles as the epochs already trained did (set_epoch)"
    ]
    assert "set_epoch" in causes[0]["fix"]

    clean = tmp_path / "clean"
    _epoch_loop(clean, None, 10, restore_epoch=True)
    _epoch_loop(clean, 8, 16, restore_epoch=True)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def _scaled_loop(run: Path, resume: int | None, until: int, *, restore_scaler: bool) -> None:
    """A plain loop under `torch.amp.GradScaler` at its defaults (growth every 2000 good
    steps), saving its state with the others every 4 steps; resumed from `ckpt_RESUME.pt`,
    with or without `scaler.load_state_dict`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if restore_scaler:
            scaler.load_state_dict(saved["scaler"])
        step = saved["step"]
    run.mkdir(parents=True, exist_ok=True)
    while step < until:
        step += 1
        rows = slice(step * 8 % 256, step * 8 % 256 + 8)
        loss = torch.nn.functional.mse_loss(model(xs[rows]), ys[rows])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if step % 4 == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "step": step,
            }
            torch.save(state, run / f"ckpt_{step}.pt")


def test_a_scaler_reset_the_scale_cannot_show_is_told_by_its_growth_tracker(
    tmp_path: Path,
) -> None:
    """Resumed without the GradScaler's state, 2000 steps from any growth: the loss scale is
    65536 either way, only the growth tracker counted again from the resume. The doctor found
    it, but its evidence led with the scale ("continued it would be 65536, a fresh scaler
    reaches 65536"), which proves nothing, and gave the tracker without what it should be."""
    run = tmp_path / "run"
    _scaled_loop(run, None, 9, restore_scaler=True)
    _scaled_loop(run, 8, 12, restore_scaler=False)
    saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True)["scaler"] for n in (8, 12)]
    assert [(s["scale"], s["_growth_tracker"]) for s in saved] == [(65536.0, 8), (65536.0, 4)]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("grad_scaler_reset", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["title"] == (
        "the gradient scaler was reset: its growth tracker counted again from the resume"
    )
    assert causes[0]["evidence"] == [
        "growth tracker 8 at ckpt_8.pt, 4 at ckpt_12.pt: continued it would be 12, a fresh "
        "scaler counts 4 (the loss scale, 65536 at both, grows only every 2000 good steps)"
    ]

    clean = tmp_path / "clean"
    _scaled_loop(clean, None, 9, restore_scaler=True)
    _scaled_loop(clean, 8, 12, restore_scaler=True)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def _batchnorm_loop(run: Path, resume: int | None, until: int, *, eval_after_load: bool) -> None:
    """A plain loop over an MLP with BatchNorm and dropout, `model.train()` once before it
    starts, `torch.save` every 4 steps; resumed from `ckpt_RESUME.pt` with everything restored.
    `eval_after_load`: the resume script validates the loaded model first (`model.eval()`) and
    the loop, whose `model.train()` came before the load, never switches it back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    model.train()
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        if eval_after_load:
            model.eval()
            with torch.no_grad():
                model(xs[:32])
    _train_and_save(run, model, optimizer, xs, ys, step, until)


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_a_model_left_in_eval_mode_at_the_resume_is_found_by_its_batchnorm(
    tmp_path: Path,
) -> None:
    """The resume script ran a validation pass (`model.eval()`) and the loop went on training
    in eval mode: dropout off, BatchNorm normalising by its frozen running statistics. The
    doctor said NO CAUSE FOUND. BatchNorm's `num_batches_tracked`, which counted every
    training batch up to the save, stands still after it while the optimizer steps. The same
    resume that stays in train mode is clean."""
    run = tmp_path / "run"
    _batchnorm_loop(run, None, 9, eval_after_load=False)
    _batchnorm_loop(run, 8, 12, eval_after_load=True)
    saved = [torch.load(run / f"ckpt_{n}.pt", weights_only=True) for n in (4, 8, 12)]
    assert [int(s["model"]["1.num_batches_tracked"]) for s in saved] == [4, 8, 8]
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("model_in_eval_mode", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["evidence"] == [
        "BatchNorm's 1.num_batches_tracked 4 at ckpt_4.pt, 8 at ckpt_8.pt, 8 at ckpt_12.pt "
        "while the optimizer stepped 4 times: the model counted its batches in train mode up "
        "to the resume, and none after it"
    ], causes[0]["evidence"]
    assert "model.train()" in causes[0]["fix"]
    # BatchNorm frozen on purpose at the resume is declared: shown, not ranked
    declared = run_ckpt("doctor", run, "--expect", "model_in_eval_mode", "--json")
    assert declared.exit_code == 0, declared.stdout
    assert [(c["id"], c["declared"]) for c in declared.json["result"]["causes"]] == [
        ("model_in_eval_mode", True)
    ]

    clean = tmp_path / "clean"
    _batchnorm_loop(clean, None, 9, eval_after_load=False)
    _batchnorm_loop(clean, 8, 12, eval_after_load=False)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []


def _decay_loop(
    run: Path, resume: int | None, until: int, *, decay_after_load: float | None
) -> None:
    """A plain loop with AdamW (weight decay 0.1, betas (0.9, 0.95)) saving every 4 steps;
    resumed from `ckpt_RESUME.pt` with everything restored, then, where `decay_after_load`
    says, the param groups' weight decay overridden after the load (a config value applied to
    the restored optimizer; `load_state_dict` restores the saved settings)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(256, 8, generator=data), torch.randn(256, 1, generator=data)
    step = 0
    if resume is not None:
        saved = torch.load(run / f"ckpt_{resume}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        if decay_after_load is not None:
            for group in optimizer.param_groups:
                group["weight_decay"] = decay_after_load
    _train_and_save(run, model, optimizer, xs, ys, step, until)


def test_optimizer_settings_changed_at_the_resume_are_found(tmp_path: Path) -> None:
    """The resume applied another weight decay to the restored optimizer (0.1 → 0.0): every
    step after it regularises differently. The optimizer's param groups save their settings,
    and the doctor compared only their sizes: NO CAUSE FOUND. The change is named, with its
    group; declared with `--expect optimizer-settings` it is shown, not ranked. The resume that
    keeps the settings is clean."""
    run = tmp_path / "run"
    _decay_loop(run, None, 9, decay_after_load=None)
    _decay_loop(run, 8, 12, decay_after_load=0.0)
    after = torch.load(run / "ckpt_12.pt", weights_only=True)
    assert after["optimizer"]["param_groups"][0]["weight_decay"] == 0.0
    result = run_ckpt("doctor", run, "--json")
    assert result.exit_code == 1, result.stdout
    causes = result.json["result"]["causes"]
    assert [(c["id"], c["before"], c["after"]) for c in causes] == [
        ("optimizer_settings_changed", "ckpt_8.pt", "ckpt_12.pt")
    ], causes
    assert causes[0]["evidence"] == [
        "weight_decay 0.1 at ckpt_8.pt, 0 at ckpt_12.pt (optimizer param group 0)"
    ], causes[0]["evidence"]
    declared = run_ckpt("doctor", run, "--expect", "optimizer-settings", "--json")
    assert declared.exit_code == 0, declared.stdout
    assert [(c["id"], c["declared"]) for c in declared.json["result"]["causes"]] == [
        ("optimizer_settings_changed", True)
    ]

    clean = tmp_path / "clean"
    _decay_loop(clean, None, 9, decay_after_load=None)
    _decay_loop(clean, 8, 12, decay_after_load=None)
    result = run_ckpt("doctor", clean, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["causes"] == []
