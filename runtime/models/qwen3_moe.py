"""Qwen3-MoE language model (`model_type` qwen3_moe: Qwen3-30B-A3B, mlx-community 4-bit exports).

Every layer is the same two halves, each behind an RMSNorm and a residual: grouped-query attention (an
RMSNorm over each head's queries and keys, RoPE over the whole head, no output gate), then the MoE block
(softmax router, the top-k renormalised, the routed experts combined in router-rank order; no shared
expert). Tensors are named as mlx-lm's export names them: `model.embed_tokens`,
`model.layers.N.self_attn.{q,k,v,o}_proj` and `.{q,k}_norm`, `model.layers.N.mlp.gate` (the router),
`model.layers.N.{input,post_attention}_layernorm`, `model.norm`, `lm_head` (none with tied embeddings);
`model.layers.N.mlp.switch_mlp.*` are the routed experts, which the experts provider holds.

Numerics as mlx-lm's `qwen3_moe.py` in the same dtype: the router's softmax accumulates in float32, the sums
of the picks run left to right in rank order (`kernels.combine`).
"""

from __future__ import annotations

import mlx.core as mx

from ...formats.config import ModelArgs
from .kernels import (
    GroupedAttention,
    Loader,
    PreNormLayer,
    Projections,
    RoPE,
    RoutedMoe,
    Streams,
    TextModel,
    route,
)


class Attention(GroupedAttention):
    """Grouped-query attention with q/k RMSNorm per head and RoPE over the whole head."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        H = args.hidden_size
        self.nq, self.nkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps, self.scale = args.rms_norm_eps, args.head_dim**-0.5
        self.qkv_proj = Projections(ld, [(f"{p}q_proj", self.nq * self.hd), (f"{p}k_proj", self.nkv * self.hd),
                                         (f"{p}v_proj", self.nkv * self.hd)], H)
        self.o_proj = ld.linear(f"{p}o_proj", H, self.nq * self.hd)
        self.q_norm = ld.float(f"{p}q_norm.weight", (self.hd,))
        self.k_norm = ld.float(f"{p}k_norm.weight", (self.hd,))

    def project(self, x: mx.array) -> list[mx.array]:
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = mx.fast.rms_norm(q.reshape(B, L, self.nq, self.hd), self.q_norm, self.eps).transpose(0, 2, 1, 3)
        k = mx.fast.rms_norm(k.reshape(B, L, self.nkv, self.hd), self.k_norm, self.eps).transpose(0, 2, 1, 3)
        return [q, k, v.reshape(B, L, self.nkv, self.hd).transpose(0, 2, 1, 3)]


class SparseMoe(RoutedMoe):
    """The MoE block: a softmax router, its top-k renormalised, weighing the routed experts."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        self.k, self.norm_topk = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = ld.linear(f"{p}gate", args.num_experts, args.hidden_size)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(inds, scores) of x's picks, router-rank order."""
        return route(self.gate(x), self.k, self.norm_topk)


class DecoderLayer(PreNormLayer):
    """Attention and the MoE block, each behind an RMSNorm and a residual."""

    def __init__(self, args: ModelArgs, ld: Loader, i: int):
        p = f"model.layers.{i}."
        self.i, self.eps = i, args.rms_norm_eps
        self.self_attn = Attention(args, ld, f"{p}self_attn.")
        self.input_layernorm = ld.float(f"{p}input_layernorm.weight", (args.hidden_size,))
        self.post_attention_layernorm = ld.float(f"{p}post_attention_layernorm.weight", (args.hidden_size,))
        self.mlp = SparseMoe(args, ld, f"{p}mlp.")


class Model(TextModel):
    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32,
                 streams: Streams = ()):
        super().__init__(args, weights, dtype, streams, DecoderLayer, RoPE(args.head_dim, args.rope_theta))

    def router_logits(self, i: int, x: mx.array) -> mx.array:
        return self.layers[i].mlp.gate(x)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return route(logits, self.args.num_experts_per_tok, self.args.norm_topk_prob)
