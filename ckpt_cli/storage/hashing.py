"""File digests for `ckpt verify --checksums` / `--write-manifest`, hashed in parallel threads.

Throughput strategy: each thread takes the next file (largest first) until none is left and
reads it with unbuffered `readinto` into its one reusable 1 MiB buffer, page-aligned
(`fileio.aligned_buffer`: a 4 MiB `bytearray` sits 16 bytes past a page start, where the
kernel's copy out of the page cache ran four times slower; 2 GiB of 16 shards, fresh
processes: xxh3 0.45 -> 0.12 s, the block size mattering little once aligned, 1 MiB the
quickest of 128 KiB / 1 MiB / 4 MiB). The hash functions release the GIL for buffers this
large (hashlib above 2 KiB, blake3 and xxhash always), so threads hash different files truly
in parallel and the run is bound by I/O, not by the interpreter. Per byte, the loop costs
about what `xxhsum` (read + hash) and `b3sum` (mmap + hash) cost in CPU; `hashlib.sha256` is
OpenSSL's own code.

Never `mmap` of the files: a file truncated by another process while it is mapped (a save
rewriting the same path) kills the whole process with SIGBUS at the next access of a page past
the new end. Linux has no mapping flag that turns that into an error; `MAP_POPULATE` and
`mlock` do not keep the pages (truncation unmaps them), a read lease (`F_SETLEASE`) only delays
the truncation by `lease-break-time` (and a stopped process still dies on resume), and Python
cannot recover from SIGBUS inside C code. Only the copy would be saved, about 0.03 CPU-seconds per GB.

sha256 is the default because it is what the Hub records as a file's LFS oid; blake3 and xxh3
come from the optional `fast` extra (`pip install 'ckpt-cli[fast]'`).

Files in an object store (`StoredFile`) are streamed with ranged reads of `REMOTE_BLOCK`
bytes through their `Storage`, never downloaded whole; the threads overlap the round trips.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import NotFoundError, UsageError
from ..faults import io_failure
from ..progress import NULL_PROGRESS, Progress
from .fileio import aligned_buffer
from .local import open_regular

if TYPE_CHECKING:
    from . import Storage

ALGORITHMS = ("sha256", "blake3", "xxh3")
#: bytes per read: large enough that the GIL is released for nearly all of the hashing, small
#: enough that the copy and the hash of it stay in the core's cache
BLOCK = 1 << 20
#: bytes per ranged read of a remote file: fewer round trips, still bounded memory per thread
REMOTE_BLOCK = 16 << 20


@dataclass(frozen=True)
class StoredFile:
    """A file read through a `Storage` (an object store) rather than a local path.

    Attributes:
        storage: where it is read from (ranged reads).
        rel: its name relative to the storage root.
        size: its size, from the listing.
    """

    storage: Storage
    rel: str
    size: int

    def __str__(self) -> str:
        return self.storage.describe(self.rel)


#: what can be hashed: a local path, or a file read with ranged reads
Hashable = Path | StoredFile


class Hasher(Protocol):
    """What every hash object offers (hashlib, blake3, xxhash)."""

    def update(self, data: Any, /) -> Any:
        """Feed more bytes."""

    def hexdigest(self) -> str:
        """The digest as lowercase hex."""


def hasher_factory(algo: str, parallel_files: int = 2) -> Callable[[], Hasher]:
    """A constructor of fresh hash objects for `algo`; UsageError for unknown or missing ones.

    Args:
        algo: `sha256`, `blake3` or `xxh3` (128-bit XXH3).
        parallel_files: how many files are hashed at once; with one, blake3 uses its own
            threads inside the file instead.
    """
    if algo == "sha256":
        return hashlib.sha256
    if algo not in ALGORITHMS:
        raise UsageError(
            f"unknown hash algorithm {algo!r}", fix=f"Use one of {', '.join(ALGORITHMS)}."
        )
    module = "blake3" if algo == "blake3" else "xxhash"
    try:
        if algo == "blake3":
            import blake3

            if parallel_files <= 1:
                return lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)
            return blake3.blake3
        import xxhash

        return xxhash.xxh3_128
    except ImportError:
        raise UsageError(
            f"--algo {algo} needs the {module!r} package, which is not installed",
            fix="Install it with `pip install 'ckpt-cli[fast]'`, or use --algo sha256.",
        ) from None


def hash_file(
    path: Hashable,
    new: Callable[[], Hasher],
    progress: Progress = NULL_PROGRESS,
    stop: threading.Event | None = None,
    buffer: memoryview | None = None,
) -> str:
    """The hex digest of one file, read in `BLOCK`-sized pieces (abandoned once `stop` is set)
    into `buffer` (a fresh one when not given)."""
    if isinstance(path, StoredFile):
        return _hash_stored(path, new, progress, stop)
    hasher = new()
    view = buffer if buffer is not None else aligned_buffer(BLOCK)
    try:
        # never blocks: a FIFO (or a socket, a device) is refused, naming it, before it is read;
        # a blocking open of a FIFO waited for a writer forever, and no signal ended it
        fh = os.fdopen(open_regular(path), "rb", buffering=0)
    except NotFoundError:
        raise NotFoundError(
            "disappeared while the checkpoint was being hashed",
            path=path,
            fix="Something is changing the checkpoint; run again once it is written.",
        ) from None
    except PermissionError as exc:
        # the OS refused the read: exit 74 as every refused read (nothing wrong with the input)
        raise io_failure(exc, path, "hashing") from None
    with fh:
        while True:
            try:
                n = fh.readinto(view)
            except OSError as exc:  # a bad sector: this file is the one to check
                raise io_failure(exc, path, "hashing") from None
            if not n or (stop is not None and stop.is_set()):
                break
            hasher.update(view[:n])
            progress.advance(n)
    return hasher.hexdigest()


def _hash_stored(
    file: StoredFile,
    new: Callable[[], Hasher],
    progress: Progress,
    stop: threading.Event | None,
) -> str:
    hasher = new()
    offset = 0
    while offset < file.size and not (stop is not None and stop.is_set()):
        data = file.storage.read(file.rel, offset, min(REMOTE_BLOCK, file.size - offset))
        hasher.update(data)
        offset += len(data)
        progress.advance(len(data))
    return hasher.hexdigest()


def default_workers() -> int:
    """Threads to hash with: one per core, at least 4 (reads of cold files queue up on the
    device while other threads hash), at most 8."""
    return max(4, min(8, os.cpu_count() or 4))


def hash_files(
    paths: Mapping[str, Hashable],
    algo: str = "sha256",
    *,
    workers: int | None = None,
    progress: Progress = NULL_PROGRESS,
) -> dict[str, str]:
    """Digest every file (name -> path) in parallel threads; returns name -> hex digest.

    Files are handed out largest first so one big shard does not finish last alone.
    """
    workers = workers or default_workers()
    sizes = {name: _size(path) for name, path in paths.items()}
    alone = hasher_factory(algo, parallel_files=1)
    together = hasher_factory(algo, parallel_files=2) if len(paths) > 1 else alone
    # A file holding more than a core's share of the bytes would be hashed last, alone, on one
    # core (one model.safetensors beside a few JSON files): blake3 spreads that file over its
    # own threads instead. The rest run one file per thread: threads inside every file cost
    # more than they give when the files already keep the cores busy (+10-20% CPU measured on
    # 16 equal shards).
    share = sum(sizes.values()) / (os.cpu_count() or 1)
    sink = _LockedProgress(progress)
    stop = threading.Event()
    order = iter(sorted(paths, key=lambda name: -sizes[name]))
    taking = threading.Lock()
    digests: dict[str, str] = {}

    def worker() -> None:
        # each thread takes the next file until none is left, reading every one into the same
        # buffer: a fresh buffer per file (allocated, faulted in, unmapped with a TLB
        # shootdown) cost more than hashing a small file does
        buffer = aligned_buffer(BLOCK)
        try:
            while not stop.is_set():
                with taking:
                    name = next(order, None)
                if name is None:
                    return
                new = alone if sizes[name] > share else together
                digests[name] = hash_file(paths[name], new, sink, stop, buffer)
        except BaseException:
            stop.set()  # the other threads stop at their next block and take no new file
            raise

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-hash")
    try:
        for future in [pool.submit(worker) for _ in range(min(workers, len(paths)))]:
            future.result()
    except BaseException:
        # Ctrl-C or a failed file: running threads stop at their next block
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return {name: digests[name] for name in paths}


def _size(path: Hashable) -> int:
    if isinstance(path, StoredFile):
        return path.size
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _LockedProgress:
    """Serialises `advance` calls from the hashing threads."""

    def __init__(self, inner: Progress):
        self._inner = inner
        self._lock = threading.Lock()

    def start(self, total: int, description: str) -> None:
        self._inner.start(total, description)

    def advance(self, amount: int) -> None:
        with self._lock:
            self._inner.advance(amount)

    def finish(self) -> None:
        self._inner.finish()
