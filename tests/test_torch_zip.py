"""The torch.save zip, read and written at byte level without torch.

`locate_single_tensor` / `index_torch_zip` find each tensor's bytes in files `torch.save`
itself wrote (judged against the tensors torch loads back); `TorchZipWriter.add_raw` writes
tensors from raw bytes, judged by `torch.load(weights_only=True)` (and `mmap=True`) bit-exact
and against the bytes `torch.save` writes for the same tensors.
"""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.formats.torch.zip_index import index_torch_zip, locate_single_tensor
from ckpt_cli.formats.torch.zip_write import TorchZipWriter

from .conftest import REPO

#: every dtype torch.save stores, with and without a typed storage class
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float4_e2m1fn_x2,
]


def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` holding random bytes (NaNs included: compared bit by bit)."""
    size = torch.empty(0, dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _saved(obj: Any, pad: int = 0) -> bytes:
    """`pad` bytes of something else, then what torch.save writes for `obj` (a DCP item)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return b"\xee" * pad + buf.getvalue()


def _reader(data: bytes) -> Any:
    return lambda offset, n: data[offset : offset + n]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_saved_tensor_of_every_dtype_is_found_inside_a_larger_file(dtype: torch.dtype) -> None:
    tensor = _random(dtype, (3, 4))
    data = _saved(tensor, pad=1000)
    found = locate_single_tensor(_reader(data), 1000, len(data) - 1000)
    assert found is not None
    assert data[found.offset : found.offset + found.length] == _bits(tensor)
    assert found.dtype == str(dtype).removeprefix("torch.")
    assert (found.shape, found.stride, found.storage_offset) == ((3, 4), (4, 1), 0)


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor(2.5), torch.zeros(0, 3), torch.nn.Parameter(torch.ones(2, 2))],
    ids=["0-dim", "0-size", "parameter"],
)
def test_scalars_empty_tensors_and_parameters_are_plain(tensor: torch.Tensor) -> None:
    data = _saved(tensor)
    found = locate_single_tensor(_reader(data), 0, len(data))
    assert found is not None
    assert found.shape == tuple(tensor.shape)
    assert data[found.offset : found.offset + found.length] == _bits(tensor)


@pytest.mark.parametrize(
    "obj",
    [
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.arange(10.0)[2:5],  # a view: its storage holds more
        torch.arange(4.0).to(torch.complex64).conj(),  # conjugate bit: bytes are not values
        {"a": torch.ones(2)},  # not one tensor
        [torch.ones(2)],
        7,
    ],
    ids=["transposed", "slice", "conj", "dict", "list", "int"],
)
def test_what_is_not_one_whole_plain_tensor_is_not_located(obj: Any) -> None:
    data = _saved(obj)
    assert locate_single_tensor(_reader(data), 0, len(data)) is None


def test_garbage_truncated_and_legacy_blobs_are_not_located(tmp_path: Path) -> None:
    data = _saved(torch.ones(4))
    assert locate_single_tensor(_reader(data), 0, len(data) - 10) is None
    assert locate_single_tensor(_reader(b"PK\x03\x04" + b"\0" * 100), 0, 104) is None
    legacy = io.BytesIO()
    torch.save(torch.ones(4), legacy, _use_new_zipfile_serialization=False)
    raw = legacy.getvalue()
    assert locate_single_tensor(_reader(raw), 0, len(raw)) is None


def test_a_hostile_pickle_is_walked_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # a zip laid out like torch.save's whose data.pkl calls os.system: read as opaque
    evil = (
        b"\x80\x02cos\nsystem\nq\x00X" + len(f"touch {marker}").to_bytes(4, "little")
        + f"touch {marker}".encode() + b"\x85R."
    )  # fmt: skip
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", evil)
        z.writestr("archive/version", "3\n")
    data = buf.getvalue()
    assert locate_single_tensor(_reader(data), 0, len(data)) is None
    index = index_torch_zip(_reader(data), 0, len(data))
    assert index is not None and index.tensors == {}
    assert not marker.exists()


def test_every_tensor_of_a_state_dict_maps_to_its_bytes() -> None:
    base = _random(torch.float32, (4, 4))
    state = {
        "model": {
            "embed": base,
            "tied": base,  # shares a storage
            "rows": base[1:3],  # a C-order range inside that storage
            "cols": base[:, 1],  # strided: no range
            "ids": _random(torch.uint16, (5,)),
            "empty": torch.zeros(0, 2),
        },
        "layers": [{"w": _random(torch.bfloat16, (2, 3))}],
        "pair": (torch.ones(1), 3),
        "step": 7,
    }
    data = _saved(state, pad=64)
    index = index_torch_zip(_reader(data), 64, len(data) - 64)
    assert index is not None
    assert set(index.tensors) == {
        ("model", "embed"),
        ("model", "tied"),
        ("model", "rows"),
        ("model", "cols"),
        ("model", "ids"),
        ("model", "empty"),
        ("layers", 0, "w"),
        ("pair", 0),
    }
    loaded = torch.load(io.BytesIO(data[64:]), weights_only=True)
    for path, layout in index.tensors.items():
        want: Any = loaded
        for key in path:
            want = want[key]
        assert layout.shape == tuple(want.shape) and layout.stride == want.stride()
        if path == ("model", "cols"):
            assert not layout.plain and layout.data_offset is None
            continue
        assert layout.plain, path
        assert layout.data_offset is not None
        got = data[layout.data_offset : layout.data_offset + layout.nbytes]
        assert got == _bits(want), path
    embed, tied, rows = (index.tensors[("model", k)] for k in ("embed", "tied", "rows"))
    assert embed.record == tied.record == rows.record and embed.whole and not rows.whole
    assert len(index.records) == 5  # base (4 views of it), ids, empty, w, the pair's tensor


def _write_raw(path: Path, tensors: dict[str, torch.Tensor], extra: dict[str, Any]) -> None:
    with open(path, "wb") as fh:
        writer = TorchZipWriter(fh, path.stem)
        obj: dict[str, Any] = {}
        for name, t in tensors.items():
            raw = _bits(t)
            # blocks of 5 bytes: the CRC and length are streamed, not taken from one buffer
            blocks = (raw[i : i + 5] for i in range(0, len(raw), 5))
            dtype = str(t.dtype).removeprefix("torch.")
            obj[name] = writer.add_raw(dtype, list(t.shape), len(raw), blocks)
        writer.finish({**obj, **extra})


def test_add_raw_writes_every_dtype_as_torch_loads_it_bit_exact(tmp_path: Path) -> None:
    tensors = {str(d): _random(d, (3, 2), seed=i) for i, d in enumerate(DTYPES)}
    tensors |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    out = tmp_path / "raw.pt"
    _write_raw(out, tensors, {"step": 3})
    assert zipfile.ZipFile(out).testzip() is None  # every CRC right
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        assert got["step"] == 3
        for name, want in tensors.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert got[name].stride() == want.stride()
            assert _bits(got[name]) == _bits(want), name


def test_add_raw_from_a_file_range_writes_the_same_bytes_as_from_blocks(tmp_path: Path) -> None:
    # a local range is copied in the kernel, its CRC read beforehand and patched into the
    # record's header: the file must not differ by a byte from the streamed one
    from ckpt_cli.storage.fileio import FileRange

    tensors = {str(d): _random(d, (3, 2), seed=i) for i, d in enumerate(DTYPES)}
    tensors |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    streamed = tmp_path / "archive.pt"
    _write_raw(streamed, tensors, {"step": 3})
    pool = tmp_path / "pool.bin"
    places = {}
    with open(pool, "wb") as fh:
        for name, t in tensors.items():
            fh.write(b"x")  # odd offsets
            places[name] = (fh.tell(), len(_bits(t)))
            fh.write(_bits(t))
    copied = tmp_path / "copied" / "archive.pt"
    copied.parent.mkdir()
    with open(copied, "wb") as fh:
        writer = TorchZipWriter(fh, copied.stem)
        obj: dict[str, Any] = {}
        for name, t in tensors.items():
            offset, length = places[name]
            dtype = str(t.dtype).removeprefix("torch.")
            obj[name] = writer.add_raw(
                dtype, list(t.shape), length, FileRange(pool, offset, length)
            )
        writer.finish({**obj, "step": 3})
    assert copied.read_bytes() == streamed.read_bytes()
    assert zipfile.ZipFile(copied).testzip() is None
    got = torch.load(copied, weights_only=True)
    assert all(_bits(got[name]) == _bits(want) for name, want in tensors.items())


def test_add_raw_pickles_exactly_what_torch_save_pickles(tmp_path: Path) -> None:
    tensors = {"w": _random(torch.float32, (2, 3)), "ids": _random(torch.uint16, (4,))}
    tensors["b"] = _random(torch.float8_e4m3fn, (2,))
    out = tmp_path / "archive.pt"
    _write_raw(out, tensors, {})
    ours = zipfile.ZipFile(out).read("archive/data.pkl")
    theirs = zipfile.ZipFile(io.BytesIO(_saved(tensors))).read("archive/data.pkl")
    assert ours == theirs


def test_a_string_spelling_aplaceholder_survives_the_rewrite(tmp_path: Path) -> None:
    # the bytes of the placeholder's GLOBAL opcode, inside a value: only the opcode changes
    spelled = "cckpt_cli.formats.torch_zip\n_torch_torch___utils___rebuild_tensor_v2\n"
    out = tmp_path / "o.pt"
    _write_raw(out, {"w": torch.ones(2)}, {"note": spelled})
    got = torch.load(out, weights_only=True)
    assert got["note"] == spelled and torch.equal(got["w"], torch.ones(2))


def test_raw_write_and_index_read_never_import_torch(tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    script = f"""
import sys, struct
from ckpt_cli.formats.torch.zip_write import TorchZipWriter
from ckpt_cli.formats.torch.zip_index import index_torch_zip
with open({str(out)!r}, "wb") as fh:
    w = TorchZipWriter(fh, "o")
    w.finish({{"x": w.add_raw("float32", [2], 8, [struct.pack("<2f", 1.0, 2.0)])}})
data = open({str(out)!r}, "rb").read()
index = index_torch_zip(lambda o, n: data[o:o + n], 0, len(data))
layout = index.tensors[("x",)]
assert data[layout.data_offset:layout.data_offset + layout.nbytes] == struct.pack("<2f", 1, 2)
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO)
    assert torch.equal(torch.load(out, weights_only=True)["x"], torch.tensor([1.0, 2.0]))
