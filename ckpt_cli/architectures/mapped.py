"""A checkpoint seen under another naming: `MappedCheckpoint` over the source's checkpoint.

Its manifest lists the mapping's outputs (`ArchitecturePlan.tensors`) under their new names;
reading one reads only that output's pieces from the source (`MappedTensor.read`). An output
that is one whole source tensor unchanged (a rename) is still served as the source's raw bytes,
so the writers' byte copies (and `copy_file_range`) keep working across a rename.
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
    """`base`'s tensors as `plan` maps them (names, transforms); nothing else of `base` but
    `objects`, the non-tensor entries the target naming holds of its own (name -> value)."""

    def __init__(
        self, base: Checkpoint, plan: ArchitecturePlan, objects: dict[str, Any] | None = None
    ):
        self.base = base
        self.plan = plan
        self.mapped: dict[str, MappedTensor] = {t.name: t for t in plan.tensors}
        self.objects = dict(objects or {})
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
        for name, value in self.objects.items():
            entries.append(
                Entry(
                    name=name,
                    kind="object",
                    dtype=None,
                    shape=[],
                    nbytes=0,
                    py_type=type(value).__name__,
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
        tensor = self.mapped.get(name)  # None for the naming's own objects
        return tensor.pieces[0].source if tensor is not None and tensor.verbatim else None

    def files_of(self, name: str) -> set[str]:
        tensor = self.mapped.get(name)
        if tensor is None:
            return set()  # the naming's own objects are read from no file
        return {f for source in tensor.sources for f in self.base.files_of(source)}

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.mapped[name].read(self.base)

    def read_object(self, name: str) -> Any:
        if name in self.objects:
            return self.objects[name]
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
        self.base.close()
