"""A launch in which one rank never joins: rank `MISSING` leaves at once (exit 0, as a wrapper
script that skips its work would), every other rank runs `ckpt ARGS…` (a real `ckpt` process,
with the launch's environment). Usage under torchrun: `dist_early_exit_script.py MISSING ARGS…`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.dist_helpers import leave_without_teardown  # the checkout is first

if __name__ == "__main__":
    missing, args = sys.argv[1], sys.argv[2:]
    if os.environ["RANK"] == missing:
        leave_without_teardown()
    os.execv(sys.executable, [sys.executable, "-m", "ckpt_cli", *args])
