"""PyTorch Distributed Checkpoint (DCP): a folder with `.metadata` and `__{rank}_{n}.distcp` files.

I/O strategy. `open` reads `.metadata` with a restricted unpickler (`dcp_metadata`, no torch,
nothing callable outside the DCP metadata classes) and the file listing; for the safetensors
serialization it also reads each `.distcp` file's embedded safetensors header (one small read
per file) to find where every chunk's raw bytes are. Every file name in `.metadata` goes through
`safe_relpath`/`Storage`. Reads move one chunk at a time: a torch_save chunk is one ranged read
loaded with `torch.load(weights_only=True)`; a raw chunk is read straight into a tensor
(`os.preadv` locally). `read_slice` touches only the chunks that overlap the requested box and,
for raw chunks split along dim 0, only the rows it needs.

Layouts, as torch 2.13's `FileSystemWriter` writes them:

* torch_save (default): each rank file holds its non-tensor items (a `torch.save` of the
  object each) and then one `torch.save` blob per tensor chunk; `storage_data` gives each
  item's (file, offset, length).
* safetensors (`FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`): each
  rank file holds its non-tensor items, then ONE safetensors blob (header + raw data) with
  every tensor chunk of that rank keyed by its fqn, and `DCP_SHARDING_INFO` metadata giving
  each chunk's offsets. `storage_data` points every tensor item at the start of that blob with
  the chunk's byte count as its length, so the real ranges come from the embedded header.
  (torch 2.13's own `FileSystemReader` cannot load this layout: it calls `torch.load` on it.)

Also read: `dcp.save(..., use_collectives=False)` folders (per-rank `__{r}.metadata`, merged)
and the per-rank `shard-NNNNN-model-…safetensors` files of `HuggingFaceStorageWriter(
save_distributed=True)` (no `.metadata`; chunk offsets from `DCP_SHARDING_INFO`).

Manifest: tensor entries carry `chunks` (box, file, byte range, `raw`); object entries carry
`file`, `offset` and `nbytes` of their stored `torch.save` blob, and `py_type`/`value` when the
blob holds plain Python data.

The writer streams chunks into `__{rank}_0.distcp` files and writes `.metadata` last (with
torch's own classes, so `dcp.load` reads it).
"""

from __future__ import annotations

import gc
import io
import json
import os
import re
import struct
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, cast

from .. import dtypes
from ..errors import CkptError, FormatError, NotFoundError
from ..models import Chunk, Entry, FileInfo, Manifest, Problem
from ..placement import Box, shard_dim0_boxes
from ..storage import LocalStorage, RangeFile, Storage, safe_relpath
from .base import COPY_BLOCK, Checkpoint, Format, Source, WriteOptions, Writer
from .dcp_metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    common_leaf,
    load_metadata,
    peek_saved_mapping,
    peek_saved_object,
    peek_saved_tensor,
)
from .safetensors import DCP_HF_SHARD, is_dcp_hf_sharded, read_header

if TYPE_CHECKING:
    import torch

METADATA = ".metadata"
SUFFIX = ".distcp"
SERIALIZATIONS = ("torch_save", "safetensors")
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: per-rank metadata of `dcp.save(..., use_collectives=False)` (no global `.metadata`)
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
#: safetensors metadata keys torch's DCP writer puts in each embedded blob
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
_MAX_HEADER = 100 << 20
_ZIP_MAGIC = b"PK\x03\x04"


def rank_file(rank: int) -> str:
    """The data file DCP's FileSystemWriter gives rank `rank` (single file per rank)."""
    return f"__{rank}_0{SUFFIX}"


def rank_chunk(rank: int, box: Box) -> Chunk:
    """The chunk `box` as rank `rank` writes it, into its own `rank_file` (bytes not yet placed)."""
    return Chunk(
        offsets=list(box.offsets),
        sizes=list(box.sizes),
        file=rank_file(rank),
        byte_offset=0,
        byte_length=0,
    )


# --------------------------------------------------------------------------------------------
# Reading and validating the layout


@dataclass
class _Layout:
    """What `.metadata` plus the file listing (plus embedded safetensors headers) say."""

    entries: list[Entry] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    serialization: set[str] = field(default_factory=set)
    files: dict[str, int] = field(default_factory=dict)
    planner_data: Any = None
    version: str | None = None
    #: Megatron-Core torch_dist: metadata.json's backend fields and common.pt's keys
    megatron: dict[str, Any] | None = None
    #: (file, byte offset) -> stream transform of items stored through one (`zstd`)
    transforms: dict[tuple[str, int], str] = field(default_factory=dict)

    def problem(
        self, code: str, message: str, file: str | None = None, tensor: str | None = None
    ) -> None:
        self.problems.append(Problem(code=code, message=message, file=file, tensor=tensor))


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _int_list(value: Any) -> list[int] | None:
    """`value` as a list of non-negative ints, or None when it is anything else."""
    if isinstance(value, (tuple, list)) and all(map(_is_count, value)):
        return list(value)
    return None


def _read_metadata(source: Source, listing: dict[str, int], layout: _Layout) -> Metadata:
    """`.metadata`, or the union of the per-rank `__{r}.metadata` files that
    `dcp.save(..., use_collectives=False)` writes instead."""
    storage = source.storage
    if METADATA in listing:
        return load_metadata(storage.read_all(METADATA), storage.describe(METADATA))
    names = sorted(
        (n for n in listing if _RANK_METADATA.match(n)),
        key=lambda n: int(_RANK_METADATA.match(n).group(1)),  # type: ignore[union-attr]
    )
    merged = Metadata()
    merged.state_dict_metadata, merged.storage_data, merged.planner_data = {}, {}, {}
    for name in names:
        where = storage.describe(name)
        md = load_metadata(storage.read_all(name), where)
        if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
            raise FormatError("is missing its state_dict_metadata or storage_data", path=where)
        for fqn, item in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(fqn)
            if have is None:
                if isinstance(item, TensorStorageMetadata) and isinstance(item.chunks, list):
                    copy = TensorStorageMetadata()
                    copy.properties, copy.size, copy.chunks = (
                        item.properties,
                        item.size,
                        list(item.chunks),
                    )
                    item = copy
                merged.state_dict_metadata[fqn] = item
            elif isinstance(have, TensorStorageMetadata) and isinstance(
                item, TensorStorageMetadata
            ):
                if have.size != item.size or getattr(have.properties, "dtype", None) != getattr(
                    item.properties, "dtype", None
                ):
                    layout.problem(
                        "dcp_mismatch",
                        f"tensor {fqn!r} has a different size or dtype than in an earlier "
                        "rank's metadata",
                        file=name,
                        tensor=fqn,
                    )
                known = {tuple(getattr(c, "offsets", ()) or ()) for c in have.chunks}
                for chunk in item.chunks if isinstance(item.chunks, list) else []:
                    if tuple(getattr(chunk, "offsets", ()) or ()) not in known:
                        have.chunks.append(chunk)
        merged.storage_data.update(md.storage_data)
        if isinstance(md.planner_data, dict):
            merged.planner_data.update(md.planner_data)
        merged.version = md.version
    ranks = {int(m.group(1)) for n in names if (m := _RANK_METADATA.match(n))}
    for name in listing:
        match = _RANK_FILE.match(name)
        if match and int(match.group(1)) not in ranks:
            layout.problem(
                "dcp_interrupted",
                f"rank {match.group(1)} wrote {name} but no __{match.group(1)}.metadata: its "
                "save looks interrupted",
                file=name,
            )
    return merged


def _storage_index(md: Metadata, where: str) -> dict[tuple[Any, Any], StorageInfo]:
    storage_data = md.storage_data
    if not isinstance(storage_data, dict):
        raise FormatError("has no storage_data map", path=where, fix="The file is corrupt.")
    index: dict[tuple[Any, Any], StorageInfo] = {}
    for key, info in storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, StorageInfo):
            raise FormatError("has a malformed storage_data entry", path=where)
        if not isinstance(key.fqn, str):
            raise FormatError("has a storage_data key without a name", path=where)
        index[key.key()] = info
    return index


#: DCP's `ZStandard` stream extension (`torch.distributed.checkpoint._extension`)
ZSTD_DESCRIPTOR = "stream.zstd/1"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: what a compressed torch_save item may grow to beyond its tensor bytes (zip + pickle)
_SAVE_OVERHEAD = 1 << 20
#: the cap for a compressed object entry: no decompression bomb exhausts memory
_OBJECT_INFLATE_MAX = 256 << 20


def _transform_of(descriptors: Any, name: str, where: str) -> str:
    """The transform an item's `transform_descriptors` name; only `stream.zstd/1.*` is read."""
    if isinstance(descriptors, (list, tuple)) and len(descriptors) == 1:
        registry, _, version = str(descriptors[0]).partition("/")
        if registry == "stream.zstd" and version.partition(".")[0] == "1":
            return "zstd"
    raise FormatError(
        f"entry {name!r} is stored through stream transforms {list(descriptors)!r}; this tool "
        f"reads {ZSTD_DESCRIPTOR} (DCP's ZStandard extension) only",
        path=where,
        fix="Save with FileSystemWriter(..., _extensions=[ZStandard()]) or without _extensions.",
    )


def inflate(source: IO[bytes] | bytes, limit: int, where: str, what: str) -> bytes:
    """Decompress one zstd-compressed DCP item (at most `limit` bytes, else FormatError)."""
    import zstandard

    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
        while True:
            piece = reader.read(1 << 20)
            if not piece:
                break
            out += piece
            if len(out) > limit:
                raise FormatError(
                    f"{what}: the zstd stream inflates past {limit} bytes, more than the item "
                    "can hold",
                    path=where,
                    fix="The file is corrupt or hostile; it was not loaded.",
                )
    except zstandard.ZstdError as exc:
        raise FormatError(
            f"{what}: not a valid zstd stream ({exc})",
            path=where,
            fix="The file is corrupt or truncated; use a complete copy of the checkpoint.",
        ) from None
    return bytes(out)


class InterruptedSaveError(FormatError):
    """A DCP folder with data files but no `.metadata`: the save did not finish (exit 4)."""

    code = "dcp_interrupted"


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building the manifest.

    Unpickling `.metadata` and building entries creates hundreds of thousands of small objects
    and no cycles; with the GC on, each allocation burst triggers full collections over the
    growing heap, which made this 4-6x slower on a 40,000-chunk checkpoint.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _analyse(source: Source) -> _Layout:
    """Read the layout of `source` (see `_analyse_unpaused`) with the GC paused."""
    with _gc_paused():
        return _analyse_unpaused(source)


def _analyse_unpaused(source: Source) -> _Layout:
    """Read `.metadata` and check it against the files; collect every problem found.

    Raises FormatError only when the metadata itself cannot be read (missing, hostile, corrupt).
    """
    storage = source.storage
    listing = storage.list_files() if source.target is not None else source.files
    where = storage.describe(METADATA)
    if METADATA not in listing and is_dcp_hf_sharded([n for n in listing if "/" not in n]):
        return _analyse_hf_shards(source, listing)
    if METADATA not in listing and not any(n.endswith(SUFFIX) for n in listing):
        # not an interrupted DCP save: nothing of DCP at all (`--format dcp` on another format)
        others = sorted({n.rsplit(".", 1)[-1] for n in listing if "." in n.lstrip(".")})
        holds = (
            f"it holds {', '.join('.' + o for o in others[:5])} files" if others else "it is empty"
        )
        raise FormatError(
            f"is not a DCP checkpoint: no .metadata and no .distcp files ({holds})",
            path=source.location.raw,
            fix="Leave out --format to detect the format, or pass the format it is "
            "(--format safetensors, --format torch).",
        )
    if METADATA not in listing and not any(_RANK_METADATA.match(n) for n in listing):
        raise InterruptedSaveError(
            f"has {sum(n.endswith(SUFFIX) for n in listing)} .distcp file(s) but no .metadata: "
            "the save looks interrupted (DCP writes .metadata last)",
            path=source.location.raw,
            fix="Use the previous complete checkpoint or save again; this one cannot be loaded.",
        )
    layout = _Layout(files=dict(listing))
    md = _read_metadata(source, listing, layout)
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise FormatError("has no state_dict_metadata map", path=where, fix="The file is corrupt.")
    index = _storage_index(md, where)
    layout.planner_data = md.planner_data
    layout.version = md.version if isinstance(md.version, str) else None
    # resolved file names, checked once each
    safe_names: dict[str, str] = {}

    def resolve(info: StorageInfo, name: str) -> tuple[str, int, int]:
        rel = info.relative_path
        if not isinstance(rel, str):
            raise FormatError(f"entry {name!r} has no file name", path=where)
        if rel not in safe_names:
            safe_names[rel] = safe_relpath(rel, source=where)
        offset, length = info.offset, info.length
        if not (_is_count(offset) and _is_count(length)):
            raise FormatError(f"entry {name!r} has an invalid byte range", path=where)
        if info.transform_descriptors:
            layout.transforms[(safe_names[rel], offset)] = _transform_of(
                info.transform_descriptors, name, where
            )
        return safe_names[rel], offset, length

    pending: list[tuple[str, str, list[int], list[tuple[list[int], list[int], str, int, int]]]] = []
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError("has a state_dict_metadata key that is not a string", path=where)
        if isinstance(item, BytesStorageMetadata):
            info = index.get((fqn, None))
            if info is None:
                layout.problem(
                    "dcp_missing_storage",
                    f"object {fqn!r} has no storage entry in .metadata",
                    file=METADATA,
                    tensor=fqn,
                )
                continue
            rel, offset, length = resolve(info, fqn)
            layout.entries.append(
                Entry.model_construct(
                    name=fqn,
                    kind="object",
                    dtype=None,
                    shape=[],
                    nbytes=length,
                    file=rel,
                    offset=offset,
                    chunks=None,
                    py_type=None,
                    value=None,
                )
            )
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise FormatError(f"entry {fqn!r} has an unknown storage kind", path=where)
        props = item.properties
        dtype = getattr(props, "dtype", None)
        shape = _int_list(item.size)
        if not isinstance(dtype, str) or not dtypes.is_known(dtype):
            raise FormatError(
                f"tensor {fqn!r} has dtype {dtype!r}, which this tool does not support",
                path=where,
                fix="Upgrade ckpt if this is a new dtype; otherwise the file is corrupt.",
            )
        if shape is None:
            raise FormatError(f"tensor {fqn!r} has an invalid size {item.size!r}", path=where)
        if not isinstance(item.chunks, list):
            raise FormatError(f"tensor {fqn!r} has no chunk list", path=where)
        chunks: list[tuple[list[int], list[int], str, int, int]] = []
        for chunk in item.chunks:
            offsets = _int_list(getattr(chunk, "offsets", None))
            sizes = _int_list(getattr(chunk, "sizes", None))
            if offsets is None or sizes is None or len(offsets) != len(shape) != len(sizes):
                raise FormatError(f"tensor {fqn!r} has a malformed chunk", path=where)
            if len(sizes) != len(shape):
                raise FormatError(f"tensor {fqn!r} has a malformed chunk", path=where)
            info = index.get((fqn, tuple(offsets)))
            if info is None:
                layout.problem(
                    "dcp_missing_storage",
                    f"tensor {fqn!r}: chunk at {offsets} has no storage entry in .metadata",
                    file=METADATA,
                    tensor=fqn,
                )
                continue
            rel, offset, length = resolve(info, fqn)
            chunks.append((offsets, sizes, rel, offset, length))
        pending.append((fqn, dtype, shape, chunks))

    raw_ranges = _locate_raw_chunks(source, layout, pending)
    for fqn, dtype, shape, chunks in pending:
        built: list[Chunk] = []
        for offsets, sizes, rel, offset, length in chunks:
            raw = raw_ranges.get((rel, fqn, tuple(offsets)))
            if raw is not None:
                built.append(
                    Chunk(
                        offsets=offsets,
                        sizes=sizes,
                        file=rel,
                        byte_offset=raw[0],
                        byte_length=raw[1],
                        raw=True,
                    )
                )
            else:
                built.append(
                    Chunk(
                        offsets=offsets,
                        sizes=sizes,
                        file=rel,
                        byte_offset=offset,
                        byte_length=length,
                    )
                )
        nbytes = dtypes.numel(shape) * dtypes.itemsize(dtype)
        whole = len(built) == 1 and built[0].raw and built[0].sizes == shape
        layout.entries.append(
            Entry.model_construct(
                name=fqn,
                kind="tensor",
                dtype=dtype,
                shape=shape,
                nbytes=nbytes,
                file=built[0].file if built else None,
                offset=built[0].byte_offset if whole else None,
                chunks=built,
                py_type=None,
                value=None,
            )
        )
    _check_files(layout)
    _check_coverage(layout)
    _read_megatron_common(storage, listing, layout)
    return layout


#: Megatron-Core `dist_checkpointing` (`torch_dist` backend) writes these beside the DCP files
MEGATRON_COMMON = "common.pt"
MEGATRON_METADATA = "metadata.json"
_MEGATRON_COMMON_MAX = 256 << 20
_MEGATRON_METADATA_MAX = 1 << 20


def _read_megatron_common(storage: Storage, listing: dict[str, int], layout: _Layout) -> None:
    """Megatron-Core torch_dist: `metadata.json` (backend names) and `common.pt` (the state
    every rank shares: iteration, args, ...), whose top-level keys Megatron merges into the
    sharded state on load. Each key becomes an object entry read from `common.pt`; the peek
    uses no torch and resolves no global (`peek_saved_mapping`)."""
    if MEGATRON_METADATA not in listing and MEGATRON_COMMON not in listing:
        return
    info: dict[str, Any] = {}
    if MEGATRON_METADATA in listing:
        try:
            if listing[MEGATRON_METADATA] > _MEGATRON_METADATA_MAX:
                raise ValueError("larger than 1 MiB")
            doc = json.loads(storage.read_all(MEGATRON_METADATA))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            layout.problem(
                "megatron_metadata",
                f"{MEGATRON_METADATA} is not Megatron-Core's backend description ({exc})",
                file=MEGATRON_METADATA,
            )
            doc = {}
        info["metadata"] = {k: v for k, v in doc.items() if isinstance(v, (str, int, float))}
        if doc.get("sharded_backend") not in (None, "torch_dist"):
            layout.problem(
                "megatron_backend",
                f"{MEGATRON_METADATA} names sharded backend {doc.get('sharded_backend')!r}; "
                "only torch_dist (a DCP) is read",
                file=MEGATRON_METADATA,
            )
    if MEGATRON_COMMON not in listing:
        layout.problem(
            "megatron_missing_common",
            f"{MEGATRON_COMMON} is missing: Megatron-Core keeps the state every rank shares "
            "(iteration, args...) in it, and its load needs it",
            file=MEGATRON_COMMON,
        )
        layout.megatron = info
        return
    keys = None
    if listing[MEGATRON_COMMON] <= _MEGATRON_COMMON_MAX:
        keys = peek_saved_mapping(storage.read_all(MEGATRON_COMMON))
    if keys is None:
        layout.problem(
            "megatron_common",
            f"{MEGATRON_COMMON} is not a torch.save file of a dict with string keys (or is "
            "larger than 256 MiB)",
            file=MEGATRON_COMMON,
        )
        keys = {}
    taken = {e.name for e in layout.entries}
    for key, (py_type, value) in keys.items():
        if key in taken:
            layout.problem(
                "megatron_common_clash",
                f"{MEGATRON_COMMON} key {key!r} is also a sharded entry; the sharded one is read",
                file=MEGATRON_COMMON,
                tensor=key,
            )
            layout.problems[-1] = layout.problems[-1].model_copy(update={"severity": "warning"})
            continue
        layout.entries.append(
            Entry.model_construct(
                name=key,
                kind="object",
                dtype=None,
                shape=[],
                nbytes=0,
                file=MEGATRON_COMMON,
                offset=None,
                chunks=None,
                py_type=py_type,
                value=value,
            )
        )
    info["common"] = sorted(keys)
    layout.megatron = info


def _analyse_hf_shards(source: Source, listing: dict[str, int]) -> _Layout:
    """The per-rank safetensors files of `HuggingFaceStorageWriter(save_distributed=True)`.

    There is no `.metadata`: each `shard-{rank+1}-model-….safetensors` file holds that rank's
    chunks keyed by fqn, with their offsets in the `DCP_SHARDING_INFO` metadata; the global
    shape is the extent of the chunks (as torch's `HuggingFaceStorageReader` computes it).
    """
    storage = source.storage
    layout = _Layout(files=dict(listing))
    layout.serialization.add("hf_safetensors")
    found: dict[str, list[tuple[str, Chunk]]] = {}
    for name in sorted(n for n in listing if DCP_HF_SHARD.match(n)):
        header = read_header(storage, name, listing[name])
        try:
            sharding = json.loads(header.metadata.get(SHARDING_INFO_KEY, "{}"))
        except json.JSONDecodeError:
            sharding = None
        if not isinstance(sharding, dict):
            layout.problem(
                "dcp_bad_chunk", f"has unreadable {SHARDING_INFO_KEY} metadata", file=name
            )
            sharding = {}
        for fqn, (dtype, shape, begin, end) in header.tensors.items():
            info = sharding.get(fqn)
            saved = _int_list(info.get("saved_offsets")) if isinstance(info, dict) else None
            if saved is None or len(saved) != len(shape):
                if info is not None:
                    layout.problem(
                        "dcp_bad_chunk",
                        f"tensor {fqn!r} has invalid saved_offsets {info!r}",
                        file=name,
                        tensor=fqn,
                    )
                saved = [0] * len(shape)
            chunk = Chunk(
                offsets=saved,
                sizes=list(shape),
                file=name,
                byte_offset=header.data_start + begin,
                byte_length=end - begin,
                raw=True,
            )
            found.setdefault(fqn, []).append((dtype, chunk))
    for fqn, items in found.items():
        kinds = {dtype for dtype, _ in items}
        if len(kinds) > 1:
            layout.problem(
                "dcp_mismatch",
                f"tensor {fqn!r} is stored with different dtypes ({', '.join(sorted(kinds))})",
                tensor=fqn,
            )
        dtype = items[0][0]
        chunks = [chunk for _, chunk in items]
        rank = len(chunks[0].sizes)
        if any(len(c.sizes) != rank for c in chunks):
            layout.problem(
                "dcp_mismatch", f"tensor {fqn!r} has chunks of different ranks", tensor=fqn
            )
            continue
        shape = [max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(rank)]
        layout.entries.append(
            Entry.model_construct(
                name=fqn,
                kind="tensor",
                dtype=dtype,
                shape=shape,
                nbytes=dtypes.numel(shape) * dtypes.itemsize(dtype),
                file=chunks[0].file,
                offset=chunks[0].byte_offset
                if len(chunks) == 1 and chunks[0].sizes == shape
                else None,
                chunks=chunks,
                py_type=None,
                value=None,
            )
        )
    _check_files(layout)
    _check_coverage(layout)
    return layout


def _locate_raw_chunks(
    source: Source,
    layout: _Layout,
    pending: list[tuple[str, str, list[int], list[tuple[list[int], list[int], str, int, int]]]],
) -> dict[tuple[str, str, tuple[int, ...]], tuple[int, int]]:
    """Find each file's serialization; for safetensors blobs, each chunk's real byte range."""
    storage = source.storage
    # file -> offsets where its tensor items start (one per chunk; equal for safetensors)
    starts: dict[str, set[int]] = {}
    for _fqn, _dtype, _shape, chunks in pending:
        for _o, _s, rel, offset, _length in chunks:
            starts.setdefault(rel, set()).add(offset)
    out: dict[tuple[str, str, tuple[int, ...]], tuple[int, int]] = {}
    # (file, fqn) -> (safetensors dtype code, shape) as the embedded header says
    declared: dict[tuple[str, str], tuple[str, list[int]]] = {}
    for rel, item_starts in sorted(starts.items()):
        size = layout.files.get(rel)
        if size is None:
            continue  # reported by _check_files
        first = min(item_starts)
        if size < first + 16:
            continue  # reported by _check_files as a range past the end of the file
        head = storage.read(rel, first, 16)
        if head.startswith(_ZIP_MAGIC):
            layout.serialization.add("torch_save")
            continue
        if (rel, first) in layout.transforms:
            # zstd-compressed items are torch_save blobs (DCP's extensions apply to that layout)
            layout.serialization.add("torch_save")
            continue
        if len(item_starts) > 1:
            layout.problem(
                "dcp_bad_chunk",
                f"tensor items start at {len(item_starts)} different offsets but the data at "
                f"byte {first} is not a torch.save blob",
                file=rel,
            )
            continue
        header = _read_embedded_header(storage, rel, first, size, layout)
        if header is None:
            continue
        layout.serialization.add("safetensors")
        data_start, tensors, sharding = header
        for fqn, (code, shape, begin, end) in tensors.items():
            info = sharding.get(fqn) if isinstance(sharding, dict) else None
            saved = info.get("saved_offsets") if isinstance(info, dict) else None
            key = tuple(saved) if isinstance(saved, list) else tuple([0] * len(shape))
            out[(rel, fqn, key)] = (data_start + begin, end - begin)
            declared[(rel, fqn)] = (code, shape)
    for fqn, dtype, _shape, chunks in pending:
        for offsets, sizes, rel, _offset, length in chunks:
            found = out.get((rel, fqn, tuple(offsets)))
            if found is None:
                if rel in starts and (rel, fqn) in declared:
                    layout.problem(
                        "dcp_mismatch",
                        f"tensor {fqn!r}: the chunk at {offsets} is not in the file's "
                        "safetensors header",
                        file=rel,
                        tensor=fqn,
                    )
                continue
            if declared[(rel, fqn)] != (dtypes.to_safetensors(dtype), list(sizes)):
                code, shape = declared[(rel, fqn)]
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {fqn!r}: the chunk at {offsets} is {dtype}{list(sizes)} in "
                    f".metadata but {code}{shape} in the file's safetensors header",
                    file=rel,
                    tensor=fqn,
                )
            elif found[1] != length:
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {fqn!r}: the chunk at {offsets} spans {found[1]} bytes in the "
                    f"file but .metadata says {length}",
                    file=rel,
                    tensor=fqn,
                )
    return out


def _read_embedded_header(
    storage: Storage, rel: str, start: int, size: int, layout: _Layout
) -> tuple[int, dict[str, tuple[str, list[int], int, int]], Any] | None:
    """Parse the safetensors blob DCP embeds at `start`: (data start, tensors, sharding info)."""
    (header_len,) = struct.unpack("<Q", storage.read(rel, start, 8))
    if header_len > _MAX_HEADER or start + 8 + header_len > size:
        layout.problem(
            "dcp_bad_chunk",
            f"the data at byte {start} is neither a torch.save blob nor a complete safetensors "
            "header (the file is truncated or corrupt)",
            file=rel,
        )
        return None
    try:
        header = json.loads(storage.read(rel, start + 8, header_len))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        header = None
    if not isinstance(header, dict):
        layout.problem(
            "dcp_bad_chunk", f"the safetensors header at byte {start} is not valid JSON", file=rel
        )
        return None
    meta = header.pop("__metadata__", None) or {}
    sharding: Any = {}
    if isinstance(meta, dict) and isinstance(meta.get(SHARDING_INFO_KEY), str):
        try:
            sharding = json.loads(meta[SHARDING_INFO_KEY])
        except json.JSONDecodeError:
            sharding = {}
    data_start = start + 8 + header_len
    tensors: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            continue
        code, shape, offsets = (
            info.get("dtype"),
            _int_list(info.get("shape")),
            _int_list(info.get("data_offsets")),
        )
        if not isinstance(code, str) or shape is None or offsets is None or len(offsets) != 2:
            layout.problem(
                "dcp_bad_chunk", f"the safetensors header entry {name!r} is malformed", file=rel
            )
            continue
        tensors[name] = (code, shape, offsets[0], offsets[1])
    return data_start, tensors, sharding


def _check_files(layout: _Layout) -> None:
    """Every chunk's file exists and its byte range fits inside it."""
    missing: set[str] = set()
    for entry in layout.entries:
        pieces = list(entry.chunks or [])
        if entry.kind == "object" and entry.file is not None and entry.offset is not None:
            pieces = [
                Chunk(
                    offsets=[],
                    sizes=[],
                    file=entry.file,
                    byte_offset=entry.offset,
                    byte_length=entry.nbytes,
                )
            ]
        for chunk in pieces:
            size = layout.files.get(chunk.file)
            if size is None:
                if chunk.file not in missing:
                    missing.add(chunk.file)
                    layout.problem(
                        "dcp_missing_file",
                        f"{chunk.file} is missing; .metadata stores data of {entry.name!r} "
                        "(and maybe more) in it",
                        file=chunk.file,
                        tensor=entry.name,
                    )
                continue
            end = chunk.byte_offset + chunk.byte_length
            if end > size:
                layout.problem(
                    "dcp_truncated",
                    f"{entry.kind} {entry.name!r}: bytes {chunk.byte_offset}..{end} lie past the "
                    f"end of {chunk.file} ({size} bytes); the file is truncated",
                    file=chunk.file,
                    tensor=entry.name,
                )
            if entry.kind == "tensor" and chunk.raw and entry.dtype is not None:
                want = dtypes.numel(chunk.sizes) * dtypes.itemsize(entry.dtype)
                if chunk.byte_length != want:
                    layout.problem(
                        "dcp_mismatch",
                        f"tensor {entry.name!r}: the chunk at {chunk.offsets} holds "
                        f"{chunk.byte_length} bytes but {entry.dtype}{chunk.sizes} needs {want}",
                        file=chunk.file,
                        tensor=entry.name,
                    )


#: how much of a torch_save chunk `check` reads to see what tensor it declares
_TENSOR_HEAD = 4096


def _inflate_head(stored: bytes, size: int) -> bytes | None:
    """The first `size` bytes a (possibly cut) zstd stream inflates to; None if it is not zstd."""
    import zstandard

    if not stored.startswith(_ZSTD_MAGIC):
        return None
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
        return bytes(reader.read(size))
    except zstandard.ZstdError:
        return None


def _check_saved_tensors(storage: Storage, layout: _Layout) -> None:
    """Each torch_save chunk declares the dtype and sizes `.metadata` gives it (one small read each)."""
    for entry in layout.entries:
        if entry.kind != "tensor" or entry.dtype is None:
            continue
        for chunk in entry.chunks or []:
            size = layout.files.get(chunk.file)
            if chunk.raw or size is None or chunk.byte_offset + chunk.byte_length > size:
                continue  # raw chunks are checked against their header; the rest is reported
            compressed = (chunk.file, chunk.byte_offset) in layout.transforms
            if compressed:
                # the first bytes of the zstd stream inflate to the blob's zip header + pickle
                stored = storage.read(
                    chunk.file, chunk.byte_offset, min(1 << 16, chunk.byte_length)
                )
                head = _inflate_head(stored, _TENSOR_HEAD)
            else:
                head = storage.read(
                    chunk.file, chunk.byte_offset, min(_TENSOR_HEAD, chunk.byte_length)
                )
            saved = peek_saved_tensor(head) if head is not None else None
            if saved is None:
                layout.problem(
                    "dcp_bad_chunk",
                    f"tensor {entry.name!r}: the chunk at {chunk.offsets} (byte {chunk.byte_offset}) "
                    "is not a readable torch.save blob of a tensor",
                    file=chunk.file,
                    tensor=entry.name,
                )
            elif saved.dtype != entry.dtype or saved.shape != chunk.sizes:
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {entry.name!r}: the chunk at {chunk.offsets} is "
                    f"{entry.dtype}{chunk.sizes} in .metadata but the file holds "
                    f"{saved.dtype}{saved.shape}",
                    file=chunk.file,
                    tensor=entry.name,
                )
            elif not compressed and saved.storage_bytes > chunk.byte_length:
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {entry.name!r}: the chunk at {chunk.offsets} declares "
                    f"{saved.storage_bytes} bytes of data in a {chunk.byte_length}-byte range",
                    file=chunk.file,
                    tensor=entry.name,
                )


def _overlap(a: Chunk, b: Chunk) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def _check_coverage(layout: _Layout) -> None:
    """The chunks of every tensor tile its global shape exactly: in bounds, no overlap, no hole."""
    for entry in layout.entries:
        if entry.kind != "tensor" or entry.chunks is None:
            continue
        shape = entry.shape
        live = [c for c in entry.chunks if dtypes.numel(c.sizes) > 0 or not shape]
        bad = False
        for chunk in live:
            if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape, strict=True)):
                layout.problem(
                    "dcp_chunk_out_of_bounds",
                    f"tensor {entry.name!r}: the chunk at {chunk.offsets} of size {chunk.sizes} "
                    f"reaches past the tensor's shape {shape}",
                    file=chunk.file,
                    tensor=entry.name,
                )
                bad = True
        if not shape:
            if len(live) != 1:
                layout.problem(
                    "dcp_coverage",
                    f"tensor {entry.name!r} is 0-dim but has {len(live)} chunks",
                    tensor=entry.name,
                )
            continue
        # sweep along dim 0: only chunks still open at a chunk's start can overlap it
        ordered = sorted(live, key=lambda c: c.offsets[0])
        active: list[Chunk] = []
        overlaps = 0
        for chunk in ordered:
            active = [a for a in active if a.offsets[0] + a.sizes[0] > chunk.offsets[0]]
            for other in active:
                if _overlap(chunk, other):
                    overlaps += 1
                    if overlaps <= 3:
                        layout.problem(
                            "dcp_overlap",
                            f"tensor {entry.name!r}: chunks at {other.offsets} and "
                            f"{chunk.offsets} overlap",
                            file=chunk.file,
                            tensor=entry.name,
                        )
            active.append(chunk)
        if bad or overlaps:
            continue
        covered = sum(dtypes.numel(c.sizes) for c in live)
        if covered != entry.numel:
            layout.problem(
                "dcp_hole",
                f"tensor {entry.name!r}: its chunks cover {covered} of {entry.numel} elements "
                f"of shape {shape}; part of the tensor is stored nowhere",
                tensor=entry.name,
            )


#: object blobs larger than this are not peeked at (their type stays unknown)
_PEEK_LIMIT = 1 << 20
_PEEK_TOTAL = 32 << 20


def _peek_objects(storage: Storage, layout: _Layout) -> None:
    """Fill in py_type (and small values: step counters, hyper-parameters) of object entries."""
    budget = _PEEK_TOTAL
    for index, entry in enumerate(layout.entries):
        if entry.kind != "object" or entry.file is None or entry.offset is None:
            continue
        if entry.nbytes > _PEEK_LIMIT or entry.nbytes > budget:
            continue
        budget -= entry.nbytes
        blob = storage.read(entry.file, entry.offset, entry.nbytes)
        if (entry.file, entry.offset) in layout.transforms:
            try:
                blob = inflate(blob, _PEEK_LIMIT * 64, entry.file, entry.name)
            except FormatError:
                continue  # verify --deep and reads report it; inspect just shows no type
        py_type, value = peek_saved_object(blob)
        layout.entries[index] = entry.model_copy(update={"py_type": py_type, "value": value})


def _world_size(layout: _Layout) -> int:
    ranks = set()
    names = {c.file for e in layout.entries for c in (e.chunks or [])}
    names |= {e.file for e in layout.entries if e.file is not None}
    names |= {n for n in layout.files if "/" not in n and n.endswith(SUFFIX)}
    for name in names:
        match = _RANK_FILE.match(name)
        if match:
            ranks.add(int(match.group(1)))
        hf = DCP_HF_SHARD.match(name)
        if hf:
            ranks.add(int(hf.group(1)) - 1)
    return max(ranks) + 1 if ranks else len(names)


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
    compressions = ("zstd",)
    commit_marker = METADATA
    layout_files: ClassVar[dict[str, tuple[str, ...]]] = {
        "megatron_torch_dist": (MEGATRON_METADATA,)
    }
    rank_file = staticmethod(rank_file)

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            return source.target == METADATA or source.target.endswith(SUFFIX)
        names = source.top_level()
        return any(
            n == METADATA or n.endswith(SUFFIX) or _RANK_METADATA.match(n) for n in names
        ) or is_dcp_hf_sharded(names)

    @classmethod
    def _folder(cls, source: Source) -> Source:
        # SRC may name the .metadata file or a .distcp file: read the folder around it
        if source.target is None:
            return source
        return Source(location=source.location, storage=source.storage, target=None)

    @classmethod
    def open(cls, source: Source) -> DcpCheckpoint:
        source = cls._folder(source)
        layout = _analyse(source)
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
        _peek_objects(source.storage, layout)
        files = [
            FileInfo(path=name, size=size, entries=0)
            for name, size in layout.files.items()
            if name in (METADATA, MEGATRON_COMMON, MEGATRON_METADATA)
            or name.endswith(SUFFIX)
            or DCP_HF_SHARD.match(name)
            or _RANK_METADATA.match(name)
        ]
        counts: dict[str, int] = {}
        for entry in layout.entries:
            for name in {c.file for c in entry.chunks or []}:
                counts[name] = counts.get(name, 0) + 1
        files = [f.model_copy(update={"entries": counts.get(f.path, 0)}) for f in files]
        serialization = sorted(layout.serialization)
        details: dict[str, Any] = {
            "serialization": serialization[0]
            if len(serialization) == 1
            else ("mixed" if serialization else "none"),
            "world_size": _world_size(layout),
            "chunks": sum(len(e.chunks or []) for e in layout.entries if e.kind == "tensor"),
            "objects_bytes": sum(e.nbytes for e in layout.entries if e.kind == "object"),
            "version": layout.version,
        }
        if layout.transforms:
            details["compression"] = {"zstd": len(layout.transforms)}
        if layout.megatron is not None:
            details["layout"] = "megatron_torch_dist"
            details["megatron"] = layout.megatron
        manifest = Manifest(
            format="dcp",
            location=source.location.raw,
            files=files,
            entries=layout.entries,
            details=details,
        )
        checkpoint = DcpCheckpoint(source, manifest, layout.planner_data)
        checkpoint.transforms = dict(layout.transforms)
        return checkpoint

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        source = cls._folder(source)
        try:
            layout = _analyse(source)
        except (FormatError, NotFoundError) as error:
            return [Problem(code=error.code, message=error.message, file=error.path)]
        _check_saved_tensors(source.storage, layout)
        return [
            p.model_copy(update={"file": source.storage.describe(p.file)}) if p.file else p
            for p in layout.problems
        ]

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> DcpWriter:
        return DcpWriter(staging, plan, options)


# --------------------------------------------------------------------------------------------
# Reading data


class _FileRange(RangeFile):
    """Bytes [start, start + length) of an open file, read with `os.preadv` (no copy of the range).

    `torch.load` of a chunk then reads straight from the file into the new tensor's storage,
    so loading a torch_save chunk needs the chunk's size in memory once, not twice.
    """

    def __init__(self, fd: int, start: int, length: int, name: str):
        super().__init__(length, name)
        self._fd, self._start = fd, start

    def _read_into(self, view: memoryview, position: int) -> int:
        got = os.preadv(self._fd, [view], self._start + position)
        if got == 0:
            raise FormatError(
                f"is truncated: byte {self._start + position} of a stored chunk is past its end",
                path=self.name,
                fix="The file was cut short; write or copy it again.",
            )
        return got

    def close(self) -> None:  # the fd belongs to the checkpoint
        super().close()


class DcpCheckpoint(Checkpoint):
    """An opened DCP checkpoint: reads assemble tensors from their chunks.

    Attributes:
        planner_data: the `planner_data` of `.metadata` (fqn -> path in the original nested
            state dict); pass it to the DCP writer as `options.extra["dcp_planner_data"]`
            to keep it across a rewrite.
    """

    chunk_reads = True
    object_bytes = True

    def __init__(self, source: Source, manifest: Manifest, planner_data: Any = None):
        super().__init__(source, manifest)
        self.planner_data = planner_data
        self._fds: dict[str, int] = {}
        self._common: dict[str, Any] | None = None
        #: (file, offset) -> transform of compressed items (`zstd`); set by `DcpFormat.open`
        self.transforms: dict[tuple[str, int], str] = {}

    def _entry(self, name: str, kind: str) -> Entry:
        entry = self.manifest.by_name.get(name)
        if entry is None:
            raise NotFoundError(f"no entry named {name!r}", path=self.manifest.location)
        if entry.kind != kind:
            raise FormatError(
                f"entry {name!r} is a{'n' if entry.kind == 'object' else ''} {entry.kind}, "
                f"not a{'n' if kind == 'object' else ''} {kind}",
                path=self.manifest.location,
            )
        return entry

    def read_chunk(self, name: str, index: int) -> torch.Tensor:
        """Chunk `index` of tensor `name` as stored (its box is `entry.chunks[index]`)."""
        entry = self._entry(name, "tensor")
        assert entry.chunks is not None
        return self._load_chunk(entry, entry.chunks[index])

    def _load_chunk(
        self, entry: Entry, chunk: Chunk, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Load a chunk; `rows` limits a raw chunk to rows [a, b) of its dim 0."""
        assert entry.dtype is not None
        where = self.storage.describe(chunk.file)
        if chunk.raw:
            from ..tensors import read_tensor_from_fd, tensor_from_bytes

            sizes = list(chunk.sizes)
            offset = chunk.byte_offset
            if rows is not None and sizes:
                row_bytes = dtypes.numel(sizes[1:]) * dtypes.itemsize(entry.dtype)
                offset += rows[0] * row_bytes
                sizes[0] = rows[1] - rows[0]
            if isinstance(self.storage, LocalStorage):
                fd = self._fds.get(chunk.file)
                if fd is None:
                    fd = self._fds[chunk.file] = os.open(self.storage.path(chunk.file), os.O_RDONLY)
                return read_tensor_from_fd(fd, offset, entry.dtype, sizes, where)
            nbytes = dtypes.numel(sizes) * dtypes.itemsize(entry.dtype)
            return tensor_from_bytes(
                self.storage.read(chunk.file, offset, nbytes), entry.dtype, sizes
            )
        import torch

        from ..tensors import dtype_name

        stored: IO[bytes] = self._byte_range(chunk.file, chunk.byte_offset, chunk.byte_length)
        if (chunk.file, chunk.byte_offset) in self.transforms:
            limit = dtypes.numel(chunk.sizes) * dtypes.itemsize(entry.dtype) + _SAVE_OVERHEAD
            stored = io.BytesIO(
                inflate(stored, limit, where, f"tensor {entry.name!r} chunk {chunk.offsets}")
            )
        try:
            value = torch.load(stored, map_location="cpu", weights_only=True)
        except CkptError:
            raise
        except Exception as exc:
            raise FormatError(
                f"tensor {entry.name!r}: the chunk at {chunk.offsets} (bytes "
                f"{chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length}) does not load "
                f"as a tensor with weights_only=True ({type(exc).__name__}: {str(exc)[:200]})",
                path=where,
                fix="The file is corrupt or hostile; it was not executed.",
            ) from None
        if not isinstance(value, torch.Tensor) or list(value.shape) != list(chunk.sizes):
            raise FormatError(
                f"tensor {entry.name!r}: the chunk at {chunk.offsets} holds "
                f"{type(value).__name__}{list(getattr(value, 'shape', []))}, expected shape {chunk.sizes}",
                path=where,
            )
        if dtype_name(value.dtype) != entry.dtype:
            raise FormatError(
                f"tensor {entry.name!r}: the chunk at {chunk.offsets} is {dtype_name(value.dtype)}, "
                f".metadata says {entry.dtype}",
                path=where,
            )
        return value

    def _byte_range(self, rel: str, offset: int, length: int) -> IO[bytes]:
        """A seekable file object over one stored range (torch.load reads from it directly)."""
        if isinstance(self.storage, LocalStorage):
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self.storage.path(rel), os.O_RDONLY)
            return cast(IO[bytes], _FileRange(fd, offset, length, self.storage.describe(rel)))
        return io.BytesIO(self.storage.read(rel, offset, length))

    def read_tensor(self, name: str) -> torch.Tensor:
        entry = self._entry(name, "tensor")
        return self.read_slice(name, [0] * len(entry.shape), list(entry.shape))

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """The box (offsets, sizes) of tensor `name`, reading only the chunks that overlap it.

        Raw chunks split along dim 0 are read only for the rows the box needs, so memory
        stays at the size of the box (plus one torch_save chunk for that serialization).
        """
        import torch

        from ..tensors import torch_dtype

        entry = self._entry(name, "tensor")
        assert entry.dtype is not None and entry.chunks is not None
        shape = entry.shape
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)
            )
        ):
            raise FormatError(
                f"box at {offsets} of size {sizes} is not inside tensor {name!r} of shape {shape}",
                path=self.manifest.location,
            )
        # a box that is exactly one stored chunk: hand out the loaded chunk, no second copy
        for chunk in entry.chunks:
            if chunk.offsets == offsets and chunk.sizes == sizes:
                return self._load_chunk(entry, chunk).contiguous()
        out = torch.empty(sizes, dtype=torch_dtype(entry.dtype))
        if dtypes.numel(sizes) == 0:
            return out
        for chunk in entry.chunks:
            lo = [max(o, co) for o, co in zip(offsets, chunk.offsets, strict=True)]
            hi = [
                min(o + s, co + cs)
                for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            rows = None
            base0 = chunk.offsets[0]
            if chunk.raw:
                rows = (lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0])
                base0 = lo[0]
            piece = self._load_chunk(entry, chunk, rows)
            src_index = tuple(
                slice(
                    a - (base0 if d == 0 else chunk.offsets[d]),
                    b - (base0 if d == 0 else chunk.offsets[d]),
                )
                for d, (a, b) in enumerate(zip(lo, hi, strict=True))
            )
            dst_index = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
            out[dst_index] = piece[src_index]
            del piece
        return out

    def raw_chunks_in_order(self, name: str) -> list[Chunk] | None:
        """The chunks of `name` in global C order when their raw bytes, concatenated, ARE the
        tensor's bytes (raw chunks split along dim 0 only); None otherwise.

        This is what lets a copy to a raw format skip deserialisation for multi-rank saves
        with the safetensors serialization (see `iter_raw`).
        """
        entry = self.manifest.by_name.get(name)
        if entry is None or entry.kind != "tensor" or not entry.chunks or entry.dtype is None:
            return None
        chunks = [c for c in entry.chunks if dtypes.numel(c.sizes) > 0 or not entry.shape]
        if not chunks or not all(c.raw for c in chunks):
            return None
        if entry.shape and any(c.sizes[1:] != entry.shape[1:] for c in chunks):
            return None
        ordered = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
        row = 0
        for chunk in ordered:
            if entry.shape and chunk.offsets[0] != row:
                return None
            row += chunk.sizes[0] if entry.shape else 1
        return ordered

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        """The raw C-order bytes of tensor `name`, in blocks, straight from raw chunks."""
        ordered = self.raw_chunks_in_order(name)
        if ordered is None:
            raise FormatError(
                f"tensor {name!r} is not stored as raw bytes in dim-0 pieces",
                path=self.manifest.location,
            )
        for chunk in ordered:
            done = 0
            while done < chunk.byte_length:
                n = min(block, chunk.byte_length - done)
                yield self.storage.read(chunk.file, chunk.byte_offset + done, n)
                done += n

    def read_object_bytes(self, name: str) -> bytes:
        """The stored bytes of a non-tensor entry (a `torch.save` blob), without loading it."""
        entry = self._entry(name, "object")
        if entry.file == MEGATRON_COMMON and entry.offset is None:
            # one key of Megatron's common.pt: stored as DCP stores an object, a torch.save blob
            import torch

            buffer = io.BytesIO()
            torch.save(common_leaf(self._megatron_common(), name), buffer)
            return buffer.getvalue()
        assert entry.file is not None and entry.offset is not None
        data = self.storage.read(entry.file, entry.offset, entry.nbytes)
        if (entry.file, entry.offset) in self.transforms:
            limit = _OBJECT_INFLATE_MAX + 64 * entry.nbytes
            data = inflate(data, limit, self.storage.describe(entry.file), f"object {name!r}")
        return data

    def read_object(self, name: str) -> Any:
        """The value of a non-tensor entry, loaded with `torch.load(weights_only=True)`.

        Beyond torch's own set, only `torch_save.object_allowlist()` is admitted: numpy arrays
        and dtypes (RNG states) and `torch.Generator`.
        """
        import pickle

        import torch

        from .torch_save import object_allowlist

        entry = self._entry(name, "object")
        if entry.file == MEGATRON_COMMON and entry.offset is None:
            return common_leaf(self._megatron_common(), name)
        data = self.read_object_bytes(name)
        try:
            # numpy RNG states and torch.Generator objects, which dcp.load restores too
            with torch.serialization.safe_globals(object_allowlist()):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise FormatError(
                f"object {name!r} needs more than torch.load(weights_only=True) allows "
                f"({_weights_only_reason(exc)}); it was not executed",
                path=self.storage.describe(entry.file or ""),
                fix="If you trust this checkpoint, load it with torch yourself; ckpt never "
                "unpickles arbitrary objects",
            ) from None
        except Exception as exc:
            raise FormatError(
                f"object {name!r} does not load ({type(exc).__name__}: {str(exc)[:200]})",
                path=self.storage.describe(entry.file or ""),
                fix="The file is truncated or corrupt.",
            ) from None

    def _megatron_common(self) -> dict[str, Any]:
        """Megatron-Core's `common.pt`, loaded once (weights_only, ckpt's allow-list)."""
        if self._common is None:
            from .torch_save import load_torch_file

            value, _ = load_torch_file(self.storage, MEGATRON_COMMON)
            if not isinstance(value, dict):
                raise FormatError(
                    "does not hold a dict", path=self.storage.describe(MEGATRON_COMMON)
                )
            self._common = value
        return self._common

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _weights_only_reason(exc: Exception) -> str:
    """The one informative line of torch's long weights_only refusal."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        match = re.search(r"(Unsupported global: GLOBAL [\w.]+|unsupported GLOBAL [\w.]+)", line)
        if match:
            return match.group(1)
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()[:200] or "refused"
    return lines[0][:200] if lines else "refused"


# --------------------------------------------------------------------------------------------
# Writing


@dataclass
class _FileState:
    """One output `.distcp` file while it is being written."""

    name: str
    fh: Any = None
    #: end of the embedded safetensors blob (safetensors serialization); objects go after it
    append_at: int = 0
    blob_start: int = 0
    entries: int = 0


class _RecordingFile:
    """A binary file for `torch.save` that remembers the first exception its `write` raised."""

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._fh.write(data)
        except BaseException as exc:  # KeyboardInterrupt too: a signal lands in Python code
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


class DcpWriter(Writer):
    """Streams tensors (whole, or one planned chunk at a time) and objects into a DCP folder.

    Layout: each planned tensor Entry may carry `chunks` (offsets, sizes, file; the writer fills
    in byte_offset/byte_length) deciding which file holds which box; without `chunks` the
    tensor is laid out for `options.world_size` ranks with DTensor `Shard(0)` placement
    (`placement.shard_dim0_boxes`), chunk r in `__r_0.distcp`; 0-dim tensors and objects are
    written once, in rank 0's file. `.metadata` is written last by `finish`, with torch's own classes.

    Options: `options.dcp_serialization` (`torch_save` | `safetensors`);
    `options.extra["dcp_planner_data"]` keeps a source's planner_data (default: the fqn split
    at dots).
    """

    chunk_writes = True
    object_bytes = True

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        super().__init__(staging, plan, options)
        if options.dcp_serialization not in SERIALIZATIONS:
            raise FormatError(
                f"unknown DCP serialization {options.dcp_serialization!r}",
                fix=f"Use one of: {', '.join(SERIALIZATIONS)}.",
            )
        if options.world_size < 1:
            raise FormatError(f"world size must be at least 1, not {options.world_size}")
        if options.single_file:
            raise FormatError(
                "a DCP checkpoint is a folder (.metadata + .distcp files), not a single file",
                fix="Give a folder as the destination.",
            )
        self.serialization = options.dcp_serialization
        #: `zstd`: every item goes through DCP's ZStandard stream extension (`stream.zstd/1`)
        self.compression: str | None = options.extra.get("dcp_compression") or None
        if self.compression not in (None, "zstd"):
            raise FormatError(
                f"unknown DCP compression {self.compression!r}",
                fix="Use --dcp-compression zstd or none.",
            )
        if self.compression and self.serialization == "safetensors":
            raise FormatError(
                "DCP compression applies to the torch_save serialization only",
                fix="Drop --dcp-compression, or write --dcp-serialization torch_save.",
            )
        self.world_size = options.world_size
        self.entries: dict[str, Entry] = {}
        self.layout: dict[str, list[Chunk]] = {}
        self.results: dict[str, list[tuple[int, int] | None]] = {}
        self._object_file: dict[str, str] = {}
        files: dict[str, None] = {rank_file(r): None for r in range(self.world_size)}
        for entry in plan:
            if entry.name in self.entries:
                raise FormatError(f"entry {entry.name!r} is planned twice")
            self.entries[entry.name] = entry
            if entry.kind == "object":
                self._object_file[entry.name] = rank_file(0)
                self.results[entry.name] = [None]
                continue
            if entry.dtype is None or not dtypes.is_known(entry.dtype):
                raise FormatError(f"tensor {entry.name!r} has no supported dtype ({entry.dtype!r})")
            if self.serialization == "safetensors" and not dtypes.has_safetensors_code(entry.dtype):
                raise FormatError(
                    f"tensor {entry.name!r} is {entry.dtype}, which the safetensors "
                    "serialization cannot store",
                    fix="Use --dcp-serialization torch_save (the default), which keeps it.",
                )
            chunks = self._plan_chunks(entry)
            self.layout[entry.name] = chunks
            self.results[entry.name] = [None] * len(chunks)
            for chunk in chunks:
                files.setdefault(chunk.file, None)
        self.files: dict[str, _FileState] = {name: _FileState(name) for name in files}
        # safetensors: the embedded header lists every chunk of the file up front
        self._raw_at: dict[tuple[str, int], int] = {}
        #: files this writer writes (all unless `restrict`ed); each is opened on first use
        self._owned = set(self.files)
        self._started = False

    @property
    def splittable(self) -> bool:
        return True

    def output_files(self) -> dict[str, int]:
        weights = dict.fromkeys(self.files, 0)
        for name, chunks in self.layout.items():
            entry = self.entries[name]
            assert entry.dtype is not None
            for chunk in chunks:
                weights[chunk.file] += dtypes.numel(chunk.sizes) * dtypes.itemsize(entry.dtype)
        for name, rel in self._object_file.items():
            weights[rel] += self.entries[name].nbytes
        return weights

    def restrict(self, files: Collection[str]) -> None:
        if self._started:
            raise RuntimeError("restrict() after entries were written")
        self._owned = set(files) & set(self.files)

    def owns(self, file: str) -> bool:
        """Whether this writer writes the data file `file`."""
        return file in self._owned

    def wants(self, name: str) -> bool:
        if name in self._object_file:
            return self._object_file[name] in self._owned
        return any(c.file in self._owned for c in self.layout.get(name, ()))

    def _state(self, name: str) -> _FileState:
        if name not in self._owned:
            raise RuntimeError(f"{name} is written by another rank")
        self._started = True
        state = self.files[name]
        if state.fh is None:
            self._open(name)
        return state

    def _plan_chunks(self, entry: Entry) -> list[Chunk]:
        shape = list(entry.shape)
        if entry.chunks is None:
            chunks: list[Chunk] = []
            seen: set[tuple[int, ...]] = set()
            for rank, box in enumerate(shard_dim0_boxes(shape, self.world_size)):
                # ranks left with nothing share an offset; DCP keys chunks by offset, so
                # (like its save-plan dedup) only the first of them is recorded
                if box.offsets in seen:
                    continue
                seen.add(box.offsets)
                chunks.append(rank_chunk(rank, box))
            return chunks
        out = []
        for chunk in entry.chunks:
            if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
                raise FormatError(
                    f"tensor {entry.name!r}: planned chunk {chunk.offsets} has the wrong rank"
                )
            rel = safe_relpath(chunk.file, source="the write plan")
            if "/" in rel or not rel.endswith(SUFFIX):
                raise FormatError(
                    f"tensor {entry.name!r}: planned file {rel!r} is not a top-level .distcp name"
                )
            out.append(
                chunk.model_copy(
                    update={"file": rel, "byte_offset": 0, "byte_length": 0, "raw": False}
                )
            )
        if len({tuple(c.offsets) for c in out}) != len(out):
            raise FormatError(
                f"the write plan for {entry.name!r} has two chunks at the same offsets "
                "(DCP keys chunks by their offsets)"
            )
        probe = _Layout(entries=[entry.model_copy(update={"chunks": out})])
        _check_coverage(probe)
        if probe.problems:
            raise FormatError(
                f"the write plan for {entry.name!r} is invalid: {probe.problems[0].message}"
            )
        if self.options.dcp_serialization == "safetensors":
            per_file = [c.file for c in out]
            if len(per_file) != len(set(per_file)):
                raise FormatError(
                    f"tensor {entry.name!r}: the safetensors serialization keys chunks by name, so "
                    "one file cannot hold two chunks of the same tensor",
                    fix="Plan at most one chunk per tensor per file, or use torch_save.",
                )
        return out

    def _open(self, name: str) -> None:
        state = self.files[name]
        state.fh = open(self.staging / name, "wb")
        if self.serialization != "safetensors":
            return
        # one safetensors blob at the start of the file; objects are appended after it
        header: dict[str, Any] = {}
        sharding: dict[str, Any] = {}
        offset = 0
        for entry_name, chunks in self.layout.items():
            entry = self.entries[entry_name]
            assert entry.dtype is not None
            for index, chunk in enumerate(chunks):
                if chunk.file != name:
                    continue
                length = dtypes.numel(chunk.sizes) * dtypes.itemsize(entry.dtype)
                header[entry_name] = {
                    "dtype": dtypes.to_safetensors(entry.dtype),
                    "shape": list(chunk.sizes),
                    "data_offsets": [offset, offset + length],
                }
                sharding[entry_name] = {"saved_offsets": list(chunk.offsets)}
                self._raw_at[(entry_name, index)] = offset
                offset += length
        if not header:
            return
        header = {
            "__metadata__": {
                SHARDING_INFO_KEY: json.dumps(sharding),
                "DCP_VERSION": "1.0",
                "format": "pt",
            },
            **header,
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        state.fh.write(struct.pack("<Q", len(raw)) + raw)
        data_start = 8 + len(raw)
        for key in [k for k in self._raw_at if self.layout[k[0]][k[1]].file == name]:
            self._raw_at[key] += data_start
        state.blob_start = 0
        state.append_at = data_start + offset
        state.fh.truncate(state.append_at)

    @property
    def accepts_raw(self) -> bool:
        """Raw copies work with the safetensors serialization when chunks split only dim 0."""
        if self.serialization != "safetensors":
            return False
        return all(
            all(c.sizes[1:] == self.entries[n].shape[1:] for c in chunks)
            for n, chunks in self.layout.items()
        )

    @property
    def accepts_objects(self) -> bool:
        return True

    def chunks_of(self, name: str) -> list[Chunk]:
        """The chunks `name` is written as (planned, or the default Shard(0) layout)."""
        return list(self.layout[name])

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor `name`, cut into its chunks."""
        chunks = self.layout.get(name)
        if chunks is None:
            raise FormatError(f"tensor {name!r} is not in the write plan")
        entry = self.entries[name]
        if list(tensor.shape) != list(entry.shape):
            raise FormatError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the plan says {entry.shape}"
            )
        for index, chunk in enumerate(chunks):
            if chunk.file not in self._owned:
                continue
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            self.write_chunk(name, index, tensor[box] if box else tensor)

    def write_chunk(self, name: str, chunk_index: int, piece: torch.Tensor) -> None:
        """Write one planned chunk (its box of the global tensor) of tensor `name`."""
        from ..tensors import dtype_name, tensor_bytes

        chunks = self.layout.get(name)
        if chunks is None or not 0 <= chunk_index < len(chunks):
            raise FormatError(f"tensor {name!r} has no planned chunk {chunk_index}")
        chunk = chunks[chunk_index]
        entry = self.entries[name]
        if list(piece.shape) != list(chunk.sizes) or dtype_name(piece.dtype) != entry.dtype:
            raise FormatError(
                f"tensor {name!r}: chunk {chunk_index} must be {entry.dtype}{chunk.sizes}, "
                f"got {dtype_name(piece.dtype)}{list(piece.shape)}"
            )
        if self.results[name][chunk_index] is not None:
            raise FormatError(f"tensor {name!r}: chunk {chunk_index} was written twice")
        state = self._state(chunk.file)
        if self.serialization == "safetensors":
            at = self._raw_at[(name, chunk_index)]
            data = tensor_bytes(piece)
            os.pwrite(state.fh.fileno(), data, at)
            # DCP records the blob start and the chunk's byte count for safetensors items
            self.results[name][chunk_index] = (state.blob_start, len(data))
        else:
            import torch

            piece = piece.detach().cpu().contiguous()
            if piece.untyped_storage().nbytes() != piece.numel() * piece.element_size():
                piece = piece.clone()  # torch.save would store the whole underlying storage
            if self.compression is None:
                # straight into the file: no second in-memory copy of the chunk (peak memory
                # stays one source chunk + one output chunk)
                start = state.append_at
                state.fh.seek(start)
                out = _RecordingFile(state.fh)
                try:
                    torch.save(piece, cast(IO[bytes], out))  # write + flush is all it uses
                except RuntimeError:
                    # torch's zip writer turns a failed write (ENOSPC, EIO) into "unexpected
                    # pos": raise the real error, which the CLI reports as an I/O failure
                    if out.error is not None:
                        raise out.error from None
                    raise
                state.fh.flush()
                state.append_at = state.fh.tell()
                self.results[name][chunk_index] = (start, state.append_at - start)
            else:
                buffer = io.BytesIO()
                torch.save(piece, buffer)
                self.results[name][chunk_index] = self._append(state, buffer.getbuffer())
        state.entries += 1

    def write_raw(self, name: str, blocks: Iterator[bytes]) -> None:
        """Write tensor `name` from its raw C-order bytes (safetensors serialization, dim-0 chunks)."""
        if not self.accepts_raw:
            raise FormatError("raw writes need the safetensors serialization and dim-0 chunks")
        chunks = self.layout[name]
        entry = self.entries[name]
        assert entry.dtype is not None
        row_bytes = dtypes.numel(entry.shape[1:]) * dtypes.itemsize(entry.dtype)
        # global byte range of each chunk -> its position in its file
        targets = sorted(
            (
                c.offsets[0] * row_bytes if c.offsets else 0,
                dtypes.numel(c.sizes) * dtypes.itemsize(entry.dtype),
                i,
            )
            for i, c in enumerate(chunks)
        )
        done = 0
        for block in blocks:
            view = memoryview(block)
            while len(view):
                for start, length, index in targets:
                    if start <= done < start + length:
                        n = min(len(view), start + length - done)
                        if chunks[index].file in self._owned:
                            state = self._state(chunks[index].file)
                            at = self._raw_at[(name, index)] + done - start
                            os.pwrite(state.fh.fileno(), view[:n], at)
                        done += n
                        view = view[n:]
                        break
                else:
                    raise FormatError(f"tensor {name!r}: more raw bytes than its {entry.nbytes}")
        if done != entry.nbytes:
            raise FormatError(f"tensor {name!r}: got {done} raw bytes, expected {entry.nbytes}")
        for index, (chunk, (_start, length, _i)) in enumerate(
            zip(chunks, sorted(targets, key=lambda t: t[2]), strict=True)
        ):
            if chunk.file not in self._owned:
                continue
            self.results[name][index] = (self.files[chunk.file].blob_start, length)
            self.files[chunk.file].entries += 1

    def _append(self, state: _FileState, data: bytes | memoryview) -> tuple[int, int]:
        if self.compression == "zstd":
            import zstandard

            # what ZStandard().transform_to writes: one zstd frame per item
            data = zstandard.ZstdCompressor().compress(data)
        start = state.append_at
        os.pwrite(state.fh.fileno(), data, start)
        state.append_at += len(data)
        return start, len(data)

    def write_object(self, name: str, value: Any) -> None:
        """Write a non-tensor entry the way DCP stores it (a `torch.save` of the value)."""
        import torch

        buffer = io.BytesIO()
        torch.save(value, buffer)
        self.write_object_bytes(name, buffer.getvalue())

    def write_object_bytes(self, name: str, data: bytes) -> None:
        """Write a non-tensor entry from its stored DCP bytes (`DcpCheckpoint.read_object_bytes`)."""
        rel = self._object_file.get(name)
        if rel is None:
            raise FormatError(f"object {name!r} is not in the write plan")
        if self.results[name][0] is not None:
            raise FormatError(f"object {name!r} was written twice")
        state = self._state(rel)
        self.results[name][0] = self._append(state, data)
        state.entries += 1

    def finish(self) -> list[FileInfo]:
        """fsync every data file, then write `.metadata` (the commit marker) last."""
        return self.commit([self.finish_part()])

    def _chunk_files(self, name: str) -> list[str]:
        if name in self._object_file:
            return [self._object_file[name]]
        return [c.file for c in self.layout[name]]

    def finish_part(self) -> dict[str, Any]:
        """fsync this writer's data files; their sizes and the byte ranges of what they hold."""
        missing = [
            f"{name}[{i}]"
            for name, results in self.results.items()
            for i, (r, file) in enumerate(zip(results, self._chunk_files(name), strict=True))
            if r is None and file in self._owned
        ]
        if missing:
            raise RuntimeError(
                f"DCP writer finished with unwritten entries: {', '.join(missing[:5])}"
            )
        files: dict[str, list[int]] = {}
        for name, state in self.files.items():
            if name not in self._owned:
                continue
            if state.fh is None:
                self._open(name)  # a rank with nothing to hold still gets its (empty) file
            state.fh.flush()
            os.fsync(state.fh.fileno())
            state.fh.close()
            files[name] = [state.append_at, state.entries]
        results = {
            name: [[i, r[0], r[1]] for i, r in enumerate(found) if r is not None]
            for name, found in self.results.items()
        }
        return {"files": files, "results": {n: r for n, r in results.items() if r}}

    def commit(self, parts: list[dict[str, Any]]) -> list[FileInfo]:
        """Merge every rank's part, then write `.metadata` (the commit marker) last."""
        sizes: dict[str, list[int]] = {}
        for part in parts:
            sizes.update(part["files"])
            for name, found in part["results"].items():
                for index, start, length in found:
                    self.results[name][index] = (start, length)
        missing = [
            f"{name}[{i}]"
            for name, results in self.results.items()
            for i, r in enumerate(results)
            if r is None
        ]
        absent = [name for name in self.files if name not in sizes]
        if missing or absent:
            raise RuntimeError(
                f"DCP writer finished with unwritten entries: {', '.join((missing + absent)[:5])}"
            )
        written = [
            FileInfo(path=name, size=sizes[name][0], entries=sizes[name][1]) for name in self.files
        ]
        data = self._metadata_bytes()
        tmp = self.staging / f"{METADATA}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, self.staging / METADATA)
        written.insert(0, FileInfo(path=METADATA, size=len(data), entries=0))
        return written

    def _metadata_bytes(self) -> bytes:
        import pickle

        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata as TorchBytes,
        )
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata as TorchChunk,
        )
        from torch.distributed.checkpoint.metadata import (
            Metadata as TorchMetadata,
        )
        from torch.distributed.checkpoint.metadata import (
            MetadataIndex as TorchIndex,
        )
        from torch.distributed.checkpoint.metadata import (
            StorageMeta as TorchStorageMeta,
        )
        from torch.distributed.checkpoint.metadata import (
            TensorProperties as TorchProperties,
        )
        from torch.distributed.checkpoint.metadata import (
            TensorStorageMetadata as TorchTensorMeta,
        )

        from ..tensors import torch_dtype

        state_dict_metadata: dict[str, Any] = {}
        storage_data: dict[Any, Any] = {}
        transforms = [ZSTD_DESCRIPTOR] if self.compression == "zstd" else None
        for entry in self.plan:
            results = self.results[entry.name]
            if entry.kind == "object":
                state_dict_metadata[entry.name] = TorchBytes()
                start, length = results[0]  # type: ignore[misc]
                storage_data[TorchIndex(entry.name)] = _StorageInfo(
                    self._object_file[entry.name], start, length, transforms
                )
                continue
            assert entry.dtype is not None
            chunks = self.layout[entry.name]
            state_dict_metadata[entry.name] = TorchTensorMeta(
                properties=TorchProperties(dtype=torch_dtype(entry.dtype)),
                size=torch.Size(entry.shape),
                chunks=[
                    TorchChunk(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                    for c in chunks
                ],
            )
            for index, (chunk, result) in enumerate(zip(chunks, results, strict=True)):
                assert result is not None
                storage_data[TorchIndex(entry.name, chunk.offsets, index)] = _StorageInfo(
                    chunk.file, result[0], result[1], transforms
                )
        planner_data = self.options.extra.get("dcp_planner_data")
        if not isinstance(planner_data, dict):
            planner_data = {}
        planner_data = {
            name: planner_data.get(name, tuple(name.split("."))) for name in state_dict_metadata
        }
        metadata = TorchMetadata(
            state_dict_metadata=state_dict_metadata,
            planner_data=planner_data,
            storage_data=storage_data,
            storage_meta=TorchStorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4())),
            version="1.0.0",
        )
        return pickle.dumps(metadata)
