"""The erasure code: liberasurecode's ISA-L Cauchy Reed–Solomon through `pyeclib`, and block digests."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from ...errors import UsageError
from .model import EC_TYPE

#: pyeclib fragment header size (checked against the library at start)
_HEADER = 80
#: bytes of one block read, hashed or decoded at a time: a block may be 1 GiB, memory is not.
#: Reed–Solomon works byte by byte across a stripe's blocks, so the same code over the same
#: slice of every block gives that slice of the parity (or of a rebuilt block)
CHUNK = 1 << 20


def chunk_size(block_size: int) -> int:
    """The slice of a block processed at once: the largest power of two dividing the block
    (blocks are whole 4 KiB pages) up to `CHUNK`."""
    return math.gcd(block_size, CHUNK)


# ------------------------------------------------------------------------------ codec


class Codec:
    """W + K Reed–Solomon over raw, equal-length blocks (pyeclib, headers kept aside)."""

    def __init__(self, width: int, parity: int, block_size: int, ec_type: str = EC_TYPE):
        from pyeclib.ec_iface import ECDriver

        try:
            self.driver = ECDriver(k=width, m=parity, ec_type=ec_type)
        except Exception as exc:  # a liberasurecode build without this backend
            raise UsageError(
                f"the erasure code {ec_type} is not available ({exc})",
                fix="Install pyeclib from its manylinux wheel (it bundles ISA-L).",
            ) from None
        self.width = width
        self.parity = parity
        self.block_size = block_size
        probe = self.driver.encode(bytes(width * block_size))
        if len(probe) != width + parity or any(
            len(f) != _HEADER + block_size for f in probe
        ):  # pragma: no cover - guards a change of liberasurecode's fragment format
            raise UsageError(
                f"pyeclib {ec_type} splits blocks in an unexpected way",
                fix="Install the pyeclib version ckpt is tested with (see pyproject.toml).",
            )
        self.headers = [bytes(f[:_HEADER]) for f in probe]

    def encode(self, blocks: list[bytes]) -> list[bytes]:
        """The K parity blocks of one stripe of W blocks."""
        fragments = self.driver.encode(b"".join(blocks))
        return [bytes(f[_HEADER:]) for f in fragments[self.width :]]

    def rebuild(self, shares: dict[int, bytes], wanted: list[int]) -> dict[int, bytes]:
        """Shares `wanted` (0..W-1 data, W.. parity) from at least W others of the stripe."""
        given = sorted(shares)[: self.width]
        fragments = [self.headers[i] + shares[i] for i in given]
        out = self.driver.reconstruct(fragments, wanted)
        return {i: bytes(f[_HEADER:]) for i, f in zip(wanted, out, strict=True)}


def block_digest(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def slices(length: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """(offset, length) of the `chunk`-sized pieces of `length` bytes, the last one short."""
    for offset in range(0, length, chunk):
        yield offset, min(chunk, length - offset)


def chunked_digest(read: Callable[[int, int], bytes], length: int) -> tuple[str, int]:
    """The XXH3-128 of `length` bytes read `CHUNK` at a time by `read(offset, size)` (the same
    digest `block_digest` gives the whole), and the bytes read."""
    import xxhash

    h = xxhash.xxh3_128()
    done = 0
    for offset, size in slices(length):
        data = read(offset, size)
        h.update(data)
        done += len(data)
    return h.hexdigest(), done


def pad_block(data: bytes, size: int) -> bytes:
    return data if len(data) == size else data + bytes(size - len(data))
