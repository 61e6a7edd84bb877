"""PyTorch Distributed Checkpoint (DCP): a folder with `.metadata` and `__{rank}_{n}.distcp` files.

I/O strategy. `open` reads `.metadata` with a restricted unpickler (`metadata`, no torch,
nothing callable outside the DCP metadata classes) and the file listing; for the safetensors
serialization it also reads each `.distcp` file's embedded safetensors header (one small read
per file) to find where every chunk's raw bytes are. Every file name in `.metadata` goes through
`safe_relpath`/`Storage`. Reads move one chunk at a time: a raw chunk is read straight into a
tensor (`os.preadv` locally); so is a torch_save chunk whose blob holds one plain tensor (its
bytes located from the blob's zip directory and data.pkl, `torch_blob`); any other blob is
loaded with `torch.load(weights_only=True)`. `read_slice` touches only the chunks that overlap
the requested box and, for raw chunks split along dim 0, only the rows it needs.

Layouts, as torch 2.13's `FileSystemWriter` writes them:

* torch_save (default): each rank file holds its non-tensor items (a `torch.save` of the
  object each) and then one `torch.save` blob per tensor chunk; `storage_data` gives each
  item's (file, offset, length).
* safetensors (`FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`): each
  rank file holds its non-tensor items, then ONE safetensors blob (header + raw data) with
  every tensor chunk of that rank keyed by its fqn, and `DCP_SHARDING_INFO` metadata giving
  each chunk's offsets. `storage_data` points every tensor item at the start of that blob with
  the chunk's byte count as its length, so the real ranges come from the embedded header.
  (torch 2.13's own `FileSystemReader` cannot load this layout: it calls `torch.load` on it.)

Also read: `dcp.save(..., use_collectives=False)` folders (per-rank `__{r}.metadata`, merged)
and the per-rank `shard-NNNNN-model-…safetensors` files of `HuggingFaceStorageWriter(
save_distributed=True)` (no `.metadata`; chunk offsets from `DCP_SHARDING_INFO`).

Manifest: tensor entries carry `chunks` (box, file, byte range, `raw`); object entries carry
`file`, `offset` and `nbytes` of their stored `torch.save` blob, and `py_type`/`value` when the
blob holds plain Python data.

The writer streams chunks into `__{rank}_0.distcp` files (torch_save items as torch.save
containers written around the raw bytes, no torch.save) and writes `.metadata` last (with
torch's own classes, so `dcp.load` reads it).

Package layout (mirroring `torch.distributed.checkpoint`'s own split): `metadata` (the restricted
`.metadata` reader), `peek` (what a stored `torch.save` blob declares, without torch), `check`
(layout analysis and structural checks), `raw` (where raw chunk bytes lie), `hf_shards`,
`megatron`, `transforms` (zstd), `torch_blob` (torch_save items as raw bytes, both ways),
`torch_metadata` (`.metadata` with torch's classes), `format` (`DcpFormat`), `reader`
(`DcpCheckpoint`) and `writer` (`DcpWriter`).
"""

from .format import DcpFormat
from .layout import METADATA, SERIALIZATIONS, SUFFIX, InterruptedSaveError, rank_chunk, rank_file
from .reader import DcpCheckpoint
from .writer import DcpWriter

__all__ = [
    "METADATA",
    "SERIALIZATIONS",
    "SUFFIX",
    "DcpCheckpoint",
    "DcpFormat",
    "DcpWriter",
    "InterruptedSaveError",
    "rank_chunk",
    "rank_file",
]
