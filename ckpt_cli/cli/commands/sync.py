"""`ckpt sync`: a run's complete checkpoints copied to (or pulled from) an object store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ..app import DeprecatedModeOpt, HigherIsBetterOpt, JsonOpt, app, examples, run_command

if TYPE_CHECKING:
    from ...errors import CkptError


@app.command(
    epilog=examples(
        "ckpt sync out/ s3://bucket/run/                  # upload what the bucket lacks",
        "ckpt sync out/ s3://bucket/run/ --watch 300 --max-rate 200MB   # while training",
        "ckpt sync out/ s3://bucket/run/ --prune-remote --keep-last 5 --dry-run   # the plan",
        "ckpt sync out/ s3://bucket/run/ --prune-remote --keep-last 5 --yes",
        "ckpt sync s3://bucket/run/ out/ --latest         # on a fresh machine",
        'python train.py --resume_from_checkpoint "$(ckpt latest out/)"',
    )
)
def sync(
    src: Annotated[
        str,
        typer.Argument(
            help="Local run folder, or the remote run (s3://bucket/run/) to pull.",
            show_default=False,
        ),
    ],
    dest: Annotated[
        str,
        typer.Argument(
            help="Remote prefix to push to, or the local run folder to pull into.",
            show_default=False,
        ),
    ],
    latest: Annotated[
        bool,
        typer.Option("--latest", help="Pulling: only the newest complete checkpoint."),
    ] = False,
    watch: Annotated[
        str | None,
        typer.Option(
            "--watch",
            help="Sync again every DURATION (seconds, or 30s, 5m, 1h) while a job trains "
            "(Ctrl-C stops).",
        ),
    ] = None,
    max_iterations: Annotated[
        int | None,
        typer.Option("--max-iterations", min=1, help="With --watch: stop after N rounds."),
    ] = None,
    max_rate: Annotated[
        str | None,
        typer.Option(
            "--max-rate",
            metavar="SIZE",
            help="Bytes per second at most (200MB, 1GiB), so training keeps its network.",
        ),
    ] = None,
    prune_remote: Annotated[
        bool,
        typer.Option(
            "--prune-remote",
            help="After uploading, apply the --keep-* policy to the remote run folder "
            "(deletes with --yes; --dry-run shows the plan).",
        ),
    ] = False,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="With --prune-remote: delete what the policy drops (--prune-remote needs it, "
            "or --dry-run, which wins over it).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            "-n",
            help="Show what would be uploaded or pulled (and the --prune-remote plan); write "
            "nothing.",
        ),
    ] = False,
    keep_last: Annotated[
        int | None,
        typer.Option("--keep-last", min=1, help="With --prune-remote: keep the newest N."),
    ] = None,
    keep_every: Annotated[
        int | None,
        typer.Option("--keep-every", min=1, help="With --prune-remote: keep steps divisible by K."),
    ] = None,
    keep_best: Annotated[
        str | None,
        typer.Option("--keep-best", help="With --prune-remote: keep the best by this metric."),
    ] = None,
    keep_top: Annotated[
        int | None,
        typer.Option("--keep-top", min=1, help="With --keep-best: keep the N best."),
    ] = None,
    higher_is_better: HigherIsBetterOpt = None,
    keep_within: Annotated[
        str | None,
        typer.Option(
            "--keep-within",
            metavar="DURATION",
            help="With --prune-remote: keep every checkpoint uploaded within DURATION (2d).",
        ),
    ] = None,
    keep_every_duration: Annotated[
        str | None,
        typer.Option(
            "--keep-every-duration",
            metavar="DURATION",
            help="With --prune-remote: keep one checkpoint per DURATION window.",
        ),
    ] = None,
    settle: Annotated[
        str,
        typer.Option(
            "--settle",
            help="A save modified within this DURATION (seconds, or 2m, 1h) may still be being "
            "written: an incomplete one counts as writing, not interrupted; pushing, one of a "
            "layout without a commit marker (accelerate, plain) waits; pulling, a local "
            "incomplete one is not replaced.",
        ),
    ] = "120",
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            min=1,
            help="Files of a checkpoint uploaded (pushing) or fetched (pulling) at once "
            "(default 8).",
        ),
    ] = None,
    json_output: JsonOpt = False,
    mode: DeprecatedModeOpt = None,
) -> None:
    """Copy every COMPLETE checkpoint of a run folder that the other side lacks, verified.

    Pushing (SRC local, DEST `s3://…`): saves still being written or interrupted are never
    uploaded; each checkpoint's files go first, its commit markers after, its checksum
    manifest last; every object is checked against the bytes sent, and an interrupted sync
    resumes without sending finished files again. Pulling (SRC remote, DEST local): the
    checkpoints are checked against their manifests and appear in DEST with one rename.
    `--prune-remote` deletes remote checkpoints only with `--yes`, as `ckpt prune` does;
    `--dry-run` shows one round's plan (and the prune plan) and writes nothing anywhere.
    """
    from ...durations import parse_duration
    from ...ops.prune.retention import PrunePolicy, best_mode
    from ...ops.sync import SyncReport, SyncRequest, exit_code, sync_with
    from ...sizes import parse_size
    from ..conventions import BEST_END_MODE
    from ..render.sync import render_sync, render_sync_round

    def policy() -> PrunePolicy | None:
        higher = BEST_END_MODE.resolve("sync", mode.value if mode else None, higher_is_better)
        from ...errors import UsageError

        if prune_remote and not yes and not dry_run:
            # as `ckpt prune`: nothing is deleted without --yes. Refused rather than run
            # without pruning, so a script written before --yes existed fails loudly
            raise UsageError(
                "--prune-remote deletes remote checkpoints, and needs --yes to delete",
                fix="Add --yes to delete what the policy drops, or --dry-run to see the plan "
                "first.",
            )
        if yes and not prune_remote:
            raise UsageError(
                "--yes applies to --prune-remote (a sync deletes nothing otherwise)",
                fix="Add --prune-remote with a --keep-* policy, or leave --yes out.",
            )
        if not prune_remote:
            given = (keep_last, keep_every, keep_best, keep_top, keep_within, keep_every_duration)
            if any(given) or higher is not None:
                raise UsageError(
                    "--keep-* options and --higher-is-better / --lower-is-better apply to the "
                    "remote side with --prune-remote",
                    fix="Add --prune-remote, or prune the local folder with `ckpt prune`.",
                )
            return None
        return PrunePolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            keep_top=keep_top,
            mode=best_mode(higher, keep_best),
            keep_within=parse_duration(keep_within, "--keep-within") if keep_within else None,
            keep_every_duration=parse_duration(keep_every_duration, "--keep-every-duration")
            if keep_every_duration
            else None,
        )

    def action() -> SyncReport:
        from ...ops.prune.retention import RETENTION_OPTIONS, validate_policy

        chosen = policy()
        if chosen is not None:
            validate_policy(chosen, RETENTION_OPTIONS)
        request = SyncRequest(
            latest_only=latest,
            settle=parse_duration(settle, "--settle", allow_zero=True),
            max_rate=parse_size(max_rate, option="--max-rate") if max_rate else None,
            prune_policy=chosen,
            watch_seconds=parse_duration(watch, "--watch") if watch is not None else None,
            max_iterations=max_iterations,
            jobs=jobs,
            dry_run=dry_run,
        )
        on_round = None if json_output or watch is None else render_sync_round
        return sync_with(src, dest, request, on_round=on_round)

    def failure(report: SyncReport, code: int) -> CkptError:
        from ...errors import ProblemsFound, UnsafeInputError

        if report.refused_keys:
            return UnsafeInputError(
                "the remote listing (or a checkpoint's manifest) names paths that are not "
                "safe file names: " + ", ".join(repr(k) for k in report.refused_keys),
                path=src,
                fix="Delete or rename those objects; every other checkpoint was synced.",
            )
        return ProblemsFound(
            f"ckpt sync finished with exit {code}", fix="result.failed lists each checkpoint."
        )

    run_command("sync", json_output, action, render_sync, exit_code, failure=failure)
