"""Qwen3-Next language model (`model_type` qwen3_next: Qwen3-Next-80B-A3B, Qwen3-Coder-Next; mlx-community 4-bit
exports).

Qwen3.5 is built from this model, and mlx-lm's Qwen3.5 takes its attention, MoE block and gated norm from its
`qwen3_next.py`: the layers are `qwen3_5_moe`'s (Gated DeltaNet, every fourth layer gated full attention, a routed
and a gated shared expert in every MoE block). What differs is in the export: tensors under `model.`/`lm_head`, RoPE
over the first quarter of each head at the token's index (`qwen3_5_moe`'s M-RoPE with every section on that index,
which is plain `mx.fast.rope`), and each Gated DeltaNet's input projections fused in two, grouped by key head:
`in_proj_qkvz` holds [q, k, v, z] of the first key head, then of the next, and `in_proj_ba` [b, a] likewise
(mlx-lm's `fix_query_key_value_ordering` reads them so). `unfuse` takes their rows apart into Qwen3.5's four
projections once at load; a quantized row carries its own scales and biases, so the rows are the same numbers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...formats.config import ModelArgs
from . import qwen3_5_moe
from .kernels import Streams


def unfuse(args: ModelArgs, weights: dict[str, mx.array]) -> None:
    """Replace, in `weights`, each linear layer's `in_proj_qkvz` and `in_proj_ba` (weight, scales, biases) by
    Qwen3.5's `in_proj_qkv` (q of every key head, then k, then v), `in_proj_z`, `in_proj_b` and `in_proj_a`."""
    nk, dk, dv, r = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim, \
        args.linear_num_value_heads // args.linear_num_key_heads
    qkvz = np.arange(nk * (2 * dk + 2 * r * dv)).reshape(nk, -1)
    ba = np.arange(nk * 2 * r).reshape(nk, -1)
    rows = {"in_proj_qkvz": {"in_proj_qkv": np.concatenate([qkvz[:, :dk].ravel(), qkvz[:, dk:2 * dk].ravel(),
                                                            qkvz[:, 2 * dk:2 * dk + r * dv].ravel()]),
                             "in_proj_z": qkvz[:, 2 * dk + r * dv:].ravel()},
            "in_proj_ba": {"in_proj_b": ba[:, :r].ravel(), "in_proj_a": ba[:, r:].ravel()}}
    for i in range(args.num_hidden_layers):
        if not args.is_linear(i):
            continue
        p = f"{args.prefix}model.layers.{i}.linear_attn."
        for fused, parts in rows.items():
            for suffix in ("weight", "scales", "biases"):
                w = weights.pop(f"{p}{fused}.{suffix}", None)
                if w is None:
                    continue
                for name, take in parts.items():
                    weights[f"{p}{name}.{suffix}"] = mx.take(w, mx.array(take), axis=0)


class Model(qwen3_5_moe.Model):
    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32,
                 gdn_chunked: bool | None = None, streams: Streams = ()):
        unfuse(args, weights)
        super().__init__(args, weights, dtype, gdn_chunked, streams)
