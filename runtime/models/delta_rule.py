"""Gated DeltaNet's kernels: the causal depthwise convolution in front of it and the gated delta rule in its
three forms (token loop, chunked WY form, one CUDA kernel), chosen per backend by `gated_delta`.

The recurrence, per value head and token: S <- g S;  S <- S + beta (v - S k) k^T;  y = S q, with the state S
[dv, dk] in float32. Every form computes it for a whole call; they agree up to float32 rounding (the loop, MLX's
fused op on the CPU and the CUDA kernel take the same sums in the same order).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

GDN_CHUNK = 64  # chunk length of the chunked (WY) form of the delta rule, used for calls longer than this
EVAL_EVERY = 8  # tokens of the recurrence per evaluation in prefill (the same math, evaluated in pieces)
# The delta rule's form, by backend (`gdn_form()`):
# - "kernel" on CUDA: one kernel per call (`delta_rule_cuda`), any number of tokens. Decode is host-bound there
#   (MLX encodes every kernel into a CUDA graph on the host), and the token loop's compiled step was several
#   kernels plus two copies for the grouped heads per layer: the kernel measured 2.7-3.4 ms faster per
#   full-size token on the H200 (bench/gpu_parts.py).
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



@mx.compile
def causal_conv(window: tuple[mx.array, ...], x: mx.array, w: list[mx.array]) -> tuple[mx.array, tuple[mx.array, ...]]:
    """Causal depthwise convolution of x [B, L, C] after `window` (the last K-1 inputs before it, one [B, 1, C]
    array each, oldest first: `GDNCache.rows`) with the K taps' weights w (each [C], contiguous: `conv_taps`),
    summed left to right, then SiLU; and the next window. One token (a decode step) reads its taps straight from
    the window and x, and the next window is the last K-2 rows and x: no copy of either (on a GPU a concatenation
    and a contiguous copy a layer fewer than through a [window | x] array, the same arithmetic)."""
    K, L = len(w), x.shape[1]
    if L == 1:
        taps = [*window, x]
        nxt = (*window[1:], x) if K > 1 else ()
    else:
        seq = mx.concatenate([*window, x], axis=1)
        taps = [seq[:, j : j + L] for j in range(K)]
        nxt = tuple(mx.split(mx.contiguous(seq[:, L:]), K - 1, axis=1)) if K > 1 else ()
    conv = taps[0] * w[0]
    for j in range(1, K):
        conv = conv + taps[j] * w[j]
    return nn.silu(conv), nxt


def conv_taps(w: mx.array) -> list[mx.array]:
    """A depthwise convolution's weights w [C, K] as K contiguous [C] arrays, made once at load: each step's
    `w[:, j]` would be two graph nodes a tap (a slice and a squeeze), 240 of a Qwen3.6 decode token's."""
    return [mx.contiguous(w[:, j]) for j in range(w.shape[1])]


def gated_delta(qk: mx.array, conv: mx.array, log_g: mx.array, beta: mx.array, state: mx.array,
                hk: int, hv: int, dk: int, dv: int, chunked: bool | None) -> tuple[mx.array, mx.array]:
    """y [B, L, Hv, dv] and the new state, in the backend's form (`gdn_form()`). qk [B, L, 2*Hk, dk] (q, then k:
    normalised, q scaled), conv [B, L, C] (v is its last Hv*dv columns), log_g and beta [B, L, Hv], state
    [B, Hv, dv, dk] float32. `chunked`: whether calls of more than GDN_CHUNK tokens take the chunked form
    (None: on a GPU)."""
    B, L, _ = conv.shape
    form = gdn_form()
    if form == "kernel":
        return delta_rule_cuda(qk, conv, log_g, beta, state, hk, hv, dk, dv)
    q, k = qk[:, :, :hk], qk[:, :, hk:]
    v = conv[..., 2 * hk * dk :].reshape(B, L, hv, dv)
    if L <= EVAL_EVERY and form == "fast":  # MLX's fused op (GQA built in)
        return mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, state)
    if hv != hk:  # value head j reads key head j // (Hv/Hk)
        q = mx.repeat(q, hv // hk, axis=2)
        k = mx.repeat(k, hv // hk, axis=2)
    if (chunked if chunked is not None else mx.default_device() == mx.gpu) and L > GDN_CHUNK:
        return gated_delta_chunked(q, k, v, log_g, beta, state)
    return gated_delta_loop(q, k, v, log_g, beta, state)


@mx.compile
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


# token t's inputs of value head h, in both kernels: its decay g, its beta w, and its query and key (key head kh)
_TOKEN_INPUTS = """
        const size_t bt = (size_t)b * len + t;
        const float g = expf(log_g[bt * HV + h]);
        const float w = static_cast<float>(beta[bt * HV + h]);
        const auto* q = qk + (bt * 2 * HK + kh) * DK;
        const auto* k = qk + (bt * 2 * HK + HK + kh) * DK;
"""

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
""" + _TOKEN_INPUTS + """        float recall = 0.f;
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


_DELTA_RULE_WARP_SOURCE = """
    // one warp per row j of one value head's state [DV, DK]: lane l holds columns l, l + 32, ..., so every read of
    // the state, k and q is one contiguous line; the two sums over dk are each the lanes' own, then a butterfly
    // over the lanes, which leaves the same bits in every lane (each step adds the same two values in either order)
    const int nb = conv_shape[0], len = conv_shape[1];
    const unsigned int gid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int warp = gid / 32, lane = gid % 32;
    if (warp >= (unsigned int)(nb * HV * DV)) return;
    const int j = warp % DV, h = (warp / DV) % HV, b = warp / (DV * HV);
    const int kh = h / (HV / HK);
    const size_t row = ((size_t)(b * HV + h) * DV + j) * DK;
    constexpr int PER = DK / 32;
    float s[PER];
    #pragma unroll
    for (int m = 0; m < PER; ++m) s[m] = state[row + lane + 32 * m];
    for (int t = 0; t < len; ++t) {
""" + _TOKEN_INPUTS + """        float kk[PER], recall = 0.f;
        #pragma unroll
        for (int m = 0; m < PER; ++m) {
            kk[m] = static_cast<float>(k[lane + 32 * m]);
            s[m] *= g;
            recall += s[m] * kk[m];
        }
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) recall += __shfl_xor_sync(0xffffffffu, recall, off);
        const float delta = (static_cast<float>(conv[bt * CONV + VOFF + h * DV + j]) - recall) * w;
        float acc = 0.f;
        #pragma unroll
        for (int m = 0; m < PER; ++m) { s[m] += kk[m] * delta; acc += s[m] * static_cast<float>(q[lane + 32 * m]); }
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) y[bt * HV * DV + h * DV + j] = static_cast<T>(acc);
    }
    #pragma unroll
    for (int m = 0; m < PER; ++m) state_out[row + lane + 32 * m] = s[m];
"""


# threads a block of the delta-rule kernel (each thread one state row: the shape changes no bit). 128 gives a decode
# step of Qwen3.6 32 blocks on an H100's 132 SMs, 31.9 us a call (docs/performance.md); 32 spreads them 4x wider
DELTA_RULE_THREADS = 128
# Each state row to a warp (`_DELTA_RULE_WARP_SOURCE`, where dk is a multiple of 32) instead of a thread: the row
# thread's 128 reads of its row are 32 lines a warp each, and a Qwen3.6 decode step has 4,096 threads on the whole
# GPU; a warp a row reads each line once, with 32x the threads. Its sums over dk run in another order: other bits
# than the thread form's (each form the same at every cap), both within float32 rounding of the token loop.
DELTA_RULE_WARP_ROWS = False


@functools.cache
def _delta_rule_kernel(warp_rows: bool):
    return mx.fast.cuda_kernel("streamoe_delta_rule_warp" if warp_rows else "streamoe_delta_rule",
                               ["qk", "conv", "log_g", "beta", "state"], ["y", "state_out"],
                               _DELTA_RULE_WARP_SOURCE if warp_rows else _DELTA_RULE_SOURCE)


def delta_rule_cuda(qk, conv, log_g, beta, state, hk: int, hv: int, dk: int, dv: int):
    """The recurrence of a whole call as one CUDA kernel: qk [B, L, 2*Hk, dk] (q, then k: normalised, q scaled),
    conv [B, L, C] (v is its last Hv*dv columns), log_g [B, L, Hv] float32, beta [B, L, Hv] (conv's dtype),
    state [B, Hv, dv, dk] float32. The token loop's arithmetic in float32, one thread per state row (its sums over
    dk taken left to right) or one warp (`DELTA_RULE_WARP_ROWS`): y [B, L, Hv, dv] in conv's dtype, and the new
    state. Shapes other than the model's head sizes are read at run time, so every prompt length runs the one
    compiled kernel."""
    B, L, C = conv.shape
    warp_rows = DELTA_RULE_WARP_ROWS and dk % 32 == 0
    n = B * hv * dv * (32 if warp_rows else 1)
    return _delta_rule_kernel(warp_rows)(
        inputs=[qk, conv, log_g, beta, state],
        template=[("T", conv.dtype), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv), ("CONV", C), ("VOFF", C - hv * dv)],
        grid=(n, 1, 1), threadgroup=(min(DELTA_RULE_THREADS, n), 1, 1),
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

