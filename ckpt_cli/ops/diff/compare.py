"""Comparing one pair of entries for `diff`: tensor difference statistics and non-tensor values.

Statistics are computed over slices so the float64 working copies stay small; values are
compared structurally (containers, arrays, NaN-aware floats) and shown shortened.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


#: E2M1 values by 4-bit code (sign in bit 3): what a packed F4 byte's two nibbles hold
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_LOW32 = 0xFFFFFFFF


def per_element(t: torch.Tensor) -> int:
    """Values a stored element of `t` holds: 2 for packed E2M1 pairs (`float4_e2m1fn_x2`)."""
    import torch

    return 2 if t.dtype == getattr(torch, "float4_e2m1fn_x2", None) else 1


def values_of(t: torch.Tensor) -> int:
    """How many values `t` holds (its elements, both nibbles of a packed F4 byte counted)."""
    return t.numel() * per_element(t)


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) and per_element(t) == 1


@dataclass
class _Slice:
    """One side's values at some positions: `bits` (bit patterns, one row a value), `values`
    (float64 / complex128) and, for integer dtypes, the exact value as `hi * 2^32 + lo`."""

    bits: torch.Tensor
    values: torch.Tensor
    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None


def _slice(flat: torch.Tensor, start: int, stop: int) -> _Slice:
    """Values `start:stop` of a flattened tensor (positions count values, not packed bytes)."""
    import torch

    if per_element(flat) == 2:
        # packed 4-bit pairs (low nibble first) have no conversion kernels: unpack the codes
        raw = flat[start // 2 : (stop + 1) // 2].view(torch.uint8)
        codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(-1)[start % 2 :]
        codes = codes[: stop - start].to(torch.long)
        values = torch.tensor(_E2M1, dtype=torch.float64)[codes]
        return _Slice(bits=codes, values=values)
    part = flat[start:stop]
    if part.is_complex():
        return _Slice(bits=_bits(part), values=part.to(torch.complex128))
    if not _integer(part):
        return _Slice(bits=_bits(part), values=part.to(torch.float64))
    # integers: exact as hi * 2^32 + lo (float64 holds only 53 bits: 2**53 + 1 == 2**53)
    if part.dtype == getattr(torch, "uint64", None):
        raw = part.view(torch.int64)
        hi, lo = (raw >> 32) & _LOW32, raw & _LOW32
    else:
        wide = part.to(torch.int64)
        hi, lo = wide >> 32, wide & _LOW32
    value = hi.to(torch.float64) * 2.0**32 + lo.to(torch.float64)
    return _Slice(bits=_bits(part), values=value, hi=hi, lo=lo)


def _integral_differs(hi: torch.Tensor, lo: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Exactly where integers (`hi * 2^32 + lo`) differ from float64 values `f`."""
    import torch

    integral = torch.isfinite(f) & (f == f.trunc()) & (f.abs() < 2.0**63)
    as_int = torch.where(integral, f, torch.zeros_like(f)).to(torch.int64)
    return ~(integral & ((as_int >> 32) == hi) & ((as_int & _LOW32) == lo))


def tensor_stats(
    a: torch.Tensor, b: torch.Tensor, atol: float | None, rtol: float | None
) -> tuple[int, int | None, float, float]:
    """(differing values, values outside tolerance or None, max abs, max rel) of a pair.

    `a` and `b` hold as many values (a packed F4 byte counts as its two E2M1 values, compared
    by value). NaNs in the same place count as equal values; a NaN against a number is an
    infinite difference. Integers are compared exactly: their difference is the exact integer
    difference (rounded once to float64 only to report it and to hold it against the
    tolerance), never the difference of their float64 roundings. Computed over slices of
    `STATS_SLICE` values so the float64 copies stay small.
    """
    import torch

    fa, fb = a.reshape(-1), b.reshape(-1)
    same_dtype = a.dtype == b.dtype
    differing = 0
    outside = 0 if (atol is not None or rtol is not None) else None
    max_abs = 0.0
    max_rel = 0.0
    for start in range(0, values_of(a), STATS_SLICE):
        stop = min(start + STATS_SLICE, values_of(a))
        sa, sb = _slice(fa, start, stop), _slice(fb, start, stop)
        va, vb = sa.values, sb.values
        ints = sa.hi is not None and sb.hi is not None
        # an integer side against a real floating side: compared exactly too
        mixed = (sa.hi is None) != (sb.hi is None) and not (va.is_complex() or vb.is_complex())
        if same_dtype:
            neq = sa.bits != sb.bits
            if neq.dim() == 2:
                neq = neq.any(dim=1)
        elif sa.hi is not None and sb.hi is not None and sa.lo is not None and sb.lo is not None:
            neq = (sa.hi != sb.hi) | (sa.lo != sb.lo)
        elif mixed and sa.hi is not None and sa.lo is not None:
            neq = _integral_differs(sa.hi, sa.lo, vb)
        elif mixed and sb.hi is not None and sb.lo is not None:
            neq = _integral_differs(sb.hi, sb.lo, va)
        else:
            neq = ~((va == vb) | (va.isnan() & vb.isnan()))
        count = int(neq.sum())
        if not count:
            continue
        differing += count
        if (
            ints
            and sa.hi is not None
            and sb.hi is not None
            and sa.lo is not None
            and sb.lo is not None
        ):
            # the exact difference (hi and lo parts each exact in float64), rounded once
            diff = (
                (sa.hi - sb.hi).to(torch.float64) * 2.0**32 + (sa.lo - sb.lo).to(torch.float64)
            ).abs()
        else:
            diff = (va - vb).abs().to(torch.float64)
        both_nan = va.isnan() & vb.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
        if mixed:
            # an integer against an integral float past 2^53: differing, by one at least
            diff = torch.where(neq & (diff == 0) & ~both_nan, torch.ones_like(diff), diff)
        # equal values differ by nothing, whatever `inf - inf` (NaN) makes of them
        diff = torch.where(neq, diff, torch.zeros_like(diff))
        # an infinity against any other value, or a NaN against a number, is no rounding
        # error: outside every tolerance (`rtol * inf` is NaN or inf, a bound it would pass)
        unbounded = neq & ~both_nan & ~(va.isfinite() & vb.isfinite())
        scale = vb.abs().to(torch.float64)
        rel = torch.where(
            diff == 0, torch.zeros_like(diff), diff / torch.where(scale == 0, 0.0, scale)
        )
        rel = torch.where(rel.isnan(), torch.full_like(rel, math.inf), rel)
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(rel.max()))
        if outside is not None:
            bound = (atol or 0.0) + (rtol or 0.0) * scale
            outside += int((((diff > bound) | unbounded) & neq).sum())
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


class _NotPlain(Exception):
    """A value that is no plain data (see `_PlainPickler`)."""


class _PlainPickler(pickle.Pickler):
    """Pickles plain data only: pickle asks `reducer_override` about every value that is no
    dict, list, tuple, set, str, bytes, number, bool or None, and this refuses it before a
    byte of it is written (a tensor's data is never copied to be compared)."""

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlain


def _plain_bytes(value: Any) -> bytes:
    out = io.BytesIO()
    _PlainPickler(out, protocol=4).dump(value)
    return out.getvalue()


def _same_plain_data(x: Any, y: Any) -> bool:
    """Whether `x` and `y` are the same plain data, told by their pickles: equal bytes are the
    same containers, keys, types, strings and float bits, which `values_equal` calls equal. A
    300,000-row `log_history` compares in 0.3 s, not 15 s node by node. False says nothing:
    the node walk decides (dict order, sharing, a value that is no plain data)."""
    try:
        return _plain_bytes(x) == _plain_bytes(y)
    except Exception:  # no plain data, or anything pickle refuses: the walk's to compare
        return False


def values_equal(x: Any, y: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality for non-tensor entries (tensors and floats bit-exact: `-0.0` is not
    `0.0`, a NaN equals a NaN of the same bits).

    A pair of shared sub-objects is compared once (`_seen`): a "billion laughs" graph of
    2^40 paths costs its size, not its paths.
    """
    # no value is a tensor unless torch was imported to make it: comparing plain values (a
    # python RNG state, raw bytes) must not pay torch's import
    torch = sys.modules.get("torch")

    if _seen is None and type(x) in (dict, list) and _same_plain_data(x, y):
        return True
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
    if isinstance(x, float) and isinstance(y, float):
        # bit for bit, as tensors are: `-0.0 == 0.0` in Python, yet a difference in a tensor
        # (and to `math.copysign`, `1 / x`); a NaN equals a NaN of the same bits
        return struct.pack("<d", x) == struct.pack("<d", y)
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
    text = bounded_repr(value, MAX_VALUE_REPR)
    return text if len(text) <= MAX_VALUE_REPR else text[: MAX_VALUE_REPR - 1] + "…"


#: an int wider than this is shown by its width: Python refuses to print one of more than 4,300
#: digits (`sys.get_int_max_str_digits`), and printing takes time quadratic in its digits
_MAX_INT_BITS_SHOWN = 4096


class _Value:
    """A value still to be shown (beside the text pieces on `bounded_repr`'s stack)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _container_pieces(value: Any) -> Iterator[str | _Value] | None:
    """The pieces of a container's repr (text, and its items to show in turn), or None for a
    value that is no dict, list, tuple, set or frozenset."""

    def items(values: Iterable[Any], open_: str, close: str) -> Iterator[str | _Value]:
        yield open_
        for i, item in enumerate(values):
            if i:
                yield ", "
            yield _Value(item)
        yield close

    def pairs(mapping: dict[Any, Any], open_: str, close: str) -> Iterator[str | _Value]:
        yield open_
        for i, (key, item) in enumerate(mapping.items()):
            yield from (", " if i else "", _Value(key), ": ", _Value(item))
        yield close

    kind = type(value)
    if kind is list:
        return items(value, "[", "]")
    if kind is tuple:
        return items(value, "(", ",)" if len(value) == 1 else ")")
    if kind is dict:
        return pairs(value, "{", "}")
    if isinstance(value, dict):  # OrderedDict, as a state dict loads
        return pairs(value, f"{kind.__name__}({{", "})")
    if kind is set:
        return items(value, "{", "}") if value else iter(["set()"])
    if kind is frozenset:
        return items(value, "frozenset({", "})") if value else iter(["frozenset()"])
    return None


def _leaf_repr(value: Any, limit: int) -> str:
    """repr of a value that is no container, at least `limit` + 1 characters of it when longer."""
    if type(value) is int and value.bit_length() > _MAX_INT_BITS_SHOWN:
        return f"<int of {value.bit_length():,} bits>"
    if isinstance(value, str | bytes | bytearray) and len(value) > limit:
        return repr(value[: limit + 1])
    return repr(value)


def bounded_repr(value: Any, limit: int) -> str:
    """`repr(value)` when it is at most `limit` characters, else a longer prefix of it, built
    only as far as it is shown: a "billion laughs" graph of shared lists, a list of millions of
    items or an int of a million digits costs `limit` pieces, never its whole repr."""
    parts: list[str] = []
    size = 0
    stack: list[Iterator[str | _Value]] = [iter([_Value(value)])]
    while stack and size <= limit:
        piece = next(stack[-1], None)
        if piece is None:
            stack.pop()
            continue
        if isinstance(piece, _Value):
            inner = _container_pieces(piece.value)
            if inner is not None:
                stack.append(inner)
                continue
            piece = _leaf_repr(piece.value, limit)
        parts.append(piece)
        size += len(piece)
    return "".join(parts)


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
