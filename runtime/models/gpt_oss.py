"""gpt-oss language model (`model_type` gpt_oss: gpt-oss-20b, mlx-community's MXFP4 exports).

Every layer is the same two halves, each behind an RMSNorm and a residual: grouped-query attention with biases
on q, k, v and o, RoPE with YaRN scaling, and one learned sink logit per head that joins every softmax (so a head
can attend to nothing); layers alternate sliding-window attention (each query sees itself and the `sliding_window`
- 1 positions before it) and full attention, as `layer_types` says. Then the MoE block: a router with a bias picks
the top-k experts on its logits and a softmax over those k weighs them; each expert is a GLU with biases on gate,
up and down and the clamped SwiGLU `(clip(up, ±7) + 1) * g * sigmoid(1.702 g)`, g = min(gate, 7); no shared
expert. Tensors are named as mlx-lm's export names them: `model.embed_tokens`, `model.norm`,
`model.layers.N.self_attn.{sinks, q_proj, k_proj, v_proj, o_proj}`, `model.layers.N.mlp.router`,
`model.layers.N.{input,post_attention}_layernorm`, `lm_head`; `model.layers.N.mlp.experts.*` (MXFP4 codes, uint8
scales, biases) are the routed experts, which the experts provider holds.

A sliding layer keeps a full-length KV cache like a full one (the window is a mask over its positions, and only
the keys inside it are read), so sessions, snapshots and the plan treat every layer alike.

Numerics as mlx-lm's `gpt_oss.py` in the same dtype (the routed picks are summed left to right in rank order,
`kernels.combine`, where mlx-lm reduces them in one sum).
"""

from __future__ import annotations

import mlx.core as mx

from ...formats.config import SLIDING, ModelArgs
from .kernels import (
    GroupedAttention,
    Loader,
    PreNormLayer,
    Projections,
    RoPE,
    RoutedMoe,
    Streams,
    TextModel,
    YarnRoPE,
    route_topk_softmax,
)


class Attention(GroupedAttention):
    """Grouped-query attention with biased projections, YaRN RoPE, per-head sinks and an optional sliding window."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str, window: int):
        H = args.hidden_size
        self.nq, self.nkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale, self.window = args.head_dim**-0.5, window
        self.sinks = ld.float(f"{p}sinks", (self.nq,))
        self.qkv_proj = Projections(ld, [(f"{p}q_proj", self.nq * self.hd), (f"{p}k_proj", self.nkv * self.hd),
                                         (f"{p}v_proj", self.nkv * self.hd)], H, bias=True)
        self.o_proj = ld.linear(f"{p}o_proj", H, self.nq * self.hd, bias=True)

    def project(self, x: mx.array) -> list[mx.array]:
        B, L, _ = x.shape
        return [t.reshape(B, L, -1, self.hd).transpose(0, 2, 1, 3) for t in self.qkv_proj(x)]


class SparseMoe(RoutedMoe):
    """The MoE block: the router (with its bias) picks the top-k experts by logit, a softmax over the k weighs
    them."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        self.k = args.num_experts_per_tok
        self.router = ld.linear(f"{p}router", args.num_experts, args.hidden_size, bias=True)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(inds, scores) of x's picks, router-rank order."""
        return route_topk_softmax(self.router(x), self.k)


class DecoderLayer(PreNormLayer):
    """Attention (sliding-window or full) and the MoE block, each behind an RMSNorm and a residual."""

    def __init__(self, args: ModelArgs, ld: Loader, i: int):
        p = f"model.layers.{i}."
        self.i, self.eps = i, args.rms_norm_eps
        window = args.sliding_window if args.layer_types[i] == SLIDING else 0
        self.self_attn = Attention(args, ld, f"{p}self_attn.", window)
        self.mlp = SparseMoe(args, ld, f"{p}mlp.")
        self.input_layernorm = ld.float(f"{p}input_layernorm.weight", (args.hidden_size,))
        self.post_attention_layernorm = ld.float(f"{p}post_attention_layernorm.weight", (args.hidden_size,))


class Model(TextModel):
    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32,
                 streams: Streams = ()):
        rope = YarnRoPE(args.head_dim, args.rope_theta, *args.yarn) if args.yarn else RoPE(args.head_dim, args.rope_theta)
        super().__init__(args, weights, dtype, streams, DecoderLayer, rope)

    def router_logits(self, i: int, x: mx.array) -> mx.array:
        return self.layers[i].mlp.router(x)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return route_topk_softmax(logits, self.args.num_experts_per_tok)
