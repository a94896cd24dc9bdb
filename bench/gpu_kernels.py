"""A resident decode step's kernels as the GPU runs them, each engine's, timed by Nsight Compute: whether a token
is the device's time or the host's, and which kernels the device's time goes to.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --cache-control none --clock-control none \
        --csv --print-units base --log-file S.csv python -m bench.gpu_kernels --engine streamoe --ckpt C --model M
    (the same with --engine mlx_lm into R.csv)
    python -m bench.gpu_kernels --parse streamoe=S.csv mlx_lm=R.csv --out R.json

Run under ncu, one engine a process: it feeds a short prompt token by token, decodes `--warm` greedy tokens pipelined
as stock mlx-lm's `generate_step` is (kernels compiled, graphs cached), then profiles `--steps` more (the driver's
`cuProfilerStart`/`Stop`: ncu records nothing outside them). Each kernel is timed alone (ncu serializes them),
so the sum is the device's busy time a token without the gaps between kernels; against the token's wall clock
(`bench/gpu_parts.py`'s rounds) it says which side bounds decode.

`--parse` reads the logs: per engine, kernels and device ms a step, and the kernels by name, largest first.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import re
from pathlib import Path


def profiler(on: bool) -> None:
    """The driver's profiler range (ncu's --profile-from-start off records inside it only)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuProfilerStart() if on else cuda.cuProfilerStop()
    if rc:
        raise SystemExit(f"cuProfiler{'Start' if on else 'Stop'} returned CUDA error {rc}")


def decode(engine: str, ckpt: Path, model: Path, experts: str, warm: int, steps: int, setting: str = "as_is") -> None:
    import contextlib

    import mlx.core as mx

    ids = list(range(100, 116))
    if engine == "mlx_lm":
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model

        ref, _ = load_model(ckpt)
        ref.set_dtype(mx.bfloat16)
        cache = make_prompt_cache(ref)
        for t in ids:
            logits = ref(mx.array([[t]]), cache=cache)[0, -1]

        def step(y):
            return ref(y.reshape(1, 1), cache=cache)[0, -1]
    else:
        from streamoe.runtime.engine import Engine, Options

        eng = Engine(model, Options(cap_gib=64, ctx=2048, experts=experts, runtime_bytes=600 << 20))
        from bench.gpu_parts import variant

        stack = contextlib.ExitStack()
        stack.enter_context(variant(setting, eng))  # held to the process's end
        for t in ids:
            logits = eng.decode(t)

        def step(y):
            return eng._step(eng.model.embed(y.reshape(1, 1).astype(mx.uint32)), "decode")

    y = mx.argmax(logits)
    mx.async_eval(y)
    for i in range(warm + steps):
        if i == warm:
            y.item()
            profiler(True)
        y_next = mx.argmax(step(y))
        mx.async_eval(y_next)
        y.item()
        y = y_next
    y.item()
    profiler(False)


def short(name: str) -> str:
    """A kernel's name without its template arguments' noise: what it is, in one line."""
    name = re.sub(r"\(.*$", "", name)  # the argument list
    name = re.sub(r"^void ", "", name)
    return name[:160]


def parse(path: Path, steps: int) -> dict:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    by_name: dict[str, list[float]] = {}
    for r in rows:
        by_name.setdefault(short(r["Kernel Name"]), []).append(float(r["Metric Value"].replace(",", "")) / 1e6)
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "kernels_per_step": round(len(rows) / steps, 1),
        "device_ms_per_step": round(total / steps, 3),
        "mean_kernel_us": round(total / max(len(rows), 1) * 1e3, 2),
        "by_name": [{"kernel": k, "per_step": round(len(v) / steps, 1), "ms_per_step": round(sum(v) / steps, 4),
                     "share": round(sum(v) / total, 4)} for k, v in top[:40]],
    }


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive number of steps")
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("streamoe", "mlx_lm"))
    ap.add_argument("--ckpt", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--variant", default="as_is", help="streamoe: one of bench/gpu_parts.py's settings (experts_qmv, ...)")
    ap.add_argument("--steps", type=positive, default=1, metavar="N", help="decode steps profiled (and in the logs)")
    ap.add_argument("--parse", nargs="+", metavar="ENGINE=CSV", help="the logs ncu wrote, one per engine")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.parse and not all("=" in p for p in a.parse):
        ap.error("--parse takes ENGINE=CSV pairs (streamoe=S.csv mlx_lm=R.csv)")
    if not a.parse and not (a.engine and a.ckpt and a.model):
        ap.error("--engine, --ckpt and --model are needed to profile (or --parse ENGINE=CSV ...)")
    if a.parse:
        from bench.common import machine

        res = {"machine": machine(), "steps": a.steps,
               **{k: parse(Path(v), a.steps) for k, v in (p.split("=", 1) for p in a.parse)}}
        text = json.dumps(res, indent=2)
        print(text)
        if a.out:
            a.out.write_text(text + "\n")
        return
    decode(a.engine, a.ckpt, a.model, a.experts, a.warm, a.steps, a.variant)


if __name__ == "__main__":
    main()
