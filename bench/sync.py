"""Benchmark `ckpt sync` against `s3fs put --recursive` on an S3-compatible store. By hand only.

    PYTHONPATH=. python bench/sync.py [--mb 64] [--saves 3] [--files 8] [--rounds 3]
                                      [--checking-store] [--tls]
                                      [--baseline /path/to/other/checkout]

Starts moto's S3 server in its own process on 127.0.0.1 (a middleware counts requests by kind,
request body bytes and the server's own CPU time; with `--checking-store` it also refuses a
body that does not match its `x-amz-checksum-crc32`/`-sha256` with BadDigest, as S3 does,
which moto does not; with `--tls` it is reached over HTTPS, as S3 is, with a self-signed
certificate both tools trust through `AWS_CA_BUNDLE`: there botocore's own uploads, s3fs
put's, stream their body with a CRC32 in a trailer, which this server leaves unchecked, so
the store's share of the work favours s3fs), writes a run folder of Trainer-style saves
(`--files` weight shards with their index, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json, config.json, training_args.bin; `--mb` MB each), then, in `--rounds`
interleaved rounds (each tool a fresh process, order alternating, same server):

1. first upload: `ckpt sync out/ s3://…` against `s3fs put(recursive=True)` (what a user would
   script) into a fresh prefix;
2. one new save: a prefix holding the first saves, and one more save on disk; `ckpt sync`
   sends only that save, `s3fs put` is given only that save's folder (the least it could do).

Figures are medians: wall time, the client process's CPU (user+sys), the server's CPU, and
requests. `time ratio` is s3fs put's wall time over ckpt sync's (>= 1: sync is as fast).
With `--baseline`, a second ckpt checkout (e.g. the main branch) runs the same cases.
Loopback and moto's Python server make absolute times meaningless; the ratios, requests and
client CPU per byte carry over. Each checkout's modules are compiled to bytecode first (its
`__pycache__`), as an installed ckpt's are.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SERVER = r"""
import base64, hashlib, io, json, logging, sys, threading, time, zlib
from collections import Counter
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()
state = {"counts": Counter(), "bytes": 0, "cpu0": time.process_time()}
CHECK = sys.argv[2] == "check"

def matches(env, body):
    crc = env.get("HTTP_X_AMZ_CHECKSUM_CRC32")
    if crc and crc != base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode():
        return False
    sha = env.get("HTTP_X_AMZ_CHECKSUM_SHA256")
    return not sha or sha == base64.b64encode(hashlib.sha256(body).digest()).decode()

def kind(env):
    method, query = env["REQUEST_METHOD"], env.get("QUERY_STRING", "")
    if "partNumber" in query:
        return "part"
    if "uploads" in query or "uploadId" in query:
        return "multipart"
    if "list-type" in query or (method == "GET" and env.get("PATH_INFO", "").count("/") <= 1):
        return "list"
    if method == "GET":
        return "get"
    return method.lower()

def wsgi(env, start):
    if env.get("PATH_INFO") == "/_bench/stats":
        with lock:
            body = json.dumps({"counts": dict(state["counts"]), "bytes": state["bytes"],
                               "cpu": time.process_time() - state["cpu0"]}).encode()
            if env["REQUEST_METHOD"] == "POST":
                state.update(counts=Counter(), bytes=0, cpu0=time.process_time())
        start("200 OK", [("Content-Type", "application/json")])
        return [body]
    with lock:
        state["counts"][kind(env)] += 1
        if env["REQUEST_METHOD"] in ("PUT", "POST"):
            # a streamed body (aws-chunked, its checksum in a trailer: botocore's default over
            # TLS) announces its length apart
            sent = env.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or env.get("CONTENT_LENGTH")
            state["bytes"] += int(sent or 0)
    # a streamed body's trailing checksum is left to moto, which does not check it
    streamed = "aws-chunked" in env.get("HTTP_CONTENT_ENCODING", "")
    if CHECK and env["REQUEST_METHOD"] == "PUT" and not streamed:
        body = env["wsgi.input"].read(int(env.get("CONTENT_LENGTH") or 0))
        env["wsgi.input"] = io.BytesIO(body)
        if not matches(env, body):
            start("400 Bad Request", [("Content-Type", "application/xml")])
            return [b"<Error><Code>BadDigest</Code><Message>checksum</Message></Error>"]
    return app(env, start)

context = None
if len(sys.argv) > 3:
    import ssl
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[3], sys.argv[4])
httpd = make_server("127.0.0.1", int(sys.argv[1]), wsgi, threaded=True, ssl_context=context)
print("ready", flush=True)
httpd.serve_forever()
"""


def start_server(
    check: bool = False, tls: tuple[Path, Path] | None = None
) -> tuple[str, subprocess.Popen[str]]:
    """moto's S3 app in its own process on a free port (`check`: checksums checked; `tls`:
    its certificate and key, served over HTTPS)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-c", SERVER, str(port), "check" if check else "none"]
    proc = subprocess.Popen(
        [*argv, *([str(tls[0]), str(tls[1])] if tls else [])], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return f"{'https' if tls else 'http'}://127.0.0.1:{port}", proc


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1 (openssl)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
            *("-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def server_stats(endpoint: str, reset: bool = False) -> dict[str, Any]:
    request = urllib.request.Request(f"{endpoint}/_bench/stats", method="POST" if reset else "GET")
    context = None
    if endpoint.startswith("https:"):
        import ssl

        context = ssl.create_default_context(cafile=os.environ["AWS_CA_BUNDLE"])
    with urllib.request.urlopen(request, timeout=30, context=context) as answer:
        stats: dict[str, Any] = json.loads(answer.read())
        return stats


def save(folder: Path, step: int, mb: int, files: int = 1) -> None:
    """A Hugging Face Trainer save: weights (sharded, with their index), optimizer, scheduler,
    RNG state, trainer state, config and training arguments."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    n = mb * (1 << 20) // 4 // 3
    shard = max(1, n // files)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors" if files > 1 else "model.safetensors"
        save_file({f"w{i}": torch.full((shard,), float(step + i))}, folder / name)
        weight_map[f"w{i}"] = name
    if files > 1:
        index = {"metadata": {"total_size": 4 * shard * files}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({"state": {0: {"exp_avg": torch.zeros(2 * n)}}}, folder / "optimizer.pt")
    torch.save({"last_epoch": step, "_step_count": step + 1}, folder / "scheduler.pt")
    torch.save({"python": step, "cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    torch.save({"output_dir": "out"}, folder / "training_args.bin")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')


def timed(argv: list[str], env: dict[str, str], endpoint: str, cwd: Path = REPO) -> dict[str, Any]:
    """Run one fresh process: wall time, its CPU, and what the server did for it."""
    server_stats(endpoint, reset=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stats = server_stats(endpoint)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall": wall,
        "cpu": cpu,
        "server_cpu": stats["cpu"],
        "requests": sum(stats["counts"].values()),
        "counts": stats["counts"],
        "bytes": stats["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--files", type=int, default=8, help="weight shards per save")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout of ckpt to compare")
    parser.add_argument(
        "--checking-store", action="store_true", help="the server checks x-amz-checksum-*"
    )
    parser.add_argument("--tls", action="store_true", help="the server is reached over HTTPS")
    opts = parser.parse_args()
    tls = None
    if opts.tls:
        tls = self_signed(Path(tempfile.mkdtemp()))
        os.environ["AWS_CA_BUNDLE"] = str(tls[0])
    endpoint, server = start_server(opts.checking_store, tls)
    try:
        run(opts, endpoint)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run(opts: argparse.Namespace, endpoint: str) -> None:
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_DEFAULT_REGION="us-east-1",
    )
    os.environ.update({k: env[k] for k in env if k.startswith("AWS_")})
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    root = Path(tempfile.mkdtemp())
    out = root / "out"
    for i in range(opts.saves):
        save(out / f"checkpoint-{(i + 1) * 100}", (i + 1) * 100, opts.mb, opts.files)
    new_name = f"checkpoint-{(opts.saves + 1) * 100}"
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    files = sum(1 for p in out.rglob("*") if p.is_file())
    tools = {"ckpt sync": REPO}
    if opts.baseline is not None:
        tools["baseline sync"] = opts.baseline.resolve()
    # bytecode compiled, as an installed ckpt has it (and s3fs has): a checkout run under
    # PYTHONDONTWRITEBYTECODE=1 would otherwise compile each of its modules in every process
    for checkout in tools.values():
        compileall.compile_dir(checkout / "ckpt_cli", quiet=1)

    def ckpt(tool: str, dest: str) -> list[str]:
        return [sys.executable, "-m", "ckpt_cli", "sync", str(out), dest, "--settle", "0"]

    def put(src: Path, dest: str) -> list[str]:
        script = (
            "import os, s3fs; s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL'])"
            f".put({str(src) + '/'!r}, {dest!r}, recursive=True)"
        )
        return [sys.executable, "-c", script]

    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(opts.rounds):
        names = [*tools, "s3fs put"]
        if r % 2:
            names.reverse()
        # first upload, into a fresh prefix each
        for name in names:
            prefix = f"bench/r{r}-{name.replace(' ', '-')}"
            if name == "s3fs put":
                argv, run_env = put(out, f"{prefix}/"), env
            else:
                argv, run_env = (
                    ckpt(name, f"s3://{prefix}/"),
                    {**env, "PYTHONPATH": str(tools[name])},
                )
            results.setdefault(("first upload", name), []).append(
                timed(argv, run_env, endpoint, tools.get(name, REPO))
            )
        # one new save on disk; sync finds it, put is given its folder only
        save(out / new_name, (opts.saves + 1) * 100, opts.mb, opts.files)
        for name in names:
            prefix = f"bench/r{r}-{name.replace(' ', '-')}"
            if name == "s3fs put":
                argv, run_env = put(out / new_name, f"{prefix}/{new_name}/"), env
            else:
                argv, run_env = (
                    ckpt(name, f"s3://{prefix}/"),
                    {**env, "PYTHONPATH": str(tools[name])},
                )
            results.setdefault(("one new save", name), []).append(
                timed(argv, run_env, endpoint, tools.get(name, REPO))
            )
        import shutil

        shutil.rmtree(out / new_name)
    report(opts, results, total, files)


def report(
    opts: argparse.Namespace,
    results: dict[tuple[str, str], list[dict[str, Any]]],
    total: int,
    files: int,
) -> None:
    mb = 1 << 20
    print(
        f"{opts.saves} saves of {opts.mb} MB, {files} files, {total / mb:.0f} MB; one new save "
        f"adds {files // opts.saves} files; medians of {opts.rounds} interleaved rounds; "
        f"load: {os.getloadavg()[0]:.1f}"
    )
    print(
        f"store: {'checks checksums' if opts.checking_store else 'moto (checks none)'}"
        f"{', over TLS' if opts.tls else ''}\n"
        f"{'case':<14}{'tool':<15}{'wall s':>8}{'ratio':>7}{'cpu s':>7}{'srv cpu':>8}"
        f"{'reqs':>6}{'MB sent':>9}  requests by kind"
    )
    for case in ("first upload", "one new save"):
        put_wall = statistics.median(x["wall"] for x in results[(case, "s3fs put")])
        for (c, tool), runs in results.items():
            if c != case:
                continue
            wall = statistics.median(x["wall"] for x in runs)
            cpu = statistics.median(x["cpu"] for x in runs)
            srv = statistics.median(x["server_cpu"] for x in runs)
            reqs = statistics.median(x["requests"] for x in runs)
            sent = statistics.median(x["bytes"] for x in runs) / mb
            kinds = " ".join(f"{k}={v}" for k, v in sorted(runs[-1]["counts"].items()))
            print(
                f"{case:<14}{tool:<15}{wall:>8.2f}{put_wall / wall:>7.2f}{cpu:>7.2f}{srv:>8.2f}"
                f"{reqs:>6.0f}{sent:>9.1f}  {kinds}"
            )


if __name__ == "__main__":
    main()
