"""Checkpoints in an object store: inspect reads headers with ranged GETs only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from .conftest import run_ckpt
from .s3_fixtures import S3Request, S3Server, upload_folder


def _model() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(4)}


def test_inspect_s3_sharded_checkpoint_reads_only_headers(
    tmp_path: Path, s3_server: S3Server
) -> None:
    state = _model()
    (tmp_path / "model").mkdir()
    save_torch_state_dict(state, tmp_path / "model", max_shard_size=40_000)
    upload_folder(s3_server.endpoint, "ckpts", "run1/model", tmp_path / "model")
    s3_server.requests.clear()

    result = run_ckpt("inspect", "s3://ckpts/run1/model", "--json")
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["tensors"] == 4
    assert report["tensor_bytes"] == 4 * 64 * 64 * 4
    shard_gets = [
        r for r in s3_server.requests if r.method == "GET" and r.path.endswith(".safetensors")
    ]
    assert shard_gets, "the shard headers were not read"
    assert all(r.range is not None for r in shard_gets), "a shard was fetched whole"


def test_missing_s3_prefix_is_exit_3(s3_server: S3Server, tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    save_torch_state_dict(_model(), tmp_path / "m")
    upload_folder(s3_server.endpoint, "ckpts", "exists", tmp_path / "m")
    result = run_ckpt("inspect", "s3://ckpts/does-not-exist")
    assert result.exit_code == 3
    assert "s3://ckpts/does-not-exist" in result.stderr


def test_unreachable_store_is_exit_5(monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(key, value)
    result = run_ckpt("inspect", "s3://nowhere/ckpt", "--json")
    s3fs.S3FileSystem.clear_instance_cache()
    assert result.exit_code == 5, result.stderr
    assert result.json["error"]["code"] == "hub"


@pytest.mark.parametrize("command", ["inspect", "verify", "latest"])
@pytest.mark.slow
def test_a_missing_bucket_is_exit_3_and_named(
    s3_server: S3Server, tmp_path: Path, command: str
) -> None:
    (tmp_path / "m").mkdir()
    save_torch_state_dict(_model(), tmp_path / "m")
    upload_folder(s3_server.endpoint, "ckpts", "exists", tmp_path / "m")
    result = run_ckpt(command, "s3://no-such-bucket/exists", "--json")
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert "bucket 'no-such-bucket' does not exist" in error["problem"] and error["fix"]
    # a missing prefix in a bucket that exists is still said to be one
    prefix = run_ckpt(command, "s3://ckpts/nothing-here", "--json").json["error"]
    assert prefix["problem"] == "no such object or prefix" and prefix["fix"]


@pytest.mark.slow
def test_a_store_that_stops_answering_fails_with_the_timeouts_the_docs_name(
    tmp_path: Path,
) -> None:
    # a server that accepts connections and never answers: with the settings
    # docs/object-stores.md suggests, ckpt gives up (exit 5, naming the URL) instead of waiting
    # out botocore's defaults; the subprocess timeout only guards against a hang
    import json
    import socket
    import threading

    from .conftest import run_ckpt_process

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        result = run_ckpt_process(
            "inspect",
            "s3://ckpts/run1/model",
            "--json",
            env={
                "AWS_ENDPOINT_URL": endpoint,
                "FSSPEC_S3_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "x",
                "AWS_SECRET_ACCESS_KEY": "x",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_MAX_ATTEMPTS": "1",
                "FSSPEC_S3_CONFIG_KWARGS": json.dumps({"connect_timeout": 1, "read_timeout": 1}),
            },
            timeout=240,
        )
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert result.exit_code == 5, result.stderr
    error = result.json["error"]
    assert error["path"] == "s3://ckpts/run1/model" and "timeout" in error["problem"].lower()


def test_a_shard_deleted_while_it_is_read_is_named_with_a_fix(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # another job (a prune of the bucket) deletes a shard after ckpt listed the prefix
    import threading

    import boto3

    (tmp_path / "model").mkdir()
    save_torch_state_dict(_model(), tmp_path / "model", max_shard_size=40_000)
    upload_folder(s3_server.endpoint, "ckpts", "run1/model", tmp_path / "model")
    shard = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))[1]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    asked = threading.Event()

    def held(request: S3Request) -> bool:
        if request.method == "GET" and request.path.endswith(shard):
            asked.set()
            return True
        return False

    def prune_meanwhile() -> None:
        assert asked.wait(timeout=120)
        client.delete_object(Bucket="ckpts", Key=f"run1/model/{shard}")
        s3_server.hold = None
        s3_server.release.set()

    s3_server.hold = held
    pruner = threading.Thread(target=prune_meanwhile)
    pruner.start()
    dest = tmp_path / "out"
    result = run_ckpt("convert", "s3://ckpts/run1/model", dest, "--to", "dcp", "--json")
    pruner.join()
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert error["path"] == f"s3://ckpts/run1/model/{shard}" and error["fix"]
    assert not dest.exists()
