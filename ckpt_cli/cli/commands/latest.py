"""`ckpt latest`: the newest complete checkpoint of a run folder, for resume scripts."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt latest out/",
        'python train.py --resume_from_checkpoint "$(ckpt latest out/)"',
        "ckpt latest out/ --json   # every checkpoint: step, size, status, reason",
    )
)
def latest(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="Run folder holding step checkpoints (checkpoint-N/, step-N/, *.ckpt...).",
            show_default=False,
        ),
    ],
    settle: Annotated[
        str,
        typer.Option(
            "--settle",
            help="A save modified within this DURATION (seconds, or 2m, 1h) may still be being "
            "written: an incomplete one counts as writing, not interrupted.",
        ),
    ] = "120",
    json_output: JsonOpt = False,
) -> None:
    """Print the path of the newest COMPLETE checkpoint in RUN_DIR (exit 3 if there is none).

    Unlike resume logic that takes the highest step, saves that were interrupted or are still
    being written are skipped. `--json` gives the whole table of checkpoints.
    """
    from ...durations import parse_duration
    from ...ops.latest import LatestRequest, exit_code, latest_with, none_found
    from ...sources.runs import RunReport
    from ..render.latest import render_latest

    # the table of every checkpoint is judged in full only when it is printed (--json)
    def latest() -> RunReport:
        settle_seconds = parse_duration(settle, "--settle", allow_zero=True)
        return latest_with(run_dir, LatestRequest(settle=settle_seconds, full=json_output))

    run_command(
        "latest",
        json_output,
        latest,
        render_latest,
        exit_code,
        failure=lambda report, _code: none_found(report),
    )
