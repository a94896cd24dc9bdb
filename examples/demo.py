"""`make demo`: convert the embedded default model and answer under a cap that holds a fraction of its experts.

The embedded default is the tiny Qwen3.5-MoE trained for this project (models/tiny); without it the demo
falls back to a synthetic checkpoint (random weights: the plumbing, not the answers).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".demo"


def sh(*args: str) -> None:
    print(f"\n$ streamoe {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "streamoe.cli", *args], check=True)


def main() -> None:
    from streamoe.runtime.engine import Options, plan_for

    src = ROOT / "models" / "tiny"
    if not (src / "config.json").exists():
        src = WORK / "synth-small"
        if not src.exists():
            sh("synth", str(src), "--size", "small")
    out = WORK / f"{src.name}-streamoe"
    sh("convert", str(src), str(out), "--experts", "q4,q3", "--force")
    sh("validate", str(out), "--source", str(src))
    full = plan_for(out, Options(cap_gib=64, ctx=1024))
    n = full.n_layers * full.n_experts
    cap = (full.fixed + n * full.stride // 4) / 2**30 + 0.05  # about a quarter of the experts (+ runtime slack)
    sh("plan", str(out), "--cap", f"{cap:.3f}", "--ctx", "1024")
    sh("run", str(out), "--cap", f"{cap:.3f}", "--ctx", "1024", "--raw", "-n", "48",
       "-p", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    sh("run", str(out), "--cap", f"{cap:.3f}", "--ctx", "1024", "--experts", "q3", "--no-think", "-n", "32",
       "-p", "What does the Python function len() return?")
    image = ROOT / "examples" / "demo.png"
    if image.exists() and (out / "vision.bin").exists():
        sh("run", str(out), "--cap", f"{cap:.3f}", "--ctx", "1024", "--no-think", "-n", "24", "--image", str(image),
           "-p", "What colour is the shape?")


if __name__ == "__main__":
    main()
