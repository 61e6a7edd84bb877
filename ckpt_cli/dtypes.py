"""Dtype names without torch: one canonical token per dtype, item sizes, format codes.

The canonical token is torch's name without the `torch.` prefix (`bfloat16`), which is what
JSON output, `--dtype` and the manifest use. Metadata commands rely on this table so they never
need to import torch.
"""

from __future__ import annotations

from .errors import UsageError

#: torch's legacy typed storage classes (`torch.FloatStorage`...), which torch.save pickles
#: for the dtypes that have one -> canonical dtype token
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
#: torch's short attribute names of dtypes (`torch.float` is `torch.float32`) -> canonical token
TORCH_ALIASES: dict[str, str] = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}

# canonical name -> (item size in bytes, safetensors code)
_TABLE: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "float8_e8m0fnu": (1, "F8_E8M0"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint64": (8, "U64"),
    "uint32": (4, "U32"),
    "uint16": (2, "U16"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
    "complex64": (8, "C64"),
}
# safetensors 0.8's byte-sized additions (what `safetensors.torch` writes for torch's fnuz kinds)
_TABLE.update(
    {
        "float8_e4m3fnuz": (1, "F8_E4M3FNUZ"),
        "float8_e5m2fnuz": (1, "F8_E5M2FNUZ"),
        # torch's packed FP4 (two E2M1 values a byte): safetensors stores it as F4 with the
        # last dimension counted in 4-bit values, see `torch_layout`
        "float4_e2m1fn_x2": (1, "F4"),
    }
)
#: sub-byte dtypes of safetensors 0.8: canonical name (ml_dtypes' spelling: torch has no
#: unpacked kind) -> (bits per element, safetensors code). Shapes count elements; a tensor's
#: bytes are numel * bits / 8 and must end on a byte boundary.
SUB_BYTE: dict[str, tuple[int, str]] = {
    "float4_e2m1fn": (4, "F4"),
    "float6_e2m3fn": (6, "F6_E2M3"),
    "float6_e3m2fn": (6, "F6_E3M2"),
}
FROM_SAFETENSORS = {code: name for name, (_, code) in _TABLE.items()}
# an F4 header entry is read as 4-bit elements, not as torch's packed pairs
FROM_SAFETENSORS.update({code: name for name, (_, code) in SUB_BYTE.items()})
#: torch dtypes DCP and `torch.save` round-trip that have no safetensors code in `_TABLE`:
#: item size only (`float4_e2m1fn_x2` packs two 4-bit values per byte, its shape counts bytes)
_TORCH_ONLY: dict[str, int] = {
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex128": 16,
    "complex32": 4,
    "float4_e2m1fn_x2": 1,
    # torch's bit-width shells: one byte (two for bits16) per element as torch stores them
    **{f"{kind}{bits}": 1 for kind in ("uint", "int") for bits in range(1, 8)},
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}
FLOATING = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"}
    | {"float8_e4m3fnuz", "float8_e5m2fnuz"}
)
#: low-precision floating kinds that are storage formats (quantized payloads and scales):
#: counted as parameters, never a `--dtype` target
STORAGE_FLOATING = frozenset(SUB_BYTE) | {"float4_e2m1fn_x2"}
_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a canonical byte-sized dtype (KeyError for sub-byte ones)."""
    if dtype not in _TABLE and dtype in _TORCH_ONLY:
        return _TORCH_ONLY[dtype]
    return _TABLE[dtype][0]


def bitsize(dtype: str) -> int:
    """Bits per element of any canonical dtype, sub-byte ones included."""
    if dtype in SUB_BYTE:
        return SUB_BYTE[dtype][0]
    return _TABLE[dtype][0] * 8


def storage_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int | None:
    """Bytes of a dense tensor of `dtype` and `shape`; None when they do not end on a byte.

    safetensors refuses a sub-byte tensor (or slice) whose bits are not a whole number of
    bytes, so callers report that tensor instead of rounding.
    """
    bits = numel(shape) * bitsize(dtype)
    return None if bits % 8 else bits // 8


def torch_layout(dtype: str, shape: list[int]) -> tuple[str, list[int]] | None:
    """The torch dtype token and shape that hold a tensor's bytes, or None if torch has none.

    Byte-sized dtypes map to themselves. safetensors' F4 becomes torch's packed
    `float4_e2m1fn_x2` with the last dimension halved (what `safetensors.torch` returns);
    an odd last dimension, or the F6 kinds, have no torch dtype.
    """
    if dtype == "float4_e2m1fn":
        if not shape or shape[-1] % 2:
            return None
        return "float4_e2m1fn_x2", [*shape[:-1], shape[-1] // 2]
    if dtype in SUB_BYTE:
        return None
    return dtype, list(shape)


def is_known(dtype: str) -> bool:
    """Whether `dtype` is a canonical token this tool understands."""
    return dtype in _TABLE or dtype in SUB_BYTE or dtype in _TORCH_ONLY


def has_safetensors_code(dtype: str) -> bool:
    """Whether safetensors can store `dtype` (`to_safetensors` raises KeyError otherwise)."""
    return dtype in _TABLE or dtype in SUB_BYTE


def from_safetensors(code: str) -> str | None:
    """Canonical name for a safetensors dtype code (`BF16` -> `bfloat16`), None if unknown."""
    return FROM_SAFETENSORS.get(code)


def to_safetensors(dtype: str) -> str:
    """Safetensors dtype code for a canonical name."""
    if dtype in SUB_BYTE:
        return SUB_BYTE[dtype][1]
    return _TABLE[dtype][1]


def parse_user_dtype(text: str) -> str:
    """Parse a `--dtype` value (bf16, fp16, fp32, float32, ...) into a canonical floating name."""
    name = _ALIASES.get(text.lower(), text.lower())
    if name not in FLOATING:
        raise UsageError(
            f"unknown dtype {text!r}",
            fix="Use one of bf16, fp16, fp32, fp64 (or their torch names).",
        )
    return name


def numel(shape: list[int] | tuple[int, ...]) -> int:
    """Number of elements of a shape (1 for a 0-dim tensor)."""
    n = 1
    for dim in shape:
        n *= dim
    return n


#: the largest dimension (and product of dimensions) torch, DCP and safetensors all hold: int64
MAX_DIM = (1 << 63) - 1
#: the most dimensions a tensor may have: numpy's limit (torch's own kernels stop at 25), so a
#: header cannot make a reader walk and hold millions of them
MAX_NDIM = 64


#: characters of a value read from a header that a message quotes
SHOWN_CHARS = 120


def shown(value: object) -> str:
    """`repr(value)` for a message, cut short past `SHOWN_CHARS` characters: a list or tuple
    by its length and first items (a crafted shape may hold millions of dimensions)."""
    if isinstance(value, (list, tuple)) and len(value) > SHOWN_CHARS:
        return f"[{len(value):,} items: {repr(list(value[:8]))[1:-1]}, ...]"
    text = repr(value)
    return (
        text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"
    )


def shape_problem(shape: object) -> str | None:
    """Why `shape` is no tensor shape every format can hold, or None when it is one: a list of
    plain non-negative ints (not bools), at most `MAX_NDIM` of them, each at most `MAX_DIM`,
    whose product (a zero counted as one, as torch sizes its strides) is at most `MAX_DIM` too:
    torch.load refuses a file whose tensor has a dimension of 2^63 even with no elements."""
    if not isinstance(shape, (list, tuple)):
        return "not a list of dimensions"
    if len(shape) > MAX_NDIM:
        return f"{len(shape):,} dimensions, more than the {MAX_NDIM} a tensor may have"
    span = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            return f"dimension {dim!r} is not a non-negative integer"
        if dim > MAX_DIM:
            return f"dimension {dim:,} is larger than int64 holds (2^63 - 1)"
        span *= max(dim, 1)
        if span > MAX_DIM:
            return "its dimensions multiply past what int64 holds (2^63 - 1)"
    return None
