"""Qwen3.5 / Qwen3.6 MoE language model (mlx-community 4-bit exports).

The routed experts' weights live wherever an experts provider keeps them, so every MoE block calls one:

    h = layer(h, cache[i], rope, rot, experts)    # mixer, then h + (router -> experts(i, x, inds) + shared)

`Model.layers_forward` is the one layer loop; `forward()` adds the embedding and the head for reference use
(`ResidentExperts` keeps every expert in memory; the engine passes `runtime/experts.StreamingExperts`).

Architecture (40 layers in the 35B-A3B model): every `full_attention_interval`-th layer is gated full
attention with partial, interleaved M-RoPE; the others are Gated DeltaNet (linear attention with a
delta-rule recurrence). Every layer ends in a sparse MoE block (top-k of E experts plus a gated shared
expert). Norm weights of the export already include the +1 of the HF zero-centred norms.

Numerics: activations in `dtype` (float32 on the CPU backend), routing softmax and the recurrent state in
float32. All paths are deterministic; results are bit-identical for identical calls, while splitting a
prompt into differently sized calls changes rounding (matmul shapes, attention and recurrence forms).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..formats.config import PREFIX, ModelArgs
from ..formats.errors import StreamoeError
from ..formats.record import ExpertWeights
from .cache import KV_GROUP, GDNCache, KVCache, QuantizedKVCache

GDN_CHUNK = 64  # chunk length of the chunked (WY) form of the delta rule, used for calls longer than this
EVAL_EVERY = 8  # tokens of the recurrence per evaluation in prefill (the same math, evaluated in pieces)
# The delta rule's form, by backend (`gdn_form()`):
# - "kernel" on CUDA: one kernel per call (`delta_rule_cuda`), any number of tokens. Decode is host-bound there
#   (MLX encodes every kernel into a CUDA graph on the host), and the token loop's compiled step was several
#   kernels plus two copies for the grouped heads per layer: the kernel measured 2.7-3.4 ms faster per
#   full-size token on the H200 (session 7, bench/gpu_parts.py).
# - "fast" on the CPU backend and Metal, calls of up to EVAL_EVERY tokens: MLX's fused
#   `mx.fast.gated_delta_update`; on the CPU the same arithmetic as the token loop below, bit for bit, in fewer
#   passes, but with every token's temporaries alive at once (146 MiB for 64 full-size tokens against the
#   loop's 35), hence the bound.
# - "ops" otherwise: the token loop (evaluated every EVAL_EVERY tokens) or, on a GPU beyond GDN_CHUNK tokens,
#   the chunked form.
GDN_FORM: str | None = None  # None: by backend, as above


def gdn_form() -> str:
    """"kernel", "fast" or "ops" (GDN_FORM, else by backend)."""
    if GDN_FORM is not None:
        return GDN_FORM
    return "kernel" if mx.default_device() == mx.gpu and mx.cuda.is_available() else "fast"


# --------------------------------------------------------------------------------------------------
# weights


# CPU streams for large matrix-vector products: MLX runs each CPU stream on its own thread, so splitting a
# big layer's output rows across streams uses every core. Each output row is computed by the same kernel
# whatever the split, so results do not change with the number of streams.
STREAMS: list = []
SPLIT_ROWS = 1024
BLAS_TOKENS = 16  # CPU: from this many tokens a quantized linear layer runs through numpy's BLAS (QLinear._blas)
BLAS_BLOCK = 1024  # rows dequantized at a time there (the plan's activation account holds one block)


def gpu_compiled(fn):
    """`mx.compile(fn)` on a GPU, where fusing a chain of elementwise ops saves kernel launches (decode is
    launch-bound there); `fn` itself on the CPU backend. Either way every run of a backend computes the
    same ops, so results stay identical across caps and runs."""
    compiled = mx.compile(fn)

    def call(*args):
        return compiled(*args) if mx.default_device() == mx.gpu else fn(*args)

    return functools.wraps(fn)(call)


def set_cpu_streams(n: int) -> None:
    """Use n CPU streams (n <= 1: the default stream only)."""
    STREAMS[:] = [mx.new_stream(mx.cpu) for _ in range(n)] if n > 1 else []


class QLinear(NamedTuple):
    """An affine-quantized linear layer without bias: y = x @ dequantize(weight).T"""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight.shape[0]
        if x.size >= BLAS_TOKENS * x.shape[-1] and mx.default_device() == mx.cpu:
            return self._blas(x)
        if not STREAMS or rows < SPLIT_ROWS * len(STREAMS):
            return mx.quantized_matmul(
                x, self.weight, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits
            )
        n = len(STREAMS)
        step = -(-rows // n)
        parts = []
        for j, st in enumerate(STREAMS):
            a, b = j * step, min(rows, (j + 1) * step)
            with mx.stream(st):
                parts.append(mx.quantized_matmul(x, self.weight[a:b], self.scales[a:b], self.biases[a:b],
                                                 transpose=True, group_size=self.group_size, bits=self.bits))
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

    def __init__(self, ld: _Loader, modules: list[tuple[str, int]], in_dims: int):
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (module, _) in enumerate(modules):
            groups.setdefault(ld.args.quant_params(module), []).append(j)
        self.linears, self.where = [], [None] * len(modules)
        for g, members in enumerate(groups.values()):
            parts = [ld.quantized(modules[j][0], modules[j][1], in_dims) for j in members]
            w, s, b = (mx.concatenate([q[n] for q in parts]) if len(parts) > 1 else parts[0][n] for n in range(3))
            mx.eval(w, s, b)  # now, so the parts are freed as the load goes on
            self.linears.append(QLinear(w, s, b, *parts[0][3:]))
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


class _Loader:
    """Gets tensors from the weight dict, checking presence, dtype and shape, casting floats once. With
    `consume`, each is taken out of the dict, so fused copies are not held twice while a model loads."""

    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype, consume: bool = False):
        self.args, self.weights, self.dtype, self.consume = args, weights, dtype, consume

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

    def linear(self, module: str, out_dims: int, in_dims: int) -> QLinear:
        return QLinear(*self.quantized(module, out_dims, in_dims))


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


# --------------------------------------------------------------------------------------------------
# gated delta rule


@gpu_compiled
def _delta_step(state, q, k, v, log_g, beta):
    """One token. state [B, H, dv, dk] f32; q, k [B, H, dk]; v [B, H, dv]; log_g, beta [B, H].
    Returns y [B, H, dv] in v's dtype and the new state."""
    state = state * mx.exp(log_g)[..., None, None]
    kv = (state * k[..., None, :]).sum(axis=-1)  # what the state currently recalls for k
    delta = (v - kv) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(v.dtype), state


def gated_delta_loop(q, k, v, log_g, beta, state):
    """The recurrence token by token. q, k [B, L, H, dk] (already repeated to H = Hv); v [B, L, H, dv];
    log_g, beta [B, L, H]; state [B, H, dv, dk] float32. Returns y [B, L, H, dv] (v's dtype), state."""
    ys = []
    for t in range(q.shape[1]):
        y, state = _delta_step(state, q[:, t], k[:, t], v[:, t], log_g[:, t], beta[:, t])
        ys.append(y)
        if t % EVAL_EVERY == EVAL_EVERY - 1:  # bound the live graph: a long prompt would hold every step's state
            mx.eval(state, ys)
    return (mx.stack(ys, axis=1) if len(ys) > 1 else ys[0][:, None]), state


_DELTA_RULE_SOURCE = """
    // one thread per row j of one value head's state [DV, DK], carried through the call's tokens
    const int nb = conv_shape[0], len = conv_shape[1];
    const unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (unsigned int)(nb * HV * DV)) return;
    const int j = idx % DV, h = (idx / DV) % HV, b = idx / (DV * HV);
    const int kh = h / (HV / HK);  // the key head this value head reads
    const size_t row = ((size_t)(b * HV + h) * DV + j) * DK;
    float s[DK];
    #pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = state[row + i];
    for (int t = 0; t < len; ++t) {
        const size_t bt = (size_t)b * len + t;
        const float g = expf(log_g[bt * HV + h]);
        const float w = static_cast<float>(beta[bt * HV + h]);
        const auto* q = qk + (bt * 2 * HK + kh) * DK;
        const auto* k = qk + (bt * 2 * HK + HK + kh) * DK;
        float recall = 0.f;
        #pragma unroll
        for (int i = 0; i < DK; ++i) { s[i] *= g; recall += s[i] * static_cast<float>(k[i]); }
        const float delta = (static_cast<float>(conv[bt * CONV + VOFF + h * DV + j]) - recall) * w;
        float acc = 0.f;
        #pragma unroll
        for (int i = 0; i < DK; ++i) { s[i] += static_cast<float>(k[i]) * delta; acc += s[i] * static_cast<float>(q[i]); }
        y[bt * HV * DV + h * DV + j] = static_cast<T>(acc);
    }
    #pragma unroll
    for (int i = 0; i < DK; ++i) state_out[row + i] = s[i];
"""


@functools.cache
def _delta_rule_kernel():
    return mx.fast.cuda_kernel("streamoe_delta_rule", ["qk", "conv", "log_g", "beta", "state"], ["y", "state_out"],
                               _DELTA_RULE_SOURCE)


def delta_rule_cuda(qk, conv, log_g, beta, state, hk: int, hv: int, dk: int, dv: int):
    """The recurrence of a whole call as one CUDA kernel: qk [B, L, 2*Hk, dk] (q, then k: normalised, q scaled),
    conv [B, L, C] (v is its last Hv*dv columns), log_g [B, L, Hv] float32, beta [B, L, Hv] (conv's dtype),
    state [B, Hv, dv, dk] float32. The token loop's arithmetic in float32, one thread per state row, its sums
    over dk taken left to right: y [B, L, Hv, dv] in conv's dtype, and the new state. Shapes other than the
    model's head sizes are read at run time, so every prompt length runs the one compiled kernel."""
    B, L, C = conv.shape
    n = B * hv * dv
    return _delta_rule_kernel()(
        inputs=[qk, conv, log_g, beta, state],
        template=[("T", conv.dtype), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv), ("CONV", C), ("VOFF", C - hv * dv)],
        grid=(n, 1, 1), threadgroup=(min(128, n), 1, 1),
        output_shapes=[(B, L, hv, dv), state.shape], output_dtypes=[conv.dtype, mx.float32])


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C a power of two), by recursive 2x2 block
    inversion done level by level on all diagonal blocks at once: inv([[X, 0], [Y, Z]]) =
    [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]."""
    C = a.shape[-1]
    lead = a.shape[:-2]
    inv = mx.ones((*lead, C, 1, 1), dtype=a.dtype)  # inverses of the 1x1 diagonal blocks
    b = 1
    while b < C:
        P = C // (2 * b)
        p = np.arange(P)[:, None, None]
        rows = (2 * p + 1) * b + np.arange(b)[None, :, None]
        cols = 2 * p * b + np.arange(b)[None, None, :]
        y = a[..., mx.array(rows), mx.array(cols)]  # [..., P, b, b] the block below each diagonal pair
        x_inv, z_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -(z_inv @ y @ x_inv)
        top = mx.concatenate([x_inv, mx.zeros_like(x_inv)], axis=-1)
        bottom = mx.concatenate([low, z_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)  # [..., P, 2b, 2b]
        b *= 2
    return inv.reshape(*lead, C, C)


def gated_delta_chunked(q, k, v, log_g, beta, state, chunk: int = GDN_CHUNK):
    """The same recurrence in chunks of `chunk` tokens (WY form): inside a chunk the delta-rule updates
    are solved as one unit-lower-triangular system, across chunks the state is carried. Same arguments and
    results as `gated_delta_loop`, equal up to float32 rounding."""
    B, L, H, _ = q.shape
    out_dtype = v.dtype
    pad = (-L) % chunk
    if pad:  # padded tokens have beta = 0 and no decay, so they leave the state untouched
        padding = [(0, 0), (0, pad)]
        q, k, v = (mx.pad(t, [*padding, (0, 0), (0, 0)]) for t in (q, k, v))
        log_g, beta = (mx.pad(t, [*padding, (0, 0)]) for t in (log_g, beta))
    N = (L + pad) // chunk

    def heads_first(t):  # [B, N*C, H, ...] -> [B, H, N, C, ...] float32
        t = t.astype(mx.float32).reshape(B, N, chunk, H, *t.shape[3:])
        return t.transpose(0, 3, 1, 2, *range(4, t.ndim))

    q, k, v, log_g, beta = map(heads_first, (q, k, v, log_g, beta))
    gam = mx.cumsum(log_g, axis=-1)  # log of the decay from the chunk start through token t
    idx = mx.arange(chunk)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = gam[..., :, None] - gam[..., None, :]
    decay = mx.exp(mx.where(incl, diff, -mx.inf))  # exp(gam_t - gam_s) for s <= t, else 0

    kb = k * beta[..., None]
    a = mx.where(strict, (kb @ k.swapaxes(-1, -2)) * decay, 0.0)
    t_inv = _unit_lower_inverse(a)
    u = t_inv @ (v * beta[..., None])  # [B, H, N, C, dv]
    w = t_inv @ (kb * mx.exp(gam)[..., None])  # [B, H, N, C, dk]
    qk = mx.where(incl, (q @ k.swapaxes(-1, -2)) * decay, 0.0)
    qg = q * mx.exp(gam)[..., None]
    k_tail = k * mx.exp(gam[..., -1:] - gam)[..., None]
    g_last = mx.exp(gam[..., -1])  # [B, H, N]

    ys = []
    for n in range(N):
        s_t = state.swapaxes(-1, -2)  # [B, H, dk, dv]
        delta = u[:, :, n] - w[:, :, n] @ s_t  # [B, H, C, dv]
        ys.append(qg[:, :, n] @ s_t + qk[:, :, n] @ delta)
        state = state * g_last[:, :, n, None, None] + delta.swapaxes(-1, -2) @ k_tail[:, :, n]
    y = mx.concatenate(ys, axis=2)[:, :, :L]  # [B, H, L, dv]
    return y.transpose(0, 2, 1, 3).astype(out_dtype), state


# --------------------------------------------------------------------------------------------------
# layers


@gpu_compiled
def _gdn_gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(log of the decay (float32), write strength beta) from the a/b projections."""
    return -mx.exp(A_log) * nn.softplus(a + dt_bias), mx.sigmoid(b)


@gpu_compiled
def _gated_out(y: mx.array, z: mx.array) -> mx.array:
    """The gate of the per-head RMSNorm: y (already normalised and scaled) * silu(z), in float32, in z's dtype."""
    return (nn.silu(z.astype(mx.float32)) * y.astype(mx.float32)).astype(z.dtype)


@gpu_compiled
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@gpu_compiled
def _sigmoid_gate(y: mx.array, gate: mx.array) -> mx.array:
    return y * mx.sigmoid(gate)


@gpu_compiled
def _moe_out(h: mx.array, outs: mx.array, scores: mx.array, down: mx.array, out_gate: mx.array) -> mx.array:
    """h + (routed + shared): the picks' outputs outs [..., k, H] combined by their scores, plus the shared
    expert's down projection times sigmoid(its gate): mlx-lm's sums in mlx-lm's order, one kernel on GPUs."""
    return h + (combine(outs, scores) + down * mx.sigmoid(out_gate))


@gpu_compiled
def _conv_silu(seq: mx.array, w: mx.array) -> mx.array:
    """Causal depthwise convolution of seq [B, K-1+L, C] with w [C, K] (taps summed left to right), SiLU."""
    K = w.shape[1]
    L = seq.shape[1] - (K - 1)
    conv = seq[:, 0:L, :] * w[:, 0]
    for j in range(1, K):
        conv = conv + seq[:, j : j + L, :] * w[:, j]
    return nn.silu(conv)


class GatedDeltaNet:
    def __init__(self, args: ModelArgs, ld: _Loader, p: str, chunked: bool | None):
        H, eps = args.hidden_size, args.rms_norm_eps
        self.chunked = chunked
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel, self.eps = args.linear_conv_kernel_dim, eps
        value_dim, conv_dim = self.hv * self.dv, args.conv_dim
        self.in_proj = Projections(ld, [(f"{p}in_proj_qkv", conv_dim), (f"{p}in_proj_z", value_dim),
                                        (f"{p}in_proj_b", self.hv), (f"{p}in_proj_a", self.hv)], H)
        self.conv = ld.float(f"{p}conv1d.weight", (conv_dim, self.kernel, 1))[..., 0]  # [C, K]
        self.dt_bias = ld.float(f"{p}dt_bias", (self.hv,))
        self.A_log = ld.float(f"{p}A_log", (self.hv,), dtype=mx.float32)
        self.norm = ld.float(f"{p}norm.weight", (self.dv,))
        self.out_proj = ld.linear(f"{p}out_proj", H, value_dim)
        inv = self.dk**-0.5  # q and k are L2-normalised together; q also takes the dk^-0.5 readout scale
        self.qk_scale = mx.array([inv**2] * self.hk + [inv] * self.hk, dtype=ld.dtype)[:, None]
        self.qk_eps = 1e-6 * inv**2  # 1e-6 on the sum of squares, as rms_norm's eps on their mean

    def __call__(self, x: mx.array, cache: GDNCache | None) -> mx.array:
        B, L, _ = x.shape
        qkv, z, b, a = self.in_proj(x)
        z = z.reshape(B, L, self.hv, self.dv)

        # causal depthwise convolution over [last K-1 inputs | this call's inputs], then SiLU
        K = self.kernel
        past = cache.conv if cache is not None else mx.zeros((B, K - 1, qkv.shape[-1]), dtype=qkv.dtype)
        seq = mx.concatenate([past, qkv.astype(past.dtype)], axis=1)
        if cache is not None:
            cache.conv = mx.contiguous(seq[:, L:, :])
        conv = _conv_silu(seq, self.conv)

        qk = conv[..., : 2 * self.hk * self.dk]
        qk = mx.fast.rms_norm(qk.reshape(B, L, 2 * self.hk, self.dk), None, self.qk_eps) * self.qk_scale

        log_g, beta = _gdn_gates(a, b, self.A_log, self.dt_bias)
        state = (
            cache.state if cache is not None else mx.zeros((B, self.hv, self.dv, self.dk), dtype=mx.float32)
        )
        y, state = self._delta_rule(qk, conv, log_g, beta, state)
        if cache is not None:
            cache.state = state
            cache.offset += L
        y = _gated_out(mx.fast.rms_norm(y, self.norm, self.eps), z)  # gated RMSNorm per head
        return self.out_proj(y.reshape(B, L, -1))

    def _delta_rule(self, qk, conv, log_g, beta, state):
        """y [B, L, Hv, dv] and the new state, in the backend's form (`gdn_form()`)."""
        B, L, _ = conv.shape
        form = gdn_form()
        if form == "kernel":
            return delta_rule_cuda(qk, conv, log_g, beta, state, self.hk, self.hv, self.dk, self.dv)
        q, k = qk[:, :, : self.hk], qk[:, :, self.hk :]
        v = conv[..., 2 * self.hk * self.dk :].reshape(B, L, self.hv, self.dv)
        if L <= EVAL_EVERY and form == "fast":  # MLX's fused op (GQA built in)
            return mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, state)
        if self.hv != self.hk:  # value head j reads key head j // (Hv/Hk)
            q = mx.repeat(q, self.hv // self.hk, axis=2)
            k = mx.repeat(k, self.hv // self.hk, axis=2)
        if (self.chunked if self.chunked is not None else mx.default_device() == mx.gpu) and L > GDN_CHUNK:
            return gated_delta_chunked(q, k, v, log_g, beta, state)
        return gated_delta_loop(q, k, v, log_g, beta, state)


ATTN_SCORES_BYTES = 32 << 20  # the scores of one block of query rows against the whole context (quantized KV)


def score_rows(n_heads: int, n_keys: int, itemsize: int) -> int:
    """Query positions per block of `quantized_attention`: as many as keep one block's scores within
    ATTN_SCORES_BYTES (at least one). A function of the context alone, never of the cap, so the blocks and
    the logits are the same at every cap."""
    return max(1, ATTN_SCORES_BYTES // (n_heads * n_keys * itemsize))


def per_head(x: mx.array, codes: tuple, matmul) -> mx.array:
    """matmul(x[b, h], codes[.][b, h]) for every sequence b and KV head h, stacked back to [B, nkv, ...]."""
    B, nkv = x.shape[:2]
    rows = [mx.stack([matmul(x[b, h], tuple(c[b, h] for c in codes)) for h in range(nkv)]) for b in range(B)]
    return mx.stack(rows)


def quantized_attention(q: mx.array, keys: tuple, values: tuple, scale: float, bits: int) -> mx.array:
    """Causal attention of q [B, nq, L, hd] over quantized keys/values ((codes, scales, biases), each
    [B, nkv, N, ...]), scored on the codes with `mx.quantized_matmul` as mlx-lm's quantized SDPA does.

    The query heads that share a KV head are stacked as rows of one matmul ([rep * L, hd]) rather than
    broadcast against the codes, and the L query positions go a block at a time (`score_rows`), so what is
    materialized is one block's scores (and their softmax), not L x N x nq of them for a long prompt.
    Each (sequence, KV head) is its own matmul: its live codes `[N, ...]` are a contiguous prefix of the
    cache's rows, where the batched `[B, nkv, N, ...]` view is strided past the unused positions, and MLX's
    CUDA kernels take only contiguous codes."""
    B, nq, L, D = q.shape
    nkv, N = keys[0].shape[1], keys[0].shape[2]
    rep = nq // nkv
    q = (q * scale).reshape(B, nkv, rep, L, D)
    rows = score_rows(nq, N, q.dtype.size)
    outs = []
    for a in range(0, L, rows):
        b = min(L, a + rows)
        qb = q[:, :, :, a:b].reshape(B, nkv, rep * (b - a), D)
        if outs:  # left lazy, MLX would schedule every block's scores at once (measured: all of them live)
            mx.eval(outs[-1])
        s = per_head(qb, keys, lambda x, c: mx.quantized_matmul(x, *c, transpose=True, group_size=KV_GROUP,
                                                                   bits=bits))
        if L > 1:  # query position a+i sits at key position N - L + a + i
            mask = mx.arange(N - L + a, N - L + b)[:, None] >= mx.arange(N)[None]
            s = mx.where(mask, s.reshape(B, nkv, rep, b - a, N), mx.finfo(s.dtype).min).reshape(s.shape)
        p = mx.softmax(s, axis=-1, precise=True)
        o = per_head(p, values, lambda x, c: mx.quantized_matmul(x, *c, transpose=False, group_size=KV_GROUP,
                                                                  bits=bits))
        outs.append(o.reshape(B, nkv, rep, b - a, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, nq, L, D)


class Attention:
    def __init__(self, args: ModelArgs, ld: _Loader, p: str):
        H = args.hidden_size
        self.nq, self.nkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps, self.scale = args.rms_norm_eps, args.head_dim**-0.5
        # q_proj gives per head [query | gate]
        self.qkv_proj = Projections(ld, [(f"{p}q_proj", 2 * self.nq * self.hd), (f"{p}k_proj", self.nkv * self.hd),
                                         (f"{p}v_proj", self.nkv * self.hd)], H)
        self.o_proj = ld.linear(f"{p}o_proj", H, self.nq * self.hd)
        self.q_norm = ld.float(f"{p}q_norm.weight", (self.hd,))
        self.k_norm = ld.float(f"{p}k_norm.weight", (self.hd,))

    def __call__(self, x: mx.array, cache: KVCache | None, rope: MRoPE, rot) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q, gate = mx.split(q.reshape(B, L, self.nq, 2 * self.hd), 2, axis=-1)
        k = k.reshape(B, L, self.nkv, self.hd)
        v = v.reshape(B, L, self.nkv, self.hd)
        q = mx.fast.rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = mx.fast.rms_norm(k, self.k_norm, self.eps).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        q, k = rope(q, rot), rope(k, rot)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if cache is not None and cache.bits:
            out = quantized_attention(q, k, v, self.scale, cache.bits)
        else:  # causal: query i sits at key position (n_keys - L + i); GQA is handled by the kernel
            out = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=self.scale, mask="causal" if L > 1 else None
            )
        out = out.astype(x.dtype).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(_sigmoid_gate(out, gate.reshape(B, L, -1)))


class SparseMoe:
    """The MoE block: the router picks the top-k experts, an experts provider computes them (it owns where
    their weights live), and a gated shared expert is added: routed + shared, mlx-lm's order of the sums."""

    def __init__(self, args: ModelArgs, ld: _Loader, p: str):
        H, Is = args.hidden_size, args.shared_expert_intermediate_size
        self.k, self.norm_topk = args.num_experts_per_tok, args.norm_topk_prob
        # everything that reads the block's input: router, shared expert's gate and up, its output gate
        self.in_proj = Projections(ld, [(f"{p}gate", args.num_experts), (f"{p}shared_expert.gate_proj", Is),
                                        (f"{p}shared_expert.up_proj", Is), (f"{p}shared_expert_gate", 1)], H)
        self.shared_down_proj = ld.linear(f"{p}shared_expert.down_proj", H, Is)

    def gate(self, x: mx.array) -> mx.array:
        """The router's logits alone (the cross-layer guess asks for them)."""
        return self.in_proj.one(x, 0)

    def __call__(self, i: int, x: mx.array, experts, residual: mx.array) -> mx.array:
        """residual + (routed + shared): the block's output already added to the residual stream."""
        return self.finish(i, x, experts, residual, *self.route(x))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Everything before the routed experts: (inds, scores, the shared expert's output, its gate)."""
        logits, gate, up, out_gate = self.in_proj(x)
        inds, scores = route(logits, self.k, self.norm_topk)
        return inds, scores, self.shared_down_proj(swiglu(gate, up)), out_gate

    def finish(self, i: int, x: mx.array, experts, residual: mx.array, inds: mx.array, scores: mx.array,
               down: mx.array, out_gate: mx.array) -> mx.array:
        return _moe_out(residual, experts(i, x, inds), scores, down, out_gate)


class DecoderLayer:
    """Token mixer (Gated DeltaNet or gated attention) and MoE block, each behind an RMSNorm and a residual."""

    def __init__(self, args: ModelArgs, ld: _Loader, i: int, gdn_chunked: bool | None):
        p = f"{PREFIX}model.layers.{i}."
        self.i, self.eps = i, args.rms_norm_eps
        self.is_linear = args.is_linear(i)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args, ld, f"{p}linear_attn.", gdn_chunked)
        else:
            self.self_attn = Attention(args, ld, f"{p}self_attn.")
        self.input_layernorm = ld.float(f"{p}input_layernorm.weight", (args.hidden_size,))
        self.post_attention_layernorm = ld.float(f"{p}post_attention_layernorm.weight", (args.hidden_size,))
        self.mlp = SparseMoe(args, ld, f"{p}mlp.")

    def mix(self, h: mx.array, cache, rope: MRoPE, rot) -> tuple[mx.array, mx.array]:
        """(h + mixer(norm(h)), x): the residual stream after the mixer and the MoE block's input."""
        x = mx.fast.rms_norm(h, self.input_layernorm, self.eps)
        r = self.linear_attn(x, cache) if self.is_linear else self.self_attn(x, cache, rope, rot)
        h = h + r
        return h, mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps)

    def __call__(self, h: mx.array, cache, rope: MRoPE, rot, experts) -> mx.array:
        h, x = self.mix(h, cache, rope, rot)
        return self.mlp(self.i, x, experts, h)


class Model:
    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, mx.array],
        dtype: mx.Dtype = mx.float32,
        gdn_chunked: bool | None = None,
    ):
        """`weights`: every non-routed-expert tensor of the language model, keyed by its export name
        ("language_model.model.layers.0.linear_attn.in_proj_qkv.weight", ...), as stored. Float tensors are
        cast once to `dtype` (scales and biases too), A_log to float32. The tensors used are taken out of the
        dict (projections that read the same input are concatenated, and the parts freed as the load goes);
        other keys are left.

        `gdn_chunked`: whether calls of more than GDN_CHUNK tokens run the delta rule in its chunked form
        (fewer, larger ops) instead of token by token. None = only on a GPU: on the CPU backend the
        token loop is as fast and reproduces mlx-lm bit for bit."""
        self.args, self.dtype = args, dtype
        ld = _Loader(args, weights, dtype, consume=True)
        H = args.hidden_size
        self.embed_tokens = ld.quantized(f"{PREFIX}model.embed_tokens", args.vocab_size, H)
        self.layers = [DecoderLayer(args, ld, i, gdn_chunked) for i in range(args.num_hidden_layers)]
        self.norm = ld.float(f"{PREFIX}model.norm.weight", (H,))
        if args.tie_word_embeddings:
            self.lm_head = QLinear(*self.embed_tokens)
        else:
            self.lm_head = ld.linear(f"{PREFIX}lm_head", args.vocab_size, H)
        self.rope = MRoPE(args.rotary_dim, args.rope_theta, args.mrope_section)
        arrays = [v for layer in self.layers for v in _arrays(layer)] + [*self.embed_tokens[:3], self.norm]
        mx.eval(arrays, self.lm_head[:3])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self, max_tokens: int, kv_dtype=mx.float32, batch: int = 1, kv_bits: int | None = None) -> list:
        """One entry per layer: a KV cache preallocated to `max_tokens` for full attention (floats in
        `kv_dtype`, or `kv_bits`-bit codes with `kv_dtype` scales and biases), a GDNCache (conv window +
        float32 recurrent state) for Gated DeltaNet."""
        a = self.args

        def kv():
            if kv_bits:
                return QuantizedKVCache(batch, a.num_key_value_heads, a.head_dim, max_tokens, kv_bits, dtype=kv_dtype)
            return KVCache(batch, a.num_key_value_heads, a.head_dim, max_tokens, dtype=kv_dtype)

        return [
            GDNCache(batch, a.linear_conv_kernel_dim, a.conv_dim, a.linear_num_value_heads,
                     a.linear_value_head_dim, a.linear_key_head_dim, dtype=self.dtype)
            if layer.is_linear
            else kv()
            for layer in self.layers
        ]  # fmt: skip

    def embed(self, tokens: mx.array) -> mx.array:
        """[B, L] token ids -> [B, L, H]: the rows of the quantized embedding, dequantized."""
        w, s, b, bits, group = self.embed_tokens
        return mx.dequantize(w[tokens], s[tokens], b[tokens], group_size=group, bits=bits).astype(self.dtype)

    def layers_forward(self, h: mx.array, cache: list, positions: int | mx.array, experts,
                       step: int | None = None) -> mx.array:
        """The one layer loop: every decoder layer over h [B, L, H] with its cache entry. positions: the int
        position of h's first token for plain text, or [3, B, L] int32 (t, h, w) M-RoPE positions.
        `experts(i, x, inds)` gives layer i's picks' outputs [..., k, H].

        `step` (prefill): each layer runs over h in blocks of `step` tokens, one after another, before the next
        layer starts. Block j of layer i then sees exactly what it would in a call of its own (its input, the
        cache after blocks 0..j-1), with the same shapes, so the result is bit for bit that of calls of `step`
        tokens, whatever L is; and a layer's routed experts are needed once for all its blocks: the provider's
        `prepare(i, inds, xs)`, where it has one, gets every block's picks before any block's experts run."""
        if step is None:
            rot = self.rope.prepare(positions) if self.args.n_full_attention else None
            for i, layer in enumerate(self.layers):
                h = layer(h, cache[i], self.rope, rot, experts)
            return h
        spans = [(a, min(a + step, h.shape[1])) for a in range(0, h.shape[1], step)]
        rots = [(positions + a if isinstance(positions, int) else positions[..., a:b]) for a, b in spans]
        rots = [self.rope.prepare(r) if self.args.n_full_attention else None for r in rots]
        hs = [h[:, a:b] for a, b in spans] if len(spans) > 1 else [h]
        prepare = getattr(experts, "prepare", None)
        for i, layer in enumerate(self.layers):
            blocks = []
            for j, hj in enumerate(hs):
                hj, xj = layer.mix(hj, cache[i], self.rope, rots[j])
                if not layer.is_linear and j + 1 < len(hs):
                    _settle(hj)  # the next block's KV write must find no reader of the cache: written in place
                blocks.append((hj, xj, *layer.mlp.route(xj)))
            if prepare is not None:
                prepare(i, [b[2] for b in blocks], [b[1] for b in blocks])
            hs = []
            for hj, xj, *rest in blocks:  # each block combined right after its experts, before the next block's
                hs.append(layer.mlp.finish(i, xj, experts, hj, *rest))  # run: their outputs (k rows a token) freed
                mx.async_eval(hs[-1])
        return mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0]

    def router_logits(self, i: int, x: mx.array) -> mx.array:
        return self.layers[i].mlp.gate(x)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return route(logits, self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def head(self, h: mx.array) -> mx.array:
        return self.lm_head(mx.fast.rms_norm(h, self.norm, self.args.rms_norm_eps))


def _settle(x: mx.array) -> None:
    """Compute x and wait until no kernel before it holds its inputs (a backend keeps a kernel's inputs until its
    completion handler has run, which can be after x is ready): an update of a buffer one of them read is then
    done in place, not as a copy."""
    mx.eval(x)
    mx.synchronize()


def _arrays(obj) -> list[mx.array]:
    out = []
    for v in vars(obj).values():
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, QLinear):
            out.extend(v[:3])
        elif isinstance(v, Projections):
            out.extend(a for lin in v.linears for a in lin[:3])
        elif isinstance(v, GatedDeltaNet | Attention | SparseMoe):
            out.extend(_arrays(v))
    return out


# --------------------------------------------------------------------------------------------------
# routed experts


def route(logits: mx.array, k: int, norm_topk: bool) -> tuple[mx.array, mx.array]:
    """Top-k experts: (inds [..., k] uint32, scores [..., k] in the logits' dtype), in router-rank order.

    Exactly mlx-lm's arithmetic: the softmax accumulates in float32 (precise) and returns the logits' dtype;
    the k largest picked by argpartition (kth=-k, last k, in the order argpartition leaves them: that order
    is the one experts are combined in); scores renormalised to sum to 1 (norm_topk_prob)."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if norm_topk:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds.astype(mx.uint32), scores


def switch_glu(x: mx.array, w: ExpertWeights, slots: mx.array, bits: int, group_size: int) -> mx.array:
    """Routed experts for tokens x [N, H] picked as `slots` [N, k] into stacked weights (each of w's nine
    arrays is [S, ...]): down(silu(gate(x)) * up(x)) per (token, pick) -> [N, k, H], three `gather_qmm`
    calls in all. On the CPU backend the picks are split over the CPU streams (one core each); every
    (token, pick) row is computed by the same kernel whatever the split, so results do not depend on it. Small
    experts stay on one stream: below SPLIT_ROWS x 512 weights per matrix a stream hop costs more than it saves."""
    if not STREAMS or slots.shape[-1] < 2 or w.gate_w.shape[-2] * x.shape[-1] < SPLIT_ROWS * 512:
        return _switch_glu(x, w, slots, bits, group_size)
    k, n = slots.shape[-1], min(len(STREAMS), slots.shape[-1])
    parts = []
    for j in range(n):
        with mx.stream(STREAMS[j]):
            parts.append(_switch_glu(x, w, slots[:, j * k // n:(j + 1) * k // n], bits, group_size))
    return mx.concatenate(parts, axis=1)


def _switch_glu(x, w, slots, bits, group_size):
    def qmm(a, wq, s, b):
        # scales/biases at x's dtype (the pools hold them so): mixed dtypes would cast the whole stacked array
        return mx.gather_qmm(a, wq, s, b, rhs_indices=slots, transpose=True, group_size=group_size, bits=bits)

    xe = mx.expand_dims(x, (-2, -3))  # [N, 1, 1, H]: each token meets its k picks
    h = swiglu(qmm(xe, w.gate_w, w.gate_s, w.gate_b), qmm(xe, w.up_w, w.up_s, w.up_b))
    return qmm(h, w.down_w, w.down_s, w.down_b).squeeze(-2)


def combine(outs: mx.array, scores: mx.array) -> mx.array:
    """outs [..., k, H] in router-rank order, scores [..., k] -> sum_j outs[..., j, :] * scores[..., j],
    accumulated left to right in rank order with elementwise ops (no reduction kernel), so the result
    depends only on the values, not on shapes or batching."""
    acc = outs[..., 0, :] * scores[..., 0:1]
    for j in range(1, outs.shape[-2]):
        acc = acc + outs[..., j, :] * scores[..., j : j + 1]
    return acc


class ResidentExperts:
    """Reference expert provider: every layer's stacked expert tensors in memory.

    `expert_tensors`: "language_model.model.layers.N.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}",
    stacked [E, ...] as stored; scales and biases are cast to `dtype` once."""

    def __init__(self, args: ModelArgs, expert_tensors: dict[str, mx.array], dtype=mx.float32):
        self.args, self.dtype = args, dtype
        ld = _Loader(args, expert_tensors, dtype)
        H, inter, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
        self.layers = []
        for i in range(args.num_hidden_layers):
            p = f"{PREFIX}model.layers.{i}.mlp.switch_mlp."
            parts, quant = [], set()
            for proj, (out_dims, in_dims) in (
                ("gate_proj", (inter, H)),
                ("up_proj", (inter, H)),
                ("down_proj", (H, inter)),
            ):
                w, s, b, bits, group = ld.quantized(p + proj, out_dims, in_dims)
                if w.shape[0] != E:
                    raise StreamoeError(f"{p}{proj}.weight: {w.shape[0]} experts, config says {E}")
                parts += [w, s, b]
                quant.add((bits, group))
            if len(quant) != 1:
                raise StreamoeError(f"{p}: gate/up/down quantized differently: {sorted(quant)}")
            mx.eval(parts)
            self.layers.append((parts, *quant.pop()))

    def __call__(self, i: int, x: mx.array, inds: mx.array) -> mx.array:
        """Layer i's picks' outputs [..., k, H] (router-rank order) for x [..., H] and inds [..., k] from `route`."""
        parts, bits, group = self.layers[i]
        shape, k = x.shape, inds.shape[-1]
        y = switch_glu(x.reshape(-1, shape[-1]), ExpertWeights(*parts), inds.reshape(-1, k), bits, group)
        return y.reshape(*shape[:-1], k, shape[-1])


def forward(
    model: Model,
    tokens: mx.array,
    cache: list,
    experts,
    positions: mx.array | None = None,
    input_embeddings: mx.array | None = None,
) -> mx.array:
    """The whole model for reference use: logits [B, L, V]. `experts(i, x, inds)` gives the picks' outputs; their
    combination is added to the shared expert's before the residual, as mlx-lm does: h + (routed + shared)."""
    h = model.embed(tokens) if input_embeddings is None else input_embeddings.astype(model.dtype)
    B, L = h.shape[:2]
    for c in cache:  # refuse before any layer's state has moved
        if isinstance(c, KVCache) and c.offset + L > c.max_tokens:
            raise StreamoeError(f"KV cache holds {c.max_tokens} tokens; {c.offset + L} were asked for")
    if positions is None:
        positions = cache[0].offset
    return model.head(model.layers_forward(h, cache, positions, experts))
