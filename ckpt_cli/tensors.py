"""Torch helpers for data paths (imported only by commands that move tensor data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .dtypes import storage_nbytes, torch_layout

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a canonical dtype token."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise KeyError(name)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical token of a torch dtype (`torch.bfloat16` -> `bfloat16`)."""
    return str(dtype).removeprefix("torch.")


def torch_view(dtype: str, shape: list[int], name: str = "") -> tuple[str, list[int]]:
    """The torch dtype token and shape holding a stored tensor (`dtypes.torch_layout`).

    Raises FormatError naming the tensor when torch has no dtype for it (F6, odd F4), so a
    caller reading many tensors reports that one and goes on.
    """
    layout = torch_layout(dtype, shape)
    if layout is None:
        from .errors import FormatError

        raise FormatError(
            f"tensor {name!r} is {dtype}{shape}, which torch has no dtype for",
            path=name or dtype,
            fix="Copy it as raw bytes (convert --to safetensors), or leave it out with --filter-out.",
        )
    return layout


def tensor_from_bytes(
    data: bytes | bytearray | memoryview, dtype: str, shape: list[int]
) -> torch.Tensor:
    """A tensor viewing a copy of raw little-endian C-order bytes."""
    import torch

    expected = storage_nbytes(dtype, shape)
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes for {dtype}{shape}, expected {expected}")
    dtype, shape = torch_view(dtype, shape)
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    buf = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(torch_dtype(dtype)).reshape(shape)


def read_tensor_from_fd(
    fd: int, offset: int, dtype: str, shape: list[int], name: str
) -> torch.Tensor:
    """Read a raw tensor straight into a fresh tensor's memory with `os.preadv` (one copy)."""
    import os

    import torch

    dtype, shape = torch_view(dtype, shape, name)
    nbytes = storage_nbytes(dtype, shape) or 0
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                from .errors import FormatError

                raise FormatError(
                    f"is truncated inside tensor {name!r} ({got} of {nbytes} bytes present)",
                    path=name,
                    fix="The file was cut short; write or fetch it again.",
                )
            got += n
    return out.view(torch_dtype(dtype)).reshape(shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw C-order bytes of a CPU tensor's values, without copying when already contiguous
    (a conjugate or negative view is materialised: its stored bytes are not its values)."""
    import torch

    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
