"""Remote metadata at wire latency: a 163-shard model (the DeepSeek-V3 layout) on the test Hub and
on moto's S3 server, both behind a 50 ms round trip (`tests/latency_proxy.py`).

Each shard holds about 550 tensors (expert weights and their `weight_scale_inv`, as DeepSeek-V3's
do), so its safetensors header is about 60 KiB: larger than a small first read. The tensors are
tiny (the bytes of a header are what cost here, not the data). Measured as fresh processes, as
a user runs them, interpreter start and imports included, in interleaved rounds (medians):

* `ckpt inspect`, `ckpt verify`, `ckpt download --filter` (Hub; shards and tensors mode);
* "fastest possible": a script that lists once and issues every header read at once, one
  thread per shard, each read exactly the header's bytes (it is told their lengths: a lower
  bound no tool that must discover them reaches); for download, the index and then the
  selected shards, all at once;
* what users run otherwise: `HfApi.get_safetensors_metadata` (Hub), `snapshot_download` of
  the shards the index names (Hub download), a loop of s3fs reads of each shard's header (S3).

Requests are counted at each server. Run by hand from the repository root:

    PYTHONPATH=$PWD python bench/remote_latency.py [--shards 163] [--rtt 0.05] [--rounds 3]
        [--before /path/to/other/checkout]

Prints Markdown tables for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hub_server import TestHub  # noqa: E402
from tests.latency_proxy import LatencyProxy, proxied  # noqa: E402

PY = sys.executable
#: the tensors `download --filter` asks for (set from the model built)
FILTER = ""


def build(folder: Path, shards: int, experts: int = 92) -> dict[str, int]:
    """A DeepSeek-V3-shaped sharded model of tiny tensors; returns each shard's header length."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    headers: dict[str, int] = {}
    layer, expert = 0, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:06d}.safetensors"
        tensors: dict[str, Any] = {}
        for _ in range(experts):  # 92 experts x 3 projections x (weight, scale) = 552 tensors
            for proj in ("gate_proj", "up_proj", "down_proj"):
                base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[f"{base}.weight"] = np.zeros((4, 4), dtype=np.float16)
                tensors[f"{base}.weight_scale_inv"] = np.ones((2, 2), dtype=np.float32)
            expert += 1
            if expert == 256:
                layer, expert = layer + 1, 0
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        with open(folder / name, "rb") as fh:
            headers[name] = struct.unpack("<Q", fh.read(8))[0]
    total = sum((folder / n).stat().st_size for n in headers)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    return headers


# -- the "fastest possible" scripts, run as fresh processes ------------------------------------

HUB_FASTEST = r"""
import json, sys, threading, urllib.request
endpoint, repo, lengths = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with urllib.request.urlopen(f"{endpoint}/api/models/{repo}/tree/main?recursive=true") as r:
    files = [e["path"] for e in json.load(r) if e["path"].endswith(".safetensors")]
heads = {}
def one(name):
    req = urllib.request.Request(f"{endpoint}/{repo}/resolve/main/{name}",
                                 headers={"Range": f"bytes=0-{7 + lengths[name]}"})
    with urllib.request.urlopen(req) as r:
        heads[name] = json.loads(r.read()[8:])
threads = [threading.Thread(target=one, args=(n,)) for n in files]
for t in threads: t.start()
for t in threads: t.join()
print(sum(len(h) - ("__metadata__" in h) for h in heads.values()))
"""

HUB_FASTEST_DOWNLOAD = r"""
import fnmatch, json, os, sys, threading, urllib.request
endpoint, repo, pattern, dest = sys.argv[1:5]
with urllib.request.urlopen(f"{endpoint}/api/models/{repo}/tree/main?recursive=true") as r:
    files = [e["path"] for e in json.load(r)]
with urllib.request.urlopen(f"{endpoint}/{repo}/resolve/main/model.safetensors.index.json") as r:
    weight_map = json.load(r)["weight_map"]
wanted = sorted({f for n, f in weight_map.items() if fnmatch.fnmatchcase(n, pattern)})
os.makedirs(dest)
def one(name):
    with urllib.request.urlopen(f"{endpoint}/{repo}/resolve/main/{name}") as r, \
            open(os.path.join(dest, name), "wb") as out:
        out.write(r.read())
threads = [threading.Thread(target=one, args=(n,)) for n in wanted]
for t in threads: t.start()
for t in threads: t.join()
print(len(wanted))
"""

HUB_HF = r"""
import sys
from huggingface_hub import HfApi
m = HfApi().get_safetensors_metadata(sys.argv[1])
print(sum(len(f.tensors) for f in m.files_metadata.values()))
"""

HUB_HF_DOWNLOAD = r"""
import fnmatch, json, sys
from huggingface_hub import hf_hub_download, snapshot_download
repo, pattern, dest = sys.argv[1:4]
index = json.load(open(hf_hub_download(repo, "model.safetensors.index.json")))
wanted = sorted({f for n, f in index["weight_map"].items() if fnmatch.fnmatchcase(n, pattern)})
snapshot_download(repo, allow_patterns=wanted, local_dir=dest)
print(len(wanted))
"""

S3_FASTEST = r"""
import json, sys, threading
import boto3
from botocore.config import Config
bucket, prefix, lengths = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
s3 = boto3.client("s3", config=Config(max_pool_connections=len(lengths) + 8))
keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
        if o["Key"].endswith(".safetensors")]
heads = {}
def one(key):
    n = lengths[key.rsplit("/", 1)[1]]
    body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{7 + n}")["Body"].read()
    heads[key] = json.loads(body[8:])
threads = [threading.Thread(target=one, args=(k,)) for k in keys]
for t in threads: t.start()
for t in threads: t.join()
print(sum(len(h) - ("__metadata__" in h) for h in heads.values()))
"""

S3_S3FS = r"""
import json, struct, sys
import s3fs
fs = s3fs.S3FileSystem()
count = 0
for path in fs.glob(sys.argv[1] + "/*.safetensors"):
    n = struct.unpack("<Q", fs.cat_file(path, start=0, end=8))[0]
    header = json.loads(fs.cat_file(path, start=8, end=8 + n))
    count += len(header) - ("__metadata__" in header)
print(count)
"""


def timed(cmd: list[str], env: dict[str, str], check: Callable[[str], None] | None) -> float:
    started = time.perf_counter()
    # in the checkout measured: `python -m` puts the working folder first on the path
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=env["PYTHONPATH"])
    took = time.perf_counter() - started
    if out.returncode not in (0,):
        raise SystemExit(f"{cmd[:6]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    if check is not None:
        check(out.stdout)
    return took


def start_moto() -> tuple[str, list[tuple[str, str]]]:
    """moto's S3 app on a free port, and the (method, path) of every request it answers."""
    import logging
    import socket
    import threading

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = DomainDispatcherApplication(create_backend_app)
    seen: list[tuple[str, str]] = []

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        seen.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
        return app(environ, start_response)

    class KeepAlive(WSGIRequestHandler):
        # werkzeug answers HTTP/1.0 by default, closing every connection after one response;
        # S3 keeps connections open, and clients count on it
        protocol_version = "HTTP/1.1"

    httpd = make_server("127.0.0.1", port, counted, threaded=True, request_handler=KeepAlive)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=163)
    parser.add_argument("--rtt", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--experts",
        type=int,
        default=92,
        help="experts per shard (6 tensors each; 92: ~60 KiB headers)",
    )
    parser.add_argument("--only", choices=("hub", "s3"), default=None)
    parser.add_argument(
        "--ckpt-root", type=Path, default=REPO, help="run ckpt from this checkout (before/after)"
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also run ckpt inspect/verify from this other checkout, in the same rounds",
    )
    opts = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-latency-"))
    src = work / "src"
    lengths = build(src, opts.shards, opts.experts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    n_tensors = len(index["weight_map"])
    # what `download --filter` asks for: the first expert of the middle shard (one shard)
    middle = sorted(lengths)[len(lengths) // 2]
    first = next(n for n, f in index["weight_map"].items() if f == middle)
    global FILTER
    FILTER = first.rsplit(".", 2)[0] + ".*"
    selected = {
        f for n, f in index["weight_map"].items() if __import__("fnmatch").fnmatchcase(n, FILTER)
    }
    print(
        f"model: {opts.shards} shards, {n_tensors} tensors, headers "
        f"{min(lengths.values()) / 1024:.0f}-{max(lengths.values()) / 1024:.0f} KiB; "
        f"--filter {FILTER!r} is {len(selected)} shard(s); round trip {opts.rtt * 1000:.0f} ms"
    )

    def tensors_count(stdout: str) -> None:
        assert int(stdout.strip().splitlines()[-1]) == n_tensors, stdout[-200:]

    def inspect_count(stdout: str) -> None:
        assert json.loads(stdout)["result"]["tensors"] == n_tensors

    def verify_ok(stdout: str) -> None:
        assert json.loads(stdout)["ok"] is True

    ckpt = [PY, "-m", "ckpt_cli"]
    base_env = dict(
        os.environ, PYTHONPATH=str(opts.ckpt_root.resolve()), HF_HUB_DISABLE_PROGRESS_BARS="1"
    )
    base_env.pop("PYTHONDONTWRITEBYTECODE", None)
    tables: list[str] = []
    try:
        if opts.only in (None, "hub"):
            tables.append(bench_hub(opts, work, src, lengths, ckpt, base_env, tensors_count,
                                    inspect_count, verify_ok, len(selected)))  # fmt: skip
        if opts.only in (None, "s3"):
            tables.append(bench_s3(opts, work, src, lengths, ckpt, base_env, tensors_count,
                                   inspect_count, verify_ok))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    for table in tables:
        print(table)


Case = tuple[str, Callable[[int], list[str]], Callable[[str], None] | None, Callable[[int], None]]


def ckpt_from(root: Path, *args: str) -> list[str]:
    """`python -m ckpt_cli ARGS` run from another checkout (`--before`): `-m` puts the working
    folder first on the path, so the command changes into it."""
    where = str(root.resolve())
    script = 'cd "$0" && PYTHONPATH="$0" exec "$@"'
    return ["sh", "-c", script, where, PY, "-m", "ckpt_cli", *args]


def before_cases(opts: Any, url: str, inspect_count: Any, verify_ok: Any) -> list[Case]:
    """`ckpt inspect` and `ckpt verify` of `url` from the `--before` checkout (none without)."""
    if opts.before is None:
        return []
    nothing: Callable[[int], None] = lambda r: None  # noqa: E731
    return [
        ("inspect", lambda r: ckpt_from(opts.before, "inspect", url, "--json"), inspect_count, nothing),
        ("verify", lambda r: ckpt_from(opts.before, "verify", url, "--json"), verify_ok, nothing),
    ]  # fmt: skip


BEFORE_TOOLS = ["`ckpt inspect` (--before)", "`ckpt verify` (--before)"]


def run_cases(
    cases: list[Case], rounds: int, env: dict[str, str], count: Callable[[], int]
) -> dict[str, tuple[float, int]]:
    """Median seconds and the requests of the last run, per case; rounds interleaved."""
    times: dict[str, list[float]] = {name: [] for name, *_ in cases}
    requests: dict[str, int] = {}
    for r in range(rounds):
        for name, cmd, check, cleanup in cases:
            before = count()
            times[name].append(timed(cmd(r), env, check))
            requests[name] = count() - before
            cleanup(r)
    return {name: (statistics.median(t), requests[name]) for name, t in times.items()}


def table(title: str, rows: list[tuple[str, str, float, int]]) -> str:
    lines = [
        f"\n{title}\n",
        "| task | tool | time | / fastest | requests |",
        "|---|---|---|---|---|",
    ]
    fastest = {task: t for task, tool, t, _ in rows if tool.startswith("fastest")}
    for task, tool, seconds, requests in rows:
        ratio = seconds / fastest[task] if task in fastest else float("nan")
        lines.append(f"| {task} | {tool} | {seconds:.2f} s | {ratio:.2f}× | {requests} |")
    return "\n".join(lines)


def bench_hub(opts: Any, work: Path, src: Path, lengths: dict[str, int], ckpt: list[str],
              base_env: dict[str, str], tensors_count: Any, inspect_count: Any, verify_ok: Any,
              n_selected: int) -> str:  # fmt: skip
    hub = TestHub()
    hub.add_repo("bench/ds", src)
    hub.start()
    proxy = proxied(hub.url, opts.rtt)
    hub.url = proxy.url  # LFS redirects point back through the proxy
    env = dict(base_env, HF_ENDPOINT=proxy.url, HF_HOME=str(work / "hf-home"))
    url = "hf://bench/ds"

    def dest(kind: str) -> Callable[[int], str]:
        return lambda r: str(work / f"{kind}-{r}")

    def drop(kind: str) -> Callable[[int], None]:
        def clean(r: int) -> None:
            shutil.rmtree(work / f"{kind}-{r}", ignore_errors=True)
            shutil.rmtree(work / "hf-home" / "hub", ignore_errors=True)  # no shard stays cached

        return clean

    def selected_count(stdout: str) -> None:
        assert int(stdout.strip().splitlines()[-1]) == n_selected

    nothing: Callable[[int], None] = lambda r: None  # noqa: E731
    length_arg = json.dumps(lengths)
    cases: list[Case] = [
        ("inspect", lambda r: [PY, "-c", HUB_FASTEST, proxy.url, "bench/ds", length_arg], tensors_count, nothing),
        ("inspect", lambda r: [*ckpt, "inspect", url, "--json"], inspect_count, nothing),
        ("inspect", lambda r: [PY, "-c", HUB_HF, "bench/ds"], tensors_count, nothing),
        ("verify", lambda r: [*ckpt, "verify", url, "--json"], verify_ok, nothing),
        *before_cases(opts, url, inspect_count, verify_ok),
        ("inspect", lambda r: [*ckpt, "inspect", str(src), "--json"], inspect_count, nothing),
        ("verify", lambda r: [*ckpt, "verify", str(src), "--json"], verify_ok, nothing),
        ("download", lambda r: [PY, "-c", HUB_FASTEST_DOWNLOAD, proxy.url, "bench/ds", FILTER, dest("fast")(r)], selected_count, drop("fast")),
        ("download", lambda r: [*ckpt, "download", url, dest("shards")(r), "--filter", FILTER, "--no-extras", "-q"], None, drop("shards")),
        ("download", lambda r: [*ckpt, "download", url, dest("tensors")(r), "--filter", FILTER, "--mode", "tensors", "--no-extras", "-q"], None, drop("tensors")),
        ("download", lambda r: [PY, "-c", HUB_HF_DOWNLOAD, "bench/ds", FILTER, dest("hf")(r)], selected_count, drop("hf")),
    ]  # fmt: skip
    tools = [
        "fastest (list + all headers at once)", "`ckpt inspect`", "`get_safetensors_metadata`",
        "`ckpt verify`", *(BEFORE_TOOLS if opts.before else []),
        "`ckpt inspect` of a local copy (no network)",
        "`ckpt verify` of a local copy (no network)", "fastest (list + index + shards at once)", "`ckpt download` (shards)",
        "`ckpt download --mode tensors`", "`snapshot_download` of the index's shards",
    ]  # fmt: skip
    named = [
        (f"{task}#{i}", cmd, check, clean) for i, (task, cmd, check, clean) in enumerate(cases)
    ]
    try:
        results = run_cases(named, opts.rounds, env, lambda: len(hub.log))
    finally:
        proxy.stop()
        hub.stop()
    rows = []
    for (name, *_), tool in zip(named, tools, strict=True):
        task = name.split("#")[0]
        seconds, requests = results[name]
        rows.append((task if task != "verify" else "inspect", tool, seconds, requests))
    return table(f"Hub, {opts.shards} shards, {opts.rtt * 1000:.0f} ms round trip (proxy)", rows)


def bench_s3(opts: Any, work: Path, src: Path, lengths: dict[str, int], ckpt: list[str],
             base_env: dict[str, str], tensors_count: Any, inspect_count: Any,
             verify_ok: Any) -> str:  # fmt: skip
    import boto3

    endpoint, seen = start_moto()
    creds = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(creds)
    client = boto3.client("s3", endpoint_url=endpoint)  # uploads go straight to moto
    client.create_bucket(Bucket="bench")
    for path in sorted(src.iterdir()):
        client.upload_file(str(path), "bench", f"ds/{path.name}")
    proxy: LatencyProxy = proxied(endpoint, opts.rtt)
    env = dict(base_env, **creds, AWS_ENDPOINT_URL=proxy.url, FSSPEC_S3_ENDPOINT_URL=proxy.url)
    url = "s3://bench/ds"
    nothing: Callable[[int], None] = lambda r: None  # noqa: E731
    length_arg = json.dumps(lengths)
    cases: list[Case] = [
        ("inspect#0", lambda r: [PY, "-c", S3_FASTEST, "bench", "ds", length_arg], tensors_count, nothing),
        ("inspect#1", lambda r: [*ckpt, "inspect", url, "--json"], inspect_count, nothing),
        ("inspect#2", lambda r: [PY, "-c", S3_S3FS, "bench/ds"], tensors_count, nothing),
        ("inspect#3", lambda r: [*ckpt, "verify", url, "--json"], verify_ok, nothing),
        *[(f"inspect#b{i}", *case[1:]) for i, case in enumerate(before_cases(opts, url, inspect_count, verify_ok))],
        ("inspect#4", lambda r: [*ckpt, "inspect", str(src), "--json"], inspect_count, nothing),
        ("inspect#5", lambda r: [*ckpt, "verify", str(src), "--json"], verify_ok, nothing),
    ]  # fmt: skip
    tools = ["fastest (boto3: list + all headers at once)", "`ckpt inspect`",
             "s3fs: a header read after another", "`ckpt verify`",
             *(BEFORE_TOOLS if opts.before else []),
             "`ckpt inspect` of a local copy (no network)",
             "`ckpt verify` of a local copy (no network)"]  # fmt: skip
    try:
        results = run_cases(cases, opts.rounds, env, lambda: len(seen))
    finally:
        proxy.stop()
    rows = [
        ("inspect", tool, *results[name]) for (name, *_), tool in zip(cases, tools, strict=True)
    ]
    return table(
        f"S3 (moto), {opts.shards} shards, {opts.rtt * 1000:.0f} ms round trip (proxy)", rows
    )


if __name__ == "__main__":
    main()
