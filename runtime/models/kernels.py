"""The kernel library every model family is built from, in MLX primitives.

Weights by name (`Loader`: presence, dtype and shape checked, floats cast once), quantized projections
(`QLinear`, and `Projections`: several that read one input as one matmul per quantization), the quantized
embedding, rotary embeddings (`MRoPE`, plain `RoPE`), causal attention over a float or quantized KV cache
(`attention`), the elementwise chains (`mx.compile`d on every backend: one kernel per chain; MLX builds the CPU's
with the machine's C++ compiler once, runs them uncompiled without one), the routed experts over slots (`route`,
`switch_glu`, `combine`, `ResidentExperts`), the one layer loop (`run_layers`), what the families share around their
own attention and router (`GroupedAttention`, `RoutedMoe`, `PreNormLayer`, `TextModel`), and a one-token call's layer
work compiled around its cache (`compiled`, `COMPILED_STEP`). Gated DeltaNet's kernels
are `delta_rule.py`.

Every kernel is deterministic and depends on the shapes of its call only, never on where an expert's weights
live, so a family built from them gives bit-identical results at every cap.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...formats.config import ModelArgs
from ...formats.errors import StreamoeError
from ...formats.layout import source_layout
from ...formats.record import ExpertWeights, RecordLayout
from .cache import KV_GROUP, KVCache, QuantizedKVCache

# --------------------------------------------------------------------------------------------------
# weights


# A one-token call (decode) runs each layer's work before and after its KV cache as compiled functions
# (`compiled`, `PreNormLayer.front`): the GPU's host, which bounds decode there, then builds a few graph nodes a
# layer instead of dozens, and MLX fuses the elementwise ops between them. `STREAMOE_COMPILED_STEP=0`: as built.
COMPILED_STEP = os.environ.get("STREAMOE_COMPILED_STEP", "1") != "0"
SPLIT_ROWS = 1024  # CPU streams split a matrix only from this many output rows per stream
BLAS_TOKENS = 16  # CPU: from this many tokens a quantized linear layer runs through numpy's BLAS (QLinear._blas)
BLAS_BLOCK = 1024  # rows dequantized at a time there (the plan's activation account holds one block)


@functools.cache
def _cuda_available() -> bool:
    return mx.cuda.is_available()


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and _cuda_available()


def dequantizes_one_group(k: int, group_size: int) -> bool:
    """Whether `quantized_matmul` over K = `k` multiplies float32 dequantized weights instead (CUDA, one group
    spanning K): the plan counts that copy where it is a quantized KV cache's keys."""
    return k <= group_size and _on_cuda()


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                     transpose: bool = True) -> mx.array:
    """`mx.quantized_matmul` of affine codes, kept off MLX's CUDA `qmm_sm90` kernel where one group spans the whole
    of K: MLX sends a call there on a compute-capability-9 GPU when K <= group size and there is more than one row,
    and on an H200 (MLX 0.32.4) its output was wrong in every such case, differed between reruns and once held NaNs
    (`bench/device_vs_cpu.py --qmm-sweep`; docs/performance.md). On CUDA such a call is the dequantized weights'
    plain matmul in float32, as the fused kernels accumulate (halving the group size instead is refused there: no
    CUDA kernel takes affine groups of 32). K <= group size is the test models' hidden size and a 64-wide head
    scored against a quantized KV cache (gpt-oss), never a real model's projection, so what is dequantized is at
    most one head's keys at a time."""
    if transpose and dequantizes_one_group(x.shape[-1], group_size):
        f32 = mx.float32
        w = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)
        return (x.astype(f32) @ w.T).astype(x.dtype)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits)


Streams = tuple[mx.Stream, ...]


def cpu_streams(n: int) -> Streams:
    """n CPU streams for large matrix-vector products (n <= 1: none, the default stream only). MLX runs each CPU
    stream on its own thread, so splitting a big layer's output rows (`QLinear`) or a layer's expert picks
    (`switch_glu`) across streams uses every core. Each output row is computed by the same kernel whatever the
    split, so results do not change with the number of streams. The model holds them (`Model.streams`, given to
    every projection it loads) and hands them to the experts provider."""
    return tuple(mx.new_stream(mx.cpu) for _ in range(n)) if n > 1 else ()


class QLinear(NamedTuple):
    """An affine-quantized linear layer: y = x @ dequantize(weight).T (+ bias, where the layer has one, added after
    the matmul as mlx-lm's QuantizedLinear adds it), its output rows split over `streams` (`cpu_streams`) where it
    is large."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    streams: Streams = ()
    bias: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: mx.array) -> mx.array:
        rows = self.weight.shape[0]
        if x.size >= BLAS_TOKENS * x.shape[-1] and mx.default_device() == mx.cpu:
            return self._blas(x)
        if DENSE_QMV and self.bits == 4 and x.size == x.shape[-1] and _on_cuda():
            zero = pair_rows(1, 1)[1]
            y = gather_qmv(x.reshape(1, -1), zero, zero, [(self.weight[None], self.scales[None], self.biases[None])],
                           self.group_size)
            return y.reshape(*x.shape[:-1], rows)
        if not self.streams or rows < SPLIT_ROWS * len(self.streams):
            return quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        n = len(self.streams)
        step = -(-rows // n)
        parts = []
        for j, st in enumerate(self.streams):
            a, b = j * step, min(rows, (j + 1) * step)
            with mx.stream(st):
                parts.append(quantized_matmul(x, self.weight[a:b], self.scales[a:b], self.biases[a:b],
                                              self.group_size, self.bits))
        return mx.concatenate(parts, axis=-1)

    def _blas(self, x: mx.array) -> mx.array:
        """Many tokens on the CPU backend (prefill): the weights dequantized BLAS_BLOCK rows at a time and
        multiplied by numpy's BLAS. MLX's CPU quantized matmul does not reuse a weight across tokens (0.8 GMAC/s
        per core: 2.8 s for 97 tokens through a Gated DeltaNet in_proj, 0.34 s this way). The rounding differs
        from the quantized kernel's, but the path depends only on the number of tokens, never on the cap."""
        rows, xs = self.weight.shape[0], np.asarray(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        out = np.empty((xs.shape[0], rows), dtype=np.float32)
        for a in range(0, rows, BLAS_BLOCK):
            b = min(rows, a + BLAS_BLOCK)
            w = mx.dequantize(self.weight[a:b], self.scales[a:b], self.biases[a:b], group_size=self.group_size,
                              bits=self.bits).astype(mx.float32)
            np.matmul(xs, np.asarray(w).T, out=out[:, a:b])
        return mx.array(out).astype(x.dtype).reshape(*x.shape[:-1], rows)



class Projections:
    """Quantized linear layers that read the same input, run as one matmul per quantization (bits, group
    size): their rows are concatenated at load and the output split again. Each output row is the same dot
    product whichever matrix holds it, so results do not change; decode is launch-bound on GPUs, and every
    projection fused is a kernel and a graph node fewer per layer."""

    def __init__(self, ld: Loader, modules: list[tuple[str, int]], in_dims: int, bias: bool = False):
        """`bias`: each module has its own bias (`{module}.bias`), concatenated as its rows are."""
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (module, _) in enumerate(modules):
            groups.setdefault(ld.args.quant_params(module), []).append(j)
        self.linears, self.where = [], [None] * len(modules)
        for g, members in enumerate(groups.values()):
            parts = [ld.quantized(modules[j][0], modules[j][1], in_dims) for j in members]
            w, s, b = (mx.concatenate([q[n] for q in parts]) if len(parts) > 1 else parts[0][n] for n in range(3))
            y_bias = mx.concatenate([ld.float(f"{modules[j][0]}.bias", (modules[j][1],)) for j in members]) if bias else None
            mx.eval(w, s, b, *([y_bias] if bias else []))  # now, so the parts are freed as the load goes on
            self.linears.append(QLinear(w, s, b, *parts[0][3:], ld.streams, y_bias))
            for n, j in enumerate(members):
                self.where[j] = (g, n)
        self.cuts = [np.cumsum([modules[j][1] for j in members])[:-1].tolist() for members in groups.values()]

    def __call__(self, x: mx.array) -> list[mx.array]:
        outs = [self._group(x, g) for g in range(len(self.linears))]
        return [outs[g][n] for g, n in self.where]

    def one(self, x: mx.array, j: int) -> mx.array:
        """Output j alone: only the matmul of its quantization group."""
        g, n = self.where[j]
        return self._group(x, g)[n]

    def _group(self, x: mx.array, g: int) -> list[mx.array]:
        y = self.linears[g](x)
        return mx.split(y, self.cuts[g], axis=-1) if self.cuts[g] else [y]


class Loader:
    """Gets tensors from the weight dict, checking presence, dtype and shape, casting floats once. With
    `consume`, each is taken out of the dict, so fused copies are not held twice while a model loads. The
    projections it makes run over `streams`."""

    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype, consume: bool = False,
                 streams: Streams = ()):
        self.args, self.weights, self.dtype, self.consume, self.streams = args, weights, dtype, consume, streams

    def _get(self, name: str) -> mx.array:
        if name not in self.weights:
            raise StreamoeError(f"missing tensor {name}")
        return self.weights.pop(name) if self.consume else self.weights[name]

    def float(self, name: str, shape: tuple[int, ...], dtype=None) -> mx.array:
        w = self._get(name)
        if not mx.issubdtype(w.dtype, mx.floating):
            raise StreamoeError(f"{name}: dtype {w.dtype} is not floating point")
        if tuple(w.shape) != tuple(shape):
            raise StreamoeError(f"{name}: shape {tuple(w.shape)}, expected {tuple(shape)}")
        return w.astype(dtype or self.dtype)

    def quantized(
        self, module: str, out_dims: int, in_dims: int
    ) -> tuple[mx.array, mx.array, mx.array, int, int]:
        """(weight, scales, biases, bits, group) of `module`; shapes may carry leading (expert) dims."""
        bits, group = self.args.quant_params(module)
        w = self._get(f"{module}.weight")
        s = self._get(f"{module}.scales")
        b = self._get(f"{module}.biases")
        if w.dtype != mx.uint32:
            raise StreamoeError(f"{module}.weight: dtype {w.dtype}, expected uint32 (quantized)")
        lead = tuple(w.shape[:-2])
        if in_dims % group or (in_dims * bits) % 32:
            raise StreamoeError(f"{module}: input dim {in_dims} does not pack at {bits} bits, group {group}")
        if s.ndim == w.ndim and s.shape[-1] and 32 * w.shape[-1] != bits * s.shape[-1] * group:
            found = 32 * w.shape[-1] / (s.shape[-1] * group)
            raise StreamoeError(
                f"{module}.weight: shape {tuple(w.shape)} with scales {tuple(s.shape)} means {found:g} bits, "
                f"config says {bits}"
            )
        for name, arr, shape in (
            (f"{module}.weight", w, (*lead, out_dims, in_dims * bits // 32)),
            (f"{module}.scales", s, (*lead, out_dims, in_dims // group)),
            (f"{module}.biases", b, (*lead, out_dims, in_dims // group)),
        ):
            if tuple(arr.shape) != shape:
                raise StreamoeError(
                    f"{name}: shape {tuple(arr.shape)}, expected {shape} ({bits}-bit, group {group})"
                )
        for name, arr in ((f"{module}.scales", s), (f"{module}.biases", b)):
            if not mx.issubdtype(arr.dtype, mx.floating):
                raise StreamoeError(f"{name}: dtype {arr.dtype} is not floating point")
        return w, s.astype(self.dtype), b.astype(self.dtype), bits, group

    def linear(self, module: str, out_dims: int, in_dims: int, bias: bool = False) -> QLinear:
        """A quantized linear layer, with its bias (`{module}.bias`, [out_dims]) where `bias`."""
        b = self.float(f"{module}.bias", (out_dims,)) if bias else None
        return QLinear(*self.quantized(module, out_dims, in_dims), self.streams, b)

    def embedding(self, module: str, vocab: int, dims: int) -> QEmbedding:
        return QEmbedding(*self.quantized(module, vocab, dims))


class QEmbedding(NamedTuple):
    """An affine-quantized embedding table: a token's row is dequantized when it is looked up."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def __call__(self, tokens: mx.array, dtype: mx.Dtype) -> mx.array:
        """[B, L] token ids -> [B, L, H] in `dtype`."""
        w, s, b = self.weight[tokens], self.scales[tokens], self.biases[tokens]
        return mx.dequantize(w, s, b, group_size=self.group_size, bits=self.bits).astype(dtype)

    def as_linear(self, streams: Streams = ()) -> QLinear:
        """The table as the output head of tied word embeddings."""
        return QLinear(*self, streams)


# --------------------------------------------------------------------------------------------------
# rotary embedding


class MRoPE:
    """Partial rotary embedding (rotate-half pairing) with interleaved 3-axis M-RoPE positions.

    The first `rotary_dim` dims of every head rotate; frequency f (of rotary_dim/2) takes its position
    from axis t, h or w: f % 3 == 1 -> h (for f < 3*section[1]), f % 3 == 2 -> w (for f < 3*section[2]),
    else t. With all three position rows equal this is exactly `mx.fast.rope(traditional=False)`: the
    inverse frequencies and angles are computed with the same float32 operations. So plain text (every
    axis the token index) takes `mx.fast.rope` itself, one kernel per call, as mlx-lm does; only calls
    with image positions build the cos/sin tables.
    """

    def __init__(self, rotary_dim: int, base: float, section: tuple[int, ...]):
        self.dims, self.base = rotary_dim, base
        half = rotary_dim // 2
        step = np.log(np.float32(base)) / np.float32(half)  # float32 arithmetic, as mx.fast.rope does it
        self.inv_freq = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, dtype=mx.float32))
        axis = [0] * half
        for f in range(half):
            if f % 3 == 1 and f < 3 * section[1]:
                axis[f] = 1
            elif f % 3 == 2 and f < 3 * section[2]:
                axis[f] = 2
        self.axis = mx.array(axis, dtype=mx.int32)
        mx.eval(self.inv_freq, self.axis)

    def prepare(self, positions: int | mx.array):
        """What the attention layers of one call rotate by: an int (plain text from that position) stays an
        int; positions [3, B, L] become their (cos, sin) tables."""
        return positions if isinstance(positions, int) else self.cos_sin(positions)

    def cos_sin(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """positions [3, B, L] (or [B, L] for plain text) -> cos, sin [B, 1, L, rotary_dim/2] float32."""
        if positions.ndim == 2:
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        pos = mx.take(positions, self.axis, axis=0).transpose(1, 2, 0).astype(mx.float32)  # [B, L, half]
        theta = pos * self.inv_freq
        return mx.cos(theta)[:, None], mx.sin(theta)[:, None]

    def __call__(self, x: mx.array, rot) -> mx.array:
        """x [B, heads, L, head_dim]; rot from `prepare`."""
        if isinstance(rot, int):
            return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=rot)
        cos, sin = rot
        half, d = self.dims // 2, self.dims
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        x1, x2 = x[..., :half], x[..., half:d]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if d < x.shape[-1]:
            parts.append(x[..., d:])
        return mx.concatenate(parts, axis=-1)


def text_positions(offset: int, length: int, batch: int = 1) -> mx.array:
    """M-RoPE position ids [3, B, L] of plain text: every axis is the token index."""
    pos = mx.arange(offset, offset + length, dtype=mx.int32)
    return mx.broadcast_to(pos[None, None], (3, batch, length))


class RoPE:
    """Rotary embedding of the first `dims` dims of every head (rotate-half pairing), as `mx.fast.rope` computes
    it; the same `prepare`/call interface as `MRoPE`, for families whose positions are plain token indices."""

    def __init__(self, dims: int, base: float, scale: float = 1.0):
        self.dims, self.base, self.scale = dims, base, scale

    def prepare(self, positions: int) -> int:
        return positions

    def __call__(self, x: mx.array, rot: int) -> mx.array:
        """x [B, heads, L, head_dim], its first token at position `rot`."""
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=rot)


class YarnRoPE:
    """RoPE with YaRN scaling (gpt-oss) as mlx-lm's `YarnRoPE` computes it: per-frequency interpolation between the
    extrapolated (`base^(2i/d)`) and interpolated (`factor` times that) wavelengths over a linear ramp between the
    correction dims of `beta_fast` and `beta_slow` rotations (floor and ceil, clipped to the head), the frequencies
    given to `mx.fast.rope`, and the rotated dims scaled by the attention factor `mscale` (0.1·ln(factor) + 1 over
    the same for `mscale_all_dim`) before the rotation, in the same float32 operations."""

    def __init__(self, dims: int, base: float, factor: float, original: float, beta_fast: float, beta_slow: float,
                 mscale: float = 1.0, mscale_all_dim: float = 0.0):
        def correction_dim(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        def attention_factor(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
        if low == high:
            high += 0.001  # a ramp of width zero would divide by zero
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        extrapolated = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        interpolated = factor * extrapolated
        keep = 1.0 - ramp  # 1: the dims whose wavelengths stay as trained
        self.freqs = (interpolated * extrapolated) / (interpolated * keep + extrapolated * (1 - keep))
        self.mscale = attention_factor(mscale) / attention_factor(mscale_all_dim)
        self.dims = dims
        mx.eval(self.freqs)

    def prepare(self, positions: int) -> int:
        return positions

    def __call__(self, x: mx.array, rot: int) -> mx.array:
        """x [B, heads, L, head_dim], its first token at position `rot`."""
        if self.mscale != 1.0:
            x = x * self.mscale if self.dims == x.shape[-1] else x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=rot, freqs=self.freqs)


# --------------------------------------------------------------------------------------------------
# elementwise chains


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@mx.compile
def sigmoid_gate(y: mx.array, gate: mx.array) -> mx.array:
    return y * mx.sigmoid(gate)


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's SwiGLU: the gate clamped from above at `limit`, the linear part into [-limit, limit] and shifted by
    one, `(up + 1) * gate * sigmoid(alpha * gate)` (mlx-lm's `swiglu_oai`, in its operation order)."""

    @mx.compile
    def act(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1.0) * (gate * mx.sigmoid(alpha * gate))

    return act


# --------------------------------------------------------------------------------------------------
# attention


ATTN_SCORES_BYTES = 32 << 20  # the scores of one block of query rows against the whole context (quantized KV)


def score_rows(n_heads: int, n_keys: int, itemsize: int) -> int:
    """Query positions per block of `quantized_attention`: as many as keep one block's scores within
    ATTN_SCORES_BYTES (at least one). A function of the context alone, never of the cap, so the blocks and
    the logits are the same at every cap."""
    return max(1, ATTN_SCORES_BYTES // (n_heads * n_keys * itemsize))


def key_window(n_keys: int, n_queries: int, window: int) -> int:
    """The first key any of the last `n_queries` positions of `n_keys` sees under a sliding `window` (each query
    sees itself and the window - 1 keys before it); 0 without a window."""
    return max(0, n_keys - n_queries - window + 1) if window else 0


def visible(n_keys: int, first_query: int, n_queries: int, key_start: int, window: int) -> mx.array:
    """[n_queries, n_keys - key_start] bool: query position first_query + i sees key key_start + j (causal, and
    within the window where there is one)."""
    q = mx.arange(first_query, first_query + n_queries)[:, None]
    k = mx.arange(key_start, n_keys)[None]
    mask = q >= k
    return mask & (q < k + window) if window else mask


def quantized_attention(q: mx.array, keys: tuple, values: tuple, scale: float, bits: int, window: int = 0,
                        sinks: mx.array | None = None) -> mx.array:
    """Causal attention of q [B, nq, L, hd] over quantized keys/values ((codes, scales, biases), each
    [B, nkv, N, ...]), scored on the codes with `mx.quantized_matmul` as mlx-lm's quantized SDPA does; a sliding
    `window` reads only the keys it can see, and `sinks` [nq] add one logit per head to each softmax (its share of
    the probability goes nowhere), as `mx.fast.scaled_dot_product_attention(sinks=)` computes them.

    The query heads that share a KV head are stacked as rows of one matmul ([rep * L, hd]) rather than
    broadcast against the codes, the L query positions go a block at a time (`score_rows`), and each (sequence, KV
    head) goes through scores, softmax and values before the next, so what is materialized is one head's share of
    one block's scores (and their softmax), not L x N x nq of them for a long prompt.
    Each (sequence, KV head) is its own matmul: its live codes `[N, ...]` (under a window, the last of them) are
    a contiguous run of the cache's rows, where the batched `[B, nkv, N, ...]` view is strided past the unused positions, and MLX's
    CUDA kernels take only contiguous codes."""
    B, nq, L, D = q.shape
    nkv, N = keys[0].shape[1], keys[0].shape[2]
    start = key_window(N, L, window)
    if start:
        keys, values = (tuple(a[:, :, start:] for a in kv) for kv in (keys, values))
    rep = nq // nkv
    q = (q * scale).reshape(B, nkv, rep, L, D)
    rows = score_rows(nq, N - start, q.dtype.size)
    outs, last = [], None
    for a in range(0, L, rows):
        b = min(L, a + rows)
        mask = visible(N, N - L + a, b - a, start, window) if L > 1 else None  # query a+i sits at key N - L + a + i
        heads = []
        for i, h in itertools.product(range(B), range(nkv)):
            if last is not None and L > 1:  # a prompt's block: left lazy, MLX would schedule every head's scores at
                mx.eval(last)                  # once (all of them live); a decode step's are small and must not sync
            last = _head_attention(q[i, h, :, a:b], tuple(c[i, h] for c in keys), tuple(c[i, h] for c in values),
                                   bits, mask, None if sinks is None else sinks.reshape(nkv, rep)[h])
            heads.append(last)
        outs.append(mx.stack(heads).reshape(B, nkv, rep, b - a, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, nq, L, D)


def _head_attention(q: mx.array, keys: tuple, values: tuple, bits: int, mask: mx.array | None,
                    sinks: mx.array | None) -> mx.array:
    """One (sequence, KV head) of `quantized_attention`: q [rep, T, D] (scaled) over its contiguous codes, through
    scores, softmax and values, so only this head's scores are live: [rep, T, D]."""
    rep, T, D = q.shape
    s = quantized_matmul(q.reshape(rep * T, D), *keys, KV_GROUP, bits)
    if mask is not None:
        s = mx.where(mask, s.reshape(rep, T, -1), mx.finfo(s.dtype).min).reshape(s.shape)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(s.dtype).reshape(rep, 1, 1), (rep, T, 1)).reshape(rep * T, 1)
        s = mx.concatenate([sink, s], axis=-1)
    p = mx.softmax(s, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    return mx.quantized_matmul(p, *values, transpose=False, group_size=KV_GROUP, bits=bits).reshape(rep, T, D)


def attention(q: mx.array, k: mx.array, v: mx.array, cache: KVCache | None, scale: float, window: int = 0,
              sinks: mx.array | None = None) -> mx.array:
    """Causal attention of q [B, nq, L, hd] over the cache's keys and values once this call's k, v
    [B, nkv, L, hd] are stored: on the codes where the cache is quantized (`quantized_attention`), else MLX's
    fused kernel, GQA handled by it. A sliding `window` (each query sees itself and the window - 1 positions
    before it) is a mask over positions of the same cache: only the keys some query of the call can see are read
    (a decode step's last `window`), the rest masked out; `sinks` [nq] are per-head logits joining each softmax
    (gpt-oss). Returns [B, nq, L, hd]."""
    L = q.shape[2]
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    if cache is not None and cache.bits:
        return quantized_attention(q, k, v, scale, cache.bits, window, sinks)
    N = k.shape[2]
    start = key_window(N, L, window)
    if start:
        k, v = k[:, :, start:], v[:, :, start:]
    # causal: query i sits at key position (n_keys - L + i)
    mask = "causal" if L > 1 else None
    if window and L > 1 and N > window:  # some query of the call has keys behind its window
        mask = visible(N, N - L, L, start, window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


# --------------------------------------------------------------------------------------------------
# routed experts


# CUDA: the k largest gates and their renormalised scores as one kernel (`top_gates`) instead of argpartition (a
# block sort: 12 us a call on an H100), take_along_axis, sum and divide (0.86 ms of a Qwen3.6 token's 9.65 ms of
# kernels, bench/gpu_kernels.py). An experiment until a GPU measures it (bench/gpu_parts.py's `route_kernel`).
ROUTE_KERNEL = False

_TOP_GATES_SOURCE = """
    // one warp a row of E gates: the K largest as a stable ascending sort leaves them last (of equal gates the higher
    // index ranks higher), in that order, found one at a time by a butterfly over the lanes of (gate, index), which
    // leaves every lane the same winner; then their gates over their sum (in that order, in float32) where NORM
    const unsigned int gid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int row = gid / 32, lane = gid % 32;
    if (row >= (unsigned int)gates_shape[0]) return;
    constexpr int PER = (E + 31) / 32;
    float v[PER];
    #pragma unroll
    for (int m = 0; m < PER; ++m) {
        const int e = lane + 32 * m;
        v[m] = e < E ? static_cast<float>(gates[(size_t)row * E + e]) : 0.f;
    }
    unsigned int taken = 0;
    float top[K];
    int at[K];
    #pragma unroll
    for (int r = 0; r < K; ++r) {
        float best = 0.f;
        int bi = -1;
        #pragma unroll
        for (int m = 0; m < PER; ++m) {
            const int e = lane + 32 * m;
            if (e < E && !((taken >> m) & 1u) && (bi < 0 || v[m] > best || (v[m] == best && e > bi))) { best = v[m]; bi = e; }
        }
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (oi >= 0 && (bi < 0 || ob > best || (ob == best && oi > bi))) { best = ob; bi = oi; }
        }
        if (bi % 32 == (int)lane) taken |= 1u << (bi / 32);
        top[r] = best;
        at[r] = bi;
    }
    if (lane != 0) return;
    float sum = 0.f;
    #pragma unroll
    for (int r = K - 1; r >= 0; --r) sum += top[r];
    const float total = static_cast<float>(static_cast<T>(sum));
    #pragma unroll
    for (int r = 0; r < K; ++r) {
        inds[(size_t)row * K + K - 1 - r] = at[r];
        scores[(size_t)row * K + K - 1 - r] = NORM ? static_cast<T>(top[r] / total) : static_cast<T>(top[r]);
    }
"""


@functools.cache
def _top_gates_kernel():
    return mx.fast.cuda_kernel("streamoe_top_gates", ["gates"], ["inds", "scores"], _TOP_GATES_SOURCE)


def top_gates(gates: mx.array, k: int, norm_topk: bool) -> tuple[mx.array, mx.array]:
    """CUDA: `route`'s picks and scores from its gates [..., E] in one kernel, a warp a row."""
    E, rows = gates.shape[-1], gates.size // gates.shape[-1]
    inds, scores = _top_gates_kernel()(
        inputs=[gates.reshape(rows, E)], template=[("T", gates.dtype), ("E", E), ("K", k), ("NORM", bool(norm_topk))],
        grid=(rows * 32, 1, 1), threadgroup=(min(128, rows * 32), 1, 1),
        output_shapes=[(rows, k)] * 2, output_dtypes=[mx.uint32, gates.dtype])
    return inds.reshape(*gates.shape[:-1], k), scores.reshape(*gates.shape[:-1], k)


def route(logits: mx.array, k: int, norm_topk: bool) -> tuple[mx.array, mx.array]:
    """Top-k experts: (inds [..., k] uint32, scores [..., k] in the logits' dtype), in router-rank order.

    Exactly mlx-lm's arithmetic: the softmax accumulates in float32 (precise) and returns the logits' dtype;
    the k largest picked by argpartition (kth=-k, last k, in the order argpartition leaves them: that order
    is the one experts are combined in); scores renormalised to sum to 1 (norm_topk_prob). `ROUTE_KERNEL`:
    the picks and scores after the softmax as one CUDA kernel (`top_gates`)."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    if ROUTE_KERNEL and _on_cuda() and gates.shape[-1] <= 32 * 32:
        return top_gates(gates, k, norm_topk)
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if norm_topk:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds.astype(mx.uint32), scores


def route_topk_softmax(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-k experts picked on the router's logits, then a softmax over those k (gpt-oss): (inds [..., k] uint32,
    scores [..., k]) in the order `argpartition` leaves them, as mlx-lm's `mlx_topk` and its precise softmax."""
    inds = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
    return inds.astype(mx.uint32), scores


GROUP_PAIRS = 2  # CUDA: from this many (token, pick) pairs per expert on average a call goes grouped by expert
BLAS_TILE = 16  # CPU: rows per BLAS product in the experts' path (`_switch_glu_blas`)
BLAS_ROWS_PER_EXPERT = 4  # CPU: dequantizing an expert pays for itself from about this many rows (bench/experts_blas.py)
# CUDA, affine 4-bit: the routed experts of a call not grouped by expert (a decode step) one warp an output row
# (`gather_qmv`) instead of `gather_qmm`, whose CUDA kernel runs a decode step's 8 picks as one-row tiles of its GEMM
# (`qmm_sm80`: 28.4 us a gate or up call of Qwen3.6 on an H100, about 5 % of the memory's speed;
# `bench/experts_qmv.py`). Each (token, pick) row alone, as before, so a row's bits do not depend on the call; other
# bits than `gather_qmm`'s (the sums run in another order), the same at every cap.
EXPERTS_QMV = False
QMV_THREADS = 256  # threads a block of `gather_qmv` (8 warps: 8 rows)
DENSE_QMV = False  # CUDA: one token through a dense 4-bit layer (`QLinear`) by `gather_qmv` too, not MLX's qmv


class ExpertKernel(NamedTuple):
    """How a model's routed experts compute: their codes (`bits`, `group_size`, `mode`: affine or mxfp4, as
    `gather_qmm` takes them), the GLU's activation `act(gate, up)`, and from how many tokens the CPU backend
    takes them expert by expert through BLAS (`blas_tokens`, `_switch_glu_blas`)."""

    bits: int
    group_size: int
    mode: str = "affine"
    act: Callable[[mx.array, mx.array], mx.array] = swiglu
    blas_tokens: int = BLAS_TOKENS
    n_experts: int = 0  # the layer's experts: a call's slots hold at most this many distinct (0: never grouped)


def expert_kernel(lay: RecordLayout, args: ModelArgs) -> ExpertKernel:
    """The kernel of `args`' experts stored as `lay`: SwiGLU, or gpt-oss's clamped one (`swiglu_limit`). The
    experts go through BLAS from the block size at which an expert has BLAS_ROWS_PER_EXPERT rows on average
    (Qwen3.6: 128 tokens; with 3 rows an expert `gather_qmm` was 1.07x faster, with 4 the BLAS path 1.3x, with 8 2.4x:
    `bench/experts_blas.py`): a number of tokens, the model's own, never the cap's."""
    act = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit) if args.swiglu_limit else swiglu
    k = args.num_experts_per_tok
    blas = max(BLAS_TOKENS, -(-BLAS_ROWS_PER_EXPERT * args.num_experts // k))
    return ExpertKernel(lay.bits, lay.group_size, lay.mode, act, blas, args.num_experts)


def switch_glu(x: mx.array, w: ExpertWeights, slots: mx.array, kernel: ExpertKernel,
               streams: Streams = ()) -> mx.array:
    """Routed experts for tokens x [N, H] picked as `slots` [N, k] into stacked weights (each of w's arrays is
    [S, ...]): down(act(gate(x), up(x))) per (token, pick) -> [N, k, H], three `gather_qmm` calls in all, each
    followed by its projection's bias where the experts have them. On the CPU backend the picks are split over
    `streams` (`cpu_streams`, one core each); every (token, pick) row is computed by the same kernel whatever the
    split, so results do not depend on it. Small experts stay on one stream: below SPLIT_ROWS x 512 weights per matrix a stream hop
    costs more than it saves. On CUDA a call of GROUP_PAIRS pairs an expert or more (a prefill step) of affine
    experts goes grouped by expert (`_switch_glu_grouped`), with the same bits (measured there; MXFP4's kernels and
    Metal's, not measured, keep the per-pair path)."""
    if x.shape[0] >= kernel.blas_tokens and mx.default_device() == mx.cpu:
        return _switch_glu_blas(x, w, slots, kernel)
    if groups_by_expert(slots.size, kernel.n_experts, kernel.mode) and _on_cuda():
        return _switch_glu_grouped(x, w, slots, kernel)
    if EXPERTS_QMV and kernel.mode == "affine" and kernel.bits == 4 and _on_cuda():
        return _switch_glu_qmv(x, w, slots, kernel)
    if not streams or slots.shape[-1] < 2 or w.gate_w.shape[-2] * x.shape[-1] < SPLIT_ROWS * 512:
        return _switch_glu(x, w, slots, kernel)
    return _by_picks(x, w, slots, kernel, min(len(streams), slots.shape[-1]), streams)


def groups_by_expert(pairs: int, n_experts: int, mode: str) -> bool:
    """Whether CUDA computes a call of `pairs` (token, pick) pairs grouped by expert (`_switch_glu_grouped`): affine
    codes (measured bit-identical there; MXFP4 not measured), GROUP_PAIRS pairs an expert or more on average. The
    plan counts the grouped batches by the same rule."""
    return bool(n_experts) and mode == "affine" and pairs >= GROUP_PAIRS * n_experts


def _by_picks(x, w, slots, kernel: ExpertKernel, n: int, streams: Streams = ()) -> mx.array:
    """`_switch_glu` over the picks in n parts (part j on streams[j] where given), [N, k, H] again."""
    k, parts = slots.shape[-1], []
    for j in range(n):
        with mx.stream(streams[j]) if streams else contextlib.nullcontext():
            parts.append(_switch_glu(x, w, slots[:, j * k // n:(j + 1) * k // n], kernel))
    return mx.concatenate(parts, axis=1)


def _switch_glu_grouped(x, w, slots, kernel: ExpertKernel):
    """`_switch_glu` for a prefill step on CUDA: the (token, pick) pairs grouped by slot (`group_by_expert`), each
    batch of `rows` one `gather_qmm` product, so an expert's codes are read once per batch, not once per pair (MLX's
    CUDA kernel ignores `sorted_indices`: one one-row GEMM per pair). Every row bit-identical to `_switch_glu`'s
    (affine 4- and 3-bit, bfloat16 and float32, on the H200: `bench/experts_grouped.py`); a Qwen3.6 step of 256
    tokens 2.8x (q4) and 3.6x (q3) faster there, 1,024 tokens 5.6x and 9x."""
    rows, _ = grouped_batches(slots.size, kernel.n_experts)
    return in_batches(x, w, group_by_expert(slots, rows, kernel.n_experts), kernel)


def in_batches(x: mx.array, w: ExpertWeights, groups: tuple[mx.array, mx.array, mx.array],
               kernel: ExpertKernel) -> mx.array:
    """The routed experts [T, k, H] of tokens x [T, H] computed in the batches of `groups` (`group_by_expert`'s, or
    any grouping of that form), one `gather_qmm` batch each, and put back in (token, pick) order."""
    experts, src, back = groups
    y = expert_glu(x[src].reshape(experts.size, -1, x.shape[-1]), w, experts, kernel)
    return y.reshape(-1, x.shape[-1])[back].reshape(x.shape[0], -1, x.shape[-1])


# one warp a (pick, output row): its lanes read the row's words side by side, each word 8 codes of one group, and
# sum scale * (codes . x) + bias * sum(x) group by group; then the warp adds its lanes' sums
_QMV_SOURCE = """
    const unsigned int gid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int warp = gid / 32, lane = gid % 32;
    const unsigned int picks = slots_shape[0];
    if (warp >= picks * MATS * N) return;
    const unsigned int p = warp / (MATS * N), m = (warp / N) % MATS, n = warp % N;
    const size_t slot = slots[p];
    const auto* xr = x + (size_t)rows[p] * K;
    const uint32_t* wr = (m == 0 ? w0 : w1) + (slot * N + n) * (K / 8);
    const auto* sr = (m == 0 ? s0 : s1) + (slot * N + n) * (K / GROUP);
    const auto* br = (m == 0 ? b0 : b1) + (slot * N + n) * (K / GROUP);
    float acc = 0.f;
    for (unsigned int i = lane; i < K / 8; i += 32) {
        const uint32_t word = wr[i];
        float qx = 0.f, sx = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float xv = static_cast<float>(xr[i * 8 + j]);
            qx += static_cast<float>((word >> (4 * j)) & 15u) * xv;
            sx += xv;
        }
        const unsigned int g = i * 8 / GROUP;
        acc += static_cast<float>(sr[g]) * qx + static_cast<float>(br[g]) * sx;
    }
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[((size_t)m * picks + p) * N + n] = static_cast<T>(acc);
"""


@functools.cache
def _qmv_kernel():
    return mx.fast.cuda_kernel("streamoe_experts_qmv", ["x", "rows", "slots", "w0", "s0", "b0", "w1", "s1", "b1"],
                               ["y"], _QMV_SOURCE)


def gather_qmv(x: mx.array, rows: mx.array, slots: mx.array, mats: list[tuple[mx.array, mx.array, mx.array]],
               group_size: int, threads: int | None = None) -> mx.array:
    """CUDA: y [len(mats), P, N] of one or two affine 4-bit matrices (w [S, N, K/8] uint32, scales and biases
    [S, N, K/group] at x's dtype): for each pick p, row x[rows[p]] of x [R, K] times slot slots[p] of each, one warp
    an output row, in float32 to one rounding at the end (two matrices: gate and up in one launch)."""
    w0, s0, b0 = mats[0]
    w1, s1, b1 = mats[-1]
    n, k, picks = w0.shape[1], x.shape[-1], slots.shape[0]
    (y,) = _qmv_kernel()(inputs=[x, rows, slots, w0, s0, b0, w1, s1, b1],
                         template=[("T", x.dtype), ("K", k), ("N", n), ("GROUP", group_size), ("MATS", len(mats))],
                         grid=(len(mats) * picks * n * 32, 1, 1), threadgroup=(threads or QMV_THREADS, 1, 1),
                         output_shapes=[(len(mats), picks, n)], output_dtypes=[x.dtype])
    return y


@functools.lru_cache(maxsize=64)
def pair_rows(tokens: int, k: int) -> tuple[mx.array, mx.array]:
    """For `tokens` x `k` (token, pick) pairs in order: each pair's token (its row of x), and each pair itself (its
    row of the hidden activations), uint32 constants made once per shape."""
    pairs = np.arange(tokens * k, dtype=np.uint32)
    return mx.array(pairs // k), mx.array(pairs)


def _switch_glu_qmv(x, w, slots, kernel: ExpertKernel):
    """`_switch_glu` through `gather_qmv` (CUDA, affine 4-bit): gate and up in one launch, then down, each pair's
    rows alone; [N, k, H]."""
    tokens, k = slots.shape
    flat, (token_of, pair) = slots.reshape(-1), pair_rows(tokens, k)

    def biased(y, bias):
        return y if bias is None else y + bias[flat]

    gate, up = gather_qmv(x, token_of, flat, [(w.gate_w, w.gate_s, w.gate_b), (w.up_w, w.up_s, w.up_b)],
                          kernel.group_size)
    h = kernel.act(biased(gate, w.gate_bias), biased(up, w.up_bias))
    y = gather_qmv(h, pair, flat, [(w.down_w, w.down_s, w.down_b)], kernel.group_size)[0]
    return biased(y, w.down_bias).reshape(tokens, k, -1)


def _switch_glu(x, w, slots, kernel: ExpertKernel):
    return expert_glu(mx.expand_dims(x, (-2, -3)), w, slots, kernel).squeeze(-2)  # [N, 1, 1, H]: each token meets its k picks


def expert_glu(x: mx.array, w: ExpertWeights, slots: mx.array, kernel: ExpertKernel) -> mx.array:
    """down(act(gate(x), up(x))) of the experts in `slots` (x's batch dimensions index them as `gather_qmm` takes
    `rhs_indices`), each projection followed by its bias where the experts have them."""
    def qmm(a, wq, s, b, bias):
        # scales/biases at x's dtype (the pools hold them so): mixed dtypes would cast the whole stacked array
        y = mx.gather_qmm(a, wq, s, b, lhs_indices=batch_indices(a.shape[:-2]), rhs_indices=slots, transpose=True,
                          group_size=kernel.group_size, bits=kernel.bits, mode=kernel.mode)
        return y if bias is None else y + mx.expand_dims(bias[slots], -2)

    h = kernel.act(qmm(x, w.gate_w, w.gate_s, w.gate_b, w.gate_bias), qmm(x, w.up_w, w.up_s, w.up_b, w.up_bias))
    return qmm(h, w.down_w, w.down_s, w.down_b, w.down_bias)


BATCH_INDICES_MAX = 4096  # a decode step's batches and small prefill blocks; beyond, `gather_qmm` makes its own


@functools.lru_cache(maxsize=64)
def batch_indices(shape: tuple[int, ...]) -> mx.array | None:
    """The indices `gather_qmm` takes x's batch dimensions by when given none (0, 1, ... over `shape`), as a constant
    made once per shape. Left out, they are an `arange` in every call: on CUDA a kernel of its own, three a layer
    of a decode step (120 of a Qwen3.6 token's 1,356 kernels, `bench/gpu_parts.py`'s `step_ops`). The same
    values either way, so the same bits. None for shapes past BATCH_INDICES_MAX (a prefill's: the default)."""
    n = math.prod(shape)
    return mx.array(np.arange(n, dtype=np.uint32).reshape(shape)) if n <= BATCH_INDICES_MAX else None


def grouped_batches(pairs: int, n_experts: int) -> tuple[int, int]:
    """(rows a batch, batches) of a call of `pairs` (token, pick) pairs over `n_experts` experts grouped by expert:
    16 rows up to 16 pairs an expert on average, 32 up to 64, then 64 (the fastest at each on the H200,
    `bench/experts_grouped.py`); batches as `group_by_expert` makes them, fixed by the shapes."""
    per_expert = pairs / n_experts
    rows = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return rows, batch_bound(pairs, rows, n_experts)


def batch_bound(pairs: int, rows: int, n_experts: int) -> int:
    """The batches `group_by_expert` makes of `pairs` pairs, `rows` a batch: a layer's slots hold distinct experts,
    and each expert's pairs fill all its batches but one."""
    return -(-pairs // rows) + min(n_experts, pairs)


def group_by_expert(slots: mx.array, rows: int, n_experts: int) -> tuple[mx.array, mx.array, mx.array]:
    """The (token, pick) pairs of `slots` [T, k] grouped by slot, `rows` pairs to a batch, on the device (no host
    round trip): (each batch's slot [G], each batch row's token [G * rows], each pair's batch row [T * k]). G is
    fixed by the shapes (`batch_bound`); the batches beyond those the picks need, and the rows beyond a slot's
    pairs, are slot 0's and token 0's, computed and not used."""
    t, k = slots.shape
    pairs = t * k
    n_batches = batch_bound(pairs, rows, n_experts)
    flat = slots.reshape(-1).astype(mx.uint32)
    order = mx.argsort(flat).astype(mx.uint32)
    by_slot = flat[order]
    j = mx.arange(pairs, dtype=mx.uint32)
    starts = mx.concatenate([mx.array([True]), by_slot[1:] != by_slot[:-1]])
    pos = j - mx.cummax(mx.where(starts, j, 0))  # each sorted pair's place among its slot's pairs
    first = (pos % rows) == 0
    batch = mx.cumsum(first.astype(mx.uint32)) - 1
    row = batch * rows + pos % rows
    batch_slot = mx.zeros((n_batches,), mx.uint32).at[batch].add(mx.where(first, by_slot, 0))
    src = mx.zeros((n_batches * rows,), mx.uint32).at[row].add(order // k)
    back = mx.zeros((pairs,), mx.uint32).at[order].add(row)
    return batch_slot, src, back


def _switch_glu_blas(x, w, slots, kernel: ExpertKernel):
    """`_switch_glu` for many tokens on the CPU backend (prefill), expert by expert: each picked slot's matrices
    dequantized once and multiplied by numpy's BLAS with all the (token, pick) rows that picked it. Through
    `gather_qmm` every row re-reads its expert's codes at the quantized mat-vec's speed (0.8 GMAC/s a core); here
    an expert's weights serve all its rows. The rows go BLAS_TILE at a time, zero-padded, as the columns of the
    product, so every product has one shape and a row's bits depend on neither its group's size nor its place in the
    tile: BLAS picks its kernel (and its rounding) by the shape, and an expert's group grows where other ranks' picks
    fill it (`ranks.RankExperts`). As for `QLinear._blas`, the path depends only on the number of tokens."""
    n, k = slots.shape
    xs = np.asarray(x.astype(mx.float32))
    flat = np.asarray(slots).reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, pick) rows grouped by slot, each group in token order
    by_slot = flat[order]
    starts = np.flatnonzero(np.r_[True, by_slot[1:] != by_slot[:-1]])
    groups = [(int(by_slot[a]), a, b) for a, b in zip(starts, np.r_[starts[1:], order.size], strict=True)]
    sorted_slots = mx.array(by_slot)

    def project(inp: np.ndarray, wq, s, b, bias, out_dim: int) -> mx.array:
        out = np.empty((inp.shape[0], out_dim), dtype=np.float32)
        tile = np.empty((BLAS_TILE, inp.shape[1]), dtype=np.float32)
        # at most BLAS_BLOCK dequantized rows at once, as `QLinear._blas` (the plan holds that block): several
        # experts' matrices where theirs are smaller, a big one's rows in blocks
        per = max(1, BLAS_BLOCK // out_dim)
        for j in range(0, len(groups), per):
            batch = groups[j:j + per]
            idx = mx.array([slot for slot, _, _ in batch])
            for r0 in range(0, out_dim, BLAS_BLOCK):
                r1 = min(out_dim, r0 + BLAS_BLOCK)
                dense = np.asarray(mx.dequantize(wq[idx, r0:r1], s[idx, r0:r1], None if b is None else b[idx, r0:r1],
                                                 group_size=kernel.group_size, bits=kernel.bits,
                                                 mode=kernel.mode).astype(mx.float32))
                for m, (_, a, c) in enumerate(batch):
                    for t in range(a, c, BLAS_TILE):  # one product shape: a row's bits never depend on its group's size
                        u = min(c, t + BLAS_TILE)
                        tile[: u - t] = inp[t:u]
                        tile[u - t:] = 0
                        # the tile's rows as the product's columns: a row's place in the tile then changes none of its
                        # bits (as rows, OpenBLAS's AVX-512 kernels round a row by where it falls in the tile)
                        out[t:u, r0:r1] = (dense[m] @ tile.T).T[: u - t]
        y = mx.array(out).astype(x.dtype)
        return y if bias is None else y + bias[sorted_slots]

    rows_in = xs[order // k]
    inter = w.gate_w.shape[-2]
    h = kernel.act(project(rows_in, w.gate_w, w.gate_s, w.gate_b, w.gate_bias, inter),
                   project(rows_in, w.up_w, w.up_s, w.up_b, w.up_bias, inter))
    y = project(np.asarray(h.astype(mx.float32)), w.down_w, w.down_s, w.down_b, w.down_bias, x.shape[-1])
    back = np.empty_like(order)
    back[order] = np.arange(order.size)
    return y[mx.array(back)].reshape(n, k, x.shape[-1])


def combine(outs: mx.array, scores: mx.array) -> mx.array:
    """outs [..., k, H] in router-rank order, scores [..., k] -> sum_j outs[..., j, :] * scores[..., j],
    accumulated left to right in rank order with elementwise ops (no reduction kernel), so the result
    depends only on the values, not on shapes or batching. The picks are split apart in one node per operand (a
    slice and a squeeze per pick each otherwise)."""
    k = outs.shape[-2]
    picks, weights = mx.split(outs, k, axis=-2), mx.split(mx.expand_dims(scores, -1), k, axis=-2)
    acc = picks[0] * weights[0]
    for y, w in zip(picks[1:], weights[1:], strict=True):
        acc = acc + y * w
    return acc.squeeze(-2)


class ResidentExperts:
    """Reference expert provider: every layer's stacked expert tensors in memory.

    `expert_tensors`: "{experts module}.{gate,up,down}_proj.{part}" of every layer (`ModelArgs.experts_module`:
    "language_model.model.layers.N.mlp.switch_mlp" for qwen3_5_moe, "model.layers.N.mlp.experts" for gpt_oss; the
    parts of the family's expert record: weight, scales and biases, or MXFP4's weight and scales, and each
    projection's bias where the family has one), stacked [E, ...] as stored; float arrays are cast to `dtype` once.
    The picks run over `streams`."""

    def __init__(self, args: ModelArgs, expert_tensors: dict[str, mx.array], dtype=mx.float32, streams: Streams = ()):
        self.args, self.dtype, self.streams = args, dtype, streams
        lay = source_layout(args)
        self.kernel = expert_kernel(lay, args)
        E = args.num_experts
        self.layers = []
        for i in range(args.num_hidden_layers):
            p = args.experts_module(i)
            arrays = []
            for seg in lay.segments:
                name = f"{p}.{seg.proj}.{seg.part}"
                if name not in expert_tensors:
                    raise StreamoeError(f"missing tensor {name}")
                a = expert_tensors[name]
                if tuple(a.shape) != (E, *seg.shape):
                    raise StreamoeError(f"{name}: shape {tuple(a.shape)}, expected {(E, *seg.shape)} "
                                        f"({lay.bits}-bit {lay.mode}, group {lay.group_size}, {E} experts)")
                stored = mx.uint32 if seg.part == "weight" else mx.uint8 if seg.dtype == "U8" else None
                if (a.dtype != stored) if stored is not None else not mx.issubdtype(a.dtype, mx.floating):
                    raise StreamoeError(f"{name}: dtype {a.dtype}, expected {stored or 'a float dtype'}")
                arrays.append(a if stored is not None else a.astype(dtype))
            mx.eval(arrays)
            self.layers.append(lay.weights(arrays))

    def __call__(self, i: int, x: mx.array, inds: mx.array) -> mx.array:
        """Layer i's picks' outputs [..., k, H] (router-rank order) for x [..., H] and inds [..., k] from `route`."""
        shape, k = x.shape, inds.shape[-1]
        y = switch_glu(x.reshape(-1, shape[-1]), self.layers[i], inds.reshape(-1, k), self.kernel, self.streams)
        return y.reshape(*shape[:-1], k, shape[-1])


# --------------------------------------------------------------------------------------------------
# the layer loop


def run_layers(layers: list, h: mx.array, cache: list, positions: int | mx.array, rope, experts,
               step: int | None = None, on_layer: Callable[[int], None] | None = None) -> mx.array:
    """Every decoder layer over h [B, L, H] with its cache entry. A layer has `mix(h, cache, rope, rot) -> (h, x)`
    (the residual stream after its mixer, the MoE block's input), `front(h, cache, rope, rot) -> (h, x, routed)`
    (the same and x's routing; compiled for one token) and `mlp` with `route(x) -> routed` and
    `finish(i, x, experts, h, *routed)` (the block's output added to h). positions: the
    int position of h's first token, or positions as the family's `rope.prepare` takes them (None: no layer
    rotates). `experts(i, x, inds)` gives layer i's picks' outputs [..., k, H]; a provider whose `eager_mixer` is set
    (one decode step waiting per layer for its picks) gets each layer's MoE input as soon as it is built
    (`queue(i, x)`), and one
    with `layers_ahead(i, h)` runs as many decode layers from i ahead of their picks (`_run_ahead`: its `on_hot`,
    `queue` and `check_ahead`).

    `step` (prefill): each layer runs over h in blocks of `step` tokens, one after another, before the next
    layer starts. Block j of layer i then sees exactly what it would in a call of its own (its input, the
    cache after blocks 0..j-1), with the same shapes, so the result is bit for bit that of calls of `step`
    tokens, whatever L is; and a layer's routed experts are needed once for all its blocks: the provider's
    `prepare(i, inds, xs)`, where it has one, gets every block's picks before any block's experts run.

    Of several blocks, each keeps only its residual stream and its picks until its experts run; its MoE input
    and routing are then recomputed (the same kernels on the same values: the same bits), so a chunk's tokens
    hold about two rows of the residual stream each, not the routing's intermediates
    (`plan.chunk_token_bytes`): a longer chunk fits the same memory, and each is one read of its experts.

    A block is queued once the block before it is settled: a GPU's host builds and queues blocks far faster than
    the device runs them, and a queued block's temporaries are allocated as it is queued, so a layer's blocks could
    all hold theirs at once (on the H200, q3 at `--cap 4`, an 8K-token chunk of 33 blocks: MLX's peak 1.8 GB
    above what the engine held, against an activation account of 0.4 GB for one block). Building a block's graph,
    the host's part, still overlaps the device's run of the block before it. `on_layer(i)` (prefill) is called
    once layer i is queued, the layer before it settled: a long prompt's progress."""
    if step is None:
        rot = rope.prepare(positions) if rope is not None else None
        queue_input = experts.queue if getattr(experts, "eager_mixer", False) else None  # each MoE input once built
        layers_ahead = getattr(experts, "layers_ahead", None)  # and run layers ahead of their picks
        i = 0
        while i < len(layers):
            n = layers_ahead(i, h) if layers_ahead is not None else 0
            if n > 1:
                h, i = _run_ahead(layers, h, cache, rope, rot, experts, i, i + n)
                continue
            h, x, routed = layers[i].front(h, cache[i], rope, rot)
            if queue_input is not None:
                queue_input(i, x)
            h = layers[i].mlp.finish(i, x, experts, h, *routed)
            i += 1
        return h
    spans = [(a, min(a + step, h.shape[1])) for a in range(0, h.shape[1], step)]
    rots = [(positions + a if isinstance(positions, int) else positions[..., a:b]) for a, b in spans]
    rots = [rope.prepare(r) if rope is not None else None for r in rots]
    prepare = getattr(experts, "prepare", None)
    if len(spans) == 1:  # one block keeps its MoE input and routing: nothing to recompute
        return _layers_of_one_block(layers, h, cache, rope, rots[0], experts, prepare, on_layer)
    hs = [h[:, a:b] for a, b in spans]
    for i, layer in enumerate(layers):
        blocks, queued = [], None
        for j in range(len(hs)):
            hj, xj = layer.mix(hs[j], cache[i], rope, rots[j])
            hs[j] = None  # each input block is freed once its output is computed: one row a token, not two
            if isinstance(cache[i], KVCache) and j + 1 < len(hs):
                settle(hj, experts, i)  # the next block's KV write must find no reader of the cache: written in place
            inds = layer.mlp.route(xj)[0]
            if queued is not None:  # the routing's intermediates freed block by block, one block queued at a time
                settle(queued, experts, i)
            mx.async_eval(inds)
            queued = inds
            blocks.append((hj, inds))
        if prepare is not None:
            prepare(i, [b[1] for b in blocks], (layer.moe_input(b[0]) for b in blocks))
        hs, queued = [], None
        while blocks:  # each block combined right after its experts (their k rows a token freed before the next
            hj, inds = blocks.pop(0)  # block's run), and let go of as its output is made
            xj = layer.moe_input(hj)
            rest = layer.mlp.route(xj)[1:]  # the picks stay those `prepare` landed
            if queued is not None:  # before this block's experts are queued (a provider queues them when called)
                settle(queued, experts, i)
            hs.append(layer.mlp.finish(i, xj, experts, hj, inds, *rest))
            mx.async_eval(hs[-1])
            queued = hs[-1]
        if on_layer is not None:
            on_layer(i)
    return mx.concatenate(hs, axis=1)


def _run_ahead(layers: list, h: mx.array, cache: list, rope, rot, experts, start: int, end: int) -> tuple[mx.array, int]:
    """Decode layers start..end-1 over h with each layer's experts computed from the slots the provider's hot tier
    holds (`experts.on_hot()`), no wait for their picks, then one wait for them all (`experts.check_ahead`). Every
    layer whose picks were all held computed exactly what it would have the usual way. From the first that missed a
    pick the run is thrown away: the caches of the layers after it are rewound, and its experts run the usual way
    (its front, right, is kept). Returns (h after the last layer kept, the next layer to run). The marks hold each
    Gated DeltaNet layer's previous state until the wait (2 MiB a layer at Qwen3.6's full size, a few dozen MiB for
    a whole run), inside an activation account sized for a prefill step (hundreds of MiB)."""
    marks = [cache[i].mark() for i in range(start, end)]
    on_hot = experts.on_hot()
    fronts = []
    for i in range(start, end):
        hi, x, routed = layers[i].front(h, cache[i], rope, rot)
        fronts.append((hi, x, routed))
        h = layers[i].mlp.finish(i, x, on_hot, hi, *routed)
        experts.queue(i, h)  # each layer queued as built: the device computes while the host builds the next
    missed = experts.check_ahead(start, [routed[0] for _, _, routed in fronts], h)
    if missed is None:
        return h, end
    for i in range(missed + 1, end):
        cache[i].rewind(marks[i - start])
    hi, x, routed = fronts[missed - start]
    return layers[missed].mlp.finish(missed, x, experts, hi, *routed), missed + 1


def _layers_of_one_block(layers: list, h: mx.array, cache: list, rope, rot, experts, prepare,
                         on_layer: Callable[[int], None] | None = None) -> mx.array:
    """Every layer over a chunk of one block (each chunk where every expert is resident, and a capped chunk no longer
    than a step), each layer's experts queued only once the layer before it (for the first, the block's input) is
    settled. A GPU's host builds and
    queues layers far faster than the device runs them, and MLX's CUDA backend holds every kernel's inputs and
    temporaries until the graph it was queued in completes, so a chunk whose layers nothing waited for held many
    layers' temporaries at once, several full-attention layers' scores among them (on the H200, a 32K-token prompt
    with every expert resident: MLX's peak 3,771 MiB above what the engine held, against an activation account of
    917 MiB for one step). Settling the block's input also releases the chunk before's hold on the KV caches, so
    this chunk's writes are in place. Each layer's mixer and routing are built before the wait, so that part of the
    host's work overlaps the device's run of the layer before."""
    queued = h
    for i, layer in enumerate(layers):
        h, x, (inds, *routed) = layer.front(h, cache[i], rope, rot)
        if prepare is not None:
            prepare(i, [inds], [x])
        settle(queued, experts, i)  # before this layer's experts are queued (a provider queues them when called)
        h = layer.mlp.finish(i, x, experts, h, inds, *routed)
        mx.async_eval(h)
        queued = h
        if on_layer is not None:
            on_layer(i)
    return h


# --------------------------------------------------------------------------------------------------
# what the attention-only families (qwen3_moe, gpt_oss, mixtral) share around their attention and router


@mx.compile
def moe_residual(h: mx.array, outs: mx.array, scores: mx.array) -> mx.array:
    """h + the picks' outputs outs [..., k, H] combined by their scores (`combine`): one kernel on GPUs."""
    return h + combine(outs, scores)


class RoutedMoe:
    """An MoE block of routed experts alone: the family's `route(x) -> (inds, scores)` picks them (router-rank order)
    and an experts provider computes them (it owns where their weights live); their outputs, weighted by the
    scores, are added to the residual stream."""

    def __call__(self, i: int, x: mx.array, experts, residual: mx.array) -> mx.array:
        return self.finish(i, x, experts, residual, *self.route(x))

    def finish(self, i: int, x: mx.array, experts, residual: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """residual + the routed experts' combination."""
        return moe_residual(residual, experts(i, x, inds), scores)


class GroupedAttention:
    """What the families' attention shares around its projections: rotation, the KV cache and attention (`core`),
    the output projection over the heads (`out`). The family sets `scale` and `o_proj`, where it has them `window`
    and `sinks`, and `project(x) -> [q, k, v, *rest]`."""

    window: int = 0
    sinks: mx.array | None = None

    def core(self, q: mx.array, k: mx.array, v: mx.array, cache, rope, rot) -> mx.array:
        return attention(rope(q, rot), rope(k, rot), v, cache, self.scale, self.window, self.sinks)

    def out(self, o: mx.array, dtype: mx.Dtype) -> mx.array:
        B, _, L, _ = o.shape
        return self.o_proj(o.astype(dtype).transpose(0, 2, 1, 3).reshape(B, L, -1))


class PreNormLayer:
    """A decoder layer of attention then the MoE block, each behind an RMSNorm and a residual. The family's layer
    sets `i`, `eps`, `self_attn`, `input_layernorm`, `post_attention_layernorm` and `mlp`; its attention has
    `project(x) -> (q, k, v, *rest)` (heads first, before rotation), `core(q, k, v, cache, rope, rot)` (rotation,
    the KV cache, attention) and `out(o, dtype, *rest)` (the output projection)."""

    def mix(self, h: mx.array, cache: KVCache, rope, rot) -> tuple[mx.array, mx.array]:
        """(h + attention(norm(h)), x): the residual stream after attention and the MoE block's input."""
        q, k, v, *rest = self.pre(h)
        return self.mixed(h, self.self_attn.core(q, k, v, cache, rope, rot), *rest)

    def pre(self, h: mx.array) -> list[mx.array]:
        return self.self_attn.project(mx.fast.rms_norm(h, self.input_layernorm, self.eps))

    def mixed(self, h: mx.array, o: mx.array, *rest: mx.array) -> tuple[mx.array, mx.array]:
        h = h + self.self_attn.out(o, h.dtype, *rest)
        return h, self.moe_input(h)

    def post(self, h: mx.array, o: mx.array, *rest: mx.array) -> tuple[mx.array, ...]:
        h, x = self.mixed(h, o, *rest)
        return (h, x, *self.mlp.route(x))

    def moe_input(self, h: mx.array) -> mx.array:
        """The MoE block's input from the residual stream after the mixer (a long prefill chunk recomputes it)."""
        return mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps)

    def front(self, h: mx.array, cache: KVCache, rope, rot) -> tuple[mx.array, mx.array, tuple]:
        """(h after the mixer, the MoE block's input x, x's routing): everything before the routed experts. A
        one-token call runs what comes before and after the KV cache as two compiled functions (`COMPILED_STEP`)."""
        if not compiles(h):
            h, x = self.mix(h, cache, rope, rot)
            return h, x, self.mlp.route(x)
        q, k, v, *rest = compiled(self.pre)(h)
        h, x, *routed = compiled(self.post)(h, self.self_attn.core(q, k, v, cache, rope, rot), *rest)
        return h, x, routed

    def __call__(self, h: mx.array, cache: KVCache, rope, rot, experts) -> mx.array:
        h, x, routed = self.front(h, cache, rope, rot)
        return self.mlp.finish(self.i, x, experts, h, *routed)


def compiles(h: mx.array) -> bool:
    """Whether a layer's call over h [B, L, H] runs compiled: one token (`COMPILED_STEP`)."""
    return h.shape[1] == 1 and COMPILED_STEP


def compiled(method: Callable) -> Callable:
    """`mx.compile` of a bound method, made once per object (a layer: its weights are the compiled graph's constants)
    and kept on it as `compiled_{name}`; MLX traces it again only for a new input shape. The compiled function reaches
    its object through a weak reference: a strong one would make a cycle, and the object's weights would outlive the
    engine that closed them until Python's cycle collector ran."""
    owner, func = method.__self__, method.__func__
    key = f"compiled_{func.__name__}"
    f = owner.__dict__.get(key)
    if f is None:
        ref = weakref.ref(owner)
        f = owner.__dict__[key] = mx.compile(lambda *args: func(ref(), *args))
    return f


class TextModel:
    """What the engine uses of a text-only family whose every layer keeps a KV cache (`models/__init__.py` lists the
    interface); the family's `Model` gives its own `router_logits` and `route`."""

    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype, streams: Streams, layer,
                 rope):
        """`weights`: every non-routed-expert tensor, keyed by its export name ("model.layers.0.self_attn.q_proj.
        weight", ...), as stored; floats are cast once to `dtype`; the tensors used are taken out of the dict.
        `layer(args, loader, i)` builds decoder layer i; the embedding (`model.embed_tokens`), the final norm
        (`model.norm`) and the head (`lm_head`, or the embedding where tied) are named as mlx-lm's exports name
        them. `streams`: the CPU streams the projections split their rows over (`cpu_streams`)."""
        self.args, self.dtype, self.streams, self.rope = args, dtype, streams, rope
        ld = Loader(args, weights, dtype, consume=True, streams=streams)
        H, V = args.hidden_size, args.vocab_size
        self.embed_tokens = ld.embedding("model.embed_tokens", V, H)
        self.layers = [layer(args, ld, i) for i in range(args.num_hidden_layers)]
        self.norm = ld.float("model.norm.weight", (H,))
        self.lm_head = self.embed_tokens.as_linear(streams) if args.tie_word_embeddings else ld.linear("lm_head", V, H)
        mx.eval(weight_arrays([self.layers, self.embed_tokens, self.norm, self.lm_head]))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self, max_tokens: int, kv_dtype=mx.float32, batch: int = 1, kv_bits: int | None = None) -> list:
        """A KV cache per layer (a sliding-window layer's too: its mask reads the window), preallocated to
        `max_tokens` (floats in `kv_dtype`, or `kv_bits`-bit codes with `kv_dtype` scales and biases)."""
        a = self.args
        if kv_bits:
            return [QuantizedKVCache(batch, a.num_key_value_heads, a.head_dim, max_tokens, kv_bits, dtype=kv_dtype)
                    for _ in self.layers]
        return [KVCache(batch, a.num_key_value_heads, a.head_dim, max_tokens, dtype=kv_dtype) for _ in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        """[B, L] token ids -> [B, L, H]: the rows of the quantized embedding, dequantized."""
        return self.embed_tokens(tokens, self.dtype)

    def layers_forward(self, h: mx.array, cache: list, positions: int, experts, step: int | None = None,
                       on_layer: Callable[[int], None] | None = None) -> mx.array:
        """Every decoder layer over h [B, L, H] (`run_layers`); positions: the int position of h's first token."""
        if not isinstance(positions, int):
            raise StreamoeError(f"{self.args.model_type} is a text model: its positions are the tokens' indices, "
                                "not image positions")
        return run_layers(self.layers, h, cache, positions, self.rope, experts, step, on_layer)

    def head(self, h: mx.array) -> mx.array:
        return self.lm_head(mx.fast.rms_norm(h, self.norm, self.args.rms_norm_eps))


def settle(x: mx.array, experts=None, i: int = 0) -> None:
    """Compute x and wait until no kernel before it holds its inputs (a backend keeps a kernel's inputs until its
    completion handler has run, which can be after x is ready): an update of a buffer one of them read is then
    done in place, not as a copy, and their temporaries are back in MLX's cache. The wait is the device's compute
    not hidden behind the host's work: it counts as layer i's in the provider's per-layer records, where it keeps
    them (`stats`), as a fence's wait does."""
    t = time.perf_counter()
    mx.eval(x)
    mx.synchronize()
    stats = getattr(experts, "stats", None)
    if stats is not None:
        stats[i].compute_ms += 1000 * (time.perf_counter() - t)



def weight_arrays(obj) -> list[mx.array]:
    """Every array a layer (or list of layers) holds, through its projections and sub-blocks: what a family
    evaluates once at load."""
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, QLinear):
        return [*obj[:3], *([obj.bias] if obj.bias is not None else [])]
    if isinstance(obj, QEmbedding):
        return list(obj[:3])
    if isinstance(obj, Projections):
        return [a for lin in obj.linears for a in weight_arrays(lin)]
    if isinstance(obj, list | tuple):
        return [a for v in obj for a in weight_arrays(v)]
    if hasattr(obj, "__dict__"):
        return [a for v in vars(obj).values() for a in weight_arrays(v)]
    return []
