"""`.metadata` as `dcp.save` writes it: torch's own `Metadata` classes, pickled (torch needed)."""

from __future__ import annotations

import uuid
from typing import Any

from ...models import Chunk, Entry
from .transforms import ZSTD_DESCRIPTOR


def metadata_bytes(
    plan: list[Entry],
    layout: dict[str, list[Chunk]],
    results: dict[str, list[tuple[int, int] | None]],
    object_file: dict[str, str],
    compression: str | None,
    planner_data: Any,
) -> bytes:
    """The `.metadata` pickle of a written DCP, built with torch's own classes (so `dcp.load`
    reads it): every planned entry with the byte range `results` records for it."""
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

    from ...tensors import torch_dtype

    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    transforms = [ZSTD_DESCRIPTOR] if compression == "zstd" else None
    for entry in plan:
        found = results[entry.name]
        if entry.kind == "object":
            state_dict_metadata[entry.name] = TorchBytes()
            start, length = found[0]  # type: ignore[misc]
            storage_data[TorchIndex(entry.name)] = _StorageInfo(
                object_file[entry.name], start, length, transforms
            )
            continue
        assert entry.dtype is not None
        chunks = layout[entry.name]
        state_dict_metadata[entry.name] = TorchTensorMeta(
            properties=TorchProperties(dtype=torch_dtype(entry.dtype)),
            size=torch.Size(entry.shape),
            chunks=[
                TorchChunk(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in chunks
            ],
        )
        for index, (chunk, result) in enumerate(zip(chunks, found, strict=True)):
            assert result is not None
            storage_data[TorchIndex(entry.name, chunk.offsets, index)] = _StorageInfo(
                chunk.file, result[0], result[1], transforms
            )
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
