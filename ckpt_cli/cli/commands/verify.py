"""`ckpt verify`: is a checkpoint complete, intact and resumable? Exit 1 when not (for CI)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import FormatOpt, JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt verify out/checkpoint-500",
        "ckpt verify out/checkpoint-500 --resumable --deep",
        "ckpt verify model/ --write-manifest          # once, on a known-good copy",
        "ckpt verify model/ --checksums --json        # later, in CI",
        "ckpt verify hf://org/model@main",
        "ckpt verify ./model --checksums --manifest hf://org/model@main",
    )
)
def verify(
    src: SrcArg,
    checksums: Annotated[
        bool,
        typer.Option(
            "--checksums",
            "-c",
            help="Hash every file and compare with the checksum manifest (for hf:// SRC: the "
            "files in the local HF cache against the Hub's digests).",
        ),
    ] = False,
    write_manifest: Annotated[
        bool,
        typer.Option(
            "--write-manifest",
            help="Hash every file and record sizes and digests in a manifest "
            "(ckpt-manifest.json in the checkpoint folder, or --manifest PATH).",
        ),
    ] = False,
    manifest: Annotated[
        str | None,
        typer.Option(
            "--manifest",
            "-m",
            help="The checksum manifest to check against or write (default: "
            "ckpt-manifest.json in the checkpoint folder); hf://org/repo[@rev] checks a "
            "downloaded copy against the Hub's own sha256 digests.",
        ),
    ] = None,
    algo: Annotated[
        str | None,
        typer.Option(
            "--algo",
            help="Hash algorithm for --write-manifest: sha256 (default, the Hub's LFS oid), "
            "blake3 or xxh3 (faster; `pip install 'ckpt-cli[fast]'`).",
        ),
    ] = None,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep", help="Read every tensor: check it deserialises and count NaN/Inf values."
        ),
    ] = False,
    resumable: Annotated[
        bool,
        typer.Option(
            "--resumable",
            help="Require what training needs to continue: weights, optimizer state for every "
            "parameter, a step/epoch or scheduler; what an exact resume also needs is a warning.",
        ),
    ] = False,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Require a bit-identical resume (implies --resumable): scheduler, step, RNG "
            "and data-loader state too.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Let --write-manifest replace an existing manifest.")
    ] = False,
    format: FormatOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Check that a checkpoint is complete and intact; report every problem found.

    By default reads metadata and file sizes only (headers, offsets, index against shards, DCP
    chunk coverage). Exit 0 when all holds, 1 when problems were found, 3/4 when SRC cannot be
    read at all. Never modifies the checkpoint (except writing the manifest when asked).
    """
    from ...errors import ProblemsFound
    from ...ops.verify.report import VerifyReport
    from ...ops.verify.run import VerifyRequest, verify_with
    from ..render.progress import bar

    def render(report: VerifyReport) -> None:
        from ..render.verify import render_verify  # rich: imported to print for people only

        render_verify(report)

    request = VerifyRequest(
        format=format,
        checksums=checksums,
        write_manifest=write_manifest,
        manifest=manifest,
        algo=algo,
        deep=deep,
        resumable=resumable,
        force=force,
        exact=exact,
    )
    with bar(enabled=not json_output) as progress:
        run_command(
            "verify",
            json_output,
            lambda: verify_with(src, request, progress),
            render,
            exit_code=lambda report: 0 if report.ok else 1,
            failure=lambda report, _code: ProblemsFound(
                f"{report.errors} error(s) and {report.warnings} warning(s) found",
                path=src,
                fix="result.problems lists each one with its file and fix",
            ),
        )
