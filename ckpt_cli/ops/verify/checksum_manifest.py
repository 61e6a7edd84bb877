"""The checksum manifest (`ckpt-manifest.json`): its record, where it is, reading and writing
it. `verify --checksums` / `--write-manifest` (`checksums`) check and write it; `repair`
writes it again from the parity's digests; `prune`'s slimming rewrites it for what it keeps."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...budgets import MAX_JSON_RECORD
from ...errors import FormatError, NotFoundError, UnsafeInputError
from ...formats.base import Source
from ...formats.names import is_commit_marker
from ...models import Record
from ...sources.runs.records import CHECKSUM_MANIFEST
from ...storage import safe_relpath
from ...storage.hashing import ALGORITHMS
from ...storage.output import (
    Destination,
    destination_exists,
    read_destination,
    resolve_destination,
    staged_output,
)
from ...storage.uri import parse_location

#: default manifest file name, inside a checkpoint folder (or beside a single-file checkpoint)
MANIFEST_NAME = CHECKSUM_MANIFEST
MANIFEST_VERSION = 1


class FileDigest(Record):
    """One file recorded in a checksum manifest."""

    size: int
    digest: str


class ChecksumManifest(Record):
    """The content of `ckpt-manifest.json`.

    Attributes:
        ckpt_manifest: file format version.
        algorithm: `sha256`, `blake3` or `xxh3` (XXH3-128).
        created: when it was written (UTC, ISO 8601).
        tool: the ckpt version that wrote it.
        format: the checkpoint format token.
        files: path relative to the checkpoint root -> size and hex digest.
    """

    ckpt_manifest: int = MANIFEST_VERSION
    algorithm: str
    created: str
    tool: str
    format: str | None = None
    files: dict[str, FileDigest]

    def unsafe_names(self) -> list[str]:
        """The names that are no file inside the checkpoint (`../x`, `/etc/x`, a NUL): a
        corrupt or hostile manifest, refused as such, never reported as missing files."""
        out = []
        for name in self.files:
            try:
                safe_relpath(name, source="")
            except UnsafeInputError:
                out.append(name)
        return out


def refuse_unsafe_manifest(manifest: ChecksumManifest, where: str) -> None:
    """Refuse (exit 4) a manifest that names a path outside the checkpoint."""
    unsafe = manifest.unsafe_names()
    if unsafe:
        more = f" and {len(unsafe) - 1} more" if len(unsafe) > 1 else ""
        raise UnsafeInputError(
            f"names {unsafe[0]!r}{more}, not a file inside the checkpoint (an absolute path, "
            "or one that leaves it)",
            path=where,
            fix="This manifest is corrupt or hostile; do not use it. Write a new one from a "
            "known-good copy with `ckpt verify SRC --write-manifest --force`.",
        )


def manifest_exists(path: Destination) -> bool:
    """Whether a manifest file exists at `path` (local or in an object store)."""
    return destination_exists(path)


def default_manifest_path(source: Source) -> Path:
    """`ckpt-manifest.json` in the checkpoint folder (beside the file for a single file)."""
    return local_root(source) / MANIFEST_NAME


def manifest_location(source: Source, manifest: str | None) -> Destination:
    """Where the checksum manifest is: `--manifest` (a path or URL), else in the checkpoint."""
    if manifest is not None:
        loc = parse_location(manifest)
        if loc.kind == "local":
            return Path(manifest)
        return resolve_destination(manifest)
    storage = source.storage
    if storage.writable and storage.local_root is None:
        # in the object store, beside the checkpoint's files
        return storage.destination(MANIFEST_NAME)
    return default_manifest_path(source)


def local_root(source: Source) -> Path:
    """The folder of a local checkpoint (a single file: the folder it is in)."""
    root = source.storage.local_root
    assert root is not None, "callers check for a local checkpoint first"
    return root


def read_manifest(path: Destination) -> ChecksumManifest:
    """Load a checksum manifest; NotFoundError / FormatError with the fix when unusable."""
    try:
        raw = read_destination(path, MAX_JSON_RECORD)
    except FormatError as error:
        raise FormatError(
            error.problem,
            path=str(path),
            fix="Write it again with `ckpt verify SRC --write-manifest --force`.",
        ) from None
    except FileNotFoundError:
        raise NotFoundError(
            "no checksum manifest here",
            path=str(path),
            fix="Write one from a known-good copy with `ckpt verify SRC --write-manifest`, or "
            "name it with --manifest PATH.",
        ) from None
    try:
        data: Any = json.loads(raw)
        manifest = ChecksumManifest.model_validate(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(
            f"is not a valid ckpt checksum manifest ({str(exc).splitlines()[0]})",
            path=str(path),
            fix="Write it again with `ckpt verify SRC --write-manifest --force`.",
        ) from None
    refuse_unsafe_manifest(manifest, str(path))
    if manifest.algorithm not in ALGORITHMS:
        raise FormatError(
            f"records digests of unknown algorithm {manifest.algorithm!r}",
            path=str(path),
            fix=f"Update ckpt if a newer release wrote it (this one knows "
            f"{', '.join(ALGORITHMS)}), or write the manifest again with `ckpt verify SRC "
            "--write-manifest --force`.",
        )
    return manifest


def write_manifest(path: Destination, record: ChecksumManifest, force: bool) -> None:
    """Publish the manifest atomically (temporary sibling + one rename, or an upload)."""
    # python mode, not "json": pydantic turns a dict key that is not UTF-8 (a file name's lone
    # surrogates) into replacement characters, where json escapes it as `\udcff`, read back
    # to the name on disk
    data = (json.dumps(record.model_dump(), indent=2) + "\n").encode()
    with (
        staged_output(
            path, commit_marker=is_commit_marker, force=force, single_file=True
        ) as staging,
        open(staging / path.name, "wb") as fh,
    ):
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
