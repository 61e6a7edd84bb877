"""The files a training layout lists without loading them (`OpenedSource.listed_files`: a
Trainer's `training_args.bin`, accelerate's `sampler.bin` and a registered object's
`custom_checkpoint_N.pkl`, pickles no input may be unpickled for). Those that are components
of the save are compared where both sides hold them: the object a pickle builds whole by its
plain attributes, read as data with every class a stand-in (nothing imported or run), any
other by its bytes (size and sha256). The rest (a stray ZeRO partition), and one only one side
holds, are named, with why, and whether their bytes are identical (sizes, then, where they
agree, a streamed sha256), so a user knows whether it changed.

Likewise the metadata two safetensors checkpoints keep about their files: every shard's
header `__metadata__` (`{"format": "pt"}`, a writer's notes) and an index's `metadata` object
(`total_size`, anything else its writer put there). It describes the files, holds no tensor
value, and `convert` / `reshard` rewrite it, so a key that differs is a note, not a
difference. Alias records (`lm_head.weight` -> `transformer.wte.weight`) are left to the
aliases `diff` reports, and `total_size`, the sum of the tensors' bytes, to the tensors'
own comparison.

Memory: one block of one file at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...formats.base import Checkpoint
from ...sources.layouts import OpenedSource
from ...storage.hashing import StoredFile, hash_file, hasher_factory
from ..shared.transfer import metadata_aliases

#: the name the Trainer (and many accelerate scripts) saves its `TrainingArguments` under
TRAINING_ARGS_FILE = "training_args.bin"

#: TrainingArguments fields that say where a run writes, where it came from and who pushes it,
#: not how it trains: a resumed run writes into another `output_dir`, and must still diff
#: IDENTICAL (the restart test). A field whose name starts with `_` is a cache of the machine
#: (`_n_gpu`, `_setup_devices`), and one ending in `token` a secret never shown
RUN_PLACE_ARGS = frozenset({"output_dir", "logging_dir", "run_name", "resume_from_checkpoint"})


@dataclass
class ListedComparison:
    """What `diff` found of the files the layouts list without loading.

    Attributes:
        notes: warnings: a file not compared (a stray file, or one only one side holds), and
            a TrainingArguments field left out that differs (`output_dir`).
        differences: (key, value A, value B, component) of each value that differs: a
            pickled object's plain attribute (`sampler.bin:epoch`), or, for a pickle that does
            not read as one object, the file's size and sha256 prefix (`custom_checkpoint_0.pkl`).
    """

    notes: list[str] = field(default_factory=list)
    differences: list[tuple[str, str | None, str | None, str]] = field(default_factory=list)


def listed_comparison(
    a: tuple[OpenedSource, Checkpoint], b: tuple[OpenedSource, Checkpoint]
) -> ListedComparison:
    """The files either side lists without loading. One that is a component of the save (a
    Trainer's `training_args.bin`, accelerate's `sampler.bin` or a registered object's
    `custom_checkpoint_N.pkl`) held by both sides is compared: an object the pickle builds
    whole by its plain attributes (`read_pickled_object`: nothing imported or run), any other
    by its bytes. Any other listed file (a stray partition), or one only one side holds, is a
    note: not compared, why, and whether the bytes are identical (or which side holds it)."""
    (opened_a, ca), (opened_b, cb) = a, b
    listed_a, listed_b = opened_a.listed_files, opened_b.listed_files
    parts = {rel: comp for o in (opened_a, opened_b) for comp, rel in o.listed_parts.items()}
    found = ListedComparison()
    for name in sorted(listed_a.keys() | listed_b.keys()):
        why = listed_a.get(name) or listed_b[name]
        if name not in listed_b or name not in listed_a:
            held = "A" if name in listed_a else "B"
            found.notes.append(f"{name} not compared: {why}; only {held} holds it")
            continue
        component = parts.get(name)
        if component is None and name.rsplit("/", 1)[-1] == TRAINING_ARGS_FILE:
            component = "training_args"
        if component is not None:
            _compare_values(found, name, component, ca, cb)
            continue
        size_a, size_b = ca.storage.size(name), cb.storage.size(name)
        if size_a != size_b:  # no need to read either (a listed file may be a GB partition)
            bytes_say = f"its bytes differ (A {size_a} bytes, B {size_b} bytes)"
        elif (sha_a := _digest(ca, name, size_a)) == (sha_b := _digest(cb, name, size_b)):
            bytes_say = "its bytes are identical on both sides"
        else:
            bytes_say = (
                f"its bytes differ (both {size_a} bytes; A sha256:{sha_a[:16]}, "
                f"B sha256:{sha_b[:16]})"
            )
        found.notes.append(f"{name} not compared: {why}; {bytes_say}")
    return found


def _compare_values(
    found: ListedComparison, name: str, component: str, ca: Checkpoint, cb: Checkpoint
) -> None:
    """File `name`, component `component`, of both sides, value by value into `found`."""
    values_a, values_b = _listed_values(ca, name), _listed_values(cb, name)
    left_out = []
    for key in sorted(values_a.keys() | values_b.keys()):
        value_a, value_b = values_a.get(key), values_b.get(key)
        if value_a == value_b:
            continue
        field_name = key.partition(":")[2]
        if component == "training_args" and field_name in RUN_PLACE_ARGS:
            left_out.append(f"{field_name} {value_a or '(none)'} → {value_b or '(none)'}")
        else:
            found.differences.append((key, value_a, value_b, component))
    if left_out:
        found.notes.append(
            f"{name}: {'; '.join(left_out)} (where the run writes, not how it trains: "
            "not a difference)"
        )


def _listed_values(checkpoint: Checkpoint, name: str) -> dict[str, str]:
    """`name:attribute` -> its value as JSON text, for the object the pickle `name` builds
    whole (an attribute that is an object of another class by that class); `name` -> its size
    and sha256 prefix for a pickle that reads as no object. A TrainingArguments' secrets
    (`*token`) and machine caches (`_n_gpu`) are left out; `RUN_PLACE_ARGS` are kept for the
    note that names them."""
    from ...formats.torch.pickle_values import read_pickled_object

    pickled = read_pickled_object(checkpoint.storage, name)
    if pickled is None or not (pickled.values or pickled.objects):
        size = checkpoint.storage.size(name)
        return {name: f"{size} bytes, sha256:{_digest(checkpoint, name, size)[:16]}"}
    arguments = pickled.cls.endswith("TrainingArguments")
    values: dict[str, str] = {f"{name}:__class__": json.dumps(pickled.cls)}
    shown: dict[str, Any] = {
        **pickled.values,
        **{k: f"<{cls} object>" for k, cls in pickled.objects.items()},
        **pickled.built,  # an enum member by its value (`SchedulerType('cosine')`: `cosine`)
    }
    for key, value in shown.items():
        if arguments and (key.startswith("_") or key.endswith("token")):
            continue
        values[f"{name}:{key}"] = json.dumps(value, ensure_ascii=False)
    return values


def _digest(checkpoint: Checkpoint, name: str, size: int) -> str:
    """The sha256 (hex) of file `name` of `checkpoint` (`size` bytes), streamed."""
    return hash_file(StoredFile(checkpoint.storage, name, size), hasher_factory("sha256"))


def file_metadata_notes(ca: Checkpoint, cb: Checkpoint) -> list[str]:
    """One line per key of the safetensors file metadata (every shard's header
    `__metadata__`, the index's `metadata`) whose value differs between two safetensors
    checkpoints; none when either side is another format (which keeps no such metadata).

    Two shardings of one file list are compared shard by shard, and a note names the shard;
    two other shardings by the values each side's shards hold, naming the shards of a side
    whose shards disagree."""
    from ...formats.safetensors.format import SafetensorsCheckpoint

    if not (isinstance(ca, SafetensorsCheckpoint) and isinstance(cb, SafetensorsCheckpoint)):
        return []
    suffix = " (A → B; file metadata, no tensor value: not a difference)"
    shards_a, shards_b = (
        [
            (
                h.file,
                {
                    k: v
                    for k, v in h.metadata.items()
                    if k not in metadata_aliases(c.manifest, h.metadata)
                },
            )
            for h in c.headers
        ]
        for c in (ca, cb)
    )
    notes = []
    files_a, files_b = [f for f, _ in shards_a], [f for f, _ in shards_b]
    if files_a == files_b or len(files_a) == len(files_b) == 1:
        for (file, meta_a), (_, meta_b) in zip(shards_a, shards_b, strict=True):
            where = f" of {file}" if len(files_a) > 1 else ""
            for key in sorted(meta_a.keys() | meta_b.keys()):
                value_a, value_b = _shown(meta_a, key), _shown(meta_b, key)
                if value_a != value_b:
                    notes.append(
                        f"safetensors __metadata__{where} {key}: {value_a} → {value_b}{suffix}"
                    )
    else:
        keys = sorted({k for _, meta in [*shards_a, *shards_b] for k in meta})
        for key in keys:
            spread_a, spread_b = _spread(shards_a, key), _spread(shards_b, key)
            if spread_a.keys() != spread_b.keys():
                notes.append(
                    f"safetensors __metadata__ {key}: {_spread_shown(spread_a)} → "
                    f"{_spread_shown(spread_b)}{suffix}"
                )
    # `total_size` is the sum of the tensors' bytes, which the tensors' own comparison
    # covers: a cast or a dequantized twin differs there already, two shardings never do
    index_a, index_b = (
        {k: v for k, v in c.index_metadata.items() if k != "total_size"} for c in (ca, cb)
    )
    for key in sorted(index_a.keys() | index_b.keys()):
        value_a, value_b = _shown(index_a, key), _shown(index_b, key)
        if value_a != value_b:
            notes.append(f"safetensors index metadata {key}: {value_a} → {value_b}{suffix}")
    return notes


def _spread(shards: list[tuple[str, dict[str, str]]], key: str) -> dict[str, list[str]]:
    """The values `key` takes in a side's shards (shown, `(none)` where a shard lacks it),
    each with the shards that hold it."""
    spread: dict[str, list[str]] = {}
    for file, meta in shards:
        spread.setdefault(_shown(meta, key), []).append(file)
    return spread


def _spread_shown(spread: dict[str, list[str]]) -> str:
    """One value when a side's shards agree, else each value with (up to 3 of) its shards."""
    if len(spread) == 1:
        return next(iter(spread))
    return "; ".join(
        f"{value} in {', '.join(files[:3])}{f' (+{len(files) - 3} more)' if len(files) > 3 else ''}"
        for value, files in spread.items()
    )


def _shown(meta: dict[str, Any], key: str) -> str:
    if key not in meta:
        return "(none)"
    return json.dumps(meta[key], ensure_ascii=False, sort_keys=True)[:200]
