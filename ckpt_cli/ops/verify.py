"""`verify`: is a checkpoint complete, intact and resumable? Every problem, not just the first.

Checks, cheapest first:

* structure (always): the format adapter's `check` (headers, offsets, file sizes, index
  against shards, DCP chunk coverage...), from metadata and file sizes only;
* `resumable`: the training state is complete enough to resume the run;
* `checksums` / `write_manifest`: every file hashed in parallel threads and compared with (or
  recorded in) a `ckpt-manifest.json`;
* `deep`: every tensor read, one at a time, and counted for NaN/Inf.

Nothing here writes to the checkpoint except the manifest `write_manifest` asks for (written
atomically, and only when no problem was found).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from .. import __version__, models
from ..distributed import CombinedProgress, RankShare, active
from ..errors import (
    CkptError,
    DestinationExistsError,
    FormatError,
    NotFoundError,
    UnsafeInputError,
    UsageError,
)
from ..formats import detect_format, get_format, resolve_source
from ..formats.base import Checkpoint, Source
from ..hashing import ALGORITHMS, Hashable, StoredFile, hash_files
from ..layouts import OpenedSource, check_source, open_source, recognise_layout, training_checks
from ..models import Problem, TrainingState
from ..output import Destination, RemoteDest, check_destination, resolve_destination, staged_output
from ..progress import NULL_PROGRESS, Progress
from ..storage import LocalStorage, read_regular, remote_failure
from ..uri import parse_location
from .parity import ParityCheck, check_parity, damage_text

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

#: default manifest file name, inside a checkpoint folder (or beside a single-file checkpoint)
MANIFEST_NAME = "ckpt-manifest.json"
MANIFEST_VERSION = 1
#: elements per NaN/Inf counting step: bounds the temporary masks for huge tensors
_COUNT_STEP = 1 << 24


class FileDigest(BaseModel):
    """One file recorded in a checksum manifest."""

    size: int
    digest: str


class ChecksumManifest(BaseModel):
    """The content of `ckpt-manifest.json`.

    Attributes:
        ckpt_manifest: file format version.
        algorithm: `sha256`, `blake3` or `xxh3` (XXH3-128).
        created: when it was written (UTC, ISO 8601).
        tool: the ckpt version that wrote it.
        format: the checkpoint format token.
        files: path relative to the checkpoint root -> size and hex digest.
    """

    ckpt_manifest: int = MANIFEST_VERSION
    algorithm: str
    created: str
    tool: str
    format: str | None = None
    files: dict[str, FileDigest]


class TensorHealth(BaseModel):
    """Non-finite values found in one tensor by `--deep`."""

    name: str
    file: str | None = None
    nan: int = 0
    inf: int = 0


class VerifyReport(BaseModel):
    """The result of `ckpt verify`.

    Attributes:
        location / format: what was checked and as which format.
        ok: no error-level problem was found.
        checks: which checks ran (`structure`, `resumable`, `checksums`, `deep`, `write-manifest`).
        files / bytes: files of the checkpoint considered and their total size.
        tensors: tensor entries checked by `--deep` (0 otherwise).
        hashed_bytes: bytes hashed for checksums.
        algorithm / manifest: the hash algorithm and manifest path, for checksum runs.
        manifest_written: `--write-manifest` wrote the manifest (False when problems stopped it).
        nonfinite: tensors holding NaN or Inf (`--deep`).
        training: the training state, when the source is a training checkpoint.
        problems: every problem found, errors and warnings.
        errors / warnings: counts by severity.
        ranks: under torchrun, which files each rank hashed (empty in a single-process run).
    """

    location: str
    format: str | None = None
    ok: bool
    checks: list[str]
    files: int = 0
    bytes: int = 0
    tensors: int = 0
    hashed_bytes: int = 0
    algorithm: str | None = None
    manifest: str | None = None
    manifest_written: bool = False
    nonfinite: list[TensorHealth] = Field(default_factory=list)
    training: TrainingState | None = None
    problems: list[Problem] = Field(default_factory=list)
    errors: int = 0
    warnings: int = 0
    ranks: list[RankShare] = Field(default_factory=list)
    parity: ParityCheck | None = None


def verify(
    src: str,
    *,
    format: str | None = None,
    checksums: bool = False,
    write_manifest: bool = False,
    manifest: str | None = None,
    algo: str | None = None,
    deep: bool = False,
    resumable: bool = False,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
    exact: bool = False,
) -> VerifyReport:
    """Check `src` and report every problem found.

    Args:
        src: checkpoint file or folder, or `hf://` location.
        format: read as this format instead of detecting it.
        checksums: hash every file and compare with the manifest.
        write_manifest: hash every file and record the digests in a manifest.
        manifest: manifest path (default `ckpt-manifest.json` in the checkpoint folder).
        algo: hash algorithm for `write_manifest` (checks use the manifest's own).
        deep: read every tensor, count NaN/Inf, check every entry deserialises.
        resumable: training must be able to continue: missing weights, optimizer state or
            progress counter is an error; what only an exact resume needs (scheduler, step,
            RNG, data-loader state) is a warning.
        exact: (implies `resumable`) the resumed run must be bit-identical: those are errors.
        force: let `write_manifest` replace an existing manifest.
        progress: receives hashing and reading progress.

    Raises:
        NotFoundError (exit 3) or FormatError (exit 4) when SRC cannot be read at all;
        UsageError for contradictory options. Problems found are returned, not raised.
    """
    # under torchrun: join the launch now, so rank 0 alone reports even when nothing is hashed
    active()
    if checksums and write_manifest:
        raise UsageError(
            "--checksums and --write-manifest do not go together",
            fix="Write the manifest once (--write-manifest), then check with --checksums.",
        )
    if algo is not None and algo not in ALGORITHMS:
        raise UsageError(f"unknown --algo {algo!r}", fix=f"Use one of {', '.join(ALGORITHMS)}.")
    resumable = resumable or exact
    source = resolve_source(src)
    # a training folder (Trainer, accelerate, DeepSpeed) is checked component by component
    opened = recognise_layout(source) if format is None else None
    try:
        if opened is None:
            name = _format_name(source, format)
            if name == "dcp" and source.target is not None:
                # SRC named the .metadata or one .distcp file: the checkpoint is the folder
                source = Source(location=source.location, storage=source.storage)
            problems = list(get_format(name).check(source))
            if name == "dcp" and not any(p.severity == "error" for p in problems):
                problems.extend(dcp_object_problems(source))
        else:
            training = opened.training
            name = training.layout if training else opened.checkpoint.manifest.format
            problems = check_source(src)
        report = VerifyReport(
            location=source.location.raw, format=name, ok=True, checks=["structure"]
        )
        # the manifest is not part of what it describes
        considered = {n: size for n, size in source.files.items() if n != MANIFEST_NAME}
        report.files = len(considered)
        report.bytes = sum(considered.values())
        report.training = opened.training if opened is not None else None
        if not any(p.severity == "error" for p in problems):
            _quant_checks(report, problems, src, format, opened, deep=deep)
        if resumable or deep:
            _open_checks(
                report,
                problems,
                src,
                format,
                opened,
                resumable=resumable,
                deep=deep,
                progress=progress,
                exact=exact,
            )
    finally:
        if opened is not None:
            opened.checkpoint.close()
    parity = (
        check_parity(src, checksums=checksums, progress=progress)
        if source.location.kind != "hf"
        else None
    )
    # a protected checkpoint carries its own digests: without a ckpt-manifest.json the parity
    # manifest's per-block digests are the checksums
    if (
        checksums
        and manifest is None
        and parity is not None
        and not _manifest_exists(_manifest_location(source, None))
    ):
        checksums = False
        report.checks.append("checksums")
    if checksums or write_manifest:
        _checksum_checks(
            report,
            problems,
            source,
            write=write_manifest,
            manifest=manifest,
            algo=algo,
            force=force,
            progress=progress,
        )
    if parity is not None:
        _parity_problems(report, problems, parity)
    report.problems = problems
    report.errors = sum(1 for p in problems if p.severity == "error")
    report.warnings = len(problems) - report.errors
    report.ok = report.errors == 0
    return report


def _quant_checks(
    report: VerifyReport,
    problems: list[Problem],
    src: str,
    format: str | None,
    opened: OpenedSource | None,
    *,
    deep: bool,
) -> None:
    """Quantized weights against their sidecars and the config (headers; scale values with deep)."""
    from ..quant import analyse_checkpoint

    try:
        own = opened if opened is not None else open_source(src, format)
    except CkptError:
        return  # what stops opening is already a structural problem
    try:
        checkpoint = own.checkpoint
        analysis = analyse_checkpoint(checkpoint.manifest, checkpoint.storage)
        if not analysis.quantized and analysis.config.method is None:
            return
        report.checks.append("quantization")
        problems.extend(analysis.problems)
        if deep:
            from ..quant.dequant import scale_value_problems

            problems.extend(scale_value_problems(checkpoint, analysis))
    finally:
        if opened is None:
            own.checkpoint.close()


def _manifest_exists(path: Destination) -> bool:
    if isinstance(path, Path):
        return path.exists()
    try:
        return bool(path.fs.exists(path.path))
    except Exception as exc:
        raise remote_failure(exc, path.url) from None


def _parity_problems(report: VerifyReport, problems: list[Problem], parity: ParityCheck) -> None:
    """What the parity manifest says: damage located to the block, and what repair can do."""
    report.checks.append("parity")
    report.parity = parity
    report.hashed_bytes += parity.hashed_bytes
    if report.algorithm is None and parity.hashed_bytes:
        report.algorithm = "xxh3 blocks"
    damaged = {d.path: d for d in parity.damaged}
    # the problems other checks found in these files get the repair verdict too
    for problem in problems:
        if problem.file in damaged:
            problem.repairable = damaged[problem.file].repairable
    for d in parity.damaged:
        verdict = (
            "repairable: run `ckpt repair`"
            if d.repairable
            else f"NOT repairable: more than {parity.parity} losses in a stripe"
        )
        if d.kind == "parity":
            code, severity = "parity_damaged", "warning"
        elif d.state == "missing":
            code, severity = "lost_file", "error"
        else:
            code, severity = "damaged_blocks", "error"
        problems.append(
            Problem(
                code=code,
                message=f"{damage_text(d)} (against the parity manifest; {verdict})",
                file=d.path,
                severity=severity,
                repairable=d.repairable,
            )
        )
    for name in parity.stale:
        problems.append(
            Problem(
                code="parity_stale",
                message=f"{name}: modified after `ckpt protect` wrote the parity; if the change "
                "was intended run `ckpt protect SRC --force`, else `ckpt repair SRC` restores it "
                "(check with `ckpt verify SRC --checksums`)",
                file=name,
                severity="warning",
            )
        )
    for name in parity.unprotected:
        problems.append(
            Problem(
                code="unprotected_file",
                message=f"{name}: added after `ckpt protect` (no parity covers it); run "
                "`ckpt protect SRC --force` to cover it",
                file=name,
                severity="warning",
            )
        )


def _format_name(source: Source, format: str | None) -> str:
    if format == "hub":
        if source.location.kind != "hf":
            raise UsageError(
                "--format hub needs an hf://org/repo location", path=source.location.raw
            )
        format = None
    return format or detect_format(source)


# ---------------------------------------------------------------- training state and --deep


def _open_checks(
    report: VerifyReport,
    problems: list[Problem],
    src: str,
    format: str | None,
    opened: OpenedSource | None,
    *,
    resumable: bool,
    deep: bool,
    progress: Progress,
    exact: bool = False,
) -> None:
    """Checks that need the checkpoint opened: resumability and reading every entry."""
    if any(p.severity == "error" for p in problems):
        # the structural problems are the story; reading on would only repeat them
        skipped = " and ".join(c for c, on in (("resumability", resumable), ("deep", deep)) if on)
        problems.append(
            Problem(
                code="not_checked",
                message=f"{src}: skipped the {skipped} checks because of the problems above",
                file=src,
                severity="warning",
            )
        )
        return
    if opened is None:
        try:
            opened = open_source(src, format)
        except CkptError as error:
            problems.append(Problem(code=error.code, message=error.message, file=error.path))
            return
    report.training = opened.training
    with opened.checkpoint as checkpoint:
        if resumable:
            report.checks.append("resumable")
            problems.extend(training_checks(opened, exact=exact))
        if deep:
            report.checks.append("deep")
            _deep(report, problems, checkpoint, progress)


def _deep(
    report: VerifyReport, problems: list[Problem], checkpoint: Checkpoint, progress: Progress
) -> None:
    """Read every entry once; count NaN/Inf of floating tensors.

    Under torchrun each rank reads a byte-balanced share of the entries; the findings are
    gathered and kept in manifest order, so every rank reports what one process would.
    """
    manifest = checkpoint.manifest
    workers = active()
    entries = manifest.entries
    mine = workers.mine([e.nbytes for e in entries]) if workers.distributed else range(len(entries))
    progress = CombinedProgress(progress, workers, total=manifest.tensor_bytes())
    progress.start(
        sum(entries[i].nbytes for i in mine if entries[i].kind == "tensor"), "reading tensors"
    )
    found: list[dict[str, Any]] = []
    try:
        with workers.together():
            for index in mine:
                part = VerifyReport(location=report.location, ok=True, checks=[])
                part_problems: list[Problem] = []
                _deep_entry(part, part_problems, checkpoint, entries[index], progress)
                if workers.distributed:
                    found.append(
                        {
                            "index": index,
                            "tensors": part.tensors,
                            "nonfinite": [h.model_dump(mode="json") for h in part.nonfinite],
                            "problems": [p.model_dump(mode="json") for p in part_problems],
                        }
                    )
                else:
                    report.tensors += part.tensors
                    report.nonfinite.extend(part.nonfinite)
                    problems.extend(part_problems)
    finally:
        progress.finish()
    if not workers.distributed:
        return
    merged = sorted((f for got in workers.all_gather(found) for f in got), key=lambda f: f["index"])
    for f in merged:
        report.tensors += f["tensors"]
        report.nonfinite.extend(TensorHealth.model_validate(h) for h in f["nonfinite"])
        problems.extend(Problem.model_validate(p) for p in f["problems"])


def _deep_entry(
    report: VerifyReport,
    problems: list[Problem],
    checkpoint: Checkpoint,
    entry: models.Entry,
    progress: Progress,
) -> None:
    """Read one entry; record what is wrong with it."""
    where = checkpoint.manifest.location
    file = checkpoint.storage.describe(entry.file) if entry.file else where
    if entry.kind != "tensor":
        try:
            checkpoint.read_object(entry.name)
        except UnsafeInputError:
            pass  # listed on purpose but never unpickled (training_args.bin)
        except Exception as exc:  # any failure to deserialise is the finding itself
            problems.append(_unreadable(entry.name, file, exc, "object"))
        return
    from .. import dtypes

    layout = dtypes.torch_layout(entry.dtype, list(entry.shape)) if entry.dtype else None
    if entry.dtype and layout is None:
        # F6 (and odd-length F4) have no torch dtype: the header checks are all there is
        problems.append(
            Problem(
                code="not_checked",
                message=f"{file}: tensor {entry.name!r} is {entry.dtype}, which torch cannot "
                "hold; its bytes were checked against the header only",
                file=file,
                tensor=entry.name,
                severity="warning",
            )
        )
        progress.advance(entry.nbytes)
        return
    try:
        tensor = checkpoint.read_tensor(entry.name)
    except Exception as exc:
        problems.append(_unreadable(entry.name, file, exc, "tensor"))
        progress.advance(entry.nbytes)
        return
    report.tensors += 1
    expected_shape = layout[1] if layout else list(entry.shape)
    if list(tensor.shape) != expected_shape:
        problems.append(
            Problem(
                code="shape_mismatch",
                message=f"{file}: tensor {entry.name!r} reads as shape "
                f"{list(tensor.shape)}, its metadata says {entry.shape}",
                file=file,
                tensor=entry.name,
            )
        )
    nan, inf = count_nonfinite(tensor)
    if nan or inf:
        report.nonfinite.append(TensorHealth(name=entry.name, file=file, nan=nan, inf=inf))
        problems.append(
            Problem(
                code="nonfinite",
                message=f"{file}: tensor {entry.name!r} holds {nan} NaN and {inf} Inf "
                f"values (of {tensor.numel()})",
                file=file,
                tensor=entry.name,
            )
        )
    del tensor
    progress.advance(entry.nbytes)


def _unreadable(name: str, file: str, exc: Exception, kind: str) -> Problem:
    text = exc.message if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"
    return Problem(
        code="unreadable",
        message=f"{file}: {kind} {name!r} does not deserialise ({text})",
        file=file,
        tensor=name,
    )


def count_nonfinite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor, in bounded slices; (0, 0) for others."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return 0, 0
    if tensor.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return 0, 0  # E2M1 has no NaN or Inf encodings (and no CPU kernels to look)
    flat = tensor.reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), _COUNT_STEP):
        part = flat[start : start + _COUNT_STEP]
        if part.dtype.itemsize == 1:  # float8 kinds have no isfinite kernel on CPU
            part = part.float()
        finite = torch.isfinite(part)
        if bool(finite.all()):
            continue
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf


# ---------------------------------------------------------------- checksums and the manifest


def default_manifest_path(source: Source) -> Path:
    """`ckpt-manifest.json` in the checkpoint folder (beside the file for a single file)."""
    return _local_root(source) / MANIFEST_NAME


def _manifest_location(source: Source, manifest: str | None) -> Destination:
    """Where the checksum manifest is: `--manifest` (a path or URL), else in the checkpoint."""
    if manifest is not None:
        loc = parse_location(manifest)
        if loc.kind == "local":
            return Path(manifest)
        return resolve_destination(manifest)
    storage = source.storage
    remote = storage.fs_path(MANIFEST_NAME)
    if remote is not None:
        # in the object store, beside the checkpoint's files
        fs, path = remote
        return RemoteDest(url=storage.describe(MANIFEST_NAME), fs=fs, path=path)
    return default_manifest_path(source)


def _refuse_manifest_over_checkpoint(source: Source, path: Destination) -> None:
    """Refuse to write the manifest over a file of the checkpoint, whatever the flags.

    The manifest may replace (`--force`) only a manifest: a path that is one of the
    checkpoint's files, or any existing file that is not a ckpt manifest, is refused.
    """
    root = source.storage.local_root
    if not isinstance(path, Path) or root is None:
        return
    target = path.resolve()
    listed = set(source.storage.list_files()) | set(source.files)
    if source.target is not None:
        # a single shard's siblings (the rest of its checkpoint) count too
        listed |= set(LocalStorage(root).list_files())
    for name in sorted(listed):
        if name != MANIFEST_NAME and (root / name).resolve() == target:
            raise UsageError(
                "is a file of the checkpoint; writing the manifest there would destroy it",
                path=str(path),
                fix=f"Name another --manifest path (the default is {root / MANIFEST_NAME}).",
            )
    if path.exists() or path.is_symlink():
        try:
            ChecksumManifest.model_validate(json.loads(_read_bytes(path)))
        except (CkptError, OSError, UnicodeDecodeError, ValueError, RecursionError):
            raise UsageError(
                "exists and is not a ckpt checksum manifest; --force replaces only a manifest",
                path=str(path),
                fix="Name another --manifest path, or move that file away yourself.",
            ) from None


def _local_root(source: Source) -> Path:
    root = source.storage.local_root
    assert root is not None, "callers check for a local checkpoint first"
    return root


def _checksum_checks(
    report: VerifyReport,
    problems: list[Problem],
    source: Source,
    *,
    write: bool,
    manifest: str | None,
    algo: str | None,
    force: bool,
    progress: Progress,
) -> None:
    if not write and source.storage.server_digests() is not None:
        report.checks.append("checksums")
        _hub_cache_checksums(report, problems, source, progress)
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
    if not write and manifest is not None and manifest.startswith("hf://"):
        report.checks.append("checksums")
        _local_against_hub(report, problems, source, manifest, progress)
        return
    path = _manifest_location(source, manifest)
    report.manifest = str(path)
    storage = source.storage
    files = _files_to_hash(source, path)
    if write:
        report.checks.append("write-manifest")
        algorithm = algo or "sha256"
        _refuse_manifest_over_checkpoint(source, path)
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
                )
            )
            return
        digests = _hash_split(files, algorithm, progress, report)
        sizes = files_size(files)
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
                _write_manifest(path, record, force)
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
                )
            )
            return
    sizes = files_size(files)
    to_hash: dict[str, Hashable] = {}
    for name, want in expected.items():
        if name not in files:
            problems.append(
                Problem(
                    code="missing_file",
                    message=f"{storage.describe(name)}: is missing (the manifest records {want.size} bytes)",
                    file=storage.describe(name),
                )
            )
        elif sizes[name] != want.size:
            problems.append(
                Problem(
                    code="size_changed",
                    message=f"{storage.describe(name)}: is {sizes[name]} bytes, the manifest records "
                    f"{want.size} (truncated or rewritten since the manifest was written)",
                    file=storage.describe(name),
                )
            )
        else:
            to_hash[name] = files[name]
    for name in sorted(set(files) - set(expected)):
        problems.append(
            Problem(
                code="unlisted_file",
                message=f"{storage.describe(name)}: is not in the manifest {path} (added after it was written)",
                file=storage.describe(name),
                severity="warning",
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
                    "or is corrupt)",
                    file=storage.describe(name),
                )
            )


def _files_to_hash(source: Source, manifest: Destination) -> dict[str, Hashable]:
    """The checkpoint's files (name -> local path or stored file), the manifest excluded."""
    storage = source.storage
    out: dict[str, Hashable] = {}
    root = storage.local_root
    if root is not None:
        skip = Path(manifest).resolve() if isinstance(manifest, Path) else None
        for name in source.files:
            path = root / name
            if path.resolve() != skip:
                out[name] = path
        return out
    skip_name = manifest.path if isinstance(manifest, RemoteDest) else None
    for name, size in source.files.items():
        remote = storage.fs_path(name)
        if remote is None or remote[1] != skip_name:
            out[name] = StoredFile(storage, name, size)
    return out


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
    if manifest is not None and manifest.startswith("hf://"):
        raise UsageError(
            "--manifest hf://… checks a local copy against the Hub's digests",
            path=source.location.raw,
            fix="Check the Hub repository against a manifest file instead.",
        )


def _read_bytes(path: Destination) -> bytes:
    if isinstance(path, Path):
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        return read_regular(path)  # a FIFO named like the manifest must not hang
    try:
        data: bytes = path.fs.cat_file(path.path)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise remote_failure(exc, path.url) from None
    return data


def read_manifest(path: Destination) -> ChecksumManifest:
    """Load a checksum manifest; NotFoundError / FormatError with the fix when unusable."""
    try:
        raw = _read_bytes(path)
    except FileNotFoundError:
        raise NotFoundError(
            "no checksum manifest here",
            path=str(path),
            fix="Write one from a known-good copy with `ckpt verify SRC --write-manifest`, or "
            "name it with --manifest PATH.",
        ) from None
    try:
        data: Any = json.loads(raw)
        manifest = ChecksumManifest.model_validate(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(
            f"is not a valid ckpt checksum manifest ({str(exc).splitlines()[0]})",
            path=str(path),
            fix="Write it again with `ckpt verify SRC --write-manifest --force`.",
        ) from None
    if manifest.algorithm not in ALGORITHMS:
        raise FormatError(
            f"records digests of unknown algorithm {manifest.algorithm!r}", path=str(path)
        )
    return manifest


def _write_manifest(path: Destination, record: ChecksumManifest, force: bool) -> None:
    """Publish the manifest atomically (temporary sibling + one rename, or an upload)."""
    data = (json.dumps(record.model_dump(mode="json"), indent=2) + "\n").encode()
    with (
        staged_output(path, force=force, single_file=True) as staging,
        open(staging / path.name, "wb") as fh,
    ):
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# ---------------------------------------------------------------- against the Hub's digests


def _hub_cache_checksums(
    report: VerifyReport, problems: list[Problem], source: Source, progress: Progress
) -> None:
    """`verify hf://… --checksums`: the files in the local HF cache against the Hub's digests."""
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
            )
        )
        return
    _compare_with_hub(
        report, problems, local, {n: remote[n] for n in names}, storage.describe, progress
    )


def _local_against_hub(
    report: VerifyReport, problems: list[Problem], source: Source, hub: str, progress: Progress
) -> None:
    """`verify DIR --checksums --manifest hf://…`: a downloaded copy against the Hub's digests."""
    hub_side = resolve_source(hub)
    storage = hub_side.storage
    digests = storage.server_digests()
    assert digests is not None, "an hf:// location opens a Hub storage, which records digests"
    report.manifest = storage.display
    root = _local_root(source)
    local = {
        name: root / name
        for name in source.files
        # huggingface_hub keeps its download bookkeeping there; ckpt its manifest
        if not name.startswith(".cache/huggingface/") and name != MANIFEST_NAME
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
            )
        )
    for name in sorted(set(local) - set(remote)):
        problems.append(
            Problem(
                code="unlisted_file",
                message=f"{root / name}: is not in {storage.display}",
                file=str(root / name),
                severity="warning",
            )
        )
    both = {n: local[n] for n in sorted(set(local) & set(remote))}
    _compare_with_hub(report, problems, both, remote, lambda n: str(root / n), progress)


def _compare_with_hub(
    report: VerifyReport,
    problems: list[Problem],
    local: dict[str, Path],
    remote: dict[str, Any],
    describe: Any,
    progress: Progress,
) -> None:
    """Sizes, then the Hub's own digests: LFS sha256 (hashed in parallel), git blob sha1."""
    from ..storage.hub import file_digest

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
                )
            )
        elif want.sha256:
            lfs[name] = path
        elif want.blob_id:
            # regular (non-LFS) git files are small (the Hub caps them at 10 MB): no threads
            actual = file_digest(path, "git")
            report.hashed_bytes += sizes[name]
            if actual != want.blob_id:
                problems.append(_hub_mismatch(describe(name), "git-sha1", actual, want.blob_id))
    digests = _hash_split(lfs, "sha256", progress, report)
    report.hashed_bytes += sum(sizes[n] for n in lfs)
    for name, digest in digests.items():
        if digest != remote[name].sha256:
            problems.append(_hub_mismatch(describe(name), "sha256", digest, remote[name].sha256))


def _hub_mismatch(file: str, algo: str, actual: str, expected: str) -> Problem:
    return Problem(
        code="checksum_mismatch",
        message=f"{file}: {algo} {actual[:16]}… differs from the Hub's {expected[:16]}… (the "
        "local copy is corrupt or from another revision)",
        file=file,
    )


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


def dcp_object_problems(source: Source) -> list[Problem]:
    """Every non-tensor (BYTE_IO) entry of a DCP checkpoint whose pickle needs a global that
    ckpt's restricted reader refuses: found by reading opcodes (nothing runs, no torch), so
    plain `verify` names the entry that `convert`, `diff` or `--deep` would refuse."""
    from ..formats.dcp import DcpCheckpoint
    from ..pickle_scan import refused_globals

    problems: list[Problem] = []
    try:
        checkpoint = get_format("dcp").open(source)
    except CkptError as error:
        return [Problem(code=error.code, message=error.message, file=error.path)]
    with checkpoint:
        if not isinstance(checkpoint, DcpCheckpoint):
            return []
        for entry in checkpoint.manifest.entries:
            if entry.kind != "object" or entry.file is None or entry.offset is None:
                continue
            where = checkpoint.storage.describe(entry.file)
            try:
                refused = refused_globals(checkpoint.read_object_bytes(entry.name))
            except CkptError as error:
                problems.append(Problem(code=error.code, message=error.message, file=where))
                continue
            if refused:
                problems.append(
                    Problem(
                        code="unloadable_object",
                        message=f"object entry {entry.name!r} needs "
                        f"{', '.join(refused[:5])}, which ckpt's restricted reader "
                        "(torch.load weights_only) refuses; nothing was executed",
                        file=where,
                        tensor=entry.name,
                    )
                )
    return problems
