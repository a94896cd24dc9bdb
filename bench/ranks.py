"""Expert parallelism on one machine: `streamoe run` alone and under `mlx.launch --backend ring -n N`, at the
same per-host cap. Reports, per group size: decode tok/s (rank 0's, as tokens reached stdout), each rank's MiB
read per decode token and hit rate (from rank 0's --stats, which holds every rank's records), whether the
logits equal one host's bit for bit, and the collective measured apart: one `all_gather` of a decode token's
[1, k, H] exchange and of a prefill block's [256, k, H], the per-layer cost a link adds.

    python -m bench.ranks --size small --ranks 1,2,4
    python -m bench.ranks --model /var/tmp/streamoe-bench/small-conv --cap 0.31 --ranks 1,2

On one machine the ranks share its cores (and the ring runs over loopback), so tok/s across ranks says what
the exchange and the extra processes cost here, not what two machines would reach.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import scratch_dir, write_result

PROMPT = "The quick brown fox"
LAUNCH = Path(sys.executable).parent / "mlx.launch"


def free_port(n: int) -> int:
    """A port p with p .. p + n - 1 free now (the ring's ranks listen on them)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {n} adjacent free ports")


def launched(n: int, command: list[str]) -> list[str]:
    if n == 1:
        return command
    return [str(LAUNCH), "--backend", "ring", "-n", str(n), "-p", str(free_port(n)), "--", *command]


def collective(tokens: int, k: int, hidden: int, calls: int) -> None:
    """Run under mlx.launch: ms per all_gather of a [tokens, k, H] float32 exchange (median of `calls`)."""
    import mlx.core as mx

    g = mx.distributed.init()
    y = mx.ones((1, tokens, k, hidden), dtype=mx.float32)
    times = []
    for i in range(calls + 10):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_gather(y * (i + 1), group=g))
        if i >= 10:
            times.append(1000 * (time.perf_counter() - t))
    if g.rank() == 0:
        print(json.dumps({"tokens": tokens, "ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90))}))


def run_once(model: Path, n: int, cap: float, tokens: int, work: Path) -> dict:
    stats, logits = work / f"stats-{n}.jsonl", work / f"logits-{n}.npz"
    cmd = [sys.executable, "-m", "streamoe.cli", "run", str(model), "--cap", f"{cap:.4f}", "--ctx", "512",
           "--runtime-mib", "200", "-p", PROMPT, "-n", str(tokens), "--seed", "3", "--stats", str(stats),
           "--logits-out", str(logits)]  # one seed: the ranks' logits compared with one host's
    p = subprocess.run(launched(n, cmd), capture_output=True, text=True, timeout=900)
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("[")), "")
    if not line:
        raise SystemExit(f"{n} rank(s) failed:\n{p.stderr[-2000:]}")
    records = [json.loads(ln) for ln in stats.read_text().splitlines()]
    per_rank = []
    for r in range(n):
        decode = [s for s in records if s.get("rank", 0) == r and s["phase"] == "decode"]
        picks = sum(ly["picks"] for s in decode for ly in s["layers"])
        hits = sum(ly["hits_hot"] + ly["hits_lent"] for s in decode for ly in s["layers"])
        per_rank.append({"rank": r, "mib_read_token": sum(s["bytes_read"] for s in decode) / len(decode) / 2**20,
                         "hit_rate": hits / picks if picks else 1.0,
                         "layers_with_no_pick": sum(ly["picks"] == 0 for s in decode for ly in s["layers"])})
    made = int(re.search(r"\[(\d+) tokens", line).group(1))  # fewer than asked where the model ended its answer
    return {"ranks": n, "cap_gib": cap, "tokens_asked": tokens, "tokens": made,
            "tok_s": float(re.search(r"([\d.]+) tok/s", line).group(1)), "per_rank": per_rank,
            "summary": line, "logits": np.load(logits)["logits"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="a converted directory (default: synthesize --size)")
    ap.add_argument("--size", default="small")
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--cap", type=float, default=None, help="GiB per host (default: 100 slots over the largest fixed accounts)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--collective", nargs=3, type=int, metavar=("TOKENS", "K", "H"), help=argparse.SUPPRESS)
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    if a.collective:
        collective(*a.collective, a.calls)
        return
    from streamoe.formats.config import ModelArgs
    from streamoe.formats.manifest import load_manifest
    from streamoe.runtime.plan import Options, plan_for

    sizes = [int(x) for x in a.ranks.split(",")]
    with scratch_dir(a.scratch) as work:
        model = a.model
        if model is None:
            model = work / f"{a.size}-conv"
            if not (model / "manifest.json").exists():
                subprocess.run([sys.executable, "-m", "streamoe.cli", "synth", str(work / f"{a.size}-ckpt"), "--size", a.size,
                                "--seed", "1"], check=True, capture_output=True)
                subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(work / f"{a.size}-ckpt"), str(model),
                                "--experts", "q4"], check=True, capture_output=True)
        m = load_manifest(model)
        args = ModelArgs.from_config(m.config, model / "manifest.json")
        fixed = max(plan_for(model, Options(cap_gib=8, ctx=512, runtime_bytes=200 << 20, rank=0, ranks=n)).fixed
                    for n in sizes)
        slot = plan_for(model, Options(cap_gib=8, ctx=512, runtime_bytes=200 << 20)).slot_bytes
        cap = a.cap or (fixed + 100 * slot) / 2**30  # every group size's hot tier: at least 100 slots
        results, base = [], None
        for n in sizes:
            r = run_once(model, n, cap, a.tokens, work)
            logits = r.pop("logits")
            base = logits if base is None and n == 1 else base
            r["logits_equal_to_one_host"] = None if base is None else bool(logits.tobytes() == base.tobytes())
            if n > 1:
                ex = {}
                for name, t in (("decode_token", 1), ("prefill_block", 256)):
                    cmd = [sys.executable, "-m", "bench.ranks", "--calls", str(a.calls), "--collective", str(t),
                           str(args.num_experts_per_tok), str(args.hidden_size)]
                    p = subprocess.run(launched(n, cmd), capture_output=True, text=True, timeout=600)
                    ex[name] = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))
                r["all_gather_per_layer"] = ex
            results.append(r)
            print(json.dumps(r), flush=True)
        write_result(a.name or f"ranks-{a.size if a.model is None else model.name}", "ranks", results)


if __name__ == "__main__":
    main()
