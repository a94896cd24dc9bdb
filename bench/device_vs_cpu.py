"""A family's tiny synthetic checkpoint through the engine on the GPU, each MLX kernel call the models make
(`mx.fast.*`, the quantized matmuls) replayed on the CPU with copies of the same inputs: the first call whose
GPU output is not finite where the CPU's is, or differs beyond a tolerance, names the kernel and its inputs
(saved as .npz beside the JSON), so a backend's wrong result is pinned to one operation with a reproducer.

Runs the prefill and a few greedy steps, a few times each way (a race shows in some runs only): compiled chains
on, off (`mx.disable_compile`: a wrong result that goes away there is a compiled chain's), and off with every
kernel call replayed (calls inside a compiled chain are traced, not run). Each run also compares every weight
array the engine loaded with the CPU backend's load of the same file.

    python -m bench.device_vs_cpu --family gpt_oss --dtype float32 --name device-vs-cpu-gpt-oss  # on the H200
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import write_result
from streamoe.convert.convert import convert
from streamoe.convert.synth import synth
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.models.kernels import quantized_matmul, weight_arrays

VARIANT = {"qwen3_5_moe": "qwen3.6", "qwen3_moe": "qwen3", "gpt_oss": "mxfp4-q8"}
KERNELS = [(mx.fast, "rms_norm"), (mx.fast, "rope"), (mx.fast, "scaled_dot_product_attention"),
           (mx.fast, "gated_delta_update"), (mx, "gather_qmm"), (mx, "quantized_matmul"), (mx, "matmul")]
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox around the yard."


def to_cpu(a):
    """A host copy of an MLX array (bf16 through its bits: numpy has none), or the value itself."""
    if not isinstance(a, mx.array):
        return a
    if a.dtype == mx.bfloat16:
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def as_f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


class Replay:
    """Wraps the KERNELS: each call evaluated on the default (GPU) stream, then on the CPU from host copies."""

    def __init__(self, out: Path, rtol: float):
        self.out, self.rtol, self.calls, self.first_bad, self.saved = out, rtol, 0, None, None
        self.originals = [(mod, name, getattr(mod, name)) for mod, name in KERNELS if hasattr(mod, name)]

    def __enter__(self):
        for mod, name, fn in self.originals:
            setattr(mod, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in self.originals:
            setattr(mod, name, fn)

    def _wrap(self, name: str, fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            try:
                mx.eval(out)
            except Exception:  # a traced call inside a compiled chain: nothing to compare
                return out
            self.calls += 1
            if self.first_bad is None:
                cargs = [to_cpu(a) for a in args]
                ckw = {k: to_cpu(v) for k, v in kw.items() if k != "stream"}
                ref = fn(*cargs, **ckw, stream=mx.cpu)
                self._compare(name, out, ref, args, kw)
            return out
        return call

    def _compare(self, name, out, ref, args, kw) -> None:
        outs, refs = (out, ref) if isinstance(out, (list, tuple)) else ((out,), (ref,))
        for o, r in zip(outs, refs, strict=True):
            g, c = as_f32(o), as_f32(r)
            bad_nan = bool(not np.isfinite(g).all() and np.isfinite(c).all())
            diff = float(np.abs(g - c).max()) if g.size else 0.0  # NaN where the GPU's is not finite
            scale = float(np.abs(c).max()) if c.size else 0.0
            if bad_nan or diff > self.rtol * max(scale, 1e-6):
                self.first_bad = {"call": self.calls, "kernel": name, "nonfinite_on_gpu": bad_nan,
                                  "max_abs_diff": diff if np.isfinite(diff) else None, "cpu_max_abs": scale,
                                  "inputs": [f"{a.dtype} {tuple(a.shape)}" if isinstance(a, mx.array) else repr(a)
                                             for a in args] + [f"{k}={v!r}" if not isinstance(v, mx.array)
                                                               else f"{k}: {v.dtype} {tuple(v.shape)}"
                                                               for k, v in kw.items()]}
                arrays = {f"arg{i}": host_array(a) for i, a in enumerate(args) if isinstance(a, mx.array)}
                arrays |= {k: host_array(v) for k, v in kw.items() if isinstance(v, mx.array)}
                self.saved = self.out.with_suffix(".npz")
                np.savez(self.saved, **arrays)
                return


def host_array(a: mx.array) -> np.ndarray:
    """An input as saved for the reproducer: its own dtype (packed codes stay uint32), bf16 as its uint16 bits."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


QMM_CASES = [  # (dtype, bits, mode, K, M): real models' K (above a group: MLX's qmm_sm80 at M >= 8) first, then the
    # tiny test models' K = 64 (one group: qmm_sm90, found wrong on the H200), mlx's call and streamoe's
    (dt, bits, mode, k, m)
    for k in (2048, 2880, 64) for dt in (mx.bfloat16, mx.float16, mx.float32)
    for bits, mode in ((4, "affine"), (4, "mxfp4"), (8, "affine")) for m in (16, 33, 1)
    if not (mode == "mxfp4" and dt == mx.float32)]


def qmm_case(dtype: mx.Dtype, bits: int, mode: str, k: int, m: int, reruns: int, seed: int,
             through: str = "mlx") -> dict:
    """One quantized matmul shape on random inputs: the GPU's output against the CPU's (finite, within a
    tolerance), and the same GPU call `reruns` times on the same inputs (a kernel race shows as several distinct
    outputs; MLX's qmm_sm80 kernel, used for M >= 8 on an H200 where K is larger than a group, writes its output
    tile over shared memory that asynchronous copies may still fill, in MLX's source as of 2026-08). `through`:
    `mlx` calls `mx.quantized_matmul`, `streamoe` the kernel library's `quantized_matmul` (affine only)."""
    key = mx.random.key(seed)
    gs = 32 if mode == "mxfp4" else 64
    w = mx.random.normal((256, k), key=key, stream=mx.cpu) / k**0.5
    q = mx.quantize(w, group_size=gs, bits=bits, mode=mode, stream=mx.cpu)
    wq, sc, bi = q[0], q[1], (q[2] if len(q) > 2 else None)
    x = mx.random.normal((1, m, k), key=mx.random.split(key)[0], stream=mx.cpu).astype(dtype)
    if mode == "affine":
        sc, bi = sc.astype(dtype), bi.astype(dtype)
    kw = {"transpose": True, "group_size": gs, "bits": bits, "mode": mode}
    ref = mx.quantized_matmul(x, wq, sc, bi, **kw, stream=mx.cpu)
    args = [to_cpu(a) if a is not None else None for a in (x, wq, sc, bi)]
    outs = []
    for _ in range(max(1, reruns)):
        out = (mx.quantized_matmul(*args, **kw) if through == "mlx"
               else quantized_matmul(*args, group_size=gs, bits=bits))
        mx.eval(out)
        outs.append(as_f32(out))
    g, c = outs[0], as_f32(ref)
    tol = (1e-4 if dtype == mx.float32 else 2e-2) * max(float(np.abs(c).max()), 1e-6)
    diff = float(np.abs(g - c).max()) if np.isfinite(g).all() else None
    return {"through": through, "dtype": str(dtype), "bits": bits, "mode": mode, "K": k, "M": m, "N": 256,
            "nonfinite_on_gpu": int(sum((~np.isfinite(o)).sum() for o in outs)), "max_abs_diff": diff,
            "cpu_max_abs": float(np.abs(c).max()), "within_tolerance": diff is not None and diff <= tol,
            "reruns": len(outs), "distinct_outputs": len({o.tobytes() for o in outs})}


def qmm_sweep(reruns: int, out: Path) -> list[dict]:
    """Every case of QMM_CASES (`qmm_case`); each case is printed as it ends and the partial list rewritten to
    `out`, so a run cut off by its time limit still reports what it reached."""
    cases = []
    for dt, bits, mode, k, m in QMM_CASES:
        ways = ["mlx", "streamoe"] if mode == "affine" and k <= 64 else ["mlx"]
        for through in ways:
            cases.append(qmm_case(dt, bits, mode, k, m, reruns, seed=len(cases), through=through))
            print(json.dumps(cases[-1]), flush=True)
            out.write_text(json.dumps(cases, indent=1) + "\n")
    return cases


def host_bits(arrays: list[mx.array]) -> list[bytes]:
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in arrays]


def cpu_weights(conv: Path, dtype: str) -> list[bytes]:
    """Every weight array of the model as the CPU backend loads it: what the GPU's load must equal bit for bit."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        eng = Engine(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, dtype=dtype))
        bits = host_bits(weight_arrays(eng.model))
        eng.close()
    finally:
        mx.set_default_device(device)
    return bits


def run(conv: Path, dtype: str, steps: int, reference: list[bytes]) -> dict:
    """Prefill and `steps` greedy steps: which logits are finite, and which weight arrays differ from the CPU's
    load (a wrong load shows up there, not in a kernel replay: both sides would read the same wrong weights)."""
    eng = Engine(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, dtype=dtype))
    arrays = weight_arrays(eng.model)
    differ = [f"{i}: {a.dtype} {tuple(a.shape)}" for i, (a, b, r) in
              enumerate(zip(arrays, host_bits(arrays), reference, strict=True)) if b != r]
    logits = [eng.prefill(eng.text.encode(PROMPT))]
    for _ in range(steps):
        logits.append(eng.forward([int(as_f32(logits[-1]).argmax())], "decode"))
    eng.close()
    finite = [bool(np.isfinite(as_f32(x)).all()) for x in logits]
    return {"finite_prefill": finite[0], "finite_steps": sum(finite[1:]), "steps": steps,
            "weights_unlike_cpu_load": differ}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gpt_oss", choices=sorted(VARIANT))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="runs compiled and uncompiled (a race shows in some only)")
    ap.add_argument("--rtol", type=float, default=1e-3, help="a difference beyond rtol x the CPU output's largest")
    ap.add_argument("--name", default="device-vs-cpu")
    ap.add_argument("--qmm-sweep", action="store_true", help="only quantized_matmul alone over shapes and dtypes")
    ap.add_argument("--reruns", type=int, default=30, help="--qmm-sweep: the same GPU call this many times a case")
    a = ap.parse_args()
    out = Path(a.name)
    if a.qmm_sweep:
        cases = qmm_sweep(a.reruns, out.with_suffix(".partial.json"))
        bad = [c for c in cases if c["nonfinite_on_gpu"] or not c["within_tolerance"] or c["distinct_outputs"] > 1]
        write_result(out.name, "device_vs_cpu", [{"device": str(mx.default_device()), "qmm_cases": len(cases),
                                                  "qmm_bad": bad}], out=out.with_suffix(".json"))
        out.with_suffix(".partial.json").unlink()
        return
    d = Path(tempfile.mkdtemp())
    synth(d / "ck", size="tiny", variant=VARIANT[a.family], text_only=True, seed=3, shard_bytes=None, dry_run=False,
          family=a.family)
    convert(d / "ck", d / "conv", progress=False)
    result = {"family": a.family, "dtype": a.dtype, "device": str(mx.default_device())}
    reference = cpu_weights(d / "conv", a.dtype)
    result["compiled"] = [run(d / "conv", a.dtype, a.steps, reference) for _ in range(a.repeats)]
    mx.disable_compile()
    result["uncompiled"] = [run(d / "conv", a.dtype, a.steps, reference) for _ in range(a.repeats)]
    with Replay(out, a.rtol) as rep:
        result["replayed"] = run(d / "conv", a.dtype, a.steps, reference)
    result |= {"calls_replayed": rep.calls, "first_bad": rep.first_bad, "inputs_saved": rep.saved and str(rep.saved)}
    print(write_result(out.name, "device_vs_cpu", [result], out=out.with_suffix(".json")))


if __name__ == "__main__":
    main()
