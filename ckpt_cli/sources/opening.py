"""The door every operation opens its SRC through: `open_source` (a plain checkpoint of one
format, or a training layout built on top of them), `check_source` (`verify`'s structural
check of any SRC), `SourceOpener` (one operation's SRC opened at most once), `open_plain` and
`format_of` (one format, no layout).

It sits above both halves of `ckpt_cli.sources`: the training layouts (`layouts`: what one
checkpoint is) and run folders (`runs`: which of many is which). A SRC a user names may be
neither one checkpoint nor a layout's but a folder of saves (a run folder, a folder of runs,
`final/` beside `best/`); the door refuses it in the words `latest` and `prune` use
(`runs.naming.refuse_parent_folder`), which know the layouts' step names.

One resolution per operation: an op resolves SRC once (`formats.resolve_source`) and hands the
`Source` to `open_source` / `check_source` / `recognise_layout` (`SourceOpener` opens it at most
once for the checks that need it opened), so a listing or a Hub lookup is never repeated.
"""

from __future__ import annotations

from ..errors import CkptError
from ..findings import problem_from_error
from ..formats import (
    STORAGE_NAMES,
    choose_format,
    get_format,
    holds_only_nested_checkpoints,
    resolve_source,
)
from ..formats.base import Checkpoint, Source
from ..formats.names import DCP_METADATA, RESHARD_RECORD
from ..models import Problem
from .layouts import open_folder_layout
from .layouts.base import OpenedSource, open_as_format
from .layouts.model_folders import LayoutInfo

__all__ = [
    "SourceOpener",
    "check_source",
    "describe_model_folder",
    "format_of",
    "open_plain",
    "open_source",
    "recognise_layout",
    "single_layout_missing",
]


def format_of(source: Source, format: str | None = None) -> str:
    """The format token to read `source` as (`formats.choose_format`: `format`, else the one
    detected). A folder whose checkpoints are all in subfolders is refused first, as a usage
    error naming what to pass instead, in the words `latest` and `prune` use (a run folder, a
    folder of runs, a folder of saves such as `final/` and `best/`); a legacy Megatron-LM save
    that lacks rank folders (`iter_N/mp_rank_*/`), as the incomplete save it is (exit 4)."""
    if (format is None or format in STORAGE_NAMES) and holds_only_nested_checkpoints(source):
        from .layouts.megatron_save import refuse_incomplete_save
        from .runs.naming import refuse_parent_folder

        # a legacy Megatron-LM save (`iter_N/mp_rank_*/`) that lost rank folders is refused
        # as such: naming one of the rank folders left would read part of the weights
        refuse_incomplete_save(source)
        refuse_parent_folder(source.location.raw, source.files)
    return choose_format(source, format)


def open_plain(source: Source, format: str | None = None) -> Checkpoint:
    """`formats.open_checkpoint` for a source already resolved: read as one format, `format`
    (a token) overriding detection; no training layout is looked for."""
    return open_as_format(source, format_of(source, format))


def open_source(src: str | Source, format: str | None = None) -> OpenedSource:
    """Open `src` (local path or URL), recognising training layouts unless `format` is given.

    `src` may be a `Source` already resolved (`resolve_source`): an operation resolves its
    SRC once and passes it down, so its listing and the Hub's repository lookup happen once.
    With `format`, the source is read as that format alone; a torch.save or DCP training dict
    still gets its training state (it is the same single checkpoint).
    """
    source = src if isinstance(src, Source) else resolve_source(src)
    layout: LayoutInfo | None = None
    if format is None:
        opened = open_folder_layout(source)
        if opened is not None:
            return opened
        if holds_only_nested_checkpoints(source):
            # a whole legacy Megatron-LM save (`iter_N/mp_rank_*/`, or its run folder through
            # the tracker): one checkpoint of its rank folders (imported here alone: a plain
            # model never loads it, start-up #30)
            from .layouts.megatron_save import open_save, whole_save

            save = whole_save(source)
            if save is not None:
                return open_save(save)
        layout = describe_model_folder(source)
    checkpoint = open_plain(source, format)
    saved_as = get_format(checkpoint.manifest.format)
    if saved_as.self_described:
        from .layouts.model_folders import gguf_info

        layout = gguf_info(checkpoint.manifest)
    if layout is None:
        from .layouts.model_folders import diffusers_lora_info

        layout = diffusers_lora_info(checkpoint.manifest)
    if not saved_as.holds_objects:  # no training dict: plain weights
        return OpenedSource(checkpoint=checkpoint, layout=layout)
    from .layouts.torch_dict import analyse_single

    training = analyse_single(checkpoint)
    if training is not None and saved_as.folder:
        # a DCP training save `ckpt reshard --world-size` cut for another number of ranks: its
        # file names say the new one, its record the one the run saved it at
        from .layouts.training import note_resharded

        note_resharded(training, source, RESHARD_RECORD)
    return OpenedSource(checkpoint=checkpoint, training=training, layout=layout)


class SourceOpener:
    """One operation's SRC, opened at most once, on first use, by whichever check needs it.

    `verify` runs its quantization checks and its `--deep` / `--resumable` reads on the same
    opened source; a failure to open is kept and raised again to every later caller, so each
    one reports it as it did when it opened SRC itself.
    """

    def __init__(self, source: Source, format: str | None = None) -> None:
        self.source = source
        self.format = format
        self._opened: OpenedSource | None = None
        self._error: CkptError | None = None

    def get(self) -> OpenedSource:
        """The opened source (CkptError when it cannot be opened)."""
        if self._error is not None:
            raise self._error
        if self._opened is None:
            try:
                self._opened = open_source(self.source, self.format)
            except CkptError as error:
                self._error = error
                raise
        return self._opened

    def close(self) -> None:
        """Close what `get` opened (nothing when it was never asked)."""
        if self._opened is not None:
            self._opened.checkpoint.close()


def describe_model_folder(source: Source) -> LayoutInfo | None:
    """The library layout of a local or remote model folder (PEFT...), from its JSON files."""
    from .layouts.model_folders import peft_info

    if source.target is not None:
        return None
    return peft_info(source)


def check_source(
    src: str | Source, format: str | None = None, opened: OpenedSource | None = None
) -> list[Problem]:
    """Structural problems of any SRC, training folders included (what plain `verify` runs).

    A training folder gets its format's `check` on every component (the model's index against
    its shards, every torch file loading with weights_only...) plus the components that could
    not be read; anything else gets its format's `check`. Sources that cannot be opened at all
    (a `latest` naming a missing tag) become one problem. `src` may be a `Source` already
    resolved and `opened` its training layout already opened (`recognise_layout`): nothing is
    then resolved or opened again.
    """
    where = src.location.raw if isinstance(src, Source) else src
    owned = opened is None  # what this call opens it closes; a caller's stays open
    try:
        source = src if isinstance(src, Source) else resolve_source(src)
        if opened is None and format is None:
            opened = open_folder_layout(source)
        if opened is None:
            name = format_of(source, format)
            return list(get_format(name).check(source))
    except CkptError as error:
        return [problem_from_error(error, file=error.path or where)]
    from .layouts.training import opened_problems

    try:
        return opened_problems(source, opened)
    finally:
        if owned:
            opened.checkpoint.close()


def single_layout_missing(source: Source) -> list[Problem]:
    """What one checkpoint (a DCP folder, a torch.save file) lacks by its training layout's own
    rule (`Layout.missing`: a torchtitan save holding its `train_state` and no optimizer
    state); what plain `verify` adds to its format's structural check. Only a DCP folder's
    layout has such a rule (torchtitan's): another source imports no layout module."""
    if source.target is not None or DCP_METADATA not in set(source.top_level()):
        return []
    from .layouts.composite import Folder
    from .layouts.torch_dict import SINGLE_LAYOUTS

    for layout in SINGLE_LAYOUTS:
        if layout.recognise(source):
            found = layout.missing(source, Folder(source))
            if found:
                return found
    return []


def recognise_layout(source: Source) -> OpenedSource | None:
    """The training layout of a local folder when it is one, else None (cheap: names first).

    Unlike `open_source`, nothing else is opened, so a caller can still run a format's `check`
    on a broken plain checkpoint (what `verify` does).
    """
    return open_folder_layout(source)
