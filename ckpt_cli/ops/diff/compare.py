"""Comparing one pair of entries for `diff`: tensor difference statistics and non-tensor values.

Statistics are computed over slices so the float64 working copies stay small; values are
compared structurally (containers, arrays, NaN-aware floats) and shown shortened.
"""

from __future__ import annotations

import io
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


#: elements per slice when computing difference statistics
STATS_SLICE = 1 << 20
#: longest value shown for a non-tensor entry
MAX_VALUE_REPR = 120


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
    flat = t.reshape(-1)
    if flat.element_size() == 16:  # complex128: two int64 per element
        return flat.view(torch.int64).reshape(-1, 2)
    return flat.view(view[flat.element_size()])


def _values(t: torch.Tensor) -> torch.Tensor:
    import torch

    if t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        # packed 4-bit pairs have no conversion kernels: compare (and measure) the raw bytes
        return t.view(torch.uint8).to(torch.float64)
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def tensor_stats(
    a: torch.Tensor, b: torch.Tensor, atol: float | None, rtol: float | None
) -> tuple[int, int | None, float, float]:
    """(differing elements, elements outside tolerance or None, max abs, max rel) of a pair.

    `a` and `b` have the same shape. NaNs in the same place count as equal values; a NaN
    against a number is an infinite difference. Computed over slices of `STATS_SLICE`
    elements so the float64 copies stay small.
    """
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    same_dtype = a.dtype == b.dtype
    differing = 0
    outside = 0 if (atol is not None or rtol is not None) else None
    max_abs = 0.0
    max_rel = 0.0
    for start in range(0, fa.numel(), STATS_SLICE):
        sa, sb = fa[start : start + STATS_SLICE], fb[start : start + STATS_SLICE]
        va, vb = _values(sa), _values(sb)
        if same_dtype:
            neq = _bits(sa) != _bits(sb)
            if neq.dim() == 2:
                neq = neq.any(dim=1)
        else:
            neq = ~((va == vb) | (va.isnan() & vb.isnan()))
        count = int(neq.sum())
        if not count:
            continue
        differing += count
        diff = (va - vb).abs().to(torch.float64)
        both_nan = va.isnan() & vb.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
        scale = vb.abs().to(torch.float64)
        rel = torch.where(
            diff == 0, torch.zeros_like(diff), diff / torch.where(scale == 0, 0.0, scale)
        )
        rel = torch.where(rel.isnan(), torch.full_like(rel, math.inf), rel)
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(rel.max()))
        if outside is not None:
            bound = (atol or 0.0) + (rtol or 0.0) * scale
            outside += int(((diff > bound) & neq).sum())
    return differing, outside, max_abs, max_rel


def _plain(value: Any) -> Any:
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray":
        # arrays (numpy RNG states) compare by dtype, shape and bytes, not elementwise `==`
        return ("numpy.ndarray", value.dtype.str, value.shape, value.tobytes())
    if f"{kind.__module__}.{kind.__name__}" in ("torch.Generator", "torch._C.Generator"):
        # a Generator compares by identity; its device and RNG state are what it holds
        return ("torch.Generator", str(value.device), value.get_state())
    return value


def _is_ndarray(value: Any) -> bool:
    """Whether `value` is a numpy array or numpy scalar (without importing numpy for others)."""
    return type(value).__module__ == "numpy" and hasattr(value, "tobytes")


def values_equal(x: Any, y: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality for non-tensor entries (tensors bit-exact, NaN equal to NaN).

    A pair of shared sub-objects is compared once (`_seen`): a "billion laughs" graph of
    2^40 paths costs its size, not its paths.
    """
    # no value is a tensor unless torch was imported to make it: comparing plain values (a
    # python RNG state, raw bytes) must not pay torch's import
    torch = sys.modules.get("torch")

    _seen = set() if _seen is None else _seen
    if isinstance(x, dict | list | tuple) and isinstance(y, dict | list | tuple):
        if (id(x), id(y)) in _seen:
            return True  # compared already (or being compared, up the stack)
        _seen.add((id(x), id(y)))
    x, y = _plain(x), _plain(y)
    if torch is not None and (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and bool((_bits(x.contiguous()) == _bits(y.contiguous())).all())
        )
    if _is_ndarray(x) or _is_ndarray(y):
        # RNG states (`('MT19937', array([...]), ...)`) hold numpy arrays, whose `==` is
        # element-wise: compare dtype, shape and bytes instead
        return (
            _is_ndarray(x)
            and _is_ndarray(y)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.tobytes() == y.tobytes()
        )
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(values_equal(x[k], y[k], _seen) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(
            values_equal(p, q, _seen) for p, q in zip(x, y, strict=True)
        )
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return bool(x == y) and type(x) is type(y)
    except Exception:
        return False


def short_repr(value: Any) -> str:
    """A one-line representation of a non-tensor value for reports."""
    import torch

    value = _plain(value)
    if isinstance(value, bytes | bytearray):
        import hashlib

        return f"<{len(value)} bytes, sha256 {hashlib.sha256(value).hexdigest()[:12]}>"
    if isinstance(value, torch.Tensor):
        return f"<tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}>"
    text = repr(value)
    return text if len(text) <= MAX_VALUE_REPR else text[: MAX_VALUE_REPR - 1] + "…"


def error_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b|, relative RMS error sqrt(sum((a-b)^2) / sum(b^2))), over slices in float64."""
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    max_abs, err, ref = 0.0, 0.0, 0.0
    for start in range(0, fa.numel(), STATS_SLICE):
        va = fa[start : start + STATS_SLICE].to(torch.float64)
        vb = fb[start : start + STATS_SLICE].to(torch.float64)
        d = va - vb
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
        err += float((d * d).sum())
        ref += float((vb * vb).sum())
    rel = math.sqrt(err / ref) if ref else (0.0 if err == 0 else math.inf)
    return max_abs, rel
