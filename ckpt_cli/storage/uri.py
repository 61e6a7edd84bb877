"""Parse a SRC/DEST argument into a `Location`: a local path, `hf://…`, or another fsspec URL."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from ..errors import UsageError

_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$")
_HF_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
#: object stores whose URLs start with a bucket (container): `s3://BUCKET/prefix`
BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})
#: one part of a Hub repository id, as the Hub (and huggingface_hub's `validate_repo_id`)
#: admits it: letters, digits, `-`, `_`, `.`; neither starting nor ending with `-` or `.`
_HF_ID_PART = re.compile(r"^\b[\w\-.]{1,96}\b$")


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
    if scheme in BUCKET_SCHEMES and not rest.split("/", 1)[0]:
        # `s3://` or `s3:///run`: no bucket (the store would be asked to list every bucket,
        # or a folder named `s3:` looked for on this disk)
        raise UsageError(
            "a bucket is needed: the URL names none",
            path=text,
            fix=f"Write it as {scheme}://BUCKET/prefix/.",
        )
    return Location(raw=text, kind="fsspec", url=text, path=Path(rest))


def canonical_remote(text: str) -> str:
    """An object-store URL (`s3://bkt//m/`) or a path inside its filesystem (`bkt//m/`) spelt
    the one way the store reads it: scheme in lower case, empty path parts collapsed
    (`s3://bkt/m`, `bkt/m`). s3fs reads `bkt//m` as `bkt/m`, so two spellings that differ
    only there name the same objects; compare locations through this, never as raw text."""
    match = _URL.match(text)
    scheme, rest = (match["scheme"].lower() + "://", match["rest"]) if match else ("", text)
    return scheme + "/".join(part for part in rest.split("/") if part)


def is_hub_url(text: str) -> bool:
    """Whether `text` names the Hugging Face Hub (`hf://…`, the scheme in any case), as
    `parse_location` reads it; nothing is validated or raised."""
    match = _URL.match(text)
    return match is not None and match["scheme"].lower() == "hf"


def hub_url(location: Location) -> str:
    """The `hf://` URL of a Hub location, spelt the one way `parse_location` reads back:
    `hf://[datasets/|spaces/]org/repo[@revision][/subfolder]`, `/` in a revision as `%2F`."""
    assert location.kind == "hf" and location.repo_id is not None
    kind = "" if location.repo_type == "model" else f"{location.repo_type}s/"
    revision = f"@{location.revision.replace('/', '%2F')}" if location.revision else ""
    subfolder = f"/{location.subfolder}" if location.subfolder else ""
    return f"hf://{kind}{location.repo_id}{revision}{subfolder}"


def with_hub_options(text: str, revision: str | None, repo_type: str | None) -> str:
    """`text` with `--revision` / `--repo-type` folded into its `hf://` URL.

    Refused for a SRC that is not on the Hub, for an unknown repository type, and where an
    option contradicts what the URL already says (`hf://org/repo@v1 --revision v2`).
    """
    if revision is None and repo_type is None:
        return text
    if not is_hub_url(text):
        given = [
            o for o, v in (("--revision", revision), ("--repo-type", repo_type)) if v is not None
        ]
        verb = "apply" if len(given) > 1 else "applies"
        raise UsageError(
            f"{' and '.join(given)} {verb} to a Hub location, and {text!r} is not one",
            fix="Write SRC as hf://org/repo, or leave the option out.",
        )
    if repo_type is not None and repo_type not in _HF_TYPES.values():
        raise UsageError(
            f"--repo-type {repo_type!r} is not a repository type",
            fix="Use model, dataset or space.",
        )
    location = parse_location(text)
    if repo_type is not None:
        match = _URL.match(text)
        assert match is not None  # a Hub URL, checked above
        written = match["rest"].lstrip("/").split("/", 1)[0]
        if written in _HF_TYPES and _HF_TYPES[written] != repo_type:
            raise UsageError(
                f"--repo-type {repo_type} contradicts {text!r}", fix="Keep one of the two."
            )
        location = replace(location, repo_type=repo_type)
    if revision is not None:
        if location.revision is not None and location.revision != revision:
            raise UsageError(
                f"--revision {revision} contradicts {text!r}", fix="Keep one of the two."
            )
        location = replace(location, revision=revision)
    return hub_url(location)


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
    repo_id = f"{org}/{name}"
    if (
        not all(_HF_ID_PART.match(part) for part in (org, name))
        or "--" in repo_id
        or ".." in repo_id
        or name.endswith(".git")
    ):
        raise UsageError(
            f"{text!r}: {repo_id!r} is not a Hub repository id",
            fix="A repository id is ORG/NAME of letters, digits, '-', '_' and '.' (no spaces, "
            "no '--' or '..', neither starting nor ending with '-' or '.'); check the "
            "spelling, and quote the whole URL in the shell.",
        )
    subfolder = "/".join(parts[2:])
    if any(p in ("..", ".") for p in parts[2:]):
        raise UsageError(
            f"{text!r} has '.' or '..' in its subfolder", fix="Name the subfolder plainly."
        )
    return Location(
        raw=text,
        kind="hf",
        repo_id=repo_id,
        repo_type=repo_type,
        revision=revision,
        subfolder=subfolder,
    )
