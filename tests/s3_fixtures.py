"""A real S3-compatible server (moto's server mode) on 127.0.0.1, with a request log.

The server is moto's WSGI application served by werkzeug in a thread; a small middleware
records every request's method, path and Range header, so tests can prove that metadata
commands made ranged reads only, and can refuse chosen requests (`S3Server.refuse`) the way a
store refuses a write it is not allowed (403 AccessDenied), to test failures mid-upload.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class S3Server:
    """A running server: its endpoint and what it was asked."""

    endpoint: str
    requests: list[S3Request] = field(default_factory=list)
    #: requests for which this returns True are answered 403 AccessDenied
    refuse: Callable[[S3Request], bool] | None = None
    #: requests for which this returns True are answered one second late (a slow link)
    slow: Callable[[S3Request], bool] | None = None
    #: seconds every request waits before it is answered (a far-away store; for a real link,
    #: handshakes included, put `tests/latency_proxy.py` in front)
    latency: float = 0.0
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

    def bytes_uploaded(self) -> int:
        """Body bytes of every PUT and POST (object uploads, multipart parts)."""
        return sum(r.length for r in self.requests if r.method in ("PUT", "POST"))

    def object_gets(self, key_suffix: str) -> list[S3Request]:
        """GET requests for objects whose path ends with `key_suffix`."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(key_suffix)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port and point AWS clients at it."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    port = _free_port()
    server = S3Server(endpoint=f"http://127.0.0.1:{port}")
    moto_app = DomainDispatcherApplication(create_backend_app)

    def logged(environ: dict[str, Any], start_response: Any) -> Any:
        request = S3Request(
            environ["REQUEST_METHOD"],
            environ.get("PATH_INFO", ""),
            environ.get("HTTP_RANGE"),
            int(environ.get("CONTENT_LENGTH") or 0),
            environ.get("QUERY_STRING", ""),
        )
        server.requests.append(request)
        server.enter()
        try:
            if server.latency:
                time.sleep(server.latency)
            if server.slow is not None and server.slow(request):
                time.sleep(1.0)
            if server.refuse is not None and server.refuse(request):
                start_response("403 Forbidden", [("Content-Type", "application/xml")])
                return [
                    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                    b"<Message>Access Denied</Message></Error>"
                ]
            return moto_app(environ, start_response)
        finally:
            server.leave()

    import s3fs

    # fsspec caches filesystem instances; a cached one would still talk to an old server
    s3fs.S3FileSystem.clear_instance_cache()
    httpd = make_server("127.0.0.1", port, logged, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    # moto keeps its buckets in module-level state: start every test with an empty store
    import urllib.request

    urllib.request.urlopen(
        urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"), timeout=10
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
