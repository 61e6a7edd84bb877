"""The Hub adapter: `ckpt inspect hf://…` against a real HTTP Hub on 127.0.0.1.

The manifest must come from ranged reads of the shard headers (no shard is downloaded), the
revision must resolve to one commit, and Hub failures map to exit 3 (missing) or 5 (auth).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import open_checkpoint

from .conftest import REPO, run_ckpt, run_ckpt_process
from .hub_fixtures import publish_model
from .hub_server import TestHub

SHARD_LIMIT = 200_000


def layered_state(layers: int = 6) -> dict[str, torch.Tensor]:
    """Tensors big enough (64 KiB+) that a header probe is far smaller than a shard."""
    gen = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        state[f"model.layers.{i}.mlp.weight"] = torch.randn(128, 128, generator=gen)
        state[f"model.layers.{i}.norm.weight"] = torch.randn(128, generator=gen).to(torch.bfloat16)
    state["model.embed_tokens.weight"] = torch.randn(256, 128, generator=gen)
    return state


def test_inspect_sharded_hub_repo_reads_only_header_ranges(hub: TestHub, tmp_path: Path) -> None:
    state = layered_state()
    commit = publish_model(hub, "org/tiny", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3

    result = run_ckpt("inspect", "hf://org/tiny", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["format"] == "safetensors"
    assert report["tensors"] == len(state)
    assert report["tensor_bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    by_name = {e["name"]: e for e in report["entries"]}
    for name, tensor in state.items():
        assert by_name[name]["shape"] == list(tensor.shape)
        assert by_name[name]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert by_name[name]["file"] == index["weight_map"][name]
    assert report["details"]["hub"]["repo"] == "org/tiny"
    assert report["details"]["hub"]["revision"] == "main"
    assert report["details"]["hub"]["commit"] == commit

    # every shard was read with a Range request, and far less than the shard was sent
    for shard in shards:
        size = (tmp_path / "src" / shard).stat().st_size
        gets = [r for r in hub.file_requests("org/tiny", shard) if r.method == "GET"]
        data = [r for r in gets if r.status != 302]  # LFS files redirect to the "CDN" first
        assert len(data) == 1 and data[0].range is not None and data[0].status == 206
        assert hub.bytes_sent("org/tiny", shard) < size / 2
    # and every data request named the resolved commit, not the branch
    assert all(f"/{commit}/" in r.path for r in hub.file_requests("org/tiny"))


def test_revision_tag_and_subfolder_resolve_to_a_commit(hub: TestHub, tmp_path: Path) -> None:
    old = {"w": torch.zeros(4, 4)}
    new = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    publish_model(hub, "org/evolving", tmp_path / "v1", old)
    first = hub.repos["model/org/evolving"].refs["main"]
    hub.repos["model/org/evolving"].refs["v1.0"] = first
    (tmp_path / "v2" / "unet").mkdir(parents=True)
    publish_model(hub, "org/evolving", tmp_path / "v2" / "unet", new)
    # republish with the weights in a subfolder as the new main
    hub.add_repo("org/evolving", tmp_path / "v2")

    tagged = run_ckpt("inspect", "hf://org/evolving@v1.0", "--json").json["result"]
    assert tagged["tensors"] == 1
    assert tagged["details"]["hub"]["commit"] == first
    assert tagged["details"]["hub"]["revision"] == "v1.0"
    by_commit = run_ckpt("inspect", f"hf://org/evolving@{first}", "--json").json["result"]
    assert by_commit["tensors"] == 1
    explicit = run_ckpt("inspect", f"hf://org/evolving@{first}", "--format", "hub", "--json")
    assert explicit.exit_code == 0 and explicit.json["result"]["tensors"] == 1
    sub = run_ckpt("inspect", "hf://org/evolving/unet", "--json").json["result"]
    assert sub["tensors"] == 2
    assert sub["details"]["hub"]["subfolder"] == "unet"
    dest = tmp_path / "unet-copy"
    fetched = run_ckpt("download", "hf://org/evolving/unet", dest)
    assert fetched.exit_code == 0, fetched.stderr
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (dest / "model.safetensors").read_bytes() == (
        tmp_path / "v2" / "unet" / "model.safetensors"
    ).read_bytes()
    one_file = run_ckpt("inspect", "hf://org/evolving/unet/model.safetensors", "--json")
    assert one_file.exit_code == 0, one_file.stderr
    assert one_file.json["result"]["tensors"] == 2


def test_dataset_repositories_use_their_own_urls(hub: TestHub, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = {"embeddings": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    (tmp_path / "ds").mkdir()
    save_file(state, tmp_path / "ds" / "vectors.safetensors")
    hub.add_repo("org/data", tmp_path / "ds", repo_type="dataset")
    assert run_ckpt("inspect", "hf://org/data").exit_code == 3  # not a model repository
    hub.reset_counters()
    result = run_ckpt("inspect", "hf://datasets/org/data", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["details"]["hub"]["repo_type"] == "dataset"
    dest = tmp_path / "out"
    got = run_ckpt("download", "hf://datasets/org/data", dest, "--mode", "tensors")
    assert got.exit_code == 0, got.stderr
    assert (dest / "vectors.safetensors").exists()  # a single file keeps its name
    assert all(
        r.path.startswith(("/api/datasets/", "/datasets/", "/_cdn/datasets/")) for r in hub.log
    ), [r.path for r in hub.log]


def test_read_tensor_from_hub_is_bit_exact(hub: TestHub, tmp_path: Path) -> None:
    state = layered_state(2)
    publish_model(hub, "org/exact", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    with open_checkpoint("hf://org/exact") as checkpoint:
        for name, tensor in state.items():
            got = checkpoint.read_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_missing_repo_revision_and_folder_exit_3(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/present", tmp_path / "src", {"w": torch.zeros(2)})
    missing_repo = run_ckpt("inspect", "hf://org/absent", "--json")
    assert missing_repo.exit_code == 3
    assert missing_repo.json["error"]["code"] == "not_found"
    assert "hf://org/absent" in missing_repo.stderr
    missing_rev = run_ckpt("inspect", "hf://org/present@no-such-branch")
    assert missing_rev.exit_code == 3
    assert "revision" in missing_rev.stderr
    missing_dir = run_ckpt("inspect", "hf://org/present/nowhere")
    assert missing_dir.exit_code == 3


def test_gated_repo_needs_a_token_exit_5(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/gated", tmp_path / "src", {"w": torch.zeros(2)}, token="hf_secret")
    refused = run_ckpt("inspect", "hf://org/gated", "--json")
    assert refused.exit_code == 5
    assert refused.json["error"]["code"] == "hub"
    assert "HF_TOKEN" in refused.stderr and "hf auth login" in refused.stderr
    wrong = run_ckpt("inspect", "hf://org/gated", env={"HF_TOKEN": "hf_wrong"})
    assert wrong.exit_code == 5
    allowed = run_ckpt("inspect", "hf://org/gated", "--json", env={"HF_TOKEN": "hf_secret"})
    assert allowed.exit_code == 0, allowed.stderr
    assert allowed.json["result"]["tensors"] == 1
    assert any(r.authorization == "Bearer hf_secret" for r in hub.log)
    # the token `hf auth login` saves under HF_HOME is used too
    (Path(os.environ["HF_HOME"]) / "token").write_text("hf_secret\n")
    saved = run_ckpt("inspect", "hf://org/gated")
    assert saved.exit_code == 0, saved.stderr


def test_server_errors_and_unreachable_hub_exit_5(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/flaky", tmp_path / "src", {"w": torch.zeros(2)})
    hub.fail(r"^/api/models/org/flaky", 403)
    forbidden = run_ckpt("inspect", "hf://org/flaky")
    assert forbidden.exit_code == 5
    unreachable = run_ckpt("inspect", "hf://org/flaky", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert unreachable.exit_code == 5
    assert "reached" in unreachable.stderr


@pytest.fixture
def _short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the waits between tries are the Hub's business (Retry-After) or seconds of back-off;
    # a test that counts tries need not sit through them
    from ckpt_cli.storage import hub_repo

    monkeypatch.setattr(hub_repo, "RETRY_BASE_WAIT", 0.01, raising=False)


@pytest.mark.usefixtures("_short_waits")
def test_a_busy_hub_is_asked_again_as_huggingface_hub_asks_it(hub: TestHub, tmp_path: Path) -> None:
    """The Hub answers a burst of requests with 429 (rate limit, with Retry-After) or 503 now
    and then; huggingface_hub's own downloads ask again. So do ckpt's reads: the repository's
    listing, the index and the shard headers each fail once or twice, and `inspect` and
    `verify --deep` read the checkpoint all the same."""
    state = layered_state()
    publish_model(hub, "org/busy", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    shard = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))[0]

    def busy() -> None:
        hub.fail(r"^/api/models/org/busy", 503, times=2)
        hub.fail(r"index\.json$", 429, times=1, headers={"Retry-After": "0"})
        hub.fail(rf"/{shard}$", 500, times=2)

    busy()
    inspected = run_ckpt("inspect", "hf://org/busy", "--json")
    assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
    assert inspected.json["result"]["tensors"] == len(state)
    busy()
    verified = run_ckpt("verify", "hf://org/busy", "--deep", "--json")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    assert verified.json["result"]["tensors"] == len(state)
    assert "deep" in verified.json["result"]["checks"]


@pytest.mark.usefixtures("_short_waits")
def test_a_hub_that_stays_busy_fails_after_a_bounded_number_of_tries(
    hub: TestHub, tmp_path: Path
) -> None:
    from ckpt_cli.storage.hub_repo import HUB_RETRIES

    publish_model(hub, "org/down", tmp_path / "src", layered_state(), max_shard_size=SHARD_LIMIT)
    hub.fail(r"index\.json$", 503, times=1000)
    result = run_ckpt("inspect", "hf://org/down", "--json")
    assert result.exit_code == 5, result.stdout
    error = result.json["error"]
    assert error["path"].endswith("model.safetensors.index.json")
    assert "HTTP 503" in error["problem"] and error["fix"]
    asked = [r for r in hub.log if r.path.endswith("index.json") and r.status == 503]
    assert len(asked) == HUB_RETRIES + 1


@pytest.mark.usefixtures("_short_waits")
@pytest.mark.slow
def test_a_connection_reset_on_an_api_call_is_asked_again_as_reads_are(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy or the network resets the connection of the repository's info request, or of
    its tree listing (a mirror whose info names the files alone), once or twice: the command
    asks again, as it does for a file read cut midway, and reads the checkpoint all the same.
    A connection that keeps breaking fails after the same bounded number of tries, exit 5,
    naming the repository, what happened and what to do."""
    from ckpt_cli.storage import hub_repo

    monkeypatch.setattr(hub_repo, "BROKEN_BASE_WAIT", 0.01, raising=False)
    state = layered_state()
    publish_model(hub, "org/reset", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)

    hub.reset(r"^/api/models/org/reset", times=2)
    inspected = run_ckpt("inspect", "hf://org/reset", "--json")
    assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
    assert inspected.json["result"]["tensors"] == len(state)

    hub.info_blobs = False  # the listing comes from the tree endpoint
    hub.reset(r"^/api/models/org/reset/tree/", times=2)
    verified = run_ckpt("verify", "hf://org/reset", "--json")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    assert [r.path for r in hub.log if "/tree/" in r.path and r.status == 0][:2]

    hub.reset_counters()
    hub.reset(r"^/api/models/org/reset", times=1000)
    broken = run_ckpt("inspect", "hf://org/reset", "--json")
    assert broken.exit_code == 5, broken.stdout
    error = broken.json["error"]
    assert error["code"] == "hub" and error["path"] == "hf://org/reset"
    assert "kept breaking" in error["problem"] and "network" in error["fix"]
    tries = [r for r in hub.log if r.path.startswith("/api/models/org/reset")]
    assert len(tries) == hub_repo.READ_RETRIES + 1


@pytest.mark.parametrize(
    "asked",
    [{"Retry-After": "3600"}, {"RateLimit": '"api";r=0;t=3600'}],
    ids=["retry-after", "ratelimit"],
)
def test_a_rate_limit_that_asks_for_a_long_wait_is_reported_at_once(
    hub: TestHub, tmp_path: Path, asked: dict[str, str]
) -> None:
    """A 429 that asks to wait an hour (a `Retry-After`, or the Hub's `RateLimit` header with
    its quota spent) is not waited for (a command must not sit for as long as a server likes):
    exit 5 at once, saying how long the Hub asked to wait."""
    publish_model(hub, "org/limited", tmp_path / "src", {"w": torch.zeros(4, 4)})
    hub.fail(r"^/api/models/org/limited", 429, times=1000, headers=asked)
    result = run_ckpt("inspect", "hf://org/limited", "--json")
    assert result.exit_code == 5, result.stdout
    error = result.json["error"]
    assert "HTTP 429" in error["problem"] and "3600 s" in error["problem"], error
    assert "HF_TOKEN" in error["fix"]
    assert len([r for r in hub.log if r.path.startswith("/api/models/org/limited")]) == 1


def test_an_expired_token_is_named_as_the_problem_not_the_repository(
    hub: TestHub, tmp_path: Path
) -> None:
    """The Hub answers every request that sends a revoked or expired token with 401 "Invalid
    credentials", public repositories included. The fix is a new token (or none), not the
    terms of a gated repository; the token itself never appears in the message."""
    publish_model(hub, "org/public", tmp_path / "src", {"w": torch.zeros(4, 4)})
    hub.revoked_tokens.add("hf_expired")
    for args in (["inspect", "hf://org/public"], ["download", "hf://org/public", tmp_path / "d"]):
        result = run_ckpt(*args, "--json", env={"HF_TOKEN": "hf_expired"})
        assert result.exit_code == 5, result.stdout
        error = result.json["error"]
        assert "HTTP 401" in error["problem"] and "token" in error["problem"], error
        assert "HF_TOKEN" in error["fix"] and "gated" not in error["fix"], error
        assert "hf_expired" not in result.stdout + result.stderr
    assert not (tmp_path / "d").exists()
    assert run_ckpt("inspect", "hf://org/public", env={"HF_TOKEN": ""}).exit_code == 0


@pytest.mark.slow
def test_a_hub_server_that_stops_answering_fails_the_read_instead_of_hanging(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection on which the server stops sending (no byte for HF_HUB_DOWNLOAD_TIMEOUT
    seconds) is a failed read: retried, then reported naming the file (exit 5), never waited
    on for as long as the server likes. Here it holds the shard's bytes back for 30 s."""
    from ckpt_cli.storage import hub as hub_storage

    publish_model(hub, "org/stalled", tmp_path / "src", {"w": torch.zeros(4, 4)})
    shard = next(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    gate = hub.hold("org/stalled", shard, most=30)
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")  # whole seconds, as huggingface_hub reads it
    monkeypatch.setattr(hub_storage, "READ_RETRIES", 1)
    try:
        stalled = run_ckpt("inspect", "hf://org/stalled", "--json")
    finally:
        gate.set()

    assert stalled.exit_code == 5, stalled.stderr
    assert stalled.json["error"]["code"] == "hub"
    assert shard in stalled.stderr and "kept failing" in stalled.stderr
    # the same command once the server answers again
    assert run_ckpt("inspect", "hf://org/stalled", "--json").exit_code == 0


def test_a_timeout_huggingface_hub_cannot_read_is_a_usage_error_naming_it(
    hub: TestHub, tmp_path: Path
) -> None:
    """huggingface_hub fails to import when HF_HUB_DOWNLOAD_TIMEOUT is not a whole number: in a
    process of its own (nothing imported yet) that is exit 2 naming the variable, in one
    envelope with --json, not an internal error."""
    publish_model(hub, "org/timeouts", tmp_path / "src", {"w": torch.zeros(2)})
    for value in ("0.5", "soon"):
        wrong = run_ckpt_process(
            "inspect", "hf://org/timeouts", "--json", env={"HF_HUB_DOWNLOAD_TIMEOUT": value}
        )
        assert wrong.exit_code == 2, wrong.stderr
        error = json.loads(wrong.stdout)["error"]
        assert error["code"] == "usage" and "HF_HUB_DOWNLOAD_TIMEOUT" in error["message"], error
    whole = run_ckpt_process("inspect", "hf://org/timeouts", env={"HF_HUB_DOWNLOAD_TIMEOUT": "30"})
    assert whole.exit_code == 0, whole.stderr


def test_offline_mode_reads_the_local_cache(hub: TestHub, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    state = layered_state(1)
    publish_model(hub, "org/cached", tmp_path / "src", state)
    snapshot_download(
        "org/cached", endpoint=hub.url, cache_dir=str(Path(os.environ["HF_HOME"]) / "hub")
    )
    hub.reset_counters()
    offline = run_ckpt("inspect", "hf://org/cached", "--json", env={"HF_HUB_OFFLINE": "1"})
    assert offline.exit_code == 0, offline.stderr
    assert offline.json["result"]["tensors"] == len(state)
    assert hub.log == []  # nothing asked of the Hub
    # online, files already in the cache are read from disk, not fetched again
    online = run_ckpt("inspect", "hf://org/cached", "--json")
    assert online.exit_code == 0
    assert hub.bytes_sent("org/cached") == 0
    missing = run_ckpt("inspect", "hf://org/never", env={"HF_HUB_OFFLINE": "1"})
    assert missing.exit_code == 5


def test_offline_checksums_hash_the_cached_blobs_against_their_addresses(
    hub: TestHub, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    publish_model(hub, "org/rot", tmp_path / "src", layered_state(1))
    cache = Path(os.environ["HF_HOME"]) / "hub"
    snapshot_download("org/rot", endpoint=hub.url, cache_dir=str(cache))
    offline = {"HF_HUB_OFFLINE": "1"}
    clean = run_ckpt("verify", "hf://org/rot", "--checksums", "--json", env=offline)
    assert clean.exit_code == 0, clean.stdout
    assert "checksums" in clean.json["result"]["checks"]
    blobs = sorted((cache / "models--org--rot" / "blobs").iterdir(), key=lambda b: b.stat().st_size)
    shard = blobs[-1]  # the weights: bit rot in the last byte of tensor data
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    rotten = run_ckpt("verify", "hf://org/rot", "--checksums", "--json", env=offline)
    assert rotten.exit_code == 1, rotten.stdout
    result = rotten.json["result"]
    assert [p["code"] for p in result["problems"]] == ["checksum_mismatch"]
    assert result["hashed_bytes"] >= len(data)


def test_one_request_names_the_commit_and_lists_it_and_a_mirror_without_sizes_is_listed(
    hub: TestHub, tmp_path: Path
) -> None:
    state = layered_state(1)
    publish_model(hub, "org/listed", tmp_path / "src", state)
    for blobs in (True, False):  # the Hub; a mirror whose repo info names the files alone
        hub.info_blobs = blobs
        hub.reset_counters()
        result = run_ckpt("inspect", "hf://org/listed", "--json")
        assert result.exit_code == 0, result.stderr
        assert result.json["result"]["tensors"] == len(state)
        api = [r.path for r in hub.log if r.path.startswith("/api/")]
        assert len(api) == (1 if blobs else 2), api
    # the revision's commit is kept in the cache's refs/, for a later offline run
    refs = Path(os.environ["HF_HOME"]) / "hub" / "models--org--listed" / "refs" / "main"
    assert refs.read_text() == hub.repos["model/org/listed"].resolve("main")


def test_a_commit_that_is_no_commit_id_never_leads_out_of_the_cache(
    hub: TestHub, tmp_path: Path
) -> None:
    """A hostile mirror (HF_ENDPOINT) answers the commit `../../../../elsewhere`: ckpt built the
    cache's `snapshots/<commit>/` from it and kept it in `refs/`, so a later offline run read
    a folder outside the cache as the repository (and `download` died in huggingface_hub,
    exit 70). Such a commit is refused (exit 5) before any path or URL is built from it, from
    the server and from a cache's `refs/` alike."""
    state = layered_state(1)
    commit = publish_model(hub, "org/evil", tmp_path / "src", state)
    served = hub.repos["model/org/evil"]
    escape = "../../../../elsewhere"
    served.commits[escape] = served.commits.pop(commit)
    served.refs["main"] = escape
    home = Path(os.environ["HF_HOME"])
    for command in (("inspect", "hf://org/evil"), ("download", "hf://org/evil", tmp_path / "d")):
        result = run_ckpt(*command)
        assert result.exit_code == 5, result.stdout + result.stderr
        message = " ".join(result.stderr.split())
        assert "'../../../../elsewhere'" in message and "no git commit id" in message, message
    assert not (home / "hub" / "models--org--evil" / "refs").exists()
    assert not (tmp_path / "d").exists()
    # a cache whose refs/ names a folder outside it (another tool, a damaged cache) offline
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(
        (tmp_path / "src" / "model.safetensors").read_bytes()
    )
    refs = home / "hub" / "models--org--evil" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(os.path.relpath(elsewhere, refs.parent / "snapshots"))
    (refs.parent / "snapshots").mkdir()
    offline = run_ckpt("inspect", "hf://org/evil", env={"HF_HUB_OFFLINE": "1"})
    assert offline.exit_code == 5, offline.stdout + offline.stderr
    assert "the local cache's refs/" in " ".join(offline.stderr.split())


def test_hub_inspect_does_not_import_torch(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/light", tmp_path / "src", layered_state(1))
    probe = (
        "import sys\nfrom ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', code, file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", probe, "inspect", "hf://org/light", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "NO_TORCH 0" in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["result"]["tensors"] == 3


@pytest.mark.slow
def test_refusals_to_write_the_hub_name_hf_commands_that_exist(
    hub: TestHub, tmp_path: Path
) -> None:
    # writing to the Hub is a commit, which ckpt leaves to huggingface_hub's CLI: the command
    # each fix names must be one the installed huggingface_hub has (`huggingface-cli` is gone
    # since huggingface_hub 1.0; `hf` is there from 0.34, the oldest version ckpt supports)
    import re
    import shutil

    publish_model(hub, "org/run", tmp_path / "src", {"w": torch.zeros(4)}, extras=False)
    (tmp_path / "run" / "checkpoint-1").mkdir(parents=True)
    refusals = [
        run_ckpt("convert", tmp_path / "src", "hf://org/other", "--to", "safetensors", "--json"),
        run_ckpt("sync", tmp_path / "run", "hf://org/run", "--json"),
        run_ckpt("prune", "hf://org/run", "--keep-last", "1", "--yes", "--json"),
    ]
    hf = shutil.which("hf") or str(Path(sys.executable).with_name("hf"))
    for result in refusals:
        assert result.exit_code == 2, result.stdout
        fix = result.json["error"]["fix"]
        assert "huggingface-cli" not in fix
        named = re.search(r"`hf ([a-z-]+(?: [a-z-]+)?)", fix)
        assert named is not None, fix
        words = named.group(1).split()
        help_run = subprocess.run([hf, *words, "--help"], capture_output=True, text=True)
        assert help_run.returncode == 0, f"`hf {' '.join(words)}` does not exist: {fix}"


@pytest.mark.usefixtures("_short_waits")
def test_a_shard_that_keeps_failing_is_asked_a_bounded_number_of_times_not_twice_that(
    hub: TestHub, tmp_path: Path
) -> None:
    """A shard whose every read answers 500: its header, fetched ahead with its siblings', fails
    after the Hub's bounded tries, and `inspect` reports that failure. It does not ask the same
    bounded number of times again when the reader comes to the shard."""
    from ckpt_cli.storage.hub_repo import HUB_RETRIES

    publish_model(hub, "org/bad", tmp_path / "src", layered_state(), max_shard_size=SHARD_LIMIT)
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    assert len(shards) > 1
    hub.fail(rf"/{shards[1]}$", 500, times=1000)
    result = run_ckpt("inspect", "hf://org/bad", "--json")
    assert result.exit_code == 5, result.stdout
    error = result.json["error"]
    assert error["path"].endswith(shards[1]) and "HTTP 500" in error["problem"]
    asked = [r for r in hub.log if r.path.endswith(shards[1]) and r.status == 500]
    assert len(asked) == HUB_RETRIES + 1
