"""Remote metadata at wire latency: opening a many-shard checkpoint on the Hub or on S3 costs one
listing, the index, and one header read per shard, all shards at once (issue #30).

The model is the DeepSeek-V3 layout in small: many shards, each with a header larger than a
first read of 16 KiB, named by an index. Each server answers every request late (its
`latency`), so the reads a client makes at once overlap at the server, where they are counted:
what came in, and how many were being answered at the same time. What `inspect` and `verify`
report is judged against the same checkpoint inspected on local disk.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import save_file

from .conftest import run_ckpt, run_ckpt_process
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .latency_proxy import proxied
from .s3_fixtures import S3Server, upload_folder

SHARDS = 12
#: tensors per shard: their names make a header of about 24 KiB, longer than a first read
PER_SHARD = 300


def _deepseek_like(folder: Path) -> dict[str, int]:
    """Shards of many small tensors (and one of 64 KiB), an index naming them; returns each
    shard's header length."""
    import numpy as np

    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    lengths: dict[str, int] = {}
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors: dict[str, Any] = {
            f"model.layers.{s}.mlp.experts.{e}.down_proj.weight_scale_inv": np.full(
                (2, 2), e, dtype=np.float32
            )
            for e in range(PER_SHARD)
        }
        tensors[f"model.layers.{s}.mlp.gate.weight"] = np.zeros((128, 128), dtype=np.float32)
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
        with open(folder / name, "rb") as fh:
            lengths[name] = struct.unpack("<Q", fh.read(8))[0]
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert min(lengths.values()) > 16 << 10  # longer than a first read
    return lengths


def _same_as_local(remote: dict[str, Any], local: dict[str, Any]) -> None:
    for key in ("tensors", "parameters", "total_bytes", "dtypes", "format", "files"):
        if key in local:
            assert remote.get(key) == local[key], key


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "process"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.slow
def test_hub_reads_every_header_at_once_in_one_request_each(
    hub: TestHub, tmp_path: Path, command: str, process: bool
) -> None:
    """In the process and in a process of its own: the same requests, none twice."""
    lengths = _deepseek_like(tmp_path / "src")
    hub.add_repo("org/deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    assert local.exit_code == 0, local.stderr
    hub.latency = 0.05  # requests made at once overlap at the server
    hub.reset_counters()

    run = run_ckpt_process if process else run_ckpt
    result = run(command, "hf://org/deepseek", "--json")

    assert result.exit_code == 0, result.stderr
    if command == "inspect":
        _same_as_local(result.json["result"], local.json["result"])
        assert result.json["result"]["tensors"] == SHARDS * (PER_SHARD + 1)
    else:
        assert result.json["ok"] is True
    # the shards' header reads were made at once
    assert hub.max_in_flight > SHARDS // 2
    # per shard: the redirect, then one ranged read at the CDN holding the whole header
    for shard, length in lengths.items():
        reads = [r for r in hub.file_requests("org/deepseek", shard) if r.status == 206]
        assert len(reads) == 1, (shard, [r.range for r in reads])
        first, last = reads[0].range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
        assert int(first) == 0 and int(last) + 1 >= 8 + length
        redirects = [r for r in hub.file_requests("org/deepseek", shard) if r.status == 302]
        assert len(redirects) == 1
    # and besides them: the index, and one request for the revision's commit and its files
    # together (not a second, sequential round trip for the listing); nothing else
    files = {r.file for r in hub.file_requests("org/deepseek")}
    assert files == {f"org/deepseek:{n}" for n in [*lengths, "model.safetensors.index.json"]}
    api = [r.path for r in hub.log if "/api/models/org/deepseek" in r.path]
    assert len(api) == 1 and "blobs=" in api[0], api


def _release_when_the_others_are_read(
    monkeypatch: pytest.MonkeyPatch, gate: threading.Event, slow: str, others: set[str]
) -> list[str]:
    """Set `gate` (the server's hold on `slow`) once every one of `others` had its header's
    first read handed to a reader; returns those reads' files, in the order they were made."""
    from ckpt_cli.storage.hub import HubStorage

    handed: list[str] = []
    read = HubStorage.read

    def reading(self: HubStorage, rel: str, offset: int, length: int) -> bytes:
        data = read(self, rel, offset, length)
        if offset == 0 and rel in others | {slow}:
            handed.append(rel)
            if others <= set(handed):
                gate.set()
        return data

    monkeypatch.setattr(HubStorage, "read", reading)
    return handed


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_hub_headers_are_parsed_as_they_arrive_not_behind_a_slow_one(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """The first shard's header is slow to come: the server holds it back until every other
    shard's header was handed to the parser. They are parsed meanwhile, not after it (a
    reader in shard order would wait on it first; the server then lets it go after 30 s and
    the others are read late), and the report is the one of the same checkpoint on disk."""
    lengths = _deepseek_like(tmp_path / "src")
    hub.add_repo("org/deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    slow, *others = sorted(lengths)
    gate = hub.hold("org/deepseek", slow)
    handed = _release_when_the_others_are_read(monkeypatch, gate, slow, set(others))

    result = run_ckpt(command, "hf://org/deepseek", "--json")

    gate.set()
    assert result.exit_code == 0, result.stderr
    assert set(handed[: len(others)]) == set(others) and handed[-1] == slow, handed
    if command == "inspect":
        _same_as_local(result.json["result"], local.json["result"])
    else:
        assert result.json["ok"] is True and result.json["result"]["problems"] == []


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_flawed_headers_are_reported_in_shard_order_whatever_order_they_arrive(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Two shards with a corrupt header, the first one held back until every other header
    was read, so that it arrives last: `verify` lists both in shard order and `inspect`
    refuses with the first shard's flaw, as on disk."""
    lengths = _deepseek_like(tmp_path / "src")
    first, second = sorted(lengths)[0], sorted(lengths)[5]
    for name in (first, second):
        with open(tmp_path / "src" / name, "r+b") as fh:
            fh.seek(8)
            fh.write(b"[")  # the JSON header no longer parses
    hub.add_repo("org/broken", tmp_path / "src")
    on_disk = run_ckpt(command, tmp_path / "src", "--json")
    gate = hub.hold("org/broken", first)
    # verify reads every header; inspect stops at the first flaw in shard order, so it skips
    # the shards after `second` (whichever arrived) and must wait for `first` to know
    shards = sorted(lengths)
    read_first = shards[1:] if command == "verify" else shards[1 : shards.index(second) + 1]
    handed = _release_when_the_others_are_read(monkeypatch, gate, first, set(read_first))

    remote = run_ckpt(command, "hf://org/broken", "--json")

    gate.set()
    assert handed[-1] == first, handed  # it did arrive last
    if command == "verify":
        problems = [
            (p["code"], p["file"].rsplit("/", 1)[1]) for p in remote.json["result"]["problems"]
        ]
        assert problems[:2] == [("bad_header", first), ("bad_header", second)], problems
        assert [p["code"] for p in on_disk.json["result"]["problems"]] == [c for c, _ in problems]
    else:
        assert remote.exit_code == on_disk.exit_code == 4
        assert first in json.dumps(remote.json["error"])
        assert second not in json.dumps(remote.json["error"])


def test_a_gated_repo_opens_with_token_in_a_process_of_its_own(
    hub: TestHub, tmp_path: Path
) -> None:
    """`ckpt inspect hf://org/gated --token T` as a real process: the token reaches the first
    request; nothing was asked without it."""
    import torch

    publish_model(hub, "org/gated", tmp_path / "src", {"w": torch.zeros(2)}, token="hf_secret")
    hub.reset_counters()

    result = run_ckpt_process("inspect", "hf://org/gated", "--token", "hf_secret", "--json")

    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["tensors"] == 1
    assert all(r.status != 401 for r in hub.log), [(r.path, r.status) for r in hub.log]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_hub_asks_for_the_headers_while_the_index_is_on_its_way(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """DeepSeek-V3's index is 8 MB: fetching and parsing it takes longer than a round trip.
    The shards of the index's numbered set are in the listing already, so their headers are
    asked for at once: the server holds the index back until every header was asked for (a
    reader that waits for the index would only ask once the hold runs out), each header
    still in one request (its size guessed from the index's), and the report is the one of
    the same checkpoint on disk."""
    from ckpt_cli.storage.hub import HubStorage

    lengths = _deepseek_like(tmp_path / "src")
    hub.add_repo("org/deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    index = "model.safetensors.index.json"
    gate = hub.hold("org/deepseek", index, most=5.0)
    lock = threading.Lock()
    asked: set[str] = set()
    index_read: list[bool] = []
    asked_before_the_index: list[bool] = []
    fetch, read = HubStorage._fetch, HubStorage.read

    def fetching(self: HubStorage, rel: str, start: int, end: int) -> bytes:
        with lock:
            asked.add(rel)
            if asked >= set(lengths) and not asked_before_the_index:
                asked_before_the_index.append(not index_read)
                gate.set()
        return fetch(self, rel, start, end)

    def reading(self: HubStorage, rel: str, offset: int, length: int) -> bytes:
        data = read(self, rel, offset, length)
        if rel == index:
            index_read.append(True)
        return data

    monkeypatch.setattr(HubStorage, "_fetch", fetching)
    monkeypatch.setattr(HubStorage, "read", reading)
    result = run_ckpt(command, "hf://org/deepseek", "--json")

    gate.set()
    assert result.exit_code == 0, result.stderr
    assert asked_before_the_index == [True]
    if command == "inspect":
        _same_as_local(result.json["result"], local.json["result"])
    else:
        assert result.json["ok"] is True and result.json["result"]["problems"] == []
    for shard in lengths:
        reads = [r for r in hub.file_requests("org/deepseek", shard) if r.status == 206]
        assert len(reads) == 1, (shard, [r.range for r in reads])


@pytest.mark.slow
def test_hub_asks_for_the_headers_of_a_hundred_shards_in_one_wave(
    hub: TestHub, tmp_path: Path
) -> None:
    """A hundred shards (DeepSeek-V3 has 163): their headers are asked for together, up to
    the 100 connections huggingface_hub's client pools, not 64 at a time (3 waves of
    requests for DeepSeek-V3, a round trip or two each); no byte read twice."""
    import numpy as np

    shards = 100
    src = tmp_path / "src"
    src.mkdir()
    weight_map: dict[str, str] = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{s}.weight": np.full((2, 2), s, dtype=np.float32)}
        save_file(tensors, str(src / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    hub.add_repo("org/many", src)
    hub.latency = 0.5  # each request is answered late: the ones asked together overlap
    hub.reset_counters()

    result = run_ckpt("verify", "hf://org/many", "--json")

    assert result.exit_code == 0, result.stderr
    assert result.json["ok"] is True
    assert hub.max_in_flight > 80, hub.max_in_flight
    for n in weight_map.values():  # a small file's header: its length, then the rest, once
        reads = [r.range for r in hub.file_requests("org/many", n) if r.status == 206]
        assert reads == ["bytes=0-7", "bytes=8-79"], (n, reads)


def test_hub_without_an_index_reads_each_header_whole_in_at_most_two_requests(
    hub: TestHub, tmp_path: Path
) -> None:
    lengths = _deepseek_like(tmp_path / "src")
    (tmp_path / "src" / "model.safetensors.index.json").unlink()
    hub.add_repo("org/noindex", tmp_path / "src")
    local = run_ckpt("inspect", tmp_path / "src", "--json")
    hub.latency = 0.05
    hub.reset_counters()

    result = run_ckpt("inspect", "hf://org/noindex", "--json")

    assert result.exit_code == 0, result.stderr
    _same_as_local(result.json["result"], local.json["result"])
    assert hub.max_in_flight > SHARDS // 2
    for shard, length in lengths.items():
        reads = [r for r in hub.file_requests("org/noindex", shard) if r.status == 206]
        assert 1 <= len(reads) <= 2, (shard, [r.range for r in reads])
        ends = [int(r.range.rsplit("-", 1)[1]) for r in reads]  # type: ignore[union-attr]
        assert max(ends) + 1 >= 8 + length


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.slow
def test_s3_reads_every_header_at_once_in_one_request_each(
    s3_server: S3Server, tmp_path: Path, command: str
) -> None:
    lengths = _deepseek_like(tmp_path / "src")
    upload_folder(s3_server.endpoint, "ckpts", "deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    assert local.exit_code == 0, local.stderr
    s3_server.latency = 0.05
    s3_server.requests.clear()
    s3_server.max_in_flight = 0

    result = run_ckpt(command, "s3://ckpts/deepseek", "--json")

    assert result.exit_code == 0, result.stderr
    if command == "inspect":
        _same_as_local(result.json["result"], local.json["result"])
    else:
        assert result.json["ok"] is True
    assert s3_server.max_in_flight > SHARDS // 2
    for shard, length in lengths.items():
        gets = s3_server.object_gets(f"/deepseek/{shard}")
        assert len(gets) == 1, (shard, [g.range for g in gets])
        first, last = gets[0].range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
        assert int(first) == 0 and int(last) + 1 >= 8 + length
    # besides them: the index, and the listing (no other object is read)
    gets = [r for r in s3_server.requests if r.method == "GET"]
    objects = {r.path for r in gets if r.path.startswith("/ckpts/deepseek/")}
    assert objects == {f"/ckpts/deepseek/{n}" for n in [*lengths, "model.safetensors.index.json"]}
    # one listing tells the prefix is a folder and lists it (not a check, then a listing)
    listings = [r for r in gets if r.path.rstrip("/") == "/ckpts"]
    assert len(listings) == 1, [r.query for r in listings]


@pytest.mark.slow
def test_the_latency_proxy_adds_a_round_trip_per_request_and_per_connection(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The bench's link: through the proxy, a client reads the same bytes it reads directly."""
    _deepseek_like(tmp_path / "src")
    upload_folder(s3_server.endpoint, "ckpts", "deepseek", tmp_path / "src")
    proxy = proxied(s3_server.endpoint, 0.02)
    try:
        direct = run_ckpt("inspect", "s3://ckpts/deepseek", "--json")
        # a fresh process: fsspec and botocore read the endpoint when they are set up
        far = run_ckpt_process(
            "inspect",
            "s3://ckpts/deepseek",
            "--json",
            env={"AWS_ENDPOINT_URL": proxy.url, "FSSPEC_S3_ENDPOINT_URL": proxy.url},
        )
    finally:
        proxy.stop()
    assert far.exit_code == 0, far.stderr
    _same_as_local(far.json["result"], direct.json["result"])
    assert proxy.connections >= 1


def test_hub_tensors_download_reads_only_the_headers_the_index_names(
    hub: TestHub, tmp_path: Path
) -> None:
    """`download --filter --mode tensors` of one expert: the index says which shard holds it,
    so that shard's header is the only one read (not all twelve), then the tensor's bytes."""
    from safetensors import safe_open

    lengths = _deepseek_like(tmp_path / "src")
    hub.add_repo("org/deepseek", tmp_path / "src")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    wanted = "model.layers.7.mlp.experts.3.down_proj.weight_scale_inv"
    holder = index["weight_map"][wanted]
    hub.latency = 0.05
    hub.reset_counters()

    result = run_ckpt(
        "download", "hf://org/deepseek", tmp_path / "out", "--mode", "tensors",
        "--filter", wanted, "--no-extras", "--json",
    )  # fmt: skip

    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["tensors_selected"] == 1
    assert report["tensors_total"] == SHARDS * (PER_SHARD + 1)
    # the index, and of the shards only the one holding the tensor
    files = {r.file for r in hub.file_requests("org/deepseek")}
    assert files == {"org/deepseek:model.safetensors.index.json", f"org/deepseek:{holder}"}
    reads = [r for r in hub.file_requests("org/deepseek", holder) if r.status == 206]
    # its header in one read (sized from the index), then the tensor's 16 bytes
    assert len(reads) == 2, [r.range for r in reads]
    first, last = reads[0].range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
    assert int(first) == 0 and int(last) + 1 >= 8 + lengths[holder]
    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), framework="np") as fh:
        assert list(fh.keys()) == [wanted]
        assert (fh.get_tensor(wanted) == 3).all()


def test_hub_reads_one_after_another_share_a_connection(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range answer is read to its end, so its connection serves the next request: over a
    real link each new connection costs a handshake (a round trip, more with TLS)."""
    from ckpt_cli.storage.hub import open_hub
    from ckpt_cli.storage.uri import parse_location

    lengths = _deepseek_like(tmp_path / "src")
    hub.add_repo("org/deepseek", tmp_path / "src")
    proxy = proxied(hub.url, 0.0)
    hub.url = proxy.url  # the CDN redirects point back through the proxy
    monkeypatch.setenv("HF_ENDPOINT", proxy.url)
    try:
        storage, _ = open_hub(parse_location("hf://org/deepseek"))
        shard = sorted(lengths)[0]
        local = (tmp_path / "src" / shard).read_bytes()
        before = proxy.connections
        for start in range(0, 8 * 4096, 4096):
            assert storage.read(shard, start, 4096) == local[start : start + 4096]
        storage.close()
    finally:
        proxy.stop()
    assert storage.requests == 8
    assert proxy.connections - before == 1


#: a config declaring FP8 block quantization: what `inspect` and `verify` read after the headers
QUANTIZED_CONFIG = {
    "model_type": "deepseek_v3",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


def _config_reads_compared(command: str, remote: Any, local: Any) -> None:
    """The remote report says what the local copy's does about the config's quantization."""
    assert remote.exit_code == local.exit_code, remote.stderr
    if command == "inspect":
        assert remote.json["result"]["quantization"] is not None
        assert remote.json["result"]["quantization"] == local.json["result"]["quantization"]
    else:
        assert "quantization" in remote.json["result"]["checks"]
        assert remote.json["result"]["checks"] == local.json["result"]["checks"]
        found = [
            [(p["code"], p["tensor"]) for p in r.json["result"]["problems"]]
            for r in (remote, local)
        ]
        assert found[0] == found[1]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_hub_config_is_asked_for_while_the_checkpoint_opens(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """The config the quantization checks read once the headers are is on its way while the
    checkpoint opens, not a round trip after it: the server holds the index back until the
    config was asked for (10 s at most), and the config costs one request in all."""
    from ckpt_cli.storage.hub import HubStorage

    _deepseek_like(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(QUANTIZED_CONFIG))
    hub.add_repo("org/deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    gate = hub.hold("org/deepseek", "model.safetensors.index.json", most=10)
    timed_out = len(hub.held_too_long)
    asked: list[str] = []
    fetch = HubStorage._fetch

    def fetching(self: HubStorage, rel: str, start: int, end: int) -> bytes:
        asked.append(rel)
        if rel == "config.json":
            gate.set()
        return fetch(self, rel, start, end)

    monkeypatch.setattr(HubStorage, "_fetch", fetching)

    result = run_ckpt(command, "hf://org/deepseek", "--json")

    gate.set()
    _config_reads_compared(command, result, local)
    # asked for while the held index was on its way (its ask released the index), not a round
    # trip after the index's answer; shard headers go out beside the index, so their order
    # against the config's is the scheduler's, not ckpt's
    late = hub.held_too_long[timed_out:]
    assert "config.json" in asked and not late, (asked[:3], late)
    gets = [r for r in hub.file_requests("org/deepseek", "config.json") if r.method == "GET"]
    assert len(gets) == 1, gets


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.slow
def test_s3_config_is_asked_for_while_the_checkpoint_opens(
    s3_server: S3Server, tmp_path: Path, command: str
) -> None:
    """As on the Hub: the index's GET is held until the config's GET came in (10 s at most)."""
    _deepseek_like(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(QUANTIZED_CONFIG))
    upload_folder(s3_server.endpoint, "ckpts", "deepseek", tmp_path / "src")
    local = run_ckpt(command, tmp_path / "src", "--json")
    s3_server.requests.clear()
    s3_server.release.clear()

    # whether the config's GET came in while the index's answer was still held: what this
    # test is about (shard headers go out beside the index, so their order against the
    # config's is the scheduler's, not ckpt's)
    config_while_held: list[bool] = []

    def held(request: Any) -> bool:
        if request.method != "GET":
            return False
        if request.path.endswith("/config.json"):
            config_while_held.append(not s3_server.release.is_set())
            s3_server.release.set()
        return bool(request.path.endswith("/model.safetensors.index.json"))

    s3_server.hold = held
    timer = threading.Timer(10, s3_server.release.set)
    timer.start()
    try:
        result = run_ckpt(command, "s3://ckpts/deepseek", "--json")
    finally:
        timer.cancel()
        s3_server.hold = None
        s3_server.release.set()

    _config_reads_compared(command, result, local)
    gets = [r.path.rsplit("/", 1)[1] for r in s3_server.requests if r.method == "GET"]
    objects = [name for name in gets if "." in name]  # not the listing
    # the config asked for before the index's answer (not after it, 10 s later), once
    assert config_while_held == [True], objects
    assert objects.count("config.json") == 1, objects
