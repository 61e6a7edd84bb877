"""Helpers for tests that build DCP checkpoints with the real `dcp.save` and load with `dcp.load`.

Other areas (convert, reshard, verify) import these:

* `training_state(seed)`: a small model + AdamW state after one step, a step counter, RNG
  state and data-loader position: what a resumable training checkpoint holds.
* `dcp_save(state, path, serialization)`: `dcp.save` in one process (`no_dist=True`).
* `many_entries_dcp(path, count)`: a `dcp.save` of `count` tiny tensors (`layer.{i}.w`).
* `run_torchrun(script, nproc, *args)`: run a script under `torchrun --standalone` with gloo
  on CPU (the script reads the rank from the environment); raises with its output on failure.
* `torchrun_ckpt(nproc, *args)`: `torchrun --standalone -m ckpt_cli ARGS…`; returns the process.
* `free_port()`: a TCP port on 127.0.0.1 that is free now (for rendezvous and stores).
* `DIST_SCRIPT`: `tests/dcp_dist_script.py`, whose `save` and `load` modes save a DTensor
  `Shard(0)` checkpoint and load one back into `Shard(0)` DTensors, recording per rank which
  files it read.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DIST_SCRIPT = Path(__file__).resolve().parent / "dcp_dist_script.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at this moment (the OS picks it), for a rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def training_state(seed: int = 0) -> dict[str, Any]:
    """A small resumable training state: model, AdamW after one step, step, RNG, data loader."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "step": 7,
        "rng": {"torch": torch.get_rng_state(), "python": random.Random(seed).getstate()},
        "rng_bytes": bytes(range(16)),
        "dataloader": {"epoch": 1, "position": 42},
        "embed": torch.randn(5, 4).to(torch.bfloat16),
    }


def dcp_save(state: dict[str, Any], path: Path, serialization: str = "torch_save") -> None:
    """`dcp.save` in this process (no process group), with the given serialization."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = FileSystemWriter(str(path), serialization_format=SerializationFormat(serialization))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)


def many_entries_dcp(path: Path, count: int) -> Path:
    """A DCP of `count` tiny tensors (`layer.{i}.w`, 4 floats each) written by `dcp.save`."""
    dcp_save({f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}, path)
    return path


def dcp_load_flat(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """`dcp.load` (no process group) into a copy of `template` (flat fqn -> tensor or None)."""
    import torch.distributed.checkpoint as dcp

    target = dict(template)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for launched ranks: this checkout first on the path, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


#: the pytest item being run, set by conftest's `pytest_runtest_setup` (None outside pytest)
CURRENT_TEST: Any = None


def require_torchrun_marker() -> None:
    """Fail a test that launches ranks without the `torchrun` marker.

    `pytest -m "not torchrun"` is the fast loop; it stays fast only if every test that starts a
    multi-process launch says so, including tests whose module fixtures start one.
    """
    item = CURRENT_TEST
    if item is not None and item.get_closest_marker("torchrun") is None:
        raise AssertionError(
            f"{item.nodeid} launches torchrun: mark it (or its module) @pytest.mark.torchrun"
        )


def _torchrun(
    nproc: int, target: list[str], env: dict[str, str] | None, timeout: int
) -> subprocess.CompletedProcess[str]:
    require_torchrun_marker()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *target,
        ],
        capture_output=True,
        text=True,
        env=torchrun_env(env),
        timeout=timeout,
    )


#: what a C++ runtime prints when a thread is destroyed still joinable (torch/gloo teardown)
TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(
    script: Path, nproc: int, *args: str | os.PathLike[str], timeout: int = 300
) -> str:
    """Run `script` under `torchrun --standalone --nproc-per-node nproc`; return its output.

    A launch whose rank aborted in C++ teardown ("terminate called without an active
    exception": a gloo thread still joinable when the process exits, seen now and then with
    megatron's and accelerate's loaders on a loaded machine) is run once more; any other
    failure fails the test."""
    proc = _torchrun(nproc, [str(script), *[str(a) for a in args]], None, timeout)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        sys.stderr.write(f"torchrun {script.name}: a rank aborted in teardown; running it again\n")
        proc = _torchrun(nproc, [str(script), *[str(a) for a in args]], None, timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} {args} failed ({proc.returncode}):\n{output}")
    return output


def torchrun_ckpt(
    nproc: int,
    *args: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node nproc -m ckpt_cli ARGS…` (not checked)."""
    return _torchrun(nproc, ["-m", "ckpt_cli", *[str(a) for a in args]], env, timeout)
