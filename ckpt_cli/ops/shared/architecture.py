"""`convert --to hf` / `--to torchtitan`: a transfer plan mapped to another framework naming.

`convert` plans as for any target (selection, filters, renames), then `map_plan` recognises
the model's family and naming from the planned names (`architectures.recognise`), learns the
model's args from the shapes and a Hugging Face `config.json` (`--config`, or the source's
own), and maps the plan's tensors through the family's rules. What comes back is a
`MappedCheckpoint` over the source and a plan over it, which the usual streaming writers write
(safetensors shards + index for `hf`, a DCP save for `torchtitan`): each output tensor is read
from its own source tensors when it is written, so peak memory stays one output tensor.

A training checkpoint's other components (optimizer, scheduler, data loader, train state) are
no part of either naming's model: without `--select`, the model component is selected and the
rest reported as skipped. An import is model weights only: a fresh DCP save torchtitan loads
as `step-0` (or its `initial_load_path`, model only), with no optimizer state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...architectures import (
    HF,
    NAMING_FORMATS,
    NAMINGS,
    architectures,
    get_architecture,
    recognise,
)
from ...architectures.base import (
    Architecture,
    ArchitecturePlan,
    MappedTensor,
    ModelArgs,
    NamingOutput,
    compile_pattern,
)
from ...architectures.gguf import GGUF
from ...budgets import MAX_CONFIG_BYTES
from ...errors import FormatError
from ...models import Chunk, Record
from .transfer import SkippedEntry, TransferPlan, plan_transfer

if TYPE_CHECKING:
    from ...formats.base import Checkpoint
    from ...quant.schemes import QuantAnalysis
    from ...sources.layouts.base import OpenedSource
    from ...storage import Storage


class MappedRecord(Record):
    """One output tensor of a naming change, for reports and `--dry-run`.

    Attributes:
        name: the output name.
        sources: the source tensors it is built from.
        transform: `rename`, `rotary-permute`, `unstack-experts`, `stack-experts`...
    """

    name: str
    sources: list[str]
    transform: str


class ArchitectureReport(Record):
    """What a naming change did: the family, the namings, the args, every mapped tensor.

    Attributes:
        architecture: the family token (`llama3`, `qwen3`, `qwen3-moe`).
        source_naming / target_naming: `torchtitan`, `hf`...
        args: the model args the mapping used (from shapes and config.json).
        mapped: every output tensor and how it was built.
        transforms: how many outputs each transform built.
    """

    architecture: str
    source_naming: str
    target_naming: str
    args: dict[str, Any]
    mapped: list[MappedRecord]
    transforms: dict[str, int]


@dataclass
class MappedSource:
    """The result of `map_plan`: the checkpoint and plan the writers take, and the report."""

    checkpoint: Checkpoint
    plan: TransferPlan
    report: ArchitectureReport
    config: bytes | None
    #: what the target naming holds beside the tensors (Megatron's common.pt, its objects)
    output: NamingOutput = field(default_factory=NamingOutput)
    #: output name -> the source names it was read from (for the written entries' `source`)
    origins: dict[str, str] = field(default_factory=dict)
    #: what the user should know about the mapping (a config.json of a family ckpt does not
    #: know, whose tensors are named as a known one's)
    warnings: list[str] = field(default_factory=list)
    #: `config` describes fewer modules than the config given (`Architecture.fit_config`:
    #: Qwen3.5's language model exported without its vision encoder), so it is the one written
    config_narrowed: bool = False


def naming_format(to: str) -> tuple[str, str | None]:
    """(format token, naming) of a `--to` token: `hf` -> (`safetensors`, `hf`)."""
    if to in NAMING_FORMATS:
        return NAMING_FORMATS[to], to
    return to, None


def default_select(opened: OpenedSource, select: str | None) -> str | None:
    """`--select model` for a training checkpoint whose layout knows a model component: a
    framework naming holds model weights only."""
    if select is not None or opened.training is None:
        return select
    training = opened.training
    prefix = training.prefixes.get("model")
    # a model at the top level is a component `--select` can take only in torchtitan's
    # layout; elsewhere (Megatron-Core's `decoder.`, `embedding.`) the naming reads the whole
    # checkpoint, as it names the model's own keys and reads its args beside them
    if prefix is None or (prefix == "" and training.layout != "torchtitan"):
        return None
    return "model"


def refuse_adapter(opened: OpenedSource, target: str, where: str) -> None:
    """A PEFT adapter's tensors (`lora_A` / `lora_B` beside the names of the modules they
    adapt) are an update to a base model's weights, not a model: no naming maps them, and the
    way to a model in another naming is merging it first.

    Raises:
        FormatError: when `opened` is a PEFT adapter folder.
    """
    layout = opened.layout
    if layout is None or layout.layout != "peft":
        return
    details = layout.details or {}
    # the adapter types `ckpt merge` merges (DoRA is a LoRA that says `use_dora`)
    mergeable = str(details.get("peft_type", "")).upper() in ("LORA", "IA3", "LOHA", "LOKR")
    merge = (
        f"`ckpt merge BASE {where} MERGED`"
        if mergeable
        else "peft's `merge_and_unload()` and `save_pretrained`"
    )
    raise FormatError(
        f"is a {layout.description}: its tensors are an update to the base model's weights, "
        f"not a model, so they cannot be mapped to the {target} naming",
        path=where,
        fix=f"Merge it into its base model first ({merge}), then convert the merged model "
        f"with --to {target}; or convert the adapter as it is with --to safetensors / torch.",
    )


def refuse_part(opened: OpenedSource, target: str, where: str) -> None:
    """One part of a larger checkpoint (`OpenedSource.part_of`: a legacy Megatron-LM rank
    folder, one rank's slices of the weights) is no model: mapped to a naming it would be
    written as one, half-width or missing layers, and loaded without a word.

    Raises:
        FormatError: when `opened` is such a part.
    """
    if opened.part_of is None:
        return
    raise FormatError(
        f"{opened.part_of}, so it cannot be mapped to the {target} naming (the output would "
        "be that rank's slices written as the model)",
        path=where,
        fix="Join the ranks first: convert the save to Megatron-LM's torch_dist format "
        "(Megatron-LM's `--ckpt-convert-format torch_dist --ckpt-convert-save DIR`, or its "
        f"tools/checkpoint/convert.py), then run `ckpt convert DIR --to {target}`; or copy "
        "this rank as it is with --to safetensors / torch.",
    )


def source_config(storage: Storage) -> dict[str, Any] | None:
    """The source folder's own `config.json` as a dict, when it has a readable one."""
    try:
        if not storage.exists("config.json") or storage.size("config.json") > MAX_CONFIG_BYTES:
            return None
        doc = json.loads(storage.read_all("config.json"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _args(
    arch: type[Architecture],
    shapes: dict[str, list[int]],
    naming: str,
    config: dict[str, Any] | None,
    dtype: str | None,
    where: str,
    checkpoint: Checkpoint,
) -> ModelArgs:
    """The args from the shapes and what the source keeps beside them (Megatron's `args`),
    completed by `config` (which must agree with both)."""
    shaped = arch.args_from_shapes(shapes, naming)
    own = arch.args_from_source(checkpoint, naming)
    head = arch.tied[HF][1] if HF in arch.tied else "lm_head.weight"
    if shaped.tie_embeddings is True and own.tie_embeddings is False:
        # the shapes say tied only because no output projection is there: the save's own
        # args know it was trained untied, so the one it lacks was left out (a filter)
        record = (
            "the file holds its own output.weight, which llama.cpp leaves out of a tied model"
            if naming == GGUF
            else "Megatron-LM's untie_embeddings_and_output_weights"
        )
        raise FormatError(
            f"the save's own args say its output projection is trained apart from the "
            f"embedding ({record}), but the weights "
            f"hold no output projection (transformers' {head!r}): the output would tie it "
            "to the embedding, another model",
            path=where,
            fix="Convert the whole model: no --filter / --filter-out that leaves the output "
            "projection out.",
        )
    found = shaped.merged(own)
    if config is None:
        return found.model_copy(update={"dtype": dtype})
    conflicts = arch.config_conflicts(config)
    if conflicts:
        raise FormatError(
            f"config.json says {', '.join(conflicts)}, but the weights hold no such "
            f"tensors (the {arch.title} rules map none): a model built from it gets weights "
            "no tensor fills, initialised at random",
            path=where,
            fix="Pass the config.json of this model with --config; a model trained with "
            "them is no model ckpt maps (convert it with --to safetensors / dcp to keep its "
            "names).",
        )
    given = arch.config_args(config, where)
    agree_args(arch, shapes, naming, found, given, where, "config.json")
    return found.merged(given).model_copy(update={"dtype": dtype})


def agree_args(
    arch: type[Architecture],
    shapes: dict[str, list[int]],
    naming: str,
    found: ModelArgs,
    given: ModelArgs,
    where: str,
    what: str,
) -> None:
    """Refuse args (`config.json`, a flavor) that contradict what the weights tell: the
    values the shapes give, and the rows the head counts and widths imply (a Llama's head
    count is in no shape alone, and a config.json that does not fit its tensors is one
    `from_pretrained` refuses, or builds another model from)."""
    for key in ("dim", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "num_experts"):
        a, b = getattr(found, key), getattr(given, key)
        if a is not None and b is not None and a != b:
            raise FormatError(
                f"{what} gives {key}={b}, but the weights have {key}={a}",
                path=where,
                fix="Pass the config.json (--config) or the flavor (--flavor) of this model.",
            )
    head = arch.tied[HF][1] if HF in arch.tied else None
    if head and found.tie_embeddings is True and given.tie_embeddings is False:
        # no output projection in the weights: the model transformers builds from an untied
        # config would initialise its lm_head at random (from_pretrained: "MISSING")
        says = (
            "leaves tie_word_embeddings out (transformers' default: false)"
            if given.config is not None and "tie_word_embeddings" not in given.config
            else "says tie_word_embeddings: false"
        )
        raise FormatError(
            f"{what} {says}, but the weights hold no output "
            f"projection (transformers' {head!r}): the model built from it would get a "
            "random one",
            path=where,
            fix="Pass the config.json (--config) or the flavor (--flavor) of this model "
            "(tie_word_embeddings: true), or keep its output projection (no --filter-out "
            "for it).",
        )
    conflicts = arch.shape_conflicts(shapes, naming, given)
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise FormatError(
            f"{what} does not fit the weights: {conflicts[0]}{more}",
            path=where,
            fix="Pass the config.json (--config) or the flavor (--flavor) of this model: its "
            "head counts, head_dim and intermediate sizes must match the tensors.",
        )


#: families ckpt maps none of whose tensors are named as one it maps, though their model is
#: not that one: what each computes otherwise
_NOT_IN_ALL_BUT_NAME = {
    "gemma": "its RMSNorm scales by (1 + weight), not by weight, and it multiplies the "
    "embeddings by the square root of hidden_size",
}


def _same_family(arch: type[Architecture], config: dict[str, Any], where: str) -> list[str]:
    """Refuse a `config.json` of another known family: transformers builds the model its
    `model_type` names, and these weights are not that model's (a Qwen3 config over Llama
    weights builds a Qwen3 whose q/k norms no tensor fills). A family ckpt does not know
    whose tensors are named as this one's (a Mistral's are a Llama's) is mapped, with a
    warning: its names and shapes are this family's, its attention may not be; unless ckpt
    knows its model is not this family's (a Gemma's norms, another MLP activation): mapped,
    it would be a model that computes something else, so it is refused."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type in arch.hf_model_types:
        return []
    other = next((a for a in architectures() if model_type in a.hf_model_types), None)
    activation = config.get("hidden_act")
    differs = _NOT_IN_ALL_BUT_NAME.get(model_type)
    other_activation = isinstance(activation, str) and activation not in arch.activations
    if differs is None and arch.activations and other_activation:
        differs = f"its MLP activation is {activation!r}, not {arch.activations[0]!r}"
    if other is None and differs is not None:
        raise FormatError(
            f"config.json names model_type {model_type!r}, a family ckpt does not map; its "
            f"tensors are named as {arch.title}'s, but it is no {arch.title}: {differs}, so "
            f"mapped by {arch.title}'s rules it would compute something else",
            path=where,
            fix="Convert it with --to safetensors or --to dcp, which keep its tensors and their "
            f"names; ckpt maps no {model_type} model to another framework's names.",
        )
    if other is None:
        return [
            f"{where}: config.json names model_type {model_type!r}, a family ckpt does not "
            f"map; its tensors are named as {arch.title}'s and were mapped by {arch.title}'s "
            f"rules, which keeps its outputs only if it is a {arch.title} in all but name (no "
            "sliding-window attention, no other norms, rotary or scaling)"
        ]
    raise FormatError(
        f"config.json is a {other.title} model's (model_type {model_type!r}), but the weights "
        f"are a {arch.title} model's: transformers would build a {other.title} model from it "
        "that these tensors do not fill",
        path=where,
        fix=f"Pass the config.json of this {arch.title} model (model_type "
        f"{' / '.join(arch.hf_model_types) or arch.name}) with --config, or its torchtitan "
        "flavor with --flavor.",
    )


def _check_tied(checkpoint: Checkpoint, pairs: list[tuple[str, str]], where: str) -> None:
    """An export leaves an output projection out as the embedding's twin only when it is
    one: torchtitan saves both names of a tied model, but a config.json or flavor claiming
    `tie_word_embeddings` for an untied model would drop a trained `lm_head` unseen."""
    for head, embedding in pairs:
        if not _twins(checkpoint, head, embedding):
            raise FormatError(
                f"the config says the embeddings are tied (tie_word_embeddings), but {head!r} "
                f"differs from {embedding!r}: leaving it out would change the model's outputs",
                path=where,
                fix="Pass the config.json of this model (tie_word_embeddings: false) with "
                "--config, or the torchtitan flavor it was trained as with --flavor.",
            )


def dropped_state_warnings(
    checkpoint: Checkpoint, names: list[str], arch: type[Architecture], target: str, where: str
) -> list[str]:
    """What a mapping that leaves out tensors the model computes with (`names`: its plan's
    `computing`, torchtitan's MoE load-balancing biases) changes: nothing while they hold
    zeros (a fresh start); a trained, non-zero bias routes tokens to other experts than the
    target naming's model does, so its outputs differ. torchtitan's own `to_hf` drops it too
    (transformers' router has no bias), so this is said, not refused. Each is one small
    vector (one float per expert), read whole."""
    nonzero: list[tuple[str, float]] = []
    for name in names:
        tensor = checkpoint.read_tensor(name)
        if tensor.numel() and bool(tensor.ne(0).any()):
            nonzero.append((name, float(tensor.abs().max())))
    if not nonzero:
        return []
    shown = ", ".join(n for n, _ in nonzero[:3]) + (", …" if len(nonzero) > 3 else "")
    largest = max(v for _, v in nonzero)
    return [
        f"{where}: {len(nonzero)} trained MoE load-balancing bias(es) are non-zero ({shown}; "
        f"largest |value| {largest:.3g}) and the {target} naming of {arch.title} has no "
        f"counterpart: a model in {target} names routes some tokens to other experts than "
        "this one does, so its outputs differ (torchtitan's own to_hf drops the bias too)"
    ]


def _twins(checkpoint: Checkpoint, a: str, b: str) -> bool:
    """Whether tensors `a` and `b` hold the same values: compared block by block where both
    are stored raw in one dtype (an embedding of a large vocabulary is the largest tensor of
    a model; two of them whole would double the export's peak), else read whole."""
    entries = checkpoint.manifest.by_name
    if entries[a].shape != entries[b].shape:
        return False
    if (
        entries[a].dtype == entries[b].dtype
        and checkpoint.serves_raw(a)
        and checkpoint.serves_raw(b)
    ):
        return _same_stream(checkpoint.iter_raw(a), checkpoint.iter_raw(b))
    import torch

    x, y = checkpoint.read_tensor(a), checkpoint.read_tensor(b)
    return bool(torch.equal(x, y.to(x.dtype)))


def _same_stream(a: Iterator[bytes], b: Iterator[bytes]) -> bool:
    """Whether two streams of blocks (cut anywhere, each valid until the next) hold the same
    bytes."""
    left, right = bytearray(), bytearray()
    while True:
        if not left:
            left += _next_block(a)
        if not right:
            right += _next_block(b)
        if not left or not right:
            return not left and not right  # both ended together, or one ended early
        n = min(len(left), len(right))
        if left[:n] != right[:n]:
            return False
        del left[:n], right[:n]


def _next_block(blocks: Iterator[bytes]) -> bytes:
    """The next non-empty block, or b"" at the end."""
    for block in blocks:
        if len(block):
            return block
    return b""


def map_plan(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    target: str,
    *,
    config: dict[str, Any] | None,
    cast: str | None,
    keep_objects: bool,
    dedupe_tied: bool,
    architecture: str | None = None,
    flavor: str | None = None,
) -> MappedSource:
    """Map `plan`'s tensors from their naming to naming `target` (see the module docstring).

    Args:
        checkpoint: the source checkpoint the plan reads.
        plan: the transfer plan as selection and filters made it.
        target: the naming token (`hf`, `torchtitan`).
        config: a Hugging Face `config.json` (`--config`, or the source's), for what the
            shapes do not tell (head counts, rotary base, norm epsilon).
        cast: the `--dtype` cast of floating tensors.
        keep_objects / dedupe_tied: the target format's facts, as `plan_transfer` takes them.
        architecture: the family token, when the caller names it (else recognised).
        flavor: a torchtitan flavor of the family (`--flavor`), for what the shapes and
            `config` do not tell.

    Raises:
        FormatError: no family claims the names (exit 4, naming the closest family's unknown
            tensors), a tensor no rule maps, or an arg the mapping needs is unknown.
    """
    from ...architectures import unrecognised
    from ...architectures.gguf import unmapped
    from ...architectures.mapped import MappedCheckpoint

    with _naming(checkpoint.manifest.location):
        where = checkpoint.manifest.location
        # a GGUF names its architecture: one no family maps is refused by that name
        gguf_refusal = unmapped(checkpoint, target)
        if gguf_refusal is not None:
            raise gguf_refusal
        tensors = [i for i in plan.items if i.source.kind == "tensor"]
        skipped = list(plan.skipped)
        for item in plan.items:
            if item.source.kind != "tensor":
                skipped.append(
                    SkippedEntry(
                        name=item.source.name,
                        kind=item.source.kind,
                        reason=_not_a_weight(target),
                    )
                )
        # the names as selection and renames made them, and what each is read from
        origin = {i.target.name: i.source.name for i in tensors}
        names = [i.target.name for i in tensors]
        model_type = config.get("model_type") if config else None
        if architecture is not None:
            arch = get_architecture(architecture)
            naming = arch.recognise(names)
            if naming is None:
                raise unrecognised(names, target, where)
        else:
            found = recognise(names, model_type if isinstance(model_type, str) else None)
            if found is None:
                raise unrecognised(names, target, where)
            arch, naming = found.architecture, found.naming
        if target not in arch.namings():
            # (a naming ckpt only reads, llama.cpp's, is no --to)
            others = [f"--to {n}" for n in arch.namings() if n != naming and n in NAMINGS]
            raise FormatError(
                f"{arch.title} has no {target} naming: ckpt knows it in "
                f"{', '.join(arch.namings())} names",
                path=where,
                fix=f"Convert it {' / '.join(others)}{', or ' if others else ''}--to "
                "safetensors / dcp to keep the names as they are.",
            )
        if HF not in (naming, target) and naming != target:
            # two native namings (Megatron to torchtitan): through Hugging Face's, the pivot
            # every family maps to and from, as `diff` reads them
            return _through_hf(
                checkpoint,
                plan,
                target,
                arch,
                config=config,
                cast=cast,
                keep_objects=keep_objects,
                dedupe_tied=dedupe_tied,
                flavor=flavor,
            )
        shapes = {i.target.name: list(i.source.shape) for i in tensors}
        dtypes = [i.source.dtype for i in tensors if i.source.dtype]
        # the dtype written: config.json's torch_dtype says what the weights are after --dtype
        dtype = cast or (max(set(dtypes), key=dtypes.count) if dtypes else None)
        warnings = _same_family(arch, config, where) if config is not None else []
        args = _args(arch, shapes, naming, config, dtype, where, checkpoint)
        if flavor is not None:
            from ...architectures.flavors import flavor_args

            known = flavor_args(arch, flavor)
            agree_args(arch, shapes, naming, args, known, where, f"--flavor {flavor}")
            args = args.merged(known)
        if naming == HF:
            arch.check_layers(names)
        refuse_filtered_parameters(checkpoint, plan, target)
        mapping = arch.plan(
            [(i.target.name, list(i.source.shape), i.source.dtype or "") for i in tensors],
            naming,
            target,
            args,
        )
        if target == HF != naming:  # the whole model in HF names: no layer short of a tensor
            arch.check_layers([t.name for t in mapping.tensors])
        _check_tied(checkpoint, [(origin[h], origin[e]) for h, e in mapping.tied], where)
        warnings += dropped_state_warnings(
            checkpoint, [origin[n] for n in mapping.computing], arch, target, where
        )
        skipped += [
            SkippedEntry(name=origin[n], kind="tensor", reason=why) for n, why in mapping.left_out
        ]
        # read every piece from the source checkpoint under its own name
        sourced = ArchitecturePlan(
            mapping.architecture,
            mapping.source,
            mapping.target,
            [
                replace(t, pieces=tuple(replace(p, source=origin[p.source]) for p in t.pieces))
                for t in mapping.tensors
            ],
            mapping.left_out,
            args,
        )
        output = arch.naming_output(target, args)
        mapped = MappedCheckpoint(checkpoint, sourced, output.objects)
        # the routing state the model keeps in float32 stays as stored under --dtype
        kept = [compile_pattern(p) for p in arch.float32.get(target, ())]
        new_plan = plan_transfer(
            mapped.manifest,
            dtype=cast,
            keep_objects=keep_objects,
            dedupe_tied=dedupe_tied,
            uncast={t.name for t in sourced.tensors if any(k.match(t.name) for k in kept)},
        )
        new_plan.skipped = skipped + new_plan.skipped
        for item in new_plan.items:
            pieces = output.split_dim0.get(item.target.name)
            if pieces:
                item.target = item.target.model_copy(
                    update={"chunks": dim0_chunks(item.target.shape, pieces)}
                )
        new_plan.tied = plan.tied
        config_bytes = None
        narrowed = False
        if target == HF:
            built = arch.hf_config(args)
            written = arch.fit_config(built, [t.name for t in sourced.tensors])
            narrowed = written is not built
            config_bytes = (json.dumps(written, indent=2) + "\n").encode()
        records = [_record(t) for t in sourced.tensors]
        counts: dict[str, int] = {}
        for r in records:
            counts[r.transform] = counts.get(r.transform, 0) + 1
        report = ArchitectureReport(
            architecture=arch.name,
            source_naming=naming,
            target_naming=target,
            args=args.model_dump(exclude_none=True, exclude={"config"}),
            mapped=records,
            transforms=counts,
        )
        origins = {r.name: ",".join(r.sources) or f"({r.transform})" for r in records}
        return MappedSource(
            mapped, new_plan, report, config_bytes, output, origins, warnings, narrowed
        )


def _not_a_weight(naming: str) -> str:
    """Why a non-tensor entry is left out of an output in `naming`."""
    return f"not a model weight (the {naming} naming holds weights only)"


def _through_hf(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    target: str,
    arch: type[Architecture],
    *,
    config: dict[str, Any] | None,
    cast: str | None,
    keep_objects: bool,
    dedupe_tied: bool,
    flavor: str | None,
) -> MappedSource:
    """`map_plan` from one native naming to another: to Hugging Face's first, then from it
    with the `config.json` that step built (what the first naming told of the model, a
    Megatron save's own args), as one mapping: the report names the source's tensors and
    every transform of both steps, and says what each left out."""
    to_hf = map_plan(
        checkpoint,
        plan,
        HF,
        config=config,
        cast=None,
        keep_objects=keep_objects,
        dedupe_tied=dedupe_tied,
        architecture=arch.name,
        flavor=flavor,
    )
    assert to_hf.config is not None  # an export to hf always builds its config.json
    built = json.loads(to_hf.config)
    out = map_plan(
        to_hf.checkpoint,
        to_hf.plan,
        target,
        config=built,
        cast=cast,
        keep_objects=keep_objects,
        dedupe_tied=dedupe_tied,
        architecture=arch.name,
    )
    first = {r.name: r for r in to_hf.report.mapped}
    records: list[MappedRecord] = []
    for r in out.report.mapped:
        before = [first[h] for h in r.sources if h in first]
        # what built it, step by step: `split-qkv+rotary-permute`; renames say nothing more
        steps = [t for t in dict.fromkeys([*(b.transform for b in before), r.transform])]
        transform = "+".join(t for t in steps if t != "rename") or "rename"
        sources = [s for b in before for s in b.sources] if before else r.sources
        records.append(
            MappedRecord(name=r.name, sources=list(dict.fromkeys(sources)), transform=transform)
        )
    counts: dict[str, int] = {}
    for record in records:
        counts[record.transform] = counts.get(record.transform, 0) + 1
    report = out.report.model_copy(
        update={
            "source_naming": to_hf.report.source_naming,
            "mapped": records,
            "transforms": counts,
        }
    )
    origins = {r.name: ",".join(r.sources) or f"({r.transform})" for r in records}
    # the source's non-tensor entries were left out by the first step, for the output's naming
    out.plan.skipped = [
        s.model_copy(update={"reason": _not_a_weight(target)})
        if s.reason == _not_a_weight(HF)
        else s
        for s in out.plan.skipped
    ]
    return replace(
        out,
        report=report,
        origins=origins,
        # the model's config.json, for a later --to hf of the output (a torchtitan save
        # holds none), as an import from hf carries the source's
        config=out.config if out.config is not None else to_hf.config,
        warnings=to_hf.warnings + out.warnings,
    )


def refuse_quantized_naming(analysis: QuantAnalysis, target: str, where: str) -> None:
    """Refuse to map quantized weights (FP8 with their `weight_scale_inv`, NVFP4, MXFP4...) to
    a naming without `--dequantize`: no family's rules carry the scales, so the weights were
    refused as unknown tensors, or, with `--filter-out` on the scales, written as plain
    weights of the stored codes (another model).

    Raises:
        FormatError: naming the scheme and `--dequantize`.
    """
    schemes = sorted({w.scheme for w in analysis.weights.values()})
    schemes += sorted(set(analysis.packed_scheme.values()) - set(schemes))
    if not schemes:
        return
    fix = (
        f"Pass --dequantize: --to {target} then writes the weights in full precision, which "
        "the naming holds."
        if analysis.quantized
        else "Dequantize it with the library that quantized it, then convert the result; or "
        "convert it with --to safetensors / dcp to keep its names."
    )
    raise FormatError(
        f"holds quantized weights ({', '.join(schemes)}) with their scales, which no {target} "
        "naming rule carries: mapped without them, the stored codes would be another model",
        path=where,
        fix=fix,
    )


def refuse_block_quantized_naming(checkpoint: Checkpoint, target: str) -> None:
    """Refuse to map a format's own block-quantized tensors (a GGUF's Q4_K, Q8_0...) without
    `--dequantize`: they are no tensors a rule maps, so the mapping saw a model without its
    weights and called it no known architecture.

    Raises:
        FormatError: naming the block types and `--dequantize`.
    """
    blocks = checkpoint.block_quantized()
    if not blocks:
        return
    entries = checkpoint.manifest.by_name
    kinds: dict[str, int] = {}
    for name in blocks:
        kind = entries[name].dtype or "?"
        kinds[kind] = kinds.get(kind, 0) + 1
    shown = ", ".join(f"{kind} ×{count}" for kind, count in sorted(kinds.items()))
    raise FormatError(
        f"holds {len(blocks)} quantized tensor(s) in {checkpoint.manifest.format} blocks "
        f"({shown}), which the {target} naming holds only dequantized",
        path=checkpoint.manifest.location,
        fix=f"Pass --dequantize: --to {target} then writes them in full precision (bfloat16, "
        "or --dtype fp32 for the decoded values exactly).",
    )


def refuse_filtered_parameters(checkpoint: Checkpoint, plan: TransferPlan, target: str) -> None:
    """Refuse a plan that leaves out tensors of the modules it maps: a `q_proj.bias` beside a
    `q_proj.weight` the plan carries is part of that projection, so the model computes with
    it (a Qwen2's q/k/v biases, a Llama trained with `attention_bias`). No family's rules map
    such a tensor, and `--filter-out '*.bias'` got such a model past the refusal of its unknown
    tensors into an output that runs without them (transformers initialises them at random).

    Raises:
        FormatError: naming the tensors left out and the modules they belong to.
    """
    carried = {i.source.name for i in plan.items if i.source.kind == "tensor"}
    modules = {name[: -len(".weight")] for name in carried if name.endswith(".weight")}
    left = [
        e.name
        for e in checkpoint.manifest.entries
        if e.kind == "tensor" and e.name not in carried and e.name.rpartition(".")[0] in modules
    ]
    if not left:
        return
    shown = ", ".join(repr(n) for n in left[:3])
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    raise FormatError(
        f"--filter/--filter-out leave out {len(left)} tensor(s) of modules whose weights are "
        f"mapped: {shown}{more}; the model computes with them, so a {target} model without "
        "them is another model (transformers initialises a missing one at random), and no "
        "family ckpt maps holds them",
        path=checkpoint.manifest.location,
        fix="Leave them in (no --filter/--filter-out for them): a model with them is no model "
        f"ckpt maps to the {target} naming; convert it with --to safetensors / dcp to keep "
        "its names.",
    )


@contextmanager
def _naming(where: str) -> Iterator[None]:
    """Name the checkpoint in a `FormatError` that does not name one yet.

    What a rule or the args found lacking (`ModelArgs.require`, a tensor no rule maps) is
    about this checkpoint: name it, as every error does.
    """
    try:
        yield
    except FormatError as error:
        if error.path is not None or type(error) is not FormatError:
            raise
        raise FormatError(error.problem, path=where, fix=error.fix) from error


def dim0_chunks(shape: list[int], pieces: int) -> list[Chunk]:
    """`pieces` equal chunks of a tensor along dim 0, all in the first rank's DCP file."""
    from ...formats.dcp.layout import rank_file

    step = shape[0] // pieces
    return [
        Chunk(
            offsets=[i * step, *([0] * (len(shape) - 1))],
            sizes=[step, *shape[1:]],
            file=rank_file(0),
            byte_offset=0,
            byte_length=0,
        )
        for i in range(pieces)
    ]


def _record(tensor: MappedTensor) -> MappedRecord:
    return MappedRecord(name=tensor.name, sources=tensor.sources, transform=tensor.transform)
