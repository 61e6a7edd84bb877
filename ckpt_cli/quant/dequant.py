"""Dequantization: one quantized weight and its scales in, one plain tensor out.

Each function follows the scheme's published formula, in the operation order of the reference
implementation, so results are bit-identical to it: torch's
`QuantizedHuggingFaceStorageReader` for block FP8 and MXFP4, compressed-tensors'
`NVFP4PackedCompressor.decompress` for its NVFP4, ModelOpt's `fp4 * (weight_scale *
weight_scale_2)` for ModelOpt NVFP4. Work is done in row chunks, so the temporaries stay a
fraction of the weight: peak memory is the quantized weight, its scales and the output.

`DequantizedCheckpoint` wraps an opened checkpoint: its manifest lists dequantized weights in
place of payload + sidecars, and `read_tensor` dequantizes on the fly, so `convert` and `diff`
stream a quantized checkpoint through their usual one-tensor-at-a-time pipelines.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import FormatError
from ..formats.base import Checkpoint, leading_slab
from ..models import Entry, Manifest, Problem, ProblemList
from ..storage.fileio import COPY_BLOCK
from .schemes import ACTIVATION, QuantAnalysis, QuantWeight

if TYPE_CHECKING:
    import torch

#: E2M1 values by 4-bit code (sign in bit 3), as OCP MX and NVFP4 define them
FP4_VALUES = [
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
]
#: values per NVFP4 group scale (columns of the unpacked weight)
NVFP4_GROUP = 16
#: rows per step of the chunked loops (bounds the float32 temporaries)
ROWS = 1 << 14


def _dtype(name: str) -> torch.dtype:
    from ..tensors import torch_dtype

    return torch_dtype(name)


def fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: str
) -> torch.Tensor:
    """Block-scaled FP8: every `block` of the weight times its scale (`weight_scale_inv`).

    Leading dimensions (stacked experts `[E, out, in]` with scales `[E, ceil(out/bo),
    ceil(in/bi)]`) are one `[out, in]` weight each, dequantized as such.
    """
    import torch

    *lead, rows, cols = weight.shape
    out = torch.empty(weight.shape, dtype=_dtype(dtype))
    if lead:
        flat_out = out.view(-1, rows, cols)
        flat_weight = weight.reshape(-1, rows, cols)
        flat_scale = scale.reshape(-1, *scale.shape[-2:])
        for i in range(flat_weight.shape[0]):
            _fp8_block_2d(flat_weight[i], flat_scale[i], block, flat_out[i])
    else:
        _fp8_block_2d(weight, scale, block, out)
    return out


def _fp8_block_2d(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor
) -> None:
    import torch

    rows, cols = weight.shape
    bo, bi = block
    for b in range(math.ceil(rows / bo)):
        r0, r1 = b * bo, min((b + 1) * bo, rows)
        factor = scale[b].to(torch.float32).repeat_interleave(bi)[:cols]
        out[r0:r1] = (weight[r0:r1].to(torch.float32) * factor).to(out.dtype)


def fp8_scaled(weight: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per-tensor or per-output-channel FP8: the weight times its scale."""
    import torch

    target = _dtype(dtype)
    factor = scale.to(torch.float32)
    factor = (
        factor.reshape(()) if factor.numel() == 1 else factor.reshape(-1, *[1] * (weight.dim() - 1))
    )
    if weight.dim() == 0:
        return (weight.to(torch.float32) * factor).to(target)
    out = torch.empty(weight.shape, dtype=target)
    for r0 in range(0, weight.shape[0], ROWS):
        part = factor if factor.dim() == 0 else factor[r0 : r0 + ROWS]
        out[r0 : r0 + ROWS] = (weight[r0 : r0 + ROWS].to(torch.float32) * part).to(target)
    return out


def _exponents(scales: torch.Tensor) -> torch.Tensor:
    import torch

    # E8M0 stored as its own dtype or as U8: the byte is the biased exponent either way
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    return raw.to(torch.int32) - 127


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """MXFP4 (gpt-oss): `[..., G, 16]` bytes of E2M1 pairs (low nibble first) times 2^(scale-127)."""
    import torch

    target = _dtype(dtype)
    exponents = _exponents(scales)
    lut = torch.tensor(FP4_VALUES, dtype=target)
    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    flat = blocks.reshape(rows, width)
    exponents = exponents.reshape(rows, 1)
    out = torch.empty(rows, width * 2, dtype=target)
    for r0 in range(0, rows, ROWS):
        r1 = min(r0 + ROWS, rows)
        blk = flat[r0:r1]
        sub = out[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.long)]
        sub[:, 1::2] = lut[(blk >> 4).to(torch.long)]
        torch.ldexp(sub, exponents[r0:r1], out=sub)
    return out.reshape(*prefix, groups * width * 2)


def mxfp8(blocks: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """MXFP8: `[..., G, 32]` FP8 values times 2^(scale-127)."""
    import torch

    *prefix, groups, width = blocks.shape
    exponents = _exponents(scales).unsqueeze(-1)
    values = torch.ldexp(blocks.to(torch.float32), exponents)
    return values.to(_dtype(dtype)).reshape(*prefix, groups * width)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """`[o, i/2]` bytes -> `[o, i]` float32 E2M1 values (low nibble first)."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    out[:, 0::2] = lut[(packed & 0x0F).to(torch.long)]
    out[:, 1::2] = lut[(packed >> 4).to(torch.long)]
    return out


def nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: str,
    *,
    reciprocal: bool,
) -> torch.Tensor:
    """NVFP4: E2M1 values times their FP8 group scale times the global scale.

    ModelOpt stores `weight_scale_2` (multiply); compressed-tensors stores
    `weight_global_scale`, its reciprocal (divide): `reciprocal=True`. A group is 16 columns,
    the last one partial when the input size is not a multiple of 16 (`scale` is
    `[out, ceil(in/16)]`).
    """
    import torch

    target = _dtype(dtype)
    rows, half = packed.shape
    cols = half * 2
    g = global_scale.to(torch.float32).reshape(())
    out = torch.empty(rows, cols, dtype=target)
    for r0 in range(0, rows, ROWS):
        r1 = min(r0 + ROWS, rows)
        values = unpack_fp4(packed[r0:r1])
        s = scale[r0:r1].to(torch.float32)
        s = s / g if reciprocal else s * g
        per = s.repeat_interleave(NVFP4_GROUP, dim=1)[:, :cols]
        out[r0:r1] = (values * per).to(target)
    return out


def dequantize(weight: QuantWeight, tensors: dict[str, torch.Tensor], dtype: str) -> torch.Tensor:
    """The dequantized value of `weight` from its stored tensors (payload and sidecars by name)."""
    payload = tensors[weight.payload]
    side = {role: tensors[name] for role, name in weight.sidecars.items()}
    if weight.scheme == "fp8-block":
        return fp8_block(payload, side["scale"], weight.block, dtype)
    if weight.scheme in ("fp8-tensor", "fp8-channel"):
        return fp8_scaled(payload, side["scale"], dtype)
    if weight.scheme == "mxfp4":
        values = mxfp4(payload, side["scale"], dtype)
        # transformers' convert_moe_packed_tensors: `out.transpose(1, 2).contiguous()`
        return values.transpose(-2, -1).contiguous() if weight.transposed else values
    if weight.scheme == "mxfp8":
        return mxfp8(payload, side["scale"], dtype)
    if weight.scheme == "mxfp4-ct":
        # compressed-tensors' `[..., in/2]` bytes are gpt-oss's `[..., in/32, 16]` blocks
        return mxfp4(payload.reshape(*payload.shape[:-1], -1, 16), side["scale"], dtype)
    if weight.scheme == "mxfp8-ct":
        return mxfp8(payload.reshape(*payload.shape[:-1], -1, 32), side["scale"], dtype)
    if weight.scheme == "nvfp4":
        return nvfp4(payload, side["scale"], side["scale_2"], dtype, reciprocal=False)
    if weight.scheme == "nvfp4-ct":
        return nvfp4(payload, side["scale"], side["global"], dtype, reciprocal=True)
    raise ValueError(f"no dequantization for scheme {weight.scheme!r}")


def activation_scales(weight: QuantWeight) -> list[str]:
    """The stored names of `weight`'s activation scales (no part of its dequantized value)."""
    return [name for role, name in weight.sidecars.items() if role in ACTIVATION]


#: sidecars a weight needs before it can be dequantized
REQUIRED = {
    "fp8-block": ("scale",),
    "fp8-tensor": ("scale",),
    "fp8-channel": ("scale",),
    "mxfp4": ("scale",),
    "mxfp8": ("scale",),
    "mxfp4-ct": ("scale",),
    "mxfp8-ct": ("scale",),
    "nvfp4": ("scale", "scale_2"),
    "nvfp4-ct": ("scale", "global"),
}


class DequantizedView(Checkpoint):
    """A checkpoint seen as the plain checkpoint it dequantizes to: the entries a subclass
    names in `logical` are tensors of `dtype`, read dequantized by its `read_tensor`; every
    other entry is the base's own, read, copied and described by the base."""

    def __init__(self, base: Checkpoint, dtype: str, entries: list[Entry], dequantized: int):
        self.base = base
        self.dtype = dtype
        manifest = base.manifest
        super().__init__(
            base.source,
            Manifest(
                format=manifest.format,
                location=manifest.location,
                files=manifest.files,
                entries=entries,
                metadata=manifest.metadata,
                details={**manifest.details, "dequantized": dequantized},
            ),
        )

    @abstractmethod
    def dequantizes(self, name: str) -> bool:
        """Whether entry `name` is read dequantized (not the base's own)."""

    def read_object(self, name: str) -> Any:
        return self.base.read_object(name)

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        return self.base.iter_raw(name, block)

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        return None if self.dequantizes(name) else self.base.local_ranges(name)

    def model_metadata(self) -> dict[str, str] | None:
        return self.base.model_metadata()

    def recorded_architecture(self) -> str | None:
        return self.base.recorded_architecture()

    def tolerated_problems(self) -> list[Problem]:
        return self.base.tolerated_problems()

    def close(self) -> None:
        self.base.close()


def dequantized_entry(name: str, shape: list[int] | tuple[int, ...], dtype: str) -> Entry:
    """The entry of a weight read dequantized: a tensor of `dtype` and its logical shape."""
    return Entry(
        name=name,
        kind="tensor",
        dtype=dtype,
        shape=list(shape),
        nbytes=dtypes.numel(shape) * dtypes.itemsize(dtype),
    )


class DequantizedCheckpoint(DequantizedView):
    """A quantized checkpoint (FP8, MXFP4, NVFP4 weights with their scales) seen as the plain
    checkpoint it dequantizes to.

    Every quantized weight is one entry of `dtype` and its logical shape, in the payload's
    place; its scales are gone, and its activation scales too unless `keep_activation` (what
    `diff` compares: they are no part of the weight's value, but a static activation scale
    changes every output); every other entry is the source's own, still stored raw where it
    was (`activation` names the activation scales kept). Refuses (FormatError naming the
    weight) when a weight lacks a scale or has one of the wrong grid, since its values could
    not be right.
    """

    def __init__(
        self,
        base: Checkpoint,
        analysis: QuantAnalysis,
        dtype: str,
        *,
        keep_activation: bool = False,
    ):
        for weight in analysis.weights.values():
            lacking = [r for r in REQUIRED[weight.scheme] if r not in weight.sidecars]
            if lacking:
                raise FormatError(
                    f"quantized weight {weight.payload!r} has no {', '.join(lacking)} scale, so "
                    "it cannot be dequantized",
                    path=base.manifest.location,
                    fix="`ckpt verify` lists every missing sidecar; fetch or re-export them.",
                )
        for grid in analysis.grids:
            # the grid `verify` calls wrong (scale_grid): applied, the scales would land on
            # other blocks' values, or not fit at all
            raise FormatError(
                f"scale {grid.sidecar!r} of quantized weight {grid.weight!r} has shape "
                f"{grid.got}, but the scheme implies {grid.want}, so the weight cannot be "
                "dequantized",
                path=base.manifest.location,
                fix="The scales belong to another weight or were cut wrong; `ckpt verify` "
                "lists every such scale (scale_grid). Re-export the checkpoint.",
            )
        self.analysis = analysis
        self.logical: dict[str, QuantWeight] = {}
        self.activation: set[str] = set()
        entries: list[Entry] = []
        for entry in base.manifest.entries:
            owner = analysis.owner.get(entry.name)
            if owner is None:
                entries.append(entry)
                continue
            weight = analysis.weights[owner]
            if keep_activation and entry.name in activation_scales(weight):
                self.activation.add(entry.name)
                entries.append(entry)
                continue
            if entry.name != weight.payload:
                continue
            self.logical[weight.output] = weight
            entries.append(dequantized_entry(weight.output, weight.logical_shape, dtype))
        super().__init__(base, dtype, entries, len(self.logical))

    def dequantizes(self, name: str) -> bool:
        return name in self.logical

    def read_tensor(self, name: str) -> torch.Tensor:
        weight = self.logical.get(name)
        if weight is None:
            return self.base.read_tensor(name)
        stored = {member: self.base.read_tensor(member) for member in weight.members}
        return dequantize(weight, stored, self.dtype)

    def files_of(self, name: str) -> set[str]:
        """A dequantized weight is read from the files of its payload and scales."""
        weight = self.logical.get(name)
        if weight is None:
            return self.base.files_of(name)
        return set().union(*(self.base.files_of(member) for member in weight.members))


class BlockDequantizedCheckpoint(DequantizedView):
    """A checkpoint of a format's own block quantization (a GGUF's Q4_K, Q8_0... tensors,
    `Checkpoint.block_quantized`) seen as the plain checkpoint it dequantizes to.

    Each such entry becomes a tensor of `dtype` and its shape, read with the format's decoder
    (`read_dequantized`: float32, bit for bit gguf's `gguf.quants.dequantize`) and cast as
    `tensor.to(dtype)` casts; every other entry is the source's own. Refuses (FormatError
    naming the tensor and why) when one cannot be decoded, before anything is written.
    """

    def __init__(self, base: Checkpoint, dtype: str):
        blocks = base.block_quantized()
        refused = [(name, why) for name, why in blocks.items() if why is not None]
        if refused:
            name, why = refused[0]
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise FormatError(
                f"--dequantize: quantized tensor {name!r}{more} cannot be dequantized: {why}",
                path=base.manifest.location,
                fix="Leave it out (--filter-out), or dequantize with the format's own tools "
                "(for GGUF, llama.cpp's `llama-quantize --allow-requantize SRC OUT F16`).",
            )
        #: dequantized entry -> its scheme (`gguf-Q4_K`), as `diff` reports it
        self.logical: dict[str, str] = {}
        entries: list[Entry] = []
        for entry in base.manifest.entries:
            if entry.name not in blocks:
                entries.append(entry)
                continue
            self.logical[entry.name] = f"{base.manifest.format}-{entry.dtype}"
            entries.append(dequantized_entry(entry.name, entry.shape, dtype))
        super().__init__(base, dtype, entries, len(self.logical))

    def dequantizes(self, name: str) -> bool:
        return name in self.logical

    def read_tensor(self, name: str) -> torch.Tensor:
        if name not in self.logical:
            return self.base.read_tensor(name)
        values = self.base.read_dequantized(name)
        return values.to(_dtype(self.dtype))

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """A box of a tensor; one expert of a dequantized stack decodes only its own blocks
        (each expert of a 128-expert stack decoding the whole stack took 128 times the work)."""
        if name not in self.logical:
            return self.base.read_slice(name, offsets, sizes)
        slab = leading_slab(self.base.manifest.by_name[name].shape, offsets, sizes)
        if slab is None:
            return super().read_slice(name, offsets, sizes)
        return self.base.read_dequantized(name, slab).to(_dtype(self.dtype))

    def files_of(self, name: str) -> set[str]:
        return self.base.files_of(name)


def scale_value_problems(checkpoint: Checkpoint, analysis: QuantAnalysis) -> list[Problem]:
    """`verify --deep`: every scale finite and positive; global-scale conventions plausible.

    Reads the sidecars only (a small fraction of the checkpoint). A ModelOpt `weight_scale_2`
    above 1, or a compressed-tensors `weight_global_scale` below 1, means weights larger than
    6 x 448 in absolute value: far likelier the other convention's reciprocal was stored.
    """
    import torch

    problems: list[Problem] = ProblemList()  # bounded: see `ProblemList`
    where = checkpoint.manifest.location
    for weight in analysis.weights.values():
        for role, name in weight.sidecars.items():
            tensor = checkpoint.read_tensor(name)
            if tensor.dtype == torch.uint8 or tensor.dtype == getattr(
                torch, "float8_e8m0fnu", None
            ):
                bad = int((tensor.view(torch.uint8) == 255).sum())  # E8M0's NaN
                if bad:
                    problems.append(
                        Problem(
                            code="bad_scale",
                            message=f"{where}: scale {name!r} of {weight.payload!r} holds {bad} "
                            "NaN exponents (0xFF)",
                            file=where,
                            tensor=name,
                            fix="Re-export the checkpoint.",
                        )
                    )
                continue
            values = tensor.to(torch.float32)
            nonfinite = int((~torch.isfinite(values)).sum())
            nonpositive = int((values <= 0).sum())
            if nonfinite or (nonpositive and role not in ("input", "input_global")):
                problems.append(
                    Problem(
                        code="bad_scale",
                        message=f"{where}: scale {name!r} of {weight.payload!r} holds "
                        f"{nonfinite} non-finite and {nonpositive} zero or negative values (of "
                        f"{values.numel()}). Dequantized, those weights are wrong",
                        file=where,
                        tensor=name,
                        fix="Re-export the checkpoint.",
                    )
                )
                continue
            if role in ("scale_2", "global") and values.numel() == 1:
                value = float(values.reshape(()))
                flipped = value > 1.0 if role == "scale_2" else value < 1.0
                if flipped:
                    other = "weight_global_scale" if role == "scale_2" else "weight_scale_2"
                    problems.append(
                        Problem(
                            code="reciprocal_scale",
                            message=f"{where}: {name!r} is {value:g}, which looks like a "
                            f"{other} (the reciprocal convention): dequantized, "
                            f"{weight.payload!r} would be off by a factor of about "
                            f"{max(value, 1 / value) ** 2:.3g}",
                            file=where,
                            tensor=name,
                            severity="warning",
                            fix="Check how the scale was converted.",
                        )
                    )
    return problems
