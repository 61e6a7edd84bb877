"""Judging one local checkpoint: complete, interrupted or still being written (commit markers, each component's format check, layout rules), and best-by-metric."""

from __future__ import annotations

import json
import os
import stat
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from ...errors import CkptError, UsageError
from ...formats.names import INDEX_SUFFIX, holds_dcp, index_format, weight_format
from ...storage import LocalStorage, Storage, is_parity_path, read_regular
from ...storage.output import TMP_MARKER
from .naming import deepspeed_tag, lightning_metrics, part_names
from .records import (
    DELETING,
    METRICS_FILE,
    RUN_SLIM_RECORD,
    SLIM_RECORD,
    BestMetric,
    Found,
    RunCheckpoint,
    Status,
)

# --------------------------------------------------------------------------- judging


def _walk_files(path: Path) -> Iterable[tuple[Path, os.stat_result]]:
    """Every file under `path` (or `path` itself), with lstat results; links are not followed."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        yield path, st
        return
    for dirpath, _dirs, files in os.walk(path):
        for fname in files:
            full = Path(dirpath, fname)
            try:
                yield full, full.lstat()
            except OSError:
                continue


def _size_and_mtime(paths: list[Path]) -> tuple[int, float]:
    size, newest = 0, 0.0
    for path in paths:
        try:
            if path.is_symlink():
                newest = max(newest, path.lstat().st_mtime)
                continue
            newest = max(newest, path.lstat().st_mtime)
            for _full, st in _walk_files(path):
                size += st.st_size
                newest = max(newest, st.st_mtime)
        except OSError:
            continue
    return size, newest


def _newest_mtime_following(paths: list[Path]) -> float:
    """Newest mtime through a symlinked checkpoint (its target is what a writer would touch)."""
    newest = 0.0
    for path in paths:
        try:
            target = path.resolve()
            newest = max(newest, target.stat().st_mtime)
            if target.is_dir():
                for _full, st in _walk_files(target):
                    newest = max(newest, st.st_mtime)
        except OSError:
            continue
    return newest


def _check_with_format(fmt_name: str, path: Path) -> str | None:
    """The first structural problem `fmt_name`'s `check` (the one `ckpt verify` runs) finds."""
    from ...formats import get_format, resolve_source

    try:
        fmt = get_format(fmt_name)
        problems = fmt.check(resolve_source(str(path)))
    except CkptError as error:
        return error.message
    errors = [p for p in problems if p.severity == "error"]
    if (
        errors
        and fmt.refused_pickles_may_be_whole
        and all(p.code == "unsafe_input" for p in errors)
    ):
        # A whole file whose pickle names classes weights_only refuses (Lightning's
        # hyper_parameters, say) is complete all the same: judge its structure instead.
        return _torch_structure(path)
    return errors[0].message if errors else None


def _torch_structure(path: Path) -> str | None:
    """Whether a torch.save file (or bin index) is whole, without unpickling anything."""
    size = path.stat().st_size
    if size == 0:
        return f"{path}: empty file"
    if path.name.endswith(INDEX_SUFFIX):
        return _check_torch_index(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"PK\x03\x04":
        return None  # legacy torch.save format: no cheap structural check
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{path}: truncated or corrupt torch.save file ({exc})"
    return None


def _check_torch_index(path: Path) -> str | None:
    try:
        index = json.loads(read_regular(path))
        shards = set(index["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, CkptError) as exc:
        return f"{path}: unreadable index ({exc})"
    for shard in sorted(shards):
        if not isinstance(shard, str) or not (path.parent / shard).is_file():
            return f"{path}: the index names shard {shard!r}, which is missing"
    return None


def _components(root: Path) -> list[tuple[str, Path]]:
    """The checkpoints inside one checkpoint (a Trainer folder holds model, optimizer...).

    Each DCP folder is one component; each safetensors or torch index, with the shards it
    names; each remaining safetensors or torch.save file.
    """
    if not root.is_dir():
        from ...formats import get_format

        fmt_name = weight_format(root.name)
        if fmt_name is None:
            return []
        # one data file of a folder format (a `.distcp`) stands for its folder
        return [(fmt_name, root.parent if get_format(fmt_name).folder else root)]
    out: list[tuple[str, Path]] = []
    for dirpath, dirs, files in os.walk(root):
        here = Path(dirpath)
        # the parity of `ckpt protect` is not a checkpoint part (its .bin files are no torch.save)
        dirs[:] = sorted(d for d in dirs if not is_parity_path(d))
        if holds_dcp(files):
            out.append(("dcp", here))
            continue
        claimed: set[str] = set()
        for fname in sorted(files):
            kind = index_format(fname)
            if kind is not None:
                out.append((kind, here / fname))
                claimed.update(_index_shards(here / fname))
        for fname in sorted(files):
            if fname in claimed:
                continue
            kind = weight_format(fname)
            if kind is not None:
                out.append((kind, here / fname))
    return out


def _index_shards(index: Path) -> set[str]:
    try:
        weight_map = json.loads(read_regular(index)).get("weight_map", {})
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (ValueError, AttributeError, OSError, RecursionError, CkptError):
        return set()


def _judge_components(paths: list[Path]) -> tuple[str | None, list[str]]:
    """(first problem or None, formats seen) over every component of a checkpoint."""
    formats: list[str] = []
    any_component = False
    for path in paths:
        for kind, component in _components(path):
            any_component = True
            if kind not in formats:
                formats.append(kind)
            problem = _check_with_format(kind, component)
            if problem:
                return problem, formats
    if not any_component:
        return "holds no checkpoint files (safetensors, DCP, torch.save)", formats
    return None, formats


def judge_found(
    item: Found,
    root: Path,
    now: float,
    settle: float,
    ds_latest_step: int | None,
    expected: set[str] | None = None,
) -> RunCheckpoint:
    primary = item.paths[0]
    symlink = primary.is_symlink()
    size, mtime = _size_and_mtime(item.paths)
    newest = _newest_mtime_following(item.paths) if symlink else mtime
    recent = now - newest < settle
    entry = RunCheckpoint(
        name=primary.relative_to(root).as_posix(),
        path=str(primary),
        paths=[str(p) for p in item.paths],
        layout=item.layout,
        step=item.step,
        epoch=item.epoch,
        size=0 if symlink else size,
        mtime=mtime,
        symlink=symlink,
        link_target=os.readlink(primary) if symlink else None,
    )
    if item.temporary:
        what = "deletion" if f"{TMP_MARKER}{DELETING}" in primary.name else "save"
        return with_status(
            entry,
            "writing" if recent else "interrupted",
            f"staging folder of a {what} in progress"
            if recent
            else f"staging folder left by an interrupted {what}",
        )
    if symlink and not primary.exists():
        return with_status(entry, "incomplete", f"dangling link to {entry.link_target}")
    problem, formats = _judge_components(item.paths)
    entry.formats = formats
    if problem is None and item.layout == "hf-trainer" and primary.is_dir():
        problem = _trainer_state_problem(primary / "trainer_state.json")
    entry.slim = _is_slim(primary, root)
    if entry.slim:
        entry.markers.append("weights-only")
    if problem is None and expected and not entry.slim:
        missing = expected - part_names(primary)
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
        problem = (
            f"newer than global_step{ds_latest_step} named by the `latest` file "
            "(DeepSpeed writes it when a save has finished)"
        )
    if problem is None:
        return entry
    if recent:
        return with_status(entry, "writing", f"modified in the last {settle:g} s: {problem}")
    return with_status(entry, "incomplete", problem)


def _is_slim(primary: Path, root: Path) -> bool:
    """Whether `prune --slim-older-than` slimmed this checkpoint (see `ops.slim`)."""
    if primary.is_dir():
        return (primary / SLIM_RECORD).is_file()
    record = primary.parent / RUN_SLIM_RECORD
    if not record.is_file():
        return False
    try:
        doc = json.loads(record.read_text())
        entry = doc.get(primary.name) if isinstance(doc, dict) else None
        st = primary.stat()
    except (OSError, ValueError):
        return False
    # a save written later under the same name is not the slimmed one
    return (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
    )


def _trainer_state_problem(path: Path) -> str | None:
    """The Trainer writes `trainer_state.json` last: missing or cut short, the save is not done."""
    if not path.is_file():
        return "no trainer_state.json (the Trainer writes it last)"
    try:
        json.loads(read_regular(path))
    except (ValueError, OSError, RecursionError, CkptError) as exc:
        return f"{path}: not valid JSON, cut short? ({exc})"
    return None


def with_status(entry: RunCheckpoint, status: Status, reason: str) -> RunCheckpoint:
    entry.status = status
    entry.complete = status == "complete"
    entry.reason = reason
    return entry


# --------------------------------------------------------------------------- markers, metrics


def _deepspeed_latest(run_dir: Path) -> str | None:
    """The tag of a local run folder's DeepSpeed `latest` file (see `read_deepspeed_latest`)."""
    return read_deepspeed_latest(LocalStorage(run_dir))


def read_deepspeed_latest(storage: Storage) -> str | None:
    """The tag a run folder's DeepSpeed `latest` file names, read through its storage (local
    or remote alike): at most 4 KiB of a regular file inside the run (a link out of the run, a
    FIFO or a folder named `latest` names nothing), and only a folder name (`deepspeed_tag`)."""
    try:
        if storage.size("latest") > 4096:
            return None
        text = storage.read_all("latest").decode()
    except (OSError, UnicodeDecodeError, CkptError):
        return None
    return deepspeed_tag(text)


def newest_trainer_state(
    storage: Storage, checkpoints: list[RunCheckpoint]
) -> tuple[str, dict[str, Any]] | None:
    """The newest `trainer_state.json`: of the newest complete Trainer folder, or the run root,
    read through the run folder's storage (a link out of the run is not read)."""
    candidates: list[tuple[float, str]] = []
    for c in checkpoints:
        if c.layout == "hf-trainer" and c.complete and not c.symlink:
            candidates.append((float(c.step or 0), f"{c.name}/trainer_state.json"))
    states: list[tuple[float, str, dict[str, Any]]] = []
    for _order, rel in [*sorted(candidates, reverse=True)[:1], (0.0, "trainer_state.json")]:
        try:
            doc = json.loads(storage.read_all(rel))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, CkptError):
            continue
        if isinstance(doc, dict):
            states.append((float(doc.get("global_step") or 0), rel, doc))
    if not states:
        return None
    _step, rel, doc = max(states, key=lambda s: s[0])
    return storage.describe(rel), doc


def load_metrics(
    run_dir: Path,
    metric: str,
    trainer_state: dict[str, Any] | None,
    checkpoints: list[RunCheckpoint],
    metrics_file: tuple[str, str] | None = None,
) -> tuple[dict[int, float], dict[str, float], str | None]:
    """Values of `metric`: (by step, by checkpoint name, source description).

    `metrics_file` is (where, text) of a metrics file read elsewhere (a remote run folder).
    """
    path: Path | str = run_dir / METRICS_FILE
    by_step: dict[int, float] = {}
    source: str | None = None
    text: str | None = None
    if metrics_file is not None:
        path, text = metrics_file
    elif isinstance(path, Path) and path.is_file():
        text = path.read_text()
    if text is not None:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise UsageError(
                    f"line {number} is not JSON",
                    path=path,
                    fix='Write one object per line: {"step": 500, "eval_loss": 1.9}.',
                ) from None
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                value = row.get(metric)
                if isinstance(value, int | float):
                    by_step[row["step"]] = float(value)
        if by_step:
            source = str(path)
    if not by_step and trainer_state is not None:
        for row in trainer_state.get("log_history") or []:
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                value = row.get(metric)
                if isinstance(value, int | float):
                    by_step[row["step"]] = float(value)
        if by_step:
            source = "trainer_state.json log_history"
    by_name: dict[str, float] = {}
    for c in checkpoints:
        if c.layout == "lightning":
            value = lightning_metrics(c.name.rsplit("/", 1)[-1]).get(metric)
            if value is not None:
                by_name[c.name] = value
    if by_name and source is None:
        source = "Lightning file names"
    return by_step, by_name, source


def best_by_metric(
    root: Path,
    metric: str,
    mode: Literal["min", "max"],
    trainer_doc: dict[str, Any] | None,
    checkpoints: list[RunCheckpoint],
    metrics_file: tuple[str, str] | None = None,
) -> BestMetric:
    by_step, by_name, source = load_metrics(root, metric, trainer_doc, checkpoints, metrics_file)
    best = BestMetric(metric=metric, mode=mode, source=source)
    for c in checkpoints:
        if c.name in by_name:
            c.metric = by_name[c.name]
        elif c.step is not None and c.step in by_step:
            c.metric = by_step[c.step]
    scored = [c for c in checkpoints if c.complete and c.metric is not None]
    if scored:
        sign = 1.0 if mode == "min" else -1.0
        # ties go to the newer checkpoint
        winner = min(scored, key=lambda c: (sign * (c.metric or 0.0), [-x for x in c.order]))
        winner.markers.append("best")
        best.name, best.value = winner.name, winner.metric
    return best
