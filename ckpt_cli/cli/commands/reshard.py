"""`ckpt reshard`: cut a checkpoint for another shard size or another world size, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..app import ForceOpt, FormatOpt, JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt reshard out/step-1000 out/step-1000-4ranks --world-size 4",
        "ckpt reshard step-1000 step-1000-tp2 --world-size 2 --shard-dim '*.wo.weight=1' --shard-dim '*.norm.*=replicate'",
        "ckpt reshard step-1000 step-1000-8ranks --world-size 8 --rank-state drop",
        "ckpt reshard run/checkpoint-500 checkpoint-500-3ranks --world-size 3 --rank-state replicate",
        "ckpt reshard model/ model-2GB/ --max-shard-size 2GB --json",
        "ckpt reshard out/step-1000 out/step-1000-4ranks --world-size 4 --dry-run",
    )
)
def reshard(
    src: SrcArg,
    dest: Annotated[
        str,
        typer.Argument(
            help="Folder to write, local or an object-store URL (must not exist unless --force)."
        ),
    ],
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            min=1,
            help="DCP: rewrite as N ranks would have saved it (chunk r in __r_0.distcp).",
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            help="safetensors/torch: regroup into shards of at most this size "
            "(500MB, 2GB decimal as in huggingface_hub; 1.5GiB binary).",
        ),
    ] = None,
    shard_dim: Annotated[
        list[str] | None,
        typer.Option(
            "--shard-dim",
            help="Placement rule GLOB=DIM or GLOB=replicate (repeatable; first match wins; "
            "default dim 0; optimizer state follows its parameter).",
        ),
    ] = None,
    plan: Annotated[
        Path | None,
        typer.Option(
            "--plan",
            help='JSON file of placement rules: {"GLOB": DIM | "replicate", ...}, '
            "applied after --shard-dim rules.",
        ),
    ] = None,
    rank_state: Annotated[
        str | None,
        typer.Option(
            "--rank-state",
            help="Per-rank RNG / data-loader state when the world size changes: keep (as "
            "saved), drop (left out), replicate (new ranks get a copy of rank 0's). "
            "Asked for when needed.",
        ),
    ] = None,
    dcp_serialization: Annotated[
        str | None,
        typer.Option(
            "--dcp-serialization",
            help="DCP output serialization: torch_save or safetensors (default: as the source).",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", "-n", help="Show the files and sizes that would be written; write nothing."
        ),
    ] = False,
    no_extras: Annotated[
        bool,
        typer.Option(
            "--no-extras",
            help="Leave out the source folder's non-weight files (config.json, tokenizer...).",
        ),
    ] = False,
    dcp_compression: Annotated[
        str | None,
        typer.Option(
            "--dcp-compression",
            help="DCP output compression: zstd (DCP's ZStandard extension) or none (default: as the source).",
        ),
    ] = None,
    format: FormatOpt = None,
    force: ForceOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Cut a checkpoint for another world size (DCP) or another shard size (safetensors).

    A training folder (Trainer or accelerate checkpoint, FSDP or DDP) is resharded whole: each
    DCP sub-folder re-cut, per-rank files as --rank-state says, the rest copied verbatim.
    Streams one chunk at a time: memory follows the largest chunk, not the model. The output
    is checked before it is published in one rename.
    """
    from ...ops.reshard.run import ReshardRequest, reshard_with
    from ..render.progress import bar
    from ..render.reshard import render_reshard

    request = ReshardRequest(
        world_size=world_size,
        max_shard_size=max_shard_size,
        shard_dim=shard_dim or [],
        plan=plan,
        rank_state=rank_state,
        dcp_serialization=dcp_serialization,
        dcp_compression=dcp_compression,
        format=format,
        force=force,
        dry_run=dry_run,
        extras=not no_extras,
    )
    with bar(enabled=not json_output) as progress:
        run_command(
            "reshard",
            json_output,
            lambda: reshard_with(src, dest, request, progress),
            render_reshard,
        )
