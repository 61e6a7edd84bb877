"""Benchmark `ckpt merge` (LoRA, DoRA, LoKr, LoRA on MoE expert stacks) against what users run otherwise: peft's
`PeftModel.from_pretrained(base).merge_and_unload().save_pretrained(out)`. Run by hand, not in
tests.

    PYTHONPATH=. python bench/bench_merge.py [WORKDIR] [--gb 0.5] [--rounds 1]

Builds a Llama-shaped base of about `--gb` GiB (bf16, GQA) with transformers' own
`save_pretrained`, and a LoRA, a DoRA and a LoKr adapter (r=16 on every linear layer of the
blocks, every factor and magnitude moved from its initial value) with peft's `save_pretrained`;
and a
Qwen3-MoE-shaped base of about the same size (32 experts a layer, stored one tensor per expert as
`save_pretrained` writes them) with a LoRA on its expert stacks (`target_parameters`, r=16). Then
measures, interleaved over `--rounds` rounds (wall time and peak RSS via /usr/bin/time, page
cache warm for all):

1. `ckpt merge BASE ADAPTER OUT`;
2. peft's merge, as above, in a fresh process (the whole model in memory).

Checks that both outputs hold the same tensors bit for bit, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from timing import ENV, PY, measure

BUILD = """
import sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoKrConfig, LoraConfig, get_peft_model
root, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                     num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(f"{root}/base")
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
for kind in ("lora", "dora", "lokr"):
    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(f"{root}/base", dtype=torch.bfloat16)
    if kind == "lokr":
        lora = LoKrConfig(r=16, alpha=32, target_modules=targets, decompose_both=True)
    else:
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=targets, use_dora=kind == "dora")
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name or "lokr_" in name:
                param.add_(torch.randn_like(param) * 0.01)
    model.save_pretrained(f"{root}/{kind}")
"""

BUILD_MOE = """
import sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from peft import LoraConfig, get_peft_model
root, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                        moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
                        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8)
Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(f"{root}/moe-base")
model = Qwen3MoeForCausalLM.from_pretrained(f"{root}/moe-base", dtype=torch.bfloat16)
lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
model = get_peft_model(model, lora)
with torch.no_grad():
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.add_(torch.randn_like(param) * 0.01)
model.save_pretrained(f"{root}/moe")
"""

PEFT_MERGE = """
import sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
"""

SAME = """
import sys
from pathlib import Path
from safetensors.torch import load_file
def tensors(folder):
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
different = [n for n in a if not a[n].equal(b[n])]
assert not different, different[:5]
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", nargs="?", type=Path, default=None)
    parser.add_argument("--gb", type=float, default=0.5, help="base size in GiB (bf16)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="ckpt-bench-merge-"))
    root.mkdir(parents=True, exist_ok=True)
    # a block of this shape is about 28.4 MiB in bf16; the embedding and head 125 MiB
    layers = max(1, round((args.gb * 1024 - 125) / 28.4))
    if not (root / "lokr").exists():
        subprocess.run([PY, "-c", BUILD, str(root), str(layers)], env=ENV, check=True)
    # a MoE block of this shape is about 100 MiB in bf16 (its 32 experts 96 MiB)
    moe_layers = max(1, round((args.gb * 1024 - 125) / 100))
    if not (root / "moe").exists():
        subprocess.run([PY, "-c", BUILD_MOE, str(root), str(moe_layers)], env=ENV, check=True)
    size = sum(f.stat().st_size for f in (root / "base").glob("*.safetensors")) / 2**30
    moe_size = sum(f.stat().st_size for f in (root / "moe-base").glob("*.safetensors")) / 2**30
    bases = {
        "lora": root / "base",
        "dora": root / "base",
        "lokr": root / "base",
        "moe": root / "moe-base",
    }
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for kind, base in bases.items():
            for tool in ("ckpt", "peft"):
                out = root / f"out-{tool}-{kind}"
                shutil.rmtree(out, ignore_errors=True)
                if tool == "ckpt":
                    cmd = [PY, "-m", "ckpt_cli", "merge", str(base), str(root / kind)]
                else:
                    cmd = [PY, "-c", PEFT_MERGE, str(base), str(root / kind)]
                times.setdefault((kind, tool), []).append(measure([*cmd, str(out)]))
    for kind in bases:
        outs = [str(root / f"out-{tool}-{kind}") for tool in ("ckpt", "peft")]
        subprocess.run([PY, "-c", SAME, *outs], env=ENV, check=True)
    print(
        f"base {size:.2f} GiB bf16, {layers} layers; MoE base {moe_size:.2f} GiB, {moe_layers} "
        f"layers of 32 experts; medians of {args.rounds} round(s)"
    )
    print("| adapter | ckpt merge | peft merge_and_unload | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    labels = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "moe": "LoRA on MoE experts"}
    for kind in bases:
        ours = [statistics.median(x) for x in zip(*times[(kind, "ckpt")], strict=True)]
        theirs = [statistics.median(x) for x in zip(*times[(kind, "peft")], strict=True)]
        print(
            f"| {labels[kind]} | {ours[0]:.2f} s, "
            f"{ours[1]:.0f} MiB | {theirs[0]:.2f} s, {theirs[1]:.0f} MiB | "
            f"{ours[0] / theirs[0]:.2f}x | {ours[1] / theirs[1]:.2f}x |"
        )
    print("outputs bit-identical: yes")


if __name__ == "__main__":
    main()
