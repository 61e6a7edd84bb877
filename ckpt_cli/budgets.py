"""What a reader may spend on an input, checked before it spends it: pickle memos, zip records.

Two ways a few bytes of a checkpoint could choose ckpt's memory, whatever reader unpickles them:

* **The C unpickler's memo.** `pickle.Unpickler` (the C one every restricted reader of ckpt
  subclasses, for speed) keeps its memo as an array sized by the largest index a `PUT` names:
  `\\x80\\x02 N r\\xff\\xff\\xff\\x0f .` (None, `LONG_BINPUT 268435455`, STOP) is 9 bytes that
  make it touch 4 GiB. A pickler numbers its memo 0, 1, 2... as it memoises, and each memoised
  object takes at least two bytes of the stream, so an index past half of the bytes before it
  (plus `MEMO_SLACK`) names objects that were never memoised. `BudgetedUnpickler` refuses such
  a pickle before loading it: the memo then stays within 8 bytes per byte of pickle.
* **Hash flooding.** Python's hash of an int is the int modulo 2**61 - 1, the same in every
  process: 100,000 keys `i * (2**61 - 1)` of one dict all hash to 0, and the unpickler builds
  that dict in quadratic time (a 1.5 MB `.metadata` took over two minutes of CPU, deaf to
  SIGTERM inside the C unpickler). The ints that can collide are the large ones, pickled as
  `LONG1` / `LONG4` (or protocol 0's `INT` / `LONG` text): the walk hashes those and refuses a
  pickle with more than `MAX_COLLIDING_INTS` distinct ones of one hash. (A string's hash is
  salted per process; the small ints of optimizer ids and RNG states hash to themselves.)
* **A zip record's inflated size.** A deflated record may inflate a thousandfold; the size a
  reader allocates is the one the zip directory declares (Python's `zipfile` and torch's miniz
  both stop there). `check_inflated` bounds it against the record's stored bytes, and
  `read_member` reads a member in bounded chunks under an explicit limit.

The memo scan walks the opcodes once, skipping every argument but the memo indexes (about 75 ns
a byte, a third of `pickletools.genops`; the C unpickler's own load of the same bytes takes as
long): the same bytes inside a string are never mistaken for an opcode. No torch, no numpy.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterable
from typing import IO, Any

from .errors import FormatError

#: memo indexes a pickle may name beyond one per two bytes before the opcode
MEMO_SLACK = 1024
#: a deflated zip record may inflate to at most this many times its stored bytes...
MAX_INFLATE_RATIO = 64
#: ... or to this many bytes, whichever is larger (small records compress well)
INFLATE_FLOOR = 1 << 20
#: bytes read from a zip member per call (a member is never inflated in one piece)
#: what Python's `zipfile` raises on a damaged archive: besides BadZipFile and zlib's errors,
#: NotImplementedError where a flipped bit names a compression method, version or flag it
#: does not know, ValueError (UnicodeDecodeError too) for a garbled name or header,
#: RuntimeError where a flipped flag bit marks a record encrypted ("password required"), and
#: OverflowError where a flipped offset or size is past what a read can take
ZIP_READ_ERRORS: tuple[type[Exception], ...] = (
    zipfile.BadZipFile,
    zlib.error,
    OSError,
    EOFError,
    ValueError,
    NotImplementedError,
    RuntimeError,
    OverflowError,
)

READ_CHUNK = 1 << 20
#: distinct large ints of one hash a pickle may hold (a dict of them builds in quadratic time)
MAX_COLLIDING_INTS = 2048
#: the largest model config (`config.json`) any reader reads: configs are kilobytes, and a
#: larger file (a sparse one of gigabytes) is no config to read whole into memory
MAX_CONFIG_BYTES = 16 << 20
#: distinct ints past Python's hash modulus a pickle may hold at all (64-bit seeds: a few)
MAX_HUGE_INTS = 100_000
#: Python hashes an int to itself modulo this (2**61 - 1 on 64-bit builds)
_HASH_MODULUS = sys.hash_info.modulus


def _opcode_table() -> tuple[list[int | None], list[int | None]]:
    """Per opcode byte: the fixed length of its argument, or how a variable one is found."""
    fixed: list[int | None] = [None] * 256
    variable: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        code = ord(op.code.encode("latin-1"))
        arg = op.arg
        if arg is None:
            fixed[code] = 0
        elif arg.n >= 0:
            fixed[code] = arg.n
        elif arg.name == "stringnl_noescape_pair":  # GLOBAL, INST: module and name lines
            variable[code] = _TWO_LINES
        else:
            variable[code] = arg.n
    return fixed, variable


_TWO_LINES = -100
_FIXED, _VARIABLE = _opcode_table()
_LONG_BINPUT, _PUT, _STOP = ord("r"), ord("p"), ord(".")
_LONG1, _LONG4, _INT, _LONG = ord("\x8a"), ord("\x8b"), ord("I"), ord("L")


def _plain_run() -> re.Pattern[bytes]:
    """A run of opcodes the scan only steps over: every fixed-width opcode but LONG_BINPUT
    (whose index is judged) and STOP, each with its whole argument.

    Matching such a run in C, then judging the opcode it stops at in Python, walks the same
    opcode boundaries as stepping one opcode at a time (the alternatives start with disjoint
    opcode bytes, so a run has one parse), ~5x faster on pickles of many small objects: a
    `.metadata` of a million chunks is ~130 MB of them.
    """
    by_width: dict[int, list[int]] = {}
    for code, width in enumerate(_FIXED):
        if width is not None and code not in (_LONG_BINPUT, _STOP):
            by_width.setdefault(width, []).append(code)
    alternatives = [
        b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]" + b"." * width
        for width, codes in sorted(by_width.items())
    ]
    # possessive: a run is never given back, so no backtracking state piles up
    return re.compile(b"(?:" + b"|".join(alternatives) + b")*+", re.DOTALL)


_PLAIN_RUN = _plain_run()


def _memo_budget(pos: int) -> int:
    """The largest memo index an opcode at byte `pos` may name."""
    return pos // 2 + MEMO_SLACK


def pickle_overreach(data: bytes, complete: bool = True) -> str | None:
    """What in `data` would make the C unpickler allocate more than the pickle can need, or
    None: a memo PUT naming an index over budget, or a counted argument (a string, bytes)
    longer than the bytes left (the unpickler allocates the length before reading).

    Walks the opcodes as the C unpickler reads them (argument lengths from the same bytes),
    skipping every argument unread but the PUT indexes and lengths, up to STOP; where the
    unpickler would fail first (an unknown opcode, a negative length) the walk stops too.
    Lengths past the end are judged only for a `complete` pickle (not the head of one).
    """
    return walk_pickle(data, complete)


def walk_pickle(
    data: bytes,
    complete: bool = True,
    spans: Iterable[tuple[int, int]] = (),
    found: Callable[[int, int], None] | None = None,
) -> str | None:
    """`pickle_overreach(data, complete)`; for each of `spans` (ascending, apart) that starts
    where an opcode starts in the same walk (not inside an argument, not past STOP),
    `found(start, end)`, in order.

    A span is bytes a caller read out of `data` by pattern as whole opcodes, none of them a
    PUT, a STOP or an argument counted past the span: the walk steps over one that starts on an
    opcode in one go (the unpickler reads the same opcodes there), and the caller knows the
    unpickler will read the span as it did. Spans are taken one at a time (an iterator of
    pattern matches holds none of them).
    """
    fixed, variable = _FIXED, _VARIABLE
    skip = _PLAIN_RUN.match
    n = len(data)
    pos = 0
    # large ints by hash: a set per hash seen, refused once one holds too many
    by_hash: dict[int, set[int]] = {}
    tracked = 0

    def colliding(value: int) -> str | None:
        nonlocal tracked
        if -_HASH_MODULUS < value < _HASH_MODULUS:
            return None  # hashes to itself: no other int of its size shares its hash
        same = by_hash.setdefault(hash(value), set())
        if value in same:
            return None
        same.add(value)
        tracked += 1
        if len(same) > MAX_COLLIDING_INTS:
            return (
                f"{len(same):,} distinct integers with the same hash by byte {pos:,}: a dict of "
                "them would take quadratic time to build (hash flooding)"
            )
        if tracked > MAX_HUGE_INTS:  # the walk's own memory stays bounded too
            return (
                f"more than {MAX_HUGE_INTS:,} integers past 2**61 by byte {pos:,}, far more than "
                "any checkpoint holds"
            )
        return None

    pending = iter(spans)
    stop, stop_end = next(pending, (n, n))
    while pos < n:
        while stop < pos:  # inside the argument of the opcode just stepped over
            stop, stop_end = next(pending, (n, n))
        pos = skip(data, pos, stop).end()  # type: ignore[union-attr]  # `*+` always matches
        if pos == stop < n:
            if found is not None:
                found(stop, stop_end)
            pos = stop_end
            stop, stop_end = next(pending, (n, n))
            continue
        if pos >= n:
            return None
        op = data[pos]
        width = fixed[op]
        if width is not None:
            if op == _LONG_BINPUT and pos + 5 <= n:
                index = int.from_bytes(data[pos + 1 : pos + 5], "little")
                if index > _memo_budget(pos):
                    return _memo_text(index, pos, n)
            elif op == _STOP:
                return None
            pos += 1 + width
            continue
        how = variable[op]
        if how is None:
            return None  # not an opcode: the unpickler stops here
        if how in (pickletools.UP_TO_NEWLINE, _TWO_LINES):
            end = data.find(b"\n", pos + 1)
            if how == _TWO_LINES and end >= 0:
                end = data.find(b"\n", end + 1)
            if end < 0:
                return None
            if op == _PUT:
                try:
                    index = int(data[pos + 1 : end])
                except ValueError:
                    return None
                if index > _memo_budget(pos):
                    return _memo_text(index, pos, n)
            elif op in (_INT, _LONG) and end - pos > 19:  # past 2**61: may collide
                try:
                    value: int | None = int(data[pos + 1 : end].rstrip(b"L"))
                except ValueError:
                    value = None  # the unpickler refuses it there; the walk goes on as before
                why = colliding(value) if value is not None else None
                if why is not None:
                    return why
            pos = end + 1
            continue
        width = _COUNT_WIDTH[how]
        length = int.from_bytes(
            data[pos + 1 : pos + 1 + width],
            "little",
            signed=how == pickletools.TAKEN_FROM_ARGUMENT4,
        )
        if length < 0:
            return None
        start = pos + 1 + width
        if length > n - start and complete:
            return (
                f"an argument of {length:,} bytes at byte {pos:,}, with {max(n - start, 0):,} "
                "bytes left"
            )
        if op in (_LONG1, _LONG4) and 8 <= length <= 4096:  # 8 bytes and more: may collide
            why = colliding(int.from_bytes(data[start : start + length], "little", signed=True))
            if why is not None:
                return why
        pos = start + length
    return None


_COUNT_WIDTH = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}


def _memo_text(index: int, pos: int, n: int) -> str:
    return (
        f"memo index {index:,} at byte {pos:,} of {n:,}: far beyond the objects it memoised "
        "(the unpickler would size its memo by it, gigabytes)"
    )


def check_pickle(data: bytes, where: str | None, complete: bool = True) -> None:
    """Refuse (FormatError naming `where`) a pickle that would make the C unpickler allocate
    more than its bytes can need (`pickle_overreach`)."""
    why = pickle_overreach(data, complete)
    if why is not None:
        raise pickle_refused(why, where)


def pickle_refused(why: str, where: str | None) -> FormatError:
    """The error for a pickle `pickle_overreach` (or `walk_pickle`) found `why` in."""
    return FormatError(
        f"holds a pickle with {why}; ckpt refuses it (a hostile or corrupt file)",
        path=where,
        fix="Python's pickler never writes this; re-save the checkpoint, and do not trust "
        "where this file came from.",
    )


class BudgetedUnpickler(pickle.Unpickler):
    """The base of every restricted unpickler in ckpt: the C unpickler, on bytes whose memo
    indexes were checked first (`check_pickle`), so no pickle chooses the memo's size.

    Subclasses restrict `find_class` and `persistent_load`; `file` replaces the plain reader of
    `data` (a budgeted input that counts objects, say); `complete=False` for the head of a
    pickle (lengths past its end are then not refused);
    `walked=True` when the caller ran `walk_pickle` on these bytes (or on bytes with the same
    PUTs and lengths at the same places) and refused what it found.
    """

    def __init__(
        self,
        data: bytes,
        where: str | None,
        file: IO[bytes] | Any | None = None,
        *,
        complete: bool = True,
        walked: bool = False,
    ):
        if not walked:
            check_pickle(data, where, complete)
        super().__init__(file if file is not None else io.BytesIO(data))
        #: the file the pickle is read from, for the errors of subclasses' stand-ins
        self.where = where


def inflated_over_budget(stored: int, declared: int, limit: int) -> str | None:
    """Why a zip record of `stored` bytes declaring `declared` inflated bytes is refused, or
    None when it is within budget (at most `limit`, and for a compressed record at most
    `MAX_INFLATE_RATIO` times its stored bytes or `INFLATE_FLOOR`)."""
    if declared > limit:
        return f"declares {declared:,} bytes (more than the {limit:,} this reader allows)"
    if declared > stored and declared > max(INFLATE_FLOOR, MAX_INFLATE_RATIO * stored):
        return (
            f"inflates {stored:,} stored bytes to {declared:,} (more than "
            f"{MAX_INFLATE_RATIO}x: a zip bomb)"
        )
    return None


def check_inflated(name: str, stored: int, declared: int, limit: int, where: str | None) -> None:
    """Refuse (FormatError naming `where`) a zip record over its inflation budget."""
    why = inflated_over_budget(stored, declared, limit)
    if why is not None:
        raise FormatError(
            f"zip record {name!r} {why}; ckpt refuses it before reading it",
            path=where,
            fix="torch.save stores its records uncompressed; re-save the file with torch.save.",
        )


def read_member(archive: zipfile.ZipFile, name: str, limit: int, where: str | None) -> bytes:
    """One member of `archive`, read in `READ_CHUNK` pieces once its declared size passed
    `check_inflated`; at most `limit` bytes whatever the stream holds."""
    info = archive.getinfo(name)
    check_inflated(name, info.compress_size, info.file_size, limit, where)
    out = bytearray()
    with archive.open(info) as member:
        while len(out) < info.file_size:
            block = member.read(min(READ_CHUNK, info.file_size - len(out)))
            if not block:
                break
            out += block
    return bytes(out)


#: bytes of a run's JSON record ckpt reads whole (`trainer_state.json`, `metrics.jsonl`): a
#: sparse file of a few bytes on disk may claim gigabytes, and parsing takes twice its size and
#: more (a 2 GB one: 4.2 GB and 20 s); the largest Trainer states are a few MB
MAX_JSON_RECORD = 64 << 20


def json_record_over_budget(size: int, limit: int = MAX_JSON_RECORD) -> str | None:
    """Why a JSON record of `size` bytes is not read (past `limit`), or None."""
    if size <= limit:
        return None
    return f"is {size:,} bytes, more than the {limit:,} ckpt reads of a JSON record"


#: nodes (containers and the items in them) a loaded object may unfold to, counting each shared
#: sub-object once per path to it: what any walk of it (a copy, a comparison, a writer) costs
MAX_EXPANDED_NODES = 50_000_000

_CONTAINERS = (dict, list, tuple, set, frozenset)


def expanded_size(obj: object, limit: int = MAX_EXPANDED_NODES) -> int:
    """How many nodes `obj` unfolds to when every shared sub-object is counted once per path to
    it: each dict, list, tuple or set (and subclasses) counts one, plus one per item that is not
    itself a container (a dict's keys count with its values).

    Measured over the graph, each container once (bottom-up, no recursion, memo by identity),
    so a 1.5 KB pickle of 40 nested lists each holding the next one ten times costs a few
    microseconds to measure as 10^40. Counting stops past `limit`; a cycle counts once.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[object, bool]] = [(obj, False)]
    while stack:
        node, ready = stack.pop()
        key = id(node)
        if key in sizes or not isinstance(node, _CONTAINERS):
            continue
        items: list[object] = (
            [*node.keys(), *node.values()] if isinstance(node, dict) else list(node)
        )
        if not ready:
            if key in active:
                continue  # a cycle: counted where it was entered
            active.add(key)
            stack.append((node, True))
            stack.extend(
                (c, False) for c in items if isinstance(c, _CONTAINERS) and id(c) not in sizes
            )
            continue
        active.discard(key)
        total = 1
        for child in items:
            total += sizes.get(id(child), 1) if isinstance(child, _CONTAINERS) else 1
            if total > limit:
                break
        sizes[key] = min(total, limit + 1)
    return sizes.get(id(obj), 1)


def check_expanded(obj: object, where: str | None, limit: int = MAX_EXPANDED_NODES) -> None:
    """Refuse (FormatError naming `where`) an object that unfolds to more than `limit` nodes
    (`expanded_size`): a "billion laughs" graph of shared dicts, lists or tuples."""
    if expanded_size(obj, limit) > limit:
        raise FormatError(
            f"holds a graph of shared sub-objects (dicts, lists or tuples) that unfolds to "
            f"more than {limit:,} values (a 'billion laughs' structure); ckpt refuses it",
            path=where,
            fix="Re-save the checkpoint as a flat state dict of tensors.",
        )
