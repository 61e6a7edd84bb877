"""Human rendering of `ckpt verify`: a short summary, then every problem."""

from __future__ import annotations

from rich.markup import escape

from ...errors import with_fix
from ...ops.verify.report import VerifyReport
from ...sizes import counted
from . import human_bytes, one_line_message, stdout
from .ranks import render_ranks

#: problems beyond this many per code are summarised (the JSON output has them all)
MAX_PER_CODE = 50


def render_verify(report: VerifyReport) -> None:
    """Print the verdict line, what was checked, and the problems grouped by code."""
    what = f"{counted(report.files, 'file')}, {human_bytes(report.bytes)}"
    if report.tensors:
        what += f", {report.tensors} tensors read"
    if report.hashed_bytes:
        what += f", {human_bytes(report.hashed_bytes)} hashed ({report.algorithm})"
    checks = ", ".join(report.checks)
    if report.ok:
        verdict = "[bold green]OK[/]"
    else:
        verdict = f"[bold red]FAILED[/]: {report.errors} problem{'s' if report.errors != 1 else ''}"
    if report.warnings:
        verdict += f", {report.warnings} warning{'s' if report.warnings != 1 else ''}"
    stdout.print(f"{escape(report.location)} ({report.format}): {verdict}", soft_wrap=True)
    stdout.print(f"[dim]checked: {checks} — {what}[/]", soft_wrap=True)
    state = report.training
    if "resumable" in report.checks and state is not None:
        levels = "resumable: " + (
            "yes" if state.resumable else f"no (missing: {', '.join(state.missing)})"
        )
        if state.resumable:
            levels += "; exact: " + (
                "yes" if state.exact else f"no (missing: {', '.join(state.missing_exact)})"
            )
        stdout.print(escape(levels), soft_wrap=True, highlight=False)
    if report.manifest_written:
        stdout.print(f"manifest written: {report.manifest}")
    render_ranks(report.ranks, verb="hashed")
    shown: dict[str, int] = {}
    found: dict[str, int] = {}
    for problem in report.problems:
        # a summary entry (`ProblemSummary`) stands for the problems of its code --json leaves out
        found[problem.code] = found.get(problem.code, 0) + problem.stands_for
        if problem.stands_for != 1:
            continue
        shown[problem.code] = shown.get(problem.code, 0) + 1
        if shown[problem.code] > MAX_PER_CODE:
            continue
        text = problem.message
        if problem.file and problem.file not in text:
            text = f"{problem.file}: {text}"
        # the fix follows the flaw, as in an error's message: `file: problem. fix`
        text = with_fix(text, problem.fix)
        tag = "[red]error[/]" if problem.severity == "error" else "[yellow]warning[/]"
        # one line per problem (fix included), never wrapped, so CI logs can be grepped
        stdout.print(
            f"  {tag} [bold]{problem.code}[/] {escape(one_line_message(text))}",
            highlight=False,
            soft_wrap=True,
        )
    for code, count in found.items():
        if count > MAX_PER_CODE:
            listed = shown[code]
            where = (
                "see --json"
                if listed == count
                else f"--json lists the first {listed:,} and counts the rest"
            )
            stdout.print(f"  [dim]… {count - MAX_PER_CODE:,} more {code} ({where})[/]")
