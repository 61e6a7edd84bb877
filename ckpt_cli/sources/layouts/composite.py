"""Composite checkpoints: the components of a training folder read as one.

Entry names are `<component>.<name inside the component>` (see `ckpt_cli.sources.layouts`).
`Folder` opens the components of one folder and collects what cannot be read.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...budgets import json_record_over_budget
from ...errors import REPORT_BUG, CkptError, FormatError, NotFoundError, UnsafeInputError
from ...faults import no_verdict
from ...formats import get_format
from ...formats.base import NAMES_FIX, Checkpoint, RecordedDamage, Source
from ...formats.names import DCP_DATA_SUFFIX, DCP_METADATA, weight_format
from ...formats.weight_map import INDEX_SUFFIX
from ...models import Entry, FileInfo, Manifest, Problem, TrainingState
from ...storage.uri import parse_location
from .details import CompositeDetails
from .training_args import training_arg_values

if TYPE_CHECKING:
    import torch

#: the fix of a JSON component (`trainer_state.json`) that does not parse as a JSON object
_JSON_FIX = (
    "The file is cut short or corrupt: restore it from a good copy of the checkpoint (the "
    "training run writes it again at its next save)."
)


class ObjectsCheckpoint(Checkpoint):
    """Non-tensor entries held in memory (a JSON file's values).

    Attributes:
        values: the document's top-level keys and their values, as parsed.
        leaves: entry name -> value (the flattened leaves `read_object` returns); defaults to
            `values`.
    """

    def __init__(
        self,
        source: Source,
        manifest: Manifest,
        values: dict[str, Any],
        leaves: dict[str, Any] | None = None,
    ):
        super().__init__(source, manifest)
        self.values = values
        self.leaves = values if leaves is None else leaves

    def read_tensor(self, name: str) -> torch.Tensor:
        raise FormatError(
            f"entry {name!r} is not a tensor", path=self.manifest.location, fix=REPORT_BUG
        )

    def read_object(self, name: str) -> Any:
        if name not in self.leaves:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            )
        return copy_json(self.leaves[name])  # a copy callers may change


def copy_json(value: Any) -> Any:
    """A copy of parsed JSON (dicts, lists and scalars), its containers new, walked without
    recursion (a document nested as deep as `json.loads` allows copies too). A 300,000-row
    `log_history` copies in 0.5 s, where dumping and parsing it again took 1.5 s."""
    if type(value) is not dict and type(value) is not list:
        return value
    root: Any = {} if type(value) is dict else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if type(src) is dict else enumerate(src)
        for key, item in items:
            kind = type(item)
            if kind is dict or kind is list:
                new: Any = {} if kind is dict else []
                stack.append((item, new))
                item = new
            if type(dst) is dict:
                dst[key] = item
            else:
                dst.append(item)
    return root


def _json_container(node: Any) -> str | None:
    """How a JSON value is flattened; the rules of `torch_save.flatten` (dicts with keys, lists
    holding a dict at any depth are containers; other lists are one value, and so is a log such
    as `log_history`, which `_flatten_json` keeps whole), so a JSON component and the same values
    after `convert --to torch` have the same entry names."""
    if isinstance(node, dict):
        return "dict" if node else None
    if isinstance(node, list) and node:

        def holds_dict(items: list[Any], depth: int) -> bool:
            return depth <= 8 and any(
                isinstance(i, dict) or (isinstance(i, list) and holds_dict(i, depth + 1))
                for i in items
            )

        return "list" if holds_dict(node, 0) else None
    return None


def _flatten_json(doc: dict[str, Any]) -> Iterator[tuple[tuple[tuple[str, Any], ...], Any]]:
    from ...formats.torch.flatten import is_log

    stack: list[tuple[tuple[tuple[str, Any], ...], Any]] = [
        ((("dict", str(k)),), v) for k, v in reversed(list(doc.items()))
    ]
    while stack:
        path, node = stack.pop()
        kind = None if is_log(path[-1][1], node) else _json_container(node)
        if kind is None:
            yield path, node
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = [((*path, (kind, key)), value) for key, value in items]
        stack.extend(reversed(children))


def json_component(source: Source, rel: str) -> ObjectsCheckpoint:
    """A JSON file (`trainer_state.json`) as object entries, flattened like a torch.save dict
    (`global_step`, `stateful_callbacks.TrainerControl.args.should_save`; its `log_history` one
    entry, however long), each entry remembering its key path for the torch writer."""
    from ...formats.torch.flatten import MAX_LEAVES, is_log
    from ...formats.torch.format import TorchEntry

    where = source.storage.describe(rel)
    too_large = json_record_over_budget(source.storage.size(rel))
    if too_large is not None:
        raise FormatError(
            f"{too_large} (a hostile or corrupt file)",
            path=where,
            fix="Trim its log_history (or the largest list in it), or restore it from a good "
            "copy of the checkpoint.",
        )
    try:
        doc = json.loads(source.storage.read_all(rel))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"is not valid JSON ({exc})", path=where, fix=_JSON_FIX) from None
    except RecursionError:
        raise FormatError("nests too deeply to be read", path=where, fix=_JSON_FIX) from None
    if not isinstance(doc, dict):
        raise FormatError("is not a JSON object", path=where, fix=_JSON_FIX)
    entries: list[Entry] = []
    leaves: dict[str, Any] = {}
    for path, value in _flatten_json(doc):
        if len(entries) >= MAX_LEAVES:
            # the torch.save flattening's budget: each entry costs ~1 KiB, so a 6.6 MB
            # `trainer_state.json` of 300,000 log rows took 1.3 GB
            raise FormatError(
                f"holds more than {MAX_LEAVES:,} values, past what ckpt reads of one file",
                path=where,
                fix="Trim its log_history (or the largest list in it) and run again.",
            )
        name = ".".join(str(key) for _, key in path)
        base, n = name, 1
        while name in leaves:  # {"a.b": 1, "a": {"b": 2}}
            name, n = f"{base}~{n}", n + 1
        leaves[name] = value
        scalar = value is None or isinstance(value, (bool, int, float, str))
        # a log's size as `convert --to torch` writes it (pickled): 0.2 s for 300,000 rows,
        # where dumping it as JSON again took 1 s
        log = is_log(path[-1][1], value)
        nbytes = len(pickle.dumps(value, protocol=4)) if log else len(json.dumps(value))
        entries.append(
            TorchEntry.of(
                {
                    "name": name,
                    "kind": "object",
                    "dtype": None,
                    "shape": [],
                    "nbytes": nbytes,
                    "file": rel,
                    "offset": None,
                    "chunks": None,
                    "py_type": type(value).__name__,
                    "value": value if scalar else None,
                },
                path,
            )
        )
    manifest = Manifest(
        format="json",
        location=source.location.raw,
        files=[FileInfo(path=rel, size=source.storage.size(rel), entries=len(entries))],
        entries=entries,
    )
    return ObjectsCheckpoint(source, manifest, {str(k): v for k, v in doc.items()}, leaves)


class CompositeCheckpoint(Checkpoint):
    """Several component checkpoints of one folder read as one; see the module docstring.

    Attributes:
        components: component name -> its opened checkpoint.
        layout: the training layout recognised.
    """

    def __init__(
        self,
        source: Source,
        components: dict[str, Checkpoint],
        layout: str,
        other_files: list[FileInfo],
        subfolders: dict[str, str] | None = None,
        wrappers: dict[str, str] | None = None,
        padding: dict[str, list[tuple[int, int]]] | None = None,
        root: str | None = None,
    ):
        """`root`: the component whose entries keep their own names, unprefixed (a legacy
        Megatron-LM rank folder's `model_optim_rng.pt`, read as it is read alone, beside its
        `distrib_optim.pt`)."""
        from ...formats.torch.format import TorchEntry

        subfolders = subfolders or {}
        wrappers = wrappers or {}
        #: entry name -> flat element ranges that are the layout's padding (`padding`)
        self._padding = padding or {}

        self.components = components
        self.layout = layout
        #: component -> the subfolder it lives in (`pytorch_model_fsdp_0/`), root ones absent
        self.subfolders = dict(subfolders)
        self._route: dict[str, tuple[Checkpoint, str]] = {}
        entries: list[Entry] = []
        files: list[FileInfo] = []
        formats: dict[str, str] = {}
        for comp, checkpoint in components.items():
            formats[comp] = checkpoint.manifest.format
            # a component in a subfolder (an FSDP DCP folder): file names relative to the root
            sub = subfolders.get(comp, "")
            files.extend(
                f.model_copy(update={"path": f"{sub}{f.path}"}) for f in checkpoint.manifest.files
            )
            # DCP components saved as {"model": ...} would read `model.model.x`: drop the wrapper
            wrapper = wrappers.get(comp, "")
            for entry in checkpoint.manifest.entries:
                short = entry.name[len(wrapper) :] if wrapper else entry.name
                name = f"{comp}.{short}" if short else comp
                inner = entry.saved_keys()
                if wrapper:  # the wrapper's own step goes with its name
                    inner = inner[1:] if inner and f"{inner[0][1]}." == wrapper else ()
                inner = inner or ((("dict", short),) if short else ())
                if comp == root:
                    name, inner = entry.name, entry.saved_keys() or (("dict", entry.name),)
                fields = {k: getattr(entry, k) for k in Entry.model_fields}
                fields["name"] = name
                if sub:
                    fields["file"] = f"{sub}{entry.file}" if entry.file else None
                    if entry.chunks:
                        fields["chunks"] = [replace(c, file=f"{sub}{c.file}") for c in entry.chunks]
                # the key path lets the torch writer rebuild {"model": {...}, "optimizer": {...}}
                path = inner if comp == root else (("dict", comp), *inner)
                entries.append(TorchEntry.of(fields, path))
                self._route[name] = (checkpoint, entry.name)
        files.extend(other_files)
        manifest = Manifest(
            format="composite",
            location=source.location.raw,
            files=files,
            entries=entries,
            details=CompositeDetails(layout=layout, components=formats).as_details(),
        )
        super().__init__(source, manifest)

    def _target(self, name: str) -> tuple[Checkpoint, str]:
        try:
            return self._route[name]
        except KeyError:
            raise NotFoundError(
                f"no entry named {name!r}", path=self.manifest.location, fix=NAMES_FIX
            ) from None

    def read_tensor(self, name: str) -> torch.Tensor:
        checkpoint, inner = self._target(name)
        return checkpoint.read_tensor(inner)

    def read_object(self, name: str) -> Any:
        checkpoint, inner = self._target(name)
        return checkpoint.read_object(inner)

    def read_slice(self, name: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        checkpoint, inner = self._target(name)
        return checkpoint.read_slice(inner, offsets, sizes)

    def iter_raw(self, name: str, block: int = 8 << 20) -> Iterator[bytes]:
        checkpoint, inner = self._target(name)
        return checkpoint.iter_raw(inner, block)

    def padding(self, name: str) -> list[tuple[int, int]]:
        if name in self._padding:
            return self._padding[name]
        checkpoint, inner = self._target(name)
        return checkpoint.padding(inner)

    def recorded_checksum_errors(self) -> Iterator[RecordedDamage]:
        """Each component's own (its torch.save zips as torch's reader reads them, its DCP
        blobs), its entries named as this folder names them."""
        names = {(id(checkpoint), inner): name for name, (checkpoint, inner) in self._route.items()}
        seen: set[int] = set()
        for checkpoint in self.components.values():
            if id(checkpoint) in seen:
                continue
            seen.add(id(checkpoint))
            for damage in checkpoint.recorded_checksum_errors():
                tensor = damage.tensor
                if tensor is not None:
                    tensor = names.get((id(checkpoint), tensor), tensor)
                yield RecordedDamage(damage.error, tensor)

    def close(self) -> None:
        for checkpoint in self.components.values():
            checkpoint.close()


# --------------------------------------------------------------------------- folder layouts


#: accelerate's name of an FSDP model save (`accelerate.utils.constants.FSDP_MODEL_NAME`)
FSDP_MODEL = "pytorch_model_fsdp"
#: accelerate's per-rank torch.save files of FSDP (`accelerate.utils.fsdp_utils`): model i of
#: rank r under LOCAL_STATE_DICT (`pytorch_model_fsdp_rank{r}.bin` for model 0,
#: `pytorch_model_fsdp_{i}_rank{r}.bin` after), and under SHARDED_STATE_DICT with
#: `use_dcp=False` (`pytorch_model_fsdp_{i}_rank{r}.bin` for every i, 0 included); optimizer i
#: of rank r whenever the state is not FULL and `use_dcp=False` (`optimizer_{i}_rank{r}.bin`)
RANK_MODEL_FILE = re.compile(rf"{FSDP_MODEL}(?:_(\d+))?_rank(\d+)\.bin")
RANK_OPTIMIZER_FILE = re.compile(r"optimizer_(\d+)_rank(\d+)\.bin")


def rank_component(comp: str, index: int, rank: int) -> str:
    """The component of object `index`'s state on rank `rank` (a per-rank FSDP file):
    `model_rank0`, `model_1_rank1`, `optimizer_rank0`..."""
    return f"{numbered(comp, index)}_rank{rank}"


def numbered(comp: str, index: int) -> str:
    """The component of object `index` (the i-th model, optimizer...): `comp`, then `comp_1`..."""
    return comp if index == 0 else f"{comp}_{index}"


class Folder:
    """Opens the components of a training folder, collecting what cannot be read."""

    def __init__(self, source: Source, base: str = ""):
        self.source = source
        self.base = base
        self.components: dict[str, Checkpoint] = {}
        self.unreadable: dict[str, str] = {}
        self.problems: list[Problem] = []
        #: component -> (file, problem) of the components that could not be read
        self.unreadable_parts: dict[str, tuple[str, str]] = {}
        self.used: set[str] = set()
        self.parts: dict[str, tuple[str, str]] = {}
        self.subfolders: dict[str, str] = {}
        #: components present but deliberately not loaded: component -> description
        self.listed: dict[str, str] = {}
        #: their files: file -> why it is not loaded (what `convert` reports as skipped)
        self.listed_files: dict[str, str] = {}
        #: component -> its file, for the listed components that are a file of their own
        self.listed_parts: dict[str, str] = {}
        self.wrappers: dict[str, str] = {}
        #: entry name -> flat ranges that are padding, not data (ZeRO partitions)
        self.padding: dict[str, list[tuple[int, int]]] = {}
        self.names = {
            n[len(base) :] for n in source.files if n.startswith(base) and "/" not in n[len(base) :]
        }

    def rel(self, name: str) -> str:
        return f"{self.base}{name}"

    def has(self, name: str) -> bool:
        return name in self.names

    def matching(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        return sorted(n for n in self.names if regex.fullmatch(n))

    def add(
        self,
        comp: str,
        name: str,
        fmt: str,
        *,
        root: bool = False,
        unpickled_by: str | None = None,
    ) -> Checkpoint | None:
        """Open file `name` of the folder (under `base`; at the source's top with `root`: a
        Trainer's `rng_state_0.pth` beside DeepSpeed's `global_stepN/`) as component `comp`.

        `unpickled_by`: the framework loader that reads the file with torch's full unpickler
        (accelerate's `load_state` of a registered object's `custom_checkpoint_N.pkl`): a
        pickle asking for a class weights_only refuses (a `collections.deque`) is one the
        framework resumes from, so it is listed, never loaded (as `training_args.bin`), not
        called unreadable."""
        rel = name if root else self.rel(name)
        self.used.add(rel)
        sub = Source(location=self.source.location, storage=self.source.storage, target=rel)
        try:
            if fmt == "json":
                checkpoint: Checkpoint = json_component(sub, rel)
            else:
                checkpoint = get_format(fmt).open(sub)
        except CkptError as error:
            no_verdict(error)  # the store or the OS refused the read: no verdict on the file
            if unpickled_by is not None and isinstance(error, UnsafeInputError):
                self.list_file(
                    comp,
                    name,
                    f"{name} (not loaded)",
                    f"{error.problem}; {unpickled_by} unpickles it in full, so "
                    "the save resumes; ckpt never unpickles it: copy it by hand if wanted",
                )
                return None
            self._unreadable(rel, rel, error)
            self.unreadable_parts[comp] = (
                error.path or self.source.storage.describe(rel),
                error.problem,
            )
            return None
        self.used.update(f.path for f in checkpoint.manifest.files)
        self.components[comp] = checkpoint
        self.parts[comp] = (rel, fmt)
        return checkpoint

    def list_file(self, comp: str, name: str, shown: str, why: str) -> None:
        """File `name` of the folder (under `base`) as component `comp`, listed and never
        loaded: `shown` is what the components say of it, `why` what `convert` and `diff` say
        of the file (a pickle ckpt does not unpickle, which the framework resumes from)."""
        rel = self.rel(name)
        self.used.add(rel)
        self.listed[comp] = shown
        self.listed_files[rel] = why
        self.listed_parts[comp] = rel

    def _unreadable(self, key: str, rel: str, error: CkptError) -> None:
        """Record component `key` (file `rel`) as unreadable: its problem, and one finding."""
        self.unreadable[key] = error.problem
        self.problems.append(
            Problem(
                code="unreadable_component",
                message=error.stated,
                file=error.path or self.source.storage.describe(rel),
                fix=error.fix,
            )
        )

    def list_training_args(self, *, root: bool = False) -> None:
        """List `training_args.bin` (when the folder has one; at the source's top with `root`)
        as a component never loaded.

        It is a pickle of transformers' `TrainingArguments` dataclass, which the Trainer saves
        and many accelerate scripts save beside `save_state`'s files: weights_only refuses it
        and nothing else may unpickle it, so it is listed (files, components), never read."""
        rel = "training_args.bin" if root else self.rel("training_args.bin")
        if rel not in self.source.files:
            return
        self.listed["training_args"] = "training_args.bin (not loaded)"
        self.listed_files[rel] = (
            "a pickle of transformers' TrainingArguments: never unpickled (it would run "
            "transformers code) and not needed to resume; copy it by hand if wanted"
        )

    def has_dir(self, sub: str, marker: str = DCP_METADATA) -> bool:
        return f"{self.base}{sub}/{marker}" in self.source.files

    def add_dir(
        self, comp: str, sub: str, fmt: str, wrapper: str | None = None
    ) -> Checkpoint | None:
        """A component that is a folder of its own (an FSDP `pytorch_model_fsdp_0/` DCP).

        `wrapper`: the one top-level key its writer wrapped everything in (accelerate saves
        `{"model": ...}` and `{"optimizer": ...}`), dropped from the entry names; by default
        the component's own name."""
        rel = self.rel(sub)
        try:
            part = subfolder_source(self.source, rel)
            checkpoint = get_format(fmt).open(part)
        except CkptError as error:
            no_verdict(error)  # the store or the OS refused the read: no verdict on the folder
            self._unreadable(f"{rel}/", rel, error)
            self.unreadable_parts[comp] = (
                error.path or self.source.storage.describe(rel),
                error.problem,
            )
            return None
        self.used.update(n for n in self.source.files if n.startswith(f"{rel}/"))
        self.components[comp] = checkpoint
        self.parts[comp] = (f"{rel}/", fmt)
        self.subfolders[comp] = f"{rel}/"
        names = [e.name for e in checkpoint.manifest.entries]
        key = f"{wrapper or comp}."
        if names and all(n.startswith(key) for n in names):
            self.wrappers[comp] = key
        return checkpoint

    def add_model(self, stems: tuple[str, ...] = ("model", "pytorch_model")) -> str | None:
        """The model weights: a safetensors or bin index, or one file; returns its file."""
        for stem in stems:
            for name, fmt in (
                (f"{stem}{INDEX_SUFFIX}", "safetensors"),
                (f"{stem}.safetensors", "safetensors"),
                (f"{stem}.bin.index.json", "torch"),
                (f"{stem}.bin", "torch"),
            ):
                if self.has(name):
                    self.add("model", name, fmt)
                    return name
        for sub in ("pytorch_model_fsdp_0", "model_0"):
            if self.has_dir(sub):
                self.add_dir("model", sub, "dcp")
                return f"{sub}/"
        adapters = self.matching(r"adapter_model\.(safetensors|bin)")
        if adapters:
            name = adapters[0]
            self.add("model", name, weight_format(name) or "torch")
            return name
        return None

    def dirs_matching(self, pattern: str, marker: str = DCP_METADATA) -> list[tuple[str, int]]:
        """The subfolders (holding `marker`) whose name fully matches `pattern`, with the number
        its group 1 captures, in number order (`optimizer_0`, `optimizer_1`...)."""
        return self._subfolders(pattern, lambda file: file == marker)

    def dcp_dirs_matching(self, pattern: str) -> list[tuple[str, int]]:
        """`dirs_matching` for DCP folders, finished or not: those holding `.metadata`, and
        those holding data files (`.distcp`) without it, a save that did not finish (DCP
        writes `.metadata` last), which opening reports rather than leaving unseen."""
        return self._subfolders(
            pattern, lambda file: file == DCP_METADATA or file.endswith(DCP_DATA_SUFFIX)
        )

    def _subfolders(self, pattern: str, holds: Callable[[str], bool]) -> list[tuple[str, int]]:
        """The subfolders one of whose files `holds` says, whose name fully matches `pattern`,
        with the number its group 1 captures, in number order."""
        regex = re.compile(pattern)
        found: set[tuple[str, int]] = set()
        for name in self.source.files:
            rest = name[len(self.base) :] if name.startswith(self.base) else None
            if rest is None or rest.count("/") != 1:
                continue
            sub, file = rest.split("/", 1)
            match = regex.fullmatch(sub)
            if match and holds(file):
                found.add((sub, int(match.group(1))))
        return sorted(found, key=lambda item: item[1])

    def numbered_files(self, stem: str, suffix: str) -> list[tuple[str, int]]:
        """accelerate's numbering of the files of object i: `stem.suffix` for 0, then
        `stem_1.suffix`, `stem_2.suffix`... (`optimizer.bin`, `optimizer_1.bin`)."""
        found: list[tuple[str, int]] = []
        for name in self.matching(rf"{re.escape(stem)}(?:_(\d+))?{re.escape(suffix)}"):
            match = re.fullmatch(rf"{re.escape(stem)}(?:_(\d+))?{re.escape(suffix)}", name)
            assert match is not None
            found.append((name, int(match.group(1) or 0)))
        return sorted(found, key=lambda item: item[1])

    def add_fsdp(self, model: str = "model") -> None:
        """accelerate's FSDP saves of every model and optimizer (`save_fsdp_model`,
        `save_fsdp_optimizer`), as components `model`, `model_1`... and `optimizer`,
        `optimizer_1`... (index i: the i-th prepared model / optimizer).

        SHARDED_STATE_DICT writes DCP folders `pytorch_model_fsdp_{i}/` (`{"model": ...}`) and
        `optimizer_{i}/` (`{"optimizer": ...}`), every rank its own `__r_0.distcp`;
        FULL_STATE_DICT writes rank 0's torch.save `pytorch_model_fsdp.bin` and `optimizer.bin`
        (`_{i}` from the second on). A component already taken (a Trainer's `model.safetensors`
        beside its `pytorch_model_fsdp.bin`) makes the FSDP copy `fsdp_<name>`.
        LOCAL_STATE_DICT, and SHARDED_STATE_DICT with `use_dcp=False`, write one torch.save file
        per rank (`RANK_MODEL_FILE`, `RANK_OPTIMIZER_FILE`): each is a component of its own,
        `model_rank{r}`, `model_1_rank{r}`..., `optimizer_rank{r}`, `optimizer_1_rank{r}`...
        (`rank_component`), read as the rank saved it (its shard; nothing merges them).
        """

        def free(comp: str) -> str:
            taken = comp in self.components or comp in self.unreadable_parts
            return f"fsdp_{comp}" if taken else comp

        # `add_model` may have taken model 0, or found it unreadable (said once)
        added = {rel for rel, _ in self.parts.values()} | set(self.unreadable)
        for sub, i in self.dcp_dirs_matching(rf"{FSDP_MODEL}_(\d+)"):
            if f"{self.rel(sub)}/" not in added:  # `add_model` may have taken model 0
                self.add_dir(free(numbered(model, i)), sub, "dcp", wrapper="model")
        for name, i in self.numbered_files(FSDP_MODEL, ".bin"):
            if self.rel(name) not in added:
                self.add(free(numbered(model, i)), name, "torch")
        for sub, i in self.dcp_dirs_matching(r"optimizer_(\d+)"):
            if f"{self.rel(sub)}/" not in added:
                self.add_dir(free(numbered("optimizer", i)), sub, "dcp", wrapper="optimizer")
        for comp, regex in ((model, RANK_MODEL_FILE), ("optimizer", RANK_OPTIMIZER_FILE)):
            for name in self.matching(regex.pattern):
                match = regex.fullmatch(name)
                assert match is not None
                index, rank = int(match.group(1) or 0), int(match.group(2))
                self.add(rank_component(comp, index, rank), name, "torch")

    def add_many(
        self,
        comp: str,
        files: list[str],
        fmt: str,
        index: str = r"_(\d+)\.",
        *,
        root: bool = False,
        several: bool = False,
    ) -> None:
        """One component per file (`rng_state_0.pth`...): `comp`, or `comp_N` when several,
        or when `several` says more were saved than are here (a multi-process save that lost
        all but one rank's file keeps that rank's number: `rng_1`, never `rng`) (`root`: the
        files are at the source's top, as in `add`)."""
        for name in files:
            match = re.search(index, name)
            key = f"{comp}_{match.group(1)}" if match and (len(files) > 1 or several) else comp
            self.add(key, name, fmt, root=root)

    def composite(self, layout: str, root: str | None = None) -> CompositeCheckpoint:
        """The folder's components as one checkpoint (`root`: the component whose entries
        keep their own names, see `CompositeCheckpoint`)."""
        other = [
            FileInfo(path=rel, size=size, entries=0)
            for rel, size in self.source.files.items()
            if rel not in self.used and rel not in self.unreadable
        ]
        other += [
            FileInfo(path=rel, size=self.source.files.get(rel), entries=0)
            for rel in sorted(self.unreadable)
        ]
        return CompositeCheckpoint(
            self.source,
            self.components,
            layout,
            other,
            self.subfolders,
            self.wrappers,
            self.padding,
            root,
        )


def component_files(folder: Folder) -> dict[str, str]:
    out = {}
    for comp, checkpoint in folder.components.items():
        paths = [f.path for f in checkpoint.manifest.files]
        if not paths:
            continue  # a virtual component (ZeRO weights): described in `listed`
        sub = folder.subfolders.get(comp)
        if sub is not None:
            # a DCP folder of its own (FSDP): named by the folder, not by its `.metadata`
            fmt = checkpoint.manifest.format
            out[comp] = f"{sub} ({fmt}, {len(paths)} file{'s' if len(paths) != 1 else ''})"
            continue
        out[comp] = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"
    out.update(folder.listed)
    for rel, why in folder.unreadable.items():
        out[rel] = f"unreadable: {why}"
    return out


def trainer_progress(folder: Folder, state: TrainingState) -> None:
    """Step, epoch and data position from a Hugging Face Trainer's `trainer_state.json` (the
    folder's `trainer_state` component, if it has one): the Trainer reproduces its data order
    from the seed and skips the batches of `global_step` optimizer steps when it resumes,
    `gradient_accumulation_steps` batches each (`_init_training_state`; the value is read
    from `training_args.bin`'s opcodes, 1 without one)."""
    trainer = folder.components.get("trainer_state")
    if not isinstance(trainer, ObjectsCheckpoint):
        return
    values = trainer.values
    step, epoch = values.get("global_step"), values.get("epoch")
    if isinstance(step, int) and not isinstance(step, bool):
        state.step = step
    if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
        state.epoch = float(epoch)
    if state.step is None:
        return
    args = _trainer_args(folder)
    mid_epoch = state.epoch is not None and not state.epoch.is_integer()
    if args.get("ignore_data_skip") is True and mid_epoch:
        # `_init_training_state` skips no batch then: the resumed run starts the epoch over
        state.dataloader = {
            "kind": "not replayed",
            "ignore_data_skip": True,
            "reason": "training_args.bin says ignore_data_skip=True: the Trainer resumes "
            "this mid-epoch save at the epoch's first batch, not past the batches trained on",
        }
        return
    accumulated = args.get("gradient_accumulation_steps")
    if not isinstance(accumulated, int) or isinstance(accumulated, bool) or accumulated < 1:
        accumulated = 1
    state.dataloader = {"kind": "replayed", "skips_batches": state.step * accumulated}


def _trainer_args(folder: Folder) -> dict[str, Any]:
    """What a Trainer save's resume depends on in its `training_args.bin`
    (`gradient_accumulation_steps`: batches per optimizer step; `ignore_data_skip`), read from
    its opcodes; empty when that file is absent or does not say."""
    if not folder.has("training_args.bin"):
        return {}
    keys = ("gradient_accumulation_steps", "ignore_data_skip")
    return training_arg_values(folder.source, folder.rel("training_args.bin"), keys)


def component_prefixes(checkpoint: CompositeCheckpoint) -> dict[str, str]:
    out = {}
    for comp in checkpoint.components:
        if comp in ("model", "optimizer", "scheduler", "dataloader", "sampler", "scaler"):
            out[comp] = f"{comp}."
    rng = [c for c in checkpoint.components if c == "rng" or c.startswith("rng_")]
    if rng:
        out["rng"] = f"{rng[0]}."
    if "sampler" in out and "dataloader" not in out:
        out["dataloader"] = out["sampler"]
    return out


def subfolder_source(source: Source, rel: str) -> Source:
    """A component folder of `source` (an FSDP `pytorch_model_fsdp_0/` DCP) as its own source.

    One per folder and `source`, kept in `source.parsed`: `verify` opens a training folder and
    checks its components, and both then share the component's listing and parsed metadata.
    """
    key = ("subfolder", rel, 0)
    known = source.parsed.get(key)
    if isinstance(known, Source):
        return known
    storage = source.storage.subfolder(rel)
    part = source.parsed[key] = Source(location=parse_location(storage.display), storage=storage)
    return part
