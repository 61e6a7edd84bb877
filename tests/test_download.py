"""`ckpt download`: only the shards, or only the byte ranges, that hold the selected tensors.

A real HTTP Hub on 127.0.0.1 serves repositories written by `save_torch_state_dict`; results are
read back with `safetensors.safe_open` and compared bit for bit; the server's byte counts prove
what each mode transferred.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .conftest import run_ckpt
from .hub_fixtures import CONFIG_JSON, publish_model
from .hub_server import TestHub

SHARD_LIMIT = 150_000


def model_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(128, 128, generator=gen)
    }
    for i in range(4):
        state[f"model.layers.{i}.mlp.weight"] = torch.randn(128, 128, generator=gen)
        state[f"model.layers.{i}.norm.weight"] = torch.randn(128, generator=gen).to(torch.bfloat16)
    state["lm_head.weight"] = torch.randn(128, 128, generator=gen)
    return state


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors folder, through the real reader."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = fh.get_tensor(name)
    return out


def publish(
    hub: TestHub, tmp_path: Path, repo: str = "org/model"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    state = model_state()
    publish_model(hub, repo, tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    hub.reset_counters()
    return state, index["weight_map"]


def test_shards_mode_fetches_only_the_shards_holding_the_selection(
    hub: TestHub, tmp_path: Path
) -> None:
    state, weight_map = publish(hub, tmp_path)
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3
    wanted_shard = weight_map["model.layers.1.mlp.weight"]
    dest = tmp_path / "out"
    result = run_ckpt(
        "download", "hf://org/model", dest, "--filter", "model.layers.1.mlp.*", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["tensors_selected"] == 1
    # only that shard's bytes (plus the extras) crossed the wire
    for shard in shards:
        sent = hub.bytes_sent("org/model", shard)
        size = (tmp_path / "src" / shard).stat().st_size
        if shard == wanted_shard:
            assert sent == size
        else:
            assert sent < 1024, (shard, sent)  # at most nothing; the index alone named the shard
    assert hub.bytes_sent("org/model", "config.json") == len(CONFIG_JSON)
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["config.json", "tokenizer.json", "model.safetensors.index.json", wanted_shard]
    )
    # DEST is a complete checkpoint: its index names exactly the fetched shard and its tensors
    got = read_all(dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {wanted_shard}
    assert set(index["weight_map"]) == set(got)
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name]), name
    assert all(f["verified"] for f in report["files"] if f["status"] != "rewritten")
    assert run_ckpt("inspect", dest, "--json").json["result"]["tensors"] == len(got)
    assert run_ckpt("verify", dest).exit_code == 0


@pytest.mark.parametrize("filters", [[], ["--filter", "model.layers.1.mlp.*"]], ids=["all", "some"])
def test_shards_mode_reads_the_index_from_the_hub_once(
    hub: TestHub, tmp_path: Path, filters: list[str]
) -> None:
    """The index both plans the download and goes into the HF cache (and DEST, whole or
    narrowed): it is fetched once, checked against the Hub's record, and the plan is read
    from that copy, not fetched a second time by a ranged read."""
    state, weight_map = publish(hub, tmp_path)
    index = "model.safetensors.index.json"
    dest = tmp_path / "out"
    result = run_ckpt("download", "hf://org/model", dest, *filters, "--no-extras", "--json")
    assert result.exit_code == 0, result.stderr
    reads = [r for r in hub.file_requests("org/model", index) if r.method == "GET"]
    assert len(reads) == 1 and reads[0].range is None, reads
    size = (tmp_path / "src" / index).stat().st_size
    assert hub.bytes_sent("org/model", index) == size
    report = result.json["result"]
    # every byte the Hub sent is accounted for once, and the plan named what was fetched
    assert hub.bytes_sent("org/model") == report["bytes_transferred"] + report["metadata_bytes"]
    assert report["bytes_planned"] == report["bytes_transferred"]
    entry = next(f for f in report["files"] if f["path"] == index)
    got = read_all(dest)
    if filters:
        assert entry["status"] == "rewritten"
        assert set(got) == {"model.layers.1.mlp.weight"} | {
            n for n, shard in weight_map.items() if shard == weight_map["model.layers.1.mlp.weight"]
        }
    else:
        assert entry["status"] == "fetched" and entry["verified"]
        assert (dest / index).read_bytes() == (tmp_path / "src" / index).read_bytes()
        assert got.keys() == state.keys()
    assert all(torch.equal(t, state[n]) for n, t in got.items())
    # the repository's own index is in the HF cache, where an offline run plans from it
    hub.reset_counters()
    offline = run_ckpt(
        "download", "hf://org/model", tmp_path / "offline", *filters, "--no-extras",
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert offline.exit_code == 0, offline.stderr
    assert hub.log == []


def test_shards_mode_whole_repo_is_the_source_byte_for_byte(hub: TestHub, tmp_path: Path) -> None:
    state, _ = publish(hub, tmp_path)
    dest = tmp_path / "all"
    result = run_ckpt("download", "hf://org/model", dest, "--no-extras")
    assert result.exit_code == 0, result.stderr
    for path in (tmp_path / "src").glob("*.safetensors*"):
        assert (dest / path.name).read_bytes() == path.read_bytes(), path.name
    assert not (dest / "config.json").exists()
    assert {k: v for k, v in read_all(dest).items()}.keys() == state.keys()
    # a second run is served from the HF cache: nothing is fetched again
    hub.reset_counters()
    again = run_ckpt("download", "hf://org/model", tmp_path / "again", "--json")
    assert again.exit_code == 0, again.stderr
    shard_bytes = sum(
        hub.bytes_sent("org/model", p.name) for p in (tmp_path / "src").glob("*.safetensors")
    )
    assert shard_bytes == 0
    assert {f["status"] for f in again.json["result"]["files"] if f["kind"] == "weights"} == {
        "cached"
    }
    # and the summary says where the bytes came from, not just "fetched 0 B"
    human = run_ckpt("download", "hf://org/model", tmp_path / "third", "--no-extras")
    assert human.exit_code == 0, human.stderr
    files = len(list((tmp_path / "src").glob("*.safetensors*")))  # shards and index
    assert f"in {files} files already in the HF cache" in human.stdout, human.stdout


def test_tensors_mode_fetches_only_the_selected_ranges(hub: TestHub, tmp_path: Path) -> None:
    state, _ = publish(hub, tmp_path)
    dest = tmp_path / "picked"
    globs = ["model.layers.0.*", "model.layers.3.mlp.weight", "lm_head.*"]
    args = [a for g in globs for a in ("--filter", g)]
    result = run_ckpt(
        "download", "hf://org/model", dest, "--mode", "tensors", "--no-extras", *args, "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    selected = {
        n
        for n in state
        if n.startswith("model.layers.0.") or n in ("model.layers.3.mlp.weight", "lm_head.weight")
    }
    selected_bytes = sum(state[n].numel() * state[n].element_size() for n in selected)
    assert report["tensors_selected"] == len(selected)
    assert report["selected_bytes"] == selected_bytes
    # data bytes within 1% of the selection; everything the server sent within headers of that
    assert selected_bytes <= report["bytes_transferred"] <= selected_bytes * 1.01
    total_sent = hub.bytes_sent("org/model")
    assert total_sent == report["bytes_transferred"] + report["metadata_bytes"]
    assert report["metadata_bytes"] < 0.5 * selected_bytes
    assert all(r.range is not None for r in hub.file_requests("org/model") if r.method == "GET")
    got = read_all(dest)
    assert set(got) == selected
    for name in selected:
        assert got[name].dtype == state[name].dtype and torch.equal(got[name], state[name]), name
    verify = run_ckpt("inspect", dest, "--json")
    assert verify.exit_code == 0 and verify.json["result"]["tensors"] == len(selected)
    assert run_ckpt("verify", dest).exit_code == 0


def test_tensors_mode_on_a_small_repo_fetches_the_named_header_exactly_and_no_other_data(
    hub: TestHub, tmp_path: Path
) -> None:
    # shards of a few KiB, smaller than any fixed header probe: a probe would fetch them whole
    gen = torch.Generator().manual_seed(5)
    state = {f"layers.{i}.weight": torch.randn(24, 24, generator=gen) for i in range(8)}
    publish_model(hub, "org/small", tmp_path / "src", state, max_shard_size=5_000, extras=False)
    shards = sorted((tmp_path / "src").glob("*.safetensors"))
    assert len(shards) >= 3 and all(p.stat().st_size < 16 << 10 for p in shards)
    hub.reset_counters()
    dest = tmp_path / "picked"
    result = run_ckpt(
        "download", "hf://org/small", dest, "--mode", "tensors", "--filter", "layers.5.*", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    selected = state["layers.5.weight"].numel() * 4
    assert report["selected_bytes"] == selected
    # every byte the server sent: the index, the 8-byte length and JSON header (read exactly
    # as long as that length says) of the one shard the index names for the selection, and
    # the selected tensor's data; nothing else (no other shard's header)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    holder = index["weight_map"]["layers.5.weight"]
    header = 8 + struct.unpack("<Q", (tmp_path / "src" / holder).read_bytes()[:8])[0]
    index_bytes = (tmp_path / "src" / "model.safetensors.index.json").stat().st_size
    assert hub.bytes_sent("org/small") == index_bytes + header + selected
    assert report["metadata_bytes"] == index_bytes + header
    assert {r.file for r in hub.file_requests("org/small")} == {
        "org/small:model.safetensors.index.json",
        f"org/small:{holder}",
    }
    assert report["tensors_total"] == len(state)
    with safe_open(str(next(dest.glob("*.safetensors"))), framework="pt") as fh:
        assert list(fh.keys()) == ["layers.5.weight"]
        assert torch.equal(fh.get_tensor("layers.5.weight"), state["layers.5.weight"])


def test_tensors_mode_splits_large_ranges_into_parallel_parts(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_cli.ops.download import tensors as download_ops

    state, _ = publish(hub, tmp_path)
    monkeypatch.setattr(download_ops, "PART_SIZE", 5000)  # a 64 KiB tensor takes 14 requests
    monkeypatch.setattr(download_ops, "PARTS_IN_FLIGHT", 4)
    dest = tmp_path / "parts"
    result = run_ckpt(
        "download", "hf://org/model", dest, "--mode", "tensors", "--no-extras", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    assert report["bytes_transferred"] == report["selected_bytes"]  # every tensor is contiguous
    gets = [r for r in hub.file_requests("org/model") if r.method == "GET"]
    data = [r for r in gets if r.status == 206]
    assert len(data) > report["selected_bytes"] // 5000
    # once a shard's CDN URL is known, its ranges go there directly, not through `resolve`
    redirects = [r for r in gets if r.status == 302]
    assert len(redirects) < len(data) / 4
    got = read_all(dest)
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name


def test_tensors_mode_output_is_sharded_with_an_index_when_large(
    hub: TestHub, tmp_path: Path
) -> None:
    state, _ = publish(hub, tmp_path)
    dest = tmp_path / "big"
    result = run_ckpt(
        "download", "hf://org/model", dest, "--mode", "tensors", "--filter-out", "*.norm.*"
    )
    assert result.exit_code == 0, result.stderr
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    expected = {n for n in state if ".norm." not in n}
    assert set(index["weight_map"]) == expected
    got = read_all(dest)
    assert set(got) == expected
    for name in expected:
        assert torch.equal(got[name], state[name]), name
    assert (dest / "config.json").read_bytes() == CONFIG_JSON


@pytest.mark.slow
def test_dropped_connection_mid_file_resumes(hub: TestHub, tmp_path: Path) -> None:
    state, weight_map = publish(hub, tmp_path)
    shard = weight_map["model.layers.2.mlp.weight"]
    size = (tmp_path / "src" / shard).stat().st_size
    hub.drop_after("org/model", shard, size // 3)
    dest = tmp_path / "resumed"
    result = run_ckpt("download", "hf://org/model", dest, "--filter", "model.layers.2.mlp.weight")
    assert result.exit_code == 0, result.stderr
    # huggingface_hub retried after the drop; it resumes from its last complete 10 MB block,
    # which for a shard this small is the start: the shard crossed the wire once more, no more
    gets = [
        r for r in hub.file_requests("org/model", shard) if r.method == "GET" and r.status != 302
    ]
    assert len(gets) == 2 and gets[0].sent == size // 3
    assert hub.bytes_sent("org/model", shard) == size + size // 3
    assert (dest / shard).read_bytes() == (tmp_path / "src" / shard).read_bytes()

    # the same in tensors mode (another shard: the first one is in the HF cache now): the
    # range request resumes exactly where the connection broke
    hub.reset_counters()
    other = weight_map["lm_head.weight"]
    assert other != shard
    entry_bytes = 128 * 128 * 4
    hub.drop_after("org/model", other, entry_bytes // 2)
    dest2 = tmp_path / "resumed-tensors"
    result = run_ckpt(
        "download", "hf://org/model", dest2, "--mode", "tensors", "--no-extras",
        "--filter", "lm_head.weight",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    got = read_all(dest2)
    assert torch.equal(got["lm_head.weight"], state["lm_head.weight"])
    gets = [
        r for r in hub.file_requests("org/model", other) if r.method == "GET" and r.status != 302
    ]
    assert len(gets) == 3  # header probe, broken range, resumed range
    assert gets[1].sent == entry_bytes // 2
    assert gets[2].range is not None and gets[1].range is not None
    resumed_from = int(gets[2].range.split("=")[1].split("-")[0])
    assert resumed_from == int(gets[1].range.split("=")[1].split("-")[0]) + entry_bytes // 2
    assert hub.bytes_sent("org/model", other) - gets[0].sent == entry_bytes


def test_interrupted_run_resumes_with_the_shards_it_lacks(hub: TestHub, tmp_path: Path) -> None:
    state, weight_map = publish(hub, tmp_path)
    shards = sorted(set(weight_map.values()))
    broken = shards[1]
    hub.fail(f"/resolve/.*/{broken}$", 403)
    dest = tmp_path / "interrupted"
    first = run_ckpt("download", "hf://org/model", dest, "--no-extras")
    assert first.exit_code == 5, first.stderr
    assert broken in first.stderr
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]
    from huggingface_hub import try_to_load_from_cache

    # what the first run completed is what its HF cache holds (the server's byte counters may
    # still be settling for a response the client has already read in full)
    cache = Path(os.environ["HF_HOME"]) / "hub"  # the fixture's fresh HF_HOME for this test
    completed = {
        s
        for s in shards
        if isinstance(try_to_load_from_cache("org/model", s, cache_dir=cache), str)
    }
    assert completed and broken not in completed
    hub.reset_counters()
    second = run_ckpt("download", "hf://org/model", dest, "--no-extras", "--json")
    assert second.exit_code == 0, second.stderr
    status = {f["path"]: f["status"] for f in second.json["result"]["files"]}
    for shard in shards:
        size = (tmp_path / "src" / shard).stat().st_size
        if shard in completed:  # completed by the first run: not fetched again
            assert status[shard] == "cached"
        if status[shard] == "cached":
            assert hub.bytes_sent("org/model", shard) == 0
        else:
            assert status[shard] == "fetched" and hub.bytes_sent("org/model", shard) == size
    assert status[broken] == "fetched"
    assert "cached" in status.values()  # the first run's completed shards were kept
    got = read_all(dest)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[n], state[n]) for n in state)


def test_a_corrupt_file_in_the_cache_is_caught_by_the_hub_checksum(
    hub: TestHub, tmp_path: Path
) -> None:
    _, weight_map = publish(hub, tmp_path)
    shard = weight_map["lm_head.weight"]
    first = run_ckpt(
        "download", "hf://org/model", "--cache-only", "--filter", "lm_head.*", "--json"
    )
    assert first.exit_code == 0, first.stderr
    # a DEST with --cache-only would be left unwritten: refused, not silently ignored
    both = run_ckpt("download", "hf://org/model", tmp_path / "d", "--cache-only", "--json")
    assert both.exit_code == 2 and "--cache-only writes no DEST" in both.json["error"]["message"]
    assert not (tmp_path / "d").exists()
    cached = Path(
        next(f["cache_path"] for f in first.json["result"]["files"] if f["path"] == shard)
    )
    blob = cached.resolve()  # the snapshot entry links to the blob
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    dest = tmp_path / "corrupt"
    result = run_ckpt("download", "hf://org/model", dest, "--filter", "lm_head.*")
    assert result.exit_code == 4
    said = " ".join(result.stderr.split())
    assert shard in said and "sha256" in said and "removed it from the HF cache" in said
    assert not dest.exists()
    # what ckpt found wrong left the shared cache: the rerun fetches it again and succeeds
    assert not blob.exists() and not cached.is_symlink()
    again = run_ckpt("download", "hf://org/model", dest, "--filter", "lm_head.*")
    assert again.exit_code == 0, again.stderr


def test_torch_bin_shards_with_an_index(hub: TestHub, tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    state = model_state()
    src = tmp_path / "bin"
    src.mkdir()
    save_torch_state_dict(state, src, max_shard_size=SHARD_LIMIT, safe_serialization=False)
    weight_map = json.loads((src / "pytorch_model.bin.index.json").read_text())["weight_map"]
    hub.add_repo("org/old", src)
    dest = tmp_path / "old"
    result = run_ckpt("download", "hf://org/old", dest, "--filter", "lm_head.*", "--json")
    assert result.exit_code == 0, result.stderr
    shard = weight_map["lm_head.weight"]
    assert (dest / shard).read_bytes() == (src / shard).read_bytes()
    index = json.loads((dest / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"].values()) == {shard}
    assert set(index["weight_map"]) == {n for n, s in weight_map.items() if s == shard}
    loaded = torch.load(dest / shard, weights_only=True)
    assert torch.equal(loaded["lm_head.weight"], state["lm_head.weight"])
    ranges = run_ckpt("download", "hf://org/old", tmp_path / "x", "--mode", "tensors")
    assert ranges.exit_code == 4 and "--mode shards" in ranges.stderr


def test_hostile_index_and_header_on_the_hub_are_refused(hub: TestHub, tmp_path: Path) -> None:
    import struct

    evil_index = json.dumps(
        {"metadata": {}, "weight_map": {"w": "../../outside.safetensors"}}
    ).encode()
    hub.add_repo("org/evil", {"model.safetensors.index.json": evil_index, "config.json": b"{}"})
    dest = tmp_path / "evil"
    for mode in ("shards", "tensors"):
        result = run_ckpt("download", "hf://org/evil", dest, "--mode", mode, "--json")
        assert result.exit_code == 4, (mode, result.stderr)
        assert result.json["error"]["code"] == "unsafe_input"
    # a header that claims to be far larger than the file: refused before any tensor is fetched
    bogus = struct.pack("<Q", 1 << 40) + b"{}" * 100
    hub.add_repo("org/bogus", {"model.safetensors": bogus})
    result = run_ckpt("download", "hf://org/bogus", dest, "--mode", "tensors")
    assert result.exit_code == 4 and "header" in result.stderr
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_dry_run_fetches_nothing(hub: TestHub, tmp_path: Path) -> None:
    _, weight_map = publish(hub, tmp_path)
    dest = tmp_path / "never"
    shards = publish_shards = sorted(set(weight_map.values()))
    del publish_shards
    plan = run_ckpt(
        "download", "hf://org/model", dest, "--filter", "model.layers.0.*", "--dry-run", "--json"
    )
    assert plan.exit_code == 0, plan.stderr
    report = plan.json["result"]
    assert report["dry_run"] and report["bytes_transferred"] == 0
    assert report["bytes_planned"] > 0
    assert {f["status"] for f in report["files"]} == {"planned"}
    assert not dest.exists()
    assert all(hub.bytes_sent("org/model", s) == 0 for s in shards)
    assert not [r for r in hub.log if r.method == "HEAD"]

    ranges = run_ckpt(
        "download",
        "hf://org/model",
        dest,
        "--mode",
        "tensors",
        "--filter",
        "lm_head.*",
        "--dry-run",
    )
    assert ranges.exit_code == 0, ranges.stderr
    assert "lm_head.weight" in ranges.stdout and "nothing was downloaded" in ranges.stdout
    assert not dest.exists()
    for shard in shards:  # only header probes: at most 16 KiB of any shard
        assert hub.bytes_sent("org/model", shard) <= 16 << 10


def test_errors_no_match_missing_gated_and_existing_dest(hub: TestHub, tmp_path: Path) -> None:
    publish(hub, tmp_path)
    publish_model(hub, "org/gated", tmp_path / "gated", {"w": torch.zeros(2)}, token="hf_ok")
    dest = tmp_path / "d"
    nothing = run_ckpt("download", "hf://org/model", dest, "--filter", "no.such.*", "--json")
    assert nothing.exit_code == 3
    assert "no.such.*" in nothing.json["error"]["message"]
    assert run_ckpt("download", "hf://org/absent", dest).exit_code == 3
    assert run_ckpt("download", "hf://org/model@v9", dest).exit_code == 3
    gated = run_ckpt("download", "hf://org/gated", dest)
    assert gated.exit_code == 5 and "HF_TOKEN" in gated.stderr
    ok = run_ckpt("download", "hf://org/gated", dest, env={"HF_TOKEN": "hf_ok"})
    assert ok.exit_code == 0, ok.stderr
    again = run_ckpt("download", "hf://org/gated", dest, env={"HF_TOKEN": "hf_ok"})
    assert again.exit_code == 2 and "--force" in again.stderr
    forced = run_ckpt("download", "hf://org/gated", dest, "--force", env={"HF_TOKEN": "hf_ok"})
    assert forced.exit_code == 0
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_tensors_mode_refuses_an_index_that_places_a_tensor_in_the_wrong_shard(
    hub: TestHub, tmp_path: Path
) -> None:
    # tensors mode reads only the headers of the shards the index names for the selection:
    # an index that names the wrong shard is an error, never a silently missing tensor
    state = model_state()
    publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    path = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    holder = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["lm_head.weight"] = next(s for s in shards if s != holder)
    path.write_text(json.dumps(index))
    hub.add_repo("org/stale", tmp_path / "src")
    dest = tmp_path / "d"
    result = run_ckpt(
        "download", "hf://org/stale", dest, "--mode", "tensors", "--filter", "lm_head.*", "--json"
    )
    assert result.exit_code == 4, result.stderr
    error = result.json["error"]
    assert "lm_head.weight" in error["message"] and "ckpt verify" in error["fix"]
    assert not dest.exists()


def test_file_missing_on_the_hub_is_exit_3_and_leaves_no_dest(hub: TestHub, tmp_path: Path) -> None:
    _, weight_map = publish(hub, tmp_path)
    shard = weight_map["lm_head.weight"]
    hub.fail(f"/resolve/.*/{shard}$", 404, times=5, error_code="EntryNotFound")
    dest = tmp_path / "partial"
    result = run_ckpt("download", "hf://org/model", dest, "--filter", "lm_head.*")
    assert result.exit_code == 3, result.stderr
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_cache_only_fills_the_hf_cache(hub: TestHub, tmp_path: Path) -> None:
    _, weight_map = publish(hub, tmp_path)
    result = run_ckpt(
        "download", "hf://org/model", "--cache-only", "--filter", "model.embed_tokens.*", "--json"
    )
    assert result.exit_code == 0, result.stderr
    files = result.json["result"]["files"]
    shard = weight_map["model.embed_tokens.weight"]
    cached = {f["path"]: f["cache_path"] for f in files}
    assert cached[shard].startswith(os.environ["HF_HOME"])
    assert Path(cached[shard]).read_bytes() == (tmp_path / "src" / shard).read_bytes()
    # tensors mode reads the ranges of a cached shard from disk
    picked = run_ckpt(
        "download", "hf://org/model", tmp_path / "from-cache", "--mode", "tensors",
        "--filter", "model.embed_tokens.*", "--no-extras", "--json",
    )  # fmt: skip
    assert picked.exit_code == 0, picked.stderr
    assert picked.json["result"]["bytes_transferred"] == 0
    assert picked.json["result"]["bytes_from_cache"] == 128 * 128 * 4
    # offline, the same download is served from that cache
    hub.reset_counters()
    dest = tmp_path / "offline"
    offline = run_ckpt(
        "download",
        "hf://org/model",
        dest,
        "--filter",
        "model.embed_tokens.*",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert offline.exit_code == 0, offline.stderr
    assert hub.log == []
    assert (dest / shard).read_bytes() == (tmp_path / "src" / shard).read_bytes()


def fail_midway(
    hub: TestHub, monkeypatch: pytest.MonkeyPatch, weight_map: dict[str, str], parts_ok: int
) -> None:
    """Small parts fetched one at a time; the Hub answers 403 after `parts_ok` data parts."""
    from ckpt_cli.ops.download import tensors as download_ops

    monkeypatch.setattr(download_ops, "PART_SIZE", 4096)
    monkeypatch.setattr(download_ops, "RANGE_WORKERS", 1)
    monkeypatch.setattr(download_ops, "PARTS_IN_FLIGHT", 1)
    # the CDN serves one header probe per shard, then the data parts; the failed part's retry
    # through `resolve` is redirected to the CDN again and refused too
    probes = len(set(weight_map.values()))
    hub.fail(r"^/_cdn/", 403, times=2, after=probes + parts_ok)


def test_tensors_mode_rerun_after_a_failure_fetches_only_what_it_lacks(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, weight_map = publish(hub, tmp_path)
    fail_midway(hub, monkeypatch, weight_map, parts_ok=40)
    dest = tmp_path / "resumable"
    args = ["download", "hf://org/model", dest, "--mode", "tensors", "--no-extras", "--json"]
    first = run_ckpt(*args)
    assert first.exit_code == 5, first.stderr
    assert "403" in first.stderr or "denied" in first.stderr.lower(), first.stderr
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]
    partial = tmp_path / ".resumable.ckpt-partial"
    assert partial.is_dir()
    first_sent = hub.bytes_sent("org/model")

    # a dry run says what is already there, fetches no data and keeps the pieces
    hub.reset_counters()
    plan = run_ckpt(*args, "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    present = plan.json["result"]["bytes_resumed"]
    selected = plan.json["result"]["selected_bytes"]
    assert 40 * 4096 * 0.9 <= present < selected
    assert plan.json["result"]["bytes_planned"] == selected - present
    human = run_ckpt(*args[:-1], "--dry-run")
    assert "already present from an unfinished run" in human.stdout

    hub.reset_counters()
    second = run_ckpt(*args)
    assert second.exit_code == 0, second.stderr
    report = second.json["result"]
    assert report["bytes_resumed"] == present
    # only the remainder crossed the wire: the ranges are contiguous, so selected == planned
    assert report["bytes_transferred"] == selected - present
    assert hub.bytes_sent("org/model") == report["bytes_transferred"] + report["metadata_bytes"]
    # and across both runs every data byte was sent exactly once
    assert first_sent - report["metadata_bytes"] == present
    got = read_all(dest)
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert not partial.exists()  # published: the kept ranges are gone


def test_tensors_mode_rerun_after_a_new_commit_never_reuses_old_pieces(
    hub: TestHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, weight_map = publish(hub, tmp_path)
    fail_midway(hub, monkeypatch, weight_map, parts_ok=40)
    dest = tmp_path / "moving"
    args = ["download", "hf://org/model", dest, "--mode", "tensors", "--no-extras", "--json"]
    assert run_ckpt(*args).exit_code == 5
    assert (tmp_path / ".moving.ckpt-partial").is_dir()
    # the branch moves: same names, shapes and offsets, other values
    newer = {name: tensor * 2 for name, tensor in state.items()}
    publish_model(hub, "org/model", tmp_path / "src2", newer, max_shard_size=SHARD_LIMIT)
    # the rerun discards the old commit's pieces; it fails midway too, keeping the new ones
    hub.fail(r"^/_cdn/", 403, times=2, after=len(set(weight_map.values())) + 10)
    assert run_ckpt(*args).exit_code == 5
    hub.reset_counters()
    third = run_ckpt(*args)
    assert third.exit_code == 0, third.stderr
    report = third.json["result"]
    assert 10 * 4096 * 0.9 <= report["bytes_resumed"] < 40 * 4096 * 0.9
    assert report["bytes_transferred"] == report["selected_bytes"] - report["bytes_resumed"]
    got = read_all(dest)
    for name, tensor in newer.items():
        assert torch.equal(got[name], tensor), name
    assert not (tmp_path / ".moving.ckpt-partial").exists()


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGINT"])
@pytest.mark.slow
def test_tensors_mode_resumes_after_sigkill_or_ctrl_c(
    hub: TestHub, tmp_path: Path, stop: str
) -> None:
    """A tensors-mode download killed (or stopped with Ctrl-C) mid-fetch keeps the ranges it
    fetched, and the next run fetches only the rest. Ctrl-C says where they are kept (it said
    "partial outputs are removed" over the folder it kept)."""
    import signal
    import subprocess
    import sys
    import time

    from .conftest import REPO

    state, _ = publish(hub, tmp_path)
    hub.latency = 0.05  # a slow link: the run is still fetching when it is killed
    dest = tmp_path / "killed"
    partial = tmp_path / ".killed.ckpt-partial"
    # a real process, with small parts fetched one at a time (set before the CLI runs)
    boot = (
        "import ckpt_cli.ops.download.tensors as d; d.PART_SIZE = 4096; d.RANGE_WORKERS = 1; "
        "d.PARTS_IN_FLIGHT = 1; from ckpt_cli.cli.app import main; main()"
    )
    args = ["download", "hf://org/model", str(dest), "--mode", "tensors", "--no-extras"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", boot, *args, "--json"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(partial.glob("pieces/*/*-*"))) < 10:
            assert proc.poll() is None, "the download ended before it could be killed"
            assert time.monotonic() < deadline, "no range was kept"
            time.sleep(0.01)
        proc.send_signal(getattr(signal, stop))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    if stop == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, out
        error = json.loads(out)["error"]
        assert error["problem"].endswith(f"the ranges fetched so far are kept in {partial}")
        assert error["fix"] == (
            "Run the same `ckpt download` again: it fetches only the ranges it lacks."
        )
        assert partial.is_dir()
    assert not dest.exists()
    hub.latency = 0.0
    hub.reset_counters()
    again = run_ckpt(*args, "--json")
    assert again.exit_code == 0, again.stderr
    report = again.json["result"]
    assert report["bytes_resumed"] >= 10 * 4096 * 0.9
    assert report["bytes_transferred"] == report["selected_bytes"] - report["bytes_resumed"]
    got = read_all(dest)
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    assert not partial.exists()


@pytest.mark.parametrize(
    ("include", "exclude"),
    [
        (None, None),
        (["*.layers.1.*"], None),
        (["*.layers.1.*", "lm_head.*"], ["*.weight_scale_inv"]),
        (["*down_proj.weight"], None),
        (None, ["*.layers.[02].*"]),
        (["*.layers.2.*"], ["*.layers.2.mlp.*"]),
    ],
)
def test_the_index_selection_chooses_what_select_and_with_sidecars_choose(
    include: list[str] | None, exclude: list[str] | None
) -> None:
    # planning from a 90,000-name index matches names rather than building an entry per name:
    # the choice (and its order) is the one the entry-level helpers make
    from ckpt_cli.models import Entry
    from ckpt_cli.ops.download.plan import index_selection
    from ckpt_cli.ops.inspect import select
    from ckpt_cli.quant import with_sidecars

    weight_map = {}
    for layer in range(3):
        for proj in ("gate_proj", "down_proj"):
            base = f"model.layers.{layer}.mlp.{proj}"
            weight_map[f"{base}.weight"] = f"s{layer}.safetensors"
            weight_map[f"{base}.weight_scale_inv"] = f"s{2 - layer}.safetensors"
        weight_map[f"model.layers.{layer}.norm.weight"] = f"s{layer}.safetensors"
    weight_map["lm_head.weight"] = "s2.safetensors"
    entries = [Entry.named(n, f) for n, f in weight_map.items()]
    chosen = select(entries, include, exclude)
    with_scales = with_sidecars(chosen, entries, exclude) if include else chosen

    picked, wanted = index_selection(weight_map, include, exclude)

    assert [(e.name, e.file) for e in picked] == [(e.name, e.file) for e in chosen]
    assert [(e.name, e.file) for e in wanted] == [(e.name, e.file) for e in with_scales]


@pytest.mark.slow
def test_ctrl_c_is_honoured_while_a_shard_request_is_stalled(hub: TestHub, tmp_path: Path) -> None:
    """A Hub that stops answering one shard must not hold Ctrl-C for the request's timeout
    and retries: the download stops at once, exit 130, with its JSON envelope."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from .conftest import REPO

    _, weight_map = publish(hub, tmp_path)
    stalled = sorted(set(weight_map.values()))[1]
    hit = threading.Event()

    class Stall(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            hit.set()
            return super().wait(timeout)

    gate = hub.hold("org/model", stalled, most=120)
    stall = Stall()
    hub._holds[("org/model", stalled)] = stall  # the same hold, telling when it is hit
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for mode in ("shards", "tensors"):
        hit.clear()
        args = ["download", "hf://org/model", str(tmp_path / mode), "--mode", mode, "--json"]
        env["HF_HOME"] = str(tmp_path / f"hf-{mode}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt_cli", *args], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert hit.wait(120), "the stalled shard was never asked for"
            time.sleep(0.5)  # the request is now waiting in a worker thread
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            out, _ = proc.communicate(timeout=60)
            waited = time.monotonic() - sent
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 130, (mode, out)
        assert waited < 10, f"{mode}: Ctrl-C took {waited:.1f} s"
        assert json.loads(out)["exit_code"] == 130
        assert not (tmp_path / mode).exists()
    stall.set()
    gate.set()


def test_a_shard_the_index_names_but_the_repo_lacks_is_exit_3_with_a_fix(
    hub: TestHub, tmp_path: Path
) -> None:
    # an upload cut short: the index is there, one shard is not
    state = model_state()
    publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["lm_head.weight"]
    (tmp_path / "src" / lost).unlink()
    hub.add_repo("org/holed", tmp_path / "src")
    dest = tmp_path / "d"
    result = run_ckpt("download", "hf://org/holed", dest, "--json")
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert error["path"].endswith(lost) and "ckpt verify hf://org/holed" in error["fix"]
    assert not dest.exists()


def test_a_filtered_download_checks_against_the_hub_with_its_rewritten_index(
    hub: TestHub, tmp_path: Path
) -> None:
    # `download --filter` rewrites DEST's index to name just the shards it fetched; checking
    # that copy against the Hub's digests (as ckpt's own messages suggest) must not call the
    # index ckpt wrote damaged: it is checked for agreeing with the Hub's index instead
    _, weight_map = publish(hub, tmp_path)
    dest = tmp_path / "emb"
    got = run_ckpt("download", "hf://org/model", dest, "--filter", "model.embed_tokens.*")
    assert got.exit_code == 0, got.stderr
    checked = run_ckpt("verify", dest, "--checksums", "--manifest", "hf://org/model", "--json")
    assert checked.exit_code == 0, checked.stdout
    codes = {p["code"] for p in checked.json["result"]["problems"]}
    assert "rewritten_index" in codes and "size_changed" not in codes
    # an index that names a tensor in another shard than the Hub's index does is still an error
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map["lm_head.weight"])
    index["weight_map"]["lm_head.weight"] = other
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    tampered = run_ckpt("verify", dest, "--checksums", "--manifest", "hf://org/model", "--json")
    assert tampered.exit_code == 1, tampered.stdout


def test_a_filtered_cache_only_download_leaves_a_snapshot_that_reads_true_offline(
    hub: TestHub, tmp_path: Path
) -> None:
    """`download --cache-only --filter` fills the HF cache with the shards that hold the
    tensors asked for. The repository's index goes with them: without it, the cached snapshot
    (all HF_HUB_OFFLINE=1 reads) held one shard and nothing saying the model had more, and
    offline `inspect` and `download` took that shard for the whole model (exit 0). Offline,
    the same selection downloads from the cache alone, bit-exact; the whole model is refused,
    naming a shard the cache lacks, and nothing is written."""
    state = model_state()
    commit = publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=SHARD_LIMIT)
    picked = ["--filter", "model.layers.0.*"]
    cached = run_ckpt("download", "hf://org/model", "--cache-only", *picked, "--json")
    assert cached.exit_code == 0, cached.stdout
    shards = {f["path"] for f in cached.json["result"]["files"] if f["kind"] == "weights"}
    every = {p.name for p in (tmp_path / "src").glob("*.safetensors")}
    assert shards and shards != every

    offline = {"HF_HUB_OFFLINE": "1"}
    dest = tmp_path / "whole"
    for args in (["inspect", "hf://org/model"], ["download", "hf://org/model", dest]):
        refused = run_ckpt(*args, "--json", env=offline)
        assert refused.exit_code == 5, refused.stdout
        error = refused.json["error"]
        assert Path(error["path"]).name in every - shards
        assert "HF_HUB_OFFLINE" in error["problem"]
        assert f"ckpt download hf://org/model@{commit} --cache-only" in error["fix"]
    assert not dest.exists()

    part = tmp_path / "part"
    fetched = run_ckpt("download", "hf://org/model", part, *picked, env=offline)
    assert fetched.exit_code == 0, fetched.stdout + fetched.stderr
    got = read_all(part)  # whole shards: the ones holding the tensors asked for
    assert {n for n in state if n.startswith("model.layers.0.")} <= got.keys()
    assert all(torch.equal(t, state[n]) for n, t in got.items())


@pytest.mark.frameworks
def test_a_training_save_on_the_hub_downloads_whole_and_verifies_resumable(
    hub: TestHub, real_trainer_run: Path, real_accelerate_run: Path, tmp_path: Path
) -> None:
    """A Trainer pushes `last-checkpoint/` to the Hub (`hub_strategy="checkpoint"`) to resume
    elsewhere; an accelerate run uploads its `save_state` folder. `ckpt download` fetched the
    weights alone and listed `optimizer.pt`, `scheduler.pt`, `rng_state.pth` as "weights of
    another format or variant": DEST would resume with a fresh optimizer. The whole save comes,
    byte for byte, and a filtered or ranged download says why the training state stays behind."""
    saves = {
        "org/trainer-run": real_trainer_run / "straight" / "checkpoint-4",
        "org/accelerate-run": real_accelerate_run / "straight" / "step-4",
    }
    for repo, save in saves.items():
        files = {f"last-checkpoint/{p.name}": p.read_bytes() for p in save.iterdir()}
        hub.add_repo(repo, files)
        src = f"hf://{repo}/last-checkpoint"
        if "trainer" in repo:
            # the save the real Trainer wrote is the repo's latest, at its own step
            found = run_ckpt("latest", f"hf://{repo}", "--json")
            assert found.exit_code == 0, found.stdout
            assert found.json["result"]["latest"] == src
            assert found.json["result"]["checkpoints"][0]["step"] == 4
        out = tmp_path / repo.split("/")[1]
        whole = run_ckpt("download", src, out, "--json")
        assert whole.exit_code == 0, whole.stdout + whole.stderr
        report = whole.json["result"]
        assert report["skipped"] == [], report["skipped"]
        assert {p.name for p in out.iterdir()} == {p.name for p in save.iterdir()}
        for path in save.iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
        kinds = {f["path"]: f["kind"] for f in report["files"]}
        assert kinds["model.safetensors"] == "weights"
        state = "optimizer.pt" if "trainer" in repo else "optimizer.bin"
        assert kinds[state] == "state"
        # the copy is the save: resumable, every component equal to the source's
        checked = run_ckpt("verify", out, "--json")
        assert checked.exit_code == 0, checked.stdout
        assert checked.json["result"]["training"]["resumable"] is True
        same = run_ckpt("diff", save, out, "--json").json["result"]
        assert same["identical"] is True and same["compared"] > 100
        optimizer = torch.load(out / state, weights_only=True)
        assert optimizer["state"] and optimizer["param_groups"]

        # --filter narrows the weights: the training state is not fetched, and it says why
        for options in (("--filter", "lm_head.*"), ("--mode", "tensors")):
            part = run_ckpt("download", src, tmp_path / "part", *options, "--force", "--json")
            assert part.exit_code == 0, part.stdout + part.stderr
            reasons = {s["name"]: s["reason"] for s in part.json["result"]["skipped"]}
            assert state in reasons, options
            assert "training state" in reasons[state] and "variant" not in reasons[state]
            assert not (tmp_path / "part" / state).exists()
        # the names `inspect --list` shows of the save (`model.lm_head.weight`) select its
        # weights too: they were "no tensor matches", exit 3, with a fix naming inspect --list
        head = tmp_path / "head"
        args = ("--filter", "model.lm_head.*", "--mode", "tensors", "--force", "--json")
        named = run_ckpt("download", src, head, *args)
        assert named.exit_code == 0, named.stdout + named.stderr
        assert named.json["result"]["filters"]["tensors"] == ["model.lm_head.*"]
        assert set(read_all(head)) == {"lm_head.weight"}


def test_a_tensors_mode_dry_run_lists_the_weight_files_the_run_writes(
    hub: TestHub, real_trainer_run: Path, tmp_path: Path
) -> None:
    """A user plans a ranged download of a Trainer checkpoint on the Hub, and of a sharded
    model: the dry run lists the files the run then writes (index first, shards with their
    exact sizes), not only the config files fetched beside them. It left the weights out, so
    the plan named none of the files that hold what was asked for."""
    hub.add_repo("org/run", real_trainer_run / "straight" / "checkpoint-4")
    publish(hub, tmp_path)
    kinds: set[str] = set()
    for repo, extra in (("org/run", []), ("org/model", []), ("org/model", ["-k", "lm_head.*"])):
        dest = tmp_path / f"{repo.replace('/', '-')}-{len(extra)}"
        args = ("download", f"hf://{repo}", dest, "--mode", "tensors", *extra, "--json")
        dry = run_ckpt(*args, "--dry-run")
        assert dry.exit_code == 0, dry.stderr
        assert not dest.exists()
        real = run_ckpt(*args)
        assert real.exit_code == 0, real.stderr
        planned = [(f["path"], f["size"], f["kind"]) for f in dry.json["result"]["files"]]
        written = [(f["path"], f["size"], f["kind"]) for f in real.json["result"]["files"]]
        assert planned == written, repo
        weights = [f for f in dry.json["result"]["files"] if f["kind"] != "extra"]
        assert weights and {f["status"] for f in weights} == {"planned"}
        # sizes as written on disk, the safetensors the real reader opens
        for path, size, kind in written:
            assert (dest / path).stat().st_size == size, path
            if kind == "weights":
                with safe_open(dest / path, "pt") as f:
                    assert list(f.keys()), path
        kinds |= {kind for _, _, kind in planned}
    assert kinds == {"index", "weights", "extra"}  # the sharded model's plan has its index
