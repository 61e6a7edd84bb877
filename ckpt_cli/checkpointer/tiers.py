"""Where `load_latest` finds a save: the local run folder first, then the object store.

Both tiers are judged by `ckpt_cli.sources.runs` (the judge `ckpt latest` uses): a save is a
candidate only when it is complete (`.metadata` present, every file whole; a staging folder
or a half-uploaded prefix never is); a damaged local save (a published `step-N` that is not
complete) is tried in its place, rebuilt from its parity or passed over with the reason. The newest candidate wins; on a tie the local copy is
taken (no transfer). A remote save newer than every local one is pulled into the run folder
first with `sync` (staged, checked against its checksum manifest, published with one rename).
Every candidate is verified before it is chosen (`ckpt verify`, with `--checksums` when it
carries a manifest or parity). A local save with parity that fails, or that lost a file (a
published `step-N` is whole when renamed into place, so a missing `.metadata` is damage, not an
interrupted save), is rebuilt from its parity first (`ckpt repair`) and checked again; one that
still fails is passed over, with the reason, for the next:
first the object store's copy of that very save when it holds one complete (pulled in place of
the damaged local copy), then the older saves of both tiers, newest first (once a save has
failed, the store is listed whole: its first listing judged only its newest save).
When saves are there but none can be loaded (each failed its checks, or the store holding them
could not be read or pulled from, with none on this machine), the choice is an error, never
"no save": a training script takes no save for a fresh start, which would silently discard
the run (and, with retention, later delete its saves in the store).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    CkptError,
    FormatError,
    HubError,
    IOFailure,
    MissingPrefixError,
    NoCheckpointError,
    NotFoundError,
)
from ..ops.verify.checksum_manifest import MANIFEST_NAME
from ..progress import NULL_PROGRESS, Progress
from ..sources.runs import RunCheckpoint, scan_run
from ..storage import PARITY_DIR
from .model import SAVE_FORMAT, Tier

#: the checksum algorithm of a manifest `load_latest` writes again (the Checkpointer's default)
DEFAULT_ALGO = "xxh3"
#: the name of a published save (`run_dir/step-N`; its staging folder is hidden until the rename)
STEP_SAVE = re.compile(r"step-\d+")


@dataclass
class Choice:
    """The save `load_latest` loads, and what it passed over."""

    path: str
    step: int
    tier: Tier
    verified: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)


def _resumable(checkpoints: list[RunCheckpoint]) -> list[RunCheckpoint]:
    """Complete DCP step saves, newest first (slimmed ones hold no optimizer state)."""
    done = [
        c
        for c in checkpoints
        if c.complete and not c.slim and c.step is not None and SAVE_FORMAT in c.formats
    ]
    return sorted(done, key=lambda c: c.order, reverse=True)


def _damaged(checkpoints: list[RunCheckpoint]) -> list[RunCheckpoint]:
    """Published step saves (`step-N`, never a staging folder) that are not complete: a save
    is renamed into place only once whole, so a lost `.metadata` or data file is damage (its
    parity, if any, may rebuild it), never a save still being written."""
    return [
        c
        for c in checkpoints
        if not c.complete
        and c.status != "interrupted"
        and c.step is not None
        and not c.slim
        and STEP_SAVE.fullmatch(c.name)
    ]


def _rewrite_manifest(
    save: RunCheckpoint, problem: str, algo: str, log: logging.Logger, progress: Progress
) -> tuple[list[str], str | None]:
    """Write the garbled checksum manifest of `save` again, once its parity found every file
    it covers intact (the manifest is the one file parity does not cover): the digests are
    taken of files the parity vouches for. (The manifest, None), or ([], why not); `progress`
    receives the hashing (under torchrun, rank 0's heartbeat to the waiting ranks)."""
    from ..ops.verify.run import verify

    try:
        report = verify(save.path, write_manifest=True, algo=algo, force=True, progress=progress)
    except (CkptError, OSError) as error:
        return [], f"{problem.rstrip('.')}; writing it again failed: {error}"
    if not report.manifest_written:
        first = next((p.message for p in report.problems if p.severity == "error"), "")
        return [], f"{problem.rstrip('.')}; it could not be written again: {first}"
    log.warning(
        "checkpoint %s failed its check (%s); its parity finds every data file intact: "
        "wrote %s again",
        save.path,
        problem,
        MANIFEST_NAME,
    )
    return [MANIFEST_NAME], None


def _repair(
    save: RunCheckpoint,
    problem: str,
    log: logging.Logger,
    progress: Progress,
    algo: str = DEFAULT_ALGO,
) -> tuple[list[str], str | None]:
    """Rebuild the damaged files of the local save `save` (whose check found `problem`) from
    its parity, as `ckpt repair` does: (the files rebuilt, None), or ([], why it could not).
    A garbled checksum manifest (which parity does not cover) is written again in `algo` once
    the parity finds every file it covers intact."""
    from ..ops.parity import repair

    try:
        report = repair(save.path, progress=progress)
    except (CkptError, OSError) as error:
        said = error.problem if isinstance(error, CkptError) else str(error)
        if said in problem:  # (the parity's own manifest is what is damaged: said once)
            return [], f"{problem.rstrip('.')}; so its parity cannot rebuild it"
        return [], f"{problem.rstrip('.')}; its parity could not rebuild it: {error}"
    if not report.ok:
        if not report.unrecoverable:
            # every file intact, but the garbled checksum manifest beside files the parity
            # has no record of: it could not be written again (the report says why)
            return [], f"{problem.rstrip('.')}; {report.warnings[-1]}"
        lost = ", ".join(Path(name).name for name in report.unrecoverable)
        return (
            [],
            f"{problem.rstrip('.')}; the damage is beyond its parity ({lost} cannot be rebuilt)",
        )
    folder = Path(save.path)
    rebuilt = [
        Path(name).relative_to(folder).as_posix() if Path(name).is_relative_to(folder) else name
        for name in report.rebuilt
    ]
    if rebuilt:
        log.warning(
            "checkpoint %s failed its check (%s): rebuilt %s from its parity",
            save.path,
            problem,
            ", ".join(rebuilt),
        )
    if report.rewritten:
        # repair wrote the garbled manifest again from the parity's sha256 digests; the run's
        # saves record `algo`'s, and are written so again (the files are whole: hashed now)
        if algo == "sha256":
            log.warning(
                "checkpoint %s failed its check (%s); its parity finds every data file "
                "intact: wrote %s again",
                save.path,
                problem,
                MANIFEST_NAME,
            )
            written: list[str] = [MANIFEST_NAME]
            why = None
        else:
            written, why = _rewrite_manifest(save, problem, algo, log, progress)
        if why is not None and not rebuilt:
            return [], why
        rebuilt += written
    if not rebuilt:
        return [], (
            f"{problem.rstrip('.')}; its parity finds every file it covers intact (the damage "
            "is in one it does not cover)"
        )
    return rebuilt, None


def check(
    path: str, checks: str, progress: Progress = NULL_PROGRESS
) -> tuple[list[str], str | None]:
    """Verify one local save: (the checks that ran, the first problem or None); `progress`
    receives the checksum pass's."""
    from ..ops.verify.run import verify

    if checks == "none":
        return [], None
    folder = Path(path)
    digests = (folder / MANIFEST_NAME).is_file() or (folder / PARITY_DIR).is_dir()
    with_sums = checks == "checksums" and digests
    try:
        report = verify(path, checksums=with_sums, progress=progress)
    except (FormatError, IOFailure) as error:
        # a file verify reads before it judges (the checksum or parity manifest) is garbled,
        # or cannot be read: the save is damaged, as with any problem it reports
        return [], _located(str(error.path or path), error.problem)
    if report.ok:
        return report.checks, None
    first = next(p for p in report.problems if p.severity == "error")
    return report.checks, _located(first.file or path, first.message)


def _located(where: str, message: str) -> str:
    """`message` under the file or folder it is about (most messages name it already)."""
    return message if message.startswith(where) else f"{where}: {message}"


class _Vanished(Exception):
    """The local save being judged was removed meanwhile (another process's retention)."""


#: how many times the run folder is read again when the save being judged vanishes
RESCANS = 3


def choose(
    run_dir: Path,
    upload: str | None,
    checks: str,
    log: logging.Logger,
    progress: Progress = NULL_PROGRESS,
    in_store: Callable[[], AbstractContextManager[None]] = nullcontext,
    algo: str = DEFAULT_ALGO,
) -> Choice | None:
    """The newest complete, verified save over both tiers (see the module), or None;
    `progress` receives the checks' checksum passes, and the listing of the object store and
    the pull from it run inside `in_store()` (under torchrun, rank 0's heartbeat on a clock:
    the store's requests report no progress); `algo`: the algorithm of a garbled checksum
    manifest written again (`_repair`).

    A local save removed while it is judged (the retention of the process training this run,
    once it published a newer save) is no damage: the run folder is read again, and the newer
    save judged in its place."""
    for _ in range(RESCANS):
        try:
            return _choose(run_dir, upload, checks, log, progress, in_store, algo)
        except _Vanished as gone:
            log.info(
                "%s was removed while load_latest checked it (the retention of the process "
                "training this run?): reading %s again",
                gone,
                run_dir,
            )
    raise IOFailure(
        f"the run's newest saves were removed while load_latest checked them, {RESCANS} times",
        path=str(run_dir),
        fix="Another process deletes this run's saves as fast as they are checked (a "
        "Checkpointer's keep_last retention): load a copy of the save (`ckpt latest RUN` names "
        "it), or call load_latest while that process publishes no save.",
    )


def _judge_local(
    save: RunCheckpoint,
    checks: str,
    log: logging.Logger,
    progress: Progress,
    algo: str = DEFAULT_ALGO,
) -> tuple[list[str], str | None, list[str]]:
    """Check the local save `save` (rebuilding it from its parity if it is damaged and has
    one): (the checks that ran, the problem left or None, the files rebuilt). Raises
    `_Vanished` when the save was removed meanwhile."""
    folder = Path(save.path)
    repaired: list[str] = []
    try:
        if save.complete:
            ran, problem = check(save.path, checks, progress)
        else:
            ran, problem = [], _located(save.path, save.reason or "incomplete")
        if problem is not None and (folder / PARITY_DIR).is_dir():
            repaired, unrepaired = _repair(save, problem, log, progress, algo)
            if unrepaired is None:
                # the repair checked each rebuilt file against the parity's sha256; the save
                # is checked again as a whole (the structure a lost marker hid, the manifest)
                ran, problem = check(save.path, checks, progress)
            else:
                problem = unrepaired
    except NotFoundError:
        if folder.exists():
            raise
        raise _Vanished(save.path) from None
    if problem is not None and not folder.exists():
        raise _Vanished(save.path)
    return ran, problem, repaired


def _choose(
    run_dir: Path,
    upload: str | None,
    checks: str,
    log: logging.Logger,
    progress: Progress,
    in_store: Callable[[], AbstractContextManager[None]],
    algo: str = DEFAULT_ALGO,
) -> Choice | None:
    """One reading of the run folder for `choose`."""
    skipped: list[str] = []
    unread: list[str] = []
    scanned = scan_run(run_dir, settle=0.0).checkpoints if run_dir.is_dir() else []
    local = _resumable(scanned)
    newest_local = local[0].step if local else None
    # damaged saves are tried in step order with the complete ones (rebuilt from their parity
    # if they have one, else passed over with the reason: never silently, and never taken for
    # "no save"); a store's copy newer than every complete local save is still pulled first
    local = sorted(local + _damaged(scanned), key=lambda c: c.order, reverse=True)
    remote: list[RunCheckpoint] = []
    #: the store's saves already pulled (or tried)
    tried: set[str] = set()

    def pull(saves: list[RunCheckpoint], why: str) -> Choice | None:
        """The first of the store's `saves` not tried yet that pulls and passes its check."""
        for save in saves:
            if save.name in tried or upload is None:
                continue
            tried.add(save.name)
            log.info("pulling %s from %s (%s)", save.name, upload, why)
            replace = (run_dir / save.name).exists()
            pulled = _pull(
                run_dir, upload, save, checks, skipped, unread, log, progress, in_store, replace
            )
            if pulled is not None:
                return pulled
        return None

    if upload is not None:
        remote = _remote_saves(upload, unread, log, in_store)
        best = remote[0] if remote else None
        if best is not None and (newest_local is None or (best.step or 0) > newest_local):
            pulled = pull([best], "newer than every local save")
            if pulled is not None:
                return pulled
    every_remote: list[RunCheckpoint] | None = None
    for c in local:
        assert c.step is not None
        if skipped and upload is not None and not unread:
            # a newer save failed: the store's saves between it and this one come first (the
            # listing above judged only the store's newest)
            if every_remote is None:
                every_remote = _remote_saves(upload, unread, log, in_store, every=True)
            newer = [r for r in every_remote if (r.step or 0) > c.step]
            if (pulled := pull(newer, "newer than every local save that passes")) is not None:
                return pulled
        ran, problem, repaired = _judge_local(c, checks, log, progress, algo)
        if problem is None:
            return Choice(
                path=c.path,
                step=c.step,
                tier="local",
                verified=ran,
                skipped=skipped,
                repaired=repaired,
            )
        log.warning("checkpoint %s failed verification, passed over: %s", c.path, problem)
        skipped.append(f"{c.name}: {problem}")
        # the store's copy of this very save, whole, is worth more than an older local one
        twin = [r for r in every_remote or remote if r.name == c.name]
        if (pulled := pull(twin, "in place of the damaged local copy")) is not None:
            return pulled
    if skipped and upload is not None and not unread:
        # every local save failed: the store's older saves before giving up
        if every_remote is None:
            every_remote = _remote_saves(upload, unread, log, in_store, every=True)
        if (pulled := pull(every_remote, "every local save failed its check")) is not None:
            return pulled
    if skipped:
        raise FormatError(
            f"no save of the run can be loaded: every one failed its checks ({'; '.join(skipped)})"
            + (f"; and {'; '.join(unread)}" if unread else ""),
            path=str(run_dir),
            fix="`ckpt verify` of each save says what is wrong (a save written with protect= "
            "was given to `ckpt repair` already: its damage is beyond its parity). To start "
            "the run over on purpose, move its saves out of the run folder (and the bucket).",
        )
    if unread:
        raise HubError(
            f"no save is on this machine and the object store could not be read: "
            f"{'; '.join(unread)}",
            path=upload,
            fix="Run again once the store answers: a fresh start now would train over the "
            "run's saves there.",
        )
    return None


def _remote_saves(
    upload: str,
    unread: list[str],
    log: logging.Logger,
    in_store: Callable[[], AbstractContextManager[None]] = nullcontext,
    *,
    every: bool = False,
) -> list[RunCheckpoint]:
    """The object store's complete saves, newest first: its newest only, unless `every`
    ([] when it cannot be read: the failure goes to `unread`). The listing runs inside
    `in_store()`."""
    try:
        url = upload.rstrip("/")
        with in_store():
            newest = scan_run(url, settle=0.0, until_latest=not every).checkpoints
            remote = _resumable(newest)
            if not remote and any(c.complete for c in newest):
                # the newest complete folder is no save to resume from (an export the upload
                # sent with the run folder): judge them all
                remote = _resumable(scan_run(url, settle=0.0).checkpoints)
    except (MissingPrefixError, NoCheckpointError):
        # read, and empty: a new run's prefix before its first upload holds no save (a bucket
        # that does not exist is no such answer: the uploads could not go there either)
        return []
    except CkptError as error:
        log.warning("object store %s not read, loading from the local tier: %s", upload, error)
        unread.append(str(error))
        return []
    return remote


def _pull(
    run_dir: Path,
    upload: str,
    save: RunCheckpoint,
    checks: str,
    skipped: list[str],
    unread: list[str],
    log: logging.Logger,
    progress: Progress = NULL_PROGRESS,
    in_store: Callable[[], AbstractContextManager[None]] = nullcontext,
    replace_local: bool = False,
) -> Choice | None:
    """Pull the remote save `save` into the run folder (with `replace_local`, in place of the
    local copy of that name, which failed its check) and check it. What could not be read or
    fetched (the store's failures) goes to `unread`; a save that fails its checks, to
    `skipped`. The pull runs inside `in_store()`."""
    from ..ops.sync.pull import sync_down

    assert save.step is not None
    try:
        # that save, not the bucket's newest folder (the upload sends the run folder whole:
        # the user's exports are there too)
        with in_store():
            report = sync_down(
                upload.rstrip("/"),
                str(run_dir),
                only=save.name,
                settle=0.0,
                replace_local=replace_local,
            )
    except CkptError as error:
        log.warning("pulling %s failed: %s", save.name, error)
        # the store's failure says nothing of the save; a refused copy does
        (unread if isinstance(error, HubError) else skipped).append(
            f"{save.name} (remote): {error}"
        )
        return None
    if report.failed:
        skipped.append(f"{save.name} (remote): {report.failed[0]}")
        log.warning("pulling %s failed: %s", save.name, report.failed[0])
        return None
    path = run_dir / save.name
    ran, problem = check(str(path), checks, progress)
    if problem is not None:
        skipped.append(f"{save.name} (remote): {problem}")
        log.warning("pulled %s failed verification, passed over: %s", path, problem)
        return None
    return Choice(path=str(path), step=save.step, tier="remote", verified=ran, skipped=skipped)
