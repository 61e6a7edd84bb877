"""`ckpt diff`: compare two checkpoints of any formats entry by entry."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt diff run-a/step-1000 run-b/step-1000",
        "ckpt diff step-1000/ hf-model/ --select model",
        "ckpt diff outputs/checkpoint/step-1000 llama-hf/ --select model",
        "ckpt diff model.safetensors model-bf16.safetensors --atol 1e-2 --rtol 1e-2 --ignore-dtype",
        "ckpt diff a.pt b.pt --filter 'optimizer.*' --json",
        "ckpt diff model-fp8/ model-bf16/ --dequantize --rtol 0.1",
    )
)
def diff(
    a: Annotated[
        str, typer.Argument(help="First checkpoint (file, folder or URL).", show_default=False)
    ],
    b: Annotated[
        str, typer.Argument(help="Second checkpoint (file, folder or URL).", show_default=False)
    ],
    atol: Annotated[
        float | None,
        typer.Option(
            "--atol", help="Absolute tolerance: |a-b| <= atol + rtol*|b| counts as equal."
        ),
    ] = None,
    rtol: Annotated[
        float | None,
        typer.Option("--rtol", help="Relative tolerance (to |b|); without tolerances, bit-exact."),
    ] = None,
    rename: Annotated[
        list[str] | None,
        typer.Option("--rename", help="Rename a name prefix on both sides, OLD=NEW (repeatable)."),
    ] = None,
    select: Annotated[
        str | None,
        typer.Option(
            "--select",
            help="Compare the sub-tree under this prefix, stripped, on each side that has it.",
        ),
    ] = None,
    filter: Annotated[
        list[str] | None,
        typer.Option("--filter", "-k", help="Only names matching this glob (repeatable)."),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option("--filter-out", help="Leave out names matching this glob (repeatable)."),
    ] = None,
    format_a: Annotated[
        str | None,
        typer.Option("--format-a", help="Read A as this format instead of detecting it."),
    ] = None,
    format_b: Annotated[
        str | None,
        typer.Option("--format-b", help="Read B as this format instead of detecting it."),
    ] = None,
    dequantize: Annotated[
        bool,
        typer.Option(
            "--dequantize",
            help="Compare FP8 / MXFP4 / NVFP4 / INT4 / INT8 weights and GGUF blocks by their "
            "dequantized values, "
            "with "
            "per-weight error statistics (max abs, relative RMS).",
        ),
    ] = False,
    ignore_dtype: Annotated[
        bool,
        typer.Option(
            "--ignore-dtype",
            help="A dtype change alone is no difference: judge such pairs by their values.",
        ),
    ] = False,
    naming: Annotated[
        str,
        typer.Option(
            "--naming",
            help="auto: two namings of one model family (a torchtitan or Megatron save and its "
            "--to hf export) are compared through its mapping, in hf names; off: names as "
            "they are; hf / torchtitan / megatron: compare in that naming.",
        ),
    ] = "auto",
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            metavar="PATH|hf://ORG/MODEL",
            help="The model's config.json (a file, a model folder or a Hub model), for what "
            "the naming mapping needs and the weights do not tell (head counts), where "
            "neither side holds one.",
        ),
    ] = None,
    flavor: Annotated[
        str | None,
        typer.Option(
            "--flavor",
            help="The torchtitan model flavor (8B, debugmodel...), for the same (needs "
            "torchtitan).",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Compare two checkpoints: missing names, dtype/shape changes, tensor values, state values.

    Exit 0 when identical (bit-exact, or within --atol/--rtol), 1 when they differ. Tensors are
    read one pair at a time; non-tensor entries (step, RNG, scheduler, data loader) are compared
    by value.
    """
    from ...errors import ProblemsFound
    from ...ops.diff.run import DiffReport, DiffRequest, diff_with
    from ..render.progress import bar

    def render(report: DiffReport) -> None:
        from ..render.diff import render_diff  # rich: imported to print for people only

        render_diff(report)

    request = DiffRequest(
        format_a=format_a,
        format_b=format_b,
        atol=atol,
        rtol=rtol,
        renames=rename,
        select=select,
        filters=filter,
        excludes=exclude,
        dequantize=dequantize,
        ignore_dtype=ignore_dtype,
        naming=naming,
        config=config,
        flavor=flavor,
    )
    with bar(enabled=not json_output) as progress:
        run_command(
            "diff",
            json_output,
            lambda: diff_with(a, b, request, progress),
            render,
            exit_code=lambda report: 0 if report.identical else 1,
            failure=lambda report, _code: ProblemsFound(
                f"{a} and {b} differ: {report.verdict}",
                fix="result.differences, only_a and only_b list what differs",
            ),
        )
