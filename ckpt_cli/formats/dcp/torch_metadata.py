"""`.metadata` as `dcp.save` writes it (torch's own `Metadata` classes), pickled without torch."""

from __future__ import annotations

import copyreg
import io
import pickle
import uuid
from typing import Any

from ...models import Chunk, Entry
from ..torch.zip_write import Reduced, placeholder, torch_names
from .transforms import ZSTD_DESCRIPTOR

_MD = "torch.distributed.checkpoint.metadata."
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"


def _newobj_reduce(self: Any, protocol: int) -> tuple[Any, ...]:
    # what pickle does for torch's dataclasses: NEWOBJ of the class, then BUILD with the state
    return (copyreg.__newobj__, (type(self),), self.__dict__.get("_state"))  # type: ignore[attr-defined]


def _obj(target: str, state: Any = None) -> Any:
    """An object that pickles as an instance of torch's class `target` with `state`."""
    cls: Any = placeholder(target)
    cls.__reduce_ex__ = _newobj_reduce
    obj = cls.__new__(cls)
    obj.__dict__["_state"] = state
    return obj


def _size(values: list[int]) -> Reduced:
    """What pickles as `torch.Size(values)`."""
    return Reduced(placeholder("torch.Size"), (tuple(int(v) for v in values),))


def metadata_bytes(
    plan: list[Entry],
    layout: dict[str, list[Chunk]],
    results: dict[str, list[tuple[int, int] | None]],
    object_file: dict[str, str],
    compression: str | None,
    planner_data: Any,
) -> bytes:
    """The `.metadata` pickle of a written DCP, as `dcp.save` pickles its `Metadata` (so
    `dcp.load` reads it): every planned entry with the byte range `results` records for it.

    Written without torch: the pickle names torch's classes through `torch_zip`'s placeholders
    (the same opcodes `pickle.dumps` of torch's own objects gives, protocol 2), which `.metadata`
    readers resolve to torch's classes (`dcp.load`) or to stand-ins (`metadata`).
    """
    used = {_MD + n for n in ("Metadata", "TensorStorageMetadata", "TensorProperties")}
    used |= {_MD + n for n in ("ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex")}
    used |= {_MD + "StorageMeta", _MD + "_MEM_FORMAT_ENCODING", _STORAGE_INFO, "torch.Size"}
    used.add("torch.serialization._get_layout")
    strided = Reduced(placeholder("torch.serialization._get_layout"), ("torch.strided",))
    contiguous = Reduced(placeholder(_MD + "_MEM_FORMAT_ENCODING"), (0,))
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    transforms = [ZSTD_DESCRIPTOR] if compression == "zstd" else None

    def info(rel: str, start: int, length: int) -> Any:
        state: dict[str, Any] = {"relative_path": rel, "offset": start, "length": length}
        if transforms is not None:
            state["transform_descriptors"] = transforms
        return _obj(_STORAGE_INFO, state)

    for entry in plan:
        found = results[entry.name]
        if entry.kind == "object":
            state_dict_metadata[entry.name] = _obj(_MD + "BytesStorageMetadata")
            start, length = found[0]  # type: ignore[misc]
            key = _obj(_MD + "MetadataIndex", {"fqn": entry.name, "offset": None, "index": None})
            storage_data[key] = info(object_file[entry.name], start, length)
            continue
        assert entry.dtype is not None
        dtype = placeholder("torch." + entry.dtype)
        used.add("torch." + entry.dtype)
        chunks = layout[entry.name]
        properties = _obj(_MD + "TensorProperties", (dtype, strided, False, contiguous, False))
        state_dict_metadata[entry.name] = _obj(
            _MD + "TensorStorageMetadata",
            {
                "properties": properties,
                "size": _size(entry.shape),
                "chunks": [
                    _obj(
                        _MD + "ChunkStorageMetadata",
                        {"offsets": _size(c.offsets), "sizes": _size(c.sizes)},
                    )
                    for c in chunks
                ],
            },
        )
        for index, (chunk, result) in enumerate(zip(chunks, found, strict=True)):
            assert result is not None
            key = _obj(
                _MD + "MetadataIndex",
                {"fqn": entry.name, "index": index, "offset": _size(chunk.offsets)},
            )
            storage_data[key] = info(chunk.file, result[0], result[1])
    if not isinstance(planner_data, dict):
        planner_data = {}
    planner_data = {
        name: planner_data.get(name, tuple(name.split("."))) for name in state_dict_metadata
    }
    storage_meta = {"checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None}
    metadata = _obj(
        _MD + "Metadata",
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": planner_data,
            "storage_data": storage_data,
            "storage_meta": _obj(_MD + "StorageMeta", {**storage_meta, "modules": []}),
            "version": "1.0.0",
        },
    )
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=2).dump(metadata)
    data = buffer.getvalue()
    # only the globals this pickle names (a placeholder's GLOBAL opcode is in it)
    named = {t for t in used if _marker(t) in data}
    return torch_names(data, named)


def _marker(target: str) -> bytes:
    cls = placeholder(target)
    return b"c" + cls.__module__.encode() + b"\n" + cls.__qualname__.encode() + b"\n"
