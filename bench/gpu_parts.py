"""Where a resident decode step's time goes: streamoe's blocks against mlx-lm's modules, one by one, on the
same checkpoint in one process (the step as a whole is `bench/gpu_compare.py`'s job).

    python -m bench.gpu_parts --ckpt CKPT --model CONVERTED --experts q4 --out R.json

Every part runs on a one-token input (decode shapes) with its layer's cache, as the model calls it, and is
timed three ways, per call:
- `synced_ms`: build, evaluate, wait, one call at a time (what a host round trip per call costs);
- `build_ms`: the host's time to build the call's graph (Python only, nothing evaluated);
- `device_ms`: n calls built first (chained through their caches), then evaluated in one go, divided by n:
  the device's time plus the kernel launches, with no Python in between.

With `--parts-tokens T` the parts run on a block of T tokens (a prefill block: 256), each call at the same cache
offset (a timing repeats one block in place), the whole-step parts left out; and the routed experts alone on
fixed picks two ways: as the engine calls them (`gather_qmm` over one batch per (token, pick): MLX's CUDA
kernel then runs 16-row tiles of one row each) and grouped by expert (one batch of up to 16 rows per expert,
padded), the grouping made on the host from the picks' expert ids. Their largest difference is reported.

`step_ops`: the primitives of one decode step's graph, by kind, for each engine (views, which launch nothing,
counted apart): on a GPU nearly every other primitive is a kernel that `mx.async_eval` encodes, most of a
resident token's host time there.

Then greedy decode loops, pipelined as stock mlx-lm's `generate_step` is (the next step is queued before
this token is read), each token split into `build_ms` (the host builds the next step), `async_ms` (the
`mx.async_eval` call: launches, and any wait hidden inside it) and `wait_ms` (reading this token). The host's
speed drifts and bursts by 2x within minutes on the H200 machine, so `--rounds` rounds each run mlx-lm's loop,
stock `stream_generate`, streamoe's loop and `Engine.generate` back to back, and the resident ratio is the
median over rounds of stock against `Engine.generate`; then each of `--variants` (one setting changed) runs
followed by an unchanged loop.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import re
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import machine
from bench.experts_grouped import host_groups
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.models import delta_rule, kernels


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


def at_offsets(f, caches: list):
    """f, with every cache's offset put back after each call: repeated calls write the same positions."""
    def g(x):
        offs = [c.offset for c in caches]
        try:
            return f(x)
        finally:
            for c, o in zip(caches, offs, strict=True):
                c.offset = o
    return g


def parts(eng: Engine, ref, ref_cache: list, tokens: int = 1) -> dict:
    """name -> (streamoe's callable, mlx-lm's callable), each mapping a hidden state [1, T, H] to the part's output."""
    m, lm = eng.model, ref.language_model
    ours_l, refs_l = m.layers, lm.layers
    g = next(i for i, ly in enumerate(ours_l) if ly.is_linear)
    a = next(i for i, ly in enumerate(ours_l) if not ly.is_linear)
    ex, c, rc = eng.experts, eng.conversation.caches, ref_cache
    rot = lambda i: m.rope.prepare(c[i].offset)  # noqa: E731

    def ref_mix(i, x):
        ly = refs_l[i]
        mixer = ly.linear_attn if ly.is_linear else ly.self_attn
        return x + mixer(ly.input_layernorm(x), None, rc[i])

    def ours_step(x):
        return m.head(m.layers_forward(x, c, c[a].offset, ex))

    def ref_head(h):
        h = lm.model.norm(h)
        return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)

    def ref_step(x):
        h = x
        for i, ly in enumerate(refs_l):
            h = ly(h, None, rc[i])
        return ref_head(h)

    def ours_gdn_form(form):  # decode's delta rule in another form than the backend's
        def mixer(x):
            delta_rule.GDN_FORM = form
            try:
                return ours_l[g].mix(x, c[g], m.rope, None)[0]
            finally:
                delta_rule.GDN_FORM = None
        return mixer

    def routed(i, x):
        inds, scores = m.route(ours_l[i].mlp.gate(x))
        return kernels.combine(ex(i, x, inds), scores)

    if tokens > 1:  # a prefill block
        x0 = (mx.random.normal((tokens, lm.args.hidden_size), key=mx.random.key(0)) * 0.5).astype(eng.dtype)
        inds = m.route(ours_l[g].mlp.gate(x0))[0]
        groups = host_groups(np.array(inds), 16)
        w = ex.layer_weights[g]
        diff = mx.abs(kernels._switch_glu(x0, w, inds, ex.kernel) - kernels.in_batches(x0, w, groups, ex.kernel)).max()
        print("experts_grouped_max_abs_diff", diff.item(), "groups", groups[0].size, flush=True)
        return {
            "gdn_mixer": (lambda x: ours_l[g].mix(x, c[g], m.rope, None)[0], lambda x: ref_mix(g, x)),
            "attention_mixer": (at_offsets(lambda x: ours_l[a].mix(x, c[a], m.rope, rot(a))[0], [c[a]]),
                                at_offsets(lambda x: ref_mix(a, x), [rc[a]])),
            "moe_block_and_residual": (lambda x: ours_l[g].mlp(g, x, ex, x), lambda x: x + refs_l[g].mlp(x)),
            "routed_experts_only": (lambda x: routed(g, x), lambda x: _ref_routed(refs_l[g].mlp, x)),
            "experts_per_pick": (lambda x: kernels._switch_glu(x.reshape(-1, x.shape[-1]), w, inds, ex.kernel), None),
            "experts_grouped": (lambda x: kernels.in_batches(x.reshape(-1, x.shape[-1]), w, groups, ex.kernel), None),
        }
    return {
        "gdn_mixer": (lambda x: ours_l[g].mix(x, c[g], m.rope, None)[0], lambda x: ref_mix(g, x)),
        "gdn_mixer_ops_form": (ours_gdn_form("ops"), None),
        "gdn_mixer_fast_op": (ours_gdn_form("fast"), None),
        "attention_mixer": (lambda x: ours_l[a].mix(x, c[a], m.rope, rot(a))[0], lambda x: ref_mix(a, x)),
        "moe_block_and_residual": (lambda x: ours_l[g].mlp(g, x, ex, x), lambda x: x + refs_l[g].mlp(x)),
        "routed_experts_only": (lambda x: routed(g, x),
                                lambda x: _ref_routed(refs_l[g].mlp, x)),
        "gdn_layer": (lambda x: ours_l[g](x, c[g], m.rope, None, ex), lambda x: refs_l[g](x, None, rc[g])),
        "head": (m.head, ref_head),
        "step_no_embed": (ours_step, ref_step),
    }


def _ref_routed(block, x):
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-block.top_k, axis=-1)[..., -block.top_k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = scores / scores.sum(axis=-1, keepdims=True)
    return (block.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)


def pipelined(step, first: mx.array, n: int) -> dict:
    """n greedy tokens, each step built from the token still being computed: `step(y) -> logits [V]`."""
    y = mx.argmax(first)
    mx.async_eval(y)
    rows = []
    for _ in range(n):
        t0 = time.perf_counter()
        y_next = mx.argmax(step(y))
        t1 = time.perf_counter()
        mx.async_eval(y_next)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        y = y_next
    y.item()
    med = [sorted(r[j] for r in rows[4:])[len(rows[4:]) // 2] * 1e3 for j in range(4)]
    return dict(zip(("build_ms", "async_ms", "wait_ms", "token_ms"), (round(v, 3) for v in med), strict=True))


@contextlib.contextmanager
def variant(name: str, eng: Engine):
    """One setting changed around a streamoe loop (`as_is`: none)."""
    limit, compiled_step = eng.plan.cache_limit, kernels.COMPILED_STEP
    warp_rows, qmv, route_kernel, dense = (delta_rule.DELTA_RULE_WARP_ROWS, kernels.EXPERTS_QMV, kernels.ROUTE_KERNEL,
                                           kernels.DENSE_QMV)
    try:
        if name == "own_stream":  # as mlx-lm's generate_step: its own stream
            with mx.stream(mx.new_stream(mx.default_device())):
                yield
            return
        if name == "whole_pool":  # the older form: every layer's gather_qmm over the whole model's pools
            ex = eng.experts
            eng.experts = WholePool(ex)
            try:
                yield
            finally:
                eng.experts = ex
            return
        if name in ("gdn_ops", "gdn_fast"):  # the token loop's compiled step (an older CUDA form), MLX's op
            delta_rule.GDN_FORM = name[4:]
        elif name == "uncompiled_step":  # each layer's one-token call built op by op, as before `COMPILED_STEP`
            kernels.COMPILED_STEP = False
        elif name == "delta_rule_warps":  # the delta-rule kernel in blocks of 32 threads (4x the blocks), same bits
            delta_rule.DELTA_RULE_THREADS = 32
        elif name == "delta_rule_warp_rows":  # the delta-rule kernel a warp a state row
            delta_rule.DELTA_RULE_WARP_ROWS = True
        elif name == "experts_qmv":  # a decode step's routed experts a warp an output row, not gather_qmm
            kernels.EXPERTS_QMV = True
        elif name == "route_kernel":  # the router's top-k and scores as one kernel
            kernels.ROUTE_KERNEL = True
        elif name == "dense_qmv":  # one token's dense 4-bit layers a warp an output row
            kernels.DENSE_QMV = True
        elif name == "warp_kernels":  # the three above at once
            delta_rule.DELTA_RULE_WARP_ROWS = kernels.EXPERTS_QMV = kernels.ROUTE_KERNEL = True
        elif name == "cache_account_only":  # the allocator cache as before plan.cache_limit
            mx.set_cache_limit(eng.plan.accounts["allocator cache"])
        elif name == "cache_unlimited":
            mx.set_cache_limit(64 << 30)
        elif name != "as_is":
            raise SystemExit(f"unknown variant {name}")
        drop_compiled(eng)  # the compiled decode step holds the delta-rule kernel as first traced
        yield
    finally:
        delta_rule.GDN_FORM = None
        delta_rule.DELTA_RULE_THREADS = 128
        delta_rule.DELTA_RULE_WARP_ROWS = warp_rows
        kernels.EXPERTS_QMV, kernels.ROUTE_KERNEL, kernels.DENSE_QMV = qmv, route_kernel, dense
        drop_compiled(eng)
        kernels.COMPILED_STEP = compiled_step
        mx.set_cache_limit(limit)


def drop_compiled(eng: Engine) -> None:
    """Forget every layer's compiled functions (`kernels.compiled`): traced again with the settings now in force."""
    for layer in eng.model.layers:
        for obj in (layer, *vars(layer).values()):
            for key in [k for k in getattr(obj, "__dict__", {}) if k.startswith("compiled_")]:
                del obj.__dict__[key]


class WholePool:
    """The resident provider as it was before per-layer views: slot = layer * E + expert over the whole pools."""

    def __init__(self, ex):
        self.ex, self.resident, self.stats = ex, True, None
        self.begin_prompt, self.end_prompt = ex.begin_prompt, ex.end_prompt
        self.base = [mx.array(i * ex.E, dtype=mx.uint32) for i in range(ex.L)]
        mx.eval(self.base)

    def __call__(self, i, x, inds):
        shape, k = x.shape, inds.shape[-1]
        y = kernels.switch_glu(x.reshape(-1, shape[-1]), self.ex.pools.weights(), inds.reshape(-1, k) + self.base[i],
                               self.ex.kernel)
        return y.reshape(*shape[:-1], k, shape[-1])


VARIANTS = ("whole_pool", "gdn_ops", "own_stream")


VIEWS = {"Reshape", "Broadcast", "ExpandDims", "Squeeze", "AsStrided", "Transpose", "StopGradient", "Depends", "Slice",
         "Split"}


def graph_ops(*outs: mx.array) -> dict:
    """The primitives of the outputs' graph (unevaluated), by kind: {"kernels": n, "views": n, "by_kind": {...}}."""
    text = io.StringIO()
    mx.export_to_dot(text, *outs)
    kinds: dict = {}
    for label in re.findall(r'\d+ \[label ="([^"]*)"', text.getvalue()):
        kind = label.split()[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    views = sum(n for k, n in kinds.items() if k in VIEWS)
    return {"kernels": sum(kinds.values()) - views, "views": views,
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def step_ops(eng: Engine, ref, ids: list[int]) -> dict:
    """One decode step's primitives for each engine, after the same prompt fed token by token."""
    from mlx_lm.models.cache import make_prompt_cache

    rc = make_prompt_cache(ref)
    for t in ids:
        mx.eval(ref(mx.array([[t]]), cache=rc))
    theirs = graph_ops(ref(mx.array([[ids[-1]]]), cache=rc))
    eng.reset()
    for t in ids:
        mx.eval(eng.decode(t))
    logits = eng._step(eng.model.embed(mx.array([[ids[-1]]], dtype=mx.uint32)), "decode")
    ours = graph_ops(logits)
    eng._finish(logits)
    eng.reset()
    return {"streamoe": ours, "mlx_lm": theirs}


def loops(eng: Engine, ref, tk, ids: list[int], n: int, variants: list[str], rounds: int = 3) -> dict:
    """`stock_generate_ms`: mlx-lm's own `stream_generate` on the same prompt, right after its loop here;
    `engine_generate_ms`: streamoe's own `Engine.generate` (greedy), right after its loop."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from streamoe.runtime.sampling import Sampler

    out = {}

    def ref_loop(tag):
        rc = make_prompt_cache(ref)
        for t in ids:  # token by token, as in ours_loop: no prefill kernels to compile
            first = ref(mx.array([[t]]), cache=rc)[0, -1]
        out[tag] = pipelined(lambda y: ref(y.reshape(1, 1), cache=rc)[0, -1], first, n)
        *_, last = stream_generate(ref, tk, prompt=ids, max_tokens=n, prefill_step_size=1)
        out[tag]["stock_generate_ms"] = round(1e3 / last.generation_tps, 3)
        print(tag, out[tag], flush=True)

    def ours_loop(tag):
        eng.reset()
        for t in ids:
            first = eng.decode(t)
        out[tag] = pipelined(lambda y: eng._step(eng.model.embed(y.reshape(1, 1).astype(mx.uint32)), "decode"), first, n)
        eng.reset()
        eng.text.stop_ids = set()  # random weights may pick a stop token early
        for t in ids[:-1]:
            eng.decode(t)
        prof = cProfile.Profile() if tag == "streamoe_0" else None
        if prof:
            prof.enable()
        stamps = [time.perf_counter() for _ in eng.generate(ids[-1:], n + 1, Sampler())]
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            out["engine_generate_profile"] = text.getvalue()
            print(text.getvalue(), flush=True)
        gaps = sorted(b - a for a, b in zip(stamps[4:], stamps[5:], strict=False))
        out[tag]["engine_generate_ms"] = round(gaps[len(gaps) // 2] * 1e3, 3)
        print(tag, out[tag], flush=True)

    from streamoe.runtime.plan import current_rss

    for name, f in (("current_rss", current_rss), ("snapshot", eng._snapshot)):  # host costs of Engine.generate's loop
        t = time.perf_counter()
        for _ in range(200):
            f()
        out[f"{name}_ms"] = round((time.perf_counter() - t) / 200 * 1e3, 4)
        print(name, out[f"{name}_ms"], "ms", flush=True)
    # The machine's host speed drifts and bursts by 2x within minutes (docs/performance.md): the resident ratio is taken
    # over rounds of stock mlx-lm right before Engine.generate, and each variant is run between two as_is loops.
    ratios = []
    for r in range(rounds):
        ref_loop(f"mlx_lm_{r}")
        ours_loop(f"streamoe_{r}")
        ratios.append(out[f"mlx_lm_{r}"]["stock_generate_ms"] / out[f"streamoe_{r}"]["engine_generate_ms"])
    out["generate_vs_stock_by_round"] = [round(x, 3) for x in ratios]
    out["generate_vs_stock_median"] = round(sorted(ratios)[len(ratios) // 2], 3)
    print("Engine.generate vs stock, by round:", out["generate_vs_stock_by_round"], flush=True)
    for v in variants:
        if v != "as_is":
            with variant(v, eng):
                ours_loop("streamoe_" + v)
            ours_loop(f"streamoe_as_is_after_{v}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per decode loop")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="streamoe loop settings to try, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of stock mlx-lm then Engine.generate (0: no loops)")
    ap.add_argument("--skip-parts", action="store_true")
    ap.add_argument("--parts-tokens", type=int, default=1, help="tokens per part call (256: a prefill block)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, load_tokenizer

    eng = Engine(a.model, Options(cap_gib=64, ctx=2048, experts=a.experts, dtype=a.dtype, runtime_bytes=600 << 20))
    dtype = eng.dtype
    ref, _ = load_model(a.ckpt)
    ref.set_dtype(dtype)
    rc = make_prompt_cache(ref)
    ids = list(range(100, 108))
    for t in ids:  # both caches hold the same few tokens
        mx.eval(ref(mx.array([[t]]), cache=rc))
    mx.eval(eng.prefill(ids))
    x = (mx.random.normal((1, a.parts_tokens, eng.args.hidden_size)) * 0.5).astype(dtype)
    res = {"device": str(mx.default_device()), "machine": machine(), "dtype": str(dtype), "n": a.n, "parts_tokens": a.parts_tokens, "parts": {}}
    for _ in range(0 if a.skip_parts else 2):  # the first round also pays for first-use costs (kernels, graphs): the second is kept
        for name, (ours, theirs) in parts(eng, ref, rc, a.parts_tokens).items():
            row = {"streamoe": timed(ours, x, a.n)}
            if theirs is not None:
                row["mlx_lm"] = timed(theirs, x, a.n)
                row["device_ratio"] = round(row["mlx_lm"]["device_ms"] / row["streamoe"]["device_ms"], 3)
            res["parts"][name] = row
    for name, row in res["parts"].items():
        print(name, json.dumps(row), flush=True)
    res["step_ops"] = step_ops(eng, ref, list(range(100, 108)))
    print("step_ops", {k: (v["kernels"], v["views"]) for k, v in res["step_ops"].items()}, flush=True)
    res["loops"] = loops(eng, ref, load_tokenizer(a.ckpt), list(range(100, 116)), a.tokens, [v for v in a.variants.split(",") if v],
                         a.rounds) if a.rounds else {}
    eng.close()
    text = json.dumps(res, indent=2)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
