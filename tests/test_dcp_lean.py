"""`.metadata` read lean (#30): torch's per-chunk records are rewritten before unpickling so the
memo keeps no state dict and no Size argument tuple per chunk, and what is read is what the
plain restricted unpickler (and torch) read. Only records on opcodes are rewritten: the same
bytes inside a string or a bytes value stay as they are; nothing rewritten calls anything.
Nothing here measures time or memory (`bench/bench_scale_dcp.py` does).
"""

from __future__ import annotations

import pickle
import pickletools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.errors import FormatError
from ckpt_cli.formats.dcp import lean
from ckpt_cli.formats.dcp.metadata import MetadataUnpickler, load_metadata


def _torch_metadata(tensors: int, chunks: int, planner: dict[str, Any] | None = None) -> bytes:
    """A `.metadata` pickled as `dcp.save` pickles it (torch's classes, `pickle.dumps`):
    `tensors` row-sharded tensors of `chunks` chunks each, 4-D norms, one object entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    files = [f"__{rank}_0.distcp" for rank in range(4)]  # a record naming a file first is not lean
    for t in range(tensors):
        for fqn, sizes in ((f"layers.{t}.w", [300, 16384]), (f"layers.{t}.g", [2, 3, 4, 5])):
            listed = []
            for rank in range(chunks):
                offsets = [rank * sizes[0], *[0] * (len(sizes) - 1)]
                listed.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                storage[MetadataIndex(fqn, torch.Size(offsets), rank)] = _StorageInfo(
                    files[rank % 4], 2**33 + t * 70_000 + rank, 9_830_400 + rank
                )
            shape = [sizes[0] * chunks, *sizes[1:]]
            state[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), torch.Size(shape), listed
            )
    state["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo(files[0], 0, 7)
    return pickle.dumps(Metadata(state, planner or {}, storage))


def _plain(data: bytes) -> Any:
    """The restricted unpickler on the bytes as they are (no lean rewrite)."""
    return MetadataUnpickler(data, "plain").load()


def test_torch_metadata_reads_the_same_lean_and_keeps_no_state_dicts() -> None:
    data = _torch_metadata(tensors=3, chunks=40)
    blocks, why = lean.lean_records(data)
    rewritten = b"".join(blocks)
    assert why is None and len(rewritten) == len(data) and rewritten != data

    md = load_metadata(data, "lean")
    assert repr(md) == repr(_plain(data))
    chunks = md.state_dict_metadata["layers.2.w"].chunks
    assert [(c.offsets, c.sizes) for c in chunks[:2]] == [
        ((0, 0), (300, 16384)),
        ((300, 0), (300, 16384)),
    ]
    info = md.storage_data[
        next(k for k in md.storage_data if k.key() == ("layers.2.g", (39 * 2, 0, 0, 0)))
    ]
    assert (info.relative_path, info.offset, info.length) == (
        "__3_0.distcp",
        2**33 + 140_039,
        9_830_439,
    )

    def memo_of(raw: bytes, walked: bool) -> list[Any]:
        unpickler = MetadataUnpickler(raw, "memo", walked=walked)
        unpickler.load()
        return list(unpickler.memo.copy().values())

    # per chunk, the plain load keeps three (emptied) state dicts and three argument tuples;
    # the lean one none: what is left are the records that are not per chunk (tensors, the
    # first of each kind, those naming a file first)
    chunk_count = 3 * 2 * 40

    def garbage(memo: list[Any]) -> tuple[int, int]:
        dicts = sum(type(v) is dict for v in memo)
        arguments = sum(type(v) is tuple and len(v) == 1 and type(v[0]) is tuple for v in memo)
        return dicts, arguments

    dicts, arguments = garbage(memo_of(data, walked=False))
    assert dicts > 3 * chunk_count and arguments > 3 * chunk_count
    dicts, arguments = garbage(memo_of(rewritten, walked=True))
    assert dicts < 20 and arguments < 20


def test_a_dcp_save_reads_as_torch_reads_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {f"layers.{i}.w": torch.randn(64, 32) for i in range(5)}
    state["norm"] = torch.zeros(2, 3, 4, 5)
    state["scalar"] = torch.tensor(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, "extra": {"epoch": 4}}, checkpoint_id=str(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    assert b"".join(lean.lean_records(data)[0]) != data

    md = load_metadata(data, "lean")
    theirs = FileSystemReader(str(tmp_path)).read_metadata()
    for fqn, item in theirs.state_dict_metadata.items():
        mine = md.state_dict_metadata[fqn]
        if hasattr(item, "chunks"):
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks] == [
                (c.offsets, c.sizes) for c in mine.chunks
            ]
    ours = {k.key(): (v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    assert ours == {
        (k.fqn, None if k.offset is None else tuple(k.offset)): (
            v.relative_path,
            v.offset,
            v.length,
        )
        for k, v in theirs.storage_data.items()
    }


def test_records_inside_a_bytes_value_are_left_as_they_are() -> None:
    """The bytes of a run of records, held as a value (a planner's bytes), are not opcodes:
    the walk does not find the run on an opcode, and the value comes back byte for byte."""
    records = _torch_metadata(tensors=1, chunks=4)
    run = next(lean._RUN.finditer(records))[0]
    held = {"layers.0.w": (b"x" + run, run, run * 3)}
    data = _torch_metadata(tensors=1, chunks=4, planner=held)
    assert data.count(run) >= 5  # the held copies, and the run itself
    md = load_metadata(data, "lean")
    assert md.planner_data == held
    assert repr(md) == repr(_plain(data))


def _memo_index_of(data: bytes, module: str, name: str) -> int:
    """The memo index of the global `module.name` in a protocol-4 pickle."""
    memo: list[Any] = []
    pushed: list[Any] = []  # what each opcode that pushed one thing pushed (None: not tracked)
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "SHORT_BINUNICODE":
            pushed.append(arg)
        elif opcode.name in ("BINGET", "LONG_BINGET"):
            pushed.append(memo[arg])
        elif opcode.name == "STACK_GLOBAL":
            pushed.append(("global", *pushed[-2:]))
        elif opcode.name == "MEMOIZE":
            memo.append(pushed[-1] if pushed else None)
        else:
            pushed.append(None)
    return memo.index(("global", module, name))


@pytest.mark.parametrize("swap", ["_get_layout", "ChunkStorageMetadata"])
def test_a_record_whose_size_is_not_torch_size_is_refused(swap: str) -> None:
    """A record of the shape that is rewritten, calling something else than `torch.Size` where
    torch calls it: the rewrite calls nothing, and the load refuses it."""
    data = _torch_metadata(tensors=1, chunks=6)
    size = _memo_index_of(data, "torch", "Size")
    other = _memo_index_of(
        data,
        "torch.serialization" if swap == "_get_layout" else "torch.distributed.checkpoint.metadata",
        swap,
    )
    assert size < 256 and other < 256
    # every fetch of torch.Size in the runs that are rewritten now fetches the other global
    hostile = bytearray(data)
    runs = [m.span() for m in lean._RUN.finditer(data)]
    for start, end in runs[1:]:
        chunk = bytes(hostile[start:end]).replace(bytes((0x68, size)), bytes((0x68, other)))
        hostile[start:end] = chunk
    with pytest.raises(FormatError, match="DCP metadata pickle"):
        load_metadata(bytes(hostile), "hostile")


@pytest.mark.parametrize("block", [1, 7, 300, 1 << 20])
def test_read_in_blocks_of_any_size_as_in_one_piece(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unpickler reads the pickle in blocks let go as they are read: torch's pickle and
    ckpt's own (protocol 2, its globals as lines) read the same wherever the blocks end."""
    from ckpt_cli.formats.dcp.torch_metadata import metadata_bytes
    from ckpt_cli.models import Chunk, Entry

    monkeypatch.setattr(lean, "BLOCK", block)
    chunks = [
        Chunk(
            offsets=[r * 3, 0], sizes=[3, 5], file=f"__{r}_0.distcp", byte_offset=64, byte_length=60
        )
        for r in range(4)
    ]
    entry = Entry(
        name="w", kind="tensor", dtype="float32", shape=[12, 5], nbytes=240, chunks=chunks
    )
    ours = metadata_bytes([entry], {"w": chunks}, {"w": [(64, 60)] * 4}, {}, None, None, "id")
    for data in (_torch_metadata(tensors=2, chunks=5), ours):
        assert repr(load_metadata(data, "blocks")) == repr(_plain(data))
