"""convert / reshard of a multi-folder model (a diffusers pipeline, a sentence-transformers
folder): every component with its own naming, into one atomically published DEST.

Each weight-holding component is converted (or resharded) on its own, by the single-checkpoint
operation, into its folder inside a staging sibling of DEST, so it keeps the names its library
loads (`unet/diffusion_pytorch_model.safetensors`, `2_Dense/model.safetensors`) and its
`config.json`. Every other file of the source (`model_index.json`, `modules.json`, schedulers,
tokenizers, pooling configs) is copied byte for byte. The staging folder becomes DEST with one
rename once every component is written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol, TypeVar

from ...errors import FormatError, UsageError
from ...formats import get_format, resolve_source, writable_formats
from ...formats.base import Source
from ...formats.names import is_commit_marker, is_single_file_weights, looks_like_index
from ...models import FileInfo
from ...sources.layouts.model_folders import Component, multi_folder
from ...storage.output import local_destination, resolve_destination, staged_output


class ComponentReport(Protocol):
    """What the single-checkpoint operation reports for one component: the files it wrote."""

    @property
    def files(self) -> list[FileInfo]: ...


R = TypeVar("R", bound=ComponentReport)


def component_targets() -> list[str]:
    """The formats a multi-folder model converts to: those its libraries load, the formats
    written as Hugging Face shards (`Format.shards_by_size`)."""
    return [name for name in writable_formats() if get_format(name).shards_by_size]


def components_of(source: Source) -> tuple[str, list[Component]] | None:
    """(layout, components) when `source` is a multi-folder model, else None. A Hub or
    object-store folder is one too: read flat, its `model_index.json` carried beside one file
    of every component's tensors would make an output no library loads. `source` is listed
    already; only its index file (`model_index.json`) is read."""
    if source.target is not None:
        return None
    found = multi_folder(source)
    if found is None:
        return None
    return found[0], found[1]


def component_source(src: str, components: list[Component], name: str) -> str | None:
    """The location of component `name` (`--select unet`), None when it is not a subfolder."""
    for comp in components:
        if comp.name == name.rstrip("."):
            if not comp.path:
                return None  # a root module: selected by prefix like any composite
            return f"{src.rstrip('/')}/{comp.path}"
    return None


#: where a root module's weights are written inside DEST before they move up beside the others
ROOT_SCRATCH = ".root-weights"


def write_components(
    src: str,
    dest: str,
    layout: str,
    components: list[Component],
    to: str,
    one: Callable[[Component, str, str, str], R],
    *,
    force: bool,
    dry_run: bool = False,
    skip: Collection[str] = (),
) -> tuple[list[FileInfo], list[R]]:
    """Write every component with `one(component, component_src, component_dest, target)`,
    copy the other files, publish DEST. Returns (files written, the per-component reports).

    The components named in `skip` are not written and their weight files not copied (convert's
    `--filter` / `--filter-out` left every entry of them out); their other files are.

    With `dry_run` nothing is staged, copied or published: `one` is asked for each
    component's plan (it must be a dry run itself), and the files are what would be written.
    """
    targets = component_targets()
    if to not in targets:
        # the example must be a component with weights: a scheduler alone is no checkpoint
        example = next((c for c in components if c.weights is not None), components[0])
        raise UsageError(
            f"a {layout} folder converts component by component to {' or '.join(targets)}",
            path=src,
            fix=f"Pick one component for --to {to}, e.g. --select {example.name}.",
        )
    absent = [c for c in components if c.absent]
    if absent:
        # the output would be a model its library cannot load: nothing is written
        raise FormatError(
            f"the {absent[0].name} component named by the folder's index has no folder, so "
            "the converted model could not be loaded",
            path=f"{src.rstrip('/')}/{absent[0].path}",
            fix="Copy or download the folder again (`ckpt verify` lists every one), or "
            "convert the components that are there one at a time with --select.",
        )
    lacking = [c for c in components if c.needs and c.weights is None]
    if lacking:
        # the output would be a model its library cannot load: nothing is written
        raise FormatError(
            f"the {lacking[0].name} component has no weights ({lacking[0].needs} is missing), "
            "so the converted model could not be loaded",
            path=f"{src.rstrip('/')}/{lacking[0].needs}",
            fix="Copy or download the missing file again (`ckpt verify` lists every one), or "
            "convert the components that are there one at a time with --select.",
        )
    dest_path = local_destination(resolve_destination(dest))
    if dest_path is None:
        raise UsageError(
            f"a {layout} folder is written to a local folder",
            path=dest,
            fix="Name a local folder as DEST, or convert one component with --select.",
        )
    if is_single_file_weights(dest_path.name):
        # a folder named `pipe.safetensors` is no file any loader opens, nor the model's folder
        example = next((c for c in components if c.weights is not None), components[0])
        raise UsageError(
            f"names one weights file, and a {layout} folder is written to a folder of components",
            path=dest,
            fix=f"Give DEST a folder name, or pick one component's weights for one file, e.g. "
            f"--select {example.name}.",
        )
    source = resolve_source(src)
    jobs, weight_files = _component_jobs(source.files, src.rstrip("/"), components)
    jobs = [(comp, inner_src) for comp, inner_src in jobs if comp.name not in skip]
    reports: list[R] = []
    files: list[FileInfo] = []
    if dry_run:
        for comp, inner_src in jobs:
            report = one(comp, inner_src, str(dest_path / (comp.path or ROOT_SCRATCH)), to)
            reports.append(report)
            files += _under(comp, _renamed(report.files, _root_names(src, comp, report.files)))
        planned = {info.path for info in files}
        files += [
            FileInfo(path=rel, size=size, entries=0)
            for rel, size in sorted(source.files.items())
            if rel not in weight_files and rel not in planned
        ]
        return files, reports
    with staged_output(dest_path, commit_marker=is_commit_marker, force=force) as staging:
        for comp, inner_src in jobs:
            inner_dest = staging / (comp.path or ROOT_SCRATCH)
            report = one(comp, inner_src, str(inner_dest), to)
            reports.append(report)
            names = _root_names(src, comp, report.files)
            if not comp.path:  # a root module moves up beside the other components' folders
                for child in sorted(inner_dest.iterdir()):
                    child.rename(staging / names.get(child.name, child.name))
                inner_dest.rmdir()
            files += _under(comp, _renamed(report.files, names))
        listed = {info.path for info in files}
        for rel in sorted(source.files):
            if rel in weight_files:
                continue
            target = staging / rel
            if target.exists():
                # a component wrote it beside its weights (a transformers text encoder's
                # `config.json`, carried as a model-folder file): in DEST all the same
                if rel not in listed:
                    files.append(FileInfo(path=rel, size=target.stat().st_size, entries=0))
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            size = _copy_file(source, rel, target)
            files.append(FileInfo(path=rel, size=size, entries=0))
    return files, reports


#: bytes of a carried file held at once
_COPY_CHUNK = 16 << 20
_ZEROS = bytes(_COPY_CHUNK)


def _copy_file(source: Source, rel: str, target: Path) -> int:
    """Copy `rel` of `source` to `target` a chunk at a time (never whole: a scheduler config
    extended to gigabytes, a sparse file, is a few bytes on disk), leaving a hole where the
    source reads zeros, so the copy takes the disk the source does. Returns its size."""
    size = source.storage.size(rel)
    with target.open("wb") as out:
        for offset in range(0, size, _COPY_CHUNK):
            chunk = source.storage.read(rel, offset, min(_COPY_CHUNK, size - offset))
            if chunk == _ZEROS[: len(chunk)]:
                out.seek(len(chunk), os.SEEK_CUR)
            else:
                out.write(chunk)
        out.truncate(size)  # a file ending in a hole: its length
    return size


def _component_jobs(
    listing: dict[str, int], root: str, components: list[Component]
) -> tuple[list[tuple[Component, str]], set[str]]:
    """(component, its source) for every weight-holding component, and the source files the
    single-checkpoint operation writes for them (the others are copied byte for byte)."""
    jobs: list[tuple[Component, str]] = []
    weight_files: set[str] = set()
    for comp in components:
        if comp.weights is None:
            continue
        # a root module (sentence-transformers' transformer) is written into a scratch folder,
        # then moved up beside the other components' folders
        jobs.append((comp, f"{root}/{comp.path}" if comp.path else f"{root}/{comp.weights}"))
        weight_files.update(component_weight_files(listing, comp))
    return jobs, weight_files


def component_weight_files(listing: dict[str, int] | Collection[str], comp: Component) -> list[str]:
    """The weight files (and index) of component `comp` among `listing` (paths from the
    root): those of its folder, or the root's own for a root module."""
    prefix = f"{comp.path}/" if comp.path else ""
    return sorted(
        n
        for n in listing
        if n.startswith(prefix) and "/" not in n[len(prefix) :] and _is_weights(n[len(prefix) :])
    )


def _root_names(src: str, comp: Component, written: list[FileInfo]) -> dict[str, str]:
    """The names a root module's files take in DEST: its library's (`adapter_model`, which
    `Component.stem` gives) for the one weights file written under the target's default name.
    A library that loads one file (peft) cannot load shards: those are refused."""
    if comp.path or not comp.stem:
        return {}
    weights = [f.path for f in written if _is_weights(f.path)]
    if len(weights) != 1 or looks_like_index(weights[0]):
        shards = [w for w in weights if not looks_like_index(w)]
        raise UsageError(
            f"the {comp.name} component would be cut into {len(shards)} shards, and its "
            f"library loads one {comp.stem} file",
            path=f"{src.rstrip('/')}/{comp.weights}",
            fix="Leave --max-shard-size out, or give a size above the component's.",
        )
    written_name = weights[0]
    suffix = written_name[written_name.index(".") :]
    return {written_name: f"{comp.stem}{suffix}"}


def _renamed(written: list[FileInfo], names: dict[str, str]) -> list[FileInfo]:
    return [info.model_copy(update={"path": names.get(info.path, info.path)}) for info in written]


def _under(comp: Component, written: list[FileInfo]) -> list[FileInfo]:
    """A component's files, named from DEST's root."""
    base = f"{comp.path}/" if comp.path else ""
    return [info.model_copy(update={"path": f"{base}{info.path}"}) for info in written]


def _is_weights(name: str) -> bool:
    return is_single_file_weights(name) or looks_like_index(name)
