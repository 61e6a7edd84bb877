"""`convert`: the same tensors in another format, streamed one entry at a time.

The work is `ops.transfer`'s pipeline; this module turns the command's options into a
`TransferPlan` and `WriteOptions`, guards the source, and reports what was written.
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, Field

from .. import dtypes
from ..distributed import RankShare
from ..errors import FormatError, UsageError
from ..formats.base import Checkpoint, WriteOptions
from ..layouts import open_source
from ..layouts.megatron import keep_megatron_layout
from ..models import FileInfo
from ..output import Destination, RemoteDest, resolve_destination
from ..progress import NULL_PROGRESS, Progress
from ..quant import QuantAnalysis
from ..sizes import parse_size
from ..storage import Storage
from ..uri import parse_location
from .transfer import (
    HOLDS_OBJECTS,
    Item,
    SkippedEntry,
    TransferPlan,
    WrittenEntry,
    extra_files,
    parse_renames,
    plan_transfer,
)
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
        dry_run: nothing was written: `files` and `entries` are what would be (file sizes
            exact for safetensors outputs, None where the writer decides them).
        dequantized: quantized weights written dequantized (`--dequantize`).
        quantized_kept: quantized weights and scales written as stored although `--dtype`
            was given (`--dtype` applies to unquantized tensors only).
        config_written: `config.json` written beside the output without its quantization
            section (`--dequantize`).
        extras: non-weight files of the source folder copied unchanged into DEST
            (`config.json`, `generation_config.json`, tokenizer files...; see
            `transfer.extra_files`); empty with `extras=False` or a single-file DEST.
        warnings: things the user should know: options that had no effect (a --rename rule
            that matches no entry), an output torch cannot load (DCP safetensors serialization).
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
    dry_run: bool = False
    warnings: list[str] = Field(default_factory=list)
    dequantized: int = 0
    quantized_kept: int = 0
    config_written: str | None = None
    extras: list[str] = Field(default_factory=list)


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


def _unreadable_components(
    unreadable: dict[str, tuple[str, str]],
    skipped: list[SkippedEntry],
    select: str | None,
    include: list[str] | None,
    exclude: list[str] | None,
) -> None:
    """Fail on a component that cannot be read, unless the user left it out explicitly.

    A truncated or hostile `optimizer.pt` must never vanish from the output with exit 0:
    it fails the convert (exit 4, naming it) unless `--exclude` (or `--select` / `--include`
    choosing other entries) leaves it out; then it is listed in `skipped` with why.
    """
    import fnmatch

    def left_out(comp: str) -> str | None:
        probes = (comp, f"{comp}.", f"{comp}.x")
        if exclude and any(fnmatch.fnmatchcase(p, g) for g in exclude for p in probes):
            return "left out by --exclude"
        if select is not None and comp != select.rstrip(".") and not comp.startswith(select):
            return "outside --select"
        if include and not any(fnmatch.fnmatchcase(p, g) for g in include for p in probes):
            return "not matched by --include"
        return None

    for comp, (where, problem) in sorted(unreadable.items()):
        why = left_out(comp)
        if why is None:
            raise FormatError(
                f"the {comp} component cannot be read, so it cannot be converted: {problem}",
                path=where,
                fix=f"Repair or re-save it, or leave it out explicitly with --exclude '{comp}*'.",
            )
        skipped.append(
            SkippedEntry(
                name=comp, kind="component", reason=f"unreadable: {where}: {problem}; {why}"
            )
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
    named = _FILE_KINDS.get(dest.suffix)
    if named is not None:
        # `x.safetensors --to torch` would create a folder named x.safetensors
        wanted = {"torch": "a .pt file", "safetensors": "a .safetensors file", "dcp": "a folder"}
        raise UsageError(
            f"DEST names {named}, but --to {to} writes {wanted[to]} or a folder",
            path=str(dest),
            fix=f"Use --to {_FILE_FORMATS[dest.suffix]}, or name DEST "
            + (
                f"{dest.stem}.pt"
                if to == "torch"
                else f"{dest.stem}.safetensors"
                if to == "safetensors"
                else dest.stem
            )
            + " to write that format.",
        )
    return False, None


#: file suffixes that name one file of a format, for DEST names that contradict --to
_FILE_KINDS = {
    ".safetensors": "a safetensors file",
    **{s: "a torch.save file" for s in _TORCH_FILE_SUFFIXES},
}
_FILE_FORMATS = {".safetensors": "safetensors", **{s: "torch" for s in _TORCH_FILE_SUFFIXES}}


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
    dequantize: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
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
        dequantize: write quantized weights (FP8, MXFP4, NVFP4) dequantized to `dtype` (or the
            model's dtype) and drop their scales; without it quantized weights and their
            scales are copied as stored, in one shard, and never cast.
        progress: progress sink (bytes).
        dry_run: plan only: read metadata, write nothing, report what would be written.
        extras: carry the source folder's non-weight files (config, tokenizer...) into a
            folder DEST, so `from_pretrained(DEST)` builds the same model.
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
    if format is None:
        from .components import component_source, components_of

        found = components_of(src)
        if found is not None:
            # a diffusers pipeline / sentence-transformers folder: one component, or each
            again = dict(
                max_shard_size=shard_size,
                dtype=dtype,
                include=include,
                exclude=exclude,
                renames=renames,
                dcp_serialization=dcp_serialization,
                world_size=world_size,
                progress=progress,
            )
            if select:
                sub = component_source(src, found[1], select)
                if sub is not None:
                    return convert(sub, dest, to, force=force, **again)  # type: ignore[arg-type]
            else:
                return _convert_components(src, dest, to, found, again, force)
    single_file, basename = _layout(to, dest_path, shard_size)
    opened = open_source(src, format)
    with opened.checkpoint as base:
        from ..quant import analyse_checkpoint, logical_dtype

        analysis = analyse_checkpoint(base.manifest, base.storage)
        checkpoint: Checkpoint = base
        dequantized = 0  # weights a DequantizedCheckpoint turned into plain entries
        if dequantize:
            if not analysis.quantized:
                raise UsageError(
                    "--dequantize: no quantized weight found (FP8, MXFP4, NVFP4)",
                    path=src,
                    fix="Drop --dequantize; `ckpt inspect` shows what the checkpoint holds.",
                )
            from ..quant.dequant import DequantizedCheckpoint

            plain = DequantizedCheckpoint(base, analysis, logical_dtype(analysis, cast))
            checkpoint, dequantized = plain, len(plain.logical)
        manifest = checkpoint.manifest
        from ..layouts import select_view

        # torchtitan keeps the model's keys at the top level: `--select model` takes them as-is
        view = select_view(opened, select)
        plan = plan_transfer(
            view or manifest,
            select=None if view is not None else select,
            include=include,
            exclude=exclude,
            renames=rename_pairs,
            dtype=cast,
            keep_objects=to in HOLDS_OBJECTS,
            dedupe_tied=to == "safetensors",
        )
        kept = 0 if dequantize else keep_quantized(plan, analysis)
        if manifest.format == "gguf":
            # quantized GGUF tensors are reported as such, not as generic objects
            from ..formats.gguf import skip_reason

            for skipped in plan.skipped:
                reason = skip_reason(manifest.by_name[skipped.name])
                if reason:
                    skipped.reason = reason
        _unreadable_components(opened.unreadable, plan.skipped, select, include, exclude)
        metadata: dict[str, str] = {}
        if to == "safetensors":
            # carry the source's string metadata; transformers needs format=pt to load it
            metadata.update(manifest.metadata)
            metadata.update(plan.aliases)
            metadata["format"] = "pt"
        warnings = _unused_renames(plan, rename_pairs, select)
        # eco: a Megatron-Core torch_dist source stays one (its common.pt + metadata.json)
        megatron_files = keep_megatron_layout(checkpoint, plan, to)
        if dry_run:
            return _dry_run_report(
                manifest,
                plan,
                dest_path,
                to,
                metadata,
                shard_size,
                basename,
                single_file,
                cast,
                dcp_serialization,
                world_size,
                warnings,
            )
        options = WriteOptions(
            max_shard_size=shard_size,
            metadata=metadata,
            basename=basename,
            single_file=single_file,
            dcp_serialization=dcp_serialization,
            world_size=world_size,
            extra={"dcp_compression": None if dcp_compression == "none" else dcp_compression},
        )
        if analysis.quantized and not dequantize:
            renamed = {i.source.name: i.target.name for i in plan.items}
            options.extra["together"] = [
                [renamed[n] for n in group if n in renamed] for group in analysis.together()
            ]
        if not single_file and to in ("safetensors", "torch") and format is None:
            # keep the source library's file names (adapter_model, diffusion_pytorch_model...)
            from ..layouts.model_folders import apply_naming

            apply_naming(src, to, options)
        shares: list[RankShare] = []
        carried = extra_files(checkpoint) if extras and not single_file else []
        carried += megatron_files  # eco: Megatron's own files, copied unchanged
        config_written = None
        if dequantize and not single_file:
            # published with the weights (a companion), never the source's quantized config
            rewritten = dequantized_config(base.storage)
            if rewritten is not None:
                options.extra.setdefault("companions", {})["config.json"] = rewritten
                config_written = str(PurePath(str(dest_path)) / "config.json")
        files, written = run_write(
            checkpoint,
            plan,
            dest_path,
            to,
            options,
            force=force,
            progress=progress,
            shares=shares,
            extras=carried,
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
        dequantized=dequantized,
        quantized_kept=kept,
        config_written=config_written,
        extras=carried,
        warnings=warnings + (dcp_warnings(dcp_serialization) if to == "dcp" else []),
    )


def _unused_renames(
    plan: TransferPlan, renames: list[tuple[str, str]], select: str | None
) -> list[str]:
    """A --rename rule that renames no entry has no effect: say so (reshard warns likewise)."""
    strip = f"{select}." if select else ""
    names = [i.source.name.removeprefix(strip) for i in plan.items]
    names += [s.name.removeprefix(strip) for s in plan.skipped]
    used = set()
    for name in names:
        for n, (old, _new) in enumerate(renames):
            if name.startswith(old):
                used.add(n)
                break  # first match wins
    return [
        f"--rename {old}={new} matches no entry (names are matched after --select; "
        "see `ckpt inspect --list`)"
        for n, (old, new) in enumerate(renames)
        if n not in used
    ]


def _dry_run_report(
    manifest: Any,
    plan: TransferPlan,
    dest: Destination,
    to: str,
    metadata: dict[str, str],
    shard_size: int | None,
    basename: str | None,
    single_file: bool,
    cast: str | None,
    dcp_serialization: str,
    world_size: int,
    warnings: list[str],
) -> ConvertReport:
    """What `convert` would write, from the plan alone: entries, files, sizes."""
    from ..formats.safetensors import encode_header, plan_shards, shard_names

    entries = [
        WrittenEntry(
            name=i.target.name,
            source=i.source.name,
            kind=i.target.kind,
            dtype=i.target.dtype,
            shape=list(i.target.shape or []),
            nbytes=i.target.nbytes,
            how="object" if i.target.kind != "tensor" else "cast" if i.cast else "tensor",
        )
        for i in plan.items
    ]
    tensors = [i.target for i in plan.items if i.target.kind == "tensor"]
    files: list[FileInfo] = []
    if to == "safetensors":
        shards = plan_shards(tensors, shard_size)
        stem = basename or "model"
        names = [PurePath(str(dest)).name] if single_file else shard_names(stem, len(shards))
        for name, shard in zip(names, shards, strict=True):
            size = len(encode_header(shard, metadata)) + sum(e.nbytes for e in shard)
            files.append(FileInfo(path=name, size=size, entries=len(shard)))
        if len(shards) > 1:
            files.append(FileInfo(path=f"{stem}.safetensors.index.json", entries=len(tensors)))
    elif to == "torch":
        from ..formats import torch_save

        if single_file:
            files.append(FileInfo(path=PurePath(str(dest)).name, entries=len(entries)))
        else:
            groups = plan_shards([i.target for i in plan.items], shard_size)
            stem = basename or "pytorch_model"
            for name, group in zip(torch_save.shard_names(stem, len(groups)), groups, strict=True):
                files.append(FileInfo(path=name, entries=len(group)))
            if len(groups) > 1:
                files.append(FileInfo(path=f"{stem}.bin.index.json", entries=len(entries)))
    else:
        files += [FileInfo(path=f"__{r}_0.distcp") for r in range(world_size)]
        files.append(FileInfo(path=".metadata", entries=len(entries)))
    return ConvertReport(
        source=manifest.location,
        source_format=manifest.format,
        dest=str(dest),
        format=to,
        files=files,
        tensors=len(tensors),
        objects=len(entries) - len(tensors),
        tensor_bytes=sum(e.nbytes for e in tensors),
        raw_copies=0,
        cast=cast,
        casts=sum(1 for i in plan.items if i.cast),
        renamed=sum(1 for e in entries if e.name != e.source),
        skipped=plan.skipped,
        tied=plan.tied,
        aliases=plan.aliases,
        max_shard_size=shard_size,
        dcp_serialization=dcp_serialization if to == "dcp" else None,
        world_size=world_size if to == "dcp" else None,
        entries=entries,
        dry_run=True,
        warnings=warnings,
    )


def keep_quantized(plan: TransferPlan, analysis: QuantAnalysis) -> int:
    """Never cast a quantized weight or its scales; keep each weight's scales right after it.

    Returns how many tensors a `--dtype` cast would have touched but was kept as stored.
    """
    if not analysis.quantized:
        return 0
    kept = 0
    for item in plan.items:
        if item.source.name in analysis.owner and item.cast is not None:
            item.cast = None
            item.target = item.target.model_copy(
                update={"dtype": item.source.dtype, "nbytes": item.source.nbytes}
            )
            kept += 1
    # scales follow their weight, so a shard split never separates them
    by_name = {item.source.name: item for item in plan.items}
    ordered: list[Item] = []
    placed: set[str] = set()
    for item in plan.items:
        name = item.source.name
        if name in placed:
            continue
        owner = analysis.owner.get(name)
        members = analysis.weights[owner].members if owner is not None else [name]
        for member in members:
            if member in by_name and member not in placed:
                ordered.append(by_name[member])
                placed.add(member)
        if name not in placed:
            ordered.append(item)
            placed.add(name)
    plan.items = ordered
    return kept


def dequantized_config(storage: Storage) -> bytes | None:
    """The source's `config.json` without its quantization section (None when it has none).

    A `config.json` that still declares quantization would make loaders expect scales that a
    dequantized output no longer has.
    """
    import json

    from ..quant import without_quantization

    if not storage.exists("config.json"):
        return None
    try:
        config = json.loads(storage.read_all("config.json"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    return (json.dumps(without_quantization(config), indent=2) + "\n").encode()


def _convert_components(
    src: str,
    dest: str,
    to: str,
    found: tuple[str, list[Any]],
    again: dict[str, Any],
    force: bool,
) -> ConvertReport:
    """Every component of a multi-folder model converted with its own naming, one DEST."""
    from .components import write_components

    layout, components = found

    def one(inner_src: str, inner_dest: str, target: str) -> ConvertReport:
        return convert(inner_src, inner_dest, target, **again)

    files, reports = write_components(src, dest, layout, components, to, one, force=force)
    return ConvertReport(
        source=src,
        source_format=layout,
        dest=dest,
        format=to,
        files=files,
        tensors=sum(r.tensors for r in reports),
        objects=sum(r.objects for r in reports),
        tensor_bytes=sum(r.tensor_bytes for r in reports),
        raw_copies=sum(r.raw_copies for r in reports),
        cast=next((r.cast for r in reports if r.cast), None),
        casts=sum(r.casts for r in reports),
        renamed=sum(r.renamed for r in reports),
        skipped=[s for r in reports for s in r.skipped],
        max_shard_size=again.get("max_shard_size"),
        entries=[e for r in reports for e in r.entries],
    )


def dcp_warnings(dcp_serialization: str) -> list[str]:
    """What to tell a user about a DCP output of this serialization (written by ckpt)."""
    if dcp_serialization == "safetensors":
        import torch

        return [
            f"a DCP with safetensors serialization cannot be read by torch {torch.__version__}'s "
            "dcp.load (its loader reads torch_save serialization only); ckpt reads it, and "
            "--dcp-serialization torch_save writes one dcp.load restores"
        ]
    return []
