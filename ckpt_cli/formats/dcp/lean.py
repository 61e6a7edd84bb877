"""Lean records: torch's per-chunk `.metadata` records rewritten so that unpickling them keeps
nothing but the records.

torch pickles every chunk as three records (a `ChunkStorageMetadata`, and in `storage_data` a
`MetadataIndex` key with its `_StorageInfo` value), each as NEWOBJ, a state dict and BUILD,
and each `torch.Size` in them as a REDUCE of `torch.Size` over a 1-tuple. Protocol 4 memoizes
every one of those objects, so the unpickler's memo keeps, until the load ends, three state
dicts and three argument tuples per chunk (about 340 bytes) that nothing else holds (#30).

Before the load, each run of such records is rewritten, byte for byte the same length and with
the same memo numbering, so that the memo holds None where it held a state dict or an argument
tuple, and nothing is called:

    record:  )  NEWOBJ MEMOIZE  }  MEMOIZE (  k v k v …  u  b    state dict, SETITEMS, BUILD
    lean:    )  NEWOBJ MEMOIZE  (  N MEMOIZE  k v k v …  t  b    state (None, k, v, k, v, …)

    Size:    GET(torch.Size) (…) MEMOIZE  TUPLE1 MEMOIZE REDUCE MEMOIZE
    lean:    GET(torch.Size) (…) MEMOIZE  N      MEMOIZE POP    MEMOIZE

A Size stays in the state as the stand-in that was fetched followed by the tuple; the record's
`__setstate__` (`metadata._Record`) takes the tuple for the Size only when the stand-in is
`torch.Size`'s (which returns a tuple of ints as it is), and refuses anything else, so a
rewritten record means what the original meant or the load fails. The memo slot of each Size
holds the same tuple as before (a later GET of it reads the same object).

Only what `dcp.save` writes is rewritten (protocol 4 and later: MEMOIZE; keys fetched from
the memo; values fetched, ints, None or Sizes of 1 to 64 dimensions), and only the runs that
the memo budget's opcode walk (`budgets.walk_pickle`) finds starting on an opcode, so no byte
inside an argument (a string, an int) is read as an opcode. A run is read by the pattern as
whole opcodes one after the other, none of them a PUT or an argument counted past the run, so
the walk steps over it in one go, and its verdict on the memo holds for the rewritten bytes
(the PUTs and lengths elsewhere are where they were). Anything else (protocol 2 as ckpt's own
writer writes it, transforms, a record naming a file for the first time) is loaded as it is.

The result comes in blocks of about 1 MiB in pages of their own, which the unpickler's input
hands back to the system as it reads them: when the last record is built, the file's bytes are
gone (about 130 bytes a chunk).
"""

from __future__ import annotations

import mmap
import re

from ...budgets import walk_pickle

_GET = rb"(?:h.|j....)"
#: BININT1, BININT2, BININT, LONG1 of up to 5 bytes, not negative (below 2**39: offsets in a
#: 512 GiB file); no argument of a run is then as long as a Size's REDUCE with the MEMOIZE
#: before it (5 bytes, the last one 0x94)
_INT = rb"(?:K.|M..|J....|\x8a(?:\x01.|\x02..|\x03...|\x04....|\x05....[\x00-\x7f]))"
#: the tuple of a Size, memoized: TUPLE1-3, or MARK ... TUPLE past 3 (a 0-dim Size's EMPTY_TUPLE
#: is left out: its `)` is a byte an argument could end with before the Size's REDUCE)
_TUPLE = rb"(?:%s\x85|%s{2}\x86|%s{3}\x87|\(%s{4,64}t)\x94" % (_INT, _INT, _INT, _INT)
_SIZE_TAIL = b"\x85\x94R\x94"
_LEAN_SIZE_TAIL = b"N\x940\x94"
_HEAD = rb"\)\x81\x94\}\x94\("
_LEAN_HEAD = b")\x81\x94(N\x94"
_LEAN_TAIL = b"tb"


def _record(size_tail: bytes) -> bytes:
    value = rb"(?:%s%s%s|%s|%s|N)" % (_GET, _TUPLE, size_tail, _GET, _INT)
    return rb"(?:%s%s)++" % (_GET, value)


#: a run of records as `dcp.save` pickles them, the class of each after the first fetched
_RUN = re.compile(
    rb"%s%sub(?:%s%s%sub)*+" % (_HEAD, _record(_SIZE_TAIL), _GET, _HEAD, _record(_SIZE_TAIL)),
    re.DOTALL,
)
#: a Size's REDUCE in a run, with the MEMOIZE of its tuple before it: no argument holds these
#: 5 bytes, and one ending in the first of them (0x94) is followed by the rest only where they
#: are a Size's REDUCE, whose rewrite leaves that first byte as it is
_SIZE_REDUCE = b"\x94" + _SIZE_TAIL
_LEAN_SIZE_REDUCE = b"\x94" + _LEAN_SIZE_TAIL
#: the end of a record and the start of the next, with the class fetched between them: no
#: argument holds these bytes, nor ends with their first ones where the rest follow
_NEXT = re.compile(rb"ub(%s)%s" % (_GET, _HEAD), re.DOTALL)
_HEAD_BYTES = b")\x81\x94}\x94("


#: the rewritten pickle comes in blocks of about this many bytes
BLOCK = 1 << 20


def block_of(parts: list[bytes]) -> mmap.mmap:
    """`parts` joined in memory of their own (anonymous pages), given back to the system when
    closed or let go: the allocator would keep freed blocks of this size for itself."""
    block = mmap.mmap(-1, max(sum(len(p) for p in parts), 1))
    for part in parts:
        block.write(part)
    return block


def lean_records(data: bytes) -> tuple[list[mmap.mmap], str | None]:
    """(`data` with its runs of per-chunk records rewritten lean, in blocks of about `BLOCK`
    bytes (`block_of`), what the memo walk found wrong or None: then no blocks).

    The walk is `budgets.pickle_overreach`'s: the caller need not walk the result again.
    """
    blocks = _Blocks(data)
    runs = (m.span() for m in _RUN.finditer(data))
    why = walk_pickle(data, True, runs, blocks.run)
    if why is not None:
        return [], why
    blocks.run(len(data), len(data))
    blocks.flush()
    return blocks.done, None


class _Blocks:
    """The rewritten pickle, gathered into blocks as the walk finds runs on opcodes."""

    def __init__(self, data: bytes):
        self.data = data
        self.done: list[mmap.mmap] = []
        self.parts: list[bytes] = []
        self.size = 0
        self.at = 0  # in `data`: what is before it is in a block or in `parts`

    def run(self, start: int, end: int) -> None:
        """The bytes up to `start` as they are, then the run up to `end` rewritten."""
        for at in range(self.at, start, BLOCK):
            self.add(self.data[at : min(at + BLOCK, start)])
        if end > start:
            self.add(_lean_run(self.data[start:end]))
        self.at = end

    def add(self, part: bytes) -> None:
        self.parts.append(part)
        self.size += len(part)
        if self.size >= BLOCK:
            self.flush()

    def flush(self) -> None:
        if self.parts:
            self.done.append(block_of(self.parts))
            self.parts, self.size = [], 0


def _lean_run(run: bytes) -> bytes:
    """One run (records from its first byte to its last) rewritten."""
    lean = run.replace(_SIZE_REDUCE, _LEAN_SIZE_REDUCE)
    # the classes fetched between records (one, or two taking turns: a key and its value)
    found = _NEXT.search(lean)
    while found is not None:
        fetch = found[1]
        lean = lean.replace(b"ub" + fetch + _HEAD_BYTES, _LEAN_TAIL + fetch + _LEAN_HEAD)
        found = _NEXT.search(lean, found.start())
    return b"".join((_LEAN_HEAD, memoryview(lean)[len(_LEAN_HEAD) : -len(_LEAN_TAIL)], _LEAN_TAIL))
