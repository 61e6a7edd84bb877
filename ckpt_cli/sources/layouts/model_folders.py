"""Model folders as the libraries that own them write them: PEFT adapters, diffusers models and
pipelines, sentence-transformers folders.

Recognised from file names and the libraries' small JSON files alone (never tensor data):

| layout | recognised by | what is reported |
|---|---|---|
| `peft` | `adapter_config.json` + `adapter_model.safetensors` / `.bin` | adapter type (LoRA...), base model, rank, alpha, target modules |
| `diffusers-model` | `config.json` with `_diffusers_version` beside `diffusion_pytorch_model[.VARIANT].safetensors` | class, variant |
| `diffusers-pipeline` | `model_index.json` + one subfolder per component | components, their classes |
| `sentence-transformers` | `modules.json` (+ `config_sentence_transformers.json`) | the module chain (`0_Transformer`, `1_Pooling`, `2_Dense`...) |

`naming` gives the file names an output must keep so the owning library still loads it
(`adapter_model.safetensors`, `diffusion_pytorch_model.fp16.safetensors` and diffusers' variant
index `diffusion_pytorch_model.safetensors.index.fp16.json`), and `companions` the non-weight
files of the layout that travel with the weights (`adapter_config.json`, a component's
`config.json`...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from pydantic import Field

from ...formats.base import Source
from ...formats.names import SAFETENSORS_INDEX_SUFFIX, TORCH_INDEX_SUFFIX
from ...models import Record

#: JSON files read here are small; anything larger is not the file we think it is
MAX_JSON = 4 << 20

_DIFFUSERS_WEIGHTS = re.compile(
    r"diffusion_pytorch_model(?:\.(?P<variant>\w+))?(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)$"
)
_DIFFUSERS_INDEX = re.compile(
    r"diffusion_pytorch_model\.(?:safetensors|bin)\.index(?:\.(?P<variant>[\w-]+))?\.json$"
)
#: transformers spells a variant the same way (`model.fp16.safetensors`,
#: `model.fp16-00001-of-00002.safetensors`, `model.safetensors.index.fp16.json`): a pipeline's
#: `text_encoder/` saved with `variant="fp16"` holds only these
_TRANSFORMERS_WEIGHTS = re.compile(
    r"(?:model|pytorch_model)(?:\.(?P<variant>\w+))?(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)$"
)
_TRANSFORMERS_INDEX = re.compile(
    r"(?:model|pytorch_model)\.(?:safetensors|bin)\.index(?:\.(?P<variant>[\w-]+))?\.json$"
)


class ComponentInfo(Record):
    """One component of a multi-folder model (a pipeline's `unet/`, a sentence-transformers
    module).

    Attributes:
        name: the component name (`unet`, `2_Dense`); `--select NAME` works on it alone.
        path: its folder inside the checkpoint (`` for the root).
        kind: the class that owns it (`UNet2DModel`, `sentence_transformers.models.Dense`).
        tensors / parameters / bytes: what its weights hold (0 for weightless components such as
            a scheduler or a tokenizer).
        files: its files.
    """

    name: str
    path: str
    kind: str | None = None
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    files: list[str] = Field(default_factory=list)


class LayoutInfo(Record):
    """Which library wrote a model folder and what its own files say about it.

    Attributes:
        layout: `peft`, `diffusers-model`, `diffusers-pipeline`, `diffusers-lora`,
            `sentence-transformers`.
        description: one line for humans (`LoRA adapter for meta-llama/... (r=8, alpha=16, ...)`).
        details: the facts the description is made of (JSON).
        components: for multi-folder layouts, every component with its totals.
    """

    layout: str
    description: str
    details: dict[str, Any] = Field(default_factory=dict)
    components: list[ComponentInfo] = Field(default_factory=list)


def read_json(source: Source, rel: str) -> Any:
    """A small JSON file of the folder, or None when absent, too large or not JSON."""
    if rel not in source.files:
        return None
    size = source.files.get(rel) or source.storage.size(rel)
    if size > MAX_JSON:
        return None
    try:
        return json.loads(source.storage.read_all(rel))
    except (UnicodeDecodeError, ValueError, RecursionError, OSError):
        return None


# --------------------------------------------------------------------------- PEFT


def peft_info(source: Source, base: str = "") -> LayoutInfo | None:
    """A PEFT adapter folder: its type, base model, rank, alpha and target modules."""
    names = {n[len(base) :] for n in source.files if n.startswith(base)}
    if "adapter_config.json" not in names or not (
        "adapter_model.safetensors" in names or "adapter_model.bin" in names
    ):
        return None
    config = read_json(source, f"{base}adapter_config.json")
    if not isinstance(config, dict):
        return LayoutInfo(
            layout="peft", description="PEFT adapter (adapter_config.json unreadable)"
        )
    kind = str(config.get("peft_type") or "PEFT")
    label = {"LORA": "LoRA", "ADALORA": "AdaLoRA", "LOHA": "LoHa", "LOKR": "LoKr", "IA3": "IA³"}
    name = label.get(kind.upper(), kind)
    if config.get("use_dora"):
        name = "DoRA"
    target = config.get("target_modules")
    targets = sorted(target) if isinstance(target, list) else target
    details: dict[str, Any] = {
        "peft_type": kind,
        "base_model_name_or_path": config.get("base_model_name_or_path"),
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": targets,
        "task_type": config.get("task_type"),
    }
    for key in ("target_parameters", "use_rslora", "use_dora", "fan_in_fan_out", "modules_to_save"):
        if config.get(key):
            details[key] = config[key]
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            details[key] = config[key]
    # LoHa / LoKr (peft's LyCORIS adapters) say `alpha`, not `lora_alpha`; LoKr's factoring
    # and the CP form of convolutions decide which tensors each layer holds
    for key in ("alpha", "use_effective_conv2d", "decompose_both"):
        if config.get(key) is not None and kind.upper() in ("LOHA", "LOKR"):
            details[key] = config[key]
    if kind.upper() == "LOKR" and config.get("decompose_factor") not in (None, -1):
        details["decompose_factor"] = config["decompose_factor"]
    # IA³ scales a feedforward layer's inputs, every other layer's outputs
    feedforward = config.get("feedforward_modules")
    if kind.upper() == "IA3" and feedforward:
        details["feedforward_modules"] = (
            sorted(feedforward) if isinstance(feedforward, list) else feedforward
        )
    alpha = details["lora_alpha"] if details["lora_alpha"] is not None else details.get("alpha")
    parts = []
    if details["r"] is not None:
        parts.append(f"r={details['r']}")
    if alpha is not None:
        parts.append(f"alpha={alpha}")
    if targets:
        shown = ", ".join(targets) if isinstance(targets, list) else str(targets)
        parts.append(f"targets {shown}")
    if "feedforward_modules" in details:
        shown = details["feedforward_modules"]
        parts.append(f"feedforward {', '.join(shown) if isinstance(shown, list) else shown}")
    parameters = config.get("target_parameters")
    if isinstance(parameters, list) and parameters:
        # LoRA on parameters (MoE expert stacks) rather than on whole layers
        parts.append(f"parameters {', '.join(sorted(map(str, parameters)))}")
    # a model peft wrapped without a Hub name (a diffusers UNet, `get_peft_model(unet)`) is
    # known by the class it records in `auto_mapping`
    mapping = config.get("auto_mapping")
    wrapped = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    base_model = details["base_model_name_or_path"] or (
        f"a {wrapped}" if isinstance(wrapped, str) and wrapped else "an unnamed base model"
    )
    description = f"{name} adapter for {base_model}"
    if parts:
        description += f" ({'; '.join(parts)})"
    return LayoutInfo(layout="peft", description=description, details=details)


# --------------------------------------------------------------------------- naming


@dataclass
class Naming:
    """The file names an output keeps so its owning library still loads it.

    Attributes:
        stem: weights file stem (`model`, `adapter_model`, `diffusion_pytorch_model`); "" for
            the target format's own (`model` / `pytorch_model`, as transformers names them).
        variant: a diffusers / transformers weight variant (`fp16`), kept in every name.
        library: who owns the convention (`peft`, `diffusers`, `transformers`), None for the
            default.
        companions: non-weight files of the layout to carry with the weights.
        size_shards: whether the library loads weights cut into size shards with an index
            (diffusers does; peft reads one `adapter_model.safetensors`).
    """

    stem: str
    variant: str | None = None
    library: str | None = None
    companions: list[str] = field(default_factory=list)
    size_shards: bool = True

    @property
    def basename(self) -> str:
        """The writer's basename: `diffusion_pytorch_model.fp16` for a variant."""
        return f"{self.stem}.{self.variant}" if self.variant else self.stem

    def index_name(self, suffix: str = SAFETENSORS_INDEX_SUFFIX) -> str | None:
        """diffusers and transformers put the variant before `.json`:
        `…safetensors.index.fp16.json`."""
        if self.variant:
            return f"{self.stem}{suffix.removesuffix('.json')}.{self.variant}.json"
        return None


#: the files diffusers saves a LoRA as (`save_lora_weights`, `save_lora_adapter`)
DIFFUSERS_LORA_FILES = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin")

#: non-weight files each layout needs beside its weights to load
COMPANIONS: dict[str, tuple[str, ...]] = {
    "peft": ("adapter_config.json", "README.md"),
    "diffusers": ("config.json",),
}


def naming(source: Source, base: str = "") -> Naming | None:
    """The naming convention of the weights in folder `base` of `source`, None for the default."""
    names = sorted(n[len(base) :] for n in source.files if n.startswith(base))
    names = [n for n in names if "/" not in n]
    if any(n in ("adapter_model.safetensors", "adapter_model.bin") for n in names):
        companions = [c for c in COMPANIONS["peft"] if c in names]
        return Naming("adapter_model", library="peft", companions=companions, size_shards=False)
    lora = [n for n in DIFFUSERS_LORA_FILES if n in names]
    if len(lora) == 1:
        # diffusers' `load_lora_weights` finds `pytorch_lora_weights.safetensors` (or `.bin`) by
        # that name, in one file
        return Naming(lora[0].split(".", 1)[0], library="diffusers", size_shards=False)
    variants: set[str | None] = set()
    for name in names:
        match = _DIFFUSERS_WEIGHTS.fullmatch(name) or _DIFFUSERS_INDEX.fullmatch(name)
        if match:
            variants.add(match.group("variant"))
    if variants:
        companions = [c for c in COMPANIONS["diffusers"] if c in names]
        variant = next(iter(variants)) if len(variants) == 1 else None
        return Naming(
            "diffusion_pytorch_model", variant=variant, library="diffusers", companions=companions
        )
    for name in names:
        match = _TRANSFORMERS_WEIGHTS.fullmatch(name) or _TRANSFORMERS_INDEX.fullmatch(name)
        if match:
            variants.add(match.group("variant"))
    if len(variants) == 1 and None not in variants:
        # weights saved as a variant only: the names keep it (`config.json` and the other
        # files travel as any model folder's do)
        return Naming("", variant=next(iter(variants)), library="transformers")
    return None


def is_diffusers_index(name: str) -> bool:
    """Whether `name` is a diffusers weight index, variant spelling included."""
    return _DIFFUSERS_INDEX.fullmatch(name.rsplit("/", 1)[-1]) is not None


#: the weight variant the Hub names a dtype by (`model.bf16-00001-of-00002.safetensors`,
#: `diffusion_pytorch_model.fp16.safetensors`); float32 and wider are the default weights
DTYPE_VARIANTS: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16"}


def variant_after_cast(variant: str | None, cast: str | None) -> str | None:
    """The variant weights saved as `variant` are named by once cast to `cast` (a canonical
    dtype). A variant that names a dtype (`fp16`, `bf16`, `fp32`) says what the data is in, so
    the cast data takes the cast's name (`bf16`), or none (float32: the default weights, which
    `from_pretrained` loads without a variant); any other variant (`ema`) stays."""
    if variant is None or cast is None:
        return variant
    from ...dtypes import parse_user_dtype
    from ...errors import UsageError

    try:
        named = parse_user_dtype(variant)
    except UsageError:
        return variant  # not a dtype's name
    if named == cast:
        return variant
    return DTYPE_VARIANTS.get(cast)


def cast_variant_note(source: Source, cast: str | None) -> str | None:
    """What a user loading the output must know when a cast renamed the folder's variant
    (`variant_after_cast`): the variant to load it with now, or none; None when no name changed."""
    convention = naming(source) if source.target is None else None
    if convention is None or convention.variant is None:
        return None
    variant = variant_after_cast(convention.variant, cast)
    if variant == convention.variant:
        return None
    now = (
        f'the {variant} variant (load it with variant="{variant}")'
        if variant
        else "the default weights (load it without variant=)"
    )
    return (
        f"the weights were saved as the {convention.variant} variant; cast to {cast}, they are "
        f"written as {now}"
    )


def apply_naming(source: Source, to: str, options: Any, cast: str | None = None) -> Naming | None:
    """Give a folder output `source`'s naming convention and companion files (`WriteOptions`).

    The basename (`adapter_model`, `diffusion_pytorch_model.fp16`), the index name where the
    library spells it differently, and the bytes of the companions (small JSON files) to publish
    with the weights. With `cast` (the dtype floating tensors are written in), a variant naming
    a dtype becomes the cast's (`variant_after_cast`): fp16 weights cast to fp32 are the default
    weights, not an `fp16` variant holding fp32. Returns the naming applied, None when the
    default names are right.
    """
    from ...formats import find_format

    if source.target is not None:
        return None
    convention = naming(source)
    if convention is None:
        return None
    variant = variant_after_cast(convention.variant, cast)
    if variant != convention.variant:
        convention = replace(convention, variant=variant)
        if not convention.stem and not variant:
            return None  # transformers weights without a variant: the default names
    target = find_format(to)
    if not convention.stem:
        convention = replace(convention, stem=target.default_basename if target else "model")
    options.basename = convention.basename
    # a format without a shard index never uses the name
    suffix = (target.index_suffix if target else None) or TORCH_INDEX_SUFFIX
    index = convention.index_name(suffix)
    if index:
        options.index_name = index
    companions = {}
    for rel in convention.companions:
        if (source.files.get(rel) or 0) <= MAX_JSON:
            companions[rel] = source.storage.read_all(rel)
    if companions:
        options.companions.update(companions)
    return convention


# --------------------------------------------------------------------------- multi-folder


@dataclass
class Component:
    """One weight-holding or weightless component of a multi-folder model.

    Attributes:
        name: its name (`unet`, `2_Dense`, `0_Transformer`).
        path: its folder (`unet`; `` for a sentence-transformers root module).
        kind: the class that owns it.
        weights: the file (or index) its weights are read from, relative to the root; None for
            weightless components (schedulers, tokenizers, pooling).
        needs: for a component that must hold weights (its library saves some for it), the
            file it saves them as, relative to the root; "" when it holds none, or when
            nothing says (a custom module type).
        absent: its folder is not there at all, though the folder's index names it (a
            pipeline's `unet/` deleted): the model cannot be loaded.
        stem: for a root module whose library loads its weights under a name of its own
            (peft's `adapter_model`), that stem: an output keeps it; "" for the default names.
    """

    name: str
    path: str
    kind: str | None
    weights: str | None
    needs: str = ""
    absent: bool = False
    stem: str = ""


#: the sentence-transformers module classes whose `save` writes weights (`model.safetensors`):
#: the Transformer family through `save_pretrained`, the others through `save_torch_weights`
#: (sentence-transformers 6.2); Pooling, Normalize, Dropout, BoW, Router... write none
_ST_WEIGHTED = frozenset(
    {
        "Transformer", "MLMTransformer", "CLIPModel", "Dense", "LayerNorm", "LSTM", "CNN",
        "WeightedLayerPooling", "WordEmbeddings", "WordWeights", "StaticEmbedding",
        "SparseStaticEmbedding", "SparseAutoEncoder",
    }
)  # fmt: skip


def _needs(folder: str, weighted: bool, stem: str = "model") -> str:
    """The weights file a component that must hold weights is saved with, else ""."""
    if not weighted:
        return ""
    return f"{folder}/{stem}.safetensors" if folder else f"{stem}.safetensors"


def _weights_in(names: set[str], folder: str) -> str | None:
    """The weights a component folder is read from: its default (non-variant) weights first."""
    prefix = f"{folder}/" if folder else ""
    local = {n[len(prefix) :] for n in names if n.startswith(prefix)}
    local = {n for n in local if "/" not in n}
    for stem in ("diffusion_pytorch_model", "model", "pytorch_model"):
        for name in (
            f"{stem}.safetensors.index.json",
            f"{stem}.safetensors",
            f"{stem}.bin.index.json",
            f"{stem}.bin",
        ):
            if name in local:
                return f"{prefix}{name}"
    variants = sorted(
        n
        for n in local
        if any(
            pattern.fullmatch(n)
            for pattern in (
                _DIFFUSERS_INDEX, _DIFFUSERS_WEIGHTS, _TRANSFORMERS_INDEX, _TRANSFORMERS_WEIGHTS
            )
        )
    )  # fmt: skip
    indexes = [n for n in variants if n.endswith(".json")]
    if indexes:
        return f"{prefix}{indexes[0]}"
    singles = [n for n in variants if not re.search(r"-\d{5}-of-\d{5}\.", n)]
    return f"{prefix}{singles[0]}" if singles else None


def saved_model_folders(names: set[str], base: str = "") -> list[tuple[str, str]]:
    """(subfolder, weights file) of each model a training script saved with `save_pretrained`
    into a direct subfolder of folder `base` (paths relative to it): `unet/` as the diffusers
    training scripts' `save_state` pre-hook writes it (`config.json` beside
    `diffusion_pytorch_model.safetensors`), `unet_ema/`, a `text_encoder/` saved by
    transformers. A subfolder with no `config.json` is no such model (accelerate's FSDP
    `pytorch_model_fsdp_0/`)."""
    inside = {n[len(base) :] for n in names if n.startswith(base)}
    subfolders = sorted({n.split("/", 1)[0] for n in inside if n.count("/") == 1})
    found: list[tuple[str, str]] = []
    for sub in subfolders:
        if f"{sub}/config.json" not in inside:
            continue
        weights = _weights_in(inside, sub)
        if weights is not None:
            found.append((sub, weights))
    return found


def multi_folder(source: Source) -> tuple[str, list[Component], dict[str, Any]] | None:
    """(layout, components, details) of a diffusers pipeline root, a sentence-transformers
    folder or a folder of several PEFT adapters; None for anything else. Only
    `model_index.json` / `modules.json` / `adapter_config.json` are read."""
    if source.target is not None:
        return None
    names = set(source.files)
    if "model_index.json" in names:
        index = read_json(source, "model_index.json")
        if not isinstance(index, dict):
            _refuse_damaged_index(source, names)
        components = []
        for key, value in index.items():
            if key.startswith("_") or not isinstance(value, list) or len(value) != 2:
                continue
            if value[0] is None:
                continue  # an optional component saved as null
            kind = f"{value[0]}.{value[1]}"
            if not any(n.startswith(f"{key}/") for n in names):
                # `save_pretrained` writes a folder for every component it names
                components.append(Component(str(key), str(key), kind, None, absent=True))
                continue
            # a model saves its `config.json` beside its weights; schedulers, tokenizers and
            # feature extractors save other configs and no weights
            model = f"{key}/config.json" in names
            stem = "diffusion_pytorch_model" if value[0] == "diffusers" else "model"
            components.append(
                Component(
                    str(key), str(key), kind, _weights_in(names, str(key)), _needs(key, model, stem)
                )
            )
        details = {"pipeline": index.get("_class_name"), "version": index.get("_diffusers_version")}
        return "diffusers-pipeline", components, details
    if "modules.json" in names:
        modules = read_json(source, "modules.json")
        if not isinstance(modules, list):
            return None
        components = []
        for module in modules:
            if not isinstance(module, dict) or not isinstance(module.get("path"), str):
                continue
            path = module["path"].strip("/")
            kind = str(module.get("type") or "")
            name = path or f"{module.get('idx', 0)}_{kind.rsplit('.', 1)[-1] or 'Module'}"
            weighted = kind.rsplit(".", 1)[-1] in _ST_WEIGHTED
            components.append(
                Component(
                    name, path, kind or None, _weights_in(names, path), _needs(path, weighted)
                )
            )
        return "sentence-transformers", components, {"modules": len(components)}
    if "adapter_config.json" in names:
        return peft_adapters(source, names)
    return None


#: the weights `PeftModel.save_pretrained` writes for one adapter, in the order peft loads them
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def peft_adapters(
    source: Source, names: set[str]
) -> tuple[str, list[Component], dict[str, Any]] | None:
    """A folder of several PEFT adapters, as `PeftModel.save_pretrained` writes one: the
    `default` adapter at the root, every other in a subfolder named after it
    (`second/adapter_config.json`, `second/adapter_model.safetensors`). None for a folder of
    one adapter (a plain adapter folder, described by `peft_info`). Only the adapters'
    `adapter_config.json` files are read."""
    folders = sorted(
        n.split("/")[0]
        for n in names
        if n.count("/") == 1 and n.endswith("/adapter_config.json") and not n.startswith(".")
    )
    if not folders:
        return None
    components = []
    for name, path in (("default", ""), *((f, f) for f in folders)):
        prefix = f"{path}/" if path else ""
        config = read_json(source, f"{prefix}adapter_config.json")
        kind = config.get("peft_type") if isinstance(config, dict) else None
        weights = next((f"{prefix}{w}" for w in _ADAPTER_WEIGHTS if f"{prefix}{w}" in names), None)
        needs = f"{prefix}{_ADAPTER_WEIGHTS[0]}"
        kind = f"peft.{kind or 'PEFT'}"
        components.append(Component(name, path, kind, weights, needs, stem="adapter_model"))
    return "peft-adapters", components, {"adapters": len(components)}


def _refuse_damaged_index(source: Source, names: set[str]) -> NoReturn:
    """Refuse a pipeline root whose `model_index.json` is no JSON object (cut short by an
    interrupted copy, or past the JSON budget): diffusers cannot load the pipeline, and read as
    a plain folder it would be called a folder of unrelated saves. Its component folders still
    read one at a time."""
    from ...errors import FormatError
    from ...formats.names import is_checkpoint_file

    folders = sorted({n.split("/", 1)[0] for n in names if "/" in n and is_checkpoint_file(n)})
    root = source.location.raw.rstrip("/")
    shown = " or ".join(f"{root}/{name}" for name in folders[:3])
    raise FormatError(
        f"is not a readable pipeline index (a JSON object of at most {MAX_JSON >> 20} MiB): "
        "the pipeline cannot be loaded, and its components are not known",
        path=source.storage.describe("model_index.json"),
        fix="Copy or download model_index.json again"
        + (f", or name one component's folder: {shown}." if shown else "."),
    )


#: the pipeline components a diffusers LoRA's keys are prefixed with (`save_lora_weights`)
_PIPELINE_COMPONENTS = frozenset(
    {"unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "prior", "decoder"}
)

#: the down (A) factor of a LoRA layer in each spelling diffusers saves and loads, whose
#: first dimension is the rank
_LORA_DOWN = (
    "lora.down.weight",
    "lora_linear_layer.down.weight",
    "lora_A.weight",
    "lora_down.weight",
)


def diffusers_lora_info(manifest: Any) -> LayoutInfo | None:
    """A diffusers LoRA (one `pytorch_lora_weights.*`, as `save_lora_weights` and
    `save_lora_adapter` write it): the pipeline components it adapts with their tensor counts
    (none for one model's), its ranks, and how it is loaded. None for any other checkpoint."""
    files = [f.path for f in manifest.files]
    if len(files) != 1 or files[0].rsplit("/", 1)[-1] not in DIFFUSERS_LORA_FILES:
        return None
    counts: dict[str, int] = {}
    ranks: set[int] = set()
    for entry in manifest.entries:
        if entry.kind != "tensor":
            continue
        head = entry.name.split(".", 1)[0]
        counts[head] = counts.get(head, 0) + 1
        if entry.name.endswith(_LORA_DOWN) and entry.shape:
            ranks.add(entry.shape[0])
    components = dict(sorted(counts.items())) if set(counts) <= _PIPELINE_COMPONENTS else {}
    details: dict[str, Any] = {"file": files[0], "components": components, "ranks": sorted(ranks)}
    if components:
        said = ", ".join(f"{name} {count} tensors" for name, count in components.items())
        loader = "pipe.load_lora_weights"
    else:
        said = "one model's (save_lora_adapter)"
        loader = "model.load_lora_adapter"
    rank = f"; rank {', '.join(map(str, sorted(ranks)))}" if ranks else ""
    return LayoutInfo(
        layout="diffusers-lora",
        description=f"diffusers LoRA: {said}{rank}; loaded with {loader}",
        details=details,
    )


def gguf_info(manifest: Any) -> LayoutInfo:
    """The GGUF header in one line: version, architecture, tensor types, metadata keys."""
    details = manifest.details
    types = details.get("tensor_types") or {}
    shown = ", ".join(f"{k} ×{v}" for k, v in types.items())
    keys = len(details.get("metadata") or {})
    split = details.get("split")
    parts = [f"GGUF v{details.get('gguf_version')}"]
    if details.get("architecture"):
        parts.append(f"architecture {details['architecture']}")
    parts.append(f"tensors {shown or 'none'}")
    parts.append(f"{keys} metadata keys")
    if split:
        parts.append(f"split in {split['count']} files")
    return LayoutInfo(layout="gguf", description="; ".join(parts), details=dict(details))
