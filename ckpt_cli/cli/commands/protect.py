"""`ckpt protect`: Reed–Solomon parity for a checkpoint, so a lost or corrupt shard is rebuilt."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt protect out/checkpoint-500                 # K=2: any 2 lost shards rebuild",
        "ckpt protect model/ --parity 3 --block-size 4MiB",
        "ckpt protect s3://bucket/run/step-1000",
        "ckpt protect step-1000/ --dry-run               # the cost, and what it survives",
        "ckpt protect model/ --whole-files --parity 1    # any one file lost is rebuilt",
        "ckpt verify model/ --checksums                  # later: damage located to the block",
        "ckpt repair model/",
    )
)
def protect(
    src: SrcArg,
    parity: Annotated[
        int,
        typer.Option(
            "--parity",
            min=1,
            max=16,
            help="K: losses per stripe that can be rebuilt (any K whole files of a sharded "
            "checkpoint); parity is about K / (number of files) of the checkpoint.",
        ),
    ] = 2,
    block_size: Annotated[
        str,
        typer.Option(
            "--block-size",
            metavar="SIZE",
            help="Bytes per block at most (e.g. 1MiB, 4MiB; smaller for small files): the unit "
            "damage is located and rebuilt in; memory is about 2 x block size x (columns + K), "
            "columns <= 32.",
        ),
    ] = "1MiB",
    whole_files: Annotated[
        bool,
        typer.Option(
            "--whole-files",
            help="Protect every file whole, so any K files lost are rebuilt even when one file "
            "is most of the checkpoint (parity >= K x the largest file). The default for saves "
            "with files of two or more ranks (.distcp, ZeRO partitions) that striping could "
            "not rebuild if lost.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", "-n", help="Say what the parity would cost and survive; write nothing."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace the parity a protected checkpoint has already."),
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """Write parity for SRC into SRC/.ckpt-parity/ (ignored by every loader).

    Blocks are striped across the checkpoint's files, so any K whole files lost (a missing
    shard, the `.distcp` of a dead rank) and any K damaged blocks per stripe can be rebuilt by
    `ckpt repair`. A checkpoint that one file dominates is striped within itself (damaged
    blocks are rebuilt; that file lost whole is not), unless it holds files of two or more
    ranks that this would leave unrebuildable, or `--whole-files` is given: then every file
    is protected whole. What the parity
    costs and survives is said on stderr before anything is written. The parity manifest
    records every file's size, sha256 and per-block digests; it is written last, so an
    interrupted run leaves no parity.
    """
    from ...ops.parity import ProtectRequest, protect_with
    from ..render.progress import bar
    from ..render.protect import render_protect, render_protect_plan

    request = ProtectRequest(
        parity=parity,
        block_size=block_size,
        force=force,
        whole_files=True if whole_files else None,
        dry_run=dry_run,
    )
    with bar(enabled=not json_output) as progress:
        run_command(
            "protect",
            json_output,
            lambda: protect_with(
                src, request, None if json_output else render_protect_plan, progress
            ),
            render_protect,
        )
