"""The `hub` fixture: a real HTTP Hub on 127.0.0.1 that huggingface_hub talks to.

The fixture is registered in `tests/conftest.py` (`pytest_plugins`); import the helpers:
`from .hub_fixtures import publish_model`, `from .hub_server import TestHub`.

    def test_x(hub: TestHub, tmp_path: Path) -> None:
        commit = publish_model(hub, "org/model", tmp_path / "src", state, max_shard_size=4096)
        result = run_ckpt("inspect", "hf://org/model", "--json")
        assert hub.bytes_sent("org/model", "model-00001-of-00003.safetensors") < 4096

The fixture sets `HF_ENDPOINT` to the server, `HF_HOME` (so the HF cache) to a fresh temporary
folder, and clears the token, cache and offline variables, for the test's duration.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .hub_server import TestHub

if TYPE_CHECKING:
    import torch

CONFIG_JSON = b'{"model_type": "tiny", "hidden_size": 64}\n'
TOKENIZER_JSON = b'{"version": "1.0", "model": {"type": "BPE"}}\n'


@pytest.fixture
def hub(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestHub]:
    """A started `TestHub`; HF_ENDPOINT points at it and HF_HOME is a fresh folder."""
    server = TestHub().start()
    home = tmp_path_factory.mktemp("hf-home")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(name, raising=False)
    try:
        yield server
    finally:
        server.stop()


def publish_model(
    hub: TestHub,
    repo_id: str,
    folder: Path,
    state: dict[str, torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    extras: bool = True,
    revision: str = "main",
    token: str | None = None,
) -> str:
    """Save `state` with `huggingface_hub.save_torch_state_dict` into `folder`, publish it.

    With `extras`, a `config.json` and a `tokenizer.json` are published beside the weights.
    Returns the commit id.
    """
    from huggingface_hub import save_torch_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
    if extras:
        (folder / "config.json").write_bytes(CONFIG_JSON)
        (folder / "tokenizer.json").write_bytes(TOKENIZER_JSON)
    return hub.add_repo(repo_id, folder, revision=revision, token=token)
