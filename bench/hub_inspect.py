"""Benchmark `ckpt inspect hf://…` against huggingface_hub's own `get_safetensors_metadata`.

Both read safetensors headers with HTTP range requests. A sharded model (`save_torch_state_dict`,
many small shards) is served by the test Hub in its own process with a per-request latency
(default 30 ms, a far-away server), since round trips, not bytes, dominate header reads.

Run by hand from the repository root:
    PYTHONPATH=$PWD python bench/hub_inspect.py [--shards 64] [--latency 0.03]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.03)
    args = parser.parse_args()

    import torch
    from huggingface_hub import save_torch_state_dict

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-hub-inspect-"))
    gen = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i}.{name}.weight": torch.randn(64, 64, generator=gen)
        for i in range(args.shards)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    (work / "src").mkdir()
    save_torch_state_dict(state, work / "src", max_shard_size=4 * 64 * 64 * 4)
    shards = len(list((work / "src").glob("*.safetensors")))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.hub_server",
            f"--latency={args.latency}",
            f"bench/model={work / 'src'}",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert server.stdout is not None
    url = server.stdout.readline().strip()
    env = dict(os.environ, HF_ENDPOINT=url, HF_HOME=str(work / "home"), PYTHONPATH=str(ROOT))
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        # both as a user runs them: a fresh process, interpreter start-up and imports included
        probe = (
            "from huggingface_hub import HfApi; "
            "m = HfApi().get_safetensors_metadata('bench/model'); "
            "print(sum(len(f.tensors) for f in m.files_metadata.values()))"
        )

        def bytes_sent() -> int:
            with urllib.request.urlopen(f"{url}/_testhub/bytes_sent") as response:
                return int(sum(json.load(response).values()))

        start = time.perf_counter()
        base = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
        )
        baseline = time.perf_counter() - start
        assert int(base.stdout.strip()) == len(state)
        base_bytes = bytes_sent()

        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "ckpt_cli", "inspect", "hf://bench/model", "--json"],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        ours = time.perf_counter() - start
        assert json.loads(out.stdout)["result"]["tensors"] == len(state)
        sent = bytes_sent() - base_bytes
        print(
            f"| `ckpt inspect hf://…`, {shards} shards, {args.latency * 1000:.0f} ms per request "
            f"| {ours:.2f} s | `get_safetensors_metadata` {baseline:.2f} s "
            f"| {baseline / ours:.1f}× | {sent / 2**10:.0f} KiB vs {base_bytes / 2**10:.0f} KiB |"
        )
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
