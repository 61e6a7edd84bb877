"""A folder of a storage as a storage of its own, over the parent's one listing.

I/O strategy: nothing of its own. Every call is the parent's with `PREFIX/` in front of the
name, and the listing is the parent's (listed once, cached by remote storages) filtered to the
prefix, so judging the checkpoints of a remote run folder one component at a time lists the
store once, not once per component (`FsspecStorage.subfolder` lists its prefix again), and works
on storages with no `subfolder` of their own (the Hub).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from .base import Storage
from .local import safe_relpath


class FolderView(Storage):
    """The files under `prefix` of `parent`, named relative to that folder.

    `listing` is a part of the parent's listing known to hold every file under the prefix (a
    checkpoint's files, when the folder is one of its components): listing the view then costs
    that part, not the whole run folder's listing once per component.
    """

    def __init__(self, parent: Storage, prefix: str, listing: Mapping[str, int] | None = None):
        self.parent = parent
        self.prefix = prefix.strip("/")
        self.display = parent.describe(self.prefix)
        self._listing = listing

    def _rel(self, rel: str) -> str:
        return f"{self.prefix}/{safe_relpath(rel, source=self.display)}"

    def list_files(self) -> dict[str, int]:
        start = f"{self.prefix}/"
        return {
            rel[len(start) :]: size
            for rel, size in (
                self.parent.list_files() if self._listing is None else self._listing
            ).items()
            if rel.startswith(start)
        }

    def size(self, rel: str) -> int:
        return self.parent.size(self._rel(rel))

    def read(self, rel: str, offset: int, length: int) -> bytes:
        return self.parent.read(self._rel(rel), offset, length)

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, int]]) -> Iterator[bytes]:
        return self.parent.read_ranges(self._rel(rel), ranges)

    def open(self, rel: str) -> IO[bytes]:
        return self.parent.open(self._rel(rel))

    def local_path(self, rel: str) -> Path | None:
        return self.parent.local_path(self._rel(rel))

    def header_read(self, rel: str, size: int) -> int:
        return self.parent.header_read(self._rel(rel), size)

    def fs_path(self, rel: str) -> tuple[Any, str] | None:
        return self.parent.fs_path(self._rel(rel))

    def modified(self, rel: str) -> float | None:
        return self.parent.modified(self._rel(rel))

    def describe(self, rel: str) -> str:
        return self.parent.describe(self._rel(rel))

    def subfolder(self, rel: str) -> Storage:
        return FolderView(self.parent, self._rel(rel), self._listing)
