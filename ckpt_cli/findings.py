"""Building problems: the collector header and index checks report flaws to (`Findings`),
a problem from an error (`problem_from_error`), and the fix of a checkpoint's lost file
(`restore_fix`).

Each `Problem` built here is validated against the code table of `problems.py`.
"""

from __future__ import annotations

from .errors import CkptError, FormatError
from .models import Problem, ProblemList
from .problems import Severity


class Findings:
    """The problem collector: where header and index validation sends what it finds.

    Strict findings (`strict=True`, what `open` uses) raise the first flaw as a FormatError;
    collecting findings (what `check` uses) record every flaw as a `Problem` and let the
    validation carry on, so `ckpt verify` reports all of them. Some flaws (data gaps, trailing
    bytes) do not stop a reader and are only looked for when collecting (`thorough`).
    """

    def __init__(self, strict: bool = True):
        self.strict = strict
        #: at most `models.MAX_EXAMPLES` of each code, the rest counted (a header of a million
        #: bad entries is a hundred problems and a count, not a million problems)
        self.problems: ProblemList = ProblemList()

    @property
    def thorough(self) -> bool:
        """Whether checks beyond what reading needs should run."""
        return not self.strict

    def add(
        self,
        code: str,
        problem: str,
        *,
        file: str,
        tensor: str | None = None,
        fix: str,
        severity: Severity = "error",
    ) -> None:
        """Record one flaw of `file` (a display path) and its fix, or raise it when strict."""
        if self.strict:
            raise FormatError(problem, path=file, fix=fix)
        if self.problems.full(code, severity):  # only counted: nothing to build
            self.problems.add_counted(code, severity, file, fix)
            return
        error = FormatError(problem, path=file, fix=fix)
        self.problems.append(
            Problem(
                code=code,
                message=error.stated,
                file=file,
                tensor=tensor,
                severity=severity,
                fix=fix,
            )
        )

    def add_counted(self, code: str, count: int, *, fix: str, severity: Severity = "error") -> None:
        """Count `count` more flaws of `code` (of several files) without listing them: for a
        check that listed the first `models.MAX_EXAMPLES` and knows how many more there are."""
        if count > 0:
            self.problems.add_counted(code, severity, None, fix, count=count)

    def error(self, error: CkptError, code: str | None = None) -> None:
        """Record what an exception said (as `code`, else the error's own code)."""
        self.problems.append(problem_from_error(error, code))


def problem_from_error(
    error: CkptError,
    code: str | None = None,
    *,
    file: str | None = None,
    tensor: str | None = None,
    severity: Severity = "error",
) -> Problem:
    """A `Problem` carrying what an exception said (as `code`, else the error's own code):
    its message (`path: problem`) and its fix, each in its own field; about `file` when
    given, else the error's path."""
    return Problem(
        code=code or error.code,
        message=error.stated,
        file=file if file is not None else error.path,
        tensor=tensor,
        severity=severity,
        fix=error.fix,
    )


def restore_fix(location: str) -> str:
    """The fix of a file of the checkpoint at `location` whose bytes are lost or wrong: a good
    copy of it, the parity, or the run's previous checkpoint. On the Hub, where a repository
    changes only by commits (no parity is written there, and `repair` refuses it), a good copy
    uploaded again or another revision."""
    from .storage.uri import is_hub_url

    if is_hub_url(location):
        return (
            "Upload the file again from a good copy of the checkpoint (a new commit to the "
            "repository), or read a revision that holds it intact (`hf://org/repo@REVISION`); "
            "`ckpt repair` does not write to the Hub."
        )
    return (
        "Copy or download the file again from where the checkpoint was saved (`ckpt repair "
        f"{location}` rebuilds it where the checkpoint was protected), or resume from an "
        "earlier checkpoint of the run (`ckpt latest RUN_DIR` names the newest complete one)."
    )
