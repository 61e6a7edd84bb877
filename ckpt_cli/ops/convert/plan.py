"""What `convert` (and `reshard`) decide before writing anything.

The checks of the target and its options, the checks of DEST (never inside the source; a
file name only where the target writes one file), the files a `--dry-run` reports, and the
ordering that keeps quantized weights with their scales. Everything here reads the target's
facts from its `Format` class (`formats.base`), never its name.
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from ... import dtypes
from ...budgets import MAX_CONFIG_BYTES
from ...dist.command import refuse_remote_split
from ...errors import FormatError, UsageError
from ...formats import get_format, serializations, writable_formats
from ...formats.base import Checkpoint, Format, WriteOptions
from ...models import FileInfo
from ...storage.output import (
    Destination,
    RemoteDest,
    local_destination,
    refuse_dash,
    resolve_destination,
)
from ...storage.uri import canonical_remote, parse_location

if TYPE_CHECKING:
    from ...quant import QuantAnalysis
    from ...sources.layouts import OpenedSource
    from ...sources.layouts.model_folders import Naming
    from ...storage import Storage
    from ..shared.transfer import Item, SkippedEntry, TransferPlan

#: `--dcp-compression` value that asks for no compression
NO_COMPRESSION = "none"
#: how a DCP output stores its tensors unless `--dcp-serialization` says otherwise
DEFAULT_SERIALIZATION = "torch_save"


def check_target(
    to: str, *, serialization: str | None, compression: str | None, world_size: int
) -> type[Format]:
    """The target's `Format` class, after checking the options that depend on it."""
    targets = writable_formats()
    if to not in targets:
        from ...architectures import NAMING_FORMATS

        every = [*targets, *NAMING_FORMATS]
        raise UsageError(f"cannot convert to {to!r}", fix=f"Use --to {' | '.join(every)}.")
    fmt = get_format(to)
    known = [c for name in targets for c in get_format(name).compressions]
    if compression not in (None, NO_COMPRESSION, *known):
        raise UsageError(
            f"unknown DCP compression {compression!r}",
            fix=f"Use --dcp-compression {' or '.join(known)}.",
        )
    if compression not in (None, NO_COMPRESSION) and compression not in fmt.compressions:
        raise UsageError(
            "--dcp-compression applies to --to dcp only",
            fix="Leave --dcp-compression out, or convert with --to dcp.",
        )
    if serialization is not None and serialization not in serializations():
        raise UsageError(
            f"unknown DCP serialization {serialization!r}",
            fix=f"Use --dcp-serialization {' or '.join(serializations())}.",
        )
    if serialization is not None and not fmt.shards_by_rank:
        # it would do nothing: refused as --dcp-compression is
        raise UsageError(
            "--dcp-serialization applies to --to dcp only", fix="Leave --dcp-serialization out."
        )
    check_compressed_serialization(fmt, serialization, compression)
    if world_size < 1:
        raise UsageError(
            "--world-size must be at least 1", fix="Give the number of ranks, e.g. --world-size 8."
        )
    if not fmt.shards_by_rank and world_size != 1:
        raise UsageError(
            "--world-size applies to --to dcp only",
            fix="Leave --world-size out (--max-shard-size splits other formats), or convert "
            "with --to dcp.",
        )
    return fmt


def check_compressed_serialization(
    fmt: type[Format], serialization: str | None, compression: str | None
) -> None:
    """A compression applies to the format's default serialization only (DCP compresses its
    torch_save items): asked with another (given, or a source's that reshard keeps), the two
    options do not go together, refused before anything is planned, dry runs alike."""
    default = fmt.serializations[0] if fmt.serializations else None
    if compression in (None, NO_COMPRESSION) or serialization in (None, default):
        return
    raise UsageError(
        f"--dcp-compression {compression} applies to the {default} serialization only, and the "
        f"output's is {serialization}",
        fix=f"Leave --dcp-compression out, or write --dcp-serialization {default}.",
    )


def check_shard_size(fmt: type[Format], shard_size: int | None) -> None:
    """`--max-shard-size` only for a target cut into shards by size."""
    if shard_size and not fmt.shards_by_size:
        raise UsageError(
            f"--max-shard-size does not apply to {fmt.title} (one file per rank)",
            fix="Use --world-size to choose how many files a DCP output has.",
        )


def guard_paths(src: str, dest: Destination) -> None:
    """Refuse a DEST that is, contains or lies inside the source: sources are never modified."""
    loc = parse_location(src)
    local = local_destination(dest)
    if local is None:
        if loc.kind != "fsspec" or loc.url is None:
            return
        # same store: compare the URLs as paths (an object store has no links to resolve),
        # spelt the one way the store reads them (`s3://bkt//m` is `s3://bkt/m`)
        source, target, sep = canonical_remote(loc.url), canonical_remote(str(dest)), "/"
    elif not loc.is_local or loc.path is None:
        return
    else:
        source, target, sep = os.path.realpath(loc.path), os.path.realpath(local), os.sep
    for a, b in ((source, target), (target, source)):
        if a == b or b.startswith(a.rstrip(sep) + sep):
            raise UsageError(
                "DEST overlaps the source checkpoint",
                path=str(dest),
                fix="Write the output somewhere outside the source.",
            )


def local_dest(dest: str) -> Destination:
    """DEST as a local path or an object-store location (`s3://…`: staged, then uploaded)."""
    refuse_dash(dest)
    loc = parse_location(dest)
    if loc.kind == "local" and loc.path is not None:
        return loc.path
    out = resolve_destination(dest)
    refuse_remote_split(out)
    return out


def _file_format(suffix: str) -> type[Format] | None:
    """The writable format whose single output file ends with `suffix`."""
    for name in writable_formats():
        fmt = get_format(name)
        if suffix and suffix in fmt.single_file_suffixes:
            return fmt
    return None


def output_layout(
    fmt: type[Format], dest: PurePath | RemoteDest, max_shard_size: int | None
) -> tuple[bool, str | None]:
    """(single_file, basename): whether DEST names one output file, and its stem."""
    if dest.suffix and dest.suffix in fmt.single_file_suffixes:
        if max_shard_size:
            index = f" (shards and {fmt.default_basename}{fmt.index_suffix} go in it)"
            raise UsageError(
                f"a sharded output needs a folder, not a {dest.suffix} file name",
                path=str(dest),
                fix=f"Name a folder as DEST{index if fmt.index_suffix else ''}.",
            )
        return True, dest.stem
    named = _file_format(dest.suffix)
    if named is not None:
        # `x.safetensors --to torch` would create a folder named x.safetensors
        usual = fmt.single_file_suffixes[0] if fmt.single_file_suffixes else None
        raise UsageError(
            f"DEST names a {named.title} file, but --to {fmt.name} writes "
            + (f"a {usual} file or a folder" if usual else "a folder"),
            path=str(dest),
            fix=f"Use --to {named.name}, or name DEST {dest.stem}{usual or ''} to write that format.",
        )
    return False, None


def planned_files(
    fmt: type[Format], plan: TransferPlan, dest: Destination, options: WriteOptions
) -> list[FileInfo]:
    """The files a writer of `fmt` would write for `plan` (`--dry-run`), from the plan alone:
    exact sizes where the format knows them before writing (`Format.planned_size`)."""
    from ...formats.safetensors.format import plan_shards

    held = [i.target for i in plan.items]
    if fmt.shards_by_rank:
        # as the writer reports them: the marker holds no entry; each rank file the entries
        # it holds a chunk of, cut as the writer cuts them (`Shard(0)`, a chunk offset
        # recorded once), objects on rank 0
        from ...dist.placement import shard_dim0_boxes

        counts = [0] * options.world_size
        for entry in held:
            if entry.kind != "tensor" or options.world_size == 1:
                counts[0] += 1
                continue
            seen: set[tuple[int, ...]] = set()
            for rank, box in enumerate(shard_dim0_boxes(list(entry.shape), options.world_size)):
                if tuple(box.offsets) not in seen:
                    seen.add(tuple(box.offsets))
                    counts[rank] += 1
        files = [
            FileInfo(path=fmt.rank_file(r), entries=counts[r]) for r in range(options.world_size)
        ]
        return [FileInfo(path=fmt.commit_marker or "", entries=0), *files]
    if options.single_file:
        size = fmt.planned_size(held, options.metadata)
        return [FileInfo(path=PurePath(str(dest)).name, size=size, entries=len(held))]
    files = []
    shards = plan_shards(held, options.max_shard_size)
    stem = options.basename or fmt.default_basename
    if len(shards) > 1:
        # as the writer reports it, first: the index maps the entries and holds none (as
        # DCP's `.metadata` above), so the files' entries add up to the entries written
        files.append(FileInfo(path=f"{stem}{fmt.index_suffix}", entries=0))
    for name, shard in zip(fmt.shard_names(stem, len(shards)), shards, strict=True):
        files.append(
            FileInfo(path=name, size=fmt.planned_size(shard, options.metadata), entries=len(shard))
        )
    return files


def check_one_file_naming(
    convention: Naming | None,
    plan: TransferPlan,
    options: WriteOptions,
    path: str,
    *,
    size_optional: bool = True,
) -> None:
    """Refuse a size cut that the library owning the folder's naming could not load: a PEFT
    adapter in two shards is a folder `PeftModel.from_pretrained`, the Trainer's resume and
    `ckpt merge` all fail on (peft reads one `adapter_model.safetensors`).

    `size_optional`: the command runs without --max-shard-size too (`convert`; `reshard`
    needs it or --world-size), so leaving it out is a fix to offer."""
    from ...formats.safetensors.format import plan_shards

    if convention is None or convention.size_shards or options.max_shard_size is None:
        return
    held = [i.target for i in plan.items]
    shards = plan_shards(held, options.max_shard_size)
    if len(shards) > 1:
        need = sum(e.nbytes for e in held if e.kind == "tensor")
        raise UsageError(
            f"--max-shard-size ({options.max_shard_size:,} bytes) would cut the "
            f"{convention.library} weights ({convention.stem}) into {len(shards)} shards, and "
            f"{convention.library} loads them from one file only",
            path=path,
            fix=f"Leave --max-shard-size out, or give at least {need:,} bytes."
            if size_optional
            else f"Give --max-shard-size at least {need:,} bytes (one file), or copy the "
            "folder as it is.",
        )


def output_warnings(fmt: type[Format], serialization: str) -> list[str]:
    """What to tell a user about an output of this serialization (written by ckpt)."""
    if serialization in fmt.serializations and serialization not in fmt.loader_serializations:
        import torch

        return [
            f"a {fmt.title} with {serialization} serialization cannot be read by torch "
            f"{torch.__version__}'s dcp.load (its loader reads "
            f"{' and '.join(fmt.loader_serializations)} serialization only); ckpt reads it, "
            f"and --dcp-serialization {fmt.loader_serializations[0]} writes one dcp.load restores"
        ]
    return []


def unused_renames(plan: TransferPlan, renames: list[tuple[str, str]]) -> list[str]:
    """A --rename rule that renames no entry has no effect: say so (reshard warns likewise)."""
    strip = plan.stripped
    names = [i.source.name.removeprefix(strip) for i in plan.items]
    names += [s.name.removeprefix(strip) for s in plan.skipped]
    used = set()
    for name in names:
        for n, (old, _new) in enumerate(renames):
            if name.startswith(old):
                used.add(n)
                break  # first match wins
    return [
        f"--rename {old}={new} matches no entry (names are matched after --select; "
        "see `ckpt inspect --list`)"
        for n, (old, new) in enumerate(renames)
        if n not in used
    ]


def keep_quantized(plan: TransferPlan, analysis: QuantAnalysis) -> int:
    """Never cast a quantized weight or its scales; keep each weight's scales right after it.

    Quantized weights are those of a scheme ckpt dequantizes and the tensors of an
    integer-packed one (GPTQ, AWQ: `qweight`, `qzeros`, `scales`, `g_idx`), whose float16
    scales a cast would round. Returns how many tensors a `--dtype` cast would have touched
    but was kept as stored.
    """
    if not (analysis.quantized or analysis.packed):
        return 0
    kept = 0
    for item in plan.items:
        if analysis.kept_as_stored(item.source.name) and item.cast is not None:
            item.cast = None
            item.target = item.target.model_copy(
                update={"dtype": item.source.dtype, "nbytes": item.source.nbytes}
            )
            kept += 1
    # scales follow their weight, so a shard split never separates them
    by_name = {item.source.name: item for item in plan.items}
    ordered: list[Item] = []
    placed: set[str] = set()
    for item in plan.items:
        name = item.source.name
        if name in placed:
            continue
        members = analysis.members_of(name) or [name]
        for member in members:
            if member in by_name and member not in placed:
                ordered.append(by_name[member])
                placed.add(member)
        if name not in placed:
            ordered.append(item)
            placed.add(name)
    plan.items = ordered
    return kept


def dequantized_config(storage: Storage) -> bytes | None:
    """The source's `config.json` without its quantization section (None when it has none).

    A `config.json` that still declares quantization would make loaders expect scales that a
    dequantized output no longer has.
    """
    import json

    from ...quant import without_quantization

    if not storage.exists("config.json"):
        return None
    try:
        config = json.loads(storage.read_all("config.json"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    return (json.dumps(without_quantization(config), indent=2) + "\n").encode()


def dequantized_extras(carried: list[str]) -> tuple[list[str], list[SkippedEntry]]:
    """The companion files a dequantized output carries, and those it leaves out: a file that
    only declares quantization (ModelOpt's `hf_quant_config.json`) would make loaders, and
    `ckpt verify`, take the plain weights for quantized ones."""
    from ...quant import quantization_only_file
    from ..shared.transfer import SkippedEntry

    kept = [rel for rel in carried if not quantization_only_file(rel)]
    left_out = [
        SkippedEntry(
            name=rel,
            kind="file",
            reason="declares the source's quantization, and --dequantize writes plain weights",
        )
        for rel in carried
        if quantization_only_file(rel)
    ]
    return kept, left_out


#: the keys a transformers `config.json` declares its weights' dtype under (4.x, 5.x)
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")


def config_in_dtype(data: bytes, dtype: str) -> bytes | None:
    """`config.json` (its bytes) declaring `dtype`, the one `--dtype` cast the weights to, where
    it declared a floating dtype for them (`torch_dtype`, transformers 5's `dtype`, in
    sub-configs too: `text_config`); None when it declares none or is no JSON object.

    `from_pretrained` loads in the dtype the config names: a bf16 export whose config still
    said float32 came back as a float32 model.
    """
    import json

    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None

    def retype(node: dict[str, Any]) -> bool:
        changed = False
        for key, value in node.items():
            # a hostile config's dtype may be any JSON value (a list is unhashable)
            if (
                key in CONFIG_DTYPE_KEYS
                and isinstance(value, str)
                and value in dtypes.FLOATING
                and value != dtype
            ):
                node[key] = dtype
                changed = True
            elif isinstance(value, dict):
                changed = retype(value) or changed
        return changed

    if not retype(config):
        return None
    return (json.dumps(config, indent=2) + "\n").encode()


def written_dtype(plan: TransferPlan) -> str | None:
    """The one floating dtype of every floating tensor `plan` writes (None: none, or several).

    A training checkpoint's weights may be written in another dtype than the `config.json`
    beside them declares: a DeepSpeed save's `model` is the fp32 master weights rebuilt from
    the ZeRO partitions, its config the bf16 the model trained in. The published config then
    says the dtype written, or `from_pretrained` would load the fp32 weights as bf16."""
    kinds = {
        item.target.dtype
        for item in plan.items
        if item.target.kind == "tensor" and item.target.dtype in dtypes.FLOATING
    }
    return kinds.pop() if len(kinds) == 1 else None


#: a model's `config.json` is a few KB; anything this large is not one


def read_config(spec: str) -> tuple[bytes, str]:
    """The bytes of the `config.json` that `convert --config SPEC` carries into DEST.

    SPEC is a `config.json` file, a model folder holding one, or a Hub location
    (`hf://org/model[@revision][/subfolder]`, or its `.../config.json`). The file is copied
    verbatim; it must be a JSON object. Returns (bytes, where it was read).

    Raises:
        NotFoundError: SPEC is a folder or repository without a `config.json`.
        FormatError: the file is not a JSON object, or too large to be a model config.
    """
    import json

    from ...errors import NotFoundError
    from ...formats import resolve_source

    source = resolve_source(spec)
    storage = source.storage
    rel = source.target if source.target is not None else "config.json"
    where = storage.describe(rel)
    if source.target is None and not storage.exists(rel):
        raise NotFoundError(
            "holds no config.json",
            path=where,
            fix="Point --config at the model's config.json, or at the folder or "
            "hf://org/model it came from.",
        )
    if storage.size(rel) > MAX_CONFIG_BYTES:
        raise FormatError(
            f"is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model config",
            path=where,
            fix="Point --config at the model's config.json.",
        )
    data = storage.read_all(rel)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(
            f"is not valid JSON ({str(exc).splitlines()[0]})",
            path=where,
            fix="Point --config at the model's config.json.",
        ) from None
    if not isinstance(doc, dict):
        raise FormatError(
            "is not a JSON object, so not a model config",
            path=where,
            fix="Point --config at the model's config.json.",
        )
    return data, where


#: the files beside a model's config.json that serving loads with it (tokenizer, generation)
SERVING_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def read_serving_files(spec: str) -> dict[str, bytes]:
    """The tokenizer and generation-config files of the model folder or Hub model `spec`
    names (`convert --to hf --config FOLDER|hf://org/model`), by name; none when `spec` names
    one file. Each is copied verbatim; one larger than a tokenizer can be is refused."""
    from ...formats import resolve_source
    from ...sources.model_files import MAX_EXTRA_BYTES

    source = resolve_source(spec)
    if source.target is not None:
        return {}
    storage = source.storage
    out: dict[str, bytes] = {}
    for name in SERVING_FILES:
        if not storage.exists(name):
            continue
        if storage.size(name) > MAX_EXTRA_BYTES:
            raise FormatError(
                f"is larger than {MAX_EXTRA_BYTES >> 20} MiB: not a tokenizer or generation file",
                path=storage.describe(name),
                fix="Point --config at the model's own folder.",
            )
        out[name] = storage.read_all(name)
    return out


#: training layouts whose weights users load with transformers' from_pretrained
HF_LAYOUTS = ("hf-trainer", "accelerate")


def missing_config_warning(
    opened: OpenedSource, target_name: str, select: str | None, carried: list[str], dest: str
) -> str | None:
    """Why `from_pretrained(DEST)` will fail: an HF training folder's weights exported with
    no `config.json` to carry (an FSDP Trainer checkpoint has none), None otherwise."""
    if opened.training is None or opened.training.layout not in HF_LAYOUTS:
        return None
    # the formats from_pretrained loads are the ones written as Hugging Face shards
    if not get_format(target_name).shards_by_size or "config.json" in carried:
        return None
    if select is None or select.rstrip(".") != "model":
        return None
    if "adapter_config.json" in carried:  # a PEFT adapter: peft loads it with its own config
        return None
    return (
        f"{dest} holds no config.json, so transformers' from_pretrained cannot open it "
        "(AutoModel* needs it; a model class without it builds its default config, not this "
        f"model): the source ({opened.training.layout}) has none. Pass --config "
        "PATH|hf://org/model to carry the model's config.json in."
    )


def model_metadata_note(checkpoint: Checkpoint, target_name: str) -> str | None:
    """That the model metadata the source keeps in its files (a GGUF's key-values: the
    architecture, hyper-parameters, tokenizer) is not written to `target_name` files, which
    keep none; None for a source that keeps none."""
    metadata = checkpoint.model_metadata()
    if not metadata:
        return None
    where = checkpoint.manifest.location
    return (
        f"{where}: its model metadata ({len(metadata)} key-values: the architecture, "
        f"hyper-parameters and tokenizer) is not written: {target_name} files keep none. "
        f"`ckpt inspect {where}` lists them; --to hf writes a Llama, Qwen2, Qwen3, Mixtral or "
        "Qwen3-MoE model's config.json from them, and says how to save its tokenizer."
    )
