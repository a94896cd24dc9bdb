"""Non-expert weights: `nonexpert.bin` tensors into MLX arrays, each resident exactly once.

Each tensor is read page-cache-free in chunks straight into its MLX array's memory (no mapped copy lingers),
and float tensors are cast to the compute dtype one at a time, so the load never holds a tensor twice
beyond the one being cast. `A_log` stays float32 whatever the compute dtype (the decay needs it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.blobs import BlobTensor
from ..formats.direct import RangeReader
from ..formats.dtypes import DTYPES, dtype
from ..formats.record import ExpertWeights, RecordLayout

CHUNK = 16 << 20
FLOATS = ("BF16", "F16", "F32")


def mx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype of a safetensors code (`BF16`) or compute name (`bfloat16`)."""
    return getattr(mx, dtype(name).mlx)


def code_of(d: mx.Dtype) -> str:
    """The safetensors code of an MLX dtype."""
    return next(c for c, t in DTYPES.items() if getattr(mx, t.mlx) == d)


def read_tensor(reader: RangeReader, t: BlobTensor) -> mx.array:
    """One stored tensor as an MLX array of its stored dtype (bf16 as bf16)."""
    arr = mx.zeros(t.shape, mx.uint16 if t.dtype == "BF16" else mx_dtype(t.dtype))  # numpy has no bf16
    mx.eval(arr)
    host = np.asarray(arr).reshape(-1).view(np.uint8)
    for off in range(0, t.nbytes, CHUNK):
        n = min(CHUNK, t.nbytes - off)
        host[off:off + n] = np.frombuffer(reader.read(t.offset + off, n), np.uint8)
    return arr.view(mx.bfloat16) if t.dtype == "BF16" else arr


def load_tensors(path: Path, table: Iterable[BlobTensor], dtype: mx.Dtype) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    with RangeReader(path, CHUNK) as reader:
        for t in table:
            a = read_tensor(reader, t)
            if t.dtype in FLOATS:
                target = mx.float32 if t.name.endswith("A_log") else dtype
                if a.dtype != target:
                    a = a.astype(target)
                    mx.eval(a)
            out[t.name] = a
    return out


def resident_bytes(tensors: Iterable[tuple[str, str, int]], dtype_item: int) -> int:
    """What `load_tensors` will hold for (name, stored dtype, stored nbytes) entries: packed codes as stored,
    floats at the compute dtype, A_log at 4 bytes. The plan counts exactly this."""
    total = 0
    for name, code, nbytes in tensors:
        if code in FLOATS:
            item = 4 if name.endswith("A_log") else dtype_item
            total += nbytes // DTYPES[code].itemsize * item
        else:
            total += nbytes
    return total


def record_views(buf: mx.array, base: int, lay: RecordLayout) -> ExpertWeights:
    """The nine arrays of the expert record at byte `base` of a uint8 MLX array, as zero-copy views."""
    return ExpertWeights(*(buf[base + s.offset: base + s.offset + s.nbytes].view(mx_dtype(s.dtype)).reshape(s.shape)
                           for s in lay.segments))
