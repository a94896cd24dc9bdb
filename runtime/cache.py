"""Per-layer inference state of the Qwen3.5-MoE language model.

Full-attention layers keep a key/value cache that is allocated once, at its final size, so that its memory
can be planned before anything runs; Gated DeltaNet layers keep the last K-1 convolution inputs and the
recurrent state, whose sizes do not depend on the context length. Both count the tokens they have seen in
`offset`.
"""

from __future__ import annotations

import mlx.core as mx

from ..formats.errors import StreamoeError


class KVCache:
    """Keys and values of one full-attention layer, preallocated to `max_tokens` positions.

    keys/values: [B, n_kv_heads, max_tokens, head_dim] in `dtype` (float32, or float16 to halve it).
    """

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_tokens: int, dtype=mx.float32):
        shape = (batch, n_kv_heads, max_tokens, head_dim)
        self.keys = mx.zeros(shape, dtype=dtype)
        self.values = mx.zeros(shape, dtype=dtype)
        mx.eval(self.keys, self.values)
        self.offset = 0

    @property
    def max_tokens(self) -> int:
        return self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store [B, n_kv, L, hd] new keys/values after the cached ones; return all of them so far."""
        start, end = self.offset, self.offset + keys.shape[2]
        if end > self.max_tokens:
            raise StreamoeError(f"KV cache holds {self.max_tokens} tokens; {end} were asked for")
        self.keys[:, :, start:end, :] = keys.astype(self.keys.dtype)
        self.values[:, :, start:end, :] = values.astype(self.values.dtype)
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]


class GDNCache:
    """State of one Gated DeltaNet layer.

    conv:  [B, K-1, conv_dim] the last K-1 inputs of the causal depthwise convolution (zeros at the start),
           in the activation dtype.
    state: [B, Hv, dv, dk] the recurrent (delta-rule) state, always float32.
    """

    def __init__(
        self, batch: int, conv_kernel: int, conv_dim: int, n_v_heads: int, dv: int, dk: int, dtype=mx.float32
    ):
        self.conv = mx.zeros((batch, conv_kernel - 1, conv_dim), dtype=dtype)
        self.state = mx.zeros((batch, n_v_heads, dv, dk), dtype=mx.float32)
        mx.eval(self.conv, self.state)
        self.offset = 0
