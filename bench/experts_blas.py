"""The routed experts of one prefill block on the CPU backend: `gather_qmm` (each row re-reads its expert's codes)
against `kernels._switch_glu_blas` (each expert dequantized once for its rows, BLAS products), by rows per expert.
Random 4-bit experts of a family's real shapes (default Qwen3.6: 256 experts of 2048 x 512, top-8); where the
BLAS path starts paying is what `kernels.BLAS_ROWS_PER_EXPERT` is set from.

    python -m bench.experts_blas [--experts 256 --hidden 2048 --inter 512 --top-k 8] [--tokens 64,128,192,256]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from bench.common import expert_shape_arguments, random_experts, random_picks, write_result
from streamoe.runtime.models.kernels import ExpertKernel, _switch_glu, _switch_glu_blas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    expert_shape_arguments(ap)
    ap.add_argument("--tokens", default="64,128,192,256")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each path (the fastest counts)")
    ap.add_argument("--name", default="experts-blas-cpu")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    E, H, inter, k = a.experts, a.hidden, a.inter, a.top_k

    w = random_experts(E, H, inter, 4)
    kernel = ExpertKernel(4, 64)
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        x = mx.random.normal((n, H), key=mx.random.key(n))
        picks = random_picks(n, E, k, rng)
        best = {}
        for name, f in (("gather_qmm_s", _switch_glu), ("blas_s", _switch_glu_blas)):
            mx.eval(f(x, w, picks, kernel))
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                mx.eval(f(x, w, picks, kernel))
                times.append(time.perf_counter() - t)
            best[name] = round(min(times), 4)
        rows.append({"tokens": n, "rows_per_expert": n * k / E, **best,
                     "blas_speedup": round(best["gather_qmm_s"] / best["blas_s"], 3)})
        print(rows[-1], flush=True)
    write_result(a.name, "experts_blas", [{"experts": E, "hidden": H, "inter": inter, "top_k": k, "bits": 4,
                                           "device": str(mx.default_device()), "by_tokens": rows}])


if __name__ == "__main__":
    main()
