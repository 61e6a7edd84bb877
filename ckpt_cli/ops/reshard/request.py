"""`ReshardRequest`: the options of one `reshard` call, typed and frozen."""

from __future__ import annotations

from pathlib import Path

from ...models import Request


class ReshardRequest(Request):
    """Every option of `reshard` but the locations, typed and frozen: validated once by
    `reshard_with`, and what each component of a multi-folder model is resharded with
    (`model_copy(update=...)`), so no option is re-listed by hand and none is dropped. Its
    fields are `run_reshard`'s keyword parameters (a test holds the two, and the command's
    options, to each other); `progress` is a sink, not an option, and travels beside it.

    Attributes:
        world_size: DCP: rewrite as this many ranks would have saved it.
        max_shard_size: safetensors / torch.save: shards of at most this size (`2GB`, bytes).
        shard_dim: placement rules `GLOB=DIM` / `GLOB=replicate` (first match wins).
        plan: a JSON file of placement rules, applied after `shard_dim`.
        rank_state: per-rank state when the world size changes: keep, drop or replicate.
        dcp_serialization / dcp_compression: the DCP output's encoding (default: the source's).
        format: read SRC as this format instead of detecting it.
        force: replace an existing DEST once the new output is complete.
        dry_run: plan only: read metadata, write nothing, report what would be written.
        extras: carry the source folder's non-weight files (config, tokenizer...).
    """

    world_size: int | None = None
    max_shard_size: str | int | None = None
    shard_dim: list[str] | None = None
    plan: Path | None = None
    rank_state: str | None = None
    dcp_serialization: str | None = None
    dcp_compression: str | None = None
    format: str | None = None
    force: bool = False
    dry_run: bool = False
    extras: bool = True
