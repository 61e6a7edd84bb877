"""What a run folder holds, as a listing tells it (`RunListing`): the one interface the run
judge (`judge.py`) and the scanner (`scan.py`) read a run through, implemented for a folder on
this machine (`local.py`) and for an object store or the Hub (`remote.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...storage import Storage
from .records import Found, RunCheckpoint


class RunListing(ABC):
    """What a run folder holds, as a listing tells it: candidates, their files and times.

    Attributes:
        storage: the run folder's storage; every file the judge reads is read through it.
        display: how the run folder is named in the report (`RunReport.run_dir`).
    """

    storage: Storage
    display: str

    @abstractmethod
    def discover(self) -> list[Found]:
        """The candidate checkpoints, named by the rules of `naming.collect`."""

    @abstractmethod
    def files(self, item: Found) -> dict[str, int]:
        """Every file of a candidate (a linked folder: of its target), path relative to the run
        folder -> size."""

    @abstractmethod
    def times(self, item: Found) -> tuple[float, float]:
        """(its modification time, the newest write seen through a link): seconds since the
        epoch, 0.0 when the listing does not say."""

    @abstractmethod
    def entry_time(self, item: Found) -> float:
        """The candidate's own time, for the order known before judging."""

    def where(self, rel: str) -> str:
        """How a path of the run folder is shown (`RunCheckpoint.path`)."""
        return f"{self.display}/{rel}"

    def link(self, item: Found) -> tuple[str, bool] | None:
        """(where it points, whether that exists) when the candidate is a symbolic link."""
        return None

    def holds(self, rel: str) -> bool:
        """Whether the run folder holds file `rel` outside every candidate (a single-file
        checkpoint's parity, `.ckpt-parity/NAME/`); False where the listing does not say."""
        return False

    def stamp(self, rel: str) -> tuple[int, int] | None:
        """(size, mtime in ns) of a file, following links, when the listing knows them: what
        the record of a slimmed single-file checkpoint is compared with."""
        return None

    @abstractmethod
    def root_files(self, items: list[Found]) -> list[str]:
        """Checkpoint files directly in the run folder that belong to no step checkpoint."""

    @abstractmethod
    def top_entries(self) -> dict[str, bool]:
        """Every entry at the run folder's top, name -> whether it is a folder, from the
        listing the scan has made already."""

    def upload_unfinished(self, item: Found) -> bool:
        """Whether the candidate is a save a `ckpt sync` to this folder has not finished
        uploading: the folder holds sync's record (`SYNC_RECORD`) and the save no manifest
        yet. Only a remote folder is a sync destination."""
        return False

    def mark_links(self, checkpoints: list[RunCheckpoint]) -> None:  # noqa: B027 - optional hook
        """Mark checkpoints a link in the run folder points at (only local folders have links)."""

    def close(self) -> None:
        """Finish with the folder's storage."""
        self.storage.close()
