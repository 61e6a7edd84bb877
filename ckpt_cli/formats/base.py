"""The adapter layer's interfaces: `Source`, `Format`, `Checkpoint`, `Writer`.

A `Format` recognises a source cheaply (`detect`, file names only), opens it into a
`Checkpoint` whose `manifest` comes from metadata alone, and writes new checkpoints through
a streaming `Writer`. Readers hand out one tensor (or one raw byte range) at a time, so peak
memory follows the largest tensor, never the model.

The contract has three levels, each optional beyond the first, each announced by a flag the
operations read instead of probing for methods (the way torch DCP's `StorageReader` /
`StorageWriter` ABCs document the calls a planner makes):

* entries (every format): `Checkpoint.read_tensor` / `read_object` / `read_slice`,
  `Writer.write_tensor` / `write_object`; `Checkpoint.iter_raw` and `Writer.write_raw` when
  tensors are stored as raw C-order bytes (`Entry.is_raw`, `Writer.accepts_raw`).
* chunks (`Checkpoint.chunk_reads`, `Writer.chunk_writes`; DCP): a tensor is stored as boxes
  of the global tensor (`Entry.chunks`). A chunk reader hands out one stored box at a time
  (`read_chunk`); a chunk writer is planned with the boxes it writes (`chunks_of`), may own
  only some of its data files (`owns`, under torchrun) and receives one box at a time
  (`write_chunk`), so a re-cut for another world size never holds a whole tensor.
* object bytes (`Checkpoint.object_bytes`, `Writer.object_bytes`, `Format.object_bytes`):
  each non-tensor entry is stored as its own `torch.save` blob, handed over as bytes
  (`read_object_bytes` -> `write_object_bytes`) so a copy never unpickles it, and scanned by
  `ckpt verify` for globals the restricted reader refuses.

The `Format` class also states the facts operations need about a target before any writer
exists (which file names it writes, whether it holds objects, shards by size or by rank,
dedupes tied tensors, keeps string metadata...): one attribute each, looked up through the
registry (`ckpt_cli.formats.get_format`), so no operation compares format names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..errors import REPORT_BUG, CorruptDataError, FormatError
from ..findings import problem_from_error
from ..models import Chunk, Entry, FileInfo, Manifest, Problem, TensorFacts
from ..storage import Storage
from ..storage.fileio import COPY_BLOCK
from ..storage.uri import Location
from .details import FormatDetails, PlainDetails

if TYPE_CHECKING:
    import torch

#: the fix of a read of an entry name the checkpoint does not hold
NAMES_FIX = "`ckpt inspect` lists the names it holds; use one of those."
#: the fix of a sharded output written to a single-file destination
SINGLE_FILE_FIX = "Name a folder as DEST to write shards, or leave out --max-shard-size."


@dataclass
class Source:
    """A location opened for reading: its storage and, when SRC named one file, that file.

    `origin` holds facts about where the files came from that belong in the manifest's
    `details` (for the Hub: repository, requested revision, resolved commit).
    `members` lists, when SRC named one file of a set read as one checkpoint (a split GGUF
    `model-00001-of-00003.gguf`), the files of the set present (`Format.checkpoint_source`).
    `parsed` holds what a format's `check` parsed and found flawless, keyed by the format,
    the file and its size, for the same operation's `open` to take once instead of reading
    it again (`verify` checks SRC, then opens it for its quantization checks), and the
    sources of its component folders (`layouts.composite.subfolder_source`).
    """

    location: Location
    storage: Storage
    target: str | None = None
    origin: dict[str, Any] = field(default_factory=dict)
    members: tuple[str, ...] | None = None
    parsed: dict[tuple[str, str, int], Any] = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def files(self) -> dict[str, int]:
        """Files to consider (relative path -> size): the target alone (with the `members`
        of its set), or the whole folder."""
        if self.members is not None:
            return {name: self.storage.size(name) for name in self.members}
        if self.target is not None:
            return {self.target: self.storage.size(self.target)}
        return self.storage.list_files()

    def top_level(self) -> list[str]:
        """File names directly under the root (no subfolders)."""
        return [name for name in self.files if "/" not in name]


class RecordedDamage(NamedTuple):
    """Stored bytes that fail a check their own file records (`recorded_checksum_errors`).

    Attributes:
        error: what failed, naming the file and the record.
        tensor: the entry whose bytes they are, where one is (a DCP chunk's tensor); None for
            a record several entries may view (a torch.save storage).
    """

    error: CorruptDataError
    tensor: str | None = None


def leading_slab(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> tuple[int, int] | None:
    """(first, count) when the box `offsets`/`sizes` of a tensor of `shape` is a run of whole
    slices along dim 0 (experts `e..e+count` of a stacked `[E, ...]` tensor): its bytes are
    one range of a C-order tensor's. None for any other box."""
    if not shape or len(offsets) != len(shape) or len(sizes) != len(shape):
        return None
    if any(offsets[1:]) or list(sizes[1:]) != list(shape[1:]):
        return None
    return offsets[0], sizes[0]


class Checkpoint(ABC):
    """An opened checkpoint: its manifest, and reads of one entry at a time.

    Attributes:
        chunk_reads: `read_chunk` hands out stored chunks (`Entry.chunks`) one at a time.
        object_bytes: `read_object_bytes` hands out a non-tensor entry's stored `torch.save`
            blob without unpickling it.
        planner_data: format data to carry into a rewrite of the same format (DCP's
            `planner_data`: fqn -> path in the nested state dict); None when there is none.
    """

    chunk_reads: ClassVar[bool] = False
    object_bytes: ClassVar[bool] = False
    planner_data: Any = None

    def __init__(self, source: Source, manifest: Manifest):
        self.source = source
        self.manifest = manifest

    @property
    def storage(self) -> Storage:
        """Where the files are read from."""
        return self.source.storage

    @abstractmethod
    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, contiguous, on CPU."""

    def read_object(self, name: str) -> Any:
        """The value of a non-tensor entry (bytes, int, dict...)."""
        raise FormatError(
            f"entry {name!r} is not a readable object in a {self.manifest.format} checkpoint",
            path=self.manifest.location,
            fix=REPORT_BUG,
        )

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """A box of the global tensor `name`; formats storing chunks override this."""
        tensor = self.read_tensor(name)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        return tensor[index].contiguous() if index else tensor

    def files_of(self, name: str) -> set[str]:
        """The files entry `name`'s data is read from (its file, its chunks' files); a view
        building an entry from others (`MappedCheckpoint`) names theirs."""
        entry = self.manifest.by_name[name]
        files = {entry.file} if entry.file else set()
        files.update(chunk.file for chunk in entry.chunks or [] if chunk.file)
        return files

    def serves_raw(self, name: str) -> bool:
        """Whether `iter_raw(name)` hands out tensor `name`'s C-order bytes (a copy can then
        skip deserialisation): raw-stored entries (`Entry.is_raw`); formats whose tensors
        are raw in pieces (DCP chunks, tensor bytes inside torch.save blobs) override this."""
        return self.manifest.by_name[name].is_raw

    def iter_raw(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        """The raw C-order bytes of a raw-stored tensor, in blocks (see `Entry.is_raw`)."""
        entry = self.manifest.by_name[name]
        if not entry.is_raw or entry.file is None or entry.offset is None:
            raise FormatError(
                f"tensor {name!r} is not stored as raw bytes",
                path=self.manifest.location,
                fix=REPORT_BUG,
            )
        done = 0
        while done < entry.nbytes:
            n = min(block, entry.nbytes - done)
            yield self.storage.read(entry.file, entry.offset + done, n)
            done += n

    def metadata_left_out(self, written: Mapping[str, str] | None = None) -> list[str]:
        """The keys of the files' own string metadata (a sharded safetensors model's
        `__metadata__`) that `manifest.metadata` leaves out because the files disagree on
        their value, each a sentence naming the key, its values and their files: what
        `convert` and `reshard` cannot carry into their output, and warn of. `written` is the
        metadata the output is written with: a key the writer sets all the same (safetensors'
        `format: pt`) is said to hold that value, not to be left out. Empty where the files
        agree, or the format keeps one metadata."""
        return []

    def tolerated_problems(self) -> list[Problem]:
        """The format-rule violations found while opening that leave every entry readable (a
        GGUF file whose tensors are out of order, which llama.cpp refuses and ckpt reads):
        `verify` fails them, `inspect` lists them, `convert` warns of them. None by default."""
        return []

    def model_metadata(self) -> dict[str, str] | None:
        """The metadata that is part of the model rather than of its files (GGUF's key-values:
        architecture, hyper-parameters, tokenizer), key -> the value as compared text (long
        values as a summary and a digest), for `diff`; None where the format keeps none."""
        return None

    def recorded_architecture(self) -> str | None:
        """The model architecture the checkpoint's own metadata names (a GGUF's
        `general.architecture`; "" when such a file names none); None where the format records
        none (the architecture of a safetensors model is in its `config.json`, not the file)."""
        return None

    def built_from(self, name: str) -> list[str]:
        """The entries of the checkpoint under any naming mapping that entry `name` is read
        from (a GGUF's `blk.0.attn_q.weight` for the `model.layers.0.self_attn.q_proj.weight`
        a mapping reads it as): `[name]` where nothing maps it."""
        return [name]

    def stored_as(self, name: str) -> str | None:
        """How non-tensor entry `name` is stored when ckpt does not read its value but can hand
        out its stored bytes (`iter_stored`): a GGUF quantized tensor, `Q8_0 tensor [4, 64]`.
        Such an entry is compared bit for bit (`diff`) and read whole (`verify --deep`),
        never through `read_object`. None for every other entry."""
        return None

    def iter_stored(self, name: str, block: int = COPY_BLOCK) -> Iterator[bytes]:
        """The stored bytes of an entry `stored_as` describes, in blocks of `block` bytes."""
        raise FormatError(
            f"entry {name!r} has no stored bytes ckpt hands out",
            path=self.manifest.location,
            fix=REPORT_BUG,
        )

    def stored_nonfinite(self, name: str) -> tuple[int, int, int, int] | None:
        """(bytes read, values, NaN count, Inf count) of an entry `stored_as` describes, its
        stored bytes decoded block by block (`verify --deep`), where the format can decode
        them without building the whole tensor; None where it cannot (its bytes can then
        only be read whole)."""
        return None

    def block_quantized(self) -> dict[str, str | None]:
        """The entries stored in the format's own block quantization (a GGUF's Q4_K, Q8_0...
        tensors), name -> why `read_dequantized` cannot decode it (None: it can). `convert
        --dequantize` and `diff --dequantize` read them dequantized; none by default."""
        return {}

    def read_dequantized(self, name: str, leading: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 values of block-quantized entry `name` (`block_quantized`), decoded as
        the format's reference decoder does, one tensor in memory at a time; with `leading`
        (first, count), only those slices along dim 0 (`leading_slab`: one expert of a
        stack)."""
        raise FormatError(
            f"entry {name!r} is not block-quantized",
            path=self.manifest.location,
            fix=REPORT_BUG,
        )

    def stored_nonfinite_cause(self, name: str) -> tuple[str, str] | None:
        """(what, fix) when the NaN or Inf `stored_nonfinite` found in entry `name` come from
        how it was written rather than from damaged values (a big-endian GGUF whose blocks
        were written little-endian); None otherwise. Asked after `stored_nonfinite`."""
        return None

    def local_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """Where the raw C-order bytes of tensor `name` lie in local files, as consecutive
        `(path, offset, length)` segments, when `serves_raw(name)` and every byte is in a local
        file (a writer can then copy them in the kernel, `FileRange.copy_to`); None otherwise."""
        entry = self.manifest.by_name[name]
        if not entry.is_raw or entry.file is None or entry.offset is None:
            return None
        local = self.storage.local_path(entry.file)
        return None if local is None else [(local, entry.offset, entry.nbytes)]

    def read_chunk(self, name: str, index: int) -> torch.Tensor:
        """Chunk `index` of tensor `name` as stored (its box is `entry.chunks[index]`).

        Implemented where `chunk_reads` is set; other formats store whole tensors.
        """
        raise FormatError(
            f"a {self.manifest.format} checkpoint does not store tensors as chunks "
            f"(asked for chunk {index} of {name!r})",
            path=self.manifest.location,
            fix=REPORT_BUG,
        )

    def recorded_checksum_errors(self) -> Iterator[RecordedDamage]:
        """`verify --deep`: the stored bytes checked against the checksums their own files
        record for them (a torch.save zip's CRC-32 of each storage record), one
        `CorruptDataError` per record whose bytes fail it; and the containers the format's own
        loader trusts where ckpt's reads skip them (the zip headers of DCP's torch_save blobs).
        Nothing where the format records none, or where its reader checks them on every
        read."""
        return iter(())

    def padding(self, name: str) -> list[tuple[int, int]]:
        """Ranges `[start, end)` of tensor `name`'s flat elements that hold no data: padding a
        training layout knows its framework allocates uninitialised (DeepSpeed's ZeRO
        partitions), whose values `verify --deep` must not judge. None in a plain format."""
        return []

    def read_object_bytes(self, name: str) -> bytes:
        """The stored `torch.save` blob of non-tensor entry `name`, never unpickled.

        Implemented where `object_bytes` is set.
        """
        raise FormatError(
            f"a {self.manifest.format} checkpoint does not store entry {name!r} as its own blob",
            path=self.manifest.location,
            fix=REPORT_BUG,
        )

    def release_entries(self) -> None:
        """Let go of the per-entry metadata once no entry will be read again: the manifest's
        entries (its format, location and files stay) and the source's cached parse.

        A conversion calls it once every entry is copied, so the source's entries are not
        alive beside the written `.metadata` and the output check's parse of it (#30: 100,000
        entries). Reading an entry afterwards fails as for a name the checkpoint lacks.
        """
        self.manifest.entries = []
        self.manifest.__dict__.pop("by_name", None)  # the cached index of the entries
        self.source.parsed.clear()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release open files."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class WriteOptions:
    """How a writer lays out its output.

    Attributes:
        max_shard_size: split into shards of at most this many bytes (None: one file).
        metadata: string metadata to store (safetensors `__metadata__`).
        basename: stem for shard and index names (`model` -> `model-00001-of-00002.safetensors`).
        single_file: DEST names one file rather than a folder.
        dcp_serialization: `torch_save` or `safetensors` (DCP only).
        world_size: number of ranks to lay DCP chunks out for.
        dcp_compression: the per-item stream transform of DCP output (`zstd`; None: none).
        dcp_planner_data: a source DCP's `planner_data` (fqn -> path in the nested state
            dict), kept across a rewrite so `dcp.load` of nested dicts still maps keys.
        together: groups of entry names kept in one shard (a quantized weight and its scales).
        index_name: the weight-map index's file name, where the source's naming differs from
            `<basename>.<suffix>.index.json` (diffusers' `...index.fp16.json`).
        companions: small files published with the weights (relative path -> bytes), such as
            an adapter's `adapter_config.json` or a dequantized `config.json`.
    """

    max_shard_size: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    basename: str | None = None
    single_file: bool = False
    dcp_serialization: str = "torch_save"
    world_size: int = 1
    dcp_compression: str | None = None
    dcp_planner_data: Any = None
    together: list[list[str]] | None = None
    index_name: str | None = None
    companions: dict[str, bytes] = field(default_factory=dict)


class Writer(ABC):
    """Streams entries into a new checkpoint inside a staging folder.

    The writer is told every entry up front (`plan`: names, dtypes, shapes, bytes, in order)
    so it can lay out shards and headers before data arrives; then it receives the data of
    each entry in plan order and `finish` writes the commit marker (index / `.metadata`) last.

    Attributes:
        chunk_writes: the writer stores tensors as planned chunks: `chunks_of` says which,
            `owns` which data files it writes, and `write_chunk` takes one box at a time
            (a tensor may then arrive as its chunks instead of through `write_tensor`).
        object_bytes: `write_object_bytes` stores a non-tensor entry from the `torch.save`
            blob a checkpoint with `object_bytes` hands out.
    """

    chunk_writes: ClassVar[bool] = False
    object_bytes: ClassVar[bool] = False

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        self.staging = staging
        self.plan = plan
        self.options = options

    @abstractmethod
    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Write the data of tensor `name`."""

    def write_raw(self, name: str, blocks: Iterator[bytes]) -> None:
        """Write tensor `name` from its raw C-order bytes (formats that store raw bytes)."""
        raise NotImplementedError

    def write_object(self, name: str, value: Any) -> None:
        """Write a non-tensor entry; formats that cannot hold objects raise FormatError."""
        raise FormatError(
            f"{type(self).__name__} cannot store the non-tensor entry {name!r}", fix=REPORT_BUG
        )

    def write_object_bytes(self, name: str, data: bytes) -> None:
        """Write a non-tensor entry from its stored `torch.save` blob (where `object_bytes`)."""
        raise FormatError(
            f"{type(self).__name__} cannot store {name!r} from its stored bytes", fix=REPORT_BUG
        )

    def chunks_of(self, name: str) -> list[Chunk]:
        """The chunks tensor `name` is written as (where `chunk_writes`)."""
        raise FormatError(f"{type(self).__name__} does not write tensors as chunks", fix=REPORT_BUG)

    def owns(self, file: str) -> bool:
        """Whether this writer writes the data file `file` (all of them until `restrict`)."""
        return True

    def write_chunk(self, name: str, chunk_index: int, piece: torch.Tensor) -> None:
        """Write one planned chunk (its box of the global tensor) of tensor `name`."""
        raise FormatError(f"{type(self).__name__} does not write tensors as chunks", fix=REPORT_BUG)

    @property
    def accepts_raw(self) -> bool:
        """Whether `write_raw` is supported (copies can then skip deserialisation)."""
        return False

    @property
    def accepts_objects(self) -> bool:
        """Whether non-tensor entries can be stored."""
        return False

    @abstractmethod
    def finish(self) -> list[FileInfo]:
        """Flush, fsync, write the commit marker; return the files written."""

    # Split writing (torchrun, see `ckpt_cli.dist.command`): every rank builds the same writer
    # from the same plan, `restrict`s it to the data files assigned to it, receives only the
    # entries it `wants`, and returns `finish_part()`; rank 0 then `commit`s all the parts,
    # writing the commit marker last. A writer that splits has `finish() ==
    # commit([finish_part()])`, so a split run writes the same bytes as a single one.

    @property
    def splittable(self) -> bool:
        """Whether `output_files` / `restrict` / `finish_part` / `commit` are implemented."""
        return False

    def output_files(self) -> dict[str, int]:
        """The data files the plan produces (commit marker excluded), with their planned bytes."""
        raise NotImplementedError

    def restrict(self, files: Collection[str]) -> None:
        """Write only these data files (call before any entry is written)."""
        raise NotImplementedError

    def wants(self, name: str) -> bool:
        """Whether entry `name` has data in the files this writer writes."""
        return True

    def finish_part(self) -> dict[str, Any]:
        """Flush and fsync this writer's files; a JSON-able record of them for `commit`."""
        raise NotImplementedError

    def commit(self, parts: list[dict[str, Any]]) -> list[FileInfo]:
        """Write the commit marker from every rank's `finish_part`; return all files written."""
        raise NotImplementedError


class Format(ABC):
    """One checkpoint format: detection, opening, writing, and the facts operations need.

    The facts are class attributes, set in each format's module; operations read them from
    the class the registry returns, never from the format's name.

    Attributes:
        name: the token users type (`--format`, `--to`).
        title: how messages name one of its files (`a torch.save file`).
        writable: `writer` is implemented.
        folder: a checkpoint is a whole folder; SRC naming one of its files means the folder.
        single_file_suffixes: DEST names ending so are one output file (first: the usual one).
        default_basename / index_suffix: the stem of shard names and the suffix of the shard
            index (`model` + `.safetensors.index.json`).
        holds_objects: non-tensor entries (optimizer steps, RNG states) can be written.
        object_bytes: opened checkpoints implement `Checkpoint.read_object_bytes`.
        shards_by_size: the output is cut into shards by `--max-shard-size`.
        shards_by_rank: the output is laid out for `--world-size` ranks (one file per rank).
        serializations: how the data files can be encoded (first: the default).
        loader_serializations: those the framework's own loader reads back.
        chunked_serializations: those that can hold several chunks of one tensor in one file
            (Megatron's layers stacked along dim 0, one chunk a layer); safetensors keys chunks
            by name, so it cannot.
        compressions: compression transforms the writer can apply.
        dedupes_tied: tensors that share storage are stored once (the others become aliases).
        string_metadata: a string-to-string metadata map is stored (safetensors
            `__metadata__`); `required_metadata` is what its loaders need in it.
        commit_marker: the file written last that makes an output complete (`.metadata`).
        layout_files: per details `layout`, files the entries are read from besides the data
            files (Megatron's `metadata.json`): never copied beside an output.
        details_model: the typed model of its manifests' `details` (`formats.details`).
        refused_pickles_may_be_whole: its files are pickles `torch.load(weights_only=True)`
            reads, so a file whose pickle names classes that refuses (`unsafe_input`) can still
            be whole: completeness is judged from its structure instead.
        self_described: its header describes the model (architecture, tensor types), shown
            as the layout of a checkpoint of it.
        flat_names: each entry's name is one key of a flat state dict (safetensors, GGUF:
            `model.layers.0.mlp.up_proj.weight` is a key, not a path of nested dicts), so a
            target that records key paths (DCP's planner_data) records it whole.
    """

    name: ClassVar[str]
    title: ClassVar[str] = ""
    #: whether `writer` is implemented
    writable: ClassVar[bool] = False
    folder: ClassVar[bool] = False
    single_file_suffixes: ClassVar[tuple[str, ...]] = ()
    default_basename: ClassVar[str] = "model"
    index_suffix: ClassVar[str | None] = None
    holds_objects: ClassVar[bool] = False
    object_bytes: ClassVar[bool] = False
    shards_by_size: ClassVar[bool] = False
    shards_by_rank: ClassVar[bool] = False
    serializations: ClassVar[tuple[str, ...]] = ()
    loader_serializations: ClassVar[tuple[str, ...]] = ()
    chunked_serializations: ClassVar[tuple[str, ...]] = ()
    compressions: ClassVar[tuple[str, ...]] = ()
    dedupes_tied: ClassVar[bool] = False
    string_metadata: ClassVar[bool] = False
    required_metadata: ClassVar[Mapping[str, str]] = {}
    commit_marker: ClassVar[str | None] = None
    layout_files: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    details_model: ClassVar[type[FormatDetails]] = PlainDetails
    refused_pickles_may_be_whole: ClassVar[bool] = False
    self_described: ClassVar[bool] = False
    flat_names: ClassVar[bool] = False

    @staticmethod
    def shard_names(basename: str, count: int) -> list[str]:
        """The names of `count` shards with stem `basename` (formats that shard by size)."""
        return []

    @staticmethod
    def rank_file(rank: int) -> str:
        """The data file rank `rank` writes (formats that shard by rank)."""
        raise NotImplementedError

    @staticmethod
    def planned_size(entries: list[Entry], metadata: dict[str, str]) -> int | None:
        """The exact size of a file holding `entries` in order, when known before writing."""
        return None

    @staticmethod
    def skip_reason(entry: Entry) -> str | None:
        """Why a conversion leaves `entry` out, in this format's words (None: the generic one)."""
        return None

    @classmethod
    def checkpoint_source(cls, source: Source) -> Source:
        """The source a check reads: the whole folder for a `folder` format named by one file
        (a format reading sets of files named by one of them gives the set as `members`)."""
        if cls.folder and source.target is not None:
            return Source(location=source.location, storage=source.storage, origin=source.origin)
        return source

    @classmethod
    def output_metadata(
        cls, metadata: Mapping[str, str], aliases: Mapping[str, str]
    ) -> dict[str, str]:
        """The string metadata to write: the source's, the tied-name aliases, what loaders need."""
        if not cls.string_metadata:
            return {}
        return {**metadata, **aliases, **cls.required_metadata}

    @classmethod
    def resharded_metadata(cls, metadata: Mapping[str, str]) -> dict[str, str]:
        """The string metadata a reshard writes: the source's as it is (a `format: tf` stays
        `tf`), with what loaders need where the source does not say it (shards that disagree on
        `format`, or never wrote it: accelerate refuses a file whose metadata lacks it)."""
        if not cls.string_metadata:
            return dict(metadata)
        return {**cls.required_metadata, **metadata}

    @classmethod
    def entry_files(cls, manifest: Manifest) -> set[str]:
        """The files a checkpoint's entries are read from (never copied beside an output)."""
        used = {f.path for f in manifest.files if f.entries}
        details = cls.details_model.of(manifest)
        if details is not None and details.layout is not None:
            used.update(cls.layout_files.get(details.layout, ()))
        return used

    @classmethod
    @abstractmethod
    def detect(cls, source: Source) -> bool:
        """Cheap check from file names (and at most a few bytes)."""

    @classmethod
    @abstractmethod
    def open(cls, source: Source) -> Checkpoint:
        """Read metadata and return the opened checkpoint."""

    @classmethod
    def writer(cls, staging: Path, plan: list[Entry], options: WriteOptions) -> Writer:
        """A streaming writer into `staging`."""
        raise FormatError(f"writing the {cls.name} format is not supported", fix=REPORT_BUG)

    @classmethod
    def checked_tensors(cls, source: Source) -> dict[str, TensorFacts] | None:
        """Name -> facts of every tensor `open` would give, in its order, from what `check`
        just parsed of `source`, without opening it; None when the format keeps no such
        record or the check left none (it found a flaw): the caller opens the checkpoint.

        `verify` runs its quantization checks on these when it reads no tensor data.
        """
        return None

    @classmethod
    def check(cls, source: Source) -> list[Problem]:
        """Structural problems of `source` (metadata and file sizes only), all of them.

        `ckpt verify` calls this. The default only reports what `open` refuses; formats
        override it to report every problem instead of stopping at the first.
        """
        try:
            cls.open(source).close()
        except FormatError as error:
            return [problem_from_error(error)]
        return []
