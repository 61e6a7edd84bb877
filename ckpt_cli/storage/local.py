"""Folders on this machine: regular-file opening, `LocalStorage`, staging folders and their locks.

Writes (`LocalStorage.write_file`, `put`) go to a hidden `.NAME.ckpt-tmp-*` sibling in the
target's folder, are fsynced, and are published with one `os.replace`, so a reader or a crash
sees the old file or the new one, whole; the folder is fsynced after the rename.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..errors import FormatError, NotFoundError, UnsafeInputError
from ..faults import naming
from .base import (
    FILE_GONE_FIX,
    TMP_MARKER,
    Beside,
    FileStat,
    Storage,
    is_parity_path,
    is_staging_name,
)
from .relpath import safe_relpath

if TYPE_CHECKING:
    from .destination import Destination


def special_file_kind(mode: int) -> str:
    """What a file that is neither a regular file, a folder nor a link is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], where: str | None = None) -> int:
    """Open a file for reading only if it is a regular file; returns the descriptor.

    The open itself never blocks: a FIFO opened for reading waits for a writer forever, so
    the file is opened with O_NONBLOCK, checked with fstat, and only then made blocking again.
    A FIFO, socket or device is refused (FormatError naming it); a missing file raises
    NotFoundError.
    """
    name = where or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise NotFoundError("file not found", path=name, fix=FILE_GONE_FIX) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else special_file_kind(mode)
            raise FormatError(
                f"is {kind}, not a regular file; ckpt reads only regular files",
                path=name,
                fix="Replace it with the real file.",
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], where: str | None = None) -> bytes:
    """The whole content of a regular file (see `open_regular`)."""
    with os.fdopen(open_regular(path, where), "rb") as fh:
        return fh.read()


#: the longest file name (one path component, in bytes) and path (characters) a file name read
#: from an input may have: Linux's NAME_MAX and PATH_MAX
#: a Hugging Face cache repository folder: `models--org--name` (also datasets--, spaces--)
_HF_CACHE_REPO = re.compile(r"^(models|datasets|spaces)--[^/]+$")


def hf_cache_repo(real_root: str) -> str | None:
    """The cache repository folder (`.../models--org--name`) when `real_root` (a resolved path)
    is, or is inside, one of its `snapshots/<revision>/` folders; else None."""
    parts = real_root.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and _HF_CACHE_REPO.match(parts[i - 1]) and i + 1 < len(parts):
            return os.sep.join(parts[:i])
    return None


#: bytes of an HF cache `refs/` file read: a commit id and a newline, with room to spare
MAX_REF_BYTES = 256


def read_cache_ref(ref: Path) -> str | None:
    """The commit an HF cache `refs/<revision>` file names (stripped), or None when there is no
    such regular file. At most `MAX_REF_BYTES` are read: a refs file extended to gigabytes (a
    sparse file) names no commit, and reading it whole would choose ckpt's memory."""
    try:
        if not ref.is_file():
            return None
        with ref.open("rb") as fh:
            head = fh.read(MAX_REF_BYTES + 1)
    except OSError:
        return None
    if len(head) > MAX_REF_BYTES:
        return ""
    return head.decode("utf-8", "replace").strip()


def real_path(path: str | os.PathLike[str]) -> str:
    """`os.path.realpath(path)` for a path whose links a checkpoint's owner made. Python
    resolves a chain of links by recursion, one level per link: a chain of 1,000
    (`l999 -> l998 -> ... -> step_2`) raised RecursionError, "a bug in ckpt". The kernel follows
    at most 40 links in one lookup (ELOOP), so no reader follows such a chain: it is left
    unresolved, as `realpath` leaves a loop (`a -> b -> a`), without walking it: 10,000 such
    links walked one by one were 10^7 lookups."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return os.path.abspath(path)
    try:
        return os.path.realpath(path)
    except RecursionError:  # deeper than the kernel follows: never read through
        return os.path.abspath(path)


#: links of a loop's chain named in full; a longer chain is cut there (the kernel gives up at 40)
_LOOP_SHOWN = 8


def link_loop(path: str | os.PathLike[str]) -> str | None:
    """The chain of links `path` starts (`a -> b -> a`) when opening it fails with ELOOP, each
    by the name its link holds; None for anything else. Read with `readlink` alone, at most
    `_LOOP_SHOWN` links: nothing is opened."""
    try:
        os.stat(path)
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return None
    chain = [os.path.basename(os.fspath(path))]
    seen = {os.path.abspath(path)}
    here = os.path.abspath(path)
    for _ in range(_LOOP_SHOWN):
        try:
            target = os.readlink(here)
        except OSError:
            break
        chain.append(target)
        here = os.path.normpath(os.path.join(os.path.dirname(here), target))
        if here in seen:
            return " -> ".join(chain)
        seen.add(here)
    return " -> ".join([*chain, "..."])


class LocalStorage(Storage):
    """A folder on this machine; reads use `os.pread` so nothing is read that is not asked for."""

    hashes_in_place = True
    writable = True

    def __init__(self, root: Path, versions: dict[Path, tuple[int, ...]] | None = None):
        self.root = root
        self.display = str(root)
        self._real_root = os.path.realpath(root)
        # links may resolve anywhere inside this folder: the root, or for a Hugging Face cache
        # snapshot its repository folder (`models--org--name/`, files link to `../../blobs/`)
        self._link_root = hf_cache_repo(self._real_root) or self._real_root
        #: names already confined to the root, with their paths: one copy reads the same file
        #: for every entry it holds (20,000 entries: 80,000 realpath walks)
        self._confined: dict[str, Path] = {}
        #: each regular file resolved so far -> the version first seen (`changed_since_read`);
        #: shared with the storages of its subfolders (a training save's components)
        self._versions: dict[Path, tuple[int, ...]] = {} if versions is None else versions

    def path(self, rel: str) -> Path:
        """Absolute path of `rel`, refusing names and symlinks that leave the root (or, in a
        Hugging Face cache snapshot, the cache's repository folder)."""
        known = self._confined.get(rel)
        if known is not None:
            return known
        name = rel
        rel = safe_relpath(rel, source=self.display)
        full = self.root / rel
        real = real_path(full)
        if real != self._link_root and not real.startswith(self._link_root + os.sep):
            raise UnsafeInputError(
                f"{rel!r} is a link that points outside the checkpoint ({real})",
                path=self.describe(rel),
                fix="Copy the file into the checkpoint folder instead of linking it.",
            )
        self._confined[name] = full
        version = file_version(full)
        if version is not None:
            self._versions.setdefault(full, version)
        return full

    def changed_since_read(self) -> list[str]:
        changed = []
        for full, version in self._versions.items():
            now = file_version(full)
            # a file removed since is not counted: what was read of it was read whole (a
            # read after the removal fails by itself)
            if now is not None and now != version:  # rewritten in place, or replaced
                changed.append(str(full))
        return changed

    def broken_links(self) -> dict[str, str]:
        out: dict[str, str] = {}
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return out
        for entry in entries:
            if entry.is_symlink() and not os.path.exists(entry.path):
                out[entry.name] = real_path(entry.path)
        return dict(sorted(out.items()))

    def links_out(self, rels: Iterable[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for rel in rels:
            full = self.root / rel
            # the listing walks no linked folder: a link out is the file itself (one lstat)
            if not os.path.islink(full):
                continue
            real = real_path(full)
            if real != self._link_root and not real.startswith(self._link_root + os.sep):
                out[rel] = real
        return out

    def link_loop(self, rel: str) -> str | None:
        return link_loop(self.root / rel)

    def alias_of(self, rel: str) -> str | None:
        full = self.root / rel
        if not os.path.islink(full) or not os.path.isdir(full):
            return None
        real = real_path(full)
        if not real.startswith(self._real_root + os.sep):
            return None  # out of the checkpoint (`links_out`), or the root itself
        return os.path.relpath(real, self._real_root).replace(os.sep, "/")

    def list_files(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dirpath, dirs, files in os.walk(self.root):
            # ckpt's own staging folders are not part of the checkpoint (nor walked into)
            dirs[:] = [d for d in dirs if not is_staging_name(d)]
            if dirpath == str(self.root):
                dirs[:] = [d for d in dirs if not is_parity_path(d)]
            for fname in files:
                if is_staging_name(fname):
                    continue
                full = os.path.join(dirpath, fname)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                try:
                    out[rel] = os.stat(full).st_size
                except OSError:
                    continue
        return dict(sorted(out.items()))

    def size(self, rel: str) -> int:
        try:
            return self.path(rel).stat().st_size
        except FileNotFoundError:
            raise NotFoundError(
                "file not found", path=self.describe(rel), fix=FILE_GONE_FIX
            ) from None

    def read(self, rel: str, offset: int, length: int) -> bytes:
        path = self.path(rel)
        fd = open_regular(path)
        try:
            return _pread_exact(fd, offset, length, str(path))
        except OSError as exc:  # EIO on a failing disk: exit 74 naming the file
            from ..faults import io_failure

            raise io_failure(exc, path, f"reading {length} bytes at offset {offset}") from None
        finally:
            os.close(fd)

    def read_ranges(self, rel: str, ranges: Iterable[tuple[int, int]]) -> Iterator[bytes]:
        path = self.path(rel)
        fd = open_regular(path)
        if hasattr(os, "posix_fadvise"):
            # small reads far apart (a chunk head every few MiB): read-ahead would pull in
            # ~128 KiB of tensor data behind each 4 KiB asked for
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            for offset, length in ranges:
                try:
                    data = _pread_exact(fd, offset, length, str(path))
                except OSError as exc:  # EIO on a failing disk: exit 74 naming the file
                    from ..faults import io_failure

                    raise io_failure(
                        exc, path, f"reading {length} bytes at offset {offset}"
                    ) from None
                yield data
        finally:
            os.close(fd)

    def open(self, rel: str) -> IO[bytes]:
        path = self.path(rel)
        return os.fdopen(open_regular(path), "rb")

    def local_path(self, rel: str) -> Path | None:
        return self.path(rel)

    @property
    def local_root(self) -> Path | None:
        return self.root

    def beside(self) -> Beside | None:
        # the folder a linked save resolves to is the save: its siblings are beside that
        here = self.root.resolve()
        try:
            with os.scandir(here.parent) as entries:
                folders = tuple(sorted(e.name for e in entries if e.is_dir()))
        except OSError:
            return None  # an unreadable parent: nothing to compare with
        return Beside(here.name, folders, lambda name: LocalStorage(here.parent / name))

    def subfolder(self, rel: str) -> Storage:
        return LocalStorage(self.path(rel), self._versions)

    def describe(self, rel: str) -> str:
        return str(self.root / rel)

    # ------------------------------------------------------------------------- write side

    def _target(self, rel: str) -> Path:
        """Where `rel` is written: confined to the root; a link at that name is replaced, never
        written through (its parent folders must stay inside the root)."""
        rel = safe_relpath(rel, source=self.display)
        parent = posixpath.dirname(rel)
        folder = self.path(parent) if parent else self.root
        return folder / posixpath.basename(rel)

    def write_file(self, rel: str, chunks: Iterable[bytes]) -> int:
        final = self._target(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}{TMP_MARKER}", dir=final.parent)
        written = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            _umask_mode(Path(tmp))
            os.replace(tmp, final)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(final.parent)
        return written

    def put(self, rel: str, local: Path, *, move: bool = False) -> None:
        if not move:
            super().put(rel, local)
            return
        final = self._target(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(local, final)
        except OSError as exc:
            import errno

            if exc.errno != errno.EXDEV:
                raise
            super().put(rel, local)  # another filesystem: copied, then published by rename
            return
        fsync_dir(final.parent)

    def copy(self, src: str, rel: str) -> None:
        self.put(rel, self.path(src))

    def remove(self, rel: str) -> None:
        target = self._target(rel)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)

    def stat_files(self) -> dict[str, FileStat]:
        out: dict[str, FileStat] = {}
        for rel in self.list_files():
            try:
                st = os.stat(self.root / rel)
            except OSError:
                continue
            out[rel] = FileStat(st.st_size, st.st_mtime)
        return out

    def destination(self, rel: str) -> Destination:
        return self._target(rel)


def file_version(path: Path) -> tuple[int, ...] | None:
    """What tells one version of a regular file from the next: the file it is (device and
    inode: a replace), its size and its modification time (a rewrite in place); None for
    anything else (a folder, a name no longer there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _umask_mode(path: Path) -> None:
    """Give a file made by `mkstemp` (0600) the mode a plain `open` would (0666 less umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    with suppress(OSError):
        os.chmod(path, 0o666 & ~mask)


def fsync_dir(path: Path) -> None:
    """fsync a folder so a rename inside it is durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pread_exact(fd: int, offset: int, length: int, name: str) -> bytes:
    try:
        return _pread_all(fd, offset, length, name)
    except OSError as exc:  # a bad sector: the file read is the one to check
        raise naming(exc, name) from None


def _pread_all(fd: int, offset: int, length: int, name: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    chunks = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            raise FormatError(
                f"is truncated: wanted {length} bytes at offset {offset}, the file ends after {got}",
                path=name,
                fix="The file was cut short (interrupted save or download); write or fetch it again.",
            )
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


# --------------------------------------------------------------------- staging of a process
#
# A staging folder is held by the process writing it: an exclusive `flock` on the folder,
# which the kernel releases when that process ends, however it ends (SIGKILL included). A
# staging folder nobody holds is the debris of a writer that is gone, and the next run that
# writes the same output removes it. Where the filesystem has no `flock` nothing is held and
# nothing is ever taken for debris.

#: what `tempfile.mkdtemp` appends to a prefix: eight characters of its alphabet. Names of
#: other shapes (`prune`'s `.NAME.ckpt-tmp-del-PID-NS`, a `--force` replace's old copy) are
#: never taken for a staging folder here
_MKDTEMP_TAIL = "[a-z0-9_]{8}"


def _take_lock(path: str | Path, *, wait: bool) -> tuple[int | None, bool]:
    """(a descriptor of `path` holding an exclusive `flock`, or None; whether another process
    holds it). None and False: gone, a link (never followed), or no locks on this filesystem."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None, False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None, True
    except OSError:
        os.close(fd)
        return None, False
    return fd, False


def _lock(path: str | Path, *, wait: bool) -> int | None:
    """A descriptor of `path` holding an exclusive `flock`, or None: held by another process
    (`wait=False`), gone, a link (never followed), or no locks on this filesystem."""
    return _take_lock(path, wait=wait)[0]


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine. This process is not counted (a killed
    run's number reused by this one, as in containers where every run is PID 1), nor a
    zombie (killed, not yet reaped: it holds nothing any more); a process of another user is."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (not Linux): the signal's answer stands
        return True
    return state not in ("Z", "X")


def hold(path: Path) -> int | None:
    """A descriptor of `path` holding an exclusive `flock` (close it to let go), or None: held
    by another process, gone, a link, or no locks on this filesystem. What this process holds
    `staging_held` reports as held to every other process, until this one ends."""
    return _lock(path, wait=False)


def new_staging_folder(parent: Path, name: str) -> tuple[Path, int | None]:
    """A fresh `.NAME.ckpt-tmp-XXXXXXXX` folder in `parent`, held by this process: the folder
    and the descriptor holding it (close it once the folder is published or removed; None
    where the filesystem has no locks). OSError when the folder cannot be made."""
    while True:
        folder = Path(tempfile.mkdtemp(prefix=f".{name}{TMP_MARKER}", dir=parent))
        fd = _lock(folder, wait=True)
        if fd is None:
            return folder, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(folder, follow_symlinks=False)):
                return folder, fd
        except OSError:
            pass
        # another run took it for debris between its creation and the lock: make another
        os.close(fd)


def remove_dead_stagings(parent: Path, name: str) -> list[Path]:
    """Remove the `.NAME.ckpt-tmp-XXXXXXXX` staging folders in `parent` that no
    process holds (`new_staging_folder`): those of a writer killed before it could clean up.
    Returns what was removed; best effort (a folder that cannot be read is left as it is)."""
    pattern = re.compile(re.escape(f".{name}{TMP_MARKER}") + _MKDTEMP_TAIL)
    removed: list[Path] = []
    try:
        entries = [e.name for e in os.scandir(parent) if pattern.fullmatch(e.name)]
    except OSError:
        return removed
    for entry in sorted(entries):
        path = parent / entry
        fd = _lock(path, wait=False)
        if fd is None:  # a live writer holds it (or it cannot be told): left alone
            continue
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):  # a file of that name is no staging folder
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
        finally:
            os.close(fd)
    return removed


def staging_held(path: Path) -> bool:
    """Whether a running process holds the staging folder `path` (`new_staging_folder`): it is
    being written now, however long ago its last byte was (a save stalled on a slow disk)."""
    fd, held = _take_lock(path, wait=False)
    if fd is not None:
        os.close(fd)  # the lock taken here goes with it
    return held
