"""`reshard`: the same checkpoint cut for another shard size or another world size.

Two modes:

- **shard size** (`max_shard_size`; safetensors, and sharded torch.save where its adapter
  writes): tensors regrouped in order into shards of at most that size, Hugging Face names
  and index, `__metadata__` kept; raw bytes are copied without deserialising (`convert`'s
  pipeline, `ops.transfer`).
- **world size** (`world_size`; DCP): every tensor re-cut as N ranks would have saved it,
  chunk r in `__r_0.distcp`, per-rank training state carried, kept, dropped or replicated as
  asked (`ops.reshard_world`); a training folder (Trainer / accelerate, FSDP or DDP) as a
  whole: each DCP sub-folder re-cut, per-rank files under the same policy, the rest copied
  (`ops.reshard_folder`).

Which mode applies is the source format's fact (`Format.shards_by_size`,
`Format.shards_by_rank`), never its name; the report model is in `ops.reshard_report`.

Output is staged and published atomically after a structural check (the format's `check`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...dist.command import RankShare
from ...errors import UsageError
from ...formats import (
    HF_WEIGHTS,
    find_format,
    format_of_file,
    get_format,
    holds_only_nested_checkpoints,
    resolve_source,
    serializations,
)
from ...formats.base import Checkpoint, Source, WriteOptions
from ...formats.details import IndexedDetails
from ...formats.names import (
    INDEX_SUFFIX,
    SAFETENSORS_INDEX_SUFFIX,
    TORCH_INDEX_SUFFIX,
    is_single_file_weights,
)
from ...models import FileInfo
from ...progress import NULL_PROGRESS, Progress
from ...sources.layouts import folder_layout_of
from ...sources.layouts.base import Layout, OpenedSource
from ...sources.opening import open_plain
from ...sources.runs.records import is_checksum_manifest
from ...storage.output import Destination, check_destination
from ..convert.plan import check_one_file_naming, guard_paths, local_dest, planned_files
from ..shared.selection import lost_file_warnings, refuse_lost_files
from ..shared.transfer import (
    SkippedEntry,
    TransferPlan,
    account_files,
    plan_transfer,
    planned_hows,
    write_checkpoint,
)
from .folder import reshard_folder
from .report import RankStateAction, RankStateEntry, ReshardReport
from .request import ReshardRequest
from .world import (
    RANK_STATE_CHOICES,
    find_rank_state,
    plan_world_size,
    reshard_world_size,
    source_world_size,
)

__all__ = [
    "RankStateAction",
    "RankStateEntry",
    "ReshardReport",
    "ReshardRequest",
    "find_rank_state",
    "plan_world_size",
    "reshard_shard_size",
    "reshard_with",
    "reshard_world_size",
    "run_reshard",
    "source_world_size",
]


def reshard_shard_size(
    src: str | Source,
    dest: str,
    max_shard_size: int,
    *,
    format: str | None = None,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
) -> ReshardReport:
    """Regroup `src`'s entries, in order, into shards of at most `max_shard_size` bytes.

    Runs `convert`'s pipeline (`ops.transfer`) with the source's own format as the target:
    raw byte copies for safetensors; torch.save shards hold one shard in memory at a time.
    In a training folder (Trainer `checkpoint-N/`, accelerate `save_state`) the weights are
    resharded and every other component (optimizer, scheduler, RNG, trainer state) is copied
    unchanged, so the output resumes the run as the source did. `src` may be resolved already
    (`resolve_source`): it is resolved once and read through that.
    """
    request = ReshardRequest(
        max_shard_size=max_shard_size,
        format=format,
        force=force,
        dry_run=dry_run,
        extras=extras,
    )
    source = src if isinstance(src, Source) else None
    text = source.location.raw if source is not None else str(src)
    out = _checked_dest(text, dest, request.force)
    return regroup(source or resolve_source(text), out, request, progress)


def _checked_dest(src: str, dest: str, force: bool) -> Destination:
    """DEST as a local path, refused (before any work) where it is in or over SRC, or exists
    without `force`."""
    out = local_dest(dest)
    guard_paths(src, out)  # as convert: a DEST in (or over) the source is refused
    check_destination(out.absolute(), force)
    return out


def regroup(
    source: Source, out: Destination, request: ReshardRequest, progress: Progress = NULL_PROGRESS
) -> ReshardReport:
    """The shard-size reshard of `source` into `out` (checked already) as `request` says
    (its `max_shard_size` in bytes)."""
    max_shard_size, format = request.max_shard_size, request.format
    force, dry_run, extras = request.force, request.dry_run, request.extras
    assert isinstance(max_shard_size, int)
    text = source.location.raw
    opened = _training_layout(source, format)
    with open_plain(_weights_source(source, opened), format) as checkpoint:
        carried, extra = _carried_files(source, checkpoint, opened)
        left_out = [] if extras else extra
        if not extras:
            extra = []
        manifest = checkpoint.manifest
        fmt = get_format(manifest.format)
        if not fmt.shards_by_size or not fmt.writable:
            raise UsageError(
                f"--max-shard-size regroups safetensors or torch.save shards; "
                f"this is a {manifest.format} checkpoint",
                path=text,
                fix="For DCP, change the world size with --world-size N.",
            )
        plan = plan_transfer(manifest, keep_objects=fmt.holds_objects)
        skipped = _skipped_files(checkpoint, plan, [*carried, *extra], left_out, opened)
        options = WriteOptions(
            max_shard_size=max_shard_size,
            metadata=fmt.resharded_metadata(manifest.metadata),
            basename=_basename(checkpoint),
        )
        if format is None:
            # keep the source library's file names and companions (PEFT, diffusers variants),
            # in a dry run too; never a cut that library could not load
            from ...sources.layouts.model_folders import apply_naming

            convention = apply_naming(source, manifest.format, options)
            check_one_file_naming(convention, plan, options, text, size_optional=False)
        # the files copied beside the weights, listed after them by the dry run and the run
        copied = [FileInfo(path=rel, size=source.files.get(rel)) for rel in [*carried, *extra]]
        if dry_run:
            tensors = [i.target for i in plan.items if i.target.kind == "tensor"]
            return ReshardReport(
                carried=carried,
                extras=extra,
                mode="shard-size",
                source=manifest.location,
                destination=str(out),
                format=manifest.format,
                files=planned_files(fmt, plan, out, options) + copied,
                tensors=len(tensors),
                objects=len(plan.items) - len(tensors),
                tensor_bytes=sum(e.nbytes for e in tensors),
                raw_copy=planned_hows(checkpoint, fmt, plan, options).count("raw"),
                max_shard_size=max_shard_size,
                verified=False,
                dry_run=True,
                skipped=skipped,
                warnings=checkpoint.metadata_left_out(options.metadata),
            )
        from ...quant import analyse_checkpoint
        from ..convert.plan import keep_quantized

        # a quantized weight and its scales are never split across shards
        analysis = analyse_checkpoint(manifest, checkpoint.storage)
        if analysis.quantized or analysis.packed:
            keep_quantized(plan, analysis)
            options.together = analysis.together()
        shares: list[RankShare] = []
        files, written = write_checkpoint(
            checkpoint,
            plan,
            out,
            manifest.format,
            options,
            force=force,
            progress=progress,
            shares=shares,
            extras=[*carried, *extra],
        )
        return ReshardReport(
            carried=carried,
            extras=extra,
            mode="shard-size",
            source=manifest.location,
            destination=str(out),
            format=manifest.format,
            # a naming's companions (a PEFT adapter's config and card) the writer listed already
            files=files + [f for f in copied if f.path not in {w.path for w in files}],
            tensors=sum(1 for w in written if w.kind == "tensor"),
            objects=sum(1 for w in written if w.kind != "tensor"),
            tensor_bytes=sum(w.nbytes for w in written if w.kind == "tensor"),
            raw_copy=sum(1 for w in written if w.how == "raw"),
            max_shard_size=max_shard_size,
            verified=True,
            ranks=shares,
            skipped=skipped,
            warnings=checkpoint.metadata_left_out(options.metadata),
        )


def _training_layout(source: Source, format: str | None) -> OpenedSource | None:
    """The training layout of a folder SRC (None for a file, a plain folder, or `-f`), refused
    where its framework could not load the weights cut by size (accelerate)."""
    from ...sources.layouts import folder_layout_named
    from ...sources.opening import recognise_layout

    if source.target is not None or format is not None:
        return None
    opened = recognise_layout(source)
    if opened is None or opened.training is None:
        return opened
    layout = folder_layout_named(opened.training.layout)
    if layout is not None and not layout.loads_size_shards:
        opened.checkpoint.close()
        from ...sources.layouts.base import is_model_component

        # the files it holds the weights in, as saved (one per model, or per model and rank:
        # `pytorch_model_fsdp_0_rank1.bin`), not a name it might have used
        weights = sorted(f for c, (f, _) in opened.parts.items() if is_model_component(c))
        named = ", ".join(f"`{f}`" for f in weights[:2]) + (
            f" and {len(weights) - 2} more" if len(weights) > 2 else ""
        )
        named = f" ({named} here)" if weights else ""
        per_rank = " and rank" if any("_rank" in c for c in opened.parts) else ""
        raise UsageError(
            f"--max-shard-size would cut the weights of this {layout.name} save into shards, "
            f"and {layout.name} loads one file per model{per_rank}{named}: the copy "
            "would not resume",
            path=source.location.raw,
            fix=(
                # each rank's part under its own name: no `model` to select, no world size to
                # re-cut (`--world-size` refuses per-rank files)
                "Cut the whole folder by size with `ckpt convert SRC DEST --to torch "
                "--max-shard-size SIZE` (every rank's part kept under its own name), or load it "
                "at its own world size and save it again as DCP (`use_dcp=True`), which "
                "--world-size re-cuts."
                if per_rank
                else "Export the weights cut by size with `ckpt convert SRC DEST --to "
                "safetensors --select model --max-shard-size SIZE`, or reshard for another "
                "world size with --world-size N."
            ),
        )
    return opened


def _skipped_files(
    checkpoint: Checkpoint,
    plan: TransferPlan,
    copied: list[str],
    left_out: list[str],
    opened: OpenedSource | None,
) -> list[SkippedEntry]:
    """Every file of the source neither resharded nor copied, with why (`account_files`, as
    `convert` reports them): a second adapter in a subfolder, a `.bin` beside the
    `.safetensors`, the source's checksum manifest. They used to vanish without a line."""
    listed = opened.listed_files if opened is not None else None
    _, skipped = account_files(
        checkpoint, plan, [*copied, *left_out], single_file=False, listed=listed
    )
    return [
        SkippedEntry(name=r, kind="file", reason="left out (--no-extras)") for r in left_out
    ] + [s for s in skipped]


def _weights_source(source: Source, opened: OpenedSource | None) -> Source:
    """What holds the weights of a training folder: its model file when that is a torch.save
    file (a Trainer `checkpoint-N/` with `pytorch_model.bin`, beside `optimizer.pt` and
    `rng_state.pth`, which read as one torch folder would be a mix of all of them); else the
    folder, whose safetensors are its weights."""
    if opened is None or "model" not in opened.parts:
        return source
    main, token = opened.parts["model"]
    fmt = find_format(token)
    # a single-file format holding pickled objects reads a folder as every file of its
    # suffixes: the model's file alone is the weights
    if fmt is None or fmt.folder or not fmt.holds_objects:
        return source
    if "/" in main or not is_single_file_weights(main):
        return source
    return Source(location=source.location, storage=source.storage, target=main)


def _carried_files(
    source: Source, weights: Checkpoint, opened: OpenedSource | None
) -> tuple[list[str], list[str]]:
    """(training-state files, extra files) of `source` to copy beside its resharded weights."""
    from ..shared.transfer import extra_files

    if source.target is not None:
        return [], []
    if opened is None:
        return [], extra_files(weights)
    with opened.checkpoint as composite:
        extra = extra_files(composite)
    details = IndexedDetails.of(weights.manifest)
    index = details.index if details else None
    own = {f.path for f in weights.manifest.files} | ({index} if index else set())
    carried = [
        rel
        for rel in sorted(source.files)
        if rel not in own
        and rel not in extra
        and not any(part.startswith(".") for part in rel.split("/"))
        and not is_checksum_manifest(rel)
    ]
    return carried, extra


def _basename(checkpoint: Checkpoint) -> str:
    """The stem of the source's shard names (`model`, `diffusion_pytorch_model`...)."""
    details = IndexedDetails.of(checkpoint.manifest)
    index = details.index if details else None
    if index:
        name = index.rsplit("/", 1)[-1]
        for suffix in (SAFETENSORS_INDEX_SUFFIX, TORCH_INDEX_SUFFIX, INDEX_SUFFIX):
            if name.endswith(suffix):
                return name[: -len(suffix)]
    files = [f.path for f in checkpoint.manifest.files]
    if len(files) == 1:
        stem = files[0].rsplit("/", 1)[-1].split(".", 1)[0]
        # a single shard named like `model-00001-of-00001` keeps the stem before the counter
        return re.sub(r"-\d{5}-of-\d{5}$", "", stem) or "model"
    return "model"


def run_reshard(
    src: str,
    dest: str,
    *,
    world_size: int | None = None,
    max_shard_size: str | int | None = None,
    shard_dim: list[str] | None = None,
    plan: Path | None = None,
    rank_state: str | None = None,
    dcp_serialization: str | None = None,
    dcp_compression: str | None = None,
    format: str | None = None,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
) -> ReshardReport:
    """Reshard `src` into `dest`: the library's keyword form of `reshard_with` (the
    arguments are `ReshardRequest`'s fields).

    With `dry_run`, only metadata is read and nothing is written: the report says what would be.
    `extras=False` leaves the source folder's config/tokenizer files out of the output.
    """
    request = ReshardRequest(
        world_size=world_size,
        max_shard_size=max_shard_size,
        shard_dim=shard_dim,
        plan=plan,
        rank_state=rank_state,
        dcp_serialization=dcp_serialization,
        dcp_compression=dcp_compression,
        format=format,
        force=force,
        dry_run=dry_run,
        extras=extras,
    )
    return reshard_with(src, dest, request, progress)


def reshard_with(
    src: str, dest: str, request: ReshardRequest, progress: Progress = NULL_PROGRESS
) -> ReshardReport:
    """Check the option combination, parse sizes and rules, and run the chosen mode."""
    from ...dist.placement import load_plan, parse_rule
    from ...sizes import parse_size

    world_size, max_shard_size = request.world_size, request.max_shard_size
    shard_dim, plan, rank_state = request.shard_dim, request.plan, request.rank_state
    dcp_serialization, dcp_compression = request.dcp_serialization, request.dcp_compression
    format = request.format
    if (world_size is None) == (max_shard_size is None):
        raise UsageError(
            "say what to change: --world-size N (DCP) or --max-shard-size SIZE (safetensors)",
            fix="Pass exactly one of them.",
        )
    if rank_state is not None and rank_state not in RANK_STATE_CHOICES:
        raise UsageError(
            f"--rank-state {rank_state!r} is not {' or '.join(RANK_STATE_CHOICES)}",
            fix="; ".join(f"{k}: {v}" for k, v in RANK_STATE_CHOICES.items()) + ".",
        )
    if dcp_serialization is not None and dcp_serialization not in serializations():
        raise UsageError(
            f"--dcp-serialization {dcp_serialization!r} is not {' or '.join(serializations())}",
            fix=f"Use --dcp-serialization {' or '.join(serializations())}.",
        )
    if max_shard_size is not None:
        given = [
            flag
            for flag, on in (
                ("--shard-dim", bool(shard_dim)),
                ("--plan", plan is not None),
                ("--rank-state", rank_state is not None),
                ("--dcp-serialization", dcp_serialization is not None),
                ("--dcp-compression", dcp_compression is not None),
            )
            if on
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} with "
                "--world-size only",
                fix="Leave them out, or reshard a DCP checkpoint with --world-size N.",
            )
        limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
        # parsed once: every component below is cut to the same byte count
        request = request.model_copy(update={"max_shard_size": limit})
        # SRC is resolved (listed, its Hub revision pinned) once: everything below reads it
        source = resolve_source(src)
        if format is None:
            _refuse_megatron_legacy(source)
            from ..shared.components import components_of

            found = components_of(source)
            if found is not None:
                # a diffusers pipeline / sentence-transformers folder: component by component
                return _reshard_components(src, dest, *found, request, progress)
        return regroup(source, _checked_dest(src, dest, request.force), request, progress)
    assert world_size is not None
    rules = [parse_rule(text) for text in shard_dim or []]
    if plan is not None:
        rules += load_plan(plan)
    source = resolve_source(src)  # once: the layout check and the re-cut read it
    if format is None:
        _refuse_megatron_legacy(source)
        folder = _training_folder(source)
        if folder is not None:
            source, opened, layout = folder
            try:
                report = reshard_folder(source, opened, layout, dest, request, rules, progress)
                report.warnings += lost_file_warnings(opened)
                # lost RNG files `--rank-state drop` let the re-cut leave out (it refuses others)
                dropped = refuse_lost_files(opened, "re-cut", rank_state=rank_state or "")
                report.warnings += [f"{comp}: {why}" for comp, why in dropped]
            finally:
                opened.checkpoint.close()
            return report if dropped else _rank_state_used(report, rank_state)
    return _rank_state_used(reshard_world_size(source, dest, request, rules, progress), rank_state)


def _rank_state_used(report: ReshardReport, asked: str | None) -> ReshardReport:
    """A `--rank-state` that found no per-rank state to apply to had no effect: say so, as an
    unmatched `--shard-dim` rule is said."""
    if asked is not None and report.rank_state_action is None:
        report.warnings.append(
            f"--rank-state {asked} has no effect: {report.source} holds no per-rank RNG or "
            "data-loader state"
        )
    return report


def _training_folder(source: Source) -> tuple[Source, OpenedSource, Layout] | None:
    """SRC opened as a training folder layout (Trainer, accelerate...), when it is one."""
    from ...sources.layouts import folder_layout_named
    from ...sources.opening import recognise_layout

    opened = recognise_layout(source)
    if opened is None:
        return None
    layout = folder_layout_named(opened.training.layout) if opened.training else None
    if layout is None:
        opened.checkpoint.close()
        return None
    return source, opened, layout


def _reshard_components(
    src: str,
    dest: str,
    layout: str,
    components: list[Any],
    request: ReshardRequest,
    progress: Progress,
) -> ReshardReport:
    """Reshard every weight-holding component of a multi-folder model with its own naming,
    each with this call's request (DEST's `force` is decided once, for the whole folder)."""
    from ..shared.components import write_components

    # DEST is checked once, whole; each component is written into a fresh staging folder
    _checked_dest(src, dest, request.force)
    inner = request.model_copy(update={"force": False})

    def one(comp: Any, inner_src: str, inner_dest: str, to: str) -> ReshardReport:
        return regroup(resolve_source(inner_src), Path(inner_dest), inner, progress)

    source = resolve_source(src)
    # each component keeps its own format; `to` names the one they share (for the checks)
    formats = {format_of_file(c.weights) or HF_WEIGHTS for c in components if c.weights}
    to = formats.pop() if len(formats) == 1 else HF_WEIGHTS
    files, reports = write_components(
        src, dest, layout, components, to, one, force=request.force, dry_run=request.dry_run
    )
    assert isinstance(request.max_shard_size, int)
    # each component's own accounting, named from the root: a variant beside the default
    # weights (`unet/diffusion_pytorch_model.fp16.safetensors`) is not written, and says so
    written = [c for c in components if c.weights is not None]
    skipped: list[SkippedEntry] = []
    extras: list[str] = []
    own: set[str] = set()
    for comp, report in zip(written, reports, strict=True):
        base = f"{comp.path}/" if comp.path else ""
        skipped += [s.model_copy(update={"name": f"{base}{s.name}"}) for s in report.skipped]
        extras += [f"{base}{e}" for e in report.extras]
        own.update(f"{base}{f.path}" for f in report.files)
    # and the files copied beside them (`model_index.json`, schedulers, tokenizers...)
    extras += [f.path for f in files if f.path not in own and f.path not in extras]
    return ReshardReport(
        mode="shard-size",
        source=source.location.raw,
        destination=dest,
        format=layout,
        files=files,
        skipped=skipped,
        extras=extras,
        tensors=sum(r.tensors for r in reports),
        objects=sum(r.objects for r in reports),
        tensor_bytes=sum(r.tensor_bytes for r in reports),
        raw_copy=sum(r.raw_copy for r in reports),
        max_shard_size=request.max_shard_size,
        verified=not request.dry_run,
        dry_run=request.dry_run,
    )


def _refuse_megatron_legacy(source: Source) -> None:
    """Refuse a legacy Megatron-LM save or one of its rank folders
    (`megatron_save.refuse_reshard`), its module imported only for a folder of checkpoint
    folders or a training folder: a plain model's reshard never loads it (start-up #30)."""
    if source.target is None and (
        holds_only_nested_checkpoints(source) or folder_layout_of(source) is not None
    ):
        from ...sources.layouts.megatron_save import refuse_reshard

        refuse_reshard(source)
