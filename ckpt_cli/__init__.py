"""ckpt: the command-line tool, and the library under it, for sharded and resumable checkpoints.

The operations the CLI runs are importable here, typed, with the same arguments and reports as
the commands, so a training script or a notebook calls the same code:

    import ckpt_cli

    report = ckpt_cli.verify("out/checkpoint-500", resumable=True)
    if report.ok:
        ckpt_cli.convert("out/checkpoint-500", "export/", "safetensors", select="model")

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
    "verify": ("ckpt_cli.ops.verify", "verify"),
    "convert": ("ckpt_cli.ops.convert", "convert"),
    "reshard": ("ckpt_cli.ops.reshard", "run_reshard"),
    "prune": ("ckpt_cli.ops.prune", "prune"),
    "latest": ("ckpt_cli.ops.latest", "latest"),
    "download": ("ckpt_cli.ops.download", "download"),
    "diff": ("ckpt_cli.ops.diff", "diff"),
    "doctor": ("ckpt_cli.ops.doctor", "doctor"),
    # their reports and inputs
    "InspectReport": ("ckpt_cli.ops.inspect", "InspectReport"),
    "VerifyReport": ("ckpt_cli.ops.verify", "VerifyReport"),
    "ConvertReport": ("ckpt_cli.ops.convert", "ConvertReport"),
    "ReshardReport": ("ckpt_cli.ops.reshard", "ReshardReport"),
    "PrunePolicy": ("ckpt_cli.ops.retention", "PrunePolicy"),
    "PruneReport": ("ckpt_cli.ops.retention", "PruneReport"),
    "RunReport": ("ckpt_cli.runs", "RunReport"),
    "DownloadReport": ("ckpt_cli.ops.download", "DownloadReport"),
    "DiffReport": ("ckpt_cli.ops.diff", "DiffReport"),
    "DoctorReport": ("ckpt_cli.ops.doctor", "DoctorReport"),
    # errors
    "CkptError": ("ckpt_cli.errors", "CkptError"),
}

__all__ = [
    "CkptError",
    "ConvertReport",
    "DiffReport",
    "DoctorReport",
    "DownloadReport",
    "InspectReport",
    "PrunePolicy",
    "PruneReport",
    "ReshardReport",
    "RunReport",
    "VerifyReport",
    "__version__",
    "convert",
    "diff",
    "doctor",
    "download",
    "inspect",
    "latest",
    "prune",
    "reshard",
    "verify",
]

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from .errors import CkptError
    from .ops.convert import ConvertReport, convert
    from .ops.diff import DiffReport, diff
    from .ops.doctor import DoctorReport, doctor
    from .ops.download import DownloadReport, download
    from .ops.inspect import InspectReport, inspect
    from .ops.latest import latest
    from .ops.prune import prune
    from .ops.reshard import ReshardReport
    from .ops.reshard import run_reshard as reshard
    from .ops.retention import PrunePolicy, PruneReport
    from .ops.verify import VerifyReport, verify
    from .runs import RunReport


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
