"""`ckpt prune`: retention over a run folder; a plan unless `--yes`."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import DeprecatedModeOpt, HigherIsBetterOpt, JsonOpt, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt prune out/ --keep-last 3                      # show the plan",
        "ckpt prune out/ --keep-last 2 --keep-best eval_loss --incomplete --yes",
        "ckpt prune out/ --keep-every 1000 --keep 2500 --yes --json",
        "ckpt prune out/ --keep-best eval_accuracy --higher-is-better --keep-last 1",
        "ckpt prune out/ --keep-last 3 --incomplete --watch 300 --yes   # while training runs",
        "ckpt prune out/ --keep-best eval_loss --keep-top 3 --keep-within 2d "
        "--keep-every-duration 6h",
        "ckpt prune out/ --keep-last 10 --slim-older-than 2 --yes   # old saves: weights only",
        "ckpt prune s3://bucket/run/ --keep-last 5 --yes            # an object-store run",
    )
)
def prune(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="Run folder holding step checkpoints (checkpoint-N/, step-N/, *.ckpt...).",
            show_default=False,
        ),
    ],
    keep_last: Annotated[
        int | None,
        typer.Option("--keep-last", min=1, help="Keep the newest N complete checkpoints."),
    ] = None,
    keep_every: Annotated[
        int | None,
        typer.Option("--keep-every", min=1, help="Keep checkpoints whose step is divisible by K."),
    ] = None,
    keep_best: Annotated[
        str | None,
        typer.Option(
            "--keep-best",
            help="Keep the best checkpoint by this metric (metrics.jsonl, trainer_state.json "
            "log_history or Lightning file names).",
        ),
    ] = None,
    higher_is_better: HigherIsBetterOpt = None,
    keep: Annotated[
        list[int] | None,
        typer.Option("--keep", help="Never delete the checkpoint of this step (repeatable)."),
    ] = None,
    keep_top: Annotated[
        int | None,
        typer.Option(
            "--keep-top",
            min=1,
            help="With --keep-best: keep the N best complete checkpoints by the metric.",
        ),
    ] = None,
    keep_within: Annotated[
        str | None,
        typer.Option(
            "--keep-within",
            metavar="DURATION",
            help="Keep every complete checkpoint modified within DURATION (90m, 6h, 2d, 1w).",
        ),
    ] = None,
    keep_every_duration: Annotated[
        str | None,
        typer.Option(
            "--keep-every-duration",
            metavar="DURATION",
            help="Keep one checkpoint per DURATION window (6h): the one closest to its start.",
        ),
    ] = None,
    slim_older_than: Annotated[
        int | None,
        typer.Option(
            "--slim-older-than",
            min=1,
            metavar="N",
            help="Keep the newest N complete checkpoints whole; from older kept ones remove "
            "optimizer, RNG and data-loader state (weights stay, for evaluation or export).",
        ),
    ] = None,
    incomplete: Annotated[
        bool,
        typer.Option(
            "--incomplete",
            help="Delete interrupted and incomplete saves older than the newest complete one.",
        ),
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Delete; without it only the plan is printed.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            "-n",
            help="Print the plan and delete nothing (the default without --yes; wins over it).",
        ),
    ] = False,
    watch: Annotated[
        str | None,
        typer.Option(
            "--watch",
            help="Re-apply the policy every DURATION (seconds, or 30s, 5m, 1h) while a job runs "
            "(needs --yes; Ctrl-C stops).",
        ),
    ] = None,
    max_iterations: Annotated[
        int | None,
        typer.Option("--max-iterations", min=1, help="With --watch: stop after N rounds."),
    ] = None,
    settle: Annotated[
        str,
        typer.Option(
            "--settle",
            help="A save modified within this DURATION (seconds, or 2m, 1h) may still be being "
            "written: an incomplete one counts as writing, not interrupted, and none is touched.",
        ),
    ] = "120",
    json_output: JsonOpt = False,
    mode: DeprecatedModeOpt = None,
) -> None:
    """Keep the checkpoints that matter in a run folder and delete the rest.

    Policies combine (a checkpoint survives if any rule keeps it, and the plan names every
    rule that keeps it). `--slim-older-than N` turns kept saves older than the newest N
    complete ones into weights-only saves (never the newest or the best). RUN_DIR may be an
    object-store prefix (`s3://bucket/run/`) or a Hub repo (`hf://org/repo`, plan only).
    Never deleted: the newest
    complete checkpoint, the best one, the one a DeepSpeed `latest` file or the Trainer's
    `best_model_checkpoint` points at, one still being written, anything outside RUN_DIR
    (a symlinked checkpoint is unlinked, its target untouched). Without `--yes` nothing is
    deleted: every checkpoint is listed with keep/delete and the rule that decided.
    """
    from ...durations import parse_duration
    from ...errors import ProblemsFound, UsageError
    from ...ops.prune.retention import (
        PrunePolicy,
        PruneReport,
        WatchReport,
        best_mode,
    )
    from ...ops.prune.run import exit_code
    from ...ops.prune.run import run as run_prune
    from ..conventions import BEST_END_MODE
    from ..render.prune import render_prune_result, render_watch_round

    def policy() -> PrunePolicy:
        higher = BEST_END_MODE.resolve("prune", mode.value if mode else None, higher_is_better)
        return PrunePolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            mode=best_mode(higher, keep_best),
            keep=list(keep or []),
            keep_top=keep_top,
            keep_within=parse_duration(keep_within, "--keep-within") if keep_within else None,
            keep_every_duration=parse_duration(keep_every_duration, "--keep-every-duration")
            if keep_every_duration
            else None,
            slim_older_than=slim_older_than,
            incomplete=incomplete,
            settle=parse_duration(settle, "--settle", allow_zero=True),
        )

    def prune_run() -> PruneReport | WatchReport:
        if dry_run and watch is not None:
            # not "needs --yes": --dry-run wins over --yes, and a watch that deletes nothing
            # would only repeat the plan
            raise UsageError(
                "--dry-run and --watch conflict: --watch deletes as it goes",
                fix="Leave --watch out to see the plan, or --dry-run out to watch with --yes.",
            )
        return run_prune(
            run_dir,
            policy(),
            yes=yes and not dry_run,
            watch_seconds=parse_duration(watch, "--watch") if watch is not None else None,
            max_iterations=max_iterations,
            on_round=None if json_output else render_watch_round,
        )

    run_command(
        "prune",
        json_output,
        prune_run,
        lambda report: render_prune_result(report, dry_run=dry_run),
        exit_code,
        failure=lambda _report, _code: ProblemsFound(
            "some deletions failed",
            path=run_dir,
            fix="result.failed names each checkpoint not deleted and why",
        ),
    )
