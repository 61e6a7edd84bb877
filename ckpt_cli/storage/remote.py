"""Object stores and other fsspec URLs (`s3://`, `gs://`, `memory://`...) as checkpoint storage.

I/O strategy: the location is resolved once with `fsspec.core.url_to_fs` (credentials and
endpoints come from each filesystem package's usual environment and config, e.g.
`AWS_ENDPOINT_URL`, `AWS_PROFILE`); files are listed once and read with ranged reads
(`cat_file(start, end)`), so inspecting a checkpoint fetches headers and metadata only.

Writes stream through `fs.open(path, "wb")` (multipart uploads on S3: the object appears whole
when the upload completes, or not at all); `put` uploads under a hidden temporary prefix that
holds the run's lease and publishes with one server-side copy, so the final key changes in one
step. Every write drops
the cached listing, so the next listing sees it.
"""

from __future__ import annotations

import contextlib
import glob
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import FormatError, HubError, MissingPrefixError, NotFoundError, UsageError
from .base import (
    FILE_GONE_FIX,
    TMP_MARKER,
    TRUNCATED_FIX,
    Beside,
    Storage,
    file_chunks,
    is_parity_path,
)
from .heads import HEAD_WORKERS, WHOLE_FILE_MAX, HeadCache, HeadRead
from .relpath import safe_relpath
from .remote_replies import listing_time, refusal_code, remote_failure
from .uri import Location

if TYPE_CHECKING:
    # imported where the pool is made: a local SRC never needs it, and `concurrent.futures`
    # (with `logging`) is a measurable part of a metadata command's start-up
    from concurrent.futures import Future, ThreadPoolExecutor

    from .destination import Destination


#: bytes per write when streaming into an object store (and the part size asked of
#: filesystems that upload in parts; S3 needs at least 5 MiB)
UPLOAD_BLOCK = 16 << 20


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
    from concurrent.futures import ThreadPoolExecutor

    with _POOL_LOCK:
        if _READ_POOL is None:
            _READ_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-readahead")
        return _READ_POOL


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

    hashes_in_place = True
    writable = True

    def __init__(self, fs: Any, root: str, display: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.display = display
        self._sizes: dict[str, int] | None = None
        self._mtimes: dict[str, float] = {}
        #: the ETag each object had when listed: S3 reads name it (`If-Match`), so every
        #: byte read comes from the version listed, never from one written since
        self._etags: dict[str, str] = {}
        self._ahead: dict[str, list[_Ahead]] = {}
        #: per file: where the last read ended, and whether its run had a large read before
        self._runs: dict[str, tuple[int, bool]] = {}
        #: fetches dropped by a jump but maybe still in flight (waited for by `close`)
        self._dropped: list[Future[bytes]] = []
        self._lock = threading.Lock()
        #: headers fetched ahead (`prefetch_heads`)
        self._heads = HeadCache(self._fetch)

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
            self.take_listing(found)
        assert self._sizes is not None
        return self._sizes

    def take_listing(self, found: Mapping[str, Any]) -> None:
        """Use `found` (what `fs.find(root, detail=True)` answered) as the root's listing."""
        prefix = f"{self.root}/" if self.root else ""
        # a zero-byte key ending in `/` is a folder placeholder (the S3 console's "Create
        # folder", s3fs `mkdir`, rclone), listed as a file by s3fs: no file of the checkpoint
        found = {
            name: info
            for name, info in found.items()
            if name.startswith(prefix) and not (name.endswith("/") and not info.get("size"))
        }
        self._sizes = {
            name[len(prefix) :]: int(info.get("size") or 0)
            for name, info in sorted(found.items())
            if info.get("type") != "directory"
        }
        self._mtimes = {}
        self._etags = {}
        for name, info in found.items():
            stamp = listing_time(info)
            if stamp is not None:
                self._mtimes[name[len(prefix) :]] = stamp
            etag = info.get("ETag")
            if isinstance(etag, str) and etag:
                self._etags[name[len(prefix) :]] = etag

    def fs_path(self, rel: str) -> tuple[Any, str] | None:
        return self.fs, f"{self.root}/{rel}"

    def s3_filesystem(self) -> Any | None:
        # an S3FileSystem exists only once s3fs is imported: for any other store (gs://,
        # memory://...) s3fs is neither imported nor needed to tell
        s3fs = sys.modules.get("s3fs")
        return self.fs if s3fs is not None and isinstance(self.fs, s3fs.S3FileSystem) else None

    def modified(self, rel: str) -> float | None:
        self.list_files()
        return self._mtimes.get(rel)

    def size(self, rel: str) -> int:
        rel = safe_relpath(rel, source=self.display)
        files = self.all_files()
        if rel not in files:
            raise NotFoundError("file not found", path=self.describe(rel), fix=FILE_GONE_FIX)
        return files[rel]

    def header_read(self, rel: str, size: int) -> int:
        if self._heads.pending(rel):
            head = self._heads.peek(rel)
            if head is not None:
                return len(head)
        return min(size, self.header_probe)

    def prefetch_heads(self, first_reads: Mapping[str, int]) -> None:
        """Fetch the heads of these files, `HEAD_WORKERS` at once, each from `header_probe`
        bytes (or the reader's guess, if larger) on; the fetches run on the filesystem's own
        event loop (s3fs, gcsfs), as many at once as its connection pool allows."""
        self._heads.prefetch(
            {
                rel: HeadRead(max(self.header_probe, guess), size)
                for rel, guess in first_reads.items()
                if (size := self.size(rel))
            }
        )

    def prefetch_files(self, rels: Iterable[str]) -> None:
        """Fetch those of these files the listing holds, up to `WHOLE_FILE_MAX` bytes, whole,
        each in one request, beside the heads."""
        files = self.all_files()
        self._heads.prefetch(
            {
                rel: HeadRead.whole(size)
                for rel in rels
                if 0 < (size := files.get(rel, 0)) <= WHOLE_FILE_MAX
            }
        )

    def arrival_order(self, rels: Iterable[str]) -> Iterator[str]:
        return self._heads.arrival_order(rels)

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        if offset == 0 and self._heads.pending(rel):
            head = self._heads.take(rel)
            if head is not None and len(head) >= length:
                return head[:length]
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
        etag = self._etags.get(safe_relpath(rel, source=self.display))
        s3 = self.s3_filesystem() if etag else None
        try:
            if s3 is not None and etag is not None:
                data = read_pinned(s3, self._full(rel), start, end, etag)
            else:
                data = self.fs.cat_file(self._full(rel), start=start, end=end)
        except Exception as exc:
            if refusal_code(exc) == "PreconditionFailed":
                raise HubError(
                    f"changed in the store since it was listed (its ETag is no longer {etag}): "
                    "another job rewrote it while ckpt read it, so its bytes are not read as "
                    "those of the version listed",
                    path=self.describe(rel),
                    fix="Run the command again once the job writing there is done (`ckpt "
                    "latest` names the newest complete save, never one being written).",
                ) from None
            raise remote_failure(exc, self.describe(rel)) from None
        if len(data) != end - start:
            raise FormatError(
                f"is truncated: wanted {end - start} bytes at offset {start}, got {len(data)}",
                path=self.describe(rel),
                fix=TRUNCATED_FIX,
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
        self._heads.close()
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

    def beside(self) -> Beside | None:
        parent, _, name = self.root.rpartition("/")
        if not parent or not name:
            return None  # a bucket's root: no folder beside it
        shown = self.display.rstrip("/").rpartition("/")[0]
        try:
            entries = self.fs.ls(parent, detail=True)  # one listing, by delimiter
        except (PermissionError, FileNotFoundError):
            return None  # a store that grants this prefix only: nothing to compare with
        except Exception as exc:
            raise remote_failure(exc, shown) from None
        folders = tuple(
            sorted(
                str(e["name"]).rstrip("/").rpartition("/")[2]
                for e in entries
                if e.get("type") == "directory"
            )
        )
        return Beside(
            name,
            folders,
            lambda other: FsspecStorage(self.fs, f"{parent}/{other}", f"{shown}/{other}"),
        )

    def subfolder(self, rel: str) -> Storage:
        rel = safe_relpath(rel, source=self.display)
        return FsspecStorage(self.fs, self._full(rel), self.describe(rel))

    def open(self, rel: str) -> IO[bytes]:
        try:
            handle: IO[bytes] = self.fs.open(self._full(rel), "rb")
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel)) from None
        return handle

    # ------------------------------------------------------------------------- write side

    def _written(self, full: str) -> None:
        """Forget listings that a write to `full` made stale (ours and the filesystem's)."""
        self._sizes = None
        self._mtimes = {}
        self._etags = {}
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(full)

    def write_file(self, rel: str, chunks: Iterable[bytes]) -> int:
        full = self._full(rel)
        written = 0
        try:
            out = self.fs.open(full, "wb", block_size=UPLOAD_BLOCK)
            try:
                for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
                out.close()  # the last part goes up, and the object appears whole
            except BaseException:
                abandon_upload(out)
                raise
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel), writing=True) from None
        finally:
            self._written(full)
        return written

    def put(self, rel: str, local: Path, *, move: bool = False) -> None:
        """The file goes up under a hidden prefix beside `rel` (`.NAME.ckpt-tmp-XXXX/NAME`) that
        holds this run's lease, then one server-side copy makes the final key change at once,
        and the prefix is removed. A run killed meanwhile (SIGKILL) leaves the prefix; the next
        `put` of the same name removes it (and aborts its multipart uploads) once its lease
        says the run is gone, as for every object-store output (`object_leases`)."""
        from ..faults import notice
        from .object_leases import LEASE_NAME, Lease, remove_dead_temporaries

        folder, _, name = rel.rpartition("/")
        parent = (
            FsspecStorage(self.fs, self._full(folder), self.describe(folder)) if folder else self
        )
        tmp = f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
        lease = Lease(parent, f"{tmp}/{LEASE_NAME}")
        try:
            try:
                lease.start()
            except HubError as exc:  # the store refused the first write: named by the file
                raise HubError(exc.problem, path=self.describe(rel), fix=exc.fix) from None
            for note in remove_dead_temporaries(parent, name, lease):
                notice(note)
            parent.write_file(f"{tmp}/{name}", file_chunks(local))
            parent.copy(f"{tmp}/{name}", name)
        finally:
            lease.stop()  # no renewal lands after the removal
            with contextlib.suppress(Exception):
                parent.remove(tmp)
            lease.remove_late()  # (a write the store was still answering when a signal came)
            self._written(self._full(rel))

    def copy(self, src: str, rel: str) -> None:
        full = self._full(rel)
        try:
            # one object to one key: `fs.copy` would read `*?[` in a key as a glob pattern
            self.fs.cp_file(self._full(src), full)
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel), writing=True) from None
        finally:
            self._written(full)

    def remove(self, rel: str) -> None:
        full = self._full(rel)
        rel = safe_relpath(rel, source=self.display)
        try:
            if self._sizes is not None and rel in self._sizes:
                self.fs.rm_file(full)  # an object this storage listed: one request
                del self._sizes[rel]
                self._mtimes.pop(rel, None)
                with contextlib.suppress(Exception):
                    self.fs.invalidate_cache(full)
                return
            if self.fs.exists(full):  # an object, or a prefix with everything under it
                self.fs.rm(literal(full), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise remote_failure(exc, self.describe(rel), writing=True) from None
        self._written(full)

    def destination(self, rel: str) -> Destination:
        # (a data command's: a metadata command never builds the dataclass)
        from .destination import RemoteDest

        rel = safe_relpath(rel, source=self.display)
        return RemoteDest(url=self.describe(rel), fs=self.fs, path=self._full(rel))


def literal(path: str) -> str:
    """`path` spelt so that fsspec's path-expanding calls (`rm`, `copy`, `expand_path`) read it
    as itself: they take `*`, `?` and `[` as glob patterns, so a key holding one would name
    other objects (a prefix `r?n/` matching `run/`) or none."""
    return glob.escape(path)


def read_pinned(fs: Any, path: str, start: int, end: int, etag: str) -> bytes:
    """Bytes `start..end` of the S3 object at `path` (an s3fs filesystem's), from the version
    whose ETag is `etag` only: the GET names it (`If-Match`), and S3 answers 412
    PreconditionFailed (raised, as s3fs raises it) once the object was replaced, where a plain
    ranged read would return the new object's bytes at the old object's offsets. Asked again
    on the failures s3fs itself asks again (a connection cut mid-body included)."""
    from fsspec.asyn import sync
    from s3fs.core import S3_RETRYABLE_ERRORS

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def read_body(body: Any) -> bytes:
        try:
            data: bytes = await body.read()
            return data
        finally:
            body.close()

    tries = max(1, int(getattr(fs, "retries", 1)))
    for attempt in range(tries):
        reply = fs.call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{end - 1}",
            IfMatch=etag,
            **extra,
        )
        try:
            data: bytes = sync(fs.loop, read_body, reply["Body"])
            return data
        except S3_RETRYABLE_ERRORS:
            if attempt + 1 >= tries:
                raise
            time.sleep(min(0.1 * 1.7**attempt, 15.0))
    raise AssertionError("unreachable")  # pragma: no cover


def abandon_upload(handle: Any) -> None:
    """Throw away a file of an fsspec filesystem being written, when what was to go into it
    failed (a refused part, a source that could not be read, Ctrl-C): its upload is cancelled
    (`discard`: S3's multipart upload aborted, a GCS resumable upload cancelled, where the
    store bills what it holds), and the handle is marked closed without being closed, since
    closing it (which a `with` block or the garbage collector would do) publishes what was
    written so far as the whole object."""
    from fsspec.spec import AbstractBufferedFile

    with contextlib.suppress(Exception):
        handle.discard()
    if isinstance(handle, AbstractBufferedFile):
        handle.closed = True


def _pool_options(url: str) -> dict[str, Any]:
    """Options that let an S3 filesystem hold `HEAD_WORKERS` connections: botocore's default
    pool of 10 would queue the header reads of a many-shard checkpoint ten by ten (at 50 ms a
    round trip, 163 shards: 17 round trips instead of 3). A pool size the user configured
    for fsspec (`config_kwargs`) is kept."""
    import fsspec

    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return {}
    configured = dict(fsspec.config.conf.get("s3", {}).get("config_kwargs") or {})
    if "max_pool_connections" in configured:
        return {}
    return {"config_kwargs": {**configured, "max_pool_connections": HEAD_WORKERS}}


def filesystem_for(location: Location) -> tuple[Any, str]:
    """The fsspec filesystem and the path inside it for an fsspec URL."""
    assert location.url is not None
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec ships with huggingface_hub
        raise UsageError(
            "fsspec is not installed", path=location.raw, fix="pip install fsspec"
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(location.url, **_pool_options(location.url))
    except (ImportError, ValueError) as exc:
        scheme = location.url.split("://", 1)[0]
        extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(
            scheme
        )
        fix = (
            f"Install its filesystem package (pip install {extra})."
            if extra
            else "Check the URL scheme."
        )
        raise UsageError(
            f"cannot open {scheme}:// URLs ({exc})", path=location.raw, fix=fix
        ) from None
    return fs, str(path)


def open_fsspec(location: Location) -> tuple[FsspecStorage, str | None]:
    """The storage of an fsspec URL and the file it names: a folder-like prefix (no file), or
    one object (its parent prefix, and its name)."""
    fs, path = filesystem_for(location)
    root = path.rstrip("/")
    try:
        # a prefix of objects (a checkpoint folder, the usual SRC): its listing is the one the
        # storage needs, so one request both tells a folder and lists it (not two in turn)
        found = fs.find(root, detail=True) if root else {}
        if any(name.startswith(f"{root}/") for name in found):
            storage = FsspecStorage(fs, path, location.raw)
            storage.take_listing(found)
            return storage, None
        if list(found) == [root] and found[root].get("type") == "file":
            return _one_object(location, fs, path)  # (s3fs's find answers an object itself)
        if fs.isdir(path):
            return FsspecStorage(fs, path, location.raw), None
        if fs.isfile(path):
            return _one_object(location, fs, path)
    except FileNotFoundError:
        raise _not_found(location, fs, path) from None
    except Exception as exc:  # each filesystem package raises its own network/auth errors
        raise remote_failure(exc, location.raw) from None
    raise _not_found(location, fs, path)


def _not_found(location: Location, fs: Any, path: str) -> NotFoundError:
    """Nothing at `path`: a bucket that does not exist says so (one more request, on this
    failure only), as a write to it does; else the object or prefix is missing."""
    bucket = path.strip("/").split("/", 1)[0]
    # object stores name the bucket first and have no root folder ("" root marker)
    if bucket and fs.root_marker == "":
        try:
            missing = not fs.exists(bucket)
        except Exception:  # the answer only words the message
            missing = False
        if missing:
            return NotFoundError(
                f"the bucket {bucket!r} does not exist",
                path=location.raw,
                fix="Check the bucket name, the endpoint (AWS_ENDPOINT_URL for S3) and the "
                "credentials.",
            )
    return MissingPrefixError(
        "no such object or prefix", path=location.raw, fix="Check the bucket and path."
    )


def _one_object(location: Location, fs: Any, path: str) -> tuple[FsspecStorage, str]:
    """The storage of the object's parent prefix, and the object's name."""
    parent, _, name = path.rstrip("/").rpartition("/")
    display = location.raw.rstrip("/").rpartition("/")[0]
    return FsspecStorage(fs, parent, display), name
