"""Parse byte sizes the way users write them (`5GB`, `500MB`, `2GiB`, `1000000`).

Decimal units follow huggingface_hub's `max_shard_size` convention (`5GB` = 5 * 10**9 bytes),
so `--max-shard-size 5GB` cuts the same shards as `save_torch_state_dict(max_shard_size="5GB")`;
binary units (`KiB`, `MiB`, `GiB`, `TiB`) are accepted too, and a bare number is bytes.
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
_SIZE = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """`'5GB'` -> 5_000_000_000, `'2GiB'` -> 2_147_483_648, `'4096'` -> 4096 (UsageError if bad)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match["unit"].upper() if match else ""
    if not match or unit not in _UNITS:
        raise UsageError(
            f"cannot read {text!r} as a size",
            fix="Write a number of bytes or a number with a unit: 500MB, 5GB, 2GiB.",
        )
    size = int(float(match["value"]) * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"size {text!r} must be positive", fix="Use e.g. 5GB.")
    return size
