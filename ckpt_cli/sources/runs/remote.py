"""Run folders in object stores and on the Hub: one `Storage` listing, judged by the one judge.

A run folder in an object store (`s3://bucket/run/`) or on the Hub (`hf://org/repo`, whose
subfolders are `checkpoint-N/` as the Trainer's `push_to_hub(hub_strategy="all_checkpoints")`
writes) is listed once (names, sizes and, for object stores, modification times); its
candidates are named by the local rules (`naming.collect`), and the judge reads metadata only,
through views of that one listing (`storage.base.FolderView`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ...errors import NotFoundError, UsageError
from ...formats.base import Source
from ...formats.names import CHECKPOINT_SUFFIXES, DCP_METADATA, INDEX_SUFFIX
from ...storage import Storage
from .listing import RunListing
from .naming import SUBFOLDERS, collect, holds_run, in_parity, refuse_run_of_runs
from .records import SYNC_RECORD, Found, checksum_manifest_of


def is_remote(run_dir: str | Path | Source) -> bool:
    """Whether `run_dir` is a URL (`s3://…`, `hf://…`) rather than a folder on this machine."""
    if isinstance(run_dir, Source):
        return not run_dir.location.is_local
    text = str(run_dir)
    return "://" in text and not text.startswith("file://")


def run_storage(run_dir: str | Source) -> Storage:
    """The `Storage` of a remote run folder (NotFoundError when it does not exist); `run_dir`
    may be resolved already (`resolve_source`), so an operation lists it once."""
    from ...formats import resolve_source

    source = run_dir if isinstance(run_dir, Source) else resolve_source(run_dir)
    if source.target is not None:
        raise UsageError(
            "names one file, not a run folder",
            path=source.location.raw,
            fix="Pass the prefix (or repo) that holds the step checkpoints.",
        )
    return source.storage


def _entries(files: dict[str, int]) -> dict[tuple[str, bool], dict[str, int]]:
    """The entries of the run folder and of its checkpoint sub-folders, from a listing:
    (path, is a folder) -> the files under it (path relative to the run folder -> size)."""
    groups: dict[tuple[str, bool], dict[str, int]] = {}
    for rel, size in files.items():
        parts = rel.split("/")
        depth = 2 if parts[0] in SUBFOLDERS and len(parts) >= 2 else 1
        base, is_dir = "/".join(parts[:depth]), len(parts) > depth
        groups.setdefault((base, is_dir), {})[rel] = size
    return groups


def _holds_checkpoint(base: str, inside: dict[str, int]) -> bool:
    """A plain `NAME-N/` folder holding checkpoint files, and no run folder of its own."""
    if not any(f.endswith((*CHECKPOINT_SUFFIXES, DCP_METADATA)) for f in inside):
        return False
    return not holds_run(rel[len(base) + 1 :] for rel in inside)


def _discover(groups: dict[tuple[str, bool], dict[str, int]], display: str = "") -> list[Found]:
    found = collect(
        (base, is_dir, partial(_holds_checkpoint, base, inside))
        for (base, is_dir), inside in sorted(groups.items())
    )
    if not found and display:
        runs = [
            base
            for (base, is_dir), inside in sorted(groups.items())
            if is_dir
            and "/" not in base
            and not base.startswith(".")
            and holds_run(rel[len(base) + 1 :] for rel in inside)
        ]
        refuse_run_of_runs(display, runs)
    return found


class RemoteListing(RunListing):
    """A run folder read through its `Storage`: one listing, then metadata only."""

    def __init__(self, run_dir: str | Source) -> None:
        self.storage = run_storage(run_dir)
        self.listed = self.storage.list_files()
        self._groups = _entries(self.listed)
        text = run_dir.location.raw if isinstance(run_dir, Source) else run_dir
        self.display = text.rstrip("/")

    def discover(self) -> list[Found]:
        return _discover(self._groups, self.display)

    def files(self, item: Found) -> dict[str, int]:
        out: dict[str, int] = {}
        for rel in item.rels:
            out.update(self._groups.get((rel, item.is_dir), {}))
        return out

    def times(self, item: Found) -> tuple[float, float]:
        stamps = [self.storage.modified(rel) for rel in self.files(item) if not in_parity(rel)]
        newest = max((s for s in stamps if s is not None), default=0.0)
        return newest, newest

    def entry_time(self, item: Found) -> float:
        return self.times(item)[0]

    def upload_unfinished(self, item: Found) -> bool:
        if SYNC_RECORD not in self.listed:
            return False
        return checksum_manifest_of(item.rels[0], item.is_dir) not in self.listed

    def top_entries(self) -> dict[str, bool]:
        return {rel.split("/", 1)[0]: "/" in rel for rel in self.listed}

    def root_files(self, items: list[Found]) -> list[str]:
        claimed = {rel for i in items for rel in i.rels}
        return sorted(
            rel
            for rel in self.listed
            if "/" not in rel and rel.endswith(CHECKPOINT_SUFFIXES) and rel not in claimed
        )


def looks_like_remote_run(path: str | Source) -> bool:
    """Whether a remote location holds step checkpoints and no checkpoint of its own."""
    try:
        files = run_storage(path).list_files()
    except (NotFoundError, UsageError):
        return False  # not a folder-like location: opened as a checkpoint, which says why
    top = {rel.split("/", 1)[0] for rel in files}
    if DCP_METADATA in top or any(t.endswith(CHECKPOINT_SUFFIXES) and "-of-" in t for t in top):
        return False
    if any(t.endswith(INDEX_SUFFIX) for t in top) or "model.safetensors" in top:
        return False
    return any(not i.temporary and i.layout != "plain" for i in _discover(_entries(files)))
