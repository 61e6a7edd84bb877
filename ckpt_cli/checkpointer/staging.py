"""The host staging buffer: the state dict copied into CPU memory allocated once and reused.

`save` must not hold the training loop for longer than a memory copy, and the background
writer must not see tensors the next optimizer step changes. `HostStaging.stage` walks the
state dict the way DCP does (mappings and lists are traversed, everything else is a leaf) and
copies every tensor into a CPU tensor of its own, kept between saves: the first save
allocates (and pins, when the tensors live on an accelerator), later saves only copy. A tensor
whose shape, dtype or layout changed gets a new buffer (logged). A `DTensor` is staged as its
local shard and rewrapped with the same mesh and placements, so DCP plans the same shards.
Non-tensor leaves (counters, RNG tuples, scheduler settings) are deep-copied: they are small.
A leaf that cannot be copied (a generator, a lock, an open file) is refused with a `UsageError`
naming its entry: nothing could save it. So is a leaf whose pickle names a class ckpt's
restricted reader refuses (torch's plain `DataLoader`, any object without `state_dict`): its save
would fail its check in the background, every save of the run alike, and `load_latest` could
never read it. Plain scalars, strings and containers of them are admitted without a look; other
leaves are serialised as DCP serialises them (`torch.save`) and their pickle's globals read,
before the deep copy.

Each buffer has the shape of its tensor and owns its storage (no views into one flat slab):
DCP's writer clones any tensor whose storage is larger than itself before serialising it, so
views would cost a second copy on every save.
"""

from __future__ import annotations

import copy
import io
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError
from ..formats.torch.pickle_scan import refused_globals

#: a key in the state dict, as DCP's traversal names it (dict keys, list indices)
Path = tuple[str | int, ...]


class HostStaging:
    """CPU copies of a state dict's tensors, allocated on the first `stage` and reused.

    Args:
        pin_memory: pin the buffers (faster device-to-host copies); default: when CUDA is
            available.
        logger: where re-allocations are reported.
    """

    def __init__(self, *, pin_memory: bool | None = None, logger: logging.Logger | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[Path, torch.Tensor] = {}
        self._log = logger or logging.getLogger(__name__)
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        # a snapshot of the values first: `status()` may ask from another thread mid-`stage`
        return sum(b.numel() * b.element_size() for b in list(self._buffers.values()))

    def stage(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """A copy of `state` whose tensors live in the staging buffers; (copy, tensor bytes).

        Device-to-host copies are issued non-blocking into pinned buffers and synchronized
        once at the end, so the copy is done when this returns.
        """
        seen: set[Path] = set()
        copied = [0]
        # never inference tensors, even for a save called inside `torch.inference_mode()` (an
        # evaluation step): a later save outside it could not copy into them
        with torch.inference_mode(False):
            staged = {
                str(k): self._stage_value((str(k),), v, seen, copied) for k, v in state.items()
            }
        for stale in set(self._buffers) - seen:  # an entry the state no longer has
            del self._buffers[stale]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged, copied[0]

    def _stage_value(self, path: Path, value: Any, seen: set[Path], copied: list[int]) -> Any:
        if isinstance(value, Mapping):
            return {
                k: self._stage_value((*path, str(k)), v, seen, copied) for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._stage_value((*path, i), v, seen, copied) for i, v in enumerate(value)]
        if isinstance(value, torch.Tensor):
            seen.add(path)
            return self._stage_tensor(path, value, copied)
        refuse_unloadable(path, value)
        try:
            return copy.deepcopy(value)
        except Exception as exc:  # pickling protocols raise TypeError, but also anything else
            raise UsageError(
                f"the state entry {'.'.join(map(str, path))!r} cannot be copied for the save "
                f"({type(exc).__name__}: {exc})",
                fix="Save plain values (numbers, strings, lists, dicts, tensors, numpy arrays) "
                "or an object with state_dict() and load_state_dict(), which is saved through its "
                "state_dict().",
            ) from exc

    def _stage_tensor(self, path: Path, tensor: torch.Tensor, copied: list[int]) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            local = self._copy_into(path, tensor.to_local(), copied)
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return self._copy_into(path, tensor, copied)

    def _copy_into(self, path: Path, tensor: torch.Tensor, copied: list[int]) -> torch.Tensor:
        _refuse_dataless(path, tensor)
        source = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if buffer is not None:
                self._log.info(
                    "staging buffer for %s re-allocated: %s %s -> %s %s",
                    ".".join(map(str, path)),
                    buffer.dtype,
                    tuple(buffer.shape),
                    source.dtype,
                    tuple(source.shape),
                )
            pin = self.pin_memory and source.device.type != "cpu"
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buffer
            self.allocations += 1
        buffer.copy_(source, non_blocking=buffer.is_pinned())
        copied[0] += buffer.numel() * buffer.element_size()
        return buffer


#: leaves whose pickle names no global at all, or only one every reader admits
_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


def _plain(value: Any) -> bool:
    if type(value) in _PLAIN:
        return True
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(value) is numpy.ndarray and not value.dtype.hasobject:
        # an array of numbers (an RNG state, a replay buffer): ckpt's reader admits it, and
        # serialising a large one here would double the copy that holds the loop
        return True
    if type(value) in (tuple, torch.Size):
        return all(_plain(v) or isinstance(v, torch.Tensor) for v in value)
    return False


def refuse_unloadable(path: Path, value: Any) -> None:
    """Refuse a leaf whose pickle (as DCP's `torch.save` writes it) names a global ckpt's
    restricted reader refuses, naming the entry: its save would fail its check, and
    `load_latest` could not read it without running code."""
    if _plain(value):
        return
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception:  # not picklable: the deep copy that follows names the entry
        return
    refused = refused_globals(buffer.getvalue())
    if not refused:
        return
    entry = ".".join(map(str, path))
    raise UsageError(
        f"the state entry {entry!r} ({type(value).__name__}) would be saved as a pickle that "
        f"needs {', '.join(refused[:5])}, which ckpt's restricted reader (torch.load "
        "weights_only) refuses: load_latest could not read it without running code",
        fix="Save plain values (numbers, strings, lists, dicts, tensors, numpy arrays) or an "
        "object with state_dict() and load_state_dict(), which is saved through its "
        "state_dict() (for a data loader, torchdata's StatefulDataLoader).",
    )


def _refuse_dataless(path: Path, tensor: torch.Tensor) -> None:
    """Refuse a tensor a save cannot hold as it is, naming the entry (torch's own copy error,
    `copy_() between dense and sparse Tensors is not implemented!`, names none): a sparse or
    other non-strided layout (DCP writes dense tensors), one on the meta device (no data), and
    a quantized one (`torch.qint8`: its copy fails inside torch)."""
    entry = ".".join(map(str, path))
    if tensor.device.type == "meta":
        raise UsageError(
            f"the state entry {entry!r} is a tensor on the meta device: it holds no data to save",
            fix="Materialise the module before saving (`module.to_empty(device=...)` and its "
            "initialisation, or load its weights), or leave the entry out of the state.",
        )
    if tensor.is_quantized:
        raise UsageError(
            f"the state entry {entry!r} is a quantized {str(tensor.dtype).removeprefix('torch.')} "
            "tensor (torch's deprecated quantized tensors): a save holds plain tensors",
            fix="Save its plain form (`t.dequantize()`), or its parts (`t.int_repr()` with "
            "`t.q_scale()` and `t.q_zero_point()`).",
        )
    if tensor.layout != torch.strided:
        raise UsageError(
            f"the state entry {entry!r} is a {str(tensor.layout).removeprefix('torch.')} "
            "tensor: a save holds dense (strided) tensors",
            fix="Save its dense form (`t.to_dense()`), or its parts as plain tensors (for a "
            "sparse COO tensor `t.indices()`, `t.values()` and `list(t.shape)`).",
        )
