"""Decode speed as each command reports it: `streamoe run` at a cap against stock mlx-lm resident, each in its own
process, in interleaved rounds.

    python -m bench.run_vs_mlx_lm --ckpt SMALL --model SMALLCONV --cap slots:128 --tokens 200 --rounds 5

streamoe: `streamoe run MODEL --cap C --temp 0 -n N --stats F`, its summary line's tok/s (what the user reads) and
the tokens' own stamps in F (the wall clock: the interval from the first token to the last). mlx-lm: its
`stream_generate` on the checkpoint, greedy, the compute dtype set as streamoe's (float32 on the CPU: MLX's CPU
bf16 kernels are several times slower, so a bf16 mlx-lm would flatter the ratio), the same chat-templated prompt;
its own `generation_tps` and the wall clock of its tokens the same way. The rounds alternate which runs first;
the ratio is the median over rounds of streamoe's tok/s over the mlx-lm run of the same round. `slots:N` is the
smallest cap whose plan holds N hot-tier slots (`bench.gpu_compare.cap_gib_for`: the runtime allowance fixed at
600 MiB, as passed to `streamoe run`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write_result
from bench.gpu_compare import TEXT, cap_gib_for

MLX_LM = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
model, tok = load(sys.argv[1])
if sys.argv[4] != "auto":
    model.set_dtype(getattr(mx, sys.argv[4]))
prompt = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True)
stamps, last = [], None
for r in stream_generate(model, tok, prompt, max_tokens=int(sys.argv[3]), sampler=make_sampler(0.0)):
    stamps.append(time.perf_counter())
    last = r
print(json.dumps({"tokens": last.generation_tokens, "printed_tok_s": last.generation_tps,
                  "wall_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""

SUMMARY = re.compile(r"\[(\d+) tokens, ([0-9.]+) tok/s")


def mlx_lm_run(ckpt: Path, tokens: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MLX_LM, str(ckpt), TEXT, str(tokens), dtype], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def streamoe_run(model: Path, cap_gib: float, experts: str, tokens: int, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.jsonl"
        cmd = [sys.executable, "-m", "streamoe.cli", "run", str(model), "--cap", f"{cap_gib:.6f}", "--ctx", "2048",
               "--runtime-mib", "600", "--experts", experts, "--temp", "0", "-n", str(tokens), "-p", TEXT, "--stats", str(stats)]
        if dtype != "auto":
            cmd += ["--dtype", dtype]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        m = SUMMARY.search(out.stderr)
        if m is None:
            raise SystemExit(f"no summary line in streamoe run's output: {out.stderr[-500:]}")
        steps = [json.loads(line) for line in stats.read_text().splitlines() if line.strip()]
    stamps = [s["t_token"] for s in steps if s.get("t_token") is not None]
    return {"tokens": int(m.group(1)), "printed_tok_s": float(m.group(2)),
            "wall_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "command_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="the checkpoint mlx-lm loads")
    ap.add_argument("--model", type=Path, required=True, help="its streamoe conversion")
    ap.add_argument("--cap", default="slots:128", help="GiB, or slots:N")
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--dtype", default="float32", help="both engines' compute dtype (auto: each one's default)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="run-vs-mlx-lm")
    a = ap.parse_args()
    cap = cap_gib_for(a.model, a.cap, a.experts, None if a.dtype == "auto" else a.dtype)
    rounds = []
    for r in range(a.rounds):
        order = ["mlx_lm", "streamoe"] if r % 2 == 0 else ["streamoe", "mlx_lm"]
        got = {}
        for who in order:
            got[who] = (mlx_lm_run(a.ckpt, a.tokens, a.dtype) if who == "mlx_lm"
                        else streamoe_run(a.model, cap, a.experts, a.tokens, a.dtype))
        got["printed_ratio"] = round(got["streamoe"]["printed_tok_s"] / got["mlx_lm"]["printed_tok_s"], 3)
        got["wall_ratio"] = round(got["streamoe"]["wall_tok_s"] / got["mlx_lm"]["wall_tok_s"], 3)
        print(json.dumps(got), flush=True)
        rounds.append(got)
    result = {"cap": a.cap, "cap_gib": round(cap, 4), "dtype": a.dtype, "tokens": a.tokens, "rounds": rounds,
              "printed_ratio_median": float(np.median([g["printed_ratio"] for g in rounds])),
              "wall_ratio_median": float(np.median([g["wall_ratio"] for g in rounds]))}
    write_result(a.name, "run_vs_mlx_lm", [result])


if __name__ == "__main__":
    main()
