"""Benchmark `ckpt sync` against `s3fs put --recursive` on an S3-compatible store. By hand only.

    PYTHONPATH=. python bench/sync.py [--mb 64] [--saves 3] [--files 8]

Starts moto's S3 server in this process on 127.0.0.1 (a middleware counts request body bytes),
writes a run folder of Trainer-style saves (`--files` weight shards + optimizer, `--mb` MB
each), then:

1. first upload: `ckpt sync out/ s3://…` against `s3fs put(recursive=True)` (what a user would
   script): wall time and bytes sent (ckpt also hashes every file and checks every ETag); and
   the same upload with `--jobs 1` (one file at a time, as ckpt did before `--jobs`);
2. the next round, one new save: `ckpt sync` sends only that save; `s3fs put` sends it all again;
3. an upload interrupted half-way: bytes the resumed `ckpt sync` sends, against a full re-put.

Loopback and moto's Python server make absolute times meaningless; the byte ratios carry over.
"""

from __future__ import annotations

import argparse
import os
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
    """moto's S3 app on a free port; returns the endpoint and a live upload byte counter."""
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = DomainDispatcherApplication(create_backend_app)
    counter = {"bytes": 0}

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] in ("PUT", "POST"):
            counter["bytes"] += int(environ.get("CONTENT_LENGTH") or 0)
        return app(environ, start_response)

    httpd = make_server("127.0.0.1", port, counted, threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", counter


def save(folder: Path, step: int, mb: int, files: int = 1) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    n = mb * (1 << 20) // 4 // 3
    shard = max(1, n // files)
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors" if files > 1 else "model.safetensors"
        save_file({f"w{i}": torch.full((shard,), float(step + i))}, folder / name)
    torch.save({"state": {0: {"exp_avg": torch.zeros(2 * n)}}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--files", type=int, default=8, help="weight shards per save")
    opts = parser.parse_args()
    endpoint, counter = start_server()
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_DEFAULT_REGION="us-east-1",
    )
    os.environ.update({k: env[k] for k in env if k.startswith("AWS_")})
    import boto3
    import s3fs

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    root = Path(tempfile.mkdtemp())
    out = root / "out"
    for i in range(opts.saves):
        save(out / f"checkpoint-{(i + 1) * 100}", (i + 1) * 100, opts.mb, opts.files)

    def ckpt_sync(dest: str, *extra: str) -> tuple[float, int]:
        counter["bytes"] = 0
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "ckpt_cli", "sync", str(out), dest, "--settle", "0", *extra],
            env=env,
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - start, counter["bytes"]

    def s3fs_put(dest: str) -> tuple[float, int]:
        # a fresh process too, as a user's script would be: imports and connections count
        counter["bytes"] = 0
        start = time.perf_counter()
        script = (
            "import os, s3fs; s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL'])"
            f".put({str(out) + '/'!r}, {dest!r}, recursive=True)"
        )
        subprocess.run([sys.executable, "-c", script], env=env, check=True)
        return time.perf_counter() - start, counter["bytes"]

    rows = []
    t_c, b_c = ckpt_sync("s3://bench/ckpt/")
    t_p, b_p = s3fs_put("bench/put/")
    rows.append(("first upload", t_c, b_c, t_p, b_p))
    t_1, b_1 = ckpt_sync("s3://bench/one-at-a-time/", "--jobs", "1")
    rows.append(("first, --jobs 1", t_1, b_1, t_p, b_p))
    save(out / f"checkpoint-{(opts.saves + 1) * 100}", (opts.saves + 1) * 100, opts.mb, opts.files)
    t_c, b_c = ckpt_sync("s3://bench/ckpt/")
    t_p, b_p = s3fs_put("bench/put/")
    rows.append(("one new save", t_c, b_c, t_p, b_p))
    # an interrupted upload: half of the saves' objects are gone, manifests included
    keys = sorted(fs.find("bench/ckpt/"))
    fs.rm([k for k in keys if "checkpoint-300" in k or "checkpoint-400" in k])
    t_c, b_c = ckpt_sync("s3://bench/ckpt/")
    t_p, b_p = s3fs_put("bench/put/")
    rows.append(("resume after loss", t_c, b_c, t_p, b_p))
    mb = 1 << 20
    print(
        f"{opts.saves}+1 saves of {opts.mb} MB in {opts.files + 2} files; "
        "ckpt sync vs s3fs put --recursive"
    )
    print(f"{'case':<20}{'ckpt s':>8}{'ckpt MB':>9}{'put s':>8}{'put MB':>8}{'bytes':>8}")
    for name, tc, bc, tp, bp in rows:
        ratio = bc / bp if bp else 0.0
        print(f"{name:<20}{tc:>8.2f}{bc / mb:>9.1f}{tp:>8.2f}{bp / mb:>8.1f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
