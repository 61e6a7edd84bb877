"""safetensors: one file, or shards plus a `*.safetensors.index.json`.

I/O strategy: `open` reads only the 8-byte length and the JSON header of each shard (two
small reads per file; no torch import), validating every offset against the file size. Tensor
reads are one `preadv` into a fresh tensor's memory (local) or one ranged read (remote). Raw
byte ranges are exposed so copies skip deserialisation. The writer lays out every shard's
header from the plan up front, then streams tensor bytes in order; the index is written last.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import FormatError, NotFoundError
from ..models import Entry, FileInfo, Manifest
from ..storage import LocalStorage, Storage, safe_relpath
from .base import Checkpoint, Format, Source, WriteOptions, Writer

if TYPE_CHECKING:
    import torch

INDEX_SUFFIX = ".safetensors.index.json"
#: per-rank files of torch DCP's `HuggingFaceStorageWriter(save_distributed=True)`: the same
#: tensor names in every file (chunks of one tensor), so the folder is read as `dcp`
DCP_HF_SHARD = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
#: no sane header is this large; a bigger length field is corruption or an attack
MAX_HEADER = 100 << 20
_PROBE = 64 << 10


def is_dcp_hf_sharded(names: list[str]) -> bool:
    """Whether top-level `names` are the per-rank shards of DCP's HuggingFaceStorageWriter."""
    shards = [n for n in names if n.endswith(".safetensors")]
    return (
        bool(shards)
        and all(DCP_HF_SHARD.match(n) for n in shards)
        and not any(n.endswith(INDEX_SUFFIX) for n in names)
    )


def _stem_of_index(name: str) -> str:
    return Path(name).name[: -len(INDEX_SUFFIX)]


class SafetensorsHeader:
    """A parsed, validated safetensors header.

    Attributes:
        file: path relative to the checkpoint root.
        size: file size in bytes.
        data_start: absolute offset of the data section.
        tensors: name -> (dtype, shape, begin, end) with offsets relative to `data_start`,
            in file order.
        metadata: the `__metadata__` strings.
    """

    def __init__(
        self,
        file: str,
        size: int,
        data_start: int,
        tensors: dict[str, Any],
        metadata: dict[str, str],
    ):
        self.file = file
        self.size = size
        self.data_start = data_start
        self.tensors = tensors
        self.metadata = metadata


def read_header(storage: Storage, rel: str, size: int | None = None) -> SafetensorsHeader:
    """Read and validate one safetensors header (FormatError naming the file on any flaw)."""
    where = storage.describe(rel)
    size = storage.size(rel) if size is None else size
    if size < 8:
        raise FormatError(
            f"is {size} bytes long, too short to be a safetensors file",
            path=where,
            fix="The file is truncated or not safetensors; write or fetch it again.",
        )
    # remote storages may ask for a smaller first read (bytes cost more than a round trip there)
    probe = getattr(storage, "header_probe", _PROBE)
    head = storage.read(rel, 0, min(size, probe))
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER or header_len > size - 8:
        raise FormatError(
            f"declares a {header_len}-byte header but the file is {size} bytes"
            if header_len <= MAX_HEADER
            else f"declares an absurd {header_len}-byte header",
            path=where,
            fix="The file is truncated or corrupt; write or fetch it again.",
        )
    raw = head[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += storage.read(rel, 8 + len(raw), header_len - len(raw))
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"has a header that is not valid JSON ({exc})", path=where) from None
    if not isinstance(header, dict):
        raise FormatError("has a header that is not a JSON object", path=where)
    data_start = 8 + header_len
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("has __metadata__ that is not a string-to-string map", path=where)
    tensors: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        tensors[name] = _validate_tensor(name, info, data_size, where)
    order = sorted(tensors.items(), key=lambda kv: kv[1][2])
    previous_end, previous_name = 0, None
    for name, (_, _, begin, end) in order:
        if begin < previous_end:
            raise FormatError(
                f"tensor {name!r} overlaps {previous_name!r} (bytes {begin}..{end} start before {previous_end})",
                path=where,
                fix="The header is corrupt or hostile; do not use this file.",
            )
        previous_end, previous_name = end, name
    return SafetensorsHeader(rel, size, data_start, dict(order), metadata)


def _validate_tensor(
    name: str, info: Any, data_size: int, where: str
) -> tuple[str, list[int], int, int]:
    if not isinstance(info, dict):
        raise FormatError(f"tensor {name!r} has a malformed header entry", path=where)
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = dtypes.from_safetensors(code) if isinstance(code, str) else None
    if dtype is None:
        raise FormatError(
            f"tensor {name!r} has unknown dtype {code!r}",
            path=where,
            fix="Upgrade ckpt if this is a new dtype; otherwise the header is corrupt.",
        )
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise FormatError(f"tensor {name!r} has an invalid shape {shape!r}", path=where)
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise FormatError(f"tensor {name!r} has invalid data_offsets {offsets!r}", path=where)
    begin, end = offsets
    expected = dtypes.numel(shape) * dtypes.itemsize(dtype)
    if end - begin != expected:
        raise FormatError(
            f"tensor {name!r} is {dtype}{shape} ({expected} bytes) but its data_offsets span {end - begin} bytes",
            path=where,
            fix="The header is corrupt; write or fetch the file again.",
        )
    if end > data_size:
        raise FormatError(
            f"tensor {name!r} ends at byte {end} of the data section, past its end ({data_size} bytes)",
            path=where,
            fix="The file is truncated; write or fetch it again.",
        )
    return dtype, shape, begin, end


def read_index(storage: Storage, rel: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Read a `*.safetensors.index.json`: (weight_map with safe relative shard paths, metadata)."""
    where = storage.describe(rel)
    try:
        index = json.loads(storage.read_all(rel))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(
            f"is not valid JSON ({exc})", path=where, fix="Write or fetch the index again."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FormatError("has no valid weight_map (tensor name -> shard file)", path=where)
    base = posixpath_dir(rel)
    safe = {
        name: _join(base, safe_relpath(shard, source=where)) for name, shard in weight_map.items()
    }
    metadata = index.get("metadata") or {}
    return safe, metadata if isinstance(metadata, dict) else {}


def posixpath_dir(rel: str) -> str:
    """The folder part of a relative POSIX path ('' for a top-level file)."""
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _join(base: str, rel: str) -> str:
    return f"{base}/{rel}" if base else rel


def find_index(source: Source) -> str | None:
    """The index file to use: the target if it is one, else the single one in the root."""
    if source.target is not None:
        return source.target if source.target.endswith(INDEX_SUFFIX) else None
    indexes = [n for n in source.top_level() if n.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise FormatError(
            f"holds several safetensors indexes ({', '.join(sorted(indexes))})",
            path=source.location.raw,
            fix="Point at the index you mean, e.g. "
            + f"{source.location.raw.rstrip('/')}/{sorted(indexes)[0]}.",
        )
    return indexes[0] if indexes else None


class SafetensorsFormat(Format):
    """The safetensors format (single file or sharded with an index)."""

    name = "safetensors"
    writable = True

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            return source.target.endswith((".safetensors", INDEX_SUFFIX))
        names = source.top_level()
        if is_dcp_hf_sharded(names):
            return False
        return any(n.endswith((".safetensors", INDEX_SUFFIX)) for n in names)

    @classmethod
    def open(cls, source: Source) -> SafetensorsCheckpoint:
        storage = source.storage
        index_rel = find_index(source)
        index_meta: dict[str, Any] = {}
        weight_map: dict[str, str] | None = None
        if index_rel is not None:
            weight_map, index_meta = read_index(storage, index_rel)
            shards = sorted(set(weight_map.values()))
            listing = storage.list_files() if source.target is not None else source.files
            for shard in shards:
                if shard not in listing and not storage.exists(shard):
                    raise NotFoundError(
                        f"the index names shard {shard!r}, which is missing",
                        path=storage.describe(index_rel),
                        fix="Fetch or copy the missing shard; `ckpt verify` lists every problem.",
                    )
            sizes = {shard: listing.get(shard) for shard in shards}
        elif source.target is not None:
            shards = [source.target]
            sizes = {source.target: source.files[source.target]}
        else:
            shards = [n for n in source.top_level() if n.endswith(".safetensors")]
            sizes = {n: source.files[n] for n in shards}
        headers = [read_header(storage, shard, sizes.get(shard)) for shard in shards]
        return SafetensorsCheckpoint.from_headers(
            source, headers, index_rel, weight_map, index_meta
        )

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> Writer:
        return SafetensorsWriter(staging, plan, options)


class SafetensorsCheckpoint(Checkpoint):
    """An opened safetensors checkpoint."""

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        headers: list[SafetensorsHeader],
        index: str | None,
    ):
        super().__init__(source, manifest)
        self.headers = headers
        self.index = index
        self._fds: dict[str, int] = {}

    @classmethod
    def from_headers(
        cls,
        source: Source,
        headers: list[SafetensorsHeader],
        index_rel: str | None,
        weight_map: dict[str, str] | None,
        index_meta: dict[str, Any],
    ) -> SafetensorsCheckpoint:
        """Build the manifest from validated headers (entries in shard, then file, order)."""
        entries: list[Entry] = []
        files: list[FileInfo] = []
        seen: set[str] = set()
        for header in headers:
            for name, (dtype, shape, begin, end) in header.tensors.items():
                if name in seen:
                    raise FormatError(
                        f"tensor {name!r} appears in more than one shard",
                        path=source.storage.describe(header.file),
                        fix="The checkpoint is inconsistent; `ckpt verify` lists every problem.",
                    )
                seen.add(name)
                entries.append(
                    Entry.model_construct(
                        name=name,
                        kind="tensor",
                        dtype=dtype,
                        shape=shape,
                        nbytes=end - begin,
                        file=header.file,
                        offset=header.data_start + begin,
                        chunks=None,
                        py_type=None,
                        value=None,
                    )
                )
            files.append(FileInfo(path=header.file, size=header.size, entries=len(header.tensors)))
        if index_rel is not None:
            files.insert(
                0, FileInfo(path=index_rel, size=source.storage.size(index_rel), entries=0)
            )
        details: dict[str, Any] = {"sharded": index_rel is not None}
        if index_rel is not None:
            details["index"] = index_rel
            details["weight_map_size"] = len(weight_map or {})
            if "total_size" in index_meta:
                details["total_size"] = index_meta["total_size"]
        manifest = Manifest(
            format="safetensors",
            location=source.location.raw,
            files=files,
            entries=entries,
            metadata=headers[0].metadata if headers else {},
            details=details,
        )
        return cls(source, manifest, headers, index_rel)

    def read_tensor(self, name: str) -> torch.Tensor:
        from ..tensors import read_tensor_from_fd, tensor_from_bytes

        entry = self._entry(name)
        assert entry.file is not None and entry.offset is not None and entry.dtype is not None
        storage = self.storage
        if isinstance(storage, LocalStorage):
            fd = self._fds.get(entry.file)
            if fd is None:
                fd = self._fds[entry.file] = os.open(storage.path(entry.file), os.O_RDONLY)
            return read_tensor_from_fd(
                fd, entry.offset, entry.dtype, entry.shape, storage.describe(entry.file)
            )
        data = storage.read(entry.file, entry.offset, entry.nbytes)
        return tensor_from_bytes(data, entry.dtype, entry.shape)

    def _entry(self, name: str) -> Entry:
        try:
            return self.manifest.by_name[name]
        except KeyError:
            raise NotFoundError(f"no tensor named {name!r}", path=self.manifest.location) from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def plan_shards(plan: list[Entry], max_shard_size: int | None) -> list[list[Entry]]:
    """Group entries, in order, into shards of at most `max_shard_size` bytes.

    A tensor larger than the limit gets a shard of its own; `None` means one shard.
    """
    if not max_shard_size:
        return [list(plan)]
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in plan:
        if current and size + entry.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(basename: str, count: int) -> list[str]:
    """Hugging Face shard names: `model.safetensors`, or `model-00001-of-00003.safetensors`..."""
    if count == 1:
        return [f"{basename}.safetensors"]
    return [f"{basename}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def encode_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus the JSON header for `entries` laid out contiguously, padded to 8."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for entry in entries:
        assert entry.dtype is not None
        header[entry.name] = {
            "dtype": dtypes.to_safetensors(entry.dtype),
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter(Writer):
    """Streams tensors into safetensors shards laid out from the plan; index last."""

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        super().__init__(staging, plan, options)
        objects = [e.name for e in plan if e.kind != "tensor"]
        if objects:
            raise FormatError(
                f"safetensors holds tensors only; {len(objects)} non-tensor entries were planned",
                fix="Exclude them (the convert operation reports them as skipped).",
            )
        self.metadata = dict(options.metadata)
        self.basename = options.basename or "model"
        self.groups = plan_shards(plan, options.max_shard_size)
        if options.single_file and len(self.groups) > 1:
            raise FormatError("a single-file destination cannot be split into shards")
        self.names = shard_names(self.basename, len(self.groups))
        self._where: dict[str, int] = {}
        for index, group in enumerate(self.groups):
            for entry in group:
                self._where[entry.name] = index
        self._order = [e.name for e in plan]
        self._next = 0
        self._fh: Any = None
        self._shard = -1
        self._written: list[FileInfo] = []

    @property
    def accepts_raw(self) -> bool:
        return True

    def _advance(self, name: str) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise RuntimeError(f"writer got {name!r} out of plan order (expected {expected!r})")
        self._next += 1
        shard = self._where[name]
        while self._shard < shard:
            self._open_next_shard()

    def _open_next_shard(self) -> None:
        self._close_shard()
        self._shard += 1
        # shards stay open across write calls: the writer streams one tensor at a time
        self._fh = open(self.staging / self.names[self._shard], "wb")
        self._fh.write(encode_header(self.groups[self._shard], self.metadata))

    def _close_shard(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        size = self._fh.tell()
        self._fh.close()
        self._fh = None
        self._written.append(
            FileInfo(path=self.names[self._shard], size=size, entries=len(self.groups[self._shard]))
        )

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        from ..tensors import tensor_bytes

        self._advance(name)
        data = tensor_bytes(tensor)
        expected = self.plan[self._next - 1].nbytes
        if len(data) != expected:
            raise RuntimeError(f"tensor {name!r} has {len(data)} bytes, the plan said {expected}")
        self._fh.write(data)

    def write_raw(self, name: str, blocks: Iterator[bytes]) -> None:
        self._advance(name)
        for block in blocks:
            self._fh.write(block)

    def finish(self) -> list[FileInfo]:
        if self._next != len(self._order):
            raise RuntimeError(f"writer finished after {self._next} of {len(self._order)} entries")
        # empty shards (an empty plan) still get their header written
        while self._shard < len(self.groups) - 1:
            self._open_next_shard()
        self._close_shard()
        if len(self.groups) > 1:
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in self.plan)},
                "weight_map": {name: self.names[self._where[name]] for name in sorted(self._where)},
            }
            index_name = f"{self.basename}{INDEX_SUFFIX}"
            data = (json.dumps(index, indent=2) + "\n").encode()
            with open(self.staging / index_name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            self._written.insert(0, FileInfo(path=index_name, size=len(data), entries=0))
        return self._written
