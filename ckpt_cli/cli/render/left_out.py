"""What an output does not hold, said one way by every command that writes one (`convert`,
`reshard`, `merge`): on stderr, each file under "not in the output:" (past three files of a
sub-folder left out for one reason, one line for the folder), then the entries left out by
reason; never among the data on stdout."""

from __future__ import annotations

from collections.abc import Sequence

from ...ops.shared.transfer import SkippedEntry
from . import one_line, stderr

#: files, and groups of entries, named one by one; past that, counted
MAX_LISTED = 8
#: a sub-folder's files left out for one reason are named one by one up to this many, past
#: that one line for the folder
GROUPED_FROM = 3


def _group(name: str) -> str:
    """The folder a left-out file is counted under: the top folder of a name inside the
    source (`checkpoint-500/`), the folder holding it for a path as the user typed it
    (`merge`'s ADAPTER files: `/runs/lora/checkpoint-500/`, never `/`)."""
    if "/" not in name:
        return name
    top = name.split("/", 1)[0]
    if top in ("", ".", ".."):
        return name.rsplit("/", 1)[0] + "/"
    return top + "/"


def render_not_in_output(skipped: Sequence[SkippedEntry]) -> None:
    """What the output does not hold, on stderr: each file, then the entries by reason (a dry
    run says the same as the run it plans)."""
    # the files of one sub-folder left out for one reason (a save beside the model) are one
    # line: `checkpoint-500/ (7 files)`
    lines: dict[tuple[str, str], list[str]] = {}
    for item in skipped:
        if item.kind == "file":
            lines.setdefault((_group(item.name), item.reason), []).append(item.name)
    shown = [
        f"{one_line(folder)} ({len(names)} files): {reason}"
        if len(names) > GROUPED_FROM
        else f"{one_line(name)}: {reason}"
        for (folder, reason), names in lines.items()
        for name in (names[:1] if len(names) > GROUPED_FROM else names)
    ]
    for line in shown[:MAX_LISTED]:
        stderr.print(f"[yellow]not in the output:[/] {line}", highlight=False)
    if len(shown) > MAX_LISTED:
        counts = [
            len(names) if len(names) > GROUPED_FROM else 1
            for names in lines.values()
            for _ in (names[:1] if len(names) > GROUPED_FROM else names)
        ]
        stderr.print(f"[yellow]… {sum(counts[MAX_LISTED:])} more files not in the output[/]")
    by_reason: dict[str, list[SkippedEntry]] = {}
    for entry in skipped:
        if entry.kind != "file":
            by_reason.setdefault(entry.reason, []).append(entry)
    for reason, entries in by_reason.items():
        # one line a reason, grouped by parent so 50 optimizer hyper-parameters read as one
        # line; a group of one is named in full
        groups: dict[str, list[str]] = {}
        for entry in entries:
            parent = entry.name.rsplit(".", 1)[0] if "." in entry.name else entry.name
            groups.setdefault(parent, []).append(entry.name)
        listed = [
            f"{one_line(name)}.* ({len(n)})" if len(n) > 1 else one_line(n[0])
            for name, n in groups.items()
        ]
        more = f", … {len(listed) - MAX_LISTED} more" if len(listed) > MAX_LISTED else ""
        kinds = {e.kind for e in entries}
        noun = (
            "tensor" if kinds == {"tensor"} else "component" if kinds == {"component"} else "entry"
        )
        what = noun if len(entries) == 1 else "entries" if noun == "entry" else f"{noun}s"
        stderr.print(
            f"[yellow]skipped {len(entries)} {what}[/] "
            f"({reason}): {', '.join(listed[:MAX_LISTED])}{more}",
            highlight=False,
        )
