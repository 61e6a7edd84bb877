"""`--select`: the one rule every command that takes it (convert, diff) resolves it by.

`--select NAME` picks a sub-tree and strips its prefix. When SRC is a training checkpoint whose
layout knows a component NAME (`TrainingState.prefixes`), the component's own prefix is what is
taken: `model` is `state_dict.` inside a Lightning file, the rebuilt fp32 weights of a ZeRO save,
and, in a torchtitan 0.3 save, the model's keys that sit at the top level beside
`optimizer` / `lr_scheduler` / `dataloader` / `train_state` (prefix "", names unchanged).
Otherwise NAME is a plain prefix: `NAME` itself and `NAME.*`, stripped.

`--filter` / `--filter-out` are globs on the names `ckpt inspect` shows, in inspect, convert and
download (`diff` matches the names after `--select` / `--rename`, which line its two sides up):
a multi-folder model's component is converted on its own, yet its rules see its entries as
`unet.conv_in.weight`, never `conv_in.weight` (`match_prefix`). A rule that matches no entry
anywhere is reported (`unmatched_rules`): it is a warning, not an error, since the same
`--filter-out` is often applied to many checkpoints of which only some hold what it names.

Some layouts keep stand-ins that are not the data they name (`OpenedSource.placeholders`: the
empty ZeRO-3 parameters in `model_states.module`); `refuse_placeholders` stops an operation
that would hand them over as weights without the real ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from ...errors import FormatError
from ...models import Entry, Manifest
from ...sources.layouts.base import OpenedSource


@dataclass(frozen=True)
class Selection:
    """What `--select` chose on one side.

    Attributes:
        pairs: (entry, its name after the selection), in manifest order.
        component: the training component selected (its layout's own prefix taken), or None
            when `select` was matched as a plain prefix (or not given).
        stripped: the prefix stripped from every selected name ("" when none is).
    """

    pairs: list[tuple[Entry, str]]
    component: str | None = None
    stripped: str = ""


def select_prefix(entries: list[Entry], prefix: str | None) -> list[tuple[Entry, str]]:
    """Entries under `prefix` (`model` selects `model` and `model.*`), with the prefix stripped."""
    if not prefix:
        return [(e, e.name) for e in entries]
    prefix = prefix.rstrip(".")
    out = []
    for entry in entries:
        if entry.name == prefix:
            out.append((entry, entry.name))
        elif entry.name.startswith(prefix + "."):
            out.append((entry, entry.name[len(prefix) + 1 :]))
    return out


def select_entries(
    opened: OpenedSource | None,
    entries: list[Entry],
    select: str | None,
    manifest: Manifest | None = None,
) -> Selection:
    """`entries` (a subset of `manifest`'s, after `--filter`/`--filter-out`) as `--select select`
    takes them from `opened` (see the module docstring); every entry when `select` is empty.

    `manifest` is the one `entries` come from (by default `opened`'s): a component whose keys
    sit at the top level is told apart by the manifest's top-level keys.
    """
    if not select:
        return Selection([(e, e.name) for e in entries])
    name = select.rstrip(".")
    training = opened.training if opened is not None else None
    prefix = training.prefixes.get(name) if training is not None else None
    if prefix == "" and opened is not None and training is not None:
        if training.layout == "torchtitan" and name == "model":
            from ...sources.layouts.torchtitan import model_entries, titan_model_keys

            source = manifest if manifest is not None else opened.checkpoint.manifest
            chosen = model_entries(entries, titan_model_keys(source))
            if chosen:
                return Selection([(e, e.name) for e in chosen], component=name)
    elif prefix:
        pairs = select_prefix(entries, prefix)
        if pairs:
            return Selection(pairs, component=name, stripped=prefix.rstrip(".") + ".")
    return Selection(select_prefix(entries, name), stripped=f"{name}.")


def refuse_placeholders(
    opened: OpenedSource | None, names: Iterable[str], select: str | None, where: str
) -> None:
    """Refuse (exit 4) a set of entries that holds a layout's placeholders without the data
    they stand for (`OpenedSource.placeholders`); nothing to do for any other set."""
    if opened is None or not opened.placeholders:
        return
    chosen = set(names)
    held = [n for n in opened.placeholders if n in chosen]
    lacking = [n for n in held if opened.placeholders[n].real not in chosen]
    if not lacking:
        return
    first = opened.placeholders[lacking[0]]
    what = f"--select {select}" if select else "the selected entries"
    raise FormatError(
        f"{what} holds {len(lacking)} {first.kind} ({lacking[0]}: {first.why}), not weights",
        path=where,
        fix=first.fix,
    )


def refuse_lost_files(
    opened: OpenedSource | None,
    doing: str,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    match_prefix: str = "",
    filters: bool = False,
    rank_state: str | None = None,
) -> list[tuple[str, str]]:
    """Refuse (exit 4) to write a whole training save again when a file of it was lost
    (`LOST_FILE_CODES`: a component's state, a rank's RNG states or FSDP part, a ZeRO
    partition), naming the file and the problem. The frameworks' loaders go on without some
    of them (a rank's RNG states: they log a line), so an output that silently lacks one is a
    resume that is not the run it continues; `verify` of the source fails it. `doing`:
    "converted", "re-cut". A component taken alone (`--select`, an export to a naming) needs
    none of the lost files: the caller does not ask then.

    A command that takes `--filter` / `--filter-out` (`filters`) writes the rest when they
    leave out the component every lost file would be (`lost_component`, as `inspect` names
    it in a save that holds it: `--filter-out 'rng_1*'`): the user chose so, knowing. Returns
    (component, why) of each so left out, for the report's `skipped`. A world-size reshard
    told to leave out every rank's RNG states (`rank_state`: its `--rank-state` choice, ""
    when none was made, None for a command without the option; "drop") writes none of the
    lost ones either: nothing then lacks them without a word."""
    from ...sources.layouts.ranks import LOST_FILE_CODES, lost_component

    if opened is None:
        return []
    lost = [p for p in opened.problems if p.severity == "error" and p.code in LOST_FILE_CODES]
    if not lost:
        return []
    storage = opened.checkpoint.storage
    root = storage.describe("x")[:-1]  # how this storage names its files, less the name
    components = [
        lost_component(p.file[len(root) :] if p.file and p.file.startswith(root) else p.file or "")
        for p in lost
    ]
    rng = [re.fullmatch(r"rng(_\d+)?", comp) is not None for comp in components]
    left_out = [
        "--rank-state drop leaves out every rank's RNG states"
        if is_rng and rank_state == "drop"
        else component_left_out(comp, None, include, exclude, match_prefix)
        for comp, is_rng in zip(components, rng, strict=True)
    ]
    kept = [i for i, why in enumerate(left_out) if why is None]
    if not kept:
        return [
            (comp, f"lost: {p.file} ({p.code}), so not in the output either; {why}")
            for comp, p, why in zip(components, lost, left_out, strict=True)
        ]
    first = lost[kept[0]]
    more = f" (and {len(lost) - 1} more lost file{'s' if len(lost) > 2 else ''})"
    globs = " ".join(f"--filter-out '{comp}*'" for comp in dict.fromkeys(components))
    them = "it" if len(lost) == 1 else "them"
    knowingly = ""
    if filters:
        knowingly = f"; or write the rest without {them}, knowingly: {globs}"
    elif rank_state is not None and all(rng):
        knowingly = f"; or re-cut it without {them}, knowingly: --rank-state drop"
    raise FormatError(
        f"{first.code}: {first.message.rstrip('.')}{more if len(lost) > 1 else ''}; the "
        f"{doing} output would lack it without a word, so nothing is written",
        path=first.file,
        fix="Copy it again from where the run saved it (`ckpt verify SRC` lists every lost "
        "file), or use another save of the run (`ckpt latest RUN_DIR`); to take what is there, "
        "convert one component at a time with --select COMPONENT (`ckpt inspect SRC` lists "
        f"them){knowingly}.",
    )


def component_left_out(
    comp: str,
    select: str | None,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    match_prefix: str = "",
) -> str | None:
    """Why `--select` / `--filter` / `--filter-out` leave out the whole component `comp` (one
    whose entries cannot be listed: unreadable, or lost), or None when they do not."""
    probes = (f"{match_prefix}{comp}", f"{match_prefix}{comp}.", f"{match_prefix}{comp}.x")
    if exclude and any(fnmatchcase(p, g) for g in exclude for p in probes):
        return "left out by --filter-out"
    if select is not None and comp != select.rstrip(".") and not comp.startswith(select):
        return "outside --select"
    if include and not any(fnmatchcase(p, g) for g in include for p in probes):
        return "not matched by --filter"
    return None


def lost_file_warnings(opened: OpenedSource | None) -> list[str]:
    """The warnings of an output of the whole training save that lacks what its source lacks
    and `verify` only warns of (`RANK_RNG_CODES` at severity warning: a rank's RNG states lost,
    or on another node's disk): said, never written away in silence."""
    from ...sources.layouts.ranks import RANK_RNG_CODES

    if opened is None:
        return []
    return [
        f"{p.file}: not in the source ({p.code}: lost, or on another node's disk), so not in "
        "the output either; a run resumed from it draws that rank's random numbers afresh "
        "(`ckpt verify SRC` says more)"
        for p in opened.problems
        if p.severity == "warning" and p.code in RANK_RNG_CODES
    ]


def name_chosen(name: str, include: Sequence[str] | None, exclude: Sequence[str] | None) -> bool:
    """Whether `name` matches an `include` glob (`--filter`; any name without one) and no
    `exclude` glob (`--filter-out`): the one rule of every command that takes them."""
    return (not include or any(fnmatchcase(name, g) for g in include)) and not any(
        fnmatchcase(name, g) for g in exclude or ()
    )


def unmatched_rules(
    names: Iterable[str],
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    *,
    matched: str = "entry",
) -> list[str]:
    """One warning per `--filter` / `--filter-out` glob that matches none of `names` (the
    names `ckpt inspect` shows; `matched` says which names those are, for the message)."""
    rules = [("--filter", g) for g in include or ()] + [("--filter-out", g) for g in exclude or ()]
    if not rules:
        return []
    pending = dict.fromkeys(rules)
    for name in names:
        for rule in [r for r in pending if fnmatchcase(name, r[1])]:
            del pending[rule]
        if not pending:
            return []
    return [
        f"{option} {glob!r} matches no {matched}, so it has no effect; "
        "check it against `ckpt inspect --list`"
        for option, glob in pending
    ]


def unreadable_left_out(
    unreadable: dict[str, tuple[str, str]],
    doing: str,
    select: str | None,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    match_prefix: str = "",
) -> list[tuple[str, str]]:
    """Fail on a component that cannot be read, unless the user left it out explicitly;
    (component, why) of each one left out.

    A truncated or hostile `optimizer.pt` must never vanish with exit 0: from a converted
    output, or from a diff that then calls two checkpoints identical. It fails the command
    (exit 4, naming it; `doing`: "converted", "compared") unless `--filter-out` (or `--select`
    / `--filter` choosing other entries) leaves it out.
    """
    kept: list[tuple[str, str]] = []
    for comp, (where, problem) in sorted(unreadable.items()):
        why = component_left_out(comp, select, include, exclude, match_prefix)
        if why is None:
            raise FormatError(
                f"the {comp} component cannot be read, so it cannot be {doing}: {problem}",
                path=where,
                fix=f"Repair or re-save it, or leave it out explicitly with --filter-out '{comp}*'.",
            )
        kept.append((comp, f"unreadable: {where}: {problem}; {why}"))
    return kept
