"""Quantized checkpoints: which weights are quantized, how, and whether their scales are right.

Recognition reads tensor names, dtypes and shapes (from the manifest, or from the headers a
structural check parsed: `analyse_tensors`) plus the checkpoint's own
`config.json` (`quantization_config`) and ModelOpt's `hf_quant_config.json`: never tensor data,
never torch, so `inspect` and plain `verify` stay metadata-only. The schemes:

| scheme | payload | sidecars (per module) | grid the scheme implies |
|---|---|---|---|
| `fp8-block` | `*.weight` F8_E4M3 `[..., o, i]` | `weight_scale_inv` (DeepSeek/Qwen) or `weight_scale` (compressed-tensors) | `[..., ceil(o/bo), ceil(i/bi)]`, `weight_block_size` (128x128) |
| `fp8-channel` / `fp8-tensor` | `*.weight` F8 | `weight_scale_inv`, `weight_scale` or `scale_weight` (diffusion) | `[o, 1]` / one value |
| `mxfp4` / `mxfp8` | `*_blocks` U8 (two E2M1 a byte) / F8 `[..., G, B]` | `*_scales` E8M0 (often U8) | `[..., G]`, 32 values a group |
| `nvfp4` (ModelOpt) | `*.weight` U8 `[o, i/2]` | `weight_scale` F8_E4M3 `[o, i/16]`, `weight_scale_2` F32 | `weight_scale_2` one value |
| `nvfp4-ct` (compressed-tensors) | `*.weight_packed` U8 `[o, i/2]` | `weight_scale` F8_E4M3 `[o, i/16]`, `weight_global_scale` F32 `[1]` | global scale the reciprocal of ModelOpt's |
| `mxfp4-ct` / `mxfp6-ct` / `mxfp8-ct` (compressed-tensors) | `*.weight_packed` U8 `[..., i/2]` / U8 `[..., i*3/4]` / `*.weight` F8 `[..., i]` | `weight_scale` E8M0 (U8) | `[..., i/32]` |
| `int{bits}-ct-packed` (compressed-tensors `pack-quantized`) | `*.weight_packed` I32 `[..., ceil(i*bits/32)]` | `weight_scale`, `weight_shape`, `weight_zero_point` (asymmetric), `weight_g_idx` (activation order) | `[1]`, `[..., 1]` or `[..., i/group]` |
| `int8-ct` (compressed-tensors `int-quantized`) | `*.weight` I8 `[..., i]` | `weight_scale`, `weight_zero_point` | as above |

Packed schemes are recognised but not dequantized, their tensors kept as stored, together and
never cast (`QuantAnalysis.packed`): GPTQ / AWQ (`qweight`, `qzeros`, `scales`, `g_idx`),
bitsandbytes (a U8 / I8 `weight` with `weight.absmax`, `weight.quant_map`,
`weight.quant_state.bitsandbytes__*` / `SCB`).

The scheme models and config reading live in `quant.schemes`, recognition per scheme family in
`quant.recognise`, the sidecar, grid and config checks in `quant.checks`; dequantization (torch,
one weight and its sidecars at a time) in `quant.dequant`.
"""

from __future__ import annotations

from .recognise import analyse, analyse_checkpoint, analyse_tensors, parameter_counter
from .schemes import (
    QuantAnalysis,
    QuantConfig,
    QuantGroup,
    QuantSummary,
    QuantWeight,
    entry_parameters,
    ignored,
    label,
    logical_dtype,
    prefetch_config,
    quantization_only_file,
    read_config,
    sidecar_names,
    summarise,
    with_sidecars,
    without_quantization,
)

__all__ = [
    "QuantAnalysis",
    "QuantConfig",
    "QuantGroup",
    "QuantSummary",
    "QuantWeight",
    "analyse",
    "analyse_checkpoint",
    "analyse_tensors",
    "entry_parameters",
    "ignored",
    "label",
    "logical_dtype",
    "parameter_counter",
    "prefetch_config",
    "quantization_only_file",
    "read_config",
    "sidecar_names",
    "summarise",
    "with_sidecars",
    "without_quantization",
]
