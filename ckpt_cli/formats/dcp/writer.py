"""`DcpWriter`: streams chunks into `__{rank}_0.distcp` files, `.metadata` last."""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from ... import dtypes
from ...dist.placement import shard_dim0_boxes
from ...errors import REPORT_BUG, FormatError, UsageError
from ...models import Chunk, Entry, FileInfo
from ...storage import safe_relpath
from ...storage.fileio import FileRange, open_output
from ..base import WriteOptions, Writer
from .check import check_coverage
from .layout import (
    METADATA,
    SERIALIZATIONS,
    SHARDING_INFO_KEY,
    SUFFIX,
    Layout,
    rank_chunk,
    rank_file,
    zeros,
)
from .torch_blob import BLOB_DTYPES, ByteStream, write_tensor_blob
from .torch_metadata import write_metadata

if TYPE_CHECKING:
    import torch

#: the fix when a tensor's raw bytes from the source are more or fewer than its entry says
SHORT_SOURCE_FIX = (
    "The source's data changed or is shorter than its header says: run `ckpt verify` on the "
    "source, restore it if that finds problems, then run the same command again."
)


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
    `options.dcp_planner_data` keeps a source's planner_data (default: the fqn split
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
            raise FormatError(
                f"world size must be at least 1, not {options.world_size}",
                fix="Pass a world size of 1 or more (--world-size).",
            )
        if options.single_file:
            raise FormatError(
                "a DCP checkpoint is a folder (.metadata + .distcp files), not a single file",
                fix="Give a folder as the destination.",
            )
        self.serialization = options.dcp_serialization
        #: `zstd`: every item goes through DCP's ZStandard stream extension (`stream.zstd/1`)
        self.compression: str | None = options.dcp_compression or None
        if self.compression not in (None, "zstd"):
            raise FormatError(
                f"unknown DCP compression {self.compression!r}",
                fix="Use --dcp-compression zstd or none.",
            )
        if self.compression and self.serialization == "safetensors":
            # two options that do not go together (the serialization given, or the source's
            # that reshard keeps): a usage error, not a bad checkpoint
            raise UsageError(
                "DCP compression applies to the torch_save serialization only",
                fix="Drop --dcp-compression, or write --dcp-serialization torch_save.",
            )
        self.world_size = options.world_size
        self.entries: dict[str, Entry] = {}
        self.layout: dict[str, list[Chunk]] = {}
        self._accepts_raw: bool | None = None
        self.results: dict[str, list[tuple[int, int] | None]] = {}
        self._object_file: dict[str, str] = {}
        files: dict[str, None] = {rank_file(r): None for r in range(self.world_size)}
        for entry in plan:
            if entry.name in self.entries:
                raise FormatError(f"entry {entry.name!r} is planned twice", fix=REPORT_BUG)
            self.entries[entry.name] = entry
            if entry.kind == "object":
                self._object_file[entry.name] = rank_file(0)
                self.results[entry.name] = [None]
                continue
            if entry.dtype is None or not dtypes.is_known(entry.dtype):
                raise FormatError(
                    f"tensor {entry.name!r} has no supported dtype ({entry.dtype!r})",
                    fix="Leave it out with --filter-out, or convert to torch, which keeps any "
                    "torch dtype.",
                )
            if self.serialization == "safetensors" and not dtypes.has_safetensors_code(entry.dtype):
                raise FormatError(
                    f"tensor {entry.name!r} is {entry.dtype}, which the safetensors "
                    "serialization cannot store",
                    fix="Use --dcp-serialization torch_save (the default), which keeps it.",
                )
            if self.serialization == "safetensors" and entry.name == "__metadata__":
                # the embedded blob's header keys chunks by name beside its own metadata
                raise FormatError(
                    "the safetensors serialization cannot name a tensor '__metadata__': the "
                    "key is reserved for the header's metadata",
                    fix="Use --dcp-serialization torch_save (the default), which keeps it, or "
                    "rename it with --rename OLD=NEW.",
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
        if entry.chunks is None and self.world_size == 1:
            # one rank holds the whole tensor: its chunk shares the plan's shape list and one
            # list of zeros per rank count (chunks are never changed), not two lists per entry
            return [Chunk(zeros(len(shape)), entry.shape, rank_file(0), 0, 0)]
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
                    f"tensor {entry.name!r}: planned chunk {chunk.offsets} has the wrong rank",
                    fix=REPORT_BUG,
                )
            rel = safe_relpath(chunk.file, source="the write plan")
            if "/" in rel or not rel.endswith(SUFFIX):
                raise FormatError(
                    f"tensor {entry.name!r}: planned file {rel!r} is not a top-level .distcp name",
                    fix=REPORT_BUG,
                )
            if rel != chunk.file or chunk.byte_offset or chunk.byte_length or chunk.raw:
                chunk = replace(chunk, file=rel, byte_offset=0, byte_length=0, raw=False)
            out.append(chunk)  # a planned chunk (`rank_chunk`) is kept as it is: no copy
        if len({tuple(c.offsets) for c in out}) != len(out):
            raise FormatError(
                f"the write plan for {entry.name!r} has two chunks at the same offsets "
                "(DCP keys chunks by their offsets)",
                fix=REPORT_BUG,
            )
        probe = Layout(entries=[entry.model_copy(update={"chunks": out})])
        check_coverage(probe)
        if probe.problems:
            raise FormatError(
                f"the write plan for {entry.name!r} is invalid: {probe.problems[0].message}",
                fix=REPORT_BUG,
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
        state.fh = open_output(self.staging / name)
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
        """Raw copies work when chunks split only dim 0: into the embedded safetensors blob, or
        (torch_save, uncompressed) into a torch.save container written around the bytes.

        Decided once: the plan does not change while writing, and asking per entry made a
        copy of n entries cost n² (20,000 entries: minutes)."""
        if self._accepts_raw is None:
            self._accepts_raw = self._raw_plan()
        return self._accepts_raw

    def _raw_plan(self) -> bool:
        if self.compression is not None:
            return False
        if self.serialization == "torch_save" and any(
            e.dtype not in BLOB_DTYPES for e in self.entries.values() if e.kind == "tensor"
        ):
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
            raise FormatError(f"tensor {name!r} is not in the write plan", fix=REPORT_BUG)
        entry = self.entries[name]
        if list(tensor.shape) != list(entry.shape):
            raise FormatError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the plan says {entry.shape}",
                fix=REPORT_BUG,
            )
        for index, chunk in enumerate(chunks):
            if chunk.file not in self._owned:
                continue
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            self.write_chunk(name, index, tensor[box] if box else tensor)

    def write_chunk(self, name: str, chunk_index: int, piece: torch.Tensor) -> None:
        """Write one planned chunk (its box of the global tensor) of tensor `name`."""
        from ...tensors import dtype_name, tensor_bytes

        chunks = self.layout.get(name)
        if chunks is None or not 0 <= chunk_index < len(chunks):
            raise FormatError(f"tensor {name!r} has no planned chunk {chunk_index}", fix=REPORT_BUG)
        chunk = chunks[chunk_index]
        entry = self.entries[name]
        if list(piece.shape) != list(chunk.sizes) or dtype_name(piece.dtype) != entry.dtype:
            raise FormatError(
                f"tensor {name!r}: chunk {chunk_index} must be {entry.dtype}{chunk.sizes}, "
                f"got {dtype_name(piece.dtype)}{list(piece.shape)}",
                fix=REPORT_BUG,
            )
        if self.results[name][chunk_index] is not None:
            raise FormatError(
                f"tensor {name!r}: chunk {chunk_index} was written twice", fix=REPORT_BUG
            )
        state = self._state(chunk.file)
        if self.serialization == "safetensors":
            at = self._raw_at[(name, chunk_index)]
            data = tensor_bytes(piece)
            os.pwrite(state.fh.fileno(), data, at)
            # DCP records the blob start and the chunk's byte count for safetensors items
            self.results[name][chunk_index] = (state.blob_start, len(data))
        elif entry.dtype in BLOB_DTYPES:
            # the container `write_raw` writes too: both paths give the same bytes
            data = tensor_bytes(piece)
            if self.compression is None:
                state.fh.seek(state.append_at)
                written = write_tensor_blob(state.fh, entry.dtype, list(chunk.sizes), [data])
                state.fh.flush()  # objects are appended with os.pwrite after it
                self.results[name][chunk_index] = (state.append_at, written)
                state.append_at += written
            else:
                buffer = io.BytesIO()
                write_tensor_blob(buffer, entry.dtype, list(chunk.sizes), [data])
                self.results[name][chunk_index] = self._append(state, buffer.getbuffer())
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
        """Write tensor `name` from its raw C-order bytes (dim-0 chunks; not compressed)."""
        if not self.accepts_raw:
            raise FormatError("raw writes need dim-0 chunks and no compression", fix=REPORT_BUG)
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
        if self.serialization == "torch_save":
            self._write_raw_blobs(name, targets, blocks)
            return
        if isinstance(blocks, FileRange):
            # local source bytes: each chunk's range copied in the kernel
            pieces = blocks.split([length for _start, length, _index in targets])
            for (_start, _length, index), piece in zip(targets, pieces, strict=True):
                if chunks[index].file in self._owned:
                    fd = self._state(chunks[index].file).fh.fileno()
                    piece.copy_to(fd, self._raw_at[(name, index)])
        else:
            self._pwrite_raw_blocks(name, targets, blocks)
        for index, (chunk, (_start, length, _i)) in enumerate(
            zip(chunks, sorted(targets, key=lambda t: t[2]), strict=True)
        ):
            if chunk.file not in self._owned:
                continue
            self.results[name][index] = (self.files[chunk.file].blob_start, length)
            self.files[chunk.file].entries += 1

    def _pwrite_raw_blocks(
        self, name: str, targets: list[tuple[int, int, int]], blocks: Iterator[bytes]
    ) -> None:
        """Raw blocks of tensor `name` written where each chunk sits in the embedded blob."""
        chunks = self.layout[name]
        entry = self.entries[name]
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
                    raise FormatError(
                        f"tensor {name!r}: more raw bytes than its {entry.nbytes}",
                        fix=SHORT_SOURCE_FIX,
                    )
        if done != entry.nbytes:
            raise FormatError(
                f"tensor {name!r}: got {done} raw bytes, expected {entry.nbytes}",
                fix=SHORT_SOURCE_FIX,
            )

    def _write_raw_blobs(
        self, name: str, targets: list[tuple[int, int, int]], blocks: Iterator[bytes]
    ) -> None:
        """torch_save: each chunk's torch.save container written around its raw bytes (the
        chunks are consecutive byte ranges of the tensor, taken from `blocks` in order)."""
        entry = self.entries[name]
        assert entry.dtype is not None
        lengths = [length for _start, length, _index in targets]
        stream: ByteStream | None = None
        pieces: Iterator[Iterable[Any]]
        if isinstance(blocks, FileRange):
            pieces = iter(blocks.split(lengths))  # local bytes: copied in the kernel (write_record)
        else:
            stream = ByteStream(blocks)
            pieces = (stream.take(length) for length in lengths)
        for (_start, _length, index), piece in zip(targets, pieces, strict=True):
            chunk = self.layout[name][index]
            if chunk.file not in self._owned:
                if stream is not None:  # the stream's later pieces follow these bytes
                    for _ in piece:
                        pass
                continue
            state = self._state(chunk.file)
            state.fh.seek(state.append_at)
            written = write_tensor_blob(state.fh, entry.dtype, list(chunk.sizes), piece)
            state.fh.flush()  # objects are appended with os.pwrite after it
            self.results[name][index] = (state.append_at, written)
            state.append_at += written
            state.entries += 1
        if stream is not None and (stream.done != entry.nbytes or not stream.at_end()):
            raise FormatError(
                f"tensor {name!r}: got {stream.done}{'+' if not stream.at_end() else ''} raw "
                f"bytes, expected {entry.nbytes}",
                fix=SHORT_SOURCE_FIX,
            )

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
            raise FormatError(f"object {name!r} is not in the write plan", fix=REPORT_BUG)
        if self.results[name][0] is not None:
            raise FormatError(f"object {name!r} was written twice", fix=REPORT_BUG)
        state = self._state(rel)
        self.results[name][0] = self._append(state, data)
        state.entries += 1

    def finish(self) -> list[FileInfo]:
        """fsync every data file, then write `.metadata` (the commit marker) last."""
        # one writer holds every result already: no per-chunk copy of them to merge back
        return self.commit([self.finish_part(results=False)])

    def _chunk_files(self, name: str) -> list[str]:
        if name in self._object_file:
            return [self._object_file[name]]
        return [c.file for c in self.layout[name]]

    def finish_part(self, results: bool = True) -> dict[str, Any]:
        """fsync this writer's data files; their sizes and (`results`) the byte ranges of what
        they hold."""
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
        if not results:
            return {"files": files, "results": {}}
        ranges = {
            name: [[i, r[0], r[1]] for i, r in enumerate(found) if r is not None]
            for name, found in self.results.items()
        }
        return {"files": files, "results": {n: r for n, r in ranges.items() if r}}

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
        tmp = self.staging / f"{METADATA}.tmp"
        with open(tmp, "wb") as fh:
            size = write_metadata(
                fh,
                self.plan,
                self.layout,
                self.results,
                self._object_file,
                self.compression,
                self.options.dcp_planner_data,
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, self.staging / METADATA)
        written.insert(0, FileInfo(path=METADATA, size=size, entries=0))
        return written
