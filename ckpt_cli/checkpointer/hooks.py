"""A test-only pause point, so a test can SIGKILL a training process at a chosen moment of a
background save (nothing here runs unless the variable is set).

`CKPT_TEST_PAUSE_AT=POINT[@STEP]` makes the background writer stop at `POINT` (of the save of
step `STEP`, or of every save that reaches it; once per save), write one line into the file named by
`CKPT_TEST_PAUSE_FILE` and wait there while that file exists (ten minutes at most): the test
waits for the file, then kills the process, or removes the file to let the save go on. The
points, in the order a save reaches them:

| point | the moment |
|---|---|
| `write` | every rank's data files are written and fsynced; `.metadata` (the commit marker) is not |
| `publish` | the staging folder is complete (marker, manifest, parity), not yet renamed |
| `upload` | the first file of the save is in the object store; its `.metadata` is not |
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_ENV = "CKPT_TEST_PAUSE_AT"
PAUSE_FILE_ENV = "CKPT_TEST_PAUSE_FILE"
#: the longest a paused writer waits to be killed before it carries on
PAUSE_LIMIT = 600.0
#: (point, step) already paused at: each pauses once per process
_PAUSED: set[tuple[str, int]] = set()


def pause_point(point: str, step: int) -> None:
    """Pause here when `CKPT_TEST_PAUSE_AT` names this point (and step); see the module."""
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    name, _, at = wanted.partition("@")
    if name != point or (at and int(at) != step) or (point, step) in _PAUSED:
        return
    _PAUSED.add((point, step))
    marker = os.environ.get(PAUSE_FILE_ENV)
    if not marker:
        return
    path = Path(marker)
    path.write_text(f"{point} {step} {os.getpid()}\n")
    deadline = time.monotonic() + PAUSE_LIMIT
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
