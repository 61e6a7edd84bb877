"""What a remote store's replies mean: its exceptions as ckpt errors (`remote_failure`, with
the exit code each deserves; `refusal_code`, S3's own code), and the times in its listings
(`listing_time`). Every module that talks to an fsspec filesystem reads replies through these,
so one failure is worded and exited alike wherever it happens.
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptError, HubError, NotFoundError


def remote_failure(exc: BaseException, where: str, *, writing: bool = False) -> CkptError:
    """A remote filesystem's exception as a ckpt error (exit 3 for missing, else exit 5)."""
    if isinstance(exc, CkptError):
        return exc
    if isinstance(exc, FileNotFoundError) and not writing:
        # listed (or named by the checkpoint) a moment before, gone when read
        return NotFoundError(
            "no such object in the store (deleted or replaced since it was listed?)",
            path=where,
            fix="Check that no other job (a prune, a sync, the training run) is removing files "
            "under this prefix, then run the command again.",
        )
    if isinstance(exc, FileNotFoundError):
        # an object store has no folders to be missing: a write finds no bucket
        return NotFoundError(
            f"cannot write there: the bucket does not exist ({exc})",
            path=where,
            fix="Create it first (e.g. `aws s3 mb`), or check the endpoint and credentials.",
        )
    action = "write to" if writing else "read from"
    return HubError(
        f"cannot {action} the remote store ({type(exc).__name__}: {exc})",
        path=where,
        fix="Check the network, the endpoint and your credentials"
        + (" (and that they allow writing here)." if writing else "."),
    )


def refusal_code(exc: BaseException) -> str | None:
    """The S3 error code of a failed call (s3fs raises its own error, caused by botocore's)."""
    from botocore.exceptions import ClientError

    cause = exc if isinstance(exc, ClientError) else exc.__cause__
    if isinstance(cause, ClientError):
        code = cause.response.get("Error", {}).get("Code")
        return str(code) if code else None
    return None


def listing_time(info: dict[str, Any]) -> float | None:
    """A listing entry's modification time: S3's `LastModified`, or `mtime` / `created`."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, int | float):
            return float(value)
    return None
