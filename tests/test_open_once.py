"""Each operation resolves its SRC once and passes what it opened down (issue #14 §2).

`verify --deep` used to resolve the source up to six times (the structure check, the
quantization check and the deep read each resolved and listed SRC again, and opened it again);
over an object store or the Hub each resolution is a listing round trip. These tests count,
on real checkpoints, how often the checkpoint folder is resolved (a `LocalStorage` built for
it) and listed, while the command does its whole job.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpt_cli.storage import LocalStorage

from .conftest import run_ckpt
from .run_fixtures import dcp_save, trainer_checkpoint, weights


class Counts:
    """How often each folder was resolved (a storage built on it) and listed."""

    def __init__(self) -> None:
        self.resolved: collections.Counter[Path] = collections.Counter()
        self.listed: collections.Counter[Path] = collections.Counter()


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

    monkeypatch.setattr(LocalStorage, "__init__", init)
    monkeypatch.setattr(LocalStorage, "list_files", list_files)
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
    # the source's listing, and the one `SafetensorsFormat.check` still takes itself (0.1.0: 7)
    assert counts.listed[root] <= 2


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
