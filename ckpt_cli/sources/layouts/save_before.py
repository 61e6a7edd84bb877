"""The run's save just before a checkpoint, found beside it on any storage.

A save's own files cannot tell a file lost since it was written from one its run never
wrote (a model a save hook writes, a rank's RNG states, a registered object's state): the
save before it in the same run folder can. Verified on its own, a save is compared with the
folder beside it that is named as it is but for a lower number, wherever it lies: on this
machine, in an object store (one listing of the run's prefix, one of that save's) or on the
Hub (the same commit, listed from the folder above), so that `ckpt verify s3://…/checkpoint-300`
says what `ckpt verify checkpoint-300/` says of the same files.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ...formats.base import Source
from ...models import Problem
from ...storage import Storage

#: the fix of a file a checkpoint lacks that the save before it holds
LOST_SINCE_FIX = (
    "Copy it again from where the run saved it, or use another checkpoint of the run "
    "(`ckpt latest` names the newest whole one)."
)


def lost_since(source: Source, rel: str, what: str) -> Problem:
    """`missing_component` for `rel` (a path in the checkpoint `source` opens) that the save
    before it holds; `what` says what the file is and why the save needs it."""
    return Problem(
        code="missing_component",
        message=f"is missing: {what}",
        file=source.storage.describe(rel),
        fix=LOST_SINCE_FIX,
    )


@dataclass(frozen=True)
class SaveBefore:
    """The run's save just before a checkpoint.

    Attributes:
        name: its folder's name (`checkpoint-200`).
        files: every file in it, path relative to it.
    """

    name: str
    files: frozenset[str]

    @property
    def top(self) -> set[str]:
        """The names of the files directly in it."""
        return {rel for rel in self.files if "/" not in rel}


def save_before(
    source: Source, naming: Callable[[str], re.Pattern[str] | None]
) -> SaveBefore | None:
    """The folder beside `source`'s that its run names as it names this one, with the highest
    number below its own, and its files. `naming` gives, from this save's folder name, the
    pattern its run names saves by (the number its first group), or None for a name it does
    not know. None as well where nothing beside it can be listed (`Storage.beside`), or when
    no such folder is there."""
    found = _FOUND.setdefault(source.storage, {})
    if naming not in found:
        found[naming] = _find(source.storage, naming)
    return found[naming]


#: what was found beside each storage opened, by naming rule: a layout's checks ask more than
#: once while it opens a save, and remotely each answer costs listings
_FOUND: weakref.WeakKeyDictionary[
    Storage, dict[Callable[[str], re.Pattern[str] | None], SaveBefore | None]
] = weakref.WeakKeyDictionary()


def _find(storage: Storage, naming: Callable[[str], re.Pattern[str] | None]) -> SaveBefore | None:
    beside = storage.beside()
    if beside is None:
        return None
    pattern = naming(beside.name)
    own = pattern.fullmatch(beside.name) if pattern is not None else None
    if pattern is None or own is None:
        return None
    older: list[tuple[int, str]] = []
    for name in beside.folders:
        match = pattern.fullmatch(name)
        if match is not None and int(match.group(1)) < int(own.group(1)):
            older.append((int(match.group(1)), name))
    if not older:
        return None
    _number, name = max(older)
    return SaveBefore(name, frozenset(beside.open(name).list_files()))
