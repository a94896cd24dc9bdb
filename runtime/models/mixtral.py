"""Mixtral language model (`model_type` mixtral: Mixtral-8x7B and 8x22B, mlx-community 4-bit exports).

Every layer is the same two halves, each behind an RMSNorm and a residual: grouped-query attention (no biases, no
per-head norms, RoPE over the whole head), then the sparse MoE block (the router's top-k logits, a softmax over
those k, the routed experts combined in router-rank order; no shared expert). Tensors are named as mlx-lm's export
names them: `model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.block_sparse_moe.gate`
(the router), `model.layers.N.{input,post_attention}_layernorm`, `model.norm`, `lm_head` (none with tied
embeddings); `model.layers.N.block_sparse_moe.switch_mlp.*` are the routed experts, which the experts provider
holds.

Numerics as mlx-lm's `mixtral.py` in the same dtype: the top k picked by `argpartition` of the negated logits (the
first k, in the order it leaves them: the order the picks are combined in), their softmax accumulated in float32.
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
)


def route(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(inds [..., k] uint32, scores [..., k]) as mlx-lm's mixtral picks them: the first k of `argpartition` of the
    negated logits, then a softmax (float32 accumulation) over their logits."""
    inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
    return inds.astype(mx.uint32), scores


class Attention(GroupedAttention):
    """Grouped-query attention with RoPE over the whole head."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        H = args.hidden_size
        self.nq, self.nkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        self.qkv_proj = Projections(ld, [(f"{p}q_proj", self.nq * self.hd), (f"{p}k_proj", self.nkv * self.hd),
                                         (f"{p}v_proj", self.nkv * self.hd)], H)
        self.o_proj = ld.linear(f"{p}o_proj", H, self.nq * self.hd)

    def project(self, x: mx.array) -> list[mx.array]:
        B, L, _ = x.shape
        return [t.reshape(B, L, -1, self.hd).transpose(0, 2, 1, 3) for t in self.qkv_proj(x)]


class SparseMoe(RoutedMoe):
    """The sparse MoE block: the router's top-k logits, a softmax over those k weighing the routed experts."""

    def __init__(self, args: ModelArgs, ld: Loader, p: str):
        self.k = args.num_experts_per_tok
        self.gate = ld.linear(f"{p}gate", args.num_experts, args.hidden_size)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(inds, scores) of x's picks, router-rank order."""
        return route(self.gate(x), self.k)


class DecoderLayer(PreNormLayer):
    """Attention and the sparse MoE block, each behind an RMSNorm and a residual."""

    def __init__(self, args: ModelArgs, ld: Loader, i: int):
        p = f"model.layers.{i}."
        self.i, self.eps = i, args.rms_norm_eps
        self.self_attn = Attention(args, ld, f"{p}self_attn.")
        self.input_layernorm = ld.float(f"{p}input_layernorm.weight", (args.hidden_size,))
        self.post_attention_layernorm = ld.float(f"{p}post_attention_layernorm.weight", (args.hidden_size,))
        self.mlp = SparseMoe(args, ld, f"{p}block_sparse_moe.")


class Model(TextModel):
    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32,
                 streams: Streams = ()):
        super().__init__(args, weights, dtype, streams, DecoderLayer, RoPE(args.head_dim, args.rope_theta))

    def router_logits(self, i: int, x: mx.array) -> mx.array:
        return self.layers[i].mlp.gate(x)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return route(logits, self.args.num_experts_per_tok)
