"""Quantized KV caches (`--kv q8`, `--kv q4`) against the compute-dtype cache: KL divergence and top-1
agreement of the next-token distributions over a long held-out text, teacher-forced token by token through
the streaming engine (every step attends to the whole context so far), on the trained default model.

    python -m bench.kv_quality --tokens 2048
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import scratch_dir, write_result
from .q3_quality import heldout_text

ROOT = Path(__file__).resolve().parents[1]


def logits_of(conv: Path, kv: str, ids: list[int], chunk: int, dtype: str | None = None) -> np.ndarray:
    """Logits after every token of ids[:-1]: the first `chunk` tokens as a prefill, then one token a step."""
    import mlx.core as mx

    from streamoe.runtime.engine import Engine, Options

    eng = Engine(conv, Options(cap_gib=1.0, ctx=len(ids) + 8, experts="q4", kv=kv, prefill_chunk=chunk, dtype=dtype))
    out = []
    for i in range(1, chunk + 1):  # the prefix one prefill at a time, so every position's logits are seen
        eng.reset()
        out.append(np.array(eng.prefill(ids[:i]).astype(mx.float32)))
    for t in ids[chunk:-1]:
        out.append(np.array(eng.decode(t).astype(mx.float32)))
    eng.close()
    return np.stack(out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray, target: np.ndarray) -> dict:
    pr, pg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(pr) * (pr - pg)).sum(-1)
    n = len(target)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "top1_agreement_last_quarter": float((ref[-n // 4:].argmax(-1) == got[-n // 4:].argmax(-1)).mean()),
            "nll": float(-pg[np.arange(n), target].mean()), "max_abs_logit_diff": float(np.abs(ref - got).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=16, help="leading tokens fed as prefills (the L>1 attention path)")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: float32 on the CPU, bfloat16 on GPUs)")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory)")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        conv = scratch / f"{a.model.name}-q4"
        subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(a.model), str(conv), "--experts", "q4",
                        "--force"], check=True)
        from streamoe.formats.manifest import load_manifest
        from streamoe.runtime.plan import Options, kv_format
        from streamoe.runtime.text import TextIO

        text = TextIO(conv, load_manifest(conv).config)
        ids = text.encode(heldout_text(a.tokens * 8))[: a.tokens + 1]
        base = kv_format(Options(dtype=a.dtype))
        ref = logits_of(conv, base, ids, a.prefill, a.dtype)
        target = np.array(ids[1:len(ref) + 1])
        results = []
        for kv in ("q8", "q4"):
            row = {"model": str(a.model.relative_to(ROOT)) if a.model.is_relative_to(ROOT) else str(a.model),
                   "kv": kv, "reference_kv": base, "tokens": len(ref), "nll_reference": float(
                       -log_softmax(ref)[np.arange(len(target)), target].mean())}
            row.update(compare(ref, logits_of(conv, kv, ids, a.prefill, a.dtype), target))
            results.append({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
        write_result("kv-quality" if base == "float32" else f"kv-quality-{base}", "quality", results)


if __name__ == "__main__":
    main()
