"""`diff` across framework namings: a torchtitan or Megatron-Core save against its own
`convert --to hf` export, or any two namings of one model family ckpt maps.

Two sides whose tensors are one family's (`architectures.recognise`) in two namings share no
name, so compared as they are every tensor is "only in A" or "only in B". `line_up_namings`
reads the side not in the naming compared in (Hugging Face's, unless `--naming` names another)
through the family's rules, as a `MappedCheckpoint`: the very transforms `convert --to hf`
writes (renames, the rotary q/k permutation, experts unstacked, Megatron's fused QKV and
gate/up split), so each pair compared is an export's tensor against the one it must equal, bit
for bit. Two native namings (torchtitan against Megatron) are both read in Hugging Face's.

What one naming holds and the other has no counterpart of (rotary tables, a save's optimizer
state, MoE load-balancing counters, non-tensor entries) is not compared, and each such name is
listed with why (`NamingMap.left_out_a` / `left_out_b`): nothing leaves the comparison unsaid.

The mapping needs what `convert` needs beside the shapes (a Llama's head counts for the rotary
permutation): a Megatron save's own args, the `config.json` either side holds, `--config`,
`--flavor`. Reading a mapped tensor reads only its own pieces: memory stays one pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...architectures import HF, NAMINGS, Recognised, recognise, unrecognised
from ...architectures.base import Architecture, ArchitecturePlan, ModelArgs, compile_pattern
from ...errors import FormatError, UsageError
from ...formats.base import Checkpoint
from ...models import Entry, Record
from ...sources.layouts import OpenedSource
from ..shared.architecture import agree_args, dropped_state_warnings, source_config
from ..shared.selection import select_entries

#: `--naming` values beside the naming tokens: map when needed, or never
AUTO, OFF = "auto", "off"
NAMING_CHOICES = (AUTO, OFF, *NAMINGS)


class LeftOut(Record):
    """An entry of one side not compared because the other naming has no counterpart of it.

    Attributes:
        name: the side's lined-up name (after --select / --rename).
        reason: why (`rotary table (rebuilt)`, `optimizer state (training only)`...).
    """

    name: str
    reason: str


class NamingMap(Record):
    """How `diff` lined up two sides whose names are two namings of one model family.

    Attributes:
        architecture / title: the family (`llama3`, `Llama 3`).
        naming_a / naming_b: the naming each side's tensors are in (`torchtitan`, `hf`...).
        compared_in: the naming both were compared in (the names the report shows).
        transforms_a / transforms_b: for a side read through the mapping, how many of the
            tensors compared each transform built (`rename`, `rotary-permute`,
            `unstack-experts`, `split-qkv`...); empty for a side compared as it is.
        left_out_a / left_out_b: that side's entries not compared, with why.
    """

    architecture: str
    title: str
    naming_a: str
    naming_b: str
    compared_in: str
    transforms_a: dict[str, int]
    transforms_b: dict[str, int]
    left_out_a: list[LeftOut]
    left_out_b: list[LeftOut]


@dataclass
class NamedSide:
    """One side as `diff` lined it up, and what it becomes read in another naming.

    Attributes:
        checkpoint: the checkpoint its entries are read from.
        aligned: lined-up name -> entry (after --select and --rename).
        whole: every entry under its own name (renamed), when --select stripped a prefix of a
            side that holds no such component: an HF model's own names start with `model.`,
            and its `lm_head.weight` is under none.
        where: the location, for messages.
        chosen: (entry, lined-up name) pairs, as `_resolve_aliases` takes them.
        select_applied: whether --select's prefix was stripped on this side.
        warnings: what reading it in another naming changes that the comparison cannot
            show (a trained MoE load-balancing bias that naming has no counterpart of).
    """

    checkpoint: Checkpoint
    aligned: dict[str, Entry]
    whole: dict[str, Entry] | None
    where: str
    chosen: list[tuple[Entry, str]]
    select_applied: bool
    warnings: list[str] = field(default_factory=list)


def line_up_namings(
    a: NamedSide,
    b: NamedSide,
    naming: str,
    config: dict[str, Any] | None,
    flavor: str | None,
) -> tuple[NamingMap, NamedSide, NamedSide] | None:
    """Both sides read in one naming, when they are one family's in two (see the module
    docstring); None when there is nothing to map (`--naming off`, the same naming on both
    sides, names of no family ckpt maps, two families).

    Args:
        a / b: the two sides as lined up so far.
        naming: `auto` (map to Hugging Face's naming when the namings differ), `off`, or the
            naming token to compare in.
        config: a Hugging Face `config.json` (`--config`), else either side's own is read.
        flavor: a torchtitan flavor (`--flavor`), for what the weights and config do not tell.

    Raises:
        FormatError: a forced naming for a side whose names are no known family's, or two
            sides of different families; a mapping that needs an arg nothing gives (exit 4).
    """
    if naming == OFF:
        return None
    configs = [config or source_config(side.checkpoint.storage) for side in (a, b)]
    found = []
    for side, side_config in zip((a, b), configs, strict=True):
        model_type = side_config.get("model_type") if side_config else None
        found.append(_recognised(side, model_type if isinstance(model_type, str) else None))
    (aligned_a, rec_a), (aligned_b, rec_b) = found
    if naming == AUTO:
        if rec_a is None or rec_b is None or rec_a.architecture is not rec_b.architecture:
            return None
        if rec_a.naming == rec_b.naming:
            return None
        target = HF
    else:
        for side, rec, aligned in ((a, rec_a, aligned_a), (b, rec_b, aligned_b)):
            if rec is None:
                tensors = [n for n, e in aligned.items() if e.kind == "tensor"]
                found_none = unrecognised(tensors, naming, side.where)
                raise FormatError(
                    found_none.problem,
                    path=side.where,
                    fix="Pass --select to compare a training save's model, or --naming off to "
                    "compare the names as they are.",
                )
        assert rec_a is not None and rec_b is not None
        if rec_a.architecture is not rec_b.architecture:
            raise FormatError(
                f"A is a {rec_a.architecture.title} model ({rec_a.naming} names) and B a "
                f"{rec_b.architecture.title} model ({rec_b.naming} names): --naming {naming} "
                "maps the namings of one family",
                path=b.where,
                fix="Compare two checkpoints of one model, or leave --naming out.",
            )
        target = naming
    arch = rec_a.architecture
    if target not in arch.namings():
        raise UsageError(
            f"--naming {target}: {arch.title} has no {target} naming",
            fix=f"Its namings: {', '.join(arch.namings())}.",
        )
    sides = ((a, aligned_a, rec_a.naming), (b, aligned_b, rec_b.naming))
    # the config the mapping reads, and where it is: --config, else the first side holding one
    config_where = "--config" if config else a.where if configs[0] else b.where
    args = _args(arch, sides, next((c for c in configs if c), None), config_where, flavor)
    out: list[NamedSide] = []
    transforms: list[dict[str, int]] = []
    left_out: list[list[LeftOut]] = []
    for side, aligned, side_naming in sides:
        try:
            checkpoint, mapped, counts, left, computing = _read_in(
                side.checkpoint, aligned, arch, side_naming, target, args
            )
        except FormatError as error:
            # what the mapping found lacking (an arg no side tells) is about this side
            if error.path is not None or type(error) is not FormatError:
                raise
            raise FormatError(error.problem, path=side.where, fix=error.fix) from error
        whole_used = aligned is not side.aligned
        out.append(
            replace(
                side,
                checkpoint=checkpoint,
                aligned=mapped,
                whole=None,
                # a side read in another naming, or whole, is lined up under these names as
                # they are (no --select prefix of them left to strip)
                chosen=[(e, n) for n, e in mapped.items()] if counts or whole_used else side.chosen,
                select_applied=side.select_applied and not whole_used,
                warnings=_dropped_state(side, computing, arch, target),
            )
        )
        transforms.append(counts)
        left_out.append(left)
    # a fresh-start state the mapping built (torchtitan's MoE load-balancing bias) is
    # compared only with the other side's own: a torchtitan model trained without load
    # balancing holds none, and its absence is no difference
    filled = [compile_pattern(f.pattern) for f in arch.filled.get(target, ())]
    for index, side in enumerate(out):
        other = out[1 - index].aligned
        lone = (
            {n for n in side.aligned if n not in other and any(r.match(n) for r in filled)}
            if transforms[index]
            else set()
        )
        if lone:
            side.aligned = {n: e for n, e in side.aligned.items() if n not in lone}
            side.chosen = [(e, n) for e, n in side.chosen if n not in lone]
            transforms[index]["zeros"] -= len(lone)
            if not transforms[index]["zeros"]:
                del transforms[index]["zeros"]
    report = NamingMap(
        architecture=arch.name,
        title=arch.title,
        naming_a=rec_a.naming,
        naming_b=rec_b.naming,
        compared_in=target,
        transforms_a=transforms[0],
        transforms_b=transforms[1],
        left_out_a=left_out[0],
        left_out_b=left_out[1],
    )
    return report, out[0], out[1]


def select_hint(sides: tuple[tuple[OpenedSource, Checkpoint], ...]) -> str | None:
    """What to say when names were compared as they are and `--select model` would have
    lined the sides up through a naming mapping: a torchtitan save (model, optimizer, data
    loader...) against its `--to hf` export is one-sided whole, as names and as families."""
    found: list[Recognised] = []
    component = False
    for opened, checkpoint in sides:
        entries = checkpoint.manifest.entries
        names = [e.name for e in entries if e.kind == "tensor"]
        if opened.training is not None and "model" in opened.training.prefixes:
            selection = select_entries(opened, entries, "model", checkpoint.manifest)
            if selection.component is not None:
                names = [n for e, n in selection.pairs if e.kind == "tensor"]
                component = True
        rec = recognise(names) if names else None
        if rec is None:
            return None
        found.append(rec)
    a, b = found
    if not component or a.architecture is not b.architecture or a.naming == b.naming:
        return None
    return (
        f"A's model is {a.architecture.title} in {a.naming} names and B's in {b.naming} "
        "names: --select model compares them through the naming mapping"
    )


def check_naming(naming: str) -> None:
    """Refuse a `--naming` value that is none of `NAMING_CHOICES` (exit 2)."""
    if naming not in NAMING_CHOICES:
        raise UsageError(
            f"--naming {naming!r} is no naming",
            fix=f"Use one of: {', '.join(NAMING_CHOICES)}.",
        )


def _recognised(
    side: NamedSide, model_type: str | None
) -> tuple[dict[str, Entry], Recognised | None]:
    """The side's entries (as lined up, or whole where --select stripped a prefix the model's
    own names carry) and the family and naming of their tensors, if ckpt knows one."""
    for aligned in (side.aligned, side.whole):
        if aligned is None:
            continue
        tensors = [n for n, e in aligned.items() if e.kind == "tensor"]
        found = recognise(tensors, model_type) if tensors else None
        if found is not None:
            return aligned, found
    return side.aligned, None


def _args(
    arch: type[Architecture],
    sides: tuple[tuple[NamedSide, dict[str, Entry], str], ...],
    config: dict[str, Any] | None,
    config_where: str,
    flavor: str | None,
) -> ModelArgs:
    """What the mapping needs: each side's shapes and own args (a Megatron save's), completed
    by `config` (read from `config_where`) and `flavor`, which must agree with the weights of
    both sides."""
    found = ModelArgs()
    shapes = []
    for side, aligned, naming in sides:
        side_shapes = {n: list(e.shape) for n, e in aligned.items() if e.kind == "tensor"}
        shapes.append((side, side_shapes, naming))
        own = arch.args_from_shapes(side_shapes, naming).merged(
            arch.args_from_source(side.checkpoint, naming)
        )
        found = found.merged(own)
    given: list[tuple[ModelArgs, str]] = []
    if config is not None:
        given.append((arch.config_args(config, config_where), "config.json"))
    if flavor is not None:
        from ...architectures.flavors import flavor_args

        given.append((flavor_args(arch, flavor), f"--flavor {flavor}"))
    for args, what in given:
        for side, side_shapes, naming in shapes:
            agree_args(arch, side_shapes, naming, found, args, side.where, what)
        found = found.merged(args)
    return found


def _dropped_state(
    side: NamedSide, computing: list[str], arch: type[Architecture], target: str
) -> list[str]:
    """The warning for tensors of `side` left out that its model computes with (a trained MoE
    load-balancing bias), when they hold other values than zeros: the sides compare equal in
    `target`'s names, and yet compute differently."""
    if not computing:
        return []
    found = dropped_state_warnings(side.checkpoint, computing, arch, target, side.where)
    natives = [n for n in arch.namings() if n != target and n in arch.filled]
    if found and natives:
        found[0] += f"; --naming {natives[0]} compares them (a model in {target} names holds zeros)"
    return found


def _read_in(
    checkpoint: Checkpoint,
    aligned: dict[str, Entry],
    arch: type[Architecture],
    naming: str,
    target: str,
    args: ModelArgs,
) -> tuple[Checkpoint, dict[str, Entry], dict[str, int], list[LeftOut], list[str]]:
    """One side read in naming `target`: (the checkpoint to read it from, lined-up name ->
    entry, how many tensors each transform built, what is left out and why, the names of
    those left out that its model computes with). A side already in `target` is read as it
    is, less what that naming holds of its own but the states it fills on an import
    (torchtitan's MoE load-balancing bias), which the other side, read in it, holds too."""
    left = [
        LeftOut(name=n, reason=f"not a tensor (the {target} naming holds weights only)")
        for n, e in aligned.items()
        if e.kind != "tensor"
    ]
    tensors = {n: e for n, e in aligned.items() if e.kind == "tensor"}
    # a module no rule maps (FLUX.1-dev's guidance embedder) has no counterpart the other
    # side, read in another naming, could hold: left out, named, and the rest compared
    for name, unmapped in arch.unmapped_of(list(tensors), naming):
        left.append(LeftOut(name=name, reason=unmapped.reason))
        del tensors[name]
    if naming == target:
        own = [(i.regex(), i.reason) for i in arch.ignored.get(naming, ())]
        filled = [compile_pattern(f.pattern) for f in arch.filled.get(naming, ())]
        kept: dict[str, Entry] = {}
        for name, entry in tensors.items():
            why = next((reason for regex, reason in own if regex.match(name)), None)
            if why is None or any(regex.match(name) for regex in filled):
                kept[name] = entry
            else:
                left.append(LeftOut(name=name, reason=why))
        return checkpoint, kept, {}, left, []
    from ...architectures.mapped import MappedCheckpoint

    # to a native naming from another native one: through Hugging Face's, the pivot
    steps = [(naming, target)] if HF in (naming, target) else [(naming, HF), (HF, target)]
    reads: dict[str, str] = {n: e.name for n, e in tensors.items()}
    entries = [(n, list(e.shape), e.dtype or "") for n, e in tensors.items()]
    counts: dict[str, int] = {}
    computing: list[str] = []
    mapped: Checkpoint = checkpoint
    for source, dest in steps:
        # an output projection tied to the embedding stays a tensor of its own: the other
        # side's recorded alias (config.json's tie_word_embeddings) pairs it with the
        # embedding, so an untied one that differs is a difference, not left out
        step_args = args.model_copy(update={"tie_embeddings": False}) if dest == HF else args
        plan = arch.plan(entries, source, dest, step_args)
        left += [LeftOut(name=n, reason=why) for n, why in plan.left_out]
        computing += [reads[n] for n in plan.computing]
        # a state the target naming holds at its fresh-start value (torchtitan's MoE
        # load-balancing bias) is what this side, imported, holds: compared with the other
        # side's (a trained bias the export dropped is a difference); on the way through
        # the pivot it is built from nothing and no tensor of this side
        outputs = [t for t in plan.tensors if t.combine != "zeros" or dest == target]
        sourced = ArchitecturePlan(
            plan.architecture,
            plan.source,
            plan.target,
            [
                replace(t, pieces=tuple(replace(p, source=reads[p.source]) for p in t.pieces))
                for t in outputs
            ],
            plan.left_out,
            step_args,
        )
        mapped = MappedCheckpoint(mapped, sourced)
        reads = {t.name: t.name for t in outputs}
        entries = [(t.name, list(t.shape), t.dtype) for t in outputs]
        for tensor in outputs:
            counts[tensor.transform] = counts.get(tensor.transform, 0) + 1
    by_name = mapped.manifest.by_name
    return mapped, {name: by_name[name] for name, _, _ in entries}, counts, left, computing
