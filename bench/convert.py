"""Converter benchmark: peak RSS, wall time and GB/s against the raw O_DIRECT read speed of the same shards
(measured in the same run), page-cache growth, and output sizes.

    python -m bench.convert --size full --scratch /var/tmp/streamoe-bench      # 19 GiB synthetic checkpoint, kept
    python -m bench.convert --size small                                          # seconds, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import drop_files, meminfo, raw_copy_gbs, raw_read_gbs, scratch_dir, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small", "full"], default="small")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    ap.add_argument("--experts", default="q4", help="q4 or q4,q3")
    ap.add_argument("--keep", action="store_true", help="keep the converted directory (in --scratch)")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        run(a, scratch)


def run(a, scratch: Path) -> None:
    ckpt = scratch / f"{a.size}-ckpt"
    if not (ckpt / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "streamoe.cli", "synth", str(ckpt), "--size", a.size], check=True)
    shards = sorted(ckpt.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in shards)
    out = scratch / f"{a.size}-conv-{a.experts.replace(',', '-')}"
    shutil.rmtree(out, ignore_errors=True)

    drop_files(shards)
    raw = raw_read_gbs(shards)
    drop_files(shards)
    copy = raw_copy_gbs(shards, scratch / "copy-probe.bin")
    drop_files(shards)
    cached0 = meminfo("Cached")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", "convert", str(ckpt), str(out), "--experts", a.experts],
                       stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"convert failed ({p.returncode})")
    cached1 = meminfo("Cached")
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    m = json.loads((out / "manifest.json").read_text())
    sizes = {f: sum(x["size"] for x in e["files"]) for f, e in m["experts"].items()}
    res = {
        "size": a.size, "experts": a.experts, "source_bytes": src_bytes, "wall_s": round(wall, 2),
        "convert_gbs": round(src_bytes / wall / 1e9, 3), "raw_odirect_gbs": round(raw, 3),
        "ratio_to_raw": round(src_bytes / wall / 1e9 / raw, 3), "raw_odirect_copy_gbs": round(copy, 3),
        "ratio_to_copy": round(src_bytes / wall / 1e9 / copy, 3), "peak_rss_gib": round(peak_rss / 2**30, 3),
        "page_cache_growth_gib": round((cached1 - cached0) / 2**30, 3),
        "expert_gib": {f: round(v / 2**30, 3) for f, v in sizes.items()},
        "record_bytes": {f: e["stride"] for f, e in m["experts"].items()},
        "nonexpert_gib": round(m["blobs"]["nonexpert"]["file"]["size"] / 2**30, 3),
    }
    write_result(f"convert-{a.size}", "convert", [res])
    if not a.keep:
        shutil.rmtree(out)
    os.sync()


if __name__ == "__main__":
    main()
