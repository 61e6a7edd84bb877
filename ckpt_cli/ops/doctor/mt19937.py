"""How many numbers torch's CPU generator has drawn since it was seeded, from its saved state.

`torch.get_rng_state()` is the 5056-byte `CPUGeneratorImplState`: the initial seed (uint64),
`left` and `seeded` (int32), `next` (uint64, the index of the next word), the 624 MT19937 words
(each widened to uint64), then the cached normal samples. The seed is in the state, so the
state it started from is known (`init_with_uint32`); twisting that forward until the saved
words come up gives the draws since the seed: `(twists - 1) * 624 + next`. A restored
generator has drawn at least as many numbers after a resume as before it; one seeded again at
the resume has drawn fewer (or carries another seed).

The twist is MT19937's, in numpy over four slices (the recurrence reads words 397 ahead, old,
and 227 behind, new); the walk stops at `MAX_TWISTS` (about 10 million draws), beyond which
nothing is claimed. Nothing here imports torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

N, M = 624, 397
_MATRIX_A = np.uint32(0x9908B0DF)
_UPPER = np.uint32(0x80000000)
_LOWER = np.uint32(0x7FFFFFFF)
#: the size of `torch.get_rng_state()` (CPUGeneratorImplState)
STATE_BYTES = 5056
#: the longest walk from a seed: 16384 twists, ~10.2 million draws (well under a second)
MAX_TWISTS = 1 << 14


@dataclass(frozen=True)
class CpuGeneratorState:
    """What a saved torch CPU generator state says.

    Attributes:
        seed: the seed it was last seeded with.
        next: the index of the next of the 624 words it hands out.
        words: the 624 MT19937 words (uint32, little-endian bytes).
    """

    seed: int
    next: int
    words: bytes


def parse(raw: bytes) -> CpuGeneratorState | None:
    """The state in `torch.get_rng_state()`'s bytes; None for anything else."""
    if len(raw) != STATE_BYTES:
        return None
    seed, left, seeded, nxt = struct.unpack_from("<QiiQ", raw, 0)
    words = np.frombuffer(raw, dtype="<u8", count=N, offset=24)
    if seeded != 1 or not 0 <= nxt <= N or not 1 <= left <= N or bool((words >> 32).any()):
        return None
    return CpuGeneratorState(seed, int(nxt), words.astype("<u4").tobytes())


def _seeded(seed: int) -> NDArray[np.uint32]:
    mt = [seed & 0xFFFFFFFF]
    for j in range(1, N):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + j) & 0xFFFFFFFF)
    return np.array(mt, dtype=np.uint32)


def _mix(upper: NDArray[np.uint32], lower: NDArray[np.uint32]) -> NDArray[np.uint32]:
    y = (upper & _UPPER) | (lower & _LOWER)
    out: NDArray[np.uint32] = (y >> np.uint32(1)) ^ ((y & np.uint32(1)) * _MATRIX_A)
    return out


def _twist(mt: NDArray[np.uint32]) -> NDArray[np.uint32]:
    new = np.empty_like(mt)
    new[:227] = mt[397:] ^ _mix(mt[:227], mt[1:228])
    new[227:454] = new[:227] ^ _mix(mt[227:454], mt[228:455])
    new[454:623] = new[227:396] ^ _mix(mt[454:623], mt[455:624])
    new[623:] = new[396:397] ^ _mix(mt[623:], new[:1])
    return new


def draws_since_seed(states: list[CpuGeneratorState]) -> list[int | None]:
    """For each state, the numbers drawn since its seed (None: not reached within
    `MAX_TWISTS`, or not a state its seed leads to). One walk per distinct seed."""
    out: list[int | None] = [None] * len(states)
    for seed in {s.seed for s in states}:
        wanted: dict[bytes, list[int]] = {}
        for i, state in enumerate(states):
            if state.seed == seed:
                wanted.setdefault(state.words, []).append(i)
        mt = _seeded(seed)
        for i in wanted.pop(mt.astype("<u4").tobytes(), []):
            out[i] = 0 if states[i].next == 0 else None
        twists = 0
        while wanted and twists < MAX_TWISTS:
            mt = _twist(mt)
            twists += 1
            for i in wanted.pop(mt.astype("<u4").tobytes(), []):
                if states[i].next >= 1:
                    out[i] = (twists - 1) * N + states[i].next
    return out
