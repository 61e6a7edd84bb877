"""Checkpoints in an S3-compatible store (moto's server on 127.0.0.1, through s3fs).

Reads are proven ranged from the server's request log; writes are judged by fetching the
published objects back and opening them with the real readers, bit-exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

from .conftest import REPO, run_ckpt
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .run_fixtures import trainer_checkpoint, weights
from .s3_fixtures import (
    S3Request,
    S3Server,
    fetch_object,
    fetch_prefix,
    list_keys,
    make_bucket,
    upload_folder,
)


def _model(seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # tensors larger than the header probe, so a whole-shard read would show in the log
    state = {f"layers.{i}.weight": torch.randn(128, 128, generator=gen) for i in range(4)}
    state["embed.weight"] = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    state["positions"] = torch.arange(10, dtype=torch.int64)
    return state


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = f.get_tensor(name)
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def _dcp_load(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _shard_gets(server: S3Server, suffix: str) -> list[S3Request]:
    return [r for r in server.requests if r.method == "GET" and r.path.endswith(suffix)]


@pytest.fixture
def sharded_on_s3(tmp_path: Path, s3_server: S3Server) -> dict[str, torch.Tensor]:
    """A sharded safetensors model (Hub layout) at s3://ckpts/run/model."""
    state = _model()
    (tmp_path / "src").mkdir()
    save_torch_state_dict(state, tmp_path / "src", max_shard_size=150_000)
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1
    upload_folder(s3_server.endpoint, "ckpts", "run/model", tmp_path / "src")
    s3_server.requests.clear()
    return state


def test_inspect_and_verify_read_only_headers(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server
) -> None:
    inspected = run_ckpt("inspect", "s3://ckpts/run/model", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    assert inspected.json["result"]["tensors"] == len(sharded_on_s3)

    verified = run_ckpt("verify", "s3://ckpts/run/model", "--json")
    assert verified.exit_code == 0, verified.stderr
    assert verified.json["result"]["ok"] is True

    gets = _shard_gets(s3_server, ".safetensors")
    assert gets, "the shard headers were never read"
    assert all(r.range is not None for r in gets), "a shard was fetched whole"
    # headers only: no range reaches into the tensor data (the first 16 KiB at most)
    ends = [int(r.range.split("-")[1]) for r in gets if r.range]
    assert max(ends) < 16 << 10


@pytest.mark.slow
def test_verify_checksums_streams_remote_files(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    manifest = tmp_path / "manifest.json"
    written = run_ckpt(
        "verify", "s3://ckpts/run/model", "--write-manifest", "--manifest", manifest, "--json"
    )
    assert written.exit_code == 0, written.stderr
    assert written.json["result"]["manifest_written"] is True
    assert all(r.range is not None for r in _shard_gets(s3_server, ".safetensors"))

    checked = run_ckpt("verify", "s3://ckpts/run/model", "--checksums", "--manifest", manifest)
    assert checked.exit_code == 0, checked.stderr

    # the same manifest can also live in the store, beside the checkpoint
    remote = run_ckpt("verify", "s3://ckpts/run/model", "--write-manifest", "--json")
    assert remote.exit_code == 0, remote.stderr
    assert "run/model/ckpt-manifest.json" in "\n".join(list_keys(s3_server.endpoint, "ckpts"))
    assert run_ckpt("verify", "s3://ckpts/run/model", "--checksums").exit_code == 0

    # or anywhere else in a store
    elsewhere = "s3://ckpts/manifests/model.json"
    wrote = run_ckpt("verify", "s3://ckpts/run/model", "--write-manifest", "--manifest", elsewhere)
    assert wrote.exit_code == 0, wrote.stderr
    assert "manifests/model.json" in list_keys(s3_server.endpoint, "ckpts", "manifests/")[0]
    again = run_ckpt("verify", "s3://ckpts/run/model", "--checksums", "--manifest", elsewhere)
    assert again.exit_code == 0, again.stderr

    # a shard rewritten in the store is caught
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    shard = next(k for k in list_keys(s3_server.endpoint, "ckpts") if k.endswith(".safetensors"))
    body = bytearray(client.get_object(Bucket="ckpts", Key=shard)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket="ckpts", Key=shard, Body=bytes(body))
    bad = run_ckpt("verify", "s3://ckpts/run/model", "--checksums", "--json")
    assert bad.exit_code == 1
    codes = {p["code"] for p in bad.json["result"]["problems"]}
    assert "checksum_mismatch" in codes


@pytest.mark.slow
def test_write_manifest_never_replaces_a_shard_or_another_object_in_the_store(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.put_object(Bucket="ckpts", Key="notes.txt", Body=b"my notes, not a manifest\n")
    shard = next(k for k in list_keys(s3_server.endpoint, "ckpts") if k.endswith(".safetensors"))
    before = {k: fetch_object(s3_server.endpoint, "ckpts", k) for k in (shard, "notes.txt")}
    # a shard, spelt plainly or with an empty path part, and an object that is no manifest
    for target, problem in (
        (f"s3://ckpts/{shard}", "is a file of the checkpoint"),
        (f"s3://ckpts//{shard.replace('/', '//')}", "is a file of the checkpoint"),
        ("s3://ckpts/notes.txt", "is not a ckpt checksum manifest"),
    ):
        result = run_ckpt(
            "verify", "s3://ckpts/run/model", "--write-manifest", "--manifest", target, "--force"
        )
        assert result.exit_code == 2, (target, result.stderr)
        assert problem in result.stderr, result.stderr
    for key, body in before.items():
        assert fetch_object(s3_server.endpoint, "ckpts", key) == body, key
    fetch_prefix(s3_server.endpoint, "ckpts", "run/model", tmp_path / "back")
    _assert_same(_safetensors(tmp_path / "back"), sharded_on_s3)

    # a manifest is still replaced with --force
    manifest = "s3://ckpts/manifests/model.json"
    assert (
        run_ckpt("verify", "s3://ckpts/run/model", "--write-manifest", "-m", manifest).exit_code
        == 0
    )
    again = run_ckpt(
        "verify", "s3://ckpts/run/model", "--write-manifest", "-m", manifest, "--force"
    )
    assert again.exit_code == 0, again.stderr


def test_convert_s3_to_local_dcp_reads_one_tensor_at_a_time(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    out = tmp_path / "dcp"
    result = run_ckpt("convert", "s3://ckpts/run/model", out, "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    _assert_same(_dcp_load(out, sharded_on_s3), sharded_on_s3)
    gets = _shard_gets(s3_server, ".safetensors")
    assert gets and all(r.range is not None for r in gets), "a shard was fetched whole"
    largest = max(t.numel() * t.element_size() for t in sharded_on_s3.values())
    for r in gets:
        assert r.range is not None
        start, end = (int(x) for x in r.range.removeprefix("bytes=").split("-"))
        assert end - start + 1 <= max(largest, 16 << 10), f"{r.range} spans more than a tensor"


def test_convert_local_to_s3_publishes_marker_last(s3_server: S3Server, tmp_path: Path) -> None:
    state = _model()
    torch.save(state, tmp_path / "weights.pt")
    missing = run_ckpt("convert", tmp_path / "weights.pt", "s3://ckpts/m", "--to", "safetensors")
    assert missing.exit_code == 3  # not found, as a missing local parent folder
    assert "bucket 'ckpts' does not exist" in missing.stderr
    make_bucket(s3_server.endpoint, "ckpts")
    s3_server.requests.clear()
    result = run_ckpt(
        "convert",
        tmp_path / "weights.pt",
        "s3://ckpts/exports/model",
        "--to",
        "safetensors",
        "--max-shard-size",
        "100KB",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["dest"] == "s3://ckpts/exports/model"
    keys = list_keys(s3_server.endpoint, "ckpts")
    assert all(".ckpt-tmp-" not in k for k in keys), "the temporary prefix was left behind"
    fetched = fetch_prefix(s3_server.endpoint, "ckpts", "exports/model", tmp_path / "back")
    assert "model.safetensors.index.json" in fetched and len(fetched) > 2
    _assert_same(_safetensors(tmp_path / "back"), state)
    # the index is published into DEST after every shard
    puts = [
        r.path
        for r in s3_server.requests
        if r.method == "PUT" and "/exports/model/" in r.path and ".ckpt-tmp-" not in r.path
    ]
    assert puts[-1].endswith("model.safetensors.index.json")


@pytest.mark.slow
def test_convert_s3_to_s3_and_back_through_every_format(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    dcp_url = "s3://ckpts/conv/dcp"
    torch_url = "s3://ckpts/conv/model.pt"
    st_url = "s3://ckpts/conv/roundtrip"
    assert run_ckpt("convert", "s3://ckpts/run/model", dcp_url, "--to", "dcp").exit_code == 0
    to_torch = run_ckpt("convert", dcp_url, torch_url, "--to", "torch")
    assert to_torch.exit_code == 0, to_torch.stderr
    back = run_ckpt("convert", torch_url, st_url, "--to", "safetensors")
    assert back.exit_code == 0, back.stderr

    fetch_prefix(s3_server.endpoint, "ckpts", "conv/dcp", tmp_path / "dcp")
    _assert_same(_dcp_load(tmp_path / "dcp", sharded_on_s3), sharded_on_s3)
    import boto3

    boto3.client("s3", endpoint_url=s3_server.endpoint).download_file(
        "ckpts", "conv/model.pt", str(tmp_path / "model.pt")
    )
    _assert_same(torch.load(tmp_path / "model.pt", weights_only=True), sharded_on_s3)
    fetch_prefix(s3_server.endpoint, "ckpts", "conv/roundtrip", tmp_path / "st")
    _assert_same(_safetensors(tmp_path / "st"), sharded_on_s3)

    diff = run_ckpt("diff", "s3://ckpts/run/model", dcp_url)
    assert diff.exit_code == 0, diff.stderr

    inside = run_ckpt("convert", "s3://ckpts/run/model", "s3://ckpts/run/model/x", "--to", "dcp")
    assert inside.exit_code == 2
    assert "overlaps the source" in inside.stderr

    # the same prefix spelt with an empty path part is the same objects in the store
    for spelling in ("s3://ckpts//run/model", "s3://ckpts/run//model/"):
        over = run_ckpt(
            "convert",
            "s3://ckpts/run/model",
            spelling,
            "--to",
            "safetensors",
            "--dtype",
            "bf16",
            "--force",
        )
        assert over.exit_code == 2, (spelling, over.stderr)
        assert "overlaps the source" in over.stderr
    fetch_prefix(s3_server.endpoint, "ckpts", "run/model", tmp_path / "src-after")
    _assert_same(_safetensors(tmp_path / "src-after"), sharded_on_s3)


def test_reshard_dcp_on_s3_to_another_world_size(s3_server: S3Server, tmp_path: Path) -> None:
    state = _model()
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    upload_folder(s3_server.endpoint, "ckpts", "run/step-10", tmp_path / "src")
    s3_server.requests.clear()
    inspected = run_ckpt("inspect", "s3://ckpts/run/step-10", "--json")
    assert inspected.exit_code == 0, inspected.stderr
    assert inspected.json["result"]["tensors"] == len(state)
    assert run_ckpt("verify", "s3://ckpts/run/step-10").exit_code == 0
    # metadata only: .metadata, and at most small ranged peeks into the data files
    for r in _shard_gets(s3_server, ".distcp"):
        assert r.range is not None
        start, end = (int(x) for x in r.range.removeprefix("bytes=").split("-"))
        assert end - start < 4096, r.range
    s3_server.requests.clear()
    result = run_ckpt(
        "reshard", "s3://ckpts/run/step-10", "s3://ckpts/run/step-10-ws2", "--world-size", "2"
    )
    assert result.exit_code == 0, result.stderr
    assert all(r.range is not None for r in _shard_gets(s3_server, ".distcp"))
    fetched = fetch_prefix(s3_server.endpoint, "ckpts", "run/step-10-ws2", tmp_path / "out")
    assert ".metadata" in fetched and len([f for f in fetched if f.endswith(".distcp")]) == 2
    _assert_same(_dcp_load(tmp_path / "out", state), state)


def test_reshard_safetensors_on_s3_to_a_new_shard_size(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    dest = "s3://ckpts/run/model-70k"
    result = run_ckpt("reshard", "s3://ckpts/run/model", dest, "--max-shard-size", "70KB")
    assert result.exit_code == 0, result.stderr
    fetched = fetch_prefix(s3_server.endpoint, "ckpts", "run/model-70k", tmp_path / "out")
    assert len([f for f in fetched if f.endswith(".safetensors")]) > 3
    _assert_same(_safetensors(tmp_path / "out"), sharded_on_s3)


@pytest.mark.slow
def test_existing_destination_is_refused_without_force(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, tmp_path: Path
) -> None:
    dest = "s3://ckpts/out/dcp"
    assert run_ckpt("convert", "s3://ckpts/run/model", dest, "--to", "dcp").exit_code == 0
    before = list_keys(s3_server.endpoint, "ckpts", "out/")
    again = run_ckpt("convert", "s3://ckpts/run/model", dest, "--to", "safetensors", "--json")
    assert again.exit_code == 2
    assert again.json["error"]["code"] == "destination_exists"
    assert list_keys(s3_server.endpoint, "ckpts", "out/") == before

    forced = run_ckpt("convert", "s3://ckpts/run/model", dest, "--to", "safetensors", "--force")
    assert forced.exit_code == 0, forced.stderr
    keys = list_keys(s3_server.endpoint, "ckpts", "out/")
    assert not any(k.endswith((".metadata", ".distcp")) for k in keys), "old files survived"
    fetch_prefix(s3_server.endpoint, "ckpts", "out/dcp", tmp_path / "back")
    _assert_same(_safetensors(tmp_path / "back"), sharded_on_s3)


@pytest.mark.parametrize("stage", ["upload", "publish"])
def test_failure_mid_upload_leaves_no_committed_destination(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server, stage: str
) -> None:
    """The store refuses the commit marker: while uploading to the temporary prefix, or
    while copying into DEST after every shard is already there."""

    def refuse(request: S3Request) -> bool:
        in_tmp = ".ckpt-tmp-" in request.path
        return (
            request.method == "PUT"
            and request.path.endswith(".index.json")
            and in_tmp == (stage == "upload")
        )

    s3_server.refuse = refuse
    result = run_ckpt(
        "convert",
        "s3://ckpts/run/model",
        "s3://ckpts/failed/model",
        "--to",
        "safetensors",
        "--max-shard-size",
        "100KB",
        "--json",
    )
    s3_server.refuse = None
    assert result.exit_code == 5, result.stderr
    assert "s3://ckpts/failed/model" in result.json["error"]["message"]
    assert "cannot write to the remote store" in result.json["error"]["message"]
    # neither DEST nor the temporary prefix beside it is left
    assert list_keys(s3_server.endpoint, "ckpts", "failed/") == []


@pytest.mark.slow
def test_trainer_checkpoint_with_fsdp_dcp_folder_on_s3(s3_server: S3Server, tmp_path: Path) -> None:
    """A Trainer `checkpoint-N/` whose model is an FSDP DCP subfolder, read from the store."""
    folder = tmp_path / "checkpoint-200"
    trainer_checkpoint(folder, 200)
    (folder / "model.safetensors").unlink()
    model = weights(200)
    dcp.save({"model": model}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    upload_folder(s3_server.endpoint, "ckpts", "run/checkpoint-200", folder)
    url = "s3://ckpts/run/checkpoint-200"

    local = run_ckpt("inspect", folder, "--json").json["result"]
    remote = run_ckpt("inspect", url, "--json")
    assert remote.exit_code == 0, remote.stderr
    training = remote.json["result"]["training"]
    assert training["layout"] == "hf-trainer"
    assert training["weights"]["tensors"] == len(model)
    assert remote.json["result"]["tensors"] == local["tensors"]
    verified = run_ckpt("verify", url, "--json")
    assert verified.exit_code == 0, verified.stderr

    out = tmp_path / "weights"
    converted = run_ckpt("convert", url, out, "--to", "safetensors", "--select", "model")
    assert converted.exit_code == 0, converted.stderr
    _assert_same(_safetensors(out), model)


@pytest.mark.slow
def test_hub_to_s3_convert_and_diff(hub: TestHub, s3_server: S3Server, tmp_path: Path) -> None:
    """hf:// (huggingface_hub's own filesystem) as SRC for convert and diff, DEST in S3."""
    state = _model()
    publish_model(hub, "org/model", tmp_path / "pub", state, max_shard_size=150_000, extras=False)
    make_bucket(s3_server.endpoint, "ckpts")
    converted = run_ckpt("convert", "hf://org/model", "s3://ckpts/mirror/dcp", "--to", "dcp")
    assert converted.exit_code == 0, converted.stderr
    fetch_prefix(s3_server.endpoint, "ckpts", "mirror/dcp", tmp_path / "dcp")
    _assert_same(_dcp_load(tmp_path / "dcp", state), state)

    same = run_ckpt("diff", "hf://org/model", "s3://ckpts/mirror/dcp", "--json")
    assert same.exit_code == 0, same.stderr

    changed = dict(state)
    changed["layers.1.weight"] = state["layers.1.weight"] + 1
    publish_model(hub, "org/other", tmp_path / "pub2", changed, extras=False)
    differs = run_ckpt("diff", "hf://org/other", "s3://ckpts/mirror/dcp", "--json")
    assert differs.exit_code == 1, differs.stderr
    assert "layers.1.weight" in differs.stdout


@pytest.mark.parametrize("mode", ["shards", "tensors"])
@pytest.mark.slow
def test_download_from_the_hub_into_s3(
    hub: TestHub, s3_server: S3Server, tmp_path: Path, mode: str
) -> None:
    state = _model()
    publish_model(hub, "org/model", tmp_path / "pub", state, max_shard_size=150_000)
    make_bucket(s3_server.endpoint, "ckpts")
    dest = "s3://ckpts/hub/model"
    result = run_ckpt(
        "download", "hf://org/model", dest, "--mode", mode, "--filter", "layers.*", "--json"
    )
    assert result.exit_code == 0, result.stderr
    fetched = fetch_prefix(s3_server.endpoint, "ckpts", "hub/model", tmp_path / "back")
    assert "model.safetensors.index.json" in fetched
    assert all(".ckpt-tmp-" not in k for k in list_keys(s3_server.endpoint, "ckpts"))
    got = _safetensors(tmp_path / "back")
    # shards mode fetches whole shards, so a shard's other tensors come along
    want = {k: v for k, v in state.items() if k.startswith("layers.") or mode == "shards"}
    _assert_same(got, {k: v for k, v in want.items() if k in got or k.startswith("layers.")})
    again = run_ckpt("download", "hf://org/model", dest, "--mode", mode)
    assert again.exit_code == 2


def test_any_fsspec_filesystem_and_refused_destinations(tmp_path: Path) -> None:
    """Not only S3: fsspec's in-memory filesystem as DEST and SRC; the Hub is never a DEST."""
    import fsspec

    state = _model()
    torch.save(state, tmp_path / "w.pt")
    result = run_ckpt("convert", tmp_path / "w.pt", "memory://store/out", "--to", "safetensors")
    assert result.exit_code == 0, result.stderr
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.find("/store") if ".ckpt-tmp-" in p]
    fs.get("/store/out/model.safetensors", str(tmp_path / "back.safetensors"))
    with safe_open(tmp_path / "back.safetensors", framework="pt") as f:
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, state)  # noqa: SIM118
    assert run_ckpt("diff", "memory://store/out", tmp_path / "w.pt").exit_code == 0

    to_hub = run_ckpt("convert", tmp_path / "w.pt", "hf://org/model", "--to", "safetensors")
    assert to_hub.exit_code == 2
    assert "hf upload" in to_hub.stderr
    fs.rm("/store", recursive=True)


def test_file_urls_read_and_write_like_local_paths(tmp_path: Path) -> None:
    """`file://` SRC and DEST: fsspec's local filesystem, published like any other."""
    state = _model()
    torch.save(state, tmp_path / "w.pt")
    url = f"file://{tmp_path}"
    result = run_ckpt("convert", f"{url}/w.pt", f"{url}/out", "--to", "safetensors")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "w.pt"]
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, state)  # noqa: SIM118
    assert run_ckpt("verify", f"{url}/out").exit_code == 0
    again = run_ckpt("convert", f"{url}/w.pt", f"{url}/out", "--to", "safetensors")
    assert again.exit_code == 2, again.stderr


@pytest.mark.slow
def test_sequential_reads_are_served_by_the_read_ahead(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data reads fetch the next window in the background; every byte still comes out right."""

    import s3fs

    from ckpt_cli.storage import FsspecStorage

    payload = os.urandom(300_000)
    (tmp_path / "blob").mkdir()
    (tmp_path / "blob" / "data.bin").write_bytes(payload)
    upload_folder(s3_server.endpoint, "ckpts", "blob", tmp_path / "blob")
    storage = FsspecStorage(s3fs.S3FileSystem(), "ckpts/blob", "s3://ckpts/blob")
    storage.readahead_min, storage.readahead = 1000, 50_000
    s3_server.requests.clear()
    pieces = [(0, 20_000), (20_000, 30_000), (50_000, 70_000), (120_000, 5), (120_005, 100_000)]
    pieces += [(10, 4000), (4010, 90_000), (299_000, 1000)]  # a jump back, then to the end
    for offset, length in pieces:
        assert storage.read("data.bin", offset, length) == payload[offset : offset + length]
    storage.close()  # the last read-ahead, dropped by the jump to the end, may still be in flight
    ranges = {r.range for r in _shard_gets(s3_server, "data.bin")}
    # the second read made a run: a window ahead served the next reads, in part or whole
    assert "bytes=50000-99999" in ranges
    assert not {"bytes=50000-119999", "bytes=120000-120004", "bytes=120005-220004"} & ranges

    # a header probe and the rest of a long header: no data fetched ahead
    s3_server.requests.clear()
    fresh = FsspecStorage(s3fs.S3FileSystem(), "ckpts/blob", "s3://ckpts/blob")
    fresh.readahead_min, fresh.readahead = 1000, 50_000
    assert fresh.read("data.bin", 0, 800) + fresh.read("data.bin", 800, 60_000) == payload[:60_800]
    ranges = {r.range for r in _shard_gets(s3_server, "data.bin")}
    assert ranges == {"bytes=0-799", "bytes=800-60799"}

    # the whole pipeline with a tiny read-ahead: converted bit-exact
    monkeypatch.setattr(FsspecStorage, "readahead_min", 1)
    monkeypatch.setattr(FsspecStorage, "readahead", 40_000)
    state = _model()
    (tmp_path / "src").mkdir()
    save_torch_state_dict(state, tmp_path / "src", max_shard_size=150_000)
    upload_folder(s3_server.endpoint, "ckpts", "model", tmp_path / "src")
    result = run_ckpt("convert", "s3://ckpts/model", tmp_path / "dcp", "--to", "dcp")
    assert result.exit_code == 0, result.stderr
    _assert_same(_dcp_load(tmp_path / "dcp", state), state)
    checked = run_ckpt(
        "verify", "s3://ckpts/model", "--write-manifest", "--manifest", tmp_path / "m"
    )
    assert checked.exit_code == 0, checked.stderr
    (tmp_path / "local").mkdir()
    local = run_ckpt("verify", tmp_path / "src", "--checksums", "--manifest", tmp_path / "m")
    assert local.exit_code == 0, local.stderr  # the remote digests match the local files


def _convert_until_held(
    s3_server: S3Server, held: Callable[[S3Request], bool], *args: str | Path
) -> subprocess.Popen[str]:
    """`ckpt convert ARGS…` started as a real process; returns once the store holds the
    request `held` picks (it stays held until `s3_server.release` is set)."""
    s3_server.hold = held
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "convert", *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not any(held(r) for r in list(s3_server.requests)):
        if proc.poll() is not None or time.monotonic() > deadline:
            s3_server.release.set()
            proc.kill()
            raise AssertionError(f"the held request never came: {proc.communicate()}")
        time.sleep(0.05)
    return proc


def _interrupted_convert(s3_server: S3Server, held: Callable[[S3Request], bool]) -> str:
    """`ckpt convert s3://ckpts/run/model s3://ckpts/int/model`, a real process, sent SIGINT
    while the store holds a request `held` picks; returns its stderr (after exit 130)."""
    args = ["s3://ckpts/run/model", "s3://ckpts/int/model", "--to", "safetensors"]
    proc = _convert_until_held(s3_server, held, *args, "--max-shard-size", "100KB")
    try:
        proc.send_signal(signal.SIGINT)
        # the run waits for its requests in flight before it cleans up: let the held one be
        # answered once the signal has had time to land (landing later only moves the
        # interruption to a later step, which must leave nothing either)
        time.sleep(1)
    finally:
        s3_server.release.set()
        s3_server.hold = None
    _, stderr = proc.communicate(timeout=120)
    s3_server.wait_idle()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    return stderr


@pytest.mark.slow
def test_ctrl_c_during_the_upload_removes_everything(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server
) -> None:
    """A real process interrupted while its shards are on the way: exit 130, nothing left."""

    # the shards' uploads, not the run's lease (a lease PUT in flight when Ctrl-C comes has a
    # test of its own, below): this test interrupts the data upload itself
    def shard_upload(r: S3Request) -> bool:
        return r.method == "PUT" and ".ckpt-tmp-" in r.path and r.path.endswith(".safetensors")

    _interrupted_convert(s3_server, shard_upload)
    assert list_keys(s3_server.endpoint, "ckpts", "int/") == []


@pytest.mark.slow
def test_ctrl_c_while_the_output_is_being_published_removes_what_was_published(
    sharded_on_s3: dict[str, torch.Tensor], s3_server: S3Server
) -> None:
    """Interrupted while the uploaded shards are being copied into DEST (an object store has
    no rename): the copies already made are removed too, not left as a DEST without its
    index."""

    def copy_into_place(r: S3Request) -> bool:
        return r.method == "PUT" and r.path.startswith("/ckpts/int/model/")

    _interrupted_convert(s3_server, copy_into_place)
    assert list_keys(s3_server.endpoint, "ckpts", "int/") == []


@pytest.mark.slow
def test_a_signal_while_an_upload_worker_starts_still_waits_for_its_upload(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C that lands while the upload pool starts a worker thread (seen once in CI, under
    load): the pool had started the thread but not yet counted it, so the cleanup did not
    wait for its upload, removed the hidden prefix, and the upload landed after that, a
    shard left in the bucket. Workers now start with the signal held; it is raised once the
    pool knows them, and the cleanup waits for what they send."""
    import threading

    from safetensors.torch import save_file

    save_file(_model(), tmp_path / "w.safetensors")
    make_bucket(s3_server.endpoint, "ckpts")
    real_start = threading.Thread.start
    interrupted = threading.Event()

    def start_then_ctrl_c(thread: threading.Thread) -> None:
        real_start(thread)
        if thread.name.startswith("ckpt-upload") and not interrupted.is_set():
            interrupted.set()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # room for the OS to hand the signal over

    # the upload that worker sends is held by the store: before the fix the run cleaned up
    # and returned while it was held; after it, the run waits for it (released in a while)
    s3_server.hold = lambda r: (
        r.method == "PUT" and ".ckpt-tmp-" in r.path and r.path.endswith(".safetensors")
    )
    releaser = threading.Timer(3, s3_server.release.set)
    monkeypatch.setattr(threading.Thread, "start", start_then_ctrl_c)
    releaser.start()
    try:
        result = run_ckpt(
            "convert",
            tmp_path / "w.safetensors",
            "s3://ckpts/int/model",
            "--to",
            "safetensors",
            "--max-shard-size",
            "100KB",
        )
    finally:
        monkeypatch.undo()
        s3_server.release.set()
        releaser.cancel()
    s3_server.hold = None
    s3_server.wait_idle()
    assert interrupted.is_set()
    assert result.exit_code == 130, result.stderr
    assert list_keys(s3_server.endpoint, "ckpts", "int/") == []


def test_trainer_checkpoint_with_fsdp_dcp_folder_on_the_hub(hub: TestHub, tmp_path: Path) -> None:
    """The same Trainer folder published to the Hub: its DCP subfolder is read as a view over the
    commit's one listing (the Hub has no folders of its own to open)."""
    folder = tmp_path / "checkpoint-200"
    trainer_checkpoint(folder, 200)
    (folder / "model.safetensors").unlink()
    model = weights(200)
    dcp.save({"model": model}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    hub.add_repo("org/run", folder)

    verified = run_ckpt("verify", "hf://org/run", "--json")
    assert verified.exit_code == 0, verified.stderr
    assert verified.json["result"]["ok"] is True

    out = tmp_path / "weights"
    converted = run_ckpt("convert", "hf://org/run", out, "--to", "safetensors", "--select", "model")
    assert converted.exit_code == 0, converted.stderr
    _assert_same(_safetensors(out), model)


# -- SIGKILL while writing to a store: the next run removes what the dead run left -----------


def _uploads(endpoint: str, bucket: str) -> list[str]:
    """The keys of the multipart uploads begun and neither completed nor aborted."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.slow
def test_the_next_run_removes_the_temporaries_of_a_sigkilled_upload(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """`ckpt convert … s3://` killed (SIGKILL) while a 24 MiB shard is going up as a multipart
    upload leaves its hidden prefix and the unfinished upload in the bucket (billed storage, for
    ever). The next run writing the same DEST finds them, removes them and says so."""

    from safetensors.torch import save_file

    state = {"big": torch.arange(6 << 20, dtype=torch.float32), "small": torch.ones(3)}
    save_file(state, tmp_path / "big.safetensors")
    make_bucket(s3_server.endpoint, "ckpts")

    def part(r: S3Request) -> bool:
        return r.method == "PUT" and "partNumber=" in r.query and ".ckpt-tmp-" in r.path

    args = [tmp_path / "big.safetensors", "s3://ckpts/exports/model", "--to", "safetensors"]
    proc = _convert_until_held(s3_server, part, *args)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        s3_server.release.set()
        s3_server.hold = None
    assert proc.returncode == -signal.SIGKILL
    s3_server.wait_idle()
    left = [k for k in list_keys(s3_server.endpoint, "ckpts") if ".ckpt-tmp-" in k]
    unfinished = _uploads(s3_server.endpoint, "ckpts")
    assert unfinished and all(".model.ckpt-tmp-" in k for k in unfinished)

    # and a server-side copy into DEST of a part-copied (> 5 GB) object, cut short the same way;
    # another output whose name merely begins with DEST's is not DEST
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.create_multipart_upload(Bucket="ckpts", Key="exports/model/model.safetensors")
    client.create_multipart_upload(Bucket="ckpts", Key="exports/model-v2/model.safetensors")
    again = run_ckpt("convert", *args)
    assert again.exit_code == 0, again.stderr
    assert "removed s3://ckpts/exports/.model.ckpt-tmp-" in again.stderr, again.stderr
    assert "that was killed" in again.stderr
    assert "aborted 2 unfinished multipart uploads" in again.stderr, again.stderr
    assert [k for k in list_keys(s3_server.endpoint, "ckpts") if ".ckpt-tmp-" in k] == []
    assert _uploads(s3_server.endpoint, "ckpts") == ["exports/model-v2/model.safetensors"]
    for key in left:  # whatever the dead run had stored is gone with its prefix
        assert key not in list_keys(s3_server.endpoint, "ckpts")
    fetch_prefix(s3_server.endpoint, "ckpts", "exports/model", tmp_path / "back")
    _assert_same(_safetensors(tmp_path / "back"), state)


def test_the_temporaries_of_a_live_run_are_left_alone(s3_server: S3Server, tmp_path: Path) -> None:
    """Two runs writing the same DEST: the other one's hidden prefix and its unfinished
    multipart upload are kept, whether it runs here (its process alive) or on another machine
    (its lease renewed within the last minutes)."""
    import json

    import boto3

    from ckpt_cli.storage.object_leases import LEASE_NAME, machine_id

    torch.save(_model(), tmp_path / "w.pt")
    make_bucket(s3_server.endpoint, "ckpts")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    here = f"exports/.model.ckpt-tmp-{'a' * 12}"
    elsewhere = f"exports/.model.ckpt-tmp-{'b' * 12}"
    leases = {
        here: {"pid": os.getppid(), "machine": machine_id()},  # alive, on this machine
        elsewhere: {"pid": 1, "machine": "another-machine"},  # renewed just now
    }
    for prefix, lease in leases.items():
        client.put_object(Bucket="ckpts", Key=f"{prefix}/{LEASE_NAME}", Body=json.dumps(lease))
        client.put_object(Bucket="ckpts", Key=f"{prefix}/model-00001.safetensors", Body=b"x")
        client.create_multipart_upload(Bucket="ckpts", Key=f"{prefix}/model-00002.safetensors")
    # a live run may be copying into DEST itself
    client.create_multipart_upload(Bucket="ckpts", Key="exports/model/model.safetensors")
    before = list_keys(s3_server.endpoint, "ckpts", "exports/.model")
    result = run_ckpt(
        "convert", tmp_path / "w.pt", "s3://ckpts/exports/model", "--to", "safetensors"
    )
    assert result.exit_code == 0, result.stderr
    assert "killed" not in result.stderr
    assert list_keys(s3_server.endpoint, "ckpts", "exports/.model") == before
    assert len(_uploads(s3_server.endpoint, "ckpts")) == 3


def test_a_lease_is_dead_once_its_process_is_gone_here_or_its_renewal_too_old() -> None:

    from ckpt_cli.storage.object_leases import LEASE_EXPIRY, machine_id, run_is_gone

    here = machine_id()
    assert here  # Linux: the boot and the pid namespace
    now = 1_000_000.0
    dead = {"pid": 2**22 + 12345, "machine": here}  # no such process
    alive = {"pid": os.getppid(), "machine": here}
    other = {"pid": os.getppid(), "machine": "another-machine"}
    assert run_is_gone(dead, now, now=now)
    assert not run_is_gone(alive, now, now=now)
    assert not run_is_gone(other, now - LEASE_EXPIRY + 60, now=now)
    assert run_is_gone(other, now - LEASE_EXPIRY - 60, now=now)
    # alive here but not renewed for that long: a reused process number, not the run
    assert run_is_gone(alive, now - LEASE_EXPIRY - 60, now=now)
    # no lease (a run of an earlier ckpt, or debris): judged by its newest object
    assert not run_is_gone(None, now - 60, now=now)
    assert run_is_gone(None, now - LEASE_EXPIRY - 60, now=now)
    assert not run_is_gone(None, None, now=now)  # nothing dated: never taken for debris


@pytest.mark.parametrize("part", [1, 2])
@pytest.mark.slow
def test_a_refused_part_aborts_its_multipart_upload(
    s3_server: S3Server, tmp_path: Path, part: int
) -> None:
    """The store refuses a part of a shard going up in parts (a policy, a quota), the first or
    the last (sent as the file is closed): the command
    fails naming DEST (exit 5), and neither an object nor the unfinished multipart upload,
    whose parts the store would bill for ever, is left in the bucket."""
    from safetensors.torch import save_file

    state = {"big": torch.arange(6 << 20, dtype=torch.float32), "small": torch.ones(3)}
    save_file(state, tmp_path / "big.safetensors")
    make_bucket(s3_server.endpoint, "ckpts")
    s3_server.refuse = lambda r: r.method == "PUT" and f"partNumber={part}" in r.query
    result = run_ckpt(
        "convert",
        tmp_path / "big.safetensors",
        "s3://ckpts/exports/model",
        "--to",
        "safetensors",
        "--json",
    )
    s3_server.refuse = None
    assert result.exit_code == 5, result.stdout + result.stderr
    assert "s3://ckpts/exports/model" in result.json["error"]["message"]
    assert list_keys(s3_server.endpoint, "ckpts") == []
    assert _uploads(s3_server.endpoint, "ckpts") == []


def test_an_object_replaced_between_listing_and_reading_is_refused_not_mixed(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A training job rewrites `model.safetensors` in the bucket while `convert` reads it:
    the header ckpt planned from (the old object) says where each tensor lies, the new
    object has them elsewhere (the same size, another layout). Its bytes are never written
    as the old tensors: each ranged read names the version listed (its ETag), and a changed
    object is a clear failure naming it (exit 5), with nothing published."""
    import threading

    import boto3
    from safetensors.torch import save_file

    old = {"a": torch.arange(8192, dtype=torch.float32), "b": torch.ones(4096)}
    new = {"a": torch.full((4096,), 7.0), "b": torch.arange(8192, dtype=torch.float32)}
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    old_bytes = (tmp_path / "old.safetensors").read_bytes()
    new_bytes = (tmp_path / "new.safetensors").read_bytes()
    assert len(old_bytes) == len(new_bytes) and old_bytes != new_bytes
    make_bucket(s3_server.endpoint, "ckpts")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    key = "ck/model.safetensors"
    client.put_object(Bucket="ckpts", Key=key, Body=old_bytes)

    def tensor_read(r: S3Request) -> bool:
        return (
            r.method == "GET"
            and r.path.endswith(key)
            and not (r.range or "").startswith("bytes=0-")
        )

    s3_server.hold = tensor_read

    def rewrite() -> None:  # the training job, while the read waits
        while not any(tensor_read(r) for r in s3_server.requests):
            time.sleep(0.02)
        s3_server.hold = None
        client.put_object(Bucket="ckpts", Key=key, Body=new_bytes)
        s3_server.release.set()

    job = threading.Thread(target=rewrite, daemon=True)
    job.start()
    dest = tmp_path / "out"
    result = run_ckpt("convert", "s3://ckpts/ck", dest, "--to", "safetensors", "--json")
    job.join(timeout=60)
    if result.exit_code == 0:  # what it wrote: the old tensors' places, the new bytes
        got = _safetensors(dest)
        assert all(torch.equal(got[n], old[n]) for n in old), {n: got[n][:4] for n in got}
    assert result.exit_code == 5, result.stdout
    error = result.json["error"]
    assert error["path"] == f"s3://ckpts/{key}" and "changed" in error["problem"], error
    assert "again" in error["fix"]
    assert not dest.exists()
    # once the job is done, the same command reads the new version whole
    again = run_ckpt("convert", "s3://ckpts/ck", dest, "--to", "safetensors")
    assert again.exit_code == 0, again.stderr
    got = _safetensors(dest)
    assert all(torch.equal(got[n], new[n]) for n in new)


@pytest.mark.slow
def test_a_trainer_save_whose_reads_the_store_refuses_is_a_store_failure_not_a_bad_save(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The bucket lists a Trainer save, then refuses every read (403: a policy that allows
    ListBucket but not GetObject). A refusal says nothing about the files: `inspect` printed
    "0 tensors" with every component "unreadable" and exit 0, and `convert` said exit 4 "Repair
    or re-save it". Each now fails exit 5 naming the file and the store's answer, as `latest`
    does, and writes nothing."""
    trainer_checkpoint(tmp_path / "save", 200)
    upload_folder(s3_server.endpoint, "ckpts", "run/checkpoint-200", tmp_path / "save")
    s3_server.refuse = lambda r: r.method == "GET" and r.range is not None
    src = "s3://ckpts/run/checkpoint-200"
    dest = tmp_path / "out"
    for args in (
        ["inspect", src],
        ["verify", src],
        ["convert", src, dest, "--to", "safetensors"],
    ):
        result = run_ckpt(*args, "--json")
        assert result.exit_code == 5, (args[0], result.stdout)
        error = result.json["error"]
        assert error["code"] == "hub" and error["path"].startswith(f"{src}/"), error
        assert "Access Denied" in error["problem"] and "credentials" in error["fix"], error
    assert not dest.exists()
    s3_server.refuse = None
    assert run_ckpt("inspect", src).exit_code == 0


def test_ctrl_c_while_the_lease_is_being_written_leaves_no_lease_behind(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Ctrl-C comes while the run's lease PUT is on its way (a slow store): the run removed its
    hidden prefix at once and exited, and the PUT, which the store had whole, landed after
    that: a `.ckpt-lease` object was left in the bucket until the next run writing that DEST
    removed it. The cleanup now waits (a few seconds at most) for the write in flight and
    removes what it left."""

    torch.save(_model(), tmp_path / "w.pt")
    make_bucket(s3_server.endpoint, "ckpts")

    def is_lease_put(r: S3Request) -> bool:
        return r.method == "PUT" and r.path.endswith("/.ckpt-lease")

    args = [tmp_path / "w.pt", "s3://ckpts/exports/model", "--to", "safetensors"]
    proc = _convert_until_held(s3_server, is_lease_put, *args)
    try:
        deadline = time.monotonic() + 120
        seen = len(s3_server.requests)
        proc.send_signal(signal.SIGINT)
        # the run's cleanup looks for its hidden prefix: only then does the held PUT land
        while not any(
            ".ckpt-tmp-" in r.path + r.query and not is_lease_put(r)
            for r in list(s3_server.requests)[seen:]
        ):
            assert proc.poll() is None or time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        s3_server.release.set()
        _, stderr = proc.communicate(timeout=120)
    finally:
        s3_server.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    s3_server.hold = None
    s3_server.wait_idle()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert list_keys(s3_server.endpoint, "ckpts", "exports/") == []


@pytest.mark.parametrize("prefix", ["exp [v2]/model", "sweep?/model", "lr*0.1/model"])
def test_a_destination_whose_key_holds_a_glob_character_publishes_each_file_once(
    s3_server: S3Server, tmp_path: Path, prefix: str
) -> None:
    """`[`, `?` and `*` are legal in S3 keys, and users put them in experiment names. fsspec's
    `copy` and `rm` read them as glob patterns: the server-side copy into DEST failed ("the
    bucket does not exist", the temporary prefix left behind) or published each file as a
    folder of itself (`model.safetensors/model.safetensors`, which nothing then reads)."""
    state = _model()
    (tmp_path / "src").mkdir()
    save_torch_state_dict(state, tmp_path / "src", max_shard_size=150_000)
    make_bucket(s3_server.endpoint, "ckpts")
    dest = f"s3://ckpts/{prefix}"
    for force in ((), ("--force",)):  # a first write, then one replacing it
        result = run_ckpt("convert", tmp_path / "src", dest, "--to", "safetensors", *force)
        assert result.exit_code == 0, result.stderr
        keys = list_keys(s3_server.endpoint, "ckpts")
        assert all(".ckpt-tmp-" not in k for k in keys), keys
        names = [k[len(prefix) + 1 :] for k in keys]
        assert "model.safetensors" in names and all("/" not in n for n in names), names
    assert run_ckpt("verify", dest).exit_code == 0
    fetch_prefix(s3_server.endpoint, "ckpts", prefix, tmp_path / "back")
    _assert_same(_safetensors(tmp_path / "back"), state)
