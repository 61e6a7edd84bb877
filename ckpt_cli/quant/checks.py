"""Sidecar, grid and config checks of recognised quantized weights (headers only, no torch)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .. import dtypes
from ..formats.names import SAFETENSORS_SUFFIX
from ..models import DTYPE, FILE, SHAPE, Problem, TensorFacts
from .schemes import (
    FP8,
    SCALE_DTYPES,
    SIDECAR_SUFFIXES,
    GridMismatch,
    QuantAnalysis,
    QuantConfig,
    QuantWeight,
    ignored,
    label,
    scheme_family,
    unread_block_sizes,
)


def _problem(
    code: str, where: str, tensor: str, message: str, fix: str, warn: bool = False
) -> Problem:
    return Problem(
        code=code,
        message=f"{where}: {message}",
        file=where,
        tensor=tensor,
        severity="warning" if warn else "error",
        fix=fix,
    )


@dataclass
class Checks:
    """One analysis being built: the header tensors it judges and the problems it records."""

    where: str
    tensors: Mapping[str, TensorFacts]
    out: QuantAnalysis

    def add(self, code: str, tensor: str, message: str, fix: str, warn: bool = False) -> None:
        """Record one problem about `tensor`."""
        self.out.problems.append(_problem(code, self.where, tensor, message, fix, warn))

    def claim(self, weight: QuantWeight) -> None:
        """Record a recognised weight as the owner of its payload and sidecars."""
        self.out.weights[weight.output] = weight
        for member in weight.members:
            self.out.owner[member] = weight.output

    def grid_problem(self, weight: str, sidecar: str, got: list[int], want: str) -> None:
        """A sidecar whose shape is not the grid the scheme implies: a `scale_grid` problem,
        and a `GridMismatch` dequantization refuses by."""
        self.out.grids.append(GridMismatch(weight, sidecar, got, want))
        self.add(
            "scale_grid",
            sidecar,
            f"scale {sidecar!r} of {weight!r} has shape {got}, but the scheme implies {want}",
            "The scales belong to another weight or were cut wrong; re-export the checkpoint.",
        )

    def dtype_problem(self, weight: str, sidecar: str, got: str | None, role: str) -> None:
        """A sidecar of a dtype its role never has."""
        allowed = ", ".join(sorted(SCALE_DTYPES[role]))
        self.add(
            "scale_dtype",
            sidecar,
            f"scale {sidecar!r} of {weight!r} is {got}, not one of {allowed}",
            "A loader would misread it; re-export the checkpoint.",
        )

    def missing(self, weight: str, sidecar: str, scheme: str) -> None:
        """A quantized weight without a sidecar it needs."""
        self.add(
            "missing_scale",
            weight,
            f"quantized weight {weight!r} ({label(scheme)}) has no "
            f"{sidecar!r}: loaded without it, its values are off by the scale",
            "Fetch or re-export the shard holding the scale; do not load this checkpoint.",
        )

    def optional(self, module: str, roles: dict[str, str]) -> dict[str, str]:
        """The sidecars of `module` present among `roles` (role -> name suffix)."""
        found = {}
        for role, suffix in roles.items():
            if module + suffix in self.tensors:
                found[role] = module + suffix
        return found

    def check_dtype(self, weight: str, sidecars: dict[str, str], roles: dict[str, str]) -> None:
        """Every sidecar's dtype against the dtypes of its role."""
        for role, name in sidecars.items():
            kind = roles.get(role)
            if kind and self.tensors[name][DTYPE] not in SCALE_DTYPES[kind]:
                self.dtype_problem(weight, name, self.tensors[name][DTYPE], kind)


def fp8_siblings(tensors: Mapping[str, TensorFacts]) -> bool:
    """Whether some FP8 weight of the checkpoint has a scale (so one without it lost its own)."""
    return any(
        name.endswith((".weight_scale_inv", ".scale_weight"))
        or (
            name.endswith(".weight_scale")
            and tensors.get(name[: -len("_scale")]) is not None
            and tensors[name[: -len("_scale")]][DTYPE] in FP8
        )
        for name in tensors
    )


#: square block sizes tried, in order, when no config says an FP8 weight's block size
_BLOCK_SIZES = (128, 64, 32, 16, 256, 512)


def block_grid(shape: list[int], block: tuple[int, ...]) -> list[int]:
    """The scale grid of a block FP8 weight: one scale per `block` of its last two dimensions,
    leading ones (stacked experts `[E, out, in]`) kept: `[..., ceil(out/bo), ceil(in/bi)]`."""
    return [*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])]


def fp8_grid(
    shape: list[int], scale: list[int], block: tuple[int, ...] | None
) -> tuple[str | None, str]:
    """(scheme, implied grid text) of an FP8 weight's scale; scheme None when the grid is wrong."""
    lead = "E x " * (len(shape) - 2)  # stacked experts: one grid each
    if len(shape) >= 2 and block is not None:
        want = block_grid(shape, block)
        if scale == want:
            return "fp8-block", str(want)
        return None, (
            f"{want} ({lead}ceil(out/{block[0]}) x ceil(in/{block[1]}), weight_block_size)"
        )
    if dtypes.numel(scale) == 1:
        return "fp8-tensor", "one value"
    if len(shape) >= 1 and scale in ([shape[0]], [shape[0], 1]):
        return "fp8-channel", f"[{shape[0]}, 1]"
    if len(shape) >= 2:
        # no config to say the block size: any common square block whose grid fits
        for size in _BLOCK_SIZES:
            if scale == block_grid(shape, (size, size)):
                return "fp8-block", f"{size}x{size} blocks"
        want = block_grid(shape, (128, 128))
        return None, (f"{want} ({lead}128x128 blocks), [{shape[0]}, 1] (per channel) or one value")
    return None, "one value or one per output channel"


def infer_block(shape: list[int], scale: list[int]) -> tuple[int, int]:
    """The block size of an FP8 block weight whose config does not say it."""
    for size in _BLOCK_SIZES:
        if scale == block_grid(shape, (size, size)):
            return (size, size)
    return (math.ceil(shape[-2] / scale[-2]), math.ceil(shape[-1] / scale[-1]))


def check_nvfp4(checks: Checks, weight: QuantWeight) -> None:
    """An NVFP4 weight's group scales (`[out, in/16]`) and its one global scale."""
    tensors = checks.tensors
    out_dim, in_dim = weight.logical_shape
    global_role = "global" if weight.scheme == "nvfp4-ct" else "scale_2"
    global_suffix = ".weight_global_scale" if weight.scheme == "nvfp4-ct" else ".weight_scale_2"
    scale = weight.sidecars.get("scale")
    if scale is None:
        checks.missing(weight.payload, weight.module + ".weight_scale", weight.scheme)
    else:
        want = [out_dim, math.ceil(in_dim / 16)]
        if list(tensors[scale][SHAPE]) != want:
            checks.grid_problem(
                weight.payload, scale, list(tensors[scale][SHAPE]), f"{want} (in/16 groups)"
            )
    glob = weight.sidecars.get(global_role)
    if glob is None:
        checks.missing(weight.payload, weight.module + global_suffix, weight.scheme)
    elif dtypes.numel(tensors[glob][SHAPE]) != 1:
        checks.grid_problem(
            weight.payload, glob, list(tensors[glob][SHAPE]), "one value ([] or [1])"
        )


def check_orphans(checks: Checks) -> None:
    """Scales no recognised weight owns and whose weight is absent."""
    out, tensors = checks.out, checks.tensors
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
        checks.add(
            "orphan_scale",
            name,
            f"scale {name!r} has no weight ({wanted!r} is absent)",
            "The weight's shard is missing or the names were changed; fetch or re-export it.",
        )


def check_config(checks: Checks, config: QuantConfig, families: set[str] | None) -> None:
    """The config files against the headers; then every problem pointed at its file."""
    out = checks.out
    found = {scheme_family(w.scheme) for w in out.weights.values()}
    if families is not None:
        if not found:
            checks.add(
                "config_mismatch",
                config.file or "config.json",
                f"{config.file} declares {config.method} quantization ({config.algo or 'any'}), "
                "but no tensor is quantized",
                "The weights were dequantized without updating the config; drop the "
                "quantization config or use the quantized weights.",
            )
        for weight in out.weights.values():
            family = scheme_family(weight.scheme)
            if family not in families:
                checks.add(
                    "config_mismatch",
                    weight.payload,
                    f"{weight.payload!r} is {label(weight.scheme)}, but "
                    f"{config.file} declares {config.method} ({config.algo or 'any'})",
                    "Loaders follow the config; fix the config or re-export the weights.",
                )
                families = families | {family}  # once per scheme is enough
    for weight in out.weights.values():
        if config.ignore and ignored(weight.module, config.ignore):
            checks.add(
                "config_mismatch",
                weight.payload,
                f"{weight.payload!r} is quantized, but {config.file} lists {weight.module!r} "
                "as left unquantized",
                "Loaders would read the packed values as plain weights; fix the ignore list.",
                warn=True,
            )
    name_files(out.problems, checks.tensors, checks.where)
    if found & {"mx", "nvfp4", "nvfp4-ct"} and config.file is None:
        checks.add(
            "config_mismatch",
            next(iter(out.weights.values())).payload,
            "the weights are quantized but no config.json / hf_quant_config.json says how",
            "Loaders need the quantization config to read them; copy it next to the weights.",
            warn=True,
        )
    _unread_block_sizes(checks, config)


def _unread_block_sizes(checks: Checks, config: QuantConfig) -> None:
    """A block size the config gives that is none (`block_structure: [0, 0]`): ckpt reads the
    blocks from the scales' grid, loaders from the config; a warning on the config file."""
    if config.file is None:
        return
    where = checks.where.rstrip("/")
    folder = where.rpartition("/")[0] if where.endswith(SAFETENSORS_SUFFIX) else where
    config_path = f"{folder}/{config.file}" if folder else config.file
    for setting, value in unread_block_sizes(config.raw):
        checks.out.problems.append(
            Problem(
                code="config_mismatch",
                message=f"{config_path}: {setting} is {value!r}, which is no block size (two "
                "positive integers); ckpt takes the blocks from the scales' grid, but loaders "
                "follow the config",
                file=config_path,
                severity="warning",
                fix="Write the block size the weights were quantized with (e.g. [128, 128]) "
                "into the config.",
            )
        )


def name_files(problems: list[Problem], tensors: Mapping[str, TensorFacts], where: str) -> None:
    """Point each problem at the file holding its tensor (or the weight that lacks a scale)."""
    for i, problem in enumerate(problems):
        tensor = tensors.get(problem.tensor or "")
        held_in = tensor[FILE] if tensor is not None else None
        if not held_in or problem.file != where:
            continue
        if where.rstrip("/").endswith("/" + held_in) or where == held_in:
            continue  # SRC named the file itself
        file = f"{where.rstrip('/')}/{held_in}"
        problems[i] = problem.model_copy(
            update={"file": file, "message": file + problem.message[len(where) :]}
        )
