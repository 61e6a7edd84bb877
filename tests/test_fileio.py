"""Byte ranges copied in the kernel and write-back started while a copy goes on (#18): what
lets `convert` run at the speed of `cp -r SRC DST && sync`."""

from __future__ import annotations

import io
import os
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.formats.torch import zip_write as torch_zip
from ckpt_cli.storage import crc, fileio
from ckpt_cli.storage.fileio import FileRange

from .conftest import run_ckpt
from .dist_helpers import dcp_load_flat


def _pool(tmp_path: Path, size: int = 10_000) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "pool.bin"
    path.write_bytes(data)
    return path, data


def test_a_range_of_segments_iterates_splits_checksums_and_copies_the_same_bytes(
    tmp_path: Path,
) -> None:
    pool, data = _pool(tmp_path)
    segments = [(pool, 100, 3000), (pool, 7000, 0), (pool, 5000, 2500)]
    want = data[100:3100] + data[5000:7500]
    moved: list[int] = []
    blocks = FileRange.of(segments, block=777, on_progress=moved.append)
    assert b"".join(bytes(b) for b in blocks) == want and sum(moved) == len(want)
    assert FileRange.of(segments).crc32() == zlib.crc32(want)
    pieces = FileRange.of(segments).split([1, 2998, 1001, 0, 1500])
    assert [p.length for p in pieces] == [1, 2998, 1001, 0, 1500]
    assert b"".join(b"".join(bytes(b) for b in p) for p in pieces) == want
    out = tmp_path / "out.bin"
    with open(out, "wb") as fh:
        fh.write(b"head")
        assert FileRange.of(segments).copy_to(fh.fileno(), 4) == len(want)
    assert out.read_bytes() == b"head" + want
    with pytest.raises(ValueError):
        FileRange.of(segments).split([1, 2])


def test_a_copy_of_many_row_ranges_opens_each_file_once_and_tells_progress_in_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A permuted tensor is one range per row: its copy must not open the source, nor tell the
    progress bar, once per row (1000 rows here, one open and one progress call)."""
    pool, data = _pool(tmp_path)
    rows = [(pool, (i * 7919) % 9990, 10) for i in range(1000)]
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    moved: list[int] = []
    out = tmp_path / "out.bin"
    with open(out, "wb") as fh:
        monkeypatch.setattr(os, "open", counting_open)
        copied = FileRange.of(rows, on_progress=moved.append).copy_to(fh.fileno(), 0)
        monkeypatch.setattr(os, "open", real_open)
    assert copied == 10_000 and moved == [10_000]
    assert opened == [str(pool)]
    assert out.read_bytes() == b"".join(data[o : o + n] for _, o, n in rows)


@pytest.mark.parametrize("refusal", ["error", "nothing copied"])
def test_a_copy_the_kernel_refuses_falls_back_and_a_short_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    # EXDEV and friends, or a file system whose copy_file_range copies 0 bytes of a range
    # that is there: the buffered copy does the work, and only a really short file is an error
    pool, data = _pool(tmp_path)

    def refuse(*args: Any) -> int:
        if refusal == "nothing copied":
            return 0
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    out = tmp_path / "out.bin"
    with open(out, "wb") as fh:
        FileRange.of([(pool, 10, 20), (pool, 50, 30)]).copy_to(fh.fileno(), 0)
    assert out.read_bytes() == data[10:30] + data[50:80]
    from ckpt_cli.errors import FormatError

    with open(out, "wb") as fh, pytest.raises(FormatError, match="truncated") as caught:
        FileRange(pool, 9_990, 100).copy_to(fh.fileno(), 0)
    assert str(pool) in str(caught.value.path)


@pytest.mark.parametrize("to", ["safetensors", "dcp", "torch"])
def test_convert_starts_write_back_as_it_copies_and_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    # the final fsync then waits for little: write-back was asked for every step written
    requests: list[tuple[int, int, int]] = []
    real = fileio.start_writeback

    def spy(fd: int, offset: int = 0, length: int = 0) -> None:
        requests.append((fd, offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(fileio, "WRITEBACK_STEP", 256 << 10)
    # and each zip record's CRC is read in a thread while the kernel copies (torch.save kinds)
    monkeypatch.setattr(torch_zip, "_THREADED_CRC", 1 << 10)
    monkeypatch.setattr(fileio, "start_writeback", spy)
    gen = torch.Generator().manual_seed(1)
    state = {f"layers.{i}.w": torch.randn(256, 1024, generator=gen) for i in range(3)}  # 1 MiB
    save_file(state, tmp_path / "model.safetensors")
    out = tmp_path / ("out.pt" if to == "torch" else "out")
    result = run_ckpt("convert", tmp_path / "model.safetensors", out, "--to", to, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == len(state)
    assert len(requests) >= len(state)  # each 1 MiB tensor passes the 256 KiB step
    if to == "safetensors":
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    elif to == "dcp":
        got = dcp_load_flat(out, {n: torch.empty_like(t) for n, t in state.items()})
        # each item is a zip of its own; torch never checks the CRCs, zipfile does
        storage = dcp.FileSystemReader(str(out)).read_metadata().storage_data
        assert storage
        for info in storage.values():
            with open(out / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                blob = fh.read(info.length)
            assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None
    else:
        got = torch.load(out, weights_only=True)
        assert zipfile.ZipFile(out).testzip() is None  # the CRCs the threads computed
    assert got.keys() == state.keys()
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_zip_crcs_are_isal_s_and_equal_zlib_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt depends on `isal`: the CRC-32 of each zip record ckpt writes from a file range is
    ISA-L's (~2.5x zlib's speed), and the number zlib gives, across block boundaries, unaligned
    starts and segment joins."""
    assert crc.implementation() == "isa-l"
    monkeypatch.setattr(fileio, "CRC_BLOCK", 4099)  # many blocks, none aligned
    pool, data = _pool(tmp_path, 100_000)
    cases = [
        [(pool, 0, 100_000)],
        [(pool, 1, 4098), (pool, 5000, 0), (pool, 7, 33_333)],
        [(pool, 99_999, 1)],
        [],
    ]
    for segments in cases:
        want = b"".join(data[o : o + n] for _, o, n in segments)
        assert FileRange.of(segments).crc32() == zlib.crc32(want), segments


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_without_isal_zlib_computes_the_crcs_and_the_output_is_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, to: str
) -> None:
    """Where `isal` cannot be imported (no wheel for the platform), zlib computes the CRCs: the
    torch.save containers written are byte for byte the ones written with ISA-L, and zipfile
    finds every CRC right."""
    monkeypatch.setattr(torch_zip, "_THREADED_CRC", 1 << 10)  # the CRC thread runs too
    crc.crc32_function.cache_clear()
    request.addfinalizer(crc.crc32_function.cache_clear)  # later tests import isal again
    gen = torch.Generator().manual_seed(3)
    state = {f"layers.{i}.w": torch.randn(100 + i, 333, generator=gen) for i in range(3)}
    save_file(state, tmp_path / "model.safetensors")
    outputs = []
    for name in ("isal", "zlib"):
        if name == "zlib":
            monkeypatch.setitem(sys.modules, "isal", None)  # `import isal` raises ImportError
            crc.crc32_function.cache_clear()
        assert crc.implementation() == ("isa-l" if name == "isal" else "zlib")
        (tmp_path / name).mkdir()
        out = tmp_path / name / ("model.pt" if to == "torch" else "out")  # names are stored
        result = run_ckpt("convert", tmp_path / "model.safetensors", out, "--to", to)
        assert result.exit_code == 0, result.stderr
        # (a DCP's .metadata names its folder: only the data files are compared)
        files = sorted(out.glob("*.distcp")) if out.is_dir() else [out]
        outputs.append({f.name: f.read_bytes() for f in files})
    assert outputs[0] == outputs[1] and outputs[0]
    if to == "torch":
        assert zipfile.ZipFile(out).testzip() is None
        got = torch.load(out, weights_only=True)
    else:
        got = dcp_load_flat(out, {n: torch.empty_like(t) for n, t in state.items()})
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_dcp_torch_save_tensor_bytes_are_copied_in_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the bytes inside each torch.save blob are located, then moved by copy_file_range, not
    # read into Python: every tensor byte goes through the kernel copy
    gen = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(64, 33, generator=gen) for i in range(4)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    copied: list[int] = []
    real = os.copy_file_range

    def spy(*args: Any) -> int:
        n = real(*args)
        copied.append(n)
        return n

    monkeypatch.setattr(os, "copy_file_range", spy)
    out = tmp_path / "st"
    result = run_ckpt("convert", tmp_path / "dcp", out, "--to", "safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == len(state)
    assert sum(copied) == sum(t.nbytes for t in state.values())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, tensor in state.items():
            assert torch.equal(f.get_tensor(name), tensor), name


def test_the_dcp_writer_decides_raw_copies_once_not_per_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asked per entry, the decision walked every planned entry: n entries cost n² (20,000
    # small tensors took minutes); the plan does not change while writing
    from ckpt_cli.formats.dcp import DcpWriter

    decisions: list[int] = []
    real = DcpWriter._raw_plan

    def spy(self: DcpWriter) -> bool:
        decisions.append(1)
        return real(self)

    monkeypatch.setattr(DcpWriter, "_raw_plan", spy)
    state = {f"layers.{i}.w": torch.full((3, 2), float(i)) for i in range(200)}
    save_file(state, tmp_path / "model.safetensors")
    result = run_ckpt(
        "convert", tmp_path / "model.safetensors", tmp_path / "dcp", "--to", "dcp", "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert result.json["result"]["raw_copies"] == len(state)
    assert len(decisions) == 1
    got = dcp_load_flat(tmp_path / "dcp", {n: torch.empty_like(t) for n, t in state.items()})
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_write_back_is_asked_for_by_a_background_thread_while_the_copy_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sync_file_range` blocks while it queues pages for the disk; asked on the copying thread,
    that wait was added to the copy (#30). The requests now come from `ckpt-writeback`, on a
    descriptor of the output file, and the output is the same bytes."""
    import threading
    import time

    if fileio._load_sync_file_range() is None:
        pytest.skip("no sync_file_range on this platform")
    calls: list[tuple[str, str]] = []
    done = threading.Event()

    def spy(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        done.set()
        return 0

    monkeypatch.setattr(fileio, "_sync_file_range", spy)
    monkeypatch.setattr(fileio, "WRITEBACK_STEP", 256 << 10)
    gen = torch.Generator().manual_seed(3)
    state = {f"layers.{i}.w": torch.randn(256, 1024, generator=gen) for i in range(3)}  # 1 MiB
    save_file(state, tmp_path / "model.safetensors")
    out = tmp_path / "out"
    result = run_ckpt("reshard", tmp_path / "model.safetensors", out, "--max-shard-size", "2MB")
    assert result.exit_code == 0, result.stderr
    done.wait(timeout=60)  # the thread runs on its own: wait for its first request to land
    deadline = time.monotonic() + 60
    while fileio._FLUSHER._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "no write-back was asked for"
    assert {thread for thread, _ in calls} == {"ckpt-writeback"}
    # the requests named the staged shards (published since under OUT)
    assert all(".out.ckpt-tmp-" in target and ".safetensors" in target for _, target in calls)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            got.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    assert got.keys() == state.keys()
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_shards_are_fsynced_off_the_copying_thread_and_a_failed_fsync_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each closed shard is fsynced by the background thread while the next one is copied; the
    index is written only once all are on disk, and a disk error in one of those fsyncs is
    the command's error (exit 74), with no DEST and no staging folder left."""
    import errno
    import threading

    gen = torch.Generator().manual_seed(4)
    state = {f"layers.{i}.w": torch.randn(256, 1024, generator=gen) for i in range(3)}  # 1 MiB
    save_file(state, tmp_path / "model.safetensors")
    synced: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    out = tmp_path / "out"
    result = run_ckpt("reshard", tmp_path / "model.safetensors", out, "--max-shard-size", "2MB")
    assert result.exit_code == 0, result.stderr
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1
    in_background = {Path(t).name for name, t in synced if name == "ckpt-writeback"}
    assert in_background == set(shards)
    with safe_open(str(out / shards[-1]), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), state[n]) for n in f.keys())  # noqa: SIM118

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    broken = tmp_path / "broken"
    result = run_ckpt("reshard", tmp_path / "model.safetensors", broken, "--max-shard-size", "2MB")
    assert result.exit_code == 74, result.stderr
    assert "Input/output error" in result.stderr or "EIO" in result.stderr, result.stderr
    assert not broken.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]


def test_files_are_read_into_page_aligned_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing and a zip record's CRC read into buffers that start on a page: a large
    `bytearray` starts 16 bytes past one, where the kernel's copy ran four times slower."""
    import ctypes
    import hashlib
    import mmap

    from ckpt_cli.storage import hashing

    def address(view: Any) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))

    data = os.urandom(3 << 20)
    (tmp_path / "blob").write_bytes(data)
    seen: list[int] = []
    preadv = os.preadv

    def recording(fd: int, buffers: list[Any], offset: int) -> int:
        seen.append(address(buffers[0]))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(fileio.os, "preadv", recording)
    assert FileRange(tmp_path / "blob", 0, len(data)).crc32() == zlib.crc32(data)
    assert seen and all(a % mmap.PAGESIZE == 0 for a in seen), seen

    buffers: list[int] = []

    def aligned(size: int) -> Any:
        view = fileio.aligned_buffer(size)
        buffers.append(address(view))
        return view

    monkeypatch.setattr(hashing, "aligned_buffer", aligned)
    digests = hashing.hash_files({"blob": tmp_path / "blob"}, "sha256")
    assert digests == {"blob": hashlib.sha256(data).hexdigest()}
    assert buffers and all(a % mmap.PAGESIZE == 0 for a in buffers), buffers
