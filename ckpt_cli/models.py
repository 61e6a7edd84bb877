"""Pydantic models shared by formats, operations and rendering.

`Manifest` is the centre of the adapter layer: everything a checkpoint holds, read from
metadata alone, with where each entry's bytes live.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final, Literal, Self, SupportsIndex, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, PrivateAttr, model_validator

from .dtypes import FLOATING, numel
from .problems import CODES, Severity
from .problems import check as check_code


class _SharedFieldsSet(set[str]):
    """A `__pydantic_fields_set__` shared by every record with the same set fields, read-only.

    pydantic gives each instance its own set of the field names it was given; for a 10-field
    `Entry` that set (728 bytes) costs more than the record's values, and a checkpoint of
    20,000 entries holds tens of thousands of records (#20). pydantic-core needs a `set`
    (a frozenset is refused), so this is a set whose in-place changes raise; a copy (what
    `model_copy` takes before adding its `update` keys) is a plain, private set again.
    """

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a shared fields set is read-only; copy it first")

    add = update = discard = remove = pop = clear = _read_only  # type: ignore[assignment]
    difference_update = intersection_update = symmetric_difference_update = _read_only
    __ior__ = __iand__ = __isub__ = __ixor__ = _read_only  # type: ignore[assignment]

    def __copy__(self) -> set[str]:
        return set(self)

    def __deepcopy__(self, memo: object) -> set[str]:
        return set(self)

    def __reduce__(self) -> tuple[type[set[str]], tuple[list[str]]]:
        return (set, (list(self),))


class Record(BaseModel):
    """Base of every ckpt model: its validation schema is built on first use, not at import.

    pydantic builds a model's schema and validator when the class is created by default; ckpt
    defines some 80 models and a command uses a few of them, so deferring the build takes
    about a third of the import time of a metadata command (`inspect`, `verify`) away.
    Validation, dumps and JSON schemas are the same; only when they are first built differs.
    """

    model_config = ConfigDict(defer_build=True)


class Request(Record):
    """Base of every operation's options (`ConvertRequest`, `VerifyRequest`, ...): typed, built
    once by the command or by the operation's function from its keywords, and passed down whole.

    Frozen, so a request cannot change on its way down; a field it does not declare is refused
    (pydantic's `extra_forbidden`), so a misspelt option (`ConvertRequest(dytpe="bf16")`) is an
    error rather than a silent default, as it is for the operation's function.
    """

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")


#: one shared set per distinct combination of set fields (at most 2**fields, a handful in use)
_FIELDS_SETS: dict[frozenset[str], _SharedFieldsSet] = {}


def _shared_fields(fields: set[str]) -> _SharedFieldsSet:
    """The shared read-only copy of `fields`."""
    if type(fields) is _SharedFieldsSet:
        return fields
    key = frozenset(fields)
    shared = _FIELDS_SETS.get(key)
    if shared is None:
        shared = _FIELDS_SETS[key] = _SharedFieldsSet(key)
    return shared


_Record = TypeVar("_Record", bound="_LeanRecord")


class _LeanRecord(Record):
    """Base of the per-entry records (`Entry`): their fields sets are shared.

    Validation, `model_construct` and `model_copy` all end with the shared set, so a record
    costs its values only; dumps, equality and copies are those of any pydantic model.
    """

    def model_post_init(self, context: Any, /) -> None:
        """Swap the fields set pydantic just built for the shared one."""
        object.__setattr__(
            self, "__pydantic_fields_set__", _shared_fields(self.__pydantic_fields_set__)
        )

    def model_copy(
        self: _Record, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> _Record:
        """`BaseModel.model_copy`, ending with the shared fields set."""
        copied = super().model_copy(update=update, deep=deep)
        object.__setattr__(
            copied, "__pydantic_fields_set__", _shared_fields(copied.__pydantic_fields_set__)
        )
        return copied


#: One tensor as checks over a whole checkpoint's names, dtypes and shapes read it
#: (`quant.analyse_tensors`): (dtype, shape, file). A plain tuple, made from an `Entry` or
#: straight from a parsed header (`Format.checked_tensors`): a checkpoint has 100,000 of
#: them, and a record class costs ten times a tuple to build.
TensorFacts = tuple[str | None, list[int], str | None]
#: one step of a key path inside a saved object: (kind of the container holding the key, the
#: key); kinds are `dict`, `odict`, `list` and `tuple`
KeyStep = tuple[str, str | int]
#: where a `TensorFacts` holds each fact
DTYPE: Final = 0
SHAPE: Final = 1
FILE: Final = 2


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor (a DCP chunk): its place in the global tensor and its bytes.

    Attributes:
        offsets: start of the chunk in each dimension of the global tensor.
        sizes: extent of the chunk in each dimension.
        file: file holding the chunk, relative to the checkpoint root.
        byte_offset: where the chunk's stored bytes start in `file`.
        byte_length: how many stored bytes it spans (a torch.save blob or raw bytes).
        raw: True when the stored bytes are the raw C-order little-endian data.
    """

    # A slotted dataclass, not a pydantic model (#30): a DCP checkpoint of a large run holds a
    # million chunks, and a model's per-instance `__dict__` doubled each one's cost (~570 bytes
    # with its lists and ints, ~300 now). pydantic still validates it wherever an `Entry` is
    # validated (JSON in, `Entry(chunks=[{...}])`), and its JSON schema and dumps are the same.
    # Built directly, it is not validated: the callers are format parsers and planners that
    # hand over checked non-negative ints (and lists no one else changes; they are not copied).

    offsets: list[int]
    sizes: list[int]
    file: str
    byte_offset: int
    byte_length: int
    raw: bool = False


class Entry(_LeanRecord):
    """One named item of a checkpoint: a tensor or a non-tensor object.

    Attributes:
        name: the flattened dotted name (`model.layers.0.attn.wq.weight`).
        kind: `tensor` or `object` (bytes, ints, dicts, RNG state...).
        dtype: canonical dtype token (tensors only; an object that is a tensor stored in a
            form ckpt does not decode, a GGUF quantized one, has its format's type: `Q8_0`).
        shape: global shape (tensors only, and such stored tensors' logical shape; `[]` for
            0-dim).
        nbytes: size of the data in bytes (for objects: serialized size when known).
        file: the file holding the data (the first one for chunked tensors).
        offset: absolute byte offset of raw data in `file` (raw formats only).
        chunks: stored pieces, for formats that split tensors (DCP).
        py_type: Python type name of an object entry (`int`, `bytes`, `dict`...).
        value: the value of a small scalar object when metadata holds it.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    kind: Literal["tensor", "object"] = "tensor"
    dtype: str | None = None
    shape: list[int] = Field(default_factory=list)
    nbytes: int = 0
    file: str | None = None
    offset: int | None = None
    chunks: list[Chunk] | None = None
    py_type: str | None = None
    value: Any = None

    @property
    def numel(self) -> int:
        """Number of elements (tensors)."""
        return numel(self.shape)

    @property
    def is_raw(self) -> bool:
        """True when the tensor is stored as one contiguous raw byte range (`file`, `offset`)."""
        return self.kind == "tensor" and self.offset is not None and self.file is not None

    def saved_keys(self) -> tuple[KeyStep, ...]:
        """The keys from the saved object's root to this leaf, each with the kind of container
        holding it (`dict`, `list`...), for formats that keep them (torch.save, a nested DCP:
        `KeyedEntry`); `()` when only the dotted `name` is known (its first part is then the
        top-level key)."""
        return ()

    def keys_as_named(self) -> tuple[KeyStep, ...] | None:
        """The saved key path that spells this entry's current name: the whole path while the
        name is its dotted join, the tail left when `--select` stripped a leading part
        (`optimizer.` of `optimizer.state.0.step`), None when the name was changed otherwise
        (`--rename`, a naming) or no path is known. Writers nest an entry by it."""
        keys = self.saved_keys()
        joined = ".".join(str(key) for _, key in keys)
        start = 0
        while joined:
            if self.name == joined or self.name.startswith(joined + "~"):
                return keys[start:]  # `~1`: a name made distinct by its reader
            joined = joined[len(str(keys[start][1])) + 1 :]
            start += 1
        return None

    def keys_renamed(self, name: str, new_name: str) -> tuple[KeyStep, ...] | None:
        """The key path to write this entry at under `new_name`, a prefix rename (`--rename`)
        of `name` (its name after `--select`): the saved path's tail that spells the part
        both names share is kept, and the renamed head takes the place of the keys it replaced
        (`model` -> `net` in (`model`, `0.weight`)), so the nesting survives. None when no path
        is known or the new head cannot stand where the old keys stood."""
        keys = (
            self if name == self.name else self.model_copy(update={"name": name})
        ).keys_as_named()
        if not keys:
            return None
        # the longest tail of the path whose dotted join ends the new name at a dot
        cut = len(keys)
        for start in range(len(keys) - 1, -1, -1):
            joined = ".".join(str(key) for _, key in keys[start:])
            if new_name == joined:
                return keys  # only a select tail differs: the path spells the new name
            if not new_name.endswith("." + joined):
                break
            cut = start
        tail = keys[cut:]
        head = keys[:cut]
        prefix = new_name[: len(new_name) - len(".".join(str(k) for _, k in tail)) - 1]
        if not tail:
            prefix = new_name
        parts = prefix.split(".")
        if len(head) == 1:
            return ((head[0][0], prefix), *tail)
        if len(head) == len(parts) and all(
            isinstance(k, str) or p.isdigit() for (_, k), p in zip(head, parts, strict=True)
        ):
            renamed = tuple(
                (kind, part if isinstance(key, str) else int(part))
                for (kind, key), part in zip(head, parts, strict=True)
            )
            return (*renamed, *tail)
        if not head and tail:
            return (("dict", prefix), *tail) if keys[0][0] == "dict" else None
        return None

    def top_key(self) -> str:
        """The saved object's top-level key this entry sits under (`model`, `optimizer`...): the
        real key when the format keeps key paths (a key may hold dots), else the name's first
        dotted part."""
        keys = self.saved_keys()
        return str(keys[0][1]) if keys else self.name.split(".", 1)[0]

    @classmethod
    def trusted(
        cls,
        name: str,
        dtype: str,
        shape: list[int],
        nbytes: int,
        file: str,
        offset: int,
    ) -> Entry:
        """A raw tensor entry from values a format parser has already checked, unvalidated.

        The metadata paths build one entry per tensor (100,000 for a large checkpoint); even
        `model_construct` costs ~18 µs each there, this ~5 µs. The result is an ordinary
        `Entry` (equal to a validated one, dumps and copies the same).
        """
        return _unvalidated(
            cls,
            {
                "name": name,
                "kind": "tensor",
                "dtype": dtype,
                "shape": shape,
                "nbytes": nbytes,
                "file": file,
                "offset": offset,
                "chunks": None,
                "py_type": None,
                "value": None,
            },
        )

    @classmethod
    def checked(
        cls,
        *,
        name: str,
        kind: Literal["tensor", "object"],
        dtype: str | None,
        shape: list[int],
        nbytes: int,
        file: str | None,
        offset: int | None,
        chunks: list[Chunk] | None,
        py_type: str | None,
        value: Any,
    ) -> Entry:
        """Any entry, every field given, from values a format parser has already checked,
        unvalidated, at `trusted`'s cost (a DCP training checkpoint's `.metadata` holds one per
        model and optimizer tensor; `model_construct` costs ~20 µs each)."""
        return _unvalidated(
            cls,
            {
                "name": name,
                "kind": kind,
                "dtype": dtype,
                "shape": shape,
                "nbytes": nbytes,
                "file": file,
                "offset": offset,
                "chunks": chunks,
                "py_type": py_type,
                "value": value,
            },
        )

    @classmethod
    def named(cls, name: str, file: str) -> Entry:
        """A tensor known by its name and file only (an index's `weight_map`: no dtype, shape
        or offset), unvalidated, at `trusted`'s cost: planning from the index of a
        DeepSeek-V3-sized model builds 90,000 of them."""
        entry = cls.trusted(name, "", [], 0, file, 0)
        entry.__dict__.update(dtype=None, offset=None)
        return entry


class KeyedEntry(Entry):
    """An entry that knows its real key path inside the saved object (torch.save files, a DCP
    whose planner data nests, the components of a training folder).

    Attributes:
        key_path: the keys from the saved object's root to this leaf, each with the kind of
            container holding it (`dict`, `odict`, `list`, `tuple`). Writers rebuild the
            nesting from it (`keys_as_named`).
    """

    key_path: tuple[KeyStep, ...] = ()

    def saved_keys(self) -> tuple[KeyStep, ...]:
        """The real key path (see `Entry.saved_keys`)."""
        return self.key_path

    @classmethod
    def placed(cls, entry: Entry, key_path: tuple[KeyStep, ...]) -> KeyedEntry:
        """`entry` with its key path, unvalidated, at `Entry.checked`'s cost: opening a DCP
        training checkpoint places every model and optimizer entry (`model_construct` costs
        ~20 µs each)."""
        values = dict(entry.__dict__)
        values["key_path"] = key_path
        placed = _unvalidated(cls, values)
        assert isinstance(placed, KeyedEntry)
        return placed

    @classmethod
    def of(cls, values: dict[str, Any], key_path: tuple[KeyStep, ...]) -> KeyedEntry:
        """An entry of `values` (every field of `Entry`, checked by the reader that built
        them) at `key_path`, unvalidated, as `placed`: a JSON component of 600,000 values
        (a long `trainer_state.json` log) built each with `model_construct` in ~20 µs, twice."""
        placed = _unvalidated(cls, {**values, "key_path": key_path})
        assert isinstance(placed, KeyedEntry)
        return placed


#: `BaseModel`'s slots (`__dict__` and pydantic's three), set directly by `Entry.trusted`
_new = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__

_ENTRY_FIELDS = frozenset(Entry.model_fields)
_ALL_ENTRY_FIELDS = _shared_fields(set(_ENTRY_FIELDS))


def _unvalidated(cls: type[Entry], values: dict[str, Any]) -> Entry:
    """An `Entry` of `values` (every field of `Entry`), built without validation."""
    entry = _new(cls)
    # the model is frozen: its slots are set through their descriptors, as
    # `object.__setattr__` would, without its attribute lookups (a third of the cost)
    _set_dict(entry, values)
    _set_fields(entry, _ALL_ENTRY_FIELDS)
    _set_extra(entry, None)
    _set_private(entry, None)
    return entry


class FileInfo(Record):
    """One file of a checkpoint, with its size on disk and how many entries it holds."""

    path: str
    size: int | None = None
    entries: int = 0


class Manifest(Record):
    """Everything a checkpoint holds, from metadata alone.

    Attributes:
        format: format token (`safetensors`, `dcp`, `torch`, `hub`).
        location: where it was read from, as the user wrote it.
        files: the data and metadata files.
        entries: tensors and objects in storage order.
        metadata: free-form string metadata (safetensors `__metadata__`).
        details: format specifics (DCP serialization and world size, index `total_size`...).
    """

    format: str
    location: str
    files: list[FileInfo] = Field(default_factory=list)
    entries: list[Entry] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)

    @cached_property
    def by_name(self) -> dict[str, Entry]:
        """Entries keyed by name."""
        return {entry.name: entry for entry in self.entries}

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Manifest:
        """`Record.model_copy` without the cached `by_name`: a copy with other entries (a
        view's, `ckpt merge`'s) indexed the original's, whose raw offsets it then served."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("by_name", None)
        return copied

    @property
    def tensors(self) -> list[Entry]:
        """Tensor entries only."""
        return [e for e in self.entries if e.kind == "tensor"]

    @property
    def objects(self) -> list[Entry]:
        """Non-tensor entries only."""
        return [e for e in self.entries if e.kind == "object"]

    def tensor_bytes(self) -> int:
        """Total bytes of all tensors."""
        return sum(e.nbytes for e in self.entries if e.kind == "tensor")

    def parameters(self) -> int:
        """Total element count of floating-point tensors (what people call parameters)."""
        return sum(e.numel for e in self.entries if e.kind == "tensor" and e.dtype in FLOATING)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Tensor bytes grouped by dtype, largest first."""
        totals: dict[str, int] = {}
        for e in self.entries:
            if e.kind == "tensor" and e.dtype:
                totals[e.dtype] = totals.get(e.dtype, 0) + e.nbytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


#: the JSON schema's enum of problem codes (the table of `problems.py`)
_CODE_ENUM: list[JsonValue] = [*sorted(CODES)]


class Problem(Record):
    """One problem found by `verify` or `diff`: a stable code, where, what is wrong, and what
    to do about it.

    `code` and `severity` must be in the table of `ckpt_cli/problems.py` (a code that is not is
    a bug: the model refuses it, naming the code). `message` names the file and the flaw;
    `fix` says what the user can run or do (every problem ckpt reports has one; the human
    output prints it after the message, as an error's message ends with its fix).
    """

    code: str = Field(
        description="a code of the table in docs/commands/verify.md",
        json_schema_extra={"enum": _CODE_ENUM},
    )
    message: str
    file: str | None = None
    tensor: str | None = None
    severity: Literal["error", "warning"] = "error"
    #: on a checkpoint protected by `ckpt protect`: whether `ckpt repair` can rebuild the file
    #: (None when the checkpoint has no parity or the problem is not about file contents)
    repairable: bool | None = None
    fix: str | None = Field(
        default=None,
        description="What to run or do about it (fetch the shard again, `ckpt repair SRC`, "
        "resume from the checkpoint `ckpt latest RUN_DIR` names...); a summary entry carries "
        "the fix of the problems it counts.",
    )

    @model_validator(mode="after")
    def _known_code(self) -> Problem:
        check_code(self.code, self.severity)
        return self

    @property
    def stands_for(self) -> int:
        """How many problems this entry reports: 1, or the count a `ProblemSummary` sums up."""
        return 1


#: problems of one code (and severity) a `ProblemList` lists; the rest are counted, not kept
MAX_EXAMPLES = 100


class ProblemSummary(Problem):
    """The problems of one code past the first `MAX_EXAMPLES` that a `ProblemList` kept: one
    entry saying how many more there are (`… and 999,900 more missing_tensor problems`).

    In the JSON output it is an ordinary problem (same code and severity; `file` where all of
    them name one file); the count is also kept out of band (`stands_for`), so another
    `ProblemList` the entry is added to adds the count to its own."""

    _omitted: int = PrivateAttr(default=0)

    @property
    def stands_for(self) -> int:
        return self._omitted

    def count(self, more: int, file: str | None) -> None:
        """`more` problems of this code (about `file`) left out besides."""
        self._omitted += more
        if self.file is not None and file != self.file:
            self.file = None
        self.message = (
            f"… and {self._omitted:,} more {self.code} problems (the first {MAX_EXAMPLES} are "
            "listed; a report keeps that many of each code)"
        )


class ProblemList(list[Problem]):
    """A list of problems that keeps at most `MAX_EXAMPLES` of each code and severity, and
    one `ProblemSummary` counting the rest: what a check collects and `verify` reports, so a
    checkpoint crafted with a million bad entries costs ckpt a few hundred problems of memory,
    not a million (no input chooses ckpt's memory: docs/safety.md).

    Every problem added goes through `append` (`extend`, `+=` and `insert` too); one that is
    itself a `ProblemSummary` (from another list) adds its count. The verdict is unchanged:
    every code found is listed, and `stands_for` sums to the number of problems found. An item
    replaced in place (`problems[i] = p.model_copy(...)`) keeps its code; a copy (`copy`,
    `pickle`) is built again from the items, summaries included.
    """

    def __init__(self, problems: Iterable[Problem] = ()) -> None:
        super().__init__()
        self._listed: dict[tuple[str, str], int] = {}
        self._summaries: dict[tuple[str, str], ProblemSummary] = {}
        self.extend(problems)

    def full(self, code: str, severity: Severity = "error") -> bool:
        """Whether a problem of `code` at `severity` would only be counted (so a caller may
        skip building it: `add_counted`)."""
        return self._listed.get((code, severity), 0) >= MAX_EXAMPLES

    def add_counted(
        self,
        code: str,
        severity: Severity,
        file: str | None,
        fix: str | None = None,
        count: int = 1,
    ) -> None:
        """Count `count` more problems of `code` at `severity` about `file` (whose fix is
        `fix`; None: several files) in its summary, without listing them (for a caller that
        found `full` true and built no `Problem`)."""
        key = (code, severity)
        summary = self._summaries.get(key)
        if summary is None:
            summary = ProblemSummary(code=code, message="", file=file, severity=severity, fix=fix)
            self._summaries[key] = summary
            super().append(summary)
        summary.count(count, file)

    def append(self, problem: Problem) -> None:
        key = (problem.code, problem.severity)
        if isinstance(problem, ProblemSummary):
            self._merge(key, problem)
            return
        listed = self._listed.get(key, 0)
        if listed < MAX_EXAMPLES:
            self._listed[key] = listed + 1
            super().append(problem)
        else:
            self.add_counted(problem.code, problem.severity, problem.file, problem.fix)

    def _merge(self, key: tuple[str, str], summary: ProblemSummary) -> None:
        mine = self._summaries.get(key)
        if mine is None:
            mine = summary.model_copy()
            mine._omitted = 0
            self._summaries[key] = mine
            super().append(mine)
        mine.count(summary.stands_for, summary.file)

    def extend(self, problems: Iterable[Problem]) -> None:
        for problem in problems:
            self.append(problem)

    def __iadd__(self, problems: Iterable[Problem]) -> Self:  # type: ignore[override,misc]
        self.extend(problems)
        return self

    def insert(self, index: SupportsIndex, problem: Problem) -> None:
        if isinstance(problem, ProblemSummary) or self.full(problem.code, problem.severity):
            self.append(problem)  # counted: the summary keeps its place
            return
        key = (problem.code, problem.severity)
        self._listed[key] = self._listed.get(key, 0) + 1
        super().insert(index, problem)

    def __reduce__(self) -> tuple[type[ProblemList], tuple[list[Problem]]]:
        return type(self), (list(self),)

    def found(self, severity: Severity) -> int:
        """How many problems of `severity` were found, listed or counted."""
        return sum(p.stands_for for p in self if p.severity == severity)


class OptimizerState(Record):
    """What an optimizer state holds.

    Attributes:
        kind: optimizer class when recorded (AdamW...), else guessed from its state names;
            several optimizers of different kinds are named in order (`AdamW + SGD`).
        states: per-parameter state names (`exp_avg`, `exp_avg_sq`, `step`...).
        params: number of parameters the optimizer's param groups cover.
        params_with_state: how many of those have per-parameter state.
        complete: every parameter has every state (but those `pending`).
        pending: parameters the param groups list that hold no state at all while the
            others hold all of it: torch keeps none until a parameter's first gradient
            (frozen, or staged unfreezing), and a resume restores the rest.
        source: where it was found (file or key prefix).
        scheduled: whether an LR scheduler stepped it: torch's schedulers record each param
            group's `initial_lr`, so False says the run had none (its save lacks no scheduler
            state); None where its param groups are not read by name.
    """

    kind: str | None = None
    states: list[str] = Field(default_factory=list)
    params: int | None = None
    params_with_state: int | None = None
    complete: bool = True
    pending: list[str] = Field(default_factory=list)
    source: str | None = None
    scheduled: bool | None = None


class TrainingState(Record):
    """The training state of a resumable checkpoint, and whether it is enough to resume.

    Attributes:
        layout: `hf-trainer`, `accelerate`, `torchtitan`, `lightning`, `deepspeed`,
            `torch-files`, `torch-dict`, `dcp` ... (how the state was recognised).
        step / epoch: progress counters when recorded.
        counter: a progress counter of the framework's own that its loader restores, when
            the training step itself is not recorded (accelerate's gradient-accumulation
            counter in `random_states_N.pkl`): it counts as progress for the verdict, but it
            is not the step.
        weights: tensors / parameters / bytes of the model weights.
        optimizer: the optimizer state, if any.
        scheduler: LR scheduler summary (class, last_epoch...), if any: the first one's where
            several are saved.
        schedulers: with several LR schedulers saved (accelerate's `scheduler.bin`,
            `scheduler_1.bin`...), each one's summary by component (`scheduler`,
            `scheduler_1`...); empty with one or none.
        rng: RNG streams present (`python`, `numpy`, `torch_cpu`, `torch_cuda`...).
        rng_ranks: the ranks whose RNG state is saved, each its own component (`rng_0`,
            `rng_1`...: a multi-process save); empty when there is one, unnumbered.
        dataloader: data-loader / sampler state summary, if any.
        components: component -> the file(s) holding it (or the key prefix, inside one file).
        prefixes: component -> the prefix of its entry names in the opened checkpoint
            (`model.`, `optimizer.`, or `state_dict.` in a Lightning file); what
            `convert --select` and `diff` use to line components up.
        unreadable: file -> why it could not be read safely (listed, never unpickled).
        resumable: training can continue from it: model weights, optimizer state for every
            parameter, and a progress counter (step / epoch, or the LR scheduler's state).
        missing: what is missing for `resumable`.
        exact: also resumes bit-identically: scheduler, step, RNG and data-loader position
            are saved too (implies `resumable`).
        missing_exact: what `exact` lacks beyond `resumable` (`scheduler`, `step`, `rng`,
            `dataloader`).
        resharded: `saved_world_size` (what the run saved it at) and `world_size` (what it is
            laid out for now) of a folder `ckpt reshard --world-size` cut for another world
            size (its `ckpt-reshard.json`), else None: never exact.
        reshard_record: where that record is, relative to the checkpoint (a DeepSpeed run's
            `global_step100/ckpt-reshard.json`), else None.
        reshard_record_problem: why that `ckpt-reshard.json` could not be read (its world
            sizes are then 0, unknown), else None.
    """

    layout: str
    step: int | None = None
    epoch: float | None = None
    counter: str | None = None
    weights: dict[str, int] = Field(default_factory=dict)
    optimizer: OptimizerState | None = None
    scheduler: dict[str, Any] | None = None
    schedulers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    rng: list[str] = Field(default_factory=list)
    rng_ranks: list[int] = Field(default_factory=list)
    dataloader: dict[str, Any] | None = None
    components: dict[str, str] = Field(default_factory=dict)
    prefixes: dict[str, str] = Field(default_factory=dict)
    unreadable: dict[str, str] = Field(default_factory=dict)
    resumable: bool = False
    missing: list[str] = Field(default_factory=list)
    exact: bool = False
    missing_exact: list[str] = Field(default_factory=list)
    resharded: dict[str, int] | None = None
    reshard_record: str | None = None
    reshard_record_problem: str | None = None
