"""Run folders: find the step checkpoints a training job wrote, and judge each one.

`scan_run(run_dir)` lists the checkpoints of a run folder in the layouts people use:

| layout | what is recognised |
|---|---|
| `hf-trainer` | `checkpoint-N/` (Hugging Face Trainer); in a run with none, the `last-checkpoint/` it pushes to the Hub (`hub_strategy="checkpoint"`), at the step its `trainer_state.json` records |
| `accelerate` | `checkpoints/checkpoint_N/` (accelerate `save_state` with automatic naming) |
| `torchtitan` | `step-N/`, also under `checkpoint/` (torchtitan's default folder) |
| `deepspeed` | `global_stepN/`, with the `latest` file naming the last finished save |
| `lightning` | `*.ckpt` files with `step=N` / `epoch=N` in their names (also under `checkpoints/`) |
| `plain` | any other `NAME-N` / `NAME_N` folder, or file with a checkpoint extension |

Files of the `plain` layout that share a step (`model_500.pt`, `optim_500.pt`) form one
checkpoint.

**Completeness.** A checkpoint is complete when every component it holds has its commit
marker and passes its format's structural check (`Format.check`: metadata and file sizes,
no tensor data): each DCP folder has its `.metadata`, each safetensors index names only shards
that exist with valid headers, each safetensors / torch.save file is whole. Layout rules come
on top: a Trainer folder needs a whole `trainer_state.json` (recent transformers write it
last), a DeepSpeed `global_stepN/` newer than the step the `latest` file names is unfinished
(DeepSpeed writes `latest` after every rank is done) and one missing a rank's ZeRO partition
(per the `dp_world_size` its model states record) incomplete, and accelerate and plain folders, which
have no marker at all, are incomplete when they lack a file (`optimizer.bin`, `random_states_*.pkl`: digits compared as `*`) that
at least two other saves of the run all have; a `step-N/` folder of such files (not a DCP) is a
plain save. In a `ckpt sync` destination (its root holds `.ckpt-sync.json`) a save is whole
once its `ckpt-manifest.json` is there, which sync uploads after the save's files. Staging folders of interrupted saves are never
complete: ckpt's own `.NAME.ckpt-tmp-*` (see `output.py`; `prune` also renames what it deletes
to such a name first), the Trainer's `tmp-checkpoint-N`, and `NAME.tmp` / `.partial` /
`.incomplete`. A torch.save file is judged by its zip structure (torch.save writes the zip's
directory last), without unpickling: a pickle naming classes `weights_only` refuses (Lightning's
hyper-parameters) is whole all the same, and loading is `ckpt verify`'s question.

**Still being written.** Nothing tells a reader that another process is writing, so ckpt uses
time: an incomplete checkpoint or a staging folder with a file modified within the last
`settle` seconds (default 120) is `writing`, not `interrupted`; `prune` never touches a
checkpoint with a file that recent, complete or not. ckpt's own staging folders say it
exactly: the process writing one holds it (a `flock`), so a held one is `writing` however long
it has stalled. Another writer's save that stalls for longer than the window without writing a
byte would be judged interrupted; raise `--settle` for such jobs.

**Metrics.** Values for best-by-metric come, in this order of preference, from a
`metrics.jsonl` in the run folder (one JSON object per line with `step` and metric values:
`{"step": 500, "eval_loss": 1.92}`; the last line for a step wins), the `log_history` of the
newest `trainer_state.json`, and `NAME=VALUE` pairs in Lightning file names
(`epoch=3-step=400-val_loss=0.25.ckpt`). A checkpoint gets the value logged at its own step.

The library never prints; `ops.prune` and `commands/latest.py` build on this module.

Package layout: `records` (what a scan reports), `naming` (how checkpoints are named: one rule
set for every listing, step names from each layout's `step_of`), `judge` (the one judge:
complete / interrupted / writing, each component's `Format.check`, every read through the run
folder's `Storage`), `scan` (the one scanner: ordering, early stop, markers, Trainer best,
metrics) over a `RunListing` (`listing`: what a run folder holds, as a listing tells it):
`local` (`scan_run`: the file system, links seen) or `remote` (object stores and the Hub: one
`Storage` listing). The same checkpoint gets the same verdict
and the same reason on a disk, in an object store and on the Hub.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ...formats.names import SLIM_RECORD
from .records import (
    DEFAULT_SETTLE,
    DELETING,
    METRICS_FILE,
    PROTECTED,
    RUN_SLIM_RECORD,
    BestMetric,
    RunCheckpoint,
    RunReport,
    Status,
    deleting_process,
    still_deleting,
)

if TYPE_CHECKING:
    from .judge import load_metrics
    from .local import check_run_folder, looks_like_run, scan_run
    from .naming import UNMARKED
    from .remote import is_remote, looks_like_remote_run, run_storage

#: the scanners, imported on first use: the report models (`records`) are the field types of
#: `InspectReport`, and a plain checkpoint's `ckpt inspect` must not import the scanners
_LAZY = {
    "load_metrics": "judge",
    "check_run_folder": "local",
    "looks_like_run": "local",
    "scan_run": "local",
    "UNMARKED": "naming",
    "is_remote": "remote",
    "looks_like_remote_run": "remote",
    "run_storage": "remote",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_SETTLE",
    "DELETING",
    "METRICS_FILE",
    "PROTECTED",
    "RUN_SLIM_RECORD",
    "SLIM_RECORD",
    "UNMARKED",
    "BestMetric",
    "RunCheckpoint",
    "RunReport",
    "Status",
    "check_run_folder",
    "deleting_process",
    "is_remote",
    "load_metrics",
    "looks_like_remote_run",
    "looks_like_run",
    "run_storage",
    "scan_run",
    "still_deleting",
]
