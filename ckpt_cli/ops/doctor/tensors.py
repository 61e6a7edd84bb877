"""Tensor statistics for the doctor, streamed in float64 blocks, without torch where it can.

Where the format stores a tensor's raw C-order bytes (safetensors, DCP chunks, the tensor bytes
inside torch.save blobs: `Checkpoint.serves_raw`), the bytes are read in blocks of
`BLOCK_ELEMENTS` elements and viewed with numpy: torch is never imported and no whole tensor is
ever held, so the doctor's peak memory is its own imports plus a few blocks. Anything else (a
zstd-compressed chunk, a dtype numpy has no view of) is read whole through the format's
torch-based reader, one tensor at a time, and sliced.

Every statistic is a sum over blocks (two tensors are read in lockstep, block for block), so
the order of reads, and the memory, are the same whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...formats.base import Checkpoint
from ...models import Entry

if TYPE_CHECKING:
    from numpy.typing import NDArray

#: elements per block (float64 working copies of a few MiB)
BLOCK_ELEMENTS = 1 << 18
#: little-endian numpy views of the dtypes kept as raw bytes (bfloat16: the top half of a float32)
_NUMPY_VIEWS = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "u1",
}


def _view(raw: bytes | bytearray | memoryview, dtype: str) -> NDArray[np.float64]:
    """One block of raw little-endian bytes as float64."""
    array = np.frombuffer(raw, dtype=_NUMPY_VIEWS[dtype])
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def streams_raw(checkpoint: Checkpoint, entry: Entry) -> bool:
    """Whether `blocks` reads this tensor from its raw bytes (no torch, no whole tensor)."""
    return entry.dtype in _NUMPY_VIEWS and checkpoint.serves_raw(entry.name)


def blocks(checkpoint: Checkpoint, entry: Entry) -> Iterator[NDArray[np.float64]]:
    """Tensor `entry` of `checkpoint` flattened, as float64 blocks of `BLOCK_ELEMENTS` (the
    last one shorter): two tensors of the same size yield blocks of the same sizes."""
    if entry.dtype is not None and streams_raw(checkpoint, entry):
        size = np.dtype(_NUMPY_VIEWS[entry.dtype]).itemsize
        want = BLOCK_ELEMENTS * size
        pending = bytearray()
        for piece in checkpoint.iter_raw(entry.name, block=want):
            if not pending and len(piece) == want:
                yield _view(piece, entry.dtype)  # the usual case: a whole block, no copy
                continue
            pending += piece
            while len(pending) >= want:
                yield _view(bytes(pending[:want]), entry.dtype)
                del pending[:want]
        if pending:
            yield _view(bytes(pending), entry.dtype)
        return
    import torch

    flat = checkpoint.read_tensor(entry.name).reshape(-1)
    for start in range(0, flat.numel(), BLOCK_ELEMENTS):
        yield flat[start : start + BLOCK_ELEMENTS].to(torch.float64).numpy()
    del flat


def total(checkpoint: Checkpoint, entry: Entry) -> tuple[float, int]:
    """(sum of the elements, their count) of one tensor."""
    s, n = 0.0, 0
    for block in blocks(checkpoint, entry):
        s += float(block.sum())
        n += block.size
    return s, n


def _dot(x: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    # einsum's own loop, not BLAS: `np.dot` hands a vector to a threaded BLAS, whose threads
    # cost ~100x the arithmetic on a loaded machine
    return float(np.einsum("i,i->", x, y))


@dataclass
class _Sums:
    """Running sums of one pair (x, y) of equal-sized tensors."""

    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0
    sdd: float = 0.0
    n: int = 0

    def add_block(
        self, x: NDArray[np.float64], y: NDArray[np.float64], sy: float, syy: float
    ) -> None:
        self.sx += float(x.sum())
        self.sy += sy
        self.sxx += _dot(x, x)
        self.syy += syy
        self.sxy += _dot(x, y)
        d = y - x
        self.sdd += _dot(d, d)
        self.n += x.size

    def moments(self) -> tuple[float, float, float]:
        n = self.n
        if not n:
            return 0.0, 0.0, 1.0
        var_x = max(self.sxx / n - (self.sx / n) ** 2, 0.0)
        var_y = max(self.syy / n - (self.sy / n) ** 2, 0.0)
        cov = self.sxy / n - (self.sx / n) * (self.sy / n)
        if var_x <= 1e-30 and var_y <= 1e-30:
            corr = 1.0
        elif var_x <= 1e-30 or var_y <= 1e-30:
            corr = 0.0
        else:
            corr = cov / math.sqrt(var_x * var_y)
        return math.sqrt(self.sxx), math.sqrt(self.sdd), corr


def moments_against(
    b: tuple[Checkpoint, Entry], others: list[tuple[Checkpoint, Entry]]
) -> list[tuple[float, float, float]]:
    """For each tensor `a` of `others`: (‖a‖, ‖b - a‖, Pearson correlation of a and b), all
    tensors the size of `b`, read in one pass (`b` once, however many it is compared with).

    The correlation is 1.0 for two constant tensors (nothing to correlate), and 0.0 when only
    one of them is constant.
    """
    sums = [_Sums() for _ in others]
    streams = [blocks(*a) for a in others]
    for vb in blocks(*b):
        sb, sbb = float(vb.sum()), _dot(vb, vb)
        for acc, stream in zip(sums, streams, strict=True):
            va = next(stream, None)
            if va is None or va.size != vb.size:
                raise ValueError("tensors of different sizes compared")
            acc.add_block(va, vb, sb, sbb)
    for stream in streams:
        if next(stream, None) is not None:
            raise ValueError("tensors of different sizes compared")
    return [acc.moments() for acc in sums]


def pair_moments(
    a: tuple[Checkpoint, Entry], b: tuple[Checkpoint, Entry]
) -> tuple[float, float, float]:
    """(‖a‖, ‖b - a‖, Pearson correlation of a and b) of two tensors of the same size."""
    return moments_against(b, [a])[0]


def raw_bytes(checkpoint: Checkpoint, entry: Entry, limit: int = 1 << 20) -> bytes | None:
    """A small raw-stored tensor's bytes (an RNG state), None when not raw or over `limit`."""
    if entry.dtype is None or not checkpoint.serves_raw(entry.name):
        return None
    if entry.nbytes is not None and entry.nbytes > limit:
        return None
    return b"".join(checkpoint.iter_raw(entry.name))


def head(checkpoint: Checkpoint, entry: Entry, count: int) -> NDArray[np.float64]:
    """A tensor's first `count` elements (flattened, C order) as float64: a fingerprint to
    correlate many tensors with each other in memory, read as `count` elements, not the whole
    tensor, where the format stores raw bytes."""
    if entry.dtype is not None and streams_raw(checkpoint, entry):
        size = np.dtype(_NUMPY_VIEWS[entry.dtype]).itemsize
        for piece in checkpoint.iter_raw(entry.name, block=count * size):
            return _view(piece, entry.dtype)
        return np.zeros(0)
    first = next(blocks(checkpoint, entry), None)
    return first[:count].copy() if first is not None else np.zeros(0)


def correlation(x: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Pearson correlation of two vectors of the same size (0.0 where either is constant)."""
    dx, dy = x - x.mean(), y - y.mean()
    norm = math.sqrt(_dot(dx, dx) * _dot(dy, dy))
    return _dot(dx, dy) / norm if norm > 1e-30 else 0.0
