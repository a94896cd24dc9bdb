"""Long-prompt prefill of three engines side by side: streamoe at a cap, mlx-vlm's expert offload, mlx-lm resident.

    python -m bench.prefill_peers --ckpt CKPT --model CONV --cap quarter --prompts 2048 --experts q4 \\
        --work /tmp/pp/work --out bench/results/prefill-peers-cpu-small                                    # CPU
    python -m bench.prefill_peers --ckpt $S/full-ckpt --model $S/full-conv --cap 4 --prompts 2048,8192 \\
        --experts q4 --warmup 512 --work $S/peers --out $OUT/prefill-peers-h200                           # H200

CKPT is the mlx-community checkpoint (what mlx-lm loads, and what mlx-vlm repacks), CONV its streamoe conversion.
For each prompt length the same token ids (`bench.prefill.prompt_ids`: a fixed English text tokenized by the
conversion's tokenizer, repeated to the length) go through three engines, each in a fresh process of its own
(`--child`), so no engine inherits another's memory, allocator cache or compiled kernels:

- `streamoe`: `Engine(CONV, Options(cap_gib=...))` at the cap (`--cap`: GiB, or `quarter` / `slots:N` /
  `resident` as `bench.prefill.cap_gib` reads them), its own chunking (`--prefill-chunk auto`);
- `mlx-vlm`: CKPT repacked once by `python -m mlx_vlm.moe_offload --build CKPT --out WORK/offload`, loaded by
  `mlx_vlm.load` (which sees `offload_index.json` and swaps every switch layer for an `OffloadedSwitchGLU` over an
  `ExpertStore`), with `expert_cache_gb` = streamoe's hot tier at the same cap and context (`plan.hot_slots *
  plan.slot_bytes`), so both hold the same number of expert bytes between reads; its prompt goes through its own
  `generate_step` (`mlx_vlm.generate`), whose chunks are its default `prefill_step_size` (what
  `_default_prefill_step_size_for_offload` keeps for an offloaded model);
- `mlx-lm`: `mlx_lm.load(CKPT)`, every expert resident (the compute without any disk), through its own
  `generate_step` with its default `prefill_step_size` and a cache from `make_prompt_cache`.

mlx-vlm and mlx-lm run in streamoe's compute dtype (`--dtype`, default `default_dtype()`: float32 on the CPU,
whose bf16 kernels are several times slower, bfloat16 on a GPU), set with `model.set_dtype`, so the three compute
the same function and the comparison is of engines, not of dtypes.

Why each number is taken the way it is:
- `prefill_s`: from the first token fed to the last position's logits evaluated; the libraries' generators are
  run with `max_tokens=0` (they prefill, sample the first token from the last position and stop before any decode
  step) and a sampler that keeps the log-probabilities it is given, so the time is their own prefill loop and
  nothing else. Before it, an untimed warm-up prefill of `--warmup` tokens in the same process keeps first-call
  costs (kernel compiles, CUDA's JIT) out, like `bench.prefill --warmup`; streamoe's warm-up is
  `bench.prefill.one` on a fresh engine, mlx-vlm's model is loaded again after its warm-up (its expert cache and
  mRoPE state start empty, as streamoe's fresh engine does), mlx-lm's has nothing to reset.
- `bytes_read`: `/proc/self/io` `read_bytes` over the timed prefill, i.e. what the block layer read for the process
  (page-cache misses and O_DIRECT reads alike). Right before it every file of the engine's directory (CONV,
  WORK/offload, CKPT) is evicted from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`), so pages left by the
  load, the warm-up or an earlier run do not hide reads (each file fsync'ed first: DONTNEED keeps dirty pages, and
  the repack's files may not be written back yet). MLX copies what it loads into its own buffers (no mmap), so
  an engine whose weights were all loaded before the window (mlx-lm) reads nothing in it. streamoe also reports
  its own count (`streamoe_bytes_read`, the expert store's). `disk_bound_s`: those bytes at the disk's O_DIRECT
  random-read speed of CONV's expert records (`bench.gpu_compare.best_read_gbs`, the faster of 8 and 16 in
  flight, before and after the three engines, averaged).
- `peak_rss_bytes`: `getrusage(RUSAGE_SELF).ru_maxrss` of the engine's process, its whole life (load and
  warm-up included); `prefill_peak_rss_bytes`: the kernel's high-water mark of the resident set reset right before
  the timed prefill (`/proc/self/clear_refs` 5, read back as `VmHWM`): the prefill's own peak; `rss_before_bytes`
  what it held when the prefill began.
- `expert_budget_bytes`: streamoe's hot tier, the budget mlx-vlm's store was given (as its store reports it), and
  for mlx-lm every expert's bytes (all resident). mlx-vlm's store counts an expert's tensors as stored (bfloat16
  scales), streamoe's slots at the compute dtype, so at float32 the same bytes hold more mlx-vlm experts
  (`expert_budget_experts`). mlx-vlm's `OffloadedSwitchGLU` loads a whole layer past its budget when a call
  routes to more than half of the layer's experts (`ExpertStore.get_all`, which a prefill chunk usually does):
  `store` gives its counters after the prefill.
- `argmax`: the argmax of the last position's logits; `argmax_agrees` compares it with streamoe's.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from .common import RESULTS, drop_files, status_kib, write_result

ENGINES = ("streamoe", "mlx-vlm", "mlx-lm")
REPO = Path(__file__).resolve().parents[1]


def proc_read_bytes() -> int:
    """Bytes this process has had read from storage (`/proc/self/io` read_bytes: page-cache misses and O_DIRECT)."""
    for ln in open("/proc/self/io"):
        if ln.startswith("read_bytes:"):
            return int(ln.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def evict(root: Path) -> int:
    """Drop every file under `root` from the page cache (`common.drop_files`, which fsyncs a writable file first:
    DONTNEED keeps dirty pages, and mlx-vlm's repack may still be dirty); returns how many files."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    drop_files(files)
    return len(files)


def _status_bytes(key: str) -> int | None:
    return status_kib(os.getpid(), key) * 1024 or None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed_prefill(run: Callable[[], mx.array], root: Path) -> dict:
    """`run()` (which returns the last position's logits, evaluated) timed, with its storage reads and resident-set
    peak, after `root`'s files are evicted from the page cache."""
    gc.collect()
    files = evict(root)
    rss_before = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
    read0 = proc_read_bytes()
    t0 = time.perf_counter()
    logits = run()
    mx.eval(logits)
    dt = time.perf_counter() - t0
    read = proc_read_bytes() - read0
    return {"prefill_s": round(dt, 3), "bytes_read": read, "evicted_files": files,
            "argmax": int(mx.argmax(logits.reshape(-1)).item()), "rss_before_bytes": rss_before,
            "prefill_peak_rss_bytes": _status_bytes("VmHWM") if reset else None}


class LastLogprobs:
    """A greedy sampler that keeps the log-probabilities it was given (the last position's, in a prefill)."""

    def __init__(self) -> None:
        self.logprobs: mx.array | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.logprobs = logprobs
        return mx.argmax(logprobs, axis=-1)


def _default_step(fn: Callable) -> int:
    return int(inspect.signature(fn).parameters["prefill_step_size"].default)


def _chunks(n: int, step: int) -> int:
    """Model calls of mlx-lm's / mlx-vlm's prefill loop: chunks of `step` while more than one token is left, then
    the last token with the sampling step."""
    return -(-(n - 1) // step) + 1


# --- the engines, each run in a child process --------------------------------------------------------------------

def run_streamoe(a: argparse.Namespace, ids: list[int]) -> dict:
    from streamoe.runtime.engine import Engine, Options

    from .prefill import RUNTIME, one

    ctx = len(ids) + 64
    if a.warmup:  # a fresh engine at the same plan, untimed: the prefill's kernels compiled once
        one(a.model, ids[: a.warmup], a.cap_gib, ctx, a.experts, a.dtype, "auto", a.io_threads)
        gc.collect()
        mx.clear_cache()
    eng = Engine(a.model, Options(cap_gib=a.cap_gib, ctx=ctx, experts=a.experts, dtype=a.dtype, runtime_bytes=RUNTIME,
                                  prefill_chunk="auto", io_threads=a.io_threads))
    try:
        store, plan = eng.experts.store, eng.plan
        read0 = store.bytes_read
        r = timed_prefill(lambda: eng.prefill(ids), a.model)
        eng.note_rss()
        r.update(streamoe_bytes_read=store.bytes_read - read0, expert_budget_bytes=plan.hot_slots * plan.slot_bytes,
                 expert_budget_experts=plan.hot_slots, resident=eng.experts.resident, plan_chunk=plan.prefill_chunk,
                 chunks=-(-len(ids) // plan.prefill_chunk), streamoe_peak_rss_bytes=eng.peak_rss)
        return r
    finally:
        eng.close()


def run_mlx_vlm(a: argparse.Namespace, ids: list[int]) -> dict:
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step

    offload = a.work / "offload"
    budget = int(a.budget)
    if budget <= 0:  # ExpertStore reads a budget <= 0 as "no eviction at all"
        raise SystemExit(f"an expert budget of {budget} bytes would leave mlx-vlm's expert cache unbounded")

    def open_model():
        model, _ = load(str(offload), expert_cache_gb=budget / 1e9)  # patch_model: int(expert_cache_gb * 1e9) bytes
        model.set_dtype(getattr(mx, a.dtype))
        return model

    def prefill(model, tokens: list[int]) -> mx.array:
        keep = LastLogprobs()
        for _ in generate_step(mx.array([tokens]), model, None, None, max_tokens=0, sampler=keep):
            pass  # max_tokens=0: the prompt, the first token sampled, no decode step
        return keep.logprobs

    model = open_model()
    if a.warmup:
        mx.eval(prefill(model, ids[: a.warmup]))
        del model
        gc.collect()
        mx.clear_cache()
        model = open_model()  # an empty expert cache and no mRoPE state left from the warm-up
    store = model.moe_offload_store
    r = timed_prefill(lambda: prefill(model, ids), offload)
    step = _default_step(generate_step)
    per_expert = os.path.getsize(store._paths[min(store._paths)]) / store.num_experts
    stats = store.stats()
    r.update(expert_budget_bytes=stats["budget_bytes"], expert_budget_experts=int(stats["budget_bytes"] // per_expert),
             prefill_step=step, chunks=_chunks(len(ids), step), store=stats)
    return r


def run_mlx_lm(a: argparse.Namespace, ids: list[int]) -> dict:
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(a.ckpt))
    model.set_dtype(getattr(mx, a.dtype))

    def prefill(tokens: list[int]) -> mx.array:
        keep = LastLogprobs()
        for _ in generate_step(mx.array(tokens), model, max_tokens=0, sampler=keep,
                               prompt_cache=make_prompt_cache(model)):
            pass  # max_tokens=0: the prompt, the first token sampled, no decode step
        return keep.logprobs

    if a.warmup:
        mx.eval(prefill(ids[: a.warmup]))
    r = timed_prefill(lambda: prefill(ids), a.ckpt)
    step = _default_step(generate_step)
    experts = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if ".switch_mlp." in k)
    r.update(expert_budget_bytes=experts, resident=True, prefill_step=step, chunks=_chunks(len(ids), step))
    return r


def child(a: argparse.Namespace) -> dict:
    ids = json.loads(a.ids.read_text())
    run = {"streamoe": run_streamoe, "mlx-vlm": run_mlx_vlm, "mlx-lm": run_mlx_lm}[a.child]
    r = run(a, ids)
    r["tok_s"] = round(len(ids) / r["prefill_s"], 1)
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return r


# --- the parent --------------------------------------------------------------------------------------------------

def repack(ckpt: Path, work: Path) -> dict:
    """mlx-vlm's offload layout of CKPT in WORK/offload, built once (kept and reused by later runs)."""
    out = work / "offload"
    if (out / "offload_index.json").exists():
        return {"repack": "reused"}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mlx_vlm.moe_offload", "--build", str(ckpt), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        return {"repack_error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return {"repack_s": round(time.perf_counter() - t, 2)}


def run_child(engine: str, a: argparse.Namespace, ids_file: Path, gib: float, budget: int) -> dict:
    cmd = [sys.executable, "-m", "bench.prefill_peers", "--child", engine, "--ids", str(ids_file), "--ckpt", str(a.ckpt),
           "--model", str(a.model), "--work", str(a.work), "--experts", a.experts, "--dtype", a.dtype,
           "--cap-gib", repr(gib), "--budget", str(budget), "--warmup", str(a.warmup), "--io-threads", str(a.io_threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1], "rc": p.returncode}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="the mlx-community checkpoint (mlx-lm, mlx-vlm's repack)")
    ap.add_argument("--model", type=Path, required=True, help="its streamoe conversion")
    ap.add_argument("--cap", default="quarter", help="GiB, quarter, slots:N or resident (as bench.prefill reads them)")
    ap.add_argument("--prompts", default="2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--experts", default="q4", help="streamoe's expert format")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of " + ", ".join(ENGINES))
    ap.add_argument("--dtype", default=None, help="compute dtype of all three (default: streamoe's for the device)")
    ap.add_argument("--warmup", type=int, default=256, help="an untimed prefill of this many tokens first, per process")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch directory: mlx-vlm's repack (WORK/offload, kept and reused), the prompts' ids")
    ap.add_argument("--out", default="prefill-peers", help="NAME: writes NAME.json (bench/results/NAME.json for a bare name)")
    ap.add_argument("--child", choices=ENGINES, default=None, help=argparse.SUPPRESS)  # one engine, a JSON line
    ap.add_argument("--ids", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return

    from streamoe.formats.manifest import load_manifest, safe_path
    from streamoe.runtime.engine import Options
    from streamoe.runtime.plan import default_dtype, plan_for

    from .common import scratch_dir
    from .gpu_compare import best_read_gbs
    from .prefill import RUNTIME, cap_gib, prompt_ids

    engines = a.engines.split(",")
    if unknown := set(engines) - set(ENGINES):
        ap.error(f"unknown engines: {', '.join(sorted(unknown))}")
    a.dtype = a.dtype or default_dtype()
    fmt = load_manifest(a.model).expert_formats()[a.experts]
    paths = [safe_path(a.model, f["path"]) for f in fmt.files]

    def disk_gbs() -> float:
        return best_read_gbs(paths, fmt.layout.stride)

    results = []
    with scratch_dir(a.work) as work:
        a.work = work
        built = repack(a.ckpt, work) if "mlx-vlm" in engines else {}
        for n in map(int, a.prompts.split(",")):
            ctx = n + 64
            gib = cap_gib(a.model, a.cap, ctx, a.experts, a.dtype)
            plan = plan_for(a.model, Options(cap_gib=gib, ctx=ctx, experts=a.experts, dtype=a.dtype,
                                             runtime_bytes=RUNTIME, prefill_chunk="auto"))
            budget = plan.hot_slots * plan.slot_bytes
            ids_file = work / f"ids-{n}.json"
            ids_file.write_text(json.dumps(prompt_ids(a.model, n)))
            before = disk_gbs()
            rows = []
            for engine in engines:
                r = {"engine": engine, "prompt_tokens": n, "cap": a.cap, "cap_gib": round(gib, 4), "ctx": ctx,
                     "experts": a.experts, "dtype": a.dtype, "device": str(mx.default_device()), "warmup": a.warmup}
                if engine == "mlx-vlm":
                    r.update(built)
                if "repack_error" in r:
                    r["error"] = "mlx_vlm.moe_offload --build failed: " + r["repack_error"]
                else:
                    r.update(run_child(engine, a, ids_file, gib, budget))
                rows.append(r)
            gbs = (before + disk_gbs()) / 2
            ref = next((r["argmax"] for r in rows if r["engine"] == "streamoe" and "argmax" in r), None)
            for r in rows:
                r["raw_random_read_gbs"] = round(gbs, 3)
                if "bytes_read" in r:
                    r["disk_bound_s"] = round(r["bytes_read"] / (gbs * 1e9), 3)
                if "argmax" in r and ref is not None:
                    r["argmax_agrees"] = r["argmax"] == ref
                print(json.dumps(r), flush=True)
            results += rows
    out = Path(f"{a.out}.json") if os.sep in a.out else RESULTS / f"{a.out}.json"
    write_result(a.out, "prefill_peers", results, out=out)


if __name__ == "__main__":
    main()
