"""`ckpt verify`: good checkpoints pass, every corruption is found and named, nothing is modified."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

from .conftest import (
    RecordingProgress,
    denying_prefix,
    run_ckpt,
    run_ckpt_json_as,
    run_ckpt_process,
)


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    state = {f"model.layers.{i}.mlp.weight": torch.randn(32, 16, generator=gen) for i in range(6)}
    state["model.embed.weight"] = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    state["model.mask"] = torch.tensor([True, False, True])
    return state


def sharded(path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """A Hugging Face sharded safetensors folder written by huggingface_hub itself."""
    path.mkdir()
    save_torch_state_dict(state or weights(), path, max_shard_size=3000)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def index_of(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "model.safetensors.index.json").read_text())
    return data


def write_index(folder: Path, index: dict[str, Any]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def problems(folder: Path | str, *args: str) -> tuple[int, list[dict[str, Any]]]:
    result = run_ckpt("verify", folder, *args, "--json")
    envelope = result.json
    assert envelope["command"] == "verify"
    return result.exit_code, envelope["result"]["problems"] if envelope["result"] else []


def errors(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in found if p["severity"] == "error"]


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ good checkpoints


def test_good_single_file_and_sharded_folder_pass(tmp_path: Path) -> None:
    save_file(weights(), tmp_path / "one.safetensors")
    folder = sharded(tmp_path / "sharded")
    for src in (tmp_path / "one.safetensors", folder, folder / "model.safetensors.index.json"):
        result = run_ckpt("verify", src, "--json")
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert report["ok"] is True and report["problems"] == []
        assert report["format"] == "safetensors"
    human = run_ckpt("verify", folder)
    assert human.exit_code == 0
    assert "OK" in human.stdout


def test_deep_and_checksums_on_good_checkpoint_modify_nothing(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    before = snapshot(folder)
    result = run_ckpt("verify", folder, "--checksums", "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["tensors"] == len(weights())
    assert report["hashed_bytes"] == sum(
        p.stat().st_size for p in folder.iterdir() if p.name != "ckpt-manifest.json"
    )
    assert set(report["checks"]) == {"structure", "checksums", "deep"}
    assert snapshot(folder) == before


@pytest.mark.slow
def test_a_file_the_os_will_not_let_ckpt_hash_is_an_io_error_naming_it(tmp_path: Path) -> None:
    """`verify --write-manifest` of a model whose config.json may not be read said "cannot be
    read (permission denied)" with exit 2, a usage error; a read the OS refuses is exit 74 (an
    OS error, docs/safety.md), naming the file and EACCES, and no manifest is written."""
    folder = sharded(tmp_path / "m")
    config = folder / "config.json"
    config.write_text('{"model_type": "llama"}')
    config.chmod(0)
    try:
        prefix = denying_prefix(config)
        code, doc = run_ckpt_json_as(prefix, "verify", folder, "--write-manifest")
    finally:
        config.chmod(0o644)
    assert code == 74, doc
    assert (doc["error"]["code"], doc["error"]["path"]) == ("io_error", str(config))
    assert "EACCES" in doc["error"]["message"]
    assert not (folder / "ckpt-manifest.json").exists()


# ------------------------------------------------------------------ safetensors corruptions


def test_truncated_shard_is_named_with_its_tensor(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    code, found = problems(folder)
    assert code == 1
    [problem] = errors(found)
    assert problem["code"] == "truncated"
    assert problem["file"] == str(shard)
    assert problem["tensor"] in index_of(folder)["weight_map"]
    assert index_of(folder)["weight_map"][problem["tensor"]] == shard.name


def test_trailing_garbage_is_reported(tmp_path: Path) -> None:
    save_file(weights(), tmp_path / "one.safetensors")
    with open(tmp_path / "one.safetensors", "ab") as fh:
        fh.write(b"garbage!")
    code, found = problems(tmp_path / "one.safetensors")
    assert code == 1
    assert [p["code"] for p in errors(found)] == ["trailing_bytes"]
    assert "8 bytes after the last tensor" in found[0]["message"]


def test_gap_between_tensors_is_reported(tmp_path: Path) -> None:
    # a hand-written header leaving 4 unused bytes between two tensors
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "gap.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(20))
    code, found = problems(tmp_path / "gap.safetensors")
    assert code == 1
    [problem] = errors(found)
    assert (problem["code"], problem["tensor"]) == ("gap", "b")


def test_missing_shard_names_the_shard_and_its_tensors(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[0]
    lost = sorted(n for n, s in index_of(folder)["weight_map"].items() if s == shard.name)
    shard.unlink()
    code, found = problems(folder)
    assert code == 1
    [problem] = errors(found)
    assert problem["code"] == "missing_shard"
    assert problem["file"] == str(shard)
    assert lost[0] in problem["message"]


def test_index_entry_pointing_at_the_wrong_shard(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    index = index_of(folder)
    name = "model.layers.0.mlp.weight"
    right = index["weight_map"][name]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][name] = wrong
    write_index(folder, index)
    code, found = problems(folder)
    assert code == 1
    [problem] = errors(found)
    assert (problem["code"], problem["tensor"]) == ("wrong_shard", name)
    assert right in problem["message"] and wrong in problem["message"]


def test_tensor_in_no_index(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    index = index_of(folder)
    name = "model.embed.weight"
    shard = index["weight_map"].pop(name)
    write_index(folder, index)
    code, found = problems(folder)
    assert code == 1
    [problem] = errors(found)
    assert (problem["code"], problem["tensor"]) == ("not_in_index", name)
    assert problem["file"] == str(folder / shard)


def test_index_naming_a_tensor_no_shard_holds(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    index = index_of(folder)
    index["weight_map"]["model.ghost"] = index["weight_map"]["model.mask"]
    write_index(folder, index)
    code, found = problems(folder)
    assert code == 1
    assert [(p["code"], p["tensor"]) for p in errors(found)] == [("missing_tensor", "model.ghost")]


def test_tensor_stored_twice(tmp_path: Path) -> None:
    state = {"a": torch.zeros(3), "b": torch.ones(3)}
    folder = tmp_path / "m"
    folder.mkdir()
    save_file({"a": state["a"], "b": state["b"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": state["b"]}, folder / "model-00002-of-00002.safetensors")
    write_index(
        folder,
        {
            "metadata": {"total_size": 24},
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors",
            },
        },
    )
    code, found = problems(folder)
    assert code == 1
    assert [(p["code"], p["tensor"]) for p in errors(found)] == [("duplicate_tensor", "b")]


def test_total_size_mismatch_is_a_warning_only(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    index = index_of(folder)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in weights().values()
    )
    index["metadata"]["total_size"] += 4
    write_index(folder, index)
    code, found = problems(folder)
    assert code == 0
    assert [(p["code"], p["severity"]) for p in found] == [("total_size", "warning")]


def test_all_problems_are_reported_not_just_the_first(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    shards = sorted(folder.glob("*.safetensors"))
    shards[0].unlink()
    shards[1].write_bytes(shards[1].read_bytes()[:-50])
    index = index_of(folder)
    index["weight_map"].pop(next(n for n, s in index["weight_map"].items() if s == shards[2].name))
    write_index(folder, index)
    code, found = problems(folder)
    assert code == 1
    assert sorted(p["code"] for p in errors(found)) == [
        "missing_shard",
        "not_in_index",
        "truncated",
    ]
    for problem in found:
        assert set(problem) >= {"code", "file", "tensor", "message"}
        assert problem["file"] and problem["file"] in problem["message"]
    human = run_ckpt("verify", folder)
    assert human.exit_code == 1
    assert "FAILED: 3 problems" in human.stdout
    for problem in found:
        assert problem["code"] in human.stdout


# ------------------------------------------------------------------ checksums


def test_flipped_byte_is_caught_by_checksums(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    manifest = json.loads((folder / "ckpt-manifest.json").read_text())
    assert manifest["algorithm"] == "sha256"
    shard = sorted(folder.glob("*.safetensors"))[2]
    # the manifest's sha256 is what sha256sum (and the Hub's LFS oid) would say
    assert manifest["files"][shard.name] == {
        "size": shard.stat().st_size,
        "digest": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01
    shard.write_bytes(bytes(data))
    assert run_ckpt("verify", folder).exit_code == 0  # structurally still fine
    code, found = problems(folder, "--checksums")
    assert code == 1
    [problem] = found
    assert problem["code"] == "checksum_mismatch"
    assert problem["file"] == str(shard)


def test_a_manifest_of_a_file_whose_name_is_not_utf8_checks_that_file(tmp_path: Path) -> None:
    """A checkpoint folder holding a file whose name is not UTF-8 (copied from an old Latin-1
    disk): `--write-manifest` recorded the name as replacement characters, so the very next
    `--checksums` failed the untouched folder (that name "missing", the real one "not in the
    manifest"). The manifest now records the name the file has, and it checks; a flip in that
    file is still caught, naming it."""
    import os

    folder = sharded(tmp_path / "m")
    odd = folder / os.fsdecode(b"notes-\xff.txt")
    odd.write_text("from an old disk")
    assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    code, found = problems(folder, "--checksums")
    assert (code, found) == (0, [])
    odd.write_text("from an old disc")
    code, found = problems(folder, "--checksums")
    assert code == 1
    assert [(p["code"], p["file"]) for p in found] == [("checksum_mismatch", str(odd))]


def test_checksums_find_missing_resized_and_added_files(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    manifest = tmp_path / "elsewhere.json"
    assert run_ckpt("verify", folder, "--write-manifest", "--manifest", manifest).exit_code == 0
    assert not (folder / "ckpt-manifest.json").exists()
    shards = sorted(folder.glob("*.safetensors"))
    shards[0].unlink()
    (folder / "README.md").write_text("added later")
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text() + "\n")
    code, found = problems(folder, "--checksums", "--manifest", str(manifest))
    assert code == 1
    got = {(p["code"], Path(p["file"]).name, p["severity"]) for p in found}
    assert ("missing_file", shards[0].name, "error") in got
    assert ("size_changed", index.name, "error") in got
    assert ("unlisted_file", "README.md", "warning") in got


@pytest.mark.parametrize("algo", ["blake3", "xxh3"])
def test_fast_algorithms_round_trip(tmp_path: Path, algo: str) -> None:
    folder = sharded(tmp_path / "m")
    assert run_ckpt("verify", folder, "--write-manifest", "--algo", algo).exit_code == 0
    manifest = json.loads((folder / "ckpt-manifest.json").read_text())
    assert manifest["algorithm"] == algo
    assert run_ckpt("verify", folder, "--checksums").exit_code == 0
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x80
    shard.write_bytes(bytes(data))
    code, found = problems(folder, "--checksums")
    assert code == 1 and [p["code"] for p in found] == ["checksum_mismatch"]


@pytest.mark.parametrize("algo", ["blake3", "xxh3", "sha256"])
def test_manifest_digests_are_the_reference_digests(tmp_path: Path, algo: str) -> None:
    # one big model file beside small JSON files: blake3 hashes the big one with its own
    # threads and the small ones one per thread; every digest is the reference library's
    import blake3
    import xxhash

    folder = tmp_path / "model"
    folder.mkdir()
    gen = torch.Generator().manual_seed(5)
    save_file({"w": torch.randn(1 << 20, generator=gen)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": list(range(5000))}))
    assert run_ckpt("verify", folder, "--write-manifest", "--algo", algo).exit_code == 0
    recorded = json.loads((folder / "ckpt-manifest.json").read_text())["files"]
    reference = {
        "blake3": lambda data: blake3.blake3(data).hexdigest(),
        "xxh3": xxhash.xxh3_128_hexdigest,
        "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    }[algo]
    names = ("config.json", "model.safetensors", "tokenizer.json")
    assert sorted(recorded) == list(names)
    for name in names:
        data = (folder / name).read_bytes()
        assert recorded[name] == {"size": len(data), "digest": reference(data)}, name


def test_missing_fast_package_is_a_clear_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = sharded(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    result = run_ckpt("verify", folder, "--write-manifest", "--algo", "blake3")
    assert result.exit_code == 2
    assert "ckpt-cli[fast]" in result.stderr
    assert not (folder / "ckpt-manifest.json").exists()


def test_manifest_errors(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    missing = run_ckpt("verify", folder, "--checksums")
    assert missing.exit_code == 3
    assert "ckpt-manifest.json" in missing.stderr and "--write-manifest" in missing.stderr
    assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    again = run_ckpt("verify", folder, "--write-manifest")
    assert again.exit_code == 2 and "--force" in again.stderr
    assert (
        run_ckpt("verify", folder, "--write-manifest", "--force", "--algo", "xxh3").exit_code == 0
    )
    assert json.loads((folder / "ckpt-manifest.json").read_text())["algorithm"] == "xxh3"
    assert run_ckpt("verify", folder, "--checksums", "--algo", "sha256").exit_code == 2
    assert run_ckpt("verify", folder, "--checksums", "--write-manifest").exit_code == 2
    (folder / "ckpt-manifest.json").write_text("{not json")
    assert run_ckpt("verify", folder, "--checksums").exit_code == 4


def test_a_garbled_manifest_is_written_again_by_the_fix_its_error_names(tmp_path: Path) -> None:
    """A `ckpt-manifest.json` garbled on disk: `verify --checksums` said to write it again with
    `ckpt verify SRC --write-manifest --force`, and that very command was refused ("exists and
    is not a ckpt checksum manifest; --force replaces only a manifest"). The checkpoint's own
    manifest file is replaced; any other file named with --manifest is still refused."""
    folder = sharded(tmp_path / "m")
    (folder / "ckpt-manifest.json").write_text("{garbled")
    broken = run_ckpt("verify", folder, "--checksums")
    assert broken.exit_code == 4 and "--write-manifest --force" in broken.stderr
    rewritten = run_ckpt("verify", folder, "--write-manifest", "--force")
    assert rewritten.exit_code == 0, rewritten.stderr
    assert run_ckpt("verify", folder, "--checksums").exit_code == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    refused = run_ckpt("verify", folder, "--write-manifest", "--manifest", notes, "--force")
    assert refused.exit_code == 2 and "not a ckpt checksum manifest" in refused.stderr
    assert notes.read_text() == "my notes"


def test_no_manifest_is_written_for_a_broken_checkpoint(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    sorted(folder.glob("*.safetensors"))[0].unlink()
    code, found = problems(folder, "--write-manifest")
    assert code == 1
    assert "manifest_not_written" in [p["code"] for p in found]
    assert not (folder / "ckpt-manifest.json").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ --deep, --resumable, bad input


def test_deep_counts_nan_and_inf_per_tensor(tmp_path: Path) -> None:
    state = weights()
    bad = state["model.layers.2.mlp.weight"]
    bad[0, 0] = float("nan")
    bad[1, 1] = float("nan")
    bad[2, 2] = float("inf")
    state["model.embed.weight"][3, 3] = float("-inf")
    state["model.f8"] = torch.tensor([1.0, float("nan")]).to(torch.float8_e5m2)
    save_file(state, tmp_path / "w.safetensors")
    assert run_ckpt("verify", tmp_path / "w.safetensors").exit_code == 0  # structure is fine
    result = run_ckpt("verify", tmp_path / "w.safetensors", "--deep", "--json")
    assert result.exit_code == 1
    report = result.json["result"]
    counts = {t["name"]: (t["nan"], t["inf"]) for t in report["nonfinite"]}
    assert counts == {
        "model.layers.2.mlp.weight": (2, 1),
        "model.embed.weight": (0, 1),
        "model.f8": (1, 0),
    }
    assert {p["tensor"] for p in report["problems"] if p["code"] == "nonfinite"} == set(counts)
    assert report["tensors"] == len(state)


def test_resumable_on_weights_only_fails(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    code, found = problems(folder, "--resumable")
    assert code == 1
    assert [p["code"] for p in found] == ["not_resumable"]


def test_unreadable_inputs_are_3_and_4(tmp_path: Path) -> None:
    assert run_ckpt("verify", tmp_path / "nope").exit_code == 3
    (tmp_path / "notes.txt").write_text("hello")
    assert run_ckpt("verify", tmp_path / "notes.txt").exit_code == 4


@pytest.mark.slow
def test_real_process_exit_code_and_clean_stdout(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    assert run_ckpt_process("verify", folder, "--write-manifest").exit_code == 0
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    result = run_ckpt_process("verify", folder, "--checksums", "--json")
    assert result.exit_code == 1
    envelope = json.loads(result.stdout)
    assert envelope["ok"] is False and envelope["exit_code"] == 1
    assert {p["code"] for p in envelope["result"]["problems"]} == {"truncated", "size_changed"}


def test_leftover_file_of_another_save_only_warns(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    save_file({"old": torch.zeros(2)}, folder / "model-00001-of-00003.safetensors")
    code, found = problems(folder)
    assert code == 0
    assert [(p["code"], p["severity"], Path(p["file"]).name) for p in found] == [
        ("unreferenced_shard", "warning", "model-00001-of-00003.safetensors")
    ]


# ------------------------------------------------------------------ DCP


def dcp_checkpoint(path: Path) -> Path:
    """A single-process DCP save (torch_save serialization) of a tiny model + step counter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    gen = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path


def rewrite_metadata(folder: Path, change: Any) -> None:
    """Edit `.metadata` with torch's own classes (DCP's reader unpickles it; we never do)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    change(metadata)
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)


def test_good_dcp_passes_structure_and_deep(tmp_path: Path) -> None:
    folder = dcp_checkpoint(tmp_path / "step-1")
    result = run_ckpt("verify", folder, "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["format"] == "dcp" and report["tensors"] == 2
    # naming the .metadata file means the folder, for checksums too
    assert run_ckpt("verify", folder / ".metadata", "--write-manifest").exit_code == 0
    recorded = json.loads((folder / "ckpt-manifest.json").read_text())["files"]
    assert sorted(recorded) == [".metadata", "__0_0.distcp"]


def test_dcp_without_metadata_is_an_interrupted_save(tmp_path: Path) -> None:
    folder = dcp_checkpoint(tmp_path / "step-1")
    (folder / ".metadata").unlink()
    code, found = problems(folder)
    assert code == 1
    [problem] = found
    assert problem["code"] == "dcp_interrupted"
    assert "no .metadata" in problem["message"] and "interrupted" in problem["message"]


def test_dcp_with_a_missing_distcp_file(tmp_path: Path) -> None:
    folder = dcp_checkpoint(tmp_path / "step-1")
    (folder / "__0_0.distcp").unlink()
    code, found = problems(folder)
    assert code == 1
    assert {p["code"] for p in errors(found)} == {"dcp_missing_file"}
    assert "__0_0.distcp" in errors(found)[0]["message"]


def test_dcp_chunks_with_a_hole(tmp_path: Path) -> None:
    import torch.distributed.checkpoint.metadata as m

    folder = dcp_checkpoint(tmp_path / "step-1")

    def grow(metadata: Any) -> None:
        # the one stored chunk now covers only half of a tensor twice as tall
        old = metadata.state_dict_metadata["model.w"]
        metadata.state_dict_metadata["model.w"] = m.TensorStorageMetadata(
            old.properties, torch.Size([8, 4]), old.chunks
        )

    rewrite_metadata(folder, grow)
    code, found = problems(folder)
    assert code == 1
    assert [(p["code"], p["tensor"]) for p in errors(found)] == [("dcp_hole", "model.w")]


def test_dcp_chunks_that_overlap(tmp_path: Path) -> None:
    import torch.distributed.checkpoint.metadata as m

    folder = dcp_checkpoint(tmp_path / "step-1")

    def overlap(metadata: Any) -> None:
        # a second chunk of rows 2..5 of a 6-row tensor, stored in the first chunk's bytes
        old = metadata.state_dict_metadata["model.w"]
        second = m.ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([4, 4]))
        metadata.state_dict_metadata["model.w"] = m.TensorStorageMetadata(
            old.properties, torch.Size([6, 4]), [*old.chunks, second]
        )
        first = m.MetadataIndex("model.w", torch.Size([0, 0]), 0)
        info = metadata.storage_data[first]
        metadata.storage_data[m.MetadataIndex("model.w", torch.Size([2, 0]), 1)] = info

    rewrite_metadata(folder, overlap)
    code, found = problems(folder)
    assert code == 1
    assert ("dcp_overlap", "model.w") in [(p["code"], p["tensor"]) for p in errors(found)]


# ------------------------------------------------------------------ torch.save


def test_good_torch_file_passes_and_hostile_pickle_is_not_executed(tmp_path: Path) -> None:
    torch.save(weights(), tmp_path / "model.pt")
    result = run_ckpt("verify", tmp_path / "model.pt", "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["format"] == "torch"

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.zeros(2), "evil": Evil()}, tmp_path / "evil.pt")
    code, found = problems(tmp_path / "evil.pt")
    assert code in (1, 4)
    assert found and "system" in found[0]["message"]
    code, found = problems(tmp_path / "evil.pt", "--deep", "--resumable")
    assert code in (1, 4)
    assert not marker.exists()


def test_one_file_is_checked_against_the_folder_manifest(tmp_path: Path) -> None:
    folder = sharded(tmp_path / "m")
    assert run_ckpt("verify", folder, "--write-manifest").exit_code == 0
    first, second = sorted(folder.glob("*.safetensors"))[:2]
    data = bytearray(second.read_bytes())
    data[-1] ^= 0x10
    second.write_bytes(bytes(data))
    assert run_ckpt("verify", first, "--checksums").exit_code == 0
    code, found = problems(second, "--checksums")
    assert code == 1
    assert [(p["code"], p["file"]) for p in found] == [("checksum_mismatch", str(second))]


def test_single_file_manifest_lies_beside_it(tmp_path: Path) -> None:
    save_file(weights(), tmp_path / "one.safetensors")
    assert run_ckpt("verify", tmp_path / "one.safetensors", "--write-manifest").exit_code == 0
    manifest = json.loads((tmp_path / "ckpt-manifest.json").read_text())
    assert list(manifest["files"]) == ["one.safetensors"]
    assert run_ckpt("verify", tmp_path / "one.safetensors", "--checksums").exit_code == 0


# ------------------------------------------------------------------ training folders


def trainer_checkpoint(run_dir: Path) -> Path:
    """A Hugging Face Trainer `checkpoint-4/` saved like the Trainer does (see examples/)."""
    import importlib.util

    from .conftest import REPO

    spec = importlib.util.spec_from_file_location("make_demo", REPO / "examples" / "make_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_demo", module)  # its dataclass needs a home module
    spec.loader.exec_module(sys.modules["make_demo"])
    module = sys.modules["make_demo"]
    folder: Path = module.save_trainer_checkpoint(run_dir)
    return folder


def test_trainer_folder_is_resumable_and_deep_reads_every_component(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path / "run")
    result = run_ckpt("verify", folder, "--resumable", "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["format"] == "hf-trainer"
    assert report["training"]["resumable"] is True
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    with safe_open(folder / "model.safetensors", "pt") as model:
        weights_count = len(list(model.keys()))
    per_param = sum(
        1 for state in optimizer["state"].values() for v in state.values() if torch.is_tensor(v)
    )
    # every weight and every optimizer tensor was read (plus scheduler / RNG tensors)
    assert report["tensors"] >= per_param + weights_count


def test_trainer_folder_without_optimizer_is_not_resumable(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path / "run")
    (folder / "optimizer.pt").unlink()
    # the Trainer writes optimizer.pt with the scheduler and RNG files still here: a lost file
    code, found = problems(folder)
    assert code == 1
    assert [p["code"] for p in found] == ["missing_component"]
    assert "optimizer.pt is missing" in found[0]["message"]
    # --resumable says the same, and that its own checks wait for the checkpoint to be whole
    code, found = problems(folder, "--resumable")
    assert code == 1
    assert [p["code"] for p in found] == ["missing_component", "not_checked"]
    assert "optimizer.pt is missing" in run_ckpt("verify", folder, "--resumable").stdout


def test_optimizer_state_with_a_wrong_shape(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path / "run")
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    optimizer["state"][0]["exp_avg"] = torch.zeros(3, 3)
    torch.save(optimizer, folder / "optimizer.pt")
    code, found = problems(folder, "--resumable")
    assert code == 1
    assert [p["code"] for p in found] == ["optimizer_shape_mismatch"]
    assert "[3, 3]" in found[0]["message"]


def test_every_optimizer_state_of_a_parameter_is_checked_not_only_the_first(
    tmp_path: Path,
) -> None:
    """A wrong exp_avg_sq (after a right exp_avg) used to pass: only the first state tensor of
    each parameter was compared, though the resume refuses the second just the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = trainer_checkpoint(tmp_path / "run")
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    optimizer["state"][0]["exp_avg_sq"] = torch.zeros(3, 3)
    torch.save(optimizer, folder / "optimizer.pt")
    code, found = problems(folder, "--resumable")
    assert code == 1
    assert [p["code"] for p in found] == ["optimizer_shape_mismatch"]
    assert "exp_avg_sq is [3, 3]" in found[0]["message"]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    weights, state = get_state_dict(model, adam)
    state["state"]["0.weight"]["exp_avg_sq"] = state["state"]["0.weight"]["exp_avg_sq"].t()
    saved = tmp_path / "dcp"
    dcp.save({"model": weights, "optimizer": state}, checkpoint_id=str(saved), no_dist=True)
    code, found = problems(saved, "--resumable")
    assert code == 1
    (mismatch,) = [p for p in found if p["code"] == "optimizer_shape_mismatch"]
    assert "'0.weight' (exp_avg_sq) is [4, 3]" in mismatch["message"]


def test_parameters_without_a_gradient_yet_are_a_warning_not_an_incomplete_optimizer(
    tmp_path: Path,
) -> None:
    """Staged unfreezing: the optimizer lists every parameter, the frozen ones have had no
    gradient, and torch keeps no state for them. The resume works; verify used to fail it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        adam = torch.optim.AdamW(model.parameters())
        model[0].requires_grad_(False)  # the backbone is frozen for the first steps
        return model, adam

    model, adam = build(0)
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    weights, state = get_state_dict(model, adam)
    saved = tmp_path / "step-1"
    dcp.save(
        {"model": weights, "optimizer": state, "step": 1}, checkpoint_id=str(saved), no_dist=True
    )
    result = run_ckpt("verify", saved, "--resumable", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["training"]["resumable"] is True
    (pending,) = [p for p in result.json["result"]["problems"] if "optimizer" in p["code"]]
    assert pending["code"] == "optimizer_state_pending" and pending["severity"] == "warning"
    assert "'0.weight', '0.bias'" in pending["message"] and "first gradient" in pending["message"]
    # the resume the warning promises
    resumed, adam2 = build(1)
    weights2, state2 = get_state_dict(resumed, adam2)
    loaded = {"model": weights2, "optimizer": state2}
    dcp.load(loaded, checkpoint_id=str(saved), no_dist=True)
    set_state_dict(
        resumed, adam2, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    assert int(adam2.state[resumed[1].weight]["step"]) == 1

    # a parameter holding part of its state is still an incomplete save
    del state["state"]["1.bias"]["exp_avg_sq"]
    partial = tmp_path / "partial"
    dcp.save(
        {"model": weights, "optimizer": state, "step": 1}, checkpoint_id=str(partial), no_dist=True
    )
    code, found = problems(partial, "--resumable")
    assert code == 1 and "optimizer_incomplete" in [p["code"] for p in found]


@pytest.mark.slow
def test_hostile_component_of_a_trainer_folder_is_reported_not_run(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path / "run")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"python": Evil()}, folder / "rng_state.pth")
    code, found = problems(folder, "--resumable", "--deep")
    assert code == 1
    assert any("rng_state.pth" in (p["file"] or "") for p in errors(found))
    assert not marker.exists()


def test_trainer_folder_with_a_truncated_model_is_named(tmp_path: Path) -> None:
    folder = trainer_checkpoint(tmp_path / "run")
    model = folder / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    code, found = problems(folder)
    assert code == 1
    assert any(
        p["file"] == str(model) and "past its end" in p["message"] and "truncated" in p["fix"]
        for p in errors(found)
    )


# ------------------------------------------------------------------ the Hub


def test_hub_checkpoint_structure_through_ranged_reads(hub: Any, tmp_path: Path) -> None:
    from .hub_fixtures import publish_model

    publish_model(hub, "org/model", tmp_path / "src", weights(), max_shard_size=3000)
    result = run_ckpt("verify", "hf://org/model", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["format"] == "safetensors"

    # a broken commit: the index sends a tensor to the wrong shard
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "src", broken)
    index = index_of(broken)
    right = index["weight_map"]["model.layers.0.mlp.weight"]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"]["model.layers.0.mlp.weight"] = wrong
    write_index(broken, index)
    hub.add_repo("org/broken", broken)
    code, found = problems("hf://org/broken")
    assert code == 1
    [problem] = errors(found)
    assert problem["code"] == "wrong_shard" and problem["file"].startswith("hf://org/broken@")


def test_local_copy_against_the_hubs_digests(hub: Any, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    from .hub_fixtures import publish_model

    publish_model(hub, "org/model", tmp_path / "src", weights(), max_shard_size=3000)
    copy = tmp_path / "copy"
    snapshot_download("org/model", local_dir=copy, endpoint=hub.url)
    args = ("--checksums", "--manifest", "hf://org/model")
    result = run_ckpt("verify", copy, *args, "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["problems"] == []
    assert report["hashed_bytes"] == sum(
        p.stat().st_size for p in (tmp_path / "src").iterdir()
    ) + len(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")

    shard = sorted(copy.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x04
    shard.write_bytes(bytes(data))
    (copy / "config.json").write_text('{"model_type": "other"}\n')
    code, found = problems(copy, *args)
    assert code == 1
    assert sorted((p["code"], Path(p["file"]).name) for p in errors(found)) == [
        ("checksum_mismatch", shard.name),
        ("size_changed", "config.json"),
    ]


def test_hub_cache_against_the_hubs_digests(hub: Any, tmp_path: Path) -> None:
    import os

    from huggingface_hub import snapshot_download

    from .hub_fixtures import publish_model

    publish_model(hub, "org/model", tmp_path / "src", weights(), max_shard_size=3000)
    code, found = problems("hf://org/model", "--checksums")
    assert code == 0 and [p["code"] for p in found] == ["no_local_copy"]
    snapshot = Path(
        snapshot_download(
            "org/model", endpoint=hub.url, cache_dir=str(Path(os.environ["HF_HOME"]) / "hub")
        )
    )
    assert run_ckpt("verify", "hf://org/model", "--checksums").exit_code == 0
    blob = (snapshot / "model-00002-of-00007.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    code, found = problems("hf://org/model", "--checksums")
    assert code == 1
    [problem] = found
    assert problem["code"] == "checksum_mismatch"
    assert "model-00002-of-00007.safetensors" in problem["file"]


def test_a_cache_snapshot_folder_is_checked_against_its_content_addresses(
    hub: Any, tmp_path: Path
) -> None:
    import os

    from huggingface_hub import snapshot_download

    from .hub_fixtures import publish_model

    publish_model(hub, "org/model", tmp_path / "src", weights(), max_shard_size=3000)
    cache = Path(os.environ["HF_HOME"]) / "hub"
    snapshot = Path(snapshot_download("org/model", endpoint=hub.url, cache_dir=str(cache)))
    hub.reset_counters()  # from here the cache's own names are what the files are checked by
    result = run_ckpt("verify", snapshot, "--checksums", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert "checksums" in report["checks"] and report["problems"] == []
    assert report["hashed_bytes"] == sum(p.stat().st_size for p in snapshot.iterdir())
    assert "blobs" in report["manifest"]
    # a blob whose bytes no longer match the sha256 it is named by (an LFS shard), and a
    # regular file whose git blob id no longer matches (same sizes: only the content changed)
    shard = snapshot / "model-00002-of-00007.safetensors"
    config = snapshot / "config.json"
    for path in (shard, config):
        blob = path.resolve()
        data = bytearray(blob.read_bytes())
        data[-2] ^= 0x01
        blob.write_bytes(bytes(data))
    assert run_ckpt("verify", snapshot).exit_code == 0  # the structure is intact
    code, found = problems(snapshot, "--checksums")
    assert code == 1
    assert sorted((p["code"], Path(p["file"]).name) for p in errors(found)) == [
        ("checksum_mismatch", config.name),
        ("checksum_mismatch", shard.name),
    ]
    problem = next(p for p in found if shard.name in p["file"])
    assert "content address" in problem["message"] and "hf cache rm" in problem["fix"]
    # one file of the snapshot is checked alone too
    alone = run_ckpt("verify", shard, "--checksums")
    assert alone.exit_code == 1 and shard.name in alone.stdout + alone.stderr
    assert hub.log == []  # offline: nothing asked of the Hub


def test_verify_modifies_no_training_or_dcp_file(tmp_path: Path) -> None:
    trainer = trainer_checkpoint(tmp_path / "run")
    step = dcp_checkpoint(tmp_path / "step-1")
    for folder in (trainer, step):
        before = snapshot(folder)
        assert run_ckpt("verify", folder, "--deep", "--resumable").exit_code in (0, 1)
        assert (
            run_ckpt(
                "verify", folder, "--write-manifest", "--manifest", tmp_path / "m.json", "--force"
            ).exit_code
            == 0
        )
        assert (
            run_ckpt("verify", folder, "--checksums", "--manifest", tmp_path / "m.json").exit_code
            == 0
        )
        assert snapshot(folder) == before


@pytest.mark.slow
def test_structural_verify_and_checksums_do_not_import_torch(tmp_path: Path) -> None:
    import os
    import subprocess

    from .conftest import REPO

    folder = sharded(tmp_path / "m")
    probe = (
        "import sys; sys.argv = ['ckpt'] + sys.argv[1:]\n"
        "from ckpt_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', code, file=sys.stderr)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args in (["verify", str(folder)], ["verify", str(folder), "--write-manifest"]):
        proc = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env
        )
        assert "NO_TORCH 0" in proc.stderr, (args, proc.stderr)


def test_content_checks_report_progress_in_bytes(tmp_path: Path) -> None:
    from ckpt_cli.ops.verify.run import verify

    folder = sharded(tmp_path / "m")
    size = sum(p.stat().st_size for p in folder.iterdir())
    recorder = RecordingProgress()
    report = verify(str(folder), write_manifest=True, deep=True, progress=recorder)
    assert report.ok and report.manifest_written
    tensor_bytes = sum(t.numel() * t.element_size() for t in weights().values())
    assert recorder.phases == [
        ("reading tensors", tensor_bytes, tensor_bytes),
        ("hashing (sha256)", size, size),
    ]


def test_the_pytorch_tutorial_checkpoint_dict_is_a_resumable_training_save(tmp_path: Path) -> None:
    """The dict PyTorch's "saving and loading a general checkpoint" recipe saves (`epoch`,
    `model_state_dict`, `optimizer_state_dict`, `loss`) resumes: its weights and optimizer are
    found under those keys, and the whole epoch it counted reads as `5`, not `5.0`."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    src = tmp_path / "tutorial.pt"
    torch.save(
        {
            "epoch": 5,
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "loss": 0.25,
        },
        src,
    )

    verified = run_ckpt("verify", src, "--resumable")
    shown = run_ckpt("inspect", src)

    assert verified.exit_code == 0, verified.stdout
    assert "resumable: yes" in verified.stdout
    assert "step / epoch ? / 5\n" in shown.stdout
    assert "model=model_state_dict, optimizer=optimizer_state_dict" in shown.stdout


def test_a_file_linked_out_of_the_checkpoint_is_reported_and_never_counted_or_hashed(
    tmp_path: Path,
) -> None:
    """A `notes.txt` linking to a file outside the folder: `verify` said OK, counted the file
    it leads to in `files` and `bytes`, and `--write-manifest` hashed it (any file the link
    named, /etc/passwd as well) into the manifest, while `convert` refused the folder. A shard
    linked out was refused, yet still counted and hashed. A link out is no part of the
    checkpoint now: one `unsafe_input` error naming it, not counted, read or hashed; a link
    within the checkpoint is the file it names."""
    model = sharded(tmp_path / "model")
    files = {p.name: p.stat().st_size for p in model.iterdir()}
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any checkpoint\n" * 100)
    (model / "notes.txt").symlink_to(secret)
    found = run_ckpt("verify", model, "--write-manifest", "--json")
    assert found.exit_code == 1, found.stdout
    result = found.json["result"]
    assert (result["files"], result["bytes"]) == (len(files), sum(files.values()))
    assert [(p["code"], p["file"]) for p in errors(result["problems"])] == [
        ("unsafe_input", str(model / "notes.txt")),
        ("manifest_not_written", str(model / "ckpt-manifest.json")),
    ]
    assert str(secret) in result["problems"][0]["message"]
    assert result["hashed_bytes"] == 0 and not (model / "ckpt-manifest.json").exists()
    assert run_ckpt("convert", model, tmp_path / "out", "--to", "safetensors").exit_code == 4

    # a manifest written before the link came: the link out is reported, never hashed, and no
    # "missing" or "added" file besides; the checkpoint's own files are all checked
    (model / "notes.txt").unlink()
    assert run_ckpt("verify", model, "--write-manifest").exit_code == 0
    shard = sorted(model.glob("*.safetensors"))[0]
    moved = tmp_path / "elsewhere" / shard.name
    moved.parent.mkdir()
    shard.rename(moved)
    shard.symlink_to(moved)
    found = run_ckpt("verify", model, "--checksums", "--json")
    assert found.exit_code == 1, found.stdout
    result = found.json["result"]
    assert [(p["code"], p["file"]) for p in result["problems"]] == [("unsafe_input", str(shard))]
    rest = sum(size for name, size in files.items() if name != shard.name)
    assert (result["files"], result["bytes"], result["hashed_bytes"]) == (
        len(files) - 1,
        rest,
        rest,
    )

    # linked within the folder, the shard is the file it names: counted once per name
    shard.unlink()
    inside = model / "store" / shard.name
    inside.parent.mkdir()
    moved.rename(inside)
    shard.symlink_to(Path("store") / shard.name)
    found = run_ckpt("verify", model, "--json")
    assert found.exit_code == 0, found.stdout
    assert found.json["result"]["files"] == len(files) + 1  # the link and the file it names


def test_a_cache_snapshot_whose_weights_blob_is_gone_names_the_broken_link(
    tmp_path: Path,
) -> None:
    """An HF cache snapshot whose weights blob was removed (a cache cleanup, an interrupted
    download): the listing had no file for the link to nothing, so `verify` said the folder
    "holds no checkpoint files: it holds config.json", never naming the weights. It names the
    link, where it leads, and the fix."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / ("1" * 40)).write_text('{"model_type": "llama"}')  # a git blob id
    (snapshot / "config.json").symlink_to(Path("../../blobs") / ("1" * 40))
    gone = repo / "blobs" / ("2" * 64)  # the LFS sha256 of a weights file removed
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / gone.name)
    result = run_ckpt("verify", snapshot, "--json")
    assert result.exit_code == 3, result.stdout
    error = result.json["error"]
    assert error["code"] == "not_found"
    assert (
        f"model.safetensors is a symbolic link to {gone}, which does not exist"
        in (error["problem"])
    )
    assert "hf download" in error["fix"]


def test_deep_verify_of_a_training_folder_checks_its_torch_files_as_torch_load_reads_them(
    tmp_path: Path,
) -> None:
    # `verify --deep` of one torch.save file checks its zip as torch's own reader reads it;
    # of an accelerate `save_state` folder it skipped that for every component, so one byte
    # flipped in random_states_0.pkl's zip directory (a record name) was OK in the folder and
    # corrupt alone, and accelerate's `load_state` (torch.load) fails on it
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer)
    save = tmp_path / "step-3"
    accelerator.save_state(str(save))
    rng = save / "random_states_0.pkl"
    data = bytearray(rng.read_bytes())
    at = data.rindex(b"random_states_0/.storage_alignment")  # in the zip directory
    data[at + 9] = ord("`")
    rng.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(rng, weights_only=False)

    alone = run_ckpt("verify", rng, "--deep")
    assert alone.exit_code == 1 and "corrupt_data" in alone.stdout, alone.stdout
    folder = run_ckpt("verify", save, "--deep", "--json")
    assert folder.exit_code == 1, folder.stdout
    errors = [p for p in folder.json["result"]["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in errors] == [("corrupt_data", str(rng))], errors
