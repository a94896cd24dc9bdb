"""The store's read-ahead against the disk bound, with the engine's I/O pattern and a fixed host gap.

    python -m bench.readahead --model CONVERTED [--experts q4] [--gap-ms 3.8] [--demand 4] [--guesses 3] \
        [--right 0.9] [--tokens 8] [--rounds 3] [--name readahead]

A capped decode step is, per layer: the picks arrive (one sync); the guesses read ahead for this layer that
were picked are waited for (promoted if not started), the misses are read on demand, and guesses for the
next layer are queued; once this layer's reads are in, the host lands them and computes (the gap) before the
next layer's picks arrive. This replays that with real O_DIRECT reads through `ExpertStore` and a sleep for
the gap (3.8 ms: the host and device time per layer of a full-size `--cap 4` step on the H200, docs/performance.md),
`--demand` misses and `--guesses` guesses per layer of which a fraction `--right` is picked, random records.
Two schedules, interleaved over `--rounds`: guesses yield to demand reads (the store's default) and guesses
at the demand reads' priority (the older schedule). Each reports ms per layer against the disk bound: the
bytes the layer needs (misses + right guesses) at the raw random-read speed with 8 reads in flight,
measured right before and after each run.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from streamoe.formats.manifest import load_manifest
from streamoe.runtime import store as store_mod
from streamoe.runtime.store import ExpertStore

from .common import write_result
from .fill import disk_gbs, drain


def keys(store: ExpertStore, rng: random.Random, n: int = 256) -> list[tuple[int, int]]:
    return [(rng.randrange(len(store.fds)), rng.randrange(store.n_experts)) for _ in range(n)]


def replay(store: ExpertStore, rng: random.Random, a) -> float:
    """Seconds for `a.tokens` decode steps of the engine's I/O pattern."""
    L, E = len(store.fds), store.n_experts
    ahead: list = []  # (future, picked) of guesses for the layer about to be reached
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        for i in range(L):
            wanted = []
            for f, picked in ahead:
                if picked:
                    store.promote(f)
                    wanted.append(f)
                elif not store.cancel(f):
                    f.add_done_callback(lambda f: store.release(f.result()))
            wanted += [store.read(i, rng.randrange(E)) for _ in range(a.demand)]
            nxt = (i + 1) % L
            ahead = [(store.guess(nxt, rng.randrange(E)), rng.random() < a.right) for _ in range(a.guesses)]
            drain(store, wanted)
            time.sleep(a.gap_ms / 1000)
    for f, _ in ahead:
        if not store.cancel(f):
            store.release(f.result())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--gap-ms", type=float, default=3.8)
    ap.add_argument("--demand", type=int, default=4)
    ap.add_argument("--guesses", type=int, default=3)
    ap.add_argument("--right", type=float, default=0.9)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--name", default="readahead")
    a = ap.parse_args()
    root = Path(a.model)
    m = load_manifest(root)
    fmt = m.expert_formats()[a.experts]
    lay, n_layers = fmt.layout, len(fmt.files)
    rng = random.Random(0)
    rows = []
    for r in range(a.rounds):
        for wait_ in (True, False):
            store_mod.GUESSES_WAIT = wait_
            store = ExpertStore.open(root, m, a.experts, a.io_threads, ring=2 * a.demand + 2 * a.guesses + a.io_threads)
            before = disk_gbs(store, keys(store, rng))
            s = replay(store, rng, a)
            after = disk_gbs(store, keys(store, rng))
            store.close()
            layers = a.tokens * n_layers
            need = (a.demand + a.right * a.guesses) * lay.stride  # bytes a layer needs, on average
            bound_ms = need / ((before + after) / 2 * 1e9) * 1000
            ms = s / layers * 1000
            rows.append({"round": r, "guesses": "yield to demand" if wait_ else "demand priority",
                         "ms_layer": round(ms, 2), "disk_bound_ms_layer": round(bound_ms, 2),
                         "of_disk_bound": round(bound_ms / ms, 3), "disk_gbs_before_after": [round(before, 3), round(after, 3)],
                         "record_bytes": lay.stride, "gap_ms": a.gap_ms, "demand": a.demand, "guesses_per_layer": a.guesses,
                         "right": a.right, "io_threads": a.io_threads})
            print(rows[-1], flush=True)
    store_mod.GUESSES_WAIT = True
    write_result(a.name, "readahead", rows)


if __name__ == "__main__":
    main()
