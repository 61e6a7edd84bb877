"""`ckpt convert`: the same tensors in another format, streamed in bounded memory."""

from __future__ import annotations

from typing import Annotated

import typer

from ..app import ForceOpt, FormatOpt, JsonOpt, SrcArg, app, examples, run_command


@app.command(
    epilog=examples(
        "ckpt convert step-1000/ hf-model/ --to safetensors --select model --max-shard-size 5GB",
        "ckpt convert model.safetensors model-bf16.safetensors --to safetensors --dtype bf16",
        "ckpt convert hf://org/model hf-dcp/ --to dcp --world-size 8",
        "ckpt convert step-1000/ hf-model/ --to safetensors --max-shard-size 2GB --dry-run",
        "ckpt convert ckpt.pt weights.safetensors --to safetensors --select model --filter-out '*.rotary_emb.*' --rename 'module.='",
        "ckpt convert s3://ckpts/run/step-1000 s3://ckpts/export/model --to safetensors --dtype bf16",
        "ckpt convert DeepSeek-V3-FP8/ deepseek-bf16/ --to safetensors --dequantize --dtype bf16",
        "ckpt convert checkpoint-500/ hf-model/ --to safetensors --select model "
        "--config hf://meta-llama/Llama-3.2-1B   # an FSDP save has no config.json",
        "ckpt convert outputs/checkpoint/step-1000 llama-hf/ --to hf "
        "--config hf://meta-llama/Llama-3.1-8B   # torchtitan -> transformers",
        "ckpt convert llama-hf/ outputs/checkpoint/step-0 --to torchtitan   # and back "
        "(into an existing outputs/checkpoint/)",
        "ckpt convert megatron/iter_0001000 llama-hf/ --to hf   # Megatron-Core GPT -> transformers",
        "ckpt convert llama-hf/ megatron/iter_0000000 --to megatron   # and back "
        "(into an existing megatron/)",
    )
)
def convert(
    src: SrcArg,
    dest: Annotated[
        str,
        typer.Argument(
            help="Output file or folder, local or an object-store URL (s3://bucket/prefix); "
            "a .safetensors/.pt name writes one file.",
            show_default=False,
        ),
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Target format: safetensors, dcp or torch; or a framework naming: hf "
            "(from_pretrained-ready safetensors + config.json), torchtitan (a DCP save "
            "torchtitan loads) or megatron (a torch_dist save Megatron-Core's "
            "dist_checkpointing loads), mapping names and tensors by the model's architecture.",
        ),
    ],
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            help="Split into shards of at most this size (5GB, 500MB, 2GiB) with an index.json.",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Cast floating tensors to bf16, fp16 or fp32 (ints and bools untouched).",
        ),
    ] = None,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--filter", "-k", help="Only entries whose source name matches this glob (repeatable)."
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--filter-out",
            help="Leave out entries whose source name matches this glob (repeatable).",
        ),
    ] = None,
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename", help="Rename a name prefix, OLD=NEW (repeatable; first match wins)."
        ),
    ] = None,
    select: Annotated[
        str | None,
        typer.Option(
            "--select", help="Extract the sub-tree under this prefix (e.g. model), stripping it."
        ),
    ] = None,
    dcp_serialization: Annotated[
        str | None,
        typer.Option(
            "--dcp-serialization",
            help="How a DCP output stores tensors: torch_save (default) or safetensors.",
        ),
    ] = None,
    world_size: Annotated[
        int,
        typer.Option("--world-size", help="Lay a DCP output out for this many ranks (Shard(0))."),
    ] = 1,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            "-n",
            help="Show the files, sizes and entries that would be written; write nothing.",
        ),
    ] = False,
    dequantize: Annotated[
        bool,
        typer.Option(
            "--dequantize",
            help="Write FP8 / MXFP4 / NVFP4 / INT4 / INT8 weights and GGUF blocks dequantized "
            "(to --dtype or "
            "the model's "
            "dtype) and drop their scales and the config's quantization section.",
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
            help="DCP output compression: zstd (DCP's ZStandard extension) or none (default).",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            metavar="PATH|hf://ORG/MODEL",
            help="Write this config.json into a folder DEST (a file, a model folder or a Hub "
            "model): an FSDP Trainer checkpoint has none, and from_pretrained needs it.",
        ),
    ] = None,
    flavor: Annotated[
        str | None,
        typer.Option(
            "--flavor",
            help="With --to hf / torchtitan / megatron: the torchtitan model flavor (8B, "
            "debugmodel...) whose head counts, rotary and norm settings complete what the "
            "weights tell (hf: config.json; megatron: the fused QKV and its args) when SRC has "
            "no config.json (needs torchtitan).",
        ),
    ] = None,
    format: FormatOpt = None,
    force: ForceOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Convert a checkpoint to safetensors, DCP or torch.save, one tensor at a time.

    --to hf / --to torchtitan / --to megatron also change the framework naming: the model's
    family (Llama 3, Qwen3, Qwen3-MoE) is recognised from its tensor names and each tensor is
    renamed and transformed (rotary q/k permutation, experts stacked or split, Megatron's fused
    QKV and gate/up split or fused) on the way; --dry-run lists every rename and transform.

    Peak memory is the largest tensor, not the model. Tensors stored as raw bytes on both sides
    are copied without deserialising. Non-tensor entries (optimizer step, RNG, data-loader
    state) are carried to DCP and torch outputs and reported as skipped for safetensors. The
    output is written beside DEST, checked, and published with one rename (to an object
    store: uploaded under a hidden prefix, then copied into DEST, the index or .metadata last).
    """
    from ...ops.convert.run import convert as run_convert
    from ..render.convert import render_convert
    from ..render.progress import bar

    with bar(enabled=not json_output) as progress:
        run_command(
            "convert",
            json_output,
            lambda: run_convert(
                src,
                dest,
                to,
                format=format,
                max_shard_size=max_shard_size,
                dtype=dtype,
                include=include,
                exclude=exclude,
                renames=rename,
                select=select,
                dcp_serialization=dcp_serialization,
                dcp_compression=dcp_compression,
                world_size=world_size,
                force=force,
                dequantize=dequantize,
                progress=progress,
                dry_run=dry_run,
                extras=not no_extras,
                config=config,
                flavor=flavor,
            ),
            render_convert,
        )
