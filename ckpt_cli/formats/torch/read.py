"""Reading an opened torch.save checkpoint: `TorchCheckpoint`.

Every file is loaded once (memory-mapped, see `torch_load`) and flattened into entries
(`torch_flatten`). Remote files load metadata only; reading a tensor then fetches its file
once (one file held at a time).
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import REPORT_BUG, CorruptDataError, FormatError, NotFoundError
from ...faults import naming
from ...models import Entry, FileInfo, Manifest
from ...storage import Storage
from ...storage.fileio import FileRange
from ..base import NAMES_FIX, Checkpoint, RecordedDamage, Source
from ..details import TorchDetails
from ..weight_map import declared_total_size

if TYPE_CHECKING:
    import torch

from .flatten import build_entries, is_tensor, plain_copy, type_name
from .load import load_torch_file, torch_reader_damage
from .zip_index import (
    CORRUPT_ZIP_FIX,
    TensorLayout,
    index_torch_zip,
    read_plain_torch_legacy,
    read_torch_zip,
)

#: what a `torch_zip` reader returns
T = TypeVar("T")


def _open_regular(path: Path) -> int | None:
    """A read descriptor of a regular file; None for anything else (a FIFO must not block:
    torch.load's path reports it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _read_local_zip(storage: Storage, rel: str, reader: Callable[..., T | None]) -> T | None:
    """`reader(read, 0, size)` over a local regular file (a `torch_zip` reader); None for a
    remote file or anything but a regular file."""
    local = storage.local_path(rel)
    if local is None:
        return None
    fd = _open_regular(local)
    if fd is None:
        return None
    try:
        name = storage.describe(rel)

        def read(at: int, n: int) -> bytes:
            try:
                return os.pread(fd, n, at)
            except OSError as exc:  # a bad sector: this file is the one to check
                raise naming(exc, name) from None

        return reader(read, 0, os.fstat(fd).st_size, name)
    finally:
        os.close(fd)


def _torch_reader_damage(local: Path) -> str | None:
    """`load.torch_reader_damage` of the local torch.save zip at `local`; None for a legacy
    (non-zip) file, or anything but a regular file."""
    fd = _open_regular(local)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as file:
        if file.read(4) != b"PK\x03\x04":
            return None
        return torch_reader_damage(file)


def read_plain(storage: Storage, rel: str) -> tuple[object, bool] | None:
    """A local file's object read without torch when it is plain data (`torch_zip`), and
    whether the file is in the legacy (non-zip) format; None for anything else (a remote
    file, one that needs torch.load)."""
    return _read_local(storage, rel)[0]


def _read_local(
    storage: Storage, rel: str
) -> tuple[tuple[object, bool] | None, dict[tuple[str | int, ...], TensorLayout] | None]:
    """(`read_plain` of a local file, its zip's tensor layouts when it is a zip this reader
    follows but not plain data): one read of its pickle serves both, so a file torch.load
    reads (Megatron-LM's `model_optim_rng.pt`, whose `args` is a Namespace) is not indexed
    twice."""
    found = _read_local_zip(storage, rel, read_torch_zip)
    if found is not None:
        return ((found.root, False), None) if found.plain else (None, found.index.tensors)
    legacy = _read_local_zip(storage, rel, read_plain_torch_legacy)
    return (None if legacy is None else (legacy.root, True)), None


def legacy_load_failures(storage: Storage, rel: str) -> list[str]:
    """Why `torch.load` cannot read the local legacy (non-zip) torch.save file `rel` back
    although ckpt reads it (a uint16 tensor, a Generator: see `zip_index`); empty for any
    other file."""
    legacy = _read_local_zip(storage, rel, read_plain_torch_legacy)
    return [] if legacy is None else legacy.torch_fails


class TorchCheckpoint(Checkpoint):
    """An opened torch.save checkpoint: the loaded (memory-mapped) objects of its files.

    Attributes:
        objects: file -> the object torch.load returned for it.
        leaves: entry name -> the loaded leaf (tensor or value).
    """

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        objects: dict[str, Any],
        leaves: dict[str, Any],
    ):
        super().__init__(source, manifest)
        self.objects = objects
        self.leaves = leaves
        #: the one remote file whose real tensors are held: (file, name -> leaf)
        self._loaded: tuple[str, dict[str, Any]] | None = None
        #: storages of tensors read without torch.load, while alive: (file, record) -> storage
        self._storages: dict[tuple[str | None, int], weakref.ref[Any]] = {}
        self._held: dict[tuple[str | None, int], Any] = {}
        self._left: dict[tuple[str | None, int], int] = {}
        #: whether some file was read without torch.load (its tensors are TensorLayouts)
        self._raw_read = False

    @classmethod
    def load(
        cls,
        source: Source,
        shards: list[str],
        index_rel: str | None,
        weight_map: dict[str, str] | None,
        index_meta: dict[str, Any],
    ) -> TorchCheckpoint:
        """Load every file (memory-mapped) and build the manifest."""
        storage = source.storage
        objects: dict[str, Any] = {}
        leaves: dict[str, Any] = {}
        entries: list[Entry] = []
        files: list[FileInfo] = []
        shared: list[list[str]] = []
        legacy: list[str] = []
        raw_read = False
        for shard in shards:
            # remote files: metadata only now, one whole file when a tensor of it is read
            remote = storage.local_path(shard) is None
            # plain state dicts are read without torch; anything else through torch.load
            plain, indexed = (None, None) if remote else _read_local(storage, shard)
            if plain is not None:
                (obj, is_legacy), layouts = plain, None
                raw_read = True
            else:
                obj, is_legacy = load_torch_file(storage, shard, meta=remote)
                layouts = None if is_legacy else indexed
            if is_legacy:
                legacy.append(shard)
            objects[shard] = obj
            shard_entries, shard_leaves, shard_shared = build_entries(
                obj, shard, storage.describe(shard), layouts
            )
            for entry in shard_entries:
                if entry.name in leaves:
                    raise FormatError(
                        f"entry {entry.name!r} appears in more than one shard",
                        path=storage.describe(shard),
                        fix="The checkpoint is inconsistent; `ckpt verify` lists every problem.",
                    )
                if weight_map is not None and weight_map.get(entry.name, shard) != shard:
                    raise FormatError(
                        f"the index maps {entry.name!r} to {weight_map[entry.name]}, "
                        "but it is stored here",
                        path=storage.describe(shard),
                        fix="The index is inconsistent; `ckpt verify` lists every problem.",
                    )
            entries.extend(shard_entries)
            leaves.update(shard_leaves)
            shared.extend(shard_shared)
            files.append(FileInfo(path=shard, size=storage.size(shard), entries=len(shard_entries)))
        details = TorchDetails(sharded=index_rel is not None)
        if index_rel is not None:
            files.insert(0, FileInfo(path=index_rel, size=storage.size(index_rel), entries=0))
            details.index = index_rel
            details.weight_map_size = len(weight_map or {})
            total_size = declared_total_size(index_meta)
            if total_size is not None:  # a string there is no size (verify flags it)
                details.total_size = total_size
            missing = sorted(set(weight_map or {}) - set(leaves))
            if missing:
                raise FormatError(
                    f"the index lists {len(missing)} entries no shard holds "
                    f"(first: {missing[0]!r})",
                    path=storage.describe(index_rel),
                    fix="The index is inconsistent; `ckpt verify` lists every problem.",
                )
        if shared:
            details.shared_tensors = shared
        if legacy:
            details.legacy_format = legacy
        manifest = Manifest(
            format="torch",
            location=source.location.raw,
            files=files,
            entries=entries,
            details=details.as_details(),
        )
        checkpoint = cls(source, manifest, objects, leaves)
        checkpoint._raw_read = raw_read
        return checkpoint

    def _leaf(self, name: str) -> Any:
        try:
            return self.leaves[name]
        except KeyError:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            ) from None

    def read_tensor(self, name: str) -> torch.Tensor:
        leaf = self._leaf(name)
        if not is_tensor(leaf):
            raise FormatError(
                f"entry {name!r} is a {type_name(leaf)}, not a tensor",
                path=self.manifest.location,
                fix=REPORT_BUG,
            )
        if isinstance(leaf, TensorLayout):
            return self._from_raw(self.manifest.by_name[name].file, leaf)
        if leaf.device.type == "meta":
            leaf = self._real_leaf(name)
        # memory-mapped: pages are read on first touch, one tensor at a time. A conjugate or
        # negative view (`x.conj()` saved as is) keeps its stored bytes and a bit: its values
        # are materialised, so every writer and comparison sees the values torch.load gives
        tensor: torch.Tensor = leaf.detach().resolve_conj().resolve_neg().contiguous()
        return tensor

    def _from_raw(self, file: str | None, leaf: TensorLayout) -> torch.Tensor:
        """A tensor of a file read without torch.load: its storage record read once.

        Tensors of one storage (tied weights) come back sharing it while any of them is
        alive, as `torch.load` returns them, so writers keep them tied."""
        import torch

        from ...tensors import torch_dtype

        local = self.storage.local_path(file) if file is not None else None
        if local is None:  # layouts are read for local files only
            raise FormatError(
                "a tensor has no local file", path=self.manifest.location, fix=REPORT_BUG
            )
        spot = (file, leaf.record.offset)
        known = self._storages.get(spot)
        storage = known() if known is not None else None
        if storage is None:
            data = bytearray(leaf.record.length)
            done = 0
            for block in FileRange(local, leaf.record.offset, leaf.record.length):
                data[done : done + len(block)] = block
                done += len(block)
            whole = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0)
            storage = whole.untyped_storage()
            self._storages[spot] = weakref.ref(storage)
        # a storage other entries still view stays held until the last of them is read
        left = self._views_left().get(spot, 1) - 1
        self._left[spot] = left
        if left > 0:
            self._held[spot] = storage
        else:
            self._held.pop(spot, None)
        view = torch.empty(0, dtype=torch_dtype(leaf.dtype))
        return view.set_(storage, leaf.storage_offset, leaf.shape, leaf.stride)

    def recorded_checksum_errors(self) -> Iterator[RecordedDamage]:
        """Each storage record of a local zip file whose bytes fail the CRC-32 its zip
        directory records: `torch.load` with `mmap=True` (and the raw reads) never check it,
        so a flipped data byte would otherwise read as a value. Legacy (non-zip) and remote
        files record none that is read here."""
        for rel in sorted({e.file for e in self.manifest.entries if e.file}):
            local = self.storage.local_path(rel)
            if local is None:
                continue
            # torch's own zip reader checks what the reads here skip (every record's local
            # header; data.pkl, .storage_alignment and the like, which torch.load reads
            # whole): a flipped byte there fails torch.load, or renames a tensor in it
            reason = _torch_reader_damage(local)
            if reason is not None:
                yield RecordedDamage(
                    CorruptDataError(
                        f"is corrupt: torch's zip reader misreads its torch.save archive "
                        f"({reason[:200]}); the bytes changed after they were written",
                        path=self.storage.describe(rel),
                        fix=CORRUPT_ZIP_FIX,
                    )
                )
                continue
            index = _read_local_zip(self.storage, rel, index_torch_zip)
            if index is None:
                continue
            for record in index.records.values():
                if record.crc32 is None:
                    continue
                got = FileRange(local, record.offset, record.length).crc32()
                if got != record.crc32:
                    yield RecordedDamage(
                        CorruptDataError(
                            f"storage record {record.name} is corrupt: its bytes have CRC-32 "
                            f"{got:08x}, the zip records {record.crc32:08x} (they changed after "
                            "they were written)",
                            path=self.storage.describe(rel),
                            fix="Restore this file from a good copy of the checkpoint (or download "
                            "it again).",
                        )
                    )

    def _views_left(self) -> dict[tuple[str | None, int], int]:
        """How many entries not read yet view each storage record (counted at first use)."""
        if not self._left:
            for entry in self.manifest.entries:
                leaf = self.leaves.get(entry.name)
                if isinstance(leaf, TensorLayout):
                    spot = (entry.file, leaf.record.offset)
                    self._left[spot] = self._left.get(spot, 0) + 1
        return self._left

    def _real_leaf(self, name: str) -> Any:
        """A remote file's real tensor: the whole file is fetched once, one file at a time."""
        file = self.manifest.by_name[name].file
        assert file is not None
        if self._loaded is None or self._loaded[0] != file:
            self._loaded = None  # drop the previous file before fetching the next
            obj, _ = load_torch_file(self.storage, file, meta=False)
            _, leaves, _ = build_entries(obj, file, self.storage.describe(file))
            self._loaded = (file, leaves)
        return self._loaded[1][name]

    def read_object(self, name: str) -> Any:
        leaf = self._leaf(name)
        if is_tensor(leaf):
            return self.read_tensor(name)
        # a copy, inert records as plain dicts: what every writer can store and every reader load
        try:
            value = plain_copy(leaf)
            file = self.manifest.by_name[name].file
            return self._tensors_in(value, file, 0, {}) if self._raw_read else value
        except RecursionError:
            raise FormatError(
                f"entry {name!r} is nested too deeply to copy",
                path=self.manifest.location,
                fix="Re-save the checkpoint as a flat state dict of tensors.",
            ) from None

    def _tensors_in(self, value: Any, file: str | None, depth: int, memo: dict[int, Any]) -> Any:
        """`value` with the tensors read without torch.load (in a tuple entry) made real; each
        container once (`memo`, by identity), however many paths lead to it."""
        if isinstance(value, TensorLayout):
            return self._from_raw(file, value)
        if depth > 200 or not isinstance(value, (dict, list, tuple)):
            return value
        done = memo.get(id(value))
        if done is not None:
            return done
        out: Any
        if isinstance(value, dict):
            out = type(value)(
                (k, self._tensors_in(v, file, depth + 1, memo)) for k, v in value.items()
            )
        elif type(value) in (list, tuple):
            out = type(value)(self._tensors_in(v, file, depth + 1, memo) for v in value)
        else:
            return value
        memo[id(value)] = out
        return out

    def close(self) -> None:
        self.objects.clear()
        self.leaves.clear()
        self._loaded = None
        self._held.clear()
