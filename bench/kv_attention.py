"""What one attention call allocates against a long context, by KV format, beside what the plan counts for it
(`plan.attention_elements` with activation_bytes' 1.5 margin): peak memory (mx.get_peak_memory) and time of a
prefill chunk and of a decode step over N cached positions, at the full-size model's attention shape
(16 query heads, 2 KV heads of 256). mlx-lm's quantized SDPA over the same codes is measured beside ours: it
materializes the scores of the whole chunk at once.

    python -m bench.kv_attention --ctx 8192,32768,131072 --chunk 256
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from .common import write_result


def measure(fn) -> tuple[int, float]:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return mx.get_peak_memory() - base, time.perf_counter() - t


def main() -> None:
    import mlx.core as mx

    from streamoe.runtime.models.cache import KVCache, QuantizedKVCache
    from streamoe.runtime.plan import KV_BITS, attention_elements, default_dtype

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv", default="float,q8,q4")
    ap.add_argument("--peer", action="store_true", help="also mlx-lm's quantized SDPA (whole-chunk scores)")
    ap.add_argument("--name", default=None, help="bench/results/NAME.json (default kv-attention-<device>)")
    a = ap.parse_args()
    dtype = a.dtype or default_dtype()
    dt = getattr(mx, dtype)
    nq, nkv, hd = 16, 2, 256
    rows = []
    for n in map(int, a.ctx.split(",")):
        for kv in a.kv.split(","):
            bits = KV_BITS.get(kv)
            cache = QuantizedKVCache(1, nkv, hd, n, bits, dt) if bits else KVCache(1, nkv, hd, n, dt)
            for start in range(0, n, 8192):
                m = min(8192, n - start)
                cache.update_and_fetch(*(mx.random.normal((1, nkv, m, hd)).astype(dt) for _ in range(2)))
                mx.eval([x for _, x in cache.arrays()])
            for L in (a.chunk, 1):
                q = mx.random.normal((1, nq, L, hd)).astype(dt)
                new = [mx.random.normal((1, nkv, L, hd)).astype(dt) for _ in range(2)]
                mx.eval(q, new)

                peak, secs = measure(partial(attend, cache, q, new, bits))
                item = dt.size
                planned = int(1.5 * _attention_elements(attention_elements, nq, nkv, hd, n, L, item, bits) * item)
                row = {"kv": kv, "dtype": dtype, "ctx": n, "chunk": L, "peak_bytes": peak, "planned_bytes": planned,
                       "within_plan": peak <= planned, "ms": round(1000 * secs, 3),
                       "scores_bytes_whole_chunk": L * nq * n * item}
                if bits and a.peer:
                    row["mlx_lm_peak_bytes"], s = measure(partial(attend, cache, q, new, bits, peer=True))
                    row["mlx_lm_ms"] = round(1000 * s, 3)
                rows.append(row)
                print(row, flush=True)
            del cache
    write_result(a.name or f"kv-attention-{str(mx.default_device()).split('(')[1].split(',')[0]}", "decode", rows)


def attend(cache, q, new: list, bits: int | None, peer: bool = False):
    """Attention of q over the cache's context with `new` written at its last positions, as the model runs it
    (or through mlx-lm's quantized SDPA: `peer`)."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from streamoe.runtime.models import kernels

    L, hd = q.shape[2], q.shape[3]
    cache.offset = cache.max_tokens - L
    k, v = cache.update_and_fetch(*new)
    mask = "causal" if L > 1 else None
    if peer:
        return quantized_scaled_dot_product_attention(q * 1, k, v, scale=hd**-0.5, mask=mask, bits=bits)  # scales q in place
    if bits:
        return kernels.quantized_attention(q, k, v, hd**-0.5, bits)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5, mask=mask)


def _attention_elements(fn, nq: int, nkv: int, hd: int, n: int, L: int, item: int, bits) -> int:
    """`plan.attention_elements` at the given attention shape (it reads only these fields of ModelArgs)."""
    from types import SimpleNamespace

    return fn(SimpleNamespace(num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd, attention_sinks=False),
              n, L, item, bits)


if __name__ == "__main__":
    main()
