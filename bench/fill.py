"""The copy of an expert record from host staging into its slot, against the disk read that precedes it.

    python -m bench.fill --model CONVERTED [--experts q4] [--records 512] [--dtype bfloat16] [--name fill-h200]

Same run, same records: (1) random whole-record O_DIRECT reads through `ExpertStore` with 8 in flight, GB/s;
(2) `SlotPools.stage` of records already in staging (through the upload ring, flushed eight at a time as
a layer's misses are, and on the CPU also written straight into the slot), then one eval, GB/s; the ring with the CUDA advice
(`runtime/managed.py`) off and on. A fill should cost a small fraction of the read it follows. (3) The path a host
tier could take without a host copy: records held in MLX arrays advised to stay in host memory, moved into their
slots by the device reading them over the bus (one scatter per segment for a layer's eight, evaluated per layer);
and the bus itself: the device reading 256 MiB of such an array into its own memory. (4) The path with neither a
host copy nor a kernel: CUDA's copy engine moving each segment from host memory straight into its slot's address
(`cuMemcpyHtoDAsync`), from page-locked and from plain pageable memory (as the host tier holds records), the
slots' bytes checked, and a kernel's read of the pools timed against pools the host never touched.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import mlx.core as mx
import numpy as np

from streamoe.formats.direct import aligned_buffer
from streamoe.formats.manifest import load_manifest
from streamoe.runtime import managed
from streamoe.runtime.copy_engine import open_copy_engine
from streamoe.runtime.experts import SlotPools
from streamoe.runtime.store import ExpertStore
from streamoe.runtime.weights import mx_dtype

from .common import write_result


def drain(store: ExpertStore, futures) -> None:
    """Wait for reads as they complete (as the engine does) and give their ring entries back."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            store.release(f.result())


def disk_gbs(store: ExpertStore, keys: list[tuple[int, int]]) -> float:
    t = time.perf_counter()
    drain(store, [store.read(*k) for k in keys])
    return len(keys) * store.lay.stride / (time.perf_counter() - t) / 1e9


def fill_gbs(store: ExpertStore, keys: list[tuple[int, int]], n: int, dtype: mx.Dtype, direct: bool, advise: bool) -> dict:
    """`n` fills cycling over the records of `keys` (read once into private copies) into 64 slots."""
    managed.ENABLED = advise
    records = private_records(store, keys)
    pools = SlotPools(64, store.lay, dtype, store.ring, direct=direct)
    for i in range(2 * store.ring):  # warm-up: kernels compiled, pages placed
        pools.stage(i % 64, memoryview(records[i % len(records)]), lambda: None)
    pools.flush()
    mx.eval(pools.arrays)
    mx.synchronize()
    t = time.perf_counter()
    host = 0.0
    for i in range(n):
        h = time.perf_counter()
        pools.stage(i % 64, memoryview(records[i % len(records)]), lambda: None)
        if i % 8 == 7:  # a layer's misses land together
            pools.flush()
        host += time.perf_counter() - h
    pools.flush()
    mx.eval(pools.arrays)
    mx.synchronize()
    dt = time.perf_counter() - t
    pools.close()
    return {"path": "direct" if pools.direct else "ring", "advice": pools.host_mapped, "fill_gbs": round(n * store.lay.raw_size / dt / 1e9, 3),
            "ms_per_fill": round(1000 * dt / n, 4), "host_ms_per_fill": round(1000 * host / n, 4)}


def private_records(store: ExpertStore, keys: list[tuple[int, int]]) -> list[bytearray]:
    records = []
    for k in keys:
        e = store.read(*k).result()
        records.append(bytearray(store.record(e)))
        store.release(e)
    return records


def hosted_gbs(store: ExpertStore, keys: list[tuple[int, int]], n: int, dtype: mx.Dtype) -> dict:
    """`n` fills of records held in host-mapped MLX arrays (one per segment, the advice of the upload ring) into 64
    slots, the device reading them: eight to a layer, each layer's scatters evaluated before the next."""
    records = private_records(store, keys)
    segs = store.lay.segments
    hosted = [mx.zeros((len(records), sg.nbytes), dtype=mx.uint8) for sg in segs]
    mx.eval(hosted)
    views = [np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).reshape(len(records), -1) for a in hosted]
    mapped = managed.keep_on_host(views)
    for r, rec in enumerate(records):
        raw = np.frombuffer(rec, dtype=np.uint8)
        for v, sg in zip(views, segs, strict=True):
            v[r] = raw[sg.offset:sg.offset + sg.nbytes]
    pools = SlotPools(64, store.lay, dtype, 1, direct=False)

    def land(first: int) -> None:
        idx = mx.array([(first + j) % 64 for j in range(8)], dtype=mx.uint32)
        src = mx.array([(first + j) % len(records) for j in range(8)], dtype=mx.uint32)
        for j, (sg, st) in enumerate(zip(segs, pools.stored, strict=True)):
            pools.arrays[j][idx] = hosted[j][src].view(st).reshape(8, *sg.shape).astype(pools.dtypes[j])
        mx.eval(pools.arrays)

    for i in range(0, 16, 8):  # warm-up
        land(i)
    mx.synchronize()
    t = time.perf_counter()
    for i in range(0, n, 8):
        land(i)
    mx.synchronize()
    dt = time.perf_counter() - t
    pools.close()
    return {"path": "hosted", "advice": mapped, "fill_gbs": round(n * store.lay.raw_size / dt / 1e9, 3),
            "ms_per_fill": round(1000 * dt / n, 4)}


def pools_read_ms(arrays: list[mx.array]) -> float:
    """The best of four reads of every pool by a kernel (a max over its bytes), ms: slow where pages sit on the host."""
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        mx.eval([mx.max(a.view(mx.uint8)) for a in arrays])
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return round(1000 * best, 3)


def driver_gbs(store: ExpertStore, keys: list[tuple[int, int]], n: int, dtype: mx.Dtype, pinned: bool) -> dict:
    """`n` fills by CUDA's copy engine (`runtime/copy_engine.py`): each segment of a record copied from host memory
    to its slot's address, eight records to a layer and one wait each, by `SlotPools.stage_many` as a run lands them.
    `pinned`: the records' buffer page-locked (as the engine holds the staging ring and the host tier), else
    pageable (the driver bounces it through its own pinned buffers). The slots' addresses come from host views
    of the pools, which make MLX's CUDA buffers managed memory: so a kernel's read of the pools is timed before the
    views and after the copies, and the slots' bytes are checked against the records."""
    row = {"path": "driver", "pinned": pinned}
    if mx.default_device() != mx.gpu or not mx.cuda.is_available() or (engine := open_copy_engine()) is None:
        return {**row, "skipped": "no CUDA driver"}
    lay, records = store.lay, private_records(store, keys)
    untouched = SlotPools(64, lay, dtype, 1, direct=False)
    row["pools_read_ms_untouched"] = pools_read_ms(untouched.arrays)
    untouched.close()
    pools = SlotPools(64, lay, dtype, 1, direct=False, engine=engine)
    if pools.engine is None:
        pools.close()
        engine.close()
        return {**row, "skipped": "a segment is widened into its pool (a copy cannot convert)"}
    host = aligned_buffer(len(records) * lay.stride)
    hv = np.frombuffer(host, dtype=np.uint8)
    for r, rec in enumerate(records):
        hv[r * lay.stride: r * lay.stride + len(rec)] = np.frombuffer(rec, dtype=np.uint8)
    try:
        if pinned and not engine.lock(hv.ctypes.data, hv.nbytes):
            return {**row, "error": "cuMemHostRegister refused"}

        def land(first: int) -> None:
            batch = [((first + j) % 64, memoryview(host)[r * lay.stride:(r + 1) * lay.stride], lambda: None)
                     for j in range(8) for r in [(first + j) % len(records)]]
            pools.stage_many(batch)

        mx.synchronize()
        for i in range(0, 16, 8):  # warm-up
            land(i)
        t = time.perf_counter()
        for i in range(0, n, 8):
            land(i)
        dt = time.perf_counter() - t
        land(0)
        got = pools.bytes_at(list(range(8)))
        row["bytes_identical"] = all(g == bytes(records[r][:len(g)]) and len(g) == lay.raw_size
                                     for r, g in enumerate(got))
        row["pools_read_ms_after"] = pools_read_ms(pools.arrays)
    finally:
        pools.close()
        engine.close()
    return {**row, "fill_gbs": round(n * lay.raw_size / dt / 1e9, 3), "ms_per_fill": round(1000 * dt / n, 4)}


def bus_gbs(mib: int = 256) -> dict:
    """The device reading a host-mapped MLX array into its own memory (an elementwise copy), GB/s."""
    a = mx.zeros((mib << 20,), dtype=mx.uint8)
    mx.eval(a)
    mapped = managed.keep_on_host([np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)])
    best = 0.0
    for _ in range(4):
        t = time.perf_counter()
        b = a + 1
        mx.eval(b)
        mx.synchronize()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
        del b
    return {"what": "bus", "advice": mapped, "read_gbs": round(best, 3), "bytes": a.nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--experts", default="q4")
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16" if mx.default_device() == mx.gpu else "float32")
    ap.add_argument("--name", default="fill")
    a = ap.parse_args()
    m = load_manifest(a.model)
    fmt = m.expert_formats()[a.experts]
    lay = fmt.layout
    store = ExpertStore.open(a.model, m, a.experts, io_threads=8, ring=16)
    n_experts = store.n_experts
    rng = random.Random(0)
    keys = [(rng.randrange(len(fmt.files)), rng.randrange(n_experts)) for _ in range(a.records)]
    disk = disk_gbs(store, keys)
    rows = [{"what": "disk", "read_gbs": round(disk, 3), "records": a.records, "record_bytes": lay.stride}]
    variants = [(False, False), (False, True)] + ([(True, False)] if mx.default_device() == mx.cpu else [])
    for direct, advise in variants:
        r = fill_gbs(store, keys[:32], a.records, mx_dtype(a.dtype), direct, advise)
        r["fill_vs_disk"] = round(r["fill_gbs"] / disk, 2)
        rows.append({"what": "fill", "dtype": a.dtype, **r})
    managed.ENABLED = True
    r = hosted_gbs(store, keys[:32], a.records, mx_dtype(a.dtype))
    r["fill_vs_disk"] = round(r["fill_gbs"] / disk, 2)
    rows.append({"what": "fill", "dtype": a.dtype, **r})
    for pinned in (True, False):
        try:
            r = driver_gbs(store, keys[:32], a.records, mx_dtype(a.dtype), pinned)
        except Exception as e:  # noqa: BLE001 - an untried driver path: its failure is a result, the rows above kept
            r = {"path": "driver", "pinned": pinned, "error": f"{type(e).__name__}: {e}"}
        if "fill_gbs" in r:
            r["fill_vs_disk"] = round(r["fill_gbs"] / disk, 2)
        rows.append({"what": "fill", "dtype": a.dtype, **r})
    rows.append(bus_gbs())
    store.close()
    write_result(a.name, "fill", rows)


if __name__ == "__main__":
    main()
