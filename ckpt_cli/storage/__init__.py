"""Byte access to a checkpoint's files, local or remote, confined to the checkpoint root.

Formats read through a `Storage` and never build paths themselves, so that

* every file name taken from an input (index `weight_map`, DCP `relative_path`) is checked
  to stay inside the root (`safe_relpath`), and
* the same format code reads local folders (`os.pread`, no full reads) and remote ones
  (fsspec ranged reads on S3, GCS...; HTTP range requests on the Hugging Face Hub).

Each storage has a read side and, where it declares `writable`, a write side (`write_file`,
`put`, `copy`, `remove`, `stat_files`, `destination`): operations choose from what a storage
declares, never from its class.

Modules: `base` (the `Storage` interface and its capability declarations), `local` (folders
on this machine), `remote` (fsspec filesystems: object stores; `remote_replies` reads what they answer), `hub` (Hugging Face Hub
repositories, read-only; imported on demand, not re-exported here), `output` (atomic outputs
to a local or object-store destination).
"""

from .base import (
    PARITY_DIR,
    PARITY_MANIFEST,
    STAGING_MARKERS,
    FileStat,
    RangeFile,
    RemoteFile,
    Storage,
    StorageRangeFile,
    is_parity_path,
    is_staging_name,
)
from .local import (
    LocalStorage,
    file_version,
    hf_cache_repo,
    open_regular,
    read_regular,
    real_path,
)
from .relpath import safe_relpath
from .remote import FsspecStorage, filesystem_for, literal
from .remote_replies import remote_failure

__all__ = [
    "PARITY_DIR",
    "PARITY_MANIFEST",
    "STAGING_MARKERS",
    "FileStat",
    "FsspecStorage",
    "LocalStorage",
    "RangeFile",
    "RemoteFile",
    "Storage",
    "StorageRangeFile",
    "file_version",
    "filesystem_for",
    "hf_cache_repo",
    "is_parity_path",
    "is_staging_name",
    "literal",
    "open_regular",
    "read_regular",
    "real_path",
    "remote_failure",
    "safe_relpath",
]
