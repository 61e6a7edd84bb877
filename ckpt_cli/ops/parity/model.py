"""The parity manifest and the reports of `protect`, `repair` and verify's parity check."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field

from ...models import Record
from ...storage import PARITY_MANIFEST

PARITY_VERSION = 1
#: the parity manifest; its `.index.json` suffix makes object-store uploads publish it last
MANIFEST_NAME = PARITY_MANIFEST
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
#: the erasure codes pyeclib names (`PyECLib_EC_Types`), ckpt's own first: a manifest naming
#: another is corrupt, not a backend to install
EC_TYPES = (
    EC_TYPE,
    "isa_l_rs_vand",
    "isa_l_rs_vand_inv",
    "isa_l_rs_lrc",
    "jerasure_rs_vand",
    "jerasure_rs_cauchy",
    "liberasurecode_rs_vand",
    "flat_xor_hd",
    "flat_xor_hd_3",
    "flat_xor_hd_4",
    "shss",
    "libphazr",
)
#: blocks of the longest file at least (smaller blocks for small files: less padding)
MIN_BLOCKS_PER_FILE = 64
#: the largest parity manifest read (as weight-map indexes are capped): a block's digest takes
#: 36 bytes of it, so this is 7 million blocks (7 TiB of checkpoint in 1 MiB blocks); `protect`
#: refuses to write a larger one (a larger --block-size makes it smaller)...
MAX_MANIFEST_BYTES = 256 << 20
#: ... and the most `[` and `{` it may hold (two per file and per parity share): a JSON of
#: nested or empty lists parses to ~100 bytes of objects per byte
MAX_MANIFEST_CONTAINERS = 1_000_000
#: bytes of the manifest per block digest (`"<32 hex>", `) and at most per file besides
MANIFEST_BYTES_PER_BLOCK = 36
MANIFEST_BYTES_PER_FILE = 256
#: threads reading and hashing the blocks of one stripe (hashlib and xxhash release the GIL)
HASH_THREADS = min(8, max(2, os.cpu_count() or 2))


# ------------------------------------------------------------------------------ models


class ProtectedFile(Record):
    """One data file or parity share recorded in the parity manifest.

    Attributes:
        path: relative to the checkpoint root (parity shares: to the parity folder).
        size: bytes.
        sha256: hex digest of the whole file.
        start: index of its first block in the sequence of all blocks (data files).
        blocks: hex XXH3-128 digest of each block (the last one short).
        mtime_ns: when the file was last written, as `protect` found it (a local data file;
            None for parity shares, objects, and manifests older than this field): `repair`
            dates a file it rebuilds so, so the save keeps its save time for `latest` and
            `prune`'s time rules.
    """

    path: str
    size: int
    sha256: str
    start: int = 0
    blocks: list[str] = Field(default_factory=list)
    mtime_ns: int | None = None


class ParityManifest(Record):
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
        folder_mtime_ns: the checkpoint folder's modification time when protected (a local
            folder; None otherwise, and in manifests older than this field): a repair that
            put back a deleted file dates the folder so again.
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
    folder_mtime_ns: int | None = None


class DamagedFile(Record):
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


class ProtectReport(Record):
    """The result of `ckpt protect`.

    Attributes:
        location: the checkpoint.
        parity_dir: where the parity was written.
        files / bytes: data files protected and their size.
        parity_bytes: size of the parity shares; overhead = parity_bytes / bytes.
        block_size / width / parity / stripes: the code's layout (see the module docstring).
        whole_files: any `parity` whole files lost can be rebuilt.
        codec: the erasure code used.
        rank_files: files one rank of a distributed save wrote (`.distcp`, ZeRO partitions,
            per-rank RNG); with two or more, whole files are protected by default.
        largest_file / largest_bytes: the longest data file; protecting whole files makes
            each parity share at least this long.
        survives / does_not_survive: what the parity can and cannot rebuild, in words.
        dry_run: only the plan; nothing was written.
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
    rank_files: int = 0
    largest_file: str = ""
    largest_bytes: int = 0
    survives: list[str] = Field(default_factory=list)
    does_not_survive: list[str] = Field(default_factory=list)
    dry_run: bool = False


class RepairReport(Record):
    """The result of `ckpt repair` (or its `--dry-run` plan).

    Attributes:
        location: the checkpoint.
        ok: nothing is left damaged (all was intact, or every damage was rebuilt).
        dry_run: only the plan; nothing was written.
        damaged: every damaged file found, with its blocks and whether it can be rebuilt.
        rebuilt: files rebuilt and published (verified against the manifest's sha256).
        unrecoverable: files that cannot be rebuilt (more than K losses in a stripe).
        rewritten: files written again rather than rebuilt (would be, in a dry run): the
            checksum manifest beside the protected files (`ckpt-manifest.json`, which the
            parity does not cover) when it was no longer readable, written from the parity's
            sha256 of each file once every file was found intact.
        redated: intact files dated after `protect` (every block as recorded: touched or
            copied without their times, not changed) whose time was set back to when
            `protect` found them (would be, in a dry run), so `verify` no longer calls them
            stale (`parity_stale`), a warning `repair` could otherwise never clear.
        hashed_bytes: bytes read and checked.
        warnings: what to know about the repair: a damaged file modified after `protect` is
            restored to its content as of `protect` (a deliberate edit would be undone), or
            left as it is when the damage is beyond the parity.
    """

    location: str
    ok: bool
    dry_run: bool = False
    damaged: list[DamagedFile] = Field(default_factory=list)
    rebuilt: list[str] = Field(default_factory=list)
    unrecoverable: list[str] = Field(default_factory=list)
    rewritten: list[str] = Field(default_factory=list)
    redated: list[str] = Field(default_factory=list)
    hashed_bytes: int = 0
    warnings: list[str] = Field(default_factory=list)


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


class ParityCheck(Record):
    """What `verify` learnt from the parity manifest (None when not protected).

    Attributes:
        manifest: where the parity manifest is.
        parity / width: K and W of the code.
        damaged: damaged or missing files with their byte ranges and repairability.
        misrecorded: files the parity manifest misrecords, one line each: their block digests
            or size in the manifest differ from the file, whose sha256 matches the manifest's
            (the manifest is damaged; the file is intact and is not reported damaged).
        stale: data files modified after the parity was written.
        unprotected: files added after the parity was written.
    """

    manifest: str
    parity: int
    width: int
    damaged: list[DamagedFile] = Field(default_factory=list)
    misrecorded: list[str] = Field(default_factory=list)
    stale: list[str] = Field(default_factory=list)
    unprotected: list[str] = Field(default_factory=list)
    hashed_bytes: int = 0


def describe_layout(m: ParityManifest) -> dict[str, Any]:
    """The code parameters, for reports."""
    return {"width": m.width, "parity": m.parity, "block_size": m.block_size}
