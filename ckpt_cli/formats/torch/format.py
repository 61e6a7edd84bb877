"""torch: files written by `torch.save` (`.pt/.pth/.bin/.ckpt`), and sharded
`pytorch_model.bin.index.json` folders.

I/O strategy: a torch.save file is a zip of one pickle plus one record per storage. `open`
loads it (`torch_load`) with `torch.load(weights_only=True, mmap=True, map_location="cpu")`:
the pickle is unpickled by torch's restricted unpickler (nothing outside its allow-list can
run; a file that asks for anything else is refused with `UnsafeInputError`, exit 4) and
storages are memory-mapped, so listing dtypes and shapes reads no tensor data. Old (pre-1.6, non-zip) files cannot be
mapped; they are loaded whole, still with `weights_only=True`.

Nested containers are flattened to dotted names (`optimizer.state.0.exp_avg`); every entry
remembers its real key path (`TorchEntry.key_path`) so the writer can rebuild the exact
nesting. Leaves that are not tensors are `object` entries with their Python type and, for small
scalars, their value. numpy arrays and scalars (found in RNG states) are admitted as data, as
transformers and accelerate do; they cannot run code.

Remote files (the Hub, object stores) load with `map_location="meta"`: only the zip
directory and the pickle are fetched by ranged reads; reading a tensor then fetches its file
once (one file held at a time).

The pieces: `torch_load` (safe loading), `torch_flatten` (entries and key paths),
`torch_read` (`TorchCheckpoint`), `torch_write` (`TorchWriter`), `torch_zip` (the zip
container at byte level). This module keeps the format itself and the bin index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import CkptError, FormatError, NotFoundError
from ...findings import Findings, problem_from_error
from ...models import Entry, Problem
from ...storage import Storage
from .. import names
from ..base import Format, Source, WriteOptions, Writer
from ..details import TorchDetails
from ..weight_map import (
    BIN_INDEX_SUFFIX,
    ShardContents,
    check_index,
    find_index,
    read_index,
    report_bad_index,
    report_missing_shard,
    shards_to_check,
    tensors_by_shard,
)
from .flatten import TorchEntry, build_entries
from .load import is_zip, load_torch_file, object_allowlist
from .pickle_scan import MAX_SCAN_BYTES, beyond_torch_defaults, opcodes_torch_refuses
from .read import TorchCheckpoint, legacy_load_failures, read_plain
from .write import TorchWriter, shard_names

__all__ = [
    "BIN_INDEX_SUFFIX",
    "TORCH_SUFFIXES",
    "TorchCheckpoint",
    "TorchEntry",
    "TorchFormat",
    "TorchWriter",
    "find_bin_index",
    "load_torch_file",
    "object_allowlist",
    "read_bin_index",
    "shard_names",
]

#: file suffixes torch.save files usually carry
TORCH_SUFFIXES = names.TORCH_SUFFIXES

# --------------------------------------------------------------------------- index


def read_bin_index(storage: Storage, rel: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Read a `*.bin.index.json`: the same shape as the safetensors index."""
    return read_index(storage, rel)


def find_bin_index(source: Source) -> str | None:
    """The bin index to use: the target if it is one, else the single one in the root."""
    return find_index(source, BIN_INDEX_SUFFIX, "torch")


def _torch_files(source: Source) -> list[str]:
    return sorted(n for n in source.top_level() if n.endswith(TORCH_SUFFIXES))


# --------------------------------------------------------------------------- format


class TorchFormat(Format):
    """torch.save files, single or sharded with `pytorch_model.bin.index.json`."""

    name = "torch"
    title = "torch.save"
    writable = True
    single_file_suffixes = TORCH_SUFFIXES
    default_basename = "pytorch_model"
    index_suffix = BIN_INDEX_SUFFIX
    holds_objects = True
    refused_pickles_may_be_whole = True
    shards_by_size = True
    details_model = TorchDetails
    shard_names = staticmethod(lambda basename, count: shard_names(basename, count))

    @classmethod
    def detect(cls, source: Source) -> bool:
        if source.target is not None:
            target = source.target
            if target.endswith((*TORCH_SUFFIXES, BIN_INDEX_SUFFIX)):
                return True
            # accelerate writes torch.save files named `*.pkl`
            return target.endswith(".pkl") and is_zip(source.storage, target)
        top = source.top_level()
        safetensors = any(
            n.endswith((names.SAFETENSORS_SUFFIX, names.SAFETENSORS_INDEX_SUFFIX)) for n in top
        )
        if any(n.endswith(BIN_INDEX_SUFFIX) for n in top):
            # torch shards beside a safetensors checkpoint (many Hub repositories hold both
            # formats, each with its index) are the other copy: the safetensors are read, as
            # transformers loads them and as one `pytorch_model.bin` beside them is left
            return not safetensors
        # a folder is a torch checkpoint when its one torch file is the model, not a side file
        # of another format's training folder (those are the layouts' business)
        if ".metadata" in top and "common.pt" in top:
            # Megatron-Core torch_dist: common.pt is the non-sharded half of that DCP
            return False
        files = _torch_files(source)
        return len(files) == 1 and not safetensors

    @classmethod
    def open(cls, source: Source) -> TorchCheckpoint:
        storage = source.storage
        index_rel = find_bin_index(source)
        if index_rel is not None:
            weight_map, index_meta = read_bin_index(storage, index_rel)
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not storage.exists(shard):
                    raise NotFoundError(
                        f"the index names shard {shard!r}, which is missing",
                        path=storage.describe(index_rel),
                        fix="Fetch or copy the missing shard; `ckpt verify` lists every problem.",
                    )
        elif source.target is not None:
            shards, weight_map, index_meta = [source.target], None, {}
        else:
            shards, weight_map, index_meta = _torch_files(source), None, {}
            if len(shards) != 1:
                raise FormatError(
                    f"holds {len(shards)} torch.save files and no index",
                    path=source.location.raw,
                    fix="Point at one of the files.",
                )
        return TorchCheckpoint.load(source, shards, index_rel, weight_map, index_meta)

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> Writer:
        return TorchWriter(staging, plan, options)

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        """Every file loads with weights_only=True; a bin index agrees with its shards (the
        weight-map check the safetensors format runs too: same codes, same files blamed)."""
        storage = source.storage
        findings = Findings(strict=False)
        try:
            index_rel = find_bin_index(source)
        except CkptError as error:
            findings.error(error)
            return findings.problems
        if index_rel is None:
            try:
                with cls.open(source) as checkpoint:
                    files = [f.path for f in checkpoint.manifest.files]
            except FormatError as error:
                return [problem_from_error(error)]
            return default_loader_warnings(storage, files)
        try:
            weight_map, meta = read_bin_index(storage, index_rel)
        except CkptError as error:
            report_bad_index(findings, error)
            return findings.problems
        # unnamed shards of the same save are checked too (their tensors are "not in the
        # index"); other .bin files are not strays here: a training folder holds many
        listing = storage.list_files()
        names, _ = shards_to_check(index_rel, weight_map, listing)
        shards: dict[str, ShardContents] = {}
        by_shard = tensors_by_shard(weight_map)
        for shard in names:
            if shard not in listing and not storage.exists(shard):
                report_missing_shard(findings, storage, index_rel, by_shard.get(shard, []), shard)
                continue
            try:
                # as the checkpoint reads it: plain data without torch (a legacy shard of
                # uint16 tensors torch.load fails on too), anything else through torch.load
                remote = storage.local_path(shard) is None
                plain = None if remote else read_plain(storage, shard)
                obj = plain[0] if plain else load_torch_file(storage, shard, meta=remote)[0]
                entries, _, _ = build_entries(obj, shard, storage.describe(shard))
            except FormatError as error:
                findings.error(error)
                continue
            shards[shard] = ShardContents(
                {e.name: e.nbytes if e.kind == "tensor" else 0 for e in entries}
            )
        check_index(findings, storage, index_rel, weight_map, meta, shards)
        return findings.problems + default_loader_warnings(storage, sorted(shards))


def default_loader_warnings(storage: Storage, files: list[str]) -> list[Problem]:
    """A warning for each local torch.save file that PyTorch's default loader,
    `torch.load(weights_only=True)`, refuses although ckpt reads it: a legacy file its legacy
    loader fails on, a pickle of opcodes its unpickler lacks (protocol 3+), or one naming a global (an
    `argparse.Namespace`, a DeepSpeed loss scaler...) that ckpt admits as an inert record but
    torch's allow-list does not. Found by torch's own opcode scan, nothing is run. numpy's
    array globals are left out: the frameworks that save them (RNG states) allow-list them
    when they load. torch is imported only for a file whose pickle names a global beyond
    torch's defaults and numpy's arrays (read from its opcodes first), so plain verify of an
    ordinary checkpoint stays torch-free."""
    problems: list[Problem] = []
    for rel in files:
        local = storage.local_path(rel)
        if local is not None and not is_zip(storage, rel):
            problems.extend(_legacy_loader_warning(storage, rel))
            continue
        if local is None:
            continue
        stream = _data_pkl(local)
        opcodes = [] if stream is None else opcodes_torch_refuses(stream)
        if opcodes:
            where = storage.describe(rel)
            problems.append(
                _torch_load_warning(
                    where,
                    f"PyTorch's default loader, torch.load(weights_only=True), "
                    f"refuses this file: its pickle uses {', '.join(opcodes[:5])}, which torch's "
                    "weights_only unpickler does not implement (written with a pickle_protocol "
                    "above 2; ckpt reads it)",
                    fix=f"Re-save it with the default pickle protocol: `ckpt convert {where} "
                    "OUT.pt --to torch`.",
                )
            )
            continue
        if stream is not None and not beyond_torch_defaults(stream):
            continue
        import torch

        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(local)
        except Exception:  # a file torch cannot scan is reported by the load itself
            continue
        refused = sorted(n for n in names if not n.startswith("numpy."))
        if not refused:
            continue
        where = storage.describe(rel)
        problems.append(
            _torch_load_warning(
                where,
                f"PyTorch's default loader, torch.load(weights_only=True), "
                f"refuses this file: it needs {', '.join(refused[:5])}, which is not on torch's "
                "allow-list (ckpt reads it as inert data)",
                fix=f"Load it with torch.serialization.safe_globals([{refused[0]}, ...]) if "
                "you trust it, or re-save it without.",
            )
        )
    return problems


def _torch_load_warning(where: str, message: str, fix: str) -> Problem:
    """A `torch_load_refuses` warning about the file `where` (`default_loader_warnings`)."""
    return Problem(
        code="torch_load_refuses",
        severity="warning",
        file=where,
        message=f"{where}: {message}",
        fix=fix,
    )


def _legacy_loader_warning(storage: Storage, rel: str) -> list[Problem]:
    """The warning for a legacy (non-zip) file ckpt reads and torch.load cannot read back."""
    failures = legacy_load_failures(storage, rel)
    if not failures:
        return []
    where = storage.describe(rel)
    return [
        _torch_load_warning(
            where,
            f"PyTorch's loader, torch.load, cannot read this legacy (non-zip) "
            f"torch.save file back: its legacy-format reader fails on {', '.join(failures)} "
            "(ckpt reads it as saved)",
            fix=f"Re-save it in the zip format: `ckpt convert {where} OUT.pt --to torch` (or "
            "torch.save without _use_new_zipfile_serialization=False).",
        )
    ]


def _data_pkl(path: Path) -> bytes | None:
    """The pickle of a local torch.save zip (its `data.pkl`), or None when it cannot be read
    here (torch's scan then decides)."""
    import zipfile

    from ...budgets import read_member

    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not names:
                return None
            return read_member(archive, names[0], MAX_SCAN_BYTES, None)
    except Exception:
        return None
