"""The striping plan: block size, columns and stripes of a checkpoint's files."""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field

from .model import BLOCK_ALIGN, MAX_WIDTH, MIN_BLOCKS_PER_FILE, SELF_WIDTH, ParityManifest

# ------------------------------------------------------------------------------ layout


@dataclass
class _Plan:
    """Where every file's blocks go: W columns of L blocks; file i starts at block `starts[i]`
    of the column-major sequence (column c holds blocks c*L .. c*L+L-1)."""

    width: int
    stripes: int
    starts: list[int]
    whole_files: bool


#: files one rank of a distributed save writes: the loss of a node loses them whole
RANK_FILE = re.compile(
    r"(?:.*/)?(?:"
    r"__\d+_\d+\.distcp"  # DCP
    r"|(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(?:optim|model)_states\.pt"  # DeepSpeed ZeRO
    r"|mp_rank_\d+_model_states\.pt"  # DeepSpeed model parallel
    r"|mp_rank_\d+(?:_\d+)?/model_optim_rng\.pt"  # Megatron
    r"|rng_state_\d+\.pth|random_states_\d+\.pkl"  # Trainer / accelerate per-rank RNG
    r")"
)


def rank_files(names: list[str]) -> list[str]:
    """The names among `names` that one rank of a distributed save writes (`RANK_FILE`)."""
    return [n for n in names if RANK_FILE.fullmatch(n)]


def plan_layout(sizes: list[int], block_size: int, whole_files: bool = False) -> _Plan:
    """Place the files (see the module docstring): whole files in W columns when possible.

    With `whole_files`, every file gets its own place in a column even when one file is more
    than half of the checkpoint: columns are then as long as that file (parity >= K times
    the largest file), and any K files lost whole can still be rebuilt.
    """
    blocks = [-(-s // block_size) for s in sizes]
    total = sum(blocks)
    longest = max(blocks, default=0)
    if total == 0:
        return _Plan(1, 1, [0] * len(sizes), True)
    width = min(MAX_WIDTH, total // longest)
    if whole_files:
        width = max(width, min(2, sum(1 for n in blocks if n)))
    if width >= 2:
        # longest first into the emptiest column (LPT): no file crosses a column, so a file
        # lost costs at most one block per stripe, and columns come out nearly even
        fill = [0] * width
        placed: dict[int, tuple[int, int]] = {}
        for i in sorted(range(len(sizes)), key=lambda i: (-blocks[i], i)):
            column = min(range(width), key=lambda c: (fill[c], c))
            placed[i] = (column, fill[column])
            fill[column] += blocks[i]
        stripes = max(fill)
        starts = [placed[i][0] * stripes + placed[i][1] for i in range(len(sizes))]
        return _Plan(width, stripes, starts, True)
    # one file is more than half of everything: stripe within it, the files one after another
    # (a one-block checkpoint gets W = 1: its parity blocks are copies)
    width = min(SELF_WIDTH, total)
    starts, at = [], 0
    for n in blocks:
        starts.append(at)
        at += n
    if whole_files:  # one file holding blocks: its parity blocks are K copies of it
        return _Plan(1, total, starts, True)
    return _Plan(width, -(-total // width), starts, width == 1)


def lost_whole_costs(start: int, nblocks: int, stripes: int, width: int) -> int:
    """The most blocks of one stripe that a file occupies (its loss costs that many per
    stripe; it can be rebuilt from K parity blocks when this is at most K)."""
    if nblocks == 0:
        return 0
    end = start + nblocks
    first, last = start // stripes, (end - 1) // stripes
    # the count per stripe only changes where the file's first or last block sits
    worst = 0
    for s in {0, start % stripes, end % stripes}:
        count = sum(
            1 for c in range(first, min(last, width - 1) + 1) if start <= c * stripes + s < end
        )
        worst = max(worst, count)
    return worst


def small_block(longest: int) -> int:
    """The largest power-of-two block with at least `MIN_BLOCKS_PER_FILE` in the longest file.

    Files are padded to whole blocks; with blocks this small the padding stays under ~2% of
    a small checkpoint (large checkpoints keep the requested size).
    """
    target = max(BLOCK_ALIGN, longest // MIN_BLOCKS_PER_FILE)
    return max(BLOCK_ALIGN, 1 << (target.bit_length() - 1))


def parse_block_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    from ...sizes import parse_size

    return parse_size(text, option="--block-size")


@dataclass
class ParityLayout:
    """Block arithmetic of one manifest: which file and offset a stripe's column holds."""

    m: ParityManifest
    order: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # files holding blocks, by where they start (empty files hold none)
        self.order = sorted(
            (i for i, f in enumerate(self.m.files) if f.size), key=lambda i: self.m.files[i].start
        )
        self.starts = [self.m.files[i].start for i in self.order]

    def nblocks(self, fi: int) -> int:
        return -(-self.m.files[fi].size // self.m.block_size)

    def block(self, column: int, stripe: int) -> tuple[int, int] | None:
        """(file index, block index in that file) of one share of a stripe, or None (zeros)."""
        g = column * self.m.stripes + stripe
        k = bisect_right(self.starts, g) - 1
        if k < 0:
            return None
        fi = self.order[k]
        bi = g - self.m.files[fi].start
        return (fi, bi) if bi < self.nblocks(fi) else None

    def position(self, fi: int, bi: int) -> tuple[int, int]:
        """(column, stripe) of block `bi` of file `fi`."""
        g = self.m.files[fi].start + bi
        return g // self.m.stripes, g % self.m.stripes

    def extent(self, size: int, bi: int) -> tuple[int, int]:
        start = bi * self.m.block_size
        return start, min(size, start + self.m.block_size)
