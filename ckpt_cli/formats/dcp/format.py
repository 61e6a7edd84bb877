"""`DcpFormat`: detection, open (the manifest) and check of a DCP folder."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ...errors import FormatError, NotFoundError
from ...findings import problem_from_error
from ...models import Entry, FileInfo, KeyedEntry, KeyStep, Manifest, Problem
from ..base import Format, Source, WriteOptions
from ..details import DcpDetails
from ..safetensors.format import DCP_HF_SHARD, is_dcp_hf_sharded
from .check import analysed, check_saved_tensors, peek_objects
from .layout import (
    MEGATRON_COMMON,
    MEGATRON_METADATA,
    METADATA,
    RANK_METADATA,
    SERIALIZATIONS,
    SUFFIX,
    rank_file,
    world_size,
)
from .megatron import MEGATRON_LAYOUT
from .metadata import planner_keys
from .reader import DcpCheckpoint
from .writer import DcpWriter


class DcpFormat(Format):
    """PyTorch Distributed Checkpoint folders (torch_save and safetensors serializations)."""

    name = "dcp"
    title = "DCP"
    writable = True
    folder = True
    holds_objects = True
    object_bytes = True
    shards_by_rank = True
    serializations = SERIALIZATIONS
    loader_serializations = ("torch_save",)  # torch's dcp.load reads only this one
    chunked_serializations = ("torch_save",)
    compressions = ("zstd",)
    commit_marker = METADATA
    layout_files: ClassVar[dict[str, tuple[str, ...]]] = {MEGATRON_LAYOUT: (MEGATRON_METADATA,)}
    details_model = DcpDetails
    rank_file = staticmethod(rank_file)

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            return source.target == METADATA or source.target.endswith(SUFFIX)
        names = source.top_level()
        return any(
            n == METADATA or n.endswith(SUFFIX) or RANK_METADATA.match(n) for n in names
        ) or is_dcp_hf_sharded(names)

    @classmethod
    def _folder(cls, source: Source) -> Source:
        # SRC may name the .metadata file or a .distcp file: read the folder around it
        if source.target is None:
            return source
        name = source.target.rsplit("/", 1)[-1]
        own = (METADATA, MEGATRON_COMMON, MEGATRON_METADATA)
        if not (
            name in own
            or name.endswith(SUFFIX)
            or RANK_METADATA.match(name)
            or DCP_HF_SHARD.match(name)
        ):
            # another file read as DCP (`--format dcp`): the folder around it is no DCP save
            # of its own, and any .distcp files below it are none of this file's
            raise FormatError(
                "is not a DCP checkpoint: a DCP save is a folder of .metadata and .distcp "
                "files, and this is another file",
                path=source.location.raw,
                fix="Leave out --format to detect the format, or pass the format it is "
                "(--format safetensors, --format torch).",
            )
        return Source(location=source.location, storage=source.storage, target=None)

    @classmethod
    def open(cls, source: Source) -> DcpCheckpoint:
        source = cls._folder(source)
        layout = analysed(source)
        errors = [p for p in layout.problems if p.severity == "error"]
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
            where = source.storage.describe(first.file) if first.file else source.location.raw
            raise FormatError(
                f"{first.message}{more}",
                path=where,
                fix="`ckpt verify` lists every problem; use a complete copy of the checkpoint.",
            )
        peek_objects(source.storage, layout)
        files = [
            FileInfo(path=name, size=size, entries=0)
            for name, size in layout.files.items()
            if name in (METADATA, MEGATRON_COMMON, MEGATRON_METADATA)
            or name.endswith(SUFFIX)
            or DCP_HF_SHARD.match(name)
            or RANK_METADATA.match(name)
        ]
        counts: dict[str, int] = {}
        for entry in layout.entries:
            for name in {c.file for c in entry.chunks or []}:
                counts[name] = counts.get(name, 0) + 1
        files = [f.model_copy(update={"entries": counts.get(f.path, 0)}) for f in files]
        serialization = sorted(layout.serialization)
        details = DcpDetails(
            serialization=serialization[0]
            if len(serialization) == 1
            else ("mixed" if serialization else "none"),
            world_size=world_size(layout),
            chunks=sum(len(e.chunks or []) for e in layout.entries if e.kind == "tensor"),
            objects_bytes=sum(e.nbytes for e in layout.entries if e.kind == "object"),
            version=layout.version,
        )
        if layout.transforms:
            details.compression = {"zstd": len(layout.transforms)}
        if layout.megatron is not None:
            details.layout = MEGATRON_LAYOUT
            details.megatron = layout.megatron
        manifest = Manifest(
            format="dcp",
            location=source.location.raw,
            files=files,
            entries=nested_entries(layout.entries, layout.planner_data),
            details=details.as_details(),
        )
        checkpoint = DcpCheckpoint(source, manifest, layout.planner_data)
        checkpoint.transforms = dict(layout.transforms)
        return checkpoint

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        source = cls._folder(source)
        try:
            layout = analysed(source)
        except (FormatError, NotFoundError) as error:
            return [problem_from_error(error)]
        check_saved_tensors(source.storage, layout)
        return [_described(p, source) for p in layout.problems]

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> DcpWriter:
        return DcpWriter(staging, plan, options)


def nested_entries(entries: list[Entry], planner_data: object) -> list[Entry]:
    """`entries`, each one that `planner_data` places below the top level of the saved state
    dict (`optim` -> `param_groups` -> 0 -> `lr`) as a `KeyedEntry` with that key path, so a
    conversion nests it where `dcp.save` found it. A flat state dict's entries (one path
    component each, what `dcp.save(model.state_dict())` records) stay as they are.

    An optimizer's `state` is keyed by int parameter ids, which `dcp.save` records as strings.
    They are ints again here (see `optimizer_ids_restored`): a dict keyed "0" loads into
    `optimizer.load_state_dict` without an error and restores no state at all."""
    if not isinstance(planner_data, dict):
        return entries
    paths: list[tuple[KeyStep, ...] | None] = []
    for entry in entries:
        path = planner_data.get(entry.name)
        paths.append(
            planner_keys(path, entry.name) if isinstance(path, tuple) and len(path) > 1 else None
        )
    paths = optimizer_ids_restored(paths)
    return [
        entry if keys is None else KeyedEntry.placed(entry, keys)
        for entry, keys in zip(entries, paths, strict=True)
    ]


def optimizer_ids_restored(
    paths: list[tuple[KeyStep, ...] | None],
) -> list[tuple[KeyStep, ...] | None]:
    """`paths` with the parameter ids of each optimizer state dict as ints: the decimal keys
    of a `state` dict whose parent also holds `param_groups`, the shape of every
    `torch.optim.Optimizer.state_dict()`. An optimizer keyed by parameter names
    (`get_optimizer_state_dict`) has no decimal keys there and is left alone."""
    optimizers = {
        keys[:depth]
        for keys in paths
        if keys is not None
        for depth, (_, key) in enumerate(keys)
        if key == "param_groups"
    }
    if not optimizers:
        return paths
    restored: list[tuple[KeyStep, ...] | None] = []
    for keys in paths:
        if keys is not None:
            for depth in range(len(keys) - 1):
                kind, key = keys[depth + 1]
                if (
                    keys[depth][1] == "state"
                    and kind == "dict"
                    and isinstance(key, str)
                    and key.isascii()
                    and key.isdecimal()
                    and keys[:depth] in optimizers
                ):
                    keys = (*keys[: depth + 1], ("dict", int(key)), *keys[depth + 2 :])
                    break
        restored.append(keys)
    return restored


def _described(problem: Problem, source: Source) -> Problem:
    """`problem` as `check` reports it: its file as the user names it."""
    if not problem.file:
        return problem
    return problem.model_copy(update={"file": source.storage.describe(problem.file)})
