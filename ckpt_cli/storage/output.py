"""Atomic outputs: write into a hidden temporary sibling, publish with one rename.

A crash, a SIGKILL or Ctrl-C mid-write leaves at most a `.<name>.ckpt-tmp-*` sibling (which
`ckpt prune --incomplete` and `ckpt latest` treat as an interrupted save), never a DEST that
looks complete. The staging folder is held by its process (`new_staging_folder`: a `flock`
the kernel drops when the process dies), so the next run writing the same DEST removes those
of a run that is gone (`remove_dead_stagings`) and never one that is still being written. An existing DEST is refused unless `force` is given; then it is replaced only
after the new output is complete.

DEST may also be an fsspec URL (`s3://bucket/prefix`, `gs://…`): `resolve_destination` turns
it into a `RemoteDest` and `staged_output` then

1. stages the output in a local temporary folder (`TMPDIR`), where the writers work exactly as
   for a local DEST (`pwrite`, in-kernel copies, fsync) and the format's structural check runs;
2. streams every file to a hidden temporary prefix beside DEST
   (`s3://bucket/.NAME.ckpt-tmp-XXXX/…`, multipart uploads through `fs.open("wb")`, four
   files at a time), the commit marker (`*.index.json`, `.metadata`) last;
3. publishes by copying the objects into DEST (server-side copies, four at a time), the
   marker last, and removes the temporary prefix.

Object stores have no rename and no multi-object transaction, so this is as atomic as they
allow: each object appears whole or not at all, and DEST gets its commit marker only after
every other file is in place. A failure at any step removes what was uploaded or copied, so
DEST never holds a marker without its files. A run killed outright cannot remove its temporary prefix: it
keeps a lease there, and the next run writing DEST removes the prefixes (and aborts the
multipart uploads) of runs that are gone (`object_leases`). Writers stay unchanged (they write local files),
at the price of local disk for one output.
"""

from __future__ import annotations

import contextvars
import errno
import os
import re
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..errors import (
    DestinationExistsError,
    FormatError,
    HubError,
    IOFailure,
    NotFoundError,
    UsageError,
)
from ..faults import (
    HeldStopSignals,
    interruption,
    io_failure,
    note_published,
    notice,
    submit_tracked,
)
from ..progress import NULL_PROGRESS, Progress
from . import remote_failure
from .base import TMP_MARKER as TMP_MARKER
from .base import Storage, file_chunks
from .destination import Destination as Destination
from .destination import RemoteDest as RemoteDest
from .destination import local_destination as local_destination
from .local import fsync_dir as fsync_dir
from .local import hold, process_alive, read_regular, special_file_kind
from .local import new_staging_folder as new_staging_folder
from .local import remove_dead_stagings as remove_dead_stagings
from .local import staging_held as staging_held
from .object_leases import LEASE_NAME, Lease, remove_dead_temporaries
from .remote import UPLOAD_BLOCK as UPLOAD_BLOCK
from .remote import FsspecStorage
from .uri import parse_location

#: files uploaded (and objects copied) at once: object stores scale with connections
PARALLEL_TRANSFERS = 4

#: the local staging folders open in this context: an output staged inside one of them (a
#: merge's weights, a training folder's component, a save's parity) is part of that output,
#: so its failures are reported once, by the outermost `staged_output`, naming the DEST the
#: user gave rather than a scratch folder that no longer exists
_OPEN_STAGINGS: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar(
    "ckpt_open_stagings", default=()
)


def prefix_storage(dest: RemoteDest) -> FsspecStorage:
    """The (writable) storage of the prefix that holds `dest`: uploads, copies and removals
    go through its write side."""
    return FsspecStorage(dest.fs, dest.path.rsplit("/", 1)[0], dest.url.rsplit("/", 1)[0])


def destination_exists(dest: Destination) -> bool:
    """Whether a file (or, in an object store, an object or prefix) exists at `dest`."""
    if isinstance(dest, RemoteDest):
        return _remote_exists(dest)
    return dest.exists()


def read_destination(dest: Destination, limit: int | None = None) -> bytes:
    """The whole content of the file at `dest` (a small one: a manifest); FileNotFoundError
    when there is none. A local FIFO or device named like it is refused, never waited on.

    Raises:
        FormatError: the file is longer than `limit` bytes (checked before it is read: a
            sparse file of a few bytes on disk may claim gigabytes).
    """
    if not isinstance(dest, RemoteDest):
        if not dest.exists():
            raise FileNotFoundError(errno.ENOENT, "no such file", str(dest))
        if limit is not None:
            _check_limit(dest.stat().st_size, limit, str(dest))
        return read_regular(dest)
    try:
        if limit is not None:
            _check_limit(int(dest.fs.size(dest.path)), limit, dest.url)
        data: bytes = dest.fs.cat_file(dest.path)
    except (FileNotFoundError, FormatError):
        raise
    except Exception as exc:
        raise remote_failure(exc, dest.url) from None
    return data


def _check_limit(size: int, limit: int, where: str) -> None:
    if size > limit:
        raise FormatError(
            f"is {size:,} bytes, more than the {limit:,} ckpt reads of it (a hostile or corrupt "
            "file)",
            path=where,
            fix="Move it away and write it again.",
        )


def remote_key(dest: Destination) -> str | None:
    """The path of `dest` inside its fsspec filesystem (`bucket/prefix/name`), or None for a
    local destination."""
    return dest.path if isinstance(dest, RemoteDest) else None


def refuse_dash(dest: str) -> None:
    """Refuse DEST `-`: a shell reads it as stdout (`ckpt convert m.pt - | aws s3 cp - …`);
    taken as a path it made a folder named `-` and sent the report down the pipe."""
    if dest == "-":
        raise UsageError(
            "is not standard output here: a checkpoint is written as files, and `-` would be "
            "a folder of that name",
            path="-",
            fix="Name the output's path (`./-` for a folder named `-`), then copy or upload that.",
        )


def resolve_destination(dest: str | Path) -> Destination:
    """A DEST argument as an absolute local `Path` or a `RemoteDest` (fsspec URL).

    `hf://` is refused: publishing to the Hub is a commit, which `hf upload` does.
    """
    refuse_dash(str(dest))
    loc = parse_location(str(dest))
    if loc.kind == "local":
        assert loc.path is not None
        return loc.path.absolute()
    if loc.kind == "hf":
        raise UsageError(
            "cannot write to the Hub",
            path=str(dest),
            fix="Write to a local folder, then publish it with `hf upload`.",
        )
    from . import filesystem_for

    fs, path = filesystem_for(loc)
    path = path.rstrip("/")
    if "/" not in path.strip("/"):
        raise UsageError(
            "DEST names a bucket, not a prefix inside it",
            path=str(dest),
            fix="Name a folder-like prefix, e.g. s3://bucket/checkpoints/step-1000.",
        )
    return RemoteDest(url=str(dest).rstrip("/"), fs=fs, path=path)


def _remote_exists(dest: RemoteDest) -> bool:
    try:
        return bool(dest.fs.exists(dest.path))
    except Exception as exc:  # each filesystem package raises its own network/auth errors
        raise remote_failure(exc, dest.url) from None


def require_bucket(dest: RemoteDest) -> None:
    """Refuse (exit 3) a destination whose bucket does not exist: every command that writes
    to an object store says so the same way, before any work is done."""
    bucket = dest.path.split("/", 1)[0]
    if not _remote_exists(RemoteDest(url=dest.url, fs=dest.fs, path=bucket)):
        raise NotFoundError(
            f"the bucket {bucket!r} does not exist",
            path=dest.url,
            fix="Create it first (e.g. `aws s3 mb`), or check the endpoint and credentials.",
        )


def check_destination(dest: Destination, force: bool) -> None:
    """Refuse an existing destination without --force, before any work is done."""
    if isinstance(dest, RemoteDest):
        if _remote_exists(dest) and not force:
            raise DestinationExistsError(
                "already exists (objects under this prefix)",
                path=dest.url,
                fix="Choose another destination or pass --force to replace it.",
            )
        require_bucket(dest)
        return
    if dest.exists() and _holds_current_folder(dest):
        # the output replaces DEST whole: `--local-dir .` (which `hf download` fills in place)
        # with --force would remove everything else in the folder the user is in
        raise UsageError(
            "is the current folder, or holds it: the output replaces DEST whole, so everything "
            "else in it would be removed",
            path=dest,
            fix="Name a new folder for the output (./model, say).",
        )
    special = _special_file(dest)
    if special is not None:
        # publishing renames over DEST: `/dev/null --force`, as root, would replace the
        # system's /dev/null with the output
        raise UsageError(
            f"is {special}, not an output ckpt may replace (--force replaces files, folders "
            "and links)",
            path=dest,
            fix="Name a new file or folder for the output; `--dry-run` shows what would be "
            "written without writing it.",
        )
    if (dest.exists() or dest.is_symlink()) and not force:
        raise DestinationExistsError(
            "already exists",
            path=dest,
            fix="Choose another destination or pass --force to replace it.",
        )
    if not dest.parent.exists():
        raise NotFoundError(
            "the parent folder does not exist", path=dest.parent, fix="Create it first."
        )
    if not dest.parent.is_dir():
        # a file where DEST's folder should be: the run failed creating its staging folder
        # (exit 74) after a dry run had planned the output, and after the work of reading SRC
        refused = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(dest.parent))
        raise io_failure(refused, doing=f"creating {dest.name} in it")


def _special_file(dest: Path) -> str | None:
    """What `dest` is in words when it exists as neither a regular file, a folder nor a link
    (a FIFO, a socket, a device), else None."""
    try:
        mode = dest.lstat().st_mode
    except OSError:  # missing (or unreadable: the write names that itself)
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return None
    return special_file_kind(mode)


def _holds_current_folder(dest: Path) -> bool:
    """Whether the existing folder `dest` is the working directory or one of its parents."""
    try:
        here = os.getcwd()
    except OSError:  # the working directory was removed: nothing of it to protect
        return False
    return Path(here).is_relative_to(os.path.realpath(dest))


@contextmanager
def staged_output(
    dest: Destination,
    *,
    commit_marker: Callable[[str], bool],
    force: bool = False,
    single_file: bool = False,
    progress: Progress = NULL_PROGRESS,
) -> Iterator[Path]:
    """Yield a fresh staging folder beside `dest`; on success publish it as `dest`.

    With `single_file`, the staging folder must hold exactly one file, which becomes `dest`.
    On any exception (KeyboardInterrupt included) the staging folder is removed and `dest` is
    left as it was. A `RemoteDest` is staged locally and uploaded (see the module docstring);
    `progress` then reports the bytes uploaded. `commit_marker` tells the files (paths
    relative to the output) whose presence says the output is complete (what the writer
    wrote last: the format's knowledge, `formats.names.is_commit_marker`): in an object store
    they are uploaded and published after every other file, and an old output's removed
    before its others (a folder on this machine is published with one rename).
    """
    if isinstance(dest, RemoteDest):
        with _staged_remote(
            dest,
            force=force,
            single_file=single_file,
            progress=progress,
            commit_marker=commit_marker,
        ) as s:
            yield s
        return
    dest = dest.absolute()
    # the old copy a `--force` replace of this DEST left when it was killed: put back where
    # DEST is missing, else removed (before the check: a DEST put back is refused as any)
    for note in recover_old_copies(dest):
        notice(note)
    check_destination(dest, force)
    # a signal between the staging folder's creation and the `try` that removes it would
    # leave the folder behind (and say nothing of it): the signals that stop ckpt are held
    # until the `try` is entered, where the one that came meanwhile is raised
    nested = any(dest.is_relative_to(outer) for outer in _OPEN_STAGINGS.get())
    # the staging folders of a run of this output that was killed (SIGKILL, a crash)
    remove_dead_stagings(dest.parent, dest.name)
    held = HeldStopSignals()
    try:
        staging, lock = new_staging_folder(dest.parent, dest.name)
    except OSError as exc:
        held.release()
        if nested:
            raise
        # mkdtemp names its random folder: the folder it could not write in says more
        unnamed = OSError(exc.errno, exc.strerror)
        raise io_failure(
            unnamed, dest.parent, f"creating the staging folder of {dest.name}"
        ) from None
    opened = _OPEN_STAGINGS.set((*_OPEN_STAGINGS.get(), staging))
    published = False
    try:
        held.release()
        # mkdtemp makes the folder 0700; a published output gets what a plain mkdir would
        # give (inside the try: a signal arriving meanwhile still removes the staging)
        apply_umask(staging, directory=True)
        yield staging
        if single_file:
            produced = [p for p in staging.iterdir()]
            if len(produced) != 1:
                raise RuntimeError(f"expected one output file, the writer produced {len(produced)}")
            source: Path = produced[0]
        else:
            fsync_dir(staging)
            source = staging
        # from the rename on DEST is complete: a signal meanwhile is held until that is
        # recorded, so it is never reported as a partial output removed
        publishing = HeldStopSignals()
        try:
            publish(source, dest, force=force)
        except BaseException:
            publishing.release()  # a signal that came meanwhile: an interruption, below
            raise
        published = True
        if not nested:
            note_published(dest)
        publishing.release()
        fsync_dir(dest.parent)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP
        shutil.rmtree(staging, ignore_errors=True)
        if nested:
            raise
        if published:
            raise interruption(exc, "interrupted", dest) from None
        raise interruption(exc, f"interrupted; {partial_output(dest, staging)}", dest) from None
    except OSError as exc:  # disk full, EIO, read-only, EACCES, EXDEV: exit 74, staging gone
        shutil.rmtree(staging, ignore_errors=True)
        if nested:
            raise
        raise output_failure(exc, dest, staging, removed=not staging.exists()) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    else:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        _OPEN_STAGINGS.reset(opened)
        if lock is not None:
            os.close(lock)


def partial_output(dest: Path, staging: Path, removed: bool | None = None) -> str:
    """What became of a failed output's staging folder, as the message says it: removed, or
    (`removed` False; None: looked at now) left where it is, for the next run to remove."""
    if removed is None:
        removed = not staging.exists()
    if removed:
        return "the partial output was removed"
    return (
        f"the partial output could not be removed and is left at {staging} (the next run "
        f"writing {dest.name} removes it, or remove it yourself)"
    )


def output_failure(exc: OSError, dest: Path, staging: Path, *, removed: bool = True) -> IOFailure:
    """The `IOFailure` for an OS error while `dest` was written through `staging`; `removed`:
    whether the staging folder is gone by the time the message is read (False: the removal
    itself failed, and the message says where the folder is).

    A name inside the staging folder is reported as DEST. A file outside
    it, and outside DEST, named alone is a file being read (a source shard with a bad
    sector): that file leads the message, which says it was read for DEST.
    """

    def shown(name: Any) -> Any:
        if name is None:
            return name
        path = Path(os.fsdecode(name))
        return str(dest) if path == staging or path.is_relative_to(staging) else name

    first, second = shown(exc.filename), shown(exc.filename2)
    read = (
        first is not None
        and second is None
        and first != str(dest)
        and not Path(first).is_relative_to(dest)
        and not Path(first).name.startswith(f".{dest.name}{OLD_MARKER}")
        and first != str(dest.parent)
    )
    if first is None or (first == str(dest) and second is None):
        first = None  # io_failure then names DEST, with what was being done
    mapped = OSError(exc.errno, exc.strerror, first, None, second)
    if read:
        failure = io_failure(mapped, dest, f"reading it while writing {dest}")
    else:
        failure = io_failure(mapped, dest, f"writing {dest.name}")
    problem = f"{failure.problem}; {partial_output(dest, staging, removed)}"
    return IOFailure(problem, path=failure.path, fix=failure.fix)


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path, *, directory: bool) -> None:
    """Give `path` the mode a plain `mkdir` (0777) or `open` (0666) would under the umask
    (`tempfile.mkdtemp` makes staging folders 0700, which a published output must not keep)."""
    base = 0o777 if directory else 0o666
    with suppress(OSError):
        os.chmod(path, base & ~current_umask())


#: the marker of an old DEST moved aside by `--force` (never debris: a whole checkpoint)
OLD_MARKER = ".ckpt-old-"
#: renameat2 flags: fail if the target exists / swap two paths atomically (Linux >= 3.15)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(a, b, flags): False where the platform, libc or filesystem cannot (the
    caller then falls back); other OS errors are raised (EEXIST as FileExistsError)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, or a libc without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes.append(ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one atomic step with renameat2(RENAME_EXCHANGE).

    Returns False where the platform, libc or filesystem cannot (the caller then falls back
    to two renames); other OS errors are raised.
    """
    if os.environ.get("CKPT_NO_RENAME_EXCHANGE"):
        return False
    return _renameat2(a, b, RENAME_EXCHANGE)


def _appeared(dest: Path) -> DestinationExistsError:
    return DestinationExistsError(
        "appeared while writing", path=dest, fix="Pass --force to replace it."
    )


def _rename_new(source: Path, dest: Path) -> None:
    """Rename `source` to `dest`, which must not exist: what another process published there
    meanwhile is never replaced (renameat2(RENAME_NOREPLACE); else a hard link for a file,
    which fails on an existing name, then the temporary name removed).

    Raises:
        DestinationExistsError: `dest` appeared while the output was written.
    """
    try:
        if not os.environ.get("CKPT_NO_RENAME_EXCHANGE") and _renameat2(
            source, dest, RENAME_NOREPLACE
        ):
            return
    except FileExistsError:
        raise _appeared(dest) from None
    if source.is_symlink() or not source.is_dir():
        try:
            os.link(source, dest, follow_symlinks=False)
        except FileExistsError:
            raise _appeared(dest) from None
        except OSError as exc:
            # no hard links here (some network and FUSE filesystems): the plain rename below
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
        else:
            os.unlink(source)
            return
    if dest.exists() or dest.is_symlink():
        raise _appeared(dest)
    os.rename(source, dest)


def old_copy_name(dest: Path) -> Path:
    """Where `--force` keeps the old DEST while the new one is published."""
    return dest.with_name(f".{dest.name}{OLD_MARKER}{os.getpid()}")


def leftover_old_copies(dest: Path) -> list[Path]:
    """Old copies of `dest` left by a `--force` replace that was killed mid-way."""
    import glob

    try:
        return sorted(dest.parent.glob(f".{glob.escape(dest.name)}{OLD_MARKER}*"))
    except OSError:
        return []


def recover_old_copies(dest: Path) -> list[str]:
    """Put back or remove the old copies (`.DEST.ckpt-old-PID`) that `--force` replaces of
    `dest` left when they were killed; returns what was done, for the user.

    A copy is a killed run's when its process is gone (`process_alive`) and nothing holds
    it (`publish` holds the copy it moves aside with a `flock`, which the kernel drops when
    the process dies): the copy of a replace still under way is never touched. Where DEST is
    missing, the killed run had moved the user's DEST aside and died before the new one took
    its place: the copy (the newest, should there be several) is renamed back to DEST. Where
    DEST exists it is whole (the old output or the new one), and the spare copy is removed.
    """
    prefix = f".{dest.name}{OLD_MARKER}"
    dead: list[tuple[int, Path, int]] = []
    for path in leftover_old_copies(dest):
        tail = path.name[len(prefix) :]
        if not re.fullmatch(r"[0-9]{1,10}", tail):
            continue
        pid = int(tail)
        if process_alive(pid) or staging_held(path):
            continue
        try:
            dead.append((path.lstat().st_ctime_ns, path, pid))  # a rename sets the ctime
        except OSError:
            continue
    notes: list[str] = []
    for _, path, pid in sorted(dead, reverse=True):
        if not (dest.exists() or dest.is_symlink()):
            try:
                _rename_new(path, dest)
            except (OSError, DestinationExistsError):
                continue  # left as it is: reading DEST names it, with the `mv` that recovers it
            notes.append(
                f"restored {dest} from {path.name}: a `--force` replace (process {pid}) had "
                "moved it there and was killed before publishing its new output"
            )
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):
                path.unlink()
        if not (path.exists() or path.is_symlink()):
            notes.append(
                f"removed {path.name}, the spare copy of {dest.name} that a killed `--force` "
                f"replace (process {pid}) had left beside it ({dest.name} itself is whole)"
            )
    return notes


def recover_old_copies_in(folder: Path) -> list[str]:
    """`recover_old_copies` for every output of `folder` that has an old copy beside it (a
    run folder a pull publishes into, each checkpoint a `--force` replace)."""
    pattern = re.compile(r"\.(?P<name>.+)" + re.escape(OLD_MARKER) + r"[0-9]{1,10}")
    try:
        names = {m["name"] for e in os.scandir(folder) if (m := pattern.fullmatch(e.name))}
    except OSError:
        return []
    notes: list[str] = []
    for name in sorted(names):
        notes += recover_old_copies(folder / name)
    return notes


def publish(source: Path, dest: Path, *, force: bool) -> None:
    """Rename the finished `source` to `dest`; with `force`, in place of what `dest` holds
    (one atomic exchange where the filesystem has it, else through `.DEST.ckpt-old-PID`,
    never leaving `dest` missing on a failed rename), the replaced copy then removed.

    Without `force` a `dest` that appeared meanwhile (another process published it) is never
    replaced. When publishing fails, `dest` is as it was and the new output is back at
    `source` (for the caller to remove).
    """
    if not (dest.exists() or dest.is_symlink()):
        _rename_new(source, dest)
        return
    if not force:
        raise _appeared(dest)
    old = old_copy_name(dest)
    # the old DEST is held while it waits as `old`, so no other run takes it for a killed
    # run's (`recover_old_copies`); the kernel lets go when this process ends
    guard = hold(dest)
    try:
        _replace(source, dest, old)
    finally:
        if guard is not None:
            os.close(guard)


def _replace(source: Path, dest: Path, old: Path) -> None:
    """`publish` with `force` over an existing `dest`, the old one waiting as `old`."""
    # the complete new output takes the `.DEST.ckpt-old-PID` name first, so whatever a kill
    # leaves under that name is a whole checkpoint, never debris
    os.rename(source, old)
    try:
        exchanged = _exchange(old, dest)
    except BaseException:
        # DEST could not be exchanged (a mount point: EBUSY): the new output goes back
        os.rename(old, source)
        raise
    if exchanged:
        # one atomic step: DEST is now the new output and `old` holds the replaced one
        pass
    else:
        os.rename(old, source)
        # two renames: the old DEST waits under a name that says what it is
        # (`.DEST.ckpt-old-PID`, never treated as debris); ckpt names it if DEST is missing
        os.rename(dest, old)
        try:
            os.rename(source, dest)
        except BaseException:
            os.rename(old, dest)
            raise
    fsync_dir(dest.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


# --------------------------------------------------------------------------- object stores


def publish_order(names: list[str], commit_marker: Callable[[str], bool]) -> list[str]:
    """`names` sorted with the commit markers last."""
    return sorted(names, key=lambda n: (commit_marker(n), n))


@contextmanager
def _staged_remote(
    dest: RemoteDest,
    *,
    force: bool,
    single_file: bool,
    progress: Progress,
    commit_marker: Callable[[str], bool],
) -> Iterator[Path]:
    check_destination(dest, force)
    nested = bool(_OPEN_STAGINGS.get())
    local_tmp = Path(tempfile.gettempdir())
    remove_dead_stagings(local_tmp, dest.name)  # those of a killed run, on local disk
    held = HeldStopSignals()  # as in `staged_output`: no signal before the `try`
    try:
        staging, lock = new_staging_folder(local_tmp, dest.name)
    except BaseException:
        held.release()
        raise
    # uploads, copies and removals go through the write side of the prefix holding DEST
    store = prefix_storage(dest)
    tmp_name = f".{dest.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    # this run's lease on its hidden prefix: another run writing DEST leaves it alone while
    # it is renewed, and removes the prefixes of runs that were killed (`object_leases`)
    lease = Lease(store, f"{tmp_name}/{LEASE_NAME}")

    def discard() -> None:
        lease.stop()  # no renewal lands after the removal
        _remove_remote(store, [tmp_name])
        lease.remove_late()  # (a write the store was still answering when a signal came)

    opened = _OPEN_STAGINGS.set((*_OPEN_STAGINGS.get(), staging))
    try:
        held.release()
        try:
            lease.start()
        except HubError as exc:  # the store refused the first write: named by DEST
            raise HubError(exc.problem, path=dest.url, fix=exc.fix) from None
        for note in remove_dead_temporaries(store, dest.name, lease):
            notice(note)
        yield staging
        files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        if single_file and len(files) != 1:
            raise RuntimeError(f"expected one output file, the writer produced {len(files)}")
        try:
            _upload(dest, store, staging, files, tmp_name, progress, commit_marker)
            _publish_remote(dest, store, files, tmp_name, single_file, force, commit_marker)
            if not nested:
                note_published(dest.url)
        except HubError as exc:  # a write the store refused: named by DEST as the user wrote it
            raise HubError(exc.problem, path=dest.url, fix=exc.fix) from None
        except Exception as exc:
            raise remote_failure(exc, dest.url, writing=True) from None
    except KeyboardInterrupt as exc:
        discard()
        raise interruption(exc, "interrupted; the partial output was removed", dest.url) from None
    except OSError as exc:  # this machine's side (the store's failures are mapped above)
        discard()
        raise _local_staging_failure(exc, dest, staging) from None
    except BaseException:
        discard()
        raise
    finally:
        _OPEN_STAGINGS.reset(opened)
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            os.close(lock)
    discard()


def _local_staging_failure(exc: OSError, dest: RemoteDest, staging: Path) -> IOFailure:
    """An OS error while an object-store output was staged on local disk: a file being read
    (a source shard) is named as such; otherwise the local folder the staging lives in
    (TMPDIR), which is what is full or read-only, not the store."""
    if exc.filename is not None and not Path(os.fsdecode(exc.filename)).is_relative_to(staging):
        failure = io_failure(exc, None, f"reading it while writing {dest.url}")
        fix = failure.fix
    else:
        unnamed = OSError(exc.errno, exc.strerror)
        failure = io_failure(unnamed, staging.parent, f"staging {dest.url} on local disk")
        fix = (
            f"{failure.fix} ckpt writes an object-store output on local disk first: point "
            "TMPDIR at a filesystem with room for it."
        )
    problem = f"{failure.problem}; nothing was uploaded"
    return IOFailure(problem, path=failure.path, fix=fix)


def _in_parallel(work: Callable[[str], None], names: list[str]) -> None:
    """Run `work` on every name, `PARALLEL_TRANSFERS` at a time; the first error is raised."""
    if len(names) <= 1:
        for name in names:
            work(name)
        return
    pool = ThreadPoolExecutor(PARALLEL_TRANSFERS, thread_name_prefix="ckpt-upload")
    try:
        for future in [submit_tracked(pool, work, name) for name in names]:
            future.result()
    except BaseException:
        # a failure or Ctrl-C: queued transfers never start; running ones finish before cleanup
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()


def _upload(
    dest: RemoteDest,
    store: Storage,
    staging: Path,
    files: list[str],
    tmp_name: str,
    progress: Progress,
    commit_marker: Callable[[str], bool],
) -> None:
    """Stream every staged file to the temporary prefix (data files in parallel), markers last."""
    total = sum((staging / f).stat().st_size for f in files)
    progress.start(total, f"uploading → {dest.url}")
    lock = threading.Lock()

    def counted(rel: str) -> Iterator[bytes]:
        for block in file_chunks(staging / rel, UPLOAD_BLOCK):
            yield block
            with lock:
                progress.advance(len(block))

    def upload(rel: str) -> None:
        store.write_file(f"{tmp_name}/{rel}", counted(rel))

    try:
        _in_parallel(upload, [f for f in files if not commit_marker(f)])
        _in_parallel(upload, [f for f in publish_order(files, commit_marker) if commit_marker(f)])
    finally:
        progress.finish()


def _publish_remote(
    dest: RemoteDest,
    store: Storage,
    files: list[str],
    tmp_name: str,
    single_file: bool,
    force: bool,
    commit_marker: Callable[[str], bool],
) -> None:
    """Copy the uploaded objects into DEST, the commit marker last; undo on failure."""
    if _remote_exists(dest):
        if not force:
            raise DestinationExistsError(
                "appeared while writing", path=dest.url, fix="Pass --force to replace it."
            )
        # no rename in an object store: the old output goes first, its markers before its
        # data, so no moment shows a marker over a mix of old and new files
        if dest.fs.isfile(dest.path):
            store.remove(dest.name)
        else:
            previous = FsspecStorage(dest.fs, dest.path, dest.url)
            for rel in sorted(previous.all_files(), key=lambda n: (not commit_marker(n), n)):
                previous.remove(rel)  # listed: one request each
    if single_file:
        store.copy(f"{tmp_name}/{files[0]}", dest.name)
        return
    copied: list[str] = []

    def copy(rel: str) -> None:
        target = f"{dest.name}/{rel}"
        copied.append(target)  # before the copy: a half-done copy is removed too
        store.copy(f"{tmp_name}/{rel}", target)

    try:
        _in_parallel(copy, [f for f in files if not commit_marker(f)])
        for rel in publish_order(files, commit_marker):
            if commit_marker(rel):
                copy(rel)
    except BaseException:
        _remove_remote(store, copied)
        raise


def _remove_remote(store: Storage, names: list[str]) -> None:
    """Best-effort removal of uploaded objects or prefixes (cleanup must not mask the error)."""
    for name in names:
        with suppress(Exception):
            store.remove(name)
