"""A streamed writer of the torch.save zip container: one tensor's bytes in memory at a time.

`torch.save(obj, f)` needs the whole object, so saving a checkpoint that way holds every tensor
at once. The container itself does not need that: it is a zip (stored, not compressed) of

- `<archive>/data/<key>`: the raw bytes of each storage, its data 64-byte aligned in the file
  (what `torch.load(mmap=True)` maps),
- `<archive>/data.pkl`: the pickle of the object, where each storage is a persistent id
  `("storage", <torch.XStorage>, key, "cpu", numel)` and each tensor the reduction torch itself
  gives (`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`),
- `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder`, `version` ("3\\n").

`TorchZipWriter.add_tensor` streams a tensor's storage into the zip as soon as it arrives and
returns a small stand-in that pickles as that tensor; `finish(obj)` pickles the object the
stand-ins sit in, last. `torch.load` finds records by name, so their order does not matter.
Tensors that share one storage (tied weights) are written once while that storage is alive.
The `.data/serialization_id` record torch 2.x adds is left out: no reader needs it, and
without it the same input gives the same bytes.

`TorchZipWriter.add_raw` does the same from raw C-order bytes without torch: the pickle names
torch's globals (`torch._utils._rebuild_tensor_v2`, `torch.FloatStorage`...) through
placeholders of this module, whose GLOBAL opcodes are rewritten to torch's names in data.pkl.

The reading side (`index_torch_zip`, `locate_single_tensor`) finds each tensor's bytes in such
a file from the zip directory and a restricted walk of data.pkl's opcodes, so a copy to a
raw format moves byte ranges and never unpickles anything.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import sys
import threading
import warnings
import weakref
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from ...dtypes import STORAGE_DTYPES, is_known, itemsize
from ...storage.fileio import FileRange
from .flatten import MAX_DEPTH

if TYPE_CHECKING:
    import torch

#: what `torch.save` aligns storage data to (torch.serialization._get_storage_alignment)
ALIGNMENT = 64
_DTYPE_STORAGES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
#: the pickle protocol torch.save uses by default
PROTOCOL = 2
#: bytes handed to the zip (and its CRC) per write
_CHUNK = 16 << 20
#: fixed timestamp, as torch's own writer stores, so equal inputs give equal files
_DATE = (1980, 1, 1, 0, 0, 0)


_PLACEHOLDERS: dict[str, type] = {}


def placeholder(target: str) -> type:
    """A class of this module standing for torch's global `target` in a pickle written
    without torch; `torch_names` rewrites its GLOBAL opcode to torch's name."""
    cls = _PLACEHOLDERS.get(target)
    if cls is None:
        name = "_torch_" + target.replace(".", "__")
        cls = type(name, (), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # pickle checks that the module really holds it
        _PLACEHOLDERS[target] = cls
    return cls


def _global_op(module: str, name: str) -> bytes:
    """The protocol-2 GLOBAL opcode for `module.name`."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def torch_names(data: bytes, used: set[str]) -> bytes:
    """data.pkl with the GLOBAL opcodes of the placeholders in `used` naming torch's globals.

    The pickler memoizes globals, so each used placeholder is written exactly once; when its
    bytes occur more often (a string of the object spells them), the opcodes are found by
    parsing instead, so no string is ever changed.
    """
    for target in sorted(used):
        cls = _PLACEHOLDERS[target]
        marker = _global_op(__name__, cls.__qualname__)
        module, _, attr = target.rpartition(".")
        torch_op = _global_op(module, attr)
        if data.count(marker) == 1:
            data = data.replace(marker, torch_op)
            continue
        wanted = f"{__name__} {cls.__qualname__}"
        spots = [
            pos
            for op, arg, pos in pickletools.genops(io.BytesIO(data))
            if op.name == "GLOBAL" and arg == wanted and pos is not None
        ]
        for pos in reversed(spots):
            data = data[:pos] + torch_op + data[pos + len(marker) :]
    return data


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor (a 0-size dimension counts as 1)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class StorageRef:
    """A storage already written to the zip: pickles as torch's persistent id for it."""

    __slots__ = ("pid",)

    def __init__(self, storage_type: Any, key: str, numel: int):
        self.pid = ("storage", storage_type, key, "cpu", numel)


class Reduced:
    """A tensor whose storage was written: pickles exactly as torch pickles that tensor."""

    __slots__ = ("args", "func")

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]):
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


#: Python frames the pickler spends per level of nesting (save, a container's items, the
#: `persistent_id` call), with room to spare
_FRAMES_PER_LEVEL = 4


@contextmanager
def _deep_enough() -> Iterator[None]:
    """Let the pickler recurse as deep as a file the reader admits may nest (`MAX_DEPTH`):
    pickling recurses per level, and a 990-deep dict read from a torch.save file ran out of
    Python's default limit of 1,000 frames writing it back ("a bug in ckpt")."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, before + _FRAMES_PER_LEVEL * MAX_DEPTH))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


class _Pickler(pickle.Pickler):
    def __init__(self, file: IO[bytes], writer: TorchZipWriter):
        super().__init__(file, protocol=PROTOCOL)
        self._writer = writer

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is StorageRef:
            return obj.pid
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        # a tensor inside an object entry (a tuple of tensors is one value) reached the
        # pickle whole: write its storage now, as torch.save does
        if isinstance(obj, torch.storage.TypedStorage):
            kind = getattr(torch, obj._pickle_storage_type())
            return self._writer._storage(obj._untyped_storage, kind, obj._size()).pid
        if isinstance(obj, torch.UntypedStorage):
            return self._writer._storage(obj, torch.UntypedStorage, obj.nbytes()).pid
        return None


def raw_tensor_reduction(dtype: str, dims: tuple[int, ...], key: str) -> tuple[Reduced, set[str]]:
    """What pickles exactly as torch pickles a contiguous CPU tensor whose storage is record
    `data/<key>`, and the torch globals it names (for `torch_names`): `_rebuild_tensor_v2` of a
    typed storage, or `_rebuild_tensor_v3` with the dtype for kinds without a typed storage
    class (uint16, float8...), as `torch.save` writes them."""
    count = 1
    for d in dims:
        count *= d
    hooks: OrderedDict[Any, Any] = OrderedDict()
    storage = _DTYPE_STORAGES.get(dtype)
    if storage is not None:
        targets = {"torch." + storage, "torch._utils._rebuild_tensor_v2"}
        ref = StorageRef(placeholder("torch." + storage), key, count)
        args: tuple[Any, ...] = (ref, 0, dims, c_strides(dims), False, hooks)
        rebuild = "torch._utils._rebuild_tensor_v2"
    else:
        rebuild = "torch._utils._rebuild_tensor_v3"
        targets = {"torch.storage.UntypedStorage", rebuild, "torch." + dtype}
        ref = StorageRef(placeholder("torch.storage.UntypedStorage"), key, count * itemsize(dtype))
        args = (ref, 0, dims, c_strides(dims), False, hooks, placeholder("torch." + dtype))
    return Reduced(placeholder(rebuild), args), targets


#: records at least this large have their CRC computed in a thread while the kernel copies
_THREADED_CRC = 16 << 20


def _copy_with_crc(data: FileRange, fd: int, at: int) -> tuple[int, int]:
    """Copy `data` to `fd` at `at`: (bytes copied, CRC-32 of them). The CRC of a large range
    is read from the source while the kernel copies it (the CRC code, ISA-L's or zlib's, and
    copy_file_range all let go of the GIL), so the two overlap on two cores."""
    if data.length < _THREADED_CRC:
        crc = data.crc32()
        return data.copy_to(fd, at), crc
    crcs: list[int] = []
    failure: list[BaseException] = []

    def checksum() -> None:
        try:
            crcs.append(data.crc32())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=checksum, name="ckpt-crc", daemon=True)
    worker.start()
    try:
        copied = data.copy_to(fd, at)
    finally:
        worker.join()
    if failure:
        raise failure[0]
    return copied, crcs[0]


def write_record(
    archive: zipfile.ZipFile, fh: IO[bytes], base: int, name: str, data: Any, size: int
) -> None:
    """One stored zip record of `archive` (written to `fh`, whose offset `base` is the zip's
    start) whose data starts at a multiple of ALIGNMENT within the zip.

    `data` is a buffer, an iterator of blocks of `size` bytes in all (zipfile computes the CRC
    as they pass), or a local `FileRange`: its bytes are copied in the kernel, past zipfile,
    while its CRC is read from the source (`_copy_with_crc`); the local header zipfile wrote is
    then rewritten with the CRC and sizes (the central directory takes them from the same
    `ZipInfo`), so the record is byte for byte the streamed one.
    """
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule, decided here
    # local header: 30 bytes + name + extra (+ the 20-byte zip64 field zipfile adds);
    # pad with an extra field ("FB", torch's padding id) so the data lands aligned
    start = fh.tell() - base + 30 + len(info.filename.encode()) + (20 if zip64 else 0)
    pad = -(start + 4) % ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    if isinstance(data, FileRange):
        if data.length != size:
            raise ValueError(f"{name}: got {data.length} bytes for a {size}-byte record")
        with archive.open(info, "w", force_zip64=zip64):
            fh.flush()  # the header zipfile just wrote
            at = fh.tell()
            copied, crc = _copy_with_crc(data, fh.fileno(), at)
            fh.seek(at + copied)
        info.CRC, info.file_size, info.compress_size = crc, size, size
        fh.flush()
        os.pwrite(fh.fileno(), info.FileHeader(zip64), base + info.header_offset)
        return
    written = 0
    with archive.open(info, "w", force_zip64=zip64) as out:
        if not isinstance(data, Iterator):
            view = memoryview(data).cast("B")
            for begin in range(0, size, _CHUNK):
                written += out.write(view[begin : begin + _CHUNK])
        else:
            for block in data:
                written += out.write(block)  # zipfile updates the CRC block by block
                if written > size:
                    break
    if written != size:
        raise ValueError(f"{name}: got {written} bytes for a {size}-byte record")


class TorchZipWriter:
    """Write one torch.save file to `fh` (a seekable binary file), tensor by tensor.

    Usage: `ref = w.add_tensor(t)` for each tensor (drop `t` afterwards), build the object
    with the refs in place of the tensors, then `w.finish(obj)`.
    """

    def __init__(self, fh: IO[bytes], archive: str = "archive"):
        self._fh = fh
        self._zip = zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._prefix = archive + "/"
        # StorageImpl address -> (key, storage type, weak reference to the storage): a live
        # storage seen again is shared; a dead one's address may be reused, so it is not
        self._keys: dict[int, tuple[str, Any, weakref.ref[Any]]] = {}
        self._count = 0
        #: torch globals this file's pickle names through placeholders (see `add_raw`)
        self._used: set[str] = set()

    def _record(self, name: str, data: Any, nbytes: int) -> None:
        write_record(self._zip, self._fh, 0, self._prefix + name, data, nbytes)

    def add_raw(
        self, dtype: str, shape: tuple[int, ...] | list[int], nbytes: int, blocks: Iterable[bytes]
    ) -> Reduced:
        """Write one tensor's storage from its raw C-order bytes; no torch needed.

        `blocks` yields `nbytes` in all (the CRC is computed as they stream). Returns what
        pickles exactly as torch pickles that tensor: `torch._utils._rebuild_tensor_v2` of a
        typed storage, or `_rebuild_tensor_v3` with the dtype for kinds without a typed
        storage class (uint16, float8...), as `torch.save` writes them.
        """
        dims = tuple(int(d) for d in shape)
        count = 1
        for d in dims:
            count *= d
        if not is_known(dtype) or count * itemsize(dtype) != nbytes:
            raise ValueError(f"{nbytes} bytes are no {dtype} tensor of shape {list(dims)}")
        key = str(self._count)
        self._count += 1
        self._record(
            f"data/{key}", blocks if isinstance(blocks, FileRange) else iter(blocks), nbytes
        )
        reduced, used = raw_tensor_reduction(dtype, dims, key)
        self._used.update(used)
        return reduced

    def name_global(self, target: str) -> type:
        """A class that pickles as the global `target` (`module.attr`) in this file's data.pkl,
        without importing it: what a reduction names to rebuild an object of a class ckpt does
        not import (DeepSpeed's loss scaler, read as an inert record, written back as itself)."""
        self._used.add(target)
        return placeholder(target)

    def add_tensor(self, tensor: torch.Tensor) -> Reduced:
        """Write `tensor`'s storage (once per live storage) and return what pickles as it."""
        return self._reduce(tensor)

    def _reduce(self, tensor: torch.Tensor) -> Reduced:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage's deprecation notice
            untyped: Any = tensor  # torch's pickling internals carry no annotations
            func, args = untyped.__reduce_ex__(PROTOCOL)[:2]
            out: list[Any] = []
            for arg in args:
                if isinstance(arg, torch.storage.TypedStorage):
                    typed: Any = arg
                    kind = getattr(torch, typed._pickle_storage_type())
                    out.append(self._storage(typed._untyped_storage, kind, typed._size()))
                elif isinstance(arg, torch.UntypedStorage):
                    # dtypes without a typed storage class (uint16, float8...): _rebuild_tensor_v3
                    out.append(self._storage(arg, torch.UntypedStorage, arg.nbytes()))
                elif isinstance(arg, torch.Tensor):
                    out.append(self._reduce(arg))  # nn.Parameter wraps its data tensor
                else:
                    out.append(arg)
        return Reduced(func, tuple(out))

    def _storage(self, untyped: Any, storage_type: Any, numel: int) -> StorageRef:
        import torch

        if untyped.device.type != "cpu":
            raise ValueError("TorchZipWriter writes CPU tensors only")
        known = self._keys.get(untyped._cdata)
        if known is not None and known[2]() is untyped and known[1] is storage_type:
            return StorageRef(storage_type, known[0], numel)
        key = str(self._count)
        self._count += 1
        nbytes = untyped.nbytes()
        raw = torch.empty(0, dtype=torch.uint8).set_(untyped) if nbytes else b""
        self._record(f"data/{key}", raw.numpy() if nbytes else raw, nbytes)  # type: ignore[union-attr]
        self._keys[untyped._cdata] = (key, storage_type, weakref.ref(untyped))
        return StorageRef(storage_type, key, numel)

    def finish(self, obj: Any) -> None:
        """Pickle `obj` (tensors replaced by `add_tensor`'s results), write the small records
        and the zip directory. The caller flushes and fsyncs `fh`."""
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage's deprecation notice
            with _deep_enough():
                _Pickler(buf, self).dump(obj)
        data = torch_names(buf.getvalue(), self._used) if self._used else buf.getbuffer()
        self._record("data.pkl", data, len(data))
        for name, text in (
            (".format_version", "1"),
            (".storage_alignment", str(ALIGNMENT)),
            ("byteorder", sys.byteorder),
            ("version", "3\n"),
        ):
            raw = text.encode()
            self._record(name, raw, len(raw))
        self._keys.clear()
        self._zip.close()
