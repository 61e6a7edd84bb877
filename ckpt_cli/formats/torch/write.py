"""Writing torch.save files: `TorchWriter`, single file or Hugging Face shards.

The writer saves one file (nesting rebuilt from key paths when entries came from a torch.save
file and were not renamed, otherwise flat keys), or, with `max_shard_size`, Hugging Face style
flat shards `pytorch_model-00001-of-00002.bin` plus `pytorch_model.bin.index.json`, written last.
Each tensor is streamed into its file's zip container as it arrives (`torch_zip`): one tensor
in memory at a time, whatever the file or shard size.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ...dtypes import torch_layout
from ...errors import FormatError
from ...models import Entry, FileInfo, KeyStep
from ...storage.fileio import FileRange, open_output
from ..base import SINGLE_FILE_FIX, WriteOptions, Writer
from ..safetensors.format import plan_shards
from .flatten import TorchEntry, plain_copy
from .zip_write import Reduced, TorchZipWriter

if TYPE_CHECKING:
    import torch


#: suffix of a sharded torch checkpoint's index (`pytorch_model.bin.index.json`)
from ..weight_map import BIN_INDEX_SUFFIX


def shard_names(basename: str, count: int) -> list[str]:
    """Hugging Face names: `pytorch_model.bin` or `pytorch_model-00001-of-00002.bin`..."""
    if count == 1:
        return [f"{basename}.bin"]
    return [f"{basename}-{i:05d}-of-{count:05d}.bin" for i in range(1, count + 1)]


class _Node:
    """A container being rebuilt from key paths."""

    def __init__(self, kind: str):
        self.kind = kind
        self.children: dict[str | int, Any] = {}

    def materialize(self) -> Any:
        """The container and everything below it, built from the deepest node up: without
        recursion, as a file may legitimately nest containers as deep as the reader admits
        (`flatten.MAX_DEPTH`), past Python's own recursion limit."""
        order: list[_Node] = []  # parents before their children
        stack = [self]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(v for v in node.children.values() if isinstance(v, _Node))
        built: dict[int, Any] = {}
        for node in reversed(order):
            built[id(node)] = node._built(built)
        return built[id(self)]

    def _built(self, built: dict[int, Any]) -> Any:
        """This container, its child nodes already in `built` (by `id`)."""
        values = {k: built[id(v)] if isinstance(v, _Node) else v for k, v in self.children.items()}
        if self.kind == "list":
            return [values[k] for k in sorted(values, key=lambda k: int(k))]
        if self.kind == "tuple":
            return tuple(values[k] for k in sorted(values, key=lambda k: int(k)))
        if self.kind == "odict":
            return OrderedDict(values)
        return dict(values)


def rebuild(items: list[tuple[Entry, Any]]) -> Any:
    """The saved object for (entry, value) pairs: nesting from key paths where they still fit.

    An entry keeps its original place when it carries a key path (it came from a torch.save
    file, a nested DCP or a training folder) that still spells its name (`keys_as_named`: not
    renamed; under `--select`, the path below the selected part). Every other entry becomes a
    top-level key named by its full name, which is the flat state_dict layout transformers uses.
    """
    if len(items) == 1 and isinstance(items[0][0], TorchEntry) and items[0][0].key_path == ():
        return items[0][1]  # torch.save(tensor): the root itself
    paths: list[tuple[KeyStep, ...]] = []
    for entry, _ in items:
        paths.append(entry.keys_as_named() or (("dict", entry.name),))
    root_kinds = {path[0][0] for path in paths if path}
    root = _Node(root_kinds.pop() if len(root_kinds) == 1 else "dict")
    for (entry, value), path in zip(items, paths, strict=True):
        if path[0][0] != root.kind:
            path = ((root.kind, entry.name),)
        node = root
        ok = True
        for depth, (_, key) in enumerate(path[:-1]):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(path[depth + 1][0])
            elif not isinstance(child, _Node):
                ok = False
                break
            node = child
        last = path[-1][1]
        if not ok or last in node.children:
            root.children[entry.name] = value
        else:
            node.children[last] = value
    return root.materialize()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor torch.save writes without dragging along a larger storage it views into."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        # a slice of a bigger buffer: torch.save would write the whole buffer
        tensor = tensor.clone()
    return tensor


class TorchWriter(Writer):
    """torch.save, single file or Hugging Face shards; one tensor in memory at a time.

    Each tensor is streamed into its file's zip container as it arrives (`torch_zip`); only
    a stand-in stays behind. Entries may arrive in any order. Without `max_shard_size` the
    object is pickled at `finish` as one file whose nesting is rebuilt (see `rebuild`); with
    it, each shard is a flat name -> value dict closed as soon as all its entries have
    arrived, and the index `<basename>.bin.index.json` is written last.
    """

    def __init__(self, staging: Path, plan: list[Entry], options: WriteOptions):
        super().__init__(staging, plan, options)
        self.basename = options.basename or "pytorch_model"
        self.groups = plan_shards(plan, options.max_shard_size)
        if options.single_file and len(self.groups) > 1:
            raise FormatError(
                "a single-file destination cannot be split into shards", fix=SINGLE_FILE_FIX
            )
        self.names = shard_names(self.basename, len(self.groups))
        self._where = {e.name: i for i, group in enumerate(self.groups) for e in group}
        self._entries = {e.name: e for e in plan}
        self._pending: list[dict[str, Any]] = [{} for _ in self.groups]
        self._saved: set[int] = set()
        self._written: list[FileInfo] = []
        self._open: dict[int, tuple[IO[bytes], TorchZipWriter]] = {}
        #: raw copies already written, by source place (see `write_raw`)
        self._raw_places: dict[tuple[Any, ...], Reduced] = {}

    @property
    def accepts_objects(self) -> bool:
        return True

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._where.get(name)
        if shard is None:
            raise RuntimeError(f"writer got {name!r}, which is not in the plan")
        if name in self._pending[shard] or shard in self._saved:
            raise RuntimeError(f"writer got {name!r} twice")
        self._put(name, self._zip(shard).add_tensor(_own_storage(tensor)))

    @property
    def accepts_raw(self) -> bool:
        return True

    def write_raw(self, name: str, blocks: Iterator[bytes]) -> None:
        """Write tensor `name` from its raw C-order bytes: no torch tensor is built.

        The plan entry gives dtype and shape (safetensors' F4 becomes torch's packed
        `float4_e2m1fn_x2`, as the tensor path does). Two entries copied from the same bytes
        of the same local file (a tied weight of a torch.save source) share one storage, as
        `torch.save` stores them.
        """
        shard = self._where.get(name)
        if shard is None:
            raise RuntimeError(f"writer got {name!r}, which is not in the plan")
        entry = self._entries[name]
        layout = torch_layout(entry.dtype or "", list(entry.shape)) if entry.dtype else None
        if layout is None:
            raise FormatError(
                f"tensor {name!r} is {entry.dtype}, which torch has no dtype for",
                fix="Convert to safetensors instead, or cast it with --dtype.",
            )
        dtype, shape = layout
        place = (
            (shard, blocks.place, dtype, tuple(shape)) if isinstance(blocks, FileRange) else None
        )
        tied = self._raw_places.get(place) if place is not None else None
        if tied is not None:
            self._put(name, Reduced(tied.func, tied.args))  # same storage, its own tensor
            return
        reduced = self._zip(shard).add_raw(dtype, shape, entry.nbytes, blocks)
        if place is not None:
            self._raw_places[place] = reduced
        self._put(name, reduced)

    def _zip(self, shard: int) -> TorchZipWriter:
        """The open container of output file `shard` (opened at its first tensor)."""
        opened = self._open.get(shard)
        if opened is None:
            fname = self.names[shard]
            fh = open_output(self.staging / fname)  # closed in _save_file
            # torch names the archive folder after the file, as `torch.save(obj, path)` does
            opened = self._open[shard] = (fh, TorchZipWriter(fh, fname.rsplit(".", 1)[0]))
        return opened[1]

    def write_object(self, name: str, value: Any) -> None:
        self._put(name, plain_copy(value))

    def _put(self, name: str, value: Any) -> None:
        shard = self._where.get(name)
        if shard is None:
            raise RuntimeError(f"writer got {name!r}, which is not in the plan")
        if name in self._pending[shard] or shard in self._saved:
            raise RuntimeError(f"writer got {name!r} twice")
        self._pending[shard][name] = value
        if len(self.groups) > 1 and len(self._pending[shard]) == len(self.groups[shard]):
            self._save_shard(shard)

    def _save_file(self, shard: int, obj: Any, entries: int) -> None:
        """Pickle `obj` (tensors already streamed) into file `shard`, close and fsync it."""
        fname = self.names[shard]
        fh, container = self._open.pop(shard, None) or (None, None)
        if fh is None or container is None:  # a file of objects only
            fh = open_output(self.staging / fname)  # closed below
            container = TorchZipWriter(fh, fname.rsplit(".", 1)[0])
        with fh:
            container.finish(obj)
            fh.flush()
            os.fsync(fh.fileno())
        size = (self.staging / fname).stat().st_size
        self._written.append(FileInfo(path=fname, size=size, entries=entries))

    def _save_shard(self, shard: int) -> None:
        values = self._pending[shard]
        # shards are flat name -> value dicts, in plan order, as transformers writes them
        ordered = {e.name: values[e.name] for e in self.groups[shard]}
        self._save_file(shard, ordered, len(ordered))
        self._pending[shard] = {}
        self._saved.add(shard)

    def finish(self) -> list[FileInfo]:
        missing = [
            e.name
            for i, group in enumerate(self.groups)
            if i not in self._saved
            for e in group
            if e.name not in self._pending[i]
        ]
        if missing:
            raise RuntimeError(
                f"writer finished with {len(missing)} entries unwritten: {missing[:3]}"
            )
        if len(self.groups) == 1:
            values = self._pending[0]
            items = [(self._entries[e.name], values[e.name]) for e in self.plan]
            self._save_file(0, rebuild(items), len(items))
            self._pending[0] = {}
            return self._written
        for shard in range(len(self.groups)):
            if shard not in self._saved:
                self._save_shard(shard)
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in self.plan if e.kind == "tensor")},
            "weight_map": {name: self.names[i] for name, i in sorted(self._where.items())},
        }
        # a naming convention may spell the index itself (diffusers variants)
        index_name = self.options.index_name or f"{self.basename}{BIN_INDEX_SUFFIX}"
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        with open(self.staging / index_name, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self._written.sort(key=lambda f: f.path)
        self._written.insert(0, FileInfo(path=index_name, size=len(data), entries=0))
        return self._written
