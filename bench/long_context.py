"""A long context inside the cap, by KV format side by side: the plan (KV account, hot tier, the longest
context each format fits), then decode speed with the context filled. Each format runs in its own process,
so each plan measures its own runtime allowance and nothing of one run stays resident in the next.

    python -m bench.long_context MODEL --cap 4 --ctx 131072 --kv bfloat16,q8,q4

The context is filled with random keys and values (`--fill`, default ctx - tokens - 1 positions) written
straight into the caches, as a prefill of that length would leave them in size (the contents do not change
what a decode step reads or computes: attention over every position, the same experts streamed), so a
131,072-token context costs seconds, not a capped prefill of hours. Decode then runs `--tokens` greedy
steps; tok/s is by wall clock over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .common import write_result


def fill_caches(eng, n: int, block: int = 4096, seed: int = 0) -> None:
    """n positions of random keys/values (unit normal, as RMS-normed keys are) in every KV cache, through
    the caches' own writes (a quantized cache quantizes them); every layer's offset set to n."""
    import mlx.core as mx

    from streamoe.runtime.models.cache import KVCache

    mx.random.seed(seed)
    for c in eng.conversation.caches:
        if isinstance(c, KVCache):
            b, h, _, _ = c.keys.shape
            hd = eng.args.head_dim
            for a in range(0, n, block):
                k, v = (mx.random.normal((b, h, min(block, n - a), hd)).astype(eng.dtype) for _ in range(2))
                c.update_and_fetch(k, v)
                mx.eval([x for _, x in c.arrays()])
    eng.conversation.resume(n, 0)


def one(a) -> dict:
    """One KV format: open, fill, decode; the row of the results."""
    import mlx.core as mx

    from streamoe.runtime.engine import Engine, Options

    opts = Options(cap_gib=a.cap, ctx=a.ctx, experts=a.experts, kv=a.kv, dtype=a.dtype)
    t0 = time.perf_counter()
    eng = Engine(a.model, opts)
    open_s = time.perf_counter() - t0
    plan = eng.plan
    fill = a.ctx - a.tokens - 1 if a.fill is None else a.fill
    t0 = time.perf_counter()
    fill_caches(eng, fill)
    fill_s = time.perf_counter() - t0
    mx.reset_peak_memory()
    tok, times = 0, []
    for _ in range(a.tokens):
        t = time.perf_counter()
        logits = eng.decode(tok)
        tok = int(mx.argmax(logits).item())
        times.append(time.perf_counter() - t)
    eng.note_rss()
    steady = times[1:] or times
    row = {"kv": a.kv, "cap_gib": a.cap, "ctx": a.ctx, "filled": fill, "experts": a.experts, "fits": plan.fits,
           "kv_bytes": plan.accounts["kv cache"], "activations_bytes": plan.accounts["activations"],
           "fixed_bytes": plan.fixed, "hot_slots": plan.hot_slots, "hot_bytes": plan.hot_slots * plan.slot_bytes,
           "all_slots": plan.n_layers * plan.n_experts, "kv_formats": plan.kv_formats, "open_s": round(open_s, 3),
           "fill_s": round(fill_s, 3), "decode_tokens": len(times), "decode_tok_s": round(len(steady) / sum(steady), 3),
           "first_step_ms": round(1000 * times[0], 2), "peak_rss": eng.peak_rss, "mlx_peak_bytes": mx.get_peak_memory(),
           "misses": sum(ly.misses for s in eng.steps for ly in s.layers)}
    eng.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a converted directory")
    ap.add_argument("--cap", type=float, default=4.0)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--kv", default="bfloat16,q8,q4", help="KV formats, comma-separated (run one process each)")
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps")
    ap.add_argument("--fill", type=int, default=None, help="context positions filled before decoding")
    ap.add_argument("--name", default="long-context", help="bench/results/NAME.json")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead of bench/results/")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one format, a JSON line
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a)))
        return
    rows = []
    for kv in a.kv.split(","):
        cmd = [sys.executable, "-m", "bench.long_context", str(a.model), "--one", "--kv", kv, "--cap", str(a.cap),
               "--ctx", str(a.ctx), "--experts", a.experts, "--tokens", str(a.tokens)]
        cmd += ["--dtype", a.dtype] if a.dtype else []
        cmd += ["--fill", str(a.fill)] if a.fill is not None else []
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if p.returncode != 0:  # a format that does not fit (or fails) is a row saying so, not the end of the bench
            rows.append({"kv": kv, "cap_gib": a.cap, "ctx": a.ctx, "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    write_result(a.name, "decode", rows, out=a.out)


if __name__ == "__main__":
    main()
