"""`ckpt prune`: retention over a run folder; a plan unless `--yes`."""

from __future__ import annotations

from typing import Annotated

import typer

from ..cli import JsonOpt, app, run_command


@app.command(
    epilog=(
        "Examples:\n\n"
        "  ckpt prune out/ --keep-last 3                      # show the plan\n\n"
        "  ckpt prune out/ --keep-last 2 --keep-best eval_loss --incomplete --yes\n\n"
        "  ckpt prune out/ --keep-every 1000 --keep 2500 --yes --json\n\n"
        "  ckpt prune out/ --keep-last 3 --incomplete --watch 300 --yes   # while training runs"
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
    mode: Annotated[
        str,
        typer.Option("--mode", help="Whether the best --keep-best value is the min or the max."),
    ] = "min",
    keep: Annotated[
        list[int] | None,
        typer.Option("--keep", help="Never delete the checkpoint of this step (repeatable)."),
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
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            help="Re-apply the policy every SECONDS while a job runs (needs --yes; Ctrl-C stops).",
        ),
    ] = None,
    max_iterations: Annotated[
        int | None,
        typer.Option("--max-iterations", min=1, help="With --watch: stop after N rounds."),
    ] = None,
    settle: Annotated[
        float,
        typer.Option(
            "--settle",
            help="Seconds: a checkpoint with a file modified more recently is never touched.",
        ),
    ] = 120.0,
    json_output: JsonOpt = False,
) -> None:
    """Keep the checkpoints that matter in a run folder and delete the rest.

    Policies combine (a checkpoint survives if any rule keeps it). Never deleted: the newest
    complete checkpoint, the best one, the one a DeepSpeed `latest` file or the Trainer's
    `best_model_checkpoint` points at, one still being written, anything outside RUN_DIR
    (a symlinked checkpoint is unlinked, its target untouched). Without `--yes` nothing is
    deleted: every checkpoint is listed with keep/delete and the rule that decided.
    """
    from ..ops.prune import PrunePolicy, usage_check, watch_exit_code
    from ..ops.prune import prune as run_prune
    from ..ops.prune import watch as run_watch
    from ..render.prune import render_prune, render_watch, render_watch_round

    def policy() -> PrunePolicy:
        usage_check(mode, watch, yes, max_iterations)
        return PrunePolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            mode="max" if mode == "max" else "min",
            keep=list(keep or []),
            incomplete=incomplete,
            settle=settle,
        )

    if watch is None:
        run_command(
            "prune",
            json_output,
            lambda: run_prune(run_dir, policy(), yes=yes),
            render_prune,
            lambda report: 1 if report.failed else 0,
        )
        return
    interval = watch
    run_command(
        "prune",
        json_output,
        lambda: run_watch(
            run_dir,
            policy(),
            interval,
            max_iterations=max_iterations,
            on_round=None if json_output else render_watch_round,
        ),
        render_watch,
        watch_exit_code,
    )
