"""Chunk layouts: how N ranks cut each tensor, and which stored pieces cover a box.

Pure Python (no torch): the reshard planner, `convert --to dcp --world-size N` and the DCP
adapter use it to decide output chunks and to find the source chunks an output box needs.

Sharding follows DTensor's `Shard(dim)` exactly (the same cut as `torch.chunk`): the chunk
size is `ceil(size / world_size)`; rank r holds `[r*c, min((r+1)*c, size))`. Trailing ranks
may get a smaller box or an empty one; an empty box starts at `size` (DTensor's global offset
for an empty shard), and `dcp.save` records it as a zero-size chunk in that rank's file.

Placement rules (`--shard-dim`, `--plan`) are `GLOB=DIM` or `GLOB=replicate`; the first rule
that matches a tensor wins; tensors no rule matches shard on dim 0; 0-dim tensors are always
replicated. A rule matches a tensor's own name, or, for optimizer state
(`optim.state.<param>.<state>`), its parameter's name, so optimizer state follows its
parameter's placement.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from itertools import pairwise
from pathlib import Path

from ..errors import UsageError

#: what a rule's right-hand side may say instead of a dim
REPLICATE = "replicate"


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: start and extent in each dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements inside the box."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def empty(self) -> bool:
        """True when the box holds no element."""
        return any(s == 0 for s in self.sizes)


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor."""
    return Box(tuple(0 for _ in shape), tuple(shape))


def shard_boxes(shape: Sequence[int], world_size: int, dim: int = 0) -> list[Box]:
    """The box rank r holds when `shape` is placed `Shard(dim)` over `world_size` ranks.

    Exactly DTensor's (and `torch.chunk`'s) cut: chunk size `ceil(size / world_size)`;
    a rank past the end gets an empty box starting at `size`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= dim < len(shape):
        raise ValueError(f"cannot shard a {len(shape)}-dim tensor on dim {dim}")
    size = shape[dim]
    chunk = -(-size // world_size)
    boxes = []
    for rank in range(world_size):
        start = min(rank * chunk, size)
        extent = max(0, min(chunk, size - start))
        if extent == 0:
            start = size
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = start, extent
        boxes.append(Box(tuple(offsets), tuple(sizes)))
    return boxes


def shard_dim0_boxes(shape: Sequence[int], world_size: int) -> list[Box]:
    """`shard_boxes` on dim 0: FSDP's layout (DTensor `Shard(0)`), one box per rank.

    0-dim tensors are not split: one box, the whole (scalar) tensor.
    """
    if not shape:
        return [full_box(shape)]
    return shard_boxes(shape, world_size, 0)


@dataclass(frozen=True)
class Rule:
    """One placement rule: tensors matching `pattern` shard on `dim` (None: replicate)."""

    pattern: str
    dim: int | None

    def __str__(self) -> str:
        return f"{self.pattern}={REPLICATE if self.dim is None else self.dim}"


def parse_rule(text: str, *, origin: str = "--shard-dim") -> Rule:
    """Parse `GLOB=DIM` or `GLOB=replicate` (UsageError naming the rule otherwise)."""
    pattern, sep, value = text.rpartition("=")
    value = value.strip().lower()
    if not sep or not pattern.strip():
        raise UsageError(
            f"{origin} rule {text!r} is not GLOB=DIM or GLOB=replicate",
            fix="Write e.g. --shard-dim '*.wo.weight=1' or --shard-dim '*.norm.*=replicate'.",
        )
    if value in (REPLICATE, "r", "none"):
        return Rule(pattern.strip(), None)
    if not value.isdigit():
        raise UsageError(
            f"{origin} rule {text!r}: {value!r} is neither a dim (0, 1, ...) nor 'replicate'",
            fix="Write e.g. --shard-dim '*.wo.weight=1'.",
        )
    return Rule(pattern.strip(), int(value))


def load_plan(path: Path) -> list[Rule]:
    """Rules from a `--plan` JSON file.

    Accepted shapes: `{"GLOB": DIM | "replicate", ...}` (order kept), `{"rules": {...}}`, or
    a list of `"GLOB=DIM"` strings / `{"pattern": GLOB, "dim": DIM | "replicate"}` objects.
    """
    where = str(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError("no such plan file", path=where, fix="Check the --plan path.") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"is not a readable JSON plan ({exc})", path=where, fix="Fix the JSON."
        ) from None
    if isinstance(doc, dict) and set(doc) == {"rules"}:
        doc = doc["rules"]
    items: list[str] = []
    if isinstance(doc, dict):
        items = [f"{k}={v}" for k, v in doc.items()]
    elif isinstance(doc, list):
        for item in doc:
            if isinstance(item, str):
                items.append(item)
            elif isinstance(item, dict) and "pattern" in item and "dim" in item:
                items.append(f"{item['pattern']}={item['dim']}")
            else:
                raise UsageError(
                    f"plan item {item!r} is neither 'GLOB=DIM' nor {{'pattern', 'dim'}}",
                    path=where,
                    fix='Write each rule as "GLOB=DIM" or {"pattern": GLOB, "dim": DIM}.',
                )
    else:
        raise UsageError(
            "must hold an object {GLOB: DIM | 'replicate'} or a list of rules",
            path=where,
            fix='Write the plan as {"*.wo.weight": 1, "*.norm.*": "replicate"}.',
        )
    return [parse_rule(item, origin=f"{where}:") for item in items]


#: optimizer state names: `<...optim...>.state.<param>.<state>` or `state.<param>.<state>`
def param_name(name: str) -> str | None:
    """The parameter an optimizer-state entry belongs to, or None for other entries.

    `optimizer.state.layers.0.wq.weight.exp_avg` -> `layers.0.wq.weight` (the layout of
    `get_optimizer_state_dict` and torchtitan saves).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part == "state" and (i == 0 or any("optim" in p for p in parts[:i])):
            inner = parts[i + 1 : -1]
            return ".".join(inner) if inner else None
    return None


#: a parameter's FQN -> the names its weight is saved under (`param_weights`)
WeightNames = Callable[[str], list[str]]


def param_weights(names: Iterable[str]) -> WeightNames:
    """For optimizer state: the names a parameter's weight has among `names`, the entries of
    one checkpoint: its FQN itself or under a top-level key (`emb.weight` -> `model.emb.weight`,
    as `inspect` lists it), so a rule written for the weight reaches its state too."""
    held = set(names)
    tops = sorted({n.split(".", 1)[0] for n in held})

    def lookup(param: str) -> list[str]:
        return [w for w in (param, *(f"{t}.{param}" for t in tops)) if w in held]

    return lookup


def rule_for(name: str, rules: Iterable[Rule], weights: WeightNames | None = None) -> Rule | None:
    """The first rule matching `name` or, for optimizer state, its parameter's name or (with
    `weights`, see `param_weights`) the name its parameter's weight is saved under."""
    candidates = [name]
    param = param_name(name)
    if param:
        candidates.append(param)
        if weights is not None:
            candidates += weights(param)
    for rule in rules:
        if any(fnmatchcase(c, rule.pattern) for c in candidates):
            return rule
    return None


def placement_dim(
    name: str, shape: Sequence[int], rules: Iterable[Rule], weights: WeightNames | None = None
) -> int | None:
    """The dim `name` shards on (None: replicated) under `rules`; default dim 0.

    0-dim tensors are always replicated. A rule naming a dim the tensor lacks is a UsageError.
    `weights` (`param_weights`) lets a rule for a weight's saved name reach its optimizer state.
    """
    if not shape:
        return None
    rule = rule_for(name, rules, weights)
    if rule is None:
        return 0
    if rule.dim is not None and rule.dim >= len(shape):
        raise UsageError(
            f"rule {rule} shards {name!r} on dim {rule.dim}, but it has shape {list(shape)}",
            fix="Narrow the glob or pick a dim the tensor has.",
        )
    return rule.dim


@dataclass(frozen=True)
class Piece:
    """Where part of an output box comes from: one stored source chunk.

    Attributes:
        chunk: index of the source chunk in the list given to `overlaps`.
        box: the overlap, in global coordinates.
        src: the overlap relative to the source chunk (offsets inside it, sizes).
        dst: the overlap relative to the output box.
    """

    chunk: int
    box: Box
    src: Box
    dst: Box


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None when they do not meet."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def overlaps(box: Box, chunks: Sequence[Box]) -> list[Piece]:
    """The source pieces covering `box`: every non-empty overlap with a stored chunk.

    Works whatever the source chunking (any world size, uneven, any dim). 0-dim boxes are
    covered by the first 0-dim chunk. Raises ValueError when the chunks leave part of `box`
    uncovered (a checkpoint missing data).
    """
    if not box.offsets:
        for i, chunk in enumerate(chunks):
            if not chunk.offsets:
                return [Piece(i, box, chunk, box)]
        raise ValueError("no stored chunk holds this 0-dim tensor")
    pieces: list[Piece] = []
    covered = 0
    for i, chunk in enumerate(chunks):
        common = intersect(box, chunk)
        if common is None:
            continue
        src = Box(
            tuple(o - c for o, c in zip(common.offsets, chunk.offsets, strict=True)),
            common.sizes,
        )
        dst = Box(
            tuple(o - b for o, b in zip(common.offsets, box.offsets, strict=True)), common.sizes
        )
        pieces.append(Piece(i, common, src, dst))
        covered += common.numel
    if covered < box.numel:
        raise ValueError(
            f"stored chunks cover {covered} of the {box.numel} elements of box "
            f"offsets={list(box.offsets)} sizes={list(box.sizes)}"
        )
    return pieces


#: per-rank training state: a name segment like `rank3`, `rank_3`, `dp_rank_3`, `rank-3`
#: (only parallelism prefixes, so a module named `lora_rank_8` is not mistaken for one)
_RANK_SEGMENT = re.compile(
    r"^(?:(?:dp|tp|pp|cp|ep|fsdp|data|global|local|world)_)?rank[_-]?(\d+)$", re.IGNORECASE
)
#: ... or a numeric segment right under an RNG / data-loader prefix (`rng.3`, `dataloader.3.pos`)
_RANK_PREFIXES = re.compile(
    r"^(?:rng|rngs|rng_state|rng_states|random|random_state|generator|generators|"
    r"dataloader|dataloaders|data_loader|data_loaders|sampler|samplers|loader)$",
    re.IGNORECASE,
)


def rank_of(name: str) -> int | None:
    """The rank a per-rank training-state entry belongs to, or None for shared entries.

    Recognised: any name segment `rank{r}`, `rank_{r}`, `rank-{r}` or `dp_rank_{r}` (also
    `tp_`, `pp_`, `cp_`, `ep_`, `fsdp_`, `data_`, `global_`, `local_`, `world_`; torchtitan's
    `dataloader.dp_rank_{r}`), and a numeric segment directly under an RNG or
    data-loader segment (`rng.{r}`, `dataloader.{r}.position`, `rng_state.{r}`).
    """
    parts = name.split(".")
    for part in parts:
        match = _RANK_SEGMENT.match(part)
        if match:
            return int(match.group(1))
    for prev, part in pairwise(parts):
        if part.isdigit() and _RANK_PREFIXES.match(prev):
            return int(part)
    return None


def with_rank(name: str, rank: int) -> str:
    """`name` (a per-rank entry, see `rank_of`) renamed for `rank`: `rng.rank0` -> `rng.rank2`,
    `dataloader.dp_rank_0.position` -> `dataloader.dp_rank_2.position`, `rng.0` -> `rng.2`.
    The segment `rank_of` reads the rank from is the one changed; other names are returned
    unchanged."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        match = _RANK_SEGMENT.match(part)
        if match:
            start, end = match.span(1)
            parts[i] = f"{part[:start]}{rank}{part[end:]}"
            return ".".join(parts)
    for i in range(1, len(parts)):
        if parts[i].isdigit() and _RANK_PREFIXES.match(parts[i - 1]):
            parts[i] = str(rank)
            return ".".join(parts)
    return name
