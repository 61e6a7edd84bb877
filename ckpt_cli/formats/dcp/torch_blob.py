"""DCP torch_save items as raw bytes, both ways, without torch.

Reading: `locate_chunk` finds a torch_save chunk's C-order tensor bytes inside its blob (the
zip directory and a restricted walk of data.pkl, `torch_zip.locate_single_tensor`), so a copy
to a raw format moves that byte range instead of deserialising the blob.

Writing: `write_tensor_blob` writes the `torch.save` container of one tensor around its raw
bytes, streamed in blocks (the CRC as they pass) or, from a local `FileRange`, copied in the
kernel (`torch_zip.write_record`), with its records in torch.save's order:
`data.pkl` first (what `peek.peek_saved_tensor` reads from the blob's first bytes), then
`.format_version`, `.storage_alignment`, `byteorder`, `data/0` (64-byte aligned in the blob),
`version`. data.pkl is byte for byte what torch.save pickles for that tensor; the zip headers
are Python's `zipfile`'s, not torch's miniz ones, and torch's `.data/serialization_id` record
is left out (no reader needs it), so the blob is not byte-identical to `torch.save`'s.

A small tensor's container (`SMALL_BLOB`) is the same bytes, built from a template per dtype and
shape: the container `zipfile` writes around zeros, with the data and its CRC-32 put in. Only
the data record's bytes and CRC depend on the data (the date is fixed), and building six zip
records per tensor was most of the CPU of a copy of many small tensors (#30).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import IO, Any, cast

from ... import dtypes
from ...models import Chunk
from ...storage.fileio import FileRange
from ..torch.zip_index import locate_single_tensor
from ..torch.zip_write import (
    ALIGNMENT,
    PROTOCOL,
    StorageRef,
    c_strides,
    raw_tensor_reduction,
    torch_names,
    write_record,
)

#: the dtypes whose data.pkl `tensor_pickle` writes byte for byte as torch.save does (checked
#: against torch 2.13 for each) and that are read raw; others go through torch.save/torch.load
BLOB_DTYPES = frozenset(
    {
        "bfloat16", "bool", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "int16", "int32", "int64", "int8", "uint16", "uint32", "uint64", "uint8",
    }
)  # fmt: skip
#: tensors up to this many bytes have their container built in memory, then written at once
SMALL_BLOB = 1 << 20
#: torch.save's fixed timestamp (equal inputs give equal blobs)
_DATE = (1980, 1, 1, 0, 0, 0)
_ARCHIVE = "archive/"


def locate_chunk(
    read: Any, chunk: Chunk, dtype: str, where: str | None = None
) -> tuple[Chunk, int | None] | None:
    """`chunk` (a torch_save blob) pointing at its raw C-order tensor bytes, with the CRC-32
    the blob's zip records for them, or None when the blob is not one plain contiguous tensor
    of exactly the chunk's dtype and sizes.

    `read(offset, n)` reads the chunk's file at absolute offsets; `where` names it in the
    FormatError of a blob over its budget (`budgets`).
    """
    if dtype not in BLOB_DTYPES:
        return None  # read with torch.load (complex32/complex128 have no raw tensor path)
    found = locate_single_tensor(read, chunk.byte_offset, chunk.byte_length, where)
    if found is None:
        return None
    shape = tuple(chunk.sizes)
    want = dtypes.numel(list(shape)) * dtypes.itemsize(dtype)
    if (
        found.dtype != dtype
        or found.shape != shape
        or found.storage_offset != 0
        or (found.stride != c_strides(shape) and dtypes.numel(list(shape)) > 1)
        or found.length != want
        or found.offset < chunk.byte_offset
        or found.offset + found.length > chunk.byte_offset + chunk.byte_length
    ):
        return None
    located = replace(chunk, byte_offset=found.offset, byte_length=found.length, raw=True)
    return located, found.crc32


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is StorageRef else None


def tensor_pickle(dtype: str, shape: list[int]) -> bytes:
    """The data.pkl `torch.save` writes for a contiguous CPU tensor stored as record `0`."""
    reduced, used = raw_tensor_reduction(dtype, tuple(int(d) for d in shape), "0")
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PROTOCOL).dump(reduced)
    return torch_names(buffer.getvalue(), used)


class _Shifted(io.RawIOBase):
    """`fh` seen from `base` on: zipfile records offsets from its file's start (Python 3.11 has
    no offset of its own for a zip written mid-file), and a DCP blob is loaded on its own."""

    def __init__(self, fh: IO[bytes], base: int):
        super().__init__()
        self._fh, self._base = fh, base

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._fh.write(data)

    def tell(self) -> int:
        return self._fh.tell() - self._base

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            return self._fh.seek(self._base + offset) - self._base
        return self._fh.seek(offset, whence) - self._base

    def flush(self) -> None:
        self._fh.flush()


def write_tensor_blob(fh: IO[bytes], dtype: str, shape: list[int], blocks: Iterable[Any]) -> int:
    """Write the torch.save container of one tensor at `fh`'s position; its length in bytes.

    `blocks` yield the tensor's C-order bytes (numel x itemsize in all). No torch is imported.
    """
    nbytes = dtypes.numel(shape) * dtypes.itemsize(dtype)
    if nbytes <= SMALL_BLOB and not isinstance(fh, io.BytesIO):
        # a small tensor's container is built in memory and written in one call: through
        # the file, zipfile's seek-back per record costs ~20 system calls a tensor
        data = b"".join(bytes(block) for block in blocks)
        if len(data) != nbytes:
            raise ValueError(f"data/0: got {len(data)} bytes for a {nbytes}-byte record")
        blob = _template(dtype, shape, nbytes).fill(data)
        fh.write(blob)
        return len(blob)
    return _write_zip(fh, dtype, shape, blocks, nbytes)


def _write_zip(
    fh: IO[bytes], dtype: str, shape: list[int], blocks: Iterable[Any], nbytes: int
) -> int:
    """`write_tensor_blob` through `zipfile`, record by record."""
    base = fh.tell()
    shifted = cast(IO[bytes], _Shifted(fh, base))
    with zipfile.ZipFile(shifted, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        data = tensor_pickle(dtype, shape)
        write_record(archive, fh, base, _ARCHIVE + "data.pkl", data, len(data))
        for name, text in (
            (".format_version", "1"),
            (".storage_alignment", str(ALIGNMENT)),
            ("byteorder", sys.byteorder),
        ):
            write_record(archive, fh, base, _ARCHIVE + name, text.encode(), len(text))
        data_blocks = blocks if isinstance(blocks, FileRange) else iter(blocks)
        write_record(archive, fh, base, _ARCHIVE + "data/0", data_blocks, nbytes)
        write_record(archive, fh, base, _ARCHIVE + "version", b"3\n", 2)
    return fh.tell() - base


@dataclass(frozen=True, slots=True)
class _Template:
    """A small tensor's container less its data: the bytes before and after the data record's
    bytes, and where its CRC-32 goes in each (the local header in `head`, the central
    directory entry in `tail`)."""

    head: bytes
    tail: bytes
    head_crc: int
    tail_crc: int

    def fill(self, data: bytes) -> bytearray:
        """The container holding `data`."""
        blob = bytearray(self.head)
        blob += data
        blob += self.tail
        crc = zlib.crc32(data)
        struct.pack_into("<I", blob, self.head_crc, crc)
        struct.pack_into("<I", blob, len(self.head) + len(data) + self.tail_crc, crc)
        return blob


#: templates by (dtype, shape), at most `_MAX_TEMPLATES` (a model has a few hundred shapes; no
#: input makes the cache grow past that: it starts over)
_TEMPLATES: dict[tuple[str, tuple[int, ...]], _Template] = {}
_MAX_TEMPLATES = 4096
_DATA_RECORD = _ARCHIVE + "data/0"


def _template(dtype: str, shape: list[int], nbytes: int) -> _Template:
    """The template of the container `_write_zip` writes for a `dtype` tensor of `shape`."""
    key = (dtype, tuple(shape))
    found = _TEMPLATES.get(key)
    if found is not None:
        return found
    buffer = io.BytesIO()
    _write_zip(buffer, dtype, shape, iter([bytes(nbytes)]), nbytes)
    blob = buffer.getvalue()
    local = zipfile.ZipFile(io.BytesIO(blob)).getinfo(_DATA_RECORD).header_offset
    name_length, extra_length = struct.unpack_from("<HH", blob, local + 26)
    start = local + 30 + name_length + extra_length
    # the central directory: its entry for the data record (46 bytes + name + extra + comment)
    directory = struct.unpack_from("<I", blob, len(blob) - 22 + 16)[0]
    at = directory
    while blob[at + 46 : at + 46 + len(_DATA_RECORD)] != _DATA_RECORD.encode():
        at += 46 + sum(struct.unpack_from("<HHH", blob, at + 28))
    template = _Template(blob[:start], blob[start + nbytes :], local + 14, at + 16 - start - nbytes)
    if template.fill(bytes(nbytes)) != blob:
        raise AssertionError(f"the {dtype}{shape} container template does not rebuild itself")
    if len(_TEMPLATES) >= _MAX_TEMPLATES:
        _TEMPLATES.clear()
    _TEMPLATES[key] = template
    return template


class ByteStream:
    """Raw blocks re-cut into consecutive pieces of given lengths (no copies: slices)."""

    def __init__(self, blocks: Iterator[bytes]):
        self._blocks = iter(blocks)
        self._left = memoryview(b"")
        #: bytes handed out so far
        self.done = 0

    def take(self, length: int) -> Iterator[memoryview]:
        """The next `length` bytes, as slices of the source blocks (each valid until the next)."""
        need = length
        while need > 0:
            if not len(self._left):
                block = next(self._blocks, None)
                if block is None:
                    return
                self._left = memoryview(block).cast("B")
                continue
            piece = self._left[:need]
            self._left = self._left[len(piece) :]
            need -= len(piece)
            self.done += len(piece)
            yield piece

    def at_end(self) -> bool:
        """Whether the source has no bytes left."""
        while not len(self._left):
            block = next(self._blocks, None)
            if block is None:
                return True
            self._left = memoryview(block).cast("B")
        return False
