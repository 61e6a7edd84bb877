"""Helpers for tests that build DCP checkpoints with the real `dcp.save` and load with `dcp.load`.

Other areas (convert, reshard, verify) import these:

* `training_state(seed)`: a small model + AdamW state after one step, a step counter, RNG
  state and data-loader position: what a resumable training checkpoint holds.
* `dcp_save(state, path, serialization)`: `dcp.save` in one process (`no_dist=True`).
* `many_entries_dcp(path, count)`: a `dcp.save` of `count` tiny tensors (`layer.{i}.w`).
* `run_torchrun(script, nproc, *args)`: run a script under `torchrun --standalone` with gloo
  on CPU (the script reads the rank from the environment); raises with its output on failure,
  and past its timeout once every rank is ended (`Launch`).
* `torchrun_ckpt(nproc, *args)`: `torchrun --standalone -m ckpt_cli ARGS…`; returns the process.
* `free_port()`: a TCP port on 127.0.0.1 that is free now (for rendezvous and stores).
* `RANK_TIMEOUT`: the `timeout=` every launched script gives `init_process_group`, so a rank
  waiting for a dead or stuck peer ends itself instead of waiting torch's default 30 minutes.
* `leave_without_teardown()`: how a launched rank ends once every rank is done (see there).
* `Launch(command, env=…)` / `run_launch(command, timeout, env=…)`: a launcher (torchrun) started
  in a session of its own, its processes tagged; a timeout, or anything else that ends the
  wait, ends every process it started (SIGTERM, a short grace, SIGKILL) and waits for them,
  and a timeout fails with their output (`LaunchTimeout`).
* `DIST_SCRIPT`: `tests/dcp_dist_script.py`, whose `save` and `load` modes save a DTensor
  `Shard(0)` checkpoint and load one back into `Shard(0)` DTensors, recording per rank which
  files it read.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, NoReturn

import torch

REPO = Path(__file__).resolve().parents[1]
DIST_SCRIPT = Path(__file__).resolve().parent / "dcp_dist_script.py"

#: every launched script's `init_process_group(timeout=...)`: the rendezvous and each collective
#: fail after this long instead of torch's default 30 minutes (generous for a loaded machine: the
#: slowest rank between two collectives; far below the launches' own timeouts)
RANK_TIMEOUT = timedelta(seconds=180)


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


def leave_without_teardown() -> NoReturn:
    """End a launched rank once every rank is done (after its last collective, a barrier):
    flush and `os._exit(0)`, without tearing the gloo process group down.

    Tearing it down (`destroy_process_group`, or the interpreter freeing DDP's reducer, which
    holds the group too) joins gloo's worker thread while holding the GIL; a worker still
    freeing a finished collective (the barrier and the broadcast it waited for) must take the
    GIL to release their tensors. On a loaded machine the worker is that late now and then:
    the rank deadlocks, its peers gone (or, another ordering, aborts with "terminate called
    without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


#: the environment variable that tags every process of one launch (torchrun starts each rank in a
#: session of its own, out of reach of the launcher's process group; the environment is inherited)
LAUNCH_TAG = "CKPT_TEST_LAUNCH"
#: how long a launch's processes get after SIGTERM before SIGKILL
KILL_GRACE = 5.0
#: how long the killed processes may take to disappear
REAP_WAIT = 30.0


class LaunchTimeout(AssertionError):
    """A launch ran past its timeout; its processes were ended. The message holds its output."""


class Launch:
    """A launcher (torchrun and its ranks) started in a session of its own, every process it
    starts tagged through the environment (`LAUNCH_TAG`), so all of them can be found and ended,
    whichever session or process group they moved to and whoever their parent is now."""

    def __init__(
        self,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdout: int | IO[str] | None = None,
        stderr: int | IO[str] | None = None,
    ) -> None:
        """`stdout` and `stderr` default to pipes (`wait` returns what they held)."""
        self.command = command
        self.tag = uuid.uuid4().hex
        tagged = dict(os.environ if env is None else env)
        tagged[LAUNCH_TAG] = self.tag
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.PIPE if stderr is None else stderr,
            env=tagged,
            cwd=cwd,
            start_new_session=True,
        )
        # the pipes are read as the launch runs: the ranks hold them too, so the launcher's
        # exit is no end of file, and a full pipe would stop a rank mid-write
        self._chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        self._readers = [
            threading.Thread(target=self._read, args=(stream, self._chunks[name]), daemon=True)
            for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))
            if stream is not None
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[bytes], chunks: list[bytes]) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            chunks.append(chunk)
        stream.close()

    def processes(self) -> list[int]:
        """The live processes of this launch (zombies, which hold nothing, are not counted)."""
        needle = f"{LAUNCH_TAG}={self.tag}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone meanwhile, or another user's
                continue
            if needle in environ.split(b"\0") and state not in ("Z", "X"):
                found.append(int(entry.name))
        return found

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            self.proc.poll()  # reap the launcher as soon as it exits
            if not self.processes():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every process of the launch at once (a crash, not a stop); wait until all
        are gone."""
        self._signal(signal.SIGKILL)
        self.proc.wait()
        if not self._gone_within(REAP_WAIT):
            raise AssertionError(
                f"{self.command}: processes {self.processes()} outlived SIGKILL for {REAP_WAIT}s"
            )

    def end(self) -> None:
        """End every process of the launch: SIGTERM (torchrun then stops its ranks), a grace
        of `KILL_GRACE` seconds, SIGKILL to whatever is left; wait until all are gone."""
        if self.proc.poll() is not None and not self.processes():
            return
        self._signal(signal.SIGTERM)
        if self._gone_within(KILL_GRACE):
            self.proc.wait()
            return
        self.kill()

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) of the ended launch: all it wrote (what came within `REAP_WAIT`
        seconds if something outside the launch still holds a pipe)."""
        for reader in self._readers:
            reader.join(REAP_WAIT)
        out, err = (b"".join(self._chunks[name]) for name in ("out", "err"))
        return out.decode(errors="replace"), err.decode(errors="replace")

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Its result once the launcher exits (not checked), any process it left ended.

        Past `timeout` every process is ended and `LaunchTimeout` raised with their output;
        an exception while waiting (pytest-timeout, Ctrl-C) ends them too, their output
        written to stderr (pytest shows it with the failure)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end()
            out, err = self.output()
            raise LaunchTimeout(
                f"{' '.join(self.command)} did not finish within {timeout:g}s; its processes "
                f"were ended. Its output:\n{out}{err}"
            ) from None
        except BaseException:
            self.end()
            with contextlib.suppress(Exception):
                out, err = self.output()
                sys.stderr.write(f"{' '.join(self.command)} was interrupted:\n{out}{err}")
            raise
        self.end()  # a rank that outlived its launcher
        out, err = self.output()
        return subprocess.CompletedProcess(self.command, self.proc.returncode, out, err)


def run_launch(
    command: list[str],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`Launch(command…).wait(timeout)`: run a launcher to its end; its result (not checked)."""
    return Launch(command, env=env, cwd=cwd).wait(timeout)


def torchrun_command(nproc: int, *target: str | os.PathLike[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node NPROC TARGET…`
    (`--standalone`: torchrun picks a free port for its rendezvous)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *[str(t) for t in target],
    ]


def _torchrun(
    nproc: int, target: list[str], env: dict[str, str] | None, timeout: int
) -> subprocess.CompletedProcess[str]:
    require_torchrun_marker()
    return run_launch(torchrun_command(nproc, *target), timeout, env=torchrun_env(env))


#: what a C++ runtime prints when a thread is destroyed still joinable (torch/gloo teardown)
TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(
    script: Path,
    nproc: int,
    *args: str | os.PathLike[str],
    timeout: int = 300,
    env: dict[str, str] | None = None,
) -> str:
    """Run `script` under `torchrun --standalone --nproc-per-node nproc`; return its output.

    A launch whose rank aborted in C++ teardown ("terminate called without an active
    exception": a gloo thread still joinable when the process exits, seen now and then with
    megatron's and accelerate's loaders on a loaded machine) is run once more; any other
    failure fails the test. Past `timeout` every rank is ended and the test fails with their
    output (`LaunchTimeout`), not run again. `env`: variables the ranks get beside this
    process's."""
    proc = _torchrun(nproc, [str(script), *[str(a) for a in args]], env, timeout)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        sys.stderr.write(f"torchrun {script.name}: a rank aborted in teardown; running it again\n")
        proc = _torchrun(nproc, [str(script), *[str(a) for a in args]], env, timeout)
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
