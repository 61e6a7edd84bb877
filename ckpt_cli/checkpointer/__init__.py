"""`Checkpointer`: near-free checkpoints from a training loop, in the background, in tiers.

```python
from ckpt_cli import Checkpointer

ck = Checkpointer("runs/exp1", keep_last=3, keep_every=1000, upload="s3://bucket/exp1")
loaded = ck.load_latest(into={"model": model, "optimizer": opt, "scheduler": sched})
for step in range(loaded.step + 1 if loaded else 1, total + 1):
    ...
    if step % 100 == 0:
        ck.save(step, {"model": model, "optimizer": opt, "scheduler": sched, "data": loader})
ck.close()
```

What a save does, and where each step runs:

1. `save` (the training thread): the state dicts are taken (`state.py`: models and optimizers
   through `torch.distributed.checkpoint.state_dict`, other Stateful objects by their
   `state_dict()`, as `dcp.save` does) and copied into a host staging buffer allocated on the
   first save and reused (`staging.py`). Only this blocks the loop.
2. The background thread (one save in flight; another `save` waits or is skipped, by
   `on_busy`): rank 0 creates the staging folder `run_dir/.step-N.ckpt-tmp-*`
   (`output.staged_output`), every rank writes its own shards into it with `dcp.save` and
   DCP's `FileSystemWriter` (planning and de-duplication across ranks are DCP's, every file
   fsynced), and rank 0 writes `.metadata`, the commit marker, after every rank's data.
3. Rank 0 seals the folder: the structural check of `ckpt verify` with the checksum manifest
   (`ckpt-manifest.json`), parity with `protect=K` (`ckpt protect`); then the one rename that
   publishes `run_dir/step-N`.
4. Rank 0 applies retention (`ckpt prune` with `keep_last` / `keep_every`; interrupted saves
   older than the newest complete one are removed) and uploads with `ckpt sync` (data first,
   `.metadata` after it, the manifest last; the same retention on the remote side).

A crash (SIGKILL included) at any moment leaves the previous complete save as `latest`: before
the rename the save is a `.ckpt-tmp-` staging folder, which `ckpt latest` never returns; in the
object store a save without its `.metadata` is incomplete. `load_latest` takes the newest
complete save of the local run folder, or of the object store when that one is newer (pulled
first), verifies it, and loads it (`tiers.py`). A save is an ordinary DCP folder: `ckpt
inspect`, `ckpt verify`, `ckpt latest` and `dcp.load` read it.

The library never prints: progress goes to the logger `ckpt_cli.checkpointer` (or the one
given), failures to it and to `Checkpointer.status()`. For tests, `hooks.py` can pause the
background writer at a named point (`CKPT_TEST_PAUSE_AT`) so a test can kill it there.
"""

from __future__ import annotations

from .engine import Checkpointer
from .model import CheckpointerStatus, LoadedCheckpoint, SaveRecord

__all__ = [
    "Checkpointer",
    "CheckpointerStatus",
    "LoadedCheckpoint",
    "SaveRecord",
]
