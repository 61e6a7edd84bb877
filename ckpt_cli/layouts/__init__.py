"""Open any SRC: a plain checkpoint of one format, or a training layout built on top of them.

`open_source` is what inspect, verify, convert and diff call. It returns the checkpoint to read
entries from and, when the source is (or contains) a resumable training checkpoint, the
`TrainingState` describing it.

Layouts recognised (from file names, then from the keys of the loaded objects):

| layout | what it is |
|---|---|
| `hf-trainer` | Hugging Face Trainer `checkpoint-N/`: model weights, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `trainer_state.json`, `training_args.bin` |
| `accelerate` | `Accelerator.save_state` folders: `model.safetensors`, `optimizer.bin`, `scheduler.bin`, `sampler.bin`, `random_states_N.pkl`, `custom_checkpoint_N.pkl` |
| `deepspeed` | `global_stepN/` (`mp_rank_00_model_states.pt`, `*_optim_states.pt`), or its parent with `latest` |
| `torchtitan` | DCP folders with `optimizer.` / `lr_scheduler.` / `dataloader.` / `train_state.` keys beside the model's top-level keys (0.3), or `model.` (older) |
| `diffusers-pipeline` / `sentence-transformers` | `model_index.json` / `modules.json` folders: one composite of their components (`ckpt_cli.layouts.model_folders`) |
| `lightning` | a Lightning `.ckpt`: `state_dict`, `optimizer_states`, `lr_schedulers`, `epoch`, `global_step`, `loops` |
| `torch-dict` | a torch.save dict with model / optimizer / scheduler / step / rng keys |

Composite naming: a folder of several files opens as one `CompositeCheckpoint` whose entry
names are `<component>.<name inside the component>`: `model.lm_head.weight`,
`optimizer.state.0.exp_avg`, `scheduler.last_epoch`, `rng.python`, `trainer_state.global_step`.
This is the very naming a flattened `torch.save({"model": ..., "optimizer": ...})` dict and a
torchtitan DCP checkpoint already have, so `diff` lines a Trainer folder up with a plain torch
dict, and `convert --select model` extracts the weights of any of them. `TrainingState.prefixes`
gives each component's prefix (`state_dict.` for the weights inside a Lightning file).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CkptError, FormatError, NotFoundError
from ..formats import get_format, open_checkpoint, resolve_source
from ..formats.base import Checkpoint, Source
from ..formats.safetensors import INDEX_SUFFIX
from ..models import Entry, FileInfo, Manifest, OptimizerState, Problem, TrainingState
from ..storage import safe_relpath
from ..uri import parse_location
from .model_folders import LayoutInfo

if TYPE_CHECKING:
    import torch

#: the components `resumable` needs, in the order they are reported
REQUIRED = ("weights", "optimizer", "scheduler", "step", "rng", "dataloader")


@dataclass
class OpenedSource:
    """A source opened for reading.

    Attributes:
        checkpoint: where entries are read from (a composite for multi-file training folders).
        training: the training state, when the layout holds one.
        problems: components that were found but could not be read (unsafe or corrupt files).
        parts: for a multi-file folder, component -> (its main file, its format token).
        unreadable: components found but not readable: component -> (where, the problem);
            a command that writes the checkpoint must not drop them silently.
    """

    checkpoint: Checkpoint
    training: TrainingState | None = None
    problems: list[Problem] = field(default_factory=list)
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the library layout of a model folder (PEFT adapter, diffusers pipeline...), if any
    layout: LayoutInfo | None = None
    unreadable: dict[str, tuple[str, str]] = field(default_factory=dict)


# --------------------------------------------------------------------------- checkpoints


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
        raise FormatError(f"entry {name!r} is not a tensor", path=self.manifest.location)

    def read_object(self, name: str) -> Any:
        if name not in self.leaves:
            raise NotFoundError(f"no entry named {name!r}", path=self.manifest.location)
        return json.loads(json.dumps(self.leaves[name]))  # a copy callers may change


def _json_container(node: Any) -> str | None:
    """How a JSON value is flattened; the rules of `torch_save.flatten` (dicts with keys, lists
    holding a dict at any depth are containers; other lists are one value), so a JSON
    component and the same values after `convert --to torch` have the same entry names."""
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
    stack: list[tuple[tuple[tuple[str, Any], ...], Any]] = [
        ((("dict", str(k)),), v) for k, v in reversed(list(doc.items()))
    ]
    while stack:
        path, node = stack.pop()
        kind = _json_container(node)
        if kind is None:
            yield path, node
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = [((*path, (kind, key)), value) for key, value in items]
        stack.extend(reversed(children))


def json_component(source: Source, rel: str) -> ObjectsCheckpoint:
    """A JSON file (`trainer_state.json`) as object entries, flattened like a torch.save dict
    (`log_history.0.loss`), each entry remembering its key path for the torch writer."""
    from ..formats.torch_save import TorchEntry

    where = source.storage.describe(rel)
    try:
        doc = json.loads(source.storage.read_all(rel))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"is not valid JSON ({exc})", path=where) from None
    except RecursionError:
        raise FormatError("nests too deeply to be read", path=where) from None
    if not isinstance(doc, dict):
        raise FormatError("is not a JSON object", path=where)
    entries: list[Entry] = []
    leaves: dict[str, Any] = {}
    for path, value in _flatten_json(doc):
        name = ".".join(str(key) for _, key in path)
        base, n = name, 1
        while name in leaves:  # {"a.b": 1, "a": {"b": 2}}
            name, n = f"{base}~{n}", n + 1
        leaves[name] = value
        scalar = value is None or isinstance(value, (bool, int, float, str))
        entries.append(
            TorchEntry.model_construct(
                name=name,
                kind="object",
                dtype=None,
                shape=[],
                nbytes=len(json.dumps(value)),
                file=rel,
                offset=None,
                chunks=None,
                py_type=type(value).__name__,
                value=value if scalar else None,
                key_path=path,
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
    ):
        from ..formats.torch_save import TorchEntry

        subfolders = subfolders or {}
        wrappers = wrappers or {}

        self.components = components
        self.layout = layout
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
                inner = (None if wrapper else getattr(entry, "key_path", None)) or (
                    (("dict", short),) if short else ()
                )
                fields = {k: getattr(entry, k) for k in Entry.model_fields}
                fields["name"] = name
                if sub:
                    fields["file"] = f"{sub}{entry.file}" if entry.file else None
                    if entry.chunks:
                        fields["chunks"] = [
                            c.model_copy(update={"file": f"{sub}{c.file}"}) for c in entry.chunks
                        ]
                # the key path lets the torch writer rebuild {"model": {...}, "optimizer": {...}}
                entries.append(
                    TorchEntry.model_construct(**fields, key_path=(("dict", comp), *inner))
                )
                self._route[name] = (checkpoint, entry.name)
        files.extend(other_files)
        manifest = Manifest(
            format="composite",
            location=source.location.raw,
            files=files,
            entries=entries,
            details={"layout": layout, "components": formats},
        )
        super().__init__(source, manifest)

    def _target(self, name: str) -> tuple[Checkpoint, str]:
        try:
            return self._route[name]
        except KeyError:
            raise NotFoundError(f"no entry named {name!r}", path=self.manifest.location) from None

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

    def close(self) -> None:
        for checkpoint in self.components.values():
            checkpoint.close()


# --------------------------------------------------------------------------- folder layouts


class _Folder:
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
        self.wrappers: dict[str, str] = {}
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

    def add(self, comp: str, name: str, fmt: str) -> Checkpoint | None:
        rel = self.rel(name)
        self.used.add(rel)
        sub = Source(location=self.source.location, storage=self.source.storage, target=rel)
        try:
            if fmt == "json":
                checkpoint: Checkpoint = json_component(sub, rel)
            else:
                checkpoint = get_format(fmt).open(sub)
        except CkptError as error:
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

    def _unreadable(self, key: str, rel: str, error: CkptError) -> None:
        """Record component `key` (file `rel`) as unreadable: its problem, and one finding."""
        self.unreadable[key] = error.problem
        self.problems.append(
            Problem(
                code="unreadable_component",
                message=error.message,
                file=error.path or self.source.storage.describe(rel),
            )
        )

    def has_dir(self, sub: str, marker: str = ".metadata") -> bool:
        return f"{self.base}{sub}/{marker}" in self.source.files

    def add_dir(self, comp: str, sub: str, fmt: str) -> Checkpoint | None:
        """A component that is a folder of its own (an FSDP `pytorch_model_fsdp_0/` DCP)."""
        rel = self.rel(sub)
        try:
            part = subfolder_source(self.source, rel)
            checkpoint = get_format(fmt).open(part)
        except CkptError as error:
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
        if names and all(n.startswith(f"{comp}.") for n in names):
            self.wrappers[comp] = f"{comp}."
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
            self.add("model", name, "safetensors" if name.endswith(".safetensors") else "torch")
            return name
        return None

    def add_many(self, comp: str, files: list[str], fmt: str, index: str = r"_(\d+)\.") -> None:
        """One component per file (`rng_state_0.pth`...): `comp`, or `comp_N` when several."""
        for name in files:
            match = re.search(index, name)
            key = f"{comp}_{match.group(1)}" if match and len(files) > 1 else comp
            self.add(key, name, fmt)

    def composite(self, layout: str) -> CompositeCheckpoint:
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
            self.source, self.components, layout, other, self.subfolders, self.wrappers
        )


def _trainer(source: Source) -> OpenedSource | None:
    folder = _Folder(source)
    markers = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "training_args.bin")
    rng = folder.matching(r"rng_state(_\d+)?\.pth")
    if not (any(folder.has(m) for m in markers) or rng):
        return None
    model_file = folder.add_model()
    for comp, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt")):
        if folder.has(name):
            folder.add(comp, name, "torch")
    if "optimizer" not in folder.components and folder.has_dir("optimizer_0"):
        folder.add_dir("optimizer", "optimizer_0", "dcp")  # FSDP sharded optimizer state
    if folder.has("scaler.pt"):
        folder.add("scaler", "scaler.pt", "torch")
    folder.add_many("rng", rng, "torch")
    if folder.has("trainer_state.json"):
        folder.add("trainer_state", "trainer_state.json", "json")
    if folder.has("training_args.bin"):
        # a pickle of transformers' TrainingArguments dataclass: weights_only refuses it and
        # nothing else may unpickle it, so it is listed (files, components) and never read
        folder.listed["training_args"] = "training_args.bin (not loaded)"
    folder.problems.extend(_trainer_missing(source, folder))
    checkpoint = folder.composite("hf-trainer")
    state = _analyse(checkpoint, "hf-trainer", _prefixes(checkpoint))
    state.components = _component_files(folder)
    if model_file is None:
        state.components.pop("model", None)
    trainer = folder.components.get("trainer_state")
    if trainer is not None:
        values = getattr(trainer, "values", {})
        if isinstance(values.get("global_step"), int):
            state.step = values["global_step"]
        if isinstance(values.get("epoch"), (int, float)):
            state.epoch = float(values["epoch"])
        # the Trainer reproduces the data order from its seed and skips `global_step` batches
        if state.step is not None:
            state.dataloader = {"kind": "replayed", "skips_batches": state.step}
    return _finish(checkpoint, state, folder)


#: what a Trainer saves beside the weights unless `save_only_model` is set
_TRAINER_STATE_FILES = ("optimizer.pt", "scheduler.pt")


def _save_only_model(source: Source, rel: str) -> bool | None:
    """`save_only_model` from `training_args.bin`, read from the pickle's opcodes alone.

    The file is a torch.save zip of transformers' `TrainingArguments`; nothing in it is ever
    unpickled (it would import and run transformers code). Its `data.pkl` stores the dataclass
    fields as key, value pairs, so the opcode after the `save_only_model` string is the value.
    """
    import io
    import pickletools
    import zipfile

    size = source.storage.size(rel)
    if size > 16 << 20:
        return None
    data = source.storage.read_all(rel)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if member is None or archive.getinfo(member).file_size > 16 << 20:
                return None
            data = archive.read(member)
    except zipfile.BadZipFile:
        pass  # an old-style (non-zip) torch.save: the pickle itself
    try:
        ops = list(pickletools.genops(data))
    except Exception:
        return None
    # the memo bookkeeping between a key and its value carries no data
    ops = [op for op in ops if op[0].name not in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE")]
    for (_, arg, _), (op, _, _) in itertools.pairwise(ops):
        if arg == "save_only_model":
            if op.name == "NEWTRUE":
                return True
            if op.name == "NEWFALSE":
                return False
            return None
    return None


def _trainer_missing(source: Source, folder: _Folder) -> list[Problem]:
    """Optimizer / scheduler files a Trainer checkpoint should have but lacks, when its own
    training arguments (`save_only_model` false) or its sibling checkpoints say so."""
    if folder.has_dir("optimizer_0") or any(n.startswith("global_step") for n in source.files):
        return []  # FSDP or DeepSpeed state: saved in another shape
    missing = [n for n in _TRAINER_STATE_FILES if not folder.has(n)]
    if not missing:
        return []
    from ..runs import SLIM_RECORD

    if folder.has(SLIM_RECORD):
        return []  # `ckpt prune --slim-older-than` removed them on purpose: a weights-only save
    reasons: dict[str, str] = {}
    if folder.has("training_args.bin"):
        only_model = _save_only_model(source, "training_args.bin")
        if only_model is False:
            for name in missing:
                reasons[name] = "training_args.bin says save_only_model=False"
        elif only_model is True:
            return []
    loc = source.location
    if loc.is_local and loc.path is not None:
        here = loc.path.resolve()
        siblings = sorted(
            p
            for p in here.parent.glob("checkpoint-*")
            if p.is_dir() and p != here and re.fullmatch(r"checkpoint-\d+", p.name)
        )
        for name in missing:
            having = [p.name for p in siblings if (p / name).is_file()]
            if having and name not in reasons:
                reasons[name] = f"the sibling checkpoint {having[-1]} has one"
    where = loc.raw
    return [
        Problem(
            code="missing_component",
            message=f"{where}: {name} is missing, but {why}; this checkpoint cannot resume "
            "training where it stopped",
            file=source.storage.describe(name),
        )
        for name, why in reasons.items()
    ]


def _accelerate(source: Source) -> OpenedSource | None:
    folder = _Folder(source)
    rng = folder.matching(r"random_states_\d+\.pkl")
    optim = folder.matching(r"optimizer(_\d+)?\.bin")
    if not (rng or optim or folder.has("scheduler.bin")):
        return None
    folder.add_model()
    for comp, files in (
        ("optimizer", optim),
        ("scheduler", folder.matching(r"scheduler(_\d+)?\.bin")),
        ("sampler", folder.matching(r"sampler(_\d+)?\.bin")),
        ("dataloader", folder.matching(r"dl_state_dict(_\d+)?\.bin")),
    ):
        folder.add_many(comp, files, "torch")
    if folder.has("scaler.pt"):
        folder.add("scaler", "scaler.pt", "torch")
    folder.add_many("rng", rng, "torch")
    for name in folder.matching(r"custom_checkpoint_\d+\.pkl"):
        number = re.findall(r"\d+", name)[-1]
        folder.add(f"custom_{number}", name, "torch")
    checkpoint = folder.composite("accelerate")
    state = _analyse(checkpoint, "accelerate", _prefixes(checkpoint))
    state.components = _component_files(folder)
    for name in ("rng", *(c for c in folder.components if c.startswith("rng_"))):
        step = _value(checkpoint, f"{name}.step")
        if isinstance(step, int):
            state.step = step
            break
    if state.step is None:
        match = re.search(r"(\d+)$", source.location.raw.rstrip("/"))
        if match:
            state.step = int(match.group(1))
    return _finish(checkpoint, state, folder)


_DS_MODEL = re.compile(r"mp_rank_\d+_model_states\.pt$")


def _deepspeed(source: Source) -> OpenedSource | None:
    top = {n for n in source.files if "/" not in n}
    base = ""
    if "latest" in top:
        # a tag name is short; never read more than a few KB of whatever `latest` holds
        size = min(source.storage.size("latest"), 4096)
        tag = source.storage.read("latest", 0, size).decode("utf-8", "replace").strip()
        tag = safe_relpath(tag, source=source.storage.describe("latest"))
        base = f"{tag}/"
        if not any(n.startswith(base) for n in source.files):
            if not any(_DS_MODEL.search(n) for n in source.files):
                return None  # some other tool's `latest` file
            raise NotFoundError(
                f"`latest` names {tag!r}, which is missing",
                path=source.storage.describe("latest"),
                fix="The save was interrupted or the folder was pruned; point at another tag.",
            )
    folder = _Folder(source, base)
    models = folder.matching(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")
    if not models:
        return None
    if "latest" in top:
        folder.used.add("latest")
    folder.add("model_states", models[0], "torch")
    for extra in models[1:]:
        folder.add(extra.removesuffix(".pt"), extra, "torch")
    optim = folder.matching(r".*optim_states\.pt")
    folder.add_many("optim_states", optim, "torch", index=r"rank_(\d+)_")
    from .zero import zero_partitions

    # ZeRO: every rank's partition must be there; the fp32 weights are rebuilt from them
    zero = zero_partitions(source, base, folder.parts, folder.components)
    if zero is not None:
        folder.problems.extend(zero.problems)
        if zero.weights is not None:
            folder.components["model"] = zero.weights
            folder.listed["model"] = (
                f"fp32 weights rebuilt from {zero.weights.world_size} "
                f"ZeRO-{zero.weights.stage} partitions"
            )
    checkpoint = folder.composite("deepspeed")
    names = checkpoint.manifest.by_name
    rebuilt = zero is not None and zero.weights is not None
    prefixes: dict[str, str] = {"model": "model." if rebuilt else "model_states.module."}
    if any(n.startswith("model_states.optimizer.state.") for n in names):
        prefixes["optimizer"] = "model_states.optimizer."
    else:
        for comp in folder.components:
            if comp.startswith("optim_states"):
                # ZeRO keeps the wrapped optimizer's state (over flat partitions) one level down
                # ZeRO-1/2 keep the wrapped optimizer's state under `base_optimizer_state`,
                # ZeRO-3 under a second `optimizer_state_dict` (both over flat partitions)
                prefixes["optimizer"] = f"{comp}.optimizer_state_dict."
                for inner in ("base_optimizer_state.", "optimizer_state_dict."):
                    if any(
                        n.startswith(f"{comp}.optimizer_state_dict.{inner}state.") for n in names
                    ):
                        prefixes["optimizer"] = f"{comp}.optimizer_state_dict.{inner}"
                        break
                break
    if any(n.startswith("model_states.lr_scheduler.") for n in names):
        prefixes["scheduler"] = "model_states.lr_scheduler."
    for key in ("rng", "random_state", "rng_state"):
        if any(n.startswith(f"model_states.{key}.") for n in names):
            prefixes["rng"] = f"model_states.{key}."
    for key in ("dataloader", "data_loader", "sampler"):
        if any(n.startswith(f"model_states.{key}.") for n in names):
            prefixes["dataloader"] = f"model_states.{key}."
    state = _analyse(checkpoint, "deepspeed", prefixes)
    state.components = _component_files(folder)
    if any(c.startswith("optim_states") for c in folder.components) or any(
        rel.endswith("optim_states.pt") for rel in folder.unreadable
    ):
        state.components.setdefault(
            "optimizer", ", ".join(rel for rel in folder.used if rel.endswith("optim_states.pt"))
        )
    step = _value(checkpoint, "model_states.global_steps")
    if isinstance(step, int):
        state.step = step
    configured = _value(checkpoint, "model_states.ds_config.optimizer.type")
    if state.optimizer is not None and isinstance(configured, str):
        state.optimizer.kind = configured
    if not state.weights.get("tensors"):
        state.weights = _zero3_weights(checkpoint)
    return _finish(checkpoint, state, folder)


def _zero3_weights(checkpoint: Checkpoint) -> dict[str, int]:
    """ZeRO-3 keeps no weights in the model states: count them from `param_shapes` and the
    fp32 partitions the optimizer files hold (what `zero_to_fp32.py` reassembles)."""
    manifest = checkpoint.manifest
    shapes = [
        e.value
        for e in _under(manifest, "model_states.param_shapes.")
        if isinstance(e.value, list) and all(isinstance(d, int) for d in e.value)
    ]
    flat = [
        e
        for e in manifest.entries
        if e.kind == "tensor"
        and (".fp32_flat_groups." in e.name or ".single_partition_of_fp32_groups." in e.name)
    ]
    if not shapes or not flat:
        return {}
    parameters = 0
    for shape in shapes:
        count = 1
        for dim in shape:
            count *= dim
        parameters += count
    return {
        "tensors": len(shapes),
        "parameters": parameters,
        "bytes": sum(e.nbytes for e in flat),
    }


def _components(source: Source) -> OpenedSource | None:
    """A diffusers pipeline root or a sentence-transformers folder: one checkpoint of components.

    Each weight-holding component opens with its own format (`unet.` entries come from
    `unet/diffusion_pytorch_model.safetensors`); weightless ones (schedulers, tokenizers,
    pooling) are listed. The layout block reports every component with its totals.
    """
    from .model_folders import ComponentInfo, multi_folder

    found = multi_folder(source)
    if found is None:
        return None
    layout, components, details = found
    folder = _Folder(source)
    infos: list[ComponentInfo] = []
    for comp in components:
        info = ComponentInfo(name=comp.name, path=comp.path, kind=comp.kind)
        prefix = f"{comp.path}/" if comp.path else ""
        info.files = sorted(
            n for n in source.files if n.startswith(prefix) and (comp.path or "/" not in n)
        )
        if comp.weights is not None:
            fmt = "torch" if comp.weights.endswith((".bin", ".bin.index.json")) else "safetensors"
            checkpoint = folder.add(comp.name, comp.weights, fmt)
            if checkpoint is not None:
                manifest = checkpoint.manifest
                info.tensors = sum(1 for e in manifest.entries if e.kind == "tensor")
                info.parameters = manifest.parameters()
                info.bytes = manifest.tensor_bytes()
        infos.append(info)
    checkpoint = folder.composite(layout)
    weighted = [i for i in infos if i.tensors]
    label = details.get("pipeline") or "SentenceTransformer"
    description = (
        f"{label}: {len(infos)} components ({', '.join(i.name for i in infos)}), "
        f"{len(weighted)} with weights"
    )
    summary = LayoutInfo(layout=layout, description=description, details=details, components=infos)
    return OpenedSource(
        checkpoint=checkpoint,
        problems=list(folder.problems),
        parts=dict(folder.parts),
        layout=summary,
    )


def _component_files(folder: _Folder) -> dict[str, str]:
    out = {}
    for comp, checkpoint in folder.components.items():
        paths = [f.path for f in checkpoint.manifest.files]
        if not paths:
            continue  # a virtual component (ZeRO weights): described in `listed`
        out[comp] = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"
    out.update(folder.listed)
    for rel, why in folder.unreadable.items():
        out[rel] = f"unreadable: {why}"
    return out


def _prefixes(checkpoint: CompositeCheckpoint) -> dict[str, str]:
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


def _finish(
    checkpoint: Checkpoint, state: TrainingState, folder: _Folder | None = None
) -> OpenedSource:
    if folder is not None:
        state.unreadable = dict(folder.unreadable)
    _verdict(state)
    if folder is None:
        return OpenedSource(checkpoint=checkpoint, training=state)
    return OpenedSource(
        checkpoint=checkpoint,
        training=state,
        problems=list(folder.problems),
        parts=dict(folder.parts),
        unreadable=dict(folder.unreadable_parts),
    )


# --------------------------------------------------------------------------- analysis


def _value(checkpoint: Checkpoint, name: str) -> Any:
    """An object entry's value: from the manifest when it holds it, else read (None on error)."""
    entry = checkpoint.manifest.by_name.get(name)
    if entry is None:
        return None
    if entry.kind == "object" and entry.value is not None:
        return entry.value
    if entry.kind == "tensor" and entry.numel != 1:
        return None  # counters are scalars; never read a large tensor here
    try:
        if entry.kind == "tensor":
            return checkpoint.read_tensor(name).item()
        value = checkpoint.read_object(name)
    except CkptError:
        return None
    if entry.kind == "tensor" or hasattr(value, "item"):
        try:
            return value.item() if getattr(value, "numel", lambda: 1)() == 1 else value
        except (AttributeError, ValueError, RuntimeError):
            return value
    return value


def _under(manifest: Manifest, prefix: str) -> list[Entry]:
    return [e for e in manifest.entries if e.name.startswith(prefix)]


def _weights(manifest: Manifest, prefix: str) -> dict[str, int]:
    view = Manifest(format=manifest.format, location=manifest.location)
    view.entries = [e for e in _under(manifest, prefix) if e.kind == "tensor"]
    return {
        "tensors": len(view.entries),
        "parameters": view.parameters(),
        "bytes": view.tensor_bytes(),
    }


_OPTIMIZER_KINDS = (
    ({"exp_avg_sq_row"}, "Adafactor"),
    ({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, "Adam (amsgrad)"),
    ({"exp_avg", "exp_avg_sq"}, "Adam"),
    ({"acc_delta"}, "Adadelta"),
    ({"square_avg"}, "RMSprop"),
    ({"momentum_buffer"}, "SGD"),
    ({"sum"}, "Adagrad"),
    ({"exp_avg"}, "Lion"),
)


@dataclass
class _OptimizerView:
    """Per-parameter optimizer state as found: param id -> state name -> shape."""

    state: OptimizerState
    per_param: dict[str, dict[str, list[int]]]
    by_fqn: bool


def analyse_optimizer(checkpoint: Checkpoint, prefix: str) -> _OptimizerView | None:
    """Summarise a `torch.optim` state dict (int ids, or DCP's FQN-keyed flattening)."""
    manifest = checkpoint.manifest
    entries = _under(manifest, prefix)
    if not entries:
        return None
    state_prefix = f"{prefix}state."
    groups_prefix = f"{prefix}param_groups."
    per_param: dict[str, dict[str, list[int]]] = {}
    for e in entries:
        if e.name.startswith(state_prefix):
            rest = e.name[len(state_prefix) :]
            if "." not in rest:
                continue
            pid, state_name = rest.rsplit(".", 1)
            per_param.setdefault(pid, {})[state_name] = list(e.shape) if e.kind == "tensor" else []
    group_names = [e.name for e in entries if e.name.startswith(groups_prefix)]
    by_fqn = bool(per_param) and not all(pid.isdigit() for pid in per_param)
    params: int | None = None
    group_keys: dict[str, Any] = {}
    listed = [n for n in group_names if n.endswith(".params")]
    if listed:
        # param_groups is a list whose `params` name the parameters (ids, or FQNs in DCP)
        total = 0
        for name in group_names:
            if name.endswith(".params"):
                value = _value(checkpoint, name)
                if isinstance(value, (list, tuple)):
                    total += len(value)
            key = name.rsplit(".", 1)[-1]
            if key not in group_keys:
                group_keys[key] = _value(checkpoint, name) if key == "decoupled_weight_decay" else 1
        params = total
    elif group_names:
        fqns = {n[len(groups_prefix) :].rsplit(".", 1)[0] for n in group_names}
        params = len(fqns)
        for n in group_names:
            if n.endswith(".decoupled_weight_decay"):
                group_keys["decoupled_weight_decay"] = _value(checkpoint, n)
    names = sorted({s for states in per_param.values() for s in states})
    kind = None
    for needed, label in _OPTIMIZER_KINDS:
        if needed <= set(names):
            kind = label
            break
    if kind == "Adam" and group_keys.get("decoupled_weight_decay") is True:
        kind = "AdamW"
    full = set(names)
    with_state = sum(1 for states in per_param.values() if set(states) == full) if full else 0
    if params is None:
        params = len(per_param)
    complete = params > 0 and with_state == params and len(per_param) == params
    if not per_param and params and _stateless_sgd(checkpoint, groups_prefix, group_names):
        # SGD without momentum keeps no per-parameter state: nothing is missing
        kind, complete = "SGD", True
    return _OptimizerView(
        state=OptimizerState(
            kind=kind,
            states=names,
            params=params,
            params_with_state=with_state,
            complete=complete,
            source=prefix,
        ),
        per_param=per_param,
        by_fqn=by_fqn,
    )


def _stateless_sgd(checkpoint: Checkpoint, groups_prefix: str, group_names: list[str]) -> bool:
    momenta = [n for n in group_names if n.endswith(".momentum")]
    dampening = any(n.endswith(".dampening") for n in group_names)
    return bool(momenta) and dampening and all(_value(checkpoint, n) == 0 for n in momenta)


_SCHEDULERS = (
    ("_schedulers", "SequentialLR/ChainedScheduler"),
    ("lr_lambdas", "LambdaLR"),
    ("total_steps", "OneCycleLR"),
    ("T_max", "CosineAnnealingLR"),
    ("T_0", "CosineAnnealingWarmRestarts"),
    ("milestones", "MultiStepLR"),
    ("step_size", "StepLR"),
    ("total_iters", "LinearLR/ConstantLR/PolynomialLR"),
    ("gamma", "ExponentialLR"),
    ("patience", "ReduceLROnPlateau"),
)


def _scheduler(checkpoint: Checkpoint, prefix: str) -> dict[str, Any] | None:
    entries = _under(checkpoint.manifest, prefix)
    if not entries:
        return None
    keys = {e.name[len(prefix) :].split(".", 1)[0] for e in entries}
    summary: dict[str, Any] = {}
    for key, label in _SCHEDULERS:
        if key in keys:
            summary["kind"] = label
            break
    for key in ("last_epoch", "_step_count"):
        value = _value(checkpoint, f"{prefix}{key}")
        if isinstance(value, int):
            summary[key.lstrip("_")] = value
    last_lr = _value(checkpoint, f"{prefix}_last_lr")
    if isinstance(last_lr, list) and last_lr:
        summary["last_lr"] = last_lr[0] if len(last_lr) == 1 else last_lr
    if not summary:
        summary["entries"] = len(entries)
    return summary


_RNG_STREAMS = (
    (("python", "random_state"), "python"),
    (("numpy", "np_"), "numpy"),
    (("cuda",), "torch_cuda"),
    (("xpu",), "torch_xpu"),
    (("mps",), "torch_mps"),
    (("npu",), "torch_npu"),
    (("xm_", "xla"), "torch_xla"),
    (("cpu", "torch"), "torch_cpu"),
)


def _rng(manifest: Manifest, prefixes: list[str]) -> list[str]:
    found: list[str] = []
    for prefix in prefixes:
        for e in _under(manifest, prefix):
            key = e.name[len(prefix) :].split(".", 1)[0].lower()
            for needles, stream in _RNG_STREAMS:
                if any(n in key for n in needles):
                    if stream not in found:
                        found.append(stream)
                    break
    order = [s for _, s in _RNG_STREAMS]
    return sorted(found, key=order.index)


def _analyse(checkpoint: Checkpoint, layout: str, prefixes: dict[str, str]) -> TrainingState:
    manifest = checkpoint.manifest
    state = TrainingState(layout=layout, prefixes=dict(prefixes))
    if "model" in prefixes:
        state.weights = _weights(manifest, prefixes["model"])
    if "optimizer" in prefixes:
        view = analyse_optimizer(checkpoint, prefixes["optimizer"])
        state.optimizer = view.state if view else None
    if "scheduler" in prefixes:
        state.scheduler = _scheduler(checkpoint, prefixes["scheduler"])
    rng_prefixes = [prefixes["rng"]] if "rng" in prefixes else []
    if isinstance(checkpoint, CompositeCheckpoint):
        rng_prefixes += [
            f"{c}." for c in checkpoint.components if c == "rng" or c.startswith("rng_")
        ]
    state.rng = _rng(manifest, list(dict.fromkeys(rng_prefixes)))
    if "dataloader" in prefixes:
        entries = _under(manifest, prefixes["dataloader"])
        if entries:
            state.dataloader = {"entries": len(entries), "source": prefixes["dataloader"]}
    return state


def _verdict(state: TrainingState) -> None:
    """Two levels: `resumable` (training can continue: weights, optimizer, a progress counter)
    and `exact` (the resumed run is bit-identical: also scheduler, step, RNG, data loader).
    Lightning and torchtitan saves without RNG, or torch dicts without data-loader state, are
    resumable (their users resume from them every day), not exact."""
    missing = []
    if not state.weights.get("tensors"):
        missing.append("weights")
    if state.optimizer is None:
        missing.append("optimizer")
    elif not state.optimizer.complete:
        missing.append("optimizer state for every parameter")
    counted = state.step is not None or state.epoch is not None
    if not counted and not state.scheduler:
        missing.append("step")
    for rel, why in state.unreadable.items():
        missing.append(f"{rel} (unreadable: {why})")
    extra = []
    if not state.scheduler:
        extra.append("scheduler")
    if not counted and "step" not in missing:
        extra.append("step")
    if not state.rng:
        extra.append("rng")
    if not state.dataloader:
        extra.append("dataloader")
    state.missing = missing
    state.resumable = not missing
    state.missing_exact = extra
    state.exact = state.resumable and not extra


# --------------------------------------------------------------------------- single files


_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module", "net", "network")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state")
_SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched", "lr_schedule")
_STEP_KEYS = ("step", "global_step", "iteration", "iter", "steps", "train_step")
_RNG_KEYS = ("rng", "rng_state", "rng_states", "random_state", "random_states", "rng_state_dict")
_LOADER_KEYS = (
    "dataloader",
    "data_loader",
    "sampler",
    "dataloader_state",
    "train_loader",
    "data",
    "data_state",
)


def _top_keys(manifest: Manifest) -> dict[str, str]:
    """Top-level key -> the prefix of its entries (the real key, not the first dotted part)."""
    out: dict[str, str] = {}
    for e in manifest.entries:
        path = getattr(e, "key_path", None)
        key = str(path[0][1]) if path else e.name.split(".", 1)[0]
        if key not in out:
            out[key] = f"{key}." if e.name != key else key
    return out


def _first(keys: dict[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in keys:
            return name
    return None


def analyse_single(checkpoint: Checkpoint) -> TrainingState | None:
    """The training state of one torch.save file or DCP folder, None for plain weights."""
    manifest = checkpoint.manifest
    keys = _top_keys(manifest)
    if "state_dict" in keys and (
        "pytorch-lightning_version" in keys
        or "optimizer_states" in keys
        or ("loops" in keys and "global_step" in keys)
    ):
        return _lightning(checkpoint, keys)
    model = _first(keys, _MODEL_KEYS)
    optimizer = _first(keys, _OPTIMIZER_KEYS)
    scheduler = _first(keys, _SCHEDULER_KEYS)
    step = _first(keys, _STEP_KEYS)
    is_titan = manifest.format == "dcp" and "train_state" in keys
    if not (optimizer or scheduler or step or is_titan):
        return None
    prefixes: dict[str, str] = {}
    titan_model = titan_model_keys(manifest) if is_titan and not model else []
    if model:
        prefixes["model"] = f"{model}."
    elif titan_model:
        # torchtitan >= 0.2 saves the model's FQNs at the top level, beside its other states
        prefixes["model"] = ""
    if optimizer:
        prefixes["optimizer"] = f"{optimizer}."
    if scheduler:
        prefixes["scheduler"] = f"{scheduler}."
    rng = _first(keys, _RNG_KEYS)
    if rng:
        prefixes["rng"] = keys[rng]
    loader = _first(keys, _LOADER_KEYS)
    if loader:
        prefixes["dataloader"] = keys[loader]
    layout = "torchtitan" if is_titan else "dcp" if manifest.format == "dcp" else "torch-dict"
    state = _analyse(checkpoint, layout, prefixes)
    if titan_model:
        view = Manifest(format=manifest.format, location=manifest.location)
        view.entries = [e for e in model_entries(manifest, titan_model) if e.kind == "tensor"]
        state.weights = {
            "tensors": len(view.entries),
            "parameters": view.parameters(),
            "bytes": view.tensor_bytes(),
        }
    if rng and not state.rng:
        # a stream under an unrecognised key name still counts as RNG state
        state.rng = [rng]
    if step:
        state.step = _as_int(_value(checkpoint, step))
    if is_titan:
        state.step = _as_int(_value(checkpoint, "train_state.step"))
    if "trainer_state" in keys and state.step is None:
        # a Trainer folder converted to one torch / DCP checkpoint: its trainer_state came along
        state.step = _as_int(_value(checkpoint, "trainer_state.global_step"))
        if state.step is not None and state.dataloader is None:
            # the Trainer replays its data order from the seed and skips `global_step` batches
            state.dataloader = {"kind": "replayed", "skips_batches": state.step}
        epoch = _value(checkpoint, "trainer_state.epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
            state.epoch = float(epoch)
    epoch = _value(checkpoint, "epoch") if "epoch" in keys else None
    if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
        state.epoch = float(epoch)
    state.components = {c: p.rstrip(".") for c, p in prefixes.items()}
    if titan_model:
        state.components["model"] = f"top-level keys ({', '.join(titan_model)})"
    _verdict(state)
    return state


#: the top-level states torchtitan's CheckpointManager saves beside the model's own keys
_TITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def titan_model_keys(manifest: Manifest) -> list[str]:
    """The top-level keys of a torchtitan DCP that are the model's (`tok_embeddings`, `layers`,
    `norm`, `output`...): every key but the CheckpointManager's other states."""
    keys = _top_keys(manifest)
    return [k for k in keys if k not in _TITAN_STATES]


def model_entries(manifest: Manifest, keys: list[str]) -> list[Entry]:
    """The entries under the top-level `keys`."""
    wanted = set(keys)

    def top(entry: Entry) -> str:
        path = getattr(entry, "key_path", None)
        return str(path[0][1]) if path else entry.name.split(".", 1)[0]

    return [e for e in manifest.entries if top(e) in wanted]


def select_view(opened: OpenedSource, select: str | None) -> Manifest | None:
    """For `--select model` on a layout whose model keys sit at the top level (torchtitan
    0.3), the manifest of just those entries (names unchanged); None otherwise."""
    state = opened.training
    if not select or select.rstrip(".") != "model" or state is None:
        return None
    if state.layout != "torchtitan" or state.prefixes.get("model") != "":
        return None
    manifest = opened.checkpoint.manifest
    return manifest.model_copy(
        update={"entries": model_entries(manifest, titan_model_keys(manifest))}
    )


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _lightning(checkpoint: Checkpoint, keys: dict[str, str]) -> TrainingState:
    names = checkpoint.manifest.by_name
    prefixes = {"model": "state_dict."}
    if any(n.startswith("optimizer_states.0.") for n in names):
        prefixes["optimizer"] = "optimizer_states.0."
    if any(n.startswith("lr_schedulers.0.") for n in names):
        prefixes["scheduler"] = "lr_schedulers.0."
    if "loops" in keys:
        prefixes["dataloader"] = "loops."
    state = _analyse(checkpoint, "lightning", prefixes)
    state.step = _as_int(_value(checkpoint, "global_step"))
    epoch = _value(checkpoint, "epoch")
    if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
        state.epoch = float(epoch)
    if state.dataloader is not None:
        # Lightning restores the position in the epoch from its loop progress counters
        state.dataloader = {"kind": "loop progress", "source": "loops"}
    for key in ("rng", "rng_states", "random_state"):
        if key in keys:
            state.rng = _rng(checkpoint.manifest, [keys[key]]) or [key]
    state.components = {c: p.rstrip(".") for c, p in prefixes.items()}
    _verdict(state)
    return state


# --------------------------------------------------------------------------- entry point


def _open_layout(source: Source) -> OpenedSource | None:
    """The training folder layout of a local or object-store folder, if it is one (DCP folders
    excepted). The Hub is read as a model repository (its own adapter), never as a run folder."""
    if source.target is not None or source.location.kind == "hf":
        return None
    if ".metadata" in set(source.top_level()):
        return None
    for recognise in (_deepspeed, _trainer, _accelerate, _components):
        opened = recognise(source)
        if opened is not None:
            return opened
    return None


def subfolder_source(source: Source, rel: str) -> Source:
    """A component folder of `source` (an FSDP `pytorch_model_fsdp_0/` DCP) as its own source."""
    storage = source.storage.subfolder(rel)
    if storage is None:
        raise FormatError(
            "subfolder components cannot be read from this storage", path=source.location.raw
        )
    return Source(location=parse_location(storage.display), storage=storage)


def open_source(src: str, format: str | None = None) -> OpenedSource:
    """Open `src` (local path or URL), recognising training layouts unless `format` is given.

    With `format`, the source is read as that format alone; a torch.save or DCP training dict
    still gets its training state (it is the same single checkpoint).
    """
    layout: LayoutInfo | None = None
    if format is None:
        source = resolve_source(src)
        opened = _open_layout(source)
        if opened is not None:
            return opened
        layout = describe_model_folder(source)
    checkpoint = open_checkpoint(src, format)
    if checkpoint.manifest.format == "gguf":
        from .model_folders import gguf_info

        layout = gguf_info(checkpoint.manifest)
    if checkpoint.manifest.format not in ("torch", "dcp"):
        return OpenedSource(checkpoint=checkpoint, layout=layout)
    return OpenedSource(checkpoint=checkpoint, training=analyse_single(checkpoint), layout=layout)


def describe_model_folder(source: Source) -> LayoutInfo | None:
    """The library layout of a local or remote model folder (PEFT...), from its JSON files."""
    from .model_folders import peft_info

    if source.target is not None:
        return None
    return peft_info(source)


# --------------------------------------------------------------------------- checks


def check_source(src: str, format: str | None = None) -> list[Problem]:
    """Structural problems of any SRC, training folders included (what plain `verify` runs).

    A training folder gets its format's `check` on every component (the model's index against
    its shards, every torch file loading with weights_only...) plus the components that could
    not be read; anything else gets its format's `check`. Sources that cannot be opened at all
    (a `latest` naming a missing tag) become one problem.
    """
    try:
        source = resolve_source(src)
        opened = _open_layout(source) if format is None else None
        if opened is None:
            from ..formats import detect_format

            name = format or detect_format(source)
            return list(get_format(name).check(source))
    except CkptError as error:
        return [Problem(code=error.code, message=error.message, file=error.path or src)]
    problems = component_problems(opened)
    with opened.checkpoint:
        for rel, fmt in opened.parts.values():
            if fmt == "json":
                continue
            if rel.endswith("/"):
                part = subfolder_source(source, rel.rstrip("/"))
            else:
                part = Source(location=source.location, storage=source.storage, target=rel)
            problems.extend(get_format(fmt).check(part))
    return problems


def component_problems(opened: OpenedSource) -> list[Problem]:
    """Components that were found but could not be read (for a structural verify)."""
    return list(opened.problems)


def training_checks(opened: OpenedSource, exact: bool = False) -> list[Problem]:
    """What `verify --resumable` reports: every reason the checkpoint cannot resume the run.

    Errors: missing weights, optimizer or progress counter; optimizer state that does not
    exist for every parameter or whose shapes do not match the weights; components that could
    not be read. What only an exact (bit-identical) resume needs (scheduler, step, RNG,
    data-loader state) is a warning, an error with `exact`. A source with no training state
    at all is one problem.
    """
    where = opened.checkpoint.manifest.location
    state = opened.training
    if state is None:
        return [
            Problem(
                code="not_resumable",
                message=f"{where}: holds no training state (weights only); "
                "a resumable checkpoint also saves optimizer, scheduler, step, RNG and data-loader state",
                file=where,
            )
        ]
    problems = component_problems(opened)
    labels = {
        "weights": "no model weights",
        "optimizer": "no optimizer state",
        "scheduler": "no LR scheduler state",
        "step": "no step or epoch counter",
        "rng": "no RNG state (dropout and shuffling will differ after a resume)",
        "dataloader": "no data-loader state (the resumed run will see different batches)",
    }
    for item in REQUIRED:
        if item in state.missing:
            problems.append(
                Problem(code=f"missing_{item}", message=f"{where}: {labels[item]}", file=where)
            )
        elif item in state.missing_exact:
            problems.append(
                Problem(
                    code=f"missing_{item}",
                    message=f"{where}: {labels[item]}; resumable, but not exactly",
                    file=where,
                    severity="error" if exact else "warning",
                )
            )
    opt = state.optimizer
    if opt is not None and not opt.complete:
        problems.append(
            Problem(
                code="optimizer_incomplete",
                message=f"{where}: optimizer state covers {opt.params_with_state} of "
                f"{opt.params} parameters ({', '.join(opt.states) or 'no state'})",
                file=where,
            )
        )
    problems.extend(_shape_problems(opened))
    return problems


def _shape_problems(opened: OpenedSource) -> list[Problem]:
    state = opened.training
    if state is None or state.optimizer is None:
        return []
    model_prefix = state.prefixes.get("model")
    opt_prefix = state.prefixes.get("optimizer")
    if model_prefix is None or opt_prefix is None:
        return []
    checkpoint = opened.checkpoint
    if opt_prefix.startswith("optim_states"):
        return []  # DeepSpeed ZeRO state covers flat partitions, not individual weights
    view = analyse_optimizer(checkpoint, opt_prefix)
    if view is None:
        return []
    where = checkpoint.manifest.location
    model = {
        e.name[len(model_prefix) :]: list(e.shape)
        for e in _under(checkpoint.manifest, model_prefix)
        if e.kind == "tensor"
    }
    problems: list[Problem] = []

    def param_shape(states: dict[str, list[int]]) -> list[int] | None:
        shaped = [s for name, s in states.items() if s and name != "step"]
        return shaped[0] if shaped else None

    if view.by_fqn:
        for fqn, states in view.per_param.items():
            shape = param_shape(states)
            if fqn not in model:
                problems.append(
                    Problem(
                        code="optimizer_unknown_param",
                        message=f"{where}: optimizer state for {fqn!r}, which the weights lack",
                        file=where,
                        tensor=f"{opt_prefix}state.{fqn}",
                    )
                )
            elif shape is not None and shape != model[fqn]:
                problems.append(
                    Problem(
                        code="optimizer_shape_mismatch",
                        message=f"{where}: optimizer state of {fqn!r} is {shape}, "
                        f"the weight is {model[fqn]}",
                        file=where,
                        tensor=f"{opt_prefix}state.{fqn}",
                    )
                )
        return problems
    # torch.optim numbers parameters in model.parameters() order, which the saved weights do
    # not record (safetensors sorts names): every state shape must match a distinct weight
    available = Counter(tuple(s) for s in model.values())
    for pid in sorted(view.per_param, key=lambda p: int(p) if p.isdigit() else 0):
        shape = param_shape(view.per_param[pid])
        if shape is None:
            continue
        if available[tuple(shape)] > 0:
            available[tuple(shape)] -= 1
            continue
        problems.append(
            Problem(
                code="optimizer_shape_mismatch",
                message=f"{where}: optimizer state of parameter {pid} has shape {shape}, "
                "which no remaining model weight has",
                file=where,
                tensor=f"{opt_prefix}state.{pid}",
            )
        )
    return problems


def recognise_layout(source: Source) -> OpenedSource | None:
    """The training layout of a local folder when it is one, else None (cheap: names first).

    Unlike `open_source`, nothing else is opened, so a caller can still run a format's `check`
    on a broken plain checkpoint (what `verify` does).
    """
    return _open_layout(source)
