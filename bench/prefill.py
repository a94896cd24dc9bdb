"""Long prompts inside the cap: prefill time against what it reads, and what it reads against what it needs.

    python -m bench.prefill --model CONVERTED --caps quarter --prompts 2048 --chunks auto,256           # CPU
    python -m bench.prefill --model CONVERTED --caps 4 --experts q4,q3 --prompts 2048,8192,32768        # H200

For each model x expert format x cap x prompt length x `--prefill-chunk`: one prompt prefilled in a fresh
engine (raw tokens of a fixed English text, repeated to the length), and
- `prefill_s`, `tok_s`, `sweeps` (bytes read / every expert record once), `read_vs_needed` (bytes read / the
  sum over chunks of each chunk's distinct picks' records: 1.0 = nothing read twice in a chunk, nothing
  read that was not picked), the guesses that were read ahead and picked, and those wasted;
- the disk's raw O_DIRECT random-read speed of the layer files at 8 and 16 reads in flight (the faster), measured
  right before and right after the run and averaged (the disk drifts), and `of_disk_bound` = (bytes read / that
  speed) / prefill time: near 1, the prefill runs at the disk's speed;
- the plan's chunk, hot tier and activation account, what the prefill allocated at its peak beyond what the
  engine held before it (`prefill_work_mib`; `work_within_account`: no more than the activation account), MLX's
  peak in all (`mlx_peak_gib`, against the cap) and the peak resident set.
A cap is GiB, `slots:N` (the hot tier holds N experts at the smallest chunk), `quarter` (a quarter of every
expert) or `resident` (every expert in memory: the prefill's compute alone). `--cgroup` also runs each case as
`streamoe run` inside a cgroup-v1 memory group whose limit is the cap (root): `cgroup_peak` against the cap,
`cgroup_failcnt` 0 when the limit was never reached.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import mlx.core as mx

from streamoe.formats.errors import StreamoeError
from streamoe.formats.manifest import load_manifest, safe_path
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.plan import PREFILL_STEP, plan_for

from .common import scratch_dir, write_result
from .gpu_compare import TEXT, best_read_gbs

RUNTIME = 600 << 20  # a fixed interpreter allowance, so every case's plan is the same whatever ran before it


def prompt_ids(model: Path, n: int) -> list[int]:
    from streamoe.runtime.text import TextIO

    ids = TextIO(model, load_manifest(model).config).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def cap_gib(model: Path, cap: str, ctx: int, experts: str, dtype: str | None) -> float:
    """GiB, `resident` (64 GiB: every expert in memory, the prefill's compute alone), or `slots:N` / `quarter`: the
    fixed accounts at the smallest chunk + that many hot-tier slots."""
    if cap == "resident":
        return 64.0
    if cap != "quarter" and not cap.startswith("slots:"):
        return float(cap)
    base = plan_for(model, Options(cap_gib=1 << 10, ctx=ctx, experts=experts, dtype=dtype, runtime_bytes=RUNTIME,
                                   prefill_chunk=PREFILL_STEP))
    slots = base.n_layers * base.n_experts // 4 if cap == "quarter" else int(cap[6:])
    return (base.fixed + slots * base.slot_bytes + 1) / 2**30


def prefill_parts(pre: list) -> dict:
    """Where the prefill steps' time went on the host's thread, in seconds: waiting at fences for the device (its
    compute not hidden behind the host's work), for the disk, landing records beyond that (of which the copy
    threads and the ring's sync), and the rest, the host's own work: building and queueing the layers' kernels,
    the tiers' bookkeeping, and on the CPU backend the prefill's BLAS products (`kernels._switch_glu_blas`)."""
    s = {name: sum(getattr(ly, name) for st in pre for ly in st.layers) / 1000
         for name in ("compute_ms", "io_wait_ms", "landing_ms", "copy_wait_ms", "sync_ms")}
    total = sum(st.ms for st in pre) / 1000
    out = {"steps": total, "device_wait": s["compute_ms"], "disk_wait": s["io_wait_ms"], "landing": s["landing_ms"],
           "landing_copy_wait": s["copy_wait_ms"], "landing_ring_sync": s["sync_ms"],
           "host": total - s["compute_ms"] - s["io_wait_ms"] - s["landing_ms"]}
    return {k: round(v, 3) for k, v in out.items()}


def one(model: Path, ids: list[int], cap: float, ctx: int, experts: str, dtype: str | None, chunk: str,
        io_threads: int) -> dict:
    gc.collect()
    mx.clear_cache()
    eng = Engine(model, Options(cap_gib=cap, ctx=ctx, experts=experts, dtype=dtype, runtime_bytes=RUNTIME,
                                prefill_chunk=chunk if chunk == "auto" else int(chunk), io_threads=io_threads))
    try:
        store, plan = eng.experts.store, eng.plan
        read0, busy0 = store.bytes_read, store.busy_time()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        mx.eval(eng.prefill(ids))
        dt = time.perf_counter() - t0
        work = mx.get_peak_memory() - held
        read = store.bytes_read - read0
        pre = [s for s in eng.steps if s.phase == "prefill"]
        lay = [ly for s in pre for ly in s.layers]
        needed = sum(ly.picks - ly.hits_hot - ly.hits_lent for ly in lay) * plan.stride
        sweep = plan.n_layers * plan.n_experts * plan.stride
        return {"prompt_tokens": len(ids), "chunk": chunk, "plan_chunk": plan.prefill_chunk, "plan_step": plan.prefill_step,
                "chunks": len(pre), "cap_gib": round(cap, 4), "resident": eng.experts.resident, "hot_slots": plan.hot_slots,
                "activations_mib": round(plan.accounts["activations"] / 2**20, 1),
                "prefill_work_mib": round(work / 2**20, 1),  # MLX's peak over the prefill beyond what the engine held
                "work_within_account": work <= plan.accounts["activations"],
                "mlx_peak_gib": round((held + work) / 2**30, 4),  # against the cap (the device's, on split memory)
                "prefill_s": round(dt, 3), "tok_s": round(len(ids) / dt, 1), "bytes_read": read,
                "sweeps": round(read / sweep, 3), "read_vs_needed": round(read / needed, 4) if needed else None,
                "distinct_picks": sum(ly.picks for ly in lay), "read_ahead_picked": sum(ly.hits_prefetch for ly in lay),
                "read_ahead_wasted": sum(ly.prefetch_wasted for ly in lay),
                "disk_busy_s": round(store.busy_time() - busy0, 3),
                "parts_s": prefill_parts(pre),
                "peak_rss_gib": round(eng.peak_rss / 2**30, 4)}
    finally:
        eng.close()


def cgroup_run(model: Path, ids: list[int], cap: float, ctx: int, experts: str, chunk: str, work: Path) -> dict:
    """The same prompt through `streamoe run` (raw, 2 tokens) inside a memory cgroup whose limit is the cap."""
    import shlex
    import subprocess
    import sys

    from streamoe.runtime.text import TextIO
    from tests.conftest import capped_cgroup

    text = TextIO(model, load_manifest(model).config).decode(ids)
    stats = work / "stats.jsonl"
    args = ["run", model, "--cap", f"{cap:.4f}", "--ctx", ctx, "--experts", experts, "--raw", "-p", text, "-n", 2, "--temp", 0,
            "--prefill-chunk", chunk, "--stats", stats]
    with capped_cgroup(cap, "prefill") as (cg, read):  # no time limit: a long prompt on a small CPU takes minutes
        cmd = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m streamoe.cli {shlex.join(map(str, args))}"
        p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
        failcnt, peak = read()
    recs = [json.loads(ln) for ln in stats.read_text().splitlines()] if p.returncode == 0 else []
    return {"cgroup_rc": p.returncode, "cgroup_failcnt": failcnt, "cgroup_peak_gib": round(peak / 2**30, 4),
            "cgroup_within_cap": failcnt == 0 and peak <= cap * 2**30,
            "cgroup_prompt_tokens": sum(r["n_tokens"] for r in recs if r["phase"] == "prefill"),
            "cgroup_stderr_tail": p.stderr.strip().splitlines()[-1:] if p.returncode else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="converted directories, comma-separated")
    ap.add_argument("--caps", default="quarter", help="GiB, slots:N, quarter or resident, comma-separated")
    ap.add_argument("--experts", default="q4", help="q4, q3 or q4,q3")
    ap.add_argument("--prompts", default="2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunks", default="auto", help="--prefill-chunk values, comma-separated (auto, or tokens)")
    ap.add_argument("--ctx", type=int, default=None, help="planned context (default: each prompt's length + 64)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--cgroup", action="store_true", help="also each case as `streamoe run` in a capped cgroup")
    ap.add_argument("--cgroup-only", action="store_true", help="only the cgroup runs (no in-process prefill)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default="prefill", help="result name: bench/results/NAME.json")
    ap.add_argument("--warmup", type=int, default=0,
                    help="first prefill this many tokens once, untimed, per expert format (a fresh GPU machine compiles "
                         "its kernels on the first prefill: minutes that are not the prefill's)")
    a = ap.parse_args()
    lengths = [int(n) for n in a.prompts.split(",")]
    results = []
    with scratch_dir(a.work) as work:
        for model in map(Path, a.model.split(",")):
            m = load_manifest(model)
            for experts in a.experts.split(","):
                fmt = m.expert_formats()[experts]
                paths = [safe_path(model, f["path"]) for f in fmt.files]

                def disk_gbs(paths=paths, stride=fmt.layout.stride) -> float:
                    return best_read_gbs(paths, stride)

                if a.warmup and not a.cgroup_only:
                    cap = a.caps.split(",")[0]
                    one(model, prompt_ids(model, a.warmup), cap_gib(model, cap, a.warmup + 64, experts, a.dtype),
                        a.warmup + 64, experts, a.dtype, "auto", a.io_threads)
                for cap in a.caps.split(","):
                    for n in lengths:
                        ctx = a.ctx or n + 64
                        gib = cap_gib(model, cap, ctx, experts, a.dtype)
                        ids = prompt_ids(model, n)
                        for chunk in a.chunks.split(","):
                            if a.cgroup_only:
                                r = {"model": model.name, "experts": experts, "cap": cap, "cap_gib": round(gib, 4),
                                     "ctx": ctx, "prompt_tokens": n, "chunk": chunk,
                                     **cgroup_run(model, ids, gib, ctx, experts, chunk, work)}
                                print(json.dumps(r), flush=True)
                                results.append(r)
                                continue
                            before = disk_gbs()
                            try:
                                r = one(model, ids, gib, ctx, experts, a.dtype, chunk, a.io_threads)
                            except StreamoeError as e:  # e.g. the plan does not fit this cap at this context
                                results.append({"model": model.name, "experts": experts, "cap": cap, "ctx": ctx,
                                                "prompt_tokens": n, "chunk": chunk, "error": str(e)})
                                print(json.dumps(results[-1]), flush=True)
                                continue
                            after = disk_gbs()
                            gbs = (before + after) / 2
                            r.update(model=model.name, experts=experts, cap=cap, ctx=ctx, device=str(mx.default_device()),
                                     raw_random_read_gbs_before_after=[round(before, 3), round(after, 3)],
                                     disk_bound_s=round(r["bytes_read"] / (gbs * 1e9), 3))
                            r["of_disk_bound"] = round(r["disk_bound_s"] / r["prefill_s"], 3)
                            print(json.dumps(r), flush=True)
                            if a.cgroup:
                                r.update(cgroup_run(model, ids, gib, ctx, experts, chunk, work))
                                print(json.dumps(r), flush=True)
                            results.append(r)
    write_result(a.out, "prefill", results)


if __name__ == "__main__":
    main()
