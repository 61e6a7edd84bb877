"""`ckpt_cli.Checkpointer`: a training loop saves in the background and resumes bit-identically.

A user's story: a real (tiny) training run (`tests/checkpointer_worker.py`: an MLP with
dropout, AdamW, a StepLR schedule, a shuffling resumable data loader, the torch RNG) saves
every 3 steps through the Checkpointer, is SIGKILLed in the middle of a background save, and
resumes with `load_latest`; its final parameters and optimizer state are compared bit for bit
with a run that was never interrupted. The moments are chosen with the test-only pause point
of `ckpt_cli/checkpointer/hooks.py`: `CKPT_TEST_PAUSE_AT=write@9` stops the background writer
of step 9 when every rank's data files are written but `.metadata` (the commit marker) is not,
`upload@9` once the first file of step 9 is in the object store; the writer then touches
`CKPT_TEST_PAUSE_FILE` and waits, and the test kills the process.

The saves are judged by the real readers: `ckpt latest` / `ckpt verify` (the CLI), and
`dcp.load` for the tensors.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import REPO, run_ckpt
from .dist_helpers import (
    Launch,
    require_torchrun_marker,
    run_launch,
    torchrun_command,
    torchrun_env,
)
from .s3_fixtures import S3Server, list_keys, make_bucket

WORKER = Path(__file__).resolve().parent / "checkpointer_worker.py"
#: the longest a worker may take to reach its pause point (a guard, not a measurement)
REACH_PAUSE = 300.0


def _command(nproc: int, run_dir: Path, out: Path, args: tuple[str, ...]) -> list[str]:
    target = [str(WORKER), str(run_dir), str(out), *args]
    if nproc == 1:
        return [sys.executable, *target]
    require_torchrun_marker()
    return torchrun_command(nproc, *target)


def train(run_dir: Path, out: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    """Train to the end (steps 1..12, a save every 3, keeping 2); fail with its output if it fails."""
    proc = run_launch(_command(nproc, run_dir, out, args), 600, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def train_and_kill_at(point: str, run_dir: Path, out: Path, *args: str, nproc: int = 1) -> str:
    """Train with the pause point `point` set; SIGKILL every process once it is reached.

    Returns the worker's stderr (its log)."""
    marker = run_dir.parent / f"paused-{point.replace('@', '-')}"
    env = torchrun_env({"CKPT_TEST_PAUSE_AT": point, "CKPT_TEST_PAUSE_FILE": str(marker)})
    log = run_dir.parent / f"log-{point.replace('@', '-')}.txt"
    with open(log, "w") as err:
        launch = Launch(
            _command(nproc, run_dir, out, args), env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            deadline = time.monotonic() + REACH_PAUSE
            while not marker.exists():
                if launch.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"never reached {point}:\n{log.read_text()}")
                time.sleep(0.05)
        except BaseException:
            launch.end()
            raise
        # every process at once (torchrun starts each rank in a session of its own)
        launch.kill()
    return log.read_text()


def final_state(out: Path, rank: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
    return state


def assert_bit_identical(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    """Final parameters, optimizer state (every tensor), param groups and schedule: equal."""
    assert resumed["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    got, want = resumed["optimizer"], reference["optimizer"]
    assert got["state"].keys() == want["state"].keys()
    for index, slots in want["state"].items():
        assert got["state"][index].keys() == slots.keys()
        for slot, value in slots.items():
            assert torch.equal(got["state"][index][slot], value), (index, slot)
    assert got["param_groups"] == want["param_groups"]
    assert resumed["scheduler"] == reference["scheduler"]


def latest(run: str | Path) -> str:
    result = run_ckpt("latest", str(run))
    assert result.exit_code == 0, result.stdout + result.stderr
    return result.stdout.strip()


def dcp_model(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `model` entry of a saved DCP folder, read by `dcp.load` itself."""
    import torch.distributed.checkpoint as dcp

    target = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted single-process run: steps 1..12, saving every 3."""
    root = tmp_path_factory.mktemp("reference")
    proc = train(root / "run", root / "final")
    assert proc.stdout == ""  # the checkpointer logs; it never prints
    assert "step 12 saved" in proc.stderr
    return final_state(root / "final")


@pytest.mark.slow
@pytest.mark.timeout(900)  # three training processes on a shared machine
def test_sigkill_during_a_background_write_leaves_the_previous_save_latest_and_resume_is_bit_identical(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    train_and_kill_at("write@9", run, tmp_path / "killed")

    # step 9 was being written: its data is in the staging folder, its commit marker is not
    staging = [p for p in run.iterdir() if p.name.startswith(".step-9.ckpt-tmp-")]
    assert len(staging) == 1
    assert (staging[0] / "__0_0.distcp").is_file()
    assert not (staging[0] / ".metadata").exists()
    assert not (run / "step-9").exists()
    assert latest(run) == str(run / "step-6")
    verdict = run_ckpt("verify", str(run / "step-6"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout

    proc = train(run, tmp_path / "resumed", "--resume")
    assert proc.stdout == ""
    resumed = final_state(tmp_path / "resumed")
    assert (resumed["start"], resumed["tier"]) == (6, "local")
    assert_bit_identical(resumed, reference)
    # the saves are ordinary DCP folders: ckpt finds the whole training state in them...
    assert latest(run) == str(run / "step-12")
    verdict = run_ckpt("verify", str(run / "step-12"), "--exact", "--checksums")
    assert verdict.exit_code == 0 and "exact: yes" in verdict.stdout, verdict.stdout
    # ...and dcp.load reads the final parameters back
    for name, tensor in dcp_model(run / "step-12", resumed["model"]).items():
        assert torch.equal(tensor, resumed["model"][name]), name
    # retention kept the newest two; the interrupted save's staging folder was cleaned up
    assert sorted(p.name for p in run.iterdir()) == ["step-12", "step-9"]


def _copy_prefix(endpoint: str, bucket: str, src: str, dest: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for key in list_keys(endpoint, bucket, f"{src}/"):
        client.copy_object(
            Bucket=bucket, Key=dest + key[len(src) :], CopySource={"Bucket": bucket, "Key": key}
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_an_upload_leaves_the_previous_upload_latest_remotely_and_both_tiers_resume(
    tmp_path: Path, reference: dict[str, Any], s3_server: S3Server
) -> None:
    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    train_and_kill_at("upload@9", run, tmp_path / "killed", "--upload", "s3://ckpt/exp")

    # locally step 9 was published before its upload began
    assert latest(run) == str(run / "step-9")
    # remotely it is cut short: some of its objects, not its commit marker
    step9 = list_keys(s3_server.endpoint, "ckpt", "exp/step-9/")
    assert step9 and "exp/step-9/.metadata" not in step9
    assert latest("s3://ckpt/exp") == "s3://ckpt/exp/step-6"
    # a second node that lost its disk will resume from this object store
    _copy_prefix(s3_server.endpoint, "ckpt", "exp", "lost")

    # the same node resumes from its local tier (newer than the object store's)
    proc = train(run, tmp_path / "local", "--resume", "--upload", "s3://ckpt/exp")
    assert proc.stdout == ""
    resumed = final_state(tmp_path / "local")
    assert (resumed["start"], resumed["tier"]) == (9, "local")
    assert_bit_identical(resumed, reference)
    # and its next save finished the interrupted upload of step 9
    assert latest("s3://ckpt/exp") == "s3://ckpt/exp/step-12"
    assert "exp/step-9/.metadata" in list_keys(s3_server.endpoint, "ckpt", "exp/step-9/")

    # a node with an empty disk pulls the newest complete remote save: step 6, not the cut 9
    fresh = tmp_path / "fresh-node"
    proc = train(fresh, tmp_path / "remote", "--resume", "--upload", "s3://ckpt/lost")
    resumed = final_state(tmp_path / "remote")
    assert (resumed["start"], resumed["tier"]) == (6, "remote")
    assert "pulling step-6" in proc.stderr
    assert_bit_identical(resumed, reference)


def test_a_save_while_another_is_in_flight_is_skipped_and_says_so(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ckpt_cli import Checkpointer

    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPT_TEST_PAUSE_AT", "publish@2")
    monkeypatch.setenv("CKPT_TEST_PAUSE_FILE", str(marker))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = tmp_path / "run"
    ck = Checkpointer(run, on_busy="skip")
    with caplog.at_level(logging.INFO, logger="ckpt_cli.checkpointer"):
        first = ck.save(2, {"model": model, "optimizer": optimizer})
        assert first.phase != "skipped"
        while not marker.exists():  # step 2 is sealed and waits before its rename
            time.sleep(0.02)
        second = ck.save(4, {"model": model, "optimizer": optimizer})
        status = ck.status()
        marker.unlink()  # let step 2 go on
        done = ck.wait()
    assert second.phase == "skipped" and second.error == "step 2 was still being saved"
    assert status.skipped == 1 and status.in_flight is not None and status.in_flight.step == 2
    assert "save of step 4 skipped: step 2 is still in flight" in caplog.text
    assert done is not None and (done.step, done.phase) == (2, "done")
    assert ck.status().last_complete_step == 2 and ck.status().failures == 0
    assert latest(run) == str(run / "step-2") and not (run / "step-4").exists()
    ck.close()
    assert capsys.readouterr().out == ""


@pytest.fixture(scope="module")
def dist_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run on 2 ranks (gloo, DDP)."""
    require_torchrun_marker()
    root = tmp_path_factory.mktemp("dist-reference")
    train(root / "run", root / "final", nproc=2)
    return [final_state(root / "final", rank) for rank in (0, 1)]


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_ranks_write_their_own_shards_survive_sigkill_mid_write_and_resume_bit_identically(
    tmp_path: Path, dist_reference: list[dict[str, Any]]
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    train_and_kill_at("write@6", run, tmp_path / "killed", nproc=2)

    # both ranks' data of step 6 is in the staging folder; the marker rank 0 writes last is not
    staging = [p for p in run.iterdir() if p.name.startswith(".step-6.ckpt-tmp-")]
    assert len(staging) == 1
    assert {p.name for p in staging[0].iterdir()} == {"__0_0.distcp", "__1_0.distcp"}
    assert latest(run) == str(run / "step-3")
    # each rank wrote its own shard of step 3 (DCP spread the replicated tensors over them)
    metadata = FileSystemReader(str(run / "step-3")).read_metadata()
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}

    train(run, tmp_path / "resumed", "--resume", nproc=2)
    for rank in (0, 1):
        resumed = final_state(tmp_path / "resumed", rank)
        assert (resumed["start"], resumed["tier"]) == (3, "local")
        assert_bit_identical(resumed, dist_reference[rank])
    assert latest(run) == str(run / "step-12")
    verdict = run_ckpt("verify", str(run / "step-12"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout
    final = final_state(tmp_path / "resumed", 0)["model"]
    for name, tensor in dcp_model(run / "step-12", final).items():
        assert torch.equal(tensor, final[name]), name


def _protected_run(run: Path) -> dict[int, dict[str, torch.Tensor]]:
    """A run saving steps 2, 4, 6, 8 with retention (keep_last 1, keep_every 4) and parity
    (protect 1); each save's model parameters, by step."""
    from ckpt_cli import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(run, keep_last=1, keep_every=4, protect=1) as ck:
        for step in (2, 4, 6, 8):
            model(torch.randn(3, 64)).sum().backward()
            optimizer.step()
            ck.save(step, {"model": model, "optimizer": optimizer})
            saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            record = ck.wait()
            assert record is not None and record.phase == "done", record
    assert record.pruned == ["step-6"]
    return saved


def _weight_shard(save: Path) -> tuple[Path, int, int]:
    """The data file holding `model.weight` of a DCP save, and its bytes' offset and length."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(save)).read_metadata().storage_data
    weight = next(info for index, info in storage.items() if index.fqn == "model.weight")
    return save / weight.relative_path, weight.offset, weight.length


def _resume(run: Path) -> tuple[Any, torch.nn.Linear, torch.optim.AdamW]:
    from ckpt_cli import Checkpointer

    fresh = torch.nn.Linear(64, 32)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    loaded = Checkpointer(run).load_latest(into={"model": fresh, "optimizer": fresh_optimizer})
    return loaded, fresh, fresh_optimizer


def test_retention_parity_and_a_corrupt_newest_save_repaired_from_its_parity_on_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    saved = _protected_run(run)
    # the newest (keep_last 1) and the multiples of 4 (keep_every 4) are left, each protected
    assert sorted(p.name for p in run.iterdir()) == ["step-4", "step-8"]
    assert (run / "step-8" / ".ckpt-parity" / "parity.index.json").is_file()
    verdict = run_ckpt("verify", str(run / "step-8"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout

    # a bit flips in the newest save's data: its parity rebuilds it, as `ckpt repair` does,
    # and that save is loaded, not the older step 4
    shard, offset, length = _weight_shard(run / "step-8")
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ckpt_cli.checkpointer"):
        loaded, fresh, fresh_optimizer = _resume(run)
    assert loaded is not None and (loaded.step, loaded.tier) == (8, "local")
    assert loaded.repaired == [shard.name] and loaded.skipped == []
    assert "checksums" in loaded.verified
    assert f"rebuilt {shard.name} from its parity" in caplog.text
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[8][name]), name
    assert fresh_optimizer.state_dict()["state"][0]["step"] == torch.tensor(4.0)
    verdict = run_ckpt("verify", str(run / "step-8"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout


def test_a_newest_save_that_lost_its_metadata_is_rebuilt_from_its_parity_and_loaded(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    saved = _protected_run(run)
    (run / "step-8" / ".metadata").unlink()  # the commit marker is gone: the save looks unfinished
    loaded, fresh, _ = _resume(run)
    assert loaded is not None and (loaded.step, loaded.tier) == (8, "local")
    assert loaded.repaired == [".metadata"]
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[8][name]), name
    assert latest(run) == str(run / "step-8")


def _two_saves(run: Path, protect: int) -> None:
    """Steps 1 and 2 of a Linear(8, 8) whose weight is filled with the step."""
    from ckpt_cli import Checkpointer

    model = torch.nn.Linear(8, 8)
    with Checkpointer(run, protect=protect) as ck:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            ck.save(step, {"model": model})
            assert (record := ck.wait()) is not None and record.phase == "done", record


@pytest.mark.parametrize(
    ("garbled", "protect"),
    [
        ("ckpt-manifest.json", 0),
        (".ckpt-parity/parity.index.json", 1),
    ],
)
def test_a_newest_save_whose_checksum_manifest_is_corrupt_is_passed_over_with_the_reason(
    tmp_path: Path, garbled: str, protect: int
) -> None:
    """A save's `ckpt-manifest.json` garbled on disk: load_latest raised verify's FormatError
    ("is not a valid ckpt checksum manifest") instead of judging the save damaged and passing
    it over for the previous save, saying why."""
    from ckpt_cli import Checkpointer

    run = tmp_path / "run"
    _two_saves(run, protect)
    (run / "step-2" / garbled).write_text("{garbled")
    fresh = torch.nn.Linear(8, 8)
    loaded = Checkpointer(run).load_latest({"model": fresh})
    assert loaded is not None
    assert loaded.step == 1 and loaded.repaired == [] and len(loaded.skipped) == 1, loaded
    assert loaded.skipped[0].startswith("step-2: ") and garbled in loaded.skipped[0]
    if protect:
        assert loaded.skipped[0].endswith("so its parity cannot rebuild it"), loaded.skipped
    assert torch.equal(fresh.weight, torch.full_like(fresh.weight, float(loaded.step)))


@pytest.mark.parametrize("data", ["intact", "flipped"])
def test_a_garbled_checksum_manifest_of_a_save_whose_parity_finds_it_intact_is_written_again(
    tmp_path: Path, data: str
) -> None:
    """A save written with protect= whose `ckpt-manifest.json` is garbled (parity does not
    cover the manifest): load_latest passed the newest save over for the previous one, though
    its parity proved every data file and `.metadata` intact. The manifest is now written
    again from the files the parity vouches for, and the save loaded (named in `repaired`);
    `ckpt verify --checksums` passes on it afterwards. With a data file damaged too, the
    parity rebuilds it and the manifest is written again after it (it was passed over)."""
    from ckpt_cli import Checkpointer

    run = tmp_path / "run"
    _two_saves(run, protect=1)
    (run / "step-2" / "ckpt-manifest.json").write_text("{garbled")
    rebuilt = []
    if data == "flipped":
        shard, offset, length = _weight_shard(run / "step-2")
        damaged = bytearray(shard.read_bytes())
        damaged[offset + length // 2] ^= 0xFF
        shard.write_bytes(bytes(damaged))
        rebuilt = [shard.name]
    fresh = torch.nn.Linear(8, 8)
    loaded = Checkpointer(run).load_latest({"model": fresh})
    assert loaded is not None
    assert (loaded.step, loaded.skipped) == (2, []), loaded
    assert loaded.repaired == [*rebuilt, "ckpt-manifest.json"]
    assert torch.equal(fresh.weight, torch.full_like(fresh.weight, 2.0))
    checked = run_ckpt("verify", run / "step-2", "--checksums")
    assert checked.exit_code == 0, checked.stdout + checked.stderr
    assert latest(run) == str(run / "step-2")


def test_a_newest_save_damaged_beyond_its_parity_is_passed_over_with_the_reason(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    saved = _protected_run(run)
    shard, _, _ = _weight_shard(run / "step-8")
    shard.unlink()  # one data file and one parity share: a whole lost file is beyond it
    loaded, fresh, fresh_optimizer = _resume(run)
    assert loaded is not None and (loaded.step, loaded.tier) == (4, "local")
    assert loaded.repaired == []
    assert len(loaded.skipped) == 1 and loaded.skipped[0].startswith("step-8: "), loaded.skipped
    assert shard.name in loaded.skipped[0] and "parity" in loaded.skipped[0]
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[4][name]), name
    assert fresh_optimizer.state_dict()["state"][0]["step"] == torch.tensor(2.0)


EXIT_SCRIPT = """
import logging, os, signal, sys, threading, time
from pathlib import Path
import torch
from ckpt_cli import Checkpointer

logging.basicConfig(level=logging.INFO)
run, marker, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Linear(64, 32)
torch.save(model.state_dict(), run + ".ref.pt")
Checkpointer(run).save(1, {"model": model, "step": 1})  # no close(), no wait()
while not marker.exists():  # the data is written; the checksums and the publish are not
    time.sleep(0.02)

def go_on() -> None:  # the save carries on once the script has begun to exit
    time.sleep(0.5)
    marker.unlink()

threading.Thread(target=go_on, daemon=True).start()
if mode == "sigterm":  # a handler that exits cleanly, as job schedulers expect
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
raise RuntimeError("the training loop crashed after the save")
"""


@pytest.mark.parametrize("mode", ["raise", "sigterm"])
@pytest.mark.slow
def test_a_script_that_ends_while_its_save_is_in_flight_still_publishes_it(
    tmp_path: Path, mode: str
) -> None:
    run = tmp_path / "run"
    marker = tmp_path / "paused"
    env = torchrun_env({"CKPT_TEST_PAUSE_AT": "write@1", "CKPT_TEST_PAUSE_FILE": str(marker)})
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(run), str(marker), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == (143 if mode == "sigterm" else 1), proc.stderr
    assert "save of step 1 failed" not in proc.stderr, proc.stderr
    # the exit waits for the write, which may take minutes: the log says so, not a silent hang
    waits = proc.stderr.index("the script is ending: waiting for the save of step 1 in flight")
    assert waits < proc.stderr.index("step 1 saved"), proc.stderr
    assert latest(run) == str(run / "step-1")
    verdict = run_ckpt("verify", str(run / "step-1"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout
    saved = torch.load(f"{run}.ref.pt")
    for name, tensor in dcp_model(run / "step-1", saved).items():
        assert torch.equal(tensor, saved[name]), name


RANK_VALUES_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer

run, out = sys.argv[1], sys.argv[2]
from tests.dist_helpers import RANK_TIMEOUT

dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
torch.manual_seed(1000 + rank)  # each rank draws from its own RNG stream
saved = {"rng": {"torch": torch.get_rng_state()}, "seen": torch.tensor([rank, 7 * rank]),
         "samples": 100 + rank, "step": 5}
with Checkpointer(run) as ck:
    ck.save(5, {"model": model, **saved})
torch.manual_seed(0)  # the state the resumed process starts from
into = {"model": model, "rng": {"torch": torch.get_rng_state()}, "seen": None, "samples": 0,
        "step": 0}
loaded = Checkpointer(run).load_latest(into)
torch.save({"saved": saved, "loaded": {k: into[k] for k in saved}}, f"{out}.rank{rank}.pt")
dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_two_ranks_resume_each_its_own_rng_state_and_counters(tmp_path: Path) -> None:
    from .dist_helpers import run_torchrun

    script = tmp_path / "rank_values.py"
    script.write_text(RANK_VALUES_SCRIPT)
    run_torchrun(script, 2, tmp_path / "run", tmp_path / "out")
    states = [torch.load(tmp_path / f"out.rank{rank}.pt") for rank in (0, 1)]
    assert not torch.equal(states[0]["saved"]["rng"]["torch"], states[1]["saved"]["rng"]["torch"])
    for state in states:
        saved, loaded = state["saved"], state["loaded"]
        assert torch.equal(loaded["rng"]["torch"], saved["rng"]["torch"])
        assert torch.equal(loaded["seen"], saved["seen"])
        assert (loaded["samples"], loaded["step"]) == (saved["samples"], saved["step"])
    # one process resuming from the 2-rank save gets rank 0's values
    from ckpt_cli import Checkpointer

    into: dict[str, Any] = {"rng": {"torch": None}, "samples": 0}
    Checkpointer(tmp_path / "run").load_latest(into)
    assert torch.equal(into["rng"]["torch"], states[0]["saved"]["rng"]["torch"])
    assert into["samples"] == 100


RANK_STATEFUL_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT


class ShardReader:  # each rank reads its own shard: its position and shuffling generator differ
    def __init__(self, rank):
        self.position = 0
        self.generator = torch.Generator().manual_seed(100 + rank)

    def advance(self, n):
        self.position += n
        torch.randperm(8, generator=self.generator)

    def state_dict(self):
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.generator.set_state(state["generator"])


run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(8, 8)
reader = ShardReader(rank)
reader.advance(10 + rank)
with Checkpointer(run) as ck:
    ck.save(5, {"model": model, "data": reader})
saved = reader.state_dict()
into = {"model": torch.nn.Linear(8, 8), "data": ShardReader(rank)}
Checkpointer(run).load_latest(into)
torch.save({"saved": saved, "loaded": into["data"].state_dict()}, f"{out}.rank{rank}.pt")
dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_two_ranks_resume_each_its_own_stateful_data_loader_state(tmp_path: Path) -> None:
    """A data loader whose state differs by rank (its shard's position and shuffling
    generator): each rank resumed with the state of another rank (DCP keeps one rank's copy of
    a key every rank saves), so the resumed run read other batches than the uninterrupted one."""
    from .dist_helpers import run_torchrun

    script = tmp_path / "rank_stateful.py"
    script.write_text(RANK_STATEFUL_SCRIPT)
    run_torchrun(script, 2, tmp_path / "run", tmp_path / "out")
    states = [torch.load(tmp_path / f"out.rank{rank}.pt") for rank in (0, 1)]
    assert states[0]["saved"]["position"] != states[1]["saved"]["position"]
    for state in states:
        saved, loaded = state["saved"], state["loaded"]
        assert loaded["position"] == saved["position"]
        assert torch.equal(loaded["generator"], saved["generator"])
    # one process resuming from the 2-rank save gets rank 0's state
    from ckpt_cli import Checkpointer

    class Reader:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = state

    reader = Reader()
    Checkpointer(tmp_path / "run").load_latest({"model": torch.nn.Linear(8, 8), "data": reader})
    assert reader.state["position"] == states[0]["saved"]["position"]
    assert torch.equal(reader.state["generator"], states[0]["saved"]["generator"])


LOAD_AFTER_CLOSE_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(8, 8)
ck = Checkpointer(run)
ck.save(1, {"model": model, "seen": rank})
ck.close()  # the training is over; the script then reloads the newest save with the same object
try:
    loaded = ck.load_latest({"model": torch.nn.Linear(8, 8), "seen": 0})
    result = {"loaded": loaded.step if loaded else None}
except CkptError as error:
    result = {"raised": type(error).__name__, "exit_code": error.exit_code, "text": str(error)}
except Exception as error:
    result = {"bug": f"{type(error).__name__}: {error}"}
again = Checkpointer(run).load_latest({"model": torch.nn.Linear(8, 8), "seen": 0})
result["new_checkpointer_loaded"] = again.step if again else None
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_load_latest_after_close_on_two_ranks_says_the_checkpointer_is_closed(
    tmp_path: Path,
) -> None:
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "load_after_close.py"
    script.write_text(LOAD_AFTER_CLOSE_SCRIPT)
    run_torchrun(script, 2, tmp_path / "run", tmp_path / "out")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert result.get("raised") == "UsageError", result
        assert result["exit_code"] == 2
        assert "closed" in result["text"] and "new Checkpointer" in result["text"], result
        # what the error says to do works: a new Checkpointer on every rank loads the save
        assert result["new_checkpointer_loaded"] == 1


REPAIR_ON_TWO_RANKS_SCRIPT = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(64, 64)
with Checkpointer(run, protect=1) as ck:
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        ck.save(step, {"model": model, "seen": 10 * rank + step})
dist.barrier()
if rank == 0:  # a bit of the newest save flips on the shared disk
    storage = FileSystemReader(str(run / "step-2")).read_metadata().storage_data
    weight = next(info for index, info in storage.items() if index.fqn == "model.weight")
    shard = run / "step-2" / weight.relative_path
    data = bytearray(shard.read_bytes())
    data[weight.offset + weight.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
dist.barrier()
into = {"model": torch.nn.Linear(64, 64), "seen": 0}
loaded = Checkpointer(run).load_latest(into)
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"step": loaded.step, "repaired": loaded.repaired, "seen": into["seen"],
               "weight": into["model"].weight.unique().tolist()}, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_two_ranks_resume_from_a_damaged_save_their_parity_rebuilds(tmp_path: Path) -> None:
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "repair_on_two_ranks.py"
    script.write_text(REPAIR_ON_TWO_RANKS_SCRIPT)
    run_torchrun(script, 2, tmp_path / "run", tmp_path / "out")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert result["step"] == 2 and result["seen"] == 10 * rank + 2, result
        assert result["weight"] == [2.0], result
        assert len(result["repaired"]) == 1 and result["repaired"][0].endswith(".distcp"), result


ONE_RANK_FAILS_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(8, 8)  # a replica on every rank, as DDP keeps it
ck = Checkpointer(run)
saves = []
for step in (1, 2, 3):
    with torch.no_grad():
        model.weight.fill_(step)
        model.bias.fill_(step)
    state = {"model": model, "seen": step}
    if rank == 1 and step == 2:  # this rank's state of step 2 cannot be saved
        state["batches"] = (i for i in range(3))
    try:
        saves.append(ck.save(step, state).model_dump(mode="json"))
    except Exception as error:  # the loop logs it and trains on
        saves.append({"step": step, "raised": type(error).__name__})
ck.close()
status = ck.status()
into = {"model": torch.nn.Linear(8, 8), "seen": 0}
loaded = Checkpointer(run).load_latest(into)
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"saves": saves, "failures": status.failures, "loaded": loaded.step,
               "seen": into["seen"], "weight": into["model"].weight.unique().tolist()}, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_rank_whose_save_raises_leaves_that_step_unsaved_on_every_rank_never_torn(
    tmp_path: Path,
) -> None:
    """Rank 1's state of step 2 cannot be staged (its `save` raises, the loop catches it and
    goes on): no rank writes step 2, and step 3 is whole. It used to leave rank 0's background
    write of step 2 waiting for rank 1, which then wrote its step 3 into step 2's folder: a
    step-2 save of rank 0's step 2 and rank 1's step 3 was published (and the job hung)."""
    import json

    require_torchrun_marker()
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    proc = run_launch(torchrun_command(2, script, run, out), 240, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[1]["saves"][1] == {"step": 2, "raised": "UsageError"}
    step2 = ranks[0]["saves"][1]
    assert step2["phase"] == "failed" and "rank 1 could not stage step 2" in step2["error"]
    for rank in ranks:  # step 3 was saved whole, and each rank resumes from it
        assert [s.get("phase") for s in rank["saves"][::2]] == ["staged", "staged"]
        assert (rank["loaded"], rank["seen"], rank["weight"]) == (3, 3, [3.0])
    assert ranks[0]["failures"] == 1
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-3"]
    assert latest(run) == str(run / "step-3")
    verdict = run_ckpt("verify", str(run / "step-3"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout


DAMAGED_RUN_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown
from tests.test_checkpointer import _flip_tensor_byte
from pathlib import Path

run, out = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
with Checkpointer(run) as ck:
    for step in (1, 2):
        ck.save(step, {"model": model, "seen": step})
        ck.wait()
dist.barrier()
if rank == 0:  # bit rot in the weights of every save of the run
    for step in (1, 2):
        _flip_tensor_byte(run / f"step-{step}", "model.weight")
dist.barrier()
try:
    Checkpointer(run).load_latest({"model": torch.nn.Linear(16, 8), "seen": 0})
    got = {"raised": None}
except Exception as error:
    got = {"raised": type(error).__name__, "exit_code": getattr(error, "exit_code", None),
           "message": str(error), "fix": getattr(error, "fix", None)}
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_two_ranks_whose_every_save_is_damaged_raise_the_damage_not_an_io_error(
    tmp_path: Path,
) -> None:
    """Every save of a 2-rank run damaged: `load_latest` raised an `IOFailure` (exit 74, "the
    operating system refused a read or a write") on every rank, quoting rank 0's message, where
    one process raises the `FormatError` (exit 4) naming each save: a script that catches the
    damage (or a job scheduler reading the exit code) took it for a disk fault."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "damaged_run.py"
    script.write_text(DAMAGED_RUN_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    run_torchrun(script, 2, run, out)
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert (got["raised"], got["exit_code"]) == ("FormatError", 4), got
        assert "step-1: " in got["message"] and "step-2: " in got["message"], got
        assert "ckpt verify" in got["fix"], got


SAVE_ON_TWO_RANKS_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
with Checkpointer(sys.argv[1]) as ck:
    ck.save(5, {"model": model, "samples": 100 + rank})
dist.barrier()
leave_without_teardown()
"""

LOAD_ON_THREE_RANKS_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
got = {}
for run in sys.argv[2:]:
    into = {"model": torch.nn.Linear(8, 8), "samples": 0}
    try:
        loaded = Checkpointer(run).load_latest(into)
        got[run] = {"step": loaded.step, "samples": into["samples"]}
    except CkptError as error:  # the script starts those ranks afresh: none may wait for it
        got[run] = {"raised": type(error).__name__, "exit_code": error.exit_code,
                    "message": str(error)}
with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_two_rank_save_resumed_on_three_ranks_fails_or_loads_on_every_rank_alike(
    tmp_path: Path,
) -> None:
    """A 2-rank save (with each rank's own sample counter) resumed on 3 ranks: rank 2, which
    has no values of its own, raised the `FormatError`, while ranks 0 and 1 waited in
    `dcp.load` for it, then failed with gloo's `RuntimeError: Connection closed by peer` once
    it exited (or waited on, had the script caught the error on rank 2). Resharded with
    `--rank-state drop`, ranks 1 and 2 raised and rank 0 loaded and trained on alone. Now every
    rank raises the same error; a save resharded with `--rank-state replicate` loads on all."""
    import json

    from .dist_helpers import run_torchrun

    save_script, load_script = tmp_path / "save.py", tmp_path / "load.py"
    save_script.write_text(SAVE_ON_TWO_RANKS_SCRIPT)
    load_script.write_text(LOAD_ON_THREE_RANKS_SCRIPT)
    run = tmp_path / "run"
    run_torchrun(save_script, 2, run)
    for mode in ("drop", "replicate"):
        (tmp_path / mode).mkdir()
        cut = run_ckpt(
            "reshard",
            run / "step-5",
            tmp_path / mode / "step-5",
            "--world-size",
            "3",
            "--rank-state",
            mode,
        )
        assert cut.exit_code == 0, cut.stdout + cut.stderr
    out = tmp_path / "out"
    run_torchrun(load_script, 3, out, run, tmp_path / "drop", tmp_path / "replicate")
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1, 2)]
    for rank, got in enumerate(ranks):
        for where, first in ((run, 2), (tmp_path / "drop", 1)):
            failed = got[str(where)]
            assert (failed["raised"], failed["exit_code"]) == ("FormatError", 4), (rank, failed)
            # a rank without values names itself; the others, the first rank without
            named = max(rank, first)
            assert f"holds no values of rank {named} (such as 'samples')" in failed["message"]
        # rank 2 gets a copy of rank 1's values (rank 0's are saved under their own names)
        assert got[str(tmp_path / "replicate")] == {"step": 5, "samples": 100 + min(rank, 1)}


ONE_RANK_CANNOT_WRITE_SCRIPT = """
import json, resource, signal, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)  # 257 KiB of weights on each rank
records = []
with Checkpointer(run) as ck:
    for step in (1, 2, 3):
        if rank == 1 and step == 2:  # this rank's file size limit: its shard cannot be written
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        ck.save(step, {"model": model, "seen": step})
        records.append(ck.wait().model_dump(mode="json"))
        if rank == 1 and step == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(records, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_rank_that_cannot_write_its_shard_is_named_with_its_error_and_fix_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 1 cannot write its shard of step 2 (its file size limit, `ulimit -f`). Both ranks
    logged `save of step 2 failed: OSError: [Errno 27] File too large`: rank 0 as if its own
    write had failed, with no rank, no file and no fix. The other steps are saved whole."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "one_rank_cannot_write.py"
    script.write_text(ONE_RANK_CANNOT_WRITE_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    run_torchrun(script, 2, run, out)
    for rank in (0, 1):
        records = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert [r["phase"] for r in records] == ["done", "failed", "done"], records
        error = records[1]["error"]
        assert "rank 1 of 2" in error and "step 2" in error, error
        assert "__1_*.distcp" in error and "File too large (EFBIG)" in error, error
        assert "ulimit -f" in error, error
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-3"]
    assert latest(run) == str(run / "step-3")


DIFFERENT_STEPS_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(4, 4)
got = {}
with Checkpointer(run) as ck:
    try:  # each rank counts its own steps, and they drifted apart
        got["drifted"] = ck.save(100 + rank, {"model": model, "seen": rank}).phase
    except CkptError as error:
        got["drifted"] = {"raised": type(error).__name__, "message": str(error)}
    ck.save(200, {"model": model, "seen": rank})
    got["next"] = ck.wait().model_dump(mode="json")
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_ranks_that_save_different_steps_are_refused_on_every_rank_and_save_nothing(
    tmp_path: Path,
) -> None:
    """Rank 0 called `save(100, ...)` and rank 1 `save(101, ...)`: one folder `step-100` held
    both ranks' state, and rank 1 reported `step 101 saved: RUN/step-101`, a folder that was
    never written. Now every rank raises the same `UsageError` naming both steps, nothing is
    written, and the next save goes on normally."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "different_steps.py"
    script.write_text(DIFFERENT_STEPS_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    run_torchrun(script, 2, run, out)
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert got["drifted"]["raised"] == "UsageError", got
        assert "different steps (rank 0: 100, rank 1: 101)" in got["drifted"]["message"]
        assert got["next"]["phase"] == "done" and got["next"]["path"] == str(run / "step-200")
    assert sorted(p.name for p in run.iterdir()) == ["step-200"]


def _flip_tensor_byte(save: Path, fqn: str) -> None:
    """Damage one byte of the tensor `fqn` in a saved DCP folder (a bit rot on disk)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    storage = FileSystemReader(str(save)).read_metadata().storage_data
    info = next(info for index, info in storage.items() if index.fqn == fqn)
    shard = save / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_retention_keeps_the_users_folders_and_never_deletes_the_save_just_written(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file, save_file

    from ckpt_cli import Checkpointer

    model = torch.nn.Linear(4, 4)
    run = tmp_path / "run"
    # folders the user put in the run folder: an HF-style checkpoint and exports, two of them
    # with higher steps than this run reaches
    theirs = ("checkpoint-5", "export-step-3", "finetune-step-700")
    for name in theirs:
        (run / name).mkdir(parents=True)
        save_file({"w": torch.ones(2)}, run / name / "model.safetensors")
        os.utime(run / name, (0, 0))
    with Checkpointer(run, keep_last=2) as ck:
        for step in (10, 20, 30):
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
    assert sorted(p.name for p in run.iterdir()) == sorted([*theirs, "step-20", "step-30"])
    for name in theirs:
        assert torch.equal(load_file(run / name / "model.safetensors")["w"], torch.ones(2))

    # the newest save rots; the run resumes from step 20 and goes on: its new saves stay
    _flip_tensor_byte(run / "step-30", "model.weight")
    ck = Checkpointer(run, keep_last=1)
    into: dict[str, Any] = {"model": model, "step": 0}
    loaded = ck.load_latest(into)
    assert loaded is not None and loaded.step == 20 and into["step"] == 20
    # (keep_last 1 counts the rotten step-30 as the newest: each new save is kept as the save
    # just written, and once it is, the one before goes)
    for step, pruned in ((21, ["step-20"]), (22, ["step-21"])):
        ck.save(step, {"model": model, "step": step})
        record = ck.wait()
        assert record is not None and record.phase == "done", record
        assert record.pruned == pruned
    ck.close()
    assert {p.name for p in run.iterdir()} == {*theirs, "step-22", "step-30"}
    again = Checkpointer(run).load_latest({"model": model, "step": 0})
    assert again is not None and again.step == 22


@pytest.mark.slow
def test_remote_retention_also_keeps_the_users_folders_uploaded_from_the_run_folder(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The upload sends the whole run folder, the user's exports too; retention in the bucket
    judged every folder there: each save deleted `export-step-3` from the bucket (sent again by
    the next one), and counted `finetune-step-700` as the newest save. It now judges the
    Checkpointer's own saves only, as it does on the local disk."""
    from safetensors.torch import load, save_file

    from ckpt_cli import Checkpointer

    from .s3_fixtures import fetch_object

    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    theirs = ("export-step-3", "finetune-step-700")
    for name in theirs:
        (run / name).mkdir(parents=True)
        save_file({"w": torch.ones(2)}, run / name / "model.safetensors")
    model = torch.nn.Linear(8, 8)
    with Checkpointer(run, keep_last=2, upload="s3://ckpt/exp") as ck:
        for step in (10, 20, 30):
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
            assert not any(name in pruned for pruned in record.pruned for name in theirs)
    assert record.pruned == ["step-10", "s3://ckpt/exp/step-10"]
    remote = {key.split("/")[1] for key in list_keys(s3_server.endpoint, "ckpt", "exp/")}
    assert remote == {".ckpt-sync.json", *theirs, "step-20", "step-30"}
    for name in theirs:
        body = fetch_object(s3_server.endpoint, "ckpt", f"exp/{name}/model.safetensors")
        assert torch.equal(load(body)["w"], torch.ones(2))


@pytest.mark.slow
def test_a_fresh_node_pulls_the_newest_checkpointer_save_not_another_folder_of_the_bucket(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The upload sends the run folder whole, so the bucket also holds the user's
    `finetune-step-700` (safetensors, no optimizer). `load_latest` on a node with an empty disk
    chose step-30 but pulled the bucket's newest folder, `finetune-step-700`, then found no
    step-30 on disk and started from scratch ("no complete checkpoint")."""
    from safetensors.torch import save_file

    from ckpt_cli import Checkpointer

    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    (run / "finetune-step-700").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, run / "finetune-step-700" / "model.safetensors")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with Checkpointer(run, upload="s3://ckpt/exp") as ck:
        ck.save(30, {"model": model, "step": 30})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert latest("s3://ckpt/exp") == "s3://ckpt/exp/finetune-step-700"

    fresh_node = tmp_path / "fresh"
    into: dict[str, Any] = {"model": torch.nn.Linear(8, 8), "step": 0}
    loaded = Checkpointer(fresh_node, upload="s3://ckpt/exp").load_latest(into)
    assert loaded is not None and (loaded.step, loaded.tier) == (30, "remote"), loaded
    assert loaded.skipped == [] and into["step"] == 30
    for name, tensor in model.state_dict().items():
        assert torch.equal(into["model"].state_dict()[name], tensor), name
    assert sorted(p.name for p in fresh_node.iterdir()) == ["step-30"]


def _library_page_loop() -> str:
    """The Checkpointer example of docs/library.md, as a user copies it."""
    page = (REPO / "docs" / "library.md").read_text()
    section = page.split("## Checkpointing from a training loop", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_library_pages_training_loop_runs_as_written_and_resumes_from_the_bucket(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library page's loop, run as written (the names it leaves to the user defined as
    it says: a torchdata `StatefulDataLoader`), against a new bucket prefix: its first run
    starts fresh and saves, uploading each save with its parity; run again on a node with an
    empty disk, it resumes from the bucket at the last save. Each step of that story failed
    once (a plain `DataLoader`, an empty prefix, the parity against the checksum manifest)."""
    pytest.importorskip("torchdata", reason="the page's data loader is a StatefulDataLoader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    make_bucket(s3_server.endpoint, "bucket")
    code = _library_page_loop()
    assert 'upload="s3://bucket/exp1"' in code and "protect=1" in code

    def run(node: Path, total_steps: int) -> dict[str, Any]:
        monkeypatch.chdir(node)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        scope: dict[str, Any] = {
            "torch": torch,
            "model": model,
            "opt": opt,
            "sched": torch.optim.lr_scheduler.StepLR(opt, 50),
            "loader": StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True),
            "total_steps": total_steps,
        }

        def train_step() -> None:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            scope["sched"].step()

        scope["train_step"] = train_step
        exec(compile(code, "docs/library.md", "exec"), scope)
        return scope

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    done = run(first, 200)
    assert done["loaded"] is None and done["ck"].status().failures == 0
    assert latest("s3://bucket/exp1") == "s3://bucket/exp1/step-200"
    assert run_ckpt("verify", "s3://bucket/exp1/step-200", "--checksums").exit_code == 0
    resumed = run(second, 300)
    assert resumed["loaded"] is not None and resumed["loaded"].step == 200
    assert resumed["ck"].status().failures == 0
    assert latest("s3://bucket/exp1") == "s3://bucket/exp1/step-300"


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_a_new_run_with_upload_starts_fresh_on_an_empty_prefix_and_resumes_from_it_later(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The library page's loop, on its first run: `load_latest` before any save, with
    `upload=` naming a prefix of an existing bucket that holds nothing yet. It raised
    `HubError` ("the object store could not be read: no such object or prefix"), so a new run
    with an upload could never start. An empty prefix holds no save: None, a fresh start. A
    bucket that does not exist is still an error naming it (the uploads could not go there)."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import HubError

    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    model = torch.nn.Linear(8, 8)
    into: dict[str, Any] = {"model": model, "step": 0}
    with Checkpointer(run, upload="s3://ckpt/new-run") as ck:
        assert ck.load_latest(into) is None
        ck.save(5, {"model": model, "step": 5})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert latest("s3://ckpt/new-run") == "s3://ckpt/new-run/step-5"
    again: dict[str, Any] = {"model": torch.nn.Linear(8, 8), "step": 0}
    loaded = Checkpointer(tmp_path / "fresh", upload="s3://ckpt/new-run").load_latest(again)
    assert loaded is not None and (loaded.step, loaded.tier) == (5, "remote"), loaded
    with pytest.raises(HubError) as raised:
        Checkpointer(tmp_path / "other", upload="s3://no-such-bucket/run").load_latest(again)
    assert "the bucket 'no-such-bucket' does not exist" in str(raised.value)


@pytest.mark.slow
def test_the_next_save_removes_the_staging_folder_of_a_killed_save_without_retention(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    train_and_kill_at("write@9", run, tmp_path / "killed", "--keep-last", "0")
    debris = [p.name for p in run.iterdir() if p.name.startswith(".step-9.ckpt-tmp-")]
    assert len(debris) == 1
    train(run, tmp_path / "resumed", "--resume", "--keep-last", "0")
    assert {p.name for p in run.iterdir()} == {f"step-{s}" for s in (3, 6, 9, 12)}


def test_saves_from_two_threads_at_once_each_hold_their_own_tensors(tmp_path: Path) -> None:
    import threading

    from ckpt_cli import Checkpointer

    models = {step: torch.nn.Linear(512, 512) for step in (1, 2)}
    for step, model in models.items():
        with torch.no_grad():
            model.weight.fill_(step)
            model.bias.fill_(step)
    for trial in range(4):
        run = tmp_path / f"run{trial}"
        ck = Checkpointer(run, checksums=None)
        start = threading.Barrier(2)

        def save(step: int, ck: Checkpointer = ck, start: threading.Barrier = start) -> None:
            start.wait()
            ck.save(step, {"model": models[step]})

        threads = [threading.Thread(target=save, args=(step,)) for step in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ck.close()
        for step, model in models.items():
            like = {k: v.detach() for k, v in model.state_dict().items()}
            for name, tensor in dcp_model(run / f"step-{step}", like).items():
                assert torch.equal(tensor, like[name]), (trial, step, name)


class _TrainerOptimizer:
    """A Stateful wrapper around a torch optimizer, as training frameworks have (not an
    Optimizer itself): its state dict keys the moments by int parameter index."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def test_int_keys_and_empty_dicts_round_trip_and_a_wrapped_adam_resumes_its_moments(
    tmp_path: Path,
) -> None:
    from ckpt_cli import Checkpointer

    def build() -> tuple[torch.nn.Module, _TrainerOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return model, _TrainerOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    model, wrapped = build()
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
    saved_optimizer = wrapped.state_dict()
    plain = {
        "cfg": {"lr": 0.1, "extra_metrics": {}},
        "best": {},
        "by_layer": {0: "a", 1: torch.tensor([1.5, 2.5]), "2": [3, 4]},
    }
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(3, {"model": model, "trainer_opt": wrapped, **plain})
        assert (record := ck.wait()) is not None and record.phase == "done", record

    fresh_model, fresh = build()
    into: dict[str, Any] = {"model": fresh_model, "trainer_opt": fresh, **plain}
    loaded = Checkpointer(tmp_path / "run").load_latest(into)
    assert loaded is not None and loaded.step == 3
    assert into["cfg"] == {"lr": 0.1, "extra_metrics": {}} and into["best"] == {}
    assert list(into["by_layer"]) == [0, 1, "2"]
    assert into["by_layer"][0] == "a" and into["by_layer"]["2"] == [3, 4]
    assert torch.equal(into["by_layer"][1], torch.tensor([1.5, 2.5]))
    resumed = fresh.optimizer.state_dict()
    assert sorted(resumed["state"]) == [0, 1]
    for index, moments in saved_optimizer["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(resumed["state"][index][name], tensor), (index, name)


def test_a_save_before_the_first_optimizer_step_changes_nothing_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """A loop saves its initial state (step 0) before AdamW has stepped. DCP's state-dict API
    initialises an empty optimizer with a zero-gradient step: the save used to leave the live
    optimizer one step ahead (its bias correction then differs: other weights than a run that
    never saved), and a resume from that save started one step ahead too."""
    from ckpt_cli import Checkpointer

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        data = torch.Generator().manual_seed(1)
        for _ in range(5):
            model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model.weight.detach().clone()

    reference = train(*build())
    model, optimizer = build()
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(0, {"model": model, "optimizer": optimizer})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert optimizer.state_dict()["state"] == {}  # the live optimizer is as it was
    assert torch.equal(train(model, optimizer), reference)
    assert optimizer.state_dict()["state"][0]["step"] == torch.tensor(5.0)

    model, optimizer = build()
    with torch.no_grad():
        model.weight.fill_(7.0)  # the resume must bring back the saved weights
    loaded = Checkpointer(tmp_path / "run").load_latest({"model": model, "optimizer": optimizer})
    assert loaded is not None and loaded.step == 0
    assert optimizer.state_dict()["state"] == {}
    assert torch.equal(train(model, optimizer), reference)


def test_a_save_and_a_resume_never_run_the_optimizers_step_hooks_nor_touch_the_schedule(
    tmp_path: Path,
) -> None:
    """An EMA of the weights updated by the optimizer's step post-hook, a pre-hook counting
    steps, a global step hook, and a StepLR schedule. DCP fills an optimizer that has not
    stepped by calling its `step()`: a save of step 0 ran every hook once (the EMA counted an
    update that never happened, the step counter read 1), silenced the scheduler's warning of a
    `scheduler.step()` called before `optimizer.step()`, and every `load_latest` into a fresh
    optimizer ran its hooks twice more."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.optim.swa_utils import AveragedModel

    from ckpt_cli import Checkpointer

    def build() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        ema = AveragedModel(model)
        calls = {"pre": 0, "post": 0}

        def pre(*_: Any) -> None:
            calls["pre"] += 1

        def post(*_: Any) -> None:
            calls["post"] += 1
            ema.update_parameters(model)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        return model, optimizer, scheduler, ema, calls

    def train(model: Any, optimizer: Any, scheduler: Any, steps: int) -> None:
        data = torch.Generator().manual_seed(1)
        for _ in range(steps):
            model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

    every_step = {"n": 0}

    def count(*_: Any) -> None:
        every_step["n"] += 1

    handle = register_optimizer_step_post_hook(count)
    try:
        model, optimizer, scheduler, ema, calls = build()
        with Checkpointer(tmp_path / "run") as ck:
            ck.save(0, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "ema": ema})
            assert (record := ck.wait()) is not None and record.phase == "done", record
        assert (calls, every_step["n"], int(ema.n_averaged)) == ({"pre": 0, "post": 0}, 0, 0)
        with pytest.warns(UserWarning, match="before `optimizer.step"):
            scheduler.step()  # the loop's own mistake: still reported

        for steps in (0, 3):  # the step-0 save, then a save after three steps
            model, optimizer, scheduler, ema, calls = build()
            train(model, optimizer, scheduler, steps)
            with Checkpointer(tmp_path / f"run{steps}") as ck:
                state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
                ck.save(steps, {**state, "ema": ema})
                assert (record := ck.wait()) is not None and record.phase == "done", record
            saved_ema = int(ema.n_averaged)
            fresh, fresh_optimizer, fresh_scheduler, fresh_ema, fresh_calls = build()
            before = every_step["n"]
            into = {"model": fresh, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler}
            loaded = Checkpointer(tmp_path / f"run{steps}").load_latest({**into, "ema": fresh_ema})
            assert loaded is not None and loaded.step == steps
            assert fresh_calls == {"pre": 0, "post": 0} and every_step["n"] == before, steps
            assert int(fresh_ema.n_averaged) == saved_ema == steps
            train(model, optimizer, scheduler, 2)
            train(fresh, fresh_optimizer, fresh_scheduler, 2)
            assert torch.equal(fresh.weight, model.weight), steps
            for name, tensor in ema.state_dict().items():
                assert torch.equal(fresh_ema.state_dict()[name], tensor), (steps, name)
    finally:
        handle.remove()


def test_a_save_between_the_first_backward_and_the_first_optimizer_step_loads(
    tmp_path: Path,
) -> None:
    """With gradients already there, DCP does not fill the optimizer that has not stepped: the
    save holds no optimizer state, and `load_latest` refused it ("Missing key in checkpoint
    state_dict: optimizer.state.weight.step" and a fix telling to rebuild the optimizer as the
    run did, which it was)."""
    from ckpt_cli import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()  # the first micro-batch of an accumulation
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(0, {"model": model, "optimizer": optimizer})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    fresh = torch.nn.Linear(4, 4)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    loaded = Checkpointer(tmp_path / "run").load_latest(
        {"model": fresh, "optimizer": fresh_optimizer}
    )
    assert loaded is not None and loaded.step == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh_optimizer.state_dict()["state"] == {}
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1


def test_a_save_inside_inference_mode_then_one_outside_it_both_save(tmp_path: Path) -> None:
    """A loop that saves at its evaluation step, inside `torch.inference_mode()`, allocated
    the staging buffers as inference tensors there; every later save, outside it, raised
    torch's "Inplace update to inference tensor outside InferenceMode" into the loop."""
    from ckpt_cli import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        for step in (1, 2, 3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                with torch.inference_mode():  # the evaluation step saves
                    model(torch.randn(2, 8))
                    ck.save(step, {"model": model, "optimizer": optimizer})
            else:
                ck.save(step, {"model": model, "optimizer": optimizer})
            assert (record := ck.wait()) is not None and record.phase == "done", record
    fresh = torch.nn.Linear(8, 8)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with torch.inference_mode():  # an evaluator may load inside it too
        loaded = Checkpointer(run).load_latest({"model": fresh, "optimizer": fresh_optimizer})
    assert loaded is not None and loaded.step == 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh_optimizer.state_dict()["state"][0]["step"] == torch.tensor(3.0)


def test_verify_resumable_reads_the_step_a_checkpointer_save_records(tmp_path: Path) -> None:
    """A loop saves its model and optimizer and no `step` entry (the step is `save`'s own
    argument): `load_latest` resumes it at its step, but `ckpt verify --resumable` said
    "resumable: no (missing: step)", exit 1. The save records its step (`__ckpt__.step`)."""
    import json

    from ckpt_cli import Checkpointer

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        ck.save(300, {"model": model, "optimizer": optimizer})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    verdict = run_ckpt("verify", str(run / "step-300"), "--resumable", "--json")
    assert verdict.exit_code == 0, verdict.stdout
    training = json.loads(verdict.stdout)["result"]["training"]
    assert training["step"] == 300 and training["resumable"], training
    loaded = Checkpointer(run).load_latest({"model": model, "optimizer": optimizer})
    assert loaded is not None and loaded.step == 300


def test_a_disabled_grad_scaler_in_the_state_saves_and_resumes(tmp_path: Path) -> None:
    """The AMP recipe's `GradScaler(enabled=use_amp)` with AMP off (a CPU run): its state dict
    is empty, the save held nothing under it, and every resume failed with "the checkpoint
    holds no entry 'scaler'"."""
    from ckpt_cli import Checkpointer

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model(torch.randn(2, 4)).sum().backward()
    scaler.step(optimizer)  # what the recipe calls; with AMP off, a plain optimizer step
    scaler.update()
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(1, {"model": model, "optimizer": optimizer, "scaler": scaler, "step": 1})
    fresh = torch.nn.Linear(4, 4)
    into: dict[str, Any] = {
        "model": fresh,
        "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1),
        "scaler": torch.amp.GradScaler("cpu", enabled=False),
        "step": 0,
    }
    loaded = Checkpointer(tmp_path / "run").load_latest(into)
    assert loaded is not None and loaded.step == 1 and into["step"] == 1
    assert torch.equal(fresh.weight, model.weight)
    assert into["scaler"].state_dict() == {}
    # a save made without the scaler is still told from one that saved it empty
    from ckpt_cli.errors import FormatError

    with Checkpointer(tmp_path / "other") as ck:
        ck.save(1, {"model": model, "step": 1})
    with pytest.raises(FormatError, match="no entry 'scaler'"):
        Checkpointer(tmp_path / "other").load_latest(
            {"model": fresh, "scaler": torch.amp.GradScaler("cpu", enabled=False)}
        )


def test_loading_into_a_state_that_does_not_match_the_save_raises_a_ckpt_error_naming_it(
    tmp_path: Path,
) -> None:
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import FormatError

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(tmp_path / "run") as ck:
        ck.save(1, {"model": model, "optimizer": optimizer, "step": 1})
    fresh = torch.nn.Linear(2, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, 1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": torch.nn.Linear(2, 3)}, "Size mismatch"),
        ({"model": fresh, "ema": torch.nn.Linear(2, 2)}, "no entry 'ema' (the model"),
        ({"model": fresh, "optimizer": fresh_optimizer, "sched": scheduler}, "no entry 'sched'"),
    ]
    for into, problem in cases:
        with pytest.raises(FormatError) as raised:
            Checkpointer(tmp_path / "run").load_latest(into)
        assert problem in str(raised.value) and raised.value.fix, str(raised.value)
    # (StepLR set initial_lr in the optimizer's groups: the saved optimizer has none)
    with pytest.raises(FormatError, match="initial_lr"):
        Checkpointer(tmp_path / "run").load_latest({"model": fresh, "optimizer": fresh_optimizer})


def test_an_optimizer_over_two_models_of_the_state_is_told_to_save_them_as_one_entry(
    tmp_path: Path,
) -> None:
    """An encoder and a decoder trained by one optimizer, each its own entry: `save` said the
    optimizer's parameters belong to no model of the state and to pass "the model it
    optimizes in the same mapping", which the user did. It names both models and how to save
    them (one `ModuleDict` entry), which then saves and resumes."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    encoder, decoder = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *decoder.parameters()])
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        with pytest.raises(UsageError) as refused:
            ck.save(1, {"encoder": encoder, "decoder": decoder, "optimizer": optimizer})
        assert "'encoder', 'decoder'" in str(refused.value), refused.value
        assert refused.value.fix is not None and "ModuleDict" in refused.value.fix
        model = torch.nn.ModuleDict({"encoder": encoder, "decoder": decoder})
        ck.save(1, {"model": model, "optimizer": optimizer})
    saved = ck.wait()
    assert saved is not None and saved.phase == "done", saved
    fresh = torch.nn.ModuleDict(
        {"encoder": torch.nn.Linear(4, 4), "decoder": torch.nn.Linear(4, 2)}
    )
    into = {"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters())}
    assert Checkpointer(run).load_latest(into) is not None
    assert torch.equal(fresh["decoder"].weight, decoder.weight)


def test_a_plain_value_that_cannot_be_copied_is_refused_by_save_naming_the_entry(
    tmp_path: Path,
) -> None:
    """A user puts the loop's batch generator into the state: `save` refuses it at once with
    a CkptError naming the entry and the fix (it was a bare `TypeError: cannot pickle
    'generator' object`), and the checkpointer goes on saving the corrected state."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    model = torch.nn.Linear(4, 4)
    batches = (torch.randn(2, 4) for _ in range(10))
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        with pytest.raises(UsageError) as raised:
            ck.save(1, {"model": model, "progress": {"batches": batches, "epoch": 0}})
        message = str(raised.value)
        assert "'progress.batches'" in message and "cannot pickle 'generator' object" in message
        assert raised.value.fix is not None and "state_dict()" in raised.value.fix
        assert ck.status().in_flight is None and ck.status().saves == 0
        ck.save(1, {"model": model, "progress": {"epoch": 0}})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert latest(run) == str(run / "step-1")


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_a_tensor_with_no_dense_data_is_refused_by_save_naming_the_entry(
    tmp_path: Path, kind: str
) -> None:
    """A sparse tensor (an embedding's sparse gradient kept in the state, a sparse mask) or
    one on the meta device (a module never materialised), or a quantized one: `save` raised
    torch's own `RuntimeError: copy_() between dense and sparse Tensors is not implemented!`
    (or the meta copy's, or an internal assert) into the training loop. It now raises `UsageError` naming the entry and what
    to save instead, nothing is written, and the next save goes on."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    model = torch.nn.Linear(4, 4)
    if kind == "sparse":
        odd = torch.eye(4).to_sparse()
    elif kind == "meta":
        odd = torch.empty(4, device="meta")
    else:
        with warnings.catch_warnings():  # torch deprecates its quantized tensors
            warnings.simplefilter("ignore")
            odd = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        with pytest.raises(UsageError) as raised:
            ck.save(1, {"model": model, "extra": {"mask": odd}})
        message = str(raised.value)
        assert "'extra.mask'" in message, message
        assert {"sparse": "sparse", "meta": "meta device", "quantized": "quantized"}[
            kind
        ] in message
        assert raised.value.fix is not None
        assert ck.status().in_flight is None and ck.status().saves == 0
        ck.save(1, {"model": model})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert latest(run) == str(run / "step-1")


def test_a_value_load_latest_could_not_read_is_refused_by_save_itself(tmp_path: Path) -> None:
    """A user follows the library page with torch's plain `DataLoader` as `data` (it has no
    `state_dict`, so it would be pickled whole): `save` refuses it at once, naming the entry
    and what to pass instead, rather than every save of the run failing in the background."""
    import numpy as np

    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    model = torch.nn.Linear(4, 4)
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        with pytest.raises(UsageError) as raised:
            ck.save(1, {"model": model, "data": loader})
        message = str(raised.value)
        assert "'data'" in message and "torch.utils.data.dataloader.DataLoader" in message
        assert raised.value.fix is not None and "StatefulDataLoader" in raised.value.fix
        assert ck.status().in_flight is None and ck.status().saves == 0
        # the plain values a loop saves are admitted: RNG tuples, numpy scalars, sizes, dtypes
        plain = {
            "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "misc": (np.float64(0.5), torch.Size([2, 3]), torch.float16, b"x", None),
            "seen": {3, 1},
            "buffer": np.arange(6, dtype=np.float32).reshape(2, 3),
        }
        ck.save(1, {"model": model, **plain})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    assert latest(run) == str(run / "step-1")
    assert list(run.iterdir()) == [run / "step-1"]


def test_a_save_that_fails_its_check_names_the_unpublished_save_not_its_removed_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save refused by its background check (here a plain `DataLoader` let past `save`'s own
    look): the message names `RUN/step-1` and the entry, not a file of the staging folder
    that the failure removed."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.checkpointer import staging

    monkeypatch.setattr(staging, "refuse_unloadable", lambda path, value: None)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4), "data": loader})
    record = ck.wait()
    assert record is not None and record.phase == "failed" and record.error is not None
    assert record.error.startswith(f"{run / 'step-1'}: the save of step 1 failed its check")
    assert "object entry 'data'" in record.error and ".ckpt-tmp-" not in record.error
    assert list(run.iterdir()) == []


def _save_on_a_full_disk(run: Path) -> tuple[Any, Any]:
    from ckpt_cli import Checkpointer

    with Checkpointer(run) as ck:
        ck.save(1, {"model": torch.nn.Linear(1024, 1024)})  # 4 MiB
    record = ck.wait()
    assert record is not None and record.phase == "failed"
    return record, ck.status()


def test_a_full_disk_is_reported_as_such_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    run = tmp_path / "run"
    record, status = _save_on_a_full_disk(run)
    assert record.error == status.last_error
    assert record.error.startswith("writing step 1 failed: no space left on the device (")
    assert record.error.endswith(f"check free space at {run}") and "\n" not in record.error
    assert not any(p.name.startswith("step-") for p in run.iterdir())


def test_a_file_system_gone_read_only_mid_write_names_the_save_not_its_removed_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run folder's file system turned read-only (an ext4 error remounts it so) while DCP
    wrote a data file: the failure named that file in the staging folder the failure then
    removed (`RUN/.step-1.ckpt-tmp-x8k2/__0_0.distcp: writing step 1 failed: ...`), a path
    that never exists for the user to look at. It names the save and the file in it."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def read_only(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        data = Path(self.path) / "__0_0.distcp"  # what DCP's writer opens first
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(data))

    monkeypatch.setattr(FileSystemWriter, "write_data", read_only)
    run = tmp_path / "run"
    from ckpt_cli import Checkpointer

    with Checkpointer(run) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)})
    record, status = ck.wait(), ck.status()
    assert record is not None and record.phase == "failed" and record.error is not None
    assert record.error == status.last_error
    assert record.error.startswith(
        f"{run / 'step-1'}: writing step 1 (__0_0.distcp) failed: Read-only file system (EROFS)"
    ), record.error
    assert ".ckpt-tmp-" not in record.error and "read-only" in record.error
    assert list(run.iterdir()) == []


def test_a_disk_that_fills_up_with_the_parity_says_so_as_a_full_disk_with_retentions_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensors fit but the parity (`protect=`) did not: the failure was the staging
    folder's generic one (`RUN/step-3: writing step-3 failed: No space left on device
    (ENOSPC); the partial output was removed...`), not the documented full-disk line, and with
    keep_last it never said that retention makes room only once the new save is published."""
    import errno

    import ckpt_cli.ops.parity as parity
    from ckpt_cli import Checkpointer

    protect = parity.protect

    def full_at_step_3(path: str, *args: Any, **kwargs: Any) -> Any:
        if ".step-3." in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{path}/ckpt-parity.json")
        return protect(path, *args, **kwargs)

    monkeypatch.setattr(parity, "protect", full_at_step_3)
    run = tmp_path / "run"
    with Checkpointer(run, keep_last=2, protect=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": torch.nn.Linear(64, 64)})
    record = ck.wait()
    assert record is not None and record.phase == "failed" and record.error is not None
    assert record.error.startswith("writing step 3 failed: no space left on the device ("), (
        record.error
    )
    assert "keep_last=2" in record.error and "room for 3 saves" in record.error
    assert record.error.endswith(f"check free space at {run}") and "\n" not in record.error
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_save_larger_than_the_free_space_says_the_disk_is_full(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs mount here")
    try:
        record, _ = _save_on_a_full_disk(disk / "run")
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    # DCP's own error is a zip writer traceback ("unexpected pos 704 vs 598")
    assert record.error.startswith("writing step 1 failed: no space left on the device (")
    assert "MiB free, the save holds 4.0 MiB" in record.error and "\n" not in record.error


@pytest.mark.parametrize("moment", ["read_metadata", "read_data"])
def test_a_save_removed_by_the_trainers_retention_while_an_evaluator_loads_it_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """An evaluation process loads the newest save while the training's keep_last retention
    removes it (a newer save was published meanwhile): load_latest raised a bare
    FileNotFoundError (removed before `.metadata` was read), or a FormatError saying the save
    "does not fit the state of `into`" with a fix to rebuild the models (removed mid-load)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import IOFailure

    run = tmp_path / "run"
    model = torch.nn.Linear(8, 8)
    with Checkpointer(run) as ck:
        for step in (1, 2):
            ck.save(step, {"model": model})
            assert (record := ck.wait()) is not None and record.phase == "done", record
    read = getattr(FileSystemReader, moment)

    def retention_meanwhile(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        folder = Path(self.path)
        if folder.exists():  # what `ckpt prune` does: a rename out of sight, then the removal
            gone = folder.with_name(".step-2.ckpt-tmp-del-test")
            folder.rename(gone)
            shutil.rmtree(gone)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, moment, retention_meanwhile)
    with pytest.raises(IOFailure) as raised:
        Checkpointer(run).load_latest({"model": torch.nn.Linear(8, 8)})
    assert raised.value.exit_code == 74
    message = str(raised.value)
    assert "step 2 was removed while it was being loaded" in message, message
    assert "does not fit" not in message
    assert "load_latest again" in (raised.value.fix or "")


def _publish_meanwhile(run: Path, stash: Path) -> None:
    """What the training process does while an evaluator loads step-2: it publishes step-3
    (written beforehand into `stash`) and its keep_last=1 retention removes step-2 as `ckpt
    prune` does (a rename out of sight, then the removal)."""
    if not (run / "step-2").exists():
        return
    (stash / "step-3").rename(run / "step-3")
    gone = run / ".step-2.ckpt-tmp-del-test"
    (run / "step-2").rename(gone)
    shutil.rmtree(gone)


@pytest.mark.parametrize("moment", ["read_metadata", "read_data"])
def test_a_save_removed_while_an_evaluator_loads_it_gives_way_to_the_newer_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """The evaluator's load_latest loads step-2 while the training publishes step-3 and its
    retention removes step-2: load_latest raised IOFailure ("step 2 was removed while it was
    being loaded ... call load_latest again") though a newer complete save was there. It now
    chooses again and loads step-3 (an older save in its place is still refused: the test
    above)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from ckpt_cli import Checkpointer

    run, stash = tmp_path / "run", tmp_path / "stash"
    model = torch.nn.Linear(8, 8)
    for folder, steps in ((run, (1, 2)), (stash, (3,))):
        with Checkpointer(folder) as ck:
            for step in steps:
                with torch.no_grad():
                    model.weight.fill_(step)
                ck.save(step, {"model": model})
                assert (record := ck.wait()) is not None and record.phase == "done", record
    read = getattr(FileSystemReader, moment)

    def training_meanwhile(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        _publish_meanwhile(run, stash)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, moment, training_meanwhile)
    evaluated = torch.nn.Linear(8, 8)
    loaded = Checkpointer(run).load_latest({"model": evaluated})
    assert loaded is not None and loaded.step == 3, loaded
    assert torch.equal(evaluated.weight, torch.full_like(evaluated.weight, 3.0))


REMOVED_WHILE_LOADED_ON_TWO_RANKS_SCRIPT = """
import json, shutil, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = Path(sys.argv[1]), sys.argv[2]
stash = run.parent / "stash"
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
model = torch.nn.Linear(8, 8)
for folder, steps in ((run, (1, 2)), (stash, (3,))):
    with Checkpointer(folder) as ck:
        for step in steps:
            with torch.no_grad():
                model.weight.fill_(step)
            ck.save(step, {"model": model, "seen": 10 * rank + step})
dist.barrier()
read = FileSystemReader.read_metadata

def training_meanwhile(self, *args, **kwargs):
    if rank == 0 and (run / "step-2").exists():  # step-3 published, step-2 removed
        (stash / "step-3").rename(run / "step-3")
        gone = run / ".step-2.ckpt-tmp-del-test"
        (run / "step-2").rename(gone)
        shutil.rmtree(gone)
    return read(self, *args, **kwargs)

FileSystemReader.read_metadata = training_meanwhile
into = {"model": torch.nn.Linear(8, 8), "seen": 0}
try:
    loaded = Checkpointer(run).load_latest(into)
    result = {"step": loaded.step, "seen": into["seen"],
              "weight": into["model"].weight.unique().tolist()}
except CkptError as error:
    result = {"raised": type(error).__name__, "text": str(error)}
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_save_removed_while_two_ranks_load_it_gives_way_to_the_newer_save(
    tmp_path: Path,
) -> None:
    """The same under torchrun: every rank raised IOFailure ("step 2 was removed while it was
    being loaded"); every rank now chooses again, alike, and loads step-3."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "removed_while_loaded.py"
    script.write_text(REMOVED_WHILE_LOADED_ON_TWO_RANKS_SCRIPT)
    run_torchrun(script, 2, tmp_path / "run", tmp_path / "out")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert result.get("step") == 3, result
        assert result["seen"] == 10 * rank + 3 and result["weight"] == [3.0], result


def test_a_save_removed_while_an_evaluator_checks_it_gives_way_to_the_newer_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation process's load_latest checks the newest save while the training
    publishes the next one and its keep_last=1 retention removes the one being checked:
    load_latest raised NotFoundError ("step-2: no such file or folder. Check the path.")
    though the run held a newer complete save. It now reads the run folder again and loads
    that one."""
    import ckpt_cli.ops.verify.run as verify_run
    from ckpt_cli import Checkpointer

    run = tmp_path / "run"
    trained = torch.nn.Linear(8, 8)
    with Checkpointer(run, keep_last=1) as trainer:
        for step in (1, 2):
            with torch.no_grad():
                trained.weight.fill_(step)
            trainer.save(step, {"model": trained})
            assert (record := trainer.wait()) is not None and record.phase == "done", record
        verify = verify_run.verify

        def training_meanwhile(path: str, *args: Any, **kwargs: Any) -> Any:
            if Path(path).name == "step-2" and Path(path).exists():
                with torch.no_grad():
                    trained.weight.fill_(3)
                trainer.save(3, {"model": trained})  # published, then step-2 removed
                assert (record := trainer.wait()) is not None and record.phase == "done"
                assert record.pruned == ["step-2"], record
            return verify(path, *args, **kwargs)

        monkeypatch.setattr(verify_run, "verify", training_meanwhile)
        evaluated = torch.nn.Linear(8, 8)
        loaded = Checkpointer(run).load_latest({"model": evaluated})
    assert loaded is not None and loaded.step == 3 and loaded.skipped == [], loaded
    assert torch.equal(evaluated.weight, torch.full_like(evaluated.weight, 3.0))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_with_keep_last_says_retention_needs_room_for_one_more_save(
    tmp_path: Path,
) -> None:
    """A run folder sized for keep_last=2 saves: every save after the second failed with "no
    space left (2.0 MiB free, the save holds 2.0 MiB)", which reads as if it fit, and never
    said why retention did not make room (it removes the oldest save only once the new one
    is published, so that a crash always leaves a complete save)."""
    from ckpt_cli import Checkpointer

    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs mount here")
    try:
        model = torch.nn.Linear(512, 1024)  # 2 MiB
        records = []
        with Checkpointer(disk / "run", keep_last=2) as ck:
            for step in (1, 2, 3):
                ck.save(step, {"model": model})
                records.append(ck.wait())
        names = sorted(p.name for p in (disk / "run").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert [r.phase for r in records if r is not None] == ["done", "done", "failed"]
    error = records[2].error if records[2] is not None else ""
    assert error.startswith("writing step 3 failed: no space left on the device ("), error
    assert "2.0 MiB of tensors" in error, error
    assert "keep_last=2" in error and "room for 3 saves" in error, error
    assert names == ["step-1", "step-2"]  # the failed save left nothing behind


@pytest.mark.slow
def test_an_unreachable_upload_target_says_the_save_is_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli import Checkpointer

    for name in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    run = tmp_path / "run"
    with Checkpointer(run, upload="s3://bucket/exp") as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)})
    record = ck.wait()
    assert record is not None and record.phase == "failed" and record.error is not None
    assert f"step 1 is saved locally ({run / 'step-1'}) but its upload failed: " in record.error
    assert ck.status().last_complete_step == 1 and latest(run) == str(run / "step-1")


QUIET_SCRIPT = """
import logging, sys
import torch
from ckpt_cli import Checkpointer

logging.disable(logging.CRITICAL)  # the logger is the documented channel
model = torch.nn.Linear(2, 2)
with Checkpointer(sys.argv[1]) as ck:
    ck.save(1, {"model": model, "step": 1})
assert Checkpointer(sys.argv[1]).load_latest({"model": model, "step": 0}).step == 1
"""


@pytest.mark.slow
def test_a_single_process_save_and_load_write_nothing_to_stdout_or_stderr(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("", "")


TORCHRUN_EXIT_SCRIPT = """
import sys, threading, time
from pathlib import Path
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer

from tests.dist_helpers import RANK_TIMEOUT

dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
Checkpointer(sys.argv[1]).save(1, {"model": model, "step": 1})  # no close(), no wait()
if dist.get_rank() == 0:  # the data is written; the checksums and the publish are not
    marker = Path(sys.argv[2])
    while not marker.exists():
        time.sleep(0.02)

    def go_on() -> None:  # the save carries on once the script has begun to exit
        time.sleep(0.5)
        marker.unlink()

    threading.Thread(target=go_on, daemon=True).start()
sys.exit(0)  # the script ends with the save in flight on every rank
"""


@pytest.mark.torchrun
def test_two_ranks_that_end_while_their_save_is_in_flight_still_publish_it(
    tmp_path: Path,
) -> None:
    require_torchrun_marker()
    script = tmp_path / "exit.py"
    script.write_text(TORCHRUN_EXIT_SCRIPT)
    marker = tmp_path / "paused"
    command = torchrun_command(2, script, tmp_path / "run", marker)
    env = torchrun_env({"CKPT_TEST_PAUSE_AT": "write@1", "CKPT_TEST_PAUSE_FILE": str(marker)})
    proc = run_launch(command, 300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "save of step 1 failed" not in output, output
    assert latest(tmp_path / "run") == str(tmp_path / "run" / "step-1")
    verdict = run_ckpt("verify", str(tmp_path / "run" / "step-1"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout


def test_a_run_whose_every_save_fails_its_checks_raises_never_a_silent_fresh_start(
    tmp_path: Path,
) -> None:
    """Every save of the run damaged (a bit flipped in each one's weights): `load_latest`
    returned None, which a training script takes for "no save yet", so the run started over
    from step 0 with only a log line, and its retention then deleted the damaged saves that
    `ckpt repair` could have rebuilt."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import FormatError

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        for step in (1, 2):
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
    for step in (1, 2):
        storage = FileSystemReader(str(run / f"step-{step}")).read_metadata().storage_data
        weight = next(info for index, info in storage.items() if index.fqn == "model.weight")
        shard = run / f"step-{step}" / weight.relative_path
        data = bytearray(shard.read_bytes())
        data[weight.offset + weight.length // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    fresh = torch.nn.Linear(16, 8)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    into: dict[str, Any] = {"model": fresh, "step": 0}
    with pytest.raises(FormatError) as raised:
        Checkpointer(run).load_latest(into)
    message = str(raised.value)
    assert "step-1: " in message and "step-2: " in message, message
    assert "ckpt verify" in (raised.value.fix or "")
    assert into["step"] == 0  # nothing was loaded
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    # a run folder with no save at all is still a fresh start
    assert Checkpointer(tmp_path / "new").load_latest({"model": fresh}) is None


def test_a_save_that_lost_a_file_is_named_when_passed_over_and_never_a_silent_fresh_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A published save (no parity) that lost its `.metadata` or a data file is damage (the
    Checkpointer renames a save into place only once whole): `load_latest` passed over it
    without a word, and when it was the run's only save returned None, a fresh start that
    trained over the run."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import FormatError

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
    (run / "step-2" / ".metadata").unlink()
    fresh = torch.nn.Linear(16, 8)
    into: dict[str, Any] = {"model": fresh, "step": 0}
    with caplog.at_level(logging.WARNING, logger="ckpt_cli.checkpointer"):
        loaded = Checkpointer(run).load_latest(into)
    assert loaded is not None and loaded.step == 1 and into["step"] == 1
    assert len(loaded.skipped) == 1 and loaded.skipped[0].startswith("step-2: "), loaded.skipped
    assert ".metadata" in loaded.skipped[0]
    assert "step-2" in caplog.text and "passed over" in caplog.text
    assert torch.equal(fresh.weight, torch.full_like(fresh.weight, 1.0))

    # the run's only save lost a data file: an error naming it, not "no save yet"
    shutil.rmtree(run / "step-2")
    (run / "step-1" / "__0_0.distcp").unlink()
    with pytest.raises(FormatError) as raised:
        Checkpointer(run).load_latest({"model": torch.nn.Linear(16, 8), "step": 0})
    assert "step-1: " in str(raised.value) and "__0_0.distcp" in str(raised.value)


@pytest.mark.slow
def test_a_fresh_node_that_cannot_read_the_bucket_raises_never_starts_from_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node with an empty disk resumes from the bucket; the store did not answer (a network
    blip at start-up): `load_latest` returned None and the job trained from step 0, uploading
    its new saves over the run's."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import HubError

    for name in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    into: dict[str, Any] = {"model": torch.nn.Linear(4, 4), "step": 0}
    with pytest.raises(HubError) as raised:
        Checkpointer(tmp_path / "run", upload="s3://bucket/exp").load_latest(into)
    assert "s3://bucket/exp" in str(raised.value) and "Run again" in (raised.value.fix or "")
    assert into["step"] == 0


def test_a_wait_from_another_thread_never_hides_the_save_started_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A monitoring thread calls `wait()` while the loop saves again: its wait for save 1
    ended after the loop had started save 2, and then forgot "the save in flight", which was
    save 2 by then. `close()` returned with save 2 still writing (the staging buffer released
    under it), and the next save did not see it in flight."""
    import threading

    from ckpt_cli import Checkpointer
    from ckpt_cli.checkpointer import engine

    started: list[threading.Thread] = []
    first_joined = threading.Event()
    second_started = threading.Event()
    plain_thread = threading.Thread

    class Thread(plain_thread):
        """The Checkpointer's save threads, each known to the test."""

        def start(self) -> None:
            if not self.name.startswith("ckpt-save"):
                super().start()  # a pool's worker (hashing): not the test's business
                return
            started.append(self)
            super().start()
            if len(started) == 2:
                second_started.set()

        def run(self) -> None:
            if len(started) == 2 and self is started[1]:
                time.sleep(0.5)  # save 2 is still writing when close() is called
            super().run()

        def join(self, timeout: float | None = None) -> None:
            super().join(timeout)
            if self is started[0] and threading.current_thread().name == "monitor":
                first_joined.set()
                second_started.wait(10)  # the loop starts save 2 before this wait returns

    monkeypatch.setattr(engine.threading, "Thread", Thread)
    model = torch.nn.Linear(4, 4)
    ck = Checkpointer(tmp_path / "run")
    ck.save(1, {"model": model, "step": 1})
    monitor = plain_thread(target=ck.wait, name="monitor")
    monitor.start()
    assert first_joined.wait(10)
    ck.save(2, {"model": model, "step": 2})
    monitor.join(10)
    ck.close()
    assert not started[1].is_alive()  # close waited for save 2
    assert (tmp_path / "run" / "step-2" / ".metadata").is_file()


STALLED_RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from ckpt_cli import Checkpointer, CkptError
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
rank0_done = Path(f"{out}.rank0.json")
stall = [False]
write_data = FileSystemWriter.write_data


def hung_disk(self, plan, planner):  # rank 1's disk hangs in step 2's write until rank 0 is done
    deadline = time.monotonic() + 600
    while rank == 1 and stall[0] and not rank0_done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return write_data(self, plan, planner)


FileSystemWriter.write_data = hung_disk
model = torch.nn.Linear(4, 4)
got = {}
ck = Checkpointer(run, timeout=3)
ck.save(1, {"model": model})
got["first"] = ck.wait().model_dump(mode="json")
stall[0] = True
ck.save(2, {"model": model})
got["stalled"] = ck.wait().model_dump(mode="json")
started = time.monotonic()
try:
    ck.save(3, {"model": model})
    got["next"] = ck.wait().model_dump(mode="json")
except CkptError as error:
    got["next"] = {"raised": type(error).__name__, "message": str(error)}
got["next_seconds"] = time.monotonic() - started
Path(f"{out}.rank{rank}.part").write_text(json.dumps(got))
os.rename(f"{out}.rank{rank}.part", f"{out}.rank{rank}.json")
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_rank_that_stalls_mid_save_fails_the_save_on_the_other_rank_within_the_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1's disk hangs while it writes its part of step 2. Rank 0 waited in DCP's gather
    for torch's default 30 minutes (the Checkpointer's own gloo groups ignored every timeout
    the script gave): here the launch hung past its limit. Now rank 0's save fails after the
    Checkpointer's `timeout`, naming rank 1 and the save, nothing of step 2 is published
    (step 1 stays the latest), and the next save raises at once on both ranks: their groups
    are out of step, so the job must restart."""
    import json

    require_torchrun_marker()
    script = tmp_path / "stalled_rank.py"
    script.write_text(STALLED_RANK_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    proc = run_launch(torchrun_command(2, script, run, out), 150, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert got[rank]["first"]["phase"] == "done", got[rank]
        assert got[rank]["stalled"]["phase"] == "failed", got[rank]
        assert str(run / "step-2") in got[rank]["stalled"]["error"], got[rank]
        assert got[rank]["next"]["raised"] == "IOFailure", got[rank]
        assert "restart" in got[rank]["next"]["message"], got[rank]
        # no further wait for the lost rank (a generous bound: a loaded CI machine is slow)
        assert got[rank]["next_seconds"] < 60, got[rank]
    error = got[0]["stalled"]["error"]
    assert "rank 1 did not answer within 3 s" in error, error
    assert "nothing of it was published" in error, error
    assert "rank 0" in got[1]["stalled"]["error"], got[1]
    assert sorted(p.name for p in run.iterdir()) == ["step-1"]
    assert latest(run) == str(run / "step-1")


def test_a_save_with_a_train_state_entry_and_no_optimizer_is_the_checkpointers_not_torchtitans(
    tmp_path: Path,
) -> None:
    """A loop that saves its model and a `train_state` dict (no optimizer: a frozen backbone's
    adapter trained with SGD outside, an EMA copy...) had every save refused: the check before
    the publish took `step-N` with a `train_state` entry for a torchtitan save lacking its
    optimizer state, so nothing was ever published. A model-only save got `ckpt latest`'s
    warning that it is torchtitan's `last_save_model_only` export. A save holding the
    Checkpointer's own record is judged as the Checkpointer's."""
    from ckpt_cli import Checkpointer

    model = torch.nn.Linear(4, 4)
    with_state, model_only = tmp_path / "with-state", tmp_path / "model-only"
    with Checkpointer(with_state) as ck:
        for step in (1, 2):
            ck.save(step, {"model": model, "train_state": {"step": step, "tokens": 100 * step}})
            record = ck.wait()
            assert record is not None and record.phase == "done", record
    with Checkpointer(model_only) as ck:
        ck.save(1, {"model": model})
        ck.save(2, {"model": model})
    for run in (with_state, model_only):
        result = run_ckpt("latest", str(run))
        assert result.exit_code == 0, result.stdout + result.stderr
        assert result.stdout.strip() == str(run / "step-2")
        assert "torchtitan" not in result.stderr, result.stderr
        verdict = run_ckpt("verify", str(run / "step-2"), "--checksums")
        assert verdict.exit_code == 0, verdict.stdout + verdict.stderr
    state: dict[str, Any] = {"model": torch.nn.Linear(4, 4), "train_state": {}}
    loaded = Checkpointer(with_state).load_latest(state)
    assert loaded is not None and loaded.step == 2
    assert state["train_state"] == {"step": 2, "tokens": 200}
    assert torch.equal(state["model"].weight, model.weight)


SLOW_SEAL_SCRIPT = """
import json, os, sys, time
import torch
import torch.distributed as dist
import ckpt_cli.storage.hashing as hashing
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()


class SlowFile:  # rank 0's disk reads slowly: its checksum pass takes longer than the timeout
    def __init__(self, f):
        self.f = f

    def readinto(self, b):
        time.sleep(0.25)
        return self.f.readinto(b)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class SlowOs:
    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, *args, **kwargs):
        return SlowFile(os.fdopen(*args, **kwargs))


if rank == 0:
    hashing.os, hashing.BLOCK = SlowOs(), 4096
torch.manual_seed(0)  # the same model on both ranks (DCP saves one copy of what they share)
model = torch.nn.Linear(128, 128)
ck = Checkpointer(run, timeout=2)
started = time.monotonic()
ck.save(1, {"model": model})
got = {"save": ck.wait().model_dump(mode="json"), "seconds": time.monotonic() - started}
started = time.monotonic()
fresh = torch.nn.Linear(128, 128)
loaded = Checkpointer(run, timeout=2).load_latest({"model": fresh})  # rank 0 verifies it first
got["loaded"] = loaded.step if loaded else None
got["load_seconds"] = time.monotonic() - started
got["same"] = torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_the_other_ranks_wait_out_a_checksum_pass_longer_than_the_timeout(tmp_path: Path) -> None:
    """Rank 0 alone hashes the whole save (and writes parity) while the other ranks wait for
    its outcome, and in `load_latest` verifies the save it chose while they wait for the
    choice: with the timeout bounding every wait, a pass longer than it failed their save (and
    their load) though rank 0 was working. Rank 0 now tells them it is alive while it hashes,
    so the timeout bounds only how long a rank may stop answering."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "slow_seal.py"
    script.write_text(SLOW_SEAL_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    run_torchrun(script, 2, run, out)
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert got["save"]["phase"] == "done", got
        assert got["save"]["path"] == str(run / "step-1"), got
        assert got["seconds"] > 2, got  # the pass did outlast the timeout
        assert got["loaded"] == 1 and got["same"], got
        assert got["load_seconds"] > 2, got
    verdict = run_ckpt("verify", str(run / "step-1"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout


def test_the_timeout_is_seconds_or_a_timedelta_and_positive(tmp_path: Path) -> None:
    from datetime import timedelta

    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    for wrong in (0, -5, True, "600", timedelta(0)):
        with pytest.raises(UsageError, match="timeout must be"):
            Checkpointer(tmp_path / "run", timeout=wrong)  # type: ignore[arg-type]
    assert Checkpointer(tmp_path / "run", timeout=90).timeout == timedelta(seconds=90)
    assert Checkpointer(tmp_path / "run", timeout=timedelta(minutes=2)).timeout.seconds == 120


PREEMPTION_SCRIPT = """
import signal, sys, time
import torch
from ckpt_cli import Checkpointer

model = torch.nn.Linear(64, 64)
ck = Checkpointer(sys.argv[1])
step = 0


def on_term(signum, frame):  # preemption: save where the loop is, then leave
    ck.save(step, {"model": model, "step": step})
    ck.wait()
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
for step in range(1, 1000):
    with torch.no_grad():
        model.weight.fill_(step)
    if step % 2 == 0:
        ck.save(step, {"model": model, "step": step})  # step 4's waits for step 2's
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_sigterm_handler_that_saves_while_save_waits_for_the_previous_one_saves_and_exits(
    tmp_path: Path,
) -> None:
    """The preemption pattern: a SIGTERM handler saves and exits. The signal came while the
    loop's `save` of step 4 waited for step 2's write: the handler's `save` waited for the lock
    the interrupted `save` of the same thread held, and the process hung until SIGKILL (step 4
    lost). Now the handler's save runs (the interrupted one had only been waiting), is
    published, and the script exits with the handler's code."""
    run, marker = tmp_path / "run", tmp_path / "paused"
    env = torchrun_env({"CKPT_TEST_PAUSE_AT": "write@2", "CKPT_TEST_PAUSE_FILE": str(marker)})
    proc = subprocess.Popen(
        [sys.executable, "-c", PREEMPTION_SCRIPT, str(run)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + REACH_PAUSE
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        # step 4's save is waiting for step 2's once the loop is past step 4
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        marker.unlink()  # step 2's write goes on
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert latest(run) == str(run / "step-4")
    weight = dcp_model(run / "step-4", {"weight": torch.zeros(64, 64), "bias": torch.zeros(64)})
    assert torch.equal(weight["weight"], torch.full((64, 64), 4.0))


SLOW_AFTER_PUBLISH_SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
retain = Checkpointer._retain


def slow_retention(self, record):  # rank 0's work after the publish (retention, the upload)
    time.sleep(5)
    retain(self, record)


if rank == 0:
    Checkpointer._retain = slow_retention
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
ck = Checkpointer(run, timeout=2)
got = {}
ck.save(1, {"model": model})
got["second"] = ck.save(2, {"model": model}).phase  # waits for step 1 on rank 0
got["load"] = ck.load_latest({"model": torch.nn.Linear(8, 8)}).step  # waits for step 2
got["saves"] = [ck.status().last.phase, ck.status().failures]
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.barrier()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_rank_waits_out_rank_0s_work_after_a_publish_longer_than_the_timeout(
    tmp_path: Path,
) -> None:
    """After the publish rank 0 alone prunes and uploads, and the next `save` (or
    `load_latest`) waits for that on every rank: the other ranks, done at once, waited for rank
    0 in a collective, so an upload longer than the timeout failed them though rank 0 was
    working. The ranks now wait each for its own save and agree every quarter of the timeout
    whether any is still busy."""
    import json

    from .dist_helpers import run_torchrun

    script = tmp_path / "slow_after_publish.py"
    script.write_text(SLOW_AFTER_PUBLISH_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    run_torchrun(script, 2, run, out)
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert got == {"second": "staged", "load": 2, "saves": ["done", 0]}, got


def test_a_signal_handlers_save_during_the_copy_of_another_save_is_refused_never_mixed(
    tmp_path: Path,
) -> None:
    """The signal comes while the loop's `save` copies the state into the staging buffer (here
    the data loader's `state_dict()` is where it lands): the handler's `save` would overwrite
    that copy. It raises `UsageError` naming the step instead (before, the process hung), the
    loop's save raises it in turn, and the save before stays the latest, whole."""
    from ckpt_cli import Checkpointer
    from ckpt_cli.errors import UsageError

    run = tmp_path / "run"
    model = torch.nn.Linear(4, 4)
    ck = Checkpointer(run)
    ck.save(1, {"model": model})
    ck.wait()

    class Loader:
        def state_dict(self) -> dict[str, int]:
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered before this returns
            time.sleep(0.1)
            return {"position": 2}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    def on_signal(signum: int, frame: Any) -> None:
        ck.save(2, {"model": model})

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(UsageError, match="save of step 2 was called while this thread"):
            ck.save(2, {"model": model, "data": Loader()})
    finally:
        signal.signal(signal.SIGUSR1, previous)
    ck.close()
    assert latest(run) == str(run / "step-1")
    assert sorted(p.name for p in run.iterdir()) == ["step-1"]


SLOW_PULL_SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist
import ckpt_cli.ops.sync.pull as pull
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out, bucket = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
pull.UPLOAD_BLOCK = 8192  # many ranged reads, each a round trip to the far-away store
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
fresh = torch.nn.Linear(256, 256)
started = time.monotonic()
got = {}
try:
    loaded = Checkpointer(run, upload=bucket, timeout=2).load_latest({"model": fresh})
    got["loaded"] = [loaded.step, loaded.tier] if loaded else None
except Exception as error:
    got["raised"] = f"{type(error).__name__}: {error}"
got["seconds"] = time.monotonic() - started
got["same"] = torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(got, f)
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_the_other_ranks_wait_out_a_pull_from_the_bucket_longer_than_the_timeout(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A fresh node resumes from the bucket under torchrun: rank 0 pulls the save while the
    other ranks wait for its choice. The pull sent them no sign of life, so one longer than
    the timeout (a far-away store) failed their `load_latest` ("did not answer within 2 s")
    though rank 0 was downloading, and the job could not resume at all. Rank 0 now tells them
    it is alive as the bytes arrive, as it does while it verifies: both ranks load the save."""
    import json

    from ckpt_cli import Checkpointer

    from .dist_helpers import run_launch

    require_torchrun_marker()
    make_bucket(s3_server.endpoint, "ckpt")
    torch.manual_seed(0)
    with Checkpointer(tmp_path / "first-node", upload="s3://ckpt/exp") as ck:
        ck.save(5, {"model": torch.nn.Linear(256, 256)})
        assert (record := ck.wait()) is not None and record.phase == "done", record
    s3_server.latency = 0.05  # every request: a far-away store
    script = tmp_path / "slow_pull.py"
    script.write_text(SLOW_PULL_SCRIPT)
    run, out = tmp_path / "fresh-node", tmp_path / "out"
    command = torchrun_command(2, script, run, out, "s3://ckpt/exp")
    proc = run_launch(command, 300, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert got.get("loaded") == [5, "remote"] and got["same"], (rank, got, proc.stderr)
        assert got["seconds"] > 2, got  # the pull did outlast the timeout
    assert latest(run) == str(run / "step-5")


SIGNAL_MID_SAVE_SCRIPT = """
import json, os, signal, sys
import torch
import torch.distributed as dist
from ckpt_cli import Checkpointer
from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown

run, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
ck = Checkpointer(run, timeout=3)
ck.save(1, {"model": model})
ck.wait()
step = 2


def on_term(signum, frame):  # preemption: save where the loop is, then leave
    got = {}
    try:
        record = ck.save(step, {"model": model})
        got = (ck.wait() or record).model_dump(mode="json")
    except Exception as error:
        got = {"raised": f"{type(error).__name__}: {error}"}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(got, f)
    leave_without_teardown()


signal.signal(signal.SIGTERM, on_term)
armed = [False]


def signalled_after(collective):  # rank 1's SIGTERM lands as its first agreement returns
    def call(*args, **kwargs):
        result = collective(*args, **kwargs)
        if armed[0]:
            armed[0] = False
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    return call


dist.all_reduce = signalled_after(dist.all_reduce)
dist.all_gather = signalled_after(dist.all_gather)
if rank == 0:
    os.kill(os.getpid(), signal.SIGTERM)  # rank 0's lands before the loop's save of step 2
armed[0] = True
ck.save(step, {"model": model})
ck.wait()
leave_without_teardown()
"""


@pytest.mark.torchrun
def test_a_sigterm_on_each_rank_at_another_point_of_the_save_never_leaves_them_out_of_step(
    tmp_path: Path,
) -> None:
    """Preemption under torchrun: each rank's SIGTERM handler saves and leaves, and the signal
    reaches each rank at its own moment: rank 0's before the loop's `save` of step 2, rank 1's
    inside it, just after its first agreement with the other ranks. Rank 0's handler-save
    took rank 1's agreement for its own and went on to the next, while rank 1's handler-save
    began again from the first: two different collectives met (gloo's failure, or a wait until
    the timeout), and the ranks were out of step. Now the ranks see that their saves met at
    different points, and every rank gives that save up at once with the same clear message
    (nothing published: step 1 stays the latest)."""
    import json

    require_torchrun_marker()
    script = tmp_path / "signal_mid_save.py"
    script.write_text(SIGNAL_MID_SAVE_SCRIPT)
    run, out = tmp_path / "run", tmp_path / "out"
    proc = run_launch(torchrun_command(2, script, run, out), 150, env=torchrun_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert got[rank].get("phase") == "failed", (rank, got, proc.stderr)
        error = got[rank]["error"]
        assert "out of step" in error and "signal handler" in error, error
        assert "no rank saved step 2" in error, error
    assert got[0]["error"] == got[1]["error"]
    assert sorted(p.name for p in run.iterdir()) == ["step-1"]
    assert latest(run) == str(run / "step-1")


@pytest.mark.slow
def test_a_damaged_newest_local_save_is_pulled_whole_from_the_bucket_not_passed_over(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A bit flips in the newest save on the local disk, whose upload to the bucket is whole.
    `load_latest` passed the local copy over for the older local save (step 3), a warning in
    the log: the run silently went back three steps, though the bucket held step 6 intact
    (pulled only when newer than every local save). The damaged copy is now replaced by the
    bucket's, checked, and loaded."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckpt_cli import Checkpointer

    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    model = torch.nn.Linear(16, 8)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(run, upload="s3://ckpt/exp") as ck:
        for step in (3, 6):
            with torch.no_grad():
                model.weight.fill_(float(step))
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    storage = FileSystemReader(str(run / "step-6")).read_metadata().storage_data
    weight = next(info for index, info in storage.items() if index.fqn == "model.weight")
    shard = run / "step-6" / weight.relative_path
    data = bytearray(shard.read_bytes())
    data[weight.offset + weight.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    fresh = torch.nn.Linear(16, 8)
    into: dict[str, Any] = {"model": fresh, "step": 0}
    loaded = Checkpointer(run, upload="s3://ckpt/exp").load_latest(into)
    assert loaded is not None and (loaded.step, loaded.tier) == (6, "remote"), loaded
    assert into["step"] == 6
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[6][name]), name
    assert len(loaded.skipped) == 1 and loaded.skipped[0].startswith("step-6: "), loaded
    verdict = run_ckpt("verify", str(run / "step-6"), "--checksums")
    assert verdict.exit_code == 0, verdict.stdout + verdict.stderr


@pytest.mark.slow
def test_when_every_local_save_fails_its_check_an_older_save_in_the_bucket_is_loaded(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The disk holds only the newest save (step 6), and a bit flipped in it; the bucket holds
    step 3 whole, and step 6 without its commit marker (its upload was cut short).
    `load_latest` raised "no save of the run can be loaded" (the store was looked at only for a
    save newer than every local one), so the job could not resume at all. The store's older
    saves are now tried before giving up: step 3 is pulled, checked and loaded."""
    import boto3
    from torch.distributed.checkpoint import FileSystemReader

    from ckpt_cli import Checkpointer

    make_bucket(s3_server.endpoint, "ckpt")
    run = tmp_path / "run"
    model = torch.nn.Linear(16, 8)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(run, upload="s3://ckpt/exp") as ck:
        for step in (3, 6):
            with torch.no_grad():
                model.weight.fill_(float(step))
            ck.save(step, {"model": model, "step": step})
            assert (record := ck.wait()) is not None and record.phase == "done", record
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    import shutil

    shutil.rmtree(run / "step-3")  # the local disk keeps the newest save only
    boto3.client("s3", endpoint_url=s3_server.endpoint).delete_object(
        Bucket="ckpt", Key="exp/step-6/.metadata"
    )
    storage = FileSystemReader(str(run / "step-6")).read_metadata().storage_data
    weight = next(info for index, info in storage.items() if index.fqn == "model.weight")
    shard = run / "step-6" / weight.relative_path
    data = bytearray(shard.read_bytes())
    data[weight.offset + weight.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    fresh = torch.nn.Linear(16, 8)
    into: dict[str, Any] = {"model": fresh, "step": 0}
    loaded = Checkpointer(run, upload="s3://ckpt/exp").load_latest(into)
    assert loaded is not None and (loaded.step, loaded.tier) == (3, "remote"), loaded
    assert into["step"] == 3
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[3][name]), name
    assert [entry.split(":")[0] for entry in loaded.skipped] == ["step-6"], loaded
