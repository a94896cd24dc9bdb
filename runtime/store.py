"""ExpertStore: expert records read from the layer files into host staging this process owns.

The disk never writes into memory a device may be using: every record lands, with one page-cache-free
read, in an entry of a small ring of page-aligned host buffers (anonymous mmap, never seen by MLX), and
the slot pools copy it from there (`runtime/experts.py`). That is what keeps a CUDA device's managed
memory out of the DMA path (O_DIRECT into managed pages that a kernel touches loses pages), and it costs
one memcpy per record, far below the read itself.

A read waits for a free ring entry inside its I/O thread, so any number of reads can be queued while the
staging memory stays at `ring` records: the consumer fills a slot from an entry and releases it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..formats.direct import aligned_buffer, drop_cache, open_uncached
from ..formats.errors import fail
from ..formats.layout import detect_format
from ..formats.record import RecordLayout


class ExpertStore:
    """The layer files of one expert format, an I/O thread pool, and the host staging ring."""

    def __init__(self, paths: list[Path], lay: RecordLayout, n_experts: int, layouts: dict[str, RecordLayout], fmt: str,
                 io_threads: int, ring: int):
        self.lay, self.n_experts, self.paths = lay, n_experts, list(paths)
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
        self.ring = max(ring, io_threads)
        self.buf = aligned_buffer(self.ring * lay.stride)
        self.view = memoryview(self.buf)
        self.free = list(range(self.ring))
        self.cond = threading.Condition()
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="streamoe-io")
        self.bytes_read = 0

    def record(self, entry: int) -> memoryview:
        """The bytes of the record held in ring entry `entry`."""
        s = self.lay.stride
        return self.view[entry * s: (entry + 1) * s]

    def release(self, entry: int) -> None:
        with self.cond:
            self.free.append(entry)
            self.cond.notify()

    def _read(self, layer: int, expert: int) -> int:
        with self.cond:
            while not self.free:
                self.cond.wait()
            entry = self.free.pop()
        try:
            off = expert * self.lay.stride
            n = os.preadv(self.fds[layer], [self.record(entry)], off)
            if not self.direct[layer]:
                drop_cache(self.fds[layer], off, self.lay.stride)
            if n != self.lay.stride:
                raise fail(self.paths[layer], f"short read of expert {expert}: {n} of {self.lay.stride} bytes "
                                              "(the file changed since it was opened?)")
        except BaseException:
            self.release(entry)
            raise
        return entry

    def read(self, layer: int, expert: int) -> Future:
        """Start reading one record; the future's result is the ring entry holding it (release it after use)."""
        self.bytes_read += self.lay.stride
        return self.pool.submit(self._read, layer, expert)

    def cancel(self, fut: Future) -> bool:
        """Withdraw a read that has not started (its bytes are then not counted)."""
        if fut.cancel():
            self.bytes_read -= self.lay.stride
            return True
        return False

    def read_bytes(self, layer: int, expert: int) -> bytes:
        """One record through a plain buffered read, bypassing the ring (the verification mode's reference)."""
        s = self.lay.stride
        with open(self.paths[layer], "rb") as f:
            f.seek(expert * s)
            return f.read(self.lay.raw_size)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
