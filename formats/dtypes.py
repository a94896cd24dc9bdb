"""The one dtype table: safetensors codes, their raw numpy view, size, and MLX name.

Files name dtypes by safetensors code (`BF16`); the CLI and plans name compute dtypes as MLX does
(`bfloat16`). Both resolve here. bf16 has no numpy dtype, so its raw bytes are viewed as uint16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import StreamoeError


@dataclass(frozen=True)
class DType:
    code: str  # safetensors name
    numpy: np.dtype  # how raw bytes are viewed on the host
    itemsize: int
    mlx: str  # the mlx.core attribute of the same dtype


def _d(code: str, raw, itemsize: int, mlx: str) -> DType:
    return DType(code, np.dtype(raw), itemsize, mlx)


DTYPES: dict[str, DType] = {d.code: d for d in (
    _d("BOOL", np.bool_, 1, "bool_"), _d("U8", np.uint8, 1, "uint8"), _d("I8", np.int8, 1, "int8"),
    _d("U16", np.uint16, 2, "uint16"), _d("I16", np.int16, 2, "int16"), _d("F16", np.float16, 2, "float16"),
    _d("BF16", np.uint16, 2, "bfloat16"), _d("U32", np.uint32, 4, "uint32"), _d("I32", np.int32, 4, "int32"),
    _d("F32", np.float32, 4, "float32"), _d("U64", np.uint64, 8, "uint64"), _d("I64", np.int64, 8, "int64"),
    _d("F64", np.float64, 8, "float64"),
)}
# compute dtypes (--dtype, --kv) by their MLX names
COMPUTE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def dtype(name: str) -> DType:
    """A dtype by safetensors code (`BF16`) or compute name (`bfloat16`)."""
    d = DTYPES.get(COMPUTE.get(name, name))
    if d is None:
        raise StreamoeError(f"unknown dtype {name!r}")
    return d


def itemsize(name: str) -> int:
    return dtype(name).itemsize
