"""One save of a run as the doctor reads it: opened once, its counters and settings read once.

A `Save` keeps its source open for the tensor statistics of the cause modules (one tensor at a
time) and answers the small questions they all ask: the step, the optimizer's step count, the
scheduler's position, the data position, the grad scaler, the batch settings, the RNG streams,
the weights, an EMA copy, the config and tokenizer files. Counters come from the training-state
analysis (`layouts.training.value_of`); nothing here reads a large tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ...errors import CkptError
from ...formats.base import Source
from ...formats.torch.pickle_values import NotPlain, load_plain_pickle
from ...models import Entry
from ...sources.layouts import OpenedSource
from ...sources.layouts.training import as_int, entries_under, value_of

#: leaf names of data-position counters, wherever a layout keeps them
DATA_COUNTERS = (
    "samples_seen",
    "batches_seen",
    "num_input_tokens_seen",
    "tokens_seen",
    "ntokens_seen",
    "consumed_samples",
    "consumed_train_samples",
    "_num_yielded",
    "_sampler_iter_yielded",
    "num_yielded",
    "samples_yielded",
)
#: leaf names a loader's own position goes by (`dataloader.position`,
#: `dataloader.dp_rank_0.position`, torchtitan's pickled `{"pos": ...}`): read only inside a
#: data-loader component, where they count the data seen (elsewhere `step` / `index` do not)
LOADER_POSITIONS = ("position", "pos", "step", "index")
#: the components data counters live in
_DATA_HOMES = (
    "dataloader",
    "data_loader",
    "sampler",
    "train_state",
    "trainer_state",
    "data",
    "loader",
)
#: the data-loader components among them (accelerate numbers them: `dataloader_1`)
_LOADER_HOMES = ("dataloader", "data_loader", "loader")
#: names an EMA copy of the weights is saved under
EMA_KEYS = ("ema", "ema_model", "model_ema", "ema_state_dict", "ema_state", "averaged_model")
#: a fresh `torch.amp.GradScaler`'s scale (`init_scale`)
INITIAL_SCALE = 65536.0
#: model-config files, and tokenizer files, compared between saves
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
#: training-argument fields read from a Trainer's `training_args.bin` (opcodes, never unpickled)
TRAINING_ARGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "bf16",
    "fp16",
    "seed",
    "data_seed",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "num_train_epochs",
    "max_grad_norm",
    "save_only_model",
    "ignore_data_skip",
)
#: the gradient-clipping norm's names in a loop's saved settings (`config.max_grad_norm`)
_CLIP_NAMES = ("max_grad_norm", "grad_clip", "clip_grad_norm", "gradient_clipping")


@dataclass
class Save:
    """One checkpoint of the run, opened.

    Attributes:
        name: its name in the run folder (`checkpoint-6`).
        path: its full location.
        opened: the opened source (entries, training state).
        source: its resolved source (for the JSON files beside the weights).
        folder_step: the step its name says (None when it says none).
        mtime: the newest modification time of its files.
    """

    name: str
    path: str
    opened: OpenedSource
    source: Source
    folder_step: int | None = None
    mtime: float = 0.0
    _values: dict[str, Any] = field(default_factory=dict, repr=False)
    #: what a cause family read from this save once and asks again for other pairs
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- basics

    @property
    def layout(self) -> str | None:
        """The training layout (`hf-trainer`, `accelerate`, `dcp`...), None for plain weights."""
        return self.opened.training.layout if self.opened.training else None

    def value(self, name: str) -> Any:
        """An object entry's (or scalar tensor's) value; None when absent or unreadable."""
        if name not in self._values:
            self._values[name] = value_of(self.opened.checkpoint, name)
        return self._values[name]

    def prefix(self, component: str) -> str | None:
        """The entry prefix of a training component (`optimizer.`), when it has one."""
        state = self.opened.training
        if state is not None and component in state.prefixes:
            return state.prefixes[component]
        if any(e.name.startswith(f"{component}.") for e in self.entries):
            return f"{component}."
        return None

    @cached_property
    def entries(self) -> list[Entry]:
        """Every entry of the checkpoint."""
        return list(self.opened.checkpoint.manifest.entries)

    @cached_property
    def entries_by_name(self) -> dict[str, Entry]:
        """Every entry of the checkpoint, by its name."""
        return {entry.name: entry for entry in self.entries}

    @cached_property
    def step(self) -> int | None:
        """The training step: the trainer's own counter, else the one in the folder's name.

        accelerate's `step` counts gradient-accumulation micro-steps under `accumulate()` (0
        without it), so its folder's name wins there. The Trainer names each save after its
        `global_step` (`checkpoint-N`), so its name wins there too: a `trainer_state.json`
        that says otherwise is another save's (`consistency` names it).
        """
        state = self.opened.training
        own = state.step if state is not None else None
        if self.layout in ("accelerate", "hf-trainer") and self.folder_step is not None:
            return self.folder_step
        return own if own is not None and own > 0 else self.folder_step

    @cached_property
    def counted_step(self) -> int | None:
        """The step the trainer counted, to hold the optimizer's and scheduler's counters
        against. None for an accelerate save named automatically (`checkpoint_N`, one per
        `save_state` call: N counts saves), whose own `step` counts accumulation micro-steps:
        neither is the number of optimizer steps taken. A folder the script named after its
        step (`step-500`) says it."""
        from ...sources.layouts.accelerate import Accelerate

        folder = self.name.rstrip("/").rsplit("/", 1)[-1]
        if self.layout == "accelerate" and Accelerate.step_folder.fullmatch(folder):
            return None
        return self.step

    @cached_property
    def misnamed_trainer_state(self) -> int | None:
        """A Trainer save's `trainer_state.json` `global_step` where it is not the step the
        save is named after (the Trainer names `checkpoint-N` after it): the file is another
        save's. None when they agree, or either is unknown."""
        state = self.opened.training
        own = state.step if state is not None else None
        if self.layout != "hf-trainer" or self.folder_step is None or own is None:
            return None
        return own if own != self.folder_step else None

    # ---------------------------------------------------------------- optimizer, scheduler

    @cached_property
    def optimizer_steps(self) -> list[int]:
        """Each parameter's optimizer `step` count (Adam-like optimizers keep one)."""
        prefix = self.prefix("optimizer")
        if prefix is None:
            return []
        steps: list[int] = []
        for entry in entries_under(self.opened.checkpoint.manifest, f"{prefix}state."):
            if entry.name.endswith(".step") and (entry.kind == "object" or entry.numel == 1):
                value = self.value(entry.name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    steps.append(int(value))
        return steps

    @cached_property
    def optimizer_step(self) -> int | None:
        """The optimizer's step count (the largest of its parameters')."""
        return max(self.optimizer_steps) if self.optimizer_steps else None

    @cached_property
    def scheduler_epoch(self) -> int | None:
        """The LR scheduler's `last_epoch` (the steps it has taken); DeepSpeed's own schedulers
        (`WarmupLR`, `WarmupDecayLR`, `OneCycle`...) count `last_batch_iteration` from -1."""
        prefix = self.prefix("scheduler") or self.prefix("lr_scheduler")
        if prefix is None:
            return None
        epoch = as_int(self.value(f"{prefix}last_epoch"))
        if epoch is not None:
            return epoch
        batch = as_int(self.value(f"{prefix}last_batch_iteration"))
        return batch + 1 if batch is not None else None

    @property
    def scheduler_counter(self) -> str:
        """What `scheduler_epoch` was read from, for evidence lines."""
        prefix = self.prefix("scheduler") or self.prefix("lr_scheduler")
        if prefix is not None and as_int(self.value(f"{prefix}last_epoch")) is None:
            return "steps (last_batch_iteration + 1)"
        return "last_epoch"

    @cached_property
    def base_lr(self) -> float | None:
        """The learning rate the run was configured with (before any schedule)."""
        # DeepSpeed's own config: its schedulers keep no base_lrs, and the optimizer's param
        # groups hold the warm-up's current learning rate
        configured = self.value("model_states.ds_config.optimizer.params.lr")
        if isinstance(configured, int | float) and not isinstance(configured, bool):
            return float(configured)
        prefix = self.prefix("scheduler") or self.prefix("lr_scheduler")
        if prefix:
            lrs = self.value(f"{prefix}base_lrs")
            if isinstance(lrs, list | tuple) and lrs and isinstance(lrs[0], int | float):
                return float(lrs[0])
        opt = self.prefix("optimizer")
        if opt:
            for key in ("initial_lr", "lr"):
                value = self.value(f"{opt}param_groups.0.{key}")
                if isinstance(value, int | float) and not isinstance(value, bool):
                    return float(value)
        value = self.training_args.get("learning_rate")
        return float(value) if isinstance(value, int | float) else None

    @cached_property
    def current_lr(self) -> float | None:
        """The learning rate the optimizer's first param group held at the save (what its
        scheduler last set)."""
        opt = self.prefix("optimizer")
        value = self.value(f"{opt}param_groups.0.lr") if opt else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    @cached_property
    def param_groups(self) -> list[int]:
        """The number of parameters in each optimizer param group."""
        opt = self.prefix("optimizer")
        if opt is None:
            return []
        sizes: list[int] = []
        for i in range(1024):
            params = self.value(f"{opt}param_groups.{i}.params")
            if not isinstance(params, list | tuple):
                break
            sizes.append(len(params))
        return sizes

    # ---------------------------------------------------------------- data, scaler, settings

    @cached_property
    def data_counters(self) -> dict[str, float]:
        """Data-position counters by entry name (`dataloader.samples_seen`: 24)."""
        found: dict[str, float] = {}
        foreign = self.misnamed_trainer_state is not None  # another save's counters
        for entry in self.entries:
            parts = entry.name.split(".")
            if "log_history" in parts:
                continue  # the values logged at past steps, not the position now
            if foreign and parts[0] == "trainer_state":
                continue
            if parts[-1] in LOADER_POSITIONS:
                counted = self._in_loader(entry.name)
            else:
                # a counter of its own at the top level (a plain loop's `torch.save` dict), or
                # inside a data-position component
                counted = parts[-1] in DATA_COUNTERS and (
                    len(parts) == 1 or _under(parts[0], _DATA_HOMES)
                )
            if not counted:
                continue
            if entry.kind == "tensor" and entry.numel != 1:
                continue
            value = self.value(entry.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[entry.name] = float(value)
        for name, value in self._pickled_loader_counters().items():
            found.setdefault(name, value)
        epoch = None if foreign else self.value("trainer_state.epoch")
        if isinstance(epoch, int | float) and not isinstance(epoch, bool):
            found["trainer_state.epoch"] = float(epoch)
        return found

    @cached_property
    def epoch_counters(self) -> dict[str, float]:
        """Epoch numbers by entry name: an `epoch` at the top level of a plain loop's
        `torch.save` dict (what it hands `sampler.set_epoch`), or in a data-position component
        (`sampler.epoch`, `train_state.epoch`); not the Trainer's epoch fraction, which
        `data_counters` holds."""
        found: dict[str, float] = {}
        for entry in self.entries:
            parts = entry.name.split(".")
            if parts[-1] != "epoch" or "log_history" in parts or parts[0] == "trainer_state":
                continue
            if len(parts) > 2 or (len(parts) == 2 and not _under(parts[0], _DATA_HOMES)):
                continue
            if entry.kind == "tensor" and entry.numel != 1:
                continue
            value = self.value(entry.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[entry.name] = float(value)
        return found

    def _pickled_loader_counters(self) -> dict[str, float]:
        """Counters inside a data loader state kept as pickled bytes (torchtitan's
        `dataloader.dp_rank_N`: `pickle.dumps` of the `StatefulDataLoader` state), read with
        the plain-data unpickler (nothing runs) and found by leaf name at any depth."""
        found: dict[str, float] = {}
        for entry in self.entries:
            parts = entry.name.split(".")
            if entry.kind != "object" or parts[0] not in _DATA_HOMES or entry.nbytes > 1 << 20:
                continue
            raw = self.value(entry.name)
            if not isinstance(raw, bytes | bytearray) or raw[:1] != b"\x80":
                continue  # a pickle opens with its PROTO opcode
            try:
                state = load_plain_pickle(bytes(raw), self.source.storage.describe(entry.name))
            except (NotPlain, CkptError):
                continue
            stack: list[tuple[str, Any]] = [(entry.name, state)]
            while stack and len(found) < 64:
                where, value = stack.pop()
                if isinstance(value, dict):
                    stack += [(f"{where}.{k}", v) for k, v in value.items() if isinstance(k, str)]
                elif (
                    (
                        where.rsplit(".", 1)[-1] in DATA_COUNTERS
                        or (where.rsplit(".", 1)[-1] in LOADER_POSITIONS and self._in_loader(where))
                    )
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                ):
                    found[where] = float(value)
        return found

    @cached_property
    def loader_entries(self) -> list[Entry]:
        """The entries of the data loader's own state (`dataloader.`, a numbered
        `dataloader_1.`, `data_loader.`, `loader.`, `sampler.`; accelerate's `dl_state_dict.bin`
        and `sampler.bin`; DeepSpeed's `model_states.dataloader.`)."""
        return [
            e
            for e in self.entries
            if self._in_loader(e.name) or _under(e.name.split(".", 1)[0], ("sampler",))
        ]

    def _in_loader(self, name: str) -> bool:
        """Whether an entry lies inside a data-loader component: under a `dataloader` /
        `data_loader` / `loader` key, or the layout's own loader state (DeepSpeed's
        `model_states.dataloader.`)."""
        head = name.split(".", 1)[0]
        if head != name and _under(head, _LOADER_HOMES):
            return True
        prefix = self.prefix("dataloader")
        return prefix is not None and prefix != "" and name.startswith(prefix)

    @cached_property
    def scaler(self) -> dict[str, float] | None:
        """The gradient scaler: scale, growth tracker, growth factor and interval."""
        prefix = self.prefix("scaler") or self.prefix("grad_scaler")
        if prefix is None:
            return None
        out: dict[str, float] = {}
        for key, name in (
            ("scale", "scale"),
            ("growth_tracker", "_growth_tracker"),
            ("growth_factor", "growth_factor"),
            ("growth_interval", "growth_interval"),
        ):
            value = self.value(f"{prefix}{name}")
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = float(value)
        return out if "scale" in out else None

    @cached_property
    def may_skip_steps(self) -> bool:
        """Whether the run can skip optimizer steps on fp16 overflow: a grad scaler saved, or
        DeepSpeed's own loss scaling (fp16 in its config, or steps it counts as skipped)."""
        if self.scaler is not None:
            return True
        skipped = self.value("model_states.skipped_steps")
        if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped > 0:
            return True
        return self.value("model_states.ds_config.fp16.enabled") is True

    @cached_property
    def training_args(self) -> dict[str, Any]:
        """Fields of a Trainer's `training_args.bin`, read from its opcodes (never unpickled)."""
        if self.layout != "hf-trainer" or "training_args.bin" not in self.source.files:
            return {}
        from ...sources.layouts.training_args import training_arg_values

        return training_arg_values(self.source, "training_args.bin", TRAINING_ARGS)

    @cached_property
    def settings(self) -> dict[str, float]:
        """World size, per-device batch and gradient accumulation, where the save records them:
        in a train-state / config / args component, at the top level of a plain loop's
        `torch.save` dict (`batch_size`), or in the Trainer's `training_args.bin`."""
        return {key: value for key, (value, _) in self._settings.items()}

    def setting_source(self, key: str) -> str:
        """Where `settings[key]` was read (`train_state.per_device_batch`, `batch_size`,
        `training_args.bin per_device_train_batch_size`), for evidence lines."""
        return self._settings[key][1] if key in self._settings else key

    @cached_property
    def _settings(self) -> dict[str, tuple[float, str]]:
        out: dict[str, tuple[float, str]] = {}
        names = {
            "world_size": ("world_size", "dp_world_size", "data_parallel_size"),
            "per_device_batch": (
                "per_device_batch",
                "per_device_batch_size",
                "micro_batch_size",
                "batch_size",
            ),
            "grad_accum": ("grad_accum", "gradient_accumulation_steps", "grad_accum_steps"),
        }
        for home in ("train_state", "trainer_state", "config", "args", ""):
            for key, candidates in names.items():
                for candidate in candidates:
                    name = f"{home}.{candidate}" if home else candidate
                    value = self.value(name)
                    if isinstance(value, int) and not isinstance(value, bool) and key not in out:
                        out[key] = (float(value), name)
        args = self.training_args
        for key, arg in (
            ("per_device_batch", "per_device_train_batch_size"),
            ("grad_accum", "gradient_accumulation_steps"),
        ):
            if isinstance(args.get(arg), int):
                out.setdefault(key, (float(args[arg]), f"training_args.bin {arg}"))
        processes = self.trainer_processes
        if processes is not None:
            out.setdefault("world_size", (float(processes[0]), processes[1]))
        return out

    @cached_property
    def trainer_processes(self) -> tuple[int, str] | None:
        """How many processes wrote a Trainer save, from its RNG files (the Trainer records no
        world size): `rng_state.pth` from one, `rng_state_N.pth` from each of several; and the
        files it was read from. None where they do not say: no RNG file, or per-rank files
        with one lost (a gap, or `rng_state_0.pth` alone: `consistency` names the lost one)."""
        if self.layout != "hf-trainer" or self.source.target is not None:
            return None
        ranks = []
        for rel in self.source.files:
            match = re.fullmatch(r"rng_state(?:_(\d+))?\.\w+", rel)
            if match is not None:
                ranks.append(int(match.group(1)) if match.group(1) is not None else -1)
        if not ranks:
            return None
        if -1 in ranks:
            return 1, "rng_state.pth"
        if len(ranks) < 2 or sorted(ranks) != list(range(len(ranks))):
            return None
        return len(ranks), f"rng_state_0..{len(ranks) - 1}.pth files"

    @cached_property
    def grad_clip(self) -> tuple[float, str] | None:
        """The gradient-clipping norm the run was configured with, and where it was read: the
        Trainer's `max_grad_norm` (training_args.bin), DeepSpeed's `gradient_clipping`, or a
        loop's own record (`config.max_grad_norm`, `grad_clip` at the top level...)."""
        found = self.training_args.get("max_grad_norm")
        if isinstance(found, int | float) and not isinstance(found, bool):
            return float(found), "training_args.bin max_grad_norm"
        candidates = ["model_states.ds_config.gradient_clipping"]
        for home in ("train_state", "config", "args", ""):
            candidates += [f"{home}.{n}" if home else n for n in _CLIP_NAMES]
        for name in candidates:
            value = self.value(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value), name
        return None

    @cached_property
    def work_counters(self) -> dict[str, float]:
        """Counters that grow with the work done per step (the Trainer's `total_flos`, the
        tokens torchtitan's `train_state` counts, the samples DeepSpeed's engine counts)."""
        out: dict[str, float] = {}
        foreign = self.misnamed_trainer_state is not None  # another save's counters
        for name in (
            "trainer_state.total_flos",
            "trainer_state.num_input_tokens_seen",
            "train_state.ntokens_seen",
            "train_state.tokens_seen",
            "model_states.global_samples",
        ):
            if foreign and name.startswith("trainer_state."):
                continue
            value = self.value(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                out[name] = float(value)
        return out

    # ---------------------------------------------------------------- RNG

    @cached_property
    def rng_groups(self) -> dict[str, list[Entry]]:
        """RNG entries per rank (`0`, `1`...): per-rank files or keys, else one group `0`."""
        groups: dict[str, list[Entry]] = {}
        for entry in self.entries:
            head, _, rest = entry.name.partition(".")
            match = re.fullmatch(r"rng(?:_state)?(?:_(\d+))?", head)
            if match is None:
                continue
            if not rest:
                rest = head  # one generator's state saved whole (`"rng": torch.get_rng_state()`)
            rank = match.group(1) or _file_rank(entry.file) or "0"
            inner = re.match(r"(?:rank_?|r)(\d+)\.(.+)", rest)
            if inner:
                rank, rest = inner.group(1), inner.group(2)
            if rest in ("step",) or rest.endswith(".step"):
                continue  # a counter kept beside the streams (accelerate), not a stream
            groups.setdefault(rank, []).append(entry)
        return groups

    @cached_property
    def rng_ranks(self) -> int:
        """How many ranks' RNG states the save holds."""
        return len(self.rng_groups)

    def rng_stream_names(self) -> dict[str, str]:
        """Rank 0's RNG entries: the name inside the rank -> the entry name."""
        out: dict[str, str] = {}
        for entry in self.rng_groups.get("0", []):
            out[entry.name.rsplit(".", 1)[-1]] = entry.name
        return out

    # ---------------------------------------------------------------- weights, EMA, files

    @cached_property
    def model_prefix(self) -> str | None:
        """The prefix of the model weights."""
        return self.prefix("model")

    @cached_property
    def model_tensors(self) -> dict[str, Entry]:
        """The model's tensors by name inside the model."""
        prefix = self.model_prefix
        if prefix is None:
            return {}
        # the model's keys at the top level (torchtitan 0.3): every other component's are not
        others = tuple(
            p
            for c, p in (self.opened.training.prefixes if self.opened.training else {}).items()
            if c != "model" and p
        )
        others += tuple(f"{home}." for home in (*_DATA_HOMES, *EMA_KEYS, "rng", "scaler"))
        return {
            e.name[len(prefix) :]: e
            for e in self.entries
            if e.kind == "tensor"
            and e.name.startswith(prefix)
            and not (prefix == "" and e.name.startswith(others))
        }

    @cached_property
    def ema_tensors(self) -> dict[str, Entry]:
        """An EMA copy of the weights, by the model's tensor names (empty when none)."""
        for key in EMA_KEYS:
            prefix = f"{key}."
            found = {
                e.name[len(prefix) :]: e
                for e in self.entries
                if e.kind == "tensor" and e.name.startswith(prefix)
            }
            if found:
                return found
        return {}

    def json_file(self, rel: str) -> Any:
        """A JSON file beside the weights, parsed (None when absent or not JSON)."""
        raw = self.file_bytes(rel)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None

    def file_bytes(self, rel: str, limit: int = 64 << 20) -> bytes | None:
        """A small file of the checkpoint folder (None when absent, or larger than `limit`)."""
        if self.source.target is not None or rel not in self.source.files:
            return None
        if self.source.files[rel] > limit:
            return None
        try:
            return self.source.storage.read_all(rel)
        except CkptError:
            return None

    def close(self) -> None:
        """Close the opened checkpoint."""
        self.opened.checkpoint.close()


def _file_rank(file: str | None) -> str | None:
    """The rank a per-rank RNG file is numbered for (`rng_state_1.pth`, `random_states_1.pkl`):
    a save holding one such file names its component without the number, whichever rank's it
    is."""
    if file is None:
        return None
    match = re.fullmatch(r"(?:rng_state|random_states)_(\d+)\.\w+", file.rsplit("/", 1)[-1])
    return match.group(1) if match else None


def _under(head: str, homes: tuple[str, ...]) -> bool:
    """Whether an entry's first segment names one of `homes` (numbered too: `dataloader_1`)."""
    return any(head == home or head.startswith(f"{home}_") for home in homes)
