"""Where each chunk's raw C-order bytes are inside a DCP data file (embedded safetensors blobs)."""

from __future__ import annotations

import json
import struct
from typing import Any

from ... import dtypes
from ...storage import Storage
from ..base import Source
from .layout import SHARDING_INFO_KEY, ZIP_MAGIC, Layout, PendingTensor, int_list

#: the largest embedded safetensors header read
_MAX_HEADER = 100 << 20


def locate_raw_chunks(
    source: Source,
    layout: Layout,
    pending: list[PendingTensor],
) -> dict[tuple[str, str, tuple[int, ...]], tuple[int, int]]:
    """Find each file's serialization; for safetensors blobs, each chunk's real byte range."""
    storage = source.storage
    # file -> offsets where its tensor items start (one per chunk; equal for safetensors)
    starts: dict[str, set[int]] = {}
    for _fqn, _dtype, _shape, chunks in pending:
        for _o, _s, rel, offset, _length in chunks:
            starts.setdefault(rel, set()).add(offset)
    out: dict[tuple[str, str, tuple[int, ...]], tuple[int, int]] = {}
    # (file, fqn) -> (safetensors dtype code, shape) as the embedded header says
    declared: dict[tuple[str, str], tuple[str, list[int]]] = {}
    for rel, item_starts in sorted(starts.items()):
        size = layout.files.get(rel)
        if size is None:
            continue  # reported by check_files
        first = min(item_starts)
        if size < first + 16:
            continue  # reported by check_files as a range past the end of the file
        head = storage.read(rel, first, 16)
        if head.startswith(ZIP_MAGIC):
            layout.serialization.add("torch_save")
            continue
        if (rel, first) in layout.transforms:
            # zstd-compressed items are torch_save blobs (DCP's extensions apply to that layout)
            layout.serialization.add("torch_save")
            continue
        if len(item_starts) > 1:
            layout.problem(
                "dcp_bad_chunk",
                f"tensor items start at {len(item_starts)} different offsets but the data at "
                f"byte {first} is not a torch.save blob",
                file=rel,
            )
            continue
        header = _read_embedded_header(storage, rel, first, size, layout)
        if header is None:
            continue
        layout.serialization.add("safetensors")
        data_start, tensors, sharding = header
        for fqn, (code, shape, begin, end) in tensors.items():
            info = sharding.get(fqn) if isinstance(sharding, dict) else None
            saved = info.get("saved_offsets") if isinstance(info, dict) else None
            key = tuple(saved) if isinstance(saved, list) else tuple([0] * len(shape))
            out[(rel, fqn, key)] = (data_start + begin, end - begin)
            declared[(rel, fqn)] = (code, shape)
    for fqn, dtype, _shape, chunks in pending:
        for offsets, sizes, rel, _offset, length in chunks:
            found = out.get((rel, fqn, tuple(offsets)))
            if found is None:
                if rel in starts and (rel, fqn) in declared:
                    layout.problem(
                        "dcp_mismatch",
                        f"tensor {fqn!r}: the chunk at {offsets} is not in the file's "
                        "safetensors header",
                        file=rel,
                        tensor=fqn,
                    )
                continue
            if declared[(rel, fqn)] != (dtypes.to_safetensors(dtype), list(sizes)):
                code, shape = declared[(rel, fqn)]
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {fqn!r}: the chunk at {offsets} is {dtype}{list(sizes)} in "
                    f".metadata but {code}{shape} in the file's safetensors header",
                    file=rel,
                    tensor=fqn,
                )
            elif found[1] != length:
                layout.problem(
                    "dcp_mismatch",
                    f"tensor {fqn!r}: the chunk at {offsets} spans {found[1]} bytes in the "
                    f"file but .metadata says {length}",
                    file=rel,
                    tensor=fqn,
                )
    return out


def _read_embedded_header(
    storage: Storage, rel: str, start: int, size: int, layout: Layout
) -> tuple[int, dict[str, tuple[str, list[int], int, int]], Any] | None:
    """Parse the safetensors blob DCP embeds at `start`: (data start, tensors, sharding info)."""
    (header_len,) = struct.unpack("<Q", storage.read(rel, start, 8))
    if header_len > _MAX_HEADER or start + 8 + header_len > size:
        layout.problem(
            "dcp_bad_chunk",
            f"the data at byte {start} is neither a torch.save blob nor a complete safetensors "
            "header (the file is truncated or corrupt)",
            file=rel,
        )
        return None
    try:
        header = json.loads(storage.read(rel, start + 8, header_len))
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        layout.problem(
            "dcp_bad_chunk", f"the safetensors header at byte {start} is not valid JSON", file=rel
        )
        return None
    meta = header.pop("__metadata__", None) or {}
    sharding: Any = {}
    if isinstance(meta, dict) and isinstance(meta.get(SHARDING_INFO_KEY), str):
        try:
            sharding = json.loads(meta[SHARDING_INFO_KEY])
        except (ValueError, RecursionError):
            sharding = {}
    data_start = start + 8 + header_len
    tensors: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            continue
        code, shape, offsets = (
            info.get("dtype"),
            int_list(info.get("shape")),
            int_list(info.get("data_offsets")),
        )
        if not isinstance(code, str) or shape is None or offsets is None or len(offsets) != 2:
            layout.problem(
                "dcp_bad_chunk", f"the safetensors header entry {name!r} is malformed", file=rel
            )
            continue
        tensors[name] = (code, shape, offsets[0], offsets[1])
    return data_start, tensors, sharding
