"""`merge`: a LoRA adapter folded into its base model, one weight at a time.

peft's `merge_and_unload` builds the whole model in memory. Here the base checkpoint is read one
tensor at a time: a weight some LoRA module targets gets `W + scaling · (B @ A)` (transposed for
embeddings and transformers' `Conv1D` layers, which peft decides per layer), with
`scaling = lora_alpha / r` (`/ sqrt(r)` with rsLoRA, per-module `rank_pattern` /
`alpha_pattern` honoured), computed and rounded into the base weight's dtype exactly as peft's
`lora.Linear` / `lora.Embedding` merge does on CPU (DoRA's linear layers as its
`DoraLinearVariant`: `W + ΔW` scaled row by row to the adapter's magnitude); weights listed in
`modules_to_save` are replaced by the adapter's copy (of a resized vocabulary too, when the
adapter holds every vocabulary tensor whole: `config.json` then says its `vocab_size`); every
other tensor is copied as raw bytes. Peak memory is one base weight plus its two low-rank factors. A LoRA
target whose base weight is quantized is refused before anything is written: an update added
to quantized codes is wrong data.

IA³, LoHa and LoKr adapters are merged the same way, weight by weight, by `merge_variants`
(their `modules_to_save` copies as a LoRA adapter's).

The output keeps the base's naming (one `model.safetensors`, or its shard size and index; a
diffusers model's `diffusion_pytorch_model[.VARIANT]` names) and
carries the base's non-weight files (`config.json`, tokenizer, generation config), so it loads
with `from_pretrained` like the base did. It is written beside DEST and published with one
rename.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ..dtypes import itemsize, numel
from ..errors import FormatError, NotFoundError, UsageError
from ..formats import HF_WEIGHTS, get_format, resolve_source
from ..formats.base import Checkpoint, Source, WriteOptions
from ..formats.names import is_checkpoint_file, is_commit_marker
from ..models import Entry, FileInfo, Record, Request
from ..progress import NULL_PROGRESS, Progress
from ..quant import QuantAnalysis, analyse_checkpoint, label
from ..sources.layouts.model_folders import DIFFUSERS_LORA_FILES, apply_naming, read_json
from ..sources.model_files import MAX_EXTRA_BYTES
from ..sources.opening import open_plain
from ..sources.runs.naming import top_folders
from ..storage.output import (
    check_destination,
    local_destination,
    resolve_destination,
    staged_output,
)
from ..storage.uri import parse_location
from .convert.plan import SERVING_FILES, guard_paths, planned_files
from .merge_variants import (
    VARIANT_LABELS,
    VariantUpdate,
    check_rank_and_alpha,
    check_variant_config,
    plan_variants,
    split_variant_entries,
)
from .shared.transfer import (
    SkippedEntry,
    TransferPlan,
    account_files,
    extra_files,
    plan_transfer,
)
from .shared.transfer import write_checkpoint as run_write

if TYPE_CHECKING:
    import torch

_PEFT_PREFIX = "base_model.model."
_LORA = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B"
    r"|lora_magnitude_vector)(?:\.weight)?$",
    re.DOTALL,  # a module name may hold any character, a line break too
)
#: the bias of a `lora_B` layer (`lora_bias=True`): added into the base layer's bias
_LORA_BIAS = re.compile(r"(?P<module>.+)\.lora_B\.bias$", re.DOTALL)
#: the weight dtypes peft adds a LoRA update into (an FP8 weight fails in torch; an integer
#: one holds quantized codes)
_MERGEABLE = frozenset({"float16", "bfloat16", "float32", "float64"})
#: `config.json` model types whose `c_attn` / `c_proj` / `c_fc` / `q_attn` are transformers'
#: `Conv1D` (weight stored `[in, out]`), the one case a square weight's orientation is not
#: told by its shape (transformers' gpt2, openai, imagegpt, decision_transformer, clvp)
_CONV1D_MODEL_TYPES = frozenset(
    {"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp", "clvp_decoder"}
)
_CONV1D_MODULES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})
#: `config.json` model types whose MoE expert stacks are stored `[E, in, out]` (transformers'
#: `use_experts_implementation(is_transposed=True)`); every other model's are `[E, out, in]`.
#: Told by the shapes but for a square stack (`hidden_size == 2 * intermediate_size`)
_TRANSPOSED_EXPERT_MODEL_TYPES = frozenset({"gpt_oss", "aria", "ergo", "openai_privacy_filter"})
#: peft's trainable tokens (`trainable_token_indices`): rows of an embedding replaced
_TRAINABLE_TOKENS = (".token_adapter.", "trainable_tokens_delta", "trainable_tokens_original")


class MergeReport(Record):
    """The result of `ckpt merge`.

    Attributes:
        base / adapter / dest: what was read and written.
        adapter_type / base_model: from `adapter_config.json` (LoRA, IA³, LoHa or LoKr).
        r / lora_alpha: the adapter's default rank and alpha (LoHa / LoKr's `alpha`; None
            for IA³, which has neither).
        merged: base weights (and biases, `lora_bias`, IA³'s) that received an update.
        replaced: base weights replaced by the adapter's `modules_to_save` copy.
        copied: base tensors written unchanged.
        vocab_size: the vocabulary the merged model holds when the adapter was trained on a
            resized one (its saved embedding and output head, of that many rows, replace the
            base's, and `config.json` says it); None when the base's is kept.
        tokenizer_from_adapter: with `vocab_size`, the tokenizer files carried from the adapter
            folder in place of the base's (the tokenizer that holds the added tokens).
        skipped: every file of BASE or ADAPTER neither read into the output nor carried, with
            why (kind `file`; ADAPTER's named under its folder): nothing vanishes unsaid.
        files: the files written (weights and carried companions).
        tensors / tensor_bytes: tensors written and their bytes.
        dtypes: dtype -> how many tensors of it are written (the base's dtypes: merged
            weights are rounded into their base weight's).
        dry_run: nothing was written: `files` (sizes exact), `tensors`, `dtypes` and the
            lists above are what would be.
    """

    base: str
    adapter: str
    dest: str
    adapter_type: str
    base_model: str | None = None
    r: int | None = None
    lora_alpha: int | float | None = None
    merged: list[str] = Field(default_factory=list)
    replaced: list[str] = Field(default_factory=list)
    copied: int = 0
    vocab_size: int | None = None
    tokenizer_from_adapter: list[str] = Field(default_factory=list)
    skipped: list[SkippedEntry] = Field(default_factory=list)
    files: list[FileInfo] = Field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    dtypes: dict[str, int] = Field(default_factory=dict)
    dry_run: bool = False


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rule: a `rank_pattern` / `alpha_pattern` key matches a module name's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _check_lora_config(config: dict[str, Any], adapter: str) -> None:
    """The numbers `scaling = lora_alpha / r` is made of, as peft accepts them: `r: 0` was a
    ZeroDivisionError (exit 70), a negative `r` merged with a negative scaling, and a pattern
    that is not a mapping an AttributeError."""
    where = f"{adapter.rstrip('/')}/adapter_config.json"
    fix = "Fix adapter_config.json (peft writes r >= 1 and a numeric lora_alpha), or re-save it."
    check_rank_and_alpha(config, "lora_alpha", where, fix)


class _Update:
    """One base weight's LoRA factors, and how peft's layer merges them.

    Attributes:
        embedding: a `lora.Embedding` (delta transposed, rounded to the weight's dtype, then
            added); else a `lora.Linear` (the sum taken in float32, one rounding).
        transposed: the delta is added as `(B @ A).T` (embeddings, and `Conv1D` layers, whose
            weight is `[in, out]`: peft's per-layer `fan_in_fan_out`).
        magnitude: the DoRA magnitude vector (`lora_magnitude_vector`, one value per output
            feature), or None for plain LoRA.
        bias: for the update of a base layer's bias (`lora_bias=True`), the `lora_B` bias
            added into it, scaled as the weight's update; `a` and `b` are then None.
        experts: for a parameter an adapter's `target_parameters` names (peft's
            `ParamWrapper`), the number of experts of its `[E, ...]` stack (1 for a 2-D
            weight); `module` is then the parameter's name and `transposed` says the stack is
            stored `[E, in, out]`. None for a layer `target_modules` names.
        expert / rows: for a stack the base stores one tensor per expert, the expert this
            tensor holds and which of that expert's rows (None: all of them).
    """

    def __init__(self, module: str):
        self.module = module
        self.a: str | None = None
        self.b: str | None = None
        self.embedding = False
        self.transposed = False
        self.magnitude: str | None = None
        self.bias: str | None = None
        self.experts: int | None = None
        self.expert: int | None = None
        self.rows: tuple[int, int] | None = None


def _plan_bias(
    module: str,
    name: str,
    base: Checkpoint,
    quant: QuantAnalysis,
    known: set[str],
    names: set[str],
    updates: dict[str, _Update],
    where: str,
) -> None:
    """The update of `module`'s bias by its `lora_B` bias (`lora_bias=True`), refused where
    peft refuses it: a base layer without a bias, or one it cannot add into."""
    target = _base_name(module, "bias", known)
    if target is None:
        raise NotFoundError(
            f"holds {name!r} (lora_bias), but the base layer {module!r} has no bias to merge "
            "it into (peft refuses the same merge)",
            path=where,
            fix="Check that the adapter was trained on this base model.",
        )
    problem = _not_mergeable(base, quant, target, module, names)
    if problem is not None:
        raise problem
    update = _Update(module)
    update.bias = name
    updates[target] = update


def _check_dora(
    update: _Update, config: dict[str, Any], outputs: int, where: str, factors: dict[str, Entry]
) -> None:
    """A DoRA layer is merged whole or refused: every layer of a `use_dora` adapter holds its
    magnitude, one value per output feature (peft's `lora.Linear`; DoRA on embeddings is
    not merged here)."""
    if not config.get("use_dora"):
        return
    if update.magnitude is None:
        raise FormatError(
            f"is a DoRA adapter (use_dora), but {update.module!r} has no lora_magnitude_vector",
            path=where,
            fix="The adapter file is incomplete; save it again.",
        )
    if update.embedding:
        raise FormatError(
            f"is a DoRA adapter on the embedding {update.module!r}, which `ckpt merge` does not "
            "merge (DoRA on linear layers only)",
            path=where,
            fix="Merge it with peft's merge_and_unload.",
        )
    held = list(factors[update.magnitude].shape)
    if held != [outputs]:
        raise FormatError(
            f"the DoRA magnitude of {update.module!r} has shape {held}, its layer has {outputs} "
            "output features",
            path=where,
            fix="Use the adapter_config.json and weights saved together; save it again.",
        )


def _delta_dtype(weight: torch.dtype) -> torch.dtype:
    """The dtype peft holds a layer's LoRA factors in, so computes its delta in: the base
    weight's (`_move_adapter_to_device_of_base_layer`), 16-bit upcast to float32
    (`autocast_adapter_dtype`, on by default); the adapter file's own dtype is only copied in."""
    import torch

    return torch.float32 if weight in (torch.float16, torch.bfloat16) else weight


class MergedCheckpoint(Checkpoint):
    """The base checkpoint as seen through the adapter: merged weights on read."""

    def __init__(
        self,
        base: Checkpoint,
        adapter: Checkpoint,
        updates: dict[str, _Update],
        replaced: dict[str, str],
        config: dict[str, Any],
        untied: dict[str, tuple[str | None, str]] | None = None,
        resized: dict[str, list[int]] | None = None,
        variants: dict[str, VariantUpdate] | None = None,
    ):
        # the shapes of the vocabulary tensors the adapter saved resized (name -> shape)
        resized = resized or {}

        def computed(entry: Entry, name: str) -> Entry:
            """`entry` as written under `name`: computed on read, never copied as the base's
            raw bytes, in the adapter's shape where it resized the vocabulary."""
            update: dict[str, Any] = {"name": name, "offset": None}
            if name in resized and entry.dtype is not None:
                shape = resized[name]
                update |= {"shape": shape, "nbytes": itemsize(entry.dtype) * numel(shape)}
            return entry.model_copy(update=update)

        # an IA³ / LoHa / LoKr adapter's updates (base tensor -> its update)
        self.variants = variants or {}
        entries: list[Entry] = []
        for entry in base.manifest.entries:
            if entry.name in updates or entry.name in replaced or entry.name in self.variants:
                entry = computed(entry, entry.name)
            entries.append(entry)
        # an output head the base tied to its embedding, written as its own tensor: the
        # adapter's `modules_to_save` copy, or (None) the embedding as the base holds it
        # (alias -> (adapter tensor or None, the embedding))
        self.untied = untied or {}
        for alias, (_copy, embedding) in self.untied.items():
            entries.append(computed(base.manifest.by_name[embedding], alias))
        super().__init__(base.source, base.manifest.model_copy(update={"entries": entries}))
        self.base = base
        self.adapter = adapter
        self.updates = updates
        self.replaced = replaced
        self.config = config
        # `_parameter_delta`'s: (A, B name, compute dtype) -> the factors; the last delta
        self._factors: dict[tuple[str, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_delta: tuple[tuple[str, int | None, torch.dtype], torch.Tensor] | None = None

    def read_tensor(self, name: str) -> torch.Tensor:
        if name in self.untied:
            from ..tensors import torch_dtype

            copy, embedding = self.untied[name]
            if copy is None:
                return self.base.read_tensor(embedding)
            dtype = self.base.manifest.by_name[embedding].dtype
            weight = self.adapter.read_tensor(copy)
            return weight.to(torch_dtype(dtype)) if dtype else weight
        if name in self.replaced:
            from ..tensors import torch_dtype

            weight = self.adapter.read_tensor(self.replaced[name])
            dtype = self.base.manifest.by_name[name].dtype
            weight = weight.to(torch_dtype(dtype)) if dtype else weight
        else:
            weight = self.base.read_tensor(name)
        variant = self.variants.get(name)
        if variant is not None:
            return variant.merged(weight, self.adapter.read_tensor)
        update = self.updates.get(name)
        if update is None:
            return weight
        import torch

        r = _pattern_value(self.config.get("rank_pattern") or {}, update.module, self.config["r"])
        alpha = _pattern_value(
            self.config.get("alpha_pattern") or {}, update.module, self.config["lora_alpha"]
        )
        scaling = alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r
        if update.bias is not None:
            # lora.Linear.merge: `bias += lora_B.bias * scaling`, in the wider dtype, one
            # rounding into the bias's
            added = self.adapter.read_tensor(update.bias).to(_delta_dtype(weight.dtype)) * scaling
            self._check_fits(f"the LoRA bias of {update.module!r}", added, "bias", name, weight)
            return torch.add(weight, added).to(weight.dtype).contiguous()
        assert update.a is not None and update.b is not None
        compute = _delta_dtype(weight.dtype)
        if update.experts is not None:
            delta = self._parameter_delta(update, r, scaling, compute)
            if update.rows is not None:
                delta = delta[update.rows[0] : update.rows[1]]
            self._check_fits(
                f"the LoRA update of {update.module!r}", delta, "parameter", name, weight
            )
            # ParamWrapper.merge: `param += delta`, the delta rounded into the parameter's
            # dtype first (`get_delta_weight`), then the sum rounded again
            return torch.add(weight, delta.to(weight.dtype)).contiguous()
        a = self.adapter.read_tensor(update.a)
        b = self.adapter.read_tensor(update.b)
        self._check_rank(update, a, r)
        delta = (b.to(compute) @ a.to(compute)) * scaling
        if update.transposed:
            delta = delta.T
        # the plan checked the base's shape; a `modules_to_save` copy may differ from it
        self._check_fits(f"the LoRA update of {update.module!r}", delta, "weight", name, weight)
        if update.magnitude is not None:
            return _dora_merged(weight, delta, self.adapter.read_tensor(update.magnitude), update)
        if update.embedding:
            # lora.Embedding.merge: `weight += delta.to(weight.dtype)`, the delta rounded to
            # the weight's dtype first, then the sum rounded again
            return torch.add(weight, delta.to(weight.dtype)).contiguous()
        # lora.Linear.merge: `weight += delta`, one rounding into the weight's dtype, the sum
        # taken in the wider of the two (a bf16 weight: bf16(w + delta), never
        # w + bf16(delta), which differs by an ulp in about a third of the values)
        return torch.add(weight, delta).to(weight.dtype).contiguous()

    def _check_rank(self, update: _Update, a: torch.Tensor, r: int) -> None:
        """Refuse factors whose own rank is not adapter_config.json's: the product has theirs,
        so every delta would be scaled wrong. lora_A (and lora_embedding_A) is `[r, in]`; a
        parameter's, `[r * E, in]` for E experts."""
        held = a.shape[0] // (update.experts or 1)
        if held != r:
            raise FormatError(
                f"the LoRA factors of {update.module!r} have rank {held}, adapter_config.json "
                f"says r={r}",
                path=self.adapter.manifest.location,
                fix="Use the adapter_config.json saved with these weights.",
            )

    def _parameter_delta(
        self, update: _Update, r: int, scaling: float, compute: torch.dtype
    ) -> torch.Tensor:
        """The delta of a `ParamWrapper` update (`_stack_delta`): of its whole parameter, or of
        the one expert its tensor holds. A stack stored one tensor per expert is written
        tensor by tensor, its two or three projections of an expert side by side: the factors
        of the last stacks read, and the last expert's delta, are kept for the next tensors
        (bounded: the factors of two stacks, one expert's delta; never a whole stack's)."""
        assert update.a is not None and update.b is not None
        key = (update.module, update.expert, compute)
        if self._last_delta is not None and self._last_delta[0] == key:
            return self._last_delta[1]
        pair = (update.a, update.b, compute)
        factors = self._factors.get(pair)
        if factors is None:
            a = self.adapter.read_tensor(update.a)
            self._check_rank(update, a, r)
            factors = (a.to(compute), self.adapter.read_tensor(update.b).to(compute))
            if len(self._factors) >= 2:
                del self._factors[next(iter(self._factors))]
            self._factors[pair] = factors
        delta = _stack_delta(*factors, update, scaling)
        # one expert's delta is small; a whole stack's is the largest tensor, held no longer
        # than its own write
        self._last_delta = (key, delta) if update.expert is not None else None
        return delta

    def _check_fits(
        self, what: str, update: torch.Tensor, kind: str, name: str, base: torch.Tensor
    ) -> None:
        """Refuse an update (`what`) whose shape is not the base tensor's it is added to."""
        if tuple(update.shape) != tuple(base.shape):
            raise FormatError(
                f"{what} has shape {list(update.shape)}, the base {kind} {name!r} is "
                f"{list(base.shape)}",
                path=self.adapter.manifest.location,
                fix="Check that the adapter was trained on this base model.",
            )

    def read_object(self, name: str) -> Any:
        return self.base.read_object(name)

    def close(self) -> None:
        self.base.close()
        self.adapter.close()


def _dora_merged(
    weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor, update: _Update
) -> torch.Tensor:
    """peft's `DoraLinearVariant.merge`, op for op: the norm of each output feature's row of
    `W + delta` (taken in the delta's dtype, the base's 16-bit weight widened), the magnitude
    over that norm, times `W + delta`, one rounding into the weight's dtype. `delta` is laid
    out as the weight (`[in, out]` for a `Conv1D`, whose rows are then the columns)."""
    import torch

    rows = weight.T + delta.T if update.transposed else weight + delta
    norm = torch.linalg.norm(rows, dim=1).to(rows.dtype)
    factor = magnitude.to(delta.dtype) / norm
    factor = factor.view(1, -1) if update.transposed else factor.view(-1, 1)
    merged: torch.Tensor = (factor * (weight + delta)).to(weight.dtype)
    return merged.contiguous()


def _stack_delta(a: torch.Tensor, b: torch.Tensor, update: _Update, scaling: float) -> torch.Tensor:
    """peft's `ParamWrapper.get_delta_weight`, op for op: a 2-D weight's `B @ A` (as
    `lora.Linear`); for a stack of E experts, lora_A's rows read expert by expert (`[E, r,
    in]`), lora_B's columns rank by rank (`[out, r, E]`), multiplied per expert into the
    stack's own layout (`[E, out, in]`, or `[E, in, out]` when `transposed`); for a stack
    stored one tensor per expert, that tensor's expert only (`[out, in]`)."""
    import torch

    experts = update.experts or 1
    if update.experts == 1:
        return (b @ a) * scaling
    per_a = a.reshape(experts, -1, a.shape[-1])
    per_b = b.reshape(b.shape[0], -1, experts)
    if update.expert is not None:
        # one expert of a stack stored expert by expert: its own product, the values of its
        # slice of the batched one (each batch of which is that same product; the tests hold
        # the merge to peft's bit for bit), without computing every other expert's
        e = update.expert
        delta = per_b[:, :, e] @ per_a[e]
        return (delta.T if update.transposed else delta) * scaling
    layout = "e i o" if update.transposed else "e o i"
    return torch.einsum(f"o r e, e r i -> {layout}", per_b, per_a) * scaling


#: input embeddings an output projection is tied to when a model saves no `lm_head.weight`
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def _tied_names(names: set[str]) -> dict[str, str]:
    """`lm_head.weight` -> the embedding it is tied to, when the base saves no output
    projection but one input embedding (`save_pretrained` drops the tied copy): peft's LoRA on
    `lm_head` then updates that one shared tensor, and `merge_and_unload` changes the
    embedding with it."""
    if any(n == "lm_head.weight" or n.endswith(".lm_head.weight") for n in names):
        return {}
    embeddings = [n for n in names if n.endswith(_EMBEDDINGS)]
    return {"lm_head.weight": embeddings[0]} if len(embeddings) == 1 else {}


def _tied_pair_refused(first: str, second: str, target: str, where: str) -> FormatError:
    """LoRA layers on both the embedding and the output head of a base that ties them: merged
    into the one tensor both read, each update also changes the other layer. peft's
    `merge_and_unload` adds both into it all the same (with `ensure_weight_tying`, the one
    shared update twice), a model that computes what the adapter did not, so no merge is
    written; untied, each layer takes its own update and the merge is exact."""
    return FormatError(
        f"{first!r} and {second!r} both hold LoRA updates, and the base ties the two to one "
        f"tensor, {target!r} (tie_word_embeddings): merged into it, each update would also "
        "change the other layer, so the merged model would not compute what the adapter does "
        "(peft's merge_and_unload adds both into the shared tensor all the same)",
        path=where,
        fix="Untie the base, then merge into that: in Python, `m = AutoModelForCausalLM."
        "from_pretrained(BASE); m.config.tie_word_embeddings = False; m.lm_head.weight = "
        "torch.nn.Parameter(m.get_input_embeddings().weight.clone()); m.save_pretrained(UNTIED)`"
        ", then `ckpt merge UNTIED ADAPTER DEST`: the embedding and the output head each take "
        "their own update.",
    )


def _base_name(
    module: str, suffix: str, names: set[str], tied: dict[str, str] | None = None
) -> str | None:
    """The base tensor a peft module path addresses (exact, else the one name ending so, else
    the tensor a tied name shares)."""
    exact = f"{module}.{suffix}"
    if exact in names:
        return exact
    tails = [n for n in names if n.endswith(f".{exact}") or exact.endswith(f".{n}")]
    if len(tails) == 1:
        return tails[0]
    for alias, target in (tied or {}).items():
        if exact == alias or exact.endswith(f".{alias}"):
            return target
    return None


def _not_mergeable(
    base: Checkpoint,
    quant: QuantAnalysis,
    target: str,
    module: str,
    names: set[str],
    update: str = "a LoRA update",
) -> FormatError | None:
    """Why `target`, the base weight a LoRA module updates, cannot take the update: quantized
    by a scheme `quant` recognises (its codes are not values), or held in a dtype peft adds
    no update into (integer codes such as bitsandbytes' LLM.int8, FP8 without a scale).
    `update`: what the adapter merges, as the message says it ("the IA³ update")."""
    where = base.manifest.location
    recognised = quant.weights.get(target)
    if recognised is not None:
        return FormatError(
            f"the adapter targets {module!r}, whose base weight {recognised.payload!r} is "
            f"quantized ({label(recognised.scheme, recognised.block)}): {update} applied to "
            "quantized values is wrong data",
            path=where,
            fix="Dequantize the base first (`ckpt convert BASE DEQUANTIZED --to safetensors "
            "--dequantize`), then merge into DEQUANTIZED.",
        )
    packed = target.removesuffix(".weight")
    if target not in names and packed in quant.packed_scheme:
        # GPTQ / AWQ `qweight`, compressed-tensors `weight_packed`: packed codes under
        # another name
        scheme = quant.packed_scheme[packed]
        return FormatError(
            f"the adapter targets {module!r}, whose base weight {target!r} is quantized "
            f"({scheme}, stored packed as {quant.packed[packed][0]!r}): {update} applied "
            "to quantized values is wrong data",
            path=where,
            fix=f"Dequantize the base to float16/bfloat16/float32 with {scheme}'s own tools "
            "and save it, then merge into that copy.",
        )
    dtype = base.manifest.by_name[target].dtype if target in names else None
    if dtype in _MERGEABLE:
        return None
    method = quant.config.method
    return FormatError(
        f"the adapter targets {module!r}, whose base weight {target!r} is {dtype}"
        f"{f' ({method} quantization)' if method else ''}: peft merges {update} only into "
        "float16, bfloat16, float32 or float64 weights, and applied to quantized values it is "
        "wrong data",
        path=where,
        fix="Dequantize the base to float16/bfloat16/float32"
        f"{f' with {method}' if method else ''} and save it, then merge into that copy.",
    )


def _orientation(
    update: _Update,
    product: list[int],
    weight: list[int],
    model_type: str | None,
    config: dict[str, Any],
) -> bool | None:
    """Whether `B @ A` (shape `product`, `[out, in]`) is added transposed to a base weight of
    shape `weight`, as peft decides per layer; None when neither way fits.

    An embedding always is (`lora.Embedding`). A linear layer is when its weight is stored
    `[in, out]`: peft sets `fan_in_fan_out` True for transformers' `Conv1D` and False for
    `nn.Linear`, whatever adapter_config.json says, so the shape tells; a square weight is
    told by the base's architecture: in transformers' own models (a `config.json` model type,
    no remote code) only the GPT-2-style families' `c_attn` / `c_proj` / `c_fc` / `q_attn` are
    `Conv1D`; for a model of remote code, or none known, adapter_config.json's value holds."""
    straight, flipped = weight == product, weight == product[::-1]
    if update.embedding:
        return True if flipped else None
    if straight and flipped:
        if model_type is None:
            return bool(config.get("fan_in_fan_out"))
        return (
            model_type in _CONV1D_MODEL_TYPES
            and update.module.rsplit(".", 1)[-1] in _CONV1D_MODULES
        )
    return False if straight else True if flipped else None


def _plan_updates(
    base: Checkpoint,
    adapter: Checkpoint,
    config: dict[str, Any],
    quant: QuantAnalysis,
    model_type: str | None = None,
    entries: list[Entry] | None = None,
) -> tuple[
    dict[str, _Update],
    dict[str, str],
    dict[str, tuple[str | None, str]],
    dict[str, list[int]],
]:
    """The LoRA updates (base weight -> factors), the `modules_to_save` copies (base weight
    -> adapter tensor), the output heads to write untied (name -> (adapter tensor, the
    embedding the base ties it to)) and, for an adapter trained on a resized vocabulary, the
    shapes its saved embedding and output head give those tensors (`_check_vocabulary`).
    `entries`: the adapter tensors to plan (None: all; an IA³ / LoHa / LoKr adapter's other
    than its own layers', its `modules_to_save` copies)."""
    planned = adapter.manifest.entries if entries is None else entries
    names = {e.name for e in base.manifest.entries if e.kind == "tensor"}
    # a quantized weight may be stored under another name (`weight_packed`, `_blocks`): a LoRA
    # target is looked up among what the base's weights are, to be refused by name
    known = names | set(quant.weights) | {m + ".weight" for m in quant.packed}
    tied = _tied_names(names)
    updates: dict[str, _Update] = {}
    replaced: dict[str, str] = {}
    untied: dict[str, tuple[str | None, str]] = {}
    resized: dict[str, list[int]] = {}
    where = adapter.manifest.location
    adapter_keys = {e.name.removeprefix(_PEFT_PREFIX) for e in planned}
    parameter_targets = _parameter_targets(config)
    # the factors of peft's `ParamWrapper`s (`target_parameters`): module -> its wrappers, the
    # outermost first (depth = the `.base_layer` parts after the module's name) -> part -> entry
    wrapped: dict[str, dict[int, dict[str, Entry]]] = {}
    for entry in planned:
        if entry.kind != "tensor":
            continue
        key = entry.name.removeprefix(_PEFT_PREFIX)
        if ".original_module." in key:
            # peft's `save_embedding_layers` saves a `modules_to_save` wrapper whole: the
            # untrained original, which `merge_and_unload` drops for the trained copy
            continue
        if ".modules_to_save." in key:
            # ... and the trained copy under the wrapper's name, beside the same tensor under
            # the module's own (`lm_head.weight`), the one read
            key = key.replace(".modules_to_save.", ".", 1)
            if key in adapter_keys:
                continue
        if any(part in key for part in _TRAINABLE_TOKENS):
            raise FormatError(
                f"holds {entry.name!r}: trainable tokens (trainable_token_indices), which "
                "`ckpt merge` does not merge",
                path=where,
                fix="Merge it with peft's merge_and_unload.",
            )
        bias = _LORA_BIAS.fullmatch(key)
        if bias is not None:
            _plan_bias(bias.group("module"), entry.name, base, quant, known, names, updates, where)
            continue
        match = _LORA.fullmatch(key)
        if match is None:
            if ".lora_" in key:
                raise FormatError(
                    f"holds {entry.name!r}, a LoRA tensor `ckpt merge` does not know",
                    path=where,
                    fix="Merge it with peft's merge_and_unload.",
                )
            # a `modules_to_save` copy, or a targeted embedding layer peft saved whole
            # (`save_embedding_layers`: `embed_tokens.base_layer.weight`): the adapter's
            # tensor replaces the base's, and that layer's own LoRA update applies on top
            module, param = key.rsplit(".", 1)[0], key.rsplit(".", 1)[-1]
            direct = _base_name(module.removesuffix(".base_layer"), param, known)
            target = direct or _base_name(module.removesuffix(".base_layer"), param, known, tied)
            saved_whole = config.get("modules_to_save") or []
            trained = _targeted(module, saved_whole)
            if (
                direct is None
                and target is not None
                and not module.endswith(".base_layer")
                and not trained
                and not _targeted(target.removesuffix(".weight"), saved_whole)
            ):
                # the output head of a tied pair saved whole (`save_embedding_layers`), neither
                # side a `modules_to_save` copy: the shared tensor itself, and the tie stays
                if _resized_against(entry, base, target, "it is tied to", where):
                    resized[target] = list(entry.shape)
                replaced.setdefault(target, entry.name)  # the embedding's own copy first
                continue
            if direct is None and target is not None and not module.endswith(".base_layer"):
                # a `modules_to_save` copy of an output head tied to the embedding: peft
                # trains the copy alone and leaves the embedding as it was, so merged the two
                # are separate tensors (`merge_and_unload` unties them)
                alias = next(a for a, t in tied.items() if t == target)
                if _resized_against(entry, base, target, "it stands beside", where):
                    resized[alias] = list(entry.shape)
                untied[alias] = (entry.name, target)
                continue
            if target is None:
                raise NotFoundError(
                    f"{entry.name!r} replaces a base weight {key!r} the base does not have",
                    path=where,
                    fix="Check that the adapter was trained on this base model.",
                )
            held = base.manifest.by_name[target].dtype if target in names else None
            if held != entry.dtype and (
                held not in _MERGEABLE or target in quant.weights or target not in names
            ):
                # a float copy cast into quantized codes, or one written beside them
                problem = _not_mergeable(base, quant, target, module, names)
                assert problem is not None
                raise problem
            held_shape = base.manifest.by_name[target].shape if target in names else None
            if (
                held_shape is not None
                and target.endswith(_VOCABULARY)
                and _vocabulary_resized(list(held_shape), list(entry.shape))
            ):
                # the embedding or output head of a resized vocabulary, saved whole: it
                # replaces the base's (`_check_vocabulary` judges the whole model)
                resized[target] = list(entry.shape)
            elif held_shape is not None and list(entry.shape) != list(held_shape):
                # a copy saved from a base of another size (a larger vocabulary): the merged
                # model would not load, and peft cannot load the adapter into this base
                raise FormatError(
                    f"{entry.name!r} has shape {list(entry.shape)}, the base weight "
                    f"{target!r} it replaces is {list(held_shape)}",
                    path=where,
                    fix="Check that the adapter was trained on this base model (a resized "
                    "vocabulary: resize the base's embeddings and save it, then merge).",
                )
            replaced[target] = entry.name
            if trained:
                # a copy of an embedding the base ties its output head to: peft trains the
                # copy alone and the head keeps the embedding's original values
                for alias in (a for a, t in tied.items() if t == target):
                    untied.setdefault(alias, (None, target))
            continue
        module, part = match.group("module"), match.group("part")
        if parameter_targets and part in ("lora_A", "lora_B"):
            owner, depth = module, 0
            while owner.endswith(".base_layer"):
                owner, depth = owner.removesuffix(".base_layer"), depth + 1
            named = _named_parameters(owner, parameter_targets)
            for key in named:
                # a stack stored quantized (gpt-oss's MXFP4 `gate_up_proj_blocks`): refused
                # as every quantized LoRA target is, by its scheme
                held = _base_name(owner, key.rpartition(".")[2], known)
                if held is not None and held not in names:
                    problem = _not_mergeable(base, quant, held, owner, names)
                    if problem is not None:
                        raise problem
            if _wrapped_parameters(owner, parameter_targets, names, base):
                wrapped.setdefault(owner, {}).setdefault(depth, {})[part] = entry
                continue
            if named and _base_name(owner, "weight", known) is None:
                raise NotFoundError(
                    f"the adapter updates {', '.join(named)} (target_parameters), which the "
                    "base stores neither under that name nor one tensor per expert "
                    "(experts.N.gate_proj / up_proj / down_proj)",
                    path=where,
                    fix="Check that the adapter was trained on this base model; a base whose "
                    "experts transformers renames on load (Mixtral's w1/w2/w3): merge it with "
                    "peft's merge_and_unload.",
                )
        magnitude = part == "lora_magnitude_vector"
        if magnitude and not config.get("use_dora"):
            raise FormatError(
                f"holds {entry.name!r}, a DoRA magnitude, but adapter_config.json does not say "
                "use_dora: peft would merge it as plain LoRA and drop the magnitudes",
                path=where,
                fix="Use the adapter_config.json saved with these weights.",
            )
        if len(entry.shape) != (1 if magnitude else 2):
            raise FormatError(
                f"{entry.name!r} has shape {entry.shape}: only LoRA on linear and embedding "
                "layers is merged",
                path=where,
                fix="Merge convolution LoRA with peft's merge_and_unload.",
            )
        target = _base_name(module, "weight", known, tied)
        if target is None:
            raise NotFoundError(
                f"the adapter targets {module!r}, which has no weight in the base",
                path=where,
                fix="Check that the adapter was trained on this base model.",
            )
        problem = _not_mergeable(base, quant, target, module, names)
        if problem is not None:
            raise problem
        update = updates.setdefault(target, _Update(module))
        if update.module != module:  # two LoRA layers on one tied tensor (embedding + lm_head)
            raise _tied_pair_refused(update.module, module, target, where)
        if magnitude:
            update.magnitude = entry.name
            continue
        update.embedding = part.startswith("lora_embedding")
        if part.endswith("A"):
            update.a = entry.name
        else:
            update.b = entry.name
    factors = adapter.manifest.by_name
    for target, update in updates.items():
        if update.bias is not None:
            continue
        if update.a is None or update.b is None:
            raise FormatError(
                f"{update.module!r} has only one of its two LoRA factors",
                path=where,
                fix="The adapter file is incomplete; save it again.",
            )
        product = [factors[update.b].shape[0], factors[update.a].shape[1]]
        # a LoRA layer on an embedding peft saved resized updates the saved one
        weight = resized.get(target) or list(base.manifest.by_name[target].shape)
        transposed = _orientation(update, product, weight, model_type, config)
        if transposed is None:
            raise FormatError(
                f"the LoRA update of {update.module!r} has shape {product}, "
                f"the base weight {target!r} is {weight}",
                path=where,
                fix="Check that the adapter was trained on this base model.",
            )
        update.transposed = transposed
        _check_dora(update, config, product[0], where, factors)
    for owner, levels in wrapped.items():
        _plan_parameters(
            owner, levels, parameter_targets, base, quant, names, model_type, updates, where
        )
    _check_coverage(base, config, names, updates, where)
    _check_vocabulary(base, names, tied, untied, resized, where)
    return updates, replaced, untied, resized


def _parameter_targets(config: dict[str, Any]) -> list[str]:
    """adapter_config.json's `target_parameters`: the parameters peft wraps one by one (a MoE
    layer's `mlp.experts.gate_up_proj` stack), which no `target_modules` layer holds."""
    targets = config.get("target_parameters")
    return [t for t in targets if isinstance(t, str)] if isinstance(targets, list) else []


@dataclass(frozen=True)
class _Stored:
    """A parameter `target_parameters` names, as the base stores it: its shape in the model
    (`[E, X, Y]` for a stack of E experts) and the tensors holding it, each with the expert it
    holds (None: the whole parameter) and that expert's rows (None: all of them)."""

    shape: list[int]
    pieces: list[tuple[str, int | None, tuple[int, int] | None]]


#: expert stacks transformers builds on load from one tensor per expert (its conversion
#: mapping of the Qwen2-MoE family: Qwen3-MoE, DeepSeek-V2/V3, OLMoE, GLM-4-MoE...): the
#: stack -> the per-expert projections concatenated into each expert's rows
_PER_EXPERT: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _stored_parameter(module: str, param: str, names: set[str], base: Checkpoint) -> _Stored | None:
    """How the base stores `module`'s parameter `param`: as one tensor of that name (a
    weight, or a stack saved whole, as gpt-oss's), or one tensor per expert
    (`experts.0.gate_proj.weight`...: save_pretrained writes most MoE models' stacks so); None
    when it holds neither."""
    whole = _base_name(module, param, names)
    if whole is not None:
        return _Stored(list(base.manifest.by_name[whole].shape), [(whole, None, None)])
    projections = _PER_EXPERT.get(param)
    if projections is None:
        return None
    first = _base_name(module, f"0.{projections[0]}.weight", names)
    if first is None:
        return None
    prefix = first.removesuffix(f"0.{projections[0]}.weight")
    pieces: list[tuple[str, int | None, tuple[int, int] | None]] = []
    size: tuple[int, int] | None = None  # each expert's (rows, columns)
    expert = 0
    while f"{prefix}{expert}.{projections[0]}.weight" in names:
        held = [f"{prefix}{expert}.{projection}.weight" for projection in projections]
        if any(name not in names for name in held):
            return None
        shapes = [list(base.manifest.by_name[name].shape) for name in held]
        if any(len(shape) != 2 for shape in shapes) or len({shape[1] for shape in shapes}) != 1:
            return None
        rows = sum(shape[0] for shape in shapes)
        if size not in (None, (rows, shapes[0][1])):
            return None
        size = (rows, shapes[0][1])
        row = 0
        for name, shape in zip(held, shapes, strict=True):
            pieces.append((name, expert, (row, row + shape[0]) if len(held) > 1 else None))
            row += shape[0]
        expert += 1
    if size is None:
        return None
    return _Stored([expert, *size], pieces)


def _named_parameters(module: str, targets: list[str]) -> list[str]:
    """The names of `module`'s parameters that `targets` (`target_parameters`) name: peft's
    rule, a parameter whose full name is a target or ends with `.` and one."""
    keys = (f"{module}.{target.rpartition('.')[2]}" for target in targets)
    return [
        key
        for key, target in zip(keys, targets, strict=True)
        if key == target or key.endswith(f".{target}")
    ]


def _wrapped_parameters(
    module: str, targets: list[str], names: set[str], base: Checkpoint
) -> dict[str, _Stored]:
    """The parameters of `module` that `targets` (`target_parameters`) name
    (`_named_parameters`), as the base stores them; those it does not store are left out."""
    found: dict[str, _Stored] = {}
    for key in _named_parameters(module, targets):
        stored = _stored_parameter(module, key.rpartition(".")[2], names, base)
        if stored is not None:
            found.setdefault(key, stored)
    return found


def _parameter_fits(
    a: list[int], b: list[int], shape: list[int], model_type: str | None
) -> list[bool]:
    """The layouts (`transposed` or not) in which a `ParamWrapper`'s factors, lora_A `a`
    (`[r * E, in]`) and lora_B `b` (`[out, r * E]`), update a parameter of `shape`, as peft
    reads them: a 2-D weight is `[out, in]`; an `[E, X, Y]` expert stack is `[E, out, in]`, or
    `[E, in, out]` in the models whose experts are transposed. A square stack's layout is the
    model type's (both, so refused, when the model type is unknown)."""
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        return []
    if len(shape) == 2:
        return [False] if [b[0], a[1]] == shape else []
    if len(shape) != 3 or shape[0] < 1 or a[0] % shape[0]:
        return []
    _, rows, cols = shape
    found = [
        transposed
        for transposed, (inputs, outputs) in ((False, (cols, rows)), (True, (rows, cols)))
        if (a[1], b[0]) == (inputs, outputs)
    ]
    if len(found) == 2 and model_type is not None:
        return [model_type in _TRANSPOSED_EXPERT_MODEL_TYPES]
    return found


def _plan_parameters(
    owner: str,
    levels: dict[int, dict[str, Entry]],
    targets: list[str],
    base: Checkpoint,
    quant: QuantAnalysis,
    names: set[str],
    model_type: str | None,
    updates: dict[str, _Update],
    where: str,
) -> None:
    """The updates of the parameters of `owner` that `target_parameters` names: peft wraps each
    in a `ParamWrapper`, nested when a module has several (`experts.lora_A`,
    `experts.base_layer.lora_A`...) in an order no file records, so each wrapper's factors
    are matched to the one parameter their shapes fit; anything else is refused."""
    params = _wrapped_parameters(owner, targets, names, base)
    done: set[str] = set()
    for depth, parts in sorted(levels.items()):
        label = owner + ".base_layer" * depth
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None:
            raise FormatError(
                f"{label!r} has only one of its two LoRA factors",
                path=where,
                fix="The adapter file is incomplete; save it again.",
            )
        fits = [
            (key, transposed)
            for key, stored in params.items()
            for transposed in _parameter_fits(
                list(a.shape), list(b.shape), stored.shape, model_type
            )
        ]
        if len(fits) != 1:
            found = ", ".join(f"{key} {stored.shape}" for key, stored in params.items())
            raise FormatError(
                f"the LoRA factors of {label!r} (lora_A {list(a.shape)}, lora_B "
                f"{list(b.shape)}) fit {'none' if not fits else 'more than one'} of the "
                f"parameters target_parameters names there ({found})",
                path=where,
                fix="Check that the adapter was trained on this base model"
                + ("" if not fits else "; merge it with peft's merge_and_unload")
                + ".",
            )
        ((key, transposed),) = fits
        stored = params[key]
        if key in done:
            raise FormatError(
                f"two LoRA wrappers of {owner!r} update the same parameter {key!r}",
                path=where,
                fix="The adapter file is inconsistent; save it again.",
            )
        done.add(key)
        if transposed and len(stored.pieces) > 1:
            raise FormatError(
                f"the adapter updates {key!r}, an expert stack stored transposed ([E, in, out]) "
                "one tensor per expert, a layout `ckpt merge` does not split",
                path=where,
                fix="Merge it with peft's merge_and_unload.",
            )
        for name, expert, rows in stored.pieces:
            problem = _not_mergeable(base, quant, name, owner, names)
            if problem is not None:
                raise problem
            update = _Update(key)
            update.a, update.b = a.name, b.name
            update.transposed = transposed
            update.experts = stored.shape[0] if len(stored.shape) == 3 else 1
            update.expert, update.rows = expert, rows
            updates[name] = update


#: the tensors whose rows are the vocabulary: the input embeddings and the output head
_VOCABULARY = (*_EMBEDDINGS, "lm_head.weight")


def _resized_against(
    entry: Entry, base: Checkpoint, target: str, relation: str, where: str
) -> bool:
    """Whether the adapter's whole copy `entry` of the tied base weight `target` has another
    vocabulary size (its rows replace the base's); FormatError when it differs otherwise
    (`relation`: how the two weights are paired, for the message)."""
    tied_shape = list(base.manifest.by_name[target].shape)
    if _vocabulary_resized(tied_shape, list(entry.shape)):
        return True
    if list(entry.shape) != tied_shape:
        raise FormatError(
            f"{entry.name!r} has shape {list(entry.shape)}, the base weight {target!r} "
            f"{relation} is {tied_shape}",
            path=where,
            fix="Check that the adapter was trained on this base model.",
        )
    return False


def _vocabulary_resized(held: list[int], saved: list[int]) -> bool:
    """Whether a saved `[rows, width]` tensor is the base's `held` one of another vocabulary
    (`resize_token_embeddings`): the same width, other rows."""
    return len(held) == len(saved) == 2 and held[1] == saved[1] and held[0] != saved[0]


def _check_vocabulary(
    base: Checkpoint,
    names: set[str],
    tied: dict[str, str],
    untied: dict[str, tuple[str | None, str]],
    resized: dict[str, list[int]],
    where: str,
) -> None:
    """An adapter trained on a resized vocabulary (`resize_token_embeddings`) merges when it
    saved every tensor of that vocabulary whole (peft's `save_embedding_layers`, or
    `modules_to_save` on the embedding and the head): those replace the base's, as peft's
    `merge_and_unload` on the resized base gives. A vocabulary tensor it did not save would
    need the rows `resize_token_embeddings` added to the base, which this base does not hold:
    refused, naming both sizes and the fix."""
    if not resized:
        return
    rows = sorted({shape[0] for shape in resized.values()})
    vocabulary = sorted(n for n in names if n.endswith(_VOCABULARY) and n not in tied.values())
    vocabulary += sorted(tied.values())
    vocabulary += sorted(untied)
    held = base.manifest.by_name
    first = next(iter(resized))
    base_rows = (held[first] if first in held else held[untied[first][1]]).shape[0]
    missing = [n for n in vocabulary if n not in resized]
    if len(rows) == 1 and not missing:
        return
    saved = ", ".join(repr(n) for n in resized)
    sizes = " and ".join(str(r) for r in rows)
    lacking = ", ".join(repr(n) for n in missing)
    raise FormatError(
        f"was trained on a resized vocabulary: it holds {saved} for {sizes} tokens, the base "
        f"holds {base_rows}"
        + (f", and it holds no {lacking} of that size" if missing else "")
        + ": the merged model would take rows the base does not have",
        path=where,
        fix="Merge into the base the adapter was trained on: if that was this base resized, "
        f"resize it as training did (`model.resize_token_embeddings({rows[-1]})`), save it "
        "and merge into that folder, or save the adapter again with "
        "`save_embedding_layers=True` so it holds the embedding and the output head whole.",
    )


def _targeted(module: str, targets: list[str] | str) -> bool:
    """peft's rule for a `target_modules` list (a module name or a tail of dotted parts) or
    string (a regular expression the whole module name matches)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _check_coverage(
    base: Checkpoint,
    config: dict[str, Any],
    names: set[str],
    updates: Collection[str],
    where: str,
    held: str = "LoRA factors",
) -> None:
    """Refuse an adapter trained on another base that happens to fit this one's shapes (a
    shallower model of the same width): a base layer its own `target_modules` selects, holding
    no LoRA factors. peft warns of the missing keys and leaves (or fills at random) what it
    never trained. Not judged where the config narrows the targets otherwise
    (`layers_to_transform`, `exclude_modules`, `target_parameters`, `all-linear`).
    `updates`: the base weights the adapter updates; `held`: what it holds per layer."""
    targets = config.get("target_modules")
    if (
        not targets
        or targets == "all-linear"
        or not isinstance(targets, (str, list))
        or any(
            config.get(k) for k in ("layers_to_transform", "exclude_modules", "target_parameters")
        )
        or not all(isinstance(t, str) for t in targets)
    ):
        return
    try:
        lacking = sorted(
            n
            for n in names
            if n.endswith(".weight")
            and n not in updates
            and len(base.manifest.by_name[n].shape) == 2
            and base.manifest.by_name[n].dtype in _MERGEABLE
            and _targeted(n.removesuffix(".weight"), targets)
        )
    except re.error:
        return  # peft would not build it either; the factors decide
    if lacking and updates:
        module = lacking[0].removesuffix(".weight")
        more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
        raise FormatError(
            f"adapter_config.json targets {config['target_modules']!r}, which selects the base's "
            f"{module!r}{more}, but the adapter holds no {held} for it: it was trained "
            f"on another base ({config.get('base_model_name_or_path') or 'unnamed'})",
            path=where,
            fix="Check that the adapter was trained on this base model; merge it into the "
            "base it was trained on.",
        )


class MergeRequest(Request):
    """Every option of `merge` but the locations, typed and frozen (a test holds its fields to
    `merge`'s keyword parameters and the command's options).

    Attributes:
        force: replace an existing DEST once the new output is complete.
        dry_run: plan only: read metadata, write nothing, report what would be written.
    """

    force: bool = False
    dry_run: bool = False


def merge(
    base: str,
    adapter: str,
    dest: str,
    *,
    force: bool = False,
    dry_run: bool = False,
    progress: Progress = NULL_PROGRESS,
) -> MergeReport:
    """Merge the LoRA adapter folder `adapter` into the base model `base`, writing `dest`.

    Args:
        base: the base model folder (or one safetensors / torch file).
        adapter: a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.*`).
        dest: the output folder (refused if it exists, unless `force`).
        force: replace an existing `dest` once the new output is complete.
        dry_run: plan only: the report says what would be written (files and their sizes,
            tensors, bytes, dtypes); nothing is written, `dest` is not created.
        progress: progress sink (bytes).
    """
    return merge_with(base, adapter, dest, MergeRequest(force=force, dry_run=dry_run), progress)


def merge_with(
    base: str, adapter: str, dest: str, request: MergeRequest, progress: Progress = NULL_PROGRESS
) -> MergeReport:
    """`merge` as `request` says (the command's one call)."""
    force = request.force
    # each side is resolved (listed, its Hub revision pinned) once and read through that; the
    # base first, so a missing BASE is the error named when both are
    base_source = resolve_source(base)
    adapter_source = resolve_source(adapter)
    config = read_json(adapter_source, "adapter_config.json")
    if not isinstance(config, dict):
        _refuse_diffusers_lora(adapter, adapter_source)
        raise NotFoundError(
            "has no readable adapter_config.json",
            path=adapter,
            fix="Point ADAPTER at the folder peft's save_pretrained wrote.",
        )
    kind = str(config.get("peft_type") or "").upper()
    if kind in VARIANT_LABELS:
        check_variant_config(kind, config, adapter)
    elif kind != "LORA":
        raise FormatError(
            f"is a {config.get('peft_type') or 'non-LoRA'} adapter; `ckpt merge` merges LoRA "
            "(and DoRA), IA³, LoHa and LoKr adapters",
            path=adapter,
            fix="Merge it with peft's merge_and_unload() and save_pretrained.",
        )
    else:
        _check_lora_config(config, adapter)
    if config.get("trainable_token_indices"):
        raise FormatError(
            "trains tokens of an embedding (trainable_token_indices), which `ckpt merge` "
            "does not merge",
            path=adapter,
            fix="Merge it with peft's merge_and_unload.",
        )
    _refuse_layer_replication(config, adapter)
    weights = next(
        (
            n
            for n in ("adapter_model.safetensors", "adapter_model.bin")
            if n in adapter_source.files
        ),
        None,
    )
    if weights is None:
        raise NotFoundError(
            "has no adapter_model.safetensors or adapter_model.bin",
            path=adapter,
            fix="Point ADAPTER at the folder peft's save_pretrained wrote.",
        )
    dest_path = local_destination(resolve_destination(dest))
    if dest_path is None:
        raise UsageError(
            "merge writes to a local folder",
            path=dest,
            fix="Name a local folder as DEST (upload it afterwards, e.g. with `ckpt sync`).",
        )
    # neither source is ever modified: a DEST that is, holds or lies inside BASE or ADAPTER
    # (which `--force` would replace) is refused, as convert and reshard refuse it
    guard_paths(base, dest_path)
    guard_paths(adapter, dest_path)
    if request.dry_run:
        # the real run refuses an existing DEST (or a missing parent) before any work: its
        # dry run says so too
        check_destination(dest_path, force)
    _refuse_pipeline_base(base, adapter, dest, base_source, config)
    base_checkpoint = open_plain(base_source)
    try:
        adapter_weights = Source(
            location=parse_location(f"{adapter.rstrip('/')}/{weights}"),
            storage=adapter_source.storage,
            target=weights,
            origin=adapter_source.origin,
        )
        adapter_checkpoint = open_plain(adapter_weights)
    except BaseException:
        base_checkpoint.close()
        raise
    # the architecture that tells a square `Conv1D` weight from an `nn.Linear` one: a
    # transformers model's type (remote code, `auto_map`, may define its own `Conv1D` layers)
    base_config = read_json(base_source, "config.json")
    model_type = (
        base_config.get("model_type")
        if isinstance(base_config, dict) and "auto_map" not in base_config
        else None
    )
    try:
        quant = analyse_checkpoint(base_checkpoint.manifest, base_checkpoint.storage)
        known_type = model_type if isinstance(model_type, str) else None
        variants, rest = _plan_variants(
            kind, base_checkpoint, adapter_checkpoint, config, quant, known_type
        )
        updates, replaced, untied, resized = _plan_updates(
            base_checkpoint, adapter_checkpoint, config, quant, known_type, rest
        )
    except BaseException:
        base_checkpoint.close()
        adapter_checkpoint.close()
        raise
    merged = MergedCheckpoint(
        base_checkpoint, adapter_checkpoint, updates, replaced, config, untied, resized, variants
    )
    # the vocabulary the adapter was trained on, when it resized the base's
    vocab_size = next((shape[0] for shape in resized.values()), None)
    # the base's config, tokenizer, generation config and code, as `convert` carries them
    companions = extra_files(base_checkpoint)
    # a resized vocabulary's tokens are in the tokenizer saved beside the adapter (the recipe:
    # `tokenizer.add_tokens`, `resize_token_embeddings(len(tokenizer))`, both saved), not
    # in the base's: the adapter's tokenizer files replace the base's whole set
    tokenizer_files = frozenset(n for n in SERVING_FILES if n != "generation_config.json")
    from_adapter = [
        n
        for n in sorted(tokenizer_files)
        if vocab_size is not None
        and (adapter_source.files.get(n) or 0) <= MAX_EXTRA_BYTES
        and n in adapter_source.files
    ]
    if from_adapter:
        companions = [c for c in companions if c not in tokenizer_files]
    shard = _shard_size(base_checkpoint)
    with merged:
        # written as Hugging Face libraries save weights, so `from_pretrained(DEST)` loads it
        target = get_format(HF_WEIGHTS)
        plan = plan_transfer(
            merged.manifest, keep_objects=target.holds_objects, dedupe_tied=target.dedupes_tied
        )
        metadata = target.output_metadata(base_checkpoint.manifest.metadata, plan.aliases)
        options = WriteOptions(max_shard_size=shard, metadata=metadata, basename="model")
        # the base's own file names (a diffusers model's `diffusion_pytorch_model[.VARIANT]`
        # and its variant index, a transformers variant's `model.fp16`): the library that
        # loaded the base finds the merged weights under the same names
        apply_naming(base_source, target.name, options)
        # its companions are written below, as the base's (config.json rewritten when the
        # merge changes what it says)
        options.companions.clear()

        def companion(rel: str) -> bytes:
            """A file written beside the weights: the adapter's tokenizer file, or the base's
            companion (its config.json saying an untied head or a resized vocabulary)."""
            if rel in from_adapter:
                return adapter_source.storage.read_all(rel)
            data = base_source.storage.read_all(rel)
            if rel == "config.json" and (untied or resized) and isinstance(base_config, dict):
                written_config = dict(base_config)
                if untied:
                    # the head is its own tensor now: loaders must not tie it back
                    written_config["tie_word_embeddings"] = False
                if vocab_size is not None:
                    # `resize_token_embeddings` sets it so on the model peft merges
                    written_config["vocab_size"] = vocab_size
                data = (json.dumps(written_config, indent=2, sort_keys=True) + "\n").encode()
            return data

        # counted before the write spends the plan's items
        tensors = [i.target for i in plan.items if i.target.kind == "tensor"]
        dtypes: dict[str, int] = {}
        for entry in tensors:
            key = entry.dtype or "unknown"
            dtypes[key] = dtypes.get(key, 0) + 1
        tensor_bytes = sum(e.nbytes for e in tensors)
        skipped = _unused_files(
            base_checkpoint, plan, companions, adapter, adapter_source, [weights, *from_adapter]
        )
        written_names: list[str]
        if request.dry_run:
            files = planned_files(target, plan, dest_path, options)
            files += [
                FileInfo(path=rel, size=len(companion(rel)), entries=0)
                for rel in [*from_adapter, *companions]
            ]
            written_names = [i.target.name for i in plan.items]
        else:
            with staged_output(dest_path, commit_marker=is_commit_marker, force=force) as staging:
                inner = staging / "weights"
                files, written = run_write(
                    merged, plan, inner, target.name, options, progress=progress
                )
                for child in inner.iterdir():
                    child.rename(staging / child.name)
                inner.rmdir()
                for rel in [*from_adapter, *companions]:
                    data = companion(rel)
                    (staging / rel).write_bytes(data)
                    files.append(FileInfo(path=rel, size=len(data), entries=0))
            written_names = [w.name for w in written]
    return MergeReport(
        base=base,
        adapter=adapter,
        dest=str(dest_path),
        adapter_type=VARIANT_LABELS.get(kind, "LoRA"),
        base_model=config.get("base_model_name_or_path"),
        r=config.get("r"),
        lora_alpha=config.get("alpha" if kind in VARIANT_LABELS else "lora_alpha"),
        merged=sorted([*updates, *variants]),
        replaced=sorted([*replaced, *(a for a, (copy, _) in untied.items() if copy)]),
        copied=sum(
            1
            for name in written_names
            if name not in updates
            and name not in variants
            and name not in replaced
            and not (name in untied and untied[name][0])
        ),
        vocab_size=vocab_size,
        tokenizer_from_adapter=from_adapter,
        skipped=skipped,
        files=files,
        tensors=len(tensors),
        tensor_bytes=tensor_bytes,
        dtypes=dict(sorted(dtypes.items())),
        dry_run=request.dry_run,
    )


def _plan_variants(
    kind: str,
    base: Checkpoint,
    adapter: Checkpoint,
    config: dict[str, Any],
    quant: QuantAnalysis,
    model_type: str | None,
) -> tuple[dict[str, VariantUpdate], list[Entry] | None]:
    """An IA³ / LoHa / LoKr adapter's own updates (`merge_variants.plan_variants`), and the
    adapter tensors left to plan as a LoRA adapter's are (its `modules_to_save` copies).
    Nothing, and None (every tensor), for a LoRA adapter."""
    if kind not in VARIANT_LABELS:
        return {}, None
    tensors = [e for e in adapter.manifest.entries if e.kind == "tensor"]
    own, rest = split_variant_entries(kind, tensors)
    names = {e.name for e in base.manifest.entries if e.kind == "tensor"}
    known = names | set(quant.weights) | {m + ".weight" for m in quant.packed}
    shapes = {n: list(base.manifest.by_name[n].shape) for n in names}
    tied = _tied_names(names)

    def is_conv1d(module: str) -> bool:
        """A square weight's layer is transformers' `Conv1D` (`_orientation`'s rule)."""
        if model_type is None:
            return bool(config.get("fan_in_fan_out"))
        return model_type in _CONV1D_MODEL_TYPES and module.rsplit(".", 1)[-1] in _CONV1D_MODULES

    variants = plan_variants(
        kind,
        config,
        own,
        shapes,
        # a layer on the output head of a base that ties it to its embedding updates that
        # one shared tensor, as peft's merge does (and LoRA's, above)
        lambda module, suffix: _base_name(module, suffix, known, tied),
        lambda target, module: _not_mergeable(
            base, quant, target, module, names, f"the {VARIANT_LABELS[kind]} update"
        ),
        is_conv1d,
        adapter.manifest.location,
    )
    if not variants:
        raise FormatError(
            f"holds no {VARIANT_LABELS[kind]} tensors",
            path=adapter.manifest.location,
            fix="Point ADAPTER at the folder peft's save_pretrained wrote.",
        )
    # an adapter trained on a shallower base of the same width fits every weight it holds
    _check_coverage(
        base,
        config,
        names,
        variants,
        adapter.manifest.location,
        f"{VARIANT_LABELS[kind]} weights",
    )
    return variants, rest


def _refuse_layer_replication(config: dict[str, Any], adapter: str) -> None:
    """An adapter trained with peft's `layer_replication` updates layers the base does not have.

    peft stacks the base's layers by the config's `[start, end)` ranges before it wraps them,
    the copies sharing the base's weights, each copy with its own LoRA update: no merge into the
    base's own layers is that model, and peft's own `merge_and_unload` adds every copy's update
    into the one weight they share. Refused by name, not as "trained on another base"."""
    ranges = config.get("layer_replication")
    if not ranges:
        return
    stacked = None
    if isinstance(ranges, list) and all(
        isinstance(r, list)
        and len(r) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in ranges
    ):
        stacked = sum(max(0, end - start) for start, end in ranges)
    into = f" into {stacked} layers" if stacked is not None else ""
    raise FormatError(
        f"was trained with peft's layer_replication {json.dumps(ranges)[:200]}: peft stacked "
        f"the base's layers{into}, the copies sharing the base weights and each copy with a "
        "LoRA update of its own, so no merge into the base's layers is the trained model "
        "(peft's own merge_and_unload adds every copy's update into the one weight they share)",
        path=f"{adapter.rstrip('/')}/adapter_config.json",
        fix="Use the adapter unmerged: PeftModel.from_pretrained(base, ADAPTER) replicates the "
        "layers as in training.",
    )


def _refuse_pipeline_base(
    base: str, adapter: str, dest: str, base_source: Source, config: dict[str, Any]
) -> None:
    """Refuse a diffusers pipeline's root given as BASE (a LoRA is trained on one of its
    components), naming the component the adapter's class is (peft records the class it
    wrapped in `auto_mapping`, model_index.json the class of each component) and the way to
    a whole pipeline with it merged. Nothing when BASE is no pipeline root."""
    if base_source.target is not None or "model_index.json" not in base_source.files:
        return
    index = read_json(base_source, "model_index.json")
    if not isinstance(index, dict):
        return
    mapping = config.get("auto_mapping")
    wrapped = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    folders = top_folders(base_source.files)
    with_weights = [n for n, inner in folders.items() if any(map(is_checkpoint_file, inner))]
    matching = [
        name
        for name, value in index.items()
        if isinstance(value, list) and value[-1:] == [wrapped] and name in with_weights
    ]
    root = base.rstrip("/")
    if len(matching) == 1:
        said = f"the adapter was trained on its {wrapped}, the {matching[0]} component"
        name, first = matching[0], "Merge into that component's folder"
    else:
        listed = ", ".join(f"{n}/" for n in with_weights)
        said = f"an adapter is merged into one of its components ({listed})"
        name, first = "COMPONENT", "Name the component the adapter was trained on"
    fix = f"{first}: `ckpt merge {root}/{name} {adapter} {dest}`."
    if "://" not in root:
        # a local pipeline: a copy of it with the component replaced is the whole pipeline
        fix = (
            f"{first}; for the whole pipeline with it merged: `cp -r {root} {dest} && ckpt "
            f"merge {root}/{name} {adapter} {dest}/{name} --force`."
        )
    raise UsageError(f"is a diffusers pipeline (model_index.json): {said}", path=base, fix=fix)


def _refuse_diffusers_lora(adapter: str, adapter_source: Source) -> None:
    """Refuse a diffusers LoRA (one `pytorch_lora_weights.*`, no adapter_config.json) as what
    it is: its keys are named per pipeline component (`unet.…`, `text_encoder.…`) in one of
    several spellings, and its alpha is not always saved, so diffusers' own loader is the one
    that knows how to fuse it. Nothing when `adapter_source` holds no such file."""
    held = sorted(n for n in adapter_source.files if n.rsplit("/", 1)[-1] in DIFFUSERS_LORA_FILES)
    if not held:
        return
    raise FormatError(
        f"holds a diffusers LoRA ({held[0]}, as diffusers' save_lora_weights / "
        "save_lora_adapter write it), not a peft adapter folder (adapter_config.json + "
        "adapter_model.*), which is what `ckpt merge` merges",
        path=adapter,
        fix="Fuse it with diffusers: a pipeline's (keys `unet.…`, `text_encoder.…`): `pipe = "
        "DiffusionPipeline.from_pretrained(PIPELINE); pipe.load_lora_weights(ADAPTER); "
        "pipe.fuse_lora(); pipe.unload_lora_weights(); pipe.save_pretrained(DEST)`; one "
        "model's (save_lora_adapter): `model.load_lora_adapter(ADAPTER, prefix=None, "
        f"weight_name={held[0].rsplit('/', 1)[-1]!r}); model.fuse_lora(); model.unload_lora(); "
        "model.save_pretrained(DEST)`.",
    )


def _unused_files(
    base: Checkpoint,
    plan: TransferPlan,
    carried: list[str],
    adapter: str,
    adapter_source: Source,
    read: list[str],
) -> list[SkippedEntry]:
    """The files of BASE the output neither reads nor carries (`transfer.account_files`, as
    `convert` says them: an `original/` folder of other weights, a file too large to be a
    tokenizer's...), then ADAPTER's besides its config, its weights and the tokenizer files
    taken from it (`read`): its model card, its training arguments."""
    _, skipped = account_files(base, plan, carried, single_file=False)
    folder = adapter.rstrip("/")
    skipped += [
        SkippedEntry(
            name=f"{folder}/{rel}",
            kind="file",
            reason=_adapter_file_left(rel, folder, adapter_source),
        )
        for rel in sorted(adapter_source.files)
        if rel not in read and rel != "adapter_config.json"
    ]
    return skipped


def _adapter_file_left(rel: str, folder: str, adapter_source: Source) -> str:
    """Why file `rel` of ADAPTER (`folder`) is not in the merged model. peft's save_pretrained
    writes every adapter but the default one in a subfolder named after it (`second/`, with its
    own adapter_config.json): another adapter, which `merge` leaves as peft's
    `PeftModel.from_pretrained(base, ADAPTER)` does, and merges when pointed at it."""
    if rel.rsplit("/", 1)[-1].startswith("."):
        return "a hidden file: not part of the checkpoint"
    sub = rel.split("/", 1)[0] if "/" in rel else None
    if sub is not None and f"{sub}/adapter_config.json" in adapter_source.files:
        return (
            f"a file of another adapter of the folder ({sub!r}, which peft saves beside the "
            "default one): not merged, as peft's PeftModel.from_pretrained(base, ADAPTER) loads "
            f"the default one alone; merge it on its own with `ckpt merge BASE {folder}/{sub}`"
        )
    return (
        "a file of the adapter folder (its card, or training state saved beside it), not of "
        "the merged model, which carries the base's config and tokenizer"
    )


def _shard_size(checkpoint: Checkpoint) -> int | None:
    """The base's own shard size (its largest shard, safetensors or `.bin`), so the output is
    cut the same way."""
    files = [f for f in checkpoint.manifest.files if f.entries]
    if len(files) <= 1:
        return None
    return max(f.size or 0 for f in files) or None
