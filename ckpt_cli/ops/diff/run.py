"""`diff`: two checkpoints of any formats compared entry by entry: the restart test's judge.

Names are lined up first (`--select` strips a sub-tree prefix on each side that has it,
`--rename` maps prefixes on both sides, `--filter` narrows), then every pair is compared:
kind, dtype and shape from the manifests; tensor values bit for bit (or within `--atol` /
`--rtol`); non-tensor entries (step, RNG, scheduler and data-loader state) by value.

Memory: one tensor pair at a time. Pairs stored as raw bytes on both sides with the same dtype
and shape are first compared block by block without building tensors; only a pair that differs
is read whole, and its statistics are computed over slices so the float64 working copies stay
small.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from ...errors import CkptError, NotFoundError, UsageError
from ...formats.base import Checkpoint
from ...models import Entry, Record, Request
from ...progress import NULL_PROGRESS, Progress
from ...sources.layouts import OpenedSource
from ...sources.opening import open_source
from ..shared.selection import (
    name_chosen,
    refuse_placeholders,
    select_entries,
    unmatched_rules,
    unreadable_left_out,
)
from ..shared.transfer import (
    check_source_unchanged,
    nothing_to_dequantize,
    parse_renames,
    raw_blocks,
    rename,
    unused_rename_rules,
)
from .compare import error_stats, short_repr, tensor_stats, values_equal, values_of
from .listed import (
    TRAINING_ARGS_FILE,
    ListedComparison,
    file_metadata_notes,
    listed_comparison,
)
from .namings import AUTO, OFF, NamedSide, NamingMap, check_naming, line_up_namings, select_hint


class EntryDiff(Record):
    """How one lined-up pair of entries differs.

    Attributes:
        name: the lined-up name (after --select / --rename).
        name_a / name_b: the names in A and B.
        status: `kind`, `dtype`, `shape` (structure changed), `values` (tensor data differs
            beyond tolerance), `close` (differs, within tolerance: not a difference) or
            `value` (non-tensor entry differs).
        kind_a / kind_b, dtype_a / dtype_b, shape_a / shape_b: what each side holds.
        numel: elements compared.
        differing: elements that are not bit-identical.
        outside_tolerance: elements failing |a-b| <= atol + rtol*|b| (when tolerances are set).
        max_abs / max_rel: largest absolute and relative (to |b|) difference.
        value_a / value_b: short representations of differing non-tensor values.
        dtype_changed: the two sides store the tensor in different dtypes (its values were
            compared after casting both to float64 / complex128, exact for every floating
            dtype; integers are compared exactly).
    """

    name: str
    name_a: str
    name_b: str
    status: str
    kind_a: str
    kind_b: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    numel: int | None = None
    differing: int | None = None
    outside_tolerance: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    value_a: str | None = None
    value_b: str | None = None
    dtype_changed: bool = False

    @property
    def is_difference(self) -> bool:
        """Whether this pair makes the checkpoints different (`close` does not)."""
        return self.status != "close"


class MetadataDiff(Record):
    """A key of the model's metadata (GGUF's key-values, or a companion file's:
    `config.json:rms_norm_eps`) that differs between the sides.

    Attributes:
        key: the metadata key (`general.architecture`, `llama.rope.freq_base`...).
        value_a / value_b: each side's value as JSON text (a long one as its summary and a
            sha256 prefix of the whole); None where that side lacks the key.
    """

    key: str
    value_a: str | None = None
    value_b: str | None = None


class AliasPair(Record):
    """A tied name: an alias of another tensor (`lm_head.weight` of `transformer.wte.weight`).

    Attributes:
        name: the lined-up alias name.
        target: the lined-up name of the tensor it is.
        recorded_a / recorded_b: how each side records the alias (`safetensors metadata`,
            `shared storage`, `config.json tie_word_embeddings (GPT2LMHeadModel)`); None
            where that side does not.
        written_once: `a` or `b`, the side that stores the tensor once and the alias only as
            a record: the other side's `name` was compared with its `target` (None when both
            sides hold the name, compared as usual).
    """

    name: str
    target: str
    recorded_a: str | None = None
    recorded_b: str | None = None
    written_once: str | None = None


class QuantError(Record):
    """How far one dequantized weight is from the other side's tensor (`diff --dequantize`).

    Attributes:
        name: the lined-up name; scheme: the quantization scheme of the dequantized side.
        numel: elements compared.
        max_abs: largest |a - b|.
        rel_rms: sqrt(sum((a - b)^2) / sum(b^2)), the error relative to the weight's size.
    """

    name: str
    scheme: str
    numel: int
    max_abs: float
    rel_rms: float


class DiffReport(Record):
    """The result of `ckpt diff`.

    Attributes:
        a / b: the two locations; format_a / format_b their formats.
        identical: no difference (tensors bit-exact, or within tolerance when one is set).
        verdict: one line saying so.
        atol / rtol: tolerances used (None: bit-exact).
        select_applied: for each side, whether --select found the prefix there.
        compared: pairs compared; equal: bit-identical pairs; close: within tolerance.
        only_a / only_b: names present on one side only.
        differences: differing pairs, largest first (structure, then values, then objects).
        components: differing entries (and names on one side only) per top-level key
            (`model`, `optimizer`, `rng`...), and differing values of the pickled components
            ckpt never unpickles (`sampler`, `custom_0`, `training_args`) per component: where
            a resumed run diverged.
        within_tolerance: pairs that differ but are within tolerance.
        dequantized: with `--dequantize`, how many weights of each side were dequantized.
        quant_errors: per dequantized weight, the error statistics, worst first.
        ignore_dtype: dtype changes were accepted (`--ignore-dtype`): such a pair counts by
            its values alone.
        dtype_changes: pairs whose dtype differs between the sides (differences unless
            `ignore_dtype`).
        aliases: tied names (see `ops.aliases`): a name one side keeps only as a recorded
            alias is compared with the tensor it names there, not counted as missing.
        naming: when the two sides are one model family in two framework namings (a
            torchtitan save and its `convert --to hf` export), how their names were mapped to
            one naming to be compared, and what has no counterpart in it (`ops.diff.namings`);
            None when names were compared as they are.
        metadata: keys of the model's metadata (GGUF's architecture, hyper-parameters and
            tokenizer; the companion files both folders hold, `config.json:KEY`, or the file
            name for a file that is no JSON object) whose values differ, when both sides keep
            such metadata and the whole checkpoints are compared (no --select / --filter /
            --filter-out): differences. Likewise the training components a layout lists
            without loading (`ops.diff.listed`): a pickled object's attribute
            (`training_args.bin:learning_rate`, `sampler.bin:epoch`), or a pickle's file name
            where it is compared by its bytes (`custom_checkpoint_0.pkl`).
        warnings: options that had no effect (a `--filter` glob that matches no entry of
            either side), and what was not compared (a companion file only one side holds).
    """

    a: str
    b: str
    format_a: str
    format_b: str
    identical: bool
    verdict: str
    atol: float | None = None
    rtol: float | None = None
    select_applied: dict[str, bool] = Field(default_factory=dict)
    compared: int = 0
    equal: int = 0
    close: int = 0
    only_a: list[str] = Field(default_factory=list)
    only_b: list[str] = Field(default_factory=list)
    differences: list[EntryDiff] = Field(default_factory=list)
    components: dict[str, int] = Field(default_factory=dict)
    within_tolerance: list[EntryDiff] = Field(default_factory=list)
    dequantized: dict[str, int] = Field(default_factory=dict)
    quant_errors: list[QuantError] = Field(default_factory=list)
    ignore_dtype: bool = False
    dtype_changes: int = 0
    aliases: list[AliasPair] = Field(default_factory=list)
    naming: NamingMap | None = None
    metadata: list[MetadataDiff] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @property
    def differ_within(self) -> int:
        """Pairs whose values differ within tolerance (`close` counts, besides them, the
        pairs `--ignore-dtype` accepted with equal values)."""
        return sum(1 for d in self.within_tolerance if d.differing)


def _selected(
    opened: OpenedSource,
    checkpoint: Checkpoint,
    select: str | None,
    other: list[str] | None,
) -> tuple[list[tuple[Entry, str]], bool, bool]:
    """(entry, name after --select) pairs of one side, whether --select applied there, and
    whether it named a training component of that side (`ops.selection`'s rule, as convert).

    A side without that component (a weights file exported from it) strips `select` as a plain
    prefix only where that lines it up better with `other` (the other side's selected names):
    the exported weights of an HF causal LM start with `model.` themselves
    (`model.layers.0...`, beside `lm_head.weight`).
    """
    entries = checkpoint.manifest.entries
    whole = [(e, e.name) for e in entries]
    if not select:
        return whole, False, False
    selection = select_entries(opened, entries, select, checkpoint.manifest)
    if selection.component is not None:
        return selection.pairs, True, True
    chosen = selection.pairs
    if not chosen:
        return whole, False, False
    if other is not None:
        names = set(other)
        if sum(n in names for _, n in whole) > sum(n in names for _, n in chosen):
            return whole, False, False
    return chosen, True, False


def _line_up(
    ca: Checkpoint,
    cb: Checkpoint,
    chosen_a: list[tuple[Entry, str]],
    chosen_b: list[tuple[Entry, str]],
) -> tuple[list[tuple[Entry, str]], bool, list[tuple[Entry, str]], bool]:
    """Both sides stripped of --select's prefix, or one of them whole: whichever pairing
    lines up the most names (both stripped on a tie), with whether each side was stripped."""
    whole_a = [(e, e.name) for e in ca.manifest.entries]
    whole_b = [(e, e.name) for e in cb.manifest.entries]

    def common(x: list[tuple[Entry, str]], y: list[tuple[Entry, str]]) -> int:
        return len({n for _, n in x} & {n for _, n in y})

    options = [
        (common(chosen_a, chosen_b), chosen_a, True, chosen_b, True),
        (common(whole_a, chosen_b), whole_a, False, chosen_b, True),
        (common(chosen_a, whole_b), chosen_a, True, whole_b, False),
    ]
    best = max(options, key=lambda option: option[0])  # the first of equals: both stripped
    return best[1], best[2], best[3], best[4]


#: one side of `_training_state_one_side`: opened, checkpoint, (entry, selected name) pairs,
#: and whether --select took a training component of it
_Selected = tuple[OpenedSource, Checkpoint, list[tuple[Entry, str]], bool]


def _training_state_one_side(side_a: _Selected, side_b: _Selected, select: str) -> list[str]:
    """A note for a training save diffed with --select against a model that holds no training
    state (its `convert --to hf` export): the weights line up, and the optimizer, scheduler,
    RNG and trainer state that only the save holds vanished from an IDENTICAL verdict. Each
    is named as held by that side alone (not compared: --select compares a part). Two
    training saves get no note: --select is then the user's choice of a part."""
    notes = []
    for (opened, checkpoint, chosen, component), other, label, other_label in (
        (side_a, side_b, "A", "B"),
        (side_b, side_a, "B", "A"),
    ):
        if not component or opened.training is None or other[0].training is not None:
            continue
        taken = {e.name for e, _ in chosen}
        held = {e.name.split(".", 1)[0] for e in checkpoint.manifest.entries if e.name not in taken}
        held |= set(opened.listed_parts)
        if any(rel.rsplit("/", 1)[-1] == TRAINING_ARGS_FILE for rel in opened.listed_files):
            held.add("training_args")
        held.discard(select.rstrip("."))
        if held:
            notes.append(
                f"only {label} holds a training state: its {', '.join(sorted(held))} not "
                f"compared (--select {select} compares its {select.rstrip('.')} component, and "
                f"{other_label} is a model without one)"
            )
    return notes


def _component_hint(names_a: set[str], names_b: set[str]) -> str | None:
    """When no name is on both sides, but one side's names are the other's under one
    component prefix (a training save's `model.` against the weights it exported, a folder of
    adapters' `default.` against one adapter), the `--select` that compares them: every name
    of the smaller side is one of the larger side's, the prefix stripped."""
    if not names_a or not names_b or names_a & names_b:
        return None
    for whole, part, whole_side, part_side in (
        (names_a, names_b, "A", "B"),
        (names_b, names_a, "B", "A"),
    ):
        grouped: dict[str, set[str]] = {}
        for name in whole:  # one pass: a save of many top-level keys is no quadratic walk
            prefix, dot, rest = name.partition(".")
            if dot:
                grouped.setdefault(prefix, set()).add(rest)
        for prefix, under in sorted(grouped.items()):
            if len(under) >= len(part) and part <= under:
                return (
                    f"no name is on both sides, and every name of {part_side} is one of "
                    f"{whole_side}'s under {prefix!r} (its {prefix} component): --select "
                    f"{prefix} compares them"
                )
    return None


def _filtered(
    aligned: dict[str, Entry], filters: Sequence[str], excludes: Sequence[str] = ()
) -> dict[str, Entry]:
    """The lined-up names (as `ckpt inspect` shows them, after --select and --rename) that
    match a `--filter` glob (all of them without one) and no `--filter-out` glob."""
    if not filters and not excludes:
        return aligned
    return {n: e for n, e in aligned.items() if name_chosen(n, filters, excludes)}


def _lined_up_fix(
    lined_up: Sequence[str],
    filters: Sequence[str],
    excludes: Sequence[str],
    select: str | None,
    renamed: bool,
) -> str:
    """The fix for `--filter` globs that leave nothing: with --select or --rename they match
    the lined-up names, not the source names `ckpt inspect --list` shows (as `convert`'s do),
    so a glob written with the selected prefix gets it stripped where that matches."""
    if not select and not renamed:
        return "Check the pattern against `ckpt inspect --list`."
    said = (
        "diff matches the patterns against the names after --select strips its prefix and "
        "--rename applies (they line the two sides up), not the names `ckpt inspect --list` shows"
    )
    prefix = f"{select.rstrip('.')}." if select else ""
    moved = [g.removeprefix(prefix) if prefix else g for g in filters]
    if moved != list(filters) and any(name_chosen(n, moved, excludes) for n in lined_up):
        return said + ": " + " ".join(f"--filter '{g}'" for g in moved) + "."
    return said + "."


def _align(chosen: list[tuple[Entry, str]], renames: Sequence[tuple[str, str]]) -> dict[str, Entry]:
    aligned: dict[str, Entry] = {}
    for entry, name in chosen:
        new = rename(name, renames)
        if new in aligned:
            raise UsageError(
                f"{entry.name!r} and {aligned[new].name!r} line up under the same name {new!r}",
                fix="Adjust --select/--rename so names stay distinct.",
            )
        aligned[new] = entry
    return aligned


def _raw_equal(ca: Checkpoint, cb: Checkpoint, ea: Entry, eb: Entry) -> bool:
    """Byte-compare two raw-stored tensors block by block (no tensors built)."""
    blocks_b = raw_blocks(cb, eb.name)
    for block_a in raw_blocks(ca, ea.name):
        block_b = next(blocks_b, None)
        if block_b is None or bytes(block_a) != bytes(block_b):
            return False
    return next(blocks_b, None) is None


def _compare_stored(
    ca: Checkpoint, cb: Checkpoint, ea: Entry, eb: Entry
) -> tuple[bool, str, str] | None:
    """Two entries of which one at least is compared by its stored bytes (`stored_as`: a GGUF
    quantized tensor, which ckpt does not dequantize): (bit-identical, what A holds, what B
    holds); None when neither is. Stored forms that differ (Q4_K against Q8_0) differ."""
    form_a, form_b = ca.stored_as(ea.name), cb.stored_as(eb.name)
    if form_a is None and form_b is None:
        return None
    if form_a is None or form_b is None or form_a != form_b or ea.nbytes != eb.nbytes:
        return False, form_a or str(ea.py_type), form_b or str(eb.py_type)
    import hashlib

    digest_a, digest_b = hashlib.sha256(), hashlib.sha256()
    blocks_b = cb.iter_stored(eb.name)
    same = True
    for block_a in ca.iter_stored(ea.name):
        block_b = next(blocks_b, b"")
        digest_a.update(block_a)
        digest_b.update(block_b)
        same = same and bytes(block_a) == bytes(block_b)
    for block_b in blocks_b:
        digest_b.update(block_b)
        same = False
    if same:
        return True, form_a, form_b
    return (
        False,
        f"{form_a}, stored bytes sha256:{digest_a.hexdigest()[:16]}",
        f"{form_b}, stored bytes sha256:{digest_b.hexdigest()[:16]}",
    )


def _whole(
    checkpoint: Checkpoint,
    applied: bool,
    component: bool,
    renames: Sequence[tuple[str, str]],
) -> dict[str, Entry] | None:
    """Every entry of a side under its own name (renamed), when --select stripped a plain
    prefix there (no training component of it): an HF model's own names start with `model.`,
    so a naming is recognised in them whole (None otherwise, or when renames make two names
    one)."""
    if not applied or component:
        return None
    try:
        return _align([(e, e.name) for e in checkpoint.manifest.entries], renames)
    except UsageError:
        return None


def _unused_mapping_options(request: DiffRequest) -> list[str]:
    """`--config` and `--flavor` serve the naming mapping alone: a warning for each one given
    to a diff that mapped no naming (as `convert` refuses `--flavor` with nothing to apply to)."""
    given = [(o, v) for o, v in (("--config", request.config), ("--flavor", request.flavor)) if v]
    why = (
        "--naming off maps no naming"
        if request.naming == OFF
        else "A and B were not read as one model family in two namings (a torchtitan or "
        "Megatron save and its HF export), so no naming was mapped"
    )
    return [
        f"{option} {value} was not used: {why}, and it serves that mapping alone. Leave it "
        "out, or name the two sides of one model in two namings (--naming hf)."
        for option, value in given
    ]


def _given_config(spec: str | None) -> dict[str, Any] | None:
    """`--config`'s `config.json` as a dict (read, and refused, as `convert --config` reads it:
    a JSON object, a file, a model folder or a Hub model)."""
    if spec is None:
        return None
    import json

    from ..convert.plan import read_config

    doc: dict[str, Any] = json.loads(read_config(spec)[0])
    return doc


def _read_value(checkpoint: Checkpoint, entry: Entry) -> Any:
    return checkpoint.read_object(entry.name)


class DiffRequest(Request):
    """Every option of `diff` but the two locations, typed and frozen: validated once by
    `diff_with` and passed whole to each comparison, so no option is re-listed by hand. Its
    fields are `diff`'s keyword parameters (the command's `--rename` / `--filter` /
    `--filter-out` are `renames` / `filters` / `excludes`; a test holds them to each other);
    `progress` is a sink, not an option, and travels beside it. The fields mean what `diff`'s
    arguments say."""

    format_a: str | None = None
    format_b: str | None = None
    atol: float | None = None
    rtol: float | None = None
    renames: list[str] | None = None
    select: str | None = None
    filters: list[str] | None = None
    excludes: list[str] | None = None
    dequantize: bool = False
    ignore_dtype: bool = False
    naming: str = AUTO
    config: str | None = None
    flavor: str | None = None


def _compare(
    ca: Checkpoint,
    cb: Checkpoint,
    name: str,
    ea: Entry,
    eb: Entry,
    request: DiffRequest,
    quant: dict[str, Any] | None = None,
) -> EntryDiff | None:
    """Compare one pair as `request` says (tolerances, dtype); with `quant` (a dequantized
    weight's scheme -> errors list), a dtype change is expected and the pair's error
    statistics are recorded."""
    atol, rtol, ignore_dtype = request.atol, request.rtol, request.ignore_dtype
    base: dict[str, Any] = {
        "name": name,
        "name_a": ea.name,
        "name_b": eb.name,
        "kind_a": ea.kind,
        "kind_b": eb.kind,
    }
    if ea.kind != eb.kind:
        return EntryDiff(status="kind", **base)
    if ea.kind != "tensor":
        stored = _compare_stored(ca, cb, ea, eb)
        if stored is not None:
            same, value_a, value_b = stored
            if same:
                return None
            return EntryDiff(status="value", value_a=value_a, value_b=value_b, **base)
        va, vb = _read_value(ca, ea), _read_value(cb, eb)
        if values_equal(va, vb):
            return None
        return EntryDiff(status="value", value_a=short_repr(va), value_b=short_repr(vb), **base)
    base.update(dtype_a=ea.dtype, dtype_b=eb.dtype, shape_a=list(ea.shape), shape_b=list(eb.shape))
    if list(ea.shape) != list(eb.shape):
        return EntryDiff(status="shape", **base)
    if ea.dtype == eb.dtype and ea.is_raw and eb.is_raw and _raw_equal(ca, cb, ea, eb):
        return None
    ta = ca.read_tensor(ea.name)
    tb = cb.read_tensor(eb.name)
    differing, outside, max_abs, max_rel = tensor_stats(ta, tb, atol, rtol)
    numel = values_of(ta)
    if quant is not None:
        worst, rel_rms = error_stats(ta, tb)
        quant["errors"].append(
            QuantError(
                name=name, scheme=quant["scheme"], numel=numel, max_abs=worst, rel_rms=rel_rms
            )
        )
    del ta, tb
    changed = ea.dtype != eb.dtype and quant is None
    if not changed and differing == 0:
        return None
    within = outside == 0 if outside is not None else differing == 0
    status = "dtype" if changed and not ignore_dtype else "close" if within else "values"
    return EntryDiff(
        status=status,
        numel=numel,
        differing=differing,
        outside_tolerance=outside,
        max_abs=max_abs,
        max_rel=max_rel,
        dtype_changed=changed,
        **base,
    )


_STRUCTURE = {"kind": 0, "shape": 1, "dtype": 2}


def _order(d: EntryDiff) -> tuple[int, float, str]:
    if d.status in _STRUCTURE:
        return (_STRUCTURE[d.status], -(d.max_abs or 0.0), d.name)
    if d.status == "value":
        return (4, 0.0, d.name)
    return (3, -(d.max_abs or 0.0), d.name)


def diff(
    a: str,
    b: str,
    *,
    format_a: str | None = None,
    format_b: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    renames: list[str] | None = None,
    select: str | None = None,
    filters: list[str] | None = None,
    dequantize: bool = False,
    progress: Progress = NULL_PROGRESS,
    ignore_dtype: bool = False,
    excludes: list[str] | None = None,
    naming: str = AUTO,
    config: str | None = None,
    flavor: str | None = None,
) -> DiffReport:
    """Compare checkpoints `a` and `b` entry by entry.

    Args:
        a / b: checkpoint files, folders or URLs (any formats).
        format_a / format_b: read each side as this format instead of detecting it.
        atol / rtol: tolerances; without them tensors must be bit-identical.
        renames: `OLD=NEW` prefix renames applied to the names of both sides.
        select: compare only the sub-tree under this prefix, stripped, on each side that has
            it (a side without it is compared whole: `--select model` lines a training
            checkpoint up with a weights-only file).
        filters: globs on the lined-up names: only those matching one are compared.
        excludes: globs on the lined-up names: those matching one are left out.
        dequantize: compare quantized weights (FP8, MXFP4, NVFP4, GGUF blocks) by their
            dequantized values (in float32), with per-weight error statistics; their weight scales are not
            compared, their activation scales (`input_scale`) are, as plain tensors, where
            both sides hold them (a warning names those only one side holds).
        progress: progress sink (bytes of A).
        ignore_dtype: a dtype change is no difference by itself: the pair is judged by its
            values (cast to float64 on both sides), bit-exact or within the tolerances.
        naming: `auto`: two sides that are one model family in two framework namings (a
            torchtitan or Megatron save and its `convert --to hf` export) are compared in
            Hugging Face's naming, through the family's mapping; `off`: names as they are;
            `hf` / `torchtitan` / `megatron`: both sides compared in that naming.
        config: a Hugging Face `config.json` (file, model folder or `hf://org/model`) for what
            the naming mapping needs and the weights do not tell (a Llama's head counts), where
            neither side holds one.
        flavor: the torchtitan flavor of the model, for the same.
    """
    request = DiffRequest(
        format_a=format_a,
        format_b=format_b,
        atol=atol,
        rtol=rtol,
        renames=renames,
        select=select,
        filters=filters,
        excludes=excludes,
        dequantize=dequantize,
        ignore_dtype=ignore_dtype,
        naming=naming,
        config=config,
        flavor=flavor,
    )
    return diff_with(a, b, request, progress)


#: `--format` (or `-f/--format`) in a fix, the option of the commands that read one SRC
_FORMAT_OPTION = re.compile(r"(?<![\w-])(?:-f/)?--format(?![\w-])")


def _open_side(location: str, format: str | None, option: str) -> OpenedSource:
    """`open_source` of one side. A fix that says to pass or leave out `--format` (the option
    of the commands that read one SRC, which diff lacks) names this side's `option`."""
    try:
        return open_source(location, format)
    except CkptError as error:
        if error.fix:
            error.fix = _FORMAT_OPTION.sub(option, error.fix)
        raise


def diff_with(
    a: str, b: str, request: DiffRequest, progress: Progress = NULL_PROGRESS
) -> DiffReport:
    """`diff` of `a` and `b` as `request` says (the command's one call)."""
    atol, rtol, select, filters = request.atol, request.rtol, request.select, request.filters
    for value, flag in ((atol, "--atol"), (rtol, "--rtol")):
        if value is not None and (value < 0 or math.isnan(value)):
            raise UsageError(
                f"{flag} must be a non-negative number",
                fix=f"Give a tolerance of 0 or more, e.g. {flag} 1e-3.",
            )
    rename_pairs = parse_renames(request.renames)
    check_naming(request.naming)
    config = _given_config(request.config)
    opened_a = _open_side(a, request.format_a, "--format-a")
    opened_b = _open_side(b, request.format_b, "--format-b")
    with opened_a.checkpoint as base_a, opened_b.checkpoint as base_b:
        ca, cb = base_a, base_b
        schemes: dict[str, str] = {}
        counts: dict[str, int] = {}
        activation: dict[str, set[str]] = {}
        if request.dequantize:
            ca, cb = (
                _dequantized(c, side, schemes, counts, activation)
                for c, side in ((ca, "a"), (cb, "b"))
            )
            if not counts:  # it would do nothing: refused, as `convert --dequantize` is
                from ...quant import analyse_checkpoint

                for side in (base_a, base_b):
                    packed = analyse_checkpoint(side.manifest, side.storage).packed_scheme
                    refusal = nothing_to_dequantize(side.manifest, packed=packed)
                    if not isinstance(refusal, UsageError):
                        raise refusal  # quantized, in a scheme ckpt does not dequantize
                raise UsageError(
                    "--dequantize: no quantized weight found on either side (FP8, MXFP4, NVFP4, INT4/INT8, "
                    "GGUF blocks)",
                    path=a,
                    fix="Drop --dequantize; `ckpt inspect` shows what each checkpoint holds.",
                )
        chosen_a, applied_a, comp_a = _selected(opened_a, ca, select, None)
        chosen_b, applied_b, comp_b = _selected(
            opened_b, cb, select, [n for _, n in chosen_a] if comp_a else None
        )
        if comp_b and not comp_a:
            chosen_a, applied_a, _ = _selected(opened_a, ca, select, [n for _, n in chosen_b])
        elif applied_a and applied_b and not comp_a:
            # neither side names PREFIX as a training component (a plain `dcp.save({"model":
            # ...})`, or two weights files): one of them may be exported weights whose own
            # names start with it (an HF causal LM's `model.layers…` beside `lm_head`), so
            # that side is compared whole where that lines up better
            chosen_a, applied_a, chosen_b, applied_b = _line_up(ca, cb, chosen_a, chosen_b)
        one_side = (
            _training_state_one_side(
                (opened_a, ca, chosen_a, comp_a), (opened_b, cb, chosen_b, comp_b), select
            )
            if select
            else []
        )
        for opened, chosen, where in ((opened_a, chosen_a, a), (opened_b, chosen_b, b)):
            if select:
                # ZeRO-3's empty parameters would compare equal whatever the weights are
                refuse_placeholders(opened, [e.name for e, _ in chosen], select, where)
        left = _align(chosen_a, rename_pairs)
        right = _align(chosen_b, rename_pairs)
        lined_namings = line_up_namings(
            NamedSide(
                ca, left, _whole(ca, applied_a, comp_a, rename_pairs), a, chosen_a, applied_a
            ),
            NamedSide(
                cb, right, _whole(cb, applied_b, comp_b, rename_pairs), b, chosen_b, applied_b
            ),
            request.naming,
            config,
            request.flavor,
        )
        naming_map = None
        if lined_namings is not None:
            naming_map, side_a, side_b = lined_namings
            ca, left, chosen_a, applied_a = (
                side_a.checkpoint,
                side_a.aligned,
                side_a.chosen,
                side_a.select_applied,
            )
            cb, right, chosen_b, applied_b = (
                side_b.checkpoint,
                side_b.aligned,
                side_b.chosen,
                side_b.select_applied,
            )
        excludes = request.excludes or []
        warnings = [*side_a.warnings, *side_b.warnings] if lined_namings is not None else []
        warnings += one_side
        if lined_namings is None:
            warnings += _unused_mapping_options(request)
        warnings += unmatched_rules(
            [*left, *right], filters, excludes, matched="entry of either side"
        )
        warnings += unused_rename_rules(
            [n for _, n in [*chosen_a, *chosen_b]], rename_pairs, matched="entry of either side"
        )
        if naming_map is None and not select and request.naming != OFF:
            hint = select_hint(((opened_a, ca), (opened_b, cb)))
            if hint is not None:
                warnings.append(hint)
        if naming_map is None and not request.dequantize and request.naming != OFF:
            hint = _dequantize_hint(((ca, a), (cb, b)))
            if hint is not None:
                warnings.append(hint)
        for opened, where in ((opened_a, a), (opened_b, b)):
            # a component that cannot be read would otherwise vanish from both the comparison
            # and the verdict: two saves whose optimizers differ were called IDENTICAL
            warnings += [
                f"{where}: {comp} not compared: {why}"
                for comp, why in unreadable_left_out(
                    opened.unreadable, "compared", select, filters, excludes
                )
            ]
        listed = ListedComparison()
        if not (select or filters or excludes):
            # a file a layout lists without loading (`training_args.bin`, `sampler.bin`, never
            # unpickled) vanished from the report: two saves whose sampler epoch differed were
            # IDENTICAL. A component of the save is compared by its values, the rest named
            listed = listed_comparison((opened_a, base_a), (opened_b, base_b))
            warnings += listed.notes
            # the safetensors file metadata (header, index) was ignored: a differing key is named
            warnings += file_metadata_notes(base_a, base_b)
        lined_up = [*left, *right]
        whole_left, whole_right = left, right
        left = _filtered(left, filters or [], excludes)
        right = _filtered(right, filters or [], excludes)
        lone_a = _lone_activation_scales(left, right, activation.get("a", set()))
        lone_b = _lone_activation_scales(right, left, activation.get("b", set()))
        for lone, where, other in ((lone_a, a, "B"), (lone_b, b, "A")):
            if lone:
                warnings.append(
                    f"{where}: {len(lone)} activation scale(s) of quantized weights not "
                    f"compared, {other} has none ({', '.join(lone[:3])}"
                    f"{', …' if len(lone) > 3 else ''})"
                )
        if not select and naming_map is None:
            hint = _component_hint(set(left), set(right))
            if hint is not None:
                warnings.append(hint)
        if select and not (applied_a or applied_b):
            raise NotFoundError(
                f"neither checkpoint has entries under {select!r}",
                path=a,
                fix="Check the prefix with `ckpt inspect`.",
            )
        if (filters or excludes) and not left and not right:
            raise NotFoundError(
                "the --filter/--filter-out patterns leave no entry on either side",
                path=a,
                fix=_lined_up_fix(lined_up, filters or [], excludes, select, bool(rename_pairs)),
            )
        report = DiffReport(
            a=ca.manifest.location,
            b=cb.manifest.location,
            format_a=ca.manifest.format,
            format_b=cb.manifest.format,
            dequantized=counts,
            identical=False,
            verdict="",
            atol=atol,
            rtol=rtol,
            ignore_dtype=request.ignore_dtype,
            select_applied={"a": applied_a, "b": applied_b} if select else {},
            only_a=[n for n in left if n not in right and n not in lone_a],
            only_b=[n for n in right if n not in left and n not in lone_b],
            naming=naming_map,
            warnings=warnings,
        )
        _compare_metadata(report, base_a, base_b, bool(select or filters or excludes), request)
        listed_components: dict[str, str] = {}
        for key, value_a, value_b, component in listed.differences:
            report.metadata.append(MetadataDiff(key=key, value_a=value_a, value_b=value_b))
            listed_components[key] = component
        extra = _resolve_aliases(
            report,
            (opened_a, ca, chosen_a, whole_left),
            (opened_b, cb, chosen_b, whole_right),
            rename_pairs,
            left,
            right,
        )
        common = [n for n in left if n in right]
        progress.start(sum(left[n].nbytes for n in common if left[n].kind == "tensor"), "diff")
        try:
            for name in common:
                ea, eb = left[name], right[name]
                scheme = _scheme(schemes, "a", ca, ea.name) or _scheme(schemes, "b", cb, eb.name)
                quant = (
                    {"scheme": scheme, "errors": report.quant_errors}
                    if scheme is not None and ea.kind == eb.kind == "tensor"
                    else None
                )
                found = _compare(ca, cb, name, ea, eb, request, quant)
                if found is not None and found.dtype_changed and quant is None:
                    report.dtype_changes += 1
                report.compared += 1
                if found is None:
                    report.equal += 1
                elif found.is_difference:
                    report.differences.append(found)
                else:
                    report.close += 1
                    report.within_tolerance.append(found)
                if ea.kind == "tensor":
                    progress.advance(ea.nbytes)
            for name, (ea, eb) in extra.items():
                # a name written once: A's tensor against the one B's alias names, or back
                found = _compare(ca, cb, name, ea, eb, request)
                report.compared += 1
                if found is None:
                    report.equal += 1
                elif found.is_difference:
                    report.differences.append(found)
                else:
                    report.close += 1
                    report.within_tolerance.append(found)
        finally:
            progress.finish()
        for side in (base_a, base_b):
            # a save written into either side meanwhile: the values compared may be two saves'
            check_source_unchanged(
                side, "the comparison could have read two versions of it; no verdict is given"
            )
    report.quant_errors.sort(key=lambda e: -e.rel_rms)
    report.differences.sort(key=_order)
    report.within_tolerance.sort(key=_order)
    for name in [d.name for d in report.differences] + report.only_a + report.only_b:
        top = name.split(".", 1)[0]
        report.components[top] = report.components.get(top, 0) + 1
    for component in listed_components.values():
        # a pickled component's value (`sampler.bin:epoch`): counted under its component
        report.components[component] = report.components.get(component, 0) + 1
    report.identical = not (report.differences or report.only_a or report.only_b or report.metadata)
    report.verdict = _verdict(report)
    return report


def _compare_metadata(
    report: DiffReport, ca: Checkpoint, cb: Checkpoint, part: bool, request: DiffRequest
) -> None:
    """The model metadata of both sides (`Checkpoint.model_metadata`: GGUF's key-values),
    key by key, into `report.metadata`; a side that keeps none, or a comparison of a part
    (`part`: --select, --filter), is a warning saying the metadata was not compared. Then
    the companion files both folders hold (`_compare_companions`)."""
    _compare_companions(report, ca, cb, part, request)
    meta_a, meta_b = ca.model_metadata(), cb.model_metadata()
    if meta_a is None and meta_b is None:
        return
    if meta_a is None or meta_b is None:
        held, lacks = ("A", "B") if meta_a is not None else ("B", "A")
        report.warnings.append(
            f"the model metadata of {held} (GGUF key-values) was not compared: {lacks} keeps none"
        )
        return
    if part:
        report.warnings.append(
            "the model metadata (GGUF key-values) was not compared: --select/--filter "
            "compare a part of each checkpoint"
        )
        return
    for key in sorted(meta_a.keys() | meta_b.keys()):
        value_a, value_b = meta_a.get(key), meta_b.get(key)
        if value_a != value_b:
            report.metadata.append(MetadataDiff(key=key, value_a=value_a, value_b=value_b))


#: one side for alias resolution: opened, checkpoint, (entry, selected name) pairs, and every
#: lined-up name of it before --filter / --filter-out (the tensors an alias may name)
def _compare_companions(
    report: DiffReport, ca: Checkpoint, cb: Checkpoint, part: bool, request: DiffRequest
) -> None:
    """The companion files (`config.json`, tokenizer files...: `companions`) both sides hold,
    key by key into `report.metadata` (`config.json:rms_norm_eps`): a changed config is a
    changed model, and was called IDENTICAL. One a folder holds and the other folder lacks is
    a warning (a single file holds none, so nothing is said); under --select / --filter,
    which compare a part, those both hold are not compared and a warning says so.
    `--ignore-dtype` and `--dequantize` accept in the config what they accept in the weights
    (`companions.companion_values`)."""
    from .companions import companion_files, companion_values

    dequantize = request.dequantize
    files_a = companion_files(ca, dequantize=dequantize)
    files_b = companion_files(cb, dequantize=dequantize)
    both = [name for name in files_a if name in files_b]
    if part:
        if both:
            report.warnings.append(
                f"the companion files ({', '.join(both)}) were not compared: --select/--filter "
                "compare a part of each checkpoint"
            )
        return
    for lone, side, other in ((files_a, "A", cb), (files_b, "B", ca)):
        missing = [name for name in lone if name not in both]
        if missing and other.source.target is None:
            report.warnings.append(
                f"only {side} holds {', '.join(missing)}: not compared (a companion file of the "
                "weights, not an entry)"
            )
    for name in both:
        values_a, values_b = (
            companion_values(c, name, ignore_dtype=request.ignore_dtype, dequantize=dequantize)
            for c in (ca, cb)
        )
        for key in sorted(values_a.keys() | values_b.keys()):
            value_a, value_b = values_a.get(key), values_b.get(key)
            if value_a != value_b:
                report.metadata.append(MetadataDiff(key=key, value_a=value_a, value_b=value_b))


_Side = tuple[OpenedSource, Checkpoint, list[tuple[Entry, str]], dict[str, Entry]]


def _resolve_aliases(
    report: DiffReport,
    side_a: _Side,
    side_b: _Side,
    renames: Sequence[tuple[str, str]],
    left: dict[str, Entry],
    right: dict[str, Entry],
) -> dict[str, tuple[Entry, Entry]]:
    """Line up the names one side holds only as recorded aliases (tied weights).

    Each name in `only_a` that B records as an alias of a tensor B holds is taken out of
    `only_a` and returned as the pair (A's entry, B's target entry) to compare; the same the
    other way. Aliases both sides hold (shared storage) are listed in `report.aliases` only.
    `--filter` chooses the alias names compared (`left` / `right`), never the tensors they
    name: `--filter 'lm_head.*'` compares `lm_head.weight` with the `transformer.wte.weight`
    a side stores it as, which the glob itself leaves out.
    """
    pairs: dict[str, tuple[Entry, Entry]] = {}
    if not (report.only_a or report.only_b) and not any(
        _has_shared(c) for c in (side_a[1], side_b[1])
    ):
        return pairs
    from .aliases import recorded_aliases

    found: dict[tuple[str, str], AliasPair] = {}

    def note(name: str, target: str, label: str, how: str) -> AliasPair:
        pair = found.setdefault((name, target), AliasPair(name=name, target=target))
        setattr(pair, f"recorded_{label}", how)
        return pair

    for label, (opened, checkpoint, chosen, whole), own, other, missing in (
        ("b", side_b, right, left, report.only_a),
        ("a", side_a, left, right, report.only_b),
    ):
        prefix = _applied_prefix(chosen)
        model = opened.training.prefixes.get("model", "") if opened.training else ""
        for alias in recorded_aliases(checkpoint, model):
            name, target = (
                _lined(alias.name, prefix, renames),
                _lined(alias.target, prefix, renames),
            )
            if name is None or target is None or target not in whole:
                continue
            if alias.stored:
                if name in own:
                    note(name, target, label, alias.recorded)
                continue
            if name not in missing or name not in other:
                continue
            missing.remove(name)
            theirs, mine = other[name], whole[target]
            pairs[name] = (theirs, mine) if label == "b" else (mine, theirs)
            note(name, target, label, alias.recorded).written_once = label
    report.aliases = list(found.values())
    return pairs


def _has_shared(checkpoint: Checkpoint) -> bool:
    from ..shared.transfer import tied_groups

    return bool(tied_groups(checkpoint.manifest))


def _applied_prefix(chosen: list[tuple[Entry, str]]) -> str:
    """The prefix --select stripped from this side's names ("" when none)."""
    for entry, name in chosen:
        if entry.name.endswith(name):
            return entry.name[: len(entry.name) - len(name)]
    return ""


def _lined(raw: str, prefix: str, renames: Sequence[tuple[str, str]]) -> str | None:
    """`raw` under this side's --select and --rename, or None when --select leaves it out."""
    if not raw.startswith(prefix):
        return None
    return rename(raw[len(prefix) :], renames)


def _dequantize_hint(sides: tuple[tuple[Checkpoint, str], ...]) -> str | None:
    """What to say when a side's weights are a format's own quantized blocks (a GGUF's Q8_0)
    of one model family whose other side is in another naming (its `--to hf --dequantize`
    export): stored blocks are no tensors the naming mapping reads, so every name stood on
    one side only, unexplained; `--dequantize` reads them as tensors, through the mapping."""
    from ...architectures import recognise

    found = []
    quantized: tuple[str, int] | None = None
    for checkpoint, where in sides:
        blocks = checkpoint.block_quantized()
        names = [
            e.name for e in checkpoint.manifest.entries if e.kind == "tensor" or e.name in blocks
        ]
        rec = recognise(names) if names else None
        if rec is None:
            return None
        found.append(rec)
        if blocks and quantized is None:
            quantized = (where, len(blocks))
    a, b = found
    if quantized is None or a.architecture is not b.architecture or a.naming == b.naming:
        return None
    where, count = quantized
    return (
        f"{where}: its {count} quantized tensors are {a.architecture.title} weights in "
        f"{a.naming if where == sides[0][1] else b.naming} names, compared as stored bytes "
        "under their own names; --dequantize reads them as tensors and compares them with "
        "the other side through the naming mapping"
    )


def _scheme(schemes: dict[str, str], side: str, checkpoint: Checkpoint, name: str) -> str | None:
    """The quantization scheme of `side`'s entry `name`, dequantized (None: not dequantized),
    looked up by the names it is read from where a naming mapping renamed it."""
    found = (schemes.get(f"{side}:{source}") for source in checkpoint.built_from(name))
    return next((scheme for scheme in found if scheme is not None), None)


def _dequantized(
    checkpoint: Checkpoint,
    side: str,
    schemes: dict[str, str],
    counts: dict[str, int],
    activation: dict[str, set[str]],
) -> Checkpoint:
    """`checkpoint` seen dequantized to float32 when it holds quantized weights, its
    activation scales kept as plain tensors (their names in `activation[side]`)."""
    from ...quant import analyse_checkpoint
    from ...quant.dequant import BlockDequantizedCheckpoint, DequantizedCheckpoint

    analysis = analyse_checkpoint(checkpoint.manifest, checkpoint.storage)
    if not analysis.quantized and checkpoint.block_quantized():
        blocks = BlockDequantizedCheckpoint(checkpoint, "float32")  # a GGUF's Q4_K...
        for name, scheme in blocks.logical.items():
            schemes[f"{side}:{name}"] = scheme
        counts[side] = len(blocks.logical)
        activation[side] = set()
        return blocks
    if not analysis.quantized:
        return checkpoint
    wrapped = DequantizedCheckpoint(checkpoint, analysis, "float32", keep_activation=True)
    for name, weight in wrapped.logical.items():
        schemes[f"{side}:{name}"] = weight.scheme
    counts[side] = len(wrapped.logical)
    activation[side] = wrapped.activation
    return wrapped


def _lone_activation_scales(
    mine: dict[str, Entry], other: dict[str, Entry], activation: set[str]
) -> list[str]:
    """Lined-up names of one side's activation scales that the other side lacks: a
    full-precision model has none, so they are no difference, but they were not compared."""
    return [n for n, e in mine.items() if n not in other and e.name in activation]


def _verdict(r: DiffReport) -> str:
    if r.identical:
        how = "bit-identical" if not r.close else "equal"
        if r.differ_within:
            how += f" ({r.differ_within} within tolerance)"
        if r.dtype_changes:
            how += f", {r.dtype_changes} with a dtype change (ignored)"
        written_once = sum(a.written_once is not None for a in r.aliases)
        if written_once:
            how += f", {written_once} of them tied names one side stores once (aliases)"
        return f"IDENTICAL: {r.compared} entries {how}"
    # a dtype change whose values are within tolerance, or equal when none is given (a
    # lossless cast: bfloat16 to float32), is the one difference --ignore-dtype forgives
    dtype_only = [
        d
        for d in r.differences
        if d.status == "dtype"
        and (d.outside_tolerance == 0 or (d.outside_tolerance is None and d.differing == 0))
    ]
    if dtype_only and len(dtype_only) == len(r.differences) and not (r.only_a or r.only_b):
        values = "equal" if r.atol is None and r.rtol is None else "within tolerance"
        return (
            f"DIFFERENT: {len(dtype_only)} of {r.compared} entries changed dtype "
            f"(values {values}; --ignore-dtype accepts that)"
        )
    parts = []
    if r.differences:
        parts.append(f"{len(r.differences)} of {r.compared} entries differ")
    if r.metadata:
        keys = len(r.metadata)
        parts.append(
            f"{keys} metadata key{'s' if keys != 1 else ''} differ{'' if keys != 1 else 's'}"
        )
    if r.only_a:
        parts.append(f"{len(r.only_a)} only in A")
    if r.only_b:
        parts.append(f"{len(r.only_b)} only in B")
    return "DIFFERENT: " + ", ".join(parts)
