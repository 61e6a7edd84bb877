"""The error hierarchy: every expected failure is a `CkptError` with an exit code.

A message names the file, the problem and the fix. The CLI prints `str(error)` and exits
with `error.exit_code`; the JSON envelope carries `error.code` (a stable string) too.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import ClassVar

#: the fix of a failure no input can cause (a caller skipped the capability check that guards
#: the call): there is nothing to change in the checkpoint, only a bug to report
REPORT_BUG = "This is a bug in ckpt: please report it with the command you ran."


def with_fix(text: str, fix: str | None) -> str:
    """`text` followed by its fix, as every message reads: `path: problem. fix` (`text` alone
    when there is no fix). The one spelling of an error's message and of a problem's line."""
    if not fix:
        return text
    text = text.rstrip(".")
    return f"{text} {fix}" if text.endswith(("?", "!")) else f"{text}. {fix}"


class CkptError(Exception):
    """Base class of expected failures.

    Args:
        problem: what is wrong, as a sentence fragment ("header length 10 GB is past the end").
        path: the file or location concerned; it leads the message.
        fix: what the user can do about it ("re-download the shard", "pass --force").
    """

    exit_code: ClassVar[int] = 70
    code: ClassVar[str] = "internal"

    def __init__(self, problem: str, *, path: str | PurePath | None = None, fix: str | None = None):
        self.problem = problem
        self.path = str(path) if path is not None else None
        self.fix = fix
        super().__init__(self.message)

    @property
    def stated(self) -> str:
        """The message without its fix: `path: problem` (a `Problem` built from this error
        carries the fix in its own `fix` field)."""
        return f"{self.path}: {self.problem}" if self.path else self.problem

    @property
    def message(self) -> str:
        """The full human message: `path: problem. fix`."""
        return with_fix(self.stated, self.fix)

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as itself, whatever its constructor takes: another rank of a torchrun
        launch re-raises the very error (class, exit code, path, problem and fix)."""
        return (_restored, (type(self), self.args), self.__dict__)

    def to_json(self) -> dict[str, str | int | None]:
        """The `error` member of the JSON envelope."""
        return {
            "code": self.code,
            "exit_code": self.exit_code,
            "message": self.message,
            "path": self.path,
            "problem": self.problem,
            "fix": self.fix,
        }


def _restored(cls: type[CkptError], args: tuple[object, ...]) -> CkptError:
    """A pickled `CkptError`, its attributes set by pickle afterwards (no `__init__` call)."""
    return cls.__new__(cls, *args)


class ProblemsFound(CkptError):
    """A run that finished and found problems: verify, diff, a failed deletion (exit 1).

    Not raised by the library: the CLI puts it in the JSON envelope of an exit-1 result, so
    every non-zero exit carries an error object (code, message, fix).
    """

    exit_code = 1
    code = "problems_found"


class UsageError(CkptError):
    """Bad arguments or option combinations (exit 2)."""

    exit_code = 2
    code = "usage"


class NotFoundError(CkptError):
    """A path, tensor, repository or revision that does not exist (exit 3)."""

    exit_code = 3
    code = "not_found"


class NoCheckpointError(NotFoundError):
    """A location that exists and holds no checkpoint: an empty folder, or one of other
    files (exit 3, as for a path that does not exist: what was asked for is not there; 4 is
    for a checkpoint that is there and bad). Every command that reads a checkpoint or a run
    folder raises this one for it."""

    code = "no_checkpoint"


class MissingPrefixError(NotFoundError):
    """Nothing at a location of an object store whose bucket exists: no object and no prefix
    (exit 3). A run's upload prefix is one until its first save arrives."""


class FormatError(CkptError):
    """A corrupt, hostile, unsupported, unrecognised or ambiguous checkpoint (exit 4)."""

    exit_code = 4
    code = "bad_checkpoint"


class UnsafeInputError(FormatError):
    """Input that tried to run code or escape the checkpoint folder (exit 4)."""

    code = "unsafe_input"


class CorruptDataError(FormatError):
    """Stored bytes that fail the checksum their own file records for them (a zip member's
    CRC-32): they changed after they were written (exit 4)."""

    code = "corrupt_data"


class MissingRanksError(FormatError):
    """A legacy Megatron-LM save (`iter_N/mp_rank_*/`) that lacks rank folders its args call
    for (exit 4; `verify` reports it as a problem, exit 1)."""

    code = "missing_rank_folder"


class DestinationExistsError(UsageError):
    """An output that exists already and `--force` was not given (exit 2)."""

    code = "destination_exists"


class HubError(CkptError):
    """A Hub, network or authentication failure (exit 5)."""

    exit_code = 5
    code = "hub"


class Interrupted(CkptError):
    """The user interrupted the run; partial outputs were removed (exit 130)."""

    exit_code = 130
    code = "interrupted"


class IOFailure(CkptError):
    """The operating system refused a read or a write (disk full, I/O error, read-only
    filesystem, permission denied, cross-device rename, a short transfer): exit 74, as
    sysexits' EX_IOERR. Nothing is wrong with ckpt or (necessarily) with the checkpoint; the
    partial output was removed.
    """

    exit_code = 74
    code = "io_error"


class Terminated(Interrupted):
    """Stopped by SIGTERM; partial outputs were removed (exit 143 = 128 + SIGTERM)."""

    exit_code = 143
    code = "terminated"


class HungUp(Terminated):
    """Stopped by SIGHUP (the terminal went away); partial outputs were removed (exit 129)."""

    exit_code = 129
    code = "hangup"
