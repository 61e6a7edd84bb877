"""Inert records: stand-ins for the data-only classes frameworks pickle into checkpoints.

torch.load is given these classes for the names in `INERT_CLASSES` / `INERT_DICTS` (see
`load`), and ckpt's own zip reader (`zip_index`) builds the same ones: their pickled arguments
and state are kept, their code is never imported or run.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

__all__ = ["INERT", "INERT_CLASSES", "INERT_DICTS", "InertDict", "InertObject"]

#: classes DeepSpeed pickles into its checkpoints that only carry data (loss scaler settings,
#: the ZeRO stage, parameter fragment addresses). They load as inert records: their pickled
#: state is kept, their code is never imported or run. Without them no ZeRO optimizer file
#: loads under weights_only.
INERT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    # hyper-parameters of older Lightning checkpoints
    "argparse.Namespace",
)
#: dict subclasses that carry plain mappings (Lightning's hyper-parameters): loaded as dicts
INERT_DICTS = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
)


class InertObject:
    """A stand-in for an allow-listed class: holds the pickled arguments and state, no code."""

    original: ClassVar[str] = ""
    # class-level defaults: NEWOBJ builds instances without calling __init__
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.state = kwargs or None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __deepcopy__(self, memo: dict[int, Any]) -> InertObject:
        new = type(self).__new__(type(self))
        new.args = copy.deepcopy(self.args, memo)
        new.state = copy.deepcopy(self.state, memo)
        return new

    def as_plain(self) -> dict[str, Any]:
        """What the torch writer stores instead (the original class is not importable here)."""
        return {"__class__": self.original, "args": list(self.args), "state": self.state}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.args == other.args and self.state == other.state

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<inert {self.original} args={self.args!r} state={self.state!r}>"


class InertDict:
    """A stand-in for an allow-listed dict subclass: unpickles as a plain dict (its items follow
    through SETITEMS, which torch's loader allows on plain dicts only)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return {}


INERT: dict[str, type] = {
    name: type(name.rsplit(".", 1)[1], (InertObject,), {"original": name}) for name in INERT_CLASSES
}
INERT.update(
    {name: type(name.rsplit(".", 1)[1], (InertDict,), {"original": name}) for name in INERT_DICTS}
)
