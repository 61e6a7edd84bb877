"""`sync` down: remote checkpoints streamed into staging, checked against their manifest, published."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...budgets import json_record_over_budget
from ...errors import (
    CkptError,
    DestinationExistsError,
    FormatError,
    Interrupted,
    IOFailure,
    NotFoundError,
    UnsafeInputError,
    UsageError,
    with_fix,
)
from ...faults import (
    HeldStopSignals,
    close_pool,
    interruption,
    io_failure,
    note_published,
    notice,
    submit_tracked,
)
from ...formats.names import CHECKPOINT_SUFFIXES, DCP_METADATA
from ...sources.runs import RunCheckpoint, run_storage, scan_run
from ...sources.runs.naming import (
    MEGATRON_TRACKER,
    deepspeed_step,
    deepspeed_tag,
    megatron_folder,
    megatron_tracker,
)
from ...sources.runs.records import DEFAULT_SETTLE, checksum_manifest_of
from ...storage import LocalStorage, Storage, safe_relpath
from ...storage.base import PARITY_DIR
from ...storage.hashing import hasher_factory
from ...storage.output import (
    TMP_MARKER,
    UPLOAD_BLOCK,
    apply_umask,
    fsync_dir,
    publish,
    recover_old_copies_in,
)
from ...storage.uri import parse_location
from ..verify.checksum_manifest import MANIFEST_NAME, ChecksumManifest, refuse_unsafe_manifest
from .model import DEFAULT_JOBS, RateLimit, SyncedCheckpoint, SyncReport
from .plan import POINTER_FILES, ROOT_FILES, left_out, remote_manifest_bytes


def _unsafe_key(rel: str) -> bool:
    """Whether a listed key (relative to the run folder) is not a plain relative file name.

    A key with an empty, `.` or `..` part, a backslash or a NUL (`checkpoint-200/..`,
    `checkpoint-200/../x`, `checkpoint-200/a//b`) names no file a checkpoint writer makes, and
    written to disk it would land elsewhere than its name says (or on a folder: EISDIR).
    """
    return "\\" in rel or "\x00" in rel or any(part in ("", ".", "..") for part in rel.split("/"))


def _file_and_folder(keys: dict[str, int]) -> list[str]:
    """Keys that are also the folder of another key (`a/model.safetensors` and
    `a/model.safetensors/x`): no disk holds both, and writing them would fail midway."""
    out = []
    for rel in sorted(keys):
        parts = rel.split("/")
        if any("/".join(parts[:i]) in keys for i in range(1, len(parts))):
            out.append(rel)
    return out


def _refuse_keys(storage: Storage, c: RunCheckpoint, keys: list[str]) -> UnsafeInputError:
    # as listed: `describe` would normalise the very parts that make the key unsafe
    shown = ", ".join(repr(k) for k in keys[:3])
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return UnsafeInputError(
        f"{c.name} was not pulled: the remote listing holds the key{'s' if len(keys) > 1 else ''}"
        f" {shown}{more}, not a safe file name (an empty, `.` or `..` part, or a name that is "
        "also another key's folder)",
        path=storage.describe(c.name),
        fix="Delete or rename that object in the bucket (no checkpoint writer makes such a "
        "key); the other checkpoints were pulled.",
    )


#: the staging folder of a pull: `.NAME.ckpt-tmp-pull`, kept when the pull is cut short
PULL_TAG = "pull"


def _whole(target: Path, size: int, digest: str | None, new: Callable[[], Any] | None) -> bool:
    """Whether an earlier, interrupted pull left `target` whole: its size, and its digest
    where the manifest records one (a file is renamed to its name only once it is fsynced)."""
    try:
        if target.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    if digest is None or new is None:
        return True
    hasher = new()
    with open(target, "rb") as src:
        while block := src.read(UPLOAD_BLOCK):
            hasher.update(block)
    if hasher.hexdigest() == digest:
        return True
    target.unlink()
    return False


def _fetch(
    storage: Storage,
    rel: str,
    size: int,
    target: Path,
    new: Callable[[], Any] | None,
    limit: RateLimit,
    stop: threading.Event | None = None,
) -> tuple[str | None, int]:
    """Stream one remote file to `target` (through `target.part`, fsynced, then renamed);
    returns its digest when a manifest gave the algorithm, and the bytes fetched from the
    store (less than its size when the start an interrupted pull left is kept). Once `stop`
    is set the fetch ends at its next block (`_Stopped`), its `.part` kept to resume."""
    part = target.with_name(target.name + ".part")
    try:
        return _fetch_into(storage, rel, size, target, part, new, limit, stop)
    except OSError as exc:  # a full disk, a quota, EIO: exit 74 naming the file written
        raise io_failure(exc, part, "writing") from None


def _resumable(part: Path, size: int, hasher: Any) -> int:
    """How many bytes of `part`, left by a pull cut in the middle of this file, the fetch
    keeps (fed to `hasher`): all of them when the checkpoint's manifest records the file's
    digest (`hasher`), which then judges the whole file; none without one, or when `part` is
    no shorter than the file."""
    if hasher is None:
        return 0
    try:
        held = part.stat().st_size
    except FileNotFoundError:
        return 0
    if not 0 < held < size:
        return 0
    with open(part, "rb") as src:
        while block := src.read(UPLOAD_BLOCK):
            hasher.update(block)
    return held


def _fetch_into(
    storage: Storage,
    rel: str,
    size: int,
    target: Path,
    part: Path,
    new: Callable[[], Any] | None,
    limit: RateLimit,
    stop: threading.Event | None,
) -> tuple[str | None, int]:
    hasher = new() if new else None
    offset = kept = _resumable(part, size, hasher)
    with open(part, "r+b" if offset else "wb") as out:
        out.seek(offset)
        out.truncate()
        while offset < size:
            if stop is not None and stop.is_set():
                raise _Stopped(rel)
            block = storage.read(rel, offset, min(UPLOAD_BLOCK, size - offset))
            if not block:
                raise FormatError(
                    f"the remote object ended at byte {offset} of {size}",
                    path=storage.describe(rel),
                    fix="It changed while it was read; run the sync again.",
                )
            out.write(block)
            if hasher is not None:
                hasher.update(block)
            offset += len(block)
            limit.take(len(block))
        out.flush()
        os.fsync(out.fileno())
    os.rename(part, target)
    return (hasher.hexdigest() if hasher is not None else None), size - kept


class _Stopped(Exception):
    """A fetch ended because the pull stopped (another file failed, or a signal came): what
    it wrote stays in its `.part`, for the next pull to resume."""


@dataclass(frozen=True)
class _Pulled:
    """One file of a pull: found whole in staging (`reused`), or fetched: the bytes that came
    from the store and the digest of the file's bytes (when a manifest gave the algorithm)."""

    reused: bool
    fetched: int = 0
    digest: str | None = None


def _pull_file(
    storage: Storage,
    rel: str,
    size: int,
    target: Path,
    digest: str | None,
    new: Callable[[], Any] | None,
    limit: RateLimit,
    stop: threading.Event,
) -> _Pulled:
    """Bring one file of a checkpoint into staging (`target`), unless an earlier pull left it
    there whole; `digest` is the manifest's, the caller compares the result with it."""
    if _whole(target, size, digest, new):
        _stamp(target, storage, rel)
        return _Pulled(reused=True)
    part = target.with_name(target.name + ".part")
    resumed = new is not None and part.is_file()
    got, fetched = _fetch(storage, rel, size, target, new, limit, stop=stop)
    if resumed and digest is not None and digest != got:
        # the kept start of the file was not the object's (a torn write, an object rewritten
        # since): fetched whole once more before the copy is judged damaged
        target.unlink()
        got, again = _fetch(storage, rel, size, target, new, limit, stop=stop)
        fetched += again
    _stamp(target, storage, rel)
    return _Pulled(reused=False, fetched=fetched, digest=got)


def _stamp(target: Path, storage: Storage, rel: str) -> None:
    """Give a pulled file the time its object was written in the store (as `aws s3 sync`
    does), where the store says.

    The pull's own clock said nothing true of the save: a pulled save looked just written (a
    plain-file save held back by `--settle`), and newer than its manifest in the store, so a
    push from the machine that pulled it took it for a rewritten save. With the store's
    times the copy is as old as what it copies, and both sides' times come from one clock.
    """
    stamp = storage.modified(rel)
    if stamp is not None:
        os.utime(target, (stamp, stamp))


def _drop_leftovers(staging: Path, files: dict[str, int], folder: str | None) -> None:
    """Remove what an earlier, interrupted pull left in staging that this checkpoint no
    longer holds (a `.part`, a file the remote copy has since dropped): only the listed
    files, and the manifest, are published."""
    keep = {rel.removeprefix(f"{folder}/") if folder else rel.rsplit("/", 1)[-1] for rel in files}
    keep.add(MANIFEST_NAME)
    for path in sorted(staging.rglob("*"), reverse=True):
        rel = path.relative_to(staging).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(k.startswith(rel + "/") for k in keep):
                shutil.rmtree(path, ignore_errors=True)
        elif rel not in keep:
            path.unlink()


def _download(
    storage: Storage,
    c: RunCheckpoint,
    files: dict[str, int],
    manifest: tuple[ChecksumManifest, bytes] | None,
    manifest_rel: str,
    dest_root: Path,
    limit: RateLimit,
    *,
    replace: bool = False,
    jobs: int = DEFAULT_JOBS,
) -> SyncedCheckpoint:
    """Stream one remote checkpoint into a staging folder, verified (against its manifest, of
    which `manifest` holds the bytes read, else structurally), then publish it (with
    `replace`, in place of the local copy of the same name); `jobs` files fetched at once."""
    manifest_raw = manifest[1] if manifest is not None else None
    record = manifest[0] if manifest is not None else None
    is_dir = c.name not in files
    result = SyncedCheckpoint(
        name=c.name,
        step=c.step,
        action="downloaded",
        files=len(files),
        bytes=sum(files.values()),
        manifest="checkpoint" if record else None,
    )
    final = dest_root / c.name
    final.parent.mkdir(parents=True, exist_ok=True)
    # one staging folder per checkpoint, the same name each time: a pull cut by a lost
    # connection, Ctrl-C or a killed job leaves it behind (hidden, judged an interrupted save
    # by `ckpt latest` and `ckpt prune`) and the next pull keeps every file already whole in it
    staging = final.parent / f".{final.name}{TMP_MARKER}{PULL_TAG}"
    fresh = not staging.is_dir()
    staging.mkdir(exist_ok=True)
    if fresh:
        # a plain mkdir: the published checkpoint gets what the umask gives
        apply_umask(staging, directory=True)
    claim = _claim(staging, final)
    new = hasher_factory(record.algorithm) if record else None
    damaged = False
    published = False
    try:
        wanted: list[tuple[str, int, Path, str | None]] = []
        for rel, size in sorted(files.items()):
            inside = rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]
            target = staging / inside
            target.parent.mkdir(parents=True, exist_ok=True)
            expected = record.files.get(inside) if record is not None else None
            # the parity of `ckpt protect` is in no checksum manifest: its own index records
            # every share's digest, and the pulled save's check reads it
            if record is not None and expected is None and not inside.startswith(f"{PARITY_DIR}/"):
                damaged = True
                raise FormatError(
                    f"{rel} is not listed in the checkpoint's checksum manifest",
                    path=storage.describe(manifest_rel),
                    fix="The remote copy is damaged; pull an older checkpoint, or sync "
                    "it again from a machine that has it whole.",
                )
            if expected is not None and expected.size != size:
                damaged = True
                raise FormatError(
                    f"{rel} is {size} bytes in the store, and the checkpoint's checksum "
                    f"manifest records {expected.size}",
                    path=storage.describe(manifest_rel),
                    fix="The remote copy is damaged; pull an older checkpoint, or sync "
                    "it again from a machine that has it whole.",
                )
            wanted.append((rel, size, target, expected.digest if expected else None))
        # the largest first (the longest fetch starts at once, the small files beside it),
        # `jobs` at once; each is judged in that order once it is here
        wanted.sort(key=lambda item: -item[1])
        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="ckpt-pull")
        stop = threading.Event()
        try:
            pending = [
                (
                    rel,
                    digest,
                    submit_tracked(
                        pool, _pull_file, storage, rel, size, target, digest, new, limit, stop
                    ),
                )
                for rel, size, target, digest in wanted
            ]
            futures = [future for _, _, future in pending]
            wait(futures, return_when=FIRST_EXCEPTION)
            if any(f.done() and not f.cancelled() and f.exception() for f in futures):
                # one file failed: the others end now, not once the largest is whole
                stop.set()
            for rel, digest, future in pending:
                if isinstance(future.exception(), _Stopped):
                    continue  # stopped for another file's failure, raised in its turn
                pulled = future.result()
                if pulled.reused:
                    result.files_reused += 1
                    continue
                result.files_sent += 1
                # what came over the wire: a resumed file's rest, not its whole size
                result.bytes_sent += pulled.fetched
                if digest is not None and digest != pulled.digest:
                    damaged = True
                    raise FormatError(
                        f"{rel} does not match the checkpoint's checksum manifest",
                        path=storage.describe(manifest_rel),
                        fix="The remote copy is damaged; pull an older checkpoint, or sync "
                        "it again from a machine that has it whole.",
                    )
        except BaseException:
            # a failure or Ctrl-C: the fetches under way end at their next block (a 10 GB
            # file is not finished first), their `.part` kept to resume
            stop.set()
            raise
        finally:
            # what is queued is dropped, what is being fetched ends first
            close_pool(pool)
        if record is not None:
            missing = set(record.files) - {
                rel.removeprefix(f"{c.name}/") if is_dir else rel.rsplit("/", 1)[-1]
                for rel in files
            }
            if missing:
                damaged = True
                raise FormatError(
                    f"the remote checkpoint lacks {', '.join(sorted(missing))}, "
                    "which its manifest lists",
                    path=storage.describe(manifest_rel),
                    fix="The remote copy is damaged; pull an older checkpoint, or sync "
                    "it again from a machine that has it whole.",
                )
            if is_dir and manifest_raw is not None:
                # the very manifest the files were checked against, never read again: the
                # store's could have been replaced by a newer sync meanwhile
                (staging / MANIFEST_NAME).write_bytes(manifest_raw)
                _stamp(staging / MANIFEST_NAME, storage, manifest_rel)
        _drop_leftovers(staging, files, c.name if is_dir else None)
        fsync_dir(staging)
        if record is None:
            # nothing to check the bytes against: the staged copy is checked structurally,
            # and published only if it passes
            problem = _structural_problem(
                staging if is_dir else staging / c.name.rsplit("/", 1)[-1],
                staging,
                final if is_dir else final.parent,
            )
            if problem is not None:
                damaged = True
                result.action = "failed"
                result.reason = (
                    f"no checksum manifest, and the structural check failed: {problem.rstrip('.')}; "
                    "nothing was published"
                )
                return result
        # from the rename on the checkpoint is here, whole: a signal meanwhile is held until
        # that is recorded, so it is never reported as a partial pull kept to resume
        publishing = HeldStopSignals()
        try:
            if is_dir:
                # over the local copy when it is replaced (`_resynced_since_pulled`)
                publish(staging, final, force=replace)
            else:
                # plain files of one step (`model_500.pt`, `optim_500.pt`) land side by side
                for rel in files:
                    os.rename(staging / rel.rsplit("/", 1)[-1], dest_root / rel)
        except BaseException:
            publishing.release()
            raise
        published = True
        note_published(final)
        publishing.release()
        if not is_dir:
            shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(final.parent)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the staging is kept to resume
        if published:
            raise interruption(
                exc,
                "interrupted",
                final,
                fix="Run the same `ckpt sync` again for the checkpoints not pulled yet.",
            ) from None
        raise interruption(
            exc,
            f"interrupted; the partial pull of {c.name} is kept in {staging}",
            final,
            fix="Run the same `ckpt sync` again: it resumes, keeping every file already whole.",
        ) from None
    except IOFailure as failure:  # a full disk here: the staging is kept to resume, and said so
        if damaged or not staging.exists():
            raise
        raise IOFailure(
            f"{failure.problem}; the partial pull of {c.name} is kept in {staging}",
            path=failure.path,
            fix=f"{(failure.fix or '').rstrip('.')}, then run the same `ckpt sync` again: it "
            "resumes, keeping every file already whole (or delete that folder to start over).",
        ) from None
    finally:
        if damaged:
            # nothing of a copy that disagrees with its manifest is worth keeping
            shutil.rmtree(staging, ignore_errors=True)
        if claim is not None:
            os.close(claim)
    result.verified = record is not None
    return result


def _claim(staging: Path, final: Path) -> int | None:
    """Hold the pull's staging folder for this process: an exclusive `flock` on the folder,
    released when its descriptor closes (by the kernel too, if the process is killed).

    The staging folder has one name per checkpoint, so a pull cut short is resumed; without
    the lock, a second `ckpt sync` pulling the same checkpoint into the same run folder at
    the same time wrote into the very files the first was writing (`open(... "wb")` truncates
    them under it), and the first published a file with a hole of zeros, called verified.
    Where the platform has no `flock` nothing is held.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DestinationExistsError(
            f"another `ckpt sync` is pulling it into {staging} now; nothing was written",
            path=final,
            fix="Let that sync finish (the checkpoint is then here), or stop it and run again.",
        ) from None
    return fd


def _structural_problem(staged: Path, staging: Path, shown: Path) -> str | None:
    """The first error `ckpt verify` finds in a staged copy, or None when it passes; files
    are named where they would have been published (`shown` for `staging`)."""
    from ..verify.run import verify

    report = verify(str(staged))
    if report.ok:
        return None
    first = next((p for p in report.problems if p.severity == "error"), None)
    if first is None:
        return "verify failed"
    return with_fix(first.message, first.fix).replace(str(staging), str(shown))


def _kept_local(mine: RunCheckpoint | None, path: Path) -> str | None:
    """Why the local thing of a remote checkpoint's name is neither `present` nor replaced
    by the pull (None: it is one or the other): a save still being written here, a link, or
    something that is no checkpoint. A complete local copy is never replaced by this rule;
    an incomplete or interrupted one is (`publish` swaps it out in one rename)."""
    fix = "Move it away (or wait for the save to finish), then sync again."
    if mine is None:
        return f"{path} exists here and is no checkpoint; it was not replaced. {fix}"
    if mine.symlink:
        return f"{path} is a link here ({mine.status}); it was not replaced. {fix}"
    if mine.status == "writing":
        return f"{path} is being written here ({mine.reason}); it was not replaced. {fix}"
    return None


def _resynced_since_pulled(
    storage: Storage, manifest_rel: str, listing: dict[str, int], local_manifest: Path
) -> bool:
    """Whether the remote copy of a checkpoint this machine holds was synced again after this
    copy was pulled (a run restarted from an earlier save writes the same step anew, and
    `sync` sends it up again): the remote manifest is newer than the local one, and differs.

    Only a copy with ckpt's manifest beside its files can tell (a pulled folder has one); one
    without it, the training's own save, stays as it is. Both times are the store's (a pulled
    manifest carries its object's time, `_stamp`), and they only decide whether the manifest
    is read: the bytes decide whether the copy is replaced.
    """
    if manifest_rel not in listing or listing[manifest_rel] > 16 << 20:
        return False
    try:
        pulled_at = local_manifest.stat().st_mtime
    except OSError:
        return False
    written = storage.modified(manifest_rel)
    # in whole seconds: S3 lists times to the second
    if written is None or int(written) <= int(pulled_at):
        return False
    try:
        if local_manifest.stat().st_size != listing[manifest_rel]:
            return True  # other bytes, and never read whole (a sparse file may claim GiBs)
        return storage.read_all(manifest_rel) != local_manifest.read_bytes()
    except OSError:
        return False


def _damaged_copy(
    storage: Storage, manifest_rel: str, listing: dict[str, int], local_manifest: Path
) -> str | None:
    """What a pulled copy here lost since (a file its manifest lists deleted, or at another
    size), when the store still holds that very save (the same manifest bytes); else None.

    `ckpt latest` judges a save by its markers, so a pulled Trainer save without its
    `optimizer.pt` looks complete, and was called `present` for ever. The check costs a stat
    per file; the store's manifest is read only when a file is found missing."""
    try:
        too_large = json_record_over_budget(local_manifest.stat().st_size)
        if too_large is not None:
            # no manifest a pull writes (the store's is read within the same budget)
            return f"holds a checksum manifest that {too_large}"
        record = ChecksumManifest.model_validate_json(local_manifest.read_bytes())
    except (OSError, ValueError):
        return None
    folder = local_manifest.parent
    lost = []
    for name, entry in sorted(record.files.items()):
        try:
            size = (folder / safe_relpath(name, source=str(local_manifest))).stat().st_size
        except (OSError, CkptError):
            size = None
        if size != entry.size:
            lost.append(f"lacks {name}" if size is None else f"has {name} at {size} bytes")
    if not lost or manifest_rel not in listing:
        return None
    try:
        if local_manifest.stat().st_size != listing[manifest_rel] or (
            storage.read_all(manifest_rel) != local_manifest.read_bytes()
        ):
            return None  # another save of that name: not a copy of this one
    except (OSError, NotFoundError):
        return None
    return ", ".join(lost[:3]) + (f" (and {len(lost) - 3} more)" if len(lost) > 3 else "")


def _root_file_newer(name: str, remote: bytes, local: bytes | None, held: set[str]) -> bool:
    """Whether the remote copy of a run folder's own file should be written here (`local`:
    the file here, None when there is none).

    `latest` (DeepSpeed's pointer to its newest finished save): when the save it names is
    here whole (a pointer to a save that failed to pull would send `load_checkpoint` to a
    missing folder) and is not older than the one the local file names; a local run that
    has moved past the store keeps its own; Megatron-LM's `latest_checkpointed_iteration.txt`
    alike. `metrics.jsonl`: when the remote log has grown from the local one (a log written
    here since is kept).
    """
    if name == MEGATRON_TRACKER:
        named = megatron_tracker(remote.decode(errors="replace"))
        if megatron_folder(named) not in held:
            return False
        ours = megatron_tracker(local.decode(errors="replace")) if local is not None else None
        return not isinstance(ours, int) or not isinstance(named, int) or named >= ours
    if name == "latest":
        tag = deepspeed_tag(remote.decode(errors="replace"))
        if tag is None or tag not in held:
            return False
        if local is None:
            return True
        theirs = deepspeed_step(tag)
        mine = deepspeed_step(deepspeed_tag(local.decode(errors="replace")))
        return mine is None or theirs is None or theirs >= mine
    return local is None or (len(remote) > len(local) and remote.startswith(local))


def _pull_root_files(
    storage: Storage, listing: dict[str, int], dest_root: Path, held: set[str]
) -> None:
    """Bring the run folder's own files (`ROOT_FILES`) here when missing or older
    (`_root_file_newer`), through the run folder's write side so that each appears whole or
    not at all."""
    run = LocalStorage(dest_root)
    for name in ROOT_FILES:
        size = listing.get(name)
        if size is None or size > 16 << 20:
            continue
        local = dest_root / name
        mine = None
        if local.exists():
            if not local.is_file() or (name not in POINTER_FILES and local.stat().st_size >= size):
                continue  # an append-only log no longer than ours holds nothing new
            mine = local.read_bytes()
        remote = storage.read_all(name)
        if remote != mine and _root_file_newer(name, remote, mine, held):
            run.write_file(name, [remote])


def _passed_over(
    checkpoints: list[RunCheckpoint], wanted: list[RunCheckpoint], latest_only: bool
) -> list[SyncedCheckpoint]:
    """The remote checkpoints a pull does not fetch, each `skipped` with why: unfinished
    (an upload cut short, one still going) or slimmed to its weights (not a save to resume
    from). With `--latest`, only those newer than the one fetched (the older ones were not
    asked for)."""
    newest = wanted[-1].order if latest_only and wanted else None
    fetched = {c.name for c in wanted}
    out = []
    for c in checkpoints:
        if c.name in fetched or (c.complete and not c.slim):
            continue
        if newest is not None and c.order < newest:
            continue
        reason = (
            f"{c.status}: {c.reason}"
            if not c.complete
            else "weights only (slimmed by prune --slim-older-than): no save to resume from"
        )
        out.append(
            SyncedCheckpoint(
                name=c.name, step=c.step, action="skipped", reason=reason, bytes=c.size
            )
        )
    return out


def _refuse_one_checkpoint(src: str, dest: str, listing: dict[str, int]) -> None:
    """Refuse a SRC that is one checkpoint (its own weights or DCP files at its top), not a run
    folder of step checkpoints: every file of it was listed as not synced and the pull said
    "0 checkpoints", exit 0 (UsageError, naming its run folder)."""
    top = {rel.split("/", 1)[0] for rel in listing if "/" not in rel}
    if not any(name.endswith((*CHECKPOINT_SUFFIXES, DCP_METADATA)) for name in top):
        return
    location = parse_location(src.rstrip("/"))
    if location.kind == "hf":
        at_root = not location.subfolder.strip("/")
    else:
        at_root = "/" not in location.raw.partition("://")[2].strip("/")
    if at_root:
        # a Hub repo, or a bucket, of its own: there is no run folder above it
        fix = f"Copy the checkpoint with `ckpt convert {src} {dest}`."
    else:
        parent = src.rstrip("/").rpartition("/")[0]
        fix = (
            f"Pull its run folder: `ckpt sync {parent} {dest}` (`--latest` for the newest "
            "complete save only)."
        )
    raise UsageError("is one checkpoint, not a run folder of step checkpoints", path=src, fix=fix)


def sync_down(
    src: str,
    dest: str,
    *,
    latest_only: bool = False,
    limit: RateLimit | None = None,
    settle: float = DEFAULT_SETTLE,
    dry_run: bool = False,
    only: str | None = None,
    replace_local: bool = False,
    jobs: int = DEFAULT_JOBS,
) -> SyncReport:
    """`ckpt sync s3://… RUN_DIR`: pull the newest (or every missing) complete checkpoint.

    With `dry_run` nothing is written (DEST is not even created, no staging folder is made):
    each checkpoint the pull would fetch is reported `downloaded` with its files and bytes,
    judged from the listing, the manifests and the local copies as the pull judges them.

    `only`: pull that one checkpoint (by name), which must be complete, whatever else the run
    holds (the Checkpointer's resume picks its own newest save, not the run's newest folder).
    With `replace_local` the local copy of that checkpoint is replaced by the store's, whole as
    it looks (the caller found a flipped bit in it that sizes and markers do not show).
    The files of a checkpoint are fetched `jobs` at once, the largest first.
    """
    limit = limit or RateLimit(None)
    remote = scan_run(src.rstrip("/"), settle=0.0)
    storage = run_storage(src.rstrip("/"))
    listing = storage.list_files()
    if not remote.checkpoints:
        _refuse_one_checkpoint(src, dest, listing)
    dest_root = Path(dest)
    report = SyncReport(source=src, dest=dest, direction="down", dry_run=dry_run)
    wanted = [c for c in remote.checkpoints if c.complete and not c.slim]
    if only is not None:
        wanted = [c for c in wanted if c.name == only]
        if not wanted:
            raise NotFoundError(
                f"no complete checkpoint {only} in the remote run folder",
                path=src,
                fix="`ckpt latest` on it lists every checkpoint and why it is not complete.",
            )
    if latest_only:
        if not wanted:
            raise NotFoundError(
                "no complete checkpoint in the remote run folder",
                path=src,
                fix="`ckpt latest` on it lists every checkpoint and why it is not complete.",
            )
        wanted = wanted[-1:]
    # made once there is something to pull into it: a refused pull leaves no empty DEST
    if not dry_run:
        dest_root.mkdir(parents=True, exist_ok=True)
        # a pull killed while it replaced a save left the local copy aside: put back (then
        # judged below as any local copy) or, where the new one was published, removed; a
        # dry run leaves it where it is (it writes nothing)
        for note in recover_old_copies_in(dest_root):
            notice(note)
    report.checkpoints += _passed_over(remote.checkpoints, wanted, latest_only)
    # what is here already, judged as `ckpt latest` judges it: a save cut short here is no
    # copy of the store's complete one
    here = (
        {c.name: c for c in scan_run(dest_root, settle=settle).checkpoints}
        if dest_root.is_dir()
        else {}
    )
    for c in wanted:
        is_dir = c.name not in listing
        manifest_rel = checksum_manifest_of(c.name, is_dir)
        own = {p.removeprefix(remote.run_dir.rstrip("/") + "/") for p in c.paths}
        files = {
            rel: size
            for rel, size in listing.items()
            if (rel.startswith(f"{c.name}/") if is_dir else rel in own) and rel != manifest_rel
        }
        replace = False
        replaced_why = "synced again since it was pulled: the local copy was replaced"
        if (dest_root / c.name).exists() or (dest_root / c.name).is_symlink():
            mine = here.get(c.name)
            kept = _kept_local(mine, dest_root / c.name)
            if kept is not None:
                report.failed.append(f"{c.name}: {kept}")
                report.checkpoints.append(
                    SyncedCheckpoint(
                        name=c.name, step=c.step, action="failed", reason=kept, files=len(files)
                    )
                )
                continue
            assert mine is not None  # `_kept_local` keeps what is no checkpoint here
            local_manifest = dest_root / manifest_rel
            if replace_local and c.name == only:
                replace = True
                replaced_why = "the local copy failed its check: replaced by the store's copy"
            elif not mine.complete:
                replace = True
                replaced_why = (
                    f"the local copy was {mine.status} ({mine.reason}): replaced by the "
                    "store's complete copy"
                )
            else:
                replace = is_dir and _resynced_since_pulled(
                    storage, manifest_rel, listing, local_manifest
                )
                damage = (
                    None
                    if replace or not is_dir
                    else _damaged_copy(storage, manifest_rel, listing, local_manifest)
                )
                if damage is not None:
                    replace = True
                    replaced_why = (
                        f"the local copy {damage}, which the manifest it was pulled with "
                        "lists: replaced by the store's copy"
                    )
            if not replace:
                report.checkpoints.append(
                    SyncedCheckpoint(
                        name=c.name,
                        step=c.step,
                        action="present",
                        files=len(files),
                        bytes=sum(files.values()),
                    )
                )
                continue
        unsafe = {rel for rel in [c.name, *files] if _unsafe_key(rel)}
        hostile = sorted(unsafe | set(_file_and_folder(files)))
        if hostile:
            refused = _refuse_keys(storage, c, hostile)
            report.refused_keys += hostile
            report.failed.append(f"{c.name}: {refused.message}")
            report.checkpoints.append(
                SyncedCheckpoint(
                    name=c.name,
                    step=c.step,
                    action="failed",
                    reason=refused.message,
                    files=len(files),
                )
            )
            continue
        try:
            manifest = (
                remote_manifest_bytes(storage, manifest_rel) if manifest_rel in listing else None
            )
            if manifest is not None and manifest[0].unsafe_names():
                report.refused_keys += [
                    f"{manifest_rel}: {name}" for name in manifest[0].unsafe_names()
                ]
                refuse_unsafe_manifest(manifest[0], storage.describe(manifest_rel))
            if dry_run:
                done = SyncedCheckpoint(
                    name=c.name,
                    step=c.step,
                    action="downloaded",
                    files=len(files),
                    bytes=sum(files.values()),
                    files_sent=len(files),
                    bytes_sent=sum(files.values()),
                    manifest="checkpoint" if manifest is not None else None,
                )
            else:
                done = _download(
                    storage,
                    c,
                    files,
                    manifest,
                    manifest_rel,
                    dest_root,
                    limit,
                    replace=replace,
                    jobs=jobs,
                )
            if replace and done.action == "downloaded":
                done.reason = replaced_why
        except (IOFailure, Interrupted):
            raise  # this machine's disk failed, or a signal came: not the checkpoint's fault
        except CkptError as error:
            done = SyncedCheckpoint(name=c.name, step=c.step, action="failed", reason=str(error))
        if done.action == "failed":
            report.failed.append(f"{c.name}: {done.reason}")
        report.checkpoints.append(done)
        report.bytes_sent += done.bytes_sent
        if done.action == "downloaded":
            report.transferred.append(c.name)
    order = {c.name: c.order for c in remote.checkpoints}
    report.checkpoints.sort(key=lambda done: order[done.name])
    report.left_out = left_out(remote.top_entries, remote.checkpoints, remote.run_dir)
    if dry_run:
        storage.close()
        # as DEST holds it now
        report.latest = (
            scan_run(dest_root, settle=0.0, until_latest=True).latest
            if dest_root.is_dir()
            else None
        )
        return report
    held = {c.name for c in report.checkpoints if c.action in ("present", "downloaded")}
    _pull_root_files(storage, listing, dest_root, held)
    storage.close()
    local = scan_run(dest_root, settle=0.0, until_latest=True)
    report.latest = local.latest
    return report
