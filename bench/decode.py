"""Decode benchmark: a sweep of caps (and tier / prefetch settings) on one converted model.

Each configuration runs `streamoe run` in its own process (inside a cgroup-v1 memory cgroup when one is
available, so peak memory is what the kernel charged, page cache included) and writes --stats; from the
telemetry we report decode tok/s, ms/token split (compute / I/O wait / other), MiB read per token, hit
rate by tier, prefetch accuracy, and the hit rate of Belady's optimum on the same routing trace with the
same number of slots. The raw O_DIRECT read speed of the layer files is measured in the same run.

    python -m bench.decode --model /var/tmp/streamoe-bench/full-conv --caps 3,4,6,resident --tokens 24
    python -m bench.decode --size small            # synthesizes + converts a small model in --scratch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import drop_files, raw_read_gbs, scratch_dir, write_result

RAW_PROMPT = "import csv\nimport sys\n\n\ndef mean_of_columns(path):\n    "  # a trained model continues this for many tokens
PROMPT = ("Write a Python function that parses a CSV file, computes the mean of every numeric column, "
          "and prints a short report. Explain each step.")


def cgroup_base() -> Path | None:
    try:
        own = next(ln.split(":")[2].strip() for ln in open("/proc/self/cgroup") if ln.split(":")[1] == "memory")
    except (OSError, StopIteration):
        return None
    b = Path("/sys/fs/cgroup/memory") / own.lstrip("/")
    return b if (b / "memory.limit_in_bytes").exists() and os.access(b, os.W_OK) else None


def belady_hits(trace: list[tuple[int, int]], slots: int, start: int = 0) -> int:
    """Hits at positions >= start of the offline-optimal cache (evict the entry used farthest in the future)
    with `slots` entries; the positions before `start` (the prompt) only warm it."""
    nxt = [0] * len(trace)
    last: dict = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = last.get(trace[i], 1 << 60)
        last[trace[i]] = i
    cache: dict = {}  # key -> next use
    hits = 0
    for i, k in enumerate(trace):
        if k in cache:
            hits += i >= start
        elif slots > 0 and len(cache) >= slots:
            del cache[max(cache, key=cache.get)]
        if slots > 0:
            cache[k] = nxt[i]
    return hits


def run_one(model: Path, cap: float, tokens: int, extra: list[str], tag: str, scratch: Path, raw: bool = False) -> dict:
    stats = scratch / f"stats-{tag}.jsonl"
    prompt = ["--raw", "-p", RAW_PROMPT] if raw else ["-p", PROMPT, "--no-think"]
    cmd = [sys.executable, "-m", "streamoe.cli", "run", str(model), "--cap", str(cap), "--temp", "0", "-n", str(tokens), *prompt,
           "--stats", str(stats), "-q", *extra]
    base, peak = cgroup_base(), None
    if base is not None:
        cg = base / f"streamoe_bench_{os.getpid()}"
        cg.mkdir(exist_ok=True)
        try:
            (cg / "memory.limit_in_bytes").write_text(str(int(cap * 2**30)))
            p = subprocess.run(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec \"$@\"", "sh", *cmd], capture_output=True, text=True)
            peak = int((cg / "memory.max_usage_in_bytes").read_text())
            failcnt = int((cg / "memory.failcnt").read_text())
        finally:
            try:
                (cg / "memory.force_empty").write_text("1")
            except OSError:
                pass
            cg.rmdir()
    else:
        p = subprocess.run(cmd, capture_output=True, text=True)
        failcnt = None
    if p.returncode:
        return {"tag": tag, "cap_gib": cap, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}"}
    recs = [json.loads(ln) for ln in stats.read_text().splitlines()]
    dec = [r for r in recs if r["phase"] == "decode"]
    n = max(1, len(dec))
    lay = [ly for r in dec for ly in r["layers"]]
    picks = sum(ly["picks"] for ly in lay)
    issued = sum(ly["prefetch_issued"] for ly in lay)
    trace = [(ly["layer"], e) for r in dec for ly in r["layers"] for e in ly["experts"]]
    ms = sum(r["ms"] for r in dec)
    comp = sum(ly["compute_ms"] for ly in lay)
    io = sum(ly["io_wait_ms"] for ly in lay)
    missed = sum(ly["misses"] for ly in lay)
    return {
        "tag": tag, "cap_gib": cap, "args": extra, "decode_tokens": len(dec), "tok_s": round(1000 * len(dec) / ms, 3) if ms else 0,
        "ms_token": round(ms / n, 2), "compute_ms": round(comp / n, 2), "io_wait_ms": round(io / n, 2),
        "other_ms": round((ms - comp - io) / n, 2), "mib_read_token": round(sum(ly["bytes_read"] for ly in lay) / n / 2**20, 2),
        "misses_token": round(missed / n, 2),
        "hit_rate": round(1 - missed / picks, 4) if picks else None,
        "hit_hot": round(sum(ly["hits_hot"] for ly in lay) / picks, 4) if picks else None,
        "hit_lent": round(sum(ly["hits_lent"] for ly in lay) / picks, 4) if picks else None,
        "hit_prefetch": round(sum(ly["hits_prefetch"] for ly in lay) / picks, 4) if picks else None,
        "prefetch_issued_token": round(issued / n, 2),
        "prefetch_accuracy": round(sum(ly["hits_prefetch"] for ly in lay) / issued, 4) if issued else None,
        "prefill_tokens": sum(r["n_tokens"] for r in recs if r["phase"] == "prefill"),
        "prefill_s": round(sum(r["ms"] for r in recs if r["phase"] == "prefill") / 1000, 2),
        "peak_cgroup_gib": round(peak / 2**30, 3) if peak else None, "cgroup_failcnt": failcnt,
        "_trace": trace, "_warm": [(ly["layer"], e) for r in recs if r["phase"] == "prefill" for ly in r["layers"] for e in ly["experts"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="converted directory")
    ap.add_argument("--size", choices=["small", "full"], default="small", help="without --model: synth + convert this size")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory (default: a fresh temporary one)")
    ap.add_argument("--caps", default=None, help="comma list of GiB, 'resident' = everything in RAM")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--variants", action="store_true", help="also tier lru and prefetch 0 at each cap")
    ap.add_argument("--runtime-mib", type=int, default=300,
                    help="the interpreter allowance, fixed for the plans and the runs alike (so the caps they compute agree)")
    ap.add_argument("--raw", action="store_true", help="continue a code prompt without the chat template (the trained "
                    "tiny model answers a chat prompt in a few tokens; Belady needs a long trace)")
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        sweep(a, scratch)


def sweep(a: argparse.Namespace, scratch: Path) -> None:
    """Every configuration of the sweep, its runs' files in `scratch`; the result goes to bench/results."""
    model = a.model
    if model is None:
        ck, model = scratch / f"{a.size}-ckpt", scratch / f"{a.size}-conv"
        if not ck.exists():
            subprocess.run([sys.executable, "-m", "streamoe.cli", "synth", str(ck), "--size", a.size], check=True)
        ok = subprocess.run([sys.executable, "-m", "streamoe.cli", "validate", str(model)], capture_output=True).returncode == 0
        if not ok:  # absent, or written by an older streamoe: convert again
            subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(ck), str(model), "--experts", "q4,q3",
                            "--force"], check=True)

    def plan(cap: float) -> dict:  # asked of a fresh process, which measures the same runtime allowance a run does
        p = subprocess.run([sys.executable, "-m", "streamoe.cli", "plan", str(model), "--cap", str(cap), "--ctx", str(a.ctx),
                            "--experts", a.experts, "--runtime-mib", str(a.runtime_mib), "--json"], capture_output=True, text=True)
        return json.loads(p.stdout)

    full = plan(512)
    top_k = json.loads((model / "manifest.json").read_text())["model"]["top_k"]
    n_exp_total, slot, stride = full["n_layers"] * full["n_experts"], full["slot"], full["stride"]
    if a.caps is None:  # fractions of the experts held, for a model of any size
        caps = [round((full["fixed"] + f * n_exp_total * slot) / 2**30 + 0.002, 3) for f in (0.05, 0.2, 0.5)] + ["resident"]
    else:
        caps = [c if c == "resident" else float(c) for c in a.caps.split(",")]
    layer_files = sorted((model / "experts" / a.experts).glob("layer-*.bin"))
    drop_files(layer_files)
    raw = raw_read_gbs(layer_files, limit_bytes=2 << 30)
    results = []
    for cap in caps:
        c = round((full["fixed"] + n_exp_total * slot) / 2**30 + 0.05, 3) if cap == "resident" else cap
        variants = [("freq-pf6", [])]
        if a.variants and cap != "resident":
            variants += [("lru-pf6", ["--tier", "lru"]), ("freq-pf0", ["--prefetch-width", "0"])]
        for name, extra in variants:
            r = run_one(model, c, a.tokens, ["--experts", a.experts, "--ctx", str(a.ctx), "--runtime-mib", str(a.runtime_mib), *extra], f"{cap}-{name}", scratch, a.raw)
            warm, trace = r.pop("_warm", []), r.pop("_trace", [])
            if "error" not in r:
                pl = plan(c)
                tier_scratch = min(pl["staging_slots"], 3 * top_k)  # the tier's scratch ring: 2 x top-k + the default width (top-k)
                slots = pl["hot_slots"] + pl["staging_slots"] - tier_scratch
                r["hot_slots"], r["tier_slots"] = pl["hot_slots"], slots
                if trace:
                    r["belady_hit_rate"] = round(belady_hits(warm + trace, slots, start=len(warm)) / len(trace), 4)
                    if r["belady_hit_rate"] and r["hit_hot"] is not None:  # already in memory, read ahead not counted
                        r["of_belady"] = round((r["hit_hot"] + r["hit_lent"]) / r["belady_hit_rate"], 3)
                r["raw_read_gbs"] = round(raw, 3)
                r["io_wait_bound_ms"] = round(0.5 * r["misses_token"] * stride / (raw * 1e9) * 1000, 2)
            r["resident"] = cap == "resident"
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    write_result(a.name or f"decode-{model.name}-{a.experts}", "decode", results)


if __name__ == "__main__":
    main()
