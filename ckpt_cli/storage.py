"""Byte access to a checkpoint's files, local or remote, confined to the checkpoint root.

Formats read through a `Storage` and never build paths themselves, so that

* every file name taken from an input (index `weight_map`, DCP `relative_path`) is checked
  to stay inside the root (`safe_relpath`), and
* the same format code reads local folders (`os.pread`, no full reads) and remote ones
  (fsspec ranged reads: the Hub through huggingface_hub's `HfFileSystem`, S3, ...).
"""

from __future__ import annotations

import io
import os
import posixpath
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

from .errors import CkptError, FormatError, HubError, NotFoundError, UnsafeInputError


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
        """All files under the root (recursively), relative POSIX path -> size in bytes."""

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

    def describe(self, rel: str) -> str:
        """How to name a file of this storage in messages."""
        return f"{self.display.rstrip('/')}/{rel}"


class LocalStorage(Storage):
    """A folder on this machine; reads use `os.pread` so nothing is read that is not asked for."""

    def __init__(self, root: Path):
        self.root = root
        self.display = str(root)
        self._real_root = os.path.realpath(root)

    def path(self, rel: str) -> Path:
        """Absolute path of `rel`, refusing names and symlinks that leave the root."""
        rel = safe_relpath(rel, source=self.display)
        full = self.root / rel
        real = os.path.realpath(full)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise UnsafeInputError(
                f"{rel!r} is a link that points outside the checkpoint ({real})",
                path=self.display,
                fix="Copy the file into the checkpoint folder instead of linking it.",
            )
        return full

    def list_files(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(self.root):
            for fname in files:
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
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError("file not found", path=str(path)) from None
        try:
            return _pread_exact(fd, offset, length, str(path))
        finally:
            os.close(fd)

    def open(self, rel: str) -> IO[bytes]:
        path = self.path(rel)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise NotFoundError("file not found", path=str(path)) from None

    def local_path(self, rel: str) -> Path | None:
        return self.path(rel)

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


def remote_failure(exc: BaseException, where: str) -> CkptError:
    """A remote filesystem's exception as a ckpt error (exit 3 for missing, else exit 5)."""
    if isinstance(exc, CkptError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return NotFoundError("no such remote file", path=where)
    return HubError(
        f"cannot read from the remote store ({type(exc).__name__}: {exc})",
        path=where,
        fix="Check the network, the endpoint and your credentials.",
    )


class FsspecStorage(Storage):
    """Any fsspec filesystem (the Hub through `HfFileSystem`, S3, GCS...), with ranged reads."""

    def __init__(self, fs: Any, root: str, display: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.display = display
        self._sizes: dict[str, int] | None = None

    def _full(self, rel: str) -> str:
        rel = safe_relpath(rel, source=self.display)
        return f"{self.root}/{rel}" if self.root else rel

    def list_files(self) -> dict[str, int]:
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
        return self._sizes

    def size(self, rel: str) -> int:
        rel = safe_relpath(rel, source=self.display)
        files = self.list_files()
        if rel not in files:
            raise NotFoundError("file not found", path=self.describe(rel))
        return files[rel]

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        try:
            data = self.fs.cat_file(self._full(rel), start=offset, end=offset + length)
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel)) from None
        if len(data) != length:
            raise FormatError(
                f"is truncated: wanted {length} bytes at offset {offset}, got {len(data)}",
                path=self.describe(rel),
            )
        return bytes(data)

    def open(self, rel: str) -> IO[bytes]:
        try:
            handle: IO[bytes] = self.fs.open(self._full(rel), "rb")
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel)) from None
        return handle
