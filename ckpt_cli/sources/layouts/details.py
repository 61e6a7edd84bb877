"""Typed `Manifest.details` of the training-layout side (issue #14 §1 "typed details").

`Manifest.details` is a JSON dict each format fills with its own keys (see `formats.details`,
the formats' models); the layouts' part of it is declared here the same way: the
writer builds the model and stores its `model_dump()` (so the JSON output is unchanged, key for
key), and a reader asks `CompositeDetails.of(manifest)` for a typed view instead of reading
strings out of a dict.
"""

from __future__ import annotations

from typing import ClassVar

from ...formats.details import FormatDetails


class CompositeDetails(FormatDetails):
    """`details` of a training folder opened as one composite checkpoint.

    Attributes:
        layout: the training layout token (`hf-trainer`, `accelerate`, `deepspeed`...).
        components: each component (`model`, `optimizer`, `rng_1`...) -> its format token
            (`safetensors`, `torch`, `dcp`, `json`, `opaque`).
    """

    formats: ClassVar[tuple[str, ...]] = ("composite",)

    layout: str
    components: dict[str, str]


class ZeroDetails(FormatDetails):
    """`details` of DeepSpeed ZeRO partitions opened as the fp32 weights they rebuild.

    Attributes:
        zero_stage: the ZeRO stage (1, 2 or 3).
        world_size: the data-parallel ranks whose partitions hold the weights.
        mp_world_size: the model-parallel ranks (each rebuilt on its own).
    """

    formats: ClassVar[tuple[str, ...]] = ("zero",)

    zero_stage: int
    world_size: int
    mp_world_size: int
