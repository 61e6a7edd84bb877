"""Slimming: keep the weights of an old save, remove the state only a resume needs.

Optimizer state is several times the size of the weights, and an old save of a run is
rarely resumed from; it is kept for evaluation or export. `slim_plan` finds what of one
checkpoint is training-only state: the optimizer, RNG, data-loader (sampler) and gradient-scaler
state, from the training-state analysis of `layouts` (headers only), by one rule for every
layout; a folder's plan lists every one of its files, removed or kept, with why. `slim` then removes it:

* a folder of component files (Trainer `checkpoint-N/`, accelerate, DeepSpeed): the component
  files are deleted (each renamed to a hidden `.NAME.ckpt-tmp-del-*` name first);
* a DCP folder or a single torch.save file (torchtitan `step-N/`, `state.pt`, Lightning
  `.ckpt`): the checkpoint is rewritten without those entries by `ops.convert` into a hidden
  staging sibling (so it passes the format's structural check before it is published), then
  published with its slim record as `--force` publishes (`storage.output.publish`: one atomic
  exchange, or the old copy kept as `.NAME.ckpt-old-*`, never debris), the old one removed
  last.

The scheduler, the step counter and the configuration stay: they are small and say where the
weights came from (a Trainer's `scheduler.pt` and `trainer_state.json`, accelerate's
`scheduler.bin`); so does accelerate's registered objects' state (`custom_checkpoint_N.pkl`),
the script's own, which may be an EMA of the weights. A slimmed save records itself (`ckpt-slim.json` inside a folder, the run
folder's `.ckpt-slim.json` for single files, keyed by name with its size and mtime so a new
save under the same name is not mistaken for it); `ckpt_cli.sources.runs` reads the record so that
`ckpt latest` never offers a slimmed save as a resume point.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from ...budgets import json_record_over_budget
from ...errors import CkptError, FormatError, IOFailure
from ...formats import find_format, get_format
from ...formats.base import Checkpoint
from ...models import Record
from ...sources.runs import (
    DELETING,
    RUN_SLIM_RECORD,
    SLIM_RECORD,
    deleting_process,
    still_deleting,
)
from ...storage.base import is_parity_path
from ...storage.output import TMP_MARKER, fsync_dir, publish

if TYPE_CHECKING:
    from ..parity import ParityManifest

#: training-only components removed by slimming, each with why (the same for every layout)
REMOVED_WHY = {
    "optimizer": "the optimizer's state: only a resume reads it",
    "rng": "RNG states: only a resume reads them",
    "dataloader": "the data loader's position: only a resume reads it",
    "sampler": "the data sampler's state: only a resume reads it",
    "scaler": "the gradient scaler's loss scale (fp16): only a resume reads it",
}
DROPPED = tuple(REMOVED_WHY)

#: why slimming keeps a component's files, by component (numbered ones by their stem)
_KEPT_WHY = {
    "model": "the model's weights",
    "scheduler": "the LR scheduler's state: small, it says where in the schedule the weights "
    "were saved (slimming keeps the scheduler, step and configuration in every layout)",
    "trainer_state": "the step and log history: small, it says where the weights came from",
    "custom": "a registered object's state (accelerate's register_for_checkpointing): the "
    "script's own, perhaps an EMA of the weights or its step counter, which ckpt cannot tell "
    "apart, so it stays",
}
#: why slimming keeps a file no component names
_OTHER_WHY = (
    "not resume state (configuration, tokenizer, the script's own files): slimming removes only "
    "optimizer, RNG, data-loader and gradient-scaler state"
)


def is_dropped(component: str) -> bool:
    """Whether slimming removes `component`: one of `DROPPED`, also numbered per model or per
    rank (`optimizer_1`, `rng_3`, `optimizer_0_rank1`): a multi-model or multi-rank save
    kept its second optimizer and every rank's RNG but the first while the plan said "drop
    optimizer, rng"."""
    return _stem(component) in DROPPED


def _stem(component: str) -> str:
    """A component without its model or rank number (`optimizer_1` -> `optimizer`)."""
    return re.sub(r"(_rank\d+|_\d+)+$", "", component)


class SlimFile(Record):
    """One file of a checkpoint slimming removes files from, and what becomes of it.

    Attributes:
        path: the file, relative to the checkpoint folder.
        removed: whether slimming removes it (else it is kept).
        why: the reason, in a few words.
    """

    path: str
    removed: bool
    why: str


class SlimAction(Record):
    """What slimming does to one checkpoint.

    Attributes:
        how: `remove` (component files are deleted) or `rewrite` (the DCP folder or torch.save
            file is rewritten without the entries under `prefixes`).
        target: the folder or file rewritten, or the checkpoint folder files are removed from.
        format: the format of a rewritten checkpoint (`dcp`, `torch`).
        components: the components removed (`optimizer`, `rng`, `dataloader`...).
        files: for `remove`: the files deleted (relative to `target`).
        prefixes: for `rewrite`: the entry-name prefixes dropped.
        bytes: bytes it frees (for a rewrite, the bytes of the dropped entries: an estimate
            until it is done, then the measured difference).
        kept: resume state slimming leaves, each with why (a DeepSpeed save's optimizer, in
            ZeRO partitions that hold the fp32 weights too).
        listing: for `remove`: every file of the checkpoint folder, removed or kept, each with
            why (nothing leaves unnamed, nothing stays unexplained).
    """

    how: Literal["remove", "rewrite"]
    target: str
    format: str | None = None
    components: list[str] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    prefixes: list[str] = Field(default_factory=list)
    bytes: int = 0
    kept: list[str] = Field(default_factory=list)
    listing: list[SlimFile] = Field(default_factory=list)


def slim_plan(path: str | Path) -> SlimAction | str:
    """What slimming the checkpoint at `path` would remove, or, when there is nothing, why
    (a phrase: `it holds no optimizer, RNG or data-loader state`)."""
    from ...sources.layouts import CompositeCheckpoint
    from ...sources.opening import open_source

    target = Path(path)
    try:
        opened = open_source(str(target))
    except CkptError as exc:
        return f"it could not be read ({exc.stated})"
    with opened.checkpoint as checkpoint:
        training = opened.training
        if training is None:
            return f"it holds no training state ({checkpoint.manifest.format} weights only)"
        named = list(training.prefixes)
        if isinstance(checkpoint, CompositeCheckpoint):
            named += [c for c in checkpoint.components if c not in named]
            # a component listed, never loaded (accelerate's pickled sampler): its file
            named += [c for c in opened.listed_parts if c not in named]
        dropped = [c for c in named if is_dropped(c)]
        if not dropped:
            return "it holds no optimizer, RNG or data-loader state"
        if isinstance(checkpoint, CompositeCheckpoint):
            files: list[str] = []
            size = 0
            owner: dict[str, str] = {}  # each component file -> its component
            weights = {  # components holding tensors: a model a save hook wrote (`unet`)...
                name
                for name, component in checkpoint.components.items()
                if any(e.kind == "tensor" for e in component.manifest.entries)
            }
            for name, component in checkpoint.components.items():
                for info in component.manifest.files:
                    rel = _relative(target, component, info.path)
                    if rel is None:
                        continue
                    owner.setdefault(rel, name)
                    if name in dropped and rel not in files:
                        files.append(rel)
                        size += (target / rel).stat().st_size
            for name, rel in opened.listed_parts.items():
                owner.setdefault(rel, name)
            for name, rel in opened.listed_parts.items():
                if name in dropped and rel not in files and (target / rel).is_file():
                    files.append(rel)
                    size += (target / rel).stat().st_size
            # a component named by its place in another one (`rng` in `rng_0.`, a DeepSpeed
            # optimizer in its ZeRO partitions) goes with that one, or stays with it
            removed = set(dropped) & (set(checkpoint.components) | set(opened.listed_parts))
            holder = {
                c: training.prefixes[c].partition(".")[0]
                for c in dropped
                if c not in removed and c in training.prefixes
            }
            gone = [c for c in dropped if c in removed or holder.get(c) in removed]
            kept = []
            for c in dropped:
                if c not in gone:
                    where = training.components.get(c) or training.components.get(holder.get(c, c))
                    if where is None:
                        kept.append(f"{c} is inside a file slimming keeps")
                    else:
                        they = "they hold" if ", " in where else "it holds"
                        kept.append(f"{c} is in {where} (kept: {they} the weights too)")
            if not files:
                return f"its {'; its '.join(kept)}" if kept else "no file holds resume state alone"
            return SlimAction(
                how="remove",
                target=str(target),
                components=gone,
                files=files,
                bytes=size,
                kept=kept,
                listing=_listing(target, files, owner, weights),
            )
        fmt = find_format(checkpoint.manifest.format)
        if target.is_dir() and fmt is not None and fmt.holds_objects and not fmt.folder:
            # a folder holding one training-state file (`step-N/state.pt`): that file is
            # rewritten
            if len(checkpoint.manifest.files) != 1:
                return (
                    f"its {', '.join(dropped)} state is in a folder of "
                    f"{len(checkpoint.manifest.files)} {checkpoint.manifest.format} files "
                    "(slimming rewrites a single file)"
                )
            target = target / checkpoint.manifest.files[0].path
        prefixes = [training.prefixes[c] for c in dropped if c in training.prefixes]
        entries = [e for e in checkpoint.manifest.entries if e.name.startswith(tuple(prefixes))]
        if not entries:
            return f"its {', '.join(dropped)} state holds no entry"
        return SlimAction(
            how="rewrite",
            target=str(target),
            format=checkpoint.manifest.format,
            components=dropped,
            prefixes=prefixes,
            bytes=sum(e.nbytes for e in entries),
        )


def _listing(
    root: Path, removed: list[str], owner: dict[str, str], weights: set[str]
) -> list[SlimFile]:
    """Every file of the checkpoint folder `root` (hidden ones and ckpt's own records aside),
    removed or kept, with why; `owner` names each component file's component, `weights` the
    components that hold tensors."""
    out = [SlimFile(path=rel, removed=True, why=REMOVED_WHY[_stem(owner[rel])]) for rel in removed]
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel in removed or not path.is_file() or path.is_symlink():
            continue
        if any(part.startswith(".") for part in rel.split("/")) or rel == SLIM_RECORD:
            continue
        comp = owner.get(rel)
        if comp is None:
            why = _OTHER_WHY
        elif _stem(comp) in _KEPT_WHY:
            why = _KEPT_WHY[_stem(comp)]
        elif comp in weights:  # a model a save hook wrote (`unet`, `lora`)
            why = f"the weights of {comp}"
        else:
            why = f"the component {comp}: {_OTHER_WHY.partition(': ')[2]}"
        out.append(SlimFile(path=rel, removed=False, why=why))
    return out


def _relative(root: Path, component: Checkpoint, name: str) -> str | None:
    """A component's file as a path relative to the checkpoint folder (None if elsewhere)."""
    base = component.storage.local_root
    full = (base / name) if base is not None else root / name
    try:
        rel = full.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return rel.as_posix() if full.is_file() else None


def _hidden(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}{TMP_MARKER}{what}{os.getpid()}-{time.time_ns()}")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def slim(action: SlimAction, checkpoint: str | Path) -> int:
    """Carry out `action` on the checkpoint at `checkpoint`; returns the bytes freed.

    The checkpoint is whole at every moment it carries its real name, and never looks
    interrupted (which `prune --incomplete` would delete): the slim record goes in before any
    file leaves (a kill mid-way leaves a weights-only save that says so), removed files go in
    one rename each before anything is deleted, and a rewrite, with its record, is published
    as `--force` publishes (one atomic exchange, or the old copy kept as `.NAME.ckpt-old-*`).
    """
    root = Path(checkpoint)
    target = Path(action.target)
    checked = _check_against_manifest(root, action)
    saved_ns = _newest_ns(root)
    protected = _parity_of(root)
    if protected is not None:
        _check_against_parity(root, action, protected)
    record: dict[str, object] = {
        "ckpt_slim": 1,
        "slimmed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "components": action.components,
        "files": action.files,
        "prefixes": action.prefixes,
        "bytes_freed": action.bytes,
    }
    if action.how == "remove":
        before = _size(root)
        _write_record(root, record)
        hidden = []
        for rel in action.files:
            path = target / rel
            aside = _hidden(path, DELETING)
            os.rename(path, aside)
            hidden.append(aside)
        fsync_dir(target)
        for aside in hidden:
            aside.unlink(missing_ok=True)
        freed = max(0, before - _size(root))
        record["bytes_freed"] = freed
        _write_record(root, record)
    else:
        freed = _rewrite(action, root, target, record, saved_ns)
    _refresh_manifest(root, checked)
    if protected is not None:
        _protect_again(root, protected)
    _keep_time(root, saved_ns)
    return freed


def finish_removal(root: Path) -> None:
    """Remove the files a slim killed midway left renamed in the slimmed folder `root`
    (`.NAME.ckpt-tmp-del-PID-NS`, out of the checkpoint since the rename): the slim record
    is in place, so the save is never slimmed again and they held their disk for good. Those
    of a `prune` still running are left to it."""
    if root.is_symlink() or not (root / SLIM_RECORD).is_file():
        return
    for entry in os.scandir(root):
        pid = deleting_process(entry.name)
        if pid is None or still_deleting(pid) or not entry.is_file(follow_symlinks=False):
            continue
        with suppress(OSError):
            os.unlink(entry.path)


def _parity_of(root: Path) -> ParityManifest | None:
    """The parity manifest of a protected checkpoint (None when it is not protected)."""
    from ..parity import read_parity_manifest
    from ..parity.target import open_parity_target

    return read_parity_manifest(open_parity_target(str(root)))


def _protect_again(root: Path, old: ParityManifest) -> None:
    """Parity for what a slimmed checkpoint now holds, as it was protected before (K, block
    size, whole files). The old parity lists the files slimming dropped: left in place,
    `verify` called them lost and `repair` wrote them back into the slimmed save.

    Raises:
        IOFailure: the new parity could not be written (the old one is gone: protect again).
    """
    import shutil

    from ..parity import protect
    from ..parity.target import open_parity_target

    target = open_parity_target(str(root))
    where = target.storage.local_path(target.parity_rel)
    try:
        if where is not None and where.is_dir():
            shutil.rmtree(where)
        protect(
            str(root),
            parity=old.parity,
            block_size=old.block_size,
            whole_files=True if old.whole_files else None,
        )
    except (CkptError, OSError) as exc:
        why = exc.message if isinstance(exc, CkptError) else (exc.strerror or str(exc))
        raise IOFailure(
            f"was slimmed, but its parity could not be written again ({why}); the parity of "
            "the full save was removed",
            path=str(root),
            fix=f"Protect it again: `ckpt protect {root}`.",
        ) from None


def _newest_ns(root: Path) -> int:
    """When the save was made: the newest mtime (ns) of the checkpoint and what it holds,
    its parity aside (`ckpt protect` of an old save is no new save)."""
    stamps = [root.lstat().st_mtime_ns]
    if root.is_dir() and not root.is_symlink():
        stamps += [
            p.lstat().st_mtime_ns
            for p in root.rglob("*")
            if not any(is_parity_path(part) for part in p.relative_to(root).parts)
        ]
    return max(stamps)


def _keep_time(root: Path, saved_ns: int) -> None:
    """Give back the save's time to what slimming rewrote or added (the rewritten files, the
    record, the folder whose entries changed): a slimmed save is as old as the save it was,
    or time rules (`--keep-within`) would keep it over newer whole ones, and the run table
    would call it new. The folder itself last (touching its files does not change it)."""
    paths = sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else []
    for path in [*paths, root]:
        st = path.lstat()
        if not path.is_symlink() and st.st_mtime_ns > saved_ns:
            os.utime(path, ns=(st.st_atime_ns, saved_ns))


#: a file's identity and state when its digest was checked: (inode, size, mtime_ns)
_Stamp = tuple[int, int, int]


def _stamp(path: Path) -> _Stamp:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _check_against_manifest(root: Path, action: SlimAction) -> dict[str, tuple[str, _Stamp]]:
    """The files a slim keeps, checked against the folder's checksum manifest first (rel ->
    their digest, and the stamp they had when checked); {} without a manifest.

    The manifest is rewritten after slimming: a file damaged before would otherwise be
    recorded as the checkpoint's content, and `verify --checksums` would call it intact.

    Raises:
        FormatError: a kept file is missing or no longer matches the manifest (nothing is
            slimmed).
    """
    from ...storage.hashing import hash_files
    from ..verify.checksum_manifest import MANIFEST_NAME, read_manifest

    path = root / MANIFEST_NAME
    if not root.is_dir() or not path.is_file():
        return {}
    old = read_manifest(path)
    dropped = set(action.files) if action.how == "remove" else set()
    kept = {rel: d for rel, d in old.files.items() if rel not in dropped}
    stamps: dict[str, _Stamp] = {}
    missing: list[str] = []
    for rel in kept:
        try:
            stamps[rel] = _stamp(root / rel)
        except FileNotFoundError:
            missing.append(rel)
    wrong = [rel for rel, st in stamps.items() if st[1] != kept[rel].size]
    digests = hash_files({rel: root / rel for rel in stamps if rel not in wrong}, old.algorithm)
    wrong += [rel for rel, digest in digests.items() if digest != kept[rel].digest]
    if missing or wrong:
        bad = sorted(wrong) + sorted(missing)
        raise FormatError(
            f"{_damaged(bad, MANIFEST_NAME)}; slimming rewrites the manifest and would record "
            "the damage as the checkpoint's content",
            path=str(root / bad[0]),
            fix=f"See `ckpt verify {root} --checksums`; restore the file (`ckpt repair` where "
            "the checkpoint is protected, or from a good copy), then slim.",
        )
    return {rel: (digests[rel], stamps[rel]) for rel in digests}


def _damaged(bad: list[str], record: str) -> str:
    """`a, b, c (+N more) are missing or no longer match RECORD` (a manifest, a parity)."""
    shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
    one = len(bad) == 1
    return (
        f"{shown} {'is' if one else 'are'} missing or no longer "
        f"{'matches' if one else 'match'} {record}"
    )


def _check_against_parity(root: Path, action: SlimAction, protected: ParityManifest) -> None:
    """The files a slim keeps (a rewrite: every file it reads), checked against the sha256s
    of the parity manifest of a protected save first. The slimmed save is protected again:
    the new parity would record a damaged file as its content, and the old one, which can
    still rebuild it, would be gone.

    Raises:
        FormatError: a kept file is missing or no longer matches its parity (nothing is
            slimmed).
    """
    from ..parity.target import sha256_file

    base = root if root.is_dir() else root.parent
    dropped = set(action.files) if action.how == "remove" else set()
    bad: list[str] = []
    for f in protected.files:
        if f.path in dropped:
            continue
        path = base / f.path
        try:
            intact = path.stat().st_size == f.size and sha256_file(path) == f.sha256
        except FileNotFoundError:
            intact = False
        if not intact:
            bad.append(f.path)
    if bad:
        raise FormatError(
            f"{_damaged(bad, 'the parity `ckpt protect` wrote')}; slimming protects the save "
            "again and would record the damage as its content",
            path=str(base / bad[0]),
            fix=f"Rebuild it with `ckpt repair {root}` (see `ckpt verify {root} --checksums`), "
            "then slim.",
        )


def _refresh_manifest(root: Path, checked: dict[str, tuple[str, _Stamp]]) -> None:
    """A checksum manifest in a slimmed folder is rewritten for what the folder now holds
    (same algorithm), so `verify --checksums` and `ckpt sync` keep working on it. A file
    `checked` against the old manifest before slimming, and unchanged since, keeps that digest;
    the others (rewritten, the slim record) are hashed."""
    from ... import __version__
    from ...storage.hashing import hash_files
    from ..verify.checksum_manifest import (
        MANIFEST_NAME,
        ChecksumManifest,
        FileDigest,
        read_manifest,
    )

    path = root / MANIFEST_NAME
    if not root.is_dir() or not path.is_file():
        return
    old = read_manifest(path)
    files = {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.is_symlink()
        and p.name != MANIFEST_NAME
        and not is_parity_path(p.relative_to(root).as_posix())
    }
    digests = {
        rel: checked[rel][0]
        for rel, p in files.items()
        if rel in checked and _stamp(p) == checked[rel][1]
    }
    digests.update(hash_files({r: p for r, p in files.items() if r not in digests}, old.algorithm))
    record = ChecksumManifest(
        algorithm=old.algorithm,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        tool=f"ckpt {__version__} prune --slim-older-than",
        format=old.format,
        files={
            rel: FileDigest(size=p.stat().st_size, digest=digests[rel]) for rel, p in files.items()
        },
    )
    _atomic_json(path, record.model_dump(mode="json"))


def _rewrite(
    action: SlimAction, root: Path, target: Path, record: dict[str, object], saved_ns: int
) -> int:
    """Rewrite a DCP folder or torch.save file without the dropped entries and publish it
    with its slim record (as `--force` publishes); returns the bytes freed."""
    import shutil

    from ..convert.run import convert

    assert action.format is not None and get_format(action.format).holds_objects, action.format
    staged = _hidden(target, "slim-")
    if target.is_file():
        # convert writes one file when DEST ends like one (`.pt`, `.ckpt`...)
        staged = staged.with_name(staged.name + target.suffix)
    mode = target.stat().st_mode & 0o7777
    try:
        convert(
            str(target),
            str(staged),
            action.format,
            format=action.format,
            exclude=[f"{p}*" for p in action.prefixes],
        )
        # the rewrite keeps the permissions the training job gave the save
        os.chmod(staged, mode)
        freed = max(0, _size(target) - _size(staged))
        record["bytes_freed"] = freed
        # the record is in place before the slimmed save carries its name: never a save that
        # lacks its optimizer without saying why (`prune --incomplete` would delete it)
        if target == root and staged.is_dir():
            _atomic_json(staged / SLIM_RECORD, record)
            fsync_dir(staged)
        elif target == root:
            # keyed by size and mtime, which the publishing rename keeps: the save's own time
            # first (`_keep_time`), so the record matches the file as published
            _keep_time(staged, saved_ns)
            _write_file_record(root, staged, record)
        else:
            _write_record(root, record)
        publish(staged, target, force=True)
    except BaseException:
        if staged.is_dir() and not staged.is_symlink():
            shutil.rmtree(staged, ignore_errors=True)
        else:
            staged.unlink(missing_ok=True)
        raise
    return freed


def _write_record(root: Path, record: dict[str, object]) -> None:
    """`ckpt-slim.json` in a slimmed folder; an entry of the run folder's record for a file."""
    if root.is_dir():
        _atomic_json(root / SLIM_RECORD, record)
        return
    _write_file_record(root, root, record)


def _write_file_record(root: Path, stamped: Path, record: dict[str, object]) -> None:
    """The run folder's record for the file `root`, keyed by the size and mtime of `stamped`
    (the file itself, or the rewrite that is about to take its name)."""
    run_record = root.parent / RUN_SLIM_RECORD
    try:
        # past the budget: no record this writes, and read whole it would choose the memory
        if json_record_over_budget(run_record.stat().st_size) is not None:
            raise ValueError("not a record prune writes")
        doc = json.loads(run_record.read_text())
        if not isinstance(doc, dict):
            doc = {}
    except (OSError, ValueError, RecursionError):
        doc = {}
    st = stamped.stat()
    doc[root.name] = {**record, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _atomic_json(run_record, doc)


def _atomic_json(path: Path, doc: object) -> None:
    tmp = _hidden(path, "rec-")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
