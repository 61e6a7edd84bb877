"""Object stores and other fsspec URLs (`s3://`, `gs://`, `memory://`...) as checkpoint sources.

I/O strategy: the location is resolved once with `fsspec.core.url_to_fs` (credentials and
endpoints come from each filesystem package's usual environment and config, e.g.
`AWS_ENDPOINT_URL`, `AWS_PROFILE`); files are listed once and read with ranged reads
(`cat_file(start, end)`), so inspecting a checkpoint fetches headers and metadata only.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotFoundError, UsageError
from ..storage import FsspecStorage, remote_failure
from ..uri import Location
from .base import Source


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
        fs, path = fsspec.core.url_to_fs(location.url)
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


def fsspec_source(location: Location) -> Source:
    """A `Source` for an fsspec URL: a folder-like prefix, or one object."""
    fs, path = filesystem_for(location)
    try:
        if fs.isdir(path):
            return Source(location=location, storage=FsspecStorage(fs, path, location.raw))
        if fs.isfile(path):
            parent, _, name = path.rstrip("/").rpartition("/")
            display = location.raw.rstrip("/").rpartition("/")[0]
            return Source(
                location=location, storage=FsspecStorage(fs, parent, display), target=name
            )
    except FileNotFoundError:
        raise NotFoundError("no such object or prefix", path=location.raw) from None
    except Exception as exc:  # each filesystem package raises its own network/auth errors
        raise remote_failure(exc, location.raw) from None
    raise NotFoundError(
        "no such object or prefix", path=location.raw, fix="Check the bucket and path."
    )
