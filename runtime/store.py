"""ExpertStore: expert records read from the layer files straight into MLX memory, bypassing the page cache.

One MLX uint8 array holds every expert slot (hot tier + prefill staging), 4096-aligned so O_DIRECT can
write into it; each slot has nine precomputed zero-copy views (weights, scales, biases of gate/up/down)
that the quantized matmuls read directly. A small thread pool runs the reads (`os.preadv` drops the GIL).
Rule: a slot is never refilled while an unevaluated graph still reads it — the engine evaluates each
layer before its slots can be reused, and the tier never hands out a pinned slot.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.direct import ALIGN, drop_cache, open_uncached
from ..formats.errors import fail
from ..formats.layout import detect_format
from ..formats.record import ExpertWeights, RecordLayout
from .weights import mx_dtype


def aligned_mlx_buffer(nbytes: int) -> tuple[mx.array, np.ndarray, int]:
    """An evaluated MLX uint8 array with a 4096-aligned window of `nbytes`; returns (array, numpy view, offset)."""
    raw = mx.zeros((nbytes + 2 * ALIGN,), mx.uint8)
    mx.eval(raw)
    host = np.asarray(raw)  # writable, zero-copy; keeping it referenced also prevents buffer donation
    off = (-host.ctypes.data) % ALIGN
    return raw, host, off


def record_views(buf: mx.array, base: int, lay: RecordLayout) -> ExpertWeights:
    """The nine arrays of the record at byte `base` of `buf`, as zero-copy MLX views."""
    views = []
    for s in lay.segments:
        v = buf[base + s.offset: base + s.offset + s.nbytes].view(mx_dtype(s.dtype)).reshape(s.shape)
        views.append(v)
    return ExpertWeights(*views)


class SlotPool:
    """`n` expert slots of one record layout in aligned MLX buffers of at most 1 GiB each (an MLX dimension
    is a 32-bit integer, so one array cannot hold a 4 GiB pool)."""

    GROUP_BYTES = 1 << 30

    def __init__(self, n: int, lay: RecordLayout):
        self.n, self.lay = n, lay
        self.per_group = max(1, self.GROUP_BYTES // lay.stride)
        self.groups = []
        self.views: list[ExpertWeights] = []
        for g0 in range(0, max(1, n), self.per_group):
            k = min(self.per_group, max(1, n) - g0)
            raw, host, base = aligned_mlx_buffer(k * lay.stride)
            self.groups.append((raw, host, base))
            self.views += [record_views(raw, base + i * lay.stride, lay) for i in range(k)]
        mx.eval([v for ew in self.views for v in ew])
        self.nbytes = sum(g[0].nbytes for g in self.groups)

    def memory(self, slot: int) -> memoryview:
        _, host, base = self.groups[slot // self.per_group]
        o = base + (slot % self.per_group) * self.lay.stride
        return memoryview(host[o: o + self.lay.stride])


class ExpertStore:
    """The layer files of one expert format, and the I/O pool that reads records into slots."""

    def __init__(self, paths: list[Path], lay: RecordLayout, n_experts: int, layouts: dict[str, RecordLayout], fmt: str,
                 io_threads: int = 4):
        self.lay, self.n_experts = lay, n_experts
        self.fds: list[int] = []
        self.direct: list[bool] = []
        for p in paths:
            if not p.is_file():
                raise fail(p, "missing expert layer file")
            got = detect_format(p, p.stat().st_size, n_experts, layouts, claimed=fmt)
            if got != fmt:
                raise fail(p, f"holds {got} experts by its size, but {fmt} was asked for")
            fd, direct = open_uncached(p)
            self.fds.append(fd)
            self.direct.append(direct)
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="streamoe-io")
        self.bytes_read = 0

    def read_sync(self, layer: int, expert: int, dst: memoryview) -> int:
        off = expert * self.lay.stride
        n = os.preadv(self.fds[layer], [dst], off)
        if not self.direct[layer]:
            drop_cache(self.fds[layer], off, self.lay.stride)
        if n != self.lay.stride:
            raise OSError(f"short read of layer {layer} expert {expert}: {n} bytes")
        return n

    def read(self, layer: int, expert: int, dst: memoryview) -> Future:
        self.bytes_read += self.lay.stride
        return self.pool.submit(self.read_sync, layer, expert, dst)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
