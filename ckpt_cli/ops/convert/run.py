"""`convert`: the same tensors in another format, streamed one entry at a time.

The work is `ops.transfer`'s pipeline; this module turns the command's options into a
`TransferPlan` and `WriteOptions`, guards the source, and reports what was written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ... import dtypes
from ...architectures import HF
from ...architectures.gguf import tokenizer_note
from ...dist.command import RankShare, refuse_remote_split
from ...errors import NotFoundError, UsageError, with_fix
from ...formats import find_format, holds_only_nested_checkpoints, resolve_source
from ...formats.base import Checkpoint, Format, WriteOptions
from ...models import FileInfo, Manifest, Record, Request
from ...progress import NULL_PROGRESS, Progress
from ...quant import QuantAnalysis
from ...sizes import parse_size
from ...sources.layouts import OpenedSource, folder_layout_named
from ...sources.layouts.model_folders import Component, saved_model_folders
from ...sources.opening import open_source
from ...storage.output import Destination, check_destination, resolve_destination
from ..shared.architecture import (
    ArchitectureReport,
    default_select,
    map_plan,
    naming_format,
    refuse_adapter,
    refuse_block_quantized_naming,
    refuse_part,
    refuse_quantized_naming,
    source_config,
)
from ..shared.megatron import keep_megatron_layout
from ..shared.selection import (
    lost_file_warnings,
    refuse_lost_files,
    unmatched_rules,
    unreadable_left_out,
)
from ..shared.transfer import (
    SkippedEntry,
    TransferPlan,
    WrittenEntry,
    account_files,
    extra_files,
    kept_counters_note,
    left_out_components,
    nothing_to_dequantize,
    parse_renames,
    plan_transfer,
    planned_hows,
)
from ..shared.transfer import write_checkpoint as run_write
from .plan import (
    DEFAULT_SERIALIZATION,
    NO_COMPRESSION,
    check_one_file_naming,
    check_shard_size,
    check_target,
    config_in_dtype,
    dequantized_config,
    dequantized_extras,
    guard_paths,
    keep_quantized,
    missing_config_warning,
    model_metadata_note,
    output_layout,
    output_warnings,
    planned_files,
    read_config,
    read_serving_files,
    unused_renames,
    written_dtype,
)

if TYPE_CHECKING:
    from ...sources.layouts.megatron_save import WholeSave


class ConvertRequest(Request):
    """Every option of `convert` but the locations, frozen: what each component of a
    multi-folder source is converted with (`model_copy(update=...)`), so no option is re-listed
    by hand and none is dropped. Its fields are `convert`'s keyword parameters (a test holds
    the two to each other); `progress` is a sink, not an option, and travels beside it."""

    format: str | None = None
    max_shard_size: str | int | None = None
    dtype: str | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    renames: list[str] | None = None
    select: str | None = None
    dcp_serialization: str | None = None
    dcp_compression: str | None = None
    world_size: int = 1
    force: bool = False
    dequantize: bool = False
    dry_run: bool = False
    extras: bool = True
    config: str | None = None
    match_prefix: str = ""
    flavor: str | None = None


class ConvertReport(Record):
    """The result of `ckpt convert`.

    Attributes:
        source / source_format: what was read.
        dest / format: what was written, and as which format.
        files: the files written (paths relative to `dest`; a single-file DEST is its own name).
        tensors / objects: how many entries were written.
        tensor_bytes: bytes of tensor data written.
        raw_copies: tensors copied as raw bytes without deserialising.
        cast: the dtype floating tensors were cast to, if any; `casts` how many were.
        renamed: entries whose output name differs from the source name.
        skipped: source entries not written, with why; and (kind `file`) every file of the
            source that is neither read into the output (`read`) nor carried (`extras`).
        read: the files of the source the output's entries were read from (with the index or
            `.metadata` that found them): with `extras` and the `file` items of `skipped`,
            every file of the source.
        tied: groups of output names sharing storage in the source (the first name is kept).
        aliases: names written once as another tensor (safetensors `__metadata__` records them).
        max_shard_size / dcp_serialization / world_size: the layout asked for.
        checked: the output passed the format's structural check before it was published.
        entries: every entry written.
        ranks: under torchrun, what each rank wrote (empty in a single-process run).
        dry_run: nothing was written: `files` and `entries` are what would be (file sizes
            exact for safetensors outputs, None where the writer decides them).
        dequantized: quantized weights written dequantized (`--dequantize`).
        quantized_kept: quantized weights and scales written as stored although `--dtype`
            was given (`--dtype` applies to unquantized tensors only).
        config_written: `config.json` written into the output: the source's without its
            quantization section (`--dequantize`), or the one `--config` named; with
            `config_dtype`, the dtype it declares for the weights set to the cast's.
        config_dtype: the dtype `config.json` now declares (`torch_dtype` / `dtype`): the one
            `--dtype` cast the weights to, or, without `--dtype`, the one a training
            checkpoint's weights are written in where its config said another (a DeepSpeed
            save's fp32 weights, its config bf16); None: its dtype was left as it was, or it
            has none.
        config_source: where `--config` read that `config.json` (None without it).
        architecture: for `--to hf` / `--to torchtitan`: the model's family, the two namings
            and every tensor's rename and transform.
        serving_files: tokenizer and generation-config files `--to hf --config FOLDER` copied
            from that folder (or Hub model) beside the config.
        extras: non-weight files of the source folder copied unchanged into DEST
            (`config.json`, `generation_config.json`, tokenizer files...; see
            `transfer.extra_files`); empty with `extras=False` or a single-file DEST.
        warnings: things the user should know: options that had no effect (a --rename rule
            that matches no entry), an output torch cannot load (DCP safetensors serialization).
    """

    source: str
    source_format: str
    dest: str
    format: str
    files: list[FileInfo]
    tensors: int
    objects: int
    tensor_bytes: int
    raw_copies: int
    cast: str | None = None
    casts: int = 0
    renamed: int = 0
    skipped: list[SkippedEntry] = Field(default_factory=list)
    read: list[str] = Field(default_factory=list)
    tied: list[list[str]] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict)
    max_shard_size: int | None = None
    dcp_serialization: str | None = None
    world_size: int | None = None
    checked: bool = True
    entries: list[WrittenEntry] = Field(default_factory=list)
    ranks: list[RankShare] = Field(default_factory=list)
    dry_run: bool = False
    warnings: list[str] = Field(default_factory=list)
    dequantized: int = 0
    quantized_kept: int = 0
    config_written: str | None = None
    config_dtype: str | None = None
    config_source: str | None = None
    extras: list[str] = Field(default_factory=list)
    architecture: ArchitectureReport | None = None
    serving_files: list[str] = Field(default_factory=list)


def convert(
    src: str,
    dest: str,
    to: str,
    *,
    format: str | None = None,
    max_shard_size: str | int | None = None,
    dtype: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    renames: list[str] | None = None,
    select: str | None = None,
    dcp_serialization: str | None = None,
    dcp_compression: str | None = None,
    world_size: int = 1,
    force: bool = False,
    dequantize: bool = False,
    progress: Progress = NULL_PROGRESS,
    dry_run: bool = False,
    extras: bool = True,
    config: str | None = None,
    match_prefix: str = "",
    flavor: str | None = None,
) -> ConvertReport:
    """Convert `src` into format `to` at `dest`, streaming one tensor or byte range at a time.

    Args:
        src: checkpoint file, folder or URL.
        dest: output file or folder, local or an fsspec URL such as `s3://bucket/prefix`
            (refused if it exists, unless `force`).
        to: target format token (`safetensors`, `dcp`, `torch`), or a framework naming:
            `hf` (Hugging Face safetensors shards, names and `config.json` that
            `from_pretrained` loads), `torchtitan` (a DCP save torchtitan loads, model only)
            or `megatron` (a Megatron-Core torch_dist save `dist_checkpointing.load` reads);
            the model's family is recognised from its tensor names (`ops.architecture`).
        format: read `src` as this format instead of detecting it.
        max_shard_size: split the output into shards of at most this size (`5GB`, bytes).
        dtype: cast floating tensors (`bf16`, `fp16`, `fp32`); integer/bool tensors untouched.
        include / exclude: globs on source names choosing the entries.
        renames: `OLD=NEW` prefix renames.
        select: keep only the sub-tree under this prefix (`model`), stripping it.
        dcp_serialization: `torch_save` (None: the default) or `safetensors` (DCP target
            only).
        dcp_compression: `zstd` writes every DCP item through DCP's ZStandard extension.
        world_size: ranks to lay a DCP output out for (DCP target only).
        force: replace an existing `dest` once the new output is complete.
        dequantize: write quantized weights (FP8, MXFP4, NVFP4, GGUF blocks) dequantized to
            `dtype` (or the model's dtype) and drop their scales; without it quantized weights and their
            scales are copied as stored, in one shard, and never cast.
        progress: progress sink (bytes).
        dry_run: plan only: read metadata, write nothing, report what would be written.
        extras: carry the source folder's non-weight files (config, tokenizer...) into a
            folder DEST, so `from_pretrained(DEST)` builds the same model.
        config: a `config.json` to write into a folder DEST, in place of the source's: a
            file, a model folder or `hf://org/model` (an FSDP Trainer checkpoint has none,
            and `from_pretrained` needs one).
        match_prefix: what `include` / `exclude` see before each source name: a multi-folder
            model's component is converted with `unet.`, so the globs match the names
            `ckpt inspect` shows of the whole folder (`unet.conv_in.weight`).
        flavor: `--to hf` / `--to torchtitan` / `--to megatron`: the torchtitan model flavor (`8B`,
            `debugmodel`) whose args (head counts, rotary base and scaling, norm epsilon)
            complete what the weights tell, read from the installed torchtitan's registry.
    """
    to, naming = naming_format(to)
    if flavor is not None and naming is None:
        raise UsageError(
            "--flavor applies to --to hf, --to torchtitan and --to megatron only",
            fix="Leave --flavor out, or convert with one of those.",
        )
    target = check_target(
        to, serialization=dcp_serialization, compression=dcp_compression, world_size=world_size
    )
    dest_path = resolve_destination(dest)
    refuse_remote_split(dest_path)
    if dry_run and not match_prefix:
        # the real run refuses an existing DEST (or a missing parent) before any work: its dry
        # run says so too. A component's own DEST (under the whole one) is planned, not checked
        check_destination(dest_path, force)
    shard_size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    check_shard_size(target, shard_size)
    cast = dtypes.parse_user_dtype(dtype) if dtype else None
    rename_pairs = parse_renames(renames)
    guard_paths(src, dest_path)
    # SRC is resolved (listed, its Hub revision pinned) once: everything below reads `source`
    source = resolve_source(src)
    if format is None:
        from ..shared.components import component_source, components_of

        found = components_of(source)
        if found is not None and naming is not None and not select:
            # a framework naming maps one model: of a multi-folder one, the component chosen
            example = next((c for c in found[1] if c.weights is not None), found[1][0])
            raise UsageError(
                f"a {found[0]} folder holds several models, and --to {naming} maps one",
                path=src,
                fix=f"Pick the component to map with --select, e.g. --select {example.name}.",
            )
        # a component that is a model folder of its own, converted as that folder with
        # every option this call was given
        request = ConvertRequest(
            max_shard_size=shard_size,
            dtype=dtype,
            include=include,
            exclude=exclude,
            renames=renames,
            dcp_serialization=dcp_serialization,
            dcp_compression=dcp_compression,
            world_size=world_size,
            force=force,
            dequantize=dequantize,
            dry_run=dry_run,
            extras=extras,
            config=config,
            flavor=flavor,
        )
        if found is None and not select and holds_only_nested_checkpoints(source):
            # a whole legacy Megatron-LM save (`iter_N/`, or its run folder: the iteration its
            # tracker names), imported here alone (start-up #30)
            from ...sources.layouts.megatron_save import whole_save

            save = whole_save(source)
            if save is not None:
                return _convert_megatron_save(src, save, dest, to, naming, request, progress)
        if found is not None:
            # a diffusers pipeline / sentence-transformers folder: one component, or each
            if not select:
                if config is not None:
                    raise UsageError(
                        f"--config names one model's config.json; the components of a "
                        f"{found[0]} folder each keep their own",
                        path=src,
                        fix="Pick the component it belongs to with --select "
                        f"{found[1][0].name}, or leave --config out.",
                    )
                return _convert_components(src, dest, to, found, request, progress)
            sub = component_source(src, found[1], select)
            if sub is not None:
                return _convert_subfolder(sub, dest, naming or to, select, request, progress)
        elif select and source.target is None:
            # a model a training script's save hook wrote into a subfolder of its save (the
            # diffusers scripts' `unet/`): converted as the model folder its library loads,
            # its config.json and weight names kept
            name = select.rstrip(".")
            if name in {sub for sub, _ in saved_model_folders(set(source.files))}:
                sub = f"{src.rstrip('/')}/{name}"
                return _convert_subfolder(sub, dest, naming or to, select, request, progress)
    single_file, basename = output_layout(target, dest_path, shard_size)
    if single_file and naming is not None:
        raise UsageError(
            f"--to {naming} writes a folder (weights, index and config.json), not one file",
            path=str(dest_path),
            fix="Name a folder as DEST.",
        )
    given_config: tuple[bytes, str] | None = None
    if config is not None:
        if single_file:
            raise UsageError(
                "--config writes config.json into a folder DEST; this DEST is one file",
                path=str(dest_path),
                fix="Name a folder as DEST (hf-model/), or leave --config out.",
            )
        given_config = read_config(config)
    opened = open_source(source, format)
    if naming is not None:
        refuse_adapter(opened, naming, src)
        refuse_part(opened, naming, src)
        select = default_select(opened, select)
    # a lost file's component left out by --filter/--filter-out: written without it, knowingly
    lost_left_out = (
        refuse_lost_files(
            opened,
            "converted",
            include=include,
            exclude=exclude,
            match_prefix=match_prefix,
            filters=True,
        )
        if select is None and naming is None
        else []
    )
    with opened.checkpoint as base:
        from ...quant import analyse_checkpoint

        analysis = analyse_checkpoint(base.manifest, base.storage)
        if naming is not None and not dequantize:
            refuse_quantized_naming(analysis, naming, src)
            refuse_block_quantized_naming(base, naming)
        if dequantize and given_config is not None and not base.block_quantized():
            # a format's own blocks (GGUF) come with no config.json to rewrite: --config
            # gives the model's; a quantized model's config.json is rewritten by --dequantize
            raise UsageError(
                "--config and --dequantize both write config.json",
                fix="Leave --config out: --dequantize writes the source's config without its "
                "quantization section.",
            )
        checkpoint, dequantizable = _readable(base, analysis, src, dequantize, cast)
        manifest = checkpoint.manifest
        # a chosen component that cannot be read is the error (exit 4, naming it), before the
        # choice finds nothing under its prefix (exit 3, "no entry under 'model'"); the ones
        # left out are listed as skipped with the plan's own
        unreadable = [
            SkippedEntry(name=comp, kind="component", reason=why)
            for comp, why in unreadable_left_out(
                opened.unreadable, "converted", select, include, exclude, match_prefix
            )
            + lost_left_out
        ]
        plan = _plan(
            opened,
            manifest,
            target,
            select,
            include,
            exclude,
            rename_pairs,
            cast,
            match_prefix,
            restore_aliases=naming is None,
            config=source_config(base.storage) if cast in ("float16", "bfloat16") else None,
        )
        # the dequantized weights the output holds, not all the source has (-k picks some)
        dequantized = sum(1 for item in plan.items if item.source.name in dequantizable)
        origins: dict[str, str] = {}
        architecture: ArchitectureReport | None = None
        naming_config: bytes | None = None
        naming_files: dict[str, bytes] = {}
        naming_basename: str | None = None
        naming_warnings: list[str] = []
        # the source's files are accounted for against its own entries, not a naming's
        selected_from, selected = checkpoint, plan
        config_from_source = False
        config_narrowed = False
        if naming is not None:
            known = json.loads(given_config[0]) if given_config else source_config(base.storage)
            config_from_source = given_config is None and known is not None
            if dequantizable and known is not None:
                from ...quant import without_quantization

                known = without_quantization(known)  # the written weights are plain
            mapped = map_plan(
                checkpoint,
                plan,
                naming,
                config=known,
                cast=cast,
                keep_objects=target.holds_objects,
                dedupe_tied=target.dedupes_tied,
                flavor=flavor,
            )
            chunked = sorted(mapped.output.split_dim0)
            serialization = dcp_serialization or DEFAULT_SERIALIZATION
            if chunked and serialization not in target.chunked_serializations:
                # the writer would stop at the first stacked tensor with exit 4 ("bad
                # checkpoint") for what is an option this naming cannot take
                raise UsageError(
                    f"--to {naming} stores {chunked[0]}"
                    f"{f' (and {len(chunked) - 1} more)' if len(chunked) > 1 else ''} as one "
                    "chunk per layer in one file, which the safetensors serialization cannot "
                    "hold (it keys chunks by name)",
                    fix="Leave --dcp-serialization out (torch_save, what Megatron-Core saves).",
                )
            checkpoint, plan, origins = mapped.checkpoint, mapped.plan, mapped.origins
            architecture, naming_config = mapped.report, mapped.config
            config_narrowed = mapped.config_narrowed
            naming_files = mapped.output.files
            naming_basename = mapped.output.basename
            naming_warnings = mapped.warnings
        kept = 0 if dequantize or naming else keep_quantized(plan, analysis)
        plan.skipped += unreadable
        options = WriteOptions(
            max_shard_size=shard_size,
            # the source's string metadata where the target keeps some (safetensors)
            metadata=target.output_metadata(manifest.metadata, plan.aliases),
            # the stem the naming's loader looks for (diffusers' diffusion_pytorch_model)
            basename=basename or naming_basename,
            single_file=single_file,
            dcp_serialization=dcp_serialization or DEFAULT_SERIALIZATION,
            world_size=world_size,
            dcp_compression=None if dcp_compression == NO_COMPRESSION else dcp_compression,
        )
        source_format = find_format(manifest.format)
        if naming is None and not opened.parts and source_format and source_format.flat_names:
            # a flat state dict's keys stay whole keys (`dcp.save` of `model.state_dict()`
            # records `("lm_head.weight",)`): torch's `dcp_to_torch_save` of the output gives
            # the same flat state dict back, not dicts nested at every dot
            options.dcp_planner_data = {i.target.name: (i.target.name,) for i in plan.items}
        elif naming is None and isinstance(checkpoint.planner_data, dict):
            # a DCP source: each name keeps the path its `.metadata` records (whole keys of a
            # flat state dict too); a renamed one is placed by its own name
            recorded = checkpoint.planner_data
            options.dcp_planner_data = {
                i.target.name: recorded[i.source.name]
                for i in plan.items
                if i.target.name == i.source.name and i.source.name in recorded
            }
        warnings = unused_renames(plan, rename_pairs) + naming_warnings
        counters = kept_counters_note(plan, cast, match_prefix) if cast is not None else None
        warnings += [counters] if counters is not None else []
        # the output holds every tensor's values; the source's layout flaw is said anyway
        warnings += [with_fix(p.message, p.fix) for p in checkpoint.tolerated_problems()]
        # shards whose `__metadata__` disagree: the output keeps what they agree on
        warnings += checkpoint.metadata_left_out(options.metadata)
        if select is None and naming is None:
            warnings += lost_file_warnings(opened)
        if opened.part_of is not None:
            # copied as it is, names and slices kept: a part still, never the whole model
            warnings.append(f"{opened.part_of}: the output holds that part alone, as it is")
        if not match_prefix:  # a component's rules are judged over the whole folder
            # a component left out whole (lost, unreadable) is matched though it lists nothing
            left_out = [f"{entry.name}." for entry in unreadable]
            names = [*(e.name for e in manifest.entries), *left_out]
            warnings += unmatched_rules(names, include, exclude)
        companions = [] if single_file else extra_files(checkpoint)
        carried = companions if extras else []
        quant_files: list[SkippedEntry] = []
        if dequantize:
            carried, quant_files = dequantized_extras(carried)
        # a framework naming, or one component taken out of a training save, is a model, not
        # the training save: its framework's tools for that save (`zero_to_fp32.py`) stay
        component_out = naming is not None or (select is not None and opened.training is not None)
        if component_out:
            carried = [rel for rel in carried if not is_training_file(opened, rel)]
        if given_config is not None and not config_narrowed:
            carried = [rel for rel in carried if rel != "config.json"]
            options.companions["config.json"] = given_config[0]
        elif naming_config is not None:
            # the config of the mapped model, built from its args (or the source's own)
            carried = [rel for rel in carried if rel != "config.json"]
            options.companions["config.json"] = naming_config
        serving: list[str] = []
        if naming == HF and config is not None:
            # a model folder / Hub model given for its config serves its tokenizer too
            for name, data in read_serving_files(config).items():
                if name not in carried:
                    options.companions[name] = data
                    serving.append(name)
        elif not single_file and naming is None and given_config is None:
            missing = missing_config_warning(opened, target.name, select, carried, str(dest_path))
            if missing is not None:
                warnings.append(missing)
        if naming == HF and not any(n.startswith("tokenizer") for n in [*serving, *carried]):
            # a GGUF keeps its tokenizer in its metadata, which is no file to carry
            note = tokenizer_note(base, naming)
            warnings += [note] if note is not None else []
        elif naming is None:
            # a GGUF's key-values (its tokenizer...) are no file to carry, nor tensors
            note = model_metadata_note(base, target.name)
            warnings += [note] if note is not None else []
        # what the target naming keeps beside the tensors (Megatron's common.pt...)
        options.companions.update(naming_files)
        carried = [rel for rel in carried if rel not in naming_files]
        # a Megatron-Core torch_dist source stays one (its common.pt + metadata.json)
        megatron_files = [] if naming else keep_megatron_layout(checkpoint, plan, target.name)
        if not single_file and target.shards_by_size and format is None and naming is None:
            # keep the source library's file names (adapter_model, diffusion_pytorch_model...)
            from ...sources.layouts.model_folders import apply_naming, cast_variant_note

            convention = apply_naming(source, to, options, cast)
            check_one_file_naming(convention, plan, options, src)
            variant_note = cast_variant_note(source, cast)
            if variant_note is not None:
                warnings.append(variant_note)
        if analysis.together() and not dequantize:
            renamed = {i.source.name: i.target.name for i in plan.items}
            options.together = [
                [renamed[n] for n in group if n in renamed] for group in analysis.together()
            ]
        shares: list[RankShare] = []
        carried += megatron_files  # Megatron's own files, copied unchanged
        # every file of SRC: read into the output, carried, or skipped with why
        # a naming's config.json built on the source's is the source's, carried (rewritten)
        accounted = [*carried, "config.json"] if config_from_source else list(carried)
        accounted += [f.name for f in quant_files]  # left out, with their own reason
        listed = dict(opened.listed_files)
        # a companion not carried says why: it is one ckpt carries, left out on purpose
        for rel in companions:
            if rel in accounted:
                continue
            if not extras:
                listed.setdefault(rel, "left out (--no-extras)")
            elif rel == "config.json" and given_config is not None:
                listed.setdefault(rel, f"replaced by --config {given_config[1]}")
            elif rel == "config.json" and naming_config is not None:
                listed.setdefault(rel, "replaced by the config.json written for the naming")
            elif component_out and is_training_file(opened, rel):
                listed.setdefault(
                    rel, "a file of the training save, not of the model: not exported"
                )
        read, skipped_files = account_files(
            selected_from, selected, accounted, single_file=single_file, listed=listed
        )
        # the training state the selection left in the files it read (torchtitan's optimizer
        # beside the weights) is listed too, as the files it left are
        how = (
            f"--to {naming} exports the model's weights only"
            if naming is not None
            else f"outside --select {select}"
        )
        skipped_files += left_out_components(selected_from, selected, read, opened, select, how)
        config_written = None
        if given_config is not None or naming_config is not None:
            config_written = str(PurePath(str(dest_path)) / "config.json")
        if dequantize and not single_file:
            # published with the weights (a companion), never the source's quantized config
            rewritten = dequantized_config(base.storage)
            if rewritten is not None:
                options.companions["config.json"] = rewritten
                config_written = str(PurePath(str(dest_path)) / "config.json")
        config_dtype = None
        declared = cast
        from_source = "config.json" in carried or (naming_config is not None and not given_config)
        if declared is None and opened.training is not None and from_source:
            # a training checkpoint's weights written in another dtype than its config says
            # (ZeRO's fp32 master weights beside a bf16 config): say the one written
            declared = written_dtype(plan)
        if declared is not None and not single_file:
            # the config published says the dtype the weights were cast to (or written in)
            published = options.companions.get("config.json")
            if published is None and "config.json" in carried:
                published = checkpoint.source.storage.read_all("config.json")
            retyped = config_in_dtype(published, declared) if published is not None else None
            if retyped is not None:
                options.companions["config.json"] = retyped
                carried = [rel for rel in carried if rel != "config.json"]  # written, not copied
                config_written = str(PurePath(str(dest_path)) / "config.json")
                config_dtype = declared
        if dry_run:  # after every file is worked out: a dry run lists what the real run writes
            hows = planned_hows(checkpoint, target, plan, options)
            report = _dry_run_report(
                manifest, plan, hows, dest_path, target, options, cast, warnings
            )
            report = report.model_copy(
                update={
                    # the files written beside the weights (a config.json built or retyped...)
                    "files": [
                        *report.files,
                        *(
                            FileInfo(path=name, size=len(data))
                            for name, data in options.companions.items()
                        ),
                    ],
                    "extras": carried,
                    "read": read,
                    "skipped": plan.skipped + skipped_files + quant_files,
                    "config_written": config_written,
                    "config_dtype": config_dtype,
                    "config_source": given_config[1] if given_config is not None else None,
                    "dequantized": dequantized,
                    "quantized_kept": kept,
                    "serving_files": serving,
                }
            )
            return _with_origins(report, origins, architecture)
        files, written = run_write(
            checkpoint,
            plan,
            dest_path,
            to,
            options,
            force=force,
            progress=progress,
            shares=shares,
            extras=carried,
            origins=origins,
            release_source=True,  # below, the report reads only its location and format
        )
    tensors = [w for w in written if w.kind == "tensor"]
    return ConvertReport(
        source=manifest.location,
        source_format=manifest.format,
        dest=str(dest_path),
        format=to,
        files=files,
        tensors=len(tensors),
        objects=len(written) - len(tensors),
        tensor_bytes=sum(w.nbytes for w in tensors),
        raw_copies=sum(1 for w in written if w.how == "raw"),
        cast=cast,
        casts=sum(1 for w in written if w.how == "cast"),
        renamed=sum(1 for w in written if w.name != w.source),
        skipped=plan.skipped + skipped_files + quant_files,
        read=read,
        tied=plan.tied,
        aliases=plan.aliases,
        max_shard_size=shard_size,
        dcp_serialization=options.dcp_serialization if target.serializations else None,
        world_size=world_size if target.shards_by_rank else None,
        entries=written,
        ranks=shares,
        dequantized=dequantized,
        quantized_kept=kept,
        config_written=config_written,
        config_dtype=config_dtype,
        config_source=given_config[1] if given_config is not None else None,
        extras=carried,
        warnings=warnings + output_warnings(target, options.dcp_serialization),
        architecture=architecture,
        serving_files=serving,
    )


def _with_origins(
    report: ConvertReport, origins: dict[str, str], architecture: ArchitectureReport | None
) -> ConvertReport:
    """A dry run's report with each entry's source as the source names it is built from."""
    if not origins:
        return report
    entries = [
        dataclasses.replace(e, source=origins.get(e.source, e.source)) for e in report.entries
    ]
    renamed = sum(1 for e in entries if e.name != e.source)
    return report.model_copy(
        update={"entries": entries, "renamed": renamed, "architecture": architecture}
    )


def _readable(
    base: Checkpoint, analysis: QuantAnalysis, src: str, dequantize: bool, cast: str | None
) -> tuple[Checkpoint, set[str]]:
    """The checkpoint to copy from, and the names of the weights `--dequantize` turned into
    plain entries (a `DequantizedCheckpoint` or `BlockDequantizedCheckpoint` over `base`)."""
    if not dequantize:
        return base, set()
    from ...quant import logical_dtype
    from ...quant.dequant import BlockDequantizedCheckpoint, DequantizedCheckpoint

    if not analysis.quantized and base.block_quantized():
        # a format's own blocks (GGUF): the same default dtype as the other schemes
        blocks = BlockDequantizedCheckpoint(base, logical_dtype(analysis, cast))
        return blocks, set(blocks.logical)
    if not analysis.quantized:
        raise nothing_to_dequantize(base.manifest, packed=analysis.packed_scheme)

    plain = DequantizedCheckpoint(base, analysis, logical_dtype(analysis, cast))
    return plain, set(plain.logical)


def _plan(
    opened: OpenedSource,
    manifest: Manifest,
    target: type[Format],
    select: str | None,
    include: list[str] | None,
    exclude: list[str] | None,
    renames: list[tuple[str, str]],
    cast: str | None,
    match_prefix: str = "",
    *,
    restore_aliases: bool,
    config: dict[str, Any] | None = None,
) -> TransferPlan:
    """What goes out under which name and dtype, as far as the target can hold it; with
    `restore_aliases`, the names the source records as aliases too (`plan_transfer`). The
    weights transformers loads in float32 whatever the dtype (the model class `config` names:
    `kept_in_float32`) stay as stored under a cast."""
    from ...architectures.fp32_modules import kept_in_float32
    from ..shared.selection import refuse_placeholders

    source_format = find_format(manifest.format)
    plan = plan_transfer(
        manifest,
        select=select,
        include=include,
        exclude=exclude,
        renames=renames,
        dtype=cast,
        keep_objects=target.holds_objects,
        dedupe_tied=target.dedupes_tied,
        opened=opened,
        match_prefix=match_prefix,
        restore_aliases=restore_aliases,
        # the source format's own words for what it cannot hand over (GGUF quantized
        # tensors), whether or not the target holds objects
        left_out=source_format.skip_reason if source_format is not None else None,
        with_scales=True,
        uncast=kept_in_float32(config, cast, (e.name for e in manifest.entries)),
    )
    if select or include or exclude:
        # ZeRO-3's empty parameters are no weights: never picked out without the rebuilt ones
        # (a whole-folder copy carries them as stored, beside the rebuilt weights)
        names = [i.source.name for i in plan.items]
        refuse_placeholders(opened, names, select, manifest.location)
    return plan


def _dry_run_report(
    manifest: Manifest,
    plan: TransferPlan,
    hows: list[str],
    dest: Destination,
    target: type[Format],
    options: WriteOptions,
    cast: str | None,
    warnings: list[str],
) -> ConvertReport:
    """What `convert` would write, from the plan alone: entries, files, sizes; `hows`: how
    each item would be written (`planned_hows`)."""
    entries = [
        WrittenEntry(
            name=i.target.name,
            source=i.source.name,
            kind=i.target.kind,
            dtype=i.target.dtype,
            shape=list(i.target.shape or []),
            nbytes=i.target.nbytes,
            how=how,
        )
        for i, how in zip(plan.items, hows, strict=True)
    ]
    tensors = [i.target for i in plan.items if i.target.kind == "tensor"]
    return ConvertReport(
        source=manifest.location,
        source_format=manifest.format,
        dest=str(dest),
        format=target.name,
        files=planned_files(target, plan, dest, options),
        tensors=len(tensors),
        objects=len(entries) - len(tensors),
        tensor_bytes=sum(e.nbytes for e in tensors),
        raw_copies=hows.count("raw"),
        cast=cast,
        casts=sum(1 for i in plan.items if i.cast),
        renamed=sum(1 for e in entries if e.name != e.source),
        skipped=plan.skipped,
        tied=plan.tied,
        aliases=plan.aliases,
        max_shard_size=options.max_shard_size,
        dcp_serialization=options.dcp_serialization if target.serializations else None,
        world_size=options.world_size if target.shards_by_rank else None,
        entries=entries,
        dry_run=True,
        warnings=warnings,
    )


def _convert_subfolder(
    sub: str, dest: str, to: str, select: str, request: ConvertRequest, progress: Progress
) -> ConvertReport:
    """`convert --select NAME` of a component that is a model folder of its own (`sub`):
    converted as that folder, the include / exclude globs seeing the names inspect shows of
    the whole folder (`unet.conv_in.weight`)."""
    prefix = f"{select.rstrip('.')}."
    named = request.model_copy(update={"match_prefix": prefix})
    report = convert_component(sub, dest, to, named, progress)
    if request.include or request.exclude:
        with open_source(sub).checkpoint as part:
            names = [prefix + e.name for e in part.manifest.entries]
        report.warnings += unmatched_rules(names, request.include, request.exclude)
    return report


def convert_component(
    src: str, dest: str, to: str, request: ConvertRequest, progress: Progress
) -> ConvertReport:
    """`convert` of one component with the request's options (a component is written into
    its own folder of DEST's staging: never replaced, so without `force`)."""
    return convert(src, dest, to, progress=progress, **request.model_dump())


def _convert_components(
    src: str,
    dest: str,
    to: str,
    found: tuple[str, list[Any]],
    request: ConvertRequest,
    progress: Progress,
) -> ConvertReport:
    """Every component of a multi-folder model converted with its own naming, one DEST."""
    from ..shared.components import write_components

    layout, components = found
    left_out, warnings = _left_out_components(src, components, request)
    inner = request.model_copy(update={"force": False})

    def one(comp: Component, component_src: str, component_dest: str, target: str) -> ConvertReport:
        # the globs see the names inspect shows of the whole folder: `unet.conv_in.weight`
        named = inner.model_copy(update={"match_prefix": f"{comp.name}."})
        return convert_component(component_src, component_dest, target, named, progress)

    files, reports = write_components(
        src,
        dest,
        layout,
        components,
        to,
        one,
        force=request.force,
        dry_run=request.dry_run,
        skip=left_out,
    )
    shard_size = request.max_shard_size
    # every file of SRC accounted for: each component's own (prefixed with its folder), and
    # the files copied beside them (`model_index.json`, schedulers, tokenizers...)
    converted = [c for c in components if c.weights is not None and c.name not in left_out]
    bases = [f"{c.path}/" if c.path else "" for c in converted]
    read: list[str] = []
    carried: list[str] = []
    skipped = _left_out_files(src, components, left_out)
    written: set[str] = set()
    for base, report in zip(bases, reports, strict=True):
        read += [f"{base}{r}" for r in report.read]
        carried += [f"{base}{r}" for r in report.extras]
        written.update(f"{base}{f.path}" for f in report.files)
        skipped += [
            s.model_copy(update={"name": f"{base}{s.name}"}) if s.kind == "file" else s
            for s in report.skipped
        ]
    # (a root module's weights keep their library's name, the file they were read from)
    carried += [f.path for f in files if f.path not in written and f.path not in carried + read]
    return ConvertReport(
        source=src,
        source_format=layout,
        dest=dest,
        format=to,
        files=files,
        **summed_counts(reports),
        cast=next((r.cast for r in reports if r.cast), None),
        skipped=skipped,
        read=read,
        extras=carried,
        max_shard_size=shard_size if isinstance(shard_size, int) else None,
        entries=[e for r in reports for e in r.entries],
        dry_run=request.dry_run,
        dequantized=sum(r.dequantized for r in reports),
        quantized_kept=sum(r.quantized_kept for r in reports),
        # components that share a fact (each one's variant renamed by the cast) say it once
        warnings=list(dict.fromkeys(warnings + [w for r in reports for w in r.warnings])),
    )


def summed_counts(reports: list[ConvertReport]) -> dict[str, int]:
    """The counts of several parts' reports (components, rank folders), summed: the report of
    them all holds these."""
    return {
        "tensors": sum(r.tensors for r in reports),
        "objects": sum(r.objects for r in reports),
        "tensor_bytes": sum(r.tensor_bytes for r in reports),
        "raw_copies": sum(r.raw_copies for r in reports),
        "casts": sum(r.casts for r in reports),
        "renamed": sum(r.renamed for r in reports),
    }


def _convert_megatron_save(
    src: str,
    save: WholeSave,
    dest: str,
    to: str,
    naming: str | None,
    request: ConvertRequest,
    progress: Progress,
) -> ConvertReport:
    """`convert` of a whole legacy Megatron-LM save (`megatron_save.whole_save`).

    One rank folder (tensor, pipeline and expert sizes 1) is the model: converted as that
    folder, every option kept, a framework naming included. Several are written each as it is
    named alone, into DEST/<rank folder>/ (one staging folder, published with one rename):
    merging them is no copy (which dimension each weight is split along, the per-stage layer
    numbering, the distributed optimizer's flat buffers all depend on the model and its args),
    and no reader at hand loads a merged legacy save to check it; a framework naming, which
    needs the merged model, is refused."""
    from ...formats.names import is_commit_marker, is_single_file_weights
    from ...sources.layouts.megatron_legacy import sizes_text
    from ...sources.layouts.megatron_save import SAVE_LAYOUT, refuse_export
    from ...storage.output import local_destination, staged_output

    root = save.source.location.raw.rstrip("/")
    if len(save.folders) == 1:
        report = convert_component(
            f"{root}/{save.folders[0]}", dest, naming or to, request, progress
        )
        report.source = src
        return report
    if naming is not None:
        refuse_export(save, naming)
    dest_path = local_destination(resolve_destination(dest))
    if dest_path is None or is_single_file_weights(dest_path.name):
        raise UsageError(
            f"is a legacy Megatron-LM save of {len(save.folders)} rank folders, written each "
            "to its own folder under DEST; DEST must be a local folder",
            path=dest,
            fix="Name a local folder as DEST (out/), or convert one rank folder "
            f"({root}/{save.folders[0]}) to a file.",
        )
    # --filter / --filter-out see the names `ckpt inspect` shows of the whole save
    # (`mp_rank_01_000.model.decoder...`); a rank folder they keep nothing of is left out
    ranks = [Component(name=f, path=f, kind=None, weights=f"{f}/") for f in save.folders]
    left_out, filter_warnings = _left_out_components(src, ranks, request)
    folders = [f for f in save.folders if f not in left_out]
    reports: list[ConvertReport] = []
    files: list[FileInfo] = []

    def one(folder: str, out: Path) -> None:
        named = request.model_copy(update={"force": False, "match_prefix": f"{folder}."})
        report = convert_component(f"{root}/{folder}", str(out / folder), to, named, progress)
        reports.append(report)
        files.extend(f.model_copy(update={"path": f"{folder}/{f.path}"}) for f in report.files)

    if request.dry_run:
        check_destination(dest_path, request.force)
        for folder in folders:
            one(folder, dest_path)
    else:
        with staged_output(dest_path, commit_marker=is_commit_marker, force=request.force) as out:
            for folder in folders:
                one(folder, out)
    # each rank's own "one of the N rank folders" note is this one, said once for the save
    told = {f"{folder}/ is one of the" for folder in save.folders}
    warnings = [
        f"{root} is a legacy Megatron-LM save of {len(save.folders)} rank folders "
        f"({sizes_text(save.sizes)} in its args): each rank folder was converted as it is, "
        "into DEST/<rank folder>/, its slices of the model unmerged"
    ]
    warnings += filter_warnings
    warnings += [w for r in reports for w in r.warnings if not any(w.startswith(t) for t in told)]

    def under(folder: str, names: list[str]) -> list[str]:
        return [f"{folder}/{n}" for n in names]

    first = reports[0]
    return ConvertReport(
        source=src,
        source_format=SAVE_LAYOUT,
        dest=dest,
        format=to,
        files=files,
        **summed_counts(reports),
        cast=first.cast,
        skipped=[
            SkippedEntry(
                name=f, kind="component", reason="every entry left out by --filter/--filter-out"
            )
            for f in save.folders
            if f in left_out
        ]
        + [
            s.model_copy(update={"name": f"{folder}{'/' if s.kind == 'file' else '.'}{s.name}"})
            for folder, r in zip(folders, reports, strict=True)
            for s in r.skipped
        ],
        read=[n for folder, r in zip(folders, reports, strict=True) for n in under(folder, r.read)],
        extras=[
            n for folder, r in zip(folders, reports, strict=True) for n in under(folder, r.extras)
        ],
        max_shard_size=first.max_shard_size,
        dcp_serialization=first.dcp_serialization,
        world_size=first.world_size,
        entries=[
            dataclasses.replace(e, name=f"{folder}.{e.name}", source=f"{folder}.{e.source}")
            for folder, r in zip(folders, reports, strict=True)
            for e in r.entries
        ],
        dry_run=request.dry_run,
        warnings=list(dict.fromkeys(warnings)),
    )


def _left_out_components(
    src: str, components: list[Component], request: ConvertRequest
) -> tuple[set[str], list[str]]:
    """The weight-holding components of which `--filter` / `--filter-out` keep no entry (left
    out whole), and a warning for each of them and for each glob that matches no entry of any
    component. The globs are matched as everywhere else: against the names `ckpt inspect`
    shows of the whole folder (`unet.conv_in.weight`)."""
    include, exclude = request.include, request.exclude
    if not (include or exclude):
        return set(), []
    from ..inspect import select as select_globs

    opened = open_source(src)
    with opened.checkpoint as whole:
        entries = whole.manifest.entries
        names = [e.name for e in entries]
        kept = {e.name for e in select_globs(entries, include, exclude)}
    warnings = unmatched_rules(names, include, exclude, matched="entry of any component")
    weighted = [c for c in components if c.weights is not None]
    left_out = {c.name for c in weighted if not any(n.startswith(f"{c.name}.") for n in kept)}
    if len(left_out) == len(weighted):
        raise NotFoundError(
            "the --filter/--filter-out patterns leave no entry to write",
            path=src,
            fix="Check the patterns against `ckpt inspect --list` (a component's entries are "
            f"named `{weighted[0].name}.<name>`).",
        )
    for name in sorted(left_out):
        warnings.append(
            f"the {name} component is left out whole (--filter/--filter-out keep none of its "
            "entries): the output holds its other files, not its weights"
        )
    return left_out, warnings


def _left_out_files(
    src: str, components: list[Component], left_out: set[str]
) -> list[SkippedEntry]:
    """The components left out whole, and their weight files, as `skipped` lists them."""
    if not left_out:
        return []
    from ...formats import resolve_source
    from ..shared.components import component_weight_files

    listing = resolve_source(src).files
    why = "every entry of the component left out by --filter/--filter-out"
    skipped: list[SkippedEntry] = []
    for comp in components:
        if comp.name in left_out:
            skipped.append(SkippedEntry(name=comp.name, kind="component", reason=why))
            skipped += [
                SkippedEntry(name=rel, kind="file", reason=why)
                for rel in component_weight_files(listing, comp)
            ]
    return skipped


def is_training_file(opened: OpenedSource, rel: str) -> bool:
    """Whether `rel` is a file the source's training layout writes for the save, not for the
    model (`Layout.training_files`): no part of a model folder in a framework naming."""
    if opened.training is None:
        return False
    layout = folder_layout_named(opened.training.layout)
    pattern = layout.training_files if layout is not None else None
    return pattern is not None and pattern.fullmatch(rel) is not None
