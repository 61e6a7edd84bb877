"""What a user meets on the Hub and in object stores when nothing fails: one file named in an
`hf://` location, a repository that holds weights of both formats, a commit partly in the HF
cache. A real HTTP Hub on 127.0.0.1 serves files written by the real writers; results are read
back with the real readers, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .conftest import run_ckpt
from .hub_fixtures import CONFIG_JSON
from .hub_server import TestHub


def state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"blocks.{i}.{part}.weight": torch.randn(32, 16, generator=gen).to(dtype)
        for i in range(3)
        for part in ("conv", "norm")
    }


def read_file(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def publish_unet_with_variant(hub: TestHub, tmp_path: Path) -> tuple[dict[str, torch.Tensor], ...]:
    """A diffusers-style `unet/` with its default weights and an fp16 variant beside them."""
    folder = tmp_path / "pipe"
    (folder / "unet").mkdir(parents=True)
    full, half = state(1), state(1, torch.float16)
    save_file(full, folder / "unet" / "diffusion_pytorch_model.safetensors")
    save_file(half, folder / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    (folder / "unet" / "config.json").write_bytes(CONFIG_JSON)
    (folder / "model_index.json").write_text('{"_class_name": "LDMPipeline"}\n')
    hub.add_repo("org/pipe", folder)
    return full, half


def test_download_of_one_file_named_in_the_location_fetches_that_file(
    hub: TestHub, tmp_path: Path
) -> None:
    _, half = publish_unet_with_variant(hub, tmp_path)
    src = "hf://org/pipe/unet/diffusion_pytorch_model.fp16.safetensors"
    # inspect reads it: so does download, in both modes
    assert run_ckpt("inspect", src).exit_code == 0
    dest = tmp_path / "fp16"
    result = run_ckpt("download", src, dest, "--json")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.fp16.safetensors",
    ]
    assert (dest / "diffusion_pytorch_model.fp16.safetensors").read_bytes() == (
        tmp_path / "pipe" / "unet" / "diffusion_pytorch_model.fp16.safetensors"
    ).read_bytes()
    assert result.json["result"]["tensors_total"] == len(half)

    picked = tmp_path / "picked"
    result = run_ckpt("download", src, picked, "--mode", "tensors", "--filter", "blocks.1.*")
    assert result.exit_code == 0, result.stderr
    [written] = picked.glob("*.safetensors")
    assert same(read_file(written), {k: v for k, v in half.items() if k.startswith("blocks.1.")})


def test_verify_checksums_of_a_commit_partly_in_the_cache_names_what_it_did_not_check(
    hub: TestHub, tmp_path: Path
) -> None:
    import os

    from huggingface_hub import save_torch_state_dict, snapshot_download

    folder = tmp_path / "src"
    folder.mkdir()
    save_torch_state_dict(state(2), folder, max_shard_size=3000)
    hub.add_repo("org/model", folder)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 3
    snapshot_download(
        "org/model",
        endpoint=hub.url,
        cache_dir=str(Path(os.environ["HF_HOME"]) / "hub"),
        allow_patterns=[shards[0]],
    )
    result = run_ckpt("verify", "hf://org/model", "--checksums", "--json")
    assert result.exit_code == 0, result.stdout
    report = result.json["result"]
    assert report["hashed_bytes"] == (folder / shards[0]).stat().st_size
    unchecked = {
        Path(p["file"]).name
        for p in report["problems"]
        if p["code"] == "missing_file" and p["severity"] == "warning"
    }
    # every file of the checkpoint the Hub lists but the cache lacks is named as not checked
    assert set(shards[1:]) | {"model.safetensors.index.json"} == unchecked
    text = run_ckpt("verify", "hf://org/model", "--checksums")
    assert text.exit_code == 0 and shards[1] in text.stdout + text.stderr


def publish_both_formats(hub: TestHub, tmp_path: Path) -> dict[str, torch.Tensor]:
    """A repository with the same weights twice, as many hold them: `model.safetensors` and
    `pytorch_model.bin`, with a config, a license and the Hub's `.gitattributes`."""
    weights = state(3)
    folder = tmp_path / "both"
    folder.mkdir()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "config.json").write_bytes(CONFIG_JSON)
    (folder / "LICENSE").write_text("Apache-2.0\n")
    hub.add_repo("org/both", folder)
    return weights


def test_a_repo_with_both_formats_downloads_one_and_names_every_file_it_left(
    hub: TestHub, tmp_path: Path
) -> None:
    publish_both_formats(hub, tmp_path)
    listed = set(hub.repos["model/org/both"].commits[hub.repos["model/org/both"].refs["main"]])
    for mode in ("shards", "tensors"):
        for dry_run in ((), ("--dry-run",)):
            dest = tmp_path / f"{mode}{len(dry_run)}"
            result = run_ckpt("download", "hf://org/both", dest, "--mode", mode, *dry_run, "--json")
            assert result.exit_code == 0, result.stderr
            report = result.json["result"]
            fetched = {f["path"] for f in report["files"] if f["status"] != "written"}
            fetched |= {r["file"] for r in report["ranges"]}
            skipped = {s["name"]: s["reason"] for s in report["skipped"]}
            # nothing vanishes: every file of the repository is fetched (whole or by ranges)
            # or skipped with a reason
            assert fetched | set(skipped) == listed, (mode, dry_run)
            assert not fetched & set(skipped)
            assert "pytorch_model.bin" in skipped and "--include" in skipped["pytorch_model.bin"]
            assert skipped.get("LICENSE")
    # only one copy of the weights came down
    assert sorted(p.name for p in (tmp_path / "shards0").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    text = run_ckpt("download", "hf://org/both", tmp_path / "text")
    assert "pytorch_model.bin" in text.stderr


def test_include_fetches_the_other_format_when_asked(hub: TestHub, tmp_path: Path) -> None:
    weights = publish_both_formats(hub, tmp_path)
    dest = tmp_path / "out"
    result = run_ckpt(
        "download", "hf://org/both", dest, "--include", "*.bin", "--include", "*.json", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
    ]
    assert same(torch.load(dest / "pytorch_model.bin", weights_only=True), weights)
    assert same(read_file(dest / "model.safetensors"), weights)
    assert result.json["result"]["warnings"] == []


def test_a_filtered_download_names_the_shards_it_left(hub: TestHub, tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "src"
    folder.mkdir()
    save_torch_state_dict(state(4), folder, max_shard_size=3000)
    hub.add_repo("org/sharded", folder)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    for mode in ("shards", "tensors"):
        result = run_ckpt(
            "download",
            "hf://org/sharded",
            tmp_path / mode,
            "--mode",
            mode,
            "--filter",
            "blocks.0.conv.*",
            "--no-extras",
            "--json",
        )
        assert result.exit_code == 0, result.stderr
        report = result.json["result"]
        skipped = {s["name"]: s["reason"] for s in report["skipped"]}
        left = [s for s in shards if s in skipped]
        assert len(left) == len(shards) - 1, (mode, skipped)
        assert all("selected" in skipped[s] for s in left)


def test_download_of_a_pipeline_root_names_the_component_folders(
    hub: TestHub, tmp_path: Path
) -> None:
    full, _ = publish_unet_with_variant(hub, tmp_path)
    for mode in ("shards", "tensors"):
        result = run_ckpt("download", "hf://org/pipe", tmp_path / mode, "--mode", mode)
        assert result.exit_code == 4, result.stderr
        message = " ".join(result.stderr.split())
        # not "holds no safetensors checkpoint": it names where the weights are, and the fix
        assert "unet/" in message and "hf://org/pipe/unet" in message, message
        assert not (tmp_path / mode).exists()
    # the fix it names works
    dest = tmp_path / "unet"
    assert run_ckpt("download", "hf://org/pipe/unet", dest).exit_code == 0
    assert same(read_file(dest / "diffusion_pytorch_model.safetensors"), full)


def test_force_never_replaces_the_folder_the_user_is_in(
    hub: TestHub, tmp_path: Path, monkeypatch: object
) -> None:
    import pytest

    publish_both_formats(hub, tmp_path)
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    (work / "notes" / "todo.txt").write_text("mine\n")
    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.chdir(work / "notes")
    # `hf download --local-dir .` adds files to the folder; ckpt replaces DEST whole, so a
    # DEST that is (or holds) the current folder is refused, with --force too
    for dest in (".", ".."):
        for force in ((), ("--force",)):
            result = run_ckpt("download", "hf://org/both", "--local-dir", dest, *force)
            assert result.exit_code == 2, result.stdout + result.stderr
            assert "current folder" in result.stderr and "pass --force" not in result.stderr
    assert (work / "notes" / "todo.txt").read_text() == "mine\n"
    assert sorted(p.name for p in work.iterdir()) == ["notes"]
    # a new folder under it is fine
    assert run_ckpt("download", "hf://org/both", "--local-dir", "model").exit_code == 0
    assert (work / "notes" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_folder_with_both_formats_sharded_reads_as_safetensors_everywhere(
    hub: TestHub, s3_server: object, tmp_path: Path
) -> None:
    """Many Hub repositories (Llama-2 among them) hold `model-*.safetensors` with their index
    and `pytorch_model-*.bin` with theirs: read as the safetensors, as transformers loads them
    and as a folder with one file of each is read, locally, on the Hub and in a bucket."""
    from huggingface_hub import save_torch_state_dict

    from .s3_fixtures import S3Server, upload_folder

    assert isinstance(s3_server, S3Server)
    weights = state(5)
    folder = tmp_path / "both"
    folder.mkdir()
    save_torch_state_dict(weights, folder, max_shard_size=3000)
    save_torch_state_dict(weights, folder, max_shard_size=3000, safe_serialization=False)
    assert (folder / "pytorch_model.bin.index.json").is_file()
    hub.add_repo("org/both-sharded", folder)
    upload_folder(s3_server.endpoint, "bucket", "both", folder)
    for src in (folder, "hf://org/both-sharded", "s3://bucket/both"):
        result = run_ckpt("inspect", src, "--json")
        assert result.exit_code == 0, (src, result.stderr)
        assert result.json["result"]["format"] == "safetensors"
        # the other is read when asked for
        asked = run_ckpt("inspect", src, "--format", "torch", "--json")
        assert asked.exit_code == 0, (src, asked.stderr)
        assert asked.json["result"]["format"] == "torch"
    out = tmp_path / "out"
    result = run_ckpt("convert", "hf://org/both-sharded", out, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    skipped = {s["name"] for s in result.json["result"]["skipped"]}
    assert "pytorch_model.bin.index.json" in skipped
    assert {p.name for p in folder.glob("pytorch_model-*.bin")} <= skipped
    [written] = out.glob("*.safetensors")
    assert same(read_file(written), weights)
    assert run_ckpt("diff", folder, "hf://org/both-sharded").exit_code == 0


def test_a_repo_with_only_pytorch_model_bin_downloads(hub: TestHub, tmp_path: Path) -> None:
    """Older repositories hold one `pytorch_model.bin` and no index: shards mode fetches it
    (the tensors named from its pickle by ranged reads), as it fetches one safetensors file."""
    weights = state(6)
    folder = tmp_path / "old"
    folder.mkdir()
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "config.json").write_bytes(CONFIG_JSON)
    hub.add_repo("org/old", folder)
    dest = tmp_path / "out"
    result = run_ckpt("download", "hf://org/old", dest, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["tensors_total"] == len(weights)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert same(torch.load(dest / "pytorch_model.bin", weights_only=True), weights)
    # a filter that matches nothing is still not found; tensors mode says to use shards mode
    assert run_ckpt("download", "hf://org/old", tmp_path / "none", "--filter", "x*").exit_code == 3
    ranged = run_ckpt("download", "hf://org/old", tmp_path / "t", "--mode", "tensors")
    assert ranged.exit_code == 4 and "--mode shards" in ranged.stderr


def test_a_pipeline_on_the_hub_converts_component_by_component_as_a_local_one(
    hub: TestHub, diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """A diffusers pipeline converted from the Hub keeps its component folders, as one
    converted from disk does: a flat file beside the pipeline's `model_index.json` is no
    pipeline diffusers loads (nor one ckpt reads back)."""
    import warnings

    from diffusers import LDMPipeline

    hub.add_repo("org/ldm", diffusers_pipeline)
    for command, extra in (
        ("convert", ("--to", "safetensors")),
        ("reshard", ("--max-shard-size", "20KB")),
    ):
        dest = tmp_path / command
        result = run_ckpt(command, "hf://org/ldm", dest, *extra)
        assert result.exit_code == 0, result.stdout + result.stderr
        assert list((dest / "unet").glob("diffusion_pytorch_model*.safetensors"))
        assert (dest / "model_index.json").is_file()
        assert run_ckpt("diff", "hf://org/ldm", dest).exit_code == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = LDMPipeline.from_pretrained(dest)
            original = LDMPipeline.from_pretrained(diffusers_pipeline)
        assert same(loaded.unet.state_dict(), original.unet.state_dict())
        assert same(loaded.vqvae.state_dict(), original.vqvae.state_dict())


def test_weights_in_a_subfolder_are_named_as_in_a_subfolder(hub: TestHub, tmp_path: Path) -> None:
    """Llama 3 repositories keep Meta's own `original/consolidated.00.pth` beside the
    transformers weights: not fetched, and said to be in a subfolder (with the location that
    reads it), not "another format beside those read"."""
    weights = state(7)
    folder = tmp_path / "llama"
    (folder / "original").mkdir(parents=True)
    save_file(weights, folder / "model.safetensors")
    torch.save(weights, folder / "original" / "consolidated.00.pth")
    hub.add_repo("org/llama", folder)
    result = run_ckpt("download", "hf://org/llama", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    skipped = {s["name"]: s["reason"] for s in result.json["result"]["skipped"]}
    assert "subfolder" in skipped["original/consolidated.00.pth"]


def test_include_fetches_a_subfolder_in_both_modes(hub: TestHub, tmp_path: Path) -> None:
    weights = state(8)
    folder = tmp_path / "llama"
    (folder / "original").mkdir(parents=True)
    save_file(weights, folder / "model.safetensors")
    torch.save(weights, folder / "original" / "consolidated.00.pth")
    (folder / "original" / "params.json").write_text('{"dim": 16}\n')
    hub.add_repo("org/llama", folder)
    for mode in ("shards", "tensors"):
        dest = tmp_path / mode
        result = run_ckpt(
            "download", "hf://org/llama", dest, "--mode", mode, "--include", "original/*"
        )
        assert result.exit_code == 0, result.stdout + result.stderr
        assert (dest / "original" / "params.json").read_text() == '{"dim": 16}\n'
        pth = dest / "original" / "consolidated.00.pth"
        assert same(torch.load(pth, weights_only=True), weights)
        [written] = dest.glob("*.safetensors")
        assert same(read_file(written), weights)


def test_a_numbered_shard_set_without_its_index_and_with_shards_gone_fails_verify(
    hub: TestHub, tmp_path: Path
) -> None:
    """A filtered download fills the HF cache with some shards of a set and no index: the
    snapshot `org/name` (or any folder holding `model-00002-of-00003.safetensors` alone) is
    not the whole checkpoint, and `verify` says which shards are gone."""
    import os

    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "src"
    folder.mkdir()
    save_torch_state_dict(state(9), folder, max_shard_size=3000)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 3
    hub.add_repo("org/model", folder)
    fetched = run_ckpt("download", "hf://org/model", "--cache-only", "--filter", "blocks.2.*")
    assert fetched.exit_code == 0, fetched.stderr
    cache = Path(os.environ["HF_HOME"]) / "hub" / "models--org--model" / "snapshots"
    [snapshot] = cache.iterdir()
    held = sorted(p.name for p in snapshot.glob("*.safetensors"))
    assert held and held != shards
    result = run_ckpt("verify", snapshot, "--json")
    assert result.exit_code == 1, result.stdout
    missing = {
        Path(p["file"]).name
        for p in result.json["result"]["problems"]
        if p["code"] == "missing_shard"
    }
    assert missing == set(shards) - set(held)


def test_a_repo_id_the_hub_cannot_hold_is_a_usage_error_and_a_spaced_subfolder_reads(
    hub: TestHub, tmp_path: Path
) -> None:
    """A user pastes a name with a space into the repository part (`hf://org/my model`): the
    Hub admits no such repository id, so ckpt says so (exit 2, the id and the rule named), not
    "internal error" from huggingface_hub's validator. A space in the subfolder is fine: file
    names on the Hub may hold one, and the weights there read as from disk."""
    weights = state(3)
    folder = tmp_path / "repo"
    (folder / "my weights").mkdir(parents=True)
    save_file(weights, folder / "my weights" / "model.safetensors")
    hub.add_repo("org/model", folder)

    for command in ("inspect", "verify", "download"):
        args = [command, "hf://org/my model", "--json"]
        if command == "download":
            args.insert(2, str(tmp_path / "out"))
        result = run_ckpt(*args)
        assert result.exit_code == 2, result.stderr
        error = result.json["error"]
        assert "'org/my model' is not a Hub repository id" in error["message"], error
        assert "internal error" not in result.stderr
        assert not (tmp_path / "out").exists()

    result = run_ckpt("download", "hf://org/model/my weights", tmp_path / "got", "--json")
    assert result.exit_code == 0, result.stderr
    assert same(read_file(tmp_path / "got" / "model.safetensors"), weights)
