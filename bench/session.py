"""Session files: size, save and load time for a conversation of N tokens, and that a loaded session saves
back to the same bytes.

    python -m bench.session --model /var/tmp/streamoe-bench/full-conv-q4-q3 --tokens 154 --cap 4
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from .common import scratch_dir, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="converted directory")
    ap.add_argument("--tokens", type=int, default=154, help="conversation length (random token ids)")
    ap.add_argument("--cap", type=float, default=4.0)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--kv", default="float32")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    ap.add_argument("--name", default="session")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        run(a, scratch)


def run(a, scratch: Path) -> None:
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.session import load_session, save_session

    first, second = scratch / "bench-session-a.zst", scratch / "bench-session-b.zst"
    opts = Options(cap_gib=a.cap, ctx=a.ctx, kv=a.kv)
    eng = Engine(a.model, opts)
    ids = np.random.default_rng(0).integers(0, eng.args.vocab_size, a.tokens).tolist()
    t = time.perf_counter()
    eng.prefill(ids)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    size = save_session(eng, first, {})
    save_s = time.perf_counter() - t
    runtime = eng.plan.accounts["runtime"]
    eng.close()
    # reopened in this process: keep the first open's measured allowance (the RSS now counts the first engine)
    eng = Engine(a.model, dataclasses.replace(opts, runtime_bytes=runtime))
    t = time.perf_counter()
    load_session(eng, first)
    load_s = time.perf_counter() - t
    save_session(eng, second, {})
    eng.close()
    same = first.read_bytes() == second.read_bytes()
    res = {"model": str(a.model), "tokens": a.tokens, "kv": a.kv, "cap_gib": a.cap, "file_mib": round(size / 2**20, 2),
           "save_s": round(save_s, 3), "load_s": round(load_s, 3), "prefill_s": round(prefill_s, 2),
           "resave_identical": same}
    for f in (first, second):
        f.unlink()
    write_result(a.name, "session", [res])


if __name__ == "__main__":
    main()
