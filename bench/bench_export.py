"""Benchmark `ckpt convert --to hf` (torchtitan -> Hugging Face) against torchtitan's own
conversion. Run by hand, not in tests.

    PYTHONPATH=. python bench/bench_export.py [WORKDIR] [--gb 1.0]

Builds a Llama 3 model of about `--gb` GiB (float32, GQA) with torchtitan 0.3.0's own model
code on CPU and saves its state dict as torchtitan's CheckpointManager saves the model (a DCP
with the model's FQNs at the top level). Then measures, in one run (wall time and peak RSS via
/usr/bin/time, page cache warm for all):

1. `ckpt convert STEP OUT --to hf --config config.json`;
2. torchtitan's own conversion, as its `scripts/checkpoint_conversion/convert_to_hf.py` runs
   it: the model's state dict allocated, `dcp.load` into it, `Llama3StateDictAdapter.to_hf`,
   `dcp.save` through `HuggingFaceStorageWriter` (consolidated to safetensors);
3. a durable copy of the same bytes (`cp -r STEP X && sync`): the floor for any conversion.

Checks that both outputs hold the same tensors bit for bit, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from timing import ENV, PY, REPO, measure

DIM, HEADS, KV_HEADS, VOCAB = 1024, 16, 8, 32000

MODEL = f"""
import sys
sys.path.insert(0, "{REPO / "tests"}")
import torch
import torchtitan.models.llama3 as llama3
from torchtitan.models.common import Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.rope import ComplexRoPE

def config(layers):
    return llama3.Llama3Model.Config(
        dim={DIM}, vocab_size={VOCAB},
        tok_embeddings=Embedding.Config(num_embeddings={VOCAB}, embedding_dim={DIM},
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape={DIM}, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features={DIM}, out_features={VOCAB},
                              param_init=llama3._output_linear_init({DIM})),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim={DIM}, n_heads={HEADS}, n_kv_heads={KV_HEADS},
            hidden_dim=compute_ffn_hidden_dim({DIM}, multiple_of=256),
            rope=ComplexRoPE.Config(dim={DIM // HEADS}, max_seq_len=2048, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"),
    )
"""

SAVE = (
    MODEL
    + """
import torch.distributed.checkpoint as dcp
layers, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
with torch.device("meta"):
    model = config(layers).build()
model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
dcp.save(model.state_dict(), checkpoint_id=out, no_dist=True)
"""
)

# torchtitan's scripts/checkpoint_conversion/convert_to_hf.py, single process
THEIRS = (
    MODEL
    + """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
layers, src, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = config(layers)
with torch.device("meta"):
    model = cfg.build()
model.to_empty(device="cpu")
state = model.state_dict()
dcp.load(state, checkpoint_id=src, no_dist=True)
hf = Llama3StateDictAdapter(cfg, None).to_hf(state)
writer = HuggingFaceStorageWriter(path=out, save_distributed=True, enable_consolidation=True)
dcp.save(hf, storage_writer=writer, no_dist=True)
"""
)

COMPARE = """
import sys, glob
from safetensors import safe_open
import torch
def open_all(folder):
    out = {}
    for path in sorted(glob.glob(folder + "/*.safetensors")):
        f = safe_open(path, "pt")
        for k in f.keys():
            out[k] = f
    return out
a, b = open_all(sys.argv[1]), open_all(sys.argv[2])
assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
for k in a:
    assert torch.equal(a[k].get_tensor(k), b[k].get_tensor(k)), k
print(len(a))
"""


def hf_config(layers: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": DIM,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", nargs="?", default="/tmp/ckpt-bench-export")
    parser.add_argument("--gb", type=float, default=1.0)
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # embeddings + lm_head, then ~11.8M parameters (47 MB) per layer
    embeddings = 2 * VOCAB * DIM * 4
    per_layer = (DIM * DIM * 2 + 2 * DIM * DIM * KV_HEADS // HEADS + 3 * DIM * 2816) * 4
    layers = max(1, round((args.gb * 2**30 - embeddings) / per_layer))
    step = work / "step-1"
    subprocess.run([PY, "-c", SAVE, str(layers), str(step)], env=ENV, check=True)
    nbytes = sum(f.stat().st_size for f in step.iterdir())
    largest = VOCAB * DIM * 4
    config = work / "config.json"
    config.write_text(json.dumps(hf_config(layers)))

    ckpt = [PY, "-m", "ckpt_cli", "convert", str(step)]
    ours = measure([*ckpt, str(work / "ours"), "--to", "hf", "--config", str(config)])
    theirs = measure([PY, "-c", THEIRS, str(layers), str(step), str(work / "theirs")])
    copy = measure(["sh", "-c", f"cp -r '{step}' '{work / 'copy'}' && sync"])
    same = subprocess.run(
        [PY, "-c", COMPARE, str(work / "ours"), str(work / "theirs")],
        env=ENV,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()

    gib = nbytes / 2**30
    print(
        f"\nLlama 3 (torchtitan), {layers} layers, {gib:.2f} GiB float32, largest tensor "
        f"{largest / 2**20:.0f} MiB; outputs equal bit for bit ({same} tensors)\n"
    )
    print("| export | wall | GB/s | peak RSS | vs durable copy |")
    print("|---|---|---|---|---|")
    for name, (secs, rss) in (
        ("`ckpt convert --to hf`", ours),
        ("torchtitan convert_to_hf (dcp.load + to_hf + HF writer)", theirs),
        ("`cp -r && sync` (durable copy)", copy),
    ):
        print(
            f"| {name} | {secs:.2f} s | {nbytes / secs / 1e9:.2f} | {rss:.0f} MiB | "
            f"{copy[0] / secs:.2f}x |"
        )


if __name__ == "__main__":
    main()
