"""torchrun worker for the reshard tests: save a DCP checkpoint, or load resharded ones.

`save DIR`: on the launch's ranks (gloo, CPU), build a small tensor-parallel-style model
(`wq` Shard(0), `wo` Shard(1), `norm` replicated, `embed`/`out` Shard(0) with uneven rows),
take one AdamW step, and `dcp.save` model + optimizer (`get_state_dict`) + per-rank RNG and
data-loader state + a shared step counter; rank 0 writes the full values to DIR.expected.pt.

`load JOBS.json`: for each job {path, expected, rules, own_file}, `dcp.load` every entry of
the checkpoint into DTensors placed as `rules` say (default Shard(0)) on this world size,
with a planner that records which file each read item came from; check every tensor and
object bit-exact against the expected values, the local shard against the Shard cut, and
(when `own_file`) that every sharded tensor was read from this rank's file only. Rank 0
writes a JSON summary next to JOBS.json.
"""

from __future__ import annotations

import json
import sys
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.dist_helpers import RANK_TIMEOUT, leave_without_teardown  # the checkout is first

TP_RULES = {"*.wo.weight": 1, "*.norm.*": "replicate"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 12, bias=False)
        self.wo = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(8)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 5)  # 5 rows: uneven on 2 ranks, an empty shard on 4


def placement_for(name: str, rules: dict[str, Any]) -> Any:
    param = name
    parts = name.split(".")
    if "state" in parts:  # optimizer state follows its parameter
        i = parts.index("state")
        param = ".".join(parts[i + 1 : -1])
    for pattern, dim in rules.items():
        if fnmatchcase(name, pattern) or fnmatchcase(param, pattern):
            return Replicate() if dim == "replicate" else Shard(int(dim))
    return Shard(0)


def build_model(seed: int) -> Model:
    torch.manual_seed(seed)
    return Model()


def save(folder: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(0)
    for mod_name, module in list(model.named_modules()):
        for pname, param in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{pname}" if mod_name else pname
            dt = distribute_tensor(param.data, mesh, [placement_for(full, TP_RULES)])
            module.register_parameter(pname, nn.Parameter(dt))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    torch.manual_seed(1)
    for param in model.parameters():
        grad = torch.randn(param.shape)
        param.grad = distribute_tensor(grad, mesh, param.placements)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    torch.manual_seed(100 + rank)
    state: dict[str, Any] = {
        "model": model_sd,
        "optimizer": optim_sd,
        "rng": {f"rank{rank}": torch.get_rng_state()},
        "dataloader": {f"dp_rank_{rank}": {"position": 100 * rank + 7}},
        "train_state": {"step": 3},
    }
    dcp.save(state, checkpoint_id=str(folder))
    # full values of everything saved, for the test's bit-exact checks
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in flat.items():
        if isinstance(value, DTensor):
            tensors[name] = value.full_tensor()
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {k: v for k, v in flat.items() if k not in tensors})
    objects = {k: v for part in gathered for k, v in part.items()}
    gathered_t: list[Any] = [None] * world
    dist.all_gather_object(gathered_t, {k: v for k, v in tensors.items() if k.startswith("rng.")})
    for part in gathered_t:
        tensors.update(part)
    if rank == 0:
        torch.save({"tensors": tensors, "objects": objects}, f"{folder}.expected.pt")


class RecordingPlanner(DefaultLoadPlanner):
    """A load planner that records the files each read item comes from."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, set[str]] = {}

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]  # type: ignore[union-attr]
            self.files.setdefault(item.dest_index.fqn, set()).add(info.relative_path)
        return plan


def load(jobs_path: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    jobs = json.loads(jobs_path.read_text())
    summary = []
    for job in jobs:
        path = job["path"]
        expected = torch.load(job["expected"], weights_only=True)
        metadata = FileSystemReader(path).read_metadata()
        state: dict[str, Any] = {}
        placements: dict[str, Any] = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, BytesStorageMetadata):
                state[fqn] = None
            elif isinstance(meta, TensorStorageMetadata):
                if len(meta.size) == 0 or fqn.startswith("rng."):
                    # scalars and per-rank RNG state load as plain tensors, as a trainer would
                    state[fqn] = torch.zeros(meta.size, dtype=meta.properties.dtype)
                    continue
                placement = placement_for(fqn, job["rules"])
                placements[fqn] = placement
                full = torch.zeros(meta.size, dtype=meta.properties.dtype)
                state[fqn] = distribute_tensor(full, mesh, [placement])
        planner = RecordingPlanner()
        dcp.load(state, checkpoint_id=path, planner=planner)
        problems = []
        for fqn, value in state.items():
            if isinstance(value, DTensor):
                want = expected["tensors"][fqn]
                if not torch.equal(value.full_tensor(), want):
                    problems.append(f"{fqn}: full tensor differs")
                placement = placements[fqn]
                if isinstance(placement, Shard):
                    local = want.chunk(world, dim=placement.dim)
                    mine = local[rank] if rank < len(local) else want.narrow(placement.dim, 0, 0)
                    if not torch.equal(value.to_local(), mine):
                        problems.append(f"{fqn}: local shard differs from the Shard cut")
                    if job["own_file"] and value.to_local().numel() > 0:
                        read = planner.files.get(fqn, set())
                        if read != {f"__{rank}_0.distcp"}:
                            problems.append(f"{fqn}: rank {rank} read {sorted(read)}")
            elif isinstance(value, torch.Tensor):
                if not torch.equal(value, expected["tensors"][fqn]):
                    problems.append(f"{fqn}: tensor differs")
            elif value != expected["objects"].get(fqn, "<missing>"):
                problems.append(f"{fqn}: object {value!r} != {expected['objects'].get(fqn)!r}")
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        summary.append(
            {
                "path": path,
                "problems": [p for part in gathered for p in part],
                "entries": len(state),
                "sharded": sum(isinstance(p, Shard) for p in placements.values()),
            }
        )
    if rank == 0:
        Path(f"{jobs_path}.result.json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]))
    else:
        load(Path(sys.argv[2]))
    dist.barrier()
    leave_without_teardown()


if __name__ == "__main__":
    main()
