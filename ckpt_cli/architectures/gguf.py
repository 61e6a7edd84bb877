"""llama.cpp's GGUF naming of a Llama, a Mixtral, a Qwen2, a Qwen3 and a Qwen3-MoE, and the
model args its metadata holds.

llama.cpp's `convert_hf_to_gguf.py` writes a `LlamaForCausalLM` (and a Mistral, which it
converts as a Llama) under its own names: `model.layers.0.self_attn.q_proj.weight` becomes
`blk.0.attn_q.weight`. It reorders the q and k rows of each head into the interleaved rotary
layout (`LlamaModel.permute`, what ggml's rope of a `llama` file expects), so on the way back
they are permuted into transformers' halves layout (`RotaryPermute`, exactly what
transformers' own GGUF loader's `_reverse_permute_weights` does). The rest are renames. A
Qwen3 (`qwen3` files: ggml's NEOX rope, the halves layout) is written with its rows as they
are, and its q/k norms as `attn_q_norm` / `attn_k_norm`: renames only. A Qwen2 (and Qwen2.5:
`qwen2` files, NEOX rope too) is a Llama with q/k/v biases (`attn_q.bias`...): renames only.
A Qwen3-MoE (`qwen3moe`) is a Qwen3 whose MLP is a router (`ffn_gate_inp`) and experts,
stacked per layer (`ffn_gate_exps` `[E, F, D]`...) where transformers' files hold one tensor
per expert: unstacked, each expert read from its own box. A Mixtral is a `llama` file (q/k
permuted) with a router and expert stacks in place of the dense MLP: which family a `llama`
file is, its tensors tell (`ARCHITECTURES` lists both).

A GGUF holds no `config.json`: the model's settings are metadata key-values
(`llama.block_count`, `llama.attention.head_count`, `llama.rope.freq_base`...), read here into
`ModelArgs` (`args_from_metadata`). What a Llama `config.json` cannot say is refused rather
than dropped: partial rotary, a rope scaling transformers' Llama has no spelling of, head
counts that differ per layer. Llama 3.1's rope scaling is stored by llama.cpp as a table of
per-frequency factors (`rope_freqs.weight`) rather than as metadata: it is recognised as the
table llama.cpp computes from a `rope_type: llama3` scaling, or refused.

Only `general.architecture` values in `ARCHITECTURES` are mapped; any other GGUF is refused
naming its architecture (`unmapped`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import FormatError
from .base import ModelArgs

if TYPE_CHECKING:
    from ..formats.base import Checkpoint

#: the naming token of llama.cpp's tensor names
GGUF = "gguf"

#: llama.cpp `general.architecture` -> the family tokens whose `gguf` naming maps it (its
#: tensors tell which: a `llama` file with expert stacks is a Mixtral)
ARCHITECTURES = {
    "llama": ("llama3", "mixtral"),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "qwen3moe": ("qwen3-moe",),
}

#: (Hugging Face pattern, llama.cpp pattern) of the tensors renamed as they are
RENAMES = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.layers.{layer}.self_attn.v_proj.weight", "blk.{layer}.attn_v.weight"),
    ("model.layers.{layer}.self_attn.o_proj.weight", "blk.{layer}.attn_output.weight"),
    ("model.layers.{layer}.input_layernorm.weight", "blk.{layer}.attn_norm.weight"),
    ("model.layers.{layer}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{layer}.mlp.gate_proj.weight", "blk.{layer}.ffn_gate.weight"),
    ("model.layers.{layer}.mlp.up_proj.weight", "blk.{layer}.ffn_up.weight"),
    ("model.layers.{layer}.mlp.down_proj.weight", "blk.{layer}.ffn_down.weight"),
)
#: the q and k projections, rows permuted by llama.cpp's `LlamaModel.permute`
Q = ("model.layers.{layer}.self_attn.q_proj.weight", "blk.{layer}.attn_q.weight")
K = ("model.layers.{layer}.self_attn.k_proj.weight", "blk.{layer}.attn_k.weight")
#: Qwen3's per-head q/k RMSNorms
QK_NORMS = (
    ("model.layers.{layer}.self_attn.q_norm.weight", "blk.{layer}.attn_q_norm.weight"),
    ("model.layers.{layer}.self_attn.k_norm.weight", "blk.{layer}.attn_k_norm.weight"),
)
#: Qwen2's q/k/v projection biases
QKV_BIASES = (
    ("model.layers.{layer}.self_attn.q_proj.bias", "blk.{layer}.attn_q.bias"),
    ("model.layers.{layer}.self_attn.k_proj.bias", "blk.{layer}.attn_k.bias"),
    ("model.layers.{layer}.self_attn.v_proj.bias", "blk.{layer}.attn_v.bias"),
)
#: an MoE layer's router
ROUTER = ("model.layers.{layer}.mlp.gate.weight", "blk.{layer}.ffn_gate_inp.weight")
#: an MoE layer's experts, stacked `[E, F, D]` (`[E, D, F]` down) by llama.cpp
EXPERTS = (
    ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "blk.{layer}.ffn_gate_exps.weight"),
    ("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", "blk.{layer}.ffn_up_exps.weight"),
    ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", "blk.{layer}.ffn_down_exps.weight"),
)  # fmt: skip
#: Mixtral's router and experts (w1 gate, w3 up, w2 down), stacked the same way
MIXTRAL_ROUTER = ("model.layers.{layer}.block_sparse_moe.gate.weight", ROUTER[1])
MIXTRAL_EXPERTS = (
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", EXPERTS[0][1]),
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", EXPERTS[1][1]),
    ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", EXPERTS[2][1]),
)
#: ...and one tensor per expert, llama.cpp's layout before April 2024 (most published Mixtral
#: GGUFs), which its loader still reads
MIXTRAL_EXPERTS_APART = (
    (MIXTRAL_EXPERTS[0][0], "blk.{layer}.ffn_gate.{expert}.weight"),
    (MIXTRAL_EXPERTS[1][0], "blk.{layer}.ffn_up.{expert}.weight"),
    (MIXTRAL_EXPERTS[2][0], "blk.{layer}.ffn_down.{expert}.weight"),
)
#: llama.cpp's table of rotary frequency factors (Llama 3.1's rope scaling)
ROPE_FREQS = "rope_freqs.weight"

#: llama.cpp's defaults for what a Llama GGUF may leave out (llama-model.cpp)
_DEFAULT_ROPE_THETA = 10000.0
#: llama.cpp's defaults for a `rope_type: llama3` scaling's fields (convert_hf_to_gguf.py),
#: which are also those of every Llama 3.x Meta released
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def to_hf_names(shapes: Mapping[str, Sequence[int]]) -> dict[str, Sequence[int]]:
    """`shapes` under the Hugging Face names of the tensors this naming renames (the others
    dropped): what the family's shape rules read."""
    import re

    out: dict[str, Sequence[int]] = {}
    for hf, native in (*RENAMES, Q, K, *QK_NORMS, *QKV_BIASES, ROUTER, *EXPERTS):
        regex = re.compile(re.escape(native).replace(r"\{layer\}", r"(\d+)") + r"\Z")
        for name, shape in shapes.items():
            m = regex.match(name)
            if not m:
                continue
            if "{expert}" in hf:  # a stack of experts: the shape of its first
                out[hf.format(layer=int(m.group(1)), expert=0)] = shape[1:]
            else:
                out[hf.format(layer=int(m.group(1))) if m.groups() else hf] = shape
    return out


def gguf_architecture(checkpoint: Checkpoint) -> str | None:
    """`general.architecture` of a GGUF source; None for any other format."""
    return checkpoint.recorded_architecture()


def unmapped(checkpoint: Checkpoint, target: str) -> FormatError | None:
    """The error for a GGUF whose `general.architecture` no family's `gguf` naming maps (a
    `gemma`, a `phi3`...); None for any other source."""
    architecture = gguf_architecture(checkpoint)
    if architecture is None or architecture in ARCHITECTURES:
        return None
    return FormatError(
        f"is a GGUF of llama.cpp architecture {architecture or '(none)'!r}, which ckpt does not "
        f"map to the {target} naming (it maps: {', '.join(ARCHITECTURES)}; llama.cpp gives "
        "Llama, Mistral and Mixtral models the architecture llama)",
        path=checkpoint.manifest.location,
        fix="Convert it with --to safetensors (add --dequantize for quantized tensors) to keep "
        "llama.cpp's names, or load it with transformers' own GGUF support "
        "(AutoModelForCausalLM.from_pretrained(FOLDER, gguf_file=NAME)) and save_pretrained it.",
    )


def tokenizer_note(checkpoint: Checkpoint, dest_naming: str) -> str | None:
    """The warning that a GGUF's tokenizer (`tokenizer.ggml.*` metadata) is not written into
    the exported model folder, and how to write it; None when it holds none."""
    if gguf_architecture(checkpoint) is None:
        return None
    metadata = checkpoint.manifest.details.get("metadata") or {}
    if not any(str(k).startswith("tokenizer.ggml.") for k in metadata):
        return None
    where = checkpoint.manifest.location
    files = checkpoint.manifest.files
    # the file transformers reads (of a split set, the first), named inside its folder
    name = files[0].path.rsplit("/", 1)[-1] if files else where.rstrip("/").rsplit("/", 1)[-1]
    return (
        f"{where}: the GGUF's tokenizer (its tokenizer.ggml.* metadata) is not written into the "
        f"{dest_naming} model folder; write it with transformers: "
        f"AutoTokenizer.from_pretrained(FOLDER, gguf_file={name!r}).save_pretrained(DEST)"
    )


def refuse_misfit(
    checkpoint: Checkpoint, args: ModelArgs, found: ModelArgs, conflicts: list[str]
) -> None:
    """Refuse metadata (`args`) that contradicts the tensors: the sizes the shapes give
    (`found`; the vocabulary is the embedding's rows whatever the metadata says), and the rows
    the head counts and widths imply (`conflicts`, the family's
    `shape_conflicts`). A q/k projection permuted per a wrong head count, under a config.json
    `from_pretrained` refuses, would be written otherwise.

    Raises:
        FormatError: naming the first contradiction.
    """
    misfits = [
        f"{key}={getattr(args, key)}, where the tensors have {key}={getattr(found, key)}"
        # llama.cpp checks these as it loads (the expert count: its router's rows)
        for key in ("dim", "n_layers", "ffn_dim", "num_experts")
        if getattr(args, key) is not None
        and getattr(found, key) is not None
        and getattr(args, key) != getattr(found, key)
    ]
    experts = found.num_experts or args.num_experts
    if experts and args.experts_per_token and args.experts_per_token > experts:
        misfits.append(
            f"experts_per_token={args.experts_per_token}, more than the {experts} experts "
            "the router picks among"
        )
    misfits += conflicts
    if misfits:
        more = f" (and {len(misfits) - 1} more)" if len(misfits) > 1 else ""
        raise FormatError(
            f"the GGUF's metadata does not fit its tensors: {misfits[0]}{more}",
            path=checkpoint.manifest.location,
            fix="The file's metadata is damaged or was edited: convert the model to GGUF again.",
        )


def _float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores float32: its
    1e-05 is 9.999999747378752e-06 as a double; the model computes with the float32)."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == packed:
            return short
    return value


def args_from_metadata(checkpoint: Checkpoint, family: str, title: str) -> ModelArgs:
    """The model args a GGUF's metadata holds (`llama.block_count`, head counts, rotary base
    and scaling, norm epsilon, context length, token ids).

    Raises:
        FormatError: a setting the Hugging Face model cannot hold (partial rotary, per-layer
            head counts, a rope scaling other than linear or Llama 3's), an architecture
            this naming does not map, or one that is not the family `family` whose tensor
            names these are.
    """
    where = checkpoint.manifest.location
    architecture = gguf_architecture(checkpoint) or ""
    error = unmapped(checkpoint, "hf")
    if error is not None:
        raise error
    if family not in ARCHITECTURES[architecture]:
        raise FormatError(
            f"is a GGUF of llama.cpp architecture {architecture!r}, but its tensors are "
            f"named as a {title} model's: the file's metadata and tensors disagree",
            path=where,
            fix="Convert the model to GGUF again, or convert it with --to safetensors to keep "
            "llama.cpp's names.",
        )
    metadata: Mapping[str, Any] = checkpoint.manifest.details.get("metadata") or {}

    def key(name: str) -> Any:
        return metadata.get(f"{architecture}.{name}")

    def refuse(what: str) -> FormatError:
        return FormatError(
            f"the GGUF's metadata says {what}, which a Hugging Face {title} model cannot hold",
            path=where,
            fix="Load it with the runtime that reads it (llama.cpp), or convert it with "
            "--to safetensors to keep llama.cpp's names and settings.",
        )

    def no_model(name: str, value: object, why: str) -> FormatError:
        # a value no model has (0 heads, a NaN rotary base): damage, refused as a
        # config.json's are (`checked_args`), before any rule divides by it
        return FormatError(
            f"the GGUF's metadata says {architecture}.{name} = {value!r}, a value no model has "
            f"({why})",
            path=where,
            fix="The file's metadata is damaged or was edited: convert the model to GGUF again.",
        )

    def integer(name: str, *, positive: bool = True) -> int | None:
        value = key(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise refuse(f"{architecture}.{name} = {value!r} (one value per layer, or no integer)")
        if value < 0 or (positive and value == 0):
            raise no_model(name, value, "a count or width is positive")
        return value

    def number(name: str) -> float | None:
        value = key(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise refuse(f"{architecture}.{name} = {value!r} (no number)")
        if not (math.isfinite(value) and value >= 0):
            raise no_model(name, value, "it is a finite number, 0 or more")
        return _float32(float(value))

    dim = integer("embedding_length")
    heads = integer("attention.head_count")
    kv_heads = integer("attention.head_count_kv")
    head_dim = integer("attention.key_length") or (dim // heads if dim and heads else None)
    value_dim = integer("attention.value_length")
    if value_dim is not None and head_dim is not None and value_dim != head_dim:
        raise refuse(f"attention.value_length {value_dim} != attention.key_length {head_dim}")
    rotary = integer("rope.dimension_count")
    if rotary is not None and head_dim is not None and rotary != head_dim:
        raise refuse(
            f"{architecture}.rope.dimension_count = {rotary}: rotary over {rotary} of each "
            f"head's {head_dim} dimensions (partial rotary)"
        )
    theta = number("rope.freq_base")
    theta = _DEFAULT_ROPE_THETA if theta is None else theta
    scaling = _rope_scaling(checkpoint, architecture, key, number, theta, head_dim, refuse)
    tokens = (
        metadata.get("tokenizer.ggml.bos_token_id"),
        metadata.get("tokenizer.ggml.eos_token_id"),
    )
    bos, eos = (t if isinstance(t, int) and not isinstance(t, bool) else None for t in tokens)
    experts = integer("expert_count", positive=False)  # 0: a dense model
    moe: dict[str, Any] = {}
    if experts:
        moe = {
            "num_experts": experts,
            "experts_per_token": integer("expert_used_count"),
            "moe_ffn_dim": integer("expert_feed_forward_length"),
            # llama.cpp's qwen3moe graph renormalises the top-k weights, whatever the
            # original config said (transformers' own GGUF load sets it so too)
            "norm_topk_prob": True,
        }
    return ModelArgs(
        dim=dim,
        n_layers=integer("block_count"),
        n_heads=heads,
        n_kv_heads=kv_heads if kv_heads is not None else heads,
        head_dim=head_dim,
        ffn_dim=integer("feed_forward_length"),
        vocab_size=integer("vocab_size"),
        norm_eps=number("attention.layer_norm_rms_epsilon"),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=integer("context_length"),
        bos_token_id=bos,
        eos_token_id=eos,
        **moe,
    )


def _rope_scaling(
    checkpoint: Checkpoint,
    architecture: str,
    key: Any,
    number: Any,
    theta: float,
    head_dim: int | None,
    refuse: Any,
) -> dict[str, Any] | None:
    """The Hugging Face `rope_scaling` of a GGUF: llama.cpp's `rope.scaling.type` linear, or
    the llama3 scaling its `rope_freqs.weight` table was computed from; None for none."""
    kind = key("rope.scaling.type")
    if kind not in (None, "none"):
        factor = number("rope.scaling.factor")
        if kind != "linear" or factor is None:
            raise refuse(f"{architecture}.rope.scaling.type = {kind!r}")
        return {"rope_type": "linear", "factor": factor}
    if ROPE_FREQS not in checkpoint.manifest.by_name:
        return None
    table = [float(x) for x in checkpoint.read_tensor(ROPE_FREQS).float().reshape(-1).tolist()]
    scaling = _llama3_scaling(table, theta, head_dim) if head_dim else None
    if scaling is None:
        raise refuse(
            f"rotary frequency factors ({ROPE_FREQS!r}) that are not the table llama.cpp "
            "computes from a Llama 3 rope scaling (rope_type llama3, low_freq_factor 1, "
            "high_freq_factor 4, original_max_position_embeddings 8192)"
        )
    return scaling


def _llama3_scaling(table: list[float], theta: float, head_dim: int) -> dict[str, Any] | None:
    """The `rope_type: llama3` scaling whose factors llama.cpp's converter writes as `table`
    (`LlamaModel.generate_extra_tensors`), with its default low/high frequency factors and
    original context; None when no such scaling gives the table."""
    if len(table) != head_dim // 2 or not table:
        return None
    factor = max(table)
    low_wavelen = _LLAMA3_ORIGINAL / _LLAMA3_LOW
    high_wavelen = _LLAMA3_ORIGINAL / _LLAMA3_HIGH
    for i, stored in enumerate(table):
        # float32 as llama.cpp's converter computes the frequencies (torch.float32 arange)
        freq = 1.0 / (_as_float32(theta) ** _as_float32(2 * i / head_dim))
        wavelen = 2 * math.pi / _as_float32(freq)
        if wavelen < high_wavelen:
            want = 1.0
        elif wavelen > low_wavelen:
            want = factor
        else:
            smooth = (_LLAMA3_ORIGINAL / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
            want = 1 / ((1 - smooth) / factor + smooth)
        if not math.isclose(stored, want, rel_tol=1e-5):
            return None
    return {
        "rope_type": "llama3",
        "factor": _float32(factor),
        "low_freq_factor": _LLAMA3_LOW,
        "high_freq_factor": _LLAMA3_HIGH,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL,
    }


def _as_float32(value: float) -> float:
    """`value` rounded to float32."""
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result
