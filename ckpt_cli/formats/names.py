"""What a file's name says about its format: the suffixes, index names and commit markers.

This is the one place outside the adapters that knows a format's file names; run folders,
training layouts, storages and operations ask it (`weight_format`, `index_format`,
`is_checkpoint_file`, `holds_dcp`...) instead of testing suffixes themselves, so a new format
is taught here and in its adapter, inside `formats/`. Names only: no I/O, no imports, so run
scanning and the Hub's header prefetch stay light.
"""

from __future__ import annotations

from collections.abc import Iterable

SAFETENSORS_SUFFIX = ".safetensors"
#: the suffix transformers and accelerate give their torch.save files (`pytorch_model.bin`)
TORCH_BIN_SUFFIX = ".bin"
#: torch.save files: `.pt`/`.pth` (PyTorch), `.bin` (`pytorch_model.bin`), `.ckpt` (Lightning)
TORCH_SUFFIXES = (".pt", ".pth", TORCH_BIN_SUFFIX, ".ckpt")
#: the suffix Lightning's `ModelCheckpoint` gives its torch.save files
LIGHTNING_SUFFIX = ".ckpt"
#: a DCP folder's data files (`__0_0.distcp`) and its commit marker, written last
DCP_DATA_SUFFIX = ".distcp"
DCP_METADATA = ".metadata"
GGUF_SUFFIX = ".gguf"
#: every shard index ends so (`model.safetensors.index.json`, `pytorch_model.bin.index.json`)
INDEX_SUFFIX = ".index.json"
SAFETENSORS_INDEX_SUFFIX = SAFETENSORS_SUFFIX + INDEX_SUFFIX
#: the index of sharded `pytorch_model-0000N-of-0000M.bin` files
TORCH_INDEX_SUFFIX = TORCH_BIN_SUFFIX + INDEX_SUFFIX
#: written into a checkpoint folder that `ckpt prune --slim-older-than` slimmed to its weights:
#: the save holds no optimizer or RNG state on purpose, and every training layout says so
SLIM_RECORD = "ckpt-slim.json"
#: written into a training folder `ckpt reshard --world-size` cut for another world size: the
#: world size the run saved it at and the one it is laid out for now (a resume at the new one
#: is never bit-identical: every rank reads another shard of the data, another RNG stream)
RESHARD_RECORD = "ckpt-reshard.json"
#: the stem diffusers saves and loads a model's weights under
#: (`diffusion_pytorch_model.safetensors`, `diffusion_pytorch_model.safetensors.index.json`)
DIFFUSERS_WEIGHTS_STEM = "diffusion_pytorch_model"
#: pickles a training save holds beside its tensors (accelerate's `random_states_0.pkl`)
PICKLE_SUFFIX = ".pkl"

#: formats training frameworks save in, each with the suffixes of the files holding its tensors
#: (GGUF is an export format, never a training save: run folders do not look for it)
SAVE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "safetensors": (SAFETENSORS_SUFFIX,),
    "torch": TORCH_SUFFIXES,
    "dcp": (DCP_DATA_SUFFIX,),
}
#: the suffixes of every file a training save holds tensors in
CHECKPOINT_SUFFIXES = (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX, DCP_DATA_SUFFIX)
#: weight files any library writes (ours and others': Keras, Flax, ONNX, GGUF): never carried
#: beside a model as config or tokenizer files
WEIGHT_SUFFIXES = (
    SAFETENSORS_SUFFIX,
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    GGUF_SUFFIX,
)


def base_name(name: str) -> str:
    """The last part of a `/`-separated relative path."""
    return name.rsplit("/", 1)[-1]


def weight_format(name: str) -> str | None:
    """The save format of a file holding tensors, from its suffix (`safetensors`, `torch`,
    `dcp`); None for any other file (indexes and markers included)."""
    for token, suffixes in SAVE_SUFFIXES.items():
        if name.endswith(suffixes):
            return token
    return None


def is_single_file_weights(name: str) -> bool:
    """A file that is a whole checkpoint on its own: a safetensors or torch.save file (DCP data
    files are pieces of their folder)."""
    return weight_format(name) in ("safetensors", "torch")


def index_format(name: str) -> str | None:
    """The format of a shard index, from its name: `safetensors` for
    `*.safetensors.index.json`, `torch` for `*.{pt,pth,bin,ckpt}.index.json`; None otherwise."""
    if not name.endswith(INDEX_SUFFIX):
        return None
    owner = weight_format(name.removesuffix(INDEX_SUFFIX))
    return owner if owner in ("safetensors", "torch") else None


def is_index_file(name: str) -> bool:
    """A safetensors or torch.save shard index (`model.safetensors.index.json`)."""
    return index_format(name) is not None


def looks_like_index(name: str) -> bool:
    """Any file named like a shard index, variants included (`….index.json`,
    diffusers' `….safetensors.index.fp16.json`)."""
    return name.endswith(INDEX_SUFFIX) or (".index." in name and name.endswith(".json"))


def is_dcp_metadata(name: str) -> bool:
    """The DCP commit marker, `.metadata` (a bare name or the end of a path)."""
    return base_name(name) == DCP_METADATA


def holds_dcp(names: Iterable[str]) -> bool:
    """Whether a folder's file names are a DCP checkpoint's (its marker or its data files)."""
    return any(is_dcp_metadata(n) or n.endswith(DCP_DATA_SUFFIX) for n in names)


def is_checkpoint_file(name: str) -> bool:
    """A file that holds a training save's tensors or commits one: data files of every save
    format and DCP's `.metadata`."""
    return name.endswith(CHECKPOINT_SUFFIXES) or is_dcp_metadata(name)


def is_commit_marker(name: str) -> bool:
    """The files written last, which make a checkpoint look complete: shard indexes and DCP's
    `.metadata`."""
    base = base_name(name)
    return base == DCP_METADATA or base.endswith(INDEX_SUFFIX)
