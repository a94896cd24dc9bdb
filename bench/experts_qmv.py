"""A decode step's routed experts one warp an output row (`kernels.gather_qmv`, a gather mat-vec) against MLX's
`gather_qmm`, which CUDA runs as its `qmm_sm80` GEMM kernel: 28.4 us a gate or up call for 8 picks of Qwen3.6 on an
H100, 32 blocks for 132 SMs, about 5 % of the memory's speed (`bench/gpu_kernels.py`, docs/performance.md).

    python -m bench.experts_qmv --out R.json     # on a GPU (CUDA); Qwen3.6's shapes by default

For each projection shape (gate/up: N = 512 rows of K = 2048; down: N = 2048 of K = 512) and affine 4-bit experts
in a pool of 256 slots, 8 picks of one token: the kernel's result against `gather_qmm`'s (largest difference,
relative to the largest value; the sums run in another order, so not the same bits), each one's difference from
the float32 product of the dequantized weights, and each one's device time a call (n calls built, then evaluated
at once, divided by n: where the host builds a call slower than the device runs it, the host's time). `gate_up`
also times one kernel computing both projections of a pick (one launch for two). `dense`: one token through a dense
4-bit matrix (Qwen3.6's LM head, a Gated DeltaNet's input projection, an attention output), the kernel against
`quantized_matmul`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from streamoe.runtime.models.kernels import gather_qmv


def device_ms(f, n: int = 100) -> float:
    mx.eval(f())
    t = time.perf_counter()
    mx.eval([f() for _ in range(n)])
    return (time.perf_counter() - t) / n * 1e3


def measure(mats: list, slots: mx.array, picks: int, per_pick: bool, threads: list[int]) -> dict:
    """One projection shape: the kernel against `gather_qmm` (x one row for every pick, or one row a pick)."""
    n, k = mats[0][0].shape[1], mats[0][0].shape[2] * 8
    x = mx.random.normal((picks if per_pick else 1, k)).astype(mx.bfloat16)
    rows = mx.arange(picks).astype(mx.uint32) if per_pick else mx.zeros((picks,), mx.uint32)
    mx.eval(mats, x, rows, slots)
    xe = x[:, None, None, :] if per_pick else x[None, None, None, :]  # [P, 1, 1, K] / [1, 1, 1, K]
    rhs = slots[:, None] if per_pick else slots[None, :]

    def ref():
        return [mx.gather_qmm(xe, *m, rhs_indices=rhs, transpose=True, group_size=64, bits=4) for m in mats]

    f32 = mx.float32
    exact = [(mx.dequantize(w[slots], s[slots].astype(f32), b[slots].astype(f32), group_size=64, bits=4)
              @ x[rows].astype(f32)[:, :, None])[..., 0] for w, s, b in mats]  # [P, N], float32 throughout

    def off(got: list[mx.array]) -> float:  # the largest difference from the float32 product, over its largest value
        return max(float(mx.abs(g.astype(f32) - e).max() / mx.abs(e).max()) for g, e in zip(got, exact, strict=True))

    theirs = [r.reshape(picks, n) for r in ref()]
    row = {"N": n, "K": k, "gather_qmm_ms": round(device_ms(ref), 4), "gather_qmm_off": off(theirs)}
    for t in threads:
        got = gather_qmv(x, rows, slots, mats, 64, threads=t)
        row[f"qmv_{t}"] = {"ms": round(device_ms(lambda t=t: gather_qmv(x, rows, slots, mats, 64, threads=t)), 4),
                           "off": off(list(got)),
                           "from_gather_qmm": max(float(mx.abs(g.astype(f32) - h.astype(f32)).max()
                                                       / mx.abs(h.astype(f32)).max()) for g, h in zip(list(got), theirs, strict=True))}
        if len(mats) == 2:  # one launch per matrix, as gather_qmm has
            row[f"qmv_{t}_apart_ms"] = round(device_ms(
                lambda t=t: [gather_qmv(x, rows, slots, [m], 64, threads=t) for m in mats]), 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--picks", type=int, default=8)
    ap.add_argument("--threads", default="256,128", help="block sizes to try")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from bench.common import machine

    mx.random.seed(0)
    dt = mx.bfloat16
    res = {"machine": machine(), "picks": a.picks, "slots": a.slots, "shapes": {}}
    slots = mx.random.randint(0, a.slots, (a.picks,)).astype(mx.uint32)

    def experts(n, k):
        return mx.quantize((mx.random.normal((a.slots, n, k)) * 0.02).astype(dt), group_size=64, bits=4)

    for name, n, k, per_pick in (("gate_up", a.inter, a.hidden, False), ("down", a.hidden, a.inter, True)):
        mats = [experts(n, k) for _ in range(2 if name == "gate_up" else 1)]
        res["shapes"][name] = row = measure(mats, slots, a.picks, per_pick, [int(v) for v in a.threads.split(",")])
        print(name, json.dumps(row), flush=True)
    res["dense"] = {}
    for name, n, k in (("lm_head", 248320, a.hidden), ("gdn_in_proj", 12288, a.hidden), ("o_proj", a.hidden, 4096)):
        w = mx.quantize((mx.random.normal((n, k)) * 0.02).astype(dt), group_size=64, bits=4)
        x = mx.random.normal((1, k)).astype(dt)
        zero = mx.zeros((1,), mx.uint32)
        mx.eval(w, x, zero)
        ours = gather_qmv(x, zero, zero, [tuple(t[None] for t in w)], 64)[0]
        theirs = mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
        f32 = mx.float32
        res["dense"][name] = row = {
            "N": n, "K": k,
            "quantized_matmul_ms": round(device_ms(lambda w=w, x=x: mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)), 4),
            "qmv_ms": round(device_ms(lambda w=w, x=x, z=zero: gather_qmv(x, z, z, [tuple(t[None] for t in w)], 64)), 4),
            "from_quantized_matmul": float(mx.abs(ours.astype(f32) - theirs.astype(f32)).max() / mx.abs(theirs.astype(f32)).max())}
        print(name, json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
