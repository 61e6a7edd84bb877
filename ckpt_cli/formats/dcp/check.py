"""Reading `.metadata` against the files, and the structural checks of a DCP layout."""

from __future__ import annotations

import dataclasses
import itertools
import reprlib
from typing import Any

from ... import dtypes
from ...errors import FormatError
from ...heap import gc_paused
from ...models import Chunk, Entry, ProblemList
from ...storage import Storage, safe_relpath
from ..base import Source
from ..safetensors.format import is_dcp_hf_sharded
from ..torch.pickle_scan import read_archive
from .hf_shards import analyse_hf_shards
from .layout import (
    METADATA,
    RANK_FILE,
    RANK_METADATA,
    SUFFIX,
    InterruptedSaveError,
    Layout,
    PendingChunk,
    PendingTensor,
    int_list,
    is_count,
    zeros,
)
from .megatron import read_megatron_common
from .metadata import (
    CORRUPT_METADATA_FIX,
    MAX_METADATA_BYTES,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    load_metadata,
    over_budget,
    planner_keys,
)
from .peek import SavedTensor, peek_saved_object, peek_saved_tensor
from .raw import locate_raw_chunks
from .transforms import inflate, inflate_head, transform_of


def _read_metadata(source: Source, listing: dict[str, int], layout: Layout) -> Metadata:
    """`.metadata`, or the union of the per-rank `__{r}.metadata` files that
    `dcp.save(..., use_collectives=False)` writes instead."""
    storage = source.storage
    if METADATA in listing:
        return load_metadata(_read_capped(storage, METADATA, listing), storage.describe(METADATA))
    names = sorted(
        (n for n in listing if RANK_METADATA.match(n)),
        key=lambda n: int(RANK_METADATA.match(n).group(1)),  # type: ignore[union-attr]
    )
    merged = Metadata()
    merged.state_dict_metadata, merged.storage_data, merged.planner_data = {}, {}, {}
    for name in names:
        where = storage.describe(name)
        md = load_metadata(_read_capped(storage, name, listing), where)
        if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
            raise FormatError(
                "is missing its state_dict_metadata or storage_data",
                path=where,
                fix=CORRUPT_METADATA_FIX,
            )
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
    ranks = {int(m.group(1)) for n in names if (m := RANK_METADATA.match(n))}
    for name in listing:
        match = RANK_FILE.match(name)
        if match and int(match.group(1)) not in ranks:
            layout.problem(
                "dcp_interrupted",
                f"rank {match.group(1)} wrote {name} but no __{match.group(1)}.metadata: its "
                "save looks interrupted",
                file=name,
            )
    return merged


def _read_capped(storage: Storage, name: str, listing: dict[str, int]) -> bytes:
    """A metadata file's bytes; one larger than `MAX_METADATA_BYTES` is refused unread."""
    size = listing.get(name, 0)
    if size > MAX_METADATA_BYTES:
        raise over_budget(
            storage.describe(name), f"{size:,} bytes, more than {MAX_METADATA_BYTES:,}"
        )
    return storage.read_all(name)


def _storage_index(md: Metadata, where: str) -> dict[tuple[Any, Any], StorageInfo]:
    storage_data = md.storage_data
    if not isinstance(storage_data, dict):
        raise FormatError("has no storage_data map", path=where, fix=CORRUPT_METADATA_FIX)
    index: dict[tuple[Any, Any], StorageInfo] = {}
    for key, info in storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, StorageInfo):
            raise FormatError(
                "has a malformed storage_data entry", path=where, fix=CORRUPT_METADATA_FIX
            )
        if not isinstance(key.fqn, str):
            raise FormatError(
                "has a storage_data key without a name", path=where, fix=CORRUPT_METADATA_FIX
            )
        index[key.key()] = info
    return index


def analyse(source: Source) -> Layout:
    """Read the layout of `source` (see `_analyse_unpaused`) with the GC paused."""
    # unpickling `.metadata` and building entries: see `heap` (4-6x slower with the GC on)
    with gc_paused():
        return _analyse_unpaused(source)


def analysed(source: Source) -> Layout:
    """`analyse(source)`, read once per source: `check` and `open` of the same source in one
    operation (`verify` checks SRC, then opens it) share the parse, kept in `source.parsed`
    under the `.metadata` file and its size.

    Each call returns its own copy of what a caller changes (the entry list, the problems, the
    serializations and transforms); entries themselves are frozen and shared. A source that
    cannot be analysed is tried again by the next call, which raises again.
    """
    key = ("dcp", METADATA, source.files.get(METADATA, -1))
    layout = source.parsed.get(key)
    if not isinstance(layout, Layout):
        layout = source.parsed[key] = analyse(source)
    return dataclasses.replace(
        layout,
        entries=list(layout.entries),
        problems=ProblemList(layout.problems),
        serialization=set(layout.serialization),
        transforms=dict(layout.transforms),
    )


def _analyse_unpaused(source: Source) -> Layout:
    """Read `.metadata` and check it against the files; collect every problem found.

    Raises FormatError only when the metadata itself cannot be read (missing, hostile, corrupt).
    """
    storage = source.storage
    listing = storage.list_files() if source.target is not None else source.files
    where = storage.describe(METADATA)
    if METADATA not in listing and is_dcp_hf_sharded([n for n in listing if "/" not in n]):
        layout = analyse_hf_shards(source, listing)
        check_files(layout)
        check_coverage(layout)
        return layout
    _refuse_without_metadata(source, listing)
    layout = Layout(files=dict(listing))
    md = _read_metadata(source, listing, layout)
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise FormatError("has no state_dict_metadata map", path=where, fix=CORRUPT_METADATA_FIX)
    items = _Items(layout, _storage_index(md, where), where, storage)
    # from here on the stand-ins are let go as soon as they are read: with a million chunks
    # they outweigh the manifest built from them (the index holds what storage_data said)
    if isinstance(md.storage_data, dict):
        md.storage_data.clear()
    layout.planner_data = md.planner_data
    layout.version = md.version if isinstance(md.version, str) else None
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    blamed = METADATA if METADATA in listing else None
    pending: list[PendingTensor] = []
    for fqn, item in sdm.items():
        if not isinstance(fqn, str):
            raise FormatError(
                "has a state_dict_metadata key that is not a string",
                path=where,
                fix=CORRUPT_METADATA_FIX,
            )
        if fqn in planner:
            _check_planner_path(layout, planner[fqn], fqn, blamed)
        if isinstance(item, BytesStorageMetadata):
            items.add_object(fqn)
        elif isinstance(item, TensorStorageMetadata):
            pending.append(items.tensor(fqn, item))
            sdm[fqn] = None  # read into `pending`: its chunk stand-ins are let go
        else:
            raise FormatError(
                f"entry {fqn!r} has an unknown storage kind", path=where, fix=CORRUPT_METADATA_FIX
            )
    _add_tensors(layout, pending, locate_raw_chunks(source, layout, pending))
    check_files(layout)
    check_coverage(layout)
    read_megatron_common(storage, listing, layout)
    return layout


def _check_planner_path(layout: Layout, path: Any, fqn: str, blamed: str | None) -> None:
    """A problem when `path`, the `planner_data` of entry `fqn`, is no key path that spells
    `fqn` (`("optim", "param_groups", 0, "lr")` for `optim.param_groups.0.lr`), the only kind
    `dcp.save` records: torch's loaders that rebuild the state dict from `.metadata`
    (`dcp_to_torch_save`, `_load_state_dict_from_keys`, FSDP's optimizer loading) place the
    entry there and then find no entry of that name, or fail on a path that is no path."""
    if path == (fqn,) or planner_keys(path, fqn) is not None:
        return
    layout.problem(
        "dcp_bad_planner_data",
        f"records {reprlib.repr(path)} as the place of {fqn!r} in the saved state dict, which "
        "is no key path that spells that name: torch's loaders that rebuild the state dict "
        "from .metadata (`dcp_to_torch_save`, FSDP's optimizer loading) refuse the checkpoint",
        file=blamed,
        tensor=fqn,
    )


def _refuse_without_metadata(source: Source, listing: dict[str, int]) -> None:
    """Raise when there is no `.metadata` (nor per-rank metadata) to read."""
    if METADATA in listing:
        return
    if not any(n.endswith(SUFFIX) for n in listing):
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
    if not any(RANK_METADATA.match(n) for n in listing):
        raise InterruptedSaveError(
            f"has {sum(n.endswith(SUFFIX) for n in listing)} .distcp file(s) but no .metadata: "
            "the save looks interrupted (DCP writes .metadata last)",
            path=source.location.raw,
            fix="Use the previous complete checkpoint or save again; this one cannot be loaded.",
        )


class _Items:
    """Turns `.metadata` items into entries: checks each storage entry's file name and range."""

    def __init__(
        self,
        layout: Layout,
        index: dict[tuple[Any, Any], StorageInfo],
        where: str,
        storage: Storage,
    ) -> None:
        self.layout, self.index, self.where = layout, index, where
        self.storage = storage
        # resolved file names, checked once each
        self.safe_names: dict[str, str] = {}

    def resolve(self, info: StorageInfo, name: str) -> tuple[str, int, int]:
        """(safe file name, offset, length) of one storage entry; records its transform."""
        rel = info.relative_path
        if not isinstance(rel, str):
            raise FormatError(
                f"entry {name!r} has no file name", path=self.where, fix=CORRUPT_METADATA_FIX
            )
        if rel not in self.safe_names:
            safe = safe_relpath(rel, source=self.where)
            # confined before the listing's size of it is judged: a link out of the checkpoint
            # is refused naming the link and its target (the listing follows links, so its
            # size is the outside file's: "truncated" would be a lie, and tell that size)
            self.storage.local_path(safe)
            self.safe_names[rel] = safe
        offset, length = info.offset, info.length
        if not (is_count(offset) and is_count(length)):
            raise FormatError(
                f"entry {name!r} has an invalid byte range",
                path=self.where,
                fix=CORRUPT_METADATA_FIX,
            )
        if info.transform_descriptors:
            self.layout.transforms[(self.safe_names[rel], offset)] = transform_of(
                info.transform_descriptors, name, self.where
            )
        return self.safe_names[rel], offset, length

    def add_object(self, fqn: str) -> None:
        """Add the object entry `fqn` (a problem when it has no storage entry)."""
        info = self.index.get((fqn, None))
        if info is None:
            self.layout.problem(
                "dcp_missing_storage",
                f"object {fqn!r} has no storage entry in .metadata",
                file=METADATA,
                tensor=fqn,
            )
            return
        rel, offset, length = self.resolve(info, fqn)
        self.layout.entries.append(
            Entry.checked(
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

    def tensor(self, fqn: str, item: TensorStorageMetadata) -> PendingTensor:
        """The tensor `fqn`'s dtype, shape and stored chunks, checked."""
        where = self.where
        dtype = getattr(item.properties, "dtype", None)
        shape = int_list(item.size)
        if not isinstance(dtype, str) or not dtypes.is_known(dtype):
            raise FormatError(
                f"tensor {fqn!r} has dtype {dtype!r}, which this tool does not support",
                path=where,
                fix="Upgrade ckpt if this is a new dtype; otherwise the file is corrupt.",
            )
        why = "not a list of dimensions" if shape is None else dtypes.shape_problem(shape)
        if shape is None or why is not None:
            raise FormatError(
                f"tensor {fqn!r} has an invalid size {dtypes.shown(item.size)} ({why})",
                path=where,
                fix="The .metadata is corrupt or crafted; save the checkpoint again.",
            )
        if not isinstance(item.chunks, list):
            raise FormatError(
                f"tensor {fqn!r} has no chunk list", path=where, fix=CORRUPT_METADATA_FIX
            )
        chunks: list[PendingChunk] = []
        for chunk in item.chunks:
            offsets = int_list(getattr(chunk, "offsets", None))
            sizes = int_list(getattr(chunk, "sizes", None))
            if offsets is None or sizes is None or len(offsets) != len(shape) != len(sizes):
                raise FormatError(
                    f"tensor {fqn!r} has a malformed chunk", path=where, fix=CORRUPT_METADATA_FIX
                )
            if len(sizes) != len(shape):
                raise FormatError(
                    f"tensor {fqn!r} has a malformed chunk", path=where, fix=CORRUPT_METADATA_FIX
                )
            # a chunk that is the whole tensor (the usual one of a single-rank save) keeps the
            # tensor's shape and the shared zeros, not two lists of its own (#30)
            if sizes == shape:
                sizes = shape
            if not any(offsets):
                offsets = zeros(len(offsets))
            info = self.index.get((fqn, tuple(offsets)))
            if info is None:
                self.layout.problem(
                    "dcp_missing_storage",
                    f"tensor {fqn!r}: chunk at {offsets} has no storage entry in .metadata",
                    file=METADATA,
                    tensor=fqn,
                )
                continue
            rel, offset, length = self.resolve(info, fqn)
            chunks.append((offsets, sizes, rel, offset, length))
        # each chunk's storage entry is read once (no other tensor's keys name this fqn)
        for chunk_offsets, *_ in chunks:
            self.index.pop((fqn, tuple(chunk_offsets)), None)
        return fqn, dtype, shape, chunks


def _add_tensors(
    layout: Layout,
    pending: list[PendingTensor],
    raw_ranges: dict[tuple[str, str, tuple[int, ...]], tuple[int, int]],
) -> None:
    """One tensor entry per pending tensor; chunks found raw point at their raw bytes.

    `pending` is emptied as the entries are built: its tuples are let go one by one, not all
    at the end, when every entry is alive beside them (#30)."""
    pending.reverse()
    while pending:
        fqn, dtype, shape, chunks = pending.pop()
        built: list[Chunk] = []
        for offsets, sizes, rel, offset, length in chunks:
            # the lists are the ones `_Items.tensor` made from `.metadata` (checked there)
            raw = raw_ranges.get((rel, fqn, tuple(offsets)))
            if raw is not None:
                built.append(Chunk(offsets, sizes, rel, raw[0], raw[1], raw=True))
            else:
                built.append(Chunk(offsets, sizes, rel, offset, length))
        chunks.clear()  # the pending tuples are let go as their chunks are built
        nbytes = dtypes.numel(shape) * dtypes.itemsize(dtype)
        whole = len(built) == 1 and built[0].raw and built[0].sizes == shape
        layout.entries.append(
            Entry.checked(
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


def check_files(layout: Layout) -> None:
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


def check_saved_tensors(storage: Storage, layout: Layout) -> None:
    """Each torch_save chunk declares the dtype and sizes `.metadata` gives it (one small read each).

    The heads are read file by file in offset order, each file opened once
    (`Storage.read_ranges`; a save of 2,048 ranks interleaves its files chunk by chunk); the
    problems are then listed in entry order.
    """
    entries: list[Entry] = []
    chunks: list[Chunk] = []
    by_file: dict[str, list[int]] = {}
    for entry in layout.entries:
        if entry.kind != "tensor" or entry.dtype is None:
            continue
        for chunk in entry.chunks or []:
            size = layout.files.get(chunk.file)
            if chunk.raw or size is None or chunk.byte_offset + chunk.byte_length > size:
                continue  # raw chunks are checked against their header; the rest is reported
            by_file.setdefault(chunk.file, []).append(len(chunks))
            entries.append(entry)
            chunks.append(chunk)
    # what each chunk's head says, judged as it is read: a verdict per chunk (None: fine;
    # unread: its head could not be read), not a parsed head per chunk held to the end (#30)
    unread = ("", "")
    verdicts: list[tuple[str, str] | None] = [unread] * len(chunks)
    for rel, indexes in by_file.items():
        indexes.sort(key=lambda i: chunks[i].byte_offset)
        where = storage.describe(rel)
        compressed = [(rel, chunks[i].byte_offset) in layout.transforms for i in indexes]
        # the first bytes of a zstd stream inflate to the blob's zip header + pickle
        ranges = (
            (chunks[i].byte_offset, min(1 << 16 if packed else _TENSOR_HEAD, chunks[i].byte_length))
            for i, packed in zip(indexes, compressed, strict=True)
        )
        for i, packed, stored in zip(
            indexes, compressed, storage.read_ranges(rel, ranges), strict=False
        ):
            head = inflate_head(stored, _TENSOR_HEAD) if packed else stored
            saved = peek_saved_tensor(head, where) if head is not None else None
            verdicts[i] = _saved_verdict(entries[i], chunks[i], saved, packed)
    for entry, chunk, verdict in zip(entries, chunks, verdicts, strict=True):
        if verdict is unread:
            verdict = _saved_verdict(entry, chunk, None, False)
        if verdict is not None:
            layout.problem(verdict[0], verdict[1], file=chunk.file, tensor=entry.name)


def _saved_verdict(
    entry: Entry, chunk: Chunk, saved: SavedTensor | None, packed: bool
) -> tuple[str, str] | None:
    """The problem (code, message) of a torch_save chunk whose head declares `saved`."""
    if saved is None:
        return (
            "dcp_bad_chunk",
            f"tensor {entry.name!r}: the chunk at {chunk.offsets} (byte {chunk.byte_offset}) "
            "is not a readable torch.save blob of a tensor",
        )
    if saved.dtype != entry.dtype or saved.shape != chunk.sizes:
        return (
            "dcp_mismatch",
            f"tensor {entry.name!r}: the chunk at {chunk.offsets} is "
            f"{entry.dtype}{chunk.sizes} in .metadata but the file holds "
            f"{saved.dtype}{saved.shape}",
        )
    if not packed and saved.storage_bytes > chunk.byte_length:
        return (
            "dcp_mismatch",
            f"tensor {entry.name!r}: the chunk at {chunk.offsets} declares "
            f"{saved.storage_bytes} bytes of data in a {chunk.byte_length}-byte range",
        )
    return None


def _overlap(a: Chunk, b: Chunk) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


#: overlapping pairs of one tensor's chunks reported (one is enough to refuse the tensor)
_OVERLAPS_SHOWN = 3
#: grid cells per chunk (plus a floor) the overlap check may mark
_CELLS_PER_CHUNK = 8
_CELLS_FLOOR = 1 << 16
#: chunk pairs the sweep may compare where the chunks form no grid
_SWEEP_PAIRS = 20_000_000


def _overlaps(chunks: list[Chunk]) -> list[tuple[Chunk, Chunk]] | None:
    """Up to `_OVERLAPS_SHOWN` pairs of `chunks` (in bounds, non-empty) that overlap, found in
    time linear in the chunks where they form a grid (every sharding torch writes does).

    The chunk boundaries along each dimension cut the tensor into cells; each chunk marks the
    cells it covers and one that meets a marked cell overlaps an earlier chunk. Where the cells
    would outnumber the chunks many times over (boundaries that form no grid), a sweep along
    the dimension with the most distinct offsets compares the chunks still open, within
    `_SWEEP_PAIRS` comparisons (None past them). (A sweep alone compared 1,000,000 chunks of
    one column, 30 MB of `.metadata`, pair by pair: hours of CPU.)
    """
    found: list[tuple[Chunk, Chunk]] = []
    if len(chunks) < 2:
        return found
    ndim = len(chunks[0].offsets)
    cuts: list[dict[int, int]] = []
    cells = 1
    for d in range(ndim):
        points = sorted(
            {c.offsets[d] for c in chunks} | {c.offsets[d] + c.sizes[d] for c in chunks}
        )
        cuts.append({p: i for i, p in enumerate(points)})
        cells *= max(len(points) - 1, 1)
    if cells <= _CELLS_PER_CHUNK * len(chunks) + _CELLS_FLOOR:
        owner: dict[int, Chunk] = {}
        strides = [1] * ndim
        for d in range(ndim - 2, -1, -1):
            strides[d] = strides[d + 1] * max(len(cuts[d + 1]) - 1, 1)
        for chunk in chunks:
            spans = [
                range(cuts[d][chunk.offsets[d]], cuts[d][chunk.offsets[d] + chunk.sizes[d]])
                for d in range(ndim)
            ]
            for cell in itertools.product(*spans):
                key = sum(i * st for i, st in zip(cell, strides, strict=True))
                other = owner.setdefault(key, chunk)
                if other is not chunk:
                    found.append((other, chunk))
                    break  # one overlap per chunk says it
            if len(found) >= _OVERLAPS_SHOWN:
                break
        return found
    dim = max(range(ndim), key=lambda d: len(cuts[d]))
    active: list[Chunk] = []
    pairs = 0
    for chunk in sorted(chunks, key=lambda c: c.offsets[dim]):
        start = chunk.offsets[dim]
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > start]
        pairs += len(active)
        if pairs > _SWEEP_PAIRS:
            return None
        for other in active:
            if _overlap(chunk, other):
                found.append((other, chunk))
                if len(found) >= _OVERLAPS_SHOWN:
                    return found
        active.append(chunk)
    return found


def check_coverage(layout: Layout) -> None:
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
        if bad:
            continue
        overlaps = _overlaps(live)
        if overlaps is None:
            layout.problem(
                "dcp_coverage",
                f"tensor {entry.name!r} has {len(live):,} chunks whose boundaries form no grid, "
                "more than ckpt compares pair by pair (the .metadata is corrupt or hostile)",
                tensor=entry.name,
            )
            continue
        for other, chunk in overlaps:
            layout.problem(
                "dcp_overlap",
                f"tensor {entry.name!r}: chunks at {other.offsets} and {chunk.offsets} overlap",
                file=chunk.file,
                tensor=entry.name,
            )
        if overlaps:
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


def peek_objects(storage: Storage, layout: Layout) -> None:
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
        try:
            py_type, value = peek_saved_object(blob, storage.describe(entry.file))
        except FormatError:
            if read_archive(blob).damage is None:
                raise  # over its budget as written (hostile): nothing opens it
            # bytes changed after dcp.save wrote them (a flipped size): that one entry is
            # corrupt, which verify names and every read of it refuses; inspect shows no type
            continue
        layout.entries[index] = entry.model_copy(update={"py_type": py_type, "value": value})
