"""The Hugging Face weight-map index (`*.safetensors.index.json`, `*.bin.index.json`).

One index maps every tensor name to the shard that holds it, plus `metadata.total_size`.
The safetensors and torch formats share this module: reading and finding an index, and the one
check of an index against its shards, so both report the same defect with the same code and
blame the same file (the index, for what the index gets wrong; the shard, for what a shard holds
that the index does not list).
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptError, FormatError, UnsafeInputError
from ..findings import Findings
from ..storage import Storage, safe_relpath
from .base import Source
from .names import SAFETENSORS_INDEX_SUFFIX, TORCH_INDEX_SUFFIX

INDEX_SUFFIX = SAFETENSORS_INDEX_SUFFIX
#: suffix of a sharded torch checkpoint's index (`pytorch_model.bin.index.json`)
BIN_INDEX_SUFFIX = TORCH_INDEX_SUFFIX
#: a weight variant's index as diffusers names it (`….safetensors.index.fp16.json`)
VARIANT_INDEX = re.compile(r"[^/]+\.safetensors\.index\.[\w-]+\.json")


@dataclass
class ShardContents:
    """What one readable shard holds, as its format's reader found it.

    Attributes:
        entries: entry name -> tensor bytes (0 for a non-tensor object), in file order.
        rejected: names of entries that failed validation (reported already: the index
            check does not report them again).
    """

    entries: dict[str, int]
    rejected: set[str] = field(default_factory=set)


#: the largest index read (1M tensor names take ~80 MB; the Hub's largest models ~10 MB)...
MAX_INDEX_BYTES = 128 << 20
#: ... and the most `[` and `{` it may hold (an index is one object of strings, its metadata
#: a few more): a JSON of nested empty lists parses to ~20 bytes of objects per byte
MAX_INDEX_CONTAINERS = 100_000


def read_index(storage: Storage, rel: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Read a weight-map index, within budgets (`MAX_INDEX_BYTES`, `MAX_INDEX_CONTAINERS`)
    checked before it is parsed.

    Returns (tensor name -> shard path relative to the root, each checked by `safe_relpath`;
    the index's `metadata`).
    """
    where = storage.describe(rel)
    index = load_index_json(storage, rel)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    # JSON object keys are strings; the values are checked at C speed (tens of thousands)
    if not isinstance(weight_map, dict) or set(map(type, weight_map.values())) - {str}:
        raise FormatError(
            "has no valid weight_map (tensor name -> shard file)",
            path=where,
            fix="Write or fetch the index again (save_pretrained writes it with the shards).",
        )
    base = posixpath_dir(rel)
    # thousands of tensors share a few shard names: check each name once
    resolved = {shard: _join(base, _shard_name(shard, where)) for shard in set(weight_map.values())}
    # an index at the root naming its shards plainly (the common case) maps them as written
    plain = all(shard == path for shard, path in resolved.items())
    safe = weight_map if plain else {name: resolved[shard] for name, shard in weight_map.items()}
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        # transformers' from_pretrained adds the key list to it: a TypeError there
        raise FormatError(
            f"has metadata {_shown(metadata)}, which is not a JSON object "
            "(transformers' from_pretrained fails on it)",
            path=where,
            fix='Write the index again (save_pretrained writes {"total_size": BYTES} there).',
        )
    return safe, metadata


def _shard_name(shard: str, where: str) -> str:
    """`safe_relpath` of a shard the index names, which must name a file, not the folder."""
    name = safe_relpath(shard, source=where)
    if name != "." and shard.endswith(("/", "/.")):
        # loaders join the name to the folder as written (`os.path.join`), and a file opened
        # as a folder fails (ENOTDIR), where the normalised name reads the shard
        raise FormatError(
            f"names the shard {shard!r}, a folder's name (it ends in {shard[-1]!r}): "
            "from_pretrained and safe_open cannot open a file by it",
            path=where,
            fix="Write the index again (save_pretrained writes it with the shards), or drop the "
            "trailing characters from the shard names in its weight_map.",
        )
    if name == ".":
        raise FormatError(
            f"names the checkpoint folder itself ({shard!r}) as a shard file",
            path=where,
            fix="Write or fetch the index again (save_pretrained writes it with the shards).",
        )
    return name


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_index_json(storage: Storage, rel: str) -> Any:
    """The parsed JSON of a weight-map index, within budgets (`MAX_INDEX_BYTES`,
    `MAX_INDEX_CONTAINERS`) checked before it is parsed; FormatError naming it past them, or
    when it is no JSON."""
    where = storage.describe(rel)
    size = storage.size(rel)
    if size > MAX_INDEX_BYTES:
        raise FormatError(
            f"is {size:,} bytes, more than the {MAX_INDEX_BYTES:,} an index may take; ckpt "
            "refuses it (a hostile or corrupt index)",
            path=where,
            fix="Write or fetch the index again.",
        )
    raw = storage.read_all(rel)
    if raw.count(b"[") + raw.count(b"{") > MAX_INDEX_CONTAINERS:
        raise FormatError(
            f"holds more than {MAX_INDEX_CONTAINERS:,} JSON arrays and objects, which no "
            "weight map needs; ckpt refuses it (a hostile or corrupt index)",
            path=where,
            fix="Write or fetch the index again.",
        )
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # too deep: hostile
        raise FormatError(
            f"is not valid JSON ({exc})", path=where, fix="Write or fetch the index again."
        ) from None
    return index


def posixpath_dir(rel: str) -> str:
    """The folder part of a relative POSIX path ('' for a top-level file)."""
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def _join(base: str, rel: str) -> str:
    return f"{base}/{rel}" if base else rel


def find_index(source: Source, suffix: str = INDEX_SUFFIX, kind: str = "safetensors") -> str | None:
    """The weight-map index to use: the target if it is one, else the single one in the root.

    `suffix=BIN_INDEX_SUFFIX, kind="torch"` finds a torch index, whose shape is the same.
    """
    if source.target is not None:
        # the target may sit in a subfolder (a pipeline's `unet/…safetensors.index.fp16.json`)
        if suffix == INDEX_SUFFIX and VARIANT_INDEX.fullmatch(source.target.rsplit("/", 1)[-1]):
            return source.target
        return source.target if source.target.endswith(suffix) else None
    indexes = sorted(n for n in source.top_level() if n.endswith(suffix))
    if not indexes and suffix == INDEX_SUFFIX:
        # diffusers spells a variant's index `diffusion_pytorch_model.safetensors.index.fp16.json`
        indexes = sorted(n for n in source.top_level() if VARIANT_INDEX.fullmatch(n))
    if len(indexes) > 1:
        raise FormatError(
            f"holds several {kind} indexes ({', '.join(indexes)})",
            path=source.location.raw,
            fix=f"Point at the index you mean, e.g. {source.location.raw.rstrip('/')}/{indexes[0]}.",
        )
    return indexes[0] if indexes else None


def stem_of_index(name: str) -> tuple[str, str]:
    """(shard stem, shard suffix) an index's name implies: (`model`, `.safetensors`) for
    `model.safetensors.index.json`, (`pytorch_model`, `.bin`) for `pytorch_model.bin.index.json`."""
    base = name.rsplit("/", 1)[-1]
    if VARIANT_INDEX.fullmatch(base) and not base.endswith(INDEX_SUFFIX):
        # `diffusion_pytorch_model.safetensors.index.fp16.json` indexes `…model.fp16-0000k-of-…`
        stem, _, rest = base.partition(".safetensors.index.")
        return f"{stem}.{rest.removesuffix('.json')}", ".safetensors"
    stem, _, suffix = base.removesuffix(".index.json").rpartition(".")
    return stem, f".{suffix}"


def same_save(index_rel: str, named: set[str]) -> Callable[[str], bool]:
    """Whether a shard name follows the naming of the index's own shards (`stem-i-of-N`)."""
    stem, suffix = stem_of_index(index_rel)
    pattern = re.compile(rf"^{re.escape(stem)}-\d{{5}}-of-(\d{{5}}){re.escape(suffix)}$")
    counts = {m.group(1) for m in map(pattern.match, named) if m}

    def belongs(name: str) -> bool:
        match = pattern.match(name)
        return bool(match and match.group(1) in counts)

    return belongs


def shards_to_check(
    index_rel: str, weight_map: dict[str, str], listing: Collection[str]
) -> tuple[list[str], list[str]]:
    """(shards to check, strays) of an index: the shards it names plus the top-level files of
    the same save it does not name (so tensors in them show up as "not in the index"); strays
    are the other top-level files with the shards' suffix (a leftover of another save?)."""
    named = set(weight_map.values())
    _, suffix = stem_of_index(index_rel)
    siblings = same_save(index_rel, named)
    unnamed = [n for n in listing if "/" not in n and n.endswith(suffix) and n not in named]
    shards = sorted(named | {n for n in unnamed if siblings(n)})
    return shards, [n for n in unnamed if not siblings(n)]


def some(names: list[str], limit: int = 3) -> str:
    """The first `limit` names, and how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def tensors_by_shard(weight_map: dict[str, str]) -> dict[str, list[str]]:
    """shard -> the tensor names the index maps to it, sorted: built once per index (an index
    of 300,000 shards, each missing, made verify scan the whole map once per shard)."""
    found: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        found.setdefault(shard, []).append(name)
    for names in found.values():
        names.sort()
    return found


def report_missing_shard(
    findings: Findings, storage: Storage, index_rel: str, names: list[str], shard: str
) -> None:
    """A shard the index names is missing (blamed on the shard: that is the file to fetch);
    `names`: the tensors the index maps to it (`tensors_by_shard`). One that is there but
    through a link out of the checkpoint (a linked folder is not listed) is reported as such:
    it is refused, not missing."""
    try:
        storage.local_path(shard)
    except UnsafeInputError as error:
        findings.error(error)
        return
    findings.add(
        "missing_shard",
        f"is missing; the index {index_rel} maps {len(names)} tensors to it ({some(names)})",
        file=storage.describe(shard),
        fix="Fetch or copy the missing shard again.",
    )


#: a Hugging Face shard name: `model-00002-of-00003.safetensors` (stem, number, count, suffix)
_NUMBERED = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})(?P<suffix>\.[a-z]+)$")


def missing_numbered_shards(names: list[str], limit: int) -> tuple[list[str], int]:
    """The shards a numbered set lacks, among `names` of a folder with no index: with
    `model-00002-of-00003.safetensors` there, `model-00001-of-00003.safetensors` and
    `model-00003-of-00003.safetensors` are part of the same save. A filtered download leaves
    such a set (in the HF cache: shards, no index), which reads as a smaller checkpoint.

    Returns the first `limit` of them in name order, and how many there are in all: each
    name `-00001-of-99999` says 99,998 more, so only those listed are built."""
    sets: dict[tuple[str, int, str], set[int]] = {}
    for name in names:
        match = _NUMBERED.match(name)
        if match is not None and 0 < int(match["i"]) <= int(match["n"]):
            key = (match["stem"], int(match["n"]), match["suffix"])
            sets.setdefault(key, set()).add(int(match["i"]))
    # within a set the zero-padded names sort as their numbers: merge the sets' runs in order
    runs = [_lacking(key, present) for key, present in sets.items()]
    listed = list(itertools.islice(heapq.merge(*runs), limit))
    return listed, sum(count - len(present) for (_, count, _), present in sets.items())


def _lacking(key: tuple[str, int, str], present: set[int]) -> Iterator[str]:
    """The names of a numbered set's shards not `present`, in order."""
    stem, count, suffix = key
    for i in range(1, count + 1):
        if i not in present:
            yield f"{stem}-{i:05d}-of-{count:05d}{suffix}"


def report_bad_index(findings: Findings, error: CkptError) -> None:
    """An index that cannot be read: `bad_index`, or `unsafe_input` for a path out of the root."""
    findings.error(error, None if error.code == "unsafe_input" else "bad_index")


def check_duplicates(
    findings: Findings, storage: Storage, shards: dict[str, ShardContents]
) -> dict[str, list[str]]:
    """Tensors stored in more than one shard (blamed on the second). Returns name -> shards."""
    found: dict[str, list[str]] = {}
    for shard, contents in shards.items():
        for name in contents.entries:
            found.setdefault(name, []).append(shard)
    for name, where in found.items():
        if len(where) > 1:
            findings.add(
                "duplicate_tensor",
                f"tensor {name!r} is stored in {len(where)} shards ({', '.join(where)})",
                file=storage.describe(where[1]),
                tensor=name,
                fix="The checkpoint mixes two saves; write it again.",
            )
    return found


def check_index(
    findings: Findings,
    storage: Storage,
    index_rel: str,
    weight_map: dict[str, str],
    index_meta: dict[str, Any],
    shards: dict[str, ShardContents],
) -> None:
    """The index against the shards it names (and any others given): every entry where it
    says, every tensor indexed, `total_size` the tensors' bytes. Missing shards are reported
    by the caller (`report_missing_shard`) as it meets them."""
    # the common case, at C speed: every tensor stored once, in the shard the index names,
    # and every stored tensor indexed; then only the total size is left to check
    stored: dict[str, str] = {}
    for shard, held in shards.items():
        stored.update(dict.fromkeys(held.entries, shard))
    if len(stored) == sum(len(c.entries) for c in shards.values()) and stored == weight_map:
        _check_total_size(findings, storage.describe(index_rel), weight_map, index_meta, shards)
        return
    found = check_duplicates(findings, storage, shards)
    index_where = storage.describe(index_rel)
    for name, shard in weight_map.items():
        contents = shards.get(shard)
        if contents is None or name in contents.entries or name in contents.rejected:
            continue  # a missing or unreadable shard, or a bad entry, is reported already
        elsewhere = found.get(name)
        if elsewhere:
            findings.add(
                "wrong_shard",
                f"maps tensor {name!r} to {shard}, but it is stored in {', '.join(elsewhere)}",
                file=index_where,
                tensor=name,
                fix="The index does not belong to these shards; write the checkpoint again.",
            )
        else:
            findings.add(
                "missing_tensor",
                f"maps tensor {name!r} to {shard}, which does not hold it (no shard does)",
                file=index_where,
                tensor=name,
                fix="The shard is from another save or incomplete; write the checkpoint again.",
            )
    for name, holders in found.items():
        if name not in weight_map:
            findings.add(
                "not_in_index",
                f"holds tensor {name!r}, which the index {index_rel} does not list",
                file=storage.describe(holders[0]),
                tensor=name,
                fix="Loaders that follow the index will not load it; write the checkpoint again.",
            )
    _check_total_size(findings, index_where, weight_map, index_meta, shards)


def declared_total_size(index_meta: dict[str, Any]) -> int | None:
    """The index's `metadata.total_size` when it is a byte count (a non-negative integer), else
    None: a string or a list there is no size to report (`check_index` flags it)."""
    total = index_meta.get("total_size")
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        return None
    return total


def _check_total_size(
    findings: Findings,
    index_where: str,
    weight_map: dict[str, str],
    index_meta: dict[str, Any],
    shards: dict[str, ShardContents],
) -> None:
    total = index_meta.get("total_size")
    if total is None:
        return
    if declared_total_size(index_meta) is None:
        findings.add(
            "bad_index",
            f"has metadata.total_size {total!r}, which is not a byte count",
            file=index_where,
            fix="Write the index again (save_pretrained writes the shards' byte count there).",
        )
        return
    complete = all(s in shards and not shards[s].rejected for s in set(weight_map.values()))
    actual = sum(sum(contents.entries.values()) for contents in shards.values())
    if complete and total != actual:
        # huggingface_hub/transformers sum the tensors' *storage* sizes, which exceed the tensor
        # bytes when a saved tensor was a view; loaders ignore the field, so this only warns
        findings.add(
            "total_size",
            f"says metadata.total_size is {total} bytes but the shards hold {actual} bytes of tensors",
            file=index_where,
            severity="warning",
            fix="Harmless for loading; rewrite the index if tools rely on it.",
        )
