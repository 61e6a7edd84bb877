"""Where an output goes: a local `Path`, or a `RemoteDest` in an object store.

`storage.output` writes both (a local staging folder, then for a `RemoteDest` an upload); this
module only names them, so every storage can hand out a destination (`Storage.destination`)
without knowing how outputs are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any


@dataclass(frozen=True)
class RemoteDest:
    """A destination in an fsspec filesystem (an object-store prefix or object).

    Attributes:
        url: the URL as the user wrote it (trailing slashes dropped).
        fs: the fsspec filesystem (credentials and endpoint from its usual env/config).
        path: the path inside `fs` (`bucket/prefix/name`).
    """

    url: str
    fs: Any
    path: str

    @property
    def name(self) -> str:
        """The last component (the folder or file name)."""
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        """The file suffix of `name` (`.safetensors`), as `Path.suffix`."""
        return PurePosixPath(self.path).suffix

    @property
    def stem(self) -> str:
        """`name` without its suffix, as `Path.stem`."""
        return PurePosixPath(self.path).stem

    def absolute(self) -> RemoteDest:
        """Itself (a URL is absolute); lets callers treat a DEST like a `Path`."""
        return self

    def __str__(self) -> str:
        return self.url


Destination = Path | RemoteDest


def local_destination(dest: Destination) -> Path | None:
    """`dest` as an absolute path on this machine, or None when it is not on a local disk (an
    object store): for outputs that must be written locally. Destinations are told apart here,
    in the storage layer, and nowhere else."""
    return None if isinstance(dest, RemoteDest) else dest.absolute()
