"""Typed `Manifest.details` of the training-layout side (issue #14 §1 "typed details").

`Manifest.details` is a JSON dict each format fills with its own keys; readers used to pick
keys out of it by name. The layouts' part of it is declared here as a pydantic model: the
writer builds the model and stores its `model_dump()` (so the JSON output is unchanged, key for
key), and a reader asks `CompositeDetails.of(manifest)` for a typed view instead of reading
strings out of a dict.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..models import Manifest


class CompositeDetails(BaseModel):
    """`details` of a training folder opened as one composite checkpoint.

    Attributes:
        layout: the training layout token (`hf-trainer`, `accelerate`, `deepspeed`...).
        components: each component (`model`, `optimizer`, `rng_1`...) -> its format token
            (`safetensors`, `torch`, `dcp`, `json`, `opaque`).
    """

    model_config = ConfigDict(extra="forbid")

    layout: str
    components: dict[str, str]

    def as_details(self) -> dict[str, Any]:
        """What goes into `Manifest.details` (and the JSON output): the fields, in order."""
        return self.model_dump()

    @classmethod
    def of(cls, manifest: Manifest) -> CompositeDetails | None:
        """The typed details of a composite manifest; None for any other manifest (or one
        whose details were not written by `CompositeCheckpoint`)."""
        if manifest.format != "composite":
            return None
        fields = {k: manifest.details[k] for k in cls.model_fields if k in manifest.details}
        try:
            return cls.model_validate(fields)
        except ValidationError:
            return None
