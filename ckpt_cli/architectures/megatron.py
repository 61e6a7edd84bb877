"""Megatron-Core GPT (Llama-style) under the `megatron` naming: rules against Hugging Face's.

How Megatron-Core's `GPTModel` (local or Transformer Engine spec) names and lays out a
Llama-style model in a `dist_checkpointing` (torch_dist) save, read from megatron-core 0.16:

- `embedding.word_embeddings.weight`, `decoder.final_layernorm.weight`, `output_layer.weight`
  (absent when the output shares the embedding).
- `linear_qkv` fuses Q, K and V per query group: its rows are `num_query_groups` groups of
  `[q × heads/groups, k, v]` heads of `head_dim` rows (`Attention.
  get_query_key_value_tensors`). Tensor parallelism gives each rank whole groups, so the
  global tensor has this layout whatever the TP size.
- `linear_fc1` fuses SwiGLU's gate and up projections: the first half of its rows is the gate
  (`silu(chunk 0) * chunk 1`); the sharded form keeps every rank's gate rows before every
  rank's up rows (`apply_swiglu_sharded_factory`), so the global tensor is `[gate; up]`.
- The pre-norms are folded into the linears they feed: `self_attention.linear_qkv.
  layer_norm_weight` (HF `input_layernorm`) and `mlp.linear_fc1.layer_norm_weight` (HF
  `post_attention_layernorm`); the local spec's `input_layernorm` / `pre_mlp_layernorm` are
  saved under those names too (its `sharded_state_dict_keys_map`).
- Homogeneous layers are saved stacked: one tensor `decoder.layers.<suffix>` with a leading
  layer axis (pipeline stages each hold a slice of it). Saves with `non_homogeneous_layers`
  keep `decoder.layers.<i>.<suffix>` per layer; both are read, the stacked form is written.
- Each linear has an `_extra_state` ShardedObject per layer (Transformer Engine's FP8 state;
  `None` in the local spec): `decoder.layers.<module>._extra_state/shard_<i>_<L>`. They hold
  no weights; an import writes them empty, as Megatron's load asks for them.

Rotary embeddings: both sides rotate halves (Megatron's default `rotary_interleaved=False`,
HF Llama's `rotate_half`), so Q and K rows are copied without a permutation. Megatron-LM's
`--use-rope-scaling` is Llama 3's frequency scaling (`rope_type: llama3`, `--rope-scaling-factor`,
the other values fixed): read from the args on export, written into them on import.

Every output is built from boxes of its sources (`Piece`): a Q projection is its rows of each
query group of the fused tensor (one box per group, one layer of the stack), so an export
reads each fused tensor once across its three outputs and holds one output at a time; an
import concatenates every layer's boxes into the stacked output (`StackedTensor`).
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import FormatError
from .base import (
    Direction,
    Ignored,
    MappedTensor,
    Match,
    ModelArgs,
    NamingOutput,
    Piece,
    Rename,
    TensorReads,
    TensorRule,
    checked_args,
    one,
)

if TYPE_CHECKING:
    import torch

    from ..formats.base import Checkpoint

MEGATRON = "megatron"
#: the files `dist_checkpointing.save` writes beside the DCP ones
MEGATRON_COMMON_PT = "common.pt"
MEGATRON_METADATA = "metadata.json"

#: what the fused tensor of a rule holds: `[q; k; v]` per group, `[gate; up]`, or one tensor
Fused = Literal["one", "qkv", "gate_up"]

#: Megatron-Core's Llama 3.x rotary scaling (`RotaryEmbedding._apply_scaling`, enabled by
#: Megatron-LM's `--use-rope-scaling`): the factor is an argument, these are fixed
MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: the linears whose `_extra_state` Megatron-Core saves (and asks for on load) per layer
EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
#: Megatron-Core's backend description beside a torch_dist save (what `dist_checkpointing`
#: writes, byte for byte)
MEGATRON_METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
#: Megatron-LM's checkpoint format version (`checkpointing.get_checkpoint_version`)
CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True)
class StackedTensor(MappedTensor):
    """An output that stacks every layer's tensor (Megatron's homogeneous layer stack): its
    pieces are each layer's, in order, the same count per layer; each layer is read and
    concatenated into its place of the output, so at most one layer's pieces are held beside
    the output."""

    def read(self, checkpoint: TensorReads) -> torch.Tensor:
        import torch

        from ..tensors import torch_dtype

        layers = self.shape[0]
        per_layer = len(self.pieces) // layers
        out = torch.empty(self.shape, dtype=torch_dtype(self.dtype))
        for layer in range(layers):
            pieces = self.pieces[layer * per_layer : (layer + 1) * per_layer]
            row = 0
            for piece in pieces:
                part = _read_piece(checkpoint, piece)
                out[layer, row : row + part.shape[0]] = part
                row += part.shape[0]
                del part
        return out


def _read_piece(checkpoint: TensorReads, piece: Piece) -> torch.Tensor:
    if piece.offsets is None or piece.sizes is None:
        return checkpoint.read_tensor(piece.source)
    return checkpoint.read_slice(piece.source, list(piece.offsets), list(piece.sizes))


@dataclass(frozen=True)
class LayerTensor(TensorRule):
    """One per-layer Megatron tensor (`native`: the stacked name, then the per-layer one) and
    the HF tensors it holds (`hf`, in the order the fused rows hold them).

    To HF every layer of a stacked tensor (or each per-layer tensor) becomes `len(hf)` outputs,
    each the concatenation of its boxes. From HF every layer's tensors are gathered into one
    stacked output; every layer `0..L-1` must be present.
    """

    fused: Fused = "one"

    @property
    def transform(self) -> str:
        return {"one": "rename", "qkv": "split-qkv", "gate_up": "split-gate-up"}[self.fused]

    def _boxes(self, rows: int, args: ModelArgs, family: str) -> list[list[tuple[int, int]]]:
        """Per HF tensor, the `(first row, row count)` boxes of a fused tensor of `rows` rows."""
        if self.fused == "one":
            return [[(0, rows)]]
        if self.fused == "gate_up":
            half = rows // 2
            return [[(0, half)], [(half, half)]]
        heads = int(args.require("n_heads", family, "the fused QKV holds heads per group"))
        groups = int(args.n_kv_heads or heads)
        head_dim = int(args.head_dim or int(args.require("dim", family, "head size")) // heads)
        per_group = (heads // groups + 2) * head_dim
        if heads % groups or rows != groups * per_group:
            raise FormatError(
                f"a fused QKV of {rows} rows is not {groups} query groups of "
                f"{heads // max(groups, 1)} query heads + 1 key + 1 value head of {head_dim}",
                fix="Check the model args (--config): num_attention_heads, "
                "num_key_value_heads and head_dim must match the weights.",
            )
        q_rows = heads // groups * head_dim
        return [
            [(g * per_group, q_rows) for g in range(groups)],
            [(g * per_group + q_rows, head_dim) for g in range(groups)],
            [(g * per_group + q_rows + head_dim, head_dim) for g in range(groups)],
        ]

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        if direction == "to_hf":
            return self._to_hf(matches, args, family)
        return self._from_hf(matches, args, family)

    def _to_hf(self, matches: Sequence[Match], args: ModelArgs, family: str) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        for m in matches:
            stacked = m.pattern == 0
            layers = range(m.shape[0]) if stacked else [m.groups["layer"]]
            shape = m.shape[1:] if stacked else m.shape
            boxes = self._boxes(shape[0], args, family)
            for layer in layers:
                for hf, spans in zip(self.hf, boxes, strict=True):
                    lead = (layer,) if stacked else ()
                    rest = tuple(0 for _ in shape[1:])
                    pieces = tuple(
                        Piece(
                            m.name,
                            (*lead, start, *rest),
                            (*((1,) if stacked else ()), rows, *shape[1:]),
                            squeeze=stacked,
                        )
                        for start, rows in spans
                    )
                    whole = not stacked and self.fused == "one"
                    out.append(
                        MappedTensor(
                            name=hf.format(layer=layer),
                            shape=(sum(r for _, r in spans), *shape[1:]),
                            dtype=m.dtype,
                            pieces=(Piece(m.name),) if whole else pieces,
                            combine="one" if len(pieces) == 1 else "concat",
                            transform=self.transform if self.fused != "one" else "unstack-layers",
                        )
                    )
        return out

    def _from_hf(
        self, matches: Sequence[Match], args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        by_layer: dict[int, dict[int, Match]] = {}
        for m in matches:
            by_layer.setdefault(m.groups["layer"], {})[m.pattern] = m
        layers = max(by_layer) + 1
        for layer in range(layers):
            have = by_layer.get(layer, {})
            lacking = [self.hf[p].format(layer=layer) for p in range(len(self.hf)) if p not in have]
            if lacking:
                raise FormatError(
                    f"{lacking[0]!r} is missing, so the layers' {self.native[0]} cannot be stacked",
                    fix="Convert the complete checkpoint (every shard of it).",
                )
        first = by_layer[0]
        columns = tuple(first[0].shape[1:])
        rows = sum(first[p].shape[0] for p in range(len(self.hf)))
        boxes = self._boxes(rows, args, family)
        pieces: list[Piece] = []
        for layer in range(layers):
            parts = by_layer[layer]
            if self.fused == "one":
                pieces.append(Piece(parts[0].name))
                continue
            # the fused rows in Megatron's order (for QKV: group by group, each group's q, k, v);
            # the boxes of one HF tensor are its rows in order
            spans = []
            for part, group in enumerate(boxes):
                row = 0
                for fused_start, count in group:
                    spans.append((fused_start, part, row, count))
                    row += count
            for _, part, row, count in sorted(spans):
                zeros = tuple(0 for _ in columns)
                pieces.append(Piece(parts[part].name, (row, *zeros), (count, *columns)))
        return [
            StackedTensor(
                name=self.native[0],
                shape=(layers, rows, *columns),
                dtype=first[0].dtype,
                pieces=tuple(pieces),
                combine="concat",
                transform={"one": "stack-layers", "qkv": "fuse-qkv", "gate_up": "fuse-gate-up"}[
                    self.fused
                ],
            )
        ]


def _layer(
    stacked: str, hf: Sequence[str], fused: Fused = "one", alias: str | None = None
) -> LayerTensor:
    native = [f"decoder.layers.{stacked}", f"decoder.layers.{{layer}}.{stacked}"]
    if alias is not None:
        native.append(f"decoder.layers.{{layer}}.{alias}")
    return LayerTensor(tuple(f"model.layers.{{layer}}.{h}" for h in hf), tuple(native), fused)


#: Llama-style decoder (RMSNorm, GQA, SwiGLU, no bias) between HF and Megatron-Core names
MEGATRON_RULES: tuple[TensorRule, ...] = (
    Rename(one("model.embed_tokens.weight"), one("embedding.word_embeddings.weight")),
    _layer(
        "self_attention.linear_qkv.layer_norm_weight",
        ("input_layernorm.weight",),
        alias="input_layernorm.weight",
    ),
    _layer(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    _layer("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    _layer(
        "mlp.linear_fc1.layer_norm_weight",
        ("post_attention_layernorm.weight",),
        alias="pre_mlp_layernorm.weight",
    ),
    _layer("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    _layer("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
    Rename(one("model.norm.weight"), one("decoder.final_layernorm.weight")),
    Rename(one("lm_head.weight"), one("output_layer.weight")),
)


@dataclass(frozen=True)
class MegatronStyle:
    """What a Megatron-Core `GPTModel` of a family holds beyond the Llama style: Qwen2's q/k/v
    biases (Megatron-LM's `--add-qkv-bias`: `linear_qkv.bias`, fused per query group as the
    weight is) or Qwen3's q/k norms (`--qk-layernorm`: `q_layernorm` / `k_layernorm`, RMSNorm
    over each head before the rotary embedding, as transformers' `q_norm` / `k_norm`)."""

    #: the family's name in messages (`not Llama-style`)
    name: str = "Llama"
    qkv_bias: bool = False
    qk_layernorm: bool = False

    @property
    def flags(self) -> dict[str, bool]:
        """Megatron-LM's arguments for what the style holds."""
        return {"add_qkv_bias": self.qkv_bias, "qk_layernorm": self.qk_layernorm}

    @property
    def rules(self) -> tuple[TensorRule, ...]:
        """The rules of a GPTModel of this style against Hugging Face names."""
        extra: list[TensorRule] = []
        if self.qkv_bias:
            extra.append(
                _layer(
                    "self_attention.linear_qkv.bias",
                    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                    "qkv",
                )
            )
        if self.qk_layernorm:
            extra += [
                _layer("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
                _layer("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
            ]
        return (*MEGATRON_RULES, *extra)

    @property
    def markers(self) -> tuple[str, ...]:
        """Name patterns of which a save of this style holds one (stacked or per layer)."""
        module = (
            "self_attention.linear_qkv.bias"
            if self.qkv_bias
            else "self_attention.q_layernorm.weight"
            if self.qk_layernorm
            else "self_attention.linear_qkv.weight"
        )
        return (f"decoder.layers.{module}", f"decoder.layers.{{layer}}.{module}")


LLAMA_STYLE = MegatronStyle()

#: what a Megatron save holds beside the model's weights
MEGATRON_IGNORED = (
    Ignored("rotary_pos_emb.inv_freq", "rotary table (rebuilt)"),
    # Megatron-LM saves the optimizer's sharded state beside the model in one torch_dist
    # checkpoint (`optimizer.state.exp_avg.<param>`, `optimizer.state.fp32_param.<param>`...)
    Ignored("optimizer.", "optimizer state (training only)", prefix=True),
)

_STACKED_QKV = "decoder.layers.self_attention.linear_qkv.weight"


def args_from_shapes(shapes: Mapping[str, Sequence[int]]) -> ModelArgs:
    """What a Megatron save's tensor shapes tell: sizes, layers, the FFN width, tying."""
    embed = shapes.get("embedding.word_embeddings.weight")
    fc1 = shapes.get("decoder.layers.mlp.linear_fc1.weight")
    layers = None
    if _STACKED_QKV in shapes:
        layers = shapes[_STACKED_QKV][0]
    else:
        numbered = {
            int(n.split(".")[2])
            for n in shapes
            if n.startswith("decoder.layers.") and n.split(".")[2].isdigit()
        }
        layers = max(numbered) + 1 if numbered else None
        fc1 = shapes.get("decoder.layers.0.mlp.linear_fc1.weight")
    return ModelArgs(
        dim=embed[1] if embed else None,
        vocab_size=embed[0] if embed else None,
        n_layers=layers,
        ffn_dim=fc1[-2] // 2 if fc1 else None,
        tie_embeddings="output_layer.weight" not in shapes if embed else None,
    )


def args_from_megatron(
    args: Mapping[str, Any], where: str, style: MegatronStyle = LLAMA_STYLE
) -> ModelArgs:
    """The model args of Megatron-LM's arguments (`args` in `common.pt`), refusing a model the
    family's Hugging Face model (`style`) cannot express (LayerNorm, GeLU, biases the style
    has not, learned positions, partial or interleaved rotary, MoE) with a FormatError
    naming what it found."""
    checks = {
        "normalization": (args.get("normalization"), "RMSNorm"),
        "swiglu": (bool(args.get("swiglu")), True),
        "add_bias_linear": (bool(args.get("add_bias_linear", False)), False),
        "add_qkv_bias": (bool(args.get("add_qkv_bias", False)), style.qkv_bias),
        "position_embedding_type": (args.get("position_embedding_type", "rope"), "rope"),
        "rotary_percent": (float(args.get("rotary_percent", 1.0) or 1.0), 1.0),
        "rotary_interleaved": (bool(args.get("rotary_interleaved", False)), False),
        "qk_layernorm": (bool(args.get("qk_layernorm", False)), style.qk_layernorm),
        "num_experts": (args.get("num_experts"), None),
    }
    wrong = {k: got for k, (got, want) in checks.items() if got != want}
    if wrong:
        shown = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        held = (
            "q/k/v biases" if style.qkv_bias else "q/k norms" if style.qk_layernorm else "no bias"
        )
        raise FormatError(
            f"the Megatron model is not {style.name}-style ({shown}): only RMSNorm, SwiGLU, "
            f"rotary embeddings over the whole head, {held} and no MoE map to Hugging Face "
            f"{style.name}, whose tensors the save's names are",
            path=where,
            fix="Export it with --to safetensors / dcp to keep Megatron's own names.",
        )
    heads = args.get("num_attention_heads")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else None
    theta = args.get("rotary_base")
    scaling = _rope_scaling_of(args, where)
    return ModelArgs(
        dim=args.get("hidden_size"),
        n_layers=args.get("num_layers"),
        n_heads=heads,
        n_kv_heads=groups,
        head_dim=args.get("kv_channels"),
        vocab_size=args.get("padded_vocab_size"),
        ffn_dim=args.get("ffn_hidden_size"),
        norm_eps=args.get("norm_epsilon"),
        rope_theta=float(theta) if theta is not None else None,
        rope_scaling=scaling,
        max_position_embeddings=args.get("max_position_embeddings"),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        dtype=dtype,
    )


def _rope_scaling_of(args: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The Hugging Face rope scaling of Megatron-LM's arguments: Llama 3.x's
    (`--use-rope-scaling`, `--rope-scaling-factor`), or linear (positions divided by
    `--rotary-seq-len-interpolation-factor`); None when neither is set."""
    llama3 = bool(args.get("use_rope_scaling", False))
    interpolation = args.get("rotary_seq_len_interpolation_factor")
    positions = float(interpolation) if interpolation is not None else 1.0
    linear = positions != 1.0
    if llama3 and linear:
        raise FormatError(
            "the Megatron model scales its rotary embeddings twice (use_rope_scaling and "
            f"rotary_seq_len_interpolation_factor={interpolation!r}): a Hugging Face Llama "
            "config.json holds one rope scaling",
            path=where,
            fix="Export it with --to safetensors / dcp to keep Megatron's own names.",
        )
    if llama3:
        factor = args.get("rope_scaling_factor")
        return {
            "rope_type": "llama3",
            "factor": float(factor) if factor is not None else 8.0,
            **MEGATRON_LLAMA3_ROPE,
        }
    if linear:
        return {"rope_type": "linear", "factor": positions}
    return None


def _megatron_rope_args(args: ModelArgs, family: str) -> dict[str, Any]:
    """Megatron-LM's rope-scaling arguments of a model's rope scaling (the inverse of
    `_rope_scaling_of`); a FormatError for a scaling Megatron-Core cannot apply."""
    scaling = dict(args.rope_scaling or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    factor = scaling.pop("factor", None)
    out: dict[str, Any] = {
        "use_rope_scaling": False,
        "rope_scaling_factor": 8.0,
        "rotary_seq_len_interpolation_factor": None,
    }
    if kind == "default" and factor is None:
        return out
    if kind == "llama3" and isinstance(factor, int | float) and scaling == MEGATRON_LLAMA3_ROPE:
        return {**out, "use_rope_scaling": True, "rope_scaling_factor": float(factor)}
    if kind == "linear" and isinstance(factor, int | float) and not scaling:
        # Megatron-LM parses the interpolation factor as an int
        whole = float(factor).is_integer()
        return {**out, "rotary_seq_len_interpolation_factor": int(factor) if whole else factor}
    raise FormatError(
        f"the {family} model's rope scaling ({args.rope_scaling!r}) is not one Megatron-Core "
        "applies (Llama 3.x's with low_freq_factor 1, high_freq_factor 4 and "
        "original_max_position_embeddings 8192, or linear): Megatron would run it unscaled",
        fix="Convert it with --to safetensors / dcp instead.",
    )


def megatron_args(
    args: ModelArgs, family: str, style: MegatronStyle = LLAMA_STYLE
) -> dict[str, Any]:
    """Megatron-LM's argument names for a model (what an import keeps as `args` in
    `common.pt`, so an export of it needs no --config)."""
    heads = int(args.require("n_heads", family, "Megatron's args name it"))
    dim = int(args.require("dim", family, "Megatron's args name it"))
    groups = int(args.n_kv_heads or heads)
    return {
        "num_layers": args.require("n_layers", family, "Megatron's args name it"),
        "hidden_size": dim,
        "ffn_hidden_size": args.require("ffn_dim", family, "Megatron's args name it"),
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": args.head_dim or dim // heads,
        "padded_vocab_size": args.require("vocab_size", family, "Megatron's args name it"),
        "max_position_embeddings": args.max_position_embeddings or 4096,
        "position_embedding_type": "rope",
        "rotary_base": args.rope_theta if args.rope_theta is not None else 10000.0,
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "normalization": "RMSNorm",
        "norm_epsilon": args.norm_eps if args.norm_eps is not None else 1e-5,
        "swiglu": True,
        "add_bias_linear": False,
        **style.flags,
        "untie_embeddings_and_output_weights": not args.tie_embeddings,
        "bf16": args.dtype in ("bfloat16", "bf16"),
        "fp16": args.dtype in ("float16", "fp16"),
        **_megatron_rope_args(args, family),
    }


def common_pt(args: ModelArgs, family: str, style: MegatronStyle = LLAMA_STYLE) -> bytes:
    """`common.pt` of an imported model: what Megatron-LM's `save_checkpoint` keeps there for a
    fresh start (iteration 0, the checkpoint version, `args` as an `argparse.Namespace`)."""
    import torch

    buffer = io.BytesIO()
    state = {
        "args": argparse.Namespace(**megatron_args(args, family, style)),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
    }
    torch.save(state, buffer)
    return buffer.getvalue()


def metadata_json() -> bytes:
    """`metadata.json` as `dist_checkpointing.save` writes it for the torch_dist backend."""
    return json.dumps(MEGATRON_METADATA_JSON).encode()


def args_from_checkpoint(checkpoint: Checkpoint, style: MegatronStyle = LLAMA_STYLE) -> ModelArgs:
    """The model args of a Megatron save's `common.pt` `args` (Megatron-LM's arguments,
    an `argparse.Namespace` or a dict), loaded with ckpt's restricted loader. Empty when the
    save has none or they cannot be read safely: the rules needing them then ask for
    --config. A model not of the family's `style` is refused (`args_from_megatron`)."""
    from ..errors import CkptError
    from ..formats.dcp.layout import MEGATRON_COMMON
    from ..formats.torch.inert import InertObject
    from ..formats.torch.load import load_torch_file

    storage = checkpoint.storage
    if not storage.exists(MEGATRON_COMMON):
        return ModelArgs()
    try:
        common, _ = load_torch_file(storage, MEGATRON_COMMON)
    except CkptError:
        return ModelArgs()
    args = common.get("args") if isinstance(common, dict) else None
    if isinstance(args, InertObject):
        args = args.state
    if not isinstance(args, dict):
        return ModelArgs()
    where = storage.describe(MEGATRON_COMMON)
    return checked_args(
        lambda: args_from_megatron(args, where, style),
        where,
        "Megatron's args",
        MEGATRON_KEYS,
        "The save's common.pt is damaged or was edited: restore it from the run that wrote "
        "it (Megatron-LM writes the same args in every save of the run).",
    )


#: Megatron-LM's name of each model arg, for errors
MEGATRON_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "vocab_size": "padded_vocab_size",
    "ffn_dim": "ffn_hidden_size",
    "norm_eps": "norm_epsilon",
    "rope_theta": "rotary_base",
}


def naming_output(args: ModelArgs, family: str, style: MegatronStyle = LLAMA_STYLE) -> NamingOutput:
    """What an import into the megatron naming writes beside the tensors: `common.pt`,
    `metadata.json`, every layer's empty `_extra_state` (Megatron-Core stores a
    ShardedObject's value as a one-element list), and the layer stacks one chunk per layer."""
    layers = int(args.require("n_layers", family, "Megatron's load asks for every layer"))
    stacks = [r.native[0] for r in style.rules if isinstance(r, LayerTensor)]
    return NamingOutput(
        files={
            MEGATRON_COMMON_PT: common_pt(args, family, style),
            MEGATRON_METADATA: metadata_json(),
        },
        objects={name: [None] for name in extra_state_names(layers)},
        split_dim0=dict.fromkeys(stacks, layers),
    )


def extra_state_names(num_layers: int) -> list[str]:
    """The per-layer `_extra_state` ShardedObject keys Megatron-Core's load asks for."""
    return [
        f"decoder.layers.{module}._extra_state/shard_{layer}_{num_layers}"
        for module in EXTRA_STATE_MODULES
        for layer in range(num_layers)
    ]
