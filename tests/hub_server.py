"""A small Hugging Face Hub on 127.0.0.1 for tests: real HTTP, the endpoints huggingface_hub calls.

`TestHub` serves repositories built by the tests (from a local folder of real files) on a free
port in a background thread:

* `GET /api/{models,datasets}/{repo}[/revision/{rev}][?blobs=true]`: repo info, `sha` = the
  resolved commit, `siblings` the files (with `blobs=true`: with sizes, blob ids and LFS info);
* `GET /api/{type}s/{repo}/tree/{rev}[/{path}]?recursive=`: the file listing with sizes and, for
  LFS files, `lfs.oid` (sha256) and `lfs.size`;
* `GET /api/agent-harnesses`: an empty registry (huggingface_hub fetches it once a day);
* `HEAD`/`GET /[datasets/]{repo}/resolve/{rev}/{path}`: file bytes with `ETag`, `X-Repo-Commit`,
  `Content-Length`, `Accept-Ranges`, and `X-Linked-Etag`/`X-Linked-Size` for LFS files; `Range`
  requests get `206` with `Content-Range`.

Nothing advertises Xet (no `X-Xet-Hash`, no `xetHash`), so huggingface_hub uses plain HTTP.
Errors carry the `X-Error-Code` headers the real Hub sends (`RepoNotFound`, `RevisionNotFound`,
`EntryNotFound`, `GatedRepo`), so huggingface_hub raises its real exception classes.

Every request is logged (`TestHub.log`), the body bytes sent are counted per file
(`TestHub.bytes_sent`), the most requests answered at once is kept (`TestHub.max_in_flight`),
each request can be made to wait (`TestHub.latency`), one file's bytes held back until a test lets them
go (`hold`), and faults can be injected: `drop_after` (close the connection after N
body bytes of a file, once), `fail` (answer a status for a path, N times), `reset` (reset the
connection, no answer at all, for a path, N times).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

#: files stored in LFS on the Hub (by suffix; the Hub also uses LFS for anything >10 MB)
LFS_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".distcp",
    ".gguf",
    ".h5",
    ".msgpack",
)


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's content (what the Hub reports as `oid` for non-LFS files)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass
class HubFile:
    """One file of a served repository."""

    path: str
    data: bytes
    lfs: bool

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def etag(self) -> str:
        return self.sha256 if self.lfs else git_blob_id(self.data)


@dataclass
class HubRepo:
    """A served repository: files per commit, refs (branches/tags) naming commits."""

    repo_id: str
    repo_type: str = "model"
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    #: gated: only requests with `Authorization: Bearer <token>` get through
    token: str | None = None

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        if revision in self.commits:
            return revision
        return None


@dataclass
class LoggedRequest:
    """One request as the server saw it."""

    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0
    file: str | None = None
    authorization: str | None = None


class TestHub:
    """The test Hub. Use through the `hub` fixture (see `tests/hub_fixtures.py`).

    Attributes:
        url: the endpoint (`http://127.0.0.1:PORT`), what `HF_ENDPOINT` is set to.
        repos: served repositories by `type/org/name`.
        log: every request, in order.
    """

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self._log: list[LoggedRequest] = []
        #: requests being answered: a client may hold its whole response (and the test go on)
        #: before the handler thread has logged it, so the log and the counters are read only
        #: once every request begun is logged
        self._answering = 0
        #: the most requests answered at once so far (a client's concurrency)
        self.max_in_flight = 0
        self._idle = threading.Condition()
        #: LFS files answer `resolve` with a 302 to a CDN URL on another host name, as the Hub does
        self.lfs_redirect = True
        #: tokens the Hub no longer accepts (expired, revoked): a request sending one is
        #: answered 401 "Invalid credentials in Authorization header", whatever it asks for
        self.revoked_tokens: set[str] = set()
        #: repo info honours `blobs=true` (files with sizes), as the Hub does; False: a mirror
        #: that lists the names alone
        self.info_blobs = True
        #: seconds each request waits before it is answered: a round trip to a far-away server,
        #: paid by every request (a redirect's too), whether its connection is new or kept
        #: alive; opening a connection costs nothing more (`tests/latency_proxy.py` charges that)
        self.latency = 0.0
        self._sent: Counter[tuple[str, str]] = Counter()
        self._drops: dict[tuple[str, str], int] = {}
        self._fails: list[list[object]] = []
        self._resets: list[list[object]] = []
        self._corrupt: dict[tuple[str, str], list[object]] = {}
        self._holds: dict[tuple[str, str], threading.Event] = {}
        self._hold_most = 30.0
        #: the held GETs answered because `hold`'s time ran out, not because its event was set
        self.held_too_long: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> TestHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- building repositories -------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        folder: Path | dict[str, bytes],
        *,
        revision: str = "main",
        repo_type: str = "model",
        token: str | None = None,
        tags: tuple[str, ...] = (),
    ) -> str:
        """Publish the files of `folder` (recursively) as a new commit on branch `revision`.

        Returns the commit id (40 hex). Adding to an existing repo adds a commit (the branch
        moves); `token` makes the repository gated (401 without it).
        """
        if isinstance(folder, dict):
            items = sorted(folder.items())
        else:
            items = sorted(
                (p.relative_to(folder).as_posix(), p.read_bytes())
                for p in folder.rglob("*")
                if p.is_file()
            )
        files = {
            rel: HubFile(rel, data, lfs=rel.endswith(LFS_SUFFIXES) or len(data) > 10 << 20)
            for rel, data in items
        }
        files.setdefault(
            ".gitattributes",
            HubFile(
                ".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False
            ),
        )
        key = f"{repo_type}/{repo_id}"
        repo = self.repos.setdefault(key, HubRepo(repo_id=repo_id, repo_type=repo_type))
        digest = hashlib.sha1()
        digest.update(str(len(repo.commits)).encode())
        for rel, f in sorted(files.items()):
            digest.update(rel.encode() + b"\0" + f.etag.encode())
        commit = digest.hexdigest()
        repo.commits[commit] = files
        repo.refs[revision] = commit
        for tag in tags:
            repo.refs[tag] = commit
        if token is not None:
            repo.token = token
        return commit

    # -- faults --------------------------------------------------------------------------------

    def drop_after(self, repo_id: str, path: str, nbytes: int) -> None:
        """Close the connection after `nbytes` body bytes of the next longer GET of `path` (once)."""
        self._drops[(repo_id, path)] = nbytes

    def fail(
        self,
        pattern: str,
        status: int,
        times: int = 1,
        error_code: str | None = None,
        after: int = 0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer `status` to the next `times` requests whose URL path matches regex `pattern`.

        With `after`, the first `after` matching requests are served normally (a fault midway);
        `headers` go with each such answer (`Retry-After` with a 429 or 503).
        """
        self._fails.append([re.compile(pattern), status, times, error_code, after, headers or {}])

    def reset(self, pattern: str, times: int = 1) -> None:
        """Reset the connection (a TCP RST, no answer at all) of the next `times` requests whose
        URL path matches regex `pattern`: a connection reset by a peer or a proxy on the way."""
        self._resets.append([re.compile(pattern), times])

    def corrupt_ranges(self, repo_id: str, path: str, how: str, times: int = 1_000_000) -> None:
        """Answer the next `times` GETs of `path` (ranges past byte 0, or whole) wrongly.

        `how`: `flip` (right headers, one byte of the body inverted), `shift` (the bytes one
        further on, with an honest Content-Range saying so), `lie` (the bytes one further on
        under the Content-Range asked for), `short` (one byte fewer, Content-Length saying
        so), `whole` (ignore Range: a 200 with the whole file, which is legal HTTP), `part200`
        (a 200 with only the asked bytes). Ranges at byte 0 (headers) are served normally; a
        GET of the whole file gets only `flip`.
        """
        self._corrupt[(repo_id, path)] = [how, times]

    def hold(self, repo_id: str, path: str, most: float = 30.0) -> threading.Event:
        """Hold back every GET of `path`'s bytes until the returned event is set (a slow
        request: what a client does meanwhile shows whether it waits on that one), or for
        `most` seconds, so that a client that does wait is answered in the end."""
        gate = threading.Event()
        with self._lock:
            self._holds[(repo_id, path)] = gate
        self._hold_most = most
        return gate

    # -- observations --------------------------------------------------------------------------

    @property
    def log(self) -> list[LoggedRequest]:
        """Every request answered so far, in order (waits for those being answered)."""
        self._settle()
        return self._log

    def _settle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._answering == 0, timeout=30)

    def answering(self) -> Callable[[], None]:
        """Count one request as being answered; returns what to call once it is logged."""
        with self._idle:
            self._answering += 1
            self.max_in_flight = max(self.max_in_flight, self._answering)

        def done() -> None:
            with self._idle:
                self._answering -= 1
                self._idle.notify_all()

        return done

    def bytes_sent(self, repo_id: str, path: str | None = None) -> int:
        """Body bytes of file data sent for one file of `repo_id`, or for all its files."""
        self._settle()
        with self._lock:
            if path is not None:
                return self._sent[(repo_id, path)]
            return sum(n for (repo, _), n in self._sent.items() if repo == repo_id)

    def file_requests(self, repo_id: str, path: str | None = None) -> list[LoggedRequest]:
        """The logged `resolve` requests (HEAD and GET) for one file (or all files) of a repo."""
        prefix = f"{repo_id}:"
        return [
            r
            for r in self.log
            if r.file is not None
            and r.file.startswith(prefix)
            and (path is None or r.file == f"{repo_id}:{path}")
        ]

    def reset_counters(self) -> None:
        """Forget the log and byte counts (e.g. after a set-up step)."""
        self._settle()
        with self._lock:
            self._log.clear()
            self._sent.clear()
            self.max_in_flight = 0

    # -- used by the handler -------------------------------------------------------------------

    def _take_fault(self, path: str) -> tuple[int, str | None, dict[str, str]] | None:
        with self._lock:
            for fault in self._fails:
                pattern, status, times, code, after, headers = fault
                if times and pattern.search(path):  # type: ignore[attr-defined]
                    if after:
                        fault[4] = int(after) - 1  # type: ignore[call-overload]
                        continue
                    fault[2] = int(times) - 1  # type: ignore[call-overload]
                    return int(status), code, headers  # type: ignore[call-overload,return-value]
        return None

    def _take_reset(self, path: str) -> bool:
        with self._lock:
            for fault in self._resets:
                pattern, times = fault
                if times and pattern.search(path):  # type: ignore[attr-defined]
                    fault[1] = int(times) - 1  # type: ignore[call-overload]
                    return True
        return False

    def _take_drop(self, repo_id: str, path: str, length: int) -> int | None:
        """The armed drop for this file if this response is long enough to be cut (once)."""
        with self._lock:
            drop = self._drops.get((repo_id, path))
            if drop is None or drop >= length:
                return None
            del self._drops[(repo_id, path)]
            return drop

    def _take_corruption(self, repo_id: str, path: str) -> str | None:
        with self._lock:
            fault = self._corrupt.get((repo_id, path))
            if fault is None or not fault[1]:
                return None
            fault[1] = int(fault[1]) - 1  # type: ignore[call-overload]
            return str(fault[0])

    def _wait_if_held(self, repo_id: str, path: str) -> None:
        with self._lock:
            gate = self._holds.get((repo_id, path))
        if gate is not None and not gate.wait(self._hold_most):
            with self._lock:
                self.held_too_long.append((repo_id, path))

    def _count(self, repo_id: str, path: str, n: int) -> None:
        with self._lock:
            self._sent[(repo_id, path)] += n


_API = re.compile(
    r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
    r"(?:/(?P<kind>revision|tree)/(?P<rest>.*))?$"
)
_RESOLVE = re.compile(
    r"^/(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"
)
_CDN = re.compile(
    r"^/_cdn/(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/(?P<commit>[0-9a-f]{40})/(?P<path>.+)$"
)
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Server(ThreadingHTTPServer):
    # the default listen backlog of 5 drops the SYNs of a client opening 16 connections at
    # once, which then wait a second for the retransmit
    request_queue_size = 128


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: TestHub

    def log_message(self, format: str, *args: object) -> None:  # silence stderr
        pass

    def setup(self) -> None:
        super().setup()
        # headers and body go out in separate writes: without NODELAY, Nagle's algorithm and
        # delayed ACKs add 40 ms to every small response on loopback
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        done = self.server_hub.answering()
        try:
            self._handle(head=False)
        finally:
            done()

    def do_HEAD(self) -> None:
        done = self.server_hub.answering()
        try:
            self._handle(head=True)
        finally:
            done()

    # -- plumbing -----------------------------------------------------------------------------

    def _record(self, status: int, sent: int = 0, file: str | None = None) -> None:
        self.server_hub._log.append(
            LoggedRequest(
                method=self.command,
                path=self.path,
                range=self.headers.get("Range"),
                status=status,
                sent=sent,
                file=file,
                authorization=self.headers.get("Authorization"),
            )
        )

    def _error(
        self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None
    ) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._record(status)

    def _json(self, payload: object, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._record(200)

    def _repo(self, type_: str | None, repo_id: str) -> HubRepo | None:
        singular = {"models": "model", "datasets": "dataset", "spaces": "space", None: "model"}
        repo = self.server_hub.repos.get(f"{singular[type_]}/{repo_id}")
        if repo is None:
            # like the real Hub: without a token an unknown repository is a 401, so that
            # private repositories cannot be told from absent ones
            status = 404 if self.headers.get("Authorization") else 401
            self._error(status, "RepoNotFound", "Repository not found")
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(
                401,
                "GatedRepo",
                "Access to this model is restricted. You must have access to it and be authenticated.",
            )
            return None
        return repo

    def _handle(self, head: bool) -> None:
        if self.server_hub.latency:
            time.sleep(self.server_hub.latency)
        url = urlsplit(self.path)
        path = unquote(url.path)
        sent = self.headers.get("Authorization") or ""
        if sent.startswith("Bearer ") and sent[7:] in self.server_hub.revoked_tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return
        if self.server_hub._take_reset(path):
            # SO_LINGER 0: closing sends an RST, the client reads "connection reset by peer"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self._record(0)
            return
        fault = self.server_hub._take_fault(path)
        if fault is not None:
            status, code, headers = fault
            self._error(status, code, f"injected HTTP {status}", headers)
            return
        if url.path == "/_testhub/bytes_sent":  # counters, for a server run in another process
            with self.server_hub._lock:
                counts = {f"{r}:{p}": n for (r, p), n in self.server_hub._sent.items()}
            self._json(counts)
            return
        if url.path == "/api/agent-harnesses":
            # huggingface_hub asks for this registry before its first request and caches it
            # for a day in HF_HOME; a 404 would make it ask again in every process
            self._json({"standardEnvVars": [], "harnesses": {}})
            return
        if match := _API.match(url.path):
            self._api(match, parse_qs(url.query))
        elif match := _RESOLVE.match(url.path):
            self._resolve(match, head)
        elif match := _CDN.match(url.path):
            self._cdn(match, head)
        else:
            self._error(404, None, "Not Found")

    # -- endpoints ----------------------------------------------------------------------------

    def _api(self, match: re.Match[str], query: dict[str, list[str]]) -> None:
        repo = self._repo(match["type"], unquote(match["repo"]))
        if repo is None:
            return
        kind, rest = match["kind"], match["rest"]
        if kind is None or kind == "revision":
            revision = unquote(rest) if kind == "revision" and rest else "main"
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            files = repo.commits[commit]
            self._json(
                {
                    "_id": repo.repo_id,
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "sha": commit,
                    "private": False,
                    "gated": "manual" if repo.token else False,
                    "disabled": False,
                    "siblings": [
                        _sibling(
                            name, f, blobs=self.server_hub.info_blobs and _flag(query, "blobs")
                        )
                        for name, f in sorted(files.items())
                    ],
                }
            )
            return
        # tree: the revision is URL-quoted as one segment; the path may follow
        assert rest is not None
        revision_q, _, sub_q = rest.partition("/")
        revision, sub = unquote(revision_q), unquote(sub_q).strip("/")
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        files = repo.commits[commit]
        recursive = _flag(query, "recursive")
        prefix = f"{sub}/" if sub else ""
        if sub and not any(name.startswith(prefix) for name in files):
            self._error(404, "EntryNotFound", f"{sub} does not exist on {revision}")
            return
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for name, f in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            rel = name[len(prefix) :]
            parts = rel.split("/")
            if not recursive and len(parts) > 1:
                folders.add(prefix + parts[0])
                continue
            for depth in range(1, len(parts)):
                folders.add(prefix + "/".join(parts[:depth]))
            entry: dict[str, object] = {
                "type": "file",
                "path": name,
                "size": len(f.data),
                "oid": git_blob_id(f.data),
            }
            if f.lfs:
                entry["oid"] = git_blob_id(_lfs_pointer(f))
                entry["size"] = len(f.data)
                entry["lfs"] = {
                    "oid": f.sha256,
                    "size": len(f.data),
                    "pointerSize": len(_lfs_pointer(f)),
                }
            entries.append(entry)
        for folder in sorted(folders):
            entries.append({"type": "directory", "path": folder, "oid": "0" * 40})
        self._json(entries)

    def _resolve(self, match: re.Match[str], head: bool) -> None:
        repo = self._repo(match["type"], unquote(match["repo"]))
        if repo is None:
            return
        revision, rel = unquote(match["rev"]), unquote(match["path"])
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        f = repo.commits[commit].get(rel)
        key = f"{repo.repo_id}:{rel}"
        if f is None:
            self._error(404, "EntryNotFound", f"{rel} does not exist", {"X-Repo-Commit": commit})
            return
        if f.lfs and self.server_hub.lfs_redirect:
            # like the Hub: LFS files redirect to a CDN host with a signed URL; the metadata
            # huggingface_hub needs is on the redirect itself
            host = (
                "localhost"
                if urlsplit(self.server_hub.url).hostname == "127.0.0.1"
                else "127.0.0.1"
            )
            port = urlsplit(self.server_hub.url).port
            prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
            location = (
                f"http://{host}:{port}/_cdn/{prefix}{repo.repo_id}/{commit}/{quote(rel)}?sig=test"
            )
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.send_header("ETag", f'"{git_blob_id(_lfs_pointer(f))}"')
            self.send_header("X-Repo-Commit", commit)
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(len(f.data)))
            self.end_headers()
            self._record(302, file=key)
            return
        self._serve(repo, commit, rel, f, head)

    def _cdn(self, match: re.Match[str], head: bool) -> None:
        singular = {"datasets": "dataset", "spaces": "space", None: "model"}
        repo = self.server_hub.repos.get(f"{singular[match['type']]}/{unquote(match['repo'])}")
        commit, rel = match["commit"], unquote(match["path"])
        f = repo.commits.get(commit, {}).get(rel) if repo is not None else None
        if repo is None or f is None:
            self._error(404, None, "no such object")
            return
        self._serve(repo, commit, rel, f, head)

    def _serve(self, repo: HubRepo, commit: str, rel: str, f: HubFile, head: bool) -> None:
        key = f"{repo.repo_id}:{rel}"
        size = len(f.data)
        start, end = 0, size  # end exclusive
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            m = _RANGE.match(wanted.strip())
            if m is None or (not m[1] and not m[2]):
                self._error(416, None, f"bad range {wanted}")
                return
            if m[1]:
                start = int(m[1])
                end = min(size, int(m[2]) + 1) if m[2] else size
            else:  # suffix range: the last N bytes
                start = max(0, size - int(m[2]))
            if start >= size or end <= start:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self._record(416, file=key)
                return
            status = 206
        header_range = (start, end)
        body = f.data[start:end]
        # header reads (ranges at byte 0) are spared; a whole-file GET gets `flip` faults too
        how = (
            None
            if head or (wanted and start == 0)
            else self.server_hub._take_corruption(repo.repo_id, rel)
        )
        if not wanted and how != "flip":
            how = None
        if how == "flip":
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
        elif how == "shift":
            body = f.data[start + 1 : end + 1]
            header_range = (start + 1, start + 1 + len(body))
        elif how == "lie":  # the right length, the wrong bytes
            body = f.data[start + 1 : end + 1].ljust(end - start, b"\0")
        elif how == "short":
            body = body[:-1]
            header_range = (start, end - 1)
        elif how == "whole":
            status, body, header_range = 200, f.data, (0, size)
        elif how == "part200":
            status = 200
        start, end = header_range
        if not head:
            self.server_hub._wait_if_held(repo.repo_id, rel)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{f.etag}"')
        self.send_header("X-Repo-Commit", commit)
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if head:
            self._record(status, file=key)
            return
        drop = self.server_hub._take_drop(repo.repo_id, rel, len(body))
        if drop is not None:
            self.wfile.write(body[:drop])
            self.wfile.flush()
            self.server_hub._count(repo.repo_id, rel, drop)
            self._record(status, sent=drop, file=key)
            # an abrupt close mid-body: the client sees a truncated response
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        sent = 0
        view = memoryview(body)
        try:
            while sent < len(body):
                n = min(1 << 20, len(body) - sent)
                self.wfile.write(view[sent : sent + n])
                sent += n
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        self.server_hub._count(repo.repo_id, rel, sent)
        self._record(status, sent=sent, file=key)


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[0].lower() in ("1", "true")


def _sibling(name: str, f: HubFile, *, blobs: bool) -> dict[str, object]:
    """A file as repo info lists it: its name; with `blobs=true`, as the Hub does, also its
    size, git blob id and (LFS files) the LFS object's sha256 and size."""
    if not blobs:
        return {"rfilename": name}
    entry: dict[str, object] = {
        "rfilename": name,
        "size": len(f.data),
        "blobId": git_blob_id(_lfs_pointer(f) if f.lfs else f.data),
    }
    if f.lfs:
        entry["lfs"] = {
            "sha256": f.sha256,
            "size": len(f.data),
            "pointerSize": len(_lfs_pointer(f)),
        }
    return entry


def _lfs_pointer(f: HubFile) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{f.sha256}\nsize {len(f.data)}\n"
    ).encode()


def main(argv: list[str] | None = None) -> None:
    """Serve folders as repositories until interrupted (for benchmarks in another process).

    Usage: python -m tests.hub_server [--latency=SECONDS] ORG/NAME=FOLDER [...]; prints the
    endpoint URL on stdout.
    `GET /_testhub/bytes_sent` returns the per-file byte counters as JSON.
    """
    import sys

    hub = TestHub()
    args = list(argv if argv is not None else sys.argv[1:])
    if args and args[0].startswith("--latency="):
        hub.latency = float(args.pop(0).split("=", 1)[1])
    for spec in args:
        repo_id, _, folder = spec.partition("=")
        hub.add_repo(repo_id, Path(folder))
    hub.start()
    print(hub.url, flush=True)
    try:
        hub._thread.join()
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
