"""The files a training layout lists without loading them (`OpenedSource.listed_files`: a
Trainer's `training_args.bin`, a pickle no input may be unpickled for), which `diff` cannot
compare by value: each is named, with why, and where both sides hold it its bytes are
compared (size, then a streamed sha256), so a user knows whether it changed.

Memory: one block of one file at a time.
"""

from __future__ import annotations

import hashlib

from ...formats.base import Checkpoint
from ...sources.layouts import OpenedSource

#: bytes read at a time while hashing a listed file
BLOCK = 1 << 20


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
        sha_a, size_a = _digest(ca, name)
        sha_b, size_b = _digest(cb, name)
        if (size_a, sha_a) == (size_b, sha_b):
            bytes_say = "its bytes are identical on both sides"
        else:
            bytes_say = (
                f"its bytes differ (A {size_a} bytes, sha256:{sha_a[:16]}; "
                f"B {size_b} bytes, sha256:{sha_b[:16]})"
            )
        notes.append(f"{name} not compared: {why}; {bytes_say}")
    return notes


def _digest(checkpoint: Checkpoint, name: str) -> tuple[str, int]:
    """The sha256 (hex) and size of file `name` of `checkpoint`, streamed."""
    hasher = hashlib.sha256()
    size = 0
    with checkpoint.storage.open(name) as fh:
        while block := fh.read(BLOCK):
            hasher.update(block)
            size += len(block)
    return hasher.hexdigest(), size
