"""Streaming copy of entries from an opened checkpoint into a writer, one entry at a time.

Shared by `reshard --max-shard-size` (and usable by `convert`): where the source stores raw
bytes and the writer accepts them, tensors move as raw byte blocks without deserialising;
otherwise one tensor at a time through `read_tensor` / `write_tensor`. Peak memory is one
copy block, or the largest tensor on the tensor path.

Local sources are read with `os.preadv` into ONE reused buffer. Measured on this machine
(1 GB from the page cache, fsync'd): a fresh `bytes` per 8 MiB block 3.3-3.7 s (every block
is a new mapping, page-faulted in), `sendfile` 0.4-1.1 s, `copy_file_range` 1.0 s, the reused
buffer 0.3-0.9 s. Writers consume each block before asking for the next (`write_raw` writes it
out synchronously), so reusing the buffer is safe.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

from ..errors import FormatError
from ..formats.base import COPY_BLOCK, Checkpoint, Writer
from ..models import Entry
from ..progress import NULL_PROGRESS, Progress
from ..storage import LocalStorage


@dataclass
class CopyStats:
    """What a streaming copy moved.

    Attributes:
        tensors: tensor entries written.
        objects: non-tensor entries written.
        raw_tensors: tensors copied as raw bytes (no deserialisation).
        bytes: tensor bytes written.
    """

    tensors: int = 0
    objects: int = 0
    raw_tensors: int = 0
    bytes: int = 0


def _counted(blocks: Iterable[bytes], progress: Progress) -> Iterator[bytes]:
    for block in blocks:
        progress.advance(len(block))
        yield block


@dataclass
class _LocalReader:
    """Raw ranges of local files, read into one reused buffer (fds kept open per file)."""

    storage: LocalStorage
    block: int
    fds: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buffer = memoryview(bytearray(self.block))

    def blocks(self, rel: str, offset: int, length: int) -> Iterator[bytes]:
        """Views of the reused buffer; each is valid until the next one is requested."""
        fd = self.fds.get(rel)
        if fd is None:
            fd = self.fds[rel] = os.open(self.storage.path(rel), os.O_RDONLY)
        done = 0
        while done < length:
            want = min(self.block, length - done)
            got = os.preadv(fd, [self.buffer[:want]], offset + done)
            if got <= 0:
                raise FormatError(
                    f"is truncated ({done} of the {length} bytes at {offset} present)",
                    path=self.storage.describe(rel),
                    fix="The file was cut short; write or fetch it again.",
                )
            done += got
            yield cast(bytes, self.buffer[:got])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def copy_entries(
    checkpoint: Checkpoint,
    writer: Writer,
    entries: Iterable[Entry],
    progress: Progress = NULL_PROGRESS,
    block: int = COPY_BLOCK,
) -> CopyStats:
    """Write every entry of `entries` (in order, as planned for `writer`) from `checkpoint`.

    The progress sink advances by tensor bytes.
    """
    stats = CopyStats()
    storage = checkpoint.storage
    local = _LocalReader(storage, block) if isinstance(storage, LocalStorage) else None
    try:
        for entry in entries:
            if entry.kind == "object":
                writer.write_object(entry.name, checkpoint.read_object(entry.name))
                stats.objects += 1
                continue
            if entry.is_raw and writer.accepts_raw:
                if local is not None and entry.file is not None and entry.offset is not None:
                    blocks = local.blocks(entry.file, entry.offset, entry.nbytes)
                else:
                    blocks = checkpoint.iter_raw(entry.name, block)
                writer.write_raw(entry.name, _counted(blocks, progress))
                stats.raw_tensors += 1
            else:
                writer.write_tensor(entry.name, checkpoint.read_tensor(entry.name))
                progress.advance(entry.nbytes)
            stats.tensors += 1
            stats.bytes += entry.nbytes
    finally:
        if local is not None:
            local.close()
    return stats
