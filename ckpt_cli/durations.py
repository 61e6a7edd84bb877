"""Human durations on the command line (`--settle 2m`, `--watch 30s`, `--keep-within 2d`).

Every option that takes a length of time takes the same spellings: a bare number is seconds
(`--settle 120`, as before units were accepted), or numbers with units `s`, `m`, `h`, `d`, `w`,
joined (`1d12h`).
"""

from __future__ import annotations

import re

from .errors import UsageError

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str, option: str = "duration", *, allow_zero: bool = False) -> float:
    """`90`, `90s`, `30m`, `6h`, `2d`, `1w`, `1d12h` as seconds (UsageError otherwise).

    Args:
        text: what the user wrote.
        option: the option's name, for the message (`--settle`).
        allow_zero: whether `0` is a valid value (`--settle 0`: nothing waits), else a
            duration must be longer than 0.
    """
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise UsageError(
            f"{option} {text!r} is not a duration",
            fix="Write seconds, or a number with a unit: 90s, 30m, 6h, 2d, 1w (or 1d12h).",
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0 and not (allow_zero and seconds == 0):
        raise UsageError(
            f"{option} must be longer than 0 (got {text!r})",
            fix=f"Give a duration such as {option} 6h (units: s, m, h, d, w).",
        )
    return seconds


def format_duration(seconds: float) -> str:
    """`seconds` as the largest whole unit that spells it: 7200 -> `2h`, 90 -> `90s`."""
    for unit in ("w", "d", "h", "m"):
        size = _UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
