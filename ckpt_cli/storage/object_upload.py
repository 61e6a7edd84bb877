"""Uploading local files into an object store, each read once and checked by the store's reply.

I/O strategy: S3 (and every S3-compatible store s3fs speaks to) is called directly through
s3fs's own client (`call_s3`: its credentials, endpoint, retries and extra request arguments),
so that each upload is checked by the store's reply, with no listing or HEAD after it.

Integrity: a store that checks the flexible checksums of requests (`x-amz-checksum-*`, as S3
does) is found once per uploader (`checks_checksums`: a tiny PUT with a wrong CRC32 must be
refused; asked in the background as soon as something is to be sent, `ask_early`, and awaited
by each upload only once its bytes are read, where the answer decides what is sent). The
store checks every body, and each byte is hashed with SHA-256 once, for the manifest (save
a part's over plain HTTP, which botocore always signs):
- to a store that checks checksums, over TLS, a single PUT carries that SHA-256 in
  `x-amz-checksum-sha256` (S3 keeps it as the object's checksum) and each part its CRC32
  (ISA-L's: cheap), and the payload goes unsigned (`leave_checked_unsigned`: botocore would
  otherwise hash every such body again to sign it); over plain HTTP, where botocore always
  signs a body's SHA-256, a single PUT carries its CRC32 and the SHA-256 is the signed one
  (`SignedPayloads`);
- a store that does not refuse a wrong checksum (moto, some S3-compatible servers) gets
  `Content-MD5` with each body, and the ETag of its reply (MD5 of the bytes it received) is
  compared with the MD5 of the bytes sent; a part there also carries the CRC32 botocore would
  otherwise compute with zlib (`crc32_by_default`), and a single PUT's SHA-256 is the signed
  one where botocore signs it.
A file under `SINGLE_PUT_MAX` bytes goes up in one PUT; a larger one as a multipart upload
of `UPLOAD_BLOCK` parts, its parts sent side by side in a shared pool while the file is still
being read and hashed in order. Memory: the bytes read and not yet sent are bounded by
`budget` (two `UPLOAD_BLOCK`s per job), whatever the file sizes.

Which stores those are is what the storage declares (`Storage.s3_filesystem()`); other fsspec
filesystems have no such API, and callers stream through `fs.open(..., "wb")` and check with a
listing instead.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .. import faults
from ..faults import close_pool, io_failure, naming, submit_tracked
from .crc import crc32_function
from .remote import UPLOAD_BLOCK
from .remote_replies import refusal_code

#: files under this size go up in one PUT (S3 recommends multipart uploads from about
#: 100 MB; one PUT costs the store a third of the work of parts it must join, measured
#: against moto); larger ones as `UPLOAD_BLOCK` parts
SINGLE_PUT_MAX = 4 * UPLOAD_BLOCK

#: error codes with which a store refuses a body that does not match its `x-amz-checksum-*`
#: (S3: BadDigest; MinIO: XAmzContentChecksumMismatch)
CHECKSUM_REFUSALS = frozenset({"BadDigest", "XAmzContentChecksumMismatch"})
_NO_RETRY = {"max_attempts": 1, "mode": "standard"}


@dataclass
class UploadedFile:
    """What one upload read and what the store answered.

    Attributes:
        size: bytes read from the file and sent.
        digest: the caller's hash (the manifest's algorithm) of those bytes.
        expected_etag: the ETag S3 gives these bytes sent this way (`multipart_etag`); None
            when the store checked the body against its checksum instead (no MD5 computed).
        etag: the ETag the store returned for the object (None if it sent none).
        checked: the store accepted the body against the checksum sent with it (SHA-256 of
            a single PUT, CRC32 of each part), and it refuses a body that does not match.
    """

    size: int
    digest: str
    expected_etag: str | None
    etag: str | None
    checked: bool = False


def multipart_etag(parts: list[bytes]) -> str:
    """The ETag S3 gives an object completed from parts with these MD5 digests."""
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def _etag(reply: dict[str, Any]) -> str | None:
    value = reply.get("ETag")
    return str(value).strip('"') if value else None


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _crc32(data: bytes) -> str:
    """The `x-amz-checksum-crc32` value of `data` (ISA-L's CRC-32 where it is installed: the
    same numbers as botocore's zlib pass, a fifth of its CPU)."""
    return _b64(crc32_function()(data, 0).to_bytes(4, "big"))


_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")


class SignedPayloads:
    """The SHA-256 botocore signs for the body of a PUT, taken instead of hashing the body a
    second time.

    SigV4 can sign an S3 payload: botocore then hashes the body with SHA-256 and sends it as
    `X-Amz-Content-SHA256`, which S3 checks against the body. It always does over plain
    HTTP; over TLS a Content-MD5 makes it sign none (an unsigned payload). A single PUT's
    body is the whole file, so a signed hash is the digest a SHA-256 manifest records:
    hashing the bytes again for the manifest doubled the work.

    A `before-send` handler on the client (registered once, harmless to its other callers:
    it looks only at the PUTs announced with `expect`) notes the signed hash of each
    announced request, matched by its object key, body length and a checksum header's value;
    a request that carries none (an unsigned payload, a client made since) leaves the caller
    to hash the bytes itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (key, body length, header, its value) -> the signed SHA-256 once seen, else None
        self._wanted: dict[tuple[str, int, str, str], str | None] = {}

    def attach(self, client: Any) -> None:
        """Listen on `client` (botocore's, or aiobotocore's) for the PUTs it sends, and leave
        the bodies a checksum header protects over TLS unsigned (`leave_checked_unsigned`)."""
        client.meta.events.register(
            "before-send.s3.PutObject", self._seen, unique_id=f"ckpt-signed-payloads-{id(self)}"
        )
        for operation in ("PutObject", "UploadPart"):
            client.meta.events.register(
                f"before-sign.s3.{operation}",
                leave_checked_unsigned,
                unique_id=f"ckpt-unsigned-{operation}",
            )

    def expect(self, key: str, length: int, header: str, value: str) -> None:
        """Announce a PUT of `length` bytes to `key` sent with this checksum header."""
        with self._lock:
            self._wanted[(key, length, header, value)] = None

    def take(self, key: str, length: int, header: str, value: str) -> str | None:
        """The hex SHA-256 botocore signed for that PUT, or None where it signed none."""
        with self._lock:
            return self._wanted.pop((key, length, header, value), None)

    def _seen(self, request: Any, **_: Any) -> None:
        headers = request.headers
        signed = _text(headers.get("X-Amz-Content-SHA256"))
        length = _text(headers.get("Content-Length"))
        if signed is None or not _HEX_SHA256.fullmatch(signed):
            return  # an unsigned or streamed payload: the caller hashes the bytes
        if length is None or not length.isdigit():
            return
        path = unquote(urlsplit(request.url).path)
        with self._lock:
            for wanted in self._wanted:
                key, size, header, value = wanted
                if (
                    size == int(length)
                    and _text(headers.get(header)) == value
                    and path.endswith(f"/{key}")
                ):
                    self._wanted[wanted] = signed
                    return


def leave_checked_unsigned(request: Any, **_: Any) -> None:
    """botocore's own rule for a body's signature, completed: over TLS, a body sent with a
    checksum header that the store checks goes as an unsigned payload (`UNSIGNED-PAYLOAD`),
    since TLS and the checksum already protect it. botocore applies the rule to Content-MD5
    and to the checksums it computes itself, but not to an `x-amz-checksum-*` its caller
    sets, as ckpt does (the SHA-256 a manifest records, a part's CRC32): it then hashed each
    such body once more with SHA-256 to sign it, a whole pass over every byte uploaded to S3.
    A user's own `payload_signing_enabled` setting stands; plain HTTP is always signed."""
    if not str(request.url).startswith("https:"):
        return
    if not any(str(name).lower().startswith("x-amz-checksum-") for name in request.headers):
        return
    config = request.context.get("client_config")
    if config is None or "payload_signing_enabled" in (config.s3 or {}):
        return
    request.context["client_config"] = _payload_unsigned(config)


@functools.lru_cache(maxsize=8)
def _payload_unsigned(config: Any) -> Any:
    """`config` with payloads left unsigned (one per client configuration)."""
    from botocore.config import Config

    return config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))


def _text(value: str | bytes | None) -> str | None:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def read_for_upload(src: Any, size: int) -> bytes:
    """Up to `size` bytes of the local file being uploaded. An OS error there (a bad sector)
    is that file's, not the store's: an `IOFailure` (exit 74) naming it."""
    try:
        data: bytes = src.read(size)
    except OSError as exc:
        raise io_failure(naming(exc, src.name), doing="reading it to upload") from None
    return data


class ObjectUploader:
    """Uploads files through one s3fs filesystem (`fs`: what `Storage.s3_filesystem()` gives),
    with S3's own requests.

    `jobs` parts of multipart uploads are sent at once (their own pool, so a reader waiting
    for its parts never holds a thread a part needs). `take(n)` is called for every block
    about to be sent (the caller's rate limit). `probe` names a key (in the destination) the
    first upload may write once, with a wrong checksum, to learn whether the store checks
    checksums (`checks_checksums`); without it every body is checked by MD5 and ETag.
    """

    def __init__(
        self,
        fs: Any,
        jobs: int,
        take: Callable[[int], None] | None = None,
        probe: str | None = None,
    ):
        self.fs = fs
        self.jobs = max(1, jobs)
        self._take = take
        #: bytes read and not yet sent, at most (a single PUT of a larger file waits for all)
        self.budget = 2 * self.jobs * UPLOAD_BLOCK
        self._held = 0
        self._room = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._probe = probe
        self._checks: bool | None = None
        self._probe_lock = threading.Lock()
        #: the removal of a probe object the store kept (`close` waits for it)
        self._forget: threading.Thread | None = None
        #: the question asked ahead of the first upload (`ask_early`; `close` waits for it)
        self._asking: threading.Thread | None = None
        self._default_crc32: bool | None = None
        #: the SHA-256 botocore signs for a PUT's body (plain HTTP), by request
        self._signed = SignedPayloads()
        self._listening: Any = None
        #: multipart uploads begun and not yet completed or aborted: upload id -> (bucket, key)
        self._open: dict[str, tuple[str, str]] = {}
        #: closed after a signal: an upload thread still running begins no multipart upload
        self._closed = False

    def ask_early(self) -> None:
        """Ask the checksum question now, in the background (once): the first uploads read
        and hash their bytes while the store answers, and wait only where the answer
        decides what they send."""
        with self._lock:
            if self._asking is not None or self._probe is None:
                return
            self._asking = threading.Thread(target=self._ask_quietly, name="ckpt-probe")
        self._asking.start()

    def _ask_quietly(self) -> None:
        # a failure to ask (no answer at all) leaves the question open: the upload that
        # asks next asks again and raises it, naming its file
        with contextlib.suppress(Exception):
            self.checks_checksums()

    def checks_checksums(self) -> bool:
        """Whether the store refuses a body whose `x-amz-checksum-crc32` does not match it
        (asked once: a tiny PUT to the `probe` key with a wrong CRC32; one the store keeps
        is deleted again)."""
        with self._probe_lock:
            if self._checks is None:
                self._checks = self._ask_store()
            return self._checks

    def _ask_store(self) -> bool:
        if self._probe is None:
            return False
        bucket, key, _ = self.fs.split_path(self._probe)
        body = b"ckpt: does this store check x-amz-checksum-crc32?"
        # botocore retries a BadDigest four times, seconds apart: the question is asked once,
        # through a client of the same settings (and session: its models are loaded) that
        # does not retry
        options = dict(self.fs.storage_options)
        config = {**(options.get("config_kwargs") or {}), "retries": _NO_RETRY}
        once = type(self.fs)(
            **{
                **options,
                "config_kwargs": config,
                "session": self.fs.session,
                "skip_instance_cache": True,
            }
        )
        try:
            once.call_s3(
                "put_object", Bucket=bucket, Key=key, Body=body, ChecksumCRC32=_crc32(body + b"!")
            )
        except Exception as exc:  # refused: by its checksum, or for another reason (MD5 then)
            return refusal_code(exc) in CHECKSUM_REFUSALS
        # stored although its checksum is wrong: this store checks nothing of the kind; the
        # uploads waiting for the answer need not also wait for the probe object's removal
        self._forget = threading.Thread(
            target=self._forget_probe, args=(bucket, key), name="ckpt-probe-removal"
        )
        self._forget.start()
        return False

    def _forget_probe(self, bucket: str, key: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key)
        self.fs.invalidate_cache(self._probe)

    def list_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under `prefix` (a folder-like path, `bucket/run`), by path, with its
        `size`, `ETag` and `LastModified`: one ListObjectsV2 request per 1,000 objects (s3fs's
        `find` asks a HEAD and a second listing after a prefix that holds nothing, as a first
        sync's does).

        Raises what the filesystem raises (FileNotFoundError for a missing bucket).
        """
        bucket, key, _ = self.fs.split_path(prefix)
        found: dict[str, dict[str, Any]] = {}
        more: dict[str, str] = {}
        while True:
            page = self.fs.call_s3(
                "list_objects_v2",
                Bucket=bucket,
                Prefix=f"{key.rstrip('/')}/",
                **self.fs.req_kw,  # RequestPayer, as s3fs's own listings send it
                **more,
            )
            for item in page.get("Contents", []):
                if str(item["Key"]).endswith("/"):
                    continue  # a folder placeholder some tools write, not a file
                found[f"{bucket}/{item['Key']}"] = {
                    "type": "file",
                    "size": int(item.get("Size") or 0),
                    "ETag": item.get("ETag"),
                    "LastModified": item.get("LastModified"),
                }
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found
            more = {"ContinuationToken": str(token)}

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
        """Wait for parts still in flight (none once every upload has returned) and for the
        probe object's removal; abort the multipart uploads still open.

        Those are the uploads of a command stopped by a signal: its threads inside a request
        are not waited for (`close_pool`), and the process ends before they could abort their
        uploads themselves, which would stay in the bucket, billed and unlisted."""
        with self._lock:
            pool, self._pool = self._pool, None
            # after a signal, an upload thread still running is given up on (`close_pool`);
            # otherwise this uploader may still send (a root file after the checkpoints)
            self._closed = faults.received is not None
        if pool is not None:
            close_pool(pool)
        with self._lock:
            left, self._open = self._open, {}
        for upload_id, (bucket, key) in left.items():
            self._abort(bucket, key, upload_id)
        if self._asking is not None:
            self._asking.join()
        if self._forget is not None:
            self._forget.join()

    def _parts_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="ckpt-part")
            return self._pool

    def upload(
        self,
        path: Path,
        target: str,
        size: int,
        new: Callable[[], Any],
        *,
        sha256: bool = False,
    ) -> UploadedFile:
        """Send `path` (of `size` bytes) to `target`, hashing it with `new()` on the way
        (`sha256`: `new` is SHA-256, whose digest is then the checksum of a single PUT).

        Raises what the filesystem raises (the caller names the file); a multipart upload
        that fails is aborted, so no part of it lingers in the bucket.
        """
        bucket, key, _ = self.fs.split_path(target)
        hasher = new()
        with open(path, "rb") as src:
            if size >= SINGLE_PUT_MAX:
                return self._multipart(src, bucket, key, target, hasher, self.checks_checksums())
            held = self._reserve(size)
            try:
                data = read_for_upload(src, size)  # one that grew since is caught by its stamp
                return self._put(data, target, hasher, sha256=sha256)
            finally:
                self._release(held)

    def upload_bytes(
        self, data: bytes, target: str, new: Callable[[], Any], *, sha256: bool = False
    ) -> UploadedFile:
        """Send `data` (a small file: a manifest, a pointer) to `target` in one PUT, hashed
        with `new()` and checked as `upload` checks a file."""
        return self._put(data, target, new(), sha256=sha256)

    def _put(self, data: bytes, target: str, hasher: Any, *, sha256: bool) -> UploadedFile:
        """One PUT of `data`, with the checksum the store checks, or its Content-MD5."""
        bucket, key, _ = self.fs.split_path(target)
        self._listen()
        if sha256 and (self._checks is False or self._signs_payloads()):
            # the SHA-256 comes from the request's signature (or is hashed after it); else
            # (TLS, unsigned) it is hashed here while the store's answer is awaited, and sent
            return self._put_hashed_by_signature(data, target, hasher, self.checks_checksums())
        hasher.update(data)
        # asked once the bytes are hashed: the answer, on its way since `ask_early`, decides
        # only whether an MD5 is computed too
        checks = self.checks_checksums()
        sent: dict[str, str] = {}
        if sha256:
            # the manifest's digest, already computed: also what botocore would otherwise
            # spend a CRC32 pass of its own on
            sent["ChecksumSHA256"] = _b64(bytes.fromhex(hasher.hexdigest()))
        elif checks or self.crc32_by_default():
            sent["ChecksumCRC32"] = _crc32(data)
        md5 = None if checks else hashlib.md5(data).digest()
        if md5 is not None:
            sent["ContentMD5"] = _b64(md5)
        self._pace(len(data))
        reply = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **sent)
        self.fs.invalidate_cache(target)
        _same_checksums(sent, reply, target)
        return UploadedFile(
            len(data),
            hasher.hexdigest(),
            None if md5 is None else md5.hex(),
            _etag(reply),
            checked=checks,
        )

    def _put_hashed_by_signature(
        self, data: bytes, target: str, hasher: Any, checks: bool
    ) -> UploadedFile:
        """One PUT of `data` for a SHA-256 manifest whose digest is taken from the request's
        signature where botocore signs the payload (plain HTTP: `SignedPayloads`), hashed
        here only where it signs none. To a store that checks checksums it goes with its
        CRC32 (ISA-L's: a fraction of a SHA-256 pass), which the store checks; to one that
        checks none, with its Content-MD5, which the reply's ETag must be. (Over TLS a store
        that checks checksums gets the SHA-256 itself in `x-amz-checksum-sha256`, which it
        keeps as the object's checksum, and the payload goes unsigned: `_put`.)"""
        bucket, key, _ = self.fs.split_path(target)
        md5 = None if checks else hashlib.md5(data).digest()
        sent: dict[str, str] = {}
        if md5 is not None:
            sent["ContentMD5"] = _b64(md5)
        if checks or self.crc32_by_default():
            # a store that checks nothing: else botocore adds a CRC32 of its own, with zlib's
            # slower pass
            sent["ChecksumCRC32"] = _crc32(data)
        header, value = (
            ("Content-MD5", sent["ContentMD5"])
            if md5
            else (
                "x-amz-checksum-crc32",
                sent["ChecksumCRC32"],
            )
        )
        self._signed.expect(key, len(data), header, value)
        self._pace(len(data))
        try:
            reply = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **sent)
        finally:
            signed = self._signed.take(key, len(data), header, value)
        self.fs.invalidate_cache(target)
        _same_checksums(sent, reply, target)
        if signed is None:
            hasher.update(data)
            signed = hasher.hexdigest()
        return UploadedFile(
            len(data), signed, None if md5 is None else md5.hex(), _etag(reply), checked=checks
        )

    def _signs_payloads(self) -> bool:
        """Whether botocore signs each body's SHA-256: over plain HTTP, unless the user's
        `payload_signing_enabled` says otherwise (over TLS it signs none ckpt sends:
        `leave_checked_unsigned`)."""
        meta = self.fs.s3.meta  # s3fs's client (connected by then)
        chosen = (meta.config.s3 or {}).get("payload_signing_enabled")
        if chosen is not None:
            return bool(chosen)
        return not str(meta.endpoint_url).startswith("https:")

    def _listen(self) -> None:
        """`SignedPayloads` listens on s3fs's current client (once per client): every
        upload's request goes through it."""
        client = self.fs.s3
        with self._lock:
            if self._listening is not client:
                self._signed.attach(client)
                self._listening = client

    def crc32_by_default(self) -> bool:
        """Whether botocore adds a CRC32 of its own to a body sent without an
        `x-amz-checksum-*` (its default, `request_checksum_calculation = when_supported`;
        not where the user asked for `when_required`): the body then carries ours instead,
        the same value, from ISA-L's pass rather than zlib's."""
        if self._default_crc32 is None:
            config = self.fs.s3.meta.config  # s3fs's client (connected by then)
            # botocore before 1.36 has no such setting, and adds no checksum of its own
            calculation = getattr(config, "request_checksum_calculation", None)
            self._default_crc32 = calculation == "when_supported"
        return self._default_crc32

    def _pace(self, amount: int) -> None:
        """The rate limit, before the bytes go: a burst of jobs never outruns it."""
        if self._take is not None:
            self._take(amount)

    def _multipart(
        self, src: Any, bucket: str, key: str, target: str, hasher: Any, checks: bool
    ) -> UploadedFile:
        extra = {"ChecksumAlgorithm": "CRC32"} if checks else {}
        self._listen()
        mpu = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key, **extra)
        upload_id = mpu["UploadId"]
        with self._lock:
            closed = self._closed
            if not closed:
                self._open[upload_id] = (bucket, key)
        if closed:  # begun as `close` (a signal) gave up on this thread: it is ours to abort
            self._abort(bucket, key, upload_id)
            raise OSError(errno.ECANCELED, "the upload was stopped", target)
        crc_anyway = self.crc32_by_default()
        futures: list[Future[dict[str, Any]]] = []
        parts: list[bytes] = []
        crcs: list[str] = []
        size = 0
        try:
            while True:
                held = self._reserve(UPLOAD_BLOCK)
                try:
                    block = read_for_upload(src, UPLOAD_BLOCK)
                    if not block:
                        self._release(held)
                        break
                    hasher.update(block)
                    check = (
                        {"ChecksumCRC32": _crc32(block)}
                        if checks
                        else {"ContentMD5": _b64(hashlib.md5(block).digest())}
                    )
                    if not checks and crc_anyway:
                        check["ChecksumCRC32"] = _crc32(block)
                    future = submit_tracked(
                        self._parts_pool(),
                        self._part,
                        bucket,
                        key,
                        upload_id,
                        len(futures) + 1,
                        block,
                        check,
                    )
                except BaseException:
                    self._release(held)
                    raise
                future.add_done_callback(functools.partial(self._part_done, held))
                if checks:
                    crcs.append(check["ChecksumCRC32"])
                else:
                    parts.append(base64.b64decode(check["ContentMD5"]))
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
                        {"PartNumber": n, "ETag": r["ETag"], **({"ChecksumCRC32": c} if c else {})}
                        for n, (r, c) in enumerate(
                            zip(replies, crcs or [""] * len(replies), strict=True), 1
                        )
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
            self._abort(bucket, key, upload_id)
            raise
        finally:
            with self._lock:
                self._open.pop(upload_id, None)
        self.fs.invalidate_cache(target)
        return UploadedFile(
            size,
            hasher.hexdigest(),
            None if checks else multipart_etag(parts),
            _etag(done),
            checked=checks,
        )

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        """Abort one multipart upload; a failure to is not reported (the failure that led
        here is the one to report, and the next sync to DEST aborts what a dead run left)."""
        with contextlib.suppress(Exception):
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)

    def _part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        block: bytes,
        check: dict[str, str],
    ) -> dict[str, Any]:
        self._pace(len(block))
        reply: dict[str, Any] = self.fs.call_s3(
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=block,
            **check,
        )
        _same_checksums(check, reply, f"{key} part {number}")
        return reply


def _same_checksums(sent: dict[str, str], reply: dict[str, Any], target: str) -> None:
    """A checksum the store echoes in its reply is the one sent (one it omits proves nothing
    either way: the ETag or the store's own refusal is the check)."""
    for name, value in sent.items():
        if name.startswith("Checksum") and reply.get(name) not in (None, value):
            raise OSError(f"{target}: the store recorded {name} {reply.get(name)}, not {value}")
