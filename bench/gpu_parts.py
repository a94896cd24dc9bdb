"""Where a resident decode step's time goes: streamoe's blocks against mlx-lm's modules, one by one, on the
same checkpoint in one process (the step as a whole is `bench/gpu_compare.py`'s job).

    python -m bench.gpu_parts --ckpt CKPT --model CONVERTED --experts q4 --out R.json

Every part runs on a one-token input (decode shapes) with its layer's cache, as the model calls it, and is
timed three ways, per call:
- `synced_ms`: build, evaluate, wait, one call at a time (what a host round trip per call costs);
- `build_ms`: the host's time to build the call's graph (Python only, nothing evaluated);
- `device_ms`: n calls built first (chained through their caches), then evaluated in one go, divided by n:
  the device's time plus the kernel launches, with no Python in between.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from streamoe.runtime import model as model_mod
from streamoe.runtime.engine import Engine, Options


def timed(f, x: mx.array, n: int) -> dict:
    for _ in range(3):
        mx.eval(f(x))
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(f(x))
    synced = (time.perf_counter() - t) / n
    t = time.perf_counter()
    ys = [f(x) for _ in range(n)]
    build = (time.perf_counter() - t) / n
    t = time.perf_counter()
    mx.eval(ys)
    device = (time.perf_counter() - t) / n
    return {"synced_ms": round(synced * 1e3, 4), "build_ms": round(build * 1e3, 4), "device_ms": round(device * 1e3, 4)}


def parts(eng: Engine, ref, ref_cache: list, dtype) -> dict:
    """name -> (streamoe's callable, mlx-lm's callable), each mapping a hidden state [1, 1, H] to the part's output."""
    m, lm = eng.model, ref.language_model
    ours_l, refs_l = m.layers, lm.layers
    g = next(i for i, ly in enumerate(ours_l) if ly.is_linear)
    a = next(i for i, ly in enumerate(ours_l) if not ly.is_linear)
    ex, c, rc = eng.experts, eng.cache, ref_cache
    rot = lambda i: m.rope.prepare(c[i].offset)  # noqa: E731

    def ref_mix(i, x):
        ly = refs_l[i]
        mixer = ly.linear_attn if ly.is_linear else ly.self_attn
        return x + mixer(ly.input_layernorm(x), None, rc[i])

    def ours_step(x):
        return m.head(m.layers_forward(x, c, c[a].offset, ex))

    def ref_step(x):
        h = x
        for i, ly in enumerate(refs_l):
            h = ly(h, None, rc[i])
        return lm.lm_head(lm.model.norm(h)) if not lm.args.tie_word_embeddings else lm.model.embed_tokens.as_linear(lm.model.norm(h))

    def ours_gdn_loop(x):
        model_mod.FAST_GDN = False
        try:
            return ours_l[g].mix(x, c[g], m.rope, None)[0]
        finally:
            model_mod.FAST_GDN = True

    return {
        "gdn_mixer": (lambda x: ours_l[g].mix(x, c[g], m.rope, None)[0], lambda x: ref_mix(g, x)),
        "gdn_mixer_ops_loop": (ours_gdn_loop, None),
        "attention_mixer": (lambda x: ours_l[a].mix(x, c[a], m.rope, rot(a))[0], lambda x: ref_mix(a, x)),
        "moe_block": (lambda x: ours_l[g].mlp(g, x, ex), lambda x: refs_l[g].mlp(x)),
        "routed_experts_only": (lambda x: ex(g, x, *m.route(ours_l[g].mlp.gate(x))),
                                lambda x: _ref_routed(refs_l[g].mlp, x)),
        "gdn_layer": (lambda x: ours_l[g](x, c[g], m.rope, None, ex), lambda x: refs_l[g](x, None, rc[g])),
        "head": (m.head, lambda x: lm.lm_head(lm.model.norm(x))),
        "step_no_embed": (ours_step, ref_step),
    }


def _ref_routed(block, x):
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-block.top_k, axis=-1)[..., -block.top_k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = scores / scores.sum(axis=-1, keepdims=True)
    return (block.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    eng = Engine(a.model, Options(cap_gib=64, ctx=2048, experts=a.experts, dtype=a.dtype, runtime_bytes=600 << 20))
    dtype = eng.dtype
    ref, _ = load_model(a.ckpt)
    ref.set_dtype(dtype)
    rc = make_prompt_cache(ref)
    ids = list(range(100, 108))
    for t in ids:  # both caches hold the same few tokens
        mx.eval(ref(mx.array([[t]]), cache=rc))
    mx.eval(eng.prefill(ids))
    x = (mx.random.normal((1, 1, eng.args.hidden_size)) * 0.5).astype(dtype)
    res = {"device": str(mx.default_device()), "dtype": str(dtype), "n": a.n, "parts": {}}
    for name, (ours, theirs) in parts(eng, ref, rc, dtype).items():
        row = {"streamoe": timed(ours, x, a.n)}
        if theirs is not None:
            row["mlx_lm"] = timed(theirs, x, a.n)
            row["device_ratio"] = round(row["mlx_lm"]["device_ms"] / row["streamoe"]["device_ms"], 3)
        res["parts"][name] = row
        print(name, json.dumps(row), flush=True)
    eng.close()
    text = json.dumps(res, indent=2)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
