"""`DcpCheckpoint`: reads tensors chunk by chunk and non-tensor entries of a DCP folder."""

from __future__ import annotations

import io
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, cast

from ... import dtypes
from ...errors import REPORT_BUG, CkptError, CorruptDataError, FormatError, NotFoundError
from ...faults import naming
from ...models import Chunk, Entry, Manifest
from ...storage import RangeFile, Storage
from ...storage.fileio import COPY_BLOCK, FileRange
from ..base import NAMES_FIX, Checkpoint, RecordedDamage, Source
from ..torch.load import torch_reader_damage
from ..torch.pickle_scan import read_archive
from ..torch.preflight import check_torch_blob, check_torch_pickle
from ..torch.zip_index import check_zip_budget
from .layout import MEGATRON_COMMON
from .peek import common_leaf
from .torch_blob import locate_chunk
from .transforms import OBJECT_INFLATE_MAX, SAVE_OVERHEAD, inflate


class ArchiveBytes(NamedTuple):
    """An object entry's stored bytes, checked, and its `data.pkl` records (None: not kept)."""

    data: bytes
    pickles: tuple[bytes, ...] | None


if TYPE_CHECKING:
    import torch


#: a remote torch_save blob up to this size is fetched whole to check its zip headers (one
#: request); a larger one by ranged reads of its headers only
_WHOLE_BLOB = 4 << 20


#: data files whose read descriptor a checkpoint keeps open between reads: a quarter of the
#: usual `ulimit -n` (1,024); a save of more ranks than that must not run the process out
KEPT_OPEN = 256


class _Descriptor:
    """One open read descriptor of a data file, closed when nothing holds it any more: the
    checkpoint's cache of recent files, or a reader still using it (a `_FileRange` torch.load
    reads from, a zip locator's `pread`), so leaving the cache never closes it under a read."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        with suppress(OSError):
            os.close(self.fd)


class _FileRange(RangeFile):
    """Bytes [start, start + length) of an open file, read with `os.preadv` (no copy of the range).

    `torch.load` of a chunk then reads straight from the file into the new tensor's storage,
    so loading a torch_save chunk needs the chunk's size in memory once, not twice.
    """

    def __init__(self, handle: _Descriptor, start: int, length: int, name: str):
        super().__init__(length, name)
        self._handle = handle  # kept open while this range is read
        self._fd, self._start = handle.fd, start

    def _read_into(self, view: memoryview, position: int) -> int:
        try:
            got = os.preadv(self._fd, [view], self._start + position)
        except OSError as exc:  # a bad sector: this file is the one to check
            raise naming(exc, self.name) from None
        if got == 0:
            raise FormatError(
                f"is truncated: byte {self._start + position} of a stored chunk is past its end",
                path=self.name,
                fix="The file was cut short; write or copy it again.",
            )
        return got

    def close(self) -> None:  # the fd belongs to the checkpoint
        super().close()


class _StoredRange(RangeFile):
    """Bytes [start, start + length) of a file of a (remote) `Storage`, fetched by ranged reads
    as they are asked for: a zip reader's look at a blob's headers never fetches its data."""

    def __init__(self, storage: Storage, rel: str, start: int, length: int):
        super().__init__(length, storage.describe(rel))
        self._storage, self._rel, self._start = storage, rel, start

    def _read_into(self, view: memoryview, position: int) -> int:
        data = self._storage.read(self._rel, self._start + position, len(view))
        view[: len(data)] = data
        return len(data)


#: the fix of a stored chunk that is not the tensor piece `.metadata` records there
MISMATCHED_DATA_FIX = (
    "The .distcp file does not match .metadata (a file of another save, or a corrupt one): "
    "restore the folder from one save (`ckpt repair` where it was protected), or use an "
    "earlier checkpoint."
)

#: how many located torch_save blobs a reader keeps (a tensor's chunks, read again by a slice)
_LOCATED_KEPT = 4096


class DcpCheckpoint(Checkpoint):
    """An opened DCP checkpoint: reads assemble tensors from their chunks.

    Attributes:
        planner_data: the `planner_data` of `.metadata` (fqn -> path in the original nested
            state dict); pass it to the DCP writer as `options.dcp_planner_data`
            to keep it across a rewrite.
    """

    chunk_reads = True
    object_bytes = True

    def __init__(self, source: Source, manifest: Manifest, planner_data: Any = None):
        super().__init__(source, manifest)
        self.planner_data = planner_data
        #: the data files read most recently -> their descriptors (`KEPT_OPEN` at most)
        self._fds: OrderedDict[str, _Descriptor] = OrderedDict()
        self._common: dict[str, Any] | None = None
        #: the last tensor asked about -> its raw chunks in order (None: not raw); a copy asks
        #: `serves_raw`, then `local_ranges`, of one tensor after the other, so one is kept:
        #: kept for every tensor, they grew with the checkpoint (#30)
        self._raw: dict[str, list[Chunk] | None] = {}
        #: (file, offset) of a torch_save blob of that tensor -> its tensor bytes as a raw chunk
        #: and the CRC-32 the blob records for them (None: not plain)
        self._located_at: dict[tuple[str, int], tuple[Chunk, int | None] | None] = {}
        #: the last tensor's raw chunks' recorded CRC-32s, in `_raw`'s order (None: raw bytes)
        self._raw_crcs: dict[str, list[int | None]] = {}
        #: (file, offset) of located tensor bytes whose CRC-32 was checked (`local_ranges`)
        self._crc_checked: set[tuple[str, int]] = set()
        #: (file, offset) -> transform of compressed items (`zstd`); set by `DcpFormat.open`
        self.transforms: dict[tuple[str, int], str] = {}

    def release_entries(self) -> None:
        """`Checkpoint.release_entries`, and the planner_data and the chunks found raw."""
        super().release_entries()
        self.planner_data = None
        self._raw.clear()
        self._raw_crcs.clear()
        self._located_at.clear()
        self._crc_checked.clear()

    def _entry(self, name: str, kind: str) -> Entry:
        entry = self.manifest.by_name.get(name)
        if entry is None:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            )
        if entry.kind != kind:
            raise FormatError(
                f"entry {name!r} is a{'n' if entry.kind == 'object' else ''} {entry.kind}, "
                f"not a{'n' if kind == 'object' else ''} {kind}",
                path=self.manifest.location,
                fix=REPORT_BUG,
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
            return self._read_raw_chunk(entry, chunk, rows)
        if (chunk.file, chunk.byte_offset) not in self.transforms:
            located = self._located(entry, chunk)
            if located is not None:
                # one plain tensor in the blob: read its bytes, no torch.load; they are
                # checked against the CRC-32 the blob records (torch.load checks none)
                from ...storage.crc import crc32_function
                from ...tensors import tensor_bytes

                value = self._read_raw_chunk(entry, located, None)
                recorded = self._recorded_crc(chunk)
                if recorded is not None:
                    got = crc32_function()(tensor_bytes(value), 0)
                    self._check_crc(entry, chunk, recorded, got)
                return value
        import torch

        from ...tensors import dtype_name

        stored: IO[bytes] = self._byte_range(chunk.file, chunk.byte_offset, chunk.byte_length)
        if (chunk.file, chunk.byte_offset) in self.transforms:
            limit = dtypes.numel(chunk.sizes) * dtypes.itemsize(entry.dtype) + SAVE_OVERHEAD
            data = inflate(stored, limit, where, f"tensor {entry.name!r} chunk {chunk.offsets}")
            with self._blob_of(entry, chunk):
                check_zip_budget(lambda at, n: data[at : at + n], 0, len(data), where)
            stored = io.BytesIO(data)
            stored_len: int | None = len(data)
        else:
            stored_len = None
            read = self._reader(chunk.file)
            with self._blob_of(entry, chunk):
                check_zip_budget(read, chunk.byte_offset, chunk.byte_length, where)
        # the blob's pickle read by ckpt's own restricted reader first (`torch.preflight`)
        check_torch_blob(stored, chunk.byte_length if stored_len is None else stored_len, where)
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
                fix=MISMATCHED_DATA_FIX,
            )
        if dtype_name(value.dtype) != entry.dtype:
            raise FormatError(
                f"tensor {entry.name!r}: the chunk at {chunk.offsets} is {dtype_name(value.dtype)}, "
                f".metadata says {entry.dtype}",
                path=where,
                fix=MISMATCHED_DATA_FIX,
            )
        return value

    def _read_raw_chunk(
        self, entry: Entry, chunk: Chunk, rows: tuple[int, int] | None
    ) -> torch.Tensor:
        """A raw chunk's tensor (rows [a, b) of its dim 0 when `rows`), read straight into it."""
        from ...tensors import read_tensor_from_fd, tensor_from_bytes

        assert entry.dtype is not None
        sizes = list(chunk.sizes)
        offset = chunk.byte_offset
        if rows is not None and sizes:
            row_bytes = dtypes.numel(sizes[1:]) * dtypes.itemsize(entry.dtype)
            offset += rows[0] * row_bytes
            sizes[0] = rows[1] - rows[0]
        if self.storage.local_root is not None:  # a local folder: one descriptor per file
            handle = self._local_fd(chunk.file)
            where = self.storage.describe(chunk.file)
            return read_tensor_from_fd(handle.fd, offset, entry.dtype, sizes, where)
        nbytes = dtypes.numel(sizes) * dtypes.itemsize(entry.dtype)
        return tensor_from_bytes(self.storage.read(chunk.file, offset, nbytes), entry.dtype, sizes)

    def _byte_range(self, rel: str, offset: int, length: int) -> IO[bytes]:
        """A seekable file object over one stored range (torch.load reads from it directly)."""
        if self.storage.local_root is not None:  # a local folder: one descriptor per file
            handle = self._local_fd(rel)
            return cast(IO[bytes], _FileRange(handle, offset, length, self.storage.describe(rel)))
        return io.BytesIO(self.storage.read(rel, offset, length))

    def _local_fd(self, rel: str) -> _Descriptor:
        """A read descriptor of local data file `rel`: kept for the checkpoint's next reads
        among the `KEPT_OPEN` files read most recently."""
        handle = self._fds.get(rel)
        if handle is not None:
            self._fds.move_to_end(rel)
            return handle
        path = self.storage.local_path(rel)
        if path is None:
            raise FormatError(
                "is not a local file", path=self.storage.describe(rel), fix=REPORT_BUG
            )
        handle = self._fds[rel] = _Descriptor(path)
        while len(self._fds) > KEPT_OPEN:
            self._fds.popitem(last=False)  # closed once no read holds it
        return handle

    def read_tensor(self, name: str) -> torch.Tensor:
        entry = self._entry(name, "tensor")
        return self.read_slice(name, [0] * len(entry.shape), list(entry.shape))

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """The box (offsets, sizes) of tensor `name`, reading only the chunks that overlap it.

        Raw chunks split along dim 0 are read only for the rows the box needs, so memory
        stays at the size of the box (plus one torch_save chunk for that serialization).
        """
        import torch

        from ...tensors import torch_dtype

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
                fix=REPORT_BUG,
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

    def serves_raw(self, name: str) -> bool:
        """Raw when the entry is, or when its chunks are raw in order (`raw_chunks_in_order`)."""
        entry = self.manifest.by_name[name]
        return entry.is_raw or self.raw_chunks_in_order(name) is not None

    def raw_chunks_in_order(self, name: str) -> list[Chunk] | None:
        """The chunks of `name` in global C order when their raw bytes, concatenated, ARE the
        tensor's bytes (raw chunks split along dim 0 only); None otherwise.

        A torch_save chunk counts as raw when its blob holds one plain contiguous tensor of the
        chunk's dtype and sizes: the returned chunk then points at the tensor bytes inside the
        blob (found from the blob's zip directory and data.pkl, never deserialised; see
        `torch_blob.locate_chunk`). zstd-compressed items never do. This is what lets a copy
        to a raw format skip deserialisation (see `iter_raw`).
        """
        entry = self.manifest.by_name.get(name)
        if entry is None or entry.kind != "tensor" or not entry.chunks or entry.dtype is None:
            return None
        if name in self._raw:
            return self._raw[name]
        self._raw.clear()
        self._raw_crcs.clear()
        self._located_at.clear()
        self._crc_checked.clear()
        ordered = self._raw_order(entry)
        self._raw[name] = ordered
        return ordered

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """The located raw chunks of `name` (`raw_chunks_in_order`) as local file segments."""
        ordered = self.raw_chunks_in_order(name)
        if ordered is None:
            return None
        segments = []
        for chunk in ordered:
            local = self.storage.local_path(chunk.file)
            if local is None:
                return None
            segments.append((local, chunk.byte_offset, chunk.byte_length))
        # the ranges are copied past any reader (in the kernel, or under a CRC the writer
        # computes afresh): tensor bytes inside torch_save blobs are checked against the
        # CRC-32 their blob records first, so corrupt data is refused, not laundered
        entry = self.manifest.by_name[name]
        crcs = self._raw_crcs.get(name) or [None] * len(ordered)
        for chunk, recorded, (local, offset, length) in zip(ordered, crcs, segments, strict=True):
            key = (chunk.file, chunk.byte_offset)
            if recorded is None or key in self._crc_checked:
                continue
            self._check_crc(entry, chunk, recorded, FileRange(local, offset, length).crc32())
            self._crc_checked.add(key)
        return segments

    def _raw_order(self, entry: Entry) -> list[Chunk] | None:
        assert entry.chunks is not None and entry.dtype is not None
        chunks = [c for c in entry.chunks if dtypes.numel(c.sizes) > 0 or not entry.shape]
        if not chunks:
            return [] if dtypes.numel(entry.shape) == 0 else None  # an empty tensor: no bytes
        if entry.shape and any(c.sizes[1:] != entry.shape[1:] for c in chunks):
            return None
        ordered = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
        row = 0
        for chunk in ordered:
            if entry.shape and chunk.offsets[0] != row:
                return None
            row += chunk.sizes[0] if entry.shape else 1
        located: list[Chunk] = []
        crcs: list[int | None] = []
        for chunk in ordered:
            crc = None
            if not chunk.raw:
                if (chunk.file, chunk.byte_offset) in self.transforms:
                    return None
                found = self._located(entry, chunk)
                if found is None:
                    return None
                crc = self._recorded_crc(chunk)
                chunk = found
            located.append(chunk)
            crcs.append(crc)
        self._raw_crcs[entry.name] = crcs
        return located

    def _located(self, entry: Entry, chunk: Chunk) -> Chunk | None:
        """A torch_save `chunk` as the raw chunk of its tensor bytes inside the blob, if plain."""
        assert entry.dtype is not None
        key = (chunk.file, chunk.byte_offset)
        if key not in self._located_at:
            if len(self._located_at) >= _LOCATED_KEPT:  # reads one tensor after another
                self._located_at.clear()
                self._crc_checked.clear()
            with self._blob_of(entry, chunk):
                self._located_at[key] = locate_chunk(
                    self._reader(chunk.file), chunk, entry.dtype, self.storage.describe(chunk.file)
                )
        found = self._located_at[key]
        return None if found is None else found[0]

    @contextmanager
    def _blob_of(self, entry: Entry, chunk: Chunk) -> Iterator[None]:
        """A CorruptDataError of the zip reader (`zip_index.record_damage`: a header torch's
        reader misreads) raised in the block names the tensor and chunk."""
        try:
            yield
        except CorruptDataError as error:
            raise CorruptDataError(
                f"tensor {entry.name!r}: the chunk at {chunk.offsets} (bytes "
                f"{chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length}) "
                f"{error.problem}",
                path=error.path,
                fix=error.fix,
            ) from None

    def _recorded_crc(self, chunk: Chunk) -> int | None:
        """The CRC-32 the blob records for the tensor bytes of torch_save `chunk` (located by
        `_located` just before), or None for raw chunks."""
        found = self._located_at.get((chunk.file, chunk.byte_offset))
        return None if found is None else found[1]

    def _check_crc(self, entry: Entry, chunk: Chunk, recorded: int, got: int) -> None:
        """CorruptDataError when tensor bytes read from a torch_save blob (`chunk`) do not hold
        the CRC-32 the blob's zip records for them."""
        if got == recorded:
            return
        raise CorruptDataError(
            f"tensor {entry.name!r}: the chunk at {chunk.offsets} (bytes "
            f"{chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length}) is corrupt: its "
            f"bytes have CRC-32 {got:08x}, the blob's zip records {recorded:08x} (bad CRC-32: "
            "they changed after they were written)",
            path=self.storage.describe(chunk.file),
            fix="Restore this file from a good copy of the checkpoint (or download it again); "
            "ckpt copies no corrupt data",
        )

    def _reader(self, rel: str) -> Callable[[int, int], bytes]:
        """`read(offset, n)` of one data file (what the zip locator reads with)."""
        if self.storage.local_root is not None:  # a local folder: one descriptor per file
            handle = self._local_fd(rel)  # one open for the many small reads of each blob
            name = self.storage.describe(rel)

            def pread(offset: int, n: int) -> bytes:
                try:
                    return os.pread(handle.fd, n, offset)
                except OSError as exc:  # a bad sector: this file is the one to check
                    raise naming(exc, name) from None

            return pread

        def read(offset: int, n: int) -> bytes:
            return self.storage.read(rel, offset, n)

        return read

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        """The raw C-order bytes of tensor `name`, in blocks, straight from raw chunks (or the
        tensor bytes inside torch_save blobs)."""
        ordered = self.raw_chunks_in_order(name)
        if ordered is None:
            raise FormatError(
                f"tensor {name!r} is not stored as raw bytes in dim-0 pieces",
                path=self.manifest.location,
                fix=REPORT_BUG,
            )
        from ...storage.crc import crc32_function

        checksum = crc32_function()
        entry = self.manifest.by_name[name]
        crcs = self._raw_crcs.get(name) or [None] * len(ordered)
        for chunk, recorded in zip(ordered, crcs, strict=True):
            crc = done = 0
            while done < chunk.byte_length:
                n = min(block, chunk.byte_length - done)
                piece = self.storage.read(chunk.file, chunk.byte_offset + done, n)
                if recorded is not None:
                    crc = checksum(piece, crc)
                yield piece
                done += n
            if recorded is not None:
                # after the chunk's last block: what took the blocks fails before it finishes
                self._check_crc(entry, chunk, recorded, crc)

    def recorded_checksum_errors(self) -> Iterator[RecordedDamage]:
        """The torch_save blob of every tensor chunk opened as torch.load (`dcp.load`) opens it:
        torch's own zip reader (miniz) checks headers ckpt's raw reads of the tensor bytes skip
        (every record's local header, flags, disk numbers, the records torch.load reads besides
        the data), so a flipped header byte that makes `dcp.load` fail, or read uninitialised
        memory, is a CorruptDataError naming the tensor (`torch.load.torch_reader_damage`)."""
        for entry in self.manifest.entries:
            if entry.kind != "tensor" or not entry.chunks:
                continue
            for chunk in entry.chunks:
                if chunk.raw or (chunk.file, chunk.byte_offset) in self.transforms:
                    continue
                blob: IO[bytes] = (
                    self._byte_range(chunk.file, chunk.byte_offset, chunk.byte_length)
                    if self.storage.local_root is not None or chunk.byte_length <= _WHOLE_BLOB
                    else cast(
                        IO[bytes],
                        _StoredRange(
                            self.storage, chunk.file, chunk.byte_offset, chunk.byte_length
                        ),
                    )
                )
                reason = torch_reader_damage(blob)
                if reason is not None:
                    yield RecordedDamage(
                        CorruptDataError(
                            f"tensor {entry.name!r}: the chunk at {chunk.offsets} (bytes "
                            f"{chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length}) is "
                            f"corrupt: torch's zip reader misreads its torch.save archive "
                            f"({reason[:200]}); the bytes changed after they were written",
                            path=self.storage.describe(chunk.file),
                            fix="Restore this file from a good copy of the checkpoint (or download "
                            "it again)",
                        ),
                        entry.name,
                    )

    def read_object_bytes(self, name: str) -> bytes:
        """The stored bytes of a non-tensor entry (a `torch.save` blob), without loading it."""
        entry = self._entry(name, "object")
        if entry.file == MEGATRON_COMMON and entry.offset is None:
            # one key of Megatron's common.pt: stored as DCP stores an object, a torch.save blob
            import torch

            buffer = io.BytesIO()
            torch.save(common_leaf(self._megatron_common(), name), buffer)
            return buffer.getvalue()
        return self._stored_object(entry).data

    def _stored_object(self, entry: Entry) -> ArchiveBytes:
        """The stored bytes of the object `entry`, read through and checked for corruption,
        with the `data.pkl` records read on the way (`pickle_scan.read_archive`)."""
        name = entry.name
        assert entry.file is not None and entry.offset is not None
        data = self.storage.read(entry.file, entry.offset, entry.nbytes)
        where = self.storage.describe(entry.file)
        if (entry.file, entry.offset) in self.transforms:
            limit = OBJECT_INFLATE_MAX + 64 * entry.nbytes
            data = inflate(data, limit, where, f"object {name!r}")
        archive = read_archive(data, where)
        damage = archive.damage
        if damage is not None:
            # checked here, where every reader of the bytes passes: a copy (reshard, convert
            # to DCP) would otherwise carry the corrupt blob into an output that fails to load
            raise CorruptDataError(
                f"object {name!r} (bytes {entry.offset}..{entry.offset + entry.nbytes}) is "
                f"corrupt: its torch.save archive fails its own check ({damage}); the bytes "
                "changed after they were written",
                path=where,
                fix="Restore this file from a good copy of the checkpoint (or download it "
                "again); nothing was written from it",
            )
        return ArchiveBytes(data, archive.pickles)

    def read_object(self, name: str) -> Any:
        """The value of a non-tensor entry, loaded with `torch.load(weights_only=True)`.

        Beyond torch's own set, only `torch_save.object_allowlist()` is admitted: numpy arrays
        and dtypes (RNG states) and `torch.Generator`.
        """
        import pickle

        import torch

        from ..torch.format import object_allowlist

        entry = self._entry(name, "object")
        if entry.file == MEGATRON_COMMON and entry.offset is None:
            return common_leaf(self._megatron_common(), name)
        stored = self._stored_object(entry)
        data = stored.data
        where = self.storage.describe(entry.file or "")
        check_zip_budget(lambda at, n: data[at : at + n], 0, len(data), where)
        # ckpt's own restricted reader first: no allocation by a size, no numpy state that
        # crashes numpy (`torch.preflight`); on the records already read, when they were kept
        if stored.pickles is None:
            check_torch_blob(io.BytesIO(data), len(data), where)
        for pickled in stored.pickles or ():
            check_torch_pickle(pickled, where)
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
            from ..torch.format import load_torch_file

            value, _ = load_torch_file(self.storage, MEGATRON_COMMON)
            if not isinstance(value, dict):
                raise FormatError(
                    "does not hold a dict",
                    path=self.storage.describe(MEGATRON_COMMON),
                    fix="Copy common.pt again from the save: it is corrupt or was not written by "
                    "Megatron-Core.",
                )
            self._common = value
        return self._common

    def close(self) -> None:
        self._fds.clear()  # each descriptor closes once no read holds it


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
