"""`ckpt inspect`: what is inside a checkpoint, from headers and metadata only."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import FormatOpt, JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt inspect model.safetensors",
        "ckpt inspect out/checkpoint-500 --list --filter '*.layers.0.*'",
        "ckpt inspect model.safetensors -l | grep lm_head",
        "ckpt inspect hf://org/model@main --json",
    )
)
def inspect(
    src: SrcArg,
    tensors: Annotated[
        bool,
        typer.Option(
            "--list", "-l", help="List every entry, one per line: name, dtype, shape, bytes, file."
        ),
    ] = False,
    filter: Annotated[
        list[str] | None,
        typer.Option(
            "--filter", "-k", help="Only entries whose name matches this glob (repeatable)."
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--filter-out", help="Leave out entries whose name matches this glob (repeatable)."
        ),
    ] = None,
    format: FormatOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Show what a checkpoint holds: tensors, dtypes, shapes, bytes, files, training state.

    Reads headers and metadata only; no tensor data is loaded.
    """
    from ...ops.inspect import InspectReport, InspectRequest, inspect_with

    def render(report: InspectReport) -> None:
        from ..render.inspect import render_inspect  # rich: imported to print for people only

        render_inspect(report, show_tensors=tensors)

    request = InspectRequest(format=format, filters=filter, excludes=exclude)
    run_command(
        "inspect",
        json_output,
        lambda: inspect_with(src, request),
        render,
        # shown, but a malformed file is a bad checkpoint (exit 4), as `verify` judges it
        exit_code=lambda report: 4 if any(p.severity == "error" for p in report.problems) else 0,
    )
