"""`scan_run` and `looks_like_run` for a run folder on this machine (remote ones: `remote.py`).

The listing is the file system's own: entries are seen with `lstat`, so a link is a link (never
followed out of the run to find candidates; a linked checkpoint is judged by what it links to,
and deleting it frees nothing), staging folders are seen (a `Storage` listing hides them), and
only the folders of the checkpoints that are judged are walked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

from ...errors import NotFoundError, UsageError
from ...faults import no_verdict
from ...formats.base import Source
from ...formats.names import CHECKPOINT_SUFFIXES, is_checkpoint_file
from ...storage import LocalStorage, Storage, is_parity_path, real_path
from .listing import RunListing
from .naming import SUBFOLDERS, collect, holds_run, in_parity, match_name, refuse_run_of_runs
from .records import DEFAULT_SETTLE, Found, RunCheckpoint, RunReport
from .remote import RemoteListing, is_remote, looks_like_remote_run
from .scan import scan


def scan_run(
    run_dir: str | Path | Source,
    *,
    metric: str | None = None,
    mode: Literal["min", "max"] = "min",
    settle: float = DEFAULT_SETTLE,
    now: float | None = None,
    until_latest: bool = False,
) -> RunReport:
    """List and judge the checkpoints of `run_dir` (see the module docstring for the rules).

    Args:
        run_dir: the run folder (the Trainer's `output_dir`, a torchtitan dump folder...).
        metric: judge best-by-metric on this metric name (`eval_loss`).
        mode: `min` or `max`: which end of `metric` is best.
        settle: seconds since the last write below which an incomplete save is `writing`.
        now: the current time (tests of the settle window pass one).
        until_latest: judge from the newest save down and stop at the first complete one
            (`checkpoints` then holds only those): what `ckpt latest` needs, and no more.
    """
    run: RunListing
    if is_remote(run_dir):
        run = RemoteListing(run_dir if isinstance(run_dir, Source) else str(run_dir))
    else:
        run = _local_listing(run_dir)
    return scan(
        run,
        metric=metric,
        mode=mode,
        settle=settle,
        now=now,
        until_latest=until_latest,
    )


def check_run_folder(root: Path) -> None:
    """Refuse a run folder that is missing (exit 3) or is a file (exit 2), in the words every
    command that takes one (`latest`, `prune`, `sync`, `doctor`) uses."""
    if not root.exists():
        raise NotFoundError("no such folder", path=root, fix="Check the run folder's path.")
    if not root.is_dir():
        raise UsageError(
            "is not a folder",
            path=root,
            fix="Pass the run folder that holds the step checkpoints (checkpoint-N/...).",
        )


def _local_listing(run_dir: str | Path | Source) -> LocalListing:
    root = _local_root(run_dir)
    check_run_folder(root)
    storage = None
    if isinstance(run_dir, Source) and run_dir.storage.local_root is not None:
        storage = run_dir.storage if run_dir.target is None else None  # resolved: reused
    return LocalListing(root, storage)


class LocalListing(RunListing):
    """A run folder on this machine, listed with `lstat`: each folder of the run once per scan,
    each judged checkpoint walked once."""

    def __init__(self, root: Path, storage: Storage | None = None) -> None:
        self.root = root
        self.display = str(root)
        # the run's own files are read through the run folder's storage (the one it was
        # resolved to, when it was): regular files inside the run only
        self.storage = storage or LocalStorage(root)
        self._listings: dict[Path, list[Path]] = {}
        self._files: dict[str, dict[str, int]] = {}
        self._mtimes: dict[str, float] = {}

    def _list(self, folder: Path) -> list[Path]:
        """A folder of the run, listed once per scan: discovery, the root's loose files and the
        link marks read the same listing."""
        if folder not in self._listings:
            self._listings[folder] = sorted(folder.iterdir())
        return self._listings[folder]

    def discover(self) -> list[Found]:
        found = discover_local(self.root, self._list)
        if not found:
            refuse_run_of_runs(self.display, nested_runs(self.root, self._list))
        return found

    def files(self, item: Found) -> dict[str, int]:
        out: dict[str, int] = {}
        for rel in item.rels:
            if rel not in self._files:
                self._files[rel] = self._walk(rel)
            out.update(self._files[rel])
        return out

    def _walk(self, rel: str) -> dict[str, int]:
        """Every file under `rel` (or `rel` itself) with its size; a linked folder is walked
        through its link, links inside it are not followed."""
        path = self.root / rel
        found: dict[str, int] = {}
        try:
            st = path.lstat()
        except OSError:
            return found
        if not path.is_dir():
            if path.is_symlink() and path.exists():
                st = path.stat()  # a linked file: what it links to is what a writer touches
            found[rel] = st.st_size
            self._mtimes[rel] = st.st_mtime
            return found
        for dirpath, _dirs, names in os.walk(path, onerror=no_verdict):
            for name in names:
                full = Path(dirpath, name)
                try:
                    st = full.lstat()
                except OSError as exc:
                    # refused: no verdict on the save; gone since the listing: not there
                    no_verdict(exc)
                    continue
                inner = f"{rel}/{full.relative_to(path).as_posix()}"
                found[inner] = st.st_size
                self._mtimes[inner] = st.st_mtime
        return found

    def times(self, item: Found) -> tuple[float, float]:
        files = self.files(item)
        own = 0.0
        for rel in item.rels:
            try:
                own = max(own, (self.root / rel).lstat().st_mtime)
            except OSError:
                continue
        inner = max((self._mtimes.get(f, 0.0) for f in files if not in_parity(f)), default=0.0)
        if self.link(item) is None:
            newest = max(own, inner)
            return newest, newest
        # a link: its own time is shown, the target's (what a writer touches) decides
        try:
            target = (self.root / item.rels[0]).stat().st_mtime
        except OSError:
            target = 0.0
        return own, max(target, inner)

    def entry_time(self, item: Found) -> float:
        try:
            return (self.root / item.rels[0]).lstat().st_mtime
        except OSError:
            return 0.0

    def where(self, rel: str) -> str:
        return str(self.root / rel)

    def holds(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def link(self, item: Found) -> tuple[str, bool] | None:
        path = self.root / item.rels[0]
        if not path.is_symlink():
            return None
        return os.readlink(path), path.exists()

    def stamp(self, rel: str) -> tuple[int, int] | None:
        try:
            st = (self.root / rel).stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def root_files(self, items: list[Found]) -> list[str]:
        claimed = {rel for f in items for rel in f.rels}
        return sorted(
            e.name
            for e in self._list(self.root)
            if e.is_file() and e.name.endswith(CHECKPOINT_SUFFIXES) and e.name not in claimed
        )

    def top_entries(self) -> dict[str, bool]:
        return {p.name: p.is_dir() and not p.is_symlink() for p in self._list(self.root)}

    def mark_links(self, checkpoints: list[RunCheckpoint]) -> None:
        """A checkpoint a symlink in the run folder points at (Lightning `last.ckpt`) is in use."""
        real_root = os.path.realpath(self.root)
        targets: set[str] = set()
        for folder in scan_dirs(self.root):
            for entry in self._list(folder):
                if entry.is_symlink():
                    real = real_path(entry)
                    if real.startswith(real_root + os.sep):
                        targets.add(real)
        for c in checkpoints:
            if not c.symlink and real_path(c.path) in targets:
                c.markers.append("link-target")


def scan_dirs(run_dir: Path) -> list[Path]:
    """The run folder and its checkpoint sub-folders (`naming.SUBFOLDERS`) that are folders."""
    dirs = [run_dir]
    for sub in SUBFOLDERS:
        candidate = run_dir / sub
        if candidate.is_dir() and not candidate.is_symlink():
            dirs.append(candidate)
    return dirs


def _holds_checkpoint(entry: Path) -> bool:
    # a linked folder is not walked (it may point anywhere): its name decides
    return entry.is_symlink() or _looks_like_checkpoint_folder(entry)


def _looks_like_checkpoint_folder(path: Path) -> bool:
    """A plain `NAME-N/` folder counts only when it holds checkpoint files (not logs), and is
    no run folder of its own (`naming.holds_run`: Lightning's `version_0/`)."""
    return _plain_folder_kind(path) == "checkpoint"


def _plain_folder_kind(path: Path) -> Literal["checkpoint", "run", "other"]:
    """What a plain `NAME-N/` folder is: one checkpoint, a run folder of its own, or neither."""
    inside: list[str] = []
    holds = False
    for dirpath, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not is_parity_path(d)]  # `ckpt protect`'s parity
        holds = holds or any(is_checkpoint_file(f) for f in files)
        where = Path(dirpath).relative_to(path).as_posix()
        inside += [name if where == "." else f"{where}/{name}" for name in files]
    if not holds:
        return "other"
    return "run" if holds_run(inside) else "checkpoint"


#: how deep below a folder `nested_runs` looks for the step checkpoints that make it a run
#: folder: `exp1/checkpoints/checkpoint_1/model.safetensors` (accelerate), `trial_0/checkpoint/
#: step-10/.metadata` (torchtitan); never a walk of a whole tree given by mistake (`ckpt latest ~`)
_RUN_DEPTH = 4


def nested_runs(run_dir: Path, list_dir: Callable[[Path], list[Path]]) -> list[str]:
    """The folders at the top of `run_dir` that are run folders of their own (`holds_run`):
    a sweep's `trial_0/`, Lightning's `version_0/`, experiments `exp1/` of any name."""
    return [
        e.name
        for e in list_dir(run_dir)
        if e.is_dir()
        and not e.is_symlink()
        and not e.name.startswith(".")
        and holds_run(_files_below(e, _RUN_DEPTH))
    ]


def _files_below(folder: Path, depth: int) -> list[str]:
    """The checkpoint files under `folder` at most `depth` names down, relative to it."""
    found: list[str] = []
    for dirpath, dirs, names in os.walk(folder):
        where = Path(dirpath).relative_to(folder)
        if len(where.parts) + 1 >= depth:
            dirs[:] = []
        else:
            dirs[:] = [d for d in dirs if not is_parity_path(d)]
        found += [(where / n).as_posix() for n in names if is_checkpoint_file(n)]
    return found


def discover_local(
    run_dir: Path, list_dir: Callable[[Path], list[Path]] = lambda p: sorted(p.iterdir())
) -> list[Found]:
    """The candidate checkpoints of a local run folder; `list_dir` lists its folders (a scan
    passes one that lists each folder once for all its steps)."""

    return collect(
        (entry.relative_to(run_dir).as_posix(), entry.is_dir(), partial(_holds_checkpoint, entry))
        for folder in scan_dirs(run_dir)
        for entry in list_dir(folder)
    )


def _local_root(run_dir: str | Path | Source) -> Path:
    if isinstance(run_dir, Source) and run_dir.location.path is not None:
        return run_dir.location.path
    return Path(str(run_dir).removeprefix("file://"))


def looks_like_run(path: str | Path | Source) -> bool:
    """Whether `path` is a local run folder holding step checkpoints (not itself a checkpoint).

    A folder named like a step checkpoint (`checkpoint-500`, which may hold a DeepSpeed
    `global_step500/`) is a checkpoint; otherwise one layout folder or Lightning file, or plain
    checkpoints at two different steps and no unnumbered checkpoint file, make a run folder.
    A DeepSpeed save folder with a `latest` file and a single `global_stepN/` is that
    checkpoint (as DeepSpeed reads it); with several tags it is a run folder.
    """
    if is_remote(path):
        return looks_like_remote_run(path if isinstance(path, Source) else str(path))
    root = _local_root(path)
    if not root.is_dir():
        return False
    own = match_name(root.name, True)
    if own is not None and own[0] != "plain":
        return False
    found = [f for f in discover_local(root) if not f.temporary]
    if (root / "latest").is_file() and len(found) == 1 and found[0].layout == "deepspeed":
        return False  # DeepSpeed's save folder with its one tag: `load_checkpoint(dir)` reads it
    if any(f.layout != "plain" for f in found):
        return True
    # numbered files beside unnumbered ones are parts of one checkpoint (accelerate writes
    # model.safetensors, model_1.safetensors...), not steps
    numbered = {rel for f in found for rel in f.rels}
    for entry in root.iterdir():
        is_part = is_checkpoint_file(entry.name)
        if is_part and entry.name not in numbered:
            return False
    return len({f.step for f in found}) >= 2
