"""The write side of the storage protocol, told the same story on a local folder and in S3.

One test body runs against both writable storages: a checkpoint written by the real writer is
published into the storage file by file (`put`, `write_file`), copied, replaced and removed,
and is then judged by `ckpt verify` and the real reader through a fresh storage of the same
location; nothing of ckpt's staging is left behind. The S3 store is moto's server on 127.0.0.1
(see `s3_fixtures`). The Hub is declared not writable, and protect refuses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.errors import UsageError
from ckpt_cli.formats import resolve_source
from ckpt_cli.formats.names import is_commit_marker
from ckpt_cli.storage import Storage
from ckpt_cli.storage.output import staged_output

from .conftest import run_ckpt
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .s3_fixtures import S3Server, fetch_prefix, list_keys, make_bucket


@dataclass
class Place:
    """Where a checkpoint is written: its URL (or path), and every name stored there."""

    url: str
    #: every file or key under the location, staging included (listed without ckpt)
    stored: Callable[[], list[str]]

    def storage(self) -> Storage:
        """A fresh storage of the location, opened the way every command opens one."""
        return resolve_source(self.url).storage


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    """An empty-but-existing checkpoint location: a folder, or a prefix holding one object
    (an object store has no empty folders)."""
    if request.param == "local":
        root = tmp_path / "ckpt"
        root.mkdir()
        (root / "README.md").write_text("a checkpoint\n")

        def local_names() -> list[str]:
            return sorted(
                os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                for d, _dirs, files in os.walk(root)
                for f in files
            )

        yield Place(str(root), local_names)
        return
    server: S3Server = request.getfixturevalue("s3_server")
    make_bucket(server.endpoint, "ckpts")
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint).put_object(
        Bucket="ckpts", Key="run/ckpt/README.md", Body=b"a checkpoint\n"
    )

    def s3_names() -> list[str]:
        return [k.removeprefix("run/ckpt/") for k in list_keys(server.endpoint, "ckpts", "run/")]

    yield Place("s3://ckpts/run/ckpt", s3_names)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layers.0.weight": torch.randn(32, 32, generator=gen).to(torch.bfloat16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def _read_back(storage: Storage, rel: str, scratch: Path) -> dict[str, torch.Tensor]:
    """A stored safetensors file, read through the storage and opened by the real reader."""
    scratch.write_bytes(storage.read_all(rel))
    with safe_open(scratch, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_checkpoint_written_through_the_storage_reads_back_whole(
    place: Place, tmp_path: Path
) -> None:
    storage = place.storage()
    assert storage.writable
    first = tmp_path / "first.safetensors"
    save_file(_weights(1), first)

    # a local file published under a nested name, and a file streamed in pieces
    storage.put("shards/model.safetensors", first)
    config = b'{"model_type": "tiny", "hidden_size": 32}\n'
    assert storage.write_file("config.json", [config[:10], config[10:], b""]) == len(config)
    assert first.exists()  # put without move leaves the local file

    fresh = place.storage()
    assert fresh.list_files() == {
        "README.md": len(b"a checkpoint\n"),
        "config.json": len(config),
        "shards/model.safetensors": first.stat().st_size,
    }
    assert fresh.read_all("config.json") == config
    _assert_same(_read_back(fresh, "shards/model.safetensors", tmp_path / "r1"), _weights(1))
    # every file the listing holds has its modification time
    stats = fresh.stat_files()
    assert {rel: s.size for rel, s in stats.items()} == fresh.list_files()
    assert all(s.mtime is not None and s.mtime > 0 for s in stats.values())

    # replaced: the name holds the new content, whole (moved in from a local staging file)
    second = tmp_path / "second.safetensors"
    save_file(_weights(2), second)
    storage.put("shards/model.safetensors", second, move=True)
    _assert_same(
        _read_back(place.storage(), "shards/model.safetensors", tmp_path / "r2"), _weights(2)
    )

    # copied within the storage, then a folder (prefix) removed with everything in it
    storage.copy("shards/model.safetensors", "backup/model.safetensors")
    assert place.storage().read_all("backup/model.safetensors") == place.storage().read_all(
        "shards/model.safetensors"
    )
    storage.remove("backup")
    storage.remove("never-written.bin")  # a name that is not there is no error
    assert "backup/model.safetensors" not in place.storage().list_files()

    # what is stored is a checkpoint ckpt itself judges complete
    storage.remove("shards")
    storage.put("model.safetensors", first)
    result = run_ckpt("verify", place.url, "--json")
    assert result.exit_code == 0, result.stderr
    # nothing of the writes' staging is left, whatever lists the location
    assert place.stored() == ["README.md", "config.json", "model.safetensors"]


def test_an_output_staged_to_a_storage_destination_is_published_there(
    place: Place, tmp_path: Path
) -> None:
    storage = place.storage()
    dest = storage.destination("exported")
    with staged_output(dest, commit_marker=is_commit_marker) as staging:
        save_file(_weights(3), staging / "model.safetensors")
        (staging / "config.json").write_text("{}\n")
    fresh = place.storage()
    assert {"exported/model.safetensors", "exported/config.json"} <= set(fresh.list_files())
    _assert_same(_read_back(fresh, "exported/model.safetensors", tmp_path / "r"), _weights(3))
    assert not [name for name in place.stored() if ".ckpt-tmp-" in name]
    # a second output to the same destination is refused without --force
    with (
        pytest.raises(Exception, match="already exists"),
        staged_output(dest, commit_marker=is_commit_marker),
    ):
        pass


def test_an_s3_write_the_store_refuses_names_the_object_and_leaves_nothing(
    s3_server: S3Server, tmp_path: Path
) -> None:
    make_bucket(s3_server.endpoint, "ckpts")
    import boto3

    boto3.client("s3", endpoint_url=s3_server.endpoint).put_object(
        Bucket="ckpts", Key="run/ckpt/README.md", Body=b"x"
    )
    storage = resolve_source("s3://ckpts/run/ckpt").storage
    save_file(_weights(4), tmp_path / "w.safetensors")
    s3_server.refuse = lambda r: r.method == "PUT" and "model.safetensors" in r.path
    with pytest.raises(Exception, match="cannot write to the remote store") as failure:
        storage.put("model.safetensors", tmp_path / "w.safetensors")
    s3_server.refuse = None
    assert "s3://ckpts/run/ckpt/" in str(failure.value)
    assert getattr(failure.value, "exit_code", None) == 5
    assert list_keys(s3_server.endpoint, "ckpts") == ["run/ckpt/README.md"]
    assert fetch_prefix(s3_server.endpoint, "ckpts", "run/ckpt", tmp_path / "back") == ["README.md"]


def test_the_hub_is_not_writable_and_protect_says_so(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/tiny", tmp_path / "pub", _weights(5), extras=False)
    storage = resolve_source("hf://org/tiny").storage
    assert not storage.writable
    with pytest.raises(UsageError, match="cannot write to the Hub"):
        storage.write_file("model.safetensors", [b"x"])
    with pytest.raises(UsageError, match="hf upload"):
        storage.destination("out")
    result = run_ckpt("protect", "hf://org/tiny", "--json")
    assert result.exit_code == 2, result.stderr
    assert "protect and repair work on local folders and object stores" in result.stderr + str(
        result.json
    )


def test_a_failed_output_whose_staging_cannot_be_removed_says_where_it_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails for an OS reason (disk full) removes its staging folder and says so.
    When that removal fails too (seen at a tiny `ulimit -n`: the failed write still held the
    descriptors the removal needs), the message said "the partial output was removed" of a
    folder still there; it now says where the folder is and who removes it."""
    import errno
    import shutil

    from ckpt_cli.errors import IOFailure
    from ckpt_cli.storage import output

    dest = tmp_path / "out"
    kept: list[Path] = []
    # the usual case first: gone, and said so
    with (
        pytest.raises(IOFailure) as removed,
        staged_output(dest, commit_marker=is_commit_marker) as staging,
    ):
        kept.append(staging)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert "the partial output was removed" in str(removed.value)
    assert not kept[0].exists() and not dest.exists()

    # the removal fails as it does when the failed write left no descriptor to open the folder
    monkeypatch.setattr(output.shutil, "rmtree", lambda *args, **kwargs: None)
    with (
        pytest.raises(IOFailure) as left,
        staged_output(dest, commit_marker=is_commit_marker) as staging,
    ):
        kept.append(staging)
        (staging / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(left.value)
    assert "was removed" not in message, message
    assert f"is left at {kept[1]}" in message and kept[1].exists(), message
    assert not dest.exists()
    monkeypatch.undo()
    shutil.rmtree(kept[1])
