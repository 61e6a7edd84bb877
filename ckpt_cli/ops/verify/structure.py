"""`verify`'s structural check: what `verify SRC` reports first, from metadata and file sizes
(no bytes hashed), shared with the commands that must not bless a broken checkpoint (`protect`).
"""

from __future__ import annotations

from ...errors import CkptError, MissingRanksError
from ...findings import problem_from_error
from ...formats import get_format
from ...formats.base import Source
from ...heap import gc_paused
from ...models import Problem, ProblemList
from ...sources.layouts import OpenedSource
from ...sources.opening import (
    SourceOpener,
    check_source,
    format_of,
    recognise_layout,
    single_layout_missing,
)


def structural_errors(source: Source) -> list[Problem]:
    """The errors of `verify`'s structural check of `source` (what `verify SRC` reports first,
    no bytes hashed): for a command that must not bless a broken checkpoint (`protect`)."""
    opened = recognise_layout(source)
    opener = SourceOpener(source, None)
    try:
        _name, _source, problems = structure_checks(source, None, opener, opened)
    finally:
        if opened is not None:
            opened.checkpoint.close()
        opener.close()
    return [p for p in problems if p.severity == "error"]


@gc_paused()  # builds and walks the manifest (a million DCP chunks), no cycles: see `heap`
def structure_checks(
    source: Source, format: str | None, opener: SourceOpener, opened: OpenedSource | None
) -> tuple[str, Source, ProblemList]:
    """`verify`'s structural checks of `source` (as `format`, else recognised; `opened`: its
    training layout, when recognised): (the format or layout name, the checkpoint's source,
    problems)."""
    if opened is not None:
        training = opened.training
        name = training.layout if training else opened.checkpoint.manifest.format
        return name, source, ProblemList(check_source(source, opened=opened))
    try:
        name = format_of(source, format)
    except MissingRanksError as error:
        # a legacy Megatron-LM save that lost rank folders: a finding (exit 1), as a missing
        # shard is, where inspect and convert refuse it (the run folders' names imported here
        # alone: a plain model's verify never loads them, start-up #30)
        from ...sources.runs.naming import MEGATRON

        return MEGATRON, source, ProblemList([problem_from_error(error)])
    fmt = get_format(name)
    # SRC named the .metadata or one .distcp file: the checkpoint is the folder
    source = fmt.checkpoint_source(source)
    # at most `MAX_EXAMPLES` of each code, the rest counted: a checkpoint crafted with a
    # million bad entries is reported in bounded memory, every code still listed
    problems = ProblemList(fmt.check(source))
    if fmt.object_bytes and not any(p.severity == "error" for p in problems):
        problems.extend(object_problems(opener))
    if format is None and not any(p.severity == "error" for p in problems):
        # a training layout's own rule (a torchtitan save with no optimizer state)
        problems.extend(single_layout_missing(source))
    return name, source, problems


def object_problems(opener: SourceOpener) -> list[Problem]:
    """Every non-tensor entry stored as its own pickle (`Format.object_bytes`: DCP's BYTE_IO
    items) whose pickle needs a global that ckpt's restricted reader refuses: found by reading
    opcodes (nothing runs, no torch), so plain `verify` names the entry that `convert`, `diff`
    or `--deep` would refuse. Entries of a whole pickled file (Megatron's `common.pt`) are
    judged by loading that file once with the restricted reader. SRC is the one `opener` opens (once for all of verify's checks)."""
    from ...formats.torch.pickle_scan import refused_globals

    problems: list[Problem] = []
    try:
        checkpoint = opener.get().checkpoint
    except CkptError as error:
        return [problem_from_error(error)]
    if not checkpoint.object_bytes:
        return []
    whole_files: set[str] = set()
    for entry in checkpoint.manifest.entries:
        if entry.kind != "object" or entry.file is None:
            continue
        where = checkpoint.storage.describe(entry.file)
        if entry.offset is None:
            # an entry of a whole pickled file (Megatron's common.pt): reading one loads the
            # file with the restricted reader, which names what it refuses (nothing runs);
            # once per file, as convert and diff would meet it
            if entry.file in whole_files:
                continue
            whole_files.add(entry.file)
            try:
                checkpoint.read_object(entry.name)  # loaded, never pickled again
            except CkptError as error:
                problems.append(problem_from_error(error, file=where))
            continue
        try:
            refused = refused_globals(checkpoint.read_object_bytes(entry.name))
        except CkptError as error:  # a corrupt blob (`corrupt_data`) among them
            problems.append(problem_from_error(error, file=where, tensor=entry.name))
            continue
        if refused:
            problems.append(
                Problem(
                    code="unloadable_object",
                    message=f"object entry {entry.name!r} needs "
                    f"{', '.join(refused[:5])}, which ckpt's restricted reader "
                    "(torch.load weights_only) refuses; nothing was executed",
                    file=where,
                    tensor=entry.name,
                    fix="Save it again without that object, from the code that wrote it "
                    "(plain dicts, lists, numbers and tensors load everywhere, unpickling "
                    "nothing).",
                )
            )
    return problems
