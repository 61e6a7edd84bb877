"""`reshard --world-size` of a whole training folder: resume on another number of ranks.

A training folder (Hugging Face Trainer `checkpoint-N/` with FSDP, accelerate `save_state`, a
DDP Trainer checkpoint...) is one checkpoint of components. Its DCP sub-folders (FSDP's
`pytorch_model_fsdp_0/`, `optimizer_0/`) are re-cut for the new world size, each streamed chunk
by chunk as `ops.reshard_world` does for one DCP; its per-rank files (`rng_state_{r}.pth`,
`random_states_{r}.pkl`: the layout's `rank_files`) follow the one per-rank policy
(`--rank-state keep|drop|replicate`, asked for when the world size changes); every other file
(scheduler, trainer state, replicated weights of a DDP save, config) is copied verbatim, one
block at a time. Hidden files are listed in `skipped` with the reason (a `.ckpt-parity/` folder
is never part of a listing: its parity would not match the new files anyway). Everything is staged
beside DEST and published with one rename after each DCP's structural check.

The report says what became of every file, and whether the output resumes the run: after a
world-size change `resumable` stays the source's and `exact` is false, with why (and the
layout's own warning when the saved data position was counted in a global batch that the new
world size changes: the Trainer's `train_batch_size` x ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from ...dist.placement import Rule
from ...errors import UsageError
from ...formats import get_format
from ...formats.base import Checkpoint, Source
from ...formats.names import DCP_DATA_SUFFIX, DCP_METADATA, RESHARD_RECORD
from ...models import FileInfo
from ...progress import NULL_PROGRESS, Progress
from ...sources.layouts.base import Layout, OpenedSource
from ...storage import safe_relpath
from ...storage.output import check_destination
from ..convert.plan import guard_paths, local_dest
from ..shared.selection import refuse_lost_files
from ..shared.transfer import SkippedEntry
from .rank_files import (
    copy_verbatim,
    missing_rank_files,
    rank_file_plan,
    reshard_record,
    with_record,
)
from .report import (
    RankFile,
    RankStateChoice,
    RankStateEntry,
    ReshardedPart,
    ReshardReport,
)
from .request import ReshardRequest
from .world import (
    DcpCut,
    check_world_options,
    find_rank_state,
    plan_cut,
    rank_state_choice,
    resume_verdict,
    source_world_size,
    write_cuts,
)

#: a DCP folder's own files besides its `*.distcp` data files: written anew by the cut
_DCP_OWN = (DCP_METADATA,)


def dcp_subfolders(source: Source) -> list[str]:
    """The top-level sub-folders of a folder that are DCP checkpoints (`.metadata` inside),
    hidden ones excepted (a parity folder)."""
    found = {
        rel.split("/", 1)[0]
        for rel in source.files
        if rel.count("/") == 1 and rel.endswith("/.metadata") and not rel.startswith(".")
    }
    return sorted(found)


def reshard_folder(
    source: Source,
    opened: OpenedSource,
    layout: Layout,
    dest: str,
    request: ReshardRequest,
    rules: list[Rule],
    progress: Progress = NULL_PROGRESS,
) -> ReshardReport:
    """Reshard the whole training folder `source` (opened as `layout`) for `world_size` ranks.

    Every DCP sub-folder is re-cut; per-rank files follow `rank_state_action` (`keep`: as
    saved; `drop`: left out; `replicate`: the new world's set, each rank its own where it had
    one and a copy of the lowest rank's otherwise, ranks past the new world left out; None:
    carried at the same world size, else a `UsageError` listing them and the choices); every
    other file is copied verbatim (with `extras=False`, but the config / tokenizer files
    `convert` calls extras). `rules` are the request's `--shard-dim` / `--plan`, parsed.
    """
    assert request.world_size is not None
    world_size = request.world_size
    rank_state_action = cast(RankStateChoice | None, request.rank_state)
    serialization, compression = request.dcp_serialization, request.dcp_compression
    force, dry_run, extras = request.force, request.dry_run, request.extras
    src = source.location.raw
    check_world_options(world_size, compression)
    # `--rank-state drop` writes no rank's RNG states: a lost one is then left out knowingly
    refuse_lost_files(opened, "re-cut", rank_state=rank_state_action or "")
    if layout.world_size_cut == "zero":
        if rules or serialization or compression:
            raise UsageError(
                "--shard-dim, --plan and --dcp-* cut DCP checkpoints; a DeepSpeed ZeRO save is "
                "cut by DeepSpeed's own partitioning rule",
                path=src,
                fix="Leave those options out.",
            )
        from .zero import reshard_zero

        return reshard_zero(source, opened, layout, dest, request, progress)
    from ...sources.layouts.composite import RANK_MODEL_FILE, RANK_OPTIMIZER_FILE

    per_rank = sorted(
        rel
        for rel in source.files
        if RANK_MODEL_FILE.fullmatch(rel) or RANK_OPTIMIZER_FILE.fullmatch(rel)
    )
    if per_rank:
        # each file is one rank's part of every parameter, loaded back only by that rank
        raise UsageError(
            f"--world-size does not re-cut FSDP state saved one file per rank yet ({per_rank[0]}"
            f"{f' and {len(per_rank) - 1} more' if len(per_rank) > 1 else ''}): the framework "
            "loads each file on the rank that saved it, at the world size that saved it",
            path=src,
            fix="Load it at its own world size and save it again as DCP (accelerate's default "
            "SHARDED_STATE_DICT save, `use_dcp=True`), which --world-size re-cuts; or convert "
            "the whole folder (`ckpt convert SRC OUT --to dcp`) to keep every rank's part.",
        )
    out = local_dest(dest)
    guard_paths(src, out)
    check_destination(out.absolute(), force)
    subfolders = dcp_subfolders(source)
    component_of = {
        rel.rstrip("/"): comp for comp, (rel, fmt) in opened.parts.items() if rel.endswith("/")
    }
    parts = _open_parts(source, subfolders)
    try:
        rank_files = {
            rel: rank
            for rel in sorted(source.files)
            if "/" not in rel and (rank := layout.rank_file_rank(rel)) is not None
        }
        before = max(
            [source_world_size(cp) for cp in parts.values()]
            + [max(rank_files.values()) + 1 if rank_files else 1]
        )
        names = list(rank_files)
        for sub, checkpoint in parts.items():
            names.extend(f"{sub}/{e.name}" for e in find_rank_state(checkpoint.manifest.entries))
        action = rank_state_choice(src, names, rank_state_action, before, world_size)
        cuts = [
            plan_cut(
                checkpoint,
                world_size,
                rules=rules,
                action=action,
                serialization=serialization,
                compression=compression,
                into=f"{sub}/",
                extras=_dcp_extras(source, sub, checkpoint),
                world_size_entries=layout.rank_state_world_size,
            )
            for sub, checkpoint in parts.items()
        ]
        files_out = rank_file_plan(layout, rank_files, action, world_size)
        carried, skipped = _carried(source, subfolders, rank_files)
        if not extras:
            from ..shared.transfer import extra_files

            left_out = set(extra_files(opened.checkpoint))
            skipped += [
                SkippedEntry(name=r, kind="file", reason="left out (--no-extras)")
                for r in carried
                if r in left_out
            ]
            carried = [r for r in carried if r not in left_out]
        report = ReshardReport(
            mode="world-size",
            source=src,
            destination=str(out),
            format=opened.checkpoint.manifest.format,
            layout=layout.name,
            tensors=sum(c.report.tensors for c in cuts),
            objects=sum(c.report.objects for c in cuts),
            tensor_bytes=sum(c.report.tensor_bytes for c in cuts),
            source_world_size=before,
            world_size=world_size,
            serialization=cuts[0].report.serialization if cuts else None,
            partitioning="chunks",
            replicated=sum(c.report.replicated for c in cuts),
            rules=[str(r) for r in rules],
            unused_rules=sorted(set.intersection(*(set(c.report.unused_rules) for c in cuts)))
            if cuts
            else [str(r) for r in rules],
            rank_state=[e for c in cuts for e in _prefixed(c)],
            rank_state_action=action if names else None,
            parts=[
                ReshardedPart(
                    path=c.into,
                    component=component_of.get(c.into.rstrip("/"), c.into.rstrip("/")),
                    source_world_size=c.report.source_world_size or 1,
                    tensors=c.report.tensors,
                    objects=c.report.objects,
                    tensor_bytes=c.report.tensor_bytes,
                )
                for c in cuts
            ],
            rank_files=files_out,
            carried=carried,
            skipped=skipped,
        )
        for cut in cuts:
            for dim, n in cut.report.sharded.items():
                report.sharded[dim] = report.sharded.get(dim, 0) + n
            report.warnings.extend(w for w in cut.report.warnings if w not in report.warnings)
        notes = layout.batch_notes(opened, before, world_size)
        report.warnings.extend(notes)
        notes = notes + missing_rank_files(layout, files_out, rank_files, world_size, before)
        report.resume = resume_verdict(opened.training, report, notes)
        record = reshard_record(source, before, world_size, action)
        if dry_run:
            report.files = _planned(cuts, carried, files_out, source)
            report.files = with_record(report.files, record)
            report.dry_run = True
            return report

        def carry(staging: Path) -> None:
            for rel in carried:
                copy_verbatim(source, rel, staging / safe_relpath(rel, source=src))
            for item in files_out:
                for name in item.written:
                    copy_verbatim(source, item.path, staging / safe_relpath(name, source=src))
            if record is not None:
                # written after what was carried: a record the source had says an older cut
                (staging / RESHARD_RECORD).write_bytes(record)

        result = write_cuts(cuts, out, force, progress, carry)
        written = [FileInfo.model_validate(f) for f in result["files"]]
        written += [FileInfo(path=rel, size=source.files.get(rel)) for rel in carried]
        written += [
            FileInfo(path=name, size=source.files.get(item.path))
            for item in files_out
            for name in item.written
        ]
        report.files = with_record(written, record)
        report.verified = True
        from ...dist.command import RankShare

        report.ranks = [RankShare.model_validate(r) for r in result["shares"]]
        return report
    finally:
        for checkpoint in parts.values():
            checkpoint.close()


def _open_parts(source: Source, subfolders: list[str]) -> dict[str, Checkpoint]:
    """Each DCP sub-folder opened as its own checkpoint."""
    from ...sources.layouts import subfolder_source

    parts: dict[str, Checkpoint] = {}
    try:
        for sub in subfolders:
            parts[sub] = get_format("dcp").open(subfolder_source(source, sub))
    except BaseException:
        for checkpoint in parts.values():
            checkpoint.close()
        raise
    return parts


def _dcp_extras(source: Source, sub: str, checkpoint: Checkpoint) -> list[str]:
    """Files inside a DCP sub-folder that are not DCP's own (copied beside the re-cut one)."""
    own = {f.path for f in checkpoint.manifest.files} | set(_DCP_OWN)
    prefix = f"{sub}/"
    out = []
    for rel in sorted(source.files):
        if not rel.startswith(prefix):
            continue
        inner = rel[len(prefix) :]
        name = inner.rsplit("/", 1)[-1]
        if inner in own or name.startswith(".") or inner.endswith(DCP_DATA_SUFFIX):
            continue
        out.append(inner)
    return out


def _prefixed(cut: DcpCut) -> list[RankStateEntry]:
    """A cut's per-rank entries, named with the sub-folder they are in."""
    return [
        e.model_copy(
            update={
                "name": f"{cut.into}{e.name}",
                "written": None if e.written is None else [f"{cut.into}{n}" for n in e.written],
            }
        )
        for e in cut.report.rank_state
    ]


def _carried(
    source: Source, subfolders: list[str], rank_files: dict[str, int]
) -> tuple[list[str], list[SkippedEntry]]:
    """(files copied verbatim, files left out with why): everything outside the DCP
    sub-folders but the per-rank files (their own policy) and hidden files."""
    carried: list[str] = []
    skipped: list[SkippedEntry] = []
    inside = tuple(f"{sub}/" for sub in subfolders)
    for rel in sorted(source.files):
        if rel.startswith(inside) or rel in rank_files:
            continue
        if any(part.startswith(".") for part in rel.split("/")):
            skipped.append(
                SkippedEntry(
                    name=rel, kind="file", reason="a hidden file: not part of the training state"
                )
            )
        else:
            carried.append(rel)
    return carried, skipped


def _planned(
    cuts: list[DcpCut], carried: list[str], files_out: list[RankFile], source: Source
) -> list[FileInfo]:
    """`--dry-run`: the files each cut would write, then those copied."""
    from .world import planned_rank_files

    files: list[FileInfo] = []
    for cut in cuts:
        files.extend(
            f.model_copy(update={"path": f"{cut.into}{f.path}"})
            for f in planned_rank_files(cut.fmt, cut.plan, cut.options.world_size)
        )
    files += [FileInfo(path=rel, size=source.files.get(rel)) for rel in carried]
    files += [
        FileInfo(path=name, size=source.files.get(item.path))
        for item in files_out
        for name in item.written
    ]
    return files
