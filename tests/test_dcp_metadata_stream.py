"""The streamed `.metadata` writer (#30) gives the opcodes the pickler gave for the object
graph it replaced (kept below as the reference), less the PUTs of what is never fetched again
(`pickletools.optimize` of both is the same bytes), and torch reads them.

The reference is the writer before #30: stand-ins of torch's classes pickled with
`pickle.Pickler(protocol=2)` (the C pickler), then renamed to torch's globals. The inputs cover
what changes opcodes: the C pickler's batches of 1,000 (a full last batch and a batch of one),
memo indices past 255, chunked tensors, object entries, 0-dim shapes, offsets past 2**31,
names without a dot, with empty and one-character parts, non-ASCII names, ZStandard transforms
and planner data carried from a source.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import pickletools
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckpt_cli.formats.dcp.torch_metadata import metadata_bytes, write_metadata
from ckpt_cli.formats.dcp.transforms import ZSTD_DESCRIPTOR
from ckpt_cli.formats.torch.zip_write import Reduced, placeholder, torch_names
from ckpt_cli.models import Chunk, Entry

SAVE_ID = "0b8f4f0e-5a57-4d0e-9a53-1d6f00c0ffee"
_MD = "torch.distributed.checkpoint.metadata."
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"


def _newobj_reduce(self: Any, protocol: int) -> tuple[Any, ...]:
    return (copyreg.__newobj__, (type(self),), self.__dict__.get("_state"))  # type: ignore[attr-defined]


def _obj(target: str, state: Any = None) -> Any:
    cls: Any = placeholder(target)
    cls.__reduce_ex__ = _newobj_reduce
    obj = cls.__new__(cls)
    obj.__dict__["_state"] = state
    return obj


def _size(values: list[int]) -> Reduced:
    return Reduced(placeholder("torch.Size"), (tuple(int(v) for v in values),))


def reference_bytes(
    plan: list[Entry],
    layout: dict[str, list[Chunk]],
    results: dict[str, list[tuple[int, int] | None]],
    object_file: dict[str, str],
    compression: str | None,
    planner_data: Any,
) -> bytes:
    """The writer before #30 (the object graph, pickled), with a fixed save id."""
    used = {_MD + n for n in ("Metadata", "TensorStorageMetadata", "TensorProperties")}
    used |= {_MD + n for n in ("ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex")}
    used |= {_MD + "StorageMeta", _MD + "_MEM_FORMAT_ENCODING", _STORAGE_INFO, "torch.Size"}
    used.add("torch.serialization._get_layout")
    strided = Reduced(placeholder("torch.serialization._get_layout"), ("torch.strided",))
    contiguous = Reduced(placeholder(_MD + "_MEM_FORMAT_ENCODING"), (0,))
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    transforms = [ZSTD_DESCRIPTOR] if compression == "zstd" else None

    def info(rel: str, start: int, length: int) -> Any:
        state: dict[str, Any] = {"relative_path": rel, "offset": start, "length": length}
        if transforms is not None:
            state["transform_descriptors"] = transforms
        return _obj(_STORAGE_INFO, state)

    for entry in plan:
        found = results[entry.name]
        if entry.kind == "object":
            state_dict_metadata[entry.name] = _obj(_MD + "BytesStorageMetadata")
            start, length = found[0]  # type: ignore[misc]
            key = _obj(_MD + "MetadataIndex", {"fqn": entry.name, "offset": None, "index": None})
            storage_data[key] = info(object_file[entry.name], start, length)
            continue
        assert entry.dtype is not None
        dtype = placeholder("torch." + entry.dtype)
        used.add("torch." + entry.dtype)
        chunks = layout[entry.name]
        properties = _obj(_MD + "TensorProperties", (dtype, strided, False, contiguous, False))
        state_dict_metadata[entry.name] = _obj(
            _MD + "TensorStorageMetadata",
            {
                "properties": properties,
                "size": _size(entry.shape),
                "chunks": [
                    _obj(
                        _MD + "ChunkStorageMetadata",
                        {"offsets": _size(c.offsets), "sizes": _size(c.sizes)},
                    )
                    for c in chunks
                ],
            },
        )
        for index, (chunk, result) in enumerate(zip(chunks, found, strict=True)):
            assert result is not None
            key = _obj(
                _MD + "MetadataIndex",
                {"fqn": entry.name, "index": index, "offset": _size(chunk.offsets)},
            )
            storage_data[key] = info(chunk.file, result[0], result[1])
    if not isinstance(planner_data, dict):
        planner_data = {}
    planner_data = {
        name: planner_data.get(name, tuple(name.split("."))) for name in state_dict_metadata
    }
    storage_meta = {"checkpoint_id": None, "save_id": SAVE_ID, "load_id": None}
    metadata = _obj(
        _MD + "Metadata",
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": planner_data,
            "storage_data": storage_data,
            "storage_meta": _obj(_MD + "StorageMeta", {**storage_meta, "modules": []}),
            "version": "1.0.0",
        },
    )
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=2).dump(metadata)
    data = buffer.getvalue()
    named = {t for t in used if _marker(t) in data}
    return torch_names(data, named)


def same_pickle(got: bytes, expected: bytes) -> bool:
    """The same opcodes, but for PUTs never fetched and the memo's numbering."""
    return pickletools.optimize(got) == pickletools.optimize(expected)


def memoized_after(data: bytes) -> set[str]:
    """The opcodes whose result `data` memoizes (the opcode before each PUT)."""
    found: set[str] = set()
    previous = ""
    for opcode, _arg, _pos in pickletools.genops(data):
        if "PUT" in opcode.name:
            found.add(previous)
        previous = opcode.name
    return found


def _marker(target: str) -> bytes:
    cls = placeholder(target)
    return b"c" + cls.__module__.encode() + b"\n" + cls.__qualname__.encode() + b"\n"


Inputs = tuple[
    list[Entry], dict[str, list[Chunk]], dict[str, list[tuple[int, int] | None]], dict[str, str]
]


def _inputs(count: int, files: int = 3) -> Inputs:
    """A plan as the DCP writer holds it: `count` tensors (some chunked, some 0-dim, some of
    odd names) and a few object entries, spread over `files` data files."""
    plan: list[Entry] = []
    layout: dict[str, list[Chunk]] = {}
    results: dict[str, list[tuple[int, int] | None]] = {}
    object_file: dict[str, str] = {}
    file_names = [f"__{rank}_0.distcp" for rank in range(files)]
    odd = ["w", "a..b", "x.y.z", "model.layers.0.attn.wq.weight", "poids.é.ü", "层.权重", ".lead"]
    position = 0
    for i in range(count):
        name = odd[i] if i < len(odd) else f"layer.{i}.w"
        dtype = ("float32", "bfloat16", "int64", "float16")[i % 4]
        if i % 5 == 4:  # a 0-dim tensor
            shape: list[int] = []
            chunks = [Chunk([], [], file_names[i % files], 0, 0)]
        elif i % 7 == 3:  # chunked in two along dim 0
            shape = [8, 4]
            chunks = [
                Chunk([0, 0], [4, 4], file_names[i % files], 0, 0),
                Chunk([4, 0], [4, 4], file_names[(i + 1) % files], 0, 0),
            ]
        else:
            shape = [4]
            chunks = [Chunk([0], [4], file_names[i % files], 0, 0)]
        plan.append(Entry(name=name, dtype=dtype, shape=shape, nbytes=16))
        layout[name] = chunks
        found: list[tuple[int, int] | None] = []
        for _ in chunks:
            start = position + (2**33 if i == count - 1 else 0)
            found.append((start, 64 + i))
            position += 64 + i
        results[name] = found
    for j in range(3):
        name = f"extra.{j}" if j else "step"
        plan.append(Entry(name=name, kind="object", py_type="int", nbytes=10))
        object_file[name] = file_names[0]
        results[name] = [(position, 10)]
        position += 10
    return plan, layout, results, object_file


@pytest.mark.parametrize("count", [1, 2, 300, 997, 1999, 2500])
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.slow
def test_streamed_bytes_equal_the_pickled_graph(count: int, compression: str | None) -> None:
    plan, layout, results, object_file = _inputs(count)
    expected = reference_bytes(plan, layout, results, object_file, compression, None)
    got = metadata_bytes(plan, layout, results, object_file, compression, None, SAVE_ID)
    assert same_pickle(got, expected)
    # only strings, globals and the shared constants (`torch.strided`; the zstd descriptor
    # list) are memoized: no state dict, torch.Size or stand-in stays in a reader's memo
    assert memoized_after(got) <= {"BINUNICODE", "GLOBAL", "REDUCE", "EMPTY_LIST"}
    assert len(got) < len(expected)


def test_a_reader_keeps_no_per_entry_container_alive() -> None:
    """Unpickling the streamed `.metadata` frees each state dict and `torch.Size` argument as
    soon as it is used: at its peak the load holds little more than the metadata it returns
    (the pickled graph's memo kept every object until the end: twice that)."""
    import tracemalloc

    from ckpt_cli.formats.dcp.metadata import load_metadata

    plan, layout, results, object_file = _inputs(3000)
    data = metadata_bytes(plan, layout, results, object_file, None, None, SAVE_ID)
    tracemalloc.start()
    try:
        metadata = load_metadata(data, "x")
        live, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert metadata.state_dict_metadata["layer.8.w"].size == (4,)
    assert peak < 1.3 * live


def test_one_entry_and_no_entry() -> None:
    entry = Entry(name="only", dtype="float32", shape=[2], nbytes=8)
    layout = {"only": [Chunk([0], [2], "__0_0.distcp", 0, 0)]}
    results: dict[str, list[tuple[int, int] | None]] = {"only": [(0, 8)]}
    args: Inputs = ([entry], layout, results, {})
    assert same_pickle(
        metadata_bytes(*args, None, None, SAVE_ID), reference_bytes(*args, None, None)
    )
    assert same_pickle(
        metadata_bytes([], {}, {}, {}, None, None, SAVE_ID),
        reference_bytes([], {}, {}, {}, None, None),
    )


def _real_dcp(path: Path, count: int) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state: dict[str, Any] = {f"layer.{i}.w": torch.full((4,), float(i)) for i in range(count)}
        state["step"] = 7
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.slow  # 2-6 s: the fast loop stays under 3 minutes
def test_planner_data_of_a_real_save_and_torch_reads_it(tmp_path: Path) -> None:
    """A reshard carries the source's planner_data (unpickled by ckpt's own reader): the bytes
    still match, and torch's reader reads the written `.metadata`."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_cli.formats.dcp.metadata import load_metadata

    src = _real_dcp(tmp_path / "src", 1200)
    metadata_file = src / ".metadata"
    planner_data = load_metadata(metadata_file.read_bytes(), str(metadata_file)).planner_data
    plan, layout, results, object_file = _inputs(1200, files=1)
    plan = [e for e in plan if e.kind == "tensor"]
    got = metadata_bytes(plan, layout, results, object_file, None, planner_data, SAVE_ID)
    assert same_pickle(got, reference_bytes(plan, layout, results, object_file, None, planner_data))

    # torch's reader reads the streamed file
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".metadata", "wb") as fh:
        size = write_metadata(fh, plan, layout, results, object_file, None, None)
    assert size == (out / ".metadata").stat().st_size
    metadata = dcp.FileSystemReader(str(out)).read_metadata()
    assert metadata.state_dict_metadata["layer.8.w"].size == torch.Size([4])
    assert metadata.planner_data["a..b"] == ("a", "", "b")
    assert len(metadata.storage_data) == sum(len(c) for c in layout.values())
