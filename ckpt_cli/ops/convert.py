"""`convert`: the same tensors in another format, streamed one entry at a time.

The work is `ops.transfer`'s pipeline; this module turns the command's options into a
`TransferPlan` and `WriteOptions`, guards the source, and reports what was written.
"""

from __future__ import annotations

import os
from pathlib import PurePath

from pydantic import BaseModel, Field

from .. import dtypes
from ..distributed import RankShare
from ..errors import UsageError
from ..formats.base import WriteOptions
from ..layouts import open_source
from ..models import FileInfo
from ..output import Destination, RemoteDest, resolve_destination
from ..progress import NULL_PROGRESS, Progress
from ..sizes import parse_size
from ..uri import parse_location
from .transfer import HOLDS_OBJECTS, SkippedEntry, WrittenEntry, parse_renames, plan_transfer
from .transfer import write_checkpoint as run_write

#: formats `--to` accepts
TARGETS = ("safetensors", "dcp", "torch")
SERIALIZATIONS = ("torch_save", "safetensors")
_TORCH_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class ConvertReport(BaseModel):
    """The result of `ckpt convert`.

    Attributes:
        source / source_format: what was read.
        dest / format: what was written, and as which format.
        files: the files written (paths relative to `dest`; a single-file DEST is its own name).
        tensors / objects: how many entries were written.
        tensor_bytes: bytes of tensor data written.
        raw_copies: tensors copied as raw bytes without deserialising.
        cast: the dtype floating tensors were cast to, if any; `casts` how many were.
        renamed: entries whose output name differs from the source name.
        skipped: source entries not written, with why.
        tied: groups of output names sharing storage in the source (the first name is kept).
        aliases: names written once as another tensor (safetensors `__metadata__` records them).
        max_shard_size / dcp_serialization / world_size: the layout asked for.
        checked: the output passed the format's structural check before it was published.
        entries: every entry written.
        ranks: under torchrun, what each rank wrote (empty in a single-process run).
    """

    source: str
    source_format: str
    dest: str
    format: str
    files: list[FileInfo]
    tensors: int
    objects: int
    tensor_bytes: int
    raw_copies: int
    cast: str | None = None
    casts: int = 0
    renamed: int = 0
    skipped: list[SkippedEntry] = Field(default_factory=list)
    tied: list[list[str]] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict)
    max_shard_size: int | None = None
    dcp_serialization: str | None = None
    world_size: int | None = None
    checked: bool = True
    entries: list[WrittenEntry] = Field(default_factory=list)
    ranks: list[RankShare] = Field(default_factory=list)


def _guard_paths(src: str, dest: Destination) -> None:
    """Refuse a DEST that is, contains or lies inside the source: sources are never modified."""
    loc = parse_location(src)
    if isinstance(dest, RemoteDest):
        if loc.kind != "fsspec" or loc.url is None:
            return
        # same store: compare the URLs as paths (an object store has no links to resolve)
        source, target, sep = loc.url.rstrip("/"), dest.url, "/"
    elif not loc.is_local or loc.path is None:
        return
    else:
        source, target, sep = os.path.realpath(loc.path), os.path.realpath(dest), os.sep
    for a, b in ((source, target), (target, source)):
        if a == b or b.startswith(a.rstrip(sep) + sep):
            raise UsageError(
                "DEST overlaps the source checkpoint",
                path=str(dest),
                fix="Write the converted checkpoint somewhere outside the source.",
            )


def _layout(
    to: str, dest: PurePath | RemoteDest, max_shard_size: int | None
) -> tuple[bool, str | None]:  # (single_file, basename)
    if to == "safetensors" and dest.suffix == ".safetensors":
        if max_shard_size:
            raise UsageError(
                "a sharded output needs a folder, not a .safetensors file name",
                path=str(dest),
                fix="Name a folder as DEST (shards and model.safetensors.index.json go in it).",
            )
        return True, dest.stem
    if to == "torch" and dest.suffix in _TORCH_FILE_SUFFIXES:
        if max_shard_size:
            raise UsageError(
                f"a sharded output needs a folder, not a {dest.suffix} file name",
                path=str(dest),
                fix="Name a folder as DEST.",
            )
        return True, dest.stem
    return False, None


def convert(
    src: str,
    dest: str,
    to: str,
    *,
    format: str | None = None,
    max_shard_size: str | int | None = None,
    dtype: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    renames: list[str] | None = None,
    select: str | None = None,
    dcp_serialization: str = "torch_save",
    dcp_compression: str | None = None,
    world_size: int = 1,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
) -> ConvertReport:
    """Convert `src` into format `to` at `dest`, streaming one tensor or byte range at a time.

    Args:
        src: checkpoint file, folder or URL.
        dest: output file or folder, local or an fsspec URL such as `s3://bucket/prefix`
            (refused if it exists, unless `force`).
        to: target format token (`safetensors`, `dcp`, `torch`).
        format: read `src` as this format instead of detecting it.
        max_shard_size: split the output into shards of at most this size (`5GB`, bytes).
        dtype: cast floating tensors (`bf16`, `fp16`, `fp32`); integer/bool tensors untouched.
        include / exclude: globs on source names choosing the entries.
        renames: `OLD=NEW` prefix renames.
        select: keep only the sub-tree under this prefix (`model`), stripping it.
        dcp_serialization: `torch_save` or `safetensors` (DCP target only).
        dcp_compression: `zstd` writes every DCP item through DCP's ZStandard extension.
        world_size: ranks to lay a DCP output out for (DCP target only).
        force: replace an existing `dest` once the new output is complete.
        progress: progress sink (bytes).
    """
    if to not in TARGETS:
        raise UsageError(f"cannot convert to {to!r}", fix=f"Use --to {' | '.join(TARGETS)}.")
    if dcp_compression not in (None, "none", "zstd"):
        raise UsageError(
            f"unknown DCP compression {dcp_compression!r}", fix="Use --dcp-compression zstd."
        )
    if dcp_compression not in (None, "none") and to != "dcp":
        raise UsageError("--dcp-compression applies to --to dcp only")
    if dcp_serialization not in SERIALIZATIONS:
        raise UsageError(
            f"unknown DCP serialization {dcp_serialization!r}",
            fix="Use --dcp-serialization torch_save or safetensors.",
        )
    if world_size < 1:
        raise UsageError("--world-size must be at least 1")
    if to != "dcp" and world_size != 1:
        raise UsageError("--world-size applies to --to dcp only")
    dest_path = resolve_destination(dest)
    shard_size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if shard_size and to == "dcp":
        raise UsageError(
            "--max-shard-size does not apply to DCP (one file per rank)",
            fix="Use --world-size to choose how many files a DCP output has.",
        )
    cast = dtypes.parse_user_dtype(dtype) if dtype else None
    rename_pairs = parse_renames(renames)
    _guard_paths(src, dest_path)
    single_file, basename = _layout(to, dest_path, shard_size)
    opened = open_source(src, format)
    with opened.checkpoint as checkpoint:
        manifest = checkpoint.manifest
        plan = plan_transfer(
            manifest,
            select=select,
            include=include,
            exclude=exclude,
            renames=rename_pairs,
            dtype=cast,
            keep_objects=to in HOLDS_OBJECTS,
            dedupe_tied=to == "safetensors",
        )
        metadata: dict[str, str] = {}
        if to == "safetensors":
            # carry the source's string metadata; transformers needs format=pt to load it
            metadata.update(manifest.metadata)
            metadata.update(plan.aliases)
            metadata["format"] = "pt"
        options = WriteOptions(
            max_shard_size=shard_size,
            metadata=metadata,
            basename=basename,
            single_file=single_file,
            dcp_serialization=dcp_serialization,
            world_size=world_size,
            extra={"dcp_compression": None if dcp_compression == "none" else dcp_compression},
        )
        shares: list[RankShare] = []
        files, written = run_write(
            checkpoint, plan, dest_path, to, options, force=force, progress=progress, shares=shares
        )
    tensors = [w for w in written if w.kind == "tensor"]
    return ConvertReport(
        source=manifest.location,
        source_format=manifest.format,
        dest=str(dest_path),
        format=to,
        files=files,
        tensors=len(tensors),
        objects=len(written) - len(tensors),
        tensor_bytes=sum(w.nbytes for w in tensors),
        raw_copies=sum(1 for w in written if w.how == "raw"),
        cast=cast,
        casts=sum(1 for w in written if w.how == "cast"),
        renamed=sum(1 for w in written if w.name != w.source),
        skipped=plan.skipped,
        tied=plan.tied,
        aliases=plan.aliases,
        max_shard_size=shard_size,
        dcp_serialization=dcp_serialization if to == "dcp" else None,
        world_size=world_size if to == "dcp" else None,
        entries=written,
        ranks=shares,
    )
