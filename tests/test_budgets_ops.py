"""No input chooses the memory or CPU of `verify --checksums` and `repair`: tampered parity
manifests, measured in a real process.

Each run is a `python -m ckpt_cli` child of a small launcher that sets RLIMIT_CPU on it and
reads its peak RSS and CPU time from `os.wait4` (a launcher of its own, so the peak is the
child's: at exec Linux folds the parent's high-water mark into `ru_maxrss`, and pytest's is
large). Bounds are on memory and CPU seconds, never on wall-clock time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from .conftest import REPO

LAUNCHER = """
import json, os, resource, sys

cpu, out, err, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
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


@dataclass
class Bounded:
    """One `ckpt` run under a CPU limit: exit code (negative: killed by that signal), output,
    peak resident memory and CPU seconds."""

    code: int
    stdout: str
    stderr: str
    peak_mib: float
    cpu_s: float


def run_bounded(tmp: Path, *args: str | Path, cpu_s: int = 30) -> Bounded:
    """`ckpt ARGS` in a fresh process killed (SIGXCPU) after `cpu_s` CPU seconds."""
    out, err = tmp / "child.stdout", tmp / "child.stderr"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "ckpt_cli", *map(str, args)]
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(cpu_s), str(out), str(err), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    return Bounded(
        result["code"],
        out.read_text(),
        err.read_text(),
        result["peak_kib"] / 1024,
        result["cpu_s"],
    )


#: what a `ckpt verify` of a small checkpoint takes at most (interpreter, pydantic, pyeclib)
SMALL_PEAK_MIB = 120


def _protected_2kb_checkpoint(folder: Path) -> Path:
    """A 2 KB safetensors checkpoint (safetensors' own writer) protected by `ckpt protect`."""
    folder.mkdir()
    save_file({"w": torch.arange(480, dtype=torch.float32)}, folder / "model.safetensors")
    assert (folder / "model.safetensors").stat().st_size < 2100
    done = subprocess.run(
        [sys.executable, "-m", "ckpt_cli", "protect", str(folder)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return folder / ".ckpt-parity" / "parity.index.json"


def _sparse_shares(manifest: Path, doc: dict[str, object], parity: int, size: int) -> None:
    """Replace the parity shares by `parity` sparse files of `size` bytes (holes: no disk)."""
    for old in manifest.parent.glob("parity-*.bin"):
        old.unlink()
    for j in range(parity):
        with open(manifest.parent / f"parity-{j}.bin", "wb") as fh:
            fh.truncate(size)
    manifest.write_text(json.dumps(doc))


def _zero_digest(block_size: int) -> str:
    h = xxhash.xxh3_128()
    zeros = bytes(1 << 20)
    for _ in range(block_size >> 20):
        h.update(zeros)
    return h.hexdigest()


@pytest.mark.parametrize("command", [["verify", "--checksums"], ["repair", "--dry-run"]])
@pytest.mark.slow
def test_a_manifest_with_1_gib_blocks_on_a_2_kb_checkpoint_is_refused_before_any_read(
    tmp_path: Path, command: list[str]
) -> None:
    # the tamper: block_size 1 GiB, width 32, parity 16 and 16 sparse 1 GiB parity shares;
    # every number in range, every share the size the manifest says (16 GiB to read)
    manifest = _protected_2kb_checkpoint(tmp_path / "model")
    doc = json.loads(manifest.read_text())
    data = (tmp_path / "model" / "model.safetensors").read_bytes()
    gib = 1 << 30
    doc.update(block_size=gib, width=32, parity=16, stripes=1, total_blocks=1)
    doc["files"] = [dict(doc["files"][0], start=0, blocks=[xxhash.xxh3_128_hexdigest(data)])]
    doc["shares"] = [
        {"path": f"parity-{j}.bin", "size": gib, "sha256": "0" * 64, "blocks": ["0" * 32]}
        for j in range(16)
    ]
    _sparse_shares(manifest, doc, 16, gib)
    run = run_bounded(tmp_path, command[0], tmp_path / "model", *command[1:])
    assert run.code == 4, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert "parity.index.json" in message and "protect would write" in message
    assert "block_size 1073741824" in message and "--force" in message
    assert run.peak_mib < SMALL_PEAK_MIB and run.cpu_s < 30


@pytest.mark.parametrize("command", [["verify", "--checksums"], ["repair", "--dry-run"]])
@pytest.mark.slow
def test_a_manifest_claiming_a_lost_8_gib_file_is_checked_a_chunk_at_a_time(
    tmp_path: Path, command: list[str]
) -> None:
    # a manifest exactly as protect would write it had the checkpoint held an 8 GiB file,
    # lost since: 128 MiB blocks, and one 1.1 GiB (sparse) parity share to check
    manifest = _protected_2kb_checkpoint(tmp_path / "model")
    doc = json.loads(manifest.read_text())
    data = (tmp_path / "model" / "model.safetensors").read_bytes()
    block = 128 << 20
    doc.update(block_size=block, width=8, parity=1, stripes=9, total_blocks=65)
    doc["whole_files"] = False
    doc["files"] = [
        dict(doc["files"][0], start=0, blocks=[xxhash.xxh3_128_hexdigest(data)]),
        {
            "path": "lost.bin",
            "size": 8 << 30,
            "sha256": "0" * 64,
            "start": 1,
            "blocks": ["0" * 32] * 64,
        },
    ]
    doc["shares"] = [
        {
            "path": "parity-0.bin",
            "size": 9 * block,
            "sha256": "0" * 64,
            "blocks": [_zero_digest(block)] * 9,
        }
    ]
    _sparse_shares(manifest, doc, 1, 9 * block)
    run = run_bounded(tmp_path, command[0], tmp_path / "model", *command[1:], "--json")
    assert run.code == 1, run.stdout + run.stderr
    result = json.loads(run.stdout)["result"]
    damaged = result["parity"]["damaged"] if command[0] == "verify" else result["damaged"]
    assert [(Path(d["path"]).name, d["state"], d["repairable"]) for d in damaged] == [
        ("lost.bin", "missing", False)
    ]
    assert result["parity"]["hashed_bytes"] if command[0] == "verify" else result["hashed_bytes"]
    # the share was read whole, a chunk at a time: memory is not the manifest's 128 MiB block
    assert run.peak_mib < SMALL_PEAK_MIB, run.peak_mib
    assert run.cpu_s < 60


@pytest.mark.parametrize(
    "command", [["verify", "--checksums"], ["repair", "--dry-run"], ["repair"]]
)
@pytest.mark.slow
def test_a_manifest_nested_past_pythons_limit_is_exit_4_naming_it(
    tmp_path: Path, command: list[str]
) -> None:
    # 0.1.x: exit 70, "internal error: RecursionError"
    manifest = _protected_2kb_checkpoint(tmp_path / "model")
    manifest.write_text('{"files": ' + "[" * 200_000 + "]" * 200_000 + "}")
    run = run_bounded(tmp_path, command[0], tmp_path / "model", *command[1:])
    assert run.code == 4, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert str(manifest) in message and "not a valid ckpt parity manifest" in message
    assert "internal error" not in message


@pytest.mark.parametrize("command", [["verify", "--checksums"], ["repair", "--dry-run"]])
@pytest.mark.slow
def test_a_1_gib_manifest_is_refused_before_it_is_read(tmp_path: Path, command: list[str]) -> None:
    # the manifest was read whole whatever its size: a sparse 1 GiB file (no disk) took 1 GiB
    # of memory before json said it was not JSON
    manifest = _protected_2kb_checkpoint(tmp_path / "model")
    with open(manifest, "r+b") as fh:
        fh.truncate(1 << 30)
    run = run_bounded(tmp_path, command[0], tmp_path / "model", *command[1:])
    assert run.code == 4, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert str(manifest) in message, message
    assert "1,073,741,824 bytes" in message and "268,435,456" in message, message
    assert "ckpt protect" in message and "--force" in message, message
    assert "internal error" not in message
    assert run.peak_mib < SMALL_PEAK_MIB and run.cpu_s < 30


@pytest.mark.parametrize("command", [["verify", "--checksums"], ["repair", "--dry-run"]])
@pytest.mark.slow
def test_a_manifest_of_millions_of_empty_lists_is_refused_before_it_is_parsed(
    tmp_path: Path, command: list[str]
) -> None:
    # 15 MB of `[], ` parse to 4 million lists (~400 MB) before pydantic refuses the shape
    manifest = _protected_2kb_checkpoint(tmp_path / "model")
    manifest.write_text('{"files": [' + "[], " * 4_000_000 + "[]]}")
    run = run_bounded(tmp_path, command[0], tmp_path / "model", *command[1:])
    assert run.code == 4, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert str(manifest) in message and "JSON arrays and objects" in message, message
    assert "ckpt protect" in message and "--force" in message, message
    assert run.peak_mib < SMALL_PEAK_MIB and run.cpu_s < 30


def test_protect_refuses_blocks_so_small_that_repair_would_refuse_the_manifest(
    tmp_path: Path,
) -> None:
    # a 30 GiB tensor (a sparse file: no disk) in 4 KiB blocks is 7.9 million digests, a
    # manifest over the 256 MiB verify and repair read: refused before a byte is hashed
    folder = tmp_path / "model"
    folder.mkdir()
    size = 30 << 30
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    shard = folder / "model.safetensors"
    with open(shard, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + size)
    run = run_bounded(tmp_path, "protect", folder, "--block-size", "4KiB", "--dry-run")
    assert run.code == 2, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert "parity.index.json" in message and "268,435,456" in message, message
    assert "--block-size 8KiB" in message, message
    assert run.cpu_s < 30
    # what it suggests is taken
    run = run_bounded(tmp_path, "protect", folder, "--block-size", "8KiB", "--dry-run")
    assert run.code == 0, run.stdout + run.stderr
