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
bench/bench_erasure.py; see docs/parity.md). pyeclib wraps every fragment in a fixed 80-byte header
that depends only on the code and the fragment length, never on the content, so the parity
files store raw payloads and the headers are regenerated from a zero stripe when decoding.

Memory of `protect` is two stripes: 2 × (W + K) blocks (the next stripe is read while one is
encoded). `verify --checksums` and `repair` never hold a block: they hash and decode
`codec.CHUNK` (1 MiB) slices of every block, so their memory is W + K slices whatever block size
a manifest gives; and a manifest must be the layout `protect` itself would write for its files'
sizes (block at most 1/64 of the longest file, the width and stripes `plan_layout` gives), so it
chooses neither the block size nor the width. Reads and writes go through `Storage` (local `pread`,
or fsspec ranged reads for `s3://`); outputs are staged and published with one rename (or, in
an object store, uploaded whole with the manifest last). Under torchrun, `protect` of a local
(shared-filesystem) checkpoint splits the stripes and the whole-file hashing across ranks; the
parity is byte-identical to a single process's. `repair`, and `protect` of an object store,
run on rank 0 while the others wait and report its result.
"""

from .model import (
    ParityCheck,
    ParityManifest,
    ProtectReport,
    RepairReport,
    damage_text,
    describe_layout,
)
from .protect import ProtectRequest, protect, protect_with
from .repair import RepairRequest, repair, repair_with
from .scan import check_parity
from .target import read_parity_manifest

__all__ = [
    "ParityCheck",
    "ParityManifest",
    "ProtectReport",
    "ProtectRequest",
    "RepairReport",
    "RepairRequest",
    "check_parity",
    "damage_text",
    "describe_layout",
    "protect",
    "protect_with",
    "read_parity_manifest",
    "repair",
    "repair_with",
]
