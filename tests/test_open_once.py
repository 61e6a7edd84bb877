"""Each operation resolves its SRC once and passes what it opened down (issues #14 §2, #26).

`verify --deep` used to resolve the source up to six times (the structure check, the
quantization check and the deep read each resolved and listed SRC again, and opened it again);
`convert` three times, `reshard` four, `inspect hf://` twice; over an object store or the Hub
each resolution is a listing round trip. These tests count, on real checkpoints, how often the
checkpoint folder is resolved (a `LocalStorage` built for it) and listed, and a run folder's
top level listed, while each command does its whole job; over the test Hub, how often the
repository's revision is resolved and its files listed (the Hub's own request log).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpt_cli.storage import LocalStorage

from .conftest import run_ckpt
from .hub_fixtures import publish_model
from .hub_server import TestHub
from .run_fixtures import dcp_save, trainer_checkpoint, trainer_run, weights
from .s3_fixtures import S3Server, make_bucket


class Counts:
    """How often each folder was resolved (a storage built on it) and listed."""

    def __init__(self) -> None:
        self.resolved: collections.Counter[Path] = collections.Counter()
        self.listed: collections.Counter[Path] = collections.Counter()
        #: a run folder's entries read (`Path.iterdir`)
        self.iterated: collections.Counter[Path] = collections.Counter()

    def of(self, folder: Path) -> tuple[int, int, int]:
        """(resolved, listed, iterated) of `folder` since the last call, which resets them."""
        root = folder.resolve()
        seen = (self.resolved[root], self.listed[root], self.iterated[root])
        for counter in (self.resolved, self.listed, self.iterated):
            counter.clear()
        return seen


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    seen = Counts()
    real_init = LocalStorage.__init__
    real_list = LocalStorage.list_files

    def init(self: LocalStorage, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.resolved[Path(self.root).resolve()] += 1

    def list_files(self: LocalStorage) -> dict[str, int]:
        seen.listed[Path(self.root).resolve()] += 1
        return real_list(self)

    real_iterdir = Path.iterdir

    def iterdir(self: Path) -> Iterator[Path]:
        seen.iterated[self.resolve()] += 1
        return real_iterdir(self)

    monkeypatch.setattr(LocalStorage, "__init__", init)
    monkeypatch.setattr(LocalStorage, "list_files", list_files)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    yield seen


def _sharded_model(folder: Path) -> Path:
    folder.mkdir()
    save_torch_state_dict(weights(1), folder, max_shard_size=300)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_verify_deep_resolves_and_lists_a_sharded_model_once(
    tmp_path: Path, counts: Counts
) -> None:
    folder = _sharded_model(tmp_path / "model")
    result = run_ckpt("verify", folder, "--deep", "--json")
    assert result.exit_code == 0, result.output
    report = result.json["result"]
    assert report["ok"] and "deep" in report["checks"]
    root = folder.resolve()
    assert counts.resolved[root] == 1  # 0.1.0: 6
    # `SafetensorsFormat.check` reads the source's listing, not one of its own (0.1.0: 7)
    assert counts.listed[root] == 1


def test_verify_deep_resumable_opens_a_trainer_folder_once(tmp_path: Path, counts: Counts) -> None:
    folder = tmp_path / "checkpoint-7"
    trainer_checkpoint(folder, 7)
    result = run_ckpt("verify", folder, "--deep", "--resumable", "--json")
    report = result.json["result"]
    assert report["format"] == "hf-trainer"
    assert "deep" in report["checks"] and "resumable" in report["checks"]
    assert report["training"]["step"] == 7
    root = folder.resolve()
    assert counts.resolved[root] == 1  # 0.1.0: 3
    assert counts.listed[root] == 1


def test_verify_deep_resolves_a_dcp_folder_once(tmp_path: Path, counts: Counts) -> None:
    folder = tmp_path / "step-3"
    dcp_save(folder, 3)
    result = run_ckpt("verify", folder, "--deep", "--json")
    assert result.exit_code == 0, result.output
    report = result.json["result"]
    assert report["ok"] and "deep" in report["checks"]
    assert counts.resolved[folder.resolve()] == 1  # 0.1.0: 6
    assert counts.listed[folder.resolve()] == 1


def test_inspect_and_diff_resolve_each_side_once(tmp_path: Path, counts: Counts) -> None:
    a = _sharded_model(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    torch.save(weights(1), b / "model.pt")
    assert run_ckpt("inspect", a, "--json").exit_code == 0
    assert counts.resolved[a.resolve()] == 1
    counts.resolved.clear()
    result = run_ckpt("diff", a, b / "model.pt", "--json")
    assert result.exit_code == 0, result.output
    assert counts.resolved[a.resolve()] == 1
    assert counts.resolved[b.resolve()] == 1


def _ok(*args: Any) -> dict[str, Any]:
    result = run_ckpt(*args, "--json")
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = result.json["result"]
    return report


def test_convert_and_reshard_resolve_a_sharded_model_once(tmp_path: Path, counts: Counts) -> None:
    folder = _sharded_model(tmp_path / "model")
    counts.of(folder)
    _ok("convert", folder, tmp_path / "pt", "--to", "torch")
    assert counts.of(folder)[:2] == (1, 1)  # 0.1.0: resolved 3 times
    _ok("convert", folder, tmp_path / "dcp", "--to", "dcp", "--world-size", "2")
    assert counts.of(folder)[:2] == (1, 1)
    report = _ok("reshard", folder, tmp_path / "resharded", "--max-shard-size", "1KB")
    assert report["verified"]
    assert counts.of(folder)[:2] == (1, 1)  # 0.1.0: resolved 4 times


def test_convert_and_reshard_resolve_a_trainer_folder_once(tmp_path: Path, counts: Counts) -> None:
    folder = tmp_path / "checkpoint-7"
    trainer_checkpoint(folder, 7)
    counts.of(folder)
    _ok("convert", folder, tmp_path / "st", "--to", "safetensors")
    assert counts.of(folder)[:2] == (1, 1)  # 0.1.0: 3
    report = _ok("reshard", folder, tmp_path / "resharded", "--max-shard-size", "1KB")
    assert report["carried"]  # the optimizer, scheduler, RNG and trainer state came along
    assert counts.of(folder)[:2] == (1, 1)  # 0.1.0: 4


def test_reshard_to_another_world_size_resolves_a_dcp_folder_once(
    tmp_path: Path, counts: Counts
) -> None:
    folder = tmp_path / "step-3"
    dcp_save(folder, 3)
    counts.of(folder)
    # the data loader's per-rank state torchtitan saves comes along as saved
    report = _ok("reshard", folder, tmp_path / "two", "--world-size", "2", "--rank-state", "keep")
    assert report["verified"]
    assert counts.of(folder)[:2] == (1, 1)  # 0.1.0: 2


def test_protect_and_repair_resolve_their_checkpoint_once(tmp_path: Path, counts: Counts) -> None:
    folder = _sharded_model(tmp_path / "model")
    counts.of(folder)
    _ok("protect", folder)
    assert counts.of(folder)[:2] == (1, 1)
    _ok("repair", folder)
    assert counts.of(folder)[:2] == (1, 1)


@pytest.mark.slow
def test_run_commands_list_the_run_folder_once(
    tmp_path: Path, counts: Counts, s3_server: S3Server
) -> None:
    run = trainer_run(tmp_path / "run", steps=(100, 200, 300))
    counts.of(run)
    assert _ok("latest", run)["latest"] == str(run / "checkpoint-300")
    assert counts.of(run) == (1, 0, 1)  # 0.1.0: the top level read 3 times
    plan = _ok("prune", run, "--keep-last", "1")
    assert plan["to_delete"] == 1 and not plan["applied"]  # the best one (200) is kept
    assert counts.of(run) == (1, 0, 1)  # 0.1.0: 3
    report = run_ckpt("doctor", run, "--json")
    assert report.exit_code == 0, report.output
    assert report.json["result"]["mode"] == "run"
    # resolved once (0.1.0: twice, the scan then the logs); the run check and the scan still
    # each read the top level of a local run folder
    assert counts.of(run)[:2] == (1, 1)
    make_bucket(s3_server.endpoint, "ckpt-once")
    synced = _ok("sync", run, "s3://ckpt-once/run/")
    assert {c["action"] for c in synced["checkpoints"]} == {"uploaded"}
    assert counts.of(run)[2] == 1


def _hub_lookups(hub: TestHub) -> tuple[int, int]:
    """(revision resolutions, file listings) the Hub answered since the last call: repo info
    names the commit, and with its files' metadata (`blobs=true`) lists them in the same
    request; a tree listing lists. huggingface_hub's agent registry is neither."""
    api = [
        r.path for r in hub.log if r.path.startswith("/api/") and "agent-harnesses" not in r.path
    ]
    hub.reset_counters()
    resolved = sum("/tree/" not in p for p in api)
    listed = sum("/tree/" in p or "blobs=" in p for p in api)
    return resolved, listed


@pytest.mark.parametrize(
    "command",
    [
        ("inspect",),  # 0.1.0: 2 (the run-folder check resolved SRC on its own)
        ("verify", "--deep"),
        ("verify", "--checksums"),
        ("convert", "{out}", "--to", "torch"),
        ("reshard", "{out}", "--max-shard-size", "1KB"),
        ("download", "{out}"),
        ("download", "{out}", "--mode", "tensors", "--filter", "*layers.0*"),
    ],
    ids=lambda c: "-".join(a for a in c if not a.startswith(("{", "*"))),
)
def test_every_command_resolves_and_lists_a_hub_repository_once(
    hub: TestHub, tmp_path: Path, command: tuple[str, ...]
) -> None:
    publish_model(hub, "org/model", tmp_path / "src", weights(1), max_shard_size=300)
    hub.reset_counters()
    args = [a.format(out=tmp_path / "out") for a in command]
    _ok(args[0], "hf://org/model", *args[1:])
    assert _hub_lookups(hub) == (1, 1)


def test_diff_resolves_a_hub_side_once(hub: TestHub, tmp_path: Path) -> None:
    publish_model(hub, "org/model", tmp_path / "src", weights(1), max_shard_size=300)
    hub.reset_counters()
    report = _ok("diff", "hf://org/model", tmp_path / "src")
    assert report["equal"]
    assert _hub_lookups(hub) == (1, 1)


def test_merge_resolves_the_base_and_the_adapter_once(
    tiny_llama: Path, lora_adapter: Path, tmp_path: Path, counts: Counts
) -> None:
    report = _ok("merge", tiny_llama, lora_adapter, tmp_path / "merged")
    assert report["merged"]
    base, adapter = tiny_llama.resolve(), lora_adapter.resolve()
    assert (counts.resolved[base], counts.listed[base]) == (1, 1)  # 0.1.0: resolved 3 times
    assert (counts.resolved[adapter], counts.listed[adapter]) == (1, 1)  # 0.1.0: 2
