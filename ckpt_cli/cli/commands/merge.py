"""`ckpt merge`: fold a LoRA (DoRA, IA³, LoHa, LoKr) adapter into its base model, one weight at
a time."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import JsonOpt, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt merge meta-llama-3-8b/ my-lora/ merged/",
        "ckpt merge base/ adapter/ merged/ --force --json",
        "ckpt merge base/ adapter/ merged/ --dry-run      # the files, sizes and dtypes",
    )
)
def merge(
    base: Annotated[
        str,
        typer.Argument(help="The base model folder (safetensors or torch).", show_default=False),
    ],
    adapter: Annotated[
        str,
        typer.Argument(
            help="The PEFT LoRA, DoRA, IA³, LoHa or LoKr adapter folder (adapter_config.json + adapter_model.*).",
            show_default=False,
        ),
    ],
    dest: Annotated[
        str, typer.Argument(help="Output folder for the merged model.", show_default=False)
    ],
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace DEST if it exists (once the new one is complete)."),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            "-n",
            help="Show the files, sizes and entries that would be written; write nothing.",
        ),
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """Merge a LoRA, DoRA, IA³, LoHa or LoKr ADAPTER into BASE and write the merged model to DEST.

    Streams one base weight at a time (peft's merge_and_unload holds the whole model) and
    computes each merged weight as peft does, bit for bit; the output keeps the base's file
    names and carries its config and tokenizer files, so it loads with from_pretrained. Files
    of BASE or ADAPTER not in the output are named, with why.
    """
    from ...ops.merge import MergeRequest, merge_with
    from ..render.merge import render_merge

    run_command(
        "merge",
        json_output,
        lambda: merge_with(base, adapter, dest, MergeRequest(force=force, dry_run=dry_run)),
        render_merge,
    )
