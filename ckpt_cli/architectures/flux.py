"""Flux: torchtitan 0.3's `flux` transformer against diffusers' `FluxTransformer2DModel`.

The correspondence is torchtitan 0.3.0's own `FluxStateDictAdapter`
(`torchtitan/models/flux/model/state_dict_adapter.py`), stated declaratively:

- embedders, modulations, q/k norms, projections and MLPs: renames;
- a double-stream block's fused `img_attn.qkv` / `txt_attn.qkv` (weight and bias) are diffusers'
  `attn.to_q/to_k/to_v` / `attn.add_q_proj/add_k_proj/add_v_proj`, rows `[q | k | v]` of one
  width each; a single-stream block's `linear1` is `attn.to_q/to_k/to_v` and `proj_mlp`, rows
  `[q | k | v | mlp]` (`FusedRows`: the hidden size, from `img_in`'s rows, splits it);
- the final layer's `adaLN_modulation.1` is diffusers' `norm_out.linear` with its halves
  swapped (BFL's Flux computes `shift, scale`, diffusers' `AdaLayerNormContinuous` `scale,
  shift`: `SwapHalves`, its own inverse).

Every output is whole rows of one source tensor, or rows of several back to back, so an export
is byte ranges copied in the kernel: no tensor is decoded.

Diffusers loads `diffusion_pytorch_model.safetensors` (+ `.index.json` when sharded) beside a
`config.json` naming `_class_name: FluxTransformer2DModel` (`naming_output`, `hf_config`).
torchtitan's Flux has no guidance embedder (FLUX.1-dev's `time_text_embed.guidance_embedder`):
a diffusers model holding one is refused, naming it (`unmapped`), and the exported config says
`guidance_embeds: false`. The shapes tell every size but the rotary axes' widths
(`axes_dims_rope`, which `--config` or `--flavor` give; torchtitan's flavors and BFL's Flux use
16, 56, 56 for their 128-wide heads, taken when a head is 128 wide and nothing says otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import FormatError, UsageError
from ..formats.names import DIFFUSERS_WEIGHTS_STEM
from .base import (
    HF,
    Architecture,
    Direction,
    Ignored,
    MappedTensor,
    Match,
    ModelArgs,
    NamingOutput,
    Piece,
    Rename,
    TensorRule,
    numbers_held,
    one,
)

TITAN = "torchtitan"
#: the diffusers model class an export is loaded as (`config.json`'s `_class_name`)
DIFFUSERS_CLASS = "FluxTransformer2DModel"
#: diffusers' `FluxTransformer2DModel` builds every MLP this many times the hidden size wide
#: (no config key changes it), and its rotary base is fixed at 10,000
MLP_RATIO = 4
ROPE_THETA = 10_000
#: the rotary axes' widths of BFL's Flux and of every torchtitan flavor (128-wide heads)
DEFAULT_AXES = (16, 56, 56)
#: the first diffusers release with `FluxTransformer2DModel`, written as `_diffusers_version`
#: where diffusers is not installed
FIRST_FLUX_DIFFUSERS = "0.30.0"

_D = "transformer_blocks.{layer}."
_S = "single_transformer_blocks.{layer}."
_TD = "double_blocks.{layer}."
_TS = "single_blocks.{layer}."

_PARAMS = ("weight", "bias")

_TOP = (
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("proj_out", "final_layer.linear"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
)
_DOUBLE = (
    (_D + "attn.to_add_out", _TD + "txt_attn.proj"),
    (_D + "attn.to_out.0", _TD + "img_attn.proj"),
    (_D + "ff.net.0.proj", _TD + "img_mlp.0"),
    (_D + "ff.net.2", _TD + "img_mlp.2"),
    (_D + "ff_context.net.0.proj", _TD + "txt_mlp.0"),
    (_D + "ff_context.net.2", _TD + "txt_mlp.2"),
    (_D + "norm1.linear", _TD + "img_mod.lin"),
    (_D + "norm1_context.linear", _TD + "txt_mod.lin"),
)
_SINGLE = (
    (_S + "norm.linear", _TS + "modulation.lin"),
    (_S + "proj_out", _TS + "linear2"),
)
#: q/k RMSNorm scales (weights only)
_NORMS = (
    (_D + "attn.norm_q.weight", _TD + "img_attn.norm.query_norm.weight"),
    (_D + "attn.norm_k.weight", _TD + "img_attn.norm.key_norm.weight"),
    (_D + "attn.norm_added_q.weight", _TD + "txt_attn.norm.query_norm.weight"),
    (_D + "attn.norm_added_k.weight", _TD + "txt_attn.norm.key_norm.weight"),
    (_S + "attn.norm_q.weight", _TS + "norm.query_norm.weight"),
    (_S + "attn.norm_k.weight", _TS + "norm.key_norm.weight"),
)
#: (diffusers parts, torchtitan fused) of each fused projection, without `.weight` / `.bias`
_FUSED = (
    (
        (_D + "attn.to_q", _D + "attn.to_k", _D + "attn.to_v"),
        _TD + "img_attn.qkv",
    ),
    (
        (_D + "attn.add_q_proj", _D + "attn.add_k_proj", _D + "attn.add_v_proj"),
        _TD + "txt_attn.qkv",
    ),
    (
        (_S + "attn.to_q", _S + "attn.to_k", _S + "attn.to_v", _S + "proj_mlp"),
        _TS + "linear1",
    ),
)
_FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")

#: shapes the args are read from, as (diffusers, torchtitan) names
_IMG_IN = ("x_embedder.weight", "img_in.weight")
_TXT_IN = ("context_embedder.weight", "txt_in.weight")
_VEC_IN = ("time_text_embed.text_embedder.linear_1.weight", "vector_in.in_layer.weight")
_OUT = ("proj_out.weight", "final_layer.linear.weight")
_DOUBLE_NORM = _NORMS[0]
_SINGLE_NORM = _NORMS[4]
_MLP_IN = (_D + "ff.net.0.proj.weight", _TD + "img_mlp.0.weight")

_GUIDANCE = "guidance embedder (torchtitan's Flux has none)"
_GUIDANCE_PREFIX = "time_text_embed.guidance_embedder."


@dataclass(frozen=True)
class FusedRows(TensorRule):
    """torchtitan's one fused projection (`native`) against diffusers' separate ones (`hf`),
    rows back to back in `hf`'s order: q, k and v of the hidden size each, and the rest (a
    single-stream block's MLP input) after them."""

    @property
    def transform(self) -> str:
        return "fuse-rows"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        if direction == "to_hf":
            hidden = int(args.require("dim", family, "it is the width of q, k and v"))
            out: list[MappedTensor] = []
            for m in matches:
                rows = m.shape[0] if m.shape else 0
                widths = [hidden] * len(self.hf)
                widths[-1] = rows - hidden * (len(self.hf) - 1)
                if widths[-1] <= 0 or (len(self.hf) == 3 and rows != 3 * hidden):
                    raise FormatError(
                        f"{m.name!r} has {rows} rows, which are not "
                        f"{' | '.join(p.rsplit('.', 1)[-1] for p in self.hf)} rows of the hidden "
                        f"size {hidden} (img_in's rows)",
                        fix="Convert a checkpoint as torchtitan saved it.",
                    )
                rest = tuple(m.shape[1:])
                start = 0
                for pattern, width in zip(self.hf, widths, strict=True):
                    out.append(
                        MappedTensor(
                            name=pattern.format(**m.groups),
                            shape=(width, *rest),
                            dtype=m.dtype,
                            pieces=(Piece(m.name, (start, *(0 for _ in rest)), (width, *rest)),),
                            transform="split-rows",
                        )
                    )
                    start += width
            return out
        by_layer: dict[int, dict[int, Match]] = {}
        for m in matches:
            by_layer.setdefault(m.groups["layer"], {})[m.pattern] = m
        out = []
        for layer, have in sorted(by_layer.items()):
            lacking = [p.format(layer=layer) for i, p in enumerate(self.hf) if i not in have]
            if lacking:
                raise FormatError(
                    f"{lacking[0]!r} is missing, so {self.native[0].format(layer=layer)!r} "
                    "cannot be built (its parts are one tensor in torchtitan's naming)",
                    fix="Convert the complete checkpoint (every shard of it), with every tensor "
                    "of each block (no --filter / --filter-out that leaves one out).",
                )
            parts = [have[i] for i in range(len(self.hf))]
            first = parts[0]
            if any(tuple(p.shape[1:]) != tuple(first.shape[1:]) for p in parts):
                raise FormatError(
                    f"{', '.join(repr(p.name) for p in parts)} differ in their columns "
                    f"({', '.join(str(list(p.shape)) for p in parts)}), so they are no rows of "
                    "one fused projection",
                    fix="Convert a checkpoint as diffusers saved it.",
                )
            out.append(
                MappedTensor(
                    name=self.native[0].format(layer=layer),
                    shape=(sum(p.shape[0] for p in parts), *first.shape[1:]),
                    dtype=first.dtype,
                    pieces=tuple(Piece(p.name) for p in parts),
                    combine="concat",
                    transform="fuse-rows",
                )
            )
        return out


@dataclass(frozen=True)
class SwapHalves(TensorRule):
    """The final layer's modulation: BFL's (torchtitan's) rows are `[shift | scale]`,
    diffusers' `[scale | shift]`; either way the two halves trade places."""

    @property
    def transform(self) -> str:
        return "swap-halves"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        target = self.target_patterns(direction)[0]
        out = []
        for m in matches:
            rows = m.shape[0] if m.shape else 0
            if rows % 2 or not rows:
                raise FormatError(
                    f"{m.name!r} has {rows} rows, not a shift and a scale of one width each",
                    fix="Convert a checkpoint as its framework saved it.",
                )
            half, rest = rows // 2, tuple(m.shape[1:])
            zeros = tuple(0 for _ in rest)
            out.append(
                MappedTensor(
                    name=target.format(**m.groups),
                    shape=m.shape,
                    dtype=m.dtype,
                    pieces=(
                        Piece(m.name, (half, *zeros), (half, *rest)),
                        Piece(m.name, (0, *zeros), (half, *rest)),
                    ),
                    combine="concat",
                    transform="swap-halves",
                )
            )
        return out


def _rules() -> list[TensorRule]:
    rules: list[TensorRule] = []
    for hf, native in (*_TOP, *_DOUBLE, *_SINGLE):
        rules += [Rename(one(f"{hf}.{p}"), one(f"{native}.{p}")) for p in _PARAMS]
    rules += [Rename(one(hf), one(native)) for hf, native in _NORMS]
    for parts, fused in _FUSED:
        for p in _PARAMS:
            rules.append(FusedRows(tuple(f"{h}.{p}" for h in parts), one(f"{fused}.{p}")))
    hf, native = _FINAL_MODULATION
    rules += [SwapHalves(one(f"{hf}.{p}"), one(f"{native}.{p}")) for p in _PARAMS]
    return rules


def _layers(shapes: Mapping[str, Sequence[int]], pattern: str) -> list[int]:
    regex = re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)") + r"\Z")
    return sorted({int(m.group(1)) for name in shapes if (m := regex.match(name))})


def _diffusers_version() -> str:
    """What diffusers' own `save_config` writes as `_diffusers_version`: the installed
    release (read from its metadata, not imported), else the first with Flux."""
    import importlib.metadata  # ~30 ms: only an export to diffusers needs it, not recognition

    try:
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return FIRST_FLUX_DIFFUSERS


class Flux(Architecture):
    """Flux (FLUX.1's transformer: double- then single-stream blocks): torchtitan's `flux`
    flavors against diffusers' `FluxTransformer2DModel`."""

    name = "flux"
    title = "Flux"
    torchtitan_models = "torchtitan.models.flux"
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {TITAN: _rules()}
    unmapped: ClassVar[Mapping[str, Sequence[Ignored]]] = {
        HF: (Ignored(_GUIDANCE_PREFIX, _GUIDANCE, prefix=True),),
    }

    @classmethod
    def check_layers(cls, names: Sequence[str]) -> None:
        """As `Architecture.check_layers`, over the double-stream blocks and the
        single-stream blocks apart (FLUX.1 has 19 of one and 38 of the other)."""
        for prefix in (_D.split("{")[0], _S.split("{")[0]):
            patterns = [p for rule in cls.rules[TITAN] for p in rule.hf if p.startswith(prefix)]
            held = numbers_held(names, patterns)
            layers = set().union(*held.values())
            for layer in range(max(layers) + 1 if layers else 0):
                lacks = [p.format(layer=layer) for p in patterns if layer not in held[p]]
                if lacks:
                    more = f" and {len(lacks) - 3} more" if len(lacks) > 3 else ""
                    raise FormatError(
                        f"block {layer} of the Flux model's {prefix.rstrip('.')} lacks "
                        f"{', '.join(repr(n) for n in lacks[:3])}{more} (in diffusers names), "
                        "which its other blocks hold: a model written without it is not the "
                        "one trained (diffusers initialises a missing weight at random; "
                        "torchtitan's load refuses it)",
                        fix="Convert the complete checkpoint (every shard of it), with every "
                        "tensor of each block (no --filter / --filter-out that leaves one out).",
                    )

    @classmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        side = 0 if naming == HF else 1
        img_in = shapes.get(_IMG_IN[side])
        norm = _layers(shapes, _DOUBLE_NORM[side])
        double = _layers(shapes, _DOUBLE[0][side] + ".weight")
        single = _layers(shapes, _SINGLE[0][side] + ".weight")
        head = shapes.get(_DOUBLE_NORM[side].format(layer=norm[0])) if norm else None
        if head is None:
            norms = _layers(shapes, _SINGLE_NORM[side])
            head = shapes.get(_SINGLE_NORM[side].format(layer=norms[0])) if norms else None
        dim = img_in[0] if img_in and len(img_in) == 2 else None
        head_dim = head[0] if head and len(head) == 1 else None
        widths: dict[str, int] = {}
        for key, pair, axis in (
            ("in_channels", _IMG_IN, 1),
            ("joint_attention_dim", _TXT_IN, 1),
            ("pooled_projection_dim", _VEC_IN, 1),
            ("out_rows", _OUT, 0),
        ):
            shape = shapes.get(pair[side])
            if shape and len(shape) == 2:
                widths[key] = shape[axis]
        mlp = [shapes.get(_MLP_IN[side].format(layer=layer)) for layer in double[:1]]
        if mlp and mlp[0]:
            widths["mlp_rows"] = mlp[0][0]
        widths["num_single_layers"] = max(single) + 1 if single else 0
        return ModelArgs(
            dim=dim,
            n_layers=max(double) + 1 if double else None,
            head_dim=head_dim,
            n_heads=dim // head_dim if dim and head_dim and dim % head_dim == 0 else None,
            widths=widths,
        )

    @classmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
        dim = None
        if isinstance(heads, int) and isinstance(head_dim, int):
            dim = heads * head_dim  # the hidden size (no key of diffusers' config)
        return ModelArgs(
            dim=dim,
            n_layers=config.get("num_layers"),
            n_heads=heads,
            head_dim=head_dim,
            config=dict(config),
        )

    @classmethod
    def shape_conflicts(
        cls, shapes: Mapping[str, Sequence[int]], naming: str, args: ModelArgs
    ) -> list[str]:
        if args.config is None:
            return []
        config = args.config
        found = cls.args_from_shapes(shapes, naming)
        widths = found.widths or {}
        out: list[str] = []
        named = config.get("_class_name")
        if named is not None and named != DIFFUSERS_CLASS:
            out.append(f"_class_name is {named!r}, not {DIFFUSERS_CLASS!r}")
        guided = any(n.startswith(_GUIDANCE_PREFIX) for n in shapes) if naming == HF else False
        if config.get("guidance_embeds") and not guided:
            out.append(
                "guidance_embeds is true, and the weights hold no guidance embedder "
                f"({_GUIDANCE_PREFIX}*; torchtitan's Flux has none)"
            )
        for key in (
            "in_channels",
            "joint_attention_dim",
            "pooled_projection_dim",
            "num_single_layers",
        ):
            said = config.get(key)
            if key in widths and said is not None and said != widths[key]:
                out.append(f"the weights have {key}={widths[key]}, where config.json says {said}")
        head_dim, axes = config.get("attention_head_dim"), config.get("axes_dims_rope")
        if found.head_dim is not None and head_dim is not None and head_dim != found.head_dim:
            out.append(
                f"the q/k norms are {found.head_dim} wide, where attention_head_dim={head_dim}"
            )
        if (
            isinstance(axes, list)
            and isinstance(head_dim, int)
            and (not all(isinstance(a, int) for a in axes) or sum(axes) != head_dim)
        ):
            out.append(f"axes_dims_rope={axes} does not sum to attention_head_dim={head_dim}")
        patch, channels = config.get("patch_size", 1), config.get("out_channels")
        channels = channels if channels is not None else config.get("in_channels")
        rows = widths.get("out_rows")
        if (
            isinstance(patch, int)
            and isinstance(channels, int)
            and rows is not None
            and patch * patch * channels != rows
        ):
            out.append(
                f"{_OUT[0 if naming == HF else 1]} has {rows} rows, where patch_size={patch}"
                f"² x out_channels={channels} = {patch * patch * channels}"
            )
        return out

    @classmethod
    def naming_output(cls, naming: str, args: ModelArgs) -> NamingOutput:
        # diffusers' from_pretrained looks for its own file names, never `model.safetensors`
        return NamingOutput(basename=DIFFUSERS_WEIGHTS_STEM if naming == HF else None)

    @classmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        widths = args.widths or {}
        dim = int(args.require("dim", cls.title, "config.json names it"))
        mlp = widths.get("mlp_rows")
        if mlp is not None and mlp != MLP_RATIO * dim:
            raise FormatError(
                f"the MLPs are {mlp} wide, {mlp / dim:g} x the hidden size {dim}, and diffusers' "
                f"FluxTransformer2DModel builds them {MLP_RATIO} x as wide (no config key "
                "changes it): it cannot load these weights",
                fix="Convert it with --to safetensors / dcp to keep its names; ckpt maps Flux "
                f"models of mlp_ratio {MLP_RATIO} to diffusers.",
            )
        if args.config is not None:
            return dict(args.config)
        head_dim = int(args.require("head_dim", cls.title, "the q/k norms are that wide"))
        if head_dim != sum(DEFAULT_AXES):
            raise FormatError(
                f"the rotary axes' widths (diffusers' axes_dims_rope) of a Flux with "
                f"{head_dim}-wide heads are not in the weights",
                fix="Pass --config with the model's diffusers config.json (a file, a folder or "
                "hf://org/model), or --flavor with the torchtitan flavor it was trained as.",
            )
        in_channels = widths.get("in_channels")
        rows = widths.get("out_rows")
        return {
            "_class_name": DIFFUSERS_CLASS,
            "_diffusers_version": _diffusers_version(),
            "attention_head_dim": head_dim,
            "axes_dims_rope": list(DEFAULT_AXES),
            "guidance_embeds": False,
            "in_channels": in_channels,
            "joint_attention_dim": widths.get("joint_attention_dim"),
            "num_attention_heads": dim // head_dim,
            "num_layers": args.n_layers,
            "num_single_layers": widths.get("num_single_layers", 0),
            "out_channels": None if rows == in_channels else rows,
            "patch_size": 1,
            "pooled_projection_dim": widths.get("pooled_projection_dim"),
        }

    @classmethod
    def args_from_torchtitan(cls, model: Any) -> ModelArgs:
        """The diffusers `config.json` (as `ModelArgs.config`) of torchtitan's
        `FluxModel.Config` `model`: the transformer as diffusers builds it.

        Raises:
            UsageError: the flavor builds a model diffusers' class cannot (another MLP ratio,
                rotary base or no q/k/v biases).
        """
        if model.mlp_ratio != MLP_RATIO or not model.qkv_bias or model.theta != ROPE_THETA:
            raise UsageError(
                f"--flavor: this Flux flavor (mlp_ratio {model.mlp_ratio}, qkv_bias "
                f"{model.qkv_bias}, theta {model.theta}) is no model diffusers' "
                f"FluxTransformer2DModel builds (mlp_ratio {MLP_RATIO}, q/k/v biases, theta "
                f"{ROPE_THETA})",
                fix="Convert it with --to safetensors / dcp to keep its names.",
            )
        head_dim = model.hidden_size // model.num_heads
        patch = int(model.final_layer_config.patch_size)
        return cls.args_from_config(
            {
                "_class_name": DIFFUSERS_CLASS,
                "_diffusers_version": _diffusers_version(),
                "attention_head_dim": head_dim,
                "axes_dims_rope": [int(a) for a in model.axes_dim],
                "guidance_embeds": False,
                "in_channels": model.in_channels,
                "joint_attention_dim": model.context_in_dim,
                "num_attention_heads": model.num_heads,
                "num_layers": model.depth,
                "num_single_layers": model.depth_single_blocks,
                "out_channels": None
                if model.out_channels == model.in_channels
                else model.out_channels,
                "patch_size": patch,
                "pooled_projection_dim": model.vec_in_dim,
            }
        )
