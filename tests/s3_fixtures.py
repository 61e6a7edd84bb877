"""A real S3-compatible server (moto's server mode) on 127.0.0.1, with a request log.

The server is moto's WSGI application served by werkzeug in a thread; a small middleware
records every request's method, path and Range header, so tests can prove that metadata
commands made ranged reads only, and can refuse chosen requests (`S3Server.refuse`) the way a
store refuses a write it is not allowed (403 AccessDenied), to test failures mid-upload.

moto stores a body whatever its `Content-MD5` or `x-amz-checksum-*` says (checked: moto 5.2);
`S3Server.checks_checksums` makes the server refuse a body that does not match its
`x-amz-checksum-crc32` / `-sha256` with 400 BadDigest, as S3 does, and `S3Server.corrupt`
flips a byte of chosen request bodies on their way in (a link or proxy that damages data).
"""

from __future__ import annotations

import base64
import hashlib
import io
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# fsspec reads the FSSPEC_<PROTOCOL>_<OPTION> variables into its config once, when it is first
# imported: first imported in a test that points S3 at a dead endpoint (FSSPEC_S3_ENDPOINT_URL),
# every later test of the worker would talk to that endpoint, its own server's variables
# unread. Imported here, before any test sets them, its config is the clean environment's.
import fsspec  # noqa: F401
import pytest


@dataclass
class S3Request:
    """One request the server answered."""

    method: str
    path: str
    range: str | None
    #: bytes of the request body (what an upload sent)
    length: int = 0
    #: the query string (`partNumber=2&uploadId=…` for a multipart upload's part)
    query: str = ""
    #: integrity headers sent with the body, name (lowercase) -> value: `content-md5`,
    #: `x-amz-checksum-crc32`, `x-amz-checksum-sha256`…
    checksums: dict[str, str] = field(default_factory=dict)
    #: `x-amz-content-sha256`: the body's SHA-256 that the request's signature covers (a
    #: signed payload), or `UNSIGNED-PAYLOAD` / a streaming mode
    content_sha256: str | None = None


@dataclass
class S3Server:
    """A running server: its endpoint and what it was asked."""

    endpoint: str
    requests: list[S3Request] = field(default_factory=list)
    #: requests for which this returns True are answered 403 AccessDenied
    refuse: Callable[[S3Request], bool] | None = None
    #: requests for which this returns True are held, unanswered, until `release` is set
    #: (a slow link: the test decides when, no timing assumed)
    hold: Callable[[S3Request], bool] | None = None
    release: threading.Event = field(default_factory=threading.Event)
    #: seconds every request waits before it is answered (a far-away store; for a real link,
    #: handshakes included, put `tests/latency_proxy.py` in front)
    latency: float = 0.0
    #: refuse a body that does not match its x-amz-checksum-crc32/-sha256 (400 BadDigest), as
    #: S3 does; moto itself checks neither those nor Content-MD5
    checks_checksums: bool = False
    #: requests for which this returns True have their body's first byte flipped on the way in
    corrupt: Callable[[S3Request], bool] | None = None
    #: the most requests being answered at once so far (a client's concurrency)
    max_in_flight: int = 0
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self) -> None:
        """Count one request as being answered."""
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

    def leave(self) -> None:
        """Count one request as answered."""
        with self._lock:
            self._in_flight -= 1

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until no request is being answered (what a dead client sent has landed)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._in_flight == 0:
                    return
            assert time.monotonic() < deadline, "the server is still answering requests"
            time.sleep(0.02)

    def bytes_uploaded(self) -> int:
        """Body bytes of every PUT and POST (object uploads, multipart parts)."""
        return sum(r.length for r in self.requests if r.method in ("PUT", "POST"))

    def object_gets(self, key_suffix: str) -> list[S3Request]:
        """GET requests for objects whose path ends with `key_suffix`."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(key_suffix)]


def _matches(checksums: dict[str, str], signed: str | None, body: bytes) -> bool:
    """Whether the body has the CRC32 / SHA-256 its request headers say (those present), and
    the SHA-256 its signature covers where the payload is signed."""
    if signed is not None and len(signed) == 64 and signed != hashlib.sha256(body).hexdigest():
        return False
    crc32 = checksums.get("x-amz-checksum-crc32")
    if (
        crc32 is not None
        and crc32 != base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    ):
        return False
    sha256 = checksums.get("x-amz-checksum-sha256")
    return sha256 is None or sha256 == base64.b64encode(hashlib.sha256(body).digest()).decode()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port and point AWS clients at it."""
    yield from _serve(monkeypatch, None)


@pytest.fixture
def s3_tls_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3Server]:
    """The same server over HTTPS (as S3 itself is reached): a self-signed certificate for
    127.0.0.1, which AWS clients trust through `AWS_CA_BUNDLE`."""
    yield from _serve(monkeypatch, _self_signed(tmp_path / "tls"))


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1 (cryptography: moto's own dependency)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _serve(monkeypatch: pytest.MonkeyPatch, tls: tuple[Path, Path] | None) -> Iterator[S3Server]:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    port = _free_port()
    scheme = "http" if tls is None else "https"
    server = S3Server(endpoint=f"{scheme}://127.0.0.1:{port}")
    moto_app = DomainDispatcherApplication(create_backend_app)

    def logged(environ: dict[str, Any], start_response: Any) -> Any:
        request = S3Request(
            environ["REQUEST_METHOD"],
            environ.get("PATH_INFO", ""),
            environ.get("HTTP_RANGE"),
            int(environ.get("CONTENT_LENGTH") or 0),
            environ.get("QUERY_STRING", ""),
            {
                key[5:].lower().replace("_", "-"): value
                for key, value in environ.items()
                if key in ("HTTP_CONTENT_MD5",) or key.startswith("HTTP_X_AMZ_CHECKSUM_")
            },
            environ.get("HTTP_X_AMZ_CONTENT_SHA256"),
        )
        server.requests.append(request)
        server.enter()
        try:
            if server.latency:
                time.sleep(server.latency)
            if server.hold is not None and server.hold(request):
                assert server.release.wait(timeout=120), "a held request was never released"
            if server.refuse is not None and server.refuse(request):
                start_response("403 Forbidden", [("Content-Type", "application/xml")])
                return [
                    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                    b"<Message>Access Denied</Message></Error>"
                ]
            # a streamed body (aws-chunked, its CRC32 in a trailer: botocore's own default
            # over TLS, as boto3's helpers here send) is left whole to moto
            streamed = "aws-chunked" in environ.get("HTTP_CONTENT_ENCODING", "")
            if (server.checks_checksums or server.corrupt is not None) and not streamed:
                body = environ["wsgi.input"].read(request.length) if request.length else b""
                if body and server.corrupt is not None and server.corrupt(request):
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                environ["wsgi.input"] = io.BytesIO(body)
                if server.checks_checksums and not _matches(
                    request.checksums, request.content_sha256, body
                ):
                    start_response("400 Bad Request", [("Content-Type", "application/xml")])
                    return [
                        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>BadDigest</Code>"
                        b"<Message>The checksum you specified did not match the calculated "
                        b"checksum.</Message></Error>"
                    ]
            return moto_app(environ, start_response)
        finally:
            server.leave()

    import s3fs

    # fsspec caches filesystem instances; a cached one would still talk to an old server
    s3fs.S3FileSystem.clear_instance_cache()
    context = None
    if tls is not None:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
    httpd = make_server("127.0.0.1", port, logged, threaded=True, ssl_context=context)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    # moto keeps its buckets in module-level state: start every test with an empty store
    import urllib.request

    trusted = None
    if tls is not None:
        import ssl

        trusted = ssl.create_default_context(cafile=str(tls[0]))
    # moto imports its backends on the first request: seconds, more on a loaded machine (a
    # 10 s limit here timed out once in the fast loop at load 4)
    urllib.request.urlopen(
        urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"),
        timeout=120,
        context=trusted,
    ).close()
    server.requests.clear()
    for key, value in {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": server.endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    if tls is not None:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tls[0]))
    try:
        yield server
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        httpd.shutdown()
        thread.join(timeout=5)


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create the bucket unless it exists."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)


def upload_folder(endpoint: str, bucket: str, prefix: str, folder: Any) -> None:
    """Upload every file under `folder` to s3://bucket/prefix/ with boto3."""
    import boto3

    make_bucket(endpoint, bucket)
    client = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


def fetch_prefix(endpoint: str, bucket: str, prefix: str, folder: Any) -> list[str]:
    """Download every object under s3://bucket/prefix/ into `folder`; returns the keys' names."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    names = []
    listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    for item in listing.get("Contents", []):
        rel = item["Key"][len(prefix) + 1 :]
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, item["Key"], str(target))
        names.append(rel)
    return sorted(names)


def list_keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    """Every key in the bucket under `prefix`."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listing.get("Contents", []))


def fetch_object(endpoint: str, bucket: str, key: str) -> bytes:
    """One object's bytes."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return body
