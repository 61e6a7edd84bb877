"""Checksums for `verify`: the `ckpt-manifest.json` manifest (written, read, checked) and
the Hub's own digests (LFS sha256, git blob ids) for local copies of Hub files.

Files are hashed in parallel threads (`hashing.hash_files`); under torchrun each rank hashes a
byte-balanced share (`_hash_split`). Where the files live decides nothing by class: a storage
that `hashes_in_place` is hashed through its own reads, one with a `local_root` by path, and
one whose server records digests (`server_digests()`) is compared with them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import __version__
from ...budgets import MAX_JSON_RECORD
from ...dist.command import CombinedProgress, RankShare, active
from ...errors import (
    CkptError,
    DestinationExistsError,
    UsageError,
)
from ...formats import resolve_source
from ...formats.base import Source
from ...formats.names import is_index_file
from ...formats.weight_map import MAX_INDEX_BYTES
from ...models import Problem
from ...progress import Progress
from ...storage import (
    LocalStorage,
    RemoteFile,
    Storage,
    file_version,
    hf_cache_repo,
)
from ...storage.hashing import Hashable, StoredFile, hash_files
from ...storage.output import (
    Destination,
    check_destination,
    destination_exists,
    local_destination,
    read_destination,
    remote_key,
)
from ...storage.uri import canonical_remote, is_hub_url
from .checksum_manifest import (
    MANIFEST_NAME,
    ChecksumManifest,
    FileDigest,
    local_root,
    manifest_exists,
    manifest_location,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from .report import VerifyReport

#: the fix of a file that no longer matches its manifest record
_RESTORE_FIX = (
    "Restore it from a good copy (`ckpt repair` rebuilds it where the checkpoint was "
    "protected); if the change was meant, write the manifest again (`--write-manifest --force`)."
)
#: the fix of a file the manifest does not record
_UNLISTED_FIX = (
    "If it belongs to the checkpoint, write the manifest again (`--write-manifest --force`); "
    "otherwise move it out of the folder."
)


# ---------------------------------------------------------------- checksums and the manifest


def _refuse_manifest_over_checkpoint(
    source: Source, path: Destination, *, own_place: bool = False
) -> None:
    """Refuse to write the manifest over a file of the checkpoint, whatever the flags.

    The manifest may replace (`--force`) only a manifest: a path that is one of the
    checkpoint's files, or any existing file that is not a ckpt manifest, is refused, on a
    local disk and in an object store alike. `own_place`: `path` is the checkpoint's own
    `ckpt-manifest.json` (no `--manifest` given), which is the manifest by its name even when
    garbled (no checkpoint file, never hashed nor covered by parity), so it is replaced: its
    read error names this very command as the fix.
    """
    root = source.storage.local_root
    local = local_destination(path)
    key = remote_key(path)
    if local is not None and root is not None:
        target = _file_id(local)
        if target is not None:  # a path that names nothing is no file of the checkpoint
            listed = set(source.storage.list_files()) | set(source.files)
            if source.target is not None:
                # a single shard's siblings (the rest of its checkpoint) count too
                listed |= set(LocalStorage(root).list_files())
            for name in sorted(listed):
                if name != MANIFEST_NAME and _same_file(root / name, local, target):
                    _refuse_checkpoint_file(path, root / MANIFEST_NAME)
    elif key is not None and root is None and source.storage.writable:
        # the same object store: an object's key, spelt the one way the store reads it (its
        # listing holds the siblings of a single object too)
        storage = source.storage
        wanted = canonical_remote(key)
        for name in sorted(set(storage.list_files()) | set(source.files)):
            there = remote_key(storage.destination(name))
            if name != MANIFEST_NAME and there is not None and canonical_remote(there) == wanted:
                _refuse_checkpoint_file(path, storage.destination(MANIFEST_NAME))
    if own_place and not (local is not None and local.is_symlink()):
        return
    if destination_exists(path) or (local is not None and local.is_symlink()):
        try:
            ChecksumManifest.model_validate(json.loads(read_destination(path, MAX_JSON_RECORD)))
        except (CkptError, OSError, UnicodeDecodeError, ValueError, RecursionError):
            raise UsageError(
                "exists and is not a ckpt checksum manifest; --force replaces only a manifest",
                path=str(path),
                fix="Name another --manifest path, or move that file away yourself.",
            ) from None


def _refuse_checkpoint_file(path: Destination, default: Destination) -> None:
    raise UsageError(
        "is a file of the checkpoint; writing the manifest there would destroy it",
        path=str(path),
        fix=f"Name another --manifest path (the default is {default}).",
    )


def checksum_checks(
    report: VerifyReport,
    problems: list[Problem],
    source: Source,
    *,
    write: bool,
    manifest: str | None,
    algo: str | None,
    force: bool,
    progress: Progress,
    outside: Collection[str] = (),
) -> None:
    """`verify --checksums` / `--write-manifest`: check the files against their manifest (or
    the Hub's digests), or record them in a new manifest; problems go into `problems`.
    `outside`: files linked out of the checkpoint (reported already): never hashed, and no
    part of what is compared or recorded."""
    if not write and source.storage.server_digests() is not None:
        if _hub_cache_checksums(report, problems, source, progress):
            report.checks.append("checksums")
        return
    if not source.storage.hashes_in_place:
        raise UsageError(
            "--checksums and --write-manifest need a local or object-store checkpoint",
            path=source.location.raw,
            fix="Download it first (`ckpt download`), then check the copy against the Hub with "
            "`ckpt verify DEST --checksums --manifest hf://org/repo@revision`.",
        )
    if source.storage.local_root is None:
        # hub-digest checks need a local copy; object stores are hashed in place
        _refuse_hub_manifest(manifest, source)
    if not write and manifest is not None and is_hub_url(manifest):
        report.checks.append("checksums")
        _local_against_hub(report, problems, source, manifest, progress, outside)
        return
    if not write and manifest is None:
        cache = _cache_snapshot(source)
        if cache is not None and not manifest_exists(manifest_location(source, None)):
            report.checks.append("checksums")
            _cache_against_addresses(report, problems, source, cache, progress, outside)
            return
    path = manifest_location(source, manifest)
    report.manifest = str(path)
    storage = source.storage
    files = _files_to_hash(source, path, outside)
    if write:
        report.checks.append("write-manifest")
        algorithm = algo or "sha256"
        _refuse_manifest_over_checkpoint(source, path, own_place=manifest is None)
        if not force:
            try:
                check_destination(path, force=False)
            except DestinationExistsError:
                raise DestinationExistsError(
                    "already exists",
                    path=str(path),
                    fix="Check against it with --checksums, or pass --force to replace it.",
                ) from None
            except UsageError:
                pass  # a missing parent folder is reported when the manifest is written
        report.algorithm = algorithm
        if any(p.severity == "error" for p in problems):
            problems.append(
                Problem(
                    code="manifest_not_written",
                    message=f"{path}: not written, because the checkpoint has the problems "
                    "above; a manifest must not bless a broken checkpoint",
                    file=str(path),
                    fix="Fix the problems above (restore the files they name), then run "
                    f"`ckpt verify {source.location.raw} --write-manifest` again.",
                )
            )
            return
        # a file another job rewrites while it is hashed would be recorded as no version of it
        local = {n: p for n, p in files.items() if isinstance(p, Path)}
        versions = {n: file_version(p) for n, p in local.items()}
        digests = _hash_split(files, algorithm, progress, report)
        sizes = files_size(files)
        changed = [n for n, p in local.items() if file_version(p) != versions[n]]
        if changed:
            problems.append(
                Problem(
                    code="manifest_not_written",
                    message=f"{path}: not written, because {storage.describe(changed[0])}"
                    + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                    + " changed while it was hashed (another process rewrote or replaced it): "
                    "a manifest must record the files as they are",
                    file=str(path),
                    fix="Run the command again once the job writing the checkpoint has finished.",
                )
            )
            return
        report.hashed_bytes = sum(sizes.values())
        record = ChecksumManifest(
            algorithm=algorithm,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            tool=f"ckpt {__version__}",
            format=report.format,
            files={n: FileDigest(size=sizes[n], digest=digests[n]) for n in sorted(files)},
        )
        workers = active()
        # rank 0 alone writes; a failure there fails every rank of a torchrun launch
        with workers.together():
            if workers.leader:
                write_manifest(path, record, force)
        report.manifest_written = True
        return
    report.checks.append("checksums")
    recorded = read_manifest(path)
    if algo is not None and algo != recorded.algorithm:
        raise UsageError(
            f"--algo {algo} asked, but the manifest records {recorded.algorithm} digests",
            path=str(path),
            fix="Drop --algo (checks use the manifest's algorithm) or write a new manifest.",
        )
    report.algorithm = recorded.algorithm
    expected = recorded.files
    if source.target is not None:
        # SRC named one file: check that file against its record, whatever else is recorded
        expected = {n: d for n, d in expected.items() if n == source.target}
        if not expected:
            problems.append(
                Problem(
                    code="unlisted_file",
                    message=f"{storage.describe(source.target)}: is not in the manifest {path}",
                    file=storage.describe(source.target),
                    fix=_UNLISTED_FIX,
                )
            )
            return
    sizes = files_size(files)
    to_hash: dict[str, Hashable] = {}
    for name, want in expected.items():
        if name in outside:
            continue  # reported as a link out of the checkpoint
        if name not in files:
            problems.append(
                Problem(
                    code="missing_file",
                    message=f"{storage.describe(name)}: is missing (the manifest records "
                    f"{want.size} bytes)",
                    file=storage.describe(name),
                    fix=_RESTORE_FIX,
                )
            )
        elif sizes[name] != want.size:
            problems.append(
                Problem(
                    code="size_changed",
                    message=f"{storage.describe(name)}: is {sizes[name]} bytes, the manifest records "
                    f"{want.size} (truncated or rewritten since the manifest was written)",
                    file=storage.describe(name),
                    fix=_RESTORE_FIX,
                )
            )
        else:
            to_hash[name] = files[name]
    for name in sorted(set(files) - set(expected)):
        problems.append(
            Problem(
                code="unlisted_file",
                message=f"{storage.describe(name)}: is not in the manifest {path} (added after "
                f"it was written)",
                file=storage.describe(name),
                severity="warning",
                fix=_UNLISTED_FIX,
            )
        )
    digests = _hash_split(to_hash, recorded.algorithm, progress, report)
    report.hashed_bytes = sum(sizes[n] for n in to_hash)
    for name, digest in digests.items():
        if digest != recorded.files[name].digest:
            problems.append(
                Problem(
                    code="checksum_mismatch",
                    message=f"{storage.describe(name)}: {recorded.algorithm} digest {digest[:16]}… differs "
                    f"from the manifest's {recorded.files[name].digest[:16]}… (the content changed "
                    f"or is corrupt)",
                    file=storage.describe(name),
                    fix=_RESTORE_FIX,
                )
            )


def _files_to_hash(
    source: Source, manifest: Destination, outside: Collection[str]
) -> dict[str, Hashable]:
    """The checkpoint's files (name -> local path or stored file), the manifest and the files
    linked `outside` it excluded."""
    storage = source.storage
    out: dict[str, Hashable] = {}
    root = storage.local_root
    if root is not None:
        local = local_destination(manifest)
        skip = _file_id(local) if local is not None else None
        for name in source.files:
            if name in outside:
                continue
            path = root / name
            if skip is None or local is None or not _same_file(path, local, skip):
                out[name] = path
        return out
    skip_name = remote_key(manifest)
    for name, size in source.files.items():
        remote = storage.fs_path(name)
        if remote is None or remote[1] != skip_name:
            out[name] = StoredFile(storage, name, size)
    return out


def _file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file `path` names, links followed; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _same_file(path: Path, other: Path, other_id: tuple[int, int]) -> bool:
    """Whether `path` resolves to `other` (whose `_file_id` is `other_id`). One stat per file:
    the path walk of `resolve` (2,000 shards: 2 x 40 ms) only where the inodes already agree."""
    return _file_id(path) == other_id and path.resolve() == other.resolve()


def files_size(files: Mapping[str, Hashable]) -> dict[str, int]:
    """Current sizes of the files (0 for ones that vanished)."""
    sizes = {}
    for name, path in files.items():
        if isinstance(path, StoredFile):
            sizes[name] = path.size
            continue
        try:
            sizes[name] = path.stat().st_size
        except OSError:
            sizes[name] = 0
    return sizes


def _hash(files: Mapping[str, Hashable], algo: str, progress: Progress) -> dict[str, str]:
    total = sum(files_size(files).values())
    progress.start(total, f"hashing ({algo})")
    try:
        return hash_files(files, algo, progress=progress)
    finally:
        progress.finish()


def _refuse_hub_manifest(manifest: str | None, source: Source) -> None:
    if manifest is not None and is_hub_url(manifest):
        raise UsageError(
            "--manifest hf://… checks a local copy against the Hub's digests",
            path=source.location.raw,
            fix="Check the Hub repository against a manifest file instead.",
        )


# ---------------------------------------------------------------- against the Hub's digests


def _hub_cache_checksums(
    report: VerifyReport, problems: list[Problem], source: Source, progress: Progress
) -> bool:
    """`verify hf://… --checksums`: the files in the local HF cache against the Hub's digests;
    whether anything was checked.

    Offline (`HF_HUB_OFFLINE=1`) the listing comes from the cache and carries no digests:
    each cached file is then checked against the name of the blob it links to, its content
    address (the LFS sha256, or the git blob id), as `verify SNAPSHOT --checksums` does. A
    file with neither is reported as not checked, never counted as checked."""
    storage = source.storage
    digests = storage.server_digests()
    assert digests is not None, "called for a storage whose server records digests"
    remote = dict(digests)
    names = [source.target] if source.target is not None else sorted(remote)
    local: dict[str, Path] = {}
    for name in names:
        path = storage.local_path(name)
        if path is not None:
            local[name] = path
    report.manifest = storage.display
    if not local:
        problems.append(
            Problem(
                code="no_local_copy",
                message=f"{storage.display}: no file of this commit is in the local HF "
                "cache, so there is nothing to check against the Hub's digests",
                file=storage.display,
                severity="warning",
                fix=f"Download it into the cache first (`ckpt download {source.location.raw} "
                "--cache-only`), then check again.",
            )
        )
        return False
    # a commit partly in the cache (a `download --filter`): what is not there is not checked,
    # and the verdict says so file by file rather than passing it over (a hidden file, such
    # as `.gitattributes`, is no part of a checkpoint and no download fetches it)
    for name in names:
        if name not in local and not name.rsplit("/", 1)[-1].startswith("."):
            problems.append(
                Problem(
                    code="missing_file",
                    message=f"{storage.describe(name)}: not in the local HF cache, so its "
                    "checksum was not checked",
                    file=storage.describe(name),
                    severity="warning",
                    fix=f"Download it into the cache first (`ckpt download "
                    f"{source.location.raw} --cache-only`, or `hf download`), then check again.",
                )
            )
    recorded = {n: p for n, p in local.items() if remote[n].sha256 or remote[n].blob_id}
    addressed: dict[str, Path] = {}
    addresses: dict[str, RemoteFile] = {}
    for name, path in local.items():
        if name in recorded:
            continue
        address = Path(os.path.realpath(path)).name
        if not (_SHA256_NAME.match(address) or _GIT_NAME.match(address)):
            problems.append(
                Problem(
                    code="no_content_address",
                    message=f"{storage.describe(name)}: no digest to check it against (the "
                    "listing is the offline cache's, and its cached file is not named by its "
                    "content); its checksum was not checked",
                    file=storage.describe(name),
                    severity="warning",
                    fix="Run the check again online (without HF_HUB_OFFLINE=1): the Hub's "
                    "listing carries the digests.",
                )
            )
            continue
        addressed[name] = path
        sha = address if len(address) == 64 else None
        addresses[name] = RemoteFile(
            path=name, size=remote[name].size, sha256=sha, blob_id=None if sha else address
        )
    if recorded:
        _compare_with_hub(
            report,
            problems,
            recorded,
            {n: remote[n] for n in recorded},
            storage.describe,
            progress,
            fix=_refetch_fix(source.location.raw),
        )
    if addressed:
        _compare_with_hub(
            report,
            problems,
            addressed,
            addresses,
            storage.describe,
            progress,
            against="its blob's name (its content address in the HF cache; offline, the Hub's "
            "digests are not fetched)",
            fix=_refetch_fix(source.location.raw),
        )
    return bool(recorded or addressed)


def _cache_snapshot(source: Source) -> Path | None:
    """The HF cache repository folder (`models--org--name/`) when SRC is a snapshot folder of
    it (or a file in one), else None."""
    root = source.storage.local_root
    if root is None:
        return None
    repo = hf_cache_repo(os.path.realpath(root))
    return Path(repo) if repo is not None else None


#: the names huggingface_hub gives blobs: the LFS sha256, or the git blob id of a regular file
_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
_GIT_NAME = re.compile(r"^[0-9a-f]{40}$")


def _cache_against_addresses(
    report: VerifyReport,
    problems: list[Problem],
    source: Source,
    cache: Path,
    progress: Progress,
    outside: Collection[str],
) -> None:
    """`verify SNAPSHOT --checksums`: an HF cache is content-addressed, so each snapshot file
    is checked against the name of the blob it links to (`blobs/<sha256>` for LFS files,
    `blobs/<git blob id>` for regular ones), as `hf cache verify` checks them against the
    Hub, offline. A file that is not a link into `blobs/` has no address to check."""
    root = local_root(source)
    blobs = cache / "blobs"
    names = [source.target] if source.target is not None else sorted(source.files)
    names = [n for n in names if n not in outside]
    local: dict[str, Path] = {}
    addresses: dict[str, RemoteFile] = {}
    sizes = files_size({n: root / n for n in names})
    for name in names:
        path = root / name
        blob = Path(os.path.realpath(path))
        address = blob.name
        if blob.parent != blobs or not (_SHA256_NAME.match(address) or _GIT_NAME.match(address)):
            problems.append(
                Problem(
                    code="no_content_address",
                    message=f"{path}: is not a link into the cache's blobs/ folder, so it has "
                    "no content address to check (copied into the snapshot by hand?)",
                    file=str(path),
                    severity="warning",
                    fix="Check the snapshot against the Hub's digests instead (`ckpt verify "
                    f"{source.location.raw} --checksums --manifest hf://ORG/REPO@REVISION`), or "
                    "download the file again (`hf download`) so the cache holds it by address.",
                )
            )
            continue
        local[name] = path
        sha = address if len(address) == 64 else None
        addresses[name] = RemoteFile(
            path=name, size=sizes[name], sha256=sha, blob_id=None if sha else address
        )
    report.manifest = f"{blobs} (content addresses)"
    _compare_with_hub(
        report,
        problems,
        local,
        addresses,
        lambda n: str(root / n),
        progress,
        against="its blob's name (its content address in the HF cache)",
        fix=_refetch_fix("hf://ORG/REPO@REVISION"),
    )


def _local_against_hub(
    report: VerifyReport,
    problems: list[Problem],
    source: Source,
    hub: str,
    progress: Progress,
    outside: Collection[str],
) -> None:
    """`verify DIR --checksums --manifest hf://…`: a downloaded copy against the Hub's digests."""
    hub_side = resolve_source(hub)
    storage = hub_side.storage
    digests = storage.server_digests()
    assert digests is not None, "an hf:// location opens a Hub storage, which records digests"
    report.manifest = storage.display
    root = local_root(source)
    local = {
        name: root / name
        for name in source.files
        # huggingface_hub keeps its download bookkeeping there; ckpt its manifest
        if not name.startswith(".cache/huggingface/")
        and name != MANIFEST_NAME
        and name not in outside
    }
    remote = dict(digests)
    if source.target is not None:
        remote = {n: f for n, f in remote.items() if n == source.target}
    for name in sorted(set(remote) - set(local)):
        problems.append(
            Problem(
                code="missing_file",
                message=f"{root / name}: is not in the local copy ({storage.describe(name)} has "
                f"{remote[name].size} bytes)",
                file=str(root / name),
                severity="warning",
                fix=f"If the copy should hold it, download it again from {hub} (`ckpt download "
                f"{hub} NEW_DIR`); a copy made with `--filter` or `--include` leaves files out "
                "on purpose.",
            )
        )
    for name in sorted(set(local) - set(remote)):
        problems.append(
            Problem(
                code="unlisted_file",
                message=f"{root / name}: is not in {storage.display}",
                file=str(root / name),
                severity="warning",
                fix=f"Move it out of the folder if it is not part of {hub}; if it is, check "
                "that --manifest names the revision the copy was downloaded from.",
            )
        )
    both = {n: local[n] for n in sorted(set(local) & set(remote))}
    for name in [n for n in both if is_index_file(n)]:
        note = _rewritten_index(both[name], storage, name, remote[name].size, set(local))
        if note is not None:
            del both[name]
            problems.append(
                Problem(
                    code="rewritten_index",
                    message=f"{root / name}: {note}",
                    file=str(root / name),
                    severity="warning",
                    fix="Nothing to do for a copy `ckpt download --filter` made: the shards it "
                    "names are checked against the Hub's digests.",
                )
            )
    _compare_with_hub(
        report,
        problems,
        both,
        remote,
        lambda n: str(root / n),
        progress,
        fix=f"Download the file again from {hub} into a new folder (`ckpt download {hub} "
        "NEW_DIR`) and use that copy.",
    )


def _rewritten_index(
    path: Path, storage: Storage, name: str, hub_size: int, local: set[str]
) -> str | None:
    """What a local shard index that differs from the Hub's is, when it is the subset `ckpt
    download --filter` writes: every tensor it names in the shard the Hub's index names, every
    such shard here. None otherwise (it is then compared byte for byte, and fails)."""
    if path.stat().st_size == hub_size:
        return None  # the same size: compared by digest like any file
    if max(path.stat().st_size, hub_size) > MAX_INDEX_BYTES:
        return None  # past what ckpt reads of an index: compared by digest, and fails
    try:
        mine = json.loads(path.read_bytes())["weight_map"]
        theirs = json.loads(storage.read_all(name))["weight_map"]
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if not isinstance(mine, dict) or not isinstance(theirs, dict) or not mine:
        return None
    if any(theirs.get(tensor) != shard or shard not in local for tensor, shard in mine.items()):
        return None
    shards = len(set(mine.values()))
    return (
        f"is not the Hub's index but a subset of it (`ckpt download --filter` writes one): "
        f"{len(mine)} of its {len(theirs)} tensors, each in the shard the Hub's index names; "
        f"{shards} shard(s) here"
    )


def _compare_with_hub(
    report: VerifyReport,
    problems: list[Problem],
    local: dict[str, Path],
    remote: dict[str, Any],
    describe: Any,
    progress: Progress,
    against: str = "the Hub's",
    *,
    fix: str,
) -> None:
    """Sizes, then the Hub's own digests: LFS sha256 (hashed in parallel), git blob sha1
    (`against` names where the expected digests come from, for the messages; `fix` is what
    a file that differs needs)."""
    from ...storage.hub import file_digest

    report.algorithm = "sha256 (LFS) / git-sha1"
    sizes = files_size(local)
    lfs: dict[str, Path] = {}
    for name, path in local.items():
        want = remote[name]
        if sizes[name] != want.size:
            problems.append(
                Problem(
                    code="size_changed",
                    message=f"{describe(name)}: is {sizes[name]} bytes, the Hub records "
                    f"{want.size}",
                    file=describe(name),
                    fix=fix,
                )
            )
        elif want.sha256:
            lfs[name] = path
        elif want.blob_id:
            # regular (non-LFS) git files are small (the Hub caps them at 10 MB): no threads
            actual = file_digest(path, "git")
            report.hashed_bytes += sizes[name]
            if actual != want.blob_id:
                problems.append(
                    _hub_mismatch(describe(name), "git-sha1", actual, want.blob_id, against, fix)
                )
    digests = _hash_split(lfs, "sha256", progress, report)
    report.hashed_bytes += sum(sizes[n] for n in lfs)
    for name, digest in digests.items():
        if digest != remote[name].sha256:
            problems.append(
                _hub_mismatch(describe(name), "sha256", digest, remote[name].sha256, against, fix)
            )


def _hub_mismatch(
    file: str, algo: str, actual: str, expected: str, against: str, fix: str
) -> Problem:
    if against == "the Hub's":
        said = f"the Hub's {expected[:16]}… (the local copy is corrupt or from another revision)"
    else:
        said = f"{expected[:16]}…, {against}: the blob is corrupt"
    return Problem(
        code="checksum_mismatch",
        message=f"{file}: {algo} {actual[:16]}… differs from {said}",
        file=file,
        fix=fix,
    )


def _refetch_fix(hub: str) -> str:
    """The fix of a file of the HF cache that differs from what the Hub (or its content
    address) says: the blob deleted and fetched again."""
    return f"Delete it (`hf cache rm`) and download it again (`ckpt download {hub} --cache-only`)."


# ---------------------------------------------------------------- split across torchrun ranks


def _hash_split(
    files: Mapping[str, Any], algo: str, progress: Progress, report: VerifyReport
) -> dict[str, str]:
    """`_hash`; under torchrun each rank hashes a byte-balanced share and every rank gets all."""
    workers = active()
    if not workers.distributed:
        return _hash(dict(files), algo, progress)
    sizes = files_size(dict(files))
    names = list(files)
    mine = [names[i] for i in workers.mine([sizes[n] for n in names])]
    started = time.perf_counter()
    digests: dict[str, str] = {}
    with workers.together():
        combined = CombinedProgress(progress, workers, total=sum(sizes.values()))
        digests = _hash({n: files[n] for n in mine}, algo, combined)
        workers.test_failure_point("hashing")
    share = RankShare(
        rank=workers.rank,
        files=mine,
        bytes=sum(sizes[n] for n in mine),
        seconds=time.perf_counter() - started,
    )
    merged: dict[str, str] = {}
    for got in workers.all_gather({"digests": digests, "share": share.model_dump(mode="json")}):
        merged.update(got["digests"])
        report.ranks.append(RankShare.model_validate(got["share"]))
    return {name: merged[name] for name in names}
