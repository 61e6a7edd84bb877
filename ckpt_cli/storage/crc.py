"""The zip CRC-32 of large buffers, by ISA-L (the `isal` package) where it is installed.

A torch.save container (a DCP item, a `.pt` file) is a zip, and every record carries the CRC-32
of its bytes, so writing one from local tensor bytes reads them once for the CRC while the
kernel copies them (`FileRange.crc32`). zlib's `crc32` (1.2.x, what CPython links on Linux)
runs at ~6 GB/s on one core, 0.16-0.23 s of CPU per GiB, which on two cores competes with the
copy and the write-back. ISA-L computes the same function with carry-less multiplication at
~15 GB/s through `isal.isal_zlib.crc32` (0.036 s per GiB in memory on the dev machine).

`isal` is a runtime dependency; where its wheel is missing for a platform, zlib's `crc32`
gives the same numbers, slower.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cache

#: (data, previous CRC) -> CRC, as `zlib.crc32`
Crc32 = Callable[[bytes | bytearray | memoryview, int], int]


@cache
def crc32_function() -> Crc32:
    """ISA-L's CRC-32 where `isal` imports, else zlib's: imported once, on first use."""
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32
    crc: Crc32 = isal_zlib.crc32
    return crc


def implementation() -> str:
    """Which code computes large CRCs here: "isa-l" or "zlib" (for benches and reports)."""
    return "zlib" if crc32_function() is zlib.crc32 else "isa-l"
