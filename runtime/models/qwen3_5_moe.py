"""Qwen3.5 / Qwen3.6 MoE language model (`model_type` qwen3_5_moe; mlx-community 4-bit exports).

Every `full_attention_interval`-th layer is gated full attention with partial, interleaved M-RoPE; the others
are Gated DeltaNet (linear attention with a delta-rule recurrence). Every layer ends in a sparse MoE block:
top-k of E routed experts plus a gated shared expert. Norm weights of the export already include the +1 of
the HF zero-centred norms. Tensors are named as the export names them, under
`language_model.model.layers.N.` (the family's `ModelArgs.prefix`: `qwen3_next.py` builds on these layers with
none): `linear_attn.*` or `self_attn.*`, `mlp.*`, the two layer norms.

Numerics: activations in `dtype` (float32 on the CPU backend), routing softmax and the recurrent state in
float32. All paths are deterministic; results are bit-identical for identical calls, while splitting a
prompt into differently sized calls changes rounding (matmul shapes, attention and recurrence forms).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ...formats.config import ModelArgs
from .cache import GDNCache, KVCache, QuantizedKVCache
from .delta_rule import causal_conv, conv_taps, gated_delta
from .kernels import (
    GroupedAttention,
    Loader,
    MRoPE,
    PreNormLayer,
    Projections,
    Streams,
    combine,
    compiled,
    compiles,
    route,
    run_layers,
    sigmoid_gate,
    swiglu,
    weight_arrays,
)


@mx.compile
def _gdn_gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(log of the decay (float32), write strength beta) from the a/b projections."""
    return -mx.exp(A_log) * nn.softplus(a + dt_bias), mx.sigmoid(b)


@mx.compile
def _gated_out(y: mx.array, z: mx.array) -> mx.array:
    """The gate of the per-head RMSNorm: y (already normalised and scaled) * silu(z), in float32, in z's dtype."""
    return (nn.silu(z.astype(mx.float32)) * y.astype(mx.float32)).astype(z.dtype)


@mx.compile
def _moe_out(h: mx.array, outs: mx.array, scores: mx.array, down: mx.array, out_gate: mx.array) -> mx.array:
    """h + (routed + shared): the picks' outputs outs [..., k, H] combined by their scores, plus the shared
    expert's down projection times sigmoid(its gate): mlx-lm's sums in mlx-lm's order, one kernel on GPUs."""
    return h + (combine(outs, scores) + down * mx.sigmoid(out_gate))


class GatedDeltaNet:
    """Linear attention: a causal convolution, then the gated delta rule over L2-normalised q and k, then a
    per-head RMSNorm gated by silu(z)."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str, chunked: bool | None):
        H, eps = args.hidden_size, args.rms_norm_eps
        self.chunked = chunked
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel, self.eps = args.linear_conv_kernel_dim, eps
        value_dim, conv_dim = self.hv * self.dv, args.conv_dim
        self.in_proj = Projections(ld, [(f"{p}in_proj_qkv", conv_dim), (f"{p}in_proj_z", value_dim),
                                        (f"{p}in_proj_b", self.hv), (f"{p}in_proj_a", self.hv)], H)
        self.conv = conv_taps(ld.float(f"{p}conv1d.weight", (conv_dim, self.kernel, 1))[..., 0])  # K of [C]
        self.dt_bias = ld.float(f"{p}dt_bias", (self.hv,))
        self.A_log = ld.float(f"{p}A_log", (self.hv,), dtype=mx.float32)
        self.norm = ld.float(f"{p}norm.weight", (self.dv,))
        self.out_proj = ld.linear(f"{p}out_proj", H, value_dim)
        inv = self.dk**-0.5  # q and k are L2-normalised together; q also takes the dk^-0.5 readout scale
        self.qk_scale = mx.array([inv**2] * self.hk + [inv] * self.hk, dtype=ld.dtype)[:, None]
        self.qk_eps = 1e-6 * inv**2  # 1e-6 on the sum of squares, as rms_norm's eps on their mean

    def step(self, x: mx.array, conv: tuple[mx.array, ...], state: mx.array) -> tuple[mx.array, tuple, mx.array]:
        """(the mixer's output, the new convolution window, the new state) of x [B, L, H] after `conv` (the last
        K-1 inputs of the convolution, a `GDNCache`'s rows) and `state` (its recurrent state): a pure function of
        its inputs, so a decode step compiles."""
        B, L, _ = x.shape
        qkv, z, b, a = self.in_proj(x)
        z = z.reshape(B, L, self.hv, self.dv)

        mixed, conv = causal_conv(conv, qkv.astype(self.conv[0].dtype), self.conv)

        qk = mixed[..., : 2 * self.hk * self.dk]
        qk = mx.fast.rms_norm(qk.reshape(B, L, 2 * self.hk, self.dk), None, self.qk_eps) * self.qk_scale

        log_g, beta = _gdn_gates(a, b, self.A_log, self.dt_bias)
        y, state = gated_delta(qk, mixed, log_g, beta, state, self.hk, self.hv, self.dk, self.dv, self.chunked)
        y = _gated_out(mx.fast.rms_norm(y, self.norm, self.eps), z)  # gated RMSNorm per head
        return self.out_proj(y.reshape(B, L, -1)), conv, state


class Attention(GroupedAttention):
    """Full attention with q/k RMSNorm, partial M-RoPE and an output gate: q_proj gives per head [query | gate]."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        H = args.hidden_size
        self.nq, self.nkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps, self.scale = args.rms_norm_eps, args.head_dim**-0.5
        self.qkv_proj = Projections(ld, [(f"{p}q_proj", 2 * self.nq * self.hd), (f"{p}k_proj", self.nkv * self.hd),
                                         (f"{p}v_proj", self.nkv * self.hd)], H)
        self.o_proj = ld.linear(f"{p}o_proj", H, self.nq * self.hd)
        self.q_norm = ld.float(f"{p}q_norm.weight", (self.hd,))
        self.k_norm = ld.float(f"{p}k_norm.weight", (self.hd,))

    def project(self, x: mx.array) -> list[mx.array]:
        """[q, k, v, the output gate]: q and k normalised per head, heads first, not yet rotated."""
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q, gate = mx.split(q.reshape(B, L, self.nq, 2 * self.hd), 2, axis=-1)
        k = k.reshape(B, L, self.nkv, self.hd)
        v = v.reshape(B, L, self.nkv, self.hd)
        q = mx.fast.rms_norm(q, self.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = mx.fast.rms_norm(k, self.k_norm, self.eps).transpose(0, 2, 1, 3)
        return [q, k, v.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)]

    def out(self, o: mx.array, dtype: mx.Dtype, gate: mx.array) -> mx.array:
        B, _, L, _ = o.shape
        return self.o_proj(sigmoid_gate(o.astype(dtype).transpose(0, 2, 1, 3).reshape(B, L, -1), gate))


class SparseMoe:
    """The MoE block: the router picks the top-k experts, an experts provider computes them (it owns where
    their weights live), and a gated shared expert is added: routed + shared, mlx-lm's order of the sums."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
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


class DecoderLayer(PreNormLayer):
    """Token mixer (Gated DeltaNet or gated attention) and MoE block, each behind an RMSNorm and a residual."""

    def __init__(self, args: ModelArgs, ld: Loader, i: int, gdn_chunked: bool | None):
        p = f"{args.prefix}model.layers.{i}."
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
        if not self.is_linear:
            return super().mix(h, cache, rope, rot)
        h, x, cache.rows, cache.state = self.gdn_mix(h, cache.rows, cache.state)
        cache.offset += h.shape[1]
        return h, x

    def front(self, h: mx.array, cache, rope: MRoPE, rot) -> tuple[mx.array, mx.array, tuple]:
        """A Gated DeltaNet layer's one-token call is one compiled function of (h, its cache's two arrays)."""
        if not self.is_linear or not compiles(h):
            return super().front(h, cache, rope, rot)
        h, x, *routed, cache.rows, cache.state = compiled(self.gdn_front)(h, cache.rows, cache.state)
        cache.offset += 1
        return h, x, routed

    def gdn_mix(self, h: mx.array, conv: tuple[mx.array, ...], state: mx.array) -> tuple:
        """(h + Gated DeltaNet(norm(h)), the MoE block's input, the cache's new conv window and state)."""
        r, conv, state = self.linear_attn.step(mx.fast.rms_norm(h, self.input_layernorm, self.eps), conv, state)
        h = h + r
        return h, self.moe_input(h), conv, state

    def gdn_front(self, h: mx.array, conv: tuple[mx.array, ...], state: mx.array) -> tuple:
        h, x, conv, state = self.gdn_mix(h, conv, state)
        return (h, x, *self.mlp.route(x), conv, state)


class Model:
    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, mx.array],
        dtype: mx.Dtype = mx.float32,
        gdn_chunked: bool | None = None,
        streams: Streams = (),
    ):
        """`weights`: every non-routed-expert tensor of the language model, keyed by its export name
        ("language_model.model.layers.0.linear_attn.in_proj_qkv.weight", ...), as stored. Float tensors are
        cast once to `dtype` (scales and biases too), A_log to float32. The tensors used are taken out of the
        dict (projections that read the same input are concatenated, and the parts freed as the load goes);
        other keys are left.

        `gdn_chunked`: whether calls of more than GDN_CHUNK tokens run the delta rule in its chunked form
        (fewer, larger ops) instead of token by token. None = only on a GPU: on the CPU backend the
        token loop is as fast and reproduces mlx-lm bit for bit.

        `streams`: the CPU streams every projection splits its rows over (`kernels.cpu_streams`), also handed to
        the experts provider."""
        self.args, self.dtype, self.streams = args, dtype, streams
        ld = Loader(args, weights, dtype, consume=True, streams=streams)
        H = args.hidden_size
        self.embed_tokens = ld.embedding(f"{args.prefix}model.embed_tokens", args.vocab_size, H)
        self.layers = [DecoderLayer(args, ld, i, gdn_chunked) for i in range(args.num_hidden_layers)]
        self.norm = ld.float(f"{args.prefix}model.norm.weight", (H,))
        if args.tie_word_embeddings:
            self.lm_head = self.embed_tokens.as_linear(streams)
        else:
            self.lm_head = ld.linear(f"{args.prefix}lm_head", args.vocab_size, H)
        self.rope = MRoPE(args.rotary_dim, args.rope_theta, args.mrope_section)
        mx.eval(weight_arrays([self.layers, self.embed_tokens, self.norm, self.lm_head]))

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
        return self.embed_tokens(tokens, self.dtype)

    def layers_forward(self, h: mx.array, cache: list, positions: int | mx.array, experts,
                       step: int | None = None, on_layer: Callable[[int], None] | None = None) -> mx.array:
        """Every decoder layer over h [B, L, H] (`kernels.run_layers`). positions: the int position of h's first
        token for plain text, or [3, B, L] int32 (t, h, w) M-RoPE positions."""
        rope = self.rope if self.args.n_full_attention else None
        return run_layers(self.layers, h, cache, positions, rope, experts, step, on_layer)

    def router_logits(self, i: int, x: mx.array) -> mx.array:
        return self.layers[i].mlp.gate(x)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return route(logits, self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def head(self, h: mx.array) -> mx.array:
        return self.lm_head(mx.fast.rms_norm(h, self.norm, self.args.rms_norm_eps))
