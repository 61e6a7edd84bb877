"""`inspect`: what a checkpoint holds, from metadata alone."""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from ..architectures import NamingInfo
from ..errors import NotFoundError
from ..formats import resolve_source
from ..formats.base import Checkpoint, Source
from ..formats.names import LIGHTNING_SUFFIX, SAFETENSORS_SUFFIX
from ..models import Entry, FileInfo, Manifest, Problem, Record, Request, TrainingState
from ..quant import (
    QuantAnalysis,
    QuantSummary,
    analyse_checkpoint,
    parameter_counter,
    prefetch_config,
)
from ..sources.layouts import OpenedSource
from ..sources.layouts.base import is_model_component
from ..sources.layouts.model_folders import LayoutInfo
from ..sources.opening import open_source
from ..sources.runs.records import RunReport
from ..storage import LocalStorage
from ..storage.uri import parse_location
from .shared.selection import name_chosen
from .shared.tree import TreeNode, build_tree, collapse_chains


class InspectReport(Record):
    """The result of `ckpt inspect`.

    Attributes:
        location / format: what was read and as which format.
        files: the checkpoint's files with sizes.
        tensors / objects: entry counts (after filters); tensors stored in a form ckpt does
            not decode (GGUF's quantized ones) count as tensors, their bytes under their type
            in `bytes_by_dtype`.
        parameters: floating-point element count of the model (quantized weights by their
            logical shape): in a training checkpoint,
            the model's weights only (optimizer and other state are in `state_elements`).
        state_elements: floating-point element count of each non-model component of a
            training checkpoint (`optimizer`, `rng`...; `other` for the rest), so
            `parameters` is never inflated by optimizer state.
        tensor_bytes / bytes_by_dtype: sizes.
        metadata / details: format metadata (safetensors `__metadata__`, DCP details...).
        training: the training state, for resumable checkpoints.
        tree: folded module tree.
        entries: every entry (after filters).
        filters: the globs applied.
        excludes: the `--filter-out` globs applied.
        run: for a run folder (`format` is `run`): its step checkpoints (see `ckpt_cli.sources.runs`).
        quantization: for a quantized checkpoint: the scheme per module group, logical
            parameters next to stored bytes, unquantized modules (see `ckpt_cli.quant`).
        layout: the library layout of a model folder (PEFT adapter, diffusers pipeline...).
        architecture: the model family of the weights and the framework naming them (`llama3`
            in `torchtitan` names: what `convert --to hf` maps), None when no family is known.
        problems: format-rule violations that do not stop reading (a safetensors file with
            trailing bytes, a hole between tensors, a first tensor not at offset 0): what
            `verify` reports too; `ckpt inspect` exits 4 when there are any.
        part_of: what part of a larger checkpoint SRC is, when it is one (a legacy Megatron-LM
            rank folder: one rank's slices of the model), for people; None for a whole one.
        alias_of: when SRC is a link to another folder beside it (`RUN/best ->
            global_step100`, as users name a save): that folder's path relative to SRC's
            parent; SRC reads as that folder. None for anything else.
    """

    location: str
    format: str
    files: list[FileInfo]
    tensors: int
    objects: int
    parameters: int
    state_elements: dict[str, int] = Field(default_factory=dict)
    tensor_bytes: int
    bytes_by_dtype: dict[str, int]
    metadata: dict[str, str] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    training: TrainingState | None = None
    tree: list[TreeNode] = Field(default_factory=list)
    entries: list[Entry] = Field(default_factory=list)
    filters: list[str] = Field(default_factory=list)
    excludes: list[str] = Field(default_factory=list)
    run: RunReport | None = None
    quantization: QuantSummary | None = None
    layout: LayoutInfo | None = None
    problems: list[Problem] = Field(default_factory=list)
    architecture: NamingInfo | None = None
    part_of: str | None = None
    alias_of: str | None = None


def select(
    entries: list[Entry],
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    prefix: str = "",
) -> list[Entry]:
    """Entries matching any `include` glob (all if none) and no `exclude` glob; the globs see
    each name as `prefix + name` (a multi-folder model's component: `unet.` + its own name)."""
    if not include and not exclude:
        return entries
    return [e for e in entries if name_chosen(prefix + e.name, include, exclude)]


class InspectRequest(Request):
    """The options of `inspect`, typed and frozen (a test holds them to `inspect`'s parameters
    and the command's options; `--list` only chooses what the text output shows).

    Attributes:
        format: read SRC as this format instead of detecting it (a run folder as a checkpoint).
        filters: globs choosing the entries reported (`unet.*`, `*.weight`).
        excludes: globs leaving entries out of the report (`--filter-out`).
    """

    format: str | None = None
    filters: list[str] | None = None
    excludes: list[str] | None = None


def inspect(
    src: str,
    format: str | None = None,
    filters: list[str] | None = None,
    excludes: list[str] | None = None,
) -> InspectReport:
    """Read `src`'s metadata and summarise it (no tensor data is read).

    A local run folder (one holding step checkpoints: `checkpoint-N/`, `step-N/`...) is
    reported as its table of checkpoints instead; `format` forces reading it as a checkpoint.
    """
    # the manifest, tree and report are hundreds of thousands of small objects and no
    # cycles: with the cyclic GC on, its full collections over the growing heap cost a
    # quarter of the CPU time on 100,000 tensors (bench/bench_metadata.py)
    return inspect_with(src, InspectRequest(format=format, filters=filters, excludes=excludes))


def inspect_with(src: str, request: InspectRequest) -> InspectReport:
    """`inspect` of `src` as `request` says (the command's one call)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _inspect(src, request)
    finally:
        if enabled:
            gc.enable()


def _inspect(src: str, request: InspectRequest) -> InspectReport:
    format, filters, excludes = request.format, request.filters, request.excludes
    # a remote SRC is resolved (listed, its Hub revision pinned) once: the run check, the run
    # scan and the opening all read that
    source: str | Source = src if parse_location(src).is_local else resolve_source(src)
    if format is None and not filters and not excludes and _could_be_run(src):
        from ..sources.runs import looks_like_run, scan_run

        if looks_like_run(source):
            run = scan_run(source)
            return InspectReport(
                location=src,
                format="run",
                files=[],
                tensors=0,
                objects=0,
                parameters=0,
                tensor_bytes=0,
                bytes_by_dtype={},
                run=run,
            )
    if isinstance(source, Source):
        # read once the headers are (the quantization); on their way meanwhile
        prefetch_config(source.storage)
    opened = open_source(source, format)
    with opened.checkpoint as checkpoint:
        manifest = checkpoint.manifest
        entries = select(manifest.entries, filters, excludes)
        if (filters or excludes) and not entries:
            raise NotFoundError(
                "the --filter/--filter-out patterns leave no entry",
                path=src,
                fix="Check the pattern; `ckpt inspect --list` lists every name.",
            )
        chosen = filters or excludes
        view = manifest.model_copy(update={"entries": entries}) if chosen else manifest
        # the quantization of the whole checkpoint: a filter's entries are counted by it too
        analysis = analyse_checkpoint(manifest, checkpoint.storage)
        count = parameter_counter(manifest, checkpoint.storage, analysis)
        if opened.ranks:
            parameters, state_elements = _split_ranks(view, opened, count)
        else:
            parameters, state_elements = _split_parameters(view, opened.training, count)
        # tensors stored in a form ckpt does not decode (GGUF's Q4_K, Q8_0...) are entries of
        # their own kind, but weights all the same: counted with their logical shape, their
        # stored bytes under their type
        stored = [e for e in entries if e.kind != "tensor" and checkpoint.stored_as(e.name)]
        by_type = view.bytes_by_dtype()
        for e in stored:
            by_type[e.dtype or "stored"] = by_type.get(e.dtype or "stored", 0) + e.nbytes
        # packed weights (GPTQ, bitsandbytes...) count their logical values and quantized
        # weights their dequantized ones, scales nothing: the quantization section's count
        quantization = quantization_summary(manifest, analysis)
        return InspectReport(
            location=manifest.location,
            format=manifest.format,
            files=manifest.files,
            tensors=sum(1 for e in entries if e.kind == "tensor") + len(stored),
            objects=sum(1 for e in entries if e.kind == "object") - len(stored),
            parameters=parameters + sum(e.numel for e in stored),
            state_elements=state_elements,
            tensor_bytes=view.tensor_bytes() + sum(e.nbytes for e in stored),
            bytes_by_dtype=dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
            metadata=manifest.metadata,
            details=manifest.details,
            training=opened.training,
            tree=[collapse_chains(node) for node in build_tree(entries)],
            entries=entries,
            filters=list(filters or []),
            excludes=list(excludes or []),
            quantization=quantization,
            layout=opened.layout,
            problems=malformed(checkpoint),
            # a whole save's rank folders hold slices and each stage's own layers: no model
            architecture=None if opened.ranks else _naming(opened, entries, manifest, stored),
            part_of=opened.part_of,
            alias_of=_alias_of(src),
        )


def _alias_of(src: str) -> str | None:
    """The folder beside it that a local `src` is a link to (`RUN/best -> global_step100`);
    None when it is no such link (one leading out of its parent folder included)."""
    location = parse_location(src)
    path = location.path
    if not location.is_local or path is None or not path.is_symlink():
        return None
    return LocalStorage(path.parent).alias_of(path.name)


def _naming(
    opened: OpenedSource, entries: list[Entry], manifest: Manifest, stored: list[Entry]
) -> NamingInfo | None:
    """The family and naming of the model's weights: a training checkpoint's `model`
    component (names as `--select model` takes them), or every tensor of a model, those
    `stored` in a form ckpt does not decode (a GGUF's Q8_0 weights) included."""
    from ..architectures import naming_info
    from .shared.selection import select_entries

    tensors = [e for e in entries if e.kind == "tensor"] + stored
    training = opened.training
    if training is not None and "model" in training.prefixes:
        chosen = select_entries(opened, tensors, "model", manifest)
        if chosen.component is not None:
            return naming_info([name for _, name in chosen.pairs], component="model")
    return naming_info([e.name for e in tensors])


#: file names no run scanner takes for a step checkpoint: names without a digit (a step
#: checkpoint file is numbered; Lightning's `.ckpt` files are excluded apart) and numbered
#: safetensors shards of one model (`model-00001-of-00004.safetensors`)
_PLAIN_MODEL_FILE = re.compile(r"[^0-9]*|.*-\d+-of-\d+\.safetensors", re.ASCII | re.DOTALL)


def _could_be_run(src: str) -> bool:
    """Whether `src` may be a run folder (`runs.looks_like_run` decides), from one listing.

    A run folder holds step checkpoints: subfolders, numbered files or Lightning `.ckpt`
    files. A local file, or a folder of model files (shards, JSON, tokenizer, README), is
    never one, so inspecting a model does not import the run scanners."""
    if "://" in src and not src.startswith("file://"):
        return True
    try:
        with os.scandir(src) as listing:
            for item in listing:
                if (
                    item.is_dir()
                    or item.name.endswith(LIGHTNING_SUFFIX)
                    or not _PLAIN_MODEL_FILE.fullmatch(item.name)
                ):
                    return True
    except NotADirectoryError:
        return False
    except OSError:
        return True  # let the run scanner (or the opening) report what is wrong
    return False


def _split_parameters(
    view: Manifest, training: TrainingState | None, count: Callable[[Entry], int]
) -> tuple[int, dict[str, int]]:
    """(model parameters, floating elements of every other component) of a checkpoint, each
    entry counted by `count` (`quant.parameter_counter`: the one rule of every count).

    In a training folder entries are named `<component>.<key>`; the model components are
    the parameters, everything else (optimizer moments, RNG, ...) is state of its own. An
    entry under no component is placed by the layout's prefixes (`state_dict.` is a Lightning
    file's model, `optimizer_states.0.` its optimizer).
    """
    total = sum(count(e) for e in view.entries)
    if training is None or not training.components:
        return total, {}
    by_prefix = sorted(
        ((prefix, role) for role, prefix in training.prefixes.items() if prefix),
        key=lambda pair: -len(pair[0]),
    )
    # a component whose names carry no prefix (a lone optimizer file, torchtitan's model
    # FQNs) holds every entry no other component claims
    whole = next((c for c, prefix in training.prefixes.items() if not prefix), "other")
    per: dict[str, int] = {}
    for e in view.entries:
        counted = count(e)
        if counted:
            component = e.name.split(".", 1)[0]
            if component not in training.components:
                component = next((r for p, r in by_prefix if e.name.startswith(p)), whole)
            per[component] = per.get(component, 0) + counted
    model = sum(n for k, n in per.items() if is_model_component(k))
    if not model and "weights" not in training.missing:
        return total, {}  # a layout whose weights are not under `model*`: all of it is model
    # no weights at all (deleted, cut short): 0 parameters, never the optimizer's moments
    return model, {k: n for k, n in per.items() if not is_model_component(k) and n}


def _split_ranks(
    view: Manifest, opened: OpenedSource, count: Callable[[Entry], int]
) -> tuple[int, dict[str, int]]:
    """`_split_parameters` of a whole save of rank folders (a legacy Megatron-LM `iter_N/`):
    each rank's entries (`<folder>.<name>`) split by its own training state, the figures
    summed, and each rank folder's own parameter count set on the layout's components."""
    by_rank: dict[str, list[Entry]] = {name: [] for name in opened.ranks}
    for e in view.entries:
        folder, _, inner = e.name.partition(".")
        if folder in by_rank:
            by_rank[folder].append(e.model_copy(update={"name": inner}))
    total = 0
    state: dict[str, int] = {}
    per_rank: dict[str, int] = {}
    for folder, rank in opened.ranks.items():
        part = view.model_copy(update={"entries": by_rank[folder]})
        model, others = _split_parameters(part, rank.training, count)
        per_rank[folder] = model
        total += model
        for key, n in others.items():
            state[key] = state.get(key, 0) + n
    if opened.layout is not None:
        for comp in opened.layout.components:
            comp.parameters = per_rank.get(comp.name, comp.parameters)
    return total, state


def quantization_summary(manifest: Manifest, analysis: QuantAnalysis) -> QuantSummary | None:
    """The quantization summary, when the headers or the config files (the checkpoint's
    `analysis`) say it is quantized."""
    from ..quant import summarise

    if not (analysis.quantized or analysis.packed) and analysis.config.method is None:
        return None
    return summarise(manifest, analysis)


def malformed(checkpoint: Checkpoint) -> list[Problem]:
    """The format-rule violations of a local checkpoint's safetensors files that its reader
    tolerates (data not contiguous from offset 0, bytes after the last tensor), or of its GGUF
    files (tensors out of order or with gaps, which llama.cpp refuses): headers only."""
    tolerated = checkpoint.tolerated_problems()
    if tolerated:
        return tolerated
    from ..findings import Findings
    from ..formats.safetensors.format import SafetensorsCheckpoint
    from ..formats.safetensors.header import parse_header

    source = checkpoint.source
    if not source.location.is_local:
        return []  # a remote header costs a request; `verify` checks those
    # the opening parse already noted them; a header with tensors of unknown dtype is parsed
    # again, as the collecting parse also reports those tensors
    noted = {}
    if isinstance(checkpoint, SafetensorsCheckpoint):
        noted = {h.file: h for h in checkpoint.headers if not h.unsupported}
    findings = Findings(strict=False)
    for info in checkpoint.manifest.files:
        if info.path.endswith(SAFETENSORS_SUFFIX) and info.entries:
            header = noted.get(info.path)
            if header is not None:
                findings.problems.extend(header.tolerated)
            else:
                parse_header(source.storage, info.path, info.size, findings)
    # a dtype ckpt does not know is no format-rule violation: inspect lists those tensors as
    # unsupported and reads the rest (`details.unsupported_tensors`)
    return [p for p in findings.problems if p.code != "unknown_dtype"]
