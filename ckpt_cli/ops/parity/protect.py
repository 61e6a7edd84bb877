"""`protect`: compute and publish the parity of a checkpoint (split across ranks under torchrun)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ... import __version__
from ...dist.command import active
from ...errors import DestinationExistsError, FormatError, UsageError
from ...formats import resolve_source
from ...formats.names import is_commit_marker
from ...models import Request
from ...progress import NULL_PROGRESS, Progress
from ...sizes import counted
from ...storage.local import open_regular
from ...storage.output import Destination, local_destination, staged_output
from .codec import Codec, block_digest, pad_block
from .layout import (
    ParityLayout,
    lost_whole_costs,
    parse_block_size,
    plan_layout,
    rank_files,
    small_block,
)
from .model import (
    BLOCK_ALIGN,
    CODEC,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PARITY,
    HASH_THREADS,
    MANIFEST_BYTES_PER_BLOCK,
    MANIFEST_BYTES_PER_FILE,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_CONTAINERS,
    MAX_PARITY,
    ParityManifest,
    ProtectedFile,
    ProtectReport,
)
from .scan import damage_list, scan_parity
from .target import (
    BlockReader,
    ParityTarget,
    check_unchanged,
    checkpoint_folder,
    folder_time_kept,
    on_leader,
    open_parity_target,
    parity_dest,
    pwrite_all,
    read_parity_manifest,
    sha256_file,
    sha256_storage,
    written_at,
)


def protect(
    src: str,
    *,
    parity: int = DEFAULT_PARITY,
    block_size: str | int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
    whole_files: bool | None = None,
    dry_run: bool = False,
    on_plan: Callable[[ProtectReport], None] | None = None,
    progress: Progress = NULL_PROGRESS,
) -> ProtectReport:
    """Write Reed–Solomon parity for the checkpoint at `src` into its parity folder.

    Args:
        src: checkpoint folder or file, local or an fsspec URL (`s3://...`).
        parity: K, losses per stripe that can be rebuilt (parity shares written).
        block_size: bytes per block (a size like `4MiB`); rounded up to whole 4 KiB pages.
        force: replace existing parity.
        whole_files: protect every file whole (any K files lost can be rebuilt, at a parity
            of at least K times the largest file); None: when the checkpoint holds files of
            two or more ranks and striping would leave a rank's file unrebuildable if lost
            (a dead rank's file is the loss parity exists for), else only when that costs no
            more than striping.
        dry_run: plan only: the report says what the parity would cost and survive.
        on_plan: called with the plan (a `dry_run` report) before anything is written.
        progress: receives the bytes read.

    Raises:
        DestinationExistsError: the checkpoint is protected already (without `force`).
        UsageError: parity or block size out of range.
    """
    request = ProtectRequest(
        parity=parity,
        block_size=block_size,
        force=force,
        whole_files=whole_files,
        dry_run=dry_run,
    )
    return protect_with(src, request, on_plan, progress)


class ProtectRequest(Request):
    """Every option of `protect` but the location, typed and frozen: built once (by the
    command, or by `protect` from its keywords) and passed down whole, to every rank's share
    under torchrun too. Its fields are `protect`'s keyword parameters less the sinks
    (`on_plan`, `progress`), and the command's options (a test holds them to each other);
    they mean what `protect`'s arguments say."""

    parity: int = DEFAULT_PARITY
    block_size: str | int = DEFAULT_BLOCK_SIZE
    force: bool = False
    whole_files: bool | None = None
    dry_run: bool = False


def protect_with(
    src: str,
    request: ProtectRequest,
    on_plan: Callable[[ProtectReport], None] | None = None,
    progress: Progress = NULL_PROGRESS,
) -> ProtectReport:
    """`protect` of `src` as `request` says (the command's one call); `on_plan` is called
    with the plan (a dry-run report) before anything is written."""
    workers = active()
    split = not request.dry_run and workers.distributed
    if split and resolve_source(src).location.kind == "local":
        return _protect_split(src, request, on_plan)
    return on_leader(lambda: _protect(src, request, on_plan, progress), ProtectReport)


def _protect_split(
    src: str, options: ProtectRequest, on_plan: Callable[[ProtectReport], None] | None
) -> ProtectReport:
    """Protect under torchrun: every rank encodes a contiguous range of stripes.

    The checkpoint must be on a filesystem every rank sees (as for `verify` under torchrun).
    Rank 0 creates the staging folder and the parity files; each rank reads its stripes,
    writes their parity blocks in place (`pwrite` at the stripe's offset) and hashes the whole
    files and parity shares assigned to it (longest first); rank 0 gathers the digests,
    writes the manifest and publishes. A failure on any rank fails all and removes the staging.
    """
    workers = active()
    with ExitStack() as stack:
        shared: dict[str, Any] = {}
        parity, force = options.parity, options.force
        with workers.together():
            target, manifest = _prepare(src, options, check=workers.leader)
            dest = local_destination(parity_dest(target))
            assert dest is not None  # under torchrun: a filesystem every rank sees
            if workers.leader:
                if on_plan is not None:
                    on_plan(_report(target, manifest, dest, dry_run=True))
                dest.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(folder_time_kept(target))  # left after the publish
                staging = stack.enter_context(
                    staged_output(dest, commit_marker=is_commit_marker, force=force)
                )
                for j in range(parity):
                    with open(staging / f"parity-{j}.bin", "wb") as fh:
                        fh.truncate(manifest.stripes * manifest.block_size)
                shared = {"staging": str(staging), "manifest": manifest.model_dump(mode="json")}
        shared = workers.broadcast(shared)
        staging = Path(shared["staging"])
        # every rank works from rank 0's plan (one `created`, one layout)
        manifest = ParityManifest.model_validate(shared["manifest"])
        m = manifest
        layout = ParityLayout(m)
        storage = target.storage
        reader = BlockReader(storage)
        mine: dict[str, Any] = {"blocks": [], "parity": [], "sha": {}, "share_sha": {}}
        with workers.together():
            try:
                codec = Codec(m.width, m.parity, m.block_size)
                first = m.stripes * workers.rank // workers.size
                last = m.stripes * (workers.rank + 1) // workers.size
                fds = [os.open(staging / f"parity-{j}.bin", os.O_WRONLY) for j in range(m.parity)]
                try:
                    for stripe in range(first, last):
                        shares = []
                        for c in range(m.width):
                            where = layout.block(c, stripe)
                            if where is None:
                                shares.append(bytes(m.block_size))
                                continue
                            fi, bi = where
                            lo, hi = layout.extent(m.files[fi].size, bi)
                            data = reader.read(m.files[fi].path, lo, hi - lo)
                            mine["blocks"].append([fi, bi, block_digest(data)])
                            shares.append(pad_block(data, m.block_size))
                        for j, par in enumerate(codec.encode(shares)):
                            pwrite_all(fds[j], par, stripe * m.block_size)
                            mine["parity"].append([j, stripe, block_digest(par)])
                    for fd in fds:
                        os.fsync(fd)
                finally:
                    for fd in fds:
                        os.close(fd)
            finally:
                reader.close()
        # every parity block is written: now the whole-file digests, shared out by size
        weights = [f.size for f in m.files] + [m.stripes * m.block_size] * m.parity
        with workers.together():
            hasher = BlockReader(storage)
            try:
                for i in workers.mine(weights):
                    if i < len(m.files):
                        f = m.files[i]
                        mine["sha"][str(i)] = sha256_storage(hasher, f.path, f.size)
                    else:
                        j = i - len(m.files)
                        mine["share_sha"][str(j)] = sha256_file(staging / f"parity-{j}.bin")
            finally:
                hasher.close()
        gathered = workers.all_gather(mine)
        report: dict[str, Any] | None = None
        with workers.together():
            if workers.leader:
                digests = [[""] * -(-f.size // m.block_size) for f in m.files]
                p_digests = [[""] * m.stripes for _ in range(m.parity)]
                sha: dict[str, str] = {}
                share_sha: dict[str, str] = {}
                for part in gathered:
                    for fi, bi, digest in part["blocks"]:
                        digests[fi][bi] = digest
                    for j, stripe, digest in part["parity"]:
                        p_digests[j][stripe] = digest
                    sha.update(part["sha"])
                    share_sha.update(part["share_sha"])
                for i, f in enumerate(m.files):
                    f.sha256 = sha[str(i)]
                    f.blocks = digests[i]
                m.shares = [
                    ProtectedFile(
                        path=f"parity-{j}.bin",
                        size=m.stripes * m.block_size,
                        sha256=share_sha[str(j)],
                        blocks=p_digests[j],
                    )
                    for j in range(m.parity)
                ]
                check_unchanged(target)
                with open(staging / MANIFEST_NAME, "wb") as fh:
                    fh.write((json.dumps(m.model_dump(mode="json")) + "\n").encode())
                    fh.flush()
                    os.fsync(fh.fileno())
                stack.close()  # publish: the staging folder becomes the parity folder
                report = _report(target, m, dest).model_dump(mode="json")
    return ProtectReport.model_validate(workers.broadcast(report))


def _refuse_broken(target: ParityTarget, force: bool) -> None:
    """Parity is written for an intact checkpoint only: parity of a broken one would rebuild it
    broken, and (with `force`) replace the parity that could still rebuild what was lost.

    Raises:
        FormatError: the existing parity can rebuild a file lost since it was written (repair
            it first), or the checkpoint fails `verify`'s structural check.
    """
    from ..verify.structure import structural_errors

    where = target.source.location.raw
    if force:
        try:
            existing = read_parity_manifest(target)
        except FormatError:
            existing = None  # a corrupt parity manifest is what --force replaces
        if existing is not None:
            scan = scan_parity(target, existing, checksums=False)
            lost = [
                d.path
                for d in damage_list(target, scan)
                if d.kind == "data" and d.state == "missing" and d.repairable
            ]
            if lost:
                shown = ", ".join(lost[:3]) + (f" (+{len(lost) - 3} more)" if len(lost) > 3 else "")
                raise FormatError(
                    f"lost {shown} since `ckpt protect`; the existing parity can rebuild "
                    f"{'it' if len(lost) == 1 else 'them'}, and new parity would not "
                    "(--force would replace it)",
                    path=where,
                    fix="Rebuild with `ckpt repair SRC` first. If the file was removed on "
                    f"purpose, delete {target.storage.describe(target.parity_rel)} and protect "
                    "again.",
                )
    errors = structural_errors(target.source)
    if errors:
        first = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise FormatError(
            f"fails the structural check ({first.message}){more}; parity must not bless a "
            "broken checkpoint (it would rebuild it broken)",
            path=first.file or where,
            fix="See `ckpt verify SRC`; restore the checkpoint (`ckpt repair SRC` where it is "
            "protected, or from a good copy), then protect it.",
        )


def _prepare(
    src: str, options: ProtectRequest, check: bool = True
) -> tuple[ParityTarget, ParityManifest]:
    """Validate the options and plan the layout: the manifest without digests yet."""
    parity, block_size, force = options.parity, options.block_size, options.force
    if not 1 <= parity <= MAX_PARITY:
        raise UsageError(f"--parity {parity} is out of range", fix=f"Use 1 to {MAX_PARITY}.")
    block = parse_block_size(block_size)
    if not BLOCK_ALIGN <= block <= 1 << 30:
        raise UsageError(
            f"--block-size {block_size} is out of range", fix="Use 4KiB to 1GiB (e.g. 1MiB)."
        )
    block = -(-block // BLOCK_ALIGN) * BLOCK_ALIGN
    target = open_parity_target(src)
    storage = target.storage
    if check and not force and read_parity_manifest(target) is not None:
        raise DestinationExistsError(
            "is protected already",
            path=storage.describe(target.manifest_rel),
            fix="Check it with `ckpt verify SRC`, or pass --force to write new parity.",
        )
    for name in target.files:
        local = storage.local_path(name)
        if local is not None:
            # a FIFO, socket or device is no data to protect (and reading one may block):
            # refused, named, without blocking
            os.close(open_regular(local, storage.describe(name)))
    if check:
        _refuse_broken(target, force)
    names = list(target.files)
    sizes = [target.files[n] for n in names]
    block = min(block, small_block(max(sizes)))
    plan = plan_layout(sizes, block, whole_files=bool(options.whole_files))
    if options.whole_files is None and not plan.whole_files:
        # a dead rank's file is the loss parity exists for: when striping leaves a rank's
        # file covering more than one block of a stripe, protect whole files instead
        ranks = set(rank_files(names))
        if len(ranks) >= 2 and any(
            lost_whole_costs(start, -(-size // block), plan.stripes, plan.width) > 1
            for name, size, start in zip(names, sizes, plan.starts, strict=True)
            if name in ranks
        ):
            plan = plan_layout(sizes, block, whole_files=True)
    files = [
        ProtectedFile(
            path=name, size=size, sha256="", start=start, mtime_ns=written_at(target, name)
        )
        for name, size, start in zip(names, sizes, plan.starts, strict=True)
    ]
    folder = checkpoint_folder(target)
    manifest = ParityManifest(
        folder_mtime_ns=folder.stat().st_mtime_ns if folder is not None else None,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tool=f"ckpt {__version__}",
        block_size=block,
        width=plan.width,
        parity=parity,
        stripes=plan.stripes,
        total_blocks=sum(-(-size // block) for size in sizes),
        whole_files=plan.whole_files,
        files=files,
        shares=[],
    )
    _check_manifest_budget(manifest, storage.describe(target.manifest_rel))
    return target, manifest


def manifest_bytes(m: ParityManifest, block_size: int | None = None) -> int:
    """At most how many bytes `m`'s manifest takes once every digest is in (with blocks of
    `block_size`, by default its own): what `read_parity_manifest` must accept."""
    block = block_size or m.block_size
    blocks = sum(-(-f.size // block) for f in m.files)
    stripes = -(-blocks // m.width) if block_size else m.stripes
    # a block digest is 36 bytes; a file's path (JSON-escaped), size, sha256 and keys fit
    # in MANIFEST_BYTES_PER_FILE besides; the top-level fields in 4 KiB
    per_file = sum(len(json.dumps(f.path)) + MANIFEST_BYTES_PER_FILE for f in m.files)
    shares = m.parity * (stripes * MANIFEST_BYTES_PER_BLOCK + MANIFEST_BYTES_PER_FILE)
    return blocks * MANIFEST_BYTES_PER_BLOCK + per_file + shares + 4096


def _check_manifest_budget(m: ParityManifest, where: str) -> None:
    """Refuse a layout whose manifest `verify` and `repair` would refuse to read (too many
    blocks or files for `MAX_MANIFEST_BYTES`, `MAX_MANIFEST_CONTAINERS`), before any read."""
    containers = 1 + 2 * (len(m.files) + m.parity)
    containers += sum(f.path.count("[") + f.path.count("{") for f in m.files)
    if containers > MAX_MANIFEST_CONTAINERS:
        raise UsageError(
            f"{len(m.files):,} files are more than one parity manifest holds (at most "
            f"{MAX_MANIFEST_CONTAINERS:,} JSON arrays and objects, two per file)",
            path=where,
            fix="Protect the checkpoint's subfolders one at a time.",
        )
    need = manifest_bytes(m)
    if need <= MAX_MANIFEST_BYTES:
        return
    block = m.block_size
    while block < 1 << 30 and manifest_bytes(m, block) > MAX_MANIFEST_BYTES:
        block *= 2
    raise UsageError(
        f"blocks of {m.block_size:,} bytes make a parity manifest of up to {need:,} bytes, "
        f"more than the {MAX_MANIFEST_BYTES:,} verify and repair read",
        path=where,
        fix=f"Use a larger --block-size (--block-size {block >> 10}KiB or more).",
    )


def _report(
    target: ParityTarget, m: ParityManifest, dest: Destination, dry_run: bool = False
) -> ProtectReport:
    total = sum(f.size for f in m.files)
    parity_bytes = m.parity * m.stripes * m.block_size
    largest = max(m.files, key=lambda f: f.size)
    ranks = len(rank_files([f.path for f in m.files]))
    survives, fails = _what_it_survives(m, ranks)
    return ProtectReport(
        location=target.source.location.raw,
        parity_dir=str(dest),
        files=len(m.files),
        bytes=total,
        parity_bytes=parity_bytes,
        overhead=parity_bytes / total if total else 0.0,
        block_size=m.block_size,
        width=m.width,
        parity=m.parity,
        stripes=m.stripes,
        whole_files=m.whole_files,
        codec=f"{CODEC} {m.ec_type}",
        rank_files=ranks,
        largest_file=largest.path,
        largest_bytes=largest.size,
        survives=survives,
        does_not_survive=fails,
        dry_run=dry_run,
    )


#: files named one by one among those that cannot be rebuilt if lost whole
_NAMED = 5


def _what_it_survives(m: ParityManifest, ranks: int) -> tuple[list[str], list[str]]:
    """What the parity of `m` can rebuild, and what it cannot, in words."""
    k, n = m.parity, len(m.files)
    blocks = (
        f"any {counted(k, 'damaged block')} in a stripe of {m.width} "
        f"(blocks of {m.block_size} bytes)"
    )
    more_blocks = f"more than {counted(k, 'damaged block')} in one stripe"
    if m.whole_files:
        lost = f"any {min(k, n)} of the {n} files lost whole"
        if ranks >= 2:
            lost += f" (a dead rank's file is one: {ranks} files here are per-rank)"
        fails = [more_blocks]
        if n > k:
            fails.insert(0, f"more than {counted(k, 'file')} lost whole")
        return [lost, blocks], fails
    too_long = [
        f.path
        for f in m.files
        if lost_whole_costs(f.start, -(-f.size // m.block_size), m.stripes, m.width) > k
    ]
    shown = ", ".join(too_long[:_NAMED]) + (
        f" (+{len(too_long) - _NAMED} more)" if len(too_long) > _NAMED else ""
    )
    fails = [more_blocks]
    if too_long:
        fails.insert(
            0,
            f"{shown} lost whole: striped within itself, such a file covers more than {k} "
            "blocks of a stripe (--whole-files protects whole files, at a parity of at least "
            f"{k} x the largest file)",
        )
    return [blocks], fails


def _protect(
    src: str,
    options: ProtectRequest,
    on_plan: Callable[[ProtectReport], None] | None,
    progress: Progress,
) -> ProtectReport:
    target, manifest = _prepare(src, options)
    parity, force = options.parity, options.force
    dest = parity_dest(target)
    plan = _report(target, manifest, dest, dry_run=True)
    if options.dry_run:
        return plan
    if on_plan is not None:
        on_plan(plan)
    storage = target.storage
    files = manifest.files
    sizes = [f.size for f in files]
    block, width, stripes = manifest.block_size, manifest.width, manifest.stripes
    layout = ParityLayout(manifest)
    codec = Codec(width, parity, block)
    hashers = [hashlib.sha256() for _ in files]
    #: the next block each file's sha256 expects; a file striped across columns arrives out
    #: of order and is hashed again sequentially afterwards
    expected = [0] * len(files)
    digests: list[list[str]] = [[""] * -(-f.size // block) for f in files]
    local_parent = dest.parent if isinstance(dest, Path) else None
    if local_parent is not None and not local_parent.exists():
        local_parent.mkdir(parents=True)
    reader = BlockReader(storage)
    progress.start(sum(sizes), f"protecting (K={parity}, W={width})")
    try:
        with (
            folder_time_kept(target),
            staged_output(dest, commit_marker=is_commit_marker, force=force) as staging,
        ):
            outs = [open(staging / f"parity-{j}.bin", "wb") for j in range(parity)]
            p_hash = [hashlib.sha256() for _ in range(parity)]
            p_digests: list[list[str]] = [[] for _ in range(parity)]
            try:
                pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ckpt-protect")

                def load(fi: int, bi: int) -> bytes:
                    f = files[fi]
                    lo, hi = layout.extent(f.size, bi)
                    data = reader.read(f.path, lo, hi - lo)
                    digests[fi][bi] = block_digest(data)
                    progress.advance(len(data))
                    return data

                def submit(stripe: int) -> list[tuple[Future[bytes], int, bool] | None]:
                    # decided here, in stripe order: whether a block continues its file's sha256
                    futures: list[tuple[Future[bytes], int, bool] | None] = []
                    for c in range(width):
                        where = layout.block(c, stripe)
                        if where is None:
                            futures.append(None)
                            continue
                        fi, bi = where
                        update = expected[fi] == bi
                        expected[fi] = expected[fi] + 1 if update else -1
                        futures.append((pool.submit(load, fi, bi), fi, update))
                    return futures

                def gather(pending: list[tuple[Future[bytes], int, bool] | None]) -> list[bytes]:
                    # the file sha256s are fed here, in the calling thread, column by column:
                    # blocks of one file in one stripe finish in any order in the pool, and a
                    # hash fed as they finished recorded a wrong digest (repair then refused)
                    shares = []
                    for job in pending:
                        if job is None:
                            shares.append(zeros)
                            continue
                        future, fi, update = job
                        data = future.result()
                        if update:
                            hashers[fi].update(data)
                        shares.append(pad_block(data, block))
                    return shares

                zeros = bytes(block)
                try:
                    # stripe s+1 is read in threads while stripe s is encoded
                    pending = submit(0)
                    for s in range(stripes):
                        shares = gather(pending)
                        if s + 1 < stripes:
                            pending = submit(s + 1)
                        for j, par in enumerate(codec.encode(shares)):
                            outs[j].write(par)
                            p_hash[j].update(par)
                            p_digests[j].append(block_digest(par))
                finally:
                    pool.shutdown(wait=True, cancel_futures=True)
                for out in outs:
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                for out in outs:
                    out.close()
            for fi, f in enumerate(files):
                f.sha256 = (
                    hashers[fi].hexdigest()
                    if expected[fi] == len(digests[fi])
                    else sha256_storage(reader, f.path, f.size)
                )
                f.blocks = digests[fi]
            manifest.shares = [
                ProtectedFile(
                    path=f"parity-{j}.bin",
                    size=stripes * block,
                    sha256=p_hash[j].hexdigest(),
                    blocks=p_digests[j],
                )
                for j in range(parity)
            ]
            check_unchanged(target)
            with open(staging / MANIFEST_NAME, "wb") as fh:
                fh.write((json.dumps(manifest.model_dump(mode="json")) + "\n").encode())
                fh.flush()
                os.fsync(fh.fileno())
    finally:
        reader.close()
        progress.finish()
    return _report(target, manifest, dest)
