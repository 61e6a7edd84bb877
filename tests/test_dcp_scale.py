"""DCP metadata at scale (#30): work done once per checkpoint, not once per check or per chunk.

`verify` checks a DCP folder and then opens it (for its object and quantization checks): one
parse of `.metadata` serves both. The torch_save chunk heads it reads are read file by file,
one open each, and chunks declaring the same tensor pickle are unpickled once. The pickle memo
scan that guards every unpickling steps over plain opcodes in C: it must judge exactly as the
opcode-by-opcode walk does. Sources are written by `dcp.save`; nothing here measures time.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import warnings
from pathlib import Path

import pytest
import torch

from ckpt_cli import budgets
from ckpt_cli.formats import resolve_source
from ckpt_cli.formats.dcp import DcpFormat
from ckpt_cli.formats.dcp import peek as peek_module
from ckpt_cli.ops.verify.run import verify
from ckpt_cli.storage import local as local_storage


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def same_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 tensors of one dtype and shape (their chunks pickle the same declaration) and 2 others."""
    state = {f"layers.{i}.w": torch.full((8, 4), float(i)) for i in range(40)}
    state["head.w"] = torch.zeros(3, 5, dtype=torch.bfloat16)
    state["step"] = torch.tensor(7)
    return _save(tmp_path_factory.mktemp("scale") / "dcp", state)


def test_check_then_open_parses_metadata_once(
    same_shapes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = resolve_source(str(same_shapes))
    reads: list[str] = []
    read_all = type(source.storage).read_all

    def counting(self: local_storage.LocalStorage, rel: str) -> bytes:
        reads.append(rel)
        return read_all(self, rel)

    monkeypatch.setattr(type(source.storage), "read_all", counting)
    assert DcpFormat.check(source) == []
    with DcpFormat.open(source) as checkpoint:
        shared = checkpoint.manifest.model_dump()
    assert reads == [".metadata"]
    # the shared parse yields what a parse of its own does
    with DcpFormat.open(resolve_source(str(same_shapes))) as fresh:
        assert fresh.manifest.model_dump() == shared
    assert reads == [".metadata", ".metadata"]


def test_chunk_heads_are_read_with_one_open_per_file(
    same_shapes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    open_regular = local_storage.open_regular

    def counting(path: object, where: str | None = None) -> int:
        opened.append(Path(str(path)).name)
        return open_regular(path, where)  # type: ignore[arg-type]

    monkeypatch.setattr(local_storage, "open_regular", counting)
    source = resolve_source(str(same_shapes))
    assert DcpFormat.check(source) == []
    data_files = [name for name in opened if name.endswith(".distcp")]
    # the raw-serialization probe reads the first item of the file; the heads take one open
    assert len(data_files) <= 2, data_files


def test_same_declarations_are_unpickled_once_and_each_chunk_still_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"layers.{i}.w": torch.full((8, 4), float(i)) for i in range(20)}
    path = _save(tmp_path / "dcp", state)
    cache: dict[bytes, object] = {}
    monkeypatch.setattr(peek_module, "_DECLARED", cache)
    assert verify(str(path)).ok
    assert len(cache) == 1  # twenty chunks, one (float32, [8, 4]) declaration
    # a chunk whose pickle says otherwise is judged on its own bytes, not the cached ones
    blob = path / "__0_0.distcp"
    data = bytearray(blob.read_bytes())
    # the shape (8, 4) pickles as `K\x08K\x04\x86` (BININT1 8, BININT1 4, TUPLE2)
    at = data.rfind(b"K\x08K\x04\x86")
    assert at > 0
    data[at + 1] = 2  # the last chunk written now declares [2, 4]
    blob.write_bytes(bytes(data))
    report = verify(str(path))
    mismatches = [p for p in report.problems if p.code == "dcp_mismatch"]
    assert len(mismatches) == 1 and "float32[2, 4]" in mismatches[0].message, report.problems


def _stepwise_overreach(
    data: bytes, complete: bool = True, starts: list[int] | None = None
) -> str | None:
    """The memo scan one opcode at a time (the walk before #30), the reference for the C runs;
    each opcode's position goes into `starts` when given."""
    fixed, variable = budgets._FIXED, budgets._VARIABLE
    n, pos = len(data), 0
    while pos < n:
        if starts is not None:
            starts.append(pos)
        op = data[pos]
        width = fixed[op]
        if width is not None:
            if op == budgets._LONG_BINPUT and pos + 5 <= n:
                index = int.from_bytes(data[pos + 1 : pos + 5], "little")
                if index > budgets._memo_budget(pos):
                    return budgets._memo_text(index, pos, n)
            elif op == budgets._STOP:
                return None
            pos += 1 + width
            continue
        how = variable[op]
        if how is None:
            return None
        if how in (pickletools.UP_TO_NEWLINE, budgets._TWO_LINES):
            end = data.find(b"\n", pos + 1)
            if how == budgets._TWO_LINES and end >= 0:
                end = data.find(b"\n", end + 1)
            if end < 0:
                return None
            if op == budgets._PUT:
                try:
                    index = int(data[pos + 1 : end])
                except ValueError:
                    return None
                if index > budgets._memo_budget(pos):
                    return budgets._memo_text(index, pos, n)
            pos = end + 1
            continue
        width = budgets._COUNT_WIDTH[how]
        length = int.from_bytes(
            data[pos + 1 : pos + 1 + width],
            "little",
            signed=how == pickletools.TAKEN_FROM_ARGUMENT4,
        )
        if length < 0:
            return None
        start = pos + 1 + width
        if length > n - start and complete:
            return (
                f"an argument of {length:,} bytes at byte {pos:,}, with {max(n - start, 0):,} "
                "bytes left"
            )
        pos = start + length
    return None


@pytest.mark.slow
def test_memo_scan_judges_as_the_opcode_walk() -> None:
    values = [
        {"a": [1, 2, 3.5, "x" * 300, b"y" * 300, (1, 2)], "b": {1, 2}, "c": None, "d": 2**70},
        [{f"k{i}": i * 1000, "r": "layers"} for i in range(60)],
        ("r" * 10, -1, 65536, 1.5e300, frozenset({"p"})),
    ]
    corpus = [pickle.dumps(v, protocol=p) for v in values for p in range(6)]
    # the attacks the scan exists for: a far memo index, a length past the end
    corpus += [
        b"\x80\x02Nr\xff\xff\xff\x0f.",
        b"\x80\x02Np268435455\n.",
        b"\x80\x04X\xff\xff\xff\x7f",
    ]
    rng = random.Random(30)
    flagged = 0
    for case in range(6000):
        data = bytearray(corpus[case % len(corpus)])
        for _ in range(rng.randint(0, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            del data[rng.randrange(len(data) + 1) :]
        for complete in (True, False):
            starts: list[int] = []
            want = _stepwise_overreach(bytes(data), complete, starts)
            assert budgets.pickle_overreach(bytes(data), complete) == want, bytes(data)
            flagged += want is not None
            # the walk asked where opcodes start (empty spans: nothing stepped over) answers
            # for each position as the stepwise walk does
            asked = sorted(rng.sample(range(len(data) + 1), min(8, len(data) + 1)))
            at: list[int] = []
            spans = [(p, p) for p in asked]
            why = budgets.walk_pickle(
                bytes(data), complete, spans, lambda s, e, at=at: at.append(s)
            )
            assert why == want, bytes(data)
            assert at == [p for p in asked if p in set(starts)], bytes(data)
    assert flagged > 100  # the corpus does reach the refusals, not only the clean ends


@pytest.mark.slow
def test_object_budget_admits_any_metadata_torch_writes_up_to_the_byte_budget() -> None:
    """A `.metadata` as torch pickles it, at its objects per byte, fits the object budget all
    the way to the byte budget (a 2,048-rank FSDP x TP save of a 405B model is 1.9M chunks)."""
    import gc

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckpt_cli.formats.dcp import metadata as dcp_metadata

    state, storage = {}, {}
    for t in range(20):
        fqn = f"model.layers.{t}.feed_forward.w1.weight"
        chunks = []
        for rank in range(1000):
            offsets, sizes = torch.Size([rank * 53, 0]), torch.Size([53, 16384])
            chunks.append(ChunkStorageMetadata(offsets, sizes))
            storage[MetadataIndex(fqn, torch.Size([rank * 53, 0]), rank)] = _StorageInfo(
                f"__{rank}_0.distcp", t * 1_736_000 + 7, 1_736_000
            )
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([53_000, 16384]), chunks
        )
    data = pickle.dumps(Metadata(state, {k: tuple(k.split(".", 1)) for k in state}, storage))
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        loaded = dcp_metadata.load_metadata(data, "test")
        built = gc.get_count()[0] - before
    finally:
        if enabled:
            gc.enable()
    assert len(loaded.storage_data) == 20_000
    per_byte = built / len(data)
    assert per_byte * dcp_metadata.MAX_METADATA_BYTES <= dcp_metadata.MAX_METADATA_OBJECTS, (
        f"{built:,} objects from {len(data):,} bytes: a {dcp_metadata.MAX_METADATA_BYTES:,}-byte "
        f".metadata would build {per_byte * dcp_metadata.MAX_METADATA_BYTES:,.0f}"
    )
