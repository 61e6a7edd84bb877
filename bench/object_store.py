"""Benchmark `ckpt` against an S3-compatible store. Run by hand, not in tests.

    PYTHONPATH=. python bench/object_store.py [--mb 128]

Starts moto's S3 server in this process on 127.0.0.1 (a middleware counts the bytes each
response carries), uploads a sharded safetensors model, then runs `ckpt` in fresh processes:

1. `ckpt inspect s3://…`: bytes fetched against the checkpoint's size (the alternative, without
   ranged reads, is downloading the shards: `aws s3 cp --recursive`, `fs.get`).
2. `ckpt convert s3://… ./dcp --to dcp` against `s3fs get` of every file followed by a local
   `ckpt convert`: time, and bytes on local disk besides the output.
3. `ckpt convert ./local s3://… --to safetensors` against a local `ckpt convert` followed by
   `s3fs put`: time (the publish step adds a server-side copy).

Loopback and moto's Python server make absolute times meaningless; the byte ratios carry over
to real stores, and the time ratios show the overhead of the staging and publishing design.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def start_server() -> tuple[str, dict[str, int]]:
    """moto's S3 app on a free port; returns the endpoint and a live byte counter."""
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = DomainDispatcherApplication(create_backend_app)
    sent = {"bytes": 0, "gets": 0}

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "GET":
            sent["gets"] += 1
        for chunk in app(environ, start_response):
            if environ["REQUEST_METHOD"] == "GET":
                sent["bytes"] += len(chunk)
            yield chunk

    httpd = make_server("127.0.0.1", port, counted, threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", sent


def run(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=128.0, help="model size in MiB")
    opts = parser.parse_args()

    import boto3
    import torch
    from huggingface_hub import save_torch_state_dict

    endpoint, sent = start_server()
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        AWS_ENDPOINT_URL=endpoint,
        FSSPEC_S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    os.environ.update({k: v for k, v in env.items() if k.startswith(("AWS_", "FSSPEC_"))})
    ckpt = [sys.executable, "-m", "ckpt_cli"]
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-s3-"))
    try:
        n = max(1, int(opts.mb * (1 << 20) / (1024 * 1024 * 4)))
        gen = torch.Generator().manual_seed(0)
        state = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(n)}
        (work / "src").mkdir()
        save_torch_state_dict(state, work / "src", max_shard_size="16MB")
        size = sum(p.stat().st_size for p in (work / "src").iterdir())
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        for path in sorted((work / "src").iterdir()):
            client.upload_file(str(path), "bench", f"model/{path.name}")
        url = "s3://bench/model"
        rows = []

        sent.update(bytes=0, gets=0)
        run([*ckpt, "inspect", url, "--json"], env)
        rows.append(
            (
                "inspect (bytes fetched)",
                f"{sent['bytes'] / 1024:.0f} KiB in {sent['gets']} GETs",
                f"{size / (1 << 20):.0f} MiB (download every shard)",
                f"{size / max(1, sent['bytes']):.0f}x fewer bytes",
            )
        )

        t_ckpt = run([*ckpt, "convert", url, work / "dcp1", "--to", "dcp"], env)
        import s3fs

        fs = s3fs.S3FileSystem()
        started = time.perf_counter()
        fs.get("bench/model/", str(work / "copy") + "/", recursive=True)
        t_get = time.perf_counter() - started
        t_local = run([*ckpt, "convert", work / "copy", work / "dcp2", "--to", "dcp"], env)
        rows.append(
            (
                "convert s3 -> local dcp",
                f"{t_ckpt:.2f} s, no local copy",
                f"{t_get + t_local:.2f} s (get {t_get:.2f} + convert {t_local:.2f}), "
                f"{size / (1 << 20):.0f} MiB copy",
                f"{(t_get + t_local) / t_ckpt:.2f}x",
            )
        )

        t_up = run([*ckpt, "convert", work / "dcp1", "s3://bench/out1", "--to", "safetensors"], env)
        t_conv = run([*ckpt, "convert", work / "dcp1", work / "st", "--to", "safetensors"], env)
        started = time.perf_counter()
        fs.put(str(work / "st") + "/", "bench/out2/", recursive=True)
        t_put = time.perf_counter() - started
        rows.append(
            (
                "convert local -> s3 safetensors",
                f"{t_up:.2f} s (staged, uploaded, published)",
                f"{t_conv + t_put:.2f} s (convert {t_conv:.2f} + put {t_put:.2f}), not atomic",
                f"{(t_conv + t_put) / t_up:.2f}x",
            )
        )
        print(f"model: {n} tensors, {size / (1 << 20):.0f} MiB in 16 MB shards\n")
        print("| task | ckpt | without ckpt | ratio |")
        print("|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
