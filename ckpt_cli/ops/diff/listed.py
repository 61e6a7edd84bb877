"""The files a training layout lists without loading them (`OpenedSource.listed_files`: a
Trainer's `training_args.bin`, a pickle no input may be unpickled for), which `diff` cannot
compare by value: each is named, with why, and where both sides hold it its bytes are
compared (sizes, then, where they agree, a streamed sha256), so a user knows whether it changed.

Likewise the metadata two safetensors checkpoints keep about their files: every shard's
header `__metadata__` (`{"format": "pt"}`, a writer's notes) and an index's `metadata` object
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
    """One line per key of the safetensors file metadata (every shard's header
    `__metadata__`, the index's `metadata`) whose value differs between two safetensors
    checkpoints; none when either side is another format (which keeps no such metadata).

    Two shardings of one file list are compared shard by shard, and a note names the shard;
    two other shardings by the values each side's shards hold, naming the shards of a side
    whose shards disagree."""
    from ...formats.safetensors.format import SafetensorsCheckpoint

    if not (isinstance(ca, SafetensorsCheckpoint) and isinstance(cb, SafetensorsCheckpoint)):
        return []
    suffix = " (A → B; file metadata, no tensor value: not a difference)"
    shards_a, shards_b = (
        [
            (
                h.file,
                {
                    k: v
                    for k, v in h.metadata.items()
                    if k not in metadata_aliases(c.manifest, h.metadata)
                },
            )
            for h in c.headers
        ]
        for c in (ca, cb)
    )
    notes = []
    files_a, files_b = [f for f, _ in shards_a], [f for f, _ in shards_b]
    if files_a == files_b or len(files_a) == len(files_b) == 1:
        for (file, meta_a), (_, meta_b) in zip(shards_a, shards_b, strict=True):
            where = f" of {file}" if len(files_a) > 1 else ""
            for key in sorted(meta_a.keys() | meta_b.keys()):
                value_a, value_b = _shown(meta_a, key), _shown(meta_b, key)
                if value_a != value_b:
                    notes.append(
                        f"safetensors __metadata__{where} {key}: {value_a} → {value_b}{suffix}"
                    )
    else:
        keys = sorted({k for _, meta in [*shards_a, *shards_b] for k in meta})
        for key in keys:
            spread_a, spread_b = _spread(shards_a, key), _spread(shards_b, key)
            if spread_a.keys() != spread_b.keys():
                notes.append(
                    f"safetensors __metadata__ {key}: {_spread_shown(spread_a)} → "
                    f"{_spread_shown(spread_b)}{suffix}"
                )
    # `total_size` is the sum of the tensors' bytes, which the tensors' own comparison
    # covers: a cast or a dequantized twin differs there already, two shardings never do
    index_a, index_b = (
        {k: v for k, v in c.index_metadata.items() if k != "total_size"} for c in (ca, cb)
    )
    for key in sorted(index_a.keys() | index_b.keys()):
        value_a, value_b = _shown(index_a, key), _shown(index_b, key)
        if value_a != value_b:
            notes.append(f"safetensors index metadata {key}: {value_a} → {value_b}{suffix}")
    return notes


def _spread(shards: list[tuple[str, dict[str, str]]], key: str) -> dict[str, list[str]]:
    """The values `key` takes in a side's shards (shown, `(none)` where a shard lacks it),
    each with the shards that hold it."""
    spread: dict[str, list[str]] = {}
    for file, meta in shards:
        spread.setdefault(_shown(meta, key), []).append(file)
    return spread


def _spread_shown(spread: dict[str, list[str]]) -> str:
    """One value when a side's shards agree, else each value with (up to 3 of) its shards."""
    if len(spread) == 1:
        return next(iter(spread))
    return "; ".join(
        f"{value} in {', '.join(files[:3])}{f' (+{len(files) - 3} more)' if len(files) > 3 else ''}"
        for value, files in spread.items()
    )


def _shown(meta: dict[str, Any], key: str) -> str:
    if key not in meta:
        return "(none)"
    return json.dumps(meta[key], ensure_ascii=False, sort_keys=True)[:200]
