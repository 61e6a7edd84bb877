"""Uploading local files into an object store, each read once and checked by the store's reply.

I/O strategy: S3 (and every S3-compatible store s3fs speaks to) is called directly through
s3fs's own client (`call_s3`: its credentials, endpoint, retries and extra request arguments),
so that the ETag S3 returns for each PUT, part and completed multipart upload is seen: that
reply is the check of the upload (MD5 of the bytes received), with no listing or HEAD after
it. Each body carries its `Content-MD5`, so a store that checks it refuses a corrupt body
outright. A file under `SINGLE_PUT_MAX` bytes goes up in one PUT; a larger one as a multipart upload
of `UPLOAD_BLOCK` parts, its parts sent side by side in a shared pool while the file is still
being read and hashed in order. Memory: the bytes read and not yet sent are bounded by
`budget` (two `UPLOAD_BLOCK`s per job), whatever the file sizes.

Other fsspec filesystems have no such API: `ObjectUploader.direct` is False and callers
stream through `fs.open(..., "wb")` and check with a listing instead.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .output import UPLOAD_BLOCK

#: files under this size go up in one PUT (S3 recommends multipart uploads from about
#: 100 MB; one PUT costs the store a third of the work of parts it must join, measured
#: against moto); larger ones as `UPLOAD_BLOCK` parts
SINGLE_PUT_MAX = 4 * UPLOAD_BLOCK


@dataclass
class UploadedFile:
    """What one upload read and what the store answered.

    Attributes:
        size: bytes read from the file and sent.
        digest: the caller's hash (the manifest's algorithm) of those bytes.
        expected_etag: the ETag S3 gives these bytes sent this way (`multipart_etag`).
        etag: the ETag the store returned for the object (None if it sent none).
    """

    size: int
    digest: str
    expected_etag: str
    etag: str | None


def multipart_etag(parts: list[bytes]) -> str:
    """The ETag S3 gives an object completed from parts with these MD5 digests."""
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def _etag(reply: dict[str, Any]) -> str | None:
    value = reply.get("ETag")
    return str(value).strip('"') if value else None


def _md5_header(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class ObjectUploader:
    """Uploads files to one fsspec filesystem; direct S3 calls where the filesystem has them.

    `jobs` parts of multipart uploads are sent at once (their own pool, so a reader waiting
    for its parts never holds a thread a part needs). `take(n)` is called for every block
    about to be sent (the caller's rate limit).
    """

    def __init__(self, fs: Any, jobs: int, take: Callable[[int], None] | None = None):
        self.fs = fs
        self.direct = callable(getattr(fs, "call_s3", None)) and callable(
            getattr(fs, "split_path", None)
        )
        self.jobs = max(1, jobs)
        self._take = take
        #: bytes read and not yet sent, at most (a single PUT of a larger file waits for all)
        self.budget = 2 * self.jobs * UPLOAD_BLOCK
        self._held = 0
        self._room = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _reserve(self, amount: int) -> int:
        amount = min(amount, self.budget)
        with self._room:
            self._room.wait_for(lambda: self._held + amount <= self.budget)
            self._held += amount
        return amount

    def _part_done(self, amount: int, _future: Future[dict[str, Any]]) -> None:
        self._release(amount)

    def _release(self, amount: int) -> None:
        with self._room:
            self._held -= amount
            self._room.notify_all()

    def close(self) -> None:
        """Wait for parts still in flight (none once every upload has returned)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _parts_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="ckpt-part")
            return self._pool

    def upload(self, path: Path, target: str, size: int, new: Callable[[], Any]) -> UploadedFile:
        """Send `path` (of `size` bytes) to `target`, hashing it with `new()` on the way.

        Raises what the filesystem raises (the caller names the file); a multipart upload
        that fails is aborted, so no part of it lingers in the bucket.
        """
        assert self.direct
        bucket, key, _ = self.fs.split_path(target)
        hasher = new()
        with open(path, "rb") as src:
            if size >= SINGLE_PUT_MAX:
                return self._multipart(src, bucket, key, target, hasher)
            held = self._reserve(size)
            try:
                data = src.read(size)  # one that grew since is caught by its stamp
                hasher.update(data)
                md5 = hashlib.md5(data).digest()
                self._pace(len(data))
                reply = self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=data, ContentMD5=_md5_header(md5)
                )
            finally:
                self._release(held)
        self.fs.invalidate_cache(target)
        return UploadedFile(len(data), hasher.hexdigest(), md5.hex(), _etag(reply))

    def _pace(self, amount: int) -> None:
        """The rate limit, before the bytes go: a burst of jobs never outruns it."""
        if self._take is not None:
            self._take(amount)

    def _multipart(self, src: Any, bucket: str, key: str, target: str, hasher: Any) -> UploadedFile:
        mpu = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = mpu["UploadId"]
        futures: list[Future[dict[str, Any]]] = []
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                held = self._reserve(UPLOAD_BLOCK)
                try:
                    block = src.read(UPLOAD_BLOCK)
                    if not block:
                        self._release(held)
                        break
                    hasher.update(block)
                    md5 = hashlib.md5(block).digest()
                    future = self._parts_pool().submit(
                        self._part, bucket, key, upload_id, len(parts) + 1, block, md5
                    )
                except BaseException:
                    self._release(held)
                    raise
                future.add_done_callback(functools.partial(self._part_done, held))
                parts.append(md5)
                size += len(block)
                futures.append(future)
            replies = [f.result() for f in futures]
            done = self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [
                        {"PartNumber": n, "ETag": r["ETag"]} for n, r in enumerate(replies, 1)
                    ]
                },
            )
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()  # waited for: no part is sent after the abort
            # the upload's own failure is the one to report
            with contextlib.suppress(Exception):
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                )
            raise
        self.fs.invalidate_cache(target)
        return UploadedFile(size, hasher.hexdigest(), multipart_etag(parts), _etag(done))

    def _part(
        self, bucket: str, key: str, upload_id: str, number: int, block: bytes, md5: bytes
    ) -> dict[str, Any]:
        self._pace(len(block))
        reply: dict[str, Any] = self.fs.call_s3(
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=block,
            ContentMD5=_md5_header(md5),
        )
        return reply
