"""Atomic outputs: write into a hidden temporary sibling, publish with one rename.

A crash, a SIGKILL or Ctrl-C mid-write leaves at most a `.<name>.ckpt-tmp-*` sibling (which
`ckpt prune --incomplete` and `ckpt latest` treat as an interrupted save), never a DEST that
looks complete. An existing DEST is refused unless `force` is given; then it is replaced only
after the new output is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DestinationExistsError, Interrupted, UsageError

TMP_MARKER = ".ckpt-tmp-"


def check_destination(dest: Path, force: bool) -> None:
    """Refuse an existing destination without --force, before any work is done."""
    if (dest.exists() or dest.is_symlink()) and not force:
        raise DestinationExistsError(
            "already exists",
            path=dest,
            fix="Choose another destination or pass --force to replace it.",
        )
    if not dest.parent.exists():
        raise UsageError(
            "the parent folder does not exist", path=dest.parent, fix="Create it first."
        )


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
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


@contextmanager
def staged_output(dest: Path, *, force: bool = False, single_file: bool = False) -> Iterator[Path]:
    """Yield a fresh staging folder beside `dest`; on success publish it as `dest`.

    With `single_file`, the staging folder must hold exactly one file, which becomes `dest`.
    On any exception (KeyboardInterrupt included) the staging folder is removed and `dest` is
    left as it was.
    """
    dest = dest.absolute()
    check_destination(dest, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}{TMP_MARKER}", dir=dest.parent))
    try:
        yield staging
        if single_file:
            produced = [p for p in staging.iterdir()]
            if len(produced) != 1:
                raise RuntimeError(f"expected one output file, the writer produced {len(produced)}")
            source: Path = produced[0]
        else:
            fsync_dir(staging)
            source = staging
        _publish(source, dest, force)
        fsync_dir(dest.parent)
    except KeyboardInterrupt:
        shutil.rmtree(staging, ignore_errors=True)
        raise Interrupted("interrupted; the partial output was removed", path=dest) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    else:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _publish(source: Path, dest: Path, force: bool) -> None:
    if not (dest.exists() or dest.is_symlink()):
        os.rename(source, dest)
        return
    if not force:
        raise DestinationExistsError(
            "appeared while writing", path=dest, fix="Pass --force to replace it."
        )
    # move the old one aside first so there is never a moment without a complete dest
    old = dest.with_name(f".{dest.name}{TMP_MARKER}old-{os.getpid()}")
    os.rename(dest, old)
    try:
        os.rename(source, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
