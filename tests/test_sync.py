"""`ckpt sync`: a run's complete checkpoints to moto's S3 server and back, verified.

The preemptible-training story: a job saves into out/, `ckpt sync` copies each complete
save to the bucket (never one being written), a killed sync resumes without re-sending
finished files, and a fresh machine pulls the newest complete save and resumes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpt_cli.ops.sync import RateLimit, sync
from ckpt_cli.storage.object_leases import is_lease

from .conftest import REPO, run_ckpt
from .hub_server import TestHub
from .run_fixtures import age, interrupted_trainer_save, trainer_checkpoint, trainer_run
from .s3_fixtures import (
    S3Request,
    S3Server,
    fetch_object,
    list_keys,
    make_bucket,
    upload_folder,
)

BUCKET = "ckpts"


def local_files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def remote_checkpoints(endpoint: str, prefix: str = "run") -> set[str]:
    return {k.split("/")[1] for k in list_keys(endpoint, BUCKET, prefix + "/") if k.count("/") > 1}


def probe(server: S3Server) -> int:
    """Bytes of the PUTs with which a sync asks the store whether it checks checksums, and of
    its lease (what says, while it uploads, that it is alive)."""
    return sum(
        r.length
        for r in server.requests
        if r.method == "PUT"
        and (r.path.endswith("/.ckpt-checksum-probe") or "/.ckpt-lease-" in r.path)
    )


def fresh_save(out: Path, step: int) -> Path:
    """A Trainer save still being written: weights and optimizer, no trainer_state.json yet."""
    folder = out / f"checkpoint-{step}"
    trainer_checkpoint(folder, step)
    (folder / "trainer_state.json").unlink()
    return folder


@pytest.mark.slow
def test_sync_uploads_complete_saves_only_verified_and_once(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    interrupted_trainer_save(out, 400)
    fresh_save(out, 500)
    result = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    actions = {c["name"]: c["action"] for c in report["checkpoints"]}
    assert actions == {
        "checkpoint-100": "uploaded",
        "checkpoint-200": "uploaded",
        "checkpoint-300": "uploaded",
        "checkpoint-400": "skipped",  # interrupted
        "checkpoint-500": "skipped",  # still being written
    }
    assert remote_checkpoints(s3_server.endpoint) == {
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    }
    assert report["latest"] == f"s3://{BUCKET}/run/checkpoint-300"
    # the manifest went last, and `ckpt verify` on the remote copy checks against it
    puts = [r.path for r in s3_server.requests if r.method == "PUT"]
    ours = [p for p in puts if "/checkpoint-300/" in p]
    assert ours[-1].endswith("/checkpoint-300/ckpt-manifest.json")
    assert ours[-2].endswith(("trainer_state.json", "index.json"))
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-300", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout
    assert checked.json["result"]["files"] == len(local_files(out / "checkpoint-300"))
    # a second sync sends nothing
    s3_server.requests.clear()
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json").json["result"]
    assert again["bytes_sent"] == 0 and again["transferred"] == []
    assert s3_server.bytes_uploaded() == 0
    # the save in progress finishes: the next sync takes it
    trainer_checkpoint(tmp_path / "done", 500)
    shutil.copy(tmp_path / "done" / "trainer_state.json", out / "checkpoint-500")
    third = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json").json["result"]
    assert third["transferred"] == ["checkpoint-500"]
    human = run_ckpt("sync", out, f"s3://{BUCKET}/run/")
    assert "uploaded 0 checkpoints" in human.stdout and "present" in human.stdout


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_a_protected_save_with_its_checksum_manifest_syncs_with_its_parity(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The library page's Checkpointer (`protect=1`, `upload=`), or a user who ran
    `ckpt verify --write-manifest` then `ckpt protect` on a save: the upload checked the
    `.ckpt-parity/` files against `ckpt-manifest.json`, which never lists them (the parity
    has its own index), and refused every such save ("parity-0.bin does not match the
    checkpoint's checksum manifest"). The parity travels and is checked by its own index."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    save = out / "checkpoint-100"
    assert run_ckpt("verify", save, "--write-manifest").exit_code == 0
    assert run_ckpt("protect", save, "--parity", "1").exit_code == 0
    result = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert [c["action"] for c in result.json["result"]["checkpoints"]] == ["uploaded"]
    remote = f"s3://{BUCKET}/run/checkpoint-100"
    keys = set(list_keys(s3_server.endpoint, BUCKET, "run/checkpoint-100/"))
    assert "run/checkpoint-100/.ckpt-parity/parity.index.json" in keys
    checked = run_ckpt("verify", remote, "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout
    assert checked.json["result"]["checks"] == ["structure", "checksums", "parity"]
    # and back, on a node with an empty disk: the pull takes the parity too, and checks it
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    assert local_files(back / "checkpoint-100") == local_files(save)
    again = run_ckpt("verify", back / "checkpoint-100", "--checksums", "--json")
    assert again.exit_code == 0 and again.json["result"]["checks"][-1] == "parity"


@pytest.mark.slow
def test_a_killed_upload_resumes_without_resending_finished_files(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    target = "/checkpoint-200/optimizer.pt"
    s3_server.hold = lambda r: r.method == "PUT" and r.path.endswith(target)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "sync", str(out), f"s3://{BUCKET}/run/"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    # the saves' data go up side by side, each save published (its manifest) once its own
    # data is there: killed while checkpoint-200's optimizer is on its way (held by the server
    # until the test releases it), once 100 is published (its manifest stored, not just sent)
    while not (
        any(r.path.endswith(target) for r in s3_server.requests)
        and "run/checkpoint-100/ckpt-manifest.json" in list_keys(s3_server.endpoint, BUCKET)
    ):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # preempted mid-upload: no cleanup of any kind
    proc.wait(timeout=30)
    s3_server.hold = None
    s3_server.release.set()
    # the server may still store the request it was holding when the client died; what is
    # in the bucket once it has answered everything is what the next sync can reuse
    s3_server.wait_idle()
    keys = set(list_keys(s3_server.endpoint, BUCKET, "run/"))
    assert "run/checkpoint-200/ckpt-manifest.json" not in keys  # not synced: no manifest
    assert any(k.startswith("run/checkpoint-200/") for k in keys)  # but some files are there
    missing = sum(
        p.stat().st_size
        for p in out.rglob("*")
        if p.is_file() and f"run/{p.relative_to(out).as_posix()}" not in keys
    )
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    # meanwhile the remote side says the half-uploaded save is not complete
    half = run_ckpt("latest", f"s3://{BUCKET}/run", "--settle", "0").stdout.strip()
    assert half == f"s3://{BUCKET}/run/checkpoint-100"
    s3_server.requests.clear()
    resumed = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert resumed.exit_code == 0, resumed.stdout
    report = resumed.json["result"]
    by_name = {c["name"]: c for c in report["checkpoints"]}
    assert by_name["checkpoint-100"]["action"] == "present"
    assert by_name["checkpoint-200"]["files_reused"] > 0
    # bytes sent the second time are exactly what was missing (files) plus two manifests
    assert report["bytes_sent"] == missing < total
    manifests = [r for r in s3_server.requests if r.method == "PUT" and "manifest" in r.path]
    assert len(manifests) == 2
    assert (
        s3_server.bytes_uploaded() - sum(r.length for r in manifests) - probe(s3_server) == missing
    )
    pulled = tmp_path / "pulled"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", pulled).exit_code == 0
    for step in (100, 200, 300):
        name = f"checkpoint-{step}"
        assert local_files(pulled / name) == {
            **local_files(out / name),
            "ckpt-manifest.json": (pulled / name / "ckpt-manifest.json").read_bytes(),
        }


@pytest.mark.slow
def test_pull_latest_is_verified_and_a_damaged_remote_copy_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    fresh = tmp_path / "fresh-machine" / "out"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    assert pulled.json["result"]["latest"] == str(fresh / "checkpoint-200")
    assert [c["name"] for c in pulled.json["result"]["checkpoints"]] == ["checkpoint-200"]
    assert pulled.json["result"]["checkpoints"][0]["verified"] is True
    assert run_ckpt("latest", fresh).stdout.strip() == str(fresh / "checkpoint-200")
    original = local_files(out / "checkpoint-200")
    assert {k: v for k, v in local_files(fresh / "checkpoint-200").items() if k in original} == (
        original
    )
    # a flipped byte in the bucket: the pull fails and publishes nothing
    key = "run/checkpoint-200/model.safetensors"
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    other = tmp_path / "other"
    bad = run_ckpt("sync", f"s3://{BUCKET}/run/", other, "--latest", "--json")
    assert bad.exit_code == 1
    assert "does not match the checkpoint's checksum manifest" in bad.stdout
    assert not (other / "checkpoint-200").exists()
    assert [p.name for p in other.iterdir()] == []  # no staging folder left either


@pytest.mark.slow
def test_a_pull_names_the_remote_saves_it_does_not_fetch(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A push cut short leaves checkpoint-300's files in the bucket without their manifest. A
    pull fetched 100 and 200 and said nothing of 300; it is now listed as skipped, with why,
    and with `--latest` only what is newer than the save fetched is named."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    manifest = "run/checkpoint-300/ckpt-manifest.json"
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    boto3.client("s3", endpoint_url=s3_server.endpoint).delete_object(Bucket=BUCKET, Key=manifest)
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    rows = {c["name"]: c for c in pulled.json["result"]["checkpoints"]}
    assert [c["name"] for c in pulled.json["result"]["checkpoints"]] == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    ]
    assert rows["checkpoint-300"]["action"] == "skipped"
    assert "no ckpt-manifest.json yet" in rows["checkpoint-300"]["reason"]
    assert not (back / "checkpoint-300").exists()
    shown = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "human")
    assert "skipped" in shown.stdout and "checkpoint-300" in shown.stdout

    newest = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "one", "--latest", "--json")
    names = {c["name"]: c["action"] for c in newest.json["result"]["checkpoints"]}
    assert names == {"checkpoint-200": "downloaded", "checkpoint-300": "skipped"}


@pytest.mark.slow
def test_prune_remote_applies_retention_on_the_bucket(s3_server: S3Server, tmp_path: Path) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path)  # 100..500; the Trainer's best is 200
    result = run_ckpt(
        "sync", out, f"s3://{BUCKET}/run/", "--prune-remote", "--keep-last", "2", "--yes", "--json"
    )
    assert result.exit_code == 0, result.stdout
    assert sorted(result.json["result"]["pruned"]["deleted"]) == [
        "checkpoint-100",
        "checkpoint-300",
    ]
    assert remote_checkpoints(s3_server.endpoint) == {
        "checkpoint-200",
        "checkpoint-400",
        "checkpoint-500",
    }
    assert sorted(p.name for p in out.iterdir()) == [
        f"checkpoint-{s}" for s in range(100, 501, 100)
    ]
    needs = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--keep-last", "2")
    assert needs.exit_code == 2 and "--prune-remote" in needs.stderr


@pytest.mark.slow
def test_prune_remote_keeps_the_max_with_higher_is_better_and_mode_max_still_works(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`sync --mode min|max` meant what `download --mode` does not: the flag pair says it; the
    old spelling still works, hidden, with one deprecation line on stderr."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path)  # eval_loss 0.90 (100, the max), 0.40 (200, the min) ...
    policy = ["--prune-remote", "--yes", "--keep-best", "eval_loss", "--keep-last", "1", "--json"]
    higher = run_ckpt("sync", out, f"s3://{BUCKET}/high/", *policy, "--higher-is-better")
    assert higher.exit_code == 0, higher.stdout
    assert "is deprecated" not in higher.stderr
    # 100: the max; 200: the Trainer's best_model_checkpoint; 500: the newest
    high = {"checkpoint-100", "checkpoint-200", "checkpoint-500"}
    assert remote_checkpoints(s3_server.endpoint, "high") == high
    lower = run_ckpt("sync", out, f"s3://{BUCKET}/low/", *policy, "--lower-is-better")
    assert lower.exit_code == 0, lower.stdout
    assert remote_checkpoints(s3_server.endpoint, "low") == {"checkpoint-200", "checkpoint-500"}
    old = run_ckpt("sync", out, f"s3://{BUCKET}/old/", *policy, "--mode", "max")
    assert old.exit_code == 0, old.stdout
    assert remote_checkpoints(s3_server.endpoint, "old") == high
    assert "is deprecated" not in old.stdout and old.json["ok"]
    [line] = [x for x in old.stderr.splitlines() if "is deprecated" in x]
    assert "--mode" in line and "--higher-is-better" in line
    both = run_ckpt(
        "sync", out, f"s3://{BUCKET}/both/", *policy, "--mode", "max", "--lower-is-better"
    )
    assert both.exit_code == 2, both.stdout
    assert "--mode max" in both.json["error"]["message"]
    assert "--lower-is-better" in both.json["error"]["message"]
    assert remote_checkpoints(s3_server.endpoint, "both") == set()


def test_watch_uploads_each_new_save_within_one_interval(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    steps = iter((200, 300))
    seen: list[list[str]] = []

    def training_goes_on(_seconds: float) -> None:
        step = next(steps)
        trainer_checkpoint(out / f"checkpoint-{step}", step)

    report = sync(
        str(out),
        f"s3://{BUCKET}/run/",
        watch_seconds=60,
        max_iterations=3,
        on_round=lambda r: seen.append(r.transferred),
        sleep=training_goes_on,
    )
    assert seen == [["checkpoint-100"], ["checkpoint-200"], ["checkpoint-300"]]
    assert report.stopped == "max-iterations" and report.iterations == 3
    assert report.latest == f"s3://{BUCKET}/run/checkpoint-300"


def test_max_rate_paces_the_bytes() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limit = RateLimit(1000, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        limit.take(500)
    assert sum(slept) == pytest.approx(2.5)  # 2500 bytes at 1000 B/s
    RateLimit(None, clock=lambda: now[0], sleep=sleep).take(10**9)
    assert sum(slept) == pytest.approx(2.5)


def test_parity_travels_with_the_checkpoint(s3_server: S3Server, tmp_path: Path) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    parity = out / "checkpoint-100" / ".ckpt-parity"
    parity.mkdir()
    (parity / "model.safetensors.p0").write_bytes(hashlib.sha256(b"parity").digest() * 8)
    os.utime(parity / "model.safetensors.p0", (time.time() - 7200, time.time() - 7200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    assert run_ckpt("sync", f"s3://{BUCKET}/run", tmp_path / "back").exit_code == 0
    manifest = json.loads((tmp_path / "back" / "checkpoint-100" / "ckpt-manifest.json").read_text())
    assert ".ckpt-parity/model.safetensors.p0" in manifest["files"]
    assert (
        tmp_path / "back" / "checkpoint-100" / ".ckpt-parity" / "model.safetensors.p0"
    ).read_bytes() == (parity / "model.safetensors.p0").read_bytes()


def test_usage_errors(tmp_path: Path) -> None:
    both_local = run_ckpt("sync", tmp_path, tmp_path / "b")
    assert both_local.exit_code == 2 and "local run folder" in both_local.stderr
    to_hub = run_ckpt("sync", tmp_path, "hf://org/run")
    assert to_hub.exit_code == 2 and "commit" in to_hub.stderr
    # an empty policy names the options sync takes, not prune's --incomplete or slimming
    no_policy = run_ckpt("sync", tmp_path, f"s3://{BUCKET}/run/", "--prune-remote", "--yes")
    assert no_policy.exit_code == 2, no_policy.stderr
    assert "--keep-last N" in no_policy.stderr
    assert "--incomplete" not in no_policy.stderr and "--slim" not in no_policy.stderr


@pytest.mark.slow
def test_a_pulled_save_that_lost_a_file_here_is_pulled_again(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # a pulled Trainer save loses its optimizer.pt here (a cleanup script, a full disk): its
    # markers still make it look complete, so every later pull called it "present"; the
    # manifest it was pulled with lists the file, so the next pull restores it
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    back = tmp_path / "back"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", back).exit_code == 0
    (back / "checkpoint-100" / "optimizer.pt").unlink()

    again = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert again.exit_code == 0, again.stdout
    synced = again.json["result"]["checkpoints"][0]
    # the Trainer's own layout says so (it writes optimizer.pt with scheduler.pt)
    assert synced["action"] == "downloaded" and "optimizer.pt is missing" in synced["reason"]
    assert (
        local_files(back / "checkpoint-100").items() >= local_files(out / "checkpoint-100").items()
    )
    # whole again: the next pull has nothing to do
    third = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert third.json["result"]["checkpoints"][0]["action"] == "present"


def test_a_pull_into_a_file_is_a_usage_error_and_leaves_the_file(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # a typo names a file as the run folder: exit 2 saying so, not an OS error (exit 74)
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    result = run_ckpt("sync", f"s3://{BUCKET}/run/", target, "--latest", "--json")
    assert result.exit_code == 2, result.stdout
    assert "not a folder" in result.json["error"]["problem"] and result.json["error"]["fix"]
    assert target.read_text() == "mine\n"


@pytest.mark.slow
def test_a_pull_of_one_checkpoint_or_of_nothing_complete_names_what_to_do_and_writes_nothing(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`sync s3://…/run/checkpoint-200 out` (one save, not its run folder) said "0
    checkpoints", listed every file as not synced and exited 0; a `--latest` pull of a run with
    no complete save refused (exit 3) but left an empty DEST behind."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0

    one = tmp_path / "one"
    result = run_ckpt("sync", f"s3://{BUCKET}/run/checkpoint-200", one, "--json")
    assert result.exit_code == 2, result.stdout
    error = result.json["error"]
    assert "one checkpoint, not a run folder" in error["problem"]
    assert f"ckpt sync s3://{BUCKET}/run {one}" in error["fix"]
    assert not one.exists()

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    for step in (100, 200):  # both saves' uploads cut short: no manifest, nothing complete
        client.delete_object(Bucket=BUCKET, Key=f"run/checkpoint-{step}/ckpt-manifest.json")
    fresh = tmp_path / "fresh"
    result = run_ckpt("sync", f"s3://{BUCKET}/run", fresh, "--latest", "--json")
    assert result.exit_code == 3, result.stdout
    assert "no complete checkpoint" in result.json["error"]["problem"]
    assert not fresh.exists()


@pytest.mark.slow
def test_train_sync_lose_the_machine_pull_latest_and_resume_bit_identical(
    s3_server: S3Server, tmp_path: Path, train: ModuleType
) -> None:
    """Two evictions: the second machine pulls the whole run, resumes, saves and syncs its new
    save up before it is lost too; the third resumes from that save. The pulled saves carry
    the bucket's manifest and the new one does not: that once made the new save "incomplete"
    (never synced, never `latest`) and the pulled ones "changed" (re-hashed, their manifests
    taken down)."""
    # examples/restart_test (the `train` fixture): the straight run is the reference
    make_bucket(s3_server.endpoint, BUCKET)
    args = ["--steps", "8", "--save-every", "2", "--format", "dcp"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert train.main(["--run-dir", str(tmp_path / "straight"), *args]) == 0
        # the spot machine: trains to step 4 (the warm-up: the same whatever --steps), syncs,
        # is evicted (its disk is gone)
        spot = tmp_path / "spot"
        assert train.main(["--run-dir", str(spot), "--steps", "4", *args[2:]]) == 0
        assert run_ckpt("sync", spot, f"s3://{BUCKET}/run/").exit_code == 0
        shutil.rmtree(spot)
        # the next machine: pulls the run, resumes from `ckpt latest`, saves step 6, syncs
        second = tmp_path / "second"
        assert run_ckpt("sync", f"s3://{BUCKET}/run/", second).exit_code == 0
        resume = run_ckpt("latest", second).stdout.strip()
        assert resume == str(second / "step-4")
        # it trains on and is evicted during step 7: its step-8 save is never made
        assert train.main(["--run-dir", str(second), *args, "--resume", resume]) == 0
        shutil.rmtree(second / "step-8")
        assert run_ckpt("latest", second).stdout.strip() == str(second / "step-6")
        s3_server.requests.clear()
        up = run_ckpt("sync", second, f"s3://{BUCKET}/run/", "--settle", "0", "--json")
        assert up.exit_code == 0, up.stdout + up.stderr
        actions = {c["name"]: c["action"] for c in up.json["result"]["checkpoints"]}
        assert actions == {"step-2": "present", "step-4": "present", "step-6": "uploaded"}
        assert not [
            r
            for r in s3_server.requests
            if r.method == "DELETE"
            and "step-6" not in r.path
            and "probe" not in r.path
            and not is_lease(r.path)
        ]
        shutil.rmtree(second)
        # the third: pulls only the newest complete save and finishes the run
        fresh = tmp_path / "fresh"
        assert run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest").exit_code == 0
        resume = run_ckpt("latest", fresh).stdout.strip()
        assert resume == str(fresh / "step-6")
        assert train.main(["--run-dir", str(fresh), *args, "--resume", resume]) == 0
    diff = run_ckpt("diff", tmp_path / "straight" / "step-8", fresh / "step-8", "--json")
    assert diff.exit_code == 0, diff.stdout
    assert diff.json["result"]["equal"] == diff.json["result"]["compared"] > 50
    assert torch  # the example trains with torch


def test_pull_latest_from_a_hub_repo_of_trainer_checkpoints(hub: TestHub, tmp_path: Path) -> None:
    # what Trainer's push_to_hub(hub_strategy="all_checkpoints") leaves: no ckpt manifest
    out = trainer_run(tmp_path, steps=(100, 200))
    interrupted_trainer_save(out, 300)
    hub.add_repo("org/run", out)
    fresh = tmp_path / "fresh"
    pulled = run_ckpt("sync", "hf://org/run", fresh, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    done = pulled.json["result"]["checkpoints"][0]
    assert done["name"] == "checkpoint-200" and done["action"] == "downloaded"
    assert done["verified"] is False  # no manifest to check against: structure only
    assert local_files(fresh / "checkpoint-200") == local_files(out / "checkpoint-200")
    assert run_ckpt("latest", fresh).stdout.strip() == str(fresh / "checkpoint-200")

    # one save of the repo, or a repo that is one model: refused, naming what to run instead
    one = run_ckpt("sync", "hf://org/run/checkpoint-200", tmp_path / "one", "--json")
    assert one.exit_code == 2, one.stdout
    assert f"ckpt sync hf://org/run {tmp_path / 'one'}" in one.json["error"]["fix"]
    hub.add_repo("org/model", out / "checkpoint-200")
    model = run_ckpt("sync", "hf://org/model", tmp_path / "model", "--json")
    assert model.exit_code == 2, model.stdout
    assert f"ckpt convert hf://org/model {tmp_path / 'model'}" in model.json["error"]["fix"]
    assert not (tmp_path / "one").exists() and not (tmp_path / "model").exists()


def test_a_damaged_hub_copy_without_manifest_is_never_published(
    hub: TestHub, tmp_path: Path
) -> None:
    import zipfile

    out = trainer_run(tmp_path, steps=(100, 200))
    optimizer = out / "checkpoint-200" / "optimizer.pt"
    with zipfile.ZipFile(optimizer) as archive:
        members = [(info, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(optimizer, "w", zipfile.ZIP_STORED) as archive:
        for info, data in members:  # a whole zip whose pickle is garbage
            archive.writestr(
                info, b"\x80\x02garbage" + data[10:] if info.filename.endswith("data.pkl") else data
            )
    hub.add_repo("org/run", out)
    fresh = tmp_path / "fresh"
    pulled = run_ckpt("sync", "hf://org/run", fresh, "--latest", "--json")
    assert pulled.exit_code == 1, pulled.stdout
    done = pulled.json["result"]["checkpoints"][0]
    assert done["action"] == "failed"
    assert str(fresh / "checkpoint-200" / "optimizer.pt") in done["reason"]
    assert [p.name for p in fresh.iterdir()] == []  # nothing published, no staging left
    assert run_ckpt("latest", fresh).exit_code == 3


def test_watch_stops_cleanly_on_ctrl_c(s3_server: S3Server, tmp_path: Path) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    report = sync(str(out), f"s3://{BUCKET}/run/", watch_seconds=5, sleep=interrupted)
    assert report.stopped == "interrupted" and report.iterations == 1
    assert report.transferred == ["checkpoint-100"] and not report.failed


@pytest.mark.slow
def test_multipart_uploads_are_checked_by_etag_and_reused_on_resume(
    s3_server: S3Server, tmp_path: Path
) -> None:
    import boto3
    from safetensors.torch import save_file

    from ckpt_cli.storage.object_upload import SINGLE_PUT_MAX

    make_bucket(s3_server.endpoint, BUCKET)
    run = tmp_path / "dump"
    for step in (1, 2):
        folder = run / f"step-{step}"
        folder.mkdir(parents=True)
        # step-2 is a multipart upload: 16 MiB parts and the rest; step-1 one PUT
        size = SINGLE_PUT_MAX if step == 2 else 1 << 20
        big = torch.arange(size // 4 + 1000, dtype=torch.float32) * step
        save_file({"w": big}, folder / "model.safetensors")
        os.utime(folder / "model.safetensors", (time.time() - 7200,) * 2)
    os.utime(folder, (time.time() - 7200,) * 2)  # a plain save: settled, not being written
    # plain saves (no DCP in these `step-N/`): no settle wait for the ones just written
    first = run_ckpt("sync", run, f"s3://{BUCKET}/big/", "--settle", "0", "--json")
    assert first.exit_code == 0, first.stdout
    # verified from the ETag S3 computed over the parts: nothing was read back (the only
    # reads are the header probes of `latest` on the bucket)
    reads = [r for r in s3_server.requests if r.method == "GET" and "model" in r.path]
    for r in reads:
        assert r.range is not None
        start, end = (int(x) for x in r.range.removeprefix("bytes=").split("-"))
        assert end - start < 64 << 10, r
    # the manifest lost (a sync killed right before it): the data is reused, not re-sent
    boto3.client("s3", endpoint_url=s3_server.endpoint).delete_object(
        Bucket=BUCKET, Key="big/step-2/ckpt-manifest.json"
    )
    s3_server.requests.clear()
    again = run_ckpt("sync", run, f"s3://{BUCKET}/big/", "--settle", "0", "--json").json["result"]
    by_name = {c["name"]: c for c in again["checkpoints"]}
    assert by_name["step-2"]["files_reused"] == 1 and again["bytes_sent"] == 0
    assert s3_server.bytes_uploaded() < 4096  # only the manifest


@pytest.mark.slow
def test_a_save_slimmed_after_its_sync_is_replaced_remotely(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    assert (
        run_ckpt("prune", out, "--keep-last", "3", "--slim-older-than", "1", "--yes").exit_code == 0
    )
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    # 200 is the Trainer's best: never slimmed, so already in the bucket as it is
    assert again.json["result"]["transferred"] == ["checkpoint-100"]
    keys = list_keys(s3_server.endpoint, BUCKET, "run/checkpoint-100/")
    assert "run/checkpoint-100/optimizer.pt" not in keys
    assert "run/checkpoint-100/ckpt-slim.json" in keys
    table = run_ckpt("latest", f"s3://{BUCKET}/run", "--json").json["result"]
    marked = {c["name"] for c in table["checkpoints"] if "weights-only" in c["markers"]}
    assert marked == {"checkpoint-100"}
    assert table["latest"] == f"s3://{BUCKET}/run/checkpoint-300"
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-100", "--checksums")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_a_save_rewritten_at_the_same_size_is_synced_again(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A run restarted from an earlier save writes the same step again: same files, same sizes,
    other bytes. sync compared names and sizes only, called the old remote copy "present …
    verified" and never sent the new one. A local file modified after the remote manifest
    was written now makes the save go up again; its unchanged files are found by their ETag."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    time.sleep(1.1)  # the store lists times to the second
    weights_file = out / "checkpoint-200" / "model.safetensors"
    rewritten = bytearray(weights_file.read_bytes())
    rewritten[-4:] = b"\x01\x02\x03\x04"  # the last float of the last tensor
    weights_file.write_bytes(bytes(rewritten))

    s3_server.requests.clear()
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--settle", "0", "--json")
    assert again.exit_code == 0, again.stdout + again.stderr
    report = again.json["result"]
    assert report["transferred"] == ["checkpoint-200"]
    synced = {c["name"]: c for c in report["checkpoints"]}
    assert synced["checkpoint-100"]["action"] == "present"
    assert synced["checkpoint-200"]["files_sent"] == 1  # the rewritten file, nothing else
    assert report["bytes_sent"] == len(rewritten)
    remote = fetch_object(s3_server.endpoint, BUCKET, "run/checkpoint-200/model.safetensors")
    assert remote == bytes(rewritten)
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-200", "--checksums")
    assert checked.exit_code == 0, checked.stdout

    # and once synced, the save is present again: nothing sent
    s3_server.requests.clear()
    third = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--settle", "0", "--json")
    assert third.json["result"]["transferred"] == []
    assert s3_server.bytes_uploaded() == 0


@pytest.mark.slow
def test_a_remote_manifest_damaged_in_the_store_is_replaced_by_the_next_sync(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The bucket's manifest of a synced save is damaged (overwritten, cut by a tool): a pull
    refuses the save, and says to sync it again. That sync called it "present … verified"
    from the manifest object's mere presence and sent nothing, so the save stayed unpullable.
    Now the manifest is read: one that is no manifest, or does not list the save's files,
    does not hold the save; the next sync writes it anew (its files found in place)."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    key = "run/checkpoint-200/ckpt-manifest.json"
    client.put_object(Bucket=BUCKET, Key=key, Body=b"{not a manifest")

    refused = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "a", "--latest", "--json")
    assert refused.exit_code == 1, refused.stdout
    reason = refused.json["result"]["checkpoints"][0]["reason"]
    assert "not a valid ckpt checksum manifest" in reason and "sync it again" in reason

    s3_server.requests.clear()
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    synced = {c["name"]: c for c in again.json["result"]["checkpoints"]}
    assert synced["checkpoint-100"]["action"] == "present"
    assert synced["checkpoint-200"]["action"] == "uploaded"
    assert synced["checkpoint-200"]["files_sent"] == 0  # every data file found in place
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "b", "--latest")
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    assert (
        local_files(tmp_path / "b" / "checkpoint-200").items()
        >= local_files(out / "checkpoint-200").items()
    )


@pytest.mark.slow
def test_the_stores_manifests_are_read_side_by_side_once_each(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # judging saves already synced reads each one's manifest in the store: all at once, so a
    # run of many saves costs about one round trip, and each manifest once, in one request
    # (s3fs would ask each one's size first, a HEAD: a second round trip)
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300, 400))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    s3_server.requests.clear()
    asked: list[S3Request] = []

    def all_four_at_once(request: S3Request) -> bool:
        if request.method == "GET" and request.path.endswith("/ckpt-manifest.json"):
            asked.append(request)
            if len(asked) >= 4:  # released only once every manifest is asked for
                s3_server.release.set()
            return True
        return False

    s3_server.hold = all_four_at_once
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    assert {c["action"] for c in again.json["result"]["checkpoints"]} == {"present"}
    assert sorted(r.path for r in asked) == sorted(
        f"/{BUCKET}/run/checkpoint-{step}/ckpt-manifest.json" for step in (100, 200, 300, 400)
    )
    assert [r.path for r in s3_server.requests if r.method == "HEAD"] == []


@pytest.mark.slow
def test_what_a_sync_does_not_carry_is_named(s3_server: S3Server, tmp_path: Path) -> None:
    """sync moves step checkpoints, `latest` and `metrics.jsonl`. The Trainer's final model at
    the run's root, its `runs/` logs, a script: these stayed behind and nothing said so; now
    each is named, both ways, and ckpt's own records are not."""
    from safetensors.torch import save_file

    from .run_fixtures import weights

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    save_file(weights(200), out / "model.safetensors")  # `trainer.save_model()` at the end
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1").write_bytes(b"\0" * 16)
    (out / "metrics.jsonl").write_text('{"step": 200}\n')
    up = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert up.exit_code == 0, up.stdout + up.stderr
    assert up.json["result"]["left_out"] == ["model.safetensors", "runs/"]
    assert "run/metrics.jsonl" in list_keys(s3_server.endpoint, BUCKET)
    shown = run_ckpt("sync", out, f"s3://{BUCKET}/run/")
    assert "not synced, part of no step checkpoint: model.safetensors, runs/" in " ".join(
        shown.stdout.split()
    )

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("the run of 3 December")
    upload_folder(s3_server.endpoint, BUCKET, "run/notes", notes)
    back = tmp_path / "back"
    down = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert down.exit_code == 0, down.stdout + down.stderr
    assert down.json["result"]["left_out"] == ["notes/"]  # not .ckpt-sync.json, sync's own
    assert sorted(p.name for p in back.iterdir()) == [
        "checkpoint-100",
        "checkpoint-200",
        "metrics.jsonl",
    ]


@pytest.mark.slow
def test_plain_files_of_one_step_travel_together(s3_server: S3Server, tmp_path: Path) -> None:
    from .run_fixtures import weights

    make_bucket(s3_server.endpoint, BUCKET)
    run = tmp_path / "run"
    run.mkdir()
    for step in (10, 20):
        torch.save(weights(step), run / f"model_{step}.pt")
        torch.save({"step": step}, run / f"optim_{step}.pt")
    age(run)
    up = run_ckpt("sync", run, f"s3://{BUCKET}/plain/", "--settle", "0", "--json")
    assert up.exit_code == 0, up.stdout
    assert "plain/model_20.pt.ckpt-manifest.json" in list_keys(s3_server.endpoint, BUCKET)
    back = tmp_path / "back"
    time.sleep(1.1)  # the store lists times to the second: a pull's writes come later
    down = run_ckpt("sync", f"s3://{BUCKET}/plain/", back, "--json")
    assert down.exit_code == 0, down.stdout
    assert all(c["verified"] for c in down.json["result"]["checkpoints"])
    assert local_files(back) == local_files(run)
    # pushed back from the machine that pulled them: in place, nothing taken down or sent
    s3_server.requests.clear()
    # (--settle 0: the pulled files carry the time of their upload, seconds ago here)
    again = run_ckpt("sync", back, f"s3://{BUCKET}/plain/", "--settle", "0", "--json")
    assert again.exit_code == 0, again.stdout
    assert {c["action"] for c in again.json["result"]["checkpoints"]} == {"present"}, again.stdout
    assert [r.path for r in s3_server.requests if r.method in ("PUT", "DELETE")] == []


@pytest.mark.slow
def test_a_save_synced_again_is_pulled_again(s3_server: S3Server, tmp_path: Path) -> None:
    """The pull side of a rewritten save: a machine that had pulled checkpoint-200 kept its old
    copy, called "present", after the training machine rewrote that step and synced it again;
    resuming there was not resuming the run. A remote manifest newer than the one pulled, and
    different, now brings the new copy in its place."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    back = tmp_path / "back"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", back).exit_code == 0
    time.sleep(1.1)  # the store lists times to the second
    weights_file = out / "checkpoint-200" / "model.safetensors"
    rewritten = bytearray(weights_file.read_bytes())
    rewritten[-4:] = b"\x01\x02\x03\x04"
    weights_file.write_bytes(bytes(rewritten))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--settle", "0").exit_code == 0

    again = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert again.exit_code == 0, again.stdout + again.stderr
    pulled = {c["name"]: c for c in again.json["result"]["checkpoints"]}
    assert pulled["checkpoint-100"]["action"] == "present"
    assert pulled["checkpoint-100"]["bytes"] == sum(
        p.stat().st_size for p in (out / "checkpoint-100").iterdir()
    )
    assert pulled["checkpoint-200"]["action"] == "downloaded"
    assert "local copy was replaced" in pulled["checkpoint-200"]["reason"]
    assert pulled["checkpoint-200"]["verified"]
    assert (back / "checkpoint-200" / "model.safetensors").read_bytes() == bytes(rewritten)
    assert not [p.name for p in back.iterdir() if p.name.startswith(".")]  # nothing set aside
    assert run_ckpt("verify", back / "checkpoint-200", "--checksums").exit_code == 0

    # pulled once more, nothing changed on either side: present, nothing fetched
    third = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--json")
    assert third.json["result"]["transferred"] == [] and third.json["result"]["bytes_sent"] == 0
    assert {c["action"] for c in third.json["result"]["checkpoints"]} == {"present"}


@pytest.mark.slow
def test_sigterm_is_honoured_while_an_upload_is_stalled(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A store that stops answering one upload must not hold SIGTERM (a preempted job has
    seconds): the sync stops at once, exit 143, with its JSON envelope, and resumes later."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    target = "/checkpoint-200/optimizer.pt"
    s3_server.hold = lambda r: r.method == "PUT" and r.path.endswith(target)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "sync", str(out), f"s3://{BUCKET}/run/", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(r.path.endswith(target) for r in s3_server.requests):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        stdout, _ = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
        s3_server.hold = None
        s3_server.release.set()
    assert proc.returncode == 143, stdout
    assert waited < 10, f"SIGTERM took {waited:.1f} s"
    assert json.loads(stdout)["exit_code"] == 143
    s3_server.wait_idle()
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/")
    assert again.exit_code == 0, again.stdout
    assert remote_checkpoints(s3_server.endpoint) == {"checkpoint-100", "checkpoint-200"}


@pytest.mark.slow
def test_ctrl_c_mid_push_of_many_small_files_says_what_it_kept_and_the_rerun_resumes(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Ctrl-C while a run of saves of many small shards goes up: the sync stops (exit 130),
    names the save it synced and the one it had begun, whose files uploaded so far stay in
    the bucket (each whole, no manifest) rather than "partial outputs are removed", which
    would not be true. The rerun sends only what is missing, and a pull gets every byte."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = tmp_path / "out"
    for step in (1, 2):
        folder = out / f"checkpoint-{step}"
        trainer_checkpoint(folder, step)
        (folder / "model.safetensors").unlink()
        state = {f"layer.{i}.w": torch.full((16,), float(i + step)) for i in range(60)}
        save_torch_state_dict(state, folder, max_shard_size=100)  # one shard per tensor
    age(out)
    target = "/checkpoint-2/model-00030-of-00060.safetensors"
    s3_server.hold = lambda r: r.method == "PUT" and r.path.endswith(target)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "sync", str(out), f"s3://{BUCKET}/run/", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (
            any(r.path.endswith(target) for r in s3_server.requests)
            and "run/checkpoint-1/ckpt-manifest.json" in list_keys(s3_server.endpoint, BUCKET)
        ):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        s3_server.hold = None
        s3_server.release.set()
    assert proc.returncode == 130, stdout
    error = json.loads(stdout)["error"]
    assert "checkpoint-1 synced" in error["problem"], error
    assert "checkpoint-2" in error["problem"] and "kept" in error["problem"], error
    assert "removed" not in error["message"] and "resumes" in error["fix"], error
    s3_server.wait_idle()
    keys = list_keys(s3_server.endpoint, BUCKET, "run/")
    assert "run/checkpoint-2/ckpt-manifest.json" not in keys
    kept = [k for k in keys if k.startswith("run/checkpoint-2/")]
    assert kept
    for key in kept:  # no object is a part of its file
        assert fetch_object(s3_server.endpoint, BUCKET, key) == (out / key[4:]).read_bytes(), key
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    second = {c["name"]: c for c in again.json["result"]["checkpoints"]}["checkpoint-2"]
    assert second["action"] == "uploaded" and second["files_reused"] >= len(kept)
    pulled = tmp_path / "pulled"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", pulled).exit_code == 0
    for step in (1, 2):
        name = f"checkpoint-{step}"
        original = local_files(out / name)
        assert {k: v for k, v in local_files(pulled / name).items() if k in original} == original


def test_staging_debris_inside_a_checkpoint_is_never_uploaded(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """What a killed `protect --force` or `verify --write-manifest --force` leaves inside a
    checkpoint is no part of it: not uploaded, not in the remote manifest, not pulled back."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    debris = out / "checkpoint-100" / "..ckpt-parity.ckpt-tmp-k1ll3d"
    debris.mkdir()
    (debris / "parity-0.bin").write_bytes(os.urandom(4096))
    (out / "checkpoint-100" / ".ckpt-manifest.json.ckpt-tmp-x1").write_bytes(b"{")
    age(out)
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    keys = list_keys(s3_server.endpoint, BUCKET, "run/")
    assert keys and not [k for k in keys if ".ckpt-tmp-" in k]
    manifest = json.loads(
        fetch_object(s3_server.endpoint, BUCKET, "run/checkpoint-100/ckpt-manifest.json")
    )
    assert not [n for n in manifest["files"] if ".ckpt-tmp-" in n]
    back = tmp_path / "back"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", back).exit_code == 0
    assert not [p for p in (back / "checkpoint-100").rglob("*") if ".ckpt-tmp-" in p.name]
    assert run_ckpt("verify", back / "checkpoint-100", "--checksums").exit_code == 0


@pytest.mark.slow
def test_a_manifest_naming_paths_outside_its_checkpoint_is_refused_as_unsafe(
    s3_server: S3Server, tmp_path: Path
) -> None:
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    key = "run/checkpoint-200/ckpt-manifest.json"
    original = json.loads(fetch_object(s3_server.endpoint, BUCKET, key))
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    for hostile in ("../../../../etc/passwd", "/etc/passwd"):
        manifest = json.loads(json.dumps(original))
        manifest["files"][hostile] = {"size": 2, "digest": "0" * 64}
        client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(manifest).encode())
        checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-200", "--checksums", "--json")
        assert checked.exit_code == 4, checked.stdout
        assert hostile in checked.json["error"]["message"]
        pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "pulled", "--latest", "--json")
        assert pulled.exit_code == 4, pulled.stdout
        assert hostile in pulled.json["error"]["message"]
        assert not (tmp_path / "pulled" / "checkpoint-200").exists()


@pytest.mark.slow
def test_a_pull_keeps_the_manifest_its_files_were_checked_against(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Another machine syncs checkpoint-200 again while this one pulls it: the copy here must
    carry the manifest its files were checked against, not the newer one read afterwards."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    key = "run/checkpoint-200/ckpt-manifest.json"
    first = fetch_object(s3_server.endpoint, BUCKET, key)
    newer = json.loads(first)
    newer["files"]["model.safetensors"]["digest"] = "0" * 64
    size = (out / "checkpoint-200" / "scheduler.pt").stat().st_size
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)

    def resync_meanwhile(r: S3Request) -> bool:
        # while the pull fetches scheduler.pt, the store's manifest is replaced
        if r.path.endswith("checkpoint-200/scheduler.pt") and r.range == f"bytes=0-{size - 1}":
            client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(newer).encode())
        return False

    s3_server.refuse = resync_meanwhile
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--latest")
    s3_server.refuse = None
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    assert fetch_object(s3_server.endpoint, BUCKET, key) != first  # the race did happen
    assert (back / "checkpoint-200" / "ckpt-manifest.json").read_bytes() == first
    checked = run_ckpt("verify", back / "checkpoint-200", "--checksums")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_a_pull_checks_the_sizes_its_manifest_records(s3_server: S3Server, tmp_path: Path) -> None:
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    key = "run/checkpoint-200/ckpt-manifest.json"
    manifest = json.loads(fetch_object(s3_server.endpoint, BUCKET, key))
    manifest["files"]["model.safetensors"]["size"] += 1
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(manifest).encode())
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--latest", "--json")
    assert pulled.exit_code == 1, pulled.stdout
    reason = pulled.json["result"]["checkpoints"][0]["reason"]
    assert "model.safetensors" in reason and "manifest records" in reason
    assert [p.name for p in back.iterdir()] == []  # nothing published, no staging left


def test_a_pull_of_a_save_that_lost_a_file_its_manifest_lists_says_what_to_do(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # every save lost the same file in the bucket (a lifecycle rule on *.json, say): the judge
    # cannot tell it from the other saves, the manifest can; the reason says what to do (a
    # lost scheduler.pt or rng_state.pth the judge tells by itself: the Trainer writes them
    # with optimizer.pt)
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    for step in (100, 200):
        (out / f"checkpoint-{step}" / "config.json").write_text('{"model_type": "llama"}')
    age(out)
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    for step in (100, 200):
        client.delete_object(Bucket=BUCKET, Key=f"run/checkpoint-{step}/config.json")
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", back, "--latest", "--json")
    assert pulled.exit_code == 1, pulled.stdout
    reason = pulled.json["result"]["checkpoints"][0]["reason"]
    assert "lacks config.json" in reason and "sync it again from a machine" in reason
    assert [p.name for p in back.iterdir()] == []  # nothing published, no staging left


@pytest.mark.slow
def test_a_pull_replaces_an_interrupted_local_save_of_the_same_name(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """This machine was preempted while saving checkpoint-200; the store holds the complete
    one. The debris is no copy of it: the pull replaces it, and `latest` names it."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    here = tmp_path / "here"
    here.mkdir()
    interrupted_trainer_save(here, 200)
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", here, "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    done = pulled.json["result"]["checkpoints"][0]
    assert done["action"] == "downloaded" and "local copy was incomplete" in done["reason"]
    assert run_ckpt("latest", here).stdout.strip() == str(here / "checkpoint-200")
    original = local_files(out / "checkpoint-200")
    got = local_files(here / "checkpoint-200")
    assert {k: v for k, v in got.items() if k in original} == original
    assert not [p.name for p in here.iterdir() if p.name.startswith(".")]

    # a complete local save of that name is never replaced: present, as it was
    again = run_ckpt("sync", f"s3://{BUCKET}/run/", here, "--latest", "--json")
    assert again.json["result"]["checkpoints"][0]["action"] == "present"
    # one being written here (no commit marker layout aside, just modified) is left alone
    busy = tmp_path / "busy"
    busy.mkdir()
    save = interrupted_trainer_save(busy, 200)
    os.utime(save / "model.safetensors")  # written this very moment
    kept = run_ckpt("sync", f"s3://{BUCKET}/run/", busy, "--latest", "--json")
    assert kept.exit_code == 1, kept.stdout
    assert "being written here" in kept.json["result"]["checkpoints"][0]["reason"]
    assert not (busy / "checkpoint-200" / "trainer_state.json").exists()


def test_a_url_without_a_bucket_or_a_missing_bucket_is_a_clear_error(
    s3_server: S3Server, tmp_path: Path
) -> None:
    out = trainer_run(tmp_path, steps=(100,))
    for args in (
        ("sync", out, "s3://"),
        ("sync", "s3://", tmp_path / "pulled"),
        ("sync", out, "s3:///run"),
        ("latest", "s3://"),
        ("inspect", "s3://"),
        ("prune", "s3://", "--keep-last", "1"),
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 2, (args, result.stdout)
        assert "a bucket is needed" in result.json["error"]["message"], args
    assert not (tmp_path / "pulled").exists() and not Path("s3:").exists()
    # a bucket that does not exist: exit 3 and what to do, as convert and reshard say it
    missing = run_ckpt("sync", out, "s3://nobucket/run/", "--json")
    assert missing.exit_code == 3, missing.stdout
    assert "the bucket 'nobucket' does not exist" in missing.json["error"]["message"]
    assert "aws s3 mb" in missing.json["error"]["message"]


@pytest.mark.slow
def test_a_pulled_run_pushed_back_sends_nothing_it_pulled(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A machine that pulled the run, resumed and syncs its new saves up: the saves it pulled
    carry the bucket's own manifest but were written here after it, which made sync take
    them for rewritten ones: each lost its remote manifest (incomplete to every other reader
    meanwhile), was hashed again whole and its manifest put back. A save whose manifest is
    the bucket's, with no file newer than that manifest here, is now present as it is."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    time.sleep(1.1)  # the store lists times to the second: the pulled files are newer
    resumed = tmp_path / "resumed"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", resumed).exit_code == 0
    trainer_checkpoint(resumed / "checkpoint-300", 300)
    age(resumed / "checkpoint-300")

    s3_server.requests.clear()
    up = run_ckpt("sync", resumed, f"s3://{BUCKET}/run/", "--json")
    assert up.exit_code == 0, up.stdout + up.stderr
    synced = {c["name"]: c["action"] for c in up.json["result"]["checkpoints"]}
    assert synced == {
        "checkpoint-100": "present",
        "checkpoint-200": "present",
        "checkpoint-300": "uploaded",
    }
    assert not [r.path for r in s3_server.requests if r.method == "DELETE" and "manifest" in r.path]
    assert not [
        r.path
        for r in s3_server.requests
        if r.method == "PUT"
        and "checkpoint-300" not in r.path
        and "probe" not in r.path
        and not is_lease(r.path)
    ]


@pytest.mark.slow
def test_a_pull_follows_deepspeeds_latest_file_to_the_newest_save(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """DeepSpeed names its newest finished save in `latest`, and `load_checkpoint` reads it. A
    second pull fetched global_step20 but kept the `latest` of the first (global_step10): the
    new save was judged unfinished and the pull, `ckpt latest` and DeepSpeed all resumed from
    step 10. The file now follows the store, but never back past a save made here."""
    from .run_fixtures import weights

    make_bucket(s3_server.endpoint, BUCKET)
    out = tmp_path / "ds"

    def deepspeed_save(run: Path, step: int) -> None:
        folder = run / f"global_step{step}"
        folder.mkdir(parents=True)
        torch.save({"module": weights(step)}, folder / "mp_rank_00_model_states.pt")
        (run / "latest").write_text(f"global_step{step}")
        with open(run / "metrics.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
        age(run)

    deepspeed_save(out, 10)
    assert run_ckpt("sync", out, f"s3://{BUCKET}/ds/").exit_code == 0
    back = tmp_path / "back"
    first = run_ckpt("sync", f"s3://{BUCKET}/ds/", back, "--json")
    assert first.json["result"]["latest"] == str(back / "global_step10")

    deepspeed_save(out, 20)
    assert run_ckpt("sync", out, f"s3://{BUCKET}/ds/").exit_code == 0
    second = run_ckpt("sync", f"s3://{BUCKET}/ds/", back, "--json")
    assert second.exit_code == 0, second.stdout + second.stderr
    assert (back / "latest").read_text() == "global_step20"
    assert second.json["result"]["latest"] == str(back / "global_step20")
    assert run_ckpt("latest", back).stdout.strip() == str(back / "global_step20")
    assert (back / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()

    # this machine resumes and saves step 30; a later pull does not point `latest` back at 20
    deepspeed_save(back, 30)
    third = run_ckpt("sync", f"s3://{BUCKET}/ds/", back, "--json")
    assert third.exit_code == 0, third.stdout
    assert (back / "latest").read_text() == "global_step30"
    assert len((back / "metrics.jsonl").read_text().splitlines()) == 3  # its own line kept


def test_pulled_checkpoints_get_umask_permissions_not_0700(
    s3_server: S3Server, tmp_path: Path
) -> None:
    import stat

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    old = os.umask(0o027)
    try:
        pulled = run_ckpt("sync", f"s3://{BUCKET}/run", tmp_path / "back")
    finally:
        os.umask(old)
    assert pulled.exit_code == 0, pulled.stdout + pulled.stderr
    folder = tmp_path / "back" / "checkpoint-100"
    # what `mkdir` and `open` give under umask 027 (as convert and reshard outputs get)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    for inner in folder.rglob("*"):
        want = 0o750 if inner.is_dir() else 0o640
        assert stat.S_IMODE(inner.stat().st_mode) == want, inner


@pytest.mark.parametrize(
    "junk",
    [
        "checkpoint-200/..",
        "checkpoint-200/../x",
        "checkpoint-200/a//b",
        "checkpoint-200/./y",
        "checkpoint-200/model.safetensors/x",  # a file of the checkpoint, and a folder too
    ],
)
@pytest.mark.slow
def test_a_hostile_key_in_the_bucket_fails_its_checkpoint_only_with_exit_4(
    s3_server: S3Server, tmp_path: Path, junk: str
) -> None:
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.put_object(Bucket=BUCKET, Key=f"run/{junk}", Body=b"junk")
    back = tmp_path / "back"
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run", back, "--json")
    assert pulled.exit_code == 4, pulled.stdout + pulled.stderr
    envelope = pulled.json
    assert envelope["exit_code"] == 4
    report = envelope["result"]
    actions = {c["name"]: c["action"] for c in report["checkpoints"]}
    healthy = {"checkpoint-100", "checkpoint-200"} - {junk.split("/")[0]}
    # the healthy checkpoints are pulled, whole and verified against their manifests
    for name in healthy:
        assert actions[name] == "downloaded"
        assert {k: v for k, v in local_files(back / name).items()} == {
            **local_files(out / name),
            "ckpt-manifest.json": (back / name / "ckpt-manifest.json").read_bytes(),
        }
    # the key is named, never an OS error; nothing of a refused checkpoint is published
    assert f"run/{junk}" in json.dumps(report) or junk in json.dumps(report)
    assert "check the filesystem" not in pulled.stdout + pulled.stderr
    assert envelope["error"] is not None and junk in envelope["error"]["message"]
    for name in {"checkpoint-100", "checkpoint-200"} - healthy:
        assert actions[name] == "failed"
        assert not (back / name).exists()
    assert not [p for p in back.iterdir() if p.name.startswith(".")]
    human = run_ckpt("sync", f"s3://{BUCKET}/run", tmp_path / "human")
    assert human.exit_code == 4 and junk in human.stdout + human.stderr


@pytest.mark.slow
def test_data_files_go_up_side_by_side_and_the_markers_after_them(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--jobs`: a checkpoint's data files are uploaded at once; its markers wait for them."""
    import threading

    from ckpt_cli.ops.sync import push

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    real_upload = push._Uploader._upload_file
    # two data uploads meet here only when they run at the same time: one at a time, the
    # first waits alone and the barrier breaks
    together = threading.Barrier(2, timeout=30)
    events: list[str] = []

    def upload(self: push._Uploader, path: Path, rel: str, size: int, new: object) -> object:
        if not push.uploaded_late(rel):
            together.wait()
        events.append(rel)
        return real_upload(self, path, rel, size, new)  # type: ignore[arg-type]

    monkeypatch.setattr(push._Uploader, "_upload_file", upload)
    report = sync(str(out), f"s3://{BUCKET}/run/", jobs=2)
    assert report.transferred == ["checkpoint-100"], report.failed
    data = [rel for rel in events if not push.uploaded_late(rel)]
    assert len(data) >= 2
    # every marker after every data file, in the writer's order
    assert events[: len(data)] == data
    assert events[-1].endswith("trainer_state.json")
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-100", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


def test_a_checkpoints_data_files_go_up_largest_first(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest upload (the optimizer state) starts first, the small files beside it; the
    markers still follow every data file, in the writer's order."""
    from ckpt_cli.ops.sync import push

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    real_upload = push._Uploader._upload_file
    order: list[str] = []

    def upload(self: push._Uploader, path: Path, rel: str, size: int, plan: object) -> object:
        order.append(rel)
        return real_upload(self, path, rel, size, plan)  # type: ignore[arg-type]

    monkeypatch.setattr(push._Uploader, "_upload_file", upload)
    report = sync(str(out), f"s3://{BUCKET}/run/", jobs=1)
    assert report.transferred == ["checkpoint-100"], report.failed
    data = [rel for rel in order if not push.uploaded_late(rel)]
    sizes = [(out / rel).stat().st_size for rel in data]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1
    assert order[len(data) :] == push.upload_order(order[len(data) :])
    assert order[-1].endswith("trainer_state.json")


@pytest.mark.slow
def test_files_are_read_while_the_store_answers_the_checksum_question(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's checksum question goes out before the first upload and is awaited only
    where it decides what is sent: the question is answered only once a data file has been
    read (had the uploads waited for the answer first, nothing would be read while it waits,
    and it gives up), and every body is still checked (Content-MD5 and the ETag: moto checks
    no checksum)."""
    import threading

    import boto3

    from ckpt_cli.storage import object_upload
    from ckpt_cli.storage.object_upload import ObjectUploader

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    # sync's record of the destination is there already: the first bytes read are data
    boto3.client("s3", endpoint_url=s3_server.endpoint).put_object(
        Bucket=BUCKET, Key="run/.ckpt-sync.json", Body=b"{}"
    )
    reading = threading.Event()
    real_read = object_upload.read_for_upload

    def read(src: object, size: int) -> bytes:
        data = real_read(src, size)
        reading.set()
        return data

    monkeypatch.setattr(object_upload, "read_for_upload", read)
    answered_after_reading: list[bool] = []
    real_ask = ObjectUploader._ask_store

    def ask(self: ObjectUploader) -> bool:
        # the bound only ends a failing run: a passing one is released by the reading
        answered_after_reading.append(reading.wait(timeout=30))
        return real_ask(self)

    monkeypatch.setattr(ObjectUploader, "_ask_store", ask)
    report = sync(str(out), f"s3://{BUCKET}/run/")
    assert report.transferred == ["checkpoint-100"] and not report.failed, report.failed
    assert answered_after_reading == [True]
    puts = [r for r in s3_server.requests if r.method == "PUT" and "checkpoint-100/" in r.path]
    assert puts and all("content-md5" in r.checksums for r in puts)
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-100", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_a_body_carries_botocores_own_crc32_only_where_botocore_would_add_one(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where botocore adds a CRC32 to a body sent without a checksum (its default,
    `when_supported`), sync sends its own instead (ISA-L's, the same value); where the user
    asked for `when_required` (a store that refuses the header), none is added."""
    import s3fs

    from ckpt_cli.storage.object_upload import ObjectUploader

    default = s3fs.S3FileSystem(skip_instance_cache=True)
    assert ObjectUploader(default, 1).crc32_by_default()
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    required = s3fs.S3FileSystem(skip_instance_cache=True)
    assert not ObjectUploader(required, 1).crc32_by_default()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["checks none", "checks checksums"])
def test_a_file_sent_in_one_put_is_hashed_once_for_its_manifest(
    s3_server: S3Server, tmp_path: Path, store: str
) -> None:
    """Over plain HTTP botocore signs each body's SHA-256 (`X-Amz-Content-SHA256`); for a
    file sent in one PUT that is the digest a sha256 manifest records, so an upload takes it
    instead of hashing the file's bytes again: to a store that checks no checksum with its
    MD5 (which the reply's ETag must match), to one that checks checksums with its CRC32
    (which the store checks, and the signed SHA-256 too). A client that signs no payload
    gets the file hashed here, and a store that checks checksums then gets the SHA-256 in
    `x-amz-checksum-sha256`. The digest is right in every case."""
    import s3fs

    from ckpt_cli.storage.object_upload import ObjectUploader

    s3_server.checks_checksums = store == "checks checksums"
    make_bucket(s3_server.endpoint, BUCKET)
    data = os.urandom(3 << 20)
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_bytes(data)
    hashed: list[int] = []

    class Counted:
        """SHA-256 that counts the bytes it is given."""

        def __init__(self) -> None:
            self._inner = hashlib.sha256()

        def update(self, block: bytes) -> None:
            hashed.append(len(block))
            self._inner.update(block)

        def hexdigest(self) -> str:
            return self._inner.hexdigest()

    for case, config, here in (
        ("signed", {}, 0),
        ("unsigned", {"s3": {"payload_signing_enabled": False}}, len(data)),
    ):
        hashed.clear()
        s3_server.requests.clear()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config)
        uploader = ObjectUploader(fs, 2, probe=f"{BUCKET}/{case}/.probe")
        try:
            assert uploader.checks_checksums() == s3_server.checks_checksums
            up = uploader.upload(
                path, f"{BUCKET}/{case}/{path.name}", len(data), Counted, sha256=True
            )
        finally:
            uploader.close()
        assert up.digest == hashlib.sha256(data).hexdigest(), case
        assert sum(hashed) == here, case
        if s3_server.checks_checksums:
            assert up.checked and up.expected_etag is None
            put = [r for r in s3_server.requests if r.path.endswith(path.name)]
            assert [r.method for r in put] == ["PUT"]
            if case == "signed":
                assert put[0].checksums == {
                    "x-amz-checksum-crc32": _b64(zlib.crc32(data).to_bytes(4, "big"))
                }
                assert put[0].content_sha256 == hashlib.sha256(data).hexdigest()
            else:
                assert put[0].checksums == {
                    "x-amz-checksum-sha256": _b64(hashlib.sha256(data).digest())
                }
        else:
            assert up.expected_etag == up.etag == hashlib.md5(data).hexdigest(), case
        assert fetch_object(s3_server.endpoint, BUCKET, f"{case}/{path.name}") == data


def _pushed_then_cut_after_one_file(
    s3_server: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cut: Callable[[str], BaseException],
) -> tuple[Path, Path, Callable[..., object]]:
    """A Trainer save pushed to the bucket, and the pull's fetch patched to raise `cut(file)`
    from the second file on; returns the run folder, the pull's DEST and the real fetch."""
    from ckpt_cli.ops.sync import pull

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    real_fetch = pull._fetch
    fetched: list[str] = []

    def cut_after_one(*args: object, **kwargs: object) -> object:
        if fetched:
            raise cut(str(args[1]))
        fetched.append(str(args[1]))
        return real_fetch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pull, "_fetch", cut_after_one)
    return out, tmp_path / "fresh", real_fetch


@pytest.mark.slow
def test_an_interrupted_pull_says_its_staging_is_kept_to_resume(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops.sync import pull

    _, fresh, real_fetch = _pushed_then_cut_after_one_file(
        s3_server, tmp_path, monkeypatch, lambda _file: KeyboardInterrupt()
    )
    # one fetch at a time: the first file is whole before the second is cut (side by side,
    # the cut stops the first at its next block, to resume from its `.part`)
    cut = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest", "--jobs", "1", "--json")
    assert cut.exit_code == 130, cut.stdout
    staging = fresh / ".checkpoint-100.ckpt-tmp-pull"
    assert staging.is_dir()
    message = cut.json["error"]["message"]
    assert str(staging) in message and "resumes" in message
    assert "partial outputs are removed" not in message
    monkeypatch.setattr(pull, "_fetch", real_fetch)
    again = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest", "--json")
    assert again.exit_code == 0 and again.json["result"]["checkpoints"][0]["files_reused"] == 1


def test_a_pull_fetches_a_checkpoints_files_side_by_side(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--jobs` pulling: the files of the checkpoint are fetched at once, as a push sends
    them, the largest first; the pulled copy is the pushed one, checked against its
    manifest."""
    import threading

    from ckpt_cli.ops.sync import pull

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    real_fetch = pull._fetch
    lock = threading.Lock()
    # the first fetch waits until a second one is under way: one at a time, it waits alone
    # (until the timeout) and `most` stays 1
    second = threading.Event()
    active = [0]
    most = [0]
    started: list[str] = []

    def fetch(*args: object, **kwargs: object) -> object:
        with lock:
            started.append(str(args[1]))
            active[0] += 1
            most[0] = max(most[0], active[0])
            if active[0] >= 2:
                second.set()
        second.wait(timeout=30)
        try:
            return real_fetch(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(pull, "_fetch", fetch)
    fresh = tmp_path / "fresh"
    report = sync(f"s3://{BUCKET}/run/", str(fresh), latest_only=True, jobs=3)
    done = report.checkpoints[0]
    assert done.action == "downloaded" and done.verified, done
    assert most[0] >= 2, most
    sizes = {p.name: p.stat().st_size for p in (out / "checkpoint-100").iterdir()}
    assert done.files_sent == len(sizes) and done.bytes_sent == sum(sizes.values())
    assert report.bytes_sent == sum(sizes.values())
    original = local_files(out / "checkpoint-100")
    pulled = local_files(fresh / "checkpoint-100")
    assert {k: v for k, v in pulled.items() if k in original} == original
    checked = run_ckpt("verify", fresh / "checkpoint-100", "--checksums")
    assert checked.exit_code == 0, checked.stdout
    # one at a time, the largest first: the longest fetch is never left to go alone last
    started.clear()
    one = sync(f"s3://{BUCKET}/run/", str(tmp_path / "one"), latest_only=True, jobs=1)
    assert one.transferred == ["checkpoint-100"], one.failed
    fetched = [rel.rsplit("/", 1)[-1] for rel in started]
    assert fetched == sorted(sizes, key=lambda name: (-sizes[name], name)), fetched


def test_a_failed_file_stops_the_pulls_other_fetches_at_their_next_block(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fetched side by side, a file that fails (a lost connection) stops the fetch of a large
    file under way at its next block, not once it is whole; what it wrote is kept in its
    `.part`, and the next pull resumes it and publishes the pushed bytes."""
    import threading

    from ckpt_cli.errors import HubError
    from ckpt_cli.ops.sync import pull
    from ckpt_cli.storage.remote import FsspecStorage

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    big = max((out / "checkpoint-100").iterdir(), key=lambda p: p.stat().st_size)
    size = big.stat().st_size
    block = size // 4
    monkeypatch.setattr(pull, "UPLOAD_BLOCK", block)
    fetching, begun, noticed = threading.Event(), threading.Event(), threading.Event()
    real_read, real_fetch, real_wait = FsspecStorage.read, pull._fetch, pull.wait

    def read(self: FsspecStorage, rel: str, offset: int, length: int) -> bytes:
        # the big file's fetch only: the run's scan reads its header before any fetch
        if fetching.is_set() and rel.endswith(big.name):
            if offset >= block:
                noticed.wait(timeout=30)  # the rest only once the failure is known
            begun.set()
        return real_read(self, rel, offset, length)

    def fetch(*args: object, **kwargs: object) -> object:
        if not str(args[1]).endswith(big.name):
            begun.wait(timeout=30)
            raise HubError("connection reset", path=str(args[1]))
        fetching.set()
        return real_fetch(*args, **kwargs)  # type: ignore[arg-type]

    def wait(*args: object, **kwargs: object) -> object:
        try:
            return real_wait(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            noticed.set()

    monkeypatch.setattr(FsspecStorage, "read", read)
    monkeypatch.setattr(pull, "_fetch", fetch)
    monkeypatch.setattr(pull, "wait", wait)
    fresh = tmp_path / "fresh"
    first = sync(f"s3://{BUCKET}/run/", str(fresh), latest_only=True)
    assert first.failed and "connection reset" in first.failed[0]
    part = fresh / ".checkpoint-100.ckpt-tmp-pull" / f"{big.name}.part"
    assert 0 < part.stat().st_size < size
    monkeypatch.setattr(FsspecStorage, "read", real_read)
    monkeypatch.setattr(pull, "_fetch", real_fetch)
    again = sync(f"s3://{BUCKET}/run/", str(fresh), latest_only=True)
    assert again.transferred == ["checkpoint-100"] and again.checkpoints[0].verified
    assert (fresh / "checkpoint-100" / big.name).read_bytes() == big.read_bytes()


@pytest.mark.slow
def test_a_cut_pull_resumes_keeping_the_files_already_whole(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull cut by a lost connection keeps its hidden staging folder; the next pull fetches
    only what is missing and publishes the same bytes."""
    from ckpt_cli.errors import HubError
    from ckpt_cli.ops.sync import pull

    out, fresh, real_fetch = _pushed_then_cut_after_one_file(
        s3_server, tmp_path, monkeypatch, lambda file: HubError("connection reset", path=file)
    )
    # one fetch at a time, so the first file is whole when the second is cut
    first = sync(f"s3://{BUCKET}/run/", str(fresh), latest_only=True, jobs=1)
    assert first.failed and not (fresh / "checkpoint-100").exists()
    assert run_ckpt("latest", fresh).exit_code != 0  # nothing complete there yet
    staging = fresh / ".checkpoint-100.ckpt-tmp-pull"
    assert staging.is_dir()
    (staging / "stray.part").write_bytes(b"half a file")  # left by a killed pull
    monkeypatch.setattr(pull, "_fetch", real_fetch)
    again = sync(f"s3://{BUCKET}/run/", str(fresh), latest_only=True)
    done = again.checkpoints[0]
    assert done.action == "downloaded" and done.verified, done
    assert done.files_reused == 1 and done.files_sent == done.files - 1
    assert done.bytes_sent < done.bytes
    original = local_files(out / "checkpoint-100")
    pulled = local_files(fresh / "checkpoint-100")
    assert {k: v for k, v in pulled.items() if k in original} == original
    assert set(pulled) - set(original) <= {"ckpt-manifest.json"}
    assert sorted(p.name for p in fresh.iterdir()) == ["checkpoint-100"]
    # what the user reads: the bytes came from the bucket to the folder
    from ckpt_cli.cli.render import stdout
    from ckpt_cli.cli.render.sync import render_sync

    with stdout.capture() as shown:
        render_sync(again)
    assert f"s3://{BUCKET}/run/ → {fresh}" in shown.get()
    assert "1 file already downloaded" in shown.get()


def _is_listing(r: S3Request) -> bool:
    """A GET of the bucket itself (ListObjectsV2), not of an object in it, nor the listing of
    unfinished multipart uploads (`?uploads`) a round that uploads asks once."""
    return r.method == "GET" and r.path.strip("/").count("/") == 0 and "uploads" not in r.query


@pytest.mark.slow
def test_each_file_goes_up_in_one_request_checked_by_the_reply(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """One PUT per file, checked by the ETag the store answers with: no HEAD, no read-back,
    no listing per file or per checkpoint (one listing a round, whatever the run's size)."""
    make_bucket(s3_server.endpoint, BUCKET)
    listings = {}
    for steps in ((100,), (100, 200, 300)):
        out = trainer_run(tmp_path / str(len(steps)), steps=steps)
        s3_server.requests.clear()
        report = sync(str(out), f"s3://{BUCKET}/run{len(steps)}/")
        assert report.transferred == [f"checkpoint-{s}" for s in steps], report.failed
        files = [p for p in out.rglob("*") if p.is_file()]
        for path in files:
            key = f"/{BUCKET}/run{len(steps)}/{path.relative_to(out).as_posix()}"
            mine = [r for r in s3_server.requests if r.path == key]
            assert [r.method for r in mine if r.range is None] == ["PUT"], key
            assert mine[0].length == path.stat().st_size
        assert not [r for r in s3_server.requests if r.method == "HEAD"]
        manifests = [r for r in s3_server.requests if r.path.endswith("ckpt-manifest.json")]
        assert [r.method for r in manifests] == ["PUT"] * len(steps)
        listings[len(steps)] = sum(1 for r in s3_server.requests if _is_listing(r))
        # the newest save is the one just uploaded and checked: `latest` reads nothing back
        reads = [r for r in s3_server.requests if r.method == "GET" and not _is_listing(r)]
        # but the one listing of unfinished multipart uploads (a sync killed before it)
        assert [r.query.split("&")[0] for r in reads] == ["uploads"]
        assert report.latest == f"s3://{BUCKET}/run{len(steps)}/checkpoint-{steps[-1]}"
    # the round's listing is one request, for one save as for three, though nothing was
    # synced to either prefix before (no HEAD, no second listing to tell it is empty)
    assert listings == {1: 1, 3: 1}, listings
    checked = run_ckpt("verify", f"s3://{BUCKET}/run3/checkpoint-300", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


def test_a_refused_upload_publishes_nothing_of_its_checkpoint(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A data file the store refuses fails its checkpoint: no marker, no manifest, so the
    bucket never holds a copy that looks complete; the other saves are published."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200, 300))
    s3_server.refuse = lambda r: (
        r.method == "PUT" and r.path.endswith("/checkpoint-200/scheduler.pt")
    )
    result = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    actions = {c["name"]: c["action"] for c in report["checkpoints"]}
    assert actions == {
        "checkpoint-100": "uploaded",
        "checkpoint-200": "failed",
        "checkpoint-300": "uploaded",
    }
    assert "scheduler.pt" in report["failed"][0]
    keys = list_keys(s3_server.endpoint, BUCKET, "run/checkpoint-200/")
    assert "run/checkpoint-200/ckpt-manifest.json" not in keys
    assert "run/checkpoint-200/trainer_state.json" not in keys
    latest = run_ckpt("latest", f"s3://{BUCKET}/run", "--json").json["result"]
    complete = {c["name"] for c in latest["checkpoints"] if c["status"] == "complete"}
    assert "checkpoint-200" not in complete
    # allowed again, the next round sends what is missing of 200 and nothing else
    s3_server.refuse = None
    s3_server.requests.clear()
    again = sync(str(out), f"s3://{BUCKET}/run/")
    assert again.transferred == ["checkpoint-200"] and not again.failed
    sent = {r.path.rsplit("/", 1)[-1] for r in s3_server.requests if r.method == "PUT"}
    sent.discard(".ckpt-checksum-probe")
    sent = {name for name in sent if not is_lease(name)}
    assert sent == {"scheduler.pt", "trainer_state.json", "ckpt-manifest.json"}


@pytest.mark.slow
def test_a_multipart_upload_cut_midway_is_aborted_and_resent_whole(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A large file goes up as parts sent side by side; a refused part aborts the upload
    (no parts left in the bucket), and the next sync sends the file whole and verified."""
    import boto3
    from safetensors.torch import save_file

    from ckpt_cli.storage.object_upload import SINGLE_PUT_MAX
    from ckpt_cli.storage.output import UPLOAD_BLOCK

    make_bucket(s3_server.endpoint, BUCKET)
    folder = tmp_path / "run" / "step-1"
    folder.mkdir(parents=True)
    big = torch.arange((SINGLE_PUT_MAX + UPLOAD_BLOCK // 2) // 4, dtype=torch.float32)
    save_file({"w": big}, folder / "model.safetensors")
    os.utime(folder / "model.safetensors", (time.time() - 7200,) * 2)
    os.utime(folder, (time.time() - 7200,) * 2)  # a plain save: settled, not being written
    s3_server.refuse = lambda r: r.method == "PUT" and "partNumber=3" in r.query
    first = sync(str(tmp_path / "run"), f"s3://{BUCKET}/big/")
    assert first.failed and not first.transferred
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    assert not client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    # nothing of the checkpoint: only sync's record of the destination
    assert list_keys(s3_server.endpoint, BUCKET, "big/") == ["big/.ckpt-sync.json"]
    s3_server.refuse = None
    s3_server.requests.clear()
    again = sync(str(tmp_path / "run"), f"s3://{BUCKET}/big/")
    assert again.transferred == ["step-1"], again.failed
    parts = [r for r in s3_server.requests if "partNumber=" in r.query]
    size = (folder / "model.safetensors").stat().st_size
    assert len(parts) == -(-size // UPLOAD_BLOCK) and sum(r.length for r in parts) == size
    # moto checks no checksum: each part goes with its Content-MD5 (its ETag is compared),
    # and with the CRC32 botocore would otherwise compute itself, of that part's bytes
    data = (folder / "model.safetensors").read_bytes()
    for part in parts:
        number = int(part.query.split("partNumber=")[1].split("&")[0])
        block = data[(number - 1) * UPLOAD_BLOCK : number * UPLOAD_BLOCK]
        assert part.checksums == {
            "content-md5": _b64(hashlib.md5(block).digest()),
            "x-amz-checksum-crc32": _b64(zlib.crc32(block).to_bytes(4, "big")),
        }
    checked = run_ckpt("verify", f"s3://{BUCKET}/big/step-1", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


def test_judging_a_run_of_torch_save_files_for_a_sync_never_imports_torch(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    script = (
        "import sys; from ckpt_cli.ops.sync import sync; "
        f"r = sync({str(out)!r}, 's3://{BUCKET}/run/'); "
        "assert r.transferred == ['checkpoint-100', 'checkpoint-200'], r; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_objects_an_older_sync_sent_in_16_mib_parts_are_reused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A file of 16–64 MiB now goes up in one PUT; the copy an older `ckpt sync` left as a
    multipart upload of 16 MiB parts (its manifest never written) is recognised by its ETag
    and not sent again."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import save_file

    from ckpt_cli.storage.output import UPLOAD_BLOCK

    make_bucket(s3_server.endpoint, BUCKET)
    folder = tmp_path / "run" / "step-1"
    folder.mkdir(parents=True)
    save_file(
        {"w": torch.arange(UPLOAD_BLOCK // 4 + 5000, dtype=torch.float32)}, folder / "m.safetensors"
    )
    os.utime(folder / "m.safetensors", (time.time() - 7200,) * 2)
    os.utime(folder, (time.time() - 7200,) * 2)  # a plain save: settled, not being written
    parts = TransferConfig(multipart_threshold=UPLOAD_BLOCK, multipart_chunksize=UPLOAD_BLOCK)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.upload_file(
        str(folder / "m.safetensors"), BUCKET, "old/step-1/m.safetensors", Config=parts
    )
    assert client.head_object(Bucket=BUCKET, Key="old/step-1/m.safetensors")["ETag"].endswith('-2"')
    s3_server.requests.clear()
    report = sync(str(tmp_path / "run"), f"s3://{BUCKET}/old/")
    done = report.checkpoints[0]
    assert done.action == "uploaded" and done.files_reused == 1 and done.bytes_sent == 0
    # the data file is not sent again; the manifest goes up in one checked PUT, after the
    # round's probe of whether the store checks checksums
    puts = [r.path for r in s3_server.requests if r.method == "PUT" and not is_lease(r.path)]
    assert sorted(puts) == [
        f"/{BUCKET}/old/.ckpt-checksum-probe",
        f"/{BUCKET}/old/.ckpt-sync.json",
        f"/{BUCKET}/old/step-1/ckpt-manifest.json",
    ]
    checked = run_ckpt("verify", f"s3://{BUCKET}/old/step-1", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


def _b64(digest: bytes) -> str:
    import base64

    return base64.b64encode(digest).decode()


@pytest.mark.slow  # uploads tens of MiB through moto, checksummed (~10 s)
def test_a_store_that_checks_checksums_gets_each_files_sha256_and_refuses_a_damaged_body(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """To a store that checks `x-amz-checksum-*` (as S3 does), each file goes with the SHA-256
    its manifest records (over plain HTTP the one its request's signature covers, beside a
    CRC32 the store checks too), and no MD5 is computed: a body damaged on the way is refused
    by the store, its checkpoint is not published, and the next sync publishes it whole."""
    make_bucket(s3_server.endpoint, BUCKET)
    s3_server.checks_checksums = True
    out = trainer_run(tmp_path, steps=(100, 200))
    s3_server.corrupt = lambda r: r.method == "PUT" and r.path.endswith("200/optimizer.pt")
    first = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert first.exit_code == 1, first.stdout
    actions = {c["name"]: c["action"] for c in first.json["result"]["checkpoints"]}
    assert actions == {"checkpoint-100": "uploaded", "checkpoint-200": "failed"}
    assert "optimizer.pt" in first.json["result"]["failed"][0]
    assert "run/checkpoint-200/ckpt-manifest.json" not in list_keys(s3_server.endpoint, BUCKET)
    # the store refused the probe's wrong checksum: nothing of it is kept
    assert not [k for k in list_keys(s3_server.endpoint, BUCKET) if "probe" in k]
    manifest = json.loads(
        fetch_object(s3_server.endpoint, BUCKET, "run/checkpoint-100/ckpt-manifest.json")
    )
    for name, entry in manifest["files"].items():
        (put,) = [
            r
            for r in s3_server.requests
            if r.method == "PUT" and r.path == f"/{BUCKET}/run/checkpoint-100/{name}"
        ]
        assert put.content_sha256 == entry["digest"], name
        assert set(put.checksums) == {"x-amz-checksum-crc32"}, name
    s3_server.corrupt = None
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    assert again.json["result"]["transferred"] == ["checkpoint-200"]
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-200", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_a_damaged_body_is_caught_by_the_etag_where_the_store_checks_no_checksum(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """moto stores a body whatever checksum it came with: there each body goes with its
    Content-MD5 and the ETag of the reply is compared with the MD5 of the bytes sent, so a
    damaged body fails its checkpoint all the same (and the probe object is not left)."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    s3_server.corrupt = lambda r: r.method == "PUT" and r.path.endswith("100/scheduler.pt")
    first = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert first.exit_code == 1, first.stdout
    assert "scheduler.pt" in first.json["result"]["failed"][0]
    keys = list_keys(s3_server.endpoint, BUCKET)
    assert "run/checkpoint-100/ckpt-manifest.json" not in keys
    assert not [k for k in keys if "probe" in k]
    puts = [r for r in s3_server.requests if r.method == "PUT" and "checkpoint-100/" in r.path]
    assert puts and all("content-md5" in r.checksums for r in puts)
    s3_server.corrupt = None
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-100", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow  # uploads tens of MiB through moto, checksummed (~10 s)
def test_parts_carry_their_crc32_to_a_store_that_checks_and_a_damaged_part_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A multipart upload to a store that checks checksums: each part with its CRC32, a
    damaged part refused and the upload aborted, then sent whole and verified."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    s3_server.checks_checksums = True
    _multipart_sized_save(tmp_path / "run" / "step-1", "m.safetensors")
    s3_server.corrupt = lambda r: r.method == "PUT" and "partNumber=2&" in r.query + "&"
    first = sync(str(tmp_path / "run"), f"s3://{BUCKET}/big/")
    assert first.failed and not first.transferred
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    assert not client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    # nothing of the checkpoint: only sync's record of the destination
    assert list_keys(s3_server.endpoint, BUCKET, "big/") == ["big/.ckpt-sync.json"]
    s3_server.corrupt = None
    s3_server.requests.clear()
    again = sync(str(tmp_path / "run"), f"s3://{BUCKET}/big/")
    assert again.transferred == ["step-1"], again.failed
    parts = [r for r in s3_server.requests if "partNumber=" in r.query]
    assert parts and all(set(r.checksums) == {"x-amz-checksum-crc32"} for r in parts)
    checked = run_ckpt("verify", f"s3://{BUCKET}/big/step-1", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_latest_is_the_buckets_newest_complete_save_when_the_local_run_lacks_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`latest` in the report is the bucket's: a newer save synced from elsewhere, or one the
    local run has lost since its sync, is still the one named."""
    make_bucket(s3_server.endpoint, BUCKET)
    full = trainer_run(tmp_path / "a", steps=(100, 200, 300))
    assert sync(str(full), f"s3://{BUCKET}/run/").latest == f"s3://{BUCKET}/run/checkpoint-300"
    older = trainer_run(tmp_path / "b", steps=(100, 200))
    report = sync(str(older), f"s3://{BUCKET}/run/")
    assert report.latest == f"s3://{BUCKET}/run/checkpoint-300"
    (full / "checkpoint-300" / "trainer_state.json").unlink()  # locally no longer complete
    report = sync(str(full), f"s3://{BUCKET}/run/")
    assert [c.action for c in report.checkpoints][:2] == ["present", "present"]
    assert report.latest == f"s3://{BUCKET}/run/checkpoint-300"


def test_only_a_storage_that_declares_s3fs_gets_s3_requests(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Whether an upload takes S3's own requests (checked by the store's reply) is what the
    storage declares, never guessed from the filesystem's methods: a store that is not s3fs,
    though it has methods of s3fs's names (`call_s3`, `split_path`), is written through its own
    `open` and checked by reading back, and its copy is whole and verified."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from ckpt_cli.storage import FsspecStorage, LocalStorage, filesystem_for
    from ckpt_cli.storage.uri import parse_location

    class LookalikeFileSystem(MemoryFileSystem):
        """Another library's store: an API of its own that happens to share s3fs's names."""

        store: ClassVar[dict[str, object]] = {}  # its own, not memory://'s
        pseudo_dirs: ClassVar[list[str]] = [""]
        protocol = "lookalike"

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return str(MemoryFileSystem._strip_protocol(str(path).removeprefix("lookalike://")))

        def call_s3(self, method: str, *args: object, **kwargs: object) -> None:
            raise AssertionError(f"driven as an S3 client ({method})")

        def split_path(self, path: str) -> None:
            raise AssertionError("driven as an S3 client (split_path)")

    fsspec.register_implementation("lookalike", LookalikeFileSystem, clobber=True)
    out = trainer_run(tmp_path, steps=(100,))
    report = sync(str(out), "lookalike://bucket/run/")
    assert report.transferred == ["checkpoint-100"] and not report.failed, report.failed
    fs = LookalikeFileSystem()
    folder = out / "checkpoint-100"
    manifest = json.loads(fs.cat("/bucket/run/checkpoint-100/ckpt-manifest.json"))
    for name, data in local_files(folder).items():
        assert fs.cat(f"/bucket/run/checkpoint-100/{name}") == data, name
        assert manifest["files"][name]["digest"] == hashlib.sha256(data).hexdigest(), name
    # what each storage declares: the S3 one names its s3fs filesystem, the others none
    make_bucket(s3_server.endpoint, BUCKET)
    s3, path = filesystem_for(parse_location(f"s3://{BUCKET}/run"))
    assert FsspecStorage(s3, path, f"s3://{BUCKET}/run").s3_filesystem() is s3
    assert FsspecStorage(fs, "/bucket/run", "lookalike://bucket/run").s3_filesystem() is None
    assert LocalStorage(folder).s3_filesystem() is None


def test_uploads_do_not_wait_for_the_probe_objects_removal(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """moto keeps the probe object in spite of its wrong checksum; the uploads start as soon
    as that answer is known, while the probe object is removed (a round trip less before
    them), and the sync ends with the probe object gone."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    seen: list[str] = []

    def hold(r: S3Request) -> bool:
        if r.method == "PUT" and "/checkpoint-100/" in r.path:
            seen.append(r.path)
            s3_server.release.set()  # a data file is on its way: the removal may end
        return r.method == "DELETE" and r.path.endswith("/.ckpt-checksum-probe")

    s3_server.hold = hold
    report = sync(str(out), f"s3://{BUCKET}/run/")
    assert report.transferred == ["checkpoint-100"] and not report.failed, report.failed
    # the removal is held until a data file arrives: had the uploads waited for it, nothing
    # would release it (the sync would fail after the hold's timeout). Which of the two the
    # server hears first is the threads' business: under load the removal may come second
    deletes = [r for r in s3_server.requests if r.method == "DELETE" and not is_lease(r.path)]
    assert len(deletes) == 1 and seen
    assert not [k for k in list_keys(s3_server.endpoint, BUCKET) if "probe" in k]


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_a_manifest_damaged_on_the_way_is_caught_and_not_left_behind(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The manifest, which makes the bucket hold a checkpoint, is checked as a data file is:
    one damaged on the way to a store that checks no checksum (moto) fails its checkpoint
    and is removed, so the next sync does not take the checkpoint for synced and sends it."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    s3_server.corrupt = lambda r: r.method == "PUT" and r.path.endswith("/ckpt-manifest.json")
    first = sync(str(out), f"s3://{BUCKET}/run/")
    assert first.failed and not first.transferred
    assert "run/checkpoint-100/ckpt-manifest.json" not in list_keys(s3_server.endpoint, BUCKET)
    (put,) = [r for r in s3_server.requests if r.method == "PUT" and "manifest" in r.path]
    assert "content-md5" in put.checksums
    s3_server.corrupt = None
    again = sync(str(out), f"s3://{BUCKET}/run/")
    assert again.transferred == ["checkpoint-100"] and not again.failed, again.failed
    checked = run_ckpt("verify", f"s3://{BUCKET}/run/checkpoint-100", "--checksums", "--json")
    assert checked.exit_code == 0, checked.stdout


@pytest.mark.slow
def test_a_save_whose_upload_was_cut_is_never_the_buckets_latest(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A run of plain `ck-N/` saves (no commit marker of their own) synced, the sync killed
    while ck-2's optimizer file is on its way: ck-2's weights are in the bucket, its optimizer
    and its manifest are not. `latest` of the bucket, a pull and a prune there all read it as
    a save whose upload has not finished, since sync leaves a record at the destination's root
    (`.ckpt-sync.json`) that a save is whole once its manifest is there. The bucket's latest
    used to be ck-2, and a pull resumed training from a save without optimizer state."""
    from .run_fixtures import weights

    make_bucket(s3_server.endpoint, BUCKET)
    run = tmp_path / "run"
    for step in (1, 2):
        (run / f"ck-{step}").mkdir(parents=True)
        torch.save(weights(step), run / f"ck-{step}" / "model.pt")
        torch.save({"step": step}, run / f"ck-{step}" / "optim.pt")
    age(run)
    target = "/ck-2/optim.pt"
    s3_server.hold = lambda r: r.method == "PUT" and r.path.endswith(target)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "sync", str(run), f"s3://{BUCKET}/run/", "--jobs", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not any(r.path.endswith(target) for r in s3_server.requests):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    s3_server.hold = None
    s3_server.release.set()
    s3_server.wait_idle()
    keys = set(list_keys(s3_server.endpoint, BUCKET, "run/"))
    assert "run/ck-2/model.pt" in keys and "run/ck-2/ckpt-manifest.json" not in keys
    assert "run/ck-1/ckpt-manifest.json" in keys
    rows = run_ckpt("latest", f"s3://{BUCKET}/run", "--settle", "0", "--json").json["result"]
    by_name = {c["name"]: c for c in rows["checkpoints"]}
    assert by_name["ck-2"]["status"] == "incomplete"
    assert "ckpt-manifest.json" in by_name["ck-2"]["reason"]
    assert rows["latest"] == f"s3://{BUCKET}/run/ck-1"
    pulled = tmp_path / "pulled"
    down = run_ckpt("sync", f"s3://{BUCKET}/run/", pulled, "--latest", "--json")
    assert down.exit_code == 0, down.stdout
    assert sorted(p.name for p in pulled.iterdir()) == ["ck-1"]
    assert not (pulled / ".ckpt-sync.json").exists()  # the record stays at the destination
    # the next sync finishes ck-2, which is then the bucket's latest
    assert run_ckpt("sync", run, f"s3://{BUCKET}/run/").exit_code == 0
    assert run_ckpt("latest", f"s3://{BUCKET}/run").stdout.strip() == f"s3://{BUCKET}/run/ck-2"


def _schema_errors(doc: dict[str, object]) -> list[str]:
    """The published JSON schema's complaints about one envelope."""
    import jsonschema

    schema = json.loads((REPO / "schema" / "ckpt-json.schema.json").read_text())
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


@pytest.mark.slow
def test_prune_remote_deletes_only_with_yes_as_prune_does(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt prune` deletes nothing without --yes; `sync --prune-remote` deleted remote
    checkpoints with no --yes at all. Now it is refused up front (nothing uploaded, nothing
    deleted), naming both fixes; --yes (or -y) deletes, and --dry-run wins over --yes."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path)  # 100..500; the Trainer's best is 200
    policy = ["--prune-remote", "--keep-last", "2"]
    fresh = run_ckpt("sync", out, f"s3://{BUCKET}/fresh/", *policy, "--json")
    assert fresh.exit_code == 2, fresh.stdout + fresh.stderr
    message = fresh.json["error"]["message"]
    assert "--yes" in message and "--dry-run" in message
    assert list_keys(s3_server.endpoint, BUCKET, "fresh/") == []  # refused before any upload
    # the plan of a first round is the round's: judged on the bucket as the uploads leave it
    first = run_ckpt("sync", out, f"s3://{BUCKET}/fresh/", *policy, "--dry-run", "--json")
    assert first.exit_code == 0, first.stdout + first.stderr
    decided = {d["name"]: d["action"] for d in first.json["result"]["pruned"]["decisions"]}
    assert sorted(n for n, a in decided.items() if a == "delete") == [
        "checkpoint-100",
        "checkpoint-300",
    ]
    assert decided["checkpoint-200"] == "keep"  # the Trainer's best, as the real round keeps it
    shown = run_ckpt("sync", out, f"s3://{BUCKET}/fresh/", *policy, "-n")
    assert "would prune on the remote side: checkpoint-100, checkpoint-300" in shown.stdout
    assert "nothing was written (--dry-run)" in shown.stdout
    assert list_keys(s3_server.endpoint, BUCKET, "fresh/") == []

    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    before = list_keys(s3_server.endpoint, BUCKET, "run/")
    refused = run_ckpt("sync", out, f"s3://{BUCKET}/run/", *policy)
    assert refused.exit_code == 2 and "--yes" in refused.stderr
    planned = run_ckpt("sync", out, f"s3://{BUCKET}/run/", *policy, "--yes", "--dry-run", "--json")
    assert planned.exit_code == 0, planned.stdout + planned.stderr
    pruned = planned.json["result"]["pruned"]
    assert pruned["applied"] is False and pruned["deleted"] == []
    doomed = sorted(d["name"] for d in pruned["decisions"] if d["action"] == "delete")
    assert doomed == ["checkpoint-100", "checkpoint-300"]
    assert list_keys(s3_server.endpoint, BUCKET, "run/") == before

    deleted = run_ckpt("sync", out, f"s3://{BUCKET}/run/", *policy, "-y", "--json")
    assert deleted.exit_code == 0, deleted.stdout + deleted.stderr
    assert sorted(deleted.json["result"]["pruned"]["deleted"]) == doomed
    assert remote_checkpoints(s3_server.endpoint) == {
        "checkpoint-200",
        "checkpoint-400",
        "checkpoint-500",
    }
    # --yes alone would do nothing: refused, as the --keep-* options are
    alone = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--yes")
    assert alone.exit_code == 2 and "--prune-remote" in alone.stderr


@pytest.mark.slow
def test_sync_dry_run_writes_nothing_on_either_side(s3_server: S3Server, tmp_path: Path) -> None:
    """A user checks what a sync would send before the first real one, and what a pull would
    fetch: the bucket and the local folders are byte for byte as they were."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    interrupted_trainer_save(out, 300)
    local_before = local_files(out)
    s3_server.requests.clear()
    up = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--dry-run", "--json")
    assert up.exit_code == 0, up.stdout + up.stderr
    assert not _schema_errors(up.json)
    plan = up.json["result"]
    assert plan["dry_run"] is True
    assert plan["transferred"] == ["checkpoint-100", "checkpoint-200"]
    actions = {c["name"]: c["action"] for c in plan["checkpoints"]}
    assert actions == {
        "checkpoint-100": "uploaded",
        "checkpoint-200": "uploaded",
        "checkpoint-300": "skipped",
    }
    sizes = sum(len(b) for rel, b in local_before.items() if rel.startswith("checkpoint-100/"))
    assert plan["checkpoints"][0]["bytes"] == sizes == plan["checkpoints"][0]["bytes_sent"]
    assert list_keys(s3_server.endpoint, BUCKET) == []  # no record, no probe, no object
    assert not any(r.method in ("PUT", "POST", "DELETE") for r in s3_server.requests)
    assert local_files(out) == local_before
    human = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "-n")
    assert "would upload 2 checkpoints" in human.stdout
    assert "nothing was written (--dry-run)" in human.stdout

    # the real sync, then a plan of it again: everything is present
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    remote_before = {
        k: fetch_object(s3_server.endpoint, BUCKET, k)
        for k in list_keys(s3_server.endpoint, BUCKET)
    }
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--dry-run", "--json").json["result"]
    assert again["transferred"] == [] and again["bytes_sent"] == 0

    # pulling: DEST is not created, an existing DEST is left as it was, no staging folder
    fresh = tmp_path / "fresh"
    down = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--dry-run", "--json")
    assert down.exit_code == 0, down.stdout + down.stderr
    assert not _schema_errors(down.json)
    assert down.json["result"]["transferred"] == ["checkpoint-100", "checkpoint-200"]
    assert not fresh.exists()
    half = tmp_path / "half"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", half, "--latest").exit_code == 0
    half_before = {p.relative_to(half).as_posix() for p in half.rglob("*")}
    pulled_before = local_files(half)
    pull = run_ckpt("sync", f"s3://{BUCKET}/run/", half, "-n", "--json").json["result"]
    assert {c["name"]: c["action"] for c in pull["checkpoints"]} == {
        "checkpoint-100": "downloaded",
        "checkpoint-200": "present",
    }
    assert {p.relative_to(half).as_posix() for p in half.rglob("*")} == half_before
    assert local_files(half) == pulled_before
    assert {
        k: fetch_object(s3_server.endpoint, BUCKET, k)
        for k in list_keys(s3_server.endpoint, BUCKET)
    } == remote_before
    # one round's plan: repeating it every interval would show nothing new
    watched = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--dry-run", "--watch", "60")
    assert watched.exit_code == 2 and "--watch" in watched.stderr


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_an_empty_run_folder_is_a_run_before_its_first_save(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """docs/safety.md: `prune` and a `sync` push of a run folder that holds no checkpoint yet
    (a job before its first save, which `--watch` waits through) have nothing to do: exit 0,
    nothing written or deleted. A pull from a prefix that holds nothing is "not found" (3),
    and creates no DEST."""
    make_bucket(s3_server.endpoint, BUCKET)
    empty = tmp_path / "out"
    empty.mkdir()
    pushed = run_ckpt("sync", empty, f"s3://{BUCKET}/run/", "--json")
    assert pushed.exit_code == 0, pushed.stdout + pushed.stderr
    assert pushed.json["result"]["transferred"] == []
    assert list_keys(s3_server.endpoint, BUCKET) == []
    pruned = run_ckpt("prune", empty, "--keep-last", "1", "--yes", "--json")
    assert pruned.exit_code == 0 and pruned.json["result"]["deleted"] == []
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "back", "--json")
    assert pulled.exit_code == 3, pulled.stdout + pulled.stderr
    assert not (tmp_path / "back").exists()
    assert list(empty.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_sync_aborts_its_own_multipart_upload(
    s3_server: S3Server, tmp_path: Path, signum: int
) -> None:
    """`ckpt sync` stopped by SIGTERM (a preempted job) or Ctrl-C while a large file goes up as
    a multipart upload: it exited 143 / 130 and left the upload unfinished in the bucket,
    billed and unlisted, for ever unless the same sync ran again. A signal is caught: the
    process aborts its own unfinished uploads before it exits, as it removes its partial
    outputs, so the bucket holds no unfinished upload."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    _multipart_sized_save(tmp_path / "run" / "step-1")
    part = _part_upload
    s3_server.hold = part
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ["sync", str(tmp_path / "run"), f"s3://{BUCKET}/big/", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(part(r) for r in list(s3_server.requests)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        s3_server.hold = None
        s3_server.release.set()
    expected = 143 if signum == signal.SIGTERM else 130
    assert proc.returncode == expected, stderr
    assert json.loads(stdout)["exit_code"] == expected
    s3_server.wait_idle()
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    assert not client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    again = run_ckpt(*args[:3])
    assert again.exit_code == 0, again.stderr
    assert "aborted" not in again.stderr  # nothing left for the next run to clean up


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_the_next_sync_aborts_the_multipart_upload_of_a_sigkilled_one(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt sync` killed (SIGKILL, a preempted node) while a large file goes up as a multipart
    upload: the parts it sent stay in the bucket, billed and unlisted, for ever. The next sync
    to that destination aborts the upload (and removes the dead run's lease), says so, and
    sends the file whole; the bucket ends with no unfinished upload and no lease."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    saved = _multipart_sized_save(tmp_path / "run" / "step-1")
    part = _part_upload
    s3_server.hold = part
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ["sync", str(tmp_path / "run"), f"s3://{BUCKET}/big/"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(part(r) for r in list(s3_server.requests)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        s3_server.hold = None
        s3_server.release.set()
    s3_server.wait_idle()
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    unfinished = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    assert [u["Key"] for u in unfinished] == ["big/step-1/model.safetensors"]
    again = run_ckpt(*args)
    assert again.exit_code == 0, again.stderr
    assert "aborted 1 unfinished multipart upload" in again.stderr, again.stderr
    assert "removed the lease of 1 killed run" in again.stderr, again.stderr
    assert not client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    keys = list_keys(s3_server.endpoint, BUCKET, "big/")
    assert not [k for k in keys if ".ckpt-lease-" in k]
    assert "big/step-1/ckpt-manifest.json" in keys
    pulled = tmp_path / "pulled"
    assert run_ckpt("sync", f"s3://{BUCKET}/big/", pulled).exit_code == 0
    assert (pulled / "step-1" / "model.safetensors").read_bytes() == saved.read_bytes()


@pytest.mark.slow
def test_the_next_sync_removes_what_a_sync_killed_at_its_end_left_at_the_root(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt sync` killed (SIGKILL) once its checkpoint is up, while it removes the object it
    asked the store's checksum question with, leaves that object and its lease at the root of
    the destination. The next sync has nothing to upload, and still removes both and says so."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))

    def probe_removal(r: S3Request) -> bool:
        return r.method == "DELETE" and r.path.endswith("/.ckpt-checksum-probe")

    s3_server.hold = probe_removal
    args = ["sync", str(out), f"s3://{BUCKET}/run/"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", *args],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        manifest = "run/checkpoint-100/ckpt-manifest.json"
        while manifest not in list_keys(s3_server.endpoint, BUCKET, "run/"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        s3_server.refuse = probe_removal  # the removal never lands: the run died first
        s3_server.release.set()
        s3_server.hold = None
    s3_server.wait_idle()
    s3_server.refuse = None
    left = list_keys(s3_server.endpoint, BUCKET, "run/")
    assert "run/.ckpt-checksum-probe" in left
    assert [k for k in left if ".ckpt-lease-" in k]
    again = run_ckpt(*args, "--json")
    assert again.exit_code == 0, again.stdout + again.stderr
    assert again.json["result"]["transferred"] == []
    assert "removed the lease of 1 killed run" in again.stderr, again.stderr
    assert "removed s3://ckpts/run/.ckpt-checksum-probe" in again.stderr, again.stderr
    keys = list_keys(s3_server.endpoint, BUCKET, "run/")
    assert "run/.ckpt-checksum-probe" not in keys
    assert not [k for k in keys if ".ckpt-lease-" in k], keys


@pytest.mark.slow
def test_a_sync_leaves_the_multipart_uploads_of_a_live_one_alone(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Another sync into the same destination is uploading (its lease is fresh): its
    unfinished multipart upload is kept."""
    import boto3

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    lease = json.dumps({"pid": 1, "machine": "another-machine"})
    client.put_object(Bucket=BUCKET, Key="run/.ckpt-lease-cccccccccccc", Body=lease)
    client.create_multipart_upload(Bucket=BUCKET, Key="run/checkpoint-200/optimizer.pt")
    result = run_ckpt("sync", out, f"s3://{BUCKET}/run/")
    assert result.exit_code == 0, result.stderr
    assert "aborted" not in result.stderr
    assert len(client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])) == 1
    assert "run/.ckpt-lease-cccccccccccc" in list_keys(s3_server.endpoint, BUCKET, "run/")


#: runs `ckpt ARGV…` (renameat2 off: two renames) in a real process that SIGKILLs itself as it
#: renames a pull's staging folder into place, once the old copy was moved aside
_KILLED_PULL_PUBLISH = """
import os, signal, sys
real_rename = os.rename
def rename(a, b, *args, **kwargs):
    if str(a).endswith(".ckpt-tmp-pull") and ".ckpt-old-" not in str(b):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(a, b, *args, **kwargs)
os.rename = rename
from ckpt_cli.__main__ import entry
sys.argv = ["ckpt", *sys.argv[1:]]
entry()
"""


@pytest.mark.slow
def test_a_pull_killed_while_replacing_a_copy_is_settled_by_the_next_pull(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A pull replacing a save synced again is killed (SIGKILL) after moving the local copy
    aside and before putting the new one in its place: the local save lived on only in the
    hidden `.checkpoint-200.ckpt-old-PID`. The next pull puts it back, says so, and then
    replaces it as it should; nothing is left hidden."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100, 200))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/").exit_code == 0
    back = tmp_path / "back"
    assert run_ckpt("sync", f"s3://{BUCKET}/run/", back).exit_code == 0
    time.sleep(1.1)  # the store lists times to the second
    weights_file = out / "checkpoint-200" / "model.safetensors"
    rewritten = bytearray(weights_file.read_bytes())
    rewritten[-4:] = b"\x01\x02\x03\x04"
    weights_file.write_bytes(bytes(rewritten))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--settle", "0").exit_code == 0

    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_NO_RENAME_EXCHANGE="1")
    args = ["sync", f"s3://{BUCKET}/run/", str(back)]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_PULL_PUBLISH, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (back / "checkpoint-200").exists()
    (aside,) = back.glob(".checkpoint-200.ckpt-old-*")

    again = run_ckpt(*args)
    assert again.exit_code == 0, again.stdout + again.stderr
    assert "restored" in again.stderr and aside.name in again.stderr, again.stderr
    assert (back / "checkpoint-200" / "model.safetensors").read_bytes() == bytes(rewritten)
    assert not [p.name for p in back.iterdir() if p.name.startswith(".")]  # nothing hidden
    assert run_ckpt("verify", back / "checkpoint-200", "--checksums").exit_code == 0


@pytest.mark.parametrize("kept", ["whole", "torn"])
@pytest.mark.slow
def test_a_pull_cut_inside_a_file_resumes_that_file_where_it_stopped(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    """A pull killed in the middle of a large file (a 10 GB optimizer.pt cut at 9 GB) keeps
    what it wrote of it; the next pull asks the store only for the rest, checks the whole
    file against the checkpoint's manifest, and publishes the same bytes. Where what was
    kept is not the object's start (`torn`: a machine that lost power before the bytes
    reached the disk), the manifest's digest says so and the file is fetched whole again."""
    from ckpt_cli.ops.sync import pull
    from ckpt_cli.storage.remote import FsspecStorage

    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    assert run_ckpt("sync", out, f"s3://{BUCKET}/run").exit_code == 0
    big = max((out / "checkpoint-100").iterdir(), key=lambda p: p.stat().st_size)
    size = big.stat().st_size
    block = size // 4  # the file comes in four reads
    monkeypatch.setattr(pull, "UPLOAD_BLOCK", block)
    real_read = FsspecStorage.read
    reads: list[int] = []

    def cut_at_the_third_block(self: FsspecStorage, rel: str, offset: int, length: int) -> bytes:
        if rel.endswith(big.name) and length == block:
            reads.append(offset)
            if len(reads) == 3:
                raise KeyboardInterrupt
        return real_read(self, rel, offset, length)

    monkeypatch.setattr(FsspecStorage, "read", cut_at_the_third_block)
    fresh = tmp_path / "fresh"
    cut = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest")
    assert cut.exit_code == 130, cut.stderr
    part = fresh / ".checkpoint-100.ckpt-tmp-pull" / f"{big.name}.part"
    assert part.stat().st_size == 2 * block
    monkeypatch.setattr(FsspecStorage, "read", real_read)
    if kept == "torn":
        part.write_bytes(bytes(2 * block))
    total = sum(p.stat().st_size for p in (out / "checkpoint-100").iterdir())
    kept_bytes = sum(p.stat().st_size for p in part.parent.iterdir())
    s3_server.requests.clear()

    again = run_ckpt("sync", f"s3://{BUCKET}/run/", fresh, "--latest", "--json")

    assert again.exit_code == 0, again.stderr
    done = again.json["result"]["checkpoints"][0]
    assert done["action"] == "downloaded" and done["verified"] is True
    # the bytes that came over the wire this time: all but what the cut pull kept (its
    # whole files and the start of the cut file), and the cut file whole once more when
    # what was kept of it was wrong; not the cut file's whole size
    fetched = total - kept_bytes + (size if kept == "torn" else 0)
    assert done["bytes_sent"] == fetched, (done["bytes_sent"], fetched)
    assert again.json["result"]["bytes_sent"] == fetched
    key = f"/{BUCKET}/run/checkpoint-100/{big.name}"
    asked = [r.range for r in s3_server.requests if r.path == key and r.method == "GET"]
    # the rest of the file, from where the cut pull stopped; its first half again only when
    # what was kept of it was wrong
    assert f"bytes={2 * block}-{3 * block - 1}" in asked, asked
    first_half = {f"bytes=0-{block - 1}", f"bytes={block}-{2 * block - 1}"}
    assert (first_half <= set(asked)) == (kept == "torn"), asked
    assert (fresh / "checkpoint-100" / big.name).read_bytes() == big.read_bytes()
    assert not part.exists()


@pytest.mark.slow  # uploads 64 MiB through moto over TLS, checksummed (~10 s)
def test_over_tls_each_body_is_hashed_once_and_checked_by_the_store_all_the_same(
    s3_tls_server: S3Server, tmp_path: Path
) -> None:
    """Over HTTPS (how S3 is reached) botocore leaves a body's SHA-256 out of the request's
    signature when TLS and a checksum header protect it; it recognised only the checksums it
    computed itself, so every body ckpt sent with its own `x-amz-checksum-*` was hashed once
    more to be signed: a whole SHA-256 pass over each file, beside the manifest's. Now such
    requests go as an unsigned payload: the store still checks every body (a damaged one is
    refused, its checkpoint not published), and what lands is byte for byte the file."""

    make_bucket(s3_tls_server.endpoint, BUCKET)
    s3_tls_server.checks_checksums = True
    out = trainer_run(tmp_path, steps=(100, 200))
    big = tmp_path / "big" / "step-1"
    _multipart_sized_save(big, "m.safetensors")
    s3_tls_server.corrupt = lambda r: r.method == "PUT" and r.path.endswith("200/optimizer.pt")
    first = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert first.exit_code == 1, first.stdout
    assert "optimizer.pt" in first.json["result"]["failed"][0]
    assert "run/checkpoint-200/ckpt-manifest.json" not in list_keys(s3_tls_server.endpoint, BUCKET)
    s3_tls_server.corrupt = None
    again = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert again.exit_code == 0, again.stdout
    assert sync(str(tmp_path / "big"), f"s3://{BUCKET}/big/").transferred == ["step-1"]
    bodies = [
        r
        for r in s3_tls_server.requests
        if r.method == "PUT" and r.length and not is_lease(r.path) and "probe" not in r.path
    ]
    parts = [r for r in bodies if "partNumber=" in r.query]
    assert len(parts) >= 4 and len(bodies) > len(parts)
    for body in bodies:
        assert body.checksums, body.path  # the store checks each one
        assert body.content_sha256 == "UNSIGNED-PAYLOAD", (body.path, body.content_sha256)
    for name in ("run/checkpoint-100", "run/checkpoint-200", "big/step-1"):
        checked = run_ckpt("verify", f"s3://{BUCKET}/{name}", "--checksums", "--json")
        assert checked.exit_code == 0, checked.stdout
    assert (
        fetch_object(s3_tls_server.endpoint, BUCKET, "big/step-1/m.safetensors")
        == (big / "m.safetensors").read_bytes()
    )


def _multipart_sized_save(folder: Path, name: str = "model.safetensors") -> Path:
    """A plain save (settled: written two hours ago) of one safetensors file large enough to
    go up as a multipart upload."""
    from safetensors.torch import save_file

    from ckpt_cli.storage.object_upload import SINGLE_PUT_MAX

    folder.mkdir(parents=True)
    save_file({"w": torch.arange(SINGLE_PUT_MAX // 4 + 10, dtype=torch.float32)}, folder / name)
    os.utime(folder / name, (time.time() - 7200,) * 2)
    os.utime(folder, (time.time() - 7200,) * 2)
    return folder / name


def _part_upload(r: S3Request) -> bool:
    """A multipart upload's part."""
    return r.method == "PUT" and "partNumber=" in r.query


def test_a_sync_watch_stopped_by_sigterm_exits_143_with_its_summary(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`sync --watch` ended by the job scheduler (SIGTERM) between rounds exited 0 with
    `stopped: interrupted`: the exit-code table says 143, and a scheduler's script must tell a
    stopped watch from one that ran its rounds. The envelope still carries the summary."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path, steps=(100,))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "ckpt_cli", "sync", str(out), f"s3://{BUCKET}/run/"]
    proc = subprocess.Popen(
        [*cmd, "--settle", "0", "--watch", "3600", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        manifest = "run/checkpoint-100/ckpt-manifest.json"
        while manifest not in list_keys(s3_server.endpoint, BUCKET):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the round ends, the watch sleeps
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    envelope = json.loads(stdout)
    assert envelope["exit_code"] == 143 and envelope["error"]["code"] == "terminated"
    assert envelope["result"]["stopped"] == "interrupted"
    assert "SIGTERM" in stderr


def test_a_missing_bucket_is_exit_3_before_there_is_anything_to_upload(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt sync out/ s3://typo/run/ --watch` started with the job, before its first save,
    and `--dry-run` to check the command first: both said all was well (exit 0, the dry run
    planned every upload) for a bucket that does not exist, and only the first real upload,
    hours later, failed. The bucket is checked as every other command that writes checks it."""
    out = trainer_run(tmp_path, steps=(100,))
    planned = run_ckpt("sync", out, "s3://nobucket/run/", "--dry-run", "--json")
    assert planned.exit_code == 3, planned.stdout
    assert "bucket 'nobucket' does not exist" in planned.json["error"]["message"]
    assert "aws s3 mb" in planned.json["error"]["fix"]
    starting = tmp_path / "starting"
    starting.mkdir()
    fresh_save(starting, 100)  # the job's first save, still being written
    waiting = run_ckpt("sync", starting, "s3://nobucket/run/", "--json")
    assert waiting.exit_code == 3, waiting.stdout
    assert "bucket 'nobucket' does not exist" in waiting.json["error"]["message"]


def test_a_folder_made_in_the_console_before_the_upload_is_pulled_as_any_save(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The AWS console's "Create folder" (and s3fs `mkdir`, rclone, Cyberduck) writes a
    zero-byte key `run/checkpoint-200/`; the save was then copied in with `aws s3 cp`.
    `ckpt latest` called it complete, but the pull refused it as holding an unsafe key
    'checkpoint-200/' (exit 4). A folder placeholder is no file: the save is pulled whole."""
    import boto3
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = trainer_run(tmp_path, steps=(100, 200))
    make_bucket(s3_server.endpoint, BUCKET)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.put_object(Bucket=BUCKET, Key="run/", Body=b"")
    client.put_object(Bucket=BUCKET, Key="run/checkpoint-200/", Body=b"")
    upload_folder(s3_server.endpoint, BUCKET, "run", out)
    latest = run_ckpt("latest", f"s3://{BUCKET}/run/", "--settle", "0")
    assert latest.stdout.strip() == f"s3://{BUCKET}/run/checkpoint-200", latest.stdout
    pulled = run_ckpt("sync", f"s3://{BUCKET}/run/", tmp_path / "pulled", "--latest", "--json")
    assert pulled.exit_code == 0, pulled.stdout
    assert pulled.json["result"]["refused_keys"] == []
    assert local_files(tmp_path / "pulled" / "checkpoint-200") == local_files(
        out / "checkpoint-200"
    )
    with safe_open(tmp_path / "pulled" / "checkpoint-200" / "model.safetensors", "pt") as got:
        expected = load_file(out / "checkpoint-200" / "model.safetensors")
        assert all(torch.equal(got.get_tensor(k), v) for k, v in expected.items())


def test_a_pull_into_a_folder_under_a_file_is_refused_before_its_dry_run_plans_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt sync s3://…/run notes.txt/run --dry-run` planned the pull and exited 0; the pull
    then failed creating the folders (exit 74). The dry run now says so, as the pull does."""
    make_bucket(s3_server.endpoint, BUCKET)
    out = trainer_run(tmp_path / "train", steps=(100,))
    pushed = run_ckpt("sync", out, f"s3://{BUCKET}/run/", "--json")
    assert pushed.exit_code == 0, pushed.stdout + pushed.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    for dry in (["--dry-run"], []):
        result = run_ckpt("sync", f"s3://{BUCKET}/run/", notes / "run", *dry, "--json")
        assert result.exit_code == 74, (dry, result.stdout)
        assert result.json["error"]["path"] == str(notes), result.stdout
        assert "ENOTDIR" in result.json["error"]["message"]
    assert notes.read_text() == "not a folder\n"
