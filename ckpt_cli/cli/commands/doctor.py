"""`ckpt doctor`: why did a resumed run diverge? Explained from the saved files alone."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt doctor out/",
        "ckpt doctor --before out/checkpoint-400 --after out/checkpoint-600",
        "ckpt doctor out/ --expect world-size --json",
    )
)
def doctor(
    run_dir: Annotated[
        str | None,
        typer.Argument(
            help="Run folder holding the saves (checkpoint-N/, step-N/...), local or a URL; "
            "or one checkpoint, whose consistency is checked.",
            show_default=False,
        ),
    ] = None,
    before: Annotated[
        str | None,
        typer.Option(
            "--before",
            metavar="SAVE",
            help="The save the run resumed from (path, or name in RUN_DIR).",
        ),
    ] = None,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            metavar="SAVE",
            help="A save the resumed run wrote (path, or name in RUN_DIR).",
        ),
    ] = None,
    expect: Annotated[
        list[str] | None,
        typer.Option(
            "--expect",
            metavar="CHANGE",
            help="A change made on purpose, reported but not ranked (repeatable): batch, "
            "world-size, precision, config, tokenizer, scheduler, optimizer, optimizer-settings, "
            "data, rng, ema, scaler.",
        ),
    ] = None,
    settle: Annotated[
        str | None,
        typer.Option(
            "--settle",
            help="A save modified within this DURATION (seconds, or 2m, 1h) may still be being "
            "written: an incomplete one counts as writing, not interrupted (in RUN_DIR; "
            "default 120).",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Rank the causes of a resumed run's divergence, each with its evidence and the fix.

    Every two consecutive saves are compared: optimizer, scheduler, data position, grad
    scaler, weights, precision, batch settings, EMA, RNG, config and tokenizer; the logs
    (trainer_state.json, metrics.jsonl, Lightning metrics.csv) give the loss and LR at each
    resume. Exit 0 when no cause is found, 1 when one is.
    """
    from ...durations import parse_duration
    from ...errors import ProblemsFound
    from ...ops.doctor import DoctorReport, DoctorRequest, doctor_with
    from ..render.doctor import render_doctor

    def doctor() -> DoctorReport:
        seconds = None if settle is None else parse_duration(settle, "--settle", allow_zero=True)
        request = DoctorRequest(before=before, after=after, expect=expect or [], settle=seconds)
        return doctor_with(run_dir, request)

    run_command(
        "doctor",
        json_output,
        doctor,
        render_doctor,
        exit_code=lambda report: 1 if report.found else 0,
        failure=lambda report, _code: ProblemsFound(
            report.verdict, fix="result.causes lists each cause, its evidence and its fix"
        ),
    )
