"""Decode with a host tier under a discrete GPU's slots (`--host-cap`), against the same `--cap` without one.

    python -m bench.host_tier --model FULLCONV --runs 4,4:24,4:8,8:16 [--tokens 48] [--name host-tier-h200]
        [--profile]   # each run under cProfile too: its 40 costliest functions beside the JSON

A run is CAP or CAP:HOSTCAP in GiB, optionally with environment variables for its process after `+`
(`4:24+MLX_MAX_MB_PER_BUFFER=100000`: the same run with MLX's CUDA graphs cut by operation count only).

Each run is `streamoe run MODEL --cap C [--host-cap H]` in its own process, greedy, inside a memory cgroup whose
limit is the host cap where this machine lets us make one (the kernel's failcnt and peak: the host cap held).
From its --stats: decode tok/s by the tokens' own stamps (as the user sees them), the share of picks found in
the device's memory, read ahead, copied from the host tier, and read from disk; MiB per token from the host tier
and from disk. From its summary line: MLX's peak against --cap and the process's against --host-cap. Where an NVIDIA driver
answers, the device memory it counts as used, polled through the run, less what it counted before: the process's
whole footprint on the device (CUDA context and libraries included), against --cap.

In the same run, three speeds: the disk's (random whole-record O_DIRECT reads, 8 in flight) and the copy of a
record from host memory into its slot (`bench.fill`), through the upload ring and by CUDA's copy engine from
page-locked memory (`runtime/copy_engine.py`), as the engine lands them. The bound of a run is its host-to-device
bytes per token over the speed of the path it copies by (the copy engine's where it has one, unless
`STREAMOE_COPY_ENGINE=0` turns it off, else the ring's) plus its disk bytes per token over the disk speed; a run at the
bound spends nothing but those transfers (compute fully overlapped).

A run whose host cap holds every expert keeps them all in host memory, where the device reads the picks' weights
(the plan's `host_reads`, unless `STREAMOE_HOST_READS=0`): nothing lands in slots, every pick's bytes cross the
bus. Its bound is those bytes per token (`mib_bus_token`) over the copy engine's speed (the bus's best), and over
that of a kernel reading host-mapped memory (`hosted_gbs`, `bench.fill`'s hosted path).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from streamoe.formats.manifest import load_manifest
from streamoe.runtime.nvml import device_memory_used
from streamoe.runtime.store import ExpertStore
from streamoe.runtime.weights import mx_dtype

from .common import write_result
from .fill import disk_gbs, driver_gbs, fill_gbs, hosted_gbs

PROMPT = "import csv\nimport sys\n\n\ndef mean_of_columns(path):\n    "
PEAKS = re.compile(r"peak ([\d.]+) of ([\d.]+) GiB on the device, host ([\d.]+)")


def speeds(model: Path, experts: str, records: int = 256) -> dict:
    m = load_manifest(model)
    store = ExpertStore.open(model, m, experts, io_threads=8, ring=32)
    try:
        rng = random.Random(0)
        n = len(m.expert_formats()[experts].files)
        keys = [(rng.randrange(n), rng.randrange(store.n_experts)) for _ in range(records)]
        disk = disk_gbs(store, keys)
        dtype = mx_dtype("bfloat16" if mx.default_device() == mx.gpu else "float32")
        fill = fill_gbs(store, keys[:64], 4 * records, dtype, direct=False, advise=True)
        engine = driver_gbs(store, keys[:64], 4 * records, dtype, pinned=True)
        hosted = hosted_gbs(store, keys[:32], 4 * records, dtype)
    finally:
        store.close()
    return {"disk_gbs": round(disk, 3), "copy_gbs": fill["fill_gbs"], "copy_path": fill,
            "engine_gbs": engine.get("fill_gbs") if engine.get("bytes_identical") else None, "engine_path": engine,
            "hosted_gbs": hosted["fill_gbs"], "stride": store.lay.stride, "layers": n, "top_k": int(m.model["top_k"])}


class DeviceWatch:
    """The driver's count of used device memory, polled every 20 ms while a run lasts: its peak less the count
    before the run (None without an NVIDIA driver), and every half second (`series`: seconds since the start, GiB
    over the count before), so a run's CUDA context at start, its growth while loading and the first steps' kernel
    modules can be told apart from MLX's own allocations (which `--cap` plans)."""

    def __init__(self):
        self.base, self.peak, self.stop = device_memory_used(), 0, threading.Event()
        self.series: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        t0, n = time.perf_counter(), 0
        while not self.stop.wait(0.02):
            used = device_memory_used() or 0
            self.peak = max(self.peak, used)
            if n % 25 == 0:
                self.series.append((round(time.perf_counter() - t0, 2), round((used - self.base) / 2**30, 3)))
            n += 1

    def __enter__(self):
        if self.base is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.base is not None:
            self.thread.join()

    def gib(self) -> float | None:
        return None if self.base is None else round((self.peak - self.base) / 2**30, 3)


def run_one(model: Path, cap: float, host_cap: float | None, tokens: int, experts: str, work: Path,
            env: dict[str, str] | None = None, profile: Path | None = None) -> dict:
    from tests.conftest import capped_cgroup, cgroup_dir

    stats = work / f"stats-{cap}-{host_cap}.jsonl"
    args = ["run", model, "--cap", cap, "--experts", experts, "--ctx", 1024, "--raw", "-p", PROMPT, "-n", tokens,
            "--temp", 0, "--stats", stats, *(["--host-cap", host_cap] if host_cap else [])]
    py = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else [])]
    cmd = f"exec {shlex.join(map(str, py))} -m streamoe.cli {shlex.join(map(str, args))}"
    failcnt = peak = None
    extra, env = env or {}, {**os.environ, **(env or {})}
    with DeviceWatch() as watch:
        if host_cap and cgroup_dir() is not None:
            with capped_cgroup(host_cap, "host") as (cg, read):
                p = subprocess.run(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && {cmd}"], capture_output=True,
                                   text=True, env=env)
                failcnt, peak = read()
        else:
            p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env)
    out = {"cap_gib": cap, "host_cap_gib": host_cap, "env": extra}
    if p.returncode:
        return {**out, "error": (p.stderr.strip().splitlines() or [f"rc {p.returncode}"])[-1]}
    recs = [json.loads(ln) for ln in stats.read_text().splitlines()]
    dec = [r for r in recs if r["phase"] == "decode" and r["t_token"] is not None]
    lay = [ly for r in dec for ly in r["layers"]]
    picks, n = sum(ly["picks"] for ly in lay), max(1, len(dec))
    share = {k: round(sum(ly[k] for ly in lay) / picks, 4) if picks else None
             for k in ("hits_hot", "hits_lent", "hits_prefetch", "hits_host", "misses")}
    span = dec[-1]["t_token"] - dec[0]["t_token"] if len(dec) > 1 else 0.0
    peaks = PEAKS.search(p.stderr)
    return {**out, "decode_tokens": len(dec), "tok_s": round((len(dec) - 1) / span, 3) if span else None,
            "device_tier_hit": round(share["hits_hot"] + share["hits_lent"], 4) if picks else None,
            "read_ahead": share["hits_prefetch"], "host_tier_hit": share["hits_host"], "disk_miss": share["misses"],
            "picks_token": round(picks / n, 2),
            "mib_host_token": round(sum(ly["bytes_host"] for ly in lay) / n / 2**20, 2),
            "mib_disk_token": round(sum(ly["bytes_read"] for ly in lay) / n / 2**20, 2),
            "device_peak_gib": float(peaks.group(1)) if peaks else None,
            "host_peak_rss_gib": float(peaks.group(3)) if peaks else None,
            "cgroup_peak_gib": round(peak / 2**30, 3) if peak is not None else None, "cgroup_failcnt": failcnt,
            "driver_device_peak_gib": watch.gib(), "driver_device_series_gib": watch.series if watch.base is not None else None,
            # a token's host time by part: fences (compute), the disk, landing records (of which copy threads, sync)
            "ms_token_parts": {k: round(sum(ly.get(k, 0.0) for ly in lay) / n, 2)
                               for k in ("compute_ms", "io_wait_ms", "landing_ms", "copy_wait_ms", "sync_ms")},
            "summary": p.stderr.strip().splitlines()[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--runs", default="4,4:24,4:8,8:16",
                    help="CAP or CAP:HOSTCAP in GiB, each optionally +NAME=VALUE[+...] (its environment), comma-separated")
    ap.add_argument("--profile", action="store_true", help="each run under cProfile too: NAME-profile-K.txt")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--work", type=Path, default=Path("/tmp"))
    ap.add_argument("--name", default="host-tier")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    sp = speeds(a.model, a.experts)
    print(json.dumps(sp), flush=True)
    results = []
    for k, spec in enumerate(a.runs.split(",")):
        caps, *env = spec.split("+")
        cap, _, host = caps.partition(":")
        prof = a.work / f"host-tier-{k}.prof" if a.profile else None
        r = run_one(a.model, float(cap), float(host) if host else None, a.tokens, a.experts, a.work,
                    env=dict(e.split("=", 1) for e in env), profile=prof)
        if prof is not None and prof.exists():
            text = io.StringIO()
            pstats.Stats(str(prof), stream=text).sort_stats("tottime").print_stats(40)
            Path(f"{a.name}-profile-{k}.txt").write_text(f"{spec}\n{r.get('summary')}\n{text.getvalue()}")
        # host reads (the plan's, where the host cap holds every expert): resident, so no picks counted per layer
        reads = r.get("host_cap_gib") and r.get("picks_token") == 0
        if r.get("tok_s") and reads:
            # a resident run keeps no per-layer picks: each token's are top-k of every layer
            r["mib_bus_token"] = round(sp["layers"] * sp["top_k"] * sp["stride"] / 2**20, 2)
            for name in ("hosted", "engine"):
                if sp[f"{name}_gbs"]:
                    bound_s = r["mib_bus_token"] * 2**20 / (sp[f"{name}_gbs"] * 1e9)
                    r[f"bound_tok_s_{name}"], r[f"of_bound_{name}"] = round(1 / bound_s, 3), round(r["tok_s"] * bound_s, 3)
        elif r.get("tok_s"):
            by_engine = sp["engine_gbs"] is not None and r["env"].get(
                "STREAMOE_COPY_ENGINE", os.environ.get("STREAMOE_COPY_ENGINE", "1")) not in ("", "0")
            r["copy_gbs_used"] = sp["engine_gbs"] if by_engine else sp["copy_gbs"]
            bound_s = r["mib_host_token"] * 2**20 / (r["copy_gbs_used"] * 1e9) + r["mib_disk_token"] * 2**20 / (sp["disk_gbs"] * 1e9)
            r["bound_tok_s"] = round(1 / bound_s, 3) if bound_s else None
            r["of_bound"] = round(r["tok_s"] * bound_s, 3) if bound_s else None
        results.append({**r, **sp})
        print(json.dumps({k: v for k, v in r.items() if k not in ("copy_path", "engine_path")}), flush=True)
        base = next((r["tok_s"] for r in results if r.get("host_cap_gib") is None and r.get("tok_s")), None)
        for done in results:
            if base and done.get("tok_s"):
                done["vs_no_host_tier"] = round(done["tok_s"] / base, 3)
        # after every run: a call cut short keeps the runs it finished
        path = write_result(a.name, "host_tier", results, out=Path(a.name + ".json") if "/" in a.name else None)
    print(path)


if __name__ == "__main__":
    main()
