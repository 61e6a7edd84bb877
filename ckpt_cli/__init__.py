"""ckpt: the command-line tool, and the library under it, for sharded and resumable checkpoints.

The operations the CLI runs are importable here, typed, with the same arguments and reports as
the commands, so a training script or a notebook calls the same code:

    import ckpt_cli

    report = ckpt_cli.verify("out/checkpoint-500", resumable=True)
    if report.ok:
        ckpt_cli.convert("out/checkpoint-500", "export/", "safetensors", select="model")

A training loop saves through `ckpt_cli.Checkpointer` (background writes, retention, upload,
resume from the newest complete save; see `ckpt_cli.checkpointer`).

The names are loaded on first use (`import ckpt_cli` stays as light as `ckpt --help`): each
operation lives in `ckpt_cli.ops.<name>`; library code never prints, prompts or exits, and
every expected failure is a `ckpt_cli.errors.CkptError` with its exit code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> (module, attribute), imported on first access
_EXPORTS: dict[str, tuple[str, str]] = {
    # operations
    "inspect": ("ckpt_cli.ops.inspect", "inspect"),
    "verify": ("ckpt_cli.ops.verify.run", "verify"),
    "convert": ("ckpt_cli.ops.convert.run", "convert"),
    "reshard": ("ckpt_cli.ops.reshard.run", "run_reshard"),
    "prune": ("ckpt_cli.ops.prune.run", "prune"),
    "latest": ("ckpt_cli.ops.latest", "latest"),
    "download": ("ckpt_cli.ops.download", "download"),
    "diff": ("ckpt_cli.ops.diff.run", "diff"),
    "merge": ("ckpt_cli.ops.merge", "merge"),
    "protect": ("ckpt_cli.ops.parity.protect", "protect"),
    "repair": ("ckpt_cli.ops.parity.repair", "repair"),
    "sync": ("ckpt_cli.ops.sync", "sync"),
    "doctor": ("ckpt_cli.ops.doctor", "doctor"),
    # the save engine of a training loop (imports torch when first used)
    "Checkpointer": ("ckpt_cli.checkpointer", "Checkpointer"),
    "CheckpointerStatus": ("ckpt_cli.checkpointer", "CheckpointerStatus"),
    "LoadedCheckpoint": ("ckpt_cli.checkpointer", "LoadedCheckpoint"),
    "SaveRecord": ("ckpt_cli.checkpointer", "SaveRecord"),
    # their reports and inputs
    "InspectReport": ("ckpt_cli.ops.inspect", "InspectReport"),
    "VerifyReport": ("ckpt_cli.ops.verify.report", "VerifyReport"),
    "ConvertReport": ("ckpt_cli.ops.convert.run", "ConvertReport"),
    "ReshardReport": ("ckpt_cli.ops.reshard.run", "ReshardReport"),
    "PrunePolicy": ("ckpt_cli.ops.prune.retention", "PrunePolicy"),
    "PruneReport": ("ckpt_cli.ops.prune.retention", "PruneReport"),
    "RunReport": ("ckpt_cli.sources.runs", "RunReport"),
    "DownloadReport": ("ckpt_cli.ops.download", "DownloadReport"),
    "DiffReport": ("ckpt_cli.ops.diff.run", "DiffReport"),
    "MergeReport": ("ckpt_cli.ops.merge", "MergeReport"),
    "ProtectReport": ("ckpt_cli.ops.parity", "ProtectReport"),
    "RepairReport": ("ckpt_cli.ops.parity", "RepairReport"),
    "SyncReport": ("ckpt_cli.ops.sync", "SyncReport"),
    "DoctorReport": ("ckpt_cli.ops.doctor", "DoctorReport"),
    # errors
    "CkptError": ("ckpt_cli.errors", "CkptError"),
}

__all__ = [
    "Checkpointer",
    "CheckpointerStatus",
    "CkptError",
    "ConvertReport",
    "DiffReport",
    "DoctorReport",
    "DownloadReport",
    "InspectReport",
    "LoadedCheckpoint",
    "MergeReport",
    "ProtectReport",
    "PrunePolicy",
    "PruneReport",
    "RepairReport",
    "ReshardReport",
    "RunReport",
    "SaveRecord",
    "SyncReport",
    "VerifyReport",
    "__version__",
    "convert",
    "diff",
    "doctor",
    "download",
    "inspect",
    "latest",
    "merge",
    "protect",
    "prune",
    "repair",
    "reshard",
    "sync",
    "verify",
]

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from .checkpointer import Checkpointer, CheckpointerStatus, LoadedCheckpoint, SaveRecord
    from .errors import CkptError
    from .ops.convert.run import ConvertReport, convert
    from .ops.diff.run import DiffReport, diff
    from .ops.doctor import DoctorReport, doctor
    from .ops.download import DownloadReport, download
    from .ops.inspect import InspectReport, inspect
    from .ops.latest import latest
    from .ops.merge import MergeReport, merge
    from .ops.parity.model import ProtectReport, RepairReport
    from .ops.parity.protect import protect
    from .ops.parity.repair import repair
    from .ops.prune.retention import PrunePolicy, PruneReport
    from .ops.prune.run import prune
    from .ops.reshard.run import ReshardReport
    from .ops.reshard.run import run_reshard as reshard
    from .ops.sync import SyncReport, sync
    from .ops.verify.report import VerifyReport
    from .ops.verify.run import verify
    from .sources.runs import RunReport


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ckpt_cli' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
