"""Where MLX's CUDA backend keeps a buffer the host wrote, and what that costs: host memory (the process's resident
set) and the device's read speed, against a copy of it computed on the device.

    python -m bench.host_memory [--gib 1] [--name host-memory-h200]

Steps, one buffer of --gib GiB (uint32): made on the device (`mx.zeros`); written by the host through a numpy
view (as `runtime/weights.read_tensor` loads weights); read by the device; copied on the device (an integer add of
zero: the same bits) and the host-written buffer freed. After each, the resident set, and the time of a device
reduction over the buffer (its read speed, GB/s).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from streamoe.runtime.plan import current_rss

from .common import write_result


def read_gbs(a: mx.array, rounds: int = 5) -> float:
    mx.eval(a.sum())
    t = time.perf_counter()
    for _ in range(rounds):
        mx.eval((a & 1).sum())
    return rounds * a.nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--name", default="host-memory")
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // 4
    gib = 1 << 30
    out = {"bytes": 4 * n, "rss_start_gib": round(current_rss() / gib, 3)}
    arr = mx.zeros((n,), dtype=mx.uint32)
    mx.eval(arr)
    out["rss_made_on_device_gib"] = round(current_rss() / gib, 3)
    host = np.asarray(arr)
    host[:] = 7
    out["rss_host_written_gib"] = round(current_rss() / gib, 3)
    out["read_gbs_host_written"] = round(read_gbs(arr), 2)
    out["rss_after_device_reads_gib"] = round(current_rss() / gib, 3)
    copy = (arr.view(mx.uint8) + mx.array(0, dtype=mx.uint8)).view(mx.uint32)
    mx.eval(copy)
    same = bool(mx.array_equal(copy, arr).item())
    del host, arr
    gc.collect()
    mx.synchronize()
    mx.clear_cache()  # MLX keeps freed buffers for reuse: let this one go
    out["rss_device_copy_gib"] = round(current_rss() / gib, 3)
    out["read_gbs_device_copy"] = round(read_gbs(copy), 2)
    out["copy_equal"] = same
    out["device"] = str(mx.default_device())
    print(out)
    write_result(a.name, "host_memory", [out], out=Path(a.name + ".json") if "/" in a.name else None)


if __name__ == "__main__":
    main()
