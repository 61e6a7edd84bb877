"""`ckpt` launched as two torchrun "nodes" (#18): the multi-node path, not only `--standalone`.

A user with two machines starts the same `torchrun --nnodes 2 --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ckpt_cli …` on each. Here both "nodes" run on
localhost: two launcher processes meet in a c10d rendezvous on 127.0.0.1 (the first hosts the
store), each with its own node-local scratch folder (`TMPDIR`), and the output folder on the
filesystem both see. What they publish must be byte for byte what one process writes, and
nothing may be left in either node's scratch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from .conftest import run_ckpt
from .dist_helpers import (
    Launch,
    dcp_save,
    free_port,
    require_torchrun_marker,
    torchrun_env,
    training_state,
)
from .test_distributed import assert_same_tree, no_leftovers

pytestmark = pytest.mark.torchrun


def two_nodes(tmp_path: Path, name: str, *args: str | Path) -> list[tuple[int, str]]:
    """`torchrun --nnodes 2 --nproc-per-node 1 -m ckpt_cli ARGS` started as two nodes on
    localhost, each with its own scratch folder; (exit code, output) per node, node 0 first."""
    require_torchrun_marker()
    port = free_port()
    launches = []
    for node in (0, 1):
        scratch = tmp_path / f"scratch-{name}-node{node}"
        scratch.mkdir()
        env = torchrun_env({"TMPDIR": str(scratch)})
        for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=ckpt-{name}",
            # node 0 hosts the rendezvous store; the other joins it (both are on 127.0.0.1)
            f"--rdzv-conf=is_host={int(node == 0)},join_timeout=600",
            "--max-restarts=0",
            "-m",
            "ckpt_cli",
            *map(str, args),
        ]
        launches.append(Launch(cmd, env=env, stderr=subprocess.STDOUT))
    try:
        done = [launch.wait(600) for launch in launches]
    finally:  # one node failed or timed out: the other waits for it in vain
        for launch in launches:
            launch.end()
    results = [(proc.returncode, proc.stdout) for proc in done]
    for node in (0, 1):
        # node-local scratch: ckpt leaves nothing there (torchrun keeps its own logs folder)
        scratch = tmp_path / f"scratch-{name}-node{node}"
        left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchelastic_")]
        assert left == [], left
    return results


def ok_json(results: list[tuple[int, str]]) -> dict[str, Any]:
    """Node 0's `--json` document, after both nodes exited 0."""
    assert [code for code, _ in results] == [0, 0], "\n---\n".join(out for _, out in results)
    return first_json(results[0][1])


def first_json(out: str) -> dict[str, Any]:
    """The `--json` document in a node's output (torchrun's own log lines may follow it)."""
    doc, _ = json.JSONDecoder().raw_decode(out, out.index("{"))
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A DCP training checkpoint and a sharded safetensors model (real writers)."""
    root = tmp_path_factory.mktemp("multinode")
    dcp = root / "dcp"
    dcp_save(training_state(), dcp)
    torch.manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(32, 8 + 4 * i) for i in range(6)}
    weights["embed"] = torch.randn(50, 8).to(torch.bfloat16)
    save_file(weights, str(root / "model.safetensors"))
    sharded = root / "sharded"
    result = run_ckpt(
        "convert", root / "model.safetensors", sharded, "--to", "safetensors",
        "--max-shard-size", "2KB",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return {"dcp": dcp, "sharded": sharded}


def test_two_nodes_convert_reshard_and_verify_like_one_process(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    dcp, sharded = sources["dcp"], sources["sharded"]
    single, split = tmp_path / "single", tmp_path / "split"
    single.mkdir()
    split.mkdir()
    convert = ["convert", dcp, "--to", "safetensors", "--max-shard-size", "1KB"]
    reshard = ["reshard", dcp, "--world-size", "3"]
    for args, name in ((convert, "st"), (reshard, "ws3")):
        want = run_ckpt(*args[:2], single / name, *args[2:])
        assert want.exit_code == 0, want.stderr
        doc = ok_json(two_nodes(tmp_path, name, *args[:2], split / name, *args[2:], "--json"))
        # the work was split over both nodes' ranks
        assert [r["rank"] for r in doc["result"]["ranks"]] == [0, 1]
        assert all(r["files"] for r in doc["result"]["ranks"])
        assert_same_tree(single / name, split / name)
    assert no_leftovers(split) == []

    # verify --write-manifest: each node hashes its share, the manifest is one process's
    for copy in ("hashed-single", "hashed-split"):
        shutil.copytree(sharded, tmp_path / copy)
    assert run_ckpt("verify", tmp_path / "hashed-single", "--write-manifest").exit_code == 0
    hashed_split = tmp_path / "hashed-split"
    doc = ok_json(two_nodes(tmp_path, "hash", "verify", hashed_split, "--write-manifest", "--json"))
    assert doc["ok"] is True
    hashed = doc["result"]["ranks"]
    assert [r["rank"] for r in hashed] == [0, 1] and all(r["files"] for r in hashed)
    manifests = [
        json.loads((tmp_path / copy / "ckpt-manifest.json").read_text())["files"]
        for copy in ("hashed-single", "hashed-split")
    ]
    assert manifests[0] == manifests[1]
    # a flipped byte is found whichever node hashed that shard; both nodes fail
    victim = sorted(hashed_split.glob("model-0000*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    results = two_nodes(tmp_path, "bad", "verify", hashed_split, "--checksums", "--json")
    assert [code for code, _ in results] == [1, 1]
    doc = first_json(results[0][1])
    assert [p["file"] for p in doc["result"]["problems"]] == [str(victim)]
