"""Format registry: maps format tokens to adapter classes, imported lazily.

`open_checkpoint(src)` is the one entry point for reading: it resolves the location into a
`Source`, picks the format (an explicit token wins over detection) and opens it.

Operations never compare format names: they ask the registry for the class (`get_format`,
`find_format`, `writable_formats`, `format_of_file`) and read its facts (`Format.holds_objects`,
`Format.shards_by_rank`...; see `formats.base`).
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import os
import re
from pathlib import Path

from ..errors import FormatError, NoCheckpointError, NotFoundError, UsageError
from ..storage import PARITY_DIR, PARITY_MANIFEST, LocalStorage
from ..storage.local import read_cache_ref
from ..storage.uri import Location, parse_location
from .base import Checkpoint, Format, Source

#: token -> "module:Class"; modules import lazily so `ckpt --help` stays fast
REGISTRY: dict[str, str] = {
    "safetensors": "ckpt_cli.formats.safetensors.format:SafetensorsFormat",
    "dcp": "ckpt_cli.formats.dcp:DcpFormat",
    "torch": "ckpt_cli.formats.torch.format:TorchFormat",
    "gguf": "ckpt_cli.formats.gguf.format:GgufFormat",
}
#: formats a user may name in --format/--to
FORMAT_NAMES = ("safetensors", "dcp", "torch", "hub", "gguf")
#: `--format` names that choose a storage, not a format: the format is still detected
#: (`hub` = read from the Hugging Face Hub), with the location kind each one needs
STORAGE_NAMES = {"hub": "hf"}
#: the format Hugging Face libraries save weights in and load first (`save_pretrained`):
#: what a merged model, or a multi-folder model of mixed formats, is written as
HF_WEIGHTS = "safetensors"


def get_format(name: str) -> type[Format]:
    """The adapter class for a format token."""
    if name not in REGISTRY:
        tokens = ", ".join([*REGISTRY, *STORAGE_NAMES])
        raise UsageError(f"unknown format {name!r}", fix=f"Use one of: {tokens}.")
    module_name, cls_name = REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise FormatError(
                f"the {name} format is not available in this version (its module "
                f"{module_name} is not installed)",
                fix="Reinstall ckpt (`pip install --force-reinstall ckpt-cli`): the install is "
                "missing part of the package.",
            ) from None
        raise
    cls: type[Format] = getattr(module, cls_name)
    return cls


def find_format(name: str) -> type[Format] | None:
    """The adapter class for `name`, or None when it is not a format token (a training
    layout such as `trainer`, a multi-folder layout, a storage name)."""
    if name not in REGISTRY:
        return None
    try:
        return get_format(name)
    except FormatError:
        return None


def writable_formats() -> list[str]:
    """Format tokens that can be written (`convert --to`), in registry order."""
    return [name for name in available_formats() if get_format(name).writable]


def serializations() -> tuple[str, ...]:
    """Every data-file serialization a writable format offers (`--dcp-serialization`)."""
    out: list[str] = []
    for name in writable_formats():
        out += [s for s in get_format(name).serializations if s not in out]
    return tuple(out)


def format_of_file(name: str) -> str | None:
    """The writable format whose single files or shard index end like `name`, if any."""
    for token in writable_formats():
        fmt = get_format(token)
        if name.endswith(fmt.single_file_suffixes) or (
            fmt.index_suffix is not None and name.endswith(fmt.index_suffix)
        ):
            return token
    return None


def choose_format(source: Source, format: str | None) -> str:
    """The format token to read `source` as: `format`, else the one detected.

    A storage name (`--format hub`) only checks that the location is that storage's kind;
    the format is still detected, since any format can be read through any storage.
    """
    if format in STORAGE_NAMES:
        if source.location.kind != STORAGE_NAMES[format]:
            raise UsageError(
                f"--format {format} needs an {STORAGE_NAMES[format]}://org/repo location",
                path=source.location.raw,
                fix=f"Write SRC as {STORAGE_NAMES[format]}://org/repo, or leave --format "
                f"{format} out.",
            )
        format = None
    return format or detect_format(source)


def _broken_link(path: Path) -> str:
    """Why the symbolic link `path` leads nowhere: a loop, or a target that does not exist."""
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link that loops back on itself (ELOOP)"
    return f"is a symbolic link to {os.readlink(path)}, which does not exist"


def resolve_source(location: Location | str) -> Source:
    """Turn a location into a `Source` (storage + optional single target file)."""
    loc = parse_location(location) if isinstance(location, str) else location
    if loc.kind == "hf":
        from ..storage.hub import open_hub

        hub, target = open_hub(loc)
        return Source(location=loc, storage=hub, target=target, origin={"hub": hub.repo.details()})
    if loc.kind == "fsspec":
        from ..storage.remote import open_fsspec

        remote, target = open_fsspec(loc)
        return Source(location=loc, storage=remote, target=target)
    assert loc.path is not None
    path: Path = loc.path
    if not path.exists():
        cached = cached_snapshot(loc.raw)
        if cached is None:
            from ..storage.output import leftover_old_copies

            old = leftover_old_copies(path.absolute())
            if old:  # a `--force` replace was killed between its two renames
                raise NotFoundError(
                    f"no such file or folder, but {old[-1]} holds the copy that a killed "
                    "`--force` replace had moved aside",
                    path=path,
                    fix=f"Recover it with `mv {old[-1]} {path}`.",
                )
            if path.is_symlink():
                raise NotFoundError(
                    _broken_link(path),
                    path=path,
                    fix="Repair the link, or point at the checkpoint itself.",
                )
            if (path.parent / PARITY_DIR / path.name).is_dir():
                # a protected single file deleted outright: its parity is beside it
                raise NotFoundError(
                    "no such file, but the parity `ckpt protect` wrote for it is beside it "
                    f"({PARITY_DIR}/{path.name}/)",
                    path=path,
                    fix=f"Rebuild it with `ckpt repair {loc.raw}` (a file lost whole comes "
                    "back when it was protected with --whole-files).",
                )
            repo_like = _REPO_ID.match(loc.raw) is not None
            raise NotFoundError(
                "no such file or folder, nor a cached Hugging Face snapshot of that name"
                if repo_like
                else "no such file or folder",
                path=path,
                # the same words as the CLI's hint (`conventions.hub_hint`) for other not-found errors
                fix=f"Check the path; did you mean hf://{loc.raw}?"
                if repo_like
                else "Check the path.",
            )
        path = cached
        loc = Location(raw=loc.raw, kind="local", path=cached)
    if path.is_dir():
        return Source(location=loc, storage=LocalStorage(path))
    return Source(location=loc, storage=LocalStorage(path.parent), target=path.name)


_REPO_ID = re.compile(r"^([\w.-]+)/([\w.-]+)(?:@([\w./-]+))?$")


def cached_snapshot(text: str) -> Path | None:
    """The Hugging Face cache snapshot of `org/name[@revision]` (the way `hf` users name a
    model), when one is cached locally: `HF_HUB_CACHE/models--org--name/snapshots/<commit>/`
    for the commit `refs/<revision or main>` records, or that commit itself. None otherwise."""
    match = _REPO_ID.match(text)
    if match is None:
        return None
    from huggingface_hub import constants

    org, name, revision = match.groups()
    repo = Path(constants.HF_HUB_CACHE) / f"models--{org}--{name}"
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = revision
    recorded = read_cache_ref(ref)
    if recorded is not None:
        commit = recorded
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def available_formats() -> list[str]:
    """Registered format tokens whose adapter module is present in this build."""
    names = []
    for name, target in REGISTRY.items():
        if importlib.util.find_spec(target.split(":")[0]) is not None:
            names.append(name)
    return names


#: token -> a regex some file name (the target, or a top-level name) must fully match for the
#: format's `detect` to accept the source: a name-only superset of each `detect`, so detecting
#: a safetensors model imports no DCP, torch.save or GGUF adapter (start-up of `inspect`)
DETECT_NAMES: dict[str, re.Pattern[str]] = {
    "safetensors": re.compile(r".*\.safetensors(\.index\.json)?", re.DOTALL),
    # DCP also holds a folder of only HuggingFaceStorageWriter shards (`_may_detect`)
    "dcp": re.compile(r"(.*/)?\.metadata|.*\.distcp|(.*/)?__\d+\.metadata", re.DOTALL),
    "torch": re.compile(r".*\.(pt|pth|bin|ckpt|pkl)|.*\.bin\.index\.json", re.DOTALL),
    "gguf": re.compile(r".*\.gguf", re.DOTALL),
}


def _may_detect(name: str, source: Source) -> bool:
    """Whether format `name`'s `detect` could accept `source`, from its file names alone."""
    pattern = DETECT_NAMES.get(name)
    if pattern is None:
        return True  # a format without a pre-check is always asked
    names = [source.target] if source.target is not None else source.top_level()
    if any(pattern.fullmatch(n) for n in names):
        return True
    if name == "dcp" and source.target is None:
        from .safetensors.format import is_dcp_hf_sharded

        return is_dcp_hf_sharded(names)
    return False


#: how many names `folder_contents` lists before counting the rest
_LISTED_NAMES = 5


def folder_contents(files: dict[str, int]) -> str:
    """What a folder without a checkpoint holds, briefly: `it is empty`, or its first top-level
    names (subfolders with a trailing `/`) and how many more."""
    names = sorted({name.split("/", 1)[0] + ("/" if "/" in name else "") for name in files})
    if not names:
        return "it is empty"
    shown = ", ".join(names[:_LISTED_NAMES])
    more = len(names) - _LISTED_NAMES
    return f"it holds {shown}" + (f" and {more} more" if more > 0 else "")


def holds_only_nested_checkpoints(source: Source) -> bool:
    """Whether `source` is a folder with no checkpoint file of its own but some in its
    subfolders: a run folder, a folder of runs, or one of saves (`final/`, `best/`), which the
    layer that knows runs names (`sources.opening.format_of`); by file names only."""
    if source.target is None:
        on_top = nested = False
        for name in source.files:
            if any(p.fullmatch(name.rsplit("/", 1)[-1]) for p in DETECT_NAMES.values()):
                if "/" in name:
                    nested = True
                else:
                    on_top = True
        return nested and not on_top
    return False


def detect_format(source: Source) -> str:
    """The one format token whose `detect` accepts the source; FormatError for none or many."""
    matches = [
        name
        for name in available_formats()
        if _may_detect(name, source) and get_format(name).detect(source)
    ]
    if len(matches) == 1:
        return matches[0]
    where = source.location.raw
    if not matches:
        root = source.storage.local_root
        parity = root / PARITY_DIR if root is not None and source.target is None else None
        if parity is not None and (parity / PARITY_MANIFEST).is_file():
            # a protected checkpoint whose data files are gone: its parity may rebuild them
            raise FormatError(
                "holds no checkpoint files (safetensors, DCP .metadata/.distcp, torch.save), "
                f"but the parity `ckpt protect` wrote ({PARITY_DIR}/) lists the files it had",
                path=where,
                fix=f"Rebuild them with `ckpt repair {where}` (`--dry-run` says what it can "
                "rebuild).",
            )
        broken = source.storage.broken_links() if source.target is None else {}
        named = [
            f"{name} is a symbolic link to {target}, which does not exist"
            for name, target in broken.items()
            if any(p.fullmatch(name) for p in DETECT_NAMES.values())
        ]
        if named:
            # the listing has no file for a link to nothing: "it holds config.json" hid that
            # the weights are there as links whose files are gone (a cleaned-up HF cache)
            raise NotFoundError(
                f"holds no readable checkpoint file: {'; '.join(named[:_LISTED_NAMES])}"
                + (
                    f" (and {len(named) - _LISTED_NAMES} more)"
                    if len(named) > _LISTED_NAMES
                    else ""
                ),
                path=where,
                fix="Fetch the files again (for a Hugging Face cache snapshot `hf download "
                "ORG/REPO`, which restores the blobs the links name), or copy them in place of "
                "the links.",
            )
        if source.target is None:
            # a folder: --format cannot help (each format reads only its own suffixes there)
            contents = folder_contents(source.files)
            if parity is not None and parity.is_dir():
                contents += f" (and a {PARITY_DIR}/ with no parity manifest: nothing to rebuild)"
            raise NoCheckpointError(
                f"holds no checkpoint files (safetensors, DCP .metadata/.distcp, torch.save, "
                f"GGUF): {contents}",
                path=where,
                fix="Point at the folder the checkpoint was saved to (a model folder, a "
                "`checkpoint-N/` or `step-N/` save, or a run folder holding them), or at the "
                "checkpoint file itself.",
            )
        name = source.target or ""
        suffixed = any(p.fullmatch(name.rsplit("/", 1)[-1]) for p in DETECT_NAMES.values())
        raise FormatError(
            "is not a checkpoint this tool recognises"
            + (
                ""
                if suffixed
                else ": its name has none of the suffixes a format is told by (.safetensors, "
                ".pt, .pth, .bin, .ckpt, .pkl, .gguf, .distcp, .metadata, a shard index)"
            ),
            path=where,
            fix="Point at the checkpoint file or folder; a checkpoint under another name is "
            "read with --format where the command has one (inspect, verify, convert, reshard; "
            "diff: --format-a / --format-b), or renamed with its format's suffix.",
        )
    raise FormatError(
        f"looks like more than one format ({', '.join(matches)})",
        path=where,
        fix="Pass --format to say which one to read (inspect, verify, convert, reshard; diff: "
        "--format-a / --format-b), or move the other format's files out of the folder.",
    )


def open_checkpoint(location: Location | str, format: str | None = None) -> Checkpoint:
    """Open a checkpoint for reading; `format` (a token) overrides detection."""
    source = resolve_source(location)
    name = choose_format(source, format)
    checkpoint = get_format(name).open(source)
    if source.origin:
        checkpoint.manifest.details.update(source.origin)
    return checkpoint
