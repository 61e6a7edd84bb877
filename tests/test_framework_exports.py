"""Real framework saves of a Hugging Face model export to a model folder (#27): select + strip.

A training save of an HF-named model (accelerate's FSDP2 `save_state`, DeepSpeed ZeRO-3's
`save_checkpoint`) is the trained model plus training state. `ckpt convert SAVE DEST --to hf
--config MODEL_DIR` must write the model component alone, under its own names, which
`from_pretrained(DEST)` loads into the trained model bit for bit (state dict and logits), and
none of the framework's training files (DeepSpeed's `zero_to_fp32.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt
from .dist_helpers import run_torchrun
from .framework_fixtures import tiny_config

# each save is a 2-rank torchrun job building a Llama: minutes on a busy machine
pytestmark = [pytest.mark.torchrun, pytest.mark.frameworks, pytest.mark.timeout(1200)]

DEEPSPEED_SCRIPT = Path(__file__).resolve().parent / "deepspeed_script.py"
IDS = torch.tensor([[1, 5, 9, 2, 33, 60, 7, 4]])


def _export(save: Path, dest: Path, config: Path) -> dict[str, object]:
    result = run_ckpt("convert", save, dest, "--to", "hf", "--config", config, "--json")
    assert result.exit_code == 0, result.stderr
    doc: dict[str, object] = json.loads(result.stdout)["result"]
    return doc


def _loaded(dest: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`LlamaForCausalLM.from_pretrained(dest)`'s state dict and logits on `IDS`."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(dest).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    return model.state_dict(), logits


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_accelerate_fsdp_save_exports_the_trained_llama(
    accelerate_fsdp_saves: dict[str, Path], tmp_path: Path
) -> None:
    """accelerate FSDP2 SHARDED_STATE_DICT (`pytorch_model_fsdp_0/` DCP, two models, optimizer
    DCP folders): the first model is exported, its optimizer and the second model left out."""
    from transformers import LlamaForCausalLM

    save = accelerate_fsdp_saves["sharded"]
    config = tmp_path / "config"
    tiny_config().save_pretrained(config)
    doc = _export(save, tmp_path / "hf", config)
    assert doc["architecture"]["source_naming"] == "hf"  # type: ignore[index]
    written = {e["name"] for e in doc["entries"]}  # type: ignore[attr-defined]
    assert len(written) == 21 and all(n.startswith(("model.", "lm_head.")) for n in written)
    # the files left behind are accounted for as the source's, not the mapped model's
    files = {s["name"]: s["reason"] for s in doc["skipped"] if s["kind"] == "file"}  # type: ignore[attr-defined]
    assert files["optimizer_0/__0_0.distcp"] == "none of its entries was selected"
    assert files["pytorch_model_fsdp_1/__1_0.distcp"] == "none of its entries was selected"
    # what accelerate's own load_state restores: the trained model
    trained = torch.load(f"{save}.restored.pt", weights_only=False)["model_0"]
    on_disk: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        on_disk.update(load_file(path))
    _assert_same_state(on_disk, trained)
    state, logits = _loaded(tmp_path / "hf")
    _assert_same_state(state, trained)
    reference = LlamaForCausalLM(tiny_config()).eval()
    reference.load_state_dict(trained)
    with torch.no_grad():
        assert torch.equal(logits, reference(IDS).logits)


@pytest.fixture(scope="module")
def zero3_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zero3-hf/` (DeepSpeed ZeRO-3 save of the tiny Llama after two fp32 steps) and
    `zero3-hf-model/` (the trained model, gathered, `save_pretrained`, with `logits.pt`)."""
    out = tmp_path_factory.mktemp("deepspeed_hf")
    run_torchrun(DEEPSPEED_SCRIPT, 2, out, "--hf", timeout=900)
    return out


def test_deepspeed_zero3_save_exports_the_trained_llama(zero3_hf: Path, tmp_path: Path) -> None:
    """DeepSpeed ZeRO-3: the fp32 partitions rebuilt into the model folder, bit for bit what
    the engine's gathered model saves; the recovery scripts stay behind."""
    doc = _export(zero3_hf / "zero3-hf", tmp_path / "hf", zero3_hf / "zero3-hf-model")
    assert doc["architecture"]["transforms"] == {"copy": 21}  # type: ignore[index]
    assert not (tmp_path / "hf" / "zero_to_fp32.py").exists()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    want = load_file(zero3_hf / "zero3-hf-model" / "model.safetensors")
    _assert_same_state(load_file(tmp_path / "hf" / "model.safetensors"), want)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = torch.load(zero3_hf / "zero3-hf-model" / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(reference["ids"]).logits
    assert torch.equal(logits, reference["logits"])
