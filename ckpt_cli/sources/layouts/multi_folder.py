"""Diffusers pipeline roots, sentence-transformers folders and folders of several PEFT adapters:
one composite of components."""

from __future__ import annotations

from ...formats.base import Source
from ...formats.names import index_format, weight_format
from ...models import Problem
from .base import Layout, OpenedSource
from .composite import Folder
from .model_folders import Component, LayoutInfo

#: the file that lists the components, per layout
_INDEX = {
    "sentence-transformers": "modules.json",
    "diffusers-pipeline": "model_index.json",
    "peft-adapters": "its adapter_config.json",
}
#: how the layout block names the whole, when its index names no class
_LABEL = {"sentence-transformers": "SentenceTransformer", "peft-adapters": "PEFT adapters"}


class MultiFolder(Layout):
    """A diffusers pipeline root (`model_index.json`), a sentence-transformers folder
    (`modules.json`) or a folder of several PEFT adapters (`adapter_config.json` at the root
    and in a subfolder per named adapter), one component per subfolder."""

    name = "multi-folder"
    holds_training_state = False

    def recognise(self, source: Source) -> bool:
        names = set(source.files)
        if source.target is not None:
            return False
        if "model_index.json" in names or "modules.json" in names:
            return True
        # peft saves every adapter but the default one in a subfolder named after it
        return "adapter_config.json" in names and any(
            n.endswith("/adapter_config.json") and n.count("/") == 1 for n in names
        )

    def open(self, source: Source) -> OpenedSource | None:
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
        folder = Folder(source)
        infos: list[ComponentInfo] = []
        for comp in components:
            info = ComponentInfo(name=comp.name, path=comp.path, kind=comp.kind)
            prefix = f"{comp.path}/" if comp.path else ""
            info.files = sorted(
                n for n in source.files if n.startswith(prefix) and (comp.path or "/" not in n)
            )
            if comp.weights is not None:
                fmt = index_format(comp.weights) or weight_format(comp.weights) or "safetensors"
                checkpoint = folder.add(comp.name, comp.weights, fmt)
                if checkpoint is not None:
                    manifest = checkpoint.manifest
                    info.tensors = sum(1 for e in manifest.entries if e.kind == "tensor")
                    info.parameters = manifest.parameters()
                    info.bytes = manifest.tensor_bytes()
            elif comp.absent:
                folder.problems.append(_missing(source, layout, comp, folder_gone=True))
            elif comp.needs:
                folder.problems.append(_missing(source, layout, comp, folder_gone=False))
            infos.append(info)
        checkpoint = folder.composite(layout)
        weighted = [i for i in infos if i.tensors]
        label = details.get("pipeline") or _LABEL.get(layout, layout)
        description = (
            f"{label}: {len(infos)} components ({', '.join(i.name for i in infos)}), "
            f"{len(weighted)} with weights"
        )
        summary = LayoutInfo(
            layout=layout, description=description, details=details, components=infos
        )
        return OpenedSource(
            checkpoint=checkpoint,
            problems=list(folder.problems),
            parts=dict(folder.parts),
            layout=summary,
        )


def _missing(source: Source, layout: str, comp: Component, *, folder_gone: bool) -> Problem:
    """A component the folder's index names has no folder at all (a deleted `unet/`), or has
    one without the weights its library saves there: the model cannot load, like a lost
    shard."""
    index = _INDEX.get(layout, "the folder's index")
    kind = (comp.kind or "").rsplit(".", 1)[-1] or "module"
    if folder_gone:
        code, lacking, what = "missing_component", "its folder is not in the checkpoint", "folder"
    else:
        code, what = "missing_component_weights", "file"
        lacking = "no weights file of it is in the folder, where its library saves them"
    return Problem(
        code=code,
        message=f"is missing: {index} names the {comp.name} component ({kind}), and "
        f"{lacking}; the model cannot be loaded without it",
        file=source.storage.describe(comp.path if folder_gone else comp.needs),
        fix=f"Copy or download the {what} again.",
    )
