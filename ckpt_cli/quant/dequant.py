"""Dequantization: one quantized weight and its scales in, one plain tensor out.

Each function follows the scheme's published formula, in the operation order of the reference
implementation, so results are bit-identical to it: torch's
`QuantizedHuggingFaceStorageReader` for block FP8 and MXFP4, compressed-tensors'
`NVFP4PackedCompressor.decompress` for its NVFP4, ModelOpt's `fp4 * (weight_scale *
weight_scale_2)` for ModelOpt NVFP4, compressed-tensors' `dequantize` for its integer formats. Work is done in row chunks, so the temporaries stay a
fraction of the weight: peak memory is the quantized weight, its scales and the output.

`DequantizedCheckpoint` wraps an opened checkpoint: its manifest lists dequantized weights in
place of payload + sidecars, and `read_tensor` dequantizes on the fly, so `convert` and `diff`
stream a quantized checkpoint through their usual one-tensor-at-a-time pipelines.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import FormatError
from ..formats.base import Checkpoint, leading_slab
from ..models import Entry, Manifest, Problem, ProblemList
from ..storage.fileio import COPY_BLOCK
from .schemes import ACTIVATION, INT_CT_PACKED, QuantAnalysis, QuantWeight, label

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


#: E2M3 magnitudes by 5-bit code (OCP MX FP6; the sign is bit 5), as compressed-tensors
#: reads them
E2M3_VALUES = [m / 8 for m in range(8)] + [(1 + m / 8) * 2**e for e in range(3) for m in range(8)]


def mxfp6(packed: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """compressed-tensors' MXFP6 (`mxfp6-pack-quantized`): `[..., in*3/4]` bytes, four E2M3
    codes in three (little-endian, the first in the low bits), times their E8M0 group scale
    `[..., in/32]`; computed as `MXFP6PackedCompressor.decompress` does, in bfloat16 (exact
    E2M3 values times `2.0 ** exponent`), then cast to `dtype`."""
    import torch

    target = _dtype(dtype)
    *prefix, width = packed.shape
    rows, cols = math.prod(prefix), width * 4 // 3
    flat = packed.reshape(rows, width // 3, 3)
    factor = (2.0 ** _exponents(scales).to(torch.bfloat16)).reshape(rows, -1, 1)
    lut = torch.tensor(E2M3_VALUES, dtype=torch.float32)
    out = torch.empty(rows, cols, dtype=target)
    for r0 in range(0, rows, ROWS):
        r1 = min(r0 + ROWS, rows)
        b = flat[r0:r1].to(torch.int32)
        word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
        codes = torch.stack([word >> shift & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
        magnitude = lut[codes & 0x1F]
        values = torch.where(codes & 0x20 != 0, -magnitude, magnitude).to(torch.bfloat16)
        values = values.reshape(r1 - r0, -1, 32) * factor[r0:r1]
        out[r0:r1] = values.reshape(r1 - r0, cols).to(target)
    return out.reshape(*prefix, cols)


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


def unpack_int32(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """compressed-tensors' `pack_to_int32` undone: `[rows, words]` int32 -> `[rows, cols]`
    int8 values. Value `i` of a row is the row's bits `i*bits ..` (low bits first, words in
    order), offset by `2^(bits-1)`. For `bits` dividing 32 (1, 2, 4, 8) this is also every
    earlier compressed-tensors' packing (`32 / bits` values a word), so only those are read."""
    import sys

    import torch

    raw = words.contiguous().view(torch.uint8).reshape(words.shape[0], -1, 4)
    if sys.byteorder == "big":
        raw = raw.flip(-1)  # a word's bytes, least significant first
    raw = raw.reshape(words.shape[0], -1)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    values = (raw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(words.shape[0], raw.shape[1] * per)[:, :cols]
    return (values.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def int_ct(
    payload: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    layout: IntLayout,
    dtype: str,
) -> torch.Tensor:
    """compressed-tensors' integer weights, as its `dequantize` computes them: in the
    scale's dtype, `(q - zero_point) * scale` with the scale of the value's tensor, channel
    or group (`g_idx[column]` under activation ordering, as compressed-tensors' permuted
    groups amount to), then cast to `dtype`. `layout` is what `int_layout` checked."""
    import torch

    *lead, cols = layout.shape
    rows = math.prod(lead)
    target = _dtype(dtype)
    flat = payload.reshape(rows, -1)
    unit = scale.dtype
    factor = scale.reshape(()) if layout.groups == 0 else scale.reshape(rows, -1)
    zero = None
    if zero_point is not None:
        zero = zero_point.reshape(()) if layout.groups == 0 else _zero_points(zero_point, layout)
    column_group = None
    if layout.groups > 1:
        column_group = (
            g_idx.to(torch.long)
            if g_idx is not None and layout.ordered
            else torch.arange(cols) // (cols // layout.groups)
        )
    out = torch.empty(rows, cols, dtype=target)
    for r0 in range(0, rows, ROWS):
        r1 = min(r0 + ROWS, rows)
        codes = flat[r0:r1]
        if layout.packed:
            codes = unpack_int32(codes, layout.bits, cols)
        values = codes.to(unit)
        per = factor if factor.dim() == 0 else factor[r0:r1]
        zp = zero if zero is None or zero.dim() == 0 else zero[r0:r1]
        if column_group is not None:
            per = per.index_select(1, column_group)
            zp = zp.index_select(1, column_group) if zp is not None else None
        if zp is not None:
            values = values - zp.to(unit)
        out[r0:r1] = (values * per).to(target)
    return out.reshape(layout.shape)


def _zero_points(zero_point: torch.Tensor, layout: IntLayout) -> torch.Tensor:
    """The zero points `[rows, groups]`: int8 as stored, or unpacked from the int32 words
    compressed-tensors packs them in along the output dimension (per matrix)."""
    import torch

    out_rows = layout.shape[-2]
    groups = max(layout.groups, 1)
    if zero_point.dtype != torch.int32:
        return zero_point.reshape(-1, groups)
    mats = zero_point.reshape(-1, *zero_point.shape[-2:])
    unpacked = [
        unpack_int32(m.transpose(0, 1), layout.bits, out_rows).transpose(0, 1) for m in mats
    ]
    return torch.cat(unpacked).reshape(-1, groups)


@dataclass(frozen=True)
class IntLayout:
    """A compressed-tensors integer weight as its stored tensors' values say (`int_layout`).

    Attributes:
        shape: the dequantized shape (`weight_shape`'s value for a packed weight).
        bits: bits a value (8 for `int-quantized`).
        packed: the payload is `pack-quantized` int32 words.
        groups: scales a row: 0 per tensor, 1 per channel, more per group.
        ordered: a `g_idx` assigns columns to groups (activation ordering).
    """

    shape: tuple[int, ...]
    bits: int
    packed: bool
    groups: int
    ordered: bool


def int_layout(
    weight: QuantWeight,
    tensors: dict[str, torch.Tensor],
    payload_shape: list[int],
    scale_shape: list[int],
    payload_dtype: str = "int32",
) -> IntLayout:
    """Check a compressed-tensors integer weight against its small stored tensors
    (`weight_shape`, `weight_g_idx`, `weight_zero_point`; payload and scale by shape):
    ValueError, saying why, when compressed-tensors could not dequantize it either or ckpt
    cannot match it bit for bit."""
    import torch

    packed = INT_CT_PACKED.fullmatch(weight.scheme) is not None
    bits = int(weight.scheme[3]) if packed else 8
    if packed and payload_dtype != "int32":
        raise ValueError(
            f"its packed values are {payload_dtype}; compressed-tensors packs them in int32 words"
        )
    if packed:
        stored = tensors.get(weight.sidecars.get("shape", ""))
        if stored is None or stored.dim() != 1 or stored.is_floating_point():
            raise ValueError("its weight_shape is missing or no list of sizes")
        shape = tuple(int(v) for v in stored.tolist())
        if len(shape) != len(payload_shape) or list(shape[:-1]) != payload_shape[:-1]:
            raise ValueError(
                f"its weight_shape {list(shape)} does not fit the packed {payload_shape}"
            )
        if 32 % bits:
            raise ValueError(
                f"its values are {bits}-bit, whose packing changed between compressed-tensors "
                "versions; ckpt reads 1, 2, 4 and 8-bit packing only"
            )
        needed = math.ceil(shape[-1] * bits / 32)
        if needed != payload_shape[-1]:
            raise ValueError(
                f"its weight_shape {list(shape)} needs {needed} int32 words a row at {bits} "
                f"bits, and the packed weight has {payload_shape[-1]} (a wrong weight_shape, "
                "or the config's num_bits is not the one it was packed with)"
            )
    else:
        shape = tuple(payload_shape)
    *lead, cols = shape
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 1:
        groups = 0
    elif list(scale_shape[:-1]) == lead and scale_shape[-1] >= 1 and cols % scale_shape[-1] == 0:
        groups = scale_shape[-1]
    else:
        raise ValueError(
            f"its scale {scale_shape} is no per-tensor, per-channel or per-group grid of "
            f"{list(shape)} (compressed-tensors needs the input size a multiple of the group size)"
        )
    _check_zero_points(tensors.get(weight.sidecars.get("zero_point", "")), shape, bits, groups)
    ordered = False
    g_idx = tensors.get(weight.sidecars.get("g_idx", ""))
    if g_idx is not None and groups > 1:
        if g_idx.dim() != 1 or g_idx.numel() != cols or g_idx.is_floating_point():
            raise ValueError(
                f"its g_idx {list(g_idx.shape)} {str(g_idx.dtype).removeprefix('torch.')} is "
                f"no integer group index for each of its {cols} input columns"
            )
        # compressed-tensors reads a g_idx holding -1 (never filled in) as column order
        if not bool((g_idx == -1).any()):
            # it sorts the columns by g_idx and cuts them in groups of `group_size`: the
            # same as `scale[:, g_idx]` only when each group has that many columns
            index = g_idx.to(torch.long)
            valid = int(index.min()) >= 0 and int(index.max()) < groups
            counts = torch.bincount(index.clamp(0, groups - 1), minlength=groups)
            if not valid or bool((counts != cols // groups).any()):
                raise ValueError(
                    f"its g_idx is no activation order of {groups} groups of "
                    f"{cols // groups} columns each"
                )
            ordered = True
    return IntLayout(shape, bits, packed, groups, ordered)


def _check_zero_points(
    zero: torch.Tensor | None, shape: tuple[int, ...], bits: int, groups: int
) -> None:
    """ValueError unless `zero` (a weight's `weight_zero_point`, if any) has the shape its
    strategy stores: one value per tensor, else one per row and group, as int8 or packed in
    int32 words along the output dimension (compressed-tensors' `pack-quantized`)."""
    import torch

    if zero is None:
        return
    *lead, _ = shape
    if groups == 0:
        want = "one value"
        fits = zero.numel() == 1
    elif zero.dtype == torch.int32:
        packed = [*lead[:-1], math.ceil(lead[-1] * bits / 32), groups]
        want, fits = str(packed), list(zero.shape) == packed
    else:
        want = f"{[*lead, groups]}"
        fits = zero.numel() == math.prod(lead) * groups
    if not fits or zero.is_floating_point():
        raise ValueError(
            f"its weight_zero_point {list(zero.shape)} "
            f"{str(zero.dtype).removeprefix('torch.')} is not the integer {want} its scales "
            "imply"
        )


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
    if weight.scheme == "mxfp6-ct":
        return mxfp6(payload, side["scale"], dtype)
    if weight.scheme == "mxfp8-ct":
        return mxfp8(payload.reshape(*payload.shape[:-1], -1, 32), side["scale"], dtype)
    if weight.scheme == "nvfp4":
        return nvfp4(payload, side["scale"], side["scale_2"], dtype, reciprocal=False)
    if weight.scheme == "nvfp4-ct":
        return nvfp4(payload, side["scale"], side["global"], dtype, reciprocal=True)
    if weight.scheme == "int8-ct" or INT_CT_PACKED.fullmatch(weight.scheme):
        layout = int_layout(
            weight,
            tensors,
            list(payload.shape),
            list(side["scale"].shape),
            str(payload.dtype).removeprefix("torch."),
        )
        return int_ct(
            payload, side["scale"], side.get("zero_point"), side.get("g_idx"), layout, dtype
        )
    raise ValueError(f"no dequantization for scheme {weight.scheme!r}")


def _int_shape(base: Checkpoint, weight: QuantWeight) -> list[int]:
    """A compressed-tensors integer weight's exact shape, from its `weight_shape` (an
    int4 row's words hold up to 8 values more than it has): its small tensors read and
    checked now, so a weight that cannot be dequantized is refused before anything is
    written."""
    by_name = base.manifest.by_name
    small = {
        name: base.read_tensor(name)
        for role, name in weight.sidecars.items()
        if role in ("shape", "g_idx", "zero_point")
    }
    try:
        layout = int_layout(
            weight,
            small,
            list(by_name[weight.payload].shape),
            list(by_name[weight.sidecars["scale"]].shape),
            by_name[weight.payload].dtype or "",
        )
    except ValueError as why:
        raise FormatError(
            f"quantized weight {weight.payload!r} ({label(weight.scheme, weight.block)}) "
            f"cannot be dequantized: {why}",
            path=base.manifest.location,
            fix="Dequantize it with compressed-tensors itself (transformers' "
            "`from_pretrained(..., quantization_config=CompressedTensorsConfig("
            "run_compressed=False))` then `save_pretrained`), or leave --dequantize out "
            "to keep it as stored.",
        ) from None
    return list(layout.shape)


def _is_int(weight: QuantWeight) -> bool:
    """Whether `weight` is one of compressed-tensors' integer weights."""
    return weight.scheme == "int8-ct" or INT_CT_PACKED.fullmatch(weight.scheme) is not None


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
    "mxfp6-ct": ("scale",),
    "mxfp8-ct": ("scale",),
    "nvfp4": ("scale", "scale_2"),
    "nvfp4-ct": ("scale", "global"),
    "int8-ct": ("scale",),
}


def required(scheme: str) -> tuple[str, ...]:
    """The sidecars a weight of `scheme` needs before it can be dequantized."""
    if INT_CT_PACKED.fullmatch(scheme):
        return ("scale", "shape")
    return REQUIRED[scheme]


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

    def metadata_left_out(self, written: Mapping[str, str] | None = None) -> list[str]:
        return self.base.metadata_left_out(written)

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
    """A quantized checkpoint (FP8, MXFP4, NVFP4, compressed-tensors INT4/INT8 weights with
    their scales) seen as the plain checkpoint it dequantizes to.

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
            lacking = [r for r in required(weight.scheme) if r not in weight.sidecars]
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
        exact = {w.output: _int_shape(base, w) for w in analysis.weights.values() if _is_int(w)}
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
            if weight.output in exact:
                weight = replace(weight, logical_shape=exact[weight.output])
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


#: sidecar roles that hold no scale (compressed-tensors' integer zero points, group order
#: and logical shape): `scale_value_problems` leaves them alone (a zero point of 0 is right)
_NOT_SCALES = ("zero_point", "g_idx", "shape", "input_zero_point")


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
            if role in _NOT_SCALES:
                continue
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
