"""Recognition of quantized weights, one function per scheme family, from the headers only.

Each recogniser claims a payload with its sidecars and records, through `checks.Checks`, what
is wrong with them; `analyse` runs them over every tensor, then the orphan and config checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..dtypes import FLOATING
from ..models import DTYPE, SHAPE, Entry, Manifest, TensorFacts
from ..storage import Storage
from .checks import (
    Checks,
    check_config,
    check_nvfp4,
    check_orphans,
    fp8_grid,
    fp8_siblings,
    infer_block,
    name_files,
)
from .schemes import (
    BNB_4BIT,
    BNB_4BIT_STATES,
    BNB_4BIT_SUFFIXES,
    BNB_8BIT,
    BNB_8BIT_SUFFIXES,
    FP8,
    PACKED_REQUIRED,
    PACKED_SCHEMES,
    PACKED_SUFFIXES,
    SCALE_DTYPES,
    SIDECAR_SUFFIXES,
    QuantAnalysis,
    QuantConfig,
    QuantWeight,
    config_families,
    ct_weight_args,
    entry_parameters,
    ignored,
    label,
    read_config,
)

#: the dtypes of every payload a recogniser claims (FP8, packed FP4 and MX blocks in uint8)
_PAYLOAD_DTYPES = FP8 | {"uint8"}
#: the name endings `_packed` looks at: any other name is passed over at C speed (#30)
_PACKED_ENDINGS = (".qweight", ".SCB", ".weight_packed", *BNB_4BIT_STATES)
#: activation scales a weight may carry (kept with it)
_ACTIVATION = {"input": ".input_scale", "input_global": ".input_global_scale"}


@dataclass
class _Recognition:
    """What the recognisers share: the checks being built and what the config expects."""

    checks: Checks
    config: QuantConfig
    block: tuple[int, int] | None
    expects: set[str]
    fp8_scaled_elsewhere: bool


def analyse(manifest: Manifest, config: QuantConfig, where: str | None = None) -> QuantAnalysis:
    """Recognise every quantized weight of `manifest` and check its sidecars from headers
    (`analyse_tensors` of its tensor entries)."""
    tensors = {e.name: (e.dtype, e.shape, e.file) for e in manifest.entries if e.kind == "tensor"}
    return analyse_tensors(tensors, config, where or manifest.location)


def analyse_tensors(
    tensors: Mapping[str, TensorFacts], config: QuantConfig, where: str
) -> QuantAnalysis:
    """Recognise every quantized weight among `tensors` (name -> dtype, shape, file) and check
    its sidecars; problems name `where` (the checkpoint) and the file holding the tensor.

    Problems (each names the tensor and the sidecar): `missing_scale`, `scale_grid`,
    `scale_dtype`, `orphan_scale`, `config_mismatch`.
    """
    out = QuantAnalysis(config=config)
    checks = Checks(where, tensors, out)
    _packed(out, tensors, config)
    if _packed_states(checks):
        name_files(out.problems, tensors, where)
    families = config_families(config)
    if families is None and not _may_hold_quantized(tensors):
        # every recogniser needs a payload dtype, the orphan check a scale's name, the config
        # check a declared scheme: none here, so nothing to find (#30: one cheap pass)
        return out
    block: tuple[int, int] | None = (config.block[0], config.block[1]) if config.block else None
    r = _Recognition(checks, config, block, families or set(), fp8_siblings(tensors))
    # --- payloads with their sidecars
    for name, tensor in tensors.items():
        _recognise(r, name, tensor)
    # --- scales no weight owns, then the config against the headers
    check_orphans(checks)
    check_config(checks, config, families)
    return out


def _packed(out: QuantAnalysis, tensors: Mapping[str, TensorFacts], config: QuantConfig) -> None:
    """Modules of a packed scheme ckpt does not dequantize: GPTQ, AWQ (a `.qweight` where the
    config declares the scheme, or beside its `.qzeros`: no other checkpoint names tensors
    so) and bitsandbytes (a `.weight` beside its `quant_state.bitsandbytes__*`, or an int8
    `.weight` beside its `SCB`)."""
    method = (config.method or "").lower()
    declared = PACKED_SCHEMES.get(method)
    for name in [name for name in tensors if name.endswith(_PACKED_ENDINGS)]:
        if name.endswith(".qweight"):
            module = name[: -len(".qweight")]
            suffixes = declared or (PACKED_SUFFIXES if module + ".qzeros" in tensors else None)
            if suffixes is not None:
                names = [module + s for s in suffixes if module + s in tensors]
                out.add_packed(module, method if declared else "GPTQ/AWQ", names)
            continue
        state = next((s for s in BNB_4BIT_STATES if name.endswith(s)), None)
        payload = ".weight"
        if state is not None:
            module, scheme, suffixes = name[: -len(state)], BNB_4BIT, BNB_4BIT_SUFFIXES
        elif name.endswith(".SCB"):
            module, scheme, suffixes = name[: -len(".SCB")], BNB_8BIT, BNB_8BIT_SUFFIXES
            if _dtype(tensors, module + ".weight") != "int8":
                continue
        else:
            continue
        if module + payload in tensors and module not in out.packed:
            out.add_packed(module, scheme, [module + s for s in suffixes if module + s in tensors])


def _packed_states(checks: Checks) -> bool:
    """A `missing_scale` problem for each packed weight that lacks a tensor its codes cannot
    be read without (`PACKED_REQUIRED`); whether any was found."""
    out = checks.out
    found = False
    for module, scheme in out.packed_scheme.items():
        names = out.packed[module]
        required = PACKED_REQUIRED.get(scheme, PACKED_REQUIRED["gptq"])
        for suffix in required:
            if module + suffix in names:
                continue
            found = True
            checks.add(
                "missing_scale",
                names[0],
                f"quantized weight {names[0]!r} ({scheme}) has no {module + suffix!r}: its "
                "codes cannot be read without it",
                "Fetch or re-export the shard holding it; do not load this checkpoint.",
            )
    return found


def _dtype(tensors: Mapping[str, TensorFacts], name: str) -> str | None:
    held = tensors.get(name)
    return held[DTYPE] if held is not None else None


def _ct_int_packed(tensors: Mapping[str, TensorFacts], module: str, config: QuantConfig) -> bool:
    """Whether `module.weight_packed` is compressed-tensors' int4/int8 packing, not its NVFP4
    (uint8 codes with an FP8 group scale, or declared `nvfp4-pack-quantized`)."""
    if _dtype(tensors, module + ".weight_packed") != "uint8":
        return True
    if (config.algo or "") == "nvfp4-pack-quantized":
        return False
    scale = _dtype(tensors, module + ".weight_scale")
    return scale is not None and scale not in SCALE_DTYPES["group_scale"]


def _ct_mx_packed(
    tensors: Mapping[str, TensorFacts], module: str, config: QuantConfig
) -> str | None:
    """Which of compressed-tensors' MX formats `module.weight_packed` is: `mxfp4-ct` (two E2M1
    codes a byte), `mxfp6-ct` (four E2M3 codes in three bytes), None when it is none (its
    scale is no E8M0 exponent). The config's format says which; without it, the bytes per
    group of 32 values do (16 or 24)."""
    packed = tensors.get(module + ".weight_packed")
    scale = tensors.get(module + ".weight_scale")
    if packed is None or packed[DTYPE] != "uint8":
        return None
    algo = config.algo or ""
    if algo == "mxfp4-pack-quantized":
        return "mxfp4-ct"
    if algo == "mxfp6-pack-quantized":
        return "mxfp6-ct"
    if scale is None or scale[DTYPE] not in SCALE_DTYPES["mx_scale"]:
        return None
    packed_shape, scale_shape = list(packed[SHAPE]), list(scale[SHAPE])
    if packed_shape and scale_shape and packed_shape[-1] == 24 * scale_shape[-1]:
        return "mxfp6-ct"
    if packed_shape and scale_shape and packed_shape[-1] == 16 * scale_shape[-1]:
        return "mxfp4-ct"
    return None


def _may_hold_quantized(tensors: Mapping[str, TensorFacts]) -> bool:
    """Whether some tensor has a quantized payload's dtype or a scale's name."""
    return any(
        dtype in _PAYLOAD_DTYPES or name.endswith(SIDECAR_SUFFIXES)
        for name, (dtype, _, _) in tensors.items()
    )


def analyse_checkpoint(
    manifest: Manifest, storage: Storage, where: str | None = None
) -> QuantAnalysis:
    """`analyse` with the config files read from the checkpoint's root."""
    return analyse(manifest, read_config(storage), where)


def parameter_counter(
    manifest: Manifest, storage: Storage, analysis: QuantAnalysis | None = None
) -> Callable[[Entry], int]:
    """`entry_parameters` of the checkpoint's entries: the parameters each one counts for,
    its quantization analysed once (`analysis` when the caller holds it already), so any
    selection of entries (a `--filter`, a training layout's `model.` component) is counted by
    the same rule as the whole checkpoint."""
    if analysis is None:
        analysis = analyse_checkpoint(manifest, storage)
    if not (analysis.owner or analysis.packed_owner or analysis.orphans):
        # nothing quantized (the common case): every floating tensor counts its elements, as
        # `entry_parameters` would say, without its lookups (#30: per-tensor cost)
        return _floating_elements
    tensors = {e.name: e for e in manifest.entries if e.kind == "tensor"}
    held, orphans = analysis, frozenset(analysis.orphans)

    def count(entry: Entry) -> int:
        return entry_parameters(entry, held, tensors, orphans)

    return count


def _floating_elements(entry: Entry) -> int:
    """The elements of a floating tensor entry; 0 for any other (`entry_parameters` of a
    checkpoint holding nothing quantized)."""
    return entry.numel if entry.kind == "tensor" and entry.dtype in FLOATING else 0


def _recognise(r: _Recognition, name: str, tensor: TensorFacts) -> None:
    """Hand one tensor to the recogniser of the scheme family its name and dtype point to."""
    if name.endswith("_blocks") and "_blocks" not in name[:-7]:
        _mx(r, name, tensor)
        return
    if name.endswith(".weight_packed"):
        _nvfp4_ct(r, name, tensor)
        return
    if not name.endswith(".weight"):
        return
    module = name[: -len(".weight")]
    if (
        tensor[DTYPE] == "int8"
        and module + ".weight_scale" in r.checks.tensors
        and module not in r.checks.out.packed
    ):
        _int_ct(r, name, module, packed=False)
        return
    if tensor[DTYPE] in FP8:
        _fp8(r, name, module, tensor)
        return
    if tensor[DTYPE] == "uint8" and len(list(tensor[SHAPE])) == 2:
        _nvfp4(r, name, module, tensor)


#: gpt-oss's MXFP4 stacked experts (`model.layers.N.mlp.experts.*`), stored `[E, out, in]`
GPT_OSS_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _mx(r: _Recognition, name: str, tensor: TensorFacts) -> None:
    """MXFP4 / MXFP8: `*_blocks` payloads with `*_scales`, 32 values a group."""
    ck, tensors = r.checks, r.checks.tensors
    base = name[: -len("_blocks")]
    scales = base + "_scales"
    shape = list(tensor[SHAPE])
    scheme = "mxfp4" if tensor[DTYPE] == "uint8" else "mxfp8" if tensor[DTYPE] in FP8 else None
    if scheme is None or len(shape) < 2:
        return
    per = shape[-1] * (2 if scheme == "mxfp4" else 1)
    logical = [*shape[:-2], shape[-2] * per]
    # gpt-oss's stacked experts: transformers' GptOss holds them [E, in, out]
    transposed = scheme == "mxfp4" and len(logical) == 3 and base.endswith(GPT_OSS_EXPERTS)
    weight = QuantWeight(
        module=base.rsplit(".", 1)[0] if "." in base else base,
        scheme=scheme,
        payload=name,
        output=base,
        sidecars={},
        logical_shape=[logical[0], logical[2], logical[1]] if transposed else logical,
        block=(1, per),
        transposed=transposed,
    )
    if scales not in tensors:
        ck.missing(name, scales, scheme)
    else:
        weight.sidecars["scale"] = scales
        if list(tensors[scales][SHAPE]) != shape[:-1]:
            ck.grid_problem(
                name, scales, list(tensors[scales][SHAPE]), f"{shape[:-1]} (one per group)"
            )
        ck.check_dtype(name, {"scale": scales}, {"scale": "mx_scale"})
        if per != 32:
            ck.grid_problem(name, scales, list(tensors[scales][SHAPE]), "groups of 32 values")
    ck.claim(weight)


def _mx_ct(r: _Recognition, name: str, module: str, scheme: str, scale: str) -> None:
    """MXFP4 / MXFP6 / MXFP8 as compressed-tensors writes them: `weight_packed` uint8
    `[..., in/2]` (two E2M1 codes a byte, low nibble first) or `[..., in*3/4]` (four E2M3
    codes in three bytes, little-endian), or an FP8 `weight` `[..., in]`, with an E8M0
    `weight_scale` `[..., in/32]` (uint8 exponents): gpt-oss's MX, under other names."""
    ck, tensors = r.checks, r.checks.tensors
    shape = list(tensors[name][SHAPE])
    if not shape:
        return
    # values a byte: two E2M1 codes (MXFP4), four E2M3 codes in three bytes (MXFP6), one FP8
    values, per_bytes = {"mxfp4-ct": (2, 1), "mxfp6-ct": (4, 3)}.get(scheme, (1, 1))
    logical = [*shape[:-1], shape[-1] * values // per_bytes]
    weight = QuantWeight(
        module=module,
        scheme=scheme,
        payload=name,
        output=module + ".weight",
        sidecars={"scale": scale, **ck.optional(module, _ACTIVATION)},
        logical_shape=logical,
        block=(1, 32),
    )
    if scale not in tensors:
        del weight.sidecars["scale"]
        ck.missing(name, scale, scheme)
        ck.claim(weight)
        return
    got = list(tensors[scale][SHAPE])
    want = [*logical[:-1], logical[-1] // 32]
    if logical[-1] % 32 or shape[-1] % per_bytes or got != want:
        ck.grid_problem(name, scale, got, f"{want} (one per 32 values)")
    ck.check_dtype(name, {"scale": scale}, {"scale": "mx_scale"})
    ck.check_dtype(name, weight.sidecars, {"input_global": "global"})
    ck.claim(weight)


def _nvfp4_ct(r: _Recognition, name: str, tensor: TensorFacts) -> None:
    """NVFP4 as compressed-tensors writes it: `weight_packed` with a global scale."""
    ck, tensors = r.checks, r.checks.tensors
    module = name[: -len(".weight_packed")]
    shape = list(tensor[SHAPE])
    mx = _ct_mx_packed(tensors, module, r.config)
    if mx is not None and len(shape) >= 2:
        # stacked experts `[E, out, in/2]` too: one `[out, in/2]` weight each
        _mx_ct(r, name, module, mx, module + ".weight_scale")
        return
    if mx is None and _ct_int_packed(tensors, module, r.config):
        _int_ct(r, name, module, packed=True)
        return
    if mx is not None or tensor[DTYPE] != "uint8" or len(shape) != 2:
        return  # no NVFP4 weight
    sidecars = ck.optional(module, {"scale": ".weight_scale", "global": ".weight_global_scale"})
    scale = sidecars.get("scale")
    if (
        scale is not None
        and tensors[scale][DTYPE] not in SCALE_DTYPES["group_scale"]
        and (r.config.algo or "") != "nvfp4-pack-quantized"
    ):
        return  # compressed-tensors int4/int8 pack-quantized: not an NVFP4 weight
    weight = QuantWeight(
        module=module,
        scheme="nvfp4-ct",
        payload=name,
        output=module + ".weight",
        sidecars={**sidecars, **ck.optional(module, _ACTIVATION)},
        logical_shape=[shape[0], shape[1] * 2],
        block=(1, 16),
    )
    check_nvfp4(ck, weight)
    ck.check_dtype(
        name,
        weight.sidecars,
        {"scale": "group_scale", "global": "global", "input_global": "global"},
    )
    if module + ".weight_scale_2" in tensors:
        ck.add(
            "config_mismatch",
            module + ".weight_scale_2",
            f"{module!r} mixes compressed-tensors' weight_packed/weight_global_scale "
            "with ModelOpt's weight_scale_2; the two global scales are reciprocals "
            "of each other",
            "Keep one convention per checkpoint; re-export it.",
        )
    ck.claim(weight)


#: a compressed-tensors integer weight's sidecars: role -> name suffix
_INT_CT_SIDECARS = {
    "scale": ".weight_scale",
    "zero_point": ".weight_zero_point",
    "g_idx": ".weight_g_idx",
    "shape": ".weight_shape",
    **_ACTIVATION,
    "input_zero_point": ".input_zero_point",
}


def _int_ct(r: _Recognition, name: str, module: str, *, packed: bool) -> None:
    """compressed-tensors' integer weights: `pack-quantized` (`weight_packed` int32 words,
    `num_bits` values packed densely, 32 values in `num_bits` words, with `weight_shape`) or
    `int-quantized` (an int8 `weight`), each with `weight_scale` (per tensor `[1]`, per
    channel `[out, 1]` or per group `[out, in/group]`), `weight_zero_point` when asymmetric,
    `weight_g_idx` under activation ordering. The bits and group size come from the config
    where its groups agree; the exact input size of a packed weight is its `weight_shape`'s
    value, which dequantization reads (here: the scales' grid, else the packed width)."""
    ck, tensors = r.checks, r.checks.tensors
    shape = list(tensors[name][SHAPE])
    if len(shape) < 2:
        return
    declared_bits, declared_group = ct_weight_args(r.config.raw)
    bits = (declared_bits or 4) if packed else 8
    sidecars = ck.optional(module, _INT_CT_SIDECARS)
    if not packed:
        sidecars.pop("shape", None)
    scale = sidecars.get("scale")
    scale_shape = list(tensors[scale][SHAPE]) if scale is not None else []
    groups = scale_shape[-1] if len(scale_shape) >= 2 else 1
    cols = shape[-1]
    if packed:
        cols = shape[-1] * 32 // bits
        if (
            groups > 1
            and declared_group
            and math.ceil(groups * declared_group * bits / 32) == (shape[-1])
        ):
            cols = groups * declared_group  # exact: the groups cover the input
    weight = QuantWeight(
        module=module,
        scheme=f"int{bits}-ct-packed" if packed else "int8-ct",
        payload=name,
        output=module + ".weight",
        sidecars=sidecars,
        logical_shape=[*shape[:-1], cols],
        block=(1, cols // groups) if groups > 1 else (1, 1),
    )
    if scale is None:
        ck.missing(name, module + ".weight_scale", weight.scheme)
    else:
        per_tensor = math.prod(scale_shape) == 1 and len(scale_shape) <= 1
        if not per_tensor and (
            scale_shape[:-1] != shape[:-1] or groups < 1 or (not packed and cols % groups)
        ):
            want = f"[1], {[*shape[:-1], 1]} or {[*shape[:-1], 'in/group']}"
            ck.grid_problem(name, scale, scale_shape, want)
        ck.check_dtype(name, {"scale": scale}, {"scale": "scale"})
    if packed and "shape" not in sidecars:
        ck.add(
            "missing_scale",
            name,
            f"quantized weight {name!r} ({label(weight.scheme)}) has no "
            f"{module + '.weight_shape'!r}: its codes cannot be read without it",
            "Fetch or re-export the shard holding it; do not load this checkpoint.",
        )
    ck.claim(weight)


def _fp8(r: _Recognition, name: str, module: str, tensor: TensorFacts) -> None:
    """FP8 per block, per channel or per tensor: the scale's grid says which."""
    ck, tensors, config, block = r.checks, r.checks.tensors, r.config, r.block
    shape = list(tensor[SHAPE])
    sidecars = ck.optional(
        module,
        {"inv": ".weight_scale_inv", "mul": ".weight_scale", "comfy": ".scale_weight"},
    )
    scale_name = sidecars.get("inv") or sidecars.get("mul") or sidecars.get("comfy")
    if (
        scale_name is not None
        and scale_name == sidecars.get("mul")
        and tensors[scale_name][DTYPE] in SCALE_DTYPES["mx_scale"]
    ):
        # compressed-tensors' MXFP8 (`mxfp8-quantized`): an E8M0 exponent per 32 values
        _mx_ct(r, name, module, "mxfp8-ct", scale_name)
        return
    if scale_name is None:
        if ("fp8" in r.expects or r.fp8_scaled_elsewhere) and not ignored(module, config.ignore):
            sidecar = module + (
                ".weight_scale"
                if config.method == "compressed-tensors" or config.method == "modelopt"
                else ".weight_scale_inv"
            )
            scheme = "fp8-block" if block else "fp8-tensor"
            if config.algo == "mxfp8-quantized":
                scheme = "mxfp8-ct"
            ck.missing(name, sidecar, scheme)
            ck.claim(QuantWeight(module, scheme, name, name, {}, shape, block or (1, 1)))
        return
    scale_shape = list(tensors[scale_name][SHAPE])
    found, implied = fp8_grid(shape, scale_shape, block)
    if found is None:
        ck.grid_problem(name, scale_name, scale_shape, implied)
        found = "fp8-block" if block else "fp8-tensor"
    roles = {
        "scale": scale_name,
        **ck.optional(module, {**_ACTIVATION, "input_comfy": ".scale_input"}),
    }
    weight = QuantWeight(
        module,
        found,
        name,
        name,
        roles,
        shape,
        (block or (128, 128)) if found == "fp8-block" else (1, 1),
    )
    if found == "fp8-block" and block is None:
        weight.block = infer_block(shape, scale_shape)
    ck.check_dtype(name, {"scale": scale_name}, {"scale": "scale"})
    ck.claim(weight)


def _nvfp4(r: _Recognition, name: str, module: str, tensor: TensorFacts) -> None:
    """NVFP4 as ModelOpt writes it: a uint8 `weight` with `weight_scale` and `weight_scale_2`."""
    ck, tensors = r.checks, r.checks.tensors
    shape = list(tensor[SHAPE])
    sidecars = ck.optional(module, {"scale": ".weight_scale", "scale_2": ".weight_scale_2"})
    nv_expected = "nvfp4" in r.expects and not ignored(module, r.config.ignore)
    scale = sidecars.get("scale")
    if scale is None and "scale_2" not in sidecars and not nv_expected:
        return  # a plain uint8 tensor
    if (
        scale is not None
        and tensors[scale][DTYPE] not in SCALE_DTYPES["group_scale"]
        and not nv_expected
    ):
        return
    weight = QuantWeight(
        module=module,
        scheme="nvfp4",
        payload=name,
        output=name,
        sidecars={**sidecars, **ck.optional(module, _ACTIVATION)},
        logical_shape=[shape[0], shape[1] * 2],
        block=(1, 16),
    )
    check_nvfp4(ck, weight)
    ck.check_dtype(
        name,
        weight.sidecars,
        {"scale": "group_scale", "scale_2": "global", "input": "input"},
    )
    if module + ".weight_global_scale" in tensors:
        ck.add(
            "config_mismatch",
            module + ".weight_global_scale",
            f"{module!r} mixes ModelOpt's weight_scale_2 with compressed-tensors' "
            "weight_global_scale; the two global scales are reciprocals of each other",
            "Keep one convention per checkpoint; re-export it.",
        )
    ck.claim(weight)
