"""`.metadata` as `dcp.save` writes it (torch's own `Metadata` classes), pickled without torch.

The pickle is streamed, entry by entry, as the opcodes `pickle.Pickler(protocol=2)` (the C
pickler) gives for torch's objects: no object graph is built, so the memory stays a memo of the
strings the pickle shares (a name, a file) whatever the entry count (#30). The opcodes are those
of pickling stand-ins of torch's classes (see `tests/test_dcp_metadata_stream.py`), each below
mirroring one step of the pickler, with one difference: only what the pickle may fetch again
(a string, a global, a shared constant, a caller's planner value) is memoized (PUT). The
per-entry containers the pickler PUTs but never fetches (each state dict, `torch.Size`, chunk
list and object) are left out, as `pickletools.optimize` leaves them out: the pickle means the
same to any unpickler (torch's `dcp.load` included), but a reader's memo no longer keeps every
object of the load alive until its end. That halves what reading `.metadata` back costs at
its peak (the output check, then every later reader: ~2 KiB per entry before) and a third of
the file.
"""

from __future__ import annotations

import io
import pickle
import struct
import uuid
from collections.abc import Iterator
from typing import IO, Any

from ...models import Chunk, Entry
from .metadata import planner_paths
from .transforms import ZSTD_DESCRIPTOR

_MD = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")

#: the pickler writes a dict's items and a list's elements in batches of this many
_BATCH = 1000
#: flush the output buffer past this many bytes
_FLUSH_AT = 1 << 20


class _Stream:
    """Protocol-2 opcodes written as the C pickler writes them, with its memo.

    Objects the pickle may name twice (a fqn, a file name, a shared constant) are memoized by
    identity, as the pickler does; the containers built per entry (a `torch.Size`, a state dict)
    are referenced once, so they get no PUT at all (`pickletools.optimize` drops such PUTs).
    """

    def __init__(self, fh: IO[bytes]):
        self.fh = fh
        self.buffer = bytearray(b"\x80\x02")  # PROTO 2
        self.size = 0
        self.next_index = 0
        self.memo: dict[int, int] = {}  # id(obj) -> memo index
        self.keep: list[Any] = []  # objects memoized by id that nobody else holds
        self.globals: dict[tuple[str, str], int] = {}

    def flush(self, force: bool = False) -> None:
        if force or len(self.buffer) >= _FLUSH_AT:
            self.fh.write(self.buffer)
            self.size += len(self.buffer)
            self.buffer = bytearray()

    def put(self) -> int:
        index = self.next_index
        self.next_index += 1
        if index < 256:
            self.buffer += b"q" + bytes((index,))  # BINPUT
        else:
            self.buffer += b"r" + struct.pack("<I", index)  # LONG_BINPUT
        return index

    def get(self, index: int) -> None:
        if index < 256:
            self.buffer += b"h" + bytes((index,))  # BINGET
        else:
            self.buffer += b"j" + struct.pack("<I", index)  # LONG_BINGET

    def memoized(self, obj: Any) -> bool:
        """Write a GET when `obj` is in the memo (the pickler's first step for any object)."""
        index = self.memo.get(id(obj))
        if index is None:
            return False
        self.get(index)
        return True

    def remember(self, obj: Any, held: bool = True) -> None:
        """PUT `obj` and memoize it by identity (`held`: someone else keeps it alive)."""
        self.memo[id(obj)] = self.put()
        if not held:
            self.keep.append(obj)

    def global_(self, module: str, name: str) -> None:
        index = self.globals.get((module, name))
        if index is not None:
            self.get(index)
            return
        self.buffer += b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL
        self.globals[module, name] = self.put()

    def int_(self, value: int) -> None:
        if 0 <= value <= 0xFF:
            self.buffer += b"K" + bytes((value,))  # BININT1
        elif 0 <= value <= 0xFFFF:
            self.buffer += b"M" + struct.pack("<H", value)  # BININT2
        elif -0x80000000 <= value <= 0x7FFFFFFF:
            self.buffer += b"J" + struct.pack("<i", value)  # BININT
        else:
            encoded = pickle.encode_long(value)
            if len(encoded) < 256:
                self.buffer += b"\x8a" + bytes((len(encoded),)) + encoded  # LONG1
            else:
                self.buffer += b"\x8b" + struct.pack("<i", len(encoded)) + encoded  # LONG4

    def fresh_str(self, value: str) -> None:
        """A string nothing else in the pickle is (never fetched again: no PUT)."""
        data = value.encode("utf-8", "surrogatepass")
        self.buffer += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE

    def str_(self, value: str, held: bool = True) -> None:
        """A string that may recur (the same object): GET when it did."""
        if self.memoized(value):
            return
        data = value.encode("utf-8", "surrogatepass")
        self.buffer += b"X" + struct.pack("<I", len(data)) + data
        self.remember(value, held)

    def value(self, obj: Any) -> None:
        """Any plain value (None, bool, int, str, tuple, list, dict), memoized by identity as the
        pickler does; `obj` must stay alive until the pickle ends (a caller's planner_data)."""
        if obj is None:
            self.buffer += b"N"
        elif obj is True or obj is False:
            self.buffer += b"\x88" if obj else b"\x89"  # NEWTRUE / NEWFALSE
        elif type(obj) is int:
            self.int_(obj)
        elif self.memoized(obj):
            return
        elif type(obj) is str:
            self.str_(obj)
        elif type(obj) is tuple:
            self.tuple_(obj, self.value)
        elif type(obj) is list:
            self.list_(obj, self.value, remember=True)
        elif type(obj) is dict:
            self.buffer += b"}"  # EMPTY_DICT
            self.remember(obj)
            self.items(list(obj.items()), self.value)
        else:
            raise TypeError(f"cannot stream {type(obj).__name__} into .metadata")

    def tuple_(self, items: tuple[Any, ...], save: Any, remember: bool = True) -> None:
        if not items:
            self.buffer += b")"  # EMPTY_TUPLE, never memoized
            return
        if len(items) <= 3:
            for item in items:
                save(item)
            self.buffer += b"\x85\x86\x87"[len(items) - 1 : len(items)]  # TUPLE1..3
        else:
            self.buffer += b"("  # MARK
            for item in items:
                save(item)
            self.buffer += b"t"  # TUPLE
        if remember:
            self.remember(items)

    def list_(self, items: list[Any], save: Any, remember: bool = False) -> None:
        self.buffer += b"]"  # EMPTY_LIST
        if remember:
            self.remember(items)
        if len(items) == 1:
            save(items[0])
            self.buffer += b"a"  # APPEND
            return
        done = 0
        while done < len(items):
            self.buffer += b"("
            for item in items[done : done + _BATCH]:
                save(item)
            done += len(items[done : done + _BATCH])
            self.buffer += b"e"  # APPENDS

    def items(self, pairs: list[tuple[Any, Any]], save: Any) -> None:
        """A dict's items after its EMPTY_DICT and PUT (C pickler batching)."""
        if not pairs:
            return
        if len(pairs) == 1:
            save(pairs[0][0])
            save(pairs[0][1])
            self.buffer += b"s"  # SETITEM
            return

        def item(pair: tuple[Any, Any]) -> None:
            save(pair[0])
            save(pair[1])

        self.batched(iter(pairs), item)

    def batched(self, items: Iterator[Any], save: Any) -> None:
        """MARK … SETITEMS batches of `_BATCH` over `items` (more than one), the way the C
        pickler writes a dict: a last full batch is followed by an empty one."""
        while True:
            self.buffer += b"("
            count = 0
            for item in items:
                save(item)
                count += 1
                if count == _BATCH:
                    break
            self.buffer += b"u"  # SETITEMS
            self.flush()
            if count < _BATCH:
                return

    def small_dict(self, pairs: tuple[tuple[str, Any], ...]) -> None:
        """A state dict built for one object: string keys, values already written by callables."""
        self.buffer += b"}"
        if len(pairs) == 1:
            self.str_(pairs[0][0])
            pairs[0][1]()
            self.buffer += b"s"
            return
        self.buffer += b"("
        for key, write in pairs:
            self.str_(key)
            write()
        self.buffer += b"u"

    def new_object(self, module: str, name: str) -> None:
        """NEWOBJ of torch's class `module.name` (a dataclass); the state follows."""
        self.global_(module, name)
        self.buffer += b")\x81"  # EMPTY_TUPLE NEWOBJ

    def size_(self, values: list[int]) -> None:
        """`torch.Size(values)`: REDUCE of torch.Size with ((values…),)."""
        self.global_("torch", "Size")
        self.tuple_(tuple(values), self.int_, remember=False)
        self.buffer += b"\x85"  # TUPLE1 of the args
        self.buffer += b"R"  # REDUCE


def _planner_parts(stream: _Stream, name: str) -> None:
    """`tuple(name.split("."))` as the pickler writes the tuple CPython builds: with no dot the
    part is `name` itself, an empty or one-character (Latin-1) part is CPython's shared string,
    any other part a new string; the tuple is new."""
    parts = name.split(".")

    def part(text: str) -> None:
        if len(parts) == 1:
            stream.str_(name)  # split returns the string itself
        elif len(text) == 0 or (len(text) == 1 and ord(text) < 256):
            stream.str_(text)  # a singleton CPython keeps alive
        else:
            stream.fresh_str(text)

    stream.tuple_(tuple(parts), part, remember=False)


def write_metadata(
    fh: IO[bytes],
    plan: list[Entry],
    layout: dict[str, list[Chunk]],
    results: dict[str, list[tuple[int, int] | None]],
    object_file: dict[str, str],
    compression: str | None,
    planner_data: Any,
    save_id: str | None = None,
) -> int:
    """Write the `.metadata` pickle of a written DCP to `fh`, as `dcp.save` pickles its
    `Metadata` (so `dcp.load` reads it): every planned entry with the byte range `results`
    records for it. Returns the number of bytes written.

    Written without torch: the opcodes name torch's classes, which `.metadata` readers resolve
    to torch's classes (`dcp.load`) or to stand-ins (`metadata`). `save_id` defaults to a new
    uuid4, as `dcp.save` draws one.
    """
    stream = _Stream(fh)
    transforms = [ZSTD_DESCRIPTOR] if compression == "zstd" else None
    given = planner_data if isinstance(planner_data, dict) else {}
    seen: set[str] = set()
    names = [e.name for e in plan if not (e.name in seen or seen.add(e.name))]  # type: ignore[func-returns-value]
    del seen
    by_name = {e.name: e for e in plan}
    strided: list[int] = []
    contiguous: list[int] = []

    def shared(memo: list[int], func: tuple[str, str], arg: Any) -> None:
        # one object reduced once, then fetched: `torch.strided`, the memory format
        if memo:
            stream.get(memo[0])
            return
        stream.global_(*func)
        stream.tuple_((arg,), stream.value, remember=False)
        stream.buffer += b"R"
        memo.append(stream.put())

    def tensor_metadata(entry: Entry) -> None:
        if entry.kind == "object":
            stream.new_object(_MD, "BytesStorageMetadata")  # no state: no BUILD
            return
        assert entry.dtype is not None
        dtype = entry.dtype
        stream.new_object(_MD, "TensorStorageMetadata")

        def properties() -> None:
            stream.new_object(_MD, "TensorProperties")
            stream.buffer += b"("
            stream.global_("torch", dtype)
            shared(strided, ("torch.serialization", "_get_layout"), "torch.strided")
            stream.buffer += b"\x89"
            shared(contiguous, (_MD, "_MEM_FORMAT_ENCODING"), 0)
            stream.buffer += b"\x89t"
            stream.buffer += b"b"  # BUILD

        def chunk(c: Chunk) -> None:
            stream.new_object(_MD, "ChunkStorageMetadata")
            stream.small_dict(
                (
                    ("offsets", lambda: stream.size_(c.offsets)),
                    ("sizes", lambda: stream.size_(c.sizes)),
                )
            )
            stream.buffer += b"b"

        stream.small_dict(
            (
                ("properties", properties),
                ("size", lambda: stream.size_(entry.shape)),
                ("chunks", lambda: stream.list_(layout[entry.name], chunk)),
            )
        )
        stream.buffer += b"b"

    def info(rel: str, start: int, length: int) -> None:
        stream.new_object(*_STORAGE_INFO)
        pairs: list[tuple[str, Any]] = [
            ("relative_path", lambda: stream.str_(rel)),
            ("offset", lambda: stream.int_(start)),
            ("length", lambda: stream.int_(length)),
        ]
        if transforms is not None:
            pairs.append(("transform_descriptors", lambda: stream.value(transforms)))
        stream.small_dict(tuple(pairs))
        stream.buffer += b"b"

    def index_key(name: str, index: int | None, offsets: list[int] | None) -> None:
        stream.new_object(_MD, "MetadataIndex")
        if index is None:
            pairs: tuple[tuple[str, Any], ...] = (
                ("fqn", lambda: stream.str_(name)),
                ("offset", lambda: stream.value(None)),
                ("index", lambda: stream.value(None)),
            )
        else:
            pairs = (
                ("fqn", lambda: stream.str_(name)),
                ("index", lambda: stream.int_(index)),
                ("offset", lambda: stream.size_(offsets or [])),
            )
        stream.small_dict(pairs)
        stream.buffer += b"b"

    def storage_items() -> Iterator[tuple[str, int | None, list[int] | None, str, int, int]]:
        for entry in plan:
            found = results[entry.name]
            if entry.kind == "object":
                start, length = found[0]  # type: ignore[misc]
                yield entry.name, None, None, object_file[entry.name], start, length
                continue
            for index, (c, result) in enumerate(zip(layout[entry.name], found, strict=True)):
                assert result is not None
                yield entry.name, index, c.offsets, c.file, result[0], result[1]

    def name_items(save_value: Any) -> None:
        if len(names) == 1:
            stream.str_(names[0])
            save_value(names[0])
            stream.buffer += b"s"
        elif names:

            def item(name: str) -> None:
                stream.str_(name)
                save_value(name)

            stream.batched(iter(names), item)

    # an entry that knows where it sat (a torch.save or nested DCP source) keeps its path,
    # lists as lists; any other name is a path split at its dots. Built up front: the pickler
    # remembers each string by identity, so every path must live until the pickle ends
    keyed = ((name, by_name[name].keys_as_named(), by_name[name].kind) for name in names)
    known = planner_paths(
        (name, keys, kind == "tensor") for name, keys, kind in keyed if keys and name not in given
    )

    def planner_value(name: str) -> None:
        if name in given:
            stream.value(given[name])
        elif name in known:
            stream.value(known[name])
        else:
            _planner_parts(stream, name)

    def storage_data() -> None:
        stream.buffer += b"}"
        items = storage_items()

        def item(row: tuple[str, int | None, list[int] | None, str, int, int]) -> None:
            index_key(row[0], row[1], row[2])
            info(row[3], row[4], row[5])

        first = next(items, None)
        if first is None:
            return
        second = next(items, None)
        if second is None:
            item(first)
            stream.buffer += b"s"
            return

        def chained() -> Iterator[tuple[str, int | None, list[int] | None, str, int, int]]:
            yield first
            yield second
            yield from items

        stream.batched(chained(), item)

    def state_dict_metadata() -> None:
        stream.buffer += b"}"
        name_items(lambda n: tensor_metadata(by_name[n]))

    def planner() -> None:
        stream.buffer += b"}"
        name_items(planner_value)

    def storage_meta() -> None:
        stream.new_object(_MD, "StorageMeta")
        sid = save_id if save_id is not None else str(uuid.uuid4())
        stream.small_dict(
            (
                ("checkpoint_id", lambda: stream.value(None)),
                ("save_id", lambda: stream.str_(sid, held=False)),
                ("load_id", lambda: stream.value(None)),
                ("modules", lambda: stream.list_([], stream.value)),
            )
        )
        stream.buffer += b"b"

    stream.new_object(_MD, "Metadata")
    stream.small_dict(
        (
            ("state_dict_metadata", state_dict_metadata),
            ("planner_data", planner),
            ("storage_data", storage_data),
            ("storage_meta", storage_meta),
            ("version", lambda: stream.str_("1.0.0")),
        )
    )
    stream.buffer += b"b."  # BUILD STOP
    stream.flush(force=True)
    return stream.size


def metadata_bytes(
    plan: list[Entry],
    layout: dict[str, list[Chunk]],
    results: dict[str, list[tuple[int, int] | None]],
    object_file: dict[str, str],
    compression: str | None,
    planner_data: Any,
    save_id: str | None = None,
) -> bytes:
    """`write_metadata` into memory (the whole pickle as bytes)."""
    buffer = io.BytesIO()
    write_metadata(buffer, plan, layout, results, object_file, compression, planner_data, save_id)
    return buffer.getvalue()
