"""Scheme recognition and header checks for quantized checkpoints (no torch, no tensor data).

See the package docstring for the schemes and their sidecars.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from pydantic import BaseModel, Field

from .. import dtypes
from ..errors import CkptError
from ..models import Entry, Manifest, Problem
from ..storage import Storage

FP8 = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
#: plausible dtypes of each sidecar role
SCALE_DTYPES = {
    "scale": frozenset({"float32", "bfloat16", "float16"}),
    "mx_scale": frozenset({"uint8", "float8_e8m0fnu"}),
    "group_scale": frozenset({"float8_e4m3fn"}),
    "global": frozenset({"float32"}),
    "input": frozenset({"float32", "bfloat16", "float16"}),
}
#: name suffixes that are scales of some module's weight (or of its activations)
SIDECAR_SUFFIXES = (
    ".weight_scale_inv",
    ".weight_scale_2",
    ".weight_global_scale",
    ".weight_scale",
    ".scale_weight",
    ".input_scale",
    ".input_global_scale",
    ".scale_input",
    "_scales",
)
#: activation scales: kept with their weight, dropped once it is dequantized
ACTIVATION = ("input", "input_global")
LABELS = {
    "fp8-block": "FP8 block {block}",
    "fp8-channel": "FP8 per channel",
    "fp8-tensor": "FP8 per tensor",
    "mxfp4": "MXFP4 (groups of 32)",
    "mxfp8": "MXFP8 (groups of 32)",
    "nvfp4": "NVFP4 ModelOpt (groups of 16)",
    "nvfp4-ct": "NVFP4 compressed-tensors (groups of 16)",
}
#: config files read next to the weights (small JSON; larger is not a config)
CONFIG_FILES = ("config.json", "hf_quant_config.json")
_MAX_CONFIG = 16 << 20
_DIGITS = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class QuantWeight:
    """One quantized weight: its stored payload, its sidecars and what it dequantizes to.

    Attributes:
        module: the module prefix (`model.layers.0.mlp.down_proj`).
        scheme: scheme token (see the module docstring).
        payload: stored name of the quantized values.
        output: the dequantized tensor's name (`.weight`; MXFP4 drops `_blocks`).
        sidecars: role -> stored name (`scale`, `scale_2`, `global`, `input`, `input_global`).
        logical_shape: shape of the dequantized tensor.
        block: FP8 block size (rows, cols); MX/NV group size in `block[1]`.
    """

    module: str
    scheme: str
    payload: str
    output: str
    sidecars: dict[str, str]
    logical_shape: list[int]
    block: tuple[int, int] = (1, 1)

    @property
    def members(self) -> list[str]:
        """Every stored name this weight owns (payload first)."""
        return [self.payload, *self.sidecars.values()]


class QuantConfig(BaseModel):
    """What the checkpoint's config files say about quantization.

    Attributes:
        file: which file said it (`config.json`, `hf_quant_config.json`), None when neither.
        method: `fp8`, `mxfp4`, `compressed-tensors`, `modelopt`...
        algo: ModelOpt's `quant_algo` / compressed-tensors' `format`.
        block: `weight_block_size` for block FP8.
        ignore: module names or globs left unquantized (`modules_to_not_convert`, `ignore`,
            `exclude_modules`).
        dtype: the model's `torch_dtype` (what dequantized weights become by default).
        raw: the quantization section as written.
    """

    file: str | None = None
    method: str | None = None
    algo: str | None = None
    block: list[int] | None = None
    ignore: list[str] = Field(default_factory=list)
    dtype: str | None = None
    raw: dict[str, Any] = Field(default_factory=dict)


class QuantGroup(BaseModel):
    """The modules quantized with one scheme (what `inspect` shows per scheme).

    Attributes:
        scheme / label: scheme token and its human label (`FP8 block 128x128`).
        modules: how many weights; patterns: their names with layer numbers folded (`*`).
        stored_dtype / logical_dtype: payload dtype and the dequantized dtype.
        parameters: logical (dequantized) element count.
        stored_bytes: bytes of payloads plus sidecars.
        example: one weight: stored and logical shapes.
    """

    scheme: str
    label: str
    modules: int = 0
    patterns: list[str] = Field(default_factory=list)
    stored_dtype: str | None = None
    logical_dtype: str
    parameters: int = 0
    stored_bytes: int = 0
    example: dict[str, Any] = Field(default_factory=dict)


class QuantSummary(BaseModel):
    """The quantization of a checkpoint, from headers and config files.

    Attributes:
        label: one line (`7.6B parameters, FP8 block 128x128, 8.1 GB`).
        config: what the config files say.
        schemes: one group per scheme found.
        parameters: logical parameters of the whole model (dequantized weights plus every
            other floating tensor; scales excluded).
        stored_bytes: bytes of every tensor as stored.
        unquantized: module patterns holding floating weights that are not quantized.
        orphans: scales whose weight is absent.
    """

    label: str
    config: QuantConfig
    schemes: list[QuantGroup] = Field(default_factory=list)
    parameters: int = 0
    stored_bytes: int = 0
    unquantized: list[str] = Field(default_factory=list)
    orphans: list[str] = Field(default_factory=list)


@dataclass
class QuantAnalysis:
    """Everything recognised: weights by output name, owned names, problems found."""

    config: QuantConfig
    weights: dict[str, QuantWeight] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # stored name -> output name
    orphans: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        """Whether any quantized weight was found."""
        return bool(self.weights)

    def together(self) -> list[list[str]]:
        """Groups of stored names a writer must keep in one shard (weight with its scales)."""
        return [w.members for w in self.weights.values() if len(w.members) > 1]


def fold(name: str) -> str:
    """A module name with its layer numbers folded: `model.layers.3.mlp` -> `model.layers.*.mlp`."""
    return _DIGITS.sub(".*", name)


def _json(storage: Storage, rel: str) -> dict[str, Any] | None:
    try:
        if not storage.exists(rel) or storage.size(rel) > _MAX_CONFIG:
            return None
        doc = json.loads(storage.read_all(rel))
    except (OSError, ValueError, UnicodeDecodeError, CkptError):
        return None  # an unreadable config is no config: the headers still tell the scheme
    return doc if isinstance(doc, dict) else None


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def read_config(storage: Storage) -> QuantConfig:
    """The quantization the checkpoint's config files declare (an empty config when none)."""
    config = _json(storage, "config.json") or {}
    dtype = config.get("torch_dtype") or config.get("dtype")
    model_dtype = dtype if isinstance(dtype, str) and dtype in dtypes.FLOATING else None
    modelopt = _json(storage, "hf_quant_config.json")
    if modelopt is not None and isinstance(modelopt.get("quantization"), dict):
        q = modelopt["quantization"]
        return QuantConfig(
            file="hf_quant_config.json",
            method="modelopt",
            algo=q.get("quant_algo") if isinstance(q.get("quant_algo"), str) else None,
            ignore=_strings(q.get("exclude_modules")),
            dtype=model_dtype,
            raw=q,
        )
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return QuantConfig(dtype=model_dtype)
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        block = None
    groups = q.get("config_groups")
    if block is None and isinstance(groups, dict):
        # compressed-tensors block FP8: config_groups.*.weights.block_structure
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            structure = weights.get("block_structure") if isinstance(weights, dict) else None
            if isinstance(structure, list) and len(structure) == 2:
                block = [int(b) for b in structure]
    method = q.get("quant_method")
    algo = q.get("format") if method == "compressed-tensors" else q.get("quant_algo")
    if method == "modelopt" and not isinstance(algo, str):
        algo = q.get("quant_algo")
    ignore = (
        _strings(q.get("modules_to_not_convert"))
        + _strings(q.get("ignore"))
        + _strings(q.get("ignored_layers"))
        + _strings(q.get("exclude_modules"))
    )
    return QuantConfig(
        file="config.json",
        method=method if isinstance(method, str) else None,
        algo=algo if isinstance(algo, str) else None,
        block=block,
        ignore=ignore,
        dtype=model_dtype,
        raw=q,
    )


def ignored(module: str, patterns: list[str]) -> bool:
    """Whether a config's ignore list covers `module` (names, prefixes, globs, `re:` regexes)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                if re.fullmatch(pattern[3:], module):
                    return True
            except re.error:
                continue
        elif (
            module == pattern
            or module.startswith(pattern + ".")
            or fnmatchcase(module, pattern)
            or fnmatchcase(module, pattern + ".*")
        ):
            return True
    return False


def _config_families(config: QuantConfig) -> set[str] | None:
    """Scheme families the config allows (None: no config, or one this tool cannot judge)."""
    method, algo = (config.method or "").lower(), (config.algo or "").lower()
    if method == "fp8":
        return {"fp8"}
    if method == "mxfp4":
        return {"mx"}
    if method == "modelopt":
        if algo == "nvfp4":
            return {"nvfp4"}
        if algo == "fp8":
            return {"fp8"}
        if algo == "mixed_precision":
            return {"nvfp4", "fp8"}
        return None
    if method == "compressed-tensors":
        if algo == "nvfp4-pack-quantized":
            return {"nvfp4-ct"}
        if algo in ("float-quantized", "naive-quantized"):
            return {"fp8"}
        if algo == "mixed-precision":
            return {"nvfp4-ct", "fp8"}
        return None
    return None


def _family(scheme: str) -> str:
    return "fp8" if scheme.startswith("fp8") else "mx" if scheme.startswith("mx") else scheme


def label(scheme: str, block: tuple[int, int] | None = None) -> str:
    """The human label of a scheme (`FP8 block 128x128`)."""
    text = LABELS[scheme].format(block=f"{block[0]}x{block[1]}" if block else "")
    return text.rstrip()


def _problem(
    code: str, where: str, tensor: str, message: str, fix: str, warn: bool = False
) -> Problem:
    return Problem(
        code=code,
        message=f"{where}: {message}. {fix}",
        file=where,
        tensor=tensor,
        severity="warning" if warn else "error",
    )


def analyse(manifest: Manifest, config: QuantConfig, where: str | None = None) -> QuantAnalysis:
    """Recognise every quantized weight of `manifest` and check its sidecars from headers.

    Problems (each names the tensor and the sidecar): `missing_scale`, `scale_grid`,
    `scale_dtype`, `orphan_scale`, `config_mismatch`.
    """
    where = where or manifest.location
    tensors = {e.name: e for e in manifest.entries if e.kind == "tensor"}
    out = QuantAnalysis(config=config)
    block: tuple[int, int] | None = (config.block[0], config.block[1]) if config.block else None
    families = _config_families(config)
    expects = families or set()

    def claim(weight: QuantWeight) -> None:
        out.weights[weight.output] = weight
        for member in weight.members:
            out.owner[member] = weight.output

    def grid_problem(weight: str, sidecar: str, got: list[int], want: str) -> None:
        out.problems.append(
            _problem(
                "scale_grid",
                where,
                sidecar,
                f"scale {sidecar!r} of {weight!r} has shape {got}, but the scheme implies {want}",
                "The scales belong to another weight or were cut wrong; re-export the checkpoint.",
            )
        )

    def dtype_problem(weight: str, sidecar: str, got: str | None, role: str) -> None:
        allowed = ", ".join(sorted(SCALE_DTYPES[role]))
        out.problems.append(
            _problem(
                "scale_dtype",
                where,
                sidecar,
                f"scale {sidecar!r} of {weight!r} is {got}, not one of {allowed}",
                "A loader would misread it; re-export the checkpoint.",
            )
        )

    def missing(weight: str, sidecar: str, scheme: str) -> None:
        out.problems.append(
            _problem(
                "missing_scale",
                where,
                weight,
                f"quantized weight {weight!r} ({label(scheme)}) has no "
                f"{sidecar!r}: loaded without it, its values are off by the scale",
                "Fetch or re-export the shard holding the scale; do not load this checkpoint.",
            )
        )

    def optional(module: str, roles: dict[str, str]) -> dict[str, str]:
        found = {}
        for role, suffix in roles.items():
            if module + suffix in tensors:
                found[role] = module + suffix
        return found

    def check_dtype(weight: str, sidecars: dict[str, str], roles: dict[str, str]) -> None:
        for role, name in sidecars.items():
            kind = roles.get(role)
            if kind and tensors[name].dtype not in SCALE_DTYPES[kind]:
                dtype_problem(weight, name, tensors[name].dtype, kind)

    activation = {"input": ".input_scale", "input_global": ".input_global_scale"}
    fp8_scaled_elsewhere = _fp8_siblings(tensors)

    # --- payloads with their sidecars
    for name, entry in tensors.items():
        if name.endswith("_blocks") and "_blocks" not in name[:-7]:
            base = name[: -len("_blocks")]
            scales = base + "_scales"
            shape = list(entry.shape)
            scheme = "mxfp4" if entry.dtype == "uint8" else "mxfp8" if entry.dtype in FP8 else None
            if scheme is None or len(shape) < 2:
                continue
            per = shape[-1] * (2 if scheme == "mxfp4" else 1)
            weight = QuantWeight(
                module=base.rsplit(".", 1)[0] if "." in base else base,
                scheme=scheme,
                payload=name,
                output=base,
                sidecars={},
                logical_shape=[*shape[:-2], shape[-2] * per],
                block=(1, per),
            )
            if scales not in tensors:
                missing(name, scales, scheme)
            else:
                weight.sidecars["scale"] = scales
                if list(tensors[scales].shape) != shape[:-1]:
                    grid_problem(
                        name, scales, list(tensors[scales].shape), f"{shape[:-1]} (one per group)"
                    )
                check_dtype(name, {"scale": scales}, {"scale": "mx_scale"})
                if per != 32:
                    grid_problem(name, scales, list(tensors[scales].shape), "groups of 32 values")
            claim(weight)
            continue
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            shape = list(entry.shape)
            if entry.dtype != "uint8" or len(shape) != 2:
                continue
            sidecars = optional(
                module, {"scale": ".weight_scale", "global": ".weight_global_scale"}
            )
            scale = sidecars.get("scale")
            if (
                scale is not None
                and tensors[scale].dtype not in SCALE_DTYPES["group_scale"]
                and (config.algo or "") != "nvfp4-pack-quantized"
            ):
                continue  # compressed-tensors int4/int8 pack-quantized: not an NVFP4 weight
            weight = QuantWeight(
                module=module,
                scheme="nvfp4-ct",
                payload=name,
                output=module + ".weight",
                sidecars={**sidecars, **optional(module, activation)},
                logical_shape=[shape[0], shape[1] * 2],
                block=(1, 16),
            )
            _check_nvfp4(weight, tensors, missing, grid_problem)
            check_dtype(
                name,
                weight.sidecars,
                {"scale": "group_scale", "global": "global", "input_global": "global"},
            )
            if module + ".weight_scale_2" in tensors:
                out.problems.append(
                    _problem(
                        "config_mismatch",
                        where,
                        module + ".weight_scale_2",
                        f"{module!r} mixes compressed-tensors' weight_packed/weight_global_scale "
                        "with ModelOpt's weight_scale_2; the two global scales are reciprocals "
                        "of each other",
                        "Keep one convention per checkpoint; re-export it.",
                    )
                )
            claim(weight)
            continue
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        shape = list(entry.shape)
        if entry.dtype in FP8:
            sidecars = optional(
                module,
                {"inv": ".weight_scale_inv", "mul": ".weight_scale", "comfy": ".scale_weight"},
            )
            scale_name = sidecars.get("inv") or sidecars.get("mul") or sidecars.get("comfy")
            if scale_name is None:
                if ("fp8" in expects or fp8_scaled_elsewhere) and not ignored(
                    module, config.ignore
                ):
                    sidecar = module + (
                        ".weight_scale"
                        if config.method == "compressed-tensors" or config.method == "modelopt"
                        else ".weight_scale_inv"
                    )
                    scheme = "fp8-block" if block else "fp8-tensor"
                    missing(name, sidecar, scheme)
                    claim(QuantWeight(module, scheme, name, name, {}, shape, block or (1, 1)))
                continue
            scale_shape = list(tensors[scale_name].shape)
            scheme, implied = _fp8_grid(shape, scale_shape, block)
            if scheme is None:
                grid_problem(name, scale_name, scale_shape, implied)
                scheme = "fp8-block" if block else "fp8-tensor"
            roles = {
                "scale": scale_name,
                **optional(module, {**activation, "input_comfy": ".scale_input"}),
            }
            weight = QuantWeight(
                module,
                scheme,
                name,
                name,
                roles,
                shape,
                (block or (128, 128)) if scheme == "fp8-block" else (1, 1),
            )
            if scheme == "fp8-block" and block is None:
                weight.block = _infer_block(shape, scale_shape)
            check_dtype(name, {"scale": scale_name}, {"scale": "scale"})
            claim(weight)
            continue
        if entry.dtype == "uint8" and len(shape) == 2:
            sidecars = optional(module, {"scale": ".weight_scale", "scale_2": ".weight_scale_2"})
            nv_expected = "nvfp4" in expects and not ignored(module, config.ignore)
            scale = sidecars.get("scale")
            if scale is None and "scale_2" not in sidecars and not nv_expected:
                continue  # a plain uint8 tensor
            if (
                scale is not None
                and tensors[scale].dtype not in SCALE_DTYPES["group_scale"]
                and not nv_expected
            ):
                continue
            weight = QuantWeight(
                module=module,
                scheme="nvfp4",
                payload=name,
                output=name,
                sidecars={**sidecars, **optional(module, activation)},
                logical_shape=[shape[0], shape[1] * 2],
                block=(1, 16),
            )
            _check_nvfp4(weight, tensors, missing, grid_problem)
            check_dtype(
                name,
                weight.sidecars,
                {"scale": "group_scale", "scale_2": "global", "input": "input"},
            )
            if module + ".weight_global_scale" in tensors:
                out.problems.append(
                    _problem(
                        "config_mismatch",
                        where,
                        module + ".weight_global_scale",
                        f"{module!r} mixes ModelOpt's weight_scale_2 with compressed-tensors' "
                        "weight_global_scale; the two global scales are reciprocals of each other",
                        "Keep one convention per checkpoint; re-export it.",
                    )
                )
            claim(weight)

    # --- scales no weight owns
    for name in tensors:
        if name in out.owner or not name.endswith(SIDECAR_SUFFIXES):
            continue
        suffix = next(s for s in SIDECAR_SUFFIXES if name.endswith(s))
        base = name[: -len(suffix)]
        wanted = base + "_blocks" if suffix == "_scales" else base + ".weight"
        if wanted in tensors or (suffix != "_scales" and base + ".weight_packed" in tensors):
            # its weight is there but not of a scheme this tool dequantizes (an activation scale
            # of a plain weight, compressed-tensors' int4 packing...): not an orphan
            continue
        out.orphans.append(name)
        out.problems.append(
            _problem(
                "orphan_scale",
                where,
                name,
                f"scale {name!r} has no weight ({wanted!r} is absent)",
                "The weight's shard is missing or the names were changed; fetch or re-export it.",
            )
        )

    # --- the config against the headers
    found = {_family(w.scheme) for w in out.weights.values()}
    if families is not None:
        if not found:
            out.problems.append(
                _problem(
                    "config_mismatch",
                    where,
                    config.file or "config.json",
                    f"{config.file} declares {config.method} quantization ({config.algo or 'any'}), "
                    "but no tensor is quantized",
                    "The weights were dequantized without updating the config; drop the "
                    "quantization config or use the quantized weights.",
                )
            )
        for weight in out.weights.values():
            family = _family(weight.scheme)
            if family not in families:
                out.problems.append(
                    _problem(
                        "config_mismatch",
                        where,
                        weight.payload,
                        f"{weight.payload!r} is {label(weight.scheme)}, but "
                        f"{config.file} declares {config.method} ({config.algo or 'any'})",
                        "Loaders follow the config; fix the config or re-export the weights.",
                    )
                )
                families = families | {family}  # once per scheme is enough
    for weight in out.weights.values():
        if config.ignore and ignored(weight.module, config.ignore):
            out.problems.append(
                _problem(
                    "config_mismatch",
                    where,
                    weight.payload,
                    f"{weight.payload!r} is quantized, but {config.file} lists {weight.module!r} "
                    "as left unquantized",
                    "Loaders would read the packed values as plain weights; fix the ignore list.",
                    warn=True,
                )
            )
    _name_files(out.problems, tensors, where)
    if found & {"mx", "nvfp4", "nvfp4-ct"} and config.file is None:
        out.problems.append(
            _problem(
                "config_mismatch",
                where,
                next(iter(out.weights.values())).payload,
                "the weights are quantized but no config.json / hf_quant_config.json says how",
                "Loaders need the quantization config to read them; copy it next to the weights.",
                warn=True,
            )
        )
    return out


def _name_files(problems: list[Problem], tensors: dict[str, Entry], where: str) -> None:
    """Point each problem at the file holding its tensor (or the weight that lacks a scale)."""
    for i, problem in enumerate(problems):
        entry = tensors.get(problem.tensor or "")
        if entry is None or not entry.file or problem.file != where:
            continue
        if where.rstrip("/").endswith("/" + entry.file) or where == entry.file:
            continue  # SRC named the file itself
        file = f"{where.rstrip('/')}/{entry.file}"
        problems[i] = problem.model_copy(
            update={"file": file, "message": file + problem.message[len(where) :]}
        )


def _fp8_siblings(tensors: dict[str, Entry]) -> bool:
    """Whether some FP8 weight of the checkpoint has a scale (so one without it lost its own)."""
    return any(
        name.endswith((".weight_scale_inv", ".scale_weight"))
        or (
            name.endswith(".weight_scale")
            and tensors.get(name[: -len("_scale")]) is not None
            and tensors[name[: -len("_scale")]].dtype in FP8
        )
        for name in tensors
    )


def _fp8_grid(
    shape: list[int], scale: list[int], block: tuple[int, ...] | None
) -> tuple[str | None, str]:
    """(scheme, implied grid text) of an FP8 weight's scale; scheme None when the grid is wrong."""
    if len(shape) == 2 and block is not None:
        want = [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]
        if scale == want:
            return "fp8-block", str(want)
        return None, f"{want} (ceil(out/{block[0]}) x ceil(in/{block[1]}), weight_block_size)"
    if dtypes.numel(scale) == 1:
        return "fp8-tensor", "one value"
    if len(shape) >= 1 and scale in ([shape[0]], [shape[0], 1]):
        return "fp8-channel", f"[{shape[0]}, 1]"
    if len(shape) == 2:
        # no config to say the block size: any common square block whose grid fits
        for size in (128, 64, 32, 16, 256, 512):
            if scale == [math.ceil(shape[0] / size), math.ceil(shape[1] / size)]:
                return "fp8-block", f"{size}x{size} blocks"
        want = [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)]
        return None, f"{want} (128x128 blocks), [{shape[0]}, 1] (per channel) or one value"
    return None, "one value or one per output channel"


def _infer_block(shape: list[int], scale: list[int]) -> tuple[int, int]:
    for size in (128, 64, 32, 16, 256, 512):
        if scale == [math.ceil(shape[0] / size), math.ceil(shape[1] / size)]:
            return (size, size)
    return (math.ceil(shape[0] / scale[0]), math.ceil(shape[1] / scale[1]))


def _check_nvfp4(weight: QuantWeight, tensors: dict[str, Entry], missing: Any, grid: Any) -> None:
    out_dim, in_dim = weight.logical_shape
    global_role = "global" if weight.scheme == "nvfp4-ct" else "scale_2"
    global_suffix = ".weight_global_scale" if weight.scheme == "nvfp4-ct" else ".weight_scale_2"
    scale = weight.sidecars.get("scale")
    if scale is None:
        missing(weight.payload, weight.module + ".weight_scale", weight.scheme)
    else:
        want = [out_dim, math.ceil(in_dim / 16)]
        if list(tensors[scale].shape) != want:
            grid(weight.payload, scale, list(tensors[scale].shape), f"{want} (in/16 groups)")
    glob = weight.sidecars.get(global_role)
    if glob is None:
        missing(weight.payload, weight.module + global_suffix, weight.scheme)
    elif dtypes.numel(tensors[glob].shape) != 1:
        grid(weight.payload, glob, list(tensors[glob].shape), "one value ([] or [1])")


def analyse_checkpoint(
    manifest: Manifest, storage: Storage, where: str | None = None
) -> QuantAnalysis:
    """`analyse` with the config files read from the checkpoint's root."""
    return analyse(manifest, read_config(storage), where)


def logical_dtype(analysis: QuantAnalysis, requested: str | None = None) -> str:
    """The dtype dequantized weights take: `--dtype`, else the model's, else bfloat16."""
    return requested or analysis.config.dtype or "bfloat16"


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def summarise(manifest: Manifest, analysis: QuantAnalysis) -> QuantSummary:
    """The per-scheme view `inspect` shows."""
    tensors = {e.name: e for e in manifest.entries if e.kind == "tensor"}
    target = logical_dtype(analysis)
    groups: dict[str, QuantGroup] = {}
    for weight in analysis.weights.values():
        group = groups.get(weight.scheme)
        if group is None:
            payload = tensors[weight.payload]
            group = groups[weight.scheme] = QuantGroup(
                scheme=weight.scheme,
                label=label(weight.scheme, weight.block),
                stored_dtype=payload.dtype,
                logical_dtype=target,
                example={
                    "name": weight.payload,
                    "stored_shape": list(payload.shape),
                    "stored_dtype": payload.dtype,
                    "logical_shape": weight.logical_shape,
                    "scales": {r: list(tensors[n].shape) for r, n in weight.sidecars.items()},
                },
            )
        group.modules += 1
        pattern = fold(weight.module)
        if pattern not in group.patterns:
            group.patterns.append(pattern)
        group.parameters += dtypes.numel(weight.logical_shape)
        group.stored_bytes += sum(tensors[n].nbytes for n in weight.members if n in tensors)
    unquantized: list[str] = []
    others = 0
    for entry in tensors.values():
        if entry.name in analysis.owner or entry.name in analysis.orphans:
            continue
        if entry.dtype in dtypes.FLOATING:
            others += entry.numel
            module = entry.name.rsplit(".", 1)[0] if "." in entry.name else entry.name
            pattern = fold(module)
            if pattern not in unquantized:
                unquantized.append(pattern)
    parameters = others + sum(g.parameters for g in groups.values())
    stored = sum(e.nbytes for e in tensors.values())
    declared = " ".join(x for x in (analysis.config.method, analysis.config.algo) if x)
    labels = ", ".join(g.label for g in groups.values()) or (
        f"{declared} declared, no weight of a scheme ckpt reads" if declared else "not quantized"
    )
    return QuantSummary(
        label=f"{_count(parameters)} parameters, {labels}, {_bytes(stored)}",
        config=analysis.config,
        schemes=list(groups.values()),
        parameters=parameters,
        stored_bytes=stored,
        unquantized=unquantized,
        orphans=analysis.orphans,
    )


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """A `config.json` for dequantized weights: the quantization section dropped.

    For the code that carries `config.json` into an output (convert's extras): call it on the
    carried config when the weights were dequantized.
    """
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    return out


#: a payload's name suffix -> the suffixes of the sidecars that belong to it
_SIDECARS_OF = {
    ".weight": (
        ".weight_scale_inv",
        ".weight_scale",
        ".weight_scale_2",
        ".scale_weight",
        ".input_scale",
        ".input_global_scale",
        ".scale_input",
    ),
    ".weight_packed": (".weight_scale", ".weight_global_scale", ".input_global_scale"),
    "_blocks": ("_scales",),
}


def sidecar_names(name: str) -> list[str]:
    """Names a quantized weight's scales would have (from the name alone, any scheme)."""
    for suffix, sidecars in _SIDECARS_OF.items():
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return [base + s for s in sidecars]
    return []


def with_sidecars(
    chosen: list[Entry], entries: list[Entry], exclude: list[str] | None = None
) -> list[Entry]:
    """`chosen` plus the scales of every chosen weight (in `entries` order).

    What `download --tensors` uses: a weight fetched without its `weight_scale_inv` loads
    200x to 450,000x off. A scale the user's `exclude` globs name explicitly stays out.
    """
    picked = {e.name for e in chosen}
    wanted = set(picked)
    for name in picked:
        wanted.update(sidecar_names(name))
    if exclude:
        wanted = {n for n in wanted if n in picked or not any(fnmatchcase(n, g) for g in exclude)}
    return [e for e in entries if e.name in wanted]
