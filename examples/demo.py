"""`make demo`: convert the embedded default model and answer under a cap that holds a fraction of its experts.

The embedded default is the tiny Qwen3.5-MoE trained for this project (models/tiny); without it the demo
falls back to a synthetic checkpoint (random weights: the plumbing, not the answers).
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".demo"
RUNTIME_MIB = 192


def sh(*args: str) -> None:
    print(f"\n$ streamoe {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "streamoe.cli", *args], check=True)


def quarter(out: Path, images: bool = False) -> tuple[float, list[str], int]:
    """A cap whose hot tier holds about a quarter of the experts (a MiB above it, for the accounts that grow with
    the tier), in whole hundredths of a GiB as the plan prints a cap, so its total and cap agree on screen: the
    rounding's whole MiB go to the runtime allowance, not the tier. The cap, the allowance's flags, the experts."""
    from streamoe.runtime.engine import Options, plan_for

    full = plan_for(out, Options(cap_gib=64, ctx=1024, images=images, runtime_bytes=RUNTIME_MIB << 20))
    n = full.n_layers * full.n_experts
    exact = full.fixed + n * full.stride // 4 + (1 << 20)
    cap = math.ceil(exact * 100 / 2**30) / 100
    runtime = RUNTIME_MIB + int((cap * 2**30 - exact) // (1 << 20))
    return cap, ["--runtime-mib", str(runtime)], n  # a fixed allowance, so the cap holds what it says


def main() -> None:
    src = ROOT / "models" / "tiny"
    if not (src / "config.json").exists():
        src = WORK / "synth-small"
        if not src.exists():
            sh("synth", str(src), "--size", "small")
    out = WORK / f"{src.name}-streamoe"
    sh("convert", str(src), str(out), "--experts", "q4,q3", "--force")
    sh("validate", str(out), "--source", str(src))
    cap, allowance, n = quarter(out)
    sh("plan", str(out), "--cap", f"{cap:.2f}", "--ctx", "1024", *allowance)
    caps = f"{cap:.2f} GiB"
    sh("run", str(out), "--cap", f"{cap:.2f}", "--ctx", "1024", "--temp", "0", *allowance, "--raw", "-n", "48",
       "-p", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    sh("run", str(out), "--cap", f"{cap:.2f}", "--ctx", "1024", "--temp", "0", *allowance, "--experts", "q3", "--raw", "-n", "48",
       "-p", "import os\nimport sys\n\n\ndef main(argv):\n")
    if (out / "vision.bin").exists():
        from PIL import Image, ImageDraw

        image = WORK / "orange-triangle.png"  # drawn like the training images: one shape in a quadrant
        im = Image.new("RGB", (160, 128), "white")
        ImageDraw.Draw(im).polygon([(112, 22), (129.1, 53.5), (94.9, 53.5)], fill=(245, 130, 15))
        im.save(image)
        cap, allowance, _ = quarter(out, images=True)
        caps += f", {cap:.2f} with the vision tower"
        for question in ("What shape is in the image?", "What colour is the shape?", "Where is the shape?"):
            sh("run", str(out), "--cap", f"{cap:.2f}", "--ctx", "1024", "--temp", "0", *allowance, "--no-think", "-n", "16",
               "--image", str(image), "-p", question)
    print(f"\ndemo done: {src.relative_to(ROOT)} converted into {out.relative_to(ROOT)} (q4 and q3 experts), then "
          f"answered under caps that hold about a quarter of its {n} experts ({caps}); each "
          "bracketed line is that run's summary (tok/s by wall clock, hit rate, bytes read, peak memory against the "
          "cap). Next: `.venv/bin/streamoe serve` on the same directory (README, Serving).")


if __name__ == "__main__":
    main()
