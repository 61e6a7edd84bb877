"""The quantization schemes: their models, labels, sidecars and config files (no torch, no data).

See the package docstring for the schemes and their sidecars.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from pydantic import Field

from .. import dtypes
from ..budgets import MAX_CONFIG_BYTES
from ..errors import CkptError
from ..models import Entry, Manifest, Problem, Record
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
#: sidecar roles of activation scales (`input_scale`, `input_global_scale`, `scale_input`):
#: kept with their weight, dropped once it is dequantized (`diff --dequantize` compares them)
ACTIVATION = ("input", "input_global", "input_comfy")
LABELS = {
    "fp8-block": "FP8 block {block}",
    "fp8-channel": "FP8 per channel",
    "fp8-tensor": "FP8 per tensor",
    "mxfp4": "MXFP4 (groups of 32)",
    "mxfp8": "MXFP8 (groups of 32)",
    "mxfp4-ct": "MXFP4 compressed-tensors (groups of 32)",
    "mxfp6-ct": "MXFP6 compressed-tensors (groups of 32)",
    "mxfp8-ct": "MXFP8 compressed-tensors (groups of 32)",
    "nvfp4": "NVFP4 ModelOpt (groups of 16)",
    "nvfp4-ct": "NVFP4 compressed-tensors (groups of 16)",
    "int8-ct": "INT8 compressed-tensors int-quantized",
}
#: compressed-tensors' integer `pack-quantized` weights: `int{bits}-ct-packed` (`int4-ct-packed`)
INT_CT_PACKED = re.compile(r"int([1-8])-ct-packed")
#: integer-packed schemes ckpt recognises but does not dequantize (GPTQ, AWQ): per module, the
#: name suffixes of its tensors; a `--dtype` cast never touches them (their scales are
#: float16 by the kernels' contract) and a shard split never separates them
PACKED_SCHEMES = {
    "gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
    "awq": (".qweight", ".qzeros", ".scales"),
}
#: the suffixes of every packed scheme's tensors (the payload `.qweight` first)
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
#: bitsandbytes as transformers saves a `load_in_4bit` / `load_in_8bit` model: the payload is
#: the module's own `.weight` (uint8, two 4-bit codes a byte; int8), its quantization state
#: beside it, and the one name no other scheme writes (`quant_state.bitsandbytes__nf4|fp4`,
#: `SCB`) tells it; ckpt does not dequantize it, so it is kept as stored like GPTQ
BNB_4BIT_STATES = (
    ".weight.quant_state.bitsandbytes__nf4",
    ".weight.quant_state.bitsandbytes__fp4",
)
BNB_4BIT_SUFFIXES = (
    ".weight",
    ".weight.absmax",
    ".weight.quant_map",
    ".weight.nested_absmax",
    ".weight.nested_quant_map",
    *BNB_4BIT_STATES,
)
BNB_8BIT_SUFFIXES = (".weight", ".SCB", ".weight_format")
#: compressed-tensors' `weight_packed` tensors (int4/int8 `pack-quantized`, NVFP4, MXFP4/6)
CT_PACKED_SUFFIXES = (
    ".weight_packed",
    ".weight_scale",
    ".weight_zero_point",
    ".weight_g_idx",
    ".weight_shape",
)
#: how a packed scheme is named where the config declares none
BNB_4BIT = "bitsandbytes 4-bit"
BNB_8BIT = "bitsandbytes 8-bit"
#: per packed scheme, the tensors beside the payload its codes cannot be read without (the
#: scales; bitsandbytes' absmax and code book; compressed-tensors' logical shape)
PACKED_REQUIRED = {
    "gptq": (".scales",),
    "awq": (".scales",),
    "GPTQ/AWQ": (".scales",),
    BNB_4BIT: (".weight.absmax", ".weight.quant_map"),
    BNB_8BIT: (".SCB",),
}
#: config files read next to the weights (small JSON; larger is not a config)
CONFIG_FILES = ("config.json", "hf_quant_config.json")
#: config files that only declare quantization (ModelOpt's): a dequantized output has none,
#: or loaders (and `verify`) would take its plain weights for quantized ones
QUANT_ONLY_CONFIG_FILES = CONFIG_FILES[1:]
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
        transposed: the dequantized values' last two dims are swapped, as the model holds
            them: gpt-oss stores its stacked experts `[E, out, in]` quantized along `in`, and
            transformers' `GptOss` holds them `[E, in, out]` (its MXFP4 dequantize transposes).
    """

    module: str
    scheme: str
    payload: str
    output: str
    sidecars: dict[str, str]
    logical_shape: list[int]
    block: tuple[int, int] = (1, 1)
    transposed: bool = False

    @property
    def members(self) -> list[str]:
        """Every stored name this weight owns (payload first)."""
        return [self.payload, *self.sidecars.values()]


class QuantConfig(Record):
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


class QuantGroup(Record):
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


class QuantSummary(Record):
    """The quantization of a checkpoint, from headers and config files.

    Attributes:
        label: one line (`7.6B parameters, FP8 block 128x128, 8.1 GB`).
        config: what the config files say.
        schemes: one group per scheme found.
        parameters: logical parameters of the whole model (dequantized weights plus every
            other floating tensor; scales excluded).
        stored_bytes: bytes of every tensor as stored.
        unquantized: module patterns holding floating weights that are not quantized.
        packed: module patterns of an integer-packed scheme ckpt does not dequantize (GPTQ,
            AWQ: `qweight`, `qzeros`, `scales`, `g_idx`), kept as stored by `convert`.
        orphans: scales whose weight is absent.
    """

    label: str
    config: QuantConfig
    schemes: list[QuantGroup] = Field(default_factory=list)
    parameters: int = 0
    stored_bytes: int = 0
    unquantized: list[str] = Field(default_factory=list)
    packed: list[str] = Field(default_factory=list)
    orphans: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class GridMismatch:
    """A sidecar whose shape is not the grid its scheme implies (a `scale_grid` problem).

    Attributes:
        weight: the quantized weight's stored name (its payload).
        sidecar: the scale's stored name.
        got: the scale's shape.
        want: the grid the scheme implies, in words (`[2, 2] (ceil(out/16) x ...)`).
    """

    weight: str
    sidecar: str
    got: list[int]
    want: str


@dataclass
class QuantAnalysis:
    """Everything recognised: weights by output name, owned names, problems found, and the
    scales whose shape is not their scheme's grid (`grids`, each also a `scale_grid` problem)."""

    config: QuantConfig
    weights: dict[str, QuantWeight] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # stored name -> output name
    orphans: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    grids: list[GridMismatch] = field(default_factory=list)
    #: module -> stored names of an integer-packed scheme ckpt does not dequantize
    #: (`PACKED_SCHEMES`: GPTQ's qweight, qzeros, scales, g_idx; bitsandbytes' weight and its
    #: state): kept as stored
    packed: dict[str, list[str]] = field(default_factory=dict)
    #: module -> the packed scheme's name (`gptq`, `GPTQ/AWQ`, `bitsandbytes 4-bit`...)
    packed_scheme: dict[str, str] = field(default_factory=dict)
    #: stored name -> the packed module it belongs to
    packed_owner: dict[str, str] = field(default_factory=dict)

    def add_packed(self, module: str, scheme: str, names: list[str]) -> None:
        """Record `module` as packed in `scheme`, stored as `names` (its payload first)."""
        self.packed[module] = names
        self.packed_scheme[module] = scheme
        for name in names:
            self.packed_owner[name] = module

    @property
    def quantized(self) -> bool:
        """Whether any quantized weight of a scheme ckpt dequantizes was found."""
        return bool(self.weights)

    def members_of(self, name: str) -> list[str] | None:
        """The stored names that go with `name` (a quantized weight with its scales, a packed
        module's tensors), None when it is no part of a quantized weight."""
        owner = self.owner.get(name)
        if owner is not None:
            return self.weights[owner].members
        module = self.packed_owner.get(name)
        return self.packed[module] if module is not None else None

    def kept_as_stored(self, name: str) -> bool:
        """Whether `name` is a quantized weight, one of its scales or a packed module's
        tensor: what a `--dtype` cast never touches."""
        return self.members_of(name) is not None

    def together(self) -> list[list[str]]:
        """Groups of stored names a writer must keep in one shard (weight with its scales)."""
        groups = [w.members for w in self.weights.values() if len(w.members) > 1]
        return groups + [names for names in self.packed.values() if len(names) > 1]


def fold(name: str) -> str:
    """A module name with its layer numbers folded: `model.layers.3.mlp` -> `model.layers.*.mlp`."""
    return _DIGITS.sub(".*", name)


def _json(storage: Storage, rel: str) -> dict[str, Any] | None:
    try:
        if not storage.exists(rel) or storage.size(rel) > MAX_CONFIG_BYTES:
            return None
        doc = json.loads(storage.read_all(rel))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, CkptError):
        return None  # an unreadable config is no config: the headers still tell the scheme
    return doc if isinstance(doc, dict) else None


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def prefetch_config(storage: Storage) -> None:
    """Let a remote storage fetch the `CONFIG_FILES` that `read_config` reads once the
    checkpoint is open, while it is being opened (its index and headers read): one round
    trip less on the Hub or an object store, where each costs tens of milliseconds or more."""
    storage.prefetch_files(CONFIG_FILES)


def _block_size(value: Any) -> list[int] | None:
    """A config's block size (`weight_block_size`, `block_structure`): two positive integers,
    else None (no block size said: the scales' grid tells it, as without a config)."""
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)
    ):
        return [int(b) for b in value]
    return None


def unread_block_sizes(raw: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The block sizes a quantization section gives that are no block size (`[0, 0]`, one
    number, a string): (the setting's path in the section, its value). `read_config` takes
    each for "no block size said", and the scales' grid decides; loaders follow the config,
    so this is said (`check_config`), never passed over without a word."""
    out: list[tuple[str, Any]] = []
    given = raw.get("weight_block_size")
    if given is not None and _block_size(given) is None:
        out.append(("weight_block_size", given))
    groups = raw.get("config_groups")
    for name, group in groups.items() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        given = weights.get("block_structure") if isinstance(weights, dict) else None
        if given is not None and _block_size(given) is None:
            out.append((f"config_groups.{name}.weights.block_structure", given))
    return out


def read_config(storage: Storage) -> QuantConfig:
    """The quantization the checkpoint's config files declare (an empty config when none)."""
    hf_config, modelopt_config = CONFIG_FILES
    config = _json(storage, hf_config) or {}
    dtype = config.get("torch_dtype") or config.get("dtype")
    model_dtype = dtype if isinstance(dtype, str) and dtype in dtypes.FLOATING else None
    modelopt = _json(storage, modelopt_config)
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
    block = _block_size(q.get("weight_block_size"))
    groups = q.get("config_groups")
    if block is None and isinstance(groups, dict):
        # compressed-tensors block FP8: config_groups.*.weights.block_structure
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            structure = weights.get("block_structure") if isinstance(weights, dict) else None
            block = _block_size(structure) or block
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


def config_families(config: QuantConfig) -> set[str] | None:
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
        if algo == "float-quantized":
            return {"fp8"}
        if algo == "naive-quantized":
            return {"fp8", "int-ct"}
        if algo in ("pack-quantized", "int-quantized"):
            return {"int-ct"}
        if algo in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized"):
            return {"mx"}
        if algo == "mixed-precision":
            return {"nvfp4-ct", "fp8", "mx", "int-ct"}
        return None
    return None


def scheme_family(scheme: str) -> str:
    if scheme.startswith("fp8"):
        return "fp8"
    if scheme.startswith("mx"):
        return "mx"
    return "int-ct" if scheme.startswith("int") else scheme


def label(scheme: str, block: tuple[int, int] | None = None) -> str:
    """The human label of a scheme (`FP8 block 128x128`, `INT4 compressed-tensors
    pack-quantized (groups of 128)`)."""
    packed = INT_CT_PACKED.fullmatch(scheme)
    if packed is not None or scheme == "int8-ct":
        text = f"INT{packed[1]} compressed-tensors pack-quantized" if packed else LABELS[scheme]
        # an integer weight's `block` is (1, group size) for the group strategy, else (1, 1)
        return text + (f" (groups of {block[1]})" if block and block[1] > 1 else "")
    text = LABELS[scheme].format(block=f"{block[0]}x{block[1]}" if block else "")
    return text.rstrip()


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


def entry_parameters(
    entry: Entry,
    analysis: QuantAnalysis,
    tensors: Mapping[str, Entry],
    orphans: Container[str] | None = None,
) -> int:
    """The parameters one stored tensor counts for: the one rule of every parameter count
    (`inspect`'s first line with or without `--filter`, a training layout's weights, the
    quantization section). A quantized weight's payload counts its logical (dequantized)
    elements and its scales none; a packed module (GPTQ, AWQ, bitsandbytes...) counts its
    logical values on its payload (`qweight`, `weight`) and nothing on its scales, zeros and
    state; a scale whose weight is absent (an orphan) counts nothing; any other floating
    tensor its elements; integer tensors none. `tensors`: every tensor of the checkpoint by
    name (a packed payload's count needs its module's); `orphans`: `analysis.orphans` as a set,
    for a caller counting many entries (a list is searched through for each)."""
    if entry.kind != "tensor":
        return 0
    owner = analysis.owner.get(entry.name)
    if owner is not None:
        weight = analysis.weights[owner]
        return dtypes.numel(weight.logical_shape) if entry.name == weight.payload else 0
    module = analysis.packed_owner.get(entry.name)
    if module is not None:
        if entry.name != analysis.packed[module][0]:
            return 0
        return _packed_parameters(module, analysis, tensors)
    if entry.name in (analysis.orphans if orphans is None else orphans):
        return 0
    return entry.numel if entry.dtype in dtypes.FLOATING else 0


def _packed_parameters(module: str, analysis: QuantAnalysis, tensors: Mapping[str, Entry]) -> int:
    """The logical values of a packed module, from its payload's stored size."""
    scheme = analysis.packed_scheme[module]
    bits = analysis.config.raw.get("bits") or analysis.config.raw.get("w_bit") or 4
    qweight = tensors.get(module + ".qweight")
    codes = tensors.get(module + ".weight")
    if qweight is not None and isinstance(bits, int) and 0 < bits <= 32:
        # words of `32 / bits` values each (GPTQ packs along in, AWQ along out)
        return qweight.nbytes * 8 // bits
    if codes is not None:
        # bitsandbytes: two 4-bit codes a byte, or one int8 value each
        return codes.nbytes * 2 if scheme == BNB_4BIT else codes.numel
    return 0


def summarise(manifest: Manifest, analysis: QuantAnalysis) -> QuantSummary:
    """The per-scheme view `inspect` shows."""
    tensors = {e.name: e for e in manifest.entries if e.kind == "tensor"}
    target = logical_dtype(analysis)
    groups: dict[str, QuantGroup] = {}
    # ordered sets (dicts) of folded names: a crafted header of 100,000 distinct names made
    # each list search through all the others, quadratic
    group_patterns: dict[str, dict[str, None]] = {}
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
        group_patterns.setdefault(weight.scheme, {})[fold(weight.module)] = None
        group.parameters += dtypes.numel(weight.logical_shape)
        group.stored_bytes += sum(tensors[n].nbytes for n in weight.members if n in tensors)
    for scheme, patterns in group_patterns.items():
        groups[scheme].patterns = list(patterns)
    orphans = set(analysis.orphans)
    unquantized: dict[str, None] = {}
    for entry in tensors.values():
        if analysis.kept_as_stored(entry.name) or entry.name in orphans:
            continue
        if entry.dtype in dtypes.FLOATING:
            module = entry.name.rsplit(".", 1)[0] if "." in entry.name else entry.name
            unquantized[fold(module)] = None
    packed = list(dict.fromkeys(map(fold, analysis.packed_scheme)))
    packed_labels = list(dict.fromkeys(analysis.packed_scheme.values()))
    parameters = sum(entry_parameters(e, analysis, tensors, orphans) for e in tensors.values())
    stored = sum(e.nbytes for e in tensors.values())
    declared = " ".join(x for x in (analysis.config.method, analysis.config.algo) if x)
    labels = [g.label for g in groups.values()]
    labels += [f"{scheme} packed (kept as stored, not dequantized)" for scheme in packed_labels]
    label_text = ", ".join(labels) or (
        f"{declared} declared, no weight of a scheme ckpt reads" if declared else "not quantized"
    )
    return QuantSummary(
        label=f"{_count(parameters)} parameters, {label_text}, {_bytes(stored)}",
        config=analysis.config,
        schemes=list(groups.values()),
        parameters=parameters,
        stored_bytes=stored,
        unquantized=list(unquantized),
        packed=packed,
        orphans=analysis.orphans,
    )


def ct_weight_args(raw: dict[str, Any]) -> tuple[int | None, int | None]:
    """The weights' `num_bits` and `group_size` of a compressed-tensors config, each None
    unless every config group says the same positive integer (a mixed-precision model's
    groups differ: the tensors tell each weight's)."""
    groups = raw.get("config_groups")
    weights = [
        g["weights"]
        for g in (groups.values() if isinstance(groups, dict) else [])
        if isinstance(g, dict) and isinstance(g.get("weights"), dict)
    ]

    def agreed(key: str) -> int | None:
        # compared by their JSON text: a hostile config's value may be a list (unhashable)
        found = [w.get(key) for w in weights]
        value = found[0] if len({json.dumps(v) for v in found}) == 1 else None
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if ok else None

    return agreed("num_bits"), agreed("group_size")


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """A `config.json` for dequantized weights: the quantization section dropped.

    For the code that carries `config.json` into an output (convert's extras): call it on the
    carried config when the weights were dequantized.
    """
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    return out


def quantization_only_file(rel: str) -> bool:
    """Whether the source file `rel` only declares quantization (`hf_quant_config.json`): left
    out of a dequantized output, whose `config.json` is `without_quantization`."""
    return rel in QUANT_ONLY_CONFIG_FILES


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
        # compressed-tensors int8, bitsandbytes (4-bit states, 8-bit `SCB`)
        ".weight_zero_point",
        ".weight_g_idx",
        ".input_zero_point",
        *BNB_4BIT_SUFFIXES[1:],
        *BNB_8BIT_SUFFIXES[1:],
    ),
    ".weight_packed": (
        ".weight_scale",
        ".weight_global_scale",
        ".input_global_scale",
        *CT_PACKED_SUFFIXES[1:],
    ),
    "_blocks": ("_scales",),
    ".qweight": (".qzeros", ".scales", ".g_idx"),  # GPTQ / AWQ
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

    What `download --filter` uses: a weight fetched without its `weight_scale_inv` loads
    200x to 450,000x off. A scale the user's `exclude` globs name explicitly stays out.
    """
    picked = {e.name for e in chosen}
    wanted = set(picked)
    for name in picked:
        wanted.update(sidecar_names(name))
    if exclude:
        wanted = {n for n in wanted if n in picked or not any(fnmatchcase(n, g) for g in exclude)}
    return [e for e in entries if e.name in wanted]
