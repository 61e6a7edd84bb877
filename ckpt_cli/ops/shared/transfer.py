"""The streaming pipeline behind `convert` (and `reshard`'s shard-size mode).

Three steps, each usable on its own:

1. `plan_transfer` decides, from the source manifest alone, which entries go out under which
   names and dtypes (`--select`, `--filter/--filter-out`, `--rename`, `--dtype`), which are skipped
   and why (non-tensor entries for a tensor-only target), and which tensors share storage.
2. `copy_entries` moves the data one entry at a time into a format `Writer`: a raw byte range
   (`Checkpoint.iter_raw` -> `Writer.write_raw`, no deserialisation) when neither dtype nor
   layout changes and both sides store raw bytes, otherwise one tensor (`read_tensor`, cast,
   `write_tensor`). Peak memory is the largest tensor plus one copy block.
3. `write_checkpoint` runs the writer inside `output.staged_output`, checks the staged result
   with the target format's structural `check` hook, and only then publishes it with one rename.
"""

from __future__ import annotations

import os
import time
import typing
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ... import dtypes
from ...dist.command import CombinedProgress, RankShare, Workers, active, split_output
from ...errors import CkptError, FormatError, NotFoundError, UsageError
from ...formats import find_format, get_format
from ...formats.base import Checkpoint, Format, Source, WriteOptions, Writer
from ...formats.details import TorchDetails
from ...formats.names import DCP_DATA_SUFFIX, PICKLE_SUFFIX, WEIGHT_SUFFIXES, looks_like_index
from ...formats.safetensors.format import variant_beside_default
from ...models import Entry, FileInfo, KeyedEntry, Manifest, Record
from ...progress import NULL_PROGRESS, CountingProgress, Progress
from ...sources.model_files import EXTRA_SUFFIXES, MAX_EXTRA_BYTES
from ...sources.runs.records import is_checksum_manifest
from ...storage import LocalStorage
from ...storage.fileio import COPY_BLOCK, FileRange
from ...storage.uri import parse_location
from ..inspect import select as select_globs
from .selection import Selection, select_entries

if typing.TYPE_CHECKING:  # only the annotation: DEST may be a local path or an object store
    from ...sources.layouts.base import OpenedSource
    from ...storage.output import Destination

#: seconds to sleep after each entry; set only by the tests that kill a copy mid-way, so the
#: kill lands inside the copy deterministically without a multi-GB fixture
DELAY_ENV = "CKPT_TEST_COPY_DELAY"


class SkippedEntry(Record):
    """An entry of the source that was not written, and why."""

    name: str
    kind: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenEntry:
    """One entry written to the output.

    Attributes:
        name: the name in the output.
        source: the name in the source (differs after --select / --rename).
        kind: `tensor` or `object`.
        dtype / shape / nbytes: as written.
        how: `raw` (byte copy), `cast` (converted dtype), `tensor` (deserialised and
            re-serialised) or `object`.
    """

    # A slotted dataclass, not a pydantic model (#30), like `models.Chunk`: a report lists one
    # per entry written (100,000 for a model of many small tensors), and a model with its
    # `__dict__` and fields set cost ~1 KiB each. The report (a pydantic model) validates and
    # dumps it the same, with the same JSON schema.

    name: str
    source: str
    kind: str
    dtype: str | None = None
    shape: list[int] = field(default_factory=list)
    nbytes: int = 0
    how: str


@dataclass(slots=True)
class Item:
    """One entry to move: where it comes from, what it becomes, and the cast on the way."""

    # slotted: a plan holds one per entry (100,000 for a model of many small tensors, #30)

    source: Entry
    target: Entry
    cast: str | None = None
    #: the name the source stores the bytes under when `source` is a name it only records as
    #: an alias of that tensor (`metadata_aliases`); None: `source.name` itself
    stored_as: str | None = None

    @property
    def read_name(self) -> str:
        """The name to read from the source checkpoint."""
        return self.stored_as or self.source.name


@dataclass
class TransferPlan:
    """What `copy_entries` will do, decided from metadata alone.

    Attributes:
        items: entries to write, in output order.
        skipped: source entries left out, with the reason.
        tied: groups of output names whose source tensors share storage (first one kept).
        aliases: output name dropped as a duplicate -> the name it duplicates.
        stripped: the prefix `--select` stripped from the source names ("" when none).
    """

    items: list[Item]
    skipped: list[SkippedEntry] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    stripped: str = ""

    @property
    def total_bytes(self) -> int:
        """Bytes read from the source for all tensors of the plan."""
        return sum(i.source.nbytes for i in self.items if i.source.kind == "tensor")


def parse_renames(specs: Sequence[str] | None) -> list[tuple[str, str]]:
    """`['model.=', '=model.']` -> [('model.', ''), ('', 'model.')] (prefix renames).

    An empty OLD matches every name, so `=model.` adds a prefix; an empty NEW strips one.
    """
    out = []
    for spec in specs or ():
        if "=" not in spec or spec == "=":
            raise UsageError(
                f"--rename {spec!r} is not OLD=NEW",
                fix="Write the old and the new prefix, e.g. --rename 'model.=' (strip), "
                "--rename '=model.' (add) or --rename 'transformer.h.=model.layers.'.",
            )
        old, new = spec.split("=", 1)
        out.append((old, new))
    return out


def _renamed_in_place(entry: Entry, name: str, target: Entry) -> Entry:
    """`target`, the copy of `entry` (named `name` after --select) written as a renamed name,
    at the key path the rename gives it (`Entry.keys_renamed`): a nested source stays nested."""
    if target.name == name:
        return target
    path = entry.keys_renamed(name, target.name)
    return KeyedEntry.placed(target, path) if path else target


def rename(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """Apply the first rename whose old prefix starts `name`."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def unused_rename_rules(
    names: Iterable[str], renames: Sequence[tuple[str, str]], *, matched: str = "entry"
) -> list[str]:
    """One warning per `--rename` rule that renames none of `names` (first match wins, as
    `rename` applies them): a rule that has no effect is said, never silently ignored."""
    used: set[int] = set()
    for name in names:
        for n, (old, _new) in enumerate(renames):
            if name.startswith(old):
                used.add(n)
                break
    return [
        f"--rename {old}={new} matches no {matched} (names are matched after --select; see "
        "`ckpt inspect --list`)"
        for n, (old, new) in enumerate(renames)
        if n not in used
    ]


def top_level_keys(entries: Iterable[Entry]) -> list[str]:
    """The distinct first dotted components of entry names (for 'did you mean' messages)."""
    return sorted({e.name.split(".", 1)[0] for e in entries})


def tied_groups(manifest: Manifest, names: Iterable[str] | None = None) -> list[list[str]]:
    """Groups of tensor names that share stored bytes, from the manifest alone.

    The torch adapter records tensors that view the same storage (tied embeddings) in
    `TorchDetails.shared_tensors`; otherwise two entries are tied when they name the same file,
    byte offset, dtype and shape. safetensors never has ties (its reader refuses overlapping
    ranges). With `names`, groups are restricted to those names (and dropped below two).
    """
    wanted = set(names) if names is not None else None
    details = TorchDetails.of(manifest)
    raw: list[list[str]] = [list(g) for g in (details.shared_tensors if details else None) or []]
    by_place: dict[tuple[object, ...], list[str]] = {}
    for entry in manifest.entries:
        if entry.kind != "tensor" or entry.file is None or entry.offset is None:
            continue
        key = (entry.file, entry.offset, entry.dtype, tuple(entry.shape))
        by_place.setdefault(key, []).append(entry.name)
    raw.extend(by_place.values())
    groups = []
    for group in raw:
        kept = [n for n in group if wanted is None or n in wanted]
        if len(kept) > 1 and kept not in groups:  # raw torch ties are found both ways
            groups.append(kept)
    return groups


def nothing_to_dequantize(
    manifest: Manifest, flag: str = "--dequantize", packed: Mapping[str, str] | None = None
) -> CkptError:
    """The error for `--dequantize` of a checkpoint with no weight ckpt dequantizes: the
    modules of a packed scheme (`packed`: module -> scheme, `QuantAnalysis.packed_scheme`:
    GPTQ, AWQ, bitsandbytes) named as what ckpt does not dequantize (exit 4), else a usage
    error (exit 2). A format's own block quantization (GGUF) is dequantized, or refused by
    name, before this is asked (`Checkpoint.block_quantized`)."""
    if packed:
        module, scheme = next(iter(packed.items()))
        schemes = ", ".join(dict.fromkeys(packed.values()))
        more = f", and {len(packed) - 1} more" if len(packed) > 1 else ""
        return FormatError(
            f"{flag}: ckpt does not dequantize {schemes} weights, and the quantized weights "
            f"here are of it ({module!r}: {scheme}{more}); it dequantizes FP8, MXFP4, NVFP4, "
            "compressed-tensors INT4/INT8 weights and GGUF blocks only",
            path=manifest.location,
            fix="Dequantize with the quantizing library (for bitsandbytes, transformers' "
            "`model.dequantize()` then `save_pretrained`), or drop --dequantize: `convert` "
            "then keeps these weights and their scales as stored, `diff` compares them as "
            "stored.",
        )
    return UsageError(
        f"{flag}: no quantized weight found (FP8, MXFP4, MXFP6, NVFP4, INT4/INT8, GGUF blocks)",
        path=manifest.location,
        fix="Drop --dequantize; `ckpt inspect` shows what the checkpoint holds.",
    )


def metadata_aliases(
    manifest: Manifest, metadata: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Names the source stored once and recorded as another tensor in its string metadata
    (alias -> kept): safetensors cannot share storage, so ckpt's `convert`,
    `safetensors.torch.save_model` and huggingface_hub write `{"lm_head.weight":
    "transformer.wte.weight"}` into `__metadata__`. A key that names no tensor while its
    value does is such a record. `metadata` is the string metadata to read (one shard's),
    by default the manifest's."""
    metadata = manifest.metadata if metadata is None else metadata
    if not metadata:
        return {}
    tensors = {e.name for e in manifest.entries if e.kind == "tensor"}
    return {
        name: kept for name, kept in metadata.items() if name not in tensors and kept in tensors
    }


def is_step_counter(entry: Entry) -> bool:
    """Whether `entry` is an optimizer's step counter: a one-element floating tensor named
    `step` (torch's Adam, AdamW, Adagrad... keep `state[param]["step"]` so, in float32).

    A `--dtype` cast leaves it as stored: a counter in bfloat16 holds 1001 as 1000, and a
    resumed optimizer (which keeps the loaded counter's dtype) then adds 1 to 1000 forever.
    """
    return entry.name.rpartition(".")[2] == "step" and entry.numel == 1


def kept_counters_note(plan: TransferPlan, dtype: str, match_prefix: str = "") -> str | None:
    """What a `--dtype` cast left as stored because it is an optimizer step counter
    (`is_step_counter`), in a few words with the names; None when it left none. The user
    asked for every floating tensor in `dtype`: the tensors that are not are named, as
    `inspect --list` names them in the whole source (`match_prefix`: a component's folder, so
    each rank folder of a legacy Megatron-LM save says its own)."""
    kept = [
        item.source
        for item in plan.items
        if item.cast is None
        and item.source.dtype in dtypes.FLOATING
        and item.source.dtype != dtype
        and is_step_counter(item.source)
    ]
    if not kept:
        return None
    stored = ", ".join(sorted({e.dtype for e in kept if e.dtype is not None}))
    names = ", ".join(match_prefix + e.name for e in kept[:3]) + (", ..." if len(kept) > 3 else "")
    counters = "counter" if len(kept) == 1 else "counters"
    return (
        f"--dtype {dtype}: {len(kept)} optimizer step {counters} kept as stored ({stored}): "
        f"{names}. A counter in a 16-bit float stops counting (bfloat16 at 256), and a resumed "
        "optimizer keeps the dtype it loads"
    )


def _source_name_fix(
    candidates: list[Entry],
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    stripped: str,
    match_prefix: str,
) -> str:
    """The fix for `--filter` globs written for the names after `--select` (as `diff` takes
    them): here they match the source names, so the stripped prefix goes in front."""
    said = "The patterns match the source names, as `ckpt inspect --list` shows them, before "
    said += "--select strips its prefix"
    moved = [g if g.startswith(stripped) else stripped + g for g in include or ()]
    if (
        stripped
        and moved
        and select_globs(candidates, moved, list(exclude or []), prefix=match_prefix)
    ):
        return said + ": " + " ".join(f"--filter '{g}'" for g in moved) + "."
    return said + "; check them against `ckpt inspect --list`."


def plan_transfer(
    manifest: Manifest,
    *,
    select: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    renames: Sequence[tuple[str, str]] = (),
    dtype: str | None = None,
    keep_objects: bool = True,
    dedupe_tied: bool = False,
    opened: OpenedSource | None = None,
    match_prefix: str = "",
    restore_aliases: bool = False,
    left_out: Callable[[Entry], str | None] | None = None,
    with_scales: bool = False,
    uncast: Collection[str] = (),
) -> TransferPlan:
    """Decide what to write, from the manifest alone.

    Args:
        manifest: the source's manifest.
        select: keep only the sub-tree under this prefix, with the prefix stripped; a training
            component of `opened` by its layout's own prefix (`ops.selection`).
        include / exclude: globs on the source names (as `ckpt inspect` shows them).
        renames: prefix renames applied after `select`.
        dtype: cast floating tensors to this canonical dtype; others are untouched, and so are
            optimizer step counters (`is_step_counter`).
        keep_objects: the target can hold non-tensor entries; otherwise they are skipped.
        dedupe_tied: write tensors that share storage once (the others become aliases).
        opened: the opened source, whose layout says what `select` names.
        match_prefix: what `include` / `exclude` see before each name (`unet.`: a multi-folder
            model's component, matched by the names inspect shows of the whole folder).
        restore_aliases: the names the source records as aliases of a tensor it stored once
            (`metadata_aliases`) are written as entries of their own, read from that tensor
            and tied to it (`TransferPlan.tied`): a target that stores every name gets them
            back; one that dedupes tied tensors records them again (`aliases`).
        left_out: the source format's reason to leave an entry out whatever the target
            (`Format.skip_reason`: a GGUF quantized tensor), or None to keep it.
        with_scales: an `include` glob that picks a quantized weight picks its scales too
            (`quant.with_sidecars`, as `download --filter` does: a weight written without its
            `weight_scale_inv` loads off by the scale); an `exclude` glob naming one still wins.
        uncast: source names a `dtype` cast leaves as stored (a model family's float32
            routing state, `Architecture.float32`).
    """
    # a name the source recorded as an alias is an entry like any other here (selected,
    # filtered, renamed), read from the tensor it names: a target that stores every name gets
    # it back (shared with that tensor where it can: torch.save); one that dedupes records it
    recorded = metadata_aliases(manifest) if restore_aliases else {}
    candidates = manifest.entries
    kept_entries: dict[str, Entry] = {}
    if recorded:
        named = set(recorded.values())
        kept_entries = {e.name: e for e in manifest.entries if e.name in named}
        candidates = [
            *manifest.entries,
            *(kept_entries[kept].model_copy(update={"name": a}) for a, kept in recorded.items()),
        ]
    entries = select_globs(
        candidates, list(include or []), list(exclude or []), prefix=match_prefix
    )
    if with_scales and include:
        from ...quant import with_sidecars

        allowed = select_globs(candidates, [], list(exclude or []), prefix=match_prefix)
        entries = with_sidecars(entries, allowed)
    selection: Selection = select_entries(opened, entries, select, manifest)
    chosen = selection.pairs
    if select and not chosen and (include or exclude):
        unfiltered = select_entries(opened, candidates, select, manifest)
        if unfiltered.pairs:  # the prefix is there: the globs left nothing under it
            raise NotFoundError(
                f"the --filter/--filter-out patterns leave no entry under the prefix {select!r}",
                path=manifest.location,
                fix=_source_name_fix(
                    candidates, include, exclude, unfiltered.stripped, match_prefix
                ),
            )
    if select and not chosen:
        raise NotFoundError(
            f"no entry is under the prefix {select!r}",
            path=manifest.location,
            fix="Top-level keys here: " + ", ".join(top_level_keys(manifest.entries)) + ".",
        )
    if (include or exclude) and not chosen:
        raise NotFoundError(
            "the --filter/--filter-out patterns leave no entry to write",
            path=manifest.location,
            fix="Check the patterns against `ckpt inspect --list`.",
        )
    plan = TransferPlan(items=[], stripped=selection.stripped)
    seen: dict[str, str] = {}
    restored: dict[str, str] = {}  # output name of a recorded alias -> the source name it is
    for entry, name in chosen:
        new_name = rename(name, renames)
        if not new_name and name:  # a source's own empty name is a name like any other
            raise UsageError(
                f"--rename turns {entry.name!r} into an empty name",
                fix="Give each --rename rule a NEW prefix, or leave that entry out with "
                "--filter-out.",
            )
        if new_name in seen:
            raise UsageError(
                f"{entry.name!r} and {seen[new_name]!r} would both be written as {new_name!r}",
                fix="Adjust --select/--rename so every output name is distinct.",
            )
        seen[new_name] = entry.name
        why = left_out(entry) if left_out is not None else None
        if why:
            plan.skipped.append(SkippedEntry(name=entry.name, kind=entry.kind, reason=why))
            continue
        if entry.kind != "tensor":
            if not keep_objects:
                plan.skipped.append(
                    SkippedEntry(
                        name=entry.name,
                        kind=entry.kind,
                        reason="the target format holds tensors only",
                    )
                )
                continue
            target = entry.model_copy(
                update={"name": new_name, "file": None, "offset": None, "chunks": None}
            )
            plan.items.append(Item(entry, _renamed_in_place(entry, name, target)))
            continue
        cast = None
        target_dtype = entry.dtype
        assert target_dtype is not None
        target_shape = list(entry.shape)
        if (
            dtype
            and entry.dtype in dtypes.FLOATING
            and entry.dtype != dtype
            and not is_step_counter(entry)
            and entry.name not in uncast
        ):
            cast, target_dtype = dtype, dtype
        elif keep_objects and target_dtype in dtypes.SUB_BYTE:
            # a torch-native target holds what torch holds: F4 as packed pairs, F6 not at all
            layout = dtypes.torch_layout(target_dtype, target_shape)
            if layout is None:
                plan.skipped.append(
                    SkippedEntry(
                        name=entry.name,
                        kind=entry.kind,
                        reason=f"torch has no dtype for {target_dtype}{target_shape}; "
                        "convert --to safetensors keeps it",
                    )
                )
                continue
            target_dtype, target_shape = layout
        # a copy keeps adapter-specific fields (torch key paths, so nesting survives a
        # torch -> torch conversion); where the bytes live is for the writer to decide
        target = entry.model_copy(
            update={
                "name": new_name,
                "dtype": target_dtype,
                "shape": target_shape,
                "nbytes": entry.nbytes
                if cast is None
                else dtypes.numel(entry.shape) * dtypes.itemsize(target_dtype),
                "file": None,
                "offset": None,
                "chunks": None,
            }
        )
        kept = recorded.get(entry.name)
        if kept is not None:
            restored[new_name] = kept
        plan.items.append(Item(entry, _renamed_in_place(entry, name, target), cast, stored_as=kept))
    renamed = {item.source.name: item.target.name for item in plan.items}
    for group in tied_groups(manifest, renamed):
        plan.tied.append([renamed[n] for n in group])
    for alias, kept in restored.items():
        kept_name = renamed.get(kept)
        if kept_name is None:
            continue  # the tensor it names is not written: the alias is written as itself
        groups = [g for g in plan.tied if kept_name in g]
        if groups:
            groups[0].append(alias)
        else:
            plan.tied.append([kept_name, alias])
    if dedupe_tied:
        for names in plan.tied:
            for alias in names[1:]:
                plan.aliases[alias] = names[0]
    if plan.aliases:
        plan.items = [i for i in plan.items if i.target.name not in plan.aliases]
    return plan


def _delay() -> float:
    try:
        return float(os.environ.get(DELAY_ENV, "0") or 0)
    except ValueError:
        return 0.0


def raw_blocks(
    checkpoint: Checkpoint, name: str, block: int = COPY_BLOCK
) -> Iterator[bytes | memoryview]:
    """The raw bytes of a raw-stored tensor, in blocks; each block is valid until the next.

    Bytes in local files (`Checkpoint.local_ranges`: a safetensors range, the tensor bytes
    inside DCP torch_save blobs) are read with `os.preadv` into one reused buffer: no
    allocation and no fresh page faults per block, which is what made the plain `pread` loop
    lose to `cp`. Remote storage falls back to `Checkpoint.iter_raw`.
    """
    segments = checkpoint.local_ranges(name)
    if segments is None:
        yield from checkpoint.iter_raw(name, block)
        return
    yield from FileRange.of(segments, block=block)


def _counted(blocks: Iterable[bytes | memoryview], progress: Progress) -> Iterator[bytes]:
    # writers only pass blocks to file.write, which takes any buffer; typed as bytes for them
    for block in cast(Iterable[bytes], blocks):
        yield block
        progress.advance(len(block))


def _partial_chunks(writer: Writer, name: str) -> list[tuple[int, list[int], list[int]]] | None:
    """The chunks of `name` a restricted chunk writer (`Writer.chunk_writes`) writes, when it
    writes only some."""
    if not writer.chunk_writes:
        return None
    chunks = writer.chunks_of(name)
    mine = [(i, c.offsets, c.sizes) for i, c in enumerate(chunks) if writer.owns(c.file)]
    return mine if len(mine) < len(chunks) else None


def copies_raw(checkpoint: Checkpoint, item: Item, accepts_raw: bool) -> bool:
    """Whether `copy_entries` copies `item` as raw bytes (no tensor built): no cast, a writer
    that `accepts_raw`, and a source that serves the entry's raw bytes."""
    return item.cast is None and accepts_raw and checkpoint.serves_raw(item.read_name)


def planned_hows(
    checkpoint: Checkpoint, fmt: type[Format], plan: TransferPlan, options: WriteOptions
) -> list[str]:
    """How `copy_entries` would write each item of `plan` into a `fmt` writer built with
    `options` (`WrittenEntry.how`, in plan order), for a dry run to report what the real run
    does: a dry run that said `tensor` and 0 raw copies where the run copies raw bytes told a
    user to expect a deserialising copy.

    The writer is built and asked, never written to: writers open their files on first use,
    so nothing is created (the staging folder named does not exist)."""
    writer = fmt.writer(Path(os.devnull) / "dry-run", [i.target for i in plan.items], options)
    accepts = writer.accepts_raw
    return [
        "object"
        if item.target.kind != "tensor"
        else "raw"
        if copies_raw(checkpoint, item, accepts)
        else "cast"
        if item.cast
        else "tensor"
        for item in plan.items
    ]


def copy_entries(
    checkpoint: Checkpoint,
    writer: Writer,
    items: list[Item],
    progress: Progress = NULL_PROGRESS,
) -> list[str]:
    """Stream every item from `checkpoint` into `writer`, in order, one entry at a time; how
    each was written (`WrittenEntry.how`), in `items` order.

    Raw byte copies are used whenever the entry is stored raw, no cast is asked for and the
    writer accepts raw bytes; everything else goes through one tensor in memory. A writer
    restricted to some of its files (a rank of a split run) that holds only some chunks of a
    tensor gets just those boxes (`read_slice`); `how` still says what a whole copy would be.
    """
    delay = _delay()
    # one word per entry: the records are built from the plan once the output is checked,
    # not held (with a dump of each) through the check's parse of the output (#30)
    written: list[str] = []
    for item in items:
        source, target = item.source, item.target
        raw = copies_raw(checkpoint, item, writer.accepts_raw)
        partial = _partial_chunks(writer, target.name) if target.kind == "tensor" else None
        if partial is not None:
            from ...tensors import torch_dtype

            for index, offsets, sizes in partial:
                piece = checkpoint.read_slice(item.read_name, offsets, sizes)
                if item.cast is not None:
                    piece = piece.to(torch_dtype(item.cast))
                writer.write_chunk(target.name, index, piece)
                # counted in source bytes, like the whole-entry paths below
                progress.advance(dtypes.numel(sizes) * dtypes.itemsize(source.dtype or "uint8"))
                del piece
            how = "raw" if raw else "cast" if item.cast else "tensor"
        elif target.kind != "tensor":
            writer.write_object(target.name, checkpoint.read_object(item.read_name))
            how = "object"
        elif raw:
            segments = checkpoint.local_ranges(item.read_name)
            if segments is not None:
                # writers may copy local ranges in the kernel (FileRange.copy_to)
                blocks: Iterator[bytes] = FileRange.of(segments, on_progress=progress.advance)
            else:
                blocks = _counted(raw_blocks(checkpoint, item.read_name), progress)
            writer.write_raw(target.name, blocks)
            how = "raw"
        else:
            tensor = checkpoint.read_tensor(item.read_name)
            if item.cast is not None:
                from ...tensors import torch_dtype

                tensor = tensor.to(torch_dtype(item.cast))
            writer.write_tensor(target.name, tensor)
            del tensor
            progress.advance(source.nbytes)
            how = "cast" if item.cast else "tensor"
        written.append(how)
        if delay:
            time.sleep(delay)
    return written


def written_entry(item: Item, how: str, origins: dict[str, str] | None = None) -> WrittenEntry:
    """The record of `item` written `how` (`WrittenEntry.how`); `origins` maps a source name
    to the names the report gives instead (a naming's tensors built from several)."""
    target = item.target
    source = item.source.name
    return WrittenEntry(
        name=target.name,
        source=origins.get(source, source) if origins else source,
        kind=target.kind,
        dtype=target.dtype,
        shape=target.shape,  # the plan's own list, never changed: shared, not copied
        nbytes=target.nbytes,
        how=how,
    )


def _records(
    spent: list[Item], hows: list[str], origins: dict[str, str] | None
) -> Iterator[WrittenEntry]:
    """The record of each spent item (`written_entry`), in order, `spent` emptied as they are
    made: each item (and a source entry no one else holds) goes as its record comes (#30)."""
    spent.reverse()
    for how in hows:
        yield written_entry(spent.pop(), how, origins)
    if spent:
        raise RuntimeError(f"{len(spent)} planned entries were not written")


def check_staged(format_name: str, staging: Path, single_file: bool) -> None:
    """Run the target format's structural check on the staged output; FormatError if it fails."""
    fmt = get_format(format_name)
    files = [p.name for p in staging.iterdir()] if single_file else []
    source = Source(
        location=parse_location(str(staging)),
        storage=LocalStorage(staging),
        target=files[0] if single_file and len(files) == 1 else None,
    )
    # warnings (a file torch.load would refuse by default, written as the source holds it)
    # are the reader's to hear from verify; only errors make an output wrong
    problems = [p for p in fmt.check(source) if p.severity == "error"]
    if problems:
        details = "; ".join(p.message for p in problems[:5])
        raise FormatError(
            f"the written {format_name} output failed its structural check ({details})",
            path=staging,
            fix="Nothing was published. This is a bug in ckpt; please report it.",
        )


#: weight and training-state files: never extras
CARRIED_NEVER = (*WEIGHT_SUFFIXES, DCP_DATA_SUFFIX, PICKLE_SUFFIX)


def extra_files(checkpoint: Checkpoint) -> list[str]:
    """The non-weight files beside a checkpoint's weights: `config.json`,
    `generation_config.json`, tokenizer files, README, custom code (top level only).

    Files the checkpoint reads entries from (weights, indexes, JSON components such as
    `trainer_state.json`) are not extras; nor is anything when the source is one file.
    """
    source = checkpoint.source
    if source.target is not None:
        return []
    fmt = find_format(checkpoint.manifest.format)
    # a layout's own metadata (Megatron's `metadata.json`) travels inside the output's
    # entries: copied, it would make a plain DCP output look like a Megatron save without its
    # `common.pt` (`Format.layout_files`)
    used = (
        fmt.entry_files(checkpoint.manifest)
        if fmt is not None
        else {f.path for f in checkpoint.manifest.files if f.entries}
    )
    out = []
    for rel, size in sorted(source.files.items()):
        name = rel.rsplit("/", 1)[-1]
        if "/" in rel or rel in used or name.startswith("."):
            continue
        if rel.endswith(CARRIED_NEVER) or _is_weight_index(name) or is_checksum_manifest(rel):
            continue
        if rel.endswith(EXTRA_SUFFIXES) and (size or 0) <= MAX_EXTRA_BYTES:
            out.append(rel)
    return out


def account_files(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    carried: Sequence[str],
    *,
    single_file: bool,
    listed: dict[str, str] | None = None,
) -> tuple[list[str], list[SkippedEntry]]:
    """Every file of the source, accounted for: (read, skipped).

    `read` are the files the output's entries come from, with the metadata that found them
    (an index, a DCP `.metadata`) of every component an entry was written from; `carried` were
    copied verbatim; every other file is one `SkippedEntry` of kind `file` saying why it is
    not in the output. Nothing of a source vanishes without a line in the report.
    `listed`: file -> why a layout lists it without loading it (`training_args.bin`).
    """
    from ...sources.layouts.composite import CompositeCheckpoint

    source = checkpoint.source
    names = [source.target] if source.target is not None else sorted(source.files)
    written = [item.source for item in plan.items]
    read: set[str] = set()
    indexes: dict[str, str] = {}  # the metadata file of a component not written -> component
    for entry in written:
        if entry.name in checkpoint.manifest.by_name:
            read.update(checkpoint.files_of(entry.name))
        else:
            read.update({entry.file} if entry.file else set())
            read.update(chunk.file for chunk in entry.chunks or [] if chunk.file)
    if source.target is not None:
        # one file: read into the output unless every entry it holds was left out
        read = {source.target} if written or not checkpoint.manifest.entries else set()
    elif isinstance(checkpoint, CompositeCheckpoint):
        for comp, part in checkpoint.components.items():
            sub = checkpoint.subfolders.get(comp, "")
            index = {f"{sub}{f.path}" for f in part.manifest.files if not f.entries}
            if any(e.name == comp or e.name.startswith(f"{comp}.") for e in written):
                read.update(index)
            else:
                # a component's own metadata (a DCP `.metadata`, an index) left with it
                indexes.update(dict.fromkeys(index, comp))
    elif written:
        other = {f.path for f in checkpoint.manifest.files if f.entries}
        read.update(f.path for f in checkpoint.manifest.files if f.path not in other)
    held = {entry.file for entry in checkpoint.manifest.entries if entry.file}
    left_out = {s.name for s in plan.skipped}
    # a Trainer's `output_dir`: the run's saves beside the final model, each a checkpoint of
    # its own (the run-name rules are imported only for a folder with sub-folders)
    saves: set[str] = set()
    if source.target is None and any("/" in rel for rel in names):
        from ...sources.runs.naming import nested_saves

        saves = set(nested_saves(names))
    skipped: list[SkippedEntry] = []
    carried_set = set(carried)
    for rel in names:
        if rel in read or rel in carried_set:
            continue
        base = rel.rsplit("/", 1)[-1]
        if listed and rel in listed:
            why = listed[rel]
        elif rel in held:
            entries = [e.name for e in checkpoint.manifest.entries if e.file == rel]
            why = (
                "none of its entries was selected"
                if not all(e in left_out for e in entries)
                else "its entries are listed as skipped"
            )
        elif rel in indexes:
            why = f"the index of the {indexes[rel]} component, none of whose entries was selected"
        elif base.startswith("."):
            why = "a hidden file: not part of the checkpoint"
        elif (variant := variant_beside_default(rel, set(names))) is not None:
            why = (
                f"the {variant} variant of the default weights beside it (a library loads one "
                "or the other): convert that file on its own to keep it"
            )
        elif is_checksum_manifest(rel):
            why = (
                "the source's checksum manifest, of the source's files: `ckpt verify DEST "
                "--write-manifest` records the output's"
            )
        elif single_file and rel.endswith(EXTRA_SUFFIXES):
            why = "a single-file DEST holds entries only: convert to a folder to carry it"
        elif rel.endswith(EXTRA_SUFFIXES) and (source.files.get(rel) or 0) > MAX_EXTRA_BYTES:
            why = f"larger than the {MAX_EXTRA_BYTES >> 20} MiB carried beside the weights"
        elif "/" in rel and any(r.startswith(f"{rel.rpartition('/')[0]}/") for r in read):
            # a model folder read as one component (a save hook's `unet/`): its config
            # travels with that model converted alone
            folder = rel.rpartition("/")[0]
            why = (
                f"the companion of the {folder}/ weights read into the output, whose entries "
                f"are renamed {folder}.*: `--select {folder}` writes that model as a folder "
                "of its own, with it"
            )
        elif "/" in rel and (top := rel.split("/", 1)[0]) in saves:
            where = f"{source.location.raw.rstrip('/')}/{top}"
            why = (
                "a save of the run beside the model at the root, a checkpoint of its own: "
                f"`ckpt convert {where} DEST` converts it"
            )
        elif "/" in rel and not single_file:
            why = "in a subfolder ckpt does not read: copy it by hand if the output needs it"
        else:
            why = (
                "not a file of the checkpoint ckpt reads, nor a companion it carries "
                "(config, tokenizer...): copy it by hand if the output needs it"
            )
        skipped.append(SkippedEntry(name=rel, kind="file", reason=why))
    return sorted(read & set(names)), skipped


def left_out_components(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    read: Iterable[str],
    opened: OpenedSource,
    select: str | None,
    why: str,
) -> list[SkippedEntry]:
    """The training state a component `--select` left behind in files read into the output:
    one `SkippedEntry` of kind `component` per top-level key (`optimizer`, `lr_scheduler`...).

    A torchtitan save keeps its optimizer in the `.distcp` files of the weights, a Lightning
    file its `optimizer_states` beside `state_dict`: those files are read, so `account_files`
    lists none of them, and what the selection left out would vanish from the report. A
    component in files of its own (a Trainer's `optimizer.pt`) is listed by its file there.
    `why` says how the selection came about (`--to hf`, `--select model`).
    """
    if opened.training is None or not select:
        return []
    manifest = checkpoint.manifest
    selection = select_entries(opened, manifest.entries, select, manifest)
    if selection.component is None:
        return []
    taken = {entry.name for entry, _ in selection.pairs}
    taken.update(s.name for s in plan.skipped)
    read_files = set(read)
    one_file = checkpoint.source.target is not None
    counts: dict[str, int] = {}
    for entry in manifest.entries:
        if entry.name in taken:
            continue
        files = checkpoint.files_of(entry.name)
        # an entry with no file of its own lives in metadata that was read (DCP's objects)
        if one_file or not files or files & read_files:
            top = entry.name.split(".", 1)[0]
            counts[top] = counts.get(top, 0) + 1
    return [
        SkippedEntry(
            name=top,
            kind="component",
            reason=f"training state: {why}",
        )
        for top in counts
    ]


def _is_weight_index(name: str) -> bool:
    """A weight index: `*.index.json`, or diffusers' variant spelling `*.index.fp16.json`.

    An index is rewritten by the writer for the new shards; the source's own never travels.
    """
    return looks_like_index(name)


def copy_files(checkpoint: Checkpoint, rels: Sequence[str], staging: Path) -> None:
    """Copy source files `rels` (relative, already confined to the source) into `staging`."""
    from ...storage import safe_relpath

    for rel in rels:
        target = staging / safe_relpath(rel, source=checkpoint.manifest.location)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(checkpoint.source.storage.read_all(rel))


#: what `check_source_unchanged` says of a command that writes an output
NOTHING_PUBLISHED = "the output could mix two versions of the checkpoint; nothing was published"


def check_source_unchanged(checkpoint: Checkpoint, consequence: str = NOTHING_PUBLISHED) -> None:
    """Refuse a result read from source files another process rewrote or replaced while they
    were read (a training job saving into the folder being converted or compared): it could
    hold tensors of two saves. FormatError naming the first such file and `consequence`."""
    changed = checkpoint.storage.changed_since_read()
    if changed:
        others = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise FormatError(
            f"changed while ckpt read it{others}: another process rewrote or replaced it, so "
            f"{consequence}",
            path=changed[0],
            fix="Run the command again once the job writing the checkpoint has finished "
            "(`ckpt latest RUN_DIR` names the newest complete save).",
        )


def write_checkpoint(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    dest: Destination,
    to: str,
    options: WriteOptions,
    *,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    workers: Workers | None = None,
    shares: list[RankShare] | None = None,
    extras: Sequence[str] = (),
    origins: dict[str, str] | None = None,
    release_source: bool = False,
) -> tuple[list[FileInfo], list[WrittenEntry]]:
    """Write `plan` from `checkpoint` as format `to` at `dest`, atomically.

    The writer streams into a hidden sibling of `dest`; the result is checked with the format's
    `check` hook and published with one rename only when it passes. Under torchrun (`workers`,
    by default the active ones) every rank writes the data files `Workers.assign` gives it and
    rank 0 writes the index / `.metadata`, checks and publishes (`distributed.split_output`);
    `shares`, when given, receives what each rank did. Returns the files written (relative to
    `dest`, or `dest`'s own name for a single file) and the entries written. `extras` are
    source files (`extra_files`) copied unchanged into the output folder before it is checked.
    `origins`: the source names the records give (`written_entry`).

    The plan is spent: once the data is written, its items are let go (`plan.items` is emptied,
    the records returned describe what was written) before the check reads the output back, so
    the plan's per-entry targets are not alive at the check's peak (#30). In one process that
    is as soon as the data is copied, before the writer's index or `.metadata`; with
    `release_source` the source's entries go then too (`Checkpoint.release_entries`: the
    caller reads none afterwards), so they are not alive beside the output check's parse.
    """
    fmt = get_format(to)
    if not fmt.writable:
        raise UsageError(
            f"writing {to} is not supported in this version",
            fix="Write one of the formats `ckpt convert --help` lists for --to.",
        )
    workers = workers or active()
    writers: list[Writer] = []

    def work(staging: Path) -> dict[str, Any]:
        writer = fmt.writer(staging, [item.target for item in plan.items], options)
        writers.append(writer)
        items = plan.items
        started = time.perf_counter()
        mine: list[str] = []
        if workers.distributed:
            if not writer.splittable:
                raise UsageError(
                    f"writing {to} cannot be split across ranks",
                    fix="Run this conversion as one process (without torchrun).",
                )
            sizes = writer.output_files()
            names = list(sizes)
            mine = [names[i] for i in workers.mine([sizes[n] for n in names])]
            writer.restrict(mine)
            items = [item for item in plan.items if writer.wants(item.target.name)]
        total = sum(i.source.nbytes for i in items if i.source.kind == "tensor")
        # every rank counts its share; rank 0 draws all of them (CombinedProgress)
        counted = CountingProgress(CombinedProgress(progress, workers, total=plan.total_bytes))
        counted.start(total, f"{to} → {dest.name}")
        try:
            done = copy_entries(checkpoint, writer, items, counted)
            workers.test_failure_point("the copy")
            if not workers.distributed:
                # the records are all the report needs of the plan (and of the source's
                # entries): both go before the writer's `.metadata` and the check (#30)
                spent, plan.items, items = plan.items, [], []
                if release_source:
                    checkpoint.release_entries()
                records.extend(_records(spent, done, origins))
            part = writer.finish_part() if workers.distributed else None
            files = None if part is not None else writer.finish()
        finally:
            counted.finish()
        check_source_unchanged(checkpoint)
        share = RankShare(
            rank=workers.rank, files=mine, bytes=counted.done, seconds=time.perf_counter() - started
        )
        return {
            "share": share.model_dump(mode="json"),
            "part": part,
            "files": None if files is None else [f.model_dump(mode="json") for f in files],
            # one process: how each item of the plan was written, in plan order
            "written": [[item.target.name, how] for item, how in zip(items, done, strict=True)]
            if workers.distributed
            else [],
        }

    def commit(staging: Path, parts: list[dict[str, Any]]) -> dict[str, Any]:
        if workers.distributed:
            files = writers[0].commit([p["part"] for p in parts])
        else:
            files = [FileInfo.model_validate(f) for f in parts[0]["files"]]
        # the writer's per-entry layout is spent: free it before the check reads the output (#20)
        writers.clear()
        # the layout's small non-weight files (adapter_config.json...), published with the weights
        companions = options.companions
        for rel, data in companions.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            files.append(FileInfo(path=rel, size=len(data), entries=0))
        if extras and not options.single_file:
            copy_files(checkpoint, [rel for rel in extras if rel not in companions], staging)
            check_source_unchanged(checkpoint)
        order: list[list[Any]] = []
        if workers.distributed:
            # an entry split over several ranks' files is reported once, in plan order
            hows: dict[str, str] = {}
            for p in parts:
                for name, how in p["written"]:
                    hows.setdefault(name, how)
            order = [
                [index, hows[item.target.name]]
                for index, item in enumerate(plan.items)
                if item.target.name in hows
            ]
            del hows
            records.extend(written_entry(plan.items[i], how, origins) for i, how in order)
            # the plan is spent: its targets are let go before the check reads the output (#30)
            plan.items = []
        check_staged(to, staging, options.single_file)
        return {
            "files": [f.model_dump(mode="json") for f in files],
            # the other ranks build their records from their own plans
            "written": order,
            "shares": [p["share"] for p in parts] if workers.distributed else [],
        }

    records: list[WrittenEntry] = []  # built by `work` (one process) or `commit` (rank 0)
    result = split_output(
        workers, dest, force=force, single_file=options.single_file, work=work, commit=commit
    )
    files = [FileInfo.model_validate(f) for f in result["files"]]
    written = records
    if not workers.leader:
        written = [written_entry(plan.items[i], how, origins) for i, how in result["written"]]
        plan.items = []
    if shares is not None:
        shares.extend(RankShare.model_validate(s) for s in result["shares"])
    if options.single_file and files:
        files = [files[0].model_copy(update={"path": dest.name})]
    return files, written
