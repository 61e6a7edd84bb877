"""A Hugging Face Hub repository pinned to one commit: settings from the environment, the
revision resolved once (or from the local cache's `refs/` when offline), the file listing with
the Hub's recorded digests, and the Hub's errors as ckpt errors.

Settings are read from the environment when a location is opened, not when huggingface_hub was
imported, so a long-lived process (or a test) that changes `HF_ENDPOINT`/`HF_HOME` is honoured.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..errors import CkptError, HubError, NotFoundError, UsageError
from .base import RemoteFile
from .local import LocalStorage, read_cache_ref
from .relpath import safe_relpath
from .uri import Location

T = TypeVar("T")

#: bytes per read when hashing local files
HASH_BLOCK = 8 << 20
_TRUE = {"1", "true", "yes", "on"}
#: seconds a Hub request may wait on the server (`HubSettings.timeout`): huggingface_hub's own
DEFAULT_TIMEOUT = 10.0
#: answers with which a Hub request is asked again (a rate limit, a server's passing failure),
#: as huggingface_hub's own downloads ask again (`http_backoff`)
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: how many times a request is asked again after such an answer, at most
HUB_RETRIES = 5
#: seconds before the first new try without a `Retry-After`; twice as long each time after, up
#: to `RETRY_MAX_WAIT` (huggingface_hub's back-off: 1, 2, 4, 8, 8 s)
RETRY_BASE_WAIT = 1.0
RETRY_MAX_WAIT = 8.0
#: the longest `Retry-After` waited for: a server asking for more is reported at once (a
#: command never sits for as long as a server likes)
RETRY_AFTER_MAX = 60.0
#: a request whose connection breaks (reset, closed before or during the answer, no byte for
#: `HubSettings.timeout` seconds) is asked again this many times: file reads (resumed where
#: they stopped) and API calls (repo info, tree listings) alike
READ_RETRIES = 5
#: seconds before the first new try after a broken connection; twice as long each time after,
#: up to `BROKEN_MAX_WAIT` (0.4, 0.8, 1.6, 3.2, 5 s)
BROKEN_BASE_WAIT = 0.2
BROKEN_MAX_WAIT = 5.0


@dataclass(frozen=True)
class HubSettings:
    """How to reach the Hub, read from the environment at call time.

    Attributes:
        endpoint: `HF_ENDPOINT` (default https://huggingface.co).
        token: `HF_TOKEN`, else the token saved by `hf auth login` (None: anonymous).
        cache_dir: the HF hub cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`).
        offline: `HF_HUB_OFFLINE` is set: only the local cache is used.
        timeout: seconds a request may wait for the server (to connect, or between two
            bytes of its answer) before it counts as failed and is retried:
            `HF_HUB_DOWNLOAD_TIMEOUT`, 10 by default, as huggingface_hub's own downloads.
            Without it a connection the server stops answering would hang the command.
    """

    endpoint: str
    token: str | None
    cache_dir: str
    offline: bool
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def from_env(cls) -> HubSettings:
        """The settings huggingface_hub would use if it were imported now."""
        timeout = _timeout_from_env()  # before the import, which a wrong value breaks
        from huggingface_hub import constants, get_token

        endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        home = os.environ.get("HF_HOME")
        cache = os.environ.get("HF_HUB_CACHE") or (
            os.path.join(home, "hub") if home else constants.HF_HUB_CACHE
        )
        offline_env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
        offline = (
            offline_env.strip().lower() in _TRUE
            if offline_env is not None
            else constants.HF_HUB_OFFLINE
        )
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        token_file = os.environ.get("HF_TOKEN_PATH") or (
            os.path.join(home, "token") if home else None
        )
        if not token and token_file:
            # `hf auth login` saved it under the HF_HOME in effect now
            try:
                token = Path(token_file).expanduser().read_text().strip()
            except OSError:
                token = None
        elif not token:
            token = get_token()
        return cls(
            endpoint=endpoint,
            token=token or None,
            cache_dir=os.path.expanduser(cache),
            offline=offline,
            timeout=timeout,
        )


def _timeout_from_env() -> float:
    """`HF_HUB_DOWNLOAD_TIMEOUT` in seconds (`DEFAULT_TIMEOUT` when unset or 0, as
    huggingface_hub takes it). huggingface_hub reads it as a whole number when it is imported
    and fails to import on anything else, so any other value is a usage error naming it."""
    text = os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT")
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = int(text)
    except ValueError:
        raise UsageError(
            f"HF_HUB_DOWNLOAD_TIMEOUT={text!r} is not a whole number of seconds",
            fix="Set it to a whole number of seconds (30, say), or unset it for 10.",
        ) from None
    return float(seconds) if seconds > 0 else DEFAULT_TIMEOUT


@dataclass
class HubRepo:
    """A repository pinned to one commit, with its files under `subfolder`.

    Attributes:
        location: the parsed `hf://` location.
        settings: endpoint, token, cache and offline mode in use.
        commit: the 40-hex commit the revision resolved to.
        files: files under the subfolder (path relative to it -> RemoteFile).
        snapshot: the local snapshot folder when reading from the cache offline.
    """

    location: Location
    settings: HubSettings
    commit: str
    files: dict[str, RemoteFile]
    snapshot: Path | None = None
    _cached: dict[str, str | None] = field(default_factory=dict)

    @property
    def repo_id(self) -> str:
        """`org/name`."""
        assert self.location.repo_id is not None
        return self.location.repo_id

    @property
    def repo_type(self) -> str:
        """`model`, `dataset` or `space`."""
        return self.location.repo_type

    @property
    def subfolder(self) -> str:
        """Folder inside the repository ('' for the root)."""
        return self.location.subfolder

    def repo_path(self, rel: str) -> str:
        """Path in the repository of `rel` (relative to the subfolder)."""
        return f"{self.subfolder}/{rel}" if self.subfolder else rel

    def url(self, rel: str) -> str:
        """The `resolve` URL of `rel` at the pinned commit."""
        from huggingface_hub import hf_hub_url

        return hf_hub_url(
            self.repo_id,
            self.repo_path(rel),
            repo_type=self.repo_type,
            revision=self.commit,
            endpoint=self.settings.endpoint,
        )

    def display(self, rel: str = "") -> str:
        """How to name the repository (or one of its files) in messages."""
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        base = f"hf://{prefix}{self.repo_id}@{self.commit[:12]}"
        path = self.repo_path(rel) if rel else self.subfolder
        return f"{base}/{path}" if path else base

    def pinned(self) -> str:
        """The repository (and subfolder) at this commit, as a SRC for another command."""
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        base = f"hf://{prefix}{self.repo_id}@{self.commit}"
        return f"{base}/{self.subfolder}" if self.subfolder else base

    def cached_path(self, rel: str) -> str | None:
        """The file in the local HF cache for this commit, if it is there."""
        if rel not in self._cached:
            if self.snapshot is not None:
                candidate = self.snapshot / rel
                self._cached[rel] = str(candidate) if candidate.is_file() else None
            else:
                from huggingface_hub import try_to_load_from_cache

                found = try_to_load_from_cache(
                    self.repo_id,
                    self.repo_path(rel),
                    cache_dir=self.settings.cache_dir,
                    revision=self.commit,
                    repo_type=self.repo_type,
                )
                self._cached[rel] = found if isinstance(found, str) else None
        return self._cached[rel]

    def note_cached(self, rel: str, path: Path) -> None:
        """`rel` is now in the local HF cache at `path` (fetched there by this run): later
        reads of it are served from that copy (`cached_path` remembers its first answer)."""
        self._cached[rel] = str(path)

    def details(self) -> dict[str, Any]:
        """What `Manifest.details["hub"]` records."""
        return {
            "repo": self.repo_id,
            "repo_type": self.repo_type,
            "revision": self.location.revision or "main",
            "commit": self.commit,
            "subfolder": self.subfolder,
            "endpoint": self.settings.endpoint,
            "offline": self.snapshot is not None,
        }


def file_digest(path: Path, algorithm: str) -> str:
    """A local file's `sha256`, or (`git`) its git blob id, read block by block."""
    size = path.stat().st_size
    digest = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(b"blob %d\x00" % size)
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def hub_mismatch(path: Path, remote: RemoteFile) -> str | None:
    """Why a local copy differs from the Hub's record of the file (size, sha256 or git blob
    id), or None when it matches. `ckpt download` and `ckpt verify` use this."""
    size = path.stat().st_size
    if size != remote.size:
        return f"is {size} bytes but the Hub records {remote.size} for {remote.path}"
    if remote.sha256 and file_digest(path, "sha256") != remote.sha256:
        return f"does not match the sha256 the Hub records for {remote.path}"
    if remote.blob_id and not remote.sha256 and file_digest(path, "git") != remote.blob_id:
        return f"does not match the git blob id the Hub records for {remote.path}"
    return None


#: what the Hub says (X-Error-Message) when it does not accept the token a request sends
INVALID_TOKEN = "Invalid credentials in Authorization header"


def _auth_fix() -> str:
    return (
        "If the repository is private or gated, accept its terms on the Hub, then set HF_TOKEN "
        "or run `hf auth login`."
    )


@contextmanager
def hub_errors(where: str) -> Iterator[None]:
    """Map huggingface_hub and network exceptions to ckpt errors naming `where`.

    Under HF_HUB_OFFLINE=1 a miss says that offline mode is on, not that the Hub "cannot be
    reached" (nothing was tried).
    """
    with _mapped_hub_errors(where), _offline_misses(where):
        yield


@contextmanager
def _offline_misses(where: str) -> Iterator[None]:
    from huggingface_hub import errors as hf

    try:
        yield
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError, hf.RevisionResolutionError):
        if not HubSettings.from_env().offline:
            raise
        raise HubError(
            "is not in the local cache, and offline mode is on (HF_HUB_OFFLINE=1), so the Hub "
            "was not asked",
            path=where,
            fix="Unset HF_HUB_OFFLINE (or set it to 0) to fetch it, or fetch it once while "
            "online (`ckpt download --cache-only`).",
        ) from None


@contextmanager
def _mapped_hub_errors(where: str) -> Iterator[None]:
    """Map huggingface_hub and network exceptions to ckpt errors naming `where`.

    Missing repository (also the Hub's 401 `RepoNotFound`, which a private repository gets
    too: the message keeps the token hint), revision or file: NotFoundError (exit 3). Gated
    repositories, refused tokens, offline misses, connection and server failures: HubError
    (exit 5).
    """
    import httpx2
    from huggingface_hub import errors as hf

    try:
        yield
    except CkptError:
        raise
    except hf.GatedRepoError:
        raise HubError(
            "is a gated repository and no valid token was sent",
            path=where,
            fix="Accept its terms on the Hub, then set HF_TOKEN or run `hf auth login`.",
        ) from None
    except hf.RepositoryNotFoundError as exc:
        # the Hub answers 401 (not 404) for a repository that does not exist when no token is
        # sent, so it cannot tell "absent" from "private": not found (3), with the auth hint
        status = exc.response.status_code if exc.response is not None else None
        refused = f" (HTTP {status})" if status in (401, 403) else ""
        raise NotFoundError(
            f"no such repository on the Hub{refused}, or it is private or gated and no valid "
            "token was sent",
            path=where,
            fix=f"Check the org/name spelling. {_auth_fix()}",
        ) from None
    except hf.RevisionNotFoundError:
        raise NotFoundError(
            "no such revision (branch, tag or commit) in this repository",
            path=where,
            fix="Check the part after '@'; `hf://org/repo` reads the default branch.",
        ) from None
    except hf.LocalEntryNotFoundError as exc:
        # `hf_hub_download` reports a failed metadata request (a bare 404 from a mirror, a 403,
        # a 5xx, a lost connection) as "not in the local cache", the real answer in
        # `__cause__`: say what the server said (offline mode is `_offline_misses`' case)
        cause = exc.__cause__
        if isinstance(cause, hf.HfHubHTTPError | httpx2.TransportError):
            with _mapped_hub_errors(where):
                raise cause from None
        raise HubError(
            f"is not in the local cache and the Hub could not be used ({_first_line(exc)})",
            path=where,
            fix="Check the connection and HF_ENDPOINT.",
        ) from None
    except hf.EntryNotFoundError:
        raise NotFoundError(
            "no such file or folder in this repository at this revision",
            path=where,
            fix="Check the path after the repository name; `ckpt inspect hf://org/repo` lists the files.",
        ) from None
    except hf.RevisionResolutionError as exc:
        raise HubError(
            f"cannot be reached and nothing is cached for this revision ({_first_line(exc)})",
            path=where,
            fix="Check the connection and HF_ENDPOINT, or download it once while online.",
        ) from None
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        said = exc.response.headers.get("X-Error-Message", "") if exc.response is not None else ""
        if status == 401 and said == INVALID_TOKEN:
            # the Hub's answer to any request with a token it does not accept (expired,
            # revoked, mistyped), public repositories included
            raise HubError(
                "was refused (HTTP 401): the Hub does not accept the token sent (expired, "
                "revoked or mistyped)",
                path=where,
                fix="Set HF_TOKEN to a valid token, or run `hf auth login` again; a public "
                "repository needs none (unset HF_TOKEN, or `hf auth logout`).",
            ) from None
        if status in (401, 403):
            raise HubError(f"was refused (HTTP {status})", path=where, fix=_auth_fix()) from None
        if status == 429:
            response = exc.response
            asked = retry_after(response.headers) if response is not None else None
            wait = "" if asked is None else f"; it asks to wait {asked:.0f} s before the next"
            raise HubError(
                f"the Hub answered HTTP 429: too many requests{wait}",
                path=where,
                fix="Run the command again after that wait; requests sent with a token "
                "(HF_TOKEN, or `hf auth login`) get higher rate limits.",
            ) from None
        if status == 404:
            raise NotFoundError(
                "not found on the Hub (HTTP 404)",
                path=where,
                fix="Check the repository, revision and path; `ckpt inspect hf://org/repo` "
                "lists the files, and a mirror (HF_ENDPOINT) may lack files the Hub has.",
            ) from None
        raise HubError(
            f"the Hub answered HTTP {status} ({_first_line(exc)})",
            path=where,
            fix="Try again later; check HF_ENDPOINT if you use a mirror.",
        ) from None
    except (httpx2.TransportError, hf.OfflineModeIsEnabled, ConnectionError, TimeoutError) as exc:
        raise HubError(
            f"the Hub could not be reached ({type(exc).__name__}: {_first_line(exc)})",
            path=where,
            fix="Check the network connection and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache.",
        ) from None


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The seconds an answer asks to wait before the next request: the Hub's `RateLimit`
    header when its quota is spent (`r=0;t=SECONDS`, read by huggingface_hub's own parser),
    else a `Retry-After` (a number of seconds, or an HTTP date); None when it says neither."""
    # `huggingface_hub.utils` re-exports it lazily (mypy --strict sees no export); it is
    # defined in `utils._http`, as `http_backoff`, which reads the same headers
    from huggingface_hub.utils._http import parse_ratelimit_headers

    quota = parse_ratelimit_headers(headers)
    if quota is not None and quota.remaining == 0:
        return float(quota.reset_in_seconds)
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    from email.utils import parsedate_to_datetime

    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def retry_wait(status: int, headers: Mapping[str, str], attempt: int) -> float | None:
    """Seconds to wait before asking again a request answered `status` (with `headers`) on
    its try `attempt + 1`; None when it is not asked again: an answer that is no passing
    failure (`RETRY_STATUSES`), the `HUB_RETRIES` new tries spent, or a `Retry-After` longer
    than `RETRY_AFTER_MAX`."""
    if status not in RETRY_STATUSES or attempt >= HUB_RETRIES:
        return None
    asked = retry_after(headers)
    if asked is not None:
        return asked if asked <= RETRY_AFTER_MAX else None
    return float(min(RETRY_MAX_WAIT, RETRY_BASE_WAIT * 2.0**attempt))


def broken_connection_errors() -> tuple[type[BaseException], ...]:
    """The network failures after which a Hub request is asked again: the connection reset or
    closed before or during the answer, or silent for `HubSettings.timeout` seconds. A refused
    connection (nothing listens: a wrong HF_ENDPOINT) is not among them: asking again would
    only delay its report."""
    import httpx2

    return (
        httpx2.RemoteProtocolError,
        httpx2.ReadError,
        httpx2.WriteError,
        httpx2.TimeoutException,
    )


def broken_wait(failures: int) -> float:
    """Seconds to wait before asking again after the `failures`-th broken connection in a row."""
    return float(min(BROKEN_MAX_WAIT, BROKEN_BASE_WAIT * 2.0**failures))


def retrying(call: Callable[[], T], where: str) -> T:
    """`call()` (a request through huggingface_hub: its API, or `hf_hub_download`), asked
    again while the Hub answers a rate limit or a passing server error, as `retry_wait` says,
    or its connection breaks (`broken_connection_errors`, up to `READ_RETRIES` times, as file
    reads are); the last answer is raised, a connection that kept breaking as a HubError
    naming `where`. `hf_hub_download` reports a failed metadata request as a miss of the local
    cache caused by it: judged by that cause, and not asked again after an HTTP status (its
    own back-off has asked it again already)."""
    from huggingface_hub import errors as hf

    broken = broken_connection_errors()
    attempt = failures = 0
    while True:
        try:
            return call()
        except Exception as exc:
            cause: BaseException | None = exc
            # a failed metadata request of `hf_hub_download`: huggingface_hub has already
            # asked it again with its own back-off (`http_backoff`, 5 new tries) after a rate
            # limit or a server error; asking that whole again multiplied the tries (36
            # requests and 2.5 minutes before a Hub answering 500 was reported)
            backed_off = isinstance(exc, hf.LocalEntryNotFoundError)
            if backed_off:
                cause = exc.__cause__
            if isinstance(cause, hf.HfHubHTTPError):
                response = cause.response
                wait = (
                    None
                    if response is None or backed_off
                    else retry_wait(response.status_code, response.headers, attempt)
                )
                if wait is None:
                    raise
                attempt += 1
                time.sleep(wait)
                continue
            if not isinstance(cause, broken):
                raise
            failures += 1
            if failures > READ_RETRIES:
                raise HubError(
                    f"the connection to the Hub kept breaking ({failures} tries; the last: "
                    f"{type(cause).__name__}: {_first_line(cause)})",
                    path=where,
                    fix="Check the network (a proxy, VPN or firewall that cuts connections) "
                    "and HF_ENDPOINT, then run the command again; HF_HUB_OFFLINE=1 reads what "
                    "the local HF cache holds.",
                ) from None
            time.sleep(broken_wait(failures))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def open_repo(location: Location, settings: HubSettings | None = None) -> HubRepo:
    """Resolve `location`'s revision to a commit and list its files (sizes, sha256).

    Online, one request does both: the repository's info at the revision with its files'
    metadata (`repo_info(files_metadata=True)`): the commit and every file's size, git blob id
    and LFS sha256, all of that one commit (two requests, resolve then list, cost a round trip
    more). A revision that is a commit already is listed at once; a server whose info leaves
    the sizes out (a mirror) is listed at the commit after. Offline, the cache's `refs/` name
    the commit and its snapshot folder is listed.
    """
    settings = settings or HubSettings.from_env()  # first: it checks what the import reads
    from huggingface_hub import DatasetInfo, HfApi, ModelInfo, SpaceInfo

    where = location.raw
    api = HfApi(endpoint=settings.endpoint, token=settings.token)
    files: dict[str, RemoteFile] | None = None
    if settings.offline or _is_commit(location.revision):
        with hub_errors(where):
            commit = str(
                retrying(
                    lambda: api.resolve_revision(
                        location.repo_id or "",
                        repo_type=location.repo_type,
                        revision=location.revision,
                        cache_dir=settings.cache_dir,
                        local_files_only=settings.offline,
                    ),
                    where,
                ).resolved
            )
        _check_commit(commit, where, "the local cache's refs/ name")
        if settings.offline:
            return _open_cached(location, settings, commit)
    else:
        with hub_errors(where):
            info = retrying(
                lambda: api.repo_info(
                    location.repo_id or "",
                    repo_type=location.repo_type,
                    revision=location.revision,
                    files_metadata=True,
                    timeout=settings.timeout,
                ),
                where,
            )
        if info.sha is None:
            raise HubError(
                "the Hub's answer names no commit for this revision",
                path=where,
                fix="Try again later; check HF_ENDPOINT if you use a mirror.",
            )
        commit = info.sha
        _check_commit(commit, where, "the Hub's answer names")
        _remember_ref(location, settings, commit)
        siblings = info.siblings if isinstance(info, ModelInfo | DatasetInfo | SpaceInfo) else None
        files = _from_siblings(location, siblings)
        if files is not None and location.subfolder and not files:
            raise NotFoundError(
                "no such file or folder in this repository at this revision",
                path=where,
                fix="Check the path after the repository name; `ckpt inspect hf://org/repo` "
                "lists the files.",
            )
    if files is None:
        files = _list_tree(api, location, commit)
    if not files:
        prefix = f"{location.subfolder}/" if location.subfolder else ""
        raise NotFoundError(
            "holds no files at this revision" + (" under this folder" if prefix else ""),
            path=where,
            fix="Check the repository and the subfolder.",
        )
    return HubRepo(
        location=location, settings=settings, commit=commit, files=dict(sorted(files.items()))
    )


def _is_commit(revision: str | None) -> bool:
    return revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def _check_commit(commit: str, where: str, source: str) -> None:
    """Refuse a resolved commit that is no git commit id (40 hex digits): ckpt and
    huggingface_hub build cache paths (`snapshots/<commit>/`, `refs/`) and URLs from it, so a
    server (or a cache) answering `../../elsewhere` would lead them out of the cache."""
    if not _is_commit(commit):
        shown = commit if len(commit) <= 60 else commit[:57] + "..."
        raise HubError(
            f"{source} commit {shown!r} for this revision, which is no git commit id (40 hex "
            "digits); ckpt refuses it before building a path or URL from it",
            path=where,
            fix="Check HF_ENDPOINT: the Hub and its mirrors answer 40-hex commit ids. A "
            "damaged local cache: remove the repository's refs/ folder from it.",
        )


def _from_siblings(location: Location, siblings: Any) -> dict[str, RemoteFile] | None:
    """The files under the subfolder, from repo info's `siblings`; None when the server left
    out their sizes (then the tree listing gives them)."""
    if siblings is None or any(s.size is None for s in siblings):
        return None
    prefix = f"{location.subfolder}/" if location.subfolder else ""
    files: dict[str, RemoteFile] = {}
    for sibling in siblings:
        path = sibling.rfilename
        if not path.startswith(prefix):
            continue
        rel = safe_relpath(path[len(prefix) :], source=location.raw)
        lfs = sibling.lfs
        files[rel] = RemoteFile(
            path=path,
            size=int(lfs.size if lfs is not None else sibling.size),
            sha256=lfs.sha256 if lfs is not None else None,
            blob_id=None if lfs is not None else sibling.blob_id,
        )
    return files


def _list_tree(api: Any, location: Location, commit: str) -> dict[str, RemoteFile]:
    """The files under the subfolder at `commit`, from the recursive tree listing."""
    where = location.raw
    files: dict[str, RemoteFile] = {}
    prefix = f"{location.subfolder}/" if location.subfolder else ""
    with hub_errors(where):
        items = retrying(
            lambda: list(
                api.list_repo_tree(
                    location.repo_id or "",
                    path_in_repo=location.subfolder or None,
                    recursive=True,
                    revision=commit,
                    repo_type=location.repo_type,
                )
            ),
            where,
        )
    for item in items:
        size = getattr(item, "size", None)
        if size is None:  # a folder
            continue
        if not item.path.startswith(prefix):
            continue
        rel = safe_relpath(item.path[len(prefix) :], source=where)
        lfs = getattr(item, "lfs", None)
        files[rel] = RemoteFile(
            path=item.path,
            size=int(lfs.size if lfs is not None else size),
            sha256=lfs.sha256 if lfs is not None else None,
            blob_id=None if lfs is not None else getattr(item, "blob_id", None),
        )
    return files


def _remember_ref(location: Location, settings: HubSettings, commit: str) -> None:
    """Record the revision's commit in the cache's `refs/`, as `resolve_revision` does, so a
    later offline run finds its snapshot (best effort: the cache may be read-only)."""
    from huggingface_hub.file_download import repo_folder_name

    assert location.repo_id is not None
    ref = (
        Path(settings.cache_dir)
        / repo_folder_name(repo_id=location.repo_id, repo_type=location.repo_type)
        / "refs"
        / (location.revision or "main")
    )
    try:
        if read_cache_ref(ref) == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    except OSError:
        pass


def _open_cached(location: Location, settings: HubSettings, commit: str) -> HubRepo:
    from huggingface_hub.file_download import repo_folder_name

    assert location.repo_id is not None
    folder = Path(settings.cache_dir) / repo_folder_name(
        repo_id=location.repo_id, repo_type=location.repo_type
    )
    snapshot = folder / "snapshots" / commit
    root = snapshot / location.subfolder if location.subfolder else snapshot
    if not root.is_dir():
        raise HubError(
            f"is not in the local cache, and offline mode is on (HF_HUB_OFFLINE=1; looked in "
            f"{root})",
            path=location.raw,
            fix="Unset HF_HUB_OFFLINE to fetch it, or download it first with "
            "`ckpt download --cache-only`.",
        )
    listing = LocalStorage(root).list_files()
    prefix = f"{location.subfolder}/" if location.subfolder else ""
    files = {rel: RemoteFile(path=prefix + rel, size=size) for rel, size in listing.items()}
    return HubRepo(location=location, settings=settings, commit=commit, files=files, snapshot=root)
