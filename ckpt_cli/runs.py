"""Run folders: find the step checkpoints a training job wrote, and judge each one.

`scan_run(run_dir)` lists the checkpoints of a run folder in the layouts people use:

| layout | what is recognised |
|---|---|
| `hf-trainer` | `checkpoint-N/` (Hugging Face Trainer) |
| `accelerate` | `checkpoints/checkpoint_N/` (accelerate `save_state` with automatic naming) |
| `torchtitan` | `step-N/`, also under `checkpoint/` (torchtitan's default folder) |
| `deepspeed` | `global_stepN/`, with the `latest` file naming the last finished save |
| `lightning` | `*.ckpt` files with `step=N` / `epoch=N` in their names (also under `checkpoints/`) |
| `plain` | any other `NAME-N` / `NAME_N` folder, or file with a checkpoint extension |

Files of the `plain` layout that share a step (`model_500.pt`, `optim_500.pt`) form one
checkpoint.

**Completeness.** A checkpoint is complete when every component it holds has its commit
marker and passes its format's structural check (`Format.check`: metadata and file sizes,
no tensor data): each DCP folder has its `.metadata`, each safetensors index names only shards
that exist with valid headers, each safetensors / torch.save file is whole. Layout rules come
on top: a Trainer folder needs a whole `trainer_state.json` (recent transformers write it
last), a DeepSpeed `global_stepN/` newer than the step the `latest` file names is unfinished
(DeepSpeed writes `latest` after every rank is done), and accelerate and plain folders, which
have no marker at all, are incomplete when they lack a digit-free file (`optimizer.bin`) that
at least two other saves of the run all have. Staging folders of interrupted saves are never
complete: ckpt's own `.NAME.ckpt-tmp-*` (see `output.py`; `prune` also renames what it deletes
to such a name first), the Trainer's `tmp-checkpoint-N`, and `NAME.tmp` / `.partial` /
`.incomplete`. A torch.save file whose pickle names classes `weights_only` refuses (Lightning's
hyper-parameters) is judged by its zip structure, without unpickling.

**Still being written.** Nothing tells a reader that another process is writing, so ckpt uses
time: an incomplete checkpoint or a staging folder with a file modified within the last
`settle` seconds (default 120) is `writing`, not `interrupted`; `prune` never touches a
checkpoint with a file that recent, complete or not. A save that stalls for longer than the
window without writing a byte would be judged interrupted; raise `--settle` for such jobs.

**Metrics.** Values for best-by-metric come, in this order of preference, from a
`metrics.jsonl` in the run folder (one JSON object per line with `step` and metric values:
`{"step": 500, "eval_loss": 1.92}`; the last line for a step wins), the `log_history` of the
newest `trainer_state.json`, and `NAME=VALUE` pairs in Lightning file names
(`epoch=3-step=400-val_loss=0.25.ckpt`). A checkpoint gets the value logged at its own step.

The library never prints; `ops.prune` and `commands/latest.py` build on this module.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import stat
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from .errors import CkptError, NotFoundError, UsageError
from .output import TMP_MARKER
from .storage import Storage, is_parity_path, read_regular

#: files modified within this many seconds mark a checkpoint as possibly still being written
DEFAULT_SETTLE = 120.0
#: `prune` renames what it deletes to `.NAME.ckpt-tmp-del-*` first
DELETING = "del-"
#: metric file read from the run folder
METRICS_FILE = "metrics.jsonl"
#: written into a checkpoint folder that `prune --slim-older-than` slimmed to its weights
SLIM_RECORD = "ckpt-slim.json"
#: the run folder's record of slimmed single-file checkpoints (name -> size, mtime_ns...)
RUN_SLIM_RECORD = ".ckpt-slim.json"

Status = Literal["complete", "incomplete", "interrupted", "writing"]

_TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")
_CKPT_EXT = (*_TORCH_EXT, ".safetensors", ".distcp")
#: plain `NAME_N.ext` files: extensions that can be a whole checkpoint (not `.distcp` pieces)
_PLAIN_EXT = (*_TORCH_EXT, ".safetensors")
#: `model-00001-of-00003`, `rng_state_1`: numbered parts of one checkpoint, not steps
_PART = re.compile(r".*-\d+-of-\d+|rng_state.*|.*rank.*")
_FOLDER_LAYOUTS: list[tuple[str, re.Pattern[str]]] = [
    ("hf-trainer", re.compile(r"checkpoint-(\d+)")),
    ("accelerate", re.compile(r"checkpoint_(\d+)")),
    ("torchtitan", re.compile(r"step-(\d+)")),
    ("deepspeed", re.compile(r"global_step(\d+)")),
]
_PLAIN = re.compile(r"(?P<stem>.+?)[-_](?P<n>\d+)(?P<ext>\.[A-Za-z]+)?")
_LIGHTNING_PAIR = re.compile(r"([A-Za-z_][\w/.]*?)=(-?[\d.]+(?:e-?\d+)?)")
_TEMP_NAMES = [
    re.compile(r"\.(?P<name>.+?)" + re.escape(TMP_MARKER) + r".*"),
    re.compile(r"tmp[-_](?P<name>.+)"),
    re.compile(r"(?P<name>.+)\.(?:tmp|partial|incomplete)"),
]
#: sub-folders that hold the checkpoints in some layouts (accelerate, torchtitan, Lightning)
_SUBFOLDERS = ("checkpoints", "checkpoint")


class RunCheckpoint(BaseModel):
    """One step checkpoint of a run folder.

    Attributes:
        name: its path relative to the run folder (`checkpoint-500`, `checkpoints/checkpoint_3`).
        path: its full path (what `ckpt latest` prints).
        paths: every path it consists of (several for plain files sharing a step).
        layout: `hf-trainer`, `accelerate`, `torchtitan`, `deepspeed`, `lightning` or `plain`.
        step / epoch: from its name (`epoch` for Lightning names only).
        size: bytes on disk (a symlink counts as 0: deleting it frees nothing).
        mtime: newest modification time of its files (seconds since the epoch).
        status: `complete`; `incomplete` (a marker missing or a structural problem);
            `interrupted` (a staging folder left by a save that stopped); `writing` (incomplete
            or staging, and modified within the settle window).
        complete: status is `complete`.
        reason: why it is not complete (or why it is treated with care).
        formats: the formats of its components (`safetensors`, `dcp`, `torch`).
        symlink: it is a symbolic link (deleting it unlinks the link, never the target).
        link_target: where the link points.
        markers: `newest` (newest complete), `trainer-best` (the Trainer's
            `best_model_checkpoint`), `deepspeed-latest` (named by the `latest` file),
            `link-target` (a symlink in the run folder points at it), `best` (best by metric).
        metric: the value of the metric asked for, at this checkpoint's step.
        slim: `prune --slim-older-than` removed its optimizer / RNG / data-loader state: it
            holds weights only, is complete but not a resume point (marker `weights-only`).
    """

    name: str
    path: str
    paths: list[str]
    layout: str
    step: int | None = None
    epoch: float | None = None
    size: int = 0
    mtime: float = 0.0
    status: Status = "complete"
    complete: bool = True
    reason: str | None = None
    formats: list[str] = Field(default_factory=list)
    symlink: bool = False
    link_target: str | None = None
    markers: list[str] = Field(default_factory=list)
    metric: float | None = None
    slim: bool = False

    @property
    def order(self) -> tuple[float, float, float]:
        """Sort key: step, then epoch, then time (unknown steps sort first)."""
        step = float(self.step) if self.step is not None else -math.inf
        epoch = self.epoch if self.epoch is not None else -math.inf
        return (step, epoch, self.mtime)


class BestMetric(BaseModel):
    """Where the best checkpoint by a metric comes from.

    Attributes:
        metric: the metric name (`eval_loss`).
        mode: `min` or `max`.
        source: the file (or `file names`) the values were read from.
        name / value: the best complete checkpoint and its value (None when no checkpoint has one).
    """

    metric: str
    mode: Literal["min", "max"]
    source: str | None = None
    name: str | None = None
    value: float | None = None


class RunReport(BaseModel):
    """The checkpoints of a run folder.

    Attributes:
        run_dir: the folder scanned.
        layouts: the layouts found.
        checkpoints: every checkpoint, oldest first (by step, then time).
        latest: path of the newest complete checkpoint (None if there is none).
        trainer_state: the `trainer_state.json` the Trainer markers were read from.
        trainer_best: the Trainer's `best_model_checkpoint` (as a name in the run folder).
        trainer_best_metric: the Trainer's `best_metric`.
        deepspeed_latest: the folder the DeepSpeed `latest` file names.
        best: best-by-metric, when a metric was asked for.
        settle: the settle window used (seconds).
        root_files: checkpoint files directly in the run folder that belong to no step
            checkpoint (the Trainer's final `model.safetensors`, say).
    """

    run_dir: str
    layouts: list[str] = Field(default_factory=list)
    checkpoints: list[RunCheckpoint] = Field(default_factory=list)
    latest: str | None = None
    trainer_state: str | None = None
    trainer_best: str | None = None
    trainer_best_metric: float | None = None
    deepspeed_latest: str | None = None
    best: BestMetric | None = None
    settle: float = DEFAULT_SETTLE
    root_files: list[str] = Field(default_factory=list)

    @property
    def newest_complete(self) -> RunCheckpoint | None:
        """The newest complete checkpoint a run can resume from (slimmed saves are not)."""
        done = [c for c in self.checkpoints if c.complete and not c.slim]
        return max(done, key=lambda c: c.order) if done else None


# --------------------------------------------------------------------------- discovery


@dataclass
class _Found:
    layout: str
    step: int | None
    epoch: float | None
    paths: list[Path]
    temporary: bool = False


def _match_name(name: str, is_dir: bool) -> tuple[str, int | None, float | None] | None:
    """(layout, step, epoch) for an entry name, or None when it is not a checkpoint name."""
    if is_dir:
        for layout, pattern in _FOLDER_LAYOUTS:
            m = pattern.fullmatch(name)
            if m:
                return layout, int(m.group(1)), None
    if name.endswith(".ckpt") and ("step=" in name or "epoch=" in name):
        pairs = dict(_LIGHTNING_PAIR.findall(name[: -len(".ckpt")]))
        step = _int_or_none(pairs.get("step"))
        epoch = _float_or_none(pairs.get("epoch"))
        return "lightning", step, epoch
    m = _PLAIN.fullmatch(name)
    if m and not _PART.fullmatch(m.group("stem") + "-" + m.group("n")):
        ext = m.group("ext")
        if is_dir and ext is None:
            return "plain", int(m.group("n")), None
        if not is_dir and ext is not None and ext.lower() in _PLAIN_EXT:
            return "plain", int(m.group("n")), None
    return None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _lightning_metrics(name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in _LIGHTNING_PAIR.findall(name.removesuffix(".ckpt")):
        number = _float_or_none(value)
        if number is not None and key not in ("step", "epoch"):
            out[key] = number
    return out


def _looks_like_checkpoint_folder(path: Path) -> bool:
    """A plain `NAME-N/` folder counts only when it holds checkpoint files (not logs)."""
    for _dirpath, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not is_parity_path(d)]  # `ckpt protect`'s parity
        if any(f.endswith(_CKPT_EXT) or f == ".metadata" for f in files):
            return True
    return False


def _classify(entry: Path) -> _Found | None:
    name = entry.name
    is_dir = entry.is_dir()
    for pattern in _TEMP_NAMES:
        m = pattern.fullmatch(name)
        if m:
            inner = m.group("name")
            matched = _match_name(inner, is_dir) or _match_name(inner, not is_dir)
            if matched is None and TMP_MARKER not in name:
                continue  # `notes.tmp` is not a checkpoint; ckpt's own staging always is
            layout, step, epoch = matched or ("plain", None, None)
            return _Found(layout, step, epoch, [entry], temporary=True)
    matched = _match_name(name, is_dir)
    if matched is None:
        return None
    layout, step, epoch = matched
    plain_folder = layout == "plain" and is_dir and not entry.is_symlink()
    if plain_folder and not _looks_like_checkpoint_folder(entry):
        return None
    return _Found(layout, step, epoch, [entry])


def _scan_dirs(run_dir: Path) -> list[Path]:
    dirs = [run_dir]
    for sub in _SUBFOLDERS:
        candidate = run_dir / sub
        if candidate.is_dir() and not candidate.is_symlink():
            dirs.append(candidate)
    return dirs


def _discover(run_dir: Path) -> list[_Found]:
    found: list[_Found] = []
    plain_files: dict[tuple[Path, int | None], _Found] = {}
    for folder in _scan_dirs(run_dir):
        for entry in sorted(folder.iterdir()):
            item = _classify(entry)
            if item is None:
                continue
            if item.layout == "plain" and not item.temporary and not entry.is_dir():
                key = (folder, item.step)
                if key in plain_files:
                    plain_files[key].paths.append(entry)
                    continue
                plain_files[key] = item
            found.append(item)
    return found


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
    from .formats import get_format, resolve_source

    try:
        problems = get_format(fmt_name).check(resolve_source(str(path)))
    except CkptError as error:
        return error.message
    errors = [p for p in problems if p.severity == "error"]
    if errors and fmt_name == "torch" and all(p.code == "unsafe_input" for p in errors):
        # A whole file whose pickle names classes weights_only refuses (Lightning's
        # hyper_parameters, say) is complete all the same: judge its structure instead.
        return _torch_structure(path)
    return errors[0].message if errors else None


def _torch_structure(path: Path) -> str | None:
    """Whether a torch.save file (or bin index) is whole, without unpickling anything."""
    size = path.stat().st_size
    if size == 0:
        return f"{path}: empty file"
    if path.name.endswith(".index.json"):
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
        if root.name.endswith(".safetensors"):
            return [("safetensors", root)]
        if root.name.endswith(_TORCH_EXT):
            return [("torch", root)]
        if root.name.endswith(".distcp"):
            return [("dcp", root.parent)]
        return []
    out: list[tuple[str, Path]] = []
    for dirpath, dirs, files in os.walk(root):
        here = Path(dirpath)
        # the parity of `ckpt protect` is not a checkpoint part (its .bin files are no torch.save)
        dirs[:] = sorted(d for d in dirs if not is_parity_path(d))
        if ".metadata" in files or any(f.endswith(".distcp") for f in files):
            out.append(("dcp", here))
            continue
        claimed: set[str] = set()
        for fname in sorted(files):
            if fname.endswith(".safetensors.index.json") or (
                fname.endswith(".index.json") and fname.rsplit(".", 2)[0].endswith(_TORCH_EXT)
            ):
                kind = "safetensors" if fname.endswith(".safetensors.index.json") else "torch"
                out.append((kind, here / fname))
                claimed.update(_index_shards(here / fname))
        for fname in sorted(files):
            if fname in claimed:
                continue
            if fname.endswith(".safetensors"):
                out.append(("safetensors", here / fname))
            elif fname.endswith(_TORCH_EXT):
                out.append(("torch", here / fname))
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


def _judge(
    item: _Found,
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
        return _with_status(
            entry,
            "writing" if recent else "interrupted",
            f"staging folder of a {what} in progress"
            if recent
            else f"staging folder left by an interrupted {what}",
        )
    if symlink and not primary.exists():
        return _with_status(entry, "incomplete", f"dangling link to {entry.link_target}")
    problem, formats = _judge_components(item.paths)
    entry.formats = formats
    if problem is None and item.layout == "hf-trainer" and primary.is_dir():
        problem = _trainer_state_problem(primary / "trainer_state.json")
    entry.slim = _is_slim(primary, root)
    if entry.slim:
        entry.markers.append("weights-only")
    if problem is None and expected and not entry.slim:
        missing = expected - _part_names(primary)
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
        return _with_status(entry, "writing", f"modified in the last {settle:g} s: {problem}")
    return _with_status(entry, "incomplete", problem)


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


def _with_status(entry: RunCheckpoint, status: Status, reason: str) -> RunCheckpoint:
    entry.status = status
    entry.complete = status == "complete"
    entry.reason = reason
    return entry


# --------------------------------------------------------------------------- markers, metrics


def _deepspeed_latest(run_dir: Path) -> str | None:
    latest = run_dir / "latest"
    if not latest.is_file() or latest.stat().st_size > 4096:
        return None
    try:
        text = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def _trainer_state(
    run_dir: Path, checkpoints: list[RunCheckpoint]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest `trainer_state.json`: of the newest complete Trainer folder, or the run root."""
    candidates: list[tuple[float, Path]] = []
    for c in checkpoints:
        if c.layout == "hf-trainer" and c.complete and not c.symlink:
            candidates.append((float(c.step or 0), Path(c.path) / "trainer_state.json"))
    root = run_dir / "trainer_state.json"
    states: list[tuple[float, Path, dict[str, Any]]] = []
    for _order, path in [*sorted(candidates, reverse=True)[:1], (0.0, root)]:
        if not path.is_file():
            continue
        try:
            doc = json.loads(read_regular(path))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, CkptError):
            continue
        if isinstance(doc, dict):
            states.append((float(doc.get("global_step") or 0), path, doc))
    if not states:
        return None
    _step, path, doc = max(states, key=lambda s: s[0])
    return path, doc


def _name_in_run(run_dir: Path, pointer: str, checkpoints: list[RunCheckpoint]) -> str | None:
    """Match a path recorded by a trainer (absolute, or relative to its cwd) to a checkpoint."""
    base = Path(pointer).name
    for c in checkpoints:
        if Path(c.path).name == base:
            return c.name
    return None


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
            value = _lightning_metrics(c.name.rsplit("/", 1)[-1]).get(metric)
            if value is not None:
                by_name[c.name] = value
    if by_name and source is None:
        source = "Lightning file names"
    return by_step, by_name, source


# --------------------------------------------------------------------------- entry point


#: layouts with no commit marker of their own: their saves are compared with each other
_UNMARKED = ("accelerate", "plain")


def _part_names(folder: Path) -> set[str]:
    """Top-level file names of a checkpoint folder without digits (`optimizer.bin`, not
    `random_states_3.pkl`, whose count follows the number of processes)."""
    try:
        return {
            e.name
            for e in folder.iterdir()
            if e.is_file() and not any(ch.isdigit() for ch in e.name)
        }
    except OSError:
        return set()


def _expected_parts(found: list[_Found]) -> dict[int, set[str]]:
    """For folders of unmarked layouts: the files every *other* save of the run has.

    accelerate's `save_state` writes model, optimizer, scheduler, sampler... with no marker
    at the end, so a save cut short after the model looks whole on its own. Against at least
    two other saves of the same run it does not. Names are compared, nothing is read.
    """
    out: dict[int, set[str]] = {}
    for layout in _UNMARKED:
        folders = [
            f
            for f in found
            if f.layout == layout
            and not f.temporary
            and f.paths[0].is_dir()
            and not f.paths[0].is_symlink()
        ]
        if len(folders) < 3:
            continue
        names = {id(f): _part_names(f.paths[0]) for f in folders}
        # slimmed saves lack their optimizer on purpose: they say nothing about the others
        full = [f for f in folders if SLIM_RECORD not in names[id(f)]]
        if len(full) < 3:
            continue
        # the names every *other* full folder has, for all folders in one pass (not N² set
        # intersections): those in all of them, plus, for a full folder, those missing from
        # it alone
        counts: collections.Counter[str] = collections.Counter()
        for f in full:
            counts.update(names[id(f)])
        everywhere = {n for n, c in counts.items() if c == len(full)}
        all_but_one = {n for n, c in counts.items() if c == len(full) - 1}
        in_full = {id(f) for f in full}
        for f in folders:
            out[id(f)] = everywhere | (all_but_one - names[id(f)] if id(f) in in_full else set())
    return out


def _name_order(item: _Found) -> tuple[float, float, float]:
    """Newest-first order known before judging: step, epoch, then the entry's own time."""
    try:
        mtime = item.paths[0].lstat().st_mtime
    except OSError:
        mtime = 0.0
    step = float(item.step) if item.step is not None else -math.inf
    epoch = item.epoch if item.epoch is not None else -math.inf
    return (step, epoch, mtime)


def scan_run(
    run_dir: str | Path,
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
    if is_remote(run_dir):
        return scan_remote_run(
            str(run_dir),
            metric=metric,
            mode=mode,
            settle=settle,
            now=now,
            until_latest=until_latest,
        )
    root = Path(str(run_dir).removeprefix("file://"))
    if not root.exists():
        raise NotFoundError("no such folder", path=root, fix="Check the run folder's path.")
    if not root.is_dir():
        raise UsageError(
            "is not a folder",
            path=root,
            fix="Pass the run folder that holds the step checkpoints (checkpoint-N/...).",
        )
    now = time.time() if now is None else now
    found = _discover(root)
    ds_latest = _deepspeed_latest(root)
    ds_step = _int_or_none(ds_latest.removeprefix("global_step")) if ds_latest else None
    expected = _expected_parts(found)
    judged: list[RunCheckpoint] = []
    for item in sorted(found, key=_name_order, reverse=True):
        judged.append(_judge(item, root, now, settle, ds_step, expected.get(id(item))))
        if until_latest and judged[-1].complete and not judged[-1].slim:
            break
    checkpoints = sorted(judged, key=lambda c: c.order)
    report = RunReport(
        run_dir=str(root),
        layouts=sorted({c.layout for c in checkpoints}),
        checkpoints=checkpoints,
        settle=settle,
        root_files=_root_files(root, found),
    )
    newest = report.newest_complete
    if newest is not None:
        newest.markers.append("newest")
        report.latest = newest.path
    if ds_latest:
        for c in checkpoints:
            if c.layout == "deepspeed" and Path(c.path).name == ds_latest:
                c.markers.append("deepspeed-latest")
                report.deepspeed_latest = c.name
    _mark_link_targets(root, checkpoints)
    state = _trainer_state(root, checkpoints)
    trainer_doc = None
    if state is not None:
        state_path, trainer_doc = state
        report.trainer_state = str(state_path)
        pointer = trainer_doc.get("best_model_checkpoint")
        if isinstance(pointer, str) and pointer:
            report.trainer_best = _name_in_run(root, pointer, checkpoints)
            best_metric = trainer_doc.get("best_metric")
            if isinstance(best_metric, int | float):
                report.trainer_best_metric = float(best_metric)
            for c in checkpoints:
                if c.name == report.trainer_best:
                    c.markers.append("trainer-best")
    if metric:
        report.best = _best_by_metric(root, metric, mode, trainer_doc, checkpoints)
    return report


def _root_files(root: Path, found: list[_Found]) -> list[str]:
    claimed = {p for f in found for p in f.paths}
    return sorted(
        e.name
        for e in root.iterdir()
        if e.is_file() and e.name.endswith(_CKPT_EXT) and e not in claimed
    )


def _mark_link_targets(root: Path, checkpoints: list[RunCheckpoint]) -> None:
    """A checkpoint a symlink in the run folder points at (Lightning `last.ckpt`) is in use."""
    real_root = os.path.realpath(root)
    targets: set[str] = set()
    for folder in _scan_dirs(root):
        for entry in folder.iterdir():
            if entry.is_symlink():
                real = os.path.realpath(entry)
                if real.startswith(real_root + os.sep):
                    targets.add(real)
    for c in checkpoints:
        if not c.symlink and os.path.realpath(c.path) in targets:
            c.markers.append("link-target")


def _best_by_metric(
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


def looks_like_run(path: str | Path) -> bool:
    """Whether `path` is a local run folder holding step checkpoints (not itself a checkpoint).

    A folder named like a step checkpoint (`checkpoint-500`, which may hold a DeepSpeed
    `global_step500/`) is a checkpoint; otherwise one layout folder or Lightning file, or plain
    checkpoints at two different steps and no unnumbered checkpoint file, make a run folder.
    A DeepSpeed save folder with a `latest` file and a single `global_stepN/` is that
    checkpoint (as DeepSpeed reads it); with several tags it is a run folder.
    """
    if is_remote(path):
        return looks_like_remote_run(str(path))
    root = Path(path)
    if not root.is_dir():
        return False
    own = _match_name(root.name, True)
    if own is not None and own[0] != "plain":
        return False
    found = [f for f in _discover(root) if not f.temporary]
    if (root / "latest").is_file() and len(found) == 1 and found[0].layout == "deepspeed":
        return False  # DeepSpeed's save folder with its one tag: `load_checkpoint(dir)` reads it
    if any(f.layout != "plain" for f in found):
        return True
    # numbered files beside unnumbered ones are parts of one checkpoint (accelerate writes
    # model.safetensors, model_1.safetensors...), not steps
    numbered = {p.name for f in found for p in f.paths}
    for entry in root.iterdir():
        is_part = entry.name.endswith(_CKPT_EXT) or entry.name == ".metadata"
        if is_part and entry.name not in numbered:
            return False
    return len({f.step for f in found}) >= 2


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


def is_remote(run_dir: str | Path) -> bool:
    """Whether `run_dir` is a URL (`s3://…`, `hf://…`) rather than a folder on this machine."""
    text = str(run_dir)
    return "://" in text and not text.startswith("file://")


def run_storage(run_dir: str) -> Storage:
    """The `Storage` of a remote run folder (NotFoundError when it does not exist)."""
    from .formats import resolve_source

    source = resolve_source(run_dir)
    if source.target is not None:
        raise UsageError(
            "names one file, not a run folder",
            path=run_dir,
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
        if parts[0] in _SUBFOLDERS and len(parts) >= 2:
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
    for pattern in _TEMP_NAMES:
        m = pattern.fullmatch(name)
        if m:
            inner = m.group("name")
            matched = _match_name(inner, is_dir) or _match_name(inner, not is_dir)
            if matched is None and TMP_MARKER not in name:
                continue
            layout, step, epoch = matched or ("plain", None, None)
            return _RemoteItem(layout, step, epoch, [], is_dir, dict(inside), temporary=True)
    matched = _match_name(name, is_dir)
    if matched is None:
        return None
    layout, step, epoch = matched
    if (
        layout == "plain"
        and is_dir
        and not any(f.endswith(_CKPT_EXT) or f.endswith(".metadata") for f in inside)
    ):
        return None
    return _RemoteItem(layout, step, epoch, [], is_dir, dict(inside))


def _remote_file_problem(storage: Storage, rel: str, size: int) -> str | None:
    """Whether one remote safetensors / torch.save file is whole, from its header or its end."""
    where = storage.describe(rel)
    if size == 0:
        return f"{where}: empty file"
    try:
        if rel.endswith(".safetensors"):
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
        if rel.endswith(_TORCH_EXT):
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
            kind = "safetensors" if rel.endswith(".safetensors") else "torch"
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
        if ".metadata" in names or any(n.endswith(".distcp") for n in names):
            any_component = True
            formats.append("dcp")
            if ".metadata" not in names:
                return f"{storage.describe(prefix)}: no .metadata (DCP writes it last)", formats
            continue
        claimed: set[str] = set()
        for fname in sorted(names):
            if fname.endswith(".index.json") and fname.removesuffix(".index.json").endswith(
                (".safetensors", *_TORCH_EXT)
            ):
                any_component = True
                kind = "safetensors" if ".safetensors." in fname else "torch"
                formats.append(kind)
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
            if fname in claimed or not fname.endswith((".safetensors", *_TORCH_EXT)):
                continue
            any_component = True
            formats.append("safetensors" if fname.endswith(".safetensors") else "torch")
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
    run_dir: str,
    *,
    metric: str | None = None,
    mode: Literal["min", "max"] = "min",
    settle: float = DEFAULT_SETTLE,
    now: float | None = None,
    until_latest: bool = False,
) -> RunReport:
    """`scan_run` for a run folder in an object store or on the Hub (listings and headers)."""
    storage = run_storage(run_dir)
    files = storage.list_files()
    now = time.time() if now is None else now
    root_url = run_dir.rstrip("/")
    items = _remote_items(files)
    ds_latest: str | None = None
    if "latest" in files and files["latest"] <= 4096:
        with contextlib.suppress(CkptError, UnicodeDecodeError):
            ds_latest = storage.read_all("latest").decode().strip() or None
    ds_step = _int_or_none(ds_latest.removeprefix("global_step")) if ds_latest else None
    unmarked = _remote_expected_parts(items)

    def order(item: _RemoteItem) -> tuple[float, float, float]:
        step = float(item.step) if item.step is not None else -math.inf
        epoch = item.epoch if item.epoch is not None else -math.inf
        return (step, epoch, _remote_mtime(storage, item))

    judged: list[RunCheckpoint] = []
    for item in sorted(items, key=order, reverse=True):
        judged.append(
            _judge_remote(storage, root_url, item, now, settle, ds_step, unmarked.get(id(item)))
        )
        if until_latest and judged[-1].complete and not judged[-1].slim:
            break
    checkpoints = sorted(judged, key=lambda c: c.order)
    report = RunReport(
        run_dir=root_url,
        layouts=sorted({c.layout for c in checkpoints}),
        checkpoints=checkpoints,
        settle=settle,
        root_files=sorted(
            rel
            for rel in files
            if "/" not in rel and rel.endswith(_CKPT_EXT) and not any(rel in i.rels for i in items)
        ),
    )
    newest = report.newest_complete
    if newest is not None:
        newest.markers.append("newest")
        report.latest = newest.path
    if ds_latest:
        for c in checkpoints:
            if c.layout == "deepspeed" and c.name.rsplit("/", 1)[-1] == ds_latest:
                c.markers.append("deepspeed-latest")
                report.deepspeed_latest = c.name
    trainer_doc = None
    trainers = [c for c in checkpoints if c.layout == "hf-trainer" and c.complete]
    for rel in [f"{trainers[-1].name}/trainer_state.json"] if trainers else []:
        doc = _remote_json(storage, rel)
        if isinstance(doc, dict):
            trainer_doc = doc
            report.trainer_state = storage.describe(rel)
    if trainer_doc is not None:
        pointer = trainer_doc.get("best_model_checkpoint")
        if isinstance(pointer, str) and pointer:
            base = pointer.rstrip("/").rsplit("/", 1)[-1]
            report.trainer_best = next(
                (c.name for c in checkpoints if c.name.rsplit("/", 1)[-1] == base), None
            )
            best_metric = trainer_doc.get("best_metric")
            if isinstance(best_metric, int | float):
                report.trainer_best_metric = float(best_metric)
            for c in checkpoints:
                if c.name == report.trainer_best:
                    c.markers.append("trainer-best")
    if metric:
        metrics_file = None
        if METRICS_FILE in files:
            raw = storage.read_all(METRICS_FILE)
            metrics_file = (storage.describe(METRICS_FILE), raw.decode("utf-8", "replace"))
        report.best = _best_by_metric(
            Path("."), metric, mode, trainer_doc, checkpoints, metrics_file or ("", "")
        )
        if report.best.source == "":
            report.best.source = None
    storage.close()
    return report


def _remote_mtime(storage: Storage, item: _RemoteItem) -> float:
    stamps = [
        storage.modified(f"{item.rels[0]}/{rel}" if item.is_dir else rel) for rel in item.files
    ]
    return max((s for s in stamps if s is not None), default=0.0)


def _remote_expected_parts(items: list[_RemoteItem]) -> dict[int, set[str]]:
    """The remote twin of `_expected_parts`: names every other save of an unmarked layout has."""
    out: dict[int, set[str]] = {}
    for layout in _UNMARKED:
        folders = [i for i in items if i.layout == layout and i.is_dir and not i.temporary]
        names = {
            id(f): {n for n in f.files if "/" not in n and not any(ch.isdigit() for ch in n)}
            for f in folders
        }
        full = [f for f in folders if SLIM_RECORD not in names[id(f)]]
        if len(full) < 3:
            continue
        for f in folders:
            out[id(f)] = set.intersection(*[names[id(o)] for o in full if o is not f])
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
        return _with_status(
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
        return _with_status(entry, "writing", f"modified in the last {settle:g} s: {problem}")
    return _with_status(entry, "incomplete", problem)


def looks_like_remote_run(path: str) -> bool:
    """Whether a remote location holds step checkpoints and no checkpoint of its own."""
    try:
        files = run_storage(path).list_files()
    except (NotFoundError, UsageError):
        return False  # not a folder-like location: opened as a checkpoint, which says why
    top = {rel.split("/", 1)[0] for rel in files}
    if ".metadata" in top or any(t.endswith(_CKPT_EXT) and "-of-" in t for t in top):
        return False
    if any(t.endswith(".index.json") for t in top) or "model.safetensors" in top:
        return False
    return any(not i.temporary and i.layout != "plain" for i in _remote_items(files))
