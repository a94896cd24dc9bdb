"""Packed 3-bit (the exact shift) against 4-bit experts: KL divergence and top-1 agreement of the next-token
distributions on held-out text, teacher-forced through the streaming engine, on the trained default model.

    python -m bench.q3_quality --tokens 1024
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import scratch_dir, write_result

ROOT = Path(__file__).resolve().parents[1]


def heldout_text(limit_chars: int) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_common", ROOT / "examples" / "train_tiny" / "common.py")
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    text = []
    for rel, path in tc.stdlib_files():
        if tc.is_heldout(rel):
            text.append(path.read_text(errors="replace"))
        if sum(map(len, text)) > limit_chars:
            break
    return "".join(text)[:limit_chars]


def logits_of(conv: Path, experts: str, ids: list[int]) -> np.ndarray:
    from streamoe.runtime.engine import Engine, Options

    eng = Engine(conv, Options(cap_gib=1.0, ctx=len(ids) + 8, experts=experts))
    out = [np.array(eng.prefill(ids[:1]))]
    for t in ids[1:-1]:
        out.append(np.array(eng.forward([t], "decode")))
    eng.close()
    return np.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        run(a, scratch)


def run(a, scratch: Path) -> None:
    conv = scratch / f"{a.model.name}-q4q3"
    # converted afresh every time (seconds for the tiny model): a kept conversion may be of older weights
    subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(a.model), str(conv), "--experts", "q4,q3",
                    "--force"], check=True)
    from streamoe.formats.manifest import load_manifest
    from streamoe.runtime.text import TextIO

    text = TextIO(conv, load_manifest(conv).config)
    ids = text.encode(heldout_text(a.tokens * 8))[: a.tokens + 1]
    l4, l3 = logits_of(conv, "q4", ids), logits_of(conv, "q3", ids)

    def logp(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p4, p3 = logp(l4), logp(l3)
    kl = (np.exp(p4) * (p4 - p3)).sum(-1)
    target = np.array(ids[1:len(l4) + 1])
    res = {"model": str(a.model.relative_to(ROOT)) if a.model.is_relative_to(ROOT) else str(a.model), "tokens": len(l4),
           "kl_mean": round(float(kl.mean()), 5), "kl_p99": round(float(np.quantile(kl, 0.99)), 5),
           "top1_agreement": round(float((l4.argmax(-1) == l3.argmax(-1)).mean()), 4),
           "nll_q4": round(float(-p4[np.arange(len(target)), target].mean()), 4),
           "nll_q3": round(float(-p3[np.arange(len(target)), target].mean()), 4),
           "accuracy_q4": round(float((l4.argmax(-1) == target).mean()), 4),
           "accuracy_q3": round(float((l3.argmax(-1) == target).mean()), 4)}
    res["ppl_q4"], res["ppl_q3"] = round(float(np.exp(res["nll_q4"])), 3), round(float(np.exp(res["nll_q3"])), 3)
    write_result("q3-quality-tiny", "quality", [res])


if __name__ == "__main__":
    main()
