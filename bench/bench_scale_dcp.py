"""A simulated 405B run: `inspect`, `verify` and a `reshard --world-size` plan on a DCP
checkpoint of about a million chunks, per chunk (CPU µs and bytes of peak RSS).

The checkpoint is shaped like Llama 3.1 405B (126 layers, hidden 16,384, FFN 53,248, 8 KV
heads, vocab 128,256; bf16 weights) saved by 2,048 ranks: 2 pipeline stages x FSDP 128 x TP 8,
as torchtitan lays it out (column-parallel weights split on dim 0 by TP then FSDP, row-parallel
ones on dim 1 by TP and dim 0 by FSDP, norms replicated over TP and split by FSDP, embedding and
output split on the vocab): 937,600 chunks, one `__{rank}_0.distcp` per rank.

Nothing is trained or gathered; the checkpoint is built with no tensor data:
- `.metadata` is torch's own `Metadata` / `TensorStorageMetadata` / `ChunkStorageMetadata` /
  `MetadataIndex` / `_StorageInfo` objects, pickled the way `dcp.save` pickles them;
- each rank file has its full size (sum of its chunks' torch.save blobs) but is sparse: at each
  chunk's offset lies the head of a real `torch.save` blob of that chunk's dtype and shape (the
  zip entries up to the data, what `verify` reads to check the tensor a chunk declares); the
  data and the zip's central directory are holes, so `dcp.load` and `verify --deep` would fail
  on it, and each chunk costs one 4 KiB disk block (~4 GB in all; `--dir` keeps it between runs).

Each command is a fresh process (CPU seconds user + system and peak RSS from `wait4`); the
per-chunk figures are marginal: each command's CPU and RSS minus the same command's on a
one-layer save of the same model by one rank, divided by the difference in chunks. torch's own `FileSystemReader.read_metadata()` (a plain `pickle.load`) runs
in the same way as the reference.

Run by hand (never in tests):
    PYTHONPATH=. python bench/bench_scale_dcp.py [--dir D] [--pp 2 --fsdp 128 --tp 8]
        [--layers 126] [--skip verify,reshard]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """The model (Llama 3.1 405B by default) and the parallelism of the simulated save."""

    layers: int = 126
    hidden: int = 16_384
    ffn: int = 53_248
    heads: int = 128
    kv_heads: int = 8
    vocab: int = 128_256
    pp: int = 2
    fsdp: int = 128
    tp: int = 8

    @property
    def ranks(self) -> int:
        return self.pp * self.fsdp * self.tp


#: how a parameter is cut: "col" (TP on dim 0, then FSDP on dim 0), "row" (TP on dim 1, FSDP
#: on dim 0), "rep" (replicated over TP, FSDP on dim 0)
def parameters(shape: Shape) -> list[tuple[str, list[int], str, int]]:
    """(fqn, global shape, cut, pipeline stage) of every weight, in model order."""
    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    per_stage = math.ceil(shape.layers / shape.pp)
    out: list[tuple[str, list[int], str, int]] = [
        ("model.tok_embeddings.weight", [shape.vocab, h], "col", 0)
    ]
    for layer in range(shape.layers):
        stage = layer // per_stage
        p = f"model.layers.{layer}."
        out += [
            (p + "attention.wq.weight", [h, h], "col", stage),
            (p + "attention.wk.weight", [kv, h], "col", stage),
            (p + "attention.wv.weight", [kv, h], "col", stage),
            (p + "attention.wo.weight", [h, h], "row", stage),
            (p + "feed_forward.w1.weight", [shape.ffn, h], "col", stage),
            (p + "feed_forward.w2.weight", [h, shape.ffn], "row", stage),
            (p + "feed_forward.w3.weight", [shape.ffn, h], "col", stage),
            (p + "attention_norm.weight", [h], "rep", stage),
            (p + "ffn_norm.weight", [h], "rep", stage),
        ]
    last = shape.pp - 1
    out += [
        ("model.norm.weight", [h], "rep", last),
        ("model.output.weight", [shape.vocab, h], "col", last),
    ]
    return out


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of `parts` near-equal pieces of `n` (the first `n % parts` one larger)."""
    q, r = divmod(n, parts)
    out, at = [], 0
    for i in range(parts):
        size = q + (i < r)
        out.append((at, size))
        at += size
    return out


def chunks_of(shape: Shape, dims: list[int], cut: str, stage: int):
    """(rank, offsets, sizes) of each stored chunk of one parameter (replicas saved once)."""
    base = stage * shape.fsdp * shape.tp
    if cut == "rep":
        for d, (o, s) in enumerate(split(dims[0], shape.fsdp)):
            yield base + d * shape.tp, [o], [s]
        return
    if cut == "col":
        pieces = split(dims[0], shape.tp * shape.fsdp)
        for t in range(shape.tp):
            for d in range(shape.fsdp):
                o, s = pieces[t * shape.fsdp + d]
                yield base + d * shape.tp + t, [o, 0], [s, dims[1]]
        return
    rows, cols = split(dims[0], shape.fsdp), split(dims[1], shape.tp)
    for t, (co, cs) in enumerate(cols):
        for d, (ro, rs) in enumerate(rows):
            yield base + d * shape.tp + t, [ro, co], [rs, cs]


def blob_parts(sizes: tuple[int, ...]) -> tuple[bytes, int]:
    """(head, total length) of the torch.save blob of a bf16 tensor of `sizes`: the head is
    every byte before the data (what `verify` reads), as torch 2.13 writes it."""
    import torch

    tensor = torch.zeros(sizes, dtype=torch.bfloat16)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    blob = buffer.getvalue()
    nbytes = tensor.numel() * 2
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    # the local header: 30 fixed bytes, the name, the extra field (torch pads to 64 bytes)
    name_len, extra_len = struct.unpack(
        "<HH", blob[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    head = blob[:start]
    assert blob[start : start + nbytes] == bytes(nbytes)
    return head, len(blob)


def build(root: Path, shape: Shape) -> tuple[Path, int]:
    """Write the simulated checkpoint under `root` (kept when already there); (folder, chunks)."""

    name = f"llama405b-pp{shape.pp}-fsdp{shape.fsdp}-tp{shape.tp}-l{shape.layers}"
    folder = root / name
    if (folder / ".metadata").exists():
        count = int((folder / "chunks").read_text())
        return folder, count
    from torch import Size, bfloat16
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    staging = root / f".{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    templates: dict[tuple[int, ...], tuple[bytes, int]] = {}
    ends = [0] * shape.ranks
    heads: list[list[tuple[int, bytes]]] = [[] for _ in range(shape.ranks)]
    state: dict = {}
    storage: dict = {}
    planner: dict = {}
    count = 0
    # one name object per file, as in a real save (each rank's write results share it), so
    # the pickle memoises it
    files = [f"__{rank}_0.distcp" for rank in range(shape.ranks)]
    for fqn, dims, cut, stage in parameters(shape):
        chunks = []
        for index, (rank, offsets, sizes) in enumerate(chunks_of(shape, dims, cut, stage)):
            key = tuple(sizes)
            if key not in templates:
                templates[key] = blob_parts(key)
            head, length = templates[key]
            heads[rank].append((ends[rank], head))
            chunks.append(ChunkStorageMetadata(offsets=Size(offsets), sizes=Size(sizes)))
            storage[MetadataIndex(fqn, Size(offsets), index)] = _StorageInfo(
                files[rank], ends[rank], length
            )
            ends[rank] += length
            count += 1
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=bfloat16), Size(dims), chunks)
        planner[fqn] = tuple(fqn.split(".", 1))
    for rank in range(shape.ranks):
        with open(staging / f"__{rank}_0.distcp", "wb") as fh:
            for offset, head in heads[rank]:
                os.pwrite(fh.fileno(), head, offset)
            fh.truncate(ends[rank])
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(folder), save_id="bench"),
        version="1.0.0",
    )
    with open(staging / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)  # as FileSystemWriter.finish does
    (staging / "chunks").write_text(str(count))
    staging.rename(folder)
    return folder, count


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, CPU s user + system, peak RSS bytes) of one fresh process; exits on failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({status}): {err[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


TORCH_READ = (
    "import sys; from torch.distributed.checkpoint import FileSystemReader; "
    "md = FileSystemReader(sys.argv[1]).read_metadata(); "
    "print(sum(len(t.chunks) for t in md.state_dict_metadata.values()))"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (source kept)")
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=128)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=1024, help="the reshard plan's target")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help="commands to leave out, comma-separated")
    args = parser.parse_args()
    shape = Shape(layers=args.layers, pp=args.pp, fsdp=args.fsdp, tp=args.tp)
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-dcp-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.build_only:
        build(root, shape)
        return
    # built in a child: torch imported here would count in every measured child's peak RSS
    # (Linux carries the forking parent's high-water mark into the child)
    # (the child builds into this run's folder: without `--dir` it would make its own, and the
    # build would run again here)
    subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--dir", str(root), "--build-only"], check=True
    )
    src, chunks = build(root, shape)
    print(
        f"{src.name}: {chunks:,} chunks on {shape.ranks:,} ranks, .metadata "
        f"{(src / '.metadata').stat().st_size / 2**20:,.0f} MiB (built in "
        f"{time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    # the same commands on a one-layer, one-rank save of the same model: the fixed cost of each
    # (interpreter, imports, the command's own set-up) that the per-chunk figures leave out
    small_shape = Shape(layers=1, pp=1, fsdp=1, tp=1)
    subprocess.run(
        [sys.executable, __file__, "--dir", str(root), "--layers", "1", "--pp", "1", "--fsdp", "1",
         "--tp", "1", "--build-only"],
        check=True,
    )  # fmt: skip
    small, small_chunks = build(root, small_shape)
    py = sys.executable
    ckpt = [py, "-m", "ckpt_cli"]

    def commands(folder: Path, world: int) -> dict[str, list[str]]:
        return {
            "torch read_metadata()": [py, "-c", TORCH_READ, str(folder)],
            "inspect --json": [*ckpt, "inspect", str(folder), "--json"],
            "verify --json": [*ckpt, "verify", str(folder), "--json"],
            f"reshard --world-size {world} --dry-run": [
                *ckpt, "reshard", str(folder), str(root / "out"), "--world-size", str(world),
                "--dry-run", "--json",
            ],
        }  # fmt: skip

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    load_before = os.getloadavg()[0]
    marginal = chunks - small_chunks
    print(
        "\n| command | wall s | CPU s | peak RSS MiB | CPU µs / chunk | peak RSS B / chunk |\n"
        "|---|---|---|---|---|---|"
    )
    big_commands = commands(src, args.world_size)
    small_commands = commands(small, 1)
    for (label, argv), small_argv in zip(
        big_commands.items(), small_commands.values(), strict=False
    ):
        if any(label.startswith(s) for s in skip):
            continue
        _, small_cpu, small_rss = run(small_argv)
        wall, cpu, rss = run(argv)
        print(
            f"| {label} | {wall:.1f} | {cpu:.1f} | {rss / 2**20:,.0f} | "
            f"{(cpu - small_cpu) / marginal * 1e6:.1f} | {(rss - small_rss) / marginal:,.0f} |",
            flush=True,
        )
    print(
        f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on "
        f"{os.cpu_count()} CPUs; one run each; per chunk = (this run - the same command on the "
        f"{small_chunks}-chunk one-layer save) / {marginal:,} chunks; CPU = user + system"
    )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
