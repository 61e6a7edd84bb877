"""Run folders on object stores and other fsspec storages: listing, classification and judging through `Storage`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...errors import CkptError, NotFoundError, UsageError
from ...formats.base import Source
from ...formats.names import (
    CHECKPOINT_SUFFIXES,
    DCP_METADATA,
    INDEX_SUFFIX,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    holds_dcp,
    index_format,
    is_single_file_weights,
)
from ...storage import Storage
from .judge import read_deepspeed_latest, with_status
from .naming import (
    SUBFOLDERS,
    UNMARKED,
    classify,
    expected_parts,
    step_order,
)
from .records import DEFAULT_SETTLE, METRICS_FILE, SLIM_RECORD, RunCheckpoint, RunReport
from .scan import RunFolder, scan

# --------------------------------------------------------------------------- remote run folders
#
# A run folder in an object store (`s3://bucket/run/`) or on the Hub (`hf://org/repo`, whose
# subfolders are `checkpoint-N/` as the Trainer's `push_to_hub(hub_strategy="all_checkpoints")`
# writes) is scanned through its `Storage`: one listing (names, sizes and, for object stores,
# modification times), then headers only: each safetensors header, the end of each torch.save
# zip, the JSON of indexes and `trainer_state.json`. The naming and the rules are the local ones.

#: bytes of a safetensors header read at most when judging a remote file
_MAX_HEADER = 100 << 20
#: the end of a torch.save zip read to find its end-of-central-directory record
_ZIP_TAIL = 1024


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


@dataclass
class _RemoteItem:
    layout: str
    step: int | None
    epoch: float | None
    #: paths relative to the run root: one folder or one file (several plain files of a step)
    rels: list[str]
    is_dir: bool
    #: for a folder: its files relative to the folder, with sizes; for files: rel -> size
    files: dict[str, int]
    temporary: bool = False


def _remote_items(files: dict[str, int]) -> list[_RemoteItem]:
    """Group a listing into the entries of the run folder and its checkpoint sub-folders."""
    groups: dict[tuple[str, bool], dict[str, int]] = {}
    for rel, size in files.items():
        parts = rel.split("/")
        if parts[0] in SUBFOLDERS and len(parts) >= 2:
            base, rest = "/".join(parts[:2]), parts[2:]
        else:
            base, rest = parts[0], parts[1:]
        if rest:
            groups.setdefault((base, True), {})["/".join(rest)] = size
        else:
            groups.setdefault((base, False), {})[base] = size
    items: list[_RemoteItem] = []
    plain_files: dict[tuple[str, int | None], _RemoteItem] = {}
    for (base, is_dir), inside in sorted(groups.items()):
        name = base.rsplit("/", 1)[-1]
        parent = base.rsplit("/", 1)[0] if "/" in base else ""
        item = _classify_remote(name, is_dir, inside)
        if item is None:
            continue
        item.rels = [base]
        if item.layout == "plain" and not item.temporary and not is_dir:
            key = (parent, item.step)
            if key in plain_files:
                plain_files[key].rels.append(base)
                plain_files[key].files.update(inside)
                continue
            plain_files[key] = item
        items.append(item)
    return items


def _classify_remote(name: str, is_dir: bool, inside: dict[str, int]) -> _RemoteItem | None:
    found = classify(
        name, is_dir, lambda: any(f.endswith((*CHECKPOINT_SUFFIXES, DCP_METADATA)) for f in inside)
    )
    if found is None:
        return None
    layout, step, epoch, temporary = found
    return _RemoteItem(layout, step, epoch, [], is_dir, dict(inside), temporary=temporary)


def _remote_file_problem(storage: Storage, rel: str, size: int) -> str | None:
    """Whether one remote safetensors / torch.save file is whole, from its header or its end."""
    where = storage.describe(rel)
    if size == 0:
        return f"{where}: empty file"
    try:
        if rel.endswith(SAFETENSORS_SUFFIX):
            if size < 8:
                return f"{where}: truncated safetensors file"
            length = int.from_bytes(storage.read(rel, 0, 8), "little")
            if length > min(_MAX_HEADER, size - 8):
                return f"{where}: truncated or corrupt safetensors header"
            header = json.loads(storage.read(rel, 8, length))
            ends = [
                int(v["data_offsets"][1])
                for k, v in header.items()
                if k != "__metadata__" and isinstance(v, dict)
            ]
            if 8 + length + max(ends, default=0) > size:
                return f"{where}: truncated (the header names more bytes than the file has)"
            return None
        if rel.endswith(TORCH_SUFFIXES):
            if storage.read(rel, 0, min(4, size)) != b"PK\x03\x04":
                return None  # legacy torch.save format: no cheap structural check
            tail = storage.read(rel, max(0, size - _ZIP_TAIL), min(size, _ZIP_TAIL))
            if b"PK\x05\x06" not in tail:
                return f"{where}: truncated torch.save file (no end of zip directory)"
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{where}: unreadable header ({exc})"
    except CkptError as error:
        return error.message
    return None


def _remote_components(
    storage: Storage, base: str, is_dir: bool, files: dict[str, int]
) -> tuple[str | None, list[str]]:
    """(first problem, formats) over the components of one remote checkpoint."""
    if not is_dir:
        formats: list[str] = []
        for rel, size in files.items():
            kind = "safetensors" if rel.endswith(SAFETENSORS_SUFFIX) else "torch"
            formats.append(kind)
            problem = _remote_file_problem(storage, rel, size)
            if problem:
                return problem, formats
        return None, sorted(set(formats))
    formats = []
    folders: dict[str, dict[str, int]] = {}
    for rel, size in files.items():
        folder, _, fname = rel.rpartition("/")
        folders.setdefault(folder, {})[fname] = size
    any_component = False
    for folder, names in sorted(folders.items()):
        prefix = f"{base}/{folder}/" if folder else f"{base}/"
        if holds_dcp(names):
            any_component = True
            formats.append("dcp")
            if DCP_METADATA not in names:
                return f"{storage.describe(prefix)}: no .metadata (DCP writes it last)", formats
            continue
        claimed: set[str] = set()
        for fname in sorted(names):
            index_kind = index_format(fname)
            if index_kind is not None:
                any_component = True
                formats.append(index_kind)
                try:
                    index = json.loads(storage.read_all(prefix + fname))
                    shards = {v for v in index["weight_map"].values() if isinstance(v, str)}
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    return f"{storage.describe(prefix + fname)}: unreadable index ({exc})", formats
                for shard in sorted(shards):
                    if shard not in names:
                        return (
                            f"{storage.describe(prefix + fname)}: names shard {shard!r}, "
                            "which is missing",
                            formats,
                        )
                claimed |= shards
        for fname, size in sorted(names.items()):
            if fname in claimed or not is_single_file_weights(fname):
                continue
            any_component = True
            formats.append("safetensors" if fname.endswith(SAFETENSORS_SUFFIX) else "torch")
            problem = _remote_file_problem(storage, prefix + fname, size)
            if problem:
                return problem, sorted(set(formats))
    if not any_component:
        return "holds no checkpoint files (safetensors, DCP, torch.save)", formats
    return None, sorted(set(formats))


def _remote_json(storage: Storage, rel: str) -> Any:
    try:
        return json.loads(storage.read_all(rel))
    except (ValueError, UnicodeDecodeError, CkptError):
        return None


def scan_remote_run(
    run_dir: str | Source,
    *,
    metric: str | None = None,
    mode: Literal["min", "max"] = "min",
    settle: float = DEFAULT_SETTLE,
    now: float | None = None,
    until_latest: bool = False,
) -> RunReport:
    """`scan_run` for a run folder in an object store or on the Hub (listings and headers)."""
    return scan(
        _RemoteRun(run_dir),
        metric=metric,
        mode=mode,
        settle=settle,
        now=now,
        until_latest=until_latest,
    )


class _RemoteRun(RunFolder[_RemoteItem]):
    """A run folder read through its `Storage`: one listing, then headers only."""

    def __init__(self, run_dir: str | Source) -> None:
        self.storage = run_storage(run_dir)
        self.files = self.storage.list_files()
        text = run_dir.location.raw if isinstance(run_dir, Source) else run_dir
        self.display = text.rstrip("/")

    def discover(self) -> list[_RemoteItem]:
        return _remote_items(self.files)

    def order(self, item: _RemoteItem) -> tuple[float, float, float]:
        return step_order(item.step, item.epoch, _remote_mtime(self.storage, item))

    def judge(
        self,
        item: _RemoteItem,
        now: float,
        settle: float,
        ds_latest_step: int | None,
        expected: set[str] | None,
    ) -> RunCheckpoint:
        return _judge_remote(
            self.storage, self.display, item, now, settle, ds_latest_step, expected
        )

    def expected_parts(self, items: list[_RemoteItem]) -> dict[int, set[str]]:
        return _remote_expected_parts(items)

    def deepspeed_latest(self) -> str | None:
        # the listing says whether there is one: no request for runs without it
        return read_deepspeed_latest(self.storage) if "latest" in self.files else None

    def root_files(self, items: list[_RemoteItem]) -> list[str]:
        return sorted(
            rel
            for rel in self.files
            if "/" not in rel
            and rel.endswith(CHECKPOINT_SUFFIXES)
            and not any(rel in i.rels for i in items)
        )

    def trainer_state(self, checkpoints: list[RunCheckpoint]) -> tuple[str, dict[str, Any]] | None:
        trainers = [c for c in checkpoints if c.layout == "hf-trainer" and c.complete]
        if not trainers:
            return None
        rel = f"{trainers[-1].name}/trainer_state.json"
        doc = _remote_json(self.storage, rel)
        return (self.storage.describe(rel), doc) if isinstance(doc, dict) else None

    def metrics_file(self) -> tuple[str, str] | None:
        if METRICS_FILE not in self.files:
            return None
        raw = self.storage.read_all(METRICS_FILE)
        return self.storage.describe(METRICS_FILE), raw.decode("utf-8", "replace")

    def close(self) -> None:
        self.storage.close()


def _remote_mtime(storage: Storage, item: _RemoteItem) -> float:
    stamps = [
        storage.modified(f"{item.rels[0]}/{rel}" if item.is_dir else rel) for rel in item.files
    ]
    return max((s for s in stamps if s is not None), default=0.0)


def _remote_expected_parts(items: list[_RemoteItem]) -> dict[int, set[str]]:
    """The remote twin of `_expected_parts`: names every other save of an unmarked layout has."""
    out: dict[int, set[str]] = {}
    for layout in UNMARKED:
        folders = [i for i in items if i.layout == layout and i.is_dir and not i.temporary]
        names = {
            id(f): {n for n in f.files if "/" not in n and not any(ch.isdigit() for ch in n)}
            for f in folders
        }
        out.update(expected_parts(names))
    return out


def _judge_remote(
    storage: Storage,
    root_url: str,
    item: _RemoteItem,
    now: float,
    settle: float,
    ds_latest_step: int | None,
    expected: set[str] | None,
) -> RunCheckpoint:
    base = item.rels[0]
    mtime = _remote_mtime(storage, item)
    entry = RunCheckpoint(
        name=base,
        path=f"{root_url}/{base}",
        paths=[f"{root_url}/{rel}" for rel in item.rels],
        layout=item.layout,
        step=item.step,
        epoch=item.epoch,
        size=sum(item.files.values()),
        mtime=mtime,
    )
    recent = mtime > 0 and now - mtime < settle
    if item.temporary:
        return with_status(
            entry,
            "writing" if recent else "interrupted",
            "staging prefix of a save in progress" if recent else "staging prefix left behind",
        )
    entry.slim = item.is_dir and SLIM_RECORD in item.files
    if entry.slim:
        entry.markers.append("weights-only")
    problem, entry.formats = _remote_components(storage, base, item.is_dir, item.files)
    if problem is None and item.layout == "hf-trainer" and item.is_dir:
        if "trainer_state.json" not in item.files:
            problem = "no trainer_state.json (the Trainer writes it last)"
        elif _remote_json(storage, f"{base}/trainer_state.json") is None:
            problem = f"{storage.describe(base + '/trainer_state.json')}: not valid JSON"
    if problem is None and expected and not entry.slim:
        missing = expected - set(item.files)
        if missing:
            problem = (
                f"lacks {', '.join(sorted(missing))}, which every other save of this run has "
                "(no commit marker in this layout: an interrupted save?)"
            )
    if (
        problem is None
        and item.layout == "deepspeed"
        and ds_latest_step is not None
        and item.step is not None
        and item.step > ds_latest_step
    ):
        problem = f"newer than global_step{ds_latest_step} named by the `latest` file"
    if problem is None:
        return entry
    if recent:
        return with_status(entry, "writing", f"modified in the last {settle:g} s: {problem}")
    return with_status(entry, "incomplete", problem)


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
    return any(not i.temporary and i.layout != "plain" for i in _remote_items(files))
