"""The expert record: one routed expert as one contiguous, 4096-aligned run of bytes.

A record is gate, up and down back to back with no header, each as the checkpoint stores it: affine codes
`(weight, scales, biases)`, or MXFP4 codes `(weight, scales)` (uint8 E8M0 scales, no quantization biases), and
after them the projection's own `bias` where the family has one (gpt-oss). Records follow each other in expert
order at a fixed stride (raw size rounded up to 4096 B) so that one O_DIRECT read fetches exactly one expert.
Scales, biases and bias keep their source dtype (bf16 in mlx-community exports, uint8 for MXFP4 scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .direct import align_up
from .dtypes import DTYPES
from .errors import StreamoeError

PROJS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")  # an affine module's three tensors
MODES = ("affine", "mxfp4")
MXFP4_GROUP, MXFP4_SCALE = 32, "U8"  # MXFP4: 4-bit E2M1 codes, one power-of-two (E8M0) scale per 32


class ExpertWeights(NamedTuple):
    """One expert's arrays (or slots of them stacked), as the quantized matmuls take them: weights uint32, scales
    and biases as stored or at the compute dtype; `*_b` is None for MXFP4, `*_bias` None without expert biases."""

    gate_w: object
    gate_s: object
    gate_b: object
    up_w: object
    up_s: object
    up_b: object
    down_w: object
    down_s: object
    down_b: object
    gate_bias: object = None
    up_bias: object = None
    down_bias: object = None


_FIELD = {"weight": "w", "scales": "s", "biases": "b", "bias": "bias"}


def parts_of(mode: str, bias: bool) -> tuple[str, ...]:
    """The tensors one projection of a record holds, in record order."""
    return ("weight", "scales") + (("biases",) if mode == "affine" else ()) + (("bias",) if bias else ())


@dataclass(frozen=True)
class Segment:
    """One of the arrays inside a record."""

    proj: str  # gate_proj | up_proj | down_proj
    part: str  # weight | scales | biases (affine) | bias (the projection's own)
    dtype: str  # safetensors dtype name: U32 for weights, U8 for MXFP4 scales, BF16/F16/F32 for the rest
    shape: tuple[int, ...]  # per-expert shape, e.g. (512, 256) for a 4-bit gate weight, (512,) for its bias
    offset: int  # byte offset inside the record
    nbytes: int

    @property
    def is_float(self) -> bool:
        """A float array (affine scales and biases, an expert's bias): the pools hold it at the compute dtype; codes
        and MXFP4's uint8 scales stay as stored."""
        return self.dtype in ("BF16", "F16", "F32")


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one expert record for given dims and codes (the same for every expert of a layer)."""

    hidden: int
    intermediate: int
    bits: int
    group_size: int
    scale_dtype: str
    segments: tuple[Segment, ...]
    raw_size: int
    stride: int
    mode: str = "affine"
    bias_dtype: str | None = None  # the dtype of each projection's bias; None: the experts have none

    @classmethod
    def make(cls, hidden: int, intermediate: int, bits: int, group_size: int, scale_dtype: str = "BF16",
             mode: str = "affine", bias_dtype: str | None = None) -> RecordLayout:
        if mode not in MODES:
            raise StreamoeError(f"expert quantization mode {mode!r} is not supported (supported: {', '.join(MODES)})")
        if mode == "mxfp4" and (bits, group_size, scale_dtype) != (4, MXFP4_GROUP, MXFP4_SCALE):
            raise StreamoeError(f"mxfp4 experts are 4-bit in groups of {MXFP4_GROUP} with {MXFP4_SCALE} scales, "
                                f"not {bits}-bit, group {group_size}, {scale_dtype}")
        segs: list[Segment] = []
        off = 0
        for proj in PROJS:
            out_dim, in_dim = (hidden, intermediate) if proj == "down_proj" else (intermediate, hidden)
            if in_dim % group_size or (in_dim * bits) % 32:
                raise StreamoeError(f"{proj}: input dim {in_dim} does not pack at {bits} bits, group {group_size}")
            shapes = {
                "weight": ("U32", (out_dim, in_dim * bits // 32)),
                "scales": (scale_dtype, (out_dim, in_dim // group_size)),
                "biases": (scale_dtype, (out_dim, in_dim // group_size)),
                "bias": (bias_dtype, (out_dim,)),
            }
            for part in parts_of(mode, bias_dtype is not None):
                dt, shape = shapes[part]
                n = DTYPES[dt].itemsize
                for d in shape:
                    n *= d
                off = align_up(off, DTYPES[dt].itemsize)  # a no-op but for a 1-byte segment before a wider one
                segs.append(Segment(proj, part, dt, shape, off, n))
                off += n
        return cls(hidden, intermediate, bits, group_size, scale_dtype, tuple(segs), off, align_up(off), mode,
                   bias_dtype)

    def segment(self, proj: str, part: str) -> Segment:
        return next(s for s in self.segments if s.proj == proj and s.part == part)

    @property
    def parts(self) -> tuple[str, ...]:
        return parts_of(self.mode, self.bias_dtype is not None)

    def weights(self, arrays) -> ExpertWeights:
        """The record's arrays (one per segment, in segment order) as `ExpertWeights`."""
        fields = {f"{s.proj.removesuffix('_proj')}_{_FIELD[s.part]}": a for s, a in zip(self.segments, arrays, strict=True)}
        return ExpertWeights(**{f: fields.get(f) for f in ExpertWeights._fields})
