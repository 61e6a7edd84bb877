"""hub: `hf://org/repo[@revision][/subfolder]` on the Hugging Face Hub, read through huggingface_hub.

I/O strategy: one request resolves the revision to a commit and lists that commit's files
(sizes, LFS sha256: repo info with its files' metadata; offline, the local cache's `refs/` and
snapshot), and every later request names that commit, so all reads see one consistent
snapshot. Reads are HTTP range requests on the
`resolve` URL through huggingface_hub's own HTTP session (so `HF_ENDPOINT`, `HF_TOKEN`, proxies
and its user agent apply): a safetensors header costs one small ranged GET per shard and no
shard is downloaded. Files already in the local HF cache for that commit are read from disk
instead. With `HF_HUB_OFFLINE=1` the snapshot in the cache is read and nothing is requested.

The Hub is not a checkpoint format of its own: the files found there are opened by the format
adapters (safetensors, DCP, torch) through `HubStorage`, and the manifest's `details["hub"]`
records the repository, the requested revision and the commit it resolved to.

Settings are read from the environment when a location is opened, not when huggingface_hub was
imported, so a long-lived process (or a test) that changes `HF_ENDPOINT`/`HF_HOME` is honoured.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ..errors import CkptError, FormatError, HubError, NotFoundError
from .base import (
    TRUNCATED_FIX,
    Beside,
    RemoteFile,
    Storage,
    StorageRangeFile,
    is_parity_path,
)
from .heads import WHOLE_FILE_MAX, HeadCache, HeadRead
from .hub_repo import (
    READ_RETRIES,
    HubRepo,
    HubSettings,
    broken_connection_errors,
    broken_wait,
    file_digest,
    hub_errors,
    hub_mismatch,
    open_repo,
    retry_wait,
    retrying,
)
from .relpath import safe_relpath
from .uri import Location

#: a ranged read that breaks mid-transfer is resumed from where it stopped `READ_RETRIES`
#: times (the policy every Hub request follows: `hub_repo.broken_connection_errors`)
#: bytes per chunk when streaming a range
STREAM_CHUNK = 1 << 20
__all__ = [
    "HubRepo",
    "HubSettings",
    "HubStorage",
    "RemoteFile",
    "file_digest",
    "hub_errors",
    "hub_mismatch",
    "open_hub",
    "open_repo",
    "retrying",
]


class HubStorage(Storage):
    """The files of a Hub snapshot, read with HTTP range requests (or from the local cache).

    Attributes:
        repo: the pinned repository.
        bytes_fetched: bytes received over the network so far (cache reads do not count).
        bytes_from_cache: bytes read from files already in the local HF cache.
        requests: HTTP requests made for file data.
    """

    #: first read of a safetensors header: most shard headers fit (larger ones take a second
    #: read), and on the Hub one round trip costs more than these bytes
    header_probe = 16 << 10
    #: files smaller than this have their header read exactly, the 8-byte length first and
    #: then that many bytes: there the probe would be a quarter of the file or more, tensor
    #: data the selection may not want (of a shard smaller than the probe: all of it)
    exact_header_below = 4 * header_probe

    #: not writable: this storage is one pinned commit, and a write to a repository is a new
    #: commit of many files at once, not a file at a time
    write_refusal = (
        "cannot write to the Hub",
        "Write to a local folder, then publish it with `hf upload`.",
    )

    def __init__(self, repo: HubRepo):
        self.repo = repo
        self.display = repo.display()
        self.bytes_fetched = 0
        self.bytes_from_cache = 0
        self.requests = 0
        # reads may run on several threads (parallel range fetches)
        self._lock = threading.Lock()
        self._direct: dict[str, str] = {}
        #: headers fetched ahead (`prefetch_heads`)
        self._heads = HeadCache(self._fetch)

    def list_files(self) -> dict[str, int]:
        return {rel: f.size for rel, f in self.repo.files.items() if not is_parity_path(rel)}

    def size(self, rel: str) -> int:
        return self.remote(rel).size

    def server_digests(self) -> Mapping[str, RemoteFile] | None:
        return self.repo.files

    def remote(self, rel: str) -> RemoteFile:
        """The listing entry of `rel` (NotFoundError if absent)."""
        rel = safe_relpath(rel, source=self.display)
        try:
            return self.repo.files[rel]
        except KeyError:
            if self.repo.snapshot is not None:
                # offline, the listing is the cached snapshot's: the repository may well hold it
                raise HubError(
                    "is not in the local cache, and offline mode is on (HF_HUB_OFFLINE=1), so "
                    "the Hub was not asked",
                    path=self.describe(rel),
                    fix="Unset HF_HUB_OFFLINE (or set it to 0) to fetch it, or fetch it once "
                    f"while online (`ckpt download {self.repo.pinned()} --cache-only`).",
                ) from None
            raise NotFoundError(
                "file not found in the repository at this revision",
                path=self.describe(rel),
                fix=f"`ckpt verify {self.display}` lists what the checkpoint lacks; another "
                "revision (`@REV`) may hold it.",
            ) from None

    def describe(self, rel: str) -> str:
        return self.repo.display(rel)

    def beside(self) -> Beside | None:
        location = self.repo.location
        if not location.subfolder:
            return None  # the repository's root: no folder beside it
        up, _, name = location.subfolder.rpartition("/")
        # the same commit, listed from the folder above (the repository's files under it)
        parent = HubStorage(
            open_repo(
                replace(
                    location,
                    raw=self.repo.pinned().rpartition("/")[0],
                    subfolder=up,
                    revision=self.repo.commit,
                ),
                self.repo.settings,
            )
        )
        folders = {rel.split("/", 1)[0] for rel in parent.list_files() if "/" in rel}
        return Beside(name, tuple(sorted(folders)), parent.subfolder)

    def local_path(self, rel: str) -> Path | None:
        cached = self.repo.cached_path(safe_relpath(rel, source=self.display))
        return Path(cached) if cached else None

    def read(self, rel: str, offset: int, length: int) -> bytes:
        size = self.size(rel)
        if offset + length > size:
            raise FormatError(
                f"is truncated: wanted {length} bytes at offset {offset}, the file is {size} bytes",
                path=self.describe(rel),
                fix=TRUNCATED_FIX,
            )
        if length == 0:
            return b""
        if offset == 0 and self._heads.pending(rel):
            head = self._heads.take(rel)
            if head is not None and len(head) >= length:
                return head[:length]
        return b"".join(self.stream(rel, offset, offset + length))

    def header_read(self, rel: str, size: int) -> int:
        if self._heads.pending(rel):
            head = self._heads.peek(rel)
            if head is not None:
                return len(head)  # fetched already, with its siblings'
        if self.local_path(rel) is not None:
            return super().header_read(rel, size)
        return min(size, self.header_probe if size >= self.exact_header_below else 8)

    def prefetch_heads(self, first_reads: Mapping[str, int]) -> None:
        """Fetch the heads of files not in the local cache, `HEAD_WORKERS` at once: a file of
        `exact_header_below` bytes or more is read from `header_probe` bytes (or the reader's
        guess, if larger) on; a smaller one exactly, its 8-byte length first, then the header."""
        if self.repo.snapshot is not None:
            return
        wanted: dict[str, HeadRead] = {}
        for rel, guess in first_reads.items():
            size = self.size(rel)
            if self.local_path(rel) is not None or size == 0:
                continue
            if size < self.exact_header_below:
                wanted[rel] = HeadRead(min(size, 8), size, exact=True)
            else:
                wanted[rel] = HeadRead(max(self.header_probe, guess), size)
        self._heads.prefetch(wanted)

    def prefetch_files(self, rels: Iterable[str]) -> None:
        """Fetch those of these files the repository holds, up to `WHOLE_FILE_MAX` bytes and
        not in the local cache, whole, each in one request, beside the heads."""
        if self.repo.snapshot is not None:
            return
        wanted: dict[str, HeadRead] = {}
        for rel in rels:
            file = self.repo.files.get(rel)
            if file is not None and 0 < file.size <= WHOLE_FILE_MAX and not self.local_path(rel):
                wanted[rel] = HeadRead.whole(file.size)
        self._heads.prefetch(wanted)

    def arrival_order(self, rels: Iterable[str]) -> Iterator[str]:
        return self._heads.arrival_order(rels)

    def _fetch(self, rel: str, start: int, end: int) -> bytes:
        return b"".join(self.stream(rel, start, end))

    def close(self) -> None:
        self._heads.close()

    def stream(self, rel: str, start: int, end: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        """Bytes `start..end` of `rel` in chunks: one ranged GET, resumed if the connection drops."""
        cached = self.local_path(rel)
        if cached is not None:
            with open(cached, "rb") as fh:
                fh.seek(start)
                pos = start
                while pos < end:
                    block = fh.read(min(chunk, end - pos))
                    if not block:
                        raise FormatError(
                            f"is shorter in the local cache than on the Hub ({pos} < {end} bytes)",
                            path=str(cached),
                            fix="Delete it from the HF cache (`hf cache rm`) and fetch it again.",
                        )
                    pos += len(block)
                    with self._lock:
                        self.bytes_from_cache += len(block)
                    yield block
            return
        if self.repo.snapshot is not None:
            raise HubError(
                "is not in the local cache (HF_HUB_OFFLINE is set)",
                path=self.describe(rel),
                fix="Unset HF_HUB_OFFLINE to fetch it.",
            )
        yield from self._stream_remote(rel, start, end, chunk)

    def _stream_remote(self, rel: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        import httpx2
        from huggingface_hub import get_session, hf_raise_for_status

        # `huggingface_hub.utils` re-exports it lazily (mypy --strict sees no export); its
        # defining module has been `utils._headers` since huggingface_hub 0.x
        from huggingface_hub.utils._headers import build_hf_headers

        where = self.describe(rel)
        pos, failures, busy = start, 0, 0
        while pos < end:
            # LFS files redirect to a signed CDN URL: once known, ranges go there directly
            # (one round trip instead of two); an expired one falls back to `resolve`
            with self._lock:
                direct = self._direct.get(rel)
                self.requests += 1
            url = direct or self.repo.url(rel)
            headers = {} if direct else build_hf_headers(token=self.repo.settings.token)
            headers["Range"] = f"bytes={pos}-{end - 1}"
            headers["Accept-Encoding"] = "identity"
            try:
                with get_session().stream(
                    "GET",
                    url,
                    headers=headers,
                    follow_redirects=True,
                    timeout=self.repo.settings.timeout,
                ) as response:
                    if direct and response.status_code in (401, 403, 404, 410):
                        with self._lock:
                            self._direct.pop(rel, None)
                        continue
                    wait = retry_wait(response.status_code, response.headers, busy)
                    if wait is not None:
                        # a rate limit or a passing server error: asked again, a bounded
                        # number of times, as huggingface_hub's own downloads are
                        busy += 1
                        time.sleep(wait)
                        continue
                    with hub_errors(where):
                        hf_raise_for_status(response)
                    if not direct and response.history:
                        with self._lock:
                            self._direct[rel] = str(response.url)
                    wrong = _wrong_range(response, pos, end, self.size(rel))
                    if wrong is not None:
                        # bytes other than those asked: never written, asked again, then refused
                        failures += 1
                        if failures > READ_RETRIES:
                            raise HubError(
                                f"the server answered other bytes than asked ({wrong})",
                                path=where,
                                fix="The Hub or a proxy/CDN in between returned a wrong range: "
                                "run again later, or fetch the files whole into the local HF "
                                f"cache (`ckpt download {self.repo.pinned()} --cache-only`, "
                                "each checked against the Hub's sha256), where ckpt then reads "
                                "them.",
                            )
                        time.sleep(broken_wait(failures))
                        continue
                    # a 200 carries the whole file (checked above): skip what precedes `pos`
                    skip = pos if response.status_code == 200 else 0
                    # a range answer of a stated length (checked above) is read to its end, so
                    # its connection goes back to the pool for the next request (breaking off
                    # closes it: every request would then pay a new connection's handshake)
                    drain = (
                        response.status_code == 206
                        and response.headers.get("Content-Length") is not None
                    )
                    # no chunk size: blocks are yielded as they arrive, so after a dropped
                    # connection the retry starts at the last byte received, not at a block edge
                    for block in response.iter_bytes():
                        with self._lock:
                            self.bytes_fetched += len(block)
                        if skip:
                            cut = min(skip, len(block))
                            block, skip = block[cut:], skip - cut
                        block = block[: end - pos]
                        if not block:
                            if pos >= end and not drain:
                                break
                            continue
                        pos += len(block)
                        failures = 0
                        yield block
                        if pos >= end and not drain:
                            break
            except broken_connection_errors() as exc:
                failures += 1
                if failures > READ_RETRIES:
                    raise HubError(
                        f"the connection kept failing while reading bytes {pos}..{end} ({exc})",
                        path=where,
                        fix="Check the network and run the command again.",
                    ) from None
                time.sleep(broken_wait(failures))
                continue
            except httpx2.TransportError:
                with hub_errors(where):
                    raise
            if pos < end:
                failures += 1
                if failures > READ_RETRIES:
                    raise HubError(
                        f"the Hub sent fewer bytes than asked ({pos - start} of {end - start})",
                        path=where,
                        fix="Run the command again.",
                    )

    def open(self, rel: str) -> IO[bytes]:
        cached = self.local_path(rel)
        if cached is not None:
            return open(cached, "rb")
        return io.BufferedReader(StorageRangeFile(self, rel), buffer_size=STREAM_CHUNK)


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _wrong_range(response: Any, start: int, end: int, size: int) -> str | None:
    """Why a response to `Range: bytes=start-(end-1)` does not carry exactly those bytes.

    A 206 must say `Content-Range: bytes start-(end-1)/size` and carry `end - start` bytes; a
    200 (the server ignored Range) must carry the whole file, `size` bytes. Anything else is
    refused: a shifted or resized range would otherwise be written as the tensor's bytes.
    """
    status = response.status_code
    length = response.headers.get("Content-Length")
    if status == 200:
        if length is not None and int(length) != size:
            return f"status 200 with {length} bytes; the whole file is {size} bytes"
        return None
    if status != 206:
        return f"status {status} to a range request"
    got = _CONTENT_RANGE.match(response.headers.get("Content-Range", "").strip())
    if got is None:
        return (
            f"status 206 without a valid Content-Range ({response.headers.get('Content-Range')!r})"
        )
    first, last, total = int(got[1]), int(got[2]), got[3]
    if (first, last) != (start, end - 1) or (total != "*" and int(total) != size):
        return f"asked bytes {start}-{end - 1}/{size}, got Content-Range bytes {got[1]}-{got[2]}/{total}"
    if length is not None and int(length) != end - start:
        return f"asked {end - start} bytes, Content-Length says {length}"
    return None


def open_hub(location: Location) -> tuple[HubStorage, str | None]:
    """Open an `hf://` location: resolve the revision once, list the files, read by ranges.

    Returns the storage and the file the location names (None for a folder).

    A location whose path names one file (`hf://org/repo/model.safetensors`) opens that file.
    """
    target = None
    try:
        repo = open_repo(location)
    except (NotFoundError, HubError) as error:
        if not location.subfolder:
            raise
        # the path may name a file rather than a folder: list its folder and look for it
        parent, _, name = location.subfolder.rpartition("/")
        try:
            repo = open_repo(replace(location, subfolder=parent))
        except CkptError:
            raise error from None
        if name not in repo.files:
            raise error from None
        target = name
    return HubStorage(repo), target
