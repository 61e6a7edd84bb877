"""What the `Checkpointer` reports: one `SaveRecord` per `save` call, `CheckpointerStatus`, and
the `LoadedCheckpoint` that `load_latest` returns."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from ..models import Record

#: the one format the Checkpointer saves in (through torch.distributed.checkpoint)
SAVE_FORMAT = "dcp"

#: where a save stands: `staged` (in host memory, not yet written), `writing` (DCP is writing
#: the staging folder), `publishing` (manifest, parity, the rename), `uploading` (to the object
#: store), `done`; `skipped` (another save was in flight and `on_busy="skip"`), `failed`
SavePhase = Literal["staged", "writing", "publishing", "uploading", "done", "skipped", "failed"]
#: where a loaded checkpoint came from: the local run folder, or the object store (pulled first)
Tier = Literal["local", "remote"]


class SaveRecord(Record):
    """One `Checkpointer.save` call and what became of it.

    Attributes:
        step: the training step saved.
        name: the checkpoint's folder name in the run folder (`step-500`).
        phase: where it stands (see `SavePhase`).
        path: the published local folder, once published.
        remote: the object-store URL it was uploaded to, once uploaded.
        bytes: bytes of tensor data staged.
        blocked_seconds: how long `save` held the training loop (waiting for an earlier save,
            capturing the state dicts and copying them into the staging buffer).
        waited_seconds: the part of `blocked_seconds` spent waiting for an earlier save.
        stage_seconds: the copy into the host staging buffer.
        write_seconds: DCP's write of every rank's data and the `.metadata` commit marker.
        publish_seconds: manifest, parity, fsync and the rename.
        upload_seconds: the upload to the object store.
        pruned: checkpoints retention removed after this save (local and remote).
        error: why it failed (or why it was skipped).
    """

    step: int
    name: str
    phase: SavePhase = "staged"
    path: str | None = None
    remote: str | None = None
    bytes: int = 0
    blocked_seconds: float = 0.0
    waited_seconds: float = 0.0
    stage_seconds: float = 0.0
    write_seconds: float = 0.0
    publish_seconds: float = 0.0
    upload_seconds: float = 0.0
    pruned: list[str] = Field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Nothing more will happen to this save (done, skipped or failed)."""
        return self.phase in ("done", "skipped", "failed")


class CheckpointerStatus(Record):
    """A snapshot of a `Checkpointer`, for a training loop's logs or a health probe.

    Attributes:
        run_dir: the local run folder.
        upload: the object-store prefix saves are uploaded to (None: local only).
        rank / world_size: this process in the launch (0 of 1 without torch.distributed).
        in_flight: the save being written in the background, if any.
        last: the most recent save that finished (done, skipped or failed).
        last_complete_step: the newest step this checkpointer published locally.
        last_uploaded_step: the newest step it uploaded.
        saves / skipped / failures: counts since construction.
        last_error: the newest failure's message.
        staging_bytes: bytes of host memory held by the staging buffer.
    """

    run_dir: str
    upload: str | None = None
    rank: int = 0
    world_size: int = 1
    in_flight: SaveRecord | None = None
    last: SaveRecord | None = None
    last_complete_step: int | None = None
    last_uploaded_step: int | None = None
    saves: int = 0
    skipped: int = 0
    failures: int = 0
    last_error: str | None = None
    staging_bytes: int = 0


class LoadedCheckpoint(Record):
    """What `Checkpointer.load_latest` loaded.

    Attributes:
        step: the step of the checkpoint.
        path: the local folder it was loaded from (a pulled remote save lands in the run folder).
        tier: `local`, or `remote` when it was pulled from the object store first.
        verified: the checks it passed before loading (`structure`, `checksums`, `parity`).
        skipped: newer saves that were passed over, each with the reason (`step-900: ...`).
        repaired: the files of the save its parity rebuilt before it was loaded (it was
            damaged; written with `protect=`), relative to its folder (`__0_0.distcp`).
        state: the loaded values of the entries of `into` that are not Stateful objects
            (RNG states, counters); Stateful entries were loaded in place.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    step: int
    path: str
    tier: Tier
    verified: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    repaired: list[str] = Field(default_factory=list)
    state: dict[str, Any] = Field(default_factory=dict)
