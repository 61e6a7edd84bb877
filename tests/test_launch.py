"""The launch helper every torchrun test goes through (`dist_helpers.Launch`, `run_launch`).

A torchrun launch that hangs under load used to be killed by `subprocess.run`'s timeout: a
SIGKILL to the launcher alone. torchrun starts each rank in a session of its own, so the ranks
lived on, holding CPU and ports for the rest of the suite. These tests stand in for torchrun
with a plain script that starts one child in its own process group and one in a session of its
own (as torchrun does its ranks), all of them ignoring SIGTERM, so the SIGKILL that follows the
grace is needed. No torchrun is started: they run in the fast loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from .dist_helpers import KILL_GRACE, Launch, LaunchTimeout, run_launch

#: a stand-in launcher: starts two children that ignore SIGTERM, one in its own process group
#: and one in a session of its own, writes "PGID SAME OWN" to argv[1], prints, then sleeps
#: (or, with argv[2] == "exit", exits at once, leaving its children behind)
LAUNCHER = """
import os, signal, subprocess, sys, time
from pathlib import Path
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
same = subprocess.Popen([sys.executable, "-c", stubborn])
own = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(1)  # the children have set their handlers
Path(sys.argv[1] + ".tmp").write_text(f"{os.getpgid(0)} {same.pid} {own.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
print("rank 0: waiting for rank 1", flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
time.sleep(600)
"""


def _started(launch: Launch, pids: Path) -> tuple[int, int, int]:
    """(the launcher's process group, its child in that group, its child in its own session),
    once the launcher has written them (a bounded wait: Python starts slowly on a busy machine)."""
    deadline = time.monotonic() + 120
    while not pids.exists():
        assert launch.proc.poll() is None, launch.output()
        if time.monotonic() > deadline:
            launch.end()
            raise AssertionError("the stand-in launcher never started its children")
        time.sleep(0.05)
    pgid, same, own = map(int, pids.read_text().split())
    return pgid, same, own


def _assert_gone(*groups: int) -> None:
    """No process of the process groups `groups` exists, as the helper promised on return (a
    killed orphan is reaped by init, which may take a moment: a bounded wait for that only)."""
    deadline = time.monotonic() + 10
    left: list[int] = []
    for group in groups:
        while True:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                left.append(group)
                break
            time.sleep(0.05)
    assert left == [], f"process groups {left} survived the launch"


@pytest.mark.slow
def test_a_launch_past_its_timeout_fails_with_its_output_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    launch = Launch([sys.executable, "-c", LAUNCHER, str(pids), "hang"])
    pgid, _same, own = _started(launch, pids)
    assert pgid == launch.proc.pid  # the launch is a session (and process group) of its own
    began = time.monotonic()
    with pytest.raises(LaunchTimeout) as failure:
        launch.wait(timeout=0.5)
    # SIGTERM is ignored by all: the SIGKILL after the grace ended them
    assert time.monotonic() - began >= KILL_GRACE
    assert "did not finish within 0.5s" in str(failure.value)
    assert "rank 0: waiting for rank 1" in str(failure.value)
    assert launch.proc.returncode == -signal.SIGKILL
    _assert_gone(pgid, own)  # `same` is in group `pgid`
    assert launch.processes() == []


@pytest.mark.slow
def test_a_launcher_that_exits_leaves_no_process_behind(tmp_path: Path) -> None:
    """A rank that outlives its launcher (its own session, its parent gone) is ended too."""
    pids = tmp_path / "pids"
    launch = Launch([sys.executable, "-c", LAUNCHER, str(pids), "exit"])
    pgid, _same, own = _started(launch, pids)
    proc = launch.wait(timeout=120)
    assert proc.returncode == 0
    assert proc.stdout == "rank 0: waiting for rank 1\n"
    _assert_gone(pgid, own)  # `same` is in group `pgid`


class _Interrupted(Exception):
    """What pytest-timeout raises from its signal handler when a test runs past its timeout."""


@pytest.mark.slow
def test_an_interrupted_wait_ends_every_process_and_shows_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The test's own timeout (pytest-timeout raises from a signal handler) firing while the
    launch runs: the exception goes on, and the launch's processes are ended first."""
    pids = tmp_path / "pids"
    launch = Launch([sys.executable, "-c", LAUNCHER, str(pids), "hang"])
    pgid, _same, own = _started(launch, pids)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(_Interrupted):
            launch.wait(timeout=300)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    _assert_gone(pgid, own)  # `same` is in group `pgid`
    assert "rank 0: waiting for rank 1" in capsys.readouterr().err


def test_run_launch_returns_the_result_of_a_launch_that_ends(tmp_path: Path) -> None:
    proc = run_launch([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], 120)
    assert (proc.returncode, proc.stdout) == (3, "out\n")
