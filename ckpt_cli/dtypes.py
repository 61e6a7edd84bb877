"""Dtype names without torch: one canonical token per dtype, item sizes, format codes.

The canonical token is torch's name without the `torch.` prefix (`bfloat16`), which is what
JSON output, `--dtype` and the manifest use. Metadata commands rely on this table so they never
need to import torch.
"""

from __future__ import annotations

from .errors import UsageError

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
_FROM_SAFETENSORS = {code: name for name, (_, code) in _TABLE.items()}
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
)
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
    """Bytes per element of a canonical dtype."""
    if dtype not in _TABLE and dtype in _TORCH_ONLY:
        return _TORCH_ONLY[dtype]
    return _TABLE[dtype][0]


def is_known(dtype: str) -> bool:
    """Whether `dtype` is a canonical token this tool understands."""
    return dtype in _TABLE or dtype in _TORCH_ONLY


def has_safetensors_code(dtype: str) -> bool:
    """Whether safetensors can store `dtype` (`to_safetensors` raises KeyError otherwise)."""
    return dtype in _TABLE


def from_safetensors(code: str) -> str | None:
    """Canonical name for a safetensors dtype code (`BF16` -> `bfloat16`), None if unknown."""
    return _FROM_SAFETENSORS.get(code)


def to_safetensors(dtype: str) -> str:
    """Safetensors dtype code for a canonical name."""
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
