"""Model families, one module each, chosen by the checkpoint's `model_type` as mlx-lm chooses its models/*.py;
built from the kernel library (`kernels.py`, `delta_rule.py`) and the per-layer caches (`cache.py`).

A family module, `<model_type>.py`, exposes `Model(args, weights, dtype, streams=())`: `args` the checkpoint's
`formats.config.ModelArgs`, `weights` every non-routed-expert tensor by its export name (those it uses are
taken out of the dict), floats cast once to `dtype`, `streams` the CPU streams its projections split over
(`kernels.cpu_streams`; it hands them on as `Model.streams`). The routed experts are not the model's: every MoE block calls an experts provider
(`experts(i, x, inds) -> [..., k, H]`, the picks' outputs in router-rank order; `kernels.ResidentExperts`, or
the engine's `runtime/experts.StreamingExperts`, which may also have `prepare(i, inds, xs)`). What the engine
and the experts provider use of a `Model`:

- `num_layers`; `args`, `dtype`, `streams`
- `make_cache(max_tokens, kv_dtype, batch=1, kv_bits=None) -> list`: one cache per layer (`cache.py`:
  `KVCache`/`QuantizedKVCache` for attention, the family's own state class for other mixers)
- `embed(tokens [B, L]) -> h [B, L, H]`
- `layers_forward(h, cache, positions, experts, step=None, on_layer=None) -> h`: the layer loop
  (`kernels.run_layers`; `on_layer(i)` once a prefill's layer i is queued);
  positions is the int position of h's first token, or the family's position array (M-RoPE: [3, B, L])
- `head(h) -> logits [B, L, V]`
- `router_logits(i, x)`: layer i's router on x (the cross-layer guess), and `route(logits) -> (inds, scores)`:
  the top-k as the family defines it

The attention-only families (`qwen3_moe`, `gpt_oss`, `mixtral`) take all of it but the router from
`kernels.TextModel`. `forward` below runs any of them whole, for reference use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import mlx.core as mx

from ...formats.config import FAMILIES
from ...formats.errors import StreamoeError
from .cache import KVCache


def family(model_type: str) -> ModuleType:
    """The module of the family `model_type` names: `runtime/models/<model_type>.py`, for every model_type whose
    config facts `formats.config.FAMILIES` lists (a new family is its file here, nothing to register)."""
    if model_type not in FAMILIES:
        raise StreamoeError(f"model_type {model_type!r} is not a family streamoe runs (it runs: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(f"{__name__}.{model_type}")


def forward(
    model,
    tokens: mx.array,
    cache: list,
    experts,
    positions: mx.array | None = None,
    input_embeddings: mx.array | None = None,
) -> mx.array:
    """The whole model for reference use: logits [B, L, V] of `tokens` (or of `input_embeddings`) after what
    `cache` holds; `experts(i, x, inds)` gives the picks' outputs."""
    h = model.embed(tokens) if input_embeddings is None else input_embeddings.astype(model.dtype)
    B, L = h.shape[:2]
    for c in cache:  # refuse before any layer's state has moved
        if isinstance(c, KVCache) and c.offset + L > c.max_tokens:
            raise StreamoeError(f"KV cache holds {c.max_tokens} tokens; {c.offset + L} were asked for")
    if positions is None:
        positions = cache[0].offset
    return model.head(model.layers_forward(h, cache, positions, experts))
