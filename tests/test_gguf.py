"""GGUF files written by gguf's own GGUFWriter: inspect reads headers only (metadata, tensor
infos, quantization types, split files), verify checks structure and offsets, convert writes
the unquantized tensors to safetensors bit-exact and reports the quantized ones."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from .conftest import run_ckpt
from .dist_helpers import torchrun_env


def _reader(path: Path):  # type: ignore[no-untyped-def]
    from gguf import GGUFReader

    return GGUFReader(str(path))


def test_inspect_lists_header_ground_truth(gguf_files: Path) -> None:
    path = gguf_files / "tiny.gguf"
    reader = _reader(path)
    report = run_ckpt("inspect", path, "--json").json["result"]
    assert report["format"] == "gguf"
    by_name = {e["name"]: e for e in report["entries"]}
    assert set(by_name) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        entry = by_name[tensor.name]
        assert entry["nbytes"] == tensor.n_bytes
        if tensor.tensor_type.name == "Q8_0":
            assert entry["kind"] == "object" and "Q8_0" in entry["py_type"]
        else:
            # row-major, as torch and safetensors see it: GGUF's ne reversed
            assert entry["shape"] == list(reversed([int(d) for d in tensor.shape]))
    details = report["details"]
    assert details["tensor_types"] == {"BF16": 1, "F16": 1, "F32": 1, "Q8_0": 1}
    assert details["metadata"]["general.name"] == "tiny"
    assert details["metadata"]["tokenizer.ggml.tokens"] == "[40 × str]"
    assert report["layout"]["layout"] == "gguf"

    split = run_ckpt("inspect", gguf_files / "split", "--json").json["result"]
    assert len(split["files"]) == 2 and split["details"]["split"]["count"] == 2
    assert {e["name"] for e in split["entries"]} == set(by_name)


def test_inspect_and_verify_never_import_torch(gguf_files: Path) -> None:
    code = (
        "import sys\n"
        "from ckpt_cli.cli.app import main\n"
        "for cmd in ('inspect', 'verify'):\n"
        "    try:\n"
        f"        main([cmd, {str(gguf_files / 'tiny.gguf')!r}, '--json'])\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=torchrun_env(), capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_verify_finds_truncation_and_a_missing_split(gguf_files: Path, tmp_path: Path) -> None:
    assert run_ckpt("verify", gguf_files / "tiny.gguf").exit_code == 0
    assert run_ckpt("verify", gguf_files / "split").exit_code == 0
    cut = tmp_path / "cut.gguf"
    data = (gguf_files / "tiny.gguf").read_bytes()
    cut.write_bytes(data[: len(data) - 40])
    result = run_ckpt("verify", cut, "--json")
    assert result.exit_code == 1
    assert {p["code"] for p in result.json["result"]["problems"]} & {"truncated", "bad_checkpoint"}
    split = shutil.copytree(gguf_files / "split", tmp_path / "split")
    (split / "tiny-00002-of-00002.gguf").unlink()
    result = run_ckpt("verify", split, "--json")
    assert result.exit_code == 1
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert "missing_split" in codes


def test_convert_writes_unquantized_tensors_and_reports_quantized(
    gguf_files: Path, tmp_path: Path
) -> None:
    for src in (gguf_files / "tiny.gguf", gguf_files / "split"):
        out = tmp_path / f"{src.stem}.safetensors"
        result = run_ckpt("convert", src, out, "--to", "safetensors", "--json")
        assert result.exit_code == 0, result.stdout
        report = result.json["result"]
        assert [s["name"] for s in report["skipped"]] == ["blk.1.attn_q.weight"]
        assert "Q8_0" in report["skipped"][0]["reason"]
        got = load_file(out)
        files = [src] if src.is_file() else sorted(src.glob("*.gguf"))
        expected = {t.name: t for f in files for t in _reader(f).tensors}
        assert set(got) == {n for n, t in expected.items() if t.tensor_type.name != "Q8_0"}
        # the person reading the report sees the skipped tensor's own name, not its parent's
        human = run_ckpt(
            "convert", src, tmp_path / f"{src.stem}-2.safetensors", "--to", "safetensors"
        )
        skipped = [line for line in human.stderr.splitlines() if line.startswith("skipped")]
        assert len(skipped) == 1 and skipped[0].startswith("skipped 1 entry (Q8_0")
        assert skipped[0].endswith(": blk.1.attn_q.weight"), human.stderr
        for name, tensor in got.items():
            raw = np.asarray(expected[name].data)
            want = torch.from_numpy(raw.copy())
            if expected[name].tensor_type.name == "BF16":
                want = want.view(torch.bfloat16).reshape(tensor.shape)
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


def test_a_split_count_from_the_header_cannot_choose_the_work(tmp_path: Path) -> None:
    """`split.count` came from the header and every split it named was listed: a 176-byte
    file saying 10**9 took gigabytes and minutes. The file names (five digits) say how many
    splits there are; a header that disagrees is a problem of its own."""
    import struct

    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw

    kv = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    kv += text("split.count") + struct.pack("<I", 4) + struct.pack("<I", 10**9)
    kv += text("split.no") + struct.pack("<I", 4) + struct.pack("<I", 0)
    info = text("t") + struct.pack("<I", 1) + struct.pack("<Q", 4) + struct.pack("<IQ", 0, 0)
    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 3) + kv + info
    data += b"\0" * (-len(data) % 32) + b"\0" * 16
    split = tmp_path / "m-00001-of-00002.gguf"
    split.write_bytes(data)
    result = run_ckpt("verify", split, "--json")
    assert result.exit_code == 1, result.stdout
    codes = [p["code"] for p in result.json["result"]["problems"]]
    assert codes.count("missing_split") == 1 and "split_count_mismatch" in codes
    assert run_ckpt("inspect", split, "--json").exit_code == 4


def _write(path: Path, tensors: dict[str, np.ndarray], *, big_endian: bool = False) -> Path:
    """A GGUF file of `tensors` by gguf's own GGUFWriter (big-endian if asked)."""
    import gguf

    order = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=order)
    for name, array in tensors.items():
        writer.add_tensor(name, array.copy())  # the writer swaps big-endian data in place
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_big_endian_gguf_is_read_as_its_values(tmp_path: Path) -> None:
    """A GGUF written big-endian (GGUFWriter(endianess=BIG), as for s390x) was copied as the
    bytes lie in the file: convert wrote byte-swapped garbage (0.5 became 8.8e-44) and verify
    said OK. Every command now reads the values GGUFReader reads."""
    tensors = {
        "token_embd.weight": np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5,
        "blk.0.attn_q.weight": (np.arange(8, dtype=np.float16) - 3).reshape(2, 4),
        "blk.0.ids": np.arange(4, dtype=np.int32) * 1000,
        "blk.0.big": np.array([1, -2, 1 << 40], dtype=np.int64),
    }
    big = _write(tmp_path / "big.gguf", tensors, big_endian=True)
    little = _write(tmp_path / "little.gguf", tensors)
    # the ground truth: gguf's own reader of the big-endian file
    truth = {t.name: np.array(t.data) for t in _reader(big).tensors}
    for name, array in tensors.items():
        assert np.array_equal(truth[name].reshape(array.shape), array), name

    out = tmp_path / "out.safetensors"
    assert run_ckpt("convert", big, out, "--to", "safetensors").exit_code == 0
    got = load_file(out)
    for name, array in tensors.items():
        assert torch.equal(got[name], torch.from_numpy(array)), (name, got[name])
    pt = tmp_path / "out.pt"
    assert run_ckpt("convert", big, pt, "--to", "torch").exit_code == 0
    loaded = torch.load(pt, weights_only=True)
    for name, array in tensors.items():
        assert torch.equal(loaded[name], torch.from_numpy(array)), name

    report = run_ckpt("inspect", big, "--json").json["result"]
    assert report["details"]["byte_order"] == "big"
    assert run_ckpt("verify", big, "--deep").exit_code == 0
    same = run_ckpt("diff", big, little)
    assert same.exit_code == 0, same.stdout
    assert run_ckpt("diff", big, out).exit_code == 0
    # a file holding the byte-swapped values (what convert used to write) is not the same
    swapped = {n: a.byteswap() for n, a in tensors.items()}
    other = _write(tmp_path / "swapped.gguf", swapped)
    assert run_ckpt("diff", big, other).exit_code == 1


def test_one_file_of_a_split_set_names_the_whole_set(gguf_files: Path, tmp_path: Path) -> None:
    """Pointing at `tiny-00001-of-00002.gguf` said its sibling, right beside it, was missing
    (inspect and convert exit 4, verify exit 1): the set is read whole, as from its folder."""
    folder = gguf_files / "split"
    whole = run_ckpt("inspect", folder, "--json").json["result"]
    for name in ("tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"):
        one = folder / name
        report = run_ckpt("inspect", one, "--json")
        assert report.exit_code == 0, report.stderr
        assert len(report.json["result"]["files"]) == 2
        assert report.json["result"]["entries"] == whole["entries"]
        checked = run_ckpt("verify", one, "--json")
        assert checked.exit_code == 0, checked.stdout
        assert checked.json["result"]["files"] == 2
        out = tmp_path / f"{one.stem}.safetensors"
        assert run_ckpt("convert", one, out, "--to", "safetensors").exit_code == 0
        expected = {t.name for f in sorted(folder.glob("*.gguf")) for t in _reader(f).tensors}
        assert set(load_file(out)) == expected - {"blk.1.attn_q.weight"}  # the Q8_0 one
    # a set missing a file is still found wanting, from either file
    lone = shutil.copytree(folder, tmp_path / "lone")
    (lone / "tiny-00002-of-00002.gguf").unlink()
    result = run_ckpt("verify", lone / "tiny-00001-of-00002.gguf", "--json")
    assert result.exit_code == 1
    assert [p["code"] for p in result.json["result"]["problems"]] == ["missing_split"]


def test_a_folder_of_two_split_sets_asks_for_one(tmp_path: Path) -> None:
    """Two quantizations side by side (`m-Q4-0000k-of-00002.gguf`, `m-Q8-…`) were read as one
    4-file checkpoint: verify called it corrupt (duplicate tensors), convert blamed
    --select/--rename. The folder is refused as two plain GGUFs are; each set reads whole."""
    import gguf

    for stem, value in (("m-Q4", 1.0), ("m-Q8", 2.0)):
        for index in range(2):
            path = tmp_path / f"{stem}-{index + 1:05d}-of-00002.gguf"
            writer = gguf.GGUFWriter(str(path), "llama")
            writer.add_uint16("split.no", index)
            writer.add_uint16("split.count", 2)
            writer.add_int32("split.tensors.count", 2)
            writer.add_tensor(f"blk.{index}.attn_q.weight", np.full(4, value, np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    for command in (
        ["inspect", tmp_path],
        ["convert", tmp_path, tmp_path.with_suffix(".st"), "--to", "safetensors"],
    ):
        result = run_ckpt(*command)
        assert result.exit_code == 4, result.stderr
        assert "holds 2 split GGUF sets" in result.stderr, result.stderr
        assert "m-Q4-*-of-00002.gguf, m-Q8-*-of-00002.gguf" in result.stderr
        assert "Point at one file of the set" in result.stderr
    assert run_ckpt("verify", tmp_path).exit_code == 1
    one = run_ckpt("inspect", tmp_path / "m-Q8-00002-of-00002.gguf", "--json")
    assert one.exit_code == 0, one.stderr
    assert [e["name"] for e in one.json["result"]["entries"]] == [
        "blk.0.attn_q.weight",
        "blk.1.attn_q.weight",
    ]
    assert run_ckpt("verify", tmp_path / "m-Q4-00001-of-00002.gguf").exit_code == 0


def _quantized(path: Path, *, flip: bool = False, qtype: str = "Q8_0") -> Path:
    """A GGUF holding a quantized weight (gguf's own quantizer) and an F32 norm; `flip`
    changes one stored byte of the weight."""
    import gguf
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = quantize(x, kind).copy()
    if flip:
        q[0, 5] ^= 1
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=kind)
    writer.add_tensor("output_norm.weight", x[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_diff_compares_quantized_tensors_by_their_stored_bytes(tmp_path: Path) -> None:
    """diff of any GGUF holding quantized tensors failed with exit 4, even a file against
    itself ("ckpt does not dequantize"): a bit-for-bit comparison needs no dequantizing."""
    a = _quantized(tmp_path / "a.gguf")
    same = run_ckpt("diff", a, shutil.copy(a, tmp_path / "copy.gguf"), "--json")
    assert same.exit_code == 0, same.stdout
    assert same.json["result"]["equal"] == 2
    b = _quantized(tmp_path / "b.gguf", flip=True)
    # the ground truth: gguf's reader sees the one stored byte that differs
    qa, qb = (np.array(_reader(p).tensors[0].data) for p in (a, b))
    assert int((qa != qb).sum()) == 1
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert report["equal"] == 1
    (found,) = report["differences"]
    assert found["name"] == "blk.0.attn_q.weight" and found["status"] == "value"
    assert found["value_a"].startswith("Q8_0 tensor [4, 64], stored bytes sha256:")
    assert found["value_a"] != found["value_b"]
    other = run_ckpt("diff", a, _quantized(tmp_path / "q4.gguf", qtype="Q4_0"), "--json")
    assert other.exit_code == 1
    (found,) = other.json["result"]["differences"]
    assert (found["value_a"], found["value_b"]) == ("Q8_0 tensor [4, 64]", "Q4_0 tensor [4, 64]")
    human = run_ckpt("diff", a, b)
    assert "blk.0.attn_q.weight" in human.stdout and "stored bytes" in human.stdout


def test_verify_deep_reads_quantized_tensors_and_judges_their_values(tmp_path: Path) -> None:
    """verify --deep of a healthy quantized GGUF exited 1, one "does not deserialise" per
    Q8_0 tensor. Its blocks are now read whole and decoded block by block (gguf's own
    dequantization), so a scale turned Inf is found and the healthy file is OK."""
    good = _quantized(tmp_path / "good.gguf")
    result = run_ckpt("verify", good, "--deep", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["tensors"] == 2 and result.json["result"]["problems"] == []
    # the ground truth for the damage: gguf's reader and dequantizer see the Inf
    from gguf.quants import dequantize

    tensor = _reader(good).tensors[0]
    data = bytearray(good.read_bytes())
    data[tensor.data_offset + 34 : tensor.data_offset + 36] = np.float16(np.inf).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    broken = _reader(bad).tensors[0]
    with np.errstate(all="ignore"):
        assert np.isinf(dequantize(np.array(broken.data), broken.tensor_type)).sum() > 0
    assert run_ckpt("verify", bad).exit_code == 0  # the header is fine
    result = run_ckpt("verify", bad, "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "nonfinite" and problem["tensor"] == "blk.0.attn_q.weight"


def test_convert_skips_quantized_tensors_for_every_target(tmp_path: Path) -> None:
    """`--to safetensors` skipped a GGUF's quantized tensors and said so, while `--to torch`
    and `--to dcp` failed with exit 4 on the first one. Every target now gets the unquantized
    tensors and the same report; `--dequantize` writes the quantized one too."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = _quantized(tmp_path / "m.gguf")
    norm = torch.from_numpy(np.array(_reader(src).tensors[1].data))
    for to, dest in (("safetensors", "o.safetensors"), ("torch", "o.pt"), ("dcp", "o_dcp")):
        result = run_ckpt("convert", src, tmp_path / dest, "--to", to, "--json")
        assert result.exit_code == 0, result.stdout
        (skipped,) = result.json["result"]["skipped"]
        assert skipped["name"] == "blk.0.attn_q.weight" and "Q8_0" in skipped["reason"]
    assert set(load_file(tmp_path / "o.safetensors")) == {"output_norm.weight"}
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert list(loaded) == ["output_norm.weight"]
    assert torch.equal(loaded["output_norm.weight"], norm)
    dcp_to_torch_save(tmp_path / "o_dcp", tmp_path / "from_dcp.pt")
    loaded = torch.load(tmp_path / "from_dcp.pt", weights_only=True)
    assert list(loaded) == ["output_norm.weight"]
    assert torch.equal(loaded["output_norm.weight"], norm)

    # with --dequantize, the weight is written too (what gguf decodes, in bfloat16)
    result = run_ckpt("convert", src, tmp_path / "deq", "--to", "safetensors", "--dequantize")
    assert result.exit_code == 0, result.stderr
    written = load_file(tmp_path / "deq" / "model.safetensors")
    assert set(written) == {"blk.0.attn_q.weight", "output_norm.weight"}


def test_a_truncated_gguf_names_the_tensor_past_its_end(tmp_path: Path) -> None:
    """A GGUF cut short got `bad_checkpoint` quoting numpy's reshape error (gguf's reader
    maps every tensor first), never the documented `truncated` naming the tensor."""
    whole = _write(
        tmp_path / "m.gguf",
        {"tok_embd.weight": np.ones((4, 8), np.float32), "output_norm.weight": np.ones(8)},
    )
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-16])
    # the ground truth: gguf's own reader cannot read it
    try:
        _reader(cut)
    except ValueError:
        pass
    else:
        raise AssertionError("GGUFReader read a truncated file")
    result = run_ckpt("verify", cut, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("truncated", "output_norm.weight")
    assert f"past the end of the file ({len(data) - 16:,} bytes)" in problem["message"]
    # the verify line says the fix too, as the refusal of inspect does (it said none)
    assert problem["message"].endswith("bytes)")
    assert problem["fix"] == "The file is cut short; download it again."
    human = run_ckpt("verify", cut)
    assert "bytes). The file is cut short; download it again." in human.stdout
    for command in (["inspect", cut], ["convert", cut, tmp_path / "o", "--to", "safetensors"]):
        refused = run_ckpt(*command)
        assert refused.exit_code == 4, refused.stderr
        assert "'output_norm.weight' ends at byte" in refused.stderr
        assert "numpy" not in refused.stderr and "reshape" not in refused.stderr


def test_an_unreadable_gguf_version_or_alignment_is_named(tmp_path: Path) -> None:
    """GGUF version 1 or 4 and `general.alignment` 48 were all "truncated or corrupt;
    download it again", though a fresh download is the same bytes: each is named."""
    import struct

    import gguf

    ok = _write(tmp_path / "ok.gguf", {"output_norm.weight": np.ones(8, np.float32)})
    data = bytearray(ok.read_bytes())
    for version in (1, 4):
        data[4:8] = struct.pack("<I", version)
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(data)
        try:  # the ground truth: gguf's reader refuses the version
            _reader(path)
        except ValueError as error:
            assert f"version {version}" in str(error)
        result = run_ckpt("inspect", path, "--json")
        assert result.exit_code == 4
        message = result.json["error"]["message"]
        assert f"GGUF version {version} file" in message and "download it again" not in message
    assert "Upgrade the gguf package" in result.json["error"]["fix"]
    writer = gguf.GGUFWriter(str(tmp_path / "a48.gguf"), "llama")
    writer.add_uint32("general.alignment", 48)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_ckpt("verify", tmp_path / "a48.gguf", "--json")
    assert result.exit_code == 1
    (problem,) = result.json["result"]["problems"]
    assert "general.alignment is 48, not a power of two" in problem["message"]
    assert problem["fix"] and "download it again" not in problem["message"] + problem["fix"]


def test_a_gguf_block_type_the_gguf_package_does_not_know_is_named(tmp_path: Path) -> None:
    """A tensor of a GGML type the installed gguf package does not know (a block type llama.cpp
    added after it: MXFP4 files met gguf releases that predate it) was "not a readable GGUF
    file (ValueError: np.uint32(42) is not a valid GGMLQuantizationType) ... truncated or
    corrupt; download it again", though a fresh download is the same bytes. It is now named:
    the tensor, its type code, the package version, and the upgrade that reads it."""
    import struct
    from importlib.metadata import version

    ok = _write(tmp_path / "ok.gguf", {"blk.0.attn_q.weight": np.ones((2, 32), np.float32)})
    data = bytearray(ok.read_bytes())
    info = struct.pack("<Q", 19) + b"blk.0.attn_q.weight" + struct.pack("<IQQ", 2, 32, 2)
    at = data.index(info) + len(info)
    assert struct.unpack("<I", data[at : at + 4]) == (0,)  # F32
    data[at : at + 4] = struct.pack("<I", 42)
    path = tmp_path / "new-type.gguf"
    path.write_bytes(data)
    for command, code in (("inspect", 4), ("convert", 4)):
        args = (tmp_path / "out", "--to", "safetensors") if command == "convert" else ()
        result = run_ckpt(command, path, *args, "--json")
        assert result.exit_code == code, result.stdout
        error = result.json["error"]
        assert "'blk.0.attn_q.weight'" in error["message"] and "type 42" in error["message"]
        assert f"gguf package ({version('gguf')})" in error["message"]
        assert "pip install -U gguf" in error["fix"]
    result = run_ckpt("verify", path, "--json")
    assert result.exit_code == 1
    (problem,) = result.json["result"]["problems"]
    assert "type 42" in problem["message"] and "pip install -U gguf" in problem["fix"]


def test_inspect_counts_quantized_tensors_with_their_logical_shape(tmp_path: Path) -> None:
    """inspect of a GGUF whose weights are Q8_0 / Q4_0 said "1 tensor, 256 parameters" (the
    norm alone), and --json gave its quantized entries shape [] and dtype null."""
    import gguf
    from gguf.quants import quantize

    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, kind in (("blk.0.attn_q.weight", "Q8_0"), ("blk.0.attn_k.weight", "Q4_0")):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", x[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the ground truth: gguf's reader (ne is fastest first; row-major is its reverse)
    truth = {t.name: t for t in _reader(path).tensors}
    report = run_ckpt("inspect", path, "--json").json["result"]
    by_name = {e["name"]: e for e in report["entries"]}
    for name, tensor in truth.items():
        shape = list(reversed([int(d) for d in tensor.shape]))
        assert by_name[name]["shape"] == shape, name
        assert by_name[name]["nbytes"] == tensor.n_bytes
    assert by_name["blk.0.attn_q.weight"]["dtype"] == "Q8_0"
    assert by_name["blk.0.attn_k.weight"]["dtype"] == "Q4_0"
    assert report["tensors"] == 3 and report["objects"] == 0
    assert report["parameters"] == 2 * 64 * 256 + 256
    assert report["tensor_bytes"] == sum(int(t.n_bytes) for t in truth.values())
    assert report["bytes_by_dtype"]["Q8_0"] == truth["blk.0.attn_q.weight"].n_bytes
    human = run_ckpt("inspect", path).stdout
    assert "3 tensors, 33.02K parameters" in human and "Q4_0" in human


def test_diff_compares_the_gguf_metadata(tmp_path: Path) -> None:
    """Two GGUF files whose architecture, rope base and tokenizer differ were IDENTICAL: GGUF
    keeps the model's hyper-parameters and tokenizer in its metadata, which diff ignored."""
    import gguf

    def write(path: Path, arch: str, base: float, tokens: list[str]) -> Path:
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_rope_freq_base(base)
        writer.add_token_list(tokens)
        writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    vocab = [f"t{i}" for i in range(1000)]
    a = write(tmp_path / "a.gguf", "llama", 10000.0, vocab)
    b = write(tmp_path / "b.gguf", "qwen2", 500000.0, [*vocab[:-1], "changed"])
    same = write(tmp_path / "same.gguf", "llama", 10000.0, vocab)
    # the ground truth: gguf's reader sees the keys that differ
    fields_a, fields_b = _reader(a).fields, _reader(b).fields
    assert (
        fields_a["general.architecture"].contents() != fields_b["general.architecture"].contents()
    )
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout
    report = result.json["result"]
    assert report["equal"] == 1 and not report["differences"]
    by_key = {m["key"]: m for m in report["metadata"]}
    assert set(by_key) == {
        "general.architecture",
        "llama.rope.freq_base",
        "qwen2.rope.freq_base",
        "tokenizer.ggml.tokens",
    }
    assert (
        by_key["general.architecture"]["value_a"],
        by_key["general.architecture"]["value_b"],
    ) == (
        '"llama"',
        '"qwen2"',
    )
    assert by_key["llama.rope.freq_base"]["value_b"] is None
    # a 1000-token list differing in its last token: a summary and a digest, never the list
    tokens = by_key["tokenizer.ggml.tokens"]
    assert (
        tokens["value_a"].startswith("[1000 × str] sha256:")
        and tokens["value_a"] != tokens["value_b"]
    )
    human = run_ckpt("diff", a, b)
    assert "metadata key" in human.stdout and "general.architecture" in human.stdout
    assert run_ckpt("diff", a, same).exit_code == 0
    # only a part compared: said, not judged
    part = run_ckpt("diff", a, b, "-k", "output*", "--json")
    assert part.exit_code == 0 and "not compared" in part.json["result"]["warnings"][0]


def _with_offset_of(path: Path, out: Path, name: str, like: str) -> Path:
    """`path` with tensor `name`'s info pointing at the bytes of tensor `like` (an exact
    overlap, as a broken writer or a hand edit leaves)."""
    import struct

    reader = _reader(path)
    tensors = {t.name: t for t in reader.tensors}
    field = tensors[name].field
    at = field.offset + sum(part.nbytes for part in field.parts[:-1])  # its offset, last
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, at, tensors[like].data_offset - reader.data_offset)
    out.write_bytes(bytes(data))
    return out


def test_tensors_sharing_their_bytes_are_refused_by_every_command(tmp_path: Path) -> None:
    """Two tensor infos pointing at the same bytes: verify said `overlapping_tensors` (exit 1)
    while convert wrote the file, one tensor as a tied alias of the other (exit 0). llama.cpp's
    loader refuses such a file (each offset must follow the previous tensor), so every
    command refuses it now, naming both tensors."""
    a = np.arange(8, dtype=np.float32)
    good = _write(tmp_path / "good.gguf", {"a": a, "b": a + 100})
    bad = _with_offset_of(good, tmp_path / "bad.gguf", "b", like="a")
    # the ground truth: gguf's reader maps both names onto the same bytes
    read = {t.name: np.array(t.data) for t in _reader(bad).tensors}
    assert np.array_equal(read["a"], read["b"])

    result = run_ckpt("verify", bad, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "overlapping_tensors" and problem["tensor"] == "b"
    out = tmp_path / "out"
    for command in (
        ["convert", bad, out, "--to", "safetensors"],
        ["convert", bad, out, "--to", "torch"],
        ["inspect", bad],
        ["diff", bad, good],
    ):
        refused = run_ckpt(*command)
        assert refused.exit_code == 4, (command, refused.stdout)
        assert "bad.gguf" in refused.stderr and "'a' and 'b' overlap" in refused.stderr
        assert "llama.cpp" in refused.stderr
        assert not out.exists()
    assert run_ckpt("convert", good, out, "--to", "safetensors").exit_code == 0


def test_a_misaligned_tensor_is_refused_by_every_command_as_verify_finds_it(
    tmp_path: Path,
) -> None:
    """A tensor whose offset breaks `general.alignment` failed verify (`misaligned_tensor`)
    while convert copied it with exit 0; llama.cpp's loader refuses the file. Every command
    refuses it now."""
    import struct

    good = _write(
        tmp_path / "good.gguf",
        {"a": np.arange(8, dtype=np.float32), "c": np.arange(4, dtype=np.float32)},
    )
    reader = _reader(good)
    c = reader.tensors[1]
    at = c.field.offset + sum(part.nbytes for part in c.field.parts[:-1])
    data = bytearray(good.read_bytes())
    moved = c.data_offset - reader.data_offset + 4
    assert c.data_offset + 4 + c.n_bytes <= len(data)  # still inside the file
    struct.pack_into("<Q", data, at, moved)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    result = run_ckpt("verify", bad, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("misaligned_tensor", "c")
    out = tmp_path / "out.safetensors"
    refused = run_ckpt("convert", bad, out, "--to", "safetensors")
    assert refused.exit_code == 4, refused.stdout
    assert "bad.gguf: tensor 'c' starts at" in refused.stderr and "llama.cpp" in refused.stderr
    assert not out.exists()


def _offset_at(path: Path, name: str) -> tuple[int, int]:
    """(where tensor `name`'s data offset lies in the header, the offset): its info's last part."""
    reader = _reader(path)
    (tensor,) = [t for t in reader.tensors if t.name == name]
    at = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:-1])
    return at, int(tensor.data_offset - reader.data_offset)


def test_tensors_out_of_order_or_with_gaps_are_reported_as_llama_cpp_refuses_them(
    tmp_path: Path,
) -> None:
    """llama.cpp's loader (ggml's gguf.cpp) refuses a file whose tensor data does not follow
    the tensor infos' order, each tensor starting where the previous one ends padded to the
    alignment ("tensor 'b' has offset 0, expected 32"), but `verify` said OK and `inspect`
    nothing. Every tensor's bytes are still its own (gguf's reader reads them all), so
    `verify` fails with `noncontiguous_tensors`, `inspect` shows the file with that warning and
    exits 4 (as for a malformed safetensors file), and `convert` writes the values, saying
    the source is one llama.cpp refuses."""
    import struct

    tensors = {
        "a": np.arange(8, dtype=np.float32),
        "b": np.arange(8, dtype=np.float32) + 100,
        "c": np.arange(4, dtype=np.float32) - 7,
    }
    good = _write(tmp_path / "good.gguf", tensors)
    start = _reader(good).data_offset
    # out of order: a's and b's bytes trade places, and so do their offsets
    data = bytearray(good.read_bytes())
    (at_a, off_a), (at_b, off_b) = _offset_at(good, "a"), _offset_at(good, "b")
    struct.pack_into("<Q", data, at_a, off_b)
    struct.pack_into("<Q", data, at_b, off_a)
    bytes_a = data[start + off_a : start + off_a + 32]
    data[start + off_a : start + off_a + 32] = data[start + off_b : start + off_b + 32]
    data[start + off_b : start + off_b + 32] = bytes_a
    swapped = tmp_path / "swapped.gguf"
    swapped.write_bytes(bytes(data))
    # a gap: 64 unused bytes before c's data, its offset moved past them
    data = bytearray(good.read_bytes())
    at_c, off_c = _offset_at(good, "c")
    struct.pack_into("<Q", data, at_c, off_c + 64)
    data[start + off_c : start + off_c] = bytes(64)
    gapped = tmp_path / "gapped.gguf"
    gapped.write_bytes(bytes(data))

    for bad, name, found, expected in (
        (swapped, "a", off_b, 0),
        (gapped, "c", off_c + 64, off_c),
    ):
        # the ground truth: gguf's reader reads every tensor's own values
        read = {t.name: np.array(t.data) for t in _reader(bad).tensors}
        for key, array in tensors.items():
            assert np.array_equal(read[key], array), (bad, key)
        result = run_ckpt("verify", bad, "--json")
        assert result.exit_code == 1, result.stdout
        (problem,) = result.json["result"]["problems"]
        assert (problem["code"], problem["tensor"]) == ("noncontiguous_tensors", name)
        assert f"at data offset {found:,}" in problem["message"]
        assert f"expects {expected:,}" in problem["message"]
        assert "llama.cpp" in problem["message"] and problem["fix"]
        seen = run_ckpt("inspect", bad, "--json")
        assert seen.exit_code == 4, seen.stderr
        assert len(seen.json["result"]["entries"]) == 3
        codes = [p["code"] for p in seen.json["result"]["problems"]]
        assert codes == ["noncontiguous_tensors"]
        human = run_ckpt("inspect", bad)
        assert "noncontiguous_tensors" in human.stderr and "llama.cpp" in human.stderr
        out = tmp_path / f"{bad.stem}.safetensors"
        converted = run_ckpt("convert", bad, out, "--to", "safetensors", "--json")
        assert converted.exit_code == 0, converted.stdout
        # beside the key-values the output does not keep
        warnings = converted.json["result"]["warnings"]
        (warning,) = [w for w in warnings if "key-values" not in w]
        assert "noncontiguous" not in warning and "llama.cpp's loader expects" in warning
        got = load_file(out)
        for key, array in tensors.items():
            assert torch.equal(got[key], torch.from_numpy(array)), (bad, key)
    # gguf's writer lays tensors out in order: nothing to say
    assert run_ckpt("verify", good).exit_code == 0
    assert run_ckpt("inspect", good, "--json").json["result"]["problems"] == []


def _k_blocks(kind: str, rows: int, seed: int) -> np.ndarray:
    """`rows` rows of 256 values of K-quant `kind` blocks (gguf's numpy code cannot quantize
    them): random quants and scales with plausible fp16 `d` (and `dmin`) fields."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, 2)).astype("<f2").view(np.uint8)
    if kind == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]  # d, last
    else:
        blocks[:, 0:4] = scales  # d, dmin, first
    return blocks


def test_a_big_endian_gguf_of_quantized_tensors_is_read_as_llama_cpp_reads_it(
    tmp_path: Path,
) -> None:
    """A big-endian GGUF's quantized blocks hold their fp16 scales big-endian: gguf's
    gguf_convert_endian.py swaps them (Q4_0, Q8_0, Q4_K, Q6_K) and llama.cpp on s390x reads
    them natively. `diff` called such a file different from the little-endian one it came from
    (every quantized tensor), and `verify --deep` could not decode it (`not_checked`). Each
    block's multi-byte fields are now read as little-endian before they are compared or
    decoded, so both files are the same model and a damaged scale is found."""
    import gguf
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    little = tmp_path / "little.gguf"
    writer = gguf.GGUFWriter(str(little), "llama")
    for kind in ("Q8_0", "Q4_0"):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.0.{kind}.weight", quantize(x, qtype), raw_dtype=qtype)
    for seed, kind in enumerate(("Q4_K", "Q6_K")):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.0.{kind}.weight", _k_blocks(kind, 4, seed), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", x[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def to_order(path: Path, order: str) -> Path:
        """`path` converted in place by gguf's own gguf_convert_endian.py."""
        proc = subprocess.run(
            [sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(path), order],
            input=b"YES\n",
            capture_output=True,
            env=torchrun_env(),
        )
        assert proc.returncode == 0, proc.stderr
        return path

    big = to_order(shutil.copy(little, tmp_path / "big.gguf"), "big")
    assert big.read_bytes() != little.read_bytes()
    q8 = _reader(big).tensors[0]
    assert q8.tensor_type.name == "Q8_0"
    # the ground truth of the byte order: the Q8_0 scales are stored swapped
    stored = np.array(q8.data).reshape(-1, 34)[:, :2]
    original = np.array(_reader(little).tensors[0].data).reshape(-1, 34)[:, :2]
    assert np.array_equal(stored, original[:, ::-1])
    # and swapped back by the same tool, the file is the little-endian one again
    back = to_order(shutil.copy(big, tmp_path / "back.gguf"), "little")
    assert back.read_bytes() == little.read_bytes()

    same = run_ckpt("diff", little, big, "--json")
    assert same.exit_code == 0, same.stdout
    assert same.json["result"]["equal"] == 5
    deep = run_ckpt("verify", big, "--deep", "--json")
    assert deep.exit_code == 0, deep.stdout
    assert deep.json["result"]["problems"] == []

    # a Q8_0 scale turned Inf, written big-endian as llama.cpp on s390x would read it
    data = bytearray(big.read_bytes())
    at = q8.data_offset + 34  # the second block's scale
    data[at : at + 2] = np.array([np.inf], dtype=">f2").tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    fixed = to_order(shutil.copy(bad, tmp_path / "bad-little.gguf"), "little")
    broken = _reader(fixed).tensors[0]
    with np.errstate(all="ignore"):
        assert np.isinf(dequantize(np.array(broken.data), broken.tensor_type)).sum() > 0
    result = run_ckpt("verify", bad, "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("nonfinite", "blk.0.Q8_0.weight")
    differs = run_ckpt("diff", little, bad, "--json")
    assert differs.exit_code == 1
    assert [d["name"] for d in differs.json["result"]["differences"]] == ["blk.0.Q8_0.weight"]


def test_a_big_endian_gguf_whose_blocks_were_written_little_endian_is_named(
    tmp_path: Path,
) -> None:
    """gguf's GGUFWriter(endianess=BIG) on a little-endian machine copies quantized blocks as
    they are: their fp16 scales stay little-endian in a big-endian file, which llama.cpp on a
    big-endian machine (and gguf_convert_endian.py) reads as NaN and huge values. `verify
    --deep` says so, and how to write the file instead, rather than "resume from an earlier
    checkpoint"."""
    import gguf
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    q8 = quantize(x, gguf.GGMLQuantizationType.Q8_0)
    big = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(big), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the ground truth: the blocks are stored as the little-endian quantizer made them, and
    # gguf's own byte-order tool, reading the file as big-endian, finds NaN in them
    assert np.array_equal(np.array(_reader(big).tensors[0].data), q8)
    little = shutil.copy(big, tmp_path / "little.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(little), "little"],
        input=b"YES\n",
        capture_output=True,
        env=torchrun_env(),
    )
    assert proc.returncode == 0, proc.stderr
    tensor = _reader(little).tensors[0]
    with np.errstate(all="ignore"):
        assert np.isnan(dequantize(np.array(tensor.data), tensor.tensor_type)).sum() > 32

    result = run_ckpt("verify", big, "--deep", "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("nonfinite", "blk.0.attn_q.weight")
    assert "written little-endian into a big-endian file" in problem["message"]
    assert "GGUFWriter(endianess=BIG)" in problem["message"]
    assert "gguf-convert-endian" in problem["fix"] and "earlier checkpoint" not in problem["fix"]


def test_split_files_whose_split_no_disagrees_with_their_names_are_found(
    tmp_path: Path,
) -> None:
    """Two split files renamed into each other's places passed `verify`, though llama.cpp's
    loader checks each file's `split.no` against its place in the set ("invalid split file
    idx: 0 (file: m-00002-of-00002.gguf), expected 1"), and reads the model's metadata from
    the first file: `split_number_mismatch`, naming both numbers."""
    import gguf

    for index in range(2):
        writer = gguf.GGUFWriter(str(tmp_path / f"m-{index + 1:05d}-of-00002.gguf"), "llama")
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", 2)
        writer.add_int32("split.tensors.count", 2)
        writer.add_tensor(f"blk.{index}.w", np.full(4, index, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    assert run_ckpt("verify", tmp_path).exit_code == 0
    first, second = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    first.rename(tmp_path / "swap")
    second.rename(first)
    (tmp_path / "swap").rename(second)
    # the ground truth: gguf's reader sees each file's own split.no
    assert _reader(second).fields["split.no"].contents() == 0
    result = run_ckpt("verify", tmp_path, "--json")
    assert result.exit_code == 1, result.stdout
    problems = result.json["result"]["problems"]
    assert [p["code"] for p in problems] == ["split_number_mismatch"] * 2
    assert problems[1]["file"].endswith("m-00002-of-00002.gguf")
    assert "split.no is 0" in problems[1]["message"] and "split 2" in problems[1]["message"]
    assert "llama.cpp" in problems[1]["message"] and problems[1]["fix"]


def test_a_tensor_stored_in_two_split_files_is_refused_by_every_command(tmp_path: Path) -> None:
    """Two split files holding a tensor of the same name failed `verify` (`duplicate_tensor`)
    while `inspect` counted both and `convert` blamed options never given (exit 2, "adjust
    --select/--rename"). llama.cpp's loader refuses such a set ("tensor 'blk.w' is
    duplicated"), and which copy is the tensor cannot be told: every command refuses it, naming
    the tensor and both files."""
    import gguf

    for index in range(2):
        writer = gguf.GGUFWriter(str(tmp_path / f"m-{index + 1:05d}-of-00002.gguf"), "llama")
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", 2)
        writer.add_int32("split.tensors.count", 2)
        writer.add_tensor("blk.w", np.full(4, index, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    # the ground truth: the two files hold different values under one name
    values = [np.array(_reader(f).tensors[0].data) for f in sorted(tmp_path.glob("*.gguf"))]
    assert not np.array_equal(*values)
    result = run_ckpt("verify", tmp_path, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("duplicate_tensor", "blk.w")
    assert "m-00001-of-00002.gguf and m-00002-of-00002.gguf" in problem["message"]
    out = tmp_path.with_suffix(".safetensors")
    for command in (
        ["inspect", tmp_path],
        ["convert", tmp_path, out, "--to", "safetensors"],
        ["diff", tmp_path, tmp_path],
    ):
        refused = run_ckpt(*command)
        assert refused.exit_code == 4, (command, refused.stdout, refused.stderr)
        assert "'blk.w'" in refused.stderr and "llama.cpp" in refused.stderr
        assert "--select" not in refused.stderr
    assert not out.exists()


def test_the_first_split_files_split_count_is_checked_as_llama_cpp_reads_it(
    tmp_path: Path,
) -> None:
    """Only the last split file's `split.count` was compared with the file names: a first file
    saying 3 in a set named `-of-00002` passed `verify`, though llama.cpp takes the count from
    the first file (and looks for `m-00002-of-00003.gguf`). Each file's count is checked."""
    import gguf

    for index, count in enumerate((3, 2)):
        writer = gguf.GGUFWriter(str(tmp_path / f"m-{index + 1:05d}-of-00002.gguf"), "llama")
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", count)
        writer.add_int32("split.tensors.count", 2)
        writer.add_tensor(f"blk.{index}.w", np.full(4, index, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    # the ground truth: gguf's reader sees the first file's count
    assert _reader(tmp_path / "m-00001-of-00002.gguf").fields["split.count"].contents() == 3
    result = run_ckpt("verify", tmp_path, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert problem["code"] == "split_count_mismatch"
    assert problem["file"].endswith("m-00001-of-00002.gguf")
    assert "split.count says 3, the file names say 2" in problem["message"]


def test_metadata_strings_that_are_not_utf8_are_shown_and_compared(tmp_path: Path) -> None:
    """A token that is not valid UTF-8 (byte tokens some converters write) made the gguf
    reader's `contents()` raise, and ckpt showed the whole key as null: two files whose
    tokenizers differed in such a token were IDENTICAL to `diff`. The bytes are now shown
    with the undecodable ones escaped, and compared."""
    import gguf

    def write(path: Path, token: bytes) -> Path:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_array("tokenizer.ggml.tokens", ["a", token])
        writer.add_string("general.name", token)
        writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    a = write(tmp_path / "a.gguf", b"\xffa")
    b = write(tmp_path / "b.gguf", b"\xffb")
    # the ground truth: the stored bytes differ, and gguf's reader cannot decode them
    field = _reader(a).fields["general.name"]
    assert bytes(field.parts[field.data[0]]) == b"\xffa"
    try:
        field.contents()
    except UnicodeDecodeError:
        pass
    else:
        raise AssertionError("gguf decoded invalid UTF-8")
    metadata = run_ckpt("inspect", a, "--json").json["result"]["details"]["metadata"]
    assert metadata["general.name"] == "\\xffa"
    assert metadata["tokenizer.ggml.tokens"] == ["a", "\\xffa"]
    result = run_ckpt("diff", a, b, "--json")
    assert result.exit_code == 1, result.stdout
    keys = {m["key"] for m in result.json["result"]["metadata"]}
    assert keys == {"general.name", "tokenizer.ggml.tokens"}
    assert run_ckpt("diff", a, write(tmp_path / "same.gguf", b"\xffa")).exit_code == 0


def test_metadata_arrays_of_arrays_keep_their_nesting(tmp_path: Path) -> None:
    """GGUF arrays may hold arrays. gguf's reader flattens them (`contents()`), so ckpt showed
    `[[1, 2], [3, 4, 5]]` as `[1, 2, 3, 4, 5]`, and `diff` called it IDENTICAL to
    `[[1, 2, 3], [4, 5]]`. Each level is now read as written, in both byte orders."""
    import gguf

    def write(path: Path, nested: list[list[int]], order: gguf.GGUFEndian) -> Path:
        writer = gguf.GGUFWriter(str(path), "llama", endianess=order)
        writer.add_array("test.nested", nested)
        writer.add_array("test.words", [["a", "b"], ["c"]])
        writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    for order in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        a = write(tmp_path / f"a-{order.name}.gguf", [[1, 2], [3, 4, 5]], order)
        b = write(tmp_path / f"b-{order.name}.gguf", [[1, 2, 3], [4, 5]], order)
        # the ground truth: gguf's reader holds one sub-array per item, and flattens them
        assert _reader(a).fields["test.nested"].contents() == [1, 2, 3, 4, 5]
        metadata = run_ckpt("inspect", a, "--json").json["result"]["details"]["metadata"]
        assert metadata["test.nested"] == [[1, 2], [3, 4, 5]]
        assert metadata["test.words"] == [["a", "b"], ["c"]]
        result = run_ckpt("diff", a, b, "--json")
        assert result.exit_code == 1, result.stdout
        assert [m["key"] for m in result.json["result"]["metadata"]] == ["test.nested"]
        same = write(tmp_path / f"same-{order.name}.gguf", [[1, 2], [3, 4, 5]], order)
        assert run_ckpt("diff", a, same).exit_code == 0


def test_a_tensor_of_more_than_four_dimensions_is_reported_as_llama_cpp_refuses_it(
    tmp_path: Path,
) -> None:
    """GGUF allows at most 4 dimensions (ggml's GGML_MAX_DIMS; llama.cpp's loader refuses a
    file with more: "tensor 't' has invalid number of dimensions: 5 > 4"), but gguf's writer
    writes and its reader reads a 5-D tensor, and `verify` said OK. It is now reported
    (`too_many_dims`), `inspect` warns, and `convert` writes the tensor, saying so."""
    array = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 2, 2)
    path = _write(tmp_path / "d5.gguf", {"t": array, "ok": np.ones(4, np.float32)})
    # the ground truth: gguf's reader reads the five dimensions (fastest first)
    assert [int(d) for d in _reader(path).tensors[0].shape] == [2, 2, 1, 2, 1]
    result = run_ckpt("verify", path, "--json")
    assert result.exit_code == 1, result.stdout
    (problem,) = result.json["result"]["problems"]
    assert (problem["code"], problem["tensor"]) == ("too_many_dims", "t")
    assert "5 dimensions" in problem["message"] and "llama.cpp" in problem["message"]
    seen = run_ckpt("inspect", path, "--json")
    assert seen.exit_code == 4
    assert [p["code"] for p in seen.json["result"]["problems"]] == ["too_many_dims"]
    out = tmp_path / "out.safetensors"
    converted = run_ckpt("convert", path, out, "--to", "safetensors", "--json")
    assert converted.exit_code == 0, converted.stdout
    assert "5 dimensions" in converted.json["result"]["warnings"][0]
    assert torch.equal(load_file(out)["t"], torch.from_numpy(array))


#: the block types gguf's gguf_convert_endian.py can write big-endian
CONVERT_ENDIAN_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def _every_block_type(path: Path, *, endian: str = "little") -> Path:
    """A GGUF of one tensor per legacy and K block type (legacy quants by gguf's own
    quantizer, K-quants as random blocks with plausible scales), a stacked 3-D Q8_0 tensor, an
    F32 norm and an F16 embedding. With `endian` big: only the types gguf's
    gguf_convert_endian.py can swap, converted by it, as llama.cpp on s390x reads them."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    wanted = CONVERT_ENDIAN_TYPES if endian == "big" else None
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        if wanted and kind not in wanted:
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.0.{kind}.weight", quantize(x, qtype), raw_dtype=qtype)
    for seed, kind in enumerate(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")):
        if wanted and kind not in wanted:
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.0.{kind}.weight", _k_blocks(kind, 4, seed), raw_dtype=qtype)
    q8 = gguf.GGMLQuantizationType.Q8_0
    stacked = rng.standard_normal((2, 3, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", quantize(stacked, q8), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", x[0])
    writer.add_tensor("token_embd.weight", x[:2].astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if endian == "big":
        proc = subprocess.run(
            [sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(path), "big"],
            input=b"YES\n",
            capture_output=True,
            env=torchrun_env(),
        )
        assert proc.returncode == 0, proc.stderr
    return path


def _reference(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a little-endian GGUF as gguf itself reads it: quantized ones through
    `gguf.quants.dequantize` (float32), in torch's row-major shape."""
    from gguf.quants import dequantize

    values = {}
    for tensor in _reader(path).tensors:
        shape = [int(n) for n in reversed(tensor.shape.tolist())]
        data = np.array(tensor.data)
        if tensor.tensor_type.name in ("F32", "F16"):
            values[tensor.name] = torch.from_numpy(data.copy()).reshape(shape)
        else:
            decoded = dequantize(data, tensor.tensor_type)
            values[tensor.name] = torch.from_numpy(decoded.copy()).reshape(shape)
    return values


def test_convert_dequantize_writes_a_gguf_as_gguf_decodes_it(tmp_path: Path) -> None:
    """`convert model.gguf out --dequantize` refused every GGUF block type ("ckpt does not
    dequantize GGUF block quantization"), so a GGUF could not become a model to fine-tune. Each
    quantized tensor is now written as gguf's own `gguf.quants.dequantize` decodes it, cast
    as `tensor.to(dtype)` casts (default bfloat16, as for FP8; `--dtype fp32` keeps the
    decoded values), one tensor at a time; the unquantized tensors are copied as they are."""
    src = _every_block_type(tmp_path / "m.gguf")
    want = _reference(src)
    quantized = {n for n, e in _types(src).items() if e not in ("F32", "F16")}
    assert len(quantized) == 11

    result = run_ckpt("convert", src, tmp_path / "bf16", "--to", "safetensors", "--dequantize")
    assert result.exit_code == 0, result.stderr
    assert "11 quantized weights dequantized" in result.stdout
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in got.items():
        expected = want[name].to(torch.bfloat16) if name in quantized else want[name]
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
    assert got["blk.0.ffn_gate_exps.weight"].shape == (2, 3, 64)

    exact = run_ckpt(
        "convert", src, tmp_path / "f32", "--to", "safetensors", "--dequantize", "--dtype", "fp32"
    )
    assert exact.exit_code == 0, exact.stderr
    got = load_file(tmp_path / "f32" / "model.safetensors")
    for name, tensor in got.items():
        expected = want[name].float()  # --dtype casts the F16 embedding too
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in _reader(path).tensors}


def test_convert_dequantize_reads_a_big_endian_gguf_as_llama_cpp_does(tmp_path: Path) -> None:
    """A big-endian GGUF (gguf_convert_endian.py's, as llama.cpp on s390x reads it: each
    block's fp16 scales big-endian) dequantizes to the values of the little-endian file it
    came from, bit for bit, and its big-endian F32/F16 tensors are swapped as they stream."""
    big = _every_block_type(tmp_path / "big.gguf", endian="big")
    assert set(_types(big).values()) == {*CONVERT_ENDIAN_TYPES, "F32", "F16"}
    proc = subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(big), "little"],
        input=b"YES\n",
        capture_output=True,
        env=torchrun_env(),
    )
    assert proc.returncode == 0, proc.stderr
    little = shutil.copy(big, tmp_path / "little.gguf")
    _every_block_type(big, endian="big")  # big again, for ckpt to read
    assert big.read_bytes() != little.read_bytes()
    want = _reference(little)
    result = run_ckpt(
        "convert", big, tmp_path / "out", "--to", "safetensors", "--dequantize", "--dtype", "fp32"
    )
    assert result.exit_code == 0, result.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name].float()), name


def test_convert_dequantize_refuses_a_gguf_type_gguf_cannot_decode(tmp_path: Path) -> None:
    """A block type gguf's numpy code does not decode (Q8_K) cannot be written right: refused
    before anything is written (exit 4), naming the tensor and the type."""
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q8k = gguf.GGMLQuantizationType.Q8_K
    blocks = np.zeros((2, gguf.GGML_QUANT_SIZES[q8k][1]), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=q8k)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_ckpt("convert", path, tmp_path / "out", "--to", "safetensors", "--dequantize")
    assert result.exit_code == 4, result.stderr
    assert "'blk.0.attn_q.weight'" in result.stderr and "Q8_K" in result.stderr
    assert not (tmp_path / "out").exists()


def test_diff_dequantize_compares_a_gguf_with_its_dequantized_safetensors(
    tmp_path: Path,
) -> None:
    """`diff --dequantize` of a GGUF against a full-precision model refused the GGUF; it now
    compares the decoded values: bit-identical to its own `convert --dequantize --dtype fp32`,
    within a tolerance of the bfloat16 one, and different where one block differs."""
    src = _every_block_type(tmp_path / "m.gguf")
    for dtype in ("fp32", "bf16"):
        run_ckpt(
            "convert",
            src,
            tmp_path / dtype,
            "--to",
            "safetensors",
            "--dequantize",
            "--dtype",
            dtype,
        )
    # --ignore-dtype: --dtype fp32 cast the F16 embedding too
    same = run_ckpt("diff", src, tmp_path / "fp32", "--dequantize", "--ignore-dtype", "--json")
    assert same.exit_code == 0, same.stdout
    report = same.json["result"]
    assert report["dequantized"] == {"a": 11} and report["identical"]
    near = run_ckpt(
        "diff", src, tmp_path / "bf16", "--dequantize", "--ignore-dtype", "--rtol", "0.01"
    )
    assert near.exit_code == 0, near.stdout
    assert "gguf-Q4_K" in near.stdout
    values = load_file(tmp_path / "fp32" / "model.safetensors")
    values["blk.0.Q8_0.weight"][0, 0] += 1.0
    from safetensors.torch import save_file

    save_file(values, tmp_path / "changed.safetensors")
    differs = run_ckpt(
        "diff", src, tmp_path / "changed.safetensors", "--dequantize", "--ignore-dtype", "--json"
    )
    assert differs.exit_code == 1, differs.stdout
    names = [d["name"] for d in differs.json["result"]["differences"]]
    assert names == ["blk.0.Q8_0.weight"]


def test_convert_dequantize_counts_the_weights_it_wrote(tmp_path: Path) -> None:
    """`convert --dequantize -k` of one weight said every quantized weight of the source was
    dequantized (11); the report counts the ones the output holds."""
    src = _every_block_type(tmp_path / "m.gguf")
    args = ("--to", "safetensors", "--dequantize", "-k", "blk.0.Q4_K.*", "--json")
    result = run_ckpt("convert", src, tmp_path / "out", *args)
    assert result.exit_code == 0, result.stdout
    assert result.json["result"]["dequantized"] == 1
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {"blk.0.Q4_K.weight"}


def test_convert_dequantize_refuses_little_endian_blocks_in_a_big_endian_gguf(
    tmp_path: Path,
) -> None:
    """GGUFWriter(endianess=BIG) on a little-endian machine leaves the blocks' fp16 scales
    little-endian; read as llama.cpp on s390x reads the file they decode to NaN and huge
    values, which `convert --dequantize` wrote out with exit 0. It now refuses (exit 4),
    naming the tensor and how to write the file, and publishes nothing."""
    import gguf
    from gguf.quants import quantize

    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    big = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(big), "llama", endianess=gguf.GGUFEndian.BIG)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("blk.0.attn_q.weight", quantize(x, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_ckpt("convert", big, tmp_path / "out", "--to", "safetensors", "--dequantize")
    assert result.exit_code == 4, result.stdout
    assert "'blk.0.attn_q.weight'" in result.stderr
    assert "written little-endian into a big-endian file" in result.stderr
    assert "gguf-convert-endian" in result.stderr
    assert not (tmp_path / "out").exists()


def test_convert_dequantize_refuses_big_endian_blocks_of_a_layout_it_cannot_swap(
    tmp_path: Path,
) -> None:
    """A big-endian file's IQ4_NL blocks (a layout ckpt does not know how to swap,
    `BLOCK_FIELDS`) would decode to wrong values: refused before anything is written."""
    import gguf

    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    blocks = np.zeros((2, gguf.GGML_QUANT_SIZES[iq4][1]), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_k.weight", blocks, raw_dtype=iq4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_ckpt("convert", path, tmp_path / "out", "--to", "safetensors", "--dequantize")
    assert result.exit_code == 4, result.stdout
    assert "'blk.0.attn_k.weight'" in result.stderr and "big-endian" in result.stderr
    assert not (tmp_path / "out").exists()


def test_convert_dequantize_decodes_every_block_type_gguf_decodes(tmp_path: Path) -> None:
    """Every quantized type gguf's `gguf.quants.dequantize` decodes (IQ…, TQ…, MXFP4 and NVFP4
    too), random blocks: `--dequantize --dtype fp32` writes its values bit for bit (NaN and
    Inf of random scales included, compared as bits)."""
    import gguf
    from gguf.quants import dequantize

    plain = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}
    rng = np.random.default_rng(3)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    want: dict[str, torch.Tensor] = {}
    for kind, (per_block, size) in gguf.GGML_QUANT_SIZES.items():
        if kind.name in plain:
            continue
        blocks = rng.integers(0, 256, (2, 2 * size), dtype=np.uint8)  # 2 rows of 2 blocks
        try:
            with np.errstate(all="ignore"):
                values = dequantize(blocks, kind)
        except NotImplementedError:
            continue  # Q8_K...: refused, see the test above
        name = f"blk.0.{kind.name}.weight"
        writer.add_tensor(name, blocks, raw_dtype=kind)
        want[name] = torch.from_numpy(values.copy()).reshape(2, 2 * per_block)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert {"IQ2_XXS", "IQ4_XS", "TQ1_0", "MXFP4", "Q6_K"} <= {n.split(".")[2] for n in want}

    result = run_ckpt(
        "convert", path, tmp_path / "out", "--to", "safetensors", "--dequantize", "--dtype", "fp32"
    )
    assert result.exit_code == 0, result.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor.view(torch.int32), want[name].view(torch.int32)), name


def _llama_gguf(
    path: Path,
    qtype: str,
    *,
    tied: bool = False,
    rope_scaling: dict[str, object] | None = None,
    architecture: str = "llama",
    qwen3_head_dim: int | None = None,
    bias: bool = True,
) -> dict[str, torch.Tensor]:
    """A tiny random `LlamaForCausalLM` (GQA: 4 heads, 2 kv heads) written as llama.cpp's
    `convert_hf_to_gguf.py` writes a Llama: its tensor names (gguf's own name map), q/k rows
    permuted by `LlamaModel.permute`, the metadata llama.cpp's loader reads, a Llama 3
    rope scaling as the `rope_freqs.weight` factor table; weights of 2 dims in `qtype` (`F32`,
    `F16` or a block type), norms F32. With `qwen3_head_dim`, a `Qwen3ForCausalLM` of that
    head width written as llama.cpp writes a Qwen3 (rows as they are, `attention.key_length`).
    With `architecture` qwen2, a `Qwen2ForCausalLM` (q/k/v biases, made random so a mix-up
    shows; `bias` False: a Llama's tensors under that architecture) written as llama.cpp
    writes a Qwen2 (rows as they are, biases F32). Returns the model's state dict."""
    import math

    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    heads, kv_heads, dim, theta = 4, 2, 64, 500000.0
    qwen3 = qwen3_head_dim is not None
    qwen2 = architecture == "qwen2" and bias
    head_dim = qwen3_head_dim or dim // heads
    config_class = Qwen3Config if qwen3 else Qwen2Config if qwen2 else LlamaConfig
    config = config_class(
        head_dim=head_dim,
        vocab_size=64,
        hidden_size=dim,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    model_class = Qwen3ForCausalLM if qwen3 else Qwen2ForCausalLM if qwen2 else LlamaForCausalLM
    model = model_class(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in state:
        if name.endswith(".bias"):  # transformers initialises them to zeros
            state[name] = torch.randn_like(state[name])

    def permute(weights: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's, verbatim
        return (
            weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    kind = (
        gguf.MODEL_ARCH.QWEN3
        if qwen3
        else gguf.MODEL_ARCH.QWEN2
        if qwen2
        else gguf.MODEL_ARCH.LLAMA
    )
    names = gguf.get_tensor_name_map(kind, config.num_hidden_layers)
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(96)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    if qwen3:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(64)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(64)])
    writer.add_bos_token_id(60)
    writer.add_eos_token_id(61)
    if rope_scaling is not None and rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope_scaling["factor"]))  # type: ignore[arg-type]
    elif rope_scaling is not None:  # llama.cpp's LlamaModel.generate_extra_tensors
        head_dim = dim // heads
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factor = float(rope_scaling["factor"])  # type: ignore[arg-type]
        low, high = 8192 / 1.0, 8192 / 4.0
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high:
                factors.append(1)
            elif wavelen > low:
                factors.append(factor)
            else:
                smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", torch.tensor(factors).float().numpy())
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if qwen3 or qwen2:
            pass  # llama.cpp writes a Qwen3's and a Qwen2's rows as they are (NEOX rope)
        elif name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if data.ndim == 1 or qtype == "F32":
            writer.add_tensor(target, data.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            kind = GGMLQuantizationType[qtype]
            blocks = quantize(data, kind)
            writer.add_tensor(target, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def test_convert_to_hf_gives_the_model_transformers_loads_from_the_gguf(tmp_path: Path) -> None:
    """`convert model.gguf out/ --to hf` refused every GGUF ("no known model architecture
    matches these tensor names"): `--to safetensors` gave llama.cpp's names, its q/k row
    order and no config.json, no model transformers loads. A Llama GGUF now exports as a
    `from_pretrained` folder: transformers' names, q/k rows permuted back, config.json from
    the metadata; its state dict equals transformers' own GGUF load bit for bit (F32, F16 with
    tied embeddings, Q8_0 dequantized), and the F32 one the model it was written from."""
    from transformers import AutoModelForCausalLM

    for qtype, tied in (("F32", False), ("F16", True), ("Q8_0", False)):
        src = tmp_path / qtype / "model.gguf"
        src.parent.mkdir()
        original = _llama_gguf(src, qtype, tied=tied)
        out = tmp_path / f"{qtype}-hf"
        options = ["--dequantize"] if qtype == "Q8_0" else []
        result = run_ckpt("convert", src, out, "--to", "hf", "--dtype", "fp32", *options)
        assert result.exit_code == 0, result.stderr
        assert "llama3: gguf names -> hf names" in result.stdout
        assert "4 rotary-permute" in result.stdout
        assert "tokenizer" in result.stderr and "gguf_file='model.gguf'" in result.stderr

        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
        assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 500000.0
        assert (config["bos_token_id"], config["eos_token_id"]) == (60, 61)
        assert config["tie_word_embeddings"] is tied

        reference = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        ).state_dict()
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert set(got) == set(reference)
        for name, tensor in got.items():
            assert torch.equal(tensor, reference[name]), (qtype, name)
        if qtype == "F32":
            for name, tensor in got.items():
                assert torch.equal(tensor, original[name]), name


def test_convert_to_hf_reads_llama_3_rope_scaling_from_the_gguf_factor_table(
    tmp_path: Path,
) -> None:
    """llama.cpp keeps a Llama 3.1 rope scaling as a `rope_freqs.weight` table of factors,
    not metadata. The export recognises the table llama.cpp computes and writes the scaling
    into config.json, so the model runs as the one converted (transformers' own GGUF load
    drops it); a table that is no such scaling is refused (exit 4), not dropped. A linear
    scaling (`rope.scaling.type`) is written as transformers spells it."""
    from transformers import AutoModelForCausalLM

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    src = tmp_path / "model.gguf"
    original = _llama_gguf(src, "F32", rope_scaling=dict(scaling))  # the config takes it over
    result = run_ckpt("convert", src, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == scaling
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    got = model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in original.items())

    linear = {"rope_type": "linear", "factor": 2.0}
    _llama_gguf(tmp_path / "linear.gguf", "F32", rope_scaling=dict(linear))
    result = run_ckpt("convert", tmp_path / "linear.gguf", tmp_path / "linear", "--to", "hf")
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "linear" / "config.json").read_text())
    assert config["rope_scaling"] == linear
    assert config["rope_parameters"] == {**linear, "rope_theta": 500000.0}

    # the same model with a table no llama3 scaling gives
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(src))
    bent = tmp_path / "bent.gguf"
    writer = GGUFWriter(str(bent), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1])
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "rope_freqs.weight":
            data = data * 1.5
        writer.add_tensor(tensor.name, data.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused = run_ckpt("convert", bent, tmp_path / "bent-hf", "--to", "hf")
    assert refused.exit_code == 4, refused.stderr
    assert "rope_freqs.weight" in refused.stderr and "llama3" in refused.stderr
    assert not (tmp_path / "bent-hf").exists()


def test_convert_to_hf_refuses_a_gguf_architecture_it_does_not_map(tmp_path: Path) -> None:
    """A GGUF of an architecture ckpt has no rules for (a `gemma`) is refused naming its
    architecture (exit 4), nothing written; a `qwen2` file holding a Llama's tensors (no q/k/v
    biases) is refused as metadata and tensors that disagree."""
    src = tmp_path / "gemma.gguf"
    _llama_gguf(src, "F32", architecture="gemma")
    result = run_ckpt("convert", src, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 4, result.stderr
    assert "llama.cpp architecture 'gemma'" in result.stderr
    assert "--to safetensors" in result.stderr
    assert not (tmp_path / "hf").exists()
    src = tmp_path / "qwen2.gguf"
    _llama_gguf(src, "F32", architecture="qwen2", bias=False)
    result = run_ckpt("convert", src, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 4, result.stderr
    assert "architecture 'qwen2', but its tensors are named as a Llama 3" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_maps_a_qwen2_gguf(tmp_path: Path) -> None:
    """`convert qwen2.gguf out/ --to hf` was refused ("llama.cpp architecture 'qwen2', which
    ckpt does not map"), though Qwen2 and Qwen2.5 are among the most downloaded GGUFs. A
    llama.cpp `qwen2` file (q/k/v biases, rows as they are) now exports as a
    `Qwen2ForCausalLM` folder: equal bit for bit to transformers' own GGUF load and, from F32,
    to the model it was written from (biases included); tied embeddings (Qwen2.5-0.5B's) and
    Q8_0 weights with --dequantize too."""
    from transformers import AutoModelForCausalLM

    for qtype, tied in (("F32", False), ("Q8_0", True)):
        src = tmp_path / qtype / "model.gguf"
        src.parent.mkdir()
        original = _llama_gguf(src, qtype, architecture="qwen2", tied=tied)
        out = tmp_path / f"{qtype}-hf"
        options = ["--dequantize"] if qtype == "Q8_0" else []
        result = run_ckpt("convert", src, out, "--to", "hf", "--dtype", "fp32", *options)
        assert result.exit_code == 0, result.stderr
        assert "qwen2: gguf names -> hf names" in result.stdout
        config = json.loads((out / "config.json").read_text())
        assert (config["architectures"], config["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
        assert config["tie_word_embeddings"] is tied
        assert "attention_bias" not in config  # Qwen2 reads none: its biases are always there
        reference = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        ).state_dict()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        got = model.state_dict()
        assert set(got) == set(reference)
        assert "model.layers.1.self_attn.v_proj.bias" in got
        for name, tensor in got.items():
            assert torch.equal(tensor, reference[name]), (qtype, name)
        if qtype == "F32":
            for name, tensor in got.items():
                assert torch.equal(tensor, original[name]), name


def test_convert_to_hf_maps_a_qwen3_gguf(tmp_path: Path) -> None:
    """A llama.cpp `qwen3` GGUF (q/k norms, rows as they are) exports as a `Qwen3ForCausalLM`
    folder equal to the model it was written from, with a head width other than hidden/heads
    (read from `attention.key_length`); at Qwen3's head width of 128 (the only one
    transformers' own GGUF load builds: it reads no head_dim), equal to that load bit for bit."""
    from transformers import AutoModelForCausalLM

    for head_dim in (16, 128):
        src = tmp_path / f"qwen3-{head_dim}" / "model.gguf"
        src.parent.mkdir()
        original = _llama_gguf(src, "F32", architecture="qwen3", qwen3_head_dim=head_dim)
        out = tmp_path / f"hf-{head_dim}"
        result = run_ckpt("convert", src, out, "--to", "hf")
        assert result.exit_code == 0, result.stderr
        assert "qwen3: gguf names -> hf names" in result.stdout
        config = json.loads((out / "config.json").read_text())
        assert (config["architectures"], config["head_dim"]) == (["Qwen3ForCausalLM"], head_dim)
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert set(got) == set(original)
        for name, tensor in got.items():
            assert torch.equal(tensor, original[name]), name
        if head_dim == 128:
            reference = AutoModelForCausalLM.from_pretrained(
                src.parent, gguf_file=src.name, dtype=torch.float32
            ).state_dict()
            assert all(torch.equal(got[n], reference[n]) for n in reference)


def _qwen3_moe_gguf(path: Path, qtype: str, *, moe_ffn: int = 32) -> dict[str, torch.Tensor]:
    """A tiny random `Qwen3MoeForCausalLM` (4 experts, 2 per token) written as llama.cpp's
    `convert_hf_to_gguf.py` writes a Qwen3-MoE: each layer's experts stacked into
    `ffn_{gate,up,down}_exps` (`[E, F, D]` / `[E, D, F]` row-major), the router as
    `ffn_gate_inp`, the metadata its loader reads; 2-D and 3-D weights in `qtype`, norms F32.
    Returns the model's state dict as saved (one tensor per expert)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    experts, layers = 4, 2
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=moe_ffn,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    saved = path.parent / "hf-original"
    Qwen3MoeForCausalLM(config).save_pretrained(saved)
    state = load_file(saved / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(moe_ffn)
    writer.add_vocab_size(64)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(64)])

    def add(target: str, data: np.ndarray) -> None:
        if data.ndim == 1 or qtype == "F32":
            writer.add_tensor(target, data.astype(np.float32))
        else:
            kind = GGMLQuantizationType[qtype]
            blocks = quantize(data, kind)
            writer.add_tensor(target, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    for name, tensor in state.items():
        if ".mlp.experts." in name:
            continue  # stacked below, as llama.cpp's converter stacks them
        target = names.get_name(name, try_suffixes=(".weight",))
        assert target is not None, name
        add(target, tensor.float().numpy())
    for layer in range(layers):
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stack = [
                state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].float().numpy()
                for e in range(experts)
            ]
            add(f"blk.{layer}.ffn_{short}_exps.weight", np.stack(stack))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def test_convert_to_hf_maps_a_qwen3_moe_gguf(tmp_path: Path) -> None:
    """`convert qwen3moe.gguf out/ --to hf` was refused ("llama.cpp architecture 'qwen3moe',
    which ckpt does not map"). A llama.cpp `qwen3moe` file (router `ffn_gate_inp`, each
    layer's experts stacked `[E, F, D]` in `ffn_*_exps`) now exports as a
    `Qwen3MoeForCausalLM` folder, one tensor per expert as save_pretrained writes them, with
    the expert count, experts per token, expert width and llama.cpp's renormalised top-k in
    config.json: from F32 equal to the model it was written from; from Q8_0 (--dequantize),
    at the expert width 768 transformers' own GGUF load assumes (it reads none), equal to that
    load bit for bit."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "f32" / "model.gguf"
    src.parent.mkdir()
    original = _qwen3_moe_gguf(src, "F32")
    out = tmp_path / "f32-hf"
    result = run_ckpt("convert", src, out, "--to", "hf")
    assert result.exit_code == 0, result.stderr
    assert "qwen3-moe: gguf names -> hf names" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert (config["moe_intermediate_size"], config["norm_topk_prob"]) == (32, True)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(original)
    for name, tensor in got.items():
        assert torch.equal(tensor, original[name]), name
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"

    src = tmp_path / "q8" / "model.gguf"
    src.parent.mkdir()
    _qwen3_moe_gguf(src, "Q8_0", moe_ffn=768)
    out = tmp_path / "q8-hf"
    result = run_ckpt("convert", src, out, "--to", "hf", "--dequantize", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    reference = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    ).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(got) == set(reference)
    for name, tensor in got.items():
        assert torch.equal(tensor, reference[name]), name


def _counting(read: Any, lengths: list[int]) -> Any:
    """`read` (a storage's `read(rel, offset, length)`) recording each length it is asked."""

    def counted(rel: str, offset: int, length: int) -> bytes:
        lengths.append(length)
        data: bytes = read(rel, offset, length)
        return data

    return counted


def test_convert_to_hf_maps_a_mixtral_gguf(tmp_path: Path) -> None:
    """llama.cpp converts a Mixtral as a `llama` GGUF (q/k rows permuted as a Llama's) with a
    router `ffn_gate_inp` and each layer's experts stacked in `ffn_*_exps`. `--to hf` refused
    it ("no known model architecture matches ... no rule for ffn_gate_inp"); transformers' own
    GGUF load builds a LlamaForCausalLM without its experts. It now exports as a
    `MixtralForCausalLM` folder equal bit for bit to the model it was written from (from F32;
    from Q8_0 with --dequantize, to the values gguf decodes), expert count and experts per
    token in config.json; so does a file of llama.cpp's older layout, one tensor per expert
    (`ffn_gate.0.weight`: most Mixtral GGUFs published), which llama.cpp still loads."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    def permute(weights: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's, verbatim
        return (
            weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    torch.manual_seed(0)
    experts, layers = 4, 2
    config = MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=128,
    )  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path / "original")
    state = load_file(tmp_path / "original" / "model.safetensors")
    for qtype, stacked in (("F32", True), ("Q8_0", True), ("F32", False)):
        path = tmp_path / f"mixtral-{qtype}-{stacked}.gguf"
        writer = GGUFWriter(str(path), "llama")
        writer.add_name("Mixtral")
        writer.add_block_count(layers)
        writer.add_context_length(128)
        writer.add_embedding_length(64)
        writer.add_feed_forward_length(32)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(1000000.0)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_vocab_size(64)
        want: dict[str, torch.Tensor] = {}

        def add(
            target: str,
            data: np.ndarray,
            hf: list[str],
            writer: GGUFWriter = writer,
            qtype: str = qtype,
            want: dict[str, torch.Tensor] = want,
        ) -> None:
            if data.ndim == 1 or qtype == "F32":
                writer.add_tensor(target, data.astype(np.float32))
                decoded = data.astype(np.float32)
            else:
                kind = GGMLQuantizationType[qtype]
                blocks = quantize(data, kind)
                writer.add_tensor(target, blocks, raw_shape=blocks.shape, raw_dtype=kind)
                decoded = dequantize(blocks, kind).reshape(data.shape)
            parts = [decoded] if len(hf) == 1 else list(decoded)
            for name, part in zip(hf, parts, strict=True):
                want[name] = torch.from_numpy(np.ascontiguousarray(part))

        plain = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }
        for hf, native in plain.items():
            add(native, state[hf].numpy(), [hf])
        for n in range(layers):
            hf = f"model.layers.{n}."
            attn = {"q": (4, True), "k": (2, True), "v": (0, False), "o": (0, False)}
            for short, (heads, permuted) in attn.items():
                name = f"{hf}self_attn.{short}_proj.weight"
                data = state[name].numpy()
                data = permute(data, heads) if permuted else data
                target = "attn_output" if short == "o" else f"attn_{short}"
                # decoded rows permuted back, as transformers holds them
                add(f"blk.{n}.{target}.weight", data, [name])
                if permuted:
                    rows = want[name].numpy()
                    back = rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1)
                    want[name] = torch.from_numpy(back.swapaxes(2, 1).reshape(rows.shape).copy())
            add(f"blk.{n}.attn_norm.weight", state[f"{hf}input_layernorm.weight"].numpy(),
                [f"{hf}input_layernorm.weight"])  # fmt: skip
            add(f"blk.{n}.ffn_norm.weight", state[f"{hf}post_attention_layernorm.weight"].numpy(),
                [f"{hf}post_attention_layernorm.weight"])  # fmt: skip
            router = f"{hf}block_sparse_moe.gate.weight"
            add(f"blk.{n}.ffn_gate_inp.weight", state[router].numpy(), [router])
            for w, short in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                names = [f"{hf}block_sparse_moe.experts.{e}.{w}.weight" for e in range(experts)]
                stack = np.stack([state[name].numpy() for name in names])
                if stacked:
                    add(f"blk.{n}.ffn_{short}_exps.weight", stack, names)
                else:  # llama.cpp's layout before April 2024, still loaded
                    for e, name in enumerate(names):
                        add(f"blk.{n}.ffn_{short}.{e}.weight", stack[e], [name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

        out = tmp_path / f"hf-{qtype}-{stacked}"
        options = ["--dequantize"] if qtype == "Q8_0" else []
        result = run_ckpt("convert", path, out, "--to", "hf", "--dtype", "fp32", *options)
        assert result.exit_code == 0, result.stderr
        assert "mixtral: gguf names -> hf names" in result.stdout
        config_json = json.loads((out / "config.json").read_text())
        assert config_json["architectures"] == ["MixtralForCausalLM"]
        assert (config_json["num_local_experts"], config_json["num_experts_per_tok"]) == (4, 2)
        assert config_json["intermediate_size"] == 32
        got = load_file(out / "model.safetensors")
        assert set(got) == set(state)
        for name, tensor in got.items():
            assert torch.equal(tensor, want[name]), (qtype, name)
            if qtype == "F32":
                assert torch.equal(tensor, state[name]), name
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert type(model).__name__ == "MixtralForCausalLM"
        inspected = run_ckpt("inspect", path, "--json").json["result"]["architecture"]
        assert (inspected["architecture"], inspected["naming"]) == ("mixtral", "gguf")


def test_convert_to_hf_refuses_an_expert_count_the_experts_do_not_have(tmp_path: Path) -> None:
    """A Qwen3-MoE GGUF of 4 experts per layer whose metadata says 8 (or 9 experts per token)
    was exported with exit 0: a config.json of 8 experts over a router of 4 rows and 4 experts'
    tensors, which transformers loads without a word. Held against the tensors as a
    config.json is, it is refused (exit 4), naming the count and the tensors', nothing
    written."""
    from gguf import GGUFValueType

    src = tmp_path / "model.gguf"
    _qwen3_moe_gguf(src, "F32")
    u32 = GGUFValueType.UINT32
    for case, key, value, said in (
        (
            "count",
            "qwen3moe.expert_count",
            8,
            "num_experts=8, where the tensors have num_experts=4",
        ),
        ("used", "qwen3moe.expert_used_count", 9, "experts_per_token=9, more than the 4 experts"),
    ):
        bent = _with_metadata(src, tmp_path / f"{case}.gguf", {key: (value, u32)})
        out = tmp_path / f"{case}-hf"
        result = run_ckpt("convert", bent, out, "--to", "hf")
        assert result.exit_code == 4, (case, result.stderr)
        assert said in result.stderr, (case, result.stderr)
        assert not out.exists(), case


def test_one_expert_of_a_gguf_expert_stack_reads_only_its_own_bytes(tmp_path: Path) -> None:
    """`--to hf` of a Qwen3-MoE GGUF writes each expert from its box of the layer's stack.
    Reading one box read (and, quantized, decoded) the whole stack: E times the work per
    tensor, hours for a 128-expert model. A box along the experts' dimension now reads only
    that expert's bytes (its blocks, whole, for a quantized stack), with the same values."""
    from ckpt_cli.formats import open_checkpoint
    from ckpt_cli.quant.dequant import BlockDequantizedCheckpoint

    for qtype in ("F32", "Q8_0"):
        src = tmp_path / qtype / "model.gguf"
        src.parent.mkdir()
        _qwen3_moe_gguf(src, qtype)
        checkpoint = open_checkpoint(str(src))
        name = "blk.1.ffn_down_exps.weight"
        entry = checkpoint.manifest.by_name[name]
        experts, rows, cols = entry.shape
        view = checkpoint if qtype == "F32" else BlockDequantizedCheckpoint(checkpoint, "float32")
        whole = view.read_tensor(name)
        reads: list[int] = []
        checkpoint.storage.read = _counting(checkpoint.storage.read, reads)  # type: ignore[method-assign]
        for expert in range(experts):
            reads.clear()
            box = view.read_slice(name, [expert, 0, 0], [1, rows, cols])
            assert torch.equal(box, whole[expert : expert + 1]), (qtype, expert)
            assert sum(reads) == entry.nbytes // experts, (qtype, reads)
        # a box that is no run of whole experts is still read right
        assert torch.equal(view.read_slice(name, [1, 2, 0], [2, 3, cols]), whole[1:3, 2:5])


def test_convert_to_hf_of_a_k_quant_gguf_equals_transformers_own_load(tmp_path: Path) -> None:
    """A Llama GGUF of K-quant weights (each of Q2_K...Q6_K, as a Q4_K_M or Q6_K download mixes
    them; random blocks with plausible fp16 scales in each type's own scale fields, since
    gguf's numpy code cannot quantize them) exports with `--to hf --dequantize --dtype fp32`
    to the state dict transformers' own GGUF load builds, bit for bit: every block decoded as
    `gguf.quants.dequantize` decodes it, q/k rows permuted back after decoding."""
    import gguf
    from gguf import GGUFWriter
    from transformers import AutoModelForCausalLM

    from ckpt_cli.formats.gguf.format import BLOCK_FIELDS

    rng = np.random.default_rng(11)

    def k_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
        qtype = gguf.GGMLQuantizationType[kind]
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for start, width in BLOCK_FIELDS[kind]:  # each fp16 d / dmin: a small scale
            scale = rng.uniform(1e-3, 1e-2, len(blocks)).astype("<f2").view(np.uint8)
            blocks[:, start : start + width] = scale.reshape(-1, width)
        return blocks.reshape(rows, cols // 256 * size)

    dim, ffn, layers = 256, 512, 2
    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(dim // 4)
    writer.add_vocab_size(64)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(64)])

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        blocks = k_blocks(kind, rows, cols)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)

    add("token_embd.weight", "Q6_K", 64, dim)
    for n in range(layers):
        add(f"blk.{n}.attn_q.weight", "Q4_K", dim, dim)
        add(f"blk.{n}.attn_k.weight", "Q5_K", dim // 2, dim)
        add(f"blk.{n}.attn_v.weight", "Q6_K", dim // 2, dim)
        add(f"blk.{n}.attn_output.weight", "Q3_K", dim, dim)
        add(f"blk.{n}.ffn_gate.weight", "Q2_K", ffn, dim)
        add(f"blk.{n}.ffn_up.weight", "Q4_K", ffn, dim)
        add(f"blk.{n}.ffn_down.weight", "Q5_K", dim, ffn)
        writer.add_tensor(f"blk.{n}.attn_norm.weight", rng.standard_normal(dim).astype(np.float32))
        writer.add_tensor(f"blk.{n}.ffn_norm.weight", rng.standard_normal(dim).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(dim).astype(np.float32))
    add("output.weight", "Q6_K", 64, dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert set(_types(path).values()) == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F32"}

    out = tmp_path / "hf"
    result = run_ckpt("convert", path, out, "--to", "hf", "--dequantize", "--dtype", "fp32")
    assert result.exit_code == 0, result.stderr
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(got) == set(reference)
    for name, tensor in got.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, reference[name]), name


def test_convert_to_hf_of_a_quantized_gguf_asks_for_dequantize(tmp_path: Path) -> None:
    """`--to hf` of a Q8_0 GGUF without `--dequantize` said "no known model architecture
    matches these 5 tensor names ... needs tensors this model lacks: 'token_embd.weight'", as
    if the file were no Llama: its quantized weights were no tensors to map. It now says the
    file holds quantized blocks and names `--dequantize` (exit 4, nothing written)."""
    src = tmp_path / "model.gguf"
    _llama_gguf(src, "Q8_0")
    result = run_ckpt("convert", src, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 4, result.stderr
    assert "Q8_0" in result.stderr and "--dequantize" in result.stderr
    assert "no known model architecture" not in result.stderr
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_refuses_gguf_metadata_that_does_not_fit_the_tensors(
    tmp_path: Path,
) -> None:
    """A GGUF whose metadata says 4 key/value heads over k projections of 2 heads' rows was
    exported with exit 0: k rows permuted per the wrong head count and a config.json that
    `from_pretrained` refuses (size mismatch). The metadata is now held against the shapes as
    a config.json is (exit 4, naming the tensor and the key), nothing written."""
    from gguf import GGUFReader, GGUFWriter

    src = tmp_path / "model.gguf"
    _llama_gguf(src, "F32")
    reader = GGUFReader(str(src))
    bent = tmp_path / "bent.gguf"
    writer = GGUFWriter(str(bent), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            value = 4 if key == "llama.attention.head_count_kv" else field.contents()
            writer.add_key_value(key, value, field.types[0], field.types[-1])
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_ckpt("convert", bent, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 4, result.stderr
    assert "blk.0.attn_k.weight" in result.stderr or "k_proj" in result.stderr
    assert "num_key_value_heads=4" in result.stderr
    assert not (tmp_path / "hf").exists()


def _with_metadata(src: Path, out: Path, changes: dict[str, tuple[object, object]]) -> Path:
    """`src` written again with the metadata `changes` (key -> (value, gguf value type)) in
    place of its own, its tensors as they are."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(src))
    architecture = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(out), architecture)
    for key, field in reader.fields.items():
        if key.startswith((f"{architecture}.", "tokenizer.")):
            value, kind = changes.get(key, (field.contents(), field.types[0]))
            writer.add_key_value(key, value, kind, field.types[-1])  # type: ignore[arg-type]
    for key, (value, kind) in changes.items():
        if key not in reader.fields:
            writer.add_key_value(key, value, kind)  # type: ignore[arg-type]
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_convert_to_hf_refuses_gguf_metadata_no_model_has(tmp_path: Path) -> None:
    """A GGUF whose metadata says 0 attention heads stopped `convert --to hf` with "internal
    error: ZeroDivisionError ... This is a bug in ckpt" (exit 70); one whose rotary base is NaN
    or infinite, whose norm epsilon is negative or whose context length is 0 was exported with
    exit 0, into a config.json holding `"rope_theta": NaN` (no JSON at all) or -1.0. Each is
    now refused (exit 4) naming the key and its value, as a config.json's are, nothing
    written; an `expert_count` of 0 still means a dense model."""
    from gguf import GGUFValueType

    src = tmp_path / "model.gguf"
    _llama_gguf(src, "F32")
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    cases = {
        "heads": ("llama.attention.head_count", 0, u32),
        "theta-nan": ("llama.rope.freq_base", float("nan"), f32),
        "theta-inf": ("llama.rope.freq_base", float("inf"), f32),
        "eps": ("llama.attention.layer_norm_rms_epsilon", -1.0, f32),
        "context": ("llama.context_length", 0, u32),
    }
    for case, (key, value, kind) in cases.items():
        bent = _with_metadata(src, tmp_path / f"{case}.gguf", {key: (value, kind)})
        out = tmp_path / f"{case}-hf"
        result = run_ckpt("convert", bent, out, "--to", "hf")
        assert result.exit_code == 4, (case, result.stderr)
        assert f"{key} = {value!r}" in result.stderr, (case, result.stderr)
        assert "bug in ckpt" not in result.stderr
        assert not out.exists(), case
    dense = _with_metadata(src, tmp_path / "dense.gguf", {"llama.expert_count": (0, u32)})
    result = run_ckpt("convert", dense, tmp_path / "dense-hf", "--to", "hf")
    assert result.exit_code == 0, result.stderr


def test_convert_to_hf_of_a_split_gguf_names_its_first_file_for_the_tokenizer(
    tmp_path: Path,
) -> None:
    """A split GGUF (a folder of `-0000k-of-0000n.gguf` files) exports as the one file does;
    the tokenizer warning named the folder as `gguf_file=` (`'split'`), a file transformers
    cannot open, and now names the first split file, which holds the tokenizer metadata."""
    from gguf import GGUFReader, GGUFWriter

    whole = tmp_path / "model.gguf"
    _llama_gguf(whole, "Q8_0")
    reader = GGUFReader(str(whole))
    (tmp_path / "split").mkdir()
    writer = GGUFWriter(str(tmp_path / "split" / "model.gguf"), "llama", split_max_tensors=8)
    for key, field in reader.fields.items():
        if key.startswith("llama.") or key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1])
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert len(list((tmp_path / "split").glob("model-0000?-of-00003.gguf"))) == 3

    one = run_ckpt("convert", whole, tmp_path / "one", "--to", "hf", "--dequantize")
    assert one.exit_code == 0, one.stderr
    split = run_ckpt("convert", tmp_path / "split", tmp_path / "two", "--to", "hf", "--dequantize")
    assert split.exit_code == 0, split.stderr
    assert "gguf_file='model-00001-of-00003.gguf'" in split.stderr
    a = load_file(tmp_path / "one" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert (tmp_path / "one" / "config.json").read_text() == (
        tmp_path / "two" / "config.json"
    ).read_text()


def test_inspect_names_the_family_of_a_quantized_gguf(tmp_path: Path) -> None:
    """`inspect` says which family and naming a model's weights are (what `--to hf` maps
    from). Of an F32 GGUF it said `Llama 3 (llama3) in gguf names`; of the same model in Q8_0
    it said nothing, its quantized weights being no tensors: it now counts them as the weights
    they are, as its parameter count does."""
    for qtype in ("F32", "Q8_0"):
        src = tmp_path / f"{qtype}.gguf"
        _llama_gguf(src, qtype)
        result = run_ckpt("inspect", src, "--json")
        assert result.exit_code == 0, result.stderr
        architecture = result.json["result"]["architecture"]
        assert architecture is not None, qtype
        assert (architecture["architecture"], architecture["naming"]) == ("llama3", "gguf")


def test_convert_to_hf_of_a_quantized_gguf_takes_the_models_config_and_tokenizer(
    tmp_path: Path,
) -> None:
    """`--config` and `--dequantize` were refused together ("both write config.json"), so a
    quantized GGUF, which needs `--dequantize`, could not take the original model's
    config.json and tokenizer (`--config hf://org/model`): what a GGUF's metadata cannot say
    (a rope scaling llama.cpp stores otherwise) had no way in. A GGUF holds no config.json to
    rewrite, so the two now go together: the given config.json is written (checked against the
    tensors), its folder's tokenizer files carried, and no tokenizer warning given."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    src = tmp_path / "model.gguf"
    _llama_gguf(src, "Q8_0")
    base = tmp_path / "base"
    base.mkdir()
    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=128,
        eos_token_id=[61, 62],
    ).save_pretrained(base)
    (base / "tokenizer.json").write_text('{"version": "1.0"}')
    out = tmp_path / "hf"
    result = run_ckpt(
        "convert", src, out, "--to", "hf", "--dequantize", "--dtype", "fp32", "--config", base
    )
    assert result.exit_code == 0, result.stderr
    assert "tokenizer" not in result.stderr
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [61, 62]
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=src.name, dtype=torch.float32
    ).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(got[n], reference[n]) for n in reference)

    # a config.json of another model is still refused against the tensors
    LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8).save_pretrained(
        tmp_path / "other"
    )
    refused = run_ckpt(
        "convert", src, tmp_path / "x", "--to", "hf", "--dequantize", "--config", tmp_path / "other"
    )
    assert refused.exit_code == 4, refused.stderr


def test_diff_of_a_quantized_gguf_and_its_export_points_to_dequantize(tmp_path: Path) -> None:
    """`diff model.gguf export/` of a Q8_0 GGUF and its `--to hf --dequantize` export said
    "DIFFERENT: 21 only in A, 21 only in B" with no word of why: the quantized weights are
    no tensors to read through the naming mapping. A warning now says they are the other
    side's model in llama.cpp's names and that `--dequantize` compares them (which gives
    IDENTICAL with `--dtype fp32`)."""
    src = tmp_path / "model.gguf"
    _llama_gguf(src, "Q8_0")
    out = tmp_path / "hf"
    made = run_ckpt("convert", src, out, "--to", "hf", "--dequantize", "--dtype", "fp32")
    assert made.exit_code == 0, made.stderr
    plain = run_ckpt("diff", src, out)
    assert plain.exit_code == 1
    assert "--dequantize" in plain.stderr and "gguf names" in plain.stderr
    same = run_ckpt("diff", src, out, "--dequantize")
    assert same.exit_code == 0, same.stdout + same.stderr
    assert "IDENTICAL" in same.stdout and "--dequantize" not in same.stderr


def test_diff_dequantize_of_a_gguf_and_its_original_model_reports_the_quantization_error(
    tmp_path: Path,
) -> None:
    """`diff model.gguf original/ --dequantize` of a Q8_0 Llama GGUF and the model it was
    written from (transformers' names) listed the differences but not the per-weight
    quantization error (`quant_errors` empty, no "dequantized weights" table): the schemes
    were looked up by the names the mapping gave (`model.layers.0...`), not the GGUF's own
    (`blk.0...`). Each dequantized weight now has its error, as gguf decodes it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    src = tmp_path / "model.gguf"
    original = _llama_gguf(src, "Q8_0")
    save_file(original, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = run_ckpt("diff", src, tmp_path / "model.safetensors", "--dequantize", "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    report = result.json["result"]
    assert report["naming"]["compared_in"] == "hf"
    errors = {e["name"]: e for e in report["quant_errors"]}
    assert len(errors) == report["dequantized"]["a"] == 16
    assert {e["scheme"] for e in errors.values()} == {"gguf-Q8_0"}
    assert "model.layers.0.self_attn.q_proj.weight" in errors and "lm_head.weight" in errors
    # an unpermuted weight's error, from gguf's own decoding
    tensor = next(t for t in _reader(src).tensors if t.name == "blk.1.ffn_down.weight")
    assert tensor.tensor_type == GGMLQuantizationType.Q8_0
    decoded = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).double()
    full = original["model.layers.1.mlp.down_proj.weight"].double()
    got = errors["model.layers.1.mlp.down_proj.weight"]
    assert got["max_abs"] == float((decoded - full).abs().max())
    expected = float(((decoded - full).square().sum() / full.square().sum()).sqrt())
    assert abs(got["rel_rms"] - expected) <= 1e-6 * expected
    shown = run_ckpt("diff", src, tmp_path / "model.safetensors", "--dequantize")
    assert "gguf-Q8_0  rel RMS" in shown.stdout


def test_convert_of_a_gguf_to_plain_weights_says_its_metadata_is_not_written(
    tmp_path: Path,
) -> None:
    """`convert model.gguf out --to safetensors` (or dcp, torch) wrote the tensors and said
    nothing of the GGUF's key-values (architecture, hyper-parameters, tokenizer), which no
    such file keeps: `skipped` was empty and no warning named them. A warning now says they
    are not written, how many, and that `--to hf` writes a model's config from them;
    `--to hf`, which does, says nothing of it."""
    src = tmp_path / "model.gguf"
    _llama_gguf(src, "F16")
    keys = len(_reader(src).fields) - 3  # the reader lists GGUF.version, tensor and kv counts
    for target in ("safetensors", "dcp", "torch"):
        result = run_ckpt("convert", src, tmp_path / target, "--to", target, "--json")
        assert result.exit_code == 0, result.stderr
        notes = [w for w in result.json["result"]["warnings"] if "metadata" in w]
        assert len(notes) == 1, result.json["result"]["warnings"]
        assert f"{keys} key-values" in notes[0] and "not written" in notes[0]
        assert "--to hf" in notes[0] and "tokenizer" in notes[0]
    shown = run_ckpt("convert", src, tmp_path / "shown", "--to", "safetensors")
    assert "metadata" in shown.stderr and "not written" in shown.stderr
    exported = run_ckpt("convert", src, tmp_path / "hf", "--to", "hf", "--json")
    assert exported.exit_code == 0, exported.stderr
    assert not [w for w in exported.json["result"]["warnings"] if "key-values" in w]


def test_convert_to_hf_of_a_gguf_without_its_output_weight_is_no_tied_model(
    tmp_path: Path,
) -> None:
    """`convert model.gguf out --to hf --dequantize --filter-out output.weight` of an untied
    Llama GGUF wrote `tie_word_embeddings: true`: a model whose logits come from the
    embedding, another model, because a GGUF without `output.weight` is a tied one and the
    filter had left it out. The file's own tensors now decide, and the filter is refused as
    for a Megatron save trained untied (exit 4), naming the output projection."""
    src = tmp_path / "model.gguf"
    _llama_gguf(src, "Q8_0")
    out = tmp_path / "hf"
    result = run_ckpt(
        "convert", src, out, "--to", "hf", "--dequantize", "--filter-out", "output.weight"
    )
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "output.weight" in result.stderr and "Megatron" not in result.stderr
    assert not out.exists()
    whole = run_ckpt("convert", src, out, "--to", "hf", "--dequantize")
    assert whole.exit_code == 0, whole.stderr
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
