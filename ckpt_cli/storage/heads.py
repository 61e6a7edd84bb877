"""Heads of many remote files fetched at once: what opening a sharded checkpoint waits for.

A file that opens with its header's length (safetensors: an 8-byte little-endian length, then
the JSON header) costs a round trip to read its header, and a second one when the header is
longer than the first read. Read one file after another, 163 shards (the DeepSeek-V3 layout) at
50 ms are 8 to 16 seconds of waiting; read at once, a round trip or two.

`HeadCache.prefetch` takes the files about to be read, each with the bytes to read first, and
fetches them on `workers` threads in the background: each file's first read and, when its
length says the header goes on, the rest of the header, in the same worker (never a second
sequential pass). A larger header than the first read seen once raises the first read of
the files not yet started (shards of one model have headers of about one size), so most files
cost one request. `take` hands a file's head over once (waiting for it if it is in flight) and
forgets it; `arrival_order` says in which order to take them, so that a reader parses each
head as it lands instead of waiting, in its own order, behind one slow request.

Memory: the heads held (fetched, not yet taken) stay within `budget` bytes, and no head is
longer than `limit`: a file whose header would overrun either is left to the reader's own
reads, one at a time. A failed fetch is handed over as its failure: the fetch made the storage's
bounded tries already, and the reader's own read would only make them all again (a shard
answering 500 was asked twice the bounded number of times, and the command waited twice).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    # imported where the pool is made: a local SRC never needs it (start-up, #30)
    from concurrent.futures import Future, ThreadPoolExecutor

#: heads fetched at once: every shard of DeepSeek-V3's 163 in one wave. huggingface_hub's client
#: pools 100 connections; the requests past them wait for one to come free, which still beats
#: fewer workers: each freed connection takes the next request at once, a second hop (the CDN
#: redirect) or the next shard's first (163 shards behind a 400 ms round trip: 64 workers
#: took ~12 round trips for the headers, 192 ~7). S3's pool is sized to match
#: (`_pool_options` in remote.py).
HEAD_WORKERS = 192
#: bytes of heads held at once, fetched and not yet taken
HEAD_BUDGET = 64 << 20
#: the longest head fetched ahead; a longer header is read by its reader, when it gets to it
HEAD_LIMIT = 16 << 20
#: a first read larger than this is never guessed from other files' headers
LEARNED_MAX = 4 << 20
#: the largest file fetched whole ahead (`HeadRead.whole`: a config read beside the weights)
WHOLE_FILE_MAX = 1 << 20

#: fetch(rel, start, end) -> the bytes start..end of rel
Fetch = Callable[[str, int, int], bytes]


class HeadRead(NamedTuple):
    """How to fetch one file's head.

    Attributes:
        first: bytes to read first (the whole header when it is no longer).
        size: the file's size.
        exact: read no byte past the header: `first` as given (8: the length alone), then
            exactly the rest (no larger first read guessed from other files' headers).
    """

    first: int
    size: int
    exact: bool = False

    @classmethod
    def whole(cls, size: int) -> HeadRead:
        """A small file of `size` bytes fetched whole, in one request (no header in it)."""
        return cls(size, size, exact=True)


class HeadCache:
    """Heads of files fetched concurrently, each handed over once."""

    def __init__(
        self,
        fetch: Fetch,
        *,
        workers: int = HEAD_WORKERS,
        budget: int = HEAD_BUDGET,
        limit: int = HEAD_LIMIT,
    ):
        self._fetch = fetch
        self._workers = workers
        self._budget = budget
        self._limit = limit
        self._lock = threading.Lock()
        self._pending: dict[str, Future[bytes | None]] = {}
        self._held = 0
        self._learned = 0
        self._pool: ThreadPoolExecutor | None = None

    def prefetch(self, first_reads: Mapping[str, HeadRead]) -> None:
        """Start fetching the head of each file (rel -> how).

        Files already pending are not fetched again. Returns at once."""
        with self._lock:
            todo = {rel: v for rel, v in first_reads.items() if rel not in self._pending}
            if not todo:
                return
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(
                    max_workers=self._workers, thread_name_prefix="ckpt-heads"
                )
            for rel, how in todo.items():
                self._pending[rel] = self._pool.submit(self._one, rel, how)

    def pending(self, rel: str) -> bool:
        """Whether a head of `rel` is being fetched or held."""
        with self._lock:
            return rel in self._pending

    def peek(self, rel: str) -> bytes | None:
        """The head of `rel` (waiting for it), kept for `take`; None if none was fetched.

        Raises what the fetch raised (the file is forgotten: a later read asks again)."""
        with self._lock:
            future = self._pending.get(rel)
        if future is None:
            return None
        try:
            head = future.result()
        except BaseException:
            with self._lock:
                self._pending.pop(rel, None)
            raise
        if head is None:
            with self._lock:
                self._pending.pop(rel, None)
        return head

    def arrival_order(self, rels: Iterable[str]) -> Iterator[str]:
        """`rels`, each once: those not being fetched first (in the order given: their reader
        reads them itself, while the fetches go on), then the others as their fetch ends."""
        from concurrent.futures import as_completed

        waiting: dict[Future[bytes | None], str] = {}
        for rel in dict.fromkeys(rels):
            with self._lock:
                future = self._pending.get(rel)
            if future is None:
                yield rel
            else:
                waiting[future] = rel
        for future in as_completed(waiting):
            yield waiting[future]

    def take(self, rel: str) -> bytes | None:
        """The head of `rel`, handed over once (waiting for it); None if none was fetched.

        Raises what the fetch raised, once."""
        head = self.peek(rel)
        with self._lock:
            if self._pending.pop(rel, None) is not None and head is not None:
                self._held -= len(head)
        return head

    def close(self) -> None:
        """Wait for the fetches in flight and forget every head."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
            self._held = 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- the workers --------------------------------------------------------------------------

    def _reserve(self, n: int) -> bool:
        with self._lock:
            if self._held + n > self._budget:
                return False
            self._held += n
            return True

    def _release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    def _one(self, rel: str, how: HeadRead) -> bytes | None:
        size = how.size
        with self._lock:
            learned = 0 if how.exact else self._learned
        first = min(size, max(how.first, learned), self._limit)
        if first <= 0 or not self._reserve(first):
            return None
        try:
            head = self._fetch(rel, 0, first)
        except BaseException:
            self._release(first)
            raise  # handed to the reader by `take`
        if len(head) < 8 or first >= size:  # too short for a length, or the whole file
            return self._settle(head, first)
        (length,) = struct.unpack("<Q", head[:8])
        whole = 8 + length
        if whole <= len(head) or whole > size:  # complete, or not a header the length describes
            return self._settle(head, first)
        with self._lock:
            if whole <= LEARNED_MAX:
                # the next files' first reads: this header and an eighth more
                self._learned = max(self._learned, min(LEARNED_MAX, whole + whole // 8))
        if whole > self._limit or not self._reserve(whole - len(head)):
            return self._settle(head, first)
        try:
            rest = self._fetch(rel, len(head), whole)
        except BaseException:
            self._release(first + whole - len(head))
            raise
        return self._settle(head + rest, first + whole - len(head))

    def _settle(self, head: bytes, reserved: int) -> bytes:
        """Account for what is held: `head`, where `reserved` bytes were counted."""
        if reserved != len(head):
            self._release(reserved - len(head))
        return head
