"""Byte access to a checkpoint's files, local or remote, confined to the checkpoint root.

Formats read through a `Storage` and never build paths themselves, so that

* every file name taken from an input (index `weight_map`, DCP `relative_path`) is checked
  to stay inside the root (`safe_relpath`), and
* the same format code reads local folders (`os.pread`, no full reads) and remote ones
  (fsspec ranged reads: the Hub through huggingface_hub's `HfFileSystem`, S3, ...).
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import re
import stat
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import CkptError, FormatError, HubError, NotFoundError, UnsafeInputError

#: the folder `ckpt protect` writes parity into (inside the checkpoint folder, or beside a
#: single-file checkpoint); it is never part of the checkpoint's data, so listings skip it
PARITY_DIR = ".ckpt-parity"


def is_parity_path(rel: str) -> bool:
    """Whether `rel` lies in the parity folder or in one of its staging siblings."""
    top = rel.split("/", 1)[0]
    return top == PARITY_DIR or top.startswith(f".{PARITY_DIR}")


#: name parts of ckpt's own staging and bookkeeping (see output.py, ops/download.py): a hidden
#: `.NAME.ckpt-tmp-*` staging folder, `.NAME.ckpt-old-*` (an old DEST a `--force` replace moved
#: aside) and `.NAME.ckpt-partial` (ranges kept by an unfinished download) are never part of a
#: checkpoint, whatever folder they are found in
STAGING_MARKERS = (".ckpt-tmp-", ".ckpt-old-", ".ckpt-partial")


def is_staging_name(name: str) -> bool:
    """Whether one path component is one of ckpt's own staging names."""
    return name.startswith(".") and any(marker in name for marker in STAGING_MARKERS)


def open_regular(path: str | os.PathLike[str], where: str | None = None) -> int:
    """Open a file for reading only if it is a regular file; returns the descriptor.

    The open itself never blocks: a FIFO opened for reading waits for a writer forever, so
    the file is opened with O_NONBLOCK, checked with fstat, and only then made blocking again.
    A FIFO, socket or device is refused (FormatError naming it); a missing file raises
    NotFoundError.
    """
    name = where or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise NotFoundError("file not found", path=name) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO (named pipe)"
                if stat.S_ISFIFO(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a folder"
                if stat.S_ISDIR(mode)
                else "not a regular file"
            )
            raise FormatError(
                f"is {kind}, not a regular file; ckpt reads only regular files",
                path=name,
                fix="Replace it with the real file.",
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], where: str | None = None) -> bytes:
    """The whole content of a regular file (see `open_regular`)."""
    with os.fdopen(open_regular(path, where), "rb") as fh:
        return fh.read()


def safe_relpath(name: str, *, source: str) -> str:
    """Normalise a file name read from an input and refuse anything that leaves the root.

    Args:
        name: the file name as written in the input.
        source: the file that named it, for the error message.
    """
    if not name or "\x00" in name:
        raise UnsafeInputError(f"names an empty or invalid file name {name!r}", path=source)
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or "\\" in name:
        raise UnsafeInputError(
            f"names the absolute path {name!r}; checkpoint files must be relative to the checkpoint",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
        raise UnsafeInputError(
            f"names {name!r}, a path outside the checkpoint",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    return norm


class Storage(ABC):
    """Read access to the files under one checkpoint root."""

    #: how the root is shown in messages
    display: str

    @abstractmethod
    def list_files(self) -> dict[str, int]:
        """All files under the root (recursively), relative POSIX path -> size in bytes.

        The parity folder (`PARITY_DIR`) is not part of the checkpoint and is never listed.
        """

    @abstractmethod
    def size(self, rel: str) -> int:
        """Size of one file; NotFoundError if it is missing."""

    @abstractmethod
    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Read exactly `length` bytes at `offset` (FormatError if the file is shorter)."""

    @abstractmethod
    def open(self, rel: str) -> IO[bytes]:
        """A seekable binary file object (for readers that need one, e.g. torch.load)."""

    def exists(self, rel: str) -> bool:
        """Whether the file exists."""
        try:
            self.size(rel)
        except NotFoundError:
            return False
        return True

    def read_all(self, rel: str) -> bytes:
        """The whole file (for small files: indexes, metadata)."""
        return self.read(rel, 0, self.size(rel))

    def local_path(self, rel: str) -> Path | None:
        """The file's path on this machine, or None for remote storage."""
        return None

    def modified(self, rel: str) -> float | None:
        """When the file was last written (seconds since the epoch), from the listing when the
        storage reports it (object stores do); None when unknown."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Finish background work (remote read-ahead); the storage stays usable."""

    def describe(self, rel: str) -> str:
        """How to name a file of this storage in messages."""
        return f"{self.display.rstrip('/')}/{rel}"

    def subfolder(self, rel: str) -> Storage | None:
        """A storage rooted at the subfolder `rel` (a component folder), or None if unsupported."""
        return None


#: a Hugging Face cache repository folder: `models--org--name` (also datasets--, spaces--)
_HF_CACHE_REPO = re.compile(r"^(models|datasets|spaces)--[^/]+$")


def hf_cache_repo(real_root: str) -> str | None:
    """The cache repository folder (`.../models--org--name`) when `real_root` (a resolved path)
    is, or is inside, one of its `snapshots/<revision>/` folders; else None."""
    parts = real_root.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and _HF_CACHE_REPO.match(parts[i - 1]) and i + 1 < len(parts):
            return os.sep.join(parts[:i])
    return None


class LocalStorage(Storage):
    """A folder on this machine; reads use `os.pread` so nothing is read that is not asked for."""

    def __init__(self, root: Path):
        self.root = root
        self.display = str(root)
        self._real_root = os.path.realpath(root)
        # links may resolve anywhere inside this folder: the root, or for a Hugging Face cache
        # snapshot its repository folder (`models--org--name/`, files link to `../../blobs/`)
        self._link_root = hf_cache_repo(self._real_root) or self._real_root

    def path(self, rel: str) -> Path:
        """Absolute path of `rel`, refusing names and symlinks that leave the root (or, in a
        Hugging Face cache snapshot, the cache's repository folder)."""
        rel = safe_relpath(rel, source=self.display)
        full = self.root / rel
        real = os.path.realpath(full)
        if real != self._link_root and not real.startswith(self._link_root + os.sep):
            raise UnsafeInputError(
                f"{rel!r} is a link that points outside the checkpoint ({real})",
                path=self.display,
                fix="Copy the file into the checkpoint folder instead of linking it.",
            )
        return full

    def list_files(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dirpath, dirs, files in os.walk(self.root):
            # ckpt's own staging folders are not part of the checkpoint (nor walked into)
            dirs[:] = [d for d in dirs if not is_staging_name(d)]
            if dirpath == str(self.root):
                dirs[:] = [d for d in dirs if not is_parity_path(d)]
            for fname in files:
                if is_staging_name(fname):
                    continue
                full = os.path.join(dirpath, fname)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                try:
                    out[rel] = os.stat(full).st_size
                except OSError:
                    continue
        return dict(sorted(out.items()))

    def size(self, rel: str) -> int:
        try:
            return self.path(rel).stat().st_size
        except FileNotFoundError:
            raise NotFoundError("file not found", path=self.describe(rel)) from None

    def read(self, rel: str, offset: int, length: int) -> bytes:
        path = self.path(rel)
        fd = open_regular(path)
        try:
            return _pread_exact(fd, offset, length, str(path))
        except OSError as exc:  # EIO on a failing disk: exit 74 naming the file
            from .faults import io_failure

            raise io_failure(exc, path, f"reading {length} bytes at offset {offset}") from None
        finally:
            os.close(fd)

    def open(self, rel: str) -> IO[bytes]:
        path = self.path(rel)
        return os.fdopen(open_regular(path), "rb")

    def local_path(self, rel: str) -> Path | None:
        return self.path(rel)

    def subfolder(self, rel: str) -> Storage | None:
        return LocalStorage(self.path(rel))

    def describe(self, rel: str) -> str:
        return str(self.root / rel)


def _pread_exact(fd: int, offset: int, length: int, name: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    chunks = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            raise FormatError(
                f"is truncated: wanted {length} bytes at offset {offset}, the file ends after {got}",
                path=name,
                fix="The file was cut short (interrupted save or download); write or fetch it again.",
            )
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


class RangeFile(io.RawIOBase):
    """A seekable read-only file over `size` bytes fetched on demand by `_read_into`.

    For readers that want a file object (`torch.load`, zip directories) while we control how
    bytes arrive: ranged remote reads, or `preadv` of one byte range of a local file.
    """

    def __init__(self, size: int, name: str = ""):
        super().__init__()
        self._size = size
        self._pos = 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._size - self._pos)
        if want <= 0:
            return 0
        got = self._read_into(view[:want], self._pos)
        self._pos += got
        return got

    def _read_into(self, view: memoryview, position: int) -> int:
        """Fill `view` from `position`; return how many bytes were read (at least one)."""
        raise NotImplementedError


class StorageRangeFile(RangeFile):
    """One file of a `Storage` as a seekable file object, read through `Storage.read`."""

    def __init__(self, storage: Storage, rel: str, size: int | None = None):
        super().__init__(storage.size(rel) if size is None else size, storage.describe(rel))
        self._storage = storage
        self._rel = rel

    def _read_into(self, view: memoryview, position: int) -> int:
        data = self._storage.read(self._rel, position, len(view))
        view[: len(data)] = data
        return len(data)


def remote_failure(exc: BaseException, where: str, *, writing: bool = False) -> CkptError:
    """A remote filesystem's exception as a ckpt error (exit 3 for missing, else exit 5)."""
    if isinstance(exc, CkptError):
        return exc
    if isinstance(exc, FileNotFoundError) and not writing:
        return NotFoundError("no such remote file", path=where)
    action = "write to" if writing else "read from"
    return HubError(
        f"cannot {action} the remote store ({type(exc).__name__}: {exc})",
        path=where,
        fix="Check the network, the endpoint and your credentials"
        + (" (and that they allow writing here)." if writing else "."),
    )


@dataclass
class _Ahead:
    """A byte range of one file being fetched in the background."""

    start: int
    end: int
    data: Future[bytes]


#: background fetches for every FsspecStorage (sequential read-ahead); created on first use
_READ_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    global _READ_POOL
    with _POOL_LOCK:
        if _READ_POOL is None:
            _READ_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-readahead")
        return _READ_POOL


def _listing_time(info: dict[str, Any]) -> float | None:
    """A listing entry's modification time: S3's `LastModified`, or `mtime` / `created`."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, int | float):
            return float(value)
    return None


class FsspecStorage(Storage):
    """Any fsspec filesystem (the Hub through `HfFileSystem`, S3, GCS...), with ranged reads.

    Sequential data reads fetch ahead: a read that continues a run of contiguous reads of one
    file, after a read of at least `readahead_min` bytes in that run (tensor after tensor, block
    after block, hashing), has the next `readahead` bytes of the file fetched in a background
    thread, so the next request's round trip overlaps the work on this one. Metadata reads never
    qualify (a header probe is small, and a long header's second read is the first large one of
    its run), so `inspect` fetches no tensor data. A read elsewhere starts a new run and drops
    the windows. Memory: at most two windows per file being read.
    """

    #: first read of a safetensors header: enough for the headers of typical shards, small
    #: enough that inspecting a checkpoint of small tensors still never fetches tensor data
    header_probe = 16 << 10

    #: a run of contiguous reads holding one this large is a sequential data read: read ahead
    readahead_min = 1 << 20
    #: bytes fetched ahead (at least the size of the read that triggered it)
    readahead = 16 << 20

    def __init__(self, fs: Any, root: str, display: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.display = display
        self._sizes: dict[str, int] | None = None
        self._mtimes: dict[str, float] = {}
        self._ahead: dict[str, list[_Ahead]] = {}
        #: per file: where the last read ended, and whether its run had a large read before
        self._runs: dict[str, tuple[int, bool]] = {}
        #: fetches dropped by a jump but maybe still in flight (waited for by `close`)
        self._dropped: list[Future[bytes]] = []
        self._lock = threading.Lock()

    def _full(self, rel: str) -> str:
        rel = safe_relpath(rel, source=self.display)
        return f"{self.root}/{rel}" if self.root else rel

    def list_files(self) -> dict[str, int]:
        return {rel: size for rel, size in self.all_files().items() if not is_parity_path(rel)}

    def all_files(self) -> dict[str, int]:
        """Every object under the root, the parity folder included (listed once, cached)."""
        if self._sizes is None:
            try:
                found = self.fs.find(self.root, detail=True)
            except Exception as exc:
                raise remote_failure(exc, self.display) from None
            prefix = f"{self.root}/" if self.root else ""
            self._sizes = {
                name[len(prefix) :]: int(info.get("size") or 0)
                for name, info in sorted(found.items())
                if info.get("type") != "directory" and name.startswith(prefix)
            }
            for name, info in found.items():
                stamp = _listing_time(info)
                if stamp is not None and name.startswith(prefix):
                    self._mtimes[name[len(prefix) :]] = stamp
        return self._sizes

    def modified(self, rel: str) -> float | None:
        self.list_files()
        return self._mtimes.get(rel)

    def size(self, rel: str) -> int:
        rel = safe_relpath(rel, source=self.display)
        files = self.all_files()
        if rel not in files:
            raise NotFoundError("file not found", path=self.describe(rel))
        return files[rel]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        end = offset + length
        with self._lock:
            windows = self._ahead.pop(rel, [])
        parts: list[bytes] = []
        at = offset
        for window in windows:
            if window.start <= at < window.end:
                try:
                    data = window.data.result()
                except Exception:
                    break  # the direct read below reports the failure properly
                piece = data[at - window.start : end - window.start]
                parts.append(piece)
                at += len(piece)
                if at >= end:
                    break
        if at < end:
            parts.append(self._fetch(rel, at, end))
        # keep only what lies ahead of this read; a jump elsewhere drops every window
        kept = [w for w in windows if w.end > end and w.start <= end] if at > offset else []
        with self._lock:
            self._ahead[rel] = kept
            self._dropped = [f for f in self._dropped if not f.done()]
            self._dropped += [w.data for w in windows if w not in kept and not w.data.done()]
            last_end, had_large = self._runs.get(rel, (-1, False))
            sequential = last_end == offset and had_large
            self._runs[rel] = (end, sequential or length >= self.readahead_min)
        if sequential:
            self._read_ahead(rel, end, length)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _fetch(self, rel: str, start: int, end: int) -> bytes:
        try:
            data = self.fs.cat_file(self._full(rel), start=start, end=end)
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel)) from None
        if len(data) != end - start:
            raise FormatError(
                f"is truncated: wanted {end - start} bytes at offset {start}, got {len(data)}",
                path=self.describe(rel),
            )
        return bytes(data)

    def _read_ahead(self, rel: str, start: int, length: int) -> None:
        """Keep about a window (`readahead` or `length` bytes) fetched or in flight past `start`."""
        size = self.all_files().get(safe_relpath(rel, source=self.display), 0)
        window = max(self.readahead, length)
        with self._lock:
            windows = self._ahead.setdefault(rel, [])
            last = windows[-1].end if windows else start
            # a new window once less than half of one is left ahead: at most two per file
            if last >= size or last - start >= window // 2:
                return
            end = min(size, last + window)
            windows.append(_Ahead(last, end, _read_pool().submit(self._fetch, rel, last, end)))

    def close(self) -> None:
        """Wait for (or cancel) background fetches, so no request outlives the reader."""
        with self._lock:
            pending = [w.data for windows in self._ahead.values() for w in windows]
            pending += self._dropped
            self._ahead.clear()
            self._dropped = []
        for future in pending:
            if not future.cancel():
                # a read-ahead nobody will use: its failure does not matter
                with contextlib.suppress(Exception):
                    future.result()

    def subfolder(self, rel: str) -> Storage | None:
        rel = safe_relpath(rel, source=self.display)
        return FsspecStorage(self.fs, self._full(rel), self.describe(rel))

    def open(self, rel: str) -> IO[bytes]:
        try:
            handle: IO[bytes] = self.fs.open(self._full(rel), "rb")
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel)) from None
        return handle
