"""Qwen3-Next language model (`model_type` qwen3_next: Qwen3-Next-80B-A3B, Qwen3-Coder-Next; mlx-community 4-bit
exports).

Qwen3.5 is built from this model, and mlx-lm's Qwen3.5 takes its attention, MoE block and gated norm from its
`qwen3_next.py`: the layers are `qwen3_5_moe`'s (Gated DeltaNet, every fourth layer gated full attention, a routed
and a gated shared expert in every MoE block). What differs is in the export: tensors under `model.`/`lm_head`, RoPE
over the first quarter of each head at the token's index (`qwen3_5_moe`'s M-RoPE with every section on that index,
which is plain `mx.fast.rope`), and each Gated DeltaNet's input projections fused in two, grouped by key head:
`in_proj_qkvz` holds [q, k, v, z] of the first key head, then of the next, and `in_proj_ba` [b, a] likewise
(mlx-lm's `fix_query_key_value_ordering` reads them so; `formats.export.fused_gdn_rows`). `unfuse` takes their rows
apart into Qwen3.5's four projections once at load; a quantized row carries its own scales and biases, so the rows
are the same numbers.
"""

from __future__ import annotations

import mlx.core as mx

from ...formats.config import ModelArgs
from ...formats.export import fused_gdn_rows
from . import qwen3_5_moe
from .kernels import Streams


def unfuse(args: ModelArgs, weights: dict[str, mx.array]) -> None:
    """Replace, in `weights`, each linear layer's `in_proj_qkvz` and `in_proj_ba` (weight, scales, biases) by
    Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`: their rows, where `fused_gdn_rows` says."""
    rows = fused_gdn_rows(args)
    for i in range(args.num_hidden_layers):
        if not args.is_linear(i):
            continue
        p = f"{args.prefix}model.layers.{i}.linear_attn."
        for fused, parts in rows.items():
            for suffix in ("weight", "scales", "biases"):
                w = weights.pop(f"{p}{fused}.{suffix}")
                for name, take in parts.items():
                    weights[f"{p}{name}.{suffix}"] = mx.take(w, mx.array(take), axis=0)


class Model(qwen3_5_moe.Model):
    def __init__(self, args: ModelArgs, weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32,
                 gdn_chunked: bool | None = None, streams: Streams = ()):
        unfuse(args, weights)
        super().__init__(args, weights, dtype, gdn_chunked, streams)
