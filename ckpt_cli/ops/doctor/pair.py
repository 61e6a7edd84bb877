"""Two consecutive saves examined together, and the counter rule every family uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from .models import LogJump
from .save import Save


@dataclass
class Pair:
    """The save a run resumed from (`before`), the next save (`after`), and what surrounds them.

    Attributes:
        before / after: the two saves.
        earlier: the saves older than `before` (the RNG family looks for a state seen before).
        later: the saves newer than `after` (a pace taken up at the resume and kept after it).
        log: the logged loss and LR around the resume step, when a log covers it.
        stopped: a restart between them was found without the saved state (declared, or in
            the log, the step numbering or the file times: `points`).
    """

    before: Save
    after: Save
    earlier: list[Save] = field(default_factory=list)
    later: list[Save] = field(default_factory=list)
    log: LogJump | None = None
    stopped: bool = False

    @property
    def elapsed(self) -> int | None:
        """Steps between the two saves (None when either step is unknown, or not after)."""
        a, b = self.before.step, self.after.step
        if a is None or b is None or b <= a:
            return None
        return b - a

    def where(self) -> str:
        """`checkpoint-4 → checkpoint-6`, for evidence lines."""
        return f"{self.before.name} → {self.after.name}"


@dataclass
class Restart:
    """What a counter did across a pair: continued, or counted again from zero.

    Attributes:
        before / after: the counter in the two saves.
        continued: its value had it carried on at its pace (`before` + rate × elapsed).
        fresh: its value had it started from zero at the resume (rate × elapsed).
    """

    before: float
    after: float
    continued: float
    fresh: float
    paced: bool = True

    def outlook(self, continued: str, fresh: str) -> str:
        """`restored it would be 6, started over 2` (`continued` and `fresh` name each way);
        with the steps between the saves unknown (no pace): that the counter went back."""
        if not self.paced:
            return "it went back (the steps between the saves are unknown; carried on, it never goes back)"
        return f"{continued} {fmt(self.continued)}, {fresh} {fmt(self.fresh)}"

    @property
    def restarted(self) -> bool:
        """The counter went back, or stands nearer the fresh count than the continued one."""
        if self.after < self.before:
            return True
        return abs(self.after - self.fresh) < abs(self.after - self.continued)


def counter_restart(
    before: float | None, after: float | None, step_before: int | None, elapsed: int | None
) -> Restart | None:
    """How a counter that grows with the steps behaved across a pair (None: cannot tell).

    Its pace is taken from the save before (`before / step_before` per step): a counter that
    kept its value restarted from zero when it stands where a fresh one would be.
    """
    if before is None or after is None or before <= 0:
        return None
    if step_before is None or step_before <= 0 or elapsed is None:
        if after < before:
            return Restart(before, after, before, 0.0, paced=False)
        return None
    rate = before / step_before
    return Restart(before, after, before + rate * elapsed, rate * elapsed)


def fmt(value: float | None) -> str:
    """A number for an evidence line: integers bare, others to 4 significant digits."""
    if value is None:
        return "?"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"
