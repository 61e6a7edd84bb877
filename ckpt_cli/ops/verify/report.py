"""What `ckpt verify` reports: the report and the health of each tensor `--deep` read."""

from __future__ import annotations

from pydantic import Field

from ...dist.command import RankShare
from ...models import Problem, Record, TrainingState
from ..parity import ParityCheck


class TensorHealth(Record):
    """Non-finite values found in one tensor by `--deep`."""

    name: str
    file: str | None = None
    nan: int = 0
    inf: int = 0


class VerifyReport(Record):
    """The result of `ckpt verify`.

    Attributes:
        location / format: what was checked and as which format.
        ok: no error-level problem was found.
        checks: which checks ran (`structure`, `resumable`, `checksums`, `deep`, `write-manifest`).
        files / bytes: files of the checkpoint considered and their total size.
        tensors: tensor entries checked by `--deep` (0 otherwise).
        hashed_bytes: bytes hashed for checksums.
        algorithm / manifest: the hash algorithm and manifest path, for checksum runs.
        manifest_written: `--write-manifest` wrote the manifest (False when problems stopped it).
        nonfinite: tensors holding NaN or Inf (`--deep`).
        training: the training state, when the source is a training checkpoint.
        problems: every problem found, errors and warnings; past the first 100 of one code
            (and severity), one more entry of that code says how many more there are.
        errors / warnings: counts by severity (of every problem found, listed or not).
        ranks: under torchrun, which files each rank hashed (empty in a single-process run).
    """

    location: str
    format: str | None = None
    ok: bool
    checks: list[str]
    files: int = 0
    bytes: int = 0
    tensors: int = 0
    hashed_bytes: int = 0
    algorithm: str | None = None
    manifest: str | None = None
    manifest_written: bool = False
    nonfinite: list[TensorHealth] = Field(default_factory=list)
    training: TrainingState | None = None
    problems: list[Problem] = Field(default_factory=list)
    errors: int = 0
    warnings: int = 0
    ranks: list[RankShare] = Field(default_factory=list)
    parity: ParityCheck | None = None
