"""`ckpt download` against a Hub that answers wrong (#19 items 1 and 7).

The test Hub (tests/hub_server.py) corrupts, shifts, shortens or widens range responses, or
flips a byte of a whole-file GET. A wrong byte is never published as verified: a wrong range is
refused, ranges are called "checked for size and position" unless `--verify-ranges` hashes the
source shards, and a file found not to match the Hub's sha256 leaves the HF cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .conftest import run_ckpt
from .hub_fixtures import publish_model
from .hub_server import TestHub, git_blob_id
from .test_download import SHARD_LIMIT, model_state, read_all

TENSORS = ["--mode", "tensors", "--no-extras", "--filter", "model.layers.*"]


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # a wrong range is asked again READ_RETRIES times with back-off; one retry keeps tests quick
    monkeypatch.setattr("ckpt_cli.storage.hub.READ_RETRIES", 1)


def publish(hub: TestHub, tmp_path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    state = model_state()
    publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    return state, shards


def selected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if n.startswith("model.layers.")}


@pytest.mark.parametrize("how", ["shift", "short", "part200"])
def test_a_shifted_or_resized_range_is_refused_and_nothing_is_published(
    hub: TestHub, tmp_path: Path, how: str
) -> None:
    _, shards = publish(hub, tmp_path)
    for shard in shards:
        hub.corrupt_ranges("org/model", shard, how)
    dest = tmp_path / "picked"
    result = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--json")
    assert result.exit_code == 5, result.stdout
    assert "other bytes than asked" in result.json["error"]["message"]
    assert not dest.exists()


def test_a_200_with_the_whole_file_is_handled_and_the_bytes_are_right(
    hub: TestHub, tmp_path: Path
) -> None:
    state, shards = publish(hub, tmp_path)
    for shard in shards:
        hub.corrupt_ranges("org/model", shard, "whole")
    dest = tmp_path / "picked"
    result = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--json")
    assert result.exit_code == 0, result.stdout
    got = read_all(dest)
    assert got.keys() == selected(state).keys()
    assert all(torch.equal(got[n], t) for n, t in selected(state).items())


def test_ranged_bytes_are_never_called_verified_without_a_hash(
    hub: TestHub, tmp_path: Path
) -> None:
    publish(hub, tmp_path)
    dest = tmp_path / "picked"
    result = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    weights = [f for f in report["files"] if f["kind"] == "weights"]
    assert weights and not any(f["verified"] for f in weights)
    assert {f["checked"] for f in weights} == {"size-and-position"}
    assert "not covered by a hash" in report["integrity"]
    # DEST says so itself, in every shard's metadata
    for shard in dest.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            meta = fh.metadata()
        assert meta["ckpt.download.checked"] == "size-and-position"
        assert meta["ckpt.download.source"].startswith("hf://org/model@")
    human = run_ckpt("download", "hf://org/model", tmp_path / "again", *TENSORS)
    assert "size and position only" in human.stderr


def test_verify_ranges_catches_a_corrupted_range_and_publishes_nothing(
    hub: TestHub, tmp_path: Path
) -> None:
    state, shards = publish(hub, tmp_path)
    for shard in shards:
        hub.corrupt_ranges("org/model", shard, "flip", times=1)
    dest = tmp_path / "picked"
    result = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--verify-ranges", "--json")
    assert result.exit_code == 4, result.stdout
    message = result.json["error"]["message"]
    assert "came back wrong in range responses" in message and "model.layers." in message
    assert not dest.exists()
    # the kept pieces were discarded: the rerun (the server behaves now) is right and verified
    again = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--verify-ranges", "--json")
    assert again.exit_code == 0, again.stdout
    weights = [f for f in again.json["result"]["files"] if f["kind"] == "weights"]
    assert all(f["verified"] and f["checked"] == "ranges-sha256" for f in weights)
    got = read_all(dest)
    assert all(torch.equal(got[n], t) for n, t in selected(state).items())


def test_verify_ranges_catches_a_lying_content_range(hub: TestHub, tmp_path: Path) -> None:
    _, shards = publish(hub, tmp_path)
    for shard in shards:
        hub.corrupt_ranges("org/model", shard, "lie", times=4)
    dest = tmp_path / "picked"
    result = run_ckpt("download", "hf://org/model", dest, *TENSORS, "--verify-ranges", "--json")
    assert result.exit_code == 4, result.stdout
    assert not dest.exists()


def test_a_corrupt_shard_leaves_the_hf_cache_and_the_rerun_succeeds(
    hub: TestHub, tmp_path: Path
) -> None:
    state, shards = publish(hub, tmp_path)
    hub.corrupt_ranges("org/model", shards[0], "flip", times=1)
    dest = tmp_path / "model"
    result = run_ckpt("download", "hf://org/model", dest, "--json")
    assert result.exit_code == 4, result.stdout
    message = result.json["error"]["message"]
    assert "removed it from the HF cache" in message
    assert not dest.exists()
    # nothing that ckpt found wrong stays in the shared cache: every blob is named by the
    # hash of its content (sha256 for LFS files, the git blob id for small ones)
    home = Path(os.environ["HF_HOME"])
    blobs = [b for b in home.rglob("blobs/*") if b.is_file()]
    for blob in blobs:
        data = blob.read_bytes()
        assert blob.name in (hashlib.sha256(data).hexdigest(), git_blob_id(data)), blob
    assert result.json["error"]["message"].count(str(home)) >= 1
    # the rerun fetches the shard again and succeeds (no hand cleanup)
    again = run_ckpt("download", "hf://org/model", dest, "--json")
    assert again.exit_code == 0, again.stdout
    got = read_all(dest)
    assert all(torch.equal(got[n], t) for n, t in state.items())
    assert json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.parametrize(
    ("status", "exit_code", "said"),
    [(404, 3, "HTTP 404"), (403, 5, "refused (HTTP 403)")],
)
def test_a_shard_the_server_will_not_serve_is_named_with_its_http_status(
    hub: TestHub, tmp_path: Path, status: int, exit_code: int, said: str
) -> None:
    # a mirror or proxy answers a listed shard with a bare 404 (no X-Error-Code) or a 403:
    # huggingface_hub reports that as "not in the local cache"; the user must read what the
    # server said and what to do, not an offline-mode hint, and no DEST is left
    _, shards = publish(hub, tmp_path)
    hub.fail(f"/resolve/.*/{shards[1]}$", status, times=100)
    dest = tmp_path / "d"
    result = run_ckpt("download", "hf://org/model", dest, "--json")
    assert result.exit_code == exit_code, result.stdout
    error = result.json["error"]
    assert shards[1] in error["path"] and said in error["problem"]
    assert "HF_HUB_OFFLINE" not in error["message"] and error["fix"]
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_a_connection_reset_on_a_files_metadata_request_is_asked_again_in_shards_mode(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards mode fetches each file with `hf_hub_download`, which asks the Hub for the file's
    metadata first and reports a connection reset there as a failure at once. ckpt asks
    again, as for its own reads: the index, a shard and a config file each lose a connection
    once, and the download is the source's bytes all the same. A connection that keeps
    breaking fails, exit 5, naming the file."""
    from ckpt_cli.storage import hub_repo

    monkeypatch.setattr(hub_repo, "BROKEN_BASE_WAIT", 0.01)
    _, shards = publish(hub, tmp_path)
    for name in ("model.safetensors.index.json", shards[1], "config.json"):
        hub.reset(f"/resolve/[^/]+/{name}$", times=1)
    dest = tmp_path / "d"
    result = run_ckpt("download", "hf://org/model", dest, "--json")
    assert result.exit_code == 0, result.stdout
    assert [r for r in hub.log if r.status == 0]  # the resets happened
    for path in (tmp_path / "src").iterdir():
        assert (dest / path.name).read_bytes() == path.read_bytes(), path.name

    monkeypatch.setenv("HF_HOME", str(tmp_path / "fresh-home"))  # nothing cached
    hub.reset(f"/resolve/[^/]+/{shards[0]}$", times=1000)
    broken = run_ckpt("download", "hf://org/model", tmp_path / "e", "--json")
    assert broken.exit_code == 5, broken.stdout
    error = broken.json["error"]
    assert error["path"].endswith(shards[0]) and "kept breaking" in error["problem"], error
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_a_wrong_range_under_verify_offers_a_fix_that_verify_can_take(
    hub: TestHub, tmp_path: Path
) -> None:
    # `verify --deep` reads the Hub's shards by ranges; a proxy that shifts every range is
    # refused. The fix offered must work for verify (which has no `--mode`): the files
    # fetched whole into the HF cache, each checked against the Hub's sha256, then read there
    commit = publish_model(
        hub, "org/model", tmp_path / "src", model_state(), max_shard_size=SHARD_LIMIT
    )
    for shard in sorted(p.name for p in (tmp_path / "src").glob("*.safetensors")):
        hub.corrupt_ranges("org/model", shard, "shift")
    result = run_ckpt("verify", "hf://org/model", "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    wrong = [p for p in result.json["result"]["problems"] if "other bytes" in p["message"]]
    assert wrong, result.stdout
    fix = wrong[0]["fix"]
    assert "--mode" not in fix
    assert f"ckpt download hf://org/model@{commit} --cache-only" in fix, fix
    fetched = run_ckpt("download", f"hf://org/model@{commit}", "--cache-only")
    assert fetched.exit_code == 0, fetched.stdout + fetched.stderr
    again = run_ckpt("verify", "hf://org/model", "--deep", "--json")
    assert again.exit_code == 0, again.stdout


@pytest.mark.slow
def test_a_shard_the_hub_answers_500_for_is_asked_as_huggingface_hub_asks_it_not_36_times(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub (or mirror) that answers one shard with 500: huggingface_hub asks the shard's
    metadata again with its own back-off (5 new tries, 23 s), and ckpt asked that whole
    again 5 more times: 42 requests and 2 min 40 s before `ckpt download` said "HTTP 500".
    It is reported after huggingface_hub's own tries, exit 5, naming the shard, and the
    rerun (the Hub answers again) fetches only that shard."""
    import time
    import types

    from huggingface_hub.utils import _http

    from ckpt_cli.storage import hub_repo

    # no real waiting, ckpt's or huggingface_hub's: the requests are counted instead
    monkeypatch.setattr(hub_repo, "RETRY_BASE_WAIT", 0.0)
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if n[0] != "_"})
    clock.sleep = lambda seconds: None
    monkeypatch.setattr(_http, "time", clock)
    _, shards = publish(hub, tmp_path)
    hub.fail(f"/resolve/.*/{shards[-1]}$", 500, times=1000)
    dest = tmp_path / "d"
    result = run_ckpt("download", "hf://org/model", dest, "--json")
    assert result.exit_code == 5, result.stdout
    error = result.json["error"]
    assert error["path"].endswith(shards[-1]) and "HTTP 500" in error["problem"], error
    asked = [r for r in hub.log if r.path.endswith(shards[-1]) and r.status == 500]
    assert len(asked) <= 7, len(asked)  # huggingface_hub's: one, then 1 + 5 with back-off
    assert not dest.exists()

    hub._fails.clear()
    hub.reset_counters()
    again = run_ckpt("download", "hf://org/model", dest, "--json")
    assert again.exit_code == 0, again.stdout
    assert [s for s in shards if hub.bytes_sent("org/model", s)] == [shards[-1]]
    for path in (tmp_path / "src").iterdir():
        assert (dest / path.name).read_bytes() == path.read_bytes(), path.name
