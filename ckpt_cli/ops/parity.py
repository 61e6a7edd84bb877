"""`protect` and `repair`: Reed–Solomon parity for a checkpoint's files, and rebuilds from it.

Layout (the parity manifest records every parameter, so a reader needs nothing else):

* Every data file is cut into blocks of `block_size` bytes (the last one short). The blocks of
  all files, file after file, form one sequence of T blocks, which is cut into W *columns* of
  L = ceil(T / W) consecutive blocks. Stripe s is block s of every column (a column that has
  run out contributes zeros), plus K parity blocks computed from them.
* W is chosen so that no file is longer than a column: then a file covers any stripe at most
  once, and **any K whole files lost** (a missing shard, the `.distcp` of a dead rank) cost at
  most K blocks per stripe, which the code rebuilds; so do any K damaged blocks in a stripe.
  Parity is K * L blocks, about K / W of the checkpoint. When one file is more than half of
  the checkpoint (a single-file checkpoint), there is no such W > 1: the files are then
  striped within themselves over `SELF_WIDTH` columns, which protects against damaged
  blocks at K / W overhead but cannot bring back that file if it is lost outright
  (verify and repair say so).
* Parity share j (`parity-j.bin`) holds parity block j of every stripe, one after another.
  The manifest (`parity.index.json`, the commit marker: written last) records the code, every
  data file's size, sha256 and per-block XXH3-128 digests (damage is located to the block),
  and the same for the parity shares.

Codec: liberasurecode's ISA-L Cauchy Reed–Solomon through `pyeclib` (measured against zfec in
bench/bench_erasure.py; see the README). pyeclib wraps every fragment in a fixed 80-byte header
that depends only on the code and the fragment length, never on the content, so the parity
files store raw payloads and the headers are regenerated from a zero stripe when decoding.

Memory is two stripes: 2 × (W + K) blocks (the next stripe is read while one is encoded). Reads and writes go through `Storage` (local `pread`,
or fsspec ranged reads for `s3://`); outputs are staged and published with one rename (or, in
an object store, uploaded whole with the manifest last). Under torchrun, `protect` of a local
(shared-filesystem) checkpoint splits the stripes and the whole-file hashing across ranks; the
parity is byte-identical to a single process's. `repair`, and `protect` of an object store,
run on rank 0 while the others wait and report its result.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from .. import __version__
from ..distributed import active
from ..errors import DestinationExistsError, FormatError, NotFoundError, UsageError
from ..formats import resolve_source
from ..formats.base import Source
from ..output import TMP_MARKER, RemoteDest, fsync_dir, is_commit_marker, staged_output
from ..progress import NULL_PROGRESS, Progress
from ..storage import (
    PARITY_DIR,
    FsspecStorage,
    LocalStorage,
    Storage,
    is_parity_path,
    remote_failure,
    safe_relpath,
)

PARITY_VERSION = 1
#: the parity manifest; its `.index.json` suffix makes object-store uploads publish it last
MANIFEST_NAME = "parity.index.json"
#: the checksum manifest of `ckpt verify --write-manifest` is not protected (it is rewritten)
CHECKSUM_MANIFEST = "ckpt-manifest.json"
DEFAULT_PARITY = 2
DEFAULT_BLOCK_SIZE = 1 << 20
#: most data columns per stripe: repair of one block reads this many
MAX_WIDTH = 32
#: columns a checkpoint dominated by one file is striped over, within itself
SELF_WIDTH = 8
MAX_PARITY = 16
#: block sizes are whole pages (the codec's alignment; also keeps reads aligned)
BLOCK_ALIGN = 4096
CODEC = "pyeclib"
EC_TYPE = "isa_l_rs_cauchy"
#: blocks of the longest file at least (smaller blocks for small files: less padding)
MIN_BLOCKS_PER_FILE = 64
#: threads reading and hashing the blocks of one stripe (hashlib and xxhash release the GIL)
HASH_THREADS = min(8, max(2, os.cpu_count() or 2))
#: pyeclib fragment header size (checked against the library at start)
_HEADER = 80


# ------------------------------------------------------------------------------ models


class ProtectedFile(BaseModel):
    """One data file or parity share recorded in the parity manifest.

    Attributes:
        path: relative to the checkpoint root (parity shares: to the parity folder).
        size: bytes.
        sha256: hex digest of the whole file.
        start: index of its first block in the sequence of all blocks (data files).
        blocks: hex XXH3-128 digest of each block (the last one short).
    """

    path: str
    size: int
    sha256: str
    start: int = 0
    blocks: list[str] = Field(default_factory=list)


class ParityManifest(BaseModel):
    """The content of `.ckpt-parity/parity.index.json`.

    Attributes:
        ckpt_parity: file format version.
        codec / ec_type: the erasure code (pyeclib and its liberasurecode backend).
        created / tool: when and by which ckpt it was written.
        block_size: bytes per block.
        width: W, data blocks per stripe (columns).
        parity: K, parity blocks per stripe (parity shares); any K losses per stripe rebuild.
        stripes: L, blocks per column (and blocks per parity share).
        total_blocks: T, data blocks of all files together.
        whole_files: any K whole files lost can be rebuilt (False: striped within itself).
        files: the data files, in block order.
        shares: the parity shares `parity-0.bin` ... `parity-{K-1}.bin`.
    """

    ckpt_parity: int = PARITY_VERSION
    codec: str = CODEC
    ec_type: str = EC_TYPE
    created: str
    tool: str
    block_size: int
    width: int
    parity: int
    stripes: int
    total_blocks: int
    whole_files: bool
    files: list[ProtectedFile]
    shares: list[ProtectedFile]


class DamagedFile(BaseModel):
    """A file (data or parity share) found missing or damaged.

    Attributes:
        path: as shown to users (full path or URL).
        kind: `data` or `parity`.
        state: `missing`, `size_changed` (truncated or grown) or `corrupt`.
        blocks: indexes of the damaged blocks of this file.
        ranges: the damaged byte ranges `[start, end)` (adjacent blocks merged).
        repairable: every damaged block lies in a stripe with at most K losses.
    """

    path: str
    kind: Literal["data", "parity"]
    state: Literal["missing", "size_changed", "corrupt"]
    blocks: list[int] = Field(default_factory=list)
    ranges: list[tuple[int, int]] = Field(default_factory=list)
    repairable: bool = True


class ProtectReport(BaseModel):
    """The result of `ckpt protect`.

    Attributes:
        location: the checkpoint.
        parity_dir: where the parity was written.
        files / bytes: data files protected and their size.
        parity_bytes: size of the parity shares; overhead = parity_bytes / bytes.
        block_size / width / parity / stripes: the code's layout (see the module docstring).
        whole_files: any `parity` whole files lost can be rebuilt.
        codec: the erasure code used.
    """

    location: str
    parity_dir: str
    files: int
    bytes: int
    parity_bytes: int
    overhead: float
    block_size: int
    width: int
    parity: int
    stripes: int
    whole_files: bool
    codec: str


class RepairReport(BaseModel):
    """The result of `ckpt repair` (or its `--dry-run` plan).

    Attributes:
        location: the checkpoint.
        ok: nothing is left damaged (all was intact, or every damage was rebuilt).
        dry_run: only the plan; nothing was written.
        damaged: every damaged file found, with its blocks and whether it can be rebuilt.
        rebuilt: files rebuilt and published (verified against the manifest's sha256).
        unrecoverable: files that cannot be rebuilt (more than K losses in a stripe).
        hashed_bytes: bytes read and checked.
    """

    location: str
    ok: bool
    dry_run: bool = False
    damaged: list[DamagedFile] = Field(default_factory=list)
    rebuilt: list[str] = Field(default_factory=list)
    unrecoverable: list[str] = Field(default_factory=list)
    hashed_bytes: int = 0


# ------------------------------------------------------------------------------ codec


class Codec:
    """W + K Reed–Solomon over raw, equal-length blocks (pyeclib, headers kept aside)."""

    def __init__(self, width: int, parity: int, block_size: int, ec_type: str = EC_TYPE):
        from pyeclib.ec_iface import ECDriver

        try:
            self.driver = ECDriver(k=width, m=parity, ec_type=ec_type)
        except Exception as exc:  # a liberasurecode build without this backend
            raise UsageError(
                f"the erasure code {ec_type} is not available ({exc})",
                fix="Install pyeclib from its manylinux wheel (it bundles ISA-L).",
            ) from None
        self.width = width
        self.parity = parity
        self.block_size = block_size
        probe = self.driver.encode(bytes(width * block_size))
        if len(probe) != width + parity or any(
            len(f) != _HEADER + block_size for f in probe
        ):  # pragma: no cover - guards a change of liberasurecode's fragment format
            raise UsageError(f"pyeclib {ec_type} splits blocks in an unexpected way")
        self.headers = [bytes(f[:_HEADER]) for f in probe]

    def encode(self, blocks: list[bytes]) -> list[bytes]:
        """The K parity blocks of one stripe of W blocks."""
        fragments = self.driver.encode(b"".join(blocks))
        return [bytes(f[_HEADER:]) for f in fragments[self.width :]]

    def rebuild(self, shares: dict[int, bytes], wanted: list[int]) -> dict[int, bytes]:
        """Shares `wanted` (0..W-1 data, W.. parity) from at least W others of the stripe."""
        given = sorted(shares)[: self.width]
        fragments = [self.headers[i] + shares[i] for i in given]
        out = self.driver.reconstruct(fragments, wanted)
        return {i: bytes(f[_HEADER:]) for i, f in zip(wanted, out, strict=True)}


def _digest(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


# ------------------------------------------------------------------------------ where things are


@dataclass
class _Target:
    """A checkpoint as protect/repair see it: its storage, data files and parity folder."""

    source: Source
    storage: Storage
    #: data file name -> size (the parity folder and ckpt-manifest.json excluded)
    files: dict[str, int]
    #: the parity folder, relative to the storage root
    parity_rel: str

    @property
    def manifest_rel(self) -> str:
        return f"{self.parity_rel}/{MANIFEST_NAME}"


def _target(src: str) -> _Target:
    source = resolve_source(src)
    storage = source.storage
    if not isinstance(storage, LocalStorage | FsspecStorage):
        raise UsageError(
            "protect and repair work on local folders and object stores",
            path=source.location.raw,
            fix="Download the checkpoint first (`ckpt download`), then protect the copy.",
        )
    if source.target is not None:
        files = {source.target: source.files[source.target]}
        parity_rel = f"{PARITY_DIR}/{source.target}"
    else:
        files = {
            name: size
            for name, size in source.files.items()
            if name != CHECKSUM_MANIFEST and TMP_MARKER not in name
        }
        parity_rel = PARITY_DIR
    if not files:
        raise NotFoundError("holds no files to protect", path=source.location.raw)
    return _Target(source, storage, files, parity_rel)


def _parity_dest(target: _Target) -> Path | RemoteDest:
    storage = target.storage
    if isinstance(storage, LocalStorage):
        return storage.root / target.parity_rel
    assert isinstance(storage, FsspecStorage)
    return RemoteDest(
        url=storage.describe(target.parity_rel),
        fs=storage.fs,
        path=f"{storage.root}/{target.parity_rel}",
    )


def read_parity_manifest(target: _Target) -> ParityManifest | None:
    """The parity manifest of the checkpoint, or None when it is not protected."""
    storage = target.storage
    try:
        raw = storage.read_all(target.manifest_rel)
    except NotFoundError:
        return None
    try:
        manifest = ParityManifest.model_validate(json.loads(raw))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(
            f"is not a valid ckpt parity manifest ({str(exc).splitlines()[0]})",
            path=storage.describe(target.manifest_rel),
            fix="Protect the checkpoint again: `ckpt protect SRC --force`.",
        ) from None
    _check_manifest(manifest, storage.describe(target.manifest_rel))
    return manifest


def _check_manifest(m: ParityManifest, where: str) -> None:
    """Refuse manifests whose numbers do not add up (corrupt or hostile): no huge allocations."""
    bad = (
        m.ckpt_parity != PARITY_VERSION
        or m.codec != CODEC
        or not 1 <= m.width <= MAX_WIDTH
        or not 1 <= m.parity <= MAX_PARITY
        or m.block_size <= 0
        or m.block_size % BLOCK_ALIGN
        or m.block_size > 1 << 30
        or m.stripes < 1
        or len(m.shares) != m.parity
        or any(len(s.blocks) != m.stripes or s.size != m.stripes * m.block_size for s in m.shares)
    )
    # every name must stay inside the checkpoint (repair writes to these names)
    for f in m.files:
        if safe_relpath(f.path, source=where) != f.path or is_parity_path(f.path):
            bad = True
    if [s.path for s in m.shares] != [f"parity-{j}.bin" for j in range(len(m.shares))]:
        bad = True
    spans = []
    total = 0
    for f in m.files:
        n = -(-f.size // m.block_size)
        total += n
        if f.size < 0 or len(f.blocks) != n:
            bad = True
        if n:
            spans.append((f.start, f.start + n))
    spans.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        bad = True  # two files claim one block
    if spans and (spans[0][0] < 0 or spans[-1][1] > m.width * m.stripes):
        bad = True
    if bad or total != m.total_blocks:
        raise FormatError(
            "is not a consistent ckpt parity manifest",
            path=where,
            fix="Protect the checkpoint again: `ckpt protect SRC --force`.",
        )


# ------------------------------------------------------------------------------ layout


@dataclass
class _Plan:
    """Where every file's blocks go: W columns of L blocks; file i starts at block `starts[i]`
    of the column-major sequence (column c holds blocks c*L .. c*L+L-1)."""

    width: int
    stripes: int
    starts: list[int]
    whole_files: bool


def plan_layout(sizes: list[int], block_size: int) -> _Plan:
    """Place the files (see the module docstring): whole files in W columns when possible."""
    blocks = [-(-s // block_size) for s in sizes]
    total = sum(blocks)
    longest = max(blocks, default=0)
    if total == 0:
        return _Plan(1, 1, [0] * len(sizes), True)
    width = min(MAX_WIDTH, total // longest)
    if width >= 2:
        # longest first into the emptiest column (LPT): no file crosses a column, so a file
        # lost costs at most one block per stripe, and columns come out nearly even
        fill = [0] * width
        placed: dict[int, tuple[int, int]] = {}
        for i in sorted(range(len(sizes)), key=lambda i: (-blocks[i], i)):
            column = min(range(width), key=lambda c: (fill[c], c))
            placed[i] = (column, fill[column])
            fill[column] += blocks[i]
        stripes = max(fill)
        starts = [placed[i][0] * stripes + placed[i][1] for i in range(len(sizes))]
        return _Plan(width, stripes, starts, True)
    # one file is more than half of everything: stripe within it, the files one after another
    # (a one-block checkpoint gets W = 1: its parity blocks are copies)
    width = min(SELF_WIDTH, total)
    starts, at = [], 0
    for n in blocks:
        starts.append(at)
        at += n
    return _Plan(width, -(-total // width), starts, width == 1)


def _small_block(longest: int) -> int:
    """The largest power-of-two block with at least `MIN_BLOCKS_PER_FILE` in the longest file.

    Files are padded to whole blocks; with blocks this small the padding stays under ~2% of
    a small checkpoint (large checkpoints keep the requested size).
    """
    target = max(BLOCK_ALIGN, longest // MIN_BLOCKS_PER_FILE)
    return max(BLOCK_ALIGN, 1 << (target.bit_length() - 1))


def _parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    from ..sizes import parse_size

    return parse_size(text, option="--block-size")


@dataclass
class _Layout:
    """Block arithmetic of one manifest: which file and offset a stripe's column holds."""

    m: ParityManifest
    order: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # files holding blocks, by where they start (empty files hold none)
        self.order = sorted(
            (i for i, f in enumerate(self.m.files) if f.size), key=lambda i: self.m.files[i].start
        )
        self.starts = [self.m.files[i].start for i in self.order]

    def nblocks(self, fi: int) -> int:
        return -(-self.m.files[fi].size // self.m.block_size)

    def block(self, column: int, stripe: int) -> tuple[int, int] | None:
        """(file index, block index in that file) of one share of a stripe, or None (zeros)."""
        g = column * self.m.stripes + stripe
        k = bisect_right(self.starts, g) - 1
        if k < 0:
            return None
        fi = self.order[k]
        bi = g - self.m.files[fi].start
        return (fi, bi) if bi < self.nblocks(fi) else None

    def position(self, fi: int, bi: int) -> tuple[int, int]:
        """(column, stripe) of block `bi` of file `fi`."""
        g = self.m.files[fi].start + bi
        return g // self.m.stripes, g % self.m.stripes

    def extent(self, size: int, bi: int) -> tuple[int, int]:
        start = bi * self.m.block_size
        return start, min(size, start + self.m.block_size)


def _pad(data: bytes, size: int) -> bytes:
    return data if len(data) == size else data + bytes(size - len(data))


# ------------------------------------------------------------------------------ protect


M = TypeVar("M", bound=BaseModel)


def _on_leader(work: Callable[[], M], model: type[M]) -> M:
    """Run `work` on rank 0 only (under torchrun the others wait), the result on every rank.

    Every rank writing the same parity or rebuilding the same file would race on one staging
    name (a repair rebuilds a few files: one process suffices).
    """
    workers = active()
    result: M | None = None
    with workers.together():
        if workers.leader:
            result = work()
    if not workers.distributed:
        assert result is not None
        return result
    shared = workers.broadcast(result.model_dump(mode="json") if result is not None else None)
    return model.model_validate(shared)


def protect(
    src: str,
    *,
    parity: int = DEFAULT_PARITY,
    block_size: str | int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
    progress: Progress = NULL_PROGRESS,
) -> ProtectReport:
    """Write Reed–Solomon parity for the checkpoint at `src` into its parity folder.

    Args:
        src: checkpoint folder or file, local or an fsspec URL (`s3://...`).
        parity: K, losses per stripe that can be rebuilt (parity shares written).
        block_size: bytes per block (a size like `4MiB`); rounded up to whole 4 KiB pages.
        force: replace existing parity.
        progress: receives the bytes read.

    Raises:
        DestinationExistsError: the checkpoint is protected already (without `force`).
        UsageError: parity or block size out of range.
    """
    workers = active()
    if workers.distributed and resolve_source(src).location.kind == "local":
        return _protect_split(src, parity=parity, block_size=block_size, force=force)
    return _on_leader(
        lambda: _protect(src, parity=parity, block_size=block_size, force=force, progress=progress),
        ProtectReport,
    )


def _protect_split(src: str, *, parity: int, block_size: str | int, force: bool) -> ProtectReport:
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
        with workers.together():
            target, manifest = _prepare(
                src, parity=parity, block_size=block_size, force=force, check=workers.leader
            )
            dest = _parity_dest(target)
            assert isinstance(dest, Path)
            if workers.leader:
                dest.parent.mkdir(parents=True, exist_ok=True)
                staging = stack.enter_context(staged_output(dest, force=force))
                for j in range(parity):
                    with open(staging / f"parity-{j}.bin", "wb") as fh:
                        fh.truncate(manifest.stripes * manifest.block_size)
                shared = {"staging": str(staging), "manifest": manifest.model_dump(mode="json")}
        shared = workers.broadcast(shared)
        staging = Path(shared["staging"])
        # every rank works from rank 0's plan (one `created`, one layout)
        manifest = ParityManifest.model_validate(shared["manifest"])
        m = manifest
        layout = _Layout(m)
        storage = target.storage
        reader = _Reader(storage)
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
                            mine["blocks"].append([fi, bi, _digest(data)])
                            shares.append(_pad(data, m.block_size))
                        for j, par in enumerate(codec.encode(shares)):
                            _pwrite_all(fds[j], par, stripe * m.block_size)
                            mine["parity"].append([j, stripe, _digest(par)])
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
            hasher = _Reader(storage)
            try:
                for i in workers.mine(weights):
                    if i < len(m.files):
                        f = m.files[i]
                        mine["sha"][str(i)] = _sha256_storage(hasher, f.path, f.size)
                    else:
                        j = i - len(m.files)
                        mine["share_sha"][str(j)] = _sha256_file(staging / f"parity-{j}.bin")
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
                _check_unchanged(target)
                with open(staging / MANIFEST_NAME, "wb") as fh:
                    fh.write((json.dumps(m.model_dump(mode="json")) + "\n").encode())
                    fh.flush()
                    os.fsync(fh.fileno())
                stack.close()  # publish: the staging folder becomes the parity folder
                report = _report(target, m, dest).model_dump(mode="json")
    return ProtectReport.model_validate(workers.broadcast(report))


def _prepare(
    src: str, *, parity: int, block_size: str | int, force: bool, check: bool = True
) -> tuple[_Target, ParityManifest]:
    """Validate the options and plan the layout: the manifest without digests yet."""
    if not 1 <= parity <= MAX_PARITY:
        raise UsageError(f"--parity {parity} is out of range", fix=f"Use 1 to {MAX_PARITY}.")
    block = _parse_size(block_size)
    if not BLOCK_ALIGN <= block <= 1 << 30:
        raise UsageError(
            f"--block-size {block_size} is out of range", fix="Use 4KiB to 1GiB (e.g. 1MiB)."
        )
    block = -(-block // BLOCK_ALIGN) * BLOCK_ALIGN
    target = _target(src)
    storage = target.storage
    if check and not force and read_parity_manifest(target) is not None:
        raise DestinationExistsError(
            "is protected already",
            path=storage.describe(target.manifest_rel),
            fix="Check it with `ckpt verify SRC`, or pass --force to write new parity.",
        )
    names = list(target.files)
    sizes = [target.files[n] for n in names]
    block = min(block, _small_block(max(sizes)))
    plan = plan_layout(sizes, block)
    files = [
        ProtectedFile(path=name, size=size, sha256="", start=start)
        for name, size, start in zip(names, sizes, plan.starts, strict=True)
    ]
    manifest = ParityManifest(
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
    return target, manifest


def _report(target: _Target, m: ParityManifest, dest: Path | RemoteDest) -> ProtectReport:
    total = sum(f.size for f in m.files)
    parity_bytes = m.parity * m.stripes * m.block_size
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
    )


def _protect(
    src: str, *, parity: int, block_size: str | int, force: bool, progress: Progress
) -> ProtectReport:
    target, manifest = _prepare(src, parity=parity, block_size=block_size, force=force)
    storage = target.storage
    files = manifest.files
    sizes = [f.size for f in files]
    block, width, stripes = manifest.block_size, manifest.width, manifest.stripes
    layout = _Layout(manifest)
    codec = Codec(width, parity, block)
    hashers = [hashlib.sha256() for _ in files]
    #: the next block each file's sha256 expects; a file striped across columns arrives out
    #: of order and is hashed again sequentially afterwards
    expected = [0] * len(files)
    digests: list[list[str]] = [[""] * -(-f.size // block) for f in files]
    dest = _parity_dest(target)
    local_parent = dest.parent if isinstance(dest, Path) else None
    if local_parent is not None and not local_parent.exists():
        local_parent.mkdir(parents=True)
    reader = _Reader(storage)
    progress.start(sum(sizes), f"protecting (K={parity}, W={width})")
    try:
        with staged_output(dest, force=force) as staging:
            outs = [open(staging / f"parity-{j}.bin", "wb") for j in range(parity)]
            p_hash = [hashlib.sha256() for _ in range(parity)]
            p_digests: list[list[str]] = [[] for _ in range(parity)]
            try:
                pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ckpt-protect")

                def load(fi: int, bi: int, update: bool) -> bytes:
                    f = files[fi]
                    lo, hi = layout.extent(f.size, bi)
                    data = reader.read(f.path, lo, hi - lo)
                    if update:
                        hashers[fi].update(data)
                    digests[fi][bi] = _digest(data)
                    progress.advance(len(data))
                    return _pad(data, block)

                def submit(stripe: int) -> list[Future[bytes] | None]:
                    # decided here, in stripe order: whether a block continues its file's sha256
                    futures: list[Future[bytes] | None] = []
                    for c in range(width):
                        where = layout.block(c, stripe)
                        if where is None:
                            futures.append(None)
                            continue
                        fi, bi = where
                        update = expected[fi] == bi
                        expected[fi] = expected[fi] + 1 if update else -1
                        futures.append(pool.submit(load, fi, bi, update))
                    return futures

                zeros = bytes(block)
                try:
                    # stripe s+1 is read and hashed in threads while stripe s is encoded; a
                    # stripe's reads finish before the next stripe's start, so every file's
                    # sha256 sees its blocks in order
                    pending = submit(0)
                    for s in range(stripes):
                        shares = [zeros if f is None else f.result() for f in pending]
                        if s + 1 < stripes:
                            pending = submit(s + 1)
                        for j, par in enumerate(codec.encode(shares)):
                            outs[j].write(par)
                            p_hash[j].update(par)
                            p_digests[j].append(_digest(par))
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
                    else _sha256_storage(reader, f.path, f.size)
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
            _check_unchanged(target)
            with open(staging / MANIFEST_NAME, "wb") as fh:
                fh.write((json.dumps(manifest.model_dump(mode="json")) + "\n").encode())
                fh.flush()
                os.fsync(fh.fileno())
    finally:
        reader.close()
        progress.finish()
    return _report(target, manifest, dest)


def _check_unchanged(target: _Target) -> None:
    """Refuse to bless parity of files that changed size while they were read."""
    storage = target.storage
    if isinstance(storage, FsspecStorage):
        return  # listed once; objects are replaced whole, not rewritten in place
    for name, size in target.files.items():
        try:
            now = storage.size(name)
        except NotFoundError:
            now = -1
        if now != size:
            raise FormatError(
                "changed while it was being protected",
                path=storage.describe(name),
                fix="Protect the checkpoint once its writer has finished.",
            )


class _Reader:
    """Reads blocks, keeping local files open (one `pread` per block, no reopen)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        path = self.storage.local_path(rel) if isinstance(self.storage, LocalStorage) else None
        if path is None:
            return self.storage.read(rel, offset, length)
        with self._lock:  # blocks are read from several threads
            fd = self._fds.get(rel)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFoundError("file not found", path=str(path)) from None
                self._fds[rel] = fd
        data = os.pread(fd, length, offset)
        if len(data) != length:
            return self.storage.read(rel, offset, length)  # raises the truncation error
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            with suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self.storage.close()


# ------------------------------------------------------------------------------ scan


@dataclass
class _Scan:
    """What a scan found: bad blocks per file and per stripe."""

    manifest: ParityManifest
    #: (kind, index) -> state, bad block indexes
    damaged: dict[tuple[str, int], tuple[str, set[int]]] = field(default_factory=dict)
    hashed: int = 0

    def losses(self) -> dict[int, set[int]]:
        """stripe -> share indexes lost (0..W-1 columns, W.. parity)."""
        layout = _Layout(self.manifest)
        out: dict[int, set[int]] = {}
        for (kind, idx), (_state, blocks) in self.damaged.items():
            for bi in blocks:
                if kind == "data":
                    column, stripe = layout.position(idx, bi)
                    out.setdefault(stripe, set()).add(column)
                else:
                    out.setdefault(bi, set()).add(self.manifest.width + idx)
        return out

    def unrecoverable_stripes(self) -> set[int]:
        return {s for s, lost in self.losses().items() if len(lost) > self.manifest.parity}


def _scan(
    target: _Target, m: ParityManifest, *, checksums: bool, progress: Progress = NULL_PROGRESS
) -> _Scan:
    """Find missing, resized and (with `checksums`) corrupt blocks of data and parity files."""
    storage = target.storage
    scan = _Scan(m)
    entries: list[tuple[str, int, ProtectedFile, str]] = [
        ("data", i, f, f.path) for i, f in enumerate(m.files)
    ] + [("parity", j, s, f"{target.parity_rel}/{s.path}") for j, s in enumerate(m.shares)]
    listing = (
        storage.all_files() if isinstance(storage, FsspecStorage) else None  # local: stat each file
    )
    present: dict[str, int | None] = {}
    for _kind, _i, _f, rel in entries:
        if listing is not None:
            present[rel] = listing.get(rel)
        else:
            try:
                present[rel] = storage.size(rel)
            except NotFoundError:
                present[rel] = None
    if checksums:
        progress.start(sum(p or 0 for p in present.values()), "checking blocks (xxh3)")
    reader = _Reader(storage)
    try:
        for kind, i, f, rel in entries:
            size = present[rel]
            n = len(f.blocks)
            if size is None:
                scan.damaged[(kind, i)] = ("missing", set(range(n)))
                continue
            bad: set[int] = set()
            state = "size_changed" if size != f.size else "corrupt"
            if size != f.size:
                # blocks not wholly present are lost; those present are still checked below
                bad |= {bi for bi in range(n) if min(f.size, (bi + 1) * m.block_size) > size}
            if checksums or size != f.size:
                for bi in range(n):
                    if bi in bad:
                        continue
                    lo = bi * m.block_size
                    hi = min(f.size, lo + m.block_size)
                    data = reader.read(rel, lo, hi - lo)
                    scan.hashed += len(data)
                    progress.advance(len(data))
                    if _digest(data) != f.blocks[bi]:
                        bad.add(bi)
            if bad or size != f.size:
                scan.damaged[(kind, i)] = (state, bad)
    finally:
        reader.close()
        if checksums:
            progress.finish()
    return scan


def _ranges(blocks: set[int], size: int, block_size: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for bi in sorted(blocks):
        lo, hi = bi * block_size, min(size, (bi + 1) * block_size)
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _damage_list(target: _Target, scan: _Scan) -> list[DamagedFile]:
    m = scan.manifest
    bad_stripes = scan.unrecoverable_stripes()
    layout = _Layout(m)
    out = []
    for (kind, idx), (state, blocks) in sorted(scan.damaged.items()):
        if kind == "data":
            f = m.files[idx]
            where = target.storage.describe(f.path)
            stripes = {layout.position(idx, bi)[1] for bi in blocks}
        else:
            f = m.shares[idx]
            where = target.storage.describe(f"{target.parity_rel}/{f.path}")
            stripes = set(blocks)
        out.append(
            DamagedFile(
                path=where,
                kind="data" if kind == "data" else "parity",
                state=state,
                blocks=sorted(blocks),
                ranges=_ranges(blocks, f.size, m.block_size),
                repairable=not (stripes & bad_stripes),
            )
        )
    return out


#: damaged byte ranges shown per file before the rest are counted
MAX_RANGES = 4


def damage_text(d: DamagedFile) -> str:
    """One line about a damaged file: its state and the damaged byte ranges."""
    if d.state == "missing":
        what = "missing"
    else:
        shown = ", ".join(f"bytes {lo}-{hi}" for lo, hi in d.ranges[:MAX_RANGES])
        more = len(d.ranges) - MAX_RANGES
        what = ("size changed; " if d.state == "size_changed" else "corrupt: ") + (
            shown or "extra bytes past the recorded size"
        )
        if more > 0:
            what += f" (+{more} more ranges)"
    return f"{d.path}: {what}"


# ------------------------------------------------------------------------------ verify hook


class ParityCheck(BaseModel):
    """What `verify` learnt from the parity manifest (None when not protected).

    Attributes:
        manifest: where the parity manifest is.
        parity / width: K and W of the code.
        damaged: damaged or missing files with their byte ranges and repairability.
        stale: data files modified after the parity was written.
        unprotected: files added after the parity was written.
    """

    manifest: str
    parity: int
    width: int
    damaged: list[DamagedFile] = Field(default_factory=list)
    stale: list[str] = Field(default_factory=list)
    unprotected: list[str] = Field(default_factory=list)
    hashed_bytes: int = 0


def check_parity(
    src: str, *, checksums: bool, progress: Progress = NULL_PROGRESS
) -> ParityCheck | None:
    """For `verify`: the parity manifest checked against the files (None: not protected).

    Without `checksums` only presence and sizes are compared (and, locally, modification
    times: a file changed after `protect` makes the parity stale); with `checksums` every block
    is hashed and compared with its digest, which names the damaged byte ranges.
    """
    try:
        target = _target(src)
    except (UsageError, NotFoundError):
        return None
    m = read_parity_manifest(target)
    if m is None:
        return None
    storage = target.storage
    scan = _scan(target, m, checksums=checksums, progress=progress)
    report = ParityCheck(
        manifest=storage.describe(target.manifest_rel),
        parity=m.parity,
        width=m.width,
        damaged=_damage_list(target, scan),
        hashed_bytes=scan.hashed,
    )
    recorded = {f.path for f in m.files}
    if target.source.target is None:
        report.unprotected = [storage.describe(n) for n in target.files if n not in recorded]
    manifest_path = storage.local_path(target.manifest_rel)
    if manifest_path is not None:
        written = manifest_path.stat().st_mtime
        damaged = {d.path for d in report.damaged}
        for f in m.files:
            path = storage.local_path(f.path)
            where = storage.describe(f.path)
            with suppress(OSError):
                if path is not None and path.stat().st_mtime > written and where not in damaged:
                    report.stale.append(where)
    return report


# ------------------------------------------------------------------------------ repair


def repair(src: str, *, dry_run: bool = False, progress: Progress = NULL_PROGRESS) -> RepairReport:
    """Rebuild missing or corrupt files of a protected checkpoint, bit-exact, atomically.

    Every block of every file is checked against its digest; the damaged ones are rebuilt
    stripe by stripe from the surviving data and parity, each rebuilt file is checked against
    the manifest's sha256 in staging, then published with one rename per file (commit markers
    last). With more than K losses in a stripe nothing is changed and the report names the
    files that cannot be rebuilt (exit 1).

    Raises:
        NotFoundError: the checkpoint has no parity (run `ckpt protect` first).
        FormatError: a rebuilt file does not match its recorded sha256 (nothing published).
    """
    return _on_leader(lambda: _repair(src, dry_run=dry_run, progress=progress), RepairReport)


def _repair(src: str, *, dry_run: bool, progress: Progress) -> RepairReport:
    target = _target(src)
    m = read_parity_manifest(target)
    if m is None:
        raise NotFoundError(
            "has no parity to repair from",
            path=target.source.location.raw,
            fix="Protect checkpoints while they are intact: `ckpt protect SRC`.",
        )
    scan = _scan(target, m, checksums=True, progress=progress)
    report = RepairReport(
        location=target.source.location.raw,
        ok=True,
        dry_run=dry_run,
        damaged=_damage_list(target, scan),
        hashed_bytes=scan.hashed,
    )
    if not report.damaged:
        return report
    report.unrecoverable = [d.path for d in report.damaged if not d.repairable]
    if report.unrecoverable:
        report.ok = False
        return report
    if dry_run:
        report.ok = False  # damage remains until a real run
        return report
    with _repair_staging(target) as staging:
        staged = _rebuild(target, scan, staging, progress)
        _publish_repaired(target, staged)
    report.rebuilt = [d.path for d in report.damaged]
    return report


@contextmanager
def _repair_staging(target: _Target) -> Iterator[Path]:
    """A staging folder for rebuilt files: hidden in the parity folder (local: same filesystem,
    so publishing is a rename), or a local temporary folder for an object store."""
    storage = target.storage
    if isinstance(storage, LocalStorage):
        parent = storage.root / target.parity_rel
        folder = Path(tempfile.mkdtemp(prefix=f".repair{TMP_MARKER}", dir=parent))
    else:
        folder = Path(tempfile.mkdtemp(prefix=f".ckpt-repair{TMP_MARKER}"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rebuild(
    target: _Target, scan: _Scan, staging: Path, progress: Progress
) -> list[tuple[str, Path, ProtectedFile]]:
    """Write every damaged file whole into `staging`; each checked against its sha256."""
    m = scan.manifest
    layout = _Layout(m)
    codec = Codec(m.width, m.parity, m.block_size, m.ec_type)
    storage = target.storage
    reader = _Reader(storage)
    w = m.width
    damaged = scan.damaged
    # staged output files, pre-sized; good blocks are copied, bad ones come from the decoder
    staged: dict[tuple[str, int], tuple[str, Path, ProtectedFile, int]] = {}
    for n, (kind, idx) in enumerate(sorted(damaged)):
        f = m.files[idx] if kind == "data" else m.shares[idx]
        rel = f.path if kind == "data" else f"{target.parity_rel}/{f.path}"
        path = staging / f"{n}.part"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, f.size)
        staged[(kind, idx)] = (rel, path, f, fd)
    losses = scan.losses()
    total = sum(len(b) for _s, b in damaged.values()) * m.block_size
    progress.start(total, "rebuilding")
    try:
        for stripe in sorted(losses):
            lost = losses[stripe]
            shares: dict[int, bytes] = {}
            for c in range(w + m.parity):
                if len(shares) == w:
                    break
                if c in lost:
                    continue
                if c < w:
                    where = layout.block(c, stripe)
                    if where is None:
                        shares[c] = bytes(m.block_size)
                        continue
                    fi, bi = where
                    f = m.files[fi]
                    lo, hi = layout.extent(f.size, bi)
                    shares[c] = _pad(reader.read(f.path, lo, hi - lo), m.block_size)
                else:
                    lo = stripe * m.block_size
                    rel = f"{target.parity_rel}/{m.shares[c - w].path}"
                    shares[c] = reader.read(rel, lo, m.block_size)
            rebuilt = codec.rebuild(shares, sorted(lost))
            for c, data in rebuilt.items():
                if c < w:
                    where = layout.block(c, stripe)
                    if where is None:
                        continue
                    fi, bi = where
                    key: tuple[str, int] = ("data", fi)
                    lo, hi = layout.extent(m.files[fi].size, bi)
                else:
                    key, bi = ("parity", c - w), stripe
                    lo, hi = stripe * m.block_size, (stripe + 1) * m.block_size
                fd = staged[key][3]
                _pwrite_all(fd, data[: hi - lo], lo)
                progress.advance(hi - lo)
        # the intact blocks of damaged (not missing) files
        for key, (state, bad) in damaged.items():
            rel, _path, f, fd = staged[key]
            if state == "missing":
                continue
            for bi in range(len(f.blocks)):
                if bi in bad:
                    continue
                lo, hi = bi * m.block_size, min(f.size, (bi + 1) * m.block_size)
                _pwrite_all(fd, reader.read(rel, lo, hi - lo), lo)
        for _rel, _path, _f, fd in staged.values():
            os.fsync(fd)
    finally:
        for _rel, _path, _f, fd in staged.values():
            with suppress(OSError):
                os.close(fd)
        reader.close()
        progress.finish()
    out = []
    for rel, path, f, _fd in staged.values():
        digest = _sha256_file(path)
        if digest != f.sha256:
            raise FormatError(
                f"rebuilt from parity, but its sha256 {digest[:16]}… differs from the "
                f"manifest's {f.sha256[:16]}…; nothing was changed",
                path=storage.describe(rel),
                fix="The parity or the surviving files are damaged beyond their digests; "
                "restore this checkpoint from another copy.",
            )
        out.append((rel, path, f))
    return out


def _sha256_storage(reader: _Reader, rel: str, size: int) -> str:
    h = hashlib.sha256()
    for lo in range(0, size, 4 << 20):
        h.update(reader.read(rel, lo, min(4 << 20, size - lo)))
    return h.hexdigest()


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _publish_repaired(target: _Target, staged: list[tuple[str, Path, ProtectedFile]]) -> None:
    """Put each rebuilt file in place: data first, commit markers (index, .metadata) last."""
    storage = target.storage
    ordered = sorted(staged, key=lambda item: (is_commit_marker(item[0]), item[0]))
    for rel, path, _f in ordered:
        if isinstance(storage, LocalStorage):
            final = storage.root / rel
            final.parent.mkdir(parents=True, exist_ok=True)
            # a damaged file may be a link or read-only; replace the name, never write through it
            os.replace(path, final)
            fsync_dir(final.parent)
            continue
        assert isinstance(storage, FsspecStorage)
        key = f"{storage.root}/{rel}"
        tmp = f"{storage.root}/{target.parity_rel}/.repair{TMP_MARKER}{uuid.uuid4().hex[:12]}"
        try:
            # an object appears whole on upload; the copy makes the final key appear at once
            storage.fs.put_file(str(path), tmp)
            storage.fs.copy(tmp, key)
        except Exception as exc:
            raise remote_failure(exc, storage.describe(rel), writing=True) from None
        finally:
            with suppress(Exception):
                storage.fs.rm_file(tmp)
        with suppress(Exception):
            storage.fs.invalidate_cache(key)


def describe_layout(m: ParityManifest) -> dict[str, Any]:
    """The code parameters, for reports."""
    return {"width": m.width, "parity": m.parity, "block_size": m.block_size}
