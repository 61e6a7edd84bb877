"""Typed `Manifest.details`: one pydantic model per format (issue #14 §1).

`Manifest.details` is the JSON dict a format fills with its own facts (DCP serialization and
world size, a weight-map index, GGUF's metadata...). Each format declares its model here and
names it as `Format.details_model`; the reader builds the model and stores `as_details()` (so
the JSON output keeps the same keys), and an operation asks `Model.of(manifest)` for a typed
view instead of picking strings out of a dict. Keys added beside a format's own (the Hub's
`hub` origin, `dequantized`) are not part of the model and are left where they are.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import ConfigDict, Field, ValidationError

from ..models import Manifest, Record


class FormatDetails(Record):
    """The typed details of one format's manifests.

    Attributes:
        layout: a named layout of the format that brings files of its own
            (`megatron_torch_dist`: `metadata.json` beside the DCP files; see
            `Format.layout_files`); None for the plain format.
    """

    model_config = ConfigDict(extra="forbid")
    #: the manifest formats whose details this model describes
    formats: ClassVar[tuple[str, ...]] = ()

    layout: str | None = None

    def as_details(self) -> dict[str, Any]:
        """What goes into `Manifest.details` (and the JSON output): the fields that were set."""
        return self.model_dump(exclude_unset=True)

    @classmethod
    def of(cls, manifest: Manifest) -> Self | None:
        """The typed view of `manifest.details`; None when the manifest is of another format
        or its details were not written by that format's reader."""
        if manifest.format not in cls.formats:
            return None
        fields = {k: manifest.details[k] for k in cls.model_fields if k in manifest.details}
        try:
            return cls.model_validate(fields)
        except ValidationError:
            return None


class PlainDetails(FormatDetails):
    """Formats without details of their own (the default `Format.details_model`)."""

    formats: ClassVar[tuple[str, ...]] = ()


class IndexedDetails(FormatDetails):
    """Formats sharded with a Hugging Face weight-map index (`*.index.json`).

    Attributes:
        sharded: whether an index names the shards.
        index: the index file (relative to the checkpoint), when sharded.
        weight_map_size: how many entries the index maps.
        total_size: the index's declared `metadata.total_size`, when it has one.
    """

    formats: ClassVar[tuple[str, ...]] = ("safetensors", "torch")

    sharded: bool = False
    index: str | None = None
    weight_map_size: int | None = None
    total_size: int | None = None


class SafetensorsDetails(IndexedDetails):
    """safetensors files.

    Attributes:
        unsupported_tensors: tensors whose dtype code ckpt cannot handle (name -> code);
            the rest of the file is still read.
    """

    formats: ClassVar[tuple[str, ...]] = ("safetensors",)

    unsupported_tensors: dict[str, str] | None = None


class TorchDetails(IndexedDetails):
    """torch.save files.

    Attributes:
        shared_tensors: groups of tensor names that view one storage (tied weights).
        legacy_format: files in torch's pre-1.6 (non-zip) serialization.
    """

    formats: ClassVar[tuple[str, ...]] = ("torch",)

    shared_tensors: list[list[str]] | None = None
    legacy_format: list[str] | None = None


class DcpDetails(FormatDetails):
    """PyTorch Distributed Checkpoint folders.

    Attributes:
        serialization: how items are stored (`torch_save`, `safetensors`, `hf_safetensors`,
            `mixed`, or `none` without tensors).
        world_size: the ranks that saved it.
        chunks: stored tensor chunks.
        objects_bytes: bytes of the non-tensor entries.
        version: the `.metadata` version torch recorded, if any.
        compression: stream transforms by name -> items (`{"zstd": 12}`).
        megatron: Megatron-Core's `metadata.json` and `common.pt` summary (layout
            `megatron_torch_dist`).
    """

    formats: ClassVar[tuple[str, ...]] = ("dcp",)

    serialization: str = "none"
    world_size: int = 1
    chunks: int = 0
    objects_bytes: int = 0
    version: str | None = None
    compression: dict[str, int] | None = None
    megatron: dict[str, Any] | None = None


class GgufDetails(FormatDetails):
    """GGUF files (llama.cpp).

    Attributes:
        gguf_version: the file format version.
        architecture: `general.architecture`.
        tensor_types: GGML type name -> tensors of that type.
        metadata: the key-value metadata (large arrays summarised).
        split: `{"count": N, "files": M}` for `-0000k-of-0000n.gguf` splits.
        byte_order: `big` for files written big-endian (`mixed`: some of the splits); unset
            for little-endian ones, the usual kind. Tensors are read as their values either way.
    """

    formats: ClassVar[tuple[str, ...]] = ("gguf",)

    gguf_version: int
    architecture: str | None = None
    tensor_types: dict[str, int] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    split: dict[str, int] | None = None
    byte_order: str | None = None
