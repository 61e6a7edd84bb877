"""Reading an opened torch.save checkpoint: `TorchCheckpoint`.

Every file is loaded once (memory-mapped, see `torch_load`) and flattened into entries
(`torch_flatten`). Remote files load metadata only; reading a tensor then fetches its file
once (one file held at a time).
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, NotFoundError
from ..models import Entry, FileInfo, Manifest
from ..storage import Storage
from .base import Checkpoint, Source

if TYPE_CHECKING:
    import torch

from .torch_flatten import _is_tensor, _plain, _type_name, build_entries
from .torch_load import load_torch_file
from .torch_zip import TensorLayout, index_torch_zip


def _layouts(storage: Storage, rel: str) -> dict[tuple[str | int, ...], TensorLayout] | None:
    """Where each tensor's bytes lie in a local zip torch.save file (see `torch_zip`)."""
    local = storage.local_path(rel)
    if local is None:
        return None
    fd = os.open(local, os.O_RDONLY)
    try:
        index = index_torch_zip(lambda at, n: os.pread(fd, n, at), 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return None if index is None else index.tensors


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
        for shard in shards:
            # remote files: metadata only now, one whole file when a tensor of it is read
            remote = storage.local_path(shard) is None
            obj, is_legacy = load_torch_file(storage, shard, meta=remote)
            if is_legacy:
                legacy.append(shard)
            objects[shard] = obj
            layouts = None if is_legacy or remote else _layouts(storage, shard)
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
        details: dict[str, Any] = {"sharded": index_rel is not None}
        if index_rel is not None:
            files.insert(0, FileInfo(path=index_rel, size=storage.size(index_rel), entries=0))
            details["index"] = index_rel
            details["weight_map_size"] = len(weight_map or {})
            if "total_size" in index_meta:
                details["total_size"] = index_meta["total_size"]
            missing = sorted(set(weight_map or {}) - set(leaves))
            if missing:
                raise FormatError(
                    f"the index lists {len(missing)} entries no shard holds "
                    f"(first: {missing[0]!r})",
                    path=storage.describe(index_rel),
                    fix="The index is inconsistent; `ckpt verify` lists every problem.",
                )
        if shared:
            details["shared_tensors"] = shared
        if legacy:
            details["legacy_format"] = legacy
        manifest = Manifest(
            format="torch",
            location=source.location.raw,
            files=files,
            entries=entries,
            details=details,
        )
        return cls(source, manifest, objects, leaves)

    def _leaf(self, name: str) -> Any:
        try:
            return self.leaves[name]
        except KeyError:
            raise NotFoundError(f"no entry named {name!r}", path=self.manifest.location) from None

    def read_tensor(self, name: str) -> torch.Tensor:
        leaf = self._leaf(name)
        if not _is_tensor(leaf):
            raise FormatError(
                f"entry {name!r} is a {_type_name(leaf)}, not a tensor",
                path=self.manifest.location,
            )
        if leaf.device.type == "meta":
            leaf = self._real_leaf(name)
        # memory-mapped: pages are read on first touch, one tensor at a time
        tensor: torch.Tensor = leaf.detach().contiguous()
        return tensor

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
        if _is_tensor(leaf):
            return self.read_tensor(name)
        # inert records as plain dicts: what every writer can store and every reader load
        return _plain(copy.deepcopy(leaf))

    def close(self) -> None:
        self.objects.clear()
        self.leaves.clear()
        self._loaded = None
