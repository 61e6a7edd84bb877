"""Human sizes on the command line (`--max-shard-size 2GB`), and counts in messages.

Units follow huggingface_hub's `parse_size_to_int` (which `save_torch_state_dict` and
transformers' `max_shard_size` use): `KB`, `MB`, `GB`, `TB` are decimal (1 GB = 10^9 bytes),
so `--max-shard-size 5GB` cuts the same shards as `save_pretrained(max_shard_size="5GB")`.
The binary units `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024; a bare number (or `B`) is bytes.
"""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, *, option: str = "--max-shard-size") -> int:
    """`'2GB'` -> 2_000_000_000, `'1.5GiB'` -> 1_610_612_736, `'4096'` -> 4096."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"{option} {text!r} is not a size",
            fix="Write a number with an optional unit: 500MB, 2GB (decimal) or 1.5GiB (binary).",
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(
            f"{option} {text!r} must be more than 0 bytes", fix=f"Give a size, e.g. {option} 4GB."
        )
    return value


def counted(n: int, noun: str) -> str:
    """(1, 'file') -> '1 file'; (3, 'file') -> '3 files': a count in a message, the library's
    as the command line's."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
