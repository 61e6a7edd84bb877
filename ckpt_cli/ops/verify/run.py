"""`verify`: is a checkpoint complete, intact and resumable? Every problem, not just the first.

Checks, cheapest first:

* structure (always): the format adapter's `check` (headers, offsets, file sizes, index
  against shards, DCP chunk coverage...), from metadata and file sizes only;
* `resumable`: the training state is complete enough to resume the run;
* `checksums` / `write_manifest`: every file hashed in parallel threads and compared with (or
  recorded in) a `ckpt-manifest.json`;
* `deep`: every tensor read, one at a time, and counted for NaN/Inf.

Nothing here writes to the checkpoint except the manifest `write_manifest` asks for (written
atomically, and only when no problem was found).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ... import models
from ...dist.command import CombinedProgress, active
from ...errors import CkptError, CorruptDataError, UnsafeInputError, UsageError
from ...findings import problem_from_error, restore_fix
from ...formats import get_format, holds_only_nested_checkpoints, resolve_source
from ...formats.base import Checkpoint, Source
from ...heap import gc_paused
from ...models import Problem, ProblemList, Request
from ...progress import NULL_PROGRESS, Progress
from ...sizes import counted
from ...sources.layouts import OpenedSource
from ...sources.opening import SourceOpener, recognise_layout
from ...storage.hashing import ALGORITHMS
from ..parity import ParityCheck, check_parity, damage_text
from .checksum_manifest import MANIFEST_NAME, manifest_exists, manifest_location
from .checksums import checksum_checks
from .report import TensorHealth, VerifyReport
from .structure import structure_checks

if TYPE_CHECKING:
    import torch

#: elements per NaN/Inf counting step: bounds the temporary masks for huge tensors
_COUNT_STEP = 1 << 24
#: a raw-stored tensor larger than this is counted from its bytes a block this size at a time
#: (`_deep_streamed`), never held whole
_STREAM_BYTES = 16 << 20


class VerifyRequest(Request):
    """Every option of `verify` but the location, typed and frozen: validated once by
    `verify_with` and passed whole to each check, so no option is re-listed by hand. Its
    fields are `verify`'s keyword parameters and the command's options (a test holds them to
    each other); `progress` is a sink, not an option, and travels beside it. The fields mean
    what `verify`'s arguments say."""

    format: str | None = None
    checksums: bool = False
    write_manifest: bool = False
    manifest: str | None = None
    algo: str | None = None
    deep: bool = False
    resumable: bool = False
    force: bool = False
    exact: bool = False


def verify(
    src: str,
    *,
    format: str | None = None,
    checksums: bool = False,
    write_manifest: bool = False,
    manifest: str | None = None,
    algo: str | None = None,
    deep: bool = False,
    resumable: bool = False,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    exact: bool = False,
) -> VerifyReport:
    """Check `src` and report every problem found.

    Args:
        src: checkpoint file or folder, or `hf://` location.
        format: read as this format instead of detecting it.
        checksums: hash every file and compare with the manifest.
        write_manifest: hash every file and record the digests in a manifest.
        manifest: manifest path (default `ckpt-manifest.json` in the checkpoint folder).
        algo: hash algorithm for `write_manifest` (checks use the manifest's own).
        deep: read every tensor, count NaN/Inf, check every entry deserialises.
        resumable: training must be able to continue: missing weights, optimizer state or
            progress counter is an error; what only an exact resume needs (scheduler, step,
            RNG, data-loader state) is a warning.
        exact: (implies `resumable`) the resumed run must be bit-identical: those are errors.
        force: let `write_manifest` replace an existing manifest.
        progress: receives hashing and reading progress.

    Raises:
        NotFoundError (exit 3) or FormatError (exit 4) when SRC cannot be read at all;
        UsageError for contradictory options. Problems found are returned, not raised.
    """
    request = VerifyRequest(
        format=format,
        checksums=checksums,
        write_manifest=write_manifest,
        manifest=manifest,
        algo=algo,
        deep=deep,
        resumable=resumable,
        force=force,
        exact=exact,
    )
    return verify_with(src, request, progress)


def verify_with(
    src: str, request: VerifyRequest, progress: Progress = NULL_PROGRESS
) -> VerifyReport:
    """`verify` of `src` as `request` says (the command's one call)."""
    format, checksums, write_manifest = request.format, request.checksums, request.write_manifest
    manifest, algo, deep, force = request.manifest, request.algo, request.deep, request.force
    # --exact implies --resumable: decided once, here, for every check below
    request = request.model_copy(update={"resumable": request.resumable or request.exact})
    resumable = request.resumable
    # under torchrun: join the launch now, so rank 0 alone reports even when nothing is hashed
    active()
    if checksums and write_manifest:
        raise UsageError(
            "--checksums and --write-manifest do not go together",
            fix="Write the manifest once (--write-manifest), then check with --checksums.",
        )
    # an option that would do nothing is refused, not ignored: `--manifest m.json` alone
    # checked nothing and said OK
    alone = [
        option
        for option, given in (
            (f"--algo {algo}", algo is not None),
            ("--force", force),
        )
        if given and not write_manifest
    ]
    if alone:
        # why each would do nothing: a check reads the algorithm the manifest records, and
        # there is no manifest to replace unless one is written
        why = [
            "checking uses the algorithm the manifest records"
            if option.startswith("--algo")
            else "only a manifest being written replaces one"
            for option in alone
        ]
        raise UsageError(
            f"{' and '.join(alone)} {'applies' if len(alone) == 1 else 'apply'} to "
            f"--write-manifest only ({'; '.join(why)})",
            fix=f"Add --write-manifest to record a manifest, or leave "
            f"{'it' if len(alone) == 1 else 'them'} out.",
        )
    if manifest is not None and not (checksums or write_manifest):
        raise UsageError(
            f"--manifest {manifest} names the manifest of --checksums or --write-manifest, and "
            "neither was given: nothing would be checked against it",
            fix="Add --checksums to check against it (or --write-manifest to write it).",
        )
    if algo is not None and algo not in ALGORITHMS:
        raise UsageError(f"unknown --algo {algo!r}", fix=f"Use one of {', '.join(ALGORITHMS)}.")
    # SRC is resolved once (one listing, one Hub lookup) and opened at most once: every check
    # below gets this source, or the one opened from it
    source = resolved = resolve_source(src)
    if not resolved.location.is_local:
        from ...quant import prefetch_config

        # read once the structure is checked (the quantization); on its way meanwhile
        prefetch_config(resolved.storage)
    # a training folder (Trainer, accelerate, DeepSpeed) is checked component by component
    opened = recognise_layout(source) if format is None else None
    opener = SourceOpener(resolved, format)
    # a whole legacy Megatron-LM save (`iter_N/mp_rank_*/`): every rank folder, each as
    # verify checks one (the run folders' names imported here alone: a plain model's
    # verify never loads them, start-up #30)
    whole_save = None
    if format is None and opened is None and holds_only_nested_checkpoints(source):
        from ...sources.layouts.megatron_save import save_checks

        whole_save = save_checks(source, resumable, request.exact)
    try:
        if whole_save is not None:
            from ...sources.runs.naming import MEGATRON

            name, problems = MEGATRON, ProblemList(whole_save)
        else:
            name, source, problems = structure_checks(source, format, opener, opened)
        report = VerifyReport(
            location=source.location.raw, format=name, ok=True, checks=["structure"]
        )
        # a file linked out of the checkpoint is no part of it: reported, never counted, read
        # or hashed (it counted in `files` and `bytes`, and --write-manifest hashed the file
        # it leads to, /etc/passwd included, while convert refused the folder)
        outside = source.storage.links_out(source.files)
        problems.extend(_links_out(source, outside, problems))
        # the manifest is not part of what it describes
        considered = {
            n: size for n, size in source.files.items() if n != MANIFEST_NAME and n not in outside
        }
        # a Trainer's `output_dir`: the final model at the root, the run's saves beside it,
        # each a checkpoint of its own (they were counted as this one's, and never checked)
        # (the run-name rules are imported only for a folder with sub-folders: a model
        # folder of shards pays nothing for them)
        nested = []
        if source.target is None and any("/" in n for n in source.files):
            from ...sources.runs.naming import nested_saves

            nested = nested_saves(source.files)
        # nor hashed into (or checked against) this checkpoint's manifest: each has its own
        skipped = set(outside) | {n for n in source.files if n.split("/")[0] in nested}
        if nested:
            considered = {
                n: size for n, size in considered.items() if n.split("/")[0] not in nested
            }
            problems.append(_nested_saves(source, nested))
        report.files = len(considered)
        report.bytes = sum(considered.values())
        report.training = opened.training if opened is not None else None
        if whole_save is not None:
            # each rank folder was checked on its own, its training state too
            report.checks += ["resumable"] if resumable else []
            if deep:
                problems.append(_deep_per_rank(source))
        else:
            if not any(p.severity == "error" for p in problems):
                _quant_checks(report, problems, name, source, opener, opened, deep=deep)
            if resumable or deep:
                _open_checks(report, problems, src, opener, opened, request, progress)
    finally:
        if opened is not None:
            opened.checkpoint.close()
        opener.close()
    parity = (
        check_parity(resolved, checksums=checksums, progress=progress)
        if source.location.kind != "hf"
        else None
    )
    # a protected checkpoint carries its own digests: without a ckpt-manifest.json the parity
    # manifest's per-block digests are the checksums
    if (
        checksums
        and manifest is None
        and parity is not None
        and not manifest_exists(manifest_location(source, None))
    ):
        checksums = False
        report.checks.append("checksums")
    if checksums or write_manifest:
        checksum_checks(
            report,
            problems,
            source,
            write=write_manifest,
            manifest=manifest,
            algo=algo,
            force=force,
            progress=progress,
            outside=skipped,
        )
    if parity is not None:
        _parity_problems(report, problems, parity)
    report.problems = problems
    report.errors = problems.found("error")
    report.warnings = problems.found("warning")
    report.ok = report.errors == 0
    return report


def _deep_per_rank(source: Source) -> Problem:
    """The warning for `--deep` of a whole legacy Megatron-LM save: its tensors are read one
    rank folder at a time."""
    where = source.location.raw.rstrip("/")
    return Problem(
        code="not_checked",
        severity="warning",
        message=f"{where}: --deep reads the tensors of one rank folder at a time; the whole "
        "save's were not read",
        file=where,
        fix=f"Run `ckpt verify {where}/RANK_FOLDER --deep` for each rank folder (`mp_rank_00`...).",
    )


def _nested_saves(source: Source, nested: list[str]) -> Problem:
    """The warning for the saves of a run beside the checkpoint at a folder's root."""
    where = source.location.raw.rstrip("/")
    shown = ", ".join(f"{n}/" for n in nested[:4]) + (
        f" and {len(nested) - 4} more" if len(nested) > 4 else ""
    )
    return Problem(
        code="nested_saves",
        severity="warning",
        message=f"{where}: also holds {counted(len(nested), 'save')} of a run ({shown}), each a "
        "checkpoint of its own: not checked or counted here",
        file=where,
        fix=f"Verify a save by its folder (`ckpt verify {where}/{nested[-1]}`); `ckpt latest "
        f"{where}` names the newest complete one.",
    )


def _links_out(source: Source, outside: dict[str, str], found: list[Problem]) -> list[Problem]:
    """One `unsafe_input` error per file linked out of the checkpoint (`outside`: name -> where
    it leads) that the structural check did not already report (it does for a file it reads)."""
    storage = source.storage
    told = {p.file for p in found if p.code == "unsafe_input"}
    return [
        Problem(
            code="unsafe_input",
            message=f"{storage.describe(name)}: is a link that points outside the checkpoint "
            f"({target}): no part of it, so it is not counted, read or hashed",
            file=storage.describe(name),
            fix="Copy the file into the checkpoint folder instead of linking it, or remove the "
            "link if the checkpoint does not need it.",
        )
        for name, target in sorted(outside.items())
        if storage.describe(name) not in told
    ]


@gc_paused()  # a fact a tensor (100,000), no cycles: see `heap`
def _quant_checks(
    report: VerifyReport,
    problems: list[Problem],
    format_name: str,
    source: Source,
    opener: SourceOpener,
    opened: OpenedSource | None,
    *,
    deep: bool,
) -> None:
    """Quantized weights against their sidecars and the config (headers; scale values with deep)."""
    from ...quant import analyse_checkpoint, analyse_tensors, read_config

    # the tensors' names, dtypes and shapes as the structural check parsed them are all the
    # analysis reads: no manifest is built for it (90,000 entries of DeepSeek-V3, a fifth of
    # its verify); --deep reads scale values, and opens the checkpoint for them
    checked = opened is None and not deep
    tensors = get_format(format_name).checked_tensors(source) if checked else None
    checkpoint: Checkpoint | None = None
    if tensors is not None:
        analysis = analyse_tensors(tensors, read_config(source.storage), source.location.raw)
    else:
        try:
            checkpoint = (opened if opened is not None else opener.get()).checkpoint
        except CkptError:
            return  # what stops opening is already a structural problem
        analysis = analyse_checkpoint(checkpoint.manifest, checkpoint.storage)
    if not (analysis.quantized or analysis.packed) and analysis.config.method is None:
        return
    report.checks.append("quantization")
    problems.extend(analysis.problems)
    if deep:
        from ...quant.dequant import scale_value_problems

        assert checkpoint is not None  # opened above for --deep
        problems.extend(scale_value_problems(checkpoint, analysis))


def _parity_problems(report: VerifyReport, problems: list[Problem], parity: ParityCheck) -> None:
    """What the parity manifest says: damage located to the block, and what repair can do."""
    report.checks.append("parity")
    report.parity = parity
    report.hashed_bytes += parity.hashed_bytes
    if report.algorithm is None and parity.hashed_bytes:
        report.algorithm = "xxh3 blocks"
    src = report.location
    repair = f"Run `ckpt repair {src}`: it rebuilds the file bit-exact from the parity."
    beyond = [d.path for d in parity.damaged if not d.repairable]
    if beyond:
        # repair is all or nothing: while one file is beyond the parity it changes none
        shown = ", ".join(beyond[:3]) + (f" and {len(beyond) - 3} more" if len(beyond) > 3 else "")
        repair = (
            f"Restore {shown} from a good copy first: `ckpt repair {src}` changes nothing while "
            "a file is beyond the parity; then it rebuilds this file bit-exact."
        )
    damaged = {d.path: d for d in parity.damaged}
    # the problems other checks found in these files get the repair verdict too, and the
    # repair as their fix where the parity can rebuild the file
    for problem in problems:
        if problem.file in damaged:
            problem.repairable = damaged[problem.file].repairable
            if problem.repairable:
                problem.fix = repair
    for d in parity.damaged:
        verdict = (
            ("repairable once the files beyond the parity are restored" if beyond else "repairable")
            if d.repairable
            else f"NOT repairable: more than {parity.parity} losses in a stripe"
        )
        if d.repairable:
            fix = repair
        elif d.kind == "parity":
            fix = f"The data is intact: write the parity again with `ckpt protect {src} --force`."
        else:
            fix = restore_fix(src)
        if d.kind == "parity":
            code, severity = "parity_damaged", "warning"
        elif d.state == "missing":
            code, severity = "lost_file", "error"
        else:
            code, severity = "damaged_blocks", "error"
        problems.append(
            Problem(
                code=code,
                message=f"{damage_text(d)} (against the parity manifest; {verdict})",
                file=d.path,
                severity=severity,
                repairable=d.repairable,
                fix=fix,
            )
        )
    for line in parity.misrecorded:
        problems.append(
            Problem(
                code="parity_damaged",
                message=line,
                file=parity.manifest,
                severity="warning",
                fix=f"The data is intact: write the parity again with `ckpt protect {src} "
                "--force`.",
            )
        )
    for name in parity.stale:
        if name in beyond:  # the parity cannot bring it back: said beside its damage
            restore = "restore it from a good copy"
        elif beyond:
            restore = f"`ckpt repair {src}` restores it once the files beyond the parity are"
        else:
            restore = f"`ckpt repair {src}` restores it"
        problems.append(
            Problem(
                code="parity_stale",
                message=f"{name}: modified after `ckpt protect` wrote the parity",
                file=name,
                severity="warning",
                fix=f"If the change was intended run `ckpt protect {src} --force`, else "
                f"{restore} (check with `ckpt verify {src} --checksums`).",
            )
        )
    for name in parity.unprotected:
        problems.append(
            Problem(
                code="unprotected_file",
                message=f"{name}: added after `ckpt protect` (no parity covers it)",
                file=name,
                severity="warning",
                fix=f"Run `ckpt protect {src} --force` to cover it.",
            )
        )


# ---------------------------------------------------------------- training state and --deep


def _open_checks(
    report: VerifyReport,
    problems: list[Problem],
    src: str,
    opener: SourceOpener,
    opened: OpenedSource | None,
    request: VerifyRequest,
    progress: Progress,
) -> None:
    """Checks that need the checkpoint opened: resumability and reading every entry."""
    resumable, deep = request.resumable, request.deep
    if any(p.severity == "error" for p in problems):
        # the structural problems are the story; reading on would only repeat them
        skipped = " and ".join(c for c, on in (("resumability", resumable), ("deep", deep)) if on)
        problems.append(
            Problem(
                code="not_checked",
                message=f"{src}: skipped the {skipped} checks because of the problems above",
                file=src,
                severity="warning",
                fix="Fix the problems above, then run the same command again.",
            )
        )
        return
    if opened is None:
        try:
            opened = opener.get()
        except CkptError as error:
            problems.append(problem_from_error(error))
            return
    report.training = opened.training
    with opened.checkpoint as checkpoint:
        if resumable:
            from ...sources.layouts.training import training_checks

            report.checks.append("resumable")
            # the layout's own findings (`OpenedSource.problems`) were said by the structural
            # check already: once is enough
            said = {(p.code, p.file, p.message) for p in problems}
            problems.extend(
                p
                for p in training_checks(opened, exact=request.exact)
                if (p.code, p.file, p.message) not in said
            )
        if deep:
            report.checks.append("deep")
            _deep(report, problems, checkpoint, progress)


def _deep(
    report: VerifyReport, problems: list[Problem], checkpoint: Checkpoint, progress: Progress
) -> None:
    """Read every entry once; count NaN/Inf of floating tensors.

    Under torchrun each rank reads a byte-balanced share of the entries; the findings are
    gathered and kept in manifest order, so every rank reports what one process would.
    """
    manifest = checkpoint.manifest
    workers = active()
    entries = manifest.entries
    mine = workers.mine([e.nbytes for e in entries]) if workers.distributed else range(len(entries))
    progress = CombinedProgress(progress, workers, total=manifest.tensor_bytes())
    progress.start(
        sum(entries[i].nbytes for i in mine if entries[i].kind == "tensor"), "reading tensors"
    )
    found: list[dict[str, Any]] = []
    try:
        with workers.together():
            for index in mine:
                part = VerifyReport(location=report.location, ok=True, checks=[])
                part_problems: list[Problem] = []
                _deep_entry(part, part_problems, checkpoint, entries[index], progress)
                if workers.distributed:
                    found.append(
                        {
                            "index": index,
                            "tensors": part.tensors,
                            "nonfinite": [h.model_dump(mode="json") for h in part.nonfinite],
                            "problems": [p.model_dump(mode="json") for p in part_problems],
                        }
                    )
                else:
                    report.tensors += part.tensors
                    report.nonfinite.extend(part.nonfinite)
                    problems.extend(part_problems)
        changed = checkpoint.storage.changed_since_read()
        if changed:
            # a save written into the folder meanwhile: the verdict would be about a mix
            rewritten = Problem(
                code="changed_while_read",
                message=f"{changed[0]}: changed while ckpt read it"
                + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                + ": another process rewrote or replaced it, so what --deep read could be two "
                "versions of the checkpoint, and no verdict of its content is given",
                file=changed[0],
                fix="Run verify again once the job writing the checkpoint has finished "
                "(`ckpt latest RUN_DIR` names the newest complete save).",
            )
            if workers.distributed:  # each rank that saw it: told once, after the merge
                found.append(
                    {
                        "index": len(entries) + 1,
                        "tensors": 0,
                        "nonfinite": [],
                        "problems": [rewritten.model_dump(mode="json")],
                    }
                )
            else:
                problems.append(rewritten)
        if workers.leader:  # whole files: one rank's work
            for damage in checkpoint.recorded_checksum_errors():
                found_problem = problem_from_error(damage.error, tensor=damage.tensor)
                if workers.distributed:
                    found.append(
                        {
                            "index": len(entries),
                            "tensors": 0,
                            "nonfinite": [],
                            "problems": [found_problem.model_dump(mode="json")],
                        }
                    )
                else:
                    problems.append(found_problem)
    finally:
        progress.finish()
    if not workers.distributed:
        return
    merged = sorted((f for got in workers.all_gather(found) for f in got), key=lambda f: f["index"])
    told_rewritten: set[str | None] = set()
    for f in merged:
        report.tensors += f["tensors"]
        report.nonfinite.extend(TensorHealth.model_validate(h) for h in f["nonfinite"])
        for p in map(Problem.model_validate, f["problems"]):
            if p.code == "changed_while_read":
                if p.file in told_rewritten:  # several ranks read one file: told once
                    continue
                told_rewritten.add(p.file)
            problems.append(p)


def _deep_entry(
    report: VerifyReport,
    problems: list[Problem],
    checkpoint: Checkpoint,
    entry: models.Entry,
    progress: Progress,
) -> None:
    """Read one entry; record what is wrong with it."""
    where = checkpoint.manifest.location
    file = checkpoint.storage.describe(entry.file) if entry.file else where
    if entry.kind != "tensor" and checkpoint.stored_as(entry.name) is not None:
        _deep_stored(report, problems, checkpoint, entry, file, progress)
        return
    if entry.kind != "tensor":
        try:
            checkpoint.read_object(entry.name)
        except UnsafeInputError:
            pass  # listed on purpose but never unpickled (training_args.bin)
        except Exception as exc:  # any failure to deserialise is the finding itself
            problems.append(_unreadable(entry.name, file, exc, "object", where))
        return
    from ... import dtypes

    layout = dtypes.torch_layout(entry.dtype, list(entry.shape)) if entry.dtype else None
    if entry.dtype and layout is None:
        # F6 (and odd-length F4) have no torch dtype: the header checks are all there is
        problems.append(
            Problem(
                code="not_checked",
                message=f"{file}: tensor {entry.name!r} is {entry.dtype}, which torch cannot "
                "hold; its bytes were checked against the header only",
                file=file,
                tensor=entry.name,
                severity="warning",
                fix=f"Nothing to do if the header checks suffice; its values can be judged only "
                f"by a reader that decodes {entry.dtype}.",
            )
        )
        progress.advance(entry.nbytes)
        return
    streamable = layout is not None and entry.nbytes > _STREAM_BYTES
    # a tensor with layout padding to leave out is counted whole (the skip is by element)
    if streamable and checkpoint.serves_raw(entry.name) and not checkpoint.padding(entry.name):
        assert layout is not None
        _deep_streamed(report, problems, checkpoint, entry, layout[0], file, progress)
        return
    try:
        tensor = checkpoint.read_tensor(entry.name)
    except Exception as exc:
        problems.append(_unreadable(entry.name, file, exc, "tensor", where))
        progress.advance(entry.nbytes)
        return
    report.tensors += 1
    expected_shape = layout[1] if layout else list(entry.shape)
    if list(tensor.shape) != expected_shape:
        problems.append(
            Problem(
                code="shape_mismatch",
                message=f"{file}: tensor {entry.name!r} reads as shape "
                f"{list(tensor.shape)}, its metadata says {entry.shape}",
                file=file,
                tensor=entry.name,
                fix=restore_fix(where),
            )
        )
    # padding the layout knows is no parameter (ZeRO partitions): uninitialised, not judged
    nan, inf = count_nonfinite(tensor, skip=checkpoint.padding(entry.name))
    _nonfinite(report, problems, entry, file, nan, inf, tensor.numel())
    del tensor
    progress.advance(entry.nbytes)


def _deep_stored(
    report: VerifyReport,
    problems: list[Problem],
    checkpoint: Checkpoint,
    entry: models.Entry,
    file: str,
    progress: Progress,
) -> None:
    """A tensor ckpt does not dequantize (`Checkpoint.stored_as`: a GGUF quantized one): its
    stored bytes read whole, block by block, and counted against the header; its values
    judged for NaN/Inf where the format decodes them, else a `not_checked` warning."""
    form = checkpoint.stored_as(entry.name)
    where = checkpoint.manifest.location
    values: int | None = None
    nan = inf = 0
    try:
        found = checkpoint.stored_nonfinite(entry.name)
        if found is not None:
            read, values, nan, inf = found
        else:
            read = sum(len(block) for block in checkpoint.iter_stored(entry.name))
    except Exception as exc:  # any failure to read is the finding itself
        problems.append(_unreadable(entry.name, file, exc, "tensor", where))
        progress.advance(entry.nbytes)
        return
    progress.advance(entry.nbytes)
    report.tensors += 1
    if read != entry.nbytes:
        problems.append(
            _short_read(entry, file, read, form or f"{entry.dtype}{entry.shape}", where)
        )
    elif values is None:
        problems.append(
            Problem(
                code="not_checked",
                message=f"{file}: tensor {entry.name!r} is {form}, which ckpt cannot decode; "
                "its bytes were read whole and checked against the header only",
                file=file,
                tensor=entry.name,
                severity="warning",
                fix=f"Nothing to do if the byte count suffices; its values can be judged only "
                f"by a reader that decodes {form} (llama.cpp).",
            )
        )
    else:
        cause = checkpoint.stored_nonfinite_cause(entry.name) if nan or inf else None
        _nonfinite(report, problems, entry, file, nan, inf, values, cause)


def _nonfinite(
    report: VerifyReport,
    problems: list[Problem],
    entry: models.Entry,
    file: str,
    nan: int,
    inf: int,
    numel: int,
    cause: tuple[str, str] | None = None,
) -> None:
    """`nonfinite` for an entry holding NaN or Inf; `cause`, (what, fix), when the format
    can tell how it was written wrong (`Checkpoint.stored_nonfinite_cause`)."""
    if nan or inf:
        report.nonfinite.append(TensorHealth(name=entry.name, file=file, nan=nan, inf=inf))
        problems.append(
            Problem(
                code="nonfinite",
                message=f"{file}: tensor {entry.name!r} holds {nan} NaN and {inf} Inf "
                f"values (of {numel})" + (f", {cause[0]}" if cause else ""),
                file=file,
                tensor=entry.name,
                fix=cause[1]
                if cause
                else "Resume from an earlier checkpoint of the run, saved before the values "
                "went bad (`ckpt latest RUN_DIR` lists the complete ones); if this file is a "
                "copy, compare it with the original (`ckpt diff ORIGINAL COPY`).",
            )
        )


def _deep_streamed(
    report: VerifyReport,
    problems: list[Problem],
    checkpoint: Checkpoint,
    entry: models.Entry,
    dtype: str,
    file: str,
    progress: Progress,
) -> None:
    """Count a raw-stored tensor's NaN/Inf from its bytes, `_STREAM_BYTES` at a time: a 5 GiB
    tensor costs a block of memory, not 5 GiB. Its size is checked against the header."""
    import torch

    from ...tensors import torch_dtype

    kind = torch_dtype(dtype)
    size = kind.itemsize
    where = checkpoint.manifest.location
    nan = inf = got = 0
    rest = b""
    try:
        for block in checkpoint.iter_raw(entry.name, _STREAM_BYTES):
            progress.advance(len(block))
            data = memoryview(rest + bytes(block) if rest else block)
            cut = len(data) - len(data) % size
            rest = bytes(data[cut:])
            got += cut
            if cut:
                values = torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8).view(kind)
                n, i = count_nonfinite(values)
                nan, inf = nan + n, inf + i
                del values
    except Exception as exc:
        problems.append(_unreadable(entry.name, file, exc, "tensor", where))
        return
    got += len(rest)
    report.tensors += 1
    if got != entry.nbytes:
        problems.append(_short_read(entry, file, got, f"{entry.dtype}{entry.shape}", where))
    _nonfinite(report, problems, entry, file, nan, inf, got // size)


def _short_read(entry: models.Entry, file: str, read: int, form: str, where: str) -> Problem:
    """A tensor whose bytes read as another size than its metadata says (of the checkpoint
    at `where`)."""
    return Problem(
        code="shape_mismatch",
        message=f"{file}: tensor {entry.name!r} reads as {read:,} bytes, its metadata "
        f"says {entry.nbytes:,} ({form})",
        file=file,
        tensor=entry.name,
        fix=restore_fix(where),
    )


def _unreadable(name: str, file: str, exc: Exception, kind: str, where: str) -> Problem:
    """An entry of the checkpoint at `where` that `exc` stopped from deserialising: the
    error's own fix when it says one, else the file restored."""
    if isinstance(exc, CorruptDataError):  # bytes that fail their recorded CRC-32
        return problem_from_error(exc, file=file, tensor=name)
    text = exc.stated if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"
    fix = exc.fix if isinstance(exc, CkptError) else None
    return Problem(
        code="unreadable",
        message=f"{file}: {kind} {name!r} does not deserialise ({text})",
        file=file,
        tensor=name,
        fix=fix or restore_fix(where),
    )


def count_nonfinite(
    tensor: torch.Tensor, skip: list[tuple[int, int]] | None = None
) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor, in bounded slices; (0, 0) for others.

    `skip`: flat element ranges `[start, end)` left out (a layout's padding).
    """
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return 0, 0
    if str(tensor.dtype) == "torch.float4_e2m1fn_x2":  # a dtype older torch lacks
        return 0, 0  # E2M1 has no NaN or Inf encodings (and no CPU kernels to look)
    flat = tensor.reshape(-1)
    nan = inf = 0
    for start, end in _judged(flat.numel(), skip or []):
        part = flat[start:end]
        if part.dtype.itemsize == 1:  # float8 kinds have no isfinite kernel on CPU
            part = part.float()
        finite = torch.isfinite(part)
        if bool(finite.all()):
            continue
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf


def _judged(numel: int, skip: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`[0, numel)` without the `skip` ranges, cut into pieces of at most `_COUNT_STEP`."""
    pieces: list[tuple[int, int]] = []
    at = 0
    for lo, hi in [*sorted(skip), (numel, numel)]:
        lo, hi = max(at, min(lo, numel)), min(hi, numel)
        for start in range(at, lo, _COUNT_STEP):
            pieces.append((start, min(lo, start + _COUNT_STEP)))
        at = max(at, hi)
    return pieces
