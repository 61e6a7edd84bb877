"""Per-entry records share their pydantic fields set (#20 memory) and still behave as models.

A checkpoint of 20,000 entries holds tens of thousands of `Entry` / `Chunk` records; each
one's own `__pydantic_fields_set__` cost more than its values. They now share one read-only
set per combination of set fields: what was set, dumps with `exclude_unset`, copies and
equality stay those of an ordinary pydantic model.
"""

from __future__ import annotations

import copy
import tracemalloc

import pytest

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
    # each with its own fields sets: about 2,500 bytes
    assert per_entry < 1400, f"{per_entry:.0f} bytes per Entry + Chunk"
