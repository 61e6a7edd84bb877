"""Per-entry records share their pydantic fields set (#20 memory) and still behave as models.

A checkpoint of 20,000 entries holds tens of thousands of `Entry` / `Chunk` records; each
one's own `__pydantic_fields_set__` cost more than its values. `Entry` records now share one
read-only set per combination of set fields: what was set, dumps with `exclude_unset`, copies
and equality stay those of an ordinary pydantic model. `Chunk` (a million of them in a large
run's DCP) is a slotted dataclass (#30): validated, dumped and described in the JSON schema as
the model was.
"""

from __future__ import annotations

import copy
import tracemalloc

import pytest
from pydantic import ValidationError

from ckpt_cli.models import Chunk, Entry, Manifest


def _entry(i: int) -> Entry:
    chunk = Chunk(offsets=[0], sizes=[4], file="__0_0.distcp", byte_offset=16 * i, byte_length=16)
    return Entry(name=f"layer.{i}.w", dtype="F32", shape=[4], nbytes=16, chunks=[chunk])


def test_records_share_their_fields_set_and_dump_what_was_set() -> None:
    a, b = _entry(0), _entry(1)
    assert a.__pydantic_fields_set__ is b.__pydantic_fields_set__
    assert a.model_fields_set == {"name", "dtype", "shape", "nbytes", "chunks"}
    assert a.model_dump(exclude_unset=True) == {
        "name": "layer.0.w",
        "dtype": "F32",
        "shape": [4],
        "nbytes": 16,
        "chunks": [
            {
                "offsets": [0],
                "sizes": [4],
                "file": "__0_0.distcp",
                "byte_offset": 0,
                "byte_length": 16,
                "raw": False,  # a chunk is a dataclass: no fields set to leave out
            }
        ],
    }
    manifest = Manifest(format="dcp", location="x", entries=[a, b])
    assert Manifest.model_validate_json(manifest.model_dump_json()) == manifest


def test_a_copy_adds_its_update_without_touching_the_shared_set() -> None:
    a = _entry(0)
    moved = a.model_copy(update={"file": "out.safetensors", "offset": 8})
    assert moved.model_fields_set == a.model_fields_set | {"file", "offset"}
    assert "file" not in a.model_fields_set and "file" not in _entry(2).model_fields_set
    assert copy.deepcopy(a) == a and copy.copy(a) == a
    with pytest.raises(TypeError, match="read-only"):
        a.__pydantic_fields_set__.add("offset")
    trusted = Entry.trusted("w", "F32", [4], 16, "m.safetensors", 8)
    assert trusted == Entry(
        name="w", dtype="F32", shape=[4], nbytes=16, file="m.safetensors", offset=8
    )
    assert trusted.model_copy(update={"name": "v"}).model_fields_set == set(Entry.model_fields)


def test_an_entry_with_its_chunk_costs_about_a_kibibyte() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        entries = [_entry(i) for i in range(2000)]
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(entries)
    finally:
        tracemalloc.stop()
    # each with its own fields sets: about 2,500 bytes; with a pydantic Chunk, about 1,300
    assert per_entry < 1100, f"{per_entry:.0f} bytes per Entry + Chunk"


def test_a_chunk_costs_half_what_a_pydantic_model_did() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        chunks = [
            Chunk([i * 1000, 4096], [1000, 4096], "__7_0.distcp", i * 10**6, 10**6)
            for i in range(2000)
        ]
        per_chunk = (tracemalloc.get_traced_memory()[0] - before) / len(chunks)
    finally:
        tracemalloc.stop()
    # as a pydantic model with a shared fields set: about 570 bytes (its own __dict__)
    assert per_chunk < 360, f"{per_chunk:.0f} bytes per Chunk"
    assert not hasattr(chunks[0], "__dict__")


def test_chunks_in_entries_validate_dump_and_read_back_as_before() -> None:
    raw = {"offsets": [0, 8], "sizes": [4, 8], "file": "__1_0.distcp"}
    entry = Entry.model_validate(
        {"name": "w", "dtype": "F32", "shape": [4, 16], "chunks": [{**raw, "byte_offset": 7,
         "byte_length": 9}]}
    )  # fmt: skip
    chunk = entry.chunks[0] if entry.chunks else None
    assert isinstance(chunk, Chunk) and chunk.raw is False and chunk.byte_offset == 7
    assert Entry.model_validate_json(entry.model_dump_json()) == entry
    assert entry.model_dump(mode="json")["chunks"] == [
        {**raw, "byte_offset": 7, "byte_length": 9, "raw": False}
    ]
    with pytest.raises(ValidationError):
        Entry.model_validate({"name": "w", "chunks": [{**raw, "byte_offset": "x"}]})
    schema = Entry.model_json_schema()["$defs"]["Chunk"]
    assert schema["required"] == ["offsets", "sizes", "file", "byte_offset", "byte_length"]
    assert schema["properties"]["raw"] == {"default": False, "title": "Raw", "type": "boolean"}
    with pytest.raises(AttributeError):
        chunk.file = "elsewhere"  # type: ignore[misc]
