"""The routed experts of one prefill step on the device: `gather_qmm` over one batch per (token, pick), the
per-pair path (MLX's CUDA kernel then runs a one-row GEMM per pair, each re-reading its expert's codes), against
the same pairs grouped by expert, `rows` to a `gather_qmm` batch (each expert's codes read once per batch), grouped
on the host (exactly as many batches as needed) or on the device (`kernels.group_by_expert`: a fixed number of
batches, no host round trip; the engine's path on CUDA). Random experts of a family's real shapes (default
Qwen3.6: 256 experts of 2048 x 512, top-8), 4- and 3-bit affine or gpt-oss's MXFP4 with biases, random picks. Each
variant's largest difference from the per-pair path is reported, and whether its rows are bit-identical to it.

    python -m bench.experts_grouped [--tokens 256,1024] [--formats q4,q3,mxfp4] [--rows 8,16,32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from bench.common import expert_shape_arguments, random_experts, random_picks, write_result
from streamoe.formats.record import ExpertWeights
from streamoe.runtime.models import kernels


def host_groups(inds: np.ndarray, rows: int) -> tuple[mx.array, mx.array, mx.array]:
    """(each batch's expert [G], each batch row's token [G * rows], each pair's batch row [T * k]), as few batches as
    the picks need, padded with token 0."""
    flat = inds.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, src, back = [], [], np.empty(flat.size, dtype=np.uint32)
    for e in np.unique(flat):
        pairs = order[flat[order] == e]
        for a in range(0, pairs.size, rows):
            part = pairs[a:a + rows]
            back[part] = len(src) + np.arange(part.size)
            experts.append(e)
            src.extend(list(part // inds.shape[-1]) + [0] * (rows - part.size))
    return (mx.array(np.array(experts, dtype=np.uint32)), mx.array(np.array(src, dtype=np.uint32)), mx.array(back))


def timed(f, repeats: int) -> float:
    mx.eval(f())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(f())
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 3)


def measure(x: mx.array, w: ExpertWeights, inds: mx.array, kernel: kernels.ExpertKernel, n_experts: int, rows: str,
            repeats: int) -> dict:
    ref = kernels._switch_glu(x, w, inds, kernel)
    row = {"per_pick_ms": timed(lambda: kernels._switch_glu(x, w, inds, kernel), repeats)}
    for r in (int(v) for v in rows.split(",")):
        def by_host(r=r):
            return host_groups(np.array(inds), r)

        def on_device(r=r):
            return kernels.group_by_expert(inds, r, n_experts)

        for name, make in ((f"host_rows{r}", by_host), (f"device_rows{r}", on_device)):
            groups = make()
            mx.eval(groups)
            y = kernels.in_batches(x, w, groups, kernel)
            row[f"{name}_ms"] = timed(lambda groups=groups: kernels.in_batches(x, w, groups, kernel), repeats)
            row[f"{name}_with_grouping_ms"] = timed(lambda make=make: kernels.in_batches(x, w, make(), kernel), repeats)
            row[f"{name}_batches"] = groups[0].size
            row[f"{name}_max_abs_diff"] = mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            row[f"{name}_bit_identical"] = bool(mx.array_equal(y, ref).item())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    expert_shape_arguments(ap)
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--formats", default="q4,q3", help="q4, q3 (affine, group 64), mxfp4 (gpt-oss's, with biases)")
    ap.add_argument("--rows", default="8,16,32")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each variant (the fastest counts)")
    ap.add_argument("--name", default="experts-grouped")
    a = ap.parse_args()
    E, H, inter, k, dt = a.experts, a.hidden, a.inter, a.top_k, getattr(mx, a.dtype)
    rng = np.random.default_rng(0)
    out = []
    for fmt in a.formats.split(","):
        mode, bits = ("mxfp4", 4) if fmt == "mxfp4" else ("affine", int(fmt[1:]))
        w = random_experts(E, H, inter, bits, dt, mode)
        act = kernels.clamped_swiglu(1.702, 7.0) if mode == "mxfp4" else kernels.swiglu
        kernel = kernels.ExpertKernel(bits, 32 if mode == "mxfp4" else 64, mode, act)
        for n in (int(t) for t in a.tokens.split(",")):
            x = (mx.random.normal((n, H), key=mx.random.key(n)) * 0.5).astype(dt)
            inds = random_picks(n, E, k, rng)
            row = {"format": fmt, "bits": bits, "tokens": n, **measure(x, w, inds, kernel, E, a.rows, a.repeats)}
            print(row, flush=True)
            out.append(row)
    write_result(a.name, "experts_grouped", [{"experts": E, "hidden": H, "inter": inter, "top_k": k,
                                              "dtype": a.dtype, "device": str(mx.default_device()), "runs": out}])


if __name__ == "__main__":
    main()
