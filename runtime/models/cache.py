"""Per-layer inference state, one cache per layer, each counting the tokens it has seen in `offset`.

Full-attention layers keep a key/value cache that is allocated once, at its final size, so that its memory
can be planned before anything runs; Gated DeltaNet layers keep the last K-1 convolution inputs and the
recurrent state, whose sizes do not depend on the context length.

A KV cache is a set of position-major arrays `[B, n_kv_heads, max_tokens, d]` named by `fields`: keys and
values as floats (`KVCache`), or, quantized (`QuantizedKVCache`, `--kv q8`/`q4`), their affine codes packed
in uint32 words with one scale and one bias per group of 64 values, as `mx.quantize` lays them out and
`mx.quantized_matmul` reads them.

Every cache owns its state: `state_tensors()` is what it holds now, by field (a KV cache's arrays cut to the
offset), `state_specs(n)` the dtypes and shapes of those tensors at n tokens, `restore(field, value)` puts a
saved tensor back (a position-major one whole or a head at a time, `per_position`), `mark()`/`rewind(mark)`
take back steps and `clear()` empties it. Sessions, prompt-cache snapshots and the engine go through these
(`runtime/conversation.py`), so a new cache class is saved and restored without touching them.
"""

from __future__ import annotations

import mlx.core as mx

from ...formats.errors import StreamoeError

KV_GROUP = 64  # values per scale/bias pair of a quantized KV cache (mlx-lm's QuantizedKVCache default)


def clear_for_in_place() -> None:
    """Call before allocating an array that is then updated in place (a KV cache, the expert slot pools). MLX
    donates an array's buffer to its update (a slice or scatter assignment) only if the buffer is at most one
    16 KiB page larger than the array (`is_donatable`), while its GPU buffer cache hands out a freed buffer up to
    two pages larger than asked: an array given such a buffer would be copied whole by every update (a 0.5 GiB
    pool per landing, memory outside the plan), seen on the H200 for a pool allocated after another engine's were
    freed. With the cache empty the allocation is fresh, its own size rounded to a page. `synchronize` first: the
    GPU's completion handlers return their kernels' temporaries to the cache."""
    mx.synchronize()
    mx.clear_cache()


class KVCache:
    """Keys and values of one full-attention layer, preallocated to `max_tokens` positions.

    keys/values: [B, n_kv_heads, max_tokens, head_dim] in `dtype` (float32, or float16 to halve it).
    """

    fields = ("keys", "values")
    per_position = True  # every field is [B, heads, positions, d]: saved cut to the offset, a head at a time
    bits: int | None = None

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_tokens: int, dtype=mx.float32):
        shape = (batch, n_kv_heads, max_tokens, head_dim)
        clear_for_in_place()
        self.keys = mx.zeros(shape, dtype=dtype)
        self.values = mx.zeros(shape, dtype=dtype)
        mx.eval(self.keys, self.values)
        self.offset = 0

    @property
    def max_tokens(self) -> int:
        return self.keys.shape[2]

    def arrays(self) -> list[tuple[str, mx.array]]:
        """(field, array) of every position-major array, in `fields` order."""
        return [(f, getattr(self, f)) for f in self.fields]

    def state_tensors(self) -> list[tuple[str, mx.array]]:
        """(field, array) of the state held: every position-major array cut to the offset (lazy slices)."""
        return [(f, a[:, :, : self.offset, :]) for f, a in self.arrays()]

    def state_specs(self, n: int) -> list[tuple[str, mx.Dtype, tuple[int, ...]]]:
        """(field, dtype, shape) of `state_tensors()` when the cache holds n tokens."""
        return [(f, a.dtype, (a.shape[0], a.shape[1], n, a.shape[3])) for f, a in self.arrays()]

    def restore(self, field: str, value: mx.array, at: tuple[int, ...] = ()) -> None:
        """Write a saved tensor back, in place: `value` is the field's first n positions [B, heads, n, d], or, `at`
        (batch, head), that head's [n, d]. Positions past it are never read (attention reads up to the offset)."""
        dst = getattr(self, field)
        n = value.shape[-2]
        if at:
            dst[(*at, slice(None, n))] = value
        else:
            dst[:, :, :n, :] = value
        mx.eval(dst)

    def mark(self) -> int:
        return self.offset

    def rewind(self, mark: int) -> None:
        """Back to `mark()`: the positions written since are past the offset, so never read."""
        self.offset = mark

    def clear(self) -> None:
        self.offset = 0

    def _reserve(self, n: int) -> tuple[int, int]:
        start, end = self.offset, self.offset + n
        if end > self.max_tokens:
            raise StreamoeError(f"KV cache holds {self.max_tokens} tokens; {end} were asked for")
        self.offset = end
        return start, end

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store [B, n_kv, L, hd] new keys/values after the cached ones; return all of them so far."""
        start, end = self._reserve(keys.shape[2])
        self.keys[:, :, start:end, :] = keys.astype(self.keys.dtype)
        self.values[:, :, start:end, :] = values.astype(self.values.dtype)
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]


def quantized_kv_refusal(head_dim: int) -> str:
    """Why a model of this head_dim has no quantized KV cache (its codes are grouped by KV_GROUP along a head)."""
    return f"a quantized KV cache needs head_dim divisible by {KV_GROUP} (this model's is {head_dim}); use a float --kv"


class QuantizedKVCache(KVCache):
    """Keys and values of one full-attention layer as `bits`-bit affine codes (groups of KV_GROUP along
    head_dim), preallocated to `max_tokens` positions. Attention is scored on the codes
    (`kernels.quantized_attention`), so no dequantized copy of the context exists.

    keys/values:              [B, n_kv_heads, max_tokens, head_dim * bits / 32] uint32 codes
    key_scales/key_biases,
    value_scales/value_biases: [B, n_kv_heads, max_tokens, head_dim / KV_GROUP] in `dtype` (the compute dtype)
    """

    fields = ("keys", "key_scales", "key_biases", "values", "value_scales", "value_biases")

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_tokens: int, bits: int, dtype=mx.float32):
        if head_dim % KV_GROUP:
            raise StreamoeError(quantized_kv_refusal(head_dim))
        self.bits, self.dtype = bits, dtype
        codes = (batch, n_kv_heads, max_tokens, head_dim * bits // 32)
        groups = (batch, n_kv_heads, max_tokens, head_dim // KV_GROUP)
        clear_for_in_place()
        for f in self.fields:
            setattr(self, f, mx.zeros(groups, dtype=dtype) if f.endswith(("scales", "biases")) else mx.zeros(codes, dtype=mx.uint32))
        mx.eval([a for _, a in self.arrays()])
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """Quantize and store [B, n_kv, L, hd] new keys/values; return (codes, scales, biases) of each so far."""
        start, end = self._reserve(keys.shape[2])
        for name, x in (("key", keys), ("value", values)):
            parts = mx.quantize(x.astype(self.dtype), group_size=KV_GROUP, bits=self.bits)
            for f, p in zip((f"{name}s", f"{name}_scales", f"{name}_biases"), parts, strict=True):
                getattr(self, f)[:, :, start:end, :] = p
        return tuple(tuple(getattr(self, f)[:, :, :end, :] for f in group)
                     for group in (self.fields[:3], self.fields[3:]))


class GDNCache:
    """State of one Gated DeltaNet layer.

    conv:  [B, K-1, conv_dim] the last K-1 inputs of the causal depthwise convolution (zeros at the start),
           in the activation dtype; held as `rows`, one [B, 1, conv_dim] array each, oldest first, so a decode
           step reads its taps and hands on its window without copying either (`delta_rule.causal_conv`).
    state: [B, Hv, dv, dk] the recurrent (delta-rule) state, always float32.

    The layer replaces the rows and the state on every call (never writes into them), so a mark is the arrays.
    """

    fields = ("conv", "state")
    per_position = False

    def __init__(
        self, batch: int, conv_kernel: int, conv_dim: int, n_v_heads: int, dv: int, dk: int, dtype=mx.float32
    ):
        self.empty_window = mx.zeros((batch, 0, conv_dim), dtype=dtype)  # a kernel of one tap keeps no window
        self.rows = tuple(mx.zeros((batch, 1, conv_dim), dtype=dtype) for _ in range(conv_kernel - 1))
        self.state = mx.zeros((batch, n_v_heads, dv, dk), dtype=mx.float32)
        mx.eval(self.rows, self.state, self.empty_window)
        self.offset = 0

    @property
    def conv(self) -> mx.array:
        """The window as one array [B, K-1, conv_dim] (lazy: what sessions and snapshots save)."""
        return mx.concatenate(self.rows, axis=1) if self.rows else self.empty_window

    @conv.setter
    def conv(self, value: mx.array) -> None:
        self.rows = tuple(mx.split(value, value.shape[1], axis=1)) if value.shape[1] else ()

    def state_tensors(self) -> list[tuple[str, mx.array]]:
        return [(f, getattr(self, f)) for f in self.fields]

    def state_specs(self, n: int) -> list[tuple[str, mx.Dtype, tuple[int, ...]]]:
        return [(f, a.dtype, tuple(a.shape)) for f, a in self.state_tensors()]

    def restore(self, field: str, value: mx.array, at: tuple[int, ...] = ()) -> None:
        """Replace a field by a saved tensor (whole: `at` is always empty here)."""
        setattr(self, field, value)
        mx.eval(value)

    def mark(self) -> tuple[int, tuple[mx.array, ...], mx.array]:
        return self.offset, self.rows, self.state

    def rewind(self, mark: tuple[int, tuple[mx.array, ...], mx.array]) -> None:
        self.offset, self.rows, self.state = mark

    def clear(self) -> None:
        self.rows = tuple(mx.zeros_like(r) for r in self.rows)
        self.state = mx.zeros_like(self.state)
        mx.eval(self.rows, self.state)
        self.offset = 0
