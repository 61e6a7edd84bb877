"""Human rendering of `ckpt prune` and of run tables (`ckpt inspect RUN_DIR`)."""

from __future__ import annotations

import time

from rich.table import Table

from ...ops.prune.retention import PARTLY_DELETED, PruneReport, WatchReport
from ...sources.runs import RunCheckpoint, RunReport
from . import errors, human_bytes, stderr, stdout

_STATUS_STYLE = {
    "complete": "green",
    "incomplete": "red",
    "interrupted": "red",
    "writing": "yellow",
}


def _step(c: RunCheckpoint) -> str:
    if c.step is not None:
        return str(c.step)
    return f"epoch {c.epoch:g}" if c.epoch is not None else "?"


def _age(mtime: float) -> str:
    if mtime <= 0:
        return "unknown"  # the listing records no times (a Hub repository)
    seconds = max(0.0, time.time() - mtime)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def render_run(report: RunReport) -> None:
    """The run table: every checkpoint, its status, size, age and markers."""
    stdout.print(
        f"[bold]{report.run_dir}[/]  (run folder: {', '.join(report.layouts) or 'no checkpoints'}, "
        f"{len(report.checkpoints)} checkpoint{'s' if len(report.checkpoints) != 1 else ''})",
        soft_wrap=True,
    )
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("checkpoint", "step", "status", "size", "modified", "notes"):
        table.add_column(column, overflow="fold")
    for c in report.checkpoints:
        style = _STATUS_STYLE.get(c.status, "")
        notes = list(c.markers)
        if c.metric is not None and report.best is not None:
            notes.append(f"{report.best.metric}={c.metric:g}")
        if c.symlink:
            # a link to a sibling save (`best -> global_step100`) is another name of it
            sibling = c.complete and c.link_target is not None and "/" not in c.link_target
            notes.append(f"alias of {c.link_target}" if sibling else f"-> {c.link_target}")
        if c.reason:
            notes.append(c.reason)
        table.add_row(
            c.name,
            _step(c),
            f"[{style}]{c.status}[/]" if style else c.status,
            human_bytes(c.size),
            _age(c.mtime),
            "; ".join(notes),
        )
    if report.checkpoints:
        stdout.print(table)
    _render_aliases(report.aliases, kept=False)
    stdout.print(f"latest complete: {report.latest or '[red]none[/]'}", soft_wrap=True)
    if report.trainer_best:
        metric = (
            f" (best_metric {report.trainer_best_metric:g})"
            if report.trainer_best_metric is not None
            else ""
        )
        stdout.print(
            f"Trainer best_model_checkpoint: {report.trainer_best}{metric}", soft_wrap=True
        )
    if report.deepspeed_latest:
        stdout.print(f"DeepSpeed latest: {report.deepspeed_latest}")
    if report.megatron_latest:
        stdout.print(f"Megatron latest_checkpointed_iteration.txt: {report.megatron_latest}")
    if report.tracker_problem:
        stdout.print(f"warning: {report.tracker_problem}", soft_wrap=True, markup=False)
    if report.root_files:
        stdout.print(
            f"also in the folder itself: {', '.join(report.root_files)} "
            "(inspect them with --format or by file name)",
            soft_wrap=True,
        )
    for why in report.left_out:
        stdout.print(f"left out: {why}", soft_wrap=True, markup=False, highlight=False)


def _render_aliases(aliases: dict[str, str], *, kept: bool) -> None:
    """The links to a save of the run (`best -> global_step100`): another name of it, no save
    of their own; `kept`: said in a prune's plan (the link stays, and so does its save)."""
    for name, target in aliases.items():
        note = f" (a link, no save of its own: kept, and {target} with it)" if kept else ""
        stdout.print(
            f"{name}: alias of {target}{note}", soft_wrap=True, markup=False, highlight=False
        )


def render_prune(report: PruneReport, *, dry_run: bool = False) -> None:
    """Every checkpoint with its action and rule, then the bytes freed (or to free);
    `dry_run`: the plan was asked for with `--dry-run` (with `--yes` too, perhaps)."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("checkpoint", "step", "status", "size", "action", "rule"):
        table.add_column(column, overflow="fold")
    for d in report.decisions:
        d_rule = d.rule
        if d.action == "keep":
            action = "[green]keep[/]"
            if d.not_slimmed:
                d_rule = f"{d.rule}; not slimmed: {d.not_slimmed}"
        elif d.action == "slim":
            done = "slimmed" if d.deleted else "[yellow]not slimmed[/]"
            action = f"[cyan]{done if report.applied else 'slim'}[/]"
            freed = d.slim.bytes if d.slim is not None else 0
            kept = "".join(f"; its {why}" for why in (d.slim.kept if d.slim else []))
            d_rule = f"{d.rule}{kept}; frees {'' if report.applied else '~'}{human_bytes(freed)}"
        elif report.applied:
            action = (
                "[red]deleted[/]"
                if d.deleted
                else "[red]partly deleted[/]"
                if d.error and d.error.startswith(PARTLY_DELETED)
                else "[yellow]not deleted[/]"
            )
        else:
            action = "[red]delete[/]"
        rule = d_rule + (f" ({d.error})" if d.error else "")
        table.add_row(
            d.name,
            str(d.step) if d.step is not None else "?",
            d.status,
            human_bytes(d.size),
            action,
            rule,
        )
    stdout.print(f"[bold]{report.run_dir}[/]", soft_wrap=True)
    if report.decisions:
        stdout.print(table)
    for d in report.decisions:  # every file a slim removes or keeps, with why
        if d.action != "slim" or d.slim is None:
            continue
        finished = report.applied and d.deleted
        for f in d.slim.listing:
            verb = (
                ("removed" if finished else "removes")
                if f.removed
                else ("kept" if finished else "keeps")
            )
            stdout.print(
                f"  {d.name}: {verb} {f.path} ({f.why})",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
    _render_aliases(report.aliases, kept=True)
    for why in report.left_out:
        stdout.print(f"left out: {why}", soft_wrap=True, markup=False, highlight=False)
    if report.applied:
        stdout.print(
            f"deleted {len(report.deleted)} checkpoint{'s' if len(report.deleted) != 1 else ''}, "
            f"freed {human_bytes(report.bytes_freed)}"
        )
        if report.slimmed:
            stdout.print(
                f"slimmed {len(report.slimmed)} checkpoint{'s' if len(report.slimmed) != 1 else ''}"
                f" to weights only, freed {human_bytes(report.bytes_slimmed)}"
            )
        for failure in report.failed:  # the reason of exit 1: printed with --quiet too
            errors.print(_failure(failure), soft_wrap=True)
    elif report.to_delete or report.to_slim:
        if report.to_slim:
            stdout.print(
                f"would slim {report.to_slim} checkpoint{'s' if report.to_slim != 1 else ''} "
                f"to weights only, freeing ~{human_bytes(report.bytes_to_slim)}"
            )
        if report.to_delete:
            stdout.print(
                f"would delete {report.to_delete} "
                f"checkpoint{'s' if report.to_delete != 1 else ''}, "
                f"freeing {human_bytes(report.bytes_to_free)}"
            )
        if dry_run:  # --yes may be there too: "run again with --yes" would not help
            stdout.print("nothing was deleted (--dry-run; leave it out, with --yes, to delete)")
        else:
            stdout.print("nothing was deleted (run again with --yes to delete)")
    else:
        stdout.print("nothing to delete")


def render_watch_round(report: PruneReport) -> None:
    """One line per deletion during `--watch` (quiet rounds print nothing)."""
    stamp = time.strftime("%H:%M:%S")
    for d in report.decisions:
        if d.deleted and d.action == "slim":
            freed = d.slim.bytes if d.slim is not None else 0
            stdout.print(f"{stamp} slimmed {d.name}, freed {human_bytes(freed)}")
        elif d.deleted:
            stdout.print(f"{stamp} deleted {d.name} ({d.rule}), freed {human_bytes(d.size)}")
    for failure in report.failed:
        errors.print(f"{stamp} {_failure(failure)}", soft_wrap=True)


def _failure(failure: str) -> str:
    """A line of `PruneReport.failed`: a partly deleted checkpoint says so itself."""
    if f": {PARTLY_DELETED}:" in failure:
        return f"[red]{failure}[/]"
    return f"[yellow]not deleted:[/] {failure}"


def render_watch(report: WatchReport) -> None:
    """The summary printed when `--watch` stops."""
    stderr.print(
        f"stopped ({report.stopped}) after {report.iterations} round"
        f"{'s' if report.iterations != 1 else ''}: deleted {len(report.deleted)} "
        f"checkpoint{'s' if len(report.deleted) != 1 else ''}, freed {human_bytes(report.bytes_freed)}"
    )


def render_prune_result(report: PruneReport | WatchReport, *, dry_run: bool = False) -> None:
    """A plan or its deletions; for `--watch`, the closing summary."""
    if isinstance(report, WatchReport):
        render_watch(report)
    else:
        render_prune(report, dry_run=dry_run)
