"""Affine quantized tensor codecs: MLX's 4-bit, 8-bit and packed 3-bit layouts, and the exact 4→3 shift.

MLX packs codes least-significant first. At 4 and 8 bits a uint32 word holds 32/b codes; at 3 bits
every 3 bytes form a little-endian 24-bit word of 8 codes, code k at bits 3k (so `bits=3` kernels run
on the packed bytes directly). A weight is `scale * code + bias` per group of 64 along the last axis.
"""

from __future__ import annotations

import numpy as np


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """Codes (uint8, [..., n]) from packed uint32 words ([..., n * bits / 32])."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if bits in (2, 4, 8):
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits)
        codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)
    if bits == 3:
        b = words.view(np.uint8).reshape(*words.shape[:-1], -1, 3).astype(np.uint32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        codes = (word[..., None] >> (np.arange(8, dtype=np.uint32) * 3)) & np.uint32(7)
        return codes.reshape(*words.shape[:-1], -1).astype(np.uint8)
    raise ValueError(f"unsupported bits {bits}")


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint32 words from codes ([..., n], values < 2**bits); inverse of `unpack`."""
    codes = np.asarray(codes).astype(np.uint32)
    if bits in (2, 4, 8):
        per = 32 // bits
        c = codes.reshape(*codes.shape[:-1], -1, per)
        return np.bitwise_or.reduce(c << (np.arange(per, dtype=np.uint32) * bits), axis=-1).astype(np.uint32)
    if bits == 3:
        c = codes.reshape(*codes.shape[:-1], -1, 8)
        word = np.bitwise_or.reduce(c << (np.arange(8, dtype=np.uint32) * 3), axis=-1)
        b = np.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], axis=-1).astype(np.uint8)
        return b.reshape(*codes.shape[:-1], -1).view(np.uint32)
    raise ValueError(f"unsupported bits {bits}")


def f32_high_halves(a: np.ndarray) -> np.ndarray:
    """The high 16-bit halves of float32 storage `a` (any dtype, last axis contiguous), as a uint16 view: a bf16
    written there makes the float32 of the same value wherever the low halves are zero (little-endian, as every
    layout here: the low half first)."""
    return a.view(np.uint16)[..., 1::2]


def bf16_to_f32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 (stored as uint16) to float32, exactly. With `out` (float32, x's size, contiguous) the bits are
    written there in place, no temporary: a bf16 is the high half of its float32, the low half zero."""
    if out is None:
        return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    out.view(np.uint16)[0::2] = 0
    f32_high_halves(out)[:] = x
    return out


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 bits (uint16), round to nearest even (as MLX and torch cast)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    nan = np.isnan(x)
    out = (rounded >> 16).astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """float32 weights from a quantized triple; scales/biases as float32 arrays."""
    q = unpack(words, bits).astype(np.float32)
    q = q.reshape(*q.shape[:-1], -1, group_size)
    w = q * scales[..., None] + biases[..., None]
    return w.reshape(*w.shape[:-2], -1)


def shift_4_to_3(w4: np.ndarray, s4_f32: np.ndarray, b4_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact 4→3-bit re-quantization: q3 = q4 >> 1, s3 = 2·s4, b3 = b4 + s4/2 (float32 scales/biases).

    Every 4-bit level is exactly |s4|/2 from a 3-bit level, negative scales included, with no float search.
    Returns (packed 3-bit words, s3, b3) in float32; callers storing bf16 round s3 (exact: a power-of-two
    multiple) and b3 (correctly rounded, error at most half a bf16 ulp of b3).
    """
    q3 = unpack(w4, 4) >> 1
    return pack(q3, 3), (2.0 * s4_f32).astype(np.float32), (b4_f32 + 0.5 * s4_f32).astype(np.float32)


def shift_words_4_to_3(w4: np.ndarray) -> np.ndarray:
    """Packed 3-bit words of `q4 >> 1`, straight from packed 4-bit words (same result as pack(unpack(w4) >> 1))."""
    w = np.ascontiguousarray(w4, dtype=np.uint32)
    r = np.zeros_like(w)
    for k in range(8):
        r |= ((w >> np.uint32(4 * k + 1)) & np.uint32(7)) << np.uint32(3 * k)
    out = r.view(np.uint8).reshape(*w.shape, 4)[..., :3]
    return np.ascontiguousarray(out).reshape(*w.shape[:-1], -1).view(np.uint32)


def shift_scales_bf16(s4: np.ndarray, b4: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 (uint16 bits) scales and biases of the 3-bit shift: s3 = 2·s4 exactly, b3 = bf16(b4 + s4/2)."""
    s = bf16_to_f32(s4)
    return f32_to_bf16(2.0 * s), f32_to_bf16(bf16_to_f32(b4) + 0.5 * s)
