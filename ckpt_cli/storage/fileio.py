"""Moving bytes between local files at the speed of `cp` and a flush: byte ranges copied in the
kernel, and write-back started while the copy goes on.

Two things made a converted checkpoint take twice as long as `cp -r SRC DST && sync` of the
same bytes (`bench/bench_dcp_raw.py`):

* every byte went through user space (`pread` into Python, `write` out again), where
  `cp` asks the kernel to copy (`copy_file_range`). `FileRange.copy_to` does the same for a
  local source range; a writer that must see the bytes (a zip record's CRC) reads them once
  for the CRC (`FileRange.crc32`, in cache-sized blocks, by ISA-L where installed: `crc.py`)
  and still lets the kernel copy them.
* the dirty pages were all written back by the one fsync at the end, after the copy, where
  the disk could have been busy all along. `start_writeback` asks the kernel to begin writing a
  range out now (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`, the way PostgreSQL's
  `*_flush_after` settings do); the final fsync still makes it durable, it just has little left
  to wait for. Output files opened with `open_output` do this every `WRITEBACK_STEP` bytes.

Where the kernel refuses (another file system, a platform without the calls), both fall back:
the buffered copy, and no early write-back.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from ..errors import FormatError
from ..faults import naming
from .crc import crc32_function

#: raw copies move this many bytes per read/write
COPY_BLOCK = 8 << 20


def aligned_buffer(size: int) -> memoryview:
    """A writable buffer of `size` bytes that starts on a page boundary, to read files into.

    Not a `bytearray`: glibc serves an allocation this large from a mapping of its own and
    hands out the address 16 bytes past its start, and the kernel's copy out of the page cache
    into a destination 8-24 bytes past a page start ran four times slower (measured on the dev
    machine, AMD EPYC: 0.45 s of system time per GiB, against 0.10 s page-aligned; a 4 MiB
    bytearray made a fresh `verify --write-manifest --algo xxh3` of 2 GiB spend 0.8 s in
    `_copy_to_iter`). An anonymous mapping starts on a page; it is freed with its last view."""
    return memoryview(mmap.mmap(-1, max(1, size)))


#: bytes read per block for a CRC: the block stays in the CPU's cache between the read and the
#: checksum, and the buffer adds 1 MiB to the peak, not 8
CRC_BLOCK = 1 << 20
#: bytes written to a file between two requests to start its write-back
WRITEBACK_STEP = 64 << 20
#: sync_file_range's "start write-out of dirty pages in the range, do not wait"
_SYNC_FILE_RANGE_WRITE = 2

_sync_file_range: Callable[[int, int, int, int], int] | None = None
_sync_file_range_loaded = False


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    global _sync_file_range, _sync_file_range_loaded
    if not _sync_file_range_loaded:
        _sync_file_range_loaded = True
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                call = ctypes.CDLL(None, use_errno=True).sync_file_range
                call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                call.restype = ctypes.c_int
                _sync_file_range = cast(Callable[[int, int, int, int], int], call)
            except (OSError, AttributeError):
                _sync_file_range = None
    return _sync_file_range


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to start writing the dirty pages of `fd` in [offset, offset + length)
    (length 0: to the end of the file) to disk, without waiting. A hint: never fails.

    The request is made by a background thread (`_Flusher`): `sync_file_range` itself blocks
    while it queues the pages for the disk (40-80 ms per 64 MiB measured on a virtio disk),
    and made on the copying thread that time was added to the copy instead of overlapping it
    (1 GiB: 0.5 s of a 2.2 s reshard)."""
    if _load_sync_file_range() is not None:
        _FLUSHER.request(fd, offset, length)


class _Flusher:
    """One daemon thread that makes the write-back requests, so the copy never waits for them.

    Each request holds a duplicate of the caller's descriptor (the caller may close its own at
    once); requests for a descriptor already waiting are merged (the pending one covers the
    file's dirty pages when it runs), so at most one duplicate per open output waits here.
    """

    def __init__(self) -> None:
        import threading

        self._lock = threading.Condition(threading.Lock())
        #: caller's fd -> (duplicate fd, offset, length), oldest first
        self._pending: dict[int, tuple[int, int, int]] = {}
        #: fsyncs asked for with `fsync_soon`, oldest first (run before write-back requests)
        self._fsyncs: list[Durable] = []
        self._pid = -1  # the process whose thread runs

    def request(self, fd: int, offset: int, length: int) -> None:
        with self._lock:
            if fd in self._pending:
                _, old_offset, old_length = self._pending[fd]
                if (old_offset, old_length) != (offset, length):
                    # two different ranges: the whole file covers both
                    self._pending[fd] = (self._pending[fd][0], 0, 0)
                return
            try:
                dup = os.dup(fd)
            except OSError:
                return  # a closed descriptor: nothing to write back
            self._pending[fd] = (dup, offset, length)
            self._wake()

    def fsync(self, job: Durable) -> None:
        with self._lock:
            self._fsyncs.append(job)
            self._wake()

    def _wake(self) -> None:
        """Start the thread (once per process) and tell it there is work; lock held."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            import threading

            threading.Thread(target=self._run, name="ckpt-writeback", daemon=True).start()
        self._lock.notify()

    def _run(self) -> None:
        while True:
            job: Durable | None = None
            with self._lock:
                while not self._pending and not self._fsyncs:
                    self._lock.wait()
                if self._fsyncs:
                    job = self._fsyncs.pop(0)
                else:
                    dup, offset, length = self._pending.pop(next(iter(self._pending)))
            if job is not None:
                job.run()
                continue
            call = _load_sync_file_range()
            try:
                if call is not None:
                    call(dup, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error: no head start
            finally:
                os.close(dup)

    def forget(self) -> None:
        """In a forked child: no thread, no lock held by one, no inherited requests."""
        import threading

        self._lock = threading.Condition(threading.Lock())
        self._pending = {}
        self._fsyncs = []
        self._pid = -1


class Durable:
    """An fsync of one file made by the background thread (`fsync_soon`): `wait` returns once
    the file is on disk, or raises the fsync's error."""

    def __init__(self, fd: int):
        import threading

        self._fd = fd  # a duplicate, closed once synced
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            os.fsync(self._fd)
        except BaseException as exc:  # told to the waiter, on its own thread
            self._error = exc
        finally:
            os.close(self._fd)
            self._done.set()

    def wait(self) -> None:
        """Block until the fsync is done; raise its error (an OSError: EIO, ENOSPC) if any."""
        self._done.wait()
        if self._error is not None:
            raise self._error


def fsync_soon(fd: int) -> Durable:
    """fsync `fd`'s file in the background, while the caller goes on (writes the next shard);
    the caller may close `fd` at once. `Durable.wait` before publishing: the file is then as
    durable as after `os.fsync(fd)`, which is what it ran."""
    job = Durable(os.dup(fd))
    _FLUSHER.fsync(job)
    return job


_FLUSHER = _Flusher()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_FLUSHER.forget)


#: bytes written to each open file descriptor since its write-back was last started
_unflushed: dict[int, int] = {}


def note_written(fd: int, count: int) -> None:
    """Count `count` bytes written to `fd`; every `WRITEBACK_STEP` of them, start the
    write-back of the whole file (one request for many small writes, none per write)."""
    pending = _unflushed.get(fd, 0) + count
    if pending >= WRITEBACK_STEP:
        start_writeback(fd)
        pending = 0
    _unflushed[fd] = pending


class _WritebackFileIO(io.FileIO):
    """A `FileIO` that starts the write-back of what it wrote every `WRITEBACK_STEP` bytes."""

    def write(self, data: Any) -> int:
        written = super().write(data) or 0
        note_written(self.fileno(), written)
        return written

    def close(self) -> None:
        if not self.closed:
            _unflushed.pop(self.fileno(), None)
        super().close()


def open_output(path: Path) -> io.BufferedWriter:
    """Create (truncate) `path` for writing, as `open(path, "wb")` does, starting write-back
    of its dirty pages as they accumulate (see the module docstring)."""
    return io.BufferedWriter(_WritebackFileIO(path, "w"))


class FileRange(Iterator[bytes]):
    """Raw bytes of local files, one or more consecutive segments `(path, offset, length)`:
    iterable as blocks, copied in the kernel, or checksummed.

    Any `Writer.write_raw` can iterate it like other raw blocks (one reused buffer; each block
    is valid until the next). A writer that owns a local output file may instead call
    `copy_to`, which moves the bytes with `os.copy_file_range` (no trip through user space) and
    falls back to the buffered copy where the kernel refuses; a writer that needs a CRC of the
    bytes takes `crc32()` first (a read of the source, usually from the page cache).

    Attributes:
        segments: the ranges, in order; `length` is their total.
        on_progress: called with each byte count moved (iterated or copied; not for `crc32`).
    """

    def __init__(
        self,
        path: Path,
        offset: int,
        length: int,
        *,
        block: int = COPY_BLOCK,
        on_progress: Callable[[int], None] | None = None,
    ):
        self.segments: list[tuple[Path, int, int]] = [(path, offset, length)]
        self.length = length
        self.block = block
        self.on_progress = on_progress
        self._blocks: Iterator[bytes] | None = None
        self._kernel_refused = False
        self._untold = 0  # bytes copied and not yet told to on_progress

    @classmethod
    def of(
        cls,
        segments: Sequence[tuple[Path, int, int]],
        *,
        block: int = COPY_BLOCK,
        on_progress: Callable[[int], None] | None = None,
    ) -> FileRange:
        """The concatenation of `segments` (an empty list: no bytes)."""
        first = segments[0] if segments else (Path(os.devnull), 0, 0)
        out = cls(*first, block=block, on_progress=on_progress)
        out.segments = list(segments)
        out.length = sum(n for _, _, n in segments)
        return out

    @property
    def place(self) -> tuple[tuple[str, int, int], ...]:
        """Where the bytes are: equal places hold equal bytes (tied weights)."""
        return tuple((str(p), o, n) for p, o, n in self.segments)

    def split(self, lengths: Sequence[int]) -> list[FileRange]:
        """Consecutive pieces of these bytes, of `lengths` (which must add up to `length`)."""
        if sum(lengths) != self.length:
            raise ValueError(f"pieces of {sum(lengths)} bytes from a {self.length}-byte range")
        pieces: list[FileRange] = []
        queue = list(self.segments)
        for want in lengths:
            parts: list[tuple[Path, int, int]] = []
            while want > 0:
                path, offset, length = queue[0]
                take = min(want, length)
                parts.append((path, offset, take))
                want -= take
                if take == length:
                    queue.pop(0)
                else:
                    queue[0] = (path, offset + take, length - take)
            pieces.append(FileRange.of(parts, block=self.block, on_progress=self.on_progress))
        return pieces

    def __next__(self) -> bytes:
        if self._blocks is None:
            self._blocks = self._read_blocks(self.on_progress)
        return next(self._blocks)

    def _truncated(self, path: Path, offset: int, length: int, done: int) -> FormatError:
        return FormatError(
            f"is truncated ({done} of the {length} bytes at {offset} present)",
            path=str(path),
            fix="The file was cut short; write or fetch it again.",
        )

    def _read_blocks(
        self, on_progress: Callable[[int], None] | None, view: memoryview | None = None
    ) -> Iterator[bytes]:
        """The bytes, read into `view` (by default a new buffer of `block` bytes) block by
        block; each yielded block is a slice of it, valid until the next."""
        if view is None:
            view = aligned_buffer(min(self.block, self.length))
        fds: dict[Path, int] = {}  # each file opened once (a permutation is many row ranges)
        try:
            for path, offset, length in self.segments:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                done = 0
                while done < length:
                    want = min(len(view), length - done)
                    try:
                        got = os.preadv(fd, [view[:want]], offset + done)
                    except OSError as exc:  # a bad sector: the file read is the one to check
                        raise naming(exc, path) from None
                    if got <= 0:
                        raise self._truncated(path, offset, length, done)
                    done += got
                    if on_progress is not None:
                        on_progress(got)
                    yield cast(bytes, view[:got])
        finally:
            for fd in fds.values():
                os.close(fd)

    def crc32(self) -> int:
        """The zip CRC-32 of the bytes (read once, not counted as progress).

        Read in `CRC_BLOCK`s into one page-aligned buffer (`aligned_buffer`) that stays in the
        CPU's cache, and checksummed by ISA-L where it is installed (`storage.crc`: ~2.5x
        zlib's speed), else by zlib."""
        checksum = crc32_function()
        crc = 0
        for block in self._read_blocks(None, aligned_buffer(min(CRC_BLOCK, self.length))):
            crc = checksum(block, crc)
        return crc

    def copy_to(self, out_fd: int, position: int) -> int:
        """Copy all the bytes to `out_fd` at `position` (its file offset is not used), starting
        the write-back every `WRITEBACK_STEP` bytes (`note_written`); the byte count.

        Every segment is one `copy_file_range`, however small: a rotary permutation's 4 KiB
        rows were measured gathered into a buffer instead (one `preadv` per head scattering
        the rows to their places, or one read and a `pwritev` of the rows in order, then one
        write per 8 MiB), and both were slower than the kernel copy per row on Linux 6
        (100 MiB of rows: 0.36 s per row, 0.54-1.05 s gathered; the unpermuted copy 0.19 s)."""
        at = position
        fds: dict[Path, int] = {}  # each file opened once (a permutation is many row ranges)
        try:
            for path, offset, length in self.segments:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                at += self._copy_segment(fd, path, offset, length, out_fd, at)
        finally:
            for fd in fds.values():
                os.close(fd)
        self._tell(0, flush=True)
        return at - position

    def _tell(self, count: int, *, flush: bool = False) -> None:
        """Count `count` bytes moved; tell `on_progress` per COPY_BLOCK (a permutation's
        row-sized segments would otherwise call it per row), and the rest when `flush`."""
        self._untold += count
        if self.on_progress is not None and self._untold and (flush or self._untold >= COPY_BLOCK):
            self.on_progress(self._untold)
            self._untold = 0

    def _copy_segment(
        self, fd: int, path: Path, offset: int, length: int, out_fd: int, at: int
    ) -> int:
        done = 0
        while done < length and not self._kernel_refused:
            try:
                got = os.copy_file_range(
                    fd, out_fd, min(WRITEBACK_STEP, length - done), offset + done, at + done
                )
            except OSError:
                # EXDEV, ENOSYS, EINVAL...: the buffered copy below does the rest, and of the
                # segments after this one (a permutation's rows would each ask again)
                self._kernel_refused = True
                break
            if got <= 0:
                # end of file, or a file system that copies nothing (some FUSE and
                # network ones): the buffered copy tells the two apart
                break
            note_written(out_fd, got)
            done += got
            self._tell(got)
        if done < length:
            rest = FileRange(
                path, offset + done, length - done, block=self.block, on_progress=self._tell
            )
            position = at + done
            for block in rest:
                written = 0
                while written < len(block):
                    written += os.pwrite(out_fd, memoryview(block)[written:], position + written)
                position += len(block)
            note_written(out_fd, length - done)
        return length
