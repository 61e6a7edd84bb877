"""torchtitan 0.3 step folders as its CheckpointManager writes them: the model's FQNs at the top
level (`_flattened_model_states_sd`), beside `optimizer` (flattened, FQN-keyed),
`lr_scheduler`, `dataloader` (`dp_rank_N` pickled bytes + `world_size`) and `train_state`
(`step`, `ntokens_seen`).

torchtitan itself is not installed here (its trainer needs CUDA and triton); the fixture is the
same state dict built from the same torch APIs torchtitan 0.3.0 calls
(`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`, `LambdaLR.state_dict()`)
and saved with `dcp.save`, as `CheckpointManager.save` does."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt


class _Llama(torch.nn.Module):
    """torchtitan's llama3 FQNs at toy size (hidden 16, 2 layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleDict(
            {
                str(i): torch.nn.ModuleDict(
                    {
                        "attention": torch.nn.ModuleDict(
                            {"wq": torch.nn.Linear(16, 16, bias=False)}
                        ),
                        "feed_forward": torch.nn.ModuleDict(
                            {"w1": torch.nn.Linear(16, 32, bias=False)}
                        ),
                    }
                )
                for i in range(2)
            }
        )
        self.norm = torch.nn.LayerNorm(16)
        self.output = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = h + layer["attention"]["wq"](h)  # type: ignore[index,operator]
            h = h + layer["feed_forward"]["w1"](h)[..., :16]  # type: ignore[index,operator]
        out: torch.Tensor = self.output(self.norm(h))
        return out


@pytest.fixture(scope="module")
def titan_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = _Llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 10))
    for _ in range(2):
        model(torch.randint(0, 32, (2, 4))).sum().backward()
        optimizer.step()
        scheduler.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states: dict[str, Any] = dict(weights)  # CheckpointManager._flattened_model_states_sd
    states["optimizer"] = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    states["lr_scheduler"] = scheduler.state_dict()
    states["dataloader"] = {"dp_rank_0": pickle.dumps({"sample_idx": 8}), "world_size": 1}
    states["train_state"] = {"step": 2, "ntokens_seen": 16}
    path = tmp_path_factory.mktemp("titan") / "checkpoint" / "step-2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(states, checkpoint_id=str(path), no_dist=True)
    return path, weights


def test_top_level_model_keys_are_the_weights(
    titan_step: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, weights = titan_step
    training = run_ckpt("inspect", path, "--json").json["result"]["training"]
    assert training["layout"] == "torchtitan"
    assert training["step"] == 2
    assert training["weights"]["tensors"] == len(weights)
    assert training["weights"]["parameters"] == sum(t.numel() for t in weights.values())
    assert "weights" not in training["missing"]
    assert training["optimizer"]["complete"] is True


def test_select_model_extracts_the_weights_with_their_fqns(
    titan_step: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, weights = titan_step
    out = tmp_path / "model.safetensors"
    result = run_ckpt("convert", path, out, "--to", "safetensors", "--select", "model")
    assert result.exit_code == 0, result.stderr
    got = load_file(out)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    # the whole step converts to DCP with torchtitan's names untouched (it loads back)
    import torch.distributed.checkpoint as dcp

    copy = tmp_path / "copy"
    assert run_ckpt("convert", path, copy, "--to", "dcp").exit_code == 0
    target = {k: torch.empty_like(v) for k, v in weights.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(copy), no_dist=True)
    assert all(torch.equal(target[k], weights[k]) for k in weights)


def test_verify_good_and_damaged_step(
    titan_step: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    import shutil

    path, _ = titan_step
    assert run_ckpt("verify", path).exit_code == 0
    damaged = shutil.copytree(path, tmp_path / "step-2")
    for shard in damaged.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    assert run_ckpt("verify", damaged).exit_code == 1
