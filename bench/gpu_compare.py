"""streamoe against stock mlx-lm on the same checkpoint and machine, side by side in one process.

    python -m bench.gpu_compare --ckpt CKPT --model CONVERTED --caps resident,4 --experts q4 --out R.json      # H200
    python -m bench.gpu_compare --ckpt CKPT --model CONVERTED --caps resident,slots:128 --dtype float32 ...   # CPU

For each: prefill time of one prompt and greedy decode tok/s; for streamoe also MiB read per token, the
hit rates (already in memory vs read ahead), bytes wasted by prefetch, and the disk bound (bytes read per
token / the raw O_DIRECT random-read speed of the layer files with 8 and with 16 reads in flight, the faster of
the two, measured right before and right after each capped run and averaged: the disk's speed drifts by 2x
between minutes on the H200 machine). `--rounds N` repeats the capped runs (with their ablations) N times,
interleaved; `--mlx-lm-each-round` runs mlx-lm again before each round, so every ratio is against the run
right before it; `medians` gives each tag's median ratio over the rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import machine
from streamoe.formats.direct import aligned_buffer, open_uncached
from streamoe.formats.manifest import load_manifest, safe_path
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.experts import DECODE_AHEAD as DEFAULT_DECODE_AHEAD
from streamoe.runtime.experts import EAGER_MIXER as DEFAULT_EAGER_MIXER
from streamoe.runtime.experts import PRECISION_RANGE as DEFAULT_PRECISION_RANGE
from streamoe.runtime.experts import QUEUE_OUTPUT as DEFAULT_QUEUE_OUTPUT
from streamoe.runtime.telemetry import summarize

TEXT = ("Explain, step by step, how a mixture-of-experts language model decides which experts to use for a token, "
        "why only a few experts run for each token, and what that means for memory, speed and accuracy when the "
        "model is larger than the memory of the machine it runs on. Give a short example in Python code. ")


def random_read_gbs(paths: list[Path], stride: int, n: int = 400, threads: int = 8, parts: int = 1) -> float:
    """O_DIRECT reads of random records with `threads` in flight: the disk's speed for this access. With `parts`
    > 1, each read is one of a record's `parts` equal pieces (n records' worth of bytes in all)."""
    fds = [open_uncached(p)[0] for p in paths]
    sizes = [os.path.getsize(p) // stride for p in paths]
    piece = -(-stride // parts // 4096) * 4096  # O_DIRECT: whole 4 KiB blocks
    bufs = [aligned_buffer(piece) for _ in range(threads)]
    jobs = [(random.randrange(len(fds)), j) for j in range(n * parts)]

    def one(job):
        f, j = job
        at = random.randrange(parts) * piece
        os.preadv(fds[f], [memoryview(bufs[j % threads])[: min(piece, stride - at)]], random.randrange(sizes[f]) * stride + at)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, jobs))
    dt = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return n * stride / dt / 1e9


def best_read_gbs(paths: list[Path], stride: int) -> float:
    """The disk at its best for random whole records: the faster of 8 and 16 reads in flight."""
    return max(random_read_gbs(paths, stride, threads=t) for t in (8, 16))


def mlx_lm_run(ckpt: Path, ids: list[int], tokens: int, tokenwise: bool = False, dtype: str | None = None) -> dict:
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, load_tokenizer

    model, _ = load_model(ckpt)
    if dtype:
        model.set_dtype(getattr(mx, dtype))
    if not tokenwise:  # a warm-up prompt: the first one compiles prefill's kernels (minutes on a fresh CUDA machine)
        mx.eval(model(mx.array([ids]), cache=make_prompt_cache(model)))
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    if tokenwise:  # one token at a time: only decode-shaped kernels (a fresh CUDA machine JIT-compiles prefill's for minutes)
        for t in ids:
            lg = model(mx.array([[t]]), cache=cache)[0, -1]
            mx.eval(lg)
    else:
        lg = model(mx.array([ids]), cache=cache)[0, -1]
        mx.eval(lg)
    prefill = time.perf_counter() - t0
    tok, times, build = int(mx.argmax(lg).item()), [], []
    for _ in range(tokens):  # one sync per token
        t = time.perf_counter()
        lg = model(mx.array([[tok]]), cache=cache)[0, -1]
        build.append(time.perf_counter() - t)
        tok = int(mx.argmax(lg).item())
        times.append(time.perf_counter() - t)
    stock = None
    try:  # stock generate (pipelined with async_eval): the number users see
        tk = load_tokenizer(ckpt)
        for r in stream_generate(model, tk, prompt=ids, max_tokens=tokens, prefill_step_size=1 if tokenwise else 2048):
            stock = r
    except Exception as e:  # noqa: BLE001 - the simple loop above still stands
        print("stream_generate failed:", e)
    del model, cache
    mx.clear_cache()
    ms = float(np.median(times) * 1000)
    return {"tag": "mlx-lm", "prefill_tokenwise": tokenwise, "prefill_s": round(prefill, 3), "ms_token": round(ms, 2), "tok_s": round(1000 / ms, 2),
            "build_ms": round(float(np.median(build) * 1000), 2),
            "stock_generate_tok_s": round(stock.generation_tps, 2) if stock else None,
            "stock_prompt_tok_s": round(stock.prompt_tps, 1) if stock else None,
            "peak_gib": round(mx.get_peak_memory() / 2**30, 2)}


def streamoe_run(model: Path, ids: list[int], tokens: int, cap: str, experts: str, dtype: str | None,
                 ablate: str = "", io_threads: int = 8) -> dict:
    """`ablate`: run without one of the speed measures, to measure what it is worth: `cache32` (MLX's buffer
    cache held at 32 MiB, as before the plan had an allocator account), `kvf32` (a float32 KV cache), `gdnkernel`
    (the delta rule as the token loop of compiled steps, not the backend's form), `guesswait` (guesses read at the
    demand reads' priority, side by side with them, the older schedule), `wastebudget` (a guess rank needs a fixed
    0.8 precision, the older rule, instead of following the waste budget), `queueoutput` (a layer's routed experts
    queued with the next layer's mixer, one launch a layer, not on their own: `experts.QUEUE_OUTPUT`), `decodeahead` (the other
    setting of `experts.DECODE_AHEAD` on this backend: on a GPU each decode layer waits for its picks, none runs ahead
    of them; on the CPU layers run ahead), `eagermixer` (the other setting of `experts.EAGER_MIXER` on this backend:
    each layer's mixer queued as soon as it is built, or with the layer's experts)."""
    from streamoe.runtime import experts as experts_mod
    from streamoe.runtime import store as store_mod
    from streamoe.runtime.models import delta_rule

    delta_rule.GDN_FORM = "ops" if ablate == "gdnkernel" else None
    store_mod.GUESSES_WAIT = ablate != "guesswait"
    experts_mod.PRECISION_RANGE = (0.8, 0.8) if ablate == "wastebudget" else DEFAULT_PRECISION_RANGE
    experts_mod.QUEUE_OUTPUT = () if ablate == "queueoutput" else DEFAULT_QUEUE_OUTPUT
    backend = "cpu" if mx.default_device() == mx.cpu else "gpu"
    eager_here = backend in DEFAULT_EAGER_MIXER
    experts_mod.EAGER_MIXER = (DEFAULT_EAGER_MIXER if ablate != "eagermixer" else
                               tuple(b for b in DEFAULT_EAGER_MIXER if b != backend) if eager_here else (backend,))
    ahead_here = backend in DEFAULT_DECODE_AHEAD
    experts_mod.DECODE_AHEAD = DEFAULT_DECODE_AHEAD if ablate != "decodeahead" else () if ahead_here else (backend,)
    cap_gib = cap_gib_for(model, cap, experts, dtype)
    gc.collect()  # the previous run's engine (its timing wrapper makes a cycle), so its memory is not counted here
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    # a fixed interpreter allowance: the measured one would include what the mlx-lm run left in this process
    eng = Engine(model, Options(cap_gib=cap_gib, ctx=2048, experts=experts, dtype=dtype, runtime_bytes=600 << 20,
                                kv="float32" if ablate == "kvf32" else "auto", io_threads=io_threads))
    open_s = time.perf_counter() - t0
    if eng.experts.resident:  # a warm-up prompt, as for mlx-lm (a capped one would also warm the tier)
        mx.eval(eng.prefill(ids))
        eng.reset()
    if ablate == "cache32":
        mx.set_cache_limit(32 << 20)
    from streamoe.runtime.sampling import Sampler

    eng.text.stop_ids = set()  # random weights may pick a stop token early: measure a fixed number of tokens
    prof = None
    if ablate == "profile":  # the host's time in decode by function (cProfile: the run itself is slower)
        import cProfile

        prof = cProfile.Profile()
    t0 = time.perf_counter()
    stamps = []
    for _ in eng.generate(ids, tokens + 1, Sampler()):  # greedy: the pipelined path where everything is resident
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu0 = time.thread_time()  # this thread's CPU time: holds still where wall time drifts with the machine
            if prof is not None:
                prof.enable()
    main_cpu_ms = 1000 * (time.thread_time() - cpu0) / max(1, len(stamps) - 1)
    profile = None
    if prof is not None:
        import pstats

        prof.disable()
        st = pstats.Stats(prof)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]  # by own time
        profile = [{"fn": f"{Path(f).name}:{ln}:{fn}", "calls": v[1], "own_ms": round(v[2] * 1000, 1),
                    "cum_ms": round(v[3] * 1000, 1)} for (f, ln, fn), v in top]
    prefill = stamps[0] - t0  # time to the first token
    times = list(np.diff(stamps))
    s = summarize(eng.steps, eng.peak_rss, eng.plan.cap)
    dec = [st for st in eng.steps if st.phase == "decode"]
    lay = [ly for st in dec for ly in st.layers]
    stride = eng.lay.stride
    read = sum(ly.bytes_read for ly in lay)
    picks = sum(ly.picks for ly in lay)
    eng.close()
    ms = float(np.median(times) * 1000)
    tag = ("" if not ablate else "-profiled" if ablate == "profile" else f"-eager-mixer-{'off' if eager_here else 'on'}" if ablate == "eagermixer"
           else f"-decode-ahead-{'off' if ahead_here else 'on'}" if ablate == "decodeahead" else f"-no-{ablate}")
    res = {"tag": f"streamoe-{cap}-{experts}" + tag + (f"-io{io_threads}" if io_threads != 8 else ""), "io_threads": io_threads, "cap_gib": cap_gib, "resident": eng.experts.resident, "open_s": round(open_s, 1),
            "prefill_s": round(prefill, 3), "ms_token": round(ms, 2), "tok_s": round(1000 / ms, 2),
            "build_ms": round(float(np.median([st.host_ms for st in dec[-tokens:]])), 2), "main_cpu_ms": round(main_cpu_ms, 2), "compute_ms": round(s["compute_ms"], 2), "io_wait_ms": round(s["io_wait_ms"], 2),
            "mib_read_token": round(read / 2**20 / max(1, len(dec)), 2),
            "hit_in_memory": round(sum(ly.hits_hot + ly.hits_lent for ly in lay) / picks, 4) if picks else None,
            "hit_read_ahead": round(sum(ly.hits_prefetch for ly in lay) / picks, 4) if picks else None,
            "layers_run_ahead_frac": round(sum(ly.ran_ahead for ly in lay) / max(1, len(lay)), 4),
            "layers_thrown_frac": round(sum(ly.thrown for ly in lay) / max(1, len(lay)), 4),
            "prefetch_wasted_frac": round(sum(ly.prefetch_wasted for ly in lay) * stride / read, 4) if read else 0.0,
            "hot_slots": eng.plan.hot_slots, "peak_mlx_gib": round(mx.get_peak_memory() / 2**30, 2),
            "plan_total_gib": round((eng.plan.fixed + eng.plan.hot_slots * stride) / 2**30, 2)}
    busy_ms = sum(st.disk_busy_ms for st in dec)
    if busy_ms:  # the share of decode the disk had a read in progress, and its speed while it had
        res["disk_busy_frac"] = round(s["disk_busy"], 3)
        res["disk_gbs_while_busy"] = round(read / (busy_ms / 1000) / 1e9, 3)
    if profile:
        res["profile"] = profile
    return res


def paired_run(ckpt: Path, model: Path, ids: list[int], tokens: int, cap: str, experts: str, dtype: str | None) -> dict:
    """mlx-lm and streamoe decoding in one process, a token of each in turn (both synced per token): on a
    machine whose speed drifts by 2x within a minute, each pair of tokens sees the same machine, and the
    median of the per-pair ratios is the ratio."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    ref, _ = load_model(ckpt)
    if dtype:
        ref.set_dtype(getattr(mx, dtype))
    cache = make_prompt_cache(ref)
    ref_tok = int(mx.argmax(ref(mx.array([ids]), cache=cache)[0, -1]).item())
    eng = Engine(model, Options(cap_gib=cap_gib_for(model, cap, experts, dtype), ctx=2048, experts=experts, dtype=dtype,
                                runtime_bytes=600 << 20))
    tok = int(np.argmax(np.array(eng.prefill(ids).astype(mx.float32))))
    ref_ms, ours_ms = [], []
    for _ in range(tokens):
        t = time.perf_counter()
        ref_tok = int(mx.argmax(ref(mx.array([[ref_tok]]), cache=cache)[0, -1]).item())
        t1 = time.perf_counter()
        tok = int(np.argmax(np.array(eng.decode(tok).astype(mx.float32))))
        t2 = time.perf_counter()
        ref_ms.append((t1 - t) * 1000)
        ours_ms.append((t2 - t1) * 1000)
    eng.close()
    ratios = [r / o for r, o in zip(ref_ms[1:], ours_ms[1:], strict=True)]
    return {"tag": f"paired-mlx-lm-vs-streamoe-{cap}-{experts}", "tokens": tokens,
            "mlx_lm_ms_token": round(float(np.median(ref_ms[1:])), 2), "ms_token": round(float(np.median(ours_ms[1:])), 2),
            "decode_vs_mlx_lm_paired": round(float(np.median(ratios)), 3),
            "ratio_quartiles": [round(float(q), 3) for q in np.percentile(ratios, [25, 75])]}


def cap_gib_for(model: Path, cap: str, experts: str, dtype: str | None) -> float:
    """`slots:N`: the smallest cap whose plan (ctx 2048, the runtime allowance 600 MiB, the auto prefill chunk, as
    `streamoe run` plans it) holds at least N hot-tier slots; `resident`: all of it; else GiB. (The cap used to be
    the smallest chunk's fixed accounts + N slots: the auto chunk then took its share and left fewer.)"""
    if not cap.startswith("slots:"):
        return 64.0 if cap == "resident" else float(cap)
    from streamoe.runtime.plan import plan_for

    def hot(gib: float) -> int:
        return plan_for(model, Options(cap_gib=gib, ctx=2048, experts=experts, dtype=dtype,
                                       runtime_bytes=600 << 20)).hot_slots

    want = int(cap[6:])
    lo, hi = 0.0, 64.0  # hot(lo) < want <= hot(hi); the hot tier grows with the cap
    while hi - lo > 1e-5:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if hot(mid) >= want else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--caps", default="resident,4")
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--mlx-lm-tokenwise", action="store_true", help="feed mlx-lm's prompt one token at a time")
    ap.add_argument("--ablate", default="", help="also run without: cache32,kvf32,gdnkernel (resident), guesswait@CAP, wastebudget@CAP, queueoutput@CAP "
                    "(capped); the other setting: decodeahead@CAP, eagermixer@CAP; or profile@CAP (a capped run under cProfile, last); comma-separated")
    ap.add_argument("--io-threads", default="8", help="capped runs: reads in flight, comma-separated for several runs")
    ap.add_argument("--rounds", type=int, default=1, help="capped runs (ablations included) repeated, interleaved")
    ap.add_argument("--mlx-lm-each-round", action="store_true", help="mlx-lm's run again before each round's capped "
                    "runs: their ratios are against the run right before them")
    ap.add_argument("--paired", type=int, default=0, help="then N tokens of mlx-lm and streamoe in turn at the first "
                    "capped cap (--caps), the median of the per-pair ratios")
    ap.add_argument("--disk-grid", action="store_true", help="first, the disk's speed by reads in flight and record "
                    "pieces per read (does a layer's few reads keep the disk busy?)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from streamoe.runtime.text import TextIO

    m = load_manifest(a.model)
    ids = TextIO(a.model, m.config).encode(TEXT)[:110]
    fmt = m.expert_formats()[a.experts]
    paths = [safe_path(a.model, f["path"]) for f in fmt.files]
    res = {"device": str(mx.default_device()), "machine": machine(), "prompt_tokens": len(ids),
           "raw_random_read_gbs": round(random_read_gbs(paths, fmt.layout.stride), 3),
           "raw_random_read_gbs_16_threads": round(random_read_gbs(paths, fmt.layout.stride, threads=16), 3), "runs": []}
    if a.disk_grid:
        res["disk_grid_gbs"] = {f"{t}x{p}": round(random_read_gbs(paths, fmt.layout.stride, n=200, threads=t, parts=p), 3)
                                for t in (1, 2, 4, 8, 16) for p in (1, 2, 4) if t * p <= 32}
        print(res["disk_grid_gbs"], flush=True)
    threads = [int(t) for t in a.io_threads.split(",")]
    runs = [(cap, "", t) for cap in a.caps.split(",") for t in (threads[:1] if cap == "resident" else threads)]
    for x in filter(None, a.ablate.split(",")):
        name, _, cap = x.partition("@")
        runs.append((cap or "resident", name, threads[0]))
    MLX_LM = ("mlx-lm", "", 0)
    capped = [r for r in runs if r[0] != "resident" and r[1] != "profile"]
    plan = [] if a.skip_mlx_lm else [MLX_LM]
    plan += [r for r in runs if r[0] == "resident"]
    for k in range(a.rounds):  # A, B, A, B: the host and the disk drift
        plan += ([MLX_LM] if k and a.mlx_lm_each_round and not a.skip_mlx_lm else []) + capped
    plan += [r for r in runs if r[1] == "profile"]

    def disk_gbs() -> float:
        return best_read_gbs(paths, fmt.layout.stride)

    base = None  # the latest mlx-lm run: each streamoe run's ratios are against it
    for cap, ablate, io in plan:
        if cap == "mlx-lm":
            base = mlx_lm_run(a.ckpt, ids, a.tokens, a.mlx_lm_tokenwise, a.dtype)
            res["runs"].append(base)
            print(base, flush=True)
            continue
        before = disk_gbs() if cap != "resident" else None  # the disk's speed drifts too: measured beside each run
        r = streamoe_run(a.model, ids, a.tokens, cap, a.experts, a.dtype, ablate, io)
        if r["mib_read_token"]:
            after = disk_gbs()
            r["raw_random_read_gbs_before_after"] = [round(before, 3), round(after, 3)]
            raw = (before + after) / 2
            bound_ms = r["mib_read_token"] * 2**20 / (raw * 1e9) * 1000
            r["disk_bound_ms"] = round(bound_ms, 2)
            r["of_disk_bound"] = round(bound_ms / r["ms_token"], 3)
        if base:
            r["decode_vs_mlx_lm"] = round(base["ms_token"] / r["ms_token"], 3)
            if not base["prefill_tokenwise"]:
                r["prefill_vs_mlx_lm"] = round(base["prefill_s"] / r["prefill_s"], 3)
            if base.get("stock_generate_tok_s"):
                r["decode_vs_stock_generate"] = round(r["tok_s"] / base["stock_generate_tok_s"], 3)
        res["runs"].append(r)
        print(r, flush=True)
        if a.out:  # a run cut off by a time limit keeps what it measured
            a.out.write_text(json.dumps(res, indent=2) + "\n")
    if a.paired:
        cap = next((c for c in a.caps.split(",") if c != "resident"), "resident")
        res["runs"].append(paired_run(a.ckpt, a.model, ids, a.paired, cap, a.experts, a.dtype))
        print(res["runs"][-1], flush=True)
    medians = {}
    for key in ("decode_vs_mlx_lm", "of_disk_bound", "decode_vs_mlx_lm_paired"):
        by_tag: dict[str, list[float]] = {}
        for r in res["runs"]:
            if key in r:
                by_tag.setdefault(r["tag"], []).append(r[key])
        medians[key] = {t: round(float(np.median(v)), 3) for t, v in by_tag.items()}
    res["medians"] = medians
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
