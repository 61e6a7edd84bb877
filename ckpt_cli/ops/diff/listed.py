"""The files a training layout lists without loading them (`OpenedSource.listed_files`: a
Trainer's `training_args.bin`, a pickle no input may be unpickled for), which `diff` cannot
compare by value: each is named, with why, and where both sides hold it its bytes are
compared (sizes, then, where they agree, a streamed sha256), so a user knows whether it changed.

Likewise the metadata two safetensors checkpoints keep about their files: the header's
`__metadata__` (`{"format": "pt"}`, a writer's notes) and an index's `metadata` object
(`total_size`, anything else its writer put there). It describes the files, holds no tensor
value, and `convert` / `reshard` rewrite it, so a key that differs is a note, not a
difference. Alias records (`lm_head.weight` -> `transformer.wte.weight`) are left to the
aliases `diff` reports, and `total_size`, the sum of the tensors' bytes, to the tensors'
own comparison.

Memory: one block of one file at a time.
"""

from __future__ import annotations

import json
from typing import Any

from ...formats.base import Checkpoint
from ...sources.layouts import OpenedSource
from ...storage.hashing import StoredFile, hash_file, hasher_factory
from ..shared.transfer import metadata_aliases


def listed_notes(
    a: tuple[OpenedSource, Checkpoint], b: tuple[OpenedSource, Checkpoint]
) -> list[str]:
    """One line per file either side lists without loading: not compared, why, and whether
    the two sides' bytes are identical (or which side alone holds it)."""
    (opened_a, ca), (opened_b, cb) = a, b
    listed_a, listed_b = opened_a.listed_files, opened_b.listed_files
    notes = []
    for name in sorted(listed_a.keys() | listed_b.keys()):
        why = listed_a.get(name) or listed_b[name]
        if name not in listed_b or name not in listed_a:
            held = "A" if name in listed_a else "B"
            notes.append(f"{name} not compared: {why}; only {held} holds it")
            continue
        size_a, size_b = ca.storage.size(name), cb.storage.size(name)
        if size_a != size_b:  # no need to read either (a listed file may be a GB partition)
            bytes_say = f"its bytes differ (A {size_a} bytes, B {size_b} bytes)"
        elif (sha_a := _digest(ca, name, size_a)) == (sha_b := _digest(cb, name, size_b)):
            bytes_say = "its bytes are identical on both sides"
        else:
            bytes_say = (
                f"its bytes differ (both {size_a} bytes; A sha256:{sha_a[:16]}, "
                f"B sha256:{sha_b[:16]})"
            )
        notes.append(f"{name} not compared: {why}; {bytes_say}")
    return notes


def _digest(checkpoint: Checkpoint, name: str, size: int) -> str:
    """The sha256 (hex) of file `name` of `checkpoint` (`size` bytes), streamed."""
    return hash_file(StoredFile(checkpoint.storage, name, size), hasher_factory("sha256"))


def file_metadata_notes(ca: Checkpoint, cb: Checkpoint) -> list[str]:
    """One line per key of the safetensors file metadata (header `__metadata__`, index
    `metadata`) whose value differs between two safetensors checkpoints; none when either
    side is another format (which keeps no such metadata)."""
    from ...formats.safetensors.format import SafetensorsCheckpoint

    if not (isinstance(ca, SafetensorsCheckpoint) and isinstance(cb, SafetensorsCheckpoint)):
        return []
    notes = []
    headers = [
        {k: v for k, v in c.manifest.metadata.items() if k not in metadata_aliases(c.manifest)}
        for c in (ca, cb)
    ]
    # `total_size` is the sum of the tensors' bytes, which the tensors' own comparison
    # covers: a cast or a dequantized twin differs there already, two shardings never do
    indexes = [{k: v for k, v in c.index_metadata.items() if k != "total_size"} for c in (ca, cb)]
    for what, (meta_a, meta_b) in (
        ("__metadata__", headers),
        ("index metadata", indexes),
    ):
        for key in sorted(meta_a.keys() | meta_b.keys()):
            value_a, value_b = _shown(meta_a, key), _shown(meta_b, key)
            if value_a != value_b:
                notes.append(
                    f"safetensors {what} {key}: {value_a} → {value_b} (A → B; file "
                    "metadata, no tensor value: not a difference)"
                )
    return notes


def _shown(meta: dict[str, Any], key: str) -> str:
    if key not in meta:
        return "(none)"
    return json.dumps(meta[key], ensure_ascii=False, sort_keys=True)[:200]
