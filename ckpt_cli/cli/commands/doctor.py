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
            "world-size, precision, config, tokenizer, scheduler, optimizer, data, rng, ema, "
            "scaler.",
        ),
    ] = None,
    settle: Annotated[
        float | None,
        typer.Option(
            "--settle",
            min=0,
            help="Seconds: an incomplete save of RUN_DIR modified more recently counts as "
            "still being written (default 120).",
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
    from ...errors import ProblemsFound
    from ...ops.doctor import DoctorRequest, doctor_with
    from ..render.doctor import render_doctor

    request = DoctorRequest(before=before, after=after, expect=expect or [], settle=settle)
    run_command(
        "doctor",
        json_output,
        lambda: doctor_with(run_dir, request),
        render_doctor,
        exit_code=lambda report: 1 if report.found else 0,
        failure=lambda report, _code: ProblemsFound(
            report.verdict, fix="result.causes lists each cause, its evidence and its fix"
        ),
    )
