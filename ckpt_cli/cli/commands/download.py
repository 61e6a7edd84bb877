"""`ckpt download`: only the Hub shards, or only the bytes, that hold the tensors you ask for."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ..app import ForceOpt, JsonOpt, app, examples, run_command


class Mode(str, Enum):
    """How `ckpt download` fetches: whole shards, or only the selected tensors' bytes."""

    shards = "shards"
    tensors = "tensors"


@app.command(
    # the escaped stars keep the markdown help rendering from eating the glob stars
    epilog=examples(
        "ckpt download hf://org/model ./model",
        "ckpt download hf://org/model@v1.0 ./emb --filter 'model.embed_tokens.*' --filter 'model.layers.0.*'",
        "ckpt download hf://org/model ./l0 --mode tensors --filter 'model.layers.0.*' --no-extras",
        "ckpt download hf://org/model --cache-only --filter-out 'lm_head.*'",
        "ckpt download hf://org/model ./x --mode tensors --filter '*.q_proj.*' --dry-run --json",
        "ckpt download hf://org/model s3://mirror/org/model",
    )
)
def download(
    src: Annotated[
        str,
        typer.Argument(help="hf://org/repo[@revision][/subfolder].", show_default=False),
    ],
    dest: Annotated[
        str | None,
        typer.Argument(
            help="Folder to create, local or an object-store URL such as s3://bucket/prefix "
            "(refused if it exists, unless --force).",
            show_default=False,
        ),
    ] = None,
    tensors: Annotated[
        list[str] | None,
        typer.Option(
            "--filter", "-k", help="Fetch the tensors whose name matches this glob (repeatable)."
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option("--filter-out", help="Leave out tensors matching this glob (repeatable)."),
    ] = None,
    mode: Annotated[
        Mode,
        typer.Option(
            "--mode",
            help="shards: whole shards through the HF cache; tensors: only the selected "
            "tensors' byte ranges, written as a new safetensors checkpoint.",
        ),
    ] = Mode.shards,
    include_files: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="Fetch the repository files matching this glob besides the weights, as hf "
            "download does (default: config, tokenizer and card files; repeatable).",
        ),
    ] = None,
    exclude_files: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude", help="Leave out repository files matching this glob (repeatable)."
        ),
    ] = None,
    local_dir: Annotated[
        str | None,
        typer.Option(
            "--local-dir",
            metavar="DEST",
            help="DEST, spelled as in hf download (give one or the other).",
        ),
    ] = None,
    no_extras: Annotated[
        bool,
        typer.Option("--no-extras", help="Skip config, tokenizer and model-card files."),
    ] = False,
    cache_only: Annotated[
        bool,
        typer.Option(
            "--cache-only", help="Shards mode: fill the Hugging Face cache only; no DEST."
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", "-n", help="Show the files or ranges and bytes; fetch only metadata."
        ),
    ] = False,
    verify_ranges: Annotated[
        bool,
        typer.Option(
            "--verify-ranges",
            help="Tensors mode: also fetch the source shards whole (or read them from the HF "
            "cache) to check every ranged byte against the Hub's sha256. Without it, ranges are "
            "checked for size and position only (the Hub hashes whole files).",
        ),
    ] = False,
    force: ForceOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Download only the shards, or only the bytes, that hold the tensors you ask for.

    Resolves the revision to a commit once, reads the safetensors index or headers (range
    requests), selects tensors by --filter/--filter-out, and fetches: whole shards through the
    Hugging Face cache (--mode shards, checked against the Hub's sha256), or only the selected
    tensors' byte ranges (--mode tensors). DEST appears atomically. HF_TOKEN, HF_ENDPOINT,
    HF_HOME and HF_HUB_OFFLINE apply as in huggingface_hub.
    """
    from ...errors import UsageError
    from ...ops.download import DownloadRequest, download_with
    from ..render.download import render_download
    from ..render.progress import bar

    request = DownloadRequest(
        tensors=tensors,
        exclude=exclude,
        mode=mode.value,
        extras=not no_extras,
        cache_only=cache_only,
        dry_run=dry_run,
        force=force,
        verify_ranges=verify_ranges,
        include_files=include_files,
        exclude_files=exclude_files,
    )

    def action():  # type: ignore[no-untyped-def]
        target = dest
        if local_dir is not None:
            if dest is not None and dest != local_dir:
                raise UsageError(
                    f"DEST {dest!r} and --local-dir {local_dir!r} name two destinations",
                    fix="Give one of them.",
                )
            target = local_dir
        with bar(enabled=not json_output) as progress:
            return download_with(src, target, request, progress)

    run_command("download", json_output, action, render_download)
