"""Image path benchmark: encode time and peak memory per image size on the full-size vision tower, and the
prefill of an image turn plus decode speed after it against a text-only turn, on the trained default model.

    python -m bench.vision --model /var/tmp/streamoe-bench/full-conv-q4-q3     # a converted full-size model
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from .common import scratch_dir, write_result

ROOT = Path(__file__).resolve().parents[1]


def picture(path: Path, w: int, h: int) -> Path:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (w, h), (250, 245, 230))
    d = ImageDraw.Draw(im)
    for i in range(6):
        d.ellipse((i * w // 7, i * h // 9, i * w // 7 + w // 6, i * h // 9 + h // 6), fill=(40 * i, 200 - 30 * i, 90))
    im.save(path)
    return path


def encode_sizes(model: Path, scratch: Path) -> list[dict]:
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.image_prompt import encode_image

    eng = Engine(model, Options(cap_gib=64, ctx=4096, images=True, max_pixels=640 * 640))
    out = []
    for w, h in ((224, 224), (448, 336), (640, 640)):
        p = picture(scratch / f"bench-{w}x{h}.png", w, h)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t = time.perf_counter()
        feats, grid = encode_image(eng, p)
        dt = time.perf_counter() - t
        out.append({"kind": "encode", "model": model.name, "image": f"{w}x{h}", "grid": list(grid), "tokens": feats.shape[0],
                    "encode_s": round(dt, 3), "peak_mib_over_base": round((mx.get_peak_memory() - base) / 2**20, 1),
                    "vision_account_mib": round(eng.plan.accounts["vision"] / 2**20, 1)})
        print(out[-1], file=sys.stderr, flush=True)
        del feats
    eng.close()
    return out


def turn_speeds(scratch: Path) -> list[dict]:
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.sampling import Sampler

    conv = scratch / "tiny-q4q3"
    if not (conv / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(ROOT / "models" / "tiny"), str(conv),
                        "--experts", "q4,q3"], check=True)
    pic = picture(scratch / "bench-turn.png", 448, 336)
    out = []
    for kind in ("text", "image"):
        eng = Engine(conv, Options(cap_gib=1, ctx=2048, images=True))
        content = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}] if kind == "image" \
            else "What colour is the shape?"
        ids = eng.text.encode(eng.text.chat_prompt([{"role": "user", "content": content}], think=True))
        t = time.perf_counter()
        toks = list(eng.generate(ids, 48, Sampler(), images=[pic] if kind == "image" else None))
        total = time.perf_counter() - t
        pre = [s for s in eng.steps if s.phase == "prefill"]
        dec = [s for s in eng.steps if s.phase == "decode"]
        out.append({"kind": f"turn-{kind}", "model": "models/tiny", "prompt_tokens": sum(s.n_tokens for s in pre),
                    "prefill_s": round(sum(s.ms for s in pre) / 1000, 3), "wall_s": round(total, 3),
                    "decode_tokens": len(dec), "decode_tok_s": round(len(dec) / (sum(s.ms for s in dec) / 1000), 2) if dec else None,
                    "generated": len(toks)})
        print(out[-1], file=sys.stderr, flush=True)
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="converted full-size model for the encode timings")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        results = turn_speeds(scratch)
        if a.model is not None:
            results = encode_sizes(a.model, scratch) + results
    write_result("vision", "decode", results)


if __name__ == "__main__":
    main()
