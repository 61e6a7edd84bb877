"""Run under torchrun (gloo, CPU): save or load a DCP checkpoint of DTensors placed Shard(0).

    torchrun --standalone --nproc-per-node N tests/dcp_dist_script.py \
        [--save OUT_DIR] [--save-nocoll OUT_DIR] [--save-uneven OUT_DIR] [--save-hf OUT_DIR]
        [--load CKPT_DIR REPORT_DIR [OBJECT_NAME ...]]

`--save`: the full tensors of `expected_state()` distributed Shard(0) (0-dim ones replicated),
plus the object `train.step` = 11, saved with `dcp.save`.
`--save-nocoll`: the same with `use_collectives=False` (per-rank `__r.metadata`, no `.metadata`).
`--save-hf`: the same tensors (no objects: that writer holds tensors only) saved with
`HuggingFaceStorageWriter(save_distributed=True)`: one safetensors file per rank, no `.metadata`.
`--save-uneven`: as `--save`, plus `uneven_extra()` (a large tensor replicated on every rank,
which DCP writes once, into one rank's file): the rank files differ in size, as an FSDP save
whose rank 0 also holds the unsharded state does.
`--load`: for every tensor of `expected_state()` an empty DTensor placed Shard(0) (0-dim:
replicated) is loaded with `dcp.load`, together with the named objects; each rank compares
its local shard with the same shard of the expected tensor, bit-exact, and writes
REPORT_DIR/rank{r}.json: {"ok", "mismatches", "files_read": {fqn: [files]}, "objects"}.
All can run in one launch (a torchrun start costs seconds).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown  # the checkout is first

warnings.filterwarnings("ignore")


def expected_state() -> dict[str, torch.Tensor]:
    """Full tensors with uneven first dims (5 rows on 2 ranks, 1 row: an empty shard)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "model.w": torch.randn(5, 3, generator=gen),
        "model.b": torch.randn(1, generator=gen),
        "model.emb": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
        "optim.step": torch.tensor(4.0),
        "optim.exp_avg": torch.randn(7, 2, generator=gen),
        "counts": torch.arange(9, dtype=torch.int64),
    }


def uneven_extra() -> dict[str, torch.Tensor]:
    """What `--save-uneven` adds: replicated, so one rank's file holds all of it."""
    gen = torch.Generator().manual_seed(5)
    return {"model.head": torch.randn(96, 64, generator=gen)}


class RecordingReader(FileSystemReader):
    """A FileSystemReader that records which files this rank's load plan reads, per fqn."""

    files_read: dict[str, set[str]]

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.files_read = getattr(self, "files_read", {})
        for item in plan.items:
            rel = self.storage_data[item.storage_index].relative_path
            self.files_read.setdefault(item.storage_index.fqn, set()).add(rel)
        return super().read_data(plan, planner)


def placement(tensor: torch.Tensor) -> list:  # type: ignore[type-arg]
    return [Shard(0)] if tensor.dim() else [Replicate()]


def main() -> None:
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    args = sys.argv[1:]
    full = expected_state()
    if args and args[0] == "--save":
        out = Path(args[1])
        args = args[2:]
        state: dict = {k: distribute_tensor(v, mesh, placement(v)) for k, v in full.items()}
        state["train.step"] = 11
        dcp.save(state, checkpoint_id=str(out))
    if args and args[0] == "--save-nocoll":
        out = Path(args[1])
        args = args[2:]
        state = {k: distribute_tensor(v, mesh, placement(v)) for k, v in full.items()}
        state["train.step"] = 11
        dcp.save(state, checkpoint_id=str(out), use_collectives=False)
    if args and args[0] == "--save-uneven":
        out = Path(args[1])
        args = args[2:]
        state = {k: distribute_tensor(v, mesh, placement(v)) for k, v in full.items()}
        state.update(
            {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in uneven_extra().items()}
        )
        state["train.step"] = 11
        dcp.save(state, checkpoint_id=str(out))
    if args and args[0] == "--save-hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        out = Path(args[1])
        args = args[2:]
        tensors = {k: distribute_tensor(v, mesh, placement(v)) for k, v in full.items()}
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
    if args and args[0] == "--load":
        ckpt, report, objects = Path(args[1]), Path(args[2]), args[3:]
        target: dict = {
            k: distribute_tensor(torch.zeros_like(v), mesh, placement(v)) for k, v in full.items()
        }
        target.update({name: None for name in objects})
        reader = RecordingReader(str(ckpt))
        dcp.load(target, storage_reader=reader)
        mismatches = []
        for name, value in full.items():
            got = target[name]
            assert isinstance(got, DTensor)
            want = distribute_tensor(value, mesh, placement(value)).to_local()
            if got.to_local().dtype != want.dtype or not torch.equal(got.to_local(), want):
                mismatches.append(name)
        report.mkdir(parents=True, exist_ok=True)
        files_read = {k: sorted(v) for k, v in getattr(reader, "files_read", {}).items()}
        (report / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "ok": not mismatches,
                    "mismatches": mismatches,
                    "files_read": files_read,
                    "objects": {name: target[name] for name in objects},
                }
            )
        )
    dist.barrier()
    # not destroy_process_group(): gloo's teardown can deadlock on the GIL on a loaded machine
    leave_without_teardown()


if __name__ == "__main__":
    main()
