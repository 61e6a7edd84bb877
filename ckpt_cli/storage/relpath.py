"""File names read from an input, confined to the checkpoint root (`safe_relpath`).

Every storage, local or remote, resolves the names an input gives (an index's `weight_map`, a
DCP `relative_path`, a DeepSpeed file list) through `safe_relpath` before it touches a file, so
no name can leave the checkpoint: not an absolute path, not `..`, not a name no file system
holds.
"""

from __future__ import annotations

import posixpath

from ..errors import UnsafeInputError

MAX_NAME = 255
MAX_PATH = 4096


def _quoted(name: str, limit: int = 120) -> str:
    """`repr(name)`, cut short past `limit` characters (a crafted name may run to megabytes)."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}..."


def safe_relpath(name: str, *, source: str) -> str:
    """Normalise a file name read from an input and refuse anything that leaves the root.

    Args:
        name: the file name as written in the input.
        source: the file that named it, for the error message.
    """
    if not name or "\x00" in name:
        raise UnsafeInputError(
            f"names an empty or invalid file name {_quoted(name)}",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    too_long = len(name) > MAX_PATH or any(
        len(part.encode("utf-8", "surrogatepass")) > MAX_NAME for part in name.split("/")
    )
    if too_long:
        # no file system holds it (the open would fail with ENAMETOOLONG: an OS error, exit 74)
        raise UnsafeInputError(
            f"names a file name of {len(name):,} characters {_quoted(name)}, longer than any file "
            f"system holds ({MAX_NAME} bytes a name, {MAX_PATH:,} a path)",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeInputError(
            f"names the absolute path {name!r}; checkpoint files must be relative to the checkpoint",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    if "\\" in name:
        # a Windows separator: `..\\..\\etc` leaves the checkpoint there, and no writer of
        # these formats puts one in a name
        raise UnsafeInputError(
            f"names {name!r}, a path with a backslash (a Windows separator); checkpoint files "
            "are named with '/'",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
        raise UnsafeInputError(
            f"names {name!r}, a path outside the checkpoint",
            path=source,
            fix="This file is corrupt or hostile; do not use it.",
        )
    return norm
