"""The `Storage` interface: byte access to a checkpoint's files, local or remote, confined to the checkpoint root.

Formats read through a `Storage` and never build paths themselves, so that

* every file name taken from an input (index `weight_map`, DCP `relative_path`) is checked
  to stay inside the root (`safe_relpath`), and
* the same format code reads local folders (`os.pread`, no full reads) and remote ones
  (fsspec ranged reads: the Hub through huggingface_hub's `HfFileSystem`, S3, ...).
"""

from __future__ import annotations

import io
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from ..errors import NotFoundError, UsageError
from .relpath import safe_relpath

if TYPE_CHECKING:
    from .destination import Destination

#: the folder `ckpt protect` writes parity into (inside the checkpoint folder, or beside a
#: single-file checkpoint); it is never part of the checkpoint's data, so listings skip it
PARITY_DIR = ".ckpt-parity"
#: the parity manifest in `PARITY_DIR`, written last: parity without it can rebuild nothing
PARITY_MANIFEST = "parity.index.json"


def is_parity_path(rel: str) -> bool:
    """Whether `rel` lies in the parity folder or in one of its staging siblings."""
    top = rel.split("/", 1)[0]
    return top == PARITY_DIR or top.startswith(f".{PARITY_DIR}")


#: name parts of ckpt's own staging and bookkeeping (see output.py, ops/download.py): a hidden
#: `.NAME.ckpt-tmp-*` staging folder, `.NAME.ckpt-old-*` (an old DEST a `--force` replace moved
#: aside) and `.NAME.ckpt-partial` (ranges kept by an unfinished download) are never part of a
#: checkpoint, whatever folder they are found in
STAGING_MARKERS = (".ckpt-tmp-", ".ckpt-old-", ".ckpt-partial")
#: the marker of a staging name: `.NAME.ckpt-tmp-XXXX` (a file or folder being written)
TMP_MARKER = STAGING_MARKERS[0]


def is_staging_name(name: str) -> bool:
    """Whether one path component is one of ckpt's own staging names."""
    return name.startswith(".") and any(marker in name for marker in STAGING_MARKERS)


@dataclass(frozen=True)
class RemoteFile:
    """One file as a server lists it, with the digests the server records (the Hub does).

    Attributes:
        path: path in the repository.
        size: size in bytes (the real file, not the LFS pointer).
        sha256: the LFS object id (sha256 of the content), for LFS files.
        blob_id: the git blob id (sha1 of `blob <size>\\0<content>`), for regular files.
    """

    path: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None


@dataclass(frozen=True)
class Beside:
    """The folders beside a storage's root in its parent folder: where a run's other saves
    are, for the rules that compare a save with the one before it.

    Attributes:
        name: the name of the root's own folder (`checkpoint-300`).
        folders: the names of the folders in its parent, its own included.
        open: a storage rooted at one of `folders`.
    """

    name: str
    folders: tuple[str, ...]
    open: Callable[[str], Storage]


@dataclass(frozen=True)
class FileStat:
    """One file of a listing: its size, and when it was last written when the storage knows.

    Attributes:
        size: size in bytes.
        mtime: modification time (seconds since the epoch), or None when unknown.
    """

    size: int
    mtime: float | None = None


#: the fix of a file that is not there when it is read: a wrong path, or removed by another job
FILE_GONE_FIX = (
    "Check the path. If the file was there when the command started, another job (a prune, a "
    "sync, the training run) removed it: run the command again once that job is done."
)
#: the fix of a stored file shorter than the read its checkpoint's own header asks for
TRUNCATED_FIX = (
    "The file is truncated or changed while it was read: check that no other job is writing "
    "it, run the command again, and if it persists upload the file again from a good copy."
)
#: bytes per block when a local file is streamed into a storage (`Storage.put`)
PUT_BLOCK = 16 << 20


def file_chunks(path: Path, block: int = PUT_BLOCK) -> Iterator[bytes]:
    """The content of a local file, `block` bytes at a time."""
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            yield chunk


class Storage(ABC):
    """Read (and, where declared, write) access to the files under one checkpoint root.

    What a storage can do is declared here, so that operations choose their strategy from
    these declarations and never from the storage's class:

    * `ranged_reads`: reading a byte range costs about that range (no whole-file fetch);
    * `hashes_in_place`: a file's digest can be computed by reading it through this storage
      (a local folder, an object store), so checksum manifests can be written and checked here;
    * `server_digests()`: the digests the server itself records for every file (the Hub's LFS
      sha256 and git blob ids), or None;
    * `local_root`: the folder on this machine, or None;
    * `fs_path()`: the fsspec filesystem and path of a file (objects stores), or None;
    * `s3_filesystem()`: the s3fs filesystem through which the storage talks to S3 (or an
      S3-compatible store), whose client takes S3's own requests (`call_s3`), or None;
    * `modified()`: a file's modification time when the listing reports one, else None;
    * `local_path()`: a file's path on this machine (local folders, cached Hub files), or None;
    * `beside()`: the folders beside the root in its parent (a run's other saves), or None.

    The write side, for storages that declare `writable` (local folders, object stores):

    * `write_file(rel, chunks)`: a file written from a stream of bytes, appearing whole;
    * `put(rel, local)`: a local file published under `rel` atomically (the name shows the old
      content or the new one, never a part), moved rather than copied where it can be;
    * `copy(src, rel)`: a file of this storage copied to another name (server-side in a store);
    * `remove(rel)`: a file, or a folder / prefix with everything under it, gone;
    * `stat_files()`: the listing with sizes and modification times;
    * `destination(rel)`: `rel` as an output destination for `staged_output`.

    A storage that is not writable raises UsageError (exit 2) naming `write_refusal`. The Hub
    is not writable: a Hub storage is one pinned commit, and writing to a repository is a new
    commit of many files at once (`hf upload`), not a file at a time.
    """

    #: how the root is shown in messages
    display: str

    #: reading `length` bytes at an offset fetches about `length` bytes
    ranged_reads: ClassVar[bool] = True
    #: files can be hashed through `read`, and a manifest written beside them
    hashes_in_place: ClassVar[bool] = False
    #: files can be written, replaced and removed under the root (the write side below)
    writable: ClassVar[bool] = False
    #: why writing is refused, and what to do instead (for a storage that is not writable)
    write_refusal: ClassVar[tuple[str, str]] = (
        "this storage is read-only",
        "Write to a local folder or an object store instead.",
    )

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

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, int]]) -> Iterator[bytes]:
        """`read` of each (offset, length) of one file, in order, as each is asked for.

        For many small reads of one file (`verify` reads the head of every DCP chunk): local
        storage opens the file once for all of them instead of once per read.
        """
        for offset, length in ranges:
            yield self.read(rel, offset, length)

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

    def header_read(self, rel: str, size: int) -> int:
        """Bytes to read first of a file that opens with its header's length (safetensors: an
        8-byte length, then the JSON header), of `size` bytes: enough for most headers in one
        read (a longer header takes a second). Remote storages take less: bytes cost more there
        than a round trip."""
        return min(size, 64 << 10)

    def prefetch_heads(self, first_reads: Mapping[str, int]) -> None:  # noqa: B027 - optional hook
        """Files whose header (`header_read`'s kind: a length, then the header) is about to be
        read, each with the bytes its reader expects the header to take (0: no guess).

        A remote storage fetches them all now, concurrently and in the background, headers
        whole, within a memory budget (`storage.heads`), so that the `read`s that follow cost
        no round trip; a local one does nothing (a `pread` costs less than a thread)."""

    def prefetch_files(self, rels: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """Small files about to be read whole (a model's `config.json`, read once the headers
        are): a remote storage fetches those it holds now, in the background, beside the
        heads, so that the `read_all` that follows costs no round trip; a local one does
        nothing. A file fetched and never read is let go at `close`."""

    def arrival_order(self, rels: Iterable[str]) -> Iterator[str]:
        """`rels` (each once) in the order to read their heads: as given, or, where
        `prefetch_heads` fetches them, the fetched ones as they arrive, so a reader parses
        each header while the rest are still on their way."""
        return iter(dict.fromkeys(rels))

    @property
    def local_root(self) -> Path | None:
        """The checkpoint folder on this machine, or None when the storage is not a local folder."""
        return None

    def fs_path(self, rel: str) -> tuple[Any, str] | None:
        """The fsspec filesystem holding `rel` and its path there, or None (not an fsspec store)."""
        return None

    def s3_filesystem(self) -> Any | None:
        """The `s3fs.S3FileSystem` this storage reaches S3 (or an S3-compatible store) through,
        or None: its client takes S3's own requests (`call_s3`, `split_path`), so an upload can
        be checked by the store's reply (`storage.object_upload`)."""
        return None

    def server_digests(self) -> Mapping[str, RemoteFile] | None:
        """Every file with the digests the server records for it, or None when it records none."""
        return None

    def modified(self, rel: str) -> float | None:
        """When the file was last written (seconds since the epoch), from the listing when the
        storage reports it (object stores do); None when unknown."""
        return None

    def changed_since_read(self) -> list[str]:
        """The files read so far that another process has rewritten or replaced since ckpt
        first opened them (named as `describe` names them): what was read of them may mix two
        versions. Only local files are told apart so; an object store pins what it reads by
        ETag instead (a rewritten object fails the read itself), and other storages say []."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Finish background work (remote read-ahead); the storage stays usable."""

    def links_out(self, rels: Iterable[str]) -> dict[str, str]:
        """The files among `rels` that are links leading out of the checkpoint (rel -> where
        they lead): no part of it, so never read (`path` refuses them). Only local folders
        have links; every other storage has none."""
        return {}

    def alias_of(self, rel: str) -> str | None:
        """The folder `rel` stands for when it is a link to another folder inside the
        checkpoint (`best -> global_step100`, as users make them): that folder's path,
        relative to the root; None when `rel` is no link, or leads out of the checkpoint
        (`links_out`) or to nothing. Only local folders have links; every other storage has
        none."""
        return None

    def link_loop(self, rel: str) -> str | None:
        """The chain of links `rel` starts when it is a link that loops back on itself
        (`a -> b -> a`, as the kernel's ELOOP finds it), or None: a name no reader can open
        although `ls` shows it. Only local folders have links; every other storage has none."""
        return None

    def broken_links(self) -> dict[str, str]:
        """The top-level names that are links to nothing (name -> where they lead): a Hugging
        Face cache snapshot whose blobs were removed. The listing leaves them out, having no
        file to list; only local folders have links."""
        return {}

    def describe(self, rel: str) -> str:
        """How to name a file of this storage in messages."""
        return f"{self.display.rstrip('/')}/{rel}"

    def beside(self) -> Beside | None:
        """The folders beside this storage's root in its parent (a run's other saves, for a
        save verified on its own), listed with one request where the storage is remote. None
        where the root has no parent folder, or the parent may not be listed (a store that
        grants this prefix only): what would be compared with them is then not."""
        return None

    def subfolder(self, rel: str) -> Storage:
        """A storage rooted at the subfolder `rel` (a component folder).

        By default a view over this storage's own listing (the Hub: one commit, listed once);
        local folders and object stores return a storage of their own."""
        return FolderView(self, rel)

    # ------------------------------------------------------------------------- write side

    def refuse_write(self, rel: str = "") -> UsageError:
        """The error a write to a storage that is not `writable` raises."""
        problem, fix = self.write_refusal
        return UsageError(problem, path=self.describe(rel) if rel else self.display, fix=fix)

    def write_file(self, rel: str, chunks: Iterable[bytes]) -> int:
        """Write `rel` from `chunks` (parent folders made as needed); the file appears whole,
        replacing any file of that name. Returns the bytes written."""
        raise self.refuse_write(rel)

    def put(self, rel: str, local: Path, *, move: bool = False) -> None:
        """Publish the local file `local` as `rel` atomically: readers see the old file or the
        new one, whole. With `move`, `local` may be consumed (renamed into place where it is
        on the same filesystem)."""
        self.write_file(rel, file_chunks(local))

    def copy(self, src: str, rel: str) -> None:
        """Copy the file `src` of this storage to `rel` (server-side in an object store)."""
        raise self.refuse_write(rel)

    def remove(self, rel: str) -> None:
        """Remove the file `rel`, or the folder (prefix) `rel` with everything under it; a name
        that is not there is no error."""
        raise self.refuse_write(rel)

    def stat_files(self) -> dict[str, FileStat]:
        """Every file under the root (parity excluded, as `list_files`), with its size and its
        modification time where the storage reports one."""
        return {rel: FileStat(size, self.modified(rel)) for rel, size in self.list_files().items()}

    def destination(self, rel: str) -> Destination:
        """`rel` as an output destination (`storage.output.staged_output` publishes there)."""
        raise self.refuse_write(rel)


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


class FolderView(Storage):
    """The files under `prefix` of `parent`, named relative to that folder.

    `listing` is a part of the parent's listing known to hold every file under the prefix (a
    checkpoint's files, when the folder is one of its components): listing the view then costs
    that part, not the whole run folder's listing once per component.

    I/O strategy: nothing of its own. Every call is the parent's with `PREFIX/` in front of the
    name, and the listing is the parent's (listed once, cached by remote storages) filtered to the
    prefix, so judging the checkpoints of a remote run folder one component at a time lists the
    store once, not once per component (`FsspecStorage.subfolder` lists its prefix again), and works
    on storages with no `subfolder` of their own (the Hub).
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

    def beside(self) -> Beside | None:
        # the parent's listing (a run folder's, listed once) names the folders beside this one
        up, _, name = self.prefix.rpartition("/")
        start = f"{up}/" if up else ""
        folders = _folders_of(self.parent, start)
        return Beside(
            name,
            tuple(sorted(folders)),
            lambda other: FolderView(self.parent, f"{start}{other}", folders.get(other, {})),
        )

    def subfolder(self, rel: str) -> Storage:
        return FolderView(self.parent, self._rel(rel), self._listing)


#: each parent storage's listing grouped by the folders under one of its prefixes (the views
#: of a run's saves each ask for the same grouping; grouped once, not once per save judged)
_GROUPED: weakref.WeakKeyDictionary[Storage, dict[str, dict[str, dict[str, int]]]] = (
    weakref.WeakKeyDictionary()
)


def _folders_of(parent: Storage, start: str) -> dict[str, dict[str, int]]:
    """The folders directly under `start` (a prefix ending in `/`, or "") of `parent`'s
    listing, each with its files (paths relative to `parent`, as a `FolderView` lists)."""
    grouped = _GROUPED.setdefault(parent, {})
    if start not in grouped:
        folders: dict[str, dict[str, int]] = {}
        for rel, size in parent.list_files().items():
            if rel.startswith(start):
                name, slash, _rest = rel[len(start) :].partition("/")
                if slash:
                    folders.setdefault(name, {})[rel] = size
        grouped[start] = folders
    return grouped[start]
