"""A byte flipped in the zip headers of a `dcp.save` blob: what `dcp.load` then gets wrong,
`verify --deep` reports.

Each `torch_save` item of a `.distcp` file is a `torch.save` zip; its headers (local file
headers, central directory, zip64 end records, end of central directory) are read by torch's
own zip reader (miniz), not by the CRC-checked path a data flip meets. The sweep flips every
header byte of one small blob, found from the real file, once per entry of a checkpoint of
identical entries, and holds `verify --deep` to `dcp.load`, entry by entry.
"""

from __future__ import annotations

import re
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from .conftest import run_ckpt

#: entries per checkpoint: verify lists at most 100 problems of one code
_BATCH = 100
#: the fields of a record's header whose single bits have meanings of their own: version
#: needed, flags, compression method (local header: at 4; central directory: at 6), and the
#: internal and external attributes of a central directory record (at 36)
_LOCAL_FLAG_FIELDS = range(4, 10)
_CENTRAL_FLAG_FIELDS = (*range(6, 12), *range(36, 42))


def _header_flips(blob: bytes) -> list[tuple[int, int]]:
    """(offset in the blob, XOR mask) for every header byte of the torch.save zip `blob`:
    each byte inverted, and each bit of the flag and attribute fields flipped alone. The
    padding torch writes in its local headers' extra fields (no reader looks at it) and the
    records' data are left out."""
    end = blob.rindex(b"PK\x05\x06")
    count, directory_size, directory = struct.unpack_from("<HII", blob, end + 10)
    zip64 = blob.rfind(b"PK\x06\x06", 0, end)
    if zip64 >= 0:  # torch's writer adds the zip64 end records even to small files
        count, directory_size, directory = struct.unpack_from("<QQQ", blob, zip64 + 32)
    flips: list[tuple[int, int]] = []

    def every_byte(start: int, stop: int) -> None:
        flips.extend((at, 0xFF) for at in range(start, stop))

    def every_bit(start: int, fields: Any) -> None:
        flips.extend((start + at, 1 << bit) for at in fields for bit in range(8))

    at = directory
    for _ in range(count):
        name, extra, comment = struct.unpack_from("<HHH", blob, at + 28)
        every_byte(at, at + 46 + name + extra + comment)
        every_bit(at, _CENTRAL_FLAG_FIELDS)
        local = struct.unpack_from("<I", blob, at + 42)[0]
        local_name, local_extra = struct.unpack_from("<HH", blob, local + 26)
        every_byte(local, local + 30 + local_name)
        every_bit(local, _LOCAL_FLAG_FIELDS)
        field = local + 30 + local_name
        while field + 4 <= local + 30 + local_name + local_extra:  # each extra field's header
            every_byte(field, field + 4)
            field += 4 + struct.unpack_from("<H", blob, field + 2)[0]
        at += 46 + name + extra + comment
    every_byte(directory + directory_size, len(blob))  # zip64 end records, end record
    return flips


def _save(folder: Path, entries: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """`dcp.save` of `entries`; each entry's (offset, length) in `__0_0.distcp`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(entries, checkpoint_id=str(folder), no_dist=True)
    metadata = FileSystemReader(str(folder)).read_metadata()
    return {key.fqn: (info.offset, info.length) for key, info in metadata.storage_data.items()}


def _loads_as_saved(folder: Path, template: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """The entries of `template` that `dcp.load` fails on or returns changed (one by one)."""
    wrong = []
    for name, empty in template.items():
        target = {name: empty.clone() if isinstance(empty, torch.Tensor) else empty}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(target, checkpoint_id=str(folder), no_dist=True)
        except BaseException:  # dcp's CheckpointException is a BaseException
            wrong.append(name)
            continue
        got, want = target[name], saved[name]
        same = (
            isinstance(got, torch.Tensor)
            and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            if isinstance(want, torch.Tensor)
            else type(got) is type(want) and got == want
        )
        if not same:
            wrong.append(name)
    return wrong


def _damaged(pristine: Path, src: Path, data: bytes, flips: dict[int, int]) -> None:
    """`src`: a copy of the checkpoint `pristine` (whose `__0_0.distcp` is `data`) with the
    byte at each offset of `flips` XORed with its mask."""
    shutil.copytree(pristine, src)
    damaged = bytearray(data)
    for at, mask in flips.items():
        damaged[at] ^= mask
    (src / "__0_0.distcp").write_bytes(bytes(damaged))


def _reported(src: Path) -> set[str]:
    """The entries `verify --deep` names a problem of (as its entry, or in its message)."""
    verify = run_ckpt("verify", src, "--deep", "--json")
    assert verify.exit_code in (0, 1), verify.stdout + verify.stderr
    problems = verify.json["result"]["problems"]
    named = {p["tensor"] for p in problems if p["tensor"]}
    return named | {m for p in problems for m in re.findall(r"'(e\d{3})'", p["message"])}


def _sweep(tmp_path: Path, value: Any) -> None:
    """Every header flip of `value`'s blob, one flip per entry of a checkpoint of copies of
    `value`: each entry dcp.load then gets wrong is named by `verify --deep`.

    A flip that only reading the entry finds is not read where another entry's flip fails
    the structural check (verify skips its deep checks then): each one that dcp.load gets
    wrong and the batch did not name is verified again on its own."""
    pristine = tmp_path / "pristine"
    copies = {f"e{i:03d}": value for i in range(_BATCH)}
    places = _save(pristine, copies)
    data = (pristine / "__0_0.distcp").read_bytes()
    offset, length = places["e000"]
    flips = _header_flips(data[offset : offset + length])
    assert len(flips) > 800  # six records: the sweep covers every header
    empty: Any = torch.zeros_like(value) if isinstance(value, torch.Tensor) else None
    missed: list[str] = []
    for batch in range(0, len(flips), _BATCH):
        which = dict(zip(copies, flips[batch : batch + _BATCH], strict=False))
        src = tmp_path / f"flips-{batch}"
        _damaged(pristine, src, data, {places[n][0] + at: m for n, (at, m) in which.items()})
        reported = _reported(src)
        unreported = {name: empty for name in which if name not in reported}
        for name in _loads_as_saved(src, unreported, copies):
            at, mask = which[name]
            alone = tmp_path / f"flip-{at}-{mask}"
            _damaged(pristine, alone, data, {places[name][0] + at: mask})
            if name not in _reported(alone):
                missed.append(f"byte {at} ^ {mask:#04x}")
            shutil.rmtree(alone)
        shutil.rmtree(src)
    assert not missed, f"dcp.load gets these flips wrong, verify --deep passes them: {missed}"


@pytest.mark.slow  # ~1,700 flips, each judged by dcp.load
def test_every_header_flip_of_an_object_blob_that_dcp_load_gets_wrong_fails_deep_verify(
    tmp_path: Path,
) -> None:
    """Before: a flag bit (encrypted) or a zip64 offset flipped was 'a bug in ckpt' (exit 70),
    and a record marked as a folder (torch.load then reads uninitialised memory) could pass."""
    _sweep(tmp_path, (0.9, 0.999, "adamw"))  # a tuple: one object entry (dicts are flattened)


@pytest.mark.slow  # ~1,700 flips, each judged by dcp.load
def test_every_header_flip_of_a_tensor_blob_that_dcp_load_gets_wrong_fails_deep_verify(
    tmp_path: Path,
) -> None:
    """Before: the data record marked as a folder passed `verify --deep` (ckpt reads the
    tensor's bytes, which match their CRC-32) while dcp.load returned uninitialised memory."""
    _sweep(tmp_path, torch.arange(16, dtype=torch.float32))


def test_a_corrupt_tensor_blob_is_reported_against_its_tensor_in_the_json(
    tmp_path: Path,
) -> None:
    """`verify --deep` named the tensor of a chunk torch's zip reader misreads in its message
    only: the JSON problem's `tensor` field was empty, so a script could not tell which entry
    to restore. Here the local header of `w`'s blob's `version` record spells its name with
    one bit flipped: torch's reader refuses the blob (dcp.load fails), ckpt's raw read of
    the tensor bytes does not see it."""
    src = tmp_path / "src"
    places = _save(src, {"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(4)})
    data = bytearray((src / "__0_0.distcp").read_bytes())
    start, length = places["w"]
    flipped = 0
    at = data.find(b"PK\x03\x04", start, start + length)
    while at != -1:
        name_length = int.from_bytes(data[at + 26 : at + 28], "little")
        if bytes(data[at + 30 : at + 30 + name_length]).endswith(b"/version"):
            data[at + 30 + name_length - 1] ^= 0x01
            flipped += 1
        at = data.find(b"PK\x03\x04", at + 4, start + length)
    assert flipped == 1
    (src / "__0_0.distcp").write_bytes(bytes(data))
    verify = run_ckpt("verify", src, "--deep", "--json")
    assert verify.exit_code == 1, verify.stdout + verify.stderr
    corrupt = [p for p in verify.json["result"]["problems"] if p["code"] == "corrupt_data"]
    assert [p["tensor"] for p in corrupt] == ["w"], corrupt
    assert corrupt[0]["file"] == str(src / "__0_0.distcp")
