"""The per-rank safetensors files of `HuggingFaceStorageWriter(save_distributed=True)` (no `.metadata`)."""

from __future__ import annotations

import json

from ... import dtypes
from ...models import Chunk, Entry
from ..base import Source
from ..safetensors.format import DCP_HF_SHARD
from ..safetensors.header import prefetch_headers, read_header
from .layout import SHARDING_INFO_KEY, Layout, int_list


def analyse_hf_shards(source: Source, listing: dict[str, int]) -> Layout:
    """The per-rank safetensors files of `HuggingFaceStorageWriter(save_distributed=True)`.

    There is no `.metadata`: each `shard-{rank+1}-model-….safetensors` file holds that rank's
    chunks keyed by fqn, with their offsets in the `DCP_SHARDING_INFO` metadata; the global
    shape is the extent of the chunks (as torch's `HuggingFaceStorageReader` computes it).
    """
    storage = source.storage
    layout = Layout(files=dict(listing))
    layout.serialization.add("hf_safetensors")
    found: dict[str, list[tuple[str, Chunk]]] = {}
    names = sorted(n for n in listing if DCP_HF_SHARD.match(n))
    prefetch_headers(storage, names)
    for name in names:
        header = read_header(storage, name, listing[name])
        try:
            sharding = json.loads(header.metadata.get(SHARDING_INFO_KEY, "{}"))
        except (ValueError, RecursionError):
            sharding = None
        if not isinstance(sharding, dict):
            layout.problem(
                "dcp_bad_chunk", f"has unreadable {SHARDING_INFO_KEY} metadata", file=name
            )
            sharding = {}
        for fqn, (dtype, shape, begin, end) in header.tensors.items():
            info = sharding.get(fqn)
            saved = int_list(info.get("saved_offsets")) if isinstance(info, dict) else None
            if saved is None or len(saved) != len(shape):
                if info is not None:
                    layout.problem(
                        "dcp_bad_chunk",
                        f"tensor {fqn!r} has invalid saved_offsets {info!r}",
                        file=name,
                        tensor=fqn,
                    )
                saved = [0] * len(shape)
            chunk = Chunk(
                offsets=saved,
                sizes=list(shape),
                file=name,
                byte_offset=header.data_start + begin,
                byte_length=end - begin,
                raw=True,
            )
            found.setdefault(fqn, []).append((dtype, chunk))
    for fqn, items in found.items():
        kinds = {dtype for dtype, _ in items}
        if len(kinds) > 1:
            layout.problem(
                "dcp_mismatch",
                f"tensor {fqn!r} is stored with different dtypes ({', '.join(sorted(kinds))})",
                tensor=fqn,
            )
        dtype = items[0][0]
        chunks = [chunk for _, chunk in items]
        rank = len(chunks[0].sizes)
        if any(len(c.sizes) != rank for c in chunks):
            layout.problem(
                "dcp_mismatch", f"tensor {fqn!r} has chunks of different ranks", tensor=fqn
            )
            continue
        shape = [max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(rank)]
        layout.entries.append(
            Entry.checked(
                name=fqn,
                kind="tensor",
                dtype=dtype,
                shape=shape,
                nbytes=dtypes.numel(shape) * dtypes.itemsize(dtype),
                file=chunks[0].file,
                offset=chunks[0].byte_offset
                if len(chunks) == 1 and chunks[0].sizes == shape
                else None,
                chunks=chunks,
                py_type=None,
                value=None,
            )
        )
    return layout
