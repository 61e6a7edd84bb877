"""A checkpoint seen under another naming: `MappedCheckpoint` over the source's checkpoint.

Its manifest lists the mapping's outputs (`ArchitecturePlan.tensors`) under their new names;
reading one reads only that output's pieces from the source (`MappedTensor.read`). An output
that is one whole source tensor unchanged (a rename) is still served as the source's raw bytes,
so the writers' byte copies (and `copy_file_range`) keep working across a rename.

Boxes of a tensor the source does not store as raw bytes (a torch_save DCP chunk, a
`torch.save` blob) are cut from the whole tensor, read once and kept until an output from
another tensor is read: the E experts of a stacked `[E, ...]` tensor are consecutive outputs,
so the stacked tensor is read once, not E times, and memory stays one input plus one output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..fileio import COPY_BLOCK
from ..formats.base import Checkpoint
from ..models import Entry, Manifest
from .base import ArchitecturePlan, MappedTensor

if TYPE_CHECKING:
    import torch


class MappedCheckpoint(Checkpoint):
    """`base`'s tensors as `plan` maps them (names, transforms); nothing else of `base`."""

    def __init__(self, base: Checkpoint, plan: ArchitecturePlan):
        self.base = base
        self._reads = BoxReads(base)
        self.plan = plan
        self.mapped: dict[str, MappedTensor] = {t.name: t for t in plan.tensors}
        entries = []
        for tensor in plan.tensors:
            shape = list(tensor.shape)
            if tensor.verbatim:
                # the source's own entry under the new name: keeps its file/offset (raw copies)
                source = base.manifest.by_name[tensor.pieces[0].source]
                entries.append(source.model_copy(update={"name": tensor.name}))
                continue
            entries.append(
                Entry(
                    name=tensor.name,
                    kind="tensor",
                    dtype=tensor.dtype,
                    shape=shape,
                    nbytes=dtypes.numel(shape) * dtypes.itemsize(tensor.dtype),
                )
            )
        manifest = base.manifest
        super().__init__(
            base.source,
            Manifest(
                format=manifest.format,
                location=manifest.location,
                files=manifest.files,
                entries=entries,
                metadata=manifest.metadata,
                details={**manifest.details, "architecture": plan.architecture},
            ),
        )

    def _verbatim_source(self, name: str) -> str | None:
        tensor = self.mapped[name]
        return tensor.pieces[0].source if tensor.verbatim else None

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.mapped[name].read(self._reads)

    def read_object(self, name: str) -> Any:
        return self.base.read_object(name)

    def serves_raw(self, name: str) -> bool:
        source = self._verbatim_source(name)
        return source is not None and self.base.serves_raw(source)

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        source = self._verbatim_source(name)
        if source is None:
            return super().iter_raw(name, block)
        return self.base.iter_raw(source, block)

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        source = self._verbatim_source(name)
        return None if source is None else self.base.local_ranges(source)

    def padding(self, name: str) -> list[tuple[int, int]]:
        source = self._verbatim_source(name)
        return [] if source is None else self.base.padding(source)

    def close(self) -> None:
        self._reads.held = None
        self.base.close()


class BoxReads:
    """Reads of whole tensors and boxes from `base`, keeping the last whole tensor a box
    was cut from (when `base` cannot read the box alone from raw bytes)."""

    def __init__(self, base: Checkpoint):
        self.base = base
        self.held: tuple[str, torch.Tensor] | None = None

    def read_tensor(self, name: str) -> torch.Tensor:
        if self.held is not None and self.held[0] == name:
            return self.held[1]
        self.held = None
        return self.base.read_tensor(name)

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        if self.base.serves_raw(name):
            self.held = None
            return self.base.read_slice(name, offsets, sizes)
        if self.held is None or self.held[0] != name:
            self.held = None  # release the previous one before reading the next
            self.held = (name, self.base.read_tensor(name))
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        return self.held[1][index]
