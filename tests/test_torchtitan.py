"""torchtitan 0.3.0 checkpoints as its own `CheckpointManager.save` writes them (#20).

tests/torchtitan_writer.py trains a tiny llama3 (2 layers, dim 16) for 3 AdamW steps on CPU
with torchtitan's optimizer / LR-scheduler containers and data loader and saves `step-1..3/`
with `CheckpointManager.save`; ground truth is torchtitan's own flattened state dict, and every
output ckpt writes is judged by `CheckpointManager.load` into a fresh model.

The 0.3 layout: the model's FQNs at the top level (`_flattened_model_states_sd`), the fused
attention projection saved split (`…qkv_linear.wq/wk/wv.weight`) while the FQN-keyed optimizer
state names the fused parameter (`optimizer.state.…qkv_linear.wqkv.weight.exp_avg`), beside
`lr_scheduler` (`last_epoch`), `dataloader` (`dp_rank_0` pickled bytes + `world_size`) and
`train_state` (`step`, `ntokens_seen`).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt
from .dist_helpers import torchrun_env
from .run_fixtures import TITAN_STATES

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip(
        "torchtitan is not installed (pip install '.[frameworks]' brings torchtitan 0.3.0; "
        "its CheckpointManager writes these fixtures)",
        allow_module_level=True,
    )
pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

WRITER = Path(__file__).with_name("torchtitan_writer.py")
_STATES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


def titan(*args: str | Path) -> None:
    """Run torchtitan_writer.py (save RUN TRUTH | load RUN STEP OUT) in its own process."""
    proc = subprocess.run(
        [sys.executable, str(WRITER), *map(str, args)],
        capture_output=True,
        text=True,
        env=torchrun_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def titan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A torchtitan run folder (`checkpoint/step-{1,2,3}`) and what step 3 holds."""
    root = tmp_path_factory.mktemp("torchtitan")
    titan("save", root / "run", root / "truth.pt")
    return root / "run", torch.load(root / "truth.pt", weights_only=True)


def _weights(truth: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in truth.items() if not k.startswith(_STATES) and k != "next_batch"}


def _loads_back(run_root: Path, converted: Path, truth: dict[str, Any]) -> None:
    """`converted` restores in torchtitan's own CheckpointManager.load exactly as step 3 did:
    weights, optimizer moments and step, scheduler, train state and the next batch."""
    folder = run_root / "checkpoint"
    folder.mkdir(parents=True)
    shutil.copytree(converted, folder / "step-3")
    titan("load", run_root, 3, run_root / "back.pt")
    back = torch.load(run_root / "back.pt", weights_only=True)
    assert back.keys() == truth.keys()
    for key, want in truth.items():
        got = back[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got == want, key


def test_inspect_reports_what_torchtitan_saved(titan_run: tuple[Path, dict[str, Any]]) -> None:
    run, truth = titan_run
    result = run_ckpt("inspect", run / "checkpoint" / "step-3", "--json").json["result"]
    training = result["training"]
    weights = _weights(truth)
    assert training["layout"] == "torchtitan"
    assert training["step"] == truth["train_state.step"] == 3
    assert training["weights"]["tensors"] == len(weights)
    assert training["weights"]["parameters"] == sum(t.numel() for t in weights.values())
    assert training["optimizer"]["kind"] == "AdamW"
    assert training["optimizer"]["complete"] is True
    assert training["scheduler"]["last_epoch"] == truth["lr_scheduler.last_epoch"]
    assert training["dataloader"] is not None
    assert training["resumable"] is True and training["missing_exact"] == ["rng"]
    # every tensor torchtitan saved, with its name, dtype and shape
    tensors = {e["name"]: e for e in result["entries"] if e["kind"] == "tensor"}
    saved = {k: v for k, v in truth.items() if isinstance(v, torch.Tensor) and k != "next_batch"}
    assert tensors.keys() == saved.keys()
    for name, tensor in saved.items():
        assert tensors[name]["shape"] == list(tensor.shape), name
        assert tensors[name]["dtype"] == str(tensor.dtype).removeprefix("torch."), name
    objects = {e["name"]: e.get("value") for e in result["entries"] if e["kind"] == "object"}
    assert objects["train_state.ntokens_seen"] == truth["train_state.ntokens_seen"]


def test_verify_resumable_lines_the_fused_qkv_optimizer_state_up(
    titan_run: tuple[Path, dict[str, Any]],
) -> None:
    run, truth = titan_run
    # the optimizer keys the fused parameter, the weights are saved split
    assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in truth
    assert "layers.0.attention.qkv_linear.wq.weight" in truth
    result = run_ckpt("verify", run / "checkpoint" / "step-3", "--resumable", "--json")
    assert result.exit_code == 0, result.stdout
    problems = result.json["result"]["problems"]
    assert [(p["code"], p["severity"]) for p in problems] == [("missing_rng", "warning")]


def test_verify_good_and_damaged_copies(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    run, _ = titan_run
    step = run / "checkpoint" / "step-3"
    assert run_ckpt("verify", step).exit_code == 0
    # a deleted shard
    gone = shutil.copytree(step, tmp_path / "gone" / "step-3")
    for shard in gone.glob("*.distcp"):
        shard.unlink()
    result = run_ckpt("verify", gone)
    assert result.exit_code == 1, result.stdout
    assert "__0_0.distcp" in result.stdout
    # the same step re-saved without its optimizer, its train_state kept: torchtitan saves
    # the optimizer with every train_state, so plain verify fails it too, naming the rule
    full: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        full = _load_state_dict_from_keys(checkpoint_id=str(step))
        no_opt = {k: v for k, v in full.items() if k != "optimizer"}
        dcp.save(no_opt, checkpoint_id=str(tmp_path / "no_opt" / "step-3"), no_dist=True)
    damaged = tmp_path / "no_opt" / "step-3"
    plain = run_ckpt("verify", damaged)
    assert plain.exit_code == 1 and "missing_optimizer" in plain.stdout
    assert "train_state" in plain.stdout and "CheckpointManager" in plain.stdout
    result = run_ckpt("verify", damaged, "--resumable", "--json")
    assert result.exit_code == 1
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert "missing_optimizer" in codes, codes
    # a model-only save (the `last_save_model_only` export: the model's keys alone) is whole
    model_only = {k: v for k, v in full.items() if k not in TITAN_STATES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model_only, checkpoint_id=str(tmp_path / "export" / "step-3"), no_dist=True)
    assert run_ckpt("verify", tmp_path / "export" / "step-3").exit_code == 0


def test_convert_select_model_is_bit_exact(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, truth = titan_run
    out = tmp_path / "model.safetensors"
    result = run_ckpt(
        "convert", run / "checkpoint" / "step-3", out, "--to", "safetensors", "--select", "model"
    )
    assert result.exit_code == 0, result.stderr
    got = load_file(out)
    weights = _weights(truth)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)


@pytest.mark.parametrize(
    ("options", "how"),
    [
        (("--to", "hf", "--config", "CONFIG"), "--to hf exports the model's weights only"),
        (("--to", "safetensors", "--select", "model"), "outside --select model"),
    ],
    ids=["to-hf", "select-model"],
)
def test_an_export_lists_the_training_state_it_leaves_behind(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path, options: tuple[str, ...], how: str
) -> None:
    """torchtitan keeps the optimizer, LR scheduler, data loader and train state in the same
    `.distcp` file as the weights. An export takes the weights alone and says so: each
    component left behind is listed as skipped with why (in the JSON and on stderr), as a
    Trainer save's `optimizer.pt` is. They used to vanish from the report without a word."""
    from transformers import LlamaConfig

    sys.path.insert(0, str(WRITER.parent))
    from torchtitan_writer import DIM, HEADS, LAYERS, VOCAB

    run, _ = titan_run
    config = tmp_path / "config.json"
    LlamaConfig(
        hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, vocab_size=VOCAB, intermediate_size=48,
        tie_word_embeddings=False,
    ).to_json_file(config)  # fmt: skip
    args = [str(config) if o == "CONFIG" else o for o in options]
    step = run / "checkpoint" / "step-3"
    result = run_ckpt("convert", step, tmp_path / "out", *args, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    skipped = {s["name"]: s for s in result.json["result"]["skipped"]}
    # the four components, and nothing of the model
    assert skipped.keys() == {"optimizer", "lr_scheduler", "dataloader", "train_state"}
    for component in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
        assert skipped[component]["kind"] == "component", skipped
        assert how in skipped[component]["reason"], skipped[component]
    human = run_ckpt("convert", step, tmp_path / "human", *args)
    assert human.exit_code == 0, human.stderr
    line = next(x for x in human.stderr.splitlines() if "optimizer" in x)
    assert "skipped 4 components" in line and "lr_scheduler" in line, human.stderr
    assert "train_state" in line and "dataloader" in line, human.stderr


def test_convert_to_dcp_loads_back_in_torchtitan(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, truth = titan_run
    out = tmp_path / "converted"
    result = run_ckpt("convert", run / "checkpoint" / "step-3", out, "--to", "dcp")
    assert result.exit_code == 0, result.stderr
    _loads_back(tmp_path / "run", out, truth)


def test_reshard_to_two_ranks_loads_back_in_torchtitan(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, truth = titan_run
    step = run / "checkpoint" / "step-3"
    out = tmp_path / "resharded"
    # the data loader's per-rank state cannot be split: ckpt says so and asks for a choice
    refused = run_ckpt("reshard", step, out, "--world-size", "2")
    assert refused.exit_code == 2 and "dataloader.dp_rank_0" in refused.stderr
    result = run_ckpt("reshard", step, out, "--world-size", "2", "--rank-state", "keep")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    _loads_back(tmp_path / "run", out, truth)


def test_latest_and_prune_on_a_torchtitan_run(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run, _ = titan_run
    latest = run_ckpt("latest", run)
    assert latest.exit_code == 0, latest.stderr
    assert Path(latest.stdout.strip()) == run / "checkpoint" / "step-3"
    copy = shutil.copytree(run, tmp_path / "run")
    result = run_ckpt("prune", copy, "--keep-last", "1", "--settle", "0", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (copy / "checkpoint").iterdir()) == ["step-3"]
    assert run_ckpt("verify", copy / "checkpoint" / "step-3", "--resumable").exit_code == 0


def test_layout_protocol_opens_a_step_and_declines_a_plain_dcp(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    from ckpt_cli.formats import resolve_source
    from ckpt_cli.sources.layouts import TorchTitan

    run, truth = titan_run
    layout = TorchTitan()
    step = resolve_source(str(run / "checkpoint" / "step-3"))
    assert layout.recognise(step) and layout.step_of("step-3") == 3
    opened = layout.open(step)
    assert opened is not None and opened.training is not None
    with opened.checkpoint:
        assert opened.training.layout == "torchtitan" and opened.training.step == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_weights(truth), checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert layout.open(resolve_source(str(tmp_path / "plain"))) is None


def test_diff_select_model_takes_the_same_top_level_keys_convert_does(
    titan_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """torchtitan keeps the model's keys at the top level: `--select model` means those keys
    in diff as in convert (one rule), never the whole step with its optimizer and states."""
    import torch.distributed.checkpoint as dcp

    run, truth = titan_run
    step = run / "checkpoint" / "step-3"
    weights = _weights(truth)
    out = tmp_path / "model"
    made = run_ckpt("convert", step, out, "--to", "dcp", "--select", "model")
    assert made.exit_code == 0, made.stderr
    # what convert wrote is the model, as dcp.load restores it
    restored = {k: torch.zeros_like(v) for k, v in weights.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(restored, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(restored[k], weights[k]) for k in weights)
    for a, b in ((step, out), (out, step)):
        result = run_ckpt("diff", a, b, "--select", "model", "--json")
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert report["identical"] and report["compared"] == len(weights)
        assert not report["only_a"] and not report["only_b"]
    # two steps differ in their weights only, as far as --select model looks
    earlier = run_ckpt("diff", run / "checkpoint" / "step-2", step, "--select", "model", "--json")
    assert earlier.exit_code == 1
    report = earlier.json["result"]
    assert report["compared"] == len(weights) and not report["only_a"] and not report["only_b"]
    assert {d["name"] for d in report["differences"]} <= weights.keys()
    assert not set(report["components"]) & {s.rstrip(".") for s in _STATES}


@pytest.fixture(scope="module")
def titan_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """`step-3` of the same run on 2 data-parallel ranks under torchrun (each rank's data loader
    saves its own `dataloader.dp_rank_{r}`), and what rank 0 held."""
    from .dist_helpers import run_torchrun

    root = tmp_path_factory.mktemp("torchtitan2")
    run_torchrun(WRITER, 2, "save", root / "run", root / "truth.pt", timeout=900)
    step = root / "run" / "checkpoint" / "step-3"
    assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    return step, torch.load(root / "truth.pt", weights_only=True)


def _restored_as(back: dict[str, Any], truth: dict[str, Any], world: int) -> None:
    """What CheckpointManager.load restored on a rank of `world`: everything step 3 held; the
    data loader's dp degree is the new one (its own state_dict reports it)."""
    assert back.keys() == truth.keys()
    assert truth["dataloader.world_size"] == 2 and back["dataloader.world_size"] == world
    for key, want in truth.items():
        if key == "dataloader.world_size":
            continue
        got = back[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got == want, key


@pytest.mark.torchrun
# a 2-rank torchtitan run, then its reshard loaded by torchtitan on up to 3 ranks: several
# minutes of framework start-up on a busy CPU, more than the suite's default 300 s
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 3])
def test_two_rank_step_resharded_to_1_and_3_ranks_loads_in_torchtitan(
    titan_two_ranks: tuple[Path, dict[str, Any]], tmp_path: Path, world: int
) -> None:
    from .dist_helpers import run_torchrun

    step, truth = titan_two_ranks
    run_root = tmp_path / "run"
    out = run_root / "checkpoint" / "step-3"
    out.parent.mkdir(parents=True)
    result = run_ckpt(
        "reshard", step, out, "--world-size", world, "--rank-state", "replicate", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = result.json["result"]
    written = {e["name"]: e["written"] for e in report["rank_state"]}
    if world == 1:
        assert written == {
            "dataloader.dp_rank_0": ["dataloader.dp_rank_0"],
            "dataloader.dp_rank_1": [],
        }
    else:
        assert written["dataloader.dp_rank_0"] == [
            "dataloader.dp_rank_0",
            "dataloader.dp_rank_2",
        ]
    assert report["resume"]["resumable"] is True and report["resume"]["exact"] is False
    # torchtitan's own loader on the new number of ranks (its dp degree check passes: the
    # saved `dataloader.world_size` is the new one)
    if world == 1:
        titan("load", run_root, 3, run_root / "back.pt")
    else:
        run_torchrun(WRITER, world, "load", run_root, 3, run_root / "back.pt", timeout=900)
    for rank in range(world):
        back = torch.load(run_root / f"back.rank{rank}.pt", weights_only=True)
        _restored_as(back, truth, world)
