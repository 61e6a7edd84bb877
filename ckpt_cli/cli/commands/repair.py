"""`ckpt repair`: rebuild lost or corrupt files of a protected checkpoint from its parity."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt repair out/checkpoint-500 --dry-run        # what would be rebuilt",
        "ckpt repair out/checkpoint-500",
        "ckpt repair s3://bucket/run/step-1000 --json",
    )
)
def repair(
    src: SrcArg,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", "-n", help="Check every block and say what would be rebuilt."),
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """Rebuild missing, truncated or corrupt files of SRC bit-exact from its parity.

    Every block is checked against the parity manifest; damaged files are rebuilt in staging,
    checked against the manifest's sha256 and put in place one rename each (indexes and
    `.metadata` last). Exit 0 when the checkpoint is intact afterwards; exit 1 when more than
    K blocks of a stripe are lost (the files that cannot be rebuilt are named and nothing is
    changed) or, with --dry-run, when there is damage to repair.
    """
    from ...ops.parity import RepairRequest, repair_with
    from ..render.progress import bar
    from ..render.repair import render_repair

    request = RepairRequest(dry_run=dry_run)
    with bar(enabled=not json_output) as progress:
        run_command(
            "repair",
            json_output,
            lambda: repair_with(src, request, progress),
            render_repair,
            exit_code=lambda report: 0 if report.ok else 1,
        )
