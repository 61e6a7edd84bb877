"""Nothing vanishes silently, in any layout: the invariant, over every layout fixture.

For each layout ckpt recognises, built by the suite's own fixture builders (the frameworks' save
code where the suite has it), a user converts the whole SRC:

- every file of SRC is read into the output, carried verbatim (`extras`) or listed in
  `skipped` (kind `file`) with a reason, by the `--json` report;
- `diff SRC OUT` compares every component both sides hold and finds them equal;
- a copy that lost a component (converted with `--filter-out` of it) is DIFFERENT, the lost
  entries counted as only in SRC.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import run_ckpt
from .dist_helpers import dcp_save, training_state
from .run_fixtures import dcp_save as titan_style_save
from .run_fixtures import trainer_checkpoint, weights
from .test_layout_registry import _lightning_file
from .test_torch_format import training_dict

#: layout -> (how to get SRC from the fixtures, the target a whole conversion writes, DEST name)
Builder = Callable[[pytest.FixtureRequest, Path], Path]


def _trainer_synthetic(request: pytest.FixtureRequest, tmp: Path) -> Path:
    trainer_checkpoint(tmp / "checkpoint-300", 300, shards=True)
    return tmp / "checkpoint-300"


def _torch_dict(request: pytest.FixtureRequest, tmp: Path) -> Path:
    torch.save(training_dict(), tmp / "train.pt")
    return tmp / "train.pt"


def _dcp_training(request: pytest.FixtureRequest, tmp: Path) -> Path:
    dcp_save(training_state(), tmp / "dcp")
    return tmp / "dcp"


def _titan_style(request: pytest.FixtureRequest, tmp: Path) -> Path:
    titan_style_save(tmp / "step-5", 5)
    return tmp / "step-5"


def _lightning(request: pytest.FixtureRequest, tmp: Path) -> Path:
    return _lightning_file(tmp / "epoch=1-step=30.ckpt", 30)


def _safetensors_sharded(request: pytest.FixtureRequest, tmp: Path) -> Path:
    from huggingface_hub import save_torch_state_dict

    (tmp / "sharded").mkdir()
    save_torch_state_dict(weights(1), tmp / "sharded", max_shard_size=300)
    (tmp / "sharded" / "README.md").write_text("a model card\n")
    return tmp / "sharded"


def _fixture(name: str, *path: str) -> Builder:
    def build(request: pytest.FixtureRequest, tmp: Path) -> Path:
        value: Any = request.getfixturevalue(name)
        if isinstance(value, tuple):  # (folder, what its framework loads from it)
            value = value[0]
        for part in path:
            value = value[part] if isinstance(value, dict) else value / part
        return Path(value)

    return build


_FRAMEWORKS = pytest.mark.frameworks
_TORCHRUN = pytest.mark.torchrun
_SLOW = pytest.mark.timeout(1200)

CASES = [
    pytest.param(_trainer_synthetic, "torch", "whole.pt", "optimizer", id="trainer"),
    pytest.param(
        _fixture("trainer_runs", "full", "checkpoint-2"),
        "torch",
        "whole.pt",
        "optimizer",
        id="trainer-real",
        marks=_FRAMEWORKS,
    ),
    pytest.param(
        _fixture("real_accelerate_run", "straight", "step-4"),
        "dcp",
        "whole",
        "optimizer",
        id="accelerate-real",
        marks=_FRAMEWORKS,
    ),
    pytest.param(
        _fixture("accelerate_fsdp_saves", "sharded"),
        "torch",
        "whole.pt",
        "optimizer_1",
        id="accelerate-fsdp-sharded",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(
        _fixture("accelerate_fsdp_saves", "full"),
        "dcp",
        "whole",
        "optimizer_1",
        id="accelerate-fsdp-full",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(
        _fixture("accelerate_fsdp_rank_files"),
        "torch",
        "whole.pt",
        "optimizer_1_rank",  # accelerate's per-rank files (`use_dcp=False`): one rank each
        id="accelerate-fsdp-rank-files",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(_torch_dict, "dcp", "whole", "optimizer", id="torch-dict"),
    pytest.param(_dcp_training, "torch", "whole.pt", "optimizer", id="dcp"),
    pytest.param(_titan_style, "torch", "whole.pt", "train_state", id="dcp-step-folder"),
    pytest.param(
        _fixture("titan_run", "checkpoint", "step-3"),
        "torch",
        "whole.pt",
        "optimizer",
        id="torchtitan",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(
        _fixture("saved"),
        "dcp",
        "whole",
        "decoder",
        id="megatron",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(
        _fixture("zero_runs", "zero2"),
        "torch",
        "whole.pt",
        "optim_states",  # the ZeRO partitions' files: `optim_states_<rank>` components
        id="deepspeed-zero2",
        marks=[_FRAMEWORKS, _TORCHRUN, _SLOW],
    ),
    pytest.param(_lightning, "dcp", "whole", "optimizer_states", id="lightning"),
    pytest.param(_safetensors_sharded, "torch", "out", "model.layers.0", id="safetensors-sharded"),
    pytest.param(
        _fixture("tiny_llama"), "torch", "out", "lm_head", id="hf-model", marks=_FRAMEWORKS
    ),
    pytest.param(
        _fixture("lora_adapter"),
        "safetensors",
        "out",
        "base_model.model.model.layers.0",
        id="peft",
        marks=_FRAMEWORKS,
    ),
    pytest.param(
        _fixture("diffusers_pipeline"),
        "safetensors",
        "out",
        "unet.conv_in",  # a multi-folder model: --filter-out matches the names inspect shows
        id="diffusers",
        marks=_FRAMEWORKS,
    ),
    pytest.param(
        _fixture("sentence_transformer"),
        "safetensors",
        "out",
        "0_Transformer.embeddings",
        id="sentence-transformers",
        marks=_FRAMEWORKS,
    ),
]

# fixtures of other test modules, shared here (pytest finds them by name)
from .test_deepspeed import zero_runs  # noqa: E402,F401
from .test_megatron import saved  # noqa: E402,F401
from .test_torchtitan import titan_run  # noqa: E402,F401


def _files(src: Path) -> set[str]:
    if src.is_file():
        return {src.name}
    return {
        Path(dirpath, name).relative_to(src).as_posix()
        for dirpath, _, names in os.walk(src)
        for name in names
    }


@pytest.mark.parametrize(("build", "to", "dest", "component"), CASES)
@pytest.mark.slow
def test_every_file_is_converted_carried_or_skipped_and_diff_sees_every_component(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    build: Builder,
    to: str,
    dest: str,
    component: str,
) -> None:
    src = build(request, tmp_path)
    out = tmp_path / dest
    result = run_ckpt("convert", src, out, "--to", to, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = result.json["result"]
    read, carried = set(report["read"]), set(report["extras"])
    skipped = {s["name"]: s["reason"] for s in report["skipped"] if s["kind"] == "file"}
    names = {src.name} if src.is_file() else _files(src)
    unaccounted = names - read - carried - set(skipped)
    assert not unaccounted, f"vanished silently: {sorted(unaccounted)}"
    assert all(reason for reason in skipped.values())
    assert read, "nothing read into the output"
    assert (read | carried | set(skipped)) <= names

    same = run_ckpt("diff", src, out, "--json").json["result"]
    assert same["identical"] is True, (same["verdict"], same["only_a"][:5], same["only_b"][:5])
    assert same["compared"] > 0

    # a copy that lost one component (or, in a weights-only model, one module)
    lossy = tmp_path / f"lossy-{dest}"
    cut = run_ckpt("convert", src, lossy, "--to", to, "--filter-out", f"{component}*", "--json")
    assert cut.exit_code == 0, cut.stdout + cut.stderr
    assert not [w for w in cut.json["result"]["warnings"] if "matches no" in w]
    diffed = run_ckpt("diff", src, lossy, "--json")
    assert diffed.exit_code == 1, diffed.stdout
    lost = diffed.json["result"]
    assert lost["identical"] is False and lost["only_a"]


@pytest.mark.frameworks
@pytest.mark.parametrize(
    ("build", "lost", "component"),
    [
        pytest.param(
            _fixture("real_accelerate_run", "straight", "step-4"),
            "optimizer.bin",
            "model",
            id="accelerate-real",
        ),
        pytest.param(
            _fixture("trainer_runs", "full", "checkpoint-2"),
            "scheduler.pt",
            "model",
            id="trainer-real",
        ),
    ],
)
def test_a_save_that_lost_a_file_is_not_converted_without_it(
    request: pytest.FixtureRequest, tmp_path: Path, build: Builder, lost: str, component: str
) -> None:
    """A user converts a save whose `verify` fails because a file of it was lost (accelerate's
    `optimizer.bin` beside its `scheduler.bin`, the Trainer's `scheduler.pt` beside its
    `optimizer.pt`): convert wrote the rest with exit 0 and not a word, an output that
    resumes with a fresh optimizer or scheduler. It refuses, naming the file and the problem."""
    import shutil

    src = shutil.copytree(build(request, tmp_path), tmp_path / "damaged")
    (src / lost).unlink()
    checked = run_ckpt("verify", src, "--json")
    assert checked.exit_code == 1, checked.stdout
    codes = [(p["code"], p["file"]) for p in checked.json["result"]["problems"]]
    assert codes == [("missing_component", str(src / lost))]
    out = tmp_path / "out"
    refused = run_ckpt("convert", src, out, "--to", "dcp", "--json")
    assert refused.exit_code == 4, refused.stdout
    error = refused.json["error"]
    assert error["path"] == str(src / lost) and "missing_component" in error["message"]
    assert "--select" in error["fix"]
    assert not out.exists()
    # the human form says the same on stderr, nothing on stdout
    human = run_ckpt("convert", src, out, "--to", "dcp")
    assert human.exit_code == 4 and not human.stdout and lost in human.stderr
    assert not out.exists()
    # what is there converts, one component at a time, judged by torch's own reader
    taken = run_ckpt("convert", src, out, "--to", "safetensors", "--select", component)
    assert taken.exit_code == 0, taken.stderr
    from safetensors.torch import load_file

    assert load_file(next(out.glob("*.safetensors")))
