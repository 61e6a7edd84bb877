"""A checkpoint seen under another naming: `MappedCheckpoint` over the source's checkpoint.

Its manifest lists the mapping's outputs (`ArchitecturePlan.tensors`) under their new names;
reading one reads only that output's pieces from the source (`MappedTensor.read`). An output
that is one whole source tensor unchanged (a rename) is still served as the source's raw bytes,
so the writers' byte copies (and `copy_file_range`) keep working across a rename.

Most transforms need no tensor at all, so torch is never imported for them: an output that is
the concatenation of contiguous byte ranges of raw-stored sources (one expert's rows of a
stacked tensor, experts stacked, a rename) is served as those ranges (`local_ranges`: copied
in the kernel); a rotary permutation reorders whole rows, so a local source's permuted tensor
is its rows' ranges in the new order (`permuted_row_order`), copied in the kernel too, any
dtype; a remote one is permuted on its bytes with numpy (`permute_rows`).

Boxes of a tensor the source does not store as raw bytes (a torch_save DCP chunk, a
`torch.save` blob) are cut from the whole tensor, read once and kept until an output from
another tensor is read: the E experts of a stacked `[E, ...]` tensor are consecutive outputs,
so the stacked tensor is read once, not E times, and memory stays one input plus one output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .. import dtypes
from ..formats.base import Checkpoint
from ..models import Entry, Manifest
from ..storage.fileio import COPY_BLOCK
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
        self._reads = BoxReads(base)
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

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """(source, byte start, length) of each piece when output `name`'s bytes are those
        ranges of raw-stored sources back to back (no permutation; boxes whole rows along
        dim 0), else None."""
        tensor = self.mapped.get(name)  # None for an entry that is no mapped tensor
        if tensor is None or tensor.permute is not None or tensor.combine == "zeros":
            return None
        if tensor.combine == "concat" and tensor.axis != 0:
            return None  # pieces side by side within each row: no back-to-back ranges
        out = []
        for piece in tensor.pieces:
            entry = self.base.manifest.by_name[piece.source]
            if entry.dtype is None or not self.base.serves_raw(piece.source):
                return None
            if piece.offsets is None or piece.sizes is None:
                out.append((piece.source, 0, entry.nbytes))
                continue
            shape = list(entry.shape)
            whole_rows = not any(piece.offsets[1:]) and list(piece.sizes[1:]) == shape[1:]
            if not shape or not whole_rows or dtypes.bitsize(entry.dtype) % 8:
                return None
            row = dtypes.numel(shape[1:]) * dtypes.itemsize(entry.dtype)
            out.append((piece.source, piece.offsets[0] * row, piece.sizes[0] * row))
        return out

    def _permuted_source(self, name: str) -> str | None:
        """The raw-stored source whose rows output `name` permutes, if it is one."""
        tensor = self.mapped.get(name)
        if tensor is None or tensor.permute is None or len(tensor.pieces) != 1:
            return None
        if tensor.combine != "one":
            return None
        piece = tensor.pieces[0]
        entry = self.base.manifest.by_name[piece.source]
        if piece.offsets is not None or entry.dtype is None or dtypes.bitsize(entry.dtype) % 8:
            return None
        return piece.source if self.base.serves_raw(piece.source) else None

    def _verbatim_source(self, name: str) -> str | None:
        tensor = self.mapped.get(name)  # None for the naming's own objects
        return tensor.pieces[0].source if tensor is not None and tensor.verbatim else None

    def built_from(self, name: str) -> list[str]:
        tensor = self.mapped.get(name)
        if tensor is None:
            return []  # the naming's own objects are read from no entry
        return [found for source in tensor.sources for found in self.base.built_from(source)]

    def files_of(self, name: str) -> set[str]:
        tensor = self.mapped.get(name)
        if tensor is None:
            return set()  # the naming's own objects are read from no file
        return {f for source in tensor.sources for f in self.base.files_of(source)}

    def metadata_left_out(self, written: Mapping[str, str] | None = None) -> list[str]:
        # the manifest's metadata is the source's: so is what it leaves out
        return self.base.metadata_left_out(written)

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.mapped[name].read(self._reads)

    def read_object(self, name: str) -> Any:
        if name in self.objects:
            return self.objects[name]
        return self.base.read_object(name)

    def serves_raw(self, name: str) -> bool:
        if self.byte_ranges(name) is not None:
            return True
        return self._permuted_source(name) is not None

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        source = self._verbatim_source(name)
        if source is not None:
            return self.base.iter_raw(source, block)
        ranges = self.byte_ranges(name)
        if ranges is not None:
            return self._iter_ranges(ranges, block)
        permuted = self._permuted_source(name)
        if permuted is None:
            return super().iter_raw(name, block)
        tensor = self.mapped[name]
        rows = permute_rows(
            self.base.iter_raw(permuted, block),
            self.base.manifest.by_name[permuted].nbytes,
            tensor.shape[0],
            tensor.heads,
            tensor.permute or "to_halves",
        )
        # writers take any buffer (see transfer._counted)
        return cast(Iterator[bytes], (rows[i : i + block] for i in range(0, len(rows), block)))

    def _iter_ranges(self, ranges: list[tuple[str, int, int]], block: int) -> Iterator[bytes]:
        for source, start, length in ranges:
            at = 0  # the source's bytes stream past; only [start, start + length) is kept
            for chunk in self.base.iter_raw(source, block):
                lo, hi = max(start - at, 0), min(start + length - at, len(chunk))
                if lo < hi:
                    yield bytes(chunk[lo:hi])
                at += len(chunk)
                if at >= start + length:
                    break

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        source = self._verbatim_source(name)
        if source is not None:
            return self.base.local_ranges(source)
        ranges = self.byte_ranges(name)
        if ranges is None:
            return self._permuted_ranges(name)
        out: list[tuple[Path, int, int]] = []
        for source, start, length in ranges:
            segments = self.base.local_ranges(source)
            if segments is None:
                return None
            out += window(segments, start, length)
        return out

    def _permuted_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """A rotary permutation of a local raw-stored source as its rows' byte ranges in the
        output's order: the writers gather them (`FileRange.copy_to`: the rows of a head are
        one contiguous source range, read with one `preadv` into their permuted places)."""
        permuted = self._permuted_source(name)
        if permuted is None:
            return None
        segments = self.base.local_ranges(permuted)
        if segments is None:
            return None
        tensor = self.mapped[name]
        row = self.base.manifest.by_name[permuted].nbytes // tensor.shape[0]
        order = permuted_row_order(tensor.shape[0], tensor.heads, tensor.permute or "to_halves")
        if len(segments) == 1:  # the usual case: the tensor is one range of one file
            path, start, _ = segments[0]
            rows: Iterable[tuple[Path, int, int]] = ((path, start + r * row, row) for r in order)
        else:
            rows = (piece for r in order for piece in window(segments, r * row, row))
        out: list[tuple[Path, int, int]] = []
        for path, offset, length in rows:
            last = out[-1] if out else None
            if last is not None and last[1] + last[2] == offset and last[0] == path:
                out[-1] = (path, last[1], last[2] + length)  # rows that stay neighbours
            else:
                out.append((path, offset, length))
        return out

    def padding(self, name: str) -> list[tuple[int, int]]:
        source = self._verbatim_source(name)
        return [] if source is None else self.base.padding(source)

    def close(self) -> None:
        self._reads.held = []
        self.base.close()


def window(
    segments: list[tuple[Path, int, int]], start: int, length: int
) -> list[tuple[Path, int, int]]:
    """The part `[start, start + length)` of the bytes `segments` hold back to back."""
    out = []
    at = 0
    for path, offset, size in segments:
        lo, hi = max(start, at), min(start + length, at + size)
        if lo < hi:
            out.append((path, offset + lo - at, hi - lo))
        at += size
    return out


def permuted_row_order(rows: int, heads: int, to: str) -> list[int]:
    """The source row of each output row of `rotary_permute` (whole rows move, in order)."""
    half = rows // heads // 2
    order = []
    for head in range(heads):
        base = head * 2 * half
        if to == "to_halves":  # output (pair member j, pair i) <- source row 2i + j
            order += [base + 2 * i + j for j in range(2) for i in range(half)]
        else:  # output row 2i + j <- source (pair member j, pair i)
            order += [base + j * half + i for i in range(half) for j in range(2)]
    return order


def permute_rows(
    blocks: Iterable[bytes], nbytes: int, rows: int, heads: int, to: str
) -> memoryview:
    """`rotary_permute` on a row-major tensor's raw bytes (whole rows moved, any dtype): the
    source's blocks are read into one buffer and its rows copied once into the output."""
    import numpy as np

    data = np.empty(nbytes, dtype=np.uint8)  # one allocation, filled block by block
    at = 0
    for block in blocks:
        data[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
        at += len(block)
    flat = data.reshape(rows, -1)
    width = flat.shape[1]
    out = np.empty_like(flat)
    half = rows // heads // 2
    if to == "to_halves":
        source = flat.reshape(heads, half, 2, width).transpose(0, 2, 1, 3)
        np.copyto(out.reshape(heads, 2, half, width), source)
    else:
        source = flat.reshape(heads, 2, half, width).transpose(0, 2, 1, 3)
        np.copyto(out.reshape(heads, half, 2, width), source)
    return out.data.cast("B")


class BoxReads:
    """Reads of whole tensors and boxes from `base`. A box `base` cannot read alone from raw
    bytes is cut from the smallest region `base` stores it in: the stored chunks it overlaps
    (their bounding box), or the whole tensor. The regions of the current tensor's dim-0 slab
    are kept (Megatron's layer stacks are stored one chunk per layer and tensor-parallel rank:
    the chunks of one layer), so the q, k and v rows of a fused QKV, or the E experts of a
    stacked tensor, read each region once, and memory stays one slab, never the whole stack
    of a chunked tensor."""

    def __init__(self, base: Checkpoint):
        self.base = base
        #: (name, region offsets, region sizes, the region's values), oldest first
        self.held: list[tuple[str, list[int], list[int], torch.Tensor]] = []

    def read_tensor(self, name: str) -> torch.Tensor:
        shape = self._shape(name)
        for held_name, _, sizes, values in self.held:
            if held_name == name and sizes == shape:
                return values
        self.held = []
        return self.base.read_tensor(name)

    def _shape(self, name: str) -> list[int]:
        return list(self.base.manifest.by_name[name].shape)

    def _region(
        self, name: str, offsets: list[int], sizes: list[int]
    ) -> tuple[list[int], list[int], int]:
        """The bounding box of the stored chunks the box overlaps (the whole tensor when it is
        stored as one piece), and how many chunks share the box's dim-0 slab."""
        shape = self._shape(name)
        chunks = self.base.manifest.by_name[name].chunks or []

        def overlaps(c_offsets: list[int], c_sizes: list[int], dims: int) -> bool:
            return all(
                o < co + cs and co < o + n
                for o, n, co, cs in list(zip(offsets, sizes, c_offsets, c_sizes, strict=True))[
                    :dims
                ]
            )

        over = [c for c in chunks if overlaps(c.offsets, c.sizes, len(shape))]
        slab = sum(1 for c in chunks if overlaps(c.offsets, c.sizes, 1))
        if not over:
            return [0] * len(shape), shape, 1
        lo = [min(c.offsets[d] for c in over) for d in range(len(shape))]
        hi = [max(c.offsets[d] + c.sizes[d] for c in over) for d in range(len(shape))]
        return lo, [h - low for h, low in zip(hi, lo, strict=True)], max(slab, 1)

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        if self.base.serves_raw(name):
            self.held = []
            return self.base.read_slice(name, offsets, sizes)
        found = None
        for held in self.held:
            if held[0] == name and all(
                ho <= o and o + n <= ho + hn
                for o, n, ho, hn in zip(offsets, sizes, held[1], held[2], strict=True)
            ):
                found = held
                break
        if found is None:
            lo, extent, keep = self._region(name, offsets, sizes)
            # release what the next region replaces before reading it
            self.held = [h for h in self.held if h[0] == name][-(keep - 1) :] if keep > 1 else []
            whole = extent == self._shape(name)
            values = (
                self.base.read_tensor(name) if whole else self.base.read_slice(name, lo, extent)
            )
            found = (name, lo, extent, values)
            self.held.append(found)
        _, lo, _, values = found
        index = tuple(
            slice(o - start, o - start + n) for o, n, start in zip(offsets, sizes, lo, strict=True)
        )
        return values[index]
