"""The model-architecture seam: one family's tensors under two framework namings.

A checkpoint's weights are named by the framework that saved them: torchtitan's
`layers.0.attention.qkv_linear.wq.weight` is Hugging Face's
`model.layers.0.self_attn.q_proj.weight`, with its rows permuted between the two rotary
layouts. An `Architecture` (one module per family: Llama 3, Qwen3, ...) declares that
correspondence as `TensorRule`s, one per kind of tensor, each between the Hugging Face name
(`hf`, the pivot every naming maps to and from) and one framework's name (`native`):

- `Rename`: the same tensor under another name (bytes copied as stored);
- `RotaryPermute`: q/k projection rows reordered between the interleaved (complex) and the
  halves (rotate_half) rotary layouts;
- `Experts`: an MoE layer's experts stacked in one `[E, ...]` tensor natively, one tensor per
  expert in Hugging Face's files.

Planning (`Architecture.plan`) reads names and shapes only (no torch) and yields one
`MappedTensor` per output tensor: the source pieces it is built from (a whole tensor, or a
box of one) and how they combine. Reading one (`MappedTensor.read`) touches only its own
pieces, so a conversion streams: one input tensor to its outputs, or N inputs to one output,
and peak memory is bounded by the largest output (plus one piece).

The Megatron family adds its own rules (fused QKV and gate/up splits) by subclassing
`TensorRule`: a rule sees every source name its patterns match at once (`TensorRule.plan`),
so N-to-1 and 1-to-N rules are as natural as renames.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import ConfigDict, ValidationError

from ..errors import FormatError
from ..models import Record

if TYPE_CHECKING:
    import torch

    from ..formats.base import Checkpoint


class TensorReads(Protocol):
    """Where `MappedTensor.read` reads its pieces: a `Checkpoint`, or a reader over one."""

    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """The box `offsets`/`sizes` of tensor `name`."""


#: experts a layer may hold (the largest MoE models have a few hundred): every expert number
#: below the highest is mapped, so a tensor named or shaped for 10**11 chose the work
MAX_EXPERTS = 1 << 16


def _check_expert_count(count: int, what: str) -> None:
    """FormatError when a layer's expert count, as `what` says it, is past `MAX_EXPERTS`."""
    if count > MAX_EXPERTS:
        raise FormatError(
            f"{what}: more than the {MAX_EXPERTS:,} experts a layer may hold in ckpt (no model "
            "has that many: a corrupt or crafted checkpoint or config.json)",
            fix="Convert a checkpoint as its framework saved it (every expert numbered from 0), "
            "with the config.json its model was saved with.",
        )


#: the naming every architecture maps to and from (transformers' `from_pretrained` names)
HF = "hf"
#: framework namings a family may declare beside `hf`
NATIVE_NAMINGS = ("torchtitan", "megatron")
#: every naming token (`--to hf`, `--to torchtitan`; `inspect`'s `naming`)
NAMINGS = (HF, *NATIVE_NAMINGS)

Direction = Literal["to_hf", "from_hf"]


#: the args that count or measure something (a source giving 0 or less is no model's)...
POSITIVE_ARGS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "vocab_size",
    "ffn_dim",
    "max_position_embeddings",
    "num_experts",
    "experts_per_token",
    "moe_ffn_dim",
)
#: ... and the real-valued ones
FINITE_ARGS = ("norm_eps", "rope_theta")
#: the Hugging Face config.json key each arg comes from, for errors
HF_CONFIG_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "experts_per_token": "num_experts_per_tok",
    "moe_ffn_dim": "moe_intermediate_size",
    "norm_eps": "rms_norm_eps",
}


def checked_args(
    build: Callable[[], ModelArgs], where: str, what: str, keys: Mapping[str, str], fix: str
) -> ModelArgs:
    """The args `build` reads from a source's own record of them (`what`: `config.json`,
    Megatron's `args`), refusing values no model has: a count or width that is no positive
    integer (`"hidden_size": "abc"`, 0 heads, 2.5 layers), a rotary base or norm epsilon that
    is no finite number. `keys` names each arg as the source does, and `fix` says what to do,
    for the error.

    Raises:
        FormatError: naming `where`, the key and its value, before any rule divides by it.
    """

    def bad(field_name: str | None, value: object, why: str) -> FormatError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        key = keys.get(field_name, field_name) if field_name is not None else None
        said = f"{key}={shown}" if key is not None else "a value"
        return FormatError(
            f"in {what}, {said} is a value no model has ({why})",
            path=where,
            fix=fix,
        )

    try:
        args = build()
    except ValidationError as e:
        first = e.errors()[0]
        field_name = str(first["loc"][0]) if first["loc"] else None
        raise bad(field_name, first["input"], first["msg"].lower()) from None
    except (TypeError, ValueError, ArithmeticError) as e:
        raise bad(None, None, str(e)) from None
    for field_name in POSITIVE_ARGS:
        value = getattr(args, field_name)
        if value is not None and value <= 0:
            raise bad(field_name, value, "a count or width is positive")
    for field_name in FINITE_ARGS:
        value = getattr(args, field_name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise bad(field_name, value, "it is a finite number, 0 or more")
    return args


class ModelArgs(Record):
    """What a family needs to know about one model beyond its tensor names and shapes.

    Shapes tell most of it (`dim`, `vocab_size`, `n_layers`, `ffn_dim`); the head count, the
    rotary base and the norm epsilon are not in the weights and come from a Hugging Face
    `config.json` (`--config`, or an HF source's own). None means unknown; a rule that needs
    an unknown value fails naming it (`require`).

    Attributes:
        dim: hidden size.
        n_layers: transformer blocks.
        n_heads / n_kv_heads / head_dim: attention heads, key/value heads (GQA), head width.
        vocab_size: embedding rows.
        ffn_dim: the dense MLP's hidden width.
        norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        rope_scaling: the Hugging Face `rope_scaling` dict (`rope_type: llama3` ...), if any.
        max_position_embeddings: context length the rotary tables are built for.
        tie_embeddings: the output projection is the embedding (no `lm_head` stored).
        num_experts / experts_per_token / moe_ffn_dim: MoE layers (None for dense models).
        norm_topk_prob: the router renormalises the top-k scores (MoE).
        dtype: the weights' dtype token (`bf16`...), for `config.json`'s `torch_dtype`.
        bos_token_id / eos_token_id: the tokenizer's begin and end of sequence token ids
            (a GGUF's metadata names them), for `config.json` (generation stops at the eos).
        config: the Hugging Face `config.json` these args came from, when one was given: an
            export writes it unchanged rather than one rebuilt from the args.
        widths: what a family's shapes tell beyond these, by its own names (Flux's input
            widths and single-stream block count), for its `hf_config`.
    """

    model_config = ConfigDict(frozen=True)

    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    ffn_dim: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None
    tie_embeddings: bool | None = None
    num_experts: int | None = None
    experts_per_token: int | None = None
    moe_ffn_dim: int | None = None
    norm_topk_prob: bool | None = None
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    config: dict[str, Any] | None = None
    widths: dict[str, int] | None = None

    def merged(self, other: ModelArgs) -> ModelArgs:
        """These args with every value `other` knows and these do not."""
        known = {k: v for k, v in other.model_dump().items() if v is not None}
        mine = {k: v for k, v in self.model_dump().items() if v is not None}
        return ModelArgs(**{**known, **mine})

    def require(self, field_name: str, family: str, why: str) -> Any:
        """The value of `field_name`, or a FormatError (exit 4) naming it and how to give it."""
        value = getattr(self, field_name)
        if value is None:
            raise FormatError(
                f"the {family} mapping needs {field_name} ({why}), which the weights do not tell",
                fix="Pass --config with the model's Hugging Face config.json (a file, a folder "
                "or hf://org/model), or --flavor with the torchtitan flavor it was trained as.",
            )
        return value


@dataclass(frozen=True)
class Piece:
    """A source tensor, or the box `offsets`/`sizes` of it, that an output is built from."""

    source: str
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    #: drop the leading dimension of the box (one expert of a stacked `[E, ...]` tensor)
    squeeze: bool = False


@dataclass(frozen=True)
class MappedTensor:
    """One output tensor of a mapping: its name, shape and dtype, and how it is built.

    Attributes:
        name: the output name.
        shape / dtype: as written (dtype is the source's: a mapping never casts).
        pieces: the source tensors (or boxes) read, in order.
        combine: `one` (the single piece as is), `concat` (along dim `axis`), `stack` (a new
            leading dim, experts) or `zeros` (no pieces: a state the target naming holds and
            the source has none of, at its fresh-start value; see `Filled`).
        permute: rotary row permutation applied after combining: `to_halves` (interleaved
            -> rotate_half, torchtitan -> HF) or `to_interleaved`, with `heads` groups.
        heads: the head count `permute` works per.
        transform: the name of the transform for reports (`rename`, `rotary-permute`,
            `unstack-experts`, `stack-experts`...).
        axis: the dim `concat` joins the pieces along (0: rows; 1: Qwen3.5's experts' gate
            and up projections side by side in one `[E, 2F, D]` tensor).
        reshape: the combined tensor is viewed as `shape`, its elements in the same order
            (torchtitan's `Linear` patch embedding `[out, C*T*P*P]` is transformers'
            `Conv3d` weight `[out, C, T, P, P]`): the same bytes under another shape.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    combine: Literal["one", "concat", "stack", "zeros"] = "one"
    permute: Literal["to_halves", "to_interleaved"] | None = None
    heads: int = 0
    transform: str = "rename"
    axis: int = 0
    reshape: bool = False

    @property
    def verbatim(self) -> bool:
        """The output is one whole source tensor unchanged, shape and all (its source's entry
        can stand for it; a reshaped one is the same bytes under a shape of its own)."""
        if len(self.pieces) != 1 or self.combine != "one" or self.reshape:
            return False
        return self.pieces[0].offsets is None and self.permute is None

    @property
    def sources(self) -> list[str]:
        """The distinct source names read, in order."""
        return list(dict.fromkeys(p.source for p in self.pieces))

    def read(self, checkpoint: TensorReads) -> torch.Tensor:
        """Build this tensor from `checkpoint`, reading only its pieces."""
        import torch

        if self.combine == "zeros":
            from ..tensors import torch_dtype

            return torch.zeros(self.shape, dtype=torch_dtype(self.dtype))
        parts = []
        for piece in self.pieces:
            if piece.offsets is None or piece.sizes is None:
                part = checkpoint.read_tensor(piece.source)
            else:
                part = checkpoint.read_slice(piece.source, list(piece.offsets), list(piece.sizes))
            parts.append(part.squeeze(0) if piece.squeeze else part)
        if self.combine == "one":
            out = parts[0]
        elif self.combine == "concat":
            out = torch.cat(parts, dim=self.axis)
        else:
            out = torch.stack(parts, dim=0)
        del parts
        if self.permute is not None:
            out = rotary_permute(out, self.heads, self.permute)
        if self.reshape:
            out = out.reshape(self.shape)
        return out.contiguous()


def rotary_permute(
    weight: torch.Tensor, heads: int, to: Literal["to_halves", "to_interleaved"]
) -> torch.Tensor:
    """Reorder each head's rows of a q/k projection between the rotary layouts.

    The interleaved (complex) layout pairs rows (0, 1), (2, 3)...; the halves (rotate_half)
    layout pairs row i with i + head_dim/2. These are the exact view/transpose/reshape of
    transformers' `convert_llama_weights_to_hf.py` (and torchtitan's adapter), so the bytes
    match theirs.
    """
    rows, cols = weight.shape[0], weight.shape[1] if weight.dim() > 1 else 1
    flat = weight.reshape(rows, cols)
    if to == "to_halves":
        out = flat.view(heads, rows // heads // 2, 2, cols).transpose(1, 2)
    else:
        out = flat.view(heads, 2, rows // heads // 2, cols).transpose(1, 2)
    return out.reshape(weight.shape).clone()


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class NamePattern:
    """A tensor-name pattern (`layers.{layer}.attention.wo.weight`, or a prefix such as
    `optimizer.`), matched as its regex (a named integer group per placeholder) would match.

    Recognising a model's family tries hundreds of patterns on its first names, and almost all
    of them fail on the literal text around the placeholders; compiling each regex cost most of
    a metadata command's recognition (#30). A name that lacks the literal head or tail is
    refused on those alone, and the regex is compiled on the first name that has them.
    """

    __slots__ = ("_regex", "head", "pattern", "prefix", "tail")

    def __init__(self, pattern: str, *, prefix: bool = False) -> None:
        self.pattern = pattern
        self.prefix = prefix
        pieces = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ..., literal
        self.head = pieces[0]
        self.tail = "" if prefix else pieces[-1]
        self._regex: re.Pattern[str] | None = None

    @property
    def regex(self) -> re.Pattern[str]:
        """The compiled regex (compiled on first use)."""
        if self._regex is None:
            if self.prefix:
                self._regex = re.compile(re.escape(self.pattern) + r".*\Z", re.DOTALL)
            else:
                out, last = [], 0
                for m in _PLACEHOLDER.finditer(self.pattern):
                    out.append(re.escape(self.pattern[last : m.start()]))
                    out.append(rf"(?P<{m.group(1)}>\d+)")
                    last = m.end()
                out.append(re.escape(self.pattern[last:]))
                self._regex = re.compile("".join(out) + r"\Z")
        return self._regex

    @property
    def compiled(self) -> bool:
        """Whether the regex has been compiled (a name had the literal head and tail)."""
        return self._regex is not None

    @property
    def groupindex(self) -> Mapping[str, int]:
        """The placeholders' group numbers, by name."""
        return self.regex.groupindex

    def match(self, name: str) -> re.Match[str] | None:
        """The match of the whole of `name`, or None."""
        if not name.startswith(self.head) or not name.endswith(self.tail):
            return None
        return self.regex.match(name)


#: every pattern made so far, by (pattern, prefix): the families' tables are fixed, so each is
#: made, and its regex compiled, once a process
NAME_PATTERNS: dict[tuple[str, bool], NamePattern] = {}


def compile_pattern(pattern: str, *, prefix: bool = False) -> NamePattern:
    """`layers.{layer}.attention.wo.weight` as a `NamePattern`: a named integer group per
    placeholder (`{layer}`, `{expert}`); with `prefix`, every name that starts with `pattern`."""
    key = (pattern, prefix)
    made = NAME_PATTERNS.get(key)
    if made is None:
        made = NAME_PATTERNS[key] = NamePattern(pattern, prefix=prefix)
    return made


def numbers_held(
    names: Iterable[str], patterns: Sequence[str], key: str = "layer"
) -> dict[str, set[int]]:
    """Per pattern, the numbers its `{key}` placeholder takes in `names` (0 for a pattern with
    none): which layers (or vision blocks) hold which tensors. A name counts for the first
    pattern it matches."""
    compiled = {p: compile_pattern(p) for p in dict.fromkeys(patterns)}
    held: dict[str, set[int]] = {p: set() for p in compiled}
    for name in names:
        for pattern, regex in compiled.items():
            m = regex.match(name)
            if m:
                held[pattern].add(int(m.group(key)) if key in regex.groupindex else 0)
                break
    return held


@dataclass(frozen=True)
class Match:
    """A source tensor a rule's pattern matched: its name, shape, dtype and placeholders."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    groups: Mapping[str, int]
    #: which of the rule's source-side patterns matched (rules with several, e.g. q/k/v)
    pattern: int = 0


@dataclass(frozen=True)
class TensorRule(ABC):
    """One kind of tensor under the Hugging Face naming and one native naming.

    `hf` and `native` are name patterns with `{layer}` / `{expert}` placeholders; a rule
    with several tensors on one side (a fused QKV) lists several. `plan` gets every source
    tensor the source side's patterns matched, at once, and returns the outputs.
    """

    hf: tuple[str, ...]
    native: tuple[str, ...]

    def source_patterns(self, direction: Direction) -> tuple[str, ...]:
        """The patterns matched against the source's names."""
        return self.native if direction == "to_hf" else self.hf

    def target_patterns(self, direction: Direction) -> tuple[str, ...]:
        """The patterns the outputs are named by."""
        return self.hf if direction == "to_hf" else self.native

    @abstractmethod
    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        """The outputs built from `matches` (every source tensor this rule matched)."""

    @property
    def transform(self) -> str:
        """This rule's transform, for reports."""
        return "rename"


def one(pattern: str) -> tuple[str, ...]:
    """A single pattern as a rule side."""
    return (pattern,)


@dataclass(frozen=True)
class Rename(TensorRule):
    """The same tensor under another name: bytes copied as stored."""

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        target = self.target_patterns(direction)[0]
        return [
            MappedTensor(
                name=target.format(**m.groups),
                shape=m.shape,
                dtype=m.dtype,
                pieces=(Piece(m.name),),
            )
            for m in matches
        ]


@dataclass(frozen=True)
class RotaryPermute(TensorRule):
    """A q or k projection whose rows the native naming keeps in the interleaved rotary layout
    (torchtitan's complex RoPE) and Hugging Face in halves (`rotate_half`).

    `heads` names the ModelArgs field holding the head count the rows are grouped by
    (`n_heads` for q, `n_kv_heads` for k).
    """

    heads: str = "n_heads"

    @property
    def transform(self) -> str:
        return "rotary-permute"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        target = self.target_patterns(direction)[0]
        heads = int(args.require(self.heads, family, "the rotary permutation works per head"))
        out = []
        for m in matches:
            if not m.shape or m.shape[0] % (2 * heads):
                raise FormatError(
                    f"tensor {m.name!r} has {m.shape[0] if m.shape else 0} rows, not a multiple "
                    f"of 2 x {self.heads}={heads}: it cannot be rotary-permuted",
                    fix="Check --config: its head counts must match the weights.",
                )
            out.append(
                MappedTensor(
                    name=target.format(**m.groups),
                    shape=m.shape,
                    dtype=m.dtype,
                    pieces=(Piece(m.name),),
                    permute="to_halves" if direction == "to_hf" else "to_interleaved",
                    heads=heads,
                    transform=self.transform,
                )
            )
        return out


@dataclass(frozen=True)
class Experts(TensorRule):
    """An MoE weight stacked natively as one `[E, ...]` tensor per layer (`native` without
    `{expert}`), stored per expert by Hugging Face (`hf` with `{expert}`).

    To HF each expert's output reads only its own box of the stacked tensor; from HF the
    experts of a layer are stacked into one output (all E must be present).
    """

    @property
    def transform(self) -> str:
        return "experts"

    def plan(
        self, matches: Sequence[Match], direction: Direction, args: ModelArgs, family: str
    ) -> list[MappedTensor]:
        out: list[MappedTensor] = []
        if direction == "to_hf":
            target = self.hf[0]
            for m in matches:
                experts, rest = m.shape[0], m.shape[1:]
                _check_expert_count(experts, f"{m.name!r} stacks {experts:,} experts")
                for e in range(experts):
                    out.append(
                        MappedTensor(
                            name=target.format(**m.groups, expert=e),
                            shape=tuple(rest),
                            dtype=m.dtype,
                            pieces=(
                                Piece(m.name, (e, *([0] * len(rest))), (1, *rest), squeeze=True),
                            ),
                            transform="unstack-experts",
                        )
                    )
            return out
        target = self.native[0]
        by_layer: dict[tuple[tuple[str, int], ...], dict[int, Match]] = {}
        for m in matches:
            key = tuple(sorted((k, v) for k, v in m.groups.items() if k != "expert"))
            by_layer.setdefault(key, {})[m.groups["expert"]] = m
        for key, stack in by_layer.items():
            # the model's expert count (its router's rows, config.json's num_experts): a
            # layer whose last experts are missing is as incomplete as one with a gap
            count = max(int(args.num_experts or 0), max(stack) + 1)
            highest = self.hf[0].format(**dict(key), expert=max(stack))
            _check_expert_count(count, f"{count:,} experts (the model's, or {highest!r})")
            missing = [e for e in range(count) if e not in stack]
            if missing:
                lacking = self.hf[0].format(**dict(key), expert=missing[0])
                raise FormatError(
                    f"expert(s) {missing} of {count} are missing ({lacking!r}), so the "
                    "layer's experts cannot be stacked",
                    fix="Convert the complete checkpoint (every shard of it), with every "
                    "expert (no --filter / --filter-out that leaves one out).",
                )
            first = stack[0]
            out.append(
                MappedTensor(
                    name=target.format(**dict(key)),
                    shape=(count, *first.shape),
                    dtype=first.dtype,
                    pieces=tuple(Piece(stack[e].name) for e in range(count)),
                    combine="stack",
                    transform="stack-experts",
                )
            )
        return out


@dataclass(frozen=True)
class Filled:
    """A state one naming holds that the other has no counterpart of, written at its
    fresh-start value (zeros) into an output in the naming that holds it and lacks it:
    torchtitan's MoE load-balancing bias `expert_bias_E` on an import of a Qwen3-MoE, one
    `[E]` float32 per MoE layer, whose layers and E come from the output named by `like`
    (its dim 0); DeepSeek-V3's router `e_score_correction_bias` on an export of a torchtitan
    save built without load balancing."""

    pattern: str
    like: str
    dtype: str
    reason: str


@dataclass(frozen=True)
class Ignored:
    """Source tensors a naming holds that are no weights of the other (rotary tables, MoE
    load-balancing counters, a training save's optimizer state): left out, with the reason
    reported. `prefix`: `pattern` names every tensor under it (`optimizer.`).
    `computes`: the tensor takes part in the source model's forward (torchtitan's MoE
    `expert_bias_E` shifts which experts each token is routed to), so leaving it out keeps
    the model only while it holds zeros: the plan lists it in `ArchitecturePlan.computing`
    for the caller to check."""

    pattern: str
    reason: str
    prefix: bool = False
    computes: bool = False

    def regex(self) -> NamePattern:
        """The names this covers."""
        return compile_pattern(self.pattern, prefix=self.prefix)


@dataclass
class ArchitecturePlan:
    """What mapping a checkpoint's tensors to another naming writes, from names and shapes.

    Attributes:
        architecture / source / target: the family and the two namings.
        tensors: every output tensor, in source order.
        left_out: source tensors not carried, with why (`Ignored` rules).
        args: the model args the mapping used.
        tied: (output projection, embedding) source names of an export that leaves the
            output projection out as the embedding's twin (`tie_embeddings`): the caller
            checks they hold the same values, since only then is nothing lost.
        computing: source tensors of `left_out` the source model computes with
            (`Ignored.computes`): the output is the same model only while they hold zeros,
            which the caller checks.
    """

    architecture: str
    source: str
    target: str
    tensors: list[MappedTensor]
    left_out: list[tuple[str, str]] = field(default_factory=list)
    args: ModelArgs = field(default_factory=ModelArgs)
    tied: list[tuple[str, str]] = field(default_factory=list)
    computing: list[str] = field(default_factory=list)


@dataclass
class NamingOutput:
    """What an output in a naming holds beside the mapped tensors.

    Attributes:
        files: small files published with the weights (relative path -> bytes): Megatron's
            `common.pt` and `metadata.json`.
        objects: non-tensor entries written with the tensors (name -> value): the per-layer
            `_extra_state` objects Megatron-Core's load asks for.
        split_dim0: output tensor -> how many equal chunks along dim 0 a chunked format
            (DCP) stores it as: one per layer of Megatron's layer stack, as Megatron saves
            it, so a later read of one layer loads one chunk, not the whole stack.
        basename: the stem of the weight files when the naming's loader looks for its own
            (diffusers' `diffusion_pytorch_model`), None for the format's default (`model`).
    """

    files: dict[str, bytes] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    split_dim0: dict[str, int] = field(default_factory=dict)
    basename: str | None = None


class Architecture(ABC):
    """A model family: its tensors under each naming it knows, and its Hugging Face config.

    Subclasses declare `name`, `title`, `hf_model_types`, `namings`, `rules` (per native
    naming) and `ignored`, and implement `args_from_shapes`, `args_from_config` and
    `hf_config`. Recognition and planning are generic over the rules.

    Attributes:
        name: the registry token (`llama3`).
        title: for messages (`Llama 3`).
        hf_model_types: `config.json` `model_type`s this family reads (`llama`).
        rules: native naming -> its rules against the HF naming.
        ignored: naming -> source tensors that naming holds and no other needs.
        markers: naming -> name patterns of which at least one must be present for
            `recognise` to claim a checkpoint (what tells this family from its relatives,
            e.g. Qwen3's q/k norms).
        excluders: naming -> patterns whose presence says the checkpoint is not this family.
        optional: naming -> source patterns of rules whose tensors a checkpoint of this
            family may lack (Megatron's output layer when tied to the embedding, the dense
            MLP of a model whose every layer is MoE); every other rule must match a tensor
            for `recognise` to claim it.
        layer_variants: Hugging Face name patterns of the blocks a layer holds one of, whole
            (a Qwen3-MoE layer is a dense MLP, `mlp_only_layers`, or a router and its
            experts). Every other `{layer}` pattern of the family's Hugging Face names, but
            the optional ones, is held by every layer (`check_layers`).
        torchtitan_models: the torchtitan module whose `model_registry(flavor)` builds this
            family (`--flavor`), None when torchtitan has none.
        tied: naming -> (embedding name, output projection name): with `tie_embeddings`, the
            HF naming stores no output projection (an export drops it, as torchtitan's own
            `to_hf` does) and a native one holds it as a copy of the embedding (an import
            writes it from the embedding's bytes).
        unmapped: naming -> modules a checkpoint of this family may hold that no rule maps
            (FLUX.1-dev's guidance embedder, which torchtitan's Flux has not), as `Ignored`
            prefixes: recognition passes over them, `plan` refuses a source holding them
            (naming them and the `--filter-out` that leaves them out: a conversion never
            drops a module quietly), and `diff` leaves them out of a comparison across
            namings, named (`unmapped_of`).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[Mapping[str, Sequence[TensorRule]]] = {}
    ignored: ClassVar[Mapping[str, Sequence[Ignored]]] = {}
    markers: ClassVar[Mapping[str, Sequence[str]]] = {}
    excluders: ClassVar[Mapping[str, Sequence[str]]] = {}
    tied: ClassVar[Mapping[str, tuple[str, str]]] = {}
    optional: ClassVar[Mapping[str, Sequence[str]]] = {}
    layer_variants: ClassVar[Sequence[Sequence[str]]] = ()
    torchtitan_models: ClassVar[str | None] = None
    filled: ClassVar[Mapping[str, Sequence[Filled]]] = {}
    unmapped: ClassVar[Mapping[str, Sequence[Ignored]]] = {}
    #: naming -> patterns of tensors a `--dtype` cast leaves as stored: routing state the
    #: model keeps in float32 whatever its weights' dtype (DeepSeek-V3's router bias)
    float32: ClassVar[Mapping[str, Sequence[str]]] = {}
    #: a family with no native naming (gpt-oss): its HF tensor patterns, copied as they are
    hf_names: ClassVar[tuple[str, ...]] = ()
    #: the MLP activations (config.json's `hidden_act`) the family's models compute; a config of
    #: a family ckpt does not map naming another is no model of this one. Empty: not checked
    activations: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def args_from_source(cls, checkpoint: Checkpoint, naming: str) -> ModelArgs:
        """What a source in `naming` keeps about the model beside its tensors (Megatron-LM's
        `args` in `common.pt`); nothing by default. What it cannot read stays unknown (a rule
        needing it asks for --config); a model it reads and the naming cannot hold is refused
        (FormatError)."""
        return ModelArgs()

    @classmethod
    def args_from_torchtitan(cls, model: Any) -> ModelArgs | None:
        """The args of torchtitan's `Model.Config` `model` (`--flavor`) when this family reads
        them its own way; None (the default) for a Llama-style decoder's layers, attention,
        rope and norm, which `flavors.args_of` reads."""
        return None

    @classmethod
    def naming_output(cls, naming: str, args: ModelArgs) -> NamingOutput:
        """What an output in `naming` holds beside the tensors; nothing by default."""
        return NamingOutput()

    @classmethod
    def shape_conflicts(
        cls, shapes: Mapping[str, Sequence[int]], naming: str, args: ModelArgs
    ) -> list[str]:
        """Where the tensor shapes (in `naming`) contradict `args` (a `config.json`'s, a
        flavor's): `layers.0...wk.weight has 16 rows, where num_key_value_heads=4 x
        head_dim=8 = 32`. Head counts the weights cannot tell alone (Llama's) are checked
        here, against the rows they imply; an empty list when nothing contradicts."""
        return []

    @classmethod
    def namings(cls) -> tuple[str, ...]:
        """The namings this family maps between (always `hf`, and each native one)."""
        return (HF, *cls.rules)

    @classmethod
    def _side(cls, naming: str) -> list[tuple[TensorRule, Direction, str]]:
        """(rule, direction, its source-side pattern) for a source in `naming`."""
        out: list[tuple[TensorRule, Direction, str]] = []
        if naming == HF:
            # the HF side is the same in every native naming's rules: take the first naming's
            natives = list(cls.rules)
            if not natives:
                return [(Rename(one(p), one(p)), "from_hf", p) for p in cls.hf_names]
            for rule in cls.rules[natives[0]]:
                out += [(rule, "from_hf", p) for p in rule.hf]
        else:
            for rule in cls.rules.get(naming, ()):
                out += [(rule, "to_hf", p) for p in rule.native]
        return out

    @classmethod
    def _patterns(cls, naming: str) -> list[NamePattern]:
        """Every rule and ignore pattern of `naming`'s side, compiled."""
        side = [compile_pattern(p) for _, _, p in cls._side(naming)]
        passed = (*cls.ignored.get(naming, ()), *cls.unmapped.get(naming, ()))
        return side + [i.regex() for i in passed]

    @classmethod
    def unmapped_of(cls, names: Sequence[str], naming: str) -> list[tuple[str, Ignored]]:
        """(name, its `unmapped` entry) of each of `names` (in `naming`) no rule maps."""
        patterns = [(i.regex(), i) for i in cls.unmapped.get(naming, ())]
        out: list[tuple[str, Ignored]] = []
        for name in names:
            found = next((i for regex, i in patterns if regex.match(name)), None)
            if found is not None:
                out.append((name, found))
        return out

    @classmethod
    def covers_every(cls, names: Sequence[str], naming: str) -> bool:
        """Whether `names` are some and a rule or ignore pattern of `naming` matches each (stops
        at the first name none matches: a model of another family costs a name or a few)."""
        side = cls._patterns(naming)
        return bool(names) and all(any(r.match(name) for r in side) for name in names)

    @classmethod
    def covers(cls, names: Iterable[str], naming: str) -> tuple[list[str], list[str]]:
        """(names no rule or ignore pattern of `naming` matches, names matched)."""
        side = cls._patterns(naming)
        unknown: list[str] = []
        known: list[str] = []
        for name in names:
            (known if any(r.match(name) for r in side) else unknown).append(name)
        return unknown, known

    @classmethod
    def recognise(cls, names: Sequence[str]) -> str | None:
        """The naming `names` (a model's tensor names) are in, if this family's: every name
        matched by a rule or an ignore pattern, every rule's tensor present (but those the
        family may lack), a marker present, no excluder present."""
        for naming in cls.namings():
            if not cls.covers_every(names, naming) or cls.lacking(names, naming):
                continue
            if cls.marked(names, naming):
                return naming
        return None

    @classmethod
    def lacking(cls, names: Sequence[str], naming: str) -> list[str]:
        """The source patterns of this family's rules that no name matches: tensors the model
        would need and does not hold (a Llama-like model without `mlp.gate_proj` is no Llama:
        its export would lack weights the loader asks for). A tied output projection and the
        patterns in `optional` may be absent."""
        optional = set(cls.optional.get(naming, ()))
        optional.update(output for _, output in cls.tied.values())
        by_rule: dict[int, list[str]] = {}
        for rule, _, pattern in cls._side(naming):
            by_rule.setdefault(id(rule), []).append(pattern)
        out: list[str] = []
        for patterns in by_rule.values():
            if optional.intersection(patterns):
                continue
            found = [compile_pattern(p) for p in patterns]
            if not any(r.match(name) for r in found for name in names):
                out.append(patterns[0])
        return out

    @classmethod
    def marked(cls, names: Sequence[str], naming: str) -> bool:
        """Whether `names` hold one of this family's markers and none of its excluders."""
        markers = [compile_pattern(p) for p in cls.markers.get(naming, ())]
        if markers and not any(r.match(n) for r in markers for n in names):
            return False
        excluders = [compile_pattern(p) for p in cls.excluders.get(naming, ())]
        return not any(r.match(n) for r in excluders for n in names)

    @classmethod
    @abstractmethod
    def args_from_shapes(cls, shapes: Mapping[str, Sequence[int]], naming: str) -> ModelArgs:
        """What the tensor shapes (in `naming`) tell about the model."""

    @classmethod
    @abstractmethod
    def args_from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        """The args a Hugging Face `config.json` of this family gives (with `config` set)."""

    @classmethod
    def config_args(cls, config: Mapping[str, Any], where: str) -> ModelArgs:
        """`args_from_config`, refusing a `config.json` whose values no model has
        (`checked_args`): FormatError naming `where`, the key and its value."""
        return checked_args(
            lambda: cls.args_from_config(config),
            where,
            "config.json",
            HF_CONFIG_KEYS,
            "Pass the model's own config.json with --config (counts and widths are positive "
            "integers, rope_theta and rms_norm_eps finite numbers).",
        )

    @classmethod
    def config_conflicts(cls, config: Mapping[str, Any]) -> list[str]:
        """The settings of a Hugging Face `config.json` this family's tensors cannot hold
        (`attention_bias: true` for a family whose rules map no bias): transformers builds
        weights from them that no tensor fills. Empty when nothing conflicts."""
        return []

    @classmethod
    @abstractmethod
    def hf_config(cls, args: ModelArgs) -> dict[str, Any]:
        """A Hugging Face `config.json` for a model with `args` (transformers builds the same
        model from it)."""

    @classmethod
    def fit_config(cls, config: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
        """The `config.json` (`hf_config`'s) of an export holding the tensors `names` (Hugging
        Face names): as it is by default. A family whose config describes a module a model
        may be exported without (Qwen3.5's vision encoder) describes the modules held, so
        `from_pretrained` builds no module at random.

        Raises:
            FormatError: the export holds a module the config does not describe.
        """
        return config

    @classmethod
    def plan(
        cls,
        entries: Sequence[tuple[str, Sequence[int], str]],
        source: str,
        target: str,
        args: ModelArgs,
    ) -> ArchitecturePlan:
        """Map `(name, shape, dtype)` source tensors in naming `source` to naming `target`.

        Raises:
            FormatError: a tensor no rule knows (never copied under its old name), a pair of
                namings this family does not map, or an arg the mapping needs is unknown.
        """
        if source == target:
            tensors = [
                MappedTensor(name=n, shape=tuple(s), dtype=d, pieces=(Piece(n),), transform="copy")
                for n, s, d in entries
            ]
            return ArchitecturePlan(cls.name, source, target, tensors, args=args)
        if HF not in (source, target) or (source if target == HF else target) not in cls.rules:
            raise FormatError(
                f"{cls.title} has no mapping from the {source} naming to the {target} naming",
                fix=f"Its namings: {', '.join(cls.namings())}.",
            )
        unmapped = cls.unmapped_of([n for n, _, _ in entries], source)
        if unmapped:
            shown = ", ".join(repr(n) for n, _ in unmapped[:3])
            more = f" and {len(unmapped) - 3} more" if len(unmapped) > 3 else ""
            modules = list(dict.fromkeys(i for _, i in unmapped))
            globs = " ".join(f"--filter-out '{i.pattern}*'" for i in modules)
            raise FormatError(
                f"{len(unmapped)} tensor(s) of {cls.title}'s "
                f"{' and '.join(i.reason for i in modules)} have no rule from the {source} "
                f"naming to the {target} naming: {shown}{more}",
                fix=f"Leave them out with {globs} to convert the rest of the model alone, or "
                "convert with --to safetensors / dcp to keep every tensor under its name.",
            )
        native = source if target == HF else target
        direction: Direction = "to_hf" if target == HF else "from_hf"
        rules = cls.rules[native]
        compiled = [[compile_pattern(p) for p in rule.source_patterns(direction)] for rule in rules]
        ignored = [(i.regex(), i) for i in cls.ignored.get(source, ())]
        matched: list[list[Match]] = [[] for _ in rules]
        order: dict[str, int] = {}
        left_out: list[tuple[str, str]] = []
        computing: list[str] = []
        unknown: list[str] = []
        for index, (name, shape, dtype) in enumerate(entries):
            order[name] = index
            hit = False
            for r, patterns in enumerate(compiled):
                for p, regex in enumerate(patterns):
                    m = regex.match(name)
                    if m:
                        groups = {k: int(v) for k, v in m.groupdict().items()}
                        matched[r].append(Match(name, tuple(shape), dtype, groups, p))
                        hit = True
                        break
                if hit:
                    break
            if hit:
                continue
            ignore = next((i for regex, i in ignored if regex.match(name)), None)
            if ignore is None:
                unknown.append(name)
            else:
                left_out.append((name, ignore.reason))
                if ignore.computes:
                    computing.append(name)
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise FormatError(
                f"{len(unknown)} tensor(s) have no {cls.title} rule from the {source} naming "
                f"to the {target} naming: {shown}{more}",
                fix="Leave them out with --filter-out if they are no model weights, or convert "
                "with --to safetensors / dcp to keep the names as they are.",
            )
        outputs: list[MappedTensor] = []
        for rule, matches in zip(rules, matched, strict=True):
            if matches:
                outputs += rule.plan(matches, direction, args, cls.title)
        # source order: an output goes where its first piece was
        outputs.sort(key=lambda t: min(order[s] for s in t.sources))
        outputs += cls._fill(outputs, target)
        tied: list[tuple[str, str]] = []
        if args.tie_embeddings and HF in cls.tied and native in cls.tied:
            outputs = cls._tie(outputs, direction, native, left_out, tied)
        return ArchitecturePlan(cls.name, source, target, outputs, left_out, args, tied, computing)

    @classmethod
    def check_layers(cls, names: Sequence[str]) -> None:
        """Refuse a whole model (its tensor `names` in the Hugging Face naming: an import's
        sources, an export's outputs) one of whose layers lacks a tensor the others hold:
        `recognise` asks only that each rule match some tensor, and a model written with a
        hole loads with a weight transformers initialises at random (torchtitan's and
        Megatron's loads refuse it). `plan` maps any part of a model; this judges the whole.

        Raises:
            FormatError: naming the layer and the tensors it lacks.
        """
        optional = set(cls.optional.get(HF, ())) | {head for _, head in cls.tied.values()}
        grouped = list(dict.fromkeys(p for group in cls.layer_variants for p in group))
        every = [
            p
            for _, _, p in cls._side(HF)
            if "{layer}" in p and p not in optional and p not in grouped
        ]
        held = numbers_held(names, [*every, *grouped])
        layers = set().union(*held.values())
        for layer in range(max(layers) + 1 if layers else 0):
            lacks = [p for p in every if layer not in held[p]]
            variants = cls.layer_variants
            if variants and not any(all(layer in held[p] for p in g) for g in variants):
                closest = max(variants, key=lambda g: sum(layer in held[p] for p in g))
                lacks += [p for p in closest if layer not in held[p]]
            if not lacks:
                continue
            shown = ", ".join(
                repr(p.replace("{expert}", "*").format(layer=layer)) for p in lacks[:3]
            )
            more = f" and {len(lacks) - 3} more" if len(lacks) > 3 else ""
            raise FormatError(
                f"layer {layer} of the {cls.title} model lacks {shown}{more} (in Hugging Face "
                "names), which other layers of it hold: a model written without it is not the "
                "one trained (transformers' from_pretrained initialises a missing weight at "
                "random; torchtitan's and Megatron's loads refuse it)",
                fix="Convert the complete checkpoint (every shard of it), with every tensor of "
                "each layer (no --filter / --filter-out that leaves one out).",
            )

    @classmethod
    def _tie(
        cls,
        outputs: list[MappedTensor],
        direction: Direction,
        native: str,
        left_out: list[tuple[str, str]],
        tied: list[tuple[str, str]],
    ) -> list[MappedTensor]:
        """Tied embeddings: drop the output projection on the way to HF (recording it and
        the embedding in `tied`, for the caller to check they are twins); rebuild it from
        the embedding on the way from HF when the HF files hold none."""
        if direction == "to_hf":
            embed, head = cls.tied[HF]
            embedding = next((t.pieces[0].source for t in outputs if t.name == embed), None)
            for tensor in outputs:
                if tensor.name == head:
                    left_out.append(
                        (tensor.pieces[0].source, "tied to the embedding (tie_word_embeddings)")
                    )
                    if embedding is not None:
                        tied.append((tensor.pieces[0].source, embedding))
            return [t for t in outputs if t.name != head]
        embed, head = cls.tied[native]
        if any(t.name == head for t in outputs):
            return outputs
        source = next((t for t in outputs if t.name == embed), None)
        if source is None:
            return outputs
        copy = replace(source, name=head, transform="tie-copy")
        return [*outputs, copy]

    @classmethod
    def _fill(cls, outputs: list[MappedTensor], target: str) -> list[MappedTensor]:
        """The `Filled` states of naming `target` the outputs call for and lack, as zeros."""
        out: list[MappedTensor] = []
        held = {t.name for t in outputs}
        for fill in cls.filled.get(target, ()):
            like = compile_pattern(fill.like)
            for tensor in outputs:
                m = like.match(tensor.name)
                if m and tensor.shape:
                    groups = {k: int(v) for k, v in m.groupdict().items()}
                    if fill.pattern.format(**groups) in held:
                        continue
                    out.append(
                        MappedTensor(
                            name=fill.pattern.format(**groups),
                            shape=(tensor.shape[0],),
                            dtype=fill.dtype,
                            pieces=(),
                            combine="zeros",
                            transform="zeros",
                        )
                    )
        return out
