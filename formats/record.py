"""The expert record: one routed expert as one contiguous, 4096-aligned run of bytes.

A record is `gate(w, s, b) up(w, s, b) down(w, s, b)` back to back with no header; records follow each
other in expert order at a fixed stride (raw size rounded up to 4096 B) so that one O_DIRECT read
fetches exactly one expert. Scales and biases keep their source dtype (bf16 in mlx-community exports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .direct import align_up
from .dtypes import DTYPES
from .errors import StreamoeError

PROJS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")


class ExpertWeights(NamedTuple):
    """One expert's nine arrays, as the quantized matmuls take them (weights uint32, scales/biases as stored)."""

    gate_w: object
    gate_s: object
    gate_b: object
    up_w: object
    up_s: object
    up_b: object
    down_w: object
    down_s: object
    down_b: object


@dataclass(frozen=True)
class Segment:
    """One of the nine arrays inside a record."""

    proj: str  # gate_proj | up_proj | down_proj
    part: str  # weight | scales | biases
    dtype: str  # safetensors dtype name: U32 for weights, BF16/F16/F32 for scales and biases
    shape: tuple[int, ...]  # per-expert shape, e.g. (512, 256) for a 4-bit gate weight
    offset: int  # byte offset inside the record
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one expert record for given dims and bits (the same for every expert of a layer)."""

    hidden: int
    intermediate: int
    bits: int
    group_size: int
    scale_dtype: str
    segments: tuple[Segment, ...]
    raw_size: int
    stride: int

    @classmethod
    def make(cls, hidden: int, intermediate: int, bits: int, group_size: int, scale_dtype: str = "BF16") -> RecordLayout:

        sitem = DTYPES[scale_dtype].itemsize
        segs: list[Segment] = []
        off = 0
        for proj in PROJS:
            out_dim, in_dim = (hidden, intermediate) if proj == "down_proj" else (intermediate, hidden)
            if in_dim % group_size or (in_dim * bits) % 32:
                raise StreamoeError(f"{proj}: input dim {in_dim} does not pack at {bits} bits, group {group_size}")
            shapes = {
                "weight": ("U32", (out_dim, in_dim * bits // 32), 4),
                "scales": (scale_dtype, (out_dim, in_dim // group_size), sitem),
                "biases": (scale_dtype, (out_dim, in_dim // group_size), sitem),
            }
            for part in PARTS:
                dt, shape, item = shapes[part]
                n = shape[0] * shape[1] * item
                segs.append(Segment(proj, part, dt, shape, off, n))
                off += n
        return cls(hidden, intermediate, bits, group_size, scale_dtype, tuple(segs), off, align_up(off))

    def segment(self, proj: str, part: str) -> Segment:
        return next(s for s in self.segments if s.proj == proj and s.part == part)
