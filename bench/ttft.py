"""Where a short prompt's first token goes in a fresh process, part by part.

    python -m bench.ttft --model CONVERTED --cap 4 [--rounds 3] [--prompt TEXT]

Each round runs a fresh Python process (as `streamoe run` is one) that times, in order: the imports (MLX and the
engine), `Engine(...)` (manifest checks, plan, tokenizer, non-expert weights, caches, slot pools, and where
everything fits the whole expert preload), the chat template rendered and the prompt encoded, the first
prefill (its first calls compile and warm MLX's kernels), the first token read, and then the same prompt again on
a reset cache (the warm prefill: what the first one spent beyond it is first-call cost). The whole `streamoe run
-n 1` command is also timed from outside, wall clock, for the part the parts leave out (process start, click,
the printing). Medians over the rounds, and every round's parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from .common import write_result

PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain how it works in two sentences."

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import mlx.core as mx
from streamoe.runtime.engine import Engine, Options
t_import = time.perf_counter()
model, cap, ctx, prompt = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
eng = Engine(model, Options(cap_gib=cap, ctx=ctx))
t_open = time.perf_counter()
ids = eng.text.encode(eng.text.chat_prompt([{"role": "user", "content": prompt}]))
t_template = time.perf_counter()
logits = eng.prefill(ids)
mx.eval(logits)
t_prefill = time.perf_counter()
tok = int(mx.argmax(logits).item())
t_token = time.perf_counter()
eng.reset()
t1 = time.perf_counter()
mx.eval(eng.prefill(ids))
warm = time.perf_counter() - t1
eng.close()
print(json.dumps({"prompt_tokens": len(ids), "resident": eng.experts.resident, "import_s": t_import - t0,
                  "open_s": t_open - t_import, "template_s": t_template - t_open, "prefill_s": t_prefill - t_template,
                  "first_token_s": t_token - t0, "prefill_warm_s": warm,
                  "first_call_s": (t_prefill - t_template) - warm}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cap", type=float, default=4.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", default="ttft")
    a = ap.parse_args()
    rounds = []
    for _ in range(a.rounds):
        p = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.cap), str(a.ctx), a.prompt],
                           capture_output=True, text=True, check=True)
        parts = json.loads(p.stdout.strip().splitlines()[-1])
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "streamoe.cli", "run", a.model, "--cap", str(a.cap), "--ctx", str(a.ctx),
                        "-p", a.prompt, "-n", "1", "--temp", "0", "-q"], capture_output=True, text=True, check=True)
        parts["cli_run_n1_wall_s"] = time.perf_counter() - t0
        print(json.dumps(parts), flush=True)
        rounds.append(parts)
    keys = [k for k, v in rounds[0].items() if isinstance(v, float)]
    median = {k: round(statistics.median(r[k] for r in rounds), 4) for k in keys}
    write_result(a.out, "ttft", [{"model": a.model, "cap_gib": a.cap, "ctx": a.ctx, "prompt_tokens": rounds[0]["prompt_tokens"],
                                  "resident": rounds[0]["resident"], "median": median, "rounds": rounds}])


if __name__ == "__main__":
    main()
