"""Budgets on hostile inputs (#29): no file chooses ckpt's memory or CPU, and malformed input is
exit 4 naming the file, in every reader.

Each input is built here, tiny on disk (a sparse file where the attack is a size), and `ckpt`
runs as a real process (`python -m ckpt_cli`) under resource limits: address space (so a
regression fails fast instead of swapping the machine) and CPU seconds (RLIMIT_CPU: a process
past it is killed by SIGXCPU). The peak RSS and CPU time the kernel accounted to it (`os.wait4`)
are asserted too. The bounds are generous: they separate "a block at a time" from "the whole
thing", never a fast run from a slow one.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .hub_server import TestHub

REPO = Path(__file__).resolve().parents[1]

#: address space every run may map (torch's import maps ~0.7 GiB; the attacks wanted 4-16 GiB)
AS_LIMIT = 3 << 30
#: CPU seconds every run may use (the attacks ran for minutes)
CPU_LIMIT = 60


@dataclass
class Run:
    """One `ckpt` process: exit code, output, peak RSS (bytes) and CPU seconds."""

    exit_code: int
    stdout: str
    stderr: str
    peak_rss: int
    cpu_s: float

    @property
    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.stdout)
        return doc


#: a small launcher between pytest and `ckpt`: at exec Linux folds the forking process's
#: high-water mark into the child's `ru_maxrss`, and pytest's grows over a run (a test that
#: built a 300,000-entry index), so `ckpt` is forked from this fresh interpreter instead
LAUNCHER = """
import json, os, resource, sys

as_limit, cpu, out, err, argv = (
    int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
)
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
print(json.dumps({
    "code": os.waitstatus_to_exitcode(status),
    "peak_kib": usage.ru_maxrss,
    "cpu_s": usage.ru_utime + usage.ru_stime,
}))
"""


def ckpt_limited(*args: str | os.PathLike[str]) -> Run:
    """`python -m ckpt_cli ARGS` as a real process under the address-space and CPU limits,
    measured by `os.wait4` in `LAUNCHER`."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        argv = [sys.executable, "-m", "ckpt_cli", *map(str, args)]
        launcher = [sys.executable, "-c", LAUNCHER, str(AS_LIMIT), str(CPU_LIMIT), str(out)]
        proc = subprocess.run(
            [*launcher, str(err), *argv], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        return Run(
            result["code"],
            out.read_text(),
            err.read_text(),
            result["peak_kib"] * 1024,
            result["cpu_s"],
        )


def assert_refused(run: Run, where: Path, *words: str, exit_code: int = 4) -> None:
    """Exit `exit_code`, the file named, the words said, within the budgets."""
    text = run.stdout + run.stderr
    assert run.exit_code == exit_code, text
    assert str(where) in text, text
    for word in words:
        assert word in text, text
    assert "internal error" not in text, text
    assert run.peak_rss < 1 << 30, f"peak RSS {run.peak_rss:,}"
    assert run.cpu_s < CPU_LIMIT, f"{run.cpu_s:.1f} CPU-s"


def torch_zip_with_pickle(path: Path, data_pkl: bytes, *, deflate: bool = False) -> Path:
    """A torch.save file (written by torch.save) whose `data.pkl` is replaced by `data_pkl`."""
    real = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, real)
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                if deflate:
                    out.writestr(info.filename, data_pkl, compress_type=zipfile.ZIP_DEFLATED)
                    continue
                data = data_pkl
            out.writestr(info.filename, data)
    return path


#: None, LONG_BINPUT 268435455, STOP: the C unpickler sizes its memo by the index (4 GiB)
MEMO_BOMB = b"\x80\x02N" + b"r\xff\xff\xff\x0f" + b"."


# -- the C unpickler's memo ------------------------------------------------------------------


@pytest.mark.slow
def test_a_memo_index_of_2_28_in_a_torch_file_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    bomb = torch_zip_with_pickle(tmp_path / "memo.pt", MEMO_BOMB)
    assert bomb.stat().st_size < 2048
    inspect = ckpt_limited("inspect", bomb)  # 0.1.x: 4.3 GB
    assert_refused(inspect, bomb, "memo index 268,435,455")
    verify = ckpt_limited("verify", bomb, "--json")
    assert_refused(verify, bomb, "memo index", exit_code=1)
    convert = ckpt_limited("convert", bomb, tmp_path / "out", "--to", "safetensors")
    assert_refused(convert, bomb, "memo index")
    assert not (tmp_path / "out").exists()
    # torch's own (pure-Python, dict-memo) loader reads the same bytes as None
    assert torch.load(bomb, weights_only=True) is None


def test_a_memo_index_of_2_28_as_dcp_metadata_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(src), no_dist=True)
    (src / ".metadata").write_bytes(b"\x80\x04N" + b"r\xff\xff\xff\x0f" + b".")
    assert_refused(ckpt_limited("inspect", src), src / ".metadata", "memo index 268,435,455")
    assert_refused(ckpt_limited("verify", src), src / ".metadata", "memo index", exit_code=1)


def test_a_text_put_and_a_length_past_the_end_are_refused_too(tmp_path: Path) -> None:
    text_put = torch_zip_with_pickle(tmp_path / "put.pt", b"\x80\x02Np268435455\n.")
    assert_refused(ckpt_limited("inspect", text_put), text_put, "memo index 268,435,455")
    # BINBYTES8 of 2^40 bytes in a 20-byte pickle: the unpickler allocates the length first
    huge = torch_zip_with_pickle(
        tmp_path / "len.pt", b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"ab."
    )
    assert_refused(ckpt_limited("inspect", huge), huge, "1,099,511,627,776 bytes")


def _colliding_dict(n: int) -> bytes:
    """A dict of `n` int keys `i * (2**61 - 1)`: all of one hash (0), built in quadratic time."""
    modulus = (1 << 61) - 1

    def long1(value: int) -> bytes:
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw

    return b"}(" + b"".join(long1(i * modulus) + b"N" for i in range(1, n + 1)) + b"u"


@pytest.mark.slow
def test_a_dict_of_colliding_int_keys_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Hash flooding: 60,000 keys of one hash in a 0.8 MB torch file, 120,000 in a 1.5 MB DCP
    `.metadata` (a dict pushed then popped before the real one), each took minutes of CPU in
    the C unpickler, which also heard no SIGTERM meanwhile."""
    import torch.distributed.checkpoint as dcp

    flood = torch_zip_with_pickle(
        tmp_path / "flood.pt", b"\x80\x02}X\x01\x00\x00\x00a" + _colliding_dict(60_000) + b"s."
    )
    assert_refused(ckpt_limited("verify", flood), flood, "hash flooding", exit_code=1)
    assert_refused(ckpt_limited("inspect", flood), flood, "hash flooding")
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3, 4)}, checkpoint_id=str(src), no_dist=True)
    real = (src / ".metadata").read_bytes()
    (src / ".metadata").write_bytes(real[:2] + _colliding_dict(120_000) + b"0" + real[2:])
    assert_refused(ckpt_limited("inspect", src), src / ".metadata", "hash flooding")
    # a real pickle of large ints of distinct hashes (64-bit seeds, byte offsets) still reads
    seeds = {"seeds": [(1 << 63) - i for i in range(5000)], "w": torch.ones(2)}
    torch.save(seeds, tmp_path / "seeds.pt")
    assert ckpt_limited("inspect", tmp_path / "seeds.pt").exit_code == 0


def test_the_walk_tracks_only_ints_past_the_hash_modulus_and_a_bounded_number_of_them() -> None:
    """The flooding check keeps each large int it has seen: ints that hash to themselves
    (every byte offset and size) are never kept, and a pickle of more distinct ints past
    2**61 than any checkpoint holds is refused rather than tracked without end."""
    from ckpt_cli import budgets

    offsets = pickle.dumps([(1 << 60) + i for i in range(200_000)], protocol=2)
    assert budgets.pickle_overreach(offsets) is None
    seeds = pickle.dumps([(1 << 62) + i for i in range(budgets.MAX_HUGE_INTS + 1)], protocol=2)
    assert "integers past 2**61" in (budgets.pickle_overreach(seeds) or "")


def test_memo_indexes_a_real_pickler_writes_are_read_as_before(tmp_path: Path) -> None:
    # 300 tensors: data.pkl memoises past 256 entries, so LONG_BINPUT indexes appear
    state = {f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(300)}
    torch.save(state, tmp_path / "many.pt")
    run = ckpt_limited("inspect", tmp_path / "many.pt", "--json")
    assert run.exit_code == 0, run.stderr
    assert run.json["result"]["tensors"] == 300


# -- shared-object graphs of lists and tuples ------------------------------------------------


def _list_dag(levels: int, kind: type) -> Any:
    node: Any = kind([0] * 10)
    for _ in range(levels):
        node = kind([node] * 10)  # ten references to the level below
    return node


def test_a_dag_of_ten_element_lists_is_refused_at_once(tmp_path: Path) -> None:
    bomb = tmp_path / "lists.pt"
    torch.save({"state": _list_dag(40, list)}, bomb)  # 10^40 paths, no tensors
    assert bomb.stat().st_size < 4096
    run = ckpt_limited("inspect", bomb)  # 0.1.x: > 4 min in torch_flatten._holds
    assert_refused(run, bomb, "billion laughs")
    assert run.cpu_s < 20


def test_a_dag_of_tuples_is_refused_by_verify_deep_and_convert(tmp_path: Path) -> None:
    bomb = tmp_path / "tuples.pt"
    torch.save({"w": torch.ones(2), "state": _list_dag(40, tuple)}, bomb)
    assert bomb.stat().st_size < 4096
    verify = ckpt_limited("verify", bomb, "--deep")  # 0.1.x: minutes in copy.deepcopy
    assert_refused(verify, bomb, "billion laughs", exit_code=1)
    convert = ckpt_limited("convert", bomb, tmp_path / "out", "--to", "torch")
    assert_refused(convert, bomb, "billion laughs")
    assert not (tmp_path / "out").exists()


def test_shared_tuples_below_the_budget_still_convert_and_stay_equal(tmp_path: Path) -> None:
    shared = (1, 2.5, "x")
    torch.save({"w": torch.ones(2), "a": [shared] * 3, "b": (shared, shared)}, tmp_path / "s.pt")
    out = tmp_path / "out.pt"
    run = ckpt_limited("convert", tmp_path / "s.pt", out, "--to", "torch")
    assert run.exit_code == 0, run.stderr
    back = torch.load(out, weights_only=True)
    assert back["a"] == [shared] * 3 and back["b"] == (shared, shared)
    assert torch.equal(back["w"], torch.ones(2))


# -- inflated zip records --------------------------------------------------------------------


def _deflated_pickle_bomb(path: Path, inflated: int) -> Path:
    """A torch.save file whose data.pkl (a real pickle, then zeros) inflates to `inflated`."""
    real = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, real)
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if not info.filename.endswith("/data.pkl"):
                out.writestr(info.filename, data)
                continue
            target = zipfile.ZipInfo(info.filename)
            target.compress_type = zipfile.ZIP_DEFLATED
            with out.open(target, "w", force_zip64=True) as member:
                member.write(data)
                zero = bytes(16 << 20)
                for _ in range((inflated - len(data)) // len(zero)):
                    member.write(zero)
    return path


@pytest.mark.slow  # a pickle inflated towards 1 GiB, refused by every command in its own process
def test_a_1_mb_torch_file_whose_pickle_inflates_to_1_gib_is_refused(tmp_path: Path) -> None:
    bomb = _deflated_pickle_bomb(tmp_path / "zip.pt", 1 << 30)
    assert bomb.stat().st_size < 2 << 20
    for args in (("inspect", bomb), ("convert", bomb, tmp_path / "out", "--to", "safetensors")):
        run = ckpt_limited(*args)  # 0.1.x: 269 CPU-s and 2.28 GB, then killed
        assert_refused(run, bomb, "data.pkl", "more than the 268,435,456")
    verify = ckpt_limited("verify", bomb)
    assert_refused(verify, bomb, "data.pkl", exit_code=1)


@pytest.mark.slow
def test_a_pickle_deflated_a_thousandfold_under_the_size_cap_is_refused(tmp_path: Path) -> None:
    bomb = _deflated_pickle_bomb(tmp_path / "ratio.pt", 128 << 20)  # under 256 MiB, ~1000x
    assert_refused(ckpt_limited("inspect", bomb), bomb, "zip bomb")


# -- GGUF counts -----------------------------------------------------------------------------


def _gguf_with_one_value(path: Path, value_type: int, value: bytes) -> Path:
    key = b"general.name"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(head + struct.pack("<I", value_type) + value)
    return path


@pytest.mark.slow
def test_a_51_byte_gguf_declaring_2_40_uint8_is_refused(tmp_path: Path) -> None:
    # an ARRAY (9) of UINT8 (0), 2^40 items
    bomb = _gguf_with_one_value(tmp_path / "a.gguf", 9, struct.pack("<IQ", 0, 1 << 40))
    assert bomb.stat().st_size < 64
    assert_refused(ckpt_limited("inspect", bomb), bomb, "1,099,511,627,776 items")
    assert_refused(ckpt_limited("verify", bomb), bomb, "items", exit_code=1)


def test_a_gguf_string_running_2_60_bytes_past_the_end_is_not_ok(tmp_path: Path) -> None:
    # a STRING (8) of 2^60 bytes, six present: 0.1.x verify said OK
    bad = _gguf_with_one_value(tmp_path / "s.gguf", 8, struct.pack("<Q", 1 << 60) + b"llama!")
    assert bad.stat().st_size < 64
    verify = ckpt_limited("verify", bad, "--json")
    assert_refused(verify, bad, "runs past the end of the file", exit_code=1)
    assert verify.json["ok"] is False
    assert_refused(ckpt_limited("inspect", bad), bad, "general.name")


def test_a_gguf_the_gguf_writer_made_still_reads(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = ckpt_limited("verify", tmp_path / "m.gguf", "--json")
    assert run.exit_code == 0, run.stdout + run.stderr


# -- verify --deep on a large tensor ---------------------------------------------------------


@pytest.mark.slow  # reads a sparse 1 GiB tensor through verify --deep
def test_verify_deep_counts_a_1_gib_tensor_in_bounded_memory(tmp_path: Path) -> None:
    count = (1 << 30) // 4
    header = json.dumps({"big": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    big = tmp_path / "big.safetensors"
    with big.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + 4 * count)  # sparse: a few KiB on disk
        fh.seek(8 + len(raw) + 4 * (count // 2 + 3))  # one NaN past the middle
        fh.write(struct.pack("<f", float("nan")))
    assert big.stat().st_blocks * 512 < 1 << 20
    with safe_open(str(big), "pt") as real:  # the real reader agrees on the layout
        assert real.get_slice("big").get_shape() == [count]
    run = ckpt_limited("verify", big, "--deep", "--json")  # 0.1.x: the whole tensor (1.6 GB)
    assert run.exit_code == 1, run.stdout + run.stderr
    assert run.json["result"]["nonfinite"] == [
        {"name": "big", "file": str(big), "nan": 1, "inf": 0}
    ]
    assert run.peak_rss < 800 << 20, f"peak RSS {run.peak_rss:,}"


# -- shapes the target format cannot hold ----------------------------------------------------


def _safetensors_with_shape(path: Path, shape: list[Any], nbytes: int) -> Path:
    header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(nbytes))
    return path


def test_a_dimension_of_2_63_with_no_elements_is_refused_not_published(tmp_path: Path) -> None:
    bad = _safetensors_with_shape(tmp_path / "dim.safetensors", [1 << 63, 0], 0)
    out = tmp_path / "out.pt"
    # 0.1.x: exit 0, and torch.load(weights_only=True) of out.pt raised an overflow
    assert_refused(ckpt_limited("convert", bad, out, "--to", "torch"), bad, "int64")
    assert not out.exists()
    assert_refused(ckpt_limited("verify", bad), bad, "int64", exit_code=1)
    product = _safetensors_with_shape(tmp_path / "prod.safetensors", [1 << 40, 1 << 40, 0], 0)
    assert_refused(ckpt_limited("inspect", product), product, "multiply past")
    with pytest.raises(RuntimeError, match="overflow"):
        torch.empty((1 << 40, 1 << 40, 0))  # why: torch cannot hold it either


def test_a_shape_of_true_is_refused_as_safe_open_refuses_it(tmp_path: Path) -> None:
    bad = _safetensors_with_shape(tmp_path / "true.safetensors", [True], 4)
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="boolean"):  # the real reader: no dimension
        safe_open(str(bad), "pt")
    assert_refused(ckpt_limited("inspect", bad), bad, "invalid shape")
    convert = ckpt_limited("convert", bad, tmp_path / "out", "--to", "torch")
    assert_refused(convert, bad, "invalid shape")


@pytest.mark.slow
def test_a_shape_of_millions_of_dimensions_is_refused_before_it_is_walked(tmp_path: Path) -> None:
    # a 10 MB header of one tensor [1, 1, ...] (5M dimensions) is within the header budget;
    # 0.1.x read it (a 63 MB one: inspect 2.9 GB RSS and 40 CPU-s, convert 1.9 GB)
    bad = _safetensors_with_shape(tmp_path / "dims.safetensors", [1] * 5_000_000, 4)
    assert_refused(ckpt_limited("inspect", bad), bad, "5,000,000 dimensions")
    assert_refused(ckpt_limited("verify", bad), bad, "dimensions", exit_code=1)
    out = tmp_path / "out.pt"
    assert_refused(ckpt_limited("convert", bad, out, "--to", "torch"), bad, "dimensions")
    assert not out.exists()
    # numpy (the safetensors numpy reader) holds 64 dimensions at most; 64 still converts
    with pytest.raises(ValueError, match="64"):
        torch.zeros([1] * 65).numpy()
    at_limit = tmp_path / "d64.safetensors"
    save_file({"t": torch.ones([1] * 64)}, str(at_limit))
    assert ckpt_limited("convert", at_limit, out, "--to", "torch").exit_code == 0
    assert torch.equal(torch.load(out, weights_only=True)["t"], torch.ones([1] * 64))


@pytest.mark.slow
def test_a_torch_tensor_of_millions_of_dimensions_is_refused(tmp_path: Path) -> None:
    # 0.1.x: a 60 MB torch.save of one tensor of 15M dimensions took inspect 1.3 GB, 18 CPU-s
    many = tmp_path / "many.pt"
    torch.save({"w": torch.zeros([1] * 2_000_000)}, many)
    assert_refused(ckpt_limited("inspect", many), many, "2,000,000 dimensions")
    # read by torch.load (a strided view is not read without torch; a legacy file neither)
    for name, legacy in (("strided.pt", False), ("legacy.pt", True)):
        path = tmp_path / name
        value = torch.zeros([1] * 100).transpose(0, 1)
        torch.save({"w": value}, path, _use_new_zipfile_serialization=not legacy)
        assert_refused(ckpt_limited("inspect", path), path, "100 dimensions")


# -- malformed torch.save files: exit 4 naming the file, never 70 ----------------------------


class _Reduced:
    def __init__(self, func: Any, args: tuple[Any, ...]):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _tensor_pickle_with(size: Any, stride: Any) -> bytes:
    """data.pkl of one tensor as torch pickles it, with `size` and `stride` as given."""
    storage = object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", 2) if obj is storage else None

    buffer = io.BytesIO()
    rebuild = torch._utils._rebuild_tensor_v2
    Pickler(buffer, protocol=2).dump(
        {"w": _Reduced(rebuild, (storage, 0, size, stride, False, OrderedDict()))}
    )
    return buffer.getvalue()


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize(
    ("name", "data_pkl"),
    [
        ("build-on-empty-stack", b"\x80\x02b."),  # torch.load: IndexError
        ("append-on-empty-stack", b"\x80\x02a."),  # torch.load: IndexError
        ("size-is-an-int", _tensor_pickle_with(2, False)),  # torch.load: TypeError
        ("stride-too-short", _tensor_pickle_with((2, 1), (1,))),
        ("truncated", _tensor_pickle_with((2,), (1,))[:-7]),
    ],
)
def test_a_corrupt_torch_file_is_exit_4_in_every_command(
    tmp_path: Path, name: str, data_pkl: bytes
) -> None:
    bad = torch_zip_with_pickle(tmp_path / f"{name}.pt", data_pkl)
    for args in (
        ("inspect", bad),
        ("convert", bad, tmp_path / "out", "--to", "safetensors"),
    ):
        run = ckpt_limited(*args)  # 0.1.x: exit 70, "internal error: IndexError"
        assert_refused(run, bad)
    verify = ckpt_limited("verify", bad, "--deep")
    assert_refused(verify, bad, exit_code=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # every case a fresh process that imports torch
def test_truncations_of_a_real_torch_file_are_exit_4(tmp_path: Path) -> None:
    real = tmp_path / "real.pt"
    torch.save({"w": torch.randn(4, 3), "step": 7, "opt": {"lr": 0.1}}, real)
    data = real.read_bytes()
    for cut in (len(data) // 4, len(data) // 2, len(data) - 30):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        assert_refused(ckpt_limited("inspect", bad), bad)
        assert_refused(ckpt_limited("verify", bad, "--deep"), bad, exit_code=1)


@pytest.mark.slow
def test_verify_deep_checks_the_records_of_a_torch_file_of_20_000_tensors_in_linear_time(
    tmp_path: Path,
) -> None:
    # 0.1.x matched every record torch's reader lists against every record of the zip
    # directory: an optimizer.pt of 10,000 tensors took 30 CPU-s more, 20,000 past a minute
    # (killed here by RLIMIT_CPU), a crafted 20 MB file of 200,000 empty records hours
    state = {f"state.{i}.exp_avg": torch.full((2,), float(i)) for i in range(20_000)}
    path = tmp_path / "optimizer.pt"
    torch.save(state, path)
    run = ckpt_limited("verify", path, "--deep", "--json")
    assert run.exit_code == 0, run.stdout + run.stderr
    assert run.json["result"]["ok"] is True
    assert run.cpu_s < CPU_LIMIT
    assert torch.equal(torch.load(path)["state.19999.exp_avg"], torch.full((2,), 19999.0))


# -- calls torch's weights_only loader admits that allocate by a size ----------------------------

#: torch.save's legacy (non-zip) header: magic number, protocol version, system info
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}


def _torch_file_with(path: Path, extra: dict[str, Any], *, legacy: bool) -> Path:
    """A torch.save file of {"w": a float tensor of 2, **extra}, pickled as torch.save pickles
    it, as a zip or in the legacy (non-zip) layout: `extra`'s values are crafted calls."""
    storage = object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if obj is not storage:
                return None
            meta = ("storage", torch.FloatStorage, "0", "cpu", 2)
            return (*meta, None) if legacy else meta

    rebuild = torch._utils._rebuild_tensor_v2
    root = {"w": _Reduced(rebuild, (storage, 0, (2,), (1,), False, OrderedDict())), **extra}
    buffer = io.BytesIO()
    if not legacy:
        Pickler(buffer, protocol=2).dump(root)
        # a strided view next to them: read by torch.load, as a user's optimizer state may be
        return torch_zip_with_pickle(path, buffer.getvalue())
    for header in (_LEGACY_MAGIC, 1001, _LEGACY_INFO):
        pickle.dump(header, buffer, protocol=2)
    Pickler(buffer, protocol=2).dump(root)
    pickle.dump(["0"], buffer, protocol=2)
    buffer.write(struct.pack("<q2f", 2, 1.0, 2.0))
    path.write_bytes(buffer.getvalue())
    return path


class _ArrayWithState:
    """Pickles as numpy pickles an array: `_reconstruct(ndarray, (0,), b"b")`, then `state`."""

    def __init__(self, state: tuple[Any, ...]):
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        import numpy as np

        return (np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), self.state)


_SIZE = 1536 << 20  # past the 1 GiB of RSS `assert_refused` allows


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        # 0.1.x: inspect took 1.8 GB of RSS for a 380-byte file
        ("bytearray", _Reduced(bytearray, (_SIZE,)), "bytearray(1,610,612,736)"),
        # 0.1.x: listed a 1.5 GiB tensor of uninitialised memory, which convert wrote out
        ("tensor", _Reduced(torch.Tensor, (_SIZE // 4,)), "torch.Tensor(402,653,184)"),
        ("storage", _Reduced(torch.UntypedStorage, (_SIZE,)), "UntypedStorage(1,610,612,736)"),
    ],
)
def test_a_torch_pickle_that_allocates_by_a_size_is_refused_before_torch_load(
    tmp_path: Path, legacy: bool, name: str, value: Any, words: str
) -> None:
    bad = _torch_file_with(tmp_path / f"{name}.pt", {"x": value}, legacy=legacy)
    assert bad.stat().st_size < 2000
    assert_refused(ckpt_limited("inspect", bad), bad, words, "nothing was executed")
    out = tmp_path / "out"
    assert_refused(ckpt_limited("convert", bad, out, "--to", "safetensors"), bad, words)
    assert not out.exists()


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_numpy_state_short_of_its_items_is_refused_not_a_crash(
    tmp_path: Path, legacy: bool
) -> None:
    import numpy as np

    # an RNG-state-like object array declaring 10 items and carrying none: numpy 2.x reads
    # past the list (0.1.x: inspect died of SIGSEGV, exit -11, in ckpt's zip reader and in
    # torch.load with ckpt's numpy allow-list alike)
    state = (1, (10,), _Reduced(np.dtype, ("O8", False, True)), False, [])
    bad = _torch_file_with(tmp_path / "rng.pt", {"rng": _ArrayWithState(state)}, legacy=legacy)
    assert_refused(ckpt_limited("inspect", bad), bad, "10 Python objects but carries 0")
    verify = ckpt_limited("verify", bad, "--deep")
    assert_refused(verify, bad, "10 Python objects", exit_code=1)
    # numpy's own pickles of the same kinds of arrays still read, in both layouts
    good = tmp_path / "good.pt"
    saved = {
        "w": torch.ones(2).t(),
        "rng": np.random.get_state(),
        "raw": bytearray(b"abc"),
        "set": {1, 2},
    }
    torch.save(saved, good, _use_new_zipfile_serialization=not legacy)
    out = tmp_path / "out.pt"
    assert ckpt_limited("convert", good, out, "--to", "torch").exit_code == 0
    back = torch.load(out, weights_only=False)
    assert back["raw"] == bytearray(b"abc") and back["set"] == {1, 2}
    assert np.array_equal(back["rng"][1], saved["rng"][1])


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_remote_torch_file_is_checked_before_torch_load(
    hub: TestHub, tmp_path: Path, legacy: bool
) -> None:
    # a remote file is never read without torch: torch.load read every one of them unchecked
    bad = _torch_file_with(tmp_path / "bad.pt", {"x": _Reduced(bytearray, (_SIZE,))}, legacy=legacy)
    hub.add_repo("org/bad", {"pytorch_model.bin": bad.read_bytes()})
    run = ckpt_limited("inspect", "hf://org/bad")
    text = run.stdout + run.stderr
    assert run.exit_code == 4, text
    assert "pytorch_model.bin" in text and "bytearray(1,610,612,736)" in text, text
    assert run.peak_rss < 1 << 30, f"peak RSS {run.peak_rss:,}"


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_value_nested_past_pythons_recursion_is_listed_not_a_crash(
    tmp_path: Path, legacy: bool
) -> None:
    # {"d": [[[...]]]} 200,000 lists deep, written opcode by opcode (Python's pickler recurses)
    depth = 200_000
    body = b"\x80\x02}X\x01\x00\x00\x00d" + b"]" * depth + b"a" * (depth - 1) + b"s."
    bad = tmp_path / "deep.pt"
    if legacy:
        head = io.BytesIO()
        for header in (_LEGACY_MAGIC, 1001, _LEGACY_INFO):
            pickle.dump(header, head, protocol=2)
        bad.write_bytes(head.getvalue() + body + pickle.dumps([], protocol=2))
    else:
        torch_zip_with_pickle(bad, body)
    # 0.1.x: inspect ended in "internal error: RecursionError", exit 70
    run = ckpt_limited("inspect", bad)
    assert run.exit_code == 0, run.stderr
    assert "d  object:list" in run.stdout
    out = tmp_path / "out.pt"
    assert_refused(ckpt_limited("convert", bad, out, "--to", "torch"), bad, "nested too deeply")
    assert not out.exists()


# -- what PyTorch's default loader refuses ---------------------------------------------------


@pytest.mark.slow
def test_verify_warns_that_torch_load_refuses_a_namespace_naming_it(tmp_path: Path) -> None:
    saved = tmp_path / "hparams.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(seed=7)}, saved)
    with pytest.raises(pickle.UnpicklingError, match=r"argparse\.Namespace"):
        torch.load(saved, weights_only=True)  # the real default loader refuses it
    run = ckpt_limited("verify", saved, "--json")
    assert run.exit_code == 0, run.stdout + run.stderr  # a warning: ckpt reads it fine
    (problem,) = run.json["result"]["problems"]
    assert problem["code"] == "torch_load_refuses" and problem["severity"] == "warning"
    assert "argparse.Namespace" in problem["message"] and str(saved) in problem["message"]
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "step": 3}, plain)
    assert ckpt_limited("verify", plain, "--json").json["result"]["problems"] == []


# -- JSON indexes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_index_naming_300_000_missing_shards_is_verified_in_linear_time(tmp_path: Path) -> None:
    # 0.1.x scanned the whole weight map once per missing shard: 300,000 of them (a 9.5 MB
    # index) ran past a minute of CPU (killed here by RLIMIT_CPU)
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    weight_map = {f"t{i}": f"f{i}.safetensors" for i in range(300_000)}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    run = ckpt_limited("verify", folder, "--json")
    assert run.exit_code == 1, run.stderr
    result = run.json["result"]
    missing = [p for p in result["problems"] if p["code"] == "missing_shard"]
    # the first 100 listed, the other 299,900 counted in one entry of the same code
    assert len(missing) == 101
    assert missing[0]["file"] == str(folder / "f0.safetensors")
    assert "maps 1 tensors to it (t0)" in missing[0]["message"]
    assert "… and 299,900 more missing_shard problems" in missing[-1]["message"]
    assert result["errors"] == 300_000
    assert run.cpu_s < CPU_LIMIT


def _index_naming_missing_tensors(folder: Path, count: int) -> Path:
    """A real one-shard safetensors save whose index also maps `count` tensors no shard holds."""
    folder.mkdir()
    shard = "model-00001-of-00001.safetensors"
    save_file({"a": torch.ones(2)}, str(folder / shard))
    index = folder / "model.safetensors.index.json"
    # streamed: a `ckpt` process forked from a test holding the map counts it in its peak RSS
    with index.open("w") as out:
        out.write(f'{{"metadata": {{}}, "weight_map": {{"a": "{shard}"')
        for i in range(count):
            out.write(f', "model.layers.{i}.weight": "{shard}"')
        out.write("}}")
    return index


@pytest.mark.slow
def test_an_index_naming_200_000_missing_tensors_is_verified_in_bounded_memory(
    tmp_path: Path,
) -> None:
    # verify held one Problem per missing tensor (and --json dumped them all): 200,000 took
    # ~520 MB of RSS, a million ~1.5 GB; a report keeps 100 of each code and counts the rest
    index = _index_naming_missing_tensors(tmp_path / "model", 200_000)
    run = ckpt_limited("verify", tmp_path / "model", "--json")
    assert run.exit_code == 1, run.stderr
    doc = run.json
    assert doc["ok"] is False
    result = doc["result"]
    assert result["ok"] is False
    assert result["errors"] == 200_000
    missing = [p for p in result["problems"] if p["code"] == "missing_tensor"]
    assert len(result["problems"]) == len(missing) == 101
    assert "'model.layers.0.weight'" in missing[0]["message"]
    summary = missing[-1]
    assert summary["severity"] == "error"
    assert summary["file"] == str(index)
    assert "… and 199,900 more missing_tensor problems" in summary["message"]
    assert run.peak_rss < 256 << 20, f"peak RSS {run.peak_rss:,}"
    # the human report says the same: the verdict counts all of them, 50 listed
    human = ckpt_limited("verify", tmp_path / "model")
    assert human.exit_code == 1, human.stderr
    assert "FAILED: 200000 problems" in human.stdout
    assert "… 199,950 more missing_tensor (--json lists the first 100" in human.stdout
    assert human.peak_rss < 256 << 20, f"peak RSS {human.peak_rss:,}"


@pytest.mark.slow
def test_a_shard_header_of_200_000_bad_entries_is_verified_in_bounded_memory(
    tmp_path: Path,
) -> None:
    # each entry says 4 bytes of F32[1] and spans 8: a size_mismatch per tensor of one header
    # (streamed: a `ckpt` process forked from a test holding it counts it in its peak RSS)
    shard = tmp_path / "model.safetensors"
    with shard.open("wb") as out:
        out.write(bytes(8))
        for i in range(200_000):
            entry = f'"t{i}": {{"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}'
            out.write(("{" if i == 0 else ", ").encode() + entry.encode())
        out.write(b"}")
        length = out.tell() - 8
        out.write(bytes(8))
        out.seek(0)
        out.write(struct.pack("<Q", length))
    run = ckpt_limited("verify", shard, "--json")
    assert run.exit_code == 1, run.stderr
    result = run.json["result"]
    codes: dict[str, list[dict[str, Any]]] = {}
    for problem in result["problems"]:
        codes.setdefault(problem["code"], []).append(problem)
    assert "size_mismatch" in codes
    for code, listed in codes.items():
        assert len(listed) <= 101, code
    assert "more size_mismatch problems" in codes["size_mismatch"][-1]["message"]
    assert result["errors"] >= 200_000
    assert run.peak_rss < 256 << 20, f"peak RSS {run.peak_rss:,}"


@pytest.mark.slow
def test_an_index_naming_a_shard_longer_than_any_file_name_is_exit_4(tmp_path: Path) -> None:
    # 0.1.x tried to open it: exit 74 (an OS error, ENAMETOOLONG) and the whole name, 5 MB of
    # it, on stderr
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00001.safetensors"))
    index = folder / "model.safetensors.index.json"
    for shard in ("x" * 300 + ".safetensors", "x" * 5_000_000 + ".safetensors"):
        index.write_text(json.dumps({"weight_map": {"a": shard}}))
        for args in (("inspect", folder), ("convert", folder, tmp_path / "out", "--to", "dcp")):
            run = ckpt_limited(*args)
            assert_refused(run, index, "longer than any file system holds")
            assert len(run.stderr) < 2_000, run.stderr[:200]
        assert not (tmp_path / "out").exists()
        verify = ckpt_limited("verify", folder)
        assert_refused(verify, index, "unsafe_input", exit_code=1)


# -- quantization summaries --------------------------------------------------------------------


@pytest.mark.slow
def test_a_quantized_header_of_many_distinct_names_is_summarised_in_linear_time(
    tmp_path: Path,
) -> None:
    # one FP8 weight beside 60,000 scales whose weights are absent and 60,000 modules of
    # distinct names: the summary searched a list of the orphans, and one of the module
    # patterns, for each tensor (40,000 of each: 68 s of CPU; 60,000 past RLIMIT_CPU's minute)
    tensors = {
        "a.weight": torch.zeros(16, 16).to(torch.float8_e4m3fn),
        "a.weight_scale_inv": torch.ones(1, 1),
    }
    for i in range(60_000):
        tensors[f"o{i}.weight_scale_inv"] = torch.ones(1)
        tensors[f"u{i}x.proj.weight"] = torch.ones(1)
    shard = tmp_path / "model.safetensors"
    save_file(tensors, str(shard))
    run = ckpt_limited("inspect", shard, "--json")
    assert run.exit_code == 0, run.stderr
    quantization = run.json["result"]["quantization"]
    assert quantization["parameters"] == 16 * 16 + 60_000  # the scales count nothing
    assert len(quantization["unquantized"]) == 60_000


# -- DCP chunks ----------------------------------------------------------------------------------


def _dcp_with_chunks(
    path: Path, size: list[int], chunks: list[tuple[list[int], list[int]]]
) -> Path:
    """A real `dcp.save` of one tensor whose `.metadata` then claims `chunks` (offsets, sizes),
    each stored where the saved tensor is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    dcp.save({"w": torch.arange(8, dtype=torch.float32)}, checkpoint_id=path, no_dist=True)
    meta = pickle.loads((path / ".metadata").read_bytes())  # written just above by torch
    entry = meta.state_dict_metadata["w"]
    entry.size = torch.Size(size)
    entry.chunks = [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks
    ]
    stored = next(v for k, v in meta.storage_data.items() if k.fqn == "w")
    for offsets, _ in chunks:
        meta.storage_data[MetadataIndex("w", torch.Size(offsets))] = stored
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    return path


@pytest.mark.slow
def test_300_000_chunks_claiming_the_same_range_are_refused_in_linear_time(tmp_path: Path) -> None:
    # 0.1.x compared every chunk with every chunk still open along dim 0: 10,000 took 33
    # CPU-s, these hours
    bad = _dcp_with_chunks(tmp_path / "dup", [8], [([0], [8])] * 300_000)
    run = ckpt_limited("inspect", bad)
    assert_refused(run, bad, "overlap")
    verify = ckpt_limited("verify", bad, "--json")
    assert verify.exit_code == 1
    codes = [p["code"] for p in verify.json["result"]["problems"]]
    assert codes == ["dcp_overlap"] * 3


def test_chunks_of_a_grid_are_judged_as_before(tmp_path: Path) -> None:
    # a 4 x 4 grid of 2 x 2 chunks, one moved a row down: it overlaps its neighbour and leaves
    # a hole; the grid itself tiles the tensor
    grid = [([r, c], [2, 2]) for r in range(0, 8, 2) for c in range(0, 8, 2)]
    moved = [*grid[:5], ([3, 2], [2, 2]), *grid[6:]]
    bad = _dcp_with_chunks(tmp_path / "moved", [8, 8], moved)
    verify = ckpt_limited("verify", bad, "--json")
    found = [
        (p["message"], p["fix"])
        for p in verify.json["result"]["problems"]
        if p["code"] == "dcp_overlap"
    ]
    from ckpt_cli.formats.dcp.metadata import CORRUPT_METADATA_FIX

    overlap = "tensor 'w': chunks at [3, 2] and [4, 2] overlap"
    assert found == [(overlap, CORRUPT_METADATA_FIX)], found


@pytest.mark.slow  # every case a fresh process that imports torch
@pytest.mark.parametrize("crafted", ["bytearray", "numpy"])
def test_a_dcp_object_entry_is_checked_before_torch_load(tmp_path: Path, crafted: str) -> None:
    import numpy as np
    import torch.distributed.checkpoint as dcp

    # dcp.save pickles the object entry as written: the same calls as a hostile .pt's
    value = (
        _Reduced(bytearray, (_SIZE,))
        if crafted == "bytearray"
        else _ArrayWithState((1, (10,), _Reduced(np.dtype, ("O8", False, True)), False, []))
    )
    bad = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3), "rng": value}, checkpoint_id=bad, no_dist=True)
    words = "bytearray(1,610,612,736)" if crafted == "bytearray" else "10 Python objects"
    # 0.1.x: 1.8 GB of RSS, or SIGSEGV inside numpy (exit -11)
    out = tmp_path / "out"
    assert_refused(ckpt_limited("convert", bad, out, "--to", "torch"), bad, words)
    assert not out.exists()
    if crafted == "numpy":  # the bytearray is refused by verify's own scan of the pickle
        assert_refused(ckpt_limited("verify", bad, "--deep"), bad, words, exit_code=1)


# -- GGUF headers --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_gguf_of_millions_of_empty_arrays_is_refused_before_the_gguf_reader_builds_them(
    tmp_path: Path,
) -> None:
    # 0.1.x: an ARRAY of 1,000,000 empty ARRAYs (12 MB) took the gguf reader 1.3 GB and 28
    # CPU-s; 3,000,000 empty strings (48 MB), past 4 GB
    n = 1_100_000
    body = struct.pack("<IQ", 9, n) + struct.pack("<IQ", 0, 0) * n
    bad = _gguf_with_one_value(tmp_path / "arrays.gguf", 9, body)
    assert_refused(ckpt_limited("inspect", bad), bad, "more than the 1,000,000 pieces")
    assert_refused(ckpt_limited("verify", bad), bad, "gguf reader", exit_code=1)


@pytest.mark.slow
def test_a_gguf_array_of_millions_of_numbers_is_refused_before_the_gguf_reader_builds_them(
    tmp_path: Path,
) -> None:
    # the gguf reader builds a numpy view per item of a number array too: 5,000,000 floats
    # (a 20 MB file) took `inspect` 3.6 GB and 134 s; only strings and arrays were counted
    import gguf

    small = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(small), "llama")
    writer.add_array("llama.junk", [0.5] * 1000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the ground truth: one part per item (besides the key, value type, item type and count)
    assert len(gguf.GGUFReader(str(small)).fields["llama.junk"].parts) == 1000 + 5
    n = 1_500_000
    body = struct.pack("<IQ", 0, n) + bytes(n)  # an ARRAY of UINT8
    bad = _gguf_with_one_value(tmp_path / "bytes.gguf", 9, body)
    assert_refused(ckpt_limited("inspect", bad), bad, "more than the 1,000,000", "array item")
    assert_refused(ckpt_limited("verify", bad), bad, "gguf reader", exit_code=1)
    assert ckpt_limited("verify", small).exit_code == 0


@pytest.mark.slow
def test_a_gguf_of_200_000_tensor_infos_is_refused_before_the_gguf_reader_builds_them(
    tmp_path: Path,
) -> None:
    # the gguf reader builds ~5 KB of objects per tensor info (six views, a tensor, its data
    # view): 200,000 empty tensors (a 7.7 MB file) took `verify` 1.2 GB and 73 s, each counted
    # as two pieces of the 1,000,000 budget
    import gguf

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value)) + value.encode()

    def infos(n: int) -> bytes:
        one = struct.pack("<I", 1) + struct.pack("<Q", 0) + struct.pack("<IQ", 0, 0)
        kv = text("general.architecture") + struct.pack("<I", 8) + text("llama")
        data = b"GGUF" + struct.pack("<IQQ", 3, n, 1) + kv
        data += b"".join(text(f"t{i}") + one for i in range(n))
        return data + b"\0" * (-len(data) % 32) + b"\0" * 32

    small = tmp_path / "small.gguf"
    small.write_bytes(infos(3))
    # the ground truth: the reader builds a tensor (and its views) per info
    assert len(gguf.GGUFReader(str(small)).tensors) == 3
    bad = tmp_path / "many.gguf"
    bad.write_bytes(infos(200_000))
    assert_refused(ckpt_limited("inspect", bad), bad, "tensor info")
    assert_refused(ckpt_limited("verify", bad), bad, "gguf reader", exit_code=1)
    assert ckpt_limited("verify", small).exit_code == 0


@pytest.mark.slow
def test_a_gguf_with_a_llama_3_sized_tokenizer_still_reads(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(128_000)])
    writer.add_token_merges([f"a{i} b{i}" for i in range(280_000)])
    writer.add_tensor("w", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out.safetensors"
    run = ckpt_limited("convert", path, out, "--to", "safetensors")
    assert run.exit_code == 0, run.stderr
    with safe_open(str(out), "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.arange(4, dtype=torch.float32))


def test_a_dcp_tensor_of_a_million_dimensions_is_refused_in_a_short_message(tmp_path: Path) -> None:
    # 0.1.x quoted the whole size: a 3 MB error message
    dims = 1_000_000
    bad = _dcp_with_chunks(tmp_path / "dims", [1] * dims, [([0] * dims, [1] * dims)])
    run = ckpt_limited("inspect", bad)
    assert_refused(run, bad / ".metadata", "1,000,000 dimensions", "save the checkpoint again")
    assert len(run.stderr) < 1_000, run.stderr[:300]


# -- a run's JSON records: trainer_state.json, metrics.jsonl -----------------------------------


def _trainer_run(run: Path, steps: tuple[int, ...]) -> None:
    """A run folder of Trainer checkpoints: weights and the Trainer's own `trainer_state.json`
    (`TrainerState.save_to_json`, what `Trainer._save_checkpoint` writes)."""
    from transformers import TrainerState

    for step in steps:
        folder = run / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"w": torch.full((4,), float(step))}, folder / "model.safetensors")
        state = TrainerState(global_step=step, log_history=[{"step": step, "loss": 1.0 / step}])
        state.save_to_json(str(folder / "trainer_state.json"))


def test_a_sparse_4_gib_trainer_state_json_is_never_read_whole(tmp_path: Path) -> None:
    """A `trainer_state.json` extended to 4 GiB (a few bytes on disk, a sparse file) was read
    whole and parsed by `latest`, `inspect`, `verify` and `doctor` (2 GiB: 4.2 GB RSS and 10 to
    20 s each; past memory, a crash). It is past the budget of a JSON record (64 MiB): not read,
    named unreadable, and the save holding it is not the one to resume from."""
    run = tmp_path / "run"
    _trainer_run(run, (10, 20))
    state = run / "checkpoint-20" / "trainer_state.json"
    os.truncate(state, 4 << 30)
    verified = ckpt_limited("verify", run / "checkpoint-20")
    assert_refused(verified, state, "more than the 67,108,864 ckpt reads", exit_code=1)
    latest = ckpt_limited("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip().splitlines()[0] == str(run / "checkpoint-10")
    assert latest.peak_rss < 1 << 30 and latest.cpu_s < CPU_LIMIT
    inspected = ckpt_limited("inspect", run / "checkpoint-20")
    assert inspected.exit_code == 0, inspected.stdout + inspected.stderr
    assert "trainer_state.json=unreadable: is 4,294,967,296 bytes" in inspected.stdout
    assert inspected.peak_rss < 1 << 30 and inspected.cpu_s < CPU_LIMIT


def test_a_sparse_4_gib_metrics_jsonl_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """`prune --keep-best` read a run's `metrics.jsonl` whole and split it into a list of lines
    (2 GiB of a sparse file: 4.2 GB RSS, 33 s). Past the budget of a JSON record it is refused
    (exit 2, as a line that is not JSON), naming the file."""
    run = tmp_path / "run"
    _trainer_run(run, (10, 20))
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 10, "eval_loss": 2.0}\n{"step": 20, "eval_loss": 1.0}\n')
    os.truncate(metrics, 4 << 30)
    pruned = ckpt_limited("prune", run, "--keep-best", "eval_loss", "--keep-last", "1")
    assert_refused(pruned, metrics, "more than the 67,108,864 ckpt reads", exit_code=2)


def test_a_sparse_4_gib_index_in_a_run_is_refused_within_the_index_budget(tmp_path: Path) -> None:
    """`latest` judging a run read the index of each save whole (a `pytorch_model.bin.index.json`
    extended to 2 GiB: 4.2 GB RSS and minutes, where `inspect` of the save refuses it past 128
    MiB). The run's judgement reads indexes within the same budget: the save holding it is
    damaged, and the one before it is the latest."""
    run = tmp_path / "run"
    _trainer_run(run, (10, 20))
    index = run / "checkpoint-20" / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model.safetensors"}}))
    os.truncate(index, 4 << 30)
    latest = ckpt_limited("latest", run, "--json")
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.peak_rss < 1 << 30 and latest.cpu_s < CPU_LIMIT
    result = latest.json["result"]
    assert result["latest"] == str(run / "checkpoint-10")
    newest = next(c for c in result["checkpoints"] if c["name"] == "checkpoint-20")
    assert newest["status"] != "complete"
    assert "more than the 134,217,728 an index may take" in newest["reason"], newest


def test_a_sparse_file_of_a_pipeline_is_carried_a_chunk_at_a_time(
    diffusers_pipeline: Path, tmp_path: Path
) -> None:
    """`convert` of a diffusers pipeline copies its files beside the components (schedulers,
    tokenizers, notes) and read each whole: a file extended to 3 GiB (sparse, a few bytes on
    disk) took 6.3 GB and three minutes. It is copied 16 MiB at a time, its holes kept holes,
    and the copy is the file's bytes; `DiffusionPipeline.from_pretrained` loads the output."""
    from diffusers import DiffusionPipeline

    pipe = tmp_path / "pipe"
    shutil.copytree(diffusers_pipeline, pipe)
    notes = pipe / "scheduler" / "notes.txt"
    notes.write_text("tuned on the 3 GiB run\n")
    os.truncate(notes, 3 << 30)
    out = tmp_path / "out"
    run = ckpt_limited("convert", pipe, out, "--to", "safetensors")
    assert run.exit_code == 0, run.stdout + run.stderr
    assert run.peak_rss < 1 << 30, f"peak RSS {run.peak_rss:,}"
    copied = out / "scheduler" / "notes.txt"
    assert copied.stat().st_size == 3 << 30
    assert copied.stat().st_blocks * 512 < 64 << 20  # the hole is no data on disk
    with notes.open("rb") as a, copied.open("rb") as b:
        while block := a.read(64 << 20):
            assert b.read(64 << 20) == block
    DiffusionPipeline.from_pretrained(out)


def test_a_sparse_4_gib_slim_record_of_a_run_is_never_read_whole(tmp_path: Path) -> None:
    """ckpt's own record of the files `prune --slim-older-than` slimmed (`.ckpt-slim.json` in
    the run folder) was read whole by every judgement of the run: extended to 2 GiB (a sparse
    file), `latest` took 4.2 GB and 32 s. A record past the budget of a JSON record is none
    `prune` writes: it is not read, and the run is judged as without it."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        torch.save({"model": {"w": torch.ones(4)}, "step": step}, run / f"step_{step}.pt")
    record = run / ".ckpt-slim.json"
    record.write_text("{}\n")
    os.truncate(record, 4 << 30)
    latest = ckpt_limited("latest", run)
    assert latest.exit_code == 0, latest.stdout + latest.stderr
    assert latest.stdout.strip().splitlines()[0] == str(run / "step_200.pt")
    assert latest.peak_rss < 1 << 30 and latest.cpu_s < CPU_LIMIT


def test_a_sparse_4_gib_checksum_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """ckpt's own checksum manifest (`ckpt-manifest.json`, written by `verify
    --write-manifest`) was read whole by `verify --checksums`: extended to 2 GiB (a sparse
    file), 4.2 GB and 25 s. Past the budget of a JSON record (64 MiB, some 400,000 files) it
    is refused unread (exit 4), naming it and how to write it again."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(4)}, folder / "model.safetensors")
    written = ckpt_limited("verify", folder, "--write-manifest")
    assert written.exit_code == 0, written.stdout + written.stderr
    manifest = folder / "ckpt-manifest.json"
    os.truncate(manifest, 4 << 30)
    run = ckpt_limited("verify", folder, "--checksums")
    assert_refused(run, manifest, "more than the 67,108,864 ckpt reads of it", "--write-manifest")


def test_a_sparse_4_gib_refs_file_of_the_hf_cache_is_never_read_whole(
    hub: TestHub, tmp_path: Path
) -> None:
    """The HF cache's `refs/main` (a commit id) was read whole when ckpt recorded the commit a
    revision resolved to: extended to 2 GiB (a sparse file), `inspect hf://org/model` took
    4.2 GB and 23 s. At most 256 bytes of it are read: one longer names no commit, and is
    written again with the commit the Hub named."""
    from .hub_fixtures import publish_model

    commit = publish_model(hub, "org/refs", tmp_path / "src", {"w": torch.ones(4)})
    ref = Path(os.environ["HF_HOME"]) / "hub" / "models--org--refs" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text(commit)
    os.truncate(ref, 4 << 30)
    run = ckpt_limited("inspect", "hf://org/refs")
    assert run.exit_code == 0, run.stdout + run.stderr
    assert run.peak_rss < 1 << 30 and run.cpu_s < CPU_LIMIT
    assert ref.read_text() == commit


@pytest.mark.slow
def test_a_sparse_4_gib_manifest_of_a_pulled_copy_is_never_read_whole(
    s3_server: Any, tmp_path: Path
) -> None:
    """`sync` pulling a run judges the copy already here by the checksum manifest it was
    pulled with, and read that whole: extended to 4 GiB (a sparse file), the next pull died
    (exit 70 under a memory limit). Past the budget of a JSON record the local manifest is not
    read: it is not the store's, so the copy is pulled again, whole."""
    from .run_fixtures import trainer_run
    from .s3_fixtures import make_bucket

    make_bucket(s3_server.endpoint, "ckpts")
    out = trainer_run(tmp_path, steps=(100,))
    assert ckpt_limited("sync", out, "s3://ckpts/run/").exit_code == 0
    back = tmp_path / "back"
    assert ckpt_limited("sync", "s3://ckpts/run/", back).exit_code == 0
    manifest = back / "checkpoint-100" / "ckpt-manifest.json"
    os.truncate(manifest, 4 << 30)
    again = ckpt_limited("sync", "s3://ckpts/run/", back, "--json")
    assert again.exit_code == 0, again.stdout + again.stderr
    assert again.peak_rss < 1 << 30 and again.cpu_s < CPU_LIMIT
    assert again.json["result"]["checkpoints"][0]["action"] == "downloaded"
    assert manifest.stat().st_size < 1 << 20


def _zero2_save(run: Path, dp_world_size: int) -> None:
    """A ZeRO-2 tag folder of one rank (`global_step12/` + `latest`) whose model states record
    `dp_world_size`."""
    model = torch.nn.Linear(4, 2)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    tag = run / "global_step12"
    tag.mkdir(parents=True)
    (run / "latest").write_text("global_step12")
    ds_config = {"zero_optimization": {"stage": 2}}
    torch.save(
        {
            "module": model.state_dict(),
            "buffer_names": [],
            "param_shapes": [{"weight": torch.Size([2, 4]), "bias": torch.Size([2])}],
            "global_steps": 12,
            "dp_world_size": dp_world_size,
            "mp_world_size": 1,
            "ds_config": ds_config,
        },
        tag / "mp_rank_00_model_states.pt",
    )
    torch.save(
        {
            "optimizer_state_dict": {
                "single_partition_of_fp32_groups": [flat],
                "group_paddings": [0],
                "partition_count": [1],
            },
            "ds_config": ds_config,
        },
        tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )


@pytest.mark.slow
def test_a_zero_save_recording_a_trillion_ranks_is_refused_not_listed(tmp_path: Path) -> None:
    # dp_world_size names every rank whose partition must be there: a 2 KB model-states file
    # recording 10**12 made verify (and latest, prune) list 10**12 file names
    _zero2_save(tmp_path / "ok", 1)
    assert ckpt_limited("verify", tmp_path / "ok").exit_code == 0
    run = tmp_path / "run"
    _zero2_save(run, 10**12)
    model_states = run / "global_step12" / "mp_rank_00_model_states.pt"
    assert_refused(ckpt_limited("verify", run), model_states, "1,000,000,000,000")
    # the run folder's judge reads the same count from the pickle's opcodes: no complete save
    latest = ckpt_limited("latest", run)
    assert_refused(latest, model_states, "1,000,000,000,000", exit_code=latest.exit_code)
    assert latest.exit_code in (1, 3, 4), latest.stderr


@pytest.mark.parametrize(
    ("original", "numbered"),
    [
        ("random_states_0.pkl", "random_states_99999999999.pkl"),  # a rank
        ("scheduler.bin", "scheduler_99999999999.bin"),  # an object index
        ("scheduler.bin", "scheduler_1048576.bin"),  # one check per lower index: quadratic
    ],
)
@pytest.mark.slow
def test_a_file_numbered_past_any_run_is_refused_not_counted_up_to(
    tmp_path: Path, original: str, numbered: str
) -> None:
    # accelerate numbers each rank's RNG file and each object's state: every lower number
    # must be there too. One copied file named for rank 10**11 made verify check (and report
    # missing) every rank below it, until killed.
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)
    accelerator.prepare(model, optimizer, scheduler)
    save = tmp_path / "step-3"
    accelerator.save_state(str(save))
    assert ckpt_limited("verify", save).exit_code == 0
    shutil.copy(save / original, save / numbered)
    assert_refused(ckpt_limited("verify", save), save / numbered, "corrupt or crafted")
    judged = ckpt_limited("latest", tmp_path)
    assert_refused(judged, save / numbered, exit_code=judged.exit_code)
    assert judged.exit_code in (3, 4), judged.stderr


def test_shards_numbered_as_sets_of_99999_are_counted_not_listed(tmp_path: Path) -> None:
    # with no index, `x-00001-of-99999.safetensors` says 99,998 more shards of its save are
    # missing: 40 such files of 100 bytes each made verify build and describe 4 million names
    # (60 of them: 107 s and 0.9 GB)
    for i in range(40):
        save_file({f"t{i}": torch.ones(1)}, str(tmp_path / f"m{i}-00001-of-99999.safetensors"))
    run = ckpt_limited("verify", tmp_path, "--json")
    assert run.exit_code == 1, run.stderr
    problems = json.loads(run.stdout)["result"]["problems"]
    assert [p["code"] for p in problems] == ["missing_shard"] * 101
    assert problems[0]["file"] == str(tmp_path / "m0-00002-of-99999.safetensors")
    assert "3,999,820 more missing_shard" in problems[-1]["message"], problems[-1]
    assert run.peak_rss < 1 << 30 and run.cpu_s < 30, (run.peak_rss, run.cpu_s)


def test_doctor_names_a_few_of_the_ranks_an_rng_key_numbered_past_any_run_lacks(
    tmp_path: Path,
) -> None:
    # a save holding rank N's RNG state had N + 1 ranks: a 10 KB torch.save keyed
    # `rank_99999999999` made doctor list the 10**11 ranks it lacks (MemoryError, exit 70)
    model = torch.nn.Linear(2, 2)
    rng = {"torch_cpu": torch.get_rng_state()}
    state = {"model": model.state_dict(), "rng": {"rank_0": rng, "rank_99999999999": rng}}
    torch.save(state, tmp_path / "step-1.pt")
    run = ckpt_limited("doctor", tmp_path / "step-1.pt", "--json")
    assert run.exit_code == 1, run.stdout + run.stderr
    cause = json.loads(run.stdout)["result"]["causes"][0]
    assert cause["id"] == "rng_ranks_missing", cause
    assert "none for ranks 1, 2, 3, 4, 5, 6, 7, 8 and 99,999,999,990 more" in cause["evidence"][0]
    assert run.peak_rss < 1 << 30, run.peak_rss


def test_an_expert_numbered_past_any_model_is_refused_by_convert(tmp_path: Path) -> None:
    # stacking a layer's experts for torchtitan lists every expert number below the highest:
    # one renamed to `experts.99999999999` made convert build 10**11 of them (MemoryError)
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=40,
    )
    hf = tmp_path / "hf"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(hf)
    state = load_file(hf / "model.safetensors")
    for proj in ("gate", "up", "down"):
        old, new = (f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight" for e in (3, 99999999999))
        state[new] = state.pop(old)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    run = ckpt_limited("convert", hf, tmp_path / "titan", "--to", "torchtitan")
    assert_refused(run, hf, "100,000,000,000 experts", "experts.99999999999.gate_proj")
    assert not (tmp_path / "titan").exists()


def test_diff_reads_no_config_json_of_gigabytes(tmp_path: Path) -> None:
    """`diff` looks for tied weights in `config.json` when one side lacks a name: a sparse
    config.json of 1.5 GB beside the weights was read whole (1.9 GB of memory). A config
    past 16 MiB is none, as convert and export treat it."""
    from safetensors.torch import save_file

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    embed = {"model.embed_tokens.weight": torch.ones(4, 2)}
    save_file(embed, tmp_path / "a" / "model.safetensors")
    save_file({**embed, "lm_head.weight": torch.ones(4, 2)}, tmp_path / "b" / "model.safetensors")
    with open(tmp_path / "a" / "config.json", "wb") as config:
        config.truncate(1500 << 20)
    run = ckpt_limited("diff", tmp_path / "a", tmp_path / "b")
    assert run.exit_code == 1, run.stdout + run.stderr
    assert "only in B (1): lm_head.weight" in run.stdout
    assert run.peak_rss < 512 << 20, f"peak RSS {run.peak_rss:,}"


def test_a_zero_partition_numbered_past_any_run_is_no_latest(tmp_path: Path) -> None:
    # a stray `zero_pp_rank_99999999999_..._optim_states.pt` in a DeepSpeed tag folder (DeepSpeed's
    # loader and zero_to_fp32 take every `*_optim_states.pt` there): `verify` of the run refused
    # it, but `verify` of the tag folder said OK and `latest` named the save as complete
    run = tmp_path / "run"
    _zero2_save(run, 1)
    tag = run / "global_step12"
    assert ckpt_limited("latest", run, "--settle", "0").exit_code == 0
    stray = tag / "zero_pp_rank_99999999999_mp_rank_00_optim_states.pt"
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", stray)
    assert_refused(ckpt_limited("verify", run), stray, "corrupt or crafted")
    assert_refused(ckpt_limited("verify", tag), stray, "corrupt or crafted")
    judged = ckpt_limited("latest", run, "--settle", "0")
    assert judged.exit_code == 3, judged.stdout
    assert_refused(judged, stray, "corrupt or crafted", exit_code=3)


def test_a_stray_zero_partition_of_a_rank_the_save_did_not_have_is_named_and_left_out(
    tmp_path: Path,
) -> None:
    # a `zero_pp_rank_3_..._optim_states.pt` copied into a save of dp_world_size 1: DeepSpeed's
    # resume reads only ranks 0..dp_world_size-1, but zero_to_fp32 takes every
    # `*_optim_states.pt` and fails ("Expected 1 ... found 2 files"). `verify` said OK and
    # `convert --to torch` carried the stray partition into the output as `optim_states_3`.
    from .conftest import run_ckpt

    clean, run = tmp_path / "clean", tmp_path / "run"
    _zero2_save(clean, 1)
    _zero2_save(run, 1)
    tag = run / "global_step12"
    stray = tag / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", stray)
    for src in (run, tag):
        checked = run_ckpt("verify", src, "--json")
        assert checked.exit_code == 0, checked.stdout  # a warning: DeepSpeed resumes the save
        found = [p for p in checked.json["result"]["problems"] if p["code"] == "stray_partition"]
        assert len(found) == 1, checked.stdout
        assert found[0]["severity"] == "warning" and found[0]["file"] == str(stray)
        assert "dp_world_size 1" in found[0]["message"] and "zero_to_fp32" in found[0]["message"]
        assert f"Remove {stray.name}" in found[0]["fix"]
    assert run_ckpt("latest", run, "--settle", "0").stdout.strip() == str(tag)
    # convert carries the save as DeepSpeed resumes it: without the stray, which is skipped
    outs = {}
    for name, src in (("clean", clean / "global_step12"), ("stray", tag)):
        converted = run_ckpt("convert", src, tmp_path / f"{name}.out", "--to", "torch", "--json")
        assert converted.exit_code == 0, converted.stdout
        outs[name] = converted.json["result"]
        saved = torch.load(tmp_path / f"{name}.out" / "pytorch_model.bin", weights_only=True)
        outs[name]["names"] = sorted(saved)
    assert outs["stray"]["names"] == outs["clean"]["names"]
    assert not any(n.startswith("optim_states_3") for n in outs["stray"]["names"])
    skipped = {s["name"]: s["reason"] for s in outs["stray"]["skipped"]}
    assert "stray" in skipped.get(stray.name, ""), outs["stray"]["skipped"]
