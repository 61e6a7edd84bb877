"""Parse a SRC/DEST argument into a `Location`: a local path, `hf://…`, or another fsspec URL."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import UsageError

_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$")
_HF_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


@dataclass(frozen=True)
class Location:
    """Where a checkpoint lives.

    Attributes:
        raw: the argument as the user wrote it.
        kind: `local`, `hf` (Hugging Face Hub) or `fsspec` (any other URL).
        path: the local path (`local`), or the path after the scheme (`fsspec`).
        repo_id / repo_type / revision / subfolder: the Hub coordinates (`hf`).
        url: the full URL (`fsspec`).
    """

    raw: str
    kind: Literal["local", "hf", "fsspec"]
    path: Path | None = None
    repo_id: str | None = None
    repo_type: str = "model"
    revision: str | None = None
    subfolder: str = ""
    url: str | None = None

    @property
    def is_local(self) -> bool:
        """True for a path on this machine."""
        return self.kind == "local"

    def __str__(self) -> str:
        return self.raw


def parse_location(text: str) -> Location:
    """Parse `text` into a Location.

    `hf://org/repo[@revision][/subfolder]` (also `hf://datasets/org/repo…`) is the Hub;
    `file://x` is the local path `x`; any other `scheme://` is an fsspec URL.
    """
    match = _URL.match(text)
    if not match:
        return Location(raw=text, kind="local", path=Path(text).expanduser())
    scheme, rest = match["scheme"].lower(), match["rest"]
    if scheme == "file":
        return Location(raw=text, kind="local", path=Path(rest).expanduser())
    if scheme == "hf":
        return _parse_hf(text, rest)
    return Location(raw=text, kind="fsspec", url=text, path=Path(rest))


def _parse_hf(text: str, rest: str) -> Location:
    parts = [p for p in rest.split("/") if p]
    repo_type = "model"
    if parts and parts[0] in _HF_TYPES:
        repo_type = _HF_TYPES[parts.pop(0)]
    if len(parts) < 2:
        raise UsageError(
            f"{text!r} is not a Hub location",
            fix="Write it as hf://org/repo[@revision][/subfolder].",
        )
    org, name = parts[0], parts[1]
    revision = None
    if "@" in name:
        name, revision = name.split("@", 1)
        # a revision may itself contain slashes (refs/pr/1), URL-encoded or not
        revision = revision.replace("%2F", "/")
        if not revision:
            raise UsageError(
                f"{text!r} has an empty revision after '@'", fix="Name a branch, tag or commit."
            )
    subfolder = "/".join(parts[2:])
    if any(p in ("..", ".") for p in parts[2:]):
        raise UsageError(
            f"{text!r} has '.' or '..' in its subfolder", fix="Name the subfolder plainly."
        )
    return Location(
        raw=text,
        kind="hf",
        repo_id=f"{org}/{name}",
        repo_type=repo_type,
        revision=revision,
        subfolder=subfolder,
    )
