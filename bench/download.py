"""Benchmark `ckpt download` against fetching whole shards (what `hf download --include` does).

Serves a sharded safetensors model (written by `save_torch_state_dict`) from the test Hub on
127.0.0.1 (in its own process, so it does not share the client's GIL) and, for a few tensor selections, measures bytes sent by the server and wall time of:

* baseline: `hf_hub_download(local_dir=DEST)` of every shard (`hf download --include '*.safetensors'
  --local-dir DEST`, the usual way to get some tensors of a model),
* `ckpt download --mode shards` (the shards holding the selection),
* `ckpt download --mode tensors` (the selected byte ranges only).

Run by hand from the repository root:  PYTHONPATH=$PWD python bench/download.py [--mib 256]
Prints a Markdown table for docs/performance.md. Timing is for a loopback link: the byte ratios carry
over to real networks, the time ratios grow with a slower link.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from huggingface_hub import hf_hub_download, save_torch_state_dict

from ckpt_cli.ops.download import download


def build(folder: Path, mib: int) -> dict[str, int]:
    """A Llama-shaped model of about `mib` MiB in bf16, 8 shards; returns tensor sizes."""
    hidden, layers = 512, max(1, mib // 8)
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(8192, hidden, generator=gen).to(torch.bfloat16)
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{p}.self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=gen).to(
                torch.bfloat16
            )
        for name, shape in (("gate_proj", (4 * hidden, hidden)), ("up_proj", (4 * hidden, hidden)),
                            ("down_proj", (hidden, 4 * hidden))):  # fmt: skip
            state[f"{p}.mlp.{name}.weight"] = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        state[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in state.values())
    folder.mkdir(parents=True)
    save_torch_state_dict(state, folder, max_shard_size=total // 8 + 1)
    return {n: t.numel() * t.element_size() for n, t in state.items()}


def human(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-download-"))
    sizes = build(work / "src", args.mib)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.hub_server", f"bench/model={work / 'src'}"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert server.stdout is not None
    url = server.stdout.readline().strip()
    os.environ["HF_ENDPOINT"] = url
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

    def bytes_sent() -> int:
        with urllib.request.urlopen(f"{url}/_testhub/bytes_sent") as response:
            return sum(json.load(response).values())

    try:
        shards = sorted(p.name for p in (work / "src").glob("*.safetensors"))
        total = sum((work / "src" / s).stat().st_size for s in shards)
        selections = {
            "layer 0 + embeddings": ["model.layers.0.*", "model.embed_tokens.*"],
            "every q_proj": ["*.q_proj.weight"],
            "every layernorm": ["*.input_layernorm.weight"],
        }
        rows = []
        for label, globs in selections.items():
            import fnmatch

            wanted = sum(
                v for n, v in sizes.items() if any(fnmatch.fnmatchcase(n, g) for g in globs)
            )
            results = {}
            for method in ("baseline", "shards", "tensors"):
                home = work / f"home-{method}"
                os.environ["HF_HOME"] = str(home)
                before = bytes_sent()
                dest = work / f"out-{method}"
                if method == "baseline":
                    seconds = timed(
                        lambda dest=dest: [
                            hf_hub_download("bench/model", s, endpoint=url, local_dir=str(dest))
                            for s in shards
                        ]
                    )
                else:
                    seconds = timed(
                        lambda dest=dest, method=method, globs=globs: download(
                            "hf://bench/model",
                            dest,
                            tensors=globs,
                            mode=method,
                            extras=False,  # type: ignore[arg-type]
                        )
                    )
                results[method] = (bytes_sent() - before, seconds)
                shutil.rmtree(home, ignore_errors=True)
                shutil.rmtree(dest, ignore_errors=True)
            base_bytes, base_time = results["baseline"]
            for method in ("shards", "tensors"):
                sent, seconds = results[method]
                rows.append(
                    f"| {label} ({human(wanted)}) | `--mode {method}` | {human(sent)} "
                    f"| {base_bytes / sent:.1f}× | {seconds:.2f} s vs {base_time:.2f} s |"
                )
        print(f"Model: {len(sizes)} tensors, {len(shards)} shards, {total / 2**20:.0f} MiB; "
              f"the baseline fetches every shard ({total / 2**20:.0f} MiB).\n")  # fmt: skip
        print(
            "| selection | ckpt download | bytes sent | fewer bytes than all shards | time vs all shards |"
        )
        print("|---|---|---|---|---|")
        print("\n".join(rows))
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
